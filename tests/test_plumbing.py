"""The command line's plumbing: signals against a stalled reader, closed or odd
standard streams, hostile --replay files, pid namespaces, and small oddities of
the machine (a tight `ulimit -v`, /proc with subset=pid, /run/offtop a file).

Each case runs the real command line as a user would: real processes, real
signals, real BPF where the case needs it; machine oddities are staged in
private namespaces so nothing else on the machine notices.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import pty
import re
import resource
import signal
import subprocess
import sys
import termios
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from offtop.bpf import environment
from offtop.bpf.environment import EnvironmentProblem
from offtop.report import snapshot_to_json
from offtop.synthetic import synthetic_snapshots
from tests.conftest import ROOT, assert_one_line_error, need_root, process_ended, wait_until
from tests.test_faults import Tmux, _shell_saw_exit, assert_detached

OFFTOP = [sys.executable, "-m", "offtop.cli"]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "BCC_KERNEL_SOURCE"}
    env["OFFTOP_PY"] = sys.executable
    return env


def _prog_ids(pid: int) -> set[int]:
    """The BPF programs process `pid` holds (from its fds)."""
    ids = set()
    with contextlib.suppress(OSError):
        for f in Path(f"/proc/{pid}/fdinfo").iterdir():
            with contextlib.suppress(OSError):
                for line in f.read_text().splitlines():
                    if line.startswith("prog_id:"):
                        ids.add(int(line.split()[1]))
    return ids


def _kill(proc: subprocess.Popen[Any]) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def _sh(script: str, *, timeout: float = 90) -> subprocess.CompletedProcess[str]:
    """A shell script with $OFFTOP_PY set (the interpreter that runs offtop)."""
    return subprocess.run(["sh", "-c", script], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT, env=_env())


def _private_mounts(script: str, timeout: float = 90) -> subprocess.CompletedProcess[str]:
    """`script` in a private mount namespace: its mounts never leak out."""
    need_root()
    return subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", script],
                          capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=_env())


# --- signals win over a stdout nobody reads -----------------------------------------------


def _blocked_writing(pid: int, read_end: int) -> bool:
    """The pipe is full and process `pid` sleeps in write(2) on it."""
    buf = bytearray(4)
    fcntl.ioctl(read_end, termios.FIONREAD, buf)
    if int.from_bytes(buf, sys.byteorder) < fcntl.fcntl(read_end, fcntl.F_GETPIPE_SZ):
        return False
    try:
        wchan = Path(f"/proc/{pid}/wchan").read_text()
    except OSError:
        return False
    return "pipe_write" in wchan or wchan in ("", "0")  # "0": the kernel does not say


@pytest.mark.bpf
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP],
                         ids=["SIGTERM", "SIGINT", "SIGHUP"])
def test_signal_ends_batch_mode_while_stdout_is_not_read(bpf_available: None, sig: int) -> None:
    """`offtop --batch | (sleep 30)`: a signal ends offtop within 1 s, probe detached, status 0.

    The write blocked on the full pipe used to be restarted after the signal
    handler (PEP 475), until the reader drained the pipe: never.
    """
    r, w = os.pipe()
    fcntl.fcntl(w, fcntl.F_SETPIPE_SZ, 4096)  # one page: the first report fills it
    proc = subprocess.Popen([*OFFTOP, "--batch", "--format", "json", "--interval", "0.1"],
                            stdout=w, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    os.close(w)
    try:
        assert wait_until(lambda: _blocked_writing(proc.pid, r) or proc.poll() is not None,
                          timeout=60), "offtop never filled its stdout"
        assert proc.poll() is None, proc.communicate()[1]
        progs = _prog_ids(proc.pid)
        time.sleep(0.3)  # well inside the blocked write
        t0 = time.monotonic()
        proc.send_signal(sig)
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pytest.fail(f"offtop still runs 5 s after {signal.Signals(sig).name}, "
                        "blocked on a stdout nobody reads")
        took = time.monotonic() - t0
    finally:
        _kill(proc)
        os.close(r)
    assert proc.stderr is not None
    err = proc.stderr.read()
    assert took < 1.0, f"offtop took {took:.2f}s to exit on {signal.Signals(sig).name}"
    assert proc.returncode == 0, err
    assert "Traceback" not in err
    assert err.splitlines() == ["offtop: stdout is not being read: stopped with the last "
                                "report unwritten"], err
    assert_detached(progs)


@contextlib.contextmanager
def _on_signal(sig: int, action: Callable[[], None]) -> Iterator[None]:
    old = signal.signal(sig, lambda s, f: action())
    try:
        yield
    finally:
        signal.signal(sig, old)


def test_report_writer_abandons_a_write_nobody_takes_after_a_stop() -> None:
    """In-process, the real path: a signal arrives while write(2) is blocked on a full pipe."""
    from offtop.cli_io import ReportWriter

    r, w = os.pipe()
    try:
        with ReportWriter(w, idle_s=0.3) as writer, \
                _on_signal(signal.SIGUSR1, writer.stop_requested):
            threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGUSR1)).start()
            t0 = time.monotonic()
            writer.write("x" * (1 << 20) + "\n")  # far more than a pipe holds
            took = time.monotonic() - t0
            assert writer.stalled
            assert 0.5 <= took < 3.0, took
            t0 = time.monotonic()
            writer.write("later\n")  # nothing more is attempted
            assert time.monotonic() - t0 < 0.1
    finally:
        os.close(r)
        os.close(w)


class _LateReader:
    """Reads a pipe from `after_s` on, a chunk per `pace_s`, until EOF (in a thread)."""

    def __init__(self, fd: int, *, after_s: float, chunk: int = 1 << 16, pace_s: float = 0.0) -> None:
        self.got = bytearray()
        self._thread = threading.Thread(target=self._run, args=(fd, after_s, chunk, pace_s))
        self._thread.start()

    def _run(self, fd: int, after_s: float, chunk: int, pace_s: float) -> None:
        time.sleep(after_s)  # the writer blocks meanwhile, the stop comes in between
        while data := os.read(fd, chunk):
            self.got.extend(data)
            time.sleep(pace_s)

    def finish(self) -> bytes:
        """What it read (the write end must be closed first)."""
        self._thread.join(timeout=10)
        return bytes(self.got)


def _written_after_a_stop(lines: list[str], *, idle_s: float = 0.25, pipe_size: int = 0,
                          **reader: Any) -> tuple[bytes, bool]:
    """`lines` through a ReportWriter into a pipe, a stop (SIGUSR1) coming 0.2 s in,
    the pipe read by a _LateReader(**reader): (what it got, whether the writer stalled)."""
    from offtop.cli_io import ReportWriter

    r, w = os.pipe()
    if pipe_size:
        fcntl.fcntl(w, fcntl.F_SETPIPE_SZ, pipe_size)
    late = _LateReader(r, **reader)
    try:
        with ReportWriter(w, idle_s=idle_s) as writer, \
                _on_signal(signal.SIGUSR1, writer.stop_requested):
            threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGUSR1)).start()
            for line in lines:
                writer.write(line)
            stalled = writer.stalled
    finally:
        os.close(w)
        got = late.finish()
        os.close(r)
    return got, stalled


def test_report_writer_finishes_a_line_the_reader_takes_after_a_stop() -> None:
    """A stop never cuts a line that can still be written: the reader wakes up and takes it."""
    line = "y" * (1 << 20) + "\n"
    got, stalled = _written_after_a_stop([line], idle_s=5.0, after_s=0.5)
    assert not stalled and got == line.encode()


def test_report_writer_gives_a_slow_live_reader_every_report_after_a_stop() -> None:
    """`offtop --batch | slow-reader`, then Ctrl-C: the writer was blocked on the full
    pipe; the reader takes a page every 0.1 s, far slower than the whole of the idle
    budget allows (0.25 s). It gets the line in progress and the last report, whole.

    A budget for all the writing after the stop (before) gave up on the last report
    of a reader that was still reading: with --limit 0 on a whole machine a JSON line
    is ~100 kB, and finishing the line in progress could take the quarter second."""
    lines = ["a" * 20_000 + "\n", "b" * 20_000 + "\n"]  # ~10 pages: ~1 s at this pace
    got, stalled = _written_after_a_stop(lines, pipe_size=4096, after_s=0.4, chunk=4096,
                                         pace_s=0.1)
    assert not stalled and got == "".join(lines).encode()


def test_report_writer_gives_up_on_a_trickling_reader_at_the_total_bound() -> None:
    """A reader that takes a page just within the idle budget, forever, does not hold
    the stop past the total bound."""
    from offtop.cli_io import ReportWriter

    r, w = os.pipe()
    fcntl.fcntl(w, fcntl.F_SETPIPE_SZ, 4096)
    done = threading.Event()

    def trickle() -> None:
        while not done.is_set():
            with contextlib.suppress(OSError):
                os.read(r, 4096)
            time.sleep(0.1)

    reader = threading.Thread(target=trickle)
    reader.start()
    try:
        with ReportWriter(w, idle_s=0.25, total_s=1.0) as writer, \
                _on_signal(signal.SIGUSR1, writer.stop_requested):
            threading.Timer(0.1, os.kill, (os.getpid(), signal.SIGUSR1)).start()
            t0 = time.monotonic()
            writer.write("z" * (1 << 20))  # 256 pages: ~26 s at this pace
            took = time.monotonic() - t0
            assert writer.stalled
            assert 1.0 <= took < 3.0, took
    finally:
        done.set()
        reader.join(timeout=10)
        os.close(w)
        os.close(r)


# --- closed and odd standard streams --------------------------------------------------------


@pytest.mark.bpf
@pytest.mark.parametrize("fd", [0, 2], ids=["stdin-closed", "stderr-closed"])
def test_batch_with_a_closed_std_fd_works_and_never_hands_it_out(bpf_available: None,
                                                                   fd: int) -> None:
    """`<&-` and `2>&-`: offtop works; the fd is /dev/null, not a BPF map or a log file."""
    proc = subprocess.Popen(
        ["sh", "-c", f'exec "$OFFTOP_PY" -m offtop.cli --batch --interval 0.2 {fd}>&-'],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL if fd == 0 else None,
        text=True, cwd=ROOT, env=_env())
    try:
        assert proc.stdout is not None
        first = proc.stdout.readline()  # loaded and reporting (fd 2 is lent out while loading)
        assert first.startswith("offtop "), (first, proc.wait(timeout=10))
        assert os.readlink(f"/proc/{proc.pid}/fd/{fd}") == os.devnull
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=10)
    finally:
        _kill(proc)
    assert proc.returncode == 0
    assert "COMM" in out
    assert "Traceback" not in out and "internal error" not in out


def test_batch_with_stdout_closed_is_one_line() -> None:
    r = _sh('exec "$OFFTOP_PY" -m offtop.cli --batch --count 1 >&-')
    assert_one_line_error(r, "stdout is closed")
    assert r.returncode == 2


@pytest.mark.bpf
def test_batch_into_dev_full_is_one_line(bpf_available: None) -> None:
    r = _sh('exec "$OFFTOP_PY" -m offtop.cli --batch --count 1 --interval 0.2 > /dev/full')
    assert_one_line_error(r, "cannot write to stdout", os.strerror(errno.ENOSPC))
    assert r.returncode == 1


@pytest.mark.bpf
def test_batch_into_a_file_on_a_full_filesystem_is_one_line(bpf_available: None,
                                                             tmp_path: Path) -> None:
    d = tmp_path / "small"
    d.mkdir()
    r = _private_mounts(
        f"mount -t tmpfs -o size=8k none {d} || exit 99; "
        f"head -c 65536 /dev/zero > {d}/filler 2>/dev/null; "
        f'exec "$OFFTOP_PY" -m offtop.cli --batch --count 3 --interval 0.2 > {d}/out')
    assert r.returncode != 99, r.stderr
    assert_one_line_error(r, "cannot write to stdout", os.strerror(errno.ENOSPC))
    assert r.returncode == 1


def _tui_in_tmux(tmux: Tmux, args: str) -> int:
    """Start `offtop args` in the pane; return its pid once the probe is attached."""
    tmux.type(f"cd {ROOT} && {sys.executable} -m offtop.cli {args}; echo offtop-exit=$?")
    shell = tmux.shell_pid()

    def child() -> int:
        with contextlib.suppress(OSError, ValueError, IndexError):
            return int(Path(f"/proc/{shell}/task/{shell}/children").read_text().split()[0])
        return 0

    assert wait_until(lambda: child() != 0, timeout=10), tmux.screen()
    pid = child()
    assert wait_until(lambda: bool(_prog_ids(pid)), timeout=60), tmux.screen()
    return pid


@pytest.mark.bpf
@pytest.mark.parametrize("how", ["q", "C-c", "SIGTERM"])
def test_tui_with_stderr_closed_draws_and_quits(bpf_available: None, how: str) -> None:
    """`offtop 2>&-`: Textual draws on stderr, which is closed; offtop draws on stdout instead."""
    tmux = Tmux()
    pid = 0
    try:
        pid = _tui_in_tmux(tmux, "--interval 0.5 2>&-")
        # Drawn, and refreshing: the header's snapshot number passes #2.
        assert wait_until(lambda: re.search(r"offtop host .* #(?:[2-9]|\d\d+) ", tmux.screen())
                          is not None, timeout=30), tmux.screen()
        progs = _prog_ids(pid)
        t0 = time.monotonic()
        if how == "SIGTERM":
            os.kill(pid, signal.SIGTERM)
        else:
            tmux.run("send-keys", "-t", "t", how)
        gone = wait_until(lambda: process_ended(pid), timeout=10, step=0.02)
        took = time.monotonic() - t0
        assert gone, f"offtop still running 10 s after {how}"
        assert took < 2.0, f"offtop took {took:.2f}s to exit on {how}"
        # The shell's line, not the typed command's `echo offtop-exit=$?` (there as soon
        # as the TUI leaves the screen; beside a CPU hog the shell printed its line later).
        assert wait_until(lambda: _shell_saw_exit(tmux), timeout=5), tmux.screen()
        assert "offtop-exit=0" in tmux.screen(), tmux.screen()
        assert_detached(progs)
    finally:
        tmux.close()
        if pid:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize(("redirect", "needle"), [(">&-", "stdout is closed"),
                                                  ("<&-", "stdin is closed")],
                         ids=["stdout-closed", "stdin-closed"])
def test_tui_with_stdin_or_stdout_closed_is_one_line(redirect: str, needle: str) -> None:
    """The other two streams are a terminal; the TUI needs both stdin and stdout."""
    master, slave = pty.openpty()
    try:
        r = subprocess.run(["sh", "-c", f'exec "$OFFTOP_PY" -m offtop.cli {redirect}'],
                           stdin=slave, stdout=slave, stderr=subprocess.PIPE, text=True,
                           timeout=60, cwd=ROOT, env=_env())
    finally:
        os.close(slave)
        os.close(master)
    assert r.returncode == 2
    assert "Traceback" not in r.stderr
    assert r.stderr.splitlines() == [r.stderr.strip()] and r.stderr.startswith("offtop: ")
    assert needle in r.stderr and "--batch" in r.stderr


# --- --replay of anything ------------------------------------------------------------------


def _good_lines(n: int = 2) -> list[str]:
    return [json.dumps(snapshot_to_json(s)) for s in synthetic_snapshots(n)]


def _with_line(**change: Any) -> list[str]:
    """Two good snapshots, then a third with `change` applied (None removes a key)."""
    lines = _good_lines(3)
    d = json.loads(lines[2])
    for k, v in change.items():
        if v is None:
            del d[k]
        else:
            d[k] = v
    lines[2] = json.dumps(d)
    return lines


def _first_task(**change: Any) -> dict[str, Any]:
    row = dict(json.loads(_good_lines(1)[0])["tasks"][0])
    row.update(change)
    return row


def _write(text: str | bytes) -> Callable[[Path], Path]:
    def make(d: Path) -> Path:
        p = d / "recording.jsonl"
        if isinstance(text, bytes):
            p.write_bytes(text)
        else:
            p.write_text(text)
        return p
    return make


def _sparse(size: int) -> Callable[[Path], Path]:
    def make(d: Path) -> Path:
        p = d / "huge.jsonl"
        with p.open("wb") as f:
            f.truncate(size)
        return p
    return make


def _long_line(size: int) -> Callable[[Path], Path]:
    def make(d: Path) -> Path:
        p = d / "long.jsonl"
        with p.open("w") as f:
            f.write('{"x": "')
            for _ in range(size >> 20):
                f.write("x" * (1 << 20))
            f.write('"}\n')
        return p
    return make


def _fifo(d: Path) -> Path:
    p = d / "fifo.jsonl"
    os.mkfifo(p)
    return p


REPLAYS: list[tuple[str, Callable[[Path], Path], list[str]]] = [
    ("list", _write("[]\n"), ["line 1", "found a list"]),
    ("number", _write("1\n"), ["line 1", "found 1"]),
    ("deeply-nested", _write("[" * 200_000 + "]" * 200_000 + "\n"), ["nested too deeply"]),
    ("2-GiB", _sparse(2 << 30), ["2048 MiB", "256 MiB"]),
    ("line-of-65-MiB", _long_line(65 << 20), ["line 1", "longer than 64 MiB"]),
    ("fifo", _fifo, ["a FIFO"]),
    ("dev-zero", lambda d: Path("/dev/zero"), ["a device"]),
    ("binary-junk", _write(bytes(range(255, -1, -1)) * 64), ["line 1", "not UTF-8"]),
    ("empty", _write("\n\n"), ["holds no snapshots"]),
    ("truncated-json", _write("\n".join(_good_lines()) + '\n{"seq": 3, "tasks": [\n'),
     ["line 3", "not JSON"]),
    ("pid-a-string", _write("\n".join(_with_line(tasks=[_first_task(pid="12")]))),
     ["line 3", "tasks[0].pid", "a string"]),
    ("tasks-an-object", _write("\n".join(_with_line(tasks={"pid": 1}))),
     ["line 3", "tasks: expected a list"]),
    ("kernel-frames-a-string", _write("\n".join(_with_line(
        stacks=[{**json.loads(_good_lines(1)[0])["stacks"][0], "kernel": "schedule"}]))),
     ["line 3", "stacks[0].kernel", "a list of strings"]),
    ("time-missing", _write("\n".join(_with_line(time=None))), ["line 3", "time is missing"]),
    ("time-far-away", _write("\n".join(_with_line(time=1e300))), ["line 3", "time"]),
    ("time-nan", _write("\n".join(_good_lines()) + '\n{"time": NaN}\n'), ["line 3", "NaN"]),
    ("negative-count", _write("\n".join(_with_line(tasks=[_first_task(count=-1)]))),
     ["line 3", "tasks[0].count"]),
]


def _limit_memory() -> None:
    # Bounded memory, checked by the kernel: 1 GiB of address space is ample for
    # a replay (no compiler is loaded) and far from what /dev/zero would take.
    resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))


@pytest.mark.parametrize(("make", "needles"), [(m, n) for _, m, n in REPLAYS],
                         ids=[name for name, _, _ in REPLAYS])
def test_replay_of_anything_but_a_recording_is_one_line(tmp_path: Path,
                                                        make: Callable[[Path], Path],
                                                        needles: list[str]) -> None:
    path = make(tmp_path)
    t0 = time.monotonic()
    try:
        r = subprocess.run([*OFFTOP, "--batch", "--replay", str(path)], capture_output=True,
                           text=True, timeout=30, cwd=ROOT, preexec_fn=_limit_memory)
    except subprocess.TimeoutExpired:
        pytest.fail(f"--replay {path} still reading after 30 s")
    assert time.monotonic() - t0 < 30
    assert_one_line_error(r, "cannot read recording", str(path), *needles)
    assert r.returncode == 2


# --- pid namespaces, /proc, memory, /run/offtop -----------------------------------------------


@pytest.mark.parametrize("args", [[], ["-p", "1"]], ids=["all-tasks", "pid-1"])
def test_in_a_pid_namespace_of_its_own_offtop_refuses(args: list[str]) -> None:
    """Inside, pid 1 is the namespace's init; the kernel would report host pids."""
    need_root()
    r = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", *OFFTOP, "--batch",
                        "--count", "1", *args], capture_output=True, text=True, timeout=60,
                       cwd=ROOT)
    assert_one_line_error(r, "pid namespace of its own", "host's pid namespace")
    assert r.returncode == 1


def test_proc_with_subset_pid_is_one_line() -> None:
    r = _private_mounts('mount -t proc -o subset=pid proc /proc || exit 99; '
                        'exec "$OFFTOP_PY" -m offtop.cli --batch --count 1')
    if r.returncode == 99:
        pytest.skip(f"this kernel cannot mount proc with subset=pid: {r.stderr.strip()}")
    assert_one_line_error(r, "subset=pid", "--no-kernel-stacks")
    assert r.returncode == 1


def test_a_tight_address_space_limit_is_a_memory_message() -> None:
    """`ulimit -v 300000`: not "reinstall libbpfcc", and no silent abort inside LLVM."""
    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (300 << 20, resource.RLIM_INFINITY))

    r = subprocess.run([*OFFTOP, "--batch", "--count", "1"], capture_output=True, text=True,
                       timeout=60, cwd=ROOT, preexec_fn=limit)
    line = assert_one_line_error(r, "ulimit -v", "300 MiB", "512 MiB")
    assert "libbpfcc" not in line
    assert r.returncode == 1


def test_bcc_library_that_cannot_be_mapped_is_a_memory_message(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The loader's ENOMEM under `ulimit -v` is not a broken installation."""
    import importlib.abc

    class NoRoom(importlib.abc.MetaPathFinder):
        def find_spec(self, name: str, path: Any = None, target: Any = None) -> None:
            if name == "bcc" or name.startswith("bcc."):
                raise OSError("libLLVM-14.so.1: failed to map segment from shared object")
            return None

    for name in [m for m in sys.modules if m == "bcc" or m.startswith("bcc.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(sys, "meta_path", [NoRoom(), *sys.meta_path])
    with pytest.raises(EnvironmentProblem) as e:
        environment.check_bcc_importable()
    assert "out of memory" in str(e.value) and "ulimit -v" in str(e.value)
    assert "libbpfcc" not in str(e.value)


@pytest.mark.bpf
def test_run_offtop_a_file_is_one_line(bpf_available: None) -> None:
    """/run/offtop, where Debian's split kernel headers are joined, is a file."""
    if Path("/sys/kernel/kheaders.tar.xz").exists():
        pytest.skip("this kernel carries its own headers (kheaders)")
    if not any(Path("/usr/src").glob("linux-headers-*-common")):
        pytest.skip("no split Debian kernel headers here: /run/offtop is never used")
    r = _private_mounts(
        "for d in /lib/modules /run; do mount -t tmpfs none $d || exit 99; done; "
        "echo x > /run/offtop; "
        'exec "$OFFTOP_PY" -m offtop.cli --batch --count 1')
    assert r.returncode != 99, r.stderr
    assert_one_line_error(r, "/run/offtop is not a directory", "BCC_KERNEL_SOURCE")
    assert r.returncode == 1


# --- -p of a thread, --states ------------------------------------------------------------------


@pytest.fixture
def threaded_process() -> Iterator[tuple[int, int]]:
    """A process with a second thread: (pid, tid of that thread)."""
    proc = subprocess.Popen(
        [sys.executable, "-c",
         "import threading, time\n"
         "t = threading.Thread(target=time.sleep, args=(120,), daemon=True)\n"
         "t.start()\n"
         "print(threading.get_native_id(), t.native_id, flush=True)\n"
         "time.sleep(120)\n"],
        stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        pid, tid = map(int, proc.stdout.readline().split())
        yield pid, tid
    finally:
        _kill(proc)


def test_pid_option_given_a_thread_suggests_tid(threaded_process: tuple[int, int]) -> None:
    pid, tid = threaded_process
    assert pid != tid
    r = subprocess.run([*OFFTOP, "--batch", "--count", "1", "-p", f"{pid},{tid}"],
                       capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert_one_line_error(r, f"{tid} is a thread of process {pid}", f"use -t {tid}")
    assert r.returncode == 2


BAD_STATES = [
    (["--states", "SZ"], ["Z (zombie) is never recorded", "never runs again"]),
    (["--states", "X"], ["X (dead) is never recorded"]),
    (["--states", "SP"], ["P (parked)", "--kernel-threads"]),
    (["--states", "s"], ["unknown state 's'", "did you mean 'S'"]),
    (["--states="], ["at least one state letter"]),
]


@pytest.mark.parametrize(("args", "needles"), BAD_STATES,
                         ids=[a[-1] or "empty" for a, _ in BAD_STATES])
def test_states_only_takes_letters_offtop_can_record(args: list[str],
                                                     needles: list[str]) -> None:
    r = subprocess.run([*OFFTOP, "--batch", "--count", "1", *args], capture_output=True,
                       text=True, timeout=60, cwd=ROOT)
    assert_one_line_error(r, "--states", *needles)
    assert r.returncode == 2


# --- targets that go away: status 3 ---------------------------------------------------------


def reap(w: Any) -> None:
    """Wait for the workload's exit as its parent, as a shell would (no zombie is left)."""
    threading.Thread(target=w.proc.wait, daemon=True).start()



@pytest.mark.bpf
@pytest.mark.parametrize("fmt", ["text", "json", "folded", "pprof"])
def test_batch_ends_with_status_3_once_nothing_is_left_to_watch(bpf_available: None,
                                                                workloads: Any, fmt: str,
                                                                tmp_path: Path) -> None:
    """-p of a process that exits: its last interval is printed, then one line, status 3."""
    w = workloads("sleep", "100", "20")  # 20 sleeps of 100 ms, then it exits
    reap(w)
    out = tmp_path / "whole-run.pb.gz"
    args = ["-o", str(out)] if fmt == "pprof" else []
    t0 = time.monotonic()
    r = subprocess.run([*OFFTOP, "--batch", "--format", fmt, "--interval", "0.5",
                        "-p", str(w.pid), *args], capture_output=True, text=True, timeout=60,
                       cwd=ROOT)
    assert r.returncode == 3, r.stderr
    assert time.monotonic() - t0 < 30
    gone = f"pid {w.pid} exited"
    # Said once, last, as one line (its notice is not said twice).
    assert r.stderr.splitlines() == [f"offtop: nothing left to watch: {gone}"], r.stderr
    if fmt == "text":
        last = r.stdout.rstrip().split("\n\n")[-1].splitlines()  # the last interval's report
        assert f"notice: {gone}" in last and any("COMM" in line for line in last)
    elif fmt == "json":
        last = json.loads(r.stdout.splitlines()[-1])
        assert last["notices"] == [gone] and last["finished"] == f"nothing left to watch: {gone}"
        assert any(t["pid"] == w.pid for d in map(json.loads, r.stdout.splitlines())
                   for t in d["tasks"])
    elif fmt == "folded":
        assert any("offtop_wl_sleep" in line for line in r.stdout.splitlines())
    else:
        assert out.stat().st_size > 0 and r.stdout == ""


@pytest.mark.bpf
@pytest.mark.parametrize("fmt", ["json", "folded"])
def test_a_notice_goes_to_stderr_while_the_run_goes_on(bpf_available: None, workloads: Any,
                                                       fmt: str) -> None:
    """Of two processes, one exits: said on stderr (json and folded have no room for it).

    The one that exits is ended once offtop's first interval is out: a process
    that lived a fixed half second was gone before a slow start checked the
    pids ("no such pid", as it should say for a pid gone at the start)."""
    short = workloads("sleep", "100")  # ~10 s of sleeps: ended below
    long = workloads("sleep", "100")
    off = subprocess.Popen([*OFFTOP, "--batch", "--format", fmt, "--interval", "0.5", "--count",
                            "5", "-p", f"{short.pid},{long.pid}"], stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        assert off.stdout is not None
        first = off.stdout.readline()  # both are watched now
        short.stop()
        rest, err = off.communicate(timeout=60)
    finally:
        if off.poll() is None:
            off.kill()
            off.wait(timeout=5)
    r = subprocess.CompletedProcess(off.args, off.returncode, first + rest, err)
    assert r.returncode == 0, r.stderr
    assert r.stderr.splitlines() == [f"offtop: pid {short.pid} exited"], r.stderr
    if fmt == "json":
        notices = [n for line in r.stdout.splitlines() for n in json.loads(line)["notices"]]
        assert notices == [f"pid {short.pid} exited"]
        assert all(not json.loads(line)["finished"] for line in r.stdout.splitlines())
