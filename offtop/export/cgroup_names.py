"""Cgroup ids (as BPF's `bpf_get_current_cgroup_id` reports them) to paths.

On cgroup v2 a cgroup's id is the inode number of its directory, so a walk
of the cgroup2 mount names them all. The walk is cached and repeated on a
miss at most every `rescan_s` seconds, so a burst of unknown ids (a cgroup
removed since) costs one walk, not one per id.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

from offtop.cgroups import cgroup2_mounts


class CgroupNames:
    """`names(cgroup_id)` → the cgroup's path below the cgroup2 mount, or None."""

    def __init__(self, root: Path | None = None, *, rescan_s: float = 10.0,
                 clock: Callable[[], float] = time.monotonic, max_dirs: int = 200_000) -> None:
        if root is None:
            mounts = cgroup2_mounts()
            root = mounts[0] if mounts else None
        self._root = root
        self._rescan_s = rescan_s
        self._clock = clock
        self._max_dirs = max_dirs
        self._ids: dict[int, str] = {}
        self._scanned_at: float | None = None

    def _scan(self) -> None:
        self._scanned_at = self._clock()
        ids: dict[int, str] = {}
        if self._root is not None:
            root = str(self._root)
            for dirpath, dirnames, _ in os.walk(root):
                try:
                    ino = os.stat(dirpath).st_ino
                except OSError:
                    continue
                rel = os.path.relpath(dirpath, root)
                ids[ino] = "/" if rel == "." else "/" + rel
                if len(ids) >= self._max_dirs:
                    dirnames.clear()
                    break
        self._ids = ids

    def __call__(self, cgroup_id: int) -> str | None:
        name = self._ids.get(cgroup_id)
        if name is None and (self._scanned_at is None
                             or self._clock() - self._scanned_at >= self._rescan_s):
            self._scan()
            name = self._ids.get(cgroup_id)
        return name
