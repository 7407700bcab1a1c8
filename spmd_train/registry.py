"""A name -> entry table that each extension point (model families, attention implementations, pipeline
schedules, optimizers) keeps once: entries are registered by the module that defines them, at import."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    """Entries of one kind by name, in registration order; a name is registered once."""

    def __init__(self, kind: str, key: Callable[[T], str] = lambda entry: entry.name, reserved: tuple[str, ...] = ()):
        self.kind, self._key, self._reserved = kind, key, reserved
        self._entries: dict[str, T] = {}

    def add(self, entry: T) -> T:
        """Register `entry` under its name (ValueError for a name already taken or reserved); returns it."""
        name = self._key(entry)
        if name in self._entries or name in self._reserved:
            raise ValueError(f"{self.kind} {name!r} is registered twice or reserved")
        self._entries[name] = entry
        return entry

    def __getitem__(self, name: str) -> T:
        return self._entries[name]

    def get(self, name: object, default: T | None = None) -> T | None:
        """The entry registered as `name`, else `default`."""
        return self._entries.get(name, default)  # type: ignore[arg-type]

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[T]:
        return iter(self._entries.values())

    def names(self) -> tuple[str, ...]:
        """The registered names, in registration order (the order messages list them in)."""
        return tuple(self._entries)
