"""precision.master=float32: a float32 master copy of bfloat16 parameters in the optimizer state: what it keeps that
bfloat16 alone loses, its sharded steps against one device, resume, and the ZeRO paper's model-state bytes."""

import jax
import numpy as np
import pytest

from spmd_train import Engine, load_config
from spmd_train.analysis.plan.candidate import Candidate, Workload
from spmd_train.analysis.plan.memory import state_bytes, zero_paper_bytes
from spmd_train.analysis.plan.shape import ModelShape
from spmd_train.errors import ConfigError
from spmd_train.train.master_weights import MasterState
from tests.runs import ROOT, relative_error, run_steps

BF16 = ["model.param_dtype=bfloat16", "model.compute_dtype=float32"]
MASTER = ["precision.master=float32", *BF16]


def _leaves(tree):
    return [np.asarray(jax.device_get(x)).astype(np.float32) for x in jax.tree.leaves(tree)]


def test_a_float32_master_keeps_the_updates_bfloat16_parameters_round_away(devices):
    # Updates of about 1e-6 against weights of about 0.02, where a bfloat16 step is about 1e-4: rounded away but for
    # weights near zero.
    tiny = ["optim.lr=1e-6", "optim.schedule=constant", "optim.warmup_steps=0", "optim.weight_decay=0", "mesh.fsdp=1"]
    flat = lambda tree: np.concatenate([x.ravel() for x in _leaves(tree)])
    _, start, _, _ = run_steps([*tiny, "optim.lr=0", *BF16], devices[:1], steps=1)
    _, plain, _, _ = run_steps([*tiny, *BF16], devices[:1], steps=3)
    *_, state = run_steps([*tiny, *MASTER], devices[:1], steps=3)
    assert isinstance(state.opt_state, MasterState)
    initial = flat(start)
    assert np.mean(flat(plain) != initial) < 0.05  # measured 2.3%
    assert np.mean(flat(state.opt_state.master) != initial) > 0.99  # measured 99.9%: every update kept
    moved = np.abs(flat(state.opt_state.master) - initial).max()
    assert 1e-6 < moved < 1e-5, moved  # three steps of about 1e-6
    # The stored parameters are the master's bfloat16 rounding, exactly.
    for p, m in zip(jax.tree.leaves(state.params), jax.tree.leaves(state.opt_state.master), strict=True):
        assert p.dtype == np.dtype("bfloat16") and m.dtype == np.float32
        np.testing.assert_array_equal(np.asarray(p), np.asarray(m.astype(p.dtype)))


@pytest.mark.slow
def test_the_master_copy_over_fsdp_and_tensor_equals_one_device_and_is_split_like_the_moments(devices):
    losses, _, _, one = run_steps([*MASTER, "mesh.fsdp=1"], devices[:1])
    got, *_, state = run_steps([*MASTER, "mesh.fsdp=4", "mesh.tensor=2"], devices)
    assert np.abs(got - losses).max() <= 1e-5 * np.abs(losses).max()
    # The forward pass reads the bfloat16 rounding of the master, where one side's rounding can land a step (4e-3
    # relative) from the other's: the masters differ by 6e-5 after three steps, where the updates they hold are of
    # order 1 relative to... a slip (a missed update, a wrong shard) would show at the update's size, 1e-1 and up.
    assert relative_error(_leaves(state.opt_state.master), _leaves(one.opt_state.master)) <= 3e-4
    mu = state.opt_state.inner[1][0].mu  # clipping's state, then AdamW's (scale_by_adam first)
    for m, moment in zip(jax.tree.leaves(state.opt_state.master), jax.tree.leaves(mu), strict=True):
        assert m.sharding.is_equivalent_to(moment.sharding, m.ndim) and moment.dtype == np.float32


def test_a_master_copy_of_float32_parameters_is_refused_naming_both_keys():
    # (A run may add or drop the master copy when it resumes: tests/test_precision_policy.py.)
    with pytest.raises(ConfigError, match=r"model.param_dtype \(precision.params\)=float32 stores them in float32"):
        load_config(None, ["precision.master=float32"])


# The ZeRO paper's model-state memory (Rajbhandari et al. 2020, Figure 1 and §5): 7.5B parameters over 64 devices with
# mixed-precision Adam (2 + 2 + 12 bytes per parameter): 31.4 GB at stage 1, 16.6 GB at 2, 1.9 GB at 3.
PAPER_GB = {1: 31.4, 2: 16.6, 3: 1.9}
# A GPT-2-like 7.5B: 36 layers of d_model 4096; a gated MLP of 2/3 the width holds what a 4x one would.
SEVEN_AND_A_HALF_B = ["model.d_model=4096", "model.num_layers=36", "model.num_heads=32", "model.num_kv_heads=32",
                      "model.d_ff=10880", "model.vocab_size=51200", "model.tie_embeddings=true", *MASTER,
                      "mesh.fsdp=64", "mesh.tensor=1", "train.global_batch_size=64"]


@pytest.mark.parametrize("stage", sorted(PAPER_GB))
def test_the_planner_counts_the_zero_papers_model_states_with_a_master_copy(stage):
    cfg = load_config(ROOT / "configs" / "llama3-8b_v5p-512.yaml",
                      [*SEVEN_AND_A_HALF_B, f"parallel.zero_stage={stage}"])
    shape = ModelShape.from_config(cfg.model)
    assert shape.total_params == pytest.approx(7.5e9, rel=0.02)
    total = sum(state_bytes(shape, Candidate(fsdp=64, zero_stage=stage), Workload.from_config(cfg, "tpu")))
    assert total == pytest.approx(zero_paper_bytes(shape.total_params, 64, stage), rel=0.01)
    assert total / 1e9 == pytest.approx(PAPER_GB[stage], rel=0.05)


@pytest.mark.tpu_aot
def test_the_engine_stores_the_zero_papers_model_states_on_a_64_chip_slice():
    from spmd_train.analysis.topology import tpu_topology_devices

    devices = tpu_topology_devices("v5p:4x4x4")
    for stage, paper in PAPER_GB.items():
        cfg = load_config(ROOT / "configs" / "llama3-8b_v5p-512.yaml", [*SEVEN_AND_A_HALF_B,
                                                                         f"parallel.zero_stage={stage}"])
        engine = Engine.build(cfg, devices)  # shardings only: nothing compiles
        # Parameters, gradients and optimizer state from their shapes and shardings (describe's memory rows).
        assert engine.state_bytes_per_device / 1e9 == pytest.approx(paper, rel=0.05), stage
