#!/usr/bin/env python3
"""What offtop costs a process that forks: fork + _exit + waitpid, side by side.

    .venv/bin/python bench/fork_cost.py [--against REF] [--rounds 5] [--forks 3000]
                                        [--what fork|exec|mmap|data|anon]

bench/workloads/forker.c forks and reaps N children on CPU 1, with nothing
traced, with offtop (`--batch --format json`, on CPU 0) and, with --against,
with offtop as of git REF, in turn, round after round. offtop's probes on
sched_process_fork and sched_process_exec note who forked whom (README, How
it works); the switch probe runs at every block of the parent's waitpid and
at each child's short life. Reported: the median ns per fork of each, and
each offtop's ratio to nothing traced. `--what exec`: each child execs
/usr/bin/true; `--what mmap`: an executable mmap + munmap of a file, no fork
(the kernel's mapping records offtop reads, offtop.bpf.sent_maps); `data`: the
same, readable only; `anon`: anonymous memory, as malloc maps it. Not part
of `make bench` (no target).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import time

from run import BENCH, OUT, PY, ROOT, TRACER_CPU, WORKLOAD_CPU, Background, checkout, compile_c, say


def forks(binary: str, n: int, what: str = "fork") -> float:
    out = subprocess.run(["taskset", "-c", WORKLOAD_CPU, binary, str(n), what], capture_output=True,
                         text=True, check=True).stdout
    return float(out.split()[1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--against", help="also offtop as of this git ref")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--forks", type=int, default=3000)
    ap.add_argument("--what", choices=("fork", "exec", "mmap", "data", "anon"), default="fork")
    args = ap.parse_args()
    binary = str(compile_c(BENCH / "workloads" / "forker.c", OUT / "bench_forker"))
    trees = {"offtop": ROOT}
    if args.against:
        trees[f"offtop@{args.against}"] = checkout(args.against)
    times: dict[str, list[float]] = {"nothing": [], **{name: [] for name in trees}}
    for r in range(args.rounds):
        for name in times:
            if name == "nothing":
                times[name].append(forks(binary, args.forks, args.what))
                continue
            tracer = Background(["taskset", "-c", TRACER_CPU, PY, "-m", "offtop.cli", "--batch",
                                 "--format", "json", "--limit", "1"], f"fork_cost_{r}",
                                cwd=trees[name], env={"PYTHONPATH": str(trees[name])})
            try:
                tracer.wait_for(lambda line: line.startswith("{"), timeout=60)
                time.sleep(0.5)
                times[name].append(forks(binary, args.forks, args.what))
            finally:
                tracer.proc.terminate()
                tracer.proc.wait(timeout=30)
        say(f"round {r + 1}: " + ", ".join(f"{k} {v[-1]:.0f} ns" for k, v in times.items()))
    base = statistics.median(times["nothing"])
    for name, v in times.items():
        med = statistics.median(v)
        print(f"{name:24} {med:8.0f} ns a {args.what} (range {min(v):.0f}-{max(v):.0f}), "
              f"{med / base:.2f}x nothing")


if __name__ == "__main__":
    main()
