"""Python stacks (issue 10): what one read costs, and offtop's CPU with 100 blocked threads.

Starts Debian's /usr/bin/python3 with N threads (default 100), each blocking
again and again inside a named function (time.sleep, queue.get, Lock.acquire,
socket.recv, in turn: 20 ms waits), then:

1. times `PythonStacks.read_process` on it, as offtop calls it: the first read
   of the process (finding the interpreter), then warm reads of all threads
   and of one thread (medians of 200);
2. runs `offtop --batch --format json -p PID` with and without
   `--no-python-stacks`, alternating, and takes offtop's CPU from
   /proc/PID/stat (utime + stime) over a window after warm-up.

Needs root (offtop, process_vm_readv). Prints a small report.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from offtop.pystacks import PythonStacks  # noqa: E402

WORKLOAD = textwrap.dedent("""
    import json, os, queue, socket, sys, threading, time
    n = int(sys.argv[1])
    tids = []
    def wait_in_sleep():
        while True: time.sleep(0.02)
    def wait_in_queue_get():
        q = queue.Queue()
        while True:
            try: q.get(timeout=0.02)
            except queue.Empty: pass
    def wait_in_lock_acquire():
        lock = threading.Lock(); lock.acquire()
        while True: lock.acquire(timeout=0.02)
    def wait_in_socket_recv():
        a, b = socket.socketpair(); a.settimeout(0.02)
        while True:
            try: a.recv(1)
            except OSError: pass
    kinds = [wait_in_sleep, wait_in_queue_get, wait_in_lock_acquire, wait_in_socket_recv]
    def run(f):
        tids.append(threading.get_native_id()); f()
    for i in range(n):
        threading.Thread(target=run, args=(kinds[i % 4],), daemon=True).start()
    while len(tids) < n: time.sleep(0.01)
    print(json.dumps({"pid": os.getpid(), "tids": tids}), flush=True)
    while True: time.sleep(1)
""")


def cpu_ticks(pid: int) -> int:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


def offtop_cpu(pid: int, extra: list[str], warm_s: float, window_s: float) -> float:
    """offtop's CPU (% of one core) over `window_s` after `warm_s`."""
    p = subprocess.Popen([sys.executable, "-m", "offtop.cli", "--batch", "--format", "json",
                          "-p", str(pid), "--threshold", "10ms", *extra],
                         cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        time.sleep(warm_s)
        if p.poll() is not None:
            raise SystemExit(f"offtop exited: {p.stderr.read().decode() if p.stderr else ''}")
        t0, c0 = time.monotonic(), cpu_ticks(p.pid)
        time.sleep(window_s)
        t1, c1 = time.monotonic(), cpu_ticks(p.pid)
        return 100.0 * (c1 - c0) / os.sysconf("SC_CLK_TCK") / (t1 - t0)
    finally:
        p.send_signal(signal.SIGINT)
        p.wait(timeout=10)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--window", type=float, default=20.0)
    args = ap.parse_args()
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(WORKLOAD)
    wl = subprocess.Popen(["/usr/bin/python3", f.name, str(args.threads)], stdout=subprocess.PIPE,
                          text=True, start_new_session=True)
    try:
        assert wl.stdout is not None
        info = json.loads(wl.stdout.readline())
        pid, tids = info["pid"], info["tids"]
        stacks = PythonStacks()
        t0 = time.perf_counter()
        first = stacks.read_process(pid, budget_s=5.0)
        cold_ms = (time.perf_counter() - t0) * 1e3
        if first.failure:
            raise SystemExit(f"could not read the Python stacks: {first.failure}")
        all_ms, one_ms, frames = [], [], []
        for _ in range(200):
            t0 = time.perf_counter()
            r = stacks.read_process(pid, budget_s=5.0)
            all_ms.append((time.perf_counter() - t0) * 1e3)
            frames.append(sum(1 for t in r.threads.values() if t.frames))
            t0 = time.perf_counter()
            stacks.read_process(pid, tids=[tids[0]], budget_s=5.0)
            one_ms.append((time.perf_counter() - t0) * 1e3)
        print(f"python: /usr/bin/python3 (CPython {first.version}), "
              f"{args.threads} threads blocking 20 ms at a time in 4 named waits")
        print(f"  first read of the process (interpreter found): {cold_ms:.1f} ms")
        print(f"  warm read, all {len(tids) + 1} threads: median {statistics.median(all_ms):.2f} ms "
              f"(p90 {sorted(all_ms)[179]:.2f}); threads with frames: median "
              f"{statistics.median(frames):.0f}")
        print(f"  warm read, one thread: median {statistics.median(one_ms):.3f} ms "
              f"(p90 {sorted(one_ms)[179]:.3f})")
        on, off = [], []
        for _ in range(args.rounds):
            on.append(offtop_cpu(pid, [], 8.0, args.window))
            off.append(offtop_cpu(pid, ["--no-python-stacks"], 8.0, args.window))
        ratio = [a / b for a, b in zip(on, off, strict=True) if b > 0]
        print(f"  offtop batch CPU, {args.rounds} rounds side by side, {args.window:.0f} s windows:")
        print(f"    with Python stacks     {statistics.median(on):.1f} % of one core "
              f"({min(on):.1f}-{max(on):.1f})")
        print(f"    --no-python-stacks     {statistics.median(off):.1f} % of one core "
              f"({min(off):.1f}-{max(off):.1f})")
        if ratio:
            print(f"    ratio, same round      {statistics.median(ratio):.2f}x")
    finally:
        os.killpg(wl.pid, signal.SIGKILL)
        wl.wait()
        os.unlink(f.name)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
