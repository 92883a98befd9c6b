"""Splicing a thread's Python frames into its native user stack, as `py-spy dump --native` does.

Each C-level call of the interpreter's evaluation loop,
`_PyEval_EvalFrameDefault`, runs one or more Python frames: exactly one in
3.8-3.10 (a frame object per call), and in 3.11+ a run of frames called
Python-to-Python without leaving the loop, the outermost of which is
marked (`_PyInterpreterFrame.is_entry` in 3.11, a shim frame owned by the
C stack in 3.12+; `PyFrame.entry` here). Both stacks are innermost first,
so the n-th evaluation frame of the native stack is replaced by the n-th
run of Python frames.

A native stack with fewer evaluation frames than runs (unwinding stopped
early: no frame pointers, a JIT, a truncated capture) gets the runs left
over after its last frame, behind a `MARK_PYTHON_UNPLACED` marker; one with
more keeps the extra evaluation frames as they are.

A thread waiting for the GIL has `take_gil` (or a caller of it) between
its innermost frame and its innermost evaluation frame; that, or the
reader's own finding (`PyThread.waits_for_gil`, from the futex it sleeps
on, which works where the native stack is too short to show it), puts a
`MARK_GIL_WAIT` marker innermost and sets `gil_wait`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from offtop.pystacks.model import PyFrame

#: Behind it, Python frames that no evaluation frame of the native stack took.
MARK_PYTHON_UNPLACED = "[python frames; native stack ends before the interpreter]"
#: Innermost in the merged stack of a thread that waits for the GIL.
MARK_GIL_WAIT = "[waiting for the GIL]"

#: The evaluation loop: one C call of it runs a run of Python frames.
EVAL_FRAME_FUNCTIONS = frozenset({"_PyEval_EvalFrameDefault"})
#: Functions a thread is in while it waits to take the GIL back (3.8-3.13).
GIL_WAIT_FUNCTIONS = frozenset({
    "take_gil", "drop_gil", "PyEval_RestoreThread", "PyEval_AcquireThread", "PyEval_AcquireLock",
    "PyGILState_Ensure", "_PyThreadState_Attach", "_PyEval_AcquireLock",
})


class NamedFrame(Protocol):
    """A native frame: anything with a function name (offtop.model.Frame is one)."""

    @property
    def name(self) -> str:
        """The function's name, as the symbolizer gave it."""
        ...


N = TypeVar("N", bound=NamedFrame)


@dataclass(frozen=True, slots=True)
class StackMarker:
    """A frame that is not code but a note about the stack (`MARK_*`)."""

    name: str


@dataclass(frozen=True, slots=True)
class MergedStack(Generic[N]):
    """A native stack with Python frames spliced in, innermost first."""

    frames: tuple[N | PyFrame | StackMarker, ...]
    gil_wait: bool
    placed: int
    """Python frames put where their evaluation frames were."""
    unplaced: int
    """Python frames put after the native stack, behind MARK_PYTHON_UNPLACED."""


def _function(name: str) -> str:
    # GCC's split and cloned parts: _PyEval_EvalFrameDefault.cold, take_gil.lto_priv.0.
    return name.split(".", 1)[0]


def is_eval_frame(name: str) -> bool:
    """True for a native frame of the interpreter's evaluation loop."""
    return _function(name) in EVAL_FRAME_FUNCTIONS


def is_gil_frame(name: str) -> bool:
    """True for a native frame of a function that waits for the GIL."""
    return _function(name) in GIL_WAIT_FUNCTIONS


def _runs(python: Sequence[PyFrame]) -> list[list[PyFrame]]:
    """Python frames cut after each `entry` frame: one run per C call of the evaluation loop."""
    runs: list[list[PyFrame]] = []
    current: list[PyFrame] = []
    for f in python:
        current.append(f)
        if f.entry:
            runs.append(current)
            current = []
    if current:
        runs.append(current)
    return runs


def merge_stacks(native: Sequence[N], python: Sequence[PyFrame], *,
                 gil_wait: bool | None = None, mark_gil_wait: bool = True) -> MergedStack[N]:
    """`native` (innermost first) with `python` (innermost first) spliced in; see the module docstring.

    `gil_wait` is what the reader found (`PyThread.waits_for_gil`); the
    native frames are looked at too. With `mark_gil_wait`, a GIL wait is
    also shown as a marker frame, innermost.
    """
    runs = _runs(python)
    out: list[N | PyFrame | StackMarker] = []
    used = 0
    placed = 0
    seen_eval = False
    waits = bool(gil_wait)
    for frame in native:
        if is_eval_frame(frame.name):
            seen_eval = True
            if used < len(runs):
                out.extend(runs[used])
                placed += len(runs[used])
                used += 1
                continue
        elif not seen_eval and is_gil_frame(frame.name):
            waits = True
        out.append(frame)
    unplaced = sum(len(r) for r in runs[used:])
    if unplaced:
        out.append(StackMarker(MARK_PYTHON_UNPLACED))
        for run in runs[used:]:
            out.extend(run)
    if waits and mark_gil_wait:
        out.insert(0, StackMarker(MARK_GIL_WAIT))
    return MergedStack(frames=tuple(out), gil_wait=waits, placed=placed, unplaced=unplaced)
