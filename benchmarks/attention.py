"""Attention speed and correctness: our Pallas kernels against cuDNN and plain XLA.

Usage: python benchmarks/attention.py [--lengths 1024 2048 4096 8192 16384] [--sweep LENGTH] [--windows 1024 4096]
On a GPU (ours vs cuDNN and XLA side by side) or TPU (ours vs XLA): checks our output and
gradients against the first baseline, then times forward and
forward+backward and reports TFLOP/s. FLOP convention: forward 4 x batch x heads x L^2 x d,
halved for causal attention (the masked half is not counted); forward+backward is 3.5x
forward (the backward recomputes the scores: 2.5x). On CPU the kernel only runs in interpret
mode, so the script checks correctness at small sizes and times nothing. `--windows W ...` times
sliding-window attention instead (default lengths 8k and 16k): ours against cuDNN's sliding window
(`local_window_size`), FLOPs counted over the band only (`band_pairs`).
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.report import provenance, time_call, update_section
from spmd_train.kernels.flash_attention import BlockSizes, flash_attention
from spmd_train.ops import dot_product_attention as reference_attention


def _inputs(batch, length, heads, kv_heads, d, dtype, seed=0):
    keys = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(keys[0], (batch, length, heads, d), dtype)
    k = jax.random.normal(keys[1], (batch, length, kv_heads, d), dtype)
    v = jax.random.normal(keys[2], (batch, length, kv_heads, d), dtype)
    return q, k, v, jax.random.normal(keys[3], q.shape, dtype)


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def correctness_rows(lengths, dtype=jnp.float32, backend: str = "tpu"):
    """Forward and gradient relative errors of the kernel against the XLA reference."""
    rows = []
    for length in lengths:
        q, k, v, do = _inputs(2, length, 4, 2, 64, dtype)
        ours = jax.vjp(lambda q, k, v: flash_attention(q, k, v, causal=True, backend=backend), q, k, v)
        ref = jax.vjp(lambda q, k, v: reference_attention(q, k, v, causal=True), q, k, v)
        errs = [_rel(ours[0], ref[0])] + [_rel(a, b) for a, b in zip(ours[1](do), ref[1](do), strict=False)]
        rows.append(f"| {backend} | {jnp.dtype(dtype).name} | {length} | "
                    + " | ".join(f"{e:.1e}" for e in errs) + " |")
    return rows


def speed_rows(lengths, baselines):
    """TFLOP/s of ours and each baseline, forward and forward+backward, bf16, head_dim 128, causal.

    Ours is checked against the first baseline (output and all three gradients) before any timing."""
    rows = []
    for length in lengths:
        batch, heads, d = max(1, 32768 // length), 32, 128  # 32k tokens x 32 heads: fills an H200
        q, k, v, do = _inputs(batch, length, heads, 8, d, jnp.bfloat16)
        impls = {"ours": lambda q, k, v: flash_attention(q, k, v, causal=True)}
        for name in baselines:
            impls[name] = lambda q, k, v, name=name: jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                                                                  implementation=name)
        grads = {name: jax.jit(jax.grad(lambda q, k, v, fn=fn, do=do: jnp.sum(fn(q, k, v).astype(jnp.float32) * do),
                                        argnums=(0, 1, 2))) for name, fn in impls.items()}
        base = baselines[0]
        err = _rel(impls["ours"](q, k, v), impls[base](q, k, v))
        grad_err = max(_rel(a, b) for a, b in zip(grads["ours"](q, k, v), grads[base](q, k, v), strict=True))
        if err > 2e-2 or grad_err > 5e-2:
            raise SystemExit(f"length {length}: ours disagrees with {base}: output {err:.1e}, gradients {grad_err:.1e}")
        flops = 4 * batch * heads * length**2 * d / 2
        cells = []
        for name, fn in impls.items():
            if name == "xla" and not _xla_fits(batch, heads, length):
                cells += [float("nan")] * 2
                continue
            fwd = time_call(jax.jit(fn), q, k, v)
            both = time_call(grads[name], q, k, v)
            cells += [flops / fwd / 1e12, 3.5 * flops / both / 1e12]
        rows.append(f"| {length} | {batch} | " + " | ".join("oom" if c != c else f"{c:.0f}" for c in cells)
                    + f" | {cells[0] / cells[2]:.2f} | {cells[1] / cells[3]:.2f} | {err:.1e} / {grad_err:.1e} |")
        print(rows[-1], flush=True)  # a later length may run out of time: keep what is done
    return rows


def band_pairs(length: int, window: int) -> int:
    """(query, key) pairs a causal `window` sees over `length` tokens: query i sees min(i + 1, window) keys."""
    w = min(window, length)
    return length * w - w * (w - 1) // 2


def window_rows(lengths, windows, baseline: str = "cudnn", *, tokens: int = 32768, heads: int = 32, kv_heads: int = 8,
                head_dim: int = 128, dtype=jnp.bfloat16, repeats: int = 10):
    """TFLOP/s (band FLOPs) of our windowed kernels and `baseline`'s sliding window (jax.nn.dot_product_attention,
    `local_window_size` = (window - 1, 0): the window - 1 keys before each query and itself), forward and
    forward+backward, after checking ours against it (output and all three gradients). `tokens` per batch."""
    rows = []
    for length in lengths:
        batch = max(1, tokens // length)
        q, k, v, do = _inputs(batch, length, heads, kv_heads, head_dim, dtype)
        for window in windows:
            impls = {"ours": lambda q, k, v, w=window: flash_attention(q, k, v, causal=True, window=w),
                     baseline: lambda q, k, v, w=window: jax.nn.dot_product_attention(
                         q, k, v, is_causal=True, local_window_size=(w - 1, 0), implementation=baseline)}
            grads = {name: jax.jit(jax.grad(lambda q, k, v, fn=fn, do=do: jnp.sum(fn(q, k, v).astype(jnp.float32) * do),
                                            argnums=(0, 1, 2))) for name, fn in impls.items()}
            err = _rel(impls["ours"](q, k, v), impls[baseline](q, k, v))
            grad_err = max(_rel(a, b) for a, b in zip(grads["ours"](q, k, v), grads[baseline](q, k, v), strict=True))
            if err > 2e-2 or grad_err > 5e-2:
                raise SystemExit(f"length {length}, window {window}: ours disagrees with {baseline}: output "
                                 f"{err:.1e}, gradients {grad_err:.1e}")
            flops = 4 * batch * heads * band_pairs(length, window) * head_dim
            cells = []
            for name, fn in impls.items():
                cells += [flops / time_call(jax.jit(fn), q, k, v, repeats=repeats) / 1e12,
                          3.5 * flops / time_call(grads[name], q, k, v, repeats=repeats) / 1e12]
            rows.append(f"| {length} | {window} | {batch} | " + " | ".join(f"{c:.0f}" for c in cells)
                        + f" | {cells[0] / cells[2]:.2f} | {cells[1] / cells[3]:.2f} | {err:.1e} / {grad_err:.1e} |")
            print(rows[-1], flush=True)
    head = (f"| length | window | batch | ours fwd | ours fwd+bwd | {baseline} fwd | {baseline} fwd+bwd "
            f"| fwd ours/{baseline} | fwd+bwd ours/{baseline} | max rel. err. out / grads |")
    return [head, "|" + "---:|" * 9 + "---|", *rows]


def _xla_fits(batch, heads, length) -> bool:
    """Whether XLA's attention, which materialises fp32 scores and their gradient, fits in a quarter of
    device memory (beyond that it runs out of memory on an 80 GB H100 at 8k tokens x 32k per batch)."""
    stats = jax.devices()[0].memory_stats() or {}
    limit = stats.get("bytes_limit", 80 * 2**30)
    return batch * heads * length**2 * 4 <= limit // 4


SWEEP = {"gpu": [(64, 64), (64, 128), (128, 64), (128, 128)], "tpu": [(256, 256), (512, 512), (512, 1024),
                                                                      (1024, 512)]}


def sweep_rows(length, platform):
    """Our kernels' TFLOP/s per block shape at one length (same sizes and FLOP convention as above)."""
    batch, heads, d = max(1, 32768 // length), 32, 128
    q, k, v, do = _inputs(batch, length, heads, 8, d, jnp.bfloat16)
    flops = 4 * batch * heads * length**2 * d / 2
    rows = []
    for block_q, block_k in SWEEP[platform]:
        fn = functools.partial(flash_attention, causal=True, block_sizes=BlockSizes(block_q, block_k))
        grad = jax.jit(jax.grad(lambda q, k, v, fn=fn: jnp.sum(fn(q, k, v).astype(jnp.float32) * do),
                                argnums=(0, 1, 2)))
        try:
            cells = [flops / time_call(jax.jit(fn), q, k, v) / 1e12, 3.5 * flops / time_call(grad, q, k, v) / 1e12]
        except Exception as err:  # a shape that does not fit shared memory or registers: report, go on
            rows.append(f"| {block_q} | {block_k} | fails: {str(err).splitlines()[0][:80]} | |")
            continue
        rows.append(f"| {block_q} | {block_k} | {cells[0]:.0f} | {cells[1]:.0f} |")
    return ["| block_q | block_k | fwd | fwd+bwd |", "|---:|---:|---:|---:|", *rows]


def _speed_header(baselines):
    names = ["ours", *baselines]
    cols = [f"{n} {kind}" for n in names for kind in ("fwd", "fwd+bwd")]
    head = (f"| length | batch | {' | '.join(cols)} | fwd ours/{baselines[0]} | fwd+bwd ours/{baselines[0]} "
            "| max rel. err. out / grads |")
    return [head, "|" + "---:|" * (len(cols) + 5)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=None)
    parser.add_argument("--sweep", type=int, metavar="LENGTH", default=None,
                        help="time our kernels over block shapes at this length instead (GPU/TPU)")
    parser.add_argument("--windows", type=int, nargs="+", default=None,
                        help="time sliding-window attention at these windows instead (GPU: against cuDNN's)")
    args = parser.parse_args()
    platform = jax.devices()[0].platform
    command = "python benchmarks/attention.py " + " ".join(sys.argv[1:])
    if args.windows and platform == "gpu":
        table = "\n".join(window_rows(args.lengths or [8192, 16384], args.windows))
        note = (f"Sliding-window attention, TFLOP/s per device on {jax.devices()[0].device_kind} counting the band's "
                "FLOPs only (4 x batch x heads x head_dim x visible pairs, 3.5x for forward+backward), bf16, head_dim "
                "128, 32 query / 8 K/V heads, 32k tokens per batch; outputs and gradients checked against cuDNN's "
                "`local_window_size` before timing.")
        print(note + "\n" + table)
        update_section("attention-window-gpu", "Sliding-window attention on GPU (`benchmarks/attention.py --windows`)",
                       provenance(command.strip()) + "\n" + note + "\n\n" + table + "\n")
        return
    if args.sweep and platform != "cpu":
        table = "\n".join(sweep_rows(args.sweep, platform))
        note = f"Block shapes of our kernels on {jax.devices()[0].device_kind}, length {args.sweep}, TFLOP/s."
        print(note + "\n" + table)
        update_section("attention-sweep", "Flash-attention block shapes (`benchmarks/attention.py --sweep`)",
                       provenance(command.strip()) + "\n" + note + "\n\n" + table + "\n")
        return
    if platform == "cpu":
        lengths = args.lengths or [17, 129, 384]  # length 1 has exactly-zero dq/dk: no relative error
        rows = ["| kernels | dtype | length | out | dq | dk | dv |", "|---|---|---:|---:|---:|---:|---:|",
                *correctness_rows(lengths, backend="tpu"),
                *correctness_rows([n for n in lengths if n <= 129], jnp.bfloat16, backend="gpu")]
        note = ("CPU: interpret-mode correctness only (relative error against the XLA reference, causal, GQA 2; "
                "`tpu` = the Mosaic TPU kernels, `gpu` = the Mosaic GPU kernels run by Mosaic GPU's interpreter). "
                "Speed needs a GPU or TPU run of this script.")
    else:
        baselines = ["cudnn", "xla"] if platform == "gpu" else ["xla"]
        lengths = args.lengths or ([1024, 2048, 4096, 8192, 16384] if platform == "gpu" else [1024, 2048, 4096])
        rows = [*_speed_header(baselines), *speed_rows(lengths, baselines)]
        note = (f"TFLOP/s per device on {jax.devices()[0].device_kind}, bf16, head_dim 128, 32 query / 8 K/V heads, "
                "causal (FLOP convention above); outputs and gradients checked against "
                f"{baselines[0]} before timing.")
    table = "\n".join(rows)
    print(note + "\n" + table)
    # CPU correctness and accelerator speed are kept as separate sections: neither run replaces the other.
    name, title = (("attention", "Flash attention, interpret-mode correctness") if platform == "cpu"
                   else (f"attention-{platform}", f"Flash attention speed on {platform.upper()}"))
    update_section(name, f"{title} (`benchmarks/attention.py`)",
                   provenance(command.strip()) + "\n" + note + "\n\n" + table + "\n")


if __name__ == "__main__":
    main()
