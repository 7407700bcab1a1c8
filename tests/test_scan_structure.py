"""The layer stack compiles to one loop, so the program does not grow with depth."""

import re

import jax
import pytest

from spmd_train import Engine, load_config


def _compiled_text(devices, layers):
    cfg = load_config(None, ["model.preset=tiny", "mesh.fsdp=4", "mesh.tensor=2", f"model.num_layers={layers}",
                             "train.global_batch_size=8", "train.seq_len=16"])
    engine = Engine.build(cfg, devices)
    state = engine.abstract_state()
    tokens = jax.ShapeDtypeStruct((8, 17), "int32", sharding=engine.batch_sharding)
    return engine.train_step.lower(state, tokens).compile().as_text()


@pytest.mark.slow
def test_program_size_is_independent_of_depth(devices):
    shallow, deep = _compiled_text(devices, 2), _compiled_text(devices, 12)
    count = lambda text: len(re.findall(r"^\s+\S+ = ", text, re.M))
    # 6x the layers, the same program (a few fusion decisions may differ).
    assert abs(count(deep) - count(shallow)) <= 0.02 * count(shallow), (count(deep), count(shallow))
    # One loop over the 12 layers forward and one backward.
    assert len(re.findall(r'known_trip_count":\{"n":"12"\}', deep)) == 2
    assert len(re.findall(r'known_trip_count":\{"n":"2"\}', shallow)) == 2
