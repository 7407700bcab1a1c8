"""`generate`: new tokens for a batch of prompts from an engine's parameters, under the engine's mesh and layout.

Two programs, each compiled once per (rows, padded prompt length, max_new_tokens, greedy or sampled, number of
stop ids): the prefill and the decode loop (`models.decode`), which ends when every row has made a stop id. The
token length is never split, MoE layers drop nothing, and with mesh.pipeline > 1 `generate` refuses.

Details: docs/generate.md#how-it-works
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from spmd_train.errors import ConfigError
from spmd_train.models import decode
from spmd_train.models.transformer import Transformer
from spmd_train.parallel import Backends
from spmd_train.sharding.constrain import use_layout
from spmd_train.sharding.layout import Layout
from spmd_train.train.engine import Engine

Finish = Literal["stop id", "length"]
"""How a row of `generate` ended: at one of the stop ids (its last token), or after max_new_tokens."""


@dataclass(frozen=True)
class GenerateResult:
    """The new tokens of each prompt (prompt tokens not included; a row that stopped ends with its stop id), how each
    row ended, and how long making them took."""

    tokens: list[list[int]]
    prefill_s: float
    """Seconds of the prefill (the prompts' forward pass and the first new token), compiled beforehand."""
    decode_s: float
    """Seconds of the decode loop (every new token after the first)."""
    compile_s: float
    """Seconds spent compiling both programs in this call (0 when they were compiled by an earlier call)."""
    finish: list[Finish] = dataclasses.field(default_factory=list)
    """Per row: "stop id" (its last token is a stop id) or "length" (it made max_new_tokens)."""
    steps_run: int = 0
    """New tokens the decode loop made per row, the first included: below max_new_tokens when every row stopped
    early (the loop ended there, on the device)."""

    @property
    def decode_tokens_per_s(self) -> float | None:
        """New tokens per second of the decode loop, summed over the prompts (None when it made none)."""
        made = sum(len(t) - 1 for t in self.tokens)
        return made / self.decode_s if made and self.decode_s > 0 else None

    @property
    def tokens_per_s(self) -> float:
        """All new tokens per second of prefill and decode together."""
        return sum(map(len, self.tokens)) / max(self.prefill_s + self.decode_s, 1e-9)


def check_request(prompts: Any, vocab_size: int, *, max_new_tokens: Any, temperature: Any, top_k: Any,
                  top_p: Any, stop_ids: Any = ()) -> None:
    """Refuse (ConfigError naming the value and what is valid) a request `generate` cannot serve."""
    if isinstance(stop_ids, (str, bytes)) or not hasattr(stop_ids, "__iter__"):
        raise ConfigError(f"stop_ids={stop_ids!r} (valid: a list of token ids)")
    for t in stop_ids:
        if not isinstance(t, (int, np.integer)) or isinstance(t, bool) or not 0 <= t < vocab_size:
            raise ConfigError(f"stop id {t!r} (valid: integers from 0 to {vocab_size - 1}, "
                              f"model.vocab_size={vocab_size})")
    if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 1:
        raise ConfigError(f"max_new_tokens={max_new_tokens!r} (valid: an integer >= 1)")
    if not isinstance(temperature, (int, float)) or not math.isfinite(temperature) or temperature < 0:
        raise ConfigError(f"temperature={temperature!r} (valid: a number >= 0; 0 is greedy)")
    if top_k is not None and (not isinstance(top_k, int) or isinstance(top_k, bool) or not 1 <= top_k <= vocab_size):
        raise ConfigError(f"top_k={top_k!r} (valid: an integer from 1 to the vocabulary size {vocab_size}, or none)")
    if top_p is not None and (not isinstance(top_p, (int, float)) or not 0 < top_p <= 1):
        raise ConfigError(f"top_p={top_p!r} (valid: a number in (0, 1], or none)")
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise ConfigError(f"prompts={prompts!r} (valid: a non-empty list of prompts, each a non-empty list of "
                          "token ids)")
    for i, prompt in enumerate(prompts):
        if isinstance(prompt, (str, bytes)) or not hasattr(prompt, "__len__") or len(prompt) == 0:
            raise ConfigError(f"prompt {i} is {prompt!r} (valid: a non-empty list of token ids)")
        bad = [t for t in prompt if not isinstance(t, (int, np.integer)) or isinstance(t, bool)
               or not 0 <= t < vocab_size]
        if bad:
            raise ConfigError(f"prompt {i} holds token id {bad[0]!r} (valid: integers from 0 to {vocab_size - 1}, "
                              f"model.vocab_size={vocab_size})")


def check_engine(engine: Engine) -> None:
    """Refuse an engine `generate` cannot run on: one with pipeline stages (generation uses no schedule)."""
    if engine.mesh.shape["pipeline"] > 1:
        raise ConfigError(f"generate runs without the pipeline schedule, but mesh.pipeline="
                          f"{engine.mesh.shape['pipeline']} (valid: mesh.pipeline=1; a pipelined run's checkpoint "
                          "restores onto such a mesh, e.g. `spmd-train generate RUN_DIR mesh.pipeline=1`)")


def generate(engine: Engine, params: Any, prompts: list[list[int]], *, max_new_tokens: int,
             temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None,
             seed: int = 0, stop_ids: Sequence[int] = ()) -> GenerateResult:
    """Up to `max_new_tokens` new tokens for each prompt (a list of token ids) from `params` (stored as the engine
    stores them), greedy at temperature 0, else sampled (top_k, top_p, seeded: the same call gives the same tokens).

    A row ends at its first token among `stop_ids` (kept as its last token, as Hugging Face's `generate` keeps the
    end-of-sequence id); the loop ends when every row has. Each prompt's tokens are those it gets alone (greedy; up
    to floating-point ties), whatever the other prompts.
    """
    cfg = engine.cfg
    vocab = cfg.model.vocab_size
    check_request(prompts, vocab, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                  stop_ids=stop_ids)
    check_engine(engine)
    greedy = temperature == 0
    # Rows: a multiple of the devices the batch is split over (dummy rows repeat the first prompt).
    ways = math.prod(engine.mesh.shape[a] for a in engine.layout.batch_axes)
    rows = -(-len(prompts) // ways) * ways
    length = max(map(len, prompts))
    tokens = np.zeros((rows, length), np.int32)
    pads = np.zeros((rows,), np.int32)
    for i in range(rows):
        prompt = prompts[i] if i < len(prompts) else prompts[0]
        pads[i] = length - len(prompt)
        tokens[i, pads[i]:] = prompt
    stops = np.asarray([int(t) for t in dict.fromkeys(stop_ids)], np.int32)
    programs = _programs(engine, rows, length, max_new_tokens, greedy, len(stops))
    compile_s = programs.pop("compile_s")
    key = jax.random.key(seed)
    scalars = (jnp.float32(1.0 if greedy else temperature), jnp.int32(top_k or vocab),
               jnp.float32(1.0 if top_p is None else top_p))
    tokens = jax.device_put(tokens, programs["token_sharding"])
    pads = jax.device_put(pads, programs["row_sharding"])
    # A no-op when laid out; offload.params's host-resident layers come to the device, where decoding reads them.
    params = jax.device_put(engine.model_params(params), engine.device_param_shardings)
    start = time.perf_counter()
    cache, first = programs["prefill"](params, tokens, pads, key, *scalars)
    first.block_until_ready()
    prefill_s = time.perf_counter() - start
    start = time.perf_counter()
    stops = jax.device_put(stops, NamedSharding(engine.mesh, P()))
    made, cache = programs["decode"](params, cache, first, pads, key, *scalars, stops)
    made = jax.device_get(made)
    del cache
    decode_s = time.perf_counter() - start
    n = len(prompts)
    tokens = [made.tokens[i, : made.lengths[i]].tolist() for i in range(n)]
    finish: list[Finish] = ["stop id" if made.stopped[i] else "length" for i in range(n)]
    return GenerateResult(tokens, prefill_s, decode_s, compile_s, finish, int(made.steps_run))


def generation_backends(backends: Backends, moe_experts: int, experts_per_token: int) -> Backends:
    """The run's backends with MoE capacity that drops nothing: every token of a group fits in one expert's slots."""
    if backends.moe == "dropless" or not moe_experts:
        return backends
    # capacity_dedup: rows per device = reached x tokens x factor / ways >= tokens too, as reached <= k.
    return dataclasses.replace(backends, capacity_factor=moe_experts / experts_per_token)


def generation_layout(layout: Layout) -> Layout:
    """The run's layout with tokens' length unsplit (a decode step holds one token per row)."""
    return dataclasses.replace(layout, activations={**layout.activations, "length": (), "norm_length": ()})


def _programs(engine: Engine, rows: int, length: int, max_new: int, greedy: bool, num_stops: int) -> dict[str, Any]:
    """The compiled prefill and decode programs for this shape, built once per engine and shape."""
    cache = vars(engine).setdefault("_generate_programs", {})  # Engine is frozen; its __dict__ is not
    key = (rows, length, max_new, greedy, num_stops)
    if key in cache:
        return {**cache[key], "compile_s": 0.0}
    cfg, mesh = engine.cfg.model, engine.mesh
    moe = cfg.moe
    backends = engine.backends if moe is None else generation_backends(engine.backends, moe.num_experts,
                                                                       moe.experts_per_token)
    graphdef = nnx.split(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0), backends=backends)))[0]
    layout = generation_layout(engine.layout)
    max_len = length + max_new
    replicated = NamedSharding(mesh, P())
    token_sh = NamedSharding(mesh, layout.activation_spec(P("batch", None)))
    row_sh = NamedSharding(mesh, layout.activation_spec(P("batch")))
    cache_sh = NamedSharding(mesh, layout.activation_spec(P(*decode.cache_axes(cfg))))
    param_sh = engine.device_param_shardings

    def prefill(params, tokens, pads, key, temperature, top_k, top_p):
        with use_layout(layout):
            model = nnx.merge(graphdef, params)
            return decode.prefill(model, tokens, pads, max_len, key, decode.Sampling(greedy, temperature, top_k, top_p))

    def run_decode(params, cache, first, pads, key, temperature, top_k, top_p, stop_ids):
        with use_layout(layout):
            model = nnx.merge(graphdef, params)
            return decode.decode(model, cache, first, pads, length, max_new, key,
                                 decode.Sampling(greedy, temperature, top_k, top_p), stop_ids)

    start = time.perf_counter()
    key_arg = jax.ShapeDtypeStruct((), jax.random.key(0).dtype, sharding=replicated)
    scalar = jax.ShapeDtypeStruct((), jnp.float32, sharding=replicated)
    count = jax.ShapeDtypeStruct((), jnp.int32, sharding=replicated)
    abstract_params = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                                   engine.param_shapes, param_sh)
    tokens = jax.ShapeDtypeStruct((rows, length), jnp.int32, sharding=token_sh)
    pads = jax.ShapeDtypeStruct((rows,), jnp.int32, sharding=row_sh)
    cache_sh_tree = decode.Cache(cache_sh, cache_sh, cache_sh, cache_sh)
    prefill_c = jax.jit(prefill, out_shardings=(cache_sh_tree, row_sh)).lower(
        abstract_params, tokens, pads, key_arg, scalar, count, scalar).compile()
    kv = decode.Cache(*(jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=cache_sh)
                        for s in decode.cache_shapes(cfg, rows, max_len)))
    first = jax.ShapeDtypeStruct((rows,), jnp.int32, sharding=row_sh)
    # The cache is donated: the loop writes it in place (one copy of it, not two, at the peak).
    stop_ids = jax.ShapeDtypeStruct((num_stops,), jnp.int32, sharding=replicated)
    made_sh = decode.Decoded(replicated, replicated, replicated, replicated)
    decode_c = jax.jit(run_decode, out_shardings=(made_sh, cache_sh_tree), donate_argnums=1).lower(
        abstract_params, kv, first, pads, key_arg, scalar, count, scalar, stop_ids).compile()
    cache[key] = {"prefill": prefill_c, "decode": decode_c, "token_sharding": token_sh, "row_sharding": row_sh}
    return {**cache[key], "compile_s": time.perf_counter() - start}
