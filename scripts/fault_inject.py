"""Kill random ranks of a torchrun job and prove the restarts cost nothing but time.

    python3 scripts/fault_inject.py --kills 3 [--nproc 2 --steps 24 --checkpoint-every 4 --seed 0]
                                    [--out report.json] [-- extra gemctl overrides]

1. Trains the job uninterrupted (the reference): `gemctl train launcher=torchrun` with the sample
   ledger on (train.sample_ledger=true: every rank logs every step's sample ids).
2. Trains it again with launcher.max_restarts=kills and, `kills` times in a row, SIGKILLs a random
   rank at a random step (read from the ledger as it grows, plus a random delay of up to 50 ms, so
   a kill may land in the middle of a checkpoint write). torchrun restarts the workers; each restart
   resumes from the newest complete checkpoint.
3. Reports: restarts, samples lost and duplicated in the history that produced the final model
   (gemctl.train.ledger.account: for every rank and step, the latest attempt's samples, compared
   with the reference's), steps whose samples differ, the final loss and eval NE/AUC of both runs,
   and whether the final checkpoints (model and optimizer) are bitwise equal.

CPU with gloo by default (`train.device=cpu`); the tiny model unless overridden. Exit code 0 when
nothing was lost, duplicated or changed, 1 otherwise.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

from gemctl.train import ledger

BASE = ["run.progress=false", "train.device=cpu", "train.log_every=1", "train.warmup_timing_steps=1",
        "train.sample_ledger=true", "train.keep_last=0", "parallel=fsdp", "shuffle=bbs", "shuffle.sub_batch_size=8",
        "data.batch_size=8", "data.synthetic.eval_samples=64", "data.eval_batch_size=64"]


def _command(out: Path, nproc: int, steps: int, every: int, restarts: int, extra: list[str]) -> list[str]:
    return [sys.executable, "-m", "gemctl", "train", "launcher=torchrun", f"launcher.nproc_per_node={nproc}",
            f"launcher.max_restarts={restarts}", f"run.output_dir={out}", f"train.steps={steps}",
            f"train.checkpoint_every={every}", *BASE, *extra]


def _env() -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    env.pop("TRITON_INTERPRET", None)
    return env


def _run_dir(out: Path, timeout: float = 120.0) -> Path:
    t0 = time.time()
    while time.time() - t0 < timeout:
        found = glob.glob(str(out / "*" / "*" / "config.yaml"))
        if found:
            return Path(found[0]).parent
        time.sleep(0.05)
    raise TimeoutError(f"no run directory appeared under {out}")


def _progress(run_dir: Path, attempt: int) -> dict[int, tuple[int, int]]:
    """rank -> (last step, pid) trained in ``attempt`` so far."""
    out = {}
    for rank, lines in ledger.read(run_dir).items():
        mine = [rec for rec in lines if rec["attempt"] == attempt]
        if mine:
            out[rank] = (mine[-1]["step"], mine[-1]["pid"])
    return out


def _last_records(run_dir: Path) -> dict[int, dict]:
    """step -> the latest train record of that step in metrics.jsonl (a restart appends again)."""
    out = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if rec.get("kind") == "train":
            out[rec["step"]] = rec
    return out


def _final_state(run_dir: Path, steps: int) -> dict:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    target = run_dir / f"final-step-{steps}.pt"
    dcp_to_torch_save(str(run_dir / "checkpoints" / f"step-{steps:08d}"), str(target))
    return torch.load(target, weights_only=True)


def _flatten(tree, prefix=""):
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from _flatten(v, f"{prefix}.{k}" if prefix else str(k))
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            yield from _flatten(v, f"{prefix}.{i}")
    else:
        yield prefix, tree


def _states_equal(a: dict, b: dict) -> tuple[bool, list[str]]:
    fa, fb = dict(_flatten(a)), dict(_flatten(b))
    differ = sorted(set(fa) ^ set(fb))
    for key in set(fa) & set(fb):
        x, y = fa[key], fb[key]
        same = torch.equal(x, y) if torch.is_tensor(x) and torch.is_tensor(y) else x == y
        if not same:
            differ.append(key)
    return not differ, differ


def run(workdir: Path, kills: int, nproc: int = 2, steps: int = 24, every: int = 4, seed: int = 0,
        extra: list[str] | None = None, say=print, timeout: float = 900.0) -> dict:
    """Reference run, faulty run with ``kills`` SIGKILLs, comparison; returns the report."""
    extra = list(extra or [])
    workdir = Path(workdir)
    if steps <= every or steps % every:
        raise ValueError("--steps must be a multiple of --checkpoint-every and larger (restarts resume from a "
                         "checkpoint; the final one is compared)")
    rng = random.Random(seed)
    t0 = time.time()
    say(f"reference: {steps} steps on {nproc} ranks, uninterrupted")
    ref = subprocess.run(_command(workdir / "reference", nproc, steps, every, 0, extra), env=_env(),
                         capture_output=True, text=True, timeout=timeout)
    if ref.returncode:
        raise RuntimeError("reference run failed:\n" + ref.stdout[-2000:] + ref.stderr[-2000:])
    ref_dir = _run_dir(workdir / "reference")
    t_ref = time.time() - t0

    say(f"faulty run: {kills} kill(s), launcher.max_restarts={kills}")
    log = open(workdir / "faulty.log", "w")
    proc = subprocess.Popen(_command(workdir / "faulty", nproc, steps, every, kills, extra), env=_env(),
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    events = []
    try:
        run_dir = _run_dir(workdir / "faulty")
        attempt = 0
        for kill in range(kills):
            # The attempt's first step: 1 on the first attempt, the resumed checkpoint's step + 1 later.
            while not _progress(run_dir, attempt) and proc.poll() is None:
                time.sleep(0.02)
            if proc.poll() is not None:
                raise RuntimeError(f"the job ended before kill {kill + 1}")
            first = min(step for step, _ in _progress(run_dir, attempt).values())
            target = rng.randint(first, max(first, steps - 2))
            victim = rng.randrange(nproc)
            while proc.poll() is None:
                seen = _progress(run_dir, attempt).get(victim)
                if seen and seen[0] >= target:
                    break
                time.sleep(0.01)
            if proc.poll() is not None:
                raise RuntimeError(f"the job ended before kill {kill + 1} (target step {target})")
            time.sleep(rng.uniform(0.0, 0.05))
            step, pid = _progress(run_dir, attempt)[victim]
            os.kill(pid, signal.SIGKILL)
            events.append({"attempt": attempt, "rank": victim, "pid": pid, "target_step": target,
                           "last_logged_step": _progress(run_dir, attempt)[victim][0]})
            say(f"  kill {kill + 1}: SIGKILL rank {victim} (pid {pid}) after step {events[-1]['last_logged_step']}")
            while proc.poll() is None:  # wait for a restarted attempt to train
                later = [rec["attempt"] for lines in ledger.read(run_dir).values() for rec in lines if rec["attempt"] > attempt]
                if later:
                    attempt = min(later)
                    break
                time.sleep(0.02)
        code = proc.wait(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()
    if code:
        raise RuntimeError(f"faulty run exited with {code}; log: {workdir / 'faulty.log'}\n"
                           + (workdir / "faulty.log").read_text()[-3000:])

    acc = ledger.account(run_dir, ref_dir)
    got, want = _last_records(run_dir), _last_records(ref_dir)
    losses_equal = [got[s]["loss"] for s in sorted(got)] == [want[s]["loss"] for s in sorted(want)]
    summary_got = json.loads((run_dir / "summary.json").read_text())
    summary_want = json.loads((ref_dir / "summary.json").read_text())
    state_equal, differ = _states_equal(_final_state(run_dir, steps), _final_state(ref_dir, steps))
    report = {
        "kills": events,
        "restarts": acc["attempts"] - 1,
        "steps": steps, "ranks": nproc, "checkpoint_every": every, "seed": seed,
        "samples_trained": acc["samples"],
        "samples_lost": acc["lost"],
        "samples_duplicated": acc["duplicated"],
        "steps_with_other_samples": len(acc["mismatched_steps"]),
        "final_loss": got[steps]["loss"], "reference_final_loss": want[steps]["loss"],
        "losses_equal": losses_equal,
        "eval_equal": summary_got["eval"] == summary_want["eval"],
        "final_state_equal": state_equal, "state_differences": differ[:10],
        "reference_s": round(t_ref, 1), "total_s": round(time.time() - t0, 1),
        "run_dir": str(run_dir), "reference_dir": str(ref_dir),
    }
    report["ok"] = bool(report["restarts"] == kills and not acc["lost"] and not acc["duplicated"]
                        and not acc["mismatched_steps"] and losses_equal and report["eval_equal"] and state_equal)
    return report


def _table(report: dict):
    from rich.table import Table

    t = Table(title=f"fault injection: {len(report['kills'])} SIGKILL(s), {report['ranks']} ranks, {report['steps']} steps")
    t.add_column("check")
    t.add_column("result", justify="right")
    for name, key in [("restarts", "restarts"), ("samples trained", "samples_trained"), ("samples lost", "samples_lost"),
                      ("samples duplicated", "samples_duplicated"), ("steps with other samples", "steps_with_other_samples"),
                      ("final loss", "final_loss"), ("reference final loss", "reference_final_loss"),
                      ("every step's loss equal", "losses_equal"), ("eval NE/AUC equal", "eval_equal"),
                      ("final model + optimizer bitwise equal", "final_state_equal"), ("wall time (s)", "total_s")]:
        t.add_row(name, str(report[key]))
    return t


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kills", type=int, default=3)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--checkpoint-every", type=int, default=4)
    p.add_argument("--seed", type=int, default=0, help="picks the steps and ranks to kill")
    p.add_argument("--workdir", default=None, help="default: a fresh directory under runs/fault_inject/")
    p.add_argument("--out", default=None, help="write the report as JSON here")
    p.add_argument("overrides", nargs="*", help="extra gemctl overrides (after --)")
    args = p.parse_args(argv)
    from rich.console import Console

    console = Console()
    workdir = Path(args.workdir or f"runs/fault_inject/{time.strftime('%Y%m%d-%H%M%S')}")
    workdir.mkdir(parents=True, exist_ok=True)
    report = run(workdir, args.kills, args.nproc, args.steps, args.checkpoint_every, args.seed, args.overrides,
                 say=console.print)
    console.print(_table(report))
    text = json.dumps(report, indent=1)
    (workdir / "report.json").write_text(text)
    if args.out:
        Path(args.out).write_text(text)
    console.print(f"report: {workdir / 'report.json'}; {'OK' if report['ok'] else 'FAILED'}")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
