"""ZB-V (Qi et al., "Pipeline Parallelism with Controllable Memory", 2024; ZB paper Sec. 6): device d holds chunks d
and 2p-1-d (the "v" placement), backward split into B and W.

Its order comes from a greedy tick-by-tick run under 1F1B's activation budget (2p chunk-activations, i.e. p
whole-stage microbatches): an input gradient B when one is ready, else a forward (the second leg first) within the
budget, else a deferred W.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from spmd_train.parallel.schedule_registry import Inputs, OpTuple, ScheduleOrder, register_schedule


def zb_v_orders(p: int, m: int, v: int, inputs: Inputs) -> list[list[OpTuple]]:
    """ZB-V's op order for each of p devices (chunks d and 2p-1-d, v = 2), from a greedy run under 1F1B's memory."""
    devices = [_VDevice(d, p, m) for d in range(p)]
    done: dict[OpTuple, int] = {}
    tick = 0
    while not all(dev.finished for dev in devices):
        def ready(op: OpTuple, tick: int = tick) -> bool:
            return all(done.get(dep, tick) < tick for dep in inputs(op))

        picks = [dev.pick(ready) for dev in devices]
        if not any(picks):  # the budget reserves room for every started microbatch, so this cannot happen
            raise RuntimeError(f"zb_v greedy deadlocks at tick {tick}")
        for dev, op in zip(devices, picks, strict=True):
            if op is not None:
                dev.run(op)
                done[op] = tick
        tick += 1
    return [dev.order for dev in devices]


class _VDevice:
    """One device of the V: its two chunks' progress, deferred W's and chunk-activations held."""

    def __init__(self, d: int, p: int, m: int):
        self.first, self.second, self.m = d, 2 * p - 1 - d, m
        self.budget = 2 * p  # chunk-activations, F until W: 1F1B's p whole-stage microbatches
        self.next = {(kind, c): 0 for kind in "FB" for c in (self.first, self.second)}
        self.deferred: deque[OpTuple] = deque()
        self.held = 0
        self.order: list[OpTuple] = []

    @property
    def finished(self) -> bool:
        return len(self.order) == 6 * self.m

    def _next(self, kind: str, chunk: int) -> OpTuple | None:
        i = self.next[(kind, chunk)]
        return (kind, i, chunk) if i < self.m else None

    def pick(self, ready: Callable[[OpTuple], bool]) -> OpTuple | None:
        # B is on the critical path (the previous chunk waits for it); the lower microbatch first.
        bs = [op for op in (self._next("B", self.second), self._next("B", self.first)) if op and ready(op)]
        if bs:
            return min(bs, key=lambda op: op[1])
        # A second-leg forward brings a microbatch to the loss; a first-leg one also reserves a slot for
        # its second leg, so the budget never fills with microbatches that cannot reach their backward.
        pending_second = self.next[("F", self.first)] - self.next[("F", self.second)]
        second, first = self._next("F", self.second), self._next("F", self.first)
        if second and ready(second) and self.held < self.budget:
            return second
        if first and ready(first) and self.held + 2 + pending_second <= self.budget:
            return first
        return self.deferred[0] if self.deferred else None  # W fills what would be idle

    def run(self, op: OpTuple) -> None:
        kind, _, chunk = op
        self.order.append(op)
        if kind == "W":
            self.deferred.popleft()
            self.held -= 1
            return
        self.next[(kind, chunk)] += 1
        if kind == "F":
            self.held += 1
        else:
            self.deferred.append(("W", op[1], chunk))


register_schedule(ScheduleOrder("zb_v", zb_v_orders))
