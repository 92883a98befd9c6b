"""Unit tests of the pure model: aggregation, ranking, totals, forgetting, and the
views the TUI derives (row keys, the snapshot index, idle waits, merging, since start)."""

from __future__ import annotations

import dataclasses
import gc
from typing import Any

from offtop.model import (
    Aggregator,
    ChainCatalog,
    Frame,
    RowKey,
    Sample,
    SinceStart,
    Snapshot,
    SnapshotIndex,
    StackRow,
    blocked_in,
    group_processes,
    is_idle_wait,
    merge_identical,
    stack_key,
)

K = (Frame("schedule", "kernel", True), Frame("do_nanosleep", "kernel", True))
U = (Frame("offtop_wl_sleep", "wl"), Frame("main", "wl"))


def s(tid: int, ns: int, *, pid: int = 10, state: str = "S", count: int = 1, event: bool = False,
      kernel: tuple[Frame, ...] = K, user: tuple[Frame, ...] = U, comm: str = "wl") -> Sample:
    return Sample(pid=pid, tid=tid, comm=comm, state=state, offcpu_ns=ns, count=count, max_ns=ns,
                  kernel=kernel, user=user, from_event=event)


def build(agg: Aggregator, samples: list[Sample]) -> Snapshot:
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


def test_threads_of_processes_gone_are_forgotten_but_not_those_just_seen() -> None:
    agg = Aggregator()
    started = {10: 500, 20: 600}  # pid 30 is gone; pid 20 is now another process
    build(agg, [dataclasses.replace(s(11, 1, pid=10), start=500),
                dataclasses.replace(s(21, 1, pid=20), start=599), s(31, 1, pid=30)])
    build(agg, [s(12, 1, pid=30)])  # seen in the last interval: its last rows may still come
    build(agg, [s(13, 1, pid=30)])
    asked: list[int] = []

    def start_time(pid: int) -> int | None:
        asked.append(pid)
        return started.get(pid)

    assert agg.forget_gone(start_time) == 2  # 21 (pid reused) and 31 (gone)
    assert sorted(asked) == [10, 20, 30]  # each process once
    snap = build(agg, [s(11, 1, pid=10), s(12, 1, pid=30), s(13, 1, pid=30), s(31, 1, pid=30)])
    assert {t.tid: t.total_ns for t in snap.tasks} == {11: 2, 12: 2, 13: 2, 31: 1}


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


# --- views of a snapshot: row keys, the index, idle waits, merging, since start ----------

def kf(*names: str) -> tuple[Frame, ...]:
    return tuple(Frame(n, "kernel", True) for n in names)


def uf(*names: str, module: str = "/usr/bin/app") -> tuple[Frame, ...]:
    return tuple(Frame(n, module) for n in names)


EPOLL = kf("schedule", "schedule_hrtimeout_range_clock", "ep_poll", "do_epoll_wait")
FUTEX = kf("schedule", "futex_wait_queue", "futex_wait", "do_futex")
SLEEP = kf("schedule", "do_nanosleep", "hrtimer_nanosleep")


def test_row_keys_name_threads_and_processes_apart() -> None:
    snap = build(Aggregator(), [s(11, 100), s(12, 50)])
    assert snap.tasks[0].key == RowKey.thread(11) != RowKey.process(11)
    assert snap.processes[0].key == RowKey.process(10) and RowKey.process(10).is_process
    assert str(RowKey.thread(11)) == "thread 11"
    assert sorted([RowKey.thread(2), RowKey.process(1), RowKey.thread(1)])[0] == RowKey.process(1)


def test_the_index_groups_stacks_and_maps_threads_to_processes() -> None:
    snap = build(Aggregator(), [s(11, 100), s(11, 40, user=U[1:]), s(12, 50), s(30, 5, pid=30)])
    index = SnapshotIndex(snap)
    assert [r.offcpu_ns for r in index.stacks_of(RowKey.thread(11))] == [100, 40]
    assert [r.tid for r in index.stacks_of(RowKey.process(10))] == [11, 12, 11]
    assert index.stacks_of(RowKey.thread(99)) == ()
    assert index.counterpart(RowKey.thread(12)) == RowKey.process(10)
    # A process's main thread, else its hottest thread.
    assert index.counterpart(RowKey.process(30)) == RowKey.thread(30)
    assert index.counterpart(RowKey.process(10)) == RowKey.thread(11)
    assert index.counterpart(RowKey.thread(99)) is None
    assert index.rows[RowKey.process(10)].offcpu_ns == 190
    # The hottest stack of a thread and of a process, told apart though tid 30 is pid 30.
    assert index.hottest(RowKey.thread(11)) is index.stacks_of(RowKey.thread(11))[0]
    assert index.hottest(RowKey.process(10)).offcpu_ns == 100  # type: ignore[union-attr]
    assert index.hottest(RowKey.thread(12)).offcpu_ns == 50  # type: ignore[union-attr]
    assert index.hottest(RowKey.thread(30)) is index.hottest(RowKey.process(30)) is not None
    assert index.hottest(RowKey.thread(10)) is None and index.hottest(RowKey.process(11)) is None


def test_idle_waits_follow_the_documented_rule() -> None:
    assert is_idle_wait(EPOLL, uf("epoll_wait", "main"))
    assert is_idle_wait(kf("schedule", "do_select", "core_sys_select"), ())
    assert is_idle_wait(kf("schedule", "do_wait", "kernel_wait4"), uf("wait4", "main"))
    assert is_idle_wait(kf("schedule", "worker_thread", "kthread"), ())
    # A futex wait is idle only under a thread pool's wait-for-work frame.
    assert is_idle_wait(FUTEX, uf("syscall", "g_thread_pool_wait_for_new_task"))
    assert is_idle_wait(FUTEX, uf("runtime.futex", "runtime.notesleep", "runtime.stopm"))
    assert is_idle_wait(FUTEX, uf("py:_worker (thread.py:89)"))
    assert not is_idle_wait(FUTEX, uf("pthread_cond_wait", "Queue::pop", "main"))
    assert not is_idle_wait(kf("schedule", "do_epoll_ctl"), uf("main"))
    assert not is_idle_wait(SLEEP, uf("nanosleep", "main"))  # a sleep is asked for
    assert not is_idle_wait(kf("schedule", "io_schedule", "filemap_read"), ())


def test_blocked_in_is_the_innermost_frame_that_names_the_program() -> None:
    libc = "/usr/lib/x86_64-linux-gnu/libc.so.6"
    user = (Frame("__GI___clock_nanosleep", libc), Frame("sleep_for", "/bin/app"),
            Frame("main", "/bin/app"))
    assert blocked_in(SLEEP, user) == user[1]
    py = (Frame("read", libc), Frame("py:Queue.get (queue.py:171)", "queue.py"),
          Frame("py:worker (app.py:9)", "app.py"))
    assert blocked_in(SLEEP, py) == py[1]
    # Unresolved frames and marks are never the answer: the kernel's is.
    lost = (Frame("[user stack lost]"), Frame("libc.so.6+0x1234", libc))
    assert blocked_in(SLEEP, lost) == SLEEP[1]
    assert blocked_in(kf("schedule"), ()) is None


def test_the_catalog_knows_a_chain_by_identity_and_by_name() -> None:
    cat = ChainCatalog()
    user = uf("epoll_wait", "main")
    a = cat.info(EPOLL, user)
    assert a.idle and a.blocked_in == user[0]
    assert cat.info(EPOLL, user) is a
    # The same frames in new tuples (a replay) are the same chain.
    assert cat.info(tuple(EPOLL), tuple(list(user))).chain == a.chain
    assert cat.info(SLEEP, user).chain != a.chain
    # Bounded: past the limit all is forgotten, numbers are never reused.
    small = ChainCatalog(max_entries=2)
    first = small.info(EPOLL, user).chain
    small.info(SLEEP, user)
    assert small.info(FUTEX, user).chain not in (first,)
    assert small.info(kf("x"), ()).chain > first


def test_the_catalog_forgets_chains_not_asked_for_over_two_generations() -> None:
    cat = ChainCatalog()
    user = uf("epoll_wait", "main")
    a = cat.info(EPOLL, user)
    cat.next_generation()
    assert cat.info(EPOLL, user) is a and len(cat) == 1  # from the last one: kept on
    cat.next_generation()
    assert cat.info(tuple(EPOLL), tuple(user)) is a  # by its names, in new tuples
    cat.next_generation()
    cat.next_generation()
    assert len(cat) == 0  # a process gone: nothing of it left
    assert cat.info(EPOLL, user).chain > a.chain  # found afresh: never an old number


def test_the_catalog_tells_about_how_many_chains_are_new() -> None:
    cat = ChainCatalog()
    rows = [stack(1, 5), stack(2, 5, EPOLL), stack(3, 5, FUTEX)]
    assert cat.new_chains(rows) == 3
    cat.info(EPOLL, U)
    assert cat.new_chains(rows) == 2
    # Counting asks for nothing: what was not asked for goes as before.
    cat.next_generation()
    cat.new_chains(rows)
    cat.next_generation()
    assert cat.new_chains(rows) == 3
    # The same frames in new tuples: not known by identity (a merge would work them out).
    cat.info(SLEEP, U)
    assert cat.new_chains([stack(4, 5, tuple(list(SLEEP)))]) == 1
    # Many stacks: counted on an even sample, scaled.
    many = [stack(i, 5, kf(f"k{i}")) for i in range(10_000)]
    for s in many[: len(many) // 4]:
        cat.info(s.kernel, s.user)
    assert cat.new_chains(many, sample=100) == 7_500


def stack(tid: int, ns: int, kernel: tuple[Frame, ...] = SLEEP, *, pid: int = 10,
          comm: str = "wl", state: str = "S", count: int = 1) -> StackRow:
    return StackRow(pid=pid, tid=tid, comm=comm, state=state, offcpu_ns=ns, count=count,
                    max_ns=ns, kernel=kernel, user=U)


def test_identical_stacks_merge_across_threads_and_commands() -> None:
    rows = [stack(11, 100), stack(12, 50), stack(13, 70, pid=20), stack(21, 30, pid=30,
                                                                          comm="other"),
            stack(11, 10, EPOLL)]
    facts = SnapshotIndex(build(Aggregator(), [])).facts_of
    none, n = merge_identical(rows, "none", facts)
    assert [m.row.offcpu_ns for m in none] == [100, 50, 70, 30, 10] and n == 5
    assert merge_identical(rows, "none", facts, limit=2)[0] == none[:2]
    by_process, n = merge_identical(rows, "process", facts)
    assert n == 4
    assert [(m.row.pid, m.row.offcpu_ns, m.row.count, m.threads, m.processes)
            for m in by_process] == [(10, 150, 2, 2, 1), (20, 70, 1, 1, 1), (30, 30, 1, 1, 1),
                                     (10, 10, 1, 1, 1)]
    assert by_process[0].row.tid == 11 and by_process[0].row.max_ns == 100
    by_command, n = merge_identical(rows, "command", facts)
    assert [(m.row.comm, m.row.offcpu_ns, m.threads, m.processes) for m in by_command] == [
        ("wl", 220, 3, 2), ("other", 30, 1, 1), ("wl", 10, 1, 1)] and n == 3
    top, n = merge_identical(rows, "command", facts, limit=1)
    assert top == by_command[:1] and n == 3


def test_the_facts_of_many_stacks_are_worked_out_once_a_snapshot() -> None:
    """A merge of all stacks (or the idle pass) asks for every stack's facts:
    worked out once for the whole snapshot and kept by the stack, so the next
    merge (idle waits hidden, merged another way) looks each up in one step.
    Stacks of no snapshot (since-start rows) are worked out as before."""
    many = tuple(stack(i, 5_000 - i, kf(f"k{i % 700}")) for i in range(1_500))
    snap = Snapshot(seq=1, time=0.0, interval_s=1.0, threshold_ns=0, stacks=many)
    catalog = ChainCatalog()
    asked: list[int] = []
    infos = catalog.infos

    def counted(stacks: Any) -> Any:
        asked.append(len(stacks))
        return infos(stacks)
    catalog.infos = counted  # type: ignore[method-assign]
    index = SnapshotIndex(snap, catalog)
    first = index.facts_of(many)
    assert asked == [1_500] and len({f.chain for f in first}) == 700
    assert index.facts_of(many[200:1_400]) == first[200:1_400] and asked == [1_500]
    foreign = stack(1, 1, kf("k3"))
    mixed = index.facts_of([many[3], foreign, many[4]])
    assert asked == [1_500, 1] and mixed[1].chain == mixed[0].chain == first[3].chain
    assert [m.row.offcpu_ns for m in merge_identical(many, "process", index.facts_of)[0][:2]
            ] == [5_000 + 4_300 + 3_600, 4_999 + 4_299 + 3_599] and asked == [1_500, 1]
    # Few stacks (a task's) are worked out as asked, nothing kept for the snapshot.
    few = SnapshotIndex(snap, catalog)
    assert few.facts_of(many[:5]) == first[:5] and asked[-1] == 5


def test_the_index_filters_idle_waits_and_finds_frame_text() -> None:
    snap = build(Aggregator(), [s(11, 100, kernel=EPOLL), s(11, 40), s(12, 60, pid=12)])
    index = SnapshotIndex(snap)
    assert index.idle_ns(RowKey.thread(11)) == 100 and index.idle_ns(RowKey.thread(12)) == 0
    assert index.idle_ns(RowKey.process(10)) == 100
    assert [r.offcpu_ns for r in index.view(snap.stacks, hide_idle=True)] == [60, 40]
    assert [r.offcpu_ns for r in index.view(snap.stacks, text="EP_POLL")] == [100]
    assert index.frames_contain(RowKey.thread(11), "ep_poll")
    assert not index.frames_contain(RowKey.thread(12), "ep_poll")
    assert index.frames_contain(RowKey.process(12), "NANOSLEEP")
    assert not index.frames_contain(RowKey.process(10), "nothing like it")


def test_since_start_sums_every_snapshot_and_stays_bounded() -> None:
    agg, since = Aggregator(), SinceStart()
    for ns in (100, 200, 300):
        since.add(SnapshotIndex(build(agg, [s(11, ns), s(12, 5)])))
    ranked = since.ranked()
    assert [(r.tid, r.offcpu_ns, r.count) for r in ranked] == [(11, 600, 3), (12, 15, 3)]
    assert since.snapshots == 3 and since.since == 999.0
    small = SinceStart(max_entries=4)
    small.add(SnapshotIndex(build(agg, [s(t, t) for t in range(1, 6)])))
    kept = small.ranked()
    assert [r.tid for r in kept] == [5, 4, 3]
    assert small.dropped_ns == 1 + 2


def test_since_start_takes_a_renamed_threads_new_name_and_holds_no_rows() -> None:
    """The totals keep the sums of each stack and what its key does not say (pid,
    comm, frames), not a row: a row kept per total held its first snapshot's sums and
    wakers too (a busy server's since-start totals are the TUI's biggest data)."""
    from offtop.model import Waker

    agg, since = Aggregator(), SinceStart()
    timer = Waker(0, 0, "", "timer")
    for comm in ("before", "before", "after"):
        since.add(SnapshotIndex(build(agg, [dataclasses.replace(s(11, 100, comm=comm),
                                                                 waker=timer)])))
    assert build(agg, [dataclasses.replace(s(11, 1), waker=timer)]).stacks[0].wakers
    since.fold()
    [row] = since.ranked()
    assert (row.comm, row.offcpu_ns, row.count) == ("after", 300, 3)
    marker = 987_654_321_123
    snap = build(agg, [dataclasses.replace(s(12, marker), waker=timer)])
    since.add(SnapshotIndex(snap))
    since.fold()
    del snap
    gc.collect()
    assert not [o for o in gc.get_objects()
                if isinstance(o, StackRow) and o.offcpu_ns == marker], "a row is held"
    assert [r.offcpu_ns for r in since.ranked()] == [marker, 300]


def test_a_stacks_blocks_are_summed_by_waker_whatever_their_order() -> None:
    """One stack's blocks, summed per waker: the first waker (kept apart from the
    others while it is the only one), equal wakers that are other objects, a
    second and a third waker, and blocks with no waker between them."""
    from offtop.model import Waker, WakerRow

    timer, a, b = Waker(0, 0, "", "timer"), Waker(10, 12, "a"), Waker(10, 13, "b")
    blocks = [(None, 1), (timer, 10), (Waker(0, 0, "", "timer"), 20), (a, 100), (None, 2),
              (timer, 30), (b, 1000), (a, 200), (Waker(10, 12, "a"), 300)]
    [row] = build(Aggregator(), [dataclasses.replace(s(11, ns), waker=w) for w, ns in blocks]).stacks
    assert (row.offcpu_ns, row.count) == (1663, 9)
    assert row.wakers == (WakerRow(b, 1000, 1), WakerRow(a, 600, 3), WakerRow(timer, 60, 3))
    [one] = build(Aggregator(), [dataclasses.replace(s(11, ns), waker=w)
                                 for w, ns in ((None, 5), (a, 7), (Waker(10, 12, "a"), 9))]).stacks
    assert one.wakers == (WakerRow(a, 16, 2),)
    assert build(Aggregator(), [s(11, 5), s(11, 6)]).stacks[0].wakers == ()


def test_a_build_makes_its_stacks_wakers_into_rows_only_when_asked() -> None:
    """A busy server's build has ~10,000 stacks, each with its wakers; the screen
    shows one stack's. They are summed at the build (the engine's rows change after
    it) and made into rows when asked: the build itself leaves no waker row for
    the GC to walk. Such a row equals one given its wakers whole."""
    from offtop.model import Waker, WakerRow, WakerSums

    timer, a = Waker(0, 0, "", "timer"), Waker(10, 12, "a")
    samples = [dataclasses.replace(s(100 + i, 1000 + i, user=(Frame(f"f{i}", "wl"),)),
                                   waker=timer if i % 2 else a) for i in range(2000)]
    samples.append(dataclasses.replace(s(100, 5), waker=timer))  # a second waker for one stack
    gc.collect()
    before = sum(1 for o in gc.get_objects() if isinstance(o, WakerRow))
    snap = build(Aggregator(), samples)
    assert sum(1 for o in gc.get_objects() if isinstance(o, WakerRow)) == before
    samples[1] = dataclasses.replace(samples[1], offcpu_ns=1)  # what the build saw is kept
    by_user = {r.user[0].name: r for r in snap.stacks}
    assert by_user["f1"].wakers == (WakerRow(timer, 1001, 1),)
    assert by_user["f0"].wakers == (WakerRow(a, 1000, 1),)
    [both] = [r for r in snap.stacks if r.tid == 100 and r.user == U]
    assert both.wakers == (WakerRow(timer, 5, 1),)
    whole = StackRow(both.pid, both.tid, both.comm, both.state, both.offcpu_ns, both.count,
                     both.max_ns, both.kernel, both.user, waker_rows=(WakerRow(timer, 5, 1),))
    assert whole == both and hash(whole) == hash(both)
    assert whole != dataclasses.replace(whole, waker_rows=(WakerRow(timer, 6, 1),))
    # A row kept past its snapshot keeps the sums of a few stacks, not of all 2,001.
    assert both.waker_sums is not None and 0 < len(both.waker_sums) <= WakerSums.CHUNK
    assert sum({id(r.waker_sums): len(r.waker_sums) for r in snap.stacks
                if r.waker_sums is not None}.values()) == len(snap.stacks)


def test_a_stack_cap_keeps_the_top_rows_and_counts_the_rest() -> None:
    """Batch output that prints the top N asks for N rows: the others are counted,
    in the snapshot and in JSON (also read back), never dropped silently."""
    from offtop.snapshot_json import snapshot_from_json, snapshot_to_json

    samples = [s(10 + i, 100 * (i + 1), user=(Frame(f"f{i}", "wl"),)) for i in range(6)]
    whole = build(Aggregator(), samples)
    agg = Aggregator()
    agg.max_stacks = 2
    top = build(agg, samples)
    assert top.stacks == whole.stacks[:2] and top.omitted_stacks == 4
    assert top.tasks == whole.tasks  # tasks are all there
    d = snapshot_to_json(top, limit=1)
    assert len(d["stacks"]) == 1 and d["omitted"]["stacks"] == 5
    back = snapshot_from_json(d)
    assert back.omitted_stacks == 5
    assert snapshot_to_json(back)["omitted"]["stacks"] == 5
    assert whole.omitted_stacks == 0


def test_a_small_stack_cap_ranks_as_the_whole_list_does_ties_included() -> None:
    samples = [s(10 + i, 100 * (i % 3 + 1), user=(Frame(f"f{i}", "wl"),)) for i in range(40)]
    whole = build(Aggregator(), samples)
    for cap in (1, 3, 7):
        agg = Aggregator()
        agg.max_stacks = cap  # under a quarter of the stacks: cut by time first
        top = build(agg, samples)
        assert top.stacks == whole.stacks[:cap] and top.omitted_stacks == 40 - cap


def test_since_start_sheds_down_to_three_quarters_even_among_equal_totals() -> None:
    agg, since = Aggregator(), SinceStart(max_entries=8)
    since.add(SnapshotIndex(build(agg, [s(t, 5) for t in range(1, 11)])))
    assert len(since.ranked()) == 6 and since.dropped_ns == 4 * 5
    # Shedding waits for another quarter of new keys, then drops the lightest.
    since.add(SnapshotIndex(build(agg, [s(20, 1), s(21, 1)])))
    assert len(since.ranked()) == 8
    since.add(SnapshotIndex(build(agg, [s(30, 100)])))
    kept = since.ranked()
    assert len(kept) == 6 and kept[0].tid == 30 and all(r.tid < 20 for r in kept[1:])
    assert since.dropped_ns == 4 * 5 + 2 * 1 + 5


def test_since_start_keeps_summing_a_live_stack_among_heavier_ones_of_threads_gone() -> None:
    """Process churn fills the totals with stacks of threads gone, each heavier than
    one interval of a live thread: those are shed first, so a stack in every
    snapshot keeps its whole total (it was shed at each snapshot, its total
    never more than two intervals')."""
    agg, since = Aggregator(), SinceStart(max_entries=8)
    added = 0
    for k in range(6):
        gone = [s(100 + 4 * k + i, 100, pid=100 + 4 * k + i) for i in range(4)]
        since.add(SnapshotIndex(build(agg, [s(1, 10), *gone])))
        added += 10 + 4 * 100
    ranked = since.ranked()
    assert [(r.offcpu_ns, r.count) for r in ranked if r.tid == 1] == [(60, 6)]
    assert len(ranked) <= 8 and since.dropped_ns > 0
    assert sum(r.offcpu_ns for r in ranked) + since.dropped_ns == added


def test_since_start_holds_sums_past_64_bits_at_the_most() -> None:
    """A replayed file may hold counts up to 2^64: sums past what a cell holds stay at
    its most, whichever sum overflows first, on a new key or a kept one; nothing raises."""
    agg, since, most = Aggregator(), SinceStart(), 2**64 - 1
    since.add(SnapshotIndex(build(agg, [s(11, most), s(12, 5, count=most)])))
    since.add(SnapshotIndex(build(agg, [s(11, 7), s(12, 5, count=3), s(13, 2**64, count=2)])))
    since.add(SnapshotIndex(build(agg, [s(11, 1, comm="renamed"), s(13, 1)])))
    got = {r.tid: (r.offcpu_ns, r.count, r.max_ns, r.comm) for r in since.ranked()}
    assert got == {11: (most, 3, most, "renamed"), 12: (10, most, 5, "wl"),
                   13: (most, 3, most, "wl")}


def test_since_start_totals_leave_the_cyclic_gc_nothing_to_walk() -> None:
    """The totals live a session long and every full GC pass walks what lives: 1,000
    keys add no object the GC tracks once a pass has seen them (one per key made
    the pass ~15 ms slower at 20,000 keys; their frames are the rows')."""
    import gc

    since = SinceStart()
    since.add(SnapshotIndex(build(Aggregator(), [s(1, 1)])))
    since.fold()
    gc.collect()
    before = len(gc.get_objects())
    since.add(SnapshotIndex(build(Aggregator(), [s(t, t) for t in range(2, 1_002)])))
    since.fold()
    gc.collect()
    assert len(gc.get_objects()) - before < 20
    assert len(since.ranked()) == 1_001


def test_since_start_queues_what_is_added_and_a_ranking_sums_it_first() -> None:
    agg, since = Aggregator(), SinceStart()
    since.add(SnapshotIndex(build(agg, [s(11, 100)])))
    since.add(SnapshotIndex(build(agg, [s(11, 200), s(12, 5)])))
    assert since.pending == 2 and since.snapshots == 2
    since.fold()
    assert since.pending == 0
    since.add(SnapshotIndex(build(agg, [s(11, 300)])))
    assert [(r.tid, r.offcpu_ns, r.count) for r in since.ranked()] == [(11, 600, 3), (12, 5, 1)]
    assert since.pending == 0
    # Nothing folding: add folds once MAX_PENDING snapshots wait.
    for _ in range(SinceStart.MAX_PENDING + 1):
        since.add(SnapshotIndex(build(agg, [s(12, 1)])))
    assert since.pending == 0
    since.clear()
    since.add(SnapshotIndex(build(agg, [s(13, 7)])))
    since.clear()
    assert since.pending == 0 and since.ranked() == ()


def test_an_index_shares_the_catalog_it_is_given_even_an_empty_one() -> None:
    # An empty catalog is falsy (it has a length): the first snapshot's index
    # must still fill the shared one, or no later index finds anything kept.
    catalog = ChainCatalog()
    snap = Snapshot(seq=1, time=0.0, interval_s=1.0, threshold_ns=0)
    assert SnapshotIndex(snap, catalog).catalog is catalog


def _reference(samples: list[Sample], keep: int) -> tuple[list[Any], list[Any], int]:
    """What a build sums, written the plain way (the oracle of the test below): per
    thread, and per (thread, state, before start, frames) in the order first seen,
    wakers summed by equality in the order they came; stacks ranked by time, thread,
    state, then that order."""
    threads: dict[int, dict[str, Any]] = {}
    stacks: dict[tuple[Any, ...], dict[str, Any]] = {}
    for x in samples:
        t = threads.setdefault(x.tid, {"pid": x.pid, "comm": x.comm, "ns": 0, "count": 0,
                                       "max": 0, "states": {}, "events": 0})
        t["ns"] += x.offcpu_ns
        t["count"] += x.count
        t["max"] = max(t["max"], x.max_ns)
        t["states"][x.state] = t["states"].get(x.state, 0) + x.offcpu_ns
        t["events"] += x.count if x.from_event else 0
        t["comm"] = x.comm or t["comm"]
        st = stacks.setdefault((x.tid, x.state, x.before_start, x.kernel, x.user),
                               {"first": x, "ns": 0, "count": 0, "max": 0, "wakers": {}})
        st["ns"] += x.offcpu_ns
        st["count"] += x.count
        st["max"] = max(st["max"], x.max_ns)
        if x.waker is not None:
            w = st["wakers"].setdefault(x.waker, [0, 0])
            w[0] += x.offcpu_ns
            w[1] += x.count
    tasks = sorted(((-t["ns"], tid, t["pid"], t["comm"], t["count"], t["max"], t["states"],
                     t["events"]) for tid, t in threads.items()), key=lambda r: r[:2])
    order = list(stacks.values())
    ranked = sorted(range(len(order)), key=lambda i: (-order[i]["ns"], order[i]["first"].tid,
                                                      order[i]["first"].state, i))[:keep]
    rows = []
    for i in ranked:
        st, f = order[i], order[i]["first"]
        wakers = sorted(((-ns, w.tid, w.label, w, n) for w, (ns, n) in st["wakers"].items()),
                        key=lambda r: r[:3])
        rows.append((f.pid, f.tid, f.comm, f.state, st["ns"], st["count"], st["max"], f.kernel,
                     f.user, f.before_start, [(w, -ns, n) for ns, _t, _l, w, n in wakers]))
    return tasks, rows, len(order) - len(rows)


def test_builds_sum_as_the_plain_reference_does_on_random_samples() -> None:
    """Random intervals, several through one aggregator (its numbers kept across
    builds, and forgotten past a small bound): repeated stacks, equal frames and
    wakers in other objects, blocks with no waker, empty names, ties in time, a tid
    found in another process, small and large stack caps."""
    import random

    from offtop.model import Waker

    rng = random.Random(14)
    frames = [tuple(Frame(f"f{i}_{j}", "wl") for j in range(rng.randrange(1, 4))) for i in range(6)]
    kernels = [K, (Frame("schedule", "kernel", True),)]
    wakers = [Waker(0, 0, "", "timer"), Waker(10, 11, "a"), Waker(10, 12, "b"), None]
    for keep in (1, 3, 20_000):
        agg = Aggregator()
        agg.max_stacks = keep
        agg.groups.max_groups = 40  # forgotten every few builds
        for _ in range(30):
            samples = []
            spread = rng.choice((2, 7))  # few groups, each of many rows; or many groups
            for _ in range(rng.randrange(0, 60)):
                w = rng.choice(wakers)
                if w is not None and rng.random() < 0.3:
                    w = dataclasses.replace(w)  # equal, another object
                user = rng.choice(frames[:spread])
                if rng.random() < 0.2:
                    user = tuple(dataclasses.replace(f) for f in user)  # equal, another tuple
                samples.append(dataclasses.replace(
                    s(rng.randrange(1, 1 + spread), rng.choice((5, 7, 100, rng.randrange(1, 10**6))),
                      pid=rng.choice((10, 10, 10, 20)), state=rng.choice("SSD"),
                      count=rng.randrange(1, 4), event=rng.random() < 0.2,
                      kernel=rng.choice(kernels), user=user, comm=rng.choice(("wl", "wl", ""))),
                    max_ns=rng.randrange(1, 10**6), waker=w, before_start=rng.random() < 0.1,
                    start=rng.choice((0, 77))))
            snap = build(agg, samples)
            tasks, rows, omitted = _reference(samples, keep)
            assert [(-t.offcpu_ns, t.tid, t.pid, t.comm, t.count, t.max_ns, t.state_ns, t.events)
                    for t in snap.tasks] == tasks
            assert [(r.pid, r.tid, r.comm, r.state, r.offcpu_ns, r.count, r.max_ns, r.kernel,
                     r.user, r.before_start, [(w.waker, w.offcpu_ns, w.count) for w in r.wakers])
                    for r in snap.stacks] == rows
            assert snap.omitted_stacks == omitted
        assert agg.groups.generation > 0


def test_stack_groups_number_once_and_are_forgotten_only_when_a_build_starts() -> None:
    from offtop.model import StackGroups

    groups = StackGroups(max_groups=2)
    a = groups.number(1, "S", False, K, U)
    other = tuple(dataclasses.replace(f) for f in U)  # equal frames, another tuple
    assert other is not U and groups.number(1, "S", False, K, other) == a
    b = groups.number(1, "D", False, K, U)
    c = groups.number(2, "S", False, K, U)
    assert len({a, b, c}) == 3 and groups.thread_of[a] == groups.thread_of[b] != groups.thread_of[c]
    assert groups.number(3, "S", False, K, U) == 3  # past the bound: nothing forgotten yet
    assert groups.start_build() and groups.generation == 1 and len(groups) == 0
    assert not groups.start_build()
