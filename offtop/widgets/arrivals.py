"""What arrives with snapshots and must not be lost when they collapse.

Snapshots supersede each other (only the newest is shown), but the long
blocks, the counts of events seen and lost, and the notices of every one of
them must reach the screen. The source thread puts them here as each
snapshot comes (`put`); the UI takes what has piled up when it shows one.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass

from offtop.model import LongBlock, Snapshot


@dataclass(frozen=True, slots=True)
class Taken:
    """What piled up since the last `Arrivals.take`."""

    blocks: tuple[LongBlock, ...]
    """The newest long blocks, oldest first (at most `Arrivals.max_blocks`)."""
    seen: int
    """Long blocks that arrived from the kernel, listed or not."""
    lost: int
    """Events the perf ring lost (long blocks never seen)."""
    notices: tuple[str, ...]
    """News about the capture's scope, oldest first."""
    restarted: bool = False
    """A replay jumped (a step back, a seek): the blocks and counts taken
    before belong to another stretch of time, and are to be dropped."""


class Arrivals:
    """A thread-safe backlog of long blocks, counts and notices (see module docstring)."""

    def __init__(self, max_blocks: int = 500, max_notices: int = 50) -> None:
        self.max_blocks = max_blocks
        self._lock = threading.Lock()
        self._blocks: deque[LongBlock] = deque(maxlen=max_blocks)
        self._notices: deque[str] = deque(maxlen=max_notices)
        self._seen = 0
        self._lost = 0
        self._restarted = False

    def put(self, snap: Snapshot) -> None:
        """Queue what one snapshot brought."""
        with self._lock:
            self._blocks.extend(snap.long_blocks)
            # The engine keeps a bounded number of long blocks per interval
            # (a flood would otherwise fill memory): it counts them all.
            self._seen += max(snap.stats.events, len(snap.long_blocks))
            self._lost += snap.stats.lost
            self._notices.extend(snap.notices)

    def restart(self) -> None:
        """Drop the blocks and counts queued, and have the next `take` say so:
        a replay jumped, and what came before is another stretch of time
        (listing it again on a step back would count its blocks twice)."""
        with self._lock:
            self._blocks.clear()
            self._seen = self._lost = 0
            self._restarted = True

    def take(self) -> Taken:
        """Everything queued since the last call."""
        with self._lock:
            taken = Taken(tuple(self._blocks), self._seen, self._lost, tuple(self._notices),
                          self._restarted)
            self._blocks.clear()
            self._notices.clear()
            self._seen = self._lost = 0
            self._restarted = False
        return taken
