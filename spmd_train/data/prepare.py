"""`spmd-train prepare-data`: text files -> one `.bin` token file with its sidecars.

Writes OUT/NAME.bin (uint16 ids, uint32 when the vocabulary needs it), OUT/NAME.json
(dtype, vocab size, tokenizer, token and document counts) and OUT/NAME.docs.npy (the
offset where each input file starts). Tokenizers: `byte` (UTF-8 bytes, vocab 256, no extra
dependency), `tiktoken:NAME` (the `tiktoken` package) and `sentencepiece:PATH` (the
`sentencepiece` package); documents are separated by the tokenizer's end-of-text id where it
has one.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
from rich.progress import Progress

from spmd_train.errors import ConfigError
from spmd_train.output_dir import make_output_dir


def load_tokenizer(spec: str) -> tuple[Callable[[str], list[int]], int, int | None]:
    """(encode, vocab size, end-of-text id or None) for 'byte', 'tiktoken:NAME' or 'sentencepiece:PATH'."""
    kind, _, arg = spec.partition(":")
    if kind == "byte" and not arg:
        return (lambda text: list(text.encode("utf-8"))), 256, None
    if kind == "tiktoken" and arg:
        try:
            import tiktoken
        except ImportError:
            raise ConfigError("--tokenizer tiktoken:... needs the tiktoken package: pip install tiktoken") from None
        try:
            enc = tiktoken.get_encoding(arg)
        except ValueError:  # an unknown name: tiktoken lists the ones it has
            raise ConfigError(f"--tokenizer {spec}: tiktoken has no encoding {arg!r} (valid: "
                              f"{', '.join(tiktoken.list_encoding_names())})") from None
        except Exception as err:  # its files are downloaded on first use and cached (TIKTOKEN_CACHE_DIR)
            raise ConfigError(f"--tokenizer {spec}: tiktoken could not load {arg!r} ({type(err).__name__}: "
                              f"{str(err)[:200]}); on a machine without network, copy its cache and set "
                              "TIKTOKEN_CACHE_DIR") from None
        return (lambda text: enc.encode_ordinary(text)), enc.n_vocab, enc.eot_token
    if kind == "sentencepiece" and arg:
        try:
            import sentencepiece
        except ImportError:
            raise ConfigError("--tokenizer sentencepiece:... needs the sentencepiece package: "
                              "pip install sentencepiece") from None
        if not Path(arg).is_file():
            raise ConfigError(f"--tokenizer {spec}: model file {arg} does not exist")
        try:
            sp = sentencepiece.SentencePieceProcessor(model_file=arg)
        except Exception as err:  # not a SentencePiece model (RuntimeError from its C++ parser)
            raise ConfigError(f"--tokenizer {spec}: {arg} is not a SentencePiece model ({str(err)[:200]})") from None
        eos = sp.eos_id()
        return (lambda text: sp.encode(text)), sp.get_piece_size(), eos if eos >= 0 else None
    raise ConfigError(f"--tokenizer {spec!r} is not a tokenizer (valid: byte, tiktoken:NAME, sentencepiece:PATH)")


def prepare_data(inputs: Sequence[str | Path], out: str | Path, tokenizer: str = "byte", name: str = "data") -> Path:
    """Tokenize `inputs` (one document each) into OUT/NAME.bin; returns the .bin path."""
    encode, vocab, eot = load_tokenizer(tokenizer)
    paths = [Path(p) for p in inputs]
    for path in paths:
        if not path.is_file():
            raise ConfigError(f"input {path} does not exist")
        if path.stat().st_size == 0:
            raise ConfigError(f"input {path} is empty")
    dtype = np.uint16 if vocab <= 2**16 else np.uint32
    out = Path(out)
    created = make_output_dir(out, f"--out {out}")
    target, partial = out / f"{name}.bin", out / f"{name}.bin.partial"
    starts, total = [], 0
    try:
        with open(partial, "wb") as sink, Progress(transient=True) as progress:
            task = progress.add_task("tokenizing", total=sum(p.stat().st_size for p in paths))
            for path in paths:
                try:
                    text = path.read_text(encoding="utf-8")
                except (OSError, UnicodeDecodeError) as err:
                    raise ConfigError(f"input {path} cannot be read as UTF-8 text: {err}") from None
                ids = encode(text) + ([eot] if eot is not None else [])
                starts.append(total)
                np.asarray(ids, dtype=dtype).tofile(sink)
                total += len(ids)
                progress.advance(task, path.stat().st_size)
        # The sidecars first, the tokens last: a reader that sees NAME.bin sees its sidecars too.
        docs = out / f"{name}.docs.npy"
        with open(docs.with_name(docs.name + ".partial"), "wb") as f:
            np.save(f, np.asarray(starts, np.int64), allow_pickle=False)
        meta = out / f"{name}.json"
        meta.with_name(meta.name + ".partial").write_text(json.dumps({
            "dtype": np.dtype(dtype).name, "vocab_size": vocab, "tokenizer": tokenizer, "eot_id": eot,
            "num_tokens": total, "num_documents": len(paths), "inputs": [str(p) for p in paths],
        }, indent=2))
        for path in (docs, meta, target):
            path.with_name(path.name + ".partial").replace(path)
    except BaseException:  # refused input or an interrupt: leave nothing half-written behind
        for path in out.glob(f"{name}.*.partial"):
            path.unlink(missing_ok=True)
        if created:
            shutil.rmtree(out, ignore_errors=True)
        raise
    return target
