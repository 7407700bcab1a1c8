"""benchmarks/attention.py's sliding-window comparison (`--windows`), on CPU: the band's FLOP count and one row with
the interpreted kernels against XLA's sliding window (jax.nn.dot_product_attention's `local_window_size`), the same
call the GPU run makes with cuDNN. No timing is asserted: these machines are shared."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks.attention import band_pairs, window_rows


@pytest.mark.parametrize(("length", "window"), [(64, 16), (10, 1), (10, 40), (8192, 1024)])
def test_band_pairs_count_what_a_causal_window_sees(length, window):
    pos = np.arange(length)
    seen = (pos[:, None] >= pos[None]) & (pos[:, None] - pos[None] < window)
    assert band_pairs(length, window) == seen.sum()


def test_a_window_row_checks_ours_against_the_baseline_and_reports_both():
    rows = window_rows([64], [16], baseline="xla", tokens=64, heads=2, kv_heads=1, head_dim=32, dtype=jnp.float32,
                       repeats=1)
    assert rows[0].startswith("| length | window | batch | ours fwd | ours fwd+bwd | xla fwd | xla fwd+bwd")
    cells = [c.strip() for c in rows[2].strip("|").split("|")]
    assert cells[:3] == ["64", "16", "1"] and len(cells) == len(rows[0].strip("|").split("|"))
    out_err, grad_err = (float(x) for x in cells[-1].split(" / "))
    assert out_err < 1e-4 and grad_err < 1e-4  # fp32 kernels against XLA: the same band
