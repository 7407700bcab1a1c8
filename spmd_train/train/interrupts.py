"""Ctrl-C while a run starts: KeyboardInterrupt at once, as Python does, and remembered.

Native code (the compiler, runtime callbacks) can swallow the KeyboardInterrupt a SIGINT raises while it runs: the
CLI's run then went on to train all its steps. The CLI installs `on_sigint`; `Trainer.run` calls `raise_if_interrupted`
once the step has compiled, before the training loop puts its own stop-at-the-next-step handler in place.
A SIGINT that lands in a callback Python cannot unwind (jax's garbage-collection callback, a finalizer) is
"unraisable": Python printed it as "Exception ignored in ..." with a traceback and went on (seen in 1 CI run of
test_ctrl_c_while_compiling_exits_130_with_one_line); `install` also puts a `sys.unraisablehook` in place that
drops such a KeyboardInterrupt silently, since `raise_if_interrupted` raises it where it can stop the run, and hands
everything else to the hook that was there before (the CLI's, which quiets Orbax's teardown noise).
"""

from __future__ import annotations

import signal
import sys
import threading

_interrupted = threading.Event()
_previous_hook = sys.__unraisablehook__


def on_sigint(signum: int, frame: object) -> None:
    """SIGINT handler: remember the interrupt, then raise KeyboardInterrupt like Python's default handler."""
    _interrupted.set()
    raise KeyboardInterrupt


def on_unraisable(args) -> None:
    """sys.unraisablehook: a remembered Ctrl-C is dropped without a traceback; anything else goes to the hook before."""
    if issubclass(args.exc_type, KeyboardInterrupt) and _interrupted.is_set():
        return
    _previous_hook(args)


def install() -> None:
    """Use `on_sigint` for SIGINT in this process (main thread only, as `signal` requires), and `on_unraisable`."""
    global _previous_hook
    if threading.current_thread() is threading.main_thread():
        _interrupted.clear()
        signal.signal(signal.SIGINT, on_sigint)
        if sys.unraisablehook is not on_unraisable:  # installed twice (main() called again): keep the first chain
            _previous_hook = sys.unraisablehook
        sys.unraisablehook = on_unraisable


def raise_if_interrupted() -> None:
    """KeyboardInterrupt if a SIGINT reached `on_sigint` and its exception was lost on the way."""
    if _interrupted.is_set():
        raise KeyboardInterrupt
