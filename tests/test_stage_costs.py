"""Pipeline stage costs: per-layer FLOPs that add up to the model's, and the most even split of the layers."""

from __future__ import annotations

import itertools

import pytest

from spmd_train import load_config
from spmd_train.analysis.stage_costs import stage_shares
from spmd_train.models.flops import (
    balanced_depths,
    chunk_flops_per_token,
    flops_per_token,
    head_flops_per_token,
    layer_flops_per_token,
)
from spmd_train.parallel.schedules import stage_of
from spmd_train.train.pipelined import layer_order

MODELS = {
    "llama3-8b": (None, ["model.preset=llama3-8b"]),
    "gpt2-small": (None, ["model.preset=gpt2-small"]),
    "moe-every-2": ("configs/moe.yaml", ["model.num_layers=8"]),
    "moe-every-1-shared": ("configs/moe.yaml", ["model.moe.every=1", "model.moe.num_shared_experts=1"]),
}


def _model(name):
    config, overrides = MODELS[name]
    return load_config(config, overrides).model


@pytest.mark.parametrize("name", list(MODELS))
def test_layers_and_head_add_up_to_the_models_flops(name):
    m = _model(name)
    for seq in (1, 2048):
        assert layer_flops_per_token(m, seq).sum() + head_flops_per_token(m) == pytest.approx(
            flops_per_token(m, seq), rel=1e-12)


def _brute_force(m, seq, chunks):
    """The least max chunk cost over every contiguous split into non-empty chunks of whole MoE groups."""
    unit = max(m.moe_every, 1)
    n = m.num_layers // unit
    best = float("inf")
    for cuts in itertools.combinations(range(1, n), chunks - 1):
        depths = [(b - a) * unit for a, b in itertools.pairwise((0, *cuts, n))]
        best = min(best, max(chunk_flops_per_token(m, seq, depths)))
    return best


@pytest.mark.parametrize("name,chunks", [("gpt2-small", 4), ("gpt2-small", 3), ("moe-every-2", 2),
                                         ("moe-every-2", 4), ("moe-every-1-shared", 2)])
def test_the_balanced_split_is_the_least_slowest_chunk_of_any_split(name, chunks):
    m = _model(name)
    depths = balanced_depths(m, 1024, chunks)
    assert len(depths) == chunks and sum(depths) == m.num_layers and min(depths) >= 1
    assert all(d % max(m.moe_every, 1) == 0 for d in depths)  # whole MoE groups
    assert max(chunk_flops_per_token(m, 1024, depths)) == pytest.approx(_brute_force(m, 1024, chunks), rel=1e-12)


def test_the_head_moves_layers_off_the_last_stage_and_an_even_split_stays_when_nothing_beats_it():
    llama = _model("llama3-8b")  # its 128k-vocabulary head costs about 2.3 layers at 2048 tokens
    depths = balanced_depths(llama, 2048, 4)
    assert depths[-1] < 8 and max(chunk_flops_per_token(llama, 2048, depths)) < max(
        chunk_flops_per_token(llama, 2048, [8] * 4))
    # Identical MoE groups without a head worth a group: only the even split has the least slowest chunk.
    assert balanced_depths(_model("moe-every-2"), 64, 4) == [2, 2, 2, 2]


@pytest.mark.parametrize("placement,stages,virtual", [("loop", 4, 1), ("loop", 3, 2), ("v", 3, 2)])
def test_chunks_land_on_the_stages_the_storage_order_puts_them(placement, stages, virtual):
    m = _model("gpt2-small")  # 12 layers
    per_chunk = m.num_layers // (stages * virtual)
    order = layer_order(m.num_layers, stages, virtual, placement)
    for stored_row, layer in enumerate(order):  # stored row r lives on device r // (rows per device)
        assert stage_of(layer // per_chunk, stages, placement) == stored_row // (per_chunk * virtual)
    shares = stage_shares(m, 1024, [per_chunk] * (stages * virtual), stages, placement)
    assert sum(shares) == pytest.approx(1.0, rel=1e-12)
    head_stage = stage_of(stages * virtual - 1, stages, placement)
    assert shares[head_stage] == max(shares)


# --- the planner's stages: the same split and the same busiest stage as the engine and `describe` ----------------

PLANNED = {
    # (config, overrides, pipeline, virtual, schedule): equal chunks, uneven ones (balanced), MoE groups, dense first
    "equal": (None, ["model.preset=gpt2-small"], 4, 1, "1f1b"),
    "uneven": (None, ["model.preset=gpt2-small", "model.num_layers=10"], 4, 1, "1f1b"),
    "uneven-interleaved": (None, ["model.preset=gpt2-small", "model.num_layers=10"], 2, 2, "interleaved_1f1b"),
    "moe-groups": ("configs/moe.yaml", ["model.num_layers=10"], 2, 1, "1f1b"),
    "first-dense": ("configs/moe.yaml", ["model.moe.every=1", "model.moe.first_k_dense=3", "model.num_layers=12"], 4,
                    1, "gpipe"),
}


@pytest.mark.parametrize("name", list(PLANNED))
def test_the_planners_stages_are_the_engines_split_and_describes_busiest_stage(name):
    from spmd_train.analysis.plan.candidate import Candidate
    from spmd_train.analysis.plan.shape import ModelShape
    from spmd_train.analysis.plan.stages import chunk_layers, pipeline_layers, stage_imbalance, stored_rows_factor

    config, overrides, p, v, schedule = PLANNED[name]
    m, seq = load_config(config, overrides).model, 1024
    shape, c = ModelShape.from_config(m), Candidate(pipeline=p, virtual_stages=v, pipeline_schedule=schedule)
    assert shape.staged_flops_per_token(seq) == pytest.approx(list(layer_flops_per_token(m, seq)[m.first_dense:]),
                                                              rel=1e-12)
    equal = m.stack_rows % (p * v) == 0
    depths = list(chunk_layers(shape, c, seq))
    assert pipeline_layers(m.stack_rows, c) == (None if equal else "balanced")
    staged = m.num_layers - m.first_dense
    assert depths == ([staged // (p * v)] * (p * v) if equal else balanced_depths(m, seq, p * v))
    assert (len(set(depths)) > 1) != equal
    shares = stage_shares(m, seq, depths, p, "loop")  # what `describe` reports per stage
    assert stage_imbalance(shape, c, seq) == pytest.approx(max(shares) * p, rel=1e-9)
    assert stored_rows_factor(shape, c, seq) == pytest.approx(p * v * max(depths) / staged)
