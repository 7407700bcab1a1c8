"""A measured hardware profile (`spmd-train bench-collectives`) and the `Hardware` the planner uses from it.

The fit is the planner's own α-β model (`timing.collective_seconds`) read backwards: per collective, a
least-squares line of time against size·factor has slope β and intercept hops·α. Pure Python (no jax): the
planner reads profiles before jax starts.

Derivation: docs/explanation/planner-model.md#calibrating-from-a-measured-profile
"""

from __future__ import annotations

import json
import os
import statistics
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from spmd_train.errors import ConfigError
from spmd_train.hardware import Hardware, Link, device_spec

FORMAT = "spmd-train hardware profile 1"
OPS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")


def traffic_factor(op: str, n: int) -> float:
    """Bytes one device sends per byte of message in a ring `op` over n devices (the planner's factor)."""
    if op == "all-reduce":
        return 2 * (n - 1) / n
    if op in ("all-gather", "reduce-scatter", "all-to-all"):
        return (n - 1) / n
    if op == "collective-permute":
        return 1.0
    raise ValueError(f"unknown collective {op!r} (valid: {', '.join(OPS)})")


def hops(op: str, n: int) -> int:
    """Latency terms (α) of a ring `op` over n devices, as `timing.collective_seconds` counts them."""
    traffic_factor(op, n)  # validates op
    return {"all-reduce": 2 * (n - 1), "collective-permute": 1}.get(op, n - 1)


def algorithm_bandwidth(size: float, seconds: float) -> float:
    """NCCL-tests' algbw: message bytes per device over the time."""
    return size / seconds


def bus_bandwidth(op: str, n: int, size: float, seconds: float) -> float:
    """NCCL-tests' busbw: algbw x the op's traffic factor (2(n-1)/n all-reduce, (n-1)/n gather/scatter/a2a)."""
    return algorithm_bandwidth(size, seconds) * traffic_factor(op, n)


def fit_line(xs: list[float], ts: list[float]) -> tuple[float, float]:
    """(intercept, slope) >= 0 of t = a + b·x minimising relative squared error (weights 1/t²).

    Relative, not absolute, error: times span five orders of magnitude from 1 KiB to 256 MiB, and an
    unweighted fit would let the largest message decide the intercept alone. Where the best line has a negative
    intercept (or slope), the constrained optimum lies on a = 0 (or b = 0): the problem is a convex quadratic.
    """
    if len(xs) != len(ts) or len(set(xs)) < 2:
        raise ValueError("a line needs timings at two or more distinct sizes")
    rows = [(1 / t**2, x, t) for x, t in zip(xs, ts, strict=True)]
    s, sx, st = (sum(w * x**k * t**j for w, x, t in rows) for k, j in ((0, 0), (1, 0), (0, 1)))
    sxx, sxt = (sum(w * x**k * t**j for w, x, t in rows) for k, j in ((2, 0), (1, 1)))
    b = (s * sxt - sx * st) / (s * sxx - sx * sx)
    a = (st - b * sx) / s
    if a < 0:
        a, b = 0.0, sxt / sxx
    if b < 0:
        a, b = st / s, 0.0
    return a, b


@dataclass(frozen=True)
class Measurement:
    """One collective's median time over one mesh axis at one message size."""

    op: str
    axis: str
    group: int
    bytes: int
    seconds: float

    @property
    def busbw(self) -> float:
        """NCCL-tests' bus bandwidth of this run (bytes/s)."""
        return bus_bandwidth(self.op, self.group, self.bytes, self.seconds)


@dataclass(frozen=True)
class Fit:
    """α and β of one collective over one mesh axis, fitted to its measurements."""

    axis: str
    op: str
    group: int
    intercept: float
    """Seconds of a zero-byte collective: hops(op, group)·α."""
    alpha: float
    """Seconds per hop, the planner's `Link.latency`."""
    beta: float
    """Seconds per byte a device sends, 1 / the planner's `Link.bandwidth` (0 where no slope was measurable)."""
    busbw: float
    """The highest bus bandwidth measured (bytes/s)."""
    points: int

    def predict(self, size: float) -> float:
        """Seconds the fitted model gives a message of `size` bytes per device."""
        return self.intercept + size * traffic_factor(self.op, self.group) * self.beta


def fit(measurements: list[Measurement]) -> Fit:
    """The α-β fit of one (axis, op)'s measurements (all of one group size)."""
    first = measurements[0]
    xs = [m.bytes * traffic_factor(m.op, m.group) for m in measurements]
    intercept, beta = fit_line(xs, [m.seconds for m in measurements])
    return Fit(axis=first.axis, op=first.op, group=first.group, intercept=intercept,
               alpha=intercept / hops(first.op, first.group), beta=beta,
               busbw=max(m.busbw for m in measurements), points=len(measurements))


def fit_all(measurements: list[Measurement]) -> tuple[Fit, ...]:
    """One fit per (axis, op), in the order first measured."""
    groups: dict[tuple[str, str], list[Measurement]] = {}
    for m in measurements:
        groups.setdefault((m.axis, m.op), []).append(m)
    return tuple(fit(ms) for ms in groups.values())


@dataclass(frozen=True)
class Matmul:
    """The matmul probe: sustained FLOP/s of one device and, where the table knows its peak, the fraction."""

    dtype: str
    size: int
    flops_per_second: float
    peak: float | None
    devices: int = 1
    """Devices that ran it at once, each its own matmul (`flops_per_second` is per device): every simulated CPU
    device, since they share the host's cores; one accelerator."""

    @property
    def fraction(self) -> float | None:
        """Measured over peak FLOP/s; None where the peak is unknown (CPU)."""
        return self.flops_per_second / self.peak if self.peak else None


@dataclass(frozen=True)
class Profile:
    """What `bench-collectives` measured on one machine, with where and when."""

    created: str
    """ISO 8601 time of the run (UTC)."""
    jax_version: str
    platform: str
    device_kind: str
    """The string jax reports (`device.device_kind`), matched against the planner's hardware by `device_spec`."""
    device_count: int
    mesh: tuple[tuple[str, int], ...]
    """The benchmarked mesh's axes and sizes, outermost first."""
    slow_axes: tuple[str, ...]
    """Axes whose groups cross the slow link (inter-node); their fits calibrate `Hardware.slow`."""
    repeats: int
    measurements: tuple[Measurement, ...]
    fits: tuple[Fit, ...]
    matmul: Matmul | None = None
    host_memory: int | None = None
    """The host's physical memory in bytes, recorded on CPU, whose simulated devices share it."""

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict (`from_json` reads it back)."""
        out = asdict(self)
        out["mesh"] = dict(self.mesh)
        return {"format": FORMAT, **out}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Profile:
        """The profile `to_json` wrote; ValueError where the dict is not one."""
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise ValueError(f"not a hardware profile (no \"format\": \"{FORMAT}\")")
        try:
            return cls(created=data["created"], jax_version=data["jax_version"], platform=data["platform"],
                       device_kind=data["device_kind"], device_count=int(data["device_count"]),
                       mesh=tuple((str(a), int(n)) for a, n in data["mesh"].items()),
                       slow_axes=tuple(data["slow_axes"]), repeats=int(data["repeats"]),
                       measurements=tuple(Measurement(**m) for m in data["measurements"]),
                       fits=tuple(Fit(**f) for f in data["fits"]),
                       matmul=Matmul(**data["matmul"]) if data.get("matmul") else None,
                       host_memory=data.get("host_memory"))
        except (KeyError, TypeError, AttributeError) as err:
            raise ValueError(f"a hardware profile with a missing or malformed field ({err})") from None


def save_profile(profile: Profile, path: Path) -> None:
    """Write `profile` as indented JSON to `path`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(profile.to_json(), indent=2) + "\n")


def load_profile(path: str | Path) -> Profile:
    """The profile in `path`; ConfigError naming the file where it cannot be read as one."""
    try:
        return Profile.from_json(json.loads(Path(path).read_text()))
    except OSError as err:
        raise ConfigError(f"--profile {path}: cannot read it ({err.strerror}) (valid: a JSON file written by "
                          "`spmd-train bench-collectives --out FILE`)") from None
    except ValueError as err:
        raise ConfigError(f"--profile {path}: {err} (valid: a JSON file written by `spmd-train bench-collectives "
                          "--out FILE`)") from None


def profile_hardware(profile: Profile, hw: Hardware, source: str = "the profile",
                     devices: int | None = None) -> Hardware:
    """`hw` with the links and achievable compute fraction `profile` measured in place of the table's figures
    (`simulated_hardware` for the `cpu` kind, planning `devices` of them).

    The fast link takes the median α and 1/β over the fits of axes not marked slow, the slow link those of the
    slow axes (left nominal where none was measured); a measured link's efficiency is 1 (the planner's
    `LINK_EFFICIENCY` discounts nominal figures only). The median over the five collectives: the planner gives
    each axis one link for every op. ConfigError where the profile was measured on another kind of device.
    """
    if hw.simulated:
        return simulated_hardware(profile, hw, profile.device_count if devices is None else devices, source)
    if device_spec(profile.device_kind) != hw.spec:
        raise ConfigError(
            f"{source} was measured on {profile.device_count} x {profile.device_kind!r} ({profile.platform}) "
            f"devices, but the plan is for {hw.kind} ({hw.spec.name}): its links and compute would stand for "
            f"another machine's (valid: a profile written by `spmd-train bench-collectives` on {hw.kind} devices, "
            f"or plan for the hardware the profile was measured on)")
    fast = [f for f in profile.fits if f.axis not in profile.slow_axes]
    slow = [f for f in profile.fits if f.axis in profile.slow_axes]
    achievable = profile.matmul.fraction if profile.matmul else None
    return replace(hw, fast=measured_link(hw.fast, fast), slow=measured_link(hw.slow, slow),
                   achievable=hw.achievable if achievable is None else achievable)


def measured_link(nominal: Link, fits: list[Fit]) -> Link:
    """`nominal` with the median α and bandwidth of `fits` (unchanged where no fit has a measurable slope)."""
    usable = [f for f in fits if f.beta > 0 and f.group > 1]
    if not usable:
        return nominal
    bandwidth = statistics.median(1 / f.beta for f in usable)
    return Link(f"{nominal.name}, measured", bandwidth, statistics.median(f.alpha for f in usable), efficiency=1.0)


def simulated_hardware(profile: Profile, hw: Hardware, devices: int, source: str = "the profile") -> Hardware:
    """The `cpu` kind from a profile of this host's simulated devices: every figure measured, none nominal.

    Compute: the probe's FLOP/s per device with all of them multiplying at once (they share the host's cores),
    reached in full (achievable 1). Memory: the host's, split evenly. Links: the fits' median α and bandwidth, one
    link (a copy through host memory). The devices share cores, so the figures hold for the count measured only.
    ConfigError where the profile is not of CPU devices, of another count, or lacks the probe or a usable fit.
    """
    valid = (f"valid: a profile written by `spmd-train bench-collectives --simulate-devices {devices} --mesh ...` "
             "on this host")
    if profile.platform != "cpu":
        raise ConfigError(f"{source} was measured on {profile.device_count} x {profile.device_kind!r} "
                          f"({profile.platform}) devices, but --hardware cpu plans simulated CPU devices ({valid})")
    if profile.device_count != devices:
        raise ConfigError(f"{source} timed {profile.device_count} simulated devices sharing the host's cores, and "
                          f"the plan is for {devices}: each device's share of compute and copies differs ({valid}, "
                          f"or --devices {profile.device_count})")
    if profile.matmul is None or profile.matmul.flops_per_second <= 0:
        raise ConfigError(f"{source} has no matmul probe, the cpu kind's only compute figure ({valid})")
    link = measured_link(hw.fast, list(profile.fits))
    if link.bandwidth <= 0:
        raise ConfigError(f"{source} has no collective fit with a measurable bandwidth ({valid}, over sizes "
                          "large enough for the time to grow with them, e.g. --sizes 1KiB..64MiB)")
    memory = profile.host_memory if profile.host_memory else host_memory()
    spec = replace(hw.spec, peak_bf16_flops=profile.matmul.flops_per_second, hbm_bytes=memory / devices)
    return replace(hw, spec=spec, fast=link, slow=link, achievable=1.0)


def host_memory() -> int:
    """This host's physical memory in bytes (POSIX sysconf)."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
