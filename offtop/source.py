"""Where snapshots come from.

The app and the batch printer take any `SnapshotSource`: the BPF engine
(`offtop.bpf.engine.BpfSource`) on a live kernel, or `ReplaySource`, which
plays back recorded snapshots for UI tests and demos. Neither the app nor
the widgets know which one they have.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, TextIO

from offtop.model import Snapshot
from offtop.report import snapshot_from_json


@dataclass(frozen=True, slots=True)
class SourceInfo:
    """What the header says about the capture."""

    host: str
    kernel: str
    scope: str = "all tasks"
    stacks: str = "kernel+user"
    kind: str = "bpf"


class SnapshotSource(Protocol):
    """The interface between data and screen (see module docstring)."""

    @property
    def info(self) -> SourceInfo:
        """Host, kernel, scope and stack mode, for the header."""
        ...

    @property
    def threshold_ns(self) -> int:
        """The current long-block threshold."""
        ...

    def start(self) -> None:
        """Get ready to produce snapshots (may be slow: compiles BPF)."""
        ...

    def next_snapshot(self, interval_s: float, stop: threading.Event) -> Snapshot | None:
        """Block for about `interval_s`, then return that interval's snapshot.

        Returns None when `stop` is set or the source is exhausted. Never
        blocks much longer than the interval, whatever the event rate.
        """
        ...

    def set_threshold(self, ns: int) -> None:
        """Route blocks of `ns` or longer to the event stream, from now on."""
        ...

    def close(self) -> None:
        """Detach and free everything; safe to call twice."""
        ...


def local_info(kind: str, scope: str = "all tasks", stacks: str = "kernel+user") -> SourceInfo:
    """A `SourceInfo` for this machine."""
    return SourceInfo(
        host=platform.node(), kernel=platform.release(), scope=scope, stacks=stacks, kind=kind
    )


class ReplaySource:
    """Plays back recorded snapshots: for UI tests, demos and offline reading.

    `realtime=False` returns each snapshot at once (tests); otherwise it waits
    `interval_s` between them like a live source. Threshold changes are kept
    and stamped onto later snapshots, so the slider behaves as it would live.
    """

    def __init__(
        self,
        snapshots: Sequence[Snapshot],
        *,
        info: SourceInfo | None = None,
        realtime: bool = True,
        loop: bool = False,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._snapshots = list(snapshots)
        self._info = info or SourceInfo(
            host="replay", kernel=platform.release(), kind="replay"
        )
        self._realtime = realtime
        self._loop = loop
        self._clock = clock
        self._index = 0
        self._threshold_ns = self._snapshots[0].threshold_ns if self._snapshots else 500_000_000
        self.threshold_writes: list[int] = []
        self.closed = False

    @classmethod
    def from_jsonl(cls, path: str | os.PathLike[str], **kwargs: object) -> ReplaySource:
        """Load snapshots recorded with `offtop --batch --format json`."""
        with Path(path).open() as f:
            snaps = list(read_jsonl(f))
        return cls(snaps, **kwargs)  # type: ignore[arg-type]

    @property
    def info(self) -> SourceInfo:
        return self._info

    @property
    def threshold_ns(self) -> int:
        return self._threshold_ns

    def start(self) -> None:
        self._index = 0

    def next_snapshot(self, interval_s: float, stop: threading.Event) -> Snapshot | None:
        if self._realtime and stop.wait(interval_s):
            return None
        if stop.is_set() or self.closed:
            return None
        if self._index >= len(self._snapshots):
            if not self._loop or not self._snapshots:
                return None
            self._index = 0
        snap = self._snapshots[self._index]
        self._index += 1
        return dataclasses.replace(snap, threshold_ns=self._threshold_ns)

    def set_threshold(self, ns: int) -> None:
        self._threshold_ns = ns
        self.threshold_writes.append(ns)

    def close(self) -> None:
        self.closed = True


def read_jsonl(lines: Iterable[str] | TextIO) -> Iterable[Snapshot]:
    """Snapshots from JSON lines, skipping blank lines."""
    for line in lines:
        if line.strip():
            yield snapshot_from_json(json.loads(line))
