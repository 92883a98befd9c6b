"""Unfit machines: what offtop needs from the kernel, bcc and the host, checked before use.

The checks that need a machine without something (kernel headers, tracefs,
the bpf() syscall) call `offtop.bpf.environment` with fakes; the ones that
can be staged for real (tracefs unmounted, headers hidden) run in a private
mount namespace so nothing else on the machine notices; the rest run the
real command line in a subprocess, as a user would.
"""

from __future__ import annotations

import errno
import os
import platform
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from offtop.bpf import environment
from offtop.bpf.environment import EnvironmentProblem, HeaderChoice, find_kernel_headers
from tests.conftest import (
    ROOT,
    _python_for_nobody,
    assert_one_line_error,
    need_root,
    run_as_nobody,
)

# --- the machine -------------------------------------------------------------


def test_not_root_is_refused() -> None:
    r = run_as_nobody("--batch", "--count", "1")
    line = assert_one_line_error(r, "needs root", "CAP_BPF", "CAP_PERFMON")
    assert r.returncode == 1
    assert "sudo" in line


def test_caps_without_tracefs_access_is_one_line() -> None:
    """CAP_BPF+CAP_PERFMON pass the privilege check, then tracefs (root's 0700) says no."""
    need_root()
    py, env = _python_for_nobody()
    r = subprocess.run(
        ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
         "--inh-caps=-all,+bpf,+perfmon", "--ambient-caps=+bpf,+perfmon",
         *py, "-m", "offtop.cli", "--batch", "--count", "1"],
        capture_output=True, text=True, timeout=60, cwd=ROOT, env=env)
    assert_one_line_error(r, "root")
    assert r.returncode == 1


_REFUSE_BCC = textwrap.dedent("""
    import importlib.abc, sys
    class Refuse(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "bcc" or name.startswith("bcc."):
                raise {exc}
            return None
    sys.meta_path.insert(0, Refuse())
    import offtop.cli
    sys.exit(offtop.cli.main(["--batch", "--count", "1"]))
""")


@pytest.mark.bpf
@pytest.mark.parametrize(("exc", "needle"), [
    ("ModuleNotFoundError(\"No module named 'bcc'\", name=name)", "python3-bpfcc"),
    ("OSError('libbcc.so.0: cannot open shared object file')", "libbpfcc"),
], ids=["module-missing", "library-missing"])
def test_bcc_not_importable_names_the_package(bpf_available: None, exc: str, needle: str) -> None:
    r = subprocess.run([sys.executable, "-c", _REFUSE_BCC.format(exc=exc)],
                       capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert_one_line_error(r, needle)
    assert r.returncode == 1


@pytest.mark.bpf
def test_bad_bcc_kernel_source_names_the_package(bpf_available: None, tmp_path: Path) -> None:
    r = subprocess.run([sys.executable, "-m", "offtop.cli", "--batch", "--count", "1"],
                       capture_output=True, text=True, timeout=60, cwd=ROOT,
                       env={**os.environ, "BCC_KERNEL_SOURCE": str(tmp_path)})
    assert_one_line_error(r, f"BCC_KERNEL_SOURCE={tmp_path}", environment.headers_package())


def _in_private_mount_ns(script: str, timeout: float = 90) -> subprocess.CompletedProcess[str]:
    """Run a shell script in a private mount namespace: its mounts never leak out."""
    env = {k: v for k, v in os.environ.items() if k != "BCC_KERNEL_SOURCE"}
    env["OFFTOP_PY"] = sys.executable
    return subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", script],
                          capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env)


@pytest.mark.bpf
def test_no_kernel_headers_names_the_package(bpf_available: None) -> None:
    """Hide every header tree (in a private mount namespace) and run offtop."""
    if Path("/sys/kernel/kheaders.tar.xz").exists():
        pytest.skip("this kernel carries its own headers (kheaders)")
    r = _in_private_mount_ns(
        "for d in /usr/src /lib/modules /run/offtop; do "
        "  [ -d $d ] && { mount -t tmpfs none $d || exit 99; }; done; "
        'exec "$OFFTOP_PY" -m offtop.cli --batch --count 1')
    assert r.returncode != 99, r.stderr
    assert_one_line_error(r, "no kernel headers", environment.headers_package())
    assert r.returncode == 1


@pytest.mark.bpf
def test_tracefs_unmounted_is_mounted_again(bpf_available: None) -> None:
    """As root, offtop mounts tracefs itself (tried in a private mount namespace)."""
    if environment.tracefs_dir() != Path("/sys/kernel/tracing"):
        pytest.skip("tracefs is not mounted at /sys/kernel/tracing here")
    r = _in_private_mount_ns(
        "umount /sys/kernel/tracing || exit 99; "
        "grep -q ' /sys/kernel/tracing ' /proc/self/mountinfo && exit 98; "
        '"$OFFTOP_PY" -m offtop.cli --batch --format json --count 1 --interval 0.3 || exit $?; '
        "grep ' /sys/kernel/tracing ' /proc/self/mountinfo")
    assert r.returncode not in (98, 99), r.stderr
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr
    out = r.stdout.splitlines()
    assert out[0].startswith("{"), r.stdout[:300]
    assert "tracefs" in out[-1]


# --- environment checks, with fakes ------------------------------------------


def test_privileges() -> None:
    bit = lambda n: 1 << n  # noqa: E731
    environment.check_privileges(euid=0, caps=bit(environment.CAP_SYS_ADMIN))
    environment.check_privileges(euid=1000, caps=bit(environment.CAP_BPF)
                                 | bit(environment.CAP_PERFMON))
    for euid, caps in [(1000, 0), (0, 0), (1000, bit(environment.CAP_BPF)),
                       (1000, bit(environment.CAP_PERFMON))]:
        with pytest.raises(EnvironmentProblem, match="needs root"):
            environment.check_privileges(euid=euid, caps=caps)


def _tracefs_tree(root: Path) -> Path:
    fmt = root / "events" / "sched" / "sched_switch" / "format"
    fmt.parent.mkdir(parents=True)
    fmt.write_text("name: sched_switch\n")
    return root


def test_tracefs_found(tmp_path: Path) -> None:
    d = _tracefs_tree(tmp_path / "tracing")
    assert environment.ensure_tracefs((tmp_path / "none", d)) == d


def test_tracefs_mounted_when_missing(tmp_path: Path) -> None:
    target = tmp_path / "tracing"
    target.mkdir()
    calls: list[Path] = []

    def fake_mount(p: Path) -> int:
        calls.append(p)
        _tracefs_tree(p)
        return 0

    assert environment.ensure_tracefs((target,), mount=fake_mount, can_mount=True) == target
    assert calls == [target]


@pytest.mark.parametrize("err", [errno.EPERM, errno.ENODEV])
def test_tracefs_mount_impossible(tmp_path: Path, err: int) -> None:
    target = tmp_path / "tracing"
    target.mkdir()
    with pytest.raises(EnvironmentProblem) as e:
        environment.ensure_tracefs((target,), mount=lambda p: err, can_mount=True)
    msg = str(e.value)
    assert "\n" not in msg
    assert os.strerror(err) in msg
    assert f"mount -t tracefs nodev {target}" in msg


def test_tracefs_missing_and_not_root(tmp_path: Path) -> None:
    target = tmp_path / "tracing"
    target.mkdir()

    def must_not_mount(p: Path) -> int:
        raise AssertionError("offtop must not try to mount without root")

    with pytest.raises(EnvironmentProblem, match="tracefs is not mounted: as root"):
        environment.ensure_tracefs((target,), mount=must_not_mount, can_mount=False)


def test_tracefs_without_the_tracepoint(tmp_path: Path) -> None:
    target = tmp_path / "tracing"
    (target / "events").mkdir(parents=True)
    with pytest.raises(EnvironmentProblem, match="sched:sched_switch tracepoint is missing"):
        environment.ensure_tracefs((target,), mount=lambda p: 0, can_mount=True)


def test_bpf_syscall_missing_or_refused() -> None:
    cases = {errno.ENOSYS: "no BPF support", errno.EPERM: "EPERM",
             errno.EINVAL: r"bpf\(\) syscall failed: Invalid argument"}
    for err, needle in cases.items():
        with pytest.raises(EnvironmentProblem, match=needle) as e:
            environment.check_bpf_syscall(lambda err=err: (-1, err))
        assert "\n" not in str(e.value)
    fd = os.open(os.devnull, os.O_RDONLY)
    environment.check_bpf_syscall(lambda: (fd, 0))
    with pytest.raises(OSError):
        os.fstat(fd)  # the probe map's fd was closed


# --- kernel headers -----------------------------------------------------------


def _tree(root: Path, *dirs: str) -> Path:
    for d in dirs:
        (root / d).mkdir(parents=True, exist_ok=True)
    return root


def _find(tmp_path: Path, env: dict[str, str] | None = None, **kw: Path) -> HeaderChoice:
    args: dict = {"release": "6.99.0-test", "usr_src": tmp_path / "usr-src",
                  "modules": tmp_path / "modules", "cache": tmp_path / "cache",
                  "env": env or {}, "kheaders": tmp_path / "no-kheaders"}
    args.update(kw)
    return find_kernel_headers(**args)


def test_headers_of_the_running_kernel(tmp_path: Path) -> None:
    build = _tree(tmp_path / "modules" / "6.99.0-test" / "build", "include/linux")
    c = _find(tmp_path)
    assert (c.kind, c.path, c.source_env) == ("running kernel", build, None)


def test_headers_from_kheaders(tmp_path: Path) -> None:
    kh = tmp_path / "kheaders.tar.xz"
    kh.write_bytes(b"")
    assert _find(tmp_path, kheaders=kh).kind == "kheaders"


def test_headers_from_bcc_kernel_source(tmp_path: Path) -> None:
    mine = _tree(tmp_path / "mine", "include/linux")
    _tree(tmp_path / "modules" / "6.99.0-test" / "build", "include/linux")
    c = _find(tmp_path, env={"BCC_KERNEL_SOURCE": str(mine)})
    # bcc obeys BCC_KERNEL_SOURCE whenever it is set, so offtop must too.
    assert (c.kind, c.path, c.source_env) == ("BCC_KERNEL_SOURCE", mine, str(mine))


def test_bad_bcc_kernel_source(tmp_path: Path) -> None:
    _tree(tmp_path / "modules" / "6.99.0-test" / "build", "include/linux")
    with pytest.raises(EnvironmentProblem) as e:
        _find(tmp_path, env={"BCC_KERNEL_SOURCE": str(tmp_path / "nope")})
    msg = str(e.value)
    assert "BCC_KERNEL_SOURCE=" in msg and "include/linux" in msg
    assert environment.headers_package() in msg


def test_debian_split_headers_are_merged(tmp_path: Path) -> None:
    arch = environment.debian_arch()
    karch = environment._KERNEL_ARCH_DIR.get(platform.machine(), "x86")
    src = tmp_path / "usr-src"
    arch_tree = _tree(src / f"linux-headers-6.1.0-9-{arch}", "include/generated/uapi",
                      "include/config", f"arch/{karch}/include/generated/asm")
    (arch_tree / "Module.symvers").write_text("")
    common = _tree(src / "linux-headers-6.1.0-9-common", "include/linux", "include/uapi/linux",
                   f"arch/{karch}/include/asm", f"arch/{karch}/include/uapi", "scripts", "arch/arm")
    (common / "include/linux/types.h").write_text("/* types */\n")
    (common / f"arch/{karch}/include/asm/ptrace.h").write_text("/* ptrace */\n")
    (common / f"arch/{karch}/Makefile").write_text("")
    (common / "Makefile").write_text("")
    # An older, complete tree loses to the newer split one.
    _tree(src / f"linux-headers-5.10.0-1-{arch}", "include/linux", "include/generated")

    c = _find(tmp_path)
    assert c.kind == f"distro headers (linux-headers-6.1.0-9-{arch})"
    m = c.path
    assert m is not None and m.parent == tmp_path / "cache"
    assert c.source_env == str(m)
    assert (m / "include/linux/types.h").read_text() == "/* types */\n"
    assert (m / "include/generated/uapi").is_dir()
    assert (m / "include/config").is_dir()
    assert (m / f"arch/{karch}/include/asm/ptrace.h").is_file()
    assert (m / f"arch/{karch}/include/generated/asm").is_dir()
    assert (m / f"arch/{karch}/Makefile").is_file()
    assert (m / "arch/arm").is_dir()
    assert (m / "Makefile").is_file() and (m / "Module.symvers").is_file()
    # Idempotent: a second run reuses the finished tree.
    assert _find(tmp_path).path == m
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [m.name]


def test_no_headers_names_the_package(tmp_path: Path) -> None:
    _tree(tmp_path / "usr-src" / "linux-kbuild-6.1", "scripts")
    with pytest.raises(EnvironmentProblem) as e:
        _find(tmp_path)
    msg = str(e.value)
    assert "\n" not in msg
    assert f"linux-headers-{environment.debian_arch()}" in msg


_BROKEN_PROGRAM = textwrap.dedent("""
    import sys
    from importlib import resources
    import offtop.bpf.probe as probe

    class _Source:  # offcpu.c with one unchecked map lookup: the verifier says no
        def joinpath(self, name):
            return self
        def read_text(self):
            src = resources.files("offtop.bpf").joinpath("offcpu.c").read_text()
            bad = ("TRACEPOINT_PROBE(sched, sched_switch)\\n{\\n"
                   "    { u32 z = 0; struct start_rec *r = offcpu_start.lookup(&z);"
                   " if (r->ts == 42) return 1; }\\n")
            out = src.replace("TRACEPOINT_PROBE(sched, sched_switch)\\n{\\n", bad)
            assert out != src
            return out

    class _Resources:
        @staticmethod
        def files(pkg):
            return _Source()

    probe.resources = _Resources
    import offtop.cli
    sys.exit(offtop.cli.main(["--batch", "--count", "1"]))
""")


@pytest.mark.bpf
def test_verifier_rejection_is_one_line_with_the_log_in_a_file(bpf_available: None) -> None:
    """libbcc prints the whole verifier log on fd 2; offtop keeps it to one line."""
    r = subprocess.run([sys.executable, "-c", _BROKEN_PROGRAM], capture_output=True, text=True,
                       timeout=60, cwd=ROOT)
    line = assert_one_line_error(r, "could not load the BPF program",
                                 "invalid mem access", "full log in ")
    assert r.returncode == 1
    log = Path(line.rsplit("full log in ", 1)[1])
    try:
        text = log.read_text()
        assert "processed " in text and "invalid mem access" in text
    finally:
        log.unlink()
