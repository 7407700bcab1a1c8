"""What the config checks know of each pipeline schedule before jax starts: one `ScheduleFacts` per schedule.

A schedule is two registrations under one name. Its facts, here: where its chunks live, whether its backward
splits into B and W, how many chunks per stage and microbatches it needs, and how its bubble is stated. The
schema's `parallel.pipeline_schedule` values, the layout rules of `config.validity` and the reports read them.
Its op order, the code: `parallel.pipeline_schedules` (one module per schedule, registered by the same name).
tests/test_registries.py checks that the two registries name the same schedules (docs/howto/add-a-pipeline-schedule.md).
"""

from __future__ import annotations

from dataclasses import dataclass

from spmd_train.registry import Registry

PLACEMENTS = ("loop", "v")
"""Where chunk c runs: "loop" on stage c % stages; "v" on stage c for c < stages, else 2 * stages - 1 - c."""


@dataclass(frozen=True)
class ScheduleFacts:
    """A pipeline schedule's facts (no code): its placement, backward, chunk and microbatch rules and bubble."""

    name: str
    """parallel.pipeline_schedule's value, and the name its op order is registered under."""
    placement: str = "loop"
    """One of `PLACEMENTS`."""
    split_backward: bool = False
    """Backward is B (input gradient) then W (weight gradient), run by `parallel.pipeline_split`; else one fused B."""
    min_virtual: int = 1
    """Fewest chunks per stage (parallel.virtual_stages); also `spmd-train schedule`'s default."""
    max_virtual: int | None = 1
    """Most chunks per stage (None: no limit)."""
    virtual_refusal: str = ""
    """The end of the refusal when parallel.virtual_stages is out of range: why, and what is valid (a schedule of
    one chunk per stage needs none)."""
    fill: str = ""
    """Why the schedule needs at least as many microbatches as stages ("": it runs with fewer)."""
    groups: bool = False
    """Microbatches come in groups of `stages` (their count a multiple of mesh.pipeline)."""
    bubble_exact: bool = True
    """Its tick table attains the closed-form bubble (p-1)/(k*v*m+p-1), k = 3 split, 1 fused; else a lower bound."""
    unit_bubble: str = ""
    """Idle time units per stage (F = 1) as `spmd-train schedule` states it: a format of {p1} = p-1, {p3} = 3(p-1)."""

    def __post_init__(self):
        if self.placement not in PLACEMENTS:
            raise ValueError(f"schedule {self.name!r}: placement {self.placement!r} is not one of {PLACEMENTS}")


_FACTS: Registry[ScheduleFacts] = Registry("pipeline schedule")
register_schedule_facts = _FACTS.add
"""Add a schedule's facts (ValueError for a name already taken)."""


def schedule_facts(name: str) -> ScheduleFacts:
    """The facts of schedule `name`; an unregistered name gets the defaults (one fused chunk per stage, loop)."""
    return _FACTS.get(name) or ScheduleFacts(name)


def schedule_names() -> tuple[str, ...]:
    """Every registered schedule, in registration order (the order messages list them in)."""
    return _FACTS.names()


def names_where(**facts: object) -> tuple[str, ...]:
    """The registered schedules whose facts have these values, e.g. names_where(split_backward=True)."""
    return tuple(f.name for f in _FACTS if all(getattr(f, k) == v for k, v in facts.items()))


def spoken(names: tuple[str, ...], last: str = "and") -> str:
    """Names as a sentence lists them: "a", "a and b", "a, b and c"."""
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} {last} {names[-1]}"


register_schedule_facts(ScheduleFacts("gpipe", unit_bubble="formula 3(p-1) = {p3}"))
register_schedule_facts(ScheduleFacts("1f1b", fill="1F1B needs at least as many microbatches as stages",
                                      unit_bubble="formula 3(p-1) = {p3}"))
register_schedule_facts(ScheduleFacts(
    "interleaved_1f1b", min_virtual=2, max_virtual=None, groups=True,
    virtual_refusal=(", which gives each stage several chunks of layers (valid: >= 2, or "
                     "parallel.pipeline_schedule=1f1b or gpipe)")))
register_schedule_facts(ScheduleFacts(
    "zb_h1", split_backward=True, fill="ZB-H1 (1F1B's warm-up) needs at least as many microbatches as stages",
    unit_bubble="formula (p-1) = {p1}, 1F1B's is 3(p-1) = {p3}"))
register_schedule_facts(ScheduleFacts(
    "zb_v", placement="v", split_backward=True, min_virtual=2, max_virtual=2,
    virtual_refusal=": a V schedule runs exactly 2 chunks per stage (valid: 2), so set parallel.virtual_stages=2",
    fill="ZB-V needs at least as many microbatches as stages to fill the V before its first backward",
    bubble_exact=False, unit_bubble="lower bound (p-1) = {p1}"))
