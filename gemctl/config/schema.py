"""Typed config schema, registered in Hydra's ConfigStore.

Each component gets its own dataclass and is handed only its own slice. The YAML files under
``configs/`` merge into these nodes, so an unknown key or a value of the wrong type is an error at
compose time, never a silent default. Cross-field checks live in :mod:`gemctl.config.validate`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional

from hydra.core.config_store import ConfigStore


@dataclass
class KernelsConfig:
    """Implementation of each attention op (gemctl.ops): auto (bundled Triton kernel on CUDA where
    it is GPU-verified, else the PyTorch reference), torch (reference), triton (force the kernel)."""

    jagged_attention: str = "auto"
    gdpa: str = "auto"
    block_attention: str = "auto"


@dataclass
class MoEConfig:
    """Mixture of experts in the sequence tower's MLPs (gemctl.model.moe); 0 experts: dense MLP."""

    n_experts: int = 0
    top_k: int = 2
    aux_loss_weight: float = 0.01  # x the Switch load-balancing loss, summed over layers


@dataclass
class ModelConfig:
    name: str = "tiny"
    embedding_dim: int = 32  # width of every embedding table
    d_model: int = 64  # width of the token stream in the towers
    num_heads: int = 2
    head_dim: int = 32
    num_layers: int = 2
    mlp_ratio: int = 4
    # Attention kind per sequence-tower layer: "full", "window:<w>" (sliding window: the w most
    # recent keys up to the query, with the relative-position bias like full) or
    # "block:<block_size>". One entry applies to every layer; otherwise one entry per layer.
    attention: List[str] = field(default_factory=lambda: ["full"])
    # Rotary position embedding of the block attention layers (positions from the sequence
    # start): the frequency base, e.g. 10000; 0 turns it off. full/window layers use relpos.
    rope_base: float = 0.0
    causal: bool = True
    # Relative-position bias of the sequence tower: a learned [num_heads, relpos_buckets] table,
    # log-bucketed distances (0 turns it off).
    relpos_buckets: int = 32
    relpos_max_distance: int = 128
    pma_queries: int = 4  # learned queries pooling the history (PMA)
    gdpa_activation: str = "gelu"  # activation of PMA / cross-attention (GDPA)
    interaction_layers: int = 2  # low-rank cross layers over the pooled tokens
    interaction_rank: int = 64
    head_hidden: int = 128  # hidden width of each task head
    kernels: KernelsConfig = field(default_factory=KernelsConfig)  # e.g. model.kernels.gdpa=torch
    moe: MoEConfig = field(default_factory=MoEConfig)


@dataclass
class PrecisionRule:
    """Assigns a compute format to the modules whose dotted path matches ``match`` (fnmatch).

    ``last_n_layers`` restricts a rule to the last N sequence-tower layers (e.g. keep the late,
    numerically sensitive layers in higher precision). Later rules win over earlier ones.
    """

    match: str = "*"
    format: str = "bf16"
    last_n_layers: Optional[int] = None


@dataclass
class MXConfig:
    """Options of the ``mxfp8`` format (gemctl.precision.mx_linear): MX blocks of 32 values along
    each GEMM's contraction axis with a shared E8M0 scale."""

    elem: str = "e4m3"  # element format of the forward operands (activations, weights): e4m3 | e5m2
    grad_elem: str = "e4m3"  # element format of the output gradient in the backward GEMMs: e4m3 | e5m2
    scale_rule: str = "rceil"  # floor (the OCP spec's rule; the block max may saturate) | rceil (round up)
    wgrad_format: str = "mxfp8"  # weight-gradient GEMM: mxfp8 | bf16 (unquantized, compute dtype)
    hadamard_wgrad: bool = False  # random Hadamard rotation of both wgrad operands along the tokens
    hadamard_seed: int = 0  # seed of the rotation's fixed sign vector
    stochastic_rounding: bool = False  # round the gradient operands stochastically (unbiased)
    attention: bool = False  # MXFP8 QK^T and PV operands where the QKV projection is mxfp8 (full/window layers)
    fsdp_gather: bool = True  # FSDP/HSDP: all-gather mxfp8 Linear weights MX-quantized (gemctl.precision.mx_fsdp)


@dataclass
class Fp8Config:
    """Options of the ``fp8`` format (gemctl.precision.fp8_linear): E4M3 GEMMs on FP8 tensor cores
    with power-of-two scales along each GEMM's contraction axis."""

    granularity: str = "row"  # values sharing a scale: row (whole contraction) | block128 | mx32
    wgrad: str = "fp8"  # weight-gradient GEMM: fp8 | bf16 (unquantized)
    dgrad: str = "fp8"  # input-gradient GEMM: fp8 | bf16 (unquantized; with wgrad bf16: FP8 forward only)
    fused_mlp: bool = True  # row-wise MLP blocks (up -> SiLU -> down) with fused producers
    fused_qkv_norm: bool = True  # row: the attention's pre-norm fused into the QKV projection's FP8 casts
    token_chunk: int = 4096  # row: tokens per scale of the weight-gradient operands (a multiple of 128)
    hadamard: int = 0  # rotate both forward operands along K by a random Hadamard per this many features (0: off; a power of two)
    hadamard_seed: int = 0  # seed of that rotation's fixed sign vector
    fsdp_gather: bool = True  # FSDP/HSDP: all-gather fp8 Linear weights FP8-quantized (gemctl.precision.fp8_fsdp)


@dataclass
class PrecisionConfig:
    name: str = "bf16"
    compute_dtype: str = "bf16"  # autocast dtype on CUDA: bf16 | fp32 (CPU always runs fp32)
    rules: List[PrecisionRule] = field(default_factory=list)
    mx: MXConfig = field(default_factory=MXConfig)  # used by rules whose format is mxfp8
    fp8: Fp8Config = field(default_factory=Fp8Config)  # used by rules whose format is fp8


@dataclass
class TopologyConfig:
    gpus_per_node: int = 8  # ranks that share a node (NVLink domain); torchrun: nproc_per_node
    nodes_per_zone: int = 0  # nodes per network zone (RoCE inside, oversubscribed across); 0: one zone


@dataclass
class SparseParallelConfig:
    """Embedding tables under a distributed layout. fsdp: row shards of FSDP2 like any parameter
    (all-gathered for the lookup). torchrec: DistributedModelParallel shards the tables, the
    planner choosing per table among ``sharding_types``, lookups by all-to-all, row-wise Adagrad
    fused into the backward (fbgemm)."""

    sharding: str = "fsdp"  # fsdp | torchrec
    sharding_types: List[str] = field(default_factory=lambda: ["table_wise", "row_wise"])


@dataclass
class ActivationCheckpointConfig:
    """Activation checkpointing of the sequence tower's layers, step 2 of parallelize
    (gemctl.parallel.activation). A checkpointed layer keeps less of its forward for the backward
    and runs part of the forward again there: less memory for some extra time, so a larger batch
    fits (GEM.md item 6).

    mode: none; full (keep only the layer's input, recompute the whole layer); ops (keep the outputs
    of the GEMMs and attention kernels, recompute the norms, activations and residual adds);
    budget (torch.compile's partitioner chooses what to recompute so the compiled layers keep at
    most ``budget`` of their activation memory; needs parallel.compile=true)."""

    mode: str = "none"  # none | full | ops | budget
    every: int = 1  # full / ops: checkpoint tower layers 0, every, 2*every, ... (1: every layer)
    budget: float = 0.5  # budget: share of the activation memory kept, in (0, 1)


@dataclass
class ParallelConfig:
    """Dense data-parallel layout over the world: dp_replicate x dp_shard ranks (2-D FSDP/HSDP).

    dp_shard ranks shard every dense block (FSDP2); dp_replicate groups hold replicas and
    all-reduce their gradients (HSDP). -1 fills the dimension with world size / the other one.
    """

    name: str = "single"
    dp_replicate: int = 1
    dp_shard: int = 1
    ep: int = 1  # expert-parallel degree: MoE experts split over groups of ep ranks (gemctl.parallel.expert)
    compile: bool = False  # torch.compile every sequence-tower layer (gemctl.parallel.compile)
    activation_checkpoint: ActivationCheckpointConfig = field(default_factory=ActivationCheckpointConfig)
    sparse: SparseParallelConfig = field(default_factory=SparseParallelConfig)
    topology: TopologyConfig = field(default_factory=TopologyConfig)


@dataclass
class SyntheticDataConfig:
    num_items: int = 20000
    num_actions: int = 8
    num_users: int = 5000
    num_ads: int = 2000
    num_contexts: int = 64
    context_hotness: int = 3  # context ids per sample (multi-hot bag)
    length_sigma: float = 0.8  # log-normal sigma of history lengths
    zero_length_fraction: float = 0.02
    zipf_alpha: float = 1.1
    teacher_scale: float = 2.0  # strength of the teacher's signal (logit scale)
    base_ctr: float = 0.2
    eval_samples: int = 4096


@dataclass
class MovieLensDataConfig:
    positive_rating: int = 4  # label = rating >= this
    eval_fraction: float = 0.2  # latest fraction of interactions (by time) held out
    min_history: int = 0  # drop training targets with fewer earlier interactions than this


@dataclass
class ParquetDataConfig:
    """Your own samples, one Parquet row each (gemctl/data/parquet.py says what each column holds)."""

    train: str = ""  # a file, a directory of *.parquet files, or a glob
    eval: str = ""
    # "column:vocabulary size" each, e.g. [item_id:100000,action:8]: history columns (lists of ids)
    seq_features: List[str] = field(default_factory=list)
    sparse_features: List[str] = field(default_factory=list)  # "column:vocabulary size": id or id-list columns
    dense: List[str] = field(default_factory=list)  # float columns
    labels: List[str] = field(default_factory=lambda: ["label"])  # 0/1 columns, one task each
    weight: Optional[str] = None  # sample-weight column
    sample_id: Optional[str] = None  # int64 id column (else the row number)


@dataclass
class DataConfig:
    name: str = "synthetic"
    source: str = "synthetic"  # synthetic | movielens100k | parquet
    batch_size: int = 128
    eval_batch_size: int = 512
    max_len: int = 64
    seed: int = 1234
    num_workers: int = 0  # background loader processes; 0 loads in a thread of the trainer
    prefetch: int = 2  # batches kept ready ahead of the step
    validate: bool = True  # check every batch (ids in range, offsets, labels)
    synthetic: SyntheticDataConfig = field(default_factory=SyntheticDataConfig)
    movielens: MovieLensDataConfig = field(default_factory=MovieLensDataConfig)
    parquet: ParquetDataConfig = field(default_factory=ParquetDataConfig)


@dataclass
class ShuffleConfig:
    name: str = "none"
    kind: str = "none"  # none | bbs (Base Batch Shuffling)
    sub_batch_size: int = 128  # bbs: samples per sub-batch (must divide data.batch_size)
    key: str = "tokens"  # bbs: order sub-batches by total history tokens | attention (sum L^2)


@dataclass
class LauncherConfig:
    """local: this process, one rank. torchrun: the same resolved config on every rank of
    nnodes x nproc_per_node processes (torch.distributed.run), one run directory for all.
    slurm: a batch job of nnodes nodes, one task per node running torchrun (gemctl.launch.slurm)."""

    name: str = "local"
    kind: str = "local"  # local | torchrun
    nproc_per_node: int = 1
    nnodes: int = 1
    node_rank: int = 0  # torchrun with a static rendezvous: this node's rank
    rdzv_endpoint: str = "localhost:29500"  # host:port of the rendezvous (node 0)
    max_restarts: int = 0
    # slurm (through submitit): one task per node, each running torchrun on that node's GPUs.
    partition: Optional[str] = None
    account: Optional[str] = None
    qos: Optional[str] = None
    constraint: Optional[str] = None
    time_min: int = 60  # wall-clock limit in minutes
    cpus_per_task: Optional[int] = None  # per node (the one task); null: the cluster's default
    mem: Optional[str] = None  # per node, e.g. 512G
    rdzv_port: int = 29500  # port on the allocation's first node


@dataclass
class TrainConfig:
    steps: int = 300
    seed: int = 0
    device: str = "auto"  # auto | cpu | cuda
    lr: float = 3e-3  # AdamW, dense parameters
    weight_decay: float = 0.01
    betas: List[float] = field(default_factory=lambda: [0.9, 0.98])
    warmup_steps: int = 20
    grad_clip: float = 1.0  # 0 disables clipping
    embedding_optimizer: str = "rowwise_adagrad"  # rowwise_adagrad | adam
    embedding_lr: float = 0.05
    eval_every: int = 0  # 0: evaluate once at the end
    eval_batches: int = 0  # 0: the whole held-out split
    log_every: int = 10
    warmup_timing_steps: int = 5  # steps left out of the throughput averages (compilation, caches)
    # Deterministic algorithms: null = on a CPU only (the default); true = on every device (CUDA:
    # torch's deterministic kernels and a fixed cuBLAS workspace, slower; for ablations whose
    # seeds must repeat exactly); false = off.
    deterministic: Optional[bool] = None
    checkpoint_every: int = 0  # steps between checkpoints (0: none); gemctl/train/checkpoint.py
    keep_last: int = 3  # published checkpoints kept (0: all)
    checkpoint_dir: Optional[str] = None  # null: <run directory>/checkpoints
    resume: str = "none"  # none | auto (newest checkpoint in checkpoint_dir) | a path
    # Copy the state to host memory at the checkpoint step and write it in a background thread
    # (published once every rank has finished, at the next checkpoint or the end of training).
    async_checkpoint: bool = False
    # Non-finite loss or gradients: stop (checked when losses are read, every log_every steps;
    # exit 3 naming the step, tensor and sample ids) | skip (checked every step, one device sync:
    # the step's update is dropped, warned and counted in the summary).
    nonfinite: str = "stop"
    # One JSON line per trained step and rank with the step's sample ids, in
    # <run directory>/samples/rank<r>.jsonl (gemctl/train/ledger.py): proves across restarts that
    # no sample was lost or trained twice (scripts/fault_inject.py reads it).
    sample_ledger: bool = False


@dataclass
class MetricsConfig:
    # Peak dense TFLOP/s used for MFU; null: look the device up in the peak table, or measure
    # a calibration GEMM when it is not there (labelled as measured).
    peak_tflops: Optional[float] = None
    # Distributed runs: rank 0 first times this many steps of an unsharded copy of the model on
    # its own local batches (the other ranks wait): Local MFU, and Scaling Ratio = the job's
    # per-rank model FLOP/s / that single-rank FLOP/s. 0 skips it (Local MFU is then unknown).
    scaling_baseline_steps: int = 0


@dataclass
class ProfileConfig:
    warmup_steps: int = 3  # steps before measuring (compilation, autotuning, caches)
    steps: int = 5  # steps timed without the profiler, then again under it


@dataclass
class RunConfig:
    name: str = "default"
    output_dir: str = "runs"  # run directories are created under this
    progress: bool = True  # rich progress bar


@dataclass
class GemConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    shuffle: ShuffleConfig = field(default_factory=ShuffleConfig)
    launcher: LauncherConfig = field(default_factory=LauncherConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    run: RunConfig = field(default_factory=RunConfig)


def register() -> None:
    cs = ConfigStore.instance()
    cs.store(name="gemctl_schema", node=GemConfig)
