"""The run directory itself, and config.json with its history (what each start or resume was configured with)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from spmd_train.errors import ConfigError
from spmd_train.train.metrics import write_atomically


def make_run_dir(run_dir: Path) -> bool:
    """Create run.dir (True if this call did); ConfigError when it is a file or cannot be written."""
    if run_dir.exists() and not run_dir.is_dir():
        raise ConfigError(f"run.dir={run_dir} is a file, not a directory (valid: a new or existing directory)")
    created = not run_dir.exists()
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ConfigError(f"run.dir={run_dir} cannot be created ({err.strerror or err}) (valid: a directory this "
                          "user can write)") from None
    if not os.access(run_dir, os.W_OK | os.X_OK):
        raise ConfigError(f"run.dir={run_dir} is not writable by this user (valid: a directory this user can write)")
    return created


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
