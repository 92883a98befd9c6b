"""offtop's own cost per interval (offtop.bpf.budget.SelfCost): the CPU time is
taken over the window the caller names, not up to the call."""

from __future__ import annotations

from offtop.bpf.budget import SelfCost


def burn(seconds: float) -> None:
    end = SelfCost.cpu_s() + seconds
    while SelfCost.cpu_s() < end:
        pass


def test_the_cpu_of_a_window_ended_earlier_is_its_own() -> None:
    cost = SelfCost()
    burn(0.05)
    cut = SelfCost.cpu_s()  # the window ends here...
    burn(0.2)  # ...and this belongs to the next one
    pct, rss = cost.interval(1.0, cut)
    assert 4.0 <= pct < 15.0, pct  # 0.05 s (and a little) of 1 s, not 0.25 s
    assert rss > 0
    pct, _ = cost.interval(1.0, SelfCost.cpu_s())  # the next window: the 0.2 s is there
    assert pct >= 19.0, pct
