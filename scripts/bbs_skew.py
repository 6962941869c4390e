"""Straggler skew with and without Base Batch Shuffling, simulated from GEM-like lengths.

    python scripts/bbs_skew.py [--ranks 8 64 1024] [--local-batch 512] [--steps 30] [--out docs/bbs_skew.json]

For every step, each simulated rank's work is the model FLOPs of its local batch (gem_flops of the
`small` model on the rank's real lengths: GEMMs grow with tokens, attention with L^2); skew =
max / mean over ranks, averaged over steps. The same synthetic length law as training
(log-normal, sigma 0.8, ~0.32 fill of max_len, 2% empty histories). Also reports the padding
waste of a padded baseline (each rank's batch padded to its longest history), in tokens and in
attention pairs.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gemctl.config.compose import compose  # noqa: E402
from gemctl.data.shuffle import build_dealer  # noqa: E402
from gemctl.data.synthetic import SyntheticSource  # noqa: E402
from gemctl.metrics.flops import gem_flops  # noqa: E402


def simulate(world: int, local_batch: int, steps: int, kind: str, key: str, sub_batch: int, max_len: int):
    cfg = compose([f"data.batch_size={local_batch}", f"data.max_len={max_len}", "model=small",
                   f"shuffle={kind}", f"shuffle.key={key}", f"shuffle.sub_batch_size={sub_batch}"])
    dealer = build_dealer(cfg.shuffle, local_batch, world, 0)
    source = SyntheticSource(cfg.data, dealer)
    skews, tok_waste, attn_waste = [], [], []
    for step in range(steps):
        first = step * dealer.units_per_step
        lengths = [source.unit_lengths(first + i) for i in range(dealer.units_per_step)]
        plan = dealer.plan(lengths)  # every rank's units, as each rank computes it for itself
        works, tokens, padded_tokens, pairs, padded_pairs = [], 0, 0, 0, 0
        for units in plan:
            rank_lengths = torch.cat([lengths[u] for u in units])
            works.append(gem_flops(cfg.model, source.spec, rank_lengths).train_total)
            longest = int(rank_lengths.max())
            tokens += int(rank_lengths.sum())
            padded_tokens += longest * rank_lengths.numel()
            pairs += int((rank_lengths * rank_lengths).sum())
            padded_pairs += longest * longest * rank_lengths.numel()
        w = torch.tensor(works, dtype=torch.float64)
        skews.append(float(w.max() / w.mean()))
        tok_waste.append(1 - tokens / padded_tokens)
        attn_waste.append(1 - pairs / padded_pairs)
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    return {"skew": mean(skews), "skew_worst_step": max(skews), "padding_waste_tokens": mean(tok_waste),
            "padding_waste_attention": mean(attn_waste)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[8, 64, 1024])
    ap.add_argument("--local-batch", type=int, default=512)
    ap.add_argument("--sub-batch", type=int, default=128)
    ap.add_argument("--max-len", type=int, default=1000)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--key", default="tokens", choices=["tokens", "attention"])
    ap.add_argument("--out", default="bbs_skew.json")
    args = ap.parse_args()
    rows = []
    for world in args.ranks:
        t0 = time.time()
        off = simulate(world, args.local_batch, args.steps, "none", args.key, args.sub_batch, args.max_len)
        on = simulate(world, args.local_batch, args.steps, "bbs", args.key, args.sub_batch, args.max_len)
        cut = (off["skew"] - 1) / max(on["skew"] - 1, 1e-12)
        rows.append({"ranks": world, "without_bbs": off, "with_bbs": on, "excess_skew_cut": cut})
        print(f"{world:>5} ranks: skew {off['skew']:.4f} -> {on['skew']:.4f} (worst step {off['skew_worst_step']:.4f} -> "
              f"{on['skew_worst_step']:.4f}); excess cut {cut:.1f}x; padding waste tokens {off['padding_waste_tokens']:.1%}, "
              f"attention {off['padding_waste_attention']:.1%} ({time.time() - t0:.0f} s)", flush=True)
    meta = {"local_batch": args.local_batch, "sub_batch": args.sub_batch, "max_len": args.max_len,
            "steps": args.steps, "key": args.key, "work": "gem_flops(model=small).train_total per rank"}
    Path(args.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
