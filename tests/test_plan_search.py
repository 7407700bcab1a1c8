"""`spmd-train plan`: the published formulas its model rests on, the search against the config checks and the engine,
its pruning claims, its determinism, and the command (compile stage, --explain, --write-config, bad input)."""

import dataclasses
import itertools
import json
import math
import random
import types

import pytest

from spmd_train import Engine, load_config
from spmd_train.analysis.plan import Candidate
from spmd_train.analysis.plan.candidate import schedule_stats
from spmd_train.analysis.plan.comm import CommTerm
from spmd_train.analysis.plan.compiled import bytes_by_axes, rescore
from spmd_train.analysis.plan.enumeration import DOMINATED, GPIPE, MICROBATCHES, PIPELINES
from spmd_train.analysis.plan.labels import Scope, config_for, label, overrides, parse_label
from spmd_train.analysis.plan.memory import estimate_memory, korthikanti_layer_bytes, zero_paper_bytes
from spmd_train.analysis.plan.plan_report import why_lost
from spmd_train.analysis.plan.ranking import Ranked, tie_order
from spmd_train.analysis.plan.rejections import factorizations, real_check, structure_reason
from spmd_train.analysis.plan.search import evaluate, search
from spmd_train.analysis.plan.shape import ModelShape
from spmd_train.analysis.plan.stages import stored_rows_factor
from spmd_train.analysis.plan.target import parse_topology, slow_placements, target_for
from spmd_train.analysis.plan.timing import (
    LINK_EFFICIENCY,
    Timing,
    collective_seconds,
    estimate_timing,
    ring_allreduce_seconds,
    ties,
)
from spmd_train.cli.main import main
from spmd_train.config.schedule_facts import schedule_names
from spmd_train.errors import ConfigError
from spmd_train.hardware import KINDS, hardware
from spmd_train.parallel.schedule_simulator import simulate
from spmd_train.parallel.schedules import build_schedule
from spmd_train.train.trainer import Trainer
from spmd_train.units import gib_apart
from tests.runs import cli, main_in_process

GB = 1e9
TINY = "configs/tiny.yaml"
ODD = ["model.d_model=36", "model.head_dim=8", "model.num_heads=4", "model.num_kv_heads=2",
       "train.global_batch_size=12", "train.seq_len=24"]
"""The tiny model made awkward so that every divisibility rule refuses something on 8 devices: d_model 36 (ZeRO over
8), 2 K/V heads (tensor 4), 4 query heads (ulysses over 8), 12 rows (batch axes of 8), 24 tokens (ring over 8)."""
H100x8 = ("--devices", "8", "--hardware", "h100")


@pytest.fixture(scope="module")
def odd():
    cfg = load_config(TINY, ODD)
    return cfg, search(cfg, target_for(8, "h100", None))


# --- Formulas: the published worked examples ------------------------------------------------------------------------


def test_the_zero_papers_7_5b_model_on_64_devices_and_16_bytes_per_parameter():
    # ZeRO (Rajbhandari et al. 2020) §5.1 / Figure 1: mixed-precision AdamW, K = 12, Ψ = 7.5B, N = 64.
    assert [round(zero_paper_bytes(7.5e9, 64, stage) / GB, 1) for stage in range(4)] == [120.0, 31.4, 16.6, 1.9]
    assert zero_paper_bytes(7e9, 1, 0) / GB == 112  # 2 + 2 + 12 bytes per parameter


def test_korthikantis_activations_of_a_gpt3_175b_layer():
    # Korthikanti et al. 2022 §4: s = 2048, b = 1, h = 12288, a = 96, where 5as/h = 80 against the 34 of the rest.
    s, b, h, a = 2048, 1, 12288, 96
    assert 5 * a * s / h == 80
    sbh = s * b * h
    assert korthikanti_layer_bytes(s, b, h, a) == sbh * 114 and round(sbh * 114 / GB, 2) == 2.87
    # Tensor parallelism (t = 8) splits all but the 10 sbh of layer-norm and dropout inputs: sbh (10 + 24/t + 5as/ht).
    assert korthikanti_layer_bytes(s, b, h, a, tensor=8) == sbh * (10 + 3 + 10) == 23 * sbh
    # Sequence parallelism splits those too: sbh/t (34 + 5as/h), 14.25 sbh.
    assert korthikanti_layer_bytes(s, b, h, a, tensor=8, sequence_parallel=True) == sbh * 114 / 8
    # Selective recomputation drops the 5as/h term: 34 of 114, the paper's "70%" saving for GPT-3.
    assert round(1 - 34 / 114, 2) == 0.70


@pytest.mark.parametrize(("schedule", "p", "m", "v"), [("gpipe", 4, 8, 1), ("1f1b", 8, 32, 1), ("1f1b", 4, 4, 1),
                                                      ("interleaved_1f1b", 4, 8, 2), ("interleaved_1f1b", 8, 16, 4)])
def test_megatrons_bubble_and_the_simulators_bubble_fraction(schedule, p, m, v):
    # Megatron (Narayanan et al. 2021) states the bubble as bubble time over ideal time: (p-1)/m, interleaved
    # (p-1)/(v m). The simulator states it as idle slots over all slots of 2 (v m + p - 1) ticks: (p-1)/(v m + p - 1).
    # Exactly: megatron = simulator / (1 - simulator), and simulator = megatron / (1 + megatron).
    ticks, bubble, _ = schedule_stats(schedule, p, m, v)
    megatron = (p - 1) / (v * m)
    assert ticks == 2 * (v * m + p - 1)
    assert bubble == pytest.approx((p - 1) / (v * m + p - 1), rel=1e-12)
    assert bubble / (1 - bubble) == pytest.approx(megatron, rel=1e-12)
    assert megatron / (1 + megatron) == pytest.approx(bubble, rel=1e-12)


def test_schedule_stats_are_what_the_simulator_measures():
    # The planner counts ticks, bubble and stash on the tick table instead of simulating it: the same figures.
    for name in schedule_names():
        for p in (1, 2, 4, 8):
            for m in (p, 2 * p, 3 * p, 8 * p):
                for v in (2, 4) if name == "interleaved_1f1b" else (2,) if name == "zb_v" else (1,):
                    stats = simulate(build_schedule(name, p, m, v))
                    expected = stats.num_ticks, stats.bubble_fraction, max(stats.peak_in_flight)
                    assert schedule_stats(name, p, m, v) == expected, (name, p, m, v)


def test_ring_all_reduce_is_two_p_minus_one_alphas_and_two_p_minus_one_over_p_n_betas():
    for p, n, alpha, beta in ((2, 1.0, 1e-6, 1e-9), (8, 2**30, 3.4e-6, 1 / 450e9), (64, 5e8, 1e-6, 1 / 200e9)):
        assert ring_allreduce_seconds(p, n, alpha, beta) == pytest.approx(2 * (p - 1) * alpha
                                                                          + 2 * (p - 1) / p * n * beta)
    # The planner's time of an all-reduce over one fast axis is that formula with the link's α and β.
    hw, n = hardware("v5p"), 2**30
    term = CommTerm("all-reduce", ("tensor",), 2 * 7 / 8 * n, 1, "tensor")
    beta = 1 / (hw.fast.bandwidth * LINK_EFFICIENCY)
    assert collective_seconds(term, Candidate(fsdp=8, tensor=8), hw) == pytest.approx(
        ring_allreduce_seconds(8, n, hw.fast.latency, beta))


# --- targets ------------------------------------------------------------------------------------------------------


def test_targets_from_devices_and_topologies():
    h100 = target_for(256, "h100", None)
    assert (h100.devices, h100.domains, h100.per_domain, h100.hosts, h100.platform) == (256, 32, 8, 32, "gpu")
    assert target_for(4, "h100", None).domains == 1  # part of one node
    two = parse_topology("2xv5p:8x8x8")
    assert (two.devices, two.domains, two.slice_topology, two.platform) == (1024, 2, "v5p:8x8x8", "tpu")
    assert parse_topology("v5p:8x8x16").domains == 1 and parse_topology("tpu7x:2x2x1").devices == 8
    # 32 slow-link factors over data 4 x fsdp 64: data takes 1, 2 or 4 of them, fsdp the rest.
    assert sorted(slow_placements((4, 1, 64, 1, 1, 1), 32)) == [(1, 1, 32, 1, 1, 1), (2, 1, 16, 1, 1, 1),
                                                                 (4, 1, 8, 1, 1, 1)]
    assert slow_placements((1, 1, 4, 1, 1, 8), 8) == []  # tensor would have to cross the nodes


# --- the search against the config checks and the engine ---------------------------------------------------------


def _grid(cfg):
    """Every (mesh, structure, ZeRO stage, accumulation) the search walks, invalid ones included, remat none."""
    rows_total = cfg.train.global_batch_size
    for sizes in factorizations(8):
        mesh = Candidate(*sizes)
        p = mesh.pipeline
        pipes = [(s, v, k * p) for s, v in PIPELINES for k in MICROBATCHES] if p > 1 else [("1f1b", 1, None)]
        for sp in (False, True) if mesh.tensor > 1 else (False,):
            for cp in ("allgather", "ring", "ulysses") if mesh.sequence > 1 else ("allgather",):
                for schedule, virtual, micro in pipes:
                    for zero in (0, 1, 2, 3) if mesh.fsdp * mesh.sequence > 1 else (0,):
                        # The accumulations the search tries: whole rows, and whole microbatches of them.
                        rows = [rows_total // (mesh.batch_ways * g) for g in range(1, rows_total + 1)
                                if rows_total % (mesh.batch_ways * g) == 0]
                        accums = [rows_total // mesh.batch_ways // r for r in rows if r % (micro or 1) == 0]
                        for g in accums or [1]:
                            yield Candidate(*sizes, zero_stage=zero, sequence_parallel=sp, context_parallel=cp,
                                            pipeline_schedule=schedule, virtual_stages=virtual,
                                            pipeline_microbatches=micro, grad_accum=g)


def _refused(cfg, c, devices) -> bool:
    """What the project's own checks say: the config checks (no jax), then the engine where only it can tell."""
    if real_check(config_for(cfg, c), c, "gpu") is not None:
        return True
    if c.zero_stage >= 1 and cfg.model.d_model % (c.fsdp * c.sequence):  # the Layout's split of a weight's `embed`
        with pytest.raises(ConfigError, match="cannot be split"):
            Engine.build(config_for(cfg, c), devices)
        return True
    return False


def test_the_search_refuses_exactly_what_the_checks_refuse(odd, devices):
    cfg, result = odd
    kinds = set()
    for c in _grid(cfg):
        found = result.rejection(c)
        kinds.add(found.kind if found else "accepted")
        assert ((found is not None and found.kind == "invalid") == _refused(cfg, c, devices)), (label(c), found)
    assert kinds == {"accepted", "invalid", "dominated", "redundant"}
    refused = {r.rule for r in result.rejections if r.kind == "invalid"}
    assert {"tensor does not divide num_kv_heads=2", "fsdp x sequence does not divide d_model=36 (ZeRO-1+)",
            "data x fsdp x expert does not divide global_batch_size=12", "ring: 2 x sequence does not divide "
            "seq_len=24", "ulysses: sequence does not divide the query heads per tensor shard"} <= refused


def test_a_sample_of_accepted_layouts_builds_and_of_refused_ones_does_not(odd, devices):
    cfg, result = odd
    rng = random.Random(0)
    accepted = [r.estimate.candidate for r in result.ranked[:6]]
    accepted += rng.sample([c for c in _grid(cfg) if result.rejection(c) is None], 6)
    for c in accepted:
        Engine.build(config_for(cfg, c), devices)
    one_per_rule = {}
    for r in result.rejections:
        if r.kind == "invalid":
            one_per_rule.setdefault(r.rule, r)
    assert len(one_per_rule) >= 8
    for r in one_per_rule.values():  # at the scope it was decided, with the defaults for the rest
        with pytest.raises(ConfigError):
            Engine.build(config_for(cfg, r.candidate), devices)


def test_what_the_search_prunes_as_dominated_or_not_fitting_is_so_in_the_model():
    cfg = load_config("configs/llama3-8b_v5p-512.yaml", ["train.global_batch_size=64"])
    result = search(cfg, target_for(8, "h100", None))
    hbm, rng = hardware("h100").hbm_bytes, random.Random(1)
    groups = [r for r in result.rejections if r.rule == DOMINATED]
    for r in rng.sample(groups, 8):
        fitting = evaluate(result, Candidate(**{**_fields(r.candidate), "grad_accum": _first_fit(r, result)}))
        for g in r.accums:
            later = evaluate(result, Candidate(**{**_fields(r.candidate), "grad_accum": g}))
            assert later.timing.step >= fitting.timing.step * (1 - 1e-12), (r.label, g)
    for r in rng.sample([r for r in result.rejections if r.kind == "memory" and r.accums], 8):
        for g in r.accums:  # found by bisection: each one really overflows
            c = Candidate(**{**_fields(r.candidate), "grad_accum": g})
            assert estimate_memory(result.shape, c, result.workload).peak > hbm, (r.label, g)
    for r in [r for r in result.rejections if r.rule == GPIPE][:4]:
        gpipe = Candidate(**{**_fields(r.candidate), "zero_stage": 3})
        ours = evaluate(result, Candidate(**{**_fields(gpipe), "pipeline_schedule": "1f1b"}))
        theirs = evaluate(result, gpipe)
        assert theirs.timing.step == pytest.approx(ours.timing.step)
        assert theirs.memory.peak >= ours.memory.peak


def _fields(c: Candidate) -> dict:
    return {f: getattr(c, f) for f in Candidate.__dataclass_fields__}


def _first_fit(r, result) -> int:
    """The accumulation a dominated group's candidate fits at: the one the search tried before the group."""
    rows, micro = result.workload.global_batch // r.candidate.batch_ways, r.candidate.pipeline_microbatches or 1
    return max(g for g in range(1, r.accums[0]) if rows % g == 0 and (rows // g) % micro == 0)


def test_ranking_is_deterministic_and_labels_read_back(odd):
    cfg, result = odd
    again = search(cfg, target_for(8, "h100", None))
    assert [(r.label, r.estimate.timing.step) for r in again.ranked] == [
        (r.label, r.estimate.timing.step) for r in result.ranked]
    assert again.counts() == result.counts() and again.candidates == result.candidates
    timings = [r.estimate.timing for r in result.ranked]  # fastest first, layouts that tie by communication
    assert all(a.step <= b.step or (ties(a, b) and a.communication <= b.communication)
               for a, b in itertools.pairwise(timings))
    for r in result.ranked[:20]:
        assert parse_label(r.label) == r.estimate.candidate
    c = Candidate(data=4, pipeline=2, fsdp=32, tensor=8, zero_stage=1, remat="full", sequence_parallel=True,
                  pipeline_schedule="interleaved_1f1b", virtual_stages=2, pipeline_microbatches=16, grad_accum=2,
                  dcn={"data": 4, "fsdp": 8})
    assert label(c) == ("data=4 pipeline=2 fsdp=32 tensor=8 | zero1 remat=full sp pp=interleaved_1f1b v=2 m=16 "
                        "accum=2 | dcn data=4 fsdp=8")
    assert parse_label(label(c)) == c and label(c, Scope.MESH) == "data=4 pipeline=2 fsdp=32 tensor=8"
    with pytest.raises(ConfigError, match="'remat=some' is not part of a layout label"):
        parse_label("fsdp=8 | zero3 remat=some")


# --- the command ------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_compile_2_replaces_the_estimates_of_the_best_two_with_compiled_figures(tmp_path):
    done = cli("plan", TINY, *H100x8, "--compile", "2", "--top", "4", "--json")
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    stage = out["compile"]
    assert stage["skipped"] is None and stage["where"].startswith("8 simulated CPU devices") and not stage["dropped"]
    assert len(stage["compiled"]) == 2
    rows = out["ranked"]
    assert [r["label"] for r in rows[:2]] == sorted(stage["compiled"], key=lambda k: (
        stage["compiled"][k]["timing"]["step"], k))  # the compiled two first, ranked again on their own figures
    assert rows[2]["compiled"] is None
    for row in rows[:2]:
        comp = row["compiled"]
        assert comp["platform"] == "cpu" and comp["peak_bytes_compiled"] > 0
        # the compiled peak stands in for the estimate, and the estimate of the same program is kept beside it
        assert comp["peak_bytes"] == pytest.approx(comp["peak_bytes_compiled"] + row["memory"]["peak"]
                                                   - comp["peak_bytes_estimated"])
        assert comp["memory_error"] == pytest.approx(comp["peak_bytes_estimated"] / comp["peak_bytes_compiled"] - 1)
        assert any(b["compiled"] > 0 for b in comp["bytes_per_axes"])
        assert comp["timing"]["step"] > 0 and comp["fits"]
    assert out["winner"] == rows[0]["label"] and out["runner_up"].startswith("the runner-up, ")


def test_compiled_bytes_and_peak_take_the_estimates_place():
    cfg = load_config(TINY, ["model.compute_dtype=bfloat16"])
    result = search(cfg, target_for(8, "h100", None))
    est = evaluate(result, Candidate(fsdp=4, tensor=2))
    reference = evaluate(result, Candidate(fsdp=4, tensor=2))
    reference = dataclasses.replace(reference, memory=dataclasses.replace(reference.memory, activations=2**20))
    estimated = bytes_by_axes(est.comm)
    compiled = {("fsdp",): (3 * estimated[("fsdp",)], 9, "all-gather"), ("tensor",): (estimated[("tensor",)] / 2, 5,
                "all-reduce"), ("data", "fsdp"): (1e6, 1, "all-reduce"), ("expert",): (5.0, 1, "all-gather")}
    comp = rescore(result.shape, result.workload, hardware("h100"), est, reference, platform="cpu", seconds=1.0,
                   peak_compiled=2**30, collectives=compiled)
    assert comp.peak == 2**30 + est.memory.peak - reference.memory.peak and comp.fits
    assert comp.memory_error == pytest.approx(reference.memory.peak / 2**30 - 1)
    # Each estimated term gets its axes' compiled bytes pro rata; the size-1 expert axis moves nothing; traffic on
    # axes the model has no term for is timed too, on the critical path.
    terms = [dataclasses.replace(t, bytes=t.bytes * compiled[t.axes][0] / estimated[t.axes]) for t in est.comm]
    terms.append(CommTerm("all-reduce", ("data", "fsdp"), 1e6, 1, "compiled"))
    assert comp.timing == estimate_timing(result.shape, est.candidate, result.workload, hardware("h100"), terms)
    assert comp.bytes_compiled == {a: v[0] for a, v in compiled.items() if a != ("expert",)}
    kept = rescore(result.shape, result.workload, hardware("h100"), est, reference, platform="cpu", seconds=1.0,
                   peak_compiled=None, collectives=compiled, replace_bytes=False)
    assert kept.timing == est.timing and not kept.fits and kept.peak is None  # refused by the compiler for memory


def test_explain_gives_a_breakdown_or_the_rejection(odd, capsys):
    _, result = odd
    best = result.ranked[0].label
    assert main(["plan", TINY, *ODD, *H100x8, "--explain", best, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["rank"] == 1 and out["label"] == best and out["memory"]["peak"] > 0
    assert set(out["time_parts"]) >= {"compute", "pipeline bubble"}
    assert main(["plan", TINY, *ODD, *H100x8, "--explain", "fsdp=4 sequence=2 | zero3 remat=none cp=ring"]) == 0
    assert "fsdp x sequence does not divide d_model=36 (ZeRO-1+)" in capsys.readouterr().out


def test_explain_judges_the_best_fitting_settings_a_label_leaves_out(capsys):
    # llama3-8b on 8 H100s at 64 x 4096 tokens: accum 1 does not fit without remat, accum 8 does. A mesh-only label
    # is explained as its fastest fitting settings, not at accum 1; a label that gives every setting is judged as is.
    llama = ["configs/llama3-8b_v5p-512.yaml", "train.global_batch_size=64", "train.seq_len=4096", *H100x8]
    assert main(["plan", *llama, "--explain", "fsdp=8", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["label"] == "fsdp=8 | zero3 remat=none accum=8" and out["fits"] and out["asked"] == "fsdp=8"
    assert main(["plan", *llama, "--explain", "fsdp=8 | zero3 remat=none accum=1"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("fsdp=8 | zero3 remat=none: does not fit;") and "leaves settings" not in text
    assert main(["plan", *llama, "--explain", "fsdp=8 | remat=full"]) == 0
    # 4 ZeRO stages x the 4 accumulations that divide 8 rows a device
    assert "of the 16 it names, the fastest that fits is fsdp=8 | zero3 remat=full" in capsys.readouterr().out


def test_write_config_round_trips_into_a_trainer(tmp_path, devices):
    out = tmp_path / "winner.yaml"
    done = cli("plan", TINY, *H100x8, "--compile", "0", "--json", "--write-config", str(out))
    assert done.returncode == 0, done.stderr
    name = json.loads(done.stdout)["winner"]
    cfg = load_config(out)
    # The base config with the winner's layout, every key written out (so the presets are left unnamed).
    wanted = load_config(TINY, overrides(parse_label(name)))
    # Its own run.dir (named after the file): the base config's may hold checkpoints of another layout.
    assert cfg.run.dir == "runs/winner" != wanted.run.dir
    assert cfg == dataclasses.replace(wanted, model=dataclasses.replace(wanted.model, preset=None),
                                      mesh=dataclasses.replace(wanted.mesh, preset=None),
                                      run=dataclasses.replace(wanted.run, dir="runs/winner"))
    assert out.read_text().startswith(f"# Written by `spmd-train plan {TINY}")
    Trainer(cfg, devices)  # the checks a run makes before its first step


def test_bad_input_exits_2_with_one_paragraph_and_writes_nothing(tmp_path, capsys):
    out = tmp_path / "never.yaml"
    cases = [
        (["--devices", "0", "--hardware", "h100"], ["--devices 0", "at least one device"]),
        (["--devices", "7", "--hardware", "h100"], ["7 devices", "does not divide", "valid device counts near it: 8"]),
        (["--devices", "8", "--hardware", "h1000"], ["'h1000'", *KINDS]),
        (["--topology", "v5p:8x8"], ["'v5p:8x8'", "2xv5p:8x8x8"]),
        (["--topology", "v5x:2x2"], ["'v5x'", "v5p:4x4x4"]),
        (["--devices", "8", "--topology", "v5p:2x2x2"], ["--topology v5p:2x2x2", "--devices 8"]),
        ([], ["--devices N --hardware KIND", "--topology NAME"]),
        (["--devices", "12", "--hardware", "h100"], ["--devices 12", "whole nodes", "16"]),
    ]
    runs = [(TINY, *args, "--write-config", str(out)) for args, _ in cases]
    runs.append(("configs/llama3-8b_v5p-512.yaml", "--devices", "1", "--hardware", "h100", "--write-config", str(out)))
    cases.append(([], ["fits nowhere", "needs", "GiB", "ZeRO-3", "remat", "more devices (about"]))
    runs.append(("models/llama3-70b.yaml", "--devices", "1", "--hardware", "h100"))  # a model file: named by its path
    cases.append(([], ["the model of models/llama3-70b.yaml (70.55B parameters) fits nowhere", "offload"]))
    done = [main_in_process("plan", *a, capsys=capsys) for a in runs]
    for (args, needles), (code, out_text, err) in zip(cases, done, strict=True):
        assert code == 2, (args, out_text, err)
        err = err.strip()
        assert "Traceback" not in err and len(err.splitlines()) == 1 and err.startswith("spmd-train: error: "), err
        for needle in needles:
            assert needle in err, (args, needle, err)
    assert not out.exists()


def test_a_need_just_above_the_memory_is_printed_with_the_decimals_that_show_it():
    assert gib_apart(74.53 * 2**30, 74.5 * 2**30) == ("74.53 GiB", "74.50 GiB")
    assert gib_apart(120 * 2**30, 74.5 * 2**30) == ("120.0 GiB", "74.5 GiB")
    assert gib_apart(2**30 + 1, 2**30) == ("1.0000 GiB", "1.0000 GiB")  # beyond 4 decimals: the figures as they are


def test_the_fits_nowhere_message_names_how_many_devices_would_do():
    cfg = load_config("configs/llama3-8b_v5p-512.yaml")
    result = search(cfg, target_for(1, "h100", None))
    closest = result.closest()
    assert not result.ranked and closest.peak > hardware("h100").hbm_bytes
    assert math.ceil(closest.peak / hardware("h100").hbm_bytes) >= 2


@pytest.mark.parametrize("pipeline,schedule,virtual", [(2, "1f1b", 1), (2, "interleaved_1f1b", 2), (4, "zb_h1", 1)])
def test_moe_groups_split_across_stage_chunks_are_refused_like_the_checks(pipeline, schedule, virtual):
    # configs/moe.yaml: 4 layers in MoE groups of 2; 2 stages hold a group each, 4 stage chunks would split them.
    cfg = load_config("configs/moe.yaml", [])
    c = Candidate(pipeline=pipeline, fsdp=8 // pipeline // 2, expert=2, pipeline_schedule=schedule,
                  virtual_stages=virtual, pipeline_microbatches=pipeline)
    found = structure_reason(cfg, ModelShape.from_config(cfg.model), c)
    checked = real_check(config_for(cfg, c), c, "gpu")
    if pipeline * virtual == 2:
        assert found is None and checked is None
    elif virtual == 1:  # zb_h1 runs equal chunks only
        assert found.rule == "a stage chunk's layers would split an MoE group of moe.every=2"
        assert checked is not None and "model.moe.every=2 does not divide" in checked.detail
    else:  # a fused schedule would run uneven chunks, but 2 groups cannot fill 4 of them
        assert found.rule == "fewer stack rows than stage chunks (2)"
        assert checked is not None and "balanced cannot fill 4 stage chunks" in checked.detail


@pytest.mark.parametrize("schedule", ["1f1b", "zb_h1"])
def test_uneven_stages_are_planned_as_balanced_where_the_schedule_runs_them(schedule):
    # 6 layers in 3 MoE groups over 2 stages: 1F1B runs 2 + 1 groups (parallel.pipeline_layers=balanced), ZB-H1 only
    # equal chunks; the planner and the checks agree on both, and the estimate counts the padded stage.
    cfg = load_config("configs/moe.yaml", ["model.num_layers=6"])
    c = Candidate(pipeline=2, fsdp=2, expert=2, pipeline_schedule=schedule, pipeline_microbatches=2)
    shape = ModelShape.from_config(cfg.model)
    found = structure_reason(cfg, shape, c)
    planned = config_for(cfg, c)
    checked = real_check(planned, c, "gpu")
    if schedule == "zb_h1":
        assert found.rule == "a stage chunk's layers would split an MoE group of moe.every=2" and checked is not None
        return
    assert found is None and checked is None and planned.parallel.pipeline_layers == "balanced"
    assert "parallel.pipeline_layers=balanced" in overrides(c, cfg.model.stack_rows)
    # Each stage stores 2 groups (the one-group stage padded), 4 of the 3 groups' rows: the state bytes count them
    # (tests/test_plan_model.py holds them equal to the engine's).
    assert stored_rows_factor(shape, c, cfg.train.seq_len) == pytest.approx(4 / 3)

_TIMING = Timing(model_flops=1.0, device_flops=1.0, compute=1.531, bubble=0.0, communication=0.0, exposed=0.0,
                 step=1.531, tokens_per_second=1.0, mfu=0.6, axes=())


def test_layouts_that_tie_rank_by_less_communication_and_say_so():
    # The 512-chip v5p question ties fsdp=512 with five fsdp x sequence ring layouts (1.531 s, every collective
    # hidden); the one that moves least comes first, then labels; a layout 0.05% slower stays after them all.
    def ranked(name: str, step: float, communication: float) -> Ranked:
        timing = dataclasses.replace(_TIMING, step=step, communication=communication)
        return Ranked(name, types.SimpleNamespace(timing=timing))

    rows = [ranked("b", 1.531, 0.73), ranked("c", 1.531 * (1 + 5e-5), 0.70), ranked("a", 1.531, 0.73),
            ranked("d", 1.532, 0.48)]
    assert [r.label for r in tie_order(rows)] == ["c", "a", "b", "d"]
    first, second = tie_order(rows)[:2]
    text = why_lost(first.estimate.timing, second.estimate.timing, second.label, 512)
    assert "ties with the winner" in text and "communicates less (700.00 ms against 730.00 ms" in text, text
    assert "labels order them" in why_lost(second.estimate.timing, rows[0].estimate.timing, "b", 512)
