"""UI responsiveness benchmark: 2,000 tasks and 20,000 stacks per snapshot.

Replays synthetic snapshots into `OfftopApp` under `App.run_test()` and
measures, in one run:

* tick cost: from handing a new snapshot to the app until the screen is
  repainted, in the task view and with the callchain tree open. `publish`
  runs in a thread, as the app's source thread runs it (indexing the
  snapshot, and since the redesign summing it since the start): the tick
  includes what that thread holds the interpreter for, not more (where the
  code measured sums the stacks since the start in a worker once the
  snapshot is on screen, that worker is waited for before the next measure,
  as every worker is, and its cost is the "since-start add" row);
* keypress → repaint latency for down (from the top row, so that every
  press really moves the cursor), s, t, enter/esc, +/-; and, where the app
  has them, the stacks pane's views and modes: a (all stacks), f (flame
  graph), m (merge), i (idle waits), c (since start), with a tick while the
  flame graph of all tasks is open.

"Repainted" means all queued messages processed and the compositor has
rendered the dirty regions (`pilot.pause(0)` forces the update the refresh
timer would do). Work a key starts in a worker thread (a flame graph's tree,
the since-start ranking) is waited for before the next measure, so that it
does not slow that one; what it costs is measured apart (the rows marked
"worker"). Prints median and max over the runs; not a test, exits 0.

`--against REF` measures the code of another git commit (or an offtop tree
in a directory) side by side: each side runs in its own process, taking
turns `--rounds` times (4 by default; each round starts with the other side),
and both tables are printed with their ratios. One round is noise: the same
code on both sides came out 0.65-1.37x in two.

    .venv/bin/python bench/bench_ui.py [--runs 9] [--tasks 2000] [--stacks 20000]
    .venv/bin/python bench/bench_ui.py --against HEAD~1 [--rounds 6 --runs 2]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from textual import events

if TYPE_CHECKING:
    from offtop.app import OfftopApp
    from offtop.model import Snapshot

ROOT = Path(__file__).resolve().parent.parent
BAR_MS = 100.0

#: Per measure, the milliseconds of each run.
Results = dict[str, list[float]]


def held_replay(snaps: list[Snapshot]) -> Any:
    """A replay source that waits like a live one once its snapshots are played."""
    from offtop.source import ReplaySource, SourceInfo

    class HeldReplay(ReplaySource):
        def next_snapshot(self, interval_s: float, stop: threading.Event) -> Snapshot | None:
            snap = super().next_snapshot(interval_s, stop)
            if snap is None:
                stop.wait()
            return snap

    return HeldReplay(snaps, realtime=False,
                      info=SourceInfo(host="bench", kernel="-", kind="replay"))


def _quiet(app: OfftopApp) -> bool:
    nodes = [app, app.screen, *app.screen.walk_children(with_self=False)]
    return all(node.message_queue_size == 0 for node in nodes)


async def settle(pilot: Any) -> None:
    """Process what is queued and what that queues in turn, then repaint.

    `pilot.pause(0)` runs every message queued when it is called, then forces
    the screen update; messages posted meanwhile need another round.
    """
    for _ in range(20):
        await pilot.pause(0)
        if _quiet(pilot.app):
            await pilot.pause(0)
            return


#: Key name → the character a terminal sends for it.
CHARS = {"down": None, "enter": None, "escape": None, "plus": "+", "minus": "-"}


def send_key(app: OfftopApp, key: str) -> None:
    """Deliver a key as the terminal driver does, a message to the app
    (`Pilot.press` adds idle waits of 20 ms or more per key, which would
    swamp what is measured)."""
    event = events.Key(key, CHARS.get(key, key))
    event.set_sender(app)
    app.post_message(event)


def has_key(app: OfftopApp, key: str) -> bool:
    """The app binds `key` (the commit measured against may not)."""
    return any(getattr(b, "key", None) == key for b in app.BINDINGS)


def build_index(snap: Snapshot, catalog: object) -> object:
    """The per-snapshot index the worker thread builds, in whichever form
    the code measured has (the model's since the redesign, with the chain
    catalog the app keeps across snapshots; the app's before)."""
    try:
        from offtop.model import SnapshotIndex
    except ImportError:
        from offtop.model import SnapshotIndex
        return SnapshotIndex.build(snap)
    return SnapshotIndex(snap, catalog)


#: CPU time of each measurement, by the order it was taken (wall times are
#: what counts, but on a shared machine CPU time shows what is ours).
CPU_MS: list[float] = []


async def idle_workers(app: OfftopApp) -> None:
    """Wait for the app's workers to finish, but the source's (which never does)."""
    busy = [w for w in app.workers if w.group != "source" and not w.is_finished]
    if busy:
        await app.workers.wait_for_complete(busy)


async def measure(runs: int, action: Callable[[int], Awaitable[None]], pilot: Any) -> list[float]:
    out = []
    for i in range(runs):
        await settle(pilot)
        await idle_workers(pilot.app)
        await settle(pilot)
        t0, c0 = time.perf_counter(), time.process_time()
        await action(i)
        await settle(pilot)
        out.append((time.perf_counter() - t0) * 1000)
        CPU_MS.append((time.process_time() - c0) * 1000)
    return out


async def bench(runs: int, tasks: int, stacks: int) -> tuple[Results, Results]:
    """Every measure, `runs` times: (wall times, CPU times) in ms."""
    from offtop.app import OfftopApp
    from offtop.synthetic import synthetic_snapshots

    t0 = time.perf_counter()
    snaps = synthetic_snapshots(runs + 2, tasks=tasks, stacks=stacks, seed=1)
    gen_s = time.perf_counter() - t0
    # The bench holds all its input snapshots; the app holds one or two. Keep
    # the input out of the cyclic GC's way so that its full collections cost
    # what they would cost in the app, not ~5x more.
    gc.collect()
    gc.freeze()
    note(f"synthetic data: {runs + 2} snapshots of {len(snaps[0].tasks):,} tasks, "
         f"{len(snaps[0].stacks):,} stacks, {len(snaps[0].processes):,} processes "
         f"(generated in {gen_s:.1f}s)")
    source = held_replay(snaps[:1])
    app = OfftopApp(source, clock=lambda: 0.0, freeze_gc=True)  # as run_app does
    # The app's full GC pass comes once a snapshot is drawn, every 30 (offtop.gc_pacing):
    # which tick of the bench it fell in depended on --runs (none with 7). It is
    # taken out of the ticks here and measured once, last, as its own row.
    pacing = getattr(app, "gc_pacing", None)
    every = getattr(pacing, "every", None)
    if every is not None:
        pacing.every = 1 << 30  # the first pass (which freezes) still comes
    results: dict[str, list[float]] = {}
    cpu: dict[str, list[float]] = {}
    async with app.run_test(size=(160, 50)) as pilot:
        for _ in range(1000):
            if app.snapshot is not None:
                break
            await asyncio.sleep(0.01)
        await settle(pilot)

        seq = iter(range(1, 10_000))
        feed = [s for s in snaps[1:]]

        def next_snap() -> Snapshot:
            snap = feed[next(seq) % len(feed)]
            return snap

        async def tick(_: int) -> None:
            snap = next_snap()
            target = app.received + 1
            source_thread = asyncio.get_running_loop().run_in_executor(None, app.publish, snap)
            while app.received < target:
                await asyncio.sleep(0)
            await source_thread

        index_ms = []
        try:
            from offtop.model import ChainCatalog
            catalog: object = ChainCatalog()
        except ImportError:
            catalog = None
        for snap in snaps[:runs]:
            t = time.perf_counter()
            build_index(snap, catalog)
            index_ms.append((time.perf_counter() - t) * 1000)
        results["index (worker thread)"] = index_ms
        cpu["index (worker thread)"] = index_ms
        try:
            from offtop.model import ChainCatalog, SinceStart, SnapshotIndex
        except ImportError:
            pass
        else:  # since the redesign: the worker also sums stacks since the start
            catalog, since, since_ms = ChainCatalog(), SinceStart(), []
            for snap in snaps[:runs]:
                index = SnapshotIndex(snap, catalog)
                t = time.perf_counter()
                since.add(index)
                fold = getattr(since, "fold", None)
                if fold is not None:  # since the sum is queued by add, done by fold
                    fold()
                since_ms.append((time.perf_counter() - t) * 1000)
            results["since-start add (worker)"] = since_ms
            cpu["since-start add (worker)"] = since_ms
            # Not the app's: the GC pass timed last walks what the app holds.
            del catalog, since, index, fold
        try:
            from offtop.widgets.flame_graph import FlameTree
        except ImportError:
            pass
        else:
            flame_ms = []
            for snap in snaps[:runs]:
                t = time.perf_counter()
                FlameTree(snap.stacks, group_by="process")
                flame_ms.append((time.perf_counter() - t) * 1000)
            results["flame tree (worker thread)"] = flame_ms
            cpu["flame tree (worker thread)"] = flame_ms

        try:
            from offtop.model import ChainCatalog
        except ImportError:
            pass
        else:
            if hasattr(ChainCatalog, "new_chains"):  # since a big merge's chains come from a thread
                chains_ms = []
                for snap in snaps[:runs]:
                    fresh = ChainCatalog()  # the first merge of a run: every chain new
                    t = time.perf_counter()
                    for s in snap.stacks:
                        fresh.info(s.kernel, s.user)
                    chains_ms.append((time.perf_counter() - t) * 1000)
                results["merge's new chains (worker thread)"] = chains_ms
                cpu["merge's new chains (worker thread)"] = chains_ms
                del fresh

        async def timed(name: str, n: int, action: Callable[[int], Awaitable[None]]) -> None:
            start = len(CPU_MS)
            results.setdefault(name, []).extend(await measure(n, action, pilot))
            cpu.setdefault(name, []).extend(CPU_MS[start:])

        await timed("tick: task view", runs, tick)

        async def press(key: str) -> Callable[[int], Awaitable[None]]:
            async def go(_: int) -> None:
                send_key(app, key)

            return go

        send_key(app, "home")  # every down below moves the cursor to another task
        await settle(pilot)
        await timed("key: down", runs, await press("down"))
        await timed("key: s (sort)", runs, await press("s"))
        for _ in range(9 - (runs % 9)):
            send_key(app, "s")  # back around to the default sort
        await settle(pilot)
        for _ in range(runs):
            await timed("key: t (to processes)", 1, await press("t"))
            await timed("key: t (to threads)", 1, await press("t"))
        for _ in range(runs):
            await timed("key: enter (tree)", 1, await press("enter"))
            await timed("key: esc (back)", 1, await press("escape"))
        for _ in range(runs):
            await timed("key: + (threshold)", 1, await press("plus"))
            await timed("key: - (threshold)", 1, await press("minus"))
        send_key(app, "enter")
        await settle(pilot)
        await timed("tick: tree open", runs, tick)
        send_key(app, "escape")
        send_key(app, "t")
        await settle(pilot)
        await timed("tick: processes", runs, tick)
        send_key(app, "t")
        await settle(pilot)
        if has_key(app, "f"):  # the stacks pane's views and modes (since the redesign)
            for _ in range(runs):
                await timed("key: a (all stacks)", 1, await press("a"))
                await timed("key: a (task stacks)", 1, await press("a"))
            for key, name in (("m", "merge"), ("i", "idle waits"), ("c", "since start")):
                send_key(app, "a")
                await settle(pilot)
                for _ in range(runs):
                    await timed(f"key: {key} ({name} on)", 1, await press(key))
                    await timed(f"key: {key} ({name} off)", 1, await press(key))
                send_key(app, "a")
                await settle(pilot)
            for _ in range(runs):
                await timed("key: f (flame graph)", 1, await press("f"))
                await timed("key: f (back)", 1, await press("f"))
            send_key(app, "a")
            send_key(app, "f")
            await settle(pilot)
            await timed("tick: flame of all open", runs, tick)
        if every is not None:
            # What a pass after the 30th snapshot costs on the event loop: all that
            # was drawn since the first pass (every tick and key above) is garbage
            # by then (Textual's strips are reference cycles), and the walk is
            # what the app holds.
            async def full_pass(_: int) -> None:
                app.call_later(pacing.full_pass)

            await timed(f"tick's full GC pass (1 in {every})", 1, full_pass)
        writes = len(source.threshold_writes)
    note(f"threshold writes recorded by the source: {writes}")
    return results, cpu


#: Where progress notes go: stdout, or stderr when stdout carries JSON.
NOTES = sys.stdout


def note(text: str) -> None:
    """A line about the run (not a result)."""
    print(text, file=NOTES)


def table(results: Results, cpu: Results) -> None:
    """The results as the table `bench/run.py` parses."""
    try:
        load = "load average {:.1f} {:.1f} {:.1f}".format(*os.getloadavg())
    except OSError:
        load = ""
    print(f"\n{os.cpu_count()} CPUs, {load}")
    print(f"{'measure':<24} {'wall median':>11} {'max':>7} {'cpu median':>11} {'max':>7}"
          f" {'runs':>5}  wall < {BAR_MS:.0f} ms")
    for name, values in results.items():
        med, worst = statistics.median(values), max(values)
        c = cpu.get(name, values)
        ok = "yes" if worst < BAR_MS else ("median" if med < BAR_MS else "NO")
        print(f"{name:<24} {med:>11.1f} {worst:>7.1f} {statistics.median(c):>11.1f}"
              f" {max(c):>7.1f} {len(values):>5}  {ok}")


def code_tree(ref: str, workdir: Path) -> Path:
    """A directory holding the offtop package of `ref`: itself if it is one,
    else the commit `ref` unpacked (git archive) under `workdir`."""
    if (Path(ref) / "offtop").is_dir():
        return Path(ref).resolve()
    archive = subprocess.run(["git", "archive", ref, "offtop"], capture_output=True, cwd=ROOT,
                             check=True).stdout
    where = workdir / "against"
    where.mkdir()
    subprocess.run(["tar", "-x", "-C", str(where)], input=archive, check=True)
    return where


def side_by_side(args: argparse.Namespace) -> int:
    """Run this benchmark on the code of `args.against` and on this tree, in
    turns, each in its own process; print both and their ratios."""
    merged: dict[str, tuple[Results, Results]] = {"this": ({}, {}), "against": ({}, {})}
    with tempfile.TemporaryDirectory(prefix="bench-ui-") as tmp:
        trees = {"against": code_tree(args.against, Path(tmp)), "this": ROOT}
        for n in range(args.rounds):
            # Each round starts with the other side, as bench/README says all
            # comparisons do: with "this" always second, the same code on both
            # sides came out 0.60-1.18x in one round.
            for side in ("against", "this")[::1 if n % 2 == 0 else -1]:
                note(f"round {n + 1}/{args.rounds}: {side} ({trees[side]})")
                argv = [sys.executable, str(Path(__file__).resolve()), "--json",
                        "--code", str(trees[side]), "--runs", str(args.runs),
                        "--tasks", str(args.tasks), "--stacks", str(args.stacks)]
                out = subprocess.run(argv, capture_output=True, text=True, check=True).stdout
                data = json.loads(out)
                for i, part in enumerate(("wall", "cpu")):
                    for name, values in data[part].items():
                        merged[side][i].setdefault(name, []).extend(values)
    table(*merged["this"])
    (this, this_cpu), (other, other_cpu) = merged["this"], merged["against"]
    print(f"\nside by side, ms: wall median / worst, cpu median / worst; {args.against} → this tree")
    for name, values in this.items():
        old, old_cpu, cpu = other.get(name), other_cpu.get(name), this_cpu.get(name, values)
        if not old or not old_cpu:
            continue
        speedup = statistics.median(old) / max(statistics.median(values), 1e-9)
        print(f"  {name:<24} wall {statistics.median(old):6.1f} / {max(old):6.1f} → "
              f"{statistics.median(values):6.1f} / {max(values):6.1f}   "
              f"cpu {statistics.median(old_cpu):6.1f} / {max(old_cpu):6.1f} → "
              f"{statistics.median(cpu):6.1f} / {max(cpu):6.1f}   wall median {speedup:.2f}x")
    return 0


def main() -> int:
    """Run the benchmark (or two, with --against) and print the results."""
    global NOTES
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=9)
    parser.add_argument("--tasks", type=int, default=2000)
    parser.add_argument("--stacks", type=int, default=20_000)
    parser.add_argument("--against", metavar="REF",
                        help="also measure this git commit (or offtop tree), side by side")
    parser.add_argument("--rounds", type=int, default=4,
                        help="with --against: turns each side takes")
    parser.add_argument("--code", type=Path, default=ROOT, help=argparse.SUPPRESS)
    parser.add_argument("--json", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.runs = max(7, args.runs)
    if args.against:
        return side_by_side(args)
    sys.path.insert(0, str(args.code))
    if args.json:
        NOTES = sys.stderr
    results, cpu = asyncio.run(bench(args.runs, args.tasks, args.stacks))
    if args.json:
        print(json.dumps({"wall": results, "cpu": cpu}))
    else:
        table(results, cpu)
    return 0


if __name__ == "__main__":
    sys.exit(main())
