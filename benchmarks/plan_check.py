"""Does the planner rank layouts the way this machine runs them? Estimated against measured step time.

On 8 simulated CPU devices: profile this host (`spmd-train bench-collectives`: the collectives' α-β fits and the
matmul probe, all eight devices at once), plan the gpt2-small model (models/gpt2-small.yaml) for
`--hardware cpu` with that profile, then run the planner's top 8 and 8 layouts drawn at random (seeded) from the
rest of the ranked ones, 20 timed steps each after one untimed, and report the Spearman rank correlation between
estimated and measured step time (goal >= 0.7) and the median absolute error. The table goes to
docs/benchmarks.md, section `plan_check`; nothing here is asserted by a test (timings are not tests).

The workload is sized for a 2-core host: gpt2-small's width (768, 12 heads, the 50,304-token tied vocabulary)
with 4 of its 12 layers, at 8 rows of 64 tokens: about 2e11 FLOPs a step, a few seconds, so 16 layouts x 21
steps plus their compiles take about half an hour (the full depth took 10 s a step). fp32 compute
(`model.compute_dtype=float32`): XLA:CPU's fast matmul path is fp32, the one the probe measures; its bf16
matmuls run several times slower and would stand for a different machine than the profile.

On an accelerator host, `--hardware KIND` (e.g. h100) plans that host's devices with a profile of them and runs
the whole gpt2-small in its own dtype at 8 rows of 1,024 tokens per device (`ACCELERATOR_OVERRIDES`).

Run: `.venv/bin/python -m benchmarks.plan_check` (`--profile FILE` reuses a profile, `--no-write`).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
DEVICES = 8
STEPS = 20
OVERRIDES = ("model.num_layers=4", "train.global_batch_size=8", "train.seq_len=64", "model.compute_dtype=float32",
             "data.vocab_size=4096")
"""`data.vocab_size`: the Markov data's transition table stays small (tokens from the first 4096 of the vocabulary;
the model's vocabulary and so its FLOPs are unchanged)."""
ACCELERATOR_OVERRIDES = ("train.seq_len=1024", "data.vocab_size=4096")
CPU_PROFILE = ("--simulate-devices", str(DEVICES), "--mesh", "fsdp=4", "tensor=2", "--sizes", "1KiB..64MiB",
               "--repeats", "5")
"""Groups of 4 and 2 (the planner's axes on 8 devices span 2 to 8), up to 64 MiB: the size of the largest
collective these layouts run (the fp32 gradient of the 38.6M-parameter tied table is 154 MB whole, 19 MB to
77 MB per device over fsdp 8 to 2)."""
ACCELERATOR_PROFILE = ("--sizes", "1KiB..256MiB", "--repeats", "10")


@dataclass(frozen=True)
class Row:
    """One layout: where it came from, its estimate, and what the machine did."""

    label: str
    source: str
    """"top k" (the planner's rank) or "random"."""
    estimated: float
    measured: float | None
    """Median seconds of the timed steps; None where the layout failed to run (`failure`)."""
    compile_seconds: float = 0.0
    failure: str = ""


def spearman(xs: list[float], ys: list[float]) -> float:
    """Spearman's ρ: Pearson's correlation of the ranks (ties take their average rank)."""
    rx, ry = _ranks(xs), _ranks(ys)
    mx, my = statistics.fmean(rx), statistics.fmean(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry, strict=True))
    var = (sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry)) ** 0.5
    return cov / var if var else float("nan")


def _ranks(values: list[float]) -> list[float]:
    order = sorted(range(len(values)), key=values.__getitem__)
    ranks = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return ranks


def profile_host(path: Path, kind: str) -> None:
    """Run `bench-collectives` on the devices planned for into `path` (in this process: jax starts here)."""
    from spmd_train.cli.main import main

    code = main(["bench-collectives", *(CPU_PROFILE if kind == "cpu" else ACCELERATOR_PROFILE), "--out", str(path)])
    if code:
        raise SystemExit(f"bench-collectives failed (exit {code})")


def choose(result, top: int, drawn: int, seed: int) -> list[tuple[str, object]]:
    """The planner's best `top` and `drawn` more at random from the rest of its ranked layouts."""
    ranked = list(result.ranked)
    rest = ranked[top:]
    picks = [(f"top {i}", r) for i, r in enumerate(ranked[:top], 1)]
    return picks + [("random", r) for r in random.Random(seed).sample(rest, min(drawn, len(rest)))]


def measure(cfg, steps: int) -> tuple[float, float]:
    """(compile seconds, median step seconds over `steps` timed steps after one untimed) of `cfg`."""
    from benchmarks.report import timed_steps

    run = timed_steps(cfg, steps)
    return run.compile_seconds, run.step_seconds


def workload(kind: str, devices: int) -> tuple[str, ...]:
    """The config overrides of the checked model for `devices` devices of `kind`."""
    if kind == "cpu":
        return OVERRIDES
    return (*ACCELERATOR_OVERRIDES, f"train.global_batch_size={8 * devices}")


def run(profile_path: Path, kind: str, top: int, drawn: int, seed: int, steps: int) -> tuple[list[Row], object]:
    """Plan, pick, and run every picked layout; the rows and the search result."""
    import jax

    from spmd_train import load_config
    from spmd_train.analysis.plan.labels import config_for
    from spmd_train.analysis.plan.profile import load_profile, profile_hardware
    from spmd_train.analysis.plan.search import search
    from spmd_train.analysis.plan.target import target_for

    devices = jax.device_count()
    cfg = load_config(ROOT / "models" / "gpt2-small.yaml", list(workload(kind, devices)))
    target = target_for(devices, kind, None)
    hw = profile_hardware(load_profile(profile_path), target.hardware, str(profile_path), devices)
    target = dataclasses.replace(target, hardware=hw)
    result = search(cfg, target, keep=1 << 20)  # every fitting layout ranked exactly: one host's devices are few
    rows = []
    for source, ranked in choose(result, top, drawn, seed):
        est = ranked.estimate
        print(f"{source:8s} {ranked.label}: estimated {est.timing.step:.3f} s ...", file=sys.stderr, flush=True)
        try:
            compile_s, step = measure(config_for(cfg, est.candidate), steps)
        except Exception as err:  # a layout the planner ranked but that does not run is a finding, not a crash
            rows.append(Row(ranked.label, source, est.timing.step, None, failure=f"{type(err).__name__}: {err}"[:200]))
            print(f"  failed: {rows[-1].failure}", file=sys.stderr)
            continue
        rows.append(Row(ranked.label, source, est.timing.step, step, compile_s))
        print(f"  measured {step:.3f} s (compiled in {compile_s:.0f} s)", file=sys.stderr, flush=True)
    return rows, result


def summary(rows: list[Row]) -> dict[str, float]:
    """Spearman's ρ, the median absolute relative error and the measured spread, over the layouts that ran."""
    ran = [r for r in rows if r.measured is not None]
    if len(ran) < 2:
        raise SystemExit(f"{len(ran)} of {len(rows)} layouts ran: nothing to correlate")
    est, meas = [r.estimated for r in ran], [r.measured for r in ran]
    top = [r for r in ran if r.source.startswith("top")]
    return {"layouts": len(ran), "spearman": spearman(est, meas),
            "spearman_top": spearman([r.estimated for r in top], [r.measured for r in top]) if len(top) > 2 else
            float("nan"),
            "median_abs_error": statistics.median(abs(e / m - 1) for e, m in zip(est, meas, strict=True)),
            "best_measured_rank": 1 + sorted(meas).index(min(r.measured for r in top)) if top else 0}


def table(rows: list[Row]) -> str:
    """Markdown: one row per layout, planner's order."""
    lines = ["| picked | layout | estimated s | measured s | est./meas. | measured rank |",
             "|---|---|---:|---:|---:|---:|"]
    ran = sorted(r.measured for r in rows if r.measured is not None)
    for r in rows:
        if r.measured is None:
            lines.append(f"| {r.source} | `{r.label}` | {r.estimated:.3f} | failed: {r.failure} | | |")
            continue
        lines.append(f"| {r.source} | `{r.label}` | {r.estimated:.3f} | {r.measured:.3f} | "
                     f"{r.estimated / r.measured:.2f} | {ran.index(r.measured) + 1} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hardware", default="cpu", help="the planner's kind for this host's devices (default "
                        "cpu: 8 simulated devices)")
    parser.add_argument("--profile", type=Path, help="a bench-collectives profile of these devices (default: measure "
                        "one first)")
    parser.add_argument("--top", type=int, default=8)
    parser.add_argument("--random", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args(argv)
    if args.hardware == "cpu":
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    start = time.perf_counter()
    profile_path = args.profile
    if profile_path is None:
        profile_path = Path(tempfile.mkdtemp()) / f"{args.hardware}_profile.json"
        profile_host(profile_path, args.hardware)
    elif args.hardware == "cpu":
        from spmd_train.devices import simulate_devices

        simulate_devices(DEVICES)
    rows, result = run(profile_path, args.hardware, args.top, args.random, args.seed, args.steps)
    s = summary(rows)
    body = table(rows)
    print(body)
    print(s)
    if not args.no_write:
        write(rows, s, result, profile_path, time.perf_counter() - start)
    return 0


def write(rows: list[Row], s: dict[str, float], result, profile_path: Path, seconds: float) -> None:
    """The docs/benchmarks.md section: provenance, the profile's figures, the summary, the table."""
    from benchmarks.report import provenance, update_section
    from spmd_train.analysis.plan.profile import load_profile

    profile = load_profile(profile_path)
    hw = result.target.hardware
    head = (provenance("python -m benchmarks.plan_check") +
            f"- {len(rows)} layouts, {STEPS} timed steps each, {seconds / 60:.0f} min in all; "
            f"config models/gpt2-small.yaml with {' '.join(workload(hw.kind, result.target.devices))}\n"
            f"- profile: matmul {profile.matmul.flops_per_second / 1e9:.1f} GFLOP/s per device with all "
            f"{profile.matmul.devices} busy; collectives {hw.fast.bandwidth / 1e9:.2f} GB/s, "
            f"α {hw.fast.latency * 1e6:.0f} us (median of the fits over {dict(profile.mesh)})\n"
            f"- planner: {result.candidates:,} candidates, {len(result.ranked):,} ranked\n\n")
    verdict = (f"**Spearman ρ = {s['spearman']:.2f}** over {s['layouts']} layouts (goal >= 0.7); among the top 8 "
               f"alone ρ = {s['spearman_top']:.2f}; median absolute error of the step time "
               f"{s['median_abs_error']:.0%}; the fastest of the planner's top 8 is number "
               f"{s['best_measured_rank']} of all {s['layouts']} measured.\n\n")
    update_section("plan_check", "Planner ranking against measured CPU steps (`benchmarks/plan_check.py`)",
                   head + verdict + NOTES + "\n\n" + table(rows))


NOTES = """What CPU simulation can and cannot predict. The eight devices are threads of one process on the
host's cores: a step's time is the work of all of them over the host's throughput, plus copies through host
memory for every collective, which run in line with compute (XLA:CPU has no asynchronous collectives) and are
timed by the profile. So the `cpu` hardware kind (`spmd_train/hardware.py`) has no nominal figures, only the
profile's, hides no communication under compute, and charges nothing for a pipeline bubble: an idle device's
cores serve the others (the bubble fraction is still reported). What carries over to accelerators is the part
of the model that counts: FLOPs per device with remat and imbalance, bytes per axis and launches. What does
not: overlap, link topology, the relative cost of a collective against a matmul (a copy through host memory
against a matmul at a few GFLOP/s), and everything not a matmul (elementwise work, XLA attention's softmax,
the optimizer update), which the planner leaves out and which on CPU is a large share of the step."""


if __name__ == "__main__":
    raise SystemExit(main())
