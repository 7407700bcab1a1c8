"""The model-FLOP convention behind MFU, checked by hand."""

import pytest

from spmd_train import Trainer, load_config
from spmd_train.hardware import device_spec
from spmd_train.models.flops import flops_per_token, matmul_params


def test_llama3_8b_flops_by_hand():
    m = load_config(None, ["model.preset=llama3-8b"]).model
    # Per layer: Q and O 4096 x 4096 each, K and V 4096 x 1024 each, MLP 3 x 4096 x 14336; plus the LM head.
    per_layer = 2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336
    head = 4096 * 128256
    assert matmul_params(m) == 32 * per_layer + head == 7_504_658_432
    # Attention at 8k context: 6 x layers x seq x heads x head_dim (causal counted as half).
    attention = 6 * 32 * 8192 * 32 * 128
    assert flops_per_token(m, 8192) == 6 * (32 * per_layer + head) + attention == pytest.approx(5.15e10, rel=1e-3)


def test_mfu_uses_the_peak_override(tmp_path, devices):
    cfg = load_config(None, ["model.preset=tiny", "train.global_batch_size=16", "train.seq_len=16",
                             "train.steps=2", "run.peak_tflops=0.5", f"run.dir={tmp_path}"])
    trainer = Trainer(cfg, devices)
    record = trainer.step()
    expected = record["tokens_per_sec_per_device"] * flops_per_token(cfg.model, 16) / 0.5e12
    assert record["mfu"] == pytest.approx(expected)
    trainer.close()


@pytest.mark.parametrize(
    ("kind", "peak"),
    [("TPU v5 lite", 197e12), ("TPU v5", 459e12), ("TPU v6 lite", 918e12), ("NVIDIA H100 80GB HBM3", 989.5e12),
     ("NVIDIA H100 PCIe", 756.5e12), ("NVIDIA H200", 989.5e12), ("TPU7x", 1153.5e12), ("cpu", None)],
)
def test_peak_table_matches_device_kinds(kind, peak):
    spec = device_spec(kind)
    assert (spec.peak_bf16_flops if spec else None) == peak
