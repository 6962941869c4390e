"""data=parquet: your own samples from Parquet files. Batches carry exactly the rows' values
(histories cut to their latest max_len events, multi-hot bags, dense, labels, weights, ids), batch
k is the same however it is reached, ranks get disjoint rows, bad data and bad config name the
column or field in one line, and a short run learns a learnable label."""

from __future__ import annotations

import re
import sys

import numpy as np
import pytest
import torch

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

from gemctl.config.compose import compose  # noqa: E402
from gemctl.data.batch import validate_batch  # noqa: E402
from gemctl.data.parquet import ParquetSource  # noqa: E402
from gemctl.data.shuffle import Dealer  # noqa: E402
from gemctl.errors import ConfigError, DataError  # noqa: E402

COLUMNS = ["data.parquet.seq_features=[items:50,actions:4]", "data.parquet.sparse_features=[user:10,tags:7]",
           "data.parquet.dense=[age,score]", "data.parquet.labels=[click,buy]"]


def _rows(n, seed, learnable=False):
    rng = np.random.default_rng(seed)
    lens = rng.integers(0, 12, n)
    lens[:3] = [0, 1, 11]  # an empty history, one event, one past max_len (8)
    user = rng.integers(0, 10, n)
    click = (user % 2).astype(np.float32) if learnable else (rng.random(n) < 0.3).astype(np.float32)
    return {
        "items": [rng.integers(0, 50, k).tolist() for k in lens],
        "actions": [rng.integers(0, 4, k).tolist() for k in lens],
        "user": user,
        "tags": [rng.integers(0, 7, rng.integers(0, 4)).tolist() for _ in range(n)],
        "age": rng.random(n).astype(np.float32),
        "score": rng.integers(0, 5, n),  # an integer column read as a float feature
        "click": click,
        "buy": (rng.random(n) < 0.1).astype(np.float32),
        "w": rng.random(n).astype(np.float32) * 2,
        "sid": np.arange(n, dtype=np.int64) + 1000 * seed,
    }


def _write(tmp_path, rows_train, rows_eval, train_name="train.parquet"):
    pq.write_table(pa.table(rows_train), tmp_path / train_name)
    pq.write_table(pa.table(rows_eval), tmp_path / "eval.parquet")


def _cfg(tmp_path, extra=()):
    return compose(["data=parquet", f"data.parquet.train={tmp_path / 'train.parquet'}",
                    f"data.parquet.eval={tmp_path / 'eval.parquet'}", "data.max_len=8", "data.batch_size=16",
                    "data.eval_batch_size=32", *COLUMNS, *extra])


def test_batches_carry_the_rows(tmp_path):
    train = _rows(100, 0)
    _write(tmp_path, train, _rows(40, 1))
    cfg = _cfg(tmp_path, ["data.parquet.weight=w", "data.parquet.sample_id=sid"])
    src = ParquetSource(cfg.data)
    assert src.spec.seq_features == {"items": 50, "actions": 4} and src.spec.tasks == ("click", "buy")
    assert src.spec.num_dense == 2 and src.batches_per_epoch == 100 // 16
    seen = set()
    for k in range(src.batches_per_epoch):
        batch = src.train_batch(k)
        validate_batch(batch, src.spec)
        assert batch.batch_size == 16
        for j, sid in enumerate(batch.sample_ids.tolist()):
            r = sid  # sample ids of the train split are the row numbers (+ 0)
            seen.add(r)
            hist = train["items"][r][-8:]  # the latest max_len events
            lo, hi = batch.seq_offsets[j], batch.seq_offsets[j + 1]
            assert batch.seq_ids["items"][lo:hi].tolist() == hist
            assert batch.seq_ids["actions"][lo:hi].tolist() == train["actions"][r][-8:]
            to, te = batch.sparse_offsets["tags"][j], batch.sparse_offsets["tags"][j + 1]
            assert batch.sparse_ids["tags"][to:te].tolist() == train["tags"][r]
            assert int(batch.sparse_ids["user"][j]) == int(train["user"][r])
            assert batch.dense[j].tolist() == pytest.approx([float(train["age"][r]), float(train["score"][r])])
            assert batch.labels[j].tolist() == [float(train["click"][r]), float(train["buy"][r])]
            assert float(batch.weights[j]) == pytest.approx(float(train["w"][r]))
        assert batch.max_seq_len == int((batch.seq_offsets[1:] - batch.seq_offsets[:-1]).max())
    assert len(seen) == src.batches_per_epoch * 16  # an epoch deals each row at most once
    ev = list(src.eval_batches())
    assert [b.batch_size for b in ev] == [32, 8] and ev[0].sample_ids[0] == 1000


def test_batch_k_is_the_same_however_reached(tmp_path):
    _write(tmp_path, _rows(100, 0), _rows(20, 1))
    src = ParquetSource(_cfg(tmp_path).data)
    it = src.train_batches(0)
    first = [next(it) for _ in range(14)]  # two epochs and more: a new permutation each
    again = ParquetSource(_cfg(tmp_path).data)
    for k in (0, 5, 6, 13):
        assert torch.equal(again.train_batch(k).sample_ids, first[k].sample_ids)
        assert torch.equal(next(again.train_batches(k)).seq_ids["items"], first[k].seq_ids["items"])
    assert not torch.equal(first[0].sample_ids, first[src.batches_per_epoch].sample_ids)


def test_ranks_get_disjoint_rows(tmp_path):
    _write(tmp_path, _rows(100, 0), _rows(20, 1))
    cfg = _cfg(tmp_path)
    ranks = [ParquetSource(cfg.data, dealer=Dealer(world_size=2, rank=r)) for r in (0, 1)]
    assert ranks[0].batches_per_epoch == 100 // 32
    for k in range(3):
        a, b = (set(s.train_batch(k).sample_ids.tolist()) for s in ranks)
        assert len(a) == len(b) == 16 and not a & b


@pytest.mark.parametrize("change,extra,field,message", [
    (lambda r: r["actions"].__setitem__(4, r["actions"][4] + [1]), [], "actions", "row 4 of train has"),
    (lambda r: r["items"].__setitem__(7, [3, 50]), [], "items", "id 50 in row 7 of train is outside its vocabulary [0, 50)"),
    (lambda r: r["user"].__setitem__(2, -1), [], "user", "id -1 in row 2"),
    (lambda r: r["click"].__setitem__(9, 2.0), [], "click", "label 2.0 in row 9 of train is not in [0, 1]"),
    (lambda r: r["w"].__setitem__(5, -1.0), ["data.parquet.weight=w"], "w", "in row 5 of train is not a finite number >= 0"),
    (lambda r: r["age"].__setitem__(3, np.nan), [], "age", "non-finite value in row 3"),
    (lambda r: r.pop("buy"), [], "buy", "no such column"),
])
def test_bad_data_names_the_column_and_row(tmp_path, change, extra, field, message):
    train = _rows(60, 0)
    change(train)
    _write(tmp_path, train, _rows(20, 1))
    with pytest.raises(DataError, match=re.escape(message)) as info:
        ParquetSource(_cfg(tmp_path, extra).data)
    assert info.value.feature == field


@pytest.mark.parametrize("extra,field,message", [
    (["data.parquet.seq_features=[items]"], "data.parquet.seq_features[0]", "is not column:vocabulary size"),
    (["data.parquet.sparse_features=[user:0]"], "data.parquet.sparse_features[0]", "is not column:vocabulary size"),
    (["data.parquet.seq_features=[]"], "data.parquet.seq_features", "names no history column"),
    (["data.parquet.dense=[age,age]"], "data.parquet", "column 'age' is named twice"),
    (["data.parquet.eval=/nonexistent/*.parquet"], "data.parquet.eval", "matches no Parquet file"),
    (["data.batch_size=128"], "data.batch_size", "more than the 100 training rows"),
])
def test_bad_config_names_the_field(tmp_path, extra, field, message):
    _write(tmp_path, _rows(100, 0), _rows(20, 1))
    with pytest.raises(ConfigError, match=message) as info:
        ParquetSource(_cfg(tmp_path, extra).data)
    assert info.value.field == field


def test_a_directory_or_a_glob_reads_every_file(tmp_path):
    (tmp_path / "parts").mkdir()
    for i in range(3):
        pq.write_table(pa.table(_rows(30, 10 + i)), tmp_path / "parts" / f"part-{i}.parquet")
    pq.write_table(pa.table(_rows(20, 1)), tmp_path / "eval.parquet")
    for spec in (tmp_path / "parts", f"{tmp_path}/parts/part-*.parquet"):
        cfg = compose(["data=parquet", f"data.parquet.train={spec}", f"data.parquet.eval={tmp_path / 'eval.parquet'}",
                       "data.max_len=8", "data.batch_size=16", *COLUMNS])
        assert ParquetSource(cfg.data).train.rows == 90


def test_without_pyarrow_the_error_says_how_to_install(tmp_path, monkeypatch):
    _write(tmp_path, _rows(40, 0), _rows(20, 1))
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(ConfigError, match=r"pip install 'gemctl\[parquet\]'"):
        ParquetSource(_cfg(tmp_path).data)


def test_a_short_run_learns_a_learnable_label(tmp_path):
    from gemctl.train.trainer import Trainer

    _write(tmp_path, _rows(2000, 0, learnable=True), _rows(400, 1, learnable=True))
    cfg = _cfg(tmp_path, ["data.parquet.labels=[click]", "train.steps=120", "train.log_every=40",
                          "train.warmup_timing_steps=0", "data.batch_size=64", "train.eval_batches=0"])
    result = Trainer(cfg, run_root=str(tmp_path / "runs")).fit()
    assert result.eval["click"]["auc"] > 0.9  # the label is the user id's parity
    assert result.baselines["train_rate"]["auc"] == pytest.approx(0.5)


def test_column_types_as_they_come(tmp_path):
    """int32 ids and large_list histories, bool labels, an integer dense column past float32's
    exact range, and files whose types differ (int32 in one, int64 in the other) read as one split."""
    rows = _rows(60, 0)
    t = pa.table(rows)
    a = t.slice(0, 30).cast(pa.schema([
        pa.field("items", pa.large_list(pa.int32())), pa.field("actions", pa.list_(pa.int32())),
        pa.field("user", pa.int32()), pa.field("tags", pa.list_(pa.int64())), pa.field("age", pa.float32()),
        pa.field("score", pa.int64()), pa.field("click", pa.bool_()), pa.field("buy", pa.float64()),
        pa.field("w", pa.float32()), pa.field("sid", pa.int64())]))
    b = t.slice(30)
    b = b.set_column(b.schema.get_field_index("click"), "click", b.column("click").cast(pa.bool_()))  # bool vs float won't merge
    (tmp_path / "tr").mkdir()
    pq.write_table(a, tmp_path / "tr" / "a.parquet")
    pq.write_table(b, tmp_path / "tr" / "b.parquet")
    big = dict(_rows(20, 1), score=np.full(20, 20_000_001, dtype=np.int64))
    pq.write_table(pa.table(big), tmp_path / "eval.parquet")
    cfg = compose(["data=parquet", f"data.parquet.train={tmp_path / 'tr'}", f"data.parquet.eval={tmp_path / 'eval.parquet'}",
                   "data.max_len=8", "data.batch_size=16", *COLUMNS])
    src = ParquetSource(cfg.data)
    batch = src.train.batch(torch.arange(60))
    validate_batch(batch, src.spec)
    for r in (0, 29, 30, 59):
        lo, hi = batch.seq_offsets[r], batch.seq_offsets[r + 1]
        assert batch.seq_ids["items"][lo:hi].tolist() == rows["items"][r][-8:]
        assert batch.labels[r, 0] == float(rows["click"][r])
    ev = next(src.eval_batches())
    assert float(ev.dense[0, 1]) == pytest.approx(20_000_001, rel=1e-7)  # rounded to float32, not refused


def test_errors_name_the_file_and_its_row(tmp_path):
    (tmp_path / "tr").mkdir()
    first, second = _rows(30, 0), _rows(30, 2)
    second["items"][4] = [99]
    pq.write_table(pa.table(first), tmp_path / "tr" / "a.parquet")
    pq.write_table(pa.table(second), tmp_path / "tr" / "b.parquet")
    pq.write_table(pa.table(_rows(20, 1)), tmp_path / "eval.parquet")
    cfg = compose(["data=parquet", f"data.parquet.train={tmp_path / 'tr'}", f"data.parquet.eval={tmp_path / 'eval.parquet'}",
                   "data.max_len=8", "data.batch_size=16", *COLUMNS])
    with pytest.raises(DataError, match=re.escape(f"id 99 in row 4 of {tmp_path / 'tr' / 'b.parquet'} is outside")):
        ParquetSource(cfg.data)
    bad_eval = _rows(20, 1)
    bad_eval["user"][3] = 10
    pq.write_table(pa.table(first), tmp_path / "train.parquet")
    pq.write_table(pa.table(bad_eval), tmp_path / "eval.parquet")
    with pytest.raises(DataError, match="id 10 in row 3 of eval is outside"):
        ParquetSource(_cfg(tmp_path).data)


@pytest.mark.parametrize("column,value,field,message", [
    ("sid", [1.5] * 40, "sid", "sample ids must be one integer a row"),
    ("sid", [[1, 2]] * 40, "sid", "sample ids must be one integer a row"),
    ("items", list(range(40)), "items", "a history column must hold lists of ids"),
    ("tags", [["a"]] * 40, "tags", "ids must be integers"),
])
def test_wrong_column_types(tmp_path, column, value, field, message):
    train = dict(_rows(40, 0), **{column: value})
    _write(tmp_path, train, _rows(20, 1))
    with pytest.raises(DataError, match=message) as info:
        ParquetSource(_cfg(tmp_path, ["data.parquet.sample_id=sid"]).data)
    assert info.value.feature == field


def test_an_empty_eval_split_is_refused(tmp_path):
    _write(tmp_path, _rows(40, 0), {k: v[:0] for k, v in _rows(20, 1).items()})
    with pytest.raises(ConfigError, match="has no rows") as info:
        ParquetSource(_cfg(tmp_path).data)
    assert info.value.field == "data.parquet.eval"


def test_weighted_baseline_and_the_source_pickles(tmp_path):
    import pickle

    train = _rows(100, 0)
    _write(tmp_path, train, _rows(40, 1))
    src = ParquetSource(_cfg(tmp_path, ["data.parquet.weight=w"]).data)
    w, y = torch.tensor(train["w"]), torch.tensor(train["click"])
    rate = float((w * y).sum() / w.sum())
    ev = src.eval
    from gemctl.metrics.quality import normalized_entropy

    want = normalized_entropy(torch.full((ev.rows,), rate), ev.labels[:, 0], ev.weights)
    assert src.baselines()["train_rate"]["ne"] == pytest.approx(want)
    copy = pickle.loads(pickle.dumps(src))  # what DataLoader workers get
    assert torch.equal(copy.train_batch(7).sample_ids, src.train_batch(7).sample_ids)
