"""Peak dense bf16 FLOP/s and memory per JAX device, keyed by `device_kind`.

Figures and sources: ../shared/hardware.md (dense peaks, per JAX device: a TPU7x chip is two
devices). GPU memory is the marketed capacity; at run time prefer
`device.memory_stats()["bytes_limit"]`.
"""

from __future__ import annotations

from dataclasses import dataclass

GiB = 1024**3


@dataclass(frozen=True)
class DeviceSpec:
    """What the planner and MFU need to know about one accelerator (per JAX device)."""

    name: str
    peak_bf16_flops: float
    hbm_bytes: float


# Order matters: the first matching prefix wins ("TPU v5 lite" before "TPU v5").
_TABLE: tuple[tuple[str, DeviceSpec], ...] = (
    ("TPU v4", DeviceSpec("TPU v4", 275e12, 32 * GiB)),
    ("TPU v5 lite", DeviceSpec("TPU v5e", 197e12, 16 * GiB)),
    ("TPU v5e", DeviceSpec("TPU v5e", 197e12, 16 * GiB)),
    ("TPU v5p", DeviceSpec("TPU v5p", 459e12, 95 * GiB)),
    ("TPU v5", DeviceSpec("TPU v5p", 459e12, 95 * GiB)),
    ("TPU v6 lite", DeviceSpec("TPU v6e", 918e12, 32 * GiB)),
    ("TPU v6e", DeviceSpec("TPU v6e", 918e12, 32 * GiB)),
    ("TPU7x", DeviceSpec("TPU7x (per TensorCore device)", 1153.5e12, 96 * GiB)),
    ("NVIDIA A100-SXM4-40GB", DeviceSpec("A100 40GB", 312e12, 40e9)),
    ("NVIDIA A100-SXM4-80GB", DeviceSpec("A100 80GB", 312e12, 80e9)),
    ("NVIDIA H100 PCIe", DeviceSpec("H100 PCIe", 756.5e12, 80e9)),
    ("NVIDIA H100 NVL", DeviceSpec("H100 NVL", 835.5e12, 94e9)),
    ("NVIDIA H100", DeviceSpec("H100 SXM", 989.5e12, 80e9)),
    ("NVIDIA H200", DeviceSpec("H200", 989.5e12, 141e9)),
    ("NVIDIA B200", DeviceSpec("B200", 2250e12, 180e9)),
    ("NVIDIA GB200", DeviceSpec("GB200", 2500e12, 186e9)),
    ("AMD Instinct MI300X", DeviceSpec("MI300X", 1307.4e12, 192e9)),
)


def device_spec(device_kind: str) -> DeviceSpec | None:
    """The spec for a `device_kind` string, or None where unknown (then MFU and fit are unknown)."""
    for prefix, spec in _TABLE:
        if device_kind.startswith(prefix):
            return spec
    return None
