"""`describe`: the collectives, memory and loop counts read from compiled programs."""

import json
import math
import os
import subprocess
import sys
import threading
import warnings
from pathlib import Path

import jax
import pytest
from jax.experimental.compilation_cache import compilation_cache

from spmd_train import load_config
from spmd_train.analysis import describe, tpu_topology_devices
from spmd_train.analysis.topology import has_libtpu, without_persistent_cache
from tests.runs import cli, main_in_process
from tests.structure import mlp_forward_collectives
from tests.tiers import fast_cases

ROOT = Path(__file__).resolve().parents[1]
TINY = ["model.preset=tiny", "train.global_batch_size=32", "train.seq_len=16", "run.simulate_devices=null"]
# Big enough that XLA:TPU keeps reduce-scatters (it all-reduces tiny tensors instead).
MID = ["model.num_layers=4", "model.d_model=512", "model.d_ff=2048", "model.num_heads=8", "model.num_kv_heads=8"]


def _report(devices, *overrides, **kw):
    return describe(load_config(None, [*TINY, *overrides]), devices=devices, **kw)


def _by_axes(report, op, axes):
    return [c for c in report.collectives if c.op == op and c.axes == axes]


def _bytes(report, axes, ops=("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")):
    return sum(c.bytes for c in report.collectives if c.axes == axes and c.op in ops)


def test_tensor_parallel_mlp_has_one_all_reduce_and_no_all_gather(devices):
    coll = mlp_forward_collectives(devices, ["mesh.data=2", "mesh.fsdp=1", "mesh.tensor=4"])
    assert [(c.op, c.axes, c.count) for c in coll] == [("all-reduce", ("tensor",), 1)]
    assert coll[0].bytes == pytest.approx(2 * 3 / 4 * 4 * 16 * 64 * 4)  # 2(N-1)/N x local [4, 16, 64] fp32


@pytest.mark.tpu_aot
def test_sequence_parallel_mlp_swaps_the_all_reduce_for_reduce_scatter_and_all_gather():
    coll = mlp_forward_collectives(
        tpu_topology_devices("v5e:2x4"),
        ["mesh.data=2", "mesh.fsdp=1", "mesh.tensor=4", "parallel.sequence_parallel=true"], length=512,
    )
    assert sorted((c.op, c.axes, c.count) for c in coll) == [
        ("all-gather", ("tensor",), 1), ("reduce-scatter", ("tensor",), 1)
    ]


def test_sequence_parallel_mlp_on_cpu_gathers_before_and_reduces_after(devices):
    # XLA:CPU writes the reduce-scatter as all-reduce + slice; the all-gather is the same.
    coll = mlp_forward_collectives(
        devices, ["mesh.data=2", "mesh.fsdp=1", "mesh.tensor=4", "parallel.sequence_parallel=true"]
    )
    assert sorted((c.op, c.axes, c.count) for c in coll) == [
        ("all-gather", ("tensor",), 1), ("all-reduce", ("tensor",), 1)
    ]


@pytest.mark.parametrize("grad_accum", fast_cases([1, 4], fast=[1]))
def test_data_parallel_reduces_parameter_bytes_once_per_step(devices, grad_accum):
    report = _report(devices, "mesh.data=8", "mesh.fsdp=1", f"train.grad_accum={grad_accum}")
    param_bytes = report.param_count * 4
    assert [c.axes for c in report.collectives] == [("data",)]
    (reduce,) = report.collectives
    assert reduce.op == "all-reduce"
    # 2(N-1)/N x parameters, plus the loss scalar.
    assert reduce.bytes == pytest.approx(2 * 7 / 8 * param_bytes, rel=1e-3)


@pytest.mark.tpu_aot
def test_zero3_moves_three_times_the_parameters_over_fsdp():
    with jax.default_matmul_precision("highest"):  # keep the fp32 weights fp32 on the wire
        report = _report(tpu_topology_devices("v5e:2x4"), "mesh.fsdp=8", "parallel.zero_stage=3", *MID)
    param_bytes = report.param_count * 4
    moved = _bytes(report, ("fsdp",))
    assert moved == pytest.approx(3 * 7 / 8 * param_bytes, rel=0.10)
    assert _bytes(report, ("fsdp",), ops=("reduce-scatter",)) == pytest.approx(7 / 8 * param_bytes, rel=0.10)


@pytest.mark.slow
def test_loop_counts_come_from_the_program(devices):
    reports = {n: _report(devices, "mesh.fsdp=8", f"model.num_layers={n}") for n in (2, 4, 6)}
    counts = {n: {(c.op, c.axes): (c.count, c.bytes) for c in r.collectives} for n, r in reports.items()}
    key = ("all-gather", ("fsdp",))
    two_layers = counts[4][key][0] - counts[2][key][0]
    assert two_layers > 0 and two_layers % 2 == 0
    assert counts[6][key][0] - counts[4][key][0] == two_layers  # count = outside the loop + L x per layer
    assert counts[2][key][0] - two_layers >= 0
    # Bytes grow the same way: each layer's weights are gathered in the forward and again in the backward pass.
    two_layer_bytes = counts[4][key][1] - counts[2][key][1]
    assert counts[6][key][1] - counts[4][key][1] == pytest.approx(two_layer_bytes)
    two_layer_params = reports[4].param_count - reports[2].param_count
    assert two_layer_bytes == pytest.approx(2 * 7 / 8 * two_layer_params * 4, rel=0.01)


@pytest.mark.parametrize("stage", fast_cases([0, 1, 2, 3], fast=[3]))
def test_memory_follows_zero_arithmetic(devices, stage):
    report = _report(devices, "mesh.fsdp=8", f"parallel.zero_stage={stage}")
    d = report.per_device
    full = report.param_count * 4
    assert d["param_bytes"] == pytest.approx(full / (8 if stage >= 3 else 1), rel=0.01)
    assert d["opt_state_bytes"] == pytest.approx(2 * full / (8 if stage >= 1 else 1), rel=0.01)
    assert d["argument_bytes"] == pytest.approx(d["param_bytes"] + d["opt_state_bytes"] + d["batch_bytes"], rel=0.01)


@pytest.mark.slow
def test_flops_count_every_layer(devices):
    two, eight = (_report(devices, "mesh.fsdp=8", f"model.num_layers={n}") for n in (2, 8))
    for report in (two, eight):
        # Compiled matmul FLOPs track the model count (attention is computed unmasked on CPU).
        assert 1.0 <= report.per_device["flops"] / report.per_device["model_flops"] <= 1.3
    assert eight.per_device["flops"] > 3 * two.per_device["flops"]


def test_cli_json_has_the_public_keys(capsys):
    code, out, err = main_in_process("describe", "configs/tiny.yaml", "--json", capsys=capsys)
    assert code == 0, err
    report = json.loads(out)
    assert {"mesh", "devices", "param_count", "per_device", "collectives"} <= set(report)
    assert report["mesh"]["fsdp"] == 4 and report["mesh"]["tensor"] == 2 and report["devices"] == 8
    assert {"param_bytes", "opt_state_bytes", "argument_bytes", "output_bytes", "temp_bytes", "flops"} <= set(
        report["per_device"])
    assert all({"op", "axes", "count", "bytes"} <= set(c) for c in report["collectives"])
    assert {("all-reduce", ("tensor",))} <= {(c["op"], tuple(c["axes"])) for c in report["collectives"]}


@pytest.mark.slow
def test_cli_tables():
    proc = cli("describe", "configs/tiny.yaml", "mesh.fsdp=8", "mesh.tensor=1")
    assert proc.returncode == 0, proc.stderr
    for needle in ("Parameters", "Memory per device", "Collectives per step", "all-gather", "fsdp",
                   "blocks.attn.wq", "peak = arg + out + temp - alias"):
        assert needle in proc.stdout


@pytest.mark.parametrize(
    ("args", "needles"),
    [
        (["--topology", "v9z:1x1"], ["v9z:1x1", "v5e:2x4"]),
        (["--topology", "v5e:2x2"], ["multiply to 8", "4 devices", "v5e:2x2"]),
        (["model.d_model=abc"], ["model.d_model='abc'"]),
        (["--topology", "v5e:2x2", "mesh.fsdp=3"], ["fsdp=3", "4 devices"]),  # overrides may follow options
    ],
    ids=["unknown-topology", "topology-size", "bad-config", "override-after-option"],
)
def test_cli_bad_input_exits_2(args, needles, capsys):
    if "--topology" in args and not has_libtpu():
        pytest.skip("needs the tpu-aot extra")
    code, _, err = main_in_process("describe", "configs/tiny.yaml", *args, capsys=capsys)
    assert code == 2, err
    assert "Traceback" not in err
    for needle in needles:
        assert needle in err


@pytest.mark.slow
def test_cli_topology_without_libtpu_says_how_to_install(tmp_path):
    # Hide libtpu from the child process, as on a machine without the extra.
    (tmp_path / "sitecustomize.py").write_text("import sys\nsys.modules['libtpu'] = None\n")
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), str(ROOT)])
    proc = subprocess.run([sys.executable, "-m", "spmd_train", "describe", "configs/tiny.yaml", "--topology",
                           "v5e:2x4"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert "tpu-aot" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.slow
@pytest.mark.tpu_aot
def test_llama3_8b_on_512_v5p_chips_compiles_and_fits():
    report = describe(load_config(ROOT / "configs" / "llama3-8b_v5p-512.yaml"), topology="v5p:8x8x8")
    assert report.devices == 512 and report.mesh["fsdp"] == 64 and report.mesh["tensor"] == 8
    assert report.param_count == pytest.approx(8.03e9, rel=0.01)
    assert report.fits is True
    assert report.per_device["param_bytes"] == pytest.approx(report.param_count * 4 / 512, rel=0.01)
    assert math.isfinite(report.per_device["flops"]) and report.per_device["flops"] > report.per_device["model_flops"]


@pytest.mark.tpu_aot
def test_a_step_too_big_for_the_chip_is_reported_not_raised():
    report = describe(
        load_config(None, ["model.preset=gpt2-small", "mesh.fsdp=4", "train.global_batch_size=64",
                           "train.seq_len=8192"]),
        topology="v5e:2x2",
    )
    assert report.fits is False and report.hbm_bytes == 16 * 1024**3
    assert report.per_device["peak_bytes"] is None and "Ran out of memory" in report.notes[0]
    assert report.per_device["param_bytes"] == pytest.approx(report.param_count * 4 / 4, rel=0.01)


def test_the_cache_stays_off_until_the_last_of_several_threads_compiling_for_a_slice_leaves():
    # Two slices compiled side by side (tests/test_pipeline_memory.py does): the first thread out must not turn the
    # cache back on under the second, and the second must not leave it off for good.
    before = jax.config.jax_enable_compilation_cache
    inside, first_out = threading.Barrier(2), threading.Event()
    seen: dict[str, bool] = {}

    def first():
        with without_persistent_cache():
            inside.wait()
        first_out.set()

    def second():
        with without_persistent_cache():
            inside.wait()
            first_out.wait()
            seen["after the first left"] = jax.config.jax_enable_compilation_cache

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert seen == {"after the first left": False}
    assert jax.config.jax_enable_compilation_cache == before


@pytest.mark.tpu_aot
def test_compiling_for_a_slice_leaves_the_persistent_cache_alone(devices, tmp_path):
    # A compile-only TPU client writes entries it cannot read back: the second compile of the same program
    # warned "Error reading persistent compilation cache entry" before describe compiled slices without it.
    # A cache of its own: the session's is written by the other test workers meanwhile.
    session = jax.config.jax_compilation_cache_dir
    jax.config.update("jax_compilation_cache_dir", str(tmp_path))
    compilation_cache.reset_cache()
    try:
        cfg = load_config("configs/tiny.yaml", ["mesh.fsdp=2", "mesh.tensor=2"])
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(2):
                report = describe(cfg, topology="v5e:2x2")
        assert report.per_device["temp_bytes"] > 0
        assert not [w for w in caught if "compilation cache" in str(w.message)], [str(w.message) for w in caught]
        assert not list(tmp_path.iterdir())  # nothing written for the slice
        assert jax.config.jax_enable_compilation_cache  # and the cache is on again for this host's programs
    finally:
        jax.config.update("jax_compilation_cache_dir", session)
        compilation_cache.reset_cache()
