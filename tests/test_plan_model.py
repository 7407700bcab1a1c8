"""The planner's analytic model (spmd_train/analysis/plan): its formulas against hand computations and published
worked examples, and against what our own tools compute for the real program without compiling it."""

import ast
import math
from pathlib import Path

import jax
import pytest

from spmd_train import Engine, load_config
from spmd_train.analysis.analytic import analytic_layout
from spmd_train.analysis.plan import Candidate, ModelShape, Workload, estimate
from spmd_train.analysis.plan.candidate import group_layout, schedule_stats
from spmd_train.analysis.plan.comm import CommTerm, comm_terms, zero_terms
from spmd_train.analysis.plan.memory import (
    estimate_memory,
    korthikanti_layer_bytes,
    layer_activation_bytes,
    state_bytes,
    zero_paper_bytes,
)
from spmd_train.analysis.plan.timing import LINK_EFFICIENCY, collective_seconds, device_flops, ring_allreduce_seconds
from spmd_train.config.load import default_rules
from spmd_train.config.resolved_rules import RuleTables
from spmd_train.errors import ConfigError
from spmd_train.hardware import KINDS, device_spec, hardware
from spmd_train.models.flops import flops_per_token
from spmd_train.models.param_specs import EXPERT_DOWN_AXES, EXPERT_GATE_UP_AXES
from spmd_train.ops.experts import DOWN_AXES, GATE_UP_AXES

ROOT = Path(__file__).resolve().parents[1]
GB = 1e9


def _build(devices, path, *overrides):
    cfg = load_config(path, list(overrides))
    return cfg, Engine.build(cfg, devices)


def _planned(cfg, engine):
    a = analytic_layout(engine)  # the layout the engine hands over, as `describe` reads it
    return a.shape, a.candidate, a.workload


# --- hardware ---------------------------------------------------------------------------------------------------


def test_every_planner_kind_has_the_mfu_tables_peak_and_links_in_the_right_order():
    assert KINDS == ("a100", "h100", "h200", "b200", "gb200", "mi300x", "v4", "v5e", "v5p", "v6e", "tpu7x", "cpu")
    for kind in KINDS[:-1]:
        hw = hardware(kind)
        assert hw.spec is not None and hw.peak_flops > 1e14 and hw.hbm_bytes > 1e10
        assert hw.fast.bandwidth > hw.slow.bandwidth and hw.fast.latency < hw.slow.latency
    assert hardware("h100").peak_flops == device_spec("NVIDIA H100 80GB HBM3").peak_bf16_flops == 989.5e12
    assert hardware("h100").fast.bandwidth == 450e9  # NVLink 4: 900 GB/s over both directions, halved
    assert hardware("h100").slow.bandwidth == 50e9  # one 400 Gb/s NIC per GPU
    assert hardware("v5p").fast.bandwidth == 200e9  # 2 x 100 GB/s one-way per link: a bidirectional ring
    assert hardware("tpu7x").peak_flops == 1153.5e12 and hardware("tpu7x").devices_per_chip == 2
    assert {k: hardware(k).torus for k in ("v4", "v5e", "v5p", "v6e", "tpu7x")} == {
        "v4": 3, "v5e": 2, "v5p": 3, "v6e": 2, "tpu7x": 3}
    assert hardware("gb200").fast_domain == 72 and hardware("h100").fast_domain == 8
    # Simulated CPU devices: nothing nominal, every figure comes from a profile of the host (test_bench_collectives).
    cpu = hardware("cpu")
    assert cpu.simulated and cpu.peak_flops == cpu.hbm_bytes == cpu.fast.bandwidth == 0
    assert not any(hardware(k).simulated for k in KINDS[:-1])


@pytest.mark.parametrize("kind", ["h1000", "H100", "v5", ""])
def test_an_unknown_hardware_kind_is_refused_naming_it_and_the_valid_ones(kind):
    with pytest.raises(ConfigError, match=repr(kind)) as err:
        hardware(kind)
    assert all(k in str(err.value) for k in KINDS)


# --- the model's shape ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("path", "overrides"), [
    ("configs/tiny.yaml", []),
    ("configs/mesh_presets.yaml", ["model.tie_embeddings=true"]),
    ("configs/moe.yaml", ["model.moe.num_shared_experts=1"]),  # every 2nd layer: `layers` x `sublayers` stacks
    ("configs/moe.yaml", ["model.moe.every=1", "model.moe.d_ff=96"]),
    # gpt-oss's experts: a bias on the router logits and on each expert's three projections
    ("configs/moe.yaml", ["model.moe.router_logit_bias=true", "model.moe.expert_bias=true",
                          "model.moe.swiglu_limit=7.0"]),
    # DeepSeek-V3's layout: dense first layers (a stack of their own), then MoE layers with selection biases
    ("configs/moe.yaml", ["model.moe.every=1", "model.moe.first_k_dense=1", "model.moe.bias_update_rate=0.001"]),
    ("configs/moe.yaml", ["model.moe.first_k_dense=2"]),  # then one group of moe.every=2
    ("configs/tiny.yaml", ["model.qkv_bias=true", "model.qk_norm=true", "model.head_dim=16"]),  # Qwen2/3 layers
    # Multi-token prediction: per depth an MoE layer (in an MoE model), three norms and the 2d -> d projection.
    ("configs/moe.yaml", ["model.mtp.depth=2", "model.moe.first_k_dense=2"]),
])
def test_model_shape_lists_the_engines_parameters_and_what_a_hand_formula_counts(devices, path, overrides):
    # `models.param_specs` is what the modules create their parameters from and what the planner lists; its tree
    # assembly (paths, stacks) is its own, so it is held equal to the engine's tree, then to the layer arithmetic
    # written out: norms, attention (with Qwen's biases and per-head norms), SwiGLU or router + experts.
    cfg, engine = _build(devices, path, *overrides)
    flat = jax.tree_util.tree_flatten_with_path
    logical = dict(flat(engine.logical, is_leaf=lambda x: isinstance(x, tuple))[0])
    real = {".".join(str(k.key) for k in p): (tuple(s.shape), tuple(logical[p]))
            for p, s in flat(engine.param_shapes)[0]}
    m = cfg.model
    shape = ModelShape.from_config(m)
    assert {g.path: (g.shape, g.axes) for g in shape.params} == real and shape.total_params == engine.num_params
    d, hd, h, kv = m.d_model, m.resolved_head_dim, m.num_heads, m.num_kv_heads
    attention = 2 * d + d * hd * (2 * h + 2 * kv) + hd * (h + 2 * kv) * m.qkv_bias + 2 * hd * m.qk_norm
    dense = attention + 3 * d * m.d_ff
    moe_layers = shape.moe_layers
    if m.moe:
        e, f = m.moe.num_experts, m.resolved_moe_d_ff
        bias = e if m.moe.router_bias else 0  # the selection bias: state, counted with the parameters
        bias += e * m.moe.router_logit_bias + e * (2 * f + d) * m.moe.expert_bias
        assert shape.moe_layer_params == attention + d * e + bias + 3 * d * f * (e + m.moe.num_shared_experts)
    assert shape.dense_layer_params == (dense if moe_layers < m.num_layers else 0)
    tables = m.vocab_size * d * (1 if m.tie_embeddings else 2)
    mtp = 0 if m.mtp is None else m.mtp.depth * ((shape.moe_layer_params if m.moe else dense) + 3 * d + 2 * d * d)
    assert shape.total_params == ((m.num_layers - moe_layers) * shape.dense_layer_params
                                  + moe_layers * shape.moe_layer_params + tables + d + mtp)
    assert shape.flops_per_token(1024) == flops_per_token(m, 1024)
    assert [g.path for g in shape.params if g.lookup_only] == ([] if m.tie_embeddings else ["embedding"])


def test_the_expert_weights_logical_axes_are_the_ones_the_expert_matmuls_constrain():
    # ops (below the model layer, jax only) keeps the names its matmuls constrain the expert weights to; the
    # declaration the modules and the planner read must be the same.
    assert (EXPERT_GATE_UP_AXES, EXPERT_DOWN_AXES) == (GATE_UP_AXES, DOWN_AXES)


def test_parameter_counts_of_a_dense_and_a_mixture_model_by_hand():
    llama = ModelShape.from_config(load_config("configs/llama3-8b_v5p-512.yaml").model)
    d, f, hd, v = 4096, 14336, 128, 128256
    layer = 2 * d + d * hd * (2 * 32 + 2 * 8) + 3 * d * f
    assert llama.dense_layer_params == layer
    assert llama.embedding_params == 2 * v * d  # untied: table and head
    assert llama.total_params == 32 * layer + 2 * v * d + d == 8_030_261_248
    assert llama.active_params == 32 * (layer - 2 * d) + v * d  # 6N counts matmul weights and the head only
    mixtral = ModelShape.from_config(load_config("configs/moe.yaml", ["model.preset=mixtral-8x7b"]).model)
    assert mixtral.moe_layer_params == layer + d * 8 + 3 * d * f * 7  # router, and 8 experts for the one MLP
    assert round(mixtral.total_params / 1e9, 2) == 46.70  # models/mixtral-8x7b.yaml's own figure


# --- the rules the layout arithmetic reads -------------------------------------------------------------------


def test_candidates_read_the_loaded_rule_tables_and_carry_a_configs_own(devices):
    default = RuleTables.from_config(load_config("configs/mesh_presets.yaml").mesh.rules)
    assert default == default_rules() and Candidate(fsdp=8).tables.batch_axes == ("data", "fsdp", "expert")
    # Rules of its own travel with the candidate: `embed` on fsdp alone leaves the weights whole over `sequence`.
    cfg, engine = _build(devices, "configs/mesh_presets.yaml", "mesh.fsdp=4", "mesh.sequence=2",
                         "mesh.rules.params.embed=[fsdp]")
    own = Candidate.from_config(cfg, dict(engine.mesh.shape))
    assert own.rules == RuleTables.from_config(cfg.mesh.rules) != default
    wq = ("layers", "embed", "heads", "head_dim")
    assert group_layout(wq, own).params == ((), ("fsdp",), (), ())
    assert group_layout(wq, Candidate(fsdp=4, sequence=2)).params == ((), ("fsdp", "sequence"), (), ())
    with pytest.raises(ConfigError, match="remat='some'"):
        Candidate(fsdp=8, remat="some")


# --- memory: model state ----------------------------------------------------------------------------------------


def test_the_zero_papers_worked_example_and_sixteen_bytes_per_parameter():
    # ZeRO §5.1 / Figure 1: Ψ = 7.5B on N = 64, mixed-precision AdamW (K = 12).
    assert [round(zero_paper_bytes(7.5e9, 64, stage) / GB, 1) for stage in range(4)] == [120.0, 31.4, 16.6, 1.9]
    assert zero_paper_bytes(7e9, 1, 0) / GB == 112  # 16 bytes per parameter of model state


@pytest.mark.parametrize(("stage", "per_param"), [(0, 16), (1, 8 + 8 / 8), (2, 4 + 12 / 8), (3, 16 / 8)])
def test_our_fp32_adamw_state_by_zero_stage_over_8_devices(stage, per_param):
    # fp32 parameters, fp32 gradients, two fp32 moments: 4Ψ + 4Ψ + 8Ψ, every weight split on its model dimension.
    shape = ModelShape.from_config(load_config("configs/tiny.yaml").model)
    total = sum(state_bytes(shape, Candidate(fsdp=8, zero_stage=stage), Workload(8, 64)))
    assert total == pytest.approx(per_param * shape.total_params)


def test_bf16_lion_and_adamw_hold_one_and_two_moments_in_the_parameter_dtype():
    shape = ModelShape.from_config(load_config("configs/tiny.yaml", ["model.param_dtype=bfloat16"]).model)
    psi = shape.total_params
    lion = state_bytes(shape, Candidate(fsdp=4, zero_stage=2), Workload(8, 64, optimizer="lion"))
    assert lion == pytest.approx((2 * psi, 2 * psi / 4, 2 * psi / 4))
    adamw = state_bytes(shape, Candidate(data=2, fsdp=2, zero_stage=1), Workload(8, 64))
    assert adamw == pytest.approx((2 * psi, 2 * psi, 4 * psi / 2))


@pytest.mark.parametrize(("path", "overrides"), [
    *[("configs/mesh_presets.yaml", [f"mesh.preset={p}"]) for p in ("ddp", "fsdp", "fsdp_tp", "hsdp", "tp_sp")],
    *[("configs/mesh_presets.yaml", [f"parallel.zero_stage={z}"]) for z in (0, 1, 2)],
    ("configs/pipeline.yaml", []),
    ("configs/pipeline.yaml", ["model.num_layers=6", "parallel.pipeline_layers=balanced"]),  # padded to 2 a stage
    ("configs/moe.yaml", []),
    ("configs/moe.yaml", ["optim.name=adafactor", "parallel.zero_stage=2", "model.d_model=128", "model.moe.d_ff=128",
                          "model.d_ff=256"]),
    ("configs/tiny.yaml", ["optim.name=adafactor", "optim.b1=0.9", "model.d_model=256", "model.d_ff=512"]),
    ("configs/tiny.yaml", ["optim.name=lion", "model.param_dtype=bfloat16"]),
    # precision.moments: AdamW's two in bfloat16 beside float32 parameters; Adafactor's momentum cast too; float32
    # moments of bfloat16 parameters; bfloat16 moments under a float32 master copy.
    ("configs/tiny.yaml", ["precision.moments=bfloat16"]),
    ("configs/tiny.yaml", ["optim.name=adafactor", "optim.b1=0.9", "model.d_model=256", "model.d_ff=512",
                           "precision.moments=bfloat16"]),
    ("configs/tiny.yaml", ["precision.params=bfloat16", "precision.moments=float32"]),
    ("configs/tiny.yaml", ["precision.preset=bf16-master", "precision.moments=bfloat16"]),
    ("configs/tiny.yaml", ["model.num_kv_heads=8", "model.mla.kv_lora_rank=16", "model.mla.q_lora_rank=24",
                           "model.mla.qk_nope_head_dim=8", "model.mla.qk_rope_head_dim=4", "model.mla.v_head_dim=6"]),
])
def test_state_bytes_equal_the_engines_count_from_shapes_and_shardings(devices, path, overrides):
    cfg, engine = _build(devices, path, *overrides)
    shape, candidate, work = _planned(cfg, engine)
    # Off by the optimizer's step counters and Adafactor's (1,) placeholders' layout: a few bytes.
    assert sum(state_bytes(shape, candidate, work)) == pytest.approx(engine.state_bytes_per_device, abs=128)


# --- memory: activations ----------------------------------------------------------------------------------------


def test_korthikantis_gpt3_175b_layer():
    s, b, h, a = 2048, 1, 12288, 96
    assert korthikanti_layer_bytes(s, b, h, a) == s * b * h * (34 + 80)  # 5as/h = 80: 2.87 GB per layer
    assert korthikanti_layer_bytes(s, b, h, a, tensor=8) == s * b * h * (10 + 24 / 8 + 80 / 8)
    assert korthikanti_layer_bytes(s, b, h, a, tensor=8, sequence_parallel=True) == s * b * h * 114 / 8


def test_our_layers_activations_by_hand():
    m = ModelShape.from_config(load_config("configs/llama3-8b_v5p-512.yaml").model)  # bf16 compute
    h, f, tokens = 4096, 14336, 8192
    kw = {"tokens": tokens, "context": tokens, "attention": "flash"}
    none = layer_activation_bytes(m, "none", tensor=1, sequence_parallel=False, **kw)
    norms, attention, mlp = 2 * (8 * h + 2 * h + 8), 2 * (2 * 32 + 2 * 8) * 128 + 4 * 32, 6 * 2 * f
    assert none == tokens * (norms + attention + mlp)
    assert layer_activation_bytes(m, "full", tensor=1, sequence_parallel=False, **kw) == tokens * 2 * h
    # Tensor parallelism splits heads and d_ff; sequence parallelism the residual-stream terms too.
    tp = layer_activation_bytes(m, "none", tensor=8, sequence_parallel=False, **kw)
    assert tp == tokens * (norms + attention / 8 + mlp / 8)
    assert layer_activation_bytes(m, "none", tensor=8, sequence_parallel=True, **kw) == none / 8
    # XLA's attention keeps the fp32 probabilities and their bf16 cast: (4 + 2) x heads x context per token.
    xla = layer_activation_bytes(m, "none", tensor=1, sequence_parallel=False, **{**kw, "attention": "xla"})
    assert xla - none == tokens * (32 * 6 * tokens + 8 * 32 - 4 * 32)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_pipeline_stage_stashes_what_the_model_says_for_every_remat_policy(devices, dtype):
    from spmd_train.train.pipelined import stash_bytes_per_microbatch

    for policy in ("none", "full", "save_matmuls", "save_matmuls_no_batch"):
        cfg, engine = _build(devices, "configs/pipeline.yaml", f"parallel.remat={policy}",
                             f"model.compute_dtype={dtype}")
        shape, candidate, work = _planned(cfg, engine)
        rows = cfg.train.global_batch_size // engine.mesh.shape["fsdp"]
        traced = stash_bytes_per_microbatch(cfg, engine.block_graphdef, engine.param_shapes["blocks"], engine.plan,
                                            rows)
        _, _, slots = schedule_stats(candidate.pipeline_schedule, candidate.pipeline, engine.plan.schedule.microbatches,
                                     1)
        assert slots == engine.plan.stash_slots
        # Left out: the norm scales' per-layer fp32 copies (4 x d_model bytes a layer).
        assert estimate_memory(shape, candidate, work).activations / slots == pytest.approx(traced, rel=2e-3), policy


def test_an_moe_layer_keeps_what_jax_vjp_keeps_of_it():
    from flax import nnx

    from spmd_train.config.model_schema import BackendsConfig
    from spmd_train.models.remat import apply_remat
    from spmd_train.models.transformer import Block
    from spmd_train.ops.rope import rope_tables
    from spmd_train.parallel import resolve_backends

    cfg = load_config("configs/moe.yaml", ["model.compute_dtype=bfloat16", "model.moe.num_shared_experts=1"])
    m, b, s = cfg.model, 2, 64
    graphdef, state = nnx.split(nnx.eval_shape(
        lambda: Block(m, nnx.Rngs(0), resolve_backends(m, BackendsConfig(), "cpu"), moe=True)))
    x = jax.ShapeDtypeStruct((b, s, m.d_model), jax.numpy.bfloat16)
    weights = {(a.shape, a.dtype) for a in jax.tree.leaves(state)}
    shape = ModelShape.from_config(m)
    slots = 8 * math.ceil(2 * b * s * 1.25 / 8)
    for policy in ("none", "save_matmuls", "save_matmuls_no_batch"):
        def layer(state, x, policy=policy):
            rope = (rope_tables(s, m.resolved_head_dim, m.rope_theta, None),)
            return apply_remat(lambda x, state: nnx.merge(graphdef, state)(x, rope)[0], policy)(x, state)

        leaves = jax.eval_shape(lambda state, x, f=layer: jax.tree.leaves(jax.vjp(f, state, x)[1]), state, x)
        traced = sum(math.prod(a.shape) * a.dtype.itemsize for a in leaves if (a.shape, a.dtype) not in weights)
        mine = layer_activation_bytes(shape, policy, tokens=b * s, context=s, tensor=1, sequence_parallel=False,
                                      attention="xla", moe=True, slots=slots)
        if policy == "none":  # one layer alone also keeps what a stack keeps once: the causal mask and RoPE tables
            mine += b * 8 * s * s * 5 + 8 * shape.head_dim * s
        assert mine == pytest.approx(traced, rel=0.03), policy


@pytest.mark.parametrize("scheme", ["ring", "allgather", "ulysses"])
def test_context_parallel_attention_keeps_what_jax_vjp_keeps_of_it(devices, scheme):
    """Each scheme's residuals, traced on 4 devices of `sequence` for XLA's attention and the flash kernel, under
    every policy that keeps attention residuals, equal `attention_residual_bytes` (nothing is compiled)."""
    import numpy as np
    from jax.sharding import AxisType, Mesh
    from jax.sharding import PartitionSpec as P

    from spmd_train.analysis.plan.attention_memory import attention_residual_bytes
    from spmd_train.models.remat import apply_remat
    from spmd_train.parallel.attention_dispatch import local_kernel
    from spmd_train.parallel.backends import Backends
    from spmd_train.parallel.context import context_attention

    n, b, length, heads, kv, hd = 4, 2, 512, 8, 4, 64
    cfg = load_config("configs/tiny.yaml", ["model.compute_dtype=bfloat16", f"model.num_heads={heads}",
                                            f"model.num_kv_heads={kv}", f"model.d_model={heads * hd}"])
    shape = ModelShape.from_config(cfg.model)
    c = shape.compute_bytes
    mesh = Mesh(np.array(devices[:n]), ("sequence",), axis_types=(AxisType.Auto,))
    tokens = b * length // n
    for attention, backends in (("xla", Backends("cpu", "xla")),
                                ("flash", Backends("cpu", "pallas", kernels="tpu", interpret=True, blocks=(128, 128)))):
        kernel = local_kernel(backends)
        for policy in ("none", "save_matmuls", "save_matmuls_no_batch"):
            kept = []

            def body(q, k, v, kernel=kernel, policy=policy, kept=kept):
                attend = apply_remat(lambda q, k, v: context_attention(q, k, v, None, how=scheme, ways=n,
                                                                       kernel=kernel), policy)
                out, vjp = jax.vjp(attend, q, k, v)
                kept.extend(jax.tree.leaves(vjp))
                return out

            region = jax.shard_map(body, mesh=mesh, in_specs=(P(None, "sequence"),) * 3,
                                   out_specs=P(None, "sequence"), check_vma=False)
            jax.eval_shape(region, *(jax.ShapeDtypeStruct((b, length, h, hd), jax.numpy.bfloat16)
                                     for h in (heads, kv, kv)))
            # The model leaves out the flash kernel's int32 document ids (4 bytes a key) and scalars.
            traced = sum(math.prod(a.shape) * a.dtype.itemsize for a in kept
                         if a.ndim and (jax.numpy.issubdtype(a.dtype, jax.numpy.floating) or a.dtype == bool))
            if policy == "none" and scheme != "ring":  # ring's custom VJP keeps its output; the others leave it to
                traced += tokens * c * heads * hd        # the projection after them, whose residual it is
            if scheme == "ulysses" and attention == "xla" and policy == "none":
                traced -= tokens * 5 * heads * length   # the causal mask, which a layer stack keeps once (hoisted)
            if scheme == "ulysses" and attention == "xla" and policy == "save_matmuls":
                traced += tokens * c * heads * hd       # the product the projection's input is recomputed from
            mine = tokens * attention_residual_bytes(shape, policy, heads=heads, kv=kv, context=length,
                                                     attention=attention, scheme=scheme, ways=n)
            assert mine == pytest.approx(traced, rel=1e-3), (attention, policy)


# --- collectives -------------------------------------------------------------------------------------------------


def test_zero3_moves_three_parameter_volumes_and_zero1_two_by_hand():
    # fsdp 8, every weight split over it: two bf16 gathers and one bf16 reduce-scatter per weight (the untied table
    # is gathered once), i.e. the ZeRO paper's 3Ψ(N-1)/N; on an accelerator the weights outside the layer stack
    # (table, final norm, LM head) are gathered once. ZeRO-1 all-reduces fp32 gradients (2Ψ) and gathers fp32
    # parameters (Ψ) once per step whatever the accumulation.
    shape = ModelShape.from_config(load_config("configs/tiny.yaml", ["model.compute_dtype=bfloat16"]).model)
    psi, table, n = shape.total_params, shape.params[0].numel, 8
    outside = sum(g.numel for g in shape.params if not g.path.startswith("blocks."))
    assert outside == table + 64 + table  # the table, the final norm's scale and the untied LM head
    for xla_cpu, gathered in ((True, 2 * psi - table), (False, 2 * psi - outside)):
        three = {(t.op, t.purpose): t.bytes
                 for t in zero_terms(shape, Candidate(fsdp=n, zero_stage=3, grad_accum=2), xla_cpu=xla_cpu)}
        # An accelerator re-splits the untied fp32 table by rows for the lookup and back: two all-to-alls a step.
        reshard = {} if xla_cpu else {("all-to-all", "table-reshard"): 2 * table / n * 4 * (n - 1) / n}
        assert three == pytest.approx({("all-gather", "weights"): 2 * gathered * 2 * (n - 1) / n,
                                       ("reduce-scatter", "grad-scatter"): 2 * psi * 2 * (n - 1) / n, **reshard})
    one = {(t.op, t.purpose): t.bytes for t in zero_terms(shape, Candidate(fsdp=n, zero_stage=1, grad_accum=2))}
    assert one == pytest.approx({("reduce-scatter", "grad-reduce"): psi * 4 * (n - 1) / n,
                                 ("all-gather", "update-gather"): psi * 4 * (n - 1) / n})


def test_tensor_and_pipeline_bytes_by_hand():
    shape = ModelShape.from_config(load_config("configs/tiny.yaml", ["model.num_layers=8"]).model)  # fp32, h = 64
    work = Workload(global_batch=32, seq_len=64)
    # tensor 2 over 4 fsdp: 8 rows x 64 tokens a device; 4 all-reduce-equivalents of the [tokens, h] block per layer,
    # plus the vocabulary-parallel embedding and head; each moves 2 (T-1)/T of the block. Full remat reduces the
    # attention's output again (5 a layer); under SP each sublayer gathers its split input 3 times (6 a layer).
    block = 8 * 64 * 64 * 4
    for remat, per_layer in (("none", 4), ("full", 5)):
        (tp,) = [t for t in comm_terms(shape, Candidate(fsdp=4, tensor=2, remat=remat), work) if t.axes == ("tensor",)]
        assert (tp.op, tp.bytes, tp.count) == ("all-reduce", (8 * per_layer + 2) * block * 2 * 1 / 2, 8 * per_layer + 2)
    for remat, scatters in (("none", 4), ("full", 5)):
        sp = [t for t in comm_terms(shape, Candidate(fsdp=4, tensor=2, sequence_parallel=True, remat=remat), work)
              if t.axes == ("tensor",)]
        assert {t.op: (t.bytes, t.count) for t in sp} == {
            "all-gather": ((8 * 6 + 2) * block / 2, 8 * 6 + 2),
            "reduce-scatter": ((8 * scatters + 2) * block / 2, 8 * scatters + 2)}
    # pipeline 4 x fsdp 2, 1F1B with 16 microbatches of 1 row: 2 (m + p - 1) ticks, a send each way every tick.
    pipe = {t.op: t for t in comm_terms(shape, Candidate(pipeline=4, fsdp=2, pipeline_microbatches=16), work)
            if t.axes == ("pipeline",)}
    ticks = 2 * (16 + 4 - 1)
    assert pipe["collective-permute"].bytes == 2 * ticks * 64 * 64 * 4 and pipe["collective-permute"].count == 2 * ticks


# --- time ----------------------------------------------------------------------------------------------------------


def test_ring_all_reduce_and_the_alpha_beta_time_of_a_term():
    assert ring_allreduce_seconds(8, 1e9, 2e-6, 1e-11) == 2 * 7 * 2e-6 + 2 * 7 / 8 * 1e9 * 1e-11
    hw = hardware("h100")
    term = CommTerm("all-reduce", ("data",), 2 * 7 / 8 * 1e9, 1, "grad-reduce")
    beta = 1 / (hw.fast.bandwidth * LINK_EFFICIENCY)
    assert collective_seconds(term, Candidate(data=8), hw) == pytest.approx(
        ring_allreduce_seconds(8, 1e9, hw.fast.latency, beta))
    # 4 nodes of 8: of the bytes (n_s - 1)/(N - 1) cross InfiniBand, n_s (n_f - 1)/(N - 1) stay on NVLink.
    term = CommTerm("all-reduce", ("data",), 2 * 31 / 32 * 1e9, 1, "grad-reduce")
    slow = 2 * 31 / 32 * 1e9 * 3 / 31 / (hw.slow.bandwidth * LINK_EFFICIENCY)
    fast = 2 * 31 / 32 * 1e9 * 28 / 31 / (hw.fast.bandwidth * LINK_EFFICIENCY)
    latency = 2 * (7 * hw.fast.latency + 3 * hw.slow.latency)
    assert collective_seconds(term, Candidate(data=32, dcn={"data": 4}), hw) == pytest.approx(slow + fast + latency)


@pytest.mark.parametrize(("schedule", "p", "m", "v"), [("gpipe", 4, 8, 1), ("1f1b", 4, 16, 1), ("1f1b", 8, 8, 1),
                                                      ("interleaved_1f1b", 4, 8, 2), ("interleaved_1f1b", 2, 8, 4)])
def test_the_simulated_bubble_is_megatrons(schedule, p, m, v):
    ticks, bubble, _ = schedule_stats(schedule, p, m, v)
    assert ticks == 2 * (v * m + p - 1)
    assert bubble / (1 - bubble) == pytest.approx((p - 1) / (v * m))  # Megatron: (p-1)/m, interleaved (p-1)/(vm)


def test_remat_recompute_mfu_convention_and_the_overlap_rule():
    shape = ModelShape.from_config(load_config("configs/llama3-8b_v5p-512.yaml").model)
    work, tokens = Workload(global_batch=64, seq_len=8192), 64 * 8192
    model, plain = device_flops(shape, Candidate(fsdp=64, remat="none"), work)
    assert model == pytest.approx(flops_per_token(load_config("configs/llama3-8b_v5p-512.yaml").model, 8192) * tokens)
    assert plain == model / 64
    _, full = device_flops(shape, Candidate(fsdp=64, remat="full"), work)
    layers = shape.matmul_params - 4096 * 128256  # the LM head is outside the rematerialised layer loop
    attention_forward = shape.attention_flops_per_token(8192) / 3
    assert full * 64 == pytest.approx(model + (2 * layers + attention_forward) * tokens)
    # Compiled for v5p:4x4x4 (docs/benchmarks.md, ZeRO-3 bytes): 555.24 TFLOPs per chip under full remat.
    assert full / 1e12 == pytest.approx(555.24, rel=0.01)
    result = estimate(shape, Candidate(fsdp=64, remat="full"), hardware("v5p"), global_batch=64, seq_len=8192)
    t = result.timing
    assert t.mfu == pytest.approx(model / (t.step * hardware("v5p").peak_flops * 64))
    assert t.tokens_per_second == pytest.approx(tokens / t.step)
    (fsdp,) = t.axes
    # Gathers and gradient scatters hide; the untied table's re-split for the lookup (first in the step) does not.
    (reshard,) = [term for term in result.comm if term.purpose == "table-reshard"]
    v5p = Candidate(fsdp=64, remat="full")
    assert fsdp.axes == ("fsdp",) and fsdp.regime == "compute-bound"
    assert fsdp.exposed == pytest.approx(collective_seconds(reshard, v5p, hardware("v5p"))) and fsdp.exposed < 1e-3
    assert t.step == pytest.approx(t.compute + t.exposed)
    tp = estimate(shape, Candidate(fsdp=8, tensor=8), hardware("v5p"), global_batch=64, seq_len=8192).timing
    (tensor,) = [a for a in tp.axes if a.axes == ("tensor",)]
    assert tensor.exposed == tensor.seconds > 0  # on the critical path of every layer
    assert tp.step == pytest.approx(tp.compute + tp.exposed)


# --- no jax -------------------------------------------------------------------------------------------------------


def _module_file(name: str) -> Path | None:
    path = ROOT.joinpath(*name.split("."))
    return path.with_suffix(".py") if path.with_suffix(".py").exists() else None  # packages: their __init__ skipped


def _imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found |= {node.module, *(f"{node.module}.{a.name}" for a in node.names)}
    return found


def test_the_analytic_model_and_the_hardware_table_import_no_jax_even_indirectly():
    todo = [f"spmd_train.analysis.plan.{p.stem}" for p in (ROOT / "spmd_train/analysis/plan").glob("*.py")
            if p.stem != "__init__"] + ["spmd_train.hardware"]
    seen, jax_like = set(), {"jax", "jaxlib", "flax", "optax", "orbax", "chex"}
    while todo:
        name = todo.pop()
        if name in seen or (path := _module_file(name)) is None:
            continue
        seen.add(name)
        for imported in _imports(path):
            assert imported.split(".")[0] not in jax_like, f"{name} imports {imported}"
            if imported.startswith("spmd_train."):
                todo.append(imported)
    assert {"spmd_train.analysis.plan.memory", "spmd_train.parallel.schedules", "spmd_train.models.flops",
            "spmd_train.config.schema"} <= seen
