"""UserStackRepair's rules over processes' lives: taught per process, forgotten
on both sides once it is gone or its pid is another's; and where a walk ended
(no BPF: the probe's side is a recording fake)."""

from __future__ import annotations

import struct
from collections.abc import Iterable
from typing import Any

from offtop.bpf.decode import FP_FRAME_TAG, StackCopy
from offtop.bpf.user_stacks import RULE_FP, UserStackRepair
from offtop.unwind.maps import ExecMapping
from offtop.unwind.rules import CfaKind, RegKind, Rule
from offtop.unwind.unwinder import StopReason, UnwindResult


class FakeUnwinder:
    """No table covers anything: every pc gets the frame-pointer rule."""

    def rule_for(self, pid: int, addr: int, *, exact: bool, maps: Any = None) -> None:
        return None


class FakeProbe:
    """What the repair wrote to the probe: rules by (pid, pc), and forgets."""

    def __init__(self) -> None:
        self.rules: dict[tuple[int, int], int] = {}
        self.forgotten: list[set[int]] = []

    def teach(self, pid: int, pc: int, rule: int) -> None:
        self.rules[(pid, pc)] = rule

    def forget(self, rules: Iterable[tuple[int, int]]) -> None:
        gone = set(rules)
        self.forgotten.append({pid for pid, _ in gone})
        self.rules = {k: v for k, v in self.rules.items() if k not in gone}


def repair_with(probe: FakeProbe, max_rules: int = 65_536,
                maps_asked: list[tuple[int, int, int]] | None = None) -> UserStackRepair:
    mapped = [ExecMapping(0x1000, 0x3000, 0, "/bin/x", "")]

    def maps(pid: int, pc: int, start: int) -> list[Any]:
        if maps_asked is not None:
            maps_asked.append((pid, pc, start))
        return mapped
    return UserStackRepair(FakeUnwinder(), probe.teach, forget=probe.forget,  # type: ignore[arg-type]
                           max_rules=max_rules, maps=maps)


def test_a_gone_process_gives_its_rules_back_to_the_budget() -> None:
    probe = FakeProbe()
    repair = repair_with(probe, max_rules=4)
    repair.repair(100, (0x1000, 0x2000, 0x3000, 0x4000), start=7)
    assert repair.rules == 4 and len(probe.rules) == 4
    repair.repair(200, (0x5000, 0x6000), start=9)
    assert (200, 0x5000) not in probe.rules  # over the budget while 100 lives
    alive = {100: 7, 200: 9}
    repair.sweep(alive.get)
    assert probe.forgotten == []
    del alive[100]  # exits
    repair.sweep(alive.get)
    assert probe.forgotten == [{100}]
    assert not any(pid == 100 for pid, _ in probe.rules)
    repair.repair(200, (0x5000, 0x6000), start=9)
    assert probe.rules[(200, 0x5000)] == RULE_FP and (200, 0x6000) in probe.rules
    assert repair.rules == 2 and repair.taught_pids == {200}


def test_a_reused_pid_never_keeps_the_dead_process_rules() -> None:
    probe = FakeProbe()
    repair = repair_with(probe)
    repair.repair(100, (0x1000, 0x2000), start=7)
    del probe.rules[(100, 0x1000)]  # stands for: the probe's rule must be taught anew
    repair.repair(100, (0x1000, 0x2000), start=8)  # another process, same pid
    assert probe.forgotten == [{100}]
    assert (100, 0x1000) in probe.rules and repair.rules == 2
    repair.repair(100, (0x1000,), start=0)  # start unknown (gone since): kept as is
    assert probe.forgotten == [{100}]


def test_mappings_are_asked_with_the_process_start_time_the_repair_knows() -> None:
    """The mappings come from the symbolizer (UserSymbols.file_mappings), per process:
    asked with the start time the repair was given, so both see the same process."""
    probe = FakeProbe()
    asked: list[tuple[int, int, int]] = []
    repair = repair_with(probe, maps_asked=asked)
    repair.repair(100, (0x1000, 0x2000), start=7)
    assert asked and all(pid == 100 and start == 7 for pid, _, start in asked)
    assert {pc for _, pc, _ in asked} == {0x1000, 0x2000}


class RulesByPc:
    """A fake unwinder with a rule for some pcs (a table's rows, as `Unwinder` gives them)."""

    def __init__(self, rules: dict[int, Rule]) -> None:
        self._rules = rules

    def rule_for(self, pid: int, addr: int, *, exact: bool, maps: Any = None) -> Rule | None:
        return self._rules.get(addr if exact else addr - 1)


# rsp-based (no frame pointer), its caller's address at CFA - 8: libc's start_thread.
NO_FP = Rule(CfaKind.RSP, 7, 16, 0, RegKind.OFFSET, 0, -8, RegKind.SAME, 0, 0)
# The outermost frame (the return address undefined): clone3, _start.
OUTERMOST = Rule(CfaKind.RSP, 7, 8, 0, RegKind.UNDEFINED, 0, 0, RegKind.SAME, 0, 0)
# rbp-based: a frame-pointer frame.
FP = Rule(CfaKind.RBP, 6, 16, 0, RegKind.OFFSET, 0, -8, RegKind.OFFSET, 0, -16)


def test_a_walk_that_ended_in_a_frame_without_frame_pointer_that_has_a_caller_is_cut() -> None:
    """The probe stepped the last frame along the rbp chain (it had no rule there yet)
    and stopped: if the function there keeps no frame pointer and has a caller, the
    stack goes on past it and is cut (marked truncated); at an outermost frame, or a
    frame-pointer one (the chain's end), it is whole. A walk that ended at such a
    frame although the probe had its rule (the return address could not be read), or
    was walked before the rule was taught and read after, is cut all the same; one
    that ended at the probe's depth limit is not (its end says nothing)."""
    probe = FakeProbe()
    unwinder = RulesByPc({0x1000: FP, 0x1fff: FP, 0x2fff: NO_FP, 0x3fff: OUTERMOST})
    repair = UserStackRepair(unwinder, probe.teach, maps=lambda pid, pc, start: [])  # type: ignore[arg-type]
    stack = (0x1000, 0x2000 | FP_FRAME_TAG, 0x3000 | FP_FRAME_TAG)
    assert repair.repair(100, stack, start=7) == ((0x1000, 0x2000, 0x3000), True)
    # Taught since: the probe now steps past 0x3000 by its rule.
    assert repair.repair(100, (0x1000, 0x2000, 0x3000, 0x4000), start=7) \
        == ((0x1000, 0x2000, 0x3000, 0x4000), False)
    assert repair.repair(100, (0x1000, 0x2000, 0x3000), start=7) \
        == ((0x1000, 0x2000, 0x3000), True)  # 0x3000 was taught: still cut
    assert repair.repair(100, (0x1000, 0x2000, 0x3000), start=7, at_limit=True) \
        == ((0x1000, 0x2000, 0x3000), False)
    # Another process, stopped at its outermost frame or at a frame-pointer frame: whole.
    assert repair.repair(200, (0x1000, 0x2000, 0x3000, 0x4000), start=9)[1] is False
    assert repair.repair(300, (0x1000, 0x2000), start=9)[1] is False
    # A process gone (start 0): nothing is taught, yet its end is judged by the
    # rules its files give (a stand-in's, offtop.bpf.lineage; here the fake's),
    # with the same answers; where no rule is known, nothing is said of its end.
    assert repair.repair(400, (0x1000, 0x2000, 0x3000), start=0)[1] is True
    assert repair.repair(400, (0x1000, 0x2000, 0x3000, 0x4000), start=0)[1] is False
    assert repair.repair(400, (0x1000, 0x2000), start=0)[1] is False
    assert not any(pid == 400 for pid, _ in probe.rules)
    assert repair.stats.cut == 3
    unknown = UserStackRepair(FakeUnwinder(), probe.teach, maps=lambda pid, pc, start: [])  # type: ignore[arg-type]
    assert unknown.repair(400, (0x1000, 0x2000, 0x3000), start=0)[1] is False


class RecordingUnwinder:
    """Every pc gets the frame-pointer rule; each question asked is recorded."""

    def __init__(self) -> None:
        self.asked: list[tuple[int, int, bool]] = []

    def rule_for(self, pid: int, addr: int, *, exact: bool, maps: Any = None) -> None:
        self.asked.append((pid, addr, exact))


def _program(exe: str, base: int, libc: int) -> list[ExecMapping]:
    """A process of `exe` (mapped at `base`) with libc (at `libc`), as maps shows it."""
    return [ExecMapping(base, base + 0x2000, 0, exe, ""),
            ExecMapping(libc, libc + 0x4000, 0x1000, "/lib/libc.so.6", "")]


def test_a_new_process_of_a_program_is_taught_the_sites_its_earlier_processes_needed() -> None:
    """A stack without frame pointers is learned a frame per sighting; the sites one
    process of a program needed (file and offset: addresses move with ASLR) are taught
    to the next process of that program when it is first seen, at its own addresses,
    each rule asked of its own files. Another program gets none of them."""
    probe = FakeProbe()
    unwinder = RecordingUnwinder()
    maps = {100: _program("/usr/bin/gzip", 0x1000, 0x7000),
            200: _program("/usr/bin/gzip", 0x51000, 0x77000),
            300: _program("/usr/bin/cat", 0x1000, 0x7000)}
    repair = UserStackRepair(unwinder, probe.teach,  # type: ignore[arg-type]
                             maps=lambda pid, pc, start: maps[pid])
    # libc's read (first frame, at file offset 0x1100), gzip at 0x200 and 0x1300:
    # each sighting one frame deeper, as the probe's walk goes.
    repair.repair(100, (0x7100, 0x1200), start=7)
    assert set(probe.rules) == {(100, 0x7100), (100, 0x1200)}
    repair.repair(100, (0x7100, 0x1200, 0x2300), start=7)
    assert set(probe.rules) == {(100, 0x7100), (100, 0x1200), (100, 0x2300)}
    assert repair.stats.rules_ahead == 0

    unwinder.asked.clear()
    repair.repair(200, (0x77100,), start=9)  # gzip again, elsewhere in memory
    assert {pc for pid, pc in probe.rules if pid == 200} == {0x77100, 0x51200, 0x52300}
    assert repair.stats.rules_ahead == 2  # 0x77100 was its own, learned from its stack
    assert sorted(unwinder.asked) == [(200, 0x51200, False), (200, 0x52300, False),
                                      (200, 0x77100, True)]

    repair.repair(300, (0x7100,), start=11)  # another program: nothing ahead
    assert {pc for pid, pc in probe.rules if pid == 300} == {0x7100}
    assert repair.stats.rules_ahead == 2


def test_a_new_process_seen_at_its_first_stack_is_taught_ahead_before_its_stacks_are_read() -> None:
    """`see` (the engine calls it as the process's first stacks come, between sub-ticks)
    teaches the program's sites at once: the next walks are whole before any of its
    stacks is resolved. Once only per process; never for a process gone."""
    probe = FakeProbe()
    maps = {100: _program("/usr/bin/gzip", 0x1000, 0x7000),
            200: _program("/usr/bin/gzip", 0x51000, 0x77000)}
    repair = UserStackRepair(FakeUnwinder(), probe.teach,  # type: ignore[arg-type]
                             maps=lambda pid, pc, start: maps[pid])
    repair.repair(100, (0x7100, 0x1200, 0x2300), start=7)
    assert repair.see(100, 7, 0x7100) is False  # seen already, when it was repaired
    assert repair.see(200, 0, 0x77100) is False  # gone: nobody to teach
    assert not {pc for pid, pc in probe.rules if pid == 200}
    assert repair.see(200, 9, 0x77100) is True
    assert {pc for pid, pc in probe.rules if pid == 200} == {0x77100, 0x51200, 0x52300}
    assert repair.stats.rules_ahead == 3
    assert repair.see(200, 9, 0x77100) is False
    before = dict(probe.rules)
    out, cut = repair.repair(200, (0x77100, 0x51200), start=9)  # its first stack, read now
    assert (out, cut) == ((0x77100, 0x51200), False)
    assert probe.rules == before and repair.stats.rules_ahead == 3  # nothing again


class FakeOwners:
    """A fake of the probe's rules_owner map (child -> the process whose rules it
    walks by), and how often it was read."""

    def __init__(self, owned: dict[int, int]) -> None:
        self.owned = dict(owned)
        self.reads = 0

    def rule_owners(self) -> dict[int, int]:
        self.reads += 1
        return dict(self.owned)

    def drop_rule_owners(self, pids: Iterable[int]) -> None:
        for pid in pids:
            self.owned.pop(pid, None)


def test_a_forked_process_teaches_the_one_it_was_forked_from_the_sites_only_it_reached() -> None:
    """Until offtop sees it, a forked process walks by its forker's rules (offcpu.c
    rules_owner): a site only forked processes reach (a child's own code path) is
    taught to the forker as well as to the child, so that its next children's
    walks get past it. Once seen, the child walks by its own rules; once the
    forker is gone, nobody walks by its rules any more."""
    probe = FakeProbe()
    # 100 forked 200 and 600, and 500 (a forker never taught: it never blocked)
    # forked 700; 800 walks by 300's rules.
    owners = FakeOwners({100: 1, 200: 100, 600: 100, 700: 500, 800: 300})
    lenders = {200: (100, 7), 300: None}
    repair = UserStackRepair(FakeUnwinder(), probe.teach, forget=probe.forget,  # type: ignore[arg-type]
                             maps=lambda pid, pc, start: [ExecMapping(0x1000, 0x3000, 0, "/bin/x", "")],
                             owners=owners, lender=lenders.get)
    repair.repair(100, (0x1100, 0x1200), start=7)
    assert 100 not in owners.owned  # seen: its own rules from now
    repair.repair(200, (0x1100, 0x1300, 0x1200), start=9)  # 0x1300: the child's own site
    assert 200 not in owners.owned and owners.owned[600] == 100
    assert {pc for pid, pc in probe.rules if pid == 200} == {0x1100, 0x1300, 0x1200}
    assert {pc for pid, pc in probe.rules if pid == 100} == {0x1100, 0x1200, 0x1300}
    repair.repair(300, (0x1100, 0x1400), start=11)  # not forked from one alive: its own
    assert (100, 0x1400) not in probe.rules
    reads = owners.reads
    repair.sweep({200: 9, 300: 11}.get)  # 100 is gone, and 500
    assert owners.owned == {800: 300} and owners.reads == reads + 1
    # A pid taught again as another process: nobody walks by the old one's rules.
    owners.owned[900] = 300
    repair.repair(300, (0x1100,), start=12)
    assert owners.owned == {}
    # A lender not seen (or seen under another start time) is taught nothing.
    lenders[400] = (100, 8)
    repair.repair(400, (0x1100, 0x1500), start=13)
    assert not any(pid == 100 for pid, _ in probe.rules)


def test_rules_taught_ahead_leave_half_the_budget_to_rules_that_are_needed() -> None:
    probe = FakeProbe()
    maps = {100: _program("/usr/bin/gzip", 0x1000, 0x7000),
            200: _program("/usr/bin/gzip", 0x51000, 0x77000)}
    repair = UserStackRepair(FakeUnwinder(), probe.teach,  # type: ignore[arg-type]
                             maps=lambda pid, pc, start: maps[pid], max_rules=8)
    repair.repair(100, (0x7100, 0x1200, 0x1300, 0x1400), start=7)  # 4 of 8 taken
    repair.repair(200, (0x77100,), start=9)
    assert repair.stats.rules_ahead == 0  # half the budget is taken: none ahead
    assert (200, 0x77100) in probe.rules  # what it needs is still taught
    repair.sweep({200: 9}.get)  # 100 is gone: its 4 rules go back
    repair.repair(200, (0x77100,), start=10)  # pid 200 is another process now
    assert repair.stats.rules_ahead == 3  # 0x51200, 0x51300, 0x51400 (0x77100: its own)
    assert {pc for pid, pc in probe.rules if pid == 200} == {0x77100, 0x51200, 0x51300, 0x51400}


def test_sites_kept_are_bounded_per_program_and_in_programs() -> None:
    """The oldest site of a program goes first past its bound, the oldest program past
    theirs: what a process names its executable cannot grow offtop's memory."""
    from offtop.bpf.user_stacks import MAX_PROGRAMS, MAX_SITES_PER_PROGRAM, ProgramSites

    sites = ProgramSites()
    maps = _program("/usr/bin/gzip", 0x100000, 0x7000000)
    big = [ExecMapping(0x100000, 0x100000 + 0x10000, 0, "/usr/bin/gzip", "")]
    for i in range(MAX_SITES_PER_PROGRAM + 1):
        sites.add("/usr/bin/gzip", big, 0x100000 + i, False)
    assert len(sites) == MAX_SITES_PER_PROGRAM
    kept = {addr for addr, _ in sites.addresses("/usr/bin/gzip", big)}
    assert 0x100000 not in kept and 0x100000 + MAX_SITES_PER_PROGRAM in kept
    for p in range(MAX_PROGRAMS):
        sites.add(f"/tmp/prog{p}", maps, 0x100100, True)
    assert sites.addresses("/usr/bin/gzip", big) == []  # the oldest program went
    assert sites.addresses(f"/tmp/prog{MAX_PROGRAMS - 1}", maps) == [(0x100100, True)]
    assert len(sites) == MAX_PROGRAMS


class CopyUnwinder(FakeUnwinder):
    """Walks a copied stack as the real one would be asked to: records what it was
    given and answers the frames a walk of that memory found."""

    def __init__(self, found: tuple[int, ...]) -> None:
        self.found = found
        self.asked: list[tuple[int, int, int, int, int | None]] = []

    def unwind(self, pid: int, tid: int, pc: int, sp: int, bp: int | None = None, *,
               maps: Any = None, mem: Any = None) -> UnwindResult:
        self.asked.append((pid, pc, sp, bp or 0, mem.u64(sp)))
        return UnwindResult(self.found, StopReason.OUTERMOST)


def test_a_stack_copy_teaches_every_rule_its_stack_needs_at_once() -> None:
    """The probe sent a new stack whose walk ended on a broken rbp chain with its top
    bytes: unwound here (the copy is the memory), each of its pcs is taught, so the
    site's next walk is whole, not a frame longer (offcpu.c copy_stack)."""
    probe = FakeProbe()
    found = (0x1000, 0x1500, 0x2500, 0x3000)
    unwinder = CopyUnwinder(found)
    repair = UserStackRepair(unwinder, probe.teach, forget=probe.forget,  # type: ignore[arg-type]
                             maps=lambda pid, pc, start: [])
    copy = StackCopy(sid=5, tgid=100, pc=0x1000, sp=0x7000, bp=0x7100, data=struct.pack("<Q", 42) * 8)
    assert repair.learn_from_copy(100, 7, copy) == 4
    assert unwinder.asked == [(100, 0x1000, 0x7000, 0x7100, 42)]
    assert {pc for pid, pc in probe.rules if pid == 100} == set(found)
    assert repair.stats.copies_learned == 1
    # Taught once: a second copy of the site teaches nothing new.
    assert repair.learn_from_copy(100, 7, copy) == 0
    # A process gone (start 0) is taught nothing; a pid now another process's
    # (another start) first gives its old rules back.
    assert repair.learn_from_copy(200, 0, copy) == 0 and unwinder.asked[-1][0] == 100
    assert repair.learn_from_copy(100, 8, copy) == 4
    assert probe.forgotten == [{100}]


class CopyRules(RulesByPc):
    """Rules by pc (the cut is judged by them), and a copy's walk as CopyUnwinder's."""

    def __init__(self, rules: dict[int, Rule], found: tuple[int, ...], reason: StopReason) -> None:
        super().__init__(rules)
        self.found = found
        self.reason = reason
        self.walked: list[tuple[int, Any]] = []

    def unwind(self, pid: int, tid: int, pc: int, sp: int, bp: int | None = None, *,
               maps: Any = None, mem: Any = None) -> UnwindResult:
        self.walked.append((pid, maps))
        return UnwindResult(self.found, self.reason)


def test_a_cut_stack_is_read_on_from_its_copy_living_or_gone() -> None:
    """A walk the probe cut (no rule yet where it ended) is the same stack as the
    copy of its top unwound here: the stack shown is the copy's walk, whole if that
    reached the outermost frame, from the first sighting on, not only the next
    walk's. A gone process (start 0: an exec'd `sleep 0.01`, never seen alive) is
    taught nothing, but its copy is unwound in its own mappings (the ones the kernel
    sent, offtop.bpf.sent_maps): no mappings, no unwinding. A copy's walk that does
    not begin with the frames the probe's walk trusted is not taken."""
    probe = FakeProbe()
    whole = (0x1000, 0x2000, 0x3000, 0x4000)
    rules = {0x1000: FP, 0x1fff: NO_FP, 0x2fff: NO_FP, 0x3fff: OUTERMOST}
    mapped = [ExecMapping(0x1000, 0x5000, 0, "/bin/x", "")]
    known = {100: mapped, 200: mapped}
    unwinder = CopyRules(rules, whole, StopReason.OUTERMOST)
    repair = UserStackRepair(unwinder, probe.teach,  # type: ignore[arg-type]
                             maps=lambda pid, pc, start: known.get(pid, []))
    cut = (0x1000, 0x2000 | FP_FRAME_TAG)
    copy = StackCopy(sid=5, tgid=100, pc=0x1000, sp=0x7000, bp=0x7100, data=bytes(64))
    assert repair.repair(100, cut, start=7) == ((0x1000, 0x2000), True)  # no copy: cut
    assert repair.repair(100, cut, start=7, copy=copy) == (whole, False)
    assert repair.repair(200, cut, start=0, copy=copy) == (whole, False)
    assert not any(pid == 200 for pid, _ in probe.rules)  # gone: nobody taught
    assert unwinder.walked[-1] == (200, mapped)
    asked = len(unwinder.walked)
    assert repair.repair(300, cut, start=0, copy=copy) == ((0x1000, 0x2000), True)
    assert len(unwinder.walked) == asked  # no mappings known: not unwound
    assert repair.stats.copies_unwound == 2
    # A walk that stopped short of the outermost frame: longer, still marked cut.
    unwinder.found, unwinder.reason = whole[:3], StopReason.STACK_READ
    assert repair.repair(200, cut, start=0, copy=copy) == (whole[:3], True)
    # One that disagrees with the probe's trusted frames is not taken.
    unwinder.found, unwinder.reason = (0x1000, 0x2500, 0x3000), StopReason.OUTERMOST
    assert repair.repair(200, cut, start=0, copy=copy) == ((0x1000, 0x2000), True)
    # Nor one of another top (the copy of another walk).
    unwinder.found = whole
    other = StackCopy(sid=5, tgid=200, pc=0x1004, sp=0x7000, bp=0x7100, data=bytes(64))
    assert repair.repair(200, cut, start=0, copy=other) == ((0x1000, 0x2000), True)
