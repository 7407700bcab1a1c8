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

# After the cache directory (jax reads it when imported, as tests.runs does) and before the first backend (which
# reads XLA_FLAGS).
from tests.runs import TEST_XLA_FLAGS

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count=8 "
                           f"{TEST_XLA_FLAGS}").strip()

import jax
import pytest

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
