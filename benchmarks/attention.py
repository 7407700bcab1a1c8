"""Attention speed and correctness: our Pallas kernel against cuDNN and plain XLA.

Usage: python benchmarks/attention.py [--lengths 1024 2048 4096 8192 16384]
On a GPU or TPU: checks our output against the baseline first, then times forward and
forward+backward and reports TFLOP/s. FLOP convention: forward 4 x batch x heads x L^2 x d,
halved for causal attention (the masked half is not counted); forward+backward is 3.5x
forward (the backward recomputes the scores: 2.5x). On CPU the kernel only runs in interpret
mode, so the script checks correctness at small sizes and times nothing.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.report import provenance, time_call, update_section  # noqa: E402
from spmd_train.kernels.flash_attention import flash_attention, reference_attention  # noqa: E402


def _inputs(batch, length, heads, kv_heads, d, dtype, seed=0):
    keys = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(keys[0], (batch, length, heads, d), dtype)
    k = jax.random.normal(keys[1], (batch, length, kv_heads, d), dtype)
    v = jax.random.normal(keys[2], (batch, length, kv_heads, d), dtype)
    return q, k, v, jax.random.normal(keys[3], q.shape, dtype)


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def correctness_rows(lengths, dtype=jnp.float32):
    """Forward and gradient relative errors of the kernel against the XLA reference."""
    rows = []
    for length in lengths:
        q, k, v, do = _inputs(2, length, 4, 2, 64, dtype)
        ours = jax.vjp(lambda q, k, v: flash_attention(q, k, v, causal=True), q, k, v)
        ref = jax.vjp(lambda q, k, v: reference_attention(q, k, v, causal=True), q, k, v)
        errs = [_rel(ours[0], ref[0])] + [_rel(a, b) for a, b in zip(ours[1](do), ref[1](do))]
        rows.append(f"| {length} | " + " | ".join(f"{e:.1e}" for e in errs) + " |")
    return rows


def speed_rows(lengths, baseline):
    """TFLOP/s of ours and the baseline, forward and forward+backward, bf16, head_dim 128."""
    rows = []
    for length in lengths:
        batch = max(1, 16384 // length)
        heads, d = 32, 128
        q, k, v, do = _inputs(batch, length, heads, 8, d, jnp.bfloat16)
        impls = {
            "ours": lambda q, k, v: flash_attention(q, k, v, causal=True),
            baseline: lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=baseline),
        }
        ref = impls[baseline](q, k, v)
        assert _rel(impls["ours"](q, k, v), ref) < 2e-2, "ours disagrees with the baseline"
        flops = 4 * batch * heads * length**2 * d / 2
        cells = []
        for name, fn in impls.items():
            fwd = time_call(jax.jit(fn), q, k, v)
            grad = jax.jit(jax.grad(lambda q, k, v, fn=fn: jnp.sum(fn(q, k, v).astype(jnp.float32) * do),
                                    argnums=(0, 1, 2)))
            both = time_call(grad, q, k, v)
            cells += [flops / fwd / 1e12, 3.5 * flops / both / 1e12]
        rows.append(f"| {length} | {batch} | " + " | ".join(f"{c:.0f}" for c in cells)
                    + f" | {cells[3] and cells[1] / cells[3]:.2f} |")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=None)
    args = parser.parse_args()
    platform = jax.devices()[0].platform
    command = "python benchmarks/attention.py " + " ".join(sys.argv[1:])
    if platform == "cpu":
        lengths = args.lengths or [17, 129, 384]  # length 1 has exactly-zero dq/dk: no relative error
        rows = ["| length | out | dq | dk | dv |", "|---:|---:|---:|---:|---:|", *correctness_rows(lengths)]
        note = ("CPU: interpret-mode correctness only (relative error against the XLA reference, fp32, causal, "
                "GQA 2). Speed needs a GPU or TPU run of this script.")
    elif platform == "gpu":
        note = ("GPU: the Pallas kernel has no GPU lowering yet (see docs/attention.md); nothing to compare "
                "against cuDNN until it has.")
        rows = []
    else:
        lengths = args.lengths or [1024, 2048, 4096]
        rows = ["| length | batch | ours fwd | ours fwd+bwd | XLA fwd | XLA fwd+bwd | fwd+bwd ours/XLA |",
                "|---:|---:|---:|---:|---:|---:|---:|", *speed_rows(lengths, "xla")]
        note = "TFLOP/s per device, bf16, head_dim 128, 32 query / 8 K/V heads, causal (FLOP convention above)."
    table = "\n".join(rows)
    print(note + "\n" + table)
    update_section("attention", "Flash attention (`benchmarks/attention.py`)",
                   provenance(command.strip()) + "\n" + note + "\n\n" + table + "\n")


if __name__ == "__main__":
    main()
