"""torchrec sharding of the embedding tables (parallel.sparse.sharding=torchrec).

DistributedModelParallel wraps the model's SparseArch: the planner places every table on the
ranks (sharding types limited to parallel.sparse.sharding_types), lookups travel by all-to-all,
and row-wise Adagrad is fused into the backward by fbgemm (EXACT_ROWWISE_ADAGRAD: the same update
as gemctl.train.optim.RowWiseAdagrad). The tables start from the values the unsharded model was
initialised with (the same seed on every rank), copied shard by shard, so a sharded run starts
where a single-process run starts.

Gradient scale: each rank's loss is its local mean, and sharded tables sum the gradients of all
ranks, so a table's gradient is world size x the global-mean gradient; row-wise Adagrad divides
by the root of its accumulated squares, which cancels a constant factor (up to eps = 1e-8).

CPU: torchrec's stock sharders offer only data-parallel, table-wise and column-wise for a CPU
compute device; the sharders here also offer row-wise and table-row-wise (the fbgemm CPU ops
they use exist), so the layouts test on CPU as they run on GPUs.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def _sharders(train_cfg, cpu: bool):
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec.distributed.embedding import EmbeddingCollectionSharder
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.types import ShardingType

    fused = {"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": train_cfg.embedding_lr, "eps": 1e-8}
    extra = [ShardingType.ROW_WISE.value, ShardingType.TABLE_ROW_WISE.value] if cpu else []

    def with_cpu_row_wise(cls):
        class Sharder(cls):
            def sharding_types(self, compute_device_type: str):
                return list(dict.fromkeys(super().sharding_types(compute_device_type) + extra))

        Sharder.__name__ = cls.__name__
        return Sharder(fused_params=fused)

    return [with_cpu_row_wise(EmbeddingCollectionSharder), with_cpu_row_wise(EmbeddingBagCollectionSharder)]


def _constraints(sparse_arch, sharding_types: list[str]):
    from torchrec.distributed.planner.types import ParameterConstraints

    names = [t.name for t in sparse_arch.seq.embedding_configs()] + [t.name for t in sparse_arch.nonseq.embedding_bag_configs()]
    return {n: ParameterConstraints(sharding_types=list(sharding_types)) for n in names}


def shard_tables(model, ctx, cfg, device):
    """Replace ``model.sparse`` by its DistributedModelParallel; returns (the plan, its fused
    optimizer)."""
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
    from torchrec.distributed.types import ShardingEnv

    reference = {k: v.detach().clone() for k, v in model.sparse.state_dict().items()}
    sharders = _sharders(cfg.train, device.type == "cpu")
    pg = dist.GroupMember.WORLD
    topology = Topology(world_size=ctx.world_size, compute_device=device.type,
                        local_world_size=min(ctx.world_size, cfg.parallel.topology.gpus_per_node))
    planner = EmbeddingShardingPlanner(topology=topology, constraints=_constraints(model.sparse, cfg.parallel.sparse.sharding_types))
    plan = planner.collective_plan(model.sparse, sharders, pg)
    dmp = DistributedModelParallel(model.sparse, env=ShardingEnv.from_process_group(pg), device=device, plan=plan,
                                   sharders=sharders)
    _copy_tables(dmp, reference)
    model.sparse = dmp
    return plan_tables(plan), dmp.fused_optimizer


def plan_tables(plan) -> dict[str, dict]:
    """{table: {"sharding": type, "ranks": [...], "shards": [[row offset, col offset, rows, cols]]}}."""
    out = {}
    for module_plan in plan.plan.values():
        for table, spec in module_plan.items():
            shards = spec.sharding_spec.shards if spec.sharding_spec is not None else []
            out[table] = {
                "sharding": spec.sharding_type, "ranks": list(spec.ranks or []),
                "shards": [list(sh.shard_offsets) + list(sh.shard_sizes) for sh in shards],
            }
    return out


@torch.no_grad()
def _copy_tables(dmp, reference: dict) -> None:
    """Write the unsharded initial tables into this rank's shards."""
    for name, value in dmp.state_dict().items():
        key = name.removeprefix("_dmp_wrapped_module.").removeprefix("module.")
        full = reference[key]
        if hasattr(value, "local_shards"):
            for shard in value.local_shards():
                (r0, c0), (nr, nc) = shard.metadata.shard_offsets, shard.metadata.shard_sizes
                shard.tensor.copy_(full[r0:r0 + nr, c0:c0 + nc])
        else:  # data-parallel: a full replica
            value.copy_(full)
