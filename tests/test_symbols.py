"""Unit tests of symbol resolution: kallsyms, tracer frames, per-process caches,
caller frames at return address - 1, untrusted frames, time budgets, demangling.

Hostile inputs (malformed ELF files, FIFOs, huge perf maps) are in
test_hostile_files.py.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import os
import random
import re
import shutil
import subprocess
import time
import tracemalloc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from offtop.demangle import demangle
from offtop.elf import TIME_BUDGET, ElfCache, load_elf
from offtop.model import MARK_PROCESS_GONE, MARK_TRUNCATED, Frame
from offtop.packed_strings import PackedStrings
from offtop.symbols import (
    NO_SYMBOL,
    REREAD_S,
    UNTRUSTED,
    KernelSymbols,
    Mapping,
    UserSymbols,
    read_maps,
    strip_tracer_frames,
)
from offtop.targets import task_start_time
from tests.conftest import process_ended, wait_until

LIBC = ctypes.CDLL("libc.so.6")


def _addr(fn: object) -> int:
    a = ctypes.cast(fn, ctypes.c_void_p).value
    assert a
    return a


def _kallsyms(tmp_path: Path, *lines: str) -> KernelSymbols:
    """KernelSymbols over a kallsyms file of `lines`."""
    ks = tmp_path / "kallsyms"
    ks.write_text("".join(line + "\n" for line in lines))
    return KernelSymbols(str(ks))


def test_kallsyms_bisects_and_strips_tracer_frames(tmp_path: Path) -> None:
    k = _kallsyms(
        tmp_path,
        "ffffffff81000100 T bpf_prog_abc_tp",
        "ffffffff81000000 T schedule",
        "ffffffff81000200 t do_nanosleep",
        "ffffffff81000300 d some_data",
    )
    assert k.resolve(0xFFFFFFFF81000010).name == "schedule"
    assert k.resolve(0xFFFFFFFF81000310).name == "do_nanosleep"  # data symbols are skipped
    frames = k.resolve_stack([0xFFFFFFFF81000110, 0xFFFFFFFF81000010, 0xFFFFFFFF81000210])
    assert [f.name for f in frames] == ["schedule", "do_nanosleep"]
    assert all(f.kernel for f in frames)


def test_kallsyms_module_symbols_addresses_below_all_and_a_bounded_cache(tmp_path: Path,
                                                                        monkeypatch: Any) -> None:
    k = _kallsyms(
        tmp_path,
        "ffffffffc0000000 t nvme_irq\t[nvme]",
        "ffffffff81000000 T schedule",
        "ffffffff81000000 W schedule_alias",
        "ffffffff81000200 t do_nanosleep",
    )
    assert k.resolve(0xFFFFFFFFC0000010).name == "nvme_irq"  # the module's name cut off
    assert k.resolve(0xFFFFFFFF81000000).name == "schedule_alias"  # the last at that address
    assert k.resolve(0xFFFFFFFF80000000).name == "0xffffffff80000000"  # below every symbol
    assert k.resolve(1 << 70).name == f"0x{1 << 70:x}"  # wider than kallsyms' addresses
    monkeypatch.setattr(KernelSymbols, "MAX_CACHED", 2)
    k = KernelSymbols(str(tmp_path / "kallsyms"))
    first = k.resolve(0xFFFFFFFF81000010)
    k.resolve(0xFFFFFFFF81000210)
    k.resolve(0xFFFFFFFF81000220)  # the cache was full: emptied first
    again = k.resolve(0xFFFFFFFF81000010)  # made again
    assert again == first and again is not first
    assert k.resolve(0xFFFFFFFF81000010) is again


def test_kallsyms_addresses_in_one_function_share_its_frame(tmp_path: Path) -> None:
    k = _kallsyms(
        tmp_path,
        "ffffffff81000000 T schedule",
        "ffffffff81000200 t do_nanosleep",
    )
    a, b = k.resolve(0xFFFFFFFF81000010), k.resolve(0xFFFFFFFF810001F0)
    assert a.name == "schedule" and a is b  # one frame per function, not per address
    assert k.resolve(0xFFFFFFFF81000210) is not a


def test_kallsyms_lines_without_a_hexadecimal_address_are_left_out(tmp_path: Path) -> None:
    k = _kallsyms(
        tmp_path,
        "ffffffff81000000 T schedule",
        "ffffffff8100zz00 T not_hex",
        "ffffffff 1000300 T spaced",
        "ffffffff81000400 t do_nanosleep",
    )
    assert k.resolve(0xFFFFFFFF81000310).name == "schedule"
    assert k.resolve(0xFFFFFFFF81000410).name == "do_nanosleep"


def test_kallsyms_of_a_32_bit_kernel(tmp_path: Path) -> None:
    k = _kallsyms(
        tmp_path,
        "c1000000 T schedule",
        "c1000200 t do_nanosleep",
    )
    assert k.resolve(0xC1000010).name == "schedule"
    assert k.resolve(0xC1000210).name == "do_nanosleep"
    assert k.resolve(1 << 40).name == f"0x{1 << 40:x}"  # wider than its addresses


def test_tracer_frames_only_stripped_from_the_innermost_end() -> None:
    fs = [Frame("perf_trace_sched_switch"), Frame("__schedule"), Frame("bpf_prog_x")]
    assert [f.name for f in strip_tracer_frames(fs)] == ["__schedule", "bpf_prog_x"]


def test_user_symbols_resolve_this_process_and_cut_at_an_untrusted_frame() -> None:
    getpid = _addr(LIBC.getpid)
    u = UserSymbols()
    frames = u.resolve_stack(os.getpid(), [getpid + 1, getpid + 2])
    assert [f.name for f in frames] == ["getpid", "getpid"] or frames[0].name == "__getpid"
    assert frames[0].module == "libc.so.6" and not frames[0].unknown

    # 0x10 is in no mapping: a junk address (a frame-pointer walk through
    # code without frame pointers) is not shown; the stack ends there, marked.
    frames = u.resolve_stack(os.getpid(), [getpid + 1, 0x10, getpid + 1])
    assert [f.name for f in frames] == [frames[0].name, MARK_TRUNCATED]
    assert frames[-1].unknown
    assert u.errors == {UNTRUSTED: 1}
    assert u.misses == 1


def test_unresolved_frames_inside_a_mapping_read_module_plus_offset(tmp_path: Path) -> None:
    # A mapping of a file with no symbol at the address: trusted, named by
    # module and file offset, without brackets, and known as unresolved.
    getpid = _addr(LIBC.getpid)
    (m,) = [m for m in read_maps(os.getpid()) if m.start <= getpid < m.end]
    libc = load_elf(m.handle)
    # An address in libc's executable mapping between two symbols, if any,
    # else the first byte of the mapping (the ELF header's page).
    u = UserSymbols()
    frames = u.resolve_stack(os.getpid(), [m.start])
    if libc.lookup(libc.vaddr_of(m.offset) or 0) is None:
        assert frames[0].name == f"libc.so.6+0x{m.offset:x}"
        assert frames[0].module == "libc.so.6" and frames[0].unknown
        assert u.errors == {NO_SYMBOL: 1}
    assert Frame("libc.so.6+0x1a2b", "libc.so.6").unknown
    assert Frame("libc.so.6+0x1a2b").unknown  # read back from JSON without its module
    assert not Frame("operator+", "libstdc++.so.6").unknown


def test_a_process_gone_before_first_sight_gives_a_marked_empty_stack() -> None:
    u = UserSymbols(start_time=lambda pid: None)
    assert [f.name for f in u.resolve_stack(4242, [0x401000, 0x401100])] == [MARK_PROCESS_GONE]
    assert u.resolve_stack(4242, []) == ()


@contextlib.contextmanager
def a_sleep_seen_alive() -> Iterator[tuple[subprocess.Popen[bytes], Mapping, int, UserSymbols]]:
    """Debian's `sleep 5`, once it has exec'd and mapped libc: the process, its libc
    mapping, its start time, and a symbolizer that has read its map (its first
    sight). Killed and reaped on the way out, if it was not already."""
    ours = _libc_of_mine()
    child = subprocess.Popen(["/usr/bin/sleep", "5"])
    try:
        theirs: list[Mapping] = []
        for _ in range(100):  # until it has exec'd and mapped libc
            theirs = [m for m in read_maps(child.pid)
                      if m.path == ours.path and m.offset == ours.offset]
            if theirs:
                break
            time.sleep(0.02)
        start = task_start_time(child.pid)
        assert theirs and start
        u = UserSymbols()
        u.see(child.pid)
        yield child, theirs[0], start, u
    finally:
        child.kill()
        child.wait()


def _libc_of_mine() -> Mapping:
    getpid = _addr(LIBC.getpid)
    (ours,) = [m for m in read_maps(os.getpid()) if m.start <= getpid < m.end]
    return ours


def _getpid_in(libc: Mapping) -> int:
    """Where getpid is in another process's mapping of the same libc."""
    return _addr(LIBC.getpid) - _libc_of_mine().start + libc.start


def test_a_process_seen_alive_then_gone_is_named_from_its_files_paths() -> None:
    """A process whose maps were read while it lived (an exec'd `sleep` seen within
    milliseconds) and whose stack is read after it ended, under the start time it had:
    its map_files links are gone with it, so its files are found by path, as for one
    known gone (it was `libc.so.6+0x…` once its map_files could not be read)."""
    with a_sleep_seen_alive() as (child, libc, start, u):
        pass
    frames = u.resolve_stack(child.pid, [_getpid_in(libc)], start=start)
    assert frames[0].name in ("getpid", "__getpid") and frames[0].module == "libc.so.6", frames


def test_a_process_seen_alive_that_ended_unreaped_is_named_from_its_files_paths() -> None:
    """The same for a zombie (ended, its parent has not waited yet: a busy shell): its
    start time still reads as it was, but its map_files went with its memory. It was
    `libc.so.6+0x…`, kept so, beside two CPU hogs (the shell slow to reap)."""
    with a_sleep_seen_alive() as (child, libc, start, u):
        child.kill()
        assert wait_until(lambda: process_ended(child.pid))
        assert task_start_time(child.pid) == start  # a zombie: not reaped
        frames = u.resolve_stack(child.pid, [_getpid_in(libc)], start=start)
    assert frames[0].name in ("getpid", "__getpid") and frames[0].module == "libc.so.6", frames


def test_a_process_gone_is_named_in_the_file_it_mapped_not_in_what_its_path_holds_since(
        tmp_path: Path) -> None:
    """A `sleep` whose libc (a copy, by LD_LIBRARY_PATH) is replaced at its path while
    it runs, as a package upgrade does, then ends; its stacks are read after (a
    service restarted by the upgrade: its last rows). Its frames are named in the libc
    it mapped, read through its map_files while it lived, not in the file now at the
    path (here `true`: its few symbols named libc's addresses wrongly, or not at all)."""
    ours = _libc_of_mine()
    lib = tmp_path / "libc.so.6"
    shutil.copy(ours.path, lib)
    env = {**os.environ, "LD_LIBRARY_PATH": str(tmp_path)}
    child = subprocess.Popen(["/usr/bin/sleep", "5"], env=env)
    try:
        def copy_mapped() -> list[Mapping]:
            return [m for m in read_maps(child.pid) if m.path == str(lib) and m.offset == ours.offset]

        assert wait_until(lambda: bool(copy_mapped())), read_maps(child.pid)
        libc = copy_mapped()[0]
        start = task_start_time(child.pid)
        now = [0.0]
        u = UserSymbols(clock=lambda: now[0])
        u.see(child.pid)
        frames = u.resolve_stack(child.pid, [_getpid_in(libc)], start=start)
        assert frames[0].name in ("getpid", "__getpid"), frames
        shutil.copy("/usr/bin/true", tmp_path / "new")
        os.replace(tmp_path / "new", lib)  # an upgrade: a new file, renamed over the old
    finally:
        child.kill()
        child.wait()
    now[0] = 5.0  # what was found for the mapping is not taken as is any more
    read = _addr(LIBC.read) - ours.start + libc.start + 1
    frames = u.resolve_stack(child.pid, [read], start=start)
    assert frames[0].name in ("read", "__read", "__libc_read") and frames[0].module == "libc.so.6", frames
    write = _addr(LIBC.write) - ours.start + libc.start + 1  # known gone by now
    assert u.resolve_stack(child.pid, [write], start=start)[0].name in ("write", "__write", "__libc_write")


def test_a_process_reaped_between_two_reads_of_its_state_is_taken_as_gone(tmp_path: Path) -> None:
    """Its map_files failed (its memory gone: it is ending), then, asked whether it ended,
    it is reaped between the reads (a shell waits for its `sleep` at once). The reads
    in that order cannot take it for alive: it was `libc.so.6+0x…`, cut there, 1 in
    ~80 runs of the exec'd-sleep end-to-end test beside two CPU hogs; found gone, it
    is named from its files' paths."""
    ours = _libc_of_mine()
    getpid = _addr(LIBC.getpid)
    stat = tmp_path / "4242" / "task" / "4242" / "stat"
    stat.parent.mkdir(parents=True)
    # Exiting: a zombie, not reaped yet (fields from the state on; start time 77).
    stat.write_text("4242 (sleep) Z " + " ".join(["0"] * 18) + " 77 0\n")
    gone_files = Mapping(ours.start, ours.end, ours.offset, ours.path, str(tmp_path / "map_files-gone"))
    reaped = []

    def start_time(pid: int) -> int | None:
        if stat.exists():
            stat.unlink()  # reaped just after this read
            reaped.append(pid)
            return 77
        return None

    u = UserSymbols(start_time=start_time, maps=lambda pid: [gone_files], proc=str(tmp_path))
    u.see(4242)
    assert reaped == [4242]  # the first read, alive
    stat.parent.mkdir(parents=True, exist_ok=True)
    stat.write_text("4242 (sleep) Z " + " ".join(["0"] * 18) + " 77 0\n")
    frames = u.resolve_stack(4242, [getpid + 1], start=77)
    assert frames[0].name in ("getpid", "__getpid") and frames[0].module == "libc.so.6", frames


def test_a_process_gone_before_first_sight_resolves_in_its_stand_in() -> None:
    # A process forked from this one (offtop.bpf.lineage), gone before its
    # first sight: its addresses are this one's, named in this one's map.
    getpid = _addr(LIBC.getpid)
    me = os.getpid()
    u = UserSymbols(start_time=lambda pid: None if pid == 4242 else task_start_time(pid))
    mine = task_start_time(me)
    assert mine
    u.stand_in = lambda pid: (me, mine) if pid == 4242 else None
    frames = u.resolve_stack(4242, [getpid + 1, 0x10])
    assert frames[0].name in ("getpid", "__getpid") and frames[0].module == "libc.so.6"
    assert frames[1].name == MARK_TRUNCATED  # outside the map it is resolved in: cut
    assert u.stood_in == 1
    (libc,) = [m for m in u.file_mappings(4242, getpid) if m.start <= getpid < m.end]
    assert f"/proc/{me}/" in libc.handle
    assert u.stand_in_for(4242) == (me, mine) and u.stand_in_for(me) is None  # its own map is known
    # No stand-in known (or none alive): marked, as before.
    assert [f.name for f in u.resolve_stack(4343, [getpid + 1])] == [MARK_PROCESS_GONE]
    # An answer holds for a second (REREAD_S): asked again and again while a
    # gone process's stacks are resolved and unwound.
    asked: list[int] = []
    u = UserSymbols(start_time=lambda pid: None if pid in (4242, 4343) else task_start_time(pid))
    u.stand_in = lambda pid: asked.append(pid) or None  # type: ignore[func-returns-value]
    assert [f.name for f in u.resolve_stack(4242, [getpid + 1])] == [MARK_PROCESS_GONE]
    assert u.file_mappings(4242, getpid) == []
    assert asked == [4242] and u.stood_in == 0


def test_read_maps_keeps_executable_mappings_and_decodes_paths(tmp_path: Path) -> None:
    (tmp_path / "77").mkdir()
    (tmp_path / "77" / "maps").write_bytes(
        b"55d0a000-55d0b000 r--p 00000000 fe:00 12 /usr/bin/app\n"
        b"55d0b000-55d0c000 r-xp 00001000 fe:00 12 /usr/bin/app\n"
        b"7f00000-7f01000 r-xp 00000000 00:00 0 [vdso]\n"
        b"7f10000-7f11000 r-xp 00002000 fe:00 13 /tmp/gone (deleted)\n"
        b"7f20000-7f21000 r-xp 00003000 fe:00 14 /tmp/caf\xe9\x1b[2J.so\n"
        b"7f30000-7f31000 rwxp 00000000 00:00 0 \n"
    )
    maps = read_maps(77, proc=str(tmp_path))
    assert [(m.start, m.offset, m.module) for m in maps] == [
        (0x7F00000, 0, "vdso"), (0x7F10000, 0x2000, "gone"),
        (0x7F20000, 0x3000, "caf\ufffd\x1b[2J.so"), (0x7F30000, 0, "anon"),
        (0x55D0B000, 0x1000, "app")]
    assert maps[-1].handle == f"{tmp_path}/77/map_files/55d0b000-55d0c000"
    assert maps[0].handle == "" and maps[3].handle == ""  # memory, not files


# --- caller frames at return address - 1 ----------------------------------------------

NORETURN_C = r"""
#include <stdio.h>
#include <unistd.h>

volatile int sink;

/* Never returns: a call to it can be the last instruction of its caller. */
__attribute__((noreturn, noinline)) void die(int code)
{
    sink = code;
    for (;;)
        pause();
}

/* Ends in `call die`: its return address is the first byte of after_caller. */
__attribute__((noinline)) void caller(int x)
{
    sink = x * 3;
    die(x);
}

__attribute__((noinline)) void after_caller(void)
{
    puts("after");
}

int main(int argc, char **argv)
{
    (void)argv;
    if (argc > 5)
        after_caller();
    printf("ready pid=%d\n", getpid());
    fflush(stdout);
    caller(argc);
}
"""


@pytest.fixture(scope="module")
def noreturn_bin(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """NORETURN_C at -O2, not PIE (addresses are the ELF's), functions packed in source order."""
    cc = shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        pytest.fail("no C compiler: run the README's test command (it installs gcc)")
    d = tmp_path_factory.mktemp("noreturn")
    (d / "noreturn.c").write_text(NORETURN_C)
    subprocess.run([cc, "-O2", "-no-pie", "-falign-functions=1", "-fno-reorder-functions",
                    "-o", str(d / "noreturn"), str(d / "noreturn.c")], check=True)
    return d / "noreturn"


@pytest.fixture
def noreturn_proc(noreturn_bin: Path) -> Iterator[int]:
    """The program, blocked in die() called from caller(); yields its pid."""
    p = subprocess.Popen([str(noreturn_bin)], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout is not None
        m = re.match(r"ready pid=(\d+)", p.stdout.readline())
        assert m
        yield p.pid
    finally:
        p.kill()
        p.wait()


def _symbols(binary: Path) -> dict[str, tuple[int, int]]:
    """name -> (address, size), from binutils' nm (not from offtop's own reader)."""
    out = subprocess.run(["nm", "-S", str(binary)], capture_output=True, text=True, check=True).stdout
    syms = {}
    for line in out.splitlines():
        parts = line.split()
        if len(parts) == 4:
            syms[parts[3]] = (int(parts[0], 16), int(parts[1], 16))
    return syms


def test_caller_frames_are_looked_up_at_return_address_minus_one(noreturn_bin: Path,
                                                                  noreturn_proc: int) -> None:
    syms = _symbols(noreturn_bin)
    caller_start, caller_size = syms["caller"]
    ret_into_caller = caller_start + caller_size
    # The case this is about: caller ends in its call to die, so the return
    # address is where the next function begins.
    assert syms["after_caller"][0] == ret_into_caller, "the compiler laid the functions out otherwise"
    die_ip = syms["die"][0] + 4
    main_ret = syms["main"][0] + syms["main"][1] // 2

    u = UserSymbols()
    frames = u.resolve_stack(noreturn_proc, [die_ip, ret_into_caller, main_ret])
    assert [f.name for f in frames] == ["die", "caller", "main"]
    assert {f.module for f in frames} == {noreturn_bin.name}
    # The first address is where the thread is (not a return address): as it is.
    assert [f.name for f in u.resolve_stack(noreturn_proc, [ret_into_caller])] == ["after_caller"]


@pytest.mark.skipif(shutil.which("gdb") is None, reason="gdb (Debian's gdb) is not installed")
def test_caller_frames_match_gdbs_backtrace(noreturn_bin: Path, noreturn_proc: int) -> None:
    bt = subprocess.run(["gdb", "-p", str(noreturn_proc), "-batch", "-nx", "-ex", "bt"],
                        capture_output=True, text=True, timeout=60).stdout
    frames = re.findall(r"^#\d+\s+(0x[0-9a-f]+) in (\w+) ", bt, re.M)
    assert len(frames) >= 3, bt
    ours = UserSymbols().resolve_stack(noreturn_proc, [int(a, 16) for a, _ in frames])
    theirs = [name for _, name in frames]
    mine = [f for f, (_, name) in zip(ours, frames, strict=False) if name in ("die", "caller", "main")]
    assert [f.name for f in mine] == [n for n in theirs if n in ("die", "caller", "main")]
    assert [f.name for f in mine] == ["die", "caller", "main"]


# --- time budget ---------------------------------------------------------------------


def test_past_the_deadline_frames_are_deferred_uncached_then_resolve() -> None:
    getpid = _addr(LIBC.getpid)
    now = [100.0]
    u = UserSymbols(clock=lambda: now[0], elf_cache=ElfCache(clock=lambda: now[0]))
    frames = u.resolve_stack(os.getpid(), [getpid + 1], deadline=99.0)
    assert frames[0].module == "libc.so.6" and frames[0].unknown
    assert re.fullmatch(r"libc\.so\.6\+0x[0-9a-f]+", frames[0].name)
    assert u.errors == {TIME_BUDGET: 1}
    # Not cached: a later interval with time left resolves it.
    frames = u.resolve_stack(os.getpid(), [getpid + 1], deadline=101.0)
    assert not frames[0].unknown and "getpid" in frames[0].name
    assert u.errors == {TIME_BUDGET: 1}


def test_frames_past_the_deadline_do_not_ask_whether_their_process_lives(
        monkeypatch: Any) -> None:
    """A file out of time was found by its process's map_files link: the process
    lived. Asked anyway, a flood past its budget read /proc/PID/stat twice a frame
    (18% of a starved engine's read of the sums, in py-spy)."""
    import offtop.symbols as symbols

    asked: list[int] = []
    monkeypatch.setattr(symbols, "task_ending", lambda pid, proc: asked.append(pid) or False)
    getpid = _addr(LIBC.getpid)
    now = [100.0]
    u = UserSymbols(clock=lambda: now[0], elf_cache=ElfCache(clock=lambda: now[0]))
    frames = u.resolve_stack(os.getpid(), [getpid + 1 + i for i in range(50)], deadline=99.0)
    assert all(f.unknown and f.module == "libc.so.6" for f in frames)
    assert u.errors == {TIME_BUDGET: 50}
    assert asked == []


def test_a_big_file_loads_in_bounded_steps_across_calls() -> None:
    """Each get() does at most about one step past its deadline; the file still loads."""
    path = "/usr/lib/x86_64-linux-gnu/libc.so.6"
    ticks = [0.0]

    def clock() -> float:  # every look at the clock is a millisecond later
        ticks[0] += 0.001
        return ticks[0]

    cache = ElfCache(clock=clock)
    calls = 0
    result = cache.get(path, deadline=clock() + 0.0015)
    while result == TIME_BUDGET:
        calls += 1
        assert calls < 1000
        result = cache.get(path, deadline=clock() + 0.0015)
    assert calls >= 3  # it took several intervals
    assert not isinstance(result, str)
    whole = load_elf(path)
    assert len(result) == len(whole) > 1000
    getpid = _addr(LIBC.getpid)
    (m,) = [m for m in read_maps(os.getpid()) if m.start <= getpid < m.end]
    vaddr = whole.vaddr_of(getpid - m.start + m.offset)
    assert vaddr is not None and result.lookup(vaddr) == whole.lookup(vaddr)


def test_kernel_symbols_keep_their_names_compressed() -> None:
    data = Path("/proc/kallsyms").read_bytes()
    lines = data.count(b"\n")
    names = len(data) - lines * (data.find(b" ") + 3)  # each line's text after "ADDRESS T "
    gc.collect()
    tracemalloc.start()
    try:
        ksyms = KernelSymbols()
        held = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert ksyms.available and lines > 10_000
    # Two 8-byte numbers a symbol, and the names in well under half their bytes
    # (held as read: 4.8 MiB for 122,000 symbols; compressed: 2.0).
    assert held < 16 * lines + names / 2, (held, lines, names)


def test_packed_strings_give_every_string_of_the_table() -> None:
    rng = random.Random(5)
    names = [bytes(rng.choice(b"_ZN4llvm3abcdefgh") for _ in range(rng.choice((1, 40, 300, 5000))))
             for _ in range(400)]
    table = b"\0" + b"\0".join(names) + b"\0" + b"tail without its NUL" * 30
    packed = PackedStrings.packed(table)
    assert len(packed) == len(table) and packed.nbytes < len(table)  # random names: little to gain
    at = 1
    for name in [*names, table[at + sum(len(n) + 1 for n in names):]]:
        for limit in (2048, 64):  # names longer than the limit are cut to it
            want = name[:limit]
            assert packed.string_at(at, limit) == want, (at, limit)
        at += len(name) + 1
    assert packed.string_at(len(table), 2048) == b"" and packed.string_at(10**9, 2048) == b""
    for at, n in [(0, 10), (4090, 20), (4096, 8192), (len(table) - 5, 100), (10**9, 4)]:
        assert packed.read(at, n) == table[at:at + n], (at, n)  # across blocks too


def test_a_packed_symbol_table_names_every_function_as_the_held_one() -> None:
    path = "/lib/x86_64-linux-gnu/libc.so.6"
    held, packed = load_elf(path, pack_from=1 << 30), load_elf(path, pack_from=0)
    assert len(held) == len(packed) > 1000 and packed.nbytes < held.nbytes * 0.7
    addresses = [seg.vaddr + off for seg in held.segments for off in range(0, seg.filesz, 97)]
    names = [held.lookup(a) for a in addresses]
    assert sum(n is not None for n in names) > 1000
    assert [packed.lookup(a) for a in addresses] == names


# --- demangling ----------------------------------------------------------------------

#: Real v0 and legacy Rust symbols, from rustc 1.95's std and a small program (crate `m`)
#: built with -C symbol-mangling-version=v0 and legacy, and names from rustc-demangle's
#: own test suite; the expected names are c++filt's (binutils 2.40) without disambiguators.
RUST_NAMES = {
    "_RNvNtNtCsjrHSEGnQ3l9_3std6thread9functions5sleep": "std::thread::functions::sleep",
    "_RINvMNtCsgEmfK2I1SDS_4core3stre18trim_start_matchesReECsgY6Mt91CT9J_14rustc_demangle":
        "<str>::trim_start_matches::<&str>",
    "_RNvXCskK7mfDs1mzF_1mINtB2_3DoghENtB2_5Speak5speakB2_": "<m::Dog<u8> as m::Speak>::speak",
    "_RNvCskK7mfDs1mzF_1mu19sleeper_ncode_xjb7q": "m::sleeper_ünïcode",
    "_RINvNtCsgEmfK2I1SDS_4core3ptr13drop_in_placeINtNtCslNYArtu3iFV_5alloc5boxed3Box"
    "DNtCskK7mfDs1mzF_1m5SpeakEL_EEB1i_": "core::ptr::drop_in_place::<alloc::boxed::Box<dyn m::Speak>>",
    "_RINvMs6_NtCsgvbsrvnw3yD_9hashbrown3rawINtB6_8RawTableTNtNtCslNYArtu3iFV_5alloc6string6String"
    "TxReEEE14reserve_rehashNCINvNtB8_3map11make_hasherBQ_B1s_NtNtNtCsjrHSEGnQ3l9_3std4hash6random"
    "11RandomStateE0ECskK7mfDs1mzF_1m.llvm.7772612486167842130":
        "<hashbrown::raw::RawTable<(alloc::string::String, (i64, &str))>>::reserve_rehash::"
        "<hashbrown::map::make_hasher<alloc::string::String, (i64, &str), "
        "std::hash::random::RandomState>::{closure#0}>",
    "_RNCNCNgCs6DXkGYLi8lr_2cc5spawn00B5_": "cc::spawn::{closure#0}::{closure#0}",
    "_RNCINkXs25_NgCsbmNqQUJIY6D_4core5sliceINyB9_4IterhENuNgNoBb_4iter8iterator8Iterator"
    "9rpositionNCNgNpB9_6memchr7memrchrs_0E0Bb_":
        "<core::slice::Iter<u8> as core::iter::iterator::Iterator>::rposition::"
        "<core::slice::memchr::memrchr::{closure#1}>::{closure#0}",
    "_RINbNbCskIICzLVDPPb_5alloc5alloc8box_freeDINbNiB4_5boxed5FnBoxuEp6OutputuEL_ECs1iopQbuBiw2_3std":
        "alloc::alloc::box_free::<dyn alloc::boxed::FnBox<(), Output = ()>>",
    "_RMC0INtC8arrayvec8ArrayVechKj7b_E": "<arrayvec::ArrayVec<u8, 123>>",
    "_RIC0KVNtC3foo3BarS1sRe616263_2chc78_5sliceRAh1_h2_h3_EEE":
        "::<{foo::Bar { s: \"abc\", ch: 'x', slice: &[1, 2, 3] }}>",
    "_RNvC9backtrace3foo.llvm.A5310EB9": "backtrace::foo",
    "_ZN44_$LT$m..Dog$LT$T$GT$$u20$as$u20$m..Speak$GT$5speak17h76cdd42951cdc6b6E":
        "<m::Dog<T> as m::Speak>::speak",
    "_ZN3std2rt10lang_start28_$u7b$$u7b$closure$u7d$$u7d$17h168e94e611939a97E":
        "std::rt::lang_start::{{closure}}",
    "_ZN9hashbrown3raw21RawTable$LT$T$C$A$GT$14reserve_rehash17h48425dada2ec8bd9E.llvm.13492872851188584864":
        "hashbrown::raw::RawTable<T,A>::reserve_rehash",
    "_ZN4core5slice89_$LT$impl$u20$core..iter..traits..IntoIterator$u20$for$u20$$RF$$u27$a$u20$"
    "$u5b$T$u5d$$GT$9into_iter17h450e234d27262170E":
        "core::slice::<impl core::iter::traits::IntoIterator for &'a [T]>::into_iter",
    "_ZN1m23sleeper_$ufc$n$uef$code17hee2c1b02994196b9E": "m::sleeper_ünïcode",
}


@pytest.mark.parametrize("mangled", list(RUST_NAMES))
def test_rust_symbols_are_demangled(mangled: str) -> None:
    assert demangle(mangled) == RUST_NAMES[mangled]


def test_cxx_and_plain_names() -> None:
    assert demangle("_ZNSt6vectorIiSaIiEE9push_backERKi") == \
        "std::vector<int, std::allocator<int> >::push_back(int const&)"
    assert demangle("_ZN3foo3barEv") == "foo::bar()"  # a C++ nested name, not Rust legacy
    assert demangle("main") == "main"
    assert demangle("_RNvC3foo3barX") == "_RNvC3foo3barX"  # not valid v0: left as it is


def test_hostile_mangled_names_are_bounded() -> None:
    # Back-references that double the output at each level: 2^30 copies of `_`.
    bomb = "_RMC0" + "T" * 30 + "p" + "".join(f"B{_b62(i)}_E" for i in range(33, 3, -1))
    started = time.perf_counter()
    assert demangle(bomb) == bomb  # abandoned at the output cap: unchanged
    assert time.perf_counter() - started < 0.5
    deep = "_RIC0" + "R" * 1500 + "pE"
    assert demangle(deep) == deep  # nesting past the limit: unchanged, no RecursionError
    loop = "_RNvB0_3foo"  # a back-reference to itself
    assert demangle(loop) == loop
    assert demangle("_ZN7a$u1b$b17h0123456789abcdefE") == "a$u1b$b"  # no control char decoded


def _b62(n: int) -> str:
    digits = "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
    n -= 1
    out = ""
    while True:
        out = digits[n % 62] + out
        n //= 62
        if not n:
            return out


RUST_PROGRAM = r"""
trait Speak { fn speak(&self) -> usize; }
struct Dog<T> { v: Vec<T> }
impl<T: Clone> Speak for Dog<T> { #[inline(never)] fn speak(&self) -> usize { self.v.len() } }
#[inline(never)]
fn generic<F: Fn(u32) -> u32>(f: F, x: u32) -> u32 { f(x) }
fn main() {
    let b: Box<dyn Speak> = Box::new(Dog { v: vec![1u8, 2] });
    let c = std::env::args().count() as u32;
    println!("{} {}", b.speak(), generic(move |x| x + c, 4));
}
"""


@pytest.mark.skipif(shutil.which("rustc") is None, reason="rustc is not installed")
@pytest.mark.parametrize("mangling", ["v0", "legacy"])
def test_symbols_of_a_real_rust_program(tmp_path: Path, mangling: str) -> None:
    (tmp_path / "m.rs").write_text(RUST_PROGRAM)
    flags = ["-C", "symbol-mangling-version=v0"] if mangling == "v0" else []
    subprocess.run(["rustc", "-O", *flags, "-o", str(tmp_path / "m"), str(tmp_path / "m.rs")],
                   check=True, capture_output=True)
    elf = load_elf(str(tmp_path / "m"))
    names = {elf.lookup(a) for a in elf._starts}  # every function of the program, demangled
    if mangling == "v0":
        expected = {"<m::Dog<u8> as m::Speak>::speak", "m::generic::<m::main::{closure#0}>", "m::main"}
    else:  # legacy names carry no generic arguments
        expected = {"<m::Dog<T> as m::Speak>::speak", "m::generic", "m::main"}
    assert expected <= names
    assert not any(n and (n.startswith("_R") or re.search(r"17h[0-9a-f]{16}E$", n)) for n in names)


def test_user_symbols_count_misses_by_cause_with_injected_maps(tmp_path: Path) -> None:
    # A mapping whose file cannot be opened: trusted, module+offset, counted.
    maps = [Mapping(0x1000, 0x2000, 0x3000, "/nonexistent/lib.so", str(tmp_path / "missing"))]
    u = UserSymbols(start_time=lambda pid: 1, maps=lambda pid: maps)
    frames = u.resolve_stack(5, [0x1010, 0x1800])
    assert [f.name for f in frames] == ["lib.so+0x3010", "lib.so+0x3800"]
    assert u.errors == {"unreadable": 2}


def test_a_library_mapped_later_is_found_once_maps_are_read_again(tmp_path: Path) -> None:
    """dlopen after first sight: the address is untrusted until the maps are read again,
    which happens on a miss at most once a second (a junk address must not cost a
    read of the whole map each time)."""
    now = [0.0]
    maps = [Mapping(0x1000, 0x2000, 0, "/lib/a.so", str(tmp_path / "a"))]
    reads = [0]

    def read(pid: int) -> list[Mapping]:
        reads[0] += 1
        return list(maps)

    u = UserSymbols(start_time=lambda pid: 1, maps=read, clock=lambda: now[0])
    assert [f.name for f in u.resolve_stack(3, [0x5010])] == [MARK_TRUNCATED]
    maps.append(Mapping(0x5000, 0x6000, 0x2000, "/lib/b.so", str(tmp_path / "b")))
    now[0] = 0.5
    assert [f.name for f in u.resolve_stack(3, [0x5010])] == [MARK_TRUNCATED]  # not yet
    assert reads[0] == 1
    now[0] = 1.5
    assert [f.name for f in u.resolve_stack(3, [0x5010])] == ["b.so+0x2010"]
    assert reads[0] == 2
    assert u.errors == {UNTRUSTED: 2, "unreadable": 1}


def test_a_map_read_again_after_its_process_ended_keeps_the_one_read_while_it_lived() -> None:
    """A `sleep 0.01` read alive, its stacks read a second later under the start time
    it had (a row's, at the interval's end), a junk address first: the read again
    finds it gone (an empty map) or the pid another process's. The map read while it
    lived stands. Before, the empty one replaced it: every later stack of it was cut
    at its first frame (an exec'd `sleep`'s nanosleep, 1 in ~900 blocks beside two
    CPU hogs)."""
    libc = _libc_of_mine()
    getpid = _addr(LIBC.getpid)
    other = Mapping(0x1000, 0x2000, 0, "/usr/bin/true", "/nonexistent/true")
    for after, start_after in (([], 77), ([other], 78), ([], None)):
        now = [0.0]
        maps = {4242: [libc]}
        starts = {4242: 77}
        u = UserSymbols(start_time=starts.get, maps=lambda pid, maps=maps: list(maps.get(pid, [])),
                        clock=lambda now=now: now[0])
        u.see(4242)
        maps[4242] = after
        if start_after is None:
            del starts[4242]
        else:
            starts[4242] = start_after
        now[0] = 1.5
        assert u.resolve_stack(4242, [0x10], start=77)[0].name == MARK_TRUNCATED  # junk
        frames = u.resolve_stack(4242, [getpid + 1], start=77)
        assert frames[0].name in ("getpid", "__getpid"), (after, start_after, frames)
        assert u.file_mappings(4242, getpid, 77) == [libc]


def test_file_mappings_are_the_symbols_own_read_and_the_same_list_until_read_again(
        tmp_path: Path) -> None:
    """The repair's unwinding asks for a process's file mappings: one read of
    /proc/PID/maps serves it and the symbols, and the list stays the same object
    (its table lookups are kept by it) until an address outside it reads again."""
    now = [0.0]
    maps = [Mapping(0x1000, 0x2000, 0, "/lib/a.so", str(tmp_path / "a")),
            Mapping(0x3000, 0x4000, 0, "[vdso]", "")]
    reads = [0]

    def read(pid: int) -> list[Mapping]:
        reads[0] += 1
        return list(maps)

    u = UserSymbols(start_time=lambda pid: 1, maps=read, clock=lambda: now[0])
    files = u.file_mappings(3, 0x1010)
    assert [m.path for m in files] == ["/lib/a.so"]  # files only: anonymous memory has no table
    u.resolve_stack(3, [0x1010, 0x1020])
    assert u.file_mappings(3, 0x1800) is files and reads[0] == 1
    maps.append(Mapping(0x5000, 0x6000, 0, "/lib/b.so", str(tmp_path / "b")))
    assert u.file_mappings(3, 0x5010) is files  # outside, within a second: not read yet
    now[0] = 1.5
    again = u.file_mappings(3, 0x5010)
    assert reads[0] == 2 and again is not files
    assert [m.path for m in again] == ["/lib/a.so", "/lib/b.so"]
    assert UserSymbols(start_time=lambda pid: None, maps=read).file_mappings(4, 0x1010) == []


def test_evict_asks_the_sweeps_reader_of_start_times_when_given_one(tmp_path: Path) -> None:
    maps = [Mapping(0x1000, 0x2000, 0, "/lib/a.so", str(tmp_path / "a"))]

    def own(pid: int) -> int | None:
        return 1

    u = UserSymbols(start_time=own, maps=lambda pid: maps, grace_s=0.0)
    u.resolve_stack(3, [0x1010])
    assert u.cached_processes == 1
    assert u.evict(start_time=lambda pid: None) == 1  # gone, says the sweep's reader
    assert u.cached_processes == 0


def test_cached_frames_stay_bounded_whatever_a_process_does(tmp_path: Path) -> None:
    maps = [Mapping(0x100000, 0x10000000, 0, "/lib/big.so", str(tmp_path / "missing"))]
    u = UserSymbols(start_time=lambda pid: 1, maps=lambda pid: maps, max_frames=1000)
    for i in range(5000):  # a stack of new addresses every time
        u.resolve_stack(1, [0x100000 + 16 * i, 0x200000 + 16 * i])
    assert 0 < u.cached_frames <= 1000


def test_equal_frames_of_processes_of_one_program_are_one_object(tmp_path: Path) -> None:
    """Each process of a program resolves its frames afresh (other addresses); stacks
    kept past the process hold them, so equal frames are shared, within a bound."""
    maps = {pid: [Mapping(base, base + 0x1000, 0x3000, "/usr/bin/app", str(tmp_path / "x"))]
            for pid, base in ((1, 0x10000), (2, 0x50000))}
    u = UserSymbols(start_time=lambda pid: 1, maps=maps.__getitem__, max_shared=2)
    one = u.resolve_stack(1, [0x10010, 0x10801])
    two = u.resolve_stack(2, [0x50010, 0x50801])
    assert [f.name for f in one] == ["app+0x3010", "app+0x3801"] == [f.name for f in two]
    assert all(a is b for a, b in zip(one, two, strict=True))
    # Past the bound, sharing starts over: equal frames, maybe not the same objects.
    three = u.resolve_stack(1, [0x10020, 0x10030, 0x10040])
    assert [f.name for f in three] == ["app+0x3020", "app+0x3030", "app+0x3040"]
    assert u.resolve_stack(2, [0x50010]) == one[:1]


class CountingElfCache(ElfCache):
    """A real ElfCache that counts the lookups it is asked (a stat of the file each)."""

    def __init__(self) -> None:
        super().__init__()
        self.asked = 0

    def get(self, path: str, *, deadline: float | None = None,
            expect: tuple[int, int] | None = None) -> Any:
        self.asked += 1
        return super().get(path, deadline=deadline)


def test_a_mappings_symbols_are_looked_up_once_a_reread_period() -> None:
    # Every new address used to stat the mapping's map_files link to find its
    # file in the cache; the table found is kept per mapping for REREAD_S.
    now = [100.0]
    cache = CountingElfCache()
    u = UserSymbols(elf_cache=cache, clock=lambda: now[0])
    getpid, getppid = _addr(LIBC.getpid), _addr(LIBC.getppid)
    assert u.resolve_stack(os.getpid(), [getpid + 1])[0].name in ("getpid", "__getpid")
    assert u.resolve_stack(os.getpid(), [getppid + 1])[0].name in ("getppid", "__getppid")
    assert cache.asked == 1
    now[0] += REREAD_S
    u.resolve_stack(os.getpid(), [getppid + 2])
    assert cache.asked == 2
