"""offtop's start-up, phase by phase (run by `bench/run.py startup`).

Runs `offtop --batch --format json --count 1 ...` through offtop's own main()
with timers around its phases, and writes when each phase ended, in seconds
since launch, as one JSON object on stderr (with "load": how the program was
obtained, where offtop's loader reports it). The compile + load phase ends
when `Probe.load` returns (offtop's loader) or bcc's `BPF()` does (before). The launch time comes from
OFFTOP_BENCH_T0: the parent's time.monotonic() just before it started this
process (CLOCK_MONOTONIC is one clock for the whole machine).
"""

from __future__ import annotations

import os
import time

T0 = float(os.environ.get("OFFTOP_BENCH_T0", time.monotonic()))
MARKS: dict[str, float] = {"interpreter": time.monotonic() - T0}

import atexit  # noqa: E402
import importlib.util  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
from typing import Any  # noqa: E402

from offtop import cli  # noqa: E402
from offtop.bpf import engine, environment  # noqa: E402

MARKS["import"] = time.monotonic() - T0
INFO: dict[str, Any] = {}  # not phases: how the program was obtained


def _mark(name: str) -> None:
    MARKS.setdefault(name, time.monotonic() - T0)


def _wrap_prepare() -> None:
    prepare = environment.prepare

    def timed(*a: Any, **kw: Any) -> Any:
        out = prepare(*a, **kw)
        _mark("environment")
        if importlib.util.find_spec("offtop.bpf.loader") is not None:
            return out  # offtop's own loader: no bcc in this process (importing it would add LLVM)
        import bcc  # what engine.start() imports next, timed on its own

        _mark("bcc_import")
        stock_init = bcc.BPF.__init__

        def init(self: Any, *a: Any, **kw: Any) -> None:
            stock_init(self, *a, **kw)
            _mark("compile_load")

        bcc.BPF.__init__ = init
        return out

    environment.prepare = timed  # type: ignore[assignment]


def _wrap_probe() -> None:
    """offtop's own loader (a cached or freshly compiled program, loaded without bcc):
    `Probe.load` ends the compile + load + attach phase, and says how it got the program."""
    try:
        from offtop.bpf import probe
    except ImportError:
        return
    load = getattr(probe.Probe, "load", None)
    if load is None:
        return

    def timed(self: Any, *a: Any, **kw: Any) -> Any:
        out = load(self, *a, **kw)
        _mark("compile_load")
        report = getattr(self, "report", None)
        if report is not None:
            INFO["load"] = {k: getattr(report, k) for k in ("how", "cache_note", "compile_s", "load_s")
                            if hasattr(report, k)}
        return out

    probe.Probe.load = timed  # type: ignore[method-assign]


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
    sys.stderr.write(json.dumps({**MARKS, **INFO}) + "\n")
    sys.stderr.flush()


if __name__ == "__main__":
    _wrap_prepare()
    _wrap_probe()
    _wrap_source()
    atexit.register(_report)
    sys.exit(cli.main(sys.argv[1:]))
