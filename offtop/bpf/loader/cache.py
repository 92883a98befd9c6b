"""Compiled artifacts on disk: named by what they were compiled from, trusted only if root's.

The key is a SHA-256 over everything the compiled instructions depend on:
the artifact format, the source, the -D flags, the kernel (release, build
string, machine, and the format files of the tracepoints the source
names, from which bcc generates the `args` structs), and bcc's version.
The kernel header tree is not in it: offcpu.c reads no kernel struct (see
its top comment), so every header tree compiles the same program.

A file is used only if every directory from / down is root's and not
writable by others (or sticky), the cache directory itself is root's and
0700, and the file is a regular file of root's with one link, not
writable by others; it is opened without following symlinks at any step.
Then its content must match its name (`artifact.decode`), and the libbcc
that compiled it must still be the one installed. Anything short of that
is a miss; the fresh compile replaces the file, written to a temporary
name and renamed over it, so a reader never sees half a file.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import os
import platform
import re
import stat
import time
from dataclasses import dataclass
from pathlib import Path

from offtop.bpf.loader.artifact import FORMAT, MAX_BYTES, Artifact, ArtifactInvalid, decode, encode

DEFAULT_DIR = Path("/var/cache/offtop")
SUFFIX = ".bpfo"
#: Artifacts kept: one per set of options used lately (and per kernel, until it is gone).
KEEP = 16
_TRACEPOINT = re.compile(r"TRACEPOINT_PROBE\(\s*(\w+)\s*,\s*(\w+)\s*\)")
_OPEN_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class Untrusted(OSError):
    """A path the cache must not use; the message says why."""


def bcc_version() -> str:
    """bcc's version, read from its Python package without importing it (that loads LLVM)."""
    try:
        spec = importlib.util.find_spec("bcc")
    except (ImportError, ValueError):  # a module without a spec stands in for it
        return "unknown"
    if spec is None or spec.origin is None:
        return "none"
    try:
        text = (Path(spec.origin).parent / "version.py").read_text()
    except OSError:
        return "unknown"
    m = re.search(r"__version__\s*=\s*['\"]([^'\"]+)['\"]", text)
    return m.group(1) if m else "unknown"


def tracepoint_formats(source: str, tracefs: Path | None) -> dict[str, str]:
    """SHA-256 of the format file of each tracepoint `source` names ('' where unreadable)."""
    out: dict[str, str] = {}
    for cat, name in sorted(set(_TRACEPOINT.findall(source))):
        digest = ""
        if tracefs is not None:
            with contextlib.suppress(OSError):
                digest = hashlib.sha256(
                    (tracefs / "events" / cat / name / "format").read_bytes()).hexdigest()
        out[f"{cat}:{name}"] = digest
    return out


def cache_key(source: str, cflags: list[str], tracefs: Path | None) -> str:
    """The name of the artifact compiled from `source` with `cflags` for this kernel and bcc."""
    u = os.uname()
    doc = {
        "format": FORMAT,
        "source": hashlib.sha256(source.encode()).hexdigest(),
        "cflags": cflags,
        "kernel": [u.release, u.version, platform.machine()],
        "tracepoints": tracepoint_formats(source, tracefs),
        "bcc": bcc_version(),
    }
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()


def _check_dir(fd: int, path: str, *, final: bool) -> None:
    st = os.fstat(fd)
    if st.st_uid != 0:
        raise Untrusted(f"{path} is not owned by root")
    if final:
        if stat.S_IMODE(st.st_mode) != 0o700:
            raise Untrusted(f"{path} has mode {stat.S_IMODE(st.st_mode):o}, not 700")
    elif st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
        raise Untrusted(f"{path} is writable by others")


def open_trusted_dir(path: Path, *, create: bool) -> int:
    """An fd of directory `path`, walked from / without following symlinks, each step checked.

    The last directory is made (root's, 0700) if missing and `create`.
    """
    if not path.is_absolute():
        raise Untrusted(f"{path} is not an absolute path")
    fd = os.open("/", _OPEN_DIR)
    try:
        _check_dir(fd, "/", final=False)
        parts = path.parts[1:]
        for i, part in enumerate(parts):
            last = i == len(parts) - 1
            try:
                nfd = os.open(part, _OPEN_DIR, dir_fd=fd)
            except FileNotFoundError:
                if not (last and create):
                    raise
                with contextlib.suppress(FileExistsError):
                    os.mkdir(part, 0o700, dir_fd=fd)
                nfd = os.open(part, _OPEN_DIR, dir_fd=fd)
            except OSError as e:  # ELOOP/ENOTDIR: a symlink or a file where a directory belongs
                raise Untrusted(f"{Path('/', *parts[:i + 1])}: {e.strerror}") from None
            os.close(fd)
            fd = nfd
            _check_dir(fd, str(Path("/", *parts[:i + 1])), final=last)
        return fd
    except BaseException:
        os.close(fd)
        raise


@dataclass(slots=True)
class Lookup:
    """What a cache look-up found: the artifact, or why there was none (for the log)."""

    artifact: Artifact | None
    why: str


class ArtifactCache:
    """A directory of artifacts (see the module docstring); every failure is a miss."""

    def __init__(self, directory: Path = DEFAULT_DIR, *, keep: int = KEEP) -> None:
        self.directory = directory
        self.keep = keep

    def path_of(self, key: str) -> Path:
        """Where the artifact for `key` lives."""
        return self.directory / f"{key}{SUFFIX}"

    def get(self, key: str) -> Lookup:
        """The artifact for `key`, if there is one this process can trust."""
        if os.geteuid() != 0:
            return Lookup(None, "not root: no cache")
        try:
            dfd = open_trusted_dir(self.directory, create=False)
        except FileNotFoundError:
            return Lookup(None, "no cache directory yet")
        except OSError as e:
            return Lookup(None, f"cache directory unusable: {e}")
        try:
            name = f"{key}{SUFFIX}"
            try:
                fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                             dir_fd=dfd)
            except FileNotFoundError:
                return Lookup(None, "miss")
            except OSError as e:
                return Lookup(None, f"cannot open {name}: {e.strerror}")
            try:
                st = os.fstat(fd)
                why = _untrusted_file(st)
                if why:
                    return Lookup(None, f"{name} {why}")
                with os.fdopen(os.dup(fd), "rb") as f:
                    data = f.read(MAX_BYTES + 1)
            finally:
                os.close(fd)
            try:
                art = decode(data, key)
            except ArtifactInvalid as e:
                return Lookup(None, f"{name}: {e}")
            why = _compiler_changed(art)
            if why:
                return Lookup(None, f"{name}: {why}")
            with contextlib.suppress(OSError):  # recently used: kept longest (see _prune)
                os.utime(name, dir_fd=dfd, follow_symlinks=False)
            return Lookup(art, "hit")
        finally:
            os.close(dfd)

    def put(self, art: Artifact) -> str:
        """Store `art` atomically; '' or why it could not be (the run goes on without)."""
        if os.geteuid() != 0:
            return "not root"
        try:
            dfd = open_trusted_dir(self.directory, create=True)
        except OSError as e:
            return f"cache directory unusable: {e}"
        name = f"{art.key}{SUFFIX}"
        tmp = f".{name}.{os.getpid()}.{time.monotonic_ns()}.tmp"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                         0o600, dir_fd=dfd)
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(encode(art))
                # No fsync: a file cut short by a crash fails its hash and is a miss.
                os.rename(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp, dir_fd=dfd)
                raise
            self._prune(dfd, keep_name=name)
            return ""
        except OSError as e:
            return f"cannot write {self.path_of(art.key)}: {e.strerror or e}"
        finally:
            os.close(dfd)

    def discard(self, key: str) -> None:
        """Remove the artifact for `key` (the kernel refused it)."""
        try:
            dfd = open_trusted_dir(self.directory, create=False)
        except OSError:
            return
        try:
            with contextlib.suppress(OSError):
                os.unlink(f"{key}{SUFFIX}", dir_fd=dfd)
        finally:
            os.close(dfd)

    def _prune(self, dfd: int, keep_name: str) -> None:
        """Keep the `keep` most recently used artifacts; drop temporary files an hour old."""
        now = time.time()
        found: list[tuple[float, str]] = []
        for name in os.listdir(dfd):
            try:
                st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
            except OSError:
                continue
            if name.endswith(".tmp") and name.startswith(".") and now - st.st_mtime > 3600:
                with contextlib.suppress(OSError):
                    os.unlink(name, dir_fd=dfd)
            elif name.endswith(SUFFIX) and name != keep_name:
                found.append((st.st_mtime, name))
        found.sort(reverse=True)
        for _, name in found[max(0, self.keep - 1):]:
            with contextlib.suppress(OSError):
                os.unlink(name, dir_fd=dfd)


def _untrusted_file(st: os.stat_result) -> str:
    """Why a cache file must not be used ('' if it may)."""
    if not stat.S_ISREG(st.st_mode):
        return "is not a regular file"
    if st.st_uid != 0:
        return "is not owned by root"
    if st.st_mode & 0o022:
        return "is writable by others"
    if st.st_nlink != 1:
        return "has other links"
    if st.st_size > MAX_BYTES:
        return "is too large"
    return ""


def _compiler_changed(art: Artifact) -> str:
    """Why the libbcc that compiled `art` is not the one installed now ('' if it is)."""
    c = art.compiler
    try:
        st = os.stat(c.libbcc_path)
    except OSError:
        return f"{c.libbcc_path} is gone"
    if (st.st_size, st.st_mtime_ns) != (c.libbcc_size, c.libbcc_mtime_ns):
        return f"{c.libbcc_path} changed since it compiled this"
    return ""
