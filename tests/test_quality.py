"""NE and AUC against hand computations, brute force, and torchrec's NE."""

from __future__ import annotations

import math

import pytest
import torch

from gemctl.metrics.quality import auc, log_loss, normalized_entropy

# ----------------------------------------------------------------------------------------------
# Normalized entropy.


def test_ne_hand_computed():
    preds = [0.9, 0.2, 0.6, 0.4]
    labels = [1, 0, 0, 1]
    # Log loss: -(1/4) [log 0.9 + log 0.8 + log 0.4 + log 0.4]
    ce = -(math.log(0.9) + math.log(1 - 0.2) + math.log(1 - 0.6) + math.log(0.4)) / 4
    p = 2 / 4
    base = -(p * math.log(p) + (1 - p) * math.log(1 - p))  # = log 2
    assert base == pytest.approx(math.log(2))
    assert log_loss(preds, labels) == pytest.approx(ce, rel=1e-12)
    assert normalized_entropy(preds, labels) == pytest.approx(ce / base, rel=1e-12)
    assert normalized_entropy(preds, labels) == pytest.approx(0.7794468445, rel=1e-9)


def test_ne_hand_computed_weighted():
    preds = [0.9, 0.2, 0.6, 0.4]
    labels = [1, 0, 0, 1]
    weights = [2.0, 1.0, 0.5, 1.5]
    w = sum(weights)  # 5
    ce = -(2.0 * math.log(0.9) + 1.0 * math.log(0.8) + 0.5 * math.log(0.4) + 1.5 * math.log(0.4)) / w
    p = (2.0 + 1.5) / w  # 0.7
    base = -(p * math.log(p) + (1 - p) * math.log(1 - p))
    assert normalized_entropy(preds, labels, weights) == pytest.approx(ce / base, rel=1e-12)
    assert log_loss(preds, labels, weights) == pytest.approx(ce, rel=1e-12)
    # Integer weights are the same as repeating the samples.
    rep_p = [0.9, 0.9, 0.2, 0.6, 0.4, 0.4, 0.4]
    rep_y = [1, 1, 0, 0, 1, 1, 1]
    rep_w = [1, 1, 1, 0.5, 0.5, 0.5, 0.5]
    assert normalized_entropy(rep_p, rep_y, rep_w) == pytest.approx(ce / base, rel=1e-12)
    # Weights change the answer (not ignored).
    assert abs(normalized_entropy(preds, labels) - ce / base) > 1e-3


def test_ne_of_the_background_rate_is_one():
    labels = torch.tensor([1, 0, 0, 0, 1, 0, 0, 0, 0, 0], dtype=torch.float32)
    p = float(labels.mean())  # 0.2
    preds = torch.full_like(labels, p)
    assert normalized_entropy(preds, labels) == pytest.approx(1.0, abs=1e-12)
    weights = torch.tensor([3.0, 1, 1, 1, 1, 1, 2, 1, 1, 1])
    pw = float((weights * labels).sum() / weights.sum())  # 4 / 13
    assert normalized_entropy(torch.full_like(labels, pw), labels, weights) == pytest.approx(1.0, abs=1e-12)
    # Any other constant is worse.
    assert normalized_entropy(torch.full_like(labels, 0.3), labels) > 1.0


def test_ne_of_near_perfect_predictions_is_near_zero():
    labels = torch.tensor([1.0, 0.0] * 50, dtype=torch.float64)
    preds = torch.where(labels > 0, torch.tensor(1 - 1e-6, dtype=torch.float64), torch.tensor(1e-6, dtype=torch.float64))
    ne = normalized_entropy(preds, labels)
    assert 0 < ne < 1e-5
    assert ne == pytest.approx(-math.log(1 - 1e-6) / math.log(2), rel=1e-9)


def test_ne_clamps_certain_wrong_predictions():
    # A prediction of exactly 0 for a positive is clamped (finite, large), not inf.
    ne = normalized_entropy([0.0, 0.5], [1, 0])
    assert math.isfinite(ne) and ne > 10


def test_python_floats_are_not_rounded_through_float32():
    # 0.1 in float32 is 0.100000001490116...; the metric must see the float64 value.
    q = 0.1
    assert log_loss([q, q], [1, 0]) == pytest.approx(-(math.log(q) + math.log(1 - q)) / 2, rel=1e-15)


@pytest.mark.parametrize("label", [0.0, 1.0])
def test_ne_one_class_is_nan(label):
    assert math.isnan(normalized_entropy([0.1, 0.5, 0.9], [label] * 3))
    # Weights that zero out one class also leave one class.
    assert math.isnan(normalized_entropy([0.1, 0.9], [1 - label, label], [0.0, 1.0]))


def test_ne_shape_mismatch():
    with pytest.raises(ValueError, match="same number of elements"):
        normalized_entropy([0.1, 0.2], [1, 0, 1])


# ----------------------------------------------------------------------------------------------
# AUC.


def test_auc_perfect_reversed_tied():
    labels = [0, 0, 1, 1, 0, 1]
    assert auc([0.1, 0.2, 0.8, 0.9, 0.3, 0.7], labels) == 1.0
    assert auc([0.9, 0.8, 0.2, 0.1, 0.7, 0.3], labels) == 0.0
    assert auc([0.5] * 6, labels) == 0.5


def test_auc_hand_counted_with_ties():
    scores = [0.1, 0.4, 0.4, 0.4, 0.8, 0.8, 0.3]
    labels = [0, 1, 0, 0, 1, 0, 1]
    # Positives: 0.4, 0.8, 0.3; negatives: 0.1, 0.4, 0.4, 0.8 -> 3 x 4 = 12 pairs.
    # 0.4: beats 0.1 (1), ties 0.4, 0.4 (2 x 1/2), loses to 0.8      -> 2
    # 0.8: beats 0.1, 0.4, 0.4 (3), ties 0.8 (1/2)                   -> 3.5
    # 0.3: beats 0.1 (1), loses to the rest                          -> 1
    assert auc(scores, labels) == pytest.approx((2 + 3.5 + 1) / 12, abs=1e-15)


def test_auc_hand_counted_weighted():
    scores = [0.2, 0.6, 0.6, 0.9]
    labels = [0, 1, 0, 1]
    weights = [1.0, 2.0, 3.0, 0.5]
    # Pair weight w_pos * w_neg. Positive 0.6 (w 2): beats 0.2 (1) -> 2*1; ties 0.6 (3) -> 2*3/2.
    # Positive 0.9 (w 0.5): beats both -> 0.5 * (1 + 3).
    wins = 2 * 1 + 2 * 3 / 2 + 0.5 * 4
    assert auc(scores, labels, weights) == pytest.approx(wins / (2.5 * 4), abs=1e-15)


def test_auc_one_class_is_nan():
    assert math.isnan(auc([0.1, 0.2], [1, 1]))
    assert math.isnan(auc([0.1, 0.2], [0, 0]))


def brute_force_auc(scores, labels, weights=None):
    n = len(scores)
    weights = [1.0] * n if weights is None else weights
    wins = total = 0.0
    for i in range(n):
        if labels[i] != 1:
            continue
        for j in range(n):
            if labels[j] != 0:
                continue
            w = weights[i] * weights[j]
            total += w
            if scores[i] > scores[j]:
                wins += w
            elif scores[i] == scores[j]:
                wins += 0.5 * w
    return wins / total


def test_auc_matches_brute_force_with_many_ties():
    g = torch.Generator().manual_seed(0)
    n = 1000
    labels = (torch.rand(n, generator=g) < 0.3).to(torch.float64)
    scores = (0.35 * labels + 0.8 * torch.rand(n, generator=g)).mul(10).round().div(10)  # 1 decimal
    assert scores.unique().numel() <= 12  # many ties
    s, y = scores.tolist(), labels.tolist()
    expected = brute_force_auc(s, y)
    assert 0.6 < expected < 0.95
    assert auc(scores, labels) == pytest.approx(expected, abs=1e-12)
    weights = torch.randint(1, 4, (n,), generator=g).to(torch.float64)
    assert auc(scores, labels, weights) == pytest.approx(brute_force_auc(s, y, weights.tolist()), abs=1e-12)


def test_weighted_auc_equals_repeated_samples():
    g = torch.Generator().manual_seed(1)
    n = 300
    labels = (torch.rand(n, generator=g) < 0.4).float()
    scores = (labels * 0.2 + torch.rand(n, generator=g)).mul(20).round().div(20)
    weights = torch.randint(1, 5, (n,), generator=g)
    repeated = auc(scores.repeat_interleave(weights), labels.repeat_interleave(weights))
    weighted = auc(scores, labels, weights.float())
    assert weighted == pytest.approx(repeated, abs=1e-12)
    assert abs(weighted - auc(scores, labels)) > 1e-4  # the weights matter here


def test_auc_accepts_tensors_of_any_shape_and_device_dtype():
    scores = torch.tensor([[0.1], [0.9], [0.4], [0.6]], dtype=torch.bfloat16)
    labels = torch.tensor([[0], [1], [1], [0]], dtype=torch.int64)
    assert auc(scores, labels) == 0.75


# ----------------------------------------------------------------------------------------------
# Cross-check against torchrec's NE.


def test_ne_matches_torchrec():
    ne_mod = pytest.importorskip("torchrec.metrics.ne")
    if not (hasattr(ne_mod, "compute_cross_entropy") and hasattr(ne_mod, "compute_ne")):
        pytest.skip("torchrec.metrics.ne has no compute_cross_entropy / compute_ne")
    g = torch.Generator().manual_seed(2)
    n = 2000
    preds = torch.rand(n, generator=g, dtype=torch.float64).clamp(0.01, 0.99)
    labels = torch.bernoulli(preds, generator=g)
    eta = 1e-12
    for weights in (torch.ones(n, dtype=torch.float64), torch.rand(n, generator=g, dtype=torch.float64) * 3):
        ce = ne_mod.compute_cross_entropy(labels, preds.clone(), weights, eta)
        expected = ne_mod.compute_ne(
            ce.sum(), weights.sum(), (weights * labels).sum(), (weights * (1 - labels)).sum(), eta
        )
        assert normalized_entropy(preds, labels, weights) == pytest.approx(float(expected), rel=1e-9)
        assert 0.5 < float(expected) < 1.0


# ----------------------------------------------------------------------------------------------
# Sample weights of a batch: the training loss and the eval metrics use them where a source gives them.


def test_weighted_loss():
    from gemctl.train.trainer import compute_loss

    torch.manual_seed(0)
    logits, labels = torch.randn(6, 2), (torch.rand(6, 2) > 0.5).float()
    plain = compute_loss(logits, labels)
    torch.testing.assert_close(compute_loss(logits, labels, torch.ones(6)), plain)
    w = torch.tensor([0.0, 2.0, 1.0, 0.5, 0.0, 3.0])
    bce = torch.nn.functional.binary_cross_entropy_with_logits(logits, labels, reduction="none")
    want = sum(float((bce[:, t] * w).sum() / w.sum()) for t in range(2))
    assert float(compute_loss(logits, labels, w)) == pytest.approx(want, rel=1e-6)
    assert float(compute_loss(logits, labels, torch.zeros(6))) == 0.0


def test_eval_metrics_use_the_batches_weights(monkeypatch):
    """Weights 0/1 on the eval samples: the weighted NE / AUC / label mean are those of the samples
    weighted 1 alone."""
    import dataclasses

    from gemctl.config.compose import compose
    from gemctl.train.trainer import Trainer

    cfg = compose(["train.eval_batches=2", "data.eval_batch_size=64"])
    trainer = Trainer(cfg)
    src = trainer.source
    batches = list(src.eval_batches())[:2]
    keep = [torch.arange(b.batch_size) % 3 != 0 for b in batches]
    weighted = [dataclasses.replace(b, weights=k.float()) for b, k in zip(batches, keep)]
    monkeypatch.setattr(src, "eval_batches", lambda: iter(weighted))
    got = trainer.evaluate()
    assert got["weighted"] is True and got["samples"] == sum(b.batch_size for b in batches)
    with torch.no_grad():
        trainer.model.eval()
        p = torch.cat([torch.sigmoid(trainer.model(b).float()) for b in batches])
    y = torch.cat([b.labels for b in batches])
    k = torch.cat(keep)
    task = src.spec.tasks[0]
    assert got[task]["ne"] == pytest.approx(normalized_entropy(p[k, 0], y[k, 0]), rel=1e-5)
    assert got[task]["auc"] == pytest.approx(auc(p[k, 0], y[k, 0]), rel=1e-6)
    assert got[task]["label_mean"] == pytest.approx(float(y[k, 0].mean()), rel=1e-6)


@pytest.mark.parametrize("weights,message", [
    (lambda b: torch.ones(b, dtype=torch.float64), "must be float32"),
    (lambda b: torch.ones(b + 1), "of shape"),
    (lambda b: torch.tensor([1.0] * (b - 1) + [-1.0]), "is not a finite number >= 0"),
    (lambda b: torch.tensor([float("nan")] + [1.0] * (b - 1)), "row 0 is not a finite number"),
])
def test_bad_weights_name_the_field(weights, message):
    import dataclasses

    from gemctl.config.compose import compose
    from gemctl.data.batch import validate_batch
    from gemctl.data.synthetic import SyntheticSource
    from gemctl.errors import DataError

    src = SyntheticSource(compose([]).data)
    batch = src.train_batch(0)
    with pytest.raises(DataError, match=message) as info:
        validate_batch(dataclasses.replace(batch, weights=weights(batch.batch_size)), src.spec)
    assert info.value.feature == "weights"
