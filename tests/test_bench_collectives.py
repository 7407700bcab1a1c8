"""`spmd-train bench-collectives`: the α-β fit, the bus-bandwidth convention, the timed collectives' values, the
profile's round trip and its use by `plan --profile`. No timing is asserted: these machines are shared."""

from __future__ import annotations

import dataclasses
import json
import math
import random

import jax
import numpy as np
import pytest

from spmd_train.analysis.plan import Candidate, ModelShape, Workload, estimate
from spmd_train.analysis.plan.comm import CommTerm
from spmd_train.analysis.plan.profile import (
    OPS,
    Fit,
    Matmul,
    Measurement,
    Profile,
    bus_bandwidth,
    fit,
    fit_line,
    hops,
    host_memory,
    load_profile,
    profile_hardware,
    traffic_factor,
)
from spmd_train.analysis.plan.timing import collective_seconds
from spmd_train.cli.bench_collectives import parse_mesh, parse_sizes
from spmd_train.cli.main import main
from spmd_train.config import load_config
from spmd_train.config.mesh_schema import MeshConfig
from spmd_train.errors import ConfigError
from spmd_train.hardware import hardware
from spmd_train.mesh import build_mesh
from spmd_train.parallel import collective_bench

TINY = "configs/tiny.yaml"
SIZES = [2**10 * 4**k for k in range(8)]  # 1 KiB .. 16 MiB


def _synthetic(op: str, n: int, alpha: float, beta: float, noise: float = 0.0, seed: int = 0) -> list[Measurement]:
    rng = random.Random(seed)
    return [Measurement(op, "data", n, s, (hops(op, n) * alpha + s * traffic_factor(op, n) * beta)
                        * (1 + rng.gauss(0, noise))) for s in SIZES]


@pytest.mark.parametrize("op", OPS)
def test_the_fit_recovers_alpha_and_beta_exactly_from_noiseless_timings(op):
    got = fit(_synthetic(op, 8, alpha=3.4e-6, beta=1 / 450e9))
    assert got.alpha == pytest.approx(3.4e-6, rel=1e-9)
    assert got.beta == pytest.approx(1 / 450e9, rel=1e-9)
    assert got.intercept == pytest.approx(hops(op, 8) * 3.4e-6, rel=1e-9)


@pytest.mark.parametrize("op", OPS)
def test_the_fit_recovers_alpha_and_beta_within_tolerance_from_noisy_timings(op):
    # 5% multiplicative noise, 8 sizes: the relative-error weighting keeps the small sizes deciding α.
    got = fit(_synthetic(op, 8, alpha=14e-6, beta=1 / 50e9, noise=0.05, seed=OPS.index(op)))
    assert got.alpha == pytest.approx(14e-6, rel=0.15)
    assert got.beta == pytest.approx(1 / 50e9, rel=0.15)


def test_the_fit_stays_non_negative_and_needs_two_sizes():
    # t = 2x - 1 has a negative intercept: the constrained fit is the weighted line through the origin.
    ratios = [1 / 1, 2 / 3, 3 / 5]  # x / t
    assert fit_line([1.0, 2.0, 3.0], [1.0, 3.0, 5.0]) == pytest.approx((0.0, sum(ratios) / sum(r * r for r in ratios)))
    assert fit_line([1.0, 2.0], [2.0, 1.0])[1] == 0.0  # time falling with size: no slope
    with pytest.raises(ValueError, match="two or more"):
        fit_line([1.0, 1.0], [1.0, 2.0])


def test_bus_bandwidth_follows_nccl_tests():
    # NCCL-tests' PERFORMANCE.md: 8 ranks, 1 GB in 10 ms is algbw 100 GB/s; all-reduce busbw x 2·7/8, gather x 7/8.
    assert bus_bandwidth("all-reduce", 8, 1e9, 0.01) == pytest.approx(175e9)
    for op in ("all-gather", "reduce-scatter", "all-to-all"):
        assert bus_bandwidth(op, 8, 1e9, 0.01) == pytest.approx(87.5e9)
    assert bus_bandwidth("collective-permute", 8, 1e9, 0.01) == pytest.approx(100e9)
    assert OPS == collective_bench.OPS


@pytest.mark.parametrize("op", OPS)
def test_the_fit_is_the_planners_model_read_backwards(op):
    # A profile of one fit gives a Hardware on which the planner times that collective as the fit predicts it.
    f = fit(_synthetic(op, 8, alpha=5e-6, beta=1 / 100e9))
    hw = profile_hardware(_h100_profile([f]), hardware("h100"))
    size = 64 * 2**20
    term = CommTerm(op, ("data",), size * traffic_factor(op, 8), 1, "grad-reduce")
    assert collective_seconds(term, Candidate(data=8), hw) == pytest.approx(f.predict(size), rel=1e-9)


# --- the timed collectives compute the right values --------------------------------------------------------------

@pytest.mark.parametrize("axis", ["fsdp", "tensor"])
@pytest.mark.parametrize("op", OPS)
def test_each_collective_over_one_axis_of_a_2x4_mesh_returns_the_right_values(devices, op, axis):
    mesh = build_mesh(MeshConfig(fsdp=2, tensor=4), devices)
    shape = (2, 4)  # fsdp x tensor: the mesh's only axes larger than one, in mesh order
    n, a = mesh.shape[axis], ("fsdp", "tensor").index(axis)
    inputs, outputs = collective_bench.message_elements(op, 64 * 4, n)
    x = np.arange(8 * inputs, dtype=np.float32).reshape(*shape, inputs)
    got = np.asarray(collective_bench.collective(mesh, op, axis)(collective_bench.placed_input(mesh, inputs, x)))
    assert got.reshape(*shape, outputs).tolist() == _reference(op, x, a, n).tolist()


def _reference(op: str, x: np.ndarray, a: int, n: int) -> np.ndarray:
    """Each device's output, computed on the host; `a` is the mesh dimension the collective runs over."""
    y = np.moveaxis(x, a, 0)  # (n, other, k)
    total = y.sum(0, keepdims=True)
    if op == "all-reduce":
        out = np.broadcast_to(total, y.shape)
    elif op == "all-gather":
        out = np.broadcast_to(np.concatenate(list(y), axis=-1), (n, *y.shape[1:-1], y.shape[-1] * n))
    elif op == "reduce-scatter":
        out = np.stack(np.split(total[0], n, axis=-1))
    elif op == "all-to-all":  # device i's chunk j goes to device j's position i
        chunks = np.stack(np.split(y, n, axis=-1), axis=1)  # (sender, receiver, other, k/n)
        out = np.stack([np.concatenate([chunks[s, r] for s in range(n)], axis=-1) for r in range(n)])
    else:  # a ring shift by one: device i receives device i-1's buffer
        out = np.roll(y, 1, axis=0)
    return np.moveaxis(np.asarray(out), 0, a)


def test_the_matmul_probe_runs_every_cpu_device_at_once_and_has_no_fraction_without_a_known_peak(devices):
    # Simulated devices share the host's cores: the per-device figure a step sees is with all of them busy.
    probe = collective_bench.matmul_probe(devices, repeats=1, size=128)
    assert probe.dtype == "float32" and probe.flops_per_second > 0 and probe.devices == len(devices) == 8
    assert probe.peak is None and probe.fraction is None


# --- CLI parsing, the CLI run and plan --profile ------------------------------------------------------------------

def test_sizes_and_mesh_parse_or_are_refused_with_the_valid_forms():
    assert parse_sizes("1KiB..256MiB") == [2**10 * 4**k for k in range(10)]
    assert parse_sizes("1KiB..16KiB,100") == [100, 1024, 4096, 16384]
    assert parse_mesh(None, 8) == {"data": 8}
    assert parse_mesh(["data=2", "tensor=4"], 8) == {"data": 2, "tensor": 4}
    for bad in ("1KB", "0", "4MiB..1MiB"):
        with pytest.raises(ConfigError, match="valid"):
            parse_sizes(bad)
    for bad in (["rows=8"], ["data=3"], ["data=2", "data=4"]):
        with pytest.raises(ConfigError, match="valid"):
            parse_mesh(bad, 8)


@pytest.mark.slow
def test_a_tiny_cli_run_writes_a_profile_that_round_trips_and_plan_refuses_it_for_h100(tmp_path, capsys):
    out = tmp_path / "profile.json"
    assert main(["bench-collectives", "--sizes", "1KiB..16KiB", "--repeats", "2", "--simulate-devices", "8",
                 "--mesh", "data=2", "tensor=4", "--out", str(out), "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    profile = load_profile(out)
    assert json.loads(json.dumps(profile.to_json())) == printed == json.loads(out.read_text())
    assert Profile.from_json(profile.to_json()) == profile
    assert profile.device_kind == jax.devices()[0].device_kind and profile.device_count == 8
    assert dict(profile.mesh) == {"data": 2, "tensor": 4} and profile.jax_version == jax.__version__
    assert {(f.axis, f.op) for f in profile.fits} == {(a, op) for a in ("data", "tensor") for op in OPS}
    assert len(profile.measurements) == 2 * len(OPS) * 3  # 1, 4, 16 KiB
    assert all(m.seconds > 0 for m in profile.measurements) and profile.matmul.flops_per_second > 0

    code = main(["plan", TINY, "--devices", "8", "--hardware", "h100", "--compile", "0", "--profile", str(out)])
    err = capsys.readouterr().err
    assert code == 2
    assert "'cpu'" in err and "h100" in err and str(out) in err
    assert profile.host_memory == host_memory() and profile.matmul.devices == 8

    # The cpu kind plans these simulated devices from this profile alone: its figures are the measured ones.
    cpu = ["plan", TINY, "--devices", "8", "--hardware", "cpu", "--compile", "0"]
    assert main([*cpu, "--json", "--profile", str(out)]) == 0
    planned = json.loads(capsys.readouterr().out)
    assert planned["target"] == "8 simulated CPU devices sharing this host's cores and memory"
    hw = profile_hardware(profile, hardware("cpu"), devices=8)
    assert hw.peak_flops == profile.matmul.flops_per_second and hw.achievable == 1.0
    assert hw.hbm_bytes == profile.host_memory / 8 and hw.fast == hw.slow and hw.fast.efficiency == 1.0
    for args, says in ((cpu, "--hardware cpu has no nominal figures"),
                       ([*cpu[:3], "4", *cpu[4:], "--profile", str(out)], "timed 8 simulated devices")):
        assert main(args) == 2
        err = capsys.readouterr().err
        assert says in err and "bench-collectives --simulate-devices" in err and "Traceback" not in err


def test_a_profile_that_is_not_one_is_refused(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"format": "something else"}))
    assert main(["plan", TINY, "--devices", "8", "--hardware", "h100", "--compile", "0", "--profile", str(bad)]) == 2
    assert "not a hardware profile" in capsys.readouterr().err


def test_simulated_devices_hide_no_communication_and_pay_no_bubble():
    # XLA:CPU's devices share the host's cores: collectives run in line, and an idle stage's cores serve the others.
    shape = ModelShape.from_config(load_config("configs/pipeline.yaml").model)
    work = Workload(64, 256)
    c = Candidate(pipeline=4, fsdp=2, zero_stage=3, pipeline_schedule="1f1b", pipeline_microbatches=8)
    gpu = hardware("h100")
    cpu = dataclasses.replace(gpu, kind="cpu", simulated=True)
    real, simulated = (estimate(shape, c, hw, global_batch=64, seq_len=256, workload=work).timing for hw in (gpu, cpu))
    assert real.bubble == simulated.bubble > 0 and real.compute == simulated.compute
    assert simulated.exposed == simulated.communication > real.exposed  # ZeRO-3 gathers hide on the GPU only
    assert simulated.step == pytest.approx(simulated.compute + simulated.communication, rel=1e-12)
    assert real.step == pytest.approx(real.compute / (1 - real.bubble) + real.exposed, rel=1e-12)


def _h100_profile(fits: list[Fit], fraction: float | None = None) -> Profile:
    return Profile(created="2026-01-01T00:00:00+00:00", jax_version="0.10.2", platform="gpu",
                   device_kind="NVIDIA H100 80GB HBM3", device_count=8, mesh=(("data", 8),), slow_axes=(),
                   repeats=5, measurements=(), fits=tuple(fits),
                   matmul=Matmul("bfloat16", 8192, fraction * 989.5e12, 989.5e12) if fraction else None)


def test_a_slower_measured_link_or_compute_lengthens_the_planned_step():
    shape = ModelShape.from_config(load_config(TINY).model)
    c = Candidate(data=8, zero_stage=0)
    nominal = hardware("h100")

    def step(hw):
        return estimate(shape, c, hw, global_batch=64, seq_len=256, workload=Workload(64, 256)).timing.step

    slow_link = _h100_profile([fit(_synthetic(op, 8, alpha=20e-6, beta=1 / 20e9)) for op in OPS])
    measured = profile_hardware(slow_link, nominal)
    assert measured.fast.bandwidth == pytest.approx(20e9) and measured.fast.latency == pytest.approx(20e-6)
    assert measured.fast.efficiency == 1.0 and measured.slow == nominal.slow  # no axis marked slow
    assert step(measured) > step(nominal)
    fast_link = _h100_profile([fit(_synthetic(op, 8, alpha=1e-6, beta=1 / 2000e9)) for op in OPS])
    assert step(profile_hardware(fast_link, nominal)) < step(nominal)
    slow_compute = profile_hardware(_h100_profile([], fraction=0.3), nominal)
    assert slow_compute.achievable == 0.3 and slow_compute.fast == nominal.fast
    assert step(slow_compute) > step(nominal)
    on_slow_axis = profile_hardware(dataclasses.replace(slow_link, slow_axes=("data",)), nominal)
    assert on_slow_axis.fast == nominal.fast and math.isclose(on_slow_axis.slow.bandwidth, 20e9)


def test_plan_with_a_matching_profile_runs_and_names_the_measured_link(tmp_path, capsys):
    path = tmp_path / "h100.json"
    profile = _h100_profile([fit(_synthetic(op, 8, alpha=20e-6, beta=1 / 20e9)) for op in OPS], fraction=0.4)
    path.write_text(json.dumps(profile.to_json()))
    args = ["plan", TINY, "--devices", "8", "--hardware", "h100", "--compile", "0", "--json"]
    assert main(args) == 0
    nominal = json.loads(capsys.readouterr().out)
    assert main([*args, "--profile", str(path)]) == 0
    measured = json.loads(capsys.readouterr().out)
    assert "measured" in measured["target"]
    assert measured["ranked"][0]["timing"]["step"] > nominal["ranked"][0]["timing"]["step"]
