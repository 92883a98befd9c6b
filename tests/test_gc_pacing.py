"""Python's full GC passes, taken over by the loops (offtop.gc_pacing), and batch's use of them."""

from __future__ import annotations

import gc
import os
import threading
from collections.abc import Iterator

import pytest

from offtop.batch import batch_loop, make_format
from offtop.gc_pacing import GcPacing, Parcel
from offtop.model import Snapshot
from offtop.outputs import Outputs
from offtop.source import SourceInfo
from offtop.synthetic import synthetic_snapshots


@pytest.fixture(autouse=True)
def gc_as_it_was() -> Iterator[None]:
    before = gc.get_threshold()
    yield
    gc.set_threshold(*before)
    gc.unfreeze()


def test_full_passes_at_the_pace_given_and_python_s_own_stopped() -> None:
    now = [0.0]
    p = GcPacing(lambda: now[0], every=3, max_s=10.0)
    before = gc.get_threshold()
    assert [p.snapshot_done() for _ in range(7)] == [True, False, False, True, False, False, True]
    assert not p.active and not p.overdue()
    p.full_pass()  # the first: freezes what is alive, stops Python's own full passes
    assert p.active and gc.get_freeze_count() > 0
    assert gc.get_threshold() == (GcPacing.YOUNG_OBJECTS, GcPacing.YOUNG_PASSES, GcPacing.NO_FULL_GC)
    now[0] = 9.9
    assert not p.overdue()
    now[0] = 10.0
    assert p.overdue()
    p.full_pass()
    assert not p.overdue() and p.passes == 2
    p.restore()
    assert gc.get_threshold() == before and not p.active


def test_without_young_passes_only_the_paced_full_passes_run() -> None:
    before = gc.get_threshold()
    p = GcPacing(young=False)
    p.full_pass()
    assert gc.get_threshold()[0] == 0  # Python's own passes off, every generation
    young: list[int] = []

    def count(phase: str, info: dict[str, int]) -> None:
        if phase == "stop":
            young.append(info["generation"])

    gc.callbacks.append(count)
    try:
        held = [[i] for i in range(50_000)]  # would set off ~70 young passes
        del held
        p.full_pass()
    finally:
        gc.callbacks.remove(count)
    assert young == [2]  # the loop's full pass alone
    p.restore()
    assert gc.get_threshold() == before


class _Held:
    """A fake source (for this test): synthetic snapshots, and the GC thresholds
    in force each time one was asked for."""

    def __init__(self, snaps: list[Snapshot]) -> None:
        self._snaps = list(snaps)
        self.thresholds: list[tuple[int, int, int]] = []

    @property
    def info(self) -> SourceInfo:
        return SourceInfo(kind="replay")

    @property
    def threshold_ns(self) -> int:
        return 0

    def start(self) -> None:
        pass

    def next_snapshot(self, interval_s: float, stop: threading.Event) -> Snapshot | None:
        self.thresholds.append(gc.get_threshold())
        return self._snaps.pop(0) if self._snaps else None

    def set_threshold(self, ns: int) -> None:
        pass

    def close(self) -> None:
        pass


class _Sink:
    stalled = False

    def write(self, text: str) -> None:
        pass


def test_batch_runs_the_full_passes_itself_and_gives_them_back() -> None:
    before = gc.get_threshold()
    full: list[int] = []
    src = _Held(synthetic_snapshots(4, tasks=20, stacks=50, seed=3))

    def count(phase: str, info: dict[str, int]) -> None:
        if phase == "stop" and info["generation"] == 2:
            full.append(len(src.thresholds))

    gc.callbacks.append(count)
    try:
        status = batch_loop(src, make_format("json"), 0.0, None, threading.Event(), _Sink(),
                            outputs=Outputs(), say=lambda line: None)
    finally:
        gc.callbacks.remove(count)
    assert status == os.EX_OK
    # Python's own until the first snapshot is out; the loop's (one, which
    # froze what was alive) after it, and none of Python's own meanwhile.
    assert src.thresholds[0] == before
    assert all(t[2] == GcPacing.NO_FULL_GC for t in src.thresholds[1:]), src.thresholds
    # Nor any young or middle pass: batch mode draws nothing, its data is acyclic.
    assert all(t[0] == 0 for t in src.thresholds[1:]), src.thresholds
    assert [n for n in full if n >= 1] == [1], full
    assert gc.get_threshold() == before


class _Cycle:
    """A drawn line's shape (textual.strip.Strip caches itself once divided): a
    reference cycle that only the cyclic GC frees."""

    def __init__(self) -> None:
        self.me = [self]


def _full_pass_garbage(burst: int, alive_across: int) -> int:
    """Make `burst` cycles, allocate `alive_across` lists while they live (a
    redraw's work), drop them; return what the next full pass collects."""
    collected: list[int] = []

    def count(phase: str, info: dict[str, int]) -> None:
        if phase == "stop" and info["generation"] == 2:
            collected.append(info["collected"])

    lines = [_Cycle() for _ in range(burst)]
    work = [[i] for i in range(alive_across)]
    del lines, work
    for _ in range(20):  # the redraws and ticks until the full pass
        # Each past a young threshold, whichever is set: young and middle passes
        # run meanwhile, as they would between two full passes.
        work = [[i] for i in range(2 * alive_across)]
        del work
    gc.callbacks.append(count)
    try:
        gc.collect()
    finally:
        gc.callbacks.remove(count)
    return collected[0]


def test_a_redraw_s_cycles_die_young_once_the_passes_are_the_loop_s() -> None:
    p = GcPacing()
    # Python's own young thresholds, its full passes off (as the loops had
    # them before): a redraw's lines outlive a middle pass, are promoted and
    # wait, dead, for the full pass (most of its time).
    gen0, gen1, _ = gc.get_threshold()
    gc.set_threshold(gen0, gen1, GcPacing.NO_FULL_GC)
    gc.collect()
    assert _full_pass_garbage(5_000, 20_000) >= 4_000
    p.full_pass()
    try:
        assert _full_pass_garbage(5_000, 20_000) <= 500
    finally:
        p.restore()


def test_a_redraw_s_lines_are_not_caught_alive_by_a_young_pass() -> None:
    # A redraw: its lines (cycles) alive while it allocates its work, then
    # all dead. With Python's default first threshold (700) young passes ran
    # inside it and moved the lines to the middle generation; now none runs,
    # and the next young pass frees them where they are.
    p = GcPacing()
    p.full_pass()
    try:
        gc.collect(0)
        young_passes = gc.get_count()[1]
        lines = [_Cycle() for _ in range(2_000)]  # 4,000 objects tracked
        work = [[i] for i in range(10_000)]
        del lines, work
        assert gc.get_count()[1] == young_passes  # no young pass ran meanwhile
        assert gc.collect(0) >= 4_000  # the young pass frees every line
    finally:
        p.restore()


def test_a_parcel_hands_its_inputs_over_once() -> None:
    inputs = [1, 2, 3]
    parcel = Parcel(inputs)
    assert parcel.take() is inputs
    assert parcel.take() is None  # the worker holds nothing once it took them
