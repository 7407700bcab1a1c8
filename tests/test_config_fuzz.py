"""Fuzzing the config: any override set either passes every check `spmd-train train` makes before it
compiles, or is refused with a ConfigError that names one of the keys it was given; never another exception.

The keys, their types, Literal choices and pydantic bounds are read from the schema (dataclass fields and type
hints), so a key added to `spmd_train.config.schema` is fuzzed without touching this file.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import types
import typing
from pathlib import Path
from typing import Annotated, Any, Literal, Union

import annotated_types as at
import pytest
from hypothesis import HealthCheck, assume, event, given, settings
from hypothesis import strategies as st
from pydantic.fields import FieldInfo

from spmd_train.cli.main import main
from spmd_train.config import Config, load_config
from spmd_train.config.mesh_schema import LOGICAL_AXES
from spmd_train.errors import ConfigError
from spmd_train.train.trainer import Trainer

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
BASES = [str(CONFIGS / f"{name}.yaml") for name in ("tiny", "moe", "pipeline", "mesh_presets")]
"""The shipped configs that fit the 8 simulated devices (the llama3 ones need a cluster)."""


@dataclasses.dataclass(frozen=True)
class Key:
    """One dotted key of the schema: its type (or 'section', 'literal', 'tuple'), choices and bounds."""

    path: str
    kind: Any
    choices: tuple = ()
    bounds: tuple = ()
    """annotated_types Ge/Gt/Le/Lt, as pydantic's Field(ge=..., lt=...) records them."""
    optional: bool = False
    item: Key | None = None
    """The element of a tuple (list in YAML)."""
    alternatives: tuple = ()
    """The keys of a union's types (e.g. a list of ints or a literal word)."""


def schema_keys(cls: type = Config, prefix: str = "") -> typing.Iterator[Key]:
    hints = typing.get_type_hints(cls, include_extras=True)
    for f in dataclasses.fields(cls):
        yield from _keys(prefix + f.name, hints[f.name])


def _keys(path: str, tp: Any, bounds: tuple = (), optional: bool = False) -> typing.Iterator[Key]:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Annotated:
        extra = tuple(m for info in args[1:] if isinstance(info, FieldInfo) for m in info.metadata)
        yield from _keys(path, args[0], bounds + extra, optional)
    elif origin in (Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        nullable = optional or len(inner) < len(args)
        if len(inner) == 1:
            yield from _keys(path, inner[0], bounds, optional=nullable)
        else:
            yield Key(path, "union", alternatives=tuple(next(_keys(path, a, bounds)) for a in inner),
                      optional=nullable)
    elif dataclasses.is_dataclass(tp):
        yield Key(path, "section", optional=optional)
        yield from schema_keys(tp, path + ".")
    elif origin is Literal:
        yield Key(path, "literal", choices=args, optional=optional)
    elif origin is tuple:
        yield Key(path, "tuple", item=next(_keys(path, args[0])), optional=optional)
    elif origin is dict:  # a rules table, keyed by the logical axis names the schema checks against
        yield Key(path, "section")
        entry = next(_keys(path, args[1]))
        yield from (dataclasses.replace(entry, path=f"{path}.{name}") for name in LOGICAL_AXES)
    else:
        yield Key(path, tp, bounds=bounds, optional=optional)


KEYS = list(schema_keys())
KNOWN = {k.path for k in KEYS}
LEAVES = {k.path for k in KEYS if k.kind != "section"}
SECTIONS = sorted({k.path.split(".")[0] for k in KEYS})


def _text(value: Any) -> str:
    """A Python value as override text (YAML flow style)."""
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_text(v) for v in value) + "]"
    if isinstance(value, float) and not math.isfinite(value):
        return ".nan" if math.isnan(value) else ("-.inf" if value < 0 else ".inf")
    return json.dumps(value)  # JSON is YAML: quoted strings, true/false/null


HUGE = ["1e30", "-1e30", str(2**63), str(-(2**63)), str(2**31), str(10**100), "1e309"]
NONFINITE = [".nan", ".inf", "-.inf", "nan", "inf", "NaN"]
ODD = ["", "[", "]", "{", "{a: 1}", "null", "~", "yes", "no", "on", "é✓🙂", "'", '"', ":", "- x", "a: b", "&x", "*x",
       "!!python/object/apply:os.system [true]", '"a\\0b"', "0x10", "0o17", "1_000", "  ", "#", "a=b", "%", "|", "-",
       "{a: [1, {b: 2}]}", "2001-01-01", ".", "/", "[[1]]", "[null]", "['', ~]"]
TEXT = "ab-_./*~\x00 \té✓:[{#"
"""Characters of drawn strings (names, paths and globs): separators, wildcards, NUL, YAML syntax."""
WRONG = ["abc", "1.5", "true", "[1, 2]", "{a: 1}", '"64"', "[]", "{}", "null", "3"]


def _bound(bounds: tuple) -> tuple[float | None, float | None]:
    lo = next((b.ge for b in bounds if isinstance(b, at.Ge)), None)
    lo = next((b.gt for b in bounds if isinstance(b, at.Gt)), lo)
    hi = next((b.le for b in bounds if isinstance(b, at.Le)), None)
    return lo, next((b.lt for b in bounds if isinstance(b, at.Lt)), hi)


def valid(key: Key) -> st.SearchStrategy[Any]:
    """Values of the key's type in its range, kept small so that draws collide (axes vs devices, batch vs mesh)."""
    none = st.just(None) if key.optional else st.nothing()
    if key.kind == "section":
        return st.sampled_from([None, {}])
    if key.kind == "literal":
        return st.sampled_from(key.choices) | none
    if key.kind == "tuple":
        return st.lists(valid(key.item), max_size=3) | none
    if key.kind == "union":
        return st.one_of([valid(k) for k in key.alternatives]) | none
    if key.kind is bool:
        return st.booleans() | none
    lo, hi = _bound(key.bounds)
    if key.kind is int:
        lo = -1 if lo is None else int(lo)
        top = lo + 16 if hi is None else min(int(hi), lo + 16)
        return st.integers(lo, top) | (st.just(int(hi)) if hi is not None else st.nothing()) | none
    if key.kind is float:
        lo = -10.0 if lo is None else float(lo)
        return st.floats(lo, lo + 10 if hi is None else hi, exclude_min=True, exclude_max=hi is not None) | none
    return st.text(TEXT, max_size=10) | none


def edges(key: Key) -> list[str]:
    """A numeric key's bounds and the values just past them."""
    lo, hi = _bound(key.bounds) if key.kind in (int, float) else (None, None)
    step = 1 if key.kind is int else 1e-9
    return [_text(v) for v in (lo, None if lo is None else lo - step, hi, None if hi is None else hi + step)
            if v is not None]


def typo(path: str) -> st.SearchStrategy[str]:
    """A real key with one component misspelled (dropped, doubled or swapped letter), or a key nobody has."""
    parts = path.split(".")

    def misspell(i: int, j: int, how: int) -> str:
        word = parts[i]
        j %= len(word)
        word = [word[:j] + word[j + 1:], word[:j] + word[j] + word[j:], word[:j] + word[j + 1:j + 2] + word[j]
                + word[j + 2:], word + "s"][how]
        return ".".join([*parts[:i], word or "x", *parts[i + 1:]])

    spelled = st.builds(misspell, st.integers(0, len(parts) - 1), st.integers(0, 30), st.integers(0, 3))
    return spelled | st.sampled_from(["zzz", "model.zzz", "foo.bar.baz", f"{path}.zzz", "mesh.rules.zzz.embed"])


@st.composite
def runs(draw: st.DrawFn) -> tuple[str, list[str]]:
    """(base config, 1-4 overrides): mostly keys of one section (their cross-key checks), some from anywhere."""
    section = draw(st.sampled_from(SECTIONS))
    near = [k for k in KEYS if k.path.startswith(section + ".")]
    overrides = []
    for _ in range(draw(st.integers(1, 4))):
        key = draw(st.sampled_from(near) if draw(st.integers(0, 3)) else st.sampled_from(KEYS))
        path = draw(typo(key.path)) if draw(st.integers(0, 9)) == 0 else key.path
        bad = st.sampled_from(WRONG + ODD + HUGE + NONFINITE + edges(key))
        value = draw(st.one_of(valid(key).map(_text), valid(key).map(_text), bad))
        overrides.append(f"{path}={value}")
    return draw(st.sampled_from(BASES)), overrides


def _names(path: str) -> list[str]:
    """What an error about this override may call it: the key, its last part, the first part that is not a key,
    the deepest key it sits below (`model.d_model.x=1` sets model.d_model to a mapping), or a subsection it
    brings into being or that is checked as a whole (`model.moe.every=1` makes the model an MoE model)."""
    parts = path.split(".")
    prefixes = [".".join(parts[:i]) for i in range(1, len(parts) + 1)]
    names = [path, parts[-1]]
    names += [p for p in prefixes if p not in KNOWN][:1]
    names += [p for p in prefixes if p in LEAVES][-1:]
    names += [p for p in prefixes[1:] if p in KNOWN and p not in LEAVES]
    return names


def names_a_key(message: str, overrides: list[str]) -> bool:
    for item in overrides:
        for name in _names(item.partition("=")[0].strip()):
            # Whole words only, and a bare last part must not be the tail of another dotted key.
            if name and re.search(rf"(?<![\w.]){re.escape(name)}(?!\w)", message):
                return True
    return False


def precheck(base: str, overrides: list[str]) -> tuple[Config | None, str | None]:
    """(config, None) when the run passes every check `train` makes before compiling (`Trainer.__init__`: devices,
    mesh, layout, backends, state bytes, data source), else (config or None, the ConfigError's message)."""
    cfg = None
    try:
        cfg = load_config(base, overrides)
        Trainer(cfg)
    except ConfigError as err:
        return cfg, str(err)
    return cfg, None


FUZZ = settings(derandomize=True, deadline=None, database=None, suppress_health_check=list(HealthCheck))


@pytest.mark.slow
@settings(FUZZ, max_examples=1000)
@given(run=runs())
def test_any_override_set_is_accepted_or_refused_naming_one_of_its_keys(run):
    _, message = precheck(*run)
    event("accepted" if message is None else "refused by the schema" if message.startswith("invalid config")
          else "refused by a cross-key, layout or memory check")
    assert message is None or names_a_key(message, run[1]), f"{run[1]} -> {message}"


@settings(FUZZ, max_examples=40)
@given(run=runs())
def test_the_cli_exits_0_or_2_naming_a_key_and_never_prints_a_traceback(run, tmp_path, capsys):
    """Valid sets go through `describe --rules` (which loads and checks the config, then compiles nothing); refused
    ones through `train`, which exits 2 before it compiles. Sets that start the distributed runtime are left out:
    jax is already running in this process (test_config covers them in a fresh one)."""
    base, overrides = run
    cfg, expected = precheck(base, overrides)
    assume(cfg is None or not (cfg.run.distributed or cfg.run.coordinator))
    argv = ["describe", "--rules", base, *overrides] if expected is None else [
        "train", base, *overrides, f"run.dir={tmp_path / 'run'}"]
    capsys.readouterr()
    try:
        code = main(argv)
    except SystemExit as stop:  # argparse
        code = stop.code
    err = capsys.readouterr().err
    event(f"{argv[0]} exited {code}")
    assert "Traceback" not in err
    assert code == (0 if expected is None else 2), (argv, err)
    if code == 2:
        assert names_a_key(err, overrides), (argv, err)
