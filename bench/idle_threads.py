#!/usr/bin/env python3
"""What offtop costs while thousands of threads sit idle: side by side.

    .venv/bin/python bench/idle_threads.py [--threads 5000,20000] [--against REF]
                                           [--rounds 3] [--seconds 15] [--tools batch,tui]
                                           [--period MS]

A server's thread pools (a JVM's, a database's) hold thousands of threads that
block once and wait for hours. Nothing changes, so offtop should cost about what
it costs on an idle machine: its blocked-now list is the only thing they are in.
bench/workloads/idle_threads.c starts N threads that block on a condition
variable and never wake, before offtop starts (on CPU 1). Each tool then runs on
CPU 0, in turn, round after round: offtop `--batch --format json` and offtop's
TUI (tmux), from this tree and, with --against, from git REF. Each tool's CPU
is utime+stime over a window that starts `--warmup` s after its first data;
peak RSS is VmHWM at the window's end. `--threads 0` is in every round: the
same tools with no idle process, the floor. `--period MS`: each thread wakes
every MS ms instead (a pool's timed waits; at 1000, each wait is past the
default threshold, a long block). Not part of `make bench` (no target):
bench/README.md keeps its figures.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import time

from busy_server import Code, WindowFailed, start_tool, warm_up
from run import BENCH, CLK_TCK, OUT, TRACER_CPU, WORKLOAD_CPU, BenchError, compile_c, cpu_ticks, rss_mb, say


class IdleThreads:
    """The workload: N idle threads in one process, pinned to the workload's CPU."""

    def __init__(self, binary: str, n: int, period_ms: int = 0) -> None:
        self.proc = subprocess.Popen(["taskset", "-c", WORKLOAD_CPU, binary, str(n), str(period_ms)],
                                     stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line.startswith("ready"):
            self.stop()
            raise BenchError(f"idle_threads {n}: did not start ({line.strip()!r})")
        time.sleep(1.0)  # every thread in its wait

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait(30)


def window(name: str, code: Code, warmup: float, seconds: float) -> tuple[float, float, float]:
    """(CPU as % of one core, peak RSS in MB, median JSON line in kB: batch only, else
    0) of one tool over one window."""
    tool = start_tool(name, code, TRACER_CPU)
    try:
        warm_up(tool, warmup, start_timeout=120)
        t0, c0 = time.monotonic(), cpu_ticks(tool.pid)
        time.sleep(seconds)
        t1, c1 = time.monotonic(), cpu_ticks(tool.pid)
        peak = rss_mb(tool.pid, "VmHWM")
    finally:
        tool.stop()
    sizes = [line.size for line in getattr(tool, "lines", []) if t0 <= line.at <= t1]
    return 100.0 * (c1 - c0) / CLK_TCK / (t1 - t0), peak, statistics.median(sizes) / 1e3 if sizes else 0.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", default="5000,20000", help="comma list of idle thread counts")
    ap.add_argument("--against", help="also offtop as of this git ref")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=15.0, help="measured window per tool")
    ap.add_argument("--warmup", type=float, default=8.0, help="from a tool's first data to its window")
    ap.add_argument("--tools", default="batch,tui")
    ap.add_argument("--period", type=int, default=0, metavar="MS",
                    help="each thread wakes every MS ms (0: never)")
    args = ap.parse_args()
    counts = [0, *(int(n) for n in args.threads.split(",") if int(n) > 0)]
    binary = str(compile_c(BENCH / "workloads" / "idle_threads.c", OUT / "bench_idle_threads"))
    codes = {"offtop": Code.of(None)}
    if args.against:
        codes[f"offtop@{args.against}"] = Code.of(args.against)
    tools = args.tools.split(",")
    got: dict[tuple[int, str, str], list[tuple[float, float, float]]] = {}
    for r in range(args.rounds):
        for n in counts:
            load = IdleThreads(binary, n, args.period) if n else None
            try:
                for tool in tools:
                    for label, code in codes.items():
                        try:
                            cpu, peak, line_kb = window(tool, code, args.warmup, args.seconds)
                        except WindowFailed as e:
                            raise BenchError(f"{label} {tool} with {n} idle threads: {e}") from e
                        got.setdefault((n, tool, label), []).append((cpu, peak, line_kb))
                        say(f"round {r + 1}: {n} idle threads, {label} {tool}: {cpu:.2f}% of a core, "
                            f"peak RSS {peak:.0f} MB" + (f", JSON lines {line_kb:.0f} kB" if line_kb else ""))
            finally:
                if load is not None:
                    load.stop()
    print(f"{'idle threads':>12}  {'tool':5}  {'code':28} {'CPU, % of a core':>26}  {'peak RSS':>9}")
    for (n, tool, label), v in sorted(got.items()):
        cpus = [c for c, _, _ in v]
        med = statistics.median(cpus)
        line = f"{n:12d}  {tool:5}  {label:28} {med:6.2f} ({min(cpus):.2f}{chr(0x2013)}{max(cpus):.2f})"
        if len(codes) > 1 and label != "offtop":
            mine = [c for c, _, _ in got[(n, tool, "offtop")]]
            per_round = [a / b for a, b in zip(mine, cpus, strict=True) if b > 0]
            if per_round:
                line += f"  this tree {statistics.median(per_round):.2f}x"
        kb = statistics.median(k for _, _, k in v)
        print(f"{line:80}  {max(p for _, p, _ in v):6.0f} MB" + (f"  JSON {kb:.0f} kB" if kb else ""))


if __name__ == "__main__":
    main()
