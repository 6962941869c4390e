"""Block-attention kernels on [N, H, D] views of row-major ([N, H, D]) vs head-major ([H, N, D]) storage: does the
backward's DRAM access pattern (256-byte runs strided by H * D * 2 bytes per program) hold it back?"""
import sys, torch
sys.path.insert(0, "scripts")
from bench_block_attention import kernel_times, ROPE_BASE, byte_counts, roofline_ms
from bench_jagged_attention import make_inputs
from bench_gdpa import ceilings
from gemctl import ops
from gemctl.ops.triton import block_attention as bk
from gemctl.ops.triton import common
from workloads import block_attention_workloads

copy = ceilings()["copy_tbps"]
print("copy TB/s", copy, flush=True)
forced = {"block_attention_fwd": (4, 2, 0, 0, 1), "block_attention_bwd": (4, 1, 1, 0, 1)}
for w in block_attention_workloads():
    q, k, v, off, _, _, _, grad = make_inputs(w)
    max_len = int(w.q_lengths.max())
    tables = bk.rope_tables(ROPE_BASE, max_len, q.shape[-1], q.device, ops.rope_table_dtype(q.dtype))
    counts = byte_counts(q.shape[0], w.heads, q.shape[-1])
    hm = lambda t: t.detach().transpose(0, 1).contiguous().transpose(0, 1)
    for name, (qq, kk, vv, gg) in {"row-major": (q, k, v, grad), "head-major": (hm(q), hm(k), hm(v), hm(grad))}.items():
        for cfg_bwd in ((4, 1, 1, 0, 1), (4, 1, 1)):
            forced["block_attention_bwd"] = cfg_bwd
            with common.forced_config(forced):
                t = kernel_times(qq, kk, vv, off, max_len, 64, tables, gg)
            fwd, bwd = t["fwd_kernel_ms"], t["bwd_kernel_ms"]
            fwd_pct = 100 * roofline_ms(counts["fwd_bytes"], copy) / fwd
            bwd_pct = 100 * roofline_ms(counts["bwd_bytes"], copy) / bwd
            print(f"{w.name} {name:10s} strides {tuple(qq.stride())} bwd {cfg_bwd}: "
                  f"fwd {fwd * 1e3:.1f} us ({fwd_pct:.1f}%), bwd {bwd * 1e3:.1f} us ({bwd_pct:.1f}%)", flush=True)
