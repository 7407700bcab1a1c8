"""Checks that span several keys: each failure names the key, the value and what would be valid."""

from __future__ import annotations

import math
from collections.abc import Mapping

from spmd_train.config.rules import resolve_rules
from spmd_train.config.schema import MESH_AXES, Config
from spmd_train.errors import ConfigError


def check_config(cfg: Config) -> None:
    """Checks that need no devices: ranges, divisibility inside the model, mesh-size syntax, rules."""
    m, t = cfg.model, cfg.train
    for key, value in (
        ("model.num_layers", m.num_layers),
        ("model.d_model", m.d_model),
        ("model.num_heads", m.num_heads),
        ("model.num_kv_heads", m.num_kv_heads),
        ("model.d_ff", m.d_ff),
        ("model.vocab_size", m.vocab_size),
        ("train.steps", t.steps),
        ("train.global_batch_size", t.global_batch_size),
        ("train.seq_len", t.seq_len),
        ("train.grad_accum", t.grad_accum),
        ("train.eval_batches", t.eval_batches),
        ("run.log_every", cfg.run.log_every),
        ("data.order", cfg.data.order),
    ):
        if value < 1:
            raise ConfigError(f"{key}={value} is invalid: it must be a positive integer")
    if m.num_heads % m.num_kv_heads:
        raise ConfigError(
            f"model.num_kv_heads={m.num_kv_heads} is invalid: it must divide model.num_heads={m.num_heads} "
            f"(valid: {divisors(m.num_heads)})"
        )
    if m.attention_blocks is not None and any(b < 8 or b % 8 for b in m.attention_blocks):
        raise ConfigError(f"model.attention_blocks={list(m.attention_blocks)} is invalid: block_q and block_k must "
                          "be positive multiples of 8 (e.g. [512, 512] on TPU, [128, 128] on GPU)")
    if m.resolved_head_dim < 2 or m.resolved_head_dim % 2:
        raise ConfigError(
            f"model.head_dim={m.resolved_head_dim} is invalid: rotary embeddings need an even head_dim >= 2 "
            "(set model.head_dim, or model.d_model and model.num_heads so d_model // num_heads is even)"
        )
    d = cfg.data
    if d.source == "markov" and (d.vocab_size or m.vocab_size) > m.vocab_size:
        raise ConfigError(f"data.vocab_size={d.vocab_size} is larger than model.vocab_size={m.vocab_size} "
                          f"(valid: at most {m.vocab_size})")
    if d.source == "text" and m.vocab_size < 256:
        raise ConfigError(f"model.vocab_size={m.vocab_size} is too small for data.source=text, whose tokens are "
                          "bytes (valid: at least 256)")
    if d.concentration <= 0:
        raise ConfigError(f"data.concentration={d.concentration} is invalid: it must be > 0")
    if not 0 <= d.val_fraction < 1:
        raise ConfigError(f"data.val_fraction={d.val_fraction} is invalid: it must be in [0, 1)")
    if d.source != "markov" and not d.paths:
        raise ConfigError(f"data.source={d.source} needs data.paths (one or more files or globs)")
    ck = cfg.checkpoint
    if ck.every < 0 or ck.keep < 1:
        raise ConfigError(f"checkpoint.every={ck.every}, checkpoint.keep={ck.keep} are invalid "
                          "(valid: every >= 0, keep >= 1)")
    prof = cfg.run.profile_steps
    if prof and (len(prof) != 2 or not 1 <= prof[0] <= prof[1] <= t.steps):
        raise ConfigError(f"run.profile_steps={list(prof)} is invalid: give [first, last] with "
                          f"1 <= first <= last <= train.steps={t.steps}")
    r = cfg.run
    explicit = (r.coordinator, r.num_processes, r.process_id)
    if any(v is not None for v in explicit) and None in explicit:
        raise ConfigError(f"run.coordinator={r.coordinator!r}, run.num_processes={r.num_processes}, "
                          f"run.process_id={r.process_id}: set all three to start several processes by hand "
                          "(or none, with run.distributed=true, to detect the cluster)")
    if r.num_processes is not None and not 0 <= (r.process_id or 0) < r.num_processes:
        raise ConfigError(f"run.process_id={r.process_id} is invalid for run.num_processes={r.num_processes} "
                          f"(valid: 0 to {r.num_processes - 1})")
    if cfg.run.peak_tflops is not None and cfg.run.peak_tflops <= 0:
        raise ConfigError(f"run.peak_tflops={cfg.run.peak_tflops} is invalid: it must be > 0")
    if t.eval_every < 0:
        raise ConfigError(f"train.eval_every={t.eval_every} is invalid: it must be >= 0 (0: no evaluation)")
    if cfg.optim.warmup_steps < 0:
        raise ConfigError(f"optim.warmup_steps={cfg.optim.warmup_steps} is invalid: it must be >= 0")
    if cfg.run.simulate_devices is not None and cfg.run.simulate_devices < 1:
        raise ConfigError(f"run.simulate_devices={cfg.run.simulate_devices} is invalid: it must be >= 1 or null")
    sizes = cfg.mesh.sizes()
    for axis, size in sizes.items():
        if size == 0 or size < -1:
            raise ConfigError(f"mesh.{axis}={size} is invalid: an axis size is a positive integer or -1 (fill)")
    filled = [a for a, s in sizes.items() if s == -1]
    if len(filled) > 1:
        raise ConfigError(
            f"mesh axes {', '.join(f'mesh.{a}=-1' for a in filled)} are invalid: at most one axis may be -1"
        )
    for axis in MESH_AXES:
        factor, size = getattr(cfg.mesh.dcn, axis), sizes[axis]
        if factor < 1 or (size != -1 and size % factor):
            raise ConfigError(
                f"mesh.dcn.{axis}={factor} is invalid: a slow-link factor must be >= 1 and divide "
                f"mesh.{axis}={size} (valid: {divisors(size) if size > 0 else 'a divisor of the filled size'})"
            )
    for table in ("params", "activations"):
        for name, axes in getattr(cfg.mesh.rules, table).items():
            for axis in axes:
                if axis not in MESH_AXES:
                    raise ConfigError(
                        f"mesh.rules.{table}.{name}={list(axes)} names {axis!r}, which is not a mesh axis "
                        f"(valid: {', '.join(MESH_AXES)})"
                    )


def check_layout(cfg: Config, sizes: Mapping[str, int], platform: str | None = None) -> None:
    """Checks that need the resolved mesh axis sizes (after -1 is filled) and the platform compiled for.

    The pipeline keys are checked beside the schedules (`parallel.schedules.check_pipeline`).
    """
    m, t = cfg.model, cfg.train
    tensor = sizes["tensor"]
    for key, value in (
        ("model.num_heads", m.num_heads),
        ("model.num_kv_heads", m.num_kv_heads),
        ("model.d_ff", m.d_ff),
        ("model.vocab_size", m.vocab_size),
    ):
        if value % tensor:
            raise ConfigError(
                f"{key}={value} is not divisible by mesh.tensor={tensor}: tensor parallelism splits it "
                f"across {tensor} devices (valid mesh.tensor: {divisors(value)})"
            )
    batch_axes = resolve_rules(cfg).batch_axes
    need = math.prod(sizes[a] for a in batch_axes) * t.grad_accum
    if t.global_batch_size % need:
        raise ConfigError(
            f"train.global_batch_size={t.global_batch_size} is not divisible by "
            f"{' x '.join(f'mesh.{a}={sizes[a]}' for a in batch_axes)} x train.grad_accum={t.grad_accum} = {need}: "
            f"each device needs a whole share of every microbatch (valid: a multiple of {need})"
        )
    length_ways = sizes["sequence"] * (tensor if cfg.parallel.sequence_parallel else 1)
    if t.seq_len % length_ways:
        why = f"mesh.sequence={sizes['sequence']}"
        if cfg.parallel.sequence_parallel:
            why += f" x mesh.tensor={tensor} (parallel.sequence_parallel=true)"
        raise ConfigError(
            f"train.seq_len={t.seq_len} is not divisible by {why} = {length_ways}: "
            f"tokens are split over these axes (valid: a multiple of {length_ways})"
        )
    check_moe(cfg, sizes, platform or "cpu")
    check_attention(cfg, platform or "cpu")
    # Until context-parallel attention lands, `sequence` must stay 1; `expert` is already valid
    # because outside MoE layers it is one more batch axis.
    if sizes["sequence"] != 1:
        raise ConfigError(
            f"mesh.sequence={sizes['sequence']} is not supported yet: sequence (context) parallelism is not "
            "implemented in this version (valid: 1)"
        )


def divisors(n: int) -> str:
    """The divisors of n, as a 'valid values' list for error messages."""
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


def check_attention(cfg: Config, platform: str) -> None:
    """model.attention=pallas on a GPU: the Mosaic GPU kernels' limits, before anything is traced."""
    m = cfg.model
    if m.attention != "pallas" or platform != "gpu":
        return
    if m.compute_dtype != "bfloat16":
        raise ConfigError(f"model.attention=pallas on GPU needs model.compute_dtype=bfloat16 (the kernels feed "
                          f"wgmma bfloat16 operands); got {m.compute_dtype}: set it, or use model.attention=cudnn "
                          "or xla")
    if m.resolved_head_dim % 64:
        raise ConfigError(f"model.attention=pallas on GPU needs a head_dim that is a multiple of 64; got "
                          f"{m.resolved_head_dim}: use model.attention=cudnn or xla")
    if m.attention_blocks is not None and any(b % 64 or b > 256 for b in m.attention_blocks):
        raise ConfigError(f"model.attention_blocks={list(m.attention_blocks)} does not suit the GPU kernels: each "
                          "must be 64, 128, 192 or 256 (64-row warpgroups, at most 4 per program)")


def check_moe(cfg: Config, sizes: Mapping[str, int], platform: str) -> None:
    """Mixture-of-experts keys against the model, the resolved mesh axis sizes and the platform compiled for."""
    m = cfg.model
    if m.moe_every == 0:  # MoE off: the other MoE keys are unused
        return
    if m.moe_every < 0 or m.num_layers % m.moe_every:
        raise ConfigError(
            f"model.moe_every={m.moe_every} is invalid for model.num_layers={m.num_layers}: it must be 0 (no MoE) "
            f"or divide num_layers (valid: 0, {divisors(m.num_layers)})"
        )
    if m.num_experts < 1:
        raise ConfigError(f"model.num_experts={m.num_experts} is invalid: it must be a positive integer")
    if not 1 <= m.experts_per_token <= m.num_experts:
        raise ConfigError(
            f"model.experts_per_token={m.experts_per_token} is invalid with model.num_experts={m.num_experts} "
            f"(valid: 1 to {m.num_experts})"
        )
    if m.capacity_factor <= 0:
        raise ConfigError(f"model.capacity_factor={m.capacity_factor} is invalid: it must be > 0")
    if m.moe_d_ff is not None and m.moe_d_ff < 1:
        raise ConfigError(f"model.moe_d_ff={m.moe_d_ff} is invalid: it must be a positive integer (or null: d_ff)")
    if m.num_shared_experts < 0:
        raise ConfigError(f"model.num_shared_experts={m.num_shared_experts} is invalid: it must be >= 0")
    expert = sizes["expert"]
    if m.num_experts % expert:
        raise ConfigError(
            f"model.num_experts={m.num_experts} is not divisible by mesh.expert={expert}: each device of the "
            f"expert axis holds num_experts / mesh.expert experts (valid mesh.expert: {divisors(m.num_experts)})"
        )
    tensor = sizes["tensor"]
    if m.resolved_moe_d_ff % tensor:
        raise ConfigError(
            f"model.moe_d_ff={m.resolved_moe_d_ff} is not divisible by mesh.tensor={tensor}: tensor parallelism "
            f"splits each expert's hidden width (valid mesh.tensor: {divisors(m.resolved_moe_d_ff)})"
        )
    if m.moe_impl == "dropless" and platform == "cpu":
        raise ConfigError(
            "model.moe_impl=dropless needs ragged all-to-all, which XLA:CPU does not implement; use "
            "moe_impl=capacity here, or compile it for a TPU with `spmd-train describe --topology`"
        )
