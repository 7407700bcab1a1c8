"""`Trainer.show_sharding`: which device holds which part of a parameter, drawn by jax."""

from __future__ import annotations

import difflib
from typing import Any

import jax

from spmd_train.errors import ConfigError


def show_param_sharding(params: dict[str, Any], name: str) -> None:
    """Draw the sharding of the parameter at dotted path `name` ('embedding', 'blocks.mlp.w_up') of `params`.

    jax draws 1-D and 2-D arrays: stacked layer weights show layer 0, and trailing axes are
    folded into the last so the split axes stay visible.
    """
    leaf = params
    for part in name.split("."):
        if not isinstance(leaf, dict) or part not in leaf:
            names = _dotted_paths(params)
            close = difflib.get_close_matches(name, names, n=3, cutoff=0.5)
            raise ConfigError(f"show_sharding({name!r}): no such parameter"
                              + (f"; did you mean {', '.join(map(repr, close))}?" if close else "")
                              + f" (valid: {', '.join(names)})")
        leaf = leaf[part]
    if name.startswith("blocks."):
        leaf = leaf[0]
    if leaf.ndim > 2:
        leaf = leaf.reshape(leaf.shape[0], -1)
    jax.debug.visualize_array_sharding(leaf)


def _dotted_paths(tree: dict, prefix: str = "") -> list[str]:
    """'blocks.mlp.w_up' for every leaf of a nested dict of parameters."""
    out = []
    for key, value in tree.items():
        path = f"{prefix}.{key}" if prefix else str(key)
        out.extend(_dotted_paths(value, path) if isinstance(value, dict) else [path])
    return out
