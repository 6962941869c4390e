"""The jagged batch: one dataclass of tensors that every source produces and the model consumes.

Layout (B samples, T tasks, N = total history tokens in the batch):
- sequence features: ``seq_ids[name]`` int64 ``[N]``, all sharing ``seq_offsets`` int64 ``[B+1]``
  (offsets[0] = 0, non-decreasing); ``max_seq_len`` is a Python int computed once on the host;
  ``seq_offsets_cpu`` is a host copy so FLOP counting and kernel scheduling never sync the device.
- sparse non-sequence features: ``sparse_ids[name]`` int64 values with ``sparse_offsets[name]``
  ``[B+1]`` (multi-hot allowed); converted to a torchrec ``KeyedJaggedTensor`` by
  :meth:`JaggedBatch.sparse_kjt` (built from lengths and offsets, which works on CUDA without the
  CUDA build of fbgemm).
- dense features ``[B, F]`` float32; labels ``[B, T]`` float32 in {0, 1}; optional weights ``[B]``;
  ``sample_ids`` int64 ``[B]`` identify samples across shuffling, restarts and error reports.
Zero-length sequences are legal everywhere.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from gemctl.errors import DataError


@dataclass(frozen=True)
class FeatureSpec:
    """What a data source produces: feature names, vocabulary sizes, dense width and tasks."""

    seq_features: dict[str, int]  # name -> num_embeddings (ids must be < this)
    sparse_features: dict[str, int]  # name -> num_embeddings
    num_dense: int
    tasks: tuple[str, ...]
    max_seq_len: int


@dataclass
class JaggedBatch:
    seq_ids: dict[str, torch.Tensor]  # name -> [N] int64
    seq_offsets: torch.Tensor  # [B+1] int64
    seq_offsets_cpu: torch.Tensor  # [B+1] int64, always on the host
    max_seq_len: int  # max over the batch of the sequence lengths (host int)
    sparse_ids: dict[str, torch.Tensor]  # name -> [nnz] int64
    sparse_offsets: dict[str, torch.Tensor]  # name -> [B+1] int64
    dense: torch.Tensor  # [B, F] float32
    labels: torch.Tensor  # [B, T] float32
    sample_ids: torch.Tensor  # [B] int64
    weights: torch.Tensor | None = None  # [B] float32
    extras: dict[str, object] = field(default_factory=dict)

    @property
    def batch_size(self) -> int:
        return self.dense.shape[0]

    @property
    def num_tokens(self) -> int:
        return int(self.seq_offsets_cpu[-1])

    def seq_lengths_cpu(self) -> torch.Tensor:
        return self.seq_offsets_cpu[1:] - self.seq_offsets_cpu[:-1]

    def map_tensors(self, fn) -> "JaggedBatch":
        """A copy with ``fn`` applied to every tensor except the host offsets."""

        def f(t):
            return None if t is None else fn(t)

        return dataclasses.replace(
            self,
            seq_ids={k: f(v) for k, v in self.seq_ids.items()},
            seq_offsets=f(self.seq_offsets),
            sparse_ids={k: f(v) for k, v in self.sparse_ids.items()},
            sparse_offsets={k: f(v) for k, v in self.sparse_offsets.items()},
            dense=f(self.dense),
            labels=f(self.labels),
            sample_ids=f(self.sample_ids),
            weights=f(self.weights),
        )

    def to(self, device: torch.device | str, non_blocking: bool = False) -> "JaggedBatch":
        from gemctl.ops import host

        moved = self.map_tensors(lambda t: t.to(device, non_blocking=non_blocking))
        # Kernels plan their grids from the host copy: link it to the device offsets.
        host.register(moved.seq_offsets, self.seq_offsets_cpu)
        return moved

    def pin_memory(self) -> "JaggedBatch":
        return self.map_tensors(torch.Tensor.pin_memory)

    def seq_kjt(self):
        """Sequence ids as a KeyedJaggedTensor (all keys share the sequence offsets)."""
        return _kjt(self.seq_ids, {k: self.seq_offsets for k in self.seq_ids})

    def sparse_kjt(self):
        """Non-sequence sparse ids as a KeyedJaggedTensor."""
        return _kjt(self.sparse_ids, self.sparse_offsets)


def _kjt(values: dict[str, torch.Tensor], offsets: dict[str, torch.Tensor]):
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    keys = list(values)
    lengths = torch.cat([(offsets[k][1:] - offsets[k][:-1]) for k in keys]).to(torch.int32)
    vals = torch.cat([values[k] for k in keys])
    # Offsets of the concatenated layout; passing them avoids torchrec computing them with
    # fbgemm ops that only its CUDA build has.
    kjt_offsets = torch.zeros(lengths.numel() + 1, dtype=torch.int64, device=vals.device)
    torch.cumsum(lengths, 0, out=kjt_offsets[1:])
    return KeyedJaggedTensor(keys=keys, values=vals, lengths=lengths, offsets=kjt_offsets)


def concat_batches(batches: list[JaggedBatch]) -> JaggedBatch:
    """One batch holding the samples of ``batches`` in order (host tensors)."""
    if len(batches) == 1:
        return batches[0]

    def cat_offsets(offs: list[torch.Tensor]) -> torch.Tensor:
        lengths = torch.cat([o[1:] - o[:-1] for o in offs])
        return offsets_from_lengths(lengths)

    first = batches[0]
    seq_offsets = cat_offsets([b.seq_offsets_cpu for b in batches])
    weights = None if first.weights is None else torch.cat([b.weights for b in batches])
    return JaggedBatch(
        seq_ids={k: torch.cat([b.seq_ids[k] for b in batches]) for k in first.seq_ids},
        seq_offsets=seq_offsets,
        seq_offsets_cpu=seq_offsets,
        max_seq_len=max(b.max_seq_len for b in batches),
        sparse_ids={k: torch.cat([b.sparse_ids[k] for b in batches]) for k in first.sparse_ids},
        sparse_offsets={k: cat_offsets([b.sparse_offsets[k] for b in batches]) for k in first.sparse_offsets},
        dense=torch.cat([b.dense for b in batches]),
        labels=torch.cat([b.labels for b in batches]),
        sample_ids=torch.cat([b.sample_ids for b in batches]),
        weights=weights,
    )


def offsets_from_lengths(lengths: torch.Tensor) -> torch.Tensor:
    out = torch.zeros(lengths.numel() + 1, dtype=torch.int64)
    torch.cumsum(lengths.to(torch.int64), 0, out=out[1:])
    return out


def gather_spans(starts: torch.Tensor, ends: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows [starts[i], ends[i]) of a flat array, one span after another: (the flat index of every
    gathered row, the offsets [B+1] of the spans in it). Host tensors; no Python loop."""
    lengths = ends - starts
    offsets = offsets_from_lengths(lengths)
    total = int(offsets[-1])
    index = torch.arange(total, dtype=torch.int64) + torch.repeat_interleave(
        starts - offsets[:-1], lengths, output_size=total)
    return index, offsets


# ----------------------------------------------------------------------------------------------
# Validation: bad data is rejected with the feature name and the first offending row.


def _check_offsets(name: str, offsets: torch.Tensor, batch_size: int, numel: int) -> None:
    if offsets.dtype != torch.int64:
        raise DataError(name, f"offsets must be int64, got {offsets.dtype}")
    if offsets.dim() != 1 or offsets.numel() != batch_size + 1:
        raise DataError(
            name, f"offsets must have shape [{batch_size + 1}], got {list(offsets.shape)}"
        )
    if int(offsets[0]) != 0:
        raise DataError(name, f"offsets[0] must be 0, got {int(offsets[0])} (row 0)")
    lengths = offsets[1:] - offsets[:-1]
    bad = (lengths < 0).nonzero()
    if bad.numel():
        row = int(bad[0])
        raise DataError(
            name,
            f"offsets must be non-decreasing; row {row} has offsets {int(offsets[row])} -> "
            f"{int(offsets[row + 1])}",
        )
    if int(offsets[-1]) != numel:
        raise DataError(name, f"offsets end at {int(offsets[-1])} but there are {numel} values")


def _check_ids(name: str, ids: torch.Tensor, offsets: torch.Tensor, num_embeddings: int) -> None:
    if ids.dtype != torch.int64:
        raise DataError(name, f"ids must be int64, got {ids.dtype}")
    bad = ((ids < 0) | (ids >= num_embeddings)).nonzero()
    if bad.numel():
        pos = int(bad[0])
        row = int(torch.searchsorted(offsets, torch.tensor(pos), right=True)) - 1
        raise DataError(
            name,
            f"id {int(ids[pos])} in row {row} is outside the table [0, {num_embeddings})",
        )


def validate_batch(batch: JaggedBatch, spec: FeatureSpec) -> None:
    """Raise :class:`DataError` naming the feature and the first bad row; check on the host."""
    b = batch.batch_size
    for name, num in spec.seq_features.items():
        if name not in batch.seq_ids:
            raise DataError(name, "sequence feature missing from the batch")
    _check_offsets("seq_offsets", batch.seq_offsets_cpu, b, batch.num_tokens)
    if not torch.equal(batch.seq_offsets.cpu(), batch.seq_offsets_cpu):
        raise DataError("seq_offsets", "device offsets differ from the host copy")
    lengths = batch.seq_lengths_cpu()
    if lengths.numel() and int(lengths.max()) != batch.max_seq_len:
        raise DataError(
            "seq_offsets",
            f"max_seq_len is {batch.max_seq_len} but the longest row has {int(lengths.max())}",
        )
    if batch.max_seq_len > spec.max_seq_len:
        row = int(lengths.argmax())
        raise DataError(
            "seq_offsets", f"row {row} has length {batch.max_seq_len} > max_len {spec.max_seq_len}"
        )
    for name, num in spec.seq_features.items():
        ids = batch.seq_ids[name]
        if ids.numel() != batch.num_tokens:
            raise DataError(name, f"has {ids.numel()} values, offsets say {batch.num_tokens}")
        _check_ids(name, ids, batch.seq_offsets_cpu, num)
    for name, num in spec.sparse_features.items():
        if name not in batch.sparse_ids:
            raise DataError(name, "sparse feature missing from the batch")
        ids, offs = batch.sparse_ids[name], batch.sparse_offsets[name]
        _check_offsets(name, offs, b, ids.numel())
        _check_ids(name, ids, offs, num)
    if batch.dense.dtype != torch.float32:
        raise DataError("dense", f"must be float32, got {batch.dense.dtype}")
    if batch.dense.shape != (b, spec.num_dense):
        raise DataError("dense", f"must have shape [{b}, {spec.num_dense}], got {list(batch.dense.shape)}")
    bad = (~torch.isfinite(batch.dense)).any(1).nonzero()
    if bad.numel():
        raise DataError("dense", f"non-finite value in row {int(bad[0])}")
    if batch.labels.dtype != torch.float32:
        raise DataError("labels", f"must be float32, got {batch.labels.dtype}")
    if batch.labels.shape != (b, len(spec.tasks)):
        raise DataError(
            "labels", f"must have shape [{b}, {len(spec.tasks)}], got {list(batch.labels.shape)}"
        )
    for t, task in enumerate(spec.tasks):
        col = batch.labels[:, t]
        bad = (torch.isnan(col) | (col < 0) | (col > 1)).nonzero()
        if bad.numel():
            row = int(bad[0])
            raise DataError(f"labels.{task}", f"label {float(col[row])} in row {row} is not in [0, 1]")
    if batch.sample_ids.dtype != torch.int64 or batch.sample_ids.shape != (b,):
        raise DataError("sample_ids", f"must be int64 of shape [{b}]")
    if batch.weights is not None:
        w = batch.weights
        if w.dtype != torch.float32 or w.shape != (b,):
            raise DataError("weights", f"must be float32 of shape [{b}], got {w.dtype} {list(w.shape)}")
        bad = (~torch.isfinite(w) | (w < 0)).nonzero()
        if bad.numel():
            row = int(bad[0])
            raise DataError("weights", f"weight {float(w[row])} in row {row} is not a finite number >= 0")
