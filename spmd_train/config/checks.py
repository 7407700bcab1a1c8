"""Checks that span several keys: each failure names the key, the value and what would be valid."""

from __future__ import annotations

import logging
from collections.abc import Mapping

from spmd_train.config.attention_facts import attention_facts, attention_names, check_variants
from spmd_train.config.mesh_schema import MESH_AXES
from spmd_train.config.optimizer_facts import optimizer_facts, optimizer_names
from spmd_train.config.resolved_rules import resolve_rules
from spmd_train.config.schema import Config
from spmd_train.config.validity import (
    attention_merges_no_blocks,
    axes_divide_tokens,
    batch_axes_divide_batch,
    divisors,
    expert_divides_experts,
    mtp_outside_pipeline,
    refuse,
    ring_outside_pipeline,
    ring_zigzag_chunks,
    tensor_divides,
    ulysses_whole_heads,
    virtual_stages_fit,
)
from spmd_train.errors import ConfigError

log = logging.getLogger("spmd_train")


def check_config(cfg: Config) -> None:
    """Checks across keys that need no devices (single-key ranges are the schema's types)."""
    m, t = cfg.model, cfg.train
    if m.num_heads % m.num_kv_heads:
        raise ConfigError(
            f"model.num_kv_heads={m.num_kv_heads} is invalid: it must divide model.num_heads={m.num_heads} "
            f"(valid: {divisors(m.num_heads)})"
        )
    check_mla(m)
    if m.mla is None and (m.resolved_head_dim < 2 or m.resolved_head_dim % 2):
        raise ConfigError(
            f"model.head_dim={m.resolved_head_dim} is invalid: rotary embeddings need an even head_dim >= 2 "
            "(set model.head_dim, or model.d_model and model.num_heads so d_model // num_heads is even)"
        )
    check_layer_types(m)
    if m.mtp is not None and m.mtp.depth >= t.seq_len:
        raise ConfigError(f"model.mtp.depth={m.mtp.depth} leaves no position a target with train.seq_len={t.seq_len}: "
                          f"depth k predicts the token k + 1 places ahead (valid: 1 to {t.seq_len - 1})")
    if m.mlp_activation != "silu" and m.moe is not None:
        raise ConfigError(f"model.mlp_activation={m.mlp_activation} is for dense models: the routed experts are SwiGLU "
                          "(valid with model.moe: silu; model.moe=null for a dense GeGLU model)")
    sc = m.rope_scaling
    if sc is not None and sc.type == "llama3" and sc.low_freq_factor >= sc.high_freq_factor:
        raise ConfigError(f"model.rope_scaling.low_freq_factor={sc.low_freq_factor} must be below "
                          f"model.rope_scaling.high_freq_factor={sc.high_freq_factor} (Llama 3.1 uses 1 and 4)")
    check_precision(cfg)
    check_offload(cfg)
    check_remat_names(cfg)
    d = cfg.data
    if d.source == "markov" and (d.vocab_size or m.vocab_size) > m.vocab_size:
        raise ConfigError(f"data.vocab_size={d.vocab_size} is larger than model.vocab_size={m.vocab_size} "
                          f"(valid: at most {m.vocab_size})")
    if d.source == "text" and m.vocab_size < 256:
        raise ConfigError(f"model.vocab_size={m.vocab_size} is too small for data.source=text, whose tokens are "
                          "bytes (valid: at least 256)")
    if d.source == "markov" and d.document_mask:
        raise ConfigError("data.document_mask=true needs documents, and data.source=markov draws one endless "
                          "sequence per row (valid: data.source=tokens with packed documents, or "
                          "data.document_mask=false)")
    if d.source != "markov" and not d.paths:
        raise ConfigError(f"data.source={d.source} needs data.paths (one or more files or globs)")
    prof = cfg.run.profile_steps
    if prof and (len(prof) != 2 or not 1 <= prof[0] <= prof[1] <= t.steps):
        raise ConfigError(f"run.profile_steps={list(prof)} is invalid: give [first, last] with "
                          f"1 <= first <= last <= train.steps={t.steps}")
    if t.resume_step is not None and t.resume == "never":
        raise ConfigError(f"train.resume_step={t.resume_step} asks to resume, and train.resume=never refuses to "
                          "(valid: train.resume=auto with train.resume_step, or train.resume_step=null)")
    if t.resume_step is not None and t.resume_step > t.steps:
        raise ConfigError(f"train.resume_step={t.resume_step} is past train.steps={t.steps} (valid: a saved step "
                          f"up to {t.steps}, or a larger train.steps)")
    r = cfg.run
    explicit = (r.coordinator, r.num_processes, r.process_id)
    if any(v is not None for v in explicit) and None in explicit:
        raise ConfigError(f"run.coordinator={r.coordinator!r}, run.num_processes={r.num_processes}, "
                          f"run.process_id={r.process_id}: set all three to start several processes by hand "
                          "(or none, with run.distributed=true, to detect the cluster)")
    if r.num_processes is not None and not 0 <= (r.process_id or 0) < r.num_processes:
        raise ConfigError(f"run.process_id={r.process_id} is invalid for run.num_processes={r.num_processes} "
                          f"(valid: 0 to {r.num_processes - 1})")
    sizes = cfg.mesh.sizes()
    filled = [a for a, s in sizes.items() if s == -1]
    if len(filled) > 1:
        raise ConfigError(
            f"mesh axes {', '.join(f'mesh.{a}=-1' for a in filled)} are invalid: at most one axis may be -1"
        )
    for axis in MESH_AXES:
        factor, size = getattr(cfg.mesh.dcn, axis), sizes[axis]
        if size != -1 and size % factor:
            raise ConfigError(
                f"mesh.dcn.{axis}={factor} is invalid: a slow-link factor must divide "
                f"mesh.{axis}={size} (valid: {divisors(size) if size > 0 else 'a divisor of the filled size'})"
            )


def check_mla(m) -> None:
    """model.mla against the grouped-query keys it replaces: no K/V groups, no head_dim, no biases or q/k norms."""
    a = m.mla
    if a is None:
        return
    if m.num_kv_heads != m.num_heads:
        raise ConfigError(f"model.mla with model.num_kv_heads={m.num_kv_heads}: every head expands its own keys and "
                          f"values from the latent, there are no K/V groups (valid: model.num_kv_heads="
                          f"{m.num_heads}, model.num_heads)")
    if m.head_dim is not None:
        raise ConfigError(f"model.head_dim={m.head_dim} with model.mla: MLA's head widths are model.mla."
                          "qk_nope_head_dim + qk_rope_head_dim (queries, keys) and model.mla.v_head_dim (values) "
                          "(valid: model.head_dim=null)")
    held = [f"model.{k}=true" for k in ("qkv_bias", "attn_output_bias", "qk_norm") if getattr(m, k)]
    if held:
        raise ConfigError(f"{' and '.join(held)} with model.mla: MLA has no attention biases and normalises its "
                          "latents (model.mla's q and kv norms), not each head (valid: model.qkv_bias=false, "
                          "model.attn_output_bias=false, model.qk_norm=false)")
    if a.qk_rope_head_dim < 2 or a.qk_rope_head_dim % 2:
        raise ConfigError(f"model.mla.qk_rope_head_dim={a.qk_rope_head_dim} is invalid: rotary embeddings turn "
                          "pairs of values (valid: an even number >= 2, DeepSeek's 64)")


def check_layer_types(m) -> None:
    """model.layer_types against the window, the layer count and the sliding layers' RoPE base."""
    kinds = m.attention_kinds
    if len(m.layer_types) > m.num_layers:
        raise ConfigError(f"model.layer_types lists {len(m.layer_types)} layers, more than model.num_layers="
                          f"{m.num_layers} (valid: at most {m.num_layers}; a shorter list repeats over the layers)")
    if "sliding" in kinds and m.sliding_window is None:
        raise ConfigError(f"model.layer_types={list(m.layer_types)} has sliding layers and model.sliding_window is "
                          "null (valid: a model.sliding_window, or only full layers)")
    if m.sliding_window is not None and "sliding" not in kinds:
        raise ConfigError(f"model.sliding_window={m.sliding_window} with model.layer_types={list(m.layer_types)}: "
                          "no layer slides (valid: sliding in model.layer_types, or model.sliding_window=null)")
    if m.rope_local_theta is not None and "sliding" not in kinds:
        raise ConfigError(f"model.rope_local_theta={m.rope_local_theta} is the sliding layers' RoPE base, and "
                          "no layer slides (valid: null, or sliding layers in model.layer_types)")


def check_layout(cfg: Config, sizes: Mapping[str, int], platform: str | None = None) -> None:
    """Checks that need the resolved mesh axis sizes (after -1 is filled) and the platform compiled for.

    The rules are `config.validity`'s; the pipeline keys beyond parallel.virtual_stages are checked by
    `config.pipeline_keys.check_pipeline`.
    """
    m, t, par = cfg.model, cfg.train, cfg.parallel
    tensor = sizes["tensor"]
    for key, value in (("num_heads", m.num_heads), ("num_kv_heads", m.num_kv_heads), ("d_ff", m.d_ff),
                       ("vocab_size", m.vocab_size)):
        refuse(tensor_divides(key, value, tensor))
    batch_axes = resolve_rules(cfg).batch_axes
    refuse(batch_axes_divide_batch(t.global_batch_size, {a: sizes[a] for a in batch_axes}, t.grad_accum))
    refuse(axes_divide_tokens(t.seq_len, sizes["sequence"], tensor, par.sequence_parallel))
    if sizes["pipeline"] > 1:
        refuse(virtual_stages_fit(par.pipeline_schedule, par.virtual_stages))
    refuse(mtp_outside_pipeline(0 if m.mtp is None else m.mtp.depth, sizes["pipeline"]))
    layers = par.pipeline_layers
    if sizes["pipeline"] == 1 and layers not in (None, "balanced") and tuple(layers) != (cfg.model.num_layers,):
        raise ConfigError(f"parallel.pipeline_layers=[{', '.join(map(str, layers))}] splits the layers into stages, "
                          "but mesh.pipeline=1 runs one stage "
                          f"(valid: balanced or null, or mesh.pipeline={len(layers)})")
    if cfg.offload.params and sizes["pipeline"] > 1:
        raise ConfigError(f"offload.params=true streams the layer stack from the host in the layer loop, and "
                          f"mesh.pipeline={sizes['pipeline']} runs the layers in pipeline stages, which take their "
                          "parameters on the device (valid: offload.params=false, or mesh.pipeline=1)")
    check_moe(cfg, sizes, platform or "cpu")
    check_attention(cfg, platform or "cpu")
    check_context(cfg, sizes)


def check_context(cfg: Config, sizes: Mapping[str, int]) -> None:
    """mesh.sequence > 1: the context-parallel scheme against the rules, the heads, the backend and the other layers."""
    n = sizes["sequence"]
    if n == 1:
        return
    m, how = cfg.model, cfg.parallel.context_parallel
    length = tuple(a for a in resolve_rules(cfg).activations.get("length", ()) if sizes[a] > 1)
    if length != ("sequence",):
        raise ConfigError(f"mesh.rules.activations.length={list(length)} with mesh.sequence={n}: context-parallel "
                          "attention needs the tokens split over sequence alone (valid: [sequence])")
    refuse(ulysses_whole_heads(how, m.num_heads, sizes["tensor"], n))
    refuse(attention_merges_no_blocks(how, cfg.backends.attention, n))
    refuse(ring_outside_pipeline(how, n, sizes["pipeline"]))
    chunk = cfg.train.seq_len // (2 * n)
    if how == "ring" and "sliding" in m.attention_kinds and m.sliding_window - 1 > chunk:
        raise ConfigError(f"parallel.context_parallel=ring swaps each zigzag chunk's window with its neighbours, and "
                          f"model.sliding_window={m.sliding_window} reaches past the {chunk}-token chunk before it "
                          f"(train.seq_len={cfg.train.seq_len} / (2 x mesh.sequence={n})); valid: "
                          f"model.sliding_window up to {chunk + 1}, or parallel.context_parallel=allgather or ulysses")
    refuse(ring_zigzag_chunks(how, cfg.train.seq_len, n))


def check_attention(cfg: Config, platform: str) -> None:
    """backends.attention against the model on `platform` (e.g. the Mosaic GPU kernels' limits), before anything is
    traced: the implementation's own `AttentionFacts.check`."""
    name = cfg.backends.attention
    if name not in attention_names():  # auto picks one that fits
        return
    check_variants(name, cfg.model)
    check = attention_facts(name).check
    if check is not None:
        check(cfg.model, cfg.backends, platform)


def check_moe(cfg: Config, sizes: Mapping[str, int], platform: str) -> None:
    """Mixture-of-experts keys against the model, the resolved mesh axis sizes and the platform compiled for."""
    m, moe = cfg.model, cfg.model.moe
    if moe is None:
        return
    if moe.first_k_dense >= m.num_layers:
        raise ConfigError(f"model.moe.first_k_dense={moe.first_k_dense} leaves no MoE layer in model.num_layers="
                          f"{m.num_layers} (valid: 0 to {m.num_layers - 1}; model.moe=null for a dense model)")
    routed = m.num_layers - moe.first_k_dense
    if routed % moe.every:
        layers = (f"the {routed} layers after model.moe.first_k_dense={moe.first_k_dense} (model.num_layers="
                  f"{m.num_layers}): it must divide them" if moe.first_k_dense else
                  f"model.num_layers={m.num_layers}: it must divide num_layers")
        raise ConfigError(f"model.moe.every={moe.every} is invalid for {layers} (valid: {divisors(routed)}; "
                          "model.moe=null for a dense model)")
    if moe.experts_per_token > moe.num_experts:
        raise ConfigError(
            f"model.moe.experts_per_token={moe.experts_per_token} is invalid with "
            f"model.moe.num_experts={moe.num_experts} (valid: 1 to {moe.num_experts})"
        )
    check_moe_groups(moe)
    refuse(expert_divides_experts(moe.num_experts, sizes["expert"]))
    refuse(tensor_divides("moe.d_ff", m.resolved_moe_d_ff, sizes["tensor"]))
    if moe.router_score == "sigmoid" and moe.router_z_weight > 0:
        # Allowed (it is a regulariser like any other), but rarely meant: the default was chosen for softmax routers.
        log.warning("model.moe.router_z_weight=%g with model.moe.router_score=sigmoid: the router z-loss is "
                    "ST-MoE's regulariser for softmax routers; it pulls the logits together where sigmoid scores "
                    "crowd, slowing auxiliary-loss-free balancing (docs/moe.md), and DeepSeek-V3's sigmoid router "
                    "trains without one (model.moe.router_z_weight=0 to match it)", moe.router_z_weight)
    if cfg.backends.moe == "dropless" and platform == "cpu":
        raise ConfigError(
            "backends.moe=dropless needs ragged all-to-all, which XLA:CPU does not implement; use "
            "backends.moe=capacity here, or compile it for a TPU with `spmd-train describe --topology`"
        )


def check_moe_groups(moe) -> None:
    """Group-limited routing: n_group equal groups, topk_group of them per token, room for k experts in those."""
    e, groups, best = moe.num_experts, moe.n_group, moe.topk_group
    if e % groups:
        raise ConfigError(f"model.moe.n_group={groups} does not divide model.moe.num_experts={e}: the groups are "
                          f"equal runs of consecutive experts (valid model.moe.n_group: {divisors(e)})")
    if best > groups:
        raise ConfigError(f"model.moe.topk_group={best} is more than model.moe.n_group={groups} groups (valid: 1 to "
                          f"{groups}; equal to n_group: routing not group-limited)")
    room = best * (e // groups)
    if moe.experts_per_token > room:
        raise ConfigError(f"model.moe.experts_per_token={moe.experts_per_token} does not fit in "
                          f"model.moe.topk_group={best} groups of {e // groups} experts (num_experts={e} / "
                          f"n_group={groups}): each token's experts come from those groups (valid: "
                          f"experts_per_token up to {room}, or a larger topk_group)")


_QUANTIZED_SUMS = {"fp8": "in the compute dtype at per-tensor scales, in float32 at row scales",
                   "int8": "in int32, exactly"}


def check_precision(cfg: Config) -> None:
    """The precision policy against the model's dtypes and the attention backend (each dtype named by both of its keys,
    model.param_dtype / precision.params and model.compute_dtype / precision.compute: the user gave one of them)."""
    m, pr = cfg.model, cfg.precision
    params, compute = "model.param_dtype (precision.params)", "model.compute_dtype (precision.compute)"
    if pr.master == "float32" and m.param_dtype == "float32":
        raise ConfigError(f"precision.master=float32 keeps a float32 copy of bfloat16 or float16 parameters, and "
                          f"{params}=float32 stores them in float32 already (valid: precision.master=none, or "
                          f"{params}=bfloat16 or float16)")
    if m.compute_dtype == "float16" and pr.loss_scale != "dynamic":
        raise ConfigError(f"{compute}=float16 needs precision.loss_scale=dynamic: float16 flushes gradients below "
                          f"2^-24 to zero without a loss scale (valid: precision.loss_scale=dynamic, or {compute}="
                          "bfloat16 or float32)")
    if m.param_dtype == "float16" and pr.master != "float32":
        raise ConfigError(f"{params}=float16 needs precision.master=float32: updates under float16's step (1 in 2048 "
                          f"of a weight) round away and its range ends at 65504 (valid: precision.master=float32, or "
                          f"{params}=bfloat16 or float32)")
    if pr.reduce is not None and pr.matmul != "default":
        raise ConfigError(f"precision.reduce={pr.reduce} sets the dtype the default matmuls' weight gradients are "
                          f"summed in, and precision.matmul={pr.matmul} computes them itself ("
                          f"{_QUANTIZED_SUMS[pr.matmul]}) (valid: "
                          f"precision.reduce=null, or precision.matmul=default)")
    if pr.fp8_scaling != "tensor" and pr.matmul != "fp8":
        raise ConfigError(f"precision.fp8_scaling={pr.fp8_scaling} sets how FP8 matmuls scale their operands, and "
                          f"precision.matmul={pr.matmul} runs none (valid: precision.matmul=fp8, or "
                          "precision.fp8_scaling=tensor)")
    if m.compute_dtype == "float16" and cfg.backends.attention == "pallas":
        raise ConfigError(f"backends.attention=pallas: our flash-attention kernels take float32 or bfloat16, and "
                          f"{compute}=float16 (valid: backends.attention=auto, xla or cudnn, or {compute}=bfloat16)")


def check_remat_names(cfg: Config) -> None:
    """parallel.remat_save / remat_offload: only with parallel.remat=names, and no name in both."""
    par = cfg.parallel
    given = [(k, v) for k, v in (("remat_save", par.remat_save), ("remat_offload", par.remat_offload)) if v]
    if given and par.remat != "names":
        key, names = given[0]
        raise ConfigError(f"parallel.{key}=[{', '.join(names)}] chooses what parallel.remat=names keeps, and "
                          f"parallel.remat={par.remat} keeps its own (valid: parallel.remat=names, or "
                          f"parallel.{key}=[])")
    both = sorted(set(par.remat_save) & set(par.remat_offload))
    if both:
        raise ConfigError(f"parallel.remat_save and parallel.remat_offload both name {', '.join(both)}: an "
                          "intermediate is kept on the device or in host memory, not both (valid: name it in one)")


def check_offload(cfg: Config) -> None:
    """The offload section against the optimizer (what the devices offer is `train.offload.check_host_memory`'s)."""
    o = cfg.offload
    if o.optimizer_share and not optimizer_facts(cfg.optim.name).elementwise:
        valid = ", ".join(n for n in optimizer_names() if optimizer_facts(n).elementwise)
        raise ConfigError(f"offload.optimizer={str(o.optimizer).lower()} streams the optimizer state through the "
                          f"device a slice at a time, and optim.name={cfg.optim.name} updates whole matrices at once "
                          f"(valid: offload.optimizer=false, or optim.name={valid})")
    if o.params and not o.optimizer_share:
        raise ConfigError("offload.params=true keeps the parameters on the host, and the update streams them through "
                          "the device with the optimizer state, which offload.optimizer=false keeps on the device "
                          "(valid: offload.optimizer=true or a fraction, or offload.params=false)")
    if o.params and cfg.precision.loss_scale == "dynamic":
        raise ConfigError("offload.params=true keeps the layer stack's gradients in host memory, and "
                          "precision.loss_scale=dynamic rescales every gradient on the device (valid: "
                          "precision.loss_scale=none, or offload.params=false)")
    if o.params and cfg.parallel.remat == "none":
        raise ConfigError("offload.params=true brings each layer's parameters to the device as the layer loop reaches "
                          "it, and parallel.remat=none would keep every fetched layer for the backward pass (valid: "
                          "parallel.remat=full, save_matmuls, save_matmuls_no_batch, offload_layer_inputs or names)")
    if o.optimizer_groups is not None and not o.optimizer_share:
        raise ConfigError(f"offload.optimizer_groups={o.optimizer_groups} sets how the offloaded optimizer state "
                          "streams, and offload.optimizer=false offloads none (valid: offload.optimizer=true or a "
                          "fraction, or offload.optimizer_groups=null)")
