"""Bytes per device of a training step: model state by ZeRO stage and optimizer, activations by remat policy,
the pipeline stash, MoE dispatch buffers, the logits and a workspace allowance.

Model state follows the ZeRO paper (Rajbhandari et al. 2020, §5) in the dtypes our optimizers keep; activations
follow Korthikanti et al. 2022, §4, adapted to our layer. The estimate is what is live at once, as XLA's
live-range analysis counts it, not the heap XLA assigns.

Derivation: docs/explanation/planner-model.md#memory-per-device
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import NamedTuple

from spmd_train.analysis.plan.attention_memory import attention_residual_bytes
from spmd_train.analysis.plan.candidate import (
    Candidate,
    GroupLayout,
    Spec,
    Workload,
    capacity_slots,
    live,
    microbatches,
    param_layout,
    schedule_stats,
    spec_ways,
    tables_of,
)
from spmd_train.analysis.plan.shape import ModelShape, ParamGroup
from spmd_train.analysis.plan.stages import chunk_layers, stored_rows_factor
from spmd_train.config.field_types import DTYPE_BYTES
from spmd_train.config.mesh_schema import MESH_AXES, OFFLOADS_ACTIVATIONS, RECOMPUTES_LAYER, STACKING_AXES
from spmd_train.config.offload_schema import optimizer_groups
from spmd_train.config.optimizer_facts import optimizer_facts
from spmd_train.config.resolved_rules import RuleTables

WORKSPACE_FRACTION = 0.05
"""XLA's temporaries this model does not name (fusion outputs, collective staging, kernel scratch), as a
fraction of the rest. An allowance, not a measurement: the compile stage of the planner replaces it."""


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per device, by what holds them."""

    params: float
    """Stored parameters (model.param_dtype)."""
    grads: float
    """One gradient in the ZeRO stage's gradient layout (model.param_dtype)."""
    optimizer: float
    """Optimizer state in its ZeRO layout."""
    grad_accumulator: float
    """A second gradient buffer while microbatch gradients are summed (grad_accum > 1, or pipeline stages)."""
    activations: float
    """Residuals kept for the backward pass: layers x per-layer bytes, or the pipeline stash."""
    pipeline_buffers: float
    """The pipeline's embedded inputs and their gradient for all microbatches, and one receive slot each way."""
    logits: float
    """The logits of one microbatch (vocabulary split over `tensor`) for the forward's loss: in the compute dtype
    on accelerators, whose compilers fuse the fp32 log-softmax into its reductions (libtpu's live ranges hold bf16
    logits, never fp32 ones), in fp32 on XLA:CPU."""
    logit_grads: float
    """The logits' cotangent in the compute dtype, live while the head's weight gradient waits for it."""
    head_weights: float
    """The LM head (or tied table) gathered into its compute layout at ZeRO-3."""
    head_grads: float
    """ZeRO-3: the vocabulary tables' gradient buffers in their compute layout and dtype at the end of the
    backward. Read from libtpu's live ranges (`--xla_dump_to`, `*-live-range.txt`, "peak"), benchmarks/
    plan_accuracy.py's layouts on v5p: two buffers the size of the larger table are live together (the lookup's
    scatter-added gradient and its relayout copy; or the tied table gathered and relaid out), and where the
    gradient is all-reduced whole (`comm`: the batch split over two or more axes) the smaller table's gradient
    as well (llama3-8b fsdp 8 x sequence 8: the head's and the lookup's gradients and the all-reduce's output,
    2.9 GiB of its 3.2 GiB live peak). No fp32 copy of a table is live: gradients move in the compute dtype."""
    layer_weights: float
    """Two layers' weights gathered at ZeRO-3: the one computing and the next, prefetched."""
    recompute: float
    """Full remat: one layer's residuals, rebuilt during its backward."""
    moe_dispatch: float
    """The all-to-all's send and receive slot buffers of one MoE layer."""
    workspace: float
    """`WORKSPACE_FRACTION` of the rest."""
    host_optimizer: float = 0.0
    """offload.optimizer: the optimizer state in host memory (not in `optimizer`, which keeps the rest and the two
    slices streaming through the device)."""
    host_activations: float = 0.0
    """parallel.remat=offload_layer_inputs: every layer's input in host memory (`activations` keeps two in flight)."""
    host_params: float = 0.0
    """offload.params: the layer stack's parameters in host memory (not in `params`; `layer_weights` keeps the two
    layers fetched and in use)."""
    host_grads: float = 0.0
    """offload.params: the layer stack's gradients, which autodiff makes in host memory (not in `grads`)."""

    @property
    def state(self) -> float:
        """Parameters, gradients and optimizer state."""
        return self.params + self.grads + self.optimizer

    @property
    def peak(self) -> float:
        """Estimated peak bytes per device."""
        # The saved activations are consumed by the time the tables' gradients are formed (after the layers').
        loss = self.logits + self.head_weights
        layer = self.layer_weights + self.recompute + self.moe_dispatch
        return (self.state + self.grad_accumulator + self.pipeline_buffers
                + max(self.activations + max(loss, layer), self.logit_grads + self.head_grads) + self.workspace)


def zero_paper_bytes(psi: float, devices: int, stage: int, bytes_per_param: tuple[float, float, float] = (2, 2, 12)
                     ) -> float:
    """Model-state bytes per device in the ZeRO paper (§5.1): (parameters, gradients, optimizer) bytes per parameter,
    the optimizer divided by N from stage 1, gradients from 2, parameters at 3."""
    p, g, o = bytes_per_param
    return psi * (p / (devices if stage >= 3 else 1) + g / (devices if stage >= 2 else 1)
                  + o / (devices if stage >= 1 else 1))


def korthikanti_layer_bytes(s: int, b: int, h: int, a: int, *, tensor: int = 1, sequence_parallel: bool = False
                            ) -> float:
    """Korthikanti et al. 2022 activation bytes of one GPT layer without recomputation (§4.1-4.2.2): s·b·h·(34 +
    5as/h); with tensor parallelism s·b·h·(10 + 24/t + 5as/(ht)); with sequence parallelism too s·b·h/t·(34 + 5as/h)."""
    if sequence_parallel:
        return s * b * h / tensor * (34 + 5 * a * s / h)
    return s * b * h * (10 + 24 / tensor + 5 * a * s / (h * tensor))


def optimizer_bytes(g: ParamGroup, spec: Spec, shape: dict[str, int], param_bytes: int, w: Workload) -> float:
    """Optimizer-state bytes one device holds for parameter `g` stored with `spec`: the optimizer's own figure
    (`config.optimizer_facts.OptimizerFacts.state_bytes`, optax's state) with its moments in `w.moments`
    (`train.moment_dtype`; by default the parameters' dtype, float32 over a master copy), and the float32 master copy
    itself with `w.master` (`train.master_weights`)."""
    ways = tuple(math.prod(shape[a] for a in axes) for axes in spec)
    local = math.prod(g.shape) / math.prod(ways)
    moment = DTYPE_BYTES[w.moments] if w.moments else 4 if w.master else param_bytes
    state = optimizer_facts(w.optimizer).state_bytes(g.shape, g.axes, ways, moment, w.momentum)
    if w.moments and w.momentum:  # Adafactor's momentum, float32 in optax, is cast like every moment
        state += (moment - 4) * local
    return state + (4 * local if w.master else 0.0)


def state_bytes(m: ModelShape, c: Candidate, w: Workload) -> tuple[float, float, float]:
    """(parameters, gradients, optimizer state) bytes per device, parameter by parameter."""
    return _state_bytes(m, c.sizes, c.zero_stage, w.optimizer, w.momentum, c.rules,
                        stored_rows_factor(m, c, w.seq_len), w.master, w.moments)


@functools.lru_cache(maxsize=1 << 14)
def _state_bytes(m: ModelShape, sizes: tuple[int, ...], stage: int, optimizer: str, momentum: bool,
                 rules: RuleTables | None, stored: float = 1.0, master: bool = False, moments: str | None = None,
                 stack_only: bool = False) -> tuple[float, float, float]:
    """Parameter, gradient and optimizer bytes per device (`stack_only`: the layer stack's alone, what
    offload.params keeps on the host); `stored`: the layer stack's stored rows over its model rows (uneven
    pipeline chunks are padded to the deepest, `stages.stored_rows_factor`)."""
    shape = dict(zip(MESH_AXES, sizes, strict=True))
    w = Workload(global_batch=1, seq_len=1, optimizer=optimizer, momentum=momentum, master=master, moments=moments)
    params = grads = opt = 0.0
    for g in m.params:
        if stack_only and not g.path.startswith("blocks."):
            continue
        lay = param_layout(g.axes, sizes, stage, rules)
        scale = stored if g.path.startswith("blocks.") else 1.0
        params += scale * g.numel / spec_ways(lay.params, shape) * m.param_bytes
        grads += scale * g.numel / spec_ways(lay.grads, shape) * m.param_bytes
        opt += scale * optimizer_bytes(g, lay.optimizer, shape, m.param_bytes, w)
    return params, grads, opt


def named_bytes(m: ModelShape, names: tuple[str, ...], *, tokens: float, tensor: int, sequence_parallel: bool,
                moe: bool = False) -> float:
    """Bytes of the named intermediates (`config.mesh_schema.REMAT_NAMES`) one layer makes on one device for `tokens`
    tokens, in the compute dtype: the layer input c·h (over t under sequence parallelism), queries and the heads'
    output c·H·hd/t, keys and values c·KV·hd/t each (multi-head latent attention names none of these), a dense MLP's
    gate, up and gated product c·f/t each (an MoE layer's experts name none)."""
    c, hd = m.compute_bytes, m.head_dim
    mla = m.latent_width > 0
    per = {"layer_input": c * m.d_model / (tensor if sequence_parallel else 1),
           "query": 0.0 if mla else c * m.num_heads * hd / tensor,
           "key": 0.0 if mla else c * m.num_kv_heads * hd / tensor,
           "value": 0.0 if mla else c * m.num_kv_heads * hd / tensor,
           "attention_out": 0.0 if mla else c * m.num_heads * hd / tensor}
    for n in ("mlp_gate", "mlp_up", "mlp_hidden"):
        per[n] = 0.0 if moe else c * m.d_ff / tensor
    return tokens * sum(per[n] for n in names)


def layer_activation_bytes(m: ModelShape, policy: str, *, tokens: float, context: int, tensor: int,
                           sequence_parallel: bool, attention: str, moe: bool = False, slots: float = 0.0,
                           scheme: str | None = None, ways: int = 1) -> float:
    """Bytes one layer keeps for its backward on one device, for `tokens` tokens of `context` keys each
    (`scheme`, `ways`: the context-parallel scheme and the `sequence` size; attention's share is
    `attention_memory.attention_residual_bytes`; docs/explanation/planner-model.md lists it by scheme).

    Per token, with c = compute bytes, h = d_model, H/KV query/K-V heads of width hd, f = d_ff, t = tensor
    (heads, d_ff and the vocabulary split over it; the residual-stream terms R too under sequence parallelism):
    - none: R·2·(8h + c·h + 8) for the two RMSNorms (fp32 input and normalised copies, the cast output, the
      mean square and rsqrt) + c·(2H + 2KV)·hd/t (q, k, v and the attention output) + 6·c·f/t (SwiGLU: gate,
      up, their sigmoid, silu and product pieces); attention adds 4·H/t (log-sum-exp) with a flash kernel, or
      XLA's (4 + c)·H·context/t (fp32 probabilities and their cast) + 8·H/t (row max and sum);
    - save_matmuls (dots_saveable): the matmul outputs q, k, v, the layer input and attention output
      projection (R·2·c·h), gate and up (2·c·f/t); with XLA's attention also its scores (4·H·context/t) and
      output (c·H·hd/t). A flash kernel is not a dot: it is rerun in the backward pass;
    - save_matmuls_no_batch: as save_matmuls with a flash kernel (attention's dots have batch dimensions);
    - full: the layer input, R·c·h.
    An MoE layer's MLP (E·C capacity slots on the device, `slots`, for `tokens` tokens) keeps instead, under
    none: the fp32 router input and logits, the routing bookkeeping and the fp32 per-choice outputs it combines
    (4h + 4E + 16 + 25k + 4·k·h per token), two h-wide and six f_e/t-wide slot buffers (c·slots·(2h + 6·f_e/t));
    under save_matmuls the logits (4E), the expert inputs and gate/up outputs (c·slots·(h + 2·f_e/t)); under
    save_matmuls_no_batch the logits only (the expert matmuls are batched over experts); shared experts as a
    dense SwiGLU for the shared experts. These are the residuals jax.vjp keeps (tests compare them with a traced stage).
    """
    c, h, f = m.compute_bytes, m.d_model, m.d_ff
    r = tensor if sequence_parallel else 1
    if policy in RECOMPUTES_LAYER:  # the layer's input (in host memory under offload_layer_inputs)
        return tokens * c * h / r
    attn = attention_residual_bytes(m, policy, heads=m.num_heads / tensor, kv=m.num_kv_heads / tensor,
                                    context=context, attention=attention, scheme=scheme, ways=ways)
    per_token = (2 * (8 * h + c * h + 8) if policy == "none" else 2 * c * h) / r + attn
    wide = 6 if policy == "none" else 2
    if not moe:
        return tokens * (per_token + wide * c * f / tensor)
    e, k, fe = m.num_experts, m.experts_per_token, m.moe_d_ff
    shared = wide * c * fe * m.num_shared_experts / tensor
    if policy == "none":
        routing, slot_width = 4 * h + 4 * e + 16 + 25 * k + 4 * k * h, 2 * h + 6 * fe / tensor
    else:  # the router's logits are a dot; the experts' matmuls are batched over experts (no_batch drops them)
        routing, slot_width = 4 * e, (h + 2 * fe / tensor if policy == "save_matmuls" else 0.0)
    return tokens * (per_token + routing + shared) + slots * c * slot_width


def context_scheme(c: Candidate) -> str | None:
    """The context-parallel scheme attention's memory depends on: None with the sequence on one device."""
    return c.context_parallel if c.sequence > 1 else None


def estimate_memory(m: ModelShape, c: Candidate, w: Workload) -> MemoryEstimate:
    """Per-device memory of candidate `c` running workload `w` on model `m`."""
    return _assemble(_state_part(m, c.sizes, c.zero_stage, c.rules, w, stored_rows_factor(m, c, w.seq_len),
                                 c.offload), _activation_part(m, c, w, c.grad_accum))


class MemoryModel:
    """`estimate_memory` for many candidates of one model and workload, each part computed once per the few fields
    it reads: the search asks for a quarter of a million peaks, the ZeRO stage and the slow-link placement change
    no activation term (the latter no term at all), and the context scheme only attention's, where `sequence` > 1."""

    def __init__(self, m: ModelShape, w: Workload):
        self.m, self.w = m, w
        self._states: dict[tuple, _StatePart] = {}
        self._activations: dict[tuple, _ActivationPart] = {}

    def peak(self, c: Candidate, grad_accum: int) -> float:
        """`estimate_memory(m, c, w).peak` for `c` with `grad_accum` in place of its own, without building either."""
        return _peak(self._state(c), self._activation(c, grad_accum))

    def estimate(self, c: Candidate) -> MemoryEstimate:
        """`estimate_memory(m, c, w)`, from the memoized parts."""
        return _assemble(self._state(c), self._activation(c, c.grad_accum))

    def state_on_device(self, c: Candidate) -> float:
        """Parameter, gradient and optimizer-state bytes `c` keeps on each device (the offloaded share's streaming
        slices included)."""
        part = self._state(c)
        return part.params + part.grads + part.optimizer

    def _state(self, c: Candidate) -> _StatePart:
        stored = stored_rows_factor(self.m, c, self.w.seq_len)
        key = (c.sizes, c.zero_stage, c.rules, stored, c.offload)
        part = self._states.get(key)
        if part is None:
            part = self._states[key] = _state_part(self.m, c.sizes, c.zero_stage, c.rules, self.w, stored, c.offload)
        return part

    def _activation(self, c: Candidate, grad_accum: int) -> _ActivationPart:
        # Every field `_activation_part` reads: not the ZeRO stage or the slow-link factors.
        key = (c.sizes, c.remat, c.sequence_parallel, context_scheme(c), c.pipeline_schedule, c.pipeline_microbatches,
               c.virtual_stages, grad_accum, c.rules)
        part = self._activations.get(key)
        if part is None:
            part = self._activations[key] = _activation_part(self.m, c, self.w, grad_accum)
        return part


class _StatePart(NamedTuple):
    """The terms the mesh and the ZeRO stage alone decide."""

    params: float
    grads: float
    optimizer: float
    head_weights: float
    head_grads: float
    layer_weights: float
    host_optimizer: float = 0.0
    host_params: float = 0.0
    host_grads: float = 0.0


class _ActivationPart(NamedTuple):
    """The terms the mesh, remat, sequence parallelism, the pipeline and the accumulation decide."""

    accumulates: bool
    """Whether a second gradient buffer (`MemoryEstimate.grad_accumulator`) is there."""
    activations: float
    pipeline_buffers: float
    logits: float
    logit_grads: float
    recompute: float
    moe_dispatch: float
    host_activations: float = 0.0


def _state_part(m: ModelShape, sizes: tuple[int, ...], stage: int, rules: RuleTables | None, w: Workload,
                stored: float = 1.0, offload: float = 0.0) -> _StatePart:
    params, grads, opt = _state_bytes(m, sizes, stage, w.optimizer, w.momentum, rules, stored, w.master, w.moments)
    head, lookup, whole, layer_w = _gathered_weights(m, sizes, stage, w.xla_cpu, rules)
    tables = 2 * max(head, lookup) + (min(head, lookup) if whole else 0.0)
    host = opt * offload
    if host:
        # offload.optimizer (`train.offload`): the device keeps the rest, and in the update two slices of the
        # offloaded state (one updating, the next arriving), after the activations are gone.
        opt = opt - host + 2 * host / optimizer_groups(w.offload_groups, m.num_layers)
    host_params = host_grads = 0.0
    if w.offload_params:
        # offload.params: the layer stack and its gradients on the host; the layer loop fetches a layer at a time,
        # one in use and the next arriving (gathered at ZeRO-3, where `layer_w` already holds two; whole below it).
        host_params, host_grads, _ = _state_bytes(m, sizes, stage, w.optimizer, w.momentum, rules, stored, w.master,
                                                  w.moments, stack_only=True)
        params, grads = params - host_params, grads - host_grads
        if not layer_w:
            layer_w = 2 * host_params / m.num_layers
    return _StatePart(params, grads, opt, head, tables, layer_w, host, host_params, host_grads)


def _activation_part(m: ModelShape, c: Candidate, w: Workload, grad_accum: int) -> _ActivationPart:
    rows = w.global_batch // (grad_accum * c.batch_ways)  # `rows_per_device` at this accumulation
    micro = microbatches(c, rows)
    tokens = rows / micro * w.seq_len / c.length_ways  # one microbatch's tokens on a device
    slots = m.num_experts * capacity_slots(m, w, tokens) if m.moe_layers else 0.0
    scheme = context_scheme(c)
    kw = {"tokens": tokens, "context": w.seq_len, "tensor": c.tensor, "sequence_parallel": c.sequence_parallel,
          "attention": w.attention, "scheme": scheme, "ways": c.sequence}
    named = {"tokens": tokens, "tensor": c.tensor, "sequence_parallel": c.sequence_parallel}
    if c.remat == "names":  # what remat_save keeps on the device (remat_offload's below)
        dense = named_bytes(m, w.remat_save, **named)
        moe = named_bytes(m, w.remat_save, moe=True, **named) if m.moe_layers else 0.0
    else:
        dense = layer_activation_bytes(m, c.remat, **kw)
        moe = layer_activation_bytes(m, c.remat, moe=True, slots=slots, **kw) if m.moe_layers else 0.0
    # Kept once per layer stack, not per layer: RoPE's fp32 cos/sin tables [s, hd/2] (the q and k broadcasts too
    # under 'none') and, with XLA's attention under 'none', the causal mask [rows, H, s, context] as bool and fp32
    # (`ring` and `allgather` mask each block inside their loops: `attention_residual_bytes` counts it there).
    local = w.seq_len // c.length_ways
    per_stack = (8 if c.remat == "none" else 4) * m.head_dim * local
    if w.attention == "xla" and c.remat == "none" and scheme in (None, "ulysses"):
        per_stack += tokens * m.num_heads / c.tensor * w.seq_len * 5
    def over_layers(dense: float, moe: float) -> float:
        """A dense and an MoE layer's bytes summed over the model's layers. Multi-token prediction: each module is
        one more layer (an MoE one in an MoE model) after the trunk."""
        trunk = (m.num_layers - m.moe_layers) * dense + m.moe_layers * moe
        return trunk + ((m.mtp_depth - m.mtp_moe_layers) * dense + m.mtp_moe_layers * moe)

    layers = over_layers(dense, moe)
    stream = tokens * m.d_model * m.compute_bytes / (c.tensor if c.sequence_parallel else 1)  # one microbatch
    if c.pipeline > 1:
        _, _, in_flight = schedule_stats(c.pipeline_schedule, c.pipeline, micro, c.virtual_stages)
        # The first_k_dense layers run before the stages, each stage on 1/pipeline of every microbatch's rows, and
        # keep their residuals through the step.
        first = m.first_dense * dense
        # A stage's chunk holds its share of the stack's layers; with uneven chunks the deepest one's.
        deepest = max(chunk_layers(m, c, w.seq_len)) / len(m.staged)
        activations = in_flight * ((layers - first) * deepest + per_stack) + first * micro / c.pipeline
        pipeline_buffers = (2 * micro + 2) * stream
    else:
        activations, pipeline_buffers = layers + per_stack, 0.0
    host_activations = 0.0
    if c.remat in OFFLOADS_ACTIVATIONS and c.pipeline == 1:
        # Every layer's input in host memory, two in flight on the device. (A pipeline stage's stash is counted as
        # full remat's: what libtpu offloads of it is not measured.)
        host_activations = layers
        activations = activations - layers + 2 * layers / (m.num_layers + m.mtp_depth)
    elif c.remat == "names" and w.remat_offload and c.pipeline == 1:
        # remat_offload's intermediates of every layer in host memory, two layers' in flight on the device.
        host_activations = over_layers(named_bytes(m, w.remat_offload, **named),
                                       named_bytes(m, w.remat_offload, moe=True, **named))
        activations += 2 * host_activations / (m.num_layers + m.mtp_depth)
    logit_grads = tokens * m.vocab_size / c.tensor * m.compute_bytes
    # Each multi-token prediction module's head keeps its own logits until the backward pass, beside the main head's;
    # the backward takes the heads' cotangents one at a time.
    logits = (1 + m.mtp_depth) * (tokens * m.vocab_size / c.tensor * 4 if w.xla_cpu else logit_grads)
    recompute = 0.0
    if c.remat in RECOMPUTES_LAYER:  # the largest layer's residuals, rebuilt for its backward
        recompute = layer_activation_bytes(m, "none", **kw)
        if m.moe_layers:
            recompute = max(recompute, layer_activation_bytes(m, "none", moe=True, slots=slots, **kw))
    dispatch = 2 * slots * m.d_model * m.compute_bytes if m.moe_layers and c.expert > 1 else 0.0
    return _ActivationPart(grad_accum > 1 or c.pipeline > 1, activations, pipeline_buffers, logits, logit_grads,
                           recompute, dispatch, host_activations)


def _rest(s: _StatePart, a: _ActivationPart) -> float:
    """Every term but the workspace, added in `MemoryEstimate.peak`'s order (so that a peak is the same float)."""
    accumulator = s.grads if a.accumulates else 0.0
    return (s.params + s.grads + s.optimizer + accumulator + a.pipeline_buffers
            + max(a.activations + max(a.logits + s.head_weights, s.layer_weights + a.recompute + a.moe_dispatch),
                  a.logit_grads + s.head_grads))


def _peak(s: _StatePart, a: _ActivationPart) -> float:
    rest = _rest(s, a)
    return rest + WORKSPACE_FRACTION * rest


def _assemble(s: _StatePart, a: _ActivationPart) -> MemoryEstimate:
    return MemoryEstimate(params=s.params, grads=s.grads, optimizer=s.optimizer,
                          grad_accumulator=s.grads if a.accumulates else 0.0, activations=a.activations,
                          pipeline_buffers=a.pipeline_buffers, logits=a.logits, logit_grads=a.logit_grads,
                          head_weights=s.head_weights,
                          head_grads=s.head_grads, layer_weights=s.layer_weights, recompute=a.recompute,
                          moe_dispatch=a.moe_dispatch, workspace=WORKSPACE_FRACTION * _rest(s, a),
                          host_optimizer=s.host_optimizer, host_activations=a.host_activations,
                          host_params=s.host_params, host_grads=s.host_grads)


@functools.lru_cache(maxsize=1 << 14)
def _gathered_weights(m: ModelShape, sizes: tuple[int, ...], stage: int, xla_cpu: bool, rules: RuleTables | None
                      ) -> tuple[float, float, bool, float]:
    """(LM head, untied lookup table) bytes in the compute layout, which ZeRO-3 gathers from the stored shards;
    whether their gradients are reduced whole (`comm._zero_terms`: the batch over two or more axes, or XLA:CPU's
    reduce-scatter as an all-reduce); two layers' bytes in the compute layout."""
    shape = dict(zip(MESH_AXES, sizes, strict=True))
    if stage < 3 or shape["fsdp"] * shape["sequence"] == 1:
        return 0.0, 0.0, False, 0.0
    head, lookup, per_layer = 0.0, 0.0, {}
    acts = tables_of(sizes, rules).activations
    batch = {*acts.get("batch", ()), *acts.get("length", ())}
    whole = xla_cpu
    for g in m.params:
        lay: GroupLayout = param_layout(g.axes, sizes, stage, rules)
        if g.path == "lm_head" or (g.path == "embedding" and m.tie_embeddings):
            head += g.numel / math.prod(shape[a] for a in lay.compute) * m.compute_bytes
            whole |= not m.moe_layers and len(live(batch - set(lay.compute), shape)) > 1
        elif g.path == "embedding":
            lookup += g.numel / math.prod(shape[a] for a in lay.compute) * m.compute_bytes
        elif g.path.startswith("blocks."):
            # One layer of the stack, split as it computes (the stacking axes' `pipeline` split is not a layer's).
            stacked = math.prod(n for n, a in zip(g.shape, g.axes, strict=True) if a in STACKING_AXES)
            split = math.prod(shape[a] for a in lay.compute if a != "pipeline")
            block = g.path.rsplit(".", 2)[0]  # blocks, blocks.dense or blocks.moe
            per_layer[block] = per_layer.get(block, 0.0) + g.numel / stacked / split * m.compute_bytes
    return head, lookup, whole, 2 * max(per_layer.values(), default=0.0)
