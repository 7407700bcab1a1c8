"""Token streams read from disk: memory-mapped `.bin` token files, or UTF-8 text read as bytes.

`.bin` files are flat arrays of uint16 or uint32 token ids (the layout nanoGPT's and Megatron-style preprocessors
write), with the sidecar (`NAME.json`) and document starts (`NAME.docs.npy`) `spmd-train prepare-data` writes.
Training windows of seq_len + 1 tokens come from the first (1 - val_fraction) of each file, held-out ones from
the rest; with document masking each row also carries its documents' segments and positions.

Details (packing, document masking, where documents begin): docs/data.md#where-documents-begin
"""

from __future__ import annotations

import glob
import itertools
import json
from pathlib import Path
from typing import NamedTuple

import numpy as np

from spmd_train.data.batch import document_layout, document_layout_from_eot
from spmd_train.data.source import TokenSource
from spmd_train.errors import ConfigError


class TokenFiles(TokenSource):
    """Windows sampled from one or more token files; a pure function of (seed, step, split)."""

    def __init__(self, paths: list[str], seq_len: int, global_batch: int, *, seed: int = 0, token_dtype: str = "auto",
                 val_fraction: float = 0.01, packing: bool = True, text: bool = False, vocab_size: int | None = None,
                 document_mask: bool | None = None, eot_id: int | None = None):
        files = _expand(paths)
        self.streams = [_open(f, "uint8" if text else token_dtype, eot_id) for f in files]
        # Unasked, only packed token files mask documents: a text file is one document, and
        # unpacked windows never span two.
        self.documents = (packing and not text) if document_mask is None else document_mask
        vocabs = [v for _, _, v, _ in self.streams if v is not None]
        # Text is bytes 0-255, no end-of-text id: each file is its own stream and no window spans
        # two, so there is nothing to separate. A prepared `byte` file (vocab 257) adds id 256.
        vocab = 256 if text else (max(vocabs) if vocabs else vocab_size)
        super().__init__(vocab or 0, seq_len, global_batch, seed)
        if vocab_size is not None and vocab and vocab > vocab_size:
            name = next(str(f) for f, _, v, _ in self.streams if (256 if text else v) == vocab)
            raise ConfigError(f"data file {name} holds token ids up to {vocab - 1}, but model.vocab_size={vocab_size} "
                              f"(valid: model.vocab_size >= {vocab})")
        if vocab_size is not None and not text:
            for path, tokens, recorded, _ in self.streams:
                if recorded is None:  # no prepare-data sidecar: read the ids themselves
                    _check_ids(path, tokens, vocab_size)
        self.val_fraction, self.packing = val_fraction, packing
        window = seq_len + 1
        self.ranges = []  # per file: (train_end, [(start, stop) of usable spans])
        for path, tokens, _, docs in self.streams:
            train_end = int(len(tokens) * (1 - val_fraction))
            if train_end < window:
                raise ConfigError(f"data file {path} has {len(tokens)} tokens, too few for windows of seq_len + 1 = "
                                  f"{window} after holding out val_fraction={val_fraction} (valid: a longer file, or "
                                  "a smaller train.seq_len)")
            spans = [(0, len(tokens))] if packing or docs.starts is None else _doc_spans(docs.starts, len(tokens))
            self.ranges.append((train_end, spans))
        if document_mask is True and not text:
            for path, _, _, docs in self.streams:
                if docs.starts is None and docs.eot_id is None:
                    raise ConfigError(f"data.document_mask=true, but data file {path} marks no documents: it has no "
                                      f"{path.with_suffix('.docs.npy').name} (written by spmd-train prepare-data) and "
                                      "no eot_id in its sidecar (valid: data.eot_id=ID, the token that ends each "
                                      "document, e.g. 50256 for GPT-2 tokens, or data.document_mask=false)")
        if not packing and not any(b - a >= window for _, spans in self.ranges for a, b in spans):
            raise ConfigError(f"train.seq_len={seq_len} is longer than every document in {', '.join(paths)} and "
                              "data.packing=false (valid: data.packing=true, or seq_len below the longest document)")

    def rows(self, step: int, rows: np.ndarray, split: str = "train") -> np.ndarray:
        """Read only the requested rows of the step's global batch."""
        files, offsets = self._plan(step, split)
        window = self.seq_len + 1
        out = np.empty((len(rows), window), np.int32)
        for i, r in enumerate(rows):
            out[i] = self.streams[files[r]][1][offsets[r]: offsets[r] + window]
        return out

    def document_rows(self, step: int, rows: np.ndarray, split: str = "train") -> tuple[np.ndarray, np.ndarray]:
        """(segments, positions) [len(rows), seq_len + 1] of the requested rows: where their documents lie."""
        files, offsets = self._plan(step, split)
        window = self.seq_len + 1
        segments = np.zeros((len(rows), window), np.int32)
        positions = np.empty((len(rows), window), np.int32)
        for i, r in enumerate(rows):
            _, tokens, _, docs = self.streams[files[r]]
            if docs.starts is not None:
                segments[i], positions[i] = document_layout(docs.starts, int(offsets[r]), window)
            elif docs.eot_id is not None:
                chunk = tokens[offsets[r]: offsets[r] + window]
                segments[i], positions[i] = document_layout_from_eot(chunk, docs.eot_id)
            else:
                positions[i] = np.arange(window)
        return segments, positions

    def global_batch_array(self, step: int, split: str = "train") -> np.ndarray:
        """The whole global batch of a step (0-based)."""
        return self.rows(step, np.arange(self.global_batch), split)

    def _plan(self, step: int, split: str) -> tuple[np.ndarray, np.ndarray]:
        # Every host draws the same plan for the whole batch (cheap) and reads its rows only.
        rng = np.random.default_rng([self.seed, step, 0 if split == "train" else 1])
        window = self.seq_len + 1
        candidates = []  # (file, start, stop) spans usable for this split
        for f, ((_, tokens, _, _), (train_end, spans)) in enumerate(zip(self.streams, self.ranges, strict=False)):
            lo, hi = (0, train_end) if split == "train" else (train_end, len(tokens))
            for a, b in spans:
                a, b = max(a, lo), min(b, hi)
                if b - a >= window:
                    candidates.append((f, a, b))
        if not candidates:
            raise ConfigError(f"no {split} window of seq_len + 1 = {window} tokens fits in the data "
                              "(valid: more data, a larger data.val_fraction, or a smaller train.seq_len)")
        weights = np.array([b - a - window + 1 for _, a, b in candidates], np.float64)
        pick = rng.choice(len(candidates), size=self.global_batch, p=weights / weights.sum())
        starts = np.array([candidates[p][1] for p in pick])
        room = np.array([candidates[p][2] - candidates[p][1] - window + 1 for p in pick])
        offsets = starts + (rng.random(self.global_batch) * room).astype(np.int64)
        return np.array([candidates[p][0] for p in pick]), offsets


def _expand(paths: list[str]) -> list[Path]:
    if not paths:
        raise ConfigError("data.paths is empty: give one or more files or globs (e.g. data.paths=[data/*.bin])")
    files: list[Path] = []
    for pattern in paths:
        matched = sorted(glob.glob(pattern)) if any(c in pattern for c in "*?[") else [pattern]
        if not matched:
            raise ConfigError(f"data.paths entry {pattern!r} matches no file")
        files.extend(Path(m) for m in matched)
    return files


class _Documents(NamedTuple):
    """Where a file's documents begin: offsets (`NAME.docs.npy`), or after each `eot_id`, or unknown (both None)."""

    starts: np.ndarray | None
    eot_id: int | None


def _open(path: Path, token_dtype: str, eot_id: int | None = None):
    if not path.is_file():
        raise ConfigError(f"data.paths: the file {path} does not exist")
    meta_path = path.with_suffix(".json")
    meta = _sidecar_meta(meta_path) if meta_path.is_file() and path.suffix == ".bin" else {}
    if token_dtype != "auto" and meta.get("dtype") not in (None, token_dtype):
        raise ConfigError(f"data.token_dtype={token_dtype} contradicts {meta_path.name}, which records "
                          f"{meta['dtype']} tokens for {path} (valid: data.token_dtype=auto or {meta['dtype']})")
    dtype = meta.get("dtype") or ("uint16" if token_dtype == "auto" else token_dtype)
    if dtype not in ("uint8", "uint16", "uint32"):
        raise ConfigError(f"data file {path}: token dtype {dtype!r} is not supported (valid: uint16, uint32)")
    size = path.stat().st_size
    itemsize = np.dtype(dtype).itemsize
    if size == 0:
        raise ConfigError(f"data.paths: the file {path} is empty")
    if size % itemsize:
        raise ConfigError(f"data file {path} has {size} bytes, not a whole number of {dtype} tokens "
                          "(valid: a .bin of uint16 or uint32 ids; set data.token_dtype)")
    try:
        tokens = np.memmap(path, dtype=dtype, mode="r")
    except OSError as err:
        raise ConfigError(f"data.paths: the file {path} cannot be read: {err.strerror}") from None
    docs_path = path.with_suffix(".docs.npy")
    starts = _sidecar_starts(docs_path, tokens.size) if docs_path.is_file() else None
    eot = eot_id if eot_id is not None else meta.get("eot_id")
    return path, tokens, meta.get("vocab_size"), _Documents(starts, eot)


def _sidecar_meta(path: Path) -> dict:
    fix = "rewrite it with spmd-train prepare-data, or remove it to read the .bin without it"
    try:
        meta = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ConfigError(f"data sidecar {path} cannot be read ({type(err).__name__}: {err}); {fix}") from None
    if not isinstance(meta, dict):
        raise ConfigError(f"data sidecar {path} is not a JSON object; {fix}")
    return meta


def _sidecar_starts(path: Path, num_tokens: int) -> np.ndarray:
    """Document starts from NAME.docs.npy: increasing offsets from 0 inside the token file."""
    fix = "rewrite it with spmd-train prepare-data, or remove it (documents then come from data.eot_id)"
    try:
        starts = np.load(path, allow_pickle=False)
    except (OSError, ValueError, EOFError) as err:
        raise ConfigError(f"data sidecar {path} cannot be read ({type(err).__name__}: {err}); {fix}") from None
    if starts.ndim != 1 or starts.dtype.kind not in "iu" or not starts.size:
        raise ConfigError(f"data sidecar {path} holds {starts.dtype} of shape {starts.shape}, not document starts "
                          f"(a 1-D array of integer offsets); {fix}")
    starts = starts.astype(np.int64)
    if starts[0] != 0 or (np.diff(starts) <= 0).any() or starts[-1] >= num_tokens:
        raise ConfigError(f"data sidecar {path}: document starts must increase from 0 and stay below the file's "
                          f"{num_tokens} tokens (found {starts[0]} to {starts[-1]}); {fix}")
    return starts


SCAN_CHUNK = 1 << 24
"""Token ids read at a time when a file without a sidecar is checked against the vocabulary (bounded memory)."""


def _check_ids(path: Path, tokens: np.ndarray, vocab_size: int) -> None:
    """Every id of a sidecar-less token file below model.vocab_size, or a ConfigError naming the largest.

    An out-of-range id would index past the embedding table and turn the loss NaN at whatever
    step first reads it. The whole file is read once, in chunks: 8.7 GB/s from the page cache on
    the 2-core CI host (0.5 GB in 0.06 s), the disk's read speed otherwise (a 100 GB corpus on a
    1 GB/s disk: under 2 minutes, once per start). A prepare-data sidecar records the vocabulary
    and skips the scan.
    """
    largest = 0
    for start in range(0, len(tokens), SCAN_CHUNK):
        largest = max(largest, int(tokens[start:start + SCAN_CHUNK].max()))
    if largest >= vocab_size:
        hint = (" (it looks like text, not token ids: data.source=text reads text as bytes)"
                if path.suffix in (".txt", ".md", ".json", ".jsonl", ".csv") else "")
        raise ConfigError(f"data file {path} holds token id {largest}, but model.vocab_size={vocab_size}{hint}: "
                          f"every id must be below the vocabulary (valid: model.vocab_size >= {largest + 1}, "
                          f"the data.token_dtype the file was written with (read as {tokens.dtype}), or data "
                          "written for this model's tokenizer)")


def _doc_spans(starts: np.ndarray, total: int) -> list[tuple[int, int]]:
    bounds = [int(s) for s in starts] + [total]
    return [(a, b) for a, b in itertools.pairwise(bounds) if b > a]
