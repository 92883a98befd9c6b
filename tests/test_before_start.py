"""BeforeStart.seed: threads blocked before offtop started, found in the real /proc and
handed to a fake probe (what is seeded, not what the kernel does with it: the BPF
end-to-end tests cover that)."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from offtop.bpf.before_start import BeforeStart
from offtop.bpf.decode import StartRecord


class FakeProbe:
    """Records seeded records; `recorded` are the threads it already has a record of."""

    def __init__(self, recorded: set[int], took: set[int] = frozenset()) -> None:  # type: ignore[assignment]
        self.recorded = recorded
        self.took = took  # seeds the program took before they could be taken back
        self.seeded: dict[int, StartRecord] = {}
        self.bulk_reads = 0

    def recorded_tids(self) -> set[int]:
        self.bulk_reads += 1
        return set(self.recorded)

    def seed_record(self, tid: int, rec: StartRecord) -> bool:
        self.seeded[tid] = rec
        return True

    def unseed(self, tid: int, ts: int) -> bool:
        if tid in self.took:
            return False
        return self.seeded.pop(tid, None) is not None


@pytest.fixture
def sleepers() -> Iterator[list[int]]:
    """Three of Debian's `sleep`, each asleep in the kernel by the time they are given."""
    procs = [subprocess.Popen(["sleep", "60"]) for _ in range(3)]
    try:
        deadline = time.monotonic() + 10
        for p in procs:
            while Path(f"/proc/{p.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "S":
                assert time.monotonic() < deadline, "sleep did not sleep"
                time.sleep(0.01)
        yield [p.pid for p in procs]
    finally:
        for p in procs:
            p.kill()
            p.wait()


def test_threads_blocked_before_the_start_are_seeded_but_those_the_probe_has(sleepers: list[int]
                                                                            ) -> None:
    first, *rest = sleepers
    probe = FakeProbe(recorded={first})
    before = BeforeStart(probe, states="SD", kthreads=False, user_stacks=True,
                         accept=lambda pid, tid: pid in sleepers)
    assert before.seed() == 2
    assert sorted(probe.seeded) == sorted(rest) and probe.bulk_reads == 1
    blocks = dict(before.blocks())
    assert sorted(blocks) == sorted(rest)
    a, b = (blocks[pid] for pid in rest)
    assert any(f.name == "hrtimer_nanosleep" for f in a.kernel)
    # One pool's threads wait in the same place: one tuple of frames for all of them.
    assert a.kernel is b.kernel


def test_a_seed_the_probe_took_keeps_its_frames_one_taken_back_does_not(
        sleepers: list[int], monkeypatch: pytest.MonkeyPatch) -> None:
    """Threads that ran between their seeding and the check after it (a fake
    exec_start, moved for all): a seed taken back is forgotten; one the program
    took first began a block that ended meanwhile, summed as from before the start,
    which keeps its frames (else its row had none at all)."""
    import offtop.bpf.before_start as before_start

    monkeypatch.setattr(before_start, "exec_start_ns", lambda pid, tid: -1)
    took, *taken_back = sleepers
    probe = FakeProbe(recorded=set(), took={took})
    before = BeforeStart(probe, states="SD", kthreads=False, user_stacks=True,
                         accept=lambda pid, tid: pid in sleepers)
    assert before.seed() == 1
    assert sorted(probe.seeded) == [took]
    kept = before.pop(took)
    assert kept is not None and any(f.name == "hrtimer_nanosleep" for f in kept.kernel)
    assert all(before.pop(tid) is None for tid in taken_back)


def test_threads_out_of_scope_are_not_read(monkeypatch: pytest.MonkeyPatch) -> None:
    """`offtop -p PID` looks for its target's block from before the start in /proc
    within a budget: the walk reads no other thread's stat (it read every thread's,
    ~20 µs each, and a target late in /proc's order on a machine of 10,000 threads
    could be past the deadline: its block never seeded, never counted)."""
    from offtop import proc_tasks

    read: list[tuple[int, int]] = []
    stat = proc_tasks.task_stat

    def counted(pid: int, tid: int, proc: str = "/proc") -> proc_tasks.TaskStat | None:
        read.append((pid, tid))
        return stat(pid, tid, proc)

    monkeypatch.setattr(proc_tasks, "task_stat", counted)
    sleeper = subprocess.Popen(["/usr/bin/sleep", "30"])
    try:
        deadline = time.monotonic() + 10
        found: list[proc_tasks.BlockedTask] = []
        while not found and time.monotonic() < deadline:
            found = proc_tasks.blocked_tasks(
                "S", accept=lambda pid, tid: pid == sleeper.pid, kthreads=False,
                clock=proc_tasks.SchedClock())
        assert [(t.pid, t.tid) for t in found] == [(sleeper.pid, sleeper.pid)]
        assert read and {pid for pid, _tid in read} == {sleeper.pid}
    finally:
        sleeper.kill()
        sleeper.wait()
