"""The probe's cost sampled in a window per interval (offtop.bpf.probe_stats), with a fake
clock and fake run-time counters (named so): the windowing rules are Python's."""

from __future__ import annotations

from offtop.bpf.probe_stats import ProbeStats


class FakeCounters:
    """The kernel's run_time_ns / run_cnt of a program that runs at a steady rate."""

    def __init__(self, clock: list[float], ns_per_s: int, runs_per_s: int) -> None:
        self.clock, self.ns_per_s, self.runs_per_s = clock, ns_per_s, runs_per_s

    def __call__(self, prog_fd: int) -> tuple[int, int]:
        t = self.clock[0]
        return round(t * self.ns_per_s), round(t * self.runs_per_s)


def test_a_missed_window_gives_the_last_rate_not_zero() -> None:
    now = [0.0]
    stats = ProbeStats(3, window_s=0.1, clock=lambda: now[0],
                       read=FakeCounters(now, 2_000_000, 50_000), enable=lambda: -1)
    assert stats.interval_result(1.0) == (0, 0) and stats.missed == 1  # nothing known yet
    def interval(start: float, polls: tuple[float, ...]) -> tuple[int, int]:
        """One interval of 1 s from `start`, polled at `polls`: its result."""
        now[0] = start
        stats.start_interval(start, 1.0)
        for t in polls:
            now[0] = t
            stats.poll(t)
        now[0] = start + 1.0
        return stats.interval_result(1.0)

    # An interval polled through its middle: measured in the window, scaled.
    assert interval(1.0, (1.2, 1.45, 1.5, 1.56, 1.8)) == (2_000_000, 50_000)
    assert stats.missed == 1
    # One step of the loop took the whole second half: no poll in the window.
    assert interval(2.0, (2.1,)) == (2_000_000, 50_000)
    assert stats.missed == 2
    # The first poll past the middle came just before the end: a window of
    # 1 ms (counters that may not have moved) is not a measure either.
    assert interval(3.0, (3.999,)) == (2_000_000, 50_000)
    assert stats.missed == 3


def test_until_a_window_was_whole_it_opens_at_the_interval_start() -> None:
    """On a loaded machine the first intervals can pass without a poll in their
    middle (one step of start-up or of a flood took it all): measured anyway."""
    now = [0.0]
    stats = ProbeStats(3, window_s=0.1, clock=lambda: now[0],
                       read=FakeCounters(now, 2_000_000, 50_000), enable=lambda: -1)
    stats.start_interval(0.0, 1.0)
    now[0] = 1.0  # no poll: one step took the whole interval
    assert stats.interval_result(1.0) == (2_000_000, 50_000)
    assert stats.missed == 0
    # Then whole windows in the middle again, as before.
    now[0] = 1.0
    stats.start_interval(1.0, 1.0)
    for t in (1.2, 1.46, 1.57, 1.8):
        now[0] = t
        stats.poll(t)
    now[0] = 2.0
    assert stats.interval_result(1.0) == (2_000_000, 50_000)
    assert stats.missed == 0


def test_switches_the_kernel_ran_without_the_probe_are_a_drop_cause() -> None:
    """A tracepoint run while another BPF program or a BPF map call is under way on
    that CPU skips the probe (the kernel's recursion guard): such switches are
    unseen, and their count (the program's recursion_misses) is said as a drop."""
    import os

    from offtop.bpf.engine import _errors_by_cause
    from offtop.bpf.probe_stats import read_prog_misses

    counters = dict.fromkeys(("ustack_efault", "ustack_enomem", "ustack_eexist", "ustack_other",
                              "kstack_efault", "kstack_enomem", "kstack_eexist", "kstack_other",
                              "start_full", "agg_full", "output_fail"), 0)
    assert _errors_by_cause({**counters, "switch_unseen": 0}) == ({}, {})
    assert _errors_by_cause({**counters, "switch_unseen": 3})[1] == {"switches unseen": 3}
    assert read_prog_misses(-1) == 0
    r, w = os.pipe()  # an fd whose fdinfo has no such line
    try:
        assert read_prog_misses(r) == 0
    finally:
        os.close(r)
        os.close(w)
