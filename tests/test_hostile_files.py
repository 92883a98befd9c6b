"""Hostile files a user can put in offtop's way, and how symbolization survives them.

offtop runs as root and opens what other users control: the binaries their
processes map (through /proc/PID/map_files), their perf maps in /tmp, their
/proc/PID/maps. Each case here is a real file in a temporary directory and,
where the path through offtop needs one, a real process that maps it. Each
asserts that nothing raises, that the call returns in bounded time and
memory (peak RSS, reset before each case), and what offtop shows instead:
`module+0xOFFSET` frames and a symbolization error counted by cause.
"""

from __future__ import annotations

import contextlib
import os
import random
import re
import stat
import struct
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest

from offtop.demangle import demangle
from offtop.elf import BAD_ELF, PACK_FROM, TIME_BUDGET, ElfCache, load_elf, load_steps
from offtop.safe_files import NOT_REGULAR, UNREADABLE, WRONG_OWNER, FileRefused, open_regular
from offtop.symbols import (
    NO_SYMBOL,
    PERF_MAP_LONG_LINE,
    PERF_MAP_PREFIX,
    PERF_MAP_TRUNCATED,
    Mapping,
    PerfMap,
    UserSymbols,
)
from offtop.targets import task_start_time

T = TypeVar("T")

#: Generous bounds: the failures these tests catch took minutes, forever, or gigabytes.
SECONDS = 2.0
RSS_MB = 64

# A process that maps an anonymous executable page (a JIT's code) and each file
# named on its command line (read + exec, 8 KiB from offset 0), prints the
# addresses, and waits. System python: the child may run as another user.
MAPPER = r"""
import ctypes, os, sys, time
libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                      ctypes.c_int, ctypes.c_long]
PROT_R, PROT_W, PROT_X, MAP_PRIVATE, MAP_ANON = 1, 2, 4, 2, 0x20
addrs = [libc.mmap(None, 4096, PROT_R | PROT_W | PROT_X, MAP_PRIVATE | MAP_ANON, -1, 0)]
for path in sys.argv[1:]:
    fd = os.open(path, os.O_RDONLY)
    addrs.append(libc.mmap(None, 8192, PROT_R | PROT_X, MAP_PRIVATE, fd, 0))
    os.close(fd)
print("ready", *[hex(a) for a in addrs], flush=True)
time.sleep(600)
"""


# --- measuring --------------------------------------------------------------------


def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(field)


@contextlib.contextmanager
def bounded(seconds: float = SECONDS, rss_mb: int = RSS_MB) -> Iterator[None]:
    """Assert that the block takes less than `seconds` and raises peak RSS by less than `rss_mb`."""
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM (peak RSS) to the current RSS
    before = _status_kb("VmRSS")
    started = time.monotonic()
    yield
    elapsed = time.monotonic() - started
    grew_mb = (_status_kb("VmHWM") - before) / 1024
    assert elapsed < seconds, f"took {elapsed:.2f}s"
    assert grew_mb < rss_mb, f"peak RSS grew by {grew_mb:.0f} MB"


def returns(fn: Callable[[], T], timeout: float = 10.0) -> T:
    """fn(), run in a thread so that a call that blocks for good fails the test, not the run."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as e:  # reported below, in the test's thread
            box["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), f"blocked for more than {timeout}s"
    if "error" in box:
        raise box["error"]
    return box["value"]  # type: ignore[no-any-return]


# --- hostile ELF files -------------------------------------------------------------

EHDR = struct.Struct("<16sHHIQQQIHHHHHH")
PHDR = struct.Struct("<IIQQQQQQ")
SHDR = struct.Struct("<IIQQQQIIQQ")
SYM = struct.Struct("<IBBHQQ")
BASE = 0x400000
TEXT_OFF = 0x1000
FUNC = "hostile_fn"


def elf_bytes(*, sym_name: bytes = FUNC.encode(), symtab_off: int = 0x1800, symtab_size: int | None = None,
              entsize: int = 24, strtab_off: int = 0x1900, strtab_size: int | None = None,
              link: int = 3, shoff: int = 0x1A00, shnum: int = 4, phoff: int = 64, phnum: int = 1,
              size: int = 8192) -> bytes:
    """A small ELF64 with one function (FUNC at BASE + TEXT_OFF), any field made hostile."""
    strtab = b"\0" + sym_name + b"\0"
    symtab = SYM.pack(0, 0, 0, 0, 0, 0) + SYM.pack(1, 0x12, 0, 1, BASE + TEXT_OFF, 0x100)  # GLOBAL FUNC
    sections = [
        SHDR.pack(0, 0, 0, 0, 0, 0, 0, 0, 0, 0),
        SHDR.pack(0, 1, 6, BASE + TEXT_OFF, TEXT_OFF, 0x100, 0, 0, 16, 0),  # .text
        SHDR.pack(0, 2, 0, 0, symtab_off, len(symtab) if symtab_size is None else symtab_size,
                  link, 1, 8, entsize),  # .symtab
        SHDR.pack(0, 3, 0, 0, strtab_off, len(strtab) if strtab_size is None else strtab_size,
                  0, 0, 1, 0),  # .strtab
    ]
    ident = b"\x7fELF" + bytes([2, 1, 1]) + bytes(9)
    out = bytearray(max(size, 0x1A00 + 4 * SHDR.size))
    out[0:64] = EHDR.pack(ident, 3, 62, 1, BASE + TEXT_OFF, phoff, shoff, 0, 64, 56, phnum, 64, shnum, 0)
    out[64:64 + 56] = PHDR.pack(1, 5, 0, BASE, BASE, 8192, 8192, 0x1000)  # PT_LOAD R+X
    out[TEXT_OFF:TEXT_OFF + 4] = b"\xf3\x0f\x1e\xfa"
    out[0x1800:0x1800 + len(symtab)] = symtab
    out[0x1900:0x1900 + len(strtab)] = strtab
    out[0x1A00:0x1A00 + 4 * SHDR.size] = b"".join(sections)
    return bytes(out[:size])


@pytest.fixture
def mapper() -> Iterator[Callable[..., tuple[int, list[int]]]]:
    """Start a process mapping the given files: returns (pid, [anon page, file maps...])."""
    procs: list[subprocess.Popen[str]] = []

    def start(*paths: Path, user: int | None = None) -> tuple[int, list[int]]:
        p = subprocess.Popen(["/usr/bin/python3", "-c", MAPPER, *map(str, paths)],
                             stdout=subprocess.PIPE, text=True, user=user)
        procs.append(p)
        assert p.stdout is not None
        line = p.stdout.readline()
        assert line.startswith("ready "), line
        return p.pid, [int(a, 16) for a in line.split()[1:]]

    yield start
    for p in procs:
        p.kill()
        p.wait()


HOSTILE_ELVES: dict[str, dict[str, Any]] = {
    "symtab size not a multiple of its entry size": {"symtab_size": 1000},
    "symtab entry size 0": {"entsize": 0},
    "symtab entry size 7": {"entsize": 7},
    "symtab claims 1 GB in 8 KB": {"symtab_size": 1 << 30},
    "symtab claims 2^64 - 1 bytes": {"symtab_size": (1 << 64) - 1},
    "strtab claims 1 GB in 8 KB": {"strtab_size": 1 << 30},
    "symtab offset past the end": {"symtab_off": 1 << 40},
    "strtab offset past the end": {"strtab_off": 1 << 62},
    "section header table past the end": {"shoff": 1 << 40},
    "65,000 section headers": {"shnum": 65000},
    "program header table past the end": {"phoff": 1 << 40},
    "65,535 program headers": {"phnum": 65535},
    "symtab linked to itself": {"link": 2},
    "symtab linked past the table": {"link": 999},
    "truncated header": {"size": 40},
    "truncated section table": {"size": 0x1A10},
}


def test_a_well_formed_elf_resolves(tmp_path: Path, mapper: Callable[..., tuple[int, list[int]]]) -> None:
    """The control case: the same file, unharmed, gives its function's name."""
    (tmp_path / "h.so").write_bytes(elf_bytes())
    pid, (_, base) = mapper(tmp_path / "h.so")
    u = UserSymbols()
    assert [f.name for f in u.resolve_stack(pid, [base + TEXT_OFF + 0x10])] == [FUNC]
    assert u.errors == {}


@pytest.mark.parametrize("case", list(HOSTILE_ELVES))
def test_hostile_elf_degrades_to_module_plus_offset(tmp_path: Path, case: str,
                                                    mapper: Callable[..., tuple[int, list[int]]]) -> None:
    (tmp_path / "h.so").write_bytes(elf_bytes(**HOSTILE_ELVES[case]))
    pid, (_, base) = mapper(tmp_path / "h.so")
    u = UserSymbols()
    with bounded():
        frames = returns(lambda: u.resolve_stack(pid, [base + TEXT_OFF + 0x10]))
    assert [(f.name, f.module) for f in frames] == [("h.so+0x1010", "h.so")]
    assert frames[0].unknown
    assert u.errors == {BAD_ELF: 1}
    # Parsed once: the same file in another process is not read again.
    with bounded(seconds=0.5):
        pid2, (_, base2) = mapper(tmp_path / "h.so")
        assert u.resolve_stack(pid2, [base2 + TEXT_OFF])[0].name == "h.so+0x1000"
    assert u.elf.loads == 1


def _sparse_elf(path: Path, table_bytes: int) -> None:
    """A sparse file whose .symtab (of zeros) really spans `table_bytes`."""
    head = bytearray(elf_bytes(symtab_off=0x4000, symtab_size=table_bytes, shoff=0x1A00))
    with path.open("wb") as f:
        f.write(head)
        f.truncate(0x4000 + table_bytes + 4096)


@pytest.mark.parametrize(("table_mb", "cause"), [(1024, BAD_ELF), (60, NO_SYMBOL)])
def test_huge_sparse_symbol_tables(tmp_path: Path, table_mb: int, cause: str,
                                   mapper: Callable[..., tuple[int, list[int]]]) -> None:
    """1 GB of table: refused by size; 60 MB of zeros (under the cap): scanned at once, no symbol."""
    _sparse_elf(tmp_path / "h.so", table_mb << 20)
    pid, (_, base) = mapper(tmp_path / "h.so")
    u = UserSymbols()
    with bounded():
        frames = returns(lambda: u.resolve_stack(pid, [base + TEXT_OFF]))
    assert [f.name for f in frames] == ["h.so+0x1000"]
    assert u.errors == {cause: 1}


@pytest.mark.parametrize("pack_from", [PACK_FROM, 0], ids=["held", "packed"])
def test_hostile_symbol_names_are_decoded_and_capped(tmp_path: Path, pack_from: int) -> None:
    (tmp_path / "a.so").write_bytes(elf_bytes(sym_name=b"evil\x1b]0;PWNED\x07\xff\xfe"))
    assert (load_elf(str(tmp_path / "a.so"), pack_from=pack_from).lookup(BASE + TEXT_OFF)
            == "evil\x1b]0;PWNED\x07\ufffd\ufffd")
    # A name running to the end of the string table, without its NUL.
    data = bytearray(elf_bytes(sym_name=b"x" * 200))
    data[0x1900 + 1 + 200] = ord("y")
    (tmp_path / "b.so").write_bytes(data)
    name = load_elf(str(tmp_path / "b.so"), pack_from=pack_from).lookup(BASE + TEXT_OFF)
    assert name is not None and name.startswith("x" * 200) and len(name) <= 1024


def test_symbols_with_absurd_sizes_and_addresses(tmp_path: Path) -> None:
    data = bytearray(elf_bytes(symtab_size=3 * 24))
    data[0x1800 + 24: 0x1800 + 48] = SYM.pack(1, 0x12, 0, 1, BASE + TEXT_OFF, (1 << 64) - 1)
    # Another, near the top of the address space, reaching past it.
    data[0x1800 + 48: 0x1800 + 72] = SYM.pack(1, 0x12, 0, 1, (1 << 64) - 16, 1 << 63)
    (tmp_path / "a.so").write_bytes(data)
    with bounded():
        syms = returns(lambda: ElfCache().get(str(tmp_path / "a.so")))
    assert not isinstance(syms, str)
    assert syms.lookup(BASE + TEXT_OFF) == FUNC
    assert syms.lookup((1 << 64) - 2) == FUNC


def test_non_regular_files_as_binaries_are_never_opened_for_reading(tmp_path: Path) -> None:
    """A FIFO (open() would wait for a writer for good) and devices, as a mapping's file."""
    fifo = tmp_path / "fifo.so"
    os.mkfifo(fifo)
    maps = [Mapping(0x10000, 0x20000, 0, "/x/fifo.so", str(fifo)),
            Mapping(0x30000, 0x40000, 0, "/dev/zero", "/dev/zero"),
            Mapping(0x50000, 0x60000, 0, "/dev/null", "/dev/null")]
    u = UserSymbols(start_time=lambda pid: 1, maps=lambda pid: maps)
    try:
        with bounded():
            frames = returns(lambda: u.resolve_stack(7, [0x10010, 0x30010, 0x50010]))
    finally:
        with contextlib.suppress(OSError):  # frees a reader the old code left blocked
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
    assert [f.name for f in frames] == ["fifo.so+0x10", "zero+0x10", "null+0x10"]
    assert u.errors == {NOT_REGULAR: 3}
    for path in (str(fifo), "/dev/zero"):
        with pytest.raises(FileRefused) as e:
            returns(lambda p=path: load_elf(p))  # type: ignore[misc]
        assert e.value.cause == NOT_REGULAR


def test_a_dead_process_binary_replaced_by_a_fifo(tmp_path: Path) -> None:
    """Once a process is gone offtop falls back to the mapped path: now a FIFO."""
    fifo = tmp_path / "app"
    os.mkfifo(fifo)
    alive = [True]
    maps = [Mapping(0x10000, 0x20000, 0, str(fifo), str(tmp_path / "map_files-gone"))]
    u = UserSymbols(start_time=lambda pid: 1 if alive[0] else None, maps=lambda pid: maps)
    u.see(9)
    alive[0] = False
    try:
        with bounded():
            frames = returns(lambda: u.resolve_stack(9, [0x10020]))
    finally:
        with contextlib.suppress(OSError):
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
    assert [f.name for f in frames] == ["app+0x20"]
    assert u.errors == {NOT_REGULAR: 1}


def _many_functions(path: Path, n: int = 200_000) -> None:
    """An ELF with `n` real function symbols: loading it takes several steps."""
    data = bytearray(elf_bytes(symtab_off=0x4000, symtab_size=24 * n, shoff=0x1A00))
    data += bytes(0x4000 + 24 * n + 4096 - len(data))
    for i in range(1, n):
        data[0x4000 + 24 * i: 0x4000 + 24 * (i + 1)] = SYM.pack(1, 0x12, 0, 1, BASE + i * 16, 16)
    path.write_bytes(data)


def test_a_file_truncated_while_it_loads(tmp_path: Path) -> None:
    """Read with pread, never mapped: a file cut under offtop ends its load with a cause
    (a mapped file would have killed offtop with SIGBUS)."""
    path = tmp_path / "big.so"
    _many_functions(path)
    with open_regular(str(path)) as f:
        steps = load_steps(f)
        next(steps)
        next(steps)
        os.truncate(path, 0x3000)  # the owner cuts the file under offtop
        with bounded(), pytest.raises(FileRefused) as e:
            for _ in steps:
                pass
    assert e.value.cause == UNREADABLE
    # Loaded afresh (a new size is a new file): its symbol table is now past its end.
    assert ElfCache().get(str(path)) == BAD_ELF


def test_part_loaded_files_hold_few_descriptors(tmp_path: Path) -> None:
    for i in range(6):
        _many_functions(tmp_path / f"{i}.so", 50_000)
    fds_before = len(os.listdir("/proc/self/fd"))
    ticks = [0.0]

    def clock() -> float:
        ticks[0] += 1.0
        return ticks[0]

    cache = ElfCache(clock=clock, max_loading=2)
    for i in range(6):
        assert cache.get(str(tmp_path / f"{i}.so"), deadline=clock() + 0.5) == TIME_BUDGET
    assert len(os.listdir("/proc/self/fd")) <= fds_before + 2
    cache.close()
    assert len(os.listdir("/proc/self/fd")) == fds_before


# --- /proc/PID/maps -----------------------------------------------------------------


def test_maps_with_non_utf8_paths(tmp_path: Path, mapper: Callable[..., tuple[int, list[int]]]) -> None:
    """A binary whose path is not UTF-8 and holds an escape: decoded with replacement;
    the file itself is still opened through map_files, so its names resolve."""
    raw = os.fsencode(tmp_path) + b"/caf\xe9\x1b[2J.so"
    with open(raw, "wb") as f:
        f.write(elf_bytes())
    pid, (_, base) = mapper(Path(os.fsdecode(raw)))
    u = UserSymbols()
    with bounded():
        frames = u.resolve_stack(pid, [base + TEXT_OFF + 1, base + 0x20])
    assert [(f.name, f.module) for f in frames] == [
        (FUNC, "caf\ufffd\x1b[2J.so"), ("caf\ufffd\x1b[2J.so+0x20", "caf\ufffd\x1b[2J.so")]


# --- perf maps ----------------------------------------------------------------------


@pytest.fixture
def perf_map_of() -> Iterator[Callable[[int], Path]]:
    """/tmp/perf-PID.map of a test process, removed afterwards whatever it became."""
    made: list[Path] = []

    def path(pid: int) -> Path:
        p = Path(f"/tmp/perf-{pid}.map")
        made.append(p)
        return p

    yield path
    for p in made:
        if p.is_fifo():
            with contextlib.suppress(OSError):  # frees a reader the old code left blocked
                os.close(os.open(p, os.O_WRONLY | os.O_NONBLOCK))
        p.unlink(missing_ok=True)


def test_perf_map_names_with_control_characters_and_invalid_utf8(
        mapper: Callable[..., tuple[int, list[int]]], perf_map_of: Callable[[int], Path]) -> None:
    pid, (jit, *_) = mapper()
    raw = b"jit\x1b]0;PWNED\x07\rcr\xff\xfe [x]"
    perf_map_of(pid).write_bytes(b"%x 40 %s\n%x 40 second\n" % (jit, raw, jit + 0x40))
    u = UserSymbols()
    with bounded():
        frames = u.resolve_stack(pid, [jit + 4, jit + 0x41])
    # Exact, as decoded with replacement: shown escaped by the TUI and text output.
    assert [(f.name, f.module) for f in frames] == [
        (raw.decode("utf-8", "replace"), "[jit]"), ("second", "[jit]")]
    assert u.errors == {}


def test_a_stand_ins_perf_map_never_names_a_gone_processs_frames(
        mapper: Callable[..., tuple[int, list[int]]], perf_map_of: Callable[[int], Path]) -> None:
    # A process gone before its first sight, resolved in the process it was
    # forked from (offtop.bpf.lineage): that one's JIT code at an address may
    # be other code than the child's, so anonymous memory stays unnamed, even
    # where the stand-in's own frame there is named and cached.
    pid, (jit, *_) = mapper()
    perf_map_of(pid).write_bytes(b"%x 40 jitted\n" % jit)
    u = UserSymbols(start_time=lambda p: None if p == 4242 else task_start_time(p))
    u.stand_in = lambda p: (pid, task_start_time(pid) or 0) if p == 4242 else None
    with bounded():
        assert [f.name for f in u.resolve_stack(pid, [jit + 4])] == ["jitted"]
        frames = u.resolve_stack(4242, [jit + 4])
    assert frames[0].name != "jitted" and frames[0].unknown and frames[0].module != "[jit]"
    assert u.stood_in == 1


def test_a_fifo_perf_map_is_ignored_without_blocking(
        mapper: Callable[..., tuple[int, list[int]]], perf_map_of: Callable[[int], Path]) -> None:
    pid, (jit, *_) = mapper()
    os.mkfifo(perf_map_of(pid))
    u = UserSymbols()
    with bounded():
        frames = returns(lambda: u.resolve_stack(pid, [jit + 4]))
    assert [f.name for f in frames] == ["anon+0x4"]  # trusted (an executable mapping), unnamed
    assert u.errors == {PERF_MAP_PREFIX + NOT_REGULAR: 1, NO_SYMBOL: 1}


def test_a_sparse_1gb_perf_map_without_newline(
        mapper: Callable[..., tuple[int, list[int]]], perf_map_of: Callable[[int], Path]) -> None:
    pid, (jit, *_) = mapper()
    with perf_map_of(pid).open("wb") as f:
        f.write(b"%x 40 " % jit)
        f.truncate(1 << 30)
    u = UserSymbols()
    with bounded():
        frames = returns(lambda: u.resolve_stack(pid, [jit + 4]))
    assert [f.name for f in frames] == ["anon+0x4"]
    assert u.errors == {PERF_MAP_TRUNCATED: 1, PERF_MAP_LONG_LINE: 1, NO_SYMBOL: 1}


def test_a_perf_map_planted_by_another_user_is_ignored(
        mapper: Callable[..., tuple[int, list[int]]], perf_map_of: Callable[[int], Path]) -> None:
    """A file owned by another user for a root process: perf's rule, ignored."""
    pid, (jit, *_) = mapper()
    path = perf_map_of(pid)
    path.write_bytes(b"%x 40 planted_name\n" % jit)
    os.chown(path, 65534, 65534)
    u = UserSymbols()
    with bounded():
        frames = u.resolve_stack(pid, [jit + 4])
    assert [f.name for f in frames] == ["anon+0x4"]
    assert u.errors == {PERF_MAP_PREFIX + WRONG_OWNER: 1, NO_SYMBOL: 1}


def test_a_perf_map_of_the_process_own_user_is_read(
        mapper: Callable[..., tuple[int, list[int]]], perf_map_of: Callable[[int], Path]) -> None:
    pid, (jit, *_) = mapper(user=65534)
    path = perf_map_of(pid)
    path.write_bytes(b"%x 40 nobody_jit\n" % jit)
    os.chown(path, 65534, 65534)
    assert [f.name for f in UserSymbols().resolve_stack(pid, [jit + 4])] == ["nobody_jit"]


def test_a_symlinked_perf_map_is_not_followed(
        tmp_path: Path, mapper: Callable[..., tuple[int, list[int]]],
        perf_map_of: Callable[[int], Path]) -> None:
    pid, (jit, *_) = mapper()
    target = tmp_path / "root-owned"
    target.write_bytes(b"%x 40 through_a_symlink\n" % jit)
    perf_map_of(pid).symlink_to(target)
    u = UserSymbols()
    assert [f.name for f in u.resolve_stack(pid, [jit + 4])] == ["anon+0x4"]
    assert u.errors == {PERF_MAP_PREFIX + NOT_REGULAR: 1, NO_SYMBOL: 1}  # the link itself


def test_perf_map_read_as_it_grows_with_lines_cut_across_reads(tmp_path: Path) -> None:
    path = tmp_path / "perf.map"
    path.write_bytes(b"1000 10 first\n2000 10 sec")
    pm = PerfMap([str(path)], owners={os.getuid()})
    pm.refresh()
    assert (pm.lookup(0x1008), pm.lookup(0x2008), len(pm)) == ("first", None, 1)
    with path.open("ab") as f:  # the runtime finishes the line and adds more
        f.write(b"ond\n" + b"3000 10 " + b"z" * 10_000 + b"\n500 10 early\n")
    pm.refresh()
    assert (pm.lookup(0x2008), pm.lookup(0x3008), pm.lookup(0x508)) == ("second", None, "early")
    assert pm.errors == {PERF_MAP_LONG_LINE}
    # A line too long, cut across two reads, then a good one.
    path.write_bytes(b"")
    os.truncate(path, 0)
    pm = PerfMap([str(path)], owners={os.getuid()})
    path.write_bytes(b"4000 10 " + b"y" * 3000)
    pm.refresh()
    with path.open("ab") as f:
        f.write(b"y" * 3000 + b"\n5000 10 after\n")
    pm.refresh()
    assert (pm.lookup(0x4008), pm.lookup(0x5008)) == (None, "after")


# --- the files' opener itself -------------------------------------------------------


def test_open_regular_refuses_without_opening(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    link = tmp_path / "link"
    link.symlink_to("/etc/hostname")
    regular = tmp_path / "f"
    regular.write_bytes(b"x" * 100)
    os.chown(regular, 65534, 65534)
    cases: list[tuple[Callable[[], object], str]] = [
        (lambda: open_regular(str(fifo)), NOT_REGULAR),
        (lambda: open_regular("/dev/zero"), NOT_REGULAR),
        (lambda: open_regular(str(tmp_path)), NOT_REGULAR),
        (lambda: open_regular(str(link), follow_symlinks=False), NOT_REGULAR),  # the link itself
        (lambda: open_regular(str(regular), owners={0}), WRONG_OWNER),
        (lambda: open_regular(str(regular), max_size=99), "file too large"),
    ]
    for fn, cause in cases:
        with pytest.raises(FileRefused) as e:
            returns(fn)
        assert e.value.cause == cause
    with open_regular(str(regular), owners={65534}, max_size=100) as f:
        assert stat.S_ISREG(f.stat.st_mode)
        assert f.pread(90, 100) == b"x" * 10
        assert f.read_capped(64) == (b"x" * 64, True)
        flags = int(re.search(r"flags:\s+(\d+)", Path(f"/proc/self/fdinfo/{f.fd}").read_text())
                    .group(1), 8)  # type: ignore[union-attr]
        assert flags & os.O_NONBLOCK and flags & os.O_CLOEXEC and flags & 3 == os.O_RDONLY


# --- mutations -----------------------------------------------------------------------


def test_mutated_elf_files_never_raise(tmp_path: Path) -> None:
    """800 seeded mutations of a good file, aimed at its headers and tables."""
    rng = random.Random(8)
    good = elf_bytes(symtab_size=48)
    hot = [(0, 64), (64, 120), (0x1800, 0x1830), (0x1900, 0x1910), (0x1A00, 0x1B00)]
    path = tmp_path / "m.so"
    with bounded(seconds=10):
        for _ in range(800):
            data = bytearray(good)
            for _ in range(rng.randint(1, 16)):
                lo, hi = rng.choice(hot)
                data[rng.randrange(lo, hi)] = rng.randrange(256)
            path.write_bytes(data)
            syms = ElfCache().get(str(path))  # a cause, or a table that answers lookups
            if not isinstance(syms, str):
                for vaddr in (BASE + TEXT_OFF, 0, (1 << 64) - 1):
                    syms.lookup(vaddr)


def test_mutated_mangled_names_never_raise() -> None:
    rng = random.Random(13)
    seeds = ["_RNvNtNtCsjrHSEGnQ3l9_3std6thread9functions5sleep",
             "_RINvMNtCsgEmfK2I1SDS_4core3stre18trim_start_matchesReECsgY6Mt91CT9J_14rustc_demangle",
             "_RMC0TTTTTTpB8_EB7_EB6_EB5_EB4_EB3_E",
             "_RIC0KVNtC3foo3BarS1sRe616263_2chc78_5sliceRAh1_h2_h3_EEE",
             "_ZN44_$LT$m..Dog$LT$T$GT$$u20$as$u20$m..Speak$GT$5speak17h76cdd42951cdc6b6E"]
    alphabet = "_RNCMXYIBKLGTAPOQSDFEUWpuvsjhabcdefgimnoxyzt0123456789$."
    with bounded(seconds=10):
        for _ in range(5000):
            name = list(rng.choice(seeds))
            for _ in range(rng.randint(1, 6)):
                i = rng.randrange(2, len(name))
                name[i:i + rng.randint(0, 1)] = rng.choice(alphabet) * rng.randint(0, 2)
            assert isinstance(demangle("".join(name)), str)


def test_a_perf_map_read_put_off_by_the_time_budget_names_the_frame_later(
        mapper: Callable[..., tuple[int, list[int]]], perf_map_of: Callable[[int], Path]) -> None:
    now = [100.0]
    pid, (jit, *_) = mapper()
    u = UserSymbols(clock=lambda: now[0])
    # No perf map yet: unnamed, not for good (a runtime may write it later).
    assert [f.name for f in u.resolve_stack(pid, [jit + 4])] == ["anon+0x4"]
    perf_map_of(pid).write_bytes(b"%x 40 late_jit\n" % jit)
    now[0] += 2
    # Past the deadline the perf map is not read: unnamed, uncached, counted.
    assert [f.name for f in u.resolve_stack(pid, [jit + 4], deadline=now[0] - 1)] == ["anon+0x4"]
    assert u.errors == {TIME_BUDGET: 1}
    assert [f.name for f in u.resolve_stack(pid, [jit + 4], deadline=now[0] + 1)] == ["late_jit"]


def test_a_tasks_start_time_and_name_are_read_whole_whatever_its_name() -> None:
    """/proc/PID/stat and comm read with one open, one read, one close: a name made
    of ')' and spaces (the stat line's own separators) still gives the start time,
    and a task gone gives None, not an error."""
    from offtop.bpf.block_frames import _comm_of
    from offtop.safe_files import read_proc_small
    from offtop.targets import task_start_time

    name = ") 1 2 3 (x"
    code = ("import ctypes, sys, time; ctypes.CDLL(None).prctl(15, sys.argv[1].encode(), 0, 0, 0);"
            "print('ready', flush=True); time.sleep(60)")
    proc = subprocess.Popen(["/usr/bin/python3", "-c", code, name], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
        stat_line = Path(f"/proc/{proc.pid}/stat").read_bytes()
        assert b"(" + name.encode() + b")" in stat_line
        assert task_start_time(proc.pid) == int(stat_line[stat_line.rfind(b")") + 2:].split()[19])
        assert _comm_of(proc.pid, proc.pid) == name
        again = read_proc_small(f"/proc/{proc.pid}/stat")  # whole: the line and its end
        assert again.startswith(f"{proc.pid} ({name}) ".encode()) and again.endswith(b"\n")
    finally:
        proc.kill()
        proc.wait()
    assert task_start_time(proc.pid) is None and _comm_of(proc.pid, proc.pid) == "?"
    with pytest.raises(OSError):
        read_proc_small(f"/proc/{proc.pid}/stat")
