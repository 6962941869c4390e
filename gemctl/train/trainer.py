"""The one trainer: build from a validated config, train, evaluate, report.

    setup    device, seeds, data source, model, precision rules, optimizers, peak FLOP/s
    train    step = forward, loss, backward, clip, optimizer; metrics every log_every steps
    eval     NE and AUC per task on the held-out split (+ the source's baselines)
    report   rich summary table, metrics.jsonl and summary.json in the run directory
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import random
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from omegaconf import OmegaConf

from gemctl.data.loader import TrainLoader, eval_batches
from gemctl.errors import NumericalFault, UserError
from gemctl.data.source import build_source
from gemctl.metrics import mfu as mfu_lib
from gemctl.metrics.flops import gem_flops
from gemctl.metrics.quality import auc, log_loss, normalized_entropy
from gemctl.metrics.provenance import provenance
from gemctl.metrics.sinks import JsonlSink, RunDir
from gemctl.model import build_model
from gemctl.parallel import ParallelContext, init_parallel, parallelize
from gemctl.precision import apply_precision
from gemctl.train.optim import build_optimizers, local_tensor, lr_lambda


@dataclass
class TrainResult:
    run_dir: Path | None
    losses: list[float] = field(default_factory=list)
    # each step's dense gradient norm before clipping (None: no norm, the clip off or the update skipped)
    grad_norms: list[float | None] = field(default_factory=list)
    eval: dict = field(default_factory=dict)
    baselines: dict = field(default_factory=dict)
    perf: dict = field(default_factory=dict)


def resolve_device(name: str, local_rank: int = 0) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device("cuda", local_rank) if name == "cuda" else torch.device(name)


def seed_everything(seed: int, deterministic: bool | None, device: torch.device) -> None:
    """Seed Python and torch; deterministic algorithms on a CPU unless ``deterministic`` is false,
    on every device if it is true. CUDA: cuBLAS gets a fixed workspace (set here before its first
    use unless the environment already sets one), ops without a deterministic kernel warn (torch's
    warn_only) rather than stop the run, and the Triton kernels take their default configs instead
    of timing candidates (tile shapes sum in different orders)."""
    random.seed(seed)
    torch.manual_seed(seed)
    if deterministic is None:
        deterministic = device.type == "cpu"
    if device.type == "cuda":  # set either way: the jobs of a multirun share this process
        from gemctl.ops.triton.common import set_autotune

        set_autotune(False if deterministic else None)
        if deterministic:
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
            torch.backends.cudnn.benchmark = False
    torch.use_deterministic_algorithms(deterministic, warn_only=deterministic and device.type != "cpu")


def _plain(node):
    """A structured config section as its dataclass (plain attribute reads); anything else (a plain
    DictConfig, a namespace) as it is."""
    if OmegaConf.is_config(node) and OmegaConf.get_type(node) not in (None, dict):
        return OmegaConf.to_object(node)
    return node


def autocast_context(device: torch.device, compute_dtype: str):
    """bf16 autocast on CUDA for ``precision.compute_dtype`` bf16; nothing otherwise."""
    if device.type == "cuda" and compute_dtype == "bf16":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def compute_loss(logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
    """Sum over tasks of the mean binary cross-entropy (float32 logits); with the batch's sample
    ``weights`` [B], the weighted mean (a batch whose weights are all zero adds 0)."""
    bce = F.binary_cross_entropy_with_logits(logits.float(), labels, reduction="none")  # [B, T]
    if weights is None:
        return bce.mean(0).sum()
    w = weights.float()
    return ((bce * w[:, None]).sum(0) / w.sum().clamp_min(torch.finfo(torch.float32).tiny)).sum()


def _read_steps(losses: torch.Tensor, norms: list) -> tuple[list[float], list[float | None]]:
    """The pending steps' losses (a vector on the device) and gradient norms (device scalars; None
    where a step had none: no clipping, or an update skipped) as floats, in one host read. A
    DTensor norm (FSDP2) is made whole first: a collective that every rank runs here, at the same
    steps."""
    vals = [None if n is None else (n.full_tensor() if hasattr(n, "full_tensor") else n) for n in norms]
    known = [v.detach().float().reshape(1).to(losses.device) for v in vals if v is not None]
    read = torch.cat([losses.float().reshape(-1), *known]).cpu().tolist()
    n = losses.numel()
    rest = iter(read[n:])
    return read[:n], [None if v is None else next(rest) for v in vals]


def _norm_stats(norms: list[float | None], clip: float) -> dict:
    """Gradient-norm summary of some steps: the largest and mean finite norm before clipping, how
    many steps train.grad_clip scaled down (clip_grad_norm_'s own test: clip / (norm + 1e-6) < 1)
    and how many had a non-finite norm (the worst spike: the clip turns that update into NaN);
    empty when no step had a norm (train.grad_clip=0)."""
    known = [x for x in norms if x is not None]
    finite = [x for x in known if math.isfinite(x)]
    if not known:
        return {}
    return {"grad_norm_max": max(finite) if finite else None,
            "grad_norm_mean": sum(finite) / len(finite) if finite else None,
            "clipped_steps": sum(clip / (x + 1e-6) < 1 for x in finite) if clip > 0 else 0,
            "nonfinite_norm_steps": len(known) - len(finite)}


class Trainer:
    """Every rank builds the same model from the same seed, then the layout shards it; each rank
    trains on its own part of every step's samples (gemctl.data.shuffle). Rank 0 reports."""

    def __init__(self, cfg, console=None, run_root: str | None = None, run_dir: str | None = None,
                 ctx: ParallelContext | None = None, source=None):
        self.cfg = cfg
        # Plain-dataclass copies of the sections that every step reads: an OmegaConf attribute read
        # costs ~10-20 us of host time, and a step read ~40 of them (gem_flops alone 29) between
        # its kernels, where the GPU waits for the host (docs/benchmarks/model.md, 2026-12-07).
        self._model_cfg = _plain(cfg.model)
        self._train_cfg = _plain(cfg.train)
        self._compute_dtype = str(cfg.precision.compute_dtype)
        device_type = resolve_device(cfg.train.device).type
        self.ctx = ctx if ctx is not None else init_parallel(cfg, device_type)
        self.console = console if self.ctx.is_main else None
        self.device = resolve_device(cfg.train.device, self.ctx.local_rank)
        seed_everything(cfg.train.seed, cfg.train.deterministic, self.device)
        if cfg.train.deterministic and self.device.type == "cuda" and self.console is not None:
            self.console.print("train.deterministic: deterministic CUDA kernels, Triton kernels at their default "
                               "configs (not autotuned): reproducible, not the fastest")
        self.source = source or build_source(cfg.data, cfg.shuffle, self.ctx.world_size, self.ctx.rank)
        self.spec = self.source.spec
        self.local_baseline = None
        if self.ctx.sharded and cfg.metrics.scaling_baseline_steps:
            self.local_baseline = self._local_baseline(cfg.metrics.scaling_baseline_steps)
            seed_everything(cfg.train.seed, cfg.train.deterministic, self.device)  # same init on every rank
        if self.device.type == "cuda":  # Triton kernels imported before any step (and any torch.compile)
            from gemctl import ops

            ops.preload()
        self.model = build_model(cfg.model, self.spec, device=self.device)
        self.formats = apply_precision(self.model, cfg.precision, cfg.model.num_layers, self.device.type)
        par = parallelize(self.model, self.ctx, cfg, self.device, self.formats)
        self.table_plan, fused_sparse = par.table_plan, par.fused_sparse
        self.expert_groups, self.expert_params = par.expert_groups, par.expert_params
        self.checkpoint_plan = par.checkpoint
        if par.checkpoint.active:
            self._say(f"parallel.activation_checkpoint: {par.checkpoint.describe()}")
        if par.compiled_layers:
            from gemctl.parallel.compile import BACKEND

            self._say(f"parallel.compile: {par.compiled_layers} sequence-tower layers under torch.compile ({BACKEND}); "
                      "the first steps compile them (left out of the step times)")
        # This rank's parameter bytes as stored between steps (FSDP2 keeps the root and the last
        # block gathered after a forward, so this is measured before any).
        self.param_bytes = sum(local_tensor(p).numel() * p.element_size() for p in self.model.parameters())
        self.dense_opt, self.sparse_opt = build_optimizers(self.model, cfg.train, self.device, self.expert_params)
        if fused_sparse is not None:  # torchrec tables update in the backward (fused); step() is a no-op
            self.sparse_opt = fused_sparse
        self.schedule = torch.optim.lr_scheduler.LambdaLR(self.dense_opt, lr_lambda(cfg.train))
        self.peak = mfu_lib.resolve_peak(self.device, cfg.metrics.peak_tflops)
        self.run_root = run_root
        self.run_dir = run_dir  # an existing directory (made by the launcher) instead of a new one
        self.step_index = 0  # the step being trained (0-based), for reports
        # the last step's gradient norm before clipping (a device scalar, read with the losses; None
        # with train.grad_clip=0 or a skipped step)
        self.last_grad_norm: torch.Tensor | None = None
        self.skipped: list[dict] = []  # steps whose update was dropped (train.nonfinite=skip)

    # ------------------------------------------------------------------------------------------
    def _say(self, text: str) -> None:
        if self.console is not None:
            self.console.print(text)

    def train_step(self, batch) -> torch.Tensor:
        # Profiler ranges name the phases for `gemctl profile` (negligible cost otherwise).
        record = torch.profiler.record_function
        self.last_grad_norm = None
        self.model.train()
        moe, tcfg = self._model_cfg.moe, self._train_cfg
        with record("gemctl.forward"):
            with autocast_context(self.device, self._compute_dtype):
                logits = self.model(batch)
            loss = compute_loss(logits, batch.labels, batch.weights)
            aux = self.model.aux_loss() if moe.n_experts else None
            if aux is not None and moe.aux_loss_weight:
                loss = loss + moe.aux_loss_weight * aux
        self.dense_opt.zero_grad(set_to_none=True)
        self.sparse_opt.zero_grad(set_to_none=True)
        with record("gemctl.backward"):
            loss.backward()
        if tcfg.nonfinite == "skip":
            bad = self._first_nonfinite(loss)
            if bad is not None:
                self.skipped.append({"step": self.step_index + 1, "tensor": bad,
                                     "sample_ids": batch.sample_ids[:8].tolist()})
                self._say(f"[yellow]step {self.step_index + 1}: non-finite {bad}; update skipped "
                          f"({len(self.skipped)} so far)[/yellow]")
                self.dense_opt.zero_grad(set_to_none=True)
                self.sparse_opt.zero_grad(set_to_none=True)
                return loss.detach()
        with record("gemctl.optimizer"):
            if self.expert_params:
                from gemctl.parallel.expert import clip_grad_norm, sync_expert_grads

                sync_expert_grads(self.expert_params, self.expert_groups)
                if tcfg.grad_clip > 0:
                    experts = {id(p) for p in self.expert_params}
                    dense = [p for p in self.model.dense_parameters() if id(p) not in experts]
                    self.last_grad_norm = clip_grad_norm(dense, self.expert_params, tcfg.grad_clip,
                                                         self.expert_groups)
            elif tcfg.grad_clip > 0:
                self.last_grad_norm = torch.nn.utils.clip_grad_norm_(self.model.dense_parameters(), tcfg.grad_clip)
            self.dense_opt.step()
            self.sparse_opt.step()
            self.schedule.step()
        return loss.detach()

    def batch_flops(self, batch):
        """gem_flops of this model on the batch's history lengths (host math, no device work)."""
        return gem_flops(self._model_cfg, self.spec, batch.seq_lengths_cpu(), self.checkpoint_plan)

    def _first_nonfinite(self, loss) -> str | None:
        """'loss' or the name of the first parameter with a non-finite gradient (this rank; the
        verdict is shared by all ranks so they skip together); None when all are finite."""
        named = [(n, local_tensor(p.grad)) for n, p in self.model.named_parameters() if p.grad is not None]
        flags = torch.stack([torch.isfinite(loss).all()] + [torch.isfinite(g).all() for _, g in named])
        local = None
        if not bool(flags.all()):  # the step's one device sync; names are looked up only on a fault
            first = int((~flags).nonzero()[0])
            local = "loss" if first == 0 else f"gradient of {named[first - 1][0]}"
        if self.ctx.world_size > 1:
            flags = self.ctx.sum([0.0 if local is None else 1.0], self.device)
            if flags[0] and local is None:
                local = "gradient on another rank"
        return local

    @torch.no_grad()
    def evaluate(self) -> dict:
        self.model.eval()
        preds, labels, weights = [], [], []
        for batch in eval_batches(self.source, self.cfg.data, self.device, self.cfg.train.eval_batches):
            with autocast_context(self.device, self._compute_dtype):
                logits = self.model(batch)
            preds.append(torch.sigmoid(logits.float()).cpu())
            labels.append(batch.labels.cpu())
            weights.append(None if batch.weights is None else batch.weights.float().cpu())
        p, y = torch.cat(preds), torch.cat(labels)
        # sample weights, where the source gives them (all batches or none: a batch without counts 1s)
        w = None if all(x is None for x in weights) else torch.cat(
            [torch.ones(len(b)) if x is None else x for x, b in zip(weights, labels)])
        out = {"samples": int(p.shape[0])}
        if w is not None:
            out["weighted"] = True
        for t, task in enumerate(self.spec.tasks):
            out[task] = {
                "ne": normalized_entropy(p[:, t], y[:, t], w),
                "auc": auc(p[:, t], y[:, t], w),
                "log_loss": log_loss(p[:, t], y[:, t], w),
                "label_mean": float(y[:, t].mean() if w is None else (w * y[:, t]).sum() / w.sum()),
            }
        return out

    def _local_baseline(self, steps: int) -> dict | None:
        """Rank 0 trains an unsharded copy on its own local batches, alone: the job's
        train.warmup_timing_steps untimed (kernel tuning, caches), then ``steps`` timed, batches
        on the device before timing; the other ranks wait. Returns its model FLOP/s: the
        single-rank throughput the Scaling Ratio divides by."""
        result = None
        if self.ctx.is_main:
            warm = self.cfg.train.warmup_timing_steps
            self._say(f"scaling baseline: {warm} + {steps} steps of one unsharded rank at local batch {self.cfg.data.batch_size}")
            single = Trainer(self.cfg, ctx=ParallelContext(local_rank=self.ctx.local_rank), source=self.source)
            loader = TrainLoader(self.source, self.cfg.data, self.device)
            try:
                batches = [next(loader) for _ in range(warm + steps)]
            finally:
                loader.close()
            for batch in batches[:warm]:
                single.train_step(batch)
            batches = batches[warm:]
            flops = sum(single.batch_flops(b).train_total for b in batches)
            self._sync()
            setup0 = kernel_setup_seconds()  # first: its first call may import Triton, not step time
            t0 = time.perf_counter()
            for batch in batches:
                single.train_step(batch)
            self._sync()
            setup = kernel_setup_seconds() - setup0
            seconds = max(time.perf_counter() - t0 - setup, 1e-9)
            result = {"steps": steps, "step_time_ms": 1e3 * seconds / steps, "model_tflops": flops / seconds / 1e12,
                      "setup_s": setup}
            del single, batches
        if self.ctx.world_size > 1:
            import torch.distributed as dist

            dist.barrier()
        return result

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _global(self, window: "_Window") -> "_Window":
        """The window with counts summed over ranks (mean data wait); the time stays this rank's,
        since the collectives of every step keep the ranks in step."""
        if self.ctx.world_size == 1:
            return window
        out = _Window(**vars(window))
        out.samples, out.tokens, out.flops, out.attention_flops, wait = self.ctx.sum(
            [window.samples, window.tokens, window.flops, window.attention_flops, window.data_wait], self.device
        )
        out.data_wait = wait / self.ctx.world_size
        if window.hardware_flops is not None:  # every rank has the same plan: known on all or none
            out.hardware_flops = self.ctx.sum([window.hardware_flops], self.device)[0]
        return out

    # ------------------------------------------------------------------------------------------
    def fit(self) -> TrainResult:
        cfg, tcfg, ctx = self.cfg, self._train_cfg, self.ctx
        run = None
        if ctx.is_main:  # one run directory for all ranks; rank 0 writes it
            run = RunDir(Path(self.run_dir)) if self.run_dir else RunDir.create(self.run_root or cfg.run.output_dir, cfg.run.name)
            run.write_text("config.yaml", OmegaConf.to_yaml(cfg))
        sink = JsonlSink(run.path / "metrics.jsonl" if run else None)
        self._say(f"run directory: {run.path if run else '-'}")
        self._say(f"device: {mfu_lib.device_name(self.device)}; peak for MFU: {self.peak.describe()}")
        if ctx.sharded:
            self._say(f"layout '{cfg.parallel.name}': {ctx.describe()}, local batch {cfg.data.batch_size}")
        if self.table_plan:
            self._say("tables (torchrec): " + ", ".join(f"{t} {p['sharding']} {p['ranks']}" for t, p in self.table_plan.items()))
        if self.device.type != "cuda" and cfg.precision.compute_dtype != "fp32":
            self._say(f"precision '{cfg.precision.name}': autocast applies on CUDA only; this run computes in fp32")
        n_dense = sum(p.numel() for p in self.model.dense_parameters())
        n_sparse = sum(p.numel() for p in self.model.sparse_parameters())
        self._say(f"model '{cfg.model.name}': {n_dense / 1e6:.2f}M dense, {n_sparse / 1e6:.2f}M embedding parameters")

        result = TrainResult(run_dir=run.path if run else None)
        from gemctl.train import checkpoint

        from gemctl.train.ledger import SampleLedger, restart_count

        run_path = Path(self.run_dir or (run.path if run else "."))
        ckpt_root = Path(tcfg.checkpoint_dir or run_path / "checkpoints")
        attempt = restart_count()
        try:
            paths = checkpoint.candidates(tcfg.resume, ckpt_root)
            if attempt:  # torchrun restarted the workers after a failure: continue from this run's newest checkpoint
                paths = checkpoint.candidates("auto", ckpt_root) or paths
                self._say(f"[yellow]restart {attempt} of at most {cfg.launcher.max_restarts}: "
                          + (f"resuming from the newest complete checkpoint under {ckpt_root}[/yellow]" if paths
                             else "no checkpoint was written yet; starting over[/yellow]"))
            start, resume_from = checkpoint.load_newest_readable(self, paths, self._say)
        except UserError:  # train.resume names no checkpoint, or one of another model
            sink.close()
            if run is not None and not self.run_dir:  # nothing trained: no half-written run directory left
                shutil.rmtree(run.path, ignore_errors=True)
            raise
        if resume_from is not None:
            self._say(f"resumed from {resume_from} at step {start}")
        if start >= tcfg.steps:
            self._say(f"[yellow]the checkpoint is at step {start}, train.steps={tcfg.steps}: no step left to train; "
                      "raise train.steps to continue[/yellow]")
        ledger = SampleLedger(run_path, ctx.rank) if tcfg.sample_ledger else None
        loader = TrainLoader(self.source, cfg.data, self.device, start_step=start)
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        from gemctl.train.progress import TrainProgress

        window = _Window()
        totals = _Window()
        pending: list[torch.Tensor] = []
        pending_norms: list[torch.Tensor | None] = []  # the steps' gradient norms, read in the losses' host read
        pending_ids: list[torch.Tensor] = []  # first sample ids of each pending step (fault reports)
        checkpoint_s = 0.0  # time training waited for checkpoints
        setup_window = kernel_setup_seconds()
        t_start = time.perf_counter()
        t_window = t_start
        setup_timed = 0.0  # autotuning and compiles inside timed windows, taken out of their time
        with TrainProgress(tcfg.steps, enabled=cfg.run.progress and self.console is not None, console=self.console) as progress:
            try:
                for step in range(start, tcfg.steps):
                    batch = next(loader)
                    self.step_index = step
                    pending_ids.append(batch.sample_ids[:8])
                    window.data_wait += loader.last_wait_s
                    flops = self.batch_flops(batch)
                    window.add(batch.batch_size, batch.num_tokens, flops.train_total, flops.attention_total * 3,
                               flops.hardware_total)
                    pending.append(self.train_step(batch))
                    pending_norms.append(self.last_grad_norm)
                    if ledger is not None:
                        ledger.write(step + 1, loader.last_sample_ids)
                    last = step + 1 == tcfg.steps
                    if (step + 1) % tcfg.log_every == 0 or last or step + 1 == tcfg.warmup_timing_steps:
                        if cuda:
                            torch.cuda.synchronize(self.device)
                        now = time.perf_counter()
                        # the losses' mean over ranks and the norms, read together
                        losses, norms = _read_steps(ctx.mean(torch.stack(pending).float()), pending_norms)
                        pending.clear()
                        pending_norms.clear()
                        bad = [i for i, x in enumerate(losses) if not math.isfinite(x)]
                        if bad and tcfg.nonfinite == "stop":
                            first = step + 1 - len(losses) + bad[0] + 1
                            raise NumericalFault(
                                f"non-finite training loss at step {first} ({losses[bad[0]]}); tensor: loss; batch sample "
                                f"ids {pending_ids[bad[0]].tolist()}...; train.nonfinite=skip drops such steps instead"
                            )
                        pending_ids.clear()
                        result.losses.extend(losses)
                        result.grad_norms.extend(norms)
                        # Triton autotuning of a new shape (candidates compiled and timed) and
                        # compiles of a new specialization are not step time: they are taken out
                        # of the window they fell in, and reported
                        setup = kernel_setup_seconds() - setup_window
                        elapsed = max(now - t_window - setup, 1e-9)
                        rec = self._global(window).record(step + 1, elapsed, self.peak, ctx.world_size)
                        rec["setup_s"] = setup
                        finite = [x for x in losses if math.isfinite(x)]  # skipped steps are reported apart
                        rec["loss"] = sum(finite) / len(finite) if finite else float("nan")
                        rec["lr"] = self.schedule.get_last_lr()[0]
                        rec.update(_norm_stats(norms, tcfg.grad_clip))
                        if attempt:
                            rec["attempt"] = attempt
                        sink.write({"kind": "train", **rec})
                        if step + 1 > tcfg.warmup_timing_steps:
                            totals.merge(window, elapsed)
                            if setup and not setup_timed:
                                self._say(f"[yellow]Triton autotuning or compiling (or torch.compile) ran after the "
                                          f"{tcfg.warmup_timing_steps} "
                                          f"untimed steps ({setup:.1f} s by step {step + 1}, new shapes); taken out of the "
                                          "step times (perf.setup_s_in_timed_steps). More "
                                          "train.warmup_timing_steps tunes before timing.[/yellow]")
                            setup_timed += setup
                        mfu = rec["local_mfu"] if rec["local_mfu"] is not None else rec["e2e_mfu"]
                        progress.update(step + 1, loss=rec["loss"], qps=rec["qps"], mfu=mfu)
                        window = _Window()
                        t_window = time.perf_counter()
                        setup_window = kernel_setup_seconds()
                    else:
                        progress.advance(step + 1)
                    if tcfg.checkpoint_every and (step + 1) % tcfg.checkpoint_every == 0:
                        t_save = time.perf_counter()
                        checkpoint.save(self, step + 1, ckpt_root, tcfg.keep_last, tcfg.async_checkpoint)
                        blocked = time.perf_counter() - t_save
                        checkpoint_s += blocked
                        t_window += blocked  # keep checkpoint time out of throughput
                    if tcfg.eval_every and (step + 1) % tcfg.eval_every == 0 and not last:
                        ev = self.evaluate()
                        sink.write({"kind": "eval", "step": step + 1, **ev})
                        t_window = time.perf_counter()  # keep eval time (and its tuning) out of throughput
                        setup_window = kernel_setup_seconds()
                t_save = time.perf_counter()
                checkpoint.finish(self)  # the last asynchronous checkpoint, published
                checkpoint_s += time.perf_counter() - t_save
            finally:
                loader.close()
                if ledger is not None:
                    ledger.close()
        train_wall = time.perf_counter() - t_start

        result.eval = self.evaluate()
        sink.write({"kind": "eval", "step": tcfg.steps, **result.eval})
        result.baselines = self.source.baselines()
        perf = self._global(totals).record(tcfg.steps, totals.seconds, self.peak, ctx.world_size)
        if self.local_baseline:
            # Local MFU from the single-rank copy; Scaling Ratio = per-rank FLOP/s of the job over it,
            # so E2E MFU = Local MFU x Scaling Ratio holds by construction (and is checked).
            local = self.local_baseline["model_tflops"]
            per_rank = perf["model_tflops"] / ctx.world_size
            perf.update(local_mfu=local / self.peak.tflops, scaling_ratio=mfu_lib.scaling_ratio(per_rank, local),
                        local_baseline=self.local_baseline)
            if not math.isclose(perf["local_mfu"] * perf["scaling_ratio"], perf["e2e_mfu"], rel_tol=1e-9):
                raise AssertionError(f"E2E MFU {perf['e2e_mfu']} != Local MFU x Scaling Ratio ({perf})")
        perf.update(
            param_bytes=self.param_bytes,
            skipped_steps=self.skipped,
            checkpoint_blocking_s=checkpoint_s,
            table_plan=self.table_plan,
            activation_checkpoint=self.checkpoint_plan.describe(),
            train_wall_s=train_wall,
            timed_steps=totals.steps,
            setup_s_in_timed_steps=setup_timed,
            peak=self.peak.describe(),
            peak_tflops=self.peak.tflops,
            device=mfu_lib.device_name(self.device),
        )
        if cuda:
            perf["peak_memory_gib"] = torch.cuda.max_memory_allocated(self.device) / 2**30
        else:
            perf["peak_host_memory_gib"] = _peak_rss_gib()
        result.perf = perf
        summary = {"eval": result.eval, "baselines": result.baselines, "perf": perf,
                   "provenance": provenance() if run else None, "grad_norm": _norm_stats(result.grad_norms, tcfg.grad_clip),
                   # strict JSON: a skipped step's loss and a missing or non-finite norm are null, not NaN
                   "losses": [x if math.isfinite(x) else None for x in result.losses],
                   "grad_norms": [x if x is not None and math.isfinite(x) else None for x in result.grad_norms]}  # rank 0 writes
        sink.write({"kind": "summary", **{k: v for k, v in summary.items() if k not in ("losses", "grad_norms")}})
        if run:
            run.write_text("summary.json", json.dumps(summary, indent=2))
        sink.close()
        if run:
            self._plot_curves(run.path, result.losses, start + 1)
        return result

    def _plot_curves(self, run_path: Path, losses: list, first_step: int) -> None:
        """curves.png from this run's metrics.jsonl and per-step losses; a plot that cannot be drawn
        is said, and the run's results stand."""
        from gemctl.train.curves import plot_curves

        try:
            records = [json.loads(line) for line in (run_path / "metrics.jsonl").read_text().splitlines() if line]
            plot_curves(losses, records, run_path / "curves.png", f"{self.cfg.run.name}: {self.cfg.model.name}, "
                        f"{self.cfg.data.name} on {mfu_lib.device_name(self.device)}", first_step)
        except Exception as exc:  # noqa: BLE001 (matplotlib missing or failing must not lose the run)
            self._say(f"[yellow]curves.png not written: {type(exc).__name__}: {exc}[/yellow]")


def _peak_rss_gib() -> float | None:
    """This process's peak resident memory (Linux reports KiB), None where the OS does not say."""
    try:
        import resource
    except ImportError:
        return None
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def kernel_setup_seconds() -> float:
    """Seconds the Triton kernels have spent autotuning and compiling, and torch.compile compiling
    (parallel.compile), in this process: one-off work, left out of the step times."""
    from gemctl.parallel.compile import compile_seconds

    try:
        from gemctl.ops.triton.common import setup_seconds
    except ImportError:
        return compile_seconds()
    return setup_seconds() + compile_seconds()


def _plus(a: int | None, b: int | None) -> int | None:
    return None if a is None or b is None else a + b


@dataclass
class _Window:
    """Throughput accumulators over a span of steps."""

    steps: int = 0
    samples: int = 0
    tokens: int = 0
    flops: int = 0
    attention_flops: int = 0
    hardware_flops: int | None = 0  # with activation checkpointing's recomputation; None: not known
    data_wait: float = 0.0
    seconds: float = 0.0

    def add(self, samples: int, tokens: int, flops: int, attention_flops: int, hardware_flops: int | None = None) -> None:
        self.steps += 1
        self.samples += samples
        self.tokens += tokens
        self.flops += flops
        self.attention_flops += attention_flops
        self.hardware_flops = _plus(self.hardware_flops, hardware_flops)

    def merge(self, other: "_Window", seconds: float) -> None:
        self.steps += other.steps
        self.samples += other.samples
        self.tokens += other.tokens
        self.flops += other.flops
        self.attention_flops += other.attention_flops
        self.hardware_flops = _plus(self.hardware_flops, other.hardware_flops)
        self.data_wait += other.data_wait
        self.seconds += seconds

    def _hfu(self, world_size: int, seconds: float, peak) -> float | None:
        """Hardware FLOPs (activation checkpointing's rerun forward included) over the time of the
        MFU reported beside it: one process, its compute time (Local MFU's); across ranks,
        ranks x step time (E2E MFU's). None where the recomputation is not known."""
        return None if self.hardware_flops is None else mfu_lib.e2e_mfu(self.hardware_flops, world_size, seconds, peak)

    def record(self, step: int, seconds: float, peak, world_size: int = 1) -> dict:
        """Rates over the window. With counts summed over ``world_size`` ranks: global QPS and
        TFLOP/s, E2E MFU = global FLOPs / (N x time x peak); Local MFU and Scaling Ratio need a
        single-rank run at the same local batch, so a distributed window reports them as None."""
        seconds = max(seconds, 1e-9)
        compute = max(seconds - self.data_wait, 1e-9)  # Local MFU counts the time spent computing
        steps = max(self.steps, 1)
        if world_size > 1:
            return {
                "step": step,
                "steps": self.steps,
                "world_size": world_size,
                "step_time_ms": 1e3 * seconds / steps,
                "qps": self.samples / seconds,
                "qps_per_rank": self.samples / seconds / world_size,
                "tokens_per_s": self.tokens / seconds,
                "model_tflops": self.flops / seconds / 1e12,
                "local_mfu": None,
                "e2e_mfu": mfu_lib.e2e_mfu(self.flops, world_size, seconds, peak),
                "wall_mfu": mfu_lib.mfu(self.flops / world_size, seconds, peak),
                "hfu": self._hfu(world_size, seconds, peak),
                "attention_flop_share": self.attention_flops / self.flops if self.flops else 0.0,
                "data_wait_ms_per_step": 1e3 * self.data_wait / steps,
                "data_wait_fraction": self.data_wait / seconds,
            }
        return {
            "step": step,
            "steps": self.steps,
            "step_time_ms": 1e3 * seconds / steps,
            "qps": self.samples / seconds,
            "tokens_per_s": self.tokens / seconds,
            "model_tflops": self.flops / seconds / 1e12,
            "local_mfu": mfu_lib.mfu(self.flops, compute, peak),
            "e2e_mfu": mfu_lib.e2e_mfu(self.flops, 1, seconds, peak),
            "wall_mfu": mfu_lib.mfu(self.flops, seconds, peak),
            "hfu": self._hfu(1, compute, peak),
            "attention_flop_share": self.attention_flops / self.flops if self.flops else 0.0,
            "data_wait_ms_per_step": 1e3 * self.data_wait / steps,
            "data_wait_fraction": self.data_wait / seconds,
        }


def prepare_process() -> None:
    """Process-wide settings every entry point applies before building."""
    torch.set_float32_matmul_precision("high")
    if os.environ.get("GEMCTL_THREADS"):
        torch.set_num_threads(int(os.environ["GEMCTL_THREADS"]))


def train(cfg, console=None, run_root: str | None = None, run_dir: str | None = None) -> TrainResult:
    """Build everything from a validated config and run it (on every rank under torchrun)."""
    prepare_process()
    trainer = Trainer(cfg, console=console, run_root=run_root, run_dir=run_dir)
    try:
        result = trainer.fit()
    except BaseException:
        trainer.ctx.close(graceful=False)
        raise
    trainer.ctx.close()
    return result
