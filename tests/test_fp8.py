"""FP8 GEMMs, casts, linear and MLP block (gemctl.ops.triton.fp8_gemm, gemctl.precision.fp8_linear).

Casts are bit-exact against ``quantize_mx`` with the block set to the whole row or column (its
own tests check it against an independent reference, tests/test_mx.py). GEMMs are compared with
float64 products of the dequantized operands (the only error left is float32 accumulation).
The linear and the fused MLP are compared with the emulated numerics of the same format; the
fused MLP rounds its pre-activation and dpre to bf16 in memory, which the emulated reference here
mirrors. Triton runs under TRITON_INTERPRET=1 on CPU (conftest); the tests marked gpu run the same
checks on CUDA in bf16 at realistic sizes.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from gemctl.precision.fp8_linear import (
    GRANULARITIES, Fp8Recipe, _EmulatedFunction, fp8_linear, fp8_mlp, hadamard_features, qdq,
)
from gemctl.precision.mx import dequantize_mx, e8m0_to_float, quantize_mx

pytest.importorskip("triton")
from gemctl.ops.triton.common import INTERPRET, forced_config  # noqa: E402
from gemctl.ops.triton.fp8_gemm import fp8_cast_cols, fp8_cast_rows, fp8_gemm  # noqa: E402
from gemctl.ops.triton import fp8_gemm as fp8_kernels  # noqa: E402

E4M3 = torch.float8_e4m3fn
TMA = {"fp8_gemm": (16, 16, 32, 1, 1, True)}  # the persistent TMA kernel under the interpreter


def _hostile(rows: int, cols: int, dtype, device="cpu") -> torch.Tensor:
    """Rows spanning many binades, a zero row, subnormal-only and huge rows, one outlier."""
    g = torch.Generator().manual_seed(rows * 1000 + cols)
    x = torch.randn(rows, cols, generator=g) * torch.logspace(-6, 6, rows).unsqueeze(1)
    x[0] = 0.0
    if rows > 2:
        x[1] = torch.randn(cols, generator=g) * 1e-39  # float32 subnormals (bf16 keeps some)
        x[2, cols // 2] = 3e38 if dtype == torch.float32 else 3e37  # near the top of the range
    return x.to(dtype).to(device)


def _bytes(t):
    return t.view(torch.uint8)


def check_cast(x: torch.Tensor, chunk: int) -> None:
    dr, sr = fp8_cast_rows(x)
    rd, rs = quantize_mx(x, block=x.shape[1], axis=-1, scale_rule="rceil")
    assert torch.equal(_bytes(dr), _bytes(rd)) and torch.equal(sr, rs[:, 0])
    dt, sc = fp8_cast_cols(x, chunk)
    cd, cs = quantize_mx(x, block=chunk, axis=0, scale_rule="rceil")
    assert torch.equal(_bytes(dt), _bytes(cd.t().contiguous())) and torch.equal(sc, cs.t())
    # The row cast's column maxima (runs of amax_rows rows) give the column cast its chunk scales:
    # the same bytes from one read.
    amax_rows = max(2, chunk // 4)
    dr2, sr2, part = fp8_cast_rows(x, col_amax=True, amax_rows=amax_rows)
    assert torch.equal(_bytes(dr2), _bytes(dr)) and torch.equal(sr2, sr)
    if x.shape[1] > fp8_kernels._ROWS_IN_REGISTERS:  # wide rows: two sweeps, no column maxima
        assert part is None
        return
    assert part.shape == (-(-x.shape[0] // amax_rows), x.shape[1])
    # each column's E8M0 byte over each run of amax_rows rows, the partial last run included
    assert torch.equal(part, quantize_mx(x, block=amax_rows, axis=0, scale_rule="rceil")[1])
    dt2, sc2 = fp8_cast_cols(x, chunk, part=part, amax_rows=amax_rows)
    assert torch.equal(_bytes(dt2), _bytes(dt)) and torch.equal(sc2, sc)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape,chunk", [((5, 45), 8), ((37, 70), 16), ((1, 1), 4), ((33, 16), 64)])
def test_cast_bit_exact(shape, chunk, dtype):
    check_cast(_hostile(*shape, dtype), chunk)


@pytest.mark.parametrize("rows,chunk", [(300, 256), (2100, 2048)])
def test_cast_cols_from_many_runs(rows, chunk):
    """Runs of 2 rows: 128 per 256-row chunk, combined 64 at a time (unrolled loads), and 1024 per
    2048-row chunk, more loads than the column cast unrolls (_UNROLLED_PART_LOADS), so it loops
    over them; the partial last chunk's missing runs too."""
    x = _hostile(rows, 24, torch.bfloat16)
    dr, sr, part = fp8_cast_rows(x, col_amax=True, amax_rows=2)
    dt, sc = fp8_cast_cols(x, chunk, part=part, amax_rows=2)
    cd, cs = quantize_mx(x, block=chunk, axis=0, scale_rule="rceil")
    assert torch.equal(_bytes(dt), _bytes(cd.t().contiguous())) and torch.equal(sc, cs.t())


def test_row_per_warp_config_checks():
    """A pinned row-per-warp config names what it needs: rows a multiple of the warps, and an
    sm_90+ GPU (its kernel is Gluon); the autotuner never offers it off such a GPU."""
    x = torch.randn(64, 256)
    with forced_config({"fp8_cast_rows": (4, 8, 0, 0, 1)}), pytest.raises(ValueError, match="multiple of the warps"):
        fp8_cast_rows(x, col_amax=True, amax_rows=16)
    with forced_config({"fp8_cast_rows": (4, 4, 0, 0, 1)}), pytest.raises(ValueError, match="sm_90"):
        fp8_cast_rows(x, col_amax=True, amax_rows=16)
    # the shared-memory ring's cp.async copies 16-byte vectors: 16-aligned widths and rows only
    for bad in (torch.randn(64, 200), torch.randn(64, 257)[:, 1:], torch.randn(64, 4096),
                torch.randn(64 * 256 + 1)[1:].view(64, 256)):  # the last: only its base misaligned
        with forced_config({"fp8_cast_rows": (1, 1, 0, 0, 1, 4)}), pytest.raises(ValueError, match="shared memory"):
            fp8_cast_rows(bad, col_amax=True, amax_rows=16)
    with forced_config({"fp8_cast_rows": (1, 1, 0, 0, 1, 4)}), pytest.raises(ValueError, match="sm_90"):
        fp8_cast_rows(x, col_amax=True, amax_rows=16)


def _same_values(a, b):
    """Equal tensors, the run bytes compared as integers (uint8, or int32 from the atomic configs)."""
    if a.dtype != b.dtype and not a.is_floating_point() and not b.is_floating_point():
        a, b = a.to(torch.int64), b.to(torch.int64)
    return torch.equal(a, b)


def _rows_outputs(x, cfg, act=None, norm=False, amax_rows=8):
    """Every output of the row cast with column bytes (the RMSNorm-fused one with norm), cfg pinned."""
    from gemctl.ops.triton.fp8_gemm import fp8_rmsnorm_cast_rows

    with forced_config({"fp8_cast_rows": cfg}):
        if norm:
            w = torch.linspace(0.5, 2.0, x.shape[1], device=x.device)
            out = fp8_rmsnorm_cast_rows(x, w, 1e-6, col_amax=True, amax_rows=amax_rows)
        else:
            out = fp8_cast_rows(x, act=act, col_amax=True, amax_rows=amax_rows)
    return [t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t for t in out]


@pytest.mark.parametrize("act,norm", [(None, False), ("silu", False), (None, True)], ids=["plain", "silu", "norm"])
def test_cast_rows_two_blocks_in_flight(act, norm):
    """DEPTH 2 (the column-bytes loop requests two blocks of rows ahead) and DEPTH 0 (the loop
    pipelined by Triton): the same outputs as one block ahead, the last program's run partial (37
    rows, runs of 8, blocks of 2)."""
    x = _hostile(37, 70, torch.bfloat16)
    for deep in (1, 2):  # two blocks ahead in registers; the loop pipelined by Triton
        for got, want in zip(_rows_outputs(x, (2, 1, deep), act, norm), _rows_outputs(x, (2, 1, 0), act, norm)):
            assert torch.equal(got, want)


@pytest.mark.parametrize("act,norm", [(None, False), ("silu", False), (None, True)], ids=["plain", "silu", "norm"])
def test_cast_rows_atomic_column_bytes(act, norm):
    """One block per program with the column bytes folded by atomic max (four programs per run of
    8 rows, the last run partial): the same codes, scales, rstd and run bytes as the looping cast,
    and the column cast reads the int32 bytes as it reads the uint8 ones."""
    x = _hostile(37, 70, torch.bfloat16)
    got, want = _rows_outputs(x, (2, 1, 0, 1), act, norm), _rows_outputs(x, (2, 1, 0), act, norm)
    assert got[-1].dtype == torch.int32 and want[-1].dtype == torch.uint8
    for g, w in zip(got, want):
        assert _same_values(g, w)
    extra = {"norm": (want[2], torch.linspace(0.5, 2.0, x.shape[1]))} if norm else {}
    cols = [fp8_cast_cols(x, 16, act=act, part=p, amax_rows=8, **extra) for p in (got[-1], want[-1])]
    for g, w in zip(*cols):
        assert torch.equal(g.view(torch.uint8), w.view(torch.uint8))


@pytest.mark.parametrize("act,norm", [(None, False), ("silu", False), (None, True)], ids=["plain", "silu", "norm"])
def test_cast_cols_split_chunks(act, norm):
    """Several programs per chunk (SPLIT: the scales come from the row cast's bytes, so the chunk's
    rows can be shared): the same bytes as one program per chunk, the last chunk partial."""
    x = _hostile(45, 40, torch.bfloat16)
    rows = _rows_outputs(x, (2, 1, 0), act, norm, amax_rows=4)
    kwargs = dict(part=rows[-1], amax_rows=4)
    if norm:
        kwargs["norm"] = (rows[2], torch.linspace(0.5, 2.0, x.shape[1]))
    outs = []
    # the fourth pipelined (stages); the last two, whole tiles unmasked (_COLS_WHOLE: 40 columns, so
    # the third 16-column block and the last chunk's last 4-row tile take the masked path; a 32-row
    # tile is never whole in these 16-row chunks: one taken unmasked would read past the rows and
    # store past their padding, into the next column's codes or past the buffer)
    for cfg in ((4, 16, 1, 1), (4, 16, 1, 2), (4, 16, 1, 4), (4, 16, 1, 2, 3), (4, 16, 1, 2, 1, 1),
                (32, 16, 1, 0, 1, 1)):
        with forced_config({"fp8_cast_cols": cfg}):
            outs.append([t.view(torch.uint8) for t in fp8_cast_cols(x, 16, act=act, **kwargs)])
    for cfg in ((4, 16, 1, 0, 3), (4, 16, 1, 0, 1, 1)):  # the two-read cast pipelined, and whole tiles
        with forced_config({"fp8_cast_cols": cfg}):
            outs.append([t.view(torch.uint8) for t in fp8_cast_cols(x, 16, act=act, norm=kwargs.get("norm"))])
    cd, cs = fp8_cast_cols(x, 16, act=act, norm=kwargs.get("norm"))  # two reads: scales of its own
    for data, scale in outs:
        assert torch.equal(data, cd.view(torch.uint8)) and torch.equal(scale, cs)


def test_new_cast_candidates_wait_for_the_gpu_tier(monkeypatch):
    """Two blocks in flight and split chunks are pinned by tests and benchmarks, timed by the
    autotuner only once the GPU tier has passed them (_GPU_CHECKED) or with _PENDING_AUTOTUNE."""
    from gemctl.ops.triton import common

    seen = []

    def pick(key, cands, run, interp):
        seen.append(cands() if callable(cands) else cands)  # the list, or the function building it
        return interp

    monkeypatch.setattr(fp8_kernels, "pick_config", pick)
    monkeypatch.setattr(fp8_kernels, "_GPU_CHECKED", set())
    x = torch.randn(256, 64)
    fp8_cast_rows(x, col_amax=True, amax_rows=16)
    fp8_cast_cols(x, 64, part=torch.zeros(16, 64, dtype=torch.uint8), amax_rows=16)
    rows, cols = seen
    assert rows and not any(any(c[2:]) for c in rows) and cols and all(c[3] == 0 for c in cols)
    monkeypatch.setattr(fp8_kernels, "_PENDING_AUTOTUNE", True)
    seen.clear()
    fp8_cast_rows(x, col_amax=True, amax_rows=16)
    fp8_cast_cols(x, 64, part=torch.zeros(16, 64, dtype=torch.uint8), amax_rows=16)
    rows, cols = seen
    assert any(c[2] for c in rows) and any(c[3:] == (1,) for c in rows)  # two blocks in flight, atomic
    assert any(c[3] == fp8_kernels._COLS_SPLIT for c in cols) and any(c[5:] == (1,) for c in cols)  # whole tiles
    seen.clear()
    fp8_cast_cols(x, 64, act="silu", part=torch.zeros(16, 64, dtype=torch.uint8), amax_rows=16)
    assert not any(c[5:] for c in seen[0])  # SiLU takes whole tiles unmasked in every config
    assert common.gpu_checked([(1, 4, 1)], 2, {(1, 4, 1)}) == [(1, 4, 1)]


def test_register_transpose_cast_configs(monkeypatch):
    """The register-transpose column casts (_COLS_PAIRS) are candidates only for what they take
    (bf16 rows from the row cast's bytes, plain or silu, no norm, 64-column blocks) where the
    Gluon kernels run, autotuned since their GPU tier passed (pending while they are not in
    _GPU_CHECKED); pinned where Gluon cannot run (here: no GPU) they raise ValueError, which the
    autotuner skips."""
    seen = []

    def pick(key, cands, run, interp):
        seen.append(cands() if callable(cands) else cands)
        return interp

    monkeypatch.setattr(fp8_kernels, "pick_config", pick)
    monkeypatch.setattr(fp8_kernels, "gluon_runs", lambda name, device: True)
    monkeypatch.setattr(fp8_kernels, "_PENDING_AUTOTUNE", True)
    x = torch.randn(256, 128).to(torch.bfloat16)
    part = torch.zeros(16, 128, dtype=torch.uint8)
    exact = dict(amax_rows=16, bit_cast=False)  # the hardware conversion (the interpreter's default is the bit cast)
    fp8_cast_cols(x, 64, part=part, **exact)
    fp8_cast_cols(x, 64, act="silu", part=part, **exact)
    fp8_cast_cols(x, 64, **exact)  # two reads
    fp8_cast_cols(x[:, :96], 64, part=part[:, :96], **exact)  # not 64-column blocks
    fp8_cast_cols(x.float(), 64, part=part, **exact)  # fp32 rows
    fp8_cast_cols(x, 64, part=part, norm=(torch.ones(256), torch.ones(128)), **exact)
    fp8_cast_cols(x, 64, part=part, amax_rows=16, bit_cast=True)
    has_pairs = [any(fp8_kernels.config_field(c, 6) for c in cands) for cands in seen]
    assert has_pairs == [True, True, False, False, False, False, False]
    monkeypatch.setattr(fp8_kernels, "_PENDING_AUTOTUNE", False)
    seen.clear()
    fp8_cast_cols(x, 64, part=part, **exact)
    assert any(fp8_kernels.config_field(c, 6) for c in seen[0])  # GPU tier passed: autotuned
    monkeypatch.setattr(fp8_kernels, "_GPU_CHECKED", fp8_kernels._GPU_CHECKED - set(fp8_kernels._COLS_PAIRS))
    seen.clear()
    fp8_cast_cols(x, 64, part=part, **exact)
    assert not any(fp8_kernels.config_field(c, 6) for c in seen[0])  # unchecked configs stay pending
    monkeypatch.undo()
    pinned = fp8_kernels._COLS_PAIRS[0]
    with forced_config({"fp8_cast_cols": pinned}), pytest.raises(ValueError, match="sm_90"):
        fp8_cast_cols(x, 64, part=part, amax_rows=16, bit_cast=False)  # takes it; Gluon cannot run here
    for bad, args in ((pinned, dict(x=x.float())), (pinned, dict(x=x[:, :96], part=part[:, :96])),
                      (pinned, dict(bit_cast=True)), ((128, 32, 4, 0, 1, 0, 1), {}), ((96, 64, 4, 0, 1, 0, 1), {}),
                      ((128, 64, 4, 3, 1, 0, 1), {})):  # what it does not take; a shape or split it is not built for
        call = dict(dict(x=x, part=part, bit_cast=False), **args)
        with forced_config({"fp8_cast_cols": bad}), pytest.raises(ValueError, match="register-transpose config"):
            fp8_cast_cols(call.pop("x"), 64, amax_rows=16, **call)


def test_cast_rows_two_sweeps_for_wide_rows(monkeypatch):
    from gemctl.ops.triton import fp8_gemm as mod

    monkeypatch.setattr(mod, "_ROWS_IN_REGISTERS", 16)  # force the amax sweep + quantize sweep
    x = _hostile(6, 5000, torch.bfloat16)
    dr, sr = fp8_cast_rows(x)
    rd, rs = quantize_mx(x, block=5000, axis=-1, scale_rule="rceil")
    assert torch.equal(_bytes(dr), _bytes(rd)) and torch.equal(sr, rs[:, 0])
    dr2, sr2, part = fp8_cast_rows(x, col_amax=True)  # no column maxima from the two-sweep kernel
    assert part is None and torch.equal(_bytes(dr2), _bytes(rd))


def test_cast_nan_inf_rows_and_columns():
    x = torch.randn(6, 40)
    x[1, 3] = float("nan")
    x[4, 7] = float("inf")
    dr, sr, part = fp8_cast_rows(x, col_amax=True, amax_rows=2)
    dt, sc = fp8_cast_cols(x, 4, part=part, amax_rows=2)
    assert torch.equal(_bytes(dt), _bytes(fp8_cast_cols(x, 4)[0])) and torch.equal(sc, fp8_cast_cols(x, 4)[1])
    assert sr[1] == 255 and sr[4] == 255 and (sr[[0, 2, 3, 5]] != 255).all()
    assert sc[3, 0] == 255 and sc[7, 1] == 255 and sc[3, 1] != 255  # rows 0-3 and 4-5 are chunks
    assert torch.isnan(dr[1].float()).all() and torch.isnan(dt[7, 4:].float()).all()
    assert not torch.isnan(dr[0].float()).any() and not torch.isnan(dt[7, :4].float()).any()


def check_norm_cast(x: torch.Tensor, chunk: int, weight_dtype: torch.dtype = torch.float32, eps: float = 1e-6,
                    weight_scale: float = 2.0) -> None:
    """fp8_rmsnorm_cast_rows against RMSNorm computed in torch from the kernel's rstd (float32, one
    rounding to x's dtype) then cast by fp8_cast_rows: the same bytes; rstd against float64; the
    column cast with norm=(rstd, w) against the column cast of that RMSNorm output. The weight in
    ``weight_dtype`` (a float32 weight is rounded to x's dtype as the unfused norm applies it)."""
    from gemctl.ops.triton.fp8_gemm import fp8_rmsnorm_cast_rows

    g = torch.Generator().manual_seed(x.shape[1])
    w = (torch.randn(x.shape[1], generator=g) * weight_scale).to(x.device, weight_dtype)
    amax_rows = max(2, chunk // 4)
    data, scale, rstd, part = fp8_rmsnorm_cast_rows(x, w, eps, col_amax=True, amax_rows=amax_rows)
    want_rstd = torch.rsqrt(x.double().pow(2).mean(-1) + eps)
    assert torch.allclose(rstd.double(), want_rstd, rtol=1e-6, atol=0)  # GPU rsqrt: ~2 ulp
    y = ((x.float() * rstd[:, None]) * w.to(x.dtype).float()).to(x.dtype)
    dr, sr, pr = fp8_cast_rows(y, col_amax=True, amax_rows=amax_rows)
    assert torch.equal(_bytes(data), _bytes(dr)) and torch.equal(scale, sr) and torch.equal(part, pr)
    dt, sc = fp8_cast_cols(y, chunk)
    for kwargs in ({}, {"part": part, "amax_rows": amax_rows}):  # two reads, and the row cast's maxima
        ct, cs = fp8_cast_cols(x, chunk, norm=(rstd, w), **kwargs)
        assert torch.equal(_bytes(ct), _bytes(dt)) and torch.equal(cs, sc)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape,chunk", [((37, 70), 16), ((1, 1), 4), ((33, 16), 64)])
def test_rmsnorm_cast_bit_exact(shape, chunk, dtype):
    x = _hostile(*shape, dtype)
    if shape[0] > 2:
        x[1] = 0.0  # the hostile rows' subnormals overflow x^2's float32 range the other way: a zero row
        x[2, shape[1] // 2] = 1e18  # x^2 stays finite in float32
    check_norm_cast(x, chunk)
    if dtype == torch.bfloat16 and shape[0] > 2:  # a bf16 weight (the model's under bf16 params)
        check_norm_cast(x, chunk, torch.bfloat16)
        check_norm_cast(x, chunk, torch.bfloat16, weight_scale=1e-39)  # subnormal bf16 weights


def check_rounding_to_the_input_dtype(device: str, bit_casts) -> None:
    """The fused norm's two roundings (fp8_gemm._as_stored: its output, _norm_weight: its weight)
    against torch's ``.to(dtype).float()`` on 65,536 random float32 bit patterns plus ties,
    subnormals, Inf and -0: every input dtype, every weight dtype, each conversion path (BIT_CAST:
    the integer rounding; else the hardware one, bf16 pairs through inline PTX on a GPU)."""
    import triton
    import triton.language as tl

    @triton.jit
    def kernel(X, NW, Y, OUT_W, OUT_Y, n, IN_BF16: tl.constexpr, BIT_CAST: tl.constexpr, B: tl.constexpr):
        cc = tl.program_id(0) * B + tl.arange(0, B)
        m = cc < n
        tl.store(OUT_W + cc, fp8_kernels._norm_weight(X, NW, cc, m, IN_BF16, BIT_CAST), mask=m)
        y = tl.load(Y + cc, mask=m, other=0.0)
        tl.store(OUT_Y + cc, fp8_kernels._as_stored(X, y, IN_BF16, BIT_CAST), mask=m)

    g = torch.Generator().manual_seed(1)
    n = 1 << 16
    f32 = torch.randint(-2**31, 2**31 - 1, (n,), generator=g, dtype=torch.int64).to(torch.int32).view(torch.float32)
    f32 = torch.where(torch.isnan(f32), torch.zeros_like(f32), f32)
    f32[:9] = torch.tensor([1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8), 3.3e38, 1e-39, 7e-45, float("inf"), -0.0, 65520.0])

    def same(got, want):
        return bool(((got == want) | (torch.isnan(got) & torch.isnan(want))).all())

    for bit_cast in bit_casts:
        for x_dtype in (torch.bfloat16, torch.float16, torch.float32):
            x = torch.zeros(1, 2, dtype=x_dtype, device=device)
            xin = x.view(torch.int16) if x_dtype == torch.bfloat16 else x
            y = f32.to(device)
            for w_dtype in (torch.float32, torch.bfloat16, torch.float16):
                w = f32.to(w_dtype).to(device)
                out_w, out_y = torch.empty(n, device=device), torch.empty(n, device=device)
                kernel[(triton.cdiv(n, 1024),)](xin, fp8_kernels._weight_arg(w), y, out_w, out_y, n,
                                                IN_BF16=x_dtype == torch.bfloat16, BIT_CAST=bit_cast, B=1024)
                where = f"x {x_dtype}, weight {w_dtype}, bit_cast={bit_cast}"
                assert same(out_w, w.to(x_dtype).float()), where
                assert same(out_y, y.to(x_dtype).float()), where


def test_norm_roundings_match_torch():
    check_rounding_to_the_input_dtype("cpu", [True])


@pytest.mark.gpu
def test_norm_roundings_match_torch_gpu():
    check_rounding_to_the_input_dtype("cuda", [False, True])


def test_rmsnorm_cast_eps_zero_keeps_the_rows_past_the_end_out():
    """eps = 0: the zero rows a block loads past R have rstd = Inf, and must not reach the column
    maxima (0 * Inf is NaN): 37 rows, runs of 4 rows, the last block partial."""
    x = torch.randn(37, 70, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    check_norm_cast(x, 16, eps=0.0)


def test_rmsnorm_cast_rejects_bad_inputs():
    from gemctl.ops.triton.fp8_gemm import fp8_rmsnorm_cast_rows

    with pytest.raises(ValueError, match="weight"):
        fp8_rmsnorm_cast_rows(torch.randn(4, 8), torch.ones(7), 1e-6)
    with pytest.raises(ValueError, match="norm"):
        fp8_cast_cols(torch.randn(4, 8), 4, act="silu", norm=(torch.ones(4), torch.ones(8)))


def test_cast_silu():
    x = _hostile(9, 70, torch.bfloat16).clamp(-30, 30)
    h = F.silu(x.float())
    data, scale = fp8_cast_rows(x, act="silu")
    rd, rs = quantize_mx(h, block=70, scale_rule="rceil")
    data_t, scale_c = fp8_cast_cols(x, 4, act="silu")
    cd, cs = quantize_mx(h, block=4, axis=0, scale_rule="rceil")
    # silu(x) in Triton and in torch may differ in the last float32 bit: a few elements (and,
    # rarely, a scale right at a power-of-two boundary) could then round to a neighbour.
    for got, want, got_s, want_s in ((data, rd, scale, rs[:, 0]), (data_t.t(), cd, scale_c.t(), cs)):
        assert got_s.shape == want_s.shape and (got_s != want_s).float().mean() < 0.05
        assert ((got.float() - want.float()).abs() > 0).float().mean() < 0.03
    # Column maxima of silu(x) from the row cast: the column cast's bytes unchanged.
    *_, part = fp8_cast_rows(x, act="silu", col_amax=True, amax_rows=2)
    data_p, scale_p = fp8_cast_cols(x, 4, act="silu", part=part, amax_rows=2)
    assert torch.equal(_bytes(data_p), _bytes(data_t)) and torch.equal(scale_p, scale_c)


def check_silu_cols_as_rows(x: torch.Tensor) -> None:
    """The column cast's SiLU codes (its quantization folds the scale into SiLU's reciprocal:
    _silu_scaled) against the row cast of x's transpose, which applies SiLU and the scale apart:
    with one chunk over all of x's rows the two quantize the same values with the same scales, so
    every byte must agree, from the two-read column cast and from the row cast's column bytes."""
    r = x.shape[0]
    dr, sr = fp8_cast_rows(x.t().contiguous(), act="silu")
    chunk = max(16, 1 << (r - 1).bit_length())  # one chunk over all rows
    runs = chunk // 4
    part = fp8_cast_rows(x, act="silu", col_amax=True, amax_rows=runs)[2]
    for data_t, scale_c in (fp8_cast_cols(x, chunk, act="silu"),
                            fp8_cast_cols(x, chunk, act="silu", part=part, amax_rows=runs)):
        assert torch.equal(scale_c[:, 0], sr)
        assert torch.equal(_bytes(data_t), _bytes(dr))


@pytest.mark.parametrize("cfg", [None, (32, 16, 1, 0), (16, 32, 1, 2)], ids=["default", "32x16", "16x32_split2"])
@pytest.mark.parametrize("shape", [(37, 70), (16, 8), (5, 3)])
def test_cast_cols_silu_matches_row_cast(shape, cfg):
    """Also pinned to tiles of 32 and 16 rows, so that the last tile ends past the rows and inside
    the padded ones (the whole-tile path must not take it), and two programs a chunk."""
    x = _hostile(*shape, torch.bfloat16)
    _silu_edge_columns(x)
    with forced_config({"fp8_cast_cols": cfg} if cfg else {}):
        check_silu_cols_as_rows(x)


def _silu_edge_columns(x: torch.Tensor) -> None:
    """Columns at the ends of the scale range: zeros and values of ~1e-37, both of the smallest scale
    (2^-127, a float32 subnormal: the tiny ones give codes up to ~20 there), one of -100 .. 100
    (e^-x overflows float32 below -88), and one with +inf and one with -inf."""
    g = torch.Generator().manual_seed(x.shape[0])
    x[:, -1] = 0.0
    if x.shape[1] > 2:
        x[:, -2] = (torch.randn(x.shape[0], generator=g) * 1e-37).to(x.dtype).to(x.device)
        x[:, -3] = torch.linspace(-100, 100, x.shape[0]).to(x.dtype).to(x.device)
    if x.shape[1] > 5:  # NaN blocks: silu(inf) = inf, silu(-inf) = NaN
        x[0, -4], x[-1, -5] = float("inf"), float("-inf")


def _gemm_ref(a, b, sa, sb, group):
    if group == 0:
        da = a.double() * e8m0_to_float(sa).double()[:, None]
        db = b.double() * e8m0_to_float(sb).double()[:, None]
    else:
        da = dequantize_mx(a, sa, group).double()
        db = dequantize_mx(b, sb, group).double()
    return da @ db.t()


def _operands(t, group):
    if group == 0:
        return fp8_cast_rows(t)
    return quantize_mx(t, block=group, scale_rule="rceil")


@pytest.mark.parametrize("promote", [None, 64], ids=["one-sum", "promote-64"])
@pytest.mark.parametrize("tma", [False, True], ids=["tiles", "tma"])
@pytest.mark.parametrize("m,n,k", [(37, 45, 70), (1, 16, 32), (33, 17, 160)])
def test_gemm_rowwise(m, n, k, tma, promote):
    a, sa = _operands(torch.randn(m, k) * 7, 0)
    b, sb = _operands(torch.randn(n, k) / 3, 0)
    with forced_config(TMA if tma else {}):
        c = fp8_gemm(a, b, sa, sb, out_dtype=torch.float32, promote_every=promote)
    ref = _gemm_ref(a, b, sa, sb, 0)
    assert (c.double() - ref).abs().max() <= 1e-5 * ref.abs().max()


@pytest.mark.parametrize("tma", [False, True], ids=["tiles", "tma"])
@pytest.mark.parametrize("group", [32, 128, 256])
def test_gemm_group_scales(group, tma):
    if tma and group in (32, 128):
        pytest.skip("K-block scales run the tile kernel only")
    k = 600 if group == 256 else 256  # chunk scales: a partial last chunk
    x = torch.randn(21, k) * torch.linspace(0.01, 100, k)  # scales differ per K-block
    w = torch.randn(19, k)
    a, sa = _operands(x, group)
    b, sb = _operands(w, group)
    with forced_config(TMA if tma else {}):
        c = fp8_gemm(a, b, sa, sb, group_k=group, out_dtype=torch.float32)
    ref = _gemm_ref(a, b, sa, sb, group)
    assert (c.double() - ref).abs().max() <= 1e-5 * ref.abs().max()


def test_gemm_tma_on_jagged_token_counts():
    """The weight gradient contracts over the tokens, a jagged count: the column casts pad their
    rows to 16 bytes, so the persistent TMA kernel reads them (its last K tile zero-filled) and
    gives the tile kernel's result; a pinned TMA config on unaligned rows runs the tile kernel."""
    tokens, d, h = 1000 + 5, 24, 40
    gy, act = torch.randn(tokens, d), torch.randn(tokens, h) * 3
    (gt, gs), (ht, hs) = fp8_cast_cols(gy, 256), fp8_cast_cols(act, 256)
    assert gt.shape == (d, tokens) and gt.stride(0) % 16 == 0 and ht.stride(0) % 16 == 0
    ref = _gemm_ref(gt, ht, gs, hs, 256)
    outs = {}
    for kernel in ("tiles", "tma"):
        with forced_config(TMA if kernel == "tma" else {}):
            outs[kernel] = fp8_gemm(gt, ht, gs, hs, group_k=256, out_dtype=torch.float32)
        assert (outs[kernel].double() - ref).abs().max() <= 1e-5 * ref.abs().max(), kernel
    assert torch.equal(outs["tiles"], outs["tma"])


def test_gemm_two_programs_per_sm(monkeypatch):
    """A seventh config field runs two persistent TMA programs per SM: the tiles are dealt
    differently, the output bits are the same (plain and with the silu' epilogue); such configs
    are timed by the autotuner only once the GPU tier has passed them."""
    a, sa = _operands(torch.randn(70, 64) * 3, 0)
    b, sb = _operands(torch.randn(50, 64), 0)
    pre = (torch.randn(70, 50) * 3).to(torch.bfloat16)
    for kw in ({"out_dtype": torch.float32}, {"epilogue": "silu_bwd", "pre": pre}):
        with forced_config(TMA):
            one = fp8_gemm(a, b, sa, sb, **kw)
        with forced_config({"fp8_gemm": (*TMA["fp8_gemm"], 2)}):
            two = fp8_gemm(a, b, sa, sb, **kw)
        assert torch.equal(one, two)
    seen = []

    def pick(key, cands, run, interp):
        seen.append(cands() if callable(cands) else cands)
        return interp

    monkeypatch.setattr(fp8_kernels, "pick_config", pick)
    monkeypatch.setattr(fp8_kernels, "_GPU_CHECKED", set())
    fp8_gemm(a, b, sa, sb)
    assert seen[-1] and all(len(c) == 6 for c in seen[-1])
    monkeypatch.setattr(fp8_kernels, "_PENDING_AUTOTUNE", True)
    fp8_gemm(a, b, sa, sb)
    assert set(fp8_kernels._GEMM_TWO_PER_SM) <= set(seen[-1])


@pytest.mark.slow
def test_model_fp8_gemms_can_take_tma(monkeypatch):
    """Every FP8 GEMM of a training step of the tiny model (precision=fp8: every Linear but the
    heads, under the interpreter) gets operands whose rows are 16-byte aligned, the persistent TMA
    kernel's condition, although the weight gradients contract over a jagged token count. Before
    the column casts padded their rows, the model's weight gradients ran the tile kernel at ~18 ms
    a call on the H200 (a fifth of fp8_tower's speed) while the MLP benchmark's 65,536 tokens hid it."""
    from gemctl.config.compose import compose
    from gemctl.data.source import build_source
    from gemctl.model import build_model
    from gemctl.precision.rules import apply_precision
    from gemctl.train.trainer import compute_loss

    calls = []
    gemm = fp8_kernels.fp8_gemm

    def spy(a, b, sa, sb, **kw):
        calls.append((a.shape[1], kw.get("group_k", 0), a.stride(0), b.stride(0), a.data_ptr(), b.data_ptr()))
        return gemm(a, b, sa, sb, **kw)

    monkeypatch.setattr(fp8_kernels, "fp8_gemm", spy)
    cfg = compose(["model=tiny", "precision=fp8", "data.batch_size=2"])
    source = build_source(cfg.data, cfg.shuffle, 1, 0)
    batch = source.train_batch(0)
    torch.manual_seed(0)
    model = build_model(cfg.model, source.spec, device=torch.device("cpu"))
    apply_precision(model, cfg.precision, cfg.model.num_layers, "cpu")
    compute_loss(model(batch), batch.labels).backward()
    wgrads = [c for c in calls if c[1]]  # chunk-scaled: the weight gradients, K = tokens
    assert wgrads and any(k % 16 for k, *_ in wgrads), "the batch's token count should not be a multiple of 16"
    assert all(sa % 16 == 0 and sb % 16 == 0 and pa % 16 == 0 and pb % 16 == 0 for _, _, sa, sb, pa, pb in calls)


@pytest.mark.parametrize("tma", [False, True], ids=["tiles", "tma"])
def test_gemm_silu_bwd_epilogue(tma):
    a, sa = _operands(torch.randn(37, 64), 0)
    b, sb = _operands(torch.randn(45, 64) / 4, 0)
    ref = _gemm_ref(a, b, sa, sb, 0)
    pre = (torch.randn(37, 45) * 3).to(torch.bfloat16)
    with forced_config(TMA if tma else {}):
        dpre = fp8_gemm(a, b, sa, sb, epilogue="silu_bwd", pre=pre)
    assert dpre.dtype == torch.bfloat16
    sig = torch.sigmoid(pre.double())
    want = ref * sig * (1 + pre.double() * (1 - sig))
    # One bf16 rounding (the interpreter truncates instead of rounding to nearest: < 1 ulp).
    assert ((dpre.double() - want).abs() <= 2**-7 * want.abs() + 1e-6 * want.abs().max()).all()


def test_gemm_rejects_bad_inputs():
    a, sa = _operands(torch.randn(4, 32), 0)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        fp8_gemm(a.float(), a, sa, sa)
    with pytest.raises(ValueError, match="K-major"):
        fp8_gemm(a.t(), a.t(), sa, sa)
    with pytest.raises(ValueError, match="multiple of group_k"):
        fp8_gemm(a[:, :20], a[:, :20], sa, sa, group_k=32)
    with pytest.raises(ValueError, match="epilogue"):
        fp8_gemm(a, a, sa, sa, epilogue="gelu")
    with pytest.raises(ValueError, match="group_k 48"):
        fp8_gemm(a, a, sa, sa, group_k=48)


def _grads(fn, tensors, gy):
    for t in tensors:
        t.grad = None
    y = fn()
    y.backward(gy)
    return [y.detach().double()] + [t.grad.double() for t in tensors]


def _rel(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("granularity", list(GRANULARITIES))
@pytest.mark.parametrize("wgrad,dgrad", [("fp8", "fp8"), ("bf16", "fp8"), ("bf16", "bf16")])
def test_linear_matches_emulated(granularity, wgrad, dgrad, device="cpu", dtype=torch.float32, t=80, k=128, n=256):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(t, k, generator=g).to(device, dtype).requires_grad_()
    w = (torch.randn(n, k, generator=g) / k**0.5).to(device).requires_grad_()
    gy = torch.randn(t, n, generator=g).to(device, dtype)
    recipe = Fp8Recipe(granularity=granularity, wgrad=wgrad, dgrad=dgrad, token_chunk=256 if t > 256 else 64)
    got = _grads(lambda: fp8_linear(x, w, None, recipe), [x, w], gy)
    want = _grads(lambda: _EmulatedFunction.apply(x, w, recipe), [x, w], gy)
    exact = _grads(lambda: x.double() @ w.double().t(), [x, w], gy.double())
    for name, a, b, e in zip(("y", "dx", "dw"), got, want, exact):
        # Same quantized operands: float32 accumulation order (and the output's dtype) only.
        assert _rel(a, b) < (1e-5 if dtype == torch.float32 else 8e-3), name
        assert _rel(b, e) < 0.08, name  # E4M3 carries 3 mantissa bits


def test_hadamard_rotation_is_exact_and_orthogonal():
    g = torch.Generator().manual_seed(2)
    x, w = torch.randn(5, 3, 96, generator=g, dtype=torch.float64), torch.randn(40, 96, generator=g, dtype=torch.float64)
    xr, wr = hadamard_features(x, 32, seed=3), hadamard_features(w, 32, seed=3)
    assert torch.allclose(xr @ wr.t(), x @ w.t(), atol=1e-12)  # (x R)(W R)^T = x W^T
    assert torch.allclose(xr.norm(dim=-1), x.norm(dim=-1), atol=1e-12)
    assert not torch.allclose(xr[..., :32], x[..., :32])  # it does rotate
    assert not torch.allclose(hadamard_features(x, 32, seed=4), xr)  # the seed draws the signs


def test_hadamard_linear_quantizes_the_rotated_operands():
    """With ``hadamard``, fp8_linear is the unrotated format applied to x R and W R, gradients
    through the rotation included (the same call path as without: Triton under the interpreter;
    the rotation happens before the format is chosen, so row-wise stands for all granularities)."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(64, 64, generator=g).requires_grad_()
    w = (torch.randn(96, 64, generator=g) / 8).requires_grad_()
    gy = torch.randn(64, 96, generator=g)
    plain = Fp8Recipe(token_chunk=32)
    rotated = Fp8Recipe(token_chunk=32, hadamard=32, hadamard_seed=1)
    got = _grads(lambda: fp8_linear(x, w, None, rotated), [x, w], gy)
    want = _grads(lambda: _EmulatedFunction.apply(hadamard_features(x, 32, 1), hadamard_features(w, 32, 1), plain),
                  [x, w], gy)
    unrotated = _grads(lambda: fp8_linear(x, w, None, plain), [x, w], gy)
    exact = _grads(lambda: x.double() @ w.double().t(), [x, w], gy.double())
    for name, a, b, u, e in zip(("y", "dx", "dw"), got, want, unrotated, exact):
        assert _rel(a, b) < 1e-5, name
        assert _rel(a, e) < 0.08, name
        assert _rel(a, u) > 1e-3, name  # other operands were quantized


def test_hadamard_skips_a_layer_whose_k_does_not_divide(capsys):
    g = torch.Generator().manual_seed(6)
    x, w = torch.randn(16, 48, generator=g), torch.randn(32, 48, generator=g)
    y = fp8_linear(x, w, None, Fp8Recipe(hadamard=32))
    assert torch.equal(y, fp8_linear(x, w, None, Fp8Recipe()))
    assert "Hadamard rotation of 32 features skipped for a layer with K=48" in capsys.readouterr().err


def test_hadamard_mlp_runs_as_two_rotated_linears():
    g = torch.Generator().manual_seed(7)
    x = torch.randn(40, 64, generator=g)
    w_up, w_down = torch.randn(128, 64, generator=g) / 8, torch.randn(64, 128, generator=g) / 11
    recipe = Fp8Recipe(hadamard=32, token_chunk=64)
    got = fp8_mlp(x, w_up, w_down, recipe)
    want = fp8_linear(F.silu(fp8_linear(x, w_up, None, recipe)), w_down, None, recipe)
    assert torch.equal(got, want)


def test_hadamard_spreads_outlier_error_onto_small_features():
    """Why the rotation does not pay for E4M3 (docs/precision.md): the format's range already holds
    features 1000x apart at one power-of-two scale per row, and rotating mixes each outlier's
    rounding error into every feature of its block."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 256, generator=g)
    outliers = torch.randperm(256, generator=g)[:4]
    x[:, outliers] *= 1000
    small = torch.ones(256, dtype=torch.bool)
    small[outliers] = False
    from gemctl.precision.mx_linear import _hadamard_cpu

    err_plain = ((qdq(x, 0, 1) - x)[:, small].norm() / x[:, small].norm()).item()
    rotated = qdq(hadamard_features(x, 128), 0, 1)
    back = (rotated.reshape(256, 2, 128) @ _hadamard_cpu(128, 0).t()).reshape(256, 256)  # R^-1 = R^T
    err_rot = ((back - x)[:, small].norm() / x[:, small].norm()).item()
    assert err_plain < 0.05 < 0.5 < err_rot, (err_plain, err_rot)


def _bf16(t: torch.Tensor) -> torch.Tensor:
    """float32 -> bf16 values as the kernels store them: round to nearest even on a GPU; the
    Triton interpreter truncates (Triton 3.7)."""
    if INTERPRET:
        return (t.float().view(torch.int32) & -65536).view(torch.float32)
    return t.to(torch.bfloat16).float()


def _mlp_mirror(x, w_up, w_down, gy, chunk):
    """Emulated row-wise FP8 MLP that rounds pre and dpre to bf16 where the fused kernels store
    them; returns y, dx, dw_up, dw_down in float64."""
    xq, uq, dq = qdq(x, 0, 1), qdq(w_up, 0, 1), qdq(w_down, 0, 1)
    pre = _bf16(xq @ uq.t())
    h = F.silu(pre)
    y = qdq(h, 0, 1) @ dq.t()
    dh = qdq(gy.float(), 0, 1) @ qdq(w_down, 0, 0)
    sig = torch.sigmoid(pre)
    dpre = _bf16(dh * sig * (1 + pre * (1 - sig)))
    dx = qdq(dpre, 0, 1) @ qdq(w_up, 0, 0)
    dw_down = qdq(gy.float(), chunk, 0).t() @ qdq(h, chunk, 0)
    dw_up = qdq(dpre, chunk, 0).t() @ qdq(x, chunk, 0)
    return [t.double() for t in (y, dx, dw_up, dw_down)]


def check_mlp(device, dtype, t, d, hidden, tol, chunk):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(t, d, generator=g).to(device, dtype).requires_grad_()
    w_up = (torch.randn(hidden, d, generator=g) / d**0.5).to(device).requires_grad_()
    w_down = (torch.randn(d, hidden, generator=g) / hidden**0.5).to(device).requires_grad_()
    gy = torch.randn(t, d, generator=g).to(device, dtype)
    got = _grads(lambda: fp8_mlp(x, w_up, w_down, Fp8Recipe(token_chunk=chunk)), [x, w_up, w_down], gy)
    want = _mlp_mirror(x.detach(), w_up.detach(), w_down.detach(), gy, chunk)
    for name, a, b in zip(("y", "dx", "dw_up", "dw_down"), got, want):
        assert _rel(a, b) < tol, (name, _rel(a, b))


def test_fused_mlp_matches_emulated():
    # Residual differences: float32 accumulation order flips a few bf16 roundings of pre/dpre,
    # each then moving one E4M3 rounding.
    check_mlp("cpu", torch.float32, t=70, d=32, hidden=64, tol=3e-3, chunk=64)  # two token chunks


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_bf16_weight_gradient_operands_recomputed_in_one_pass_are_the_float32_ones(device):
    # wgrad: bf16 rebuilds silu(pre) and the norm's output in the backward; each in one pass over
    # its input, and bit for bit what float32 math rounded once to bf16 gives (every finite bf16;
    # torch's CPU and CUDA kernels each)
    from gemctl.precision.fp8_linear import _rms_normed

    every = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    x = every[torch.isfinite(every)][: 1020 * 64].reshape(1020, 64).to(device)
    assert torch.equal(F.silu(x).view(torch.int16), F.silu(x.float()).to(torch.bfloat16).view(torch.int16))
    rstd = (torch.rand(x.shape[0], generator=torch.Generator().manual_seed(0)) + 0.5).to(device)
    w = torch.linspace(0.5, 1.5, 64, device=device)
    want = (x.float() * rstd[:, None] * w.to(torch.bfloat16).float()).to(torch.bfloat16)
    assert torch.equal(_rms_normed(x, rstd, w).view(torch.int16), want.view(torch.int16))


@pytest.mark.parametrize("wgrad,dgrad", [("fp8", "fp8"), ("bf16", "fp8"), ("fp8", "bf16")])
def test_fused_mlp_and_unfused_agree(wgrad, dgrad):
    g = torch.Generator().manual_seed(2)
    x = torch.randn(20, 32, generator=g).requires_grad_()
    w_up = (torch.randn(64, 32, generator=g) / 6).requires_grad_()
    w_down = (torch.randn(32, 64, generator=g) / 8).requires_grad_()
    gy = torch.randn(20, 32, generator=g)
    fused = _grads(lambda: fp8_mlp(x, w_up, w_down, Fp8Recipe(wgrad=wgrad, dgrad=dgrad)), [x, w_up, w_down], gy)
    unfused = _grads(lambda: fp8_mlp(x, w_up, w_down, Fp8Recipe(fused_mlp=False, wgrad=wgrad, dgrad=dgrad)),
                     [x, w_up, w_down], gy)
    for a, b in zip(fused, unfused):
        assert _rel(a, b) < 0.05  # same format; the unfused path keeps pre in float32


def _fused_norm_case(seed: int, shapes: list[tuple[int, int]]):
    """x [70, 32] (x3), a norm weight near 1, weights of ``shapes``, and an output gradient."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(70, 32, generator=g) * 3).requires_grad_()
    norm_w = (1 + 0.1 * torch.randn(32, generator=g)).requires_grad_()
    ws = [(torch.randn(*shape, generator=g) / (shape[1] ** 0.5 / 1.4)).requires_grad_() for shape in shapes]
    return x, norm_w, ws, torch.randn(70, shapes[-1][0], generator=g)


def _check_fused_norm(block, x, norm_w, gy, tensors, names):
    """``block(h, norm_weight)`` with the norm fused against F.rms_norm then ``block(h, None)``: the
    same quantized operands, so only float32 summation order differs (gradients of ``tensors``)."""
    fused = _grads(lambda: block(x, norm_w), tensors, gy)
    apart = _grads(lambda: block(F.rms_norm(x, (x.shape[1],), norm_w, 1e-6), None), tensors, gy)
    for name, a, b in zip(names, fused, apart):
        assert _rel(a, b) < 1e-5, (name, _rel(a, b))
    return fused


@pytest.mark.parametrize("wgrad,dgrad", [("fp8", "fp8"), ("bf16", "fp8"), ("fp8", "bf16")])
def test_fused_norm_mlp_matches_norm_then_mlp(wgrad, dgrad):
    # The MLP's pre-norm fused into the block's first cast (the bytes: test_rmsnorm_cast_bit_exact).
    x, norm_w, (w_up, w_down), gy = _fused_norm_case(3, [(64, 32), (32, 64)])
    recipe = Fp8Recipe(wgrad=wgrad, dgrad=dgrad, token_chunk=64)
    _check_fused_norm(lambda h, nw: fp8_mlp(h, w_up, w_down, recipe, norm_weight=nw, eps=1e-6), x, norm_w, gy,
                      [x, norm_w, w_up, w_down], ("y", "dx", "dnorm_w", "dw_up", "dw_down"))


@pytest.mark.parametrize("wgrad,dgrad", [("fp8", "fp8"), ("bf16", "fp8"), ("fp8", "bf16")])
def test_fused_norm_linear_matches_norm_then_linear(wgrad, dgrad):
    # The QKV projection's pre-norm fused into its cast, the same way.
    x, norm_w, (w,), gy = _fused_norm_case(5, [(48, 32)])
    recipe = Fp8Recipe(wgrad=wgrad, dgrad=dgrad, token_chunk=64)
    fused = _check_fused_norm(lambda h, nw: fp8_linear(h, w, None, recipe, norm_weight=nw, eps=1e-6), x, norm_w, gy,
                              [x, norm_w, w], ("y", "dx", "dnorm_w", "dw"))
    # a frozen norm weight and a frozen input: the gradients that are asked for, nothing else
    norm_w.requires_grad_(False)
    x.grad = w.grad = norm_w.grad = None
    fp8_linear(x, w, None, recipe, norm_weight=norm_w, eps=1e-6).backward(gy)
    assert x.grad is not None and w.grad is not None and norm_w.grad is None
    xd = x.detach()
    w.grad = None
    fp8_linear(xd, w, None, recipe, norm_weight=norm_w, eps=1e-6).backward(gy)
    assert _rel(w.grad.double(), fused[3]) < 1e-5


def test_fused_norm_linear_falls_back_for_other_granularities():
    # block-128 scales (or a Hadamard rotation) take the norm first, then the plain linear
    g = torch.Generator().manual_seed(6)
    x, norm_w, w = torch.randn(16, 128, generator=g), 1 + 0.1 * torch.randn(128, generator=g), torch.randn(128, 128, generator=g)
    for recipe in (Fp8Recipe(granularity="block128"), Fp8Recipe(hadamard=32)):
        fused = fp8_linear(x, w, None, recipe, norm_weight=norm_w, eps=1e-6)
        apart = fp8_linear(F.rms_norm(x, (128,), norm_w, 1e-6), w, None, recipe)
        assert torch.equal(fused, apart)


def _rms_norm_case(rows: int, cols: int, device="cpu"):
    g = torch.Generator().manual_seed(rows + cols)
    x = (torch.randn(rows, cols, generator=g, dtype=torch.float64) * torch.logspace(-2, 2, rows, dtype=torch.float64)[:, None])
    x[min(1, rows - 1)] = 0.0  # a zero row (rstd = 1 / sqrt(eps))
    w = torch.randn(cols, generator=g, dtype=torch.float64)
    dy = torch.randn(rows, cols, generator=g, dtype=torch.float64)
    return x.to(device).requires_grad_(), w.to(device).requires_grad_(), dy.to(device)


@pytest.mark.parametrize("path", ["triton", "float32"])
def test_rms_norm_backward_matches_autograd(path, monkeypatch):
    from gemctl.precision import fp8_linear

    if path == "float32":  # the math where the Triton kernels do not run (a GPU without the fused op too)
        monkeypatch.setattr(fp8_linear, "triton_ready", lambda *t: False)
    x, w, dy = _rms_norm_case(9, 24)
    F.rms_norm(x, (24,), w, 1e-5).backward(dy)
    rstd = torch.rsqrt(x.detach().pow(2).mean(-1) + 1e-5)
    dx, dw = fp8_linear._rms_norm_backward(dy, x.detach(), rstd, w.detach())
    # float32 math against float64 autograd
    assert torch.allclose(dx, x.grad, rtol=1e-5, atol=1e-6) and torch.allclose(dw, w.grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,cols", [(150, 70), (1, 8), (64, 33)])
def test_rms_norm_backward_kernel(rows, cols, dtype, device="cpu"):
    """One Triton pass against float64 autograd of F.rms_norm: several programs of 64 rows (the
    last partial), columns not a power of two, a zero row, the weight as the forward applies it (in
    x's dtype), dweight's partial sums; need_dw=False gives the same dx and no dweight."""
    from gemctl.ops.triton.rms_norm import rms_norm_backward

    x, w, dy = _rms_norm_case(rows, cols, device)
    xq, dyq, wq = x.detach().to(dtype), dy.to(dtype), w.detach().to(dtype)
    xr = xq.double().requires_grad_()
    wr = wq.double().requires_grad_()
    F.rms_norm(xr, (cols,), wr, 1e-5).backward(dyq.double())
    rstd = torch.rsqrt(xr.detach().pow(2).mean(-1) + 1e-5).float()
    dx, dw = rms_norm_backward(dyq, xq, rstd, w.detach().float())
    assert dx.dtype == dtype and dw.dtype == torch.float32
    tol = 1e-5 if dtype == torch.float32 else 2**-7  # dx rounded to bf16 once
    scale = xr.grad.abs().amax(-1, keepdim=True) + 1e-30
    assert ((dx.double() - xr.grad).abs() <= tol * scale).all()
    assert torch.allclose(dw.double(), wr.grad, rtol=1e-4, atol=1e-5 * wr.grad.abs().max().item())
    dx2, none = rms_norm_backward(dyq, xq, rstd, w.detach().float(), need_dw=False)
    assert none is None and torch.equal(dx2, dx)
    with pytest.raises(ValueError, match="rstd \\[R\\]"):
        rms_norm_backward(dyq, xq, rstd[:-1] if rows > 1 else rstd.repeat(2), w.detach().float())


def _fp8_models(overrides: list[str], unfuse):
    """The same model twice under the fp8 rules (seed 0), the second with ``unfuse(layer)`` applied
    to each sequence layer (it takes the fused pre-norms back out), and a training batch."""
    from gemctl.config.compose import compose
    from gemctl.data.source import build_source
    from gemctl.model import build_model
    from gemctl.precision.rules import apply_precision

    cfg = compose(["model=tiny", "train.device=cpu", *overrides])
    source = build_source(cfg.data, cfg.shuffle, 1, 0)
    models = []
    for fuse in (True, False):
        torch.manual_seed(0)
        model = build_model(cfg.model, source.spec, device=torch.device("cpu"))
        apply_precision(model, cfg.precision, cfg.model.num_layers, "cpu")
        assert all(getattr(layer.attn.qkv, "norm_fused", False) for layer in model.tower.layers)
        if not fuse:
            for layer in model.tower.layers:
                unfuse(layer)
        models.append(model)
    return models, source.train_batch(0)


def _unfuse_qkv(layer):
    qkv = layer.attn.qkv
    qkv.norm_fused = False
    qkv.forward = lambda h, w=qkv.weight, r=qkv.fp8_recipe: fp8_linear(h, w, None, r)


def test_model_fuses_the_mlp_pre_norm(monkeypatch):
    # fp8 rules hand each sequence layer's MLP and QKV projection their pre-norms; on the emulated
    # path they run the same RMSNorm themselves, so the model's output is unchanged by the fusion
    # (the fused kernels' numerics: the tests above and below).
    from gemctl.precision import fp8_linear as mod

    monkeypatch.setattr(mod, "triton_ready", lambda *t: False)
    monkeypatch.setattr(mod, "_said", {"emulated"})

    def unfuse(layer):
        assert layer.mlp.norm_fused
        layer.mlp.norm_fused = False
        w_up, w_down, recipe = layer.mlp.up.weight, layer.mlp.down.weight, layer.mlp.fp8_recipe
        layer.mlp.forward = lambda h, u=w_up, d=w_down, r=recipe: fp8_mlp(h, u, d, r)
        _unfuse_qkv(layer)

    models, batch = _fp8_models(["precision=fp8"], unfuse)
    with torch.no_grad():
        assert torch.equal(models[0](batch), models[1](batch))


@pytest.mark.slow
def test_model_fused_norms_through_the_kernels():
    # The whole model through the fused FP8 kernels (interpreter on CPU): the QKV projection with
    # its pre-norm fused gives the same output and weight gradients as the norm followed by the
    # plain FP8 linear; the norm weight's gradient up to float32 summation order.
    if not INTERPRET:
        pytest.skip("the CPU tier's check (the GPU tier runs test_fused_norm_gpu)")
    models, batch = _fp8_models(["model.num_layers=1", "precision=fp8_tower", "data.batch_size=8", "data.max_len=16"],
                                _unfuse_qkv)
    runs = []
    for model in models:
        out = model(batch)
        out.float().square().mean().backward()
        runs.append((out.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}))
    (out_f, grads_f), (out_u, grads_u) = runs
    assert torch.equal(out_f, out_u)
    assert grads_f.keys() == grads_u.keys()
    for name in grads_f:
        assert _rel(grads_f[name].double(), grads_u[name].double()) < 1e-6, name


def test_emulated_off_gpu_is_said_once(monkeypatch, capsys):
    from gemctl.precision import fp8_linear as mod

    monkeypatch.setattr(mod, "triton_ready", lambda *t: False)
    monkeypatch.setattr(mod, "_said", set())
    x = torch.randn(4, 32)
    w = torch.randn(8, 32)
    y1 = fp8_linear(x, w, None, Fp8Recipe())
    fp8_linear(x, w, None, Fp8Recipe())
    err = capsys.readouterr().err
    assert err.count("fp8 GEMMs emulated") == 1
    assert torch.equal(y1, qdq(x, 0, 1) @ qdq(w, 0, 1).t())


def test_recipe_rules_route_modules():
    from omegaconf import OmegaConf

    from gemctl.config.compose import compose
    from gemctl.model.sequence import MLP
    from gemctl.precision.rules import apply_precision

    for name, tower_layers in (("fp8", "fp8"), ("fp8_safe", "bf16")):
        cfg = compose(["model=tiny", f"precision={name}", "train.device=cpu"])
        from gemctl.data.source import build_source
        from gemctl.model import build_model

        source = build_source(cfg.data, cfg.shuffle, 1, 0)
        model = build_model(cfg.model, source.spec, device=torch.device("cpu"))
        formats = apply_precision(model, cfg.precision, cfg.model.num_layers, "cpu")
        last = cfg.model.num_layers - 1
        assert formats[f"tower.layers.{last}.mlp.up"] == tower_layers
        assert formats["tower.layers.0.mlp.up"] == "fp8"
        assert all(f == "fp32" for p, f in formats.items() if p.startswith("heads."))
        mlp0 = model.tower.layers[0].mlp
        assert isinstance(mlp0, MLP) and hasattr(mlp0, "fp8_recipe")  # the fused block
        assert hasattr(model.tower.layers[0].attn, "fp8_recipe") or any(
            hasattr(m, "fp8_recipe") for m in model.tower.layers[0].attn.modules())
        assert not hasattr(model.tower.layers[last].mlp, "fp8_recipe") or tower_layers == "fp8"
        assert OmegaConf.select(cfg, "precision.fp8.wgrad") == ("fp8" if name == "fp8" else "bf16")


def _routed_tiny_model(precision: str):
    """The tiny model with a precision recipe applied on the CPU: (config, model, Linear formats)."""
    from gemctl.config.compose import compose
    from gemctl.data.source import build_source
    from gemctl.model import build_model
    from gemctl.precision.rules import apply_precision

    cfg = compose(["model=tiny", f"precision={precision}", "train.device=cpu"])
    source = build_source(cfg.data, cfg.shuffle, 1, 0)
    model = build_model(cfg.model, source.spec, device=torch.device("cpu"))
    formats = apply_precision(model, cfg.precision, cfg.model.num_layers, "cpu")
    return cfg, model, {p: formats[p] for p, m in model.named_modules() if isinstance(m, torch.nn.Linear)}


def test_fp8_tower_recipe_routes_only_the_tower():
    _, model, linears = _routed_tiny_model("fp8_tower")
    tower = {p for p in linears if p.startswith("tower.layers.")}
    assert tower and all(linears[p] == "fp8" for p in tower)
    assert all(f == ("fp32" if p.startswith("heads.") else "bf16") for p, f in linears.items() if p not in tower)
    assert all(hasattr(layer.mlp, "fp8_recipe") for layer in model.tower.layers)  # fused MLP blocks


def test_fp8_mlp_recipe_routes_only_the_mlp_blocks():
    cfg, model, linears = _routed_tiny_model("fp8_mlp")
    mlp = {p for p in linears if p.startswith("tower.layers.") and ".mlp." in p}
    assert len(mlp) == 2 * cfg.model.num_layers and all(linears[p] == "fp8" for p in mlp)
    assert all(f == ("fp32" if p.startswith("heads.") else "bf16") for p, f in linears.items() if p not in mlp)
    assert all(getattr(layer.mlp, "norm_fused", False) for layer in model.tower.layers)  # fused with the pre-norm
    assert not any(hasattr(m, "fp8_recipe") for m in model.tower.layers[0].attn.modules())


@pytest.mark.parametrize("name, wgrad", [("fp8_mlp_safe", "bf16"), ("fp8_mlp_tail", "fp8")])
def test_fp8_mlp_safe_and_tail_recipes_keep_the_last_mlp_bf16(name, wgrad):
    cfg, model, linears = _routed_tiny_model(name)
    last = cfg.model.num_layers - 1
    fp8 = {p for p, f in linears.items() if f == "fp8"}
    assert fp8 == {p for p in linears if p.startswith("tower.layers.") and ".mlp." in p
                   and not p.startswith(f"tower.layers.{last}.")}
    assert fp8 and all(linears[p] == "bf16" for p in linears if p.startswith(f"tower.layers.{last}."))
    assert all(linears[p] == "fp32" for p in linears if p.startswith("heads."))
    assert not hasattr(model.tower.layers[last].mlp, "fp8_recipe") and hasattr(model.tower.layers[0].mlp, "fp8_recipe")
    assert model.tower.layers[0].mlp.fp8_recipe.wgrad == wgrad  # what the routed block runs


def test_config_and_kernels_name_the_same_granularities():
    from gemctl.config.validate import FP8_GRANULARITIES

    assert FP8_GRANULARITIES == tuple(GRANULARITIES)


def test_bad_fp8_options_name_the_field():
    from gemctl.config.compose import compose
    from gemctl.config.validate import validate
    from gemctl.errors import ConfigError

    with pytest.raises(ConfigError, match=r"^precision\.fp8\.granularity: .*row, block128, mx32"):
        validate(compose(["precision=fp8", "precision.fp8.granularity=col"]), check_device=False)
    with pytest.raises(ConfigError, match=r"^precision\.fp8\.wgrad: "):
        validate(compose(["precision=fp8", "precision.fp8.wgrad=fp4"]), check_device=False)
    with pytest.raises(ConfigError, match=r"^precision\.fp8\.dgrad: "):
        validate(compose(["precision=fp8", "precision.fp8.dgrad=e5m2"]), check_device=False)
    with pytest.raises(ConfigError, match=r"^precision\.fp8\.token_chunk: .*multiple of 128"):
        validate(compose(["precision=fp8", "precision.fp8.token_chunk=1000"]), check_device=False)
    with pytest.raises(ConfigError, match=r"^precision\.fp8\.hadamard: .*power of two"):
        validate(compose(["precision=fp8", "precision.fp8.hadamard=100"]), check_device=False)


# ------------------------------------------------------------------------------------------------
# GPU tier: the same checks on CUDA, bf16 activations, realistic sizes.


@pytest.mark.gpu
@pytest.mark.parametrize("group", [0, 32, 128])
def test_gemm_gpu(group):
    m, n, k = 1000, 768, 1024
    a, sa = _operands((torch.randn(m, k, device="cuda") * 3).to(torch.bfloat16), group)
    b, sb = _operands(torch.randn(n, k, device="cuda").to(torch.bfloat16), group)
    c = fp8_gemm(a, b, sa, sb, group_k=group, out_dtype=torch.float32)
    ref = _gemm_ref(a, b, sa, sb, group)
    # Hopper's FP8 tensor cores accumulate with fewer bits than float32 (about 14 significant
    # bits kept, as DeepSeek-V3 reports); scripts/bench_fp8.py measures the effect per K.
    assert ((c.double() - ref).norm() / ref.norm()).item() < 2**-10


@pytest.mark.gpu
def test_gemm_promotion_gpu():
    # A long contraction (the wgrad sums the tokens): promoting to float32 every 4096 values
    # keeps the error near the K=4096 level instead of growing with K.
    k = 65536
    a, sa = _operands(torch.randn(256, k, device="cuda").to(torch.bfloat16), 0)
    b, sb = _operands(torch.randn(256, k, device="cuda").to(torch.bfloat16), 0)
    ref = _gemm_ref(a, b, sa, sb, 0)
    errs = {p: ((fp8_gemm(a, b, sa, sb, out_dtype=torch.float32, promote_every=p).double() - ref).norm()
                / ref.norm()).item() for p in (None, 4096)}
    assert errs[4096] < 2**-9 and errs[4096] < errs[None] / 2, errs


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", fp8_kernels._GEMM_TWO_PER_SM, ids=lambda c: "_".join(map(str, c[:5])))
def test_gemm_two_programs_per_sm_gpu(cfg):
    """Each two-programs-per-SM config pinned: the same bits as its tile with one program per SM
    (row-wise with partial tiles, the silu' epilogue, float32 promotion, token-chunk scales over a
    jagged token count) and the float64 reference's bound."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    for m, n, k, group, epi in ((1000, 1000, 1024, 0, "none"), (1000, 1000, 1024, 0, "silu_bwd"),
                                (300, 520, 16384, 0, "none"), (520, 300, 12288 + 37, 4096, "none")):
        x = (torch.randn(k, m, device="cuda", generator=gen) * 3).to(torch.bfloat16)
        w = torch.randn(k, n, device="cuda", generator=gen).to(torch.bfloat16)
        if group:  # the weight-gradient operands: column casts of [tokens, features]
            (a, sa), (b, sb) = fp8_cast_cols(x, group), fp8_cast_cols(w, group)
        else:
            (a, sa), (b, sb) = _operands(x.t().contiguous(), 0), _operands(w.t().contiguous(), 0)
        kw = dict(group_k=group)
        if epi != "none":
            kw.update(epilogue=epi, pre=torch.randn(m, n, device="cuda", generator=gen).to(torch.bfloat16))
        with forced_config({"fp8_gemm": cfg}):
            got = fp8_gemm(a, b, sa, sb, **kw)
        with forced_config({"fp8_gemm": cfg[:6]}):
            want = fp8_gemm(a, b, sa, sb, **kw)
        if epi == "none":
            ref = _gemm_ref(a, b, sa, sb, group)
            assert ((got.double() - ref).norm() / ref.norm()).item() < 2**-8, (m, n, k, group)
        assert torch.equal(got, want), (m, n, k, group, epi)


@pytest.mark.gpu
@pytest.mark.parametrize("granularity", list(GRANULARITIES))
def test_linear_gpu(granularity):
    test_linear_matches_emulated(granularity, "fp8", "fp8", device="cuda", dtype=torch.bfloat16, t=4000, k=1024, n=2048)


@pytest.mark.gpu
def test_cast_bit_exact_gpu():
    for shape in ((4096, 1024), (300, 4100), (7, 70), (5000, 9000)):
        for dtype in (torch.bfloat16, torch.float32):
            check_cast(_hostile(*shape, dtype, device="cuda"), 4096 if shape[0] > 4096 else 64)
    # 256 runs of 16 rows per 4096-row chunk (the default at 65,536 tokens): four unrolled loads of
    # run bytes per column program, a partial last chunk
    x = _hostile(8192 + 37, 1024, torch.bfloat16, device="cuda")
    want = fp8_cast_cols(x, 4096)
    got = fp8_cast_cols(x, 4096, part=fp8_cast_rows(x, col_amax=True, amax_rows=16)[2], amax_rows=16)
    for g, w in zip(got, want):
        assert torch.equal(_bytes(g), _bytes(w))


@pytest.mark.gpu
def test_cast_cols_silu_matches_row_cast_gpu():
    for rows, cols in ((4096, 1024), (4000 + 37, 4096), (300, 70)):
        x = _hostile(rows, cols, torch.bfloat16, device="cuda")
        _silu_edge_columns(x)
        check_silu_cols_as_rows(x)


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", [(br, w, 1) for br, w in fp8_kernels._ROWS_DEEP]
                         + fp8_kernels._ROWS_PIPELINED, ids=lambda c: "_".join(map(str, c)))
def test_cast_rows_two_blocks_in_flight_gpu(cfg):
    """Each DEPTH-2 candidate (deep 1) and each loop pipelined by Triton (deep 2) pinned, on
    hostile values, runs of 64 rows and a partial last run, 1024 and 4096 columns (the MLP's
    hidden width): the outputs of the same (BLOCK_R, warps) with one block in flight, plain, silu
    and RMSNorm."""
    for cols in (1024, 4096) if cfg[2] == 2 else (1024,):
        x = _hostile(8192 + 37, cols, torch.bfloat16, device="cuda")
        for act, norm in ((None, False), ("silu", False), (None, True)):
            deep = _rows_outputs(x, cfg, act, norm, amax_rows=64)
            for got, want in zip(deep, _rows_outputs(x, (*cfg[:2], 0), act, norm, amax_rows=64)):
                assert torch.equal(got, want), (cols, act, norm)


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", fp8_kernels._ROWS_ATOMIC, ids=lambda c: f"{c[0]}_{c[1]}")
def test_cast_rows_atomic_gpu(cfg):
    """Each atomic column-bytes candidate pinned, on hostile values, runs of 64 rows and a partial
    last run: the outputs of the looping cast, plain, silu and RMSNorm."""
    x = _hostile(8192 + 37, 1024, torch.bfloat16, device="cuda")
    for act, norm in ((None, False), ("silu", False), (None, True)):
        got = _rows_outputs(x, (*cfg, 0, 1), act, norm, amax_rows=64)
        want = _rows_outputs(x, (*cfg, 0), act, norm, amax_rows=64)
        for g, w in zip(got, want):
            assert _same_values(g, w), (act, norm)


_WARP_CONFIGS = [(br, w, 0, 0, 1) for br, w in fp8_kernels._ROWS_WARP] + fp8_kernels._ROWS_RING


def _check_warp_cast(x, cfg):
    """A row-per-warp config pinned against the looping cast on x (16-row runs): codes, scales and
    run bytes, plain and silu; with the RMSNorm, whose sum of squares runs in another order, rstd
    within 1e-6 and the outputs of RMSNorm computed from that rstd, then cast."""
    for act, norm in ((None, False), ("silu", False), (None, True)):
        got = _rows_outputs(x, cfg, act, norm, amax_rows=16)
        want = _rows_outputs(x, (2, 4, 0), act, norm, amax_rows=16)
        if norm:
            assert torch.allclose(got[2], want[2], rtol=1e-6, atol=0)
            w = torch.linspace(0.5, 2.0, x.shape[1], device="cuda").to(x.dtype).float()
            y = ((x.float() * got[2][:, None]) * w).to(x.dtype)
            with forced_config({"fp8_cast_rows": (2, 4, 0)}):
                want = [t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t
                        for t in fp8_cast_rows(y, col_amax=True, amax_rows=16)]
            got = got[:2] + got[3:]
        for g, w in zip(got, want):
            assert torch.equal(g, w), (x.shape, x.dtype, act, norm)


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", _WARP_CONFIGS, ids=lambda c: "_".join(map(str, c[:2] + c[5:])))
def test_cast_rows_warp_gpu(cfg):
    """Each row-per-warp candidate (Gluon) pinned, its blocks of rows in registers or through the
    shared-memory ring, on hostile values, 16-row runs and a partial last run (one program's
    blocks past the rows: the ring's copies zero-fill them), 1024 and 768 columns (a block padded
    to 1024): _check_warp_cast."""
    for cols in (1024, 768):
        _check_warp_cast(_hostile(8192 + 37, cols, torch.bfloat16, device="cuda"), cfg)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
@pytest.mark.parametrize("cfg", fp8_kernels._ROWS_RING, ids=lambda c: "_".join(map(str, c[:2] + c[5:])))
def test_cast_rows_ring_other_dtypes_gpu(cfg, dtype):
    """Each shared-memory ring config on fp16 and fp32 rows (16 and 32 bytes a thread per copy):
    _check_warp_cast. Autotuning offers the ring for every row dtype since all twelve passed
    (H200, 2026-12-06, aa0f69e)."""
    _check_warp_cast(_hostile(4096 + 37, 1024, torch.float32, device="cuda").to(dtype), cfg)


_COLS_GPU_CONFIGS = ([(*c, fp8_kernels._COLS_SPLIT) for c in fp8_kernels._COLS_CANDIDATES] + fp8_kernels._COLS_STAGED
                     + fp8_kernels._COLS_WHOLE)


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", _COLS_GPU_CONFIGS, ids=lambda c: "_".join(map(str, c)))
def test_cast_cols_split_chunks_gpu(cfg):
    """Each column-cast candidate pinned with 4 programs per chunk, or pipelined (stages, one or 4
    programs per chunk), or with whole tiles unmasked (one or 4), from the row cast's bytes: the
    bytes of the two-read cast (its own scales), plain, silu and RMSNorm, a partial last chunk;
    pipelined or whole, the two-read cast too; whole, also 1000 columns (a partial column block)."""
    for cols in (1024, 1000) if len(cfg) > 5 else (1024,):
        _check_cols_config(cfg, _hostile(8192 + 37, cols, torch.bfloat16, device="cuda"))


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", fp8_kernels._COLS_PAIRS, ids=lambda c: "_".join(map(str, c)))
def test_cast_cols_pairs_gpu(cfg):
    """The register-transpose column casts (_COLS_PAIRS, Gluon) pinned, plain and silu from the row
    cast's bytes: the bytes of the two-read Triton cast, and of the Triton cast from the same bytes
    with the padding rows R..R_PAD too, 8192 + 37 rows (a partial last chunk and tile), at 1024
    and 2048 columns, and at 1088 (17 blocks of 64 columns); a NaN and an Inf make two blocks' scale
    byte 255 (the Triton cast from the bytes alone then); runs of 16 rows (4 folds of the bytes a
    chunk) and 64; 1000 columns pinned is one ValueError naming what it takes."""
    for cols in (1024, 1088, 2048):
        x = _hostile(8192 + 37, cols, torch.bfloat16, device="cuda")
        for act in (None, "silu"):
            for amax_rows in (64, 16):
                rows = _rows_outputs(x, (2, 4, 0), act, False, amax_rows=amax_rows)
                want = fp8_cast_cols(x, 4096, act=act)
                with forced_config({"fp8_cast_cols": (256, 64, 8, 0)}):  # the Triton cast from the same bytes
                    want_part = fp8_cast_cols(x, 4096, act=act, part=rows[-1], amax_rows=amax_rows)
                with forced_config({"fp8_cast_cols": cfg}):
                    got = fp8_cast_cols(x, 4096, act=act, part=rows[-1], amax_rows=amax_rows)
                for g, w, wp in zip(got, want, want_part):
                    assert torch.equal(g.view(torch.uint8), w.view(torch.uint8)), (cols, act, amax_rows)
                    assert torch.equal(g.view(torch.uint8), wp.view(torch.uint8)), (cols, act, amax_rows)
                padded = [torch.as_strided(t.view(torch.uint8), (cols, -(-t.shape[1] // 16) * 16), (t.stride(0), 1))
                          for t in (got[0], want_part[0])]
                assert torch.equal(*padded), (cols, act, amax_rows)
    x = _hostile(8192 + 37, 1024, torch.bfloat16, device="cuda")
    x[5, 3], x[4100, 700] = float("nan"), float("inf")
    for act in (None, "silu"):
        rows = _rows_outputs(x, (2, 4, 0), act, False, amax_rows=64)
        want = fp8_cast_cols(x, 4096, act=act, part=rows[-1], amax_rows=64)
        with forced_config({"fp8_cast_cols": cfg}):
            got = fp8_cast_cols(x, 4096, act=act, part=rows[-1], amax_rows=64)
        assert (want[1].view(torch.uint8) == 255).sum() == 2
        for g, w in zip(got, want):
            assert torch.equal(g.view(torch.uint8), w.view(torch.uint8)), act
    x = _hostile(300, 1000, torch.bfloat16, device="cuda")
    rows = _rows_outputs(x, (2, 4, 0), None, False, amax_rows=64)
    with forced_config({"fp8_cast_cols": cfg}), pytest.raises(ValueError, match="register-transpose configs take"):
        fp8_cast_cols(x, 4096, part=rows[-1], amax_rows=64)


def _check_cols_config(cfg, x):
    for act, norm in ((None, False), ("silu", False), (None, True)):
        rows = _rows_outputs(x, (2, 4, 0), act, norm, amax_rows=64)
        extra = {"norm": (rows[2], torch.linspace(0.5, 2.0, x.shape[1], device="cuda"))} if norm else {}
        want = fp8_cast_cols(x, 4096, act=act, **extra)
        with forced_config({"fp8_cast_cols": cfg}):
            got = [fp8_cast_cols(x, 4096, act=act, part=rows[-1], amax_rows=64, **extra)]
            if len(cfg) > 4:
                got.append(fp8_cast_cols(x, 4096, act=act, **extra))
        for out in got:
            for g, w in zip(out, want):
                assert torch.equal(g.view(torch.uint8), w.view(torch.uint8)), (act, norm)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_backward_kernel_gpu(dtype):
    test_rms_norm_backward_kernel(8192 + 37, 1024, dtype, device="cuda")


@pytest.mark.gpu
def test_fused_mlp_gpu():
    check_mlp("cuda", torch.bfloat16, t=8192, d=1024, hidden=4096, tol=2e-2, chunk=4096)


@pytest.mark.gpu
def test_rmsnorm_cast_bit_exact_gpu():
    g = torch.Generator().manual_seed(5)
    for shape in ((8192, 1024), (300, 768), (7, 70)):
        x = (torch.randn(*shape, generator=g) * 3).to("cuda", torch.bfloat16)
        for weight_dtype in (torch.float32, torch.bfloat16):
            check_norm_cast(x, 4096 if shape[0] > 4096 else 64, weight_dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("block", ["mlp", "linear"])
def test_fused_norm_gpu(block):
    """The MLP's and the QKV projection's pre-norms fused into their casts, against F.rms_norm
    then the same block, bf16 at 8192 tokens x 1024 features."""
    g = torch.Generator().manual_seed(6)
    x = (torch.randn(8192, 1024, generator=g) * 3).to("cuda", torch.bfloat16).requires_grad_()
    norm_w = (1 + 0.1 * torch.randn(1024, generator=g)).cuda().requires_grad_()
    recipe = Fp8Recipe()
    if block == "mlp":
        w_up = (torch.randn(4096, 1024, generator=g) / 32).cuda().requires_grad_()
        w_down = (torch.randn(1024, 4096, generator=g) / 64).cuda().requires_grad_()
        weights, names = [w_up, w_down], ("y", "dx", "dnorm_w", "dw_up", "dw_down")

        def run(h, nw):
            return fp8_mlp(h, w_up, w_down, recipe, norm_weight=nw, eps=1e-6)
    else:
        w = (torch.randn(3072, 1024, generator=g) / 32).cuda().requires_grad_()
        weights, names = [w], ("y", "dx", "dnorm_w", "dw")

        def run(h, nw):
            return fp8_linear(h, w, None, recipe, norm_weight=nw, eps=1e-6)
    gy = torch.randn(8192, weights[-1].shape[0], generator=g).to("cuda", torch.bfloat16)
    tensors = [x, norm_w, *weights]
    fused = _grads(lambda: run(x, norm_w), tensors, gy)
    apart = _grads(lambda: run(F.rms_norm(x, (1024,), norm_w.to(x.dtype), 1e-6), None), tensors, gy)
    for name, a, b in zip(names, fused, apart):
        assert _rel(a, b) < 2e-2, (name, _rel(a, b))


@pytest.mark.gpu
def test_fused_mlp_deterministic_gpu():
    # The amax atomics are max operations (order-free): two runs give the same bits.
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(4096, 512, device="cuda", generator=g, dtype=torch.bfloat16)
    w_up = torch.randn(2048, 512, device="cuda", generator=g) / 23
    w_down = torch.randn(512, 2048, device="cuda", generator=g) / 45
    ys = [fp8_mlp(x, w_up, w_down, Fp8Recipe()) for _ in range(2)]
    assert torch.equal(ys[0], ys[1])


@pytest.mark.gpu
def test_tiny_model_trains_on_fp8_kernels_gpu(monkeypatch):
    # The trainer's path: rules route the tiny model's Linears and MLP blocks to the Triton FP8
    # kernels under bf16 autocast; the loss and the first layer's gradient agree with the
    # emulated numerics of the same recipe.
    from gemctl.config.compose import compose
    from gemctl.data.source import build_source
    from gemctl.model import build_model
    from gemctl.precision import fp8_linear as mod
    from gemctl.precision.rules import apply_precision
    from gemctl.train.trainer import compute_loss

    cfg = compose(["model=tiny", "precision=fp8", "data.batch_size=64"])
    source = build_source(cfg.data, cfg.shuffle, 1, 0)
    batch = source.train_batch(0).to(torch.device("cuda"))

    def step(kernels: bool):
        monkeypatch.setattr(mod, "triton_ready", (lambda *t: True) if kernels else (lambda *t: False))
        torch.manual_seed(0)
        model = build_model(cfg.model, source.spec, device=torch.device("cuda"))
        apply_precision(model, cfg.precision, cfg.model.num_layers, "cuda")
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = compute_loss(model(batch), batch.labels)
        loss.backward()
        return loss.item(), model.tower.layers[0].mlp.up.weight.grad.float()

    (l8, g8), (le, ge) = step(True), step(False)
    assert abs(l8 - le) < 0.01 * abs(le)
    assert _rel(g8, ge) < 0.1


def test_amax_rows_for():
    from gemctl.ops.triton.fp8_gemm import AMAX_ROWS, amax_rows_for

    assert amax_rows_for(4096, 10**6) == AMAX_ROWS  # large batches: the fewest column maxima
    assert amax_rows_for(4096, 262144) == 64  # ~4096 row-cast programs
    assert amax_rows_for(4096, 65536) == 16
    assert amax_rows_for(4096, 100) == 16  # never below the row cast's largest BLOCK_R
    assert amax_rows_for(384, 10**6) == 0  # 3 x 128: not a power-of-two number of runs per chunk
    assert amax_rows_for(8, 10**6) == 0  # runs shorter than 16 rows
