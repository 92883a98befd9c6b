"""Flood control, the pure logic: the in-kernel threshold follows the event rate."""

from __future__ import annotations

import itertools

from offtop.bpf.flood import FloodControl

US = 1_000


def test_a_flood_raises_the_threshold_to_keep_about_half_the_budget() -> None:
    fc = FloodControl(budget_per_s=100_000)
    # 0.25 s with 50,000 events (200k/s), lengths 1..50 us evenly.
    durations = [(i % 50 + 1) * US for i in range(50_000)]
    new = fc.observe(50_000, durations, 0.25, user_ns=0)
    assert new is not None and fc.active
    kept = sum(1 for d in durations if d >= new)
    # About TARGET_SHARE (half) of the budget's events pass: 12,500 in 0.25 s.
    assert 8_000 <= kept <= 17_000, (new, kept)


def test_within_the_band_the_threshold_holds() -> None:
    fc = FloodControl(budget_per_s=100_000)
    fc.observe(50_000, [5 * US] * 1000, 0.25, user_ns=0)
    floor = fc.floor_ns
    for events in (7_000, 20_000, 24_000):  # 28k..96k/s: a quarter of the budget to the budget
        assert fc.observe(events, [], 0.25, user_ns=0) is None
    assert fc.floor_ns == floor


def test_below_a_quarter_it_steps_down_gently_and_back_to_the_users_threshold() -> None:
    fc = FloodControl(budget_per_s=100_000)
    fc.observe(50_000, [40 * US] * 1000, 0.25, user_ns=10 * US)
    seen = [fc.floor_ns]
    while fc.active:
        new = fc.observe(100, [], 0.25, user_ns=10 * US)
        assert new is not None
        assert new >= 10 * US  # never below what the user asked for
        seen.append(fc.floor_ns)
    steps = [b / a for a, b in itertools.pairwise(seen[:-1])]
    assert all(0.9 <= r < 1 for r in steps), steps  # small steps: a steep rate curve
    assert fc.effective(10 * US) == 10 * US


def test_a_user_threshold_above_the_floor_ends_it() -> None:
    fc = FloodControl(budget_per_s=100_000)
    fc.observe(50_000, [5 * US] * 1000, 0.25, user_ns=0)
    fc.user_changed(fc.floor_ns + 1)
    assert not fc.active


def test_no_budget_means_no_control() -> None:
    fc = FloodControl(budget_per_s=0)
    assert fc.observe(10**7, [1] * 100, 0.25, user_ns=0) is None
    assert not fc.active
