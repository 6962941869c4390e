"""The synthetic source (determinism, length and id distributions, labels) and batch validation
(bad data is rejected naming the feature and the first offending row)."""

from __future__ import annotations

import dataclasses
import itertools
import math

import pytest
import torch

from gemctl.errors import first_line
from gemctl.config.compose import compose
from gemctl.data.batch import JaggedBatch, validate_batch
from gemctl.data.synthetic import SyntheticSource
from gemctl.errors import DataError, UserError


def make_source(*overrides: str) -> SyntheticSource:
    return SyntheticSource(compose(list(overrides)).data)


@pytest.fixture(scope="module")
def src() -> SyntheticSource:
    # Many empty histories, so the row arithmetic around zero-length rows is exercised.
    return make_source("data.synthetic.zero_length_fraction=0.2", "data.batch_size=256")


def assert_batches_equal(a: JaggedBatch, b: JaggedBatch) -> None:
    assert a.max_seq_len == b.max_seq_len
    assert set(a.seq_ids) == set(b.seq_ids) and set(a.sparse_ids) == set(b.sparse_ids)
    for k in a.seq_ids:
        assert torch.equal(a.seq_ids[k], b.seq_ids[k]), k
    for k in a.sparse_ids:
        assert torch.equal(a.sparse_ids[k], b.sparse_ids[k]), k
        assert torch.equal(a.sparse_offsets[k], b.sparse_offsets[k]), k
    for name in ("seq_offsets", "seq_offsets_cpu", "dense", "labels", "sample_ids"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name


def batches_differ(a: JaggedBatch, b: JaggedBatch) -> bool:
    try:
        assert_batches_equal(a, b)
    except AssertionError:
        return True
    return False


# ----------------------------------------------------------------------------------------------
# The synthetic source.


def test_batches_validate_and_have_the_layout(src):
    spec = src.spec
    assert spec.seq_features == {"item_id": 20000, "action": 8}
    assert spec.sparse_features == {"user_id": 5000, "ad_id": 2000, "context": 64}
    assert spec.tasks == ("ctr", "cvr")
    for k in range(3):
        b = src.train_batch(k)
        validate_batch(b, spec)
        assert b.batch_size == 256
        assert b.seq_offsets.dtype == torch.int64 and b.seq_offsets.shape == (257,)
        assert int(b.seq_offsets_cpu[0]) == 0 and b.num_tokens == b.seq_ids["item_id"].numel()
        assert b.dense.shape == (256, 16) and b.dense.dtype == torch.float32
        assert b.labels.shape == (256, 2) and b.labels.dtype == torch.float32
        assert torch.equal(b.sample_ids, torch.arange(256 * k, 256 * (k + 1)))
        assert b.sparse_ids["context"].numel() == 3 * 256  # context_hotness 3
        assert torch.equal(b.sparse_offsets["context"], torch.arange(257) * 3)
    for i, b in enumerate(src.eval_batches()):
        validate_batch(b, spec)
        assert int(b.sample_ids.max()) < 0  # eval ids never collide with training ids
        if i == 1:
            break


def test_same_seed_same_batches(src):
    other = make_source("data.synthetic.zero_length_fraction=0.2", "data.batch_size=256")
    assert_batches_equal(src.train_batch(5), other.train_batch(5))
    assert_batches_equal(src.train_batch(5), src.train_batch(5))
    for a, b in zip(src.eval_batches(), other.eval_batches()):
        assert_batches_equal(a, b)


def test_train_batch_k_is_the_kth_of_the_stream(src):
    stream = list(itertools.islice(src.train_batches(), 4))
    for k, batch in enumerate(stream):
        assert_batches_equal(batch, src.train_batch(k))
    # Starting the stream at k (a restart) gives the same batch k.
    assert_batches_equal(next(src.train_batches(start_step=3)), stream[3])
    assert batches_differ(stream[0], stream[1])


def test_different_seeds_differ(src):
    other = make_source("data.synthetic.zero_length_fraction=0.2", "data.batch_size=256", "data.seed=99")
    a, b = src.train_batch(0), other.train_batch(0)
    assert not torch.equal(a.seq_offsets, b.seq_offsets)
    assert not torch.equal(a.dense, b.dense)
    assert not torch.equal(a.sparse_ids["ad_id"], b.sparse_ids["ad_id"])


def test_zero_length_histories_and_max_seq_len():
    s = make_source("data.synthetic.zero_length_fraction=0.2", "data.batch_size=512")
    b = s.train_batch(0)
    lengths = b.seq_lengths_cpu()
    zeros = int((lengths == 0).sum())
    # Binomial(512, 0.2): mean 102, sd 9; these bounds are > 5 sd away.
    assert 55 <= zeros <= 150
    assert b.max_seq_len == int(lengths.max())
    assert int(lengths.max()) <= s.cfg.max_len
    assert int(lengths.min()) == 0
    validate_batch(b, s.spec)


def test_default_zero_length_fraction_is_small():
    s = make_source("data.batch_size=2048")
    zeros = float((s.train_batch(0).seq_lengths_cpu() == 0).double().mean())
    assert 0.005 < zeros < 0.04  # zero_length_fraction 0.02


def test_lengths_never_exceed_max_len():
    s = make_source("data.max_len=16", "data.batch_size=512", "data.synthetic.length_sigma=2.0")
    for k in range(3):
        b = s.train_batch(k)
        lengths = b.seq_lengths_cpu()
        assert int(lengths.max()) == 16  # sigma 2: many rows hit the clamp
        assert b.max_seq_len == 16
        validate_batch(b, s.spec)


def test_history_lengths_are_heavy_tailed():
    s = make_source("data.max_len=1000", "data.batch_size=2048", "data.synthetic.length_sigma=0.8")
    lengths = s.train_batch(0).seq_lengths_cpu().double()
    fill = float(lengths.mean()) / 1000
    assert 0.2 < fill < 0.45  # log-normal with median max_len/4: mean fill ~0.32
    nonzero = lengths[lengths > 0]
    median = float(nonzero.median())
    assert 180 < median < 320  # median max_len / 4
    assert float(nonzero.mean()) > 1.15 * median  # right-skewed
    assert float(torch.quantile(nonzero, 0.99)) > 3 * median  # a long tail
    assert float(torch.quantile(nonzero, 0.01)) < median / 3


def test_item_ids_are_zipf_skewed():
    s = make_source("data.batch_size=1024")
    ids = torch.cat([s.train_batch(k).seq_ids["item_id"] for k in range(2)])
    counts = torch.bincount(ids, minlength=20000).sort(descending=True).values
    top = counts[: 20000 // 100].sum() / counts.sum()
    assert top > 0.2  # uniform ids would give ~1%
    # Popular ids are scattered over the table, not the low ids.
    popular = torch.bincount(ids, minlength=20000).argsort(descending=True)[:200]
    assert float(popular.double().mean()) > 5000


def test_labels(src):
    labels = torch.cat([src.train_batch(k).labels for k in range(4)])
    ctr, cvr = labels[:, 0], labels[:, 1]
    assert set(labels.unique().tolist()) == {0.0, 1.0}
    assert bool((cvr <= ctr).all())
    # base_ctr sets the teacher's base logit; its signal (scale 2) spreads the rate around it.
    assert 0.15 < float(ctr.mean()) < 0.5
    assert 0 < float(cvr.sum()) < float(ctr.sum())
    rare = make_source("data.synthetic.base_ctr=0.02", "data.batch_size=1024").train_batch(0).labels[:, 0]
    assert float(rare.mean()) < float(ctr.mean()) - 0.1


def test_teacher_baseline_beats_background_rate():
    s = make_source()
    base = s.baselines()["teacher"]
    assert base["ne"] < 0.8
    assert base["auc"] > 0.8


# ----------------------------------------------------------------------------------------------
# Bad data: DataError naming the feature and the first offending row.


def pick_row(batch: JaggedBatch, min_len: int = 2, after_empty: bool = True) -> int:
    """A row with at least ``min_len`` tokens, right after an empty row when possible."""
    lengths = batch.seq_lengths_cpu()
    for r in range(1, batch.batch_size):
        if lengths[r] >= min_len and (lengths[r - 1] == 0 or not after_empty):
            return r
    raise AssertionError("no suitable row")


def data_error(batch: JaggedBatch, spec) -> DataError:
    with pytest.raises(DataError) as info:
        validate_batch(batch, spec)
    err = info.value
    assert isinstance(err, UserError) and err.exit_code == 2
    assert "\n" not in str(err)
    assert str(err).startswith(f"data feature '{err.feature}': ")
    return err


def with_seq_offsets(batch: JaggedBatch, offsets: torch.Tensor) -> JaggedBatch:
    # seq_offsets_cpu is the host copy that is validated; seq_offsets the device copy.
    return dataclasses.replace(batch, seq_offsets=offsets.clone(), seq_offsets_cpu=offsets.clone())


def test_seq_id_outside_table_names_feature_and_row(src):
    b = src.train_batch(0)
    r = pick_row(b)
    assert b.seq_lengths_cpu()[r - 1] == 0  # the row before is empty: offsets repeat there
    pos = int(b.seq_offsets_cpu[r]) + 1
    ids = b.seq_ids["item_id"].clone()
    ids[pos] = 20000
    # A later bad token must not be the one reported.
    ids[int(b.seq_offsets_cpu[-1]) - 1] = 10**9
    bad = dataclasses.replace(b, seq_ids={**b.seq_ids, "item_id": ids})
    err = data_error(bad, src.spec)
    assert err.feature == "item_id"
    assert str(err) == f"data feature 'item_id': id 20000 in row {r} is outside the table [0, 20000)"


def test_seq_id_in_first_token_of_a_row(src):
    b = src.train_batch(1)
    r = pick_row(b, min_len=1)
    ids = b.seq_ids["action"].clone()
    ids[int(b.seq_offsets_cpu[r])] = 8  # num_actions 8
    err = data_error(dataclasses.replace(b, seq_ids={**b.seq_ids, "action": ids}), src.spec)
    assert err.feature == "action"
    assert f"id 8 in row {r} " in str(err)


def test_negative_sparse_id(src):
    b = src.train_batch(0)
    r = 37
    ctx = b.sparse_ids["context"].clone()
    ctx[3 * r + 1] = -5  # multi-hot: 3 ids per row
    err = data_error(dataclasses.replace(b, sparse_ids={**b.sparse_ids, "context": ctx}), src.spec)
    assert err.feature == "context"
    assert str(err) == f"data feature 'context': id -5 in row {r} is outside the table [0, 64)"
    user = b.sparse_ids["user_id"].clone()
    user[11] = -1
    err = data_error(dataclasses.replace(b, sparse_ids={**b.sparse_ids, "user_id": user}), src.spec)
    assert err.feature == "user_id" and "id -1 in row 11 " in str(err)


def test_unsorted_seq_offsets(src):
    b = src.train_batch(0)
    offs = b.seq_offsets_cpu.clone()
    lengths = b.seq_lengths_cpu()
    r = next(r for r in range(b.batch_size) if offs[r] > 0 and lengths[r] > 0)
    start = int(offs[r])
    offs[r + 1] = start - 1  # row r now has a negative length
    err = data_error(with_seq_offsets(b, offs), src.spec)
    assert err.feature == "seq_offsets"
    assert "non-decreasing" in str(err)
    assert f"row {r} has offsets {start} -> {start - 1}" in str(err)


def test_unsorted_sparse_offsets(src):
    b = src.train_batch(0)
    offs = b.sparse_offsets["context"].clone()
    offs[6] = 14  # offsets ... 15 -> 14 -> 18: row 5 goes backwards
    err = data_error(dataclasses.replace(b, sparse_offsets={**b.sparse_offsets, "context": offs}), src.spec)
    assert err.feature == "context"
    assert "row 5 has offsets 15 -> 14" in str(err)


def test_offsets_must_start_at_zero(src):
    b = src.train_batch(0)
    offs = b.seq_offsets_cpu.clone()
    offs[0] = 1
    err = data_error(with_seq_offsets(b, offs), src.spec)
    assert err.feature == "seq_offsets"
    assert "offsets[0] must be 0, got 1 (row 0)" in str(err)


def test_offsets_must_be_int64(src):
    b = src.train_batch(0)
    err = data_error(with_seq_offsets(b, b.seq_offsets_cpu.to(torch.int32)), src.spec)
    assert err.feature == "seq_offsets"
    assert "offsets must be int64, got torch.int32" in str(err)
    bad = dataclasses.replace(
        b, sparse_offsets={**b.sparse_offsets, "ad_id": b.sparse_offsets["ad_id"].to(torch.int32)}
    )
    err = data_error(bad, src.spec)
    assert err.feature == "ad_id" and "int64" in str(err)


def test_offsets_end_must_match_values(src):
    b = src.train_batch(0)
    ctx = b.sparse_ids["context"][:-1].clone()
    err = data_error(dataclasses.replace(b, sparse_ids={**b.sparse_ids, "context": ctx}), src.spec)
    assert err.feature == "context"
    assert f"offsets end at {3 * 256} but there are {3 * 256 - 1} values" in str(err)


def test_device_offsets_must_match_the_host_copy(src):
    b = src.train_batch(0)
    offs = b.seq_offsets.clone()
    offs[-1] += 1
    err = data_error(dataclasses.replace(b, seq_offsets=offs), src.spec)
    assert err.feature == "seq_offsets" and "differ from the host copy" in str(err)


def test_max_seq_len_must_match(src):
    b = src.train_batch(0)
    err = data_error(dataclasses.replace(b, max_seq_len=b.max_seq_len + 1), src.spec)
    assert err.feature == "seq_offsets"
    assert f"max_seq_len is {b.max_seq_len + 1} but the longest row has {b.max_seq_len}" in str(err)


def test_row_longer_than_max_len(src):
    b = src.train_batch(0)
    spec = dataclasses.replace(src.spec, max_seq_len=b.max_seq_len - 1)
    row = int(b.seq_lengths_cpu().argmax())
    err = data_error(b, spec)
    assert err.feature == "seq_offsets"
    assert f"row {row} has length {b.max_seq_len} > max_len {b.max_seq_len - 1}" in str(err)


@pytest.mark.parametrize("task,col,value", [("ctr", 0, math.nan), ("cvr", 1, 2.0), ("ctr", 0, -1.0)])
def test_bad_label(src, task, col, value):
    b = src.train_batch(0)
    labels = b.labels.clone()
    labels[41, col] = value
    labels[200, col] = math.nan  # later: not reported
    err = data_error(dataclasses.replace(b, labels=labels), src.spec)
    assert err.feature == f"labels.{task}"
    assert f"label {value} in row 41 is not in [0, 1]" in str(err)


def test_dense_wrong_dtype(src):
    b = src.train_batch(0)
    err = data_error(dataclasses.replace(b, dense=b.dense.double()), src.spec)
    assert err.feature == "dense"
    assert str(err) == "data feature 'dense': must be float32, got torch.float64"


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_dense_non_finite(src, value):
    b = src.train_batch(0)
    dense = b.dense.clone()
    dense[17, 3] = value
    dense[90, 0] = math.nan
    err = data_error(dataclasses.replace(b, dense=dense), src.spec)
    assert err.feature == "dense"
    assert str(err) == "data feature 'dense': non-finite value in row 17"


def test_dense_wrong_shape(src):
    b = src.train_batch(0)
    err = data_error(dataclasses.replace(b, dense=b.dense[:, :15].contiguous()), src.spec)
    assert err.feature == "dense" and "[256, 16]" in str(err)


def test_missing_feature(src):
    b = src.train_batch(0)
    seq = {k: v for k, v in b.seq_ids.items() if k != "action"}
    err = data_error(dataclasses.replace(b, seq_ids=seq), src.spec)
    assert err.feature == "action" and "missing" in str(err)


# ----------------------------------------------------------------------------------------------
# A DataError raised in a DataLoader worker reaches the CLI as one line.


def test_first_line_unwraps_a_worker_error():
    msg = (
        "Caught DataError in DataLoader worker process 0.\n"
        "Original Traceback (most recent call last):\n"
        '  File "/x/torch/utils/data/_utils/worker.py", line 349, in _worker_loop\n'
        "    data = fetcher.fetch(index)\n"
        "gemctl.errors.DataError: data feature 'item_id': id 99 in row 3 is outside the table [0, 10)"
    )
    err = DataError(msg)  # the one-argument form torch uses to re-raise
    assert first_line(err) == "data feature 'item_id': id 99 in row 3 is outside the table [0, 10)"
    plain = DataError("item_id", "id 99 in row 3 is outside the table [0, 10)")
    assert first_line(plain) == "data feature 'item_id': id 99 in row 3 is outside the table [0, 10)"
    assert first_line(ValueError("")) == "ValueError"


class _CorruptSource:
    """Wraps a source; batch 2 has an out-of-range item id in row ``row``."""

    def __init__(self, source, row: int):
        self.source, self.spec, self.row = source, source.spec, row

    def train_batch(self, step: int) -> JaggedBatch:
        b = self.source.train_batch(step)
        if step != 2:
            return b
        ids = b.seq_ids["item_id"].clone()
        ids[int(b.seq_offsets_cpu[self.row])] = 20000
        return dataclasses.replace(b, seq_ids={**b.seq_ids, "item_id": ids})

    def train_batches(self, start_step: int = 0):
        for step in itertools.count(start_step):
            yield self.train_batch(step)


@pytest.mark.parametrize("num_workers", [0, 1])
def test_loader_surfaces_a_data_error_as_one_line(src, num_workers):
    import multiprocessing

    from gemctl.data.loader import TrainLoader

    data_cfg = compose(
        ["data.synthetic.zero_length_fraction=0.2", "data.batch_size=256", f"data.num_workers={num_workers}"]
    ).data
    row = pick_row(src.train_batch(2), min_len=1)
    before = set(multiprocessing.active_children())
    loader = TrainLoader(_CorruptSource(src, row), data_cfg, torch.device("cpu"))
    try:
        next(loader)
        next(loader)
        with pytest.raises(DataError) as info:
            next(loader)
    finally:
        loader.close()
    assert first_line(info.value) == f"data feature 'item_id': id 20000 in row {row} is outside the table [0, 20000)"
    if num_workers:
        assert "DataLoader worker" in str(info.value)  # it really came through a worker process
    # close() stops the worker processes, even while the error still references the iterator.
    assert set(multiprocessing.active_children()) <= before
