"""Bad input and unfit machines: one line on stderr, exit status != 0, no traceback.

Each case runs the real command line in a subprocess, as a user would, except
the checks that need a machine without something (kernel headers, tracefs,
the bpf() syscall): those call `offtop.bpf.environment` with fakes, and the
ones that can be staged for real (tracefs unmounted, headers hidden) run in a
private mount namespace so nothing else on the machine notices.
"""

from __future__ import annotations

import errno
import os
import platform
import pty
import subprocess
import sys
import textwrap
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from offtop.bpf import environment
from offtop.bpf.environment import EnvironmentProblem, HeaderChoice, find_kernel_headers
from offtop.cgroups import CgroupError, cgroup2_mounts, resolve_cgroup
from tests.conftest import REQUIRE_BPF, ROOT, offtop_json, remove_cgroup, run_offtop, task_of

NOBODY = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--inh-caps=-all"]


def assert_one_line_error(r: subprocess.CompletedProcess[str], *needles: str) -> str:
    """The contract for every refusal; returns the line."""
    assert r.returncode != 0, f"expected a failure, got 0; stdout={r.stdout[:300]!r}"
    assert "Traceback" not in r.stderr, r.stderr
    lines = r.stderr.splitlines()
    assert len(lines) == 1, f"expected one line on stderr, got {len(lines)}: {r.stderr!r}"
    line = lines[0]
    assert line.startswith("offtop: "), line
    for n in needles:
        assert n in line, f"{n!r} not in {line!r}"
    assert r.stdout == "", r.stdout
    return line


def need_root() -> None:
    if os.geteuid() != 0:
        if REQUIRE_BPF:
            pytest.fail("OFFTOP_REQUIRE_BPF=1 but not root")
        pytest.skip("needs root")


def _python_for_nobody() -> tuple[list[str], dict[str, str]]:
    """An interpreter that user nobody can run offtop with (the venv, or the system's)."""
    probe = subprocess.run([*NOBODY, sys.executable, "-c", "import offtop.cli"],
                           cwd=ROOT, capture_output=True)
    env = {k: v for k, v in os.environ.items() if k != "BCC_KERNEL_SOURCE"}
    if probe.returncode == 0:
        return [sys.executable], env
    return ["/usr/bin/python3"], {**env, "PYTHONPATH": str(ROOT)}


def run_as_nobody(*args: str, env: dict[str, str] | None = None,
                  timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """`offtop args...` as user nobody, with no capabilities at all."""
    need_root()
    py, base_env = _python_for_nobody()
    return subprocess.run([*NOBODY, *py, "-m", "offtop.cli", *args], capture_output=True,
                          text=True, timeout=timeout, cwd=ROOT, env={**base_env, **(env or {})})


def free_pid() -> int:
    """A pid no process or thread has right now."""
    pid_max = int(Path("/proc/sys/kernel/pid_max").read_text())
    for pid in range(pid_max - 1, 1, -1):
        if not Path(f"/proc/{pid}").exists():
            return pid
    raise AssertionError("no free pid")


# --- options -----------------------------------------------------------------

BAD_OPTIONS = [
    (["--threshold", "abc"], ["--threshold", "'abc'"]),
    (["--threshold", "-5ms"], ["--threshold", "negative"]),
    (["--threshold=-5ms"], ["--threshold", "negative"]),
    (["--threshold", "1e99"], ["--threshold", "too large"]),
    (["--threshold", "10 parsecs"], ["--threshold", "unknown unit 'parsecs'"]),
    (["--threshold", "inf"], ["--threshold", "'inf'"]),
    (["--threshold", "nan"], ["--threshold", "'nan'"]),
    (["--threshold", ""], ["--threshold"]),
    (["--interval", "0"], ["--interval", "too short"]),
    (["--interval", "-1"], ["--interval", "negative"]),
    (["--interval", "-0.5"], ["--interval", "negative"]),
    (["--interval", "1e9"], ["--interval", "too large"]),
    (["--interval", "99999999"], ["--interval", "too large"]),
    (["--interval", "0.001"], ["--interval", "too short"]),
    (["--interval", "soon"], ["--interval", "'soon'"]),
    (["--count", "0"], ["--count", "positive"]),
    (["--count", "-1"], ["--count", "positive"]),
    (["--count", "abc"], ["--count", "positive"]),
    (["--count", "1.5"], ["--count", "positive"]),
    (["-p", "abc"], ["pid", "'abc'"]),
    (["-p", "-1"], ["pid", "'-1'"]),
    (["-p", "0"], ["pid", "'0'"]),
    (["-p", ""], ["pid", "''"]),
    (["-p", "1,,2"], ["pid", "''"]),
    (["-p", "1.5"], ["pid", "'1.5'"]),
    (["-p", "99999999999"], ["pid", "larger than any pid"]),
    (["-t", "abc"], ["tid", "'abc'"]),
    (["-t", "-7"], ["tid", "'-7'"]),
    (["-t", "0"], ["tid", "'0'"]),
    (["--states", "XQ"], ["state", "'Q'"]),
    (["--format", "xml"], ["--format", "xml"]),
    (["--frobnicate"], ["unrecognized", "--frobnicate"]),
    (["--threshold"], ["--threshold", "expected one argument"]),
    (["--replay", "/nonexistent/recording.jsonl"], ["recording", "No such file"]),
]


@pytest.mark.parametrize(("args", "needles"), BAD_OPTIONS,
                         ids=[" ".join(a) or "empty" for a, _ in BAD_OPTIONS])
def test_bad_option_is_one_line(args: list[str], needles: list[str]) -> None:
    r = run_offtop("--batch", "--count", "1", *args) if "--count" not in args else \
        run_offtop("--batch", *args)
    assert_one_line_error(r, *needles)
    assert r.returncode == 2


def test_pid_that_does_not_exist_is_an_error() -> None:
    """Decision (cli.parse_ids): -p/-t of a pid that does not exist is an error."""
    pid = free_pid()
    r = run_offtop("--batch", "--count", "1", "-p", str(pid))
    assert_one_line_error(r, "no such pid", str(pid))
    r = run_offtop("--batch", "--count", "1", "-t", str(pid))
    assert_one_line_error(r, "no such tid", str(pid))
    r = run_offtop("--batch", "--count", "1", "-p", f"{os.getpid()},{pid}")
    assert_one_line_error(r, "no such pid", str(pid))


def test_corrupt_recording_is_one_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"seq": 1, "tasks": [\n')
    r = run_offtop("--batch", "--replay", str(bad))
    assert_one_line_error(r, "cannot read recording", str(bad))


def test_tui_without_a_terminal_suggests_batch() -> None:
    r = run_offtop()  # stdout is a pipe here
    assert_one_line_error(r, "not a terminal", "--batch")
    assert r.returncode == 2


def test_tui_with_stdin_not_a_terminal_suggests_batch() -> None:
    master, slave = pty.openpty()
    try:
        r = subprocess.run([sys.executable, "-m", "offtop.cli"], stdin=subprocess.DEVNULL,
                           stdout=slave, stderr=subprocess.PIPE, text=True, timeout=60, cwd=ROOT)
    finally:
        os.close(slave)
        os.close(master)
    assert r.returncode == 2
    assert "Traceback" not in r.stderr
    assert len(r.stderr.splitlines()) == 1, r.stderr
    assert "stdin is not a terminal" in r.stderr and "--batch" in r.stderr


@pytest.mark.bpf
def test_threshold_zero_makes_every_block_an_event(bpf_available: None, workloads) -> None:
    w = workloads("sleep", "20")
    snaps = offtop_json("--threshold", "0", "-p", str(w.pid), count=2, interval="1")
    last = snaps[-1]
    assert last["threshold_ns"] == 0
    t = task_of(last, w.tid)
    assert t is not None, last["tasks"]
    # 20 ms sleeps: about 50 blocks a second, every one of them an event.
    assert t["count"] >= 20
    assert t["events"] == t["count"]
    assert sum(1 for b in last["long_blocks"] if b["tid"] == w.tid) >= 20


# --- -c ------------------------------------------------------------------------


@pytest.fixture
def v2_root() -> Path:
    need_root()
    roots = cgroup2_mounts()
    if not roots:
        pytest.skip("no cgroup v2 mount")
    return roots[0]


@pytest.fixture
def make_cgroup() -> Iterator:
    """Create cgroup directories; move their tasks out and remove them at the end."""
    made: list[Path] = []

    def make(parent: Path, name: str | None = None) -> Path:
        d = parent / (name or f"offtop-test-{uuid.uuid4().hex[:8]}")
        d.mkdir()
        made.append(d)
        return d

    yield make
    for d in reversed(made):
        remove_cgroup(d)


def _move(pid: int, cgroup: Path) -> None:
    (cgroup / "cgroup.procs").write_text(f"{pid}\n")


def test_cgroup_does_not_exist(tmp_path: Path) -> None:
    r = run_offtop("--batch", "--count", "1", "-c", str(tmp_path / "nope"))
    assert_one_line_error(r, "does not exist", "nope")
    r = run_offtop("--batch", "--count", "1", "-c", "no-such-cgroup-offtop")
    assert_one_line_error(r, "does not exist", "no-such-cgroup-offtop")


def test_cgroup_not_a_directory(tmp_path: Path) -> None:
    f = tmp_path / "file"
    f.write_text("x")
    r = run_offtop("--batch", "--count", "1", "-c", str(f))
    assert_one_line_error(r, "not a directory", str(f))


def test_cgroup_not_a_cgroup(tmp_path: Path) -> None:
    r = run_offtop("--batch", "--count", "1", "-c", str(tmp_path))
    assert_one_line_error(r, "not a cgroup", str(tmp_path))
    r = run_offtop("--batch", "--count", "1", "-c", "/tmp")
    assert_one_line_error(r, "/tmp is not a cgroup")


def test_cgroup_v1_is_refused_with_the_v2_path_of_its_tasks(
        v2_root: Path, make_cgroup, workloads) -> None:
    v1 = Path("/sys/fs/cgroup/cpu")
    if not (v1 / "cgroup.procs").exists():
        pytest.skip("no cgroup v1 cpu hierarchy")
    w = workloads("sleep", "50")
    v1_dir = make_cgroup(v1)
    _move(w.pid, v1_dir)
    v2_rel = next(line[3:] for line in Path(f"/proc/{w.pid}/cgroup").read_text().splitlines()
                  if line.startswith("0::"))
    expected = str(v2_root / v2_rel.lstrip("/"))
    r = run_offtop("--batch", "--count", "1", "-c", str(v1_dir))
    line = assert_one_line_error(r, "cgroup v1", str(v1_dir))
    assert f"its tasks are in the v2 cgroup {expected}" in line
    w.stop()


def test_cgroup_v1_without_tasks_names_the_v2_mount(v2_root: Path, make_cgroup) -> None:
    v1 = Path("/sys/fs/cgroup/cpu")
    if not (v1 / "cgroup.procs").exists():
        pytest.skip("no cgroup v1 cpu hierarchy")
    v1_dir = make_cgroup(v1)
    r = run_offtop("--batch", "--count", "1", "-c", str(v1_dir))
    assert_one_line_error(r, "cgroup v1", f"cgroup v2 is mounted at {v2_root}")


def test_cgroup_that_cannot_be_read(v2_root: Path, make_cgroup) -> None:
    locked = make_cgroup(v2_root)
    locked.chmod(0o700)
    inner = make_cgroup(locked)
    r = run_as_nobody("--batch", "--count", "1", "-c", str(locked))
    assert_one_line_error(r, "cannot open cgroup", str(locked), "Permission denied")
    r = run_as_nobody("--batch", "--count", "1", "-c", str(inner))
    assert_one_line_error(r, "cannot access cgroup", "permission denied")


def test_relative_cgroup_prefers_the_v2_tree(v2_root: Path, make_cgroup, tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    cg = make_cgroup(v2_root)
    (tmp_path / cg.name).mkdir()  # a same-named plain directory in the working directory
    monkeypatch.chdir(tmp_path)
    assert resolve_cgroup(cg.name) == cg
    assert resolve_cgroup("/" + cg.name) == cg
    with pytest.raises(CgroupError, match="not a cgroup"):
        resolve_cgroup(str(tmp_path / cg.name))


@pytest.mark.bpf
def test_relative_cgroup_path_works(bpf_available: None, v2_root: Path, make_cgroup,
                                    workloads) -> None:
    cg = make_cgroup(v2_root)
    inside = workloads("sleep", "50")
    outside = workloads("sleep", "50")
    _move(inside.pid, cg)
    try:
        snaps = offtop_json("-c", cg.name, count=2, interval="1")
    finally:
        inside.stop()
    last = snaps[-1]
    assert task_of(last, inside.tid) is not None, last["tasks"]
    assert task_of(last, outside.tid) is None
    assert {t["pid"] for t in last["tasks"]} <= {inside.pid}


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
    import offtop.bpf.engine as engine

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

    engine.resources = _Resources
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
