"""A name -> entry registry, for the pluggable pieces (codecs, algorithms): Horovod's small
``Compressor`` namespace, with checks.

Entries register under their own ``name`` attribute; the built-in ones first, so ``names()``
lists them first. Not thread-safe: register at import time.
"""

from __future__ import annotations

from typing import Callable, Generic, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    """The entries of one kind (``kind``: "codec", "algorithm"), each accepted by ``accepts``."""

    def __init__(self, kind: str, accepts: Callable[[object], bool], expected: str):
        self._kind = kind
        self._accepts = accepts
        self._expected = expected
        self._entries: dict[str, T] = {}

    def register(self, entry: T) -> T:
        """Makes ``entry`` available by its ``name``; returns it (usable as a decorator).

        Raises TypeError for an entry of the wrong kind, ValueError for an empty name or one
        another entry has.
        """
        if not self._accepts(entry):
            raise TypeError(f"tf_poseidon: a {self._kind} registry takes {self._expected}, "
                            f"got {entry!r}")
        name = getattr(entry, "name", None)
        if not isinstance(name, str) or not name:
            raise ValueError(f"{self._kind} {entry!r} needs a non-empty 'name' to be registered")
        if self._entries.get(name, entry) is not entry:
            raise ValueError(f"a {self._kind} named {name!r} is registered already")
        self._entries[name] = entry
        return entry

    def names(self) -> tuple[str, ...]:
        """The registered names, in registration order."""
        return tuple(self._entries)

    def get(self, name: str) -> T | None:
        """The entry registered as ``name``, None if there is none."""
        return self._entries.get(name) if isinstance(name, str) else None

    def entries(self) -> tuple[T, ...]:
        return tuple(self._entries.values())
