#!/usr/bin/env python3
"""Soak: offtop's engine for a long time under switches and process churn.

    .venv/bin/python bench/soak.py                    30 minutes (root)
    .venv/bin/python bench/soak.py --minutes 5        a shorter run
    .venv/bin/python bench/soak.py --churn 2000 --switches 80000 --sample-s 5

The engine (`BpfSource`, as offtop's batch mode and TUI drive it) runs in this
process, so besides RSS the sampler can read what could grow without bound:
the since-start totals (`Aggregator.tracked_threads`), the per-process
symbol caches (`UserSymbols.cached_processes`), the frame cache
(`BpfSource.stacks`), the stack ids in use and the kernel's start
map. Load: `offtop_workload pingrate` (~N context switches/s) and
`offtop_workload churn` (~N short-lived processes/s, each blocking 1 ms).

After a warm-up (a third of the run, at least a minute), each series must
be flat: no more than 10% (and a small absolute slack) above its warm-up
level; RSS must be, and stay under 150 MB; caches must stay under the
engine's own caps (some fill towards them by design). The verdict and every sample go to
bench/out/soak-<time>.json; the last figures belong in bench/README.md.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from run import slope  # noqa: E402  (bench/, this script's directory)

from offtop.bpf.engine import BpfSource, EngineConfig  # noqa: E402
from offtop.units import parse_duration_ns  # noqa: E402

OUT = ROOT / "bench" / "out"
RSS_LIMIT_MB = 150.0
#: Per series: the absolute slack allowed above the warm-up level, besides 10%.
SLACK = {"rss_mb": 5.0, "tracked_threads": 500, "symbol_caches": 16, "frame_cache": 200,
         "stack_ids": 200, "start_map": 500}


def build_workload() -> Path:
    """tests/workloads/offtop_workload.c, compiled into bench/out when it changed."""
    src = ROOT / "tests" / "workloads" / "offtop_workload.c"
    out = OUT / "soak_wl"
    OUT.mkdir(parents=True, exist_ok=True)
    if not out.exists() or out.stat().st_mtime < src.stat().st_mtime:
        cc = shutil.which("gcc") or shutil.which("cc")
        if cc is None:
            sys.exit("soak: no C compiler (make test installs gcc)")
        subprocess.run([cc, "-O1", "-g", "-fno-omit-frame-pointer", "-pthread", "-o", str(out),
                        str(src)], check=True)
    return out


def start(binary: Path, *args: str) -> subprocess.Popen[str]:
    p = subprocess.Popen([str(binary), *args], stdout=subprocess.PIPE, text=True,
                         start_new_session=True)
    assert p.stdout is not None
    line = p.stdout.readline()
    if not re.search(r"ready pid=\d+", line):
        p.kill()
        sys.exit(f"soak: workload {args} did not start: {line!r}")
    return p


def stop(p: subprocess.Popen[str]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(p.pid, signal.SIGKILL)
    p.wait(timeout=10)


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def kernel_handles() -> dict[int, str]:
    """stdin/out/err and this process's BPF maps, programs, perf events, epoll: fd -> what."""
    out = {}
    for name in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/self/fd/{name}")
            if target.startswith("anon_inode:") or int(name) <= 2:
                out[int(name)] = target
    return out


def _say_fd() -> int:
    """A private copy of stdout far from the low fd numbers (see handles_lost)."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 4096 <= hard or hard == resource.RLIM_INFINITY:
        resource.setrlimit(resource.RLIMIT_NOFILE, (4096, hard))
    import fcntl

    return fcntl.fcntl(1, fcntl.F_DUPFD_CLOEXEC, 2048)


_OUT = -1


def say(text: str) -> None:
    """Print, through a high fd: the soak's report survives its stdout being closed."""
    os.write(_OUT if _OUT >= 0 else 1, (text + "\n").encode())


def handles_lost(start: dict[int, str]) -> list[str]:
    """Kernel handles open after start that are closed or replaced now.

    bcc 0.26's ProcSyms::ModulePath can close an uninitialized fd number when
    a symbol cache is freed (fixed upstream in bcc 0.33, iovisor/bcc#5193):
    under process churn that can be one of the engine's maps or its epoll.
    """
    now = kernel_handles()
    return [f"{fd}:{what}" for fd, what in start.items() if now.get(fd) != what]


def sample(src: BpfSource, snap: Any, t: float, late_s: float) -> dict[str, Any]:
    """One row: memory, caches, kernel maps, capture health."""
    st = snap.stats
    usyms = src.user_symbols
    assert src.frames.stacks is not None
    return {
        "t": round(t, 1),
        "rss_mb": round(rss_mb(), 2),
        "tracked_threads": src.aggregator.tracked_threads,
        "symbol_caches": usyms.cached_processes if usyms else 0,
        "frame_cache": src.frames.stacks.cached,
        "stack_ids": st.stacks_used,
        "start_map": sum(1 for f in src.probe.thread_fields() if f[-1] < 0),
        "tasks": len(snap.tasks),
        "switches_per_s": round(st.switches_per_s),
        "events": st.events,
        "lost_total": st.lost_total,
        "stack_errors": st.stack_errors_total,
        "drops": dict(st.drops),
        "stacks_reclaimed": st.stacks_reclaimed,
        "symbol_misses": st.symbol_misses,
        "probe_cpu_pct": round(st.probe_cpu_pct, 1),
        "max_late_s": round(late_s, 3),
        "handles_lost": [],
    }


def verdict(rows: list[dict[str, Any]], key: str, warm_s: float, cap: float) -> dict[str, Any]:
    """After the warm-up: is `key` flat (within 10% + slack of its warm-up level) and under its cap?

    Caches with a cap may keep filling towards it on a long run (stack ids are
    only reclaimed once half the map is used); that is bounded, not a leak.
    RSS has no such excuse: it must be flat and under RSS_LIMIT_MB.
    """
    before = [r[key] for r in rows if r["t"] < warm_s]
    after = [r[key] for r in rows if r["t"] >= warm_s]
    if not before or not after:
        return {"key": key, "flat": None, "bounded": None, "ok": True,
                "why": "run too short for a warm-up"}
    level = max(before)
    limit = level * 1.10 + SLACK[key]
    peak = max(after)
    pts = [(r["t"], r[key]) for r in rows if r["t"] >= warm_s]
    is_flat = peak <= limit
    bounded = max(r[key] for r in rows) <= cap
    ok = is_flat and bounded if key == "rss_mb" else bounded
    return {"key": key, "flat": is_flat, "bounded": bounded, "ok": ok, "cap": cap,
            "warm_level": level, "peak_after": peak, "limit": round(limit, 1),
            "end": after[-1], "slope_per_min": round(slope(pts) * 60, 3)}


def caps(src: BpfSource) -> dict[str, float]:
    """What each series may reach by design (the engine's own limits)."""
    cfg = src.config
    pid_max = int(Path("/proc/sys/kernel/pid_max").read_text())
    return {
        "rss_mb": RSS_LIMIT_MB,
        "tracked_threads": min(src.aggregator.max_threads * 1.0 + 20_000, pid_max),
        "symbol_caches": (src.user_symbols.max_processes if src.user_symbols else 4096) + 64,
        "frame_cache": 200_000,
        "stack_ids": 2 * cfg.stack_entries,
        "start_map": cfg.start_entries,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--minutes", type=float, default=30.0)
    ap.add_argument("--switches", type=int, default=50_000, help="context switches/s to cause")
    ap.add_argument("--churn", type=int, default=500, help="short-lived processes/s")
    ap.add_argument("--interval", type=float, default=1.0, help="snapshot interval, s")
    ap.add_argument("--threshold", default="1ms",
                    help="event threshold (1ms: every churn child's sleep is an event)")
    ap.add_argument("--sample-s", type=float, default=10.0)
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("soak: needs root (BPF)")
    warm_s = max(60.0, a.minutes * 60 / 3)
    out = a.out or OUT / f"soak-{dt.datetime.now():%Y%m%d-%H%M%S}.json"
    binary = build_workload()

    global _OUT
    _OUT = _say_fd()
    stopping = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, lambda *_: stopping.set())

    loads = [start(binary, "pingrate", str(a.switches)), start(binary, "churn", str(a.churn))]
    src = BpfSource(EngineConfig(threshold_ns=parse_duration_ns(a.threshold)))
    rows: list[dict[str, Any]] = []
    errors: list[str] = []
    snapshots = 0
    t_start = time.monotonic()
    try:
        src.start()
        handles = kernel_handles()
        rss_after_start = rss_mb()
        say(f"soak: {a.minutes:g} min, ~{a.switches} switches/s, {a.churn} processes/s, "
              f"interval {a.interval:g}s, threshold {a.threshold}; warm-up {warm_s:.0f}s; "
              f"RSS after start {rss_after_start:.1f} MB")
        t0 = time.monotonic()
        next_sample = t0 + a.sample_s
        late = 0.0
        end = t0 + a.minutes * 60
        while time.monotonic() < end and not stopping.is_set():
            t_call = time.monotonic()
            try:
                snap = src.next_snapshot(a.interval, stopping)
            except Exception:  # counted and kept going: the soak is about survival
                errors.append(traceback.format_exc())
                say(f"soak: exception #{len(errors)}:\n{errors[-1]}")
                if len(errors) > 20:
                    break
                continue
            if snap is None:
                break
            snapshots += 1
            # How much later than the interval the snapshot came (0 = on time).
            late = max(late, time.monotonic() - t_call - a.interval)
            now = time.monotonic()
            if now >= next_sample:
                row = sample(src, snap, now - t0, late)
                row["handles_lost"] = handles_lost(handles)
                rows.append(row)
                late = 0.0
                next_sample += a.sample_s
                say("  t={t:>6.0f}s rss {rss_mb:6.1f}MB  threads {tracked_threads:>6}  "
                      "symcaches {symbol_caches:>4}  frames {frame_cache:>6}  stacks "
                      "{stack_ids:>5}  start {start_map:>5}  sw/s {switches_per_s:>6}  "
                      "lost {lost_total}  late {max_late_s:.2f}s".format(**row)
                      + (f"  HANDLES LOST {row['handles_lost']}" if row["handles_lost"] else ""))
    finally:
        src.close()
        for p in loads:
            stop(p)

    limits = caps(src)
    verdicts = [verdict(rows, k, warm_s, limits[k]) for k in SLACK]
    lost_handles = rows[-1]["handles_lost"] if rows else []
    ok = all(v["ok"] for v in verdicts) and not errors and not lost_handles
    ran_s = time.monotonic() - t_start
    result = {
        "when": dt.datetime.now().isoformat(timespec="seconds"),
        "host": os.uname().nodename, "kernel": os.uname().release, "cpus": os.cpu_count(),
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items()},
        "ran_s": round(ran_s, 1), "snapshots": snapshots, "warm_s": warm_s,
        "exceptions": errors, "handles_lost": lost_handles, "verdicts": verdicts, "ok": ok,
        "samples": rows,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")

    say(f"\nsoak: {ran_s / 60:.1f} min, {snapshots} snapshots, {len(errors)} exceptions; "
          f"warm-up {warm_s:.0f}s")
    for v in verdicts:
        if v["flat"] is None:
            say(f"  {v['key']:16} {v['why']}")
            continue
        shape = "flat" if v["flat"] else "grows"
        bound = f"under its cap {v['cap']:g}" if v["bounded"] else f"OVER its cap {v['cap']:g}"
        say(f"  {v['key']:16} {shape}, {bound}: warm-up {v['warm_level']}, peak after "
              f"{v['peak_after']} (flat limit {v['limit']}), end {v['end']}, "
              f"slope {v['slope_per_min']:+}/min")
    if lost_handles:
        say(f"  kernel handles closed under offtop: {lost_handles}")
    if rows:
        say(f"  worst lateness of a snapshot: {max(r['max_late_s'] for r in rows):.2f}s; "
              f"lost events {rows[-1]['lost_total']}; stack ids reclaimed "
              f"{rows[-1]['stacks_reclaimed']}")
    say(f"soak: {'OK: RSS flat, caches bounded' if ok else 'FAILED'}; result in {out}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
