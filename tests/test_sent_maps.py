"""The kernel's exec and mapping records (offtop.bpf.sent_maps): decoded, kept per
process from its exec on, trusted only for the process the probe noted, and used to
name a process gone before its first sight; files opened by path only while they
are the file that was mapped. The last test reads real records from the kernel."""

from __future__ import annotations

import os
import shutil
import struct
import subprocess
import time
from pathlib import Path

import pytest

from offtop.bpf.sent_maps import (
    CLOCK_BOOTTIME,
    EXEC_SLACK_NS,
    KEEP_NS,
    MAX_MAPPINGS,
    PERF_RECORD_COMM,
    PERF_RECORD_MISC_COMM_EXEC,
    PERF_RECORD_MMAP2,
    SentMaps,
)
from offtop.elf import FILE_REPLACED, ElfCache
from offtop.model import MARK_PROCESS_GONE, MARK_TRUNCATED
from offtop.symbols import Mapping, UserSymbols, read_maps
from offtop.unwind.cache import TableCache
from tests.test_symbols import LIBC, _addr, a_sleep_seen_alive

SEC = 1_000_000_000


def _pad(name: bytes) -> bytes:
    name += b"\0"
    return name + b"\0" * (-len(name) % 8)


def comm_exec(pid: int, ts: int, name: bytes = b"sleep") -> tuple[int, int, bytes]:
    body = struct.pack("<II", pid, pid) + _pad(name) + struct.pack("<IIQ", pid, pid, ts)
    return PERF_RECORD_COMM, PERF_RECORD_MISC_COMM_EXEC, struct.pack("<IHH", 3, 0x2000, 8 + len(body)) + body


def mmap2(pid: int, ts: int, start: int, length: int, path: bytes, *, pgoff: int = 0,
          dev: tuple[int, int] = (254, 1), ino: int = 12) -> tuple[int, int, bytes]:
    body = (struct.pack("<IIQQQIIQQII", pid, pid, start, length, pgoff, dev[0], dev[1], ino, 0, 5, 2)
            + _pad(path) + struct.pack("<IIQ", pid, pid, ts))
    return PERF_RECORD_MMAP2, 2, struct.pack("<IHH", 10, 2, 8 + len(body)) + body


class Noted:
    """The probe's notes of execs (Lineage.exec_of), by pid: when, and forked by whom."""

    def __init__(self) -> None:
        self.execs: dict[int, int] = {}
        self.forkers: dict[int, int] = {}

    def __call__(self, pid: int) -> tuple[int, int] | None:
        t = self.execs.get(pid)
        return None if t is None else (t, self.forkers.get(pid, 0))


def store(noted: Noted, now: int = 70 * SEC) -> SentMaps:
    return SentMaps(noted, now_ns=lambda: now)


def test_a_process_s_mappings_since_its_exec_are_kept_sorted_with_their_files() -> None:
    noted = Noted()
    sent = store(noted)
    # Across CPUs the mappings may be read before the exec's record, in one batch.
    sent.take([mmap2(7, 50 * SEC + 30, 0x7F00_0000, 0x1000, b"/usr/lib/x86_64-linux-gnu/libc.so.6",
                     pgoff=0x28000, ino=99),
               comm_exec(7, 50 * SEC),
               mmap2(7, 50 * SEC + 10, 0x5500_1000, 0x2000, b"/usr/bin/sleep", pgoff=0x1000),
               mmap2(7, 50 * SEC + 20, 0x7F10_0000, 0x1000, b"//anon"),
               mmap2(7, 50 * SEC + 40, 0x7F20_0000, 0x1000, b"/tmp/gone (deleted)")])
    noted.execs[7] = 50 * SEC + 5_000
    got = sent.mappings(7)
    assert got is not None and got[0] == 50 * SEC
    exe, libc, anon, gone = got[1]
    assert (exe.start, exe.end, exe.offset, exe.path, exe.handle) \
        == (0x5500_1000, 0x5500_3000, 0x1000, "/usr/bin/sleep", "/usr/bin/sleep")
    assert exe.ident == (os.makedev(254, 1), 12) and libc.ident == (os.makedev(254, 1), 99)
    assert libc.module == "libc.so.6" and libc.offset == 0x28000
    assert (anon.path, anon.handle, anon.module) == ("", "", "anon")
    assert gone.handle == ""  # deleted: no path to open
    assert sent.mappings(8) is None  # never seen exec'ing


def test_only_the_process_the_probe_noted_under_the_pid_is_given_its_list() -> None:
    """No note, a note of a fork since (no exec), or an exec at another moment: None."""
    noted = Noted()
    sent = store(noted)
    sent.take([comm_exec(7, 50 * SEC), mmap2(7, 50 * SEC + 1, 0x1000, 0x1000, b"/bin/a")])
    assert sent.mappings(7) is None
    noted.execs[7] = 50 * SEC + EXEC_SLACK_NS + 1  # another exec, whose record was not read
    assert sent.mappings(7) is None
    noted.execs[7] = 50 * SEC - 1
    assert sent.mappings(7) is None
    noted.execs[7] = 50 * SEC
    assert sent.mappings(7) is not None


def test_a_new_exec_starts_a_new_list_and_overlaps_replace() -> None:
    noted = Noted()
    sent = store(noted)
    sent.take([comm_exec(7, 50 * SEC), mmap2(7, 50 * SEC + 1, 0x1000, 0x3000, b"/bin/a")])
    sent.take([mmap2(7, 50 * SEC + 2, 0x2000, 0x1000, b"/bin/b"),  # maps over the middle
               mmap2(7, 50 * SEC + 3, 0x8000, 0x1000, b"/bin/c")])
    noted.execs[7] = 50 * SEC
    got = sent.mappings(7)
    assert got is not None and [m.path for m in got[1]] == ["/bin/b", "/bin/c"]
    sent.take([comm_exec(7, 60 * SEC), mmap2(7, 60 * SEC + 1, 0x9000, 0x1000, b"/bin/d"),
               comm_exec(7, 40 * SEC)])  # an older exec read late changes nothing
    noted.execs[7] = 60 * SEC
    got = sent.mappings(7)
    assert got is not None and [m.path for m in got[1]] == ["/bin/d"]
    assert sent.exec_at(7) == 60 * SEC and sent.exec_at(8) is None  # the kernel's, unchecked
    assert sent.covers(7, 0x9000) and sent.covers(7, 0x9FFF) and not sent.covers(7, 0xA000)
    assert not sent.covers(7, 0x2000) and not sent.covers(8, 0x9000)
    # Mappings older than the exec (of the program before it) are not taken.
    sent.take([mmap2(7, 59 * SEC, 0xA000, 0x1000, b"/bin/old")])
    assert [m.path for m in sent.mappings(7)[1]] == ["/bin/d"]  # type: ignore[index]


def test_paths_of_a_process_forked_in_another_mount_namespace_go_through_its_forker_s_root(
        tmp_path: Path) -> None:
    """The kernel's path is the process's own view: forked by a process in another
    mount namespace (a container's), its files are looked for through that one's root;
    in this one, or by a process gone, as given."""
    for pid, ns in (("self", "mnt:[1]"), ("30", "mnt:[1]"), ("31", "mnt:[2]")):
        (tmp_path / pid / "ns").mkdir(parents=True)
        (tmp_path / pid / "ns" / "mnt").symlink_to(ns)
    noted = Noted()
    sent = SentMaps(noted, now_ns=lambda: 70 * SEC, proc=str(tmp_path))
    for pid in (7, 8, 9):
        sent.take([comm_exec(pid, 50 * SEC), mmap2(pid, 50 * SEC + 1, 0x1000, 0x1000, b"/mnt/nsleep"),
                   mmap2(pid, 50 * SEC + 2, 0x3000, 0x1000, b"//anon")])
        noted.execs[pid] = 50 * SEC
    noted.forkers.update({7: 30, 8: 31, 9: 32})
    handles = {pid: [m.handle for m in sent.mappings(pid)[1]] for pid in (7, 8, 9)}  # type: ignore[index]
    assert handles == {7: ["/mnt/nsleep", ""], 8: [f"{tmp_path}/31/root/mnt/nsleep", ""],
                       9: ["/mnt/nsleep", ""]}
    assert sent.mappings(8)[1][0].path == "/mnt/nsleep"  # type: ignore[index]


def test_lost_records_drop_everything_and_the_store_is_bounded() -> None:
    noted = Noted()
    now = [100 * SEC]
    sent = SentMaps(noted, now_ns=lambda: now[0], max_processes=3)
    for pid in range(1, 5):
        sent.take([comm_exec(pid, 90 * SEC + pid), mmap2(pid, 90 * SEC + pid, 0x1000, 0x1000, b"/bin/a")])
        noted.execs[pid] = 90 * SEC + pid
    assert len(sent) == 3 and sent.mappings(1) is None and sent.mappings(4) is not None
    sent.lost()
    assert len(sent) == 0 and sent.mappings(4) is None and sent.resets == 1
    # At most MAX_MAPPINGS a process; kept KEEP_NS after its exec.
    many = [mmap2(9, 95 * SEC + i, 0x1000 * (i + 1), 0x1000, b"/bin/a") for i in range(MAX_MAPPINGS + 5)]
    sent.take([comm_exec(9, 95 * SEC), *many])
    noted.execs[9] = 95 * SEC
    assert len(sent.mappings(9)[1]) == MAX_MAPPINGS  # type: ignore[index]
    now[0] = 95 * SEC + KEEP_NS + 1
    sent.take([])
    assert len(sent) == 0


def test_malformed_records_are_passed_over() -> None:
    noted = Noted()
    sent = store(noted)
    typ, misc, good = mmap2(7, 50 * SEC + 1, 0x1000, 0x1000, b"/bin/a")
    zero = mmap2(7, 50 * SEC + 1, 0x1000, 0, b"/bin/z")  # no length
    sent.take([comm_exec(7, 50 * SEC), (typ, misc, good[:40]), zero, (PERF_RECORD_COMM, 0x2000, b"\0" * 9),
               (typ, misc, good)])
    noted.execs[7] = 50 * SEC
    assert [m.path for m in sent.mappings(7)[1]] == ["/bin/a"]  # type: ignore[index]


def _libc_of(pid: int) -> tuple[Mapping, int]:
    getpid = _addr(LIBC.getpid)
    (m,) = [m for m in read_maps(pid) if m.start <= getpid < m.end]
    return m, getpid


def test_a_gone_process_is_named_in_the_mappings_the_kernel_sent() -> None:
    """Gone before its first sight, with no stand-in: named in its own mappings as
    sent, files opened by path while they are the files that were mapped (here this
    process's libc, as if another process had mapped it at the same place)."""
    m, getpid = _libc_of(os.getpid())
    st = os.stat(m.path)
    sent_libc = Mapping(m.start, m.end, m.offset, m.path, m.path, ident=(st.st_dev, st.st_ino))
    answers: dict[int, tuple[int, list[Mapping]] | None] = {4242: (5, [sent_libc])}
    u = UserSymbols(start_time=lambda pid: None)
    u.sent = answers.get
    frames = u.resolve_stack(4242, [getpid + 1])
    assert frames[0].name in ("getpid", "__getpid") and frames[0].module == "libc.so.6", frames
    assert u.from_sent == 1 and u.file_mappings(4242, getpid) == [sent_libc]
    # Another file at that path since (another device and inode): no name.
    u = UserSymbols(start_time=lambda pid: None)
    u.sent = {4242: (5, [Mapping(m.start, m.end, m.offset, m.path, m.path,
                                 ident=(st.st_dev, st.st_ino + 1))])}.get
    frames = u.resolve_stack(4242, [getpid + 1])
    assert frames[0].name.startswith("libc.so.6+0x") and u.errors[FILE_REPLACED] == 1, frames
    # Nothing sent: gone, as before.
    u = UserSymbols(start_time=lambda pid: None)
    u.sent = {}.get
    assert [f.name for f in u.resolve_stack(4242, [getpid + 1])] == [MARK_PROCESS_GONE]


def test_a_pid_whose_sent_mappings_are_another_process_s_since_is_asked_again() -> None:
    m, getpid = _libc_of(os.getpid())
    st = os.stat(m.path)
    libc = Mapping(m.start, m.end, m.offset, m.path, m.path, ident=(st.st_dev, st.st_ino))
    clock = [0.0]
    answers: dict[int, tuple[int, list[Mapping]] | None] = {4242: (5, [libc])}
    u = UserSymbols(start_time=lambda pid: None, clock=lambda: clock[0])
    u.sent = answers.get
    assert u.resolve_stack(4242, [getpid + 1])[0].module == "libc.so.6"
    answers[4242] = (9, [])  # another exec under the pid: nothing of it mapped there
    clock[0] = 0.5
    assert u.resolve_stack(4242, [getpid + 1])[0].module == "libc.so.6"  # held for REREAD_S
    clock[0] = 2.0
    assert u.file_mappings(4242, getpid) == [] and u.from_sent == 2


def test_files_opened_by_path_must_be_the_file_that_was_mapped(tmp_path: Path) -> None:
    """ElfCache and the unwinder's TableCache, given the (device, inode) the kernel said
    was mapped: another file at the path gives nothing; the file itself is read."""
    exe = tmp_path / "true"
    shutil.copy("/usr/bin/true", exe)
    st = exe.stat()
    assert not isinstance(ElfCache().get(str(exe), expect=(st.st_dev, st.st_ino)), str)
    assert ElfCache().get(str(exe), expect=(st.st_dev, st.st_ino + 1)) == FILE_REPLACED
    tables = TableCache()
    assert tables.get(str(exe), (st.st_dev, st.st_ino + 1)) is None
    assert tables.failures == {"file_replaced": 1}
    table = tables.get(str(exe), (st.st_dev, st.st_ino))
    assert table is not None and len(table) > 0


@pytest.mark.bpf
@pytest.mark.usefixtures("bpf_available")
def test_the_kernel_sends_an_exec_d_process_s_mappings() -> None:
    """Real records: a process that execs Debian's `true` and ends is kept with its
    own binary and libc, their devices and inodes as stat gives them."""
    from offtop.bpf.sent_maps import MappingWatch

    noted = Noted()
    watch = MappingWatch(SentMaps(noted), pages=8)
    try:
        child = subprocess.Popen(["/usr/bin/true"])
        child.wait(timeout=5)
        deadline = time.monotonic() + 5
        while watch.read() == 0 or child.pid not in watch.sent:
            assert time.monotonic() < deadline, "no exec record came"
            time.sleep(0.05)
        noted.execs[child.pid] = time.clock_gettime_ns(CLOCK_BOOTTIME)
        got = watch.sent.mappings(child.pid)
    finally:
        watch.close()
    assert got is not None
    by_path = {m.path: m for m in got[1]}
    true = by_path["/usr/bin/true"]
    st = os.stat("/usr/bin/true")
    assert true.ident == (st.st_dev, st.st_ino) and true.handle == "/usr/bin/true"
    libc = [m for m in got[1] if m.module == "libc.so.6"]
    assert libc and libc[0].ident == (os.stat(libc[0].path).st_dev, os.stat(libc[0].path).st_ino)
    assert watch.lost == 0


def test_the_mappings_kept_are_bounded_in_all() -> None:
    """Processes that each map a thousand pieces of code cost megabytes: past
    MAX_TOTAL_MAPPINGS, the oldest execs' lists go first."""
    from offtop.bpf.sent_maps import MAX_TOTAL_MAPPINGS

    noted = Noted()
    sent = store(noted)
    per = MAX_MAPPINGS
    procs = MAX_TOTAL_MAPPINGS // per + 2
    for pid in range(1, procs + 1):
        ts = 50 * SEC + pid * 10_000
        sent.take([comm_exec(pid, ts)]
                  + [mmap2(pid, ts + i + 1, 0x1000 * (i + 1), 0x1000, b"/bin/a") for i in range(per)])
        noted.execs[pid] = ts
    kept = [pid for pid in range(1, procs + 1) if sent.mappings(pid) is not None]
    assert sum(len(sent.mappings(pid)[1]) for pid in kept) <= MAX_TOTAL_MAPPINGS  # type: ignore[index]
    assert kept == list(range(procs - len(kept) + 1, procs + 1)) and len(kept) >= procs - 3
    assert sent.mappings(procs) is not None and len(sent.mappings(procs)[1]) == per  # type: ignore[index]


def test_a_process_seen_alive_then_gone_is_unwound_in_the_files_the_kernel_sent() -> None:
    """Its map was read alive (files to open through map_files, gone with it): once
    it is found gone, the files its unwinding opens are the ones the kernel sent,
    by path and checked (here a child `sleep`'s libc, as the kernel would give it)."""
    with a_sleep_seen_alive() as (child, libc, start, u):
        st = os.stat(libc.path)
        sent = [Mapping(libc.start, libc.end, libc.offset, libc.path, libc.path,
                        ident=(st.st_dev, st.st_ino))]
        u.sent = {child.pid: (5, sent)}.get
        assert all("/map_files/" in m.handle for m in u.file_mappings(child.pid, libc.start, start))
    u.resolve_stack(child.pid, [libc.start], start=start)  # finds it gone
    assert u.file_mappings(child.pid, libc.start, start) == sent


def test_mappings_sent_after_a_gone_process_was_first_asked_about_are_taken() -> None:
    """A process first asked about while it was still mapping its libraries (a stack
    of it blocked in ld.so): an address outside the mappings then known is looked for
    in those the kernel sent since, before it is cut as untrusted."""
    m, getpid = _libc_of(os.getpid())
    st = os.stat(m.path)
    libc = Mapping(m.start, m.end, m.offset, m.path, m.path, ident=(st.st_dev, st.st_ino))
    exe = Mapping(0x1000, 0x2000, 0, "/usr/bin/true", "/usr/bin/true", ident=(st.st_dev, 1))
    answers: dict[int, tuple[int, list[Mapping]] | None] = {4242: (5, [exe])}
    u = UserSymbols(start_time=lambda pid: None)
    _wire_sent(u, answers)
    assert u.resolve_stack(4242, [getpid + 1])[0].name == MARK_TRUNCATED
    answers[4242] = (5, [exe, libc])
    assert u.resolve_stack(4242, [getpid + 1])[0].name in ("getpid", "__getpid")
    # Another exec under the pid, with a mapping at the address: not taken.
    anon = Mapping(0x5000, 0x6000, 0, "[anon]", "", ident=None)
    answers[4242] = (6, [exe, anon, libc])
    assert u.sent_covers(4242, 0x5000)
    assert u.resolve_stack(4242, [0x5000])[0].name == MARK_TRUNCATED
    answers[4242] = (5, [exe, anon, libc])  # the same exec's: taken
    assert u.resolve_stack(4242, [0x5008])[0].name != MARK_TRUNCATED
    # A junk address (the exec's own stacks have thousands): cut without a read
    # of the list (a probe-map lookup and a readlink in the engine).
    asked = []
    u.sent = lambda pid: asked.append(pid) or answers.get(pid)  # type: ignore[func-returns-value]
    assert u.resolve_stack(4242, [0x9000])[0].name == MARK_TRUNCATED and asked == []


def _wire_sent(u: UserSymbols, answers: dict[int, tuple[int, list[Mapping]] | None]) -> None:
    """`sent` and `sent_covers` as the engine wires them, answering from `answers`."""
    u.sent = answers.get

    def covers(pid: int, addr: int) -> bool:
        got = answers.get(pid)
        return got is not None and any(m.start <= addr < m.end for m in got[1])
    u.sent_covers = covers


def test_a_map_read_before_its_process_exec_d_is_not_kept_for_the_new_program() -> None:
    """A shell's child is read from /proc as the shell (a block before its exec),
    then execs `sleep`: same pid, same start time, another program's memory. An exec
    the kernel recorded after the read makes the cache stale: the frames named in
    the shell's map are dropped, the map read again, or, the process gone, taken
    from the mappings the kernel sent for that exec. Before, the shell's map was
    kept a second: the sleep's addresses were cut, or named in the shell's files."""
    m, getpid = _libc_of(os.getpid())
    st = os.stat(m.path)
    exe = Mapping(0x1000, 0x2000, 0, "/usr/bin/true", "/usr/bin/true", ident=(st.st_dev, 1))
    libc = Mapping(m.start, m.end, m.offset, m.path, m.path, ident=(st.st_dev, st.st_ino))
    now = [10]
    proc_maps = {4242: [m]}  # the shell's, libc where this process has it
    alive: dict[int, int] = {4242: 77}
    execs: dict[int, int] = {}
    sent: dict[int, tuple[int, list[Mapping]]] = {}
    u = UserSymbols(start_time=alive.get, now_ns=lambda: now[0],
                    maps=lambda pid: list(proc_maps.get(pid, [])))
    u.exec_at, u.sent = execs.get, sent.get
    u.sent_covers = lambda pid, addr: any(m.start <= addr < m.end for m in sent.get(pid, (0, []))[1])
    assert u.resolve_stack(4242, [getpid + 1])[0].name in ("getpid", "__getpid")
    # It execs a program that has nothing at that address: not named in the shell's.
    now[0], execs[4242], proc_maps[4242] = 30, 20, [exe]
    assert u.resolve_stack(4242, [getpid + 1])[0].name == MARK_TRUNCATED
    assert u.execs_since_read == 1
    assert u.resolve_stack(4242, [getpid + 1])[0].name == MARK_TRUNCATED  # read once
    assert u.execs_since_read == 1
    # It execs again, libc there, and is gone before a read: the kernel's records name it.
    now[0], execs[4242], proc_maps[4242] = 50, 40, []
    del alive[4242]
    sent[4242] = (40, [exe, libc])
    frames = u.resolve_stack(4242, [getpid + 1])
    assert frames[0].name in ("getpid", "__getpid") and u.execs_since_read == 2, frames
    assert u.file_mappings(4242, getpid) == [exe, libc]


def test_a_map_read_while_the_exec_was_mapping_libraries_is_completed_from_what_was_sent() -> None:
    """Read from /proc after the exec but before its loader mapped libc (or empty: read
    as it exited), then gone: an address outside it is looked for in the mappings the
    kernel sent for that exec, before it is cut as untrusted."""
    m, getpid = _libc_of(os.getpid())
    st = os.stat(m.path)
    exe = Mapping(0x1000, 0x2000, 0, "/usr/bin/true", "/usr/bin/true", ident=(st.st_dev, 1))
    libc = Mapping(m.start, m.end, m.offset, m.path, m.path, ident=(st.st_dev, st.st_ino))
    for read in ([exe], []):
        alive = {4242: 77}
        execs = {4242: 5}
        sent: dict[int, tuple[int, list[Mapping]]] = {}
        u = UserSymbols(start_time=alive.get, now_ns=lambda: 10, maps=lambda pid, read=read: list(read))
        u.exec_at, u.sent = execs.get, sent.get
        u.sent_covers = lambda pid, addr, sent=sent: any(  # type: ignore[misc]
            m.start <= addr < m.end for m in sent.get(pid, (0, []))[1])
        u.see(4242)
        del alive[4242]
        assert u.resolve_stack(4242, [getpid + 1])[0].name == MARK_TRUNCATED  # nothing sent yet
        sent[4242] = (5, [exe, libc])
        assert u.resolve_stack(4242, [0x10])[0].name == MARK_TRUNCATED  # in neither
        frames = u.resolve_stack(4242, [getpid + 1])
        assert frames[0].name in ("getpid", "__getpid") and u.execs_since_read == 0, (read, frames)
        assert u.file_mappings(4242, getpid) == [exe, libc]
