"""How long the TUI takes to give the shell back after q (or another key) on the busy server.

    .venv/bin/python bench/exit_time.py                          q, 4 tries
    .venv/bin/python bench/exit_time.py --against 75f7ff0 --tries 3 --keys q,C-c

Starts bench_busy at bench/busy_server.py's full load (20 processes x 50
threads, 30,000 blocks/s, 3 processes/s churn), then, try after try, runs
`python -m offtop.cli` in a tmux session (bench/run.py's `TuiSession`), lets it run `--run` seconds,
types the key and times how long the offtop process takes to end (polled
every 10 ms). With `--against`, each try runs the working tree and the
code of that git ref one after the other, the first of each pair taking
turns, so that the load's and the machine's drift falls on both alike.
The brief's bar: a signal or a quit key ends offtop within a second.

Not part of `make bench` (a minute a try); writes nothing. Needs root and tmux.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from busy_server import OUT, Code, LoadSpec, TuiSession, build_load


def ended(pid: int) -> bool:
    """The process is gone (or a zombie: it has ended, its parent has not reaped it yet)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return True


def one_try(code: Code, key: str, run_s: float) -> float | None:
    """Seconds from the key to offtop's end; None if it never started or did not end."""
    tui = TuiSession([], cwd=code.cwd, env=dict(code.env), cpus=None)  # as a user runs it
    try:
        time.sleep(run_s)
        if ended(tui.pid):
            return None
        t0 = time.monotonic()
        subprocess.run(["tmux", "send-keys", "-t", tui.name, key], check=True)
        while not ended(tui.pid):
            if time.monotonic() - t0 > 20:
                return None
            time.sleep(0.01)
        return time.monotonic() - t0
    finally:
        tui.stop()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--tries", type=int, default=4, help="tries per key (and per side)")
    p.add_argument("--keys", default="q", help="comma list of tmux key names (q, C-c, F10)")
    p.add_argument("--run", type=float, default=20.0, help="seconds offtop runs before the key")
    p.add_argument("--against", metavar="GIT-REF", help="also time the code of this ref, alternated")
    args = p.parse_args()
    if os.geteuid() != 0 or shutil.which("tmux") is None:
        print("exit_time: needs root (the probe) and tmux", file=sys.stderr)
        return 2
    sides = [Code.of(None)] + ([Code.of(args.against)] if args.against else [])
    spec = LoadSpec()
    load = subprocess.Popen([str(build_load()), *spec.argv(), "--io-dir", str(OUT)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    took: dict[tuple[str, str], list[float]] = {}
    try:
        time.sleep(5)
        print(f"busy server: {spec.describe()}; offtop runs {args.run:g} s before the key")
        for i in range(args.tries):
            for key in args.keys.split(","):
                order = sides if i % 2 == 0 else sides[::-1]
                for code in order:
                    t = one_try(code, key, args.run)
                    shown = "did not start or end" if t is None else f"{t:.2f} s"
                    print(f"  try {i + 1}, {key:4s} {code.version}: {shown}", flush=True)
                    if t is not None:
                        took.setdefault((key, code.version), []).append(t)
    finally:
        load.terminate()
        load.wait()
    for (key, version), ts in took.items():
        print(f"{key:4s} {version}: median {statistics.median(ts):.2f} s, "
              f"{min(ts):.2f}-{max(ts):.2f} s over {len(ts)}, under 1 s: "
              f"{sum(t < 1.0 for t in ts)} of {len(ts)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
