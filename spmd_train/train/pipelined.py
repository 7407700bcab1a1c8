"""The model's loss and gradients computed by a pipeline schedule instead of one autodiff pass.

The embedding runs before the pipeline on every stage, then any model.moe.first_k_dense layers (their rows split
over `pipeline` as well), the layer stack over `pipeline`, and the final norm, LM head and loss on the last chunk's
stage right after each microbatch's forward, so the loss equals the non-pipelined one exactly. MoE router losses
are per microbatch, as with grad accumulation.

Derivation: docs/explanation/pipeline-executor.md#the-pipelined-loss
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from spmd_train.config.pipeline_keys import equal_stages, resolved_microbatches
from spmd_train.config.schedule_facts import names_where, schedule_facts, spoken
from spmd_train.config.schema import Config
from spmd_train.errors import ConfigError
from spmd_train.models.flops import balanced_depths, moe_layer_count
from spmd_train.models.remat import remat_of
from spmd_train.models.transformer import RESIDUAL, apply_blocks, attention_kinds, layer_kind_ids
from spmd_train.ops import cross_entropy
from spmd_train.parallel.pipeline import AXIS, executor_stage, run_pipeline, stash_layout
from spmd_train.parallel.pipeline_plan import PipelinePlan, build_plan
from spmd_train.parallel.schedules import build_schedule
from spmd_train.parallel.split_backward import split_vjp
from spmd_train.sharding.arithmetic import rows_per_device
from spmd_train.sharding.constrain import active_layout, constrain, use_layout
from spmd_train.sharding.layout import Layout
from spmd_train.train.inputs import model_inputs


def pipeline_plan(cfg: Config, sizes: dict[str, int]) -> PipelinePlan:
    """The validated schedule of a run on a mesh with these axis sizes, compiled for the executor."""
    par, p = cfg.parallel, sizes["pipeline"]
    microbatches = resolved_microbatches(cfg, p, rows_per_device(cfg, sizes))
    return build_plan(build_schedule(par.pipeline_schedule, p, microbatches, par.virtual_stages))


def chunk_depths(cfg: Config, stages: int) -> list[int]:
    """Rows of the layer stack (`ModelConfig.stack_rows`: layers, or MoE groups) in each model chunk, in model order:
    parallel.pipeline_layers resolved (null, or "balanced" under zb_h1/zb_v: equal; "balanced":
    `models.flops.balanced_depths`)."""
    par, m = cfg.parallel, cfg.model
    chunks, unit = stages * par.virtual_stages, max(m.moe_every, 1)
    if equal_stages(cfg):
        return [m.stack_rows // chunks] * chunks
    layers = (balanced_depths(m, cfg.train.seq_len, chunks) if par.pipeline_layers == "balanced"
              else list(par.pipeline_layers))
    if len(set(layers)) > 1 and schedule_facts(par.pipeline_schedule).split_backward:
        raise ConfigError(
            f"parallel.pipeline_layers=[{', '.join(map(str, layers))}] gives uneven stage chunks, which "
            f"parallel.pipeline_schedule={par.pipeline_schedule} cannot run: a padded chunk's backward would not split "
            f"into B and W (valid: a fused schedule, {spoken(names_where(split_backward=False), 'or')}, or "
            "parallel.pipeline_layers=null or balanced for equal chunks)")
    return [n // unit for n in layers]


def layer_order(num_layers: int, stages: int, virtual: int, placement: str = "loop",
                depths: list[int] | None = None) -> np.ndarray:
    """Model row of each stored row of the layer stack, -1 for padding (identity for equal chunks unless
    virtual > 1); `num_layers`: the stack's rows (`ModelConfig.stack_rows`: MoE groups when model.moe.every > 1);
    `depths`: rows per model chunk (default equal, `chunk_depths`).

    Every device stores n = max(depths) rows per chunk: stored chunk j (rows j*n .. j*n+n-1) sits on device
    d = j // virtual as its local chunk k = j % virtual, which runs as model chunk k * stages + d under the "loop"
    placement (interleaved) and as d (k = 0) or 2 * stages - 1 - d (k = 1) under "v" (zb_v); its first
    depths[model chunk] rows hold that chunk's layers, the rest are padding.
    """
    chunks = stages * virtual
    depths = [num_layers // chunks] * chunks if depths is None else list(depths)
    per_chunk, starts = max(depths), np.cumsum([0, *depths])
    order = np.full(chunks * per_chunk, -1)
    for j in range(chunks):
        c = _model_chunk(j // virtual, j % virtual, stages, placement)
        order[j * per_chunk:j * per_chunk + depths[c]] = starts[c] + np.arange(depths[c])
    return order


def model_rows(order: np.ndarray, rows: int) -> np.ndarray:
    """The inverse of a stored order (`layer_order`): for each of the model's `rows` rows, the stored row holding it."""
    inverse = np.empty(rows, int)
    stored = np.nonzero(order >= 0)[0]
    inverse[order[stored]] = stored
    return inverse


def chunk_kinds_table(cfg: Config, order: np.ndarray, stages: int, virtual: int) -> np.ndarray | None:
    """[stage, local chunk, stored row(, layer of an MoE group)] -> the attention kind of the layer stored there
    (`models.transformer.layer_kind_ids`; padding rows take kind 0), or None when every layer is one kind."""
    if len(attention_kinds(cfg.model)) == 1:
        return None
    stored = layer_kind_ids(cfg.model)[np.maximum(order, 0)]
    return stored.reshape(stages, virtual, -1, *stored.shape[1:])


def chunk_rows_table(depths: list[int], stages: int, virtual: int, placement: str) -> np.ndarray:
    """[stage, local chunk] -> rows of the model chunk it runs (the rest of its stored rows are padding)."""
    return np.array([[depths[_model_chunk(d, k, stages, placement)] for k in range(virtual)] for d in range(stages)])


def _model_chunk(device: int, local: int, stages: int, placement: str) -> int:
    """The model chunk device `device` runs as its local chunk `local` (the inverse of `schedules.stage_of`)."""
    if placement == "v":
        return device if local == 0 else 2 * stages - 1 - device
    return local * stages + device


def pipeline_value_and_grad(cfg: Config, graphdef: nnx.GraphDef, block_graphdef: nnx.GraphDef, plan: PipelinePlan,
                            mesh, *, zigzag: int = 1, loss_scale: jax.Array | None = None) -> Any:
    """(params, batch) -> (metrics, gradients), run by the pipeline schedule (`zigzag`: as in `model_inputs`);
    metrics: the mean loss, and with MoE layers the router metrics `Engine.objective` reports; `loss_scale`: the
    gradients are of the objective times it (`run_pipeline`)."""
    sched = plan.schedule
    m = sched.microbatches
    depths = chunk_depths(cfg, sched.stages)
    uneven = len(set(depths)) > 1
    stage_fn = _stage_fn(cfg, block_graphdef, padded=uneven)
    moe = cfg.model.moe
    # Statistics come back in storage order (padding included); metrics name MoE layers in model order.
    order = layer_order(cfg.model.stack_rows, sched.stages, sched.virtual, sched.placement, depths)
    model_order = model_rows(order, cfg.model.stack_rows)
    rows_table = chunk_rows_table(depths, sched.stages, sched.virtual, sched.placement) if uneven else None
    kinds_table = chunk_kinds_table(cfg, order, sched.stages, sched.virtual)

    def value_and_grad(params: Any, batch: Any):
        blocks = params["blocks"]
        rest = {k: v for k, v in params.items() if k != "blocks"}
        # Shape-only stand-ins: the embedding and the head never touch the layer stack.
        absent = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), blocks)
        model = lambda rest: nnx.merge(graphdef, {**rest, "blocks": absent})
        inputs, targets, docs, weights = model_inputs(batch, zigzag)
        rows = inputs.shape[0]
        if rows % m:
            raise ValueError(f"{rows} rows per device cannot form {m} equal microbatches")

        def split(a):
            # Row r of microbatch i is row r * m + i: each device's rows split evenly, no data moves.
            a = a.reshape(rows // m, m, *a.shape[1:]).swapaxes(0, 1)
            return constrain(a, (None, *(RESIDUAL if a.ndim == 4 else ("batch", "length"))))

        first = _first_layers_layout(cfg, rows)

        def prologue(rest):
            # The embedding, then any first_k_dense layers, which are not in the stage stack: their rows split over
            # `pipeline` as well (each stage computes its share, the pipeline's input gathers them), else on every
            # stage whole.
            ends = model(rest)
            with use_layout(first):
                x = ends.first_layers(ends.embed(inputs), remat=remat_of(cfg.parallel), **docs)
            return split(x)

        x, embed_vjp = jax.vjp(prologue, rest)

        def head_fn(rest, y, target):
            target, weight = target
            return cross_entropy(model(rest).head(y), target, weight)

        # Each microbatch's documents travel with it to every stage (replicated over `pipeline`, like the tokens).
        # Keyed, not positional: ring attention without documents has the tokens' true positions alone.
        context = {name: split(a) for name, a in docs.items()} or None
        loss, block_grads, head_grads, d_x, *stats = run_pipeline(
            stage_fn, head_fn, plan, blocks, rest, x, (split(targets), None if weights is None else split(weights)),
            context=context, mesh=mesh, extras=moe is not None, chunk_rows=rows_table, chunk_kinds=kinds_table,
            loss_scale=loss_scale)
        (embed_grads,) = embed_vjp(d_x)
        grads = jax.tree.map(lambda a, b: a + b, head_grads, embed_grads)
        metrics = {"loss": loss, **(_router_metrics(stats[0], model_order) if stats else {})}
        if stats:
            # In storage order, as the bias rows are (a padding row's counts are 0: its bias does not move).
            metrics["expert_counts"] = stats[0]["expert_counts"]
        return metrics, {**grads, "blocks": block_grads}

    return value_and_grad


def _first_layers_layout(cfg: Config, rows: int) -> Layout | None:
    """The layout the model.moe.first_k_dense layers run in under a pipeline: the batch split over `pipeline` too
    (innermost, so the stages' shares gather along `pipeline` alone), when the rows divide; else the active one."""
    layout = active_layout()
    if not cfg.model.first_dense or layout is None:
        return layout
    batch = (*(a for a in layout.activations.get("batch", ()) if a != AXIS), AXIS)
    if rows % math.prod(layout.mesh.shape[a] for a in batch):
        return layout
    return replace(layout, activations={**layout.activations, "batch": batch})


def _stage_fn(cfg: Config, block_graphdef: nnx.GraphDef, padded: bool = False):
    """One chunk of stacked layers as a pure function (chunk params, x, documents) -> x, or with MoE layers
    -> (x, the chunk's share of the weighted router losses, per-layer router statistics) (`run_pipeline`'s extras).

    documents: the microbatch's {"segments", "positions"} or {"positions"} (ring attention's zigzag order), or
    none. padded: uneven stages, the function takes `rows` (how
    many leading rows of the chunk are layers; the rest are padding it skips). With full and sliding layers mixed it
    takes `kinds`, the chunk's rows of `chunk_kinds_table`."""
    model, moe = cfg.model, cfg.model.moe

    def stage_fn(chunk, x, documents=None, rows=None, kinds=None):
        docs = dict(documents or {})
        y, stats = apply_blocks(block_graphdef, chunk, x, model, remat_of(cfg.parallel), **docs,
                                rows=rows if padded else None, kinds=kinds)
        if moe is None:
            return y
        # The objective takes the mean of each router loss over all MoE layers: this chunk's layers' sum / their count.
        layers = moe_layer_count(model)
        term = (moe.router_aux_weight * jnp.sum(stats["aux_loss"]) + moe.router_z_weight * jnp.sum(stats["z_loss"]))
        load = stats["expert_load"]
        per_layer = {"aux_loss": stats["aux_loss"], "z_loss": stats["z_loss"],
                     "dropped_fraction": stats["dropped_fraction"],
                     "expert_load": jnp.max(load, -1) / jnp.mean(load, -1)}
        if moe.seq_aux_weight > 0:
            term = term + moe.seq_aux_weight * jnp.sum(stats["seq_aux_loss"])
            per_layer["seq_aux_loss"] = stats["seq_aux_loss"]
        per_layer["expert_counts"] = load  # the bias update's input and the step's per-expert histograms
        return y, term / layers, per_layer

    return stage_fn


def _router_metrics(stats: dict[str, jax.Array], model_order: np.ndarray) -> dict[str, jax.Array]:
    """The step's router metrics, as `Engine.objective` names them, from per-layer means over microbatches."""
    stats = {key: value[model_order] for key, value in stats.items()}  # model order, without padding rows
    metrics = {key: jnp.mean(stats[key]) for key in ("aux_loss", "z_loss", "dropped_fraction", "seq_aux_loss")
               if key in stats}
    load = stats["expert_load"]
    return metrics | {f"expert_load.{i}": load[i] for i in range(load.shape[0])}


def stash_bytes_per_microbatch(cfg: Config, block_graphdef: nnx.GraphDef, block_shapes: Any, plan: PipelinePlan,
                               rows_per_device: int) -> int:
    """Bytes one (microbatch, chunk) forward keeps for its backward on a device (upper bound).

    Traced without a mesh on the device's own slice of the batch, so activations split over
    `tensor` count whole: exact without tensor parallelism, an upper bound with it.
    """
    padded = len(set(chunk_depths(cfg, plan.schedule.stages))) > 1
    chunk, x, docs = _chunk_inputs(cfg, block_shapes, plan, rows_per_device)
    info = _chunk_info(cfg, chunk, padded)
    layout = stash_layout(_stage_fn(cfg, block_graphdef, padded), chunk, x, docs, extras=cfg.model.moe is not None,
                          chunk_info=info)
    return sum(math.prod(a.shape) * a.dtype.itemsize for a in layout.stashed)


def _chunk_info(cfg: Config, chunk: Any, padded: bool) -> dict[str, jax.ShapeDtypeStruct]:
    """The abstract rows of `run_pipeline`'s chunk tables a stage function takes: `rows` when stages are uneven,
    `kinds` when full and sliding layers mix."""
    info = {"rows": jax.ShapeDtypeStruct((), jnp.int32)} if padded else {}
    if len(attention_kinds(cfg.model)) > 1:
        per_chunk = jax.tree.leaves(chunk)[0].shape[0]
        info["kinds"] = jax.ShapeDtypeStruct((per_chunk, *layer_kind_ids(cfg.model).shape[1:]), jnp.int32)
    return info


def saved_bytes_per_microbatch(cfg: Config, block_graphdef: nnx.GraphDef, block_shapes: Any, plan: PipelinePlan,
                               rows_per_device: int) -> int:
    """Bytes a split-backward schedule's B hands to its W for one (microbatch, chunk) on a device (upper bound, as
    `stash_bytes_per_microbatch`): the values `split_backward.split_vjp` finds W reads."""
    chunk, x, docs = _chunk_inputs(cfg, block_shapes, plan, rows_per_device)
    info = _chunk_info(cfg, chunk, padded=False)
    stage = executor_stage(_stage_fn(cfg, block_graphdef), extras=cfg.model.moe is not None, chunk_keys=tuple(info))
    return split_vjp(stage, chunk, x, (info, docs) if info else docs, has_aux=True).saved_bytes


def _chunk_inputs(cfg: Config, block_shapes: Any, plan: PipelinePlan, rows_per_device: int) -> tuple:
    """Abstract (chunk parameters, microbatch activation, documents) of one stage chunk, traced without a mesh on
    the device's own slice of the batch, so activations split over `tensor` count whole."""
    sched = plan.schedule
    per_chunk = max(chunk_depths(cfg, sched.stages))  # stored rows per chunk: the residuals every device reserves
    chunk = jax.tree.map(lambda a: jax.ShapeDtypeStruct((per_chunk, *a.shape[1:]), a.dtype), block_shapes)
    rows = rows_per_device // sched.microbatches
    x = jax.ShapeDtypeStruct((rows, cfg.train.seq_len, cfg.model.d_model), jnp.dtype(cfg.model.compute_dtype))
    names = ("segments", "positions") if cfg.data.masks_documents else ()  # ring (positions alone) has no pipeline
    return chunk, x, {n: jax.ShapeDtypeStruct((rows, cfg.train.seq_len), jnp.int32) for n in names}
