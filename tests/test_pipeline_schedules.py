"""Pipeline schedules as data: every table obeys the timing model and reaches its closed-form bubble."""

import ast
import dataclasses
import subprocess
import sys
from collections import Counter
from fractions import Fraction
from pathlib import Path

import pytest

from spmd_train.cli.main import main
from spmd_train.config.schedule_facts import schedule_names
from spmd_train.errors import ConfigError
from spmd_train.parallel.schedule_simulator import render_timeline, simulate
from spmd_train.parallel.schedules import Op, Schedule, build_schedule

ROOT = Path(__file__).resolve().parents[1]


def _grid():
    for p in range(1, 7):
        for m in range(1, 4 * p + 1):  # includes m < p and m not a multiple of p
            yield "gpipe", p, m, 1
            if m >= p:
                yield "1f1b", p, m, 1
            if m % p == 0:
                for v in (2, 3):
                    yield "interleaved_1f1b", p, m, v


GRID = list(_grid())


def _when(schedule: Schedule) -> dict[Op, tuple[int, int]]:
    """op -> (tick, stage), asserting no op appears twice."""
    seen = {}
    for t, row in enumerate(schedule.ticks):
        assert len(row) == schedule.stages
        for s, op in enumerate(row):
            if op is not None:
                assert op not in seen, f"{op} twice"
                seen[op] = (t, s)
    return seen


@pytest.mark.parametrize(("name", "p", "m", "v"), GRID, ids=[f"{n}-p{p}-m{m}-v{v}" for n, p, m, v in GRID])
def test_schedule_figures_match_the_formulas(name, p, m, v):
    schedule = build_schedule(name, p, m, v)
    stats = simulate(schedule)
    assert (schedule.name, schedule.stages, schedule.microbatches, schedule.virtual) == (name, p, m, v)

    # Every op exactly once, on the stage that holds its chunk; dependencies met at earlier ticks
    # (checked here independently of simulate).
    when = _when(schedule)
    assert set(when) == {Op(k, i, c) for k in "FB" for i in range(m) for c in range(p * v)}
    for op, (t, s) in when.items():
        assert s == op.chunk % p
        if op.kind == "F" and op.chunk > 0:
            assert when[Op("F", op.microbatch, op.chunk - 1)][0] < t
        if op.kind == "B":
            assert when[Op("F", op.microbatch, op.chunk)][0] < t
            if op.chunk < p * v - 1:
                assert when[Op("B", op.microbatch, op.chunk + 1)][0] < t

    # Bubble: exactly (p-1)/(v*m+p-1), i.e. 2(v*m+p-1) ticks with 2*v*m busy ones per stage.
    assert schedule.num_ticks == stats.num_ticks == 2 * (v * m + p - 1)
    assert stats.busy_ticks == (2 * v * m,) * p
    idle = p * stats.num_ticks - sum(stats.busy_ticks)
    assert Fraction(idle, p * stats.num_ticks) == Fraction(p - 1, v * m + p - 1)
    assert stats.bubble_fraction == pytest.approx(float(Fraction(p - 1, v * m + p - 1)), abs=1e-12)

    # Activations held: all m for GPipe; p - s for 1F1B; Megatron's warm-up + 1 for interleaved.
    expected_peak = {
        "gpipe": tuple(m for _ in range(p)),
        "1f1b": tuple(p - s for s in range(p)),
        "interleaved_1f1b": tuple(min((p - d - 1) * 2 + (v - 1) * p + 1, m * v) for d in range(p)),
    }[name]
    assert stats.peak_in_flight == expected_peak

    # One send per chunk boundary per microbatch, each way, to the neighbouring stage.
    kinds = Counter(t.kind for t in stats.transfers)
    assert kinds == Counter({"activation": m * (p * v - 1), "gradient": m * (p * v - 1)})
    for tr in stats.transfers:
        step = 1 if tr.kind == "activation" else -1
        assert (tr.src, tr.dst) == (tr.chunk % p, (tr.chunk + step) % p)
        assert when[Op("F" if tr.kind == "activation" else "B", tr.microbatch, tr.chunk)] == (tr.tick, tr.src)


@pytest.mark.parametrize(("p", "m"), [(1, 3), (4, 4), (4, 7), (3, 9)])
def test_gpipe_places_every_op_at_its_textbook_tick(p, m):
    when = _when(build_schedule("gpipe", p, m))
    for s in range(p):
        for i in range(m):
            assert when[Op("F", i, s)] == (i + s, s)
            assert when[Op("B", i, s)] == ((m + p - 1) + i + (p - 1 - s), s)  # last stage first


@pytest.mark.parametrize(("p", "m"), [(1, 2), (4, 4), (4, 9), (6, 7)])
def test_1f1b_warms_up_then_alternates(p, m):
    schedule = build_schedule("1f1b", p, m)
    for s in range(p):
        kinds = "".join(op.kind for op in (row[s] for row in schedule.ticks) if op is not None)
        warm = p - s  # forwards before the first backward
        assert kinds == "F" * warm + "BF" * (m - warm) + "B" * warm


def test_interleaved_runs_microbatch_groups_through_local_chunks_in_megatron_order():
    p, m, v = 4, 8, 2
    schedule = build_schedule("interleaved_1f1b", p, m, v)
    for d in range(p):
        ops = [row[d] for row in schedule.ticks if row[d] is not None]
        forwards = [(op.microbatch, op.chunk) for op in ops if op.kind == "F"]
        backwards = [(op.microbatch, op.chunk) for op in ops if op.kind == "B"]
        assert forwards == [(g * p + i, d + k * p) for g in range(m // p) for k in range(v) for i in range(p)]
        assert backwards == [(g * p + i, d + k * p) for g in range(m // p) for k in (1, 0) for i in range(p)]
        assert ops.index(next(op for op in ops if op.kind == "B")) == min((p - d - 1) * 2 + (v - 1) * p + 1, m * v)


def test_render_timeline_is_aligned_and_labels_ops():
    text = render_timeline(build_schedule("1f1b", 4, 6))
    lines = text.splitlines()
    assert len(lines) == 1 + 4 and lines[0].startswith("tick") and lines[4].startswith("stage 3")
    assert lines[1].split()[2:6] == ["F0", "F1", "F2", "F3"] and lines[1].split()[-1] == "B5"
    assert lines[2].split()[2] == "."  # stage 1 idles at tick 0
    assert len({len(line) for line in lines}) == 1
    interleaved = render_timeline(build_schedule("interleaved_1f1b", 2, 2, 2)).splitlines()
    assert interleaved[1].split()[2:6] == ["F0.0", "F1.0", "F0.2", "F1.2"]  # microbatch.chunk
    assert len({len(line) for line in interleaved}) == 1


def test_module_is_pure_python():
    source = (Path(__file__).resolve().parents[1] / "spmd_train" / "parallel" / "schedules.py").read_text()
    nodes = list(ast.walk(ast.parse(source)))
    imported = {alias.name for node in nodes if isinstance(node, ast.Import) for alias in node.names}
    imported |= {node.module for node in nodes if isinstance(node, ast.ImportFrom)}
    assert not {name for name in imported if name and name.split(".")[0] in ("jax", "jaxlib", "numpy", "flax")}


# -- validation: broken tables are rejected with the tick, stage and op ------------------------------


def _with(schedule: Schedule, changes: dict[tuple[int, int], Op | None]) -> Schedule:
    """A copy of the schedule with ticks[t][s] replaced for each (t, s) in `changes`."""
    ticks = [list(row) for row in schedule.ticks]
    for (t, s), op in changes.items():
        while t >= len(ticks):
            ticks.append([None] * schedule.stages)
        ticks[t][s] = op
    return dataclasses.replace(schedule, ticks=tuple(tuple(row) for row in ticks))


def _rejected(schedule: Schedule, *needles: str) -> str:
    with pytest.raises(ConfigError) as err:
        simulate(schedule)
    for needle in needles:
        assert needle in str(err.value), (needle, str(err.value))
    return str(err.value)


def test_swapped_ops_break_a_dependency():
    good = build_schedule("1f1b", 4, 4)
    assert good.ticks[1][1] == Op("F", 0, 1) and good.ticks[2][1] == Op("F", 1, 1)
    swapped = _with(good, {(1, 1): Op("F", 1, 1), (2, 1): Op("F", 0, 1)})
    _rejected(swapped, "tick 1", "stage 1", "F(microbatch=1, chunk=1)", "F(microbatch=1, chunk=0)", "same tick")


def test_backward_before_its_gradient_arrives():
    good = build_schedule("gpipe", 2, 1)  # (stage 0, stage 1) per tick: (F0, .), (., F0), (., B0), (B0, .)
    early = _with(good, {(2, 0): Op("B", 0, 0), (3, 0): None, (2, 1): None, (3, 1): Op("B", 0, 1)})
    _rejected(early, "tick 2", "stage 0", "B(microbatch=0, chunk=0)", "B(microbatch=0, chunk=1)", "has not run yet")


def test_dropped_op_is_named():
    good = build_schedule("gpipe", 4, 4)
    last = good.num_ticks - 1
    assert good.ticks[last][0] == Op("B", 3, 0)
    _rejected(_with(good, {(last, 0): None}), "never runs B(microbatch=3, chunk=0) on stage 0")
    # Dropping an op others depend on is caught where the first dependant runs.
    _rejected(_with(good, {(0, 0): None}), "tick 1", "stage 1", "needs the output of F(microbatch=0, chunk=0)")


def test_duplicated_op_is_named():
    good = build_schedule("1f1b", 2, 2)
    idle = next(t for t, row in enumerate(good.ticks) if row[0] is None)
    _rejected(_with(good, {(idle, 0): Op("F", 0, 0)}),
              f"tick {idle}", "stage 0", "F(microbatch=0, chunk=0) runs twice (first at tick 0 on stage 0)")


def test_op_on_the_wrong_stage_is_named():
    good = build_schedule("gpipe", 2, 2)
    moved = _with(good, {(0, 0): None, (0, 1): Op("F", 0, 0)})
    _rejected(moved, "tick 0", "stage 1", "F(microbatch=0, chunk=0) is on the wrong stage", "runs on stage 0")


@pytest.mark.parametrize(
    ("entry", "needle"),
    [(Op("X", 0, 0), "is not an op"), (Op("F", 5, 0), "out of range"), (Op("F", 0, 9), "chunk 0..3")],
)
def test_malformed_entries(entry, needle):
    good = build_schedule("interleaved_1f1b", 2, 2, 2)
    _rejected(_with(good, {(0, 0): entry}), "tick 0", "stage 0", needle)


def test_ragged_row():
    good = build_schedule("gpipe", 2, 2)
    ragged = dataclasses.replace(good, ticks=(good.ticks[0][:1], *good.ticks[1:]))
    _rejected(ragged, "tick 0 has 1 entries", "valid: 2")


# -- bad requests ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "needles"),
    [
        (("1f1b", 4, 3), ["parallel.pipeline_microbatches=3", "parallel.pipeline_schedule=1f1b", "mesh.pipeline=4",
                          "valid: >= 4"]),
        (("interleaved_1f1b", 4, 6, 2), ["parallel.pipeline_microbatches=6 is not divisible by mesh.pipeline=4",
                                         "groups of 4", "valid: a multiple of 4"]),
        (("zero_bubble", 4, 8), ["'zero_bubble'", "gpipe, 1f1b, interleaved_1f1b"]),
        (("gpipe", 4, 8, 2), ["parallel.virtual_stages=2", "parallel.pipeline_schedule=gpipe", "valid: 1"]),
        (("1f1b", 4, 8, 0), ["parallel.virtual_stages=0", "valid: an integer >= 1"]),
        (("interleaved_1f1b", 4, 8, 1), ["parallel.virtual_stages=1", "valid: >= 2"]),
        (("gpipe", 0, 8), ["mesh.pipeline=0", "valid: an integer >= 1"]),
        (("gpipe", 4, 0), ["parallel.pipeline_microbatches=0", "valid: an integer >= 1"]),
        (("1f1b", 2, 2.5), ["parallel.pipeline_microbatches=2.5"]),
    ],
    ids=["1f1b-few-mb", "interleaved-indivisible", "unknown", "gpipe-virtual", "virtual-0", "interleaved-v1",
         "no-stages", "no-microbatches", "float"],
)
def test_build_schedule_rejects_bad_requests(args, needles):
    with pytest.raises(ConfigError) as err:
        build_schedule(*args)
    for needle in needles:
        assert needle in str(err.value), (needle, str(err.value))


def test_every_listed_schedule_builds():
    assert schedule_names() == ("gpipe", "1f1b", "interleaved_1f1b", "zb_h1", "zb_v")
    for name in schedule_names():
        simulate(build_schedule(name, 2, 4, 2 if name in ("interleaved_1f1b", "zb_v") else 1))


# -- CLI ---------------------------------------------------------------------------------------------


def test_cli_prints_timeline_and_figures(capsys):
    assert main(["schedule", "--stages", "4", "--microbatches", "8", "--schedule", "interleaved_1f1b",
                 "--virtual", "2"]) == 0
    out = capsys.readouterr().out
    assert render_timeline(build_schedule("interleaved_1f1b", 4, 8, 2)) in out
    assert "ticks:           38 (each runs one chunk: 1/2 of a stage's layers)" in out
    assert "bubble fraction: 0.1579 (formula (p-1)/(v*m+p-1) = 3/19 = 0.1579)" in out
    assert "stage 0: 11, stage 1: 9, stage 2: 7, stage 3: 5" in out  # peak in flight
    assert "56 activation, 56 gradient" in out


def test_cli_defaults_and_gpipe(capsys):
    assert main(["schedule", "--stages", "2", "--microbatches", "3", "--schedule", "gpipe"]) == 0
    out = capsys.readouterr().out
    assert "stage 1  . F0 F1 F2 B0 B1 B2" in out and "bubble fraction: 0.2500" in out


@pytest.mark.parametrize(
    ("argv", "needle"),
    [(["--stages", "4", "--microbatches", "3", "--schedule", "1f1b"], "1F1B needs at least as many microbatches"),
     (["--stages", "4", "--microbatches", "8", "--schedule", "pipedream"], "gpipe, 1f1b, interleaved_1f1b"),
     (["--stages", "4", "--microbatches", "8", "--schedule", "interleaved_1f1b", "--virtual", "1"],
      "parallel.virtual_stages=1"),
     (["--stages", "64", "--microbatches", "4096", "--schedule", "1f1b"],
      "64 x --microbatches 4096 x --virtual 1 = 262,144 microbatch-chunks is more than this command draws")],
)
def test_cli_bad_input_exits_2(capsys, argv, needle):
    assert main(["schedule", *argv]) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith("spmd-train: error:") and needle in captured.err
    assert "Traceback" not in captured.err and captured.out == ""


def test_a_reader_that_stops_early_gets_no_traceback():
    """`spmd-train schedule ... | head -c 10`: 200 KB of timeline into a pipe closed after 10 bytes."""
    proc = subprocess.run(f"{sys.executable} -m spmd_train schedule --schedule 1f1b --stages 16 --microbatches 1024 "
                          "| head -c 10", shell=True, capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.stdout == "1f1b: 16 s" and proc.stderr == "", proc.stderr
