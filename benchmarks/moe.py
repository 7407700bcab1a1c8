"""Mixture of experts: tokens/s against a dense model with the same active parameters, and layer TFLOP/s.

Usage: python benchmarks/moe.py [--rounds 10] [--steps 10] [--gpu-tokens 8192]

1. Side by side on 8 simulated CPU devices (always): the tiny MoE model with the settings of
   configs/moe.yaml (expert 4 x fsdp 2, batch 32 x 64, capacity factor 1.25) against a dense
   model whose MLPs have the MoE layers' active width: d_ff = k x model.moe.d_ff, so each token meets
   as many MLP weights in both (the router's d_model x E weights aside), and every other layer
   identical. moe-tiny has d_ff = 128 = 2 x 64 already, so the baseline is the same config with
   model.moe=null. Timed in alternating rounds (noise hits both alike), median step time,
   one step in flight (two XLA:CPU programs with collectives in flight can deadlock); reported as a
   ratio to the dense model.
2. On a GPU (jax.devices()[0].platform == "gpu"): one Mixtral-sized MoE layer (d_model 4096,
   8 experts of hidden 14336, top-2, bf16) forward + backward on one device, capacity path and
   dropless path, in achieved TFLOP/s of the active work (6 x tokens x k x 3 x d x f for the
   experts; the router and dispatch are overhead), next to one dense SwiGLU matmul chain over
   the same tokens x k rows (the same FLOPs with no routing: the ceiling).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import os
import statistics
import sys
import time
from pathlib import Path


def _choose_platforms() -> None:
    """CPU always (the simulated mesh); CUDA too when its jax plugin is installed. Set before jax starts."""
    if "JAX_PLATFORMS" in os.environ:
        return
    names = {(d.metadata["Name"] or "").lower().replace("_", "-") for d in importlib.metadata.distributions()}
    cuda = any(n.startswith("jax-cuda") for n in names)
    os.environ["JAX_PLATFORMS"] = "cuda,cpu" if cuda else "cpu"


_choose_platforms()
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

from benchmarks.report import provenance, time_call, update_section  # noqa: E402
from spmd_train import Engine, load_config  # noqa: E402
from spmd_train.analysis.moe_report import moe_section  # noqa: E402
from spmd_train.data import make_source  # noqa: E402
from spmd_train.models.flops import flops_per_token, matmul_params  # noqa: E402
from spmd_train.models.moe import MoE  # noqa: E402
from spmd_train.ops.capacity import capacity  # noqa: E402
from spmd_train.parallel import resolve_backends  # noqa: E402

CONFIG = ROOT / "configs" / "moe.yaml"


# --- 1. tokens/s against the dense model, 8 simulated CPU devices -----------------------------------


class Runner:
    """One model's engine, state and a few batches; `time(steps)` returns seconds per step."""

    def __init__(self, overrides: list[str], cpus: list[jax.Device]):
        self.cfg = load_config(CONFIG, ["train.steps=100000", *overrides])
        self.engine = Engine.build(self.cfg, cpus)
        self.state = self.engine.init_state()
        data = make_source(self.cfg)
        self.batches = [data.batch(i, self.engine.batch_sharding) for i in range(4)]
        self.step = self.engine.train_step.lower(self.state, self.batches[0]).compile()

    def time(self, steps: int) -> float:
        start, pending = time.perf_counter(), None
        for i in range(steps):
            self.state, metrics = self.step(self.state, self.batches[i % len(self.batches)])
            if pending is not None:
                jax.block_until_ready(pending)  # at most one step in flight
            pending = metrics
        jax.block_until_ready(pending)
        return (time.perf_counter() - start) / steps


def side_by_side(rounds: int, steps: int) -> str:
    cpus = jax.devices("cpu")
    moe = Runner([], cpus)
    m = moe.cfg.model
    dense_ff = m.moe.experts_per_token * m.resolved_moe_d_ff
    # The MoE model's own dense layers must keep their width in the baseline ("other layers identical").
    assert m.d_ff == dense_ff, f"model.d_ff={m.d_ff} differs from k x model.moe.d_ff={dense_ff}: no such baseline"
    dense = Runner(["model.moe=null", f"model.d_ff={dense_ff}"], cpus)
    for _ in range(2):  # warm-up
        moe.time(steps), dense.time(steps)
    times = {"moe": [], "dense": []}
    for _ in range(rounds):
        times["moe"].append(moe.time(steps))
        times["dense"].append(dense.time(steps))
    t = moe.cfg.train
    tokens = t.global_batch_size * t.seq_len
    section = moe_section(moe.engine)
    moe_name = (f"MoE (configs/moe.yaml: {section['moe_layers']} of {m.num_layers} layers {m.moe.num_experts} experts "
                f"top-{m.moe.experts_per_token}, capacity factor {moe.cfg.backends.capacity_factor})")
    dense_name = f"dense (model.moe=null, d_ff = k x moe.d_ff = {dense_ff})"
    rows = []
    for name, key, runner in ((dense_name, "dense", dense), (moe_name, "moe", moe)):
        step = statistics.median(times[key])
        rows.append((name, runner.engine.num_params, matmul_params(runner.cfg.model),
                     flops_per_token(runner.cfg.model, t.seq_len), step, tokens / step))
    base = rows[0][5]
    lines = ["| model | params | active matmul params / token | model FLOPs / token | median step (ms) "
             "| tokens/s | ratio to dense |", "|---|---:|---:|---:|---:|---:|---:|"]
    for name, params, active, flops, step, tps in rows:
        lines.append(f"| {name} | {params:,} | {active:,} | {flops:,.0f} | {step * 1e3:.1f} | {tps:,.0f} "
                     f"| {tps / base:.2f} |")
    a2a = section["all_to_all"]
    slot_rows = m.moe.num_experts * section["capacity_slots"]
    assignments = m.moe.experts_per_token * section["group_tokens"]
    note = (f"8 simulated CPU devices (mesh expert 4 x fsdp 2 for both; outside MoE layers `expert` is a batch "
            f"axis), batch {t.global_batch_size} x {t.seq_len} tokens, fp32, {rounds} alternating rounds of {steps} "
            f"steps after 2 warm-up rounds, median. The MoE step moves {a2a['count']} all-to-alls over `expert` "
            f"({a2a['bytes_per_device'] / 2**20:.2f} MiB per device per step; capacity "
            f"{section['capacity_slots']} slots per expert per group of {section['group_tokens']} tokens, so "
            f"{slot_rows} slot rows for {assignments} assignments: {slot_rows / assignments:.2f}x the active expert "
            "work is computed).")
    return note + "\n\n" + "\n".join(lines)


# --- 2. one MoE layer on a GPU: achieved TFLOP/s -----------------------------------------------------


def layer_rows(device: jax.Device, tokens: int, d: int = 4096, f: int = 14336, e: int = 8, k: int = 2) -> list[str]:
    """Forward and forward+backward TFLOP/s of one MoE layer (capacity, dropless) and the dense ceiling."""
    base = load_config(None, ["model.moe.every=1", f"model.d_model={d}", "model.num_heads=32", "model.num_kv_heads=8",
                              f"model.moe.num_experts={e}", f"model.moe.experts_per_token={k}", f"model.moe.d_ff={f}",
                              "model.compute_dtype=bfloat16", "model.param_dtype=bfloat16"])
    active = 2 * tokens * k * 3 * d * f  # forward FLOPs of the routed experts
    batch = max(1, tokens // 4096)
    x = jax.device_put(jax.random.normal(jax.random.key(1), (batch, tokens // batch, d), jnp.bfloat16), device)
    rows = []
    for impl in ("capacity", "dropless"):
        choice = dataclasses.replace(base.backends, moe=impl)
        graphdef, state = nnx.split(MoE(base.model, nnx.Rngs(0), resolve_backends(base.model, choice, device.platform)))
        params = jax.device_put(nnx.to_pure_dict(state), device)

        def forward(p, x, graphdef=graphdef, state=state):
            fresh = jax.tree.map(lambda v: v, state)
            nnx.replace_by_pure_dict(fresh, p)
            return nnx.merge(graphdef, fresh)(x)[0]

        fwd = jax.jit(forward)
        grad = jax.jit(jax.grad(lambda p, x: jnp.sum(forward(p, x).astype(jnp.float32)), argnums=(0, 1)))
        t_fwd, t_both = time_call(fwd, params, x), time_call(grad, params, x)
        slots = "" if impl == "dropless" else f" ({e * capacity(k, tokens, choice.capacity_factor, e)} slot rows " \
            f"for {k * tokens} assignments)"
        rows.append(f"| MoE layer, {impl}{slots} | {active / t_fwd / 1e12:.0f} | {3 * active / t_both / 1e12:.0f} |")

    w = [jax.device_put(jax.random.normal(jax.random.key(i), s, jnp.bfloat16) * 0.02, device)
         for i, s in enumerate([(d, f), (d, f), (f, d)])]
    rows_in = jax.device_put(jax.random.normal(jax.random.key(9), (k * tokens, d), jnp.bfloat16), device)

    def swiglu(w, x):
        return (jax.nn.silu(x @ w[0]) * (x @ w[1])) @ w[2]

    t_fwd = time_call(jax.jit(swiglu), w, rows_in)
    t_both = time_call(jax.jit(jax.grad(lambda w, x: jnp.sum(swiglu(w, x).astype(jnp.float32)), argnums=(0, 1))),
                   w, rows_in)
    rows.append(f"| dense SwiGLU over the same {k * tokens} rows (no routing: the ceiling) "
                f"| {active / t_fwd / 1e12:.0f} | {3 * active / t_both / 1e12:.0f} |")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--gpu-tokens", type=int, default=8192)
    args = parser.parse_args()
    command = "python benchmarks/moe.py " + " ".join(sys.argv[1:])
    body = side_by_side(args.rounds, args.steps)
    print(body)
    device = jax.devices()[0]
    if device.platform == "gpu":
        rows = layer_rows(device, args.gpu_tokens)
        gpu = (f"One MoE layer on one {device.device_kind}: {args.gpu_tokens} tokens, d_model 4096, 8 experts of "
               "hidden 14336, top-2, bf16, no expert axis (no all-to-all). TFLOP/s of the active expert work "
               "(forward 2 x tokens x k x 3 x d x f; forward + backward 3x that).\n\n"
               "| path | forward TFLOP/s | forward + backward TFLOP/s |\n|---|---:|---:|\n" + "\n".join(rows))
    else:
        gpu = (f"MoE layer TFLOP/s: not measured ({device.platform}: the script measures it when "
               "jax.devices()[0].platform == 'gpu').")
    print(gpu)
    update_section("moe", "Mixture of experts vs dense at equal active parameters (`benchmarks/moe.py`)",
                   provenance(command.strip()) + "\n" + body + "\n\n" + gpu + "\n")


if __name__ == "__main__":
    main()
