"""Python threads that wait, again and again, inside named functions (offtop's e2e tests).

Run with Debian's /usr/bin/python3.

`py_waits.py waits`: each `wait_in_*` thread blocks for about 50 ms at a time
in one kind of wait, woken by the main thread; `blocked_since_start` sleeps
for good from before offtop starts.

`py_waits.py gil`: `wait_for_gil` waits for the GIL, which `hold_gil` keeps
while it sleeps in libc's usleep() called through ctypes.PyDLL (PyDLL calls
keep the GIL), 30 s at a time; the waiter's wait ends each time its timed
wait for the GIL times out (the switch interval, 1 s here) and starts again.
A process of its own: while the GIL is held, no other thread of it runs.

Prints one JSON line, {"pid": P, "tids": {function: tid}}, then runs until
killed.
"""

from __future__ import annotations

import ctypes
import json
import os
import queue
import socket
import sys
import threading
import time

tids: dict[str, int] = {}


def _ready(name: str) -> None:
    tids[name] = threading.get_native_id()


def wait_in_sleep() -> None:
    _ready("wait_in_sleep")
    while True:
        time.sleep(0.05)


def wait_in_queue_get(q: queue.Queue[int]) -> None:
    _ready("wait_in_queue_get")
    while True:
        q.get()


def wait_in_lock_acquire(lock: threading.Lock) -> None:
    _ready("wait_in_lock_acquire")
    while True:
        lock.acquire()


def wait_in_socket_recv(s: socket.socket) -> None:
    _ready("wait_in_socket_recv")
    while True:
        s.recv(16)


def wait_for_gil() -> None:
    _ready("wait_for_gil")
    while True:
        time.sleep(0.01)  # then needs the GIL back, while hold_gil keeps it


def hold_gil() -> None:
    _ready("hold_gil")
    time.sleep(0.2)  # the main thread prints the tids first
    libc = ctypes.PyDLL(None)
    while True:
        libc.sleep(30)  # with the GIL held
        time.sleep(0.001)


def blocked_since_start() -> None:
    _ready("blocked_since_start")
    time.sleep(1_000_000)


def main() -> None:
    mode = sys.argv[1] if len(sys.argv) > 1 else "waits"
    threads: list[tuple[object, tuple[object, ...]]]
    if mode == "gil":
        sys.setswitchinterval(1.0)
        threads = [(wait_for_gil, ()), (hold_gil, ())]
    else:
        q: queue.Queue[int] = queue.Queue()
        lock = threading.Lock()
        lock.acquire()
        a, b = socket.socketpair()
        threads = [(wait_in_sleep, ()), (wait_in_queue_get, (q,)),
                   (wait_in_lock_acquire, (lock,)), (wait_in_socket_recv, (a,)),
                   (blocked_since_start, ())]
    for fn, args in threads:
        threading.Thread(target=fn, args=args, daemon=True).start()  # type: ignore[arg-type]
    while len(tids) < len(threads):
        time.sleep(0.01)
    print(json.dumps({"pid": os.getpid(), "tids": tids}), flush=True)
    while True:  # the wakers: one of each wait every 50 ms
        time.sleep(0.05)
        if mode != "gil":
            q.put(1)
            lock.release()
            b.send(b"x")


if __name__ == "__main__":
    main()
