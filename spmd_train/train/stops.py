"""Where generation stops besides max_new_tokens: a run's end-of-text ids (what `spmd-train generate` stops at by
default), and stop strings, which are matched on the host in the decoded text after generating.

Details: docs/generate.md#when-generation-stops
"""

from __future__ import annotations

import glob
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from spmd_train.config.schema import Config
from spmd_train.errors import ConfigError


def hf_end_ids(directory: str | Path) -> tuple[int, ...]:
    """A Hugging Face checkpoint's end-of-text ids: generation_config.json's eos_token_id (an int or a list), else
    config.json's; () when neither names one."""
    for name in ("generation_config.json", "config.json"):
        path = Path(directory) / name
        if not path.is_file():
            continue
        try:
            value = json.loads(path.read_text()).get("eos_token_id")
        except (OSError, ValueError, AttributeError) as err:
            raise ConfigError(f"{path} cannot be read as a JSON object ({type(err).__name__}: {err})") from None
        ids = value if isinstance(value, list) else [] if value is None else [value]
        if any(not isinstance(t, int) or isinstance(t, bool) or t < 0 for t in ids):
            raise ConfigError(f"{path}: eos_token_id={value!r} (valid: a token id, a list of them, or null)")
        if ids:
            return tuple(dict.fromkeys(ids))
    return ()


def sidecar(paths: Sequence[str]) -> dict[str, Any]:
    """What `prepare-data` recorded beside the first token file (NAME.json): {} when there is none or it is
    unreadable (training has refused an unreadable one already)."""
    if not paths:
        return {}
    files = sorted(glob.glob(paths[0])) or [paths[0]]
    try:
        meta = json.loads(Path(files[0]).with_suffix(".json").read_text())
    except (OSError, ValueError):
        return {}
    return meta if isinstance(meta, dict) else {}


def run_end_ids(cfg: Config) -> tuple[tuple[int, ...], str | None]:
    """(a run's end-of-text ids, where they come from): for checkpoint.load_from=hf:DIR, DIR's (`hf_end_ids`); else
    for token files data.eot_id or the first file's sidecar's eot_id; none for bytes (data.source=text) or Markov
    tokens, which have no end-of-text token."""
    load_from = cfg.checkpoint.load_from or ""
    if load_from.startswith("hf:"):
        ids = hf_end_ids(load_from[3:])
        if ids:
            return ids, f"eos_token_id of {load_from[3:]}'s generation_config.json or config.json"
    if cfg.data.source == "tokens":
        if cfg.data.eot_id is not None:
            return (cfg.data.eot_id,), "data.eot_id"
        eot = sidecar(cfg.data.paths).get("eot_id")
        if isinstance(eot, int) and not isinstance(eot, bool):
            return (eot,), f"eot_id of {cfg.data.paths[0]}'s prepare-data sidecar"
    return (), None


def cut_at_stop_strings(tokens: list[int], decode: Callable[[list[int]], str],
                        stops: Sequence[str]) -> tuple[list[int], str, bool]:
    """(tokens, text, whether a stop string was found): `decode(tokens)` cut before the first occurrence of any of
    `stops` (which is dropped), and the tokens cut to the fewest whose text begins with what is kept (a token that
    straddles the cut, holding the kept text's end and the stop string's start, stays)."""
    text = decode(tokens)
    found = [at for at in (text.find(s) for s in stops) if at >= 0]
    if not found:
        return tokens, text, False
    kept = text[: min(found)]
    # Bisection: a prefix's text grows with the prefix (a decoder may show an incomplete character as U+FFFD
    # until its last byte comes, which at worst keeps one token more).
    lo, hi = 0, len(tokens)
    while lo < hi:
        mid = (lo + hi) // 2
        if decode(tokens[:mid]).startswith(kept):
            hi = mid
        else:
            lo = mid + 1
    return tokens[:lo], kept, True


def finish_rows(tokens: Sequence[list[int]], finish: Sequence[str], decode: Callable[[list[int]], str] | None,
                stops: Sequence[str]) -> tuple[list[list[int]], list[str] | None, list[str]]:
    """Each row's tokens, text (None without a `decode`) and how it ended ("stop id", "stop string", "length"), from
    `generate`'s tokens and finish and the stop strings: a row's text leaves out its stop id (its tokens keep it), and
    a stop string cuts both (`cut_at_stop_strings`)."""
    tokens, finish = [list(t) for t in tokens], list(finish)
    if decode is None:
        return tokens, None, finish
    texts = []
    for i, row in enumerate(tokens):
        body = row[:-1] if finish[i] == "stop id" else row
        cut, text, found = cut_at_stop_strings(body, decode, stops)
        if found:
            tokens[i], finish[i] = cut, "stop string"
        texts.append(text)
    return tokens, texts, finish


def check_stop_strings(stops: Sequence[str]) -> None:
    """Refuse an empty stop string (it would match before the first token)."""
    for s in stops:
        if not s:
            raise ConfigError("--stop '' is empty (valid: a non-empty string, e.g. --stop $'\\n\\n')")
