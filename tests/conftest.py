"""Shared fixtures: known workloads, real BPF gating, running offtop itself.

Real BPF tests are marked `bpf` and use the `bpf_available` fixture: on a
machine without root/BPF they skip, unless OFFTOP_REQUIRE_BPF=1 (set by
.ci/run), which turns every such skip into a failure.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

# A suite started in the background by a non-interactive shell (`make test &` in a
# script, some CI runners) inherits SIGINT ignored, and so would every offtop it
# starts: Ctrl-C would never reach them, and the tests that press it would hang.
# A handler here (any but "ignore") is reset to the default in each child.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

ROOT = Path(__file__).resolve().parent.parent
WORKLOAD_SRC = ROOT / "tests" / "workloads" / "offtop_workload.c"
REQUIRE_BPF = os.environ.get("OFFTOP_REQUIRE_BPF") == "1"


def bpf_unavailable_reason() -> str | None:
    """Why real BPF tests cannot run here, or None when they can."""
    if sys.platform != "linux":
        return "not Linux"
    if os.geteuid() != 0:
        return "not root"
    try:
        from offtop.bpf import environment

        environment.prepare()
    except Exception as e:  # EnvironmentProblem and anything bcc raises
        return str(e)
    return None


@pytest.fixture(scope="session")
def bpf_available() -> None:
    """Skip (or, under OFFTOP_REQUIRE_BPF=1, fail) when BPF cannot run."""
    reason = bpf_unavailable_reason()
    if reason is not None:
        if REQUIRE_BPF:
            pytest.fail(f"OFFTOP_REQUIRE_BPF=1 but BPF tests cannot run: {reason}")
        pytest.skip(f"real BPF tests need root and BPF: {reason}")


@pytest.fixture(scope="session")
def workload_bin(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The compiled test workload (frame pointers on)."""
    cc = shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        pytest.fail("no C compiler: run the README's test command (it installs gcc)")
    out = tmp_path_factory.mktemp("workload") / "offtop_workload"
    subprocess.run(
        [cc, "-O1", "-g", "-fno-omit-frame-pointer", "-pthread", "-o", str(out), str(WORKLOAD_SRC)],
        check=True,
    )
    return out


def build(tmp: Path, source: str, *flags: str) -> Path:
    """tests/workloads/`source` compiled into `tmp` with `flags`."""
    cc = shutil.which("gcc") or shutil.which("cc")
    assert cc, "no C compiler: run the README's test command (it installs gcc)"
    out = tmp / Path(source).stem
    subprocess.run([cc, *flags, "-pthread", "-o", str(out), str(WORKLOAD_SRC.parent / source)],
                   check=True)
    return out


@dataclass
class Workload:
    """A running workload process and the thread it measures."""

    proc: subprocess.Popen[str]
    pid: int
    tid: int

    def stop(self) -> None:
        """Kill the whole process group (vfork children included)."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=5)


_READY = re.compile(r"ready pid=(\d+) tid=(\d+)")


def start_workload(binary: Path, *args: str, prefix: list[str] | None = None,
                   preexec: Any = None) -> Workload:
    """Start `binary args...` in its own process group; wait for its ready line."""
    proc = subprocess.Popen(
        [*(prefix or []), str(binary), *args],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
        preexec_fn=preexec,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    m = _READY.search(line)
    if not m:
        proc.kill()
        raise RuntimeError(f"workload {args} did not start: {line!r}")
    return Workload(proc, int(m.group(1)), int(m.group(2)))


@pytest.fixture
def workloads(workload_bin: Path) -> Iterator[Any]:
    """A factory of workloads, all stopped at the end of the test."""
    started: list[Workload] = []

    def start(*args: str, **kw: Any) -> Workload:
        w = start_workload(workload_bin, *args, **kw)
        started.append(w)
        return w

    yield start
    for w in started:
        w.stop()


def run_offtop(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """Run the real `offtop` command line (as a user would) and capture it."""
    return subprocess.run(
        [sys.executable, "-m", "offtop.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
    )


def offtop_lines(*args: str) -> subprocess.Popen[str]:
    """`offtop --batch --format json ARGS` started, its snapshots read line by line
    from its stdout as they come."""
    return subprocess.Popen(
        [sys.executable, "-m", "offtop.cli", "--batch", "--format", "json", *args],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=ROOT,
    )


def offtop_json(*args: str, count: int = 3, interval: str = "1", timeout: float = 60) -> list[dict[str, Any]]:
    """`offtop --batch --format json --count N ...`, parsed (one dict per interval)."""
    r = run_offtop("--batch", "--format", "json", "--count", str(count), "--interval", interval,
                   *args, timeout=timeout)
    assert r.returncode == 0, f"offtop failed ({r.returncode}): {r.stderr}"
    return [json.loads(line) for line in r.stdout.splitlines() if line.strip()]


def task_of(snap: dict[str, Any], tid: int) -> dict[str, Any] | None:
    """The task row of one thread in a JSON snapshot."""
    return next((t for t in snap["tasks"] if t["tid"] == tid), None)


def process_ended(pid: int) -> bool:
    """`pid` has exited: gone, or a zombie not reaped yet. Read once, so that a process
    that goes between two looks at /proc counts as gone, not as an error."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except (FileNotFoundError, ProcessLookupError):  # gone before the open, or the read
        return True
    return stat[stat.rindex(b")") + 2:].split()[0] == b"Z"


def wait_until(pred: Any, timeout: float = 5.0, step: float = 0.05) -> bool:
    """Poll `pred()` until true or the timeout passes."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(step)
    return bool(pred())


def in_read(pid: int) -> bool:
    """`pid` is asleep in read(2) (x86-64 syscall 0, /proc/PID/syscall)."""
    try:
        return Path(f"/proc/{pid}/syscall").read_text().split()[0] == "0"
    except (OSError, IndexError):
        return False


def remove_cgroup(d: Path, tries: int = 50) -> None:
    """rmdir a test cgroup, retrying while its last tasks are still leaving."""
    for _ in range(tries):
        try:
            d.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:
            time.sleep(0.1)


# --- refusals, and running offtop as an unprivileged user ------------------------

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
