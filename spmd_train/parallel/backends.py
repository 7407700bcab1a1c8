"""The implementations a run uses, chosen once when the engine is built and handed to the model.

The engine knows the platform (from its mesh's devices), the mesh and the per-device shapes;
it resolves the `backends` section (`attention=auto`, the Pallas kernels' block sizes and the TPU VMEM
fallback, the MoE implementation) into one `Backends` record. The model passes it to
`parallel.attention` and `parallel.moe_ffn`; nothing inspects the platform while tracing.
`describe` shows the record, and a run prints it at start and writes it to `config.json`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import get_args

import jax.numpy as jnp

from spmd_train.config.attention_facts import (
    VARIANTS,
    attention_facts,
    computes,
    fallback_attention,
    kernel_head_width,
    model_variants,
    valid_on,
)
from spmd_train.config.model_schema import AttentionImpl, BackendsConfig, ModelConfig, MoEImpl
from spmd_train.errors import ConfigError
from spmd_train.kernels.flash_attention import TPU_VMEM_BUDGET, BlockSizes, tpu_vmem_bytes
from spmd_train.kernels.flash_attention.api import default_blocks

ATTENTION, MOE = get_args(AttentionImpl), get_args(MoEImpl)


@dataclass(frozen=True)
class Backends:
    """What runs attention and the experts on this run's platform, and why."""

    platform: str
    """"cpu", "gpu" or "tpu": the platform of the mesh's devices."""
    attention: str
    """"pallas", "cudnn" or "xla" (never "auto")."""
    kernels: str | None = None
    """With attention=pallas: which Pallas kernels, "tpu" (Mosaic) or "gpu" (Mosaic GPU, Hopper)."""
    interpret: bool = False
    """With attention=pallas on a CPU: the kernels run in Pallas' interpreter (for tests; slow)."""
    blocks: tuple[int, int] | None = None
    """With attention=pallas: (block_q, block_k), the config's or the kernels' default for the platform."""
    moe: str = "capacity"
    """The expert dispatch: "capacity" (all_to_all of fixed slots), "capacity_dedup" (of fixed rows per device, one per
    token and device) or "dropless" (ragged all_to_all)."""
    capacity_factor: float | None = 1.25
    """With moe=capacity: slots per expert = ceil(k x tokens per group x capacity_factor / num_experts)."""
    reason: str = ""
    """Why attention is what it is, when `auto` chose it."""
    context: str | None = None
    """With mesh.sequence > 1: how attention joins the devices' chunks ("allgather", "ring" or "ulysses")."""
    sequence: int = 1
    """The size of the `sequence` mesh axis: how many chunks each sequence is split into."""

    @property
    def zigzag(self) -> int:
        """N when ring attention needs the tokens in zigzag order over N devices (`parallel.ring`), else 1."""
        return self.sequence if self.context == "ring" else 1

    def to_json(self) -> dict:
        """Plain values, for config.json and `describe --json`."""
        return asdict(self)

    def describe(self) -> str:
        """One line: 'attention pallas (tpu kernels, blocks 512x512), experts capacity (factor 1.25) on tpu'."""
        detail = ""
        if self.attention == "pallas":
            where = f"{self.kernels} kernels{', interpreted' if self.interpret else ''}"
            detail = f" ({where}, blocks {self.blocks[0]}x{self.blocks[1]})"
        why = f"; {self.reason}" if self.reason else ""
        experts = f"{self.moe} (factor {self.capacity_factor})" if self.capacity_factor is not None else self.moe
        context = f", context-parallel {self.context} over sequence={self.sequence}" if self.context else ""
        return f"attention {self.attention}{detail}{context}, experts {experts} on {self.platform}{why}"


def resolve_backends(model: ModelConfig, choice: BackendsConfig, platform: str,
                     local_q: tuple[int, ...] | None = None, local_kv: tuple[int, ...] | None = None, *,
                     documents: bool = False, context: str = "allgather", sequence: int = 1) -> Backends:
    """The record for `choice` (the config's backends section) running `model` on `platform`, given each
    device's q and k/v shapes [b, l, heads, head_dim] and whether packed documents are masked.

    `auto` means our Pallas kernels on TPU (plain XLA if the blocks would not fit the kernels' VMEM
    budget for these shapes), cuDNN on GPU (our Mosaic GPU kernels reach 0.83-1.01x cuDNN's
    forward+backward on an H100: `pallas` selects them), XLA on CPU (Pallas runs there only when
    asked for, interpreted). With documents masked, GPU gets our kernels where they run (bfloat16,
    head_dim a multiple of 64): they take segment ids, cuDNN through jax only a dense mask.
    Without local shapes the VMEM check uses the whole model's. With `sequence` > 1, `context` is
    the context-parallel scheme; `allgather` and `ring` merge partial results by log-sum-exp, which cuDNN
    through jax does not return, so on GPU `auto` takes our kernels where they run, else XLA.
    """
    if choice.attention not in ATTENTION:
        raise ValueError(f"backends.attention={choice.attention!r} is not an implementation "
                         f"(valid: {', '.join(ATTENTION)})")
    if choice.moe not in MOE:
        raise ValueError(f"backends.moe={choice.moe!r} is not an implementation (valid: {', '.join(MOE)})")
    kernels = "gpu" if platform == "gpu" else "tpu"
    interpret = platform == "cpu"
    blocks = (BlockSizes(*choice.attention_blocks) if choice.attention_blocks else
              default_blocks(kernels, interpret, kernel_head_width(model)))
    impl, reason = choice.attention, ""
    experts = {"moe": choice.moe, "capacity_factor": None if choice.moe == "dropless" else choice.capacity_factor,
               "context": context if sequence > 1 else None, "sequence": sequence}
    needs_lse = sequence > 1 and context in ("allgather", "ring")
    if impl == "auto":
        if platform == "tpu" and model.compute_dtype == "float16":
            impl, reason = "xla", "auto: XLA, our Pallas kernels take float32 or bfloat16 (model.compute_dtype=float16)"
        elif platform == "tpu":
            hd = model.resolved_head_dim
            q = local_q or (1, 1, model.num_heads, hd)
            kv = local_kv or (1, 1, model.num_kv_heads, hd)
            need = tpu_vmem_bytes(q, kv, jnp.dtype(model.compute_dtype), blocks)
            impl = "pallas" if need <= TPU_VMEM_BUDGET else "xla"
            reason = (f"auto: Pallas kernels, {need / 2**20:.1f} MiB of VMEM" if impl == "pallas" else
                      f"auto: XLA, the Pallas blocks {blocks.block_q}x{blocks.block_k} would need "
                      f"{need / 2**20:.1f} MiB of VMEM, over the {TPU_VMEM_BUDGET / 2**20:.0f} MiB budget")
        elif platform == "gpu" and documents and _gpu_kernels_run(model):
            impl, reason = "pallas", "auto: Pallas kernels on gpu, which mask documents by segment ids"
        elif platform == "gpu" and needs_lse:
            impl = "pallas" if _gpu_kernels_run(model) else "xla"
            reason = f"auto: {impl} on gpu, context-parallel {context} merges by log-sum-exp (cuDNN returns none)"
        else:
            impl = "cudnn" if platform == "gpu" else "xla"
            reason = f"auto: {impl} on {platform}"
            if impl == "cudnn" and documents:
                reason += " (documents as a dense mask: our kernels need bfloat16 and head_dim a multiple of 64)"
    if choice.attention == "auto" and not computes(impl, model):
        preferred = impl
        kernels_run = platform == "tpu" or (platform == "gpu" and _gpu_kernels_run(model))
        impl = "pallas" if impl != "pallas" and kernels_run and computes("pallas", model) else fallback_attention()
        lacking = [VARIANTS[v] for v in model_variants(model) if v not in attention_facts(preferred).variants]
        reason = f"auto: {impl}, as {preferred} does not compute {' or '.join(lacking)}"
    if platform not in attention_facts(impl).platforms:
        raise ConfigError(f"backends.attention={impl} needs {attention_facts(impl).needs}; this run's devices are "
                          f"{platform} (valid here: {', '.join(valid_on(platform))})")
    if impl != "pallas":
        return Backends(platform=platform, attention=impl, reason=reason, **experts)
    return Backends(platform=platform, attention="pallas", kernels=kernels, interpret=interpret,
                    blocks=(blocks.block_q, blocks.block_k), reason=reason, **experts)


def _gpu_kernels_run(model: ModelConfig) -> bool:
    """Whether the Mosaic GPU kernels take this model's attention: bfloat16 operands and 64-wide head tiles (every
    variant: windows and soft-caps inside, sinks and MLA's padding outside)."""
    return jnp.dtype(model.compute_dtype) == jnp.bfloat16 and kernel_head_width(model) % 64 == 0
