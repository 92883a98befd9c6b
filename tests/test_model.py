"""Unit tests of the pure model: aggregation, ranking, totals, forgetting."""

from __future__ import annotations

from offtop.model import Aggregator, Frame, Sample, group_processes, stack_key

K = (Frame("schedule", "kernel", True), Frame("do_nanosleep", "kernel", True))
U = (Frame("offtop_wl_sleep", "wl"), Frame("main", "wl"))


def s(tid: int, ns: int, *, pid: int = 10, state: str = "S", count: int = 1, event: bool = False,
      kernel: tuple[Frame, ...] = K, user: tuple[Frame, ...] = U, comm: str = "wl") -> Sample:
    return Sample(pid=pid, tid=tid, comm=comm, state=state, offcpu_ns=ns, count=count, max_ns=ns,
                  kernel=kernel, user=user, from_event=event)


def build(agg: Aggregator, samples: list[Sample]):  # type: ignore[no-untyped-def]
    return agg.build(samples, time=1000.0, interval_s=1.0, threshold_ns=500)


def test_tasks_are_summed_split_by_state_and_ranked() -> None:
    snap = build(Aggregator(), [
        s(11, 300, state="S"), s(11, 200, state="D", count=2), s(12, 900), s(11, 100, event=True),
    ])
    assert [t.tid for t in snap.tasks] == [12, 11]
    t11 = snap.tasks[1]
    assert t11.offcpu_ns == 600 and t11.count == 4 and t11.events == 1
    assert t11.state_ns == {"S": 400, "D": 200}
    assert t11.max_ns == 300


def test_samples_with_equal_frames_merge_into_one_stack_row() -> None:
    snap = build(Aggregator(), [s(11, 100), s(11, 50, event=True), s(11, 70, user=U[1:])])
    rows = snap.stacks_of(11)
    assert [(r.offcpu_ns, r.count) for r in rows] == [(150, 2), (70, 1)]
    assert rows[0].key == stack_key(11, "S", K, U) != rows[1].key


def test_totals_accumulate_across_intervals_and_reset_on_pid_change() -> None:
    agg = Aggregator()
    build(agg, [s(11, 100)])
    snap = build(agg, [s(11, 50)])
    assert snap.tasks[0].total_ns == 150 and snap.tasks[0].offcpu_ns == 50
    snap = build(agg, [s(11, 7, pid=99)])  # tid reused by another process
    assert snap.tasks[0].total_ns == 7


def test_forgetting_bounds_totals() -> None:
    agg = Aggregator(forget_after=2)
    for i in range(70):
        build(agg, [s(1000 + i, 1)])
    assert agg.tracked_threads < 70


def test_processes_sum_threads_and_take_the_main_threads_name() -> None:
    snap = build(Aggregator(), [s(11, 100, comm="worker"), s(10, 50, comm="server"), s(20, 5, pid=20)])
    procs = group_processes(snap.tasks)
    assert [(p.pid, p.comm, p.threads, p.offcpu_ns) for p in procs] == [
        (10, "server", 2, 150), (20, "wl", 1, 5)]
    assert snap.processes == procs


def test_empty_interval_and_zero_guards() -> None:
    snap = build(Aggregator(), [])
    assert snap.tasks == () and snap.total_offcpu_ns == 0
    assert snap.stats.events_per_s == 0 and snap.stats.probe_ns_per_switch == 0


def test_frames_know_when_they_are_unknown() -> None:
    assert Frame("0x7f00").unknown and Frame("[libc.so.6+0x10]").unknown
    assert not Frame("main").unknown


def test_process_metadata_is_attached_to_the_top_processes_only() -> None:
    asked: list[int] = []

    def meta(pid: int) -> tuple[str, str] | None:
        asked.append(pid)
        return None if pid == 30 else ("alice", f"/bin/app{pid}")

    snap = Aggregator().build([s(1, 300, pid=10), s(2, 200, pid=20), s(3, 100, pid=30)],
                              time=1.0, interval_s=1.0, threshold_ns=1, process_meta=meta,
                              meta_limit=3)
    assert [(p.user, p.cmdline) for p in snap.processes] == [
        ("alice", "/bin/app10"), ("alice", "/bin/app20"), ("", "")]
    procs = Aggregator().build([s(1, 300, pid=10), s(2, 200, pid=20)], time=1.0, interval_s=1.0,
                               threshold_ns=1, process_meta=meta, meta_limit=1).processes
    assert procs[1].cmdline == ""
