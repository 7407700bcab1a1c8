"""Zero-bubble schedules (backward split into B and W): valid tables, the papers' bubbles, 1F1B's memory."""


import pytest

from spmd_train.cli.main import main
from spmd_train.config.schedule_facts import schedule_names
from spmd_train.errors import ConfigError
from spmd_train.parallel.pipeline_schedules import registered_orders
from spmd_train.parallel.schedule_simulator import render_timeline, simulate
from spmd_train.parallel.schedules import Op, build_schedule
from tests.test_pipeline_schedules import _rejected, _when, _with


def _grid():
    for p in range(1, 7):
        for m in range(p, 4 * p + 1):
            yield "zb_h1", p, m, 1
            yield "zb_v", p, m, 2


GRID = list(_grid())


def _home(name: str, p: int, chunk: int) -> int:
    """Where a chunk lives, written out again: V placement for zb_v, one chunk per stage for zb_h1."""
    if name == "zb_v":
        return chunk if chunk < p else 2 * p - 1 - chunk
    return chunk


@pytest.mark.parametrize(("name", "p", "m", "v"), GRID, ids=[f"{n}-p{p}-m{m}" for n, p, m, v in GRID])
def test_tables_are_valid(name, p, m, v):
    schedule = build_schedule(name, p, m, v)
    assert schedule.split_backward and schedule.placement == ("v" if name == "zb_v" else "loop")
    when = _when(schedule)
    last = p * v - 1
    # Every F, B and W exactly once, on its chunk's stage (checked independently of simulate).
    assert set(when) == {Op(k, i, c) for k in "FBW" for i in range(m) for c in range(p * v)}
    for op, (t, s) in when.items():
        assert s == _home(name, p, op.chunk)
        i, c = op.microbatch, op.chunk
        if op.kind == "F" and c > 0:
            assert when[Op("F", i, c - 1)][0] < t
        if op.kind == "B":
            assert when[Op("F", i, c)][0] < t
            if c < last:
                assert when[Op("B", i, c + 1)][0] < t
        if op.kind == "W":
            assert when[Op("B", i, c)][0] < t and when[Op("B", i, c)][1] == s
    stats = simulate(schedule)
    assert stats.busy_ticks == (3 * m * v,) * p  # F, B, W of m microbatches on v chunks
    assert stats.makespan_units == stats.num_ticks == stats.lockstep_units  # every split op costs 1 unit


@pytest.mark.parametrize(("p", "m"), [(p, m) for p in range(1, 7) for m in range(p, 4 * p + 1)])
def test_zb_h1_bubble_is_a_third_of_1f1b_at_1f1b_memory(p, m):
    zb, ref = simulate(build_schedule("zb_h1", p, m)), simulate(build_schedule("1f1b", p, m))
    # ZB paper, Sec. 3.1: bubble (p-1)(T_F+T_B-T_W) against 1F1B's (p-1)(T_F+T_B+T_W); with
    # T_F = T_B = T_W = 1 unit: (p-1) against 3(p-1) idle units per stage, exactly 1/3.
    assert zb.bubble_units == (p - 1,) * p
    assert ref.bubble_units == (3 * (p - 1),) * p
    assert 3 * zb.bubble_units[0] == ref.bubble_units[0]
    # Length: 3m unit ops per stage plus p-1 idle ticks; asynchronous and lockstep agree (all ops 1 unit).
    assert zb.num_ticks == zb.makespan_units == zb.lockstep_units == 3 * m + p - 1
    assert ref.makespan_units == 3 * (m + p - 1)
    # Memory: stage s holds p-s whole activations (F until B), as 1F1B; counted conservatively from F
    # to W it holds p, 1F1B's peak over stages (the paper's "peak memory of 1F1B", stage 0's), since
    # stage s defers s W's. Per stage p-s from F to W is impossible at this bubble (see report).
    assert zb.peak_whole_activations == ref.peak_in_flight == tuple(p - s for s in range(p))
    assert zb.peak_in_flight == (p,) * p and max(zb.peak_in_flight) == max(ref.peak_in_flight)
    if m >= 2 * p and p > 1:
        # Reported in bubble_units (idle time per stage, asynchronous): 1/3 <= 0.4 of 1F1B's.
        assert zb.bubble_units[0] <= 0.4 * ref.bubble_units[0]
        # Lockstep (each tick as long as its longest op): 1F1B's fused B makes most ticks 2 units long.
        assert zb.lockstep_bubble_fraction <= 0.4 * ref.lockstep_bubble_fraction


def test_zb_h1_follows_1f1b_warmup_then_defers_w():
    p, m = 4, 8
    schedule = build_schedule("zb_h1", p, m)
    for s in range(p):
        ops = [row[s] for row in schedule.ticks if row[s] is not None]
        kinds = "".join(op.kind for op in ops)
        assert kinds.startswith("F" * (p - s) + "B")  # 1F1B's warm-up
        assert kinds.endswith("BW" + "W" * s)  # s deferred W's fill the cooldown after the last B
    text = render_timeline(schedule)
    assert "W0" in text and "W7" in text


@pytest.mark.parametrize(("p", "m"), [(p, m) for p in range(1, 7) for m in range(p, 4 * p + 1)])
def test_zb_v_bubble_and_memory(p, m):
    zb, ref = simulate(build_schedule("zb_v", p, m, 2)), simulate(build_schedule("1f1b", p, m))
    # Memory in whole-stage microbatches (a chunk-activation is half a stage): at most 1F1B's p.
    assert max(zb.peak_in_flight) / 2 <= max(ref.peak_in_flight) == p
    # Bubble in units of one chunk op (half a stage's F). Lower bound: device p-1 starts at tick
    # p-1 and has 6m unit ops, so the makespan is >= 6m + p - 1 and every device idles >= p-1. The
    # paper's ZB-V has no bubble past this fill when T_F = T_B = T_W (ZB paper, Sec. 6); our greedy
    # reaches it for e.g. p=4, m=8 or 16 and stays under 2p-1 units, i.e. under p stage-forward times,
    # against 1F1B's 3(p-1) (in stage-forward times).
    assert all(b == zb.bubble_units[0] for b in zb.bubble_units)
    assert p - 1 <= zb.bubble_units[0] <= 2 * p - 1
    assert zb.makespan_units == 6 * m + zb.bubble_units[0]
    if p > 1:
        assert zb.bubble_units[0] / 2 < ref.bubble_units[0]
    # No transfer at the bottom of the V: chunk p-1 -> p stays on device p-1; every other boundary
    # crosses to a neighbour, so 2p-2 sends of each kind per microbatch.
    for t in zb.transfers:
        assert abs(t.src - t.dst) == 1
        assert not (t.kind == "activation" and t.chunk == p - 1) and not (t.kind == "gradient" and t.chunk == p)
    assert len(zb.transfers) == 2 * m * (2 * p - 2)


@pytest.mark.parametrize(("p", "m"), [(2, 2), (3, 6), (4, 8), (4, 16)])
def test_zb_v_reaches_the_fill_bound(p, m):
    assert simulate(build_schedule("zb_v", p, m, 2)).bubble_units == (p - 1,) * p  # 6m + p - 1 units


def test_v_placement_puts_the_loss_on_device_0():
    schedule = build_schedule("zb_v", 4, 4, 2)
    assert [schedule.stage_of(c) for c in range(8)] == [0, 1, 2, 3, 3, 2, 1, 0]
    text = render_timeline(schedule)
    assert "F0.7" in text and "W3.0" in text  # microbatch.chunk suffixes as interleaved


def test_fused_schedules_are_unchanged_in_kind():
    for name in ("gpipe", "1f1b", "interleaved_1f1b"):
        schedule = build_schedule(name, 2, 4, 2 if name == "interleaved_1f1b" else 1)
        assert not schedule.split_backward and schedule.placement == "loop"
        assert all(op.kind in "FB" for row in schedule.ticks for op in row if op is not None)
    assert schedule_names() == ("gpipe", "1f1b", "interleaved_1f1b", "zb_h1", "zb_v")  # training runs all of them
    assert set(registered_orders()) == set(schedule_names())


# -- validation -------------------------------------------------------------------------------------


def _where(schedule, op):
    return _when(schedule)[op]


def test_w_before_its_b_is_rejected():
    good = build_schedule("zb_h1", 2, 2)
    (tb, s), (tw, _) = _where(good, Op("B", 0, 0)), _where(good, Op("W", 0, 0))
    swapped = _with(good, {(tb, s): Op("W", 0, 0), (tw, s): Op("B", 0, 0)})
    _rejected(swapped, f"tick {tb}", f"stage {s}", "W(microbatch=0, chunk=0) needs the output of "
              "B(microbatch=0, chunk=0)", "has not run yet")


def test_w_on_the_wrong_stage_is_rejected():
    good = build_schedule("zb_v", 2, 2, 2)
    t, s = _where(good, Op("W", 0, 3))  # chunk 3 = 2p-1-0 lives on stage 0
    assert s == 0
    moved = _with(good, {(t, 0): None, (t, 1): Op("W", 0, 3)})
    _rejected(moved, f"tick {t}", "stage 1", "W(microbatch=0, chunk=3) is on the wrong stage", "runs on stage 0",
              "V placement")


def test_missing_w_is_named():
    good = build_schedule("zb_h1", 3, 3)
    t, s = _where(good, Op("W", 2, 1))
    _rejected(_with(good, {(t, s): None}), "never runs W(microbatch=2, chunk=1) on stage 1", "F, B and W")


def test_w_in_a_fused_schedule_is_not_an_op():
    good = build_schedule("1f1b", 2, 2)
    idle = next(t for t, row in enumerate(good.ticks) if row[0] is None)
    _rejected(_with(good, {(idle, 0): Op("W", 0, 0)}), f"tick {idle}", "stage 0", "is not an op",
              "kind='F' or 'B'")


@pytest.mark.parametrize(
    ("args", "needles"),
    [(("zb_h1", 4, 3), ["parallel.pipeline_microbatches=3", "zb_h1", "valid: >= 4"]),
     (("zb_h1", 4, 8, 2), ["parallel.virtual_stages=2", "valid: 1"]),
     (("zb_v", 4, 8, 1), ["parallel.virtual_stages=1", "a V schedule runs exactly 2 chunks per stage", "valid: 2"]),
     (("zb_v", 4, 8, 3), ["parallel.virtual_stages=3", "valid: 2"]),
     (("zb_v", 4, 3, 2), ["parallel.pipeline_microbatches=3", "zb_v", "valid: >= 4"]),
     (("zb_h2", 4, 8), ["'zb_h2'", "gpipe, 1f1b, interleaved_1f1b", "zb_h1, zb_v"])],
    ids=["h1-few-mb", "h1-virtual", "v-virtual-1", "v-virtual-3", "v-few-mb", "unknown"],
)
def test_bad_requests(args, needles):
    with pytest.raises(ConfigError) as err:
        build_schedule(*args)
    for needle in needles:
        assert needle in str(err.value), (needle, str(err.value))


# -- CLI ---------------------------------------------------------------------------------------------


def test_cli_prints_zb_h1(capsys):
    assert main(["schedule", "--stages", "4", "--microbatches", "8", "--schedule", "zb_h1"]) == 0
    out = capsys.readouterr().out
    assert render_timeline(build_schedule("zb_h1", 4, 8)) in out
    assert "stage 0 F0 F1 F2 F3  .  .  . B0 W0 F4" in out
    assert "ticks:           27" in out and "formula (p-1)/(3m+p-1) = 1/9" in out
    assert "bubble per stage stage 0: 3, stage 1: 3, stage 2: 3, stage 3: 3; formula (p-1) = 3, 1F1B's is 3(p-1) = 9" \
        in out
    assert "lockstep:        27 units" in out


def test_cli_zb_v_defaults_to_two_chunks(capsys):
    assert main(["schedule", "--stages", "4", "--microbatches", "8", "--schedule", "zb_v"]) == 0
    out = capsys.readouterr().out
    assert "2 chunks per stage" in out and render_timeline(build_schedule("zb_v", 4, 8, 2)) in out
    assert "async:           51 units" in out and "lower bound (p-1) = 3" in out


@pytest.mark.parametrize(
    ("argv", "needle"),
    [(["--schedule", "zb_h3"], "gpipe, 1f1b, interleaved_1f1b, zb_h1, zb_v"),
     (["--schedule", "zb_v", "--virtual", "3"], "a V schedule runs exactly 2 chunks per stage (valid: 2)"),
     (["--schedule", "zb_h1", "--virtual", "2"], "parallel.virtual_stages=2")],
)
def test_cli_bad_input_exits_2(capsys, argv, needle):
    assert main(["schedule", "--stages", "4", "--microbatches", "8", *argv]) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith("spmd-train: error:") and needle in captured.err and captured.out == ""


def test_the_v_plan_keeps_the_turn_on_its_device():
    from spmd_train.parallel.pipeline_plan import SPLIT_FIELDS, WEIGHT_CODE, build_plan

    p, m = 4, 8
    plan = build_plan(build_schedule("zb_v", p, m, 2))
    col = {name: i for i, name in enumerate(SPLIT_FIELDS)}
    rows, spare = plan.rows, plan.act_slots
    assert plan.fields == SPLIT_FIELDS and (rows[..., col["kind"]] == WEIGHT_CODE).sum() == 2 * p * m
    for t, row in enumerate(plan.schedule.ticks):
        for s, op in enumerate(row):
            kept = rows[t, s, col["keep"]] != spare
            # F of chunk p-1 (into F of chunk p), B of chunk p (into B of chunk p-1) and the loss's cotangent
            # (F of the last chunk into its B) stay on their stage; nothing else does.
            turn = op is not None and ((op.kind, op.chunk) in (("F", p - 1), ("B", p), ("F", 2 * p - 1)))
            assert kept == turn, (t, s, op)
