"""The TUI in a real terminal (tmux), against a known workload, driven by keys.

What a new user does: start offtop, see the blocked task ranked with
plausible times, drill into its callchain, move the threshold slider and
see long blocks arrive, quit to a usable shell.
"""

from __future__ import annotations

import re
import shutil
import sys
import time
from typing import Any

import pytest

from tests.conftest import ROOT, wait_until
from tests.test_faults import Tmux

pytestmark = [pytest.mark.bpf, pytest.mark.usefixtures("bpf_available")]


def _row_of(screen: str, tid: int) -> str | None:
    """The task table's row of `tid` (PID, TID, COMM columns), if on screen."""
    return next((line for line in screen.splitlines()
                 if re.match(rf"^│\s*\d+\s+{tid}\s+offtop_workload", line)), None)


def test_new_user_session_in_a_real_terminal(workloads: Any) -> None:
    if shutil.which("tmux") is None:
        pytest.fail("tmux is missing: `make test` installs it")
    w = workloads("sleep", "100")
    tmux = Tmux()
    tmux.run("set-option", "-t", "t", "window-size", "manual")
    tmux.run("resize-window", "-t", "t", "-x", "160", "-y", "45")  # a usual terminal
    try:
        # The test process's C environment carries COLUMNS=80/LINES=24 (set below
        # os.environ by something in pytest); a user's terminal does not.
        tmux.type(f"cd {ROOT} && env -u COLUMNS -u LINES {sys.executable} -m offtop.cli "
                  f"-p {w.pid}; echo offtop-exit=$?")
        # Ranked within a couple of seconds, with plausible times: the sleeper is
        # off the CPU ~100% of each interval, in blocks of ~100 ms.
        assert wait_until(lambda: _row_of(tmux.screen(), w.tid) is not None, timeout=15), \
            tmux.screen()
        # Blocks are counted when they end: an interval holds 9 to 11 of them.
        def pct() -> int:
            m = re.search(r"\b(\d+)%", _row_of(tmux.screen(), w.tid) or "")
            return int(m.group(1)) if m else -1

        assert wait_until(lambda: 88 <= pct() <= 112, timeout=10), tmux.screen()
        row = _row_of(tmux.screen(), w.tid) or ""
        assert re.search(r"\b(9\d|1[0-4]\d)ms\b", row), row  # MAX: one ~100 ms block

        # Drill down: Enter on the selected task opens its callchain tree.
        tmux.run("send-keys", "-t", "t", "Enter")
        assert wait_until(lambda: "Callchain of offtop_workload" in tmux.screen(), timeout=5), \
            tmux.screen()
        assert wait_until(lambda: all(f in tmux.screen() for f in (
            "sleep_thread", "offtop_wl_sleep", "do_nanosleep")), timeout=5), tmux.screen()
        tmux.run("send-keys", "-t", "t", "Escape")

        # The slider: the default 500 ms lets no 100 ms block through; three steps
        # down (below 100 ms) and the workload's blocks arrive as events.
        assert "≥ 500ms" in tmux.screen() or "500ms" in tmux.screen()
        for _ in range(3):
            tmux.run("send-keys", "-t", "t", "-")
            time.sleep(0.2)
        header = tmux.screen().splitlines()[1]
        m = re.search(r"threshold (\S+)", header)
        assert m and m.group(1) not in ("500ms",), header

        def long_blocks_of_workload() -> int:
            return sum(1 for line in tmux.screen().splitlines()
                       if re.search(r"\d\d:\d\d:\d\d\.\d+ S\s+(9\d|10\d)ms offtop_workload", line))

        assert wait_until(lambda: long_blocks_of_workload() >= 3, timeout=10), tmux.screen()

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
