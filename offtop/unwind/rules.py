"""What one row of a compact unwind table says: how to find the caller's frame.

x86-64 only. Of all the registers DWARF call-frame information describes, a
stack walk from a blocked thread needs three: the CFA (the caller's stack
pointer, by the x86-64 psABI), the return address (DWARF register 16) and rbp
(register 6), because a caller may compute its CFA from rbp. Every other
register's rule is dropped when a table is built, which is what makes rows
repeat and the table compact (the approach of OpenTelemetry's eBPF profiler
"stack deltas" and Parca's compact unwind tables).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

#: DWARF register numbers of x86-64 (psABI figure 3.36).
RBP = 6
RSP = 7
RIP = 16
#: Argument registers the kernel reports for a thread in a system call
#: (/proc/PID/task/TID/syscall), by DWARF number: rdi, rsi, rdx, r10, r8, r9.
SYSCALL_ARG_REGS = (5, 4, 1, 10, 8, 9)


class CfaKind(IntEnum):
    """How the canonical frame address (CFA) is computed."""

    NONE = 0  #: no rule (no FDE covers the pc, or the program defined none)
    RSP = 1  #: rsp + cfa_off
    RBP = 2  #: rbp + cfa_off
    REG = 3  #: register cfa_reg + cfa_off: only the first frame knows such a register
    DEREF = 4  #: *(cfa_reg + cfa_off) + cfa_arg, cfa_reg rsp or rbp (realigned stacks)
    PLT = 5  #: rsp + cfa_off + (8 if (pc & 15) >= cfa_arg else 0): ld's PLT entries
    UNSUPPORTED = 6  #: any other DWARF expression


class RegKind(IntEnum):
    """Where the caller's value of a register (rbp or the return address) is."""

    SAME = 0  #: unchanged by this frame
    UNDEFINED = 1  #: not recoverable; for the return address: the outermost frame
    OFFSET = 2  #: saved in memory at CFA + off
    VAL_OFFSET = 3  #: the value is CFA + off
    REGISTER = 4  #: in register `reg` of this frame
    AT_REG = 5  #: saved in memory at register `reg` + off of this frame (DW_CFA_expression)
    UNSUPPORTED = 6  #: any other rule


@dataclass(frozen=True, slots=True)
class Rule:
    """One row's rule. Tables intern rules, so equal rows share one object."""

    cfa: CfaKind
    cfa_reg: int
    cfa_off: int
    cfa_arg: int
    ra: RegKind
    ra_reg: int
    ra_off: int
    bp: RegKind
    bp_reg: int
    bp_off: int
    #: A signal trampoline (CIE augmentation 'S', glibc's __restore_rt): the
    #: caller's pc is where the signal interrupted it, not a return address.
    signal: bool = False

    @classmethod
    def from_key(cls, key: tuple[tuple[int, int, int, int], tuple[int, int, int],
                                 tuple[int, int, int], bool]) -> Rule:
        """The rule of an interpreter state key ((cfa...), (ra...), (bp...), signal)."""
        (c, creg, coff, carg), (r, rreg, roff), (b, breg, boff), signal = key
        return cls(CfaKind(c), creg, coff, carg, RegKind(r), rreg, roff, RegKind(b), breg, boff, signal)

    def describe(self) -> str:
        """A readable form like readelf's, for messages and tests."""
        cfa = {
            CfaKind.NONE: "none",
            CfaKind.RSP: f"rsp+{self.cfa_off}",
            CfaKind.RBP: f"rbp+{self.cfa_off}",
            CfaKind.REG: f"r{self.cfa_reg}+{self.cfa_off}",
            CfaKind.DEREF: f"*(r{self.cfa_reg}+{self.cfa_off})+{self.cfa_arg}",
            CfaKind.PLT: f"plt(rsp+{self.cfa_off},{self.cfa_arg})",
            CfaKind.UNSUPPORTED: "expr",
        }[self.cfa]
        return (f"cfa={cfa} ra={_reg_text(self.ra, self.ra_reg, self.ra_off)} "
                f"rbp={_reg_text(self.bp, self.bp_reg, self.bp_off)}" + (" signal" if self.signal else ""))


def _reg_text(kind: RegKind, reg: int, off: int) -> str:
    if kind == RegKind.OFFSET:
        return f"c{off:+d}"
    if kind == RegKind.VAL_OFFSET:
        return f"=c{off:+d}"
    if kind == RegKind.REGISTER:
        return f"r{reg}"
    if kind == RegKind.AT_REG:
        return f"[r{reg}{off:+d}]"
    return kind.name.lower()
