"""Where the `spmd_train` logger's lines go when nobody said: stderr, at INFO (the CLI and scripts alike)."""

from __future__ import annotations

import logging
import sys


def log_to_stderr(over_root: bool = False) -> logging.Logger:
    """Give the `spmd_train` logger a stderr handler at INFO, unless it already has one or (without `over_root`,
    the CLI's choice) the application decided: it set this logger's level, or its logging shows INFO already.

    The root logger's handlers say nothing here: absl (imported through Orbax) calls `logging.basicConfig()` when
    it first logs, which leaves every script with a root handler at WARNING that would hide each step's line."""
    logger = logging.getLogger("spmd_train")
    decided = logger.level != logging.NOTSET or logger.getEffectiveLevel() <= logging.INFO
    if logger.handlers or (decided and not over_root):
        return logger
    handler = _CurrentStderr()
    handler.setFormatter(logging.Formatter("%(asctime)s %(message)s", datefmt="%H:%M:%S"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    return logger


class _CurrentStderr(logging.StreamHandler):
    """A handler that writes to whatever `sys.stderr` is when a line is logged (a notebook's or a test's capture
    replaces it after the handler exists)."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, _value) -> None:
        pass
