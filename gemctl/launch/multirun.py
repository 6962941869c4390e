"""`gemctl train -m a=1,2 b=x,y`: one run per combination of the sweep overrides (Hydra's sweep
syntax: comma lists, range(), choice()), one after another, each in its own run directory
under ``runs/<name>/multirun-<stamp>/<job>/``, and a sweep table (sweep.json) at the end.

Every combination is composed and validated before the first job starts, so a bad value in the
fourth job fails before anything runs.
"""

from __future__ import annotations

import itertools
import json
import time
from pathlib import Path

from hydra.core.override_parser.overrides_parser import OverridesParser
from gemctl.errors import ConfigError
from gemctl.metrics.sinks import RunDir


def expand(overrides: list[str]) -> list[list[str]]:
    """Every combination of the sweep overrides, with the plain overrides in each."""
    parsed = OverridesParser.create().parse_overrides(overrides)
    axes = []
    for o in parsed:
        if o.is_sweep_override():
            key = o.get_key_element()
            axes.append([f"{key}={v}" for v in o.sweep_string_iterator()])
        else:
            axes.append([o.input_line])
    return [list(combo) for combo in itertools.product(*axes)]


def sweep_keys(overrides: list[str]) -> list[str]:
    return [o.get_key_element() for o in OverridesParser.create().parse_overrides(overrides) if o.is_sweep_override()]


def run_sweep(overrides: list[str], recipe, console) -> int:
    from gemctl.config.compose import compose
    from gemctl.config.validate import validate

    jobs = expand(overrides)
    keys = sweep_keys(overrides)
    cfgs = []
    for i, job in enumerate(jobs):
        try:
            cfg = compose(job, recipe=recipe)
            validate(cfg)
        except ConfigError as err:
            message = str(err)[len(err.field) + 2:]
            raise ConfigError(err.field, f"{message} (multirun job {i}: {' '.join(job)})") from None
        if cfg.launcher.kind == "slurm":
            raise ConfigError("launcher.kind", "a multirun runs its jobs here one after another; allowed: local, torchrun")
        cfgs.append(cfg)
    root = RunDir.create(cfgs[0].run.output_dir, cfgs[0].run.name).path
    root = root.rename(root.with_name("multirun-" + root.name))
    console.print(f"multirun: {len(jobs)} jobs over {', '.join(keys) or 'no sweep key'} -> {root}")
    results = []
    for i, (job, cfg) in enumerate(zip(jobs, cfgs)):
        run_dir = root / str(i)
        run_dir.mkdir()
        console.rule(f"job {i}: {' '.join(o for o in job if o.split('=')[0] in keys)}")
        code = _run_one(cfg, run_dir, console)
        summary = run_dir / "summary.json"
        row = {"job": i, "overrides": job, "exit_code": code, "run_dir": str(run_dir)}
        if code == 0 and summary.exists():
            data = json.loads(summary.read_text())
            row.update(eval=data["eval"], perf={k: data["perf"].get(k) for k in ("qps", "model_tflops", "local_mfu", "e2e_mfu", "step_time_ms")})
        results.append(row)
        (root / "sweep.json").write_text(json.dumps({"keys": keys, "jobs": results,
                                                     "updated": time.strftime("%Y-%m-%d %H:%M:%S")}, indent=1))
    console.print(sweep_table(keys, results))
    return max(r["exit_code"] for r in results)


def _run_one(cfg, run_dir: Path, console) -> int:
    if cfg.launcher.kind == "torchrun":
        from gemctl.launch.torchrun import launch

        return launch(cfg, console, run_dir=run_dir)[0]
    from gemctl.train.trainer import train

    train(cfg, console=console, run_dir=str(run_dir))  # writes config.yaml, metrics, summary there
    return 0


def sweep_table(keys: list[str], results: list[dict]):
    from rich.table import Table

    table = Table(title="multirun")
    for col in ["job", *keys, "NE (first task)", "AUC", "QPS", "MFU"]:
        table.add_column(col)
    for r in results:
        values = {o.split("=", 1)[0]: o.split("=", 1)[1] for o in r["overrides"]}
        if "eval" not in r:
            table.add_row(str(r["job"]), *[values.get(k, "") for k in keys], f"exit {r['exit_code']}", "", "", "")
            continue
        task = next(v for v in r["eval"].values() if isinstance(v, dict))
        mfu = r["perf"]["local_mfu"] if r["perf"]["local_mfu"] is not None else r["perf"]["e2e_mfu"]
        table.add_row(str(r["job"]), *[values.get(k, "") for k in keys], f"{task['ne']:.4f}", f"{task['auc']:.4f}",
                      f"{r['perf']['qps']:,.0f}", f"{100 * mfu:.2f}%")
    return table
