"""A Python process whose threads block inside named functions, for offtop.pystacks tests.

Each thread records its native thread id, then blocks forever in one kind of
wait. When every thread has reported, one JSON line goes to stdout:
{"pid": ..., "threads": {function name: tid, ...}}. The line of each blocking
call is marked with a `# block: NAME` comment, which the tests read back to
check the line numbers the reader reports.

`--gil` adds a pair that makes a GIL wait last as long as the test wants:
`holding_gil` calls libc's sleep() through ctypes.PyDLL, which keeps the GIL
while it sleeps (PyDLL is the calling convention for functions that need
it), so `waiting_for_gil`, woken from a short sleep, waits in take_gil for
as long as the holder sleeps, in one futex wait (the switch interval is
set long). Both are off-CPU: no core is burned, and the wait does not
depend on the scheduler.

`--sleepers N` adds N threads in time.sleep inside `extra_sleeper`, to
measure the cost of a read of many threads. Used only by tests; it runs
until it is killed.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import queue
import socket
import sys
import threading
import time

_ids: dict[str, int] = {}
_ids_lock = threading.Lock()
_all_ready = threading.Event()
_expected = 0


def _ready(name: str) -> None:
    with _ids_lock:
        _ids[name] = threading.get_native_id()
        if len(_ids) == _expected:
            _all_ready.set()


def blocked_in_sleep() -> None:
    _ready("blocked_in_sleep")
    time.sleep(100000)  # block: blocked_in_sleep


def blocked_in_queue_get(q: queue.Queue[int]) -> None:
    _ready("blocked_in_queue_get")
    q.get()  # block: blocked_in_queue_get


def blocked_in_lock_acquire(lock: threading.Lock) -> None:
    _ready("blocked_in_lock_acquire")
    lock.acquire()  # block: blocked_in_lock_acquire


def blocked_in_socket_recv(sock: socket.socket) -> None:
    _ready("blocked_in_socket_recv")
    sock.recv(1)  # block: blocked_in_socket_recv


def nested_outer(depth: int) -> None:
    """Python-to-Python calls several deep, so one C eval call runs several frames."""
    if depth == 0:
        _ready("nested_outer")
        time.sleep(100000)  # block: nested_outer
    else:
        nested_outer(depth - 1)


def holding_gil(go: threading.Event, hold_s: int) -> None:
    libc = ctypes.PyDLL(None)
    _ready("holding_gil")
    go.wait()
    while True:
        libc.sleep(hold_s)  # block: holding_gil


def waiting_for_gil() -> None:
    _ready("waiting_for_gil")
    while True:
        time.sleep(0.005)  # block: waiting_for_gil


def extra_sleeper(i: int) -> None:
    _ready(f"extra_sleeper_{i}")
    time.sleep(100000)  # block: extra_sleeper


def main() -> None:
    global _expected
    ap = argparse.ArgumentParser()
    ap.add_argument("--gil", action="store_true", help="add a GIL holder and a GIL waiter")
    ap.add_argument("--hold-s", type=int, default=3600, help="how long the holder keeps the GIL")
    ap.add_argument("--sleepers", type=int, default=0, help="extra threads in time.sleep")
    ap.add_argument("--only-sleepers", action="store_true", help="no named blockers, just sleepers")
    args = ap.parse_args()

    q: queue.Queue[int] = queue.Queue()
    lock = threading.Lock()
    lock.acquire()
    keep, b = socket.socketpair()  # the other end stays open, so recv blocks
    go = threading.Event()
    targets: list[tuple[object, tuple[object, ...]]] = []
    if not args.only_sleepers:
        targets += [(blocked_in_sleep, ()), (blocked_in_queue_get, (q,)),
                    (blocked_in_lock_acquire, (lock,)), (blocked_in_socket_recv, (b,)),
                    (nested_outer, (3,))]
    if args.gil:
        targets += [(holding_gil, (go, args.hold_s)), (waiting_for_gil, ())]
        # take_gil waits on the GIL's condition variable for one switch
        # interval at a time, then asks the holder to drop it and waits again:
        # with a long interval the waiter stays asleep on that futex.
        sys.setswitchinterval(1000.0)
    targets += [(extra_sleeper, (i,)) for i in range(args.sleepers)]
    _expected = len(targets)
    for fn, fargs in targets:
        threading.Thread(target=fn, args=fargs, daemon=True, name=getattr(fn, "__name__", "")).start()
    if not _all_ready.wait(60):
        sys.exit("threads did not start")
    print(json.dumps({"pid": threading.get_native_id(), "threads": _ids}), flush=True)
    go.set()
    _all_ready.clear()
    _all_ready.wait()  # the main thread blocks too, in Event.wait
    keep.close()


if __name__ == "__main__":
    main()
