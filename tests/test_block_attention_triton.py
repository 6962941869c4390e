"""Triton block attention (RoPE fused) against the float64 per-sequence loop: outputs and dq, dk, dv.

CPU tier: the interpreter, fp32 (and fp16), block sizes 32 and 64 over lengths around the block
edges, RoPE off, from tables and from a base frequency. GPU tier (marked gpu): bf16 on the H200,
block sizes 32/64/128, head dims 64/128; the error must stay within 2x the error of the bf16
PyTorch reference path on the same inputs (plus a small floor); gradients bitwise identical
across runs; torch.compile traces the op without a graph break.
"""

import numpy as np
import pytest
import torch

from gemctl import ops
from loops import assert_compiles_same, assert_errors, block_loop, offsets, rel_err

pytest.importorskip("triton")
from gemctl.ops.triton import block_attention as ba_kernels  # noqa: E402
from gemctl.ops.triton import common  # noqa: E402
from gemctl.ops.triton.block_attention import block_attention_triton  # noqa: E402

LENGTHS_CPU = [[0, 1, 63, 64, 65, 31], [130, 0, 2, 33]]
LENGTHS_GPU = [[0, 1, 63, 64, 65, 127, 128, 129, 7], [1000] + [3, 17, 0, 64, 200] * 8]
BASE = 10000.0


def rope_tables(length, dim, base=BASE):
    """float64 cos/sin [length, dim // 2] of positions r and frequencies base ** (-i / (dim / 2))."""
    pos = torch.arange(length, dtype=torch.float64)[:, None]
    angle = pos * base ** (-torch.arange(dim // 2, dtype=torch.float64) / (dim // 2))
    return torch.cos(angle), torch.sin(angle)


def _inputs(lengths, heads, dim, device, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    off = offsets(lengths, device)

    def make():
        x = torch.randn(int(off[-1]), heads, dim, generator=gen, dtype=torch.float64)
        return x.to(device, dtype).requires_grad_(True)

    q, k, v = make(), make(), make()
    grad = torch.randn(q.shape, generator=gen, dtype=torch.float64).to(device, dtype)
    return off, q, k, v, grad


def _run(backend, q, k, v, off, max_len, block_size, rope, grad):
    if backend == "triton":
        out = block_attention_triton(q, k, v, off, max_len, block_size=block_size, rope=rope)
    else:
        out = ops.block_attention(q, k, v, off, max_len, block_size=block_size, rope=rope, backend=backend)
    return [out] + list(torch.autograd.grad(out, [q, k, v], grad))


def _check(lengths, block_size, rope_kind, device, dtype, heads=2, dim=32, seed=0, tol=None, factor=None,
           elementwise=False):
    """rope_kind: None, "tables" (fp32 tables given) or "base" (a float base frequency)."""
    off, q, k, v, grad = _inputs(lengths, heads, dim, device, dtype, seed)
    max_len = max(lengths)
    # The kernel gets exactly max_len rows; the PyTorch reference slices the tables to the padded
    # length (a multiple of block_size), so it gets that many.
    tables64 = rope_tables(-(-max(max_len, 1) // block_size) * block_size, dim)
    tables = tuple(t.to(device, torch.float32) for t in tables64)
    rope = {None: None, "tables": tuple(t[:max_len] for t in tables), "base": BASE}[rope_kind]
    got = _run("triton", q, k, v, off, max_len, block_size, rope, grad)

    ref_in = [t.detach().double().cpu().requires_grad_(True) for t in (q, k, v)]
    ref_rope = None if rope_kind is None else tables64
    ref_out = block_loop(*ref_in, off.cpu(), block_size, rope=ref_rope)
    ref = [ref_out] + list(torch.autograd.grad(ref_out, ref_in, grad.double().cpu()))
    base = _run("torch", q, k, v, off, max_len, block_size, None if rope is None else tables, grad) if factor else None
    assert_errors(["out", "dq", "dk", "dv"], got, ref, base, tol=tol, factor=factor, elementwise=elementwise)


@pytest.mark.parametrize("lengths", LENGTHS_CPU)
@pytest.mark.parametrize("block_size", [32, 64])
@pytest.mark.parametrize("rope_kind", [None, "tables", "base"])
def test_block_attention_cpu(lengths, block_size, rope_kind):
    _check(lengths, block_size, rope_kind, "cpu", torch.float32, tol=2e-5)


def test_head_dim_64_one_program_per_head_cpu():
    """D = 64 and the one-head-per-program grid (the interpreter's default loops over the heads)."""
    with common.forced_config({"block_attention_fwd": (1, 1, 1), "block_attention_bwd": (1, 1, 1)}):
        _check([65, 1, 0, 20], 32, "tables", "cpu", torch.float32, heads=2, dim=64, tol=2e-5)


@pytest.mark.parametrize("rope_kind", [None, "tables"])
@pytest.mark.parametrize("which", ["block_attention_fwd", "block_attention_bwd"])
def test_half_width_configs_cpu(which, rope_kind, monkeypatch):
    """The forward with v and o, the backward with do, v and dv in (BS, D/2) halves (config field 4),
    against float64: partial and empty blocks, the head loop and one head per program; the kernel
    is launched with HALVES set."""
    launched = []
    real = ba_kernels._launch
    monkeypatch.setattr(ba_kernels, "_launch", lambda kernel, *a, **flags: launched.append((kernel, flags))
                        or real(kernel, *a, **flags))
    kernel = ba_kernels._block_attn_fwd if which == "block_attention_fwd" else ba_kernels._block_attn_bwd
    for per_program in (0, 1):
        with common.forced_config({which: (1, 1, per_program, 0, 1)}):
            _check(LENGTHS_CPU[0], 32, rope_kind, "cpu", torch.float32, heads=2, dim=32, tol=2e-5)
    assert [flags["HALVES"] for k, flags in launched if k is kernel] == [True, True]


@pytest.mark.parametrize("which", ["block_attention_fwd", "block_attention_bwd"])
def test_record_configs_cpu(which, monkeypatch):
    """The picks reading their block from a work record (seventh field) against float64: partial
    and empty blocks, with rope; the kernel is launched with RECORDS over common.query_records;
    records with TMA are refused in one line; the configs wait for the GPU tier (which they passed:
    they join autotuning)."""
    launched = []
    real = ba_kernels._launch
    monkeypatch.setattr(ba_kernels, "_launch", lambda kernel, *a, **flags: launched.append((kernel, flags))
                        or real(kernel, *a, **flags))
    kernel = ba_kernels._block_attn_fwd if which == "block_attention_fwd" else ba_kernels._block_attn_bwd
    cands = ba_kernels._RECORDS_FWD_CANDIDATES if which == "block_attention_fwd" else ba_kernels._RECORDS_BWD_CANDIDATES
    assert all(common.config_field(c, 6) for c in cands)
    for per_program in (0, 1):
        with common.forced_config({which: (1, 1, per_program, 0, 1, 0, 1)}):
            _check(LENGTHS_CPU[0], 32, "tables", "cpu", torch.float32, heads=2, dim=32, tol=2e-5)
    assert [flags["RECORDS"] for k, flags in launched if k is kernel] == [True, True]
    with pytest.raises(ValueError, match="work records with TMA"):
        ba_kernels._launch(kernel, offsets([40], "cpu"), 2, 32, (1, 1, 1, 1, 0, 0, 1), (), (object(),), 32, 1, "cpu",
                           RECORDS=True)
    all_cands = ba_kernels._FWD_CANDIDATES if which == "block_attention_fwd" else ba_kernels._BWD_CANDIDATES
    assert set(cands) <= set(all_cands) and not set(cands) & set(ba_kernels._tuned(all_cands, set()))
    checked = ba_kernels._FWD_CHECKED if which == "block_attention_fwd" else ba_kernels._BWD_CHECKED
    assert set(cands) <= set(ba_kernels._tuned(all_cands, checked))


def test_reference_takes_tables_of_max_len_rows_cpu():
    """The PyTorch reference with tables of exactly max_len rows (max_len not a multiple of the block
    size; it used to slice them to the padded length and fail), fwd and bwd, against the loop."""
    lengths, dim = [0, 70, 5, 33], 32
    off, q, k, v, grad = _inputs(lengths, 2, dim, "cpu", torch.float64, 5)
    tables = rope_tables(70, dim)
    out = ops.block_attention(q, k, v, off, 70, block_size=32, rope=tables, backend="torch")
    got = [out] + list(torch.autograd.grad(out, [q, k, v], grad))
    ref_out = block_loop(q, k, v, off, 32, rope=tables)
    ref = [ref_out] + list(torch.autograd.grad(ref_out, [q, k, v], grad))
    for a, b in zip(got, ref):
        assert rel_err(a, b) < 1e-10


def test_fp16_cpu():
    """fp16 within 2x the fp16 PyTorch path's error (bf16 is not run: the interpreter's bf16 dot
    is broken)."""
    _check([0, 1, 63, 64, 65], 32, "tables", "cpu", torch.float16, factor=2.0)


def test_zero_length_sequences_cpu():
    """Only empty sequences: no program runs, empty outputs and gradients; empty ones among others."""
    off, q, k, v, grad = _inputs([0, 0], 2, 32, "cpu", torch.float32, 1)
    got = _run("triton", q, k, v, off, 0, 64, BASE, grad)
    assert all(t.shape == (0, 2, 32) for t in got)
    _check([0, 5, 0], 64, "base", "cpu", torch.float32, tol=2e-5)


@pytest.mark.parametrize("rope_kind", [None, "tables"])
@pytest.mark.parametrize("per_program", [0, 1])
@pytest.mark.parametrize("halves", [0, 1])
def test_tma_whole_blocks_cpu(rope_kind, per_program, halves, monkeypatch):
    """TMA configs (fourth field 1): whole blocks through descriptors (q, k as halves; v too in the
    forward's half-width config), partial ones by masked loads; against float64, and bit for bit the
    values of the masked-load path, also with q, k, v as views of one fused [N, 3, H, D] projection."""
    built = []
    real = common.row_descriptors
    monkeypatch.setattr(ba_kernels, "row_descriptors", lambda *a, **kw: built.append(real(*a, **kw)) or built[-1])
    cfg = (1, 1, per_program, 1, halves)
    with common.forced_config({"block_attention_fwd": cfg, "block_attention_bwd": cfg}):
        _check(LENGTHS_CPU[0], 32, rope_kind, "cpu", torch.float32, tol=2e-5)
    assert built and all(d is not None for d in built)  # forward and backward ran with descriptors
    lengths = [70, 0, 32, 5]
    off = offsets(lengths, "cpu")
    gen = torch.Generator().manual_seed(3)
    qkv = torch.randn(int(off[-1]), 3, 2, 32, generator=gen).requires_grad_(True)
    grad = torch.randn(int(off[-1]), 2, 32, generator=gen)
    rope = None if rope_kind is None else BASE
    runs = []
    for cfg in [(1, 1, per_program, 1, halves), (1, 1, per_program, 0, halves)]:
        with common.forced_config({"block_attention_fwd": cfg, "block_attention_bwd": cfg}):
            q, k, v = qkv.unbind(1)
            runs.append(_run("triton", q, k, v, off, 70, 32, rope, grad))
    assert built[-1] is not None  # the fused views got descriptors too
    for a, b in zip(*runs):
        assert torch.equal(a, b)


def test_tma_candidates_wait_for_the_gpu_tier_cpu():
    """TMA and half-width candidates are pinned by tests and benchmarks but timed by the autotuner
    only once the GPU tier has passed them, per kernel (_FWD_CHECKED, _BWD_CHECKED): a config that
    passed for one kernel does not join the other's autotuning."""
    for cands in (ba_kernels._FWD_CANDIDATES, ba_kernels._BWD_CANDIDATES):
        assert any(len(c) > 3 and c[3] for c in cands)
        assert ba_kernels._tuned(cands, set()) == [c for c in cands if len(c) == 3]
        assert ba_kernels._tuned(cands, {cands[-1]})[-1] == cands[-1]
    fwd = ba_kernels._tuned(ba_kernels._FWD_CANDIDATES, ba_kernels._FWD_CHECKED)
    bwd = ba_kernels._tuned(ba_kernels._BWD_CANDIDATES, ba_kernels._BWD_CHECKED)
    assert (4, 2, 0, 0, 1) in fwd and (4, 2, 0, 0, 1) not in bwd  # checked as a forward, slower backward
    assert (4, 1, 1, 0, 1) in bwd
    halves = common.row_descriptors(32, torch.zeros(40, 2, 32), cols=16)
    assert halves is not None and halves[0].block_shape == [32, 16]
    whole, partial = common.whole_tile_work(offsets([70, 0, 32, 5], "cpu"), 32, "cpu")
    assert sorted(map(tuple, whole.tolist())) == [(0, 0), (0, 1), (2, 0)]
    assert partial.tolist() == [[0, 2], [3, 0]]


def test_hopper_configs_wait_for_the_gpu_tier_and_are_refused_off_hopper_cpu():
    """The Gluon kernels' configs (sixth field: programs per SM) wait for the GPU tier like the TMA
    ones (the forward's three-per-SM config passed it and won on the H200, the backward's two-per-SM
    one won on the H100 once it stopped spilling; one per SM stays pinned-only), and pinned where
    they cannot run (here: the interpreter, no GPU) they raise one clear error instead of falling
    back; their own checks refuse what they were not built for."""
    for hopper, cands, checked in ((ba_kernels._HOPPER_FWD_CANDIDATES, ba_kernels._FWD_CANDIDATES,
                                    ba_kernels._FWD_CHECKED),
                                   (ba_kernels._HOPPER_BWD_CANDIDATES, ba_kernels._BWD_CANDIDATES,
                                    ba_kernels._BWD_CHECKED)):
        assert hopper and all(common.config_field(c, 5) for c in hopper) and set(hopper) <= set(cands)
        assert set(hopper) & set(ba_kernels._tuned(cands, checked)) == set(hopper) & checked
    assert (4, 1, 1, 0, 0, 3) in ba_kernels._tuned(ba_kernels._FWD_CANDIDATES, ba_kernels._FWD_CHECKED)
    tuned_bwd = ba_kernels._tuned(ba_kernels._BWD_CANDIDATES, ba_kernels._BWD_CHECKED)
    assert (4, 1, 1, 0, 0, 2) in tuned_bwd and (4, 1, 1, 0, 0, 1) not in tuned_bwd
    off, q, k, v, grad = _inputs([70, 3], 2, 32, "cpu", torch.float32, 0)
    with common.forced_config({"block_attention_fwd": ba_kernels._HOPPER_FWD_CANDIDATES[0]}):
        with pytest.raises(ValueError, match="Hopper.*sm_90"):
            block_attention_triton(q, k, v, off, 70, block_size=64)
    with common.forced_config({"block_attention_bwd": ba_kernels._HOPPER_BWD_CANDIDATES[0]}):
        out = block_attention_triton(q, k, v, off, 70, block_size=64)
        with pytest.raises(ValueError, match="Hopper.*sm_90"):
            torch.autograd.grad(out, [q, k, v], grad)
    from gemctl.ops.triton import block_attention_hopper as bh  # imports without a GPU (CI compiles it)

    x = torch.zeros(128, 2, 64, dtype=torch.bfloat16)
    records = torch.zeros(1, common.RECORD, dtype=torch.int32)
    args = (x, x, x, x, None, x, x, x, None, None, records)
    with pytest.raises(ValueError, match="block 32"):
        bh.backward(*args, 32, False, 1.0, 1.0, 2)
    with pytest.raises(ValueError, match="TMA descriptors"):
        y = torch.zeros(128, 2, 66, dtype=torch.bfloat16)[..., :64]  # rows of 132 elements: not 16-byte aligned
        bh.backward(*((y,) + args[1:]), 64, False, 1.0, 1.0, 2)
    with pytest.raises(ValueError, match="rope tables of torch.float64"):
        tables64 = torch.zeros(64, 32, dtype=torch.float64)
        bh.forward(x, x, x, x, None, tables64, tables64, records, 64, True, 1.0, 3)
    tables = torch.zeros(64, 32, dtype=torch.float64)
    assert bh.table_descriptors(tables, tables) is None  # fp64 tables: the Triton kernels take them
    assert bh.table_descriptors(tables.float(), tables.float())[0].block_shape == [64, 32]
    assert bh.descriptors(x)[0].block_shape == [64, 32]
    assert bh.descriptors(x, x.half()) is None  # one dtype for every tile
    # autotuning offers the Gluon configs only where they can run (the flag is part of the key)
    assert not ba_kernels._hopper_eligible(64, False, None, None, x)  # no GPU here
    for cands in (ba_kernels._FWD_CANDIDATES, ba_kernels._BWD_CANDIDATES):
        assert ba_kernels._eligible(cands, True) == cands
        assert ba_kernels._eligible(cands, False) == [c for c in cands if not common.config_field(c, 5)]
    assert bh.tables_viewable(tables.float(), tables.float()) and not bh.tables_viewable(tables.float()[:, :30],
                                                                                          tables.float()[:, :30])
    # the persistent grid never asks for more programs than fit an SM (sm_90 ptxas: 106,536 B with
    # fp16 tables at D=128, two per SM; fp32 tables add 16 KB: one)
    assert bh.resident_programs(128, 2, 2) == 2 and bh.resident_programs(128, 2, 0) == 2
    assert bh.resident_programs(128, 2, 4) == 1 and bh.resident_programs(64, 2, 4) == 2
    # the forward: 65,560 B with fp16 tables at D=128 (three per SM), 49,176 B without rope (four fit,
    # its registers allow three)
    assert bh.resident_programs(128, 2, 2, backward=False) == 3 == bh.resident_programs(128, 2, 0, backward=False)


def test_paired_backward_records_put_the_short_blocks_last():
    """The paired backward's records (PAIR, ninth field of a Gluon backward config): query_records'
    blocks with those of more than 32 rows first and those of at most 32 last, each group in its
    order, every block once, and how many come first; its 32-row boxes land in the halves of the
    (64, D/2) tiles, whose layout they take. Items: one per head for the first, one per two heads
    for the others."""
    from gemctl.ops.triton import block_attention_hopper as bh

    lengths = [70, 0, 1, 129, 64, 96, 97, 32, 33, 200]
    off = torch.tensor(np.cumsum([0] + lengths), dtype=torch.int64)
    records, n_single = bh.paired_records(off, "cpu")
    plain = common.query_records(off, off, 64, False, "cpu")
    rows = (records[:, 3] - records[:, 1] * 64).clamp(max=64)
    assert sorted(map(tuple, records.tolist())) == sorted(map(tuple, plain.tolist()))
    assert (rows[:n_single] > 32).all() and (rows[n_single:] <= 32).all()
    # blocks of at most 32 rows: 70 (6), 1, 129 (1), 96 (32), 32, 200 (8); of more: 70's first, 129's
    # two, 64, 96's first, 97's two (64 + 33), 33, 200's three
    assert n_single == 11 and records.shape[0] - n_single == 6
    plain_rows = (plain[:, 3] - plain[:, 1] * 64).clamp(max=64)
    keep = [r for r in plain.tolist() if min(64, r[3] - r[1] * 64) > 32]
    assert records[:n_single].tolist() == keep and plain_rows.numel() == records.shape[0]
    assert bh.paired_records(off, "cpu")[0] is records  # cached per batch layout
    x = torch.zeros(128, 4, 64, dtype=torch.bfloat16)
    d32 = bh.descriptors(x, rows=32)[0]
    assert d32.block_shape == [32, 32] and d32.layout == bh.descriptors(x)[0].layout
    tables = torch.zeros(64, 32, dtype=torch.float16)
    assert bh.table_descriptors(tables, tables, rows=32)[0].block_shape == [32, 32]
    # an odd head count or no offsets: refused before anything is built (autotuning skips the config)
    x3 = torch.zeros(128, 3, 64, dtype=torch.bfloat16)
    for t, offsets_given in ((x3, off), (x, None)):
        with pytest.raises(ValueError, match="even number of heads and the batch's offsets"):
            bh.backward(t, t, t, t, None, t, t, t, None, None, None, 64, False, 1.0, 1.0, 2, pair=True,
                        offsets=offsets_given)


def _offered(monkeypatch, lengths, heads, dim, dtype):
    """(autotune key, candidate list) of the forward and the backward on these inputs (rope by base
    frequency), every candidate admitted (_PENDING_AUTOTUNE), none run: what autotuning would time."""
    seen = []

    class Picked(Exception):
        pass

    def spy(key, candidates, run, interpret_config):
        seen.append((key, candidates()))
        raise Picked

    monkeypatch.setattr(ba_kernels, "_PENDING_AUTOTUNE", True)
    monkeypatch.setattr(ba_kernels, "pick_config", spy)
    off, q, k, v, grad = _inputs(lengths, heads, dim, "cpu", dtype, 0)
    q, k, v = (t.detach() for t in (q, k, v))
    with pytest.raises(Picked):
        ba_kernels._forward(q, k, v, None, None, off, max(lengths), 64, BASE, 0.1)
    with pytest.raises(Picked):
        ba_kernels._backward(grad, q, k, v, torch.zeros(q.shape[0], heads), None, None, off, max(lengths), 64, BASE,
                             0.1)
    return seen


@pytest.mark.parametrize("rows,eligible", [(200, True), (40, False)])
def test_hopper_configs_only_for_tensors_they_can_read_cpu(monkeypatch, rows, eligible):
    """Both passes' autotune keys say whether the Gluon configs can run on the call's tensors (TMA
    boxes of 64 rows): a key tuned with them is never handed a batch they cannot read (here 40
    rows), and without that the candidates hold none of them."""
    monkeypatch.setattr(ba_kernels, "_hopper_runs", lambda device: True)  # as on an sm_90 GPU
    for key, cands in _offered(monkeypatch, [rows - 30, 30], 2, 128, torch.bfloat16):
        assert key[-1] is eligible
        assert any(common.config_field(c, 5) for c in cands) is eligible


def test_packed_rotation_only_where_sm90_ptx_runs_cpu(monkeypatch):
    """The bf16x2 rotation (ROPE == 2) is off by default; turned on, both passes take it (the
    backward recomputes the forward's scores), for bf16 only, and only where sm_90 PTX runs: never
    under the interpreter or on the CPU."""
    bf16, f16, f32 = (torch.zeros(1, 1, 32, dtype=d) for d in (torch.bfloat16, torch.float16, torch.float32))
    assert ba_kernels._PACKED_ROPE is False
    monkeypatch.setattr(ba_kernels, "_sm90", lambda device: True)  # as on an H200
    assert ba_kernels._rope_mode(True, bf16) == 1
    monkeypatch.setattr(ba_kernels, "_PACKED_ROPE", True)
    assert ba_kernels._rope_mode(False, bf16) == 0
    assert ba_kernels._rope_mode(True, bf16) == 2
    assert [ba_kernels._rope_mode(True, x) for x in (f16, f32)] == [1, 1]
    monkeypatch.setattr(ba_kernels, "_sm90", lambda device: False)  # the CPU: no inline PTX
    assert ba_kernels._rope_mode(True, bf16) == 1


def test_packed_rotation_runs_no_gluon_config_cpu(monkeypatch):
    """Under the packed rotation neither pass offers a Gluon config (they rotate in fp32: the pair
    would disagree), a pinned one is refused with the reason, and both passes' autotune keys carry
    the mode."""
    monkeypatch.setattr(ba_kernels, "_rope_mode", lambda rope, q: 2 if rope else 0)
    monkeypatch.setattr(ba_kernels, "_hopper_eligible", lambda *a: True)
    for key, cands in _offered(monkeypatch, [130, 7], 3, 64, torch.float32):
        assert key[5] == 2 and key[-1] is False  # (name, dim, dtype, block, tables, mode, ...)
        assert cands and not any(common.config_field(c, 5) for c in cands)
    with pytest.raises(ValueError, match="Gluon kernel, which rotates in fp32"):
        ba_kernels._gluon_rotation(2, ba_kernels._HOPPER_BWD_CANDIDATES[0])
    ba_kernels._gluon_rotation(1, ba_kernels._HOPPER_BWD_CANDIDATES[0])


def test_mixed_dtypes_are_refused_cpu():
    off, q, k, v, _ = _inputs([5, 3], 2, 32, "cpu", torch.float32, 0)
    with pytest.raises(ValueError, match="q, k and v must share one dtype"):
        ba_kernels.block_attention_triton(q, k.double(), v, off, 5, block_size=32)


def test_backward_is_deterministic_cpu():
    off, q, k, v, grad = _inputs([65, 0, 130, 7], 2, 32, "cpu", torch.float32, 4)
    a = _run("triton", q, k, v, off, 130, 64, BASE, grad)
    b = _run("triton", q, k, v, off, 130, 64, BASE, grad)
    for x, y in zip(a, b):
        assert torch.equal(x, y)


def test_strided_qkv_views_and_ops_dispatch_cpu():
    """q, k, v as views of one fused QKV projection (no copy), through ops.block_attention."""
    lengths = [5, 70, 0, 2]
    off = offsets(lengths)
    gen = torch.Generator().manual_seed(2)
    qkv = torch.randn(77, 3, 2, 32, generator=gen, dtype=torch.float64)
    qkv = qkv.float().requires_grad_(True)
    q, k, v = qkv.unbind(1)
    tables = tuple(t.float() for t in rope_tables(70, 32))
    out = ops.block_attention(q, k, v, off, 70, block_size=32, rope=tables, backend="triton")
    ref = block_loop(q, k, v, off, 32, rope=tables)
    assert rel_err(out, ref) < 2e-5
    out.sum().backward()
    assert torch.isfinite(qkv.grad).all()


def test_rope_tables_are_fp16_for_16_bit_inputs_cpu():
    """A base frequency builds fp16 tables for bf16/fp16 q (fp32 for fp32 q), within fp16's rounding
    of the float64 values; the kernel reads fp16 tables given by hand (fp32 inputs, interpreter) to
    the same result as the loop with those tables."""
    assert ops.rope_table_dtype(torch.bfloat16) is torch.float16
    assert ops.rope_table_dtype(torch.float16) is torch.float16
    assert ops.rope_table_dtype(torch.float32) is torch.float32
    for dtype, want in ((torch.bfloat16, torch.float16), (torch.float32, torch.float32)):
        q = torch.zeros(5, 2, 32, dtype=dtype)
        cos, sin, on = ba_kernels._rope_args(None, None, BASE, 70, q)
        assert on and cos.dtype == sin.dtype == want and cos.shape[0] >= 70
        exact = rope_tables(cos.shape[0], 32)
        bound = 2.0**-12 if want is torch.float16 else 2.0**-24
        for got, ref in zip((cos, sin), exact):
            assert float((got.double() - ref).abs().max()) <= bound
    lengths = [70, 0, 5, 33]
    off, q, k, v, grad = _inputs(lengths, 2, 32, "cpu", torch.float32, 3)
    tables = tuple(t.half() for t in rope_tables(70, 32))
    got = _run("triton", q, k, v, off, 70, 32, tables, grad)
    ref_in = [t.detach().double().requires_grad_(True) for t in (q, k, v)]
    ref_out = block_loop(*ref_in, off, 32, rope=tables)
    ref = [ref_out] + list(torch.autograd.grad(ref_out, ref_in, grad.double()))
    assert_errors(["out", "dq", "dk", "dv"], got, ref, tol=2e-5)


def test_autotune_key_names_the_rope_tables_dtype_cpu(monkeypatch):
    """fp16 and fp32 tables tune apart (their best backward configs differ on the H200)."""
    keys = []
    real = ba_kernels.pick_config
    monkeypatch.setattr(ba_kernels, "pick_config", lambda key, *a, **kw: keys.append(key) or real(key, *a, **kw))
    off, q, k, v, grad = _inputs([5, 3], 2, 32, "cpu", torch.float32, 0)
    for rope in (tuple(t.float() for t in rope_tables(5, 32)), tuple(t.half() for t in rope_tables(5, 32)), None):
        _run("triton", q, k, v, off, 5, 32, rope, grad)
    assert [key[4] for key in keys] == ["float32", "float32", "float16", "float16", False, False]
    assert [key[0] for key in keys[:2]] == ["block_attention_fwd", "block_attention_bwd"]


def test_rope_argument_errors_cpu():
    off, q, k, v, _ = _inputs([3, 4], 2, 32, "cpu", torch.float32, 0)
    short = tuple(t.float() for t in rope_tables(3, 32))
    with pytest.raises(ValueError, match="rope tables"):
        block_attention_triton(q, k, v, off, 4, rope=short)
    with pytest.raises(TypeError, match="reference takes rope"):
        ops.block_attention(q, k, v, off, 4, rope=BASE, backend="torch")
    cos, sin = rope_tables(4, 32)
    with pytest.raises(ValueError, match="share one float dtype, got torch.float16 and torch.float32"):
        block_attention_triton(q, k, v, off, 4, rope=(cos.half(), sin.float()))


def test_rope_tables_with_different_row_strides_cpu():
    """sin a slice of a wider table, cos compact: the kernels step both by one row stride, so the
    two are made contiguous first; the result is the compact tables' own."""
    off, q, k, v, grad = _inputs([5, 3], 2, 32, "cpu", torch.float32, 1)
    cos, sin = (t.float() for t in rope_tables(5, 32))
    wide = torch.cat([sin, torch.full_like(sin, 7.0)], dim=1)[:, :16]  # row stride 32, not 16
    got = _run("triton", q, k, v, off, 5, 32, (cos, wide), grad)
    ref = _run("triton", q, k, v, off, 5, 32, (cos, sin), grad)
    for a, b in zip(got, ref):
        assert torch.equal(a, b)


def _compile_check(device, dtype, backend, rope_kind, **tolerance):
    lengths = [3, 0, 70]
    off = offsets(lengths, device)
    gen = torch.Generator().manual_seed(8)
    q, k, v = (torch.randn(73, 2, 64, generator=gen).to(device, dtype).requires_grad_(True) for _ in range(3))
    rope = {"tables": tuple(t.to(device, torch.float32) for t in rope_tables(70, 64)), "base": BASE}[rope_kind]

    def f(q, k, v):
        out = ops.block_attention(q, k, v, off, 70, block_size=32, rope=rope, backend="triton")
        return out.float().square().sum()

    # ops imports its Triton module on an op's first call, which dynamo does not trace
    # (fullgraph: "Attempted to call function marked as skipped: import_module"): preload first.
    ops.preload()
    assert_compiles_same(f, [q, k, v], backend, **tolerance)


@pytest.mark.parametrize("rope_kind", ["tables", "base"])
def test_torch_compile_no_graph_break_cpu(rope_kind):
    _compile_check("cpu", torch.float32, "aot_eager", rope_kind)


# ----------------------------------------------------------------------------------------------
# GPU tier.


@pytest.mark.gpu
@pytest.mark.parametrize("lengths", LENGTHS_GPU)
@pytest.mark.parametrize("block_size", [32, 64, 128])
@pytest.mark.parametrize("dim", [64, 128])
@pytest.mark.parametrize("rope_kind", [None, "tables"])
def test_block_attention_gpu(lengths, block_size, dim, rope_kind):
    _check(lengths, block_size, rope_kind, "cuda", torch.bfloat16, heads=4, dim=dim, factor=2.0)


_EVERY_CONFIG = ([("block_attention_fwd", c) for c in ba_kernels._FWD_CANDIDATES]
                 + [("block_attention_bwd", c) for c in ba_kernels._BWD_CANDIDATES])


@pytest.mark.gpu
@pytest.mark.parametrize("which,cfg", _EVERY_CONFIG, ids=[f"{w[16:]}-{'_'.join(map(str, c))}" for w, c in _EVERY_CONFIG])
def test_every_candidate_config_gpu(which, cfg):
    """Every autotune candidate pinned in turn (the rest of the tier runs the first only), bf16,
    norm-wise and element-wise against the bf16 PyTorch path's error: fused RoPE, partial blocks."""
    block = 64 if common.config_field(cfg, 5) else 32  # the Hopper backward is built for block 64 only
    with common.forced_config({which: cfg}):
        _check(LENGTHS_GPU[1], 64, "tables", "cuda", torch.bfloat16, heads=4, dim=128, factor=2.0, elementwise=True)
        _check(LENGTHS_GPU[0], block, None, "cuda", torch.bfloat16, heads=4, dim=64, factor=2.0, elementwise=True)


_HOPPER_PINS = ([("fwd", c, (4, 2, 0)) for c in ba_kernels._HOPPER_FWD_CANDIDATES]
                + [("bwd", (4, 2, 0), c) for c in ba_kernels._HOPPER_BWD_CANDIDATES]
                + [("both", ba_kernels._HOPPER_FWD_CANDIDATES[0], ba_kernels._HOPPER_BWD_CANDIDATES[0])])


@pytest.mark.gpu
@pytest.mark.parametrize("kind,fwd,bwd", _HOPPER_PINS,
                         ids=[f"{k}-{'_'.join(map(str, f))}-{'_'.join(map(str, b))}" for k, f, b in _HOPPER_PINS])
@pytest.mark.parametrize("lengths", LENGTHS_GPU + [[64] * 300 + [65, 1]])
@pytest.mark.parametrize("dim,dtype", [(128, torch.bfloat16), (64, torch.float16)])
@pytest.mark.parametrize("rope_kind", [None, "tables", "base"])
def test_block_attention_hopper_gpu(kind, fwd, bwd, lengths, dim, dtype, rope_kind):
    """The Gluon forward and backward (block 64) pinned, each with the other pass Triton's and
    both together, against float64 element-wise and the 16-bit PyTorch path's error: partial
    blocks, empty and one-row sequences, fp32 tables ("tables") and the fp16 tables of a base
    frequency, and more items than the persistent grid has programs (the third lengths: 302
    sequences x 4 heads over 264-396 programs, each program several rounds)."""
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("the Gluon kernels need an sm_90+ GPU")
    with common.forced_config({"block_attention_fwd": fwd, "block_attention_bwd": bwd}):
        _check(lengths, 64, rope_kind, "cuda", dtype, heads=4, dim=dim, factor=2.0, elementwise=True)


@pytest.mark.gpu
@pytest.mark.parametrize("rope", [None, BASE])
def test_block_attention_hopper_ignores_non_finite_rows_past_the_sequences_gpu(rope):
    """Rows after offsets[-1] full of NaN and inf, the last sequence ending in a partial block (the
    Gluon kernels' TMA boxes read those rows): outputs and gradients stay those of the Triton
    kernels, whose masked loads never read them."""
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("the Gluon kernels need an sm_90+ GPU")
    lengths = [65, 3, 130]
    off, q, k, v, grad = _inputs(lengths, 4, 128, "cuda", torch.bfloat16, 5)
    junk = torch.full((64, 4, 128), float("nan"), device="cuda", dtype=torch.bfloat16)
    junk[::2] = float("inf")
    padded = [torch.cat([t.detach(), junk]).requires_grad_(True) for t in (q, k, v)]
    grad_padded = torch.cat([grad, junk])
    got = {}
    gluon = (ba_kernels._HOPPER_FWD_CANDIDATES[0], ba_kernels._HOPPER_BWD_CANDIDATES[0])
    for name, fwd, bwd in (("triton", (4, 2, 0), (4, 1, 1)), ("gluon", *gluon)):
        with common.forced_config({"block_attention_fwd": fwd, "block_attention_bwd": bwd}):
            got[name] = [t[:int(off[-1])] for t in _run("triton", *padded, off, max(lengths), 64, rope, grad_padded)]
    for name, a, b in zip(["out", "dq", "dk", "dv"], got["gluon"], got["triton"]):
        assert torch.isfinite(a).all(), name
        assert rel_err(a, b) < 2e-2, name


@pytest.mark.gpu
def test_packed_rotation_is_taken_on_sm90_gpu(monkeypatch):
    """Turned on (benchmarks), bf16 rotates in bf16x2 on an sm_90+ GPU in both passes; by default in fp32."""
    q = torch.zeros(1, 1, 32, device="cuda", dtype=torch.bfloat16)
    assert ba_kernels._rope_mode(True, q) == 1
    monkeypatch.setattr(ba_kernels, "_PACKED_ROPE", True)
    want = 2 if torch.cuda.get_device_capability() >= (9, 0) and torch.version.hip is None else 1
    assert ba_kernels._rope_mode(True, q) == want


@pytest.mark.gpu
@pytest.mark.parametrize("packed", [False, True], ids=["fp32_rotation", "packed_rotation"])
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("rope_kind", [None, "tables", "base"])
def test_triton_forward_and_backward_agree_elementwise_gpu(rope_kind, seed, packed, monkeypatch):
    """The Triton forward and backward picks pinned, element-wise against float64 and the bf16
    PyTorch path, with either rotation in both passes: the backward recomputes p from q and k
    rotated as the forward rotated them (with the forward's packed bf16x2 rotation and the
    backward's fp32 one, dv's worst element was 3.1x the PyTorch path's on these lengths, seed 0,
    fp32 tables: H100, 2026-12-05)."""
    monkeypatch.setattr(ba_kernels, "_PACKED_ROPE", packed)
    with common.forced_config({"block_attention_fwd": (4, 2, 0, 0, 1), "block_attention_bwd": (4, 1, 1, 0, 1)}):
        _check(LENGTHS_GPU[0], 64, rope_kind, "cuda", torch.bfloat16, heads=4, dim=128, seed=seed, factor=2.0,
               elementwise=True)


@pytest.mark.gpu
def test_rope_base_and_fp16_gpu():
    _check(LENGTHS_GPU[1], 64, "base", "cuda", torch.bfloat16, heads=4, dim=128, factor=2.0)
    _check(LENGTHS_GPU[0], 64, "tables", "cuda", torch.float16, heads=2, dim=64, factor=2.0)


@pytest.mark.gpu
@pytest.mark.parametrize("bwd_cfg", [(4, 2, 1), (4, 2, 0), *ba_kernels._HOPPER_BWD_CANDIDATES[:1]])
def test_backward_is_deterministic_gpu(bwd_cfg):
    if common.config_field(bwd_cfg, 5) and torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("the Gluon backward needs an sm_90+ GPU")
    with common.forced_config({"block_attention_fwd": (4, 2, 0), "block_attention_bwd": bwd_cfg}):
        off, q, k, v, grad = _inputs(LENGTHS_GPU[1], 4, 128, "cuda", torch.bfloat16, 3)
        a = _run("triton", q, k, v, off, 1000, 64, BASE, grad)
        b = _run("triton", q, k, v, off, 1000, 64, BASE, grad)
    for x, y in zip(a, b):
        assert torch.equal(x, y)


@pytest.mark.gpu
def test_torch_compile_no_graph_break_gpu():
    _compile_check("cuda", torch.bfloat16, "inductor", "tables", rtol=2e-2, atol=1e-3)  # bf16 gradients
