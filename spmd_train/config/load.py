"""Load a run config: YAML file + `section.key=value` overrides + named presets, validated.

Precedence, lowest first: schema defaults, the model/mesh preset, the run config file,
command-line overrides. Presets are named by `model.preset` (a file `models/NAME.yaml`
holding a `model:` section) and `mesh.preset` (a file `meshes/NAME.yaml` holding a
`mesh:` section and optionally a `parallel:` section); a preset may also be a path.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import functools
import json
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pydantic
import yaml

from spmd_train.config.checks import check_config
from spmd_train.config.hf_config import hf_directory, model_section, read_hf_config
from spmd_train.config.model_schema import ModelConfig
from spmd_train.config.moved import MOVED_KEYS, upgrade_model_section
from spmd_train.config.precision_schema import prefer_overridden_aliases, resolve_aliases
from spmd_train.config.resolved_rules import RuleTables
from spmd_train.config.schema import Config
from spmd_train.errors import ConfigError

_REPO_ROOT = Path(__file__).resolve().parents[2]
_PRESET_SECTIONS = {"model": ("models", ("model",)), "mesh": ("meshes", ("mesh", "parallel")),
                    "precision": ("precisions", ("precision",))}
_ADAPTER = pydantic.TypeAdapter(Config)
_MODEL = pydantic.TypeAdapter(ModelConfig)


class _Loader(yaml.SafeLoader):
    """Safe YAML loading that also reads `1e-3` as a float (YAML 1.2), as users expect, and refuses a key given
    twice in one mapping (PyYAML keeps the last silently: a typo'd copy would win without a word)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    "while constructing a mapping", node.start_mark, f"found the key {key!r} twice",
                    key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(
        r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
        |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
        |\.[0-9_]+(?:[eE][-+]?[0-9]+)?
        |[-+]?\.(?:inf|Inf|INF)
        |\.(?:nan|NaN|NAN))$""",
        re.X,
    ),
    list("-+0123456789."),
)


def _yaml(text: str) -> Any:
    # A copy of the parse: callers merge into what they get. Loading a config reads the same preset and rules files
    # several times (each preset, the rules table, every planner candidate), and PyYAML's pure-Python parser was a
    # fifth of the config fuzzer's time.
    return copy.deepcopy(_parsed(text))


@functools.lru_cache(maxsize=256)
def _parsed(text: str) -> Any:
    return yaml.load(text, Loader=_Loader)  # _Loader is a SafeLoader


def load_config(path: str | Path | None, overrides: Sequence[str] = ()) -> Config:
    """Read a YAML run config (or only defaults when path is None), apply overrides and presets."""
    if isinstance(overrides, str):  # iterating it would read one character per override
        raise ConfigError(f"load_config takes its overrides as a list of 'section.key=value' strings, not the string "
                          f"{overrides!r} (valid: {overrides.split()!r})")
    raw: dict[str, Any] = {}
    base_dir = Path.cwd()
    if path is not None:
        path = Path(path)
        raw = _read_yaml(path, what="config file")
        base_dir = path.resolve().parent
    given = parse_overrides(overrides)
    prefer_overridden_aliases(raw, given)
    _deep_update(raw, given)
    raw.pop("resolved", None)  # a run's config.json: what the engine derived, not settings
    return config_from_dict(raw, base_dir=base_dir)


def config_from_dict(raw: Mapping[str, Any], base_dir: str | Path | None = None) -> Config:
    """Validate a nested dict (as read from YAML) into a Config, resolving presets first."""
    given = dict(raw)  # what the user wrote: its precision keys win over presets and an imported checkpoint's
    raw = _resolve_presets(_with_hf_model(dict(raw)), Path(base_dir) if base_dir else Path.cwd())
    resolve_aliases(raw, given)
    try:
        # JSON mode: strict about scalar types (no "64" for 64), yet dicts become dataclasses
        # and lists become tuples, which is exactly what YAML input needs.
        cfg = _ADAPTER.validate_json(json.dumps(raw, default=str))
    except pydantic.ValidationError as err:
        raise ConfigError(_describe_validation_error(err)) from None
    check_config(cfg)
    return cfg


def _with_hf_model(raw: dict[str, Any]) -> dict[str, Any]:
    """checkpoint.load_from=hf:DIR: the model section is DIR/config.json's, under the config's own model keys.

    A directory that is not there leaves the section as given: a resumed run has it in full and never
    reads DIR again; a fresh run fails when it loads the weights, naming the directory.
    """
    checkpoint = raw.get("checkpoint")
    directory = hf_directory(checkpoint.get("load_from") if isinstance(checkpoint, dict) else None)
    if directory is None or not directory.exists():
        return raw
    given = raw.get("model") if isinstance(raw.get("model"), dict) else {}
    if given.get("preset") is not None:
        raise ConfigError(f"model.preset={given['preset']} and checkpoint.load_from={checkpoint['load_from']} both "
                          "name an architecture (valid: one of them; the checkpoint's config.json sets the model)")
    model = model_section(read_hf_config(directory))
    _deep_update(model, given)
    return {**raw, "model": model}


def model_from_record(model: Mapping[str, Any]) -> ModelConfig:
    """A `model` section as a checkpoint recorded it (any version: moved keys are read anew, missing = defaults)."""
    try:
        return _MODEL.validate_json(json.dumps(upgrade_model_section(dict(model)), default=str))
    except pydantic.ValidationError as err:
        raise ConfigError("a checkpoint records a model section this version cannot read: "
                          + _describe_validation_error(err).removeprefix("invalid config: ")) from None


def parse_overrides(overrides: Sequence[str]) -> dict[str, Any]:
    """Turn ["model.d_model=128", ...] into a nested dict; values are parsed as YAML scalars/lists."""
    nested: dict[str, Any] = {}
    for item in overrides:
        key, sep, text = item.partition("=")
        parts = key.strip().split(".")
        if not sep or not all(parts):
            raise ConfigError(
                f"override {item!r} is not of the form section.key=value "
                "(for example model.d_model=128 or mesh.tensor=2)"
            )
        try:
            value = _yaml(text) if text.strip() else None
        except yaml.YAMLError:
            value = text
        node = nested
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {item!r} sets a key below {part!r}, which is a value")
        node[parts[-1]] = value
    return nested


def _read_yaml(path: Path, what: str) -> dict[str, Any]:
    if path.is_dir():
        raise ConfigError(f"{what} {str(path)!r} is a directory (valid: a YAML file, e.g. configs/tiny.yaml)")
    if not path.is_file():
        raise ConfigError(f"{what} {str(path)!r} does not exist")
    try:
        data = _yaml(path.read_text())
    except yaml.YAMLError as err:
        raise ConfigError(f"{what} {str(path)!r} is not valid YAML: {err}") from None
    if data is None:  # training the defaults from an empty or all-comment file is never what was meant
        raise ConfigError(f"{what} {str(path)!r} is empty (valid: a mapping of sections such as model:, mesh:, "
                          "train:; or no file at all for the defaults)")
    if not isinstance(data, dict):
        raise ConfigError(f"{what} {str(path)!r} must hold a mapping of sections, got {type(data).__name__}")
    return data


def _resolve_presets(raw: dict[str, Any], base_dir: Path) -> dict[str, Any]:
    # Start from the schema defaults so a partial mapping (one rules entry) updates, not replaces.
    merged: dict[str, Any] = dataclasses.asdict(Config())
    for section, (folder, allowed) in _PRESET_SECTIONS.items():
        body = raw.get(section)
        name = body.get("preset") if isinstance(body, dict) else None
        if name is None:
            continue
        if not isinstance(name, str):
            raise ConfigError(f"{section}.preset={name!r} must be a preset name or a path to a YAML file")
        fragment = _read_yaml(_find_preset(folder, name, base_dir, section), what=f"{section} preset")
        extra = sorted(set(fragment) - set(allowed))
        if extra:
            raise ConfigError(
                f"{section} preset {name!r} holds sections {extra}; a {section} preset may hold only {list(allowed)}"
            )
        _deep_update(merged, fragment)
    _deep_update(merged, raw)
    _resolve_rules_preset(merged, base_dir)
    return merged


@functools.cache
def default_rules() -> RuleTables:
    """The default preset's tables (`meshes/rules/default.yaml`), as a config without rules of its own loads them."""
    return RuleTables.from_config(load_config(None).mesh.rules)


def _resolve_rules_preset(merged: dict[str, Any], base_dir: Path) -> None:
    """Put the rules preset's tables under the config's own entries (`mesh.rules.preset`)."""
    mesh = merged.get("mesh")
    rules = mesh.get("rules") if isinstance(mesh, dict) else None  # `mesh=%` makes the section a string
    if not isinstance(rules, dict):
        return  # not a mapping: validation names the key
    name = rules.get("preset")
    if not isinstance(name, str):
        raise ConfigError(f"mesh.rules.preset={name!r} must be a rules preset name or a path to a YAML file")
    fragment = _read_yaml(_find_preset("meshes/rules", name, base_dir, "mesh.rules"), what="rules preset")
    extra = sorted(set(fragment) - {"activations", "params"})
    if extra:
        raise ConfigError(f"rules preset {name!r} holds {extra}; a rules preset may hold only activations and params")
    for table in ("activations", "params"):
        own = rules.get(table) or {}
        if not isinstance(own, dict):
            raise ConfigError(f"mesh.rules.{table}={own!r} must map logical axis names to lists of mesh axes")
        rules[table] = {**(fragment.get(table) or {}), **own}


def _find_preset(folder: str, name: str, base_dir: Path, section: str) -> Path:
    as_path = Path(name)
    if as_path.suffix in (".yaml", ".yml"):
        for candidate in (as_path, base_dir / as_path):
            if candidate.is_file():
                return candidate
    dirs = []
    for root in (base_dir.parent, base_dir, Path.cwd(), _REPO_ROOT):
        d = (root / folder).resolve()
        if d not in dirs:
            dirs.append(d)
    for d in dirs:
        if (d / f"{name}.yaml").is_file():
            return d / f"{name}.yaml"
    known = sorted({p.stem for d in dirs if d.is_dir() for p in d.glob("*.yaml")})
    raise ConfigError(f"{section}.preset={name!r} is not a known preset; "
                      f"valid presets: {', '.join(known) or 'none found'}")


def _deep_update(target: dict[str, Any], update: Mapping[str, Any]) -> None:
    for key, value in update.items():
        if isinstance(value, Mapping) and isinstance(target.get(key), dict):
            _deep_update(target[key], value)
        else:
            target[key] = dict(value) if isinstance(value, Mapping) else value


def _describe_validation_error(err: pydantic.ValidationError) -> str:
    problems = []
    for e in err.errors():
        key = _dotted(e["loc"])
        if e["type"] in ("unexpected_keyword_argument", "extra_forbidden"):
            loc = [str(p) for p in e["loc"]]
            if key in MOVED_KEYS:
                problems.append(f"{key!r} has moved: use {MOVED_KEYS[key]}")
                continue
            valid = _valid_keys(loc[:-1])
            hint = difflib.get_close_matches(loc[-1], valid, n=1)
            problems.append(
                f"unknown key {key!r}"
                + (f" (did you mean {'.'.join(loc[:-1] + hint)!r}?)" if hint else "")
                + (f"; valid keys here: {', '.join(valid)}" if valid else "")
            )
        else:
            # A validator's own sentence, without pydantic's "Value error, " prefix.
            msg = str(e["ctx"]["error"]) if e["type"] == "value_error" else e["msg"]
            if e["type"] in ("dataclass_type", "dict_type"):  # pydantic's JSON word "object" means little in YAML
                msg = "it is a section: give its keys (section.key=value, or {key: value} in YAML)"
            if e["type"] == "missing" and isinstance(e["input"], dict):  # pydantic shows the section, not the key
                problems.append(f"{key} is required (no default)")
            else:
                problems.append(f"{key}={e['input']!r} is invalid: {msg}")
    return "invalid config: " + "; ".join(problems)


def _dotted(loc: tuple) -> str:
    """('mesh', 'rules', 'params', 'embed', 0) -> 'mesh.rules.params.embed[0]'."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else f"{'.' if out else ''}{part}"
    return out


def _valid_keys(loc: list[str]) -> list[str]:
    cls: Any = Config
    for part in loc:
        fields = {f.name: f for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else {}
        if part not in fields:
            return []
        cls = _dataclass_of(fields[part])
        if cls is None:
            return []
    return [f.name for f in dataclasses.fields(cls)] if dataclasses.is_dataclass(cls) else []


def _dataclass_of(f: dataclasses.Field) -> type | None:
    factory = f.default_factory
    if factory is not dataclasses.MISSING and isinstance(factory, type) and dataclasses.is_dataclass(factory):
        return factory
    return None
