"""Off-CPU profiles in speedscope's file format (https://www.speedscope.app).

The document follows speedscope's published schema
(`https://www.speedscope.app/file-format-schema.json`):

- `shared.frames`: every distinct frame once, `{"name", "file"}`, where
  `file` is the module (`kernel`, `libc.so.6`, the binary);
- one **sampled** profile per process, heaviest first (and shown first): one
  sample per (thread, state, stack), frames outermost first, weighted by its
  off-CPU time in nanoseconds (`unit: "nanoseconds"`);
- one **evented** profile per thread that had long blocks: each block opens
  its frames when it began and closes them when it ended, relative to the
  start of the run, so speedscope's time-order view is a timeline of that
  thread's long waits.

Names are exact: the JSON encoder escapes whatever a process put in its comm
or symbols, nothing is ever evaluated by speedscope.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from offtop import __version__
from offtop.export.accumulator import NO_STACK, ProfileData, StackTotal
from offtop.model import Frame, LongBlock

SCHEMA = "https://www.speedscope.app/file-format-schema.json"


class _Frames:
    """The shared frame table."""

    def __init__(self) -> None:
        self.index: dict[tuple[str, str, bool], int] = {}
        self.frames: list[dict[str, Any]] = []

    def __call__(self, f: Frame) -> int:
        key = (f.name, f.module, f.kernel)
        i = self.index.get(key)
        if i is None:
            i = self.index[key] = len(self.frames)
            entry: dict[str, Any] = {"name": f.name}
            if f.module:
                entry["file"] = f.module
            self.frames.append(entry)
        return i


def _process_name(stacks: Sequence[StackTotal]) -> str:
    pid = stacks[0].pid
    main = next((s.comm for s in stacks if s.tid == pid and s.comm), None)
    comm = main or next((s.comm for s in stacks if s.comm), "?")
    return f"{comm} (pid {pid})" if pid else comm


def _sampled(name: str, stacks: Sequence[StackTotal], frames: _Frames) -> dict[str, Any]:
    samples = [[frames(f) for f in reversed(s.frames)] for s in stacks]
    weights = [s.offcpu_ns for s in stacks]
    return {
        "type": "sampled",
        "name": name,
        "unit": "nanoseconds",
        "startValue": 0,
        "endValue": sum(weights),
        "samples": samples,
        "weights": weights,
    }


def _evented(name: str, blocks: Sequence[LongBlock], start: float, end: float,
             frames: _Frames) -> dict[str, Any]:
    """A thread's long blocks as nested open/close events.

    A thread is blocked at most once at a time, so its blocks never overlap;
    clock rounding can make two touch out of order by a few nanoseconds,
    which is clamped so that event times never go backwards (speedscope
    requires that).
    """
    events: list[dict[str, Any]] = []
    spans = sorted(
        (round((b.time - start) * 1e9) - b.duration_ns, round((b.time - start) * 1e9), b)
        for b in blocks
    )
    last = spans[0][0] if spans else 0
    first = last
    for begin, finish, b in spans:
        begin = max(begin, last)
        finish = max(finish, begin)
        chain = [frames(f) for f in reversed((b.kernel + b.user) or (NO_STACK,))]
        events += [{"type": "O", "frame": i, "at": begin} for i in chain]
        events += [{"type": "C", "frame": i, "at": finish} for i in reversed(chain)]
        last = finish
    return {
        "type": "evented",
        "name": name,
        "unit": "nanoseconds",
        "startValue": min(0, first),
        "endValue": max(last, round((end - start) * 1e9)),
        "events": events,
    }


def speedscope_document(data: ProfileData, *, name: str = "offtop off-CPU") -> dict[str, Any]:
    """`data` as a speedscope file (a JSON-ready dict)."""
    frames = _Frames()
    by_pid: dict[int, list[StackTotal]] = {}
    for s in data.stacks:
        if s.offcpu_ns > 0:
            by_pid.setdefault(s.pid, []).append(s)
    procs = sorted(by_pid.values(), key=lambda ss: (-sum(s.offcpu_ns for s in ss), ss[0].pid))
    profiles = [_sampled(_process_name(ss), ss, frames) for ss in procs]
    by_tid: dict[int, list[LongBlock]] = {}
    for b in data.long_blocks:
        by_tid.setdefault(b.tid, []).append(b)
    for tid, blocks in sorted(by_tid.items()):
        b0 = blocks[-1]
        label = f"long blocks: {b0.comm} {b0.pid}" + (f"/{tid}" if tid != b0.pid else "")
        profiles.append(_evented(label, blocks, data.start, data.end, frames))
    return {
        "$schema": SCHEMA,
        "shared": {"frames": frames.frames},
        "profiles": profiles,
        "name": name,
        "activeProfileIndex": 0,
        "exporter": f"offtop@{__version__}",
    }


def speedscope_json(data: ProfileData, *, name: str = "offtop off-CPU") -> str:
    """`data` as speedscope JSON text (ASCII, every untrusted string escaped)."""
    return json.dumps(speedscope_document(data, name=name), separators=(",", ":"))
