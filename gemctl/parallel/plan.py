"""`gemctl plan`: what a layout does at a given world size, computed without GPUs.

The model is built on the meta device (no memory), cut into the same FSDP units that
gemctl.parallel.dense makes, and every number follows from parameter shapes and the layout:

- groups: dp_shard consecutive ranks form a shard group; ranks i, i + S, i + 2S, ... a replica
  group (HSDP); each group's network tier from the topology (NVLink inside a node, the zone
  network inside a zone, across zones beyond).
- memory per rank (rank 0, whose shards are the largest): FSDP2 keeps an fp32 shard of
  ceil(dim0 / S) rows of every parameter, the same for its gradient; AdamW two fp32 states per
  dense shard; row-wise Adagrad one fp32 per table row of the shard (Adam: two per element);
  gathered parameters of two units at a time (the one running and the one prefetched) in the
  parameter dtype (bf16 with bf16 compute on CUDA), plus fp32 unsharded gradients of one unit
  before its reduce-scatter; activations by the formula in ``activation_bytes`` (an estimate).
- communication per rank per step: all-gather of every unit in forward and again in backward
  (units resharded after forward; the last block and the root stay gathered), reduce-scatter of
  every unit's gradients (fp32), and with HSDP the all-reduce of the gradient shards across
  replicas. Ring algorithm bytes: (n - 1) / n of the full buffer, twice for an all-reduce.
"""

from __future__ import annotations

import math

import torch

from gemctl.config.validate import resolve_layout, world_size

F32 = 4


def _per_rank(rows: int) -> str:
    return f"{rows} row" if rows == 1 else f"{rows} rows"


def _shard_numel(shape: torch.Size, shards: int) -> int:
    """Elements of rank 0's FSDP2 shard of a parameter (dim 0 split in ceil-sized chunks)."""
    if len(shape) == 0:
        return 1
    return math.ceil(shape[0] / shards) * math.prod(shape[1:])


def meta_model(cfg, spec):
    import importlib

    from gemctl.model import build_model

    importlib.import_module("torchrec")  # outside the meta context: importing it runs tensor code

    with torch.device("meta"):
        return build_model(cfg.model, spec, device=torch.device("meta"))


def fsdp_units(model) -> list[tuple[str, list[tuple[str, torch.nn.Parameter]]]]:
    """(unit name, its own parameters) in forward order, the root last: as apply_fsdp shards."""
    from gemctl.parallel.dense import dense_blocks

    names = {id(m): n for n, m in model.named_modules()}
    units, seen = [], set()
    for block in dense_blocks(model):
        params = [(f"{names[id(block)]}.{n}", p) for n, p in block.named_parameters()]
        seen.update(id(p) for _, p in params)
        units.append((names[id(block)], params))
    units.append(("root", [(n, p) for n, p in model.named_parameters() if id(p) not in seen]))
    return units


def _tier(ranks: list[int], gpus_per_node: int, nodes_per_zone: int) -> str:
    nodes = {r // gpus_per_node for r in ranks}
    if len(nodes) == 1:
        return "intra-node (NVLink)"
    if nodes_per_zone and len({n // nodes_per_zone for n in nodes}) > 1:
        return "cross-zone"
    return "inter-node (zone network)"


def _groups(rep: int, shard: int, gpn: int, npz: int) -> dict:
    def describe(groups):
        shown = groups if len(groups) <= 3 else groups[:2] + groups[-1:]
        return {"count": len(groups), "size": len(groups[0]), "tier": _tier(groups[0], gpn, npz),
                "examples": [g if len(g) <= 8 else g[:4] + ["..."] + g[-2:] for g in shown]}

    shard_groups = [list(range(g * shard, (g + 1) * shard)) for g in range(rep)]
    replica_groups = [list(range(i, rep * shard, shard)) for i in range(shard)]
    return {"dp_shard": describe(shard_groups), "dp_replicate": describe(replica_groups)}


def mean_history_length(source, cfg, samples: int = 4096) -> tuple[float, str]:
    """Mean history length per sample: drawn from the source's length model where it has one."""
    if hasattr(source, "unit_lengths"):
        units = max(1, samples // max(1, getattr(source, "unit_size", cfg.data.batch_size)))
        lengths = torch.cat([source.unit_lengths(u) for u in range(units)])
        return float(lengths.float().mean()), f"mean of {lengths.numel()} drawn lengths"
    return float(cfg.data.max_len), "data.max_len (upper bound: the source has no length model)"


def activation_bytes(cfg, tokens: float, batch: int, dtype_bytes: int) -> int:
    """Estimate of the activations the backward keeps, per rank per step: per token and tower
    layer the norm inputs and outputs, residual and projection outputs (5 d), q, k, v and the
    attention output (4 H D), the MLP's hidden and its activation (2 r d); cross-attention adds
    about a layer's worth without the MLP; PMA, interaction and heads scale with the batch.

    Under parallel.activation_checkpoint a checkpointed layer keeps its input (full: d, plus one
    layer's worth while the backward reruns it), the outputs of its GEMMs and attention (ops:
    3 d + 4 H D + r d), or ``budget`` of its activations (budget)."""
    m, ac = cfg.model, _checkpoint_plan(cfg)
    hd = m.num_heads * m.head_dim
    per_layer = 5 * m.d_model + 4 * hd + 2 * m.mlp_ratio * m.d_model
    tower = m.num_layers * per_layer
    if ac.mode in ("full", "ops"):
        n = len(ac.layers)
        kept = m.d_model if ac.mode == "full" else 3 * m.d_model + 4 * hd + m.mlp_ratio * m.d_model
        tower = (m.num_layers - n) * per_layer + n * kept + (per_layer if ac.mode == "full" else 0)
    elif ac.mode == "budget":
        tower = ac.budget * tower
    cross = 3 * m.d_model + 4 * hd
    pooled = batch * (m.pma_queries + 8) * m.d_model * (m.interaction_layers + 4)
    return int(dtype_bytes * (tokens * (tower + cross) + pooled))


def _checkpoint_plan(cfg):
    from gemctl.parallel.activation import CheckpointPlan

    return CheckpointPlan.from_config(cfg.parallel.activation_checkpoint, cfg.model.num_layers)


def _checkpoint_text(cfg) -> str:
    """parallel.activation_checkpoint as the plan's memory table names it."""
    ac = _checkpoint_plan(cfg)
    if ac.mode in ("full", "ops"):
        return f"{ac.mode}, {len(ac.layers)} of {ac.num_layers} tower layers"
    return f"budget {ac.budget:g}" if ac.mode == "budget" else "none"


def _ranks_text(ranks: list[int]) -> str:
    if not ranks:
        return "all (data-parallel)"
    return str(ranks) if len(ranks) <= 6 else f"{ranks[:3]} ... {ranks[-2:]} ({len(ranks)})"


def offline_table_plan(sparse_arch, cfg, world: int) -> dict:
    """torchrec's planner for the layout's topology, without a process group: the table plan
    `gemctl train` would compute on the cluster (up to the measured hardware it queries there)."""
    from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology

    from gemctl.parallel.sparse import _constraints, _sharders, plan_tables

    device = "cpu" if cfg.train.device == "cpu" else "cuda"
    topology = Topology(world_size=world, compute_device=device,
                        local_world_size=min(world, cfg.parallel.topology.gpus_per_node))
    planner = EmbeddingShardingPlanner(topology=topology, constraints=_constraints(sparse_arch, cfg.parallel.sparse.sharding_types))
    return plan_tables(planner.plan(sparse_arch, _sharders(cfg.train, device == "cpu")))


def build_plan(cfg, source) -> dict:
    """The plan of ``cfg`` (launcher and layout give the world) as a JSON-able dict."""
    world = world_size(cfg)
    rep, shard = resolve_layout(cfg, world)
    topo = cfg.parallel.topology
    on_gpu = cfg.train.device != "cpu"
    param_dtype = 2 if on_gpu and cfg.precision.compute_dtype == "bf16" else F32
    model = meta_model(cfg, source.spec)
    sparse_ids = {id(p) for p in model.sparse_parameters()}
    torchrec = cfg.parallel.sparse.sharding == "torchrec"
    units = fsdp_units(model)
    if torchrec:  # the tables leave FSDP's root unit
        units = [(name, [(n, p) for n, p in params if id(p) not in sparse_ids]) for name, params in units]
    ep = cfg.parallel.ep
    expert_ids, expert_local = set(), 0
    if ep > 1:  # expert weights leave FSDP: each rank keeps E / ep experts whole
        for layer in model.moe_layers:
            for w in (layer.up, layer.down):
                expert_ids.add(id(w))
                expert_local += w.numel() // ep
        units = [(name, [(n, p) for n, p in params if id(p) not in expert_ids]) for name, params in units]

    unit_rows = []
    dense_shard = sparse_shard = table_rows_shard = 0
    for name, params in units:
        full = sum(p.numel() for _, p in params)
        local = sum(_shard_numel(p.shape, shard) for _, p in params)
        for _, p in params:
            if id(p) in sparse_ids:
                sparse_shard += _shard_numel(p.shape, shard)
                table_rows_shard += math.ceil(p.shape[0] / shard)
            else:
                dense_shard += _shard_numel(p.shape, shard)
        unit_rows.append({"unit": name, "params": full, "shard_params": local})

    tables = [
        {"table": n.rsplit(".", 1)[0].split(".")[-1], "rows": p.shape[0], "dim": p.shape[1],
         "sharding": f"FSDP row shards: {_per_rank(math.ceil(p.shape[0] / shard))} per rank over dp_shard={shard}"
         + (f", replicated x{rep}" if rep > 1 else "")}
        for n, p in model.named_parameters() if id(p) in sparse_ids
    ]
    table_state_b = table_opt_b = 0
    if torchrec:
        table_plan = offline_table_plan(model.sparse, cfg, world)
        for t in tables:
            entry = table_plan[t["table"]]
            mine = [sh for sh, r in zip(entry["shards"], entry["ranks"]) if r == 0] if entry["shards"] else (
                [[0, 0, t["rows"], t["dim"]]] if 0 in entry["ranks"] or not entry["ranks"] else [])
            table_state_b += sum(rows * cols * F32 for _, _, rows, cols in mine)
            table_opt_b += sum(rows * F32 for _, _, rows, _ in mine)  # row-wise Adagrad: one fp32 per row
            t["sharding"] = f"torchrec {entry['sharding']} on ranks {_ranks_text(entry['ranks'])}"
            t["torchrec"] = entry

    # Memory of rank 0.
    dense_shard += expert_local  # AdamW-trained, fp32, like the FSDP shards
    if torchrec:  # tables in torchrec's shards; their gradients are fused into the update, never stored
        params_b = dense_shard * F32 + table_state_b
        grads_b = dense_shard * F32
        optimizer_b = 2 * dense_shard * F32 + table_opt_b
    else:
        params_b = grads_b = (dense_shard + sparse_shard) * F32
        sparse_opt = table_rows_shard * F32 if cfg.train.embedding_optimizer == "rowwise_adagrad" else 2 * sparse_shard * F32
        optimizer_b = 2 * dense_shard * F32 + sparse_opt
    full_units = [u["params"] for u in unit_rows]
    gathered_b = 0
    if world > 1:  # one running + one prefetched unit gathered, the last block kept, one unit's fp32 grads
        gathered_b = param_dtype * (2 * max(full_units) + full_units[-2]) + F32 * max(full_units)
    mean_len, len_how = mean_history_length(source, cfg)
    tokens = cfg.data.batch_size * mean_len
    act_b = activation_bytes(cfg, tokens, cfg.data.batch_size, param_dtype)
    memory = {"params": params_b, "grads": grads_b, "optimizer": optimizer_b, "gathered_params": gathered_b,
              "activations_estimate": act_b}
    memory["total"] = sum(memory.values())

    # Communication of one rank per step (bytes on the wire, ring algorithms).
    comm = []
    if shard > 1:
        frac = (shard - 1) / shard
        resharded = sum(full_units[:-2])  # the last block and the root stay gathered after forward
        tier = _tier(list(range(shard)), topo.gpus_per_node, topo.nodes_per_zone)
        comm.append({"collective": "all-gather (forward)", "group": f"dp_shard ({shard})", "tier": tier,
                     "bytes": int(frac * sum(full_units) * param_dtype)})
        comm.append({"collective": "all-gather (backward re-gather)", "group": f"dp_shard ({shard})", "tier": tier,
                     "bytes": int(frac * resharded * param_dtype)})
        comm.append({"collective": "reduce-scatter (gradients, fp32)", "group": f"dp_shard ({shard})", "tier": tier,
                     "bytes": int(frac * sum(full_units) * F32)})
    if torchrec and world > 1:
        # Lookups of this rank's batch come from the tables' owners and their gradients go back:
        # (W-1)/W of the looked-up embeddings each way, fp32 (an estimate: placement-dependent).
        spec = source.spec
        looked_up = (tokens * len(spec.seq_features) + cfg.data.batch_size * len(spec.sparse_features)) * cfg.model.embedding_dim
        comm.append({"collective": "all-to-all (embedding lookups, fwd + bwd)", "group": f"world ({world})",
                     "tier": _tier(list(range(world)), topo.gpus_per_node, topo.nodes_per_zone),
                     "bytes": int(2 * (world - 1) / world * looked_up * F32)})
    if ep > 1 and cfg.model.moe.n_experts:
        # Every assignment (token x top_k) of this rank travels to its expert's rank and back, in
        # the forward and again (gradients) in the backward; (ep-1)/ep of them leave the rank.
        moe = cfg.model.moe
        rows = tokens * moe.top_k * cfg.model.num_layers
        comm.append({"collective": "all-to-all (MoE dispatch + combine, fwd + bwd)", "group": f"ep ({ep})",
                     "tier": _tier(list(range(ep)), topo.gpus_per_node, topo.nodes_per_zone),
                     "bytes": int(4 * (ep - 1) / ep * rows * cfg.model.d_model * param_dtype)})
        if world > ep:
            comm.append({"collective": "all-reduce (expert gradients, fp32)", "group": f"expert replicas ({world // ep})",
                         "tier": _tier(list(range(0, world, ep)), topo.gpus_per_node, topo.nodes_per_zone),
                         "bytes": int(2 * (world // ep - 1) / (world // ep) * expert_local * F32)})
    if rep > 1:
        replica = list(range(0, rep * shard, shard))
        comm.append({"collective": "all-reduce (gradient shards, fp32)", "group": f"dp_replicate ({rep})",
                     "tier": _tier(replica, topo.gpus_per_node, topo.nodes_per_zone),
                     "bytes": int(2 * (rep - 1) / rep * sum(u["shard_params"] for u in unit_rows) * F32)})

    return {
        "world_size": world, "dp_replicate": rep, "dp_shard": shard, "layout": cfg.parallel.name,
        "gpus_per_node": topo.gpus_per_node, "nodes_per_zone": topo.nodes_per_zone,
        "model": cfg.model.name, "dense_params": sum(p.numel() for p in model.dense_parameters()),
        "embedding_params": sum(p.numel() for p in model.sparse_parameters()),
        "param_dtype_bytes": param_dtype, "local_batch": cfg.data.batch_size,
        "mean_history_length": mean_len, "mean_history_length_from": len_how,
        "groups": _groups(rep, shard, topo.gpus_per_node, topo.nodes_per_zone),
        "units": unit_rows, "tables": tables, "memory_bytes_rank0": memory,
        "activation_checkpoint": _checkpoint_text(cfg), "communication_per_step": comm,
    }
