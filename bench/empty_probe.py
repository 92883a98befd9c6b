"""The floor of `bench/run.py switch`: an empty bcc program on sched_switch.

It loads through offtop's own environment checks (the same header tree, the
same tracepoint), prints "ready" once attached, and waits for SIGINT/SIGTERM.
"""

from __future__ import annotations

import signal
import sys
import threading

from offtop.bpf import environment

EMPTY = "TRACEPOINT_PROBE(sched, sched_switch) { return 0; }"


def main() -> int:
    """Attach, say so, wait for a signal, detach."""
    environment.prepare()
    from bcc import BPF

    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    b = BPF(text=EMPTY)
    print("ready", flush=True)
    while not stop.wait(0.5):
        pass
    b.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
