"""Flood control: keep the long-block event rate within what offtop can take in.

At a low threshold on a busy machine every block is an event: hundreds of
thousands a second, more than a Python reader can decode while staying on
time. Rather than fall behind (late output, a deaf UI) or drop records in
the ring, offtop raises the threshold *in the kernel* while the flood
lasts: blocks below it are then summed there, exactly as every short block
is, so no off-CPU time is lost, only the one-by-one delivery of the
shortest blocks. When the rate falls, the threshold comes back down to the
user's. (The adaptive threshold discussed for perf's --off-cpu-thresh.)

Pure logic: the engine feeds it the events of each sub-tick and writes the
threshold it asks for.
"""

from __future__ import annotations

from collections.abc import Sequence


class FloodControl:
    """Decides the in-kernel threshold from the event rate (see module docstring)."""

    #: Aim this far below the budget when raising, so one step is enough.
    TARGET_SHARE = 0.5
    #: Lower again, a little at a time, while the rate is below this share of
    #: the budget: the events then stay between a quarter of the budget and
    #: the budget. Block lengths crowd together under a flood (a ping-pong's
    #: are all a few microseconds), so the rate jumps steeply around some
    #: threshold: only small steps down find the level between.
    CALM_SHARE = 1 / 4
    #: Each step down keeps this share of the raised threshold.
    STEP_DOWN = 0.93
    #: A raise is at least this factor (the flood may be growing).
    STEP_UP = 1.5

    def __init__(self, budget_per_s: int) -> None:
        self.budget_per_s = budget_per_s
        #: The threshold flood control imposes (0: none).
        self.floor_ns = 0
        #: How many times it raised the threshold (for the stats).
        self.raises = 0

    @property
    def active(self) -> bool:
        """True while the threshold is raised."""
        return self.floor_ns > 0

    def effective(self, user_ns: int) -> int:
        """The threshold the kernel should use."""
        return max(user_ns, self.floor_ns)

    def observe(self, events: int, durations: Sequence[int], seconds: float,
                user_ns: int) -> int | None:
        """One sub-tick: `events` long blocks arrived in `seconds`, `durations` a sample of them.

        Returns the threshold to write to the kernel, or None to leave it.
        """
        if not self.budget_per_s or seconds <= 0:
            return None
        rate = events / seconds
        current = self.effective(user_ns)
        if rate > self.budget_per_s:
            self.floor_ns = max(self._cut(durations, events, seconds),
                                int(current * self.STEP_UP), 1_000)
            self.raises += 1
            return self.effective(user_ns)
        if not self.active or rate >= self.budget_per_s * self.CALM_SHARE:
            return None
        self.floor_ns = int(self.floor_ns * self.STEP_DOWN)
        if self.floor_ns <= user_ns or self.floor_ns < 1_000:
            self.floor_ns = 0
        return self.effective(user_ns)

    def _cut(self, durations: Sequence[int], events: int, seconds: float) -> int:
        """The duration above which about TARGET_SHARE of the budget's events fall."""
        if not durations:
            return 0
        keep = self.budget_per_s * self.TARGET_SHARE * seconds / events  # fraction to keep
        step = max(1, len(durations) // 16_384)  # a sorted sample is enough
        ordered = sorted(durations[::step], reverse=True)
        i = min(len(ordered) - 1, int(keep * len(ordered)))
        return ordered[i] + 1

    def user_changed(self, user_ns: int) -> None:
        """The user moved the threshold: a floor at or below it means nothing."""
        if self.floor_ns <= user_ns:
            self.floor_ns = 0
