"""precision.reduce: the dtype the layers' weight gradients are summed in across devices, in the compiled program
(a TPU compile's reduce-scatters), in the gradients a sharded step computes, in the planner's bytes, and its
refusals."""

import re

import jax
import numpy as np
import pytest

from spmd_train import Engine, load_config, use_layout
from spmd_train.data import make_source
from spmd_train.errors import ConfigError
from spmd_train.ops.matmul_mode import use_matmul
from tests.runs import ROOT, relative_error, tpu_step_hlo


def _reduce_scatters(overrides: list[str]) -> list[tuple[str, int]]:
    """(element type, elements) of each reduce-scatter of a small model's ZeRO-3 step compiled for a v5e:2x4 slice."""
    hlo = tpu_step_hlo(["mesh.fsdp=8", "parallel.zero_stage=3", "model.d_model=512", "model.d_ff=1024",
                        "model.num_heads=8", "model.num_kv_heads=8", "train.global_batch_size=8", "train.seq_len=128",
                        "model.compute_dtype=bfloat16", *overrides], "v5e:2x4")
    found = re.findall(r"= (\w+)\[([\d,]*)\][^ ]* reduce-scatter(?:-start)?\(", hlo)
    return [(dtype, int(np.prod([int(d) for d in dims.split(",") if d]))) for dtype, dims in found]


@pytest.mark.tpu_aot
def test_a_tpu_compile_sums_the_layers_gradients_in_float32_under_precision_reduce_float32():
    default, exact = _reduce_scatters([]), _reduce_scatters(["precision.reduce=float32"])
    elements = lambda found, dtype=None: sum(n for d, n in found if dtype in (None, d))
    # bfloat16 compute sums every gradient in bfloat16; with precision.reduce=float32 the same gradients (as many
    # elements) are summed in float32, but for the input table's, whose gradient comes from the lookup, not a matmul:
    # its 256 / 8 rows x 512 stay bfloat16.
    assert {d for d, _ in default} == {"bf16"} and elements(exact) == elements(default), (default, exact)
    assert elements(exact, "bf16") == 256 // 8 * 512 and elements(exact, "f32") == elements(default) - 256 // 8 * 512


def _grads(overrides: list[str], devices, reduce: str | None):
    cfg = load_config(None, overrides)
    engine = Engine.build(cfg, list(devices))
    state, data = engine.init_state(), make_source(cfg)

    def grads(params, batch):
        with use_layout(engine.layout), use_matmul("default", reduce):
            return jax.grad(engine.loss)(params, batch)

    return jax.device_get(engine.model_params(jax.jit(grads)(state.params, data.batch(0, engine.batch_sharding))))


def test_the_gradients_a_sharded_step_sums_carry_the_reduce_dtypes_rounding(devices):
    # float32 compute: one device and data 8 agree to float32 summation order; summed in bfloat16 instead, the data-8
    # gradients carry bfloat16's rounding (2^-9 relative; measured 2.4e-3), whatever the mesh splits.
    one = _grads(["mesh.fsdp=1"], devices[:1], None)
    assert relative_error(_grads(["mesh.data=8"], devices, None), one) < 1e-5
    for mesh in (["mesh.data=8"], ["mesh.fsdp=4", "mesh.tensor=2"]):
        assert 5e-4 < relative_error(_grads(mesh, devices, "bfloat16"), one) < 1e-2, mesh


def test_precision_reduce_takes_float32_or_bfloat16_and_not_beside_quantized_matmuls():
    assert load_config(None, ["precision.reduce=float32"]).precision.reduce == "float32"
    with pytest.raises(ConfigError, match=r"precision.reduce.*float32.*bfloat16"):
        load_config(None, ["precision.reduce=int8"])
    with pytest.raises(ConfigError, match=r"precision.reduce=float32 .*precision.matmul=fp8 .*valid: "
                                          r"precision.reduce=null, or precision.matmul=default"):
        load_config(None, ["precision.reduce=float32", "precision.matmul=fp8"])


def test_the_planner_counts_the_summed_gradients_in_the_reduce_dtype():
    from spmd_train.analysis.plan.candidate import Candidate
    from spmd_train.analysis.plan.comm import zero_terms
    from spmd_train.analysis.plan.shape import ModelShape

    cfg = load_config(ROOT / "configs" / "llama3-8b_v5p-512.yaml", ["model.compute_dtype=bfloat16"])
    shape, layout = ModelShape.from_config(cfg.model), Candidate(fsdp=64, zero_stage=3)
    summed = lambda reduce_bytes: sum(t.bytes for t in zero_terms(shape, layout, reduce_bytes=reduce_bytes)
                                      if t.purpose == "grad-scatter")
    # Llama-3-8B: every matrix but the untied input table (0.53B of 8.03B parameters) is summed in float32, twice
    # bfloat16's bytes; the input table's lookup gradient stays bfloat16.
    table = next(g.numel for g in shape.params if g.lookup_only)
    matrices = sum(g.numel for g in shape.params if len(g.shape) > 1 and not g.lookup_only)
    want = (matrices * 4 + table * 2) / ((matrices + table) * 2)
    assert summed(4) / summed(0) == pytest.approx(want, rel=2e-3) and summed(2) == summed(0)
