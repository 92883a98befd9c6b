"""What offtop needs from the machine, checked before anything is compiled.

Each check either fixes what it safely can (mount tracefs as root, assemble a
header tree bcc can read) or raises `EnvironmentProblem` with one line that
says what is missing and how to get it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import importlib.util
import os
import platform
import resource
import shutil
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

TRACEFS_DIRS = (Path("/sys/kernel/tracing"), Path("/sys/kernel/debug/tracing"))
HEADER_CACHE = Path("/run/offtop/kernel-headers")

# Capability bits (linux/capability.h).
CAP_SYS_ADMIN = 21
CAP_PERFMON = 38
CAP_BPF = 39

_DEBIAN_ARCH = {"x86_64": "amd64", "aarch64": "arm64", "armv7l": "armhf", "ppc64le": "ppc64el",
                "s390x": "s390x", "riscv64": "riscv64", "i686": "i386"}
_KERNEL_ARCH_DIR = {"x86_64": "x86", "i686": "x86", "aarch64": "arm64", "armv7l": "arm",
                    "ppc64le": "powerpc", "s390x": "s390", "riscv64": "riscv"}


class EnvironmentProblem(RuntimeError):
    """Something the machine lacks; the message is one line for users."""


def debian_arch() -> str:
    """The Debian architecture name of this machine (amd64, arm64, ...)."""
    return _DEBIAN_ARCH.get(platform.machine(), platform.machine())


def headers_package() -> str:
    """The Debian package that brings a usable kernel header tree."""
    return f"linux-headers-{debian_arch()}"


# --- privileges ------------------------------------------------------------


def effective_caps() -> int:
    """The effective capability set of this process, as a bit mask."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("CapEff:"):
                return int(line.split()[1], 16)
    except OSError:
        pass
    return 0


def check_privileges(*, euid: int | None = None, caps: int | None = None) -> None:
    """Root, or CAP_BPF with CAP_PERFMON (or CAP_SYS_ADMIN); never escalate."""
    euid = os.geteuid() if euid is None else euid
    caps = effective_caps() if caps is None else caps

    def has(bit: int) -> bool:
        return bool(caps >> bit & 1)

    if euid == 0 and has(CAP_SYS_ADMIN):
        return
    if has(CAP_SYS_ADMIN) or (has(CAP_BPF) and has(CAP_PERFMON)):
        return
    raise EnvironmentProblem(
        "offtop needs root (or CAP_BPF and CAP_PERFMON) to load its BPF program: "
        "run it with sudo"
    )


# --- tracefs ---------------------------------------------------------------


def _exists(p: Path) -> bool:
    try:
        return p.exists()
    except OSError:  # EACCES: tracefs is 0700, root's
        return False


def tracefs_dir(dirs: tuple[Path, ...] = TRACEFS_DIRS) -> Path | None:
    """The mounted tracefs with the sched_switch tracepoint, if any."""
    for d in dirs:
        if _exists(d / "events" / "sched" / "sched_switch" / "format"):
            return d
    return None


def _mount_tracefs(target: Path) -> int:
    """mount -t tracefs nodev `target`; 0 or an errno."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    if libc.mount(b"nodev", str(target).encode(), b"tracefs", 0, None) != 0:
        return ctypes.get_errno() or errno.EPERM
    return 0


def ensure_tracefs(
    dirs: tuple[Path, ...] = TRACEFS_DIRS,
    *,
    mount: Callable[[Path], int] = _mount_tracefs,
    can_mount: bool | None = None,
) -> Path:
    """Find tracefs, mounting it at dirs[0] when root and missing."""
    found = tracefs_dir(dirs)
    if found:
        return found
    for d in dirs:
        try:
            os.stat(d / "events")
        except PermissionError:
            raise EnvironmentProblem(
                f"cannot read tracefs at {d} (permission denied): run offtop as root"
            ) from None
        except OSError:
            pass
    target = dirs[0]
    if can_mount is None:
        can_mount = os.geteuid() == 0
    if not can_mount:
        raise EnvironmentProblem(
            f"tracefs is not mounted: as root, run 'mount -t tracefs nodev {target}' "
            "(offtop does it itself when run as root)"
        )
    if _exists(target) and target.is_dir() and not any(target.iterdir()):
        err = mount(target)
        if err:
            raise EnvironmentProblem(
                f"tracefs is not mounted and mounting it failed ({os.strerror(err)}): "
                f"run 'mount -t tracefs nodev {target}' as root"
            )
        found = tracefs_dir(dirs)
        if found:
            return found
    if (target / "events").is_dir():
        raise EnvironmentProblem(
            "the sched:sched_switch tracepoint is missing from tracefs: "
            "this kernel lacks CONFIG_TRACEPOINTS/CONFIG_SCHEDSTATS events"
        )
    raise EnvironmentProblem(
        f"tracefs is not available: mount it with 'mount -t tracefs nodev {target}' "
        "(needs a kernel with CONFIG_TRACING)"
    )


# --- the BPF syscall ---------------------------------------------------------


def _create_array_map() -> tuple[int, int]:
    """bpf(BPF_MAP_CREATE) of a one-slot array: (fd, 0) or (-1, errno); (-2, 0) if unknown."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    nr = {"x86_64": 321, "aarch64": 280, "riscv64": 280, "s390x": 351, "ppc64le": 361}.get(
        platform.machine()
    )
    if nr is None:
        return (-2, 0)  # unknown syscall number: let bcc find out

    class _MapCreate(ctypes.Structure):
        _fields_ = [("map_type", ctypes.c_uint32), ("key_size", ctypes.c_uint32),
                    ("value_size", ctypes.c_uint32), ("max_entries", ctypes.c_uint32),
                    ("pad", ctypes.c_uint8 * 112)]

    attr = _MapCreate(map_type=2, key_size=4, value_size=8, max_entries=1)  # BPF_MAP_TYPE_ARRAY
    fd = libc.syscall(nr, 0, ctypes.byref(attr), ctypes.sizeof(attr))  # BPF_MAP_CREATE
    return (fd, 0) if fd >= 0 else (-1, ctypes.get_errno())


def check_bpf_syscall(create_map: Callable[[], tuple[int, int]] = _create_array_map) -> None:
    """Create and free a one-slot array map: proves the bpf() syscall works."""
    fd, err = create_map()
    if fd >= 0:
        os.close(fd)
        return
    if fd == -2:
        return
    if err == errno.ENOSYS:
        raise EnvironmentProblem("this kernel has no BPF support (CONFIG_BPF_SYSCALL is off)")
    if err == errno.EPERM:
        raise EnvironmentProblem(
            "the kernel refused to create a BPF map (EPERM): run as root, and check "
            "kernel.unprivileged_bpf_disabled and any LSM policy"
        )
    raise EnvironmentProblem(f"the bpf() syscall failed: {os.strerror(err)}")


# --- the view from this process ------------------------------------------------

#: The inode number of the initial pid namespace (PROC_PID_INIT_INO in
#: include/linux/proc_ns.h, fixed since Linux 3.8).
PROC_PID_INIT_INO = 0xEFFFFFFC

#: Below this address-space limit bcc cannot compile: LLVM and clang map
#: ~400 MB at peak (measured: a batch run peaks at 396 MB of VmPeak, and with
#: `ulimit -v` at 360 MB LLVM aborts the process without a word).
MIN_ADDRESS_SPACE = 512 << 20

# How the dynamic loader says mmap() failed (ENOMEM under `ulimit -v`).
_MAP_FAILURES = ("failed to map segment", "cannot map zero-fill pages", "cannot allocate memory")


def check_pid_namespace(ns_link: Path = Path("/proc/self/ns/pid")) -> None:
    """Refuse to run in any pid namespace but the initial one.

    The tracepoint reports pids as the initial namespace numbers them: inside
    a container they would name other processes, or none, and `-p` would
    match nothing. Translating them (bpf_get_ns_current_pid_tgid covers only
    the current task, not the one switched in) is not worth a silent error.
    """
    try:
        ino = os.stat(ns_link).st_ino
    except FileNotFoundError:
        raise EnvironmentProblem(
            f"{ns_link} is missing: offtop needs /proc (mount -t proc proc /proc)") from None
    except OSError as e:
        raise EnvironmentProblem(f"cannot read {ns_link}: {e.strerror}") from None
    if ino != PROC_PID_INIT_INO:
        raise EnvironmentProblem(
            f"offtop is running in a pid namespace of its own (pid:[{ino}], e.g. a container "
            "or unshare --pid): the kernel reports the host's pids, which this namespace "
            "cannot name; run offtop in the host's pid namespace (nsenter -t 1 -p -m offtop)")


def proc_mount_options(mountinfo: Path = Path("/proc/self/mountinfo")) -> set[str]:
    """The superblock options of the proc file system mounted at /proc (empty if unknown)."""
    try:
        text = mountinfo.read_text()
    except OSError:
        return set()
    options: set[str] = set()
    for line in text.splitlines():  # the last mount at /proc is the one on top
        fields, _, fs = line.partition(" - ")
        parts, fs_parts = fields.split(), fs.split()
        if len(parts) > 4 and parts[4] == "/proc" and fs_parts[:1] == ["proc"]:
            options = set(fs_parts[2].split(",")) if len(fs_parts) > 2 else set()
    return options


def check_proc(*, kernel_stacks: bool, proc: Path = Path("/proc"),
               mountinfo: Path = Path("/proc/self/mountinfo")) -> None:
    """/proc shows what offtop reads: kernel symbols (for kernel stacks) and the pid directories."""
    if not kernel_stacks or _exists(proc / "kallsyms"):
        return
    if "subset=pid" in proc_mount_options(mountinfo):
        raise EnvironmentProblem(
            f"{proc} is mounted with subset=pid, which hides {proc}/kallsyms, where offtop "
            "names kernel frames: use --no-kernel-stacks, or mount a full /proc "
            "(mount -t proc proc /proc)")
    raise EnvironmentProblem(
        f"{proc}/kallsyms is missing: offtop names kernel frames from it; mount a full /proc "
        "(mount -t proc proc /proc) or use --no-kernel-stacks")


def address_space_limit() -> int | None:
    """The soft RLIMIT_AS (`ulimit -v`) in bytes, or None when unlimited."""
    soft = resource.getrlimit(resource.RLIMIT_AS)[0]
    return None if soft == resource.RLIM_INFINITY else soft


def memory_problem(doing: str) -> str:
    """One line for running out of memory while `doing` something."""
    limit = address_space_limit()
    cap = "unlimited" if limit is None else f"{limit >> 20} MiB"
    return (f"out of memory {doing}: offtop needs about {MIN_ADDRESS_SPACE >> 20} MiB of "
            f"address space while bcc compiles (ulimit -v is {cap}); raise the limit "
            "(ulimit -v unlimited) or free memory")


def check_address_space(limit: int | None) -> None:
    """Refuse an address-space limit (bytes, None: unlimited) bcc's compiler cannot work in.

    Above it, a shortage still ends in `memory_problem`; below it, LLVM would
    abort the process without a word.
    """
    if limit is not None and limit < MIN_ADDRESS_SPACE:
        raise EnvironmentProblem(
            f"the address-space limit (ulimit -v) is {limit >> 20} MiB: offtop needs at "
            f"least {MIN_ADDRESS_SPACE >> 20} MiB, since bcc compiles its BPF program with "
            "LLVM inside the process; raise it (ulimit -v unlimited)")


def check_host_view(*, kernel_stacks: bool) -> None:
    """What must hold before any pid given by the user is looked up (see cli)."""
    check_pid_namespace()
    check_proc(kernel_stacks=kernel_stacks)
    check_address_space(address_space_limit())


# --- bcc -----------------------------------------------------------------


def _bcc_problem(e: BaseException) -> EnvironmentProblem:
    """What an ImportError, OSError or MemoryError from bcc's bindings means, in one line."""
    if isinstance(e, MemoryError):
        return EnvironmentProblem(memory_problem("loading bcc"))
    if isinstance(e, OSError):  # libbcc.so itself missing or broken, or no room to map it
        if any(m in str(e).lower() for m in _MAP_FAILURES):
            return EnvironmentProblem(memory_problem(f"loading bcc's library ({e})"))
        return EnvironmentProblem(f"bcc's library could not be loaded ({e}): reinstall libbpfcc")
    return EnvironmentProblem(
        "bcc's Python bindings are missing: install python3-bpfcc "
        "(apt-get install python3-bpfcc) and use /usr/bin/python3 or a venv made "
        "with --system-site-packages"
    )


def check_bcc_installed() -> None:
    """bcc's Python bindings are there to be found (python3-bpfcc), without loading them.

    Importing bcc maps libbcc with libLLVM and libclang, ~55 MB resident,
    and a program from the cache needs none of it: only the compiler
    process on a miss loads libbcc, and a library that fails to load there
    is reported by `check_bcc_importable`.
    """
    try:
        spec = importlib.util.find_spec("bcc")
    except (ImportError, OSError, MemoryError) as e:
        raise _bcc_problem(e) from None
    if spec is None:
        raise _bcc_problem(ModuleNotFoundError("No module named 'bcc'"))


def check_bcc_importable() -> None:
    """bcc's Python bindings come from the distro, not PyPI; this imports them (and LLVM)."""
    try:
        import bcc  # noqa: F401
    except (ImportError, OSError, MemoryError) as e:
        raise _bcc_problem(e) from None


# --- kernel headers ------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class HeaderChoice:
    """Which header tree bcc compiles against, and why."""

    kind: str
    path: Path | None  # None: bcc finds it by itself (running kernel's tree, kheaders)
    source_env: str | None  # value for BCC_KERNEL_SOURCE, or None to leave it alone


def _has_includes(tree: Path) -> bool:
    return (tree / "include" / "linux").is_dir()


def _version_key(name: str) -> tuple[int, ...]:
    digits = []
    for part in name.replace("linux-headers-", "").replace("-", ".").split("."):
        if part.isdigit():
            digits.append(int(part))
    return tuple(digits)


def find_kernel_headers(
    *, release: str | None = None, usr_src: Path = Path("/usr/src"),
    modules: Path = Path("/lib/modules"), cache: Path = HEADER_CACHE,
    env: Mapping[str, str] | None = None,
    kheaders: Path = Path("/sys/kernel/kheaders.tar.xz"),
) -> HeaderChoice:
    """Find a header tree: BCC_KERNEL_SOURCE, the running kernel's, kheaders, distro headers.

    BCC_KERNEL_SOURCE comes first because bcc itself obeys it whenever it is
    set: a bad value must be reported here, not as a compiler error later.
    offtop's BPF program reads no kernel struct, so any kernel's headers do.
    Debian splits a tree into `-<arch>` (generated headers) and `-common`
    (the rest); bcc expects one tree, so the two are joined by a symlink farm
    under /run/offtop, never under /lib/modules.
    """
    release = release or platform.release()
    env = os.environ if env is None else env
    user_tree = env.get("BCC_KERNEL_SOURCE")
    if user_tree:
        p = Path(user_tree)
        if not _has_includes(p):
            raise EnvironmentProblem(
                f"BCC_KERNEL_SOURCE={user_tree} has no include/linux directory: unset it, "
                f"or point it at a kernel header tree (e.g. from {headers_package()})"
            )
        return HeaderChoice("BCC_KERNEL_SOURCE", p, str(p))
    build = modules / release / "build"
    if _has_includes(build):
        return HeaderChoice("running kernel", build, None)
    if kheaders.exists():
        return HeaderChoice("kheaders", None, None)
    arch = debian_arch()
    candidates = sorted(
        (d for d in usr_src.glob("linux-headers-*")
         if d.is_dir() and not d.name.endswith("-common")),
        key=lambda d: (d.name.endswith(f"-{arch}"), _version_key(d.name)),
        reverse=True,
    )
    for tree in candidates:
        if _has_includes(tree) and (tree / "include" / "generated").is_dir():
            return HeaderChoice("distro headers", tree, str(tree))
        common = tree.with_name(tree.name.rsplit("-", 1)[0] + "-common")
        if _has_includes(common) and (tree / "include" / "generated").is_dir():
            try:
                merged = _merge_debian_tree(tree, common, cache)
            except OSError as e:
                raise EnvironmentProblem(_cache_problem(cache, e)) from None
            return HeaderChoice(f"distro headers ({tree.name})", merged, str(merged))
    raise EnvironmentProblem(
        f"no kernel headers found for bcc: install {headers_package()} "
        f"(apt-get install {headers_package()}; any version works)"
    )


def _cache_problem(cache: Path, e: OSError) -> str:
    """Why the header tree could not be assembled under `cache`, naming what is in the way."""
    blocker = next((p for p in (cache, *cache.parents) if p.exists() and not p.is_dir()), None)
    fix = f"or set BCC_KERNEL_SOURCE to a kernel header tree (e.g. from {headers_package()})"
    if blocker is not None:
        return (f"{blocker} is not a directory: offtop joins Debian's split kernel headers "
                f"under {cache}; move it away, {fix}")
    where = f" ({e.filename})" if e.filename else ""
    return f"cannot join the kernel headers under {cache}: {e.strerror or e}{where}; {fix}"


def _link_children(src: Path, dst: Path, skip: set[str] = frozenset()) -> None:  # type: ignore[assignment]
    for child in src.iterdir():
        if child.name not in skip and not (dst / child.name).exists():
            (dst / child.name).symlink_to(child)


def _merge_debian_tree(arch_tree: Path, common: Path, cache: Path) -> Path:
    """Join Debian's split header packages into one tree of symlinks."""
    dest = cache / arch_tree.name
    stamp = dest / ".offtop-complete"
    if stamp.exists():
        return dest
    cache.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{arch_tree.name}.", dir=cache))
    try:
        karch = _KERNEL_ARCH_DIR.get(platform.machine(), "x86")
        _link_children(common, tmp, {"include", "arch"})
        _link_children(arch_tree, tmp, {"include", "arch"})
        (tmp / "include").mkdir()
        _link_children(arch_tree / "include", tmp / "include")  # generated, config
        _link_children(common / "include", tmp / "include")
        (tmp / "arch").mkdir()
        _link_children(common / "arch", tmp / "arch", {karch})
        (tmp / "arch" / karch).mkdir()
        _link_children(common / "arch" / karch, tmp / "arch" / karch, {"include"})
        inc = tmp / "arch" / karch / "include"
        inc.mkdir()
        _link_children(common / "arch" / karch / "include", inc)
        gen = arch_tree / "arch" / karch / "include"
        if gen.is_dir():
            _link_children(gen, inc)  # generated
        (tmp / ".offtop-complete").write_text(f"{arch_tree}\n{common}\n")
        try:
            tmp.rename(dest)
        except OSError:
            if not stamp.exists():  # lost a race to another offtop: theirs is as good
                shutil.rmtree(dest, ignore_errors=True)
                tmp.rename(dest)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return dest


def prepare() -> HeaderChoice:
    """Run every check in order; return the header tree chosen for bcc."""
    check_privileges()
    ensure_tracefs()
    check_bpf_syscall()
    choice = find_kernel_headers()
    if choice.source_env:
        os.environ["BCC_KERNEL_SOURCE"] = choice.source_env
    check_bcc_installed()
    return choice


# --- compile and load failures ---------------------------------------------------


@dataclass(slots=True)
class CapturedLog:
    """What C code wrote to fd 2 inside `captured_stderr()`."""

    text: str = field(default="")


@contextmanager
def captured_stderr() -> Iterator[CapturedLog]:
    """Collect what clang and libbpf write to fd 2 while bcc compiles and loads.

    A verifier rejection makes libbcc print the whole verifier log, dozens
    of lines, straight to fd 2; offtop reports one line and keeps the log
    in a file. fd 2 is process-wide, so it is only borrowed on the main
    thread (batch mode); in the TUI, a worker thread loads the program while
    the screen is drawn on fd 2, which must not be taken away.
    """
    log = CapturedLog()
    if threading.current_thread() is not threading.main_thread():
        yield log
        return
    sys.stderr.flush()
    with tempfile.TemporaryFile() as tmp:
        saved = os.dup(2)
        os.dup2(tmp.fileno(), 2)
        try:
            yield log
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            log.text = tmp.read(4 << 20).decode(errors="replace")


def _log_reason(log: str) -> str:
    """The line of a clang or verifier log that says what went wrong."""
    lines = [ln.strip() for ln in log.splitlines() if ln.strip()]
    for ln in lines:
        if " error: " in ln or ln.startswith("error:"):
            return ln
    for i, ln in enumerate(lines):
        if ln.startswith("processed ") and " insns" in ln and i > 0:
            return lines[i - 1]
    return ""


def load_failure(error: str, log: str) -> str:
    """One line for a failed compile or load; the full log goes to a file."""
    msg = f"could not load the BPF program: {error.strip()}"
    reason = _log_reason(log)
    if reason and reason not in msg:
        msg += f" ({reason})"
    if log.strip():
        try:
            fd, path = tempfile.mkstemp(prefix="offtop-bpf-load-", suffix=".log")
            with os.fdopen(fd, "w") as f:
                f.write(log)
            msg += f"; full log in {path}"
        except OSError:
            pass
    return " ".join(msg.split())
