"""Generation with a KV cache: equal to recomputing the whole sequence, per row whatever the batch, seeded
sampling, the CLI's bad input, and a model trained on a Markov chain generating that chain."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from spmd_train import Engine, Trainer, load_config
from spmd_train.cli.main import main
from spmd_train.errors import ConfigError
from spmd_train.models.transformer import Transformer
from spmd_train.sharding.constrain import use_layout
from spmd_train.train.generation import check_request, generate, generation_backends
from tests.runs import FP32, optimized_compiles, token_files
from tests.tiers import fast_cases

PROMPTS = [[5, 17, 3], [200, 1, 2, 3, 4, 9, 77], [42], [8, 8, 8, 8, 8]]
NEW = 6


def _engine(devices, preset: str, *overrides: str) -> Engine:
    cfg = load_config(None, [f"model.preset={preset}", "train.global_batch_size=8", "train.seq_len=16", *FP32,
                             *overrides])
    return Engine.build(cfg, list(devices))


def _params(engine: Engine, seed: int = 0):
    """Random parameters, N(0, 0.02^2) and norm scales of 1, drawn by numpy: jax's initialisers compile for seconds
    (10 s for moe-tiny's), which is not what these tests are about."""
    rng = np.random.default_rng(seed)

    def draw(path, shape):
        if getattr(path[-1], "key", None) == "scale":
            return np.ones(shape.shape, shape.dtype)
        return (0.02 * rng.standard_normal(shape.shape)).astype(shape.dtype)

    values = jax.tree_util.tree_map_with_path(draw, engine.param_shapes)
    return jax.device_put(values, engine.state_shardings.params)


def _recomputed(engine: Engine, params, prompts: list[list[int]], new: int) -> list[list[int]]:
    """Greedy tokens without a cache: argmax of the full forward pass (`Transformer.__call__`) over each sequence so
    far, under the engine's layout, one pass per new token. The sequences sit left-aligned in a fixed buffer (one
    compile); the causal mask keeps the slots after each out of the logits read (and rows never meet)."""
    m = engine.cfg.model
    backends = engine.backends if m.moe is None else generation_backends(engine.backends, m.moe.num_experts,
                                                                         m.moe.experts_per_token)
    graphdef = nnx.split(nnx.eval_shape(lambda: Transformer(m, rngs=nnx.Rngs(0), backends=backends)))[0]

    @jax.jit
    def argmax(params, tokens):
        with use_layout(engine.layout):
            return jnp.argmax(nnx.merge(graphdef, params)(tokens), axis=-1)

    lengths = np.array([len(p) for p in prompts])
    buf = np.zeros((len(prompts), -(-(lengths.max() + new) // 8) * 8), np.int32)
    for row, prompt in zip(buf, prompts, strict=True):
        row[: len(prompt)] = prompt
    rows = np.arange(len(prompts))
    for t in range(new):
        buf[rows, lengths + t] = np.asarray(argmax(params, buf))[rows, lengths + t - 1]
    return [buf[i, lengths[i]: lengths[i] + new].tolist() for i in rows]


@pytest.mark.parametrize(("mesh", "preset"), fast_cases(
    [(mesh, preset) for mesh in ("one", "fsdp2_tensor4") for preset in ("tiny", "moe-tiny")],
    fast=["fsdp2_tensor4-moe-tiny"], ids="-".join, several=True))
def test_greedy_with_cache_equals_recomputation_for_every_row_of_a_ragged_batch(devices, preset, mesh):
    devs, overrides = (devices[:1], []) if mesh == "one" else (devices, ["mesh.fsdp=2", "mesh.tensor=4"])
    engine = _engine(devs, preset, *overrides)
    params = _params(engine)
    result = generate(engine, params, PROMPTS, max_new_tokens=NEW)
    assert [len(t) for t in result.tokens] == [NEW] * len(PROMPTS)
    assert result.tokens == _recomputed(engine, params, PROMPTS, NEW)
    if preset == "tiny" and mesh != "one":
        # The literal claim: a row of the batch gets the tokens its prompt gets alone.
        alone = generate(engine, params, [PROMPTS[1]], max_new_tokens=NEW)
        assert alone.tokens[0] == result.tokens[1]
        # And the second call of the same shapes compiles nothing.
        again = generate(engine, params, PROMPTS, max_new_tokens=NEW)
        assert again.tokens == result.tokens and again.compile_s == 0.0


@pytest.fixture(scope="module")
def tiny(devices):
    engine = _engine(devices[:1], "tiny")
    return engine, _params(engine)


@pytest.mark.slow
def test_sampling_is_seeded_and_top_k_1_is_greedy(tiny):
    engine, params = tiny
    greedy = generate(engine, params, PROMPTS, max_new_tokens=NEW).tokens
    kw = {"max_new_tokens": NEW, "temperature": 1.0}
    first = generate(engine, params, PROMPTS, seed=1, **kw).tokens
    assert generate(engine, params, PROMPTS, seed=1, **kw).tokens == first
    assert generate(engine, params, PROMPTS, seed=2, **kw).tokens != first
    assert first != greedy  # an untrained model is near uniform: sampling strays from the argmax at once
    assert generate(engine, params, PROMPTS, seed=3, top_k=1, **kw).tokens == greedy
    assert generate(engine, params, PROMPTS, seed=3, top_p=1e-6, **kw).tokens == greedy
    # top_k=5: every sampled token is among the five most likely after its prefix.
    sampled = generate(engine, params, PROMPTS, seed=4, top_k=5, top_p=0.9, **kw).tokens
    forward = jax.jit(lambda params, tokens: nnx.merge(engine.graphdef, params)(tokens))
    for prompt, new in zip(PROMPTS, sampled, strict=True):
        logits = np.asarray(forward(params, jnp.asarray([prompt + new])))[0]
        for t, token in enumerate(new):
            assert token in np.argsort(logits[len(prompt) + t - 1])[-5:]


# -- a model trained on a Markov chain ------------------------------------------------------------------

VOCAB = 32
MARKOV = ["model.preset=tiny", f"model.vocab_size={VOCAB}", "train.global_batch_size=32", "train.seq_len=64",
          "train.steps=150", "optim.lr=3e-3", "optim.warmup_steps=10", "checkpoint.every=0",
          "checkpoint.async_save=false", "run.log_every=1000"]


@pytest.fixture(scope="module")
def markov_run(devices, tmp_path_factory):
    """A tiny model trained on an order-1 Markov chain over 32 tokens (run dir with its final checkpoint)."""
    run_dir = tmp_path_factory.mktemp("markov")
    trainer = Trainer(load_config(None, [*MARKOV, f"run.dir={run_dir}"]), devices[:1])
    trainer.init()
    untrained = jax.tree.map(jnp.copy, trainer.state.params)  # the train step donates the state
    with optimized_compiles():  # 150 steps: faster than at -O0, its compile included
        trainer.run()
    yield trainer, untrained, run_dir
    trainer.close()


@pytest.fixture(scope="module")
def short_run(devices, tmp_path_factory):
    """The Markov run's setup trained 3 steps (run dir with its final checkpoint): what the CLI tests read."""
    run_dir = tmp_path_factory.mktemp("short")
    trainer = Trainer(load_config(None, [*MARKOV, "train.steps=3", f"run.dir={run_dir}"]), devices[:1])
    trainer.run()
    yield trainer, run_dir
    trainer.close()


def _transition_tv(sequences: np.ndarray, transitions: np.ndarray) -> float:
    """Total-variation distance between the empirical next-token distribution of each state and the chain's row,
    averaged over states weighted by how often the sequences leave them."""
    v = transitions.shape[0]
    counts = np.zeros((v, v))
    np.add.at(counts, (sequences[:, :-1].reshape(-1), sequences[:, 1:].reshape(-1)), 1)
    visits = counts.sum(1)
    seen = visits > 0
    empirical = counts[seen] / visits[seen, None]
    tv = 0.5 * np.abs(empirical - transitions[seen]).sum(1)
    return float((tv * visits[seen]).sum() / visits.sum())


@pytest.mark.slow
def test_trained_on_a_markov_chain_it_generates_that_chain(markov_run):
    """Statistic: the visit-weighted mean total-variation distance between each state's empirical next-token
    frequencies in 64 generated sequences of 64 tokens (temperature 1) and the chain's transition row.

    Sampling noise alone puts even the chain itself, sampled as often from the same first tokens, at 0.08-0.10
    from its own rows (~130 transitions per state, 32 next tokens). Measured over 6 seeds after these 150 steps
    (train loss at the chain's entropy rate to 1e-4 nats): trained 0.10-0.11, each within 0.03 of that seed's
    noise; the bound is noise + 0.05. An untrained model is near uniform while the chain's rows are peaky
    (Dirichlet(0.1)): 0.76, asserted above 0.6."""
    trainer, untrained, _ = markov_run
    chain = trainer.data
    rng = np.random.default_rng(0)
    starts = rng.choice(VOCAB, size=64, p=chain.stationary)
    prompts = [[int(s)] for s in starts]
    with optimized_compiles():
        made = trainer.generate(prompts, max_new_tokens=64, temperature=1.0, seed=0)
    generated = np.concatenate([starts[:, None], np.asarray(made.tokens)], axis=1)
    assert generated.max() < VOCAB
    # The chain itself, sampled from the same first tokens: the sampling noise of the statistic.
    truth = np.empty_like(generated)
    truth[:, 0] = starts
    for t in range(1, truth.shape[1]):
        truth[:, t] = (chain._cdf[truth[:, t - 1]] < rng.random((len(starts), 1))).sum(1)
    noise = _transition_tv(truth, chain.transitions)
    trained = _transition_tv(generated, chain.transitions)
    with optimized_compiles():
        before = generate(trainer.engine, untrained, prompts, max_new_tokens=64, temperature=1.0, seed=0).tokens
    untrained_tv = _transition_tv(np.concatenate([starts[:, None], np.asarray(before)], axis=1), chain.transitions)
    print(f"TV: chain's own sampling noise {noise:.3f}, trained {trained:.3f}, untrained {untrained_tv:.3f}")
    assert trained < noise + 0.05
    assert untrained_tv > 0.6


# -- the CLI ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("args, needles", [
    (["--prompt-ids", "1,2", "--max-new-tokens", "0"], ["max_new_tokens=0", "integer >= 1"]),
    (["--prompt-ids", "1,2", "--temperature", "-1"], ["temperature=-1.0", "number >= 0"]),
    (["--prompt-ids", "1,2", "--temperature", "1", "--top-p", "0"], ["top_p=0.0", "(0, 1]"]),
    (["--prompt-ids", "1,2", "--temperature", "1", "--top-p", "1.5"], ["top_p=1.5", "(0, 1]"]),
    (["--prompt-ids", "1,32"], ["token id 32", "0 to 31", "model.vocab_size=32"]),
    (["--prompt-ids", "1,x"], ["--prompt-ids '1,x'", "comma-separated integer"]),
    (["--prompt-ids", ""], ["--prompt-ids '' is empty"]),
    (["--prompt", "hello"], ["no tokenizer", "data.source=markov", "--prompt-ids"]),
])
def test_cli_bad_input_exits_2_with_a_message(short_run, capsys, args, needles):
    _, run_dir = short_run
    assert main(["generate", str(run_dir), *args]) == 2
    err = capsys.readouterr().err
    assert all(n in err for n in needles), err
    assert "Traceback" not in err


def test_cli_refuses_a_directory_without_a_run(tmp_path, capsys):
    assert main(["generate", str(tmp_path / "nothing"), "--prompt-ids", "1"]) == 2
    assert "is not a directory" in capsys.readouterr().err
    (tmp_path / "config.json").write_text("{}")
    assert main(["generate", str(tmp_path), "--prompt-ids", "1"]) == 2
    assert "has no checkpoint" in capsys.readouterr().err


def test_cli_generates_from_the_latest_checkpoint(short_run, capsys):
    trainer, run_dir = short_run
    # All 8 devices (fsdp 8): the checkpoint of a 1-device run is resharded; greedy tokens as the Trainer's.
    assert main(["generate", str(run_dir), "--prompt-ids", "1,2,3", "--prompt-ids", "7", "--max-new-tokens", "5",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["prompts"] == [[1, 2, 3], [7]]
    assert out["tokens"] == trainer.generate([[1, 2, 3], [7]], max_new_tokens=5).tokens
    assert out["tokens_per_s"] > 0


def test_a_pipelined_mesh_is_refused_with_the_way_out(devices):
    engine = _engine(devices, "tiny", "mesh.pipeline=2", "mesh.fsdp=4")
    with pytest.raises(ConfigError, match=r"mesh.pipeline=2 \(valid: mesh.pipeline=1"):
        generate(engine, _params(engine), [[1, 2]], max_new_tokens=2)


def test_bad_requests_name_the_value():
    for kw, needle in [({"max_new_tokens": 0}, "max_new_tokens=0"), ({"temperature": float("nan")}, "temperature=nan"),
                       ({"top_k": 0}, "top_k=0"), ({"top_p": 0.0}, "top_p=0.0")]:
        with pytest.raises(ConfigError, match=needle):
            check_request([[1]], 32, **{"max_new_tokens": 1, "temperature": 1.0, "top_k": None, "top_p": None, **kw})
    with pytest.raises(ConfigError, match="prompt 1 is"):
        check_request([[1], []], 32, max_new_tokens=1, temperature=0.0, top_k=None, top_p=None)


def test_the_runs_tokenizer_comes_from_its_data(corpus):
    """Text runs are bytes; token files carry prepare-data's tokenizer in their sidecar; Markov runs have none."""
    from spmd_train.cli.generate import run_tokenizer

    tokens = run_tokenizer(load_config(None, token_files(corpus)))
    assert tokens.name == "byte" and tokens.encode("hé") == [104, 195, 169] and tokens.decode([104, 195, 169]) == "hé"
    text = run_tokenizer(load_config(None, ["data.source=text", f"data.paths=[{corpus}]"]))
    assert text.decode(text.encode("a\nb")) == "a\nb"
    assert run_tokenizer(load_config(None, [])) is None
