"""What offtop needs from the machine, checked before anything is compiled.

Each check either fixes what it safely can (mount tracefs as root, assemble a
header tree bcc can read) or raises `EnvironmentProblem` with one line that
says what is missing and how to get it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import platform
import shutil
import tempfile
from dataclasses import dataclass
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


def check_privileges() -> None:
    """Root, or CAP_BPF with CAP_PERFMON (or CAP_SYS_ADMIN); never escalate."""
    caps = effective_caps()
    has = lambda bit: bool(caps >> bit & 1)  # noqa: E731
    if os.geteuid() == 0 and has(CAP_SYS_ADMIN):
        return
    if has(CAP_SYS_ADMIN) or (has(CAP_BPF) and has(CAP_PERFMON)):
        return
    raise EnvironmentProblem(
        "offtop needs root (or CAP_BPF and CAP_PERFMON) to load its BPF program: "
        "run it with sudo"
    )


# --- tracefs ---------------------------------------------------------------


def tracefs_dir() -> Path | None:
    """The mounted tracefs with the sched_switch tracepoint, if any."""
    for d in TRACEFS_DIRS:
        if (d / "events" / "sched" / "sched_switch" / "format").exists():
            return d
    return None


def ensure_tracefs() -> Path:
    """Find tracefs, mounting it at /sys/kernel/tracing when root and missing."""
    found = tracefs_dir()
    if found:
        return found
    target = TRACEFS_DIRS[0]
    if target.is_dir() and not any(target.iterdir()):
        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        if libc.mount(b"nodev", str(target).encode(), b"tracefs", 0, None) != 0:
            err = ctypes.get_errno()
            raise EnvironmentProblem(
                f"tracefs is not mounted and mounting it failed ({os.strerror(err)}): "
                f"run 'mount -t tracefs nodev {target}' as root"
            )
        found = tracefs_dir()
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


def check_bpf_syscall() -> None:
    """Create and free a one-slot array map: proves the bpf() syscall works."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    nr = {"x86_64": 321, "aarch64": 280, "riscv64": 280, "s390x": 351, "ppc64le": 361}.get(
        platform.machine()
    )
    if nr is None:
        return  # unknown syscall number: let bcc find out

    class _MapCreate(ctypes.Structure):
        _fields_ = [("map_type", ctypes.c_uint32), ("key_size", ctypes.c_uint32),
                    ("value_size", ctypes.c_uint32), ("max_entries", ctypes.c_uint32),
                    ("pad", ctypes.c_uint8 * 112)]

    attr = _MapCreate(map_type=2, key_size=4, value_size=8, max_entries=1)  # BPF_MAP_TYPE_ARRAY
    fd = libc.syscall(nr, 0, ctypes.byref(attr), ctypes.sizeof(attr))  # BPF_MAP_CREATE
    if fd >= 0:
        os.close(fd)
        return
    err = ctypes.get_errno()
    if err == errno.ENOSYS:
        raise EnvironmentProblem("this kernel has no BPF support (CONFIG_BPF_SYSCALL is off)")
    if err == errno.EPERM:
        raise EnvironmentProblem(
            "the kernel refused to create a BPF map (EPERM): run as root, and check "
            "kernel.unprivileged_bpf_disabled and any LSM policy"
        )
    raise EnvironmentProblem(f"the bpf() syscall failed: {os.strerror(err)}")


# --- bcc -----------------------------------------------------------------


def check_bcc_importable() -> None:
    """bcc's Python bindings come from the distro, not PyPI."""
    try:
        import bcc  # noqa: F401
    except ImportError:
        raise EnvironmentProblem(
            "bcc's Python bindings are missing: install python3-bpfcc "
            "(apt-get install python3-bpfcc) and use /usr/bin/python3 or a venv made "
            "with --system-site-packages"
        ) from None
    except OSError as e:  # libbcc.so itself missing or broken
        raise EnvironmentProblem(f"bcc's library could not be loaded ({e}): reinstall libbpfcc") from None


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
    env: dict[str, str] | None = None,
) -> HeaderChoice:
    """Find a header tree: the running kernel's, kheaders, BCC_KERNEL_SOURCE, distro headers.

    offtop's BPF program reads no kernel struct, so any kernel's headers do.
    Debian splits a tree into `-<arch>` (generated headers) and `-common`
    (the rest); bcc expects one tree, so the two are joined by a symlink farm
    under /run/offtop, never under /lib/modules.
    """
    release = release or platform.release()
    env = os.environ if env is None else env  # type: ignore[assignment]
    build = modules / release / "build"
    if _has_includes(build):
        return HeaderChoice("running kernel", build, None)
    if Path("/sys/kernel/kheaders.tar.xz").exists():
        return HeaderChoice("kheaders", None, None)
    user_tree = env.get("BCC_KERNEL_SOURCE")
    if user_tree:
        p = Path(user_tree)
        if not _has_includes(p):
            raise EnvironmentProblem(f"BCC_KERNEL_SOURCE={user_tree} has no include/linux directory")
        return HeaderChoice("BCC_KERNEL_SOURCE", p, str(p))
    arch = debian_arch()
    candidates = sorted(
        (d for d in usr_src.glob("linux-headers-*") if d.is_dir() and not d.name.endswith("-common")),
        key=lambda d: (d.name.endswith(f"-{arch}"), _version_key(d.name)),
        reverse=True,
    )
    for tree in candidates:
        if _has_includes(tree) and (tree / "include" / "generated").is_dir():
            return HeaderChoice("distro headers", tree, str(tree))
        common = tree.with_name(tree.name.rsplit("-", 1)[0] + "-common")
        if _has_includes(common) and (tree / "include" / "generated").is_dir():
            merged = _merge_debian_tree(tree, common, cache)
            return HeaderChoice(f"distro headers ({tree.name})", merged, str(merged))
    raise EnvironmentProblem(
        f"no kernel headers found for bcc: install {headers_package()} "
        f"(apt-get install {headers_package()}; any version works)"
    )


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
    check_bcc_importable()
    return choice
