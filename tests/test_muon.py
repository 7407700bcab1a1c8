"""Muon (optim.name=muon): which parameters it orthogonalises, its update against AdamW's on the rest, how sharded
matrices are made whole, and its sharded steps against one device with the collectives the planner counts. Its
convergence: tests/test_optimizer.py."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from spmd_train import Engine, load_config
from spmd_train.analysis import collectives_of
from spmd_train.analysis.analytic import analytic_layout
from spmd_train.analysis.plan.candidate import Candidate, Workload
from spmd_train.analysis.plan.comm import optimizer_flops, optimizer_terms
from spmd_train.analysis.plan.shape import ModelShape
from spmd_train.config.matrix_moves import Move, whole_matrix_bytes, whole_matrix_moves
from spmd_train.config.mesh_schema import MESH_AXES
from spmd_train.config.optimizer_facts import is_matrix, muon_dimensions
from spmd_train.data import make_source
from spmd_train.models.param_specs import model_params
from spmd_train.train.optimizer import make_optimizer
from spmd_train.train.optimizers.muon import ADAMW_RMS
from tests.runs import FP32, ROOT, relative_error, run_steps
from tests.test_optimizer import _model

MESH_ONES = dict.fromkeys(MESH_AXES, 1)
# DeepSeek's kinds of parameter at once: MLA with a query latent, routed experts with biases, a shared expert, a dense
# first layer, attention sinks, an MTP module.
EVERY_KIND = ["model.num_kv_heads=8", "model.mla.kv_lora_rank=16", "model.mla.q_lora_rank=24",
              "model.mla.qk_nope_head_dim=8", "model.mla.qk_rope_head_dim=4", "model.mla.v_head_dim=6",
              "model.moe.num_shared_experts=1", "model.mtp.depth=1", "model.moe.first_k_dense=1", "model.num_layers=3",
              "model.moe.expert_bias=true", "model.attention_sinks=true"]


def test_muon_takes_the_hidden_matrices_and_leaves_tables_router_and_vectors_to_adamw():
    cfg = load_config(ROOT / "configs" / "moe.yaml", EVERY_KIND)
    found = {path: muon_dimensions(axes) for path, _, axes in model_params(cfg.model)}
    # (reduction, output) dimensions; the layer stacks and the experts are batch dimensions.
    assert found["blocks.moe.attn.wq_a"] == ((1,), (2,))  # [layers, embed, q_lora]
    assert found["blocks.moe.attn.wkv_b"] == ((1,), (2, 3))  # the latent expanded into each head's key and value
    assert found["blocks.moe.attn.wo"] == ((1, 2), (3,))  # heads x head_dim -> embed: an output projection
    assert found["blocks.dense.mlp.w_down"] == ((2,), (3,))  # [layers, sublayers, mlp, embed]
    assert found["blocks.moe.mlp.w_gate"] == ((2,), (3,))  # [layers, experts, embed, expert_mlp]: one per expert
    assert found["first_blocks.mlp.w_up"] == ((1,), (2,))
    assert found["mtp.eh_proj"] == ((1,), (2,))  # [embedding ; hidden] -> d_model
    for path in ("embedding", "lm_head", "blocks.moe.mlp.router", "blocks.moe.mlp.b_down", "blocks.moe.mlp.b_gate",
                 "blocks.moe.attn.sinks", "blocks.moe.attn.kv_norm.scale", "final_norm.scale"):
        assert found[path] is None, path
    qkv = load_config(None, ["model.preset=tiny", "model.qkv_bias=true"])
    assert muon_dimensions({p: a for p, _, a in model_params(qkv.model)}["blocks.attn.bq"]) is None


def test_muon_orthogonalises_each_matrix_and_updates_the_rest_as_adamw_does():
    cfg, params, logical = _model(["optim.name=muon", "optim.schedule=constant", "optim.warmup_steps=0",
                                   "optim.clip_norm=null", "optim.lr=0.01", "optim.weight_decay=0.1"])
    rng = np.random.default_rng(0)
    grads = jax.tree.map(lambda p: jnp.asarray(rng.standard_normal(p.shape), p.dtype), params)  # full rank
    updates, _ = jax.jit(lambda g, p: make_optimizer(cfg.optim, 10, logical).update(
        g, make_optimizer(cfg.optim, 10, logical).init(p), p))(grads, params)
    adamw = optax.adamw(0.01, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1)
    reference, _ = adamw.update(grads, adamw.init(params), params)
    is_spec = lambda x: isinstance(x, jax.sharding.PartitionSpec)
    flat = jax.tree_util.tree_flatten_with_path(logical, is_leaf=is_spec)[0]
    seen = {"muon": 0, "adamw": 0}
    for (path, spec), u, g, p, r in zip(flat, jax.tree.leaves(updates), jax.tree.leaves(grads),
                                        jax.tree.leaves(params), jax.tree.leaves(reference), strict=True):
        dims = muon_dimensions(tuple(spec))
        if dims is None:
            # AdamW's first step; only matrices (the tables here) decayed.
            np.testing.assert_allclose(u, r if is_matrix(tuple(spec)) else r + 0.01 * 0.1 * p, rtol=1e-5, atol=1e-8)
            seen["adamw"] += 1
            continue
        reads, outs = dims
        order = [i for i in range(u.ndim) if i not in reads + outs] + [*reads, *outs]
        m, n = (int(np.prod([u.shape[i] for i in axes])) for axes in dims)
        direction = -(u + 0.01 * 0.1 * p) / (0.01 * ADAMW_RMS * np.sqrt(max(m, n)))  # the orthogonalised momentum
        for d, gi in zip(np.transpose(np.asarray(direction), order).reshape(-1, m, n),
                         np.transpose(np.asarray(g), order).reshape(-1, m, n), strict=True):
            s = np.linalg.svd(d, compute_uv=False)
            # Newton-Schulz's band (about 0.68-1.18), for all but the few directions whose gradient singular value is
            # too small for five iterations to lift (a square Gaussian matrix has one near zero).
            assert s.max() < 1.5 and np.mean(s > 0.5) >= 0.95, (jax.tree_util.keystr(path), s)
            u_g, _, v_g = np.linalg.svd(gi, full_matrices=False)
            polar = u_g @ v_g  # the exact orthogonalisation of the gradient (the first momentum's direction)
            cosine = np.sum(d * polar) / (np.linalg.norm(d) * np.linalg.norm(polar))
            assert cosine > 0.95, (jax.tree_util.keystr(path), cosine)
        seen["muon"] += 1
    assert seen["muon"] >= 5 and seen["adamw"] >= 4, seen


def test_matrices_move_to_whole_one_axis_at_a_time_over_the_stack_padded_or_are_gathered():
    mesh = {"fsdp": 4, "tensor": 2}
    # [layers 8, embed/fsdp, mlp/tensor]: both axes move to the layers, each device holds one whole matrix.
    moves = whole_matrix_moves([(), ("fsdp",), ("tensor",)], (8, 256, 512), (1, 2), mesh)
    assert moves == (Move("fsdp", 0, (8, 256, 512), (("fsdp",), (), ("tensor",))),
                     Move("tensor", 0, (8, 256, 512), (("fsdp", "tensor"), (), ())))
    local = 8 * 256 * 512 * 4 / 8
    assert whole_matrix_bytes(moves, (8, 256, 512), local, mesh) == (
        ("all-to-all", "fsdp", 2 * local * 3 / 4), ("all-to-all", "tensor", 2 * local / 2))
    # 3 layers over fsdp's 4: padded with a zero matrix to 4 (all-to-alls of 4/3 the bytes, under half a gather's),
    # then tensor, which the layers cannot take any more, is gathered.
    moves = whole_matrix_moves([(), ("fsdp",), ("tensor",)], (3, 256, 512), (1, 2), mesh)
    assert [(m.axis, m.dim, m.shape[0]) for m in moves] == [("fsdp", 0, 4), ("tensor", None, 4)]
    assert moves[-1].after == (("fsdp",), (), ())
    local = 3 * 256 * 512 * 4 / 8
    (to_all, over_fsdp, a), (gather, over_tensor, b) = whole_matrix_bytes(moves, (3, 256, 512), local, mesh)
    assert (to_all, over_fsdp, gather, over_tensor) == ("all-to-all", "fsdp", "all-gather", "tensor")
    assert (a, b) == pytest.approx((2 * local * 4 / 3 * 3 / 4, local * 4 / 3))
    # One layer (an MTP module) over fsdp 64: padding it to 64 would move twice a gather's bytes; gathered.
    moves = whole_matrix_moves([(), ("fsdp",), ()], (1, 256, 512), (1, 2), {"fsdp": 64})
    assert [(m.axis, m.dim) for m in moves] == [("fsdp", None)]
    # Experts already split over `expert` keep it; the matrix's fsdp moves onto the experts' dimension after it.
    moves = whole_matrix_moves([(), ("expert",), ("fsdp",), ()], (2, 8, 64, 32), (2, 3), {"expert": 2, "fsdp": 4})
    assert moves[-1].after == ((), ("expert", "fsdp"), (), ())


def test_the_planner_counts_llama3_8b_zero3_muon_as_its_tpu_compile_does():
    # docs/configs.md's v5p:4x4x4 compile (fsdp 64, 32 layers padded to 64: one layer's matrices per chip): Muon's
    # program ran 5.760e14 FLOPs per chip against AdamW's 5.552e14 and moved 1.60 GiB more in all-to-alls over fsdp.
    cfg = load_config(ROOT / "configs" / "llama3-8b_v5p-512.yaml", [
        "mesh.fsdp=64", "mesh.tensor=1", "train.global_batch_size=64", "train.seq_len=8192",
        "model.param_dtype=float32", "optim.name=muon"])
    shape, candidate = ModelShape.from_config(cfg.model), Candidate.from_config(cfg, {**MESH_ONES, "fsdp": 64})
    work = Workload.from_config(cfg, "tpu")
    assert optimizer_flops(shape, candidate, work) == pytest.approx(5.760e14 - 5.552e14, rel=0.02)
    ((op, axes, sent, count),) = [(t.op, t.axes, t.bytes, t.count) for t in optimizer_terms(shape, candidate, work)]
    assert (op, axes, count) == ("all-to-all", ("fsdp",), 14)  # 7 stacks, there and back
    assert sent == pytest.approx(1.60 * 2**30, rel=0.01)


@pytest.mark.slow
def test_muon_over_fsdp_and_tensor_equals_one_device_and_moves_what_the_planner_counts(devices):
    losses, params, _, _ = run_steps(["optim.name=muon", "mesh.fsdp=1", *FP32], devices[:1])
    sharded, sharded_params, engine, state = run_steps(["optim.name=muon", "mesh.fsdp=4", "mesh.tensor=2", *FP32],
                                                       devices)
    assert np.abs(sharded - losses).max() <= 1e-5 * np.abs(losses).max(), (sharded, losses)
    # Five Newton-Schulz steps carry the float32 rounding of the differently split gradient reductions a little
    # further than AdamW's update does.
    assert relative_error(sharded_params, params) <= 2e-5

    def compiled(engine, state) -> dict:
        batch = make_source(engine.cfg).batch(0, engine.batch_sharding)
        out = {}
        for c in collectives_of(engine.train_step.lower(state, batch).compile().as_text(), engine.mesh):
            out[c.op, c.axes] = out.get((c.op, c.axes), 0.0) + c.bytes
        return out

    adamw = Engine.build(load_config(None, ["model.preset=tiny", "train.global_batch_size=32", "train.seq_len=16",
                                            "mesh.fsdp=4", "mesh.tensor=2", *FP32]), devices)
    muon, base = compiled(engine, state), compiled(adamw, adamw.init_state())
    layout = analytic_layout(engine)
    planned = {(t.op, t.axes): t.bytes for t in optimizer_terms(layout.shape, layout.candidate, layout.workload)}
    # The tiny model's 2 layers are padded to fsdp's 4 and take it; tensor is then gathered (the single-row stacks
    # too small to pad are gathered over fsdp as well). What Muon adds to AdamW's program is what the planner (and
    # describe's analytic lines) count: in total within 10% (one stack alone compiles to exactly the planned moves; in
    # the step XLA moves a few KiB more over tensor), and each planned move in the program.
    assert {("all-to-all", ("fsdp",)), ("all-gather", ("tensor",))} <= set(planned)
    extra = {key: muon.get(key, 0.0) - base.get(key, 0.0) for key in set(muon) | set(base)}
    assert sum(extra.values()) == pytest.approx(sum(planned.values()), rel=0.1), (extra, planned)
    for key, sent in planned.items():
        assert extra[key] >= 0.9 * sent, (key, extra, planned)


LAYOUTS = {
    # Stacks sharded over `pipeline` (the optimizer runs outside the stages' shard_map, on the stored rows).
    "pipeline2_fsdp2_tensor2": (None, ["model.num_layers=8", "mesh.pipeline=2", "mesh.fsdp=2", "mesh.tensor=2",
                                       "parallel.pipeline_schedule=1f1b"], ["model.num_layers=8", "mesh.fsdp=1"]),
    # Experts split over `expert`, their matrices over fsdp: fsdp moves onto the experts' dimension. Capacity for
    # every token, so that the groups route alike on both sides.
    "expert4_fsdp2": ("configs/moe.yaml", ["mesh.expert=4", "mesh.fsdp=2", "backends.capacity_factor=8.0"],
                      ["mesh.expert=1", "mesh.fsdp=1", "backends.capacity_factor=8.0"]),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", LAYOUTS)
def test_muon_under_pipeline_and_expert_layouts_equals_one_device(devices, name):
    config, sharded, single = LAYOUTS[name]
    losses, params, _, _ = run_steps(["optim.name=muon", *single, *FP32], devices[:1], config=config)
    got, got_params, engine, _ = run_steps(["optim.name=muon", *sharded, *FP32], devices, config=config)
    assert np.abs(got - losses).max() <= 1e-5 * np.abs(losses).max(), (got, losses)
    assert relative_error(engine.model_params(got_params), params) <= 2e-5
