"""sm_90 ptxas figures of the block-attention backward variants of 2026-12-01 (each patch applied to d714d25).
ROOT=<tree with the patch> VARIANT=<pick|split|vat|packedbwd|earlycs|l2prefetch|ropel1> PYTHONPATH=<triton 3.6>
python3 2026-12-01_block_bwd_variants_ptxas.py"""
import os, re, subprocess, sys, tempfile, collections
ROOT = os.environ["ROOT"]
sys.path.insert(0, ROOT); sys.path.insert(0, ROOT + "/scripts")
import triton
from triton import knobs
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from check_kernels_build import _constexprs, _signature, _aligned_attrs
from gemctl.ops.triton import block_attention as ba
assert ba.__file__.startswith(ROOT)
T = GPUTarget("cuda", 90, 32)
io = {n: "*bf16" for n in ("Q", "K", "V", "O", "DO", "DK", "DV", "DQ")}
io.update(LSE="*fp32", COS="*fp16", SIN="*fp16", OFFSETS="*i64", WORK="*i32", qk_scale="fp32", scale="fp32")

def stat(consts, warps, cap=None, sass=False):
    fn = ba._block_attn_bwd
    consts = _constexprs(fn, io, dict(HEAD_DIM=128, BLOCK=64, **consts))
    consts["heads_per_program"] = 1
    attrs = _aligned_attrs(fn, io, consts)
    opts = {"num_warps": warps, "num_stages": 1}
    if cap: opts["maxnreg"] = cap
    src = ASTSource(fn=fn, signature=_signature(fn, io, consts), constexprs=consts, attrs=attrs)
    c = triton.compile(src, target=T, options=opts)
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as ptx:
        ptx.write(c.asm["ptx"]); ptx.flush()
        cmd = [knobs.nvidia.ptxas.path, "-v", "--gpu-name=sm_90a", ptx.name, "-o", os.devnull]
        out = subprocess.run(cmd + ([f"--maxrregcount={cap}"] if cap else []), capture_output=True, text=True).stderr
    regs = re.search(r"Used (\d+) registers", out).group(1)
    spill = re.search(r"(\d+) bytes spill stores", out)
    line = f"{regs} registers, {spill.group(1) if spill else 0} B spill stores, {c.metadata.shared} B shared"
    if sass:
        with tempfile.NamedTemporaryFile("wb", suffix=".cubin") as cb:
            cb.write(c.asm["cubin"]); cb.flush()
            nvdisasm = os.path.join(os.path.dirname(knobs.nvidia.ptxas.path), "nvdisasm")
            text = subprocess.run([nvdisasm, "-c", cb.name], capture_output=True, text=True).stdout
        pat = re.compile(r"\s+/\*[0-9a-f]{4}\*/")
        count = sum(1 for ln in text.splitlines() if pat.match(ln))
        line += f", {count} SASS instructions"
    return line

V = os.environ["VARIANT"]
runs = {
    "pick": [(dict(ROPE=1, HALVES=True), 4, None, True)],
    "split": [(dict(ROPE=2, HALVES=halves, SPLIT=True), warps, cap, False)
              for halves, warps, cap in ((True, 4, None), (True, 4, 168), (True, 8, None), (True, 8, 128),
                                         (False, 4, None), (False, 8, None))],
    "vat": [(dict(ROPE=1, HALVES=True, V_AT=1), 4, None, False), (dict(ROPE=1, HALVES=True, V_AT=2), 4, None, False)],
    "packedbwd": [(dict(ROPE=2, HALVES=True), 4, None, True),
                  (dict(ROPE=2, HALVES=True, PACKED_GRAD=True), 4, None, False)],
    "earlycs": [(dict(ROPE=1, HALVES=True, EARLY_CS=e), 4, None, False) for e in (3, 4, 1)],
    "l2prefetch": [(dict(ROPE=1, HALVES=True, AHEAD=3), 4, None, False)],
    "ropel1": [(dict(ROPE=1, HALVES=True, ROWS_SUM=r), 4, cap, False) for r in (9, 1) for cap in (None, 168)],
}[V]
for consts, warps, cap, sass in runs:
    capped = f" maxnreg={cap}" if cap else ""
    print(f"{V:11s} {consts} warps={warps}{capped}: {stat(consts, warps, cap, sass)}", flush=True)
