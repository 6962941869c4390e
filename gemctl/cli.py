"""`gemctl` verbs. Thin: parse, compose, validate, hand over.

    gemctl train [--recipe NAME|FILE] [-m] [--dry-run] [overrides...]
    gemctl plan [--world N] [--json] [--recipe NAME|FILE] [overrides...]
    gemctl config show|validate [--recipe NAME|FILE] [overrides...]
    gemctl recipes [list] | show NAME | cp NAME DEST

Overrides are Hydra's: ``model=small train.steps=100 data.max_len=500``.
A bad config or bad input prints one line naming the field and exits with code 2.
"""

from __future__ import annotations

import argparse
import itertools
import os
import re
import shutil
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

from gemctl.errors import UserError, report_error


def _compose(args, check_device: bool = True):
    from gemctl.config.compose import compose
    from gemctl.config.validate import validate

    cfg = compose(args.overrides, recipe=args.recipe)
    # A Slurm job runs on other machines: this one needs no CUDA device to submit it.
    validate(cfg, check_device=check_device and cfg.launcher.kind != "slurm")
    return cfg


def cmd_train(args, console: Console) -> int:
    if args.multirun:
        if args.dry_run:
            raise UserError("--dry-run: not with -m (a multirun runs its jobs here)")
        from gemctl.launch.multirun import run_sweep

        return run_sweep(args.overrides, args.recipe, console)
    cfg = _compose(args)
    from gemctl.launch.multirun import recipe_sweep

    swept = [o.split("=", 1)[0] for o in recipe_sweep(args.recipe, args.overrides)]
    if swept:  # on stderr: stdout may be a job script (--dry-run)
        how = "a multirun runs on launcher=local or torchrun" if cfg.launcher.kind == "slurm" else "add -m to run it"
        print(f"gemctl: note: recipe {args.recipe} sweeps {', '.join(swept)}; this runs one job with their defaults "
              f"({how})", file=sys.stderr)
    if args.dry_run and cfg.launcher.kind != "slurm":
        raise UserError("--dry-run: only launcher=slurm has a job script to print")
    if cfg.launcher.kind == "slurm":
        from gemctl.launch import slurm

        return slurm.dry_run(cfg, console) if args.dry_run else slurm.submit(cfg, console)
    if cfg.launcher.kind == "torchrun":
        from gemctl.launch.torchrun import launch

        code, run_dir = launch(cfg, console)
        if code:
            console.print(f"torchrun exited with code {code}; run directory: {run_dir}")
        return code
    from gemctl.train.trainer import train

    result = train(cfg, console=console)
    print_results(console, cfg, result)
    return 0


def print_results(console: Console, cfg, result) -> None:
    """A run's summary table and where its files went (the paths never wrapped: a pipe gets 80
    columns); the in-process run and rank 0 of a torchrun job alike."""
    console.print(summary_table(cfg, result))
    console.print(f"results: {result.run_dir}/summary.json, metrics: {result.run_dir}/metrics.jsonl", markup=False,
                  soft_wrap=True)


def cmd_profile(args, console: Console) -> int:
    cfg = _compose(args)
    if cfg.launcher.kind == "slurm":
        raise UserError("gemctl profile: launcher=slurm is not supported; use launcher=local or torchrun")
    if cfg.launcher.kind == "torchrun":
        from gemctl.launch.torchrun import launch

        code, run_dir = launch(cfg, console, mode="profile")
        if code:
            console.print(f"torchrun exited with code {code}; run directory: {run_dir}")
        return code
    from gemctl.profile.runner import profile
    from gemctl.train.trainer import Trainer, prepare_process

    prepare_process()
    report = profile(Trainer(cfg, console=console), console=console)
    console.print(profile_table(report))
    if report.get("top_kernels"):
        console.print(kernels_table(report))
    if (report.get("idle_by_host") or {}).get("rows"):
        console.print(idle_table(report))
    console.print(f"profile: {report['run_dir']}/profile.json, trace.json, breakdown.png, waterfall.png")
    return 0


def profile_table(report: dict) -> Table:
    step = report["step_time_s"]
    table = Table(title=f"gemctl profile: {report['recipe']} on {report['device']} (peak {report['peak']})")
    table.add_column("where the step goes")
    table.add_column("ms / step", justify="right")
    table.add_column("share", justify="right")
    table.add_column("achieved TF/s", justify="right")
    accounted = report["accounted_s"]
    for name, seconds in report["categories_s"].items():
        tf = report["achieved_tflops"].get(name)
        table.add_row(name, f"{1e3 * seconds:.2f}", f"{100 * seconds / accounted:.1f}%", f"{tf:.1f}" if tf else "")
    table.add_row("host overhead (idle)", f"{1e3 * report['host_overhead_s']:.2f}", f"{100 * report['host_overhead_s'] / accounted:.1f}%", "")
    table.add_row("data stall", f"{1e3 * report['data_stall_s']:.2f}", f"{100 * report['data_stall_s'] / accounted:.1f}%", "")
    table.add_row("exposed communication", f"{1e3 * report['exposed_communication_s']:.2f}", "", "")
    table.add_row("straggler wait", f"{1e3 * report['straggler_wait_s']:.2f}", "", "")
    if report.get("setup_s_in_timed_steps"):
        table.add_row("kernel tuning/compiles (left out)", f"{1e3 * report['setup_s_in_timed_steps']:.2f} total", "", "")
    if report.get("ranks", 1) > 1:
        sk = report["straggler_skew"]
        table.add_row(f"skew over {report['ranks']} ranks (max/mean)", f"work {sk['work_time']:.3f}", f"FLOPs {sk['flops']:.3f}", "")
    table.add_section()
    table.add_row("accounted (profiled)", f"{1e3 * accounted:.2f}", "", "")
    table.add_row("measured step time", f"{1e3 * step:.2f}", "", "")
    table.add_row("Local MFU", f"{100 * report['local_mfu']:.2f}%", "", "")
    table.add_row("Scaling Ratio", f"{report['scaling_ratio']:.4f}", "", "")
    table.add_row("E2E MFU", f"{100 * report['e2e_mfu']:.2f}%", "", "")
    table.add_row("QPS", f"{report['qps']:,.1f}", "", "")
    table.add_row("peak memory", f"{report['peak_memory_gib']:.2f} GiB", "", "")
    return table


def _ranked_table(title: str, columns: tuple, rows) -> Table:
    """A table of named rows, most first: the name column left, the numbers right-aligned."""
    table = Table(title=title)
    table.add_column(columns[0])
    for column in columns[1:]:
        table.add_column(column, justify="right")
    for name, *cells in rows:
        table.add_row(name if len(name) <= 80 else name[:77] + "...", *cells)
    return table


def kernels_table(report: dict) -> Table:
    """The kernels (on a CPU, operators) that take the most device time a step."""
    gpu = report.get("device_type") == "cuda"
    what, clock = ("kernel", "device") if gpu else ("operator", "self CPU")
    rows = [(k["name"], f"{k['calls_per_step']:g}", f"{k['ms_per_step']:.2f}", f"{100 * k['share']:.1f}%")
            for k in report["top_kernels"]]
    return _ranked_table(f"top {len(rows)} {what}s by {clock} time a step", (what, "calls / step", "ms / step", "share"),
                         rows)


def idle_table(report: dict) -> Table:
    """GPU idle gaps of the profiled steps by what the launching host thread ran during them (the
    report's values are already in milliseconds, as gaps.idle_by_host returns them)."""
    idle = report["idle_by_host"]
    rows = [(r["host"], f"{r['ms_per_step']:.2f}", f"{100 * r['share']:.1f}%", f"{r['gaps_per_step']:g}")
            for r in idle["rows"]]
    return _ranked_table(f"GPU idle {idle['gap_ms_per_step']:.2f} ms a step in {idle['gaps_per_step']:g} gaps: "
                         "what the host ran meanwhile", ("host (innermost event)", "ms / step", "share", "gaps / step"),
                         rows)


def _mfu_cell(mfu: float) -> str:
    """An MFU as a percentage; above 100% the peak it divides by (a measured one, on a busy CPU) was
    lower than what the run reached, and the cell says what to do."""
    note = " (above 100%: the peak used is below what this run reached; set metrics.peak_tflops)" if mfu > 1 else ""
    return f"{100 * mfu:.2f}%{note}"


def summary_table(cfg, result) -> Table:
    table = Table(title=f"gemctl train: {cfg.run.name} ({cfg.model.name}, {cfg.data.name})", show_header=True)
    table.add_column("metric")
    table.add_column("value", justify="right")
    ev, perf = result.eval, result.perf
    for task, m in ((k, v) for k, v in ev.items() if isinstance(v, dict)):
        table.add_row(f"eval NE ({task})", f"{m['ne']:.4f}")
        table.add_row(f"eval AUC ({task})", f"{m['auc']:.4f}")
    for name, base in result.baselines.items():
        table.add_row(f"baseline {name} NE / AUC", f"{base['ne']:.4f} / {base['auc']:.4f}")
    table.add_row("eval samples", f"{ev.get('samples', 0):,}" + (" (NE/AUC weighted)" if ev.get("weighted") else ""))
    last = result.losses[-10:]
    table.add_row(f"train loss (mean of the last {len(last)} steps)", f"{sum(last) / len(last):.4f}" if last else "-")
    table.add_row("QPS (samples/s)", f"{perf['qps']:,.1f}")
    table.add_row("tokens/s", f"{perf['tokens_per_s']:,.0f}")
    table.add_row("step time", f"{perf['step_time_ms']:.1f} ms")
    table.add_row("model TFLOP/s", f"{perf['model_tflops']:.3f}")
    if perf.get("world_size", 1) > 1:
        table.add_row("ranks (layout)", f"{perf['world_size']} ({cfg.parallel.name})")
        table.add_row("QPS per rank", f"{perf['qps_per_rank']:,.1f}")
    if perf.get("scaling_ratio") is not None:
        table.add_row("Local MFU (1-rank baseline)", _mfu_cell(perf["local_mfu"]))
        note = " (> 1: the baseline ran slower than the job; give it more steps)" if perf["scaling_ratio"] > 1.05 else ""
        table.add_row("Scaling Ratio", f"{perf['scaling_ratio']:.4f}{note}")
        table.add_row("E2E MFU (= Local x Scaling)", _mfu_cell(perf["e2e_mfu"]))
    elif perf.get("world_size", 1) > 1:
        table.add_row("E2E MFU", _mfu_cell(perf["e2e_mfu"]))
        table.add_row("Local MFU, Scaling Ratio", "set metrics.scaling_baseline_steps (1-rank baseline)")
    else:
        table.add_row("Local MFU", _mfu_cell(perf["local_mfu"]))
    if perf.get("activation_checkpoint", "none") != "none":
        table.add_row("activation checkpointing", perf["activation_checkpoint"])
        hfu = perf.get("hfu")
        table.add_row("HFU (recomputation counted)", _mfu_cell(hfu) if hfu is not None
                      else "not known (torch.compile chooses the recomputation)")
    table.add_row("peak used", perf["peak"])
    table.add_row("attention share of FLOPs", f"{100 * perf['attention_flop_share']:.1f}%")
    table.add_row("data wait per step", f"{perf['data_wait_ms_per_step']:.2f} ms ({100 * perf['data_wait_fraction']:.1f}%)")
    if "peak_memory_gib" in perf:
        table.add_row("peak GPU memory", f"{perf['peak_memory_gib']:.1f} GiB")
    if perf.get("peak_host_memory_gib") is not None:
        table.add_row("peak host memory (RSS)", f"{perf['peak_host_memory_gib']:.2f} GiB")
    table.add_row("timed steps / train wall", f"{perf['timed_steps']} / {perf['train_wall_s']:.1f} s")
    if perf.get("setup_s_in_timed_steps"):
        table.add_row("kernel tuning/compiles in timed steps (left out)", f"{perf['setup_s_in_timed_steps']:.1f} s")
    return table


def cmd_plan(args, console: Console) -> int:
    import json

    from gemctl.config.compose import compose
    from gemctl.config.validate import validate
    from gemctl.data.source import build_source
    from gemctl.parallel.plan import build_plan

    overrides = list(args.overrides)
    if args.world is not None:
        gpn = compose(overrides, recipe=args.recipe).parallel.topology.gpus_per_node
        if args.world < 1 or (args.world > gpn and args.world % gpn):
            raise UserError(f"--world: {args.world} must be >= 1 and, above one node, a multiple of "
                            f"parallel.topology.gpus_per_node={gpn}")
        per_node = min(args.world, gpn)
        overrides += ["launcher=torchrun", f"launcher.nproc_per_node={per_node}", f"launcher.nnodes={args.world // per_node}"]
    cfg = compose(overrides, recipe=args.recipe)
    validate(cfg, check_device=False)
    plan = build_plan(cfg, build_source(cfg.data, cfg.shuffle))
    if args.json:
        print(json.dumps(plan, indent=1))
    else:
        for table in plan_tables(plan):
            console.print(table)
    return 0


def _gib(n: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:,.2f} {unit}"
    return f"{n:,.0f} B"


def plan_tables(plan: dict) -> list[Table]:
    head = Table(title=(f"gemctl plan: {plan['layout']} on {plan['world_size']} ranks "
                        f"({plan['gpus_per_node']} per node) - model {plan['model']}, "
                        f"{plan['dense_params'] / 1e6:,.1f}M dense + {plan['embedding_params'] / 1e6:,.1f}M embedding"))
    head.add_column("mesh dim")
    head.add_column("groups x size", justify="right")
    head.add_column("network")
    head.add_column("ranks (first groups, last group)")
    for dim in ("dp_replicate", "dp_shard"):
        g = plan["groups"][dim]
        head.add_row(dim, f"{g['count']} x {g['size']}", g["tier"],
                     "; ".join("[" + ", ".join(map(str, x)) + "]" for x in g["examples"]))  # '...' unquoted
    mem = Table(title=f"memory per rank (rank 0), local batch {plan['local_batch']}, "
                      f"mean history {plan['mean_history_length']:.0f} ({plan['mean_history_length_from']}), "
                      f"activation checkpointing {plan['activation_checkpoint']}")
    mem.add_column("what")
    mem.add_column("bytes", justify="right")
    for k, v in plan["memory_bytes_rank0"].items():
        mem.add_row(k.replace("_", " "), _gib(v))
    comm = Table(title="communication per rank per step")
    for c in ("collective", "group", "network", "bytes"):
        comm.add_column(c, justify="right" if c == "bytes" else "left")
    for c in plan["communication_per_step"] or [{"collective": "none (one rank per replica group)", "group": "",
                                                 "tier": "", "bytes": 0}]:
        comm.add_row(c["collective"], c["group"], c["tier"], _gib(c["bytes"]))
    tables = Table(title="embedding tables")
    for c in ("table", "rows", "dim", "sharding"):
        tables.add_column(c)
    for t in plan["tables"]:
        tables.add_row(t["table"], f"{t['rows']:,}", str(t["dim"]), t["sharding"])
    return [head, mem, comm, tables]


def cmd_config(args, console: Console) -> int:
    from omegaconf import OmegaConf

    cfg = _compose(args, check_device=False)  # a config for another machine (a GPU recipe shown on a laptop)
    if args.action == "show":
        print(OmegaConf.to_yaml(cfg), end="")
        return 0
    here = ""
    if cfg.train.device == "cuda":
        import torch

        here = "" if torch.cuda.is_available() else "; train.device=cuda, and this machine shows no CUDA device"
    console.print(f"config is valid{here}", markup=False, soft_wrap=True)
    return 0


def cmd_recipes(args, console: Console) -> int:
    from gemctl.config.compose import list_recipes, resolve_recipe

    if args.action == "list":
        if args.name:
            raise UserError(f"gemctl recipes list: takes no name (got '{args.name}'); gemctl recipes show NAME shows one")
        table = Table(title="recipes")
        table.add_column("name")
        table.add_column("command / description")
        for name, path in list_recipes().items():
            table.add_row(name, recipe_summary(path.read_text()))
        console.print(table)
        return 0
    if not args.name:
        raise UserError(f"gemctl recipes {args.action}: give a recipe name")
    path = resolve_recipe(args.name)
    if args.action == "show":
        if args.dest:
            raise UserError(f"gemctl recipes show: one recipe at a time (got '{args.dest}' too)")
        print(path.read_text(), end="")
        return 0
    dest = Path(args.dest or f"{path.stem}.yaml")
    into_dir = (args.dest or "").endswith(("/", os.sep))
    if dest.is_dir() or into_dir:
        dest = dest / path.name  # into a directory (made if missing)
    elif dest.suffix not in (".yaml", ".yml"):
        dest = dest.with_name(dest.name + ".yaml")  # --recipe takes a path only as a YAML file
    if dest.exists():
        raise UserError(f"gemctl recipes cp: {dest} exists; choose another destination")
    if dest.parent.exists() and not dest.parent.is_dir():
        raise UserError(f"gemctl recipes cp: {dest.parent} is a file; give a directory or a .yaml path")
    if not dest.parent.exists() and not into_dir:
        raise UserError(f"gemctl recipes cp: directory {dest.parent} does not exist (a destination ending in / is made)")
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, dest)
    except OSError as exc:  # a file on the way (afile/x/), no permission
        raise UserError(f"gemctl recipes cp: cannot write {dest}: {exc.strerror or exc}") from None
    console.print(f"copied {path.name} -> {dest} (run it with: gemctl train --recipe {dest})", markup=False,
                  soft_wrap=True)
    return 0


def recipe_summary(text: str) -> str:
    """A recipe's command line and the first sentence of its header comment (whole, never cut)."""
    lines = []
    for ln in text.splitlines():
        if not ln.startswith("#"):
            break
        if "@package" not in ln:
            lines.append(ln[1:].strip())
    command = lines[0] if lines else ""
    paragraph = " ".join(itertools.takewhile(bool, lines[1:]))
    sentence = re.match(r".*?[.](?=\s|$)", paragraph)
    return "\n".join(filter(None, (command, sentence.group(0) if sentence else paragraph)))


def cmd_compare(args, console: Console) -> int:
    from gemctl.launch.multirun import compare

    return compare([Path(p) for p in args.runs], args.baseline, Path(args.out) if args.out else None, console)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gemctl", description="Train GEM-like recommendation models.")
    sub = parser.add_subparsers(dest="verb", required=True)

    def with_overrides(p):
        p.add_argument("--recipe", help="a recipe name (gemctl recipes list) or a YAML file")
        p.add_argument("overrides", nargs="*", default=[], help="Hydra overrides, e.g. model=small train.steps=100")

    p = sub.add_parser("train", help="train a model")
    p.add_argument("--dry-run", action="store_true", help="launcher=slurm: print the job script, submit nothing")
    p.add_argument("-m", "--multirun", action="store_true", help="one run per combination of sweep overrides (a=1,2)")
    with_overrides(p)
    p.set_defaults(func=cmd_train)
    p = sub.add_parser("profile", help="profile training steps: time and MFU by category")
    with_overrides(p)
    p.set_defaults(func=cmd_profile)
    p = sub.add_parser("plan", help="the layout at a world size, without GPUs: groups, memory, communication")
    p.add_argument("--world", type=int, help="plan for this many ranks (sets launcher=torchrun and its sizes)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    with_overrides(p)
    p.set_defaults(func=cmd_plan)
    p = sub.add_parser("config", help="show or validate the composed config")
    p.add_argument("action", choices=["show", "validate"])
    with_overrides(p)
    p.set_defaults(func=cmd_config)
    p = sub.add_parser("compare", help="the tables of one multirun over the jobs of several (NE over seeds vs a baseline)")
    p.add_argument("runs", nargs="+", help="multirun directories (runs/<name>/multirun-<stamp>) or their sweep.json")
    p.add_argument("--baseline", help="the baseline setting: a whole setting, one of its overrides (precision=bf16) or "
                   "an unambiguous value (bf16); default: the first job's")
    p.add_argument("--out", help="also write the tables as JSON to this file")
    p.set_defaults(func=cmd_compare)
    p = sub.add_parser("recipes", help="list, show or copy recipes")
    p.add_argument("action", nargs="?", default="list", choices=["list", "show", "cp"],
                   help="list (the default), show NAME, or cp NAME DEST")
    p.add_argument("name", nargs="?")
    p.add_argument("dest", nargs="?")
    p.set_defaults(func=cmd_recipes)
    return parser


def quiet_library_logs() -> None:
    import logging

    # torchrec's KeyedJaggedTensor asks torch.fx whether it is tracing; torch logs a deprecation
    # note about that at WARNING on every run. Nothing a user can act on.
    logging.getLogger("torch.fx._symbolic_trace").setLevel(logging.ERROR)


def main(argv: list[str] | None = None) -> int:
    quiet_library_logs()
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:  # overrides after an option (config show --recipe X model=small): argparse leaves them over
        if not hasattr(args, "overrides") or any(e.startswith("-") for e in extra):
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        args.overrides = [*args.overrides, *extra]
    console = Console(stderr=False)
    try:
        return args.func(args, console)
    except UserError as exc:
        return report_error(exc)
    except KeyboardInterrupt:
        print("gemctl: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
