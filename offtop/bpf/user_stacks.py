"""Frame-pointer user stacks from the probe, checked and completed with call-frame information.

The probe walks user stacks along the rbp chain: cheap, and exact where
every function keeps a frame pointer. Two things go wrong elsewhere, and
the binaries' own unwind tables (.eh_frame) fix both:

- A frameless leaf (a libc syscall wrapper sets up no frame) leaves rbp to
  its caller, so the chain skips that caller. Python looks up where the
  leaf keeps its return address (CFA = rsp + N: at [sp + N - 8]) and
  teaches the probe (`leaf_rules`, per process and pc); from then on the
  probe reads it there and puts the caller second, tagged (bit 63) as a
  frame that came from call-frame information.
- In code built without frame pointers, rbp is an ordinary register: the
  chain followed from it is junk. A frame is trusted only if the function
  below it keeps rbp as its frame base there (its CFA is rbp-based); the
  stack is cut at the first frame that is not, and marked truncated.

Where a file has no unwind table the chain is taken as it is (nothing
better is known); frames outside every mapping are cut by the symbolizer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from offtop.bpf.decode import LEAF_CALLER_TAG
from offtop.unwind import Unwinder
from offtop.unwind.maps import ExecMapping, read_exec_maps
from offtop.unwind.rules import CfaKind, RegKind

#: leaf_rules value: the leaf keeps a frame pointer, or where its return
#: address is is unknown; the probe adds nothing.
NO_LEAF_CALLER = -1


@dataclass(slots=True)
class RepairStats:
    """Counts, cumulative."""

    leaf_rules: int = 0
    cut: int = 0


class UserStackRepair:
    """Checks and completes probe user stacks (see the module docstring).

    `teach(tgid, pc, offset)` writes a leaf rule into the probe. One per
    engine thread (the unwinder's caches are not thread-safe).
    """

    def __init__(
        self,
        unwinder: Unwinder,
        teach: Callable[[int, int, int], None],
        *,
        max_rules: int = 16_384,
        maps: Callable[[int], list[ExecMapping]] = read_exec_maps,
    ) -> None:
        self._unwinder = unwinder
        self._teach = teach
        self._max_rules = max_rules
        self._read_maps = maps
        self._taught: set[tuple[int, int]] = set()
        self._maps: dict[int, list[ExecMapping]] = {}
        self.stats = RepairStats()

    def new_tick(self) -> None:
        """Forget the memory maps read so far (processes map and unmap)."""
        self._maps.clear()

    def forget_process(self, pid: int) -> None:
        """A process is gone: its leaf rules mean nothing any more."""
        self._taught = {k for k in self._taught if k[0] != pid}

    def _maps_of(self, pid: int) -> list[ExecMapping]:
        maps = self._maps.get(pid)
        if maps is None:
            maps = self._maps[pid] = self._read_maps(pid)
        return maps

    def repair(self, pid: int, addrs: tuple[int, ...]) -> tuple[tuple[int, ...], bool]:
        """(the trusted addresses, tags removed; True when frames were cut)."""
        if not addrs:
            return addrs, False
        maps = self._maps_of(pid)
        self._learn_leaf(pid, addrs[0], maps)
        out = [addrs[0]]
        # Does the function of the frame below keep rbp as its frame base?
        # For the leaf that is asked at its exact pc, for callers at ret - 1.
        for i in range(1, len(addrs)):
            addr = addrs[i]
            if addr & LEAF_CALLER_TAG:
                out.append(addr & ~LEAF_CALLER_TAG)  # from the leaf's own CFI: trusted
                continue
            below = out[-1]
            rule = self._unwinder.rule_for(pid, below, exact=(i == 1), maps=maps)
            if rule is not None and rule.cfa != CfaKind.RBP:
                self.stats.cut += 1
                return tuple(out), True
            out.append(addr)
        return tuple(out), False

    def _learn_leaf(self, pid: int, pc: int, maps: list[ExecMapping]) -> None:
        key = (pid, pc)
        if key in self._taught or len(self._taught) >= self._max_rules:
            return
        self._taught.add(key)
        rule = self._unwinder.rule_for(pid, pc, exact=True, maps=maps)
        offset = NO_LEAF_CALLER
        if rule is not None and rule.cfa == CfaKind.RSP and rule.ra == RegKind.OFFSET:
            offset = rule.cfa_off + rule.ra_off  # the return address is at [sp + offset]
        self._teach(pid, pc, offset)
        if offset != NO_LEAF_CALLER:
            self.stats.leaf_rules += 1
