"""Python frames where Python threads block, end to end, on Debian's own python3 (issue 10).

Real BPF: `offtop --batch --format json` against tests/workloads/py_waits.py,
run by /usr/bin/python3 (built without frame pointers, its interpreter read
from memory, never stopped): each named function shows up in blocked-now and
in the stacks, a GIL waiter is marked, and a thread blocked since before
offtop started is there from the first snapshot.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import ROOT, offtop_json

PYTHON = Path("/usr/bin/python3")
WAITS = ("wait_in_sleep", "wait_in_queue_get", "wait_in_lock_acquire", "wait_in_socket_recv")

pytestmark = [pytest.mark.bpf, pytest.mark.usefixtures("bpf_available")]


@contextlib.contextmanager
def py_waits(mode: str) -> Iterator[dict[str, Any]]:
    if not PYTHON.exists():
        pytest.fail("Debian's /usr/bin/python3 is missing: run the README's test command")
    proc = subprocess.Popen([str(PYTHON), str(ROOT / "tests" / "workloads" / "py_waits.py"),
                             mode], stdout=subprocess.PIPE, text=True, start_new_session=True)
    assert proc.stdout is not None
    info = json.loads(proc.stdout.readline())
    try:
        yield info
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=5)


@pytest.fixture(scope="module")
def waits() -> Iterator[dict[str, Any]]:
    with py_waits("waits") as info:
        yield info


@pytest.fixture(scope="module")
def snaps(waits: dict[str, Any]) -> list[dict[str, Any]]:
    # Not a whole number of the workload's 50 ms cycles: at a 1 s interval every
    # snapshot fell at the same point of the cycle, and when that was within
    # the 5 ms after the wakeups (blocked-now's floor), no snapshot ever saw
    # the woken threads blocked.
    return offtop_json("-p", str(waits["pid"]), "--threshold", "1s", count=4, interval="0.73")


def py_names(frames: list[str]) -> list[str]:
    """`py:Queue.get (queue.py:171)` -> `Queue.get`."""
    return [f[3:].split(" (")[0] for f in frames if f.startswith("py:")]


def test_each_waiting_function_is_in_blocked_now_and_in_the_stacks(
        waits: dict[str, Any], snaps: list[dict[str, Any]]) -> None:
    tids = waits["tids"]
    for fn in WAITS:
        tid = tids[fn]
        blocked = [b for s in snaps for b in s["blocked_now"] if b["tid"] == tid]
        stacks = [st for s in snaps for st in s["stacks"] if st["tid"] == tid]
        seen = sorted({r["tid"] for s in snaps for r in (*s["blocked_now"], *s["stacks"])})
        assert any(fn in py_names(b["user"]) for b in blocked), (
            "blocked now", fn, tid, [b["user"] for b in blocked], seen)
        assert any(fn in py_names(st["user"]) for st in stacks), (
            "stacks", fn, tid, [st["user"] for st in stacks], seen)
    # The library functions they wait in, as Python frames too.
    q = [b for s in snaps for b in s["blocked_now"] if b["tid"] == tids["wait_in_queue_get"]]
    assert any("Queue.get" in py_names(b["user"]) for b in q)


def test_python_frames_sit_inside_the_native_stack(snaps: list[dict[str, Any]],
                                                   waits: dict[str, Any]) -> None:
    """Native frames below (the syscall wrapper), Python frames in the middle, C start code above."""
    tid = waits["tids"]["wait_in_sleep"]
    rows = [b["user"] for s in snaps for b in s["blocked_now"] if b["tid"] == tid]
    assert rows
    user = rows[-1]
    first_py = next(i for i, f in enumerate(user) if f.startswith("py:"))
    assert first_py > 0 and not user[0].startswith("py:"), user  # clock_nanosleep first
    assert "Thread.run" in py_names(user), user


def test_a_gil_waiter_is_marked_in_blocked_now_and_in_the_stacks() -> None:
    with py_waits("gil") as info:
        tid = info["tids"]["wait_for_gil"]
        snaps = offtop_json("-p", str(info["pid"]), "--threshold", "10s", count=4)
    blocked = [b["user"] for s in snaps for b in s["blocked_now"] if b["tid"] == tid]
    stacks = [st["user"] for s in snaps for st in s["stacks"] if st["tid"] == tid]
    for rows in (blocked, stacks):
        assert any("[waiting for the GIL]" in u and "wait_for_gil" in py_names(u)
                   for u in rows), rows


def test_a_thread_blocked_before_offtop_started_is_there_from_the_first_snapshot(
        snaps: list[dict[str, Any]], waits: dict[str, Any]) -> None:
    tid = waits["tids"]["blocked_since_start"]
    first = [b for b in snaps[0]["blocked_now"] if b["tid"] == tid]
    assert first and first[0]["before_start"], snaps[0]["blocked_now"]
    assert any("blocked_since_start" in py_names(b["user"])
               for s in snaps for b in s["blocked_now"] if b["tid"] == tid)
