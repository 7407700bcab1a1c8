"""Every command the README and docs/ show runs as written: each fenced bash block's commands and the Python API
block of docs/python-api.md, in a fresh directory, exit 0. Train commands get a few steps instead of their hundreds.

A command is run unless SKIPPED says why not (a usage line with placeholders, a benchmark that runs for
minutes, several hosts, or a test elsewhere that already runs that exact command); a skip that no longer
matches a documented command fails, so the list cannot go stale.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.runs import ROOT, cli_env, main_in_process

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FEW_STEPS = ["train.steps=2", "checkpoint.every=0"]
"""Appended to train commands (later overrides win): the example's point is that it starts and steps."""

SKIPPED = {
    "make train": "the main job; tests/test_cli.py::test_main_job_ends_within_ten_percent_of_the_floor runs it",
    "make test": "the test suite itself (.ci/run)",
    "make golden": "rewrites the golden layouts; tests/test_golden_layouts.py compares them",
    ".venv/bin/python -m tests.golden_layouts": "the comparison tests/test_golden_layouts.py makes",
    "spmd-train train CONFIG": "a usage line (placeholders)",
    "spmd-train describe configs/tiny.yaml [section.key=value ...]": "a usage line (placeholders)",
    ".venv/bin/python benchmarks/": "a benchmark (minutes); its output is docs/benchmarks.md",
    "bash benchmarks/gpu_session.sh": "needs a GPU",
    "srun ": "needs a SLURM cluster",
    "gcloud ": "needs a TPU VM",
    "spmd-train train configs/x.yaml": "needs several hosts (a placeholder config)",
    "for i in 0 1; do": "two processes; tests/test_multihost.py runs this setup (2 x 4 simulated devices)",
}
COVERED = {
    "spmd-train convert to-hf runs/qwen3": ("tests/test_hf_interop.py", ['"convert", "to-hf"']),
    # The pair of docs/plan.md: the plan reads the profile the line before writes (each command runs in a fresh dir).
    "spmd-train bench-collectives --simulate-devices 8": ("tests/test_bench_collectives.py",
                                                           ['"bench-collectives"', '"--simulate-devices", "8"']),
    "spmd-train plan models/gpt2-small.yaml --devices 8 --hardware cpu --profile":
        ("tests/test_bench_collectives.py", ['"--hardware", "cpu"', '"--profile"']),
    # command prefix -> (the test file that runs it through the API, the arguments that file must contain)
    "spmd-train describe configs/llama3-8b_v5p-512.yaml --topology v5p:8x8x8":
        ("tests/test_describe.py", ["llama3-8b_v5p-512", "v5p:8x8x8"]),
    # The tutorial trains the config its plan command writes (each command runs in a fresh dir).
    "spmd-train train runs/plan/tiny-best.yaml": ("tests/test_plan_search.py", ['"--write-config"', "Trainer(cfg"]),
}
FIGURES = {
    # command prefix -> figures the docs quote from its output: (doc, the figure in the doc, the figure printed)
    # docs/describe.md's worked example: each collective row's count and bytes.
    "spmd-train describe configs/tiny.yaml mesh.data=2 mesh.fsdp=2 mesh.tensor=2": [
        ("docs/describe.md", rf"\| {op} \| {axes} \| {count} \| {size} \|",
         rf"│ {op}\s*│ {axes}\s*│\s*\d+ │\s*{count} │\s*{size} │")
        for op, axes in (("all-gather", "fsdp"), ("reduce-scatter", "fsdp"), ("all-to-all", "fsdp"),
                         ("all-reduce", "tensor"), ("all-reduce", "data"))
        for count, size in ((r"(\d+)", r"[\d.]+ [KM]iB"), (r"\d+", r"([\d.]+ [KM]iB)"))
    ],
    "spmd-train describe configs/moe.yaml model.preset=mixtral-8x7b": [
        ("docs/moe.md", r"([\d.]+ GiB) peak per\s+chip", r"peak = arg \+ out \+ temp - alias\W*([\d.]+ GiB)"),
        ("docs/moe.md", r"(\d+) all-to-alls over `expert` per step", r"all-to-all over expert per step\W*(\d+) x"),
        ("docs/moe.md", r"all-to-alls over `expert` per step.*?moving ([\d.]+ GiB) per device",
         r"all-to-all over expert per step\W*\d+ x, ([\d.]+ GiB)"),
    ],
}
"""A documented figure is checked against the command that prints it whenever the examples run, so a change
that moves it fails here instead of leaving the docs quoting an old figure."""


def documented_commands() -> list[tuple[str, str]]:
    """(where, command) for every command of every fenced bash block, once: comments dropped, continuations and
    quoted newlines joined, a `for ...; do` loop kept whole."""
    found: dict[str, str] = {}
    for doc in DOCS:
        for block in re.findall(r"```(?:bash|sh|shell)\n(.*?)```", doc.read_text(), re.S):
            pending: list[str] = []
            for line in re.sub(r"\\\n\s*", " ", block).splitlines():
                if line.strip().startswith("#"):  # comments, #! and #SBATCH lines
                    continue
                pending.append(re.sub(r"\s+#\s.*$", "", line).strip())
                command = " ".join(pending)
                if not _complete(command):
                    continue
                pending = []
                if command:
                    found.setdefault(command, doc.relative_to(ROOT).as_posix())
    return [(where, command) for command, where in found.items()]


def _complete(command: str) -> bool:
    """Whether the shell would run this as it stands: quotes closed, a `for` loop at its `done`."""
    try:
        words = shlex.split(command)
    except ValueError:  # an open quote: the command goes on on the next line
        return False
    return not words or words[0] != "for" or "done" in command


def _why_skipped(command: str) -> str | None:
    return next((why for prefix, why in SKIPPED.items() if command.startswith(prefix)), None)


def _covered(command: str) -> tuple[str, list[str]] | None:
    return next((cover for prefix, cover in COVERED.items() if command.startswith(prefix)), None)


COMMANDS = documented_commands()
RUN = [(where, c) for where, c in COMMANDS if _why_skipped(c) is None and _covered(c) is None]


def test_every_documented_command_is_run_or_skipped_for_a_stated_reason():
    for prefix, why in SKIPPED.items():
        assert any(c.startswith(prefix) for _, c in COMMANDS), f"stale skip {prefix!r} ({why})"
    for prefix, (test_file, args) in COVERED.items():
        assert any(c.startswith(prefix) for _, c in COMMANDS), f"stale cover {prefix!r}"
        text = (ROOT / test_file).read_text()
        assert all(a in text for a in args), f"{test_file} no longer runs {prefix!r}"
    for prefix, figures in FIGURES.items():
        assert any(c.startswith(prefix) for _, c in RUN), f"figures of {prefix!r}: no command that is run"
        for doc, quoted, _ in figures:
            assert re.search(quoted, (ROOT / doc).read_text(), re.S), f"{doc} no longer quotes {quoted!r}"
    assert len(RUN) >= 15, RUN


def _in_fresh_dir(tmp_path: Path) -> Path:
    """A directory like a fresh clone's root for the example: configs/, models/ and the Hugging Face reference
    checkpoints (read-only use), nothing else."""
    (tmp_path / "configs").symlink_to(ROOT / "configs")
    (tmp_path / "models").symlink_to(ROOT / "models")
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "hf_reference").symlink_to(ROOT / "tests" / "hf_reference")
    return tmp_path


@pytest.mark.slow
@pytest.mark.parametrize(("where", "command"), RUN, ids=[command for _, command in RUN])
def test_documented_command_runs_as_written(where, command, tmp_path, capsys):
    argv = shlex.split(command)
    fresh = _in_fresh_dir(tmp_path)
    if argv[0] == "spmd-train":
        # Through the CLI's main() in this process: what `spmd-train` runs, less an interpreter start and a jax
        # import per command (tests/test_cli.py runs the CLI in fresh processes).
        args = [*argv[1:], *(FEW_STEPS if argv[1] == "train" else [])]
        code, stdout, stderr = main_in_process(*args, capsys=capsys, cwd=fresh)
    else:
        out = subprocess.run(argv, cwd=fresh, env=cli_env(), capture_output=True, text=True, timeout=600, check=False)
        code, stdout, stderr = out.returncode, out.stdout, out.stderr
    assert code == 0, f"{where}: {command}\n{stdout[-2000:]}\n{stderr[-4000:]}"
    assert "Traceback" not in stderr
    for doc, quoted, printed in next((f for prefix, f in FIGURES.items() if command.startswith(prefix)), []):
        said = re.search(quoted, (ROOT / doc).read_text(), re.S).group(1)
        now = re.search(printed, stdout, re.S)
        assert now, f"{command!r} no longer prints {printed!r}:\n{stdout}"
        assert said == now.group(1), f"{doc} quotes {said}, {command!r} now prints {now.group(1)}: update {doc}"


@pytest.mark.slow
def test_python_api_block_runs_as_a_script(tmp_path):
    block = re.search(r"```python\n(.*?)```", (ROOT / "docs" / "python-api.md").read_text(), re.S).group(1)
    assert "trainer.run(" in block and "trainer.save()" in block
    script = _in_fresh_dir(tmp_path) / "api.py"
    script.write_text(block)
    out = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=cli_env(), capture_output=True, text=True,
                         timeout=600, check=False)
    assert out.returncode == 0, out.stderr[-4000:]
    assert (tmp_path / "runs/api/checkpoints").is_dir()
