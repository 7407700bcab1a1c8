"""Golden layouts: every shipped config still lays out its parameters, collectives and memory as recorded.

A rule that silently loses (or gains) a mesh axis changes a PartitionSpec, the bytes per device and
the collectives; this test names the parameter and the config. The records live in tests/golden/ and
are built by tests/golden_layouts.py; after an intended change regenerate them with `make golden`
(or `python -m tests.golden_layouts --write --config NAME`) and review the JSON diff.
"""

import copy
import subprocess
import sys

import jax
import pytest

# tests/ has no __init__.py: pytest puts it on sys.path, however pytest is started.
from golden_layouts import (
    CASES,
    COMPARED,
    ROOT,
    VERSION_DEPENDENT,
    compare,
    failure_message,
    golden_path,
    load_golden,
    major_minor,
    record,
    shipped_configs,
)

FAST = ("tiny", "moe", "pipeline")


def _param(name):
    # The fast tier reads one golden record per kind of layout; `make test-all` compares them all.
    marks = [pytest.mark.slow] if CASES[name].slow or name not in FAST else []
    if CASES[name].topology is not None:
        marks.append(pytest.mark.tpu_aot)
    return pytest.param(name, marks=marks, id=name)


def test_every_shipped_config_has_a_golden_case():
    covered = sorted({case.config for case in CASES.values()})
    assert covered == shipped_configs(), "add a Case to tests/golden_layouts.py, then run `make golden`"


@pytest.mark.parametrize("name", [_param(n) for n in sorted(CASES)])
def test_layout_matches_golden(name, devices):
    path = golden_path(name)
    assert path.exists(), f"no tests/golden/{path.name}: run `python -m tests.golden_layouts --write --config {name}`"
    if CASES[name].topology is None and CASES[name].cpu_devices != len(devices):
        # Another device count than this process has: the module's own check, in a process of its own.
        done = subprocess.run([sys.executable, "-m", "tests.golden_layouts", "--config", name], cwd=ROOT,
                              capture_output=True, text=True, check=False)
        if done.returncode:
            pytest.fail(done.stdout + done.stderr[-3000:], pytrace=False)
        assert f"{name}: matches" in done.stdout
        return
    golden = load_golden(name)
    current = record(name, devices)
    same_compiler = major_minor(golden["jax_version"]) == major_minor(jax.__version__)
    sections = COMPARED if same_compiler else tuple(s for s in COMPARED if s not in VERSION_DEPENDENT)
    lines = compare(golden, current, sections)
    if lines:
        pytest.fail(failure_message(name, lines, golden, current), pytrace=False)
    if not same_compiler:
        pytest.skip(f"parameter layouts match; collectives and memory not compared: {path.name} was recorded "
                    f"with jax {golden['jax_version']}, this is jax {jax.__version__}")


def test_a_lost_mesh_axis_is_named_in_the_message():
    # The comparison itself, on a recorded file (no compile): drop `fsdp` from the embedding's spec.
    golden = load_golden("mesh_presets-fsdp_tp")
    current = copy.deepcopy(golden)
    assert golden["params"]["embedding"]["spec"] == ["tensor", "fsdp"]
    before = golden["params"]["embedding"]["bytes_per_device"]
    current["params"]["embedding"]["spec"] = ["tensor", None]
    current["params"]["embedding"]["bytes_per_device"] = before * 4
    current["collectives"].popitem()
    current["params"] = dict(reversed(current["params"].items()))  # key order never matters
    lines = compare(golden, current)
    assert lines[0] == (f"param embedding: spec [tensor, fsdp] -> [tensor, null] (lost fsdp); "
                        f"bytes_per_device {before} -> {before * 4} (+300.0%)")
    assert lines[1].startswith("collective ") and "gone" in lines[1]
    assert len(lines) == 2
    message = failure_message("mesh_presets-fsdp_tp", lines * 30, golden, current)
    assert "... and 20 more differences" in message and "make golden CONFIG=mesh_presets-fsdp_tp" in message
    assert compare(golden, copy.deepcopy(golden)) == []


def test_temp_memory_within_a_tenth_of_a_percent_is_not_a_difference():
    # The buffer assigner moves tens of KB when the same step is written in another order (the 128k
    # preset: 4,286,448,544 -> 4,286,514,016 temp bytes); a lost axis or an extra activation moves far more.
    golden = load_golden("tiny")
    current = copy.deepcopy(golden)
    temp = golden["memory"]["temp_bytes"]
    current["memory"]["temp_bytes"] = temp + temp // 2000
    current["memory"]["total_bytes"] += temp // 2000
    assert compare(golden, current) == []
    current["memory"]["temp_bytes"] = temp + temp // 500
    assert [line.split(":")[0] for line in compare(golden, current)] == ["memory temp_bytes"]
    current = copy.deepcopy(golden)
    current["memory"]["argument_bytes"] += 1  # the layout's own bytes stay exact
    assert [line.split(":")[0] for line in compare(golden, current)] == ["memory argument_bytes"]
