"""Unit tests of the headless formats: JSON round trip, folded, text."""

from __future__ import annotations

import json

from offtop.model import Aggregator, BlockedNow, CaptureStats, Frame, LongBlock, Sample, Snapshot
from offtop.report import folded_lines, snapshot_from_json, snapshot_to_json, text_report

K = (Frame("schedule", "kernel", True), Frame("do_nanosleep", "kernel", True))
U = (Frame("inner fn;x", "libx.so"), Frame("main", "app"))


def snapshot():  # type: ignore[no-untyped-def]
    return Aggregator().build(
        [Sample(10, 11, "app[1]", "S", 2_500_000, 3, 1_000_000, K, U),
         Sample(10, 12, "app", "D", 1_000, 1, 1_000, K, ())],
        time=1_700_000_000.5, interval_s=1.0, threshold_ns=500_000_000,
        long_blocks=[LongBlock(1_700_000_000.2, 10, 11, "app[1]", "S", 600_000_000, K, U, 7)],
        blocked_now=[BlockedNow(10, 12, "app", "D", 9_000_000, K, ())],
        stats=CaptureStats(events=1, lost=2, stack_errors={"user EFAULT": 3}, interval_s=1.0),
    )


def test_json_has_the_contract_fields_and_round_trips() -> None:
    snap = snapshot()
    d = json.loads(json.dumps(snapshot_to_json(snap)))
    assert {"time", "interval_s", "threshold_ns", "stats", "tasks", "stacks"} <= d.keys()
    assert d["stats"]["events"] == 1 and d["stats"]["lost"] == 2 and d["stats"]["stack_errors"] == 3
    t = d["tasks"][0]
    assert {"pid", "tid", "comm", "offcpu_ns", "count", "max_ns", "state_ns"} <= t.keys()
    assert t["state_ns"] == {"S": 2_500_000, "D": 0}
    assert [x["offcpu_ns"] for x in d["tasks"]] == sorted((x["offcpu_ns"] for x in d["tasks"]), reverse=True)
    st = d["stacks"][0]
    assert st["kernel"] == ["schedule", "do_nanosleep"] and st["user"] == ["inner fn;x", "main"]
    back = snapshot_from_json(d)
    assert back.tasks == snap.tasks and back.stacks == snap.stacks
    assert back.long_blocks[0].duration_ns == 600_000_000
    assert back.blocked_now == snap.blocked_now


def test_folded_is_outermost_first_user_then_kernel_in_microseconds() -> None:
    lines = folded_lines(snapshot())
    assert lines[0] == "app[1];main;inner_fn:x;do_nanosleep;schedule 2500"
    assert len(lines) == 2 and lines[1].endswith(" 1")


def test_text_report_lists_tasks_stacks_and_blocks() -> None:
    text = text_report(snapshot())
    assert "app[1]" in text and "2.50ms" in text
    assert "long blocks" in text and "blocked now" in text


def test_hostile_names_are_escaped_in_text_and_folded_and_exact_in_json() -> None:
    evil_k = (Frame("schedule", "kernel", True), Frame("k\x1b[2J", "kernel", True))
    evil_u = (Frame("jit\x1b]0;PWNED\x07 a;b\u2028", "[anon]"), Frame("main\n", "app"))
    comm = "\x1b]0;PWNED\x07\r\n\x08\udcff"
    snap = Aggregator().build(
        [Sample(10, 11, comm, "S", 2_500_000, 3, 1_000_000, evil_k, evil_u)],
        time=1_700_000_000.5, interval_s=1.0, threshold_ns=500_000_000,
        long_blocks=[LongBlock(1_700_000_000.2, 10, 11, comm, "S", 600_000_000, evil_k, evil_u,
                               7)],
        blocked_now=[BlockedNow(10, 11, comm, "D", 9_000_000, evil_k, evil_u)],
    )
    text = text_report(snap)
    assert all(line.isprintable() for line in text.split("\n")), text
    escaped = "\\x1b]0;PWNED\\x07\\x0d\\x0a\\x08\\xff"
    assert text.count(escaped) == 4  # the task, its stack, the long block, blocked now
    assert "jit\\x1b]0;PWNED\\x07 a;b\\u2028" in text and "k\\x1b[2J" in text
    (line,) = folded_lines(snap)
    fold_comm = escaped.replace(";", ":")
    assert line == f"{fold_comm};main\\x0a;jit\\x1b]0:PWNED\\x07_a:b\\u2028;k\\x1b[2J;schedule 2500"
    # JSON: the names exactly (the encoder escapes control characters itself).
    d = json.loads(json.dumps(snapshot_to_json(snap)))
    assert d["tasks"][0]["comm"] == d["stacks"][0]["comm"] == comm
    assert d["stacks"][0]["user"] == [evil_u[0].name, "main\n"]
    assert d["blocked_now"][0]["comm"] == d["long_blocks"][0]["comm"] == comm


def test_json_round_trip_keeps_user_modules_notices_and_new_stats() -> None:
    """Long blocks and blocked-now keep their user frames' modules; notices survive."""
    from offtop.model import BlockedNow, CaptureStats, Frame, LongBlock, Snapshot
    from offtop.report import snapshot_from_json, snapshot_to_json

    user = (Frame("read_loop", "app"), Frame("main", "app"))
    snap = Snapshot(
        seq=3, time=1000.0, interval_s=1.0, threshold_ns=5,
        long_blocks=(LongBlock(time=1000.5, pid=1, tid=2, comm="x", state="S",
                               duration_ns=9, user=user),),
        blocked_now=(BlockedNow(pid=1, tid=2, comm="x", state="D", blocked_ns=7, user=user),),
        stats=CaptureStats(flood_threshold_ns=2_000_000, offtop_cpu_pct=1.5,
                           offtop_rss_bytes=80 << 20, symbol_errors={"bad ELF": 2}),
        notices=("pid 1 exited",), finished="nothing left to watch: pid 1 exited",
    )
    back = snapshot_from_json(snapshot_to_json(snap))
    assert [f.module for f in back.long_blocks[0].user] == ["app", "app"]
    assert [f.module for f in back.blocked_now[0].user] == ["app", "app"]
    assert back.notices == snap.notices and back.finished == snap.finished
    assert back.stats.flood_threshold_ns == 2_000_000
    assert back.stats.symbol_errors == {"bad ELF": 2}
    assert back.stats.offtop_rss_bytes == 80 << 20


def test_json_lines_hold_the_longest_long_blocks_in_their_order_and_count_the_rest() -> None:
    """A pool of 5,000 threads waking once a second past the threshold: 1,000 long
    blocks an interval made JSON lines of ~0.9 MB at the default --limit."""
    durations = [5, 90, 7, 60, 3, 80, 1]
    blocks = tuple(LongBlock(time=1000.0 + i, pid=1, tid=10 + i, comm="pool", state="S",
                             duration_ns=d) for i, d in enumerate(durations))
    snap = Snapshot(seq=1, time=1010.0, interval_s=1.0, threshold_ns=1, long_blocks=blocks)
    d = snapshot_to_json(snap, limit=3)
    assert [b["duration_ns"] for b in d["long_blocks"]] == [90, 60, 80]  # by time, as sent
    assert [b["tid"] for b in d["long_blocks"]] == [11, 13, 15]
    assert d["omitted"]["long_blocks"] == 4
    assert len(snapshot_to_json(snap, limit=0)["long_blocks"]) == 7
    assert snapshot_to_json(snap, limit=7)["omitted"]["long_blocks"] == 0


def test_json_lines_hold_the_top_rows_and_say_how_many_were_left_out() -> None:
    from offtop.synthetic import synthetic_snapshots

    snap = synthetic_snapshots(1, tasks=120, stacks=300)[0]
    assert len(snap.tasks) > 10 and len(snap.processes) > 10 and len(snap.stacks) > 10
    d = snapshot_to_json(snap, limit=10)
    for key in ("tasks", "processes", "stacks"):
        rows = getattr(snap, key)
        assert [r["offcpu_ns"] for r in d[key]] == [r.offcpu_ns for r in rows[:10]]
        assert d["omitted"][key] == len(rows) - 10
    # Blocked-now is bounded by the capture itself (200), and kept.
    assert len(d["blocked_now"]) == len(snap.blocked_now)
    full = snapshot_to_json(snap, limit=0)
    assert len(full["stacks"]) == len(snap.stacks)
    assert len(full["long_blocks"]) == len(snap.long_blocks)
    assert full["omitted"] == {"tasks": 0, "processes": 0, "stacks": 0, "long_blocks": 0}
    # Folded output is never limited.
    assert len(folded_lines(snap)) == sum(1 for s in snap.stacks if round(s.offcpu_ns / 1000))


def test_the_command_line_bounds_json_by_default_and_keeps_folded_complete(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """`--batch --format json`: 100 rows of each kind a line unless --limit says otherwise."""
    from offtop.report import snapshot_json_line
    from offtop.synthetic import synthetic_snapshots
    from tests.conftest import run_offtop

    snaps = synthetic_snapshots(2, tasks=300, stacks=600)
    path = tmp_path / "big.jsonl"
    path.write_text("".join(snapshot_json_line(s) for s in snaps))
    for args, n in (([], 100), (["--limit", "7"], 7), (["--limit", "0"], None)):
        r = run_offtop("--batch", "--format", "json", "--replay", str(path), *args)
        assert r.returncode == 0, r.stderr
        lines = [json.loads(x) for x in r.stdout.splitlines()]
        assert len(lines) == len(snaps)
        for d, s in zip(lines, snaps, strict=True):
            for key in ("tasks", "processes", "stacks"):
                total = len(getattr(s, key))
                assert total > 7 and (key == "processes" or total > 100)
                assert len(d[key]) == (total if n is None else min(n, total))
                assert d["omitted"][key] == total - len(d[key])
    r = run_offtop("--batch", "--format", "folded", "--replay", str(path))
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == [ln for s in snaps for ln in folded_lines(s)]
