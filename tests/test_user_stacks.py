"""UserStackRepair's rules over processes' lives: taught per process, forgotten
on both sides once it is gone or its pid is another's (no BPF: the probe's
side is a recording fake)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from offtop.bpf.user_stacks import RULE_FP, UserStackRepair
from offtop.unwind.maps import ExecMapping


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
