"""CPU gloo ranks that shard the tiny GemModel with apply_fsdp, train a few steps and count what
FSDP2 all-gathers (tests/test_mx_fsdp.py, tests/test_fp8_fsdp.py).

``spawn`` starts the ranks (torch.multiprocessing, spawn, gloo) and runs every variant (a name and
its config overrides) in the same process group, one after the other. Per variant and rank it
returns:

- ``wrapped``: the module paths whose weights apply_fsdp wrapped for a quantized all-gather;
- ``payload``: per step, the bytes of every all-gather collective's input (all_gather_single, or
  all_gather_into_tensor where FSDP2 calls that) in the forward and in the backward;
- ``expected``: those bytes as the local shards predict them: 1 byte per element plus the scale
  bytes for a wrapped weight, 4 per element (fp32, CPU) for every other parameter;
- ``pre``: what each wrapped weight's fsdp_pre_all_gather returned (phase, shape, axis, dtype and
  bytes of each tensor);
- ``all_reduce``: per step, the int32 all-reduce bytes in the forward and the backward (the fp8
  row format's column amax; FSDP2's own all-reduces are float);
- ``exact``: per wrapped weight and axis, whether quantizing the shards, all-gathering them and
  dequantizing gives the format's quantize-dequantize of the whole master weight;
- ``losses``: the global mean loss of each step.
"""

from __future__ import annotations

import math
import os
import socket
import traceback

import torch
import torch.multiprocessing as mp

WORLD = 2
STEPS = 3


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(variants: dict[str, list[str]], mesh_shape: tuple[int, ...] = (WORLD,)) -> dict[str, dict[int, dict]]:
    """Run the variants on prod(mesh_shape) ranks; a 2-D mesh is (dp_replicate, dp_shard), HSDP.
    Returns variant -> rank -> result."""
    world = math.prod(mesh_shape)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, port, variants, mesh_shape, queue)) for r in range(world)]
    for p in procs:
        p.start()
    results = dict(queue.get(timeout=180) for _ in procs)
    for p in procs:
        p.join(timeout=30)
    for r, res in results.items():
        assert isinstance(res, dict), f"rank {r}:\n{res}"
    return {name: {r: res[name] for r, res in results.items()} for name in variants}


def _worker(rank: int, port: int, variants, mesh_shape, queue) -> None:
    try:
        queue.put((rank, _run_rank(rank, port, variants, mesh_shape)))
    except Exception:  # noqa: BLE001 - reported to the parent
        queue.put((rank, traceback.format_exc()))


def _run_rank(rank: int, port: int, variants, mesh_shape) -> dict:
    import torch.distributed as dist

    from gemctl.precision import fp8_linear
    from gemctl.precision.fsdp_gather import QuantizedGatherWeight

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    # The CPU path of a real run: the fp8 GEMMs emulated. (Under the tests' TRITON_INTERPRET=1 the
    # Triton FP8 kernels would run in the interpreter, minutes per step; test_fp8.py checks them.)
    fp8_linear.triton_ready = lambda *tensors: False
    dist.init_process_group("gloo", rank=rank, world_size=math.prod(mesh_shape))
    counts = {"phase": None}
    originals = {}

    def count(name, key, only=None):
        originals[name] = orig = getattr(dist, name)

        def counted(tensor_a, *args, **kwargs):
            # all_gather_*(output, input, ...) counts the input; all_reduce(tensor, ...) the tensor.
            t = args[0] if name.startswith("all_gather") else tensor_a
            if counts["phase"] and (only is None or t.dtype == only):
                counts[key][counts["phase"]] += t.numel() * t.element_size()
            return orig(tensor_a, *args, **kwargs)

        setattr(dist, name, counted)

    for name in ("all_gather_single", "all_gather_into_tensor"):
        if hasattr(dist, name):
            count(name, "gather")
    count("all_reduce", "reduce", only=torch.int32)
    pre = QuantizedGatherWeight.fsdp_pre_all_gather

    def pre_counted(self, mesh, orig_size, contiguous_orig_stride, module, mp_policy):
        tensors, meta = pre(self, mesh, orig_size, contiguous_orig_stride, module, mp_policy)
        counts["pre"].append((counts["phase"], tuple(self.shape), meta[0],
                              [(t.dtype, t.numel() * t.element_size()) for t in tensors]))
        return tensors, meta

    QuantizedGatherWeight.fsdp_pre_all_gather = pre_counted
    try:
        return {name: _run_variant(rank, overrides, mesh_shape, counts) for name, overrides in variants.items()}
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
        QuantizedGatherWeight.fsdp_pre_all_gather = pre
        dist.destroy_process_group()


def _scale_bytes(local) -> int:
    """Scale bytes of a wrapped local shard [rows, K] (either axis: the same count)."""
    recipe, (rows, k) = local._recipe, local.shape
    group = getattr(recipe, "block", None) or getattr(recipe, "group", 0)
    return rows if group == 0 else rows * k // group


def _reference(master: torch.Tensor, recipe, axis: int) -> torch.Tensor:
    """The format's quantize-dequantize of the whole weight along ``axis``."""
    from gemctl.precision.fp8_linear import Fp8Recipe, qdq
    from gemctl.precision.mx import mx_qdq

    if isinstance(recipe, Fp8Recipe):
        return qdq(master, recipe.group, axis)
    return mx_qdq(master, recipe.block, recipe.elem, axis=axis, scale_rule=recipe.scale_rule, dtype=torch.float32)


def _gathers_exactly(local, master: torch.Tensor, shard_mesh, axis: int) -> bool:
    import torch.distributed as dist

    tensors, meta = local.quantize_shard(shard_mesh, axis)
    group = shard_mesh.get_group()
    size = dist.get_world_size(group)
    gathered = []
    for t in tensors:
        out = torch.empty(size * t.numel(), dtype=t.dtype)
        dist.all_gather_into_tensor(out, t.contiguous().view(-1), group=group)
        gathered.append(out.view(-1, *t.shape[1:]))
    return torch.equal(local.dequantize(gathered, meta, torch.float32), _reference(master, local._recipe, axis))


def _run_variant(rank: int, overrides: list[str], mesh_shape, counts) -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from gemctl.config.compose import compose
    from gemctl.data.synthetic import SyntheticSource
    from gemctl.model import build_model
    from gemctl.parallel.dense import apply_fsdp, dense_blocks
    from gemctl.precision import apply_precision
    from gemctl.precision.fsdp_gather import QuantizedGatherWeight
    from gemctl.train.trainer import compute_loss

    world = math.prod(mesh_shape)
    shard = mesh_shape[-1]
    cfg = compose(["data.batch_size=8", *overrides])
    src = SyntheticSource(cfg.data)
    torch.manual_seed(0)
    model = build_model(cfg.model, src.spec)
    # Scale each weight element by a random power of two in 2^-6..2^2: the default init gives every
    # scale group nearly the same scale, so quantizing along in- or out-features would round alike.
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, torch.nn.Linear):
                m.weight.mul_(torch.exp2(torch.randint(-4, 5, m.weight.shape, generator=g).float()) / 4)
    masters = {n: p.detach().clone() for n, p in model.named_parameters()}
    formats = apply_precision(model, cfg.precision, cfg.model.num_layers, "cpu")
    names = ("dp_shard",) if len(mesh_shape) == 1 else ("dp_replicate", "dp_shard")
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
    shard_mesh = mesh["dp_shard"] if len(mesh_shape) > 1 else mesh

    # The bytes each unit's all-gather should carry: its parameters' local shards, fp32 or quantized.
    block_names = {id(m): n for n, m in model.named_modules()}
    blocks = [block_names[id(b)] for b in dense_blocks(model)]
    wrapped = apply_fsdp(model, mesh, cfg.precision, torch.device("cpu"), formats)
    expected = {"fwd": 0, "bwd": 0}
    expected_reduce = {"fwd": 0, "bwd": 0}
    exact = {}
    for fqn, p in model.named_parameters():
        local = p.to_local()
        # FSDP2 pads a shard to ceil(rows / shard) rows (a rank with fewer rows sends padding).
        numel = -(-p.shape[0] // shard) * p[0].numel()
        nbytes = numel * 4
        regathered = any(fqn.startswith(b + ".") for b in blocks[:-1])  # the root stays gathered
        if isinstance(local, QuantizedGatherWeight):
            nbytes = numel + _scale_bytes(local)
            if getattr(local._recipe, "group", None) == 0:
                expected_reduce["bwd"] += p.shape[1] * 4  # the column amax, int32
            exact[fqn] = [_gathers_exactly(local, masters[fqn], shard_mesh, a) for a in (0, 1)]
        expected["fwd"] += nbytes
        expected["bwd"] += nbytes if regathered else 0

    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    counts.update(gather={"fwd": 0, "bwd": 0}, reduce={"fwd": 0, "bwd": 0}, pre=[])
    losses, payload, reduced = [], [], []
    for step in range(STEPS):
        local_batch = src.train_batch(step * world + rank)  # each rank its own batch of 8
        counts["phase"] = "fwd"
        loss = compute_loss(model(local_batch), local_batch.labels)
        counts["phase"] = "bwd"
        opt.zero_grad()
        loss.backward()
        counts["phase"] = None
        opt.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / world)
        payload.append((counts["gather"]["fwd"], counts["gather"]["bwd"]))
        reduced.append((counts["reduce"]["fwd"], counts["reduce"]["bwd"]))
        counts.update(gather={"fwd": 0, "bwd": 0}, reduce={"fwd": 0, "bwd": 0})
    return {"wrapped": wrapped, "expected": expected, "payload": payload, "pre": counts["pre"], "losses": losses,
            "all_reduce": reduced, "expected_all_reduce": expected_reduce, "exact": exact}
