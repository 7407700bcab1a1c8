"""A state that cannot fit is refused before anything compiles (XLA would abort the process, or run out of memory
after minutes), naming the keys that decide its size."""

import os
from typing import NamedTuple

import jax
import pytest

from spmd_train import Engine, Trainer, load_config
from spmd_train.analysis import tpu_topology_devices
from spmd_train.errors import ConfigError
from spmd_train.train import memory_fit
from spmd_train.train import trainer as trainer_module
from spmd_train.train.memory_fit import GiB, activation_floor, check_compiled_fits, check_state_fits
from tests.runs import cli, main_in_process


@pytest.mark.slow
def test_an_absurd_model_exits_2_in_train_and_describe_and_writes_nothing(tmp_path):
    for command in ("train", "describe"):
        proc = cli(command, "configs/tiny.yaml", "model.d_model=1000000000", f"run.dir={tmp_path / 'run'}")
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]  # not 134 (abort)
        assert ("model.num_layers=2, d_model=1000000000, d_ff=128, vocab_size=256, param_dtype=float32, "
                "parallel.zero_stage=3 on mesh fsdp 4 x tensor 2: the parameters, gradients and optimizer state "
                "need 11,175,873,298.20 GiB per device, more than any device holds") in proc.stderr
    assert not (tmp_path / "run").exists()


def test_the_state_is_measured_from_shapes_and_shardings(devices):
    """tiny (fp32, ZeRO-3 over fsdp 4 x tensor 2): params + grads + two AdamW moments = 4 x the parameters / 8,
    up to the few replicated leaves (norm scales are split over fsdp only)."""
    engine = Engine.build(load_config("configs/tiny.yaml", []), devices)
    params = sum(x.size for x in jax.tree.leaves(engine.param_shapes)) * 4
    assert params * 4 / 8 <= engine.state_bytes_per_device <= params * 4 / 4


def test_over_the_host_or_the_device_kind_is_refused():
    cpu = jax.devices("cpu")[0]
    check_state_fits(GiB, cpu, "run", allocating=True, local_devices=8)
    with pytest.raises(ConfigError, match=r"run: .* need 100.00 GiB per device, 800.00 GiB for this host's 8 "
                                          r"simulated devices, more than its"):
        check_state_fits(100 * GiB, cpu, "run", allocating=True, local_devices=8)
    check_state_fits(100 * GiB, cpu, "run", allocating=False)  # describe compiles without allocating


@pytest.mark.tpu_aot
def test_describe_for_a_tpu_slice_refuses_a_state_over_its_memory():
    cfg = load_config(None, ["model.preset=llama3-8b", "mesh.fsdp=8", "mesh.tensor=1", "parallel.zero_stage=1"])
    with pytest.raises(ConfigError, match=r"need [\d.]+ GiB per device, more than the 16 GiB of a TPU v5e"):
        Engine.build(cfg, tpu_topology_devices("v5e:2x4"))


def test_a_batch_too_large_for_memory_exits_2_before_compiling_and_writes_nothing(tmp_path, capsys):
    code, _, err = main_in_process("train", "configs/tiny.yaml", "train.global_batch_size=1048576",
                                   f"run.dir={tmp_path / 'run'}", capsys=capsys)
    assert code == 2 and "Traceback" not in err, err[-2000:]
    assert "train.global_batch_size=1048576 x train.seq_len=64 (train.grad_accum=1): one step needs at least" in err
    assert "valid: train.grad_accum=" in err and "compiled" not in err
    assert not (tmp_path / "run").exists()


def test_the_floor_counts_the_logits_and_each_layers_residual_stream():
    cfg = load_config("configs/tiny.yaml", ["train.grad_accum=2"])
    m = cfg.model
    # 8 rows of 65 tokens per device, two microbatches: 4 x 64 tokens each.
    floor = activation_floor(cfg, (8, 65), {"fsdp": 4, "tensor": 2})
    assert floor == 4 * 64 * (m.vocab_size // 2) * 4 + m.num_layers * 4 * 64 * m.d_model * 4


class _Memory(NamedTuple):
    argument_size_in_bytes: int
    output_size_in_bytes: int
    temp_size_in_bytes: int
    alias_size_in_bytes: int


def test_a_compiled_step_over_the_device_is_refused_with_what_would_fit():
    cpu = jax.devices("cpu")[0]
    cfg = load_config("configs/tiny.yaml", [])
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    share = host // 8
    check_compiled_fits(_Memory(share // 4, share // 4, share // 4, 0), cpu, cfg, local_devices=8)
    with pytest.raises(ConfigError, match=r"the compiled train step needs .* GiB per device .* activations and "
                                          r"temporaries for train.global_batch_size=32 x train.seq_len=64, "
                                          r"train.grad_accum=1, parallel.remat=.*nothing ran \(valid: about "
                                          r"train.grad_accum=4 "):
        check_compiled_fits(_Memory(share // 4, 0, 3 * share, 0), cpu, cfg, local_devices=8)


@pytest.mark.slow
def test_a_step_refused_after_compiling_leaves_no_run_dir(tmp_path, devices, monkeypatch):
    monkeypatch.setattr(memory_fit, "_device_limit", lambda device, local: (2**20, "in this test"))
    cfg = load_config("configs/tiny.yaml", [f"run.dir={tmp_path / 'run'}", "train.steps=2"])
    monkeypatch.setattr(trainer_module, "check_batch_fits", lambda *a, **k: None)  # only the compiled check
    trainer = Trainer(cfg, devices)
    try:
        with pytest.raises(ConfigError, match=r"the compiled train step needs .* more than the 0.0 GiB in this test"):
            trainer.run()
    finally:
        trainer.close()
    assert not (tmp_path / "run").exists()
