#!/usr/bin/env python3
"""offtop's benchmarks: what offtop costs, measured side by side in one run.

    make bench                            every benchmark, full length (root, ~30 min)
    make bench ARGS="--quick"             fewer and shorter runs (~7 min)
    make bench ARGS="switch throughput"   only these benchmarks
    .venv/bin/python bench/run.py --long 30 memory     the 30-minute memory run

Benchmarks: switch (added cost per context switch), throughput (events/s at
threshold 0), cpu (offtop's own CPU), startup, memory, ui, busy (offtop, top
and htop on a busy server: bench/busy_server.py), recording (the size of an
hour of --record, busy and idle: bench/recording_size.py). bench/README.md
says what each one measures. These machines are shared and noisy, so every
comparison runs its configurations alternately, round after round, in one
run, and reports medians with min-max. The latest figures are kept in
bench/results.json and written as a table into bench/README.md.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import math
import os
import platform
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"
OUT = BENCH / "out"  # build products and logs (git-ignored)
RESULTS = BENCH / "results.json"
README = BENCH / "README.md"
PY = sys.executable
TRACER_CPU = "0"  # offtop, bpftrace, the empty probe
WORKLOAD_CPU = "1"  # the measured workload
BENCHMARKS = ("switch", "throughput", "cpu", "startup", "memory", "ui", "busy", "recording")
# Targets (issue 14). Like-for-like per-switch cost (every switch a block) against bpftrace's:
SWITCH_VS_BPFTRACE = 0.5
# Typography for the README, spelled as escapes (ruff flags look-alike characters).
TIMES, DASH, LE, GE, MICRO = "\u00d7", "\u2013", "\u2264", "\u2265", "\u00b5"
TABLE_START = "<!-- figures:start (written by bench/run.py) -->"
TABLE_END = "<!-- figures:end -->"


T = TypeVar("T")


class BenchError(RuntimeError):
    """A benchmark could not run; the message says why."""


def say(msg: str) -> None:
    """Progress, on stderr so stdout stays the figures."""
    print(msg, file=sys.stderr, flush=True)


# --- statistics ------------------------------------------------------------


@dataclass(frozen=True)
class Dist:
    """Repeated measurements of one quantity: median and range."""

    values: tuple[float, ...]

    @property
    def median(self) -> float:
        return statistics.median(self.values) if self.values else float("nan")

    @property
    def lo(self) -> float:
        return min(self.values) if self.values else float("nan")

    @property
    def hi(self) -> float:
        return max(self.values) if self.values else float("nan")

    def fmt(self, scale: float = 1.0, digits: int = 0, unit: str = "") -> str:
        """'median (min-max) unit', values divided by `scale`."""
        m, lo, hi = (v / scale for v in (self.median, self.lo, self.hi))
        return f"{m:.{digits}f} ({lo:.{digits}f}{DASH}{hi:.{digits}f}){unit}"

    def json(self) -> dict[str, Any]:
        return {"median": self.median, "min": self.lo, "max": self.hi, "n": len(self.values)}


def ratio(a: float, b: float) -> float:
    return a / b if b else float("inf")


# --- building the workloads ------------------------------------------------


@dataclass(frozen=True)
class Tools:
    """Everything the benchmarks run, built or found."""

    workload: Path  # tests/workloads/offtop_workload.c, as bench_wl
    pacer: Path  # bench/workloads/pacer.c
    bpftrace: str | None
    quiet: Quiet = field(default_factory=lambda: Quiet())


def compile_c(src: Path, out: Path, libs: Sequence[str] = (), flags: Sequence[str] = ()) -> Path:
    """gcc with frame pointers, as tests/conftest.py builds its workloads (and `flags`)."""
    if out.exists() and out.stat().st_mtime >= src.stat().st_mtime:
        return out
    cc = shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        raise BenchError("no C compiler: `make bench` installs gcc")
    out.parent.mkdir(parents=True, exist_ok=True)  # a benchmark run alone, on a fresh clone
    subprocess.run([cc, "-O1", "-g", "-fno-omit-frame-pointer", "-pthread", *flags, "-o", str(out), str(src),
                    *libs], check=True)
    return out


def build() -> Tools:
    """Compile the workloads into bench/out/ (only when their source changed)."""
    OUT.mkdir(parents=True, exist_ok=True)
    if shutil.which("bpftool") is None:
        raise BenchError("no bpftool (to see other people's probes): `make bench` installs it")
    return Tools(
        workload=compile_c(ROOT / "tests" / "workloads" / "offtop_workload.c", OUT / "bench_wl"),
        pacer=compile_c(BENCH / "workloads" / "pacer.c", OUT / "bench_pacer"),
        bpftrace=shutil.which("bpftrace"),
    )


# --- processes ---------------------------------------------------------------


class Background:
    """A process in its own session; its stdout read line by line in a thread.

    Keeps the last `keep` lines (all when None); stderr goes to bench/out/NAME.stderr.
    """

    def __init__(self, argv: Sequence[str], name: str, *, keep: int | None = None,
                 env: dict[str, str] | None = None, cwd: Path = ROOT) -> None:
        self.name = name
        self.argv = list(argv)
        self.lines: list[str] = []
        self.nlines = 0
        self.first_line_at: float | None = None
        self._keep = keep
        self._cv = threading.Condition()
        self._err_path = OUT / f"{name}.stderr"
        self._err = self._err_path.open("w")
        self.started_at = time.monotonic()
        self.proc = subprocess.Popen(
            self.argv, stdout=subprocess.PIPE, stderr=self._err, text=True, cwd=cwd,
            start_new_session=True, env={**os.environ, **(env or {})},
        )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with self._cv:
                if self.first_line_at is None:
                    self.first_line_at = time.monotonic()
                self.lines.append(line)
                self.nlines += 1
                if self._keep is not None and len(self.lines) > self._keep:
                    del self.lines[: len(self.lines) - self._keep]
                self._cv.notify_all()
        with self._cv:
            self._cv.notify_all()

    def wait_for(self, pred: Callable[[str], bool], timeout: float = 30.0) -> str:
        """Wait for a stdout line matching `pred`; raise if the process dies first."""
        end = time.monotonic() + timeout
        seen = 0
        with self._cv:
            while True:
                for line in self.lines[seen:]:
                    if pred(line):
                        return line
                seen = len(self.lines)
                if self.proc.poll() is not None and not self._reader.is_alive():
                    raise BenchError(f"{self.name} exited ({self.proc.returncode}): {self.stderr_tail()}")
                left = end - time.monotonic()
                if left <= 0:
                    raise BenchError(f"{self.name} not ready after {timeout:.0f}s: {self.stderr_tail()}")
                self._cv.wait(min(left, 0.2))

    def stderr_tail(self) -> str:
        self._err.flush()
        try:
            text = self._err_path.read_text().strip().splitlines()
        except OSError:
            return ""
        return " | ".join(text[-3:])

    def stop(self, sig: int = signal.SIGINT, timeout: float = 20.0) -> None:
        """Ask the process to finish (SIGINT: offtop prints its last interval), then kill its group."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                say(f"  {self.name} ignored {signal.Signals(sig).name}: killing it")
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(5)
        self._reader.join(5)
        self._err.close()


def cpu_ticks(pid: int) -> int:
    """utime + stime of a process (all threads), in clock ticks."""
    return stat_ticks(Path(f"/proc/{pid}/stat"))


def stat_ticks(path: Path) -> int:
    """utime + stime in a /proc stat file (a process's, or one thread's under task/)."""
    stat = path.read_text()
    fields = stat[stat.rindex(")") + 2:].split()
    return int(fields[11]) + int(fields[12])


def rss_mb(pid: int, field: str = "VmRSS") -> float:
    """A memory figure of /proc/PID/status in MB: VmRSS (resident now) or VmHWM (peak)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def tree_rss_mb(pid: int) -> float:
    """VmRSS of a process and all its descendants, summed, in MB (what they hold together)."""
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        with contextlib.suppress(OSError, ValueError):
            rss = rss_mb(p)
            total += 0.0 if math.isnan(rss) else rss
            for task in Path(f"/proc/{p}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
    return total


class TreePeak:
    """The largest tree_rss_mb(pid) seen, sampled every `step` s in a thread until stop().

    A process's own peak (VmHWM, ru_maxrss) misses what a child holds at the
    same time: offtop may compile its BPF program in a child process.
    """

    def __init__(self, pid: int, step: float = 0.01) -> None:
        self.pid = pid
        self.peak = 0.0
        self._step = step
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._done.is_set():
            self.peak = max(self.peak, tree_rss_mb(self.pid))
            self._done.wait(self._step)

    def stop(self) -> float:
        self._done.set()
        self._thread.join(5)
        return self.peak


def wait_peak_rss_mb(proc: subprocess.Popen[Any], timeout: float) -> float:
    """Reap `proc` with wait4(2): its peak RSS over its whole life (ru_maxrss), in MB.

    /proc/PID/status's VmHWM is gone once the process exits; the kernel
    keeps the peak in the rusage it hands the parent.
    """
    end = time.monotonic() + timeout
    while True:
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            proc.returncode = os.waitstatus_to_exitcode(status)
            return usage.ru_maxrss / 1024
        if time.monotonic() > end:
            raise BenchError(f"pid {proc.pid} did not exit within {timeout:.0f}s")
        time.sleep(0.02)


CLK_TCK = os.sysconf("SC_CLK_TCK")


# --- other people's probes ---------------------------------------------------


def sched_probes() -> list[tuple[int, str]]:
    """(pid, what) of every BPF program attached to a sched tracepoint, by anyone.

    Another offtop, bpftrace or perf on the same tracepoint makes every context
    switch dearer, our baseline included: on a shared machine that is the
    largest error there is, so runs wait until only our own tracer is there.
    """
    out: list[tuple[int, str]] = []
    r = subprocess.run(["bpftool", "perf", "show", "--json"], capture_output=True, text=True)
    with contextlib.suppress(ValueError):
        for p in json.loads(r.stdout or "[]"):
            tp = p.get("tracepoint", "")
            if tp.startswith("sched_"):
                out.append((int(p["pid"]), tp))
    r = subprocess.run(["bpftool", "link", "show", "--json"], capture_output=True, text=True)
    with contextlib.suppress(ValueError):
        for link in json.loads(r.stdout or "[]"):
            tp = str(link.get("tp_name", ""))
            if tp.startswith("sched_"):
                for p in link.get("pids", []) or [{"pid": -1}]:
                    out.append((int(p["pid"]), tp))
    return out


@dataclass
class Quiet:
    """Waits until no one else's probe sits on a sched tracepoint; counts the waits."""

    waits: int = 0
    waited_s: float = 0.0
    retries: int = 0

    def foreign(self, own: Background | None) -> list[tuple[int, str]]:
        mine = {own.proc.pid} if own is not None else set()
        return [(pid, tp) for pid, tp in sched_probes() if pid not in mine]

    def wait(self, own: Background | None, timeout: float = 900.0) -> None:
        t0 = time.monotonic()
        told = False
        while True:
            others = self.foreign(own)
            if not others:
                break
            if not told:
                who = ", ".join(f"pid {pid} ({_comm(pid)}) on {tp}" for pid, tp in others[:3])
                say(f"  waiting: another probe is attached: {who}")
                told = True
                self.waits += 1
            if time.monotonic() - t0 > timeout:
                raise BenchError(f"other probes stayed attached for {timeout:.0f}s: cannot measure")
            time.sleep(0.5)
        self.waited_s += time.monotonic() - t0

    def measure(self, own: Background | None, run: Callable[[], T], tries: int = 50) -> T:
        """run() with no foreign probe before or after it (retried if one came and went)."""
        for _ in range(tries):
            self.wait(own)
            value = run()
            if not self.foreign(own):
                return value
            self.retries += 1
        raise BenchError("other probes kept attaching during the runs: cannot measure")


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:80].strip()
    except OSError:
        return "?"


# --- the tracers -------------------------------------------------------------


@dataclass(frozen=True)
class Tracer:
    """One way of tracing sched_switch (or none), started before a workload run."""

    name: str
    label: str
    argv: tuple[str, ...] = ()
    ready: Callable[[str], bool] = lambda line: True
    is_offtop: bool = False
    env: tuple[tuple[str, str], ...] = ()
    cwd: Path = ROOT

    def start(self) -> Background | None:
        if not self.argv:
            return None
        bg = Background(["taskset", "-c", TRACER_CPU, *self.argv], self.name, env=dict(self.env),
                        cwd=self.cwd)
        try:
            bg.wait_for(self.ready, timeout=60)
        except BaseException:
            bg.stop()
            raise
        return bg


def offtop_argv(*args: str, variant: Sequence[str] = ()) -> tuple[str, ...]:
    base = ["--batch", "--format", "json", "--interval", "1", *args]
    if variant:
        return (PY, str(BENCH / "probe_variant.py"), *variant, "--", *base)
    return (PY, "-m", "offtop.cli", *base)


def offtop_tracer(name: str, label: str, *args: str, variant: Sequence[str] = ()) -> Tracer:
    return Tracer(name, label, offtop_argv(*args, variant=variant), is_offtop=True)


def checkout(ref: str) -> Path:
    """offtop/ as of git `ref`, unpacked under bench/out/ (for --against)."""
    sha = subprocess.run(["git", "rev-parse", "--short", ref], capture_output=True, text=True,
                         cwd=ROOT, check=True).stdout.strip()
    where = OUT / f"ref-{sha}"
    if not (where / "offtop").exists():
        where.mkdir(parents=True, exist_ok=True)
        archive = subprocess.run(["git", "archive", sha, "offtop"], capture_output=True, cwd=ROOT,
                                 check=True).stdout
        subprocess.run(["tar", "-x", "-C", str(where)], input=archive, check=True)
    return where


def against(t: Tracer, ref: str) -> Tracer:
    """The same offtop configuration, run from the code of git `ref`."""
    where = checkout(ref)
    # Run from there: `python -m` puts the working directory first on sys.path.
    return Tracer(f"{t.name}@{ref}", f"{t.label} @ {ref}", t.argv, is_offtop=True,
                  env=(("PYTHONPATH", str(where)),), cwd=where)


def bpftrace_tracer(tools: Tools) -> Tracer:
    if tools.bpftrace is None:
        raise BenchError("bpftrace is not installed: `make bench` installs it (Debian package bpftrace)")
    return Tracer("bpftrace", "bpftrace (bench/offcpu.bt)", (tools.bpftrace, str(BENCH / "offcpu.bt")),
                  ready=lambda line: line.strip() == "ready")


EMPTY_TRACER = Tracer("empty", "empty bcc program (the floor)", (PY, str(BENCH / "empty_probe.py")),
                      ready=lambda line: line.strip() == "ready")
NO_TRACER = Tracer("none", "no tracing")


@contextlib.contextmanager
def traced(tracer: Tracer) -> Iterator[Background | None]:
    bg = tracer.start()
    try:
        yield bg
    finally:
        if bg is not None:
            bg.stop()


def snapshots(bg: Background | None) -> list[dict[str, Any]]:
    """offtop's JSON snapshots, parsed."""
    if bg is None:
        return []
    out = []
    for line in bg.lines:
        with contextlib.suppress(ValueError):
            out.append(json.loads(line))
    return out


def probe_ns_per_switch(snaps: list[dict[str, Any]], min_rate: float) -> float | None:
    """offtop's own BPF run-time per switch, over the intervals the workload was busy."""
    busy = [s["stats"] for s in snaps if s["stats"].get("switches_per_s", 0) >= min_rate]
    runs = sum(s["probe_runs"] for s in busy)
    return sum(s["probe_run_ns"] for s in busy) / runs if runs else None


# --- workloads -------------------------------------------------------------------


def pingpong(tools: Tools, rounds: int, *, batch: bool = False) -> float:
    """One `pingpong` run on the workload CPU: ns per round trip.

    batch: run it as SCHED_BATCH, whose wakeups never preempt, so each side
    blocks once per round trip (two blocks, not one: the woken side would
    otherwise preempt the writer, which then finds its reply already there).
    """
    sched = ["chrt", "-b", "0"] if batch else []
    r = subprocess.run(["taskset", "-c", WORKLOAD_CPU, *sched, str(tools.workload), "pingpong", str(rounds)],
                       capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        raise BenchError(f"pingpong failed: {r.stderr.strip()}")
    return float(r.stdout.split()[-1])


@contextlib.contextmanager
def pacer(tools: Tools, rate: int, churn: int = 0) -> Iterator[Background]:
    bg = Background(["taskset", "-c", WORKLOAD_CPU, str(tools.pacer), str(rate), str(churn)], "pacer")
    try:
        bg.wait_for(lambda line: line.startswith("ready"), timeout=10)
        yield bg
    finally:
        bg.stop(signal.SIGKILL)


# --- the context of one run ----------------------------------------------------


@dataclass
class Ctx:
    """What the command line asked for."""

    tools: Tools
    quick: bool
    runs: int
    long_minutes: float | None
    variants: list[tuple[str, list[str]]] = field(default_factory=list)
    configs: list[str] | None = None
    against: str | None = None
    batch_sched: bool = True
    busy_runs: int = 3
    ref: str | None = None


def rotations(names: Sequence[str], runs: int) -> Iterator[tuple[int, list[str]]]:
    """Round r runs every configuration once, starting one further along each round."""
    n = len(names)
    for r in range(runs):
        k = r % n
        yield r, [*names[k:], *names[:k]]


# --- 1. added cost per context switch ---------------------------------------------


def bench_switch(ctx: Ctx) -> dict[str, Any]:
    """pingpong pinned to one CPU: round trip with each tracer minus without, over 2."""
    tools = ctx.tools
    tracers = [
        NO_TRACER,
        offtop_tracer("offtop", "offtop, kernel + user stacks"),
        offtop_tracer("offtop-user", "offtop, user stacks only", "--no-kernel-stacks"),
        offtop_tracer("offtop-kernel", "offtop, kernel stacks only", "--no-user-stacks"),
        offtop_tracer("offtop-nostacks", "offtop, no stacks", "--no-stacks"),
        # Wakers (issue 11): every pingpong switch is also a wakeup. Its blocks are
        # short (< 1 ms): by default the waker is named but its stacks not taken.
        offtop_tracer("offtop-nowakers", "offtop, both stacks, --no-wakers", "--no-wakers"),
        offtop_tracer("offtop-wakerstacks", "offtop, both stacks, waker stacks always",
                      "--waker-stacks-min", "0"),
        bpftrace_tracer(tools),
        EMPTY_TRACER,
    ]
    for name, spec in ctx.variants:
        own, extra = (spec[:spec.index("--")], spec[spec.index("--") + 1:]) if "--" in spec else (spec, [])
        tracers.append(offtop_tracer(name, f"variant {name}: {' '.join(spec)}", *extra,
                                     variant=own or ["--set", "threshold_ns=500000000"]))
    if ctx.configs:
        keep = {"none", *ctx.configs, *(name for name, _ in ctx.variants)}
        tracers = [t for t in tracers if t.name in keep]
    if ctx.against:
        tracers += [against(t, ctx.against) for t in tracers
                    if t.is_offtop and not t.name.startswith(tuple(n for n, _ in ctx.variants))]
    by_name = {t.name: t for t in tracers}
    rounds_n = 50_000
    reps = 3 if ctx.quick else 5
    modes = ("preempt", "block") if ctx.batch_sched else ("preempt",)
    rt: dict[str, dict[str, list[float]]] = {m: {t.name: [] for t in tracers} for m in modes}
    probe: dict[str, dict[str, list[float]]] = {m: {t.name: [] for t in tracers} for m in modes}
    say(f"switch: {ctx.runs} rounds x {len(tracers)} configurations, pingpong {rounds_n} x {reps} "
        f"in each of {', '.join(modes)}")
    for r, order in rotations(list(by_name), ctx.runs):
        for name in order:
            t = by_name[name]
            spans = []
            with traced(t) as bg:
                for mode in modes:
                    t0 = time.time()
                    # Several runs per session; the fastest is the one least disturbed by
                    # other tenants (noise here only ever adds time).
                    rt[mode][name].append(min(
                        tools.quiet.measure(bg, lambda m=mode: pingpong(tools, rounds_n, batch=m == "block"))
                        for _ in range(reps)))
                    spans.append((mode, t0, time.time()))
                    if t.is_offtop:
                        time.sleep(1.1)  # let offtop sample a busy interval and close it
            if t.is_offtop:
                for mode, t0, t1 in spans:
                    # The probe's run-time stats are sampled mid-interval: keep the
                    # intervals whose sampling window fell inside this mode's runs.
                    snaps = [sn for sn in snapshots(bg) if t0 <= sn["time"] - sn["interval_s"] / 2 <= t1]
                    p = probe_ns_per_switch(snaps, min_rate=50_000)
                    if p is not None:
                        probe[mode][name].append(p)
        say(f"  round {r + 1}: " + "  ".join(
            f"{n}={'/'.join(f'{rt[m][n][-1]:.0f}' for m in modes)}" for n in by_name))
    result: dict[str, Any] = {"pingpong_rounds": rounds_n, "reps": reps, "runs": ctx.runs, "modes": {}}
    print("\n1. Added cost per context switch: pingpong pinned to CPU 1, ns per switch = "
          "(round trip - untraced round trip) / 2")
    for mode in modes:
        added = {n: Dist(tuple((a - b) / 2 for a, b in zip(rt[mode][n], rt[mode]["none"], strict=True)))
                 for n in rt[mode] if n != "none"}
        rows = []
        for t in tracers:
            rows.append({
                "name": t.name, "label": t.label, "round_trip_ns": Dist(tuple(rt[mode][t.name])).json(),
                "added_ns_per_switch": added[t.name].json() if t.name in added else None,
                "probe_ns_per_switch": Dist(tuple(probe[mode][t.name])).json()
                if probe[mode][t.name] else None,
            })
        res: dict[str, Any] = {"rows": rows}
        med = {n: d.median for n, d in added.items()}
        if "offtop" in med and "bpftrace" in med:
            res["stacks_vs_bpftrace"] = ratio(med["offtop"], med["bpftrace"])
        if "offtop-nostacks" in med and "empty" in med:
            res["nostacks_vs_empty"] = ratio(med["offtop-nostacks"], med["empty"])
        result["modes"][mode] = res
        print(f"\n   {MODE_TITLES[mode]}")
        print(f"   {'configuration':44} {'round trip ns':>24} {'added ns/switch':>24} "
              f"{'probe ns/switch':>20}")
        for t in tracers:
            a = added.get(t.name)
            p = Dist(tuple(probe[mode][t.name])) if probe[mode][t.name] else None
            print(f"   {t.label:44} {Dist(tuple(rt[mode][t.name])).fmt():>24} {a.fmt() if a else '':>24} "
                  f"{p.fmt() if p else '':>20}")
        if "stacks_vs_bpftrace" in res:
            target = f"target <= {SWITCH_VS_BPFTRACE}x" if mode == "block" else "not like for like: no target"
            print(f"   offtop (both stacks) / bpftrace = {res['stacks_vs_bpftrace']:.2f}x  ({target})")
        if "nostacks_vs_empty" in res:
            print(f"   offtop (no stacks) / empty program = "
                  f"{vs_floor(med['offtop-nostacks'], med['empty'])}  (target <= 2x)")
        if "offtop" in med and "offtop-nowakers" in med:
            res["wakers_ns_per_wakeup"] = med["offtop"] - med["offtop-nowakers"]
            line = (f"   waker capture, per switch (each one a wakeup): names "
                    f"{res['wakers_ns_per_wakeup']:+.0f} ns")
            if "offtop-wakerstacks" in med:
                res["waker_stacks_ns_per_wakeup"] = med["offtop-wakerstacks"] - med["offtop-nowakers"]
                line += f", names and stacks {res['waker_stacks_ns_per_wakeup']:+.0f} ns"
            print(line + " (against --no-wakers, same round)")
    return result


MODE_TITLES = {
    "preempt": "as the issue prescribes (SCHED_OTHER): the woken side preempts the writer, so per "
               "round trip one switch-out is a block (S) and one a preemption (R), which offtop's "
               "default states (SDI) do not record and bpftrace's script does",
    "block": "every switch a block (SCHED_BATCH: wakeups do not preempt): both switch-outs of a "
             "round trip are blocks, so offtop and bpftrace walk the same stacks; like for like",
}


# --- 2. event throughput ------------------------------------------------------------


def bench_throughput(ctx: Ctx) -> dict[str, Any]:
    """pingpong at threshold 0: every block becomes a perf-buffer event."""
    tools = ctx.tools
    tracers = [
        NO_TRACER,
        offtop_tracer("offtop-t0", "offtop --threshold 0", "--threshold", "0"),
        offtop_tracer("offtop-t0-nostacks", "offtop --threshold 0 --no-stacks", "--threshold", "0",
                      "--no-stacks"),
    ]
    by_name = {t.name: t for t in tracers}
    rounds_n = 300_000 if ctx.quick else 600_000
    rt: dict[str, list[float]] = {n: [] for n in by_name}
    rate: dict[str, list[float]] = {n: [] for n in by_name}
    per_trip: dict[str, list[float]] = {n: [] for n in by_name}
    lost: dict[str, int] = {n: 0 for n in by_name}
    say(f"throughput: {ctx.runs} rounds x {len(tracers)} configurations, pingpong {rounds_n}")
    comm = tools.workload.name[:15]
    for r, order in rotations(list(by_name), ctx.runs):
        for name in order:
            t = by_name[name]
            for _ in range(50):
                with traced(t) as bg:
                    tools.quiet.wait(bg)
                    trip = pingpong(tools, rounds_n, batch=True)
                    clean = not tools.quiet.foreign(bg)
                    if bg is not None:
                        time.sleep(1.1)  # let offtop close the busy interval
                if clean:
                    break
                tools.quiet.retries += 1
            else:
                raise BenchError("other probes kept attaching during the runs: cannot measure")
            rt[name].append(trip)
            if bg is None:
                continue
            snaps = snapshots(bg)
            ev = sum(task["events"] for s in snaps for task in s["tasks"] if task["comm"] == comm)
            # Over the workload's own timed loop (two blocks per round trip).
            rate[name].append(ev / (rounds_n * trip * 1e-9))
            per_trip[name].append(ev / rounds_n)
            # Lost: LOST records in the ring, and outputs the kernel refused (ring full).
            last = snaps[-1]["stats"] if snaps else {}
            lost[name] += last.get("lost_total", 0) + last.get("drops", {}).get("perf output failed", 0)
        say(f"  round {r + 1}: " + "  ".join(f"{n}={rt[n][-1]:.0f}" for n in by_name))
    rows = []
    print("\n2. Event throughput (pingpong as SCHED_BATCH pinned to CPU 1; offtop --threshold 0: "
          "one event per block)")
    print(f"   {'configuration':36} {'round trip ns':>22} {'workload events/s':>26} {'ev/trip':>8} "
          f"{'lost':>6} {'slowdown':>20}")
    for n, t in by_name.items():
        slow = Dist(tuple(a / b for a, b in zip(rt[n], rt["none"], strict=True)))
        row = {"name": n, "label": t.label, "round_trip_ns": Dist(tuple(rt[n])).json(),
               "slowdown": slow.json()}
        if n != "none":
            row |= {"events_per_s": Dist(tuple(rate[n])).json(),
                    "events_per_trip": Dist(tuple(per_trip[n])).json(), "lost": lost[n]}
            print(f"   {t.label:36} {Dist(tuple(rt[n])).fmt():>22} {Dist(tuple(rate[n])).fmt():>26} "
                  f"{Dist(tuple(per_trip[n])).median:8.3f} {lost[n]:6d} {slow.fmt(digits=2, unit='x'):>20}")
        else:
            print(f"   {t.label:36} {Dist(tuple(rt[n])).fmt():>22}")
        rows.append(row)
    return {"rows": rows, "pingpong_rounds": rounds_n, "runs": ctx.runs}


# --- 3. offtop's own CPU ------------------------------------------------------------------


def tui_available() -> bool:
    return (ROOT / "offtop" / "app.py").exists() and shutil.which("tmux") is not None


class TmuxSession:
    """A full-screen program in a detached tmux session (160x50), as a user would run it.

    `pid` is the program's own process: the pane's shell execs it.
    """

    def __init__(self, argv: Sequence[str], name: str = "offtop", *, cwd: Path = ROOT,
                 env: dict[str, str] | None = None, cpus: str | None = TRACER_CPU) -> None:
        self.name = f"{name}-bench-{os.getpid()}"
        setenv = ["env", *(f"{k}={v}" for k, v in (env or {}).items())] if env else []
        pin = ["taskset", "-c", cpus] if cpus else []
        cmd = shlex.join([*setenv, *pin, *argv])
        subprocess.run(["tmux", "new-session", "-d", "-s", self.name, "-x", "160", "-y", "50",
                        f"cd {shlex.quote(str(cwd))} && exec {cmd}"], check=True)
        out = subprocess.run(["tmux", "list-panes", "-t", self.name, "-F", "#{pane_pid}"],
                             capture_output=True, text=True, check=True)
        self.pid = int(out.stdout.split()[0])

    def alive(self) -> bool:
        return Path(f"/proc/{self.pid}").exists()

    def screen(self) -> str:
        """What the pane shows now."""
        r = subprocess.run(["tmux", "capture-pane", "-t", self.name, "-p"], capture_output=True, text=True)
        return r.stdout

    def stop(self, sig: int = signal.SIGINT) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, sig)
        end = time.monotonic() + 10
        while self.alive() and time.monotonic() < end:
            time.sleep(0.1)
        subprocess.run(["tmux", "kill-session", "-t", self.name], capture_output=True)
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)


class TuiSession(TmuxSession):
    """offtop's TUI in a detached tmux session. `launcher`: what runs offtop's command
    line (`python -m offtop.cli`; bench/gc_timed.py times its GC passes)."""

    def __init__(self, args: Sequence[str], *, cwd: Path = ROOT, env: dict[str, str] | None = None,
                 cpus: str | None = TRACER_CPU, launcher: Sequence[str] = ("-m", "offtop.cli")) -> None:
        super().__init__([PY, *launcher, *args], "offtop", cwd=cwd, env=env, cpus=cpus)


def measure_cpu(pid: int, seconds: float) -> float:
    """% of one core used by `pid` (utime+stime) over `seconds`."""
    t0, c0 = time.monotonic(), cpu_ticks(pid)
    time.sleep(seconds)
    t1, c1 = time.monotonic(), cpu_ticks(pid)
    return 100.0 * (c1 - c0) / CLK_TCK / (t1 - t0)


def bench_cpu(ctx: Ctx) -> dict[str, Any]:
    """offtop's utime+stime at 1 s refresh while a paced workload makes ~50k switches/s."""
    seconds = 10.0 if ctx.quick else 15.0
    modes = ["batch", *(["tui"] if tui_available() else [])]
    if "tui" not in modes:
        say("cpu: offtop/app.py (the TUI) is not there yet: batch mode only")
    cpu: dict[str, list[float]] = {m: [] for m in modes}
    probe_pct: list[float] = []
    switches: list[float] = []
    say(f"cpu: {ctx.runs} rounds x {modes}, {seconds:.0f}s each, pacer at 50k switches/s")
    with pacer(ctx.tools, 50_000):
        for r, order in rotations(modes, ctx.runs):
            for mode in order:
                if mode == "batch":
                    bg = Background(["taskset", "-c", TRACER_CPU, *offtop_argv()], "offtop-cpu", keep=50)
                    try:
                        bg.wait_for(lambda line: True, timeout=60)
                        time.sleep(1.0)
                        cpu[mode].append(measure_cpu(bg.proc.pid, seconds))
                    finally:
                        bg.stop()
                    # Intervals whose stats window was sampled (not the last, cut short).
                    stats = [s["stats"] for s in snapshots(bg)[1:] if s["stats"]["probe_runs"]]
                    switches.extend(s["switches_per_s"] for s in stats)
                    probe_pct.extend(s["probe_cpu_pct"] for s in stats)
                else:
                    tui = TuiSession(["--interval", "1"])
                    try:
                        time.sleep(4.0)  # compile and first paint
                        if not tui.alive():
                            raise BenchError("the TUI exited at start (run it by hand to see why)")
                        cpu[mode].append(measure_cpu(tui.pid, seconds))
                    finally:
                        tui.stop()
            say(f"  round {r + 1}: " + "  ".join(f"{m}={cpu[m][-1]:.2f}%" for m in modes))
    print("\n3. offtop's own CPU (utime+stime, % of one core, 1 s refresh, pacer at ~50k switches/s)")
    sw = Dist(tuple(switches))
    print(f"   switches/s seen by offtop: {sw.fmt()}")
    out: dict[str, Any] = {"runs": ctx.runs, "seconds": seconds, "switches_per_s": sw.json()}
    for m in modes:
        d = Dist(tuple(cpu[m]))
        print(f"   {m:6} {d.fmt(digits=2, unit=' %'):>24}   (target < 3 %)")
        out[m] = d.json()
    pp = Dist(tuple(probe_pct))
    print(f"   the BPF probe itself (charged to the switching tasks, not to offtop): {pp.fmt(digits=2)} %")
    out["probe_cpu_pct"] = pp.json()
    return out


# --- 4. start-up ----------------------------------------------------------------


PHASES = (  # (mark, label, short label for the table)
    ("interpreter", "Python start-up", "python"),
    ("import", "import offtop", "import"),
    ("environment", "environment checks", "checks"),
    ("bcc_import", "import bcc (before offtop's own loader)", "bcc import"),
    ("compile_load", "compile (or cache) + load + attach", "compile+load"),
    ("start", "maps, perf ring, symbols", "maps+rings+symbols"),
    ("first_snapshot", "first interval", "first interval"),
)


@dataclass
class StartRuns:
    """Launch to first snapshot and peak RSS of one kind of start-up run."""

    first: list[float] = field(default_factory=list)
    peak: list[float] = field(default_factory=list)  # the larger of the two below
    own_peak: list[float] = field(default_factory=list)
    tree_peak: list[float] = field(default_factory=list)

    def json(self) -> dict[str, Any]:
        return {"first_snapshot_s": Dist(tuple(self.first)).json(),
                "peak_rss_mb": Dist(tuple(self.peak)).json(),
                "own_peak_rss_mb": Dist(tuple(self.own_peak)).json(),
                "tree_peak_rss_mb": Dist(tuple(self.tree_peak)).json()}


def bench_startup(ctx: Ctx) -> dict[str, Any]:
    """Launch to the first JSON line of --count 1: with the compiled program cached (as every
    start but the first), with an empty cache (a fresh machine), and phase-timed.

    With --against REF, offtop from REF's code also starts cached and with an empty cache,
    in the same rounds (A/B of a change; not written to the README)."""
    runs = {"warm": StartRuns(), "cold": StartRuns(), "timed": StartRuns()}
    phases: dict[str, list[float]] = {k: [] for k, _, _ in PHASES}
    loads: list[str] = []
    args = ["--batch", "--format", "json", "--count", "1"]
    code_dir = checkout(ctx.ref) if ctx.ref else ROOT
    codes = {"": code_dir}
    if ctx.against:
        codes[f"@{ctx.against}"] = checkout(ctx.against)
        runs.update({f"{k}@{ctx.against}": StartRuns() for k in ("warm", "cold")})
    say(f"startup: {ctx.runs} rounds x ({', '.join(runs)})"
        + (f", offtop from {ctx.ref}" if ctx.ref else ""))

    def launch(which: str) -> None:
        kind, at, ref = which.partition("@")
        where = codes[at + ref]
        argv = [PY, str(BENCH / "startup_breakdown.py"), *args] if kind == "timed" else \
            [PY, "-m", "offtop.cli", *args]
        # On the path first: the phase-timed run is a script in bench/, whose directory,
        # not the working directory, heads sys.path (the venv's offtop is another tree's).
        env = {"PYTHONPATH": str(where)}
        cold_dir = None
        if kind == "cold":
            # An empty cache of the kind offtop trusts (root's, 0700, under sticky /tmp).
            cold_dir = tempfile.mkdtemp(prefix="offtop-bench-cache-")
            env["OFFTOP_CACHE_DIR"] = cold_dir
        t0 = time.monotonic()
        bg = Background(["taskset", "-c", TRACER_CPU, *argv], f"startup-{kind}",
                        env={"OFFTOP_BENCH_T0": repr(t0), **env}, cwd=where)
        try:
            tree = TreePeak(bg.proc.pid)
            bg.wait_for(lambda line: True, timeout=60)
            assert bg.first_line_at is not None
            most = wait_peak_rss_mb(bg.proc, 30)
            together = tree.stop()
        finally:
            bg.stop()
            if cold_dir:
                shutil.rmtree(cold_dir, ignore_errors=True)
        r = runs[which]
        r.first.append(bg.first_line_at - t0)
        r.own_peak.append(most)
        r.tree_peak.append(together)
        r.peak.append(max(most, together))
        if kind == "timed":
            marks = json.loads((OUT / "startup-timed.stderr").read_text().strip().splitlines()[-1])
            prev = 0.0
            for k, _, _ in PHASES:
                at_s = marks.get(k, prev)
                phases[k].append(at_s - prev)
                prev = at_s
            if "load" in marks:
                loads.append(str(marks["load"].get("how", "?")))

    for which in runs:  # fills the cache (not counted)
        if which.startswith("warm"):
            launch(which)
            runs[which] = StartRuns()
    for r, order in rotations(list(runs), ctx.runs):
        for which in order:
            launch(which)
        say(f"  round {r + 1}: " + "  ".join(f"{w}={runs[w].first[-1]:.3f}s/{runs[w].peak[-1]:.0f}MB"
                                            for w in runs))
    first_interval = _first_interval_s(code_dir)
    print("\n4. Start-up: launch to the first JSON line of `offtop --batch --format json --count 1`")
    print("   peak RSS: the larger of the process's ru_maxrss (its own peak, or a reaped child's) and the "
          "RSS of it and its children summed (sampled every 10 ms)")
    for which, label in (("warm", "compiled program cached (every start but the first)"),
                         ("cold", "empty cache (a fresh machine: compiles)")):
        for at in codes:
            rr = runs[which + at]
            d, pk = Dist(tuple(rr.first)), Dist(tuple(rr.peak))
            print(f"   {label}{' (offtop ' + at[1:] + ')' if at else ''}:")
            print(f"     launch to first snapshot {d.fmt(digits=3, unit=' s')}   (target <= 1.5 s)")
            print(f"     peak RSS {pk.fmt(unit=' MB')} (process {Dist(tuple(rr.own_peak)).fmt()}, "
                  f"with children {Dist(tuple(rr.tree_peak)).fmt()})   (target <= 150 MB)")
        if ctx.against:
            a, b = runs[which], runs[f"{which}@{ctx.against}"]
            print(f"     this tree / {ctx.against}: first snapshot "
                  f"{ratio(Dist(tuple(a.first)).median, Dist(tuple(b.first)).median):.2f}{TIMES}, "
                  f"peak RSS {ratio(Dist(tuple(a.peak)).median, Dist(tuple(b.peak)).median):.2f}{TIMES}")
    how = ", ".join(sorted(set(loads))) or "not reported"
    print(f"   breakdown (phase-timed runs, cached; medians; first interval is {first_interval} s; "
          f"program: {how}):")
    for k, label, _ in PHASES:
        print(f"     {label:40} {Dist(tuple(phases[k])).fmt(scale=1e-3, unit=' ms')}")
    warm = runs["warm"].json()
    out = {"runs": ctx.runs, **warm, "cold": runs["cold"].json(), "timed": runs["timed"].json(),
           "timed_first_snapshot_s": runs["timed"].json()["first_snapshot_s"],
           "phases_s": {k: Dist(tuple(v)).json() for k, v in phases.items()}, "program": how,
           "first_interval_s": first_interval, "code": ctx.ref or "working tree"}
    if ctx.against:
        out["against"] = {ctx.against: {k: runs[f"{k}@{ctx.against}"].json() for k in ("warm", "cold")}}
    return out


def _first_interval_s(cwd: Path = ROOT) -> float | None:
    """EngineConfig.first_interval_s, if the engine has one (None: a full interval)."""
    r = subprocess.run([PY, "-c", "from offtop.bpf.engine import EngineConfig as C; "
                        "print(getattr(C(), 'first_interval_s', None))"],
                       capture_output=True, text=True, cwd=cwd)
    text = r.stdout.strip()
    return None if text in ("", "None") else float(text)


# --- 5. memory --------------------------------------------------------------------


def bench_memory(ctx: Ctx) -> dict[str, Any]:
    """offtop's RSS over a long run at ~50k switches/s with process churn."""
    minutes = ctx.long_minutes if ctx.long_minutes is not None else (1.0 if ctx.quick else 4.0)
    churn = 20
    step = 5.0
    samples: list[tuple[float, float]] = []
    say(f"memory: {minutes:g} min at ~50k switches/s with {churn} new processes/s, RSS every {step:.0f}s")
    with pacer(ctx.tools, 50_000, churn):
        bg = Background(["taskset", "-c", TRACER_CPU, *offtop_argv()], "offtop-memory", keep=3)
        try:
            bg.wait_for(lambda line: True, timeout=60)
            t0 = time.monotonic()
            end = t0 + minutes * 60
            next_say = t0 + 60
            while time.monotonic() < end:
                if bg.proc.poll() is not None:
                    raise BenchError(f"offtop exited during the memory run: {bg.stderr_tail()}")
                now = time.monotonic()
                samples.append((now - t0, rss_mb(bg.proc.pid)))
                if now >= next_say:
                    say(f"  {(now - t0) / 60:.0f} min: RSS {samples[-1][1]:.1f} MB")
                    next_say += 60
                time.sleep(step)
            samples.append((time.monotonic() - t0, rss_mb(bg.proc.pid)))
            last = snapshots(bg)
        finally:
            bg.stop()
    warm = max(60.0, samples[-1][0] / 3)
    after = [(t, m) for t, m in samples if t >= warm]
    growth = slope(after) * 60
    final = samples[-1][1]
    peak = max(m for _, m in samples)
    at_warm = after[0][1] if after else final
    stats = last[-1]["stats"] if last else {}
    print(f"\n5. Memory: offtop batch, {minutes:g} min, pacer at ~50k switches/s + {churn} processes/s")
    print(f"   RSS at end {final:.1f} MB (peak {peak:.1f} MB; {at_warm:.1f} MB at warm-up, "
          f"{warm / 60:.1f} min); after warm-up {growth:+.2f} MB/min   (target <= 150 MB, flat)")
    if stats:
        print(f"   last interval: {stats.get('switches_per_s', 0):.0f} switches/s, stacks used "
              f"{stats.get('stacks_used')}/{stats.get('stacks_capacity')}, reclaimed "
              f"{stats.get('stacks_reclaimed')}, lost {stats.get('lost_total')}")
    return {"minutes": minutes, "churn_per_s": churn, "rss_end_mb": final, "rss_peak_mb": peak,
            "rss_warm_mb": at_warm, "warm_s": warm, "slope_mb_per_min": growth,
            "samples": [[round(t, 1), round(m, 2)] for t, m in samples]}


def slope(points: Sequence[tuple[float, float]]) -> float:
    """Least-squares slope (y per x)."""
    if len(points) < 2:
        return 0.0
    mx = statistics.fmean(p[0] for p in points)
    my = statistics.fmean(p[1] for p in points)
    den = sum((x - mx) ** 2 for x, _ in points)
    return sum((x - mx) * (y - my) for x, y in points) / den if den else 0.0


# --- 6. UI --------------------------------------------------------------------------


def bench_ui(ctx: Ctx) -> dict[str, Any]:
    """bench/bench_ui.py (the TUI engineer's benchmark), run as it is; its table parsed."""
    script = BENCH / "bench_ui.py"
    if not script.exists():
        raise BenchError("bench/bench_ui.py is not there yet")
    argv = [PY, str(script), "--runs", str(max(7, ctx.runs))]
    say(f"ui: {' '.join(argv[1:])}")
    r = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, timeout=1800)
    if r.returncode != 0:
        raise BenchError(f"bench_ui.py failed ({r.returncode}): {r.stderr.strip()[-500:]}")
    rows = []
    for line in r.stdout.splitlines():
        m = re.match(r"^(\S.*?)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+(\d+)\s+(\S+)$", line)
        if m:
            rows.append({"measure": m.group(1), "wall_median_ms": float(m.group(2)),
                         "wall_max_ms": float(m.group(3)), "cpu_median_ms": float(m.group(4)),
                         "cpu_max_ms": float(m.group(5)), "runs": int(m.group(6))})
    if not rows:
        raise BenchError("bench_ui.py printed no table")
    print("\n6. UI (bench/bench_ui.py: 2,000 tasks / 20,000 stacks replayed; ms)")
    for line in r.stdout.strip().splitlines():
        print(f"   {line}")
    return {"rows": rows}


# --- 7. the busy server ---------------------------------------------------------------


def bench_busy(ctx: Ctx) -> dict[str, Any]:
    """bench/busy_server.py, run as it is (its progress on stderr); its figures from its JSON."""
    out = OUT / "busy.json"
    out.unlink(missing_ok=True)
    argv = [PY, str(BENCH / "busy_server.py"), "--runs", str(ctx.busy_runs), "--json", str(out),
            "--no-readme", *(["--quick"] if ctx.quick else []), *(["--ref", ctx.ref] if ctx.ref else [])]
    say(f"busy: {' '.join(argv[1:])}")
    r = subprocess.run(argv, stdout=subprocess.PIPE, text=True, cwd=ROOT, timeout=3600)
    if r.returncode != 0 or not out.exists():
        raise BenchError(f"busy_server.py failed ({r.returncode})")
    print(r.stdout.rstrip())
    result: dict[str, Any] = json.loads(out.read_text())
    return result


# --- 8. the size of a recording ---------------------------------------------------------


def bench_recording(ctx: Ctx) -> dict[str, Any]:
    """bench/recording_size.py, run as it is; its figures from its JSON."""
    out = OUT / "recording.json"
    out.unlink(missing_ok=True)
    seconds = 30 if ctx.quick else 90
    argv = [PY, str(BENCH / "recording_size.py"), "--seconds", str(seconds), "--json", str(out)]
    say(f"recording: {' '.join(argv[1:])}")
    r = subprocess.run(argv, stdout=subprocess.PIPE, text=True, cwd=ROOT, timeout=3600)
    if r.returncode != 0 or not out.exists():
        raise BenchError(f"recording_size.py failed ({r.returncode})")
    print(r.stdout.rstrip())
    result: dict[str, Any] = json.loads(out.read_text())
    return result


def recording_rows(r: dict[str, Any], run: str) -> list[tuple[str, str, str, str, str]]:
    """The recording benchmark's rows (bench/recording_size.py writes `r`)."""
    rows = []
    for what, label in (("busy", "the busy server (section 7's load)"), ("idle", "an idle machine")):
        m = r.get(what)
        if not m:
            continue
        load = m.get("load")
        at = (f"; the load at {load['blocks_per_s'] / 1e3:.1f}k blocks/s" if load
              else "; someone else's busy server as the load" if m.get("load_shared") else "")
        rows.append((f"8. recording: an hour of --record, 1 s intervals, {label}",
                     f"{m['bytes_per_hour'] / 1e9:,.2f} GB/hour ({m['bytes_per_interval'] / 1e3:,.1f} kB "
                     f"per interval, {m['json_bytes_per_interval'] / 1e3:,.0f} kB of JSON; intervals of "
                     f"{m['interval_s']:.1f} s (median), at 1 s: "
                     f"{m['bytes_per_hour_at_1s'] / 1e9:.2f} GB/hour; "
                     f"{m['tasks']:,.0f} tasks, {m['stacks']:,.0f} stacks, "
                     f"{m['recorded_blocks_per_s'] / 1e3:,.1f}k blocks/s recorded, "
                     f"{m['switches_per_s'] / 1e3:,.0f}k switches/s machine-wide{at})",
                     "none (issue 12 names none); --replay reads files up to 256 MB", DASH, run))
    return rows


# --- bench/README.md ------------------------------------------------------------------


def machine() -> str:
    model = "?"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    mem = "?"
    with contextlib.suppress(OSError):
        kb = int(Path("/proc/meminfo").read_text().split()[1])
        mem = f"{kb / 1024 / 1024:.1f} GiB"
    virt = subprocess.run(["systemd-detect-virt"], capture_output=True, text=True).stdout.strip() \
        if shutil.which("systemd-detect-virt") else ""
    distro = ""
    with contextlib.suppress(OSError):
        m = re.search(r'^PRETTY_NAME="?([^"\n]*)', Path("/etc/os-release").read_text(), re.M)
        distro = m.group(1) if m else ""
    return (f"{distro}, kernel {platform.release()}, {os.cpu_count()} CPUs ({model}), {mem}"
            + (f", virtualization: {virt}" if virt and virt != "none" else ""))


def vs_floor(added: float, floor: float) -> str:
    """`added` over the empty program's `floor` as a ratio; none when the floor is
    not above zero (its cost lost in the noise: a ratio to it would be negative
    or infinite, and "<= 2x" said of it meaningless)."""
    if floor <= 0:
        return f"no ratio: the empty program's {floor:+.0f} ns is within noise"
    return f"{added / floor:.2f}{TIMES}"


def _dist(d: dict[str, Any] | None, scale: float = 1.0, digits: int = 0, unit: str = "") -> str:
    if not d:
        return DASH
    return (f"{d['median'] / scale:.{digits}f}{unit} "
            f"({d['min'] / scale:.{digits}f}{DASH}{d['max'] / scale:.{digits}f})")


def _row(results: dict[str, Any], name: str) -> dict[str, Any] | None:
    for row in results.get("rows", []):
        if row["name"] == name:
            return dict(row)
    return None


def summary_rows(res: dict[str, Any]) -> list[tuple[str, str, str, str, str]]:
    """(figure, measured, target, met, when) for the README's table."""
    rows: list[tuple[str, str, str, str, str]] = []

    def when(b: str) -> str:
        e = res.get(b, {})
        code = (e.get("result") or {}).get("code", "working tree")
        return (f"{e.get('date', '?')}{' (quick)' if e.get('quick') else ''}"
                + ("" if code == "working tree" or code.startswith("working tree") else f", offtop {code}"))

    def yes(ok: bool) -> str:
        return "**yes**" if ok else "**no**"

    sw = res.get("switch", {}).get("result")
    for mode, how in (("block", "every switch a block"), ("preempt", "pingpong as prescribed")):
        ms = (sw or {}).get("modes", {}).get(mode)
        if not ms:
            continue

        def added(n: str, ms: dict[str, Any] = ms) -> dict[str, Any] | None:
            row = _row(ms, n)
            return row["added_ns_per_switch"] if row else None

        o, b, n, e = added("offtop"), added("bpftrace"), added("offtop-nostacks"), added("empty")
        if o and b and "stacks_vs_bpftrace" in ms:
            x = ms["stacks_vs_bpftrace"]
            rows.append((f"1a. added cost per switch, kernel+user stacks ({how})",
                         f"offtop +{_dist(o, 1e3, 2)} {MICRO}s vs bpftrace +{_dist(b, 1e3, 2)} {MICRO}s = "
                         f"**{x:.2f}{TIMES}**",
                         *((f"{LE} {SWITCH_VS_BPFTRACE}{TIMES} bpftrace", yes(x <= SWITCH_VS_BPFTRACE))
                           if mode == "block" else ("none: not like for like (1a, every switch a block, is)",
                                                    DASH)),
                         when("switch")))
        if n and e and "nostacks_vs_empty" in ms:
            rows.append((f"1b. added cost per switch, no stacks ({how})",
                         f"offtop +{_dist(n, 1, 0)} ns vs empty program +{_dist(e, 1, 0)} ns = "
                         f"**{vs_floor(n['median'], e['median'])}**", f"{LE} 2{TIMES} empty program",
                         yes(n["median"] <= 2.0 * e["median"]), when("switch")))
    tp = res.get("throughput", {}).get("result")
    if tp:
        for name, label in (("offtop-t0", "kernel+user stacks"), ("offtop-t0-nostacks", "no stacks")):
            row = _row(tp, name)
            if not row:
                continue
            ev, slow = row["events_per_s"], row["slowdown"]
            ok = ev["median"] >= 300_000 and row["lost"] == 0 and slow["median"] <= 1.6
            rows.append((f"2. event throughput at threshold 0, {label}",
                         f"{_dist(ev, 1e3, 0)}k events/s, {row['lost']} lost, "
                         f"slowdown {_dist(slow, 1, 2)}{TIMES}",
                         f"{GE} 300k events/s, 0 lost, slowdown {LE} 1.6{TIMES}", yes(ok),
                         when("throughput")))
    cpu = res.get("cpu", {}).get("result")
    if cpu:
        for mode in ("batch", "tui"):
            if mode in cpu:
                d = cpu[mode]
                rows.append((f"3. offtop's own CPU, {'batch' if mode == 'batch' else 'TUI'}",
                             f"{_dist(d, 1, 2)} % of one core at "
                             f"{cpu['switches_per_s']['median'] / 1e3:.0f}k switches/s",
                             "< 3 %", yes(d["median"] < 3.0), when("cpu")))
        if "tui" not in cpu:
            rows.append(("3. offtop's own CPU, TUI", "not measured yet (offtop/app.py not there)",
                         "< 3 %", DASH, when("cpu")))
    st = res.get("startup", {}).get("result")
    if st:
        d = st["first_snapshot_s"]
        ph = st["phases_s"]
        parts = ", ".join(f"{short} {ph[k]['median'] * 1e3:.0f}" for k, _, short in PHASES if k in ph)
        cached = " (compiled program cached)" if "cold" in st else ""
        rows.append((f"4. start-up to first snapshot{cached}",
                     f"{_dist(d, 1, 2)} s (ms: {parts}; first interval {st.get('first_interval_s')} s)",
                     f"{LE} 1.5 s", yes(d["median"] <= 1.5), when("startup")))
        if "peak_rss_mb" in st:
            pk = st["peak_rss_mb"]
            rows.append((f"4. start-up peak RSS{cached} (offtop and any child it runs)",
                         f"{_dist(pk, 1, 0)} MB",
                         f"{LE} 150 MB", yes(pk["max"] <= 150), when("startup")))
        if "cold" in st:
            cd, cp = st["cold"]["first_snapshot_s"], st["cold"]["peak_rss_mb"]
            rows.append(("4. start-up with an empty cache (a fresh machine: compiles)",
                         f"first snapshot {_dist(cd, 1, 2)} s, peak RSS {_dist(cp, 1, 0)} MB",
                         f"{LE} 1.5 s, {LE} 150 MB", yes(cd["median"] <= 1.5 and cp["max"] <= 150),
                         when("startup")))
    mem = res.get("memory", {}).get("result")
    if mem:
        flat = abs(mem["slope_mb_per_min"]) * mem["minutes"] <= max(5.0, 0.05 * mem["rss_end_mb"])
        rows.append(("5. memory (RSS)",
                     f"{mem['rss_end_mb']:.0f} MB after {mem['minutes']:g} min "
                     f"(peak {mem['rss_peak_mb']:.0f}); "
                     f"{mem['slope_mb_per_min']:+.2f} MB/min after warm-up",
                     f"{LE} 150 MB, flat", yes(mem["rss_peak_mb"] <= 150 and flat), when("memory")))
    ui = res.get("ui", {}).get("result")
    if ui and ui.get("rows"):
        # The bar is keypress and tick to repaint; work a key hands to a worker
        # thread (bench_ui's "worker" rows) keeps the event loop free: shown apart.
        felt = [r for r in ui["rows"] if "worker" not in r["measure"]] or ui["rows"]
        apart = [r for r in ui["rows"] if "worker" in r["measure"]]
        worst_med = max(felt, key=lambda r: r["wall_median_ms"])
        worst_max = max(felt, key=lambda r: r["wall_max_ms"])
        text = (f"slowest median {worst_med['wall_median_ms']:.0f} ms ({worst_med['measure']}); "
                f"slowest single run {worst_max['wall_max_ms']:.0f} ms ({worst_max['measure']})")
        if apart:
            text += "; off the event loop: " + ", ".join(
                f"{r['measure']} {r['wall_median_ms']:.0f} ms" for r in apart)
        rows.append(("6. UI: tick and keypress to repaint, 2,000 tasks / 20,000 stacks", text,
                     "< 100 ms, every one in the worst run", yes(worst_max["wall_max_ms"] < 100), when("ui")))
    busy = res.get("busy", {}).get("result")
    if busy:
        rows += busy_rows(busy, when("busy"))
    rec = res.get("recording", {}).get("result")
    if rec:
        rows += recording_rows(rec, when("recording"))
    return rows


def busy_rows(b: dict[str, Any], run: str) -> list[tuple[str, str, str, str, str]]:
    """The busy-server benchmark's rows (bench/busy_server.py writes `b`)."""
    rows: list[tuple[str, str, str, str, str]] = []
    tools = b.get("tools", {})
    load = b.get("load", {})
    machine_sw = b.get("machine_switches_per_s", {}).get("median", 0)
    at = (f"at {load['blocks_per_s']['median'] / 1e3:.0f}k blocks/s "
          f"({machine_sw / 1e3:.0f}k switches/s machine-wide)" if load else "")
    others = "; ".join(f"{label} {_dist(tools[n]['cpu_pct'], 1, 1)} %"
                       for n, label in (("top", "top -b -d 1"), ("htop", "htop -d 10"))
                       if "cpu_pct" in tools.get(n, {}))
    cpu_target = b["targets"]["cpu_pct"]
    rss_target = b["targets"]["rss_mb"]
    if load:
        spec, full = b.get("spec", {}), b.get("full_census")
        pairs = (f"; in one {full['interval_s']:.1f} s interval {full['load_pairs']:,} (thread, stack) "
                 f"pairs, {full['load_user_stacks']:,} distinct user stacks" if full else "")
        rows.append(("7. busy server: the load (bench/workloads/busy_server.c)",
                     f"{spec.get('procs')} processes {TIMES} {spec.get('threads')} threads, 8 paths: "
                     f"{_dist(load['blocks_per_s'], 1e3, 1)}k blocks/s, {machine_sw / 1e3:.0f}k switches/s "
                     f"machine-wide, {_dist(load['exits_per_s'], 1, 1)} processes exiting and as many "
                     f"starting per s{pairs}",
                     "the load of issue 14: ~30k blocks/s, ~60k switches/s, ~8,000 pairs, churn", DASH, run))
    for name, label in (("batch", "batch (--format json)"), ("tui", "TUI")):
        t = tools.get(name)
        if not t:
            continue
        if "cpu_pct" not in t:
            why = "; ".join(b.get("failed", {}).get(name, []))[:200].replace("|", "/")
            rows.append((f"7. busy server: offtop {label}", f"failed in all {t['failed']} windows: {why}",
                         f"{LE} {cpu_target:g} % of one core, {LE} {rss_target:g} MB",
                         yes_no(False), run))
            continue
        c = t["cpu_pct"]
        rows.append((f"7. busy server: offtop {label} CPU",
                     f"{_dist(c, 1, 1)} % of one core {at}" + (f" (vs {others})" if others else "")
                     + (f"; {t['failed']} more windows failed" if t.get("failed") else ""),
                     f"{LE} {cpu_target:g} % of one core", yes_no(c["median"] <= cpu_target), run))
        rows.append((f"7. busy server: offtop {label} RSS",
                     f"{_dist(t['rss_mb'], 1, 0)} MB, peak {_dist(t['peak_rss_mb'], 1, 0)} MB",
                     f"{LE} {rss_target:g} MB", yes_no(t["peak_rss_mb"]["max"] <= rss_target), run))
    soak = b.get("tui_soak")
    if soak:
        rows.append((f"7. busy server: offtop TUI RSS over {soak['seconds'] / 60:.0f} min",
                     f"{soak['rss_mb_end']:.0f} MB at the end, peak {soak['peak_rss_mb']:.0f} MB, "
                     f"{soak['growth_mb_per_min']:+.1f} MB/min over the last half "
                     f"(CPU {soak['cpu_pct']:.1f} % of one core)",
                     f"{LE} {rss_target:g} MB", yes_no(soak["peak_rss_mb"] <= rss_target), run))
        gcp = soak.get("gc_passes")
        if gcp:
            c, w = gcp["cpu_ms"], gcp["wall_ms"]
            rows.append(("7. busy server: the TUI's full GC pass in the field (one every 30 snapshots)",
                         f"CPU {_dist(c)} ms, wall {_dist(w)} ms, {gcp['count']} passes "
                         f"in {soak['seconds'] / 60:.0f} min (bench/gc_timed.py): the TUI stops meanwhile",
                         "< 100 ms (6.'s bar: every key and tick)", yes_no(w["max"] < 100), run))
    line = tools.get("batch", {}).get("json_line_bytes")
    if line:
        limit = b["targets"]["json_line_bytes"]
        every = _dist(tools["batch"].get("interval_s"), 1, 1)
        rows.append(("7. busy server: JSON batch line per interval",
                     f"{_dist(line, 1e3, 0)} kB (one line every {every} s)",
                     f"bounded by default (top N): {LE} {limit / 1e3:.0f} kB",
                     yes_no(line["max"] <= limit), run))
    return rows


def yes_no(ok: bool) -> str:
    return "**yes**" if ok else "**no**"


def render_table(res: dict[str, Any]) -> str:
    lines = [TABLE_START, "", f"Machine: {res.get('machine', '?')}", "",
             f"| figure | measured: median (min{DASH}max) | target | met | run |",
             "|---|---|---|---|---|"]
    for fig, measured, target, met, run in summary_rows(res):
        lines.append(f"| {fig} | {measured} | {target} | {met} | {run} |")
    for name in BENCHMARKS:
        entry = res.get(name)
        if entry and entry.get("text"):
            lines += ["", f"<details><summary>{name}: full output ({entry['date']})</summary>", "",
                      "```", entry["text"].rstrip(), "```", "", "</details>"]
    for label, prof in res.get("profile", {}).items():
        lines += ["", f"<details><summary>profile {label}: py-spy on offtop at the busy server "
                      f"({prof['date']}, {prof['commit']})</summary>", "",
                  "```", prof["text"].rstrip(), "```", "", "</details>"]
    lines += ["", TABLE_END]
    return "\n".join(lines)


def write_readme(res: dict[str, Any]) -> None:
    table = render_table(res)
    text = README.read_text() if README.exists() else f"# offtop benchmarks\n\n{TABLE_START}\n{TABLE_END}\n"
    if TABLE_START in text and TABLE_END in text:
        head, rest = text.split(TABLE_START, 1)
        _, tail = rest.split(TABLE_END, 1)
        text = head + table + tail
    else:
        text = text.rstrip() + "\n\n" + table + "\n"
    README.write_text(text)


# --- main ----------------------------------------------------------------------------


RUNNERS: dict[str, Callable[[Ctx], dict[str, Any]]] = {
    "switch": bench_switch,
    "throughput": bench_throughput,
    "cpu": bench_cpu,
    "startup": bench_startup,
    "memory": bench_memory,
    "ui": bench_ui,
    "busy": bench_busy,
    "recording": bench_recording,
}


class _Tee:
    """stdout, also kept in memory (each benchmark's printout goes to the README)."""

    def __init__(self, out: Any) -> None:
        self.out = out
        self.buf: list[str] = []

    def write(self, s: str) -> int:
        self.buf.append(s)
        return int(self.out.write(s))

    def flush(self) -> None:
        self.out.flush()

    def take(self) -> str:
        text = "".join(self.buf)
        self.buf.clear()
        return text


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench/run.py", description=__doc__.split("\n\n")[0] if __doc__ else "",
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("benchmarks", nargs="*", metavar="BENCHMARK",
                   help=f"which to run (default: all): {', '.join(BENCHMARKS)}")
    p.add_argument("--quick", action="store_true", help="fewer, shorter runs (figures marked quick)")
    p.add_argument("--runs", type=int, help="rounds per comparison (default 7, quick 3; busy: 3, quick 2)")
    p.add_argument("--long", type=float, metavar="MINUTES",
                   help="length of the memory run (default 4, quick 1; the on-demand soak is 30)")
    p.add_argument("--variant", action="append", default=[], metavar="NAME=ARGS",
                   help="switch: also run offtop through bench/probe_variant.py ARGS [-- OFFTOP-ARGS] "
                        "(e.g. 'k16=--set kstack_depth=16'); not written to the README")
    p.add_argument("--configs", help="switch: only these configurations (comma list), plus none")
    p.add_argument("--against", metavar="GIT-REF",
                   help="switch, startup: also run offtop (each configuration) from the code of "
                        "GIT-REF (A/B of a change, side by side); not written to the README")
    p.add_argument("--preempt", action="store_true",
                   help="switch: run pingpong as SCHED_OTHER (wakeups preempt: one block per round trip)")
    p.add_argument("--ref", metavar="GIT-REF",
                   help="startup, busy: run offtop from the code of GIT-REF (not the working tree)")
    p.add_argument("--no-readme", action="store_true", help="print only; keep results.json and README")
    args = p.parse_args(argv)
    if os.geteuid() != 0:
        say("bench/run.py needs root (it loads BPF programs): run `sudo make bench`")
        return 1
    chosen = args.benchmarks or list(BENCHMARKS)
    unknown = [b for b in chosen if b not in BENCHMARKS]
    if unknown:
        p.error(f"unknown benchmark {', '.join(unknown)}: choose from {', '.join(BENCHMARKS)}")
    runs = args.runs or (3 if args.quick else 7)
    variants = []
    for v in args.variant:
        name, _, spec = v.partition("=")
        variants.append((name, spec.split()))
    tools = build()
    ctx = Ctx(tools=tools, quick=args.quick, runs=runs, long_minutes=args.long, variants=variants,
              configs=args.configs.split(",") if args.configs else None, against=args.against,
              batch_sched=not args.preempt, busy_runs=args.runs or (2 if args.quick else 3), ref=args.ref)
    experimental = bool(variants or args.configs or args.against or args.preempt)
    res: dict[str, Any] = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    res["machine"] = machine()
    tee = _Tee(sys.stdout)
    sys.stdout = tee  # type: ignore[assignment]
    failed = []
    try:
        for name in chosen:
            try:
                result = RUNNERS[name](ctx)
            except BenchError as e:
                say(f"{name}: skipped: {e}")
                failed.append(name)
                continue
            text = tee.take()
            if not experimental and not args.no_readme:
                res[name] = {"date": dt.date.today().isoformat(), "quick": args.quick, "result": result,
                             "text": text}
                RESULTS.write_text(json.dumps(res, indent=1) + "\n")
                write_readme(res)
    finally:
        sys.stdout = tee.out
    if not experimental and not args.no_readme:
        say(f"figures written to {README.relative_to(ROOT)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
