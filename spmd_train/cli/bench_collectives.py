"""`spmd-train bench-collectives`: time the collectives over each mesh axis, fit α and β, write a profile.

The profile (`analysis.plan.profile`) replaces the hardware table's nominal link and compute figures in
`spmd-train plan --profile FILE`. One process on this host's devices (or `--simulate-devices N` CPU devices).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import re
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from spmd_train.analysis.plan.profile import OPS, Matmul, Measurement, Profile, fit_all, host_memory, save_profile
from spmd_train.config.mesh_schema import MESH_AXES
from spmd_train.errors import ConfigError

DEFAULT_SIZES = "1KiB..256MiB"
SAFETY = 8
"""A message may use at most 1/SAFETY of a device's memory: an op holds its input and output (up to 2 x the
size), XLA's temporaries for the reduction (about one more), and the allocator and the rest of the process need
room; 8 leaves twice that. On CPU the simulated devices share the host's available RAM, split evenly."""
_UNITS = {"b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30}
_SIZE = re.compile(r"^\s*(\d+)\s*([kmg]ib|b)?\s*$", re.IGNORECASE)
log = logging.getLogger("spmd_train")


def add_bench_parser(sub: Any) -> None:
    """The `bench-collectives` subcommand and its options."""
    bench = sub.add_parser(
        "bench-collectives", help="time all-reduce, all-gather, reduce-scatter, all-to-all and permute per mesh axis "
        "and write a hardware profile for `plan --profile`",
        description="On the current devices, time each collective over each mesh axis for message sizes from "
        "--sizes (bytes per device, NCCL-tests' size), fit latency α and inverse bandwidth β per axis and "
        "collective, report bus bandwidth (NCCL-tests: algbw x 2(n-1)/n for all-reduce, x (n-1)/n for all-gather, "
        "reduce-scatter and all-to-all), probe matmul throughput, and write the profile.")
    bench.add_argument("--mesh", nargs="+", metavar="AXIS=N", default=None,
                       help=f"mesh axis sizes, axes among {', '.join(MESH_AXES)} (default: data=all devices)")
    bench.add_argument("--slow", nargs="+", metavar="AXIS", default=(),
                       help="axes whose groups cross the slow (inter-node) link: they calibrate the slow link")
    bench.add_argument("--sizes", default=DEFAULT_SIZES, metavar="A..B|S,S,...",
                       help=f"message sizes per device: A..B steps by 4x, or a comma list (default {DEFAULT_SIZES}; "
                       f"capped at 1/{SAFETY} of a device's memory)")
    bench.add_argument("--repeats", type=int, default=10, metavar="R", help="timed runs per size, median (default 10)")
    bench.add_argument("--out", default="profile.json", metavar="FILE", help="profile to write (default profile.json)")
    bench.add_argument("--json", action="store_true", help="print the profile as JSON instead of tables")
    bench.add_argument("--simulate-devices", type=int, metavar="N",
                       help="run on N simulated CPU devices (as run.simulate_devices)")


def parse_size(text: str) -> int:
    """Bytes of "64KiB", "1MiB", "512" (units B, KiB, MiB, GiB); ConfigError otherwise."""
    match = _SIZE.match(text)
    if not match or int(match[1]) < 1:
        raise ConfigError(f"--sizes: {text!r} is not a size (valid: a positive integer with an optional unit B, KiB, "
                          f"MiB or GiB, e.g. 64KiB)")
    return int(match[1]) * _UNITS[(match[2] or "b").lower()]


def parse_sizes(text: str) -> list[int]:
    """Message sizes of "A..B" (A, 4A, 16A, ... up to B) or "S,S,..." (items may be ranges), ascending."""
    sizes: set[int] = set()
    for item in text.split(","):
        low, dots, high = item.partition("..")
        if not dots:
            sizes.add(parse_size(low))
            continue
        size, top = parse_size(low), parse_size(high)
        if top < size:
            raise ConfigError(f"--sizes {item!r}: the range ends below where it starts (valid: A..B with A <= B)")
        while size <= top:
            sizes.add(size)
            size *= 4
    return sorted(sizes)


def parse_mesh(items: list[str] | None, devices: int) -> dict[str, int]:
    """Axis sizes of `AXIS=N ...` (default: every device on `data`); ConfigError naming the valid axes."""
    if not items:
        return {"data": devices}
    sizes: dict[str, int] = {}
    for item in items:
        axis, eq, value = item.partition("=")
        if not eq or axis not in MESH_AXES or not value.isdigit() or int(value) < 1 or axis in sizes:
            raise ConfigError(f"--mesh {item!r} is invalid (valid: AXIS=N once per axis, AXIS one of "
                              f"{', '.join(MESH_AXES)}, N >= 1)")
        sizes[axis] = int(value)
    if math.prod(sizes.values()) != devices:
        raise ConfigError(f"--mesh {' '.join(items)} holds {math.prod(sizes.values())} devices, but there are "
                          f"{devices} (valid: sizes whose product is {devices})")
    return sizes


def memory_cap(device: Any, count: int) -> int:
    """The largest message per device this run allows: 1/SAFETY of the device's memory (CPU: of host RAM / count)."""
    if device.platform == "cpu":
        return int(_host_available() / count / SAFETY)
    stats = device.memory_stats() or {}
    if "bytes_limit" in stats:
        return int(stats["bytes_limit"] / SAFETY)
    from spmd_train.hardware import device_spec

    spec = device_spec(device.device_kind)
    return int(spec.hbm_bytes / SAFETY) if spec else 2**30


def _host_available() -> float:
    # MemAvailable counts reclaimable page cache, which a fresh allocation can take; sysconf's free pages do not.
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2


def run_bench(args: argparse.Namespace) -> int:
    """Measure, fit, print and write the profile as the options ask; ConfigError for bad input."""
    sizes = parse_sizes(args.sizes)
    if args.repeats < 1:
        raise ConfigError(f"--repeats {args.repeats} is invalid (valid: an integer >= 1)")
    from spmd_train.devices import simulate_devices

    simulate_devices(args.simulate_devices)  # before anything below starts jax's backend
    import jax

    from spmd_train.config.mesh_schema import MeshConfig
    from spmd_train.mesh import build_mesh
    from spmd_train.parallel.collective_bench import matmul_probe, time_collective

    devices = jax.devices()
    axes = parse_mesh(args.mesh, len(devices))
    unknown = [a for a in args.slow if a not in axes]
    if unknown:
        raise ConfigError(f"--slow {' '.join(unknown)}: not an axis of the benchmarked mesh (valid: "
                          f"{', '.join(axes)})")
    mesh = build_mesh(MeshConfig(**{a: axes.get(a, 1) for a in MESH_AXES}), devices)
    cap = memory_cap(devices[0], len(devices))
    kept = [s for s in sizes if s <= cap]
    if len(kept) < 2:
        raise ConfigError(f"--sizes {args.sizes}: {len(kept)} size(s) at or below the memory cap of {_bytes(cap)} "
                          f"per device, and a fit needs two (valid: two or more sizes up to {_bytes(cap)})")
    if len(kept) < len(sizes):
        log.info("bench-collectives: sizes above %s per device skipped (1/%d of the memory)", _bytes(cap), SAFETY)
    timed_axes = [a for a in mesh.axis_names if mesh.shape[a] > 1]
    measurements = []
    for axis in timed_axes:
        for op in OPS:
            log.info("bench-collectives: %s over %s (%d devices)", op, axis, mesh.shape[axis])
            for size in kept:
                t = time_collective(mesh, op, axis, size, args.repeats)
                measurements.append(Measurement(op=t.op, axis=t.axis, group=t.group, bytes=t.bytes, seconds=t.seconds))
    probe = matmul_probe(devices, repeats=args.repeats)
    profile = Profile(
        created=datetime.now(UTC).isoformat(timespec="seconds"), jax_version=jax.__version__,
        platform=devices[0].platform, device_kind=devices[0].device_kind, device_count=len(devices),
        mesh=tuple((a, mesh.shape[a]) for a in mesh.axis_names if a in axes), slow_axes=tuple(args.slow),
        repeats=args.repeats, measurements=tuple(measurements), fits=fit_all(measurements),
        matmul=Matmul(probe.dtype, probe.size, probe.flops_per_second, probe.peak, probe.devices),
        host_memory=host_memory() if devices[0].platform == "cpu" else None)
    if args.out:
        save_profile(profile, Path(args.out))
    if args.json:
        print(json.dumps(profile.to_json(), indent=2))
    else:
        render(profile, args.out)
    return 0


def render(profile: Profile, out: str | None) -> None:
    """Rich tables of the measurements and the fits, and the matmul probe's line."""
    console = Console(width=None if sys.stdout.isatty() else 140)
    mesh = " ".join(f"{a}={n}" for a, n in profile.mesh)
    console.print(f"[bold]bench-collectives[/bold] on {profile.device_count} x {profile.device_kind} "
                  f"({profile.platform}), mesh {mesh}, jax {profile.jax_version}, median of {profile.repeats}")
    table = Table(title="Collectives (size: bytes per device, NCCL-tests convention)", title_justify="left")
    for col in ("op", "axis", "n", "size", "median", "algbw", "busbw"):
        table.add_column(col, justify="left" if col in ("op", "axis") else "right")
    for m in profile.measurements:
        table.add_row(m.op, m.axis, str(m.group), _bytes(m.bytes), _seconds(m.seconds),
                      _rate(m.bytes / m.seconds), _rate(m.busbw))
    console.print(table)
    fits = Table(title="α-β fit per axis and collective: t = hops·α + size·factor·β", title_justify="left")
    for col in ("axis", "op", "n", "α per hop", "hops·α", "1/β", "best busbw", "points"):
        fits.add_column(col, justify="left" if col in ("axis", "op") else "right")
    for f in profile.fits:
        fits.add_row(f.axis, f.op, str(f.group), _seconds(f.alpha), _seconds(f.intercept),
                     _rate(1 / f.beta) if f.beta > 0 else "unmeasured", _rate(f.busbw), str(f.points))
    console.print(fits)
    if profile.matmul:
        m = profile.matmul
        fraction = f", {m.fraction:.1%} of the {m.peak / 1e12:,.1f} TFLOP/s peak" if m.fraction else \
            " (no peak known for this device: FLOP/s only)"
        console.print(f"matmul {m.size}x{m.size} {m.dtype}: {m.flops_per_second / 1e9:,.1f} GFLOP/s{fraction}")
    if out:
        console.print(f"profile written to {out}; use it with: spmd-train plan CONFIG ... --profile {out}")


def _bytes(n: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:g} {unit}"
    return f"{n:g} B"


def _seconds(s: float) -> str:
    if s >= 1:
        return f"{s:.2f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.2f} ms"
    return f"{s * 1e6:.1f} µs"


def _rate(bps: float) -> str:
    return f"{bps / 1e9:.2f} GB/s"
