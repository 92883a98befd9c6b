"""User stacks of blocked threads, unwound with the binaries' own call-frame information.

For binaries built without frame pointers (Debian's, libc included), where a
frame-pointer walk gives junk. A blocked thread's saved user registers and
its stack do not change while it is blocked, so offtop reads them
(/proc/PID/task/TID/syscall, process_vm_readv) and walks the stack in
Python with compact per-file tables built from .eh_frame and .debug_frame.

    unwinder = Unwinder()
    result = unwinder.unwind_blocked(pid, tid)   # or .unwind(pid, tid, pc, sp, bp)
    result.addresses, result.stop_reason, result.complete
"""

from __future__ import annotations

from offtop.unwind.cache import TableCache
from offtop.unwind.regs import SyscallRegs, read_syscall_regs
from offtop.unwind.table import UnwindTable, build_table
from offtop.unwind.unwinder import StopReason, Unwinder, UnwindLimits, UnwindResult

__all__ = [
    "StopReason",
    "SyscallRegs",
    "TableCache",
    "UnwindLimits",
    "UnwindResult",
    "UnwindTable",
    "Unwinder",
    "build_table",
    "read_syscall_regs",
]
