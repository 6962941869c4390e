"""`gemctl train -m a=1,2 b=x,y`: one run per combination of the sweep overrides (Hydra's sweep
syntax: comma lists, range(), choice()), one after another, each in its own run directory
under ``runs/<name>/multirun-<stamp>/<job>/``, and a comparison table at the end: printed, and
written to the sweep directory as sweep.json (jobs and table rows) and sweep.md (markdown).
The table has, per job, the swept values, NE and AUC of every task, step time, QPS and MFU.

A recipe may declare its sweep the Hydra way, under ``hydra.sweeper.params`` (key: sweep string);
``gemctl train --recipe R -m`` then runs it, and a key swept on the command line replaces the
recipe's sweep of that key.

Every combination is composed and validated before the first job starts, so a bad value in the
fourth job fails before anything runs.
"""

from __future__ import annotations

import itertools
import json
import time
from pathlib import Path

from hydra.core.override_parser.overrides_parser import OverridesParser
from rich.markup import escape

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


def recipe_sweep(recipe, overrides: list[str]) -> list[str]:
    """The recipe's ``hydra.sweeper.params`` as sweep overrides, minus the keys that the command
    line sets (swept or not): those win."""
    if recipe is None:
        return []
    import yaml

    from gemctl.config.compose import resolve_recipe

    raw = yaml.safe_load(resolve_recipe(recipe).read_text()) or {}
    params = ((raw.get("hydra") or {}).get("sweeper") or {}).get("params") or {}
    given = {o.get_key_element() for o in OverridesParser.create().parse_overrides(overrides)}
    return [f"{key}={value}" for key, value in params.items() if key not in given]


def run_sweep(overrides: list[str], recipe, console) -> int:
    from gemctl.config.compose import compose
    from gemctl.config.validate import validate

    overrides = recipe_sweep(recipe, overrides) + list(overrides)
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
        console.rule(escape(f"job {i}: {' '.join(_value_of(o, key=True) for o in job if o.split('=')[0] in keys)}"))
        code = _run_one(cfg, run_dir, console)
        summary = run_dir / "summary.json"
        row = {"job": i, "overrides": job, "exit_code": code, "run_dir": str(run_dir)}
        if code == 0 and summary.exists():
            data = json.loads(summary.read_text())
            row.update(eval=data["eval"], perf={k: data["perf"].get(k) for k in PERF_KEYS})
        results.append(row)
        write_tables(root, keys, results)
    # The markdown table, not a rich one: it never elides a number on a narrow console, and it is
    # the same text as sweep.md.
    console.print(markdown_table(keys, comparison_rows(keys, results)), markup=False, highlight=False, soft_wrap=True)
    console.print(f"comparison: {root / 'sweep.md'}, {root / 'sweep.json'}", markup=False, soft_wrap=True)
    return max(r["exit_code"] for r in results)


PERF_KEYS = ("step_time_ms", "qps", "model_tflops", "local_mfu", "e2e_mfu", "device")


def _value_of(override: str, key: bool = False) -> str:
    """The value of ``key=value`` (or the whole override, ``key``) without Hydra's escapes (it
    escapes ':' in swept list items: ``[window\\:256]``)."""
    text = override if key else override.split("=", 1)[1]
    return text.replace("\\", "")


def comparison_rows(keys: list[str], results: list[dict]) -> list[dict]:
    """One row per job: swept values, NE and AUC per task, step time, QPS, MFU (None if it failed)."""
    rows = []
    for r in results:
        values = {o.split("=", 1)[0]: _value_of(o) for o in r["overrides"]}
        row = {"job": r["job"], **{k: values.get(k, "") for k in keys}, "exit_code": r["exit_code"]}
        if "eval" in r:
            for task, metrics in r["eval"].items():
                if isinstance(metrics, dict):
                    row[f"{task}.ne"], row[f"{task}.auc"] = metrics.get("ne"), metrics.get("auc")
            perf = r["perf"]
            row["step_time_ms"], row["qps"] = perf.get("step_time_ms"), perf.get("qps")
            row["mfu"] = perf["local_mfu"] if perf.get("local_mfu") is not None else perf.get("e2e_mfu")
        rows.append(row)
    return rows


def _columns(keys: list[str], rows: list[dict]) -> list[str]:
    metric_cols = []
    for row in rows:
        for col in row:
            if col.endswith((".ne", ".auc")) and col not in metric_cols:
                metric_cols.append(col)
    return ["job", *keys, *metric_cols, "step_time_ms", "qps", "mfu"]


def _cell(col: str, value) -> str:
    if value is None or value == "":
        return "" if value == "" else "-"
    if col.endswith((".ne", ".auc")):
        return f"{value:.4f}"
    if col == "step_time_ms":
        return f"{value:.1f}"
    if col == "qps":
        return f"{value:,.0f}"
    if col == "mfu":
        return f"{100 * value:.2f}%"
    return str(value)


_HEADERS = {"step_time_ms": "step ms", "qps": "QPS", "mfu": "MFU"}


def _header(col: str) -> str:
    if col.endswith(".ne"):
        return f"{col[:-3]} NE"
    if col.endswith(".auc"):
        return f"{col[:-4]} AUC"
    return _HEADERS.get(col, col)


def _cells(keys: list[str], cols: list[str], row: dict) -> list[str]:
    """A row's cells; a failed job shows its keys and exit code only."""
    if row["exit_code"] == 0:
        return [_cell(c, row.get(c)) for c in cols]
    cells = [_cell(c, row.get(c, "")) if c == "job" or c in keys else "" for c in cols]
    cells[len(keys) + 1] = f"exit {row['exit_code']}"
    return cells


def markdown_table(keys: list[str], rows: list[dict]) -> str:
    cols = _columns(keys, rows)
    lines = ["| " + " | ".join(_header(c) for c in cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(_cells(keys, cols, row)) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def write_tables(root: Path, keys: list[str], results: list[dict]) -> None:
    """sweep.json (the jobs and the comparison rows) and sweep.md, rewritten after every job so
    an interrupted sweep keeps what it has."""
    rows = comparison_rows(keys, results)
    stamp = time.strftime("%Y-%m-%d %H:%M:%S")
    (root / "sweep.json").write_text(json.dumps({"keys": keys, "jobs": results, "table": rows, "updated": stamp},
                                                indent=1))
    (root / "sweep.md").write_text(f"# multirun {root.name}\n\nUpdated {stamp}. Step time and QPS: means over the "
                                   f"timed steps of each job (summary.json).\n\n" + markdown_table(keys, rows))


def _run_one(cfg, run_dir: Path, console) -> int:
    if cfg.launcher.kind == "torchrun":
        from gemctl.launch.torchrun import launch

        return launch(cfg, console, run_dir=run_dir)[0]
    from gemctl.train.trainer import train

    train(cfg, console=console, run_dir=str(run_dir))  # writes config.yaml, metrics, summary there
    return 0


def sweep_table(keys: list[str], results: list[dict]):
    from rich.table import Table

    rows = comparison_rows(keys, results)
    cols = _columns(keys, rows)
    table = Table(title="multirun")
    for col in cols:
        table.add_column(_header(col))
    for row in rows:
        table.add_row(*(escape(c) for c in _cells(keys, cols, row)))  # '[full]' is a value, not rich markup
    return table
