"""Triton GDPA against the float64 per-sequence loop: outputs and dq, dk, dv, for the three GEM
shapes (PMA, cross-attention, self-attention) over hostile lengths.

CPU tier: the interpreter (16x16 tiles, a persistent grid of 2 programs), fp32; GELU is checked
twice: against the exact erf GELU (the kernel's polynomial costs up to 1e-3 relative) and against
the same polynomial in float64 (kernel arithmetic alone, fp32-tight). GPU tier (marked gpu): bf16
within 2x the error of the bf16 PyTorch reference path (+1e-3), and bitwise-identical gradients
across runs.
"""

import pytest
import torch

from gemctl import ops
from loops import assert_errors, gdpa_loop, offsets

pytest.importorskip("triton")
from gemctl.ops.triton import gdpa as gdpa_kernels  # noqa: E402

SHAPES_CPU = {  # (q lengths, k lengths)
    "pma": ([4] * 6, [0, 1, 15, 16, 17, 40]),
    "cross": ([0, 1, 15, 16, 17, 40], [1, 2, 16, 17, 32, 3]),
    "self": ([0, 1, 15, 16, 17, 40], [0, 1, 15, 16, 17, 40]),
}
SHAPES_GPU = {
    "pma-32": ([32] * 8, [0, 1, 63, 64, 65, 1000, 7, 300]),
    "cross-32": ([0, 1, 63, 64, 65, 1000, 7, 300], [32] * 8),
    "cross-256": ([5, 129, 1000], [1, 128, 256]),
    "self": ([0, 1, 63, 64, 65, 1000, 7, 300], [0, 1, 63, 64, 65, 1000, 7, 300]),
}




def _check(ql, kl, activation, device, dtype, dim=32, tol=None, factor=None, heads=2, ref_activation=None,
           elementwise=False, scale=None, score_std=None):
    """score_std: q scaled so that the scores x = scale * q . k have about that standard deviation."""
    gen = torch.Generator().manual_seed(len(ql) + sum(kl))
    qo, ko = offsets(ql, device), offsets(kl, device)

    def make(n, spread=1.0):
        x = torch.randn(n, heads, dim, generator=gen, dtype=torch.float64) * spread
        return x.to(device, dtype).requires_grad_(True)

    spread = 1.0 if score_std is None else score_std / (abs(dim**-0.5 if scale is None else scale) * dim**0.5)
    q, k, v = make(int(qo[-1]), spread), make(int(ko[-1])), make(int(ko[-1]))
    grad = torch.randn(q.shape, generator=gen, dtype=torch.float64).to(device, dtype)

    def run(backend):
        out = ops.gdpa(q, k, v, qo, ko, max(ql), max(kl), activation=activation, scale=scale, backend=backend)
        return [out] + list(torch.autograd.grad(out, [q, k, v], grad))

    got = run("triton")
    ref_in = [t.detach().double().cpu().requires_grad_(True) for t in (q, k, v)]
    ref_out = gdpa_loop(*ref_in, qo.cpu(), ko.cpu(), activation=ref_activation or activation, scale=scale)
    ref_grads = torch.autograd.grad(ref_out, ref_in, grad.double().cpu(), allow_unused=True)
    ref = [ref_out] + [torch.zeros_like(t) if g is None else g for t, g in zip(ref_in, ref_grads)]
    base = run("torch") if factor else None
    assert_errors(["out", "dq", "dk", "dv"], got, ref, base, tol=tol, factor=factor, elementwise=elementwise)
    return got


CPU_TOL = {"gelu": 1e-3, "silu": 2e-5}  # gelu: the polynomial's error (test_gelu_polynomial_bounds)


@pytest.mark.parametrize("shape", list(SHAPES_CPU))
@pytest.mark.parametrize("activation", ["gelu", "silu"])
def test_gdpa_cpu(shape, activation):
    ql, kl = SHAPES_CPU[shape]
    _check(ql, kl, activation, "cpu", torch.float32, tol=CPU_TOL[activation])


@pytest.mark.parametrize("scale", [1.0, 2.0**-6, 3e-3, -0.5, 4.0])
def test_gdpa_forward_scales_cpu(scale):
    """The kernels' GELU folds the scale into its constants for scales in [2^-6, 2^8] and multiplies
    the scores first otherwise (3e-3, negative scales): both, forward and backward, against float64,
    with scores spread over |x| up to ~10 whatever the scale (so every coefficient of both
    polynomials, and the relu and step beyond |x| = 4, carry weight)."""
    ql, kl = SHAPES_CPU["self"]
    _check(ql, kl, "gelu", "cpu", torch.float32, tol=CPU_TOL["gelu"], scale=scale, score_std=3.0)


# the interpreter (numpy) warns where u R(u) overflows to inf: by design, the min takes |a| there
@pytest.mark.filterwarnings("ignore:overflow encountered in multiply:RuntimeWarning")
def test_gdpa_fp16_large_scores_stay_finite_cpu():
    """fp16 takes no fold: the second GEMM's operand would be (2 / c) gelu(x), which overflows fp16
    from x > 32752 c. Scores up to ~5800 at c = 32^-0.5: finite, and as the PyTorch path."""
    qo = ko = offsets([5, 3], "cpu")
    q = torch.full((8, 2, 32), 32.0, dtype=torch.float16)
    v = torch.randn(8, 2, 32, generator=torch.Generator().manual_seed(0)).to(torch.float16) / 64
    got = ops.gdpa(q, q, v, qo, ko, 5, 5, activation="gelu", backend="triton")
    ref = ops.gdpa(q.float(), q.float(), v.float(), qo, ko, 5, 5, activation="gelu", backend="torch")
    assert torch.isfinite(got).all()
    assert torch.allclose(got.float(), ref, rtol=2e-2, atol=1e-2)


@pytest.mark.parametrize("shape", list(SHAPES_CPU))
def test_gdpa_gelu_kernel_arithmetic_cpu(shape):
    ql, kl = SHAPES_CPU[shape]
    _check(ql, kl, "gelu", "cpu", torch.float32, tol=2e-5, ref_activation="gelu_poly")


@pytest.mark.parametrize("cfg", [(16, 16, 1, 1, 0, 0), (16, 16, 1, 1, 1, 0), (16, 32, 1, 1, 3, 0)])
def test_gdpa_grids_cpu(cfg):
    """One program per item and persistent zigzag grids give the same result."""
    from gemctl.ops.triton.common import forced_config

    with forced_config(cfg):
        _check([0, 1, 15, 16, 17, 40, 3], [5, 0, 16, 17, 1, 33, 2], "silu", "cpu", torch.float32, tol=2e-5)


@pytest.mark.parametrize("per_sm", [0, 2])
def test_gdpa_tma_forward_cpu(per_sm, monkeypatch):
    """TMA forward configs (seventh field 1): whole key tiles through descriptors, the partial last
    one by masked loads; against float64, and the masked-load path's output (same values, up to
    the float32 summation order of the interpreter's Q K^T against K^T loaded transposed)."""
    from gemctl.ops.triton import gdpa as gdpa_kernels
    from gemctl.ops.triton.common import forced_config, row_descriptors

    built = []
    monkeypatch.setattr(gdpa_kernels, "row_descriptors", lambda *a, **kw: built.append(row_descriptors(*a, **kw)) or built[-1])
    ql, kl = [0, 1, 15, 16, 17, 40, 3], [5, 0, 16, 17, 1, 33, 48]
    with forced_config({"gdpa_fwd": (16, 16, 1, 1, per_sm, 0, 1)}):
        tma = _check(ql, kl, "silu", "cpu", torch.float32, tol=2e-5)
    assert built and all(d is not None for d in built)  # the forward ran with K/V descriptors
    with forced_config({"gdpa_fwd": (16, 16, 1, 1, per_sm, 0)}):
        plain = _check(ql, kl, "silu", "cpu", torch.float32, tol=2e-5)
    assert torch.allclose(tma[0], plain[0], rtol=1e-5, atol=1e-5) and not torch.equal(tma[0], 0 * tma[0])
    assert any(len(c) > 6 and c[6] for c in gdpa_kernels._FWD_CANDIDATES)
    assert all(len(c) == 6 or c in gdpa_kernels._GPU_CHECKED or gdpa_kernels._PENDING_AUTOTUNE
               for c in gpu_checked_forward())


def test_forward_register_cap_cpu():
    """A forward config's eighth field caps its registers (maxnreg): the same outputs, and such
    configs stay pinned-only until the GPU tier passes them (they change what ptxas emits)."""
    from gemctl.ops.triton import gdpa as gdpa_kernels
    from gemctl.ops.triton.common import forced_config

    ql, kl = [0, 1, 15, 16, 17, 40, 3], [5, 0, 16, 17, 1, 33, 48]
    with forced_config({"gdpa_fwd": (16, 16, 1, 1, 0, 0, 0, 64)}):
        capped = _check(ql, kl, "silu", "cpu", torch.float32, tol=2e-5)
    with forced_config({"gdpa_fwd": (16, 16, 1, 1, 0, 0)}):
        plain = _check(ql, kl, "silu", "cpu", torch.float32, tol=2e-5)
    assert torch.equal(capped[0], plain[0])
    caps = [c for c in gdpa_kernels._FWD_CANDIDATES if len(c) > 7 and c[7]]
    assert caps and not set(caps) & set(gpu_checked_forward()) - gdpa_kernels._GPU_CHECKED


def gpu_checked_forward():
    """The forward candidates autotuning times (the TMA ones only once the GPU tier passed them)."""
    from gemctl.ops.triton import gdpa as gdpa_kernels
    from gemctl.ops.triton.common import gpu_checked

    return gpu_checked(gdpa_kernels._FWD_CANDIDATES, 6, gdpa_kernels._GPU_CHECKED, gdpa_kernels._PENDING_AUTOTUNE)


RESIDENT = {  # shape -> per-kernel configs with the short side resident (chunk >= 1)
    "cross": ([0, 1, 15, 16, 17, 40, 33], [1, 2, 16, 17, 32, 3, 0],
              {"gdpa_fwd": (16, 32, 1, 1, 1, 2), "gdpa_dq": (16, 32, 1, 1, 0, 3), "gdpa_dkdv": (16, 16, 1, 1, 2, 0)}),
    "pma": ([4, 4, 4, 4, 4, 0], [0, 1, 15, 16, 17, 40],
            {"gdpa_dkdv": (16, 16, 1, 1, 1, 2), "gdpa_fwd": (16, 16, 1, 1, 0, 0), "gdpa_dq": (16, 16, 1, 1, 1, 0)}),
}


@pytest.mark.parametrize("shape", list(RESIDENT))
@pytest.mark.parametrize("activation", ["gelu", "silu"])
def test_gdpa_resident_cpu(shape, activation):
    """The resident-short-side kernels (keys for cross-attention, queries for PMA's dK/dV)."""
    from gemctl.ops.triton.common import forced_config

    ql, kl, cfgs = RESIDENT[shape]
    with forced_config(cfgs):
        _check(ql, kl, activation, "cpu", torch.float32, tol=2e-5, ref_activation="gelu_poly" if activation == "gelu" else None)


def test_gdpa_resident_config_rejects_long_side():
    from gemctl.ops.triton.common import forced_config

    with forced_config({"gdpa_fwd": (16, 16, 1, 1, 0, 2)}), pytest.raises(ValueError, match="key length <= 16"):
        _check([4], [17], "silu", "cpu", torch.float32, tol=2e-5)


def test_gelu_polynomial_bounds():
    """The kernels' GELU polynomial in float32 against the exact erf GELU in float64: value error
    < 2^-12 and derivative error < 2^-10 over every x, including far beyond the clamp."""
    from gemctl.ops.triton.gdpa import gelu_poly_reference

    x = torch.cat([torch.linspace(-12, 12, 480001, dtype=torch.float64), torch.tensor([-1e4, -50.0, 50.0, 1e4], dtype=torch.float64)])
    value, grad = gelu_poly_reference(x.float())
    cdf = 0.5 * (1 + torch.erf(x / 2**0.5))
    exact_grad = cdf + x * torch.exp(-0.5 * x * x) / (2 * torch.pi) ** 0.5
    assert (value.double() - x * cdf).abs().max() < 2**-12
    assert (grad.double() - exact_grad).abs().max() < 2**-10


@pytest.mark.parametrize("scale", [128**-0.5, 32**-0.5, 1.0, 2.0**-6, 2.0**8, 2.0**-7, 2.0**-9, 0.3])
def test_gelu_folded_formula_bounds(scale):
    """The kernels' GELU on raw scores (the scale folded into the constants, min(t P(t), |x|)
    for the clamp, the derivative's bound on u = a^2; 2^-7 and 2^-9 fall outside the fold range,
    2^-6 and 2^8 are its ends) in float32
    against the exact erf GELU in float64: value error < 2^-12 and derivative error < 2^-10 over
    every x = scale * a, far beyond |x| = 4 included, and t P(t) >= |x| wherever t = x^2 >= 16
    (what lets the min stand in for the clamp)."""
    from gemctl.ops.triton.gdpa import GELU_P, gelu_folded_reference

    x = torch.cat([torch.linspace(-12, 12, 240001, dtype=torch.float64), torch.tensor([-1e4, -50.0, 50.0, 1e4], dtype=torch.float64)])
    value, grad = (t.double() for t in gelu_folded_reference((x / scale).float(), scale))
    cdf = 0.5 * (1 + torch.erf(x / 2**0.5))
    assert torch.isfinite(value).all() and torch.isfinite(grad).all()
    assert (value - x * cdf).abs().max() < 2**-12
    assert (grad - (cdf + x * torch.exp(-0.5 * x * x) / (2 * torch.pi) ** 0.5)).abs().max() < 2**-10
    t = torch.cat([torch.linspace(16, 1e3, 100001, dtype=torch.float64), torch.logspace(3, 30, 1000, dtype=torch.float64)])
    poly = torch.zeros_like(t)
    for coef in reversed(GELU_P):
        poly = poly * t + coef
    assert (t * poly - t.sqrt()).min() > 1e-4


def test_gdpa_no_keys_cpu():
    got = _check([3, 2], [0, 0], "gelu", "cpu", torch.float32, tol=1e-6)
    assert torch.equal(got[0], torch.zeros_like(got[0]))


@pytest.mark.gpu
@pytest.mark.parametrize("shape", list(SHAPES_GPU))
@pytest.mark.parametrize("activation", ["gelu", "silu"])
def test_gdpa_gpu(shape, activation):
    ql, kl = SHAPES_GPU[shape]
    _check(ql, kl, activation, "cuda", torch.bfloat16, dim=128, factor=2.0, heads=4)


@pytest.mark.gpu
def test_gdpa_backward_deterministic_gpu():
    ql, kl = SHAPES_GPU["pma-32"]
    a = _check(ql, kl, "gelu", "cuda", torch.bfloat16, dim=128, factor=2.0, heads=4)
    b = _check(ql, kl, "gelu", "cuda", torch.bfloat16, dim=128, factor=2.0, heads=4)
    for x, y in zip(a, b):
        assert torch.equal(x, y)


def test_gdpa_torch_compile_no_graph_break_cpu():
    ops.preload()  # as the trainer does: alone, this test had the op's first call import inside the compile
    qo, ko = offsets([4, 4, 4]), offsets([0, 17, 3])
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(12, 2, 32, generator=gen, requires_grad=True)
    k, v = (torch.randn(20, 2, 32, generator=gen, requires_grad=True) for _ in range(2))

    def f(q, k, v):
        return ops.gdpa(q, k, v, qo, ko, 4, 17, activation="silu", backend="triton").square().sum()

    loss = torch.compile(f, fullgraph=True, backend="aot_eager")(q, k, v)
    grads = torch.autograd.grad(loss, [q, k, v])
    ref_loss = f(q, k, v)
    ref_grads = torch.autograd.grad(ref_loss, [q, k, v])
    assert torch.allclose(loss, ref_loss)
    for a, b in zip(grads, ref_grads):
        assert torch.allclose(a, b)


GPU_FORCED = {  # bf16 GPU tier of the resident and persistent variants (autotune may pick any)
    "cross-resident": ("cross-32", {"gdpa_fwd": (64, 32, 4, 3, 0, 4), "gdpa_dq": (64, 32, 4, 3, 2, 4)}),
    "cross-256-resident": ("cross-256", {"gdpa_fwd": (64, 256, 8, 2, 0, 2), "gdpa_dq": (64, 256, 8, 2, 0, 2)}),
    "pma-resident": ("pma-32", {"gdpa_dkdv": (32, 64, 4, 3, 2, 4)}),
    "self-persistent": ("self", {"gdpa_fwd": (64, 64, 4, 3, 2, 0), "gdpa_dkdv": (64, 64, 4, 2, 2, 0),
                                 "gdpa_dq": (32, 64, 4, 3, 4, 0)}),
}


@pytest.mark.gpu
@pytest.mark.parametrize("case", list(GPU_FORCED))
def test_gdpa_forced_configs_gpu(case):
    from gemctl.ops.triton.common import forced_config

    shape, cfgs = GPU_FORCED[case]
    ql, kl = SHAPES_GPU[shape]
    with forced_config(cfgs):
        _check(ql, kl, "gelu", "cuda", torch.bfloat16, dim=128, factor=2.0, heads=4)


EVERY_CONFIG = ([("gdpa_fwd", c) for c in gdpa_kernels._FWD_CANDIDATES]
                + [("gdpa_dkdv", c) for c in gdpa_kernels._DKDV_CANDIDATES]
                + [("gdpa_dq", c) for c in gdpa_kernels._DQ_CANDIDATES])


@pytest.mark.gpu
@pytest.mark.parametrize("which,cfg", EVERY_CONFIG, ids=[f"{w[5:]}-{'_'.join(map(str, c))}" for w, c in EVERY_CONFIG])
def test_every_candidate_config_gpu(which, cfg):
    """Every autotune candidate pinned in turn (the rest of the tier runs the first only), bf16,
    norm-wise and element-wise against the bf16 PyTorch path's error. Resident configs (chunk >= 1)
    on the shape whose short side fits their tile (cross-32 keys, PMA's 32 queries), the others on
    that shape and on jagged self-attention."""
    from gemctl.ops.triton.common import forced_config

    shapes = ["pma-32" if which == "gdpa_dkdv" else "cross-32"] + ([] if cfg[5] else ["self"])
    with forced_config({which: cfg}):
        for shape in shapes:
            ql, kl = SHAPES_GPU[shape]
            _check(ql, kl, "gelu", "cuda", torch.bfloat16, dim=128, factor=2.0, heads=4, elementwise=True)



# (q lengths, k lengths): every key side fits the tile; the q sides cross chunk bounds. Repeated
# 8 times (320 items of 4 heads): more items than a persistent grid has programs (2-3 per SM),
# so each program walks several items of different sizes through one query ring (items with
# fewer tiles than the ring has slots among them).
_HOPPER_Q = [0, 1, 63, 64, 65, 1000, 7, 300, 129, 513]
HOPPER_SHAPES = {
    "cross-128": (_HOPPER_Q * 8, [128, 1, 17, 127, 128, 100, 0, 64, 128, 33] * 8),
    "cross-32": (_HOPPER_Q * 8, [32, 1, 17, 31, 32, 16, 0, 2, 32, 32] * 8),
}


@pytest.mark.parametrize("cfg,why", [((64, 64, 4, 2, 2, 0, 0, 0, 1, 1), "is not built"),
                                     ((128, 128, 8, 2, 2, 16, 0, 0, 1, 1), "is not built"),
                                     ((64, 128, 4, 2, 2, 16, 0, 0, 1, 1, 1), "timing probe"),
                                     ((64, 128, 4, 2, 2, 16, 0, 0, 1, 1, 2), "timing probe"),
                                     ((64, 128, 4, 4, 1, 16, 0, 0, 3, 2), "is not built"),
                                     ((64, 128, 4, 8, 1, 16, 0, 0, 2, 2), "needs 295424 B"),
                                     ((64, 128, 4, 4, 2, 16, 0, 0, 2, 2), "one program per SM"),
                                     ((64, 128, 4, 4, 1, 16, 0, 0, 2, 3), "1 or 2 K/V buffers"),
                                     ((64, 128, 4, 3, 1, 16, 0, 0, 2, 2), "even number of query slots"),
                                     ((64, 128, 4, 4, 1, 16, 0, 0, 2, 2, 1), "timing probe"),
                                     ((64, 64, 4, 4, 1, 4, 0, 0, 3), "streaming warp-specialized"),
                                     ((64, 64, 4, 4, 2, 0, 0, 0, 3), "streaming warp-specialized"),
                                     ((64, 64, 4, 8, 1, 0, 0, 0, 3), "needs 360960 B"),
                                     ((64, 256, 4, 1, 1, 0, 0, 0, 3), "streaming warp-specialized"),
                                     ((64, 64, 4, 4, 1, 0, 1, 0, 3), "streaming warp-specialized"),
                                     ((64, 64, 4, 4, 1, 0, 0, 0, 3, 0, 1), "timing probe"),
                                     ((64, 128, 4, 2, 2, 16, 0, 0, 1, 1, 0, 1), "ping-pong"),
                                     ((64, 128, 4, 4, 1, 16, 0, 0, 2, 2, 0, 1), "measured and removed")])
@pytest.mark.parametrize("probes", [False, True])
def test_hopper_forward_refuses_configs_without_a_kernel(monkeypatch, cfg, why, probes):
    """A pinned Hopper config the Gluon module has no kernel for (chunk 0: the streaming form, removed
    after hanging the H200; 8 warps; a kernel number other than 1 and 2; a warp-specialized config
    whose buffers exceed an SM's shared memory, with two programs per SM, three K/V buffers or an odd
    number of query slots, where a consumer could pass a slot on the other's phase), or a
    timing probe (wrong outputs by design) outside bench_gdpa.py --probes or on the streaming
    warp-specialized kernel (which has none), raises before anything is built or launched."""
    gdpa_hopper = pytest.importorskip("gemctl.ops.triton.gdpa_hopper")
    assert not gdpa_hopper.PROBES
    if probes:
        if why == "timing probe" and gdpa_kernels.config_field(cfg, 8) in (1, 2):
            pytest.skip("bench_gdpa.py --probes lets the resident kernels' probes through")
        monkeypatch.setattr(gdpa_hopper, "PROBES", True)
    q = torch.zeros(4, 2, 128, dtype=torch.bfloat16)
    records = torch.zeros(1, 8, dtype=torch.int32)
    with pytest.raises(ValueError, match=why):
        gdpa_hopper.forward(q, q, q, torch.empty_like(q), records, 0, 0.1, cfg, fold=False)


def test_query_records_carry_each_items_spans_resolved_on_the_host():
    """The Gluon kernels read an item's spans from its record, so no load there waits on another's
    result: the records hold query_work's (sequence, tile) pairs in its order, then the sequence's
    query and key spans as the offsets give them, and are built once per batch layout."""
    from gemctl.ops.triton import common

    q_lengths, k_lengths = [70, 0, 1, 129, 64], [3, 5, 0, 128, 64]
    qo, ko = offsets(q_lengths), offsets(k_lengths)
    work = common.query_work(qo, ko, 64, False, "cpu")
    records = common.query_records(qo, ko, 64, False, "cpu")
    assert common.RECORD == 8  # work_record's row stride in the kernels
    assert records.dtype == torch.int32 and tuple(records.shape) == (work.shape[0], common.RECORD)
    assert torch.equal(records[:, :2], work) and not records[:, 6:].any()
    for seq, tile, q_start, q_len, k_start, k_len in records[:, :6].tolist():
        assert (q_start, q_len) == (int(qo[seq]), q_lengths[seq]) and 0 <= tile * 64 < q_len
        assert (k_start, k_len) == (int(ko[seq]), k_lengths[seq])
    assert common.query_records(qo, ko, 64, False, "cpu") is records
    work[0, 0] = 99  # the list handed out is a copy: the records built from the cached host list keep theirs
    assert torch.equal(common.query_records(qo, ko, 64, False, "cpu")[:, :2], records[:, :2])
    assert int(common.query_records(qo, ko, 16, False, "cpu")[0, 0]) != 99
    assert not torch.equal(common.query_records(qo, ko, 32, False, "cpu")[:, :2], records[:, :2])


def test_streaming_forward_is_offered_only_where_no_resident_tile_holds_the_keys():
    """Autotuning offers the streaming Gluon forward for long key sides (self-1000) and not where a
    resident Gluon tile holds every key (cross-128, where it was slower); never off Hopper."""
    stream = lambda cands: [c for c in cands if gdpa_kernels.config_field(c, 8) == 3]  # noqa: E731
    long_keys, short_keys = gdpa_kernels._forward_candidates(True, 1000), gdpa_kernels._forward_candidates(True, 128)
    assert stream(long_keys) and not stream(short_keys)
    assert any(gdpa_kernels.config_field(c, 8) == 2 for c in short_keys)
    assert not any(gdpa_kernels.config_field(c, 8) for c in gdpa_kernels._forward_candidates(False, 1000))


def test_warp_specialized_candidates_fit_and_wait_for_the_gpu_tier():
    """Every warp-specialized candidate (resident and streaming) fits one SM's shared memory at
    head_dim 128 in 16 bits (the kernel's budget, which ptxas measured at 229,704 B for the largest:
    the estimate may not be below it), the streaming ones take a pair of query tiles per item, and
    only the GPU tier's winners are autotuned."""
    gdpa_hopper = pytest.importorskip("gemctl.ops.triton.gdpa_hopper")
    assert gdpa_hopper.ws_shared_bytes(64, 128, 128, 4, 2, 2) >= 229704
    for cfg in gdpa_kernels._HOPPER_WS_CANDIDATES:
        assert gdpa_kernels.config_field(cfg, 8) == 2 and cfg[4] == 1
        assert gdpa_hopper.ws_shared_bytes(cfg[0], cfg[1], 128, cfg[3], cfg[9], 2) <= gdpa_hopper._SMEM_PER_BLOCK
        assert cfg in gdpa_kernels._FWD_CANDIDATES
    for cfg in gdpa_kernels._HOPPER_STREAM_CANDIDATES:  # four query tiles: two consumers x two items
        assert gdpa_kernels.config_field(cfg, 8) == 3 and cfg[4] == 1 and cfg[5] == 0
        assert gdpa_hopper.ws_shared_bytes(cfg[0], cfg[1], 128, 4, cfg[3], 2) <= gdpa_hopper._SMEM_PER_BLOCK
        assert gdpa_kernels.item_rows(cfg) == 2 * cfg[0]  # an item is one tile per consumer
        assert cfg in gdpa_kernels._FWD_CANDIDATES
    new = set(gdpa_kernels._HOPPER_WS_CANDIDATES + gdpa_kernels._HOPPER_STREAM_CANDIDATES)
    passed = {(64, 128, 4, 4, 1, 16, 0, 0, 2, 2), (64, 64, 4, 4, 1, 0, 0, 0, 3), (64, 64, 4, 3, 1, 0, 0, 0, 3)}
    assert new & gdpa_kernels._GPU_CHECKED == passed  # the H100 tier's winners (2026-12-05), no other
    checked = gdpa_kernels.gpu_checked(gdpa_kernels._FWD_CANDIDATES, 6, gdpa_kernels._GPU_CHECKED)
    assert new & set(checked) == passed
    assert gdpa_kernels.item_rows((64, 128, 4, 2, 2, 16, 0, 0, 1, 1)) == 64 * 16
    assert gdpa_kernels.item_rows((64, 32, 4, 3, 0, 0)) == 64


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", gdpa_kernels._HOPPER_STREAM_CANDIDATES, ids=lambda c: "_".join(map(str, c)))
@pytest.mark.parametrize("activation", ["gelu", "silu"])
@pytest.mark.parametrize("dim,dtype", [(128, torch.bfloat16), (64, torch.float16)])
@pytest.mark.parametrize("shape", ["self", "asymmetric", "few"])
def test_gdpa_hopper_stream_forward_gpu(cfg, activation, dim, dtype, shape):
    """The streaming warp-specialized forward pinned, on key sides of any length: jagged
    self-attention (lengths 0, 1, tile +- 1, one long among short; pairs of query tiles whose second
    tile is empty, key tiles ending mid-tile) and asymmetric sides (1..1000 keys against 0..1000
    queries), 80 sequences (more items than programs); and two sequences (fewer items than
    programs: one with no keys, whose rows must be stored as zeros, and a last pair whose second
    tile lies past the tensor's end). The output starts as NaN. Element-wise against the 16-bit
    PyTorch path's error."""
    ql, kl = {"self": (_HOPPER_Q * 8, _HOPPER_Q * 8), "few": ([65, 3], [0, 200]),
              "asymmetric": (_HOPPER_Q * 8, [5, 1000, 1, 64, 63, 129, 0, 300, 1000, 2] * 8)}[shape]
    _check_hopper(cfg, ql, kl, activation, dim, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", gdpa_kernels._HOPPER_FWD_CANDIDATES + gdpa_kernels._HOPPER_WS_CANDIDATES,
                         ids=lambda c: "_".join(map(str, c)))
@pytest.mark.parametrize("activation", ["gelu", "silu"])
@pytest.mark.parametrize("dim,dtype", [(128, torch.bfloat16), (64, torch.float16)])
def test_gdpa_hopper_forward_gpu(cfg, activation, dim, dtype):
    """The Gluon forwards (gdpa_hopper.py: resident and warp-specialized) pinned: key sides of
    0 .. block_n keys (masked past k_len), query sides of 0, 1, tile +- 1 and beyond a chunk (the
    TMA ring across tiles, the masked partial-tile store), one long among short. Element-wise
    against the bf16 PyTorch path's error. The backward is the Triton one's (checked with it)."""
    ql, kl = HOPPER_SHAPES["cross-128" if cfg[1] >= 128 else "cross-32"]
    _check_hopper(cfg, ql, [min(n, cfg[1]) for n in kl], activation, dim, dtype)


def _check_hopper(cfg, ql, kl, activation, dim, dtype):
    from gemctl.ops.triton.common import forced_config

    used = []
    real = gdpa_kernels._hopper

    def spy():
        used.append(True)
        return real()

    with forced_config({"gdpa_fwd": cfg}), pytest.MonkeyPatch.context() as mp:
        mp.setattr(gdpa_kernels, "_hopper", spy)
        # the output starts as NaN: a row the kernel fails to store (a zero row too) cannot pass
        mp.setattr(gdpa_kernels, "_output_like", lambda t: torch.full_like(t, float("nan")))
        _check(ql, kl, activation, "cuda", dtype, dim=dim, factor=2.0, heads=4, elementwise=True)
    assert used  # the Gluon kernel ran, not a fallback


@pytest.mark.parametrize("k_rows,eligible", [(128, True), (127, False)])
def test_hopper_configs_only_for_tensors_they_can_read(monkeypatch, k_rows, eligible):
    """The forward's autotune key says whether every Hopper config can run on the call's tensors
    (TMA boxes of 64 query / 128 key rows, heads adjacent): a key tuned with them is never handed a
    batch they cannot read, and without that the candidates hold none of them."""
    seen = {}

    class Picked(Exception):
        pass

    def spy(key, candidates, run, interpret_config):
        seen["key"], seen["candidates"] = key, candidates()
        raise Picked

    monkeypatch.setattr(gdpa_kernels, "_hopper_runs", lambda device: True)  # as on an sm_90 GPU
    monkeypatch.setattr(gdpa_kernels, "pick_config", spy)
    q = torch.randn(200, 4, 128, dtype=torch.bfloat16)
    k, v = (torch.randn(k_rows, 4, 128, dtype=torch.bfloat16) for _ in range(2))
    with pytest.raises(Picked):
        gdpa_kernels._forward(q, k, v, offsets([100, 100]), offsets([k_rows - 64, 64]), 100, 64, 0, 0.1)
    hopper = [c for c in seen["candidates"] if gdpa_kernels.config_field(c, 8)]
    assert (seen["key"][-1] == "hopper") is eligible and bool(hopper) is eligible
    assert all(c[1] >= 64 for c in hopper if c[5])  # only resident tiles that hold every key length (64 here)
