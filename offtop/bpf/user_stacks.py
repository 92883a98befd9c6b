"""User stacks from the probe, checked and completed with the binaries' call-frame information.

The probe unwinds a user stack one frame at a time, by a rule for each pc
where Python has taught it one and along the rbp chain where not. Python
teaches rules from each file's own unwind tables (.eh_frame, read by
`offtop.unwind`) for every pc it sees, so the stacks of a site become whole
within a few blocks there, also in code built without frame pointers
(Debian's, libc included) and through frameless leaves (a libc syscall
wrapper sets up no frame, so the rbp chain skips its caller).

Frames the probe reached along the rbp chain carry a tag (bit 63). Such a
frame is kept only if the function below it keeps rbp as its frame base
there (its CFA is rbp-based, or nothing says otherwise); in code without
frame pointers rbp is an ordinary register and the chain from it is junk,
so the stack is cut there and marked truncated. A walk that ended at a frame
it stepped along the rbp chain, in a function that keeps no frame pointer
but has a caller (libc's start_thread, before its rule is taught), stopped
short of the stack's end: marked truncated too, not shown as whole. Frames
outside every mapping are cut by the symbolizer.

A walk reveals one trusted frame past those it has rules for, so a process
learns a stack of N frames without frame pointers in about N sightings
(Debian's gzip in read(): 9, over 2 s). Processes of one program block in the
same places, so the sites taught (file and offset of each pc) are kept per
program (the file mapped lowest: the executable) and taught to the next
process of that program the first time it is seen: its stacks are whole from
their second sighting. Each rule is still worked out from the new process's
own files; a site taught in vain costs a map entry, never a wrong frame.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

from offtop.bpf.decode import FP_FRAME_TAG, StackCopy
from offtop.unwind import Unwinder
from offtop.unwind.memory import CopiedStack
from offtop.unwind.rules import CfaKind, RegKind, Rule
from offtop.unwind.unwinder import FileMapping, UnwindResult

# offcpu.c RULE_*: how the probe steps from a pc to its caller.
RULE_RSP, RULE_RBP, RULE_OUTERMOST, RULE_FP = 1, 2, 3, 4
RULE_BP_SAME = 0x7FFF


def pack_rule(rule: Rule | None) -> int:
    """The probe's form of a call-frame rule (offcpu.c unwind_rules); RULE_FP when it has none."""
    if rule is None or rule.signal:
        return RULE_FP
    if rule.ra == RegKind.UNDEFINED:
        return RULE_OUTERMOST
    if rule.cfa not in (CfaKind.RSP, CfaKind.RBP) or rule.ra != RegKind.OFFSET:
        return RULE_FP
    bp = rule.bp_off if rule.bp == RegKind.OFFSET else RULE_BP_SAME
    fields = (rule.cfa_off, rule.ra_off, bp)
    in_range = all(-0x8000 <= v < 0x8000 for v in fields)
    if not in_range or (rule.bp == RegKind.OFFSET and bp == RULE_BP_SAME):
        return RULE_FP
    kind = RULE_RSP if rule.cfa == CfaKind.RSP else RULE_RBP
    packed = kind
    for shift, v in zip((8, 24, 40), fields, strict=True):
        packed |= (v & 0xFFFF) << shift
    return packed


#: Sites kept per program, and programs kept (the oldest go first at either bound):
#: 32,768 sites at most, ~5 MB.
MAX_SITES_PER_PROGRAM = 512
MAX_PROGRAMS = 64

#: A site: the file a pc lies in, its offset there, and whether it was a first frame.
_Site = tuple[str, int, bool]


@dataclass(slots=True)
class RepairStats:
    """Counts, cumulative."""

    rules_taught: int = 0
    cut: int = 0
    #: Rules taught to a process ahead, from the sites of its program's earlier processes.
    rules_ahead: int = 0
    #: Stack copies the probe sent that rules were learned from (`learn_from_copy`).
    copies_learned: int = 0
    #: Stacks of gone processes made whole (or longer) from their copies.
    copies_unwound: int = 0


class ProgramSites:
    """Where the processes of each program needed rules (see the module docstring):
    by program, the sites in the order first taught, bounded."""

    def __init__(self) -> None:
        self._by_program: dict[str, dict[_Site, None]] = {}

    def __len__(self) -> int:
        return sum(len(s) for s in self._by_program.values())

    def add(self, program: str, maps: Sequence[FileMapping], addr: int, first: bool) -> None:
        """Note that a process of `program` needed the rule at `addr` (in `maps`)."""
        m = mapping_at(maps, addr)
        if m is None:
            return
        sites = self._by_program.get(program)
        if sites is None:
            if len(self._by_program) >= MAX_PROGRAMS:
                del self._by_program[next(iter(self._by_program))]
            sites = self._by_program[program] = {}
        site = (m.path, addr - m.start + m.offset, first)
        if site not in sites:
            if len(sites) >= MAX_SITES_PER_PROGRAM:
                del sites[next(iter(sites))]
            sites[site] = None

    def addresses(self, program: str, maps: Sequence[FileMapping]) -> list[tuple[int, bool]]:
        """(address, first frame?) of each site of `program` in a process mapped as `maps`."""
        sites = self._by_program.get(program)
        if not sites:
            return []
        by_path: dict[str, list[FileMapping]] = {}
        for m in maps:
            by_path.setdefault(m.path, []).append(m)
        out = []
        for path, off, first in sites:
            for m in by_path.get(path, ()):
                if m.offset <= off < m.offset + (m.end - m.start):
                    out.append((m.start + off - m.offset, first))
                    break
        return out


def mapping_at(maps: Sequence[FileMapping], addr: int) -> FileMapping | None:
    """The mapping of `maps` (sorted by address) that holds `addr`, or None."""
    i = bisect_right(maps, addr, key=lambda m: m.start) - 1
    return maps[i] if i >= 0 and addr < maps[i].end else None


def program_of(maps: Sequence[FileMapping]) -> str | None:
    """Which program a process runs, as its mappings say: the file mapped lowest (the
    executable, PIE or not; shared libraries lie above it)."""
    return maps[0].path if maps else None


class RuleOwners(Protocol):
    """Whose rules a forked process not seen yet walks by (`offtop.bpf.probe.Probe`)."""

    def rule_owners(self) -> dict[int, int]:
        """{process: the process whose rules it walks by}."""
        ...

    def drop_rule_owners(self, pids: Iterable[int]) -> None:
        """These processes walk by their own rules from now."""
        ...


class UserStackRepair:
    """Checks probe user stacks and teaches the probe rules (see the module docstring).

    `teach(tgid, pc, packed_rule)` writes a rule into the probe and
    `forget(rules)` deletes these (tgid, pc) rules there. `maps(pid, pc,
    start)` gives the process's executable file mappings around pc: the
    symbolizer's (`UserSymbols.file_mappings`), so /proc/PID/maps is read once
    for both, the same list while it holds. Rules are
    per process (its pid and start time): once it is gone (`sweep`), or its
    pid is another process's (seen at `repair`), its rules are deleted on
    both sides, so that with process churn the budget of `max_rules` goes
    to the processes alive and a reused pid never steps by a dead
    process's rules. One per engine thread (the unwinder's caches are not
    thread-safe).
    """

    def __init__(
        self,
        unwinder: Unwinder,
        teach: Callable[[int, int, int], None],
        *,
        forget: Callable[[Iterable[tuple[int, int]]], object] = lambda rules: None,
        maps: Callable[[int, int, int], Sequence[FileMapping]],
        max_rules: int = 65_536,
        owners: RuleOwners | None = None,
        lender: Callable[[int], tuple[int, int] | None] | None = None,
    ) -> None:
        self._unwinder = unwinder
        self._teach = teach
        self._forget = forget
        self._owners = owners
        # pid -> (pid, start) of the process it was forked from, alive, whose memory
        # it still shares (`lender`: offtop.bpf.lineage's stand_in), or None.
        self._lender = lender
        self._lenders: dict[int, tuple[int, int] | None] = {}
        self._max_rules = max_rules
        self._maps = maps
        self._taught: dict[int, dict[int, int]] = {}  # pid -> pc -> the rule taught, packed
        self._starts: dict[int, int] = {}  # pid -> start time of the process taught
        self._count = 0
        # pid -> (address, first frame?) -> does the frame keep rbp as its base?
        self._keeps_fp: dict[int, dict[tuple[int, bool], bool]] = {}
        self._keeps_count = 0
        self._programs: dict[int, str | None] = {}  # pid -> its program (`program_of`)
        self.sites = ProgramSites()
        self.stats = RepairStats()

    @property
    def taught_pids(self) -> set[int]:
        """Processes the probe holds rules for."""
        return set(self._taught)

    @property
    def rules(self) -> int:
        """Rules taught and not forgotten."""
        return self._count

    def forget_processes(self, pids: set[int]) -> None:
        """These processes are gone: their rules mean nothing any more, here or in the
        probe, and no process walks by them (their pids may come back as others')."""
        self._forget_rules(pids)
        self._disown(pids, pids.__contains__)

    def sweep(self, start_time: Callable[[int], int | None]) -> None:
        """Forget the processes gone since they were taught (`start_time`: now, None if
        gone), and those gone that processes forked from them walk by, taught or not
        (one that never blocked has no rules here: its pid, taken by another
        process, would lend that one's)."""
        gone = {pid for pid in self._taught if start_time(pid) != self._starts.get(pid)}
        self._forget_rules(gone)
        self._disown(gone, lambda pid: pid in gone or start_time(pid) is None)

    def _forget_rules(self, pids: set[int]) -> None:
        rules = []
        for pid in pids:
            taught = self._taught.pop(pid, ())
            self._count -= len(taught)
            rules += [(pid, pc) for pc in taught]
            self._starts.pop(pid, None)
            self._programs.pop(pid, None)
            self._lenders.pop(pid, None)
            self._keeps_count -= len(self._keeps_fp.pop(pid, ()))
        if rules:
            self._forget(rules)

    def _disown(self, pids: set[int], gone: Callable[[int], bool]) -> None:
        """The probe's notes (`RuleOwners`) of `pids`, and of every process that walks
        by the rules of one `gone` says is gone, deleted: one read of the map, each
        owner asked about once, one batch delete."""
        if self._owners is None:
            return
        owned = self._owners.rule_owners()
        verdict = {owner: gone(owner) for owner in set(owned.values())}
        dropped = [pid for pid, owner in owned.items() if pid in pids or verdict[owner]]
        if dropped:
            self._owners.drop_rule_owners(dropped)

    def _rule(self, pid: int, addr: int, first: bool,
              maps: Sequence[FileMapping] | None = None) -> Rule | None:
        if maps is None:
            maps = self._maps(pid, addr, self._starts.get(pid, 0))
        return self._unwinder.rule_for(pid, addr, exact=first, maps=maps)

    def repair(self, pid: int, addrs: tuple[int, ...], start: int = 0, *,
               at_limit: bool = False, copy: StackCopy | None = None
               ) -> tuple[tuple[int, ...], bool]:
        """(the trusted addresses, tags removed; True when frames were cut).

        `start`: the process's start time (0: unknown, the process is gone:
        nothing is taught). A pid taught before under another start time is
        another process now: the old one's rules go first. `at_limit`: the walk
        stopped at the probe's depth limit (its end says nothing of the stack's).
        `copy`: the copy of the stack's top the probe sent with it: where the
        stack is cut, every rule it needs is learned from it (`learn_from_copy`)
        before any is taught pc by pc (a walk between the two stored a version
        of the stack a frame longer: a first gzip showed three, not two).
        """
        if not addrs:
            return addrs, False
        maps = self._first_sight(pid, start, addrs[0])
        # None: the process is gone, there is nobody to teach.
        taught = self._taught.setdefault(pid, {}) if start else None
        walked = None
        if (copy is not None and taught is not None
                and self._check(pid, addrs, None, at_limit, count=False)[1]):
            walked = self._learn_copy(pid, start, copy)[1]
        out, cut = self._check(pid, addrs, taught, at_limit)
        if maps is not None and taught is not None:
            # After the check: the walk had none of these rules.
            self._seen(pid, taught, maps)
        if cut and copy is not None and copy.pc == out[0]:
            # The probe's walk had no rule where it was cut (the process's
            # first walks there; a process gone was never seen: an exec'd one
            # that lived a few milliseconds blocks once): the copy, unwound with
            # the binaries' call-frame information, is the same stack read on.
            # A gone process's is unwound in the mappings the kernel sent for
            # it (offtop.bpf.sent_maps), or none. Taken only if it begins with
            # the frames the probe's walk trusted.
            if walked is None and taught is None:
                walked = self._unwind_gone(pid, copy)
            got = walked.addresses if walked is not None else ()
            if len(got) > len(out) and got[:len(out)] == out:
                assert walked is not None
                self.stats.copies_unwound += 1
                return got, not walked.complete
        return out, cut

    def _unwind_gone(self, pid: int, copy: StackCopy) -> UnwindResult | None:
        """A gone process's copy unwound in its memory map, if one is known."""
        maps = self._maps(pid, copy.pc, 0)
        return self._unwind_copy(pid, copy, maps) if maps else None

    def _unwind_copy(self, pid: int, copy: StackCopy, maps: Sequence[FileMapping]) -> UnwindResult:
        """The stack a copy of its top holds, walked in `maps` (the copy is the memory)."""
        return self._unwinder.unwind(pid, 0, copy.pc, copy.sp, copy.bp,
                                     mem=CopiedStack(copy.sp, copy.data), maps=maps)

    def see(self, pid: int, start: int, pc: int) -> bool:
        """A process's first stack has just come (`pc` its top; `start` its start time,
        0: gone): at its first sight, the rules its program's earlier processes
        needed are taught now, before its threads' next walks, not when its
        stacks are resolved. A new process's threads block at once, each at a site
        of its own: taught a sub-tick later (0.25 s), most of their first walks
        had ended at libc's start_thread, each a `[stack truncated]` stack, then
        resolved again whole. True at a first sight."""
        maps = self._first_sight(pid, start, pc)
        if maps is None:
            return False
        self._seen(pid, self._taught.setdefault(pid, {}), maps)
        return True

    def learn_from_copy(self, pid: int, start: int, copy: StackCopy) -> int:
        """Teach the probe every rule a stack needs, from the copy of its top the probe
        sent with it (its walk ended on a broken rbp chain): unwound here with the
        binaries' call-frame information, so the site's next walk is whole rather
        than a frame longer. `start`: the process's start time (0: gone, nothing
        is taught). How many rules were taught."""
        return self._learn_copy(pid, start, copy)[0]

    def _learn_copy(self, pid: int, start: int, copy: StackCopy) -> tuple[int, UnwindResult | None]:
        """`learn_from_copy`, and the copy's walk (None: not walked)."""
        if not start:
            return 0, None
        maps = self._first_sight(pid, start, copy.pc)
        taught = self._taught.setdefault(pid, {})
        walked = self._unwind_copy(
            pid, copy, maps if maps is not None else self._maps(pid, copy.pc, start))
        before = self.stats.rules_taught
        for i, addr in enumerate(walked.addresses):
            if addr not in taught:
                self._learn(pid, taught, addr, i == 0)
        self.stats.copies_learned += 1
        if maps is not None:
            self._seen(pid, taught, maps)
        return self.stats.rules_taught - before, walked

    def _first_sight(self, pid: int, start: int, pc: int) -> Sequence[FileMapping] | None:
        """At a process's first sight (`start` not the one taught before under its pid:
        the old one's rules go first), its mappings around `pc`; else None."""
        known = self._starts.get(pid)
        if not start or known == start:
            return None
        if known is not None:
            self.forget_processes({pid})
        self._starts[pid] = start
        maps = self._maps(pid, pc, start)
        self._programs[pid] = program_of(maps)
        if self._lender is not None:
            self._lenders[pid] = self._lender(pid)
        return maps

    def _check(self, pid: int, addrs: tuple[int, ...], taught: dict[int, int] | None,
               at_limit: bool, *, count: bool = True) -> tuple[tuple[int, ...], bool]:
        """`repair`'s answer; rules for the pcs not taught yet are taught (none without
        `taught`). `count`: a cut is counted in the stats."""
        out = [addrs[0]]
        if taught is not None and addrs[0] not in taught:
            self._learn(pid, taught, addrs[0], True)
        for addr in addrs[1:]:
            if addr & FP_FRAME_TAG:
                addr &= ~FP_FRAME_TAG
                if not self._keeps_frame_pointer(pid, out[-1], len(out) == 1):
                    self.stats.cut += count
                    return tuple(out), True
            out.append(addr)
            if taught is not None and addr not in taught:
                self._learn(pid, taught, addr, False)
        if at_limit:
            return tuple(out), False
        if taught is not None:
            last_rule = taught.get(out[-1])
        else:
            # A process gone (nobody to teach): the rule its files give, if
            # they are known (a stand-in's: offtop.bpf.lineage), else none.
            last_rule = pack_rule(self._rule(pid, out[-1], len(out) == 1))
        if last_rule is not None and last_rule & 0xFF == RULE_RSP:
            # The walk ended at a function whose frame is not rbp-based yet has
            # a caller: the stack goes on past where the walk could follow.
            # Either the probe had no rule there when it walked (libc's
            # start_thread in a new process, before its rules are taught; a
            # stack walked before a rule taught since is read after it), or it
            # had one and could not read the return address. Cut, so that it is
            # marked, not shown as if whole.
            self.stats.cut += count
            return tuple(out), True
        return tuple(out), False

    def _keeps_frame_pointer(self, pid: int, addr: int, first: bool) -> bool:
        """Is rbp the frame base of the function at `addr` (or nothing says otherwise)?"""
        known = self._keeps_fp.get(pid)
        keeps = known.get((addr, first)) if known is not None else None
        if keeps is None:
            rule = self._rule(pid, addr, first)
            keeps = rule is None or rule.cfa == CfaKind.RBP
            if self._keeps_count >= 4 * self._max_rules:
                self._keeps_fp.clear()
                self._keeps_count = 0
            self._keeps_fp.setdefault(pid, {})[(addr, first)] = keeps
            self._keeps_count += 1
        return keeps

    def _seen(self, pid: int, taught: dict[int, int], maps: Sequence[FileMapping]) -> None:
        """A process seen for the first time, alive: taught ahead, then walked by its
        own rules from here (until now, if it was forked, by its forker's)."""
        self._teach_ahead(pid, taught, maps)
        if self._owners is not None:
            self._owners.drop_rule_owners((pid,))

    def _teach_ahead(self, pid: int, taught: dict[int, int],
                     maps: Sequence[FileMapping]) -> None:
        """A process seen for the first time (mapped as `maps`): the rules its program's
        earlier processes needed, taught now (each worked out from this process's own
        files), while less than half the budget is taken: the rest stays for rules
        that are needed."""
        program = self._programs.get(pid)
        if program is None:
            return
        for addr, first in self.sites.addresses(program, maps):
            if self._count >= self._max_rules // 2:
                return
            if addr not in taught:
                self._learn(pid, taught, addr, first, note=False)
                self.stats.rules_ahead += 1

    def _learn(self, pid: int, taught: dict[int, int], addr: int, first: bool, *,
               note: bool = True) -> int | None:
        """Teach the probe the rule at `addr`; the rule as packed, or None over the budget.
        `note`: keep the site for the next processes of this one's program."""
        if self._count >= self._max_rules:
            return None
        maps = self._maps(pid, addr, self._starts.get(pid, 0))
        rule = pack_rule(self._rule(pid, addr, first, maps))
        taught[addr] = rule
        self._count += 1
        self._teach(pid, addr, rule)
        self.stats.rules_taught += 1
        program = self._programs.get(pid)
        if note and program is not None:
            self.sites.add(program, maps, addr, first)
        lender = self._lenders.get(pid) if note else None
        if lender is not None and self._starts.get(lender[0]) == lender[1]:
            # Forked and not exec'd: the same memory as the one it was forked from,
            # whose next children walk by its rules (RuleOwners) from their first
            # block: a site only children reach is taught there too.
            theirs = self._taught.setdefault(lender[0], {})
            if addr not in theirs:
                self._learn(lender[0], theirs, addr, first)
        return rule
