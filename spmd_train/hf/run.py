"""A run started from a Hugging Face checkpoint: import its weights, and remember its config.json for export."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jax

from spmd_train.config.hf_config import read_hf_config
from spmd_train.errors import ConfigError
from spmd_train.hf.import_params import load_hf_params

RECORD = "hf_config.json"
"""In run.dir: the imported checkpoint's directory and config.json (export keeps its other fields)."""


def import_hf(engine, directory: Path, run_dir: Path) -> Any:
    """checkpoint.load_from=hf:DIR: the checkpoint's parameters in `engine`'s layout, its config recorded in run_dir."""
    hf = read_hf_config(directory)
    _check_tokenizer(directory, engine.cfg.model.vocab_size)
    params = load_hf_params(engine, directory)
    if jax.process_index() == 0:
        record = {"source": str(Path(directory).resolve()), "config": hf}
        (Path(run_dir) / RECORD).write_text(json.dumps(record, indent=2) + "\n")
    return params


def recorded_config(run_dir: str | Path) -> dict[str, Any] | None:
    """The config.json a run was imported from (None for a run trained from scratch)."""
    path = Path(run_dir) / RECORD
    return json.loads(path.read_text())["config"] if path.is_file() else None


def recorded_source(run_dir: str | Path) -> Path | None:
    """The directory a run was imported from (None for a run trained from scratch)."""
    path = Path(run_dir) / RECORD
    return Path(json.loads(path.read_text())["source"]) if path.is_file() else None


def tokenizer_vocab_size(directory: Path) -> int | None:
    """1 + the largest token id of DIR/tokenizer.json (its vocabulary and added tokens), or None without one."""
    path = Path(directory) / "tokenizer.json"
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
        ids = list((data.get("model") or {}).get("vocab", {}).values())
        ids += [t["id"] for t in data.get("added_tokens") or []]
    except (OSError, ValueError, TypeError, AttributeError, KeyError) as err:
        raise ConfigError(f"{path} is not a readable tokenizer.json: {err}") from None
    return max(ids) + 1 if ids else None


def _check_tokenizer(directory: Path, vocab_size: int) -> None:
    size = tokenizer_vocab_size(directory)
    if size is not None and size > vocab_size:
        raise ConfigError(f"{directory / 'tokenizer.json'} has token ids up to {size - 1}, more than the model's "
                          f"vocabulary of model.vocab_size={vocab_size} (valid: a vocab_size of at least {size})")
