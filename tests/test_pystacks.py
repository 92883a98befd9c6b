"""offtop.pystacks: Python stacks read from CPython processes' memory, and merged into native stacks.

Layers:
- line tables and struct layouts checked against the interpreters themselves
  (every CPython 3.8-3.13 found on the machine: Debian's, pyenv's, ...);
- the merge of Python frames into native stacks (pure);
- live reads of Debian's /usr/bin/python3 (and any other CPython found) with
  threads blocked in named functions, the GIL holder and a GIL waiter;
- hostile processes: not Python, and a fake interpreter (a C program that
  exports `_PyRuntime` & co.) whose memory holds loops, wrong types, huge
  lengths and garbage, next to a well-formed image as the positive control.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from offtop.model import Frame
from offtop.pystacks import (
    INCONSISTENT,
    MARK_GIL_WAIT,
    MARK_PYTHON_UNPLACED,
    NOT_PYTHON,
    TIME_LIMIT,
    UNSUPPORTED,
    PyFrame,
    PyProcess,
    PythonStacks,
    StackMarker,
    describe_failure,
    merge_stacks,
)
from offtop.pystacks.binary import Interpreter, parse_elf_symbols
from offtop.pystacks.linetable import line_from_linetable310, line_from_lnotab, line_from_locations
from offtop.pystacks.memory import ProcessMemory, ReadError, plausible_pointer
from offtop.pystacks.objects import MAX_CHARS, Inconsistent, ObjectReader, TypeAddresses
from offtop.pystacks.offsets import (
    DEBUG_COOKIE,
    DEBUG_OFFSETS_SIZE,
    LAYOUTS,
    Layout,
    LayoutError,
    debug_offsets_layout,
)

ROOT = Path(__file__).resolve().parent.parent
WORKLOADS = ROOT / "tests" / "workloads"
BLOCKERS = WORKLOADS / "pystacks_blockers.py"
DEBIAN_PYTHON = "/usr/bin/python3"
IS_ROOT = os.geteuid() == 0
needs_root = pytest.mark.skipif(not IS_ROOT, reason="reads other processes' memory and map_files: needs root")

# -- interpreters on this machine --------------------------------------------------------------


def _find_interpreters() -> dict[tuple[int, int], list[str]]:
    """CPython 3.8-3.13 executables found here, by (major, minor): Debian's, pyenv's, PATH's."""
    candidates = [DEBIAN_PYTHON, sys.executable]
    for minor in range(8, 14):
        candidates.append(shutil.which(f"python3.{minor}") or "")
        pyenv = os.environ.get("PYENV_ROOT", os.path.expanduser("~/.pyenv"))
        candidates += sorted(glob.glob(f"{pyenv}/versions/3.{minor}.*/bin/python3.{minor}"))
    found: dict[tuple[int, int], list[str]] = {}
    seen: set[str] = set()
    for c in candidates:
        if not c or "/shims/" in c or not os.path.exists(c) or os.path.realpath(c) in seen:
            continue
        seen.add(os.path.realpath(c))
        try:
            out = subprocess.run([c, "-c", "import sys; print(*sys.version_info[:2], sys.abiflags)"],
                                 capture_output=True, text=True, timeout=30).stdout.split()
        except (OSError, subprocess.TimeoutExpired):
            continue
        if len(out) >= 2 and (int(out[0]), int(out[1])) in LAYOUTS and "d" not in out[2:]:
            found.setdefault((int(out[0]), int(out[1])), []).append(c)
    return found


INTERPRETERS = _find_interpreters()
ALL_PYTHONS = [pytest.param(p, id=f"{v[0]}.{v[1]}-{Path(p).parent.parent.name}")
               for v, paths in sorted(INTERPRETERS.items()) for p in paths]


def _version_of(python: str) -> tuple[int, int]:
    return next(v for v, paths in INTERPRETERS.items() if python in paths)


# -- line tables: the decoders against the interpreters' own answers ---------------------------

_DUMP_LINES = r"""
import dis, json, sys, threading, queue, json.decoder
codes = []
def walk(co):
    codes.append(co)
    for c in co.co_consts:
        if isinstance(c, type(co)):
            walk(c)
for mod in (threading, queue, json.decoder, dis):
    with open(mod.__file__) as f:
        walk(compile(f.read(), mod.__file__, "exec"))
out = []
for co in codes:
    if sys.version_info >= (3, 10):
        ranges = list(co.co_lines())
        table = co.co_linetable
    else:
        starts = list(dis.findlinestarts(co))
        ranges = [(off, starts[i + 1][0] if i + 1 < len(starts) else len(co.co_code), line)
                  for i, (off, line) in enumerate(starts)]
        table = co.co_lnotab
    out.append([table.hex(), co.co_firstlineno, ranges])
print(json.dumps(out))
"""


@pytest.mark.skipif(not ALL_PYTHONS, reason="no CPython 3.8-3.13 found")
@pytest.mark.parametrize("python", ALL_PYTHONS)
def test_line_tables_decode_as_the_interpreter_does(python: str) -> None:
    """Every instruction of four stdlib modules gets the line the interpreter itself gives it."""
    version = _version_of(python)
    out = subprocess.run([python, "-c", _DUMP_LINES], capture_output=True, text=True, timeout=120,
                         check=True).stdout
    checked = 0
    for table_hex, first, ranges in json.loads(out):
        table = bytes.fromhex(table_hex)
        for start, end, line in ranges:
            for addr in range(start, end, 2):
                if version < (3, 10):
                    got = line_from_lnotab(table, first, addr)
                elif version == (3, 10):
                    got = line_from_linetable310(table, first, addr)
                else:
                    got = line_from_locations(table, first, addr)
                assert got == (line or 0), (python, first, addr, table_hex[:80])
                checked += 1
    assert checked > 5000


def test_line_before_the_first_instruction_is_the_def_line() -> None:
    # 3.11's prev_instr of a frame not yet started points one code unit before the code.
    assert line_from_locations(b"\xef\x04", 10, -2) == 10
    assert line_from_linetable310(b"\x02\x01", 7, -2) == 7


def test_garbage_line_tables_give_a_number_never_an_exception() -> None:
    import random

    rng = random.Random(1234)
    for _ in range(2000):
        table = bytes(rng.randrange(256) for _ in range(rng.randrange(0, 64)))
        first = rng.randrange(0, 1 << 20)
        addr = rng.randrange(-4, 512)
        for fn in (line_from_lnotab, line_from_linetable310, line_from_locations):
            line = fn(table, first, addr)
            assert isinstance(line, int) and line >= 0
    # A varint that never ends is cut after a few bytes, not followed through the table.
    endless = bytes([0x80 | (13 << 3)]) + b"\x7f" * 10000
    assert line_from_locations(endless, 1, 0) < 1 << 40


# -- struct layouts: the tables against CPython's own headers ----------------------------------


def _header_trees() -> list[tuple[str, Path]]:
    trees = []
    for inc in sorted({*glob.glob("/usr/include/python3.*"),
                       *glob.glob(os.path.expanduser("~/.pyenv/versions/3.*/include/python3.*"))}):
        m = re.search(r"python3\.(\d+)$", inc)
        if m and (3, int(m[1])) in LAYOUTS and Path(inc, "internal", "pycore_gil.h").exists():
            trees.append((inc, Path(inc)))
    return trees


HEADER_TREES = _header_trees()


@pytest.mark.skipif(not HEADER_TREES or not shutil.which("gcc"), reason="no CPython headers or gcc")
@pytest.mark.parametrize("include", [pytest.param(p, id=i) for i, p in HEADER_TREES])
def test_layout_tables_match_the_headers(include: Path, tmp_path: Path) -> None:
    """offsetof() of every field read, compiled against the headers, equals the table."""
    exe = tmp_path / "offsets"
    subprocess.run(["gcc", f"-I{include}", f"-I{include}/internal", "-o", str(exe),
                    str(WORKLOADS / "pystacks_offsets.c")], check=True, capture_output=True)
    printed = dict(line.split() for line in subprocess.run([str(exe)], capture_output=True, text=True,
                                                           check=True).stdout.splitlines())
    minor = int(re.search(r"python3\.(\d+)$", str(include))[1])  # type: ignore[index]
    layout = LAYOUTS[(3, minor)]
    assert len(printed) >= 25
    for name, value in printed.items():
        assert getattr(layout, name) == int(value), name
    code_fields = [layout.code_filename, layout.code_name, layout.code_linetable, layout.code_firstlineno,
                   layout.code_qualname or 0]
    assert layout.code_read >= max(code_fields) + 8


def _debug_offsets_image(layout: Layout, *, version: int = 0x030D00F0, free_threaded: int = 0,
                         big: int | None = None) -> bytes:
    """_Py_DebugOffsets as 3.13 lays it out, with the table's values (or `big` everywhere)."""
    from offtop.pystacks.offsets import _DEBUG_FIELDS_313

    values = {
        "version": version, "free_threaded": free_threaded,
        "runtime.interpreters_head": layout.runtime_interpreters_head,
        "interp.next": layout.interp_next, "interp.threads_head": layout.interp_threads_head,
        "interp.ceval_gil": layout.interp_gil_ptr,
        "tstate.next": layout.tstate_next, "tstate.interp": layout.tstate_interp,
        "tstate.current_frame": layout.tstate_frame, "tstate.thread_id": layout.tstate_thread_id,
        "tstate.native_thread_id": layout.tstate_native_thread_id,
        "frame.previous": layout.frame_back, "frame.executable": layout.frame_code,
        "frame.instr_ptr": layout.frame_instr, "frame.owner": layout.frame_owner,
        "code.filename": layout.code_filename, "code.name": layout.code_name,
        "code.qualname": layout.code_qualname, "code.linetable": layout.code_linetable,
        "code.firstlineno": layout.code_firstlineno, "code.co_code_adaptive": layout.code_adaptive,
        "bytes.ob_size": layout.bytes_size, "bytes.ob_sval": layout.bytes_sval,
        "unicode.state": layout.unicode_state, "unicode.length": layout.unicode_length,
        "unicode.asciiobject_size": layout.unicode_ascii_size,
    }
    words = [values.get(name) if big is None or name in ("version", "free_threaded") else big
             for name in _DEBUG_FIELDS_313]
    return DEBUG_COOKIE + b"".join(int(w or 0).to_bytes(8, "little") for w in words)


def test_debug_offsets_give_the_313_layout_and_refuse_what_they_cannot_be() -> None:
    table = LAYOUTS[(3, 13)]
    assert len(_debug_offsets_image(table)) == DEBUG_OFFSETS_SIZE
    assert debug_offsets_layout(_debug_offsets_image(table)) == table
    with pytest.raises(LayoutError, match="free-threaded"):
        debug_offsets_layout(_debug_offsets_image(table, free_threaded=1))
    with pytest.raises(LayoutError, match=r"not 3\.13"):
        debug_offsets_layout(_debug_offsets_image(table, version=0x030E00F0))
    with pytest.raises(LayoutError, match="out of range"):
        debug_offsets_layout(_debug_offsets_image(table, big=1 << 40))
    with pytest.raises(LayoutError):
        debug_offsets_layout(b"ydebugpy" + bytes(DEBUG_OFFSETS_SIZE))


# -- ELF and memory ---------------------------------------------------------------------------


def test_elf_symbols_of_debians_python_are_found_in_dynsym() -> None:
    if not os.path.exists("/usr/bin/python3.11"):
        pytest.skip("no Debian python3.11")
    data = Path("/usr/bin/python3.11").read_bytes()
    info = parse_elf_symbols(lambda off, n: data[off:off + n], len(data))
    nm = subprocess.run(["readelf", "-Ws", "--dyn-syms", "/usr/bin/python3.11"], capture_output=True,
                        text=True, check=True).stdout
    want = {line.split()[7]: int(line.split()[1], 16) for line in nm.splitlines()
            if len(line.split()) >= 8 and line.split()[7] in ("_PyRuntime", "PyCode_Type", "Py_Version")}
    assert want and all(info.symbols[k] == v for k, v in want.items())
    assert info.segments


@pytest.mark.parametrize("data", [b"", b"\x7fELF", b"MZ" + bytes(100), b"\x7fELF\x01\x01" + bytes(100)])
def test_non_elf_bytes_are_refused(data: bytes) -> None:
    with pytest.raises(ValueError):
        parse_elf_symbols(lambda off, n: data[off:off + n], len(data))


def test_elf_headers_pointing_outside_the_file_give_no_symbols() -> None:
    data = bytearray(Path(sys.executable).resolve().read_bytes()[:4096])
    info = parse_elf_symbols(lambda off, n: bytes(data[off:off + n]), len(data))
    assert info.symbols == {}


def _elf_with_dynsym(strings: bytes, entries: list[tuple[int, int, int]], padding: int = 0) -> bytes:
    """A minimal ELF64 file: section headers null, .dynsym (st_name, st_shndx, st_value entries), .dynstr."""
    import struct

    sym = struct.Struct("<IBBHQQ")
    table = bytes(sym.size * padding) + b"".join(sym.pack(n, 0x11, 0, ndx, v, 8) for n, ndx, v in entries)
    ehdr_size, shdr = 64, struct.Struct("<IIQQQQIIQQ")
    dynsym_at = ehdr_size
    dynstr_at = dynsym_at + len(table)
    shoff = dynstr_at + len(strings)
    ident = b"\x7fELF\x02\x01\x01" + bytes(9)
    ehdr = struct.pack("<16sHHIQQQIHHHHHH", ident, 3, 62, 1, 0, 0, shoff, 0, 64, 56, 0, 64, 3, 0)
    shdrs = (shdr.pack(0, 0, 0, 0, 0, 0, 0, 0, 0, 0)
             + shdr.pack(1, 11, 2, 0, dynsym_at, len(table), 2, 1, 8, sym.size)
             + shdr.pack(9, 3, 2, 0, dynstr_at, len(strings), 0, 0, 1, 0))
    return ehdr + table + strings + shdrs


def test_symbols_are_found_by_name_offset_even_in_a_huge_table_and_shared_tails() -> None:
    strings = b"\0X_PyRuntime\0Py_Version\0"
    runtime_at = strings.index(b"_PyRuntime")  # a tail shared with "X_PyRuntime"
    # A decoy: the name's offset as a misaligned 4-byte pattern inside another entry's value.
    decoy = runtime_at << 8
    data = _elf_with_dynsym(strings, [(0, 1, decoy), (runtime_at, 0, 0x999), (runtime_at, 7, 0x1234)],
                            padding=600_000)
    started = time.monotonic()
    info = parse_elf_symbols(lambda off, n: data[off:off + n], len(data))
    assert time.monotonic() - started < 1.0  # 14 MB of symbols, looked through at C speed
    assert info.symbols == {"_PyRuntime": 0x1234}  # the undefined entry (st_shndx 0) is skipped


def test_memory_reads_of_this_process_and_a_hole_between_good_ranges() -> None:
    mem = ProcessMemory(os.getpid())
    blob = b"offtop pystacks " * 8
    addr = id(blob) + 32  # PyBytesObject's ob_sval (3.8-3.13)
    assert mem.read(addr, len(blob)) == blob
    got = mem.read_many([(addr, 6), (0x10, 8), (addr + 7, 8)])
    assert got == [b"offtop", None, b"pystacks"]
    with pytest.raises(ReadError):
        mem.read(0x1000, 8)  # page 1 is never mapped
    with pytest.raises(ReadError):
        mem.read(addr, 1 << 30)  # over MAX_READ: refused before any syscall
    assert not plausible_pointer(0) and not plausible_pointer(0xFFFF888000000000)
    assert not plausible_pointer(0x7F0000000003) and plausible_pointer(0x7F0000000008)


def _own_reader() -> ObjectReader:
    layout = LAYOUTS[sys.version_info[:2]]
    types_ = TypeAddresses(code=id(types.CodeType), unicode=id(str), bytes=id(bytes),
                           frame=id(types.FrameType))
    return ObjectReader(ProcessMemory(os.getpid()), layout, types_)


@pytest.mark.skipif(sys.version_info[:2] not in LAYOUTS, reason="this Python has no layout table")
@pytest.mark.parametrize("text", ["plain ascii", "latin-1 café", "ucs2 ☃ snow", "ucs4 🐍 snake", ""])
def test_strings_of_every_kind_decode(text: str) -> None:
    s = "".join([text, ""])  # a fresh object, not an interned constant
    assert _own_reader().string(id(s)) == s


@pytest.mark.skipif(sys.version_info[:2] not in LAYOUTS, reason="this Python has no layout table")
def test_long_strings_are_capped_and_non_strings_refused() -> None:
    reader = _own_reader()
    long = "x" * (MAX_CHARS * 3)
    assert reader.string(id(long)) == "x" * MAX_CHARS + "…"
    for obj in (12345678901234567890, b"bytes", 1.5):
        with pytest.raises(Inconsistent):
            reader.string(id(obj))


@pytest.mark.skipif(sys.version_info[:2] not in LAYOUTS, reason="this Python has no layout table")
def test_code_objects_decode_and_a_changed_one_is_read_afresh() -> None:
    reader = _own_reader()

    def sample_function() -> None:
        pass

    code = sample_function.__code__
    header = reader.code_headers([id(code)])[id(code)]
    info = reader.code(id(code), header)
    assert info.function.endswith("sample_function")
    assert info.filename == __file__ and info.firstlineno == code.co_firstlineno
    assert reader.code(id(code), header) is info  # cached
    changed = bytearray(header)
    changed[reader.layout.code_firstlineno] ^= 1
    other = reader.code(id(code), bytes(changed))
    assert other is not info and other.firstlineno == code.co_firstlineno ^ 1
    with pytest.raises(Inconsistent):
        reader.code(id(code), bytes(len(header)))  # type pointer 0: not a code object


# -- merge ------------------------------------------------------------------------------------


def _native(*names: str) -> list[Frame]:
    return [Frame(name=n, module="python3.11") for n in names]


def _py(name: str, entry: bool = False) -> PyFrame:
    return PyFrame(function=name, filename=f"/app/{name}.py", line=1, entry=entry)


def _names(frames: tuple[Any, ...]) -> list[str]:
    return [f.function if isinstance(f, PyFrame) else f.name for f in frames]


def test_merge_puts_each_run_of_python_frames_at_its_evaluation_frame() -> None:
    native = _native("__futex_abstimed_wait_common", "lock_PyThread_acquire_lock", "cfunction_vectorcall",
                     "_PyEval_EvalFrameDefault", "_PyFunction_Vectorcall", "thread_run",
                     "_PyEval_EvalFrameDefault.cold", "Py_RunMain", "main")
    python = [_py("inner"), _py("caller", entry=True), _py("<module>", entry=True)]
    merged = merge_stacks(native, python)
    assert _names(merged.frames) == [
        "__futex_abstimed_wait_common", "lock_PyThread_acquire_lock", "cfunction_vectorcall",
        "inner", "caller", "_PyFunction_Vectorcall", "thread_run", "<module>", "Py_RunMain", "main"]
    assert (merged.placed, merged.unplaced, merged.gil_wait) == (3, 0, False)


def test_merge_without_evaluation_frames_appends_python_behind_a_marker() -> None:
    native = _native("clock_nanosleep", "0xa840f8")  # Debian's python3: no frame pointers
    merged = merge_stacks(native, [_py("sleeper", entry=True), _py("run", entry=True)])
    assert _names(merged.frames) == ["clock_nanosleep", "0xa840f8", MARK_PYTHON_UNPLACED, "sleeper", "run"]
    assert (merged.placed, merged.unplaced) == (0, 2)
    assert isinstance(merged.frames[2], StackMarker)


def test_merge_with_a_truncated_native_stack_places_what_it_can() -> None:
    native = _native("futex_wait", "_PyEval_EvalFrameDefault", "[stack truncated]")
    python = [_py("a"), _py("b", entry=True), _py("c", entry=True)]
    merged = merge_stacks(native, python)
    assert _names(merged.frames) == ["futex_wait", "a", "b", "[stack truncated]", MARK_PYTHON_UNPLACED, "c"]
    assert (merged.placed, merged.unplaced) == (2, 1)


def test_merge_keeps_evaluation_frames_it_has_no_python_frames_for() -> None:
    native = _native("poll", "_PyEval_EvalFrameDefault", "_PyEval_EvalFrameDefault")
    merged = merge_stacks(native, [_py("only", entry=True)])
    assert _names(merged.frames) == ["poll", "only", "_PyEval_EvalFrameDefault"]


def test_merge_of_no_python_frames_is_the_native_stack() -> None:
    native = _native("read", "_PyEval_EvalFrameDefault", "main")
    merged = merge_stacks(native, [])
    assert list(merged.frames) == native and merged.unplaced == merged.placed == 0


@pytest.mark.parametrize(("names", "hint", "waits"), [
    (("__futex_abstimed_wait_common", "take_gil", "PyEval_RestoreThread", "time_sleep",
      "_PyEval_EvalFrameDefault"), None, True),
    (("futex_wait", "take_gil.lto_priv.0", "_PyEval_EvalFrameDefault"), None, True),
    (("futex_wait", "drop_gil", "_PyEval_EvalFrameDefault"), None, True),
    # A take_gil further out than an evaluation frame is not what the thread waits on now.
    (("clock_nanosleep", "_PyEval_EvalFrameDefault", "PyEval_RestoreThread"), None, False),
    (("clock_nanosleep", "_PyEval_EvalFrameDefault"), None, False),
    # The reader's finding (the futex on the GIL) when the native stack is too short to say.
    (("__futex_abstimed_wait_common", "0x2ff67fa0"), True, True),
    (("__futex_abstimed_wait_common",), False, False),
])
def test_gil_waits_are_found_in_native_frames_or_taken_from_the_reader(
        names: tuple[str, ...], hint: bool | None, waits: bool) -> None:
    merged = merge_stacks(_native(*names), [_py("f", entry=True)], gil_wait=hint)
    assert merged.gil_wait is waits
    assert (_names(merged.frames)[0] == MARK_GIL_WAIT) is waits
    assert MARK_GIL_WAIT not in _names(merge_stacks(_native(*names), [], gil_wait=hint,
                                                    mark_gil_wait=False).frames)


# -- live reads of real interpreters ----------------------------------------------------------


def _marked_lines() -> dict[str, int]:
    lines = {}
    for n, text in enumerate(BLOCKERS.read_text().splitlines(), start=1):
        m = re.search(r"# block: (\w+)", text)
        if m:
            lines[m[1]] = n
    return lines


MARKED = _marked_lines()


@dataclass
class Blockers:
    """A running pystacks_blockers.py: its pid and the tid of each named thread."""

    proc: subprocess.Popen[str]
    pid: int
    tids: dict[str, int]
    version: tuple[int, int] = (0, 0)
    extra: dict[str, Any] = field(default_factory=dict)

    def stop(self) -> None:
        """Kill it (the GIL holder never lets it exit by itself)."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)


def start_blockers(python: str, *args: str) -> Blockers:
    """Start the blockers workload under `python`; wait for its JSON line of tids."""
    proc = subprocess.Popen([python, str(BLOCKERS), *args], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line:
        proc.kill()
        raise RuntimeError(f"{python} {BLOCKERS.name} did not start")
    info = json.loads(line)
    return Blockers(proc, info["pid"], info["threads"])


@pytest.fixture(scope="module")
def debian_blockers() -> Iterator[Blockers]:
    """Debian's python3 with every kind of blocked thread, started before any reader exists."""
    if not os.path.exists(DEBIAN_PYTHON):
        pytest.skip("no /usr/bin/python3")
    b = start_blockers(DEBIAN_PYTHON, "--gil")
    yield b
    b.stop()


def _stack_problems(result: PyProcess, b: Blockers) -> list[str]:
    """What differs from what each named thread must show; [] when all is as expected."""
    problems = []
    if result.failure is not None:
        problems.append(f"failure {result.failure}")
    for name, tid in b.tids.items():
        thread = result.threads.get(tid)
        if thread is None:
            problems.append(f"{name}: tid {tid} not read")
            continue
        fns = [f.function.rsplit(".", 1)[-1] for f in thread.frames]
        if name == "blocked_in_queue_get":
            expect = ["wait", "get", name]
        elif name == "nested_outer":
            expect = [name] * 4
        else:
            expect = [name]
        if fns[:len(expect)] != expect:
            problems.append(f"{name}: innermost frames {fns[:5]}, expected {expect}")
            continue
        own = thread.frames[0 if name == "nested_outer" else len(expect) - 1]  # the marked call
        if own.filename != str(BLOCKERS) or own.line != MARKED[name]:
            problems.append(f"{name}: at {own.filename}:{own.line}, expected line {MARKED[name]}")
        if fns[-1] != "_bootstrap" or thread.truncated:
            problems.append(f"{name}: stack does not end in Thread._bootstrap: {fns}")
        if thread.holds_gil != (name == "holding_gil"):
            problems.append(f"{name}: holds_gil {thread.holds_gil}")
        if thread.waits_for_gil != (name == "waiting_for_gil"):
            problems.append(f"{name}: waits_for_gil {thread.waits_for_gil}")
    main = result.threads.get(b.pid)
    if main is None or [f.function.rsplit(".", 1)[-1] for f in main.frames][-2:] != ["main", "<module>"]:
        problems.append(f"main thread: {main}")
    return problems


def _read_until_right(reader: PythonStacks, b: Blockers, timeout: float = 15.0) -> PyProcess:
    """Read until every thread is in its blocking call (they report ready just before it)."""
    end = time.monotonic() + timeout
    while True:
        result = reader.read_process(b.pid, budget_s=2.0)
        problems = _stack_problems(result, b)
        if not problems or time.monotonic() > end:
            assert problems == [], result
            return result
        time.sleep(0.05)


@needs_root
def test_debian_python_threads_are_read_in_their_named_functions(debian_blockers: Blockers) -> None:
    """sleep, queue.get, Lock.acquire, socket.recv, nested calls, GIL holder and waiter: each at its tid."""
    result = _read_until_right(PythonStacks(), debian_blockers)
    assert result.version.startswith("3.11.")
    assert set(debian_blockers.tids.values()) | {debian_blockers.pid} <= set(result.threads)
    # Reads while threads were still on their way to block may have been torn
    # (and counted); once all are blocked, a new reader reads them whole.
    reader = PythonStacks()
    assert not _stack_problems(reader.read_process(debian_blockers.pid), debian_blockers)
    assert not reader.failures


@needs_root
def test_debian_python_entry_frames_mark_each_c_level_evaluation_call(debian_blockers: Blockers) -> None:
    """3.11: nested_outer calls itself Python-to-Python (one C call for all four); Thread.run calls
    the target through C (a new C call)."""
    frames = PythonStacks().read(debian_blockers.pid)[debian_blockers.tids["nested_outer"]]
    assert [f.entry for f in frames[:4]] == [False, False, False, True]
    assert frames[-1].function == "Thread._bootstrap" and frames[-1].entry


@needs_root
def test_reads_of_chosen_threads_and_of_a_warm_cache_are_cheap(debian_blockers: Blockers) -> None:
    reader = PythonStacks()
    tid = debian_blockers.tids["blocked_in_sleep"]
    cold = reader.read_process(debian_blockers.pid)
    warm = reader.read_process(debian_blockers.pid)
    one = reader.read_process(debian_blockers.pid, [tid])
    assert list(one.threads) == [tid] and one.threads[tid].frames == cold.threads[tid].frames
    # Code objects and lines are decoded once; a warm read re-reads structs in batches.
    assert warm.syscalls < cold.syscalls and warm.syscalls <= 30
    assert reader.cached_processes == 1


@needs_root
def test_a_read_past_its_time_budget_stops_and_says_so(debian_blockers: Blockers) -> None:
    reader = PythonStacks()
    reader.read_process(debian_blockers.pid)  # resolve the process first
    result = reader.read_process(debian_blockers.pid, budget_s=0.0)
    assert result.failure == TIME_LIMIT
    assert all(t.truncated and not t.frames for t in result.threads.values())
    assert reader.failures[TIME_LIMIT] == 1
    assert describe_failure(result) == "python stacks: time limit (partial)"


@needs_root
def test_a_hundred_blocked_threads_are_read_in_few_syscalls() -> None:
    """Frames are walked breadth-first over all threads: one batched read per depth, not per frame."""
    b = start_blockers(DEBIAN_PYTHON, "--only-sleepers", "--sleepers", "100")
    try:
        reader = PythonStacks(budget_s=2.0)

        asleep = (PyFrame("extra_sleeper", str(BLOCKERS), MARKED["extra_sleeper"], entry=True),)

        def all_asleep() -> bool:
            result = reader.read_process(b.pid)
            main = result.threads.get(b.pid)
            return len(result.threads) == 101 and all(
                result.threads[t].frames[:1] == asleep for t in b.tids.values()) and main is not None and [
                f.function for f in main.frames] == ["Condition.wait", "Event.wait", "main", "<module>"]

        end = time.monotonic() + 15
        while not all_asleep() and time.monotonic() < end:
            time.sleep(0.05)
        result = reader.read_process(b.pid)  # warm: every code object and line known
        assert result.failure is None and len(result.threads) == 101
        # 101 thread states (a linked list: one read each) + a handful of batched reads.
        assert result.syscalls <= 101 + 12
    finally:
        b.stop()


@needs_root
@pytest.mark.skipif(not ALL_PYTHONS, reason="no CPython 3.8-3.13 found")
@pytest.mark.parametrize("python", ALL_PYTHONS)
def test_every_cpython_found_is_read_right(python: str) -> None:
    """Debian's, pyenv's or any CPython 3.8-3.13 here: the same named frames, lines, tids and GIL."""
    b = start_blockers(python, "--gil")
    try:
        result = _read_until_right(PythonStacks(), b)
        assert result.version.startswith("{}.{}".format(*_version_of(python)))
    finally:
        b.stop()


# -- hostile processes ------------------------------------------------------------------------


@needs_root
def test_a_process_that_is_not_python_is_said_so_once() -> None:
    proc = subprocess.Popen(["sleep", "60"])
    try:
        reader = PythonStacks()
        for _ in range(3):
            result = reader.read_process(proc.pid)
            assert result.failure == NOT_PYTHON and not result.threads
        assert reader.read(proc.pid) == {}
        assert reader.failures == {NOT_PYTHON: 1}
    finally:
        proc.kill()
        proc.wait()
    assert reader.read_process(proc.pid).failure == NOT_PYTHON  # gone


@needs_root
def test_a_process_offtop_may_not_look_into_is_a_failed_read_not_not_python(
        debian_blockers: Blockers) -> None:
    """Without ptrace rights (offtop with CAP_BPF+CAP_PERFMON only) the cause says so."""
    if not shutil.which("setpriv"):
        pytest.skip("no setpriv")
    code = (f"import sys; sys.path.insert(0, {str(ROOT)!r}); from offtop.pystacks import PythonStacks; "
            f"r = PythonStacks(); print(r.read_process({debian_blockers.pid}).failure, dict(r.failures))")
    out = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable,
                          "-c", code], capture_output=True, text=True, timeout=60, check=True).stdout
    assert out.strip() == "read failed {'read failed': 1}"


class _FakeFinder:
    """An InterpreterFinder stand-in that counts look-ups."""

    def __init__(self, result: Interpreter | None) -> None:
        self.result = result
        self.calls = 0

    def find(self, pid: int) -> Interpreter | None:
        self.calls += 1
        return self.result


def test_processes_are_cached_by_pid_and_start_time_and_negatives_expire() -> None:
    now = [0.0]
    start = [100]
    finder = _FakeFinder(None)
    reader = PythonStacks(finder=finder, clock=lambda: now[0], start_time=lambda pid: start[0],  # type: ignore[arg-type]
                          negative_ttl_s=30)
    reader.read_process(4242)
    reader.read_process(4242)
    assert finder.calls == 1
    start[0] = 101  # the pid now names another process
    reader.read_process(4242)
    assert finder.calls == 2
    now[0] = 31.0  # a non-Python process may have exec'd one since
    reader.read_process(4242)
    assert finder.calls == 3
    assert reader.failures[NOT_PYTHON] == 2  # counted once per process, not per read
    reader.forget(4242)
    assert reader.cached_processes == 0


def test_processes_gone_are_forgotten_at_the_sweep() -> None:
    """Bounded by a count alone (1,024 processes), the cache held mostly processes
    gone under churn: `forget_gone` drops those, and a pid another process has now."""
    starts = {1: 100, 2: 200, 3: 300}
    reader = PythonStacks(finder=_FakeFinder(None), clock=lambda: 0.0,  # type: ignore[arg-type]
                          start_time=starts.get)
    for pid in starts:
        reader.read_process(pid)
    assert reader.cached_processes == 3
    del starts[1]  # gone
    starts[3] = 301  # the pid is another process's now
    assert reader.forget_gone(starts.get) == 2 and reader.cached_processes == 1
    assert reader.forget_gone(starts.get) == 0


@pytest.fixture(scope="module")
def fake_python(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The fake interpreter, built as `python3.11` with its symbols in .dynsym."""
    cc = shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        pytest.fail("no C compiler: run the README's test command (it installs gcc)")
    out = tmp_path_factory.mktemp("fake") / "python3.11"
    subprocess.run([cc, "-O1", "-rdynamic", "-o", str(out), str(WORKLOADS / "pystacks_fake_python.c")],
                   check=True)
    return out


class Image:
    """Writes for the fake interpreter's arena, laid out with the reader's own 3.11 table."""

    RUNTIME, INTERP, TSTATE, CFRAME, FRAME1, FRAME2, CODE, FILENAME, NAME, TABLE = (
        0x0, 0x1000, 0x2000, 0x3000, 0x4000, 0x4100, 0x5000, 0x6000, 0x6100, 0x6200)

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.layout = LAYOUTS[(3, 11)]

    def put(self, off: int, kind: str, value: str | int = "-") -> Image:
        """One write: see pystacks_fake_python.c for the kinds."""
        text = f"{value:x}" if isinstance(value, int) else value
        self.lines.append(f"{off:x} {kind} {text}")
        return self

    def string(self, off: int, text: str, *, length: int | None = None, state: int = 0x64) -> Image:
        """A compact ASCII str (state: ascii | compact | kind 1)."""
        lay = self.layout
        self.put(off + 8, "type", "unicode").put(off + lay.unicode_length, "u64", length or len(text))
        self.put(off + lay.unicode_state, "u32", state)
        return self.put(off + lay.unicode_ascii_size, "hex", text.encode().hex() + "00")

    def well_formed(self) -> Image:
        """One thread, two frames of `fake_function` at line 12 of /fake/app.py; GIL free."""
        lay = self.layout
        self.put(self.RUNTIME + lay.runtime_interpreters_head, "ptr", self.INTERP)
        self.put(self.INTERP + lay.interp_threads_head, "ptr", self.TSTATE)
        self.put(self.TSTATE + lay.tstate_interp, "ptr", self.INTERP)
        self.put(self.TSTATE + (lay.tstate_native_thread_id or 0), "tid")
        self.put(self.TSTATE + lay.tstate_frame, "ptr", self.CFRAME)
        self.put(self.CFRAME + (lay.cframe_current_frame or 0), "ptr", self.FRAME1)
        bytecode = self.CODE + (lay.code_adaptive or 0)
        for frame, back, entry in ((self.FRAME1, self.FRAME2, 0), (self.FRAME2, 0, 1)):
            self.put(frame + lay.frame_code, "ptr", self.CODE)
            if back:
                self.put(frame + lay.frame_back, "ptr", back)
            self.put(frame + (lay.frame_instr or 0), "ptr", bytecode + 2)
            self.put(frame + (lay.frame_is_entry or 0), "u8", entry)
        self.put(self.CODE + 8, "type", "code").put(self.CODE + lay.code_firstlineno, "u32", 10)
        self.put(self.CODE + lay.code_filename, "ptr", self.FILENAME)
        self.put(self.CODE + lay.code_name, "ptr", self.NAME).put(self.CODE + (lay.code_qualname or 0), "ptr",
                                                                 self.NAME)
        self.put(self.CODE + lay.code_linetable, "ptr", self.TABLE)
        self.string(self.FILENAME, "/fake/app.py").string(self.NAME, "fake_function")
        # A location table of one entry: 8 code units, "no columns" form, line +2.
        self.put(self.TABLE + 8, "type", "bytes").put(self.TABLE + lay.bytes_size, "u64", 2)
        return self.put(self.TABLE + lay.bytes_sval, "hex", "ef04")


@contextlib.contextmanager
def run_fake(binary: Path, image: Image) -> Iterator[int]:
    """The fake interpreter holding `image`; yields its pid."""
    proc = subprocess.Popen([str(binary)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write("\n".join(image.lines) + "\n")
        proc.stdin.close()
        assert proc.stdout.readline().strip() == "ready"
        yield proc.pid
    finally:
        proc.kill()
        proc.wait()


@needs_root
def test_the_fake_interpreter_well_formed_reads_as_python(fake_python: Path) -> None:
    """The positive control: the hostile cases below fail for what they hold, not for the fake."""
    with run_fake(fake_python, Image().well_formed()) as pid:
        result = PythonStacks().read_process(pid)
    assert result.failure is None and result.version == "3.11.2"
    frame = PyFrame("fake_function", "/fake/app.py", 12)
    assert result.threads[pid].frames == (frame, PyFrame("fake_function", "/fake/app.py", 12, entry=True))
    assert result.threads[pid].holds_gil is False and result.threads[pid].waits_for_gil is None


def _gil_taken_by_the_thread(img: Image) -> Image:
    lay = img.layout
    gil = img.RUNTIME + (lay.runtime_gil or 0)
    return img.put(gil + lay.gil_locked, "u32", 1).put(gil + lay.gil_last_holder, "ptr", img.TSTATE)


def _hostile(img: Image, change: Callable[[Image], Image]) -> Image:
    return change(img.well_formed())


L311 = LAYOUTS[(3, 11)]
# (id, change to the well-formed image, failure, frames read, truncated)
HOSTILE: list[tuple[str, Callable[[Image], Image], str | None, int | None, bool]] = [
    ("gil holder", _gil_taken_by_the_thread, None, 2, False),
    ("tstate list loops", lambda i: i.put(i.TSTATE + L311.tstate_next, "ptr", i.TSTATE),
     INCONSISTENT, 2, False),
    ("interpreter list loops", lambda i: i.put(i.INTERP + L311.interp_next, "ptr", i.INTERP), INCONSISTENT,
     2, False),
    ("frame chain loops", lambda i: i.put(i.FRAME2 + L311.frame_back, "ptr", i.FRAME1),
     INCONSISTENT, 2, True),
    ("frame chain into unmapped memory", lambda i: i.put(i.FRAME2 + L311.frame_back, "u64", 0x7FF0DEAD0000),
     INCONSISTENT, 2, True),
    ("frame chain into kernel space", lambda i: i.put(i.FRAME1 + L311.frame_back, "u64", 0xFFFF888000001000),
     INCONSISTENT, 1, True),
    ("tstate of another interpreter", lambda i: i.put(i.TSTATE + L311.tstate_interp, "ptr", i.CODE),
     INCONSISTENT, None, False),
    ("tid of no thread", lambda i: i.put(i.TSTATE + (L311.tstate_native_thread_id or 0), "u64", 1 << 40),
     INCONSISTENT, None, False),
    ("code object of the wrong type", lambda i: i.put(i.CODE + 8, "type", "bytes"), INCONSISTENT, 0, True),
    ("name of the wrong type", lambda i: i.put(i.NAME + 8, "type", "bytes"), INCONSISTENT, 0, True),
    ("str of an impossible kind", lambda i: i.put(i.NAME + L311.unicode_state, "u32", 0x2C), INCONSISTENT, 0,
     True),
    ("line table of garbage", lambda i: i.put(i.TABLE + L311.bytes_sval, "random", 2), None, 2, False),
    ("interpreter pointer to page zero", lambda i: i.put(L311.runtime_interpreters_head, "u64", 0x10),
     INCONSISTENT, None, False),
    ("runtime of random bytes", lambda i: i.put(0, "random", 0x8000), INCONSISTENT, None, False),
    ("no interpreter yet", lambda i: i.put(L311.runtime_interpreters_head, "u64", 0), None, None, False),
]


@needs_root
@pytest.mark.parametrize(("change", "failure", "frames", "truncated"),
                         [pytest.param(*h[1:], id=h[0]) for h in HOSTILE])
def test_hostile_interpreter_memory_is_refused_never_raised(
        fake_python: Path, change: Callable[[Image], Image], failure: str | None, frames: int | None,
        truncated: bool) -> None:
    reader = PythonStacks(budget_s=2.0)
    with run_fake(fake_python, _hostile(Image(), change)) as pid:
        started = time.monotonic()
        result = reader.read_process(pid)
        assert time.monotonic() - started < 1.0
    assert result.failure == failure, result
    if frames is None:
        assert result.threads == {}
    else:
        thread = result.threads[pid]
        assert len(thread.frames) == frames and thread.truncated == truncated
        assert all(isinstance(f.line, int) and f.line >= 0 for f in thread.frames)
    assert sum(reader.failures.values()) == (failure is not None)


@needs_root
def test_a_huge_string_length_is_capped(fake_python: Path) -> None:
    img = Image().well_formed().put(Image.NAME + L311.unicode_length, "u64", 1 << 62)
    with run_fake(fake_python, img) as pid:
        result = PythonStacks().read_process(pid)
    name = result.threads[pid].frames[0].function
    assert name.startswith("fake_function") and name.endswith("…") and len(name) == MAX_CHARS + 1


@needs_root
@pytest.mark.parametrize(("version", "cookie"), [
    (0x030702F0, None),  # 3.7: older than any table
    (0x030E00F0, None),  # 3.14 by Py_Version
    (0x030B02F0, 0x030E00F0),  # debug offsets of 3.14
    (0x030B02F0, 0x030D00F0),  # debug offsets of 3.13 full of garbage
])
def test_unsupported_versions_are_said_so(fake_python: Path, version: int, cookie: int | None) -> None:
    img = Image().well_formed().put(0, "version", version)
    if cookie is not None:
        img.put(0, "hex", DEBUG_COOKIE.hex() + cookie.to_bytes(8, "little").hex()).put(24, "random", 0x200)
    reader = PythonStacks()
    with run_fake(fake_python, img) as pid:
        result = reader.read_process(pid)
        assert reader.read(pid) == {}
    assert result.failure == UNSUPPORTED and not result.threads
    assert reader.failures == {UNSUPPORTED: 1}
    assert describe_failure(result).startswith("python stacks: unsupported version 3.")


def test_this_test_process_reads_its_own_blocked_thread() -> None:
    """No root needed to read oneself: a thread parked in a named function is found by its tid."""
    if sys.version_info[:2] not in LAYOUTS:
        pytest.skip("this Python has no layout table")
    release = threading.Event()
    tid: list[int] = []

    def parked_in_this_function() -> None:
        tid.append(threading.get_native_id())
        release.wait(30)

    t = threading.Thread(target=parked_in_this_function)
    t.start()
    try:
        reader = PythonStacks(budget_s=2.0)

        def parked() -> bool:
            frames = reader.read(os.getpid()).get(tid[0] if tid else -1, ())
            return any(f.function.endswith("parked_in_this_function") for f in frames)

        end = time.monotonic() + 10
        while not parked() and time.monotonic() < end:
            time.sleep(0.02)
        assert parked()
    finally:
        release.set()
        t.join()
