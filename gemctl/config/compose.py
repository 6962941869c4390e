"""Compose a run config: configs/ groups + an optional recipe + command-line overrides.

Hydra's compose API does the merging; errors from Hydra and OmegaConf are turned into one line
that names the field and what is allowed (:class:`gemctl.errors.ConfigError`).
"""

from __future__ import annotations

import difflib
import re
import tempfile
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from gemctl.errors import ConfigError, UserError

PRIMARY = "gemctl"


def _resource_dir(name: str) -> Path:
    """configs/ or recipes/ in a source checkout, else the copy bundled into the wheel."""
    src = Path(__file__).resolve().parents[2] / name
    if src.is_dir():
        return src
    import importlib.resources

    return Path(str(importlib.resources.files(f"gemctl._{name}")))


def configs_dir() -> Path:
    return _resource_dir("configs")


def recipes_dir() -> Path:
    return _resource_dir("recipes")


def list_recipes() -> dict[str, Path]:
    return {p.stem: p for p in sorted(recipes_dir().rglob("*.yaml"))}


def resolve_recipe(recipe: str) -> Path:
    """A recipe by name (recipes/NAME.yaml) or by path to a YAML file."""
    path = Path(recipe)
    if path.suffix in (".yaml", ".yml") and path.is_file():
        return path.resolve()
    recipes = list_recipes()
    if recipe in recipes:
        return recipes[recipe]
    hint = difflib.get_close_matches(recipe, recipes, n=1)
    more = f" (did you mean '{hint[0]}'?)" if hint else ""
    raise ConfigError("recipe", f"no recipe '{recipe}'{more}; available: {', '.join(recipes)}")


def compose(overrides: list[str] | None = None, recipe: str | None = None) -> DictConfig:
    """Compose and type-check the config; raises ConfigError with one actionable line."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from gemctl.config.schema import register

    register()
    overrides = list(overrides or [])
    path = None
    with tempfile.TemporaryDirectory(prefix="gemctl-recipe-") as tmp:
        if recipe is not None:
            # A recipe is a `# @package _global_` config of the group "recipes" (Hydra's
            # experiment pattern: it may override groups of the base defaults list). The group
            # is reached through a search-path entry holding only this recipe, so a user's
            # copied recipe anywhere on disk works the same as a bundled one.
            path = resolve_recipe(recipe)
            (Path(tmp) / "recipes").mkdir()
            text = path.read_text()
            if not re.search(r"^\s*#\s*@package", text, flags=re.M):
                # a file without the directive (a run's config.yaml, `gemctl config show`'s output,
                # a hand-written one) holds top-level keys too, not keys of the group "recipes"
                _check_group_choices(text, path, overrides)
                text = "# @package _global_\n" + text
            (Path(tmp) / "recipes" / f"{path.stem}.yaml").write_text(text)  # Hydra finds .yaml only
            overrides = [f"hydra.searchpath=[file://{tmp}]", f"+recipes={path.stem}", *overrides]
        GlobalHydra.instance().clear()
        try:
            with initialize_config_dir(config_dir=str(configs_dir()), version_base="1.3"):
                cfg = hydra_compose(config_name=PRIMARY, overrides=overrides)
        except Exception as exc:  # Hydra wraps the OmegaConf error; unwrap it into one line
            raise _to_config_error(exc, overrides, recipe_path=path) from None
        finally:
            GlobalHydra.instance().clear()
        try:
            # Re-merge into the schema: catches keys forced in with '+key=value' and keys inside
            # list elements (precision.rules[0].fmt) that Hydra lets through.
            from gemctl.config.schema import GemConfig

            _check_known_keys(OmegaConf.to_container(cfg), GemConfig, "")
            typed = OmegaConf.merge(OmegaConf.structured(GemConfig), cfg)
        except Exception as exc:
            raise _to_config_error(exc, overrides) from None
    OmegaConf.set_readonly(typed, False)
    return typed


def _check_group_choices(text: str, path: Path, overrides: list[str]) -> None:
    """A config file without a package line sets whole blocks (`model:` with every field, as a
    run's config.yaml does), merged after the groups: a group picked on the command line
    (model=gem_1b) would be overwritten by the file's block without a word, so it is refused."""
    import yaml

    try:
        top = yaml.safe_load(text)
    except yaml.YAMLError:
        return  # composing reports it, with its line
    if not isinstance(top, dict):
        return
    groups = {d.name for d in configs_dir().iterdir() if d.is_dir()}
    for o in overrides:
        key, _, value = o.partition("=")
        key = key.lstrip("+~")
        if key in groups and key in top:
            raise ConfigError(key, f"{key}={value} would not apply: {path} sets the whole '{key}' block (a config "
                                   f"file without a '# @package' line); override its fields ({key}.<field>=...) or "
                                   f"remove the block from the file")


def _check_known_keys(node, schema_type, path: str) -> None:
    """Every key must be a field of the schema dataclass (recursing into nested dataclasses)."""
    import dataclasses
    import typing

    fields = {f.name: f for f in dataclasses.fields(schema_type)}
    hints = typing.get_type_hints(schema_type)
    for key, value in node.items():
        where = f"{path}.{key}" if path else str(key)
        if key not in fields:
            hint = difflib.get_close_matches(str(key), fields, n=1)
            more = f" (did you mean '{hint[0]}'?)" if hint else ""
            raise ConfigError(where, f"unknown key{more}; allowed: {', '.join(fields)}")
        typ = hints[key]
        args = typing.get_args(typ)
        if dataclasses.is_dataclass(typ) and isinstance(value, dict):
            _check_known_keys(value, typ, where)
        elif args and dataclasses.is_dataclass(args[0]) and isinstance(value, list):
            for i, item in enumerate(value):
                if isinstance(item, dict):
                    _check_known_keys(item, args[0], f"{where}[{i}]")


def _locate_unknown_key(overrides: list[str], recipe_path: Path | None) -> ConfigError | None:
    """Hydra reports an unknown key inside a list element (``precision.rules[1].fmt``) or in a
    recipe without its dotted path; find it by checking the recipe and the overrides' values
    against the schema."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from gemctl.config.schema import GemConfig

    try:
        nodes = []
        if recipe_path is not None:
            node = OmegaConf.to_container(OmegaConf.load(recipe_path))
            if isinstance(node, dict):
                node.pop("defaults", None)
                nodes.append(node)
        for ov in OverridesParser.create().parse_overrides(overrides):
            key = ov.key_or_group
            if key.split(".")[0] in ("hydra", "recipes") or ov.is_delete() or ov.is_sweep_override():
                continue
            value = ov.value()
            if isinstance(value, (dict, list)):
                for part in reversed(key.split(".")):
                    value = {part: value}
                nodes.append(value)
        for node in nodes:
            _check_known_keys(node, GemConfig, "")
    except ConfigError as exc:
        return exc
    except Exception:
        return None
    return None


def _root_cause(exc: BaseException) -> BaseException:
    while exc.__cause__ is not None:
        exc = exc.__cause__
    return exc


def _allowed_keys(full_key: str) -> list[str]:
    from gemctl.config.schema import GemConfig

    node = OmegaConf.structured(GemConfig)
    parent = full_key.rsplit(".", 1)[0] if "." in full_key else ""
    try:
        sub = OmegaConf.select(node, parent) if parent else node
        return list(sub.keys()) if isinstance(sub, DictConfig) else []
    except Exception:
        return []


def _is_list_field(key: str) -> bool:
    """Whether the dotted key names a list field of the schema."""
    from omegaconf import ListConfig

    from gemctl.config.schema import GemConfig

    try:
        return isinstance(OmegaConf.select(OmegaConf.structured(GemConfig), key), ListConfig)
    except Exception:
        return False


def _plain_validation(first: str, key: str, overrides: list[str]) -> str:
    """OmegaConf's type errors in the terms of the field: what it takes."""
    wrong = re.match(r"Value '(.*)' of type '\w+' could not be converted to (\w+)", first)
    if wrong:
        kind = {"Integer": "an integer", "Float": "a number", "Boolean": "true or false"}.get(wrong.group(2))
        if kind:
            return f"'{wrong.group(1)}' is not {kind}"
    bad_bool = re.match(r"Value '(.*)' is not a valid bool", first)
    if bad_bool:
        return f"'{bad_bool.group(1)}' is not true or false"
    if "is not a ListConfig, list or tuple" in first:
        given = [o.split("=", 1)[1] for o in overrides if o.split("=", 1)[0].lstrip("+") == key and "=" in o]
        return f"a list is expected, e.g. {key}=[{given[-1] if given else '...'}]"
    return first


def _to_config_error(exc: Exception, overrides: list[str], recipe_path: Path | None = None) -> UserError:
    from omegaconf.errors import ConfigKeyError, OmegaConfBaseException

    if isinstance(exc, UserError):
        return exc
    cause = _root_cause(exc)
    text = str(cause).strip()
    if re.search(r"Key '[^']+' not in '\w+'", text):
        located = _locate_unknown_key(overrides, recipe_path)
        if located is not None:
            return located
    # An error inside a recipe arrives as Hydra's text: "In 'recipes/x': ValidationError raised
    # while composing config:\n<message>\n    full_key: train.steps ..."; take both from the text.
    wrapped = re.match(r"In '[^']+': \w+ raised while composing config:\s*\n", text)
    if wrapped:
        text = text[wrapped.end():].strip()
    first = text.splitlines()[0] if text else type(cause).__name__
    full_key = getattr(cause, "full_key", None)
    if wrapped and not full_key:
        key = re.search(r"^\s*full_key: (\S+)\s*$", text, flags=re.M)
        full_key = key.group(1) if key else None

    missing = re.search(r"Could not find '([^']+)/([^']+)'", text)
    if missing:
        group, option = missing.groups()
        options = sorted(re.findall(r"^\t(\S+)$", text, flags=re.M))
        if not options:
            options = sorted(p.stem for p in (configs_dir() / group).glob("*.yaml"))
        hint = difflib.get_close_matches(option, options, n=1)
        more = f" (did you mean '{hint[0]}'?)" if hint else ""
        return ConfigError(group, f"no config '{option}'{more}; allowed: {', '.join(options)}")
    unknown = re.search(r"Key '([^']+)' not in '(\w+)'", first)
    if unknown or (isinstance(cause, ConfigKeyError) and full_key):
        full_key = full_key or unknown.group(1)
        allowed = _allowed_keys(full_key)
        if unknown:
            import dataclasses

            from gemctl.config import schema

            owner = getattr(schema, unknown.group(2), None)
            if dataclasses.is_dataclass(owner):
                allowed = [f.name for f in dataclasses.fields(owner)]
                if "." not in full_key and owner is not schema.GemConfig:
                    full_key = f"{unknown.group(2)}.{full_key}"
        leaf = full_key.rsplit(".", 1)[-1]
        hint = difflib.get_close_matches(leaf, allowed, n=1)
        more = f" (did you mean '{hint[0]}'?)" if hint else ""
        return ConfigError(full_key, f"unknown key{more}; allowed: {', '.join(allowed)}")
    if (isinstance(cause, OmegaConfBaseException) or wrapped) and full_key:  # ValidationError among them
        return ConfigError(full_key, _plain_validation(first, full_key, overrides))
    ambiguous = re.match(r"Ambiguous value for argument '([^'=]+)=([^']*)'", first)
    if ambiguous:
        key, value = ambiguous.groups()
        if "." not in key:  # a config group: one option per run
            return ConfigError(key, f"'{value}' gives several options: add -m to run one job each")
        other = f"write a list as {key}=[{value}]" if _is_list_field(key) else f"quote it as {key}='{value}'"
        return ConfigError(key, f"'{value}' gives several values: add -m to sweep them, or {other}")
    if getattr(cause, "problem_mark", None) is not None and recipe_path is not None:
        import yaml

        try:  # the line in the user's file (Hydra parsed a copy that may start with a package line)
            yaml.safe_load(recipe_path.read_text())
        except yaml.MarkedYAMLError as err:
            cause = err
        where = f", line {cause.problem_mark.line + 1}" if cause.problem_mark is not None else ""
        what = "; ".join(str(x) for x in (cause.context, cause.problem) if x)
        return ConfigError("recipe", f"{recipe_path}{where}: not valid YAML ({what})")
    if "Could not override" in text or "Key '" in text:
        key = re.search(r"Key '([^']+)'", text)
        field = key.group(1) if key else "overrides"
        return ConfigError(field, first)
    return ConfigError("config", first)
