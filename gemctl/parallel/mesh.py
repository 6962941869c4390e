"""The process group and device mesh of a run.

Under torchrun (WORLD_SIZE > 1) the ranks form one default process group (NCCL on CUDA, gloo on
CPU) and a 2-D DeviceMesh ("dp_replicate", "dp_shard") from the layout: dp_shard consecutive
ranks shard the dense parameters (inside a node when the layout says so), dp_replicate such
groups hold replicas. One process without torchrun is world size 1 and needs no group.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class ParallelContext:
    world_size: int = 1
    rank: int = 0
    local_rank: int = 0
    dp_replicate: int = 1
    dp_shard: int = 1
    mesh: object = None  # torch.distributed.device_mesh.DeviceMesh over (dp_replicate, dp_shard)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def describe(self) -> str:
        if self.world_size == 1:
            return "1 rank" + (" (FSDP2 over one rank)" if self.sharded else "")
        return f"{self.world_size} ranks: dp_replicate {self.dp_replicate} x dp_shard {self.dp_shard}"

    def sum(self, values: list[float], device) -> list[float]:
        """Element-wise sum over ranks (a no-op on one rank)."""
        if self.world_size == 1:
            return list(values)
        t = torch.tensor(values, dtype=torch.float64, device=device)
        dist.all_reduce(t)
        return t.tolist()

    def gather(self, obj) -> list:
        """Every rank's ``obj`` (picklable), in rank order, on every rank."""
        if self.world_size == 1:
            return [obj]
        out: list = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    def mean(self, tensor: torch.Tensor) -> torch.Tensor:
        """Mean over ranks of a tensor of the same shape on every rank."""
        if self.world_size == 1:
            return tensor
        out = tensor.clone()
        dist.all_reduce(out)
        return out / self.world_size

    @property
    def sharded(self) -> bool:
        """Whether the layout is applied (a mesh exists): any torchrun job, even of one rank."""
        return self.mesh is not None

    def close(self, graceful: bool = True) -> None:
        """Leave the process group. Graceful: all ranks first meet at a barrier, so no rank tears
        its group down while another still uses it. After a failure no barrier: the other ranks
        may never arrive."""
        if self.sharded and dist.is_initialized():
            if graceful:
                dist.barrier()
            dist.destroy_process_group()


def init_parallel(cfg, device_type: str) -> ParallelContext:
    """Join the job's process group and build its mesh (world size from torchrun's environment).

    A process not started by torchrun is one rank without a group. Under torchrun even one rank
    gets its group and mesh, so the layout's code path (FSDP2 over one rank) runs, and can be
    measured, on a single GPU."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1 and "LOCAL_RANK" not in os.environ:
        return ParallelContext()
    from torch.distributed.device_mesh import init_device_mesh

    from gemctl.config.validate import resolve_layout

    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    if device_type == "cuda":
        torch.cuda.set_device(local_rank)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device_type == "cuda" else "gloo")
    rep, shard = resolve_layout(cfg, world)  # the world torchrun gave, against the layout
    mesh = init_device_mesh(device_type, (rep, shard), mesh_dim_names=("dp_replicate", "dp_shard"))
    return ParallelContext(world, rank, local_rank, rep, shard, mesh)
