"""Command line: validate everything first, then run the TUI or batch mode.

Bad input ends with one line on stderr and exit status 2; a machine that
cannot run offtop, or an output that cannot be written, ends with one line
and status 1; never a traceback. A stop by signal (SIGINT, SIGTERM, SIGHUP)
is a normal end: status 0. Batch mode ends with status 3 when nothing it
was asked to watch is left (see `offtop.cli_args.EPILOG`).

The parts: `cli_args` (options), `cli_io` (standard streams, writes that
signals can interrupt, output files), `batch` (batch mode), `outputs`
(--record and --push, fed from batch mode or, for the TUI, by `TeeSource`).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from offtop.batch import IntervalReports, make_format, run_batch
from offtop.bpf.config import EngineError
from offtop.bpf.environment import EnvironmentProblem, check_host_view, memory_problem
from offtop.cli_args import (
    EXIT_FAILURE,
    EXIT_OK,
    EXIT_USAGE,
    UsageError,
    build_parser,
    check_output_options,
    config_from_args,
    join_negative_values,
    parse_count,
    parse_interval_arg,
    pusher_from_args,
)
from offtop.cli_io import OutputError, StdStreams, end_process, open_output
from offtop.malloc_tuning import tune_malloc
from offtop.outputs import Outputs, PushOutput, RecordOutput, TeeSource, recording_header
from offtop.source import ReplaySource, SnapshotSource


def main(argv: Sequence[str] | None = None) -> int:
    """The `offtop` console entry point."""
    try:
        tune_malloc()  # before any thread of offtop's starts
        streams = StdStreams.claim()
    except KeyboardInterrupt:  # Ctrl-C at once (libc is looked up with ldconfig): nothing began
        return EXIT_OK

    def fail(msg: str, code: int) -> int:
        streams.report(msg)
        return code

    try:
        return _main(streams, sys.argv[1:] if argv is None else list(argv), fail)
    except MemoryError:
        return fail(memory_problem("(MemoryError)"), EXIT_FAILURE)
    except KeyboardInterrupt:  # Ctrl-C before batch mode or the TUI took signals over
        return EXIT_OK


@dataclass
class _Run:
    """What a run is made of once every option is checked."""

    args: argparse.Namespace
    source: SnapshotSource
    interval: float
    count: int | None
    limit: int
    outputs: Outputs
    out_fd: int | None = None
    cgroup_name: Callable[[int], str | None] | None = None


def _main(streams: StdStreams, argv: list[str], fail: Callable[[str, int], int]) -> int:
    with contextlib.ExitStack() as cleanup:
        try:
            run = _prepare(streams, argv, cleanup)
        except UsageError as e:
            return fail(f"error: {e}", EXIT_USAGE)
        except (EnvironmentProblem, OutputError) as e:
            return fail(str(e), EXIT_FAILURE)
        status = EXIT_FAILURE
        try:
            status = _run(streams, run, fail)
        finally:
            # Every exit path: the probe goes first, then the outputs are
            # closed (a recording written out, queued pushes sent) and said.
            run.source.close()
            try:
                lines = run.outputs.close()
            except OutputError as e:
                lines = []
                status = fail(str(e), EXIT_FAILURE)
            for line in lines:
                streams.report(line)
        return status


def _run(streams: StdStreams, run: _Run, fail: Callable[[str, int], int]) -> int:
    try:
        if run.args.batch:
            return _run_batch(streams, run)
        source = TeeSource(run.source, run.outputs) if run.outputs else run.source
        return _run_tui(streams, source, run.interval, fail)
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


def _prepare(streams: StdStreams, argv: list[str], cleanup: contextlib.ExitStack) -> _Run:
    """Check every option and open every file; what is opened is closed by `cleanup`."""
    from offtop.export import CgroupNames

    parser = build_parser()
    args = parser.parse_args(join_negative_values(argv, parser))
    limit = check_output_options(args, stdout_is_terminal=streams.is_terminal(1))
    states = ""
    source: SnapshotSource
    if args.replay:
        if not args.batch and streams.is_terminal(2):
            _say_reading(args.replay)
        source, interval, count = _replay_source(args)
        cleanup.callback(source.close)
    else:
        # Before -p/-t are looked up in /proc: in a pid namespace of its
        # own, /proc would answer for pids the kernel does not report.
        check_host_view(kernel_stacks=not (args.no_kernel_stacks or args.no_stacks))
        cfg, interval, count = config_from_args(args)
        states = cfg.states
    if args.batch:
        if args.output is None:
            streams.check_batch()
    else:
        streams.check_tui()
    # Cgroup ids name cgroups of this machine only: not those of a recording.
    cgroup_name = None if args.replay else CgroupNames()
    pusher = pusher_from_args(args, cgroup_name=cgroup_name)
    if not args.replay:
        # A first start compiles the BPF program (~0.6 s of a CPU): begun now, it
        # runs beside the engine's imports and the TUI's set-up, not after them.
        from offtop.bpf.probe import compile_ahead_of

        ahead = compile_ahead_of(cfg)
        from offtop.bpf.engine import BpfSource  # bcc: only for a live capture

        source = BpfSource(cfg, ahead=ahead)
        cleanup.callback(source.close)
    out_fd = None
    if args.output is not None:
        out_fd = open_output(args.output, "-o")
        cleanup.callback(os.close, out_fd)
    record = None
    if args.record is not None:
        started = source.times[0] if isinstance(source, ReplaySource) else None
        header = recording_header(source.info, threshold_ns=source.threshold_ns,
                                  interval_s=interval, states=states, started=started)
        record = RecordOutput(args.record, open_output(args.record, "--record"), header)
        cleanup.callback(record.close)
    outputs = Outputs(record, PushOutput(pusher) if pusher is not None else None)
    return _Run(args, source, interval, count, limit, outputs, out_fd, cgroup_name)


def _run_batch(streams: StdStreams, run: _Run) -> int:
    args = run.args
    interval = run.interval
    if args.replay and not streams.is_terminal(1 if run.out_fd is None else run.out_fd):
        interval = 0.0  # a recording written elsewhere than a terminal: no need to wait
    fmt = make_format(args.format, limit=run.limit, wakers=args.folded_wakers,
                      cgroup_name=run.cgroup_name)
    shown = fmt.stacks_shown if isinstance(fmt, IntervalReports) else 0
    if shown and not run.outputs and not args.replay:
        from offtop.bpf.engine import BpfSource

        if isinstance(run.source, BpfSource):
            # Only the top stacks are printed and no recording or push reads
            # the rest: their rows are not made (they are counted as omitted).
            run.source.aggregator.max_stacks = shown
    fd = 1 if run.out_fd is None else run.out_fd
    name = "stdout" if run.out_fd is None else f"-o {args.output}"
    return run_batch(run.source, fmt, interval, run.count, fd=fd, name=name,
                     outputs=run.outputs, say=streams.report)


def _run_tui(streams: StdStreams, source: SnapshotSource, interval: float,
             fail: Callable[[str, int], int]) -> int:
    from offtop import early_signal
    from offtop.app import run_app
    from offtop.exit_guard import ExitGuard

    if early_signal.hand_over():  # a Ctrl-C while loading: no screen to put up
        return EXIT_OK
    errors: list[BaseException] = []
    # Whatever hangs in the TUI's shutdown, the process (and with it the
    # probe) goes away half a second after the app was asked to stop.
    with streams.screen_on_stdout(), ExitGuard(source, tty_fd=0) as guard:
        code = run_app(guard.source, interval_s=interval, on_error=errors.append)
    if errors:  # said after the terminal is back and stderr is the user's again
        return fail(str(errors[0]), EXIT_FAILURE)
    if isinstance(source, TeeSource):
        source.finish()  # a recording or a push gets the unfinished interval too
    return code


#: A recording this big takes seconds to check before the TUI can show it.
READING_NOTICE_BYTES = 4 << 20


def _say_reading(path: str) -> None:
    """One line on the terminal while a big recording is read: every interval is
    checked first (a busy server's 40 s, 15 MB, took 17 s), and the screen was blank."""
    with contextlib.suppress(OSError):
        size = os.stat(path).st_size
        if size >= READING_NOTICE_BYTES:
            print(f"offtop: reading {path} ({size / (1 << 20):.0f} MB): every interval is "
                  "checked first", file=sys.stderr, flush=True)


def _replay_source(args: argparse.Namespace) -> tuple[ReplaySource, float, int | None]:
    from offtop.recording import RecordingError

    interval = parse_interval_arg(args.interval)
    count = parse_count(args.count)
    try:
        # The TUI holds at the end, so time travel can go back from there.
        source = ReplaySource.from_file(args.replay, hold_at_end=not args.batch)
    except RecordingError as e:
        raise UsageError(f"cannot read recording {args.replay}: {e}") from None
    return source, interval, count


if __name__ == "__main__":
    end_process(main())
