"""What a read of a Python process gives: frozen frames, threads and a process result."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field

#: Why a process's Python stacks could not be read, or not all of them.
NOT_PYTHON = "not python"
"""No mapped file defines `_PyRuntime` (or the process is gone)."""
UNSUPPORTED = "unsupported version"
"""A CPython older than 3.8, newer than 3.13, free-threaded, or of unknown version."""
READ_FAILED = "read failed"
"""process_vm_readv failed on the interpreter's own state (not permitted, gone)."""
INCONSISTENT = "inconsistent"
"""Memory is not what the layout says: garbage, a chain that loops, a torn read."""
TIME_LIMIT = "time limit"
"""The read ran out of its time budget; what was read by then is returned."""

FAILURE_CAUSES = (NOT_PYTHON, UNSUPPORTED, READ_FAILED, INCONSISTENT, TIME_LIMIT)


@dataclass(frozen=True, slots=True)
class PyFrame:
    """One Python frame: the function, its file and the line it is at."""

    function: str
    """`co_qualname` (3.11+, e.g. `Queue.get`) or `co_name` (3.8-3.10)."""
    filename: str
    line: int
    """0 when the line table does not say."""
    entry: bool = False
    """The outermost Python frame run by one C-level call of the evaluation loop
    (`_PyEval_EvalFrameDefault`): where the next such native frame takes over."""

    @property
    def label(self) -> str:
        """`function (file.py:line)`, the file without its directory."""
        return f"{self.function} ({os.path.basename(self.filename)}:{self.line})"


@dataclass(frozen=True, slots=True)
class PyThread:
    """The Python stack of one thread, innermost frame first."""

    tid: int
    frames: tuple[PyFrame, ...]
    holds_gil: bool = False
    """The interpreter's GIL is taken and this thread took it last."""
    waits_for_gil: bool | None = None
    """The thread sleeps on the GIL's condition variable or mutex (from its
    current futex syscall); None when that was not looked at."""
    truncated: bool = False
    """Frames beyond the last one could not be read (depth or time limit, a bad pointer)."""


@dataclass(frozen=True, slots=True)
class PyProcess:
    """One read of a process: its Python threads by native thread id."""

    pid: int
    version: str = ""
    """The interpreter's version, "3.11.2" (or "3.9" when only the name tells)."""
    threads: Mapping[int, PyThread] = field(default_factory=dict)
    failure: str | None = None
    """One of `FAILURE_CAUSES`; with threads, they are what was read before it."""
    syscalls: int = 0
    """process_vm_readv calls this read made."""
