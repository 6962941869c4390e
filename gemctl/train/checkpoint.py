"""Checkpoints with torch.distributed.checkpoint (DCP): model, dense and embedding optimizer
states (FSDP2 shards stay sharded: every rank writes its own), LR schedule, step, RNG states per
rank and the resolved config.

Layout: ``<dir>/step-00000100/`` (DCP files + ``rank<r>.pt`` with the rank's RNG states +
``meta.json``). Atomic: everything is written into ``<dir>/.tmp-step-00000100/``; after every
rank has finished (a barrier) rank 0 renames it to its final name, the POSIX-atomic publish, and
prunes beyond ``keep_last``. A directory without its final name is never loaded. Loading reads
``rank<r>.pt`` with ``weights_only=True`` (tensors and plain values only) and DCP's pickled
``.metadata`` through an allowlist of DCP's own types (SafeReader): nothing in a checkpoint can
make loading run code.

The data position is the step: sources make batch k of a rank from (seed, step, rank) alone
(gemctl.data), Base Batch Shuffling included, so resuming at step k replays exactly the batches an
uninterrupted run would see next.
"""

from __future__ import annotations

import contextlib
import json
import pickle
import re
import shutil
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
import torch.distributed.checkpoint as dcp
from omegaconf import OmegaConf
from torch.distributed.checkpoint.api import CheckpointException  # a BaseException, not an Exception
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

_STEP = re.compile(r"^step-(\d{8})$")

# What a DCP ``.metadata`` pickle may refer to. torch's own reader unpickles it without limits (a
# crafted file could run code on load); SafeReader refuses anything outside this list.
_METADATA_MODULES = ("torch.distributed.checkpoint.metadata",)
_METADATA_NAMES = {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
    ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"), ("pathlib", "PureWindowsPath"), ("collections", "OrderedDict"),
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        allowed = (module in _METADATA_MODULES or (module, name) in _METADATA_NAMES
                   or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)))
        if not allowed:
            raise pickle.UnpicklingError(f"checkpoint metadata refers to {module}.{name}, which a checkpoint never "
                                         "holds; refusing to load it")
        return super().find_class(module, name)


@contextlib.contextmanager
def _single_process_quiet():
    """DCP warns on every save and load of a single process (no process group) that it assumes
    one; that is the intent here, and nothing a user can act on."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"torch\.distributed is (disabled, )?unavailable or uninitialized")
        yield


class SafeReader(dcp.FileSystemReader):
    """DCP's file reader, with the metadata unpickled through an allowlist of DCP's own types
    (tensor data is read by DCP with ``weights_only`` loading already)."""

    def read_metadata(self, *args, **kwargs):
        from torch.distributed.checkpoint.metadata import StorageMeta

        rank = kwargs.get("rank")
        name = ".metadata" if rank is None else f"__{rank}.metadata"
        with open(Path(self.path) / name, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = getattr(self, "load_id", None)
        return metadata


def step_dir(root: Path, step: int) -> Path:
    return Path(root) / f"step-{step:08d}"


def complete_checkpoints(root: Path) -> list[Path]:
    """Published checkpoints under ``root``, oldest first (temporary directories are skipped)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and _STEP.match(p.name) and (p / "meta.json").exists()]
    return sorted(found, key=lambda p: p.name)


def _barrier(ctx) -> None:
    if ctx.world_size > 1:
        dist.barrier()


class _LoadPlanner(dcp.DefaultLoadPlanner):
    """DCP's load planner without its pre-2.4 key-format guess. The guess fires whenever the
    checkpoint holds keys this rank does not ask for, which is normal here: with table-wise
    sharding, each rank's fused optimizer state names only its own tables."""

    def create_local_plan(self):
        from torch.distributed.checkpoint.default_planner import create_default_local_load_plan

        return create_default_local_load_plan(self.state_dict, self.metadata, not self.allow_partial_load)


def _expert_mesh(trainer):
    """(replica, ep) mesh of the expert layout: EP groups are ``ep`` consecutive ranks, so rank r
    holds expert slice r % ep, replicated over the world / ep groups."""
    if getattr(trainer, "_ckpt_expert_mesh", None) is None:
        from torch.distributed.device_mesh import init_device_mesh

        ep = trainer.expert_groups.ep
        trainer._ckpt_expert_mesh = init_device_mesh(trainer.device.type, (trainer.ctx.world_size // ep, ep),
                                                     mesh_dim_names=("ep_replica", "ep"))
    return trainer._ckpt_expert_mesh


def _states(trainer) -> tuple[dict, list[str]]:
    """The state DCP saves and loads: ``model`` and ``optim`` (dense and embedding optimizers).

    Expert-parallel weights are plain tensors that differ between the ranks of an EP group; DCP
    would take one rank's copy for all, so they (and their optimizer moments) are presented as
    DTensors sharded over the EP dimension and replicated over the EP groups. Returns the state
    and the keys so wrapped (unwrapped again by ``_unwrap`` after a load).
    """
    if trainer.table_plan:  # torchrec's DistributedModelParallel holds the tables: saved apart
        model_sd, optim_sd = get_state_dict(_dense_view(trainer.model), [trainer.dense_opt])
        model_sd.update({f"sparse.{k}": v for k, v in trainer.model.sparse.state_dict().items()})
        state = {"model": model_sd, "optim": optim_sd, "sparse_optim": trainer.sparse_opt.state_dict()}
    else:
        model_sd, optim_sd = get_state_dict(trainer.model, [trainer.dense_opt, trainer.sparse_opt])
        state = {"model": model_sd, "optim": optim_sd}
    wrapped = []
    if trainer.expert_params:
        from torch.distributed.tensor import DTensor, Replicate, Shard

        mesh, place = _expert_mesh(trainer), [Replicate(), Shard(0)]
        names = {id(p): n for n, p in trainer.model.named_parameters()}
        for p in trainer.expert_params:
            fqn = names[id(p)]
            model_sd[fqn] = DTensor.from_local(model_sd[fqn], mesh, place, run_check=False)
            # a copy: the inner dicts of the optimizer state dict are the optimizer's own
            moments = optim_sd["state"][fqn] = dict(optim_sd["state"].get(fqn, {}))
            for key, value in moments.items():
                if torch.is_tensor(value) and value.shape == p.shape:
                    moments[key] = DTensor.from_local(value, mesh, place, run_check=False)
            wrapped.append(fqn)
    return state, wrapped


def _dense_view(model) -> nn.Module:
    """The model without its torchrec tables (same module objects, same names): DCP's state-dict
    helpers cannot walk into DistributedModelParallel, whose tables are saved by their own
    state dict (ShardedTensors) and fused optimizer."""
    if any(True for _ in model.parameters(recurse=False)):
        raise RuntimeError("checkpoint: the model root holds parameters; the dense view would miss them")
    return nn.ModuleDict({name: child for name, child in model.named_children() if name != "sparse"})


def _apply(trainer, state: dict) -> None:
    """Copy a loaded state into the model and the optimizers."""
    if trainer.table_plan:
        dense = {k: v for k, v in state["model"].items() if not k.startswith("sparse.")}
        set_state_dict(_dense_view(trainer.model), [trainer.dense_opt], model_state_dict=dense,
                       optim_state_dict=state["optim"])
        tables = {k[len("sparse."):]: v for k, v in state["model"].items() if k.startswith("sparse.")}
        trainer.model.sparse.load_state_dict(tables)
        trainer.sparse_opt.load_state_dict(state["sparse_optim"])
    else:
        set_state_dict(trainer.model, [trainer.dense_opt, trainer.sparse_opt], model_state_dict=state["model"],
                       optim_state_dict=state["optim"])


def _unwrap(state: dict, wrapped: list[str]) -> None:
    for fqn in wrapped:
        state["model"][fqn] = state["model"][fqn].to_local()
        moments = state["optim"]["state"].get(fqn, {})
        for key, value in moments.items():
            if hasattr(value, "to_local"):
                moments[key] = value.to_local()


def save(trainer, step: int, root: Path, keep_last: int, asynchronous: bool = False) -> Path:
    """Write the checkpoint of ``step`` into a temporary directory and publish it. With
    ``asynchronous`` the state is copied to host memory now and written by a background thread
    while training goes on; it is published (renamed) at the next save or by ``finish``, after
    every rank's write has completed, so a run that dies meanwhile never leaves it half-visible."""
    finish(trainer)  # the previous asynchronous checkpoint first: publishes stay in step order
    ctx = trainer.ctx
    final = step_dir(root, step)
    tmp = final.with_name(".tmp-" + final.name)
    if ctx.is_main:
        shutil.rmtree(tmp, ignore_errors=True)  # a torn earlier attempt at this step
        tmp.mkdir(parents=True)
    _barrier(ctx)
    state, _ = _states(trainer)
    torch.save({"cpu_rng": torch.get_rng_state(),
                "cuda_rng": torch.cuda.get_rng_state(trainer.device) if trainer.device.type == "cuda" else torch.empty(0)},
               tmp / f"rank{ctx.rank}.pt")
    meta = {"step": step, "world_size": ctx.world_size, "sparse_sharding": trainer.cfg.parallel.sparse.sharding,
            "schedule": trainer.schedule.state_dict(), "config": OmegaConf.to_yaml(trainer.cfg)}
    if asynchronous:
        future = dcp.async_save(state, checkpoint_id=str(tmp), process_group=_async_group(trainer))
        trainer._ckpt_pending = (future, tmp, final, meta, root, keep_last)
        return final
    with _single_process_quiet():
        dcp.save(state, checkpoint_id=str(tmp))
    _publish(trainer, tmp, final, meta, root, keep_last)
    return final


def finish(trainer) -> None:
    """Wait for the pending asynchronous checkpoint, if any, and publish it."""
    pending = getattr(trainer, "_ckpt_pending", None)
    if pending is None:
        return
    trainer._ckpt_pending = None
    future, tmp, final, meta, root, keep_last = pending
    future.result()
    _publish(trainer, tmp, final, meta, root, keep_last)


def _async_group(trainer):
    """A gloo group for the background writer's collectives: the training collectives keep the
    default group (NCCL on GPUs) to themselves, and DCP's async save needs a CPU backend."""
    if trainer.ctx.world_size == 1 or not dist.is_initialized():
        return None
    if getattr(trainer, "_ckpt_group", None) is None:
        trainer._ckpt_group = dist.new_group(backend="gloo")
    return trainer._ckpt_group


def _publish(trainer, tmp: Path, final: Path, meta: dict, root: Path, keep_last: int) -> None:
    ctx = trainer.ctx
    _barrier(ctx)  # every rank has written its part
    if ctx.is_main:
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1, default=lambda o: None))
        tmp.rename(final)  # publish
        for old in complete_checkpoints(root)[:-keep_last] if keep_last else []:
            shutil.rmtree(old, ignore_errors=True)
    _barrier(ctx)


def find(resume: str, root: Path) -> Path | None:
    """The checkpoint to resume from: ``none``; ``auto`` (the newest published one under root, if
    any); or a path (a step directory, or a directory of them: its newest)."""
    if resume == "none":
        return None
    base = Path(root) if resume == "auto" else Path(resume)
    if _STEP.match(base.name) and (base / "meta.json").exists():
        return base
    found = complete_checkpoints(base)
    if not found and resume != "auto":
        from gemctl.errors import UserError

        raise UserError(f"train.resume: no published checkpoint (step-NNNNNNNN with meta.json) at {base}")
    return found[-1] if found else None


def candidates(resume: str, root: Path) -> list[Path]:
    """Checkpoints to try, newest first: the one asked for, then (``auto`` or a directory of
    checkpoints) the older ones, used when a newer one is unreadable."""
    first = find(resume, root)
    if first is None:
        return []
    if _STEP.match(Path(resume).name):  # a specific step was asked for: that one only
        return [first]
    older = [p for p in complete_checkpoints(first.parent) if p.name < first.name]
    return [first] + older[::-1]


def load_newest_readable(trainer, paths: list[Path], say) -> tuple[int, Path | None]:
    """Load the first readable checkpoint of ``paths``; a corrupt or truncated one is skipped with
    a warning. A checkpoint that does not fit the model (a tensor's shape, a missing tensor) is an
    error naming the tensor: an older one would not fit either."""
    from gemctl.errors import UserError

    for i, path in enumerate(paths):
        try:
            return load(trainer, path, say), path
        except UserError:
            raise
        except (Exception, CheckpointException) as exc:  # unreadable: truncated, corrupt, missing files
            reason = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}" if str(exc) else type(exc).__name__
            if i + 1 == len(paths):
                raise UserError(f"train.resume: checkpoint {path} is unreadable ({reason}) and there is no older one")
            say(f"[yellow]checkpoint {path} is unreadable ({reason}); trying {paths[i + 1]}[/yellow]")
    return 0, None


def _check_fits(path: Path, model_sd: dict) -> None:
    """Every model tensor is in the checkpoint with the model's shape (else one line naming it)."""
    from gemctl.errors import UserError

    stored = SafeReader(str(path)).read_metadata().state_dict_metadata
    for name, value in model_sd.items():
        key = f"model.{name}"
        if key not in stored:
            raise UserError(f"train.resume: {path} has no tensor {name}; it was written for another model")
        size, shape = getattr(stored[key], "size", None), tuple(value.size())  # global shapes (sharded too)
        if size is not None and tuple(size) != shape:
            raise UserError(f"train.resume: tensor {name} is {list(size)} in {path} but {list(shape)} in this "
                            "model (a changed model or table size)")


def _check_layout(trainer, path: Path, meta: dict, say) -> None:
    """A checkpoint loads into another world size when DCP can reshard it: FSDP2/HSDP shards and
    expert slices (DTensors) can, torchrec's table shards and fused optimizer state are only
    loaded at the same world size, and the embedding optimizer state differs between the two
    sparse shardings (one line naming the field otherwise)."""
    from gemctl.errors import UserError

    ctx, cfg = trainer.ctx, trainer.cfg
    written = meta.get("sparse_sharding", "fsdp")
    if written != cfg.parallel.sparse.sharding:
        raise UserError(f"train.resume: {path} was written with parallel.sparse.sharding={written}, this job uses "
                        f"{cfg.parallel.sparse.sharding}; resume with the same sparse sharding")
    if meta["world_size"] == ctx.world_size:
        return
    if written == "torchrec":
        raise UserError(f"train.resume: {path} holds torchrec table shards of {meta['world_size']} ranks, this job has "
                        f"{ctx.world_size}; torchrec checkpoints load at the same world size only")
    if say is not None:
        say(f"[yellow]{path} was written by {meta['world_size']} ranks, this job has {ctx.world_size}: parameters "
            "and optimizer states are resharded; the data stream continues at the same step with this job's "
            "global batch (samples per step change with the world size)[/yellow]")


def load(trainer, path: Path, say=None) -> int:
    """Restore ``trainer`` from ``path``; returns the step to continue from."""
    ctx = trainer.ctx
    meta = json.loads((Path(path) / "meta.json").read_text())
    _check_layout(trainer, Path(path), meta, say)
    state, wrapped = _states(trainer)
    _check_fits(Path(path), state["model"])
    with _single_process_quiet():
        dcp.load(state, storage_reader=SafeReader(str(path)), planner=_LoadPlanner())
    _unwrap(state, wrapped)
    _apply(trainer, state)
    schedule = {k: v for k, v in meta["schedule"].items() if k != "lr_lambdas"}
    trainer.schedule.load_state_dict({**trainer.schedule.state_dict(), **schedule})
    rng_file = Path(path) / f"rank{ctx.rank}.pt"
    if ctx.rank < meta["world_size"] or rng_file.exists():  # a rank the writing job did not have keeps its seed
        rng = torch.load(rng_file, weights_only=True)
        torch.set_rng_state(rng["cpu_rng"])
        if trainer.device.type == "cuda" and rng["cuda_rng"].numel():
            torch.cuda.set_rng_state(rng["cuda_rng"], trainer.device)
    return int(meta["step"])
