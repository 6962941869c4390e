"""Shared pieces of the jagged Triton kernels: work lists of valid tiles, config selection.

Work lists: every valid (sequence, tile) pair, built on the host from the offsets' host copy
(gemctl.ops.host, no device sync), sorted most expensive first, cached per batch layout so every
layer, forward and backward, reuses them. Config selection: the first call for a key times every
candidate (median of do_bench) and keeps the fastest; keys bucket lengths to powers of two so a new
batch does not re-tune. Under TRITON_INTERPRET=1 one small config runs; GEMCTL_AUTOTUNE=0 (or
set_autotune(False), which train.deterministic=true does on CUDA) takes the first candidate: timing
picks between tile shapes that sum in different orders, so tuned runs of one seed differ in the
last bits and, after a few hundred steps, in NE. Tuned picks persist on disk per kernel module, GPU
model, CUDA, Triton and device code (the @triton.jit sources, not the host code around them;
GEMCTL_CACHE_DIR, default ~/.cache/gemctl; GEMCTL_AUTOTUNE_CACHE=0 turns it off), so a later run
on the same machine kind starts tuned. A key's candidates compile at once on a thread pool before
any is timed (_precompile; GEMCTL_COMPILE_WORKERS threads, 1 compiles them one by one).

Specialization: Triton compiles one variant of a kernel per specialization of its arguments
(an integer equal to 1, a multiple of 16 or not; a pointer 16-byte aligned or not). Sizes that
change with every batch (token counts, work-list lengths) are declared ``do_not_specialize`` at
their kernels, where they only bound rows or loops: otherwise a jagged count that happens to be a
multiple of 16 compiles the kernel again in the middle of training (on the H200, three column-cast
compiles at step 79 of a run took 1.4 s and put one logging window at 220 ms a step instead of
75). Strides and padded sizes stay specialized: they are fixed per layer, and their divisibility
is what lets loads and stores vectorize. What still compiles during training (a new shape,
dtype or config) is timed by Triton's compile hooks (compile_seconds) and, like autotuning, taken
out of the trainer's step times (without a sync first, unlike tuning: the GPU may still run queued
work during a compile, so a window can lose up to that much, about a step, in exchange).
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import inspect
import json
import os
import re
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
import triton
import triton.language as tl
import triton.testing

from gemctl.errors import UserError
from gemctl.ops import host

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
_INTERPRET_CONFIG = (16, 16, 1, 1)
_config_cache: dict = {}
_forced: list = []  # configs pinned by forced_config(), innermost last
_autotune: bool | None = None  # set_autotune(); None: GEMCTL_AUTOTUNE decides
_tuning_s = 0.0  # wall seconds spent timing candidates (compilation included), all kernels
_tuning_now = False  # pick_config is timing candidates: their compiles are tuning time already
_compile_s = 0.0  # wall seconds of Triton compiles outside tuning (see compile_seconds)
_compile_t0: dict = {}  # start time of each compile in progress, by (kernel, specialization key)
_hooks = False  # our compile hooks are installed (_install_compile_hooks): precompiling can collect
_collecting = threading.local()  # .requests: the compiles this thread's launches asked for (_precompile)
_disk: dict = {}  # cache file -> its entries, each file read once per process


def _kernel_sources(module_file: str) -> tuple[Path, ...]:
    """The kernel sources a module's tuned configs depend on: the module, this one, and the kernel
    modules it imports (fp8_gemm's casts use mx_quant's conversions)."""
    here = Path(__file__).parent
    try:
        text = Path(module_file).read_text()
    except OSError:
        return ()
    names = set(re.findall(r"gemctl\.ops\.triton\.(\w+)", text)) | {"common"}
    return tuple([Path(module_file)] + sorted(here / f"{n}.py" for n in names if (here / f"{n}.py").is_file()))


def _module_of(path: Path):
    """The module whose file is ``path`` (None if none is imported): one of our kernel modules by
    its name, imported if it is not yet (so a module's digest does not depend on what else the
    process imported), anything else by a scan of the imported modules."""
    path = path.resolve()
    if path.parent == Path(__file__).resolve().parent:
        try:
            module = importlib.import_module(f"gemctl.ops.triton.{path.stem}")
        except ImportError:  # e.g. the Gluon kernels under a Triton without Gluon: its file's bytes then
            return None
        if Path(module.__file__).resolve() == path:
            return module
    for module in list(sys.modules.values()):
        file = getattr(module, "__file__", None)
        if file and Path(file).resolve() == path:
            return module
    return None


def _device_code(path: Path) -> bytes:
    """What of a kernel module the GPU runs: the source text of each @triton.jit function defined
    in it and its tl.constexpr globals. Host code (launchers, docs, helpers) is left out, and so
    are line numbers, so editing it keeps the tuned configs; the whole file when the module is not
    imported."""
    module = _module_of(path)
    if module is None:
        return path.read_bytes()
    parts = []
    for name, obj in sorted(vars(module).items()):
        fn = getattr(obj, "fn", None)
        if isinstance(obj, triton.runtime.jit.KernelInterface) and getattr(fn, "__module__", None) == module.__name__:
            parts.append(f"{name}\n{inspect.getsource(fn)}")
        elif isinstance(obj, tl.constexpr):
            parts.append(f"{name} = {obj.value!r}")
    return "\n".join(parts).encode()


_TIMING = "gpu-behind-sleep, near ties re-timed"  # how _time measures, in the disk cache's digest: picks timed otherwise are redone


@functools.lru_cache(maxsize=None)
def _source_digest(module_file: str) -> str:
    """GPU model, CUDA, Triton, how configs are timed (_TIMING) and the device code of the kernel
    modules a module's configs were timed on (_kernel_sources, _device_code)."""
    digest = hashlib.sha256()
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    digest.update(f"{gpu}|{torch.version.cuda}|{triton.__version__}|{_TIMING}".encode())
    for source in _kernel_sources(module_file):
        digest.update(_device_code(source))
    return digest.hexdigest()[:16]


def _disk_cache_path(module_file: str) -> Path | None:
    """Where tuned configs persist across processes: GEMCTL_CACHE_DIR (default ~/.cache/gemctl),
    one file per kernel module and _source_digest (an edited kernel starts a new file for the
    modules that use it, so a config is never reused for device code it was not timed on; an
    edited launcher keeps the file: every config read back must still be one of the launcher's
    candidates, and run once, before it is taken). None: off (GEMCTL_AUTOTUNE_CACHE=0)."""
    if os.environ.get("GEMCTL_AUTOTUNE_CACHE", "1") == "0":
        return None
    root = Path(os.environ.get("GEMCTL_CACHE_DIR") or Path.home() / ".cache" / "gemctl")
    return root / f"autotune-{Path(module_file).stem}-{_source_digest(module_file)}.json"


def _disk_key(key, candidates) -> str:
    """The file's key: the autotune key and the candidate list (a list that changed, e.g. configs
    admitted or benchmarks timing pending ones, is tuned again)."""
    return f"{key!r}|{hashlib.sha256(repr(list(candidates)).encode()).hexdigest()[:12]}"


def _disk_lookup(path: Path | None, key, candidates) -> tuple | None:
    if path is None:
        return None
    if path not in _disk:
        try:
            _disk[path] = json.loads(path.read_text()) if path.is_file() else {}
        except (OSError, ValueError):  # unreadable or half-written by a crashed run: tune again
            _disk[path] = {}
    cfg = _disk[path].get(_disk_key(key, candidates))
    return tuple(cfg) if cfg is not None else None


def _disk_store(path: Path | None, key, candidates, cfg: tuple) -> None:
    """Adds one tuned config to the file (read again first: the ranks of a job tune too; written to a
    temporary file and renamed, so a reader never sees half a file)."""
    if path is None or not isinstance(cfg, tuple):
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        entries = json.loads(path.read_text()) if path.is_file() else {}
        entries[_disk_key(key, candidates)] = list(cfg)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(entries, indent=0, sort_keys=True))
        os.replace(tmp, path)
        _disk[path] = entries
    except (OSError, ValueError, TypeError):
        pass  # a read-only home or an unserializable config: tuning still works, only not kept


def tuning_seconds() -> float:
    """Wall seconds pick_config has spent timing candidates so far in this process (each new key's
    candidates compiled and timed, the GPU drained first): the trainer takes them out of the step
    times of the windows they fell in."""
    return _tuning_s


def compile_seconds() -> float:
    """Wall seconds Triton has spent compiling kernels (or loading them from its disk cache) outside
    our autotuning, so far in this process: new specializations, shapes or configs met during
    training. Every Triton compile in the process counts, ours or another library's. 0 where
    Triton has no compile hooks (before 3.4) or under the interpreter."""
    return _compile_s


def setup_seconds() -> float:
    """One-off kernel work so far: autotuning plus the compiles outside it (the time the trainer
    leaves out of the step times of the windows it fell in)."""
    return _tuning_s + _compile_s


def _compile_id(hook_kwargs: dict) -> tuple:
    """Which compile a hook call is about: the JITFunction (``fn.jit_function``) and its
    specialization ``key``, as Triton 3.4-3.9 pass them."""
    fn = hook_kwargs.get("fn")
    key = hook_kwargs.get("key")
    try:
        hash(key)
    except TypeError:
        key = repr(key)
    return id(getattr(fn, "jit_function", fn)), key


def _install_compile_hooks() -> None:
    """Time every Triton compile through ``knobs.runtime.jit_cache_hook`` (called before a compile;
    a true return would skip it) and ``jit_post_compile_hook`` (after); hooks already installed by
    someone else keep running, ours only observe."""
    runtime = getattr(getattr(triton, "knobs", None), "runtime", None)
    if runtime is None or not hasattr(runtime, "jit_cache_hook") or not hasattr(runtime, "jit_post_compile_hook"):
        return
    before, after = runtime.jit_cache_hook, runtime.jit_post_compile_hook

    def started(*args, **kwargs):
        requests = getattr(_collecting, "requests", None)
        if requests is not None:  # _precompile collecting: kept for the parallel compile, none now
            fn = getattr(kwargs.get("fn"), "jit_function", None)
            data = (kwargs.get("compile") or {}).get("specialization_data")
            if fn is not None and data is not None:
                requests.setdefault(data, fn)
                return True  # skipped: Triton's launch then returns without running anything
        skip = before(*args, **kwargs) if before is not None else False
        if not skip:  # a skipped compile gets no post-compile call
            _compile_t0[_compile_id(kwargs)] = time.perf_counter()
        return skip

    def finished(*args, **kwargs):
        global _compile_s
        # Paired by kernel and key: a compile that raised (no post-compile call) leaves a start
        # that the next compile of the same kernel and key replaces, and a post-compile call
        # without a start (another caller of the hook) counts nothing.
        t0 = _compile_t0.pop(_compile_id(kwargs), None)
        if t0 is not None and not _tuning_now:
            _compile_s += time.perf_counter() - t0
        return after(*args, **kwargs) if after is not None else None

    global _hooks
    runtime.jit_cache_hook, runtime.jit_post_compile_hook = started, finished
    _hooks = True


if not INTERPRET:
    _install_compile_hooks()


def set_autotune(enabled: bool | None) -> None:
    """Time the candidates of each kernel (True), take every kernel's first candidate that runs
    (False: reproducible numerics), or let GEMCTL_AUTOTUNE decide (None)."""
    global _autotune
    _autotune = enabled


def autotune_enabled() -> bool:
    return _autotune if _autotune is not None else os.environ.get("GEMCTL_AUTOTUNE", "1") != "0"


def rows_viewable(t: torch.Tensor, block_rows: int, cols: int | None = None) -> bool:
    """Whether a jagged [N, H, D] tensor can be read by TMA as [N, H * D] in (block_rows, cols)
    boxes: heads adjacent, rows not overlapping, the row stride, the base and a box row 16-byte
    aligned, at least one box of rows."""
    n, heads, dim = t.shape
    s0, s1, s2 = t.stride()  # one call (each accessor call is host time, several per launch)
    size, width = t.element_size(), cols or dim
    return not (s2 != 1 or s1 != dim or s0 < heads * dim or (s0 * size) % 16 or t.data_ptr() % 16
                or (width * size) % 16 or n < block_rows)


def row_descriptors(block_rows: int, *tensors, cols: int | None = None):
    """TMA descriptors over jagged [N, H, D] tensors viewed as [N, H * D] with (block_rows, cols)
    blocks (cols = D: a head's rows of one tile; D / 2: half of them), or None where that view or
    TMA's alignment does not hold (rows_viewable)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    if not all(rows_viewable(t, block_rows, cols) for t in tensors):
        return None
    return [TensorDescriptor(t, [t.shape[0], t.shape[1] * t.shape[2]], [t.stride(0), 1], [block_rows, cols or t.shape[2]])
            for t in tensors]


def config_field(cfg: tuple, i: int) -> int:
    """Optional config field i (TMA, lazy rescaling, ...), 0 where the config is shorter."""
    return cfg[i] if len(cfg) > i else 0


def gpu_checked(candidates: list, first_optional: int, checked: set, everything: bool = False) -> list:
    """The candidates autotuning times: those whose optional fields (index >= first_optional: TMA,
    lazy rescaling, ...) are all 0, and those the GPU tier's every-candidate test has passed
    (``checked``); all of them with ``everything`` (benchmarks of unchecked configs)."""
    return [c for c in candidates if everything or c in checked or not any(c[first_optional:])]


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) in host code: ``triton.cdiv`` is a constexpr function whose host call costs
    ~1.6 us (argument unwrapping), dozens of times in one FP8 MLP block's forward+backward."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (n >= 1), in host code (see cdiv)."""
    return 1 << (n - 1).bit_length()


def bucket_len(n: int) -> int:
    """Autotune key of a length: the next power of two (no re-tune for every new batch)."""
    return next_pow2(int(n))


@triton.jit
def work_item(WORK, Q_OFFSETS, K_OFFSETS, pid, BLOCK: tl.constexpr):
    """Program pid's (sequence, tile) from the work list: the tile's first row and the
    sequence's query/key spans (shift = Lk - Lq aligns the last query with the last key)."""
    b = tl.load(WORK + 2 * pid)
    first = tl.load(WORK + 2 * pid + 1) * BLOCK
    q_start = tl.load(Q_OFFSETS + b).to(tl.int32)
    q_len = tl.load(Q_OFFSETS + b + 1).to(tl.int32) - q_start
    k_start = tl.load(K_OFFSETS + b).to(tl.int32)
    k_len = tl.load(K_OFFSETS + b + 1).to(tl.int32) - k_start
    return first, q_start, q_len, k_start, k_len, k_len - q_len


@triton.jit
def load_rows(PTR, start, rows, length, stride_n, head_offset, offs_d):
    """A (rows, D) tile of a jagged [N, H, D] tensor: rows ``rows`` of the sequence starting at
    value row ``start``, one head (``head_offset`` = h * stride_h); rows >= ``length`` read 0."""
    ptrs = PTR + (start + rows)[:, None] * stride_n + head_offset + offs_d[None, :]
    return tl.load(ptrs, mask=(rows < length)[:, None], other=0.0)


@triton.jit
def load_tile(PTR, DESC, start, first, rows, length, stride_n, col, offs, BY_DESC: tl.constexpr):
    """Columns [col, col + len(offs)) of rows ``first + arange`` of the sequence starting at value
    row ``start`` of a jagged [N, H, D] tensor (col counts from the row's start: h * stride_h, plus
    an offset within the head): through DESC (the tensor as [N, H * D], see row_descriptors, which
    needs stride_h == D) when BY_DESC, which callers set only for tiles inside the sequence; else
    masked loads (rows past ``length`` read 0)."""
    if BY_DESC:
        return DESC.load([start + first, col])
    else:
        return load_rows(PTR, start, rows, length, stride_n, col, offs)


@triton.jit
def store_rows(PTR, value, start, rows, length, stride_n, head_offset, offs_d):
    """Store a (rows, D) tile (cast to PTR's dtype) into the rows of a sequence, rows < length."""
    ptrs = PTR + (start + rows)[:, None] * stride_n + head_offset + offs_d[None, :]
    tl.store(ptrs, value.to(PTR.dtype.element_ty), mask=(rows < length)[:, None])


@triton.jit
def zigzag_item(r, pid, n_programs):
    """Item of round ``r`` for persistent program ``pid``: items are sorted most expensive first and
    dealt in snake order (0..G-1, then G-1..0, ...), so every program gets a mix of long and short
    tiles. With one program per item (G = number of items) this is just ``pid``."""
    return r * n_programs + tl.where(r % 2 == 0, pid, n_programs - 1 - pid)


def gluon_module(name: str, op: str, device=None):
    """gemctl.ops.triton.<name>, a module of Gluon kernels for Hopper, or ValueError where they
    cannot run on ``device`` (the current CUDA device when None): no sm_90+ GPU, the interpreter, a
    Triton without Gluon's Hopper API. Autotuning then skips their configs; a pinned one raises."""
    if (INTERPRET or not torch.cuda.is_available() or (device is not None and torch.device(device).type != "cuda")
            or torch.cuda.get_device_capability(device)[0] < 9):
        raise ValueError(f"{op} (Hopper): needs an sm_90+ GPU (the Gluon kernels' configs)")
    try:
        return importlib.import_module(f"gemctl.ops.triton.{name}")
    except ImportError as exc:
        raise ValueError(f"{op} (Hopper): Gluon unavailable ({exc})") from exc


@functools.lru_cache(maxsize=None)
def gluon_runs(name: str, device: torch.device) -> bool:
    """Whether gluon_module(name) runs on ``device`` (asked once per module and device)."""
    try:
        gluon_module(name, name, device)
    except ValueError:
        return False
    return True


def num_programs(n_items: int, per_sm: int, device) -> int:
    """Grid size: one program per item (per_sm = 0), or a persistent grid of per_sm programs on
    every streaming multiprocessor (fewer if there are fewer items)."""
    if per_sm <= 0:
        return n_items
    return max(1, min(n_items, per_sm * _sm_count(device)))


@functools.lru_cache(maxsize=None)
def _sm_count(device) -> int:
    """Streaming multiprocessors of ``device``, read once (the persistent kernels size their grid
    from it on every launch of the training step)."""
    device = torch.device(device)
    if device.type != "cuda":
        return 2  # interpreter: a tiny persistent grid, so tests exercise the dealing
    return torch.cuda.get_device_properties(device).multi_processor_count


def tile_work(tile_lengths: np.ndarray, costs_of, block: int) -> np.ndarray:
    """int32 [n, 2] (sequence, tile) pairs of every valid tile, most expensive first.

    NumPy, not torch: these are a few hundred integers, and torch's CPU ops on them hit the
    intra-op thread pool, which competes with the data-loader workers (repeat_interleave took
    4-8 ms a call in the small_h200 trace on the H200 machine, 2026-11-29).
    """
    n_tiles = (tile_lengths + block - 1) // block
    seq = np.repeat(np.arange(tile_lengths.size), n_tiles)
    first = np.cumsum(n_tiles) - n_tiles
    tile = np.arange(int(n_tiles.sum())) - np.repeat(first, n_tiles)
    order = np.argsort(-costs_of(seq, tile), kind="stable")
    return np.stack([seq[order], tile[order]], 1).astype(np.int32)


def _to_device(work: np.ndarray, device) -> torch.Tensor:
    # Pinned staging keeps the copy asynchronous: a pageable host-to-device copy makes the host
    # wait for the stream to reach it.
    tensor = torch.from_numpy(work)
    if torch.device(device).type == "cuda":
        tensor = tensor.pin_memory()
    return tensor.to(device, non_blocking=True)


def _lengths(offsets: torch.Tensor) -> np.ndarray:
    host_offsets = host.host_of(offsets).numpy()
    return (host_offsets[1:] - host_offsets[:-1]).astype(np.int64)


RECORD = 8  # int32 fields of a work record (query_records): 32 bytes (work_record's row stride)
_RECORD = tl.constexpr(RECORD)


def work_records(work: np.ndarray, q_offsets, k_offsets) -> np.ndarray:
    """int32 [n, RECORD] records of a (sequence, tile) work list: (sequence, tile, q_start, q_len,
    k_start, k_len, 0, 0), the spans resolved on the host from the offsets' host copies.

    Why: a kernel reading (sequence, tile) and then the sequence's offsets waits for one load's
    result before it can issue the next. A persistent program does that at every item. In Nsight
    Compute, the warps of GDPA's resident cross-128 forward stalled on that dependent load for 14%
    of their samples, and in its math-alone probe for 10% (H100, 2026-12-05). The record's fields are
    independent loads from one 32-byte row.
    """
    qo, ko = host.host_of(q_offsets).numpy(), host.host_of(k_offsets).numpy()
    if max(int(qo[-1]), int(ko[-1])) >= 2**31:
        raise ValueError(f"work records: {max(int(qo[-1]), int(ko[-1]))} rows; the kernels index rows in int32 "
                         f"(at most {2**31 - 1})")
    seq = work[:, 0].astype(np.int64)
    out = np.zeros((work.shape[0], RECORD), np.int32)
    out[:, :2] = work
    out[:, 2], out[:, 3] = qo[seq], qo[seq + 1] - qo[seq]
    out[:, 4], out[:, 5] = ko[seq], ko[seq + 1] - ko[seq]
    return out


@triton.jit
def work_record(RECORDS, w):
    """Record ``w`` of a query_records list: (tile, q_start, q_len, k_start, k_len), by loads that
    do not wait on each other (one 4-byte load each)."""
    row = RECORDS + w * _RECORD
    return tl.load(row + 1), tl.load(row + 2), tl.load(row + 3), tl.load(row + 4), tl.load(row + 5)


def query_work(q_offsets, k_offsets, block_m: int, causal: bool, device) -> torch.Tensor:
    """int32 [n, 2] (sequence, query tile) list of every query tile of ``block_m`` rows, most
    expensive first, on ``device``; cached per batch layout (no device sync: the host copies)."""
    # a copy: on the CPU the tensor would share memory with the cached host list the records are built from
    return host.cached_plan(q_offsets, ("q", _identity(k_offsets), block_m, causal),
                            lambda: _to_device(_query_work_host(q_offsets, k_offsets, block_m, causal).copy(), device))


def query_records(q_offsets, k_offsets, block_m: int, causal: bool, device) -> torch.Tensor:
    """query_work's list as work_records (int32 [n, RECORD]), cached per batch layout like it."""
    def build():
        work = _query_work_host(q_offsets, k_offsets, block_m, causal)
        return _to_device(work_records(work, q_offsets, k_offsets), device)

    return host.cached_plan(q_offsets, ("q records", _identity(k_offsets), block_m, causal), build)


def records_short_last(offsets, block: int, device) -> tuple[torch.Tensor, int]:
    """query_records of the self-attention tiles of ``block`` rows (``offsets`` on both sides) with the
    tiles of more than block / 2 rows first and the others last, each group in query_records' order,
    and how many come first (block attention's paired backward runs each of the last as one item
    per two heads). Built on the host from the offsets' host copy, cached per batch layout."""
    def build():
        rec = work_records(_query_work_host(offsets, offsets, block, False), offsets, offsets)
        short = np.minimum(block, rec[:, 3] - rec[:, 1] * block) <= block // 2
        order = np.concatenate([np.flatnonzero(~short), np.flatnonzero(short)])
        return _to_device(np.ascontiguousarray(rec[order]), device), int((~short).sum())

    return host.cached_plan(offsets, ("q records, short last", block), build)


def _query_work_host(q_offsets, k_offsets, block_m: int, causal: bool) -> np.ndarray:
    def build():
        lq, lk = _lengths(q_offsets), _lengths(k_offsets)

        def cost(seq, tile):
            if causal:  # keys visible to the tile's last row
                return np.clip(np.minimum(lk[seq], (tile + 1) * block_m + lk[seq] - lq[seq]), 0, None)
            # keys x the tile's rows: a sequence's partial last tile (or chunk of tiles, for the
            # kernels that take several per item) is cheaper than its whole ones
            return np.maximum(lk[seq], 1) * np.minimum(block_m, lq[seq] - tile * block_m)

        # Every query tile gets a program, also where there is no key: it writes the zeros.
        return tile_work(lq, cost, block_m)

    return host.cached_plan(q_offsets, ("q host", _identity(k_offsets), block_m, causal), build)


def whole_tile_work(offsets, block: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Two int32 [n, 2] (sequence, tile) lists: every sequence's whole tiles (longest sequences
    first), and the partial last tiles (one per sequence whose length is not a multiple of
    ``block``), for kernels that load whole tiles without masks (TMA) and partial ones with."""

    def build():
        lengths = _lengths(offsets)
        whole = tile_work(lengths // block * block, lambda seq, tile: lengths[seq], block)
        seq = np.flatnonzero(lengths % block)
        partial = np.stack([seq, lengths[seq] // block], 1).astype(np.int32)
        return _to_device(whole, device), _to_device(partial, device)

    return host.cached_plan(offsets, ("whole/partial", block), build)


def key_work(q_offsets, k_offsets, block_n: int, causal: bool, device, include_empty: bool = False) -> torch.Tensor:
    """(sequence, key tile) pairs. Sequences without queries get no tile unless ``include_empty``
    (then their tiles come last, so a kernel can write their zero gradients itself)."""

    def build():
        lq, lk = _lengths(q_offsets), _lengths(k_offsets)
        lk_eff = lk if include_empty else np.where(lq > 0, lk, 0)

        def cost(seq, tile):
            if causal:  # query rows that see the tile's first key
                return np.clip(lq[seq] - np.clip(tile * block_n - (lk[seq] - lq[seq]), 0, None), 0, None)
            return lq[seq]

        return _to_device(tile_work(lk_eff, cost, block_n), device)

    return host.cached_plan(k_offsets, ("k", _identity(q_offsets), block_n, causal, include_empty), build)


def _identity(offsets: torch.Tensor):
    """Cache key of the other side's layout: its host offsets' bytes (ids can be reused)."""
    return host.host_of(offsets).numpy().tobytes()


def same_offsets(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two offsets tensors describe one layout (the same tensor, or equal host copies: no
    device sync where the host copies are registered)."""
    return a is b or _identity(a) == _identity(b)


def _time(fn) -> float:
    """Median GPU time of ``fn`` (ms), its host cost left out.

    Each repeat is queued behind a GPU sleep longer than the host takes to launch ``fn``, so the
    events around it time the kernels alone. Timing the plain call (do_bench) counts the launches'
    host cost whenever it exceeds the kernels' time; inside a training step that cost overlaps
    the GPU's work, and the benchmarks judge GPU time (CUDA graphs). By call time the GDPA
    forward on cross-128 picked a 137 us tile loop over a 100 us Gluon kernel whose launch builds
    TMA descriptors (H100, 2026-12-05). Median of ~20 ms of repeats: 3 back-to-back runs of a
    0.1 ms kernel picked a config 2x slower than the best on self-200 (H200, 2026-11-29)."""
    if not torch.cuda.is_available():
        return triton.testing.do_bench(fn, warmup=5, rep=20, return_mode="median")
    for _ in range(3):  # compile, first-launch costs
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    host_s = time.perf_counter() - t0  # launching alone: the GPU is idle, so nothing waits
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    gpu_ms = max(start.elapsed_time(end), 1e-3)
    reps = max(5, min(100, int(20.0 / gpu_ms)))
    # 2e9 cycles a second bounds sm_80/sm_90 clocks: the sleep lasts at least 2x the host time
    cycles = int(2e9 * (2 * host_s + 20e-6))
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for a, b in events:
        torch.cuda._sleep(cycles)
        a.record()
        fn()
        b.record()
    torch.cuda.synchronize()
    times = sorted(a.elapsed_time(b) for a, b in events)
    return times[len(times) // 2]


FINAL_MARGIN = 0.10  # candidates within 10% of the fastest are timed again (_final)
FINAL_SIZE = 3  # at most this many of them
FINAL_ROUNDS = 2  # more timings each, taken in turn


def _final(timed: dict, run):
    """The pick among ``timed`` ({config: [median ms]}, every candidate that ran, in list order).
    One timing per candidate ranks them; the fastest few within FINAL_MARGIN of the best are each
    timed FINAL_ROUNDS more times, in turn (a slow or fast spell of the GPU then touches all of them),
    and the one with the lowest median of its timings wins, the earlier in the list on a tie. One
    timing alone let a transient decide near ties, and a pick persists (the disk cache): the
    column cast from column maxima read 85.9 us in one run against 78.5-78.6 us in two others
    (H100, 2026-12-06), the same kernel under a pick of its own each run."""
    order = sorted(timed, key=lambda cfg: timed[cfg][0])  # stable: list order among equal times
    best_t = timed[order[0]][0]
    finalists = [cfg for cfg in order[:FINAL_SIZE] if timed[cfg][0] <= best_t * (1 + FINAL_MARGIN)]
    if len(finalists) > 1:
        for _ in range(FINAL_ROUNDS):
            for cfg in finalists:
                try:
                    timed[cfg].append(_time(lambda: run(cfg)))
                except Exception:  # ran once, fails now (out of memory?): not picked
                    timed[cfg].append(float("inf"))
    index = {cfg: i for i, cfg in enumerate(timed)}
    return min(finalists, key=lambda cfg: (statistics.median(timed[cfg]), index[cfg]))


class forced_config:
    """``with forced_config(cfg):`` kernels launched inside use ``cfg`` (benchmarks comparing
    configs, tests of one code path): one tuple for every kernel, or a dict from the autotune key's
    first element (kernel name, e.g. "gdpa_fwd") to a tuple; kernels not named autotune as usual."""

    def __init__(self, cfg):
        self.cfg = dict(cfg) if isinstance(cfg, dict) else tuple(cfg)

    def __enter__(self):
        _forced.append(self.cfg)
        return self

    def __exit__(self, *exc):
        _forced.pop()


def _runs(run, cfg) -> bool:
    """Whether ``run(cfg)`` runs: a config read back from disk was tuned on the same device code,
    but the launcher around it may have changed since (a new check that rejects it); one launch
    tells, and a config that fails is tuned again instead of failing the step."""
    try:
        run(cfg)
    except Exception:
        return False
    return True


def compile_workers() -> int:
    """Threads that compile a key's candidates at once before they are timed (_precompile):
    GEMCTL_COMPILE_WORKERS, default this process's share of the cores (the CPUs it may run on over
    the node's local ranks, LOCAL_WORLD_SIZE), at most 16; 1 compiles them one by one as they
    are timed."""
    value = os.environ.get("GEMCTL_COMPILE_WORKERS", "").strip()
    if value:
        if not value.isdigit() or int(value) < 1:
            raise UserError(f"GEMCTL_COMPILE_WORKERS={value!r}: expected a whole number of threads, 1 or more")
        return int(value)
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    local_ranks = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1))
    return max(1, min(16, cpus // local_ranks))


class _Collecting(Exception):
    """A candidate's launch met a kernel that still has to be tuned while _precompile collected:
    that kernel is tuned when the candidate is timed, not from launches that run nothing."""


def _precompile(candidates, run) -> int:
    """Compile the kernels every candidate launches, in compile_workers() threads, before any is
    timed; returns how many compiles were handed out (0: nothing to do in parallel).

    Each candidate is launched once with our jit_cache_hook collecting: a compile Triton would make
    is recorded (its specialization data) and skipped, and a launch whose compile is skipped runs
    nothing. The recorded compiles then go through Triton's own JITFunction.preload under
    AsyncCompileMode, the same compile and cache entry a launch makes, on a thread pool, so the
    timing loop finds them built. A key's candidates took 1-3 s each to compile for sm_90 on one
    core (the FP8 GEMMs, Triton 3.6), one after another, most of a first run's tuning time;
    two threads on two cores compiled four of them in 3.0 s against 4.5 s. A compile that fails is
    left to the timing loop, which meets the same error and skips that candidate."""
    workers = compile_workers()
    if workers < 2 or not _hooks or len(candidates) < 2 or not torch.cuda.is_available():
        return 0
    try:
        from triton.runtime._async_compile import AsyncCompileMode, active_mode
    except ImportError:  # Triton before async compiles: one by one, as before
        return 0
    if active_mode.get() is not None:  # someone else's async compiles (one mode at a time)
        return 0
    _collecting.requests = {}
    try:
        for cfg in candidates:
            try:
                run(cfg)
            except Exception:  # an ineligible config, a nested kernel not tuned yet (_Collecting)
                pass
        requests = _collecting.requests
    finally:
        _collecting.requests = None
    if len(requests) < 2:
        return 0
    with ThreadPoolExecutor(min(workers, len(requests)), thread_name_prefix="gemctl-compile") as pool:
        mode = AsyncCompileMode(pool, ignore_errors=True)
        try:
            with mode:
                for data, fn in requests.items():
                    try:
                        fn.preload(data)
                    except Exception:  # not reproducible from its data: compiled when timed instead
                        pass
        except Exception:  # a finalizer raised (another library's post-compile hook): the rest compile when timed
            pass
        finally:  # Triton 3.6 leaves the mode set if a finalizer raised: later compiles would go to a closed pool
            if active_mode.get() is mode:
                active_mode.set(None)
    return len(requests)


def pick_config(key, candidates, run, interpret_config: tuple = _INTERPRET_CONFIG):
    """The fastest candidate for this key, timed once on the first call (not under the interpreter;
    with autotune off (GEMCTL_AUTOTUNE=0, set_autotune(False)) the first candidate that runs, in
    list order: no timing, so the choice does not depend on the machine's load). ``candidates``: a
    list, or a function returning it, called only when the key is not decided yet (the per-launch
    path in the training step then builds no list)."""
    global _tuning_s, _tuning_now
    if _forced:
        forced = _forced[-1]
        if not isinstance(forced, dict):
            return forced
        if key[0] in forced:
            return tuple(forced[key[0]])
    if INTERPRET:
        return interpret_config
    tuned = autotune_enabled()
    cache_key = key if tuned else ("untuned",) + tuple(key)
    if cache_key in _config_cache:
        return _config_cache[cache_key]
    if getattr(_collecting, "requests", None) is not None:
        raise _Collecting(key)  # inside another kernel's _precompile: tuned when that one is timed
    if callable(candidates):
        candidates = candidates()
    disk = None
    if tuned:
        caller = sys._getframe(1).f_globals.get("__file__")  # the kernel module asking
        disk = _disk_cache_path(caller) if caller else None
        known = _disk_lookup(disk, key, candidates)
        if known is not None and known in candidates and _runs(run, known):
            _config_cache[cache_key] = known  # tuned by an earlier run on this GPU and kernel source
            return known
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # the step's queued work is not tuning time
    t_tune = time.perf_counter()
    best, timed = None, {}
    _tuning_now = tuned
    try:
        if tuned:
            _precompile(candidates, run)
        for cfg in candidates:  # a config may not fit this shape's shared memory: the next one then
            if not tuned:
                if _runs(run, cfg):
                    best = cfg
                    break  # untuned: the first candidate that runs
                continue
            try:
                timed[cfg] = [_time(lambda: run(cfg))]
            except Exception:
                continue
        if timed:
            best = _final(timed, run)
    finally:
        _tuning_now = False
    if tuned:
        _tuning_s += time.perf_counter() - t_tune
    if best is None:
        raise RuntimeError(f"no Triton kernel config runs for {key}")
    _config_cache[cache_key] = best
    if tuned:
        _disk_store(disk, key, candidates, best)
    return best
