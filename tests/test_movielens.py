"""MovieLensSource on the MovieLens-100K copy in the recbole wheel, checked against the raw file."""

from __future__ import annotations

import importlib.util
import itertools
from collections import defaultdict

import numpy as np
import pytest
import torch

from gemctl.config.schema import DataConfig, MovieLensDataConfig
from gemctl.data.batch import validate_batch
from gemctl.errors import UserError

movielens = pytest.importorskip("gemctl.data.movielens")
try:
    DATA_DIR = movielens.movielens100k_dir()
except UserError:
    pytest.skip("recbole's MovieLens-100K files are not installed", allow_module_level=True)

MovieLensSource = movielens.MovieLensSource


def make_cfg(**kw) -> DataConfig:
    ml = MovieLensDataConfig(**kw.pop("movielens", {}))
    base = dict(
        source="movielens100k", batch_size=256, eval_batch_size=1024, max_len=200, seed=1234
    )
    base.update(kw)
    return DataConfig(movielens=ml, **base)


@pytest.fixture(scope="module")
def src():
    return MovieLensSource(make_cfg())


@pytest.fixture(scope="module")
def short_src():
    return MovieLensSource(make_cfg(max_len=8))


@pytest.fixture(scope="module")
def raw():
    """The raw file, and an independent reference of each event's strictly-earlier history."""
    inter = np.loadtxt(DATA_DIR / "ml-100k.inter", dtype=np.int64, delimiter="\t", skiprows=1)
    items = []
    genres = {}
    with open(DATA_DIR / "ml-100k.item", encoding="utf-8", errors="replace") as f:
        for line in f.read().splitlines()[1:]:
            parts = line.split("\t")
            items.append(int(parts[0]))
            genres[int(parts[0])] = [g for g in parts[3].split() if g != "unknown"]
    items = sorted(set(items) | set(inter[:, 1].tolist()))
    item_index = {it: i for i, it in enumerate(items)}
    by_user = defaultdict(list)
    for row, (u, it, r, t) in enumerate(inter.tolist()):
        by_user[u].append((t, row, it, r))
    for events in by_user.values():
        events.sort()
    return dict(inter=inter, item_index=item_index, by_user=by_user, genres=genres)


def reference_history(raw, row: int, max_len: int):
    u, _, _, t = raw["inter"][row].tolist()
    earlier = [e for e in raw["by_user"][u] if e[0] < t]
    hist = earlier[-max_len:] if max_len else []
    return (
        [raw["item_index"][e[2]] for e in hist],
        [e[3] for e in hist],
        [e[0] for e in hist],
        len(earlier),
    )


def rows_of(batch) -> list[tuple[int, list[int], list[int]]]:
    offs = batch.seq_offsets_cpu.tolist()
    items, ratings = batch.seq_ids["item_id"].tolist(), batch.seq_ids["rating"].tolist()
    return [
        (sid, items[offs[i] : offs[i + 1]], ratings[offs[i] : offs[i + 1]])
        for i, sid in enumerate(batch.sample_ids.tolist())
    ]


def assert_batches_equal(a, b):
    assert torch.equal(a.seq_offsets_cpu, b.seq_offsets_cpu)
    assert a.max_seq_len == b.max_seq_len
    for k in a.seq_ids:
        assert torch.equal(a.seq_ids[k], b.seq_ids[k]), k
    for k in a.sparse_ids:
        assert torch.equal(a.sparse_ids[k], b.sparse_ids[k]), k
        assert torch.equal(a.sparse_offsets[k], b.sparse_offsets[k]), k
    assert torch.equal(a.dense, b.dense)
    assert torch.equal(a.labels, b.labels)
    assert torch.equal(a.sample_ids, b.sample_ids)


def test_spec_and_sizes(src):
    spec = src.spec
    assert spec.tasks == ("ctr",)
    assert spec.seq_features == {"item_id": src.n_items, "rating": 6}
    assert set(spec.sparse_features) == {
        "user_id", "target_item", "age_bucket", "gender", "occupation", "genre"
    }
    assert spec.sparse_features["target_item"] == src.n_items == 1682
    assert spec.sparse_features["user_id"] == 943
    assert spec.max_seq_len == 200
    assert src.num_train + src.num_eval == 100_000  # min_history = 0 keeps every event
    assert 0.18 < src.num_eval / 100_000 < 0.22
    assert src.batches_per_epoch == src.num_train // 256
    print(f"n_train={src.num_train} n_eval={src.num_eval} cutoff={src.cutoff}")


def test_every_batch_validates(src, short_src):
    for s in (src, short_src):
        for b in itertools.islice(s.train_batches(), s.batches_per_epoch):
            validate_batch(b, s.spec)
            assert b.batch_size == 256
            assert b.seq_offsets is b.seq_offsets_cpu
            assert b.max_seq_len == (int(b.seq_lengths_cpu().max()) if b.num_tokens else 0)
            assert b.dense.abs().max() <= 3.0
        for b in s.eval_batches():
            validate_batch(b, s.spec)


def test_histories_match_reference_and_are_strictly_earlier(src, short_src, raw):
    for s in (src, short_src):
        batches = [next(s.train_batches(start_step=5)), next(s.eval_batches())]
        for b in batches:
            offs = b.seq_offsets_cpu.tolist()
            for i, (sid, items, ratings) in enumerate(rows_of(b)):
                ref_items, ref_ratings, ref_ts, n_earlier = reference_history(raw, sid, s.max_len)
                assert items == ref_items and ratings == ref_ratings, sid
                assert len(items) == min(n_earlier, s.max_len) <= s.max_len
                target_ts = int(raw["inter"][sid, 3])
                assert all(t < target_ts for t in ref_ts)  # strictly earlier: no leak
                assert ref_ts == sorted(ref_ts)  # oldest first
                # Sparse features of this row.
                g = b.sparse_offsets["genre"].tolist()
                raw_item = int(raw["inter"][sid, 1])
                assert int(b.sparse_ids["target_item"][i]) == raw["item_index"][raw_item]
                assert g[i + 1] - g[i] == len(raw["genres"][raw_item])
                label = float(raw["inter"][sid, 2] >= 4)
                assert float(b.labels[i, 0]) == label
                assert offs[i + 1] - offs[i] == len(items)


def test_some_histories_are_truncated_and_some_empty(short_src):
    lengths = torch.cat([b.seq_lengths_cpu() for b in short_src.eval_batches()])
    assert int(lengths.max()) == 8
    train = torch.cat(
        [b.seq_lengths_cpu() for b in itertools.islice(short_src.train_batches(), 50)]
    )
    assert int(train.min()) == 0  # first ratings of a user have an empty history


def test_time_split(src, raw):
    ts = torch.from_numpy(raw["inter"][:, 3]).double()  # float32 would round the seconds
    eval_ids = torch.cat([b.sample_ids for b in src.eval_batches()])
    assert eval_ids.numel() == src.num_eval
    assert eval_ids.unique().numel() == src.num_eval
    eval_ts = ts[eval_ids]
    assert bool((eval_ts >= src.cutoff).all())
    assert bool((eval_ts[1:] >= eval_ts[:-1]).all())  # eval in time order
    train_ids = torch.cat(
        [b.sample_ids for b in itertools.islice(src.train_batches(), src.batches_per_epoch)]
    )
    assert bool((ts[train_ids] < src.cutoff).all())
    assert not set(train_ids.tolist()) & set(eval_ids.tolist())
    # Cutoff is the 80% quantile of all timestamps.
    assert abs(float((ts < src.cutoff).double().mean()) - 0.8) < 0.01
    sizes = [b.batch_size for b in src.eval_batches()]
    assert all(x == 1024 for x in sizes[:-1]) and 0 < sizes[-1] <= 1024


def test_min_history_drops_short_train_samples(raw):
    s = MovieLensSource(make_cfg(movielens={"min_history": 5}, max_len=3))
    base = MovieLensSource(make_cfg(max_len=3))
    assert s.num_train < base.num_train and s.num_eval == base.num_eval
    b = next(s.train_batches())
    for sid in b.sample_ids.tolist():
        assert reference_history(raw, sid, 3)[3] >= 5


def test_epoch_is_a_permutation(src):
    n = src.batches_per_epoch
    first = torch.cat([b.sample_ids for b in itertools.islice(src.train_batches(), n)])
    assert first.unique().numel() == n * 256
    second = torch.cat([b.sample_ids for b in itertools.islice(src.train_batches(start_step=n), n)])
    assert second.unique().numel() == n * 256
    assert not torch.equal(first, second)  # each epoch is reshuffled


def test_determinism_and_resume(src):
    other = MovieLensSource(make_cfg())
    for a, b in zip(itertools.islice(src.train_batches(), 3), itertools.islice(other.train_batches(), 3)):
        assert_batches_equal(a, b)
    n = src.batches_per_epoch
    for k in (0, 7, n - 1, n, n + 3):
        stream = next(itertools.islice(src.train_batches(), k, None))
        assert_batches_equal(stream, next(other.train_batches(start_step=k)))
    reseeded = MovieLensSource(make_cfg(seed=99))
    assert not torch.equal(next(reseeded.train_batches()).sample_ids, next(src.train_batches()).sample_ids)


def test_labels(src):
    labels = torch.cat([b.labels for b in itertools.islice(src.train_batches(), 100)])
    assert labels.dtype == torch.float32
    assert set(labels.unique().tolist()) <= {0.0, 1.0}
    rate = float(labels.mean())
    print(f"train positive rate {rate:.3f}")
    assert 0.5 < rate < 0.6
    eval_rate = float(torch.cat([b.labels for b in src.eval_batches()]).mean())
    assert 0.45 < eval_rate < 0.65


def test_item_popularity_baseline(src):
    base = src.baselines()
    ne, a = base["item_popularity"]["ne"], base["item_popularity"]["auc"]
    print(f"item_popularity baseline: NE={ne:.4f} AUC={a:.4f}")
    assert 0.6 < a < 0.85
    assert 0.0 < ne < 1.0


def test_missing_recbole_is_a_user_error(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a, **k: None)
    with pytest.raises(UserError, match="pip install --no-deps recbole==1.2.1"):
        MovieLensSource(make_cfg())


def test_bad_config_values():
    with pytest.raises(UserError, match="eval_fraction"):
        MovieLensSource(make_cfg(movielens={"eval_fraction": 1.0}))
    with pytest.raises(UserError, match="batch_size"):
        MovieLensSource(make_cfg(batch_size=10**6))


def test_constructor_is_fast():
    import time

    t = time.perf_counter()
    MovieLensSource(make_cfg())
    elapsed = time.perf_counter() - t
    print(f"MovieLensSource() took {elapsed:.3f} s")
    assert elapsed < 3.0


def test_every_sample_once_per_epoch_across_ranks_and_an_interruption():
    """Two ranks with Base Batch Shuffling, the stream cut at a step inside the second epoch and
    resumed there (as a restart from a checkpoint does): per epoch, the samples of both ranks are
    distinct, and the cut stream is the uninterrupted one."""
    from gemctl.config.schema import ShuffleConfig
    from gemctl.data.shuffle import build_dealer

    cfg = make_cfg(batch_size=2048)
    shuffle = ShuffleConfig(name="bbs", kind="bbs", sub_batch_size=256)
    ranks = [MovieLensSource(cfg, dealer=build_dealer(shuffle, 2048, 2, r)) for r in range(2)]
    n = ranks[0].batches_per_epoch
    cut = n + n // 2 + 1
    for src in ranks:
        whole = [b.sample_ids for b in itertools.islice(src.train_batches(), 2 * n)]
        resumed = [b.sample_ids for b in itertools.islice(src.train_batches(), cut)]
        resumed += [b.sample_ids for b in itertools.islice(src.train_batches(start_step=cut), 2 * n - cut)]
        assert all(torch.equal(a, b) for a, b in zip(whole, resumed, strict=True))
        src.ids = resumed
    for epoch in range(2):
        ids = torch.cat([i for src in ranks for i in src.ids[epoch * n:(epoch + 1) * n]])
        assert ids.numel() == n * 2 * 2048 and ids.unique().numel() == ids.numel()
