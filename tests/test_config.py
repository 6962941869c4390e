"""Config composition: every shipped config and recipe composes and validates; bad configs fail
with a ConfigError that names the field and says what is allowed."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

from gemctl.config.compose import compose, configs_dir, list_recipes, recipes_dir
from gemctl.config.validate import validate
from gemctl.errors import ConfigError, UserError

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "configs"
RECIPES = REPO / "recipes"


def _group_options() -> list[tuple[str, str]]:
    """(group, option) for every YAML under configs/ except the primary config."""
    out = []
    for path in sorted(CONFIGS.rglob("*.yaml")):
        rel = path.relative_to(CONFIGS)
        if len(rel.parts) == 1:  # configs/gemctl.yaml: the primary config
            continue
        out.append(("/".join(rel.parts[:-1]), path.stem))
    return out


GROUP_OPTIONS = _group_options()
RECIPE_FILES = sorted(RECIPES.rglob("*.yaml"))
CUDA_RECIPES = [
    p for p in RECIPE_FILES if (yaml.safe_load(p.read_text()).get("train") or {}).get("device") == "cuda"
]


def _recipe_yaml(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


def test_sources_are_the_checkout():
    assert configs_dir() == CONFIGS
    assert recipes_dir() == RECIPES
    assert set(list_recipes()) == {p.stem for p in RECIPE_FILES}


def test_discovery_found_the_known_files():
    # Guards the parametrisation itself: an empty glob would make the tests below vacuous.
    assert ("model", "tiny") in GROUP_OPTIONS
    assert ("model", "small") in GROUP_OPTIONS
    assert ("model", "gem_1b") in GROUP_OPTIONS
    assert ("data", "movielens100k") in GROUP_OPTIONS
    assert ("precision", "bf16") in GROUP_OPTIONS
    assert {p.stem for p in RECIPE_FILES} >= {"cpu_smoke", "small_h200"}
    assert "small_h200" in {p.stem for p in CUDA_RECIPES}
    assert "cpu_smoke" not in {p.stem for p in CUDA_RECIPES}


# Options that only validate together with others (a layout needs a launcher with enough ranks).
COMPANIONS = {
    ("launcher", "torchrun"): ["parallel=fsdp"],
    ("parallel", "hsdp"): ["launcher=torchrun", "launcher.nproc_per_node=8", "launcher.nnodes=2"],
    ("launcher", "slurm"): ["parallel=hsdp"],
    ("parallel", "hsdp_ep"): ["launcher=torchrun", "launcher.nproc_per_node=8", "launcher.nnodes=2",
                              "model.moe.n_experts=16"],
}


@pytest.mark.parametrize("group,option", GROUP_OPTIONS, ids=[f"{g}={o}" for g, o in GROUP_OPTIONS])
def test_every_group_option_composes_and_validates(group, option):
    cfg = compose([f"{group}={option}"] + COMPANIONS.get((group, option), []))
    validate(cfg)
    node = cfg
    for part in group.split("/"):
        node = node[part]
    # The option's own values made it into the composed config.
    raw = yaml.safe_load((CONFIGS / group / f"{option}.yaml").read_text())
    if "name" in raw:
        assert node.name == raw["name"]
    for key, value in raw.items():
        if not isinstance(value, (dict, list)):
            assert node[key] == value, f"{group}={option}: {key}"


def test_base_config_defaults():
    cfg = compose([])
    validate(cfg)
    assert cfg.model.name == "tiny"
    assert cfg.model.d_model == 64
    assert cfg.data.source == "synthetic"
    assert [dict(r) for r in cfg.precision.rules] == [
        {"match": "*", "format": "bf16", "last_n_layers": None},
        {"match": "heads.*", "format": "fp32", "last_n_layers": None},
    ]


@pytest.mark.parametrize("path", RECIPE_FILES, ids=[p.stem for p in RECIPE_FILES])
def test_every_recipe_composes_and_validates(path):
    raw = _recipe_yaml(path)
    overrides = ["train.device=cpu"] if path in CUDA_RECIPES else []
    cfg = compose(overrides, recipe=path.stem)
    validate(cfg)
    # The recipe's values are applied (run.name and train.steps are set by every recipe).
    assert cfg.run.name == raw["run"]["name"] == path.stem
    assert cfg.train.steps == raw["train"]["steps"]
    for default in raw.get("defaults", []):
        if isinstance(default, dict):
            (key, option), = default.items()
            group = key.split()[-1].lstrip("/")
            assert cfg[group].name == option
    # The same recipe given as a path composes to the same config.
    assert compose(overrides, recipe=str(path)) == cfg


@pytest.mark.parametrize("path", CUDA_RECIPES, ids=[p.stem for p in CUDA_RECIPES])
def test_cuda_recipes_fail_validation_without_cuda(path):
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is visible")
    cfg = compose(recipe=path.stem)
    assert cfg.train.device == "cuda"
    with pytest.raises(ConfigError) as info:
        validate(cfg)
    assert info.value.field == "train.device"
    assert str(info.value).startswith("train.device: 'cuda' requested but no CUDA device is visible")
    assert "auto, cpu" in str(info.value)


def test_small_h200_recipe_values():
    cfg = compose(["train.device=cpu"], recipe="small_h200")
    validate(cfg)
    assert cfg.model.name == "small"
    assert cfg.model.d_model == 768
    assert cfg.data.max_len == 4000
    assert cfg.data.batch_size == 64
    assert cfg.data.synthetic.num_items == 1_000_000
    assert cfg.train.warmup_timing_steps == 10
    # Overrides given after a recipe win over it.
    cfg = compose(["train.device=cpu", "train.steps=7", "data.max_len=100"], recipe="small_h200")
    assert (cfg.train.steps, cfg.data.max_len) == (7, 100)


@pytest.mark.parametrize("path", RECIPE_FILES, ids=[p.stem for p in RECIPE_FILES])
def test_recipe_header(path):
    lines = path.read_text().splitlines()
    assert lines[0] == "# @package _global_"
    comments = [ln for ln in lines[1:] if ln.startswith("#")]
    assert lines[1].startswith("#"), "the line after the package header must be a comment"
    # A recipe that declares its sweep (hydra.sweeper.params) is run as a multirun.
    sweep = ((_recipe_yaml(path).get("hydra") or {}).get("sweeper") or {}).get("params")
    assert comments[0] == f"# gemctl train --recipe {path.stem}" + (" -m" if sweep else "")


def test_ablation_recipes_sweep_the_attention_kinds():
    for name in ("ablation_attention", "ablation_attention_movielens"):
        raw = _recipe_yaml(RECIPES / f"{name}.yaml")
        assert raw["hydra"]["sweeper"]["params"]["model.attention"] == "[full],[window:256],[block:64]"
        for kind in ("full", "window:256", "block:64"):
            cfg = compose([f"model.attention=[{kind}]"], recipe=name)
            validate(cfg)
            assert cfg.model.attention == [kind] and cfg.model.rope_base == 10000
        # Usable on the GPU through overrides.
        cfg = compose(["model=small", "train.device=cuda"], recipe=name)
        assert cfg.model.name == "small" and cfg.train.device == "cuda"


# ----------------------------------------------------------------------------------------------
# Bad configs: one ConfigError naming the field.


def _error(overrides=None, recipe=None) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        validate(compose(overrides, recipe=recipe))
    assert isinstance(info.value, UserError) and info.value.exit_code == 2
    assert "\n" not in str(info.value)
    assert str(info.value).startswith(f"{info.value.field}: ")
    return info.value


def test_unknown_key_suggests_the_close_one():
    err = _error(["train.stpes=3"])
    assert err.field == "train.stpes"
    assert "unknown key" in str(err)
    assert "did you mean 'steps'" in str(err)
    assert "allowed: steps, seed, device" in str(err)


def test_forced_unknown_top_level_key():
    err = _error(["+foo=1"])
    assert err.field == "foo"
    assert "unknown key" in str(err)
    assert "allowed: model, precision, parallel, data, shuffle, launcher, train, metrics, profile, run" in str(err)


def test_forced_unknown_nested_key():
    err = _error(["+model.dmodel=3"])
    assert err.field == "model.dmodel"
    assert "did you mean 'd_model'" in str(err)


def test_wrong_type():
    err = _error(["train.steps=abc"])
    assert err.field == "train.steps"
    assert str(err) == "train.steps: 'abc' is not an integer"


def test_unknown_group_option_lists_allowed():
    err = _error(["model=huge"])
    assert err.field == "model"
    assert str(err) == "model: no config 'huge'; allowed: gem_1b, small, tiny"


def test_unknown_group_option_close_match():
    err = _error(["data=synthetics"])
    assert err.field == "data"
    assert "did you mean 'synthetic'" in str(err)
    assert "allowed: movielens100k, parquet, synthetic" in str(err)


@pytest.mark.parametrize("prefix", ["", "+"])
def test_unknown_key_in_precision_rule_element(prefix):
    err = _error([f"{prefix}precision.rules=[{{match: '*', format: bf16}},{{match: 'heads.*', fmt: fp32}}]"])
    assert err.field == "precision.rules[1].fmt"
    assert "did you mean 'format'" in str(err)
    assert "allowed: match, format, last_n_layers" in str(err)


def test_unknown_key_in_recipe_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "# @package _global_\n"
        "precision:\n  rules:\n    - match: '*'\n      format: bf16\n    - match: 'heads.*'\n      fmt: fp32\n"
    )
    err = _error(recipe=str(bad))
    assert err.field == "precision.rules[1].fmt"
    assert "did you mean 'format'" in str(err)
    typo = tmp_path / "typo.yaml"
    typo.write_text("# @package _global_\ntrain:\n  stpes: 3\n")
    err = _error(recipe=str(typo))
    assert err.field == "train.stpes"
    assert "did you mean 'steps'" in str(err)


def test_wrong_type_in_recipe_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("# @package _global_\ntrain:\n  steps: abc\n")
    err = _error(recipe=str(bad))
    assert err.field == "train.steps"
    assert str(err) == "train.steps: 'abc' is not an integer"


@pytest.mark.parametrize("kind", ["window", "block:0", "block:", "full:3", "Full"])
def test_bad_attention_kind(kind):
    err = _error([f"model.attention=[{kind}]"])
    assert err.field == "model.attention[0]"
    assert f"'{kind}' is not allowed" in str(err)
    assert "allowed: full | block:<block_size>" in str(err)


def test_bad_attention_kind_names_its_index():
    err = _error(["model.attention=[full,window]"])
    assert err.field == "model.attention[1]"


def test_good_attention_kinds():
    validate(compose(["model.attention=[block:16]"]))
    validate(compose(["model.attention=[full,block:8]"]))  # one per layer (tiny: 2 layers)
    validate(compose(["model.attention=[window:1]"]))
    validate(compose(["model.attention=[window:256,block:64]", "model.rope_base=10000"]))


def test_forced_block_kernel_refuses_shapes_it_does_not_take():
    """model.kernels.block_attention=triton with a block size or head dim the kernel lacks is refused
    before anything runs, naming the field; "auto" (the reference takes over, said once) and "torch"
    accept them."""
    err = _error(["model.attention=[full,block:48]", "model.kernels.block_attention=triton"])
    assert err.field == "model.attention[1]" and "takes block sizes 16, 32, 64, 128" in str(err)
    err = _error(["model.attention=[block:64]", "model.kernels.block_attention=triton", "model.head_dim=24"])
    assert err.field == "model.head_dim" and "takes head dims 32, 64, 128, got 24" in str(err)
    validate(compose(["model.attention=[block:48]"]))
    validate(compose(["model.attention=[block:48]", "model.kernels.block_attention=torch"]))
    validate(compose(["model.attention=[block:64]", "model.kernels.block_attention=triton", "model.head_dim=64"]))


@pytest.mark.parametrize("kind", ["window:0", "window:", "window:-4", "window:2.5", "window:x", "Window:8"])
def test_bad_window_kind(kind):
    err = _error([f"model.attention=[full,{kind}]"])
    assert err.field == "model.attention[1]"
    assert f"'{kind}' is not allowed" in str(err)
    assert "window:<window> (integers >= 1)" in str(err)


def test_bad_window_kind_exits_2_with_one_line(tmp_path):
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "gemctl", "config", "validate", "model.attention=[window:0]"],
                          capture_output=True, text=True, cwd=REPO, timeout=300)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "gemctl: error: model.attention[0]: 'window:0' is not allowed; allowed: full | block:<block_size> | "
        "window:<window> (integers >= 1)"
    ]


@pytest.mark.parametrize("base", [-1, 0.5, 1])
def test_bad_rope_base(base):
    err = _error([f"model.rope_base={base}"])
    assert err.field == "model.rope_base"
    assert "must be 0 (off) or > 1" in str(err)


def test_wrong_number_of_attention_entries():
    err = _error(["model.attention=[full,full,full]"])
    assert err.field == "model.attention"
    assert "has 3 entries" in str(err)
    assert "model.num_layers=2" in str(err)


def test_bad_kernel_backend():
    err = _error(["model.kernels.gdpa=cuda"])
    assert err.field == "model.kernels.gdpa"
    assert "'cuda' is not allowed; allowed: auto, torch, triton" in str(err)


def test_kernel_backends_reach_the_model():
    from gemctl.data.synthetic import SyntheticSource
    from gemctl.model import build_model

    cfg = compose(["model.kernels.gdpa=torch", "model.kernels.jagged_attention=triton"])
    validate(cfg)
    spec = SyntheticSource(cfg.data).spec
    model = build_model(cfg.model, spec)
    assert model.backends == {"jagged_attention": "triton", "gdpa": "torch", "block_attention": "auto"}
    forced = build_model(cfg.model, spec, backend="torch")  # an explicit backend overrides every op
    assert set(forced.backends.values()) == {"torch"}


def test_attention_kinds_reach_the_model():
    """model.attention per layer: window keeps the relative-position bias, block gets RoPE tables
    (positions from the sequence start) when model.rope_base > 0; the model trains a step."""
    from gemctl.data.synthetic import SyntheticSource
    from gemctl.model import build_model
    from gemctl.model.attention import rope_tables

    cfg = compose(["model.attention=[window:3,block:4]", "model.rope_base=10000", "data.batch_size=8"])
    validate(cfg)
    src = SyntheticSource(cfg.data)
    model = build_model(cfg.model, src.spec, backend="torch")
    window, block = (layer.attn for layer in model.tower.layers)
    assert (window.kind, window.window, window.relpos is not None) == ("window", 3, True)
    assert (block.kind, block.block_size, block.rope_base, block.relpos) == ("block", 4, 10000.0, None)
    logits = model(src.train_batch(0))
    logits.sum().backward()
    assert torch.isfinite(logits).all() and window.relpos.grad is not None
    cos, sin = rope_tables(10, 4, 8, 10000.0, "cpu")
    assert cos.shape == (16, 4)  # 10 rounded up to whole blocks (12), then to a power of two
    freq = 10000.0 ** (-torch.arange(4, dtype=torch.float64) / 4)
    assert torch.allclose(sin[5].double(), torch.sin(5 * freq), atol=1e-6)
    assert rope_tables(9, 4, 8, 10000.0, "cpu")[0] is cos  # built once per length bucket
    cos16, sin16 = rope_tables(9, 4, 8, 10000.0, "cpu", torch.float16)  # what a bf16 layer passes
    assert cos16.dtype == torch.float16 and cos16 is not cos
    assert torch.allclose(sin16[5].double(), torch.sin(5 * freq), atol=2.0**-12)


@pytest.mark.parametrize("overrides,field,words", [
    (["parallel=fsdp", "launcher=torchrun", "launcher.nproc_per_node=3", "parallel.dp_shard=2"], "parallel",
     "dp_replicate=1 x dp_shard=2 = 2 ranks, but the launcher starts 3"),
    (["parallel=hsdp", "launcher=torchrun", "launcher.nproc_per_node=6"], "parallel.dp_shard",
     "8 does not divide the world size 6"),
    (["parallel=hsdp", "launcher=torchrun", "launcher.nproc_per_node=4", "launcher.nnodes=3",
      "parallel.dp_shard=6", "parallel.topology.gpus_per_node=4"], "parallel.dp_shard", "spans nodes unevenly"),
    (["parallel=fsdp", "parallel.dp_replicate=-1"], "parallel.dp_replicate", "only one of"),
    (["parallel.dp_shard=0"], "parallel.dp_shard", "must be >= 1 or -1"),
    (["launcher=torchrun", "parallel=fsdp", "launcher.nproc_per_node=4", "parallel.ep=2"], "parallel.ep",
     "2 must divide model.moe.n_experts=0"),
    (["launcher=torchrun", "parallel=fsdp", "launcher.nproc_per_node=4", "parallel.ep=3", "model.moe.n_experts=6"],
     "parallel.ep", "3 must divide parallel.dp_shard=4"),
    (["launcher.nproc_per_node=2"], "launcher.nproc_per_node", "launcher=local runs one process"),
    (["launcher=torchrun", "parallel=fsdp", "launcher.rdzv_endpoint=nohost"], "launcher.rdzv_endpoint", "host:port"),
    (["launcher=torchrun", "parallel=fsdp", "launcher.nnodes=2", "launcher.node_rank=2"], "launcher.node_rank",
     "must be in [0, launcher.nnodes=2)"),
    (["parallel.sparse.sharding=torchrec"], "parallel.sparse.sharding", "needs launcher=torchrun or launcher=slurm"),
    (["launcher=torchrun", "parallel=fsdp", "parallel.sparse.sharding=torchrec", "train.embedding_optimizer=adam"],
     "train.embedding_optimizer", "allowed: rowwise_adagrad"),
    (["parallel.sparse.sharding_types=[grid_wise]"], "parallel.sparse.sharding_types[0]", "'grid_wise' is not allowed"),
])
def test_mis_sized_layouts(overrides, field, words):
    err = _error(overrides)
    assert err.field == field
    assert words in str(err)


def test_layouts_resolve_against_the_world():
    from gemctl.config.validate import resolve_layout, world_size

    cfg = compose(["parallel=hsdp", "launcher=torchrun", "launcher.nproc_per_node=8", "launcher.nnodes=4"])
    validate(cfg)
    assert world_size(cfg) == 32 and resolve_layout(cfg, 32) == (4, 8)
    cfg = compose(["parallel=fsdp", "launcher=torchrun", "launcher.nproc_per_node=2"])
    assert resolve_layout(cfg, world_size(cfg)) == (1, 2)


def test_precision_format_not_allowed():
    err = _error(["precision.rules=[{match: '*', format: mxfp4}]"])
    assert err.field == "precision.rules[0].format"
    assert "'mxfp4' is not allowed; allowed: bf16, fp32, mxfp8" in str(err)


def test_compute_dtype_not_allowed():
    err = _error(["precision.compute_dtype=fp16"])
    assert err.field == "precision.compute_dtype"


def test_last_n_layers_beyond_num_layers():
    err = _error(["precision.rules=[{match: 'tower.*', format: fp32, last_n_layers: 3}]"])
    assert err.field == "precision.rules[0].last_n_layers"
    assert "must be in [1, model.num_layers=2], got 3" in str(err)
    err = _error(["precision.rules=[{match: 'tower.*', format: fp32, last_n_layers: 0}]"])
    assert err.field == "precision.rules[0].last_n_layers"
    validate(compose(["precision.rules=[{match: 'tower.*', format: fp32, last_n_layers: 2}]"]))


def test_parallel_layout_needs_a_launcher():
    err = _error(["parallel.dp_shard=2"])
    assert err.field == "parallel"
    assert "needs 2 ranks but launcher=local runs 1" in str(err)
    assert "use launcher=torchrun launcher.nproc_per_node=2, or parallel=single" in str(err)


def test_launcher_nproc():
    err = _error(["launcher.nproc_per_node=2"])
    assert err.field == "launcher.nproc_per_node"


def test_base_ctr_out_of_range():
    err = _error(["data.synthetic.base_ctr=1.5"])
    assert err.field == "data.synthetic.base_ctr"
    assert "must be in (0, 1), got 1.5" in str(err)


def test_warmup_timing_steps_must_leave_timed_steps():
    err = _error(["train.steps=10", "train.warmup_timing_steps=10"])
    assert err.field == "train.warmup_timing_steps"
    assert "must be < train.steps=10" in str(err)
    validate(compose(["train.steps=10", "train.warmup_timing_steps=9"]))


def test_head_dim_multiple_of_8():
    err = _error(["model.head_dim=20"])
    assert err.field == "model.head_dim"
    assert "must be a multiple of 8" in str(err) and "got 20" in str(err)


@pytest.mark.parametrize(
    "override,field",
    [
        ("train.steps=0", "train.steps"),
        ("data.batch_size=-1", "data.batch_size"),
        ("train.device=tpu", "train.device"),
        ("data.source=criteo", "data.source"),
        ("train.betas=[0.9,1.0]", "train.betas"),
        ("metrics.peak_tflops=0", "metrics.peak_tflops"),
        ("data.synthetic.zero_length_fraction=1.0", "data.synthetic.zero_length_fraction"),
    ],
)
def test_more_cross_field_checks(override, field):
    assert _error([override]).field == field


def test_fp8_fsdp_gather_option():
    assert compose(["precision=fp8"]).precision.fp8.fsdp_gather is True
    assert compose(["precision=fp8", "precision.fp8.fsdp_gather=false"]).precision.fp8.fsdp_gather is False
    assert _error(["precision=fp8", "precision.fp8.fsdp_gather=maybe"]).field == "precision.fp8.fsdp_gather"


def test_unknown_recipe_suggests_the_close_one():
    with pytest.raises(ConfigError) as info:
        compose(recipe="cpu_smok")
    assert info.value.field == "recipe"
    assert "no recipe 'cpu_smok' (did you mean 'cpu_smoke'?)" in str(info.value)
    assert "cpu_smoke" in str(info.value).split("available:")[1]
    with pytest.raises(ConfigError) as info:
        compose(recipe="nope")
    assert info.value.field == "recipe"
    assert "did you mean" not in str(info.value)
    assert "available: " in str(info.value)


@pytest.mark.parametrize("op", ["jagged_attention", "gdpa", "block_attention"])
def test_triton_kernels_on_the_cpu_need_the_interpreter(op, monkeypatch):
    """model.kernels.<op>=triton on a CPU run: one line naming the field before anything is made
    (it used to stop at the first step with a traceback); with TRITON_INTERPRET=1 it is allowed."""
    overrides = [f"model.kernels.{op}=triton", "train.device=cpu"]
    if op == "block_attention":
        overrides.append("model.attention=[block:64]")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    err = _error(overrides)
    assert err.field == f"model.kernels.{op}" and "needs a CUDA device" in str(err)
    validate(compose(overrides), check_device=False)  # planning for another machine: not checked
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    validate(compose(overrides))
