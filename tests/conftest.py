"""Test setup: 8 simulated CPU devices, configured before jax initialises its backend."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

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
