"""Base Batch Shuffling: every sample exactly once across ranks, deterministic, and balanced."""

import pytest
import torch

from gemctl.config.compose import compose
from gemctl.config.validate import validate
from gemctl.data.shuffle import build_dealer, snake_deal, unit_work
from gemctl.data.source import build_source
from gemctl.errors import ConfigError


def _cfg(kind, batch=256, sub=64, max_len=200, key="tokens", source="synthetic"):
    ov = [f"data.batch_size={batch}", f"data.max_len={max_len}", f"shuffle={kind}", f"shuffle.sub_batch_size={sub}", f"shuffle.key={key}"]
    if source != "synthetic":
        ov.append(f"data={source}")
    return compose(ov)


def test_snake_deal_by_hand():
    # 8 units, 4 ranks: sorted heaviest first 7..0, round 1 forward, round 2 backward.
    works = [0, 1, 2, 3, 4, 5, 6, 7]
    plan = snake_deal(works, 4)
    assert plan == [[7, 0], [6, 1], [5, 2], [4, 3]]
    assert [sum(works[u] for u in units) for units in plan] == [7, 7, 7, 7]
    with pytest.raises(ValueError):
        snake_deal(works, 3)


def test_unit_work_keys():
    lengths = torch.tensor([3, 0, 4])
    assert unit_work(lengths, "tokens") == 7
    assert unit_work(lengths, "attention") == 25


@pytest.mark.parametrize("kind", ["none", "bbs"])
def test_every_sample_exactly_once_across_ranks(kind):
    world, batch = 4, 256
    cfg = _cfg(kind, batch=batch)
    sources = [build_source(cfg.data, cfg.shuffle, world, r) for r in range(world)]
    for step in range(3):
        ids = torch.cat([s.train_batch(step).sample_ids for s in sources])
        assert ids.numel() == world * batch
        assert torch.equal(ids.sort().values, torch.arange(step * world * batch, (step + 1) * world * batch))


def test_bbs_is_deterministic_and_independent_of_other_ranks():
    cfg = _cfg("bbs")
    a = build_source(cfg.data, cfg.shuffle, 4, 2).train_batch(5)
    b = build_source(cfg.data, cfg.shuffle, 4, 2).train_batch(5)  # fresh process state, same plan
    assert torch.equal(a.sample_ids, b.sample_ids) and torch.equal(a.seq_ids["item_id"], b.seq_ids["item_id"])


def test_bbs_cuts_skew():
    world, steps = 16, 8
    skews = {}
    for kind in ("none", "bbs"):
        cfg = _cfg(kind, batch=256, sub=64)
        sources = [build_source(cfg.data, cfg.shuffle, world, r) for r in range(world)]
        per_step = []
        for step in range(steps):
            tokens = torch.tensor([float(s.train_batch(step).num_tokens) for s in sources])
            per_step.append(float(tokens.max() / tokens.mean()))
        skews[kind] = sum(per_step) / steps
    assert skews["none"] > 1.02
    assert skews["bbs"] - 1 <= (skews["none"] - 1) / 2, skews


def test_bbs_single_rank_keeps_the_batch_size():
    cfg = _cfg("bbs", batch=256, sub=64)
    validate(cfg)
    batch = build_source(cfg.data, cfg.shuffle).train_batch(0)
    assert batch.batch_size == 256
    assert batch.max_seq_len == int(batch.seq_lengths_cpu().max())


def test_bbs_config_errors():
    with pytest.raises(ConfigError) as err:
        validate(_cfg("bbs", batch=256, sub=100))
    assert err.value.field == "shuffle.sub_batch_size"
    with pytest.raises(ConfigError) as err:
        validate(_cfg("bbs", key="flops"))
    assert err.value.field == "shuffle.key"
    with pytest.raises(ConfigError):
        build_dealer(_cfg("bbs", batch=256, sub=100).shuffle, 256)


def test_movielens_bbs_epoch_covers_each_sample_once():
    pytest.importorskip("importlib")
    from gemctl.data.movielens import movielens100k_dir

    try:
        movielens100k_dir()
    except Exception:
        pytest.skip("MovieLens-100K not installed")
    world = 2
    cfg = _cfg("bbs", batch=256, sub=128, max_len=50, source="movielens100k")
    sources = [build_source(cfg.data, cfg.shuffle, world, r) for r in range(world)]
    steps = sources[0].batches_per_epoch
    seen = []
    iters = [s.train_batches() for s in sources]
    for _ in range(steps):
        for it in iters:
            seen.append(next(it).sample_ids)
    ids = torch.cat(seen)
    assert ids.numel() == steps * world * 256
    assert ids.unique().numel() == ids.numel()  # nothing twice within the epoch
