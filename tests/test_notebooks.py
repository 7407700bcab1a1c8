"""Every notebook runs top to bottom without error and shows what it is there to show."""

import json
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))
# What each notebook must print; a new notebook needs an entry here.
EXPECTED = {
    # The bar of trainer.run (an ipywidgets view in Jupyter), then describe()'s tables as HTML.
    "quickstart": ("loss", "MiB sent per step", "tok/s", "Collectives per step", "Memory per device"),
    "pipeline_schedules": ("bubble fraction", "peak in flight", "3/19"),
    # The search's count, the memory/time frontier, and the top layout's time split into its parts.
    "plan_meshes": ("candidates over", "frontier:", "ranked exactly", "'compute':"),
}


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_executes(path, monkeypatch):
    # A fresh kernel process: it must configure its own simulated devices like a user would.
    for var in ("XLA_FLAGS", "JAX_PLATFORMS"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("MPLBACKEND", "Agg")
    notebook = nbformat.read(path, as_version=4)
    resources = {"metadata": {"path": str(path.parent)}}
    NotebookClient(notebook, timeout=600, kernel_name="python3", resources=resources).execute()
    outputs = "".join(o.get("text", "") + _rich_outputs(o) for cell in notebook.cells for o in cell.get("outputs", []))
    outputs += json.dumps(notebook.metadata.get("widgets", {}))  # what ipywidgets views showed (the progress bar)
    for needle in EXPECTED[path.stem]:
        assert needle in outputs, (path.stem, needle)


def _rich_outputs(output: dict) -> str:
    """The HTML and plain-text views of a display output (rich's tables, widgets' captured text)."""
    data = output.get("data", {})
    return "".join(str(data.get(kind, "")) for kind in ("text/html", "text/plain")) + "".join(
        _rich_outputs(o) for o in output.get("outputs", []))
