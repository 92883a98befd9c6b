"""BlockedNowReader: who is blocked now, and the records of threads gone (a fake
record store and a fake /proc: these tests say what is read, not the kernel)."""

from __future__ import annotations

import ctypes as ct

from offtop.bpf.blocked import BlockedNowReader
from offtop.bpf.decode import RecordFields, StartRecord, owned_slot_fields, record_fields

S = 1_000_000_000


class FakeRecords:
    """The probe's per-thread records, by tid; `free_record` drops one."""

    def __init__(self, waits: dict[int, int], now: int) -> None:
        self.recs = {}
        for tid, waited in waits.items():
            r = StartRecord()
            r.ts, r.tid, r.tgid, r.ustack, r.kstack = (now - waited if waited else 0), tid, 1, -1, -1
            self.recs[tid] = r
        self.freed: list[int] = []

    def thread_fields(self) -> list[RecordFields]:
        return [(r.ts, tid, r.tgid, r.state, r.ustack, r.kstack, r.ubp, tid)
                for tid, r in self.recs.items()]

    def free_record(self, tid: int, slot: int) -> None:
        self.freed.append(tid)
        del self.recs[tid]


class FakeProc:
    """Which threads exist; counts the checks."""

    def __init__(self, gone: set[int]) -> None:
        self.gone = gone
        self.checks = 0

    def __call__(self, pid: int, tid: int) -> bool:
        self.checks += 1
        return tid not in self.gone


def rig(waits: dict[int, int], gone: set[int], *, limit: int = 200, reap_every: int = 30
        ) -> tuple[BlockedNowReader, FakeRecords, FakeProc]:
    now = 100_000 * S
    records, proc = FakeRecords(waits, now), FakeProc(gone)
    reader = BlockedNowReader(records, min_ns=5_000_000, limit=limit, reap_every=reap_every,
                              clock_ns=lambda: now, exists=proc)
    return reader, records, proc


def test_only_the_threads_shown_are_checked_against_proc_at_each_read() -> None:
    """5,000 threads idle for an hour (a thread pool): 200 are shown, so at most 200
    stat() calls a read, not 5,000."""
    waits = {tid: 3600 * S + tid for tid in range(1, 5001)}
    reader, _records, proc = rig(waits, gone=set())
    rows, _live = reader.read()
    assert [b.tid for b in rows] == list(range(5000, 4800, -1))  # longest first
    assert proc.checks == 200


def test_a_gone_thread_that_would_be_shown_is_reaped_at_once_and_the_next_one_shown() -> None:
    waits = {tid: 3600 * S + tid for tid in range(1, 11)}
    reader, records, _proc = rig(waits, gone={10, 8}, limit=3)
    rows, _live = reader.read()
    assert [b.tid for b in rows] == [9, 7, 6]
    assert sorted(records.freed) == [8, 10] and reader.reaped == 2


def test_gone_threads_below_the_rows_shown_are_reaped_at_the_reaping_read() -> None:
    waits = {tid: 3600 * S + tid for tid in range(1, 11)} | {11: 0}  # 11: not blocked now
    reader, records, proc = rig(waits, gone={2, 11}, limit=3, reap_every=3)
    for _ in range(2):
        rows, _live = reader.read()
        assert [b.tid for b in rows] == [10, 9, 8]
    assert records.freed == [] and proc.checks == 6
    rows, _live = reader.read()  # the third: every record is checked
    assert [b.tid for b in rows] == [10, 9, 8]
    assert sorted(records.freed) == [2, 11]
    assert 2 not in records.recs and 11 not in records.recs


def test_short_waits_are_shown_without_a_check() -> None:
    """Only a wait longer than `stale_after` (10 s) makes a record suspect."""
    waits = {1: 9 * S, 2: 20_000_000, 3: 1_000_000}  # 3: under min_ns, not shown
    reader, _records, proc = rig(waits, gone={1, 2, 3})
    rows, _live = reader.read()
    assert [b.tid for b in rows] == [1, 2] and proc.checks == 0


def test_records_decoded_in_bulk_are_the_records_ctypes_reads() -> None:
    """`owned_slot_fields` and `record_fields` (struct) against the records as ctypes
    reads them."""
    recs = (StartRecord * 4)()
    for i, r in enumerate(recs):
        r.ts, r.cgroup_id, r.tid, r.tgid, r.state = 10**12 + i, 99, 100 + i, 7, 0x80000002
        r.ustack, r.kstack, r.skip, r.cg_gen = i - 1, 40 + i, 4, 3
        r.upc, r.usp, r.ubp = 0x401000, 0x7ffd0000, 0x7ffd0100 + i
        r.w.tgid = 5
    recs[2].tid = 0  # being released: left out
    buf = bytes(recs)
    taken = bytearray(b"\x01\x00\x01\x01")
    want = [(r.ts, int(r.tid), r.tgid, r.state, r.ustack, r.kstack, r.ubp, at)
            for at, r in enumerate(recs) if taken[at] and r.tid]
    assert [w[-1] for w in want] == [0, 3]
    assert owned_slot_fields(buf, taken, 4) == want
    assert record_fields(buf + b"\xff" * 5, 4) == [
        (r.ts, int(r.tid), r.tgid, r.state, r.ustack, r.kstack, r.ubp, -1) for r in recs]
    assert ct.sizeof(StartRecord) == len(buf) // 4
