"""Ops against independent float64 loops over hostile jagged lengths, outputs and gradients.

CPU tier: float32 inputs, tight tolerance. GPU tier (marked gpu): bf16 inputs on CUDA, error
relative to the float64 loop within the bf16 band.
"""

import sys

import pytest
import torch

from gemctl import ops
from loops import attention_loop, block_loop, gdpa_loop, offsets, rel_err

CASES_SELF = [
    [0, 1, 15, 16, 17, 63, 64, 65, 3, 0],
    [200, 1, 2, 3, 0, 5],  # one long among short
    [1],
    [0, 0],
]
CASES_CROSS = [  # (q lengths, k lengths): asymmetric, zeros on either side
    ([3, 0, 5, 40, 1, 7], [7, 4, 0, 3, 64, 1]),
    ([65, 64, 63], [1, 2, 128]),
]

DEVICES = [
    pytest.param("cpu", torch.float32, 2e-5, id="cpu-fp32"),
    pytest.param("cuda", torch.bfloat16, 2e-2, id="cuda-bf16", marks=pytest.mark.gpu),
]




def make(n, heads, dim, device, dtype, gen):
    x = torch.randn(n, heads, dim, generator=gen, dtype=torch.float64)
    return x.to(device=device, dtype=dtype).requires_grad_(True)


def grads_of(out, inputs, gen):
    grad_out = torch.randn(out.shape, generator=gen, dtype=torch.float64).to(out.device, out.dtype)
    return torch.autograd.grad(out, inputs, grad_out, allow_unused=True), grad_out


def compare(fn_test, fn_ref, inputs, tol, gen):
    out = fn_test(*inputs)
    assert torch.isfinite(out).all()
    ref_inputs = [x.detach().double().cpu().requires_grad_(True) for x in inputs]
    ref = fn_ref(*ref_inputs)
    assert rel_err(out, ref) < tol, f"output rel err {rel_err(out, ref):.2e}"
    g_test, grad_out = grads_of(out, inputs, gen)
    g_ref = torch.autograd.grad(ref, ref_inputs, grad_out.double().cpu(), allow_unused=True)
    for i, (a, b) in enumerate(zip(g_test, g_ref)):
        if b is None:
            continue
        a = torch.zeros_like(b) if a is None else a
        assert torch.isfinite(a).all()
        assert rel_err(a, b) < tol * 2, f"grad {i} rel err {rel_err(a, b):.2e}"


def _check_self(device, dtype, tol, lengths, causal, with_bias, window, seed):
    """Self-attention through the reference op against the per-sequence loop, gradients included."""
    gen = torch.Generator().manual_seed(seed)
    h, d = 2, 32
    off = offsets(lengths, device)
    n, max_len = int(off[-1]), max(lengths)
    q, k, v = (make(n, h, d, device, dtype, gen) for _ in range(3))
    table = (torch.randn(h, 8, generator=gen, dtype=torch.float64)).to(device, torch.float32).requires_grad_(True)
    inputs = [q, k, v] + ([table] if with_bias else [])

    def run(q, k, v, *t, loop=False):
        bias = ops.RelativePositionBias(t[0], max_distance=32) if t else None
        if loop:
            return attention_loop(q, k, v, off.cpu(), off.cpu(), causal=causal, bias=bias, window=window)
        return ops.jagged_attention(q, k, v, off, off, max_len, max_len, bias=bias, causal=causal, window=window,
                                    backend="torch")

    compare(run, lambda *a: run(*a, loop=True), inputs, tol, gen)


@pytest.mark.parametrize("device,dtype,tol", DEVICES)
@pytest.mark.parametrize("lengths", CASES_SELF)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("with_bias", [False, True])
def test_jagged_attention_self(device, dtype, tol, lengths, causal, with_bias):
    _check_self(device, dtype, tol, lengths, causal, with_bias, None, sum(lengths) + causal)


@pytest.mark.parametrize("device,dtype,tol", DEVICES)
@pytest.mark.parametrize("lengths", CASES_SELF[:2])
@pytest.mark.parametrize("window", [1, 16, 64, 300])
@pytest.mark.parametrize("causal", [False, True])
def test_jagged_attention_window(device, dtype, tol, lengths, window, causal):
    """Sliding window (causal: the w most recent keys; otherwise |d| < w), with the bias."""
    _check_self(device, dtype, tol, lengths, causal, True, window, sum(lengths) + window)


def test_window_semantics():
    """Causal window w: the w most recent keys up to the aligned position; non-causal: |d| < w.
    With v = one-hot key position, the output row is the attention row itself."""
    lengths = [6]
    off = offsets(lengths)
    q = torch.zeros(6, 1, 8)  # equal scores: uniform over the visible keys
    k = torch.zeros(6, 1, 8)
    v = torch.eye(8)[:6, None, :]  # key j -> e_j
    causal = ops.jagged_attention(q, k, v, off, off, 6, 6, causal=True, window=2, backend="torch")[:, 0, :6]
    assert torch.allclose(causal[0], torch.tensor([1.0, 0, 0, 0, 0, 0]))
    assert torch.allclose(causal[3], torch.tensor([0, 0, 0.5, 0.5, 0, 0]))
    sym = ops.jagged_attention(q, k, v, off, off, 6, 6, causal=False, window=2, backend="torch")[:, 0, :6]
    assert torch.allclose(sym[3], torch.tensor([0, 0, 1 / 3, 1 / 3, 1 / 3, 0]))
    with pytest.raises(ValueError, match="window"):
        ops.jagged_attention(q, k, v, off, off, 6, 6, window=0, backend="torch")


@pytest.mark.parametrize("device,dtype,tol", DEVICES)
@pytest.mark.parametrize("q_lengths,k_lengths", CASES_CROSS)
@pytest.mark.parametrize("causal", [False, True])
def test_jagged_attention_cross(device, dtype, tol, q_lengths, k_lengths, causal):
    gen = torch.Generator().manual_seed(7)
    h, d = 2, 64
    qo, ko = offsets(q_lengths, device), offsets(k_lengths, device)
    q = make(int(qo[-1]), h, d, device, dtype, gen)
    k, v = (make(int(ko[-1]), h, d, device, dtype, gen) for _ in range(2))

    def run(q, k, v, loop=False):
        if loop:
            return attention_loop(q, k, v, qo.cpu(), ko.cpu(), causal=causal)
        return ops.jagged_attention(q, k, v, qo, ko, max(q_lengths), max(k_lengths), causal=causal, backend="torch")

    compare(run, lambda *a: run(*a, loop=True), [q, k, v], tol, gen)


@pytest.mark.parametrize("device,dtype,tol", DEVICES[:1])
def test_jagged_attention_large_negative_bias_is_finite(device, dtype, tol):
    """Every valid logit far below 0 (exp underflows): the softmax must stay exact, not cancel
    to NaN/inf. fp32 only: the logits' own rounding at |x| ~ 300 is ~3e-5, hence 10x the tolerance."""
    tol = 10 * tol
    gen = torch.Generator().manual_seed(3)
    lengths = [5, 0, 17, 1]
    off = offsets(lengths, device)
    q, k, v = (make(int(off[-1]), 2, 32, device, dtype, gen) for _ in range(3))
    table = torch.full((2, 8), -300.0, device=device)
    bias = ops.RelativePositionBias(table, 32)
    out = ops.jagged_attention(q, k, v, off, off, 17, 17, bias=bias, causal=True, backend="torch")
    ref = attention_loop(q, k, v, off.cpu(), off.cpu(), causal=True, bias=ops.RelativePositionBias(table.cpu(), 32))
    assert torch.isfinite(out).all()
    assert rel_err(out, ref) < tol


@pytest.mark.parametrize("device,dtype,tol", DEVICES)
def test_no_keys_yields_zeros(device, dtype, tol):
    gen = torch.Generator().manual_seed(4)
    qo, ko = offsets([3, 2], device), offsets([0, 0], device)
    q = make(5, 2, 32, device, dtype, gen)
    k = make(0, 2, 32, device, dtype, gen)
    v = make(0, 2, 32, device, dtype, gen)
    out = ops.jagged_attention(q, k, v, qo, ko, 3, 0, backend="torch")
    assert torch.equal(out, torch.zeros_like(out))
    g = ops.gdpa(q, k, v, qo, ko, 3, 0, backend="torch")
    assert torch.equal(g, torch.zeros_like(g))


GDPA_SHAPES = {
    # name: (q lengths, k lengths)
    "pma": ([4] * 6, [0, 1, 31, 32, 33, 100]),
    "cross": ([0, 1, 31, 32, 33, 100], [1, 2, 16, 64, 128, 256]),
    "self": ([0, 1, 31, 32, 33, 100], [0, 1, 31, 32, 33, 100]),
}


@pytest.mark.parametrize("device,dtype,tol", DEVICES)
@pytest.mark.parametrize("shape", list(GDPA_SHAPES))
@pytest.mark.parametrize("activation", ["gelu", "silu"])
def test_gdpa(device, dtype, tol, shape, activation):
    gen = torch.Generator().manual_seed(11)
    ql, kl = GDPA_SHAPES[shape]
    qo, ko = offsets(ql, device), offsets(kl, device)
    h, d = 2, 64
    q = make(int(qo[-1]), h, d, device, dtype, gen)
    k, v = (make(int(ko[-1]), h, d, device, dtype, gen) for _ in range(2))

    def run(q, k, v, loop=False):
        if loop:
            return gdpa_loop(q, k, v, qo.cpu(), ko.cpu(), activation=activation)
        return ops.gdpa(q, k, v, qo, ko, max(ql), max(kl), activation=activation, backend="torch")

    compare(run, lambda *a: run(*a, loop=True), [q, k, v], tol, gen)


@pytest.mark.parametrize("device,dtype,tol", DEVICES)
@pytest.mark.parametrize("block_size", [32, 64])
@pytest.mark.parametrize("use_rope", [False, True])
def test_block_attention(device, dtype, tol, block_size, use_rope):
    gen = torch.Generator().manual_seed(5)
    lengths = [0, 1, 63, 64, 65, 130, 31]
    off = offsets(lengths, device)
    h, d = 2, 64
    q, k, v = (make(int(off[-1]), h, d, device, dtype, gen) for _ in range(3))
    rope = None
    if use_rope:
        pos = torch.arange(256, dtype=torch.float64)[:, None]
        freq = 10000 ** (-torch.arange(d // 2, dtype=torch.float64) / (d // 2))
        rope = (torch.cos(pos * freq).to(device), torch.sin(pos * freq).to(device))

    def run(q, k, v, loop=False):
        if loop:
            return block_loop(q, k, v, off.cpu(), block_size, rope=None if rope is None else tuple(t.cpu() for t in rope))
        return ops.block_attention(q, k, v, off, max(lengths), block_size=block_size, rope=rope, backend="torch")

    compare(run, lambda *a: run(*a, loop=True), [q, k, v], tol, gen)


def test_auto_block_attention_takes_the_reference_where_the_kernel_cannot_and_says_so_once(monkeypatch, capsys):
    """backend="auto" on a GPU: a block size or head dim the Triton block attention does not take
    (a layer of model.attention=[block:48]) runs on the PyTorch reference, with one line on stderr
    per shape, instead of the kernel raising mid-run; a shape it takes goes to the kernel."""
    calls = []

    def kernel(q, *args, **kwargs):
        calls.append(kwargs["block_size"])
        return q

    monkeypatch.setattr(ops, "_pick", lambda op, backend, device: None if backend == "torch" else kernel)
    monkeypatch.setattr(ops, "_warned", set())
    gen = torch.Generator().manual_seed(0)
    off = offsets([50, 3])
    q, k, v = (torch.randn(53, 2, 64, generator=gen) for _ in range(3))
    ref = ops.block_attention(q, k, v, off, 50, block_size=48, backend="torch")
    for _ in range(2):
        out = ops.block_attention(q, k, v, off, 50, block_size=48, backend="auto")
        assert torch.equal(out, ref)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "block_size 48 with head_dim 64 runs on the PyTorch reference" in err[0]
    assert not calls
    assert ops.block_attention(q, k, v, off, 50, block_size=64, backend="auto") is q and calls == [64]
    assert not ops.block_kernel_takes(64, 16) and ops.block_kernel_takes(128, 128)


def test_relative_position_bucket():
    d = torch.arange(0, 300)
    b = ops.relative_position_bucket(d, 16, 128)
    assert torch.equal(b[:8], torch.arange(8))  # exact buckets below n_buckets // 2
    assert int(b.max()) == 15 and bool((b[1:] >= b[:-1]).all())  # monotone, capped
    assert torch.equal(ops.relative_position_bucket(-d, 16, 128), b)  # symmetric


def test_backend_errors():
    x = torch.zeros(1, 1, 8)
    off = torch.tensor([0, 1])
    with pytest.raises(ValueError, match="backend"):
        ops.jagged_attention(x, x, x, off, off, 1, 1, backend="cuda")


def test_preload_then_fullgraph_compile_and_a_clear_error_without_it(monkeypatch):
    """torch.compile(fullgraph=True) cannot trace the import on an op's first call: preload()
    imports every bundled kernel first; without it the failure names the fix."""
    pytest.importorskip("triton")
    monkeypatch.setattr(ops, "triton_kernels", {})
    q = torch.randn(5, 1, 16, requires_grad=True)
    off = torch.tensor([0, 2, 5])

    def f(q):
        return ops.jagged_attention(q, q, q, off, off, 3, 3, backend="triton").sum()

    with pytest.raises(Exception, match="preload"):
        torch.compile(f, fullgraph=True, backend="eager")(q)
    torch._dynamo.reset()
    assert ops.preload()["jagged_attention"]
    assert torch.allclose(torch.compile(f, fullgraph=True, backend="eager")(q), f(q))


def test_tuning_time_is_counted_once_per_key(monkeypatch):
    """Timing the candidates of a new key adds its wall time to tuning_seconds (which the trainer
    takes out of step times); a cached key adds nothing, nor does untuned selection."""
    import time

    from gemctl.ops.triton import common

    monkeypatch.setattr(common, "INTERPRET", False)
    monkeypatch.setattr(common, "_config_cache", {})
    monkeypatch.setattr(common, "_time", lambda fn: (fn(), time.sleep(0.05), {"a": 2.0, "b": 1.0}[cfg_seen[-1]])[2])
    cfg_seen = []
    common.set_autotune(True)
    try:
        before = common.tuning_seconds()
        assert common.pick_config(("k", 1), ["a", "b"], cfg_seen.append) == "b"
        spent = common.tuning_seconds() - before
        assert 0.1 <= spent < 5
        built = []  # candidates given as a function: built only for a key not decided yet
        assert common.pick_config(("k", 1), lambda: built.append(1) or ["a", "b"], cfg_seen.append) == "b"
        assert common.tuning_seconds() - before == spent and not built
        common.set_autotune(False)
        common.pick_config(("k", 2), lambda: built.append(1) or ["a", "b"], cfg_seen.append)
        assert common.tuning_seconds() - before == spent and built == [1]
    finally:
        common.set_autotune(None)


def test_autotuning_times_near_ties_again(monkeypatch):
    """One timing ranks the candidates; those within FINAL_MARGIN of the fastest (at most
    FINAL_SIZE) are timed FINAL_ROUNDS more times in turn and the lowest median wins: a candidate
    whose first timing caught a fast spell loses to one that is faster in the repeats, a clearly
    slower one is not timed again, and equal medians go to the earlier candidate in the list."""
    from gemctl.ops.triton import common

    monkeypatch.setattr(common, "INTERPRET", False)
    monkeypatch.setattr(common, "_config_cache", {})
    monkeypatch.setattr(common, "_disk", {})
    monkeypatch.setenv("GEMCTL_AUTOTUNE_CACHE", "0")
    spells = {}
    order = []

    def fake_time(fn):
        fn()
        cfg = order[-1]
        return spells[cfg].pop(0)

    monkeypatch.setattr(common, "_time", fake_time)
    common.set_autotune(True)
    try:
        # a: a fast first timing, slower after; b: 5% slower first, fastest after; c: 2x, never again
        spells.update(a=[1.00, 1.30, 1.30], b=[1.05, 1.00, 1.00], c=[2.0])
        assert common.pick_config(("near", 1), ["c", "a", "b"], order.append) == "b"
        assert order == ["c", "a", "b", "a", "b", "a", "b"]
        # equal medians: the earlier in the list
        order.clear()
        spells.update(a=[1.0, 1.0, 1.0], b=[1.0, 1.0, 1.0])
        assert common.pick_config(("near", 2), ["b", "a"], order.append) == "b"
        # nothing near the fastest: one timing each
        order.clear()
        spells.update(a=[1.0], b=[1.5])
        assert common.pick_config(("near", 3), ["a", "b"], order.append) == "a" and order == ["a", "b"]
        # at most FINAL_SIZE finalists, the fastest ones
        order.clear()
        spells.update({name: [1.0 + i / 100] * 3 for i, name in enumerate("pqrst")})
        assert common.pick_config(("near", 4), list("tsrqp"), order.append) == "p"
        assert sorted(set(order[5:])) == ["p", "q", "r"] and len(order) == 5 + 2 * common.FINAL_SIZE
    finally:
        common.set_autotune(None)


@pytest.mark.gpu
def test_autotuning_ranks_by_gpu_time_not_host_time_gpu():
    """_time measures a candidate's kernels, not its launch: a call that spends 3 ms on the host
    around a short kernel times below one whose kernel runs 0.5 ms (timing the plain call would
    rank them the other way), and a kernel's time is measured within 20% of a CUDA-graph replay."""
    import time

    import triton.testing

    from gemctl.ops.triton import common

    x = torch.randn(1 << 20, device="cuda")

    def host_heavy():
        time.sleep(0.003)
        x.mul_(1.0)

    def gpu_heavy():
        torch.cuda._sleep(1_000_000)  # ~0.5 ms at ~2 GHz

    assert common._time(host_heavy) < 0.2 < common._time(gpu_heavy)
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    mm = lambda: a @ a  # noqa: E731
    graph = triton.testing.do_bench_cudagraph(mm, rep=50, return_mode="median")
    assert abs(common._time(mm) - graph) < 0.2 * graph


def test_tuned_configs_name_how_they_were_timed(monkeypatch):
    """The disk cache's file name changes with the timing method (_TIMING): picks timed by the
    plain call (host cost included) are not read back as GPU-time picks."""
    pytest.importorskip("triton")
    from gemctl.ops.triton import common

    common._source_digest.cache_clear()
    first = common._source_digest(common.__file__)
    monkeypatch.setattr(common, "_TIMING", "another method")
    common._source_digest.cache_clear()
    try:
        assert common._source_digest(common.__file__) != first
    finally:
        common._source_digest.cache_clear()


def test_tuned_configs_persist_on_disk(monkeypatch, tmp_path):
    """A tuned pick is written to the on-disk cache and a later process (its in-memory cache empty)
    takes it without timing (one launch checks that it still runs); another candidate list is
    tuned again; a changed kernel source gives another file; an unreadable file is tuned over; a
    pick that the launcher now rejects is tuned over."""
    from gemctl.ops.triton import common

    monkeypatch.setenv("GEMCTL_AUTOTUNE_CACHE", "1")
    monkeypatch.setenv("GEMCTL_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(common, "INTERPRET", False)
    monkeypatch.setattr(common, "_config_cache", {})
    monkeypatch.setattr(common, "_disk", {})
    timed = []
    monkeypatch.setattr(common, "_time", lambda fn: (fn(), {(1, 2): 2.0, (3, 4): 1.0, (5, 6): 0.5}[timed[-1]])[1])
    common.set_autotune(True)
    try:
        key = ("k", 64, torch.bfloat16, True)
        assert common.pick_config(key, [(1, 2), (3, 4)], timed.append) == (3, 4) and len(timed) == 2
        files = list(tmp_path.glob("autotune-test_ops-*.json"))  # named after the module asking
        assert len(files) == 1 and "torch.bfloat16" in files[0].read_text()
        monkeypatch.setattr(common, "_config_cache", {})  # a new process
        monkeypatch.setattr(common, "_disk", {})
        assert common.pick_config(key, [(1, 2), (3, 4)], timed.append) == (3, 4) and timed[2:] == [(3, 4)]
        monkeypatch.setattr(common, "_config_cache", {})  # another candidate list: tuned again
        assert common.pick_config(key, [(1, 2), (5, 6)], timed.append) == (5, 6) and len(timed) == 5
        monkeypatch.setattr(common, "_config_cache", {})  # the launcher now rejects the stored (5, 6)
        monkeypatch.setattr(common, "_disk", {})

        def edited(cfg):
            if cfg == (5, 6):
                raise ValueError("BLOCK_R no longer divides the run")
            timed.append(cfg)

        assert common.pick_config(key, [(1, 2), (5, 6)], edited) == (1, 2) and timed[5:] == [(1, 2)]
        files[0].write_text("{half")
        monkeypatch.setattr(common, "_config_cache", {})
        monkeypatch.setattr(common, "_disk", {})
        assert common.pick_config(key, [(1, 2), (3, 4)], timed.append) == (3, 4) and len(timed) == 8
        monkeypatch.setattr(common, "_source_digest", lambda module_file: "other")  # an edited kernel source
        monkeypatch.setattr(common, "_config_cache", {})
        monkeypatch.setattr(common, "_disk", {})
        common.pick_config(key, [(1, 2), (3, 4)], timed.append)
        assert len(timed) == 10
    finally:
        common.set_autotune(None)
    from gemctl.ops.triton import fp8_gemm, gdpa

    # a module's file depends on its own source, common's and the kernel modules it imports (gdpa's
    # Gluon forward for Hopper among them)
    fp8_sources = ["fp8_gemm.py", "common.py", "mx_quant.py"]
    assert [p.name for p in common._kernel_sources(fp8_gemm.__file__)] == fp8_sources
    assert [p.name for p in common._kernel_sources(gdpa.__file__)] == ["gdpa.py", "common.py", "gdpa_hopper.py"]


def test_tuned_configs_survive_host_edits_not_kernel_edits(tmp_path, monkeypatch):
    """The on-disk configs are keyed by a module's device code: editing its host code (even lines
    that move the kernel further down the file) keeps them, editing a kernel or a constexpr the
    kernels read starts over."""
    import importlib.util

    from gemctl.ops.triton import common

    kernel = """
@triton.jit
def _scale_kernel(X, n, BLOCK: tl.constexpr):
    o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(X + o, tl.load(X + o, mask=o < n) * {factor}, mask=o < n)
"""

    def digest(name: str, host: str, factor: str = "2", width: int = 128) -> str:
        path = tmp_path / f"{name}.py"
        path.write_text(f"import triton\nimport triton.language as tl\n{host}\nWIDTH = tl.constexpr({width})\n"
                        + kernel.format(factor=factor))
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        monkeypatch.setitem(sys.modules, name, module)
        spec.loader.exec_module(module)
        return common._source_digest(str(path))

    base = digest("mod_a", "def launch(x):\n    return x")
    assert digest("mod_b", "# a comment\n\n\ndef launch(x, grid=None):\n    return x  # new host code") == base
    assert digest("mod_c", "def launch(x):\n    return x", factor="3") != base  # the kernel changed
    assert digest("mod_d", "def launch(x):\n    return x", width=256) != base  # a constexpr global changed


def test_untuned_config_is_the_first_that_runs(monkeypatch):
    """Autotune off (train.deterministic=true on CUDA, GEMCTL_AUTOTUNE=0): the first candidate that
    launches, in list order, found once per key; no candidate at all is an error naming the key."""
    from gemctl.ops.triton import common

    monkeypatch.setattr(common, "INTERPRET", False)
    monkeypatch.setattr(common, "_config_cache", {})
    common.set_autotune(False)
    try:
        calls = []

        def run(cfg):
            calls.append(cfg)
            if cfg == "too big":
                raise RuntimeError("out of shared memory")

        assert common.pick_config(("k", 1), ["too big", "fits", "faster"], run) == "fits"
        assert calls == ["too big", "fits"]
        assert common.pick_config(("k", 1), ["too big", "fits", "faster"], run) == "fits" and len(calls) == 2
        with pytest.raises(RuntimeError, match="no Triton kernel config runs for"):
            common.pick_config(("k", 2), ["too big"], run)
    finally:
        common.set_autotune(None)
