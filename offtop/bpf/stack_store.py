"""Stack ids from the probe's maps, turned into frames once and freed before the maps fill.

The program stores each distinct stack once and hands out an id; records
carry the id (or a negative errno when no stack could be kept). This store
reads a stack the first time its id is seen, symbolizes it, caches the
frames, and deletes ids nothing has referenced for a while: the kernel
never frees a stack id, and a full map silently turns every new stack into
-ENOMEM.

New user stacks also arrive whole through a ring as the probe stores them
(`offer_user`): read from there, the map is not asked (nor too late, once
its LRU has evicted them).

Ids are reused by the program once deleted, so cached frames go with them.
User frames are cached per (id, pid, process start time): the addresses
mean something only in their own process, and a pid reused by another
process must not find the old process's names.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from offtop.bpf.decode import IRQ_PATH_BASE, StackCopy, record_addresses
from offtop.model import MARK_DEPTH_LIMIT, MARK_TRUNCATED, MARK_USER_STACK_LOST, Frame
from offtop.symbols import KernelSymbols, UserSymbols
from offtop.targets import task_start_time

if TYPE_CHECKING:
    from offtop.bpf.user_stacks import UserStackRepair

ENOMEM, EEXIST, EFAULT = 12, 17, 14

_USER_LOST = (Frame(name=MARK_USER_STACK_LOST),)


class StackMaps(Protocol):
    """Where stacks are read from (`offtop.bpf.probe.Probe`, or a fake in tests)."""

    def stack(self, kind: str, sid: int) -> tuple[int, ...] | None:
        """Addresses of stack `sid` of kind 'k' or 'u', innermost first; None if absent."""
        ...

    def stack_ids(self, kind: str) -> Iterable[int]:
        """Every id in use."""
        ...

    def delete_stacks(self, kind: str, sids: Sequence[int], max_gone: int | None = None
                      ) -> tuple[int, int]:
        """Free many ids at once, in order (ids already gone are skipped); past
        `max_gone` found gone the rest is not tried. (How many went, how many of
        `sids` were tried.)"""
        ...


@dataclass(slots=True)
class StackStats:
    """What the store did (cumulative), for the capture's health line."""

    reclaimed: int = 0
    truncated: int = 0
    depth_limited: int = 0
    user_lost: int = 0
    user_freed: int = 0  #: user stack ids of processes gone, deleted from the probe's map
    symbol_deadline_misses: int = 0


class StackStore:
    """Frames of stack ids, cached; ids freed when unused (see module docstring)."""

    #: Frames that did not all resolve are looked at again after this many intervals.
    RETRY_INTERVALS = 5
    #: Every this many intervals, the user frames of processes that are gone are dropped.
    SWEEP_INTERVALS = 5
    #: Past this many user ids found gone already in a sweep's delete, the ids still in
    #: the map are read before the rest is deleted (`_free_user_ids`).
    GONE_MAX = 64
    #: User stacks the probe sent whole (`offer_user`) are kept at most this many, unread.
    FRESH_MAX = 16_384
    #: Stack copies kept unread at most (~4 KiB each: offer_copies).
    COPIES_MAX = 256

    def __init__(
        self,
        maps: StackMaps,
        *,
        kernel_symbols: KernelSymbols | None,
        user_symbols: UserSymbols | None,
        capacity: Mapping[str, int],
        kernel_depth: int,
        user_depth: int,
        max_cached: int = 200_000,
        repair: UserStackRepair | None = None,
        start_time: Callable[[int], int | None] = task_start_time,
    ) -> None:
        self._maps = maps
        self._repair = repair
        self.kernel_symbols = kernel_symbols
        self.user_symbols = user_symbols
        self._capacity = dict(capacity)
        self._kdepth = kernel_depth
        self._udepth = user_depth
        self._max_cached = max_cached
        self._start_time = start_time
        # Per kind: id -> the interval it was last used in (ints as keys: stamped
        # for every row of every interval on a busy server).
        self._last_use: dict[str, dict[int, int]] = {"k": {}, "u": {}}
        self._kernel: dict[int, tuple[Frame, ...]] = {}
        # User frames per process (pid, start time): a sweep drops a process's
        # at once, without a walk over every stack cached.
        self._user: dict[tuple[int, int], dict[int, tuple[Frame, ...]]] = {}
        self._holders: dict[int, int] = {}  # user id -> processes caching frames for it
        # One tuple for each distinct user stack cached: the processes of one program
        # resolve equal stacks under ids of their own (rebuilt at each sweep).
        self._equal: dict[tuple[Frame, ...], tuple[Frame, ...]] = {}
        # (pid, start, id) -> (the interval to look again, whether its resolving ran
        # out of time: `user_again`).
        self._retry: dict[tuple[int, int, int], tuple[int, bool]] = {}
        self._dead_ids: set[int] = set()  # user ids of processes gone at the last sweep
        self._fresh: dict[int, bytes] = {}  # user id -> its frames, packed, as the probe sent them
        self._copies: dict[int, StackCopy] = {}  # user id -> its stack's top (offer_copies)
        self._seq = 0
        self.stats = StackStats()
        #: Bumped whenever cached frames are dropped wholesale: what was learnt
        #: from any id before may name another stack now.
        self.generation = 0
        #: Counts the reclaims that deleted kernel ids; the latest one's ids. What
        #: was learnt from those may name another stack now (the kernel hands a
        #: deleted id to the next stack that hashes to it), the rest holds: the ids
        #: deleted are those no row of the last two intervals used. On a busy
        #: server interrupts' stacks (each through what it stopped) fill the map
        #: every ~15 s; a `generation` bump there had every carried row and
        #: everything kept resolved afresh, and offtop fell behind in that interval.
        self.kernel_frees = 0
        self.freed_kernel_ids: frozenset[int] = frozenset()

    @property
    def cached(self) -> int:
        """Stacks whose frames are cached."""
        return len(self._kernel) + sum(map(len, self._user.values()))

    @property
    def used(self) -> int:
        """Stack ids known to be in use."""
        return len(self._last_use["k"]) + len(self._last_use["u"])

    def last_use(self, kind: str, sid: int) -> int | None:
        """The interval id `sid` of `kind` was last stamped as used in (None: never)."""
        return self._last_use[kind].get(sid)

    def next_interval(self, seq: int) -> None:
        """Stamp later uses with interval `seq` (for reclaiming)."""
        self._seq = seq

    def touch(self, ksid: int, usid: int) -> None:
        """Stamp ids as used now, as resolving them would (they are not reclaimed)."""
        seq = self._seq
        if 0 <= ksid < IRQ_PATH_BASE:
            self._last_use["k"][ksid] = seq
        if usid >= 0:
            self._last_use["u"][usid] = seq

    def touch_all(self, kernel_ids: Iterable[int], user_ids: Iterable[int]) -> None:
        """`touch` for many ids at once (negative ids, which name no stack, and interrupts'
        paths, never reclaimed, are skipped)."""
        seq = self._seq
        for kind, ids in (("k", kernel_ids), ("u", user_ids)):
            used = set(ids)
            used.difference_update([i for i in used if i < 0 or i >= IRQ_PATH_BASE])
            self._last_use[kind].update(dict.fromkeys(used, seq))

    def final(self, pid: int, start: int, sid: int) -> bool:
        """Whether the user frames of `sid` in process (`pid`, `start`) are cached and
        will not be looked at again (a negative id: only when it means "no user
        stack", since every other is counted as a lost stack at each use)."""
        if sid < 0:
            return sid == -EFAULT or self.user_symbols is None
        return sid in self._user.get((pid, start), ()) and (pid, start, sid) not in self._retry

    def whole(self, pid: int, start: int, sid: int) -> bool:
        """Whether the user frames of `sid` in process (`pid`, `start`) are final and
        reach the stack's end (not cut, not at the depth limit): nothing left for
        an unwinder to add."""
        if sid < 0 or not self.final(pid, start, sid):
            return False
        frames = self._user[(pid, start)][sid]
        return bool(frames) and frames[-1].name not in (MARK_TRUNCATED, MARK_DEPTH_LIMIT)

    def offer_user(self, stacks: list[tuple[int, bytes]]) -> None:
        """User stacks as the probe stored them, (id, frames packed as u64s): the
        frames of an id are read from here once, not from the probe's map (a
        system call per id: thousands a second under process churn; and the map's
        LRU may have evicted an id before it is read). Ids whose frames are
        cached already are passed over; past `FRESH_MAX` unread, the oldest go
        (an id not here is read from the map, as before)."""
        fresh = self._fresh
        holders = self._holders
        for sid, raw in stacks:
            if sid not in holders:
                fresh[sid] = raw
        if len(fresh) > self.FRESH_MAX:
            for sid in list(itertools.islice(fresh, len(fresh) - self.FRESH_MAX // 2)):
                del fresh[sid]

    def see_processes(self, firsts: dict[int, int], start_of: Callable[[int], int]) -> int:
        """Processes whose new stacks just came, {tgid: top address of one}: each
        one not seen before is seen by the repair now (`UserStackRepair.see`).
        How many were new."""
        if self._repair is None:
            return 0
        see = self._repair.see
        return sum(see(pid, start, pc) for pid, pc in firsts.items() if (start := start_of(pid)))

    def offer_copies(self, copies: list[StackCopy]) -> None:
        """Copies of new stacks' tops the probe sent (offcpu.c copy_stack), kept by id
        until the stack is resolved: where the repair cuts it, the rules its whole
        stack needs are learned from its copy (`UserStackRepair.learn_from_copy`);
        else it goes unused. Past COPIES_MAX unread, the oldest go."""
        kept = self._copies
        for copy in copies:
            kept[copy.sid] = copy
        if len(kept) > self.COPIES_MAX:
            for sid in list(itertools.islice(kept, len(kept) - self.COPIES_MAX // 2)):
                del kept[sid]

    def kernel(self, sid: int) -> tuple[Frame, ...]:
        """The kernel frames of id `sid` (() for none)."""
        if sid < 0 or self.kernel_symbols is None:
            return ()
        path = sid >= IRQ_PATH_BASE  # an interrupt's path (offcpu.c irq_paths): never deleted
        if not path:
            self._last_use["k"][sid] = self._seq
        frames = self._kernel.get(sid)
        if frames is None:
            addrs = self._maps.stack("i" if path else "k", sid)
            frames = self.kernel_symbols.resolve_stack(addrs) if addrs else ()
            if addrs and len(addrs) >= self._kdepth:
                frames = (*frames, Frame(name=MARK_DEPTH_LIMIT, kernel=True))
                self.stats.depth_limited += 1
            self._kernel[sid] = frames
        return frames

    def kept_user(self, pid: int, start: int, sid: int) -> tuple[Frame, ...] | None:
        """The user frames of `sid` cached for process (`pid`, `start`), if they are
        (nothing read or resolved; a negative id: None)."""
        cached = self._user.get((pid, start))
        frames = cached.get(sid) if cached is not None and sid >= 0 else None
        if frames is not None:
            self._last_use["u"][sid] = self._seq
        return frames

    def user(self, pid: int, start: int, sid: int, *, deadline: float | None = None) -> tuple[Frame, ...]:
        """The user frames of id `sid` in process `pid` (started at `start`).

        A negative id is the errno of a stack that could not be kept: EFAULT
        means there was no user stack (a kernel-like thread) and gives ();
        any other cause gives the `[user stack lost]` mark.
        """
        if self.user_symbols is None:
            return ()
        if sid < 0:
            if sid == -EFAULT:
                return ()
            self.stats.user_lost += 1
            return _USER_LOST
        self._last_use["u"][sid] = self._seq
        frames = self.kept_user(pid, start, sid)
        if frames is not None:
            key = (pid, start, sid)
            retry = self._retry.get(key)
            if retry is None or self._seq < retry[0]:
                return frames
            del self._retry[key]
        raw = self._fresh.pop(sid, None)
        addrs = self._maps.stack("u", sid) if raw is None else record_addresses(raw)
        if addrs is None:
            # Evicted from the probe's LRU map before it could be read (a
            # flood of new stacks): the block keeps its time, marked.
            self.stats.user_lost += 1
            return _USER_LOST
        if not addrs:
            return ()
        at_limit = len(addrs) >= self._udepth
        cut = False
        if self._repair is not None:
            # A process gone before its first sight is checked by the rules of
            # the one it was forked from (offtop.bpf.lineage): worked out there
            # once, not once per process of a churn. What that one lacks is
            # taught to it: the next processes it forks walk by its rules
            # (offcpu.c rules_owner), in the same memory.
            checked, checked_start = pid, start
            if not start:
                checked, checked_start = self.user_symbols.stand_in_for(pid) or (pid, 0)
            # A gone process's copy is unwound in the memory map of the one it
            # was forked from, which learns the rules: the same memory.
            # Kept after use (until COPIES_MAX newer ones push it out): a stack
            # is resolved again once its process is gone (its start then
            # unknown, nothing kept), and its copy unwinds it then too.
            copy = self._copies.get(sid)
            addrs, cut = self._repair.repair(
                checked, addrs, checked_start, at_limit=at_limit,
                copy=copy if copy is not None and copy.tgid == pid else None)
        if deadline is not None and time.monotonic() > deadline:
            self.stats.symbol_deadline_misses += 1
        frames = self.user_symbols.resolve_stack(pid, addrs, deadline=deadline, start=start)
        # Unnamed frames as its time ran out may be named given time (those named
        # in time, a stripped binary's, will not).
        short = deadline is not None and time.monotonic() >= deadline
        if cut and not (frames and frames[-1].name == MARK_TRUNCATED):
            frames = (*frames, Frame(name=MARK_TRUNCATED))
        complete = not any(f.unknown for f in frames) or (
            cut and not any(f.unknown for f in frames[:-1]))
        if frames and frames[-1].unknown:
            self.stats.truncated += 1
        if at_limit and not cut:
            frames = (*frames, Frame(name=MARK_DEPTH_LIMIT))
            self.stats.depth_limited += 1
        # A process gone (its start unknown) keeps nothing: its last rows are
        # being read, and a churn of processes gone before their first sight,
        # named in the process they were forked from (offtop.bpf.lineage),
        # would fill the cache between two sweeps.
        if start:
            frames = self._keep(pid, start, sid, frames)
            if not complete:
                # A miss may resolve later (a library not read yet, a time
                # budget): look again in a few intervals, not at every use. (A
                # process already gone will not get better: not kept.)
                self._retry[(pid, start, sid)] = (self._seq + self.RETRY_INTERVALS, short)
        return frames

    def short_of_time(self, pid: int, start: int, sid: int) -> bool:
        """Whether the frames cached for process (`pid`, `start`)'s stack `sid` lack
        names because their resolving ran out of time."""
        retry = self._retry.get((pid, start, sid))
        return retry is not None and retry[1]

    def user_again(self, pid: int, start: int, sid: int, *, deadline: float
                   ) -> tuple[tuple[Frame, ...], bool]:
        """`user`, resolved again now (not once its retry is due) if its resolving ran
        out of time (offtop.bpf.cut_short); and whether this one did too."""
        if self.short_of_time(pid, start, sid):
            self._retry[(pid, start, sid)] = (self._seq, True)
        return self.user(pid, start, sid, deadline=deadline), self.short_of_time(pid, start, sid)

    def _keep(self, pid: int, start: int, sid: int, frames: tuple[Frame, ...]) -> tuple[Frame, ...]:
        """Cache `frames` as process (`pid`, `start`)'s stack `sid`; the tuple kept
        (an equal one already cached, if there is one)."""
        frames = self._equal.setdefault(frames, frames)
        cached = self._user.setdefault((pid, start), {})
        if sid not in cached:
            self._holders[sid] = self._holders.get(sid, 0) + 1
        cached[sid] = frames
        return frames

    def _drop(self, pid: int, start: int, sid: int) -> None:
        """Forget one process's frames of `sid` (kept in the probe's map)."""
        cached = self._user.get((pid, start))
        if cached is None or cached.pop(sid, None) is None:
            return
        if not cached:
            del self._user[(pid, start)]
        self._release(sid)

    def _release(self, sid: int) -> bool:
        """One process fewer caches `sid`: whether none does now."""
        left = self._holders[sid] - 1
        if left:
            self._holders[sid] = left
            return False
        del self._holders[sid]
        return True

    def reclaim(self, live: set[tuple[str, int]]) -> None:
        """Free ids unused for a few intervals and not held by a task asleep now.

        Runs once the maps are half full (and every 30 intervals counts what
        the maps hold, so ids never seen by this store are reclaimed too).
        """
        seq = self._seq
        if not self._half_full() and seq % 30:
            return
        if seq % 30 == 0:
            for kind in ("k", "u"):
                used = self._last_use[kind]
                for sid in self._maps.stack_ids(kind):
                    used.setdefault(sid, seq)
        full = self._half_full()
        if not full:
            return
        horizon = seq - 2
        # User stacks live in an LRU map (offcpu.c): the kernel makes room there
        # itself; ids unused here are only forgotten, never deleted.
        users = self._last_use["u"]
        for sid in [sid for sid, seen in users.items()
                    if seen < horizon and ("u", sid) not in live]:
            del users[sid]
        if "k" not in full:
            return
        kernels = self._last_use["k"]
        victims = [sid for sid, seen in kernels.items() if seen < horizon and ("k", sid) not in live]
        self._maps.delete_stacks("k", victims)
        for sid in victims:
            del kernels[sid]
        if victims:
            self.kernel_frees += 1
            self.freed_kernel_ids = frozenset(victims)
            kernel = self._kernel
            for sid in victims:
                kernel.pop(sid, None)
            self.stats.reclaimed += len(victims)

    @property
    def at(self) -> tuple[int, int]:
        """Where the store is, for `stale_ids`: (`generation`, `kernel_frees`)."""
        return self.generation, self.kernel_frees

    def stale_ids(self, seen: tuple[int, int]) -> frozenset[int] | None:
        """The kernel ids whose frames, learnt when the store was `seen` (its `at`), may
        name another stack now: none (empty), those the latest reclaim deleted, or None
        for every id (a cleared cache, or more than one reclaim since)."""
        generation, frees = seen
        if generation != self.generation:
            return None
        if frees == self.kernel_frees:
            return frozenset()
        return self.freed_kernel_ids if frees == self.kernel_frees - 1 else None

    def _half_full(self) -> set[str]:
        """The kinds whose map is at least half full."""
        return {k for k, used in self._last_use.items()
                if len(used) >= self._capacity.get(k, 0) // 2}

    def trim(self, start_time: Callable[[int], int | None] | None = None) -> None:
        """Bound the frame cache (called once per interval).

        Incomplete stacks not asked for since they were due to be looked at
        again belong to processes that are gone, most likely: dropped.
        `start_time`: the interval's reader of start times, if not this object's.
        """
        stale = [k for k, (due, _short) in self._retry.items() if due < self._seq]
        for k in stale:
            del self._retry[k]
            self._drop(*k)
        if self._seq % self.SWEEP_INTERVALS == 0:
            self._sweep_gone(start_time or self._start_time)
        if self.cached > self._max_cached:
            self.generation += 1
            self._kernel.clear()
            self._user.clear()
            self._equal.clear()
            self._holders.clear()
            self._retry.clear()

    def _sweep_gone(self, start_time: Callable[[int], int | None]) -> None:
        """Drop the user frames of processes that are gone (a pid and its start
        time name a process): with process churn they would pile up until the
        cache's bound, holding every dead process's frames."""
        if self._repair is not None:
            self._repair.sweep(start_time)
        gone = [p for p in self._user if not p[1] or start_time(p[0]) != p[1]]
        # The ids of processes gone, cached for no process alive, are deleted
        # from the probe's map: at once if no row used them in this interval or
        # the one before, else at the next sweep (a row summed just before its
        # process ended is read within a sub-tick). Waiting a sweep for all of
        # them left the map's LRU to evict most first (see _free_user_ids).
        dead = set()
        for p in gone:
            cached = self._user.pop(p)
            dead.update([sid for sid in cached if self._release(sid)])
        used = self._last_use["u"]
        recent = self._seq - 1
        waiting = {sid for sid in dead if used.get(sid, -1) >= recent}
        holders = self._holders
        self._free_user_ids({sid for sid in self._dead_ids if sid not in holders} | (dead - waiting))
        self._dead_ids = waiting
        if gone and self._retry:
            dropped = set(gone)
            self._retry = {k: v for k, v in self._retry.items() if (k[0], k[1]) not in dropped}
        self._equal = {f: f for cached in self._user.values() for f in cached.values()}

    def _free_user_ids(self, ids: set[int]) -> None:
        """Delete user stack ids from the probe's map. Its LRU would make room
        itself, but under process churn it fills with dead processes' stacks
        and then evicts fresh ones before they are read (measured on the busy
        server: ~250 user stacks a second lost after the first minute). An id
        names the same frames wherever it comes back, so nothing cached goes."""
        if not ids:
            return
        # Deleted as they come: an id found gone already (evicted by the map's
        # LRU) costs a system call of its own, so past `GONE_MAX` of them the
        # ids still in the map are read first (a few batch commands, but each
        # copies every stack the map holds: ~15 ms at a busy server's 16,000,
        # where a sweep found none of its ~7,000 ids gone).
        order = list(ids)
        freed, tried = self._maps.delete_stacks("u", order, self.GONE_MAX)
        if tried < len(order):
            rest = set(order[tried:]).intersection(self._maps.stack_ids("u"))
            freed += self._maps.delete_stacks("u", list(rest))[0]
        users = self._last_use["u"]
        for sid in ids:
            users.pop(sid, None)
        self.stats.user_freed += freed
