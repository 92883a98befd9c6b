#!/usr/bin/env python3
"""How big an hour of `offtop --record` is: on the busy server, and on a quiet machine.

    .venv/bin/python bench/recording_size.py              90 s busy, 90 s idle
    .venv/bin/python bench/recording_size.py --seconds 30 --json out.json

offtop records with `--batch --format json --record FILE --count N --interval 1
> /dev/null` (a recording is complete: every task and stack of every interval,
`--limit` never applies), first while bench/workloads/busy_server.c runs (the
`busy` benchmark's load, 30,000 blocks/s; bench/busy_server.py), then with no
load (the machine as it is: idle-ish, whatever else runs). The file's size over
the intervals it holds, times 3,600, is the hour; the size of each interval
(its gzip member) is read back with `offtop.recording`, whose format puts each
interval in a member of its own. The first interval is left out of the rate
(it covers half a second, and starts from nothing). `bench/run.py recording`
runs this and writes the figures into bench/README.md.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
import zlib
from pathlib import Path
from typing import Any

from busy_server import Load, LoadSpec, build_load, foreign_loads, load_rates, wait_for_quiet
from run import OUT, PY, ROOT, BenchError, say


def record(path: Path, seconds: int) -> dict[str, Any]:
    """Record `seconds` intervals of 1 s; the file's figures."""
    path.unlink(missing_ok=True)
    err = OUT / f"{path.stem}.stderr"
    with err.open("wb") as stderr:  # stdout (the JSON lines) is not what is measured
        proc = subprocess.Popen([PY, "-m", "offtop.cli", "--batch", "--format", "json", "--interval",
                                 "1", "--count", str(seconds), "--record", str(path)],
                                stdout=subprocess.DEVNULL, stderr=stderr, cwd=ROOT)
        try:
            # A complete interval of the busy server is ~20 MB of JSON: on a small
            # machine offtop falls behind and its intervals stretch. Past the
            # deadline it is stopped, and what it wrote (whole members) counts.
            proc.wait(timeout=3 * seconds + 60)
        except subprocess.TimeoutExpired:
            say(f"  offtop still recording after {3 * seconds + 60} s: stopped (SIGINT)")
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    if not path.exists():
        raise BenchError(f"offtop --record failed ({proc.returncode}): {err.read_text()[-300:]}")
    data = path.read_bytes()
    # Read here, not with offtop.recording: a busy interval's line can exceed
    # what --replay accepts (MAX_LINE_BYTES), and that is one of the findings.
    members = intervals_of(data)
    if len(members) < 2:
        raise BenchError(f"{path}: {len(members)} whole intervals recorded")
    rest = members[1:]  # the first (half a second, from nothing) is left out of the rate
    covered = sum(m["interval_s"] for m in rest)

    def median(key: str) -> float:
        return statistics.median(m[key] for m in rest)

    return {
        "intervals": len(members),
        "bytes": len(data),
        "bytes_per_hour": sum(m["compressed"] for m in rest) / covered * 3600,
        # What an hour would be if every interval lasted the 1 s asked for.
        "bytes_per_hour_at_1s": median("compressed") * 3600,
        "interval_s": median("interval_s"),
        "bytes_per_interval": median("compressed"),
        "json_bytes_per_interval": median("inflated"),
        "json_bytes_max": max(m["inflated"] for m in members),
        "tasks": median("tasks"),
        "stacks": median("stacks"),
        "long_blocks": median("long_blocks"),
        "switches_per_s": median("switches_per_s"),
        # Blocks recorded (switch-outs in S, D, I of every task), whoever made them.
        "recorded_blocks_per_s": statistics.median(m["blocks"] / m["interval_s"] for m in rest),
    }


def intervals_of(data: bytes) -> list[dict[str, float]]:
    """The figures of each whole interval of a recording (gzip members after the header)."""
    out = []
    while data:
        d = zlib.decompressobj(16 + zlib.MAX_WBITS)
        raw = d.decompress(data)
        if not d.eof:
            break  # cut short: not a whole member
        size = len(data) - len(d.unused_data)
        data = d.unused_data
        obj = json.loads(raw)
        if "tasks" not in obj:
            continue  # the header
        out.append({"compressed": size, "inflated": len(raw), "interval_s": obj["interval_s"],
                    "tasks": len(obj["tasks"]), "stacks": len(obj["stacks"]),
                    "long_blocks": len(obj["long_blocks"]),
                    "switches_per_s": obj["stats"].get("switches_per_s", 0),
                    "blocks": sum(t["count"] for t in obj["tasks"])})
    return out


def run(seconds: int, running_load: bool = False) -> dict[str, Any]:
    say(f"recording: {seconds} s busy, then {seconds} s idle")
    others = foreign_loads(set())
    if running_load and others:
        # Someone else's busy server (the same program) is the load: a second
        # one would double it. Its own rates are not ours to read; the
        # recording's (blocks recorded per s) are reported instead.
        say(f"  the load: the busy server already running (pid {others[0][0]})")
        busy = record(OUT / "recording-busy.rec", seconds)
        busy["load_shared"] = True
    else:
        exe = build_load()
        wait_for_quiet(None, 120)
        load = Load(exe, LoadSpec(), None)
        try:
            time.sleep(5)  # the load settles (its pace, its churn)
            before = load.sample()
            busy = record(OUT / "recording-busy.rec", seconds)
            busy["load"] = load_rates(before, load.sample())
        finally:
            load.stop()
    time.sleep(3)
    wait_for_quiet(None, 600)
    idle = record(OUT / "recording-idle.rec", seconds)
    return {"seconds": seconds, "busy": busy, "idle": idle, "code": code_version()}


def code_version() -> str:
    """The offtop measured: the working tree's commit (dirty or not)."""
    sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                         cwd=ROOT).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--", "offtop"], capture_output=True,
                           text=True, cwd=ROOT).stdout.strip()
    return f"{sha}{'-dirty' if dirty else ''}" or "working tree"


def describe(res: dict[str, Any]) -> str:
    lines = []
    for what in ("busy", "idle"):
        r = res[what]
        load = r.get("load")
        shape = (f"the load at {load['blocks_per_s']:,.0f} blocks/s, {load['switch_outs_per_s']:,.0f} "
                 f"switch-outs/s, {load['starts_per_s']:.1f} processes started/s" if load
                 else "someone else's busy server as the load" if r.get("load_shared")
                 else "no load")
        lines.append(f"   {what}: {r['intervals']} intervals, {r['bytes'] / 1e6:.2f} MB -> "
                     f"{r['bytes_per_hour'] / 1e6:,.0f} MB/hour ({r['bytes_per_interval'] / 1e3:,.1f} kB "
                     f"per interval, {r['json_bytes_per_interval'] / 1e3:,.0f} kB of JSON, intervals of "
                     f"{r['interval_s']:.1f} s (median; at 1 s: "
                     f"{r['bytes_per_hour_at_1s'] / 1e9:.2f} GB/hour); "
                     f"median {r['tasks']:,.0f} tasks, {r['stacks']:,.0f} stacks, "
                     f"{r['long_blocks']:,.0f} long blocks, {r['recorded_blocks_per_s']:,.0f} "
                     f"blocks/s recorded, {r['switches_per_s']:,.0f} switches/s machine-wide; {shape})")
    return "\n".join(["", "8. Recording size (offtop --batch --record, 1 s intervals)", *lines])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else "")
    p.add_argument("--seconds", type=int, default=90, help="intervals recorded, each way (90)")
    p.add_argument("--json", type=Path, help="write the figures here")
    p.add_argument("--running-load", action="store_true",
                   help="if someone else's bench_busy runs, record it instead of starting another")
    args = p.parse_args()
    if os.geteuid() != 0:
        say("recording_size.py needs root (offtop loads BPF)")
        return 1
    res = run(args.seconds, args.running_load)
    print(describe(res))
    if args.json:
        args.json.write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
