"""The command line's plumbing: standard streams, stall-proof writes, signals, output files.

The standard streams are taken as they come: any of fds 0-2 that is closed
is reopened on /dev/null before anything else is opened (`StdStreams`);
batch mode needs stdout (or -o), the TUI a terminal on stdin and stdout. A
stalled stdout never holds a signal back (`ReportWriter`). Files offtop
writes for the user (-o, --record) are opened by `open_output`: regular
files only, never through a symbolic link, created private (0600, as perf
does with perf.data: they hold every process's names and command lines).
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import stat
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from types import FrameType
from typing import NoReturn

from offtop import early_signal
from offtop.cli_args import EXIT_OK, UsageError

STREAM_NAMES = ("stdin", "stdout", "stderr")


# --- standard streams ------------------------------------------------------------


def end_process(status: int) -> NoReturn:
    """End offtop with `status` once `cli.main` has returned, without Python's teardown.

    By then the probe is detached and every output closed and said (`cli._main`);
    what the interpreter's exit does next is free the heap object by object:
    0.6 s on a busy server (~150 MB of rows and frames), measured between
    `main`'s return and the process's end, after a `q` that took 1.2 s to give
    the shell back. The standard streams are flushed first (one whose reader is
    gone, `| head`, is passed over: nothing more can reach it).
    """
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            if stream is not None:
                stream.flush()
    os._exit(status)


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
            name = STREAM_NAMES[fd]
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
            name = STREAM_NAMES[fd]
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
                ReportWriter(2, idle_s=0.2, total_s=0.2) as w:
            w.stop_requested()  # 0.2 s at most: stderr may be a pipe nobody reads
            w.write(line)


class OutputStalled(Exception):
    """A write the reader stopped taking after a stop request."""


class OutputError(Exception):
    """An output refused what offtop wrote (ENOSPC, EIO, ...); the message is one line for users."""


class ReportWriter:
    """Writes whole reports to a file descriptor; after a stop request, while the reader reads.

    A write(2) blocked on a full pipe is restarted after a signal handler
    returns (PEP 475), so with a reader that never reads, SIGTERM would wait
    for that reader forever. Reports go out in chunks of one page, each
    write(2) either done or blocked as a whole (PIPE_BUF). Once a stop is
    requested, a real-time timer bounds each chunk: a reader that takes a
    chunk within `idle_s` gets the next one, so a slow but live reader still
    gets the last report whole; one that takes nothing for `idle_s`, or is
    still taking after `total_s`, is given up on: the write in progress is
    abandoned and `stalled` is set; later writes are skipped.
    Writes go to the fd directly: CPython's buffered writer can drop data
    when a signal handler runs while it is blocked.

    Use it as a context manager (it owns SIGALRM meanwhile), on the main thread.
    """

    CHUNK = select.PIPE_BUF
    """Bytes per write(2): a pipe takes them all at once or none."""

    def __init__(self, fd: int, *, idle_s: float = 0.25, total_s: float = 2.0,
                 name: str | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.fd = fd
        self.name = name or fd_name(fd)
        """How messages name the output (stdout, -o FILE)."""
        self.stalled = False
        self._idle = idle_s
        self._total = total_s
        self._clock = clock
        self._deadline: float | None = None  # set by the stop request
        self._writing = False
        self._old_alarm: Callable[[int, FrameType | None], object] | int | None = None

    def __enter__(self) -> ReportWriter:
        self._old_alarm = signal.signal(signal.SIGALRM, self._on_alarm)
        return self

    def __exit__(self, *exc: object) -> None:
        self._disarm()
        signal.signal(signal.SIGALRM, self._old_alarm)

    def stop_requested(self) -> None:
        """Called from a signal handler: bound the write in progress and every later one."""
        if self._deadline is None:
            self._deadline = self._clock() + self._total
            if self._writing:
                self._arm()

    def write(self, text: str | bytes) -> None:
        """All of `text`, unless a stop was requested and the reader stops taking it."""
        if self.stalled:
            return
        data = memoryview(text if isinstance(text, bytes)
                          else text.encode("utf-8", errors="replace"))
        try:
            self._writing = True
            while data:
                if self._deadline is not None:
                    self._arm()
                n = os.write(self.fd, data[:self.CHUNK])
                self._disarm()
                data = data[n:]
        except OutputStalled:
            self.stalled = True
        except BrokenPipeError:
            raise
        except OSError as e:
            raise OutputError(f"cannot write to {self.name}: {e.strerror or e}") from None
        finally:
            self._writing = False
            self._disarm()

    def _arm(self) -> None:
        assert self._deadline is not None
        left = min(self._idle, self._deadline - self._clock())
        if left <= 0:
            raise OutputStalled
        signal.setitimer(signal.ITIMER_REAL, left)

    def _disarm(self) -> None:
        if self._deadline is not None:
            signal.setitimer(signal.ITIMER_REAL, 0)

    def _on_alarm(self, signum: int, frame: FrameType | None) -> None:
        if self._writing:
            raise OutputStalled  # out of the blocked os.write(), which is not retried


def fd_name(fd: int) -> str:
    """stdin, stdout, stderr, or `fd N`."""
    return STREAM_NAMES[fd] if fd < len(STREAM_NAMES) else f"fd {fd}"


# --- signals -------------------------------------------------------------------------


@contextlib.contextmanager
def signal_handlers(handlers: Mapping[int, Callable[[int, FrameType | None], None]]
                    ) -> Iterator[None]:
    """Install `handlers` (signal -> handler) for the block, then put the old ones back.

    A SIGINT that came before, and may have been lost (`early_signal`), is
    handed to the new handler at once."""
    lost = signal.SIGINT in handlers and early_signal.hand_over()
    old = {sig: signal.signal(sig, h) for sig, h in handlers.items()}
    try:
        if lost:
            handlers[signal.SIGINT](signal.SIGINT, None)
        yield
    finally:
        for sig, h in old.items():
            signal.signal(sig, h)


@contextlib.contextmanager
def exit_at_once_on_signal() -> Iterator[None]:
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


# --- files written for the user ----------------------------------------------------------

_FILE_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"),
               (stat.S_ISCHR, "a device"), (stat.S_ISBLK, "a device"),
               (stat.S_ISSOCK, "a socket"), (stat.S_ISLNK, "a symbolic link"))


def _kind(mode: int) -> str:
    return next((name for test, name in _FILE_KINDS if test(mode)), "not a regular file")


def open_output(path: str, option: str) -> int:
    """`path` created (0600) or truncated for writing; its fd. `UsageError` if it cannot be.

    Only a regular file: a FIFO would block offtop until someone reads it, a
    device is not where a profile belongs, and a symbolic link is refused so
    that root never writes through a link someone else planted in /tmp.
    """
    with contextlib.suppress(FileNotFoundError):
        mode = os.lstat(path).st_mode
        if not stat.S_ISREG(mode):
            hint = " (leave out -o to write to stdout)" if option == "-o" else ""
            raise UsageError(f"{option} {path}: {_kind(mode)}, not a regular file{hint}")
    flags = (os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | os.O_NOCTTY
             | os.O_NOFOLLOW | os.O_NONBLOCK)
    try:
        fd = os.open(path, flags, 0o600)
    except OSError as e:
        raise UsageError(f"cannot write {option} {path}: {e.strerror or e}") from None
    try:
        st = os.fstat(fd)  # what was opened, in case the path changed since the lstat()
        if not stat.S_ISREG(st.st_mode):
            raise UsageError(f"{option} {path}: {_kind(st.st_mode)}, not a regular file")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd

