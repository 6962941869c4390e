"""Probe (2026-12-07, not a kernel of gemctl): the column casts' whole-tile loop in Gluon with the
transpose done in registers. Each thread holds ROWS consecutive rows x 4 column pairs of the bf16
input read as int32 (one 16-byte load a row), widens the pair's low value by a shift and its high
value by a mask, and, in a layout whose registers run along the rows first (_rows_first: the same
elements in the same threads, so the conversion renames registers), quantizes and stores each
column's ROWS codes as one 8- or 16-byte vector into DATA_T [C, R]. No shared memory, no barrier.

    PYTHONPATH=<triton 3.6> python3 THIS.py ROWS LANES_R WARPS [plain]

prints the sm_90 SASS instructions an element of the loop, and ptxas's registers. Only the
whole-tile loop of fp8_gemm's column casts, given the columns' scales: no chunk scales, masks or
scale bytes."""
import os, re, subprocess, sys, collections, tempfile
sys.path.insert(0, "/work/main")
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
from gemctl.ops.triton.fp8_gemm import _quantize, _quantize_scaled, _silu_scaled


@gluon.constexpr_function
def _rows_first(rows, lanes_r, warps):
    """kern_g's load layout (BlockedLayout([rows, 4], [lanes_r, 32 // lanes_r], [warps, 1], [1, 0]))
    with each thread's registers ordered along the rows first: the same elements in the same
    threads, so the conversion is a renaming of registers."""
    lanes_c = 32 // lanes_r
    log = lambda n: n.bit_length() - 1
    reg = [[1 << i, 0] for i in range(log(rows))] + [[0, 1], [0, 2]]
    lane = [[0, 4 << i] for i in range(log(lanes_c))] + [[rows << i, 0] for i in range(log(lanes_r))]
    warp = [[rows * lanes_r << i, 0] for i in range(log(warps))]
    return gl.DistributedLinearLayout(reg, lane, warp, [], [rows * lanes_r * warps, 4 * lanes_c])


@gluon.jit
def kern_g(X, DT, S, NAN, R, stride_xr, stride_dt, ROWS: gl.constexpr, LANES_R: gl.constexpr,
           SILU: gl.constexpr):
    LANES_C: gl.constexpr = 32 // LANES_R
    L1: gl.constexpr = gl.BlockedLayout([ROWS, 4], [LANES_R, LANES_C], [gl.num_warps(), 1], [1, 0])
    L2: gl.constexpr = _rows_first(ROWS, LANES_R, gl.num_warps())
    BLOCK_R: gl.constexpr = ROWS * LANES_R * gl.num_warps()
    HALF: gl.constexpr = 4 * LANES_C
    jj = gl.program_id(0) * HALF + gl.arange(0, HALF, layout=gl.SliceLayout(0, L1))
    jjs = gl.program_id(0) * HALF + gl.arange(0, HALF, layout=gl.SliceLayout(0, L2))
    s0 = gl.load(S + 2 * jjs)
    s1 = gl.load(S + 2 * jjs + 1)
    n0 = gl.load(NAN + 2 * jjs) != 0
    n1 = gl.load(NAN + 2 * jjs + 1) != 0
    rows = gl.arange(0, BLOCK_R, layout=gl.SliceLayout(1, L1))
    jj2 = gl.program_id(0) * HALF + gl.arange(0, HALF, layout=gl.SliceLayout(0, L2))
    rows2 = gl.arange(0, BLOCK_R, layout=gl.SliceLayout(1, L2))
    xp = X + rows.to(gl.int64)[:, None] * stride_xr + jj[None, :]
    op = DT + (2 * jj2).to(gl.int64)[None, :] * stride_dt + rows2[:, None]
    step = BLOCK_R * stride_xr.to(gl.int64)
    for r0 in range(0, R, BLOCK_R):
        w = gl.convert_layout(gl.load(xp), L2)
        lo = (w << 16).to(gl.float32, bitcast=True)
        hi = (w & -65536).to(gl.float32, bitcast=True)
        if SILU:  # s: the columns' 2^shared (_silu_scaled)
            c0 = _quantize_scaled(_silu_scaled(lo, s0[None, :]), n0[None, :], False)
            c1 = _quantize_scaled(_silu_scaled(hi, s1[None, :]), n1[None, :], False)
        else:  # s: the columns' 2^-shared
            c0 = _quantize(lo, s0[None, :], n0[None, :], False)
            c1 = _quantize(hi, s1[None, :], n1[None, :], False)
        gl.store(op, c0)
        gl.store(op + stride_dt, c1)
        xp += step
        op += BLOCK_R


rows_pt, lanes_r, warps = (int(a) for a in sys.argv[1:4])
fn = kern_g
sig = {"X": "*i32", "DT": "*u8", "S": "*fp32", "NAN": "*u8", "R": "i32", "stride_xr": "i32", "stride_dt": "i32",
       "ROWS": "constexpr", "LANES_R": "constexpr", "SILU": "constexpr"}
names = list(fn.arg_names)
attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in ("X", "DT", "S", "NAN", "R", "stride_xr", "stride_dt")}
consts = {"ROWS": rows_pt, "LANES_R": lanes_r, "SILU": sys.argv[4:5] != ["plain"]}
src = GluonASTSource(fn, sig, consts, attrs)
c = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
open("/tmp/gluon_cols_probe.cubin", "wb").write(c.asm["cubin"])
from triton import knobs
nvd = os.path.join(os.path.dirname(knobs.nvidia.ptxas.path), "nvdisasm")
out = subprocess.run([nvd, "-c", "/tmp/gluon_cols_probe.cubin"], capture_output=True, text=True).stdout
open("/tmp/pp/g.sass", "w").write(out)
lines = out.splitlines()
pat = re.compile(r"\s+/\*([0-9a-f]{4})\*/\s+(@!?U?P\w+\s+)?([A-Z0-9_.]+)(.*)")
labels = {l[:-1]: i for i, l in enumerate(lines) if re.match(r"^\.L_x_\d+:", l)}
best = None
for i, l in enumerate(lines):
    m = re.search(r"BRA `\((\.L_x_\d+)\)", l)
    if m and m.group(1) in labels and labels[m.group(1)] < i:
        if best is None or i - labels[m.group(1)] > best[1] - best[0]:
            best = (labels[m.group(1)], i)
ops = collections.Counter(); n = 0
for l in lines[best[0]:best[1] + 1]:
    m = pat.match(l)
    if m:
        n += 1; ops[m.group(3).split(".")[0] + ("." + m.group(3).split(".")[-1] if m.group(3).startswith(("LDG", "STG")) else "")] += 1
per = rows_pt * 8
print(f"{'plain' if sys.argv[4:5] == ['plain'] else 'silu'} rows{rows_pt} lanes_r{lanes_r} w{warps}: loop {n} instr, {n / per:.2f}/elem, shared {c.metadata.shared}")
print("  " + "  ".join(f"{k} {v / per:.2f}" for k, v in ops.most_common(16)))
with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
    f.write(c.asm["ptx"]); f.flush()
    o = subprocess.run([knobs.nvidia.ptxas.path, "-v", "--gpu-name=sm_90a", f.name, "-o", os.devnull], capture_output=True, text=True).stderr
    print("  ", re.search(r"Used (\d+) registers", o).group(0), re.search(r"(\d+) bytes spill stores", o).group(0))
