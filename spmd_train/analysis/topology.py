"""Devices of a TPU slice we do not have, for compiling against it from a CPU host (libtpu)."""

from __future__ import annotations

import os
import re
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import jax
from jax.experimental.compilation_cache import compilation_cache

from spmd_train.errors import ConfigError

EXAMPLES = ("v5e:2x2, v5e:2x4, v5e:4x4, v5p:2x2x2, v5p:4x4x4, v5p:8x8x8, v6e:4x4, v6e:16x16, v4:2x2x2, "
            "2xv5p:8x8x8 (two slices over DCN)")


def has_libtpu() -> bool:
    """Whether libtpu (the `tpu-aot` extra) can be imported here."""
    try:
        import libtpu  # noqa: F401
    except ImportError:
        return False
    return True


def _slices(name: str) -> tuple[int, str]:
    """'2xv5p:8x8x8' -> (2, 'v5p:8x8x8'): slices over DCN, and the slice; one slice without the prefix."""
    match = re.fullmatch(r"(\d+)x([a-z].*)", name)
    return (int(match.group(1)), match.group(2)) if match and int(match.group(1)) >= 1 else (1, name)


def tpu_topology_devices(name: str) -> list[jax.Device]:
    """The devices of TPU slice `name` (e.g. 'v5e:2x4'), or of N slices over DCN ('2xv5p:8x8x8'): enough to build a
    Mesh and compile."""
    # No TPU is used, only its compiler: several processes (parallel tests, two describes) may load it.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    # Off a TPU VM libtpu cannot look its workers up and logs an error for it; compiling needs no workers.
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
    if not has_libtpu():
        raise ConfigError(
            f"--topology {name} needs libtpu to compile for TPU on this host, and it is not installed: "
            "install the extra with `pip install -e '.[tpu-aot]'` (or `pip install 'jax[tpu]'`)"
        )
    from jax.experimental import topologies

    slices, one = _slices(name)
    try:
        return list(topologies.get_topology_desc(platform="tpu", topology_name=one, num_slices=slices).devices)
    except Exception as err:  # libtpu reports bad names as a runtime error with its own text
        reason = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise ConfigError(
            f"--topology {name!r} is not a TPU slice libtpu knows ({reason}); valid names look like "
            f"GENERATION:SHAPE, e.g. {EXAMPLES}"
        ) from None


_CACHE_LOCK = threading.Lock()
_CACHE_STATE: dict[str, Any] = {"holders": 0, "enabled": None}
"""Threads inside `without_persistent_cache`, and the cache setting the first one found."""


@contextmanager
def without_persistent_cache() -> Iterator[None]:
    """Compile inside without JAX's persistent compilation cache, and leave it as it was."""
    # A compile-only TPU client writes cache entries it cannot read back: with JAX_COMPILATION_CACHE_DIR
    # set, every later compile of the same program warned "PjRtCompiler must be constructed with a Client
    # to call DeserializeLoadedExecutable" and compiled anyway. jax decides once per process whether the
    # cache is used, so the decision is reset on the way in and out. Several threads may compile at once
    # (the planner's compile stage): the first one in turns the cache off, the last one out restores it.
    with _CACHE_LOCK:
        if _CACHE_STATE["holders"] == 0:
            _CACHE_STATE["enabled"] = jax.config.jax_enable_compilation_cache
            compilation_cache.reset_cache()
            jax.config.update("jax_enable_compilation_cache", False)
        _CACHE_STATE["holders"] += 1
    try:
        yield
    finally:
        with _CACHE_LOCK:
            _CACHE_STATE["holders"] -= 1
            if _CACHE_STATE["holders"] == 0:
                jax.config.update("jax_enable_compilation_cache", _CACHE_STATE["enabled"])
                compilation_cache.reset_cache()
