"""Where does a training step spend its time? torch.profiler over a few steps of a recipe.

    python scripts/profile_step.py --recipe small_h200 [overrides...] [--steps 3] [--out DIR]

Prints the top operators by device (or CPU) time and writes a Chrome trace.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without install

from gemctl.config.compose import compose
from gemctl.config.validate import validate
from gemctl.data.loader import TrainLoader
from gemctl.train.trainer import Trainer


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--recipe")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--out", default="runs/profile", help="folder for the Chrome trace")
    ap.add_argument("--rows", type=int, default=30)
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    logging.getLogger("torch.fx._symbolic_trace").setLevel(logging.ERROR)
    cfg = compose(args.overrides, recipe=args.recipe)
    validate(cfg)
    trainer = Trainer(cfg)
    loader = TrainLoader(trainer.source, cfg.data, trainer.device)
    cuda = trainer.device.type == "cuda"
    for _ in range(args.warmup):
        trainer.train_step(next(loader))
    if cuda:
        torch.cuda.synchronize()
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    t0 = time.perf_counter()
    with torch.profiler.profile(activities=activities, record_shapes=True) as prof:
        for _ in range(args.steps):
            trainer.train_step(next(loader))
        if cuda:
            torch.cuda.synchronize()
    print(f"{args.steps} profiled steps: {(time.perf_counter() - t0) / args.steps * 1e3:.1f} ms/step (profiler on)")
    sort = "cuda_time_total" if cuda else "cpu_time_total"
    print(prof.key_averages().table(sort_by=sort, row_limit=args.rows, max_name_column_width=60))
    Path(args.out).mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(f"{args.out}/trace.json")
    print(f"Chrome trace: {args.out}/trace.json")
    loader.close()


if __name__ == "__main__":
    main()
