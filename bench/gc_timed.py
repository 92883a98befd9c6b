"""offtop with its full GC passes timed, for bench/busy_server.py's TUI soak.

    OFFTOP_BENCH_GC_LOG=FILE python bench/gc_timed.py [offtop's options]

Runs offtop's command line as `python -m offtop.cli` does, from the working
directory's `offtop` package (the code under test), with
`offtop.gc_pacing.GcPacing.full_pass` wrapped: each pass appends one JSON line
to FILE, {"wall_ms", "cpu_ms", "first"}. `cpu_ms` is the CPU time of the
thread that ran it (the TUI's event loop); `wall_ms` is how long the process
stopped, every thread waiting for the interpreter meanwhile. "first" marks
the pass that freezes what is alive at the first snapshot (it walks nothing
later passes walk). The wrapper adds two clock reads and a write per pass,
once every 30 snapshots.

`bench/bench_ui.py` times the pass on synthetic snapshots it freezes first:
this is the pass in the field, which walks the frames and rows the live TUI
holds.
"""

from __future__ import annotations

import json
import os
import sys
import time

sys.path.insert(0, os.getcwd())

from offtop import gc_pacing
from offtop.cli import main
from offtop.cli_io import end_process


def _timed(log_path: str) -> None:
    full_pass = gc_pacing.GcPacing.full_pass
    log = open(log_path, "a", buffering=1)  # noqa: SIM115 (open for the process's life)

    def timed(self: gc_pacing.GcPacing) -> None:
        first = not self.active
        wall, cpu = time.perf_counter(), time.thread_time()
        full_pass(self)
        cpu, wall = time.thread_time() - cpu, time.perf_counter() - wall
        log.write(json.dumps({"wall_ms": round(wall * 1e3, 2), "cpu_ms": round(cpu * 1e3, 2),
                              "first": first}) + "\n")

    gc_pacing.GcPacing.full_pass = timed  # type: ignore[method-assign]


if __name__ == "__main__":
    _timed(os.environ["OFFTOP_BENCH_GC_LOG"])
    sys.argv[0] = "offtop"
    end_process(main())
