"""Tokenizers for `prepare-data`, and where a text may be cut so that its pieces tokenize like the whole.

`byte`: UTF-8 bytes 0-255 plus an end-of-text id 256 (vocabulary 257), no extra dependency.
`tiktoken:NAME` and `sentencepiece:PATH` need their packages, `hf:DIR` (a Hugging Face checkpoint's
`tokenizer.json`) the `tokenizers` package (all in the `tokenizers` extra).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Literal, NamedTuple

import numpy as np

from spmd_train.errors import ConfigError

BYTE_EOT = 256
"""The byte tokenizer's end-of-text id: one past the bytes, so no byte value doubles as the separator."""
BYTE_VOCAB = BYTE_EOT + 1


class Tokenizer(NamedTuple):
    """How `prepare-data` turns text into ids."""

    encode: Callable[[str], Sequence[int] | np.ndarray]
    vocab_size: int
    eot_id: int | None
    cut: Literal["anywhere", "before_space", "drop_space"]
    """Where a document may be cut into pieces that tokenize like the whole (see `safe_cut`)."""


def load_tokenizer(spec: str) -> Tokenizer:
    """The tokenizer 'byte', 'tiktoken:NAME' or 'sentencepiece:PATH' names."""
    kind, _, arg = spec.partition(":")
    if kind == "byte" and not arg:
        return Tokenizer(_encode_bytes, BYTE_VOCAB, BYTE_EOT, "anywhere")
    if kind == "tiktoken" and arg:
        return _tiktoken(spec, arg)
    if kind == "sentencepiece" and arg:
        return _sentencepiece(spec, arg)
    if kind == "hf" and arg:
        return _hugging_face(spec, Path(arg))
    raise ConfigError(f"--tokenizer {spec!r} is not a tokenizer (valid: byte, tiktoken:NAME, sentencepiece:PATH, "
                      "hf:DIR)")


def _encode_bytes(text: str) -> np.ndarray:
    return np.frombuffer(text.encode("utf-8"), np.uint8)


def _tiktoken(spec: str, name: str) -> Tokenizer:
    try:
        import tiktoken
    except ImportError:
        raise ConfigError("--tokenizer tiktoken:... needs the tiktoken package: pip install tiktoken") from None
    try:
        enc = tiktoken.get_encoding(name)
    except ValueError:  # an unknown name: tiktoken lists the ones it has
        raise ConfigError(f"--tokenizer {spec}: tiktoken has no encoding {name!r} (valid: "
                          f"{', '.join(tiktoken.list_encoding_names())})") from None
    except Exception as err:  # its files are downloaded on first use and cached (TIKTOKEN_CACHE_DIR)
        raise ConfigError(f"--tokenizer {spec}: tiktoken could not load {name!r} ({type(err).__name__}: "
                          f"{str(err)[:200]}); on a machine without network, copy its cache and set "
                          "TIKTOKEN_CACHE_DIR") from None
    return Tokenizer(enc.encode_ordinary, enc.n_vocab, enc.eot_token, "before_space")


def _sentencepiece(spec: str, path: str) -> Tokenizer:
    try:
        import sentencepiece
    except ImportError:
        raise ConfigError("--tokenizer sentencepiece:... needs the sentencepiece package: "
                          "pip install sentencepiece") from None
    if not Path(path).is_file():
        raise ConfigError(f"--tokenizer {spec}: model file {path} does not exist")
    try:
        sp = sentencepiece.SentencePieceProcessor(model_file=path)
    except Exception as err:  # not a SentencePiece model (RuntimeError from its C++ parser)
        raise ConfigError(f"--tokenizer {spec}: {path} is not a SentencePiece model ({str(err)[:200]})") from None
    eos = sp.eos_id()
    # A model that adds a dummy "▁" before every text would add one more at a cut: the space
    # cut at is dropped instead, and the dummy prefix stands for it. (A model with neither the
    # prefix nor whitespace kept, rare, loses the space at each cut: no cut is exact for it.)
    probe = sp.encode("x", out_type=str)
    dummy_prefix = bool(probe) and probe[0].startswith("\u2581")
    return Tokenizer(sp.encode, sp.get_piece_size(), eos if eos >= 0 else None,
                     "drop_space" if dummy_prefix else "before_space")


def _hugging_face(spec: str, directory: Path) -> Tokenizer:
    try:
        import tokenizers
    except ImportError:
        raise ConfigError("--tokenizer hf:... needs the tokenizers package: pip install tokenizers") from None
    path = directory / "tokenizer.json"
    if not path.is_file():
        raise ConfigError(f"--tokenizer {spec}: {directory} has no tokenizer.json (valid: a Hugging Face checkpoint "
                          "or tokenizer directory saved by a fast tokenizer)")
    try:
        tok = tokenizers.Tokenizer.from_file(str(path))
    except Exception as err:  # the Rust parser's own exception type
        raise ConfigError(f"--tokenizer {spec}: {path} is not a tokenizers file ({str(err)[:200]})") from None
    vocab = max(tok.get_vocab(with_added_tokens=True).values()) + 1

    def encode(text: str) -> list[int]:
        # No special tokens: documents are packed, each ending with the model's end-of-sequence id.
        return tok.encode(text, add_special_tokens=False).ids

    probe = tok.encode("x", add_special_tokens=False).tokens
    dummy_prefix = bool(probe) and probe[0].startswith("\u2581")  # SentencePiece-style (Llama 2, Mistral)
    return Tokenizer(encode, vocab, _eos_id(spec, directory, tok), "drop_space" if dummy_prefix else "before_space")


def _eos_id(spec: str, directory: Path, tok) -> int:
    """The model's end-of-sequence id: config.json's eos_token_id (the first of a list), else
    tokenizer_config.json's eos_token, else generation_config.json's."""
    import json

    for name, key in (("config.json", "eos_token_id"), ("tokenizer_config.json", "eos_token"),
                      ("generation_config.json", "eos_token_id")):
        path = directory / name
        if not path.is_file():
            continue
        try:
            value = json.loads(path.read_text()).get(key)
        except (OSError, ValueError, AttributeError):
            continue
        value = value[0] if isinstance(value, list) and value else value
        value = value.get("content") if isinstance(value, dict) else value  # an AddedToken record
        if isinstance(value, str):
            value = tok.token_to_id(value)
        if isinstance(value, int):
            return value
    raise ConfigError(f"--tokenizer {spec}: no end-of-sequence token found (valid: eos_token_id in "
                      f"{directory / 'config.json'} or eos_token in tokenizer_config.json)")


def safe_cut(text: str, cut: str, max_carry: int) -> tuple[int, int]:
    """(end of the piece to encode now, start of the carry): a cut of `text` where its pieces tokenize as the whole.

    Bytes cut anywhere. Otherwise the cut goes at a space between two non-space characters
    ("x word"), and the piece after it keeps the space ("before_space") or drops it
    ("drop_space"). tiktoken: no pre-token of the GPT-2, cl100k or o200k patterns holds a space
    other than as its first character or inside a run of whitespace, and none reaches past a
    non-space character into a space, so the pre-tokens, and the BPE merges inside each, are
    those of the whole text; the piece before ends in a non-space, so the `\\s++$` rule cannot
    fire at the cut. SentencePiece (split_by_whitespace, its default) segments each word alone,
    and its dummy "\u2581" prefix stands for the dropped space. Where no such space leaves at
    most `max_carry` characters after it (a long stretch without spaces), the cut is at the end and
    the tokens there may differ from the whole's: the price of bounded memory.
    """
    end = len(text)
    if cut == "anywhere":
        return end, end
    lo = max(end - max_carry, 1)
    at = text.rfind(" ", lo, end - 1)
    while at >= lo:
        if not text[at - 1].isspace() and not text[at + 1].isspace():
            return at, at + (cut == "drop_space")
        at = text.rfind(" ", lo, at)
    return end, end


def encode_document(pieces: Iterable[str], tokenizer: Tokenizer, chunk_chars: int) -> Iterator[np.ndarray]:
    """A document's ids, given as text pieces of any size, encoded at most ~2 x `chunk_chars` characters at a time.

    The ids equal those of the whole document encoded at once for `byte`; for the others, up
    to the cuts `safe_cut` cannot place (see there).
    """
    carry = ""  # the text after the last cut: at most chunk_chars characters
    for piece in pieces:
        for at in range(0, len(piece), chunk_chars):
            text = carry + piece[at:at + chunk_chars]
            end, resume = safe_cut(text, tokenizer.cut, chunk_chars)
            if end:
                yield np.asarray(tokenizer.encode(text[:end]))
            carry = text[resume:]
    if carry:
        yield np.asarray(tokenizer.encode(carry))
