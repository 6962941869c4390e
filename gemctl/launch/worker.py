"""One rank of a torchrun job: `python -m gemctl.launch.worker <resolved config.yaml>`.

The YAML was resolved and validated by `gemctl train` before launch; it is loaded into the typed
schema again (so a hand-edited file still fails with one clear line) and trained with the run
directory the launcher made (GEMCTL_RUN_DIR).
"""

from __future__ import annotations

import logging
import os
import sys

from omegaconf import OmegaConf
from rich.console import Console

from gemctl.errors import UserError, report_error


def load_resolved(path: str):
    from gemctl.config.schema import GemConfig
    from gemctl.config.validate import validate

    cfg = OmegaConf.merge(OmegaConf.structured(GemConfig), OmegaConf.load(path))
    validate(cfg)
    return cfg


def main(argv: list[str] | None = None) -> int:
    from gemctl.cli import quiet_library_logs

    quiet_library_logs()
    argv = sys.argv[1:] if argv is None else argv
    mode = "train"
    if argv and argv[0] == "--profile":
        mode, argv = "profile", argv[1:]
    rank = int(os.environ.get("RANK", "0"))
    console = Console() if rank == 0 else None
    try:
        cfg = load_resolved(argv[0])
        if mode == "profile":
            return _profile(cfg, console)
        from gemctl.train.trainer import train

        result = train(cfg, console=console, run_dir=os.environ.get("GEMCTL_RUN_DIR"))
    except UserError as err:
        return report_error(err, f"gemctl (rank {rank})")
    if console is not None:
        from gemctl.cli import print_results

        print_results(console, cfg, result)
    return 0


def _profile(cfg, console) -> int:
    from gemctl.profile.runner import profile
    from gemctl.train.trainer import Trainer, prepare_process

    prepare_process()
    trainer = Trainer(cfg, console=console)
    try:
        report = profile(trainer, console=console, run_dir=os.environ.get("GEMCTL_RUN_DIR"))
    except BaseException:
        trainer.ctx.close(graceful=False)
        raise
    trainer.ctx.close()
    if console is not None:
        from gemctl.cli import profile_table

        console.print(profile_table(report))
        console.print(f"profile: {report['run_dir']}/profile.json, trace-rank<r>.json, breakdown.png, waterfall.png")
    return 0


def _leave(code: int) -> None:
    """End the rank without the interpreter's finalization. The process-group objects outlive
    destroy_process_group: the DeviceMesh holds them, and the mesh stays referenced after train()
    returns (by DTensor specs among others; clearing torch's sharding-propagation caches does not
    release it), so gloo's six worker and transport threads still run (measured) and are torn
    down during finalization, racing it; a rank then aborted now and then after a finished run
    ("terminate called without an active exception", SIGABRT, seen once in CI). Everything the
    run writes is written and closed by now: flush what is buffered and go."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    _leave(main())
