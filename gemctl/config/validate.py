"""Cross-field validation: runs after compose, before anything is built or written.

Each failure is a ConfigError naming the field to change and what is allowed.
"""

from __future__ import annotations

import re

from gemctl.errors import ConfigError

ATTENTION_KINDS = "full | block:<block_size> | window:<window> (integers >= 1)"
PRECISION_FORMATS = ("bf16", "fp32", "mxfp8", "fp8")
FP8_GRANULARITIES = ("row", "block128", "mx32")
FP8_GRAD_FORMATS = ("fp8", "bf16")  # precision.fp8.wgrad / dgrad: the gradient GEMM quantized or not
MX_ELEMS = ("e4m3", "e5m2")
MX_SCALE_RULES = ("floor", "rceil")
MX_WGRAD_FORMATS = ("mxfp8", "bf16")
COMPUTE_DTYPES = ("bf16", "fp32")
DEVICES = ("auto", "cpu", "cuda")
EMBEDDING_OPTIMIZERS = ("rowwise_adagrad", "adam")
SHUFFLES = ("none", "bbs")
SHUFFLE_KEYS = ("tokens", "attention")
LAUNCHERS = ("local", "torchrun", "slurm")
SOURCES = ("synthetic", "movielens100k", "parquet")
GDPA_ACTIVATIONS = ("gelu", "silu")
KERNEL_BACKENDS = ("auto", "torch", "triton")
KERNEL_OPS = ("jagged_attention", "gdpa", "block_attention")  # model.kernels.<op>
SPARSE_SHARDINGS = ("fsdp", "torchrec")
CHECKPOINT_MODES = ("none", "full", "ops", "budget")  # parallel.activation_checkpoint.mode
_SLURM_SAFE = re.compile(r"[A-Za-z0-9_.,:@%+=/-]+")
SPARSE_SHARDING_TYPES = ("table_wise", "row_wise", "column_wise", "table_row_wise", "data_parallel")


def _positive(cfg, path: str, allow_zero: bool = False) -> None:
    value = cfg
    for part in path.split("."):
        value = getattr(value, part)
    if value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ConfigError(path, f"must be {bound}, got {value}")


def _one_of(value, allowed, path: str) -> None:
    if value not in allowed:
        raise ConfigError(path, f"'{value}' is not allowed; allowed: {', '.join(map(str, allowed))}")


def _triton_needs_a_gpu(m, device: str) -> None:
    """model.kernels.<op>=triton on a run that trains on the CPU: the kernels run there only in
    Triton's interpreter (TRITON_INTERPRET=1, as the tests do); otherwise the first step would stop
    with a traceback after the run directory was made."""
    import os

    import torch

    if device == "cuda" or (device == "auto" and torch.cuda.is_available()) or os.environ.get("TRITON_INTERPRET") == "1":
        return
    for op in KERNEL_OPS:
        if getattr(m.kernels, op) == "triton":
            raise ConfigError(f"model.kernels.{op}", "'triton' needs a CUDA device and this run trains on the CPU; "
                              "allowed here: auto, torch (or TRITON_INTERPRET=1: the kernel in Triton's interpreter, slow)")


def validate(cfg, check_device: bool = True) -> None:
    """All cross-field checks; ``check_device=False`` skips the visible-CUDA check (planning a
    GPU job from a machine without one)."""
    m, d, t, p = cfg.model, cfg.data, cfg.train, cfg.precision
    for f in ("embedding_dim", "d_model", "num_heads", "head_dim", "num_layers", "mlp_ratio",
              "pma_queries", "interaction_rank", "head_hidden"):
        _positive(cfg, f"model.{f}")
    _positive(cfg, "model.interaction_layers", allow_zero=True)
    _positive(cfg, "model.relpos_buckets", allow_zero=True)
    if m.relpos_buckets and m.relpos_max_distance < 1:
        raise ConfigError("model.relpos_max_distance", f"must be >= 1, got {m.relpos_max_distance}")
    if m.head_dim % 8:
        raise ConfigError("model.head_dim", f"must be a multiple of 8 (kernels tile it), got {m.head_dim}")
    _one_of(m.gdpa_activation, GDPA_ACTIVATIONS, "model.gdpa_activation")
    moe = m.moe
    _positive(cfg, "model.moe.n_experts", allow_zero=True)
    if moe.n_experts and not 1 <= moe.top_k <= moe.n_experts:
        raise ConfigError("model.moe.top_k", f"must be in [1, model.moe.n_experts={moe.n_experts}], got {moe.top_k}")
    if moe.aux_loss_weight < 0:
        raise ConfigError("model.moe.aux_loss_weight", f"must be >= 0, got {moe.aux_loss_weight}")
    for op in KERNEL_OPS:
        _one_of(getattr(m.kernels, op), KERNEL_BACKENDS, f"model.kernels.{op}")
    kinds = list(m.attention)
    if len(kinds) not in (1, m.num_layers):
        raise ConfigError(
            "model.attention",
            f"has {len(kinds)} entries; give 1 (all layers) or model.num_layers={m.num_layers}",
        )
    forced_block_kernel = m.kernels.block_attention == "triton"  # its shapes only ("auto" takes the reference)
    for i, kind in enumerate(kinds):
        match = re.fullmatch(r"full|(?:block|window):(\d+)", kind)
        if not match or (match.group(1) is not None and int(match.group(1)) < 1):
            raise ConfigError(f"model.attention[{i}]", f"'{kind}' is not allowed; allowed: {ATTENTION_KINDS}")
        if forced_block_kernel and kind.startswith("block:"):
            from gemctl.ops import BLOCK_KERNEL_DIMS, BLOCK_KERNEL_SIZES  # torch: only where the kernel is forced

            if int(match.group(1)) not in BLOCK_KERNEL_SIZES:
                raise ConfigError(f"model.attention[{i}]", f"'{kind}': model.kernels.block_attention=triton takes block "
                                  f"sizes {', '.join(map(str, BLOCK_KERNEL_SIZES))} (or set it to auto or torch)")
            if m.head_dim not in BLOCK_KERNEL_DIMS:
                raise ConfigError("model.head_dim", f"model.kernels.block_attention=triton takes head dims "
                                  f"{', '.join(map(str, BLOCK_KERNEL_DIMS))}, got {m.head_dim} (or set it to auto or "
                                  "torch)")
    if m.rope_base < 0 or (0 < m.rope_base <= 1):
        raise ConfigError("model.rope_base", f"must be 0 (off) or > 1 (e.g. 10000), got {m.rope_base}")

    _one_of(p.compute_dtype, COMPUTE_DTYPES, "precision.compute_dtype")
    _one_of(p.mx.elem, MX_ELEMS, "precision.mx.elem")
    _one_of(p.mx.grad_elem, MX_ELEMS, "precision.mx.grad_elem")
    _one_of(p.mx.scale_rule, MX_SCALE_RULES, "precision.mx.scale_rule")
    _one_of(p.mx.wgrad_format, MX_WGRAD_FORMATS, "precision.mx.wgrad_format")
    _positive(cfg, "precision.mx.hadamard_seed", allow_zero=True)
    blocks = [i for i, kind in enumerate(kinds) if kind.startswith("block:")]
    if p.mx.attention and blocks:
        raise ConfigError("precision.mx.attention", f"quantizes full and window attention only; model.attention"
                          f"[{blocks[0]}] is '{kinds[blocks[0]]}' (block attention has no quantized operands)")
    _one_of(p.fp8.granularity, FP8_GRANULARITIES, "precision.fp8.granularity")
    _one_of(p.fp8.wgrad, FP8_GRAD_FORMATS, "precision.fp8.wgrad")
    _one_of(p.fp8.dgrad, FP8_GRAD_FORMATS, "precision.fp8.dgrad")
    if p.fp8.token_chunk < 128 or p.fp8.token_chunk % 128:
        raise ConfigError("precision.fp8.token_chunk", f"must be a positive multiple of 128, got {p.fp8.token_chunk}")
    h = p.fp8.hadamard
    if h < 0 or h == 1 or h & (h - 1) or h > 4096:
        raise ConfigError("precision.fp8.hadamard", f"must be 0 (off) or a power of two from 2 to 4096, got {h}")
    _positive(cfg, "precision.fp8.hadamard_seed", allow_zero=True)
    for i, rule in enumerate(p.rules):
        _one_of(rule.format, PRECISION_FORMATS, f"precision.rules[{i}].format")
        if rule.last_n_layers is not None and not 1 <= rule.last_n_layers <= m.num_layers:
            raise ConfigError(
                f"precision.rules[{i}].last_n_layers",
                f"must be in [1, model.num_layers={m.num_layers}], got {rule.last_n_layers}",
            )

    _one_of(d.source, SOURCES, "data.source")
    for f in ("batch_size", "eval_batch_size", "max_len", "prefetch"):
        _positive(cfg, f"data.{f}")
    _positive(cfg, "data.num_workers", allow_zero=True)
    s = d.synthetic
    for f in ("num_items", "num_actions", "num_users", "num_ads", "num_contexts", "context_hotness", "eval_samples"):
        _positive(cfg, f"data.synthetic.{f}")
    if not 0 <= s.zero_length_fraction < 1:
        raise ConfigError("data.synthetic.zero_length_fraction", f"must be in [0, 1), got {s.zero_length_fraction}")
    if not 0 < s.base_ctr < 1:
        raise ConfigError("data.synthetic.base_ctr", f"must be in (0, 1), got {s.base_ctr}")
    if s.length_sigma < 0:
        raise ConfigError("data.synthetic.length_sigma", f"must be >= 0, got {s.length_sigma}")
    if s.zipf_alpha <= 0:
        raise ConfigError("data.synthetic.zipf_alpha", f"must be > 0, got {s.zipf_alpha}")
    if not 0 < d.movielens.eval_fraction < 1:
        raise ConfigError("data.movielens.eval_fraction", f"must be in (0, 1), got {d.movielens.eval_fraction}")

    _one_of(cfg.shuffle.kind, SHUFFLES, "shuffle.kind")
    if cfg.shuffle.kind == "bbs":
        _one_of(cfg.shuffle.key, SHUFFLE_KEYS, "shuffle.key")
        _positive(cfg, "shuffle.sub_batch_size")
        if d.batch_size % cfg.shuffle.sub_batch_size:
            raise ConfigError(
                "shuffle.sub_batch_size",
                f"{cfg.shuffle.sub_batch_size} must divide data.batch_size={d.batch_size}",
            )
    validate_layout(cfg)

    _one_of(t.device, DEVICES, "train.device")
    if t.device == "cuda" and check_device:
        import torch

        if not torch.cuda.is_available():
            raise ConfigError("train.device", "'cuda' requested but no CUDA device is visible; allowed here: auto, cpu")
    if check_device:
        _triton_needs_a_gpu(m, t.device)
    _one_of(t.embedding_optimizer, EMBEDDING_OPTIMIZERS, "train.embedding_optimizer")
    _one_of(t.nonfinite, ("stop", "skip"), "train.nonfinite")
    _positive(cfg, "train.checkpoint_every", allow_zero=True)
    _positive(cfg, "train.keep_last", allow_zero=True)

    for f in ("steps", "lr", "embedding_lr", "log_every"):
        _positive(cfg, f"train.{f}")
    for f in ("warmup_steps", "grad_clip", "eval_every", "eval_batches", "weight_decay", "warmup_timing_steps"):
        _positive(cfg, f"train.{f}", allow_zero=True)
    if len(t.betas) != 2 or not all(0 <= b < 1 for b in t.betas):
        raise ConfigError("train.betas", f"must be two numbers in [0, 1), got {list(t.betas)}")
    if t.warmup_timing_steps >= t.steps:
        raise ConfigError(
            "train.warmup_timing_steps",
            f"must be < train.steps={t.steps} (steps left out of throughput averages; for a short run "
            f"give train.warmup_timing_steps=0)",
        )
    _positive(cfg, "profile.steps")
    _positive(cfg, "profile.warmup_steps", allow_zero=True)
    _positive(cfg, "metrics.scaling_baseline_steps", allow_zero=True)
    if cfg.metrics.peak_tflops is not None and cfg.metrics.peak_tflops <= 0:
        raise ConfigError("metrics.peak_tflops", f"must be > 0 or null, got {cfg.metrics.peak_tflops}")
    _check_output_dir(cfg)


def _check_output_dir(cfg) -> None:
    """run.output_dir/run.name must be a directory or creatable as one: no part of it a file."""
    from pathlib import Path

    root = Path(cfg.run.output_dir)
    for path in (root / cfg.run.name, *(root / cfg.run.name).parents):
        if path.exists():
            if not path.is_dir():
                field = "run.name" if root in path.parents else "run.output_dir"
                raise ConfigError(field, f"{path} is a file; runs go into a directory (created if missing)")
            return


def world_size(cfg) -> int:
    """Ranks the launcher starts: 1 in-process, nnodes x nproc_per_node under torchrun."""
    if cfg.launcher.kind in ("torchrun", "slurm"):
        return cfg.launcher.nnodes * cfg.launcher.nproc_per_node
    return 1


def resolve_layout(cfg, world: int) -> tuple[int, int]:
    """(dp_replicate, dp_shard) for ``world`` ranks, -1 filled in; ConfigError naming the field
    when the layout does not tile the world."""
    par = cfg.parallel
    rep, shard = par.dp_replicate, par.dp_shard
    for name, value in (("dp_replicate", rep), ("dp_shard", shard)):
        if value == 0 or value < -1:
            raise ConfigError(f"parallel.{name}", f"must be >= 1 or -1 (fill from the world size), got {value}")
    if rep == -1 and shard == -1:
        raise ConfigError("parallel.dp_replicate", "only one of dp_replicate and dp_shard may be -1")
    if rep == -1 or shard == -1:
        known = shard if rep == -1 else rep
        field_name = "dp_replicate" if rep == -1 else "dp_shard"
        if world % known:
            raise ConfigError(
                f"parallel.{'dp_shard' if rep == -1 else 'dp_replicate'}",
                f"{known} does not divide the world size {world} (launcher), so parallel.{field_name}=-1 cannot fill it",
            )
        rep, shard = (world // known, known) if rep == -1 else (known, world // known)
    if rep * shard != world and cfg.launcher.kind == "local":
        raise ConfigError(
            "parallel",
            f"layout '{par.name}' needs {rep * shard} ranks but launcher=local runs 1; use launcher=torchrun "
            f"launcher.nproc_per_node={rep * shard}, or parallel=single",
        )
    if rep * shard != world:
        raise ConfigError(
            "parallel",
            f"layout '{par.name}' is dp_replicate={rep} x dp_shard={shard} = {rep * shard} ranks, but the launcher "
            f"starts {world} (launcher.nnodes x launcher.nproc_per_node); make them equal",
        )
    return rep, shard


def _check_activation_checkpoint(cfg) -> None:
    ac = cfg.parallel.activation_checkpoint
    _one_of(ac.mode, CHECKPOINT_MODES, "parallel.activation_checkpoint.mode")
    if ac.mode in ("full", "ops") and not 1 <= ac.every <= cfg.model.num_layers:
        raise ConfigError("parallel.activation_checkpoint.every", f"must be in [1, model.num_layers="
                          f"{cfg.model.num_layers}] (checkpoint every k-th tower layer), got {ac.every}")
    if ac.mode == "budget":
        if not 0 < ac.budget < 1:
            raise ConfigError("parallel.activation_checkpoint.budget",
                              f"must be in (0, 1) (the share of activation memory kept), got {ac.budget}")
        if not cfg.parallel.compile:
            raise ConfigError("parallel.activation_checkpoint.mode", "'budget' is torch.compile's choice of what to "
                              "recompute and needs parallel.compile=true; without it use full or ops")


def validate_layout(cfg) -> None:
    """Launcher and parallel layout against each other: checked before anything launches."""
    launcher, par = cfg.launcher, cfg.parallel
    _one_of(launcher.kind, LAUNCHERS, "launcher.kind")
    for f in ("nproc_per_node", "nnodes", "max_restarts"):
        _positive(cfg, f"launcher.{f}", allow_zero=f == "max_restarts")
    if launcher.kind == "local" and (launcher.nproc_per_node != 1 or launcher.nnodes != 1):
        raise ConfigError("launcher.nproc_per_node", "launcher=local runs one process; allowed: 1 (use launcher=torchrun)")
    if launcher.kind == "torchrun":
        if not 0 <= launcher.node_rank < launcher.nnodes:
            raise ConfigError("launcher.node_rank", f"must be in [0, launcher.nnodes={launcher.nnodes}), got {launcher.node_rank}")
        if not re.fullmatch(r"[^:\s]+:\d+", launcher.rdzv_endpoint):
            raise ConfigError("launcher.rdzv_endpoint", f"must be host:port, got '{launcher.rdzv_endpoint}'")
    if launcher.kind == "slurm":
        # Values that reach the sbatch script (#SBATCH lines, the srun command's log paths) must be
        # plain words: refused, not quoted, since submitit writes them verbatim.
        for name, value in (("launcher.partition", launcher.partition), ("launcher.account", launcher.account),
                            ("launcher.qos", launcher.qos), ("launcher.constraint", launcher.constraint),
                            ("launcher.mem", launcher.mem), ("run.name", cfg.run.name),
                            ("run.output_dir", cfg.run.output_dir)):
            if value is not None and not _SLURM_SAFE.fullmatch(str(value)):
                raise ConfigError(name, f"{str(value)!r} has characters a Slurm script would interpret; "
                                  "allowed: letters, digits and _ . , : @ % + = / -")
        _positive(cfg, "launcher.time_min")
        if not 1 <= launcher.rdzv_port <= 65535:
            raise ConfigError("launcher.rdzv_port", f"must be a port in [1, 65535], got {launcher.rdzv_port}")
        if launcher.cpus_per_task is not None:
            _positive(cfg, "launcher.cpus_per_task")
    _positive(cfg, "parallel.topology.gpus_per_node")
    _positive(cfg, "parallel.topology.nodes_per_zone", allow_zero=True)
    _one_of(par.sparse.sharding, SPARSE_SHARDINGS, "parallel.sparse.sharding")
    _check_activation_checkpoint(cfg)
    if not par.sparse.sharding_types:
        raise ConfigError("parallel.sparse.sharding_types", f"give at least one of {', '.join(SPARSE_SHARDING_TYPES)}")
    for i, kind in enumerate(par.sparse.sharding_types):
        _one_of(kind, SPARSE_SHARDING_TYPES, f"parallel.sparse.sharding_types[{i}]")
    if par.sparse.sharding == "torchrec":
        if launcher.kind == "local":
            raise ConfigError("parallel.sparse.sharding", "torchrec shards the tables across ranks; it needs "
                              "launcher=torchrun or launcher=slurm (launcher=local runs one process)")
        if cfg.train.embedding_optimizer != "rowwise_adagrad":
            raise ConfigError("train.embedding_optimizer", "parallel.sparse.sharding=torchrec fuses row-wise Adagrad "
                              "into the backward; allowed: rowwise_adagrad")
    _positive(cfg, "parallel.ep")
    world = world_size(cfg)
    _, shard = resolve_layout(cfg, world)
    gpn = par.topology.gpus_per_node
    if par.ep > 1:
        experts = cfg.model.moe.n_experts
        if not experts or experts % par.ep:
            raise ConfigError("parallel.ep", f"{par.ep} must divide model.moe.n_experts={experts} (expert parallelism "
                              "splits the experts of an MoE model)")
        if shard % par.ep or gpn % par.ep:
            raise ConfigError("parallel.ep", f"{par.ep} must divide parallel.dp_shard={shard} and "
                              f"parallel.topology.gpus_per_node={gpn} (EP groups stay inside a node and a shard group)")
    if shard > gpn and shard % gpn:
        raise ConfigError(
            "parallel.dp_shard",
            f"{shard} spans nodes unevenly: a shard group larger than a node must be a multiple of "
            f"parallel.topology.gpus_per_node={gpn}",
        )
    if cfg.data.batch_size < 1:
        raise ConfigError("data.batch_size", f"must be > 0 (per rank), got {cfg.data.batch_size}")
