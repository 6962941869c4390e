"""`gemctl train -m a=1,2 b=x,y`: one run per combination of the sweep overrides (Hydra's sweep
syntax: comma lists, range(), choice()), one after another, each in its own run directory
under ``runs/<name>/multirun-<stamp>/<job>/``, and a comparison table at the end: printed, and
written to the sweep directory as sweep.json (jobs and table rows) and sweep.md (markdown).
The table has, per job, the swept values, NE and AUC of every task, step time, QPS and MFU, and
the largest gradient norm before clipping with the number of clipped steps (training stability).
When more than one setting is swept over seeds (``train.seed``), a second table compares the
settings: per setting the mean ± std of each task's NE over its seeds, the difference from the
first setting (the baseline, e.g. ``precision=bf16,fp8``: bf16) against the neutrality bar
max(0.1% of the baseline's mean NE, 2 std of the baseline's seeds), the mean ± std of the per-seed
(paired) differences where both settings ran the same seeds, AUC and step time.

A recipe may declare its sweep the Hydra way, under ``hydra.sweeper.params`` (key: sweep string);
``gemctl train --recipe R -m`` then runs it, and a key swept on the command line replaces the
recipe's sweep of that key.

Every combination is composed and validated before the first job starts, so a bad value in the
fourth job fails before anything runs.
"""

from __future__ import annotations

import itertools
import json
import math
import time
import traceback
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

    try:
        raw = yaml.safe_load(resolve_recipe(recipe).read_text()) or {}
    except yaml.YAMLError:
        return []  # composing the recipe reports it, with its file and line
    sweeper = (raw.get("hydra") or {}).get("sweeper") if isinstance(raw, dict) else None
    params = (sweeper.get("params") if isinstance(sweeper, dict) else None) or {}
    if not isinstance(params, dict):
        return []
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
    root = RunDir.create(cfgs[0].run.output_dir, cfgs[0].run.name, prefix="multirun-").path
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
            row.update(eval=data["eval"], perf={k: data["perf"].get(k) for k in PERF_KEYS},
                       provenance=data.get("provenance"), grad_norm=data.get("grad_norm"))
        results.append(row)
        rows, groups = write_tables(root, keys, results, recipe)
    print_tables(console, keys, rows, groups)
    console.print(f"comparison: {root / 'sweep.md'}, {root / 'sweep.json'}", markup=False, soft_wrap=True)
    return max(r["exit_code"] for r in results)


def print_tables(console, keys: list[str], rows: list[dict], groups: list[dict]) -> None:
    """The per-job table and, where there is one, the per-setting summary: the markdown tables, not
    rich ones (they never elide a number on a narrow console, and they are sweep.md's text)."""
    console.print(markdown_table(keys, rows), markup=False, highlight=False, soft_wrap=True)
    if groups:
        console.print(summary_markdown(keys, groups), markup=False, highlight=False, soft_wrap=True)


PERF_KEYS = ("step_time_ms", "qps", "model_tflops", "local_mfu", "e2e_mfu", "device", "peak_memory_gib", "hfu",
             "activation_checkpoint")


def _value_of(override: str, key: bool = False) -> str:
    """The value of ``key=value`` (or the whole override, ``key``) without Hydra's escapes (it
    escapes ':' in swept list items: ``[window\\:256]``)."""
    text = override if key else override.split("=", 1)[1]
    return text.replace("\\", "")


def comparison_rows(keys: list[str], results: list[dict]) -> list[dict]:
    """One row per job: swept values, NE and AUC per task, step time, QPS, MFU (None if it failed),
    and, where the job recorded them, its largest gradient norm before clipping and how many steps
    the clip scaled down (a recipe that trains with spikes shows there)."""
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
            if perf.get("peak_memory_gib") is not None:  # CUDA runs
                row["peak_memory_gib"] = perf["peak_memory_gib"]
            if perf.get("activation_checkpoint") not in (None, "none"):  # None under budget: not known
                row["hfu"] = perf.get("hfu")
            if r.get("grad_norm"):  # absent in sweeps from before it was recorded, empty without clipping
                row["grad_norm_max"] = r["grad_norm"].get("grad_norm_max")
                row["clipped_steps"] = r["grad_norm"].get("clipped_steps")
                if r["grad_norm"].get("nonfinite_norm_steps"):
                    row["clipped_steps"] = f"{row['clipped_steps']} (+{r['grad_norm']['nonfinite_norm_steps']} non-finite)"
        rows.append(row)
    return rows


def _columns(keys: list[str], rows: list[dict]) -> list[str]:
    metric_cols = []
    for row in rows:
        for col in row:
            if col.endswith((".ne", ".auc")) and col not in metric_cols:
                metric_cols.append(col)
    extra = [c for c in ("hfu", "peak_memory_gib", "grad_norm_max", "clipped_steps") if any(c in row for row in rows)]
    return ["job", *keys, *metric_cols, "step_time_ms", "qps", "mfu", *extra]


def _cell(col: str, value) -> str:
    if value is None or value == "":
        return "" if value == "" else "-"
    if col.endswith((".ne", ".auc")):
        return f"{value:.4f}"
    if col == "step_time_ms":
        return f"{value:.1f}"
    if col == "qps":
        return f"{value:,.0f}"
    if col in ("mfu", "hfu"):
        return f"{100 * value:.2f}%"
    if col == "peak_memory_gib":
        return f"{value:.1f} GiB"
    if col == "grad_norm_max":
        return f"{value:.3g}"
    return str(value)


_HEADERS = {"step_time_ms": "step ms", "qps": "QPS", "mfu": "MFU", "hfu": "HFU", "peak_memory_gib": "peak memory",
            "grad_norm_max": "max grad norm", "clipped_steps": "clipped steps"}


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


SEED_KEY = "train.seed"
NE_BAR_REL = 0.001  # neutrality bar: max(0.1% of the baseline's mean NE, 2 std of its seeds)


def _finite(value) -> bool:
    return value is not None and math.isfinite(value)


def _mean_std(values: list[float]) -> tuple[float, float | None]:
    mean = sum(values) / len(values)
    if len(values) < 2:
        return mean, None
    return mean, (sum((v - mean) ** 2 for v in values) / (len(values) - 1)) ** 0.5


def summary_rows(keys: list[str], rows: list[dict]) -> list[dict]:
    """Settings (the swept values other than the seed) compared over their seeds; empty unless
    at least two settings ran. The first setting is the baseline. Per task: NE mean, std, the
    relative difference from the baseline, the bar, the verdict (neutral when |difference| < bar,
    else worse / better: lower NE is better) and, over the seeds both ran, the paired differences'
    mean and std; AUC mean; step time mean and the baseline's step time over it (speed-up). With
    one baseline seed there is no spread to judge by: the bar is None and the verdict "unknown"."""
    setting_keys = [k for k in keys if k != SEED_KEY]
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        if row["exit_code"] == 0:
            groups.setdefault(tuple(row[k] for k in setting_keys), []).append(row)
    first = tuple(rows[0][k] for k in setting_keys) if rows else None
    if len(groups) < 2 or first not in groups:  # no baseline (every job of the first setting failed)
        return []
    groups = {first: groups.pop(first), **groups}  # the baseline's row first
    base_jobs = groups[first]
    baselines = {}  # task -> (mean, bar, NE by seed) of the baseline setting
    for task in (c[:-3] for c in _columns(keys, rows) if c.endswith(".ne")):
        base = [j[f"{task}.ne"] for j in base_jobs if _finite(j.get(f"{task}.ne"))]
        if base:  # NE undefined (e.g. one class in the eval labels): no verdict
            base_mean, base_std = _mean_std(base)
            # One baseline seed has no spread: the bar's second term is unknown, so no verdict is given.
            bar = max(NE_BAR_REL * base_mean, 2 * base_std) if base_std is not None else None
            by_seed = {j.get(SEED_KEY): j[f"{task}.ne"] for j in base_jobs if _finite(j.get(f"{task}.ne"))}
            baselines[task] = base_mean, bar, by_seed
    base_steps = [j["step_time_ms"] for j in base_jobs if j.get("step_time_ms")]
    base_step = _mean_std(base_steps)[0] if base_steps else None
    out = []
    for values, jobs in groups.items():
        g = {**dict(zip(setting_keys, values)), "n": len(jobs), "seeds": [j.get(SEED_KEY, "") for j in jobs]}
        for task, (base_mean, bar, by_seed) in baselines.items():
            ne = [j[f"{task}.ne"] for j in jobs if _finite(j.get(f"{task}.ne"))]
            if not ne:
                continue
            mean, std = _mean_std(ne)
            diff = mean - base_mean
            g[f"{task}.ne_mean"], g[f"{task}.ne_std"] = mean, std
            g[f"{task}.ne_diff_rel"], g[f"{task}.ne_bar"] = diff / base_mean, bar
            g[f"{task}.verdict"] = ("unknown" if bar is None else "neutral" if abs(diff) < bar
                                    else "worse" if diff > 0 else "better")
            paired = [j[f"{task}.ne"] - by_seed[j.get(SEED_KEY)] for j in jobs
                      if j.get(SEED_KEY, "") != "" and j.get(SEED_KEY) in by_seed and _finite(j.get(f"{task}.ne"))]
            if paired:
                g[f"{task}.paired_mean"], g[f"{task}.paired_std"] = _mean_std(paired)
            auc = [j[f"{task}.auc"] for j in jobs if j.get(f"{task}.auc") is not None]
            if auc:
                g[f"{task}.auc_mean"] = _mean_std(auc)[0]
        steps = [j["step_time_ms"] for j in jobs if j.get("step_time_ms")]
        if steps and base_step:
            g["step_time_ms"] = _mean_std(steps)[0]
            g["speedup"] = base_step / g["step_time_ms"]
        out.append(g)
    return out


def _pm(mean: float, std: float | None, digits: int = 4) -> str:
    return f"{mean:.{digits}f}" + (f" ± {std:.{digits}f}" if std is not None else "")


def summary_markdown(keys: list[str], groups: list[dict]) -> str:
    setting_keys = [k for k in keys if k != SEED_KEY]
    tasks = [c[:-8] for c in groups[0] if c.endswith(".ne_mean")]
    header = [*setting_keys, "runs"]
    for task in tasks:
        header += [f"{task} NE", f"{task} NE vs first", f"{task} paired diff", f"{task} AUC"]
    header += ["step ms", "speed-up"]
    lines = [f"Settings over seeds; first row = baseline; NE neutral when |mean difference| < "
             f"max({100 * NE_BAR_REL:.1f}% of the baseline mean, 2 std of its seeds).", "",
             "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for i, g in enumerate(groups):
        cells = [str(g[k]) for k in setting_keys] + [str(g["n"])]
        for task in tasks:
            if f"{task}.ne_mean" not in g:
                cells += ["-", "-", "-", "-"]
                continue
            cells.append(_pm(g[f"{task}.ne_mean"], g[f"{task}.ne_std"]))
            if i == 0:
                bar = g[f"{task}.ne_bar"]
                cells.append("no bar (1 seed)" if bar is None else f"bar {bar:.4f}")
            else:
                verdict = g[f"{task}.verdict"]
                cells.append(f"{100 * g[f'{task}.ne_diff_rel']:+.2f}% "
                             + ("(no verdict: 1 baseline seed)" if verdict == "unknown" else verdict))
            cells.append(_pm(g[f"{task}.paired_mean"], g.get(f"{task}.paired_std"))
                         if i > 0 and f"{task}.paired_mean" in g else "-")
            cells.append(f"{g[f'{task}.auc_mean']:.4f}" if f"{task}.auc_mean" in g else "-")
        cells += [f"{g['step_time_ms']:.1f}" if "step_time_ms" in g else "-",
                  f"{g['speedup']:.2f}x" if "speedup" in g else "-"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def write_tables(root: Path, keys: list[str], results: list[dict], recipe=None) -> tuple[list[dict], list[dict]]:
    """sweep.json (the recipe, the jobs, the comparison rows and the per-setting summary) and sweep.md,
    rewritten after every job so an interrupted sweep keeps what it has; returns the rows and the
    summary."""
    rows = comparison_rows(keys, results)
    groups = summary_rows(keys, rows)
    stamp = time.strftime("%Y-%m-%d %H:%M:%S")
    (root / "sweep.json").write_text(json.dumps({"recipe": str(recipe) if recipe else None, "keys": keys, "jobs": results,
                                                 "table": rows, "summary": groups, "updated": stamp}, indent=1))
    md = (f"# multirun {root.name}\n\nUpdated {stamp}. Step time and QPS: means over the timed steps of each job "
          f"(summary.json).\n\n" + markdown_table(keys, rows))
    if groups:
        md += "\n" + summary_markdown(keys, groups)
    (root / "sweep.md").write_text(md)
    return rows, groups


def _run_one(cfg, run_dir: Path, console) -> int:
    from gemctl.errors import UserError, report_error

    # A failed job is recorded with its exit code and the sweep goes on (torchrun's own exit code,
    # or the user error the launcher found before starting it, e.g. a train.resume of nothing).
    try:
        if cfg.launcher.kind == "torchrun":
            from gemctl.launch.torchrun import launch

            return launch(cfg, console, run_dir=run_dir)[0]
        from gemctl.train.trainer import train

        train(cfg, console=console, run_dir=str(run_dir))  # writes config.yaml, metrics, summary there
    except UserError as exc:
        return report_error(exc)
    except Exception:  # a crash: its traceback, exit code 1
        traceback.print_exc()
        return 1
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


def _load_sweep(path: Path) -> tuple[list[dict], str | None]:
    """The jobs of one multirun and its recipe (None where the sweep did not record one): its
    sweep.json, or the multirun directory holding it."""
    from gemctl.errors import UserError

    if not path.exists():
        raise UserError(f"gemctl compare: {path}: no such file or directory (give a multirun directory or its sweep.json)")
    file = path / "sweep.json" if path.is_dir() else path
    try:
        text = file.read_text()
    except FileNotFoundError:
        raise UserError(f"gemctl compare: {file}: no such file (give a multirun directory or its sweep.json)") from None
    except OSError as err:
        raise UserError(f"gemctl compare: {file}: cannot be read ({err.strerror or err})") from None
    try:
        data = json.loads(text)
        jobs = data["jobs"]
        ok = isinstance(jobs, list) and all(
            isinstance(j, dict) and isinstance(j.get("overrides"), list) and all(isinstance(o, str) for o in j["overrides"])
            and isinstance(j.get("exit_code"), int) and ("eval" not in j or isinstance(j.get("perf"), dict))
            for j in jobs)
    except (ValueError, KeyError, TypeError):
        ok = False
    if not ok:
        raise UserError(f"gemctl compare: {file}: not the sweep.json of a gemctl multirun")
    return jobs, data.get("recipe")


def _run_names(paths: list[Path]) -> list[str]:
    """A short distinct name per run: its directory's (the file's own where it is not a
    sweep.json), with parent directories added until the names differ."""
    full = [(p if p.is_dir() else p.parent if p.name == "sweep.json" else p.with_suffix("")).resolve() for p in paths]
    for depth in range(1, max(len(f.parts) for f in full) + 1):
        names = ["/".join(f.parts[-depth:]) for f in full]
        if len(set(names)) == len(names):
            return names
    return [str(f) for f in full]


def _ok(job: dict) -> bool:
    return job["exit_code"] == 0 and "eval" in job


def merge_sweeps(paths: list[Path], baseline: str | None = None) -> tuple[list[str], list[dict], list[dict]]:
    """Several multiruns compared as one: ``(keys, rows, summary)`` as a single multirun's tables.

    A job's setting is its recipe (where its sweep recorded one) and its overrides other than the
    seed, less those every merged job shares (so ``precision=bf16`` from one run and
    ``precision=fp8_mlp precision.fp8.wgrad=bf16`` from another read as such), unless that would
    leave a job without any: then every setting is its whole list. A later run that repeats a
    seed an earlier run already has for the same setting (a successful job of each) is kept apart
    as a whole: its jobs of that setting are suffixed with the run's name, never merged; a run
    that fills in seeds the others lack (a failed job rerun) joins the setting. The baseline is the
    first job's setting, or the one that ``baseline`` names: the whole setting, one of its
    overrides (``precision=bf16``), or, where that is unambiguous, one of their values (``bf16``)."""
    return _merge(_load_runs(paths), baseline)


def _load_runs(paths: list[Path]) -> list[dict]:
    """The jobs of the multiruns, each with its run's name (``source``, also in its ``job`` id) and
    its recipe as a first override where the sweep recorded one; a run given twice is refused."""
    from gemctl.errors import UserError

    resolved = [(p / "sweep.json" if p.is_dir() else p).resolve() for p in paths]
    twice = next((p for i, p in enumerate(paths) if resolved[i] in resolved[:i]), None)
    if twice is not None:
        raise UserError(f"gemctl compare: {twice}: given twice (its jobs would count twice)")
    results = []
    for path, name in zip(paths, _run_names(paths)):
        jobs, recipe = _load_sweep(path)
        for job in jobs:
            overrides = ([f"recipe={Path(recipe).stem}"] if recipe else []) + list(job["overrides"])
            results.append({**job, "overrides": overrides, "job": f"{name}/{job.get('job', '?')}", "source": name})
    if not results:
        raise UserError("gemctl compare: the multiruns given hold no jobs")
    return results


def _merge(results: list[dict], baseline: str | None) -> tuple[list[str], list[dict], list[dict]]:
    """merge_sweeps on jobs already loaded (their overrides are rewritten to setting and seed)."""
    from gemctl.errors import UserError

    def is_seed(o: str) -> bool:
        return o.split("=", 1)[0] == SEED_KEY

    def rest(job):
        return [o for o in job["overrides"] if not is_seed(o)]

    shared = set(rest(results[0])).intersection(*(set(rest(j)) for j in results[1:]))
    if any(set(rest(j)) <= shared for j in results):
        shared = set()  # some job would have no name left
    for job in results:
        job["setting"] = " ".join(_value_of(o, key=True) for o in rest(job) if o not in shared) or "(no overrides)"
        job["seed"] = next((_value_of(o) for o in job["overrides"] if is_seed(o)), "")
    seeds: dict[str, set] = {}  # setting -> seeds with a successful job so far
    for source in dict.fromkeys(j["source"] for j in results):
        mine = [j for j in results if j["source"] == source]
        for setting in dict.fromkeys(j["setting"] for j in mine):
            jobs = [j for j in mine if j["setting"] == setting]
            new = {j["seed"] for j in jobs if _ok(j)}
            if new & seeds.get(setting, set()):
                for j in jobs:
                    j["setting"] = f"{setting} [{source}]"
            else:
                seeds.setdefault(setting, set()).update(new)
    for job in results:
        job["overrides"] = [f"setting={job['setting']}", *(o for o in job["overrides"] if is_seed(o))]
    keys = ["setting", SEED_KEY] if any(j["seed"] != "" for j in results) else ["setting"]
    rows = comparison_rows(keys, results)
    if baseline is not None:
        settings = list(dict.fromkeys(r["setting"] for r in rows))
        named = ([s for s in settings if s == baseline] or [s for s in settings if baseline in s.split(" ")]
                 or [s for s in settings if baseline in (t.split("=", 1)[-1] for t in s.split(" "))])
        if len(named) != 1:
            raise UserError(f"gemctl compare: --baseline {baseline}: "
                            + ("names no setting" if not named else "names more than one setting")
                            + "; settings: " + "; ".join(named or settings))
        chosen = named[0]
        rows = [r for r in rows if r["setting"] == chosen] + [r for r in rows if r["setting"] != chosen]
    return keys, rows, summary_rows(keys, rows)


def code_stacks(jobs: list[dict]) -> dict[str, int]:
    """Jobs per (commit, torch, Triton) (summary.json's provenance), and those that did not record
    it (runs older than the record) as one more entry."""
    stacks: dict[str, int] = {}
    for job in jobs:
        p = job.get("provenance")
        stack = f"commit {p.get('commit')}, torch {p.get('torch')}, triton {p.get('triton')}" if p else "no provenance recorded"
        stacks[stack] = stacks.get(stack, 0) + 1
    return stacks


def compare(paths: list[Path], baseline: str | None, out: Path | None, console) -> int:
    """`gemctl compare RUN...`: the tables of a multirun over the jobs of several."""
    from gemctl.errors import UserError

    if out is not None and (out.is_dir() or not out.parent.is_dir()):
        raise UserError(f"gemctl compare: --out {out}: " + ("a directory; give a file path" if out.is_dir() else
                                                            f"{out.parent} is not a directory"))
    results = _load_runs(paths)
    stacks = code_stacks(results)
    keys, rows, groups = _merge(results, baseline)
    console.print(f"compare: {len(rows)} jobs from {len(paths)} multiruns: {', '.join(str(p) for p in paths)}",
                  markup=False, soft_wrap=True)
    if len(stacks) > 1:
        console.print("note: the jobs ran on different code or libraries (" + "; ".join(
            f"{stack}: {n} jobs" for stack, n in stacks.items()) + "); deterministic runs repeat only on the same "
            "code and kernel configs", markup=False, soft_wrap=True)
    print_tables(console, keys, rows, groups)
    if not groups:
        console.print("one setting only (or no baseline job ran): nothing to compare over seeds", markup=False)
    if out is not None:
        out.write_text(json.dumps({"sources": [str(p) for p in paths], "keys": keys, "table": rows,
                                   "summary": groups}, indent=1))
        console.print(f"comparison: {out}", markup=False, soft_wrap=True)
    return 0
