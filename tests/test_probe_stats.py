"""The probe's own cost (offtop.bpf.probe_stats): from the counters the probe keeps,
given by hand (so named) in the unit tests, and read from the real probe end to end."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

from offtop.bpf.probe_stats import ProbeStats


def _counters(runs: int, timed_runs: int, timed_ns: int) -> dict[str, int]:
    """Hand-made `Probe.counters()`: the three the cost is read from."""
    return {"runs": runs, "timed_runs": timed_runs, "timed_ns": timed_ns}


def test_run_time_is_the_timed_runs_scaled_to_all_runs() -> None:
    stats = ProbeStats()
    assert stats.interval_result(_counters(0, 0, 0)) == (0, 0)
    # 16,000 runs, 1,000 of them timed at 300 ns each.
    assert stats.interval_result(_counters(16_000, 1_000, 300_000)) == (4_800_000, 16_000)
    # The next interval: only what changed since.
    assert stats.interval_result(_counters(48_000, 3_000, 1_100_000)) == (12_800_000, 32_000)


def test_an_interval_with_no_timed_run_takes_the_last_rate() -> None:
    """A few runs per CPU (less than one timed): their time at the last rate known,
    never a false 0."""
    stats = ProbeStats()
    stats.interval_result(_counters(1_600, 100, 40_000))  # 400 ns a run
    assert stats.interval_result(_counters(1_610, 100, 40_000)) == (4_000, 10)


@pytest.mark.bpf
def test_the_probe_times_itself_and_never_turns_on_the_kernels_run_stats(
        bpf_available: None, workloads: Any) -> None:
    """The kernel's BPF run-time statistics are a switch for the whole machine (every
    BPF program of every tool pays for them while on): offtop never turns them on.
    Its own count and timing give the probe's cost."""
    from offtop.bpf.engine import BpfSource, EngineConfig

    if Path("/proc/sys/kernel/bpf_stats_enabled").read_text().strip() != "0":
        pytest.skip("kernel.bpf_stats_enabled is on here: run counts move for every program")
    workloads("pingrate", "20000")
    src = BpfSource(EngineConfig())
    src.start()
    try:
        stop = threading.Event()
        snaps = [src.next_snapshot(0.5, stop) for _ in range(3)]
        fdinfo = Path(f"/proc/self/fdinfo/{src.probe.prog_fd}").read_text()
    finally:
        src.close()
    for snap in snaps[1:]:
        assert snap is not None
        st = snap.stats
        # Every switch of the machine, the workload's ~20,000 a second among them.
        assert st.switches_per_s > 10_000, st
        assert 50 < st.probe_ns_per_switch < 100_000, st
    fields = dict(line.split(":", 1) for line in fdinfo.splitlines() if ":" in line)
    assert int(fields.get("run_cnt", "0")) == 0, fdinfo  # the kernel never counted a run


def test_blocks_whose_end_went_unseen_are_a_drop_cause() -> None:
    """A block whose end (its switch-in) the kernel ran without the probe is lost,
    and said so."""
    from offtop.bpf.decode import COUNTERS
    from offtop.bpf.engine import _errors_by_cause

    counters = dict.fromkeys(COUNTERS, 0)
    assert _errors_by_cause(counters) == ({}, {})
    assert _errors_by_cause({**counters, "end_unseen": 3})[1] == {"block ends unseen": 3}
