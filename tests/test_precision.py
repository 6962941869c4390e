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
