"""Every notebook runs top to bottom without error."""

from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))
# What each notebook must print; a new notebook needs an entry here.
EXPECTED = {
    "quickstart": ("loss", "MiB sent per step"),
    "pipeline_schedules": ("bubble fraction", "peak in flight", "3/19"),
}


@pytest.mark.heavy
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_executes(path, monkeypatch):
    # A fresh kernel process: it must configure its own simulated devices like a user would.
    for var in ("XLA_FLAGS", "JAX_PLATFORMS"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("MPLBACKEND", "Agg")
    notebook = nbformat.read(path, as_version=4)
    resources = {"metadata": {"path": str(path.parent)}}
    NotebookClient(notebook, timeout=600, kernel_name="python3", resources=resources).execute()
    outputs = "".join(o.get("text", "") for cell in notebook.cells for o in cell.get("outputs", []))
    for needle in EXPECTED[path.stem]:
        assert needle in outputs, (path.stem, needle)
