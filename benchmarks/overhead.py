"""Framework overhead: our train step vs a hand-written minimal jitted step of the same model, and the
cost of the step guards (our step with them against the same step with them compiled out).

Usage: python benchmarks/overhead.py [--rounds 20] [--steps 10] [--batch 16] [--seq 64] [--model tiny]
All run on one CPU device, start from the same parameters, use the same optimizer, the
same attention and cross-entropy math and the same batch, and are timed in alternating
rounds (noise hits all alike). The script first checks they compute the same loss, so the
ratios isolate what the framework adds (NNX module plumbing, logical sharding constraints,
explicit shardings, donation and metrics) and what the guards add (judging the step and
selecting the old or new state, `spmd_train/train/guards.py`).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from unittest import mock

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax
import jax.numpy as jnp
import optax

from benchmarks.report import provenance, update_section
from spmd_train import Engine, load_config
from spmd_train.data import make_source
from spmd_train.ops import (
    cross_entropy,
    dot_product_attention,
)
from spmd_train.train import engine as engine_module


def minimal_step_fn(cfg, tx):
    """The same Llama-style model and update written directly against jax.numpy."""
    m = cfg.model
    hd = m.resolved_head_dim

    def rms(x, scale):
        return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + m.norm_eps) * scale

    def rope(x):
        inv = 1.0 / (m.rope_theta ** (jnp.arange(0, hd, 2, dtype=jnp.float32) / hd))
        ang = jnp.arange(x.shape[1], dtype=jnp.float32)[:, None] * inv
        cos, sin = jnp.cos(ang)[None, :, None], jnp.sin(ang)[None, :, None]
        a, b = jnp.split(x, 2, -1)
        return jnp.concatenate([a * cos - b * sin, b * cos + a * sin], -1)

    def layer(x, p):
        h = rms(x, p["attn_norm"]["scale"])
        a = p["attn"]
        q = rope(jnp.einsum("bld,dhk->blhk", h, a["wq"]))
        k = rope(jnp.einsum("bld,dhk->blhk", h, a["wk"]))
        v = jnp.einsum("bld,dhk->blhk", h, a["wv"])
        o = dot_product_attention(q, k, v, causal=True)
        x = x + jnp.einsum("blhk,hkd->bld", o, a["wo"])
        h = rms(x, p["mlp_norm"]["scale"])
        f = p["mlp"]
        x = x + jax.nn.silu(h @ f["w_gate"]) * (h @ f["w_up"]) @ f["w_down"]
        return x, None

    def loss_fn(params, tokens):
        x = params["embedding"][tokens[:, :-1]]
        x, _ = jax.lax.scan(layer, x, params["blocks"])
        logits = rms(x, params["final_norm"]["scale"]) @ params["lm_head"]
        return cross_entropy(logits, tokens[:, 1:])

    def step(params, opt_state, tokens):
        loss, grads = jax.value_and_grad(loss_fn)(params, tokens)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return jax.jit(step, donate_argnums=(0, 1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--model", default="tiny")
    args = parser.parse_args()
    cfg = load_config(None, [f"model.preset={args.model}", "mesh.fsdp=1", f"train.global_batch_size={args.batch}",
                             f"train.seq_len={args.seq}", "train.steps=1000", "model.compute_dtype=float32",
                             "model.param_dtype=float32"])
    engine = Engine.build(cfg, jax.devices()[:1])
    tokens = make_source(cfg).batch(0, engine.batch_sharding).tokens  # a bare [batch, seq_len + 1] array

    # The same step with the guards compiled out: every step applied, nothing judged or selected.
    bare_engine = Engine.build(cfg, jax.devices()[:1])
    bare = bare_engine.init_state()
    with mock.patch.object(engine_module, "keep_if", lambda ok, new, old: new), \
            mock.patch.object(engine_module, "judge", lambda *a, **k: jnp.zeros((), jnp.int32)):
        bare_step = bare_engine.train_step.lower(bare, tokens).compile()

    ours = engine.init_state()
    base_params = jax.tree.map(jnp.copy, ours.params)
    base_opt = engine.tx.init(base_params)
    minimal = minimal_step_fn(cfg, engine.tx)

    # Same work: one step of each from the same start gives the same loss.
    ours, metrics = engine.train_step(ours, tokens)
    bare, bare_metrics = bare_step(bare, tokens)
    base_params, base_opt, base_loss = minimal(base_params, base_opt, tokens)
    assert abs(float(metrics["loss"]) - float(base_loss)) < 1e-5, (float(metrics["loss"]), float(base_loss))
    assert float(metrics["loss"]) == float(bare_metrics["loss"])

    def time_ours():
        nonlocal ours
        start = time.perf_counter()
        for _ in range(args.steps):
            ours, m = engine.train_step(ours, tokens)
        jax.block_until_ready(m)
        return (time.perf_counter() - start) / args.steps

    def time_bare():
        nonlocal bare
        start = time.perf_counter()
        for _ in range(args.steps):
            bare, m = bare_step(bare, tokens)
        jax.block_until_ready(m)
        return (time.perf_counter() - start) / args.steps

    def time_minimal():
        nonlocal base_params, base_opt
        start = time.perf_counter()
        for _ in range(args.steps):
            base_params, base_opt, loss = minimal(base_params, base_opt, tokens)
        jax.block_until_ready(loss)
        return (time.perf_counter() - start) / args.steps

    for _ in range(3):
        time_ours(), time_bare(), time_minimal()
    ours_t, bare_t, base_t = [], [], []
    for _ in range(args.rounds):
        ours_t.append(time_ours())
        bare_t.append(time_bare())
        base_t.append(time_minimal())
    o, g, b = statistics.median(ours_t), statistics.median(bare_t), statistics.median(base_t)
    table = (
        "| step | median step time (ms) |\n|---|---:|\n"
        f"| hand-written minimal jitted step | {b * 1e3:.3f} |\n"
        f"| spmd_train `Engine.train_step`, step guards compiled out | {g * 1e3:.3f} |\n"
        f"| spmd_train `Engine.train_step` (guards on, the default) | {o * 1e3:.3f} |\n"
        f"| **ratio (ours / minimal)** | **{o / b:.3f}** |\n"
        f"| **ratio (guards on / off)** | **{o / g:.3f}** |"
    )
    print(table)
    command = "python benchmarks/overhead.py " + " ".join(sys.argv[1:])
    body = (
        provenance(command.strip())
        + f"- model: {args.model} preset, batch {args.batch} x {args.seq} tokens, one CPU device, fp32; "
        f"{args.rounds} alternating rounds of {args.steps} steps, median\n\n" + table
        + "\n\nTargets: ours / minimal <= 1.05; guards on / off <= 1.02.\n"
    )
    update_section("overhead", "Step overhead vs a minimal jitted step (`benchmarks/overhead.py`)", body)


if __name__ == "__main__":
    main()
