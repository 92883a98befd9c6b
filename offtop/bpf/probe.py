"""offcpu.c, loaded and attached: its maps, read and written by name.

`Probe` is the only place that knows how the program gets into the kernel
(`offtop.bpf.loader`: a cached artifact, or bcc compiling in a child
process on a miss) and how its maps are laid out. Maps are reached by fd
through the bpf() system call (`offtop.bpf.maps`), never through bcc.
Everything it hands out is plain Python data (tuples of ints and bytes,
ctypes records copied out of mapped memory); the engine turns that into
the model. Only `set_threshold`, `kernel_threshold` (single map operations)
and `detach_soon` may be called from another thread than the one that reads.
"""

from __future__ import annotations

import ctypes as ct
import math
import mmap
import os
import struct
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from offtop.bpf import environment
from offtop.bpf.config import EngineConfig, EngineError
from offtop.bpf.decode import (
    COUNTERS,
    START_TID_OFFSET,
    AccRecord,
    AggKey,
    AggValue,
    RecordFields,
    StartRecord,
    free_slot,
    generation_sums,
    owned_slot_fields,
    record_fields,
    stack_addresses,
)
from offtop.bpf.lineage import Forked, decode_forked
from offtop.bpf.loader.cache import DEFAULT_DIR, ArtifactCache
from offtop.bpf.loader.kernel import LoadedObject, LoadFailed
from offtop.bpf.loader.load import AheadCompile, Compile, LoadReport, compile_ahead, load_object
from offtop.bpf.maps import BPF_NOEXIST, BpfMap, ElementReader, MapError
from offtop.bpf.task_regs import ITERATOR, TaskRegisters, UserRegs

PROBE_FUNCTION = "tracepoint__sched__sched_switch"
#: offcpu.c's notes of who forked whom (offtop.bpf.lineage); with user stacks only.
LINEAGE = "lineage"
#: offcpu.c's map of forked processes not seen yet: they walk by their forker's rules.
RULES_OWNER = "rules_owner"
#: Tail-called by the sched_waking probe bcc's naming rule attaches (offcpu.c).
WAKING_FUNCTION = "on_sched_waking"
#: And the one on_sched_waking tail-calls for an interrupt's path.
IRQ_WAKER_FUNCTION = "on_irq_waker"

# offcpu.c's offtop_config slots.
CFG_GEN = 0
CFG_ARMED = 1
CFG_WAKER_MIN = 3
CFG_ENTRY_LO = 4
CFG_ENTRY_HI = 5
#: The map of each kind of stack id.
_STACK_TABLES = {"k": "kernel_stacks", "u": "user_stacks", "i": "irq_paths"}
#: offcpu.c SLOT_PROBES: a thread's record is in one of these slots from tid % slots.
SLOT_PROBES = 4
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_RULE_KEY = struct.Struct("<IIQ")  # offcpu.c struct rule_key
# offcpu.c struct agg_key and struct agg_val, for decoding a whole map at once.
_AGG_KEY = struct.Struct("<IIiiIIII")
_AGG_VAL = struct.Struct("<QQQ16s16sii")
assert _AGG_KEY.size == ct.sizeof(AggKey) and _AGG_VAL.size == ct.sizeof(AggValue)
#: What summing a row needs of its agg_val: (total_ns, max_ns, count, comm, waker ustack,
#: waker kstack).
_AGG_SUMS = struct.Struct("<QQQ16s16xii")
assert _AGG_SUMS.size == _AGG_VAL.size

#: A waker as the probe keeps it: (tgid, tid, ustack, kstack, what, comm bytes).
RawWaker = tuple[int, int, int, int, int, bytes]
#: An aggregated row as the probe keeps it, stacks still ids:
#: (tgid, tid, state, ustack, kstack, total_ns, count, max_ns, comm bytes, waker).
RawRow = tuple[int, int, int, int, int, int, int, int, bytes, RawWaker]
#: A row's sums as `Drained.sums` has them: (total_ns, max_ns, count, comm, waker ustack,
#: waker kstack).
RawSums = tuple[int, int, int, bytes, int, int]


def agg_key(tgid: int, tid: int, state: int, ustack: int, kstack: int, waker_tgid: int,
            waker_tid: int, waker_what: int) -> bytes:
    """offcpu.c struct agg_key's bytes for these fields (as `Drained.keys` has them)."""
    return _AGG_KEY.pack(tgid, tid, ustack, kstack, state, waker_tgid, waker_tid, waker_what)


@dataclass(slots=True)
class Drained:
    """One generation's rows, read in bulk (`Probe.drain_aggregates`).

    `keys[i]` is row i's struct agg_key as bytes (equal for equal keys, from
    the hash or a thread's slot alike: a dict key that costs no decoding) and
    `sums[i]` what summing it needs; `row(i)` decodes it whole, for a key seen
    for the first time. On a busy server most rows are keys seen before, so
    most are never decoded.
    """

    keys: list[bytes]
    sums: list[RawSums]
    _values: bytes  # the hash's agg_vals, rows 0.._in_hash - 1
    _in_hash: int
    _slots: list[tuple[Any, ...]]  # ACC_STRUCT tuples, the rest

    def row(self, i: int) -> RawRow:
        """Row i: (tgid, tid, state, ustack, kstack, total_ns, count, max_ns, comm, waker)."""
        if i < self._in_hash:
            tgid, tid, us, ks, st, wtgid, wtid, what = _AGG_KEY.unpack(self.keys[i])
            total, mx, count, comm, wcomm, wus, wks = _AGG_VAL.unpack_from(
                self._values, i * _AGG_VAL.size)
        else:
            (_tag, tid, tgid, st, us, ks, total, mx, count, comm, wtgid, wtid, wus, wks, what,
             _pad, wcomm) = self._slots[i - self._in_hash]
        return tgid, tid, st, us, ks, total, count, mx, comm, (wtgid, wtid, wus, wks, what, wcomm)


def offcpu_source() -> str:
    """offcpu.c's text, as it is compiled (and hashed into the cache key)."""
    return resources.files("offtop.bpf").joinpath("offcpu.c").read_text()


def default_cache() -> ArtifactCache:
    """/var/cache/offtop, or $OFFTOP_CACHE_DIR (checked alike: see loader.cache)."""
    return ArtifactCache(Path(os.environ.get("OFFTOP_CACHE_DIR") or DEFAULT_DIR))


def compile_ahead_of(config: EngineConfig) -> AheadCompile | None:
    """The compile a `Probe` of `config` will need at `load`, begun now if the default
    cache has no file for it (a first start, or new options): beside the rest of
    offtop's start (the engine's imports, the TUI's), not after it. Only on a
    machine that passes `load`'s checks (which also choose the kernel headers the
    compile reads); else None, and `load` says what is wrong."""
    try:
        environment.prepare()
        tracefs = environment.tracefs_dir()
        if tracefs is None:
            return None
        return compile_ahead(offcpu_source(), config.cflags(), cache=default_cache(),
                             tracefs=tracefs)
    except Exception:  # only time is at stake: `load` meets the same problem and says it
        return None


class Probe:
    """The BPF side of offtop (see offcpu.c), behind a small API."""

    def __init__(self, config: EngineConfig, *, cache: ArtifactCache | None = None,
                 compile: Compile | None = None, ahead: AheadCompile | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self._clock = clock
        #: When recording stopped (`detach_soon`), on `clock`; inf while it records.
        self.stopped_at = math.inf
        self.cache = cache if cache is not None else default_cache()
        self._compile = compile
        self._ahead = ahead  # a compile begun before (`compile_ahead_of`), taken at load
        self._obj: LoadedObject | None = None
        self.slots_mm: mmap.mmap | None = None
        self._acc_mm: mmap.mmap | None = None
        self._touched_mm: mmap.mmap | None = None
        self._taken_mm: mmap.mmap | None = None
        self.prog_fd = -1
        self._gen = 0
        self._stack_readers: dict[str, ElementReader] = {}
        self._detach_asked = threading.Event()
        self._detacher: threading.Thread | None = None
        self._task_regs: TaskRegisters | None = None
        #: How the program was obtained (cache hit or compile) and what it cost.
        self.report = LoadReport()

    # --- life cycle ---------------------------------------------------------

    def load(self, threshold_ns: int) -> None:
        """Load and attach offcpu.c and write every map it reads (not armed yet)."""
        src = offcpu_source()
        tracefs = environment.tracefs_dir()
        if tracefs is None:
            raise EngineError("tracefs is not mounted: cannot attach to sched:sched_switch")
        self._obj, self.report = load_object(src, self.config.cflags(), cache=self.cache,
                                             tracefs=tracefs, compile=self._compile,
                                             ahead=self._ahead)
        self._ahead = None
        obj = self._obj
        try:
            obj.attach_autoload()
        except LoadFailed as e:
            raise EngineError(f"could not load the BPF program: {e.message}") from None
        self.set_threshold(threshold_ns)
        self._config_slot(CFG_WAKER_MIN, self.config.waker_stacks_min_ns)
        if self.config.pids or self.config.tids:
            one = b"\1"
            for pid in self.config.pids:
                self._map("pid_filter").update(_U32.pack(pid), one)
            for tid in self.config.tids:
                self._map("tid_filter").update(_U32.pack(tid), one)
        if self.config.cgroup is not None:
            try:
                self._map("cgroup_filter").set_cgroup(0, self.config.cgroup)
            except OSError as e:
                raise EngineError(f"cannot use cgroup {self.config.cgroup}: {e.strerror or e}") \
                    from None
        if self.config.wakers:
            # Tail-called by the sched_waking probe attached above, which hands it
            # what it found (offcpu.c); until then that one calls nothing.
            # (The interrupt's path is a kernel stack: no program for it without them.)
            called = ([WAKING_FUNCTION, IRQ_WAKER_FUNCTION] if self.config.kernel_stacks
                      else [WAKING_FUNCTION])
            try:
                for slot, name in enumerate(called):
                    fd = obj.progs.get(name)
                    if fd is None:
                        raise LoadFailed(f"no program {name}")
                    self._map("waking_next").update(_U32.pack(slot), _U32.pack(fd))
            except (LoadFailed, OSError) as e:
                why = e.message if isinstance(e, LoadFailed) else (e.strerror or str(e))
                raise EngineError(f"could not set up the sched:sched_waking probe: {why} "
                                  "(--no-wakers runs without it)") from None
        self.prog_fd = obj.progs.get(PROBE_FUNCTION, -1)
        # The per-thread records and their short-block sums, mapped: read from memory.
        n = self.config.start_entries
        self.slots_mm = mmap.mmap(self._map("offcpu_slots").fd, n * ct.sizeof(StartRecord),
                                  mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        self._acc_mm = mmap.mmap(self._map("offcpu_acc").fd, 2 * n * ct.sizeof(AccRecord),
                                 mmap.MAP_SHARED, mmap.PROT_READ)
        # A byte per slot and parity, then offcpu.c's AGG_USED_WORD.
        self._touched_mm = mmap.mmap(self._map("offcpu_touched").fd, 2 * n + 8,
                                     mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        self._taken_mm = mmap.mmap(self._map("offcpu_slot_taken").fd, n,
                                   mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)

    def set_perf_fd(self, cpu: int, fd: int, *, ring: str = "offcpu_events") -> None:
        """Point the slot for `cpu` of the program's perf event array `ring` (its
        block events, or `new_user_stacks`) at our ring's fd."""
        try:
            self._map(ring).update(_U32.pack(cpu), _U32.pack(fd))
        except OSError:
            raise EngineError(f"could not attach the perf ring of CPU {cpu}") from None

    def arm(self) -> None:
        """Start recording (offcpu.c CFG_ARMED): every map and ring is in place.

        A thread is started that detaches the tracepoints once `detach_soon`
        is called: detaching waits for RCU grace periods (about 0.2 s here,
        more on a busy machine), and begun when a stop comes it overlaps the
        last interval's build instead of adding to the exit. (A signal handler
        cannot start that thread; it can set an event.)
        """
        self._config_slot(CFG_ARMED, 1)
        obj = self._obj
        if obj is None or self._detacher is not None:
            return

        def detach_when_asked() -> None:
            self._detach_asked.wait()
            try:
                # Disarmed first: recording ends now, not once the (slow) detach is done.
                self._config_slot(CFG_ARMED, 0)  # self._obj stays until close() joins
                self.stopped_at = self._clock()
            except MapError:
                pass  # then recording ends with the detach
            finally:
                obj.detach_all()

        self._detacher = threading.Thread(target=detach_when_asked, name="offtop-detacher",
                                          daemon=True)
        self._detacher.start()

    def detach_soon(self) -> None:
        """Stop recording now: the program is disarmed and the tracepoints detached in
        the background (see `arm`; `stopped_at` says when recording ended); maps stay
        readable until `close`. Callable from a signal handler or any thread."""
        self._detach_asked.set()

    def close(self) -> None:
        """Detach and free everything; safe twice."""
        if self._detacher is not None:
            self._detach_asked.set()
            self._detacher.join()
            self._detacher = None
        for mm in (self.slots_mm, self._acc_mm, self._touched_mm, self._taken_mm):
            if mm is not None:
                mm.close()
        self.slots_mm = self._acc_mm = self._touched_mm = self._taken_mm = None
        if self._obj is not None:
            self._obj.close()  # tracepoints detached in parallel (see LoadedObject.detach_all)
            self._obj = None
        self.prog_fd = -1

    def user_regs(self, tid: int) -> UserRegs | None:
        """The user registers the kernel saved for thread `tid` (offtop.bpf.task_regs);
        None if the thread is gone or running kernel code only, or this kernel cannot."""
        obj = self._obj
        if obj is None or not (self.config.user_stacks and ITERATOR in obj.artifact_programs):
            return None
        if self._task_regs is None:
            self._task_regs = TaskRegisters(obj)
        return self._task_regs.of(tid)

    def task_regs_unavailable(self) -> str:
        """Why saved registers cannot be read ('' if they can, or were never asked for)."""
        return self._task_regs.unavailable if self._task_regs is not None else ""

    def has_map(self, name: str) -> bool:
        """Whether the loaded program has map `name` (some exist on x86-64 only)."""
        return self._obj is not None and name in self._obj.maps

    def _map(self, name: str) -> BpfMap:
        if self._obj is None:
            raise EngineError("the BPF program is not loaded")
        return self._obj.maps[name]

    def _config_slot(self, slot: int, value: int) -> None:
        self._map("offtop_config").update(_U32.pack(slot), _U64.pack(value))

    # --- knobs ----------------------------------------------------------------

    def set_threshold(self, ns: int) -> None:
        """offcpu_thresh_ns: blocks this long or longer become events, from now on."""
        self._map("offcpu_thresh_ns").update(_U32.pack(0), _U64.pack(ns))

    def kernel_threshold(self) -> int:
        """The threshold as the program reads it now."""
        raw = self._map("offcpu_thresh_ns").lookup(_U32.pack(0))
        return int(_U64.unpack(raw)[0]) if raw is not None else 0

    def forget_target(self, pid: int | None = None, tid: int | None = None) -> None:
        """Stop recording a -p process or a -t thread (gone: its id may be reused)."""
        for name, key in (("pid_filter", pid), ("tid_filter", tid)):
            if key is not None:
                self._map(name).delete(_U32.pack(key))

    def set_unwind_rule(self, tgid: int, pc: int, rule: int) -> None:
        """Teach the probe how to step from `pc` to its caller in `tgid` (offcpu.c unwind_rules)."""
        # An LRU map is never full; a failure costs only a frame-pointer step.
        self._map("unwind_rules").try_update(_RULE_KEY.pack(tgid, 0, pc), _U64.pack(rule))

    def forget_unwind_rules(self, rules: Iterable[tuple[int, int]]) -> int:
        """Delete these (tgid, pc) rules: their processes are gone (the pids may
        come back); how many were there (the LRU may have dropped some)."""
        return self._map("unwind_rules").delete_many(
            [_RULE_KEY.pack(tgid, 0, pc) for tgid, pc in rules])

    def rule_owners(self) -> dict[int, int]:
        """{process: the process whose rules it walks by} (offcpu.c rules_owner: forked
        processes offtop has not seen yet, and threads created since)."""
        return {_U32.unpack(k)[0]: _U32.unpack(v)[0]
                for k, v in self._map(RULES_OWNER).items()}

    def drop_rule_owners(self, pids: Iterable[int]) -> None:
        """These processes walk by their own rules from now (one batch command)."""
        self._map(RULES_OWNER).delete_many([_U32.pack(pid) for pid in pids])

    def forked(self, pid: int) -> Forked | None:
        """The probe's note of which process `pid` was forked from, when, and when it
        last exec'd (offtop.bpf.lineage); None if it has none."""
        raw = self._map(LINEAGE).lookup(_U32.pack(pid))
        return decode_forked(raw) if raw is not None else None

    def seed_record(self, tid: int, rec: StartRecord) -> bool:
        """Give a thread blocked before offtop started a record (overflow hash, never
        replacing one the program made); True if written."""
        return self._map("offcpu_start").try_update(_U32.pack(tid), bytes(rec), BPF_NOEXIST) == 0

    def recorded_tids(self) -> set[int]:
        """The threads with a record, slot or overflow hash (read in bulk)."""
        return {f[1] for f in self.thread_fields()}

    def record_of(self, tid: int) -> StartRecord | None:
        """The record of one thread, wherever it is (slot or overflow hash)."""
        assert self.slots_mm is not None
        size = ct.sizeof(StartRecord)
        for i in range(SLOT_PROBES):
            idx = (tid + i) % self.config.start_entries
            if _U64.unpack_from(self.slots_mm, idx * size + START_TID_OFFSET)[0] == tid:
                return StartRecord.from_buffer_copy(self.slots_mm, idx * size)
        raw = self._map("offcpu_start").lookup(_U32.pack(tid))
        return StartRecord.from_buffer_copy(raw) if raw is not None else None

    def unseed(self, tid: int, ts: int) -> bool:
        """Remove a seeded record that still holds `ts` (the thread ran meanwhile); False
        if it no longer did (the program took it: the block it began was counted)."""
        table = self._map("offcpu_start")
        raw = table.lookup(_U32.pack(tid))
        if raw is not None and StartRecord.from_buffer_copy(raw).ts == ts:
            table.delete(_U32.pack(tid))
            return True
        return False

    # --- reading ----------------------------------------------------------------

    def drain_aggregates(self) -> Drained:
        """Switch the program to the other generation, then read and clear the old one.

        Two maps and two sums per slot, picked by the parity of a counter
        (offcpu.c CFG_GEN): the program writes one while this reads the
        other, so no increment is lost to a read-and-clear race.
        """
        old = self._gen
        self._gen += 1
        self._config_slot(CFG_GEN, self._gen)
        # sched_switch runs its programs with interrupts off: one that read the
        # old generation finishes within microseconds of the flip.
        time.sleep(0.0005)
        assert self._acc_mm is not None and self._touched_mm is not None
        # Read only if the program added a key to it (offcpu.c AGG_USED_WORD): the
        # batch read walks every bucket of the map, empty or not. Cleared once
        # read; nothing writes the old generation by now (see above).
        used = 2 * self.config.start_entries + (old & 1)
        keys, values, n = b"", b"", 0
        if self._touched_mm[used]:
            table = self._map(f"offcpu_agg{old & 1}")
            raw = table.items_raw(delete=True)
            if raw is None:  # no batch commands here: one entry at a time
                items = table.items(delete=True)
                raw = b"".join(k for k, _ in items), b"".join(v for _, v in items), len(items)
            keys, values, n = raw
            self._touched_mm[used] = 0
        size = _AGG_KEY.size
        slots = generation_sums(self._acc_mm, self._touched_mm, self.config.start_entries, old)
        pack = _AGG_KEY.pack
        return Drained(
            [keys[at:at + size] for at in range(0, n * size, size)]
            + [pack(tgid, tid, us, ks, st, wtgid, wtid, what)
               for (_tag, tid, tgid, st, us, ks, _t, _m, _c, _comm, wtgid, wtid, _wus, _wks,
                    what, _pad, _wcomm) in slots],
            list(_AGG_SUMS.iter_unpack(values))
            + [(total, mx, count, comm, wus, wks)
               for (_tag, _tid, _tgid, _st, _us, _ks, total, mx, count, comm, _wtgid, _wtid,
                    wus, wks, _what, _pad, _wcomm) in slots],
            values, n, slots)

    def thread_fields(self) -> list[RecordFields]:
        """(ts, tid, tgid, state, ustack, kstack, ubp, slot) of every thread the program
        has a record of, decoded in bulk (what `BlockedNowReader` reads at every
        snapshot). slot -1: the record lives in the overflow hash (no free slot was
        near)."""
        assert self.slots_mm is not None and self._taken_mm is not None
        out = owned_slot_fields(self.slots_mm, self._taken_mm, self.config.start_entries)
        table = self._map("offcpu_start")
        raw = table.items_raw()
        if raw is not None:
            out += record_fields(raw[1], raw[2])
        else:
            values = b"".join(v for _k, v in table.items())
            out += record_fields(values, len(values) // ct.sizeof(StartRecord))
        return out

    def free_record(self, tid: int, slot: int) -> None:
        """Drop the record of a thread that is gone (a missed sched_process_free)."""
        if slot >= 0:
            assert self.slots_mm is not None and self._taken_mm is not None
            free_slot(self.slots_mm, self._taken_mm, slot, tid)
        else:
            self._map("offcpu_start").delete(_U32.pack(tid))

    def counters(self) -> dict[str, int]:
        """offtop_counters, summed over CPUs, by name (decode.COUNTERS)."""
        table = self._map("offtop_counters")
        sums = dict.fromkeys(range(len(COUNTERS)), 0)
        for k, v in table.items():
            i = _U32.unpack(k)[0]
            if i in sums:
                sums[i] = sum(_U64.unpack_from(v, c * 8)[0] for c in range(table.ncpus))
        return {name: sums[i] for i, name in enumerate(COUNTERS)}

    # --- stacks -------------------------------------------------------------

    def _stack_table(self, kind: str) -> BpfMap:
        return self._map(_STACK_TABLES[kind])

    def set_entry_text(self, lo: int, hi: int) -> None:
        """Where the kernel's entry code is, [lo, hi): interrupts' stacks are cut at their
        first frame there and kept as paths (offcpu.c irq_path_id) from now on."""
        if self.has_map("irq_paths"):
            self._config_slot(CFG_ENTRY_LO, lo)
            self._config_slot(CFG_ENTRY_HI, hi)

    def stack(self, kind: str, sid: int) -> tuple[int, ...] | None:
        """The addresses of stack `sid` ('k', 'u', or 'i': an interrupt's path), innermost
        first; None if absent.

        From the engine's thread only (one reader per map, buffers reused)."""
        reader = self._stack_readers.get(kind)
        if reader is None:
            reader = self._stack_readers[kind] = ElementReader(self._stack_table(kind))
        raw = reader.lookup(_U32.pack(sid & 0xFFFFFFFF))
        return None if raw is None else stack_addresses(raw)

    def stack_ids(self, kind: str) -> Iterable[int]:
        """Every id in use in a stack map."""
        return [struct.unpack("<i", k)[0] for k in self._stack_table(kind).all_keys()]

    def delete_stacks(self, kind: str, sids: Sequence[int], max_gone: int | None = None
                      ) -> tuple[int, int]:
        """Free stack ids in order (the kernel never frees a stack map's; ids already
        gone are skipped, each at the cost of a command of its own): one batch
        command where the map type has them. Past `max_gone` ids found gone the
        rest is not tried. (How many went, how many of `sids` were tried.)"""
        return self._stack_table(kind).delete_some(
            [_U32.pack(sid & 0xFFFFFFFF) for sid in sids], max_gone)
