"""Command line: validate everything first, then run the TUI or batch mode.

Bad input ends with one line on stderr and exit status 2; a machine that
cannot run offtop ends with one line and status 1; never a traceback. A
stop by signal (SIGINT, SIGTERM, SIGHUP) is a normal end: status 0.

The standard streams are taken as they come: any of fds 0-2 that is closed
is reopened on /dev/null before anything else is opened (see `StdStreams`);
batch mode needs stdout, the TUI a terminal on stdin and stdout. A stalled
stdout never holds a signal back (see `ReportWriter`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from types import FrameType
from typing import TYPE_CHECKING, NoReturn, TextIO

from offtop import __version__
from offtop.bpf.decode import DEFAULT_STATES, state_mask
from offtop.bpf.environment import EnvironmentProblem, check_host_view, memory_problem
from offtop.cgroups import CgroupError, resolve_cgroup
from offtop.model import Snapshot
from offtop.report import FORMATS, folded_lines, snapshot_to_json, text_report
from offtop.source import SnapshotSource
from offtop.units import DurationError, parse_duration_ns, parse_interval_s

if TYPE_CHECKING:
    from offtop.bpf.engine import EngineConfig

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_USAGE = 2

_STREAM_NAMES = ("stdin", "stdout", "stderr")


class UsageError(Exception):
    """Bad input; the message is one line for users."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{message} (see offtop --help)")


def build_parser() -> argparse.ArgumentParser:
    """offtop's options (the README's table mirrors this)."""
    p = _Parser(
        prog="offtop",
        description="A live, top-like view of where Linux threads spend their time off the CPU.",
    )
    p.add_argument("--batch", action="store_true", help="print reports instead of the TUI")
    p.add_argument("--format", choices=FORMATS, default="text", help="batch output format")
    p.add_argument("--count", type=str, default=None, metavar="N",
                   help="exit after N intervals (batch mode)")
    p.add_argument("--interval", type=str, default="1", metavar="S",
                   help="refresh interval in seconds (default 1)")
    p.add_argument("--threshold", type=str, default="500ms", metavar="DUR",
                   help="blocks this long or longer arrive one by one as events "
                        "(ns/us/ms/s; a bare number is ms; default 500ms; 0: every block)")
    p.add_argument("-c", "--cgroup", metavar="PATH",
                   help="only tasks in this cgroup v2 and its descendants")
    p.add_argument("-p", "--pid", metavar="PIDS", help="only these processes (comma list)")
    p.add_argument("-t", "--tid", metavar="TIDS", help="only these threads (comma list)")
    p.add_argument("--states", default=DEFAULT_STATES, metavar="LETTERS",
                   help=f"task states to record (default {DEFAULT_STATES}; add R for "
                        "runqueue wait after preemption, T/t for stopped/traced)")
    p.add_argument("--kernel-threads", action="store_true", help="include kernel threads")
    p.add_argument("--no-kernel-stacks", action="store_true", help="do not capture kernel stacks")
    p.add_argument("--no-user-stacks", action="store_true", help="do not capture user stacks")
    p.add_argument("--no-stacks", action="store_true", help="capture no stacks (cheapest)")
    p.add_argument("--replay", metavar="FILE",
                   help="show a recording (offtop --batch --format json) instead of live data")
    p.add_argument("--version", action="version", version=f"offtop {__version__}")
    return p


# --- option values ---------------------------------------------------------------


def _thread_group(tid: int) -> int | None:
    """The process (tgid) task `tid` belongs to, or None if there is no such task.

    /proc/TID exists for every thread, listed or not, so existence alone
    cannot tell a process from one of its threads; the Tgid line can.
    """
    try:
        with open(f"/proc/{tid}/status", "rb") as f:
            for line in f:
                if line.startswith(b"Tgid:"):
                    return int(line.split()[1])
    except (FileNotFoundError, ProcessLookupError):
        return None
    except (OSError, ValueError, IndexError):
        pass  # it exists; what it is cannot be read
    return tid


def parse_ids(text: str, what: str) -> tuple[int, ...]:
    """A comma list of positive ids; each must name a live process (pid) or thread (tid)."""
    ids = []
    for part in text.split(","):
        part = part.strip()
        if not part.isdigit() or int(part) <= 0:
            raise UsageError(f"invalid {what} {part!r}: expected positive numbers, e.g. 1234,5678")
        n = int(part)
        if n > 4_194_304:
            raise UsageError(f"invalid {what} {n}: larger than any pid Linux allows")
        tgid = _thread_group(n)
        if tgid is None:
            raise UsageError(f"no such {what}: {n}")
        if what == "pid" and tgid != n:
            raise UsageError(f"{n} is a thread of process {tgid}, not a process: use -t {n} "
                             f"for that thread (or -p {tgid} for all its threads)")
        ids.append(n)
    return tuple(dict.fromkeys(ids))


#: The states `--states` takes: the letters of the tracepoint's normalized
#: prev_state (decode.STATE_BITS) that can start a block, i.e. a switch-out
#: that a switch-in of the same task ends.
RECORDABLE_STATES: Mapping[str, str] = {
    "S": "sleeping", "D": "uninterruptible", "I": "idle wait", "R": "preempted",
    "T": "stopped", "t": "traced", "P": "parked kernel thread",
}
#: A task switches out in X or Z only on its way out of do_exit(), and never
#: runs again: a block in these states never ends, so none is ever recorded.
_EXIT_STATES: Mapping[str, str] = {"X": "dead", "Z": "zombie"}


def parse_states(text: str, *, kernel_threads: bool) -> str:
    """--states: letters from RECORDABLE_STATES, or a `UsageError` that says which and why."""
    if not text:
        raise UsageError(f"--states: give at least one state letter, e.g. {DEFAULT_STATES}")
    known = ", ".join(f"{k} {v}" for k, v in RECORDABLE_STATES.items())
    for ch in text:
        if ch not in RECORDABLE_STATES and ch not in _EXIT_STATES:
            hint = f" (did you mean {ch.upper()!r}?)" if ch.upper() in RECORDABLE_STATES else ""
            raise UsageError(f"--states: unknown state {ch!r} in {text!r}{hint}: use {known}")
    for ch in text:
        if ch in _EXIT_STATES:
            raise UsageError(
                f"--states: {ch} ({_EXIT_STATES[ch]}) is never recorded: a task switches out "
                "in X or Z only as it exits and never runs again, so such a block never ends")
    if "P" in text and not kernel_threads:
        raise UsageError("--states: P (parked) is a state only kernel threads enter: "
                         "add --kernel-threads")
    try:
        state_mask(text)
    except ValueError as e:  # RECORDABLE_STATES and decode.STATE_BITS disagree
        raise UsageError(f"--states: {e}") from None
    return text


def parse_interval_arg(text: str) -> float:
    """--interval in seconds, or a `UsageError`."""
    try:
        return parse_interval_s(text)
    except DurationError as e:
        raise UsageError(f"--interval: {e}") from None


def parse_count(text: str | None) -> int | None:
    """--count: a positive whole number of intervals, or None for "until stopped"."""
    if text is None:
        return None
    t = text.strip()
    if not t.isdigit() or int(t) <= 0:
        raise UsageError(f"invalid --count {text!r}: expected a positive whole number")
    return int(t)


def _value_options(parser: argparse.ArgumentParser) -> set[str]:
    return {
        opt
        for action in parser._actions
        if action.option_strings and action.nargs is None
        for opt in action.option_strings
    }


def join_negative_values(argv: Sequence[str], parser: argparse.ArgumentParser) -> list[str]:
    """`--threshold -5ms` -> `--threshold=-5ms`, so a negative value reaches its validator.

    argparse takes any word that starts with '-' and is not a plain negative
    number for an option, and would answer "expected one argument", which
    does not say what is wrong.
    """
    opts = _value_options(parser)
    out: list[str] = []
    i = 0
    while i < len(argv):
        a = argv[i]
        if a == "--":
            out.extend(argv[i:])
            break
        nxt = argv[i + 1] if i + 1 < len(argv) else ""
        if a in opts and len(nxt) > 1 and nxt[0] == "-" and (nxt[1].isdigit() or nxt[1] == "."):
            out.append(f"{a}={nxt}")
            i += 2
            continue
        out.append(a)
        i += 1
    return out


def config_from_args(args: argparse.Namespace) -> tuple[EngineConfig, float, int | None]:
    """Validate every option; return (EngineConfig, interval_s, count)."""
    from offtop.bpf.engine import EngineConfig

    try:
        threshold = parse_duration_ns(args.threshold)
    except DurationError as e:
        raise UsageError(f"--threshold: {e}") from None
    interval = parse_interval_arg(args.interval)
    count = parse_count(args.count)
    states = parse_states(args.states, kernel_threads=args.kernel_threads)
    # `is not None`: an empty list (-p '') is an error, not "every process".
    pids = parse_ids(args.pid, "pid") if args.pid is not None else ()
    tids = parse_ids(args.tid, "tid") if args.tid is not None else ()
    cgroup = None
    if args.cgroup is not None:
        try:
            cgroup = str(resolve_cgroup(args.cgroup))
        except CgroupError as e:
            raise UsageError(str(e)) from None
    scope = []
    if cgroup:
        scope.append(f"cgroup {cgroup}")
    if pids:
        scope.append("pid " + ",".join(map(str, pids)))
    if tids:
        scope.append("tid " + ",".join(map(str, tids)))
    cfg = EngineConfig(
        threshold_ns=threshold,
        states=states,
        kthreads=args.kernel_threads,
        user_stacks=not (args.no_user_stacks or args.no_stacks),
        kernel_stacks=not (args.no_kernel_stacks or args.no_stacks),
        pids=pids,
        tids=tids,
        cgroup=cgroup,
        scope="; ".join(scope),
    )
    return cfg, interval, count


# --- standard streams ------------------------------------------------------------


class StdStreams:
    """fds 0-2 as offtop found them, each made open before anything else is.

    A closed fd 0, 1 or 2 is handed out by the next open(), and then whatever
    is "printed" lands in that file: with fd 2 closed, libbcc's compiler log
    went into offtop's own temporary file, and Textual drew the TUI into
    whatever came next. Python leaves sys.stdin/stdout/stderr None for a
    closed fd (and print(file=None) writes to stdout). So each closed fd is
    reopened on /dev/null, and its Python stream rebuilt over it.
    """

    def __init__(self, closed: frozenset[int]) -> None:
        self.closed = closed

    @classmethod
    def claim(cls) -> StdStreams:
        """Reopen every closed fd of 0-2 on /dev/null; remember which were closed."""
        closed = set()
        for fd in (0, 1, 2):
            try:
                os.fstat(fd)
            except OSError:
                closed.add(fd)
                null = os.open(os.devnull, os.O_RDWR)  # the lowest free fd: this one
                if null != fd:
                    os.dup2(null, fd)
                    os.close(null)
        for fd in sorted(closed):
            name = _STREAM_NAMES[fd]
            if getattr(sys, name) is None:
                stream = open(fd, "r" if fd == 0 else "w", buffering=1 if fd else -1,  # noqa: SIM115
                              encoding="utf-8", errors="backslashreplace", closefd=False)
                # Textual reads sys.__stdin__ and draws on sys.__stderr__: both must exist.
                setattr(sys, name, stream)
                setattr(sys, f"__{name}__", stream)
        return cls(frozenset(closed))

    def is_terminal(self, fd: int) -> bool:
        """Is `fd` a terminal offtop was given (not a /dev/null of its own)?"""
        return fd not in self.closed and os.isatty(fd)

    def check_batch(self) -> None:
        """Batch mode needs somewhere to write its reports."""
        if 1 in self.closed:
            raise UsageError("stdout is closed: batch mode has nowhere to write its reports")

    def check_tui(self) -> None:
        """The TUI reads keys from stdin and draws on stdout: both must be a terminal."""
        batch = "use --batch for text, json or folded output"
        for fd, does in ((1, "draws on it"), (0, "reads keys from it")):
            name = _STREAM_NAMES[fd]
            if fd in self.closed:
                raise UsageError(f"{name} is closed: the TUI {does}; {batch}")
            if not os.isatty(fd):
                raise UsageError(f"{name} is not a terminal: the TUI {does}; {batch}")

    @contextlib.contextmanager
    def screen_on_stdout(self) -> Iterator[None]:
        """For the TUI's lifetime, fd 2 is stdout's terminal if it is not a terminal itself.

        Textual draws on stderr (sys.__stderr__). With stderr closed or sent
        to a file the TUI would draw into /dev/null or that file while keys
        still work; offtop draws where stdout is, and messages written after
        the TUI has ended go to the stderr the user gave.
        """
        if self.is_terminal(2):
            yield
            return
        saved = os.dup(2)
        sys.stderr.flush()
        os.dup2(1, 2)
        try:
            yield
        finally:
            with contextlib.suppress(OSError, ValueError):
                sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)

    def report(self, message: str) -> None:
        """`offtop: message` as one line on stderr, if offtop was given one; never blocks long."""
        if 2 in self.closed:
            return
        # One line, always: a message from below (bcc, the kernel) may hold newlines.
        line = "offtop: " + " ".join(message.split()) + "\n"
        with contextlib.suppress(OSError, ValueError, OutputError), \
                ReportWriter(2, budget_s=0.2) as w:
            w.stop_requested()  # 0.2 s at most: stderr may be a pipe nobody reads
            w.write(line)


# --- batch mode --------------------------------------------------------------------


class OutputStalled(Exception):
    """A write that outlived its budget after a stop request (the reader is not reading)."""


class OutputError(Exception):
    """stdout refused a report (ENOSPC, EIO, ...); the message is one line for users."""


class ReportWriter:
    """Writes whole reports to a file descriptor; after a stop request, within a time budget.

    A write(2) blocked on a full pipe is restarted after a signal handler
    returns (PEP 475), so with a reader that never reads, SIGTERM would wait
    for that reader forever. Once a stop is requested, a real-time timer
    bounds the writing that is left: what can be written within `budget_s`
    is (a line being taken by a slow reader is finished), then the write
    in progress is abandoned and `stalled` is set; later writes are skipped.
    Writes go to the fd directly: CPython's buffered writer can drop data
    when a signal handler runs while it is blocked.

    Use it as a context manager (it owns SIGALRM meanwhile), on the main thread.
    """

    def __init__(self, fd: int, *, budget_s: float = 0.25) -> None:
        self.fd = fd
        self.stalled = False
        self._budget = budget_s
        self._stopping = False
        self._writing = False
        self._armed_at = 0.0
        self._old_alarm: Callable[[int, FrameType | None], object] | int | None = None

    def __enter__(self) -> ReportWriter:
        self._old_alarm = signal.signal(signal.SIGALRM, self._on_alarm)
        return self

    def __exit__(self, *exc: object) -> None:
        self._disarm()
        signal.signal(signal.SIGALRM, self._old_alarm)

    def stop_requested(self) -> None:
        """Called from a signal handler: bound the write in progress and every later one."""
        if not self._stopping:
            self._stopping = True
            if self._writing:
                self._arm()

    def write(self, text: str) -> None:
        """All of `text`, unless a stop was requested and the budget runs out first."""
        if self.stalled:
            return
        data = memoryview(text.encode("utf-8", errors="replace"))
        try:
            self._writing = True
            if self._stopping:
                self._arm()
            while data:
                n = os.write(self.fd, data)  # may be partial
                data = data[n:]
        except OutputStalled:
            self.stalled = True
        except BrokenPipeError:
            raise
        except OSError as e:
            raise OutputError(f"cannot write to {_fd_name(self.fd)}: "
                              f"{e.strerror or e}") from None
        finally:
            self._writing = False
            self._disarm()

    def _arm(self) -> None:
        if self._budget <= 0:
            raise OutputStalled
        self._armed_at = time.monotonic()
        signal.setitimer(signal.ITIMER_REAL, self._budget)

    def _disarm(self) -> None:
        if self._armed_at:
            signal.setitimer(signal.ITIMER_REAL, 0)
            self._budget -= time.monotonic() - self._armed_at
            self._armed_at = 0.0

    def _on_alarm(self, signum: int, frame: FrameType | None) -> None:
        if self._writing:
            raise OutputStalled  # out of the blocked os.write(), which is not retried


def _fd_name(fd: int) -> str:
    return _STREAM_NAMES[fd] if fd < len(_STREAM_NAMES) else f"fd {fd}"


def _render(snap: Snapshot, fmt: str) -> str:
    if fmt == "json":
        return json.dumps(snapshot_to_json(snap), separators=(",", ":")) + "\n"
    if fmt == "folded":
        lines = folded_lines(snap)
        return "\n".join(lines) + "\n" if lines else ""
    return text_report(snap) + "\n\n"


@contextlib.contextmanager
def _signal_handlers(handlers: Mapping[int, Callable[[int, FrameType | None], None]]
                     ) -> Iterator[None]:
    old = {sig: signal.signal(sig, h) for sig, h in handlers.items()}
    try:
        yield
    finally:
        for sig, h in old.items():
            signal.signal(sig, h)


def run_batch(source: SnapshotSource, fmt: str, interval_s: float, count: int | None,
              out: TextIO | None = None, *,
              report: Callable[[str], None] | None = None) -> int:
    """Print one report per interval until `count` or a signal; then the partial one.

    `out` defaults to stdout; `report` gets a line for stderr when a stop
    left the last report unwritten (stdout not being read).
    """
    stream = sys.stdout if out is None else out
    try:
        fd = stream.fileno()
    except (AttributeError, OSError, ValueError):  # not a real file (tests)
        return _run_batch_into(source, fmt, interval_s, count, stream)
    stream.flush()
    stop = threading.Event()
    with ReportWriter(fd) as writer:

        def on_signal(signum: int, frame: FrameType | None) -> None:
            stop.set()
            writer.stop_requested()

        sigs = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
        with _signal_handlers(dict.fromkeys(sigs, on_signal)):
            _batch_loop(source, fmt, interval_s, count, stop, writer.write)
    if writer.stalled and report is not None:
        report(f"{_fd_name(fd)} is not being read: stopped with the last report unwritten")
    return EXIT_OK


def _run_batch_into(source: SnapshotSource, fmt: str, interval_s: float, count: int | None,
                    stream: TextIO) -> int:
    def write(text: str) -> None:
        stream.write(text)
        stream.flush()

    _batch_loop(source, fmt, interval_s, count, threading.Event(), write)
    return EXIT_OK


def _batch_loop(source: SnapshotSource, fmt: str, interval_s: float, count: int | None,
                stop: threading.Event, write: Callable[[str], None]) -> None:
    with _exit_at_once_on_signal():
        source.start()
    if stop.is_set():
        return
    n = 0
    while not stop.is_set():
        snap = source.next_snapshot(interval_s, stop)
        if snap is None:
            break
        text = _render(snap, fmt)
        if text:
            write(text)
        n += 1
        if count is not None and n >= count:
            return
    # Interrupted: print what the unfinished interval holds, then leave.
    last = source.next_snapshot(0.0, threading.Event())
    if last is not None and (last.tasks or last.long_blocks):
        text = _render(last, fmt)
        if text:
            write(text)


@contextlib.contextmanager
def _exit_at_once_on_signal() -> Iterator[None]:
    """While bcc compiles and loads (seconds, in C), a signal ends the process at once.

    Python runs signal handlers only between bytecodes of the main thread,
    so a Ctrl-C during BPF() would wait for the compiler. The C-level
    handler writes to the wakeup fd at once, though; a thread reading it
    exits the process, which closes every fd: anything half attached goes
    with them. Nothing has been printed yet, so nothing is lost.
    """
    rfd, wfd = os.pipe()
    os.set_blocking(wfd, False)
    done = threading.Event()

    def watch() -> None:
        while True:
            try:
                data = os.read(rfd, 64)
            except OSError:
                return
            if not data or done.is_set():
                return
            os._exit(EXIT_OK)

    old = signal.set_wakeup_fd(wfd, warn_on_full_buffer=False)
    watcher = threading.Thread(target=watch, name="offtop-start-signals", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        done.set()
        signal.set_wakeup_fd(old)
        os.close(wfd)  # the watcher reads EOF and returns
        watcher.join(timeout=1.0)
        os.close(rfd)


# --- main ----------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    """The `offtop` console entry point."""
    streams = StdStreams.claim()

    def fail(msg: str, code: int) -> int:
        streams.report(msg)
        return code

    try:
        return _main(streams, sys.argv[1:] if argv is None else list(argv), fail)
    except MemoryError:
        return fail(memory_problem("(MemoryError)"), EXIT_FAILURE)
    except KeyboardInterrupt:  # Ctrl-C before batch mode or the TUI took signals over
        return EXIT_OK


def _main(streams: StdStreams, argv: list[str], fail: Callable[[str, int], int]) -> int:
    from offtop.bpf.engine import BpfSource, EngineError

    source: SnapshotSource
    try:
        parser = build_parser()
        args = parser.parse_args(join_negative_values(argv, parser))
        if args.replay:
            source, interval, count = _replay_source(args)
        else:
            # Before -p/-t are looked up in /proc: in a pid namespace of its
            # own, /proc would answer for pids the kernel does not report.
            check_host_view(kernel_stacks=not (args.no_kernel_stacks or args.no_stacks))
            cfg, interval, count = config_from_args(args)
        if args.batch:
            streams.check_batch()
        else:
            streams.check_tui()
        if not args.replay:
            source = BpfSource(cfg)
    except UsageError as e:
        return fail(f"error: {e}", EXIT_USAGE)
    except EnvironmentProblem as e:
        return fail(str(e), EXIT_FAILURE)

    try:
        if args.batch:
            if args.replay and not streams.is_terminal(1):
                interval = 0.0  # a recording piped elsewhere: no need to wait
            return run_batch(source, args.format, interval, count, report=streams.report)
        return _run_tui(streams, source, interval, fail)
    except (EnvironmentProblem, EngineError, OutputError) as e:
        return fail(str(e), EXIT_FAILURE)
    except BrokenPipeError:
        # The reader went away (e.g. `| head`): not an error for a report printer.
        os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
        return EXIT_OK
    except KeyboardInterrupt:
        return EXIT_OK
    except MemoryError:
        raise
    except Exception as e:
        if os.environ.get("OFFTOP_DEBUG"):
            raise
        return fail(f"internal error: {type(e).__name__}: {e} (OFFTOP_DEBUG=1 shows where)",
                    EXIT_FAILURE)
    finally:
        source.close()


def _run_tui(streams: StdStreams, source: SnapshotSource, interval: float,
             fail: Callable[[str, int], int]) -> int:
    from offtop.app import run_app
    from offtop.exit_guard import ExitGuard

    errors: list[BaseException] = []
    # Whatever hangs in the TUI's shutdown, the process (and with it the
    # probe) goes away half a second after the app was asked to stop.
    with streams.screen_on_stdout(), ExitGuard(source, tty_fd=0) as guard:
        code = run_app(guard.source, interval_s=interval, on_error=errors.append)
    if errors:  # said after the terminal is back and stderr is the user's again
        return fail(str(errors[0]), EXIT_FAILURE)
    return code


def _replay_source(args: argparse.Namespace) -> tuple[SnapshotSource, float, int | None]:
    from offtop.source import RecordingError, ReplaySource

    interval = parse_interval_arg(args.interval)
    count = parse_count(args.count)
    try:
        source = ReplaySource.from_jsonl(args.replay)
    except RecordingError as e:
        raise UsageError(f"cannot read recording {args.replay}: {e}") from None
    return source, interval, count


if __name__ == "__main__":
    sys.exit(main())
