"""Finding and validating the cgroup v2 directory a user names with -c."""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path


class CgroupError(ValueError):
    """A -c argument offtop cannot use; the message is one line for users."""


@dataclass(frozen=True, slots=True)
class Mount:
    """One line of /proc/self/mountinfo, the parts offtop needs."""

    point: Path
    fstype: str
    options: str


def mounts(mountinfo: str = "/proc/self/mountinfo") -> list[Mount]:
    """Mounted filesystems, in mount order."""
    out: list[Mount] = []
    try:
        text = Path(mountinfo).read_text()
    except OSError:
        return out
    for line in text.splitlines():
        left, _, right = line.partition(" - ")
        fields = left.split()
        rfields = right.split()
        if len(fields) < 5 or len(rfields) < 3:
            continue
        point = fields[4].replace("\\040", " ")
        out.append(Mount(Path(point), rfields[0], rfields[2]))
    return out


def cgroup2_mounts(mountinfo: str = "/proc/self/mountinfo") -> list[Path]:
    """Where cgroup v2 is mounted (often /sys/fs/cgroup or /sys/fs/cgroup/unified)."""
    return [m.point for m in mounts(mountinfo) if m.fstype == "cgroup2"]


def _mount_of(path: Path, mountinfo: str) -> Mount | None:
    best: Mount | None = None
    for m in mounts(mountinfo):
        under = path == m.point or m.point in path.parents
        if under and (best is None or len(str(m.point)) >= len(str(best.point))):
            best = m
    return best


def _v2_path_of_members(v1_dir: Path, mountinfo: str) -> str | None:
    """Where the tasks of a cgroup v1 directory live in the v2 hierarchy."""
    v2 = cgroup2_mounts(mountinfo)
    if not v2:
        return None
    try:
        pids = (v1_dir / "cgroup.procs").read_text().split()
    except OSError:
        return None
    for pid in pids[:64]:  # the first ones may exit while we look
        try:
            for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
                if line.startswith("0::"):
                    return str(v2[0] / line[3:].lstrip("/"))
        except OSError:
            continue
    return None


def _is_dir(p: Path) -> bool:
    """Like Path.is_dir, but a directory offtop may not look into is a `CgroupError`."""
    try:
        return stat.S_ISDIR(os.stat(p).st_mode)
    except PermissionError:
        raise CgroupError(f"cannot access cgroup {p}: permission denied") from None
    except OSError:
        return False


def resolve_cgroup(arg: str, *, mountinfo: str = "/proc/self/mountinfo") -> Path:
    """The absolute cgroup v2 directory `arg` names, or a `CgroupError`.

    `arg` may be absolute (/sys/fs/cgroup/app) or relative to the cgroup v2
    mount (app, /app). cgroup v1 paths are refused with the v2 path of their
    tasks, when there is one: offtop filters in the kernel by cgroup v2.
    """
    if not arg or "\0" in arg:
        raise CgroupError("empty cgroup path")
    given = Path(arg)
    # A relative name means the cgroup v2 tree first (-c app), the working
    # directory only when no cgroup has that name.
    candidates = [root / arg.lstrip("/") for root in cgroup2_mounts(mountinfo)]
    if given.is_absolute():
        candidates.insert(0, given)
    else:
        candidates.append(given)
    path = next((c for c in candidates if _is_dir(c)), None)
    if path is None:
        if any(os.path.lexists(c) for c in candidates):
            raise CgroupError(f"cgroup {arg} is not a directory")
        raise CgroupError(f"cgroup {arg} does not exist")
    path = path.resolve()
    if not path.is_dir():
        raise CgroupError(f"cgroup {arg} is not a directory")
    m = _mount_of(path, mountinfo)
    if m is None or m.fstype not in ("cgroup", "cgroup2"):
        raise CgroupError(f"{arg} is not a cgroup directory (not on a cgroup filesystem)")
    if m.fstype == "cgroup":
        hint = _v2_path_of_members(path, mountinfo)
        where = f"; its tasks are in the v2 cgroup {hint}" if hint else ""
        v2 = cgroup2_mounts(mountinfo)
        mounted = f" (cgroup v2 is mounted at {v2[0]})" if v2 and not hint else ""
        raise CgroupError(
            f"{arg} is a cgroup v1 directory: offtop filters by cgroup v2{where}{mounted}"
        )
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        os.close(fd)
    except OSError as e:
        raise CgroupError(f"cannot open cgroup {arg}: {e.strerror}") from None
    return path
