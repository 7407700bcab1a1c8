"""config.json and its history: what each start or resume of a run directory was configured with."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from spmd_train.train.metrics import write_atomically


def record_config(run_dir: Path, record: dict[str, Any], step: int) -> dict[str, list[Any]]:
    """Write config.json; when it replaces a different one, append the changes to config_changes.jsonl.

    Returns the changes, {"section.key": [before, now]}, so the caller can say them. A resume with
    other overrides (a longer `train.steps`, another mesh) thus leaves a trace instead of silently
    rewriting the record of what the earlier steps ran with.
    """
    path = run_dir / "config.json"
    changes: dict[str, list[Any]] = {}
    if path.exists():
        try:
            before = json.loads(path.read_text())
        except json.JSONDecodeError:  # cut short by a kill: nothing to compare with
            before = {}
        changes = {key: [b, a] for key, (b, a) in _differences(_flat(before), _flat(record)).items()}
        if changes:
            line = {"step": step, "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "changes": changes}
            with open(run_dir / "config_changes.jsonl", "a") as f:
                f.write(json.dumps(line) + "\n")
    write_atomically(path, json.dumps(record, indent=2))
    return changes


def _flat(tree: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(tree, dict):
        return {prefix: tree}
    out: dict[str, Any] = {}
    for key, value in tree.items():
        out.update(_flat(value, f"{prefix}.{key}" if prefix else str(key)))
    return out


def _differences(before: dict[str, Any], after: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    # JSON round trip so tuples and lists compare alike.
    norm = lambda v: json.loads(json.dumps(v))
    return {k: (before.get(k), after.get(k)) for k in sorted(set(before) | set(after))
            if norm(before.get(k)) != norm(after.get(k))}
