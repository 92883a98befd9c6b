"""The user registers the kernel reports for a thread blocked in a system call.

/proc/PID/task/TID/syscall (proc(5)) reads "NR ARG1 … ARG6 SP PC" for a
thread in a system call, "-1 SP PC" for one blocked outside a system call
(a page fault, a ptrace stop), and "running" for one on a CPU. The values
are those the thread entered the kernel with, saved in its pt_regs, so they
stay valid for as long as it is blocked. The six arguments are registers
too (rdi, rsi, rdx, r10, r8, r9): the first frame may need one of them
(__vfork keeps its return address in rdi across the system call).
"""

from __future__ import annotations

from dataclasses import dataclass

from offtop.unwind.rules import SYSCALL_ARG_REGS


@dataclass(frozen=True, slots=True)
class SyscallRegs:
    """A blocked thread's user pc and sp, and its syscall number and arguments."""

    nr: int  #: the system call number, -1 when blocked outside a system call
    args: tuple[int, ...]  #: the six argument registers ((), when nr is -1)
    sp: int
    pc: int

    def leaf_registers(self) -> dict[int, int]:
        """The argument registers by DWARF register number (for the first frame only)."""
        return dict(zip(SYSCALL_ARG_REGS, self.args, strict=False))


def parse_syscall(text: str) -> SyscallRegs | None:
    """SyscallRegs from the text of a syscall file; None for "running" or malformed text."""
    parts = text.split()
    try:
        if len(parts) == 9:
            vals = [int(p, 0) for p in parts[1:]]
            return SyscallRegs(int(parts[0]), tuple(vals[:6]), vals[6], vals[7])
        if len(parts) == 3 and parts[0] == "-1":
            return SyscallRegs(-1, (), int(parts[1], 0), int(parts[2], 0))
    except ValueError:
        return None
    return None


def read_syscall_regs(pid: int, tid: int, proc: str = "/proc") -> SyscallRegs | None:
    """The registers of thread `tid` of `pid`, or None when running, gone or not readable."""
    try:
        with open(f"{proc}/{pid}/task/{tid}/syscall") as f:
            return parse_syscall(f.read(512))
    except OSError:
        return None
