"""offtop's options: the parser, and every value checked before anything starts.

Bad input is a `UsageError`, whose message is the one line users see (the
CLI adds "offtop: error:" and exits with status 2).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import re
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, NoReturn

from offtop import __version__
from offtop.bpf.decode import DEFAULT_STATES, state_mask
from offtop.cgroups import CgroupError, resolve_cgroup
from offtop.report import FORMATS
from offtop.units import DurationError, parse_duration_ns, parse_interval_s

if TYPE_CHECKING:
    from offtop.bpf.config import EngineConfig
    from offtop.export import Pusher

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_USAGE = 2
EXIT_NOTHING_LEFT = 3

#: Formats written once, at the end of the run, for the whole run.
PROFILE_FORMATS = ("pprof", "speedscope")
OUTPUT_FORMATS = (*FORMATS, *PROFILE_FORMATS)
#: How many tasks, processes and stacks a JSON line holds by default.
DEFAULT_JSON_LIMIT = 100

EPILOG = f"""\
exit status:
  {EXIT_OK}  done: --count reached, stopped by a signal (SIGINT, SIGTERM, SIGHUP) or q,
     or the replay ended
  {EXIT_FAILURE}  failure: this machine cannot run offtop, or an output could not be written
  {EXIT_USAGE}  usage: an invalid option, file or recording
  {EXIT_NOTHING_LEFT}  nothing left to watch: every process (-p), thread (-t) or cgroup (-c)
     offtop was watching is gone (batch mode; the TUI says so and stays)
"""


class UsageError(Exception):
    """Bad input; the message is one line for users."""


class _Parser(argparse.ArgumentParser):
    """argparse, with errors as `UsageError` and a record of the options that take a value."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.value_options: set[str] = set()
        """Options followed by a value (`join_negative_values` needs them)."""

    def add_argument(self, *names: Any, **kwargs: Any) -> argparse.Action:
        action = super().add_argument(*names, **kwargs)
        if kwargs.get("action", "store") in ("store", "append") and "nargs" not in kwargs:
            self.value_options.update(action.option_strings)
        return action

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{message} (see offtop --help)")


def build_parser() -> _Parser:
    """offtop's options (the README's table mirrors this)."""
    p = _Parser(
        prog="offtop",
        description="A live, top-like view of where Linux threads spend their time off the CPU.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--batch", action="store_true", help="print reports instead of the TUI")
    p.add_argument("--format", choices=OUTPUT_FORMATS, default="text",
                   help="batch output: text, json or folded per interval; pprof (gzipped "
                        "profile.proto) or speedscope (JSON) once, for the whole run")
    p.add_argument("-o", "--output", metavar="FILE",
                   help="batch: write the output to FILE instead of stdout")
    p.add_argument("--limit", type=str, default=None, metavar="N",
                   help=f"json: the top N tasks, processes and stacks per interval, and its N "
                        f"longest long blocks (default "
                        f"{DEFAULT_JSON_LIMIT}; 0: all); folded, pprof, speedscope and "
                        "recordings are always complete")
    p.add_argument("--count", type=str, default=None, metavar="N",
                   help="exit after N intervals (batch mode)")
    p.add_argument("--interval", type=str, default="1", metavar="S",
                   help="refresh interval in seconds (default 1)")
    p.add_argument("--threshold", type=str, default="500ms", metavar="DUR",
                   help="blocks this long or longer arrive one by one as events "
                        "(ns/us/ms/s; a bare number is ms; default 500ms; 0: every block)")
    p.add_argument("-c", "--cgroup", metavar="PATH",
                   help="only tasks in this cgroup v2 and its descendants")
    # Repeatable: every -p counts (with "store", all but the last were dropped silently).
    p.add_argument("-p", "--pid", metavar="PIDS", action="append",
                   help="only these processes (comma list; may be repeated)")
    p.add_argument("-t", "--tid", metavar="TIDS", action="append",
                   help="only these threads (comma list; may be repeated)")
    p.add_argument("--states", default=DEFAULT_STATES, metavar="LETTERS",
                   help=f"task states to record (default {DEFAULT_STATES}; add R for "
                        "runqueue wait after preemption, T/t for stopped/traced)")
    p.add_argument("--kernel-threads", action="store_true", help="include kernel threads")
    p.add_argument("--no-kernel-stacks", action="store_true", help="do not capture kernel stacks")
    p.add_argument("--no-user-stacks", action="store_true", help="do not capture user stacks")
    p.add_argument("--no-stacks", action="store_true", help="capture no stacks (cheapest)")
    p.add_argument("--no-wakers", action="store_true",
                   help="do not record who woke each block (saves the sched_waking probe)")
    p.add_argument("--waker-stacks-min", type=str, default=None, metavar="DUR",
                   help="take the waker's stacks only for blocks at least this long "
                        "(default 1ms; 0: every block); shorter blocks keep the waker's name")
    p.add_argument("--folded-wakers", action="store_true",
                   help="folded: each block's waker stack on top of it, after a '--' frame "
                        "(offwaketime style)")
    p.add_argument("--no-python-stacks", action="store_true",
                   help="do not read Python frames from CPython processes' memory")
    p.add_argument("--record", metavar="FILE",
                   help="also write a recording (gzipped JSON lines, complete) to FILE, "
                        "for --replay")
    p.add_argument("--replay", metavar="FILE",
                   help="show a recording (--record, or --batch --format json output) "
                        "instead of live data")
    p.add_argument("--push", metavar="URL",
                   help="send each interval as a pprof profile to a Pyroscope-compatible "
                        "server (URL/ingest)")
    p.add_argument("--push-name", metavar="NAME",
                   help="the application name profiles are pushed under (default offtop)")
    p.add_argument("--push-label", action="append", default=[], metavar="K=V",
                   help="a label of the pushed series (repeatable; default host=HOSTNAME)")
    p.add_argument("--push-header", action="append", default=[], metavar="K:V",
                   help="an HTTP header sent with each push (repeatable), "
                        "e.g. 'X-Scope-OrgID: tenant'")
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


def parse_limit(text: str | None, fmt: str) -> int:
    """--limit: a whole number (0: everything); only JSON lines are limited."""
    if text is None:
        return DEFAULT_JSON_LIMIT if fmt == "json" else 0
    t = text.strip()
    if not t.isdigit():
        raise UsageError(f"invalid --limit {text!r}: expected a whole number (0: no limit)")
    if fmt != "json":
        raise UsageError(f"--limit applies to --format json only (--format {fmt} is always "
                         "complete)")
    return int(t)


def join_negative_values(argv: Sequence[str], parser: _Parser) -> list[str]:
    """`--threshold -5ms` -> `--threshold=-5ms`, so a negative value reaches its validator.

    argparse takes any word that starts with '-' and is not a plain negative
    number for an option, and would answer "expected one argument", which
    does not say what is wrong.
    """
    opts = parser.value_options
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


def check_output_options(args: argparse.Namespace, *, stdout_is_terminal: bool) -> int:
    """The options that say where output goes, checked together; returns the JSON limit."""
    if not args.batch:
        for given, what in ((args.format in PROFILE_FORMATS, f"--format {args.format}"),
                            (args.output is not None, "-o/--output"),
                            (args.limit is not None, "--limit")):
            if given:
                raise UsageError(f"{what} needs --batch (the TUI exports its views itself)")
        if args.replay and (args.record or args.push):
            raise UsageError("--record and --push with --replay need --batch (the TUI's time "
                             "travel would record and push intervals twice)")
    if args.format == "pprof" and args.output is None and stdout_is_terminal:
        raise UsageError("--format pprof is binary: give -o FILE or redirect stdout")
    for opt, path in (("--record", args.record), ("-o", args.output)):
        if path is not None and args.replay and os.path.exists(path) \
                and os.path.samefile(path, args.replay):
            raise UsageError(f"{opt} {path} is the file being replayed")
    if args.record is not None and args.output is not None and os.path.exists(args.record) \
            and os.path.exists(args.output) and os.path.samefile(args.record, args.output):
        raise UsageError("--record and -o name the same file")
    if not args.push and (args.push_name or args.push_label or args.push_header):
        raise UsageError("--push-name, --push-label and --push-header need --push URL")
    return parse_limit(args.limit, args.format)


def config_from_args(args: argparse.Namespace) -> tuple[EngineConfig, float, int | None]:
    """Validate every option; return (EngineConfig, interval_s, count)."""
    from offtop.bpf.config import EngineConfig

    try:
        threshold = parse_duration_ns(args.threshold)
    except DurationError as e:
        raise UsageError(f"--threshold: {e}") from None
    interval = parse_interval_arg(args.interval)
    count = parse_count(args.count)
    states = parse_states(args.states, kernel_threads=args.kernel_threads)
    # `is not None`: an empty list (-p '') is an error, not "every process".
    pids = parse_ids(",".join(args.pid), "pid") if args.pid is not None else ()
    tids = parse_ids(",".join(args.tid), "tid") if args.tid is not None else ()
    # Given or not (then EngineConfig's default), never compared with a copy of it.
    waker_min: int | None = None
    if args.waker_stacks_min is not None:
        if args.no_wakers:
            raise UsageError("--waker-stacks-min with --no-wakers: no waker is recorded")
        try:
            waker_min = parse_duration_ns(args.waker_stacks_min)
        except DurationError as e:
            raise UsageError(f"--waker-stacks-min: {e}") from None
    if args.folded_wakers and (args.format != "folded" or args.no_wakers):
        raise UsageError("--folded-wakers needs --format folded and wakers (no --no-wakers)")
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
        wakers=not args.no_wakers,
        python_stacks=not (args.no_python_stacks or args.no_user_stacks or args.no_stacks),
        pids=pids,
        tids=tids,
        cgroup=cgroup,
        scope="; ".join(scope),
    )
    if waker_min is not None:
        cfg = dataclasses.replace(cfg, waker_stacks_min_ns=waker_min)
    return cfg, interval, count


# --- pushing -----------------------------------------------------------------------

#: An HTTP header name (RFC 9110's token).
_HEADER_NAME = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")


def parse_push_labels(items: Sequence[str]) -> dict[str, str]:
    """--push-label K=V ...: host=HOSTNAME first, then the user's (which may replace it)."""
    labels: dict[str, str] = {}
    host = platform.node()
    if host:
        labels["host"] = host
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise UsageError(f"invalid --push-label {item!r}: expected KEY=VALUE, e.g. env=prod")
        labels[key] = value
    return labels


def parse_push_headers(items: Sequence[str]) -> dict[str, str]:
    """--push-header 'K: V' ...; names are tokens, values hold no control characters."""
    headers: dict[str, str] = {}
    for item in items:
        name, sep, value = item.partition(":")
        name, value = name.strip(), value.strip()
        if not sep or not _HEADER_NAME.fullmatch(name):
            raise UsageError(f"invalid --push-header {name or item!r}: expected NAME: VALUE, "
                             "e.g. 'X-Scope-OrgID: tenant'")
        if any(ord(c) < 0x20 or ord(c) == 0x7F for c in value):
            # A CR or LF would start a header (or a request) of its own.
            raise UsageError(f"invalid --push-header {name}: its value holds a control character")
        headers[name] = value
    return headers


def pusher_from_args(args: argparse.Namespace, *,
                     cgroup_name: Callable[[int], str | None] | None = None) -> Pusher | None:
    """The `Pusher` --push asks for (not started), or None; `UsageError` for a bad URL or label."""
    if not args.push:
        return None
    from offtop.export import Pusher

    labels = parse_push_labels(args.push_label)
    headers = parse_push_headers(args.push_header)
    if "host" in labels and not any(item.startswith("host=") for item in args.push_label):
        labels = _usable_host_label(labels)
    try:
        return Pusher(args.push, name=args.push_name or "offtop", labels=labels,
                      headers=headers, cgroup_name=cgroup_name)
    except ValueError as e:
        raise UsageError(str(e)) from None


def _usable_host_label(labels: Mapping[str, str]) -> dict[str, str]:
    """Drop the default host label if this host's name is one Pyroscope would misparse."""
    from offtop.export.push import series_name

    try:
        series_name("offtop", {"host": labels["host"]})
    except ValueError:
        return {k: v for k, v in labels.items() if k != "host"}
    return dict(labels)
