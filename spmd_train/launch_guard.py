"""Ctrl-C while the `spmd-train` command is still importing jax: one line and exit 130, not a 30-line traceback.

The package's imports (jax, flax, orbax) take seconds, and run before `cli.main` can catch anything. The guard is
put in place first thing, only when this process is the command itself (its console script, or `python -m
spmd_train` while Python locates the module); a notebook or a script importing the library keeps Python's own
Ctrl-C. The command replaces it with its own handler (`train.interrupts`) once it starts.
"""

from __future__ import annotations

import os
import signal
import sys

MESSAGE = "spmd-train: interrupted (Ctrl-C) while starting; nothing was run\n"


def guard_cli_imports() -> None:
    """Exit 130 with one line on Ctrl-C from here until the command installs its handler (the command only)."""
    command = os.path.basename(sys.argv[0]) == "spmd-train" or sys.argv[:1] == ["-m"]
    if command and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, _exit_interrupted)


def _exit_interrupted(signum: int, frame: object) -> None:
    sys.stderr.write(MESSAGE)
    sys.stderr.flush()
    os._exit(130)  # no interpreter teardown halfway through an import
