"""HLO text whose instructions span several lines: a custom call (MaxText's splash-attention Pallas kernel, a
`tpu_custom_call`) can carry an attribute printed over many lines, some starting with `}` at column 0. Such a
line continues the instruction; it does not close the computation, so nothing after it may be lost."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from spmd_train.analysis.hlo import matmul_flops, parse_collectives
from spmd_train.analysis.hlo_text import parse_computations

# A Pallas kernel as XLA:TPU prints it when its attributes hold newlines: an unquoted `kernel_metadata={...}`
# whose JSON closes on a line starting with `}}`, then a quoted `backend_config` with a line that is just `}`
# and an unbalanced `(` and `{` inside the string (a parser that ignores quotes never sees the end).
SPLASH = r'''  %splash_mqa_fwd.3 = (f32[8,32]{1,0}, f32[8,128]{1,0}) custom-call(%get-tuple-element.24, %get-tuple-element.28), custom_call_target="tpu_custom_call", operand_layout_constraints={f32[8,32]{1,0}, f32[32,32]{1,0}}, frontend_attributes={kernel_metadata={{
  "block_sizes": {"block_q": 512, "block_kv": 512},
  "mask": "causal } with \"escaped { quotes\" and a backslash \\"
}}
}, metadata={op_name="jit(body)/while/body/splash_mqa_fwd" stack_frame_id=12}, backend_config="{\"custom_call_config\": {\"body\": \"TUzvUgFN\", \"cost_estimate\": {\"flops\": 16384,
}
\"grid\": \"(8, 32 {\"}"
  %get-tuple-element.99 = f32[8,32]{1,0} get-tuple-element(%splash_mqa_fwd.3), index=0'''  # noqa: E501 - HLO lines as XLA prints them

HLO = """HloModule jit_body, is_scheduled=true, entry_computation_layout={(f32[8,32]{1,0}, f32[32,32]{1,0})->f32[8,32]{1,0}}, num_partitions=8

FileNames
1 "/tmp/model.py"

%region_1.0 (psum_invariant.1: f32[], psum_invariant.4: f32[]) -> f32[] {
  %psum_invariant.1 = f32[] parameter(0), metadata={op_name="while/body/closed_call/psum_invariant"}
  %psum_invariant.4 = f32[] parameter(1), metadata={op_name="while/body/closed_call/psum_invariant"}
  ROOT %add.2 = f32[] add(%psum_invariant.1, %psum_invariant.4), metadata={op_name="add" stack_frame_id=8}
}

%fused_computation (param_0: f32[8,32], param_1: f32[32,32]) -> f32[8,32] {
  %param_0 = f32[8,32]{1,0} parameter(0)
  %param_1 = f32[32,32]{1,0} parameter(1)
  ROOT %dot_general.4 = f32[8,32]{1,0} dot(%param_0, %param_1), lhs_contracting_dims={1}, rhs_contracting_dims={0}, metadata={op_name="jit(body)/shard_map/while/body/closed_call/dot_general" stack_frame_id=12}
}

%region_0.2_spmd (param: (s32[], f32[8,32], f32[32,32])) -> (s32[], f32[8,32], f32[32,32]) {
  %param = (s32[], f32[8,32]{1,0}, f32[32,32]{1,0}) parameter(0), metadata={op_name="jit(body)/shard_map" stack_frame_id=1}
  %constant.0.clone = s32[] constant(1), metadata={op_name="jit(body)/shard_map" stack_frame_id=1}
  %get-tuple-element.28 = f32[32,32]{1,0} get-tuple-element(%param), index=2, metadata={op_name="jit(body)/shard_map" stack_frame_id=1}
  %get-tuple-element.24 = f32[8,32]{1,0} get-tuple-element(%param), index=1
  %get-tuple-element.23 = s32[] get-tuple-element(%param), index=0
@SPLASH@
  %ynn_fusion = f32[8,32]{1,0} fusion(%get-tuple-element.24, %get-tuple-element.28), kind=kCustom, calls=%fused_computation, metadata={op_name="jit(body)/shard_map/while/body/closed_call/dot_general" stack_frame_id=12}, backend_config={"fusion_config":{"kind":"__ynn_fusion"},"outer_dimension_partitions":[]}
  %add.5 = s32[] add(%get-tuple-element.23, %constant.0.clone)
  %psum_invariant.7 = f32[8,32]{1,0} all-reduce(%ynn_fusion), channel_id=1, replica_groups={{0,1,2,3},{4,5,6,7}}, use_global_device_ids=true, to_apply=%region_1.0, metadata={op_name="jit(body)/shard_map/while/body/closed_call/psum_invariant" stack_frame_id=13}
  %all-gather.1 = f32[32,32]{1,0} all-gather(%ynn_fusion), channel_id=2, replica_groups=[2,4]<=[8], dimensions={0}, use_global_device_ids=true
  ROOT %tuple.9 = (s32[], f32[8,32]{1,0}, f32[32,32]{1,0}) tuple(%add.5, %psum_invariant.7, %get-tuple-element.28)
}

%region_2.3_spmd (param.1: (s32[], f32[8,32], f32[32,32])) -> pred[] {
  %param.1 = (s32[], f32[8,32]{1,0}, f32[32,32]{1,0}) parameter(0), metadata={op_name="jit(body)/shard_map" stack_frame_id=1}
  %constant.1.clone = s32[] constant(5), metadata={op_name="jit(body)/shard_map" stack_frame_id=1}
  %get-tuple-element.17 = s32[] get-tuple-element(%param.1), index=0, metadata={op_name="jit(body)/shard_map" stack_frame_id=1}
  ROOT %lt.3 = pred[] compare(%get-tuple-element.17, %constant.1.clone), direction=LT
}

ENTRY %main.5_spmd (param.4: f32[8,32], param.5: f32[32,32]) -> f32[8,32] {
  %param.4 = f32[8,32]{1,0} parameter(0), sharding={devices=[2,1,4]<=[8] last_tile_dim_replicate}, metadata={op_name="x"}
  %param.5 = f32[32,32]{1,0} parameter(1), sharding={replicated}, metadata={op_name="w"}
  %constant.3.clone.1 = s32[] constant(0), metadata={op_name="jit(body)/shard_map" stack_frame_id=1}
  %tuple.7 = (s32[], f32[8,32]{1,0}, f32[32,32]{1,0}) tuple(%constant.3.clone.1, %param.4, %param.5)
  %while.9 = (s32[], f32[8,32]{1,0}, f32[32,32]{1,0}) while(%tuple.7), condition=%region_2.3_spmd, body=%region_0.2_spmd@TRIP@
  ROOT %get-tuple-element.19 = f32[8,32]{1,0} get-tuple-element(%while.9), index=1
}
"""  # noqa: E501
KNOWN_TRIP = ', backend_config={"known_induction_variable":{"tuple_index":"0"},"known_trip_count":{"n":"5"}}'
DOT_FLOPS = 2 * 8 * 32 * 32  # f32[8,32] = f32[8,32] . f32[32,32], per loop iteration


def _hlo(splash: bool, trip: str = "") -> str:
    return HLO.replace("@SPLASH@\n", SPLASH + "\n" if splash else "").replace("@TRIP@", trip)


@pytest.mark.parametrize("trip", ["", KNOWN_TRIP], ids=["trip-from-condition", "known-trip-count"])
@pytest.mark.parametrize("splash", [True, False], ids=["multiline-custom-call", "plain"])
def test_a_multiline_custom_call_hides_nothing_after_it(splash, trip):
    text = _hlo(splash, trip)
    assert text.count("\n}}\n") == splash and text.count("\n}\n\\\"grid") == splash
    assert matmul_flops(text) == 5 * DOT_FLOPS
    ops = {op.kind: op for op in parse_collectives(text, 8)}
    assert set(ops) == {"all-reduce", "all-gather"}
    assert ops["all-reduce"].executions == ops["all-gather"].executions == 5
    assert ops["all-reduce"].trip_count_known and ops["all-reduce"].operand_bytes == 8 * 32 * 4
    assert ops["all-reduce"].groups == ((0, 1, 2, 3), (4, 5, 6, 7))
    assert ops["all-gather"].groups == ((0, 1, 2, 3), (4, 5, 6, 7))


def test_continuation_lines_join_the_instruction():
    computations, entry = parse_computations(_hlo(True))
    assert entry == "main.5_spmd"
    body = {ins.name: ins for ins in computations["region_0.2_spmd"]}
    assert list(body)[5:] == ["splash_mqa_fwd.3", "get-tuple-element.99", "ynn_fusion", "add.5", "psum_invariant.7",
                              "all-gather.1", "tuple.9"]
    call = body["splash_mqa_fwd.3"]
    assert call.opcode == "custom-call" and call.operands == ["get-tuple-element.24", "get-tuple-element.28"]
    assert call.shape == "(f32[8,32]{1,0}, f32[8,128]{1,0})"
    assert 'custom_call_target="tpu_custom_call"' in call.rest
    assert '"block_q": 512' in call.rest and "\n}}\n" in call.rest
    backend = re.search(r'backend_config="((?:[^"\\]|\\.)*)"', call.rest)
    assert backend and backend.group(1).endswith('\\"grid\\": \\"(8, 32 {\\"}') and "16384,\n}\n" in backend.group(1)
    assert body["get-tuple-element.99"].operands == ["splash_mqa_fwd.3"]
    plain, _ = parse_computations(_hlo(False))
    assert {c: len(i) for c, i in plain.items()} == {
        c: len(i) - 2 * (c == "region_0.2_spmd") for c, i in computations.items()}


def test_a_compiled_program_with_a_spliced_multiline_custom_call(devices):
    mesh = Mesh(np.array(devices).reshape(2, 4), ("data", "model"))

    def body(x, w):
        return jax.lax.fori_loop(0, 5, lambda i, x: jax.lax.psum(x @ w, "model"), x)

    f = jax.shard_map(body, mesh=mesh, in_specs=(P("data", None), P()), out_specs=P("data", None))
    x = jax.ShapeDtypeStruct((16, 32), jnp.float32, sharding=NamedSharding(mesh, P("data", None)))
    w = jax.ShapeDtypeStruct((32, 32), jnp.float32, sharding=NamedSharding(mesh, P()))
    text = jax.jit(f).lower(x, w).compile().as_text()
    # At the top of the loop body, before its dot and all-reduce, as in a scanned layer stack.
    loop = re.search(r"\bbody=%?([\w.\-]+)", text).group(1)
    header = re.search(rf"^%?{re.escape(loop)} .*\{{\n", text, re.MULTILINE)
    call = SPLASH.replace("%get-tuple-element.24, %get-tuple-element.28", "")
    spliced = text[: header.end()] + call + "\n" + text[header.end():]
    for hlo in (text, spliced):
        assert matmul_flops(hlo) == 5 * DOT_FLOPS
        [op] = parse_collectives(hlo, 8)
        assert (op.kind, op.executions, op.groups) == ("all-reduce", 5, ((0, 1, 2, 3), (4, 5, 6, 7)))
