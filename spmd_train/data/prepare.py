"""`spmd-train prepare-data`: text files and JSONL -> one `.bin` token file with its sidecars.

Writes OUT/NAME.bin (uint16 ids, uint32 when the vocabulary needs it), OUT/NAME.json (dtype,
vocab size, tokenizer, end-of-text id, token and document counts) and OUT/NAME.docs.npy (the
offset where each document starts). A plain text input is one document; a `.jsonl` input holds
one per line (`text_field`); see `text_inputs`. Every document ends with the tokenizer's
end-of-text id (`byte`: 256); documents without tokens are skipped.

Inputs are streamed: host memory stays a small multiple of `chunk_bytes` (plus 8 bytes per
document for the starts, and the longest line of a JSONL input), whatever the inputs' size.
"""

from __future__ import annotations

import json
import shutil
from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

import numpy as np
from rich.progress import Progress

from spmd_train.data.text_inputs import CHUNK_BYTES, is_jsonl, read_documents
from spmd_train.data.tokenizers import Tokenizer, encode_document, load_tokenizer
from spmd_train.errors import ConfigError
from spmd_train.output_dir import make_output_dir

__all__ = ["CHUNK_BYTES", "load_tokenizer", "prepare_data"]


@dataclass
class _Tally:
    """What has been written so far: tokens, where each document starts, documents skipped as empty."""

    tokens: int = 0
    starts: array = field(default_factory=lambda: array("q"))  # 8 bytes a document, not a Python int each
    skipped: int = 0


def prepare_data(inputs: Sequence[str | Path], out: str | Path, tokenizer: str = "byte", name: str = "data", *,
                 text_field: str = "text", chunk_bytes: int = CHUNK_BYTES) -> Path:
    """Tokenize the documents of `inputs` into OUT/NAME.bin and its sidecars; returns the .bin path."""
    tok = load_tokenizer(tokenizer)
    paths = _checked_inputs(inputs)
    dtype = np.dtype(np.uint16 if tok.vocab_size <= 2**16 else np.uint32)
    out = Path(out)
    created = make_output_dir(out, f"--out {out}")
    target, docs, meta = (out / f"{name}{suffix}" for suffix in (".bin", ".docs.npy", ".json"))
    tally = _Tally()
    try:
        with open(_partial(target), "wb") as sink, Progress(transient=True) as progress:
            task = progress.add_task("tokenizing", total=sum(p.stat().st_size for p in paths))
            done = 0
            for path in paths:
                at = lambda pos, done=done: progress.update(task, completed=done + pos)
                _write_documents(read_documents(path, text_field, chunk_bytes, at), tok, dtype, chunk_bytes, sink,
                                 tally)
                done += path.stat().st_size
        if not tally.starts:
            raise ConfigError(f"the inputs hold no document with text ({tally.skipped} empty ones skipped): "
                              f"{', '.join(map(str, paths))}")
        # The sidecars first, the tokens last: a reader that sees NAME.bin sees its sidecars too.
        with open(_partial(docs), "wb") as f:
            np.save(f, np.frombuffer(tally.starts, np.int64), allow_pickle=False)
        _partial(meta).write_text(json.dumps({
            "dtype": dtype.name, "vocab_size": tok.vocab_size, "tokenizer": tokenizer, "eot_id": tok.eot_id,
            "num_tokens": tally.tokens, "num_documents": len(tally.starts), "empty_documents_skipped": tally.skipped,
            **({"text_field": text_field} if any(map(is_jsonl, paths)) else {}),
            "inputs": [str(p) for p in paths],
        }, indent=2))
        for path in (docs, meta, target):
            _partial(path).replace(path)
    except BaseException:  # refused input or an interrupt: leave nothing half-written behind
        for path in out.glob(f"{name}.*.partial"):
            path.unlink(missing_ok=True)
        if created:
            shutil.rmtree(out, ignore_errors=True)
        raise
    return target


def _checked_inputs(inputs: Sequence[str | Path]) -> list[Path]:
    paths = [Path(p) for p in inputs]
    for path in paths:
        if not path.is_file():
            raise ConfigError(f"input {path} does not exist")
        if path.stat().st_size == 0:
            raise ConfigError(f"input {path} is empty")
    return paths


def _partial(path: Path) -> Path:
    return path.with_name(path.name + ".partial")


def _write_documents(documents: Iterable[Iterable[str]], tok: Tokenizer, dtype: np.dtype, chunk_chars: int,
                     sink: BinaryIO, tally: _Tally) -> None:
    """Append each document's ids and end-of-text id to `sink` as they are encoded; record where it starts."""
    end = np.asarray([] if tok.eot_id is None else [tok.eot_id], dtype)
    for pieces in documents:
        count = 0
        for ids in encode_document(pieces, tok, chunk_chars):
            sink.write(ids.astype(dtype, copy=False))
            count += ids.size
        if not count:  # no text (or, without an end id, no token): a start here would repeat the next one's
            tally.skipped += 1
            continue
        sink.write(end)
        tally.starts.append(tally.tokens)
        tally.tokens += count + end.size
