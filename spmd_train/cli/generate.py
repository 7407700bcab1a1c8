"""`spmd-train generate RUN_DIR`: new tokens from a run's latest checkpoint, for prompts given as text or token ids.

The run's recorded config (RUN_DIR/config.json) says the model, the mesh and the data; its
tokenizer is the data's: bytes for `data.source=text`, the tokenizer `prepare-data` recorded in
the token file's sidecar for `data.source=tokens`, none for `markov` (only --prompt-ids then).
Overrides after RUN_DIR change the config generation runs with (e.g. another mesh).
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path
from typing import Any, NamedTuple

from spmd_train.config import load_config
from spmd_train.config.schema import Config
from spmd_train.errors import ConfigError


class TextCodec(NamedTuple):
    """A run's tokenizer, both ways."""

    name: str
    encode: Any
    decode: Any


def add_generate_parser(sub) -> None:
    """Register `generate` on the CLI's subcommands."""
    gen = sub.add_parser(
        "generate", help="generate tokens from a run's latest checkpoint (KV cache, greedy or sampled)",
        description="Restore RUN_DIR's latest checkpoint and generate new tokens for each prompt with a KV cache: "
        "greedy at temperature 0 (the default), else sampled. Prints the decoded text (or the ids when the run "
        "has no tokenizer), how each row ended and the decode speed. A row ends at the run's end-of-text ids "
        "(see --stop-id, --no-stop), at --stop strings, or after --max-new-tokens.")
    gen.add_argument("run_dir", metavar="RUN_DIR", help="a run directory written by `spmd-train train`")
    gen.add_argument("overrides", nargs="*", metavar="section.key=value",
                     help="config overrides for generating, e.g. mesh.pipeline=1")
    prompts = gen.add_mutually_exclusive_group(required=True)
    prompts.add_argument("--prompt", action="append", metavar="TEXT", help="a prompt as text (repeat for a batch)")
    prompts.add_argument("--prompt-file", action="append", metavar="F",
                         help="a UTF-8 file whose whole text is one prompt (repeat for a batch)")
    prompts.add_argument("--prompt-ids", action="append", metavar="1,2,3",
                         help="a prompt as comma-separated token ids (repeat for a batch)")
    gen.add_argument("--max-new-tokens", type=int, default=64, metavar="N",
                     help="the most new tokens per prompt (default 64)")
    gen.add_argument("--temperature", type=float, default=0.0, metavar="T", help="0 (default): greedy; > 0: sampled")
    gen.add_argument("--top-k", type=int, metavar="K", help="sample from the K most likely tokens only")
    gen.add_argument("--top-p", type=float, metavar="P", help="sample from the most likely tokens holding P of the "
                     "probability (0 < P <= 1)")
    gen.add_argument("--seed", type=int, default=0, metavar="S", help="random seed of the sampling (default 0)")
    ids = gen.add_mutually_exclusive_group()
    ids.add_argument("--stop-id", type=int, action="append", metavar="ID",
                     help="end a row at this token id (repeatable; replaces the run's end-of-text ids, the default: "
                     "a Hugging Face checkpoint's eos_token_id, or the token files' eot_id)")
    ids.add_argument("--no-stop", action="store_true",
                     help="stop at no token id: every row makes --max-new-tokens tokens")
    gen.add_argument("--stop", action="append", metavar="TEXT",
                     help="cut a row's text before this string, which is dropped, and its tokens to those of the "
                     "kept text (repeatable; matched after generating; needs the run's tokenizer)")
    gen.add_argument("--json", action="store_true",
                     help='print one JSON object: {"prompts": [...], "tokens": [[...]], "finish": [...], '
                     '"tokens_per_s": ...}')


def run_generate(args: argparse.Namespace) -> int:
    """The `generate` subcommand; bad input raises ConfigError (exit 2 in `main`)."""
    run_dir = Path(args.run_dir)
    cfg = _run_config(run_dir, args.overrides)
    codec = run_tokenizer(cfg)
    prompts = _prompts(args, codec, cfg.data.source)
    stop_ids = _stop_ids(args, cfg, codec)
    from spmd_train.train.generation import check_request

    check_request(prompts, cfg.model.vocab_size, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                  top_k=args.top_k, top_p=args.top_p, stop_ids=stop_ids)

    import jax

    from spmd_train.devices import simulate_devices
    from spmd_train.train.checkpoint import Checkpointer
    from spmd_train.train.engine import Engine
    from spmd_train.train.generation import check_engine, generate
    from spmd_train.train.restore import restore_latest

    simulate_devices(cfg.run.simulate_devices)
    engine = Engine.build(cfg)
    check_engine(engine)  # before reading the checkpoint
    absl = logging.getLogger("absl")
    level = absl.level
    absl.setLevel(logging.ERROR)  # Orbax's three warnings that a read-only manager is read-only
    try:
        source = Checkpointer(run_dir / "checkpoints", read_only=True)
    finally:
        absl.setLevel(level)
    restored = restore_latest(engine, cfg, source, run_dir)
    if restored is None:
        raise ConfigError(f"RUN_DIR {run_dir}: no checkpoint in {run_dir / 'checkpoints'} could be restored")
    step, state = restored
    result = generate(engine, state.params, prompts, max_new_tokens=args.max_new_tokens,
                      temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                      stop_ids=stop_ids)
    if jax.process_index() != 0:
        return 0
    from spmd_train.train.stops import finish_rows

    tokens, texts, finish = finish_rows(result.tokens, result.finish, codec and codec.decode, args.stop or ())
    speed = result.decode_tokens_per_s
    if args.json:
        out = {"prompts": prompts, "tokens": tokens, "finish": finish, "stop_ids": list(stop_ids),
               "tokens_per_s": speed, "prefill_s": result.prefill_s, "decode_s": result.decode_s,
               "compile_s": result.compile_s, "step": step}
        if codec is not None:
            out["text"] = texts
        print(json.dumps(out))
        return 0
    for i, row in enumerate(tokens):
        if len(prompts) > 1:
            print(f"--- prompt {i} ({finish[i]})")
        print(texts[i] if codec is not None else " ".join(map(str, row)))
    rate = f"{speed:,.1f} tokens/s" if speed is not None else "no decode steps"
    made = sum(map(len, tokens))
    ended = ", ".join(f"{finish.count(how)} at {how}" for how in ("stop id", "stop string", "length")
                      if how in finish)
    print(f"[{made} new tokens from step {step} of {run_dir}: ended {ended}; prefill {result.prefill_s:.3f} s, "
          f"decode {rate} ({len(prompts)} prompt{'s' * (len(prompts) > 1)}), compiled in {result.compile_s:.1f} s]")
    return 0


def _stop_ids(args: argparse.Namespace, cfg: Config, codec: TextCodec | None) -> tuple[int, ...]:
    """The token ids rows stop at: --stop-id's, none with --no-stop, else the run's end-of-text ids; and refuse
    --stop strings when the run has no tokenizer to match them in."""
    from spmd_train.train.stops import check_stop_strings, run_end_ids

    if args.stop:
        check_stop_strings(args.stop)
        if codec is None:
            raise ConfigError(f"--stop: this run has no tokenizer (data.source={cfg.data.source}), so stop strings "
                              "cannot be matched in its text (valid: --stop-id ID, a token id to stop at)")
    if args.no_stop:
        return ()
    if args.stop_id:
        return tuple(args.stop_id)
    ids, source = run_end_ids(cfg)
    vocab = cfg.model.vocab_size
    for t in ids:
        if not 0 <= t < vocab:
            raise ConfigError(f"the run's end-of-text id {t} (from {source}) is outside the vocabulary (valid: "
                              f"0 to {vocab - 1}, model.vocab_size={vocab}); give --stop-id ID or --no-stop")
    return ids


def _run_config(run_dir: Path, overrides: list[str]) -> Config:
    """RUN_DIR's recorded config, with `run.dir` pointing at RUN_DIR, after checking it has checkpoints."""
    valid = "valid: a run directory written by `spmd-train train`, holding config.json and checkpoints/"
    if not run_dir.is_dir():
        raise ConfigError(f"RUN_DIR {run_dir} is not a directory ({valid})")
    if not (run_dir / "config.json").is_file():
        raise ConfigError(f"RUN_DIR {run_dir} has no config.json ({valid})")
    checkpoints = run_dir / "checkpoints"
    if not checkpoints.is_dir() or not any(p.name.isdigit() for p in checkpoints.iterdir()):
        raise ConfigError(f"RUN_DIR {run_dir} has no checkpoint in {checkpoints} ({valid}; train it first)")
    return load_config(run_dir / "config.json", [f"run.dir={run_dir}", *overrides])


def run_tokenizer(cfg: Config) -> TextCodec | None:
    """The tokenizer a run's data was made with, or None (Markov tokens, token files without a sidecar).

    A run started from a Hugging Face checkpoint (checkpoint.load_from=hf:DIR) whose data names no tokenizer
    uses DIR's tokenizer.json when there is one.
    """
    data = cfg.data
    if data.source == "text":
        return TextCodec("bytes", lambda text: list(text.encode("utf-8")), _decode_bytes)
    spec = _sidecar_tokenizer(data.paths) if data.source == "tokens" and data.paths else None
    load_from = cfg.checkpoint.load_from or ""
    if spec is None and load_from.startswith("hf:") and (Path(load_from[3:]) / "tokenizer.json").is_file():
        spec = load_from
    if spec is None:
        return None
    from spmd_train.data.tokenizers import load_tokenizer

    tok = load_tokenizer(spec)
    encode = lambda text: [int(t) for t in tok.encode(text)]
    kind, _, arg = spec.partition(":")
    if kind == "byte":
        return TextCodec(spec, encode, _decode_bytes)
    if kind == "tiktoken":
        import tiktoken

        enc = tiktoken.get_encoding(arg)
        return TextCodec(spec, encode, lambda ids: enc.decode([i for i in ids if i < enc.n_vocab]))
    if kind == "sentencepiece":
        import sentencepiece

        sp = sentencepiece.SentencePieceProcessor(model_file=arg)
        return TextCodec(spec, encode, lambda ids: sp.decode([i for i in ids if i < sp.get_piece_size()]))
    if kind == "hf":
        import tokenizers

        hf = tokenizers.Tokenizer.from_file(str(Path(arg) / "tokenizer.json"))
        return TextCodec(spec, encode, lambda ids: hf.decode(ids, skip_special_tokens=False))
    return None


def _sidecar_tokenizer(paths: tuple[str, ...]) -> str | None:
    """The tokenizer `prepare-data` recorded beside the first token file (NAME.json), or None."""
    from spmd_train.train.stops import sidecar

    spec = sidecar(paths).get("tokenizer")
    return spec if isinstance(spec, str) else None


def _decode_bytes(ids: list[int]) -> str:
    # Ids past the bytes (a prepared file's end-of-text 256, or rows a larger vocabulary adds) are shown as U+FFFD.
    return b"".join(bytes([i]) if i < 256 else "\ufffd".encode() for i in ids).decode("utf-8", errors="replace")


def _prompts(args: argparse.Namespace, codec: TextCodec | None, source: str) -> list[list[int]]:
    """The prompts as token ids, from --prompt, --prompt-file or --prompt-ids."""
    if args.prompt_ids:
        prompts = []
        for given in args.prompt_ids:
            try:
                prompts.append([int(t) for t in given.split(",") if t.strip()])
            except ValueError:
                raise ConfigError(f"--prompt-ids {given!r} (valid: comma-separated integer token ids, "
                                  "e.g. 1,2,3)") from None
            if not prompts[-1]:
                raise ConfigError(f"--prompt-ids {given!r} is empty (valid: comma-separated integer token ids, "
                                  "e.g. 1,2,3)")
        return prompts
    flag = "--prompt" if args.prompt else "--prompt-file"
    if codec is None:
        raise ConfigError(f"{flag}: this run has no tokenizer (data.source={source}), so text cannot be "
                          "turned into token ids (valid: --prompt-ids 1,2,3)")
    texts = args.prompt or []
    for path in args.prompt_file or []:
        try:
            texts.append(Path(path).read_text(encoding="utf-8").removesuffix("\n"))
        except (OSError, UnicodeDecodeError) as err:
            raise ConfigError(f"--prompt-file {path} cannot be read ({type(err).__name__}: {err}) "
                              "(valid: a UTF-8 text file)") from None
    prompts = [codec.encode(text) for text in texts]
    for text, ids in zip(texts, prompts, strict=True):
        if not ids:
            raise ConfigError(f"{flag} {text!r} is empty (valid: text of at least one token)")
    return prompts

