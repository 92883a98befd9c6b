"""Command line: validate everything first, then run the TUI or batch mode.

Bad input ends with one line on stderr and exit status 2; a machine that
cannot run offtop ends with one line and status 1; never a traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import FrameType
from typing import NoReturn, TextIO

from offtop import __version__
from offtop.bpf.decode import DEFAULT_STATES, state_mask
from offtop.cgroups import CgroupError, resolve_cgroup
from offtop.model import Snapshot
from offtop.report import FORMATS, folded_lines, snapshot_to_json, text_report
from offtop.source import SnapshotSource
from offtop.units import DurationError, parse_duration_ns, parse_interval_s

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_USAGE = 2


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
                        "runqueue wait after preemption)")
    p.add_argument("--kernel-threads", action="store_true", help="include kernel threads")
    p.add_argument("--no-kernel-stacks", action="store_true", help="do not capture kernel stacks")
    p.add_argument("--no-user-stacks", action="store_true", help="do not capture user stacks")
    p.add_argument("--no-stacks", action="store_true", help="capture no stacks (cheapest)")
    p.add_argument("--replay", metavar="FILE",
                   help="show a recording (offtop --batch --format json) instead of live data")
    p.add_argument("--version", action="version", version=f"offtop {__version__}")
    return p


def parse_ids(text: str, what: str) -> tuple[int, ...]:
    """A comma list of positive ids; each must name a live process or thread."""
    ids = []
    for part in text.split(","):
        part = part.strip()
        if not part.isdigit() or int(part) <= 0:
            raise UsageError(f"invalid {what} {part!r}: expected positive numbers, e.g. 1234,5678")
        n = int(part)
        if n > 4_194_304:
            raise UsageError(f"invalid {what} {n}: larger than any pid Linux allows")
        if not Path(f"/proc/{n}").exists():
            raise UsageError(f"no such {what}: {n}")
        ids.append(n)
    return tuple(dict.fromkeys(ids))


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


def config_from_args(args: argparse.Namespace) -> tuple[object, float, int | None]:
    """Validate every option; return (EngineConfig, interval_s, count)."""
    from offtop.bpf.engine import EngineConfig

    try:
        threshold = parse_duration_ns(args.threshold)
    except DurationError as e:
        raise UsageError(f"--threshold: {e}") from None
    interval = parse_interval_arg(args.interval)
    count = parse_count(args.count)
    try:
        state_mask(args.states)
    except ValueError as e:
        raise UsageError(f"--states: {e}") from None
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
        states=args.states,
        kthreads=args.kernel_threads,
        user_stacks=not (args.no_user_stacks or args.no_stacks),
        kernel_stacks=not (args.no_kernel_stacks or args.no_stacks),
        pids=pids,
        tids=tids,
        cgroup=cgroup,
        scope="; ".join(scope),
    )
    return cfg, interval, count


def write_all(out: TextIO, text: str) -> None:
    """Write `text` to `out`'s file descriptor, completely.

    Not `out.write`: CPython's buffered writer drops data when a signal
    handler runs while it is blocked on a full pipe (seen with a 300 KB JSON
    line and Ctrl-C), and batch mode must end with whole lines.
    """
    try:
        fd = out.fileno()
    except (AttributeError, OSError, ValueError):  # not a real file (tests)
        out.write(text)
        out.flush()
        return
    out.flush()
    data = memoryview(text.encode("utf-8", errors="replace"))
    while data:
        n = os.write(fd, data)  # retried on EINTR (PEP 475); may be partial
        data = data[n:]


def _emit(snap: Snapshot, fmt: str, out: TextIO) -> None:
    if fmt == "json":
        write_all(out, json.dumps(snapshot_to_json(snap), separators=(",", ":")) + "\n")
    elif fmt == "folded":
        lines = folded_lines(snap)
        if lines:
            write_all(out, "\n".join(lines) + "\n")
    else:
        write_all(out, text_report(snap) + "\n\n")


def run_batch(source: SnapshotSource, fmt: str, interval_s: float, count: int | None,
              out: TextIO = sys.stdout) -> int:
    """Print one report per interval until `count` or a signal; then the partial one."""
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, on_signal)
    with _exit_at_once_on_signal():
        source.start()
    if stop.is_set():
        return EXIT_OK
    n = 0
    while not stop.is_set():
        snap = source.next_snapshot(interval_s, stop)
        if snap is None:
            break
        _emit(snap, fmt, out)
        n += 1
        if count is not None and n >= count:
            return EXIT_OK
    # Interrupted: print what the unfinished interval holds, then leave.
    last = source.next_snapshot(0.0, threading.Event())
    if last is not None and (last.tasks or last.long_blocks):
        _emit(last, fmt, out)
    return EXIT_OK


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


def _fail(msg: str, code: int) -> int:
    # One line, always: a message from below (bcc, the kernel) may hold newlines.
    print("offtop: " + " ".join(msg.split()), file=sys.stderr)
    return code


def main(argv: Sequence[str] | None = None) -> int:
    """The `offtop` console entry point."""
    from offtop.bpf.engine import BpfSource, EngineError
    from offtop.bpf.environment import EnvironmentProblem

    source: SnapshotSource | None = None
    try:
        parser = build_parser()
        args = parser.parse_args(join_negative_values(
            sys.argv[1:] if argv is None else list(argv), parser))
        if args.replay:
            source, interval, count = _replay_source(args)
        else:
            cfg, interval, count = config_from_args(args)
        if not args.batch:
            check_terminal()
        if source is None:
            source = BpfSource(cfg)  # type: ignore[arg-type]
    except UsageError as e:
        return _fail(f"error: {e}", EXIT_USAGE)

    try:
        if args.batch:
            if args.replay and not sys.stdout.isatty():
                interval = 0.0  # a recording piped elsewhere: no need to wait
            return run_batch(source, args.format, interval, count)
        from offtop.app import run_app
        from offtop.exit_guard import ExitGuard

        # Whatever hangs in the TUI's shutdown, the process (and with it the
        # probe) goes away half a second after the app was asked to stop.
        with ExitGuard(source, tty_fd=sys.stdin.fileno()) as guard:
            return run_app(guard.source, interval_s=interval)
    except (EnvironmentProblem, EngineError) as e:
        return _fail(str(e), EXIT_FAILURE)
    except BrokenPipeError:
        # The reader went away (e.g. `| head`): not an error for a report printer.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_OK
    except KeyboardInterrupt:
        return EXIT_OK
    except Exception as e:
        if os.environ.get("OFFTOP_DEBUG"):
            raise
        return _fail(f"internal error: {type(e).__name__}: {e} (OFFTOP_DEBUG=1 shows where)",
                     EXIT_FAILURE)
    finally:
        source.close()


def check_terminal() -> None:
    """The TUI needs a terminal on both ends; say what to use instead."""
    if not sys.stdout.isatty():
        raise UsageError("stdout is not a terminal: use --batch for text, json or folded output")
    if not sys.stdin.isatty():
        raise UsageError("stdin is not a terminal: the TUI reads keys from it; "
                         "use --batch for text, json or folded output")


def _replay_source(args: argparse.Namespace) -> tuple[SnapshotSource, float, int | None]:
    from offtop.source import ReplaySource

    interval = parse_interval_arg(args.interval)
    count = parse_count(args.count)
    try:
        source = ReplaySource.from_jsonl(args.replay)
    except (OSError, ValueError, KeyError, TypeError) as e:
        msg = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        raise UsageError(f"cannot read recording {args.replay}: {msg}") from None
    return source, interval, count


if __name__ == "__main__":
    sys.exit(main())
