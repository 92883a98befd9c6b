"""glibc's malloc, told not to hold on to freed memory that offtop's churn leaves behind.

Python keeps objects under 512 bytes in its own arenas and hands everything
larger to malloc: dict and set tables, lists, bytes read from maps and
files. offtop frees and remakes such objects every interval (each
interval's rows, its dicts of 10,000 keys, the maps read in bulk). glibc's
defaults serve that badly on a busy server:

- **Its threshold for serving an allocation with its own mapping moves.**
  It starts at 128 KiB, and each time a mapped block is freed it rises to
  that block's size (up to 32 MiB). After the first few large tables are
  freed, every large table comes from the heap instead, and its hole stays
  there once it is freed, split by whatever smaller block lands in it.
- **Each thread that allocates gets a heap of its own** (up to eight per
  CPU): the engine's thread and the TUI's threads each fragment their own.

Measured on the busy server (bench/README.md), the TUI after 4 minutes: 53
MiB of malloc's heaps of which 17.6 MiB free, in 1,543 holes that
`malloc_trim` could not give back (2.5 MiB returned), while the objects
alive stayed at ~55 MiB from the 2nd minute to the 9th; the process grew
~0.6 MiB a minute and was at 148.2 MiB after 10 minutes. With a fixed
threshold and two heaps: 1.7 MiB free, large blocks mapped and unmapped as
they come and go, and 138.1 MiB after 10 minutes. CPU and start-up the same.

`mallopt` is glibc's public interface; where it is missing (another libc)
nothing is changed.
"""

from __future__ import annotations

import ctypes

from offtop.bpf import syscalls

#: mallopt's parameters (glibc's <malloc.h>).
M_MMAP_THRESHOLD = -3
M_ARENA_MAX = -8

#: Blocks at least this large get a mapping of their own, returned when freed.
#: glibc's own starting value, fixed: setting it stops the threshold moving.
MMAP_THRESHOLD = 128 * 1024
#: Heaps at most: offtop's Python threads take the GIL in turn anyway.
ARENA_MAX = 2


def tune_malloc() -> bool:
    """Fix malloc's mapping threshold and cap its heaps (see the module
    docstring); True if glibc took both. Before offtop's threads start."""
    try:
        mallopt = syscalls.libc().mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    # mallopt returns 1 on success, 0 on a parameter it refuses.
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) & mallopt(M_ARENA_MAX, ARENA_MAX))
