"""The documents in `prepare-data`'s inputs, read in bounded pieces.

A plain text file is one document, read `chunk_bytes` at a time. A `.jsonl` file holds one
document per line, a JSON object whose `text_field` is the text, read in blocks of whole lines of
about `chunk_bytes`; blank lines are no documents.
A name ending in `.gz` is decompressed as it is read (`a.jsonl.gz`, `b.txt.gz`). Every error
names the input (and, for JSONL, the line).
"""

from __future__ import annotations

import codecs
import contextlib
import gzip
import io
import json
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO

from spmd_train.errors import ConfigError

CHUNK_BYTES = 4 << 20
"""Bytes of a plain text input read and tokenized at a time (host memory is a small multiple of it)."""


def is_jsonl(path: Path) -> bool:
    """Whether `path` is read as JSONL (one JSON object per line), by its name."""
    return path.name.removesuffix(".gz").endswith(".jsonl")


def read_documents(path: Path, text_field: str = "text", chunk_bytes: int = CHUNK_BYTES,
                   on_position: Callable[[int], None] = lambda _: None) -> Iterator[Iterator[str]]:
    """The documents of one input, each as an iterator of its text pieces; `on_position` gets the bytes read so far.

    Consume each document before asking for the next: they share one open file.
    """
    with _open(path) as (stream, raw):
        read = _guard(path, lambda: on_position(raw.tell()))
        if is_jsonl(path):
            yield from _jsonl_documents(stream, path, text_field, chunk_bytes, read)
        else:
            yield _text_pieces(stream, path, chunk_bytes, read)


@contextlib.contextmanager
def _open(path: Path):
    with open(path, "rb") as raw:
        if path.suffix != ".gz":
            yield raw, raw
            return
        with gzip.GzipFile(fileobj=raw, mode="rb") as stream:
            yield stream, raw


def _guard(path: Path, report: Callable[[], None]) -> Callable[[Callable[[], bytes]], bytes]:
    """A reader that names the input when reading fails (a truncated or corrupt .gz, an I/O error)."""
    def read(call: Callable[[], bytes]) -> bytes:
        try:
            data = call()
        except (OSError, EOFError, zlib.error) as err:
            raise ConfigError(f"input {path} cannot be read ({type(err).__name__}: {err})") from None
        report()
        return data
    return read


def _text_pieces(stream: BinaryIO, path: Path, chunk_bytes: int, read) -> Iterator[str]:
    # Universal newlines, as Path.read_text reads ("\r\n" and "\r" become "\n"), also where a
    # "\r\n" straddles two chunks; the incremental decoder likewise carries a multi-byte
    # character cut by a chunk boundary over to the next chunk.
    decoder = io.IncrementalNewlineDecoder(codecs.getincrementaldecoder("utf-8")(), translate=True)
    offset = 0  # bytes of text read before this chunk
    while True:
        data = read(lambda: stream.read(chunk_bytes))
        pending = len(decoder.getstate()[0])  # bytes of a character begun in the previous chunk
        try:
            text = decoder.decode(data, final=not data)
        except UnicodeDecodeError as err:
            raise ConfigError(f"input {path} cannot be read as UTF-8 text: byte {offset - pending + err.start} "
                              f"(0x{err.object[err.start]:02x}): {err.reason}") from None
        offset += len(data)
        if text:
            yield text
        if not data:
            return


def _jsonl_documents(stream: BinaryIO, path: Path, field: str, chunk_bytes: int, read) -> Iterator[Iterator[str]]:
    number = 0
    # Whole lines, about chunk_bytes of them at a time: one read (and one progress update) per block.
    while lines := read(lambda: stream.readlines(chunk_bytes)):
        for line in lines:
            number += 1
            if line.strip():
                yield iter((jsonl_text(line, f"{path}:{number}", field, first=number == 1),))


def jsonl_text(line: bytes, where: str, field: str, first: bool = False) -> str:
    """The text field of one JSONL line, or a ConfigError naming `where` (FILE:LINE) and the field."""
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ConfigError(f"input {where}: not UTF-8 text (byte {err.start} of the line: {err.reason})") from None
    try:
        obj = json.loads(text.removeprefix("\ufeff") if first else text)  # a byte-order mark may open the file
    except json.JSONDecodeError as err:
        raise ConfigError(f"input {where}: not JSON ({err.msg} at column {err.colno}); each line of a .jsonl "
                          f"input must be one JSON object with a string field {field!r}") from None
    if not isinstance(obj, dict):
        raise ConfigError(f"input {where}: a JSON {_kind(obj)}, not an object with a string field {field!r}")
    if field not in obj:
        keys = ", ".join(repr(k) for k in list(obj)[:20]) + (", ..." if len(obj) > 20 else "")
        raise ConfigError(f"input {where}: the object has no field {field!r} (its keys: {keys or 'none'}; "
                          "valid: --text-field KEY naming the field that holds the text)")
    if not isinstance(obj[field], str):
        raise ConfigError(f"input {where}: field {field!r} is a JSON {_kind(obj[field])}, not a string")
    return obj[field]


def _kind(value: object) -> str:
    names = {dict: "object", list: "array", str: "string", bool: "boolean", int: "number", float: "number"}
    return "null" if value is None else names.get(type(value), type(value).__name__)
