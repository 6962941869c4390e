"""Triton jagged attention against the float64 per-sequence loop: outputs and dq, dk, dv, dbias.

CPU tier: the interpreter (TRITON_INTERPRET=1, 16x16 tiles), fp32, small hostile shapes.
GPU tier (marked gpu): bf16 on the H200; the error must stay within 2x the error of the bf16
PyTorch reference path on the same inputs (plus a small floor), and gradients are bitwise
identical across runs. Sliding windows: smaller than a tile, a tile's width, the length of a
sequence, larger than every length, and 1 (each query sees only its own aligned key).
"""

import pytest
import torch

from gemctl import ops
from loops import assert_errors, attention_loop, offsets, rel_err

pytest.importorskip("triton")
from gemctl.ops.triton import common  # noqa: E402
from gemctl.ops.triton import jagged_attention as ja_kernels  # noqa: E402

# Interpreter tiles are 16: lengths around 16/32 are the tile edges there; GPU tiles are 32-128.
SELF_CPU = [[0, 1, 15, 16, 17, 33, 3], [70, 1, 2, 0, 5], [1], [0, 0, 4]]
CROSS_CPU = [([3, 0, 17, 40, 1], [20, 4, 0, 3, 16]), ([33, 16, 15], [1, 2, 50])]
SELF_GPU = [[0, 1, 63, 64, 65, 127, 128, 129, 7], [1000] + [3, 17, 0, 64] * 8, [200] * 16]
CROSS_GPU = [([5, 0, 130, 64, 1000], [300, 7, 0, 64, 32]), ([64, 65, 1], [1, 2, 900])]
# Windows against the lengths above: 1, below a tile, a tile (16 on CPU), tile + 1, the longest
# length (33) and beyond every length.
WINDOW_CPU = [1, 7, 16, 17, 33, 100]
WINDOW_GPU = [1, 63, 64, 256, 2000]




def _inputs(q_lengths, k_lengths, heads, dim, device, dtype, seed, with_bias):
    gen = torch.Generator().manual_seed(seed)
    # Self-attention gets one offsets tensor for both sides, as the model passes it: the forward
    # then reads the bias as tiles (bias_tile_table), cross-attention by gathers.
    qo = offsets(q_lengths, device)
    ko = qo if list(q_lengths) == list(k_lengths) else offsets(k_lengths, device)
    def make(n):
        return torch.randn(n, heads, dim, generator=gen, dtype=torch.float64).to(device, dtype).requires_grad_(True)
    q, k, v = make(int(qo[-1])), make(int(ko[-1])), make(int(ko[-1]))
    table = (torch.randn(heads, 16, generator=gen, dtype=torch.float64) * 0.5).to(device, torch.float32).requires_grad_(True) if with_bias else None
    grad_out = torch.randn(int(qo[-1]), heads, dim, generator=gen, dtype=torch.float64).to(device, dtype)
    return qo, ko, q, k, v, table, grad_out


def _run(backend, q, k, v, table, qo, ko, mq, mk, causal, window=None):
    bias = None if table is None else ops.RelativePositionBias(table, 40)
    out = ops.jagged_attention(q, k, v, qo, ko, mq, mk, bias=bias, causal=causal, window=window, backend=backend)
    return out


def _grads(out, tensors, grad_out):
    wanted = [t for t in tensors if t is not None]
    return torch.autograd.grad(out, wanted, grad_out, allow_unused=True)


def _check(q_lengths, k_lengths, causal, with_bias, device, dtype, heads=2, dim=32, seed=0, factor=None, tol=None,
           window=None, elementwise=False):
    qo, ko, q, k, v, table, grad_out = _inputs(q_lengths, k_lengths, heads, dim, device, dtype, seed, with_bias)
    mq, mk = max(q_lengths), max(k_lengths)
    out = _run("triton", q, k, v, table, qo, ko, mq, mk, causal, window)
    assert torch.isfinite(out).all()
    grads = _grads(out, [q, k, v, table], grad_out)

    # The float64 reference runs on the inputs' device (float64 has no TF32 path, so it is as exact
    # on the GPU). That did not make the GPU tier's slow tests fast: the causal and windowed ones on
    # the 1000-token batch still take ~60 s each under 16 xdist workers, of which the tier's log
    # counts ~9 s as Triton compiles (docs/runs/2026-12-01_tierlog_d714d25.tsv). Alone under
    # cProfile one took 20 s, its largest item Triton's code generator (docs/runs/
    # 2026-12-01_cprofile_jagged_test_d714d25.txt). Where the rest goes under xdist is not known.
    ref_in = [t.detach().double().requires_grad_(True) if t is not None else None for t in (q, k, v, table)]
    ref_bias = None if table is None else ops.RelativePositionBias(ref_in[3], 40)
    ref = attention_loop(ref_in[0], ref_in[1], ref_in[2], qo.cpu(), ko.cpu(), causal=causal, bias=ref_bias, window=window)
    ref_grads = _grads(ref, ref_in, grad_out.double())

    if factor is not None:  # bound by the low-precision PyTorch path's own error
        base = _run("torch", q, k, v, table, qo, ko, mq, mk, causal, window)
        base_grads = _grads(base, [q, k, v, table], grad_out)
    baselines = [base, *base_grads] if factor is not None else [None] * 5
    kept = [(name, torch.zeros_like(r) if g is None else g, r, b)
            for name, g, r, b in zip(["out", "dq", "dk", "dv", "dbias"], [out, *grads], [ref, *ref_grads], baselines)
            if r is not None]  # no bias: no dbias
    names, got, want, bases = zip(*kept)
    assert_errors(names, got, want, bases, tol=tol, factor=factor, elementwise=elementwise)


@pytest.mark.parametrize("lengths", SELF_CPU)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("with_bias", [False, True])
def test_self_cpu(lengths, causal, with_bias):
    _check(lengths, lengths, causal, with_bias, "cpu", torch.float32, tol=2e-5)


@pytest.mark.parametrize("q_lengths,k_lengths", CROSS_CPU)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("with_bias", [False, True])
def test_cross_cpu(q_lengths, k_lengths, causal, with_bias):
    _check(q_lengths, k_lengths, causal, with_bias, "cpu", torch.float32, tol=2e-5)


@pytest.mark.parametrize("tiles", [(16, 16), (16, 32), (32, 16)])
@pytest.mark.parametrize("causal", [False, True])
def test_transposed_dkdv_cpu(tiles, causal):
    """The dK/dV pass's transposed formulation (key x query tiles; an autotune candidate on the
    GPU) against float64: self and cross lengths, bias, a window, square and unequal tiles."""
    with common.forced_config({"dkdv": (*tiles, 1, 1, 1)}):
        _check(SELF_CPU[0], SELF_CPU[0], causal, True, "cpu", torch.float32, tol=2e-5)
        _check(*CROSS_CPU[0], causal, True, "cpu", torch.float32, tol=2e-5)
        _check(SELF_CPU[1], SELF_CPU[1], causal, False, "cpu", torch.float32, tol=2e-5, window=20)


def test_fp16_elementwise_cpu():
    """fp16 under the interpreter, bounded by the fp16 PyTorch path norm-wise and element-wise."""
    _check(SELF_CPU[0], SELF_CPU[0], True, True, "cpu", torch.float16, factor=2.0, elementwise=True)
    _check(*CROSS_CPU[0], False, True, "cpu", torch.float16, factor=2.0, elementwise=True)


@pytest.mark.parametrize("forced", [{"fwd": (16, 16, 1, 1, 1), "dkdv": (16, 16, 1, 1, 0, 1), "dq": (16, 16, 1, 1, 1)},
                                    {"fwd": (16, 32, 1, 1, 1), "dkdv": (16, 32, 1, 1, 1, 1), "dq": (32, 16, 1, 1, 1)}],
                         ids=["square", "unequal-transposed"])
@pytest.mark.parametrize("causal", [False, True])
def test_tma_tiles_cpu(forced, causal):
    """The TMA candidates (unmasked tiles through tensor descriptors, masked ones by masked loads)
    of all three passes against float64: self and cross lengths with partial tiles, bias, a window."""
    with common.forced_config(forced):
        _check(SELF_CPU[0], SELF_CPU[0], causal, True, "cpu", torch.float32, tol=2e-5)
        _check(SELF_CPU[1], SELF_CPU[1], causal, False, "cpu", torch.float32, tol=2e-5, window=20)
        _check(*CROSS_CPU[0], causal, True, "cpu", torch.float32, tol=2e-5)
        _check(*CROSS_CPU[1], causal, True, "cpu", torch.float32, tol=2e-5)


@pytest.mark.parametrize("causal", [False, True])
def test_lazy_rescaling_cpu(causal):
    """The forward with lazy rescaling (a sixth config field) against float64; scores spread by a
    bias so that running maxima grow by more and by less than 2^8 within a row."""
    with common.forced_config({"fwd": (16, 16, 1, 1, 0, 1)}):
        _check(SELF_CPU[0], SELF_CPU[0], causal, False, "cpu", torch.float32, tol=2e-5)
        _check(SELF_CPU[1], SELF_CPU[1], causal, True, "cpu", torch.float32, tol=2e-5, window=20)
        _check(*CROSS_CPU[0], causal, True, "cpu", torch.float32, tol=2e-5)
    with common.forced_config({"fwd": (16, 16, 1, 1, 1, 1)}):  # with TMA tiles
        _check(SELF_CPU[1], SELF_CPU[1], causal, False, "cpu", torch.float32, tol=2e-5)
    # Scores spread over ~+-60 (log2 units): running maxima jump by more than 2^8 in later tiles.
    lengths = [70, 33, 1, 0, 17]
    off = offsets(lengths)
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(121, 2, 32, generator=gen, dtype=torch.float64) for _ in range(3))
    k = k * torch.linspace(0.2, 8.0, 121, dtype=torch.float64)[:, None, None]  # later keys score higher
    ref = attention_loop(q, k, v, off, off, causal=causal)
    with common.forced_config({"fwd": (16, 16, 1, 1, 0, 1)}):
        out = ops.jagged_attention(q.float(), k.float(), v.float(), off, off, 70, 70, causal=causal, backend="triton")
    assert rel_err(out, ref) < 1e-5


def test_pending_candidates_join_autotuning_only_when_enabled_cpu(monkeypatch):
    """TMA and lazy-rescaling configs are pinned by tests and benchmarks but not timed by the
    autotuner until their GPU tier has passed them (_GPU_CHECKED; _PENDING_AUTOTUNE for all)."""
    fwd, dkdv = ja_kernels._FWD_CANDIDATES["small"], ja_kernels._DKDV_CANDIDATES
    assert any(len(c) > 4 and c[4] for c in fwd) and any(len(c) > 5 and c[5] for c in fwd)
    assert any(len(c) > 5 and c[5] for c in dkdv)
    monkeypatch.setattr(ja_kernels, "_PENDING_AUTOTUNE", False)
    checked = ja_kernels._GPU_CHECKED
    every = set(ja_kernels._FWD_CANDIDATES["large"]) | set(fwd) | set(dkdv) | set(ja_kernels._DQ_CANDIDATES)
    assert checked and checked <= every
    assert ja_kernels._tuned(fwd, 4) == [c for c in fwd if len(c) == 4 or c in checked]
    assert (64, 64, 4, 3, 1, 1) not in ja_kernels._tuned(fwd, 4)  # lazy rescaling: pinned only
    assert ja_kernels._tuned(dkdv, 5) == [c for c in dkdv if len(c) == 5 or c in checked]  # the transposed field stays
    monkeypatch.setattr(ja_kernels, "_PENDING_AUTOTUNE", True)
    assert ja_kernels._tuned(fwd, 4) == fwd and ja_kernels._tuned(dkdv, 5) == dkdv


@pytest.mark.parametrize("causal", [False, True])
def test_backward_writes_every_gradient_row_cpu(monkeypatch, causal):
    """dq, dk, dv are allocated without zero fills: every row must be written by a kernel. With the
    allocations poisoned (NaN), sequences without queries, without keys, keys no query sees
    (causal, K longer than Q) and rows past a tile still come out exact; delta comes from the fused
    rowsum kernel."""
    real = torch.empty_like

    def poisoned(t, *args, **kwargs):
        return real(t, *args, **kwargs).fill_(float("nan"))

    monkeypatch.setattr(ja_kernels.torch, "empty_like", poisoned)
    _check([0, 5, 17, 1, 0, 40], [7, 0, 40, 1, 0, 9], causal, True, "cpu", torch.float32, tol=2e-5)
    _check([33, 0, 2], [33, 3, 2], causal, False, "cpu", torch.float32, tol=2e-5)


def test_tma_needs_row_views_cpu():
    """Descriptors only where a head's rows are one contiguous, 16-byte aligned [N, H * D] view."""
    x = torch.zeros(40, 2, 16)
    assert common.row_descriptors(16, x, x) is not None
    assert common.row_descriptors(16, x.transpose(1, 2).contiguous().transpose(1, 2)) is None  # heads apart
    assert common.row_descriptors(16, torch.zeros(60, 3, 2, 16)[:, 1]) is not None  # a fused-QKV view
    assert common.row_descriptors(16, torch.zeros(40 * 32 + 1)[1:].view(40, 2, 16)) is None  # base 4 B off
    assert common.row_descriptors(16, x[:8]) is None  # fewer rows than a block
    assert common.row_descriptors(16, torch.zeros(1, 2, 16).expand(40, 2, 16)) is None  # rows overlap


def _tiles_and_gathers(flag: str, call):
    """``call()`` with the module flag ``flag`` (_BIAS_TILES or _BIAS_TILES_BWD) on, then off:
    both results, and the flag's value at each bias_tile_table build."""
    runs, built = [], []
    real, before = ja_kernels.bias_tile_table, getattr(ja_kernels, flag)
    for tiles in (True, False):
        setattr(ja_kernels, flag, tiles)
        ja_kernels.bias_tile_table = lambda *a, tiles=tiles, **kw: built.append(tiles) or real(*a, **kw)
        try:
            runs.append(call())
        finally:
            setattr(ja_kernels, flag, before)
            ja_kernels.bias_tile_table = real
    return runs, built


def _bias_forward_both_ways(lengths, causal, window, max_distance, device, dtype, heads=2, dim=32):
    """The forward with the bias read as tiles and by gathers (same offsets object, so both run
    the self-attention path): outputs and log-sum-exps, and how often the tile table was built."""
    off = offsets(lengths, device)
    n = int(off[-1])
    gen = torch.Generator().manual_seed(len(lengths) + max_distance)
    q, k, v = (torch.randn(n, heads, dim, generator=gen).to(device, dtype) for _ in range(3))
    bias = ops.RelativePositionBias((torch.randn(heads, 16, generator=gen) * 0.5).to(device), max_distance)
    return _tiles_and_gathers("_BIAS_TILES", lambda: ja_kernels._forward(
        q, k, v, off, off, max(lengths), max(lengths), bias, causal, dim**-0.5, window or 0)[:2])


# Every (tile, causality, window) of the forward with the length sets in turn (each set meets every
# tile and both causalities; the full cross product took ~90 s of the CPU tier for no new case).
_BIAS_FWD_CASES = [(tile, causal, window) for tile in [(16, 16), (16, 32), (32, 16)] for causal in (False, True)
                   for window in (None, 7, 17)]


@pytest.mark.parametrize("tile,causal,window,lengths",
                         [(*case, SELF_CPU[i % len(SELF_CPU)]) for i, case in enumerate(_BIAS_FWD_CASES)])
def test_bias_tiles_are_the_gathers_bits_cpu(lengths, causal, window, tile):
    """Self-attention's bias tiles hold the per-distance table's values: the forward's output and
    log-sum-exp are bit for bit those of the gathers, for distances inside and beyond the table's
    clamp (max_distance 8 and 40 against lengths up to 70), with windows and causality, square and
    oblong tiles (the table's offsets step by the smaller side)."""
    with common.forced_config({"fwd": (*tile, 1, 1)}):
        for max_distance in (8, 40):
            (tiled, gathered), built = _bias_forward_both_ways(lengths, causal, window, max_distance, "cpu",
                                                               torch.float32)
            assert built == [True]  # the tile path ran, and only with _BIAS_TILES
            assert all(torch.equal(a, b) for a, b in zip(tiled, gathered))


def _bias_backward_both_ways(lengths, causal, window, max_distance, device, dtype, heads=2, dim=32):
    """The backward (dq, dk, dv, the bias table's gradient) with the bias read as tiles
    (_BIAS_TILES_BWD) and by gathers, from one forward; and how often the tile table was built."""
    off = offsets(lengths, device)
    n = int(off[-1])
    gen = torch.Generator().manual_seed(len(lengths) + max_distance + 1)
    q, k, v, grad = (torch.randn(n, heads, dim, generator=gen).to(device, dtype) for _ in range(4))
    bias = ops.RelativePositionBias((torch.randn(heads, 16, generator=gen) * 0.5).to(device), max_distance)
    out, lse, _ = ja_kernels._forward(q, k, v, off, off, max(lengths), max(lengths), bias, causal, dim**-0.5,
                                      window or 0)
    return _tiles_and_gathers("_BIAS_TILES_BWD", lambda: ja_kernels._backward(
        grad, q, k, v, out, lse, off, off, max(lengths), max(lengths), bias, causal, dim**-0.5, window or 0))


_BIAS_BWD_FORCED = {"square": {"dkdv": (16, 16, 1, 1, 0), "dq": (16, 16, 1, 1)},
                    "transposed-dkdv": {"dkdv": (16, 32, 1, 1, 1), "dq": (32, 16, 1, 1)},
                    "oblong": {"dkdv": (32, 16, 1, 1, 0), "dq": (16, 32, 1, 1)}}
# every (formulation, causality, window) with one of the two length sets, chosen so that each
# formulation meets both sets and each (causality, window, set) occurs (the full cross product
# took ~210 s of the CPU tier)
_BIAS_BWD_CASES = [(name, causal, window, (f + causal + (window is not None)) % 2)
                   for f, name in enumerate(_BIAS_BWD_FORCED) for causal in (False, True) for window in (None, 17)]


@pytest.mark.parametrize("name,causal,window,which", _BIAS_BWD_CASES)
def test_backward_bias_tiles_are_the_gathers_bits_cpu(name, causal, window, which):
    """The backward passes read the same tiles (the dK/dV pass's transposed formulation from the
    table stored keys x queries): dq, dk, dv and the bias table's gradient bit for bit the
    gathers', distances inside and beyond the clamp."""
    forced, lengths = _BIAS_BWD_FORCED[name], SELF_CPU[which]
    with common.forced_config(forced):
        for max_distance in (8, 40):
            (tiled, gathered), built = _bias_backward_both_ways(lengths, causal, window, max_distance, "cpu",
                                                                torch.float32)
            assert built == [True, True]  # dK/dV and dQ, only with _BIAS_TILES_BWD
            assert all(torch.equal(a, b) for a, b in zip(tiled, gathered))


def _check_bias_gradient_of_a_tile(tile, max_distance, diag, device):
    """_dbias_tile of random ds tiles against the float64 sum per bucket."""
    import triton
    import triton.language as tl

    @triton.jit
    def one_tile(DS, OUT, BUCKETS, d0, bias_max, BM: tl.constexpr, BN: tl.constexpr, NB: tl.constexpr,
                 DIAG: tl.constexpr):
        a = tl.arange(0, BM)[:, None]
        b = tl.arange(0, BN)[None, :]
        out = ja_kernels._dbias_tile(tl.load(DS + a * BN + b), d0 + a - b, d0, BUCKETS, bias_max, tl.arange(0, NB),
                                     BM, BN, DIAG)
        tl.store(OUT + tl.arange(0, NB), out)

    bm, bn = tile
    buckets = ops.relative_position_bucket(torch.arange(max_distance + 1), 32, max_distance)
    gen = torch.Generator().manual_seed(bm + bn + max_distance)
    few = ja_kernels._DBIAS_DIAGONAL_MIN.value

    def tile_buckets(d0):
        return buckets[(d0 + torch.arange(bm)[:, None] - torch.arange(bn)[None, :]).abs().clamp(max=max_distance)]

    some = next(d0 for d0 in range(2000) if 1 < len(tile_buckets(d0).unique()) <= few)  # the masked sums' case
    spans = set()
    for d0 in (0, -bn + 1, -bn, bm - 1, bm, 5, -7, some, -some, bm + bn, -3 * bn, 100, -100, 700, 1030, -2000):
        ds = torch.randn(bm, bn, generator=gen, dtype=torch.float64)
        got = torch.empty(32, device=device)
        one_tile[(1,)](ds.float().to(device), got, buckets.to(device, torch.int32), d0, max_distance, BM=bm, BN=bn,
                       NB=32, DIAG=diag)
        want = torch.zeros(32, dtype=torch.float64).index_add_(0, tile_buckets(d0).flatten(), ds.flatten())
        torch.testing.assert_close(got.cpu().double(), want, rtol=1e-5, atol=1e-5)
        spans.add(len(tile_buckets(d0).unique()))
    assert 1 in spans and any(1 < n <= few for n in spans) and max(spans) > few  # every path ran


_DIAG_IDS = ["masked-sums", "diagonals"]


@pytest.mark.parametrize("tile", [(16, 16), (32, 16), (16, 32), (64, 32)])
@pytest.mark.parametrize("max_distance", [8, 40, 1024])
@pytest.mark.parametrize("diag", [False, True], ids=_DIAG_IDS)
def test_bias_gradient_of_a_tile_cpu(tile, max_distance, diag):
    """_dbias_tile sums a ds tile per bucket of |d0 + a - b|: one bucket, a few (masked sums) and many
    (diagonal sums first by a register gather where BM >= BN, or masked sums), for tiles on, beside
    and far from the diagonal, both signs."""
    _check_bias_gradient_of_a_tile(tile, max_distance, diag, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("tile", sorted({c[:2] for c in ja_kernels._DQ_CANDIDATES}))
@pytest.mark.parametrize("diag", [False, True], ids=_DIAG_IDS)
def test_bias_gradient_of_a_tile_gpu(tile, diag):
    """The same on the GPU for the dQ candidates' tile shapes (the register gather compiled)."""
    _check_bias_gradient_of_a_tile(tile, 1024, diag, "cuda")


@pytest.mark.parametrize("passes", ["dkdv", "dq"])
def test_backward_bias_tiles_per_pass_cpu(monkeypatch, passes):
    """_BIAS_TILES_BWD naming one pass builds that pass's table only; the gradients keep the gathers' bits."""
    off = offsets([40, 3, 17], "cpu")
    gen = torch.Generator().manual_seed(3)
    q, k, v, grad = (torch.randn(60, 2, 32, generator=gen) for _ in range(4))
    bias = ops.RelativePositionBias(torch.randn(2, 16, generator=gen) * 0.5, 40)
    kinds = []  # HAS_BIAS of each launch's bias operand, dK/dV first: 2 = tiles
    real = ja_kernels._bias_operand
    monkeypatch.setattr(ja_kernels, "_bias_operand", lambda *a, **kw: kinds.append(real(*a, **kw)[1]) or real(*a, **kw))
    runs = []
    with common.forced_config({"dkdv": (16, 16, 1, 1, 0), "dq": (16, 16, 1, 1)}):
        out, lse, _ = ja_kernels._forward(q, k, v, off, off, 40, 40, bias, True, 32**-0.5, 0)
        for flag in (passes, False):
            monkeypatch.setattr(ja_kernels, "_BIAS_TILES_BWD", flag)
            kinds.clear()
            runs.append(ja_kernels._backward(grad, q, k, v, out, lse, off, off, 40, 40, bias, True, 32**-0.5, 0))
            assert kinds == ([2, True] if flag == "dkdv" else [True, 2] if flag == "dq" else [True, True])
    assert all(torch.equal(x, y) for x, y in zip(*runs))


def test_cross_attention_bias_is_gathered_cpu(monkeypatch):
    """Different layouts (cross-attention, shift != 0) never take the tile table; two offsets tensors
    with the same values (self-attention passed as copies) do."""
    real = ja_kernels.bias_tile_table
    monkeypatch.setattr(ja_kernels, "bias_tile_table", lambda *a: pytest.fail("tile table built for cross-attention"))
    _check(*CROSS_CPU[0], True, True, "cpu", torch.float32, tol=2e-5)
    built = []
    monkeypatch.setattr(ja_kernels, "bias_tile_table", lambda *a: built.append(1) or real(*a))
    q = k = v = torch.randn(20, 2, 32)
    bias = ops.RelativePositionBias(torch.randn(2, 16), 8)
    ops.jagged_attention(q, k, v, offsets([20], "cpu"), offsets([20], "cpu"), 20, 20, bias=bias, backend="triton")
    assert built == [1]


def test_bias_tiles_over_the_size_cap_are_gathered_cpu(monkeypatch):
    """A launch whose table would exceed _BIAS_TILE_BYTES gathers instead, forward and backward,
    with the same bits; _tile_table_bytes is the table's real size."""
    per_distance = torch.zeros(3, 41)
    assert ja_kernels._tile_table_bytes(3, 40, 32, 16) == ja_kernels.bias_tile_table(per_distance, 40, 32, 16).numel() * 4
    (tiled, _), _ = _bias_forward_both_ways([40, 3], True, None, 40, "cpu", torch.float32)
    monkeypatch.setattr(ja_kernels, "_BIAS_TILES_BWD", True)
    (tiled_bwd, _), _ = _bias_backward_both_ways([40, 3], True, None, 40, "cpu", torch.float32)
    monkeypatch.setattr(ja_kernels, "_BIAS_TILE_BYTES", 0)
    (capped, gathered), built = _bias_forward_both_ways([40, 3], True, None, 40, "cpu", torch.float32)
    assert built == [] and all(torch.equal(a, b) for a, b in zip(capped, tiled))
    (capped_bwd, _), built = _bias_backward_both_ways([40, 3], True, None, 40, "cpu", torch.float32)
    assert built == [] and all(torch.equal(a, b) for a, b in zip(capped_bwd, tiled_bwd))


def test_bias_tile_table_layout_cpu():
    """Tile t of the table holds bias(min(|d0 + a - b|, max_d)) with d0 = D_LO + t * G, D_LO and the
    tile count as the kernel computes them; the end tiles are constant."""
    per_distance = torch.arange(3 * 41, dtype=torch.float32).view(3, 41)  # head h: 41 h + |d|
    table = ja_kernels.bias_tile_table(per_distance, 40, 32, 16)
    g, d_lo = 16, -((40 + 32 + 15) // 16) * 16
    assert table.shape == (3, ((40 + 16 + 15) // 16 * 16 - d_lo) // g + 1, 32, 16)
    for t in (0, 3, table.shape[1] - 1):
        d = (d_lo + t * g + torch.arange(32)[:, None] - torch.arange(16)[None, :]).abs().clamp(max=40)
        assert torch.equal(table[2, t], 41 * 2 + d.float())
    assert (table[:, 0] == table[:, 0, :1, :1]).all() and (table[:, -1] == table[:, -1, :1, :1]).all()
    assert torch.equal(ja_kernels.bias_tile_table(per_distance, 40, 32, 16, transposed=True), table.transpose(-1, -2))


@pytest.mark.parametrize("window", WINDOW_CPU)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("with_bias", [False, True])
def test_window_self_cpu(window, causal, with_bias):
    _check(SELF_CPU[0], SELF_CPU[0], causal, with_bias, "cpu", torch.float32, tol=2e-5, window=window)


@pytest.mark.parametrize("window", [5, 16, 20])
@pytest.mark.parametrize("causal", [False, True])
def test_window_long_among_short_cpu(window, causal):
    # 70 tokens: several query and key tiles lie entirely outside the band and are skipped.
    _check(SELF_CPU[1], SELF_CPU[1], causal, True, "cpu", torch.float32, tol=2e-5, window=window)


@pytest.mark.parametrize("causal", [False, True])
def test_window_cross_cpu(causal):
    _check(*CROSS_CPU[0], causal, True, "cpu", torch.float32, tol=2e-5, window=6)
    _check(*CROSS_CPU[1], causal, False, "cpu", torch.float32, tol=2e-5, window=17)


@pytest.mark.parametrize("causal", [False, True])
def test_window_skips_tiles_outside_the_band_cpu(causal):
    """Keys in tiles no query's window reaches are never read: NaN there must not reach any output
    or gradient (a masked tile would still turn 0 * NaN into NaN), and their dK, dV are 0."""
    qo, ko = offsets([16]), offsets([64])  # queries aligned to key positions 48..63
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(16, 2, 32, generator=gen, requires_grad=True)
    k, v = (torch.randn(64, 2, 32, generator=gen) for _ in range(2))
    k[:32], v[:32] = float("nan"), float("nan")  # tiles [0, 16) and [16, 32) of 16 keys
    k.requires_grad_(True), v.requires_grad_(True)
    table = torch.randn(2, 16, generator=gen, requires_grad=True)
    bias = ops.RelativePositionBias(table, 40)
    out = ops.jagged_attention(q, k, v, qo, ko, 16, 64, bias=bias, causal=causal, window=16, backend="triton")
    dq, dk, dv, dtable = torch.autograd.grad(out.square().sum(), [q, k, v, table])
    for t in (out, dq, dk, dv, dtable):
        assert torch.isfinite(t).all()
    assert torch.equal(dk[:32], torch.zeros_like(dk[:32])) and torch.equal(dv[:32], torch.zeros_like(dv[:32]))
    clean_k, clean_v = k.detach()[32:], v.detach()[32:]  # the same attention without the far keys
    ref = attention_loop(q, clean_k, clean_v, qo, offsets([32]), causal=causal, window=16,
                         bias=ops.RelativePositionBias(table, 40))
    assert rel_err(out, ref) < 2e-5


@pytest.mark.parametrize("window", [0, -3, 2.5, True])
def test_window_must_be_a_positive_int(window):
    x = torch.zeros(1, 1, 16)
    off = torch.tensor([0, 1])
    with pytest.raises(ValueError, match="window"):
        ops.jagged_attention(x, x, x, off, off, 1, 1, window=window, backend="triton")


def test_large_negative_bias_rows_cpu():
    """All valid logits far below 0: exact (no cancellation), finite, zeros for keyless rows."""
    lengths = [5, 0, 20, 1]
    qo = offsets(lengths)
    gen = torch.Generator().manual_seed(9)
    q, k, v = (torch.randn(26, 2, 32, generator=gen) for _ in range(3))
    table = torch.full((2, 16), -300.0)
    bias = ops.RelativePositionBias(table, 40)
    out = ops.jagged_attention(q, k, v, qo, qo, 20, 20, bias=bias, causal=True, backend="triton")
    ref = attention_loop(q, k, v, qo, qo, causal=True, bias=bias)
    assert torch.isfinite(out).all()
    assert rel_err(out, ref) < 2e-4


def test_no_keys_gives_zeros_cpu():
    qo, ko = offsets([3, 2]), offsets([0, 0])
    q = torch.randn(5, 2, 32, requires_grad=True)
    k = torch.randn(0, 2, 32, requires_grad=True)
    v = torch.randn(0, 2, 32, requires_grad=True)
    out = ops.jagged_attention(q, k, v, qo, ko, 3, 0, backend="triton")
    assert torch.equal(out, torch.zeros_like(out))
    out.sum().backward()
    assert torch.equal(q.grad, torch.zeros_like(q))


@pytest.mark.gpu
@pytest.mark.parametrize("lengths", SELF_GPU)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("dim", [64, 128])
def test_self_gpu(lengths, causal, with_bias, dim):
    _check(lengths, lengths, causal, with_bias, "cuda", torch.bfloat16, heads=4, dim=dim, factor=2.0)


@pytest.mark.gpu
@pytest.mark.parametrize("q_lengths,k_lengths", CROSS_GPU)
@pytest.mark.parametrize("causal", [False, True])
def test_cross_gpu(q_lengths, k_lengths, causal):
    _check(q_lengths, k_lengths, causal, True, "cuda", torch.bfloat16, heads=4, dim=128, factor=2.0)


@pytest.mark.gpu
@pytest.mark.parametrize("lengths", SELF_GPU)
@pytest.mark.parametrize("window", WINDOW_GPU)
@pytest.mark.parametrize("causal", [False, True])
def test_window_self_gpu(lengths, window, causal):
    _check(lengths, lengths, causal, True, "cuda", torch.bfloat16, heads=4, dim=128, factor=2.0, window=window)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_window_cross_gpu(causal):
    _check(*CROSS_GPU[0], causal, True, "cuda", torch.bfloat16, heads=4, dim=64, factor=2.0, window=100)


# Every autotune candidate of every pass, each pinned in turn: the autotuner may pick any of them
# (the rest of the GPU tier runs with autotune off, i.e. the first candidate only), and a config
# the compiler gets wrong fails here, not silently in training.
_EVERY_CONFIG = ([("fwd", c) for c in dict.fromkeys(sum(ja_kernels._FWD_CANDIDATES.values(), []))]
                 + [("dkdv", c) for c in ja_kernels._DKDV_CANDIDATES] + [("dq", c) for c in ja_kernels._DQ_CANDIDATES])


@pytest.mark.gpu
@pytest.mark.parametrize("which,cfg", _EVERY_CONFIG, ids=[f"{w}-{'_'.join(map(str, c))}" for w, c in _EVERY_CONFIG])
def test_every_candidate_config_gpu(which, cfg):
    """bf16, both head dims: uniform lengths without causality or bias (the benchmark's self-200),
    one long among short with causality and bias, cross lengths with a window; element-wise too (the
    benchmark saw dropped candidates differ by 1.2 in a few elements while the norm-wise error passed)."""
    strict = {"factor": 2.0, "elementwise": True}
    with common.forced_config({which: cfg}):
        _check(SELF_GPU[2], SELF_GPU[2], False, False, "cuda", torch.bfloat16, heads=4, dim=128, **strict)
        _check(SELF_GPU[1], SELF_GPU[1], True, True, "cuda", torch.bfloat16, heads=4, dim=64, **strict)
        _check(*CROSS_GPU[0], True, True, "cuda", torch.bfloat16, heads=4, dim=128, window=100, **strict)
        _check(SELF_GPU[0], SELF_GPU[0], False, True, "cuda", torch.bfloat16, heads=4, dim=128, window=64, **strict)


_FWD_CONFIGS = [c for w, c in _EVERY_CONFIG if w == "fwd"]


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", _FWD_CONFIGS, ids=["_".join(map(str, c)) for c in _FWD_CONFIGS])
def test_bias_tiles_are_the_gathers_bits_gpu(cfg):
    """Every forward candidate, bf16, D=128: the bias tiles give the gathers' bits (one long among
    short, uniform lengths; causal or not; distances past the clamp)."""
    with common.forced_config({"fwd": cfg}):
        for lengths, causal, window in ((SELF_GPU[1], True, None), (SELF_GPU[2], False, None), (SELF_GPU[0], True, 64)):
            (tiled, gathered), built = _bias_forward_both_ways(lengths, causal, window, 128, "cuda", torch.bfloat16,
                                                               heads=4, dim=128)
            assert built == [True] and all(torch.equal(a, b) for a, b in zip(tiled, gathered))


_BWD_CONFIGS = [(w, c) for w, c in _EVERY_CONFIG if w != "fwd"]


@pytest.mark.gpu
@pytest.mark.parametrize("which,cfg", _BWD_CONFIGS, ids=[f"{w}-{'_'.join(map(str, c))}" for w, c in _BWD_CONFIGS])
def test_backward_bias_tiles_are_the_gathers_bits_gpu(which, cfg):
    """Every dK/dV and dQ candidate, bf16, D=128: the backward's bias tiles give the gathers' bits.
    The other pass is pinned too (an unpinned one would be trial-launched once per new key)."""
    pinned = {"dkdv": ja_kernels._DKDV_CANDIDATES[0], "dq": ja_kernels._DQ_CANDIDATES[0], which: cfg}
    with common.forced_config(pinned):
        for lengths, causal, window in ((SELF_GPU[1], True, None), (SELF_GPU[2], False, None), (SELF_GPU[0], True, 64)):
            (tiled, gathered), built = _bias_backward_both_ways(lengths, causal, window, 128, "cuda", torch.bfloat16,
                                                                heads=4, dim=128)
            assert built == [True, True] and all(torch.equal(a, b) for a, b in zip(tiled, gathered))


_TMA_CONFIGS = [(w, c) for w, c in _EVERY_CONFIG if len(c) > (5 if w == "dkdv" else 4) and c[5 if w == "dkdv" else 4]]


@pytest.mark.gpu
@pytest.mark.parametrize("which,cfg", _TMA_CONFIGS, ids=[f"{w}-{'_'.join(map(str, c))}" for w, c in _TMA_CONFIGS])
def test_tma_on_fused_qkv_views_gpu(which, cfg):
    """The model's layout: q, k, v as views of one [N, 3, H, D] projection (row stride 3*H*D)
    through the TMA tiles give exactly what contiguous copies give, gradients included."""
    lengths = [1000] + [3, 17, 0, 64, 200] * 6
    off = offsets(lengths, "cuda")
    gen = torch.Generator().manual_seed(4)
    qkv = torch.randn(int(off[-1]), 3, 4, 128, generator=gen).to("cuda", torch.bfloat16).requires_grad_(True)
    grad = torch.randn(int(off[-1]), 4, 128, generator=gen).to("cuda", torch.bfloat16)
    table = torch.randn(4, 16, device="cuda", requires_grad=True)
    copies = [t.detach().contiguous().requires_grad_(True) for t in qkv.unbind(1)]
    with common.forced_config({which: cfg}):
        runs = []
        for q, k, v in (qkv.unbind(1), copies):
            out = _run("triton", q, k, v, table, off, off, 1000, 1000, True)
            runs.append([out, *torch.autograd.grad(out, [q, k, v, table], grad)])
    for a, b in zip(*runs):
        assert torch.equal(a, b)


@pytest.mark.gpu
def test_fp16_gpu():
    _check([0, 1, 64, 65, 300], [0, 1, 64, 65, 300], True, True, "cuda", torch.float16, heads=2, dim=64, factor=2.0)


@pytest.mark.gpu
@pytest.mark.parametrize("window", [None, 256])
def test_backward_is_deterministic_gpu(window):
    lengths = [1000] + [3, 17, 0, 64, 129] * 10
    qo, ko, q, k, v, table, grad_out = _inputs(lengths, lengths, 4, 128, "cuda", torch.bfloat16, 3, True)
    runs = []
    for _ in range(2):
        out = _run("triton", q, k, v, table, qo, ko, 1000, 1000, True, window)
        runs.append([out] + list(_grads(out, [q, k, v, table], grad_out)))
    for a, b in zip(*runs):
        assert torch.equal(a, b)


def test_strided_qkv_views_cpu():
    """q, k, v as views of one fused QKV projection (row stride 3*H*D): no copy needed, same result."""
    lengths = [5, 17, 0, 2]
    off = offsets(lengths)
    gen = torch.Generator().manual_seed(2)
    qkv = torch.randn(24, 3, 2, 32, generator=gen, requires_grad=True)
    q, k, v = qkv.unbind(1)
    out = ops.jagged_attention(q, k, v, off, off, 17, 17, causal=True, backend="triton")
    ref = attention_loop(q, k, v, off, off, causal=True)
    assert rel_err(out, ref) < 2e-5
    out.sum().backward()
    assert torch.isfinite(qkv.grad).all()


def test_torch_compile_no_graph_break_cpu(monkeypatch):
    """The op is a torch.library custom op with a fake: fullgraph compile traces it, fwd and bwd;
    the compiled forward still reads the bias as tiles (self-attention's one offsets tensor)."""
    ops.preload()  # as the trainer does: the first call of an op imports its module (alone, this test had it fail)
    built, real = [], ja_kernels.bias_tile_table
    monkeypatch.setattr(ja_kernels, "bias_tile_table", lambda *a, **kw: built.append(1) or real(*a, **kw))
    lengths = [3, 0, 17]
    off = offsets(lengths)
    gen = torch.Generator().manual_seed(8)
    q, k, v = (torch.randn(20, 2, 32, generator=gen, requires_grad=True) for _ in range(3))
    table = torch.randn(2, 16, generator=gen, requires_grad=True)

    def f(q, k, v, table):
        bias = ops.RelativePositionBias(table, 40)
        return ops.jagged_attention(q, k, v, off, off, 17, 17, bias=bias, causal=True, backend="triton").square().sum()

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    loss = compiled(q, k, v, table)
    assert built, "the compiled forward gathered the bias instead of reading tiles"
    grads = torch.autograd.grad(loss, [q, k, v, table])
    ref_loss = f(q, k, v, table)
    ref_grads = torch.autograd.grad(ref_loss, [q, k, v, table])
    assert torch.allclose(loss, ref_loss)
    for a, b in zip(grads, ref_grads):
        assert torch.allclose(a, b)


def test_bias_bucket_table_is_built_once_per_layout(monkeypatch):
    """The bucket of each |distance| depends on (max_distance, buckets, device) only: built on the
    first call and reused (it was ~10 small kernels a call); the per-distance bias follows the
    table's current values on every call."""
    calls = []
    real = ja_kernels.relative_position_bucket
    monkeypatch.setattr(ja_kernels, "relative_position_bucket", lambda *a: calls.append(a[1:]) or real(*a))
    monkeypatch.setattr(ja_kernels, "_BUCKETS", {})
    table = torch.randn(2, 16)
    bias = ops.RelativePositionBias(table, 40)
    d1, b1, max_d, nb = ja_kernels._bias_tables(bias, 2, torch.device("cpu"))
    table.mul_(2.0)  # an optimizer step
    d2, b2, _, _ = ja_kernels._bias_tables(bias, 2, torch.device("cpu"))
    assert calls == [(16, 40)] and b2 is b1 and (max_d, nb) == (40, 16)
    want = ops.relative_position_bucket(torch.arange(41), 16, 40)
    assert torch.equal(b1, want.to(torch.int32))
    assert torch.equal(d2, table[:, want] * ja_kernels.LOG2E) and torch.equal(d2, 2 * d1)
    ja_kernels._bias_tables(ops.RelativePositionBias(table, 80), 2, torch.device("cpu"))
    assert calls == [(16, 40), (16, 80)]
