"""parallel.activation_checkpoint: the tower's layers checkpointed (gemctl.parallel.activation), the
recomputation counted in hardware FLOPs (HFU), never in model FLOPs."""

from __future__ import annotations

import json
import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from gemctl.config.compose import compose
from gemctl.config.validate import validate
from gemctl.data.synthetic import SyntheticSource
from gemctl.errors import ConfigError
from gemctl.metrics import flops
from gemctl.model import build_model
from gemctl.parallel import compile as compile_mod
from gemctl.parallel.activation import CheckpointPlan, apply_activation_checkpointing, checkpointed_layers
from gemctl.train.trainer import compute_loss, train

CPU = torch.device("cpu")
SHORT = ["train.steps=6", "train.log_every=3", "train.warmup_timing_steps=1", "train.eval_batches=1", "run.progress=false"]


class _LiveOutputs(TorchDispatchMode):
    """Every tensor an op makes while active, by weak reference: after a forward, the ones still
    alive are what the graph keeps for the backward (and the outputs)."""

    def __init__(self):
        super().__init__()
        self.refs = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.refs.extend(weakref.ref(t) for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor))
        return out

    def live_bytes(self) -> int:
        storages = {}
        for ref in self.refs:
            t = ref()
            if t is not None:
                storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return sum(storages.values())


def _model(overrides=()):
    cfg = compose(["data.batch_size=32", "data.max_len=64", "model.num_layers=4", *overrides])
    validate(cfg)
    src = SyntheticSource(cfg.data)
    torch.manual_seed(0)
    model = build_model(cfg.model, src.spec)
    plan = apply_activation_checkpointing(model, cfg.parallel.activation_checkpoint, CPU)
    return model, plan, src.train_batch(0), cfg, src


def _step(overrides=()):
    """(loss, gradients, bytes kept between the forward and the backward, plan)."""
    model, plan, batch, _, _ = _model(overrides)
    with _LiveOutputs() as live:
        loss = compute_loss(model(batch), batch.labels, batch.weights)
    kept = live.live_bytes()
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads, kept, plan


def test_checkpointed_layers_train_as_without_and_keep_less():
    """full and ops give the same loss and gradients as no checkpointing (the rerun forward is the
    same computation), and keep less between the forward and the backward: ops less than none,
    full less than ops. Measured on this tiny model: 16.8 / 11.4 / 5.2 MB at 2 layers."""
    loss, grads, kept_none, plan = _step()
    assert plan.mode == "none" and not plan.active
    kept = {}
    for mode in ("ops", "full"):
        got_loss, got_grads, kept[mode], plan = _step([f"parallel.activation_checkpoint.mode={mode}"])
        assert plan.mode == mode and plan.layers == (0, 1, 2, 3)
        assert torch.equal(got_loss, loss)
        assert got_grads.keys() == grads.keys()
        for name, g in grads.items():
            torch.testing.assert_close(got_grads[name], g, rtol=1e-6, atol=1e-7, msg=name)
    assert kept["full"] < kept["ops"] < kept_none
    assert kept["full"] < 0.6 * kept_none


def test_every_kth_layer_and_parameter_names_unchanged():
    """every=2 checkpoints layers 0 and 2 of 4; the wrap leaves module paths and parameter names
    (checkpoints, precision rules, FSDP units) as they were."""
    plain, _, _, _, _ = _model()
    model, plan, _, _, _ = _model(["parallel.activation_checkpoint.mode=full", "parallel.activation_checkpoint.every=2"])
    assert plan.layers == (0, 2) == checkpointed_layers(4, 2)
    assert list(model.state_dict()) == list(plain.state_dict())
    wrapped = [i for i, layer in enumerate(model.tower.layers) if "forward" in vars(layer)]
    assert wrapped == [0, 2]
    assert plan.describe() == "full: 2 of 4 tower layers (whole layer recomputed)"


def test_eval_keeps_no_checkpoint(monkeypatch):
    """Under no_grad a checkpointed layer runs its plain forward (nothing to keep)."""
    import torch.utils.checkpoint as ckpt

    model, _, batch, _, _ = _model(["parallel.activation_checkpoint.mode=full"])
    calls = []
    real = ckpt.checkpoint
    monkeypatch.setattr(ckpt, "checkpoint", lambda *a, **k: calls.append(1) or real(*a, **k))
    with torch.no_grad():
        model(batch)
    assert not calls
    model(batch)
    assert len(calls) == 4


def test_recomputed_flops_count_in_hardware_not_model_flops():
    """Model FLOPs are the same under every mode; hardware FLOPs add a full layer's forward per
    checkpointed layer, nothing for ops without Triton FP8 GEMMs, and are unknown under budget."""
    _, _, batch, cfg, src = _model()
    lengths = batch.seq_lengths_cpu()
    base = flops.gem_flops(cfg.model, src.spec, lengths)
    assert base.recompute == 0 and base.hardware_total == base.train_total
    per_layer = flops._tower_layer(cfg.model, lengths.to(torch.int64), int(lengths.sum()), "full")
    full = flops.gem_flops(cfg.model, src.spec, lengths, CheckpointPlan("full", (0, 2), 4))
    assert full.forward == base.forward
    assert full.recompute == 2 * sum(per_layer.values()) > 0
    assert full.hardware_total == base.train_total + full.recompute
    ops = flops.gem_flops(cfg.model, src.spec, lengths, CheckpointPlan("ops", (0, 1, 2, 3), 4,
                                                                       gemm_per_token={0: 0, 1: 0, 2: 0, 3: 0}))
    assert ops.recompute == 0 and ops.hardware_total == base.train_total
    budget = flops.gem_flops(cfg.model, src.spec, lengths, CheckpointPlan("budget", (0, 1, 2, 3), 4, budget=0.5))
    assert budget.forward == base.forward and budget.recompute is None and budget.hardware_total is None


def test_ops_mode_counts_the_triton_fp8_gemms_it_reruns():
    """Under an fp8 recipe the Linears' GEMMs run as Triton kernels (the interpreter here), outside
    the dispatcher where the ops policy keeps outputs: the plan counts their FLOPs per token."""
    from gemctl.ops.triton.common import INTERPRET
    from gemctl.precision.rules import apply_precision

    if not INTERPRET:
        pytest.skip("the CPU tier (TRITON_INTERPRET=1) decides where FP8 GEMMs run")
    cfg = compose(["data.batch_size=8", "precision=fp8", "parallel.activation_checkpoint.mode=ops"])
    src = SyntheticSource(cfg.data)
    model = build_model(cfg.model, src.spec)
    formats = apply_precision(model, cfg.precision, cfg.model.num_layers, "cpu")
    plan = apply_activation_checkpointing(model, cfg.parallel.activation_checkpoint, CPU)
    for i, layer in enumerate(model.tower.layers):
        fp8 = [m for n, m in layer.named_modules() if isinstance(m, torch.nn.Linear)
               and formats[f"tower.layers.{i}.{n}"] == "fp8"]
        assert fp8, "the fp8 recipe quantizes the tower's Linears"
        assert plan.gemm_per_token[i] == sum(2 * m.in_features * m.out_features for m in fp8)


@pytest.mark.slow
def test_train_reports_hfu_and_same_losses(tmp_path):
    """The trainer with full checkpointing: the same losses as without, the plan in the summary,
    HFU above E2E MFU by the recomputed share."""
    runs = {}
    for mode in ("none", "full"):
        cfg = compose(SHORT + [f"parallel.activation_checkpoint.mode={mode}"])
        validate(cfg)
        runs[mode] = train(cfg, run_root=str(tmp_path / mode))
    assert runs["full"].losses == pytest.approx(runs["none"].losses, rel=1e-6)
    none, full = runs["none"].perf, runs["full"].perf
    assert none["activation_checkpoint"] == "none" and none["hfu"] == pytest.approx(none["local_mfu"])
    assert full["activation_checkpoint"].startswith("full: 2 of 2")
    # the same time as Local MFU's: HFU / MFU is the hardware / model FLOPs ratio, between 1 and 4/3
    # (the tower's forward is a part of a step's 3 forwards)
    assert full["local_mfu"] < full["hfu"] < 4 / 3 * full["local_mfu"]
    (summary,) = (tmp_path / "full").glob("default/*/summary.json")
    assert json.loads(summary.read_text())["perf"]["hfu"] == pytest.approx(full["hfu"])


@pytest.fixture
def _fresh_dynamo(monkeypatch):
    import torch._functorch.config as functorch_config

    monkeypatch.setattr(functorch_config, "activation_memory_budget", functorch_config.activation_memory_budget)
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["full", "ops", "budget"])
def test_checkpointed_layers_compile(tmp_path, monkeypatch, _fresh_dynamo, mode):
    """Checkpointing under parallel.compile (the order of parallelize: checkpoint, then compile):
    the same losses as eager. budget sets the partitioner's memory budget (traced with a backend
    that runs the min-cut partitioner)."""
    import torch._functorch.config as functorch_config

    monkeypatch.setattr(compile_mod, "BACKEND", "aot_eager_decomp_partition" if mode == "budget" else "aot_eager")
    eager = train(compose(SHORT), run_root=str(tmp_path / "eager"))
    cfg = compose(SHORT + ["parallel.compile=true", f"parallel.activation_checkpoint.mode={mode}",
                           "parallel.activation_checkpoint.budget=0.1"])
    validate(cfg)
    compiled = train(cfg, run_root=str(tmp_path / mode))
    assert compiled.losses == pytest.approx(eager.losses, rel=1e-5, abs=1e-6)
    if mode == "budget":
        assert functorch_config.activation_memory_budget == 0.1
        assert compiled.perf["hfu"] is None


def test_plan_estimate_follows_the_mode():
    """gemctl plan's activation estimate: full < ops < none, every=2 between full and none, budget
    scales the tower's share."""
    from gemctl.parallel.plan import activation_bytes

    def est(*overrides):
        return activation_bytes(compose(["model=small", *overrides]), tokens=1e5, batch=64, dtype_bytes=2)

    key = "parallel.activation_checkpoint"
    none, ops, full = est(), est(f"{key}.mode=ops"), est(f"{key}.mode=full")
    assert full < ops < none
    assert full < est(f"{key}.mode=full", f"{key}.every=2") < none
    assert est(f"{key}.mode=budget", "parallel.compile=true", f"{key}.budget=0.25") < ops
    from gemctl.parallel.plan import _checkpoint_text

    assert _checkpoint_text(compose(["model=small", f"{key}.mode=full", f"{key}.every=2"])) == "full, 2 of 4 tower layers"


def test_budget_makes_the_partitioner_keep_less(_fresh_dynamo):
    """What `budget` sets is what torch.compile's min-cut partitioner reads: a tower layer's forward
    graph saves fewer bytes for the backward at a lower budget (CPU, torch's partitioner without
    code generation; measured 3.1 MB at 1.0, 0.54 MB at 0.1 on a 16-sample batch)."""
    import torch._functorch.config as functorch_config
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    def saved_bytes(budget: float) -> int:
        cfg = compose(["data.batch_size=16", "data.max_len=64", "parallel.compile=true",
                       "parallel.activation_checkpoint.mode=budget", f"parallel.activation_checkpoint.budget={budget}"])
        validate(cfg)
        src = SyntheticSource(cfg.data)
        torch.manual_seed(0)
        model = build_model(cfg.model, src.spec)
        apply_activation_checkpointing(model, cfg.parallel.activation_checkpoint, CPU)
        assert functorch_config.activation_memory_budget == budget
        outputs = []

        def forward_compiler(gm, example_inputs):  # the forward graph's outputs: results + what it saves
            (returned,) = [n.args[0] for n in gm.graph.nodes if n.op == "output"]
            outputs.append(sum(o.meta["val"].numel() * o.meta["val"].element_size() for o in returned
                               if isinstance(o.meta.get("val"), torch.Tensor)))
            return gm.forward

        backend = aot_autograd(fw_compiler=forward_compiler, bw_compiler=lambda gm, _: gm.forward,
                               partition_fn=min_cut_rematerialization_partition)
        torch._dynamo.reset()
        for layer in model.tower.layers:
            layer.compile(backend=backend)
        batch = src.train_batch(0)
        compute_loss(model(batch), batch.labels, batch.weights).backward()
        return outputs[0]

    assert saved_bytes(0.1) < 0.5 * saved_bytes(0.99)


@pytest.mark.parametrize("overrides,field", [
    (["parallel.activation_checkpoint.mode=some"], "parallel.activation_checkpoint.mode"),
    (["parallel.activation_checkpoint.mode=full", "parallel.activation_checkpoint.every=0"],
     "parallel.activation_checkpoint.every"),
    (["parallel.activation_checkpoint.mode=ops", "parallel.activation_checkpoint.every=3"],
     "parallel.activation_checkpoint.every"),  # tiny has 2 layers
    (["parallel.activation_checkpoint.mode=budget"], "parallel.activation_checkpoint.mode"),  # no compile
    (["parallel.activation_checkpoint.mode=budget", "parallel.compile=true", "parallel.activation_checkpoint.budget=1"],
     "parallel.activation_checkpoint.budget"),
])
def test_bad_checkpoint_config_names_the_field(overrides, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        validate(compose(overrides), check_device=False)


def _gpu_modes(overrides: list[str], fp8: bool = False) -> dict:
    """mode -> (loss, flat gradients, peak bytes above the model, plan) of one forward+backward on
    CUDA in bf16, the same seed and batch under none, ops and full."""
    from gemctl.train.trainer import autocast_context

    cuda = torch.device("cuda")
    cfg = compose(["model=small", "train.device=cuda", *overrides])
    src = SyntheticSource(cfg.data)
    batch = src.train_batch(0).to(cuda)
    results = {}
    for mode in ("none", "ops", "full"):
        torch.manual_seed(0)
        model = build_model(cfg.model, src.spec, device=cuda)
        if fp8:
            from gemctl.precision.rules import apply_precision

            apply_precision(model, cfg.precision, cfg.model.num_layers, "cuda")
        ac = compose([f"parallel.activation_checkpoint.mode={mode}"]).parallel.activation_checkpoint
        plan = apply_activation_checkpointing(model, ac, cuda)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        with autocast_context(cuda, "bf16"):
            logits = model(batch)
        loss = compute_loss(logits, batch.labels, batch.weights)
        loss.backward()
        torch.cuda.synchronize()
        grads = torch.cat([p.grad.float().flatten() for p in model.parameters() if p.grad is not None])
        results[mode] = (loss.detach(), grads, torch.cuda.max_memory_allocated() - base, plan)
        del model, logits, loss
    loss, grads = results["none"][:2]
    for mode in ("ops", "full"):  # the same forward; gradients within bf16 rounding
        assert torch.equal(results[mode][0], loss), mode
        assert (results[mode][1] - grads).norm() <= 2e-2 * grads.norm(), mode
    return results


@pytest.mark.gpu
def test_checkpointing_lowers_peak_memory_on_gpu():
    """On CUDA in bf16 with the Triton attention kernels (their outputs are what ops keeps): the
    forward is the same, the gradients agree to bf16 rounding, and the step's peak memory above the
    model falls from none to ops to full."""
    results = _gpu_modes(["model.num_layers=4", "data.batch_size=64", "data.max_len=1024"])
    print({m: round(r[2] / 2**20, 1) for m, r in results.items()}, "MiB above the model")
    assert results["full"][2] < results["ops"][2] < results["none"][2]


@pytest.mark.gpu
def test_checkpointing_fp8_layers_on_gpu():
    """The fp8 recipe's Triton GEMMs inside checkpointed layers (their autograd functions rerun
    under ops and full): the same forward, gradients within bf16 rounding. On the CPU the same
    holds bit for bit under the interpreter, too slow for the default tier (~1 minute a mode)."""
    results = _gpu_modes(["model.num_layers=2", "data.batch_size=32", "data.max_len=512", "precision=fp8"], fp8=True)
    plan = results["ops"][3]
    assert all(plan.gemm_per_token[i] > 0 for i in plan.layers)  # the FP8 GEMMs rerun
