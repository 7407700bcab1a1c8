"""Keys that moved between config versions: hints for old configs, and old checkpoint records read anew."""

from __future__ import annotations

from typing import Any

MOVED_KEYS = {
    "model.moe_every": "model.moe.every (0: model.moe=null)",
    "model.num_experts": "model.moe.num_experts",
    "model.experts_per_token": "model.moe.experts_per_token",
    "model.moe_d_ff": "model.moe.d_ff",
    "model.num_shared_experts": "model.moe.num_shared_experts",
    "model.router_score": "model.moe.router_score",
    "model.router_aux_weight": "model.moe.router_aux_weight",
    "model.router_z_weight": "model.moe.router_z_weight",
    "model.capacity_factor": "backends.capacity_factor",
    "model.moe_impl": "backends.moe",
    "model.attention": "backends.attention",
    "model.attention_blocks": "backends.attention_blocks",
}
"""Old dotted key -> where it lives now (the MoE keys nested under model.moe, implementations under backends)."""

_FLAT_MOE = {old.removeprefix("model."): new.removeprefix("model.moe.") for old, new in MOVED_KEYS.items()
             if new.startswith("model.moe.") and old != "model.moe_every"}
"""Old flat model key -> its key inside model.moe (`moe_every` aside: it decides whether there is a section)."""


def upgrade_model_section(model: dict[str, Any]) -> dict[str, Any]:
    """A `model` section as written before MoE keys were nested, in today's shape (others pass through).

    Checkpoints record the model section they were saved with; older ones hold `moe_every`,
    `num_experts`, ... at the top and the implementation keys that now live under `backends`.
    """
    out = {k: v for k, v in model.items() if f"model.{k}" not in MOVED_KEYS}
    if "moe_every" in model and "moe" not in model:
        every = model["moe_every"]
        out["moe"] = None if not every else {
            "every": every, **{new: model[old] for old, new in _FLAT_MOE.items() if old in model}}
    return out
