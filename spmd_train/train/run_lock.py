"""One writer per run directory: an advisory lock on `run.dir/.lock`, naming its holder.

The lock is `fcntl.flock` on the file, so the operating system releases it when the holder
exits, however it exits (SIGKILL included): a lock file left behind is never stale, it is
simply not locked. The file holds the holder's host, pid and start time for the message a
second writer gets. Several `Trainer`s of one process share the lock (a notebook re-creating
its trainer is the same writer). In a multi-host run only process 0 takes it: the other
processes write nothing there.

On a network filesystem `flock` is only as reliable as the filesystem's lock support (NFSv4
and Lustre with `flock` enabled honour it across hosts; a filesystem without it lets both
writers through, as before).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import time
from pathlib import Path

from spmd_train.errors import ConfigError

_HELD: dict[Path, list] = {}
"""Run directories this process holds: path -> [open lock file, users]."""


def acquire(run_dir: Path) -> Path:
    """Take run_dir's lock for this process (again, if it already holds it); ConfigError naming the holder if taken."""
    path = (Path(run_dir) / ".lock").absolute()
    if path in _HELD:
        _HELD[path][1] += 1
        return path
    handle = open(path, "a+")  # never truncates what a holder wrote before we know we hold it
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        handle.seek(0)
        holder = _describe(handle.read())
        handle.close()
        raise ConfigError(f"run.dir={run_dir} is in use by another training process ({holder}): one run.dir takes "
                          "one writer; wait for it to finish, stop it, or give this run another run.dir") from None
    handle.seek(0)
    handle.truncate()
    handle.write(json.dumps({"host": socket.gethostname(), "pid": os.getpid(),
                             "started": time.strftime("%Y-%m-%d %H:%M:%S %Z")}))
    handle.flush()
    _HELD[path] = [handle, 1]
    return path


def release(path: Path) -> None:
    """Give back one use of a lock `acquire` returned; the last use unlocks it."""
    entry = _HELD.get(path)
    if entry is None:
        return
    entry[1] -= 1
    if entry[1] == 0:
        del _HELD[path]
        with contextlib.suppress(OSError):
            fcntl.flock(entry[0], fcntl.LOCK_UN)
        entry[0].close()


def _describe(text: str) -> str:
    try:
        info = json.loads(text)
        return f"host {info['host']}, pid {info['pid']}, since {info['started']}"
    except (ValueError, KeyError, TypeError):
        return "its holder did not record itself yet"
