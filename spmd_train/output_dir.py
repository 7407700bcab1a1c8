"""Directories the user names for output (`run.dir`, `prepare-data --out`): created, or refused in one paragraph."""

from __future__ import annotations

import os
from pathlib import Path

from spmd_train.errors import ConfigError


def make_output_dir(path: Path, named: str) -> bool:
    """Create `path` (True if this call did); ConfigError starting with `named` (e.g. 'run.dir=runs/x') when it
    is a file, cannot be created, or cannot be written."""
    valid = "(valid: a new or existing directory this user can write)"
    if path.exists() and not path.is_dir():
        raise ConfigError(f"{named} is a file, not a directory {valid}")
    created = not path.exists()
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ConfigError(f"{named} cannot be created ({err.strerror or err}) {valid}") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise ConfigError(f"{named} is not writable by this user {valid}")
    return created
