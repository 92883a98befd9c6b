"""Python stacks of CPython processes, read from their memory (issue 10).

`PythonStacks.read(pid)` gives the Python frames (function, file, line) of
each thread of a CPython 3.8-3.13 process by kernel thread id, innermost
first, read with process_vm_readv: the process is never stopped, signalled
or traced. `merge_stacks` splices them into a native user stack where the
interpreter's evaluation frames are, as `py-spy dump --native` does, and
says when a thread waits for the GIL.
"""

from __future__ import annotations

from offtop.pystacks.merge import (
    MARK_GIL_WAIT,
    MARK_PYTHON_UNPLACED,
    MergedStack,
    StackMarker,
    is_eval_frame,
    is_gil_frame,
    merge_stacks,
)
from offtop.pystacks.model import (
    FAILURE_CAUSES,
    INCONSISTENT,
    NOT_PYTHON,
    READ_FAILED,
    TIME_LIMIT,
    UNSUPPORTED,
    PyFrame,
    PyProcess,
    PyThread,
)
from offtop.pystacks.stacks import PythonStacks, describe_failure

__all__ = [
    "FAILURE_CAUSES",
    "INCONSISTENT",
    "MARK_GIL_WAIT",
    "MARK_PYTHON_UNPLACED",
    "NOT_PYTHON",
    "READ_FAILED",
    "TIME_LIMIT",
    "UNSUPPORTED",
    "MergedStack",
    "PyFrame",
    "PyProcess",
    "PyThread",
    "PythonStacks",
    "StackMarker",
    "describe_failure",
    "is_eval_frame",
    "is_gil_frame",
    "merge_stacks",
]
