"""Only clean, file-backed compiler-library mappings may be dropped."""

from __future__ import annotations

from offtop.bpf.compiler_memory import _clean_compiler_mappings, _compiler_mapped, release_compiler_memory

SMAPS = """\
7f0000000000-7f0000100000 r-xp 00000000 fe:00 1 /usr/lib/x86_64-linux-gnu/libLLVM-14.so.1
Rss:                1000 kB
Private_Dirty:         0 kB
Anonymous:             0 kB
7f0000100000-7f0000200000 r--p 00100000 fe:00 1 /usr/lib/x86_64-linux-gnu/libLLVM-14.so.1
Rss:                1000 kB
Private_Dirty:       900 kB
Anonymous:           900 kB
7f0000200000-7f0000300000 r--p 00000000 fe:00 2 /usr/lib/llvm-14/lib/libclang-cpp.so.14
Rss:                 500 kB
Private_Dirty:         0 kB
Anonymous:             0 kB
7f0000300000-7f0000400000 r-xp 00000000 fe:00 3 /usr/lib/x86_64-linux-gnu/libc.so.6
Rss:                 500 kB
Private_Dirty:         0 kB
Anonymous:             0 kB
"""


def test_only_clean_llvm_and_clang_mappings_are_selected() -> None:
    assert _clean_compiler_mappings(SMAPS) == [
        (0x7F0000000000, 0x7F0000100000),
        (0x7F0000200000, 0x7F0000300000),
    ]


def test_smaps_is_read_only_when_a_compiler_library_is_mapped() -> None:
    assert _compiler_mapped(SMAPS)
    assert not _compiler_mapped("7f00-7f10 r-xp 00000000 fe:00 3 /usr/lib/x86_64-linux-gnu/libc.so.6\n")


def test_release_in_a_process_without_compiler_libraries_drops_nothing() -> None:
    """offtop no longer compiles in its own process: nothing of LLVM to give back."""
    import subprocess
    import sys

    code = ("from offtop.bpf.compiler_memory import release_compiler_memory as r; "
            "import sys; print(r(), 'bcc' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["0", "False"]
    assert release_compiler_memory() >= 0


def test_trim_heap_gives_freed_pages_inside_the_heap_back() -> None:
    """Memory freed below a live allocation stays resident until the heap is trimmed."""
    import subprocess
    import sys

    code = """
import ctypes
from offtop.bpf.compiler_memory import trim_heap
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
libc.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
def rss_mb():
    return int(open("/proc/self/statm").read().split()[1]) * 4096 / 2**20
blocks = [libc.malloc(64 * 1024) for _ in range(1024)]  # 64 MB, below the mmap threshold
for b in blocks:
    libc.memset(b, 1, 64 * 1024)
for b in blocks[:-1]:  # the last one pins the heap's top: nothing is returned by free
    libc.free(b)
before = rss_mb()
ok = trim_heap()
print(ok, round(before - rss_mb()))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    trimmed, freed_mb = out.stdout.split()
    assert trimmed == "True"
    assert int(freed_mb) >= 48, out.stdout  # of the ~64 MB freed
