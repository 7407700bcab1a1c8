"""The training engine: sharded initialisation and one jitted, exactly-specified train step.

Everything static about a run (mesh, layout, model graph, optimizer, shardings) is built
once in `Engine.build`; the step itself is a pure function of (state, batch).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from spmd_train.config.checks import check_layout
from spmd_train.config.pipeline_keys import check_pipeline
from spmd_train.config.precision_schema import matmul_mode, moment_dtype
from spmd_train.config.schema import Config
from spmd_train.data.batch import Batch, as_batch
from spmd_train.errors import ConfigError
from spmd_train.mesh import build_mesh
from spmd_train.models.param_specs import in_layer_stack
from spmd_train.models.remat import remat_of
from spmd_train.models.transformer import Transformer
from spmd_train.ops import cross_entropy
from spmd_train.ops.matmul_mode import use_matmul
from spmd_train.parallel import Backends, resolve_backends
from spmd_train.parallel.gradients import loss_and_grads
from spmd_train.parallel.pipeline_plan import PipelinePlan
from spmd_train.sharding.arithmetic import local_shape, rows_per_device
from spmd_train.sharding.constrain import use_layout
from spmd_train.sharding.layout import Layout
from spmd_train.tpu_flags import tpu_flags_in_effect
from spmd_train.train.balance import (
    balance_vectors,
    bias_metrics,
    router_biases_on_device,
    update_router_bias,
    without_bias_updates,
)
from spmd_train.train.checkpoint import layout_meta
from spmd_train.train.fingerprint import fingerprint
from spmd_train.train.guards import OVERFLOW, GuardState, advance, all_finite, init_guard, judge, keep_if
from spmd_train.train.inputs import model_inputs, mtp_inputs, with_loss_weights
from spmd_train.train.loss_scale import LossScaleState, adjust, unscale
from spmd_train.train.memory_fit import check_state_fits, describe_run, device_bytes_per_device
from spmd_train.train.offload import (
    OffloadPlan,
    check_host_memory,
    clipper,
    grads_on_host,
    params_on_host,
    params_to_device,
    plan_offload,
    streamed_norm,
    streamed_update,
    to_device,
)
from spmd_train.train.optimizer import lr_schedule, make_optimizer, opt_state_shardings
from spmd_train.train.pipelined import chunk_depths, layer_order, model_rows, pipeline_plan, pipeline_value_and_grad


class TrainState(NamedTuple):
    """What changes from step to step: the step count, parameters, optimizer state and the step guards."""

    step: jax.Array
    """Batches consumed (applied or skipped steps); the optimizer's own count holds the applied ones."""
    params: Any
    opt_state: Any
    guard: GuardState


@dataclass(frozen=True)
class Engine:
    """A model, a mesh and an optimizer bound together with their shardings."""

    cfg: Config
    mesh: Mesh
    layout: Layout
    backends: Backends
    """The implementations chosen for this platform and mesh (attention, kernel blocks, experts)."""
    graphdef: nnx.GraphDef
    logical: Any
    """Pure dict of logical PartitionSpecs, one per parameter."""
    param_shapes: Any
    tx: optax.GradientTransformation
    schedule: optax.Schedule
    state_shardings: TrainState
    batch_sharding: NamedSharding
    block_graphdef: nnx.GraphDef
    plan: PipelinePlan | None = None
    """The pipeline program when mesh.pipeline > 1."""
    layer_order: np.ndarray | None = None
    """Model layer of each stored row of the layer stack, when it is not the identity (interleaved 1F1B)."""
    state_bytes_per_device: int = 0
    """Parameters, gradients and optimizer state one device stores (from shapes and shardings)."""
    offload: OffloadPlan | None = None
    """Where offload.optimizer keeps the optimizer state and how it streams (None: on the device)."""
    stream_tx: optax.GradientTransformation | None = None
    """With `offload`: `tx` without its clipping, which the step applies slice by slice from the whole gradient's
    norm (`train.offload.clipper`)."""

    @classmethod
    def build(cls, cfg: Config, devices: list[jax.Device] | None = None) -> Engine:
        """Resolve the mesh and layout for `cfg` on `devices` (default: all) and prepare the step.

        Process set-up (simulated devices, the distributed runtime) is the entry points' job: the
        CLI, `Trainer` and `describe` do it before the first device is looked at.
        """
        mesh = build_mesh(cfg.mesh, devices)
        sizes = dict(mesh.shape)
        check_layout(cfg, sizes, mesh.devices.flat[0].platform)
        if sizes["pipeline"] > 1:
            check_pipeline(cfg, sizes, rows_per_device(cfg, sizes))
        layout = Layout.from_config(cfg, mesh)
        backends = _backends(cfg, layout)
        abstract = nnx.eval_shape(lambda: Transformer(cfg.model, rngs=nnx.Rngs(cfg.train.seed), backends=backends))
        graphdef, abstract_state = nnx.split(abstract)
        block_graphdef = nnx.split(abstract.blocks)[0]
        logical = nnx.to_pure_dict(
            jax.tree.map(
                lambda v: v.get_metadata()["logical_axes"], abstract_state,
                is_leaf=lambda x: isinstance(x, nnx.Variable)
            )
        )
        shapes = nnx.to_pure_dict(abstract_state)
        plan = order = None
        if sizes["pipeline"] > 1:
            plan = pipeline_plan(cfg, sizes)
            order = layer_order(cfg.model.stack_rows, sizes["pipeline"], cfg.parallel.virtual_stages,
                                plan.schedule.placement, chunk_depths(cfg, sizes["pipeline"]))
            if order.size == cfg.model.stack_rows and (order == np.arange(order.size)).all():
                order = None
            elif order.size > cfg.model.stack_rows:  # uneven stages: every device stores its longest chunk's rows
                shapes = {**shapes, "blocks": jax.tree.map(
                    lambda a: jax.ShapeDtypeStruct((order.size, *a.shape[1:]), a.dtype), shapes["blocks"])}
        tx = make_optimizer(cfg.optim, cfg.train.steps, logical, cfg.precision)
        param_sh = layout.param_shardings(logical, shapes)
        if cfg.offload.params:  # the layer stack in host memory (`models.transformer.fetched` brings each layer in)
            param_sh = params_on_host(param_sh)
        grad_sh = layout.grad_shardings(logical, shapes)
        opt_shapes = jax.eval_shape(tx.init, shapes)
        opt_sh = opt_state_shardings(tx, opt_shapes, layout, logical, shapes)
        offload = stream_tx = None
        check_host_memory(cfg, mesh.devices.flat[0])
        if cfg.offload.optimizer_share:
            rows = cfg.model.stack_rows if order is None else int(order.size)
            offload = plan_offload(cfg, tx, opt_shapes, opt_sh, shapes, layout.opt_shardings(logical, shapes), rows,
                                   param_sh, grad_sh)
            opt_sh = offload.stored
            stream_tx = make_optimizer(cfg.optim, cfg.train.steps, logical, cfg.precision, clip=False)
        replicated = NamedSharding(mesh, P())
        guard_sh = jax.tree.map(lambda _: replicated, jax.eval_shape(lambda: init_guard(cfg.train)))
        state_sh = TrainState(step=replicated, params=param_sh, opt_state=opt_sh, guard=guard_sh)
        # Before anything compiles: XLA aborts the process on a state of absurd size.
        # What the device holds: offload's host arrays left out (offload.params's stack gradients are made in host
        # memory too, where autodiff keeps a host input's gradient).
        grads_stored = params_on_host(grad_sh) if cfg.offload.params else grad_sh
        need = (device_bytes_per_device(shapes, param_sh) + device_bytes_per_device(shapes, grads_stored)
                + device_bytes_per_device(opt_shapes, opt_sh))
        check_state_fits(need, mesh.devices.flat[0], describe_run(cfg, sizes), allocating=False)
        return cls(cfg=cfg, mesh=mesh, layout=layout, backends=backends, graphdef=graphdef, logical=logical,
                   param_shapes=shapes, tx=tx, schedule=lr_schedule(cfg.optim, cfg.train.steps),
                   state_shardings=state_sh, batch_sharding=layout.batch_sharding(), block_graphdef=block_graphdef,
                   plan=plan, layer_order=order, state_bytes_per_device=need, offload=offload, stream_tx=stream_tx)

    @property
    def device_param_shardings(self) -> Any:
        """The parameters' shardings in device memory (the stored ones but for offload.params's host-resident layer
        stack): what code that reads every parameter at once, as decoding does, holds them in."""
        if self.offload is None or not self.offload.host_param_bytes_per_device:
            return self.state_shardings.params
        return self.offload.params_device

    def init_state(self) -> TrainState:
        """Fresh parameters and optimizer state, created directly in their shardings.

        The values depend only on `train.seed`, never on the mesh (up to the stored order of
        the layer stack under interleaved 1F1B; see `model_params`).
        """
        return self.init_fn()

    def state_from_params(self, params: Any) -> TrainState:
        """A fresh train state around given parameters (stored layout and shardings; donated): step 0, new
        optimizer state. No random parameters are drawn, so the model is held once."""
        train_cfg = self.cfg.train

        def build(params):
            return TrainState(jnp.zeros((), jnp.int32), params, self.tx.init(params), init_guard(train_cfg))

        return jax.jit(build, out_shardings=self.state_shardings, donate_argnums=0)(params)

    @functools.cached_property
    def init_fn(self):
        """The jitted initialiser: each device computes only its own shards."""
        model_cfg, train_cfg, backends = self.cfg.model, self.cfg.train, self.backends

        order = self.layer_order

        def init():
            model = Transformer(model_cfg, rngs=nnx.Rngs(train_cfg.seed), backends=backends)
            params = nnx.to_pure_dict(nnx.state(model))
            if order is not None:
                params = _take_layers(params, order, model_cfg.stack_rows)
            return TrainState(jnp.zeros((), jnp.int32), params, self.tx.init(params), init_guard(train_cfg))

        return jax.jit(init, out_shardings=self.state_shardings)

    def fresh_guard(self) -> GuardState:
        """The step guards of a run that has taken no step, replicated (for checkpoints that predate them)."""
        return jax.jit(lambda: init_guard(self.cfg.train), out_shardings=self.state_shardings.guard)()

    @functools.cached_property
    def state_health(self):
        """Jitted: state -> (whether every parameter and optimizer value is finite, the state's fingerprint
        [leaves, 2]), reduced where the shards live; what a save records and a restore checks."""
        def health(state):
            if self.offload is not None:  # computed on the device, where the values can be read
                state = state._replace(opt_state=to_device(state.opt_state, self.offload),
                                       params=params_to_device(state.params, self.offload))
            return all_finite((state.params, state.opt_state)), fingerprint(state)

        return jax.jit(health, out_shardings=NamedSharding(self.mesh, P()))

    def abstract_batch(self) -> Batch:
        """The step's batch as ShapeDtypeStructs carrying the batch sharding: to lower or compile the step."""
        t = self.cfg.train
        rows = jax.ShapeDtypeStruct((t.global_batch_size, t.seq_len + 1), "int32", sharding=self.batch_sharding)
        return Batch(rows, rows, rows) if self.cfg.data.masks_documents else Batch(rows)

    def abstract_state(self) -> TrainState:
        """The train state as ShapeDtypeStructs carrying their shardings: to lower, compile or restore into."""
        return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                            jax.eval_shape(self.init_fn), self.state_shardings)

    def checkpoint_meta(self, step: int) -> dict[str, Any]:
        """What a checkpoint written at `step` records about this run: config, mesh, rules, shapes, layer order."""
        layout = self.layout
        meta = layout_meta(self.cfg, self.mesh, {"params": dict(layout.params), "activations": dict(layout.activations),
                                                 "zero_stage": layout.zero_stage}, self.param_shapes)
        meta["data"] = {"source": self.cfg.data.source, "next_step": step}
        meta["layer_order"] = self.stored_layer_order
        return meta

    def _matmuls(self):
        """The precision policy's matmuls (precision.matmul, fp8_scaling, reduce) for the layers traced inside."""
        pr = self.cfg.precision
        return use_matmul(matmul_mode(pr.matmul, pr.fp8_scaling), pr.reduce)

    def resolved(self) -> dict[str, Any]:
        """What the engine derived from the config (effective sharding rules, backends, the precision policy in
        effect, TPU compiler flags)."""
        pr, m = self.cfg.precision, self.cfg.model
        precision = {"params": m.param_dtype, "compute": m.compute_dtype,
                     "matmul": matmul_mode(pr.matmul, pr.fp8_scaling),
                     "moments": moment_dtype(pr.moments, pr.master, m.param_dtype), "master": pr.master,
                     "loss_scale": pr.loss_scale, "reduce": pr.reduce or m.compute_dtype}
        resolved = {"rules": self.layout.rules.to_json(), "backends": self.backends.to_json(), "precision": precision}
        if self.backends.platform == "tpu":
            resolved["tpu_flags"] = tpu_flags_in_effect()
        return resolved

    @property
    def num_params(self) -> int:
        """Total parameter count (of the model: an uneven pipeline's padding rows are not parameters)."""
        rows, stored = self.cfg.model.stack_rows, self.stored_rows
        return sum(math.prod(x.shape) // stored * rows if in_layer_stack(path) else math.prod(x.shape)
                   for path, x in jax.tree_util.tree_flatten_with_path(self.param_shapes)[0])

    @property
    def stored_rows(self) -> int:
        """Rows of the stored layer stack: the model's (`ModelConfig.stack_rows`), or more with uneven stages."""
        return self.cfg.model.stack_rows if self.layer_order is None else int(self.layer_order.size)

    @property
    def stored_row_of_model(self) -> np.ndarray:
        """For each row of the model's layer stack, the stored row that holds it."""
        if self.layer_order is None:
            return np.arange(self.cfg.model.stack_rows)
        return model_rows(self.layer_order, self.cfg.model.stack_rows)

    def model_params(self, params: Any) -> Any:
        """Stored parameters with the layer stack in model order, without padding rows (they differ under interleaved
        and V schedules, and uneven stages)."""
        if self.layer_order is None:
            return params
        return _take_layers(params, self.stored_row_of_model, self.stored_rows)

    @property
    def stored_layer_order(self) -> list[int] | None:
        """`layer_order` as a JSON-friendly list (None: model order; -1: a padding row), as checkpoints record it."""
        return None if self.layer_order is None else [int(i) for i in self.layer_order]

    def reorder_layers(self, state: TrainState, saved: list[int] | None) -> TrainState:
        """A state restored from a run that stored its layer stack in order `saved`, in this run's order."""
        n = self.cfg.model.stack_rows
        saved_order = np.arange(n) if saved is None else np.asarray(saved)
        current = np.arange(n) if self.layer_order is None else self.layer_order
        if saved_order.size != current.size:
            raise ConfigError(
                f"the checkpoint stores its layer stack in {saved_order.size} rows and this run in {current.size} "
                f"(uneven pipeline stages pad every stage to the longest): resume with the saving run's mesh.pipeline, "
                f"parallel.virtual_stages and parallel.pipeline_layers (its config.yaml), or export it with "
                "`spmd-train convert to-hf` and start a run from that with checkpoint.load_from")
        if (saved_order == current).all():
            return state
        # Row q takes the saved row holding model row current[q]; a padding row takes a saved padding row (zeros).
        source = np.where(current >= 0, model_rows(saved_order, n)[np.maximum(current, 0)], -1)
        return jax.jit(lambda s: _take_layers(s, source, current.size), out_shardings=self.state_shardings)(state)

    def loss(self, params: Any, batch: Batch | jax.Array) -> jax.Array:
        """Mean next-token cross-entropy of a `Batch` (or a bare [batch, seq_len + 1] token array), without the
        pipeline; with documents, the mean over targets inside their input's document."""
        return self.objective(params, batch)[1]["loss"]

    def objective(self, params: Any, batch: Batch | jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
        """(what training minimises, metrics): cross-entropy plus the weighted multi-token prediction and MoE router
        losses.

        Metrics: `loss` (the next-token cross-entropy alone), with model.mtp `mtp_loss` (the mean of its depths'
        cross-entropies, unweighted) and, with MoE layers (an MoE model's MTP layers after the trunk's), `aux_loss`
        and `z_loss` (unweighted, mean over MoE layers), `seq_aux_loss` when weighted, `dropped_fraction` and
        `expert_load.<i>` (max / mean of the tokens routed to each expert of MoE layer i), and `expert_counts` [MoE
        layers, E], which the train step pops: the bias update's input, and `histograms`' (`balance_vectors`).
        """
        model = nnx.merge(self.graphdef, self.model_params(params))
        inputs, targets, docs, weights = model_inputs(batch, self.backends.zigzag)
        mtp = self.cfg.model.mtp
        if mtp is None:
            logits, stats = model.forward(inputs, **docs, remat=remat_of(self.cfg.parallel))
        else:
            ahead = mtp_inputs(batch, mtp.depth, self.backends.zigzag)
            logits, mtp_logits, stats = model.forward_mtp(inputs, [a[0] for a in ahead], **docs,
                                                          remat=remat_of(self.cfg.parallel))
        with jax.named_scope("loss"):
            loss = cross_entropy(logits, targets, weights)
            total = loss
            metrics = {"loss": loss}
            if mtp is not None:
                metrics["mtp_loss"] = sum(cross_entropy(out, target, w)
                                          for out, (_, target, w) in zip(mtp_logits, ahead, strict=True)) / mtp.depth
                total = total + mtp.loss_weight * metrics["mtp_loss"]
        if not stats:
            return total, metrics
        moe = self.cfg.model.moe
        aux, z = jnp.mean(stats["aux_loss"]), jnp.mean(stats["z_loss"])
        load = stats["expert_load"]
        metrics.update(aux_loss=aux, z_loss=z, dropped_fraction=jnp.mean(stats["dropped_fraction"]))
        metrics.update({f"expert_load.{i}": r for i, r in enumerate(jnp.max(load, -1) / jnp.mean(load, -1))})
        metrics["expert_counts"] = load
        total = total + moe.router_aux_weight * aux + moe.router_z_weight * z
        if moe.seq_aux_weight > 0:
            metrics["seq_aux_loss"] = jnp.mean(stats["seq_aux_loss"])
            total = total + moe.seq_aux_weight * metrics["seq_aux_loss"]
        return total, metrics

    def step_fn(self, state: TrainState, batch: Batch | jax.Array) -> tuple[TrainState, dict[str, jax.Array]]:
        """One optimizer step (un-jitted; see `train_step`)."""
        mtp = self.cfg.model.mtp
        batch = with_loss_weights(as_batch(batch), 0 if mtp is None else mtp.depth)
        # precision.loss_scale=dynamic: the objective times the scale, so every cotangent carries it (float16's).
        scaling = isinstance(state.opt_state, LossScaleState)
        scale = state.opt_state.scale if scaling else None
        if self.plan is None:
            def scaled_objective(params, batch):
                total, metrics = self.objective(params, batch)
                return (total * scale if scaling else total), metrics

            def value_and_grad(params, batch):
                (_, metrics), grads = jax.value_and_grad(scaled_objective, has_aux=True)(params, batch)
                return metrics, grads
        else:
            value_and_grad = pipeline_value_and_grad(self.cfg, self.graphdef, self.block_graphdef, self.plan,
                                                     self.mesh, zigzag=self.backends.zigzag, loss_scale=scale)
        with use_layout(self.layout), self._matmuls():
            values, grads = loss_and_grads(
                value_and_grad, state.params, batch,
                layout=self.layout, logical=self.logical, grad_accum=self.cfg.train.grad_accum,
            )
        if scaling:
            grads = unscale(grads, scale)
        # offload.params: the host parameters' gradients are made in host memory, and stay there: their norm and the
        # update read them a slice at a time.
        host_grads = grads_on_host(self.offload)
        grad_norm = streamed_norm(grads, self.offload, self.cfg) if host_grads else optax.tree.norm(grads)
        # The schedule is indexed by applied steps: a skipped step does not advance it (nor optax's count).
        lr = self.schedule(state.step - state.guard.skipped)
        with jax.named_scope("guards"):
            # Judged from values already reduced over the mesh: the guards add no collective. A non-finite
            # router loss reaches the gradient norm; with finite gradients and learning rate, clipped
            # AdamW's update is finite (an overflowing one is still caught before any save).
            reason = judge(state.guard, values["loss"], grad_norm, self.cfg.train, jnp.isfinite(lr), loss_scale=scale)
        # Under the layout: an optimizer may place its work (Muon's whole matrices: sharding.whole_matrices).
        with jax.named_scope("optimizer"), use_layout(self.layout):
            apply = lambda params, updates: optax.apply_updates(params, without_bias_updates(updates))
            if self.offload is None:
                updates, opt_state = self.tx.update(grads, state.opt_state, state.params)
                params = apply(state.params, updates)
            else:  # a slice at a time through the device, each clipped, updated and kept or dropped in turn
                params, opt_state = streamed_update(self.stream_tx, self.offload, grads, state.opt_state,
                                                    state.params, reason == 0, apply,
                                                    clipper(grads, self.cfg, grad_norm if host_grads else None))
        counts = values.pop("expert_counts", None)  # with MoE layers
        if counts is not None and self.cfg.offload.params:  # read and moved below; stored back on the host
            params = router_biases_on_device(params)
        before_bias = params
        if counts is not None and self.cfg.model.moe.moves_bias:
            with jax.named_scope("router_bias"):
                params = update_router_bias(params, counts, self.cfg.model.moe.bias_update_rate)
        with jax.named_scope("guards"):
            if self.offload is None:
                params, opt_state = keep_if(reason == 0, (params, opt_state), (state.params, state.opt_state))
            else:  # the streamed slices were kept or dropped already: only what changed since (the router bias)
                params = keep_if(reason == 0, params, before_bias)
            guard = advance(state.guard, reason, values["loss"], grad_norm)
            if scaling:  # after keep_if: an overflowing step is skipped, and its scale still falls
                kept = adjust(state.opt_state, reason == OVERFLOW, reason == 0,
                              self.cfg.precision.loss_scale_growth_interval)
                opt_state = opt_state._replace(scale=kept.scale, good_steps=kept.good_steps)
                values["loss_scale"] = opt_state.scale
        model_rows = None if self.layer_order is None else self.stored_row_of_model
        metrics = {**values, **bias_metrics(params, model_rows), "grad_norm": grad_norm, "lr": lr,
                   "skip_reason": reason, "skipped_steps": guard.skipped, "consecutive_skips": guard.consecutive}
        if counts is not None:
            metrics["histograms"] = balance_vectors(params, counts, model_rows)
        return TrainState(state.step + 1, params, opt_state, guard), metrics

    @functools.cached_property
    def eval_step(self):
        """The jitted evaluation: (params, batch) -> mean cross-entropy, without the pipeline schedule."""

        def loss(params, batch):
            with use_layout(self.layout), self._matmuls():
                return self.loss(params, batch)

        return jax.jit(loss, in_shardings=(self.state_shardings.params, self.batch_sharding),
                       out_shardings=NamedSharding(self.mesh, P()))

    @functools.cached_property
    def train_step(self):
        """The jitted step: (state, batch) -> (state, metrics); the input state is donated."""
        replicated = NamedSharding(self.mesh, P())
        return jax.jit(
            self.step_fn,
            in_shardings=(self.state_shardings, self.batch_sharding),
            out_shardings=(self.state_shardings, replicated),
            donate_argnums=0,
        )


def _take_layers(tree: Any, index: np.ndarray, rows: int) -> Any:
    """`tree` with every layer-stack array under a `blocks` key (of `rows` rows) taken at rows `index` along axis 0;
    index -1 gives a row of zeros (an uneven pipeline's padding).

    Works on parameters and on whole train states (optimizer moments mirror the parameters;
    scalars such as step counts are left alone).
    """
    index = np.asarray(index)
    pad = index < 0

    def take(path, leaf):
        if not (in_layer_stack(path) and leaf.ndim and leaf.shape[0] == rows):
            return leaf
        taken = leaf[np.maximum(index, 0)]
        if not pad.any():
            return taken
        return jnp.where(jnp.asarray(pad).reshape(-1, *(1,) * (leaf.ndim - 1)), jnp.zeros((), leaf.dtype), taken)

    return jax.tree_util.tree_map_with_path(take, tree)



def _backends(cfg: Config, layout: Layout) -> Backends:
    """The run's implementations, from the platform of its devices and each device's attention shapes."""
    m, sizes = cfg.model, dict(layout.mesh.shape)
    rows = cfg.train.global_batch_size // cfg.train.grad_accum
    hd = m.resolved_head_dim
    q = local_shape((rows, cfg.train.seq_len, m.num_heads, hd),
                    layout.activation_spec(P("batch", "length", "heads", "head_dim")), sizes)
    kv = local_shape((rows, cfg.train.seq_len, m.num_kv_heads, hd),
                     layout.activation_spec(P("batch", "length", "kv_heads", "head_dim")), sizes)
    return resolve_backends(m, cfg.backends, layout.mesh.devices.flat[0].platform, q, kv,
                            documents=cfg.data.masks_documents, context=cfg.parallel.context_parallel,
                            sequence=sizes["sequence"])
