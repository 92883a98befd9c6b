"""offcpu.c, compiled, loaded and attached: its maps, read and written by name.

`Probe` is the only place that talks to bcc. Everything it hands out is
plain Python data (tuples of ints and bytes, ctypes records copied out of
mapped memory); the engine turns that into the model. Only `set_threshold`
may be called from another thread than the one that reads (a single map
write).
"""

from __future__ import annotations

import contextlib
import ctypes as ct
import mmap
import struct
import threading
import time
from collections.abc import Iterable, Iterator
from importlib import resources
from typing import Any

from offtop.bpf import environment
from offtop.bpf.config import EngineConfig, EngineError
from offtop.bpf.decode import (
    COUNTERS,
    START_TID_OFFSET,
    AccRecord,
    StartRecord,
    free_slot,
    generation_sums,
    owned_slots,
)

PROBE_FUNCTION = b"tracepoint__sched__sched_switch"

# offcpu.c's offtop_config slots.
CFG_GEN = 0
CFG_ARMED = 1
CFG_WAKER_MIN = 3
#: offcpu.c SLOT_PROBES: a thread's record is in one of these slots from tid % slots.
SLOT_PROBES = 4
BPF_NOEXIST = 1
_U64 = struct.Struct("<Q")

#: A waker as the probe keeps it: (tgid, tid, ustack, kstack, what, comm bytes).
RawWaker = tuple[int, int, int, int, int, bytes]
#: An aggregated row as the probe keeps it, stacks still ids:
#: (tgid, tid, state, ustack, kstack, total_ns, count, max_ns, comm bytes, waker).
RawRow = tuple[int, int, int, int, int, int, int, int, bytes, RawWaker]


class Probe:
    """The BPF side of offtop (see offcpu.c), behind a small API."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self._bpf: Any = None
        self._tables: dict[str, Any] = {}
        self.slots_mm: mmap.mmap | None = None
        self._acc_mm: mmap.mmap | None = None
        self.prog_fd = -1
        self._gen = 0

    # --- life cycle ---------------------------------------------------------

    def load(self, threshold_ns: int) -> None:
        """Compile and attach offcpu.c and write every map it reads (not armed yet)."""
        from bcc import BPF  # after environment.prepare(): bcc reads its settings at import

        src = resources.files("offtop.bpf").joinpath("offcpu.c").read_text()
        try:
            with environment.captured_stderr() as log:
                self._bpf = BPF(text=src.encode(), cflags=self.config.cflags())
        except Exception as e:  # bcc raises bare Exception on compile/load/attach errors
            raise EngineError(environment.load_failure(str(e), log.text)) from None
        self.set_threshold(threshold_ns)
        self._table("offtop_config")[ct.c_int(CFG_WAKER_MIN)] = ct.c_uint64(
            self.config.waker_stacks_min_ns)
        if self.config.pids or self.config.tids:
            one = ct.c_uint8(1)
            for pid in self.config.pids:
                self._table("pid_filter")[ct.c_uint32(pid)] = one
            for tid in self.config.tids:
                self._table("tid_filter")[ct.c_uint32(tid)] = one
        if self.config.cgroup is not None:
            try:
                self._table("cgroup_filter")[0] = self.config.cgroup
            except Exception as e:
                raise EngineError(f"cannot use cgroup {self.config.cgroup}: {e}") from None
        if self.config.wakers:
            # After the probe bcc attached as it loaded: on_sched_waking reads
            # what that one found (offcpu.c).
            try:
                self._bpf.attach_tracepoint(tp=b"sched:sched_waking", fn_name=b"on_sched_waking")
            except Exception as e:  # bcc raises bare Exception
                raise EngineError(f"could not attach to sched:sched_waking: {e} "
                                  "(--no-wakers runs without it)") from None
        funcs = self._bpf.funcs
        self.prog_fd = funcs[PROBE_FUNCTION].fd if PROBE_FUNCTION in funcs else -1
        # The per-thread records and their short-block sums, mapped: read from memory.
        n = self.config.start_entries
        self.slots_mm = mmap.mmap(self._table("offcpu_slots").map_fd, n * ct.sizeof(StartRecord),
                                  mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        self._acc_mm = mmap.mmap(self._table("offcpu_acc").map_fd, 2 * n * ct.sizeof(AccRecord),
                                 mmap.MAP_SHARED, mmap.PROT_READ)

    def set_perf_fd(self, cpu: int, fd: int) -> None:
        """Point the program's perf event array slot for `cpu` at our ring's fd."""
        from bcc.libbcc import lib

        table = self._table("offcpu_events")
        # Not bcc's PerfEventArray bookkeeping: the ring is ours (perf_ring.py).
        key, leaf = ct.c_int(cpu), ct.c_int(fd)
        if lib.bpf_update_elem(table.map_fd, ct.byref(key), ct.byref(leaf), 0) < 0:
            raise EngineError(f"could not attach the perf ring of CPU {cpu}")

    def arm(self) -> None:
        """Start recording (offcpu.c CFG_ARMED): every map and ring is in place."""
        self._table("offtop_config")[ct.c_int(CFG_ARMED)] = ct.c_uint64(1)

    def close(self) -> None:
        """Detach and free everything; safe twice."""
        for mm in (self.slots_mm, self._acc_mm):
            if mm is not None:
                mm.close()
        self.slots_mm = self._acc_mm = None
        if self._bpf is not None:
            self._detach_tracepoints()
            self._bpf.cleanup()
            self._bpf = None
        self._tables.clear()

    def _detach_tracepoints(self) -> None:
        """Close every tracepoint's perf event at once.

        The last perf user of a tracepoint waits for an RCU grace period as
        it goes (tens of ms here); bcc closes them one after another, which
        with a dozen tracepoints held offtop's exit for over a second. Each
        close here runs in its own thread (ctypes lets go of the GIL), so
        the waits overlap.
        """
        from bcc.libbcc import lib

        fds = self._bpf.tracepoint_fds
        closers = [threading.Thread(target=lib.bpf_close_perf_event_fd, args=(fd,),
                                    name="offtop-detach", daemon=True) for fd in fds.values()]
        for t in closers:
            t.start()
        for t in closers:
            t.join(timeout=5.0)
        fds.clear()

    def _table(self, name: str) -> Any:
        t = self._tables.get(name)
        if t is None:
            t = self._tables[name] = self._bpf.get_table(name.encode())
        return t

    # --- knobs ----------------------------------------------------------------

    def set_threshold(self, ns: int) -> None:
        """offcpu_thresh_ns: blocks this long or longer become events, from now on."""
        self._table("offcpu_thresh_ns")[ct.c_int(0)] = ct.c_uint64(ns)

    def kernel_threshold(self) -> int:
        """The threshold as the program reads it now."""
        return int(self._table("offcpu_thresh_ns")[ct.c_int(0)].value)

    def forget_target(self, pid: int | None = None, tid: int | None = None) -> None:
        """Stop recording a -p process or a -t thread (gone: its id may be reused)."""
        for name, key in (("pid_filter", pid), ("tid_filter", tid)):
            if key is not None:
                with contextlib.suppress(KeyError):
                    del self._table(name)[ct.c_uint32(key)]

    def set_unwind_rule(self, tgid: int, pc: int, rule: int) -> None:
        """Teach the probe how to step from `pc` to its caller in `tgid` (offcpu.c unwind_rules)."""
        from bcc.libbcc import lib

        table = self._table("unwind_rules")
        key, leaf = table.Key(tgid, 0, pc), ct.c_uint64(rule)
        lib.bpf_update_elem(table.map_fd, ct.byref(key), ct.byref(leaf), 0)  # LRU: never full

    def forget_unwind_rules(self, gone: set[int]) -> int:
        """Delete the rules of processes that are gone (their pids may come back); how many."""
        table = self._table("unwind_rules")
        victims = [k for k in table if k.tgid in gone]
        for k in victims:
            with contextlib.suppress(KeyError):
                del table[k]
        return len(victims)

    def seed_record(self, tid: int, rec: StartRecord) -> bool:
        """Give a thread blocked before offtop started a record (overflow hash, never
        replacing one the program made); True if written."""
        from bcc.libbcc import lib

        table = self._table("offcpu_start")
        key = ct.c_uint32(tid)
        return bool(lib.bpf_update_elem(table.map_fd, ct.byref(key), ct.byref(rec),
                                        BPF_NOEXIST) == 0)

    def record_of(self, tid: int) -> StartRecord | None:
        """The record of one thread, wherever it is (slot or overflow hash)."""
        assert self.slots_mm is not None
        size = ct.sizeof(StartRecord)
        for i in range(SLOT_PROBES):
            idx = (tid + i) % self.config.start_entries
            if _U64.unpack_from(self.slots_mm, idx * size + START_TID_OFFSET)[0] == tid:
                return StartRecord.from_buffer_copy(self.slots_mm, idx * size)
        table = self._table("offcpu_start")
        try:
            return StartRecord.from_buffer_copy(table[table.Key(tid)])
        except KeyError:
            return None

    def unseed(self, tid: int, ts: int) -> None:
        """Remove a seeded record that still holds `ts` (the thread ran meanwhile)."""
        table = self._table("offcpu_start")
        try:
            if table[table.Key(tid)].ts == ts:
                del table[table.Key(tid)]
        except KeyError:
            pass

    # --- reading ----------------------------------------------------------------

    def drain_aggregates(self) -> Iterator[RawRow]:
        """Switch the program to the other generation, then read and clear the old one.

        Two maps and two sums per slot, picked by the parity of a counter
        (offcpu.c CFG_GEN): the program writes one while this reads the
        other, so no increment is lost to a read-and-clear race.
        """
        old = self._gen
        self._gen += 1
        self._table("offtop_config")[ct.c_int(CFG_GEN)] = ct.c_uint64(self._gen)
        # sched_switch runs its programs with interrupts off: one that read the
        # old generation finishes within microseconds of the flip.
        time.sleep(0.0005)
        for k, v in self._table(f"offcpu_agg{old & 1}").items_lookup_and_delete_batch():
            yield (k.tgid, k.tid, k.state, k.ustack, k.kstack, v.total_ns, v.count, v.max_ns,
                   bytes(v.comm), (k.waker_tgid, k.waker_tid, v.waker_ustack, v.waker_kstack,
                                   k.waker_what, bytes(v.waker_comm)))
        assert self._acc_mm is not None
        for a in generation_sums(self._acc_mm, self.config.start_entries, old):
            w = a.w
            yield (a.tgid, a.tid, a.state, a.ustack, a.kstack, a.total_ns, a.count, a.max_ns,
                   bytes(a.comm), (w.tgid, w.tid, w.ustack, w.kstack, w.what, bytes(w.comm)))

    def thread_records(self) -> list[tuple[int, StartRecord, int]]:
        """(tid, record, slot) of every thread the program has a record of.

        slot -1: the record lives in the overflow hash (no free slot was near).
        """
        assert self.slots_mm is not None
        out = [(int(v.tid), v, i)
               for i, v in owned_slots(self.slots_mm, self.config.start_entries)]
        out += [(k if isinstance(k, int) else int(k.value), v, -1)
                for k, v in self._table("offcpu_start").items_lookup_batch()]
        return out

    def free_record(self, tid: int, slot: int) -> None:
        """Drop the record of a thread that is gone (a missed sched_process_free)."""
        if slot >= 0:
            assert self.slots_mm is not None
            free_slot(self.slots_mm, slot, tid)
        else:
            table = self._table("offcpu_start")
            with contextlib.suppress(KeyError):
                del table[table.Key(tid)]

    def counters(self) -> dict[str, int]:
        """offtop_counters, summed over CPUs, by name (decode.COUNTERS)."""
        table = self._table("offtop_counters")
        out = {}
        for i, name in enumerate(COUNTERS):
            try:
                out[name] = int(sum(table[ct.c_int(i)]))
            except (KeyError, IndexError):
                out[name] = 0
        return out

    # --- stacks -------------------------------------------------------------

    def _stack_table(self, kind: str) -> Any:
        return self._table("kernel_stacks" if kind == "k" else "user_stacks")

    def stack(self, kind: str, sid: int) -> tuple[int, ...] | None:
        """The addresses of stack `sid` ('k' or 'u'), innermost first; None if absent."""
        table = self._stack_table(kind)
        try:
            leaf = table[table.Key(sid)]
        except KeyError:
            return None
        ips = []
        for ip in leaf.ip:
            if not ip:
                break
            ips.append(int(ip))
        return tuple(ips)

    def stack_ids(self, kind: str) -> Iterable[int]:
        """Every id in use in a stack map."""
        return [int(key.value) for key in self._stack_table(kind)]

    def delete_stack(self, kind: str, sid: int) -> None:
        """Free a stack id (the kernel never does)."""
        table = self._stack_table(kind)
        with contextlib.suppress(KeyError):
            del table[table.Key(sid)]
