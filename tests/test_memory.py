"""Per-device bytes of parameters and optimizer state follow the ZeRO arithmetic; init is sharded."""

import jax
import pytest

from tests.runs import run_steps
from tests.tiers import fast_cases


def _bytes_on(device, tree) -> int:
    return sum(
        shard.data.nbytes for leaf in jax.tree.leaves(tree) for shard in leaf.addressable_shards
        if shard.device == device
    )


@pytest.mark.parametrize("stage", fast_cases([0, 1, 2, 3], fast=[3]))
def test_zero_stage_memory_per_device(devices, stage):
    _, params_np, _engine, state = run_steps(["mesh.fsdp=8", f"parallel.zero_stage={stage}"], devices, steps=1)
    full_params = sum(x.nbytes for x in jax.tree.leaves(params_np))
    full_opt = 2 * full_params  # AdamW: first and second moments, fp32
    param_ways = 8 if stage >= 3 else 1
    opt_ways = 8 if stage >= 1 else 1
    for device in devices:
        assert _bytes_on(device, state.params) == pytest.approx(full_params / param_ways, rel=0.01)
        assert _bytes_on(device, state.opt_state) == pytest.approx(full_opt / opt_ways, rel=0.01)


def test_initialisation_never_materialises_the_full_model(devices):
    _, params_np, engine, _ = run_steps(["mesh.fsdp=8", "parallel.zero_stage=3", "model.vocab_size=4096"], devices,
                                        steps=0)
    full_params = sum(x.nbytes for x in jax.tree.leaves(params_np))
    largest = max(x.nbytes for x in jax.tree.leaves(params_np))
    mem = engine.init_fn.lower().compile().memory_analysis()
    assert mem.output_size_in_bytes == pytest.approx(3 * full_params / 8, rel=0.01)  # params + 2 moments, / 8
    # No device ever holds one whole copy of the parameters, nor even the largest one whole.
    assert mem.temp_size_in_bytes < largest, (mem.temp_size_in_bytes, largest)
    assert mem.output_size_in_bytes + mem.temp_size_in_bytes < full_params
