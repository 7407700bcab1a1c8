"""Which tier a test case runs in. `make test` (the fast tier) leaves out every test marked `slow`, `tpu_aot`,
`multiprocess` or `faults` (pyproject.toml); `make test-all` runs them all.

A grid of cases that proves one property many ways keeps one or a few cases in the fast tier and the rest in the
slow one: `fast_cases` marks them, so the grid itself stays written once.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import pytest


def fast_cases(values: Iterable[Any], fast: Iterable[Any], ids: Callable[[Any], str] | None = None,
               several: bool = False) -> list:
    """`values` as pytest params, those whose id is in `fast` in the fast tier and the others marked slow
    (`several`: each value is a tuple of several arguments, as for `parametrize(("a", "b"), ...)`)."""
    fast = {str(f) for f in fast}
    values = list(values)
    names = [ids(v) if ids else v if isinstance(v, str) else str(v) for v in values]
    unknown = fast - set(names)
    assert not unknown, f"fast_cases names cases the grid does not have: {sorted(unknown)} (ids: {names})"
    return [pytest.param(*(v if several else (v,)), id=name,
                         marks=() if name in fast else pytest.mark.slow) for v, name in zip(values, names, strict=True)]
