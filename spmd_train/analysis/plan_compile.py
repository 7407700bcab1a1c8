"""The planner's compile stage: the best K candidates compiled with `describe`, their compiled memory and collective
bytes put in place of the estimates (`plan.compiled.rescore`), and the K ranked again.

Where they compile:
- `--topology`: libtpu compiles for the slice on this host (the `tpu-aot` extra); several slices come
  from `jax.experimental.topologies.get_topology_desc(..., num_slices=N)`, whose devices carry their
  slice index, so the mesh puts the `mesh.dcn` factors across slices as a real run would (the transfers
  between slices are the megascale sends `analysis.hlo` reads as collectives over the slow axes);
- GPU kinds: XLA:CPU on as many simulated devices as the target has, up to `MAX_SIMULATED_DEVICES`.
  The SPMD program is partitioned and compiled once whatever the device count, and the collectives are
  the same groups a GPU run has; the attention is XLA's, not cuDNN's (`compiled.rescore` accounts for it); a
  layout that offloads to host memory compiles without it (XLA:CPU's host is its device) and the estimated
  saving is subtracted;
- TPU kinds named by `--devices`: no slice shape to compile for, so the stage says to give `--topology`.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

import jax

from spmd_train.analysis.plan.candidate import Candidate, Workload
from spmd_train.analysis.plan.compiled import Compiled, rescore
from spmd_train.analysis.plan.labels import Scope, config_for
from spmd_train.analysis.plan.model import estimate
from spmd_train.analysis.plan.ranking import Ranked, tie_order
from spmd_train.analysis.plan.rejections import REFUSED, Rejection
from spmd_train.analysis.plan.search import SearchResult
from spmd_train.analysis.render import PIPELINE_FLOPS_NOTE
from spmd_train.analysis.step_report import describe
from spmd_train.analysis.topology import has_libtpu, tpu_topology_devices
from spmd_train.config.mesh_schema import OFFLOADS_ACTIVATIONS
from spmd_train.devices import simulate_devices
from spmd_train.errors import ConfigError

MAX_SIMULATED_DEVICES = 1024
"""Most simulated CPU devices the stage compiles on. Measured on this 2-core host: the tiny config compiled in
7.9, 9.1 and 8.0 s on 8, 64 and 256 devices (0.57-0.64 GB resident), llama3-8b (fsdp x tensor 8, 8192 tokens a
row) in 12.4 s on 64 and 10.1 s on 1024 devices (0.63 and 0.72 GB): the count barely matters, since the program is
compiled once. Nothing above 1024 was measured, so there the stage is skipped and says why."""
COMPILED_FIT = "does not fit in HBM when compiled"
PIPELINE_NOTE = "pipelined programs: their compiled collective bytes are shown, and the estimates time the step"
HOST_NOTE = ("offloading layouts: XLA:CPU's host and device are one memory, so each was compiled without its offload "
             "and the estimated saving subtracted from that peak")


@dataclass(frozen=True)
class CompileStage:
    """What the compile stage did: where, how long, each compiled candidate's figures, and the final order."""

    where: str
    """The devices compiled for, e.g. "8 simulated CPU devices" (empty when skipped)."""
    skipped: str | None
    """Why nothing was compiled, or None."""
    compiled: dict[str, Compiled]
    """By label, every candidate that compiled (fitting or not)."""
    dropped: tuple[Rejection, ...]
    """Candidates that did not fit when compiled, or that the compile refused."""
    order: tuple[Ranked, ...]
    """The final ranking: the compiled candidates that fit, by re-estimated step time, then the others as ranked."""
    seconds: float


def compile_stage(result: SearchResult, k: int, devices: list[jax.Device] | None = None) -> CompileStage:
    """Compile the best `k` candidates of `result` and rank them again on their compiled figures."""
    start = time.perf_counter()
    if k == 0:
        return CompileStage("", "--compile 0: analytic estimates only", {}, (), result.ranked, 0.0)
    found = _devices(result, devices)
    if isinstance(found, str):
        return CompileStage("", found, {}, (), result.ranked, 0.0)
    devs, platform, where = found
    compiled, dropped = {}, []
    for ranked in result.ranked[:k]:
        c = ranked.estimate.candidate
        built = _without_offload(c) if platform == "cpu" else c
        cfg = config_for(result.cfg, built)
        try:
            report = describe(cfg, devices=devs)
        except ConfigError as err:
            dropped.append(Rejection(c, Scope.FULL, REFUSED, f"refused when compiled: {err}", "invalid"))
            continue
        reference = estimate(result.shape, built, result.target.hardware, global_batch=cfg.train.global_batch_size,
                             seq_len=cfg.train.seq_len, workload=Workload.from_config(cfg, platform))
        notes = tuple(n for n in report.notes if n != PIPELINE_FLOPS_NOTE)
        if built != c:
            notes = (*notes, HOST_NOTE)
        collectives = _by_axes(report.collectives)
        if c.pipeline > 1:
            notes = (*notes, PIPELINE_NOTE)
        found = rescore(result.shape, result.workload, result.target.hardware, ranked.estimate, reference,
                        platform=platform, seconds=report.compile_seconds,
                        peak_compiled=report.per_device["peak_bytes"], collectives=collectives,
                        replace_bytes=c.pipeline == 1, notes=notes)
        compiled[ranked.label] = found
        if not found.fits:
            peak = "refused by the compiler" if found.peak is None else f"{found.peak / 2**30:.1f} GiB"
            dropped.append(Rejection(c, Scope.FULL, COMPILED_FIT, f"does not fit when compiled: {peak} > "
                                     f"{result.target.hardware.hbm_bytes / 2**30:.1f} GiB", "memory", peak=found.peak))
    gone = {r.candidate for r in dropped}
    fitting = sorted((r for r in result.ranked[:k] if r.label in compiled and compiled[r.label].fits),
                     key=lambda r: (compiled[r.label].timing.step, r.label))
    first = tie_order(fitting, lambda r: compiled[r.label].timing)
    rest = [r for r in result.ranked if r.label not in compiled and r.estimate.candidate not in gone]
    return CompileStage(where, None, compiled, tuple(dropped), (*first, *rest), time.perf_counter() - start)


def _without_offload(c: Candidate) -> Candidate:
    """`c` keeping everything on the device: what XLA:CPU, whose host and device are one memory, compiles in its place
    (the offload's saving is then the estimates' difference, `compiled.rescore`)."""
    if not c.offload and c.remat not in OFFLOADS_ACTIVATIONS:
        return c
    return dataclasses.replace(c, offload=0.0, remat="full" if c.remat in OFFLOADS_ACTIVATIONS else c.remat)


def _devices(result: SearchResult, given: list[jax.Device] | None) -> tuple[list[jax.Device], str, str] | str:
    """(devices, platform, description) to compile on, or why there are none."""
    target = result.target
    n = target.devices
    if target.platform == "tpu":
        if target.topology is None:
            return (f"--devices {n} --hardware {target.hardware.kind} names no slice shape to compile for: give "
                    f"--topology (e.g. {target.hardware.kind}:4x4x4) for the compile stage")
        if not has_libtpu():
            return ("compiling for a TPU slice needs libtpu, which is not installed here: `pip install -e "
                    "'.[tpu-aot]'`")
        devs = tpu_topology_devices(target.slice_topology)
        if target.domains > 1:
            from jax.experimental import topologies

            devs = list(topologies.get_topology_desc(platform="tpu", topology_name=target.slice_topology,
                                                     num_slices=target.domains).devices)
        return devs, "tpu", f"TPU {target.topology} through libtpu"
    if n > MAX_SIMULATED_DEVICES:
        return (f"{n} devices is more than the {MAX_SIMULATED_DEVICES} simulated CPU devices this stage compiles on "
                "(the largest count measured; see plan_compile.MAX_SIMULATED_DEVICES)")
    if given is None:
        try:
            simulate_devices(n)
        except ConfigError as err:
            return f"cannot simulate {n} CPU devices in this process: {err}"
        given = jax.devices()
    if len(given) < n or given[0].platform != "cpu":
        return f"this process has {len(given)} {given[0].platform} devices, not the {n} simulated CPU devices needed"
    return list(given[:n]), "cpu", f"{n} simulated CPU devices (XLA:CPU)"


def _by_axes(collectives) -> dict[tuple[str, ...], tuple[float, int, str]]:
    """Compiled collectives per set of mesh axes: (bytes, launches, the op with the most bytes)."""
    per_op: dict[tuple[str, ...], dict[str, float]] = {}
    out: dict[tuple[str, ...], tuple[float, int, str]] = {}
    for s in collectives:
        ops = per_op.setdefault(s.axes, {})
        ops[s.op] = ops.get(s.op, 0.0) + s.bytes
        nbytes, count, _ = out.get(s.axes, (0.0, 0, ""))
        out[s.axes] = (nbytes + s.bytes, count + s.count, max(ops, key=ops.get))
    return out
