"""A bounded map that keeps what was asked for lately: two generations.

`rotate()` starts a new generation; what nobody asked for (`get`) or put
since the rotation before is dropped at the next one, and what is found in
the older generation is moved back into the newer. With process churn,
caches keyed by what a process brought (its stacks, its wakers, its chains)
would otherwise fill up with the processes gone. Every call is one or two
dict operations and a rotation swaps two attributes, so threads may share
one under the GIL: an entry put into a generation just retired is found
there, and moved back, at its next use.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class Recent(Generic[K, V]):
    """See the module docstring; bounded: at `max_kept` entries (both generations),
    a `put` empties it first."""

    def __init__(self, max_kept: int) -> None:
        self._max = max_kept
        self._now: dict[K, V] = {}
        self._before: dict[K, V] = {}  # kept before the last rotate, not asked for since

    def __len__(self) -> int:
        return len(self._now) + len(self._before)

    def missing(self, keys: Iterable[K]) -> int:
        """How many of `keys` are not kept; nothing is moved (as `get` would):
        asking whether is not asking for."""
        now, before = self._now, self._before
        return sum(1 for key in keys if key not in now and key not in before)

    def get(self, key: K) -> V | None:
        """The value kept for `key` (kept on), None if none."""
        value = self._now.get(key)
        if value is None:
            value = self._before.pop(key, None)
            if value is not None:
                self._now[key] = value
        return value

    def get_many(self, keys: Sequence[K]) -> list[V | None]:
        """`get` of each of `keys` (a pass over the newer generation, then `get`
        for those not in it)."""
        found = list(map(self._now.get, keys))
        if self._before and None in found:
            found = [self.get(key) if value is None else value
                     for key, value in zip(keys, found, strict=True)]
        return found

    def put(self, key: K, value: V) -> None:
        if len(self._now) + len(self._before) >= self._max:
            self.clear()
        self._now[key] = value

    def drop(self, unwanted: Callable[[K], bool]) -> None:
        """Forget every key for which `unwanted(key)` (a pass over all that is kept)."""
        self._now = {k: v for k, v in self._now.items() if not unwanted(k)}
        self._before = {k: v for k, v in self._before.items() if not unwanted(k)}

    def rotate(self) -> None:
        self._before, self._now = self._now, {}

    def clear(self) -> None:
        self._now, self._before = {}, {}
