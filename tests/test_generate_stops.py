"""Where generation stops: each row of a ragged batch at its own first stop id (its tokens those it makes without
stops, cut there), the decode loop ending on the device when every row has stopped, the run's end-of-text ids
as the CLI's default (Hugging Face generation_config.json, token-file sidecars), stop strings, and refusals."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from spmd_train import Trainer, load_config
from spmd_train.errors import ConfigError
from spmd_train.train.generation import check_request, generate
from spmd_train.train.stops import cut_at_stop_strings, finish_rows, hf_end_ids, run_end_ids
from tests.runs import ROOT, main_in_process, token_files
from tests.test_generate import PROMPTS, _engine, _params, _recomputed
from tests.tiers import fast_cases

NEW = 10


def _cut(row: list[int], stops: set[int]) -> list[int]:
    """`row` up to and including its first token in `stops` (all of it when there is none)."""
    at = next((i for i, t in enumerate(row) if t in stops), len(row) - 1)
    return row[: at + 1]


@pytest.mark.parametrize(("mesh", "preset"), fast_cases(
    [(mesh, preset) for mesh in ("one", "fsdp2_tensor4") for preset in ("tiny", "moe-tiny")],
    fast=["one-tiny"], ids="-".join, several=True))
def test_each_row_of_a_ragged_batch_stops_at_its_own_first_stop_id(devices, mesh, preset):
    devs, overrides = (devices[:1], []) if mesh == "one" else (devices, ["mesh.fsdp=2", "mesh.tensor=4"])
    engine = _engine(devs, preset, *overrides)
    params = _params(engine, seed=3)
    free = generate(engine, params, PROMPTS, max_new_tokens=NEW)
    assert free.finish == ["length"] * len(PROMPTS) and free.steps_run == NEW
    assert free.tokens == _recomputed(engine, params, PROMPTS, NEW)  # so the cut rows below are recomputation's too
    # Stop ids met by rows 0 and 1 at different steps (3rd and 6th token, or earlier where the token repeats); an
    # id no row makes changes nothing.
    stops = {free.tokens[0][2], free.tokens[1][5]}
    other = next(t for t in range(engine.cfg.model.vocab_size) if all(t not in row for row in free.tokens))
    stopped = generate(engine, params, PROMPTS, max_new_tokens=NEW, stop_ids=[other, *stops])
    want = [_cut(row, stops) for row in free.tokens]
    assert stopped.tokens == want
    assert stopped.finish == ["stop id" if stops & set(row) else "length" for row in free.tokens]
    assert len({len(row) for row, how in zip(want, stopped.finish, strict=True) if how == "stop id"}) >= 2
    # Other ids of the same count run the same program (the ids are a value).
    again = generate(engine, params, PROMPTS, max_new_tokens=NEW, stop_ids=[*stops, other])
    assert again.tokens == want and again.compile_s == 0.0


def test_the_loop_ends_on_the_device_when_every_row_has_stopped(tiny):
    engine, params = tiny
    free = generate(engine, params, PROMPTS, max_new_tokens=NEW).tokens
    # Every row's third token is a stop id: each row ends by its third token, so the loop by its third step.
    stops = sorted({row[2] for row in free})
    out = generate(engine, params, PROMPTS, max_new_tokens=NEW, stop_ids=stops)
    want = [_cut(row, set(stops)) for row in free]
    assert out.tokens == want and out.finish == ["stop id"] * len(PROMPTS)
    assert out.steps_run == max(map(len, want)) <= 3 < NEW
    # A stop at the first token (made by the prefill) ends it before any decode step.
    firsts = sorted({row[0] for row in free})
    out = generate(engine, params, PROMPTS, max_new_tokens=NEW, stop_ids=firsts)
    assert out.tokens == [row[:1] for row in free] and out.steps_run == 1
    assert out.decode_tokens_per_s is None


@pytest.fixture(scope="module")
def tiny(devices):
    engine = _engine(devices[:1], "tiny")
    return engine, _params(engine, seed=3)


def test_stop_ids_are_checked_against_the_vocabulary():
    base = {"max_new_tokens": 1, "temperature": 0.0, "top_k": None, "top_p": None}
    for ids, needle in [([32], r"stop id 32 \(valid: integers from 0 to 31, model.vocab_size=32\)"),
                        ([-1], "stop id -1"), ([1.5], "stop id 1.5"), ([True], "stop id True"),
                        (5, "stop_ids=5")]:
        with pytest.raises(ConfigError, match=needle):
            check_request([[1]], 32, stop_ids=ids, **base)
    check_request([[1]], 32, stop_ids=[0, 31, np.int32(7)], **base)


# -- the defaults: a run's end-of-text ids ----------------------------------------------------------------

def test_a_hugging_face_checkpoints_end_ids_come_from_generation_config_then_config(tmp_path):
    shutil.copy(ROOT / "tests" / "hf_reference" / "llama" / "config.json", tmp_path)  # eos_token_id 2
    assert hf_end_ids(tmp_path) == (2,)
    (tmp_path / "generation_config.json").write_text(json.dumps({"bos_token_id": 1}))
    assert hf_end_ids(tmp_path) == (2,)  # no eos_token_id there: config.json's
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 9, 7]}))
    assert hf_end_ids(tmp_path) == (7, 9)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 5}))
    assert hf_end_ids(tmp_path) == (5,)
    cfg = load_config(None, [f"checkpoint.load_from=hf:{tmp_path}"])
    assert run_end_ids(cfg) == ((5,), f"eos_token_id of {tmp_path}'s generation_config.json or config.json")
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": "</s>"}))
    with pytest.raises(ConfigError, match="eos_token_id='</s>'"):
        hf_end_ids(tmp_path)
    assert hf_end_ids(tmp_path / "nothing") == ()


def test_token_files_end_at_their_sidecars_eot_id_and_bytes_at_none(corpus):
    assert run_end_ids(load_config(None, token_files(corpus)))[0] == (256,)  # prepare-data's byte end-of-text
    assert run_end_ids(load_config(None, [*token_files(corpus), "data.eot_id=10"])) == ((10,), "data.eot_id")
    assert run_end_ids(load_config(None, ["data.source=text", f"data.paths=[{corpus}]"])) == ((), None)
    assert run_end_ids(load_config(None, [])) == ((), None)  # Markov


# -- stop strings -----------------------------------------------------------------------------------------

def _bytes(ids: list[int]) -> str:
    return bytes(ids).decode("utf-8", errors="replace")


def test_stop_strings_cut_the_text_and_the_tokens():
    ids = list(b"one. two\n\nthree")
    assert cut_at_stop_strings(ids, _bytes, ["\n\n", "."]) == (list(b"one"), "one", True)
    assert cut_at_stop_strings(ids, _bytes, ["\n\n"]) == (list(b"one. two"), "one. two", True)
    assert cut_at_stop_strings(ids, _bytes, ["four"]) == (ids, "one. two\n\nthree", False)
    assert cut_at_stop_strings(ids, _bytes, ["one"]) == ([], "", True)
    # A token holding the kept text's end and the stop string's start stays (word tokens here).
    words = ["a", "b.\n", "c"]
    assert cut_at_stop_strings([0, 1, 2], lambda t: "".join(words[i] for i in t), ["\n"]) == ([0, 1], "ab.", True)
    # A row's text leaves its stop id (256) out; a stop string before it ends the row there instead.
    rows = [[*b"ab", 256], [*b"a;b", 256], list(b"a;b")]
    assert finish_rows(rows, ["stop id", "stop id", "length"], _bytes, [";"]) == (
        [rows[0], list(b"a"), list(b"a")], ["ab", "a", "a"], ["stop id", "stop string", "stop string"])
    assert finish_rows(rows, ["stop id"] * 3, None, []) == (rows, None, ["stop id"] * 3)


# -- the CLI ------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def byte_run(devices, tmp_path_factory, corpus):
    """A tiny model trained 2 steps on prepare-data's byte tokens (end-of-text 256): a run with a tokenizer and a
    default stop id."""
    run_dir = tmp_path_factory.mktemp("bytes")
    trainer = Trainer(load_config(None, ["model.preset=tiny", *token_files(corpus), "train.global_batch_size=8",
                                         "train.seq_len=32", "train.steps=2", "checkpoint.every=0",
                                         "checkpoint.async_save=false", "run.log_every=1000",
                                         f"run.dir={run_dir}"]), devices[:1])
    trainer.run()
    yield trainer, run_dir
    trainer.close()


def test_cli_stops_at_the_runs_end_id_and_at_stop_strings(byte_run, capsys):
    trainer, run_dir = byte_run
    prompts = [list(b"ab"), list(b"xyz q")]
    free = trainer.generate(prompts, max_new_tokens=12).tokens
    code, out, err = main_in_process("generate", str(run_dir), "--prompt", "ab", "--prompt", "xyz q", "--no-stop",
                                     "--max-new-tokens", "12", "--json", capsys=capsys)
    assert code == 0, err
    got = json.loads(out)
    assert got["tokens"] == free and got["finish"] == ["length", "length"] and got["stop_ids"] == []
    # The default: the sidecar's end-of-text id 256 (untrained, the model may not make it: the tokens say so).
    code, out, err = main_in_process("generate", str(run_dir), "--prompt", "ab", "--prompt", "xyz q",
                                     "--max-new-tokens", "12", "--json", capsys=capsys)
    got = json.loads(out)
    assert code == 0 and got["stop_ids"] == [256] and got["tokens"] == [_cut(r, {256}) for r in free]
    # --stop-id replaces it; the printed text leaves the stop id out (the --json tokens keep it, as above).
    stop = free[0][3]
    code, out, err = main_in_process("generate", str(run_dir), "--prompt", "ab", "--stop-id", str(stop),
                                     "--max-new-tokens", "12", capsys=capsys)
    assert code == 0, err
    assert out.startswith(_bytes(_cut(free[0], {stop})[:-1]) + "\n[") and "ended 1 at stop id;" in out
    # A stop string: the text before its first occurrence, the fewest tokens that make that text.
    text = _bytes(free[1])
    needle = text[4:6]
    code, out, err = main_in_process("generate", str(run_dir), "--prompt", "xyz q", "--no-stop", "--stop", needle,
                                     "--stop", "\x00never", "--max-new-tokens", "12", "--json", capsys=capsys)
    assert code == 0, err
    got = json.loads(out)
    kept = text[: text.index(needle)]
    fewest = next(k for k in range(len(free[1]) + 1) if _bytes(free[1][:k]).startswith(kept))
    assert got["text"] == [kept] and got["finish"] == ["stop string"] and got["tokens"] == [free[1][:fewest]]
    assert fewest < len(free[1])


@pytest.mark.parametrize("args, needles", [
    (["--prompt-ids", "1,2", "--stop", "x"], ["--stop:", "no tokenizer", "data.source=markov", "--stop-id"]),
    (["--prompt-ids", "1,2", "--stop-id", "32"], ["stop id 32", "0 to 31", "model.vocab_size=32"]),
    (["--prompt-ids", "1,2", "--stop-id", "x"], ["--stop-id", "invalid int value: 'x'"]),
    (["--prompt-ids", "1,2", "--stop-id", "3", "--no-stop"], ["--no-stop", "not allowed with"]),
])
def test_cli_refuses_bad_stops(markov_dir, capsys, args, needles):
    code, _, err = main_in_process("generate", str(markov_dir), *args, capsys=capsys)
    assert code == 2 and all(n in err for n in needles), err
    assert "Traceback" not in err


@pytest.fixture(scope="module")
def markov_dir(tmp_path_factory):
    """A run directory that passes the CLI's checks (config and a checkpoint folder): refusals come first."""
    run_dir = tmp_path_factory.mktemp("markov-stub")
    (run_dir / "config.json").write_text(json.dumps({"model": {"preset": "tiny", "vocab_size": 32}}))
    (run_dir / "checkpoints" / "3").mkdir(parents=True)
    return run_dir


def test_cli_refuses_a_default_end_id_outside_the_vocabulary(byte_run, capsys):
    _, run_dir = byte_run
    code, _, err = main_in_process("generate", str(run_dir), "model.vocab_size=256", "--prompt-ids", "1",
                                   capsys=capsys)
    assert code == 2 and "end-of-text id 256" in err and "sidecar" in err and "--no-stop" in err, err


def test_an_imported_checkpoint_stops_where_transformers_would_at_its_generation_configs_ids(devices, tmp_path):
    """transformers' greedy tokens (eos off, tests/hf_reference), cut at the first of the ids a
    generation_config.json names: row 0 at its 7th new token (123), row 1 at its 8th (113)."""
    from spmd_train.hf.import_params import load_hf_params
    from tests.test_hf_interop import REFERENCE
    from tests.test_hf_interop import _engine as hf_engine

    for f in ("config.json", "model.safetensors", "reference.npz"):
        shutil.copy(REFERENCE / "llama" / f, tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [123, 113]}))
    engine = hf_engine("llama", devices[:1], directory=tmp_path)
    ids, _ = run_end_ids(engine.cfg)
    assert ids == (123, 113)
    ref = np.load(tmp_path / "reference.npz")
    prompts = [ref["prompt_0"].tolist(), ref["prompt_1"].tolist()]
    out = generate(engine, load_hf_params(engine, tmp_path), prompts, max_new_tokens=12, stop_ids=ids)
    made = [ref[f"greedy_{i}"].tolist()[len(p):] for i, p in enumerate(prompts)]
    assert out.tokens == [_cut(row, set(ids)) for row in made] == [made[0][:7], made[1][:8]]
    assert out.finish == ["stop id", "stop id"] and out.steps_run == 8
