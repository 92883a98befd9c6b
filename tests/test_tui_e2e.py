"""The TUI in a real terminal (tmux), against a known workload, driven by keys.

What a new user does: start offtop, see the blocked task ranked with
plausible times and blocked right now for no longer than it really sleeps,
drill into its callchain, move the threshold and see long blocks arrive,
quit to a usable shell. The workload's thread sleeps 93 ms at a time in
`offtop_wl_sleep`; its main thread waits in pthread_join from before offtop
starts.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from offtop.recording import load_recording
from tests.conftest import ROOT, wait_until
from tests.test_faults import Tmux

pytestmark = [pytest.mark.bpf, pytest.mark.usefixtures("bpf_available")]

_UNITS_MS = {"ns": 1e-6, "us": 1e-3, "ms": 1.0, "s": 1e3}


def _ms(text: str) -> float:
    """`63.6ms`, `1.01s`, `~2.00s` as milliseconds."""
    m = re.fullmatch(r"~?([\d.]+)(ns|us|ms|s)", text)
    assert m, text
    return float(m.group(1)) * _UNITS_MS[m.group(2)]


def _row_of(screen: str, tid: int) -> str | None:
    """The task table's row of `tid` (PID, TID, COMM columns), if on screen."""
    return next((line for line in screen.splitlines()
                 if re.match(rf"^│\s*\d+\s+{tid}\s+offtop_workload", line)), None)


def _blocked_wait(screen: str, pid: int, tid: int) -> str | None:
    """The blocked-now wait of a thread (`63.6ms`, `~5.01s`), if listed."""
    task = f"{pid}" if tid == pid else f"{pid}/{tid}"
    m = re.search(rf"│\s*(~?[\d.]+(?:ns|us|ms|s))\s+[SD]\s+offtop_workload {task}\s", screen)
    return m.group(1) if m else None


def _header(screen: str) -> str:
    return screen.splitlines()[1]


def test_new_user_session_in_a_real_terminal(workloads: Any) -> None:
    if shutil.which("tmux") is None:
        pytest.fail("tmux is missing: `make test` installs it")
    # 93 ms, not 100: a whole number of sleeps a second put every snapshot at the
    # same point of the sleeper's cycle, and when that was just after a wakeup
    # (under blocked-now's 5 ms floor), the sleeper was never listed.
    w = workloads("sleep", "93")
    tmux = Tmux()
    tmux.run("set-option", "-t", "t", "window-size", "manual")
    tmux.run("resize-window", "-t", "t", "-x", "160", "-y", "45")  # a usual terminal
    try:
        # The test process's C environment carries COLUMNS=80/LINES=24 (set below
        # os.environ by something in pytest); a user's terminal does not.
        tmux.type(f"cd {ROOT} && env -u COLUMNS -u LINES {sys.executable} -m offtop.cli "
                  f"-p {w.pid}; echo offtop-exit=$?")
        # Ranked within a couple of seconds, with plausible times: the sleeper is
        # off the CPU ~100% of each interval, in blocks of ~93 ms.
        assert wait_until(lambda: _row_of(tmux.screen(), w.tid) is not None, timeout=15), \
            tmux.screen()

        def pct() -> int:
            m = re.search(r"\b(\d+)%", _row_of(tmux.screen(), w.tid) or "")
            return int(m.group(1)) if m else -1

        assert wait_until(lambda: 88 <= pct() <= 112, timeout=10), tmux.screen()
        row = _row_of(tmux.screen(), w.tid) or ""
        assert re.search(r"\b(9\d(\.\d)?|1[0-4]\d)ms\b", row), row  # MAX: one ~93 ms block

        # Blocked now: the sleeper's wait is read at every redraw, so it never
        # shows more than one sleep (a guess from the last snapshot grew to
        # 400, 600, 900 ms); its main thread, in pthread_join since before
        # offtop started, shows an estimated (~) and growing wait.
        waits = []
        for _ in range(12):
            screen = tmux.screen()
            wait = _blocked_wait(screen, w.pid, w.tid)
            if wait is not None:
                waits.append(_ms(wait))
            time.sleep(0.25)
        assert len(waits) >= 6, tmux.screen()
        assert max(waits) <= 250, waits
        main = _blocked_wait(tmux.screen(), w.pid, w.pid)
        assert main is not None and main.startswith("~"), tmux.screen()

        # Drill down: Enter on the selected task opens its callchain tree.
        tmux.run("send-keys", "-t", "t", "Enter")
        assert wait_until(lambda: "Callchain of offtop_workload" in tmux.screen(), timeout=5), \
            tmux.screen()
        assert wait_until(lambda: all(f in tmux.screen() for f in (
            "sleep_thread", "offtop_wl_sleep", "do_nanosleep")), timeout=5), tmux.screen()
        tmux.run("send-keys", "-t", "t", "Escape")
        # (A key right after Esc would be read with it, as Alt+key.)
        assert wait_until(lambda: "Stacks of offtop_workload" in tmux.screen(), timeout=5), \
            tmux.screen()

        # The threshold: 500 ms by default, said in the header, the threshold
        # box and the log's title; no 93 ms block gets through.
        screen = tmux.screen()
        assert re.search(r"\bthreshold 500ms\b", _header(screen)), screen
        assert re.search(r"│ ≥ 500ms\s", screen) and "Long blocks ≥ 500ms" in screen, screen
        # (A line naming its waker drops the clock's milliseconds when narrow.)
        assert not re.search(r"\d\d:\d\d:\d\d(\.\d+)? S\s+\d+(\.\d+)?ms offtop_workload", screen)
        # Three steps down: 200, 100, 50 ms; the workload's blocks now arrive one by one.
        for _ in range(3):
            tmux.run("send-keys", "-t", "t", "-")
            time.sleep(0.2)
        assert wait_until(lambda: re.search(r"\bthreshold 50\.0ms\b", _header(tmux.screen()))
                          is not None, timeout=5), tmux.screen()
        assert wait_until(lambda: "Long blocks ≥ 50.0ms" in tmux.screen()
                          and re.search(r"│ ≥ 50\.0ms\s", tmux.screen()) is not None,
                          timeout=5), tmux.screen()

        def long_blocks_of_workload() -> int:
            return sum(1 for line in tmux.screen().splitlines()
                       if re.search(r"\d\d:\d\d:\d\d(\.\d+)? S\s+(9\d|10\d)(\.\d+)?ms "
                                    rf"offtop_workload {w.pid}/", line))  # the tid is cut

        assert wait_until(lambda: long_blocks_of_workload() >= 3, timeout=10), tmux.screen()
        assert wait_until(lambda: re.search(r"\b([3-9]|\d\d+) seen\b", tmux.screen())
                          is not None, timeout=5), tmux.screen()

        # Quit: the shell is back, usable, offtop exited 0.
        tmux.run("send-keys", "-t", "t", "q")
        assert wait_until(lambda: re.search(r"offtop-exit=\d", tmux.screen()) is not None,
                          timeout=5), tmux.screen()
        assert "offtop-exit=0" in tmux.screen(), tmux.screen()
        tmux.type("echo ok-$((40+2))")
        assert wait_until(lambda: "ok-42" in tmux.screen(), timeout=5), tmux.screen()
        assert "Traceback" not in tmux.screen()
    finally:
        tmux.close()


def _replay_in_tmux(path: Path) -> Tmux:
    """`offtop --replay path` typed in a 160x45 terminal, then `offtop-exit=STATUS`."""
    tmux = Tmux()
    try:
        tmux.run("set-option", "-t", "t", "window-size", "manual")
        tmux.run("resize-window", "-t", "t", "-x", "160", "-y", "45")
        tmux.type(f"cd {ROOT} && env -u COLUMNS -u LINES {sys.executable} -m offtop.cli "
                  f"--replay {path}; echo offtop-exit=$?")
    except BaseException:
        tmux.close()
        raise
    return tmux


def test_a_big_recording_says_it_is_being_read_before_the_screen_comes(tmp_path: Path) -> None:
    """Every interval of a recording is checked before the replay shows (a busy
    server's 40 s took 17 s): the terminal says so meanwhile, once, on stderr;
    batch mode, read by scripts, says nothing."""
    from offtop.cli import READING_NOTICE_BYTES
    from offtop.report import snapshot_json_line
    from offtop.synthetic import synthetic_snapshots

    path = tmp_path / "big.json"  # --format json output replays too
    with path.open("w") as f:
        while f.tell() < READING_NOTICE_BYTES:
            for snap in synthetic_snapshots(2, tasks=500, stacks=5000, seed=7):
                f.write(snapshot_json_line(snap))
    mb = f"{path.stat().st_size / (1 << 20):.0f} MB"
    batch = subprocess.run([sys.executable, "-m", "offtop.cli", "--replay", str(path), "--batch",
                            "--count", "1"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                           text=True, cwd=ROOT, timeout=120)
    assert batch.returncode == 0 and batch.stderr == "", batch.stderr
    tmux = _replay_in_tmux(path)
    try:
        assert wait_until(lambda: "source replay" in tmux.screen(), timeout=60), tmux.screen()
        tmux.run("send-keys", "-t", "t", "q")
        assert wait_until(lambda: re.search(r"offtop-exit=\d", tmux.screen()) is not None,
                          timeout=10), tmux.screen()
        screen = tmux.screen()  # the terminal as the TUI left it
        assert "offtop-exit=0" in screen, screen
        assert screen.count(f"offtop: reading {path} ({mb}): every interval is checked first") \
            == 1, screen
    finally:
        tmux.close()


def test_a_real_recording_replays_with_its_header_and_steps_back(workloads: Any,
                                                                  tmp_path: Path) -> None:
    """`offtop --batch --record` on a workload with real BPF, then `offtop --replay`
    in a terminal: the recorded host and scope in the header, the replay bar,
    a step back shows the interval before (its number in the header and the bar)."""
    if shutil.which("tmux") is None:
        pytest.fail("tmux is missing: `make test` installs it")
    w = workloads("sleep", "100")
    path = tmp_path / "real.rec"
    r = subprocess.run([sys.executable, "-m", "offtop.cli", "--batch", "--format", "json",
                        "--interval", "0.5", "--count", "4", "-p", str(w.pid), "--record",
                        str(path)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                       cwd=ROOT, timeout=120)
    assert r.returncode == 0, r.stderr
    header = load_recording(path).header
    assert header is not None and header.scope == f"pid {w.pid}"
    # Replaying needs no root and no BPF: the workload's pid is in no argument.
    tmux = _replay_in_tmux(path)
    try:

        def at(seq: int) -> bool:
            first = tmux.screen().splitlines()[0]
            return re.search(rf" #{seq} ", first) is not None

        # A replay holds at its end: the fourth interval, half a second each.
        assert wait_until(lambda: at(4), timeout=30), tmux.screen()
        screen = tmux.screen()
        first = screen.splitlines()[0]
        assert f"host {header.host}" in first and f"scope pid {w.pid}" in first, first
        assert f"kernel {header.kernel}" in first and "source replay" in first, first
        assert re.search(r"■ at end\s+1x\s+\d\d:\d\d:\d\d\s+4/4\s", screen), screen
        assert "offtop_workload" in screen, screen  # the recorded tasks
        tmux.run("send-keys", "-t", "t", ",")
        assert wait_until(lambda: at(3), timeout=10), tmux.screen()
        assert re.search(r"❚❚ paused\s+1x\s+\d\d:\d\d:\d\d\s+3/4\s", tmux.screen()), \
            tmux.screen()
        tmux.run("send-keys", "-t", "t", "g")
        assert wait_until(lambda: at(1), timeout=10), tmux.screen()
        tmux.run("send-keys", "-t", "t", "q")
        assert wait_until(lambda: "offtop-exit=0" in tmux.screen(), timeout=10), tmux.screen()
        assert "Traceback" not in tmux.screen()
    finally:
        tmux.close()
