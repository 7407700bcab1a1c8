"""docs/reference/config.md from the config schema: every section reachable from `Config`, walked by introspection."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import itertools
import re
import textwrap
import types
import typing
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Annotated, Any, Literal, Union

import pydantic

from spmd_train.config.schema import Config

HEADER = """# Config reference

<!-- Generated from spmd_train.config.schema.Config by `make docs` (spmd_train/cli/reference_docs.py): do not edit
by hand; tests/test_reference_docs.py fails when this page and the schema differ. -->

Every key a run config takes, section by section, with its type, its default and what it does. Set a key in the
YAML file (`section:` then `key: value`) or on the command line (`section.key=value`); the command line wins over
the file, the file over the presets it names, the presets over the defaults below. An unknown key, a value of the
wrong type or one out of range exits 2 naming the key, the value and what is valid. How configs combine, presets
and what may change on resume: [configs.md](../configs.md).
"""


@dataclass(frozen=True)
class Key:
    """One field of a section: its dotted path, type, default and documentation."""

    path: str
    annotation: Any
    default: str
    doc: str
    section: type | None
    """The section class the field holds (a nested table), or None for a leaf key."""


def config_reference() -> str:
    """The markdown of docs/reference/config.md."""
    out = [HEADER, "Sections: " + ", ".join(f"[`{k.path}`](#{_anchor(k.path)})" for k in _keys(Config, "")) + ".\n"]
    out += _section_pages(Config, "")
    return "\n".join(out).rstrip() + "\n"


def _section_pages(cls: type, prefix: str) -> list[str]:
    out = []
    for key in _keys(cls, prefix):
        if key.section is None:
            continue
        level = "#" * min(1 + key.path.count(".") + 1, 6)
        out += [f"{level} `{key.path}`\n", _class_doc(key.section) + "\n"]
        if key.doc:
            out.append(key.doc + "\n")
        rows = [_row(k) for k in _keys(key.section, key.path)]
        out += ["| key | type | default | description |\n|---|---|---|---|\n" + "\n".join(rows) + "\n"]
        out += _section_pages(key.section, key.path)
    return out


def _row(key: Key) -> str:
    doc = key.doc
    if key.section is not None:
        doc = (doc + " " if doc else "") + f"Its keys: [`{key.path}`](#{_anchor(key.path)})."
    cells = [f"`{key.path}`", type_text(key.annotation), key.default, doc]
    return "| " + " | ".join(c.replace("|", "\\|").replace("\n", " ") for c in cells) + " |"


def _keys(cls: type, prefix: str) -> Iterator[Key]:
    hints = typing.get_type_hints(cls, include_extras=True)
    docs = _attribute_docs(cls)
    for name, default, described in _fields(cls):
        path = f"{prefix}.{name}" if prefix else name
        doc = " ".join(part for part in (described, docs.get(name, "")) if part)
        yield Key(path, hints[name], default, doc, _section_class(hints[name]))


def _fields(cls: type) -> Iterator[tuple[str, str, str]]:
    """(name, default as text, description given in the field itself) of a dataclass or a pydantic model."""
    if dataclasses.is_dataclass(cls):
        for f in dataclasses.fields(cls):
            if f.default is not dataclasses.MISSING:
                default = _value_text(f.default)
            elif f.default_factory is not dataclasses.MISSING:
                default = _value_text(f.default_factory())
            else:
                default = "required"
            yield f.name, default, ""
    else:
        for name, info in cls.model_fields.items():
            default = "required" if info.is_required() else _value_text(info.get_default(call_default_factory=True))
            yield name, default, info.description or ""


def _attribute_docs(cls: type) -> dict[str, str]:
    """The string literal under each annotated field of the class body (the schema's attribute docstrings)."""
    try:
        body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body
    except (OSError, TypeError):  # no source to read: the types and defaults still document the field
        return {}
    docs = {}
    for field, after in itertools.pairwise(body):
        if (isinstance(field, ast.AnnAssign) and isinstance(field.target, ast.Name) and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str)):
            docs[field.target.id] = _linked(_one_line(after.value.value))
    return docs


def _linked(text: str) -> str:
    """`docs/NAME.md` mentions as links that work from docs/reference/."""
    return re.sub(r"\bdocs/([\w/.-]+\.md)\b", lambda m: f"[docs/{m.group(1)}](../{m.group(1)})", text)


def _class_doc(cls: type) -> str:
    doc = cls.__doc__ or ""
    if doc.startswith(cls.__name__ + "("):  # the signature dataclasses put where a docstring is missing
        return ""
    return "\n\n".join(_linked(_one_line(p)) for p in inspect.cleandoc(doc).split("\n\n"))


def _one_line(text: str) -> str:
    return " ".join(inspect.cleandoc(text).split())


def _is_section(tp: Any) -> bool:
    return isinstance(tp, type) and (dataclasses.is_dataclass(tp) or issubclass(tp, pydantic.BaseModel))


def _section_class(annotation: Any) -> type | None:
    """The section class a field holds, alone or in a union with None."""
    base = _strip(annotation)
    members = typing.get_args(base) if _is_union(base) else (base,)
    sections = [m for m in map(_strip, members) if _is_section(m)]
    return sections[0] if sections else None


def _strip(tp: Any) -> Any:
    return typing.get_args(tp)[0] if typing.get_origin(tp) is Annotated else tp


def _is_union(tp: Any) -> bool:
    return typing.get_origin(tp) in (Union, types.UnionType)


def type_text(annotation: Any) -> str:
    """A type as a YAML reader sees it: `integer in [1, 2^31 - 1]`, `one of a, b`, `list of string`, `... or null`."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is Annotated:
        return _with_bounds(type_text(args[0]), _constraints(args[1:]))
    if _is_union(annotation):
        # Literal members are listed as their values: "list of integer, `balanced` or null".
        parts = [_literal_values(a) if typing.get_origin(a) is Literal else type_text(a) for a in args
                 if a is not type(None)]
        parts += ["null"] if type(None) in args else []
        return ", ".join(parts[:-1]) + " or " + parts[-1] if len(parts) > 1 else parts[0]
    if origin is Literal:
        return "one of " + _literal_values(annotation)
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            item = type_text(args[0])
            return f"list of ({item})" if " " in item else f"list of {item}"
        return "[" + ", ".join(type_text(a) for a in args) + "]"
    if origin is dict:
        return f"mapping of {type_text(args[0])} to {type_text(args[1])}"
    if _is_section(annotation):
        return "section"
    names = {bool: "boolean", int: "integer", float: "float", str: "string", type(None): "null"}
    return names.get(annotation, getattr(annotation, "__name__", str(annotation)))


def _literal_values(literal: Any) -> str:
    return ", ".join(f"`{_value_text(v).strip('`')}`" for v in typing.get_args(literal))


def _constraints(metadata: tuple) -> dict[str, Any]:
    """Bounds from Field(...) and annotated-types markers: ge, gt, le, lt, min_length, allow_inf_nan."""
    found: dict[str, Any] = {}
    for item in metadata:
        for marker in getattr(item, "metadata", [item]):
            for name in ("ge", "gt", "le", "lt", "min_length", "max_length", "allow_inf_nan"):
                if getattr(marker, name, None) is not None:
                    found[name] = getattr(marker, name)
    return found


def _with_bounds(text: str, bounds: dict[str, Any]) -> str:
    if bounds.get("allow_inf_nan") is False:
        text = f"finite {text}"
    if bounds.get("min_length") == 1 and text == "string":
        text = "non-empty string"
    low = f"[{_number(bounds['ge'])}" if "ge" in bounds else f"({_number(bounds['gt'])}" if "gt" in bounds else None
    high = f"{_number(bounds['le'])}]" if "le" in bounds else f"{_number(bounds['lt'])})" if "lt" in bounds else None
    if low and high:
        return f"{text} in {low}, {high}"
    if low:
        return f"{text} {'>=' if low[0] == '[' else '>'} {low[1:]}"
    if high:
        return f"{text} {'<=' if high[-1] == ']' else '<'} {high[:-1]}"
    return text


def _number(value: Any) -> str:
    if isinstance(value, int) and value > 2**16 and (value + 1).bit_count() == 1:
        return f"2^{(value + 1).bit_length() - 1} - 1"
    return str(value)


def _value_text(value: Any) -> str:
    """A default as YAML would write it, in backticks; a section's default is its own keys' defaults."""
    if _is_section(type(value)):
        return "its keys' defaults"
    if value is None:
        return "`null`"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, tuple | list):
        return "`[" + ", ".join(_value_text(v).strip("`") for v in value) + "]`"
    if isinstance(value, dict):
        return "`{" + ", ".join(f"{k}: {_value_text(v).strip('`')}" for k, v in value.items()) + "}`"
    return f"`{value}`"


def _anchor(path: str) -> str:
    # GitHub's heading anchors: lower case, punctuation (the dots, the backticks) dropped.
    return "".join(c for c in path.lower() if c.isalnum() or c in "-_")
