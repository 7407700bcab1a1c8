"""Ctrl-C while a run starts: KeyboardInterrupt at once, as Python does, and remembered.

Native code (the compiler, runtime callbacks) can swallow the KeyboardInterrupt a SIGINT raises while it runs: the
CLI's run then went on to train all its steps. The CLI installs `on_sigint`; `Trainer.run` calls `raise_if_interrupted`
once the step has compiled, before the training loop puts its own stop-at-the-next-step handler in place.
"""

from __future__ import annotations

import signal
import threading

_interrupted = threading.Event()


def on_sigint(signum: int, frame: object) -> None:
    """SIGINT handler: remember the interrupt, then raise KeyboardInterrupt like Python's default handler."""
    _interrupted.set()
    raise KeyboardInterrupt


def install() -> None:
    """Use `on_sigint` for SIGINT in this process (main thread only, as `signal` requires)."""
    if threading.current_thread() is threading.main_thread():
        _interrupted.clear()
        signal.signal(signal.SIGINT, on_sigint)


def raise_if_interrupted() -> None:
    """KeyboardInterrupt if a SIGINT reached `on_sigint` and its exception was lost on the way."""
    if _interrupted.is_set():
        raise KeyboardInterrupt
