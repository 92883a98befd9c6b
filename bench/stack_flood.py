"""offtop when new stacks come faster than it resolves them: interval lengths and memory.

    .venv/bin/python bench/stack_flood.py                          this code, 2 runs
    .venv/bin/python bench/stack_flood.py --against 7bc2d0b        alternated with a ref

Starts tests/workloads/many_stacks.c (`many_stacks 20000 4`: 4 threads cycling
through 20,000 distinct user stacks, each ending in a 1 µs sleep; on 2 CPUs it
saturates the machine), then `offtop --batch --format json -p PID --threshold 1s
--count N` on it, and reads each JSON line: how long each interval covered, when
offtop stopped being behind (`behind_rows` 0; a ref without the field counts as
never behind), its CPU and RSS as it reports them, and its wall time for the N
snapshots. With `--against`, runs alternate between the working tree and the ref
(unpacked under bench/out/, as `busy_server.py --against` does), each with its own
start of the workload. Not part of `make bench` and writes nothing.

Needs root (the probe).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from run import OUT, PY, ROOT, checkout, compile_c

SOURCE = ROOT / "tests" / "workloads" / "many_stacks.c"


def one_run(binary: Path, where: Path, count: int, stacks: int, threads: int) -> dict[str, float]:
    load = subprocess.Popen([str(binary), str(stacks), str(threads)], stdout=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        assert load.stdout is not None
        load.stdout.readline()  # ready
        env = {**os.environ, "PYTHONPATH": str(where)}
        t0 = time.monotonic()
        out = subprocess.run(
            [PY, "-m", "offtop.cli", "--batch", "--format", "json", "-p", str(load.pid),
             "--threshold", "1s", "--count", str(count)],
            capture_output=True, text=True, cwd=where, env=env, timeout=600)
        wall = time.monotonic() - t0
    finally:
        load.kill()
        load.wait()
    if out.returncode != 0:
        sys.exit(f"stack_flood: offtop failed ({out.returncode}): {out.stderr.strip()[-300:]}")
    snaps = [json.loads(line) for line in out.stdout.splitlines() if line.strip()]
    lengths = [s["interval_s"] for s in snaps[1:]]  # the first is short by design
    behind = [s["stats"].get("behind_rows", 0) for s in snaps]
    caught_up = next((i + 1 for i in range(len(snaps)) if i >= 1 and not any(behind[i:])), 0)
    return {
        "wall_s": wall,
        "longest_s": max(lengths),
        "median_s": statistics.median(lengths),
        "caught_up_at": caught_up,
        "rss_mb": max(s["stats"]["offtop_rss_bytes"] for s in snaps) / 2**20,
        "distinct_last": len(snaps[-1]["stacks"]),
        "behind_rows": sum(behind),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--against", help="a git ref to alternate with the working tree")
    ap.add_argument("--runs", type=int, default=2, help="runs of each (default 2)")
    ap.add_argument("--count", type=int, default=15, help="snapshots per run (default 15)")
    ap.add_argument("--stacks", type=int, default=20_000)
    ap.add_argument("--threads", type=int, default=4)
    a = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("stack_flood: needs root (the probe)")
    # As tests/test_truth_e2e.py builds it: each chain of calls a stack of its own.
    binary = compile_c(SOURCE, OUT / "many_stacks", flags=("-fno-optimize-sibling-calls",))
    codes = [("this code", ROOT)] + ([(a.against, checkout(a.against))] if a.against else [])
    print(f"many_stacks {a.stacks} {a.threads}; offtop --batch -p PID --threshold 1s "
          f"--count {a.count} (default --limit); intervals after the first")
    print(f"{'code':<12} {'run':>3} {'wall s':>7} {'longest s':>9} {'median s':>8} "
          f"{'caught up':>9} {'peak RSS MB':>11} {'behind rows':>11}")
    for r in range(a.runs):
        for name, where in codes:
            m = one_run(binary, where, a.count, a.stacks, a.threads)
            caught = f"#{m['caught_up_at']}" if m["caught_up_at"] else "never"
            print(f"{name:<12} {r + 1:>3} {m['wall_s']:>7.1f} {m['longest_s']:>9.2f} "
                  f"{m['median_s']:>8.2f} {caught:>9} {m['rss_mb']:>11.0f} "
                  f"{m['behind_rows']:>11,}", flush=True)


if __name__ == "__main__":
    main()
