"""The planner's analytic estimate against compiled programs, without compiling: the figures recorded in
tests/golden/*.json (kept true by tests/test_golden_layouts.py) against `analysis.plan.estimate` of the same config.

The planner's targets are memory within 15% and bytes per mesh axis within 10%. Each golden case that does not meet them
asserts its documented bound instead, with the reason beside it (`KNOWN`): the test fails if a case gets worse, and
also if it gets better than its documented bound by a wide margin, so the table is tightened when the model is fixed.
Conventions as in benchmarks/plan_accuracy.py (XLA:CPU's reduce-scatter as all-reduce + slice; XLA attention on CPU).
"""

import pytest

from benchmarks.plan_accuracy import (
    BYTES_BOUND,
    GRID,
    MEMORY_BOUND,
    analytic,
    error,
    estimated_bytes,
    golden_bytes,
)
from spmd_train import load_config
from tests.golden_layouts import CASES, CONFIG_DIR, load_golden

CPU_TINY_MEMORY = (
    "XLA:CPU's heap for a 1-10 MiB program is about 1.2x what is live at once (its live-range analysis, "
    "benchmarks/plan_accuracy.py's live column: the estimate is -8..+6% of that)")
CPU_TENSOR_BYTES = (
    "XLA:CPU re-reduces the forward's two tensor all-reduces (and one more token block) in each layer's backward "
    "(7 all-reduces of the [rows, seq, d] block per layer instead of Megatron's 4; seen in the HLO of configs/tiny), "
    "while on TPU llama3-8b fsdp 64 x tensor 8 (full remat) the model is exact")
PIPELINE = ("pipelined program: the fsdp collectives inside a stage are counted on every tick for each branch of the "
            "per-tick switch (PIPELINE_COLLECTIVES_NOTE), an upper bound, and the stash memory is sized for the stage "
            "that needs the most; only `pipeline` bytes compare")
MOE_AXES = ("the compiler reduces the expert gradients over fsdp x expert together (a reduce-scatter over both) "
            "where the model has a reduce-scatter over fsdp and an all-reduce over expert; the total compares")
TPU_HEAP = ("libtpu's heap is {ratio} the program's live peak (XLA's live ranges: {live}, the estimate {err} of it): "
            "the assigner's packing around the table-sized buffers, which the model does not predict")
CPU_SPLIT = ("XLA:CPU splits the reduce-scatter over fsdp x sequence into all-reduces over each axis (10 GB over fsdp "
             "and sequence each where the model has none): only fsdp x sequence compares on CPU")

# case -> {"memory" or axes: (lowest, highest) error allowed, reason}
KNOWN: dict[str, dict] = {
    "mesh_presets-fsdp": {"memory": (-0.22, -0.15, CPU_TINY_MEMORY)},
    "mesh_presets-fsdp_tp": {"memory": (-0.23, -0.15, CPU_TINY_MEMORY), ("tensor",): (-0.40, -0.35, CPU_TENSOR_BYTES)},
    "mesh_presets-hsdp": {"memory": (-0.20, -0.14, CPU_TINY_MEMORY)},
    "mesh_presets-tp_sp": {"memory": (-0.27, -0.20, CPU_TINY_MEMORY), ("tensor",): (-0.29, -0.23, CPU_TENSOR_BYTES)},
    "tiny": {"memory": (-0.23, -0.16, CPU_TINY_MEMORY), ("tensor",): (-0.40, -0.35, CPU_TENSOR_BYTES)},
    # The tiny Qwen3 of tests/hf_reference on fsdp 2 x tensor 4 (8 MiB compiled): the same two CPU effects as tiny;
    # its memory gap is larger than tiny's and not yet broken down.
    "hf_finetune": {"memory": (-0.38, -0.32, CPU_TINY_MEMORY), ("tensor",): (-0.41, -0.35, CPU_TENSOR_BYTES)},
    "pipeline": {"memory": (-0.47, -0.40, PIPELINE), ("fsdp",): (-1.0, -0.9, PIPELINE)},
    "moe": {"memory": (-0.20, -0.14, CPU_TINY_MEMORY), ("expert",): (0.35, 0.45, MOE_AXES),
            ("fsdp",): (0.7, 0.9, MOE_AXES), ("fsdp", "expert"): (-1.0, -1.0, MOE_AXES)},
    "llama3-8b_v5p-512": {
        "memory": (-0.47, -0.40, TPU_HEAP.format(ratio="1.92x", live="288 MiB", err="+7.8%")),
        ("fsdp", "tensor"): (-1.0, -1.0, "72 bytes (a scalar's reduction over both axes): nothing to estimate")},
    "llama3-8b_128k_v5p": {"memory": (-0.22, -0.16, TPU_HEAP.format(ratio="1.32x", live="3.22 GiB", err="+7.2%"))},
    "llama3-8b_128k_h100": {
        "memory": (-0.62, -0.55, "XLA:CPU compiles the 64-device program with its all-reduces in place of "
                                 "reduce-scatters (full fp32 gradient buffers) and XLA attention over 256 tokens"),
        ("fsdp",): (-1.0, -1.0, CPU_SPLIT), ("sequence",): (-1.0, -0.99, CPU_SPLIT)},
}
MARGIN = 0.03
"""How far inside its documented bound a known case may get before the test asks to tighten the bound."""


def _check(case: str, key, err: float, bound: float, failures: list[str]) -> None:
    known = KNOWN.get(case, {}).get(key)
    what = key if isinstance(key, str) else " x ".join(key)
    if known is None:
        if abs(err) > bound:
            failures.append(f"{case} {what}: {err:+.1%} outside ±{bound:.0%}")
        return
    low, high, reason = known
    if not (low - 1e-9 <= err <= high + 1e-9):
        failures.append(f"{case} {what}: {err:+.1%} outside its documented [{low:+.0%}, {high:+.0%}] ({reason})")
    elif abs(err) <= bound - MARGIN:
        failures.append(f"{case} {what}: {err:+.1%} now within ±{bound:.0%}: drop it from KNOWN")


@pytest.mark.parametrize("case", sorted(CASES))
def test_estimates_are_within_bounds_of_the_golden_compiled_figures(case):
    spec = CASES[case]
    golden = load_golden(case)
    cfg = load_config(CONFIG_DIR / f"{spec.config}.yaml", list(spec.overrides))
    platform = "tpu" if spec.topology else "cpu"
    est = analytic(cfg, golden["mesh"], platform)
    failures: list[str] = []
    _check(case, "memory", error(est.memory.peak, golden["memory"]["total_bytes"]), MEMORY_BOUND, failures)
    estimated, compiled = estimated_bytes(list(est.comm), platform, golden["mesh"]), golden_bytes(golden["collectives"])
    for axes in sorted(set(estimated) | set(compiled)):
        err = error(estimated.get(axes, 0.0), compiled.get(axes, 0.0))
        _check(case, axes, max(err, -1.0) if err != float("inf") else 9.99, BYTES_BOUND, failures)
    assert not failures, "\n".join(failures)


def test_every_known_miss_names_a_golden_case_and_a_reason():
    for case, entries in KNOWN.items():
        assert case in CASES
        for low, high, reason in entries.values():
            assert low <= high and len(reason) > 20


GPT2 = ("model.preset=gpt2-small", "model.num_layers=2", "train.seq_len=256", "train.global_batch_size=8")
LIBTPU = {
    # name: (config, overrides, mesh, {(op, axes): bytes one device sends per step}) as libtpu 0.0.42.1 compiled
    # them for v5p:2x2x2 (jax 0.10.2; `describe(cfg, topology="v5p:2x2x2").collectives`), the parameter traffic only.
    # Each pins one way an accelerator partitions what `analysis.zero_floor` counts otherwise (`comm.zero_terms`):
    "tied table gathered once, re-split by rows": (
        "mesh_presets", GPT2, {"fsdp": 8},
        {("all-gather", ("fsdp",)): 117_153_792, ("all-to-all", ("fsdp",)): 8_451_072,
         ("reduce-scatter", ("fsdp",)): 92_381_184}),
    "MoE: non-expert gradients scattered over fsdp x expert, gathered over expert": (
        "moe", ("model.preset=mixtral-8x7b", "model.num_layers=2", "train.seq_len=256", "train.global_batch_size=8"),
        {"fsdp": 2, "expert": 4},
        {("reduce-scatter", ("fsdp", "expert")): 605_782_016, ("all-gather", ("expert",)): 519_174_144,
         ("reduce-scatter", ("fsdp",)): 704_643_072, ("all-to-all", ("fsdp",)): 262_144_000,
         ("all-gather", ("fsdp",)): 1_839_308_800}),
    "two batch axes: the tied table's gradient all-reduced": (
        "mesh_presets", ("model.preset=llama-1b", "model.num_layers=2", "train.global_batch_size=8",
                         "train.seq_len=2048", "mesh.fsdp=2", "mesh.sequence=4", "parallel.context_parallel=ulysses"),
        {"fsdp": 2, "sequence": 4},
        {("all-reduce", ("fsdp", "sequence")): 919_410_702, ("reduce-scatter", ("fsdp", "sequence")): 212_860_928,
         ("all-gather", ("fsdp", "sequence")): 885_427_200, ("all-to-all", ("fsdp",)): 32_833_536}),
    "ZeRO-1 over fsdp: the whole gradient reduce-scattered once a step in fp32, the update gathered (2Ψ)": (
        "mesh_presets", ("model.preset=llama-1b", "model.num_layers=2", "train.seq_len=256",
                         "train.global_batch_size=8", "mesh.fsdp=8", "mesh.tensor=1", "mesh.data=1",
                         "parallel.zero_stage=1"),
        {"fsdp": 8}, {("reduce-scatter", ("fsdp",)): 1_345_089_536, ("all-gather", ("fsdp",)): 1_345_096_704}),
    "ZeRO-0 (tp_sp's stage) over fsdp 4: the table's gradient all-reduced in the compute dtype; SP gathers a "
    "sublayer's input 3 times": (
        "mesh_presets", (*GPT2, "mesh.preset=tp_sp", "mesh.data=1", "mesh.fsdp=4", "mesh.tensor=2"),
        {"fsdp": 4, "tensor": 2}, {("all-reduce", ("fsdp",)): 100_440_582,
                                   ("all-gather", ("tensor",)): 5_505_024, ("reduce-scatter", ("tensor",)): 3_932_160}),
}


@pytest.mark.parametrize("name", sorted(LIBTPU))
def test_parameter_traffic_is_what_libtpu_compiled(name):
    config, overrides, mesh, compiled = LIBTPU[name]
    est = analytic(load_config(CONFIG_DIR / f"{config}.yaml", list(overrides)), mesh, "tpu")
    mine: dict = {}
    for t in est.comm:
        mine[t.op, t.axes] = mine.get((t.op, t.axes), 0.0) + t.bytes
    assert {key: mine.get(key, 0.0) for key in compiled} == pytest.approx(compiled, rel=1e-3), name
    # ... and no parameter traffic the compiled program does not have.
    assert {(t.op, t.axes) for t in est.comm if t.purpose not in ("tensor", "context", "expert")} <= set(compiled)


L1B = ("model.preset=llama-1b", "model.num_layers=2", "train.global_batch_size=8")
L8B = ("model.num_layers=2",)
LIVE = {
    # name: (config, overrides, mesh, live peak bytes, documented (low, high, reason) or None for within
    # MEMORY_BOUND): the peak of XLA's live-range analysis of the step as libtpu 0.0.42.1 compiled these 2-layer
    # cuts (jax 0.10.2; "Stack trace breakdown for peak usage" in the `--xla_dump_to` files, as
    # benchmarks/plan_accuracy.py reads them). What the memory model estimates: the compiled heap around it is
    # larger by libtpu's packing (KNOWN's TPU_HEAP), which weighs most where the vocabulary tables outweigh the
    # layers; the models at full depth are TPU_GRID below.
    "gpt2-small fsdp 8 (its tied table gathered and relaid out)": (
        "mesh_presets", GPT2, {"fsdp": 8}, 268_823_714, None),
    "llama-1b fsdp 8, remat full": (
        "mesh_presets", (*L1B, "train.seq_len=512", "parallel.remat=full"), {"fsdp": 8}, 1_823_545_872, None),
    "llama3-8b fsdp 64 x tensor 8, 1,024 tokens (the lookup's gradient and its copy, the logits)": (
        "llama3-8b_v5p-512", (*L8B, "train.global_batch_size=64", "train.seq_len=1024"), {"fsdp": 64, "tensor": 8},
        342_206_664, None),
    "llama3-8b fsdp 64 x tensor 8, 16 tokens (the golden)": (
        "llama3-8b_v5p-512", (*L8B, "train.global_batch_size=64", "train.seq_len=16"), {"fsdp": 64, "tensor": 8},
        301_608_448, None),
    "llama3-8b fsdp 8 x sequence 8, ring (gradients all-reduced whole: three tables)": (
        "llama3-8b_128k_v5p", (*L8B, "train.seq_len=4096"), {"fsdp": 8, "sequence": 8}, 3_458_117_864, None),
    "mixtral-8x7b fsdp 2 x expert 4": (
        "moe", ("model.preset=mixtral-8x7b", *L8B, "train.seq_len=256", "train.global_batch_size=8"),
        {"fsdp": 2, "expert": 4}, 9_826_215_098, None),
    "gpt2-small fsdp 4 x tensor 2, SP (ZeRO-0)": (
        "mesh_presets", (*GPT2, "mesh.preset=tp_sp", "mesh.data=1", "mesh.fsdp=4", "mesh.tensor=2"),
        {"fsdp": 4, "tensor": 2}, 438_586_256, None),
    "llama-1b fsdp 2 x sequence 4, ulysses": (
        "mesh_presets", (*L1B, "train.seq_len=2048", "mesh.fsdp=2", "mesh.sequence=4",
                         "parallel.context_parallel=ulysses"), {"fsdp": 2, "sequence": 4}, 1_688_007_228,
        (0.45, 0.57, "the model counts the loss's bf16 logits (501 MiB) in both phases, which this program never "
                     "materialises whole (fused into the loss's reductions; llama3-8b's 1,024-token program keeps "
                     "them), and the gradient shards beside the forward's activations: when XLA fuses the logits "
                     "away is not modelled")),
}


@pytest.mark.parametrize("name", sorted(LIVE))
def test_memory_estimate_is_what_libtpu_keeps_live(name):
    config, overrides, mesh, live, known = LIVE[name]
    err = error(analytic(load_config(CONFIG_DIR / f"{config}.yaml", list(overrides)), mesh, "tpu").memory.peak, live)
    if known is None:
        assert abs(err) <= MEMORY_BOUND, f"{name}: {err:+.1%}"
    else:
        low, high, reason = known
        assert low <= err <= high, f"{name}: {err:+.1%} outside its documented [{low:+.0%}, {high:+.0%}] ({reason})"


HEAP = ("libtpu's heap is {ratio} the program's live peak: its packing of the buffers, which the model does "
        "not predict (the estimate is {err} of what is live)")
TPU_GRID = {
    # benchmarks/plan_accuracy.py's TPU rows ("layout | model"): the real models at full depth as libtpu 0.0.42.1
    # compiled them (jax 0.10.2; its `--json` output): mesh, compiled heap (argument + output + temp - alias)
    # and live peak in bytes, then the documented (low, high, reason) of the estimate's error against each, or
    # None where it is within MEMORY_BOUND.
    "fsdp 8 | gpt2-small": ({"fsdp": 8}, 578_572_224, 508_186_426, None, None),
    "fsdp 4 x tensor 2, SP | gpt2-small": ({"fsdp": 4, "tensor": 2}, 1_418_375_968, 1_352_439_083, None, None),
    "fsdp 8, remat full | llama-1b": (
        {"fsdp": 8}, 5_057_840_064, 3_526_547_992, (-0.27, -0.21, HEAP.format(ratio="1.43x", err="+8.8%")), None),
    "fsdp 2 x sequence 4, ulysses | llama-1b": (
        {"fsdp": 2, "sequence": 4}, 9_488_702_656, 7_726_209_354, None,
        (0.15, 0.18, "the model counts the loss's bf16 logits (501 MiB), which this program never materialises "
                     "whole (as in LIVE's 2-layer cut): without them the estimate is +9.2% of what is live")),
    "fsdp 8 x sequence 8, allgather, no remat | llama3-8b": (
        {"fsdp": 8, "sequence": 8}, 13_783_475_040, 13_402_781_026, None, None),
    "pipeline 4 x fsdp 2, gpipe | llama-1b": (
        {"pipeline": 4, "fsdp": 2}, 20_250_544_224, 15_925_800_886,
        (-0.22, -0.16, HEAP.format(ratio="1.27x", err="+3.3%")), None),
    "pipeline 4 x fsdp 2, 1f1b | llama-1b": (
        {"pipeline": 4, "fsdp": 2}, 10_516_006_912, 6_488_895_402,
        (-0.32, -0.26, HEAP.format(ratio="1.62x", err="+14.6%")), None),
    "fsdp 64 x tensor 8 | llama3-8b": ({"fsdp": 64, "tensor": 8}, 763_062_944, 749_744_326, None, None),
    # The live peak less the host's memory space (the 7.48 GiB of offloaded state): the estimate is -0.9% of it.
    "fsdp 8, remat full, optimizer offloaded | llama3-8b": (
        {"fsdp": 8}, 14_751_963_680, 11_825_163_994,
        (-0.23, -0.18, "memory_analysis()'s temporaries count 2.2 GiB more than the heap libtpu's buffer assignment "
                       "lays out (11.67 GiB, against which the estimate is -6.5%); 1.2 GiB more without the offload. "
                       "Which buffers the extra is, the report does not say"), None),
    "fsdp 8 x sequence 8, ring | llama3-8b": ({"fsdp": 8, "sequence": 8}, 6_527_880_288, 5_145_598_674, None, None),
    "fsdp 16 x expert 4 | mixtral-8x7b": (
        {"fsdp": 16, "expert": 4}, 24_395_992_096, 16_403_110_226,
        (-0.19, -0.13, HEAP.format(ratio="1.49x", err="+25.3%")),
        (0.22, 0.29, "XLA's peak is where the forward starts: the 32 layers' residual stacks allocated (six E·C "
                     "slot buffers of 560 MiB among them) beside bf16 copies of the stacked expert weights, before "
                     "any gradient exists, where the estimate adds the 3 GiB of fp32 gradient shards to the "
                     "activations; the backward's phase is not broken down")),
}


def _grid_layout(row: str):
    found = [g for g in GRID if g.topology and f"{g.name} | {g.model}" == row]
    assert len(found) == 1, f"{row!r} is not one TPU row of benchmarks/plan_accuracy.GRID"
    return found[0]


def test_every_tpu_row_of_the_grid_is_pinned():
    assert {f"{g.name} | {g.model}" for g in GRID if g.topology} == set(TPU_GRID)


@pytest.mark.parametrize("row", sorted(TPU_GRID))
def test_memory_estimate_against_libtpu_programs_at_full_depth(row):
    lay = _grid_layout(row)
    mesh, heap, live, heap_known, live_known = TPU_GRID[row]
    est = analytic(load_config(CONFIG_DIR / f"{lay.config}.yaml", list(lay.overrides)), mesh, "tpu").memory.peak
    failures: list[str] = []
    for what, compiled, known in (("heap", heap, heap_known), ("live", live, live_known)):
        err = error(est, compiled)
        if known is None:
            if abs(err) > MEMORY_BOUND:
                failures.append(f"{what}: {err:+.1%} outside ±{MEMORY_BOUND:.0%}")
            continue
        low, high, reason = known
        if not (low - 1e-9 <= err <= high + 1e-9):
            failures.append(f"{what}: {err:+.1%} outside its documented [{low:+.0%}, {high:+.0%}] ({reason})")
        elif abs(err) <= MEMORY_BOUND - MARGIN:
            failures.append(f"{what}: {err:+.1%} now within ±{MEMORY_BOUND:.0%}: drop its documented bound")
    assert not failures, f"{row}: " + "; ".join(failures)


def test_pipeline_traffic_is_what_libtpu_compiled():
    # llama-1b pipeline 4 x fsdp 2 (1F1B, ZeRO-3) as libtpu 0.0.42.1 compiled it for v5p:2x2x2: 140 sends of one
    # microbatch's bf16 residual stream, and one sum over the stages of the fp32 head gradient split over fsdp as
    # it is stored (f32[128256,1024]) with the 32 microbatches' input gradients in bf16 (XLA dropped the
    # executor's fp32 round trip); the compiled sum has 6 more bytes (the loss's scalars).
    lay = _grid_layout("pipeline 4 x fsdp 2, 1f1b | llama-1b")
    est = analytic(load_config(CONFIG_DIR / f"{lay.config}.yaml", list(lay.overrides)), {"pipeline": 4, "fsdp": 2},
                   "tpu")
    mine = {(t.op, t.count): t.bytes for t in est.comm if t.axes == ("pipeline",)}
    assert mine == {("collective-permute", 140): 293_601_280, ("all-reduce", 1): pytest.approx(888_674_310, abs=8)}
