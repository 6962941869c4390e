"""Your own data from Parquet files: one row per sample (``data=parquet``, data.parquet.*).

Columns, named in the config:

- ``seq_features``: "column:vocabulary size" each: a list of integer ids, the user's history in
  time order (oldest first); every history column of a row has the same length. Histories longer
  than ``data.max_len`` keep their latest ``max_len`` events.
- ``sparse_features``: "column:vocabulary size" each: an integer id, or a list of ids (a multi-hot bag).
- ``dense``: float columns, one dense feature each (any number, also none).
- ``labels``: 0/1 columns, one task each (the task is named after its column).
- ``weight`` (optional): a float column of sample weights (loss and eval metrics weighted).
- ``sample_id`` (optional): an int64 column; the row number otherwise.

``data.parquet.train`` and ``data.parquet.eval`` are a file, a directory of ``*.parquet`` files, or
a glob. Both load into host memory once (pyarrow, ``pip install 'gemctl[parquet]'``; list columns
with 64-bit offsets, the files' column types promoted to a common one); each epoch deals a fresh
permutation of the training rows (seeded by data.seed, as the other sources), so batch k is the
same however the run got there (resume, data-loader workers). Bad data stops the run with one
line naming the column and the first bad row (and its file, where a split has several): a missing
column, a wrong type, a null, an id outside its vocabulary, history columns of unequal length, a
label outside [0, 1], a negative or non-finite weight, an empty eval split.
"""

from __future__ import annotations

import glob
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

from gemctl.data.batch import FeatureSpec, JaggedBatch, gather_spans
from gemctl.errors import ConfigError, DataError


def _columns(entries, field: str) -> dict[str, int]:
    """["item_id:100000", ...] -> {"item_id": 100000}; ConfigError naming the field otherwise."""
    out = {}
    for i, entry in enumerate(entries):
        name, sep, vocab = str(entry).rpartition(":")
        if not sep or not name or not vocab.isdigit() or int(vocab) < 1:
            raise ConfigError(f"{field}[{i}]", f"'{entry}' is not column:vocabulary size (a whole number >= 1), "
                              "e.g. item_id:100000")
        if name in out:
            raise ConfigError(f"{field}[{i}]", f"column '{name}' is named twice")
        out[name] = int(vocab)
    return out


def _files(spec: str, field: str) -> list[str]:
    if not spec:
        raise ConfigError(field, "names no Parquet file: give a file, a directory of *.parquet files or a glob")
    p = Path(spec)
    files = sorted(str(f) for f in p.glob("*.parquet")) if p.is_dir() else sorted(glob.glob(spec))
    if not files:
        raise ConfigError(field, f"'{spec}' matches no Parquet file")
    return files


def _read(files: list[str], columns: list[str], split: str):
    """The files' columns as one table (list columns as large_list: int64 offsets, so a split may
    hold more than 2^31 events), and a function naming the file and row of a row of the table."""
    try:
        import pyarrow.parquet as pq
    except ImportError as exc:
        raise ConfigError("data.source", "'parquet' needs pyarrow: pip install 'gemctl[parquet]' (or pyarrow)") from exc
    import pyarrow as pa

    tables, starts = [], [0]
    for f in files:
        have = pq.read_schema(f).names
        missing = [c for c in columns if c not in have]
        if missing:
            raise DataError(missing[0], f"no such column in {f} (its columns: {', '.join(have)})")
        t = pq.read_table(f, columns=columns)
        t = t.cast(pa.schema([pa.field(x.name, pa.large_list(x.type.value_type)) if pa.types.is_list(x.type) else x
                              for x in t.schema]))
        tables.append(t)
        starts.append(starts[-1] + t.num_rows)
    try:
        table = pa.concat_tables(tables, promote_options="permissive") if len(tables) > 1 else tables[0]
    except (pa.ArrowInvalid, pa.ArrowTypeError) as exc:
        raise DataError(f"data.parquet.{split}", f"the files' column types do not agree: {str(exc).splitlines()[0]}") from exc

    def where(row: int) -> str:
        i = int(np.searchsorted(starts, row, side="right")) - 1
        return f"row {row - starts[i]} of {files[i]}" if len(files) > 1 else f"row {row} of {split}"

    return table.combine_chunks(), where


class _Jagged:
    """One list column: values (torch int64) and per-row offsets; or a scalar column as lists of 1."""

    def __init__(self, table, name: str, vocab: int, where, history: bool = False):
        import pyarrow as pa

        rows = table.num_rows
        if not rows:
            self.values, self.offsets = torch.zeros(0, dtype=torch.int64), torch.zeros(1, dtype=torch.int64)
            return
        col = table.column(name).combine_chunks()
        if pa.types.is_large_list(col.type):
            if col.null_count:
                raise DataError(name, f"null list in {where(_first_null(col))}")
            offsets = np.asarray(col.offsets, dtype=np.int64)
            offsets = offsets - offsets[0]
            flat = col.flatten()
            values_type = col.type.value_type
        elif history:
            raise DataError(name, f"a history column must hold lists of ids, got {col.type}")
        else:
            offsets = np.arange(rows + 1, dtype=np.int64)
            flat = col
            values_type = col.type
        if not pa.types.is_integer(values_type):
            raise DataError(name, f"ids must be integers, got {values_type}")
        if flat.null_count:
            raise DataError(name, f"null id in {where(int(np.searchsorted(offsets, _first_null(flat), 'right')) - 1)}")
        self.values = _int64(flat, name, "ids")
        self.offsets = torch.from_numpy(offsets)
        if self.values.numel():
            bad = ((self.values < 0) | (self.values >= vocab)).nonzero()
            if bad.numel():
                i = int(bad[0])
                row = int(torch.searchsorted(self.offsets, torch.tensor(i), right=True)) - 1
                raise DataError(name, f"id {int(self.values[i])} in {where(row)} is outside its vocabulary [0, {vocab})")

    @property
    def lengths(self) -> torch.Tensor:
        return self.offsets[1:] - self.offsets[:-1]


def _first_null(arr) -> int:
    return int(np.flatnonzero(~np.asarray(arr.is_valid()))[0])


def _floats(table, name: str, where) -> torch.Tensor:
    """A number column (float, integer or boolean) as float32 (large integers round)."""
    import pyarrow as pa

    col = table.column(name).combine_chunks()
    if not (pa.types.is_floating(col.type) or pa.types.is_integer(col.type) or pa.types.is_boolean(col.type)):
        raise DataError(name, f"must be a number column, got {col.type}")
    if col.null_count:
        raise DataError(name, f"null value in {where(_first_null(col))}")
    return torch.from_numpy(col.to_numpy(zero_copy_only=False).astype(np.float32))


def _int64(arr, name: str, what: str) -> torch.Tensor:
    """An integer pyarrow array (no nulls) as int64, copied once; uint64 values past int64 refused."""
    raw = np.asarray(arr)
    if raw.dtype == np.uint64 and raw.size and int(raw.max()) >= 2**63:
        raise DataError(name, f"{what} must be below 2^63, got {int(raw.max())}")
    return torch.from_numpy(raw.astype(np.int64))


def _sample_ids(table, name: str) -> torch.Tensor:
    """An integer column, one id a row (below 2^63)."""
    import pyarrow as pa

    col = table.column(name).combine_chunks()
    if not pa.types.is_integer(col.type):
        raise DataError(name, f"sample ids must be one integer a row, got {col.type}")
    if col.null_count:
        raise DataError(name, f"null sample id in row {_first_null(col)}")
    return _int64(col, name, "sample ids")


class _Split:
    """One split in host memory, gathered into batches by row positions."""

    def __init__(self, read, pcfg, seq_vocab: dict, sparse_vocab: dict, max_len: int):
        table, where = read
        self.rows = table.num_rows
        seq = {n: _Jagged(table, n, v, where, history=True) for n, v in seq_vocab.items()}
        first = next(iter(seq.values()))
        for name, col in seq.items():
            bad = (col.lengths != first.lengths).nonzero()
            if bad.numel():
                r = int(bad[0])
                raise DataError(name, f"{where(r)} has {int(col.lengths[r])} events, {next(iter(seq))} has "
                                      f"{int(first.lengths[r])}: history columns must be of equal length")
        self.seq = seq
        self.seq_end = first.offsets[1:]
        self.seq_start = torch.maximum(first.offsets[:-1], self.seq_end - max_len)  # the latest max_len events
        self.sparse = {n: _Jagged(table, n, v, where) for n, v in sparse_vocab.items()}
        self.dense = (torch.stack([_floats(table, c, where) for c in pcfg.dense], 1) if len(pcfg.dense)
                      else torch.zeros(self.rows, 0))
        self.labels = (torch.stack([_floats(table, c, where) for c in pcfg.labels], 1) if self.rows
                       else torch.zeros(0, len(pcfg.labels)))
        for t, c in enumerate(pcfg.labels):
            bad = ((self.labels[:, t] < 0) | (self.labels[:, t] > 1) | self.labels[:, t].isnan()).nonzero()
            if bad.numel():
                r = int(bad[0])
                raise DataError(c, f"label {float(self.labels[r, t])} in {where(r)} is not in [0, 1]")
        bad = (~torch.isfinite(self.dense)).any(1).nonzero() if self.dense.numel() else torch.zeros(0)
        if bad.numel():
            r = int(bad[0])
            c = pcfg.dense[int((~torch.isfinite(self.dense[r])).nonzero()[0])]
            raise DataError(c, f"non-finite value in {where(r)}")
        self.weights = _floats(table, pcfg.weight, where) if pcfg.weight else None
        if self.weights is not None:
            bad = (~torch.isfinite(self.weights) | (self.weights < 0)).nonzero()
            if bad.numel():
                r = int(bad[0])
                raise DataError(pcfg.weight, f"weight {float(self.weights[r])} in {where(r)} is not a finite number >= 0")
        self.ids = _sample_ids(table, pcfg.sample_id) if pcfg.sample_id else torch.arange(self.rows, dtype=torch.int64)

    def batch(self, pos: torch.Tensor) -> JaggedBatch:
        starts, ends = self.seq_start[pos], self.seq_end[pos]
        index, offsets = gather_spans(starts, ends)  # the history columns share their spans
        seq_ids = {name: col.values[index] for name, col in self.seq.items()}
        sparse_ids, sparse_offsets = {}, {}
        for name, col in self.sparse.items():
            bag, sparse_offsets[name] = gather_spans(col.offsets[:-1][pos], col.offsets[1:][pos])
            sparse_ids[name] = col.values[bag]
        lengths = ends - starts
        return JaggedBatch(
            seq_ids=seq_ids, seq_offsets=offsets, seq_offsets_cpu=offsets,
            max_seq_len=int(lengths.max()) if pos.numel() else 0,
            sparse_ids=sparse_ids, sparse_offsets=sparse_offsets,
            dense=self.dense[pos], labels=self.labels[pos], sample_ids=self.ids[pos],
            weights=None if self.weights is None else self.weights[pos],
        )


class ParquetSource:
    """Samples from Parquet files; implements :class:`gemctl.data.source.Source`."""

    def __init__(self, data_cfg, dealer=None):
        from gemctl.data.shuffle import Dealer

        pcfg = data_cfg.parquet
        self.dealer = dealer or Dealer()
        self.batch_size = int(data_cfg.batch_size)
        self.eval_batch_size = int(data_cfg.eval_batch_size)
        self.seed = int(data_cfg.seed)
        max_len = int(data_cfg.max_len)
        seq_vocab = _columns(pcfg.seq_features, "data.parquet.seq_features")
        sparse_vocab = _columns(pcfg.sparse_features, "data.parquet.sparse_features")
        if not seq_vocab:
            raise ConfigError("data.parquet.seq_features", "names no history column: give [column:vocabulary size, ...]")
        if not len(pcfg.labels):
            raise ConfigError("data.parquet.labels", "names no label column")
        columns = [*seq_vocab, *sparse_vocab, *pcfg.dense, *pcfg.labels,
                   *([pcfg.weight] if pcfg.weight else []), *([pcfg.sample_id] if pcfg.sample_id else [])]
        dup = sorted({c for c in columns if columns.count(c) > 1})
        if dup:
            raise ConfigError("data.parquet", f"column '{dup[0]}' is named twice")
        self.train, self.eval = (
            _Split(_read(_files(getattr(pcfg, s), f"data.parquet.{s}"), columns, s), pcfg, seq_vocab, sparse_vocab,
                   max_len) for s in ("train", "eval"))
        if not self.eval.rows:
            raise ConfigError("data.parquet.eval", f"'{pcfg.eval}' has no rows: the run evaluates on them")
        self.spec = FeatureSpec(
            seq_features=seq_vocab,
            sparse_features=sparse_vocab,
            num_dense=len(pcfg.dense),
            tasks=tuple(pcfg.labels),
            max_seq_len=max_len,
        )
        self.batches_per_epoch = self.train.rows // (self.batch_size * self.dealer.world_size)
        if self.batches_per_epoch == 0:
            raise ConfigError("data.batch_size", f"{self.batch_size} x {self.dealer.world_size} ranks is more than the "
                              f"{self.train.rows} training rows")
        self._perm: tuple[int, torch.Tensor] | None = None

    def _epoch_perm(self, epoch: int) -> torch.Tensor:
        if self._perm is None or self._perm[0] != epoch:
            g = torch.Generator().manual_seed((self.seed * 1_000_003 + epoch) % 2**63)
            self._perm = (epoch, torch.randperm(self.train.rows, generator=g))
        return self._perm[1]

    def train_batch(self, step: int) -> JaggedBatch:
        """This rank's batch of global step ``step`` (random access: resume and loader workers)."""
        epoch, k = divmod(int(step), self.batches_per_epoch)
        d = self.dealer
        per_step = self.batch_size * d.world_size
        unit = self.batch_size // d.units_per_rank
        pos = self._epoch_perm(epoch)[k * per_step:(k + 1) * per_step].view(d.units_per_step, unit)
        lengths = [self.train.seq_end[p] - self.train.seq_start[p] for p in pos] if d.kind == "bbs" else None
        return self.train.batch(torch.cat([pos[i] for i in d.my_units(lengths)]))

    def train_batches(self, start_step: int = 0) -> Iterator[JaggedBatch]:
        if start_step < 0:
            raise ValueError(f"start_step must be >= 0, got {start_step}")
        step = int(start_step)
        while True:
            yield self.train_batch(step)
            step += 1

    def eval_batches(self) -> Iterator[JaggedBatch]:
        for i in range(0, self.eval.rows, self.eval_batch_size):
            yield self.eval.batch(torch.arange(i, min(i + self.eval_batch_size, self.eval.rows)))

    def baselines(self) -> dict[str, dict[str, float]]:
        """The training label rate (weighted where the rows are) as the prediction of every held-out
        sample (NE about 1, AUC 0.5): the floor any model must beat."""
        from gemctl.metrics.quality import auc, normalized_entropy

        w = self.train.weights
        y_tr = self.train.labels[:, 0]
        rate = float(y_tr.mean() if w is None else (w * y_tr).sum() / w.sum().clamp_min(1e-30))
        y = self.eval.labels[:, 0]
        p = torch.full_like(y, rate)
        return {"train_rate": {"ne": normalized_entropy(p, y, self.eval.weights), "auc": auc(p, y, self.eval.weights)}}
