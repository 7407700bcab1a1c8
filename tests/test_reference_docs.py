"""The generated reference pages (docs/reference/) are what the code makes now, and config.md names every key."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from pydantic import TypeAdapter

from spmd_train.cli import reference_docs
from spmd_train.cli.reference_docs import PAGES, generated_pages
from spmd_train.config import Config
from tests.runs import ROOT


@pytest.mark.parametrize("path", list(PAGES))
def test_checked_in_reference_page_is_what_the_code_generates(path):
    checked_in = (ROOT / path).read_text() if (ROOT / path).exists() else ""
    assert checked_in == generated_pages()[path], f"{path} is stale: run `make docs` and commit the result"


def _schema_leaves(schema: dict, defs: dict, prefix: str = "") -> list[str]:
    """Dotted keys holding values, walked through pydantic's JSON schema of Config (not the generator's own walk)."""
    found = []
    for name, prop in schema["properties"].items():
        path = f"{prefix}.{name}" if prefix else name
        refs = [p["$ref"] for p in [prop, *prop.get("anyOf", [])] if "$ref" in p]
        section = defs[refs[0].rsplit("/", 1)[-1]] if refs else None
        found += _schema_leaves(section, defs, path) if section and "properties" in section else [path]
    return found


def test_config_page_names_every_leaf_key_of_the_schema():
    schema = TypeAdapter(Config).json_schema()
    leaves = _schema_leaves(schema, schema["$defs"])
    assert len(leaves) > 100 and "model.moe.router_z_weight" in leaves and "mesh.dcn.tensor" in leaves
    page = (ROOT / "docs/reference/config.md").read_text()
    missing = [key for key in leaves if f"| `{key}` |" not in page]
    assert not missing, f"docs/reference/config.md lacks {missing}: run `make docs`"


def test_check_exits_1_naming_the_stale_page(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(reference_docs, "ROOT", tmp_path)
    assert reference_docs.main(["--write"]) == 0
    assert reference_docs.main(["--check"]) == 0
    (tmp_path / "docs/reference/cli.md").write_text("old\n")
    assert reference_docs.main(["--check"]) == 1
    assert "docs/reference/cli.md is stale: run `make docs`" in capsys.readouterr().err


def test_generation_does_not_depend_on_the_terminal():
    # argparse wraps help to the terminal's width; the pages must not change with it.
    code = "import json; from spmd_train.cli.reference_docs import generated_pages as g; print(json.dumps(g()))"
    runs = [subprocess.run([sys.executable, "-c", code], env={**os.environ, "COLUMNS": columns}, cwd=ROOT,
                           capture_output=True, text=True, check=True).stdout for columns in ("40", "200")]
    assert runs[0] == runs[1]
