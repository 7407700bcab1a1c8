"""Collective bytes each device sends per step, per operation and mesh axes: a list of `CommTerm`s.

Bytes are the bandwidth-optimal ring costs `analysis.collectives` counts. One function per form of parallelism:
`zero_terms` (data parallelism and ZeRO, with the ways an accelerator's compiler departs from XLA:CPU's
partitioning), `tensor_terms`, `pipeline_terms`, `expert_terms` and `context_terms`.

Derivation: docs/explanation/planner-model.md#collective-bytes
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from spmd_train.analysis.plan.candidate import (
    Candidate,
    Workload,
    capacity_slots,
    group_layout,
    live,
    microbatches,
    param_layout,
    residual_ways,
    rows_per_device,
    schedule_stats,
    spec_ways,
    tables_of,
    ways,
)
from spmd_train.analysis.plan.shape import ModelShape
from spmd_train.config.field_types import DTYPE_BYTES
from spmd_train.config.matrix_moves import local_matrices, whole_matrix_bytes, whole_matrix_moves
from spmd_train.config.mesh_schema import MESH_AXES, RECOMPUTES_LAYER, STACKING_AXES
from spmd_train.config.optimizer_facts import muon_dimensions, newton_schulz_flops
from spmd_train.config.precision_schema import sums_in_reduce_dtype, takes_quantized
from spmd_train.config.resolved_rules import RuleTables
from spmd_train.ops.capacity import device_capacity
from spmd_train.parallel.head_groups import kv_repeats

LOOKUP_ONLY = "embedding"
"""The table an untied model only looks up: computing with it needs one gather per microbatch, not two."""


@dataclass(frozen=True)
class CommTerm:
    """One kind of collective over one set of mesh axes: bytes each device sends per step, in `count` launches."""

    op: str
    """all-gather, reduce-scatter, all-reduce, all-to-all or collective-permute."""
    axes: tuple[str, ...]
    bytes: float
    count: int
    purpose: str
    """weights (ZeRO-3 gathers), table-reshard, grad-scatter, grad-gather, grad-reduce, update-gather, tensor,
    pipeline, expert, context or optimizer (Muon's moves): what the timing model's overlap rule looks at."""


def _fraction(n: int) -> float:
    return (n - 1) / n


def zero_terms(m: ModelShape, c: Candidate, xla_cpu: bool = False, fp8: bool = False,
               reduce_bytes: int = 0) -> list[CommTerm]:
    """Parameter traffic of data parallelism and ZeRO, parameter by parameter: as an accelerator's compiler
    partitions it, or with `xla_cpu` as XLA:CPU does, which is the algorithm's floor `describe` shows
    (`analysis.zero_floor`, docs/explanation/planner-model.md#collective-bytes). `fp8` (precision.matmul=fp8): the
    weights `takes_quantized` names are gathered in one byte an element. `reduce_bytes` (precision.reduce; 0: the
    compute dtype's): the bytes an element of the gradients `sums_in_reduce_dtype` names are summed in."""
    out = []
    accumulates = c.grad_accum > 1 or c.pipeline > 1
    found = _zero_terms(m, c.sizes, c.zero_stage, xla_cpu, accumulates, c.rules, fp8, reduce_bytes)
    for (op, axes, purpose), (per_micro, launches, once, once_launches) in found:
        out.append(CommTerm(op, axes, per_micro * c.grad_accum + once, launches * c.grad_accum + once_launches,
                            purpose))
    return out


def policy_zero_terms(m: ModelShape, c: Candidate, w: Workload, xla_cpu: bool | None = None) -> list[CommTerm]:
    """`zero_terms` under w's precision policy (FP8 gathers, precision.reduce's bytes), partitioned as w.xla_cpu says
    unless `xla_cpu` is given."""
    return zero_terms(m, c, w.xla_cpu if xla_cpu is None else xla_cpu, w.matmul == "fp8",
                      DTYPE_BYTES[w.reduce] if w.reduce else 0)


@functools.lru_cache(maxsize=1 << 14)
def _zero_terms(m: ModelShape, sizes: tuple[int, ...], stage: int, xla_cpu: bool, accumulates: bool,
                rules: RuleTables | None, fp8: bool = False, reduce_bytes: int = 0) -> tuple:
    """((op, axes, purpose), (bytes per microbatch, launches per microbatch, bytes per step, launches per step))."""
    shape, cb = dict(zip(MESH_AXES, sizes, strict=True)), m.compute_bytes
    acts = tables_of(sizes, rules).activations
    batch = {*acts.get("batch", ()), *acts.get("length", ())}  # what the gradients are summed over
    # Replica axes the step cannot reduce by hand (`parallel.gradients`: `expert` splits an MoE model's experts).
    automatic = {"expert"} if m.moe_layers else set()
    terms: dict = {}

    def add(op, axes, purpose, per_micro=0.0, launches=0, once=0.0, once_launches=0):
        old = terms.get((op, axes, purpose), (0.0, 0, 0.0, 0))
        terms[op, axes, purpose] = (old[0] + per_micro, old[1] + launches, old[2] + once, old[3] + once_launches)

    for g in m.params:
        lay = param_layout(g.axes, sizes, stage, rules)
        compute = lay.compute
        stored = {a for dim in lay.params for a in dim}
        grads = {a for dim in lay.grads for a in dim}
        opt = {a for dim in lay.optimizer for a in dim}
        slice_bytes = g.numel / ways(compute, shape) * cb
        # The gradient's sum: in precision.reduce's dtype where `dense` computes it (`models.layers._reduced_dense`).
        rb = reduce_bytes if reduce_bytes and not g.lookup_only and sums_in_reduce_dtype(g.axes) else cb
        grad_bytes = slice_bytes / cb * rb
        layers = _stacked(g)
        outside = not g.path.startswith("blocks.")  # outside the layer stack: tables, the final norm
        gathered = live(stored - compute, shape)
        if gathered:
            gathers = 1 if (g.path == LOOKUP_ONLY and g.lookup_only) or (outside and not xla_cpu) else 2
            moved = slice_bytes / cb if fp8 and takes_quantized(g.axes) else slice_bytes  # e4m3: one byte an element
            add("all-gather", gathered, "weights", gathers * moved * _fraction(ways(gathered, shape)),
                gathers * layers)
        rows = g.shape[0] % shape["fsdp"] == 0
        if g.path == LOOKUP_ONLY and "fsdp" in gathered and rows and not compute & set(lay.params[0]) and not xla_cpu:
            # The lookup's table, split on its width, is first re-split by rows over `fsdp` (an all-to-all of the
            # stored shard) where its rows divide evenly (none at fsdp 512 for llama3-8b's 128,256): once in the
            # compute dtype when tied, and back for the gradient when not.
            n, nbytes = (1, cb) if not g.lookup_only else (2, m.param_bytes)
            shard = g.numel / ways(stored, shape) * nbytes
            add("all-to-all", ("fsdp",), "table-reshard", once=n * shard * _fraction(shape["fsdp"]), once_launches=n)
        reduced = batch - compute
        scattered = live(reduced & grads, shape)
        replicas = live(reduced - grads, shape)
        together = tuple(a for a in replicas if a in automatic) if scattered and not xla_cpu else ()
        if together:  # reduced over the shard's axes and the automatic replicas at once, then gathered back
            both = live({*scattered, *together}, shape)
            add("reduce-scatter", both, "grad-scatter", grad_bytes * _fraction(ways(both, shape)), layers)
            shard = g.numel / ways(compute | grads, shape) * m.param_bytes
            add("all-gather", together, "grad-gather", once=shard * _fraction(ways(together, shape)),
                once_launches=1)
            replicas = tuple(a for a in replicas if a not in together)
        elif scattered and outside and len(live(reduced, shape)) > 1 and not xla_cpu:  # the whole gradient reduced
            add("all-reduce", scattered, "grad-scatter", 2 * grad_bytes * _fraction(ways(scattered, shape)), layers)
        elif scattered:
            add("reduce-scatter", scattered, "grad-scatter", grad_bytes * _fraction(ways(scattered, shape)), layers)
        # ZeRO-1: the whole accumulated gradient is reduce-scattered once a step into the optimizer's shard
        # (`parallel.gradients`), then any other replica axes reduce that shard.
        deferred = tuple(a for a in replicas if a in opt)
        replicas = tuple(a for a in replicas if a not in opt)
        dtype = rb if outside and not (accumulates or xla_cpu) else m.param_bytes
        if deferred:  # in the parameter dtype everywhere (libtpu converts a table's all-reduce, not this)
            whole = g.numel / ways(compute | grads, shape) * m.param_bytes
            add("reduce-scatter", deferred, "grad-reduce", once=whole * _fraction(ways(deferred, shape)),
                once_launches=1)
        if replicas:
            shard = g.numel / ways(compute | grads | set(deferred), shape) * dtype
            add("all-reduce", replicas, "grad-reduce", once=2 * shard * _fraction(ways(replicas, shape)),
                once_launches=1)
        regathered = live(opt - stored, shape)
        if regathered:
            shard = g.numel / ways(stored, shape) * m.param_bytes
            add("all-gather", regathered, "update-gather", once=shard * _fraction(ways(regathered, shape)),
                once_launches=1)
    return tuple(terms.items())


def _stacked(g) -> int:
    """Collective launches one pass over this parameter makes: one per layer of its stack."""
    n = 1
    for size, axis in zip(g.shape, g.axes, strict=True):
        if axis in STACKING_AXES:
            n *= size
    return n


def tensor_terms(m: ModelShape, c: Candidate, w: Workload) -> list[CommTerm]:
    """Megatron tensor parallelism's activation collectives over `tensor` (all-reduce-equivalents); MLA's as its
    sharded math runs (docs/plan.md#multi-head-latent-attention)."""
    t = c.tensor
    if t == 1:
        return []
    rows = rows_per_device(c, w)
    tokens = rows * w.seq_len / c.length_ways  # per accumulation step, all pipeline microbatches together
    block = tokens * m.d_model * m.compute_bytes
    micro = microbatches(c, rows)
    here = 1 / c.pipeline  # a stage runs its own layers only
    # Per layer and microbatch, reductions of each sublayer's output: forward and backward, and under full remat
    # the attention's again (the MLP's recomputed output feeds nothing the backward reads, so XLA drops it).
    # Attention's backward reduction is the input gradient of the head-split projections that read the residual
    # stream (all of grouped-query attention's; MLA's query projection without a query latent).
    # Under SP each sublayer gathers its input three times: forward, backward (the scatter's transpose), and
    # again for its weight gradients, or in the recompute under full remat (Korthikanti et al. §4.2.2 keep the
    # input split and gather it again). MLA's down-projections keep the split input as their residual: its
    # attention gathers for the recompute and, where a head-split projection reads the input, for that weight's
    # gradient too.
    full = c.remat in RECOMPUTES_LAYER
    direct = m.heads_read_residual
    attn, mlp_reduces, gathers = 1 + full + direct, 2, 3
    attn_gathers = 2 + full + direct if m.latent_width else gathers
    dense = m.num_layers - m.moe_layers
    mlp_block = block
    if m.moe_layers:  # an MoE layer's MLP reduces its slot buffer (and the shared experts' block)
        slots = m.num_experts * capacity_slots(m, w, tokens / micro) * micro
        mlp_block = slots * m.d_model * m.compute_bytes + (block if m.num_shared_experts else 0.0)
    layers = m.num_layers * here
    edge = 2 * block  # vocabulary-parallel embedding (forward) and LM head (input gradient)
    mlp_blocks = here * (dense * block + m.moe_layers * mlp_block)
    reduced = layers * attn * block + mlp_blocks * mlp_reduces + edge
    gathered = layers * attn_gathers * block + mlp_blocks * gathers + edge
    # MLA: every tensor rank computes the latents whole from the (gathered) input, and the head-split expansions'
    # gradients with respect to them are partial sums: all-reduced, latent_width wide, at the full length. Under SP
    # the down-projections' weight gradients come from the split input: all-reduced too, d_model x latent_width.
    latent = layers * tokens * m.latent_width * m.compute_bytes
    latent_weights = layers * micro * m.d_model * m.latent_width * m.compute_bytes

    def per_step(total: float, per_layer: int) -> tuple[float, int]:
        return total * _fraction(t) * c.grad_accum, round((layers * per_layer + 2) * micro) * c.grad_accum

    if c.sequence_parallel:
        (rs, rs_n), (ag, ag_n) = per_step(reduced, attn + mlp_reduces), per_step(gathered, attn_gathers + gathers)
        out = [CommTerm("all-gather", ("tensor",), ag, ag_n, "tensor"),
               CommTerm("reduce-scatter", ("tensor",), rs, rs_n, "tensor")]
        if m.latent_width:
            nbytes = 2 * (latent + latent_weights) * _fraction(t) * c.grad_accum
            out.append(CommTerm("all-reduce", ("tensor",), nbytes, round(2 * layers * micro) * c.grad_accum,
                                "tensor"))
        return out
    # Without SP the latent's reduction joins the attention's backward one (one launch, d_model + latent_width wide
    # without a query latent).
    nbytes, count = per_step(2 * (reduced + latent), 2 + full + mlp_reduces)
    return [CommTerm("all-reduce", ("tensor",), nbytes, count, "tensor")]


def pipeline_terms(m: ModelShape, c: Candidate, w: Workload) -> list[CommTerm]:
    """Our executor's sends between stages (every tick, both ways) and its fp32 sum of head and input gradients."""
    p = c.pipeline
    if p == 1:
        return []
    rows = rows_per_device(c, w)
    micro = microbatches(c, rows)
    ticks, _, _ = schedule_stats(c.pipeline_schedule, p, micro, c.virtual_stages)
    split = residual_ways(c)
    stream = rows / micro * w.seq_len / split * m.d_model * m.compute_bytes
    sends = CommTerm("collective-permute", ("pipeline",), 2 * ticks * stream * c.grad_accum,
                     2 * ticks * c.grad_accum, "pipeline")
    head = 0.0
    for g in m.params:
        if not g.path.startswith("blocks."):
            lay = group_layout(g.axes, c)
            head += g.numel / spec_ways(lay.grads, c.shape) * 4
    # An accelerator's XLA sums the input gradients in the compute dtype: it drops the executor's fp32 round
    # trip (excess precision allowed), which XLA:CPU keeps.
    inputs = rows * w.seq_len / split * m.d_model * (4 if w.xla_cpu else m.compute_bytes)
    summed = CommTerm("all-reduce", ("pipeline",), 2 * (head + inputs) * _fraction(p) * c.grad_accum,
                      c.grad_accum, "pipeline")
    return [sends, summed]


@dataclass(frozen=True)
class ExpertExchange:
    """How the token all-to-alls over `expert` run: per MoE layer and microbatch, and in all per step."""

    per_layer: int
    """All-to-alls per MoE layer and microbatch: 4 (there and back, and their transposes), 6 under any remat policy
    (the forward is rerun inside the backward and no policy saves an all-to-all); capacity_dedup 5 (the rerun needs
    no rows back: the receiver applied the gates)."""
    layers: float
    """MoE layers a device runs: its stage's share when pipelined (and any multi-token prediction MoE layers)."""
    microbatches: int
    """Microbatches per step: accumulation steps times pipeline microbatches."""
    group_tokens: float
    """A group, what capacity is counted over: the tokens a device holds of one microbatch."""
    slots: float
    """Capacity slots per expert and group (k x tokens / E when dropless)."""
    bytes_per_exchange: float
    """Bytes one all-to-all sends from a device: (N-1)/N of the E x C x d_model slot buffer (dropless: of the k x
    tokens rows, under balanced routing; capacity_dedup: of the N x device-capacity rows)."""
    rows: int = 0
    """capacity_dedup: the rows a group sends, one per token and device reached (`ops.capacity.device_capacity` per
    destination device)."""
    choices_per_layer: int = 0
    """capacity_dedup: the small all-to-alls of each row's choices per MoE layer and microbatch (local experts and
    gates out, the kept flags back, the gates' gradient; local experts and gates again under remat)."""
    choice_bytes: float = 0.0
    """Bytes those send from a device per MoE layer and microbatch, in all."""

    @property
    def count(self) -> float:
        """All-to-alls per step."""
        return self.layers * self.microbatches * (self.per_layer + self.choices_per_layer)

    @property
    def total_bytes(self) -> float:
        """Bytes a device sends in all of them per step."""
        return self.layers * self.microbatches * (self.per_layer * self.bytes_per_exchange + self.choice_bytes)


def expert_exchange(m: ModelShape, c: Candidate, w: Workload) -> ExpertExchange:
    """The token all-to-alls of candidate `c` (docs/moe.md)."""
    rows = rows_per_device(c, w)
    micro = microbatches(c, rows)
    tokens = rows / micro * w.seq_len / c.length_ways
    slots = capacity_slots(m, w, tokens)
    per_layer, sent, choices, choice_bytes = 4 if c.remat == "none" else 6, 0, 0, 0.0
    if w.moe_impl == "dropless":
        exchange = m.experts_per_token * tokens * m.d_model * m.compute_bytes * _fraction(c.expert)
    elif w.moe_impl == "capacity_dedup" and c.expert > 1:
        sent = c.expert * device_capacity(m.experts_per_token, tokens, w.capacity_factor, c.expert, m.num_experts,
                                          m.n_group, m.topk_group)
        exchange = sent * m.d_model * m.compute_bytes * _fraction(c.expert)
        remat = c.remat != "none"
        # The receiver weighs the outputs by the gates, so a rerun forward needs no rows back: 5 under remat.
        per_layer = 4 + remat
        choices = 4 + 2 * remat  # int32 experts and fp32 gates out, int8 flags back, fp32 gate gradients
        choice_bytes = sent * m.experts_per_token * (4 + 4 + 1 + 4 + 8 * remat) * _fraction(c.expert)
    else:
        exchange = m.num_experts * slots * m.d_model * m.compute_bytes * _fraction(c.expert)
    return ExpertExchange(per_layer=per_layer, layers=m.moe_layers / c.pipeline + m.mtp_moe_layers,
                          microbatches=c.grad_accum * micro, group_tokens=tokens, slots=slots,
                          bytes_per_exchange=exchange, rows=sent, choices_per_layer=choices,
                          choice_bytes=choice_bytes)


def expert_terms(m: ModelShape, c: Candidate, w: Workload) -> list[CommTerm]:
    """Token all-to-alls over `expert` (`expert_exchange`)."""
    if c.expert == 1 or m.moe_layers == 0:
        return []
    x = expert_exchange(m, c, w)
    return [CommTerm("all-to-all", ("expert",), x.total_bytes, x.count, "expert")]


def context_terms(m: ModelShape, c: Candidate, w: Workload) -> list[CommTerm]:
    """Attention's collectives over `sequence` (`analysis.context_report.context_section`, docs/context.md)."""
    n = c.sequence
    if n == 1:
        return []
    heads = m.num_heads // ways(c.split_by("heads"), c.shape)
    kv = m.num_kv_heads // ways(c.split_by("kv_heads"), c.shape)
    rows, local, width, hd = rows_per_device(c, w), w.seq_len // n, m.compute_bytes, m.head_dim
    block = rows * local * kv * hd * width
    ids = rows * local * 4
    share = _fraction(n)
    forward, backward, once = {}, {}, {}

    def add(table, op, count, each):
        old = table.get(op, (0, 0.0))
        table[op] = (old[0] + count, old[1] + count * each)

    if c.context_parallel == "allgather":
        add(forward, "all-gather", 2, block * n * share)
        add(backward, "reduce-scatter", 2, block * n * share)
        if w.documents:
            add(once, "all-gather", 1, ids * n * share)
    elif c.context_parallel == "ulysses":
        qkv = rows * local * (heads + 2 * kv * kv_repeats(kv, n)) * hd * width
        for table in (forward, backward):
            add(table, "all-to-all", 1, qkv * share)
            add(table, "all-to-all", 1, rows * local * heads * hd * width * share)
        if w.documents:
            add(once, "all-gather", 1, ids * n * share)
    else:
        add(forward, "collective-permute", 2 * (n - 1), block)
        add(backward, "collective-permute", 2 * (n - 1), block)
        add(backward, "collective-permute", 2 * (n - 1), block * 4 / width)
        add(backward, "collective-permute", 2, block)
        if w.documents:
            add(once, "collective-permute", n - 1, ids)
    layers = m.num_layers * c.grad_accum
    again = 2 if c.remat in RECOMPUTES_LAYER and c.context_parallel != "ring" else 1
    out: dict[str, tuple[int, float]] = {}
    for table, times in ((forward, layers * again), (backward, layers), (once, c.grad_accum)):
        for op, (count, total) in table.items():
            old = out.get(op, (0, 0.0))
            out[op] = (old[0] + times * count, old[1] + times * total)
    return [CommTerm(op, ("sequence",), total, count, "context") for op, (count, total) in out.items()]


def optimizer_terms(m: ModelShape, c: Candidate, w: Workload) -> list[CommTerm]:
    """Muon's: each matrix stack made whole on its devices and back, once per step (`config.matrix_moves`), in the
    parameter dtype; none for the other optimizers."""
    if w.optimizer != "muon":
        return []
    found = _muon_terms(m, c.sizes, c.zero_stage, c.rules)
    return [CommTerm(op, axes, total, count, "optimizer") for (op, axes), (count, total) in found.items()]


@functools.lru_cache(maxsize=1 << 12)
def _muon_moves(m: ModelShape, sizes: tuple[int, ...], stage: int, rules: RuleTables | None) -> tuple:
    """(group, its optimizer-state spec, its (reads, writes) dimensions, its moves) for each matrix Muon takes."""
    shape, out = dict(zip(MESH_AXES, sizes, strict=True)), []
    for g in m.params:
        dims = muon_dimensions(g.axes)
        if dims is not None:
            spec = param_layout(g.axes, sizes, stage, rules).optimizer
            out.append((g, spec, dims, whole_matrix_moves(spec, g.shape, dims[0] + dims[1], shape)))
    return tuple(out)


@functools.lru_cache(maxsize=1 << 12)
def _muon_terms(m: ModelShape, sizes: tuple[int, ...], stage: int, rules: RuleTables | None) -> dict:
    """{(op, axes): (launches, bytes each device sends)} of Muon's moves."""
    shape, out = dict(zip(MESH_AXES, sizes, strict=True)), {}
    for g, spec, _, moves in _muon_moves(m, sizes, stage, rules):
        local = g.numel / spec_ways(spec, shape) * m.param_bytes
        for op, axis, sent in whole_matrix_bytes(moves, g.shape, local, shape):
            count, total = out.get((op, (axis,)), (0, 0.0))
            out[op, (axis,)] = (count + (2 if op == "all-to-all" else 1), total + sent)
    return out


def optimizer_flops(m: ModelShape, c: Candidate, w: Workload) -> float:
    """FLOPs one device runs in the optimizer beyond elementwise work: Muon's Newton-Schulz iterations on the whole
    matrices it holds after the moves (padding included, and repeated along gathered axes); 0 for the others."""
    if w.optimizer != "muon":
        return 0.0
    shape, total = dict(zip(MESH_AXES, c.sizes, strict=True)), 0.0
    for g, spec, dims, moves in _muon_moves(m, c.sizes, c.zero_stage, c.rules):
        rows, cols = (math.prod(g.shape[d] for d in side) for side in dims)
        total += local_matrices(moves, spec, g.shape, dims[0] + dims[1], shape) * newton_schulz_flops(rows, cols)
    return total


def comm_terms(m: ModelShape, c: Candidate, w: Workload) -> list[CommTerm]:
    """Every collective a step of candidate `c` runs, per device: ZeRO, tensor, pipeline, expert, context and the
    optimizer's own."""
    return [*policy_zero_terms(m, c, w), *tensor_terms(m, c, w), *pipeline_terms(m, c, w), *expert_terms(m, c, w),
            *context_terms(m, c, w), *optimizer_terms(m, c, w)]
