"""offtop's start-up, phase by phase (run by `bench/run.py startup`).

Runs `offtop --batch --format json --count 1 ...` through offtop's own main()
with timers around its phases, and writes when each phase ended, in seconds
since launch, as one JSON object on stderr. The launch time comes from
OFFTOP_BENCH_T0: the parent's time.monotonic() just before it started this
process (CLOCK_MONOTONIC is one clock for the whole machine).
"""

from __future__ import annotations

import os
import time

T0 = float(os.environ.get("OFFTOP_BENCH_T0", time.monotonic()))
MARKS: dict[str, float] = {"interpreter": time.monotonic() - T0}

import atexit  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
from typing import Any  # noqa: E402

from offtop import cli  # noqa: E402
from offtop.bpf import engine, environment  # noqa: E402

MARKS["import"] = time.monotonic() - T0


def _mark(name: str) -> None:
    MARKS.setdefault(name, time.monotonic() - T0)


def _wrap_prepare() -> None:
    prepare = environment.prepare

    def timed(*a: Any, **kw: Any) -> Any:
        out = prepare(*a, **kw)
        _mark("environment")
        import bcc  # what engine.start() imports next, timed on its own

        _mark("bcc_import")
        stock_init = bcc.BPF.__init__

        def init(self: Any, *a: Any, **kw: Any) -> None:
            stock_init(self, *a, **kw)
            _mark("compile_load")

        bcc.BPF.__init__ = init
        return out

    environment.prepare = timed  # type: ignore[assignment]


def _wrap_source() -> None:
    start = engine.BpfSource.start
    next_snapshot = engine.BpfSource.next_snapshot

    def timed_start(self: Any) -> None:
        start(self)
        _mark("start")

    def timed_next(self: Any, *a: Any, **kw: Any) -> Any:
        snap = next_snapshot(self, *a, **kw)
        _mark("first_snapshot")
        return snap

    engine.BpfSource.start = timed_start  # type: ignore[method-assign]
    engine.BpfSource.next_snapshot = timed_next  # type: ignore[method-assign]


def _report() -> None:
    sys.stderr.write(json.dumps(MARKS) + "\n")
    sys.stderr.flush()


if __name__ == "__main__":
    _wrap_prepare()
    _wrap_source()
    atexit.register(_report)
    sys.exit(cli.main(sys.argv[1:]))
