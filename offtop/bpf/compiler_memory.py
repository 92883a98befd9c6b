"""Give back memory that compiler libraries hold but will not use: pages loading them touched.

Run in the compiler process (`loader/bcc_child.py`) right after libbcc is
loaded: dlopen's relocations and LLVM's static constructors fault in ~34 MB
of clean pages of libLLVM and libclang that the compile mostly never reads
again, and they would count in that process's RSS, on top of offtop's, for
the whole compile. offtop itself maps no compiler library any more (it
neither compiles nor imports bcc), so there the call (engine start-up) only
trims the heap. Pages are dropped with MADV_DONTNEED, but only on mappings
whose pages are all clean and file-backed, which the kernel reads back from
the file if they are touched again. Relocated (dirty) pages are never
dropped: discarding them would revert them to the file's unrelocated
contents. Standard library only: the compiler process imports nothing of
offtop's package.
"""

from __future__ import annotations

import ctypes
import functools
import re

MADV_DONTNEED = 4
_COMPILER_LIBS = re.compile(r"/lib(LLVM|clang)[^/]*\.so")
_RANGE = re.compile(r"^([0-9a-f]+)-([0-9a-f]+) ")


def _clean_compiler_mappings(smaps: str) -> list[tuple[int, int]]:
    """Address ranges of compiler libraries with no dirty or anonymous pages."""
    out: list[tuple[int, int]] = []
    cur: dict[str, str] | None = None
    rows: list[dict[str, str]] = []
    for line in smaps.splitlines():
        m = _RANGE.match(line)
        if m:
            parts = line.split()
            cur = {"start": m.group(1), "end": m.group(2), "path": parts[5] if len(parts) > 5 else ""}
            rows.append(cur)
        elif cur is not None and ":" in line:
            key, _, rest = line.partition(":")
            cur[key] = rest.split()[0] if rest.split() else ""
    for r in rows:
        if (_COMPILER_LIBS.search(r["path"]) and r.get("Private_Dirty") == "0"
                and r.get("Anonymous") == "0"):
            out.append((int(r["start"], 16), int(r["end"], 16)))
    return out


def _compiler_mapped(maps: str) -> bool:
    """Whether /proc/self/maps shows a compiler library (smaps, 10x longer, only then)."""
    return _COMPILER_LIBS.search(maps) is not None


@functools.cache
def _libc() -> ctypes.CDLL:
    """The process's own symbols, libc's among them (loaded once)."""
    return ctypes.CDLL(None, use_errno=True)


def trim_heap() -> bool:
    """Give the C heap's free pages back to the system: glibc's malloc_trim, which
    walks every arena (each thread that allocates may get one) and returns whole
    free pages inside them too, not only the top. Freed memory is otherwise kept
    at its high-water mark, and the engine's churn (rows, stacks and maps of
    processes come and gone) raises it. False where libc has none (musl)."""
    libc = _libc()
    if not hasattr(libc, "malloc_trim"):
        return False
    libc.malloc_trim(0)
    return True


def release_compiler_memory() -> int:
    """Trim the heap and drop clean compiler-library pages; return ranges dropped."""
    trim_heap()
    libc = _libc()
    try:
        with open("/proc/self/maps") as f:
            if not _compiler_mapped(f.read()):
                return 0
        with open("/proc/self/smaps") as f:
            ranges = _clean_compiler_mappings(f.read())
    except OSError:
        return 0
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return sum(libc.madvise(a, b - a, MADV_DONTNEED) == 0 for a, b in ranges)
