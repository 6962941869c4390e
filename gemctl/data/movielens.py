"""MovieLens-100K as a source of jagged batches (the copy that ships in the recbole wheel).

Every rating event is one sample. Its history is the user's events with a strictly earlier
timestamp (the most recent ``max_len`` of them, oldest first); its label is
``rating >= movielens.positive_rating`` (task ``ctr``). Events are ordered by
(timestamp, row of the file) for stability; events of the same user at the same second are not
in each other's histories, so neither the target's rating nor a simultaneous one can leak.

Split by time: the cutoff is the ``1 - eval_fraction`` quantile of all event timestamps; events
at or after it are eval samples (their histories include the user's train-period events), earlier
events are train samples (those with fewer than ``min_history`` earlier events are dropped).

Features:
- sequence (shared offsets): ``item_id`` (contiguous movie ids), ``rating`` (the earlier event's
  rating as a token 0..5);
- sparse, one id per sample: ``user_id``, ``target_item`` (same remap as ``item_id``),
  ``age_bucket`` (7), ``gender`` (2), ``occupation``; multi-hot ``genre`` (the target movie's
  genres; empty for the genre "unknown");
- dense ``[B, 4]`` float32 in about [-3, 3]: log1p(history length) / log1p(max_len), time of day
  of the event in [0, 1), the movie's release year standardised (0 when unknown), and
  log1p(user's number of earlier events) / log1p(the largest such number).

Everything is precomputed at construction: flat per-user item and rating arrays in time order
plus per-sample (start, end) pointers, so building a batch is one vectorised gather.
"""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

from gemctl.data.batch import FeatureSpec, JaggedBatch, gather_spans, offsets_from_lengths
from gemctl.errors import ConfigError, UserError

_MISSING = (
    "data.source=movielens100k needs the MovieLens-100K file from the recbole wheel: "
    "pip install --no-deps recbole==1.2.1"
)

# MovieLens-1M style age groups: <18, 18-24, 25-34, 35-44, 45-49, 50-55, 56+.
_AGE_EDGES = np.array([18, 25, 35, 45, 50, 56])
NUM_AGE_BUCKETS = len(_AGE_EDGES) + 1
NUM_RATING_TOKENS = 6
NUM_DENSE = 4
POPULARITY_SMOOTHING = 10.0


def movielens100k_dir() -> Path:
    """The ml-100k directory inside the installed recbole package, found without importing it."""
    try:
        spec = importlib.util.find_spec("recbole")
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise UserError(_MISSING)
    d = Path(list(spec.submodule_search_locations)[0]) / "dataset_example" / "ml-100k"
    if not (d / "ml-100k.inter").is_file():
        raise UserError(_MISSING)
    return d


def _read_rows(path: Path) -> list[list[str]]:
    with open(path, encoding="utf-8", errors="replace") as f:
        lines = f.read().splitlines()
    return [line.split("\t") for line in lines[1:] if line]


def _seed_for(seed: int, epoch: int) -> int:
    state = np.random.SeedSequence([int(seed) & 0xFFFFFFFFFFFFFFFF, int(epoch)])
    return int(state.generate_state(1, dtype=np.uint64)[0] & np.uint64(0x7FFFFFFFFFFFFFFF))


class MovieLensSource:
    """MovieLens-100K per-user histories; implements :class:`gemctl.data.source.Source`."""

    def __init__(self, data_cfg, data_dir: str | Path | None = None, dealer=None):
        from gemctl.data.shuffle import Dealer

        self.dealer = dealer or Dealer()
        ml = data_cfg.movielens
        self.batch_size = int(data_cfg.batch_size)
        self.eval_batch_size = int(data_cfg.eval_batch_size)
        self.max_len = int(data_cfg.max_len)
        self.seed = int(data_cfg.seed)
        self.positive_rating = float(ml.positive_rating)
        self.eval_fraction = float(ml.eval_fraction)
        self.min_history = int(ml.min_history)
        if self.batch_size < 1:
            raise ConfigError("data.batch_size", f"must be >= 1, got {self.batch_size}")
        if self.eval_batch_size < 1:
            raise ConfigError("data.eval_batch_size", f"must be >= 1, got {self.eval_batch_size}")
        if self.max_len < 1:
            raise ConfigError("data.max_len", f"must be >= 1, got {self.max_len}")
        if not 0.0 < self.eval_fraction < 1.0:
            raise ConfigError(
                "data.movielens.eval_fraction", f"must be in (0, 1), got {self.eval_fraction}"
            )
        if self.min_history < 0:
            raise ConfigError("data.movielens.min_history", f"must be >= 0, got {self.min_history}")

        self.data_dir = Path(data_dir) if data_dir is not None else movielens100k_dir()
        self._load()

        self.spec = FeatureSpec(
            seq_features={"item_id": self.n_items, "rating": NUM_RATING_TOKENS},
            sparse_features={
                "user_id": self.n_users,
                "target_item": self.n_items,
                "age_bucket": NUM_AGE_BUCKETS,
                "gender": self.n_genders,
                "occupation": self.n_occupations,
                "genre": self.n_genres,
            },
            num_dense=NUM_DENSE,
            tasks=("ctr",),
            max_seq_len=self.max_len,
        )
        # One step consumes a local batch for every rank of the dealer's world.
        self.batches_per_epoch = self.num_train // (self.batch_size * self.dealer.world_size)
        if self.batches_per_epoch == 0:
            raise ConfigError(
                "data.batch_size",
                f"{self.batch_size} is larger than the {self.num_train} training samples",
            )

    # ------------------------------------------------------------------------------------------
    # Loading and precomputation.

    def _load(self) -> None:
        d = self.data_dir
        inter = np.loadtxt(d / "ml-100k.inter", dtype=np.int64, delimiter="\t", skiprows=1, ndmin=2)
        if inter.shape[0] == 0 or inter.shape[1] < 4:
            raise UserError(f"{d / 'ml-100k.inter'}: expected columns user, item, rating, timestamp")
        raw_user, raw_item, rating, ts = (inter[:, i] for i in range(4))
        n = len(ts)
        if rating.min() < 0 or rating.max() >= NUM_RATING_TOKENS:
            raise UserError(f"{d / 'ml-100k.inter'}: ratings must be integers in 0..5")

        # Users: ids from the user file (plus any only in the interactions).
        user_rows = _read_rows(d / "ml-100k.user")
        file_users = np.array([int(r[0]) for r in user_rows], dtype=np.int64)
        users = np.unique(np.concatenate([file_users, raw_user]))
        self.n_users = len(users)
        user = np.searchsorted(users, raw_user)
        age = np.full(self.n_users, 30, dtype=np.int64)
        gender_tok = np.zeros(self.n_users, dtype=np.int64)
        occ_names = sorted({r[3] for r in user_rows})
        occ_index = {name: i for i, name in enumerate(occ_names)}
        occupation = np.zeros(self.n_users, dtype=np.int64)
        pos = np.searchsorted(users, file_users)
        age[pos] = [int(r[1]) for r in user_rows]
        gender_tok[pos] = [1 if r[2] == "F" else 0 for r in user_rows]
        occupation[pos] = [occ_index[r[3]] for r in user_rows]
        self.n_genders = 2
        self.n_occupations = max(len(occ_names), 1)
        self.occupation_names = occ_names
        self._user_age_bucket = torch.from_numpy(np.searchsorted(_AGE_EDGES, age, side="right"))
        self._user_gender = torch.from_numpy(gender_tok)
        self._user_occupation = torch.from_numpy(occupation)

        # Items: ids from the item file (plus any only in the interactions).
        item_rows = _read_rows(d / "ml-100k.item")
        file_items = np.array([int(r[0]) for r in item_rows], dtype=np.int64)
        items = np.unique(np.concatenate([file_items, raw_item]))
        self.n_items = len(items)
        item = np.searchsorted(items, raw_item)
        ipos = np.searchsorted(items, file_items)
        year = np.full(self.n_items, np.nan)
        genre_lists: list[list[str]] = [[] for _ in range(self.n_items)]
        for p, r in zip(ipos, item_rows):
            y = r[2].strip() if len(r) > 2 else ""
            if y.isdigit():
                year[p] = float(y)
            if len(r) > 3:
                genre_lists[p] = [g for g in r[3].split() if g and g.lower() != "unknown"]
        genre_names = sorted({g for gl in genre_lists for g in gl})
        genre_index = {g: i for i, g in enumerate(genre_names)}
        self.genre_names = genre_names
        self.n_genres = max(len(genre_names), 1)
        glen = torch.tensor([len(gl) for gl in genre_lists], dtype=torch.int64)
        self._item_genre_offsets = offsets_from_lengths(glen)
        self._item_genre_ids = torch.tensor(
            [genre_index[g] for gl in genre_lists for g in gl], dtype=torch.int64
        )
        known = ~np.isnan(year)
        if known.any():
            mu, sd = year[known].mean(), year[known].std()
            year_z = np.where(known, (year - mu) / max(sd, 1.0), 0.0)
        else:
            year_z = np.zeros(self.n_items)
        self._item_year_z = torch.from_numpy(np.clip(year_z, -3.0, 3.0).astype(np.float32))

        # Time order per user: (user, timestamp, file row).
        rows = np.arange(n, dtype=np.int64)
        order = np.lexsort((rows, ts, user))
        u_s, ts_s = user[order], ts[order]
        counts = np.bincount(u_s, minlength=self.n_users)
        user_start = np.zeros(self.n_users + 1, dtype=np.int64)
        np.cumsum(counts, out=user_start[1:])
        # History of event j: the user's events strictly earlier in time, i.e. those before the
        # first event of j's (user, timestamp) group.
        new_group = np.ones(n, dtype=bool)
        new_group[1:] = (u_s[1:] != u_s[:-1]) | (ts_s[1:] != ts_s[:-1])
        group_start = np.maximum.accumulate(np.where(new_group, rows, 0))
        first = user_start[u_s]
        n_earlier = group_start - first
        hist_end = group_start
        hist_start = np.maximum(first, hist_end - self.max_len)

        self._flat_item = torch.from_numpy(item[order])
        self._flat_rating = torch.from_numpy(rating[order])

        # Split by time.
        self.cutoff = float(np.quantile(ts.astype(np.float64), 1.0 - self.eval_fraction))
        is_eval = ts_s >= self.cutoff
        train_pos = np.nonzero(~is_eval & (n_earlier >= self.min_history))[0]
        eval_pos = np.nonzero(is_eval)[0]
        # Eval samples in time order (timestamp, file row).
        eval_pos = eval_pos[np.lexsort((order[eval_pos], ts_s[eval_pos]))]

        # Per-sample columns, indexed by sorted position.
        max_earlier = max(int(n_earlier.max()), 1)
        hist_len = hist_end - hist_start
        dense = np.stack(
            [
                np.log1p(hist_len) / math.log1p(self.max_len),
                (ts_s % 86400) / 86400.0,
                year_z.astype(np.float64)[item[order]].clip(-3.0, 3.0),
                np.log1p(n_earlier) / math.log1p(max_earlier),
            ],
            axis=1,
        ).astype(np.float32)
        self._s_start = torch.from_numpy(hist_start)
        self._s_end = torch.from_numpy(hist_end)
        self._s_user = torch.from_numpy(u_s)
        self._s_item = torch.from_numpy(item[order])
        self._s_label = torch.from_numpy((rating[order] >= self.positive_rating).astype(np.float32))
        self._s_ts = torch.from_numpy(ts_s)
        self._s_id = torch.from_numpy(order)  # row of the event in ml-100k.inter
        self._s_dense = torch.from_numpy(dense)
        self._train_pos = torch.from_numpy(train_pos)
        self._eval_pos = torch.from_numpy(eval_pos)
        self.num_train = len(train_pos)
        self.num_eval = len(eval_pos)
        self.n_events = n

    # ------------------------------------------------------------------------------------------
    # Batches.

    def _batch(self, pos: torch.Tensor) -> JaggedBatch:
        """Gather the samples at sorted positions ``pos`` into one batch."""
        starts, ends = self._s_start[pos], self._s_end[pos]
        lengths = ends - starts
        idx, offsets = gather_spans(starts, ends)
        b = pos.numel()
        ones = torch.arange(b + 1, dtype=torch.int64)
        users, targets = self._s_user[pos], self._s_item[pos]
        gidx, goffs = gather_spans(self._item_genre_offsets[targets], self._item_genre_offsets[targets + 1])
        return JaggedBatch(
            seq_ids={"item_id": self._flat_item[idx], "rating": self._flat_rating[idx]},
            seq_offsets=offsets,
            seq_offsets_cpu=offsets,
            max_seq_len=int(lengths.max()) if b else 0,
            sparse_ids={
                "user_id": users,
                "target_item": targets,
                "age_bucket": self._user_age_bucket[users],
                "gender": self._user_gender[users],
                "occupation": self._user_occupation[users],
                "genre": self._item_genre_ids[gidx],
            },
            sparse_offsets={
                "user_id": ones,
                "target_item": ones,
                "age_bucket": ones,
                "gender": ones,
                "occupation": ones,
                "genre": goffs,
            },
            dense=self._s_dense[pos],
            labels=self._s_label[pos].unsqueeze(1),
            sample_ids=self._s_id[pos],
        )

    def epoch_permutation(self, epoch: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(_seed_for(self.seed, epoch))
        return torch.randperm(self.num_train, generator=g)

    def train_batches(self, start_step: int = 0) -> Iterator[JaggedBatch]:
        if start_step < 0:
            raise ValueError(f"start_step must be >= 0, got {start_step}")
        bpe = self.batches_per_epoch
        step = int(start_step)
        epoch, perm = -1, None
        while True:
            e, k = divmod(step, bpe)
            if e != epoch:
                epoch, perm = e, self.epoch_permutation(e)
            yield self._batch(self._step_positions(perm, k))
            step += 1

    def _step_positions(self, perm: torch.Tensor, k: int) -> torch.Tensor:
        """This rank's sample positions at step ``k`` of an epoch with permutation ``perm``."""
        d = self.dealer
        per_step = self.batch_size * d.world_size
        unit = self.batch_size // d.units_per_rank
        pos = self._train_pos[perm[k * per_step : (k + 1) * per_step]].view(d.units_per_step, unit)
        lengths = [self._s_end[p] - self._s_start[p] for p in pos] if d.kind == "bbs" else None
        return torch.cat([pos[i] for i in d.my_units(lengths)])

    def eval_batches(self) -> Iterator[JaggedBatch]:
        for i in range(0, self.num_eval, self.eval_batch_size):
            yield self._batch(self._eval_pos[i : i + self.eval_batch_size])

    # ------------------------------------------------------------------------------------------
    # Reference predictors.

    def baselines(self) -> dict[str, dict[str, float]]:
        from gemctl.metrics.quality import auc, normalized_entropy

        tr, ev = self._train_pos, self._eval_pos
        y_tr = self._s_label[tr].double()
        p_global = float(y_tr.mean())
        n_i = torch.bincount(self._s_item[tr], minlength=self.n_items).double()
        pos_i = torch.zeros(self.n_items, dtype=torch.float64).index_add_(0, self._s_item[tr], y_tr)
        m = POPULARITY_SMOOTHING
        rate = (pos_i + m * p_global) / (n_i + m)
        preds, labels = rate[self._s_item[ev]], self._s_label[ev]
        return {
            "item_popularity": {
                "ne": normalized_entropy(preds, labels),
                "auc": auc(preds, labels),
            }
        }
