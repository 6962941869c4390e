"""Per-layer precision rules: which format each module of a real tiny GemModel resolves to, and
that fp32 modules really run with autocast off."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from gemctl.config.compose import compose
from gemctl.data.synthetic import SyntheticSource
from gemctl.model import build_model
from gemctl.precision import apply_precision, resolve_formats

BF16_RULES = [("*", "bf16", None), ("heads.*", "fp32", None)]


def precision_cfg(rules=None, compute_dtype="bf16"):
    """A typed precision config; ``rules`` None keeps configs/precision/bf16.yaml's rules."""
    overrides = ["precision=bf16", f"precision.compute_dtype={compute_dtype}"]
    if rules is not None:
        items = []
        for match, fmt, last_n in rules:
            extra = f", last_n_layers: {last_n}" if last_n is not None else ""
            items.append(f"{{match: '{match}', format: {fmt}{extra}}}")
        overrides.append(f"precision.rules=[{','.join(items)}]")
    return compose(overrides).precision


def tiny_model(seed: int = 0):
    cfg = compose(["data.batch_size=8"])
    src = SyntheticSource(cfg.data)
    torch.manual_seed(seed)
    return build_model(cfg.model, src.spec), src, cfg


@pytest.fixture(scope="module")
def model():
    return tiny_model()[0]


def paths(model, prefix):
    out = [p for p, _ in model.named_modules() if p == prefix or p.startswith(prefix + ".")]
    assert out, prefix
    return out


def test_bf16_yaml_rules(model):
    cfg = precision_cfg()
    assert [(r.match, r.format, r.last_n_layers) for r in cfg.rules] == BF16_RULES
    formats = resolve_formats(model, cfg, num_layers=2)
    assert set(formats) == {p for p, _ in model.named_modules()}
    assert formats[""] == "bf16"
    heads = [p for p in formats if p.startswith("heads.")]
    assert "heads.heads.ctr.0" in heads and "heads.heads.cvr.2" in heads
    assert all(formats[p] == "fp32" for p in heads)
    tower = [p for p in formats if p.startswith("tower.")]
    assert "tower.layers.1.mlp.up" in tower and "tower.layers.0.attn.qkv" in tower
    assert all(formats[p] == "bf16" for p in tower)
    others = [p for p in formats if p and not p.startswith("heads.")]
    assert {formats[p] for p in others} == {"bf16"}


def test_last_n_layers(model):
    cfg = precision_cfg(BF16_RULES + [("tower.layers.*", "fp32", 1)])
    formats = resolve_formats(model, cfg, num_layers=2)
    fp32_tower = sorted(p for p, f in formats.items() if p.startswith("tower") and f == "fp32")
    assert fp32_tower == sorted(paths(model, "tower.layers.1"))
    assert all(formats[p] == "bf16" for p in paths(model, "tower.layers.0"))
    assert formats["tower.layers"] == "bf16" and formats["tower.norm"] == "bf16"
    # last_n_layers=2 covers both layers of the tiny model.
    cfg = precision_cfg(BF16_RULES + [("tower.layers.*", "fp32", 2)])
    formats = resolve_formats(model, cfg, num_layers=2)
    assert all(formats[p] == "fp32" for p in paths(model, "tower.layers.0") + paths(model, "tower.layers.1"))
    # A last_n_layers rule never applies outside the sequence tower's layers.
    cfg = precision_cfg(BF16_RULES + [("*", "fp32", 1)])
    formats = resolve_formats(model, cfg, num_layers=2)
    assert formats["cross.attn.q"] == "bf16" and formats["tower.norm"] == "bf16"
    assert formats["tower.layers.1.attn.out"] == "fp32" and formats["tower.layers.0.attn.out"] == "bf16"


def test_later_rules_win(model):
    a = resolve_formats(model, precision_cfg([("tower.*", "fp32", None), ("tower.layers.0.*", "bf16", None)]), 2)
    assert a["tower.layers.0.mlp.up"] == "bf16"
    assert a["tower.layers.1.mlp.up"] == "fp32"
    assert a["tower.norm"] == "fp32"
    b = resolve_formats(model, precision_cfg([("tower.layers.0.*", "bf16", None), ("tower.*", "fp32", None)]), 2)
    assert b["tower.layers.0.mlp.up"] == "fp32"
    assert all(b[p] == "fp32" for p in b if p.startswith("tower."))


def test_unmatched_modules_inherit(model):
    formats = resolve_formats(model, precision_cfg([("tower", "fp32", None)]), 2)
    assert formats["tower"] == "fp32"
    assert all(formats[p] == "fp32" for p in paths(model, "tower"))  # children inherit
    assert formats["cross.attn.q"] == "bf16"  # the root's compute_dtype
    formats = resolve_formats(model, precision_cfg([], compute_dtype="fp32"), 2)
    assert set(formats.values()) == {"fp32"}


# ----------------------------------------------------------------------------------------------
# apply_precision: fp32 modules run with autocast off.


class Toy(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Linear(8, 8)
        self.head = nn.Sequential(nn.Linear(8, 8), nn.SiLU(), nn.Linear(8, 4))

    def forward(self, x):
        h = self.body(x)
        return h, self.head(h)


def test_fp32_module_runs_outside_autocast():
    x = torch.randn(3, 8)
    plain = Toy()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        h, y = plain(x)
    assert (h.dtype, y.dtype) == (torch.bfloat16, torch.bfloat16)  # the control: autocast is on

    toy = Toy()
    toy.load_state_dict(plain.state_dict())
    formats = apply_precision(toy, precision_cfg([("*", "bf16", None), ("head*", "fp32", None)]), 1, "cpu")
    assert formats["head"] == formats["head.0"] == "fp32" and formats["body"] == "bf16"
    with torch.autocast("cpu", dtype=torch.bfloat16):
        h, y = toy(x)
    assert h.dtype == torch.bfloat16  # the bf16 Linear elsewhere
    assert y.dtype == torch.float32  # the fp32 module, fed a bf16 input, computes in fp32
    ref = plain.head(h.float())
    torch.testing.assert_close(y, ref, rtol=0, atol=0)


def _linear_output_dtypes(model, src):
    dtypes = {}
    for name, mod in model.named_modules():
        if isinstance(mod, nn.Linear):
            mod.register_forward_hook(lambda m, i, o, name=name: dtypes.__setitem__(name, o.dtype))
    batch = src.train_batch(0)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(batch)
    return dtypes, out


def test_gem_model_heads_run_in_fp32_under_autocast():
    model, src, cfg = tiny_model()
    apply_precision(model, cfg.precision, cfg.model.num_layers, "cpu")  # configs/precision/bf16.yaml
    dtypes, out = _linear_output_dtypes(model, src)
    assert out.dtype == torch.float32 and out.shape == (8, 2)
    heads = {n: d for n, d in dtypes.items() if n.startswith("heads.")}
    assert set(heads) == {"heads.heads.ctr.0", "heads.heads.ctr.2", "heads.heads.cvr.0", "heads.heads.cvr.2"}
    # The heads sit under a ModuleDict, which is indexed, never called: they must still be fp32.
    assert set(heads.values()) == {torch.float32}
    rest = {d for n, d in dtypes.items() if not n.startswith("heads.")}
    assert rest == {torch.bfloat16}


def test_gem_model_last_layer_in_fp32_under_autocast():
    model, src, cfg = tiny_model()
    cfg_p = precision_cfg(BF16_RULES + [("tower.layers.*", "fp32", 1)])
    apply_precision(model, cfg_p, cfg.model.num_layers, "cpu")
    dtypes, _ = _linear_output_dtypes(model, src)
    for name, dtype in dtypes.items():
        fp32 = name.startswith("tower.layers.1.") or name.startswith("heads.")
        assert dtype == (torch.float32 if fp32 else torch.bfloat16), name


@pytest.mark.parametrize(
    "rules",
    [
        [("tower.layers", "fp32", None)],  # the layers inherit fp32 from the ModuleList
        [("*", "bf16", None), ("tower.layers*", "fp32", None)],
    ],
)
def test_gem_model_fp32_module_list(rules):
    # A rule on the ModuleList (tower.layers), which is indexed, never called: every layer in it
    # must still run in fp32.
    model, src, cfg = tiny_model()
    formats = apply_precision(model, precision_cfg(rules), 2, "cpu")
    assert all(formats[p] == "fp32" for p in paths(model, "tower.layers"))
    dtypes, _ = _linear_output_dtypes(model, src)
    assert {d for n, d in dtypes.items() if n.startswith("tower.layers.")} == {torch.float32}
    assert dtypes["cross.attn.q"] == torch.bfloat16 and dtypes["heads.heads.ctr.0"] == torch.bfloat16


# ----------------------------------------------------------------------------------------------
# mxfp8: recipes, validation, the MX linear inside the model.

MX_LINEARS = [
    "seq_in", "ns_tokens.sparse.0", "ns_tokens.sparse.1", "ns_tokens.sparse.2", "ns_tokens.dense",
    "cross.attn.q", "cross.attn.kv", "cross.attn.out",
    "tower.layers.0.attn.qkv", "tower.layers.0.attn.out", "tower.layers.0.mlp.up", "tower.layers.0.mlp.down",
    "tower.layers.1.attn.qkv", "tower.layers.1.attn.out", "tower.layers.1.mlp.up", "tower.layers.1.mlp.down",
    "pma.attn.q", "pma.attn.kv", "pma.attn.out",
    "interaction.proj", "interaction.layers.0.v", "interaction.layers.0.u", "interaction.layers.1.v",
    "interaction.layers.1.u",
]
HEADS = ["heads.heads.ctr.0", "heads.heads.ctr.2", "heads.heads.cvr.0", "heads.heads.cvr.2"]


def linear_formats(model, cfg_p):
    formats = resolve_formats(model, cfg_p, num_layers=2)
    return {n: formats[n] for n, m in model.named_modules() if isinstance(m, nn.Linear)}, formats


def test_mxfp8_recipes_match_intended_modules(model):
    cfg = compose(["precision=mxfp8"]).precision
    lin, formats = linear_formats(model, cfg)
    assert lin == {**{n: "mxfp8" for n in MX_LINEARS}, **{n: "fp32" for n in HEADS}}
    assert formats["sparse"] == "bf16" and all(formats[p] == "bf16" for p in paths(model, "sparse"))
    assert (cfg.mx.wgrad_format, cfg.mx.hadamard_wgrad, cfg.mx.stochastic_rounding, cfg.mx.scale_rule) == (
        "mxfp8", True, True, "rceil")

    safe = compose(["precision=mxfp8_safe"]).precision
    lin, _ = linear_formats(model, safe)
    last = [n for n in MX_LINEARS if n.startswith("tower.layers.1.")]
    expected = {n: "mxfp8" for n in MX_LINEARS} | {n: "bf16" for n in last} | {n: "fp32" for n in HEADS}
    assert lin == expected
    assert safe.mx.wgrad_format == "bf16"


@pytest.mark.parametrize(
    "override, field",
    [
        ("precision.rules=[{match: '*', format: mxfp4}]", "precision.rules[0].format"),
        ("precision.mx.scale_rule=ceil", "precision.mx.scale_rule"),
        ("precision.mx.elem=e2m1", "precision.mx.elem"),
        ("precision.mx.grad_elem=int8", "precision.mx.grad_elem"),
        ("precision.mx.wgrad_format=fp8", "precision.mx.wgrad_format"),
        ("precision.mx.hadamard_seed=-1", "precision.mx.hadamard_seed"),
    ],
)
def test_mxfp8_validation_names_the_field(override, field):
    from gemctl.config.validate import validate
    from gemctl.errors import ConfigError

    with pytest.raises(ConfigError) as err:
        validate(compose(["precision=mxfp8", override]), check_device=False)
    message = str(err.value)
    assert message.startswith(field) and "\n" not in message
    if field.endswith("format") and "rules" in field:
        assert "bf16, fp32, mxfp8" in message


def test_mxfp8_bad_format_exits_2_with_one_line(capsys):
    from gemctl.cli import main

    code = main(["config", "validate", "precision=mxfp8", "precision.mx.scale_rule=ceil"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "precision.mx.scale_rule" in err[0] and "floor, rceil" in err[0]


def test_mxfp8_linears_run_through_the_mx_linear():
    model, src, cfg = tiny_model()
    cfg_p = compose(["precision=mxfp8"]).precision
    apply_precision(model, cfg_p, 2, "cpu")
    mods = dict(model.named_modules())
    assert all(getattr(mods[n], "mx_recipe", None) is not None for n in MX_LINEARS)
    assert all(getattr(mods[n], "mx_recipe", None) is None for n in HEADS)
    # The quantized forward differs from the plain one, but only by MX rounding.
    plain, _, _ = tiny_model()
    batch = src.train_batch(0)
    with torch.no_grad():
        a, b = model(batch), plain(batch)
    assert not torch.equal(a, b)
    assert (a - b).abs().max() < 0.2 * b.abs().max() + 0.05


def _train(precision: str, steps: int = 4):
    from gemctl.train.trainer import compute_loss

    model, src, _ = tiny_model(seed=0)
    apply_precision(model, compose([f"precision={precision}"]).precision, 2, "cpu")
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses, grad_norms = [], []
    for step in range(steps):
        batch = src.train_batch(step)
        loss = compute_loss(model(batch), batch.labels)
        opt.zero_grad()
        loss.backward()
        grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        grad_norms.append({n: g.norm().item() for n, g in grads.items()})
        opt.step()
        losses.append(loss.item())
    return losses, grad_norms


def test_mxfp8_tiny_training_close_to_bf16():
    torch.manual_seed(0)
    ref, _ = _train("bf16")
    for recipe in ("mxfp8", "mxfp8_safe"):
        torch.manual_seed(0)
        losses, grad_norms = _train(recipe)
        assert all(torch.isfinite(torch.tensor(losses))), (recipe, losses)
        assert max(abs(a - b) for a, b in zip(losses, ref)) < 0.05 * max(ref), (recipe, losses, ref)
        first = grad_norms[0]
        for name in ("tower.layers.0.mlp.up.weight", "tower.layers.0.attn.qkv.weight", "seq_in.weight",
                     "heads.heads.ctr.0.weight"):
            assert name in first and first[name] > 0, (recipe, name)  # gradients flow through MX linears
