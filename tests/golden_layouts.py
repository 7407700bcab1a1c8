"""Golden layout records: what each shipped run config puts on each device, checked in under tests/golden/.

For every `configs/*.yaml` one JSON file `tests/golden/<stem>.json` holds (for `configs/mesh_presets.yaml`,
one per mesh preset it is shipped to try: `tests/golden/mesh_presets-<preset>.json`), from `describe` (one compiled
train step):
- per parameter: its logical axes, its PartitionSpec (one entry per dimension: null, a mesh axis, or a
  list of mesh axes) and its bytes per device;
- the mesh (axes of size > 1);
- the step's collectives, keyed "<op> over <axes> (group <n>)": executions per step and bytes each
  device sends (rounded to whole bytes: the bandwidth-optimal formulas give fractions of a byte for
  small tensors, e.g. 2 (N-1)/N x 4 bytes);
- per-device memory of the compiled step: argument, output, temp, alias and total
  (argument + output + temp - alias). Temp and total are compared to within `MEMORY_SLACK` (0.1%): the
  buffer assigner moves tens of KB when the same computation is written in another order, while a lost
  mesh axis or a new copy of an activation moves far more.
Also recorded, never compared: the jax (and libtpu) version and the config overrides used.

`tests/test_golden_layouts.py` recomputes the record and compares. Regenerate after an intended change:

    make golden                                    # all configs
    python -m tests.golden_layouts --write --config tiny --config moe
    python -m tests.golden_layouts                 # check only: print the differences, exit 1 on any
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
GOLDEN_DIR = ROOT / "tests" / "golden"
CONFIG_DIR = ROOT / "configs"
MAX_LINES = 40
"""Difference lines shown in a failure message; the rest are counted."""


@dataclass(frozen=True)
class Case:
    """How one shipped config is compiled for its golden record."""

    config: str
    """The stem of the run config in configs/."""

    overrides: tuple[str, ...] = ()
    """Applied on top of the config file. Only ones that keep the layout: the batch and length only
    change activation bytes, and the scanned layer stack gives every layer the same layout."""
    topology: str | None = None
    """A TPU slice to compile for with libtpu; None: the config's own simulated CPU devices."""
    slow: bool = False
    cpu_devices: int = 8
    """Simulated CPU devices to compile on (topology None): a plan for a GPU cluster compiles its own mesh
    shape on that many, in a process of its own (`python -m tests.golden_layouts --config NAME`)."""


MESH_PRESETS = ("ddp", "fsdp", "fsdp_tp", "hsdp", "tp_sp")
"""The mesh presets configs/mesh_presets.yaml is shipped to try (pipeline has its own config)."""

CASES: dict[str, Case] = {
    **{f"mesh_presets-{p}": Case("mesh_presets", overrides=(f"mesh.preset={p}",)) for p in MESH_PRESETS},
    "pipeline": Case("pipeline"),
    "moe": Case("moe"),
    "tiny": Case("tiny"),
    "hf_finetune": Case("hf_finetune"),
    # 512 chips, fsdp 64 x tensor 8. Two layers instead of 32 (the scan keeps one layer's layout and
    # the same collectives per layer), the smallest batch the 64-way batch split allows and a short
    # sequence: the same collectives (op, axes, count) as two layers at the shipped 512 x 8192 (only
    # activation bytes shrink); ~15 s to compile instead of ~80 s for that (one layer is no faster).
    "llama3-8b_v5p-512": Case(
        "llama3-8b_v5p-512",
        overrides=("model.num_layers=2", "train.global_batch_size=64", "train.seq_len=16"),
        topology="v5p:8x8x8",
        slow=True,
    ),
    # 64 chips, fsdp 8 x sequence 8, ring attention. Two layers and 256 tokens (16 per zigzag chunk)
    # instead of 32 x 131072: the same layout and ring collectives per layer, ~20 s to compile
    # instead of ~4 min (the full size is measured by benchmarks/context.py).
    "llama3-8b_128k_v5p": Case(
        "llama3-8b_128k_v5p",
        overrides=("model.num_layers=2", "train.seq_len=256"),
        topology="v5p:4x4x4",
        slow=True,
    ),
    # 64 H100s, fsdp 8 (across nodes) x sequence 8 (Ulysses inside a node). No GPU compiler here: the
    # layout and the collectives per axis are held on 64 simulated CPU devices, with XLA attention in
    # place of cuDNN (the local kernel; the all-to-alls around it are the same). XLA:CPU lowers the
    # gradients' reduce-scatters as all-reduces (docs/describe.md): bytes on GPU are lower than recorded.
    "llama3-8b_128k_h100": Case(
        "llama3-8b_128k_h100",
        overrides=("model.num_layers=2", "train.seq_len=256", "backends.attention=xla"),
        slow=True,
        cpu_devices=64,
    ),
}

MEMORY_KEYS = {"argument_bytes": "argument_bytes", "output_bytes": "output_bytes", "temp_bytes": "temp_bytes",
               "alias_bytes": "alias_bytes", "total_bytes": "peak_bytes"}
"""Golden key -> `StepReport.per_device` key (`peak_bytes` there is argument + output + temp - alias)."""
COMPARED = ("mesh", "params", "collectives", "memory")
VERSION_DEPENDENT = ("collectives", "memory")
"""Sections that depend on the compiler: compared only under the jax major.minor they were recorded with."""


def golden_path(name: str) -> Path:
    return GOLDEN_DIR / f"{name}.json"


def shipped_configs() -> list[str]:
    """Stems of the run configs in configs/."""
    return sorted(p.stem for p in CONFIG_DIR.glob("*.yaml"))


def record(name: str, devices: list | None = None) -> dict[str, Any]:
    """Compile config `name` as its Case says and return its golden record.

    `devices`: the simulated CPU devices for CPU configs (default: jax.devices()); ignored for TPU slices.
    """
    import jax

    from spmd_train import load_config
    from spmd_train.analysis.step_report import describe

    case = CASES[name]
    cfg = load_config(CONFIG_DIR / f"{case.config}.yaml", list(case.overrides))
    if case.topology is not None:
        report = describe(cfg, topology=case.topology)
    else:
        devices = list(devices if devices is not None else jax.devices())
        want = cfg.run.simulate_devices or case.cpu_devices
        if len(devices) != want or devices[0].platform != "cpu":
            raise RuntimeError(f"the golden case {name} compiles on {want} simulated CPU devices, "
                               f"got {len(devices)} {devices[0].platform} devices")
        report = describe(cfg, devices=devices)
    out = report.to_json()
    rec: dict[str, Any] = {
        "config": f"configs/{case.config}.yaml",
        "overrides": list(case.overrides),
        "topology": case.topology,
        "jax_version": jax.__version__,
        "mesh": {axis: size for axis, size in out["mesh"].items() if size > 1},
        "params": {
            p["path"]: {"logical": list(p["logical"]), "spec": [_spec_entry(e) for e in p["spec"]],
                        "bytes_per_device": int(p["bytes_per_device"])}
            for p in out["params"]
        },
        "collectives": {},
        "memory": {key: _int_or_none(out["per_device"][src]) for key, src in MEMORY_KEYS.items()},
    }
    if case.topology is not None:
        rec["libtpu_version"] = _libtpu_version()
    for c in out["collectives"]:
        key = f"{c['op']} over {','.join(c['axes'])} (group {c['group_size']})"
        if key in rec["collectives"]:  # summarize() keys on (op, axes, group size): cannot happen
            raise AssertionError(f"two collective rows for {key}")
        rec["collectives"][key] = {"count": int(c["count"]), "bytes_per_device": round(c["bytes"])}
    return rec


def _spec_entry(entry: Any) -> Any:
    """One PartitionSpec entry as null, "axis" or ["axis", ...] (('fsdp',) and 'fsdp' are the same split)."""
    if entry is None:
        return None
    if isinstance(entry, str):
        return entry
    entry = list(entry)
    if not entry:
        return None
    return entry[0] if len(entry) == 1 else entry


def _int_or_none(x: Any) -> int | None:
    return None if x is None else int(x)


def _libtpu_version() -> str | None:
    try:
        from importlib.metadata import version

        return version("libtpu")
    except Exception:
        return None


def major_minor(version: str) -> str:
    return ".".join(version.split(".")[:2])


# ---------------------------------------------------------------------------------------------------------
# Comparison


def compare(golden: dict[str, Any], current: dict[str, Any], sections: tuple[str, ...] = COMPARED) -> list[str]:
    """Readable differences between two records in `sections` (empty: identical). Key order never matters."""
    lines: list[str] = []
    if "mesh" in sections and golden.get("mesh") != current.get("mesh"):
        lines.append(f"mesh: {_fmt_mesh(golden.get('mesh', {}))} -> {_fmt_mesh(current.get('mesh', {}))}")
    if "params" in sections:
        lines += _compare_params(golden.get("params", {}), current.get("params", {}))
    if "collectives" in sections:
        lines += _compare_keyed("collective", golden.get("collectives", {}), current.get("collectives", {}))
    if "memory" in sections:
        old, new = golden.get("memory", {}), current.get("memory", {})
        for key in sorted(set(old) | set(new)):
            if old.get(key) != new.get(key) and not _within_slack(key, old.get(key), new.get(key)):
                lines.append(f"memory {key}: {_fmt(old.get(key, 'absent'))} -> {_fmt(new.get(key, 'absent'))}"
                             + _delta(old.get(key), new.get(key)))
    return lines


MEMORY_SLACK = 0.001
"""Relative change of temp/total bytes that is not a difference (argument, output and alias stay exact)."""


def _within_slack(key: str, old: Any, new: Any) -> bool:
    if key not in ("temp_bytes", "total_bytes") or not isinstance(old, int) or not isinstance(new, int):
        return False
    return abs(new - old) <= MEMORY_SLACK * max(old, 1)


def _compare_params(old: dict, new: dict) -> list[str]:
    lines = []
    for path in sorted(set(old) | set(new)):
        if path not in new:
            lines.append(f"param {path}: gone (golden: spec {_fmt_spec(old[path]['spec'])})")
            continue
        if path not in old:
            lines.append(f"param {path}: new, spec {_fmt_spec(new[path]['spec'])}, "
                         f"{new[path]['bytes_per_device']} bytes/device")
            continue
        a, b = old[path], new[path]
        changes = []
        for field in sorted(set(a) | set(b), key=lambda f: (f != "spec", f)):  # the spec first
            if a.get(field) == b.get(field):
                continue
            if field in ("spec", "logical"):
                changes.append(f"{field} {_fmt_spec(a.get(field))} -> {_fmt_spec(b.get(field))}"
                               + (_axes_change(a.get(field), b.get(field)) if field == "spec" else ""))
            else:
                changes.append(f"{field} {_fmt(a.get(field))} -> {_fmt(b.get(field))}"
                               + _delta(a.get(field), b.get(field)))
        if changes:
            lines.append(f"param {path}: " + "; ".join(changes))
    return lines


def _compare_keyed(what: str, old: dict, new: dict) -> list[str]:
    lines = []
    for key in sorted(set(old) | set(new)):
        if key not in new:
            lines.append(f"{what} {key}: gone (golden: {_fmt_fields(old[key])})")
        elif key not in old:
            lines.append(f"{what} {key}: new ({_fmt_fields(new[key])})")
        elif old[key] != new[key]:
            changes = [f"{f} {_fmt(old[key].get(f))} -> {_fmt(new[key].get(f))}"
                       for f in sorted(set(old[key]) | set(new[key])) if old[key].get(f) != new[key].get(f)]
            lines.append(f"{what} {key}: " + ", ".join(changes))
    return lines


def _axes(spec: list | None) -> set[str]:
    axes: set[str] = set()
    for e in spec or []:
        axes.update([e] if isinstance(e, str) else (e or []))
    return axes


def _axes_change(old: list | None, new: list | None) -> str:
    lost, gained = sorted(_axes(old) - _axes(new)), sorted(_axes(new) - _axes(old))
    parts = ([f"lost {', '.join(lost)}"] if lost else []) + ([f"gained {', '.join(gained)}"] if gained else [])
    return f" ({', '.join(parts)})" if parts else " (same axes, other dims)"


def _fmt_spec(spec: list | None) -> str:
    if spec is None:
        return "absent"
    return "[" + ", ".join("null" if e is None else e if isinstance(e, str) else "(" + ", ".join(e) + ")"
                           for e in spec) + "]"


def _fmt_mesh(mesh: dict) -> str:
    return " x ".join(f"{k}={v}" for k, v in mesh.items()) or "(one device)"


def _fmt_fields(d: dict) -> str:
    return ", ".join(f"{k} {_fmt(v)}" for k, v in sorted(d.items()))


def _fmt(x: Any) -> str:
    return "null" if x is None else str(x)


def _delta(a: Any, b: Any) -> str:
    if isinstance(a, int) and isinstance(b, int) and a:
        return f" ({(b - a) / a:+.1%})"
    return ""


def failure_message(name: str, lines: list[str], golden: dict, current: dict) -> str:
    """The whole message for a mismatch: what differs (at most MAX_LINES lines) and how to regenerate."""
    shown = lines[:MAX_LINES]
    if len(lines) > MAX_LINES:
        shown.append(f"... and {len(lines) - MAX_LINES} more differences")
    case = CASES[name]
    head = (f"configs/{case.config}.yaml{''.join(' ' + o for o in case.overrides)} no longer matches "
            f"tests/golden/{name}.json ({len(lines)} differences, golden -> now):")
    notes = []
    if golden.get("overrides") != current.get("overrides") or golden.get("topology") != current.get("topology"):
        notes.append(f"note: the golden was recorded with overrides {golden.get('overrides')} on "
                     f"{golden.get('topology') or 'CPU'}, this run used {current.get('overrides')} on "
                     f"{current.get('topology') or 'CPU'}")
    tail = (f"If the change is intended, regenerate: make golden CONFIG={name}  "
            f"(python -m tests.golden_layouts --write --config {name}) and review the JSON diff.")
    return "\n".join([head, *("  " + s for s in shown), *notes, tail])


# ---------------------------------------------------------------------------------------------------------
# Files


def dumps(rec: dict[str, Any]) -> str:
    """Pretty JSON with sorted keys; lists of scalars (specs, logical axes) stay on one line."""
    return _dump(rec, 0) + "\n"


def _dump(x: Any, depth: int) -> str:
    pad, inner = "  " * depth, "  " * (depth + 1)
    if isinstance(x, dict):
        if not x:
            return "{}"
        items = [f"{inner}{json.dumps(str(k))}: {_dump(x[k], depth + 1)}" for k in sorted(x)]
        return "{\n" + ",\n".join(items) + "\n" + pad + "}"
    if isinstance(x, list) and any(isinstance(e, dict) for e in x):
        return "[\n" + ",\n".join(inner + _dump(e, depth + 1) for e in x) + "\n" + pad + "]"
    return json.dumps(x)  # scalars and lists of scalars / lists of lists of scalars, on one line


def load_golden(name: str) -> dict[str, Any]:
    return json.loads(golden_path(name).read_text())


def write_golden(name: str, rec: dict[str, Any]) -> Path:
    path = golden_path(name)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(dumps(rec))
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.golden_layouts", description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", action="store_true", help="rewrite the golden files (default: only compare)")
    parser.add_argument("--config", action="append", metavar="NAME", choices=sorted(CASES),
                        help="only this case (a stem of configs/*.yaml, or mesh_presets-PRESET); repeatable")
    args = parser.parse_args(argv)

    missing = sorted(set(shipped_configs()) - {c.config for c in CASES.values()})
    if missing:
        print(f"configs without a Case in tests/golden_layouts.py: {', '.join(missing)}", file=sys.stderr)
        return 1
    names = args.config or sorted(CASES)
    # jax has one device count per process: cases on another count run in a process of their own.
    count = Counter(CASES[n].cpu_devices for n in names).most_common(1)[0][0]
    others = [n for n in names if CASES[n].cpu_devices != count]
    failed = 0
    for name in others:
        command = [sys.executable, "-m", "tests.golden_layouts", *(["--write"] if args.write else []), "--config", name]
        failed += subprocess.run(command, cwd=ROOT, check=False).returncode != 0

    # As in tests/conftest.py: simulated CPU devices and the suite's compiler flags (buffer assignment, so the
    # recorded memory, depends on them), set before jax initialises its backend.
    from tests.runs import TEST_XLA_FLAGS

    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + f" --xla_force_host_platform_device_count={count} {TEST_XLA_FLAGS}").strip()
    import jax

    jax.config.update("jax_num_cpu_devices", count)

    for name in (n for n in names if n not in others):
        start = time.perf_counter()
        rec = record(name)
        seconds = time.perf_counter() - start
        if args.write:
            path = write_golden(name, rec)
            print(f"wrote {path.relative_to(ROOT)} ({len(rec['params'])} params, "
                  f"{len(rec['collectives'])} collective rows; {seconds:.1f} s)")
            continue
        if not golden_path(name).exists():
            print(f"{name}: no golden file {golden_path(name).relative_to(ROOT)}")
            failed += 1
            continue
        golden = load_golden(name)
        lines = compare(golden, rec)
        if lines:
            failed += 1
            print(failure_message(name, lines, golden, rec))
        else:
            print(f"{name}: matches ({seconds:.1f} s)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
