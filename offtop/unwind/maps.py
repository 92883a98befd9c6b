"""A process's executable file mappings, from /proc/PID/maps.

The unwinder's own reader (not the symbolizer's): a stack walk needs each
mapping's file offset and a path it can open even when the binary was
deleted or lives in another mount namespace (/proc/PID/map_files/START-END).
"""

from __future__ import annotations

from dataclasses import dataclass

#: /proc/PID/maps of a process with a huge number of mappings is read only this far.
MAX_MAPS_BYTES = 8 << 20


@dataclass(frozen=True, slots=True)
class ExecMapping:
    """One executable file mapping: [start, end) maps the file from `offset`."""

    start: int
    end: int
    offset: int
    path: str  #: as maps shows it, " (deleted)" included
    handle: str  #: what to open: /proc/PID/map_files/START-END
    ident: tuple[int, int] | None = None  #: never a path here (see FileMapping)


def parse_maps(text: str, pid: int, proc: str = "/proc") -> list[ExecMapping]:
    """Executable file mappings in the text of a maps file, sorted by address."""
    out: list[ExecMapping] = []
    for line in text.splitlines():
        parts = line.split(None, 5)
        if len(parts) < 6 or len(parts[1]) < 3 or parts[1][2] != "x" or not parts[5].startswith("/"):
            continue
        lo, _, hi = parts[0].partition("-")
        try:
            start, end, offset = int(lo, 16), int(hi, 16), int(parts[2], 16)
        except ValueError:
            continue
        if start < end:
            # map_files names have no leading zeros, unlike maps (00400000-…):
            # a non-PIE binary's mapping is /proc/PID/map_files/400000-….
            handle = f"{proc}/{pid}/map_files/{start:x}-{end:x}"
            out.append(ExecMapping(start, end, offset, parts[5], handle))
    out.sort(key=lambda m: m.start)
    return out


def read_exec_maps(pid: int, proc: str = "/proc") -> list[ExecMapping]:
    """The executable file mappings of a process ([] when it is gone or hidden)."""
    try:
        with open(f"{proc}/{pid}/maps", errors="replace") as f:
            text = f.read(MAX_MAPS_BYTES)
    except OSError:
        return []
    return parse_maps(text, pid, proc)
