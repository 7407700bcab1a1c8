"""Whether a run's parameters, gradients and optimizer state can exist on its devices, checked before compiling.

XLA aborts the process (a failed CHECK in its heap simulator, exit 134) when asked to compile a
state of absurd size (`model.d_model=1000000000`), and a state that merely exceeds the devices
runs out of memory only after minutes of compiling. The state's bytes per device follow from the
shapes and shardings alone, so both are refused at once with the figure and what would fit.
Activations come on top. Before compiling, `check_batch_fits` refuses a batch whose activations
cannot fit by a floor every program of ours needs (a batch of a million rows would otherwise run
out of memory only after minutes of making batches and compiling); after compiling,
`check_compiled_fits` holds the compiled step's own figure (what `spmd-train describe` reports)
to the device before the first step allocates it.
"""

from __future__ import annotations

import math
import os
from typing import Any

import jax

from spmd_train.config.offload_schema import HOST_MEMORY_KIND
from spmd_train.errors import ConfigError
from spmd_train.hardware import device_spec
from spmd_train.units import GiB

NO_DEVICE_HOLDS = 2**40
"""Per-device state bytes no accelerator holds (the largest have about 0.3 TiB)."""


def bytes_per_device(shapes: Any, shardings: Any) -> int:
    """Bytes one device stores of a tree of ShapeDtypeStructs split by a matching tree of shardings."""
    total = 0
    for shape, sharding in zip(jax.tree.leaves(shapes), jax.tree.leaves(shardings), strict=True):
        total += math.prod(sharding.shard_shape(shape.shape)) * shape.dtype.itemsize
    return total


def device_bytes_per_device(shapes: Any, shardings: Any) -> int:
    """`bytes_per_device` of the arrays stored in device memory (offload's pinned host arrays left out)."""
    kept = [(s, sh) for s, sh in zip(jax.tree.leaves(shapes), jax.tree.leaves(shardings), strict=True)
            if sh.memory_kind != HOST_MEMORY_KIND]
    return bytes_per_device([s for s, _ in kept], [sh for _, sh in kept])


def describe_run(cfg: Any, mesh_shape: dict[str, int]) -> str:
    """The keys that decide the state's size, for the error message."""
    m = cfg.model
    axes = " x ".join(f"{a} {n}" for a, n in mesh_shape.items() if n > 1) or "one device"
    attention = ""
    if m.mla is not None:
        a = m.mla
        attention = (f"num_heads={m.num_heads}, mla.q_lora_rank={a.q_lora_rank}, mla.kv_lora_rank={a.kv_lora_rank}, "
                     f"mla.qk_nope_head_dim={a.qk_nope_head_dim}, mla.qk_rope_head_dim={a.qk_rope_head_dim}, "
                     f"mla.v_head_dim={a.v_head_dim}, ")
    elif m.num_heads * m.resolved_head_dim != m.d_model:  # otherwise the attention weights follow from d_model
        attention = f"num_heads={m.num_heads}, num_kv_heads={m.num_kv_heads}, head_dim={m.resolved_head_dim}, "
    moe = ""
    if m.moe is not None and m.moe.num_experts > 1:
        moe = f"model.moe.num_experts={m.moe.num_experts}, model.moe.d_ff={m.moe.d_ff}, "
        if m.moe.num_shared_experts:
            moe += f"model.moe.num_shared_experts={m.moe.num_shared_experts}, "
    return (f"model.num_layers={m.num_layers}, d_model={m.d_model}, d_ff={m.d_ff}, {attention}{moe}"
            f"vocab_size={m.vocab_size}, param_dtype={m.param_dtype}, parallel.zero_stage={cfg.parallel.zero_stage} "
            f"on mesh {axes}")


def check_state_fits(need: int, device: jax.Device, run: str, *, allocating: bool, local_devices: int = 1) -> None:
    """ConfigError naming `run` (`describe_run`) when `need` bytes of state per device cannot fit: over the device
    kind's memory (when known), over what any device holds, or, when `allocating` on CPU, over this host's memory
    for its local devices."""
    what = f"{run}: the parameters, gradients and optimizer state need {need / GiB:,.2f} GiB per device"
    fix = ("valid: a smaller model (model.*), more devices on the axes that split the state (mesh.fsdp with "
           "parallel.zero_stage=3 divides all three, mesh.tensor the matrices), or bfloat16 parameters "
           "(model.param_dtype)")
    spec = device_spec(device.device_kind)
    if spec is not None and need > spec.hbm_bytes:
        raise ConfigError(f"{what}, more than the {spec.hbm_bytes / GiB:.0f} GiB of a {spec.name} ({fix})")
    if need > NO_DEVICE_HOLDS:
        raise ConfigError(f"{what}, more than any device holds ({fix})")
    if allocating and device.platform == "cpu":
        host = host_memory()
        if need * local_devices > host:
            raise ConfigError(f"{what}, {need * local_devices / GiB:,.2f} GiB for this host's {local_devices} "
                              f"simulated devices, more than its {host / GiB:.1f} GiB of memory ({fix})")


def activation_floor(cfg: Any, batch_shard: tuple[int, ...], mesh_shape: dict[str, int]) -> int:
    """Bytes of activations one device holds at least in a step, whatever the remat policy or schedule.

    `batch_shard` is one device's block of the [global_batch, seq_len + 1] token array. Counted: the fp32
    logits of one microbatch (cross_entropy upcasts them; the vocabulary is split over `tensor`) and the
    residual stream each of the device's layers keeps for the backward pass (full remat keeps exactly
    that). Attention scores, MLP intermediates and gradients come on top, so the true peak is higher.
    """
    m, t = cfg.model, cfg.train
    tokens = math.prod(batch_shard) * t.seq_len // (t.seq_len + 1) // max(t.grad_accum, 1)
    vocab = -(-m.vocab_size // mesh_shape.get("tensor", 1))
    layers = -(-m.num_layers // mesh_shape.get("pipeline", 1))
    compute = jax.numpy.dtype(m.compute_dtype).itemsize
    return tokens * vocab * 4 + layers * tokens * m.d_model * compute


def check_batch_fits(state: int, activations: int, device: jax.Device, cfg: Any, *, local_devices: int) -> None:
    """ConfigError naming the batch keys when the state plus the activation floor cannot fit one device (its kind's
    memory, or on CPU this host's memory shared by its simulated devices), with the grad_accum that would fit."""
    limit, where = _device_limit(device, local_devices)
    if limit is None or state + activations <= limit:
        return
    t = cfg.train
    accum = _grad_accum_to_fit(t.grad_accum, activations, limit - state)
    fix = (f"train.grad_accum={accum} or more (the same batch in smaller microbatches), " if accum else "") + \
        "a smaller train.global_batch_size or train.seq_len, or more devices on the axes that split the batch " \
        "(mesh.data, mesh.fsdp)"
    raise ConfigError(
        f"train.global_batch_size={t.global_batch_size} x train.seq_len={t.seq_len} (train.grad_accum={t.grad_accum}): "
        f"one step needs at least {activations / GiB:,.2f} GiB of activations per device (the fp32 logits and the "
        f"residual stream of each layer) on top of {state / GiB:,.2f} GiB of parameters, gradients and optimizer "
        f"state, more than the {limit / GiB:,.1f} GiB {where} (valid: {fix})")


def check_compiled_fits(memory: Any, device: jax.Device, cfg: Any, *, local_devices: int) -> None:
    """ConfigError when the compiled step's peak (`compiled.memory_analysis()`) exceeds the device, before it runs."""
    limit, where = _device_limit(device, local_devices)
    if limit is None or memory is None:
        return
    peak = (memory.argument_size_in_bytes + memory.output_size_in_bytes + memory.temp_size_in_bytes
            - memory.alias_size_in_bytes)
    if peak <= limit:
        return
    t = cfg.train
    temp = memory.temp_size_in_bytes
    accum = _grad_accum_to_fit(t.grad_accum, temp, limit - (peak - temp))
    fix = (f"about train.grad_accum={accum} (temporaries shrink with the microbatch), " if accum else "") + \
        "parallel.remat=full (keeps only each layer's input), a smaller train.global_batch_size or train.seq_len, " \
        "or more devices on mesh.data / mesh.fsdp"
    raise ConfigError(
        f"the compiled train step needs {peak / GiB:,.2f} GiB per device ({temp / GiB:,.2f} GiB of it activations "
        f"and temporaries for train.global_batch_size={t.global_batch_size} x train.seq_len={t.seq_len}, "
        f"train.grad_accum={t.grad_accum}, parallel.remat={cfg.parallel.remat}), more than the {limit / GiB:,.1f} GiB "
        f"{where}; nothing ran (valid: {fix})")


def _grad_accum_to_fit(grad_accum: int, per_microbatch: int, room: int) -> int | None:
    """The train.grad_accum at which `per_microbatch` bytes (which shrink with the microbatch) fit in `room`."""
    return grad_accum * math.ceil(per_microbatch / room) if room > 0 else None


def host_memory() -> int:
    """Bytes of physical memory on this host (what simulated CPU devices share)."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _device_limit(device: jax.Device, local_devices: int) -> tuple[int | None, str]:
    """(bytes one device may use, how to say where they come from); None when unknown."""
    stats = device.memory_stats() if device.platform != "cpu" else None
    if stats and stats.get("bytes_limit"):
        return int(stats["bytes_limit"]), f"{device.device_kind} makes available"
    spec = device_spec(device.device_kind)
    if spec is not None:
        return int(spec.hbm_bytes), f"of a {spec.name}"
    if device.platform == "cpu":
        host = host_memory()
        share = f"per simulated device ({host / GiB:.1f} GiB of host memory / {local_devices})"
        return host // max(local_devices, 1), share
    return None, ""

