"""What the config checks and the planner know of each optimizer before jax starts: one `OptimizerFacts` each.

An optimizer is two registrations under one name. Its facts, here: the moment settings (optim.b1/b2/eps) it
reads and their defaults, why it refuses the others, and the bytes of state it keeps per parameter, which the
planner counts (`analysis.plan.memory`, no jax). `optim.name`'s values are these names. Its optax
transformation, the code: `train.optimizers` (one module per optimizer, registered by the same name).
tests/test_registries.py checks that the two registries name the same optimizers and that each state-bytes
figure is optax's (docs/howto/add-an-optimizer.md).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from spmd_train.config.mesh_schema import STACKING_AXES
from spmd_train.registry import Registry

MOMENT_KEYS = ("b1", "b2", "eps")
"""optim keys whose meaning and default depend on the optimizer."""
FACTOR_MIN_DIM = 128
"""optax.adafactor's min_dim_size_to_factor (its default; `train.optimizers.adafactor` does not change it)."""

StateBytes = Callable[[tuple[int, ...], tuple[str, ...], tuple[int, ...], int, bool], float]
"""state_bytes(shape, axes, ways, param_bytes, momentum): optimizer-state bytes one device holds for a parameter of
`shape` and logical `axes` whose dimension i is split `ways[i]` ways, stored with `param_bytes` per element;
`momentum`: optim.b1 is set where that adds state (`OptimizerFacts.b1_adds_state`)."""

MATRIX_INPUT_AXES = ("embed", "q_lora_in", "kv_lora_in")
"""Logical axes a weight matrix reads its input along or writes its output to: the residual stream, and MLA's
latents where the query and key/value expansions read them."""
BATCH_AXES = (*STACKING_AXES, "experts")
"""Axes that hold independent matrices side by side: the layer stacks and the routed experts."""


def is_matrix(axes: tuple[str | None, ...]) -> bool:
    """Whether a parameter with these logical axes is a weight matrix (decayed, and orthogonalised by Muon): at
    least two axes besides the `BATCH_AXES`, one of them a `MATRIX_INPUT_AXES`. Not matrices: norm scales, biases
    (Q/K/V's [heads, head_dim] included), attention sinks."""
    own = [a for a in axes if a not in BATCH_AXES]
    return len(own) >= 2 and any(a in MATRIX_INPUT_AXES for a in own)


def muon_dimensions(axes: tuple[str | None, ...]) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """(reduction, output) dimensions of the matrix Muon orthogonalises for a parameter with these logical axes, or
    None where AdamW updates it: every non-matrix, the vocabulary tables (embedding, LM head) and the router, as in
    Jordan et al. 2024 and Liu et al. 2025 (arXiv:2502.16982). A matrix reads along its first axis, or, when its last
    is `embed` (an output projection: attention's wo, the MLPs' down projections), along all the others; the
    `BATCH_AXES` stack independent matrices."""
    if not is_matrix(axes) or "vocab" in axes or "router_experts" in axes:
        return None
    own = [i for i, a in enumerate(axes) if a not in BATCH_AXES]
    reads = own[:-1] if axes[own[-1]] == "embed" else own[:1]
    return tuple(reads), tuple(i for i in own if i not in reads)


@dataclass(frozen=True)
class OptimizerFacts:
    """An optimizer's facts (no code)."""

    name: str
    """optim.name's value, and the name its optax transformation is registered under."""
    defaults: tuple[tuple[str, float | None], ...]
    """The `MOMENT_KEYS` it reads, with the value a null one takes."""
    state_bytes: StateBytes
    """Bytes of its state per parameter and device (its moments kept in model.param_dtype, as optax does)."""
    not_applicable: tuple[tuple[str, str], ...] = ()
    """The `MOMENT_KEYS` it has no use for, and why (setting one is refused)."""
    b1_adds_state: bool = False
    """Setting optim.b1 adds a momentum to its state (a run resumes only with b1 set or unset as it started)."""
    elementwise: bool = False
    """Its update of each parameter element reads only that element's gradient, state and value (and the step count),
    so the state can be updated a slice at a time (offload.optimizer); Adafactor's factored moments and Muon's
    orthogonalisation read whole matrices."""


_FACTS: Registry[OptimizerFacts] = Registry("optimizer")


def register_optimizer_facts(facts: OptimizerFacts) -> OptimizerFacts:
    """Add an optimizer's facts (ValueError for a name already taken, or moment keys not accounted for)."""
    named = [k for k, _ in facts.defaults] + [k for k, _ in facts.not_applicable]
    if sorted(named) != sorted(MOMENT_KEYS):
        raise ValueError(f"optimizer {facts.name!r}: defaults and not_applicable name {named}, not each of "
                         f"{MOMENT_KEYS} once")
    return _FACTS.add(facts)


def optimizer_facts(name: str) -> OptimizerFacts:
    """The facts of optimizer `name` (KeyError for an unknown name)."""
    return _FACTS[name]


def optimizer_names() -> tuple[str, ...]:
    """Every registered optimizer, in registration order (the order the schema and messages list them in)."""
    return _FACTS.names()


NEWTON_SCHULZ = (3.4445, -4.7750, 2.0315)
"""Muon's quintic step X <- a X + (b A + c A²) X, A = X Xᵀ (Jordan et al. 2024): its coefficients push every singular
value of a Frobenius-normalised matrix into about [0.7, 1.2] in NEWTON_SCHULZ_STEPS steps."""
NEWTON_SCHULZ_STEPS = 5


def newton_schulz_flops(rows: int, cols: int) -> float:
    """FLOPs of orthogonalising one rows x cols matrix: per step, with m <= n its sides, X Xᵀ (2m²n), A² (2m³) and
    the product with X (2m²n)."""
    m, n = sorted((rows, cols))
    return NEWTON_SCHULZ_STEPS * (4 * m * m * n + 2 * m ** 3)


def _moments(count: int) -> StateBytes:
    """`count` arrays the parameter's shape and layout (optax.adamw: mu and nu; optax.lion: mu)."""
    def state_bytes(shape: tuple[int, ...], axes: tuple[str, ...], ways: tuple[int, ...], param_bytes: int,
                    momentum: bool) -> float:
        return count * (math.prod(shape) / math.prod(ways)) * param_bytes
    return state_bytes


def _muon_bytes(shape: tuple[int, ...], axes: tuple[str, ...], ways: tuple[int, ...], param_bytes: int,
                momentum: bool) -> float:
    """Muon's momentum for the matrices it orthogonalises (`muon_dimensions`), AdamW's two moments elsewhere."""
    count = 1 if muon_dimensions(axes) is not None else 2
    return count * (math.prod(shape) / math.prod(ways)) * param_bytes


def _adafactor_bytes(shape: tuple[int, ...], axes: tuple[str, ...], ways: tuple[int, ...], param_bytes: int,
                     momentum: bool) -> float:
    """optax.adafactor: a row and a column vector per matrix whose two largest dimensions are >= FACTOR_MIN_DIM
    (`_factored_dims`), else a full second moment; (1,) placeholders; an fp32 momentum when optim.b1 is set."""
    local = math.prod(shape) / math.prod(ways)
    extra = 4 * local if momentum else 0.0
    dims = sorted(range(len(shape)), key=lambda i: shape[i])  # optax: np.argsort of the shape
    if len(shape) < 2 or shape[dims[-2]] < FACTOR_MIN_DIM:
        return (local + 3) * param_bytes + extra  # v, and (1,) placeholders for update, v_row, v_col
    factored = 0.0
    for drop in (dims[-1], dims[-2]):  # v_row drops the largest dimension, v_col the second largest
        kept = shape[:drop] + shape[drop + 1:]
        # `train.optimizer.state_sharding` does not know which dimension was reduced: it drops the split of the
        # last dimension whose removal gives this shape (for two equal dimensions, maybe not the reduced one).
        gone = max(i for i in range(len(shape)) if shape[:i] + shape[i + 1:] == kept)
        factored += math.prod(n // ways[i] for i, n in enumerate(shape) if i != gone)
    return (factored + 2) * param_bytes + extra  # (1,) placeholders for update and v


register_optimizer_facts(OptimizerFacts("adamw", (("b1", 0.9), ("b2", 0.95), ("eps", 1e-8)), _moments(2),
                                        elementwise=True))
register_optimizer_facts(OptimizerFacts(
    "adafactor", (("b1", None),), _adafactor_bytes, b1_adds_state=True,  # Shazeer & Stern 2018: no first moment
    not_applicable=(("b2", "Adafactor's second-moment decay is 1 - t^-0.8, set by the step"),
                    ("eps", "Adafactor's epsilon (1e-30) is added to the squared gradient, another quantity"))))
register_optimizer_facts(OptimizerFacts(
    "lion", (("b1", 0.9), ("b2", 0.99)), _moments(1),  # Chen et al. 2023 (optax's defaults)
    not_applicable=(("eps", "Lion's update is the sign of a momentum; it divides by nothing"),), elementwise=True))
register_optimizer_facts(OptimizerFacts(
    # b1: Muon's Nesterov momentum; b2, eps: the AdamW that updates the tables, the router and the vectors (its b1 is
    # AdamW's 0.9). Liu et al. 2025 (Moonlight): momentum 0.95, AdamW betas (0.9, 0.95).
    "muon", (("b1", 0.95), ("b2", 0.95), ("eps", 1e-8)), _muon_bytes))
