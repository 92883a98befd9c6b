"""Where the engine's CPU goes on the busy server: calls and CPU per function, in process.

    .venv/bin/python bench/engine_counts.py                 20 s at the busy-server load
    .venv/bin/python bench/engine_counts.py --seconds 40 --rate 10000 --procs 10
    .venv/bin/python bench/engine_counts.py --max-stacks 100 --no-young-gc    as batch mode runs

Starts bench_busy (bench/busy_server.py's load, built the same way), runs offtop's
engine (`BpfSource`, default options) in this process, lets it warm up for a few
intervals, then counts, for the engine's main steps, how often each ran and
how much CPU it took: `time.thread_time`, the engine thread's own CPU. On a
2-CPU machine the load's 1,000 threads keep offtop off the CPU much of the time,
so wall-clock timers there measure waiting as much as work; thread CPU does
not. Each wrapped call adds ~1 µs, and the steps nest (inclusive figures).
Not part of `make bench` and writes nothing: a tool for profiling engine work
(py-spy gives the shares; this gives the counts behind them).

Needs root (the probe).
"""

from __future__ import annotations

import argparse
import collections
import gc
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from busy_server import OUT, LoadSpec, build_load  # noqa: E402

from offtop.bpf import (  # noqa: E402
    block_frames,
    engine,
    probe,
    row_frames,
    stack_store,
    user_stacks,
)
from offtop.gc_pacing import GcPacing  # noqa: E402
from offtop.model import Aggregator, StackGroups  # noqa: E402
from offtop.symbols import UserSymbols  # noqa: E402

#: (class, method) pairs counted: the sub-tick, the new rows' resolution and its
#: parts, the snapshot's build and its parts.
STEPS: list[tuple[type, str]] = [
    (engine.BpfSource, "_subtick"), (engine.BpfSource, "_sum_rows"),
    (engine.BpfSource, "_new_waker"), (engine.BpfSource, "_build"),
    (row_frames.RowFrames, "resolve"), (row_frames.RowFrames, "waker"),
    (block_frames.BlockFrames, "blocked_now"),
    (stack_store.StackStore, "user"), (stack_store.StackStore, "kernel"),
    (stack_store.StackStore, "trim"), (stack_store.StackStore, "_free_user_ids"),
    (engine.BpfSource, "_read_new_stacks"), (stack_store.StackStore, "offer_user"),
    (probe.Probe, "stack"), (probe.Probe, "drain_aggregates"), (probe.Probe, "stack_ids"),
    (user_stacks.UserStackRepair, "repair"), (UserSymbols, "resolve_stack"),
    (Aggregator, "build_grouped"), (StackGroups, "number"), (StackGroups, "start_build"),
]


class Counts:
    """CPU and calls per wrapped method, from one thread (the engine's)."""

    def __init__(self) -> None:
        self.cpu: collections.Counter[str] = collections.Counter()
        self.calls: collections.Counter[str] = collections.Counter()

    def wrap(self, cls: type, name: str) -> None:
        inner = getattr(cls, name)
        label = f"{cls.__name__}.{name}"
        clock = time.thread_time
        cpu, calls = self.cpu, self.calls

        def counted(*args: Any, **kwargs: Any) -> Any:
            t = clock()
            try:
                return inner(*args, **kwargs)
            finally:
                cpu[label] += clock() - t
                calls[label] += 1

        setattr(cls, name, counted)

    def count_gc(self) -> None:
        """Also count the cyclic GC's passes, by generation (`gc.callbacks`): py-spy
        charges them to whatever line allocated when one began."""
        clock = time.thread_time
        began = [0.0]

        def callback(phase: str, info: dict[str, int]) -> None:
            if phase == "start":
                began[0] = clock()
            else:
                label = f"(GC generation {info['generation']})"
                self.cpu[label] += clock() - began[0]
                self.calls[label] += 1

        gc.callbacks.append(callback)

    def clear(self) -> None:
        self.cpu.clear()
        self.calls.clear()


def run_intervals(src: engine.BpfSource, n: int, pacing: GcPacing,
                  after: Callable[[Any], None] = lambda snap: None) -> None:
    stop = threading.Event()
    for _ in range(n):
        snap = src.next_snapshot(1.0, stop)
        after(snap)
        if pacing.snapshot_done() or pacing.overdue():
            pacing.full_pass()  # as batch mode and the TUI do (offtop.gc_pacing)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--seconds", type=int, default=20, help="intervals (1 s each) counted")
    p.add_argument("--warmup", type=int, default=6, help="intervals before counting")
    p.add_argument("--procs", type=int, default=LoadSpec.procs)
    p.add_argument("--threads", type=int, default=LoadSpec.threads)
    p.add_argument("--rate", type=float, default=LoadSpec.rate)
    p.add_argument("--churn", type=float, default=LoadSpec.churn)
    p.add_argument("--max-stacks", type=int, default=Aggregator().max_stacks,
                   help="stacks made into rows a snapshot (the TUI's default; batch output "
                        "that prints the top N makes N)")
    p.add_argument("--no-young-gc", action="store_true",
                   help="Python's young GC passes off, as batch mode runs (the TUI keeps them)")
    args = p.parse_args()
    if os.geteuid() != 0:
        print("engine_counts: needs root (the probe)", file=sys.stderr)
        return 2
    spec = LoadSpec(procs=args.procs, threads=args.threads, rate=args.rate, churn=args.churn)
    exe = build_load()
    counts = Counts()
    for cls, name in STEPS:
        counts.wrap(cls, name)
    counts.count_gc()
    offered = [0]  # new user stacks that came through the probe's ring
    decode_new = engine.new_user_stacks

    def counted_new(records: list[bytes], **kwargs: Any) -> list[tuple[int, int, bytes]]:
        out = decode_new(records, **kwargs)
        offered[0] += len(out)
        return out

    engine.new_user_stacks = counted_new
    # Started once everything above is in place, and stopped whatever happens after:
    # a load left running doubles the next run's (1,000 more threads).
    load = subprocess.Popen([str(exe), *spec.argv(), "--io-dir", str(OUT)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        time.sleep(3)
        src = engine.BpfSource(engine.EngineConfig(),
                               aggregator=Aggregator(max_stacks=args.max_stacks))
        src.start()
        pacing = GcPacing(young=not args.no_young_gc)
        run_intervals(src, args.warmup, pacing)
        counts.clear()
        offered[0] = 0
        ring_lost0 = src.stack_ring_lost
        rows: list[int] = []
        cpu0, wall0 = time.process_time(), time.monotonic()
        run_intervals(src, args.seconds, pacing, lambda snap: rows.append(snap.stats.agg_entries))
        cpu, wall = time.process_time() - cpu0, time.monotonic() - wall0
        stats = src.frames.stacks.stats if src.frames.stacks else None
        ring_lost = src.stack_ring_lost - ring_lost0
        src.close()
    finally:
        load.terminate()
        load.wait()
    print(f"busy server: {spec.describe()}")
    print(f"offtop's engine: {cpu:.2f} s of CPU over {wall:.2f} s ({100 * cpu / wall:.1f}% of a core), "
          f"{len(rows)} snapshots, rows per snapshot {min(rows)}-{max(rows)}")
    if stats is not None:
        print(f"  user stacks lost {stats.user_lost}, freed {stats.user_freed}")
    print(f"  new user stacks through the ring {offered[0] / wall:.0f}/s, records lost there {ring_lost}")
    print(f"  {'step (inclusive)':34s} {'CPU ms/s':>9s} {'calls/s':>9s} {'µs/call':>9s}")
    for label, t in counts.cpu.most_common():
        n = counts.calls[label]
        print(f"  {label:34s} {1000 * t / wall:9.1f} {n / wall:9.0f} {1e6 * t / n:9.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
