"""The command line as a user meets it: a real run, and bad input that exits 2 without a traceback."""

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from spmd_train import load_config
from spmd_train.train import interrupts
from tests.runs import cli, main_in_process, uncached_env

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_train_writes_metrics_and_learns(tmp_path):
    run_dir = tmp_path / "run"
    proc = cli("train", "configs/tiny.yaml", "train.steps=40", f"run.dir={run_dir}")
    assert proc.returncode == 0, proc.stderr
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 41))
    for r in records:
        assert {"step", "loss", "grad_norm", "lr", "step_time_s", "tokens_per_sec", "tokens_per_sec_per_device",
                "mfu", "memory_bytes", "loss_floor"} <= set(r)
        assert r["step_time_s"] > 0 and r["tokens_per_sec"] == pytest.approx(8 * r["tokens_per_sec_per_device"])
        assert r["mfu"] is None  # no peak FLOP/s is known for a CPU without run.peak_tflops
    assert records[-1]["loss"] < records[0]["loss"] - 0.3
    assert records[0]["loss_floor"] == pytest.approx(3.6847, abs=1e-3)
    assert records[0]["loss_floor"] < records[-1]["loss"]
    assert records[0]["lr"] == 0.0 and records[10]["lr"] == pytest.approx(3e-3, rel=1e-3)  # warmup, then peak
    assert "compiled the train step" in proc.stderr and "best achievable loss" in proc.stderr
    assert "done: step 40" in proc.stdout and str(run_dir / "checkpoints") in proc.stdout
    assert (run_dir / "checkpoints" / "40").is_dir() and list((run_dir / "tensorboard").glob("events.*"))
    # The backends are chosen once and said at start; config.json keeps them and the effective rules,
    # and loads back as the same config.
    assert "backends: attention xla, experts capacity (factor 1.25) on cpu; auto: xla on cpu" in proc.stderr
    record = json.loads((run_dir / "config.json").read_text())
    assert record["resolved"]["backends"]["attention"] == "xla"
    assert record["resolved"]["rules"]["params"]["embed"] == ["fsdp", "sequence"]
    hlo = (run_dir / "compiled" / "train_step.hlo.txt").read_text()  # the program the run ran
    assert hlo.startswith("HloModule") and "all-reduce" in hlo
    assert load_config(run_dir / "config.json") == load_config(ROOT / "configs" / "tiny.yaml",
                                                               ["train.steps=40", f"run.dir={run_dir}"])


@pytest.mark.parametrize(
    ("overrides", "needles"),
    [
        (["mesh.fsdp=3"], ["fsdp=3", "tensor=2", "multiply to 6", "8 devices"]),
        (["model.num_heads=12", "model.num_kv_heads=4", "model.head_dim=8", "mesh.tensor=8", "mesh.fsdp=1"],
         ["model.num_heads=12", "mesh.tensor=8", "1, 2, 3, 4, 6, 12"]),
        (["train.global_batch_size=8", "train.grad_accum=4"],
         ["train.global_batch_size=8", "train.grad_accum=4", "multiple of 16"]),
        (["parallel.sequence_parallel=true", "train.seq_len=63"],
         ["train.seq_len=63", "mesh.tensor=2", "sequence_parallel", "multiple of 2"]),
        (["model.d_modle=64"], ["unknown key 'model.d_modle'", "d_model"]),
        (["train.steps=many"], ["train.steps='many'", "integer"]),
        (["parallel.zero_stage=5"], ["parallel.zero_stage=5", "0, 1, 2 or 3"]),
        (["mesh.pipeline=4", "mesh.fsdp=2", "mesh.tensor=1"],
         ["model.num_layers=2", "mesh.pipeline=4", "preset 'tiny'"]),
        (["mesh.pipeline=4", "mesh.fsdp=2", "mesh.tensor=1", "model.num_layers=8", "parallel.pipeline_microbatches=2"],
         ["parallel.pipeline_microbatches=2", "1f1b", "mesh.pipeline=4", ">= 4"]),
        (["mesh.rules.params.embed=[tensor]"], ["mesh axis 'tensor'", "'embed'", "'kv_heads'", "--rules"]),
    ],
    ids=["mesh-product", "heads-vs-tensor", "batch-vs-accum", "seq-vs-sp", "unknown-key", "wrong-type", "zero-stage",
         "pipeline-too-shallow", "microbatches-below-stages", "mesh-axis-twice"],
)
def test_bad_input_exits_2_with_a_message(tmp_path, overrides, needles, capsys):
    run_dir = tmp_path / "run"
    code, _, err = main_in_process("train", "configs/tiny.yaml", f"run.dir={run_dir}", *overrides, capsys=capsys)
    assert code == 2, err
    assert "Traceback" not in err
    assert err.strip().startswith("spmd-train: error:") or "spmd-train: error:" in err
    for needle in needles:
        assert needle in err, (needle, err)
    assert not (run_dir / "metrics.jsonl").exists()


def test_describe_rules_prints_the_effective_rules_with_those_the_code_adds(capsys):
    code, out, err = main_in_process("describe", "configs/tiny.yaml", "--rules", "parallel.sequence_parallel=true",
                                     "mesh.rules.params.vocab=[]", capsys=capsys)
    assert code == 0, err
    rows = {line.split("│")[1].strip(): [c.strip() for c in line.split("│")[2:4]]
            for line in out.splitlines() if line.startswith("│")}
    assert rows["batch"][0] == "data, fsdp, expert" and rows["embed"] == ["-", "fsdp, sequence"]
    assert rows["norm_length"][0] == "sequence, tensor" and rows["vocab"] == ["tensor", "-"]
    assert "added by the code: activations.norm_length += tensor (parallel.sequence_parallel=true" in out
    code, out, err = main_in_process("describe", "configs/pipeline.yaml", "--rules", "--json", capsys=capsys)
    as_json = json.loads(out)
    assert as_json["params"]["layers"] == ["pipeline"] and "mesh.pipeline=4" in as_json["added_by_code"][0]


def test_missing_config_file_exits_2(capsys):
    code, _, err = main_in_process("train", "configs/no_such.yaml", capsys=capsys)
    assert code == 2 and "configs/no_such.yaml" in err and "Traceback" not in err


@pytest.mark.slow
def test_prepare_data_then_train_on_it(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the quick brown fox jumps over the lazy dog. " * 400)
    prep = cli("prepare-data", str(corpus), "--out", str(tmp_path / "data"))
    assert prep.returncode == 0, prep.stderr
    assert "wrote 18,001 tokens" in prep.stdout  # and the end-of-text id
    run_dir = tmp_path / "run"
    proc = cli("train", "configs/tiny.yaml", "data.source=tokens", f"data.paths=[{tmp_path / 'data' / 'data.bin'}]",
                "model.vocab_size=264", "train.steps=30", f"run.dir={run_dir}")
    assert proc.returncode == 0, proc.stderr
    losses = [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert losses[-1] < losses[0] - 1.0


@pytest.mark.parametrize(
    ("setup", "args", "needle"),
    [
        (lambda d: (d / "empty.bin").write_bytes(b""), ["data.source=tokens", "data.paths=[{d}/empty.bin]"],
         "empty.bin is empty"),
        (lambda d: (d / "doc.txt").write_text("short"), ["data.source=text", "data.paths=[{d}/doc.txt]",
                                                           "data.packing=false", "data.val_fraction=0.0"],
         "doc.txt has 5 tokens"),
        # Token ids the model cannot embed: refused before the first step, not trained into NaN.
        (lambda d: (d / "prose.txt").write_text("Some prose, not token ids. " * 40),
         ["data.source=tokens", "data.paths=[{d}/prose.txt]"], "it looks like text"),
    ],
    ids=["empty-file", "seq-longer-than-document", "text-given-as-tokens"],
)
def test_bad_data_through_the_cli(tmp_path, setup, args, needle, capsys):
    setup(tmp_path)
    code, _, err = main_in_process("train", "configs/tiny.yaml", f"run.dir={tmp_path / 'run'}",
                                   *(a.format(d=tmp_path) for a in args), capsys=capsys)
    assert code == 2 and "Traceback" not in err
    assert needle in err


@pytest.mark.slow
def test_profile_steps_write_a_trace(tmp_path):
    proc = cli("train", "configs/tiny.yaml", "train.steps=6", "run.profile_steps=[3,4]", f"run.dir={tmp_path}")
    assert proc.returncode == 0, proc.stderr
    traces = list((tmp_path / "profile").rglob("*.xplane.pb"))
    assert traces and traces[0].stat().st_size > 0


@pytest.mark.slow
def test_main_job_ends_within_ten_percent_of_the_floor(tmp_path):
    proc = cli("train", "configs/tiny.yaml", f"run.dir={tmp_path}", optimized=True)
    assert proc.returncode == 0, proc.stderr
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    final = sum(r["loss"] for r in records[-20:]) / 20
    assert len(records) == 600 and final <= 1.10 * records[-1]["loss_floor"]
    # The step guards leave a healthy run alone: no step skipped, even converged at the floor.
    assert not any(r["skipped"] for r in records) and records[-1]["skipped_steps"] == 0
    assert (tmp_path / "checkpoints" / "600").is_dir() and "checkpoints in" in proc.stdout


def test_a_ctrl_c_that_native_code_swallowed_still_stops_the_run_before_its_first_step(tmp_path, devices):
    # What a SIGINT during compilation looks like when the compiler catches the KeyboardInterrupt it raised.
    from spmd_train.train import interrupts
    from spmd_train.train.trainer import Trainer

    interrupts.install()
    try:
        try:
            interrupts.on_sigint(signal.SIGINT, None)
        except KeyboardInterrupt:
            pass  # swallowed
        trainer = Trainer(load_config("configs/tiny.yaml", ["train.steps=3", f"run.dir={tmp_path}"]), devices)
        with pytest.raises(KeyboardInterrupt):
            trainer.run()
        assert trainer.step_count == 0 and not (tmp_path / "metrics.jsonl").exists()
    finally:
        interrupts.install()  # clears the flag
        signal.signal(signal.SIGINT, signal.default_int_handler)


GC_CALLBACK_CTRL_C = """
import gc, signal
from spmd_train.train import interrupts

def ctrl_c(phase, info):
    if phase == "start":
        interrupts.on_sigint(signal.SIGINT, None)

def other(phase, info):
    if phase == "start":
        raise ValueError("other")

interrupts.install()
gc.callbacks.append(ctrl_c)
gc.collect()
gc.callbacks[:] = [other]
gc.collect()
gc.callbacks.clear()
try:
    interrupts.raise_if_interrupted()
except KeyboardInterrupt:
    print("remembered")
"""


@pytest.mark.faults
def test_a_ctrl_c_inside_a_gc_callback_prints_no_traceback_and_is_remembered():
    # The SIGINT of one CI run landed in jax's garbage-collection callback: Python printed "Exception ignored in
    # <function _xla_gc_callback>" with a traceback. In a process of its own: pytest puts its own unraisablehook.
    proc = subprocess.run([sys.executable, "-c", GC_CALLBACK_CTRL_C], cwd=ROOT, env=uncached_env(),
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0 and proc.stdout == "remembered\n", proc.stderr
    # The Ctrl-C leaves no trace; anything else unraisable is still reported as Python reports it.
    assert "KeyboardInterrupt" not in proc.stderr and proc.stderr.count("Traceback") == 1, proc.stderr
    assert "ValueError: other" in proc.stderr, proc.stderr


class _RaisesWhenCollected:
    def __init__(self, err: Exception):
        self.err = err

    def __del__(self):
        raise self.err


def test_the_ctrl_c_hook_keeps_the_clis_quiet_orbax_teardown(capsys):
    # main() installs the CLI's unraisable hook (Orbax's writers abandoned on a closed event loop are noise), then the
    # Ctrl-C hook on top; the Ctrl-C hook used to hand everything else to Python's own, so a disk-full stop printed a
    # traceback per abandoned write (1 CI run, 40 of them). Both hooks must act, in the order main() installs them.
    from spmd_train.cli.main import _quiet_unraisable

    saved = sys.unraisablehook, signal.getsignal(signal.SIGINT)
    try:
        sys.unraisablehook = _quiet_unraisable
        interrupts.install()
        _RaisesWhenCollected(RuntimeError("Event loop is closed"))
        assert capsys.readouterr().err == ""
        _RaisesWhenCollected(ValueError("other"))
        assert "ValueError: other" in capsys.readouterr().err
    finally:
        sys.unraisablehook = saved[0]
        signal.signal(signal.SIGINT, saved[1])


@pytest.mark.tpu_aot
def test_a_run_on_the_hosts_real_devices_prints_nothing_of_libtpu(tmp_path):
    # The tpu-aot extra installs libtpu to compile for TPU slices; a run on a host without a TPU must not start (and
    # log the failure of) jax's TPU backend. Simulated devices pin jax to the CPU anyway; real ones did not.
    proc = cli("train", "configs/tiny.yaml", "run.simulate_devices=null", "mesh.fsdp=1", "mesh.tensor=1",
               "train.steps=1", f"run.dir={tmp_path / 'run'}")
    assert proc.returncode == 0, proc.stderr
    assert "step 1/1" in proc.stderr
    for noise in ("TPU", "libtpu", "E0000", "InitGoogle"):
        assert noise not in proc.stderr, proc.stderr


def _as_from_a_terminal() -> None:
    """In the child before it starts: Ctrl-C at its default, as a terminal starts a command. A suite launched in the
    background by a non-interactive shell (`cmd &`) passes SIGINT on ignored, as POSIX asks, and the command rightly
    keeps it ignored: one such run trained all 600 steps through the signal."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.faults
def test_ctrl_c_while_the_command_imports_jax_exits_130_with_one_line(tmp_path):
    # -X importtime prints each module as its import finishes: a jax module done means the package's imports are
    # under way (the guard is installed before them), and the command's own handler is not in place yet.
    proc = subprocess.Popen([sys.executable, "-X", "importtime", "-m", "spmd_train", "train", "configs/tiny.yaml",
                             f"run.dir={tmp_path / 'run'}"], cwd=ROOT, env=uncached_env(), stderr=subprocess.PIPE,
                            text=True, preexec_fn=_as_from_a_terminal)
    for line in proc.stderr:
        if line.rstrip().endswith("jax._src.config"):
            proc.send_signal(signal.SIGINT)
            break
    rest = proc.stderr.read()
    assert proc.wait(timeout=60) == 130, rest
    said = [line for line in rest.splitlines() if not line.startswith("import time:")]
    assert said == ["spmd-train: interrupted (Ctrl-C) while starting; nothing was run"], rest
    assert not (tmp_path / "run").exists()


@pytest.mark.faults
def test_ctrl_c_while_compiling_exits_130_with_one_line(tmp_path):
    proc = subprocess.Popen([sys.executable, "-m", "spmd_train", "train", "configs/tiny.yaml",
                             f"run.dir={tmp_path / 'run'}"], cwd=ROOT, env=uncached_env(), stderr=subprocess.PIPE,
                            text=True, preexec_fn=_as_from_a_terminal)
    lines = []
    for line in proc.stderr:  # "backends: ..." is the last line before the train step compiles
        lines.append(line)
        if "backends:" in line:
            proc.send_signal(signal.SIGINT)
            break
    rest = proc.stderr.read()
    assert proc.wait(timeout=120) == 130, rest
    assert "Traceback" not in rest and "interrupted (Ctrl-C) while starting the run" in rest
    assert not (tmp_path / "run" / "checkpoints").exists() or not any((tmp_path / "run" / "checkpoints").iterdir())
