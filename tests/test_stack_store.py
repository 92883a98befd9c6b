"""Stack ids freed before the probe's maps fill (offtop.bpf.stack_store.StackStore.reclaim):
what was used lately, or is held by a task asleep now, stays; the rest of the
kernel map is deleted once half full.

The stack maps and symbolizers are fakes (named so): the rules under test are
Python's; tests/test_bpf_e2e.py runs the real probe.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from offtop.bpf.stack_store import StackStore
from offtop.model import MARK_USER_STACK_LOST, Frame


class FakeStackMaps:
    """Stack ids -> addresses, as the probe's maps would hold them; deletions recorded."""

    def __init__(self, kernel_ids: range, user_ids: range) -> None:
        self.stacks = {("k", i): (0xFFFF0000 + i,) for i in kernel_ids}
        self.stacks.update({("u", i): (0x401000 + i,) for i in user_ids})
        self.deleted: list[tuple[str, int]] = []  # ids that went
        self.missed: list[tuple[str, int]] = []  # ids asked to go, found gone already
        self.reads = 0  # reads of every id (`stack_ids`)

    def stack(self, kind: str, sid: int) -> tuple[int, ...] | None:
        return self.stacks.get((kind, sid))

    def stack_ids(self, kind: str) -> list[int]:
        self.reads += 1
        return [sid for k, sid in self.stacks if k == kind]

    def delete_stacks(self, kind: str, sids: Any, max_gone: int | None = None) -> tuple[int, int]:
        """As the probe's: in order, each one found gone counted, the rest left past
        `max_gone` of them."""
        freed = gone = 0
        for tried, sid in enumerate(sids):
            if max_gone is not None and gone > max_gone:
                return freed, tried
            if self.stacks.pop((kind, sid), None) is None:
                self.missed.append((kind, sid))
                gone += 1
            else:
                self.deleted.append((kind, sid))
                freed += 1
        return freed, len(sids)


class FakeKernelSymbols:
    def resolve_stack(self, addrs: Any) -> tuple[Frame, ...]:
        return tuple(Frame(f"k{a:x}", kernel=True) for a in addrs)


def store(maps: FakeStackMaps, capacity: int = 8) -> StackStore:
    return StackStore(maps, kernel_symbols=FakeKernelSymbols(), user_symbols=None,  # type: ignore[arg-type]
                      capacity={"k": capacity, "u": capacity}, kernel_depth=64, user_depth=64)


def looked_up(kernel_ids: range, at: int = 1) -> tuple[FakeStackMaps, StackStore]:
    """A store whose kernel stacks `kernel_ids` were looked up in interval `at`."""
    maps = FakeStackMaps(kernel_ids, range(0))
    s = store(maps)
    s.next_interval(at)
    for sid in kernel_ids:
        s.kernel(sid)
    return maps, s


def test_ids_unused_for_two_intervals_are_deleted_once_half_full() -> None:
    maps, s = looked_up(range(4))
    s.next_interval(4)
    s.touch_all([0], [])  # used now
    s.reclaim(live={("k", 1)})  # held by a task blocked now
    assert sorted(maps.deleted) == [("k", 2), ("k", 3)]
    # Only what is learnt from the ids deleted is stale: not everything (`generation`).
    assert (s.generation, s.kernel_frees, s.freed_kernel_ids) == (0, 1, {2, 3})
    assert s.stats.reclaimed == 2
    assert (s.stale_ids((0, 1)), s.stale_ids((0, 0)), s.stale_ids((0, -1))) == (set(), {2, 3}, None)
    assert s.stale_ids((-1, 1)) is None  # a cleared cache: every id
    assert (s.last_use("k", 0), s.last_use("k", 1), s.last_use("k", 2)) == (4, 1, None)


def test_nothing_is_deleted_below_half_full() -> None:
    maps, s = looked_up(range(3))
    s.next_interval(9)
    s.reclaim(live=set())
    assert maps.deleted == [] and (s.generation, s.kernel_frees, s.used) == (0, 0, 3)


def test_bulk_stamps_skip_negative_ids_and_keep_what_they_name() -> None:
    maps, s = looked_up(range(4))
    s.next_interval(5)
    # Errnos (-14: no user stack) and offtop's own "not resolved" mark name no stack.
    s.touch_all([2, 3, -14, -(1 << 40)], [-14, -12])
    assert s.used == 4 and s.last_use("k", -14) is None and s.last_use("u", -12) is None
    s.reclaim(live=set())
    assert sorted(maps.deleted) == [("k", 0), ("k", 1)]


def test_ids_the_maps_hold_but_no_row_named_are_counted_every_30_intervals() -> None:
    maps = FakeStackMaps(range(4), range(0))  # in the maps, never looked up here
    s = store(maps)
    s.next_interval(30)
    s.reclaim(live=set())
    assert s.used == 4 and maps.deleted == []  # stamped now: not yet unused for long
    s.next_interval(33)
    s.reclaim(live=set())
    assert sorted(maps.deleted) == [("k", 0), ("k", 1), ("k", 2), ("k", 3)]


def test_user_ids_unused_are_forgotten_never_deleted() -> None:
    """The user stack map is an LRU map: the kernel makes room in it itself
    (reclaim deletes none; the ids of processes gone go at the sweep, below)."""
    maps = FakeStackMaps(range(4), range(4))
    s = store(maps)
    s.next_interval(30)
    s.reclaim(live={("u", 2)})
    s.next_interval(33)
    s.reclaim(live={("u", 2)})
    assert all(kind == "k" for kind, _ in maps.deleted)
    assert [s.last_use("u", i) for i in range(4)] == [None, None, 30, None]


class FakeUserSymbols:
    def resolve_stack(self, pid: int, addrs: Any, *, deadline: Any = None,
                      start: Any = None) -> tuple[Frame, ...]:
        return tuple(Frame(f"u{a:x}") for a in addrs)


def user_store(maps: FakeStackMaps, start_time: Callable[[int], int | None]) -> StackStore:
    """A store of user stacks only, processes' start times read by `start_time`."""
    return StackStore(maps, kernel_symbols=None, user_symbols=FakeUserSymbols(),  # type: ignore[arg-type]
                      capacity={"k": 8, "u": 8}, kernel_depth=64, user_depth=64,
                      start_time=start_time)


def sharing_one_id(user_ids: range) -> tuple[FakeStackMaps, dict[int, int], StackStore]:
    """Processes 100 (ids 0 and 1) and 200 (ids 1 and 2) alive, read in interval 1."""
    maps = FakeStackMaps(range(0), user_ids)
    alive = {100: 7, 200: 9}
    s = user_store(maps, alive.get)
    s.next_interval(1)
    for pid, start, sid in ((100, 7, 0), (100, 7, 1), (200, 9, 1), (200, 9, 2)):
        assert s.user(pid, start, sid)
    return maps, alive, s


def test_user_ids_of_processes_gone_are_deleted_at_once_unless_used_lately() -> None:
    """Under process churn the LRU map filled with dead processes' stacks and
    then evicted fresh ones before they were read: the ids of processes gone
    are deleted, but not those a process alive shares. An id a row used in
    this interval or the one before waits for the next sweep (a row summed
    just before a process ended is still read); the others go at the sweep
    that finds their process gone, before the map's LRU evicts them itself."""
    maps, alive, s = sharing_one_id(range(5))
    s.next_interval(4)
    assert s.user(100, 7, 3)  # used in the interval before the sweep
    del alive[100]
    s.next_interval(5)
    s.trim()  # the sweep that finds 100 gone
    assert maps.deleted == [("u", 0)]  # id 1 is 200's too; id 3 was used lately
    assert s.stats.user_freed == 1 and s.last_use("u", 0) is None
    s.next_interval(10)
    s.trim()
    assert maps.deleted == [("u", 0), ("u", 3)]
    assert s.stats.user_freed == 2 and s.last_use("u", 3) is None
    assert s.user(200, 9, 1) == (Frame("u401001"),)


def test_a_sweep_reads_start_times_through_the_reader_it_is_given() -> None:
    """The engine reads each process's start time once for all of an interval's
    sweeps (the stack store's, the symbols', the totals'): a sweep asks the reader
    it is given, not its own."""
    def own(pid: int) -> int | None:
        raise AssertionError("the store's own reader was asked")

    maps = FakeStackMaps(range(0), range(4))
    s = user_store(maps, own)
    s.next_interval(1)
    assert s.user(100, 7, 0)
    asked: list[int] = []
    s.next_interval(5)
    s.trim(lambda pid: asked.append(pid) or None)
    assert asked == [100]


def test_a_sweep_deletes_only_the_ids_the_map_still_holds() -> None:
    """A sweep deletes a dead process's ids as they come: those the map's LRU
    evicted already are skipped, each at the cost of a system call of its own.
    Past `GONE_MAX` of them (a full map under churn: most evicted), the ids the
    map still holds are read first and only those are deleted. Either way the
    ids are forgotten, and what went is counted."""
    for gone_max, reads, missed in ((1, 1, [1, 2]), (3, 0, [1, 2, 4])):
        maps = FakeStackMaps(range(0), range(6))
        alive = {100: 7}
        s = user_store(maps, alive.get)
        s.GONE_MAX = gone_max
        s.next_interval(1)
        for sid in range(6):
            assert s.user(100, 7, sid)
        for sid in (1, 2, 4):  # evicted by the map's LRU meanwhile
            del maps.stacks[("u", sid)]
        del alive[100]
        reads_before = maps.reads
        s.next_interval(5)
        s.trim()
        assert sorted(maps.deleted) == [("u", 0), ("u", 3), ("u", 5)]
        assert sorted(sid for _, sid in maps.missed) == missed
        assert maps.reads - reads_before == reads
        assert s.stats.user_freed == 3
        assert all(s.last_use("u", sid) is None for sid in range(6))


def test_an_id_processes_share_is_deleted_once_the_last_of_them_is_gone() -> None:
    """Frames are cached per process, and an id two processes hold (one binary
    mapped at one address, e.g. not position-independent) outlives the first to
    go: the map keeps it until no process alive holds it."""
    maps, alive, s = sharing_one_id(range(3))
    assert s.cached == 4
    del alive[100]
    s.next_interval(5)
    s.trim()
    assert maps.deleted == [("u", 0)] and s.cached == 2
    assert s.final(200, 9, 1) and not s.final(100, 7, 1)
    del alive[200]
    s.next_interval(10)
    s.trim()
    assert sorted(maps.deleted) == [("u", 0), ("u", 1), ("u", 2)] and s.cached == 0


def test_stacks_the_probe_sent_whole_are_read_once_without_the_map() -> None:
    """New user stacks come through a ring as the probe stores them
    (`offer_user`): read from there, not from the map (which may have evicted
    them meanwhile); an id already cached is not kept again, an id not offered
    is read from the map, and the unread ones are bounded."""
    maps = FakeStackMaps(range(0), range(3))
    s = user_store(maps, {100: 7}.get)
    s.next_interval(1)
    assert s.user(100, 7, 0) == (Frame("u401000"),)  # from the map
    packed = (0x401007).to_bytes(8, "little") + (0x401008).to_bytes(8, "little")
    s.offer_user([(0, (0xBAD).to_bytes(8, "little")), (5, packed)])
    del maps.stacks[("u", 1)]  # evicted by the map's LRU: not offered either
    assert s.user(100, 7, 5) == (Frame("u401007"), Frame("u401008"))  # not in the map
    assert s.user(100, 7, 0) == (Frame("u401000"),)  # cached: the offer was passed over
    assert s.user(100, 7, 1)[0].name == MARK_USER_STACK_LOST
    s.FRESH_MAX = 4
    s.offer_user([(sid, packed) for sid in range(10, 20)])
    assert s.user(100, 7, 19)[0].name == "u401007"  # the newest are kept
    assert s.user(100, 7, 10)[0].name == MARK_USER_STACK_LOST  # the oldest went


class FakeProgramSymbols:
    """One program's functions wherever it is loaded: named by the address's offset."""

    def resolve_stack(self, pid: int, addrs: Any, *, deadline: Any = None,
                      start: Any = None) -> tuple[Frame, ...]:
        return tuple(Frame(f"f{a & 0xFFFFFF:x}", "prog") for a in addrs)


def test_the_processes_of_one_program_share_one_tuple_for_an_equal_stack() -> None:
    """Each process of a program loaded elsewhere (ASLR) has its stacks under ids
    of its own, which resolve to equal frames: one tuple is kept for all, so that
    a pre-fork server's workers do not each hold (and each GC pass walk) a copy."""
    maps = FakeStackMaps(range(0), range(0))
    for sid, base in ((10, 0x5555_0000_0000), (11, 0x5666_0000_0000), (12, 0x5777_0000_0000)):
        maps.stacks[("u", sid)] = (base + 0x401000, base + 0x402000)
    alive = {100: 7, 200: 9, 300: 3}
    s = StackStore(maps, kernel_symbols=None, user_symbols=FakeProgramSymbols(),  # type: ignore[arg-type]
                   capacity={"k": 8, "u": 8}, kernel_depth=64, user_depth=64, start_time=alive.get)
    s.next_interval(1)
    first, second = s.user(100, 7, 10), s.user(200, 9, 11)
    assert first == (Frame("f401000", "prog"), Frame("f402000", "prog"))
    assert second is first
    del alive[100]
    s.next_interval(5)
    s.trim()  # a sweep: process 100's frames go, the one tuple stays with 200's
    assert s.user(200, 9, 11) is first
    assert s.user(300, 3, 12) is first


class FakeSlowSymbols:
    """A binary whose symbols are not loaded until `loaded` is set (as a time budget
    leaves them): its frames read `prog+0x…` until then."""

    def __init__(self) -> None:
        self.loaded = False
        self.calls = 0

    def resolve_stack(self, pid: int, addrs: Any, *, deadline: Any = None,
                      start: Any = None) -> tuple[Frame, ...]:
        self.calls += 1
        if self.loaded:
            return tuple(Frame(f"f{a:x}", "prog") for a in addrs)
        return tuple(Frame(f"prog+0x{a:x}", "prog") for a in addrs)


def slow_store() -> tuple[FakeSlowSymbols, StackStore]:
    maps = FakeStackMaps(range(0), range(2))
    syms = FakeSlowSymbols()
    s = StackStore(maps, kernel_symbols=None, user_symbols=syms,  # type: ignore[arg-type]
                   capacity={"k": 8, "u": 8}, kernel_depth=64, user_depth=64,
                   start_time={100: 7}.get)
    s.next_interval(1)
    return syms, s


def test_a_stack_left_unnamed_as_its_time_ran_out_is_resolved_again_when_asked() -> None:
    """A stack resolved without names is looked at again only when its retry is due
    (not at every use), or at once through `user_again` if its resolving ran out
    of time, as the long blocks it cut short ask (offtop.bpf.cut_short)."""
    syms, s = slow_store()
    assert s.user(100, 7, 0, deadline=0.0)[0].unknown  # out of time from the start
    assert s.short_of_time(100, 7, 0)
    syms.loaded = True
    assert s.user(100, 7, 0)[0].unknown and syms.calls == 1  # the cached frames
    assert s.user_again(100, 7, 0, deadline=1e18) == ((Frame("f401000", "prog"),), False)
    assert syms.calls == 2 and not s.short_of_time(100, 7, 0)
    assert s.user_again(100, 7, 0, deadline=1e18) == ((Frame("f401000", "prog"),), False)
    assert syms.calls == 2  # complete now: cached, not resolved again


def test_a_stack_left_unnamed_in_time_is_not_resolved_again_at_once() -> None:
    """Frames unnamed with time left (a stripped binary's) would be unnamed again."""
    syms, s = slow_store()
    unnamed = s.user(100, 7, 1, deadline=1e18)
    assert unnamed[0].unknown and not s.short_of_time(100, 7, 1)
    syms.loaded = True
    assert s.user_again(100, 7, 1, deadline=1e18) == (unnamed, False)
    assert syms.calls == 1
