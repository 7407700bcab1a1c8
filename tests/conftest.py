"""Test setup: 8 simulated CPU devices, configured before jax initialises its backend."""

import atexit
import os
import shutil
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")

if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    # One persistent compilation cache for the session, inherited by the xdist workers and the CLI subprocesses
    # they start: the many tests that compile the same program (the tiny config's step above all, in-process
    # and through the CLI) load it instead of compiling it again. Keyed by the program, flags and devices.
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="spmd_train-tests-jax-cache-")
    atexit.register(shutil.rmtree, os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)
# Every program into that cache, not only those compiling for over a second (jax's default): at -O0 most of the
# suite's programs compile in less, and the same ones (one-device references, init and data programs, the CLI's
# steps) recur across tests and processes. Measured on 4 equivalence-heavy files with 2 workers: 2:04 instead of
# 2:30, user CPU 3:42 instead of 4:32.
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")

# After the cache directory (jax reads it when imported, as tests.runs does) and before the first backend (which
# reads XLA_FLAGS).
from tests.runs import TEST_XLA_FLAGS

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count=8 "
                           f"{TEST_XLA_FLAGS}").strip()

import logging

import jax
import pytest

# The suite has decided where the library's log lines go: to pytest's capture and `caplog` (through the root
# logger), not to a handler of the library's own (`spmd_train.console_log.log_to_stderr`).
logging.getLogger("spmd_train").setLevel(logging.INFO)

jax.config.update("jax_num_cpu_devices", 8)


@pytest.fixture(scope="session")
def devices():
    """The 8 simulated CPU devices."""
    found = jax.devices()
    assert len(found) == 8, f"expected 8 simulated devices, got {len(found)}"
    return found


@pytest.fixture(scope="session")
def corpus(tmp_path_factory):
    """A token file of 400 packed byte documents of 2 to 23 tokens (the path, as a string)."""
    import numpy as np

    from tests.runs import write_corpus

    lengths = np.random.default_rng(1).integers(2, 24, 400)
    return str(write_corpus(tmp_path_factory.mktemp("docs"), lengths)[0])


HEAVY = ("tpu_aot", "multiprocess", "faults", "slow")
"""Markers of the long tests, which run first (the rest keep their order after them)."""


def pytest_collection_modifyitems(config, items):
    """`tpu_aot` tests compile with libtpu: skipped, with the reason, where the tpu-aot extra is not installed.

    The long tests move to the front: xdist hands tests out in this order, so a minute-long TPU compile collected
    last (test_zero_floor.py sorts last) would run while the other worker has nothing left to take."""
    from spmd_train.analysis.topology import has_libtpu

    if not has_libtpu():
        skip = pytest.mark.skip(reason="compiles for a TPU slice: needs libtpu (pip install -e '.[tpu-aot]')")
        for item in items:
            if "tpu_aot" in item.keywords:
                item.add_marker(skip)
    items.sort(key=lambda item: next((i for i, m in enumerate(HEAVY) if m in item.keywords), len(HEAVY)))


FAST_TIER_BUDGET_S = 600
"""`make test` (the fast tier) must finish in 10 minutes on 2 cores: the budget it prints itself against."""


_SESSION_START = []


def pytest_sessionstart(session):
    import time

    _SESSION_START.append(time.monotonic())


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """Print the run's wall time against the fast tier's budget, so a test that pushes the tier over is seen."""
    import time

    tier = os.environ.get("SPMD_TRAIN_TIER")
    if not tier or not _SESSION_START:
        return
    elapsed = time.monotonic() - _SESSION_START[0]
    budget = FAST_TIER_BUDGET_S if tier == "fast" else None
    verdict = "" if budget is None else (f" (budget {budget} s: OVER, make the slowest tests above cheaper or mark "
                                         "them slow)" if elapsed > budget else f" (budget {budget} s)")
    terminalreporter.write_line(f"{tier} tier: {elapsed:.0f} s of wall time{verdict}")
