"""The devices a plan is for (`Target`): how many, of which kind, and how the slow link groups them.

Two ways to name them: `--devices N --hardware KIND` (a GPU cluster of whole nodes, or TPU chips
without a slice shape) or `--topology NAME` (a TPU slice, `v5p:8x8x8`, or several joined over DCN,
`2xv5p:8x8x8`). Either gives a device count and the number of fast-link domains: GPU nodes (or
NVLink racks, `Hardware.fast_domain`) and TPU slices. Between domains only the slow link
(InfiniBand, DCN) runs, and its factors go on the outer mesh axes (`SLOW_AXES`; `mesh.dcn`, docs/multi-host.md),
which `slow_placements` enumerates. Pure Python: the planner reads this before jax starts.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from itertools import product

from spmd_train.config.mesh_schema import MESH_AXES
from spmd_train.errors import ConfigError
from spmd_train.hardware import KINDS, Hardware, hardware

SLOW_AXES = ("data", "pipeline", "fsdp")
"""The outer mesh axes that may cross the slow link (`config.mesh_schema.MESH_AXES`: the fastest links go to the last,
inner axes)."""
TPU_KINDS = tuple(k for k in KINDS if hardware(k).torus)
TOPOLOGY_EXAMPLES = "v5e:2x4, v5e:16x16, v6e:16x16, v4:2x2x2, v5p:4x4x4, v5p:8x8x16, tpu7x:4x4x4, 2xv5p:8x8x8"
_TOPOLOGY = re.compile(r"^(?:(?P<slices>[1-9]\d*)x)?(?P<kind>[a-z0-9]+):(?P<shape>\d+(?:x\d+)*)$")


@dataclass(frozen=True)
class Target:
    """Devices to plan for: the hardware, the count, and the fast-link domains the slow link joins."""

    hardware: Hardware
    devices: int
    domains: int = 1
    """GPU nodes (NVLink domains) or TPU slices; more than one means some mesh factors cross the slow link."""
    topology: str | None = None
    """The `--topology` name as given, e.g. "2xv5p:8x8x8" (None for `--devices`)."""
    slice_topology: str | None = None
    """One slice's name, e.g. "v5p:8x8x8": what libtpu compiles for (None for `--devices`)."""

    @property
    def platform(self) -> str:
        """"tpu", "gpu" or "cpu" (simulated devices): what the attention and MoE backends resolve for."""
        return "cpu" if self.hardware.simulated else "tpu" if self.hardware.torus else "gpu"

    @property
    def per_domain(self) -> int:
        """Devices in one fast-link domain."""
        return self.devices // self.domains

    @property
    def hosts(self) -> int:
        """Hosts (processes) that drive the devices."""
        return -(-self.devices // self.hardware.devices_per_host)

    def describe(self) -> str:
        """One line: count, kind, and how the devices group (e.g. "256 x h100: 32 nodes of 8 ...")."""
        hw = self.hardware
        if hw.simulated:
            return f"{self.devices} simulated CPU devices sharing this host's cores and memory"
        unit = "slice" if hw.torus else ("rack" if hw.fast_domain > hw.devices_per_host else "node")
        where = self.topology or f"{self.devices} x {hw.kind}"
        if self.domains == 1:
            return f"{where}: one {unit} ({hw.fast.name}), {self.hosts} host{'s' if self.hosts > 1 else ''}"
        return (f"{where}: {self.domains} {unit}s of {self.per_domain} ({hw.fast.name} inside, {hw.slow.name} "
                f"between), {self.hosts} hosts")


def target_for(devices: int | None, kind: str | None, topology: str | None) -> Target:
    """The target of `--devices N --hardware KIND` or `--topology NAME` (ConfigError for any other mix)."""
    if topology is not None:
        if devices is not None or kind is not None:
            given = " and ".join(f"--{k} {v}" for k, v in (("devices", devices), ("hardware", kind)) if v is not None)
            raise ConfigError(f"--topology {topology} names the devices already; {given} cannot be given with it "
                              f"(valid: --topology NAME alone, or --devices N --hardware KIND)")
        return parse_topology(topology)
    if devices is None or kind is None:
        missing = "--hardware KIND" if devices is not None else "--devices N" if kind is not None else "the devices"
        raise ConfigError(f"plan needs {missing}: give --devices N --hardware KIND (KIND one of {', '.join(KINDS)}) "
                          f"or --topology NAME (e.g. {TOPOLOGY_EXAMPLES})")
    hw = hardware(kind)
    if devices < 1:
        raise ConfigError(f"--devices {devices} is invalid: a plan needs at least one device (valid: an integer >= 1)")
    if devices <= hw.fast_domain:
        return Target(hw, devices)
    if devices % hw.fast_domain:
        unit = "slices" if hw.torus else "nodes"
        raise ConfigError(
            f"--devices {devices} --hardware {kind}: more than one {hw.fast_domain}-device "
            f"{unit[:-1]} must be whole {unit} joined by {hw.slow.name} (valid: 1 to {hw.fast_domain}, or a multiple "
            f"of {hw.fast_domain}: {devices // hw.fast_domain * hw.fast_domain} or "
            f"{(devices // hw.fast_domain + 1) * hw.fast_domain})")
    return Target(hw, devices, devices // hw.fast_domain)


def parse_topology(name: str) -> Target:
    """A TPU slice `KIND:AxB[xC]`, or `Nx` of them over DCN (ConfigError naming valid examples)."""
    match = _TOPOLOGY.match(name or "")
    kind = match["kind"] if match else None
    if kind not in TPU_KINDS:
        why = f"{kind!r} is not a TPU kind (valid: {', '.join(TPU_KINDS)})" if match else "it does not parse"
        raise ConfigError(f"--topology {name!r} is invalid: {why}; a topology is [SLICESx]KIND:SHAPE, e.g. "
                          f"{TOPOLOGY_EXAMPLES}")
    hw = hardware(kind)
    dims = [int(d) for d in match["shape"].split("x")]
    chips = math.prod(dims)
    if len(dims) != hw.torus or chips < 1:
        raise ConfigError(f"--topology {name!r} is invalid: a {kind} slice has {hw.torus} dimensions of at least 1, "
                          f"e.g. {kind}:{'x'.join(['4'] * hw.torus)} (valid examples: {TOPOLOGY_EXAMPLES})")
    per_slice = chips * hw.devices_per_chip
    if per_slice > hw.fast_domain:
        raise ConfigError(f"--topology {name!r} is invalid: one {kind} slice holds at most "
                          f"{hw.fast_domain // hw.devices_per_chip} chips, not {chips} (valid: a smaller shape, or "
                          f"several slices, e.g. 2x{kind}:...)")
    slices = int(match["slices"] or 1)
    return Target(hw, per_slice * slices, slices, topology=name, slice_topology=f"{kind}:{match['shape']}")


def slow_placements(sizes: tuple[int, ...], domains: int) -> list[tuple[int, ...]]:
    """Every `mesh.dcn` (factors in `MESH_AXES` order) putting `domains` slow-link factors on the outer axes,
    each factor dividing its axis; one all-ones tuple for a single domain, none where the outer axes cannot."""
    if domains == 1:
        return [(1,) * len(MESH_AXES)]
    outer = [MESH_AXES.index(a) for a in SLOW_AXES]
    choices = [_divisors(math.gcd(sizes[i], domains)) for i in outer]
    out = []
    for factors in product(*choices):
        if math.prod(factors) == domains:
            dcn = [1] * len(MESH_AXES)
            for i, f in zip(outer, factors, strict=True):
                dcn[i] = f
            out.append(tuple(dcn))
    return out


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
