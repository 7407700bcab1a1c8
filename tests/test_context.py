"""Context parallelism: tokens split over `sequence`, attention joined by all-gather or Ulysses all-to-all."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend.core import jaxprs_in_params
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from spmd_train import Engine, load_config
from spmd_train.analysis import describe
from spmd_train.config.checks import check_layout
from spmd_train.errors import ConfigError
from spmd_train.ops.attention import dot_product_attention
from spmd_train.parallel.attention_dispatch import local_kernel
from spmd_train.parallel.backends import Backends, resolve_backends
from spmd_train.parallel.context import context_attention
from spmd_train.parallel.head_groups import kv_repeats
from spmd_train.parallel.ring import zigzag_order
from tests.runs import FP32, ROOT, TINY, main_in_process, relative_error, run_steps, token_files
from tests.tiers import fast_cases


def _kernel(name):
    """The local kernel the model's attention region hands the schemes (Pallas: TPU kernels, interpreted)."""
    if name == "xla":
        return local_kernel(Backends(platform="cpu", attention="xla"))
    return local_kernel(Backends(platform="cpu", attention="pallas", kernels="tpu", interpret=True, blocks=(8, 8)))


def test_kv_heads_are_repeated_only_as_far_as_the_devices_need():
    assert [kv_repeats(kvh, 4) for kvh in (1, 2, 4, 8)] == [4, 2, 1, 1]
    assert kv_repeats(6, 4) == 2  # 12 heads: 3 whole groups per device


@pytest.mark.parametrize(("kernel", "how"), fast_cases(
    [(kernel, how) for kernel in ("xla", "pallas") for how in ("ring", "allgather", "ulysses")],
    fast=["xla-ring", "xla-allgather", "pallas-ulysses"], ids="-".join, several=True))
def test_each_device_chunk_attends_like_the_whole_sequence(devices, how, kernel):
    # 4 chunks of 8 tokens, 4 query heads over 2 K/V heads (ulysses repeats them), three documents
    # whose boundaries fall inside chunks: values and gradients equal the unsplit reference.
    n, (b, length, h, kvh, d) = 4, (2, 32, 4, 2, 16)
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.normal(size=(b, length, heads, d)), jnp.float32) for heads in (h, kvh, kvh))
    segments = jnp.asarray([np.repeat([0, 1, 2], sizes) for sizes in ([5, 14, 13], [20, 6, 6])], jnp.int32)
    cotangent = jnp.asarray(rng.normal(size=(b, length, h, d)), jnp.float32)
    if how == "ring":  # the ring's devices hold zigzag pairs of chunks
        order = zigzag_order(length, n)
        q, k, v, segments, cotangent = (a[:, order] for a in (q, k, v, segments, cotangent))
        positions = jnp.asarray(order)
    else:
        positions = jnp.arange(length)
    mesh = Mesh(np.array(devices[:n]), ("sequence",))
    split = P(None, "sequence")
    local = functools.partial(context_attention, how=how, ways=n, kernel=_kernel(kernel))
    sharded = jax.shard_map(local, mesh=mesh, in_specs=(split, split, split, split), out_specs=split,
                            check_vma=False)
    # The reference in true token order (a permutation of rows commutes with attention).
    back = jnp.argsort(positions)
    reference = lambda q, k, v: dot_product_attention(q[:, back], k[:, back], v[:, back], causal=True,
                                                      segment_ids=segments[:, back])[:, positions]
    loss = lambda f: lambda q, k, v: jnp.sum(f(q, k, v) * cotangent)
    got, got_grads = jax.jit(jax.value_and_grad(loss(lambda q, k, v: sharded(q, k, v, segments)), (0, 1, 2)))(q, k, v)
    want, want_grads = jax.value_and_grad(loss(reference), (0, 1, 2))(q, k, v)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    for g, w in zip(got_grads, want_grads, strict=True):
        np.testing.assert_allclose(g, w, rtol=2e-4, atol=2e-5)
    # Without the documents the result differs: the masks reach every chunk.
    plain = jax.jit(lambda q, k, v: jax.shard_map(lambda q, k, v: local(q, k, v, None), mesh=mesh,
                                                  in_specs=(split,) * 3, out_specs=split, check_vma=False)(q, k, v))
    assert not np.allclose(plain(q, k, v), reference(q, k, v), atol=1e-3)


@pytest.fixture(scope="module")
def references(corpus, devices):
    plain = run_steps([*FP32, "mesh.fsdp=1"], devices[:1])[:2]
    documents = run_steps([*FP32, "mesh.fsdp=1", *token_files(corpus)], devices[:1])[:2]
    return {False: plain, True: documents}


LAYOUTS = {
    "allgather_sequence8": (False, ["mesh.fsdp=1", "mesh.sequence=8"]),
    "ulysses_sequence8_kv_heads_repeated": (False, ["mesh.fsdp=1", "mesh.sequence=8",
                                                    "parallel.context_parallel=ulysses"]),
    "ring_sequence8": (False, ["mesh.fsdp=1", "mesh.sequence=8", "parallel.context_parallel=ring"]),
    "ring_sequence4_fsdp2_documents": (True, ["mesh.fsdp=2", "mesh.sequence=4", "parallel.context_parallel=ring"]),
    "ulysses_sequence2_tensor2_fsdp2_sp_documents": (True, ["mesh.fsdp=2", "mesh.tensor=2", "mesh.sequence=2",
                                                            "parallel.sequence_parallel=true",
                                                            "parallel.context_parallel=ulysses"]),
    "ring_sequence2_data2_fsdp2_zero1_accum2_remat": (False, ["mesh.data=2", "mesh.fsdp=2", "mesh.sequence=2",
                                                              "parallel.context_parallel=ring", "parallel.zero_stage=1",
                                                              "train.grad_accum=2", "parallel.remat=full"]),
    "allgather_sequence2_pipeline2_fsdp2_1f1b_documents": (True, ["mesh.pipeline=2", "mesh.fsdp=2",
                                                                  "mesh.sequence=2",
                                                                  "parallel.pipeline_schedule=1f1b",
                                                                  "parallel.pipeline_microbatches=4"]),
    # Ulysses' all-to-alls inside the pipeline's per-tick branch are right; ring's permutes there are not, and a
    # pipeline with ring attention is refused (test_layouts_context_parallelism_cannot_run_are_refused).
    "ulysses_sequence2_pipeline2_fsdp2_1f1b": (False, ["mesh.pipeline=2", "mesh.fsdp=2", "mesh.sequence=2",
                                                      "parallel.context_parallel=ulysses",
                                                      "parallel.pipeline_schedule=1f1b",
                                                      "parallel.pipeline_microbatches=4"]),
}


@pytest.mark.parametrize("layout", fast_cases(LAYOUTS, fast=["ring_sequence8", "ulysses_sequence8_kv_heads_repeated"]))
def test_sequence_split_runs_equal_one_device(corpus, references, devices, layout):
    documents, overrides = LAYOUTS[layout]
    ref_losses, ref_params = references[documents]
    losses, params, engine, _ = run_steps([*FP32, *overrides, *(token_files(corpus) if documents else [])], devices)
    assert engine.backends.context and engine.backends.sequence > 1
    assert engine.cfg.data.masks_documents == documents
    assert abs(losses - ref_losses).max() / abs(ref_losses).max() <= 1e-5, (losses, ref_losses)
    assert relative_error(params, ref_params) <= 1e-5


def _sequence_collectives(devices, how, overrides=(), n=4):
    """(config, compiled collectives over `sequence` by op as (count, bytes)) of the tiny model's step; the
    describe section's prediction must equal the compiled figures."""
    cfg = load_config(None, [*TINY, *FP32, "mesh.fsdp=2", f"mesh.sequence={n}", f"parallel.context_parallel={how}",
                             *overrides])
    context = describe(cfg, devices=devices[:2 * n]).context
    assert context["compiled"] == context["collectives"]
    assert context["exact"]
    return cfg, {op: (c["count"], c["bytes_per_device"]) for op, c in context["compiled"].items()}


@pytest.mark.slow
def test_allgather_gathers_k_and_v_forward_and_reduce_scatters_their_gradients(devices):
    cfg, found = _sequence_collectives(devices, "allgather")
    m, t, n = cfg.model, cfg.train, 4
    rows = t.global_batch_size // 2  # fsdp 2 splits the batch
    kv_bytes = rows * t.seq_len * m.num_kv_heads * m.resolved_head_dim * 4  # one layer's K (or V), gathered
    per_layer = 2 * kv_bytes * (n - 1) / n
    assert found["all-gather"] == (2 * m.num_layers, pytest.approx(m.num_layers * per_layer))
    assert found["reduce-scatter"] == (2 * m.num_layers, pytest.approx(m.num_layers * per_layer))
    assert "all-to-all" not in found


def test_ring_passes_k_and_v_n_minus_1_times_forward_and_brings_their_gradients_home(devices):
    cfg, found = _sequence_collectives(devices, "ring")
    m, t, n = cfg.model, cfg.train, 4
    rows = t.global_batch_size // 2
    block = rows * t.seq_len // n * m.num_kv_heads * m.resolved_head_dim * 4  # one device's K (or V)
    # Forward: K and V go N-1 hops. Backward: again N-1 hops each, and N hops each of dK, dV (all fp32 here).
    hops = 2 * (n - 1) + 2 * (n - 1) + 2 * n
    assert found["collective-permute"][0] == m.num_layers * hops
    assert found["collective-permute"][1] == pytest.approx(m.num_layers * hops * block, rel=1e-3)
    assert "all-gather" not in found and "all-to-all" not in found


@pytest.mark.slow
def test_ring_with_documents_remat_and_accumulation_compiles_to_the_described_collectives(corpus, devices):
    # Document ids go round once per microbatch (hoisted out of the layer loop, reused backward); the
    # forward hops full remat recomputes are the backward ring's own, so they add nothing.
    cfg, found = _sequence_collectives(devices, "ring", [*token_files(corpus), "parallel.remat=full",
                                                         "train.grad_accum=2"])
    n, layers = 4, cfg.model.num_layers
    assert found["collective-permute"][0] == 2 * (layers * (2 * (n - 1) + 2 * (n - 1) + 2 * n) + (n - 1))


def _branch_flops(jaxpr) -> list[list[int]]:
    """For each `cond` in a jaxpr (nested ones included): the matmul FLOPs of each of its branches."""
    out = []

    def flops(jaxpr):
        total = 0
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "dot_general":
                (contract, _), _ = eqn.params["dimension_numbers"]
                lhs = eqn.invars[0].aval.shape
                total += 2 * int(np.prod(eqn.outvars[0].aval.shape)) * int(np.prod([lhs[d] for d in contract]))
            for sub in jaxprs_in_params(eqn.params):
                total += flops(sub)
        return total

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "cond":
                out.append([flops(b.jaxpr) for b in eqn.params["branches"]])
            for sub in jaxprs_in_params(eqn.params):
                walk(sub)

    walk(jaxpr)
    return out


def test_zigzag_gives_every_ring_device_the_same_attention_work(devices):
    # Every ring step after the first is one `cond` between the block from an earlier device and
    # the block from a later one; the device index picks the branch. Equal matmul FLOPs in both
    # branches, forward and backward, means every device does the same work at every step.
    n, (b, length, h, kvh, d) = 4, (1, 32, 4, 2, 8)
    q, k, v = (jnp.ones((b, length, heads, d), jnp.float32) for heads in (h, kvh, kvh))
    mesh = Mesh(np.array(devices[:n]), ("sequence",))
    split = P(None, "sequence")
    local = functools.partial(context_attention, segments=None, how="ring", ways=n, kernel=_kernel("xla"))
    sharded = jax.shard_map(local, mesh=mesh, in_specs=(split,) * 3, out_specs=split, check_vma=False)
    jaxpr = jax.make_jaxpr(jax.grad(lambda q, k, v: jnp.sum(sharded(q, k, v)), (0, 1, 2)))(q, k, v)
    branches = _branch_flops(jaxpr.jaxpr)
    assert len(branches) == 2 * (n - 1)  # forward and backward, one per ring step after the first
    for pair in branches:
        assert len(pair) == 2 and pair[0] == pair[1] > 0, pair
    # Contiguous chunks (allgather) would leave device N-1 (2N-1)/N of the average work.


@pytest.mark.slow
def test_ulysses_moves_qkv_in_one_all_to_all_and_the_output_in_another(devices):
    cfg, found = _sequence_collectives(devices, "ulysses")
    m, t, n = cfg.model, cfg.train, 4
    rows = t.global_batch_size // 2
    token_bytes = rows * t.seq_len * m.resolved_head_dim * 4 // n  # per head, one device's chunk
    heads = m.num_heads + 2 * m.num_kv_heads * kv_repeats(m.num_kv_heads, n)
    per_layer = 2 * (heads + m.num_heads) * token_bytes * (n - 1) / n  # forward and backward
    assert found["all-to-all"] == (4 * m.num_layers, pytest.approx(m.num_layers * per_layer))
    assert "all-gather" not in found and "reduce-scatter" not in found


@pytest.mark.parametrize(("overrides", "message"), [
    (["model.num_heads=4", "mesh.tensor=2", "mesh.sequence=4", "parallel.context_parallel=ulysses"],
     r"parallel\.context_parallel=ulysses with mesh\.sequence=4 needs the query heads on a device \(model\.num_heads"
     r"=4 / mesh\.tensor=2 = 2\) to divide by 4 \(valid mesh\.sequence: 1, 2\)"),
    (["mesh.sequence=2", "backends.attention=cudnn"], r"backends\.attention=cudnn with parallel\.context_parallel="
                                                      r"allgather.*valid: backends\.attention=pallas, xla or auto"),
    (["mesh.sequence=4", "parallel.context_parallel=ring", "train.seq_len=12"],
     r"train\.seq_len=12 with parallel\.context_parallel=ring over mesh\.sequence=4.*valid: a multiple of 8"),
    (["mesh.sequence=2", "mesh.pipeline=2", "parallel.context_parallel=ring", "parallel.pipeline_microbatches=2"],
     r"parallel\.context_parallel=ring with mesh\.pipeline=2.*wrong values.*valid: parallel\.context_parallel="
     r"allgather or ulysses with a pipeline, or mesh\.pipeline=1"),
    (["mesh.sequence=2", "mesh.rules.activations.length=[]"], r"mesh\.rules\.activations\.length=\[\] with "
                                                               r"mesh\.sequence=2.*valid: \[sequence\]"),
])
def test_layouts_context_parallelism_cannot_run_are_refused(devices, overrides, message):
    cfg = load_config(None, [*TINY, "mesh.fsdp=-1", *overrides])
    with pytest.raises(ConfigError, match=message):
        Engine.build(cfg, devices)


def test_the_cli_refuses_ulysses_heads_that_do_not_divide(capsys):
    code, _, err = main_in_process("train", "configs/tiny.yaml", "model.num_heads=4", "mesh.fsdp=1", "mesh.sequence=4",
                                   "parallel.context_parallel=ulysses", "train.steps=1", capsys=capsys)
    assert code == 2 and "Traceback" not in err
    assert "parallel.context_parallel=ulysses" in err and "context_parallel=ring" in err


def test_the_h100_preset_passes_the_gpu_checks_and_picks_fused_attention():
    # No GPU compiler here: its layout and collectives are held by the golden case on 64 CPU devices.
    cfg = load_config(ROOT / "configs" / "llama3-8b_128k_h100.yaml")
    sizes = cfg.mesh.sizes()
    assert math.prod(sizes.values()) == 64 and sizes["sequence"] == 8 and cfg.mesh.dcn.fsdp == 8
    check_layout(cfg, sizes, platform="gpu")
    m, n = cfg.model, sizes["sequence"]
    local = lambda heads: (1, cfg.train.seq_len, heads // n, m.resolved_head_dim)  # Ulysses: whole sequences
    chosen = lambda documents: resolve_backends(m, cfg.backends, "gpu", local(m.num_heads), local(m.num_kv_heads),
                                                documents=documents, context="ulysses", sequence=n).attention
    assert chosen(False) == "cudnn" and chosen(True) == "pallas"
    with pytest.raises(ConfigError, match=r"backends\.attention=cudnn with parallel\.context_parallel=ring"):
        check_layout(load_config(ROOT / "configs" / "llama3-8b_128k_h100.yaml",
                                 ["parallel.context_parallel=ring", "backends.attention=cudnn"]), sizes, "gpu")
