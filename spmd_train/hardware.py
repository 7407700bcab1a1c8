"""Per-accelerator figures for MFU and the mesh planner, per JAX device (a TPU7x chip is two devices).

`device_spec(device_kind)`: the string jax reports -> dense bf16 peak and memory (MFU, the fit checks);
`hardware(kind)`: a planner name (`h100`, `v5p`, ...) -> `Hardware`, adding HBM bandwidth, the fast and slow links
with their per-hop latency, and how devices group into hosts and fast-link domains. Each figure cites its source
by tag; the tags' URLs (vendor datasheets and pages) are listed above `_TABLE`. `Link.bandwidth` is the bytes per
second one device moves through one ring collective: one direction for GPU links and NICs (NVIDIA's NVLink
figures, sums over both directions, halved), the bidirectional figure of one link for TPU ICI.

Sources and derivation: docs/explanation/hardware-figures.md
"""

from __future__ import annotations

from dataclasses import dataclass

from spmd_train.errors import ConfigError
from spmd_train.units import GiB


@dataclass(frozen=True)
class DeviceSpec:
    """What the planner and MFU need to know about one accelerator (per JAX device)."""

    name: str
    peak_bf16_flops: float
    hbm_bytes: float
    peak_fp8_flops: float | None = None
    """Dense FP8 matmul FLOP/s, where the chip has FP8 matmuls (None: it has none, or no source lists them)."""
    peak_int8_ops: float | None = None
    """Dense int8 matmul ops/s, where a source lists them (None: not listed)."""
    host_link: float | None = None
    """Bytes per second one device moves to or from its host's memory, each way (PCIe; None: no source consulted)."""


# Sources, cited by tag beside each figure below (docs/explanation/hardware-figures.md quotes each figure from its
# source, and says which value was chosen where sources disagree):
# [C-v4] https://cloud.google.com/tpu/docs/v4        [C-v5e] https://cloud.google.com/tpu/docs/v5e
# [C-v5p] https://cloud.google.com/tpu/docs/v5p      [C-v6e] https://cloud.google.com/tpu/docs/v6e
# [C-7x] https://cloud.google.com/tpu/docs/tpu7x
# [N-A100] https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf
# [S-A100] https://glennklockwood.com/garden/processors/A100 (the A100 datasheet's figures, as read)
# [N-H100] https://resources.nvidia.com/en-us-tensor-core/nvidia-tensor-core-gpu-datasheet (H100 SXM, PCIe, NVL)
# [S-H100] https://glennklockwood.com/garden/processors/h100 (the H100 datasheet's figures, as read)
# [N-H200] https://www.nvidia.com/en-us/data-center/h200/
# [N-BW] https://nvdam.widen.net/s/wwnsxrhm2w/blackwell-datasheet-3384703 (B200)
# [N-HGX] https://www.nvidia.com/en-us/data-center/hgx/ (HGX B200 system totals)
# [N-GB] https://www.nvidia.com/en-us/data-center/gb200-nvl72/ (NVL72 rack totals, divided by 72)
# [N-POD] https://docs.nvidia.com/dgx-basepod/reference-architecture-infrastructure-foundation-enterprise-ai/latest/core-components.html
# [S-IB] https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/nvidia-dgx-a100-datasheet.pdf (DGX A100 NICs)
# [AMD] https://www.amd.com/en/products/accelerators/instinct/mi300/mi300x.html
# [S-mi300] secondary pages agreeing with [AMD]: emergentmind.com (128 GB/s per xGMI link, both directions) and
#   gpu.blog (896 GB/s, fully connected 8-GPU xGMI)
# [AZ] https://github.com/MicrosoftDocs/azure-docs/blob/main/articles/virtual-machines/sizes/gpu-accelerated/nd-mi300x-v5-series.md
# [SB-T] https://jax-ml.github.io/scaling-book/tpus/ (tpus.md @ 54e2c43)
# [SB-G] https://jax-ml.github.io/scaling-book/gpus/ (gpus.md @ 1a55377)
# [SB] https://jax-ml.github.io/scaling-book/sharding/ (sharding.md @ 0819a7d)
# [NCCL] https://github.com/NVIDIA/nccl/blob/master/src/graph/tuning.cc (hwLat: Ring, Simple protocol)
# [M1] https://github.com/AI-Hypercomputer/maxtext/blob/e591f30/src/maxtext/utils/accelerator_to_spec_map.py
# _TABLE's rows, by source: v4 [C-v4]; v5e [C-v5e]; v5p [C-v5p]; v6e [C-v6e]; TPU7x [C-7x] (per chip / 2); A100
# [N-A100]; H100 SXM, PCIe and NVL [N-H100]; H200 [N-H200]; B200 [N-BW] (memory: 1,440 GB per DGX B200 / 8, [N-POD]);
# GB200 [N-GB] (360 PF sparse and 13.4 TB per NVL72 rack, / 72 / 2); MI300X [AMD]. Peaks are dense: NVIDIA's
# datasheets list 2:4-sparsity figures, twice the dense ones. Columns: name, bf16, HBM, FP8, int8. FP8: twice bf16
# on Hopper, Blackwell, MI300X and TPU7x ([C-7x]: 4,614 per chip), equal to bf16 on v5p and v6e (FP8 storage, no
# faster matmul: [C-v5p], [C-7x]'s table), none on v4, v5e and A100. int8: v4 275 "(bf16 or int8)" [C-v4], v5e 393
# [C-v5e], v5p 918 [SB-T], v6e 1,836 [C-v6e], A100 624 [N-A100]; not carried for the others (no source consulted).
# host_link, each way per device: TPU v4, v5e and v5p "typically around 1.5e10 bytes / second per chip", v6e
# "32GB/s, about 2x higher than v5" [SB-T]; PCIe Gen4 x16 on A100, 64 GB/s both ways together [N-A100]; PCIe Gen5
# x16 on H100 and H200, 128 GB/s both ways together [S-H100] [N-H200]; not carried for the others.
# Order matters: the first matching prefix wins ("TPU v5 lite" before "TPU v5").
_TABLE: tuple[tuple[str, DeviceSpec], ...] = (
    ("TPU v4", DeviceSpec("TPU v4", 275e12, 32 * GiB, None, 275e12, host_link=1.5e10)),
    ("TPU v5 lite", DeviceSpec("TPU v5e", 197e12, 16 * GiB, None, 393e12, host_link=1.5e10)),
    ("TPU v5e", DeviceSpec("TPU v5e", 197e12, 16 * GiB, None, 393e12, host_link=1.5e10)),
    ("TPU v5p", DeviceSpec("TPU v5p", 459e12, 95 * GiB, 459e12, 918e12, host_link=1.5e10)),
    ("TPU v5", DeviceSpec("TPU v5p", 459e12, 95 * GiB, 459e12, 918e12, host_link=1.5e10)),
    ("TPU v6 lite", DeviceSpec("TPU v6e", 918e12, 32 * GiB, 918e12, 1836e12, host_link=3.2e10)),
    ("TPU v6e", DeviceSpec("TPU v6e", 918e12, 32 * GiB, 918e12, 1836e12, host_link=3.2e10)),
    ("TPU7x", DeviceSpec("TPU7x (per TensorCore device)", 1153.5e12, 96 * GiB, 2307e12)),
    ("NVIDIA A100-SXM4-40GB", DeviceSpec("A100 40GB", 312e12, 40e9, None, 624e12, host_link=3.2e10)),
    ("NVIDIA A100-SXM4-80GB", DeviceSpec("A100 80GB", 312e12, 80e9, None, 624e12, host_link=3.2e10)),
    ("NVIDIA H100 PCIe", DeviceSpec("H100 PCIe", 756.5e12, 80e9, 1513e12, host_link=6.4e10)),
    ("NVIDIA H100 NVL", DeviceSpec("H100 NVL", 835.5e12, 94e9, 1670.5e12, host_link=6.4e10)),
    ("NVIDIA H100", DeviceSpec("H100 SXM", 989.5e12, 80e9, 1979e12, host_link=6.4e10)),
    ("NVIDIA H200", DeviceSpec("H200", 989.5e12, 141e9, 1979e12, host_link=6.4e10)),
    ("NVIDIA B200", DeviceSpec("B200", 2250e12, 180e9, 4500e12)),
    ("NVIDIA GB200", DeviceSpec("GB200", 2500e12, 186e9, 5000e12)),
    ("AMD Instinct MI300X", DeviceSpec("MI300X", 1307.4e12, 192e9, 2614.9e12)),
)


def device_spec(device_kind: str) -> DeviceSpec | None:
    """The spec for a `device_kind` string, or None where unknown (then MFU and fit are unknown)."""
    for prefix, spec in _TABLE:
        if device_kind.startswith(prefix):
            return spec
    return None


@dataclass(frozen=True)
class Link:
    """One interconnect as the α-β model sees it from one device (the module docstring defines `bandwidth`)."""

    name: str
    bandwidth: float
    """Bytes per second one device moves through one ring collective over this link."""
    latency: float
    """α: seconds per hop, whatever the message size."""
    efficiency: float | None = None
    """Fraction of `bandwidth` a collective reaches; None: the planner's assumed `LINK_EFFICIENCY` (a nominal
    figure), 1.0 where `bench-collectives` measured `bandwidth` (`analysis.plan.profile`)."""


@dataclass(frozen=True)
class Hardware:
    """One accelerator kind for the planner: peaks, memory, links and how devices group (per JAX device)."""

    kind: str
    """The planner name: h100, v5p, ..."""
    spec: DeviceSpec
    """Dense bf16 peak and HBM bytes, the same row MFU uses (`device_spec`)."""
    hbm_bandwidth: float
    """Bytes per second of HBM per device."""
    fast: Link
    """The intra-node / intra-slice link: NVLink, xGMI or ICI."""
    slow: Link
    """The inter-node / inter-slice link: InfiniBand, RoCE or DCN."""
    devices_per_host: int
    """Devices one host (one process) drives."""
    fast_domain: int
    """Most devices one fast-link domain holds: a GPU node or NVLink rack, or the largest TPU slice."""
    torus: int = 0
    """Dimensions of the ICI torus (3: v4, v5p, tpu7x; 2: v5e, v6e); 0 for switched GPU links."""
    devices_per_chip: int = 1
    """JAX devices per chip (2 on TPU7x, whose TensorCores are separate devices)."""
    achievable: float | None = None
    """Fraction of the dense peak matmuls sustain; None: the planner's assumed `ACHIEVABLE_FRACTION`, else the
    `bench-collectives` matmul probe's measurement (`analysis.plan.profile`)."""
    simulated: bool = False
    """XLA:CPU's simulated devices (`cpu`): they share the host's cores and memory, so an idle device's cores
    serve the others (a pipeline bubble costs no time) and collectives run in line with compute (none overlap)."""

    @property
    def peak_flops(self) -> float:
        """Dense bf16 FLOP/s per device."""
        return self.spec.peak_bf16_flops

    @property
    def hbm_bytes(self) -> float:
        """HBM bytes per device."""
        return self.spec.hbm_bytes

    def matmul_peak(self, matmul: str) -> float:
        """Dense FLOP/s per device of the matmuls precision.matmul=`matmul` runs: the chip's FP8 or int8 peak where
        it has one, else the bf16 peak (a chip without FP8 or int8 matmuls computes them at its bf16 rate)."""
        low = {"fp8": self.spec.peak_fp8_flops, "int8": self.spec.peak_int8_ops}.get(matmul)
        return low or self.spec.peak_bf16_flops


_NVLINK_ALPHA = 3.4e-6  # [NCCL] hwLat NVLink, Ring, Simple
_NET_ALPHA = 14e-6  # [NCCL] hwLat network, Ring, Simple
_ICI_ALPHA = 1e-6  # [SB]: "Each hop over an ICI link has some intrinsic overhead ... typically around 1us"
# DCN: no published per-hop figure; assumed the same order as InfiniBand's, hence NCCL's network value.
_DCN_ALPHA = _NET_ALPHA


def _ib(gbps: float, what: str) -> Link:
    """A NIC per device rated at `gbps` Gb/s per direction (NIC ratings are per direction: module docstring)."""
    return Link(what, gbps / 8 * 1e9, _NET_ALPHA)


def _dcn(gbps_per_chip: float, devices_per_chip: int = 1) -> Link:
    """DCN at `gbps_per_chip` Gb/s per chip, shared by the chip's devices."""
    return Link("DCN", gbps_per_chip / 8 * 1e9 / devices_per_chip, _DCN_ALPHA)


def _ici(one_way_per_link: float, devices_per_chip: int = 1) -> Link:
    """ICI along one torus dimension: 2 x one-way per link (module docstring), shared by the chip's devices."""
    return Link("ICI", 2 * one_way_per_link / devices_per_chip, _ICI_ALPHA)


_PLANNER: dict[str, Hardware] = {
    # NVLink: per-GPU totals over both directions halved (module docstring): A100 600 -> 300, Hopper 900 -> 450,
    # Blackwell 1,800 -> 900 GB/s [SB-G][N-A100][N-H100][N-BW]. Scale-out: one NIC per GPU [N-POD][S-IB][AZ].
    "a100": Hardware(
        # The 80 GB SXM4 part (DGX A100 640 GB); the 40 GB part differs only in memory and HBM bandwidth.
        "a100", device_spec("NVIDIA A100-SXM4-80GB"), 2.039e12,  # [S-A100]
        Link("NVLink 3", 300e9, _NVLINK_ALPHA), _ib(200, "HDR InfiniBand 200 Gb/s"),  # [S-IB]: 8 x CX-6 200 Gb/s
        devices_per_host=8, fast_domain=8),  # 6 x NVSwitch gen 2 [N-A100]
    "h100": Hardware(
        "h100", device_spec("NVIDIA H100 80GB HBM3"), 3.35e12,  # [N-H100][S-H100]
        Link("NVLink 4", 450e9, _NVLINK_ALPHA), _ib(400, "NDR InfiniBand 400 Gb/s"),  # [N-POD]: 8 x CX-7 400 Gb/s
        devices_per_host=8, fast_domain=8),
    "h200": Hardware(
        "h200", device_spec("NVIDIA H200"), 4.8e12,  # [N-H200]
        Link("NVLink 4", 450e9, _NVLINK_ALPHA), _ib(400, "NDR InfiniBand 400 Gb/s"),  # [N-POD]
        devices_per_host=8, fast_domain=8),
    "b200": Hardware(
        "b200", device_spec("NVIDIA B200"), 8e12,  # [N-HGX]: HGX B200 64 TB/s per 8 GPUs
        Link("NVLink 5", 900e9, _NVLINK_ALPHA), _ib(400, "NDR InfiniBand 400 Gb/s"),  # [N-POD]: 8 x CX-7
        devices_per_host=8, fast_domain=8),
    "gb200": Hardware(
        # The NVLink domain is the whole NVL72 rack (72 GPUs, [N-GB]): the planner's fast/slow split follows the
        # links, so the "node" a slow factor crosses is the rack. A host (compute tray) drives 2 superchips = 4 GPUs
        # (NVIDIA's NVL72 has 18 compute trays of 4 GPUs; some summaries say 8 per host).
        "gb200", device_spec("NVIDIA GB200"), 8e12,  # [N-GB]: 576 TB/s / 72
        Link("NVLink 5", 900e9, _NVLINK_ALPHA), _ib(400, "InfiniBand 400 Gb/s"),  # [SB-G]: 72 x 400 Gb/s per rack
        devices_per_host=4, fast_domain=72),
    "mi300x": Hardware(
        # xGMI: 7 peer links x 64 GB/s per direction, fully connected [AMD][S-mi300]; a collective over the 8 GPUs
        # of a node runs rings over all peers at once (assumed), so the sum is what it can use. α: NCCL's NVLink
        # value (RCCL descends from NCCL; assumed).
        "mi300x", device_spec("AMD Instinct MI300X"), 5.3e12,  # [AMD][S-mi300]
        Link("Infinity Fabric (xGMI)", 7 * 64e9, _NVLINK_ALPHA), _ib(400, "NDR InfiniBand 400 Gb/s"),  # [AZ]
        devices_per_host=8, fast_domain=8),
    # TPUs. ICI one-way per link: v5e 50, v5p and v6e 100 GB/s (Cloud per-chip bidi / (2 x ports));
    # v4 45 GB/s ([SB-T], the only source). DCN per chip from Cloud's Gbps or NICs per host.
    # fast_domain is the largest single slice: beyond it, multislice over DCN.
    "v4": Hardware(
        "v4", device_spec("TPU v4"), 1.2e12,  # [C-v4]
        _ici(45e9),
        # DCN per v4 chip is not published: the scaling-book's per-chip DCN figure for v4p/v5p,
        # 6.25e9 B/s = 50 Gb/s [SB-T], is assumed.
        _dcn(50),
        devices_per_host=4, fast_domain=4096, torus=3),  # [C-v4]: 4 chips per host, pod 4,096 chips, 3D
    "v5e": Hardware(
        "v5e", device_spec("TPU v5 lite"), 819e9,  # [C-v5e]: the chip table's 819 GBps
        _ici(50e9),
        _dcn(25),  # [C-v5e]: 2 x 100 Gb/s NICs per 8-chip host; [SB-T] 3.125e9 B/s per chip
        devices_per_host=8, fast_domain=256, torus=2),  # 16x16, 2D torus
    "v5p": Hardware(
        "v5p", device_spec("TPU v5"), 2765e9,  # [C-v5p]
        _ici(100e9),
        _dcn(50),  # [C-v5p]: 50 Gb/s per chip
        devices_per_host=4, fast_domain=6144, torus=3),  # [C-v5p]: largest single-slice job 6,144 chips
    "v6e": Hardware(
        "v6e", device_spec("TPU v6 lite"), 1638e9,  # [C-v6e] (latest version), [C-7x]
        _ici(100e9),
        _dcn(100),  # [C-v6e][C-7x]: 4 x 200 Gb/s NICs per 8-chip host
        devices_per_host=8, fast_domain=256, torus=2),
    "tpu7x": Hardware(
        # Two devices per chip share its HBM bandwidth, ICI and DCN: per-device figures are the chip's halved.
        # ICI links per chip are not stated in [C-7x]; the chip's 1,200 GB/s bidi equals v5p's 6 x 200, so v5p's
        # 100 GB/s one-way per link is assumed.
        "tpu7x", device_spec("TPU7x"), 7380e9 / 2,  # [C-7x]
        _ici(100e9, devices_per_chip=2),
        _dcn(100, devices_per_chip=2),  # [C-7x]: 100 Gb/s per chip
        devices_per_host=8, fast_domain=2 * 9216, torus=3, devices_per_chip=2),  # [M1]: 4 chips per VM; pod 9,216
}

_PLANNER["cpu"] = Hardware(
    # Simulated CPU devices (`--xla_force_host_platform_device_count`), for checking the planner on this host. No
    # figure here is nominal: compute, memory and links all come from a `bench-collectives` profile of the host
    # (`analysis.plan.profile.simulated_hardware`), so the zeros make a plan without one refuse (`search`).
    "cpu", DeviceSpec("CPU (simulated devices)", 0.0, 0.0), 0.0,
    Link("host memory", 0.0, 0.0), Link("host memory", 0.0, 0.0),
    devices_per_host=1 << 16, fast_domain=1 << 16, simulated=True)

KINDS = tuple(_PLANNER)
"""Valid planner hardware names."""


def hardware(kind: str) -> Hardware:
    """The planner's figures for accelerator `kind` (lower case, e.g. "h100", "v5p"); ConfigError if unknown."""
    try:
        return _PLANNER[kind]
    except (KeyError, TypeError):
        raise ConfigError(f"unknown hardware kind {kind!r} (valid: {', '.join(KINDS)})") from None
