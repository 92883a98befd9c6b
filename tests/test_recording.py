"""Recordings (--record / --replay) and replay's time travel.

Unit tests build recordings with the real writer and read them with the
real loader; the end-to-end ones record a known workload with real BPF, in
batch mode and in the TUI, and replay what was recorded.
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import os
import platform
import re
import signal
import subprocess
import sys
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from offtop import __version__
from offtop.model import (
    BlockedNow,
    CaptureStats,
    Frame,
    LongBlock,
    ProcessRow,
    Snapshot,
    StackRow,
    TaskRow,
    Waker,
    WakerRow,
)
from offtop.outputs import Outputs, RecordOutput, TeeSource, recording_header
from offtop.recording import (
    FORMAT_VERSION,
    RecordingError,
    RecordingHeader,
    RecordingWriter,
    load_recording,
)
from offtop.report import snapshot_json_line
from offtop.snapshot_json import SnapshotJsonError, parse_json, snapshot_from_json, snapshot_to_json
from offtop.source import ReplaySource, SourceInfo
from offtop.synthetic import synthetic_snapshots
from tests.conftest import ROOT, assert_one_line_error, run_offtop, wait_until

HEADER = RecordingHeader(host="db-7", kernel="6.1.0-27-amd64", scope="pid 4242",
                         stacks="kernel+user", threshold_ns=500_000_000, interval_s=1.0,
                         started=1_700_000_000.0, states="SDI")


def same(a: Snapshot, b: Snapshot) -> bool:
    """Equal as the JSON codec carries them (it rounds times and derives some stats)."""
    return snapshot_json_line(a) == snapshot_json_line(b)


def record(path: Path, snaps: list[Snapshot], header: RecordingHeader = HEADER) -> Path:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    w = RecordingWriter(fd, header)
    for s in snaps:
        w.add(s)
    w.close()
    return path


@pytest.fixture
def snaps() -> list[Snapshot]:
    return synthetic_snapshots(6, tasks=40, stacks=120)


# --- the format ------------------------------------------------------------------------


def test_a_recording_is_gzipped_json_lines_with_a_header_first(tmp_path: Path,
                                                               snaps: list[Snapshot]) -> None:
    path = record(tmp_path / "r.offtop.gz", snaps)
    with gzip.open(path, "rt") as f:  # what zcat sees: one stream of JSON lines
        lines = f.read().splitlines()
    assert len(lines) == 1 + len(snaps)
    head = json.loads(lines[0])
    assert head == {"offtop_recording": FORMAT_VERSION, "offtop_version": __version__,
                    "host": "db-7", "kernel": "6.1.0-27-amd64", "scope": "pid 4242",
                    "stacks": "kernel+user", "states": "SDI", "threshold_ns": 500_000_000,
                    "interval_s": 1.0, "started": 1_700_000_000.0}
    # Every other line is exactly what --format json prints, never limited.
    assert lines[1:] == [snapshot_json_line(s).rstrip("\n") for s in snaps]
    assert all(json.loads(ln)["omitted"] == {"tasks": 0, "processes": 0, "stacks": 0,
                                             "long_blocks": 0}
               for ln in lines[1:])


def test_each_interval_is_a_gzip_member_of_its_own(tmp_path: Path,
                                                   snaps: list[Snapshot]) -> None:
    data = record(tmp_path / "r.gz", snaps).read_bytes()
    members = 0
    while data:
        d = zlib.decompressobj(wbits=31)
        text = d.decompress(data)
        assert d.eof and text.count(b"\n") == 1 and text.endswith(b"\n")
        data = d.unused_data
        members += 1
    assert members == 1 + len(snaps)


def test_load_gives_the_header_and_every_interval(tmp_path: Path,
                                                  snaps: list[Snapshot]) -> None:
    rec = load_recording(record(tmp_path / "r.gz", snaps))
    assert rec.header == HEADER and not rec.cut_short
    assert len(rec.timeline) == len(snaps)
    assert all(same(a, b) for a, b in zip(rec.timeline, snaps, strict=True))
    assert rec.timeline.times == tuple(s.time for s in snaps)
    # Held compressed: far less than the JSON it stands for.
    json_bytes = sum(len(snapshot_json_line(s)) for s in snaps)
    assert rec.timeline.stored_bytes < json_bytes / 4


def test_a_replay_holds_each_stack_and_each_frame_once(tmp_path: Path,
                                                       snaps: list[Snapshot]) -> None:
    # Decoded apart, a busy server's recording (the same few hundred
    # functions in ~300,000 frames a snapshot) held millions of Frames in a
    # replay, 1.5 GB, and each of the TUI's full GC passes walked them all.
    rec = load_recording(record(tmp_path / "r.gz", snaps))
    decoded = list(rec.timeline)
    assert all(same(a, b) for a, b in zip(decoded, snaps, strict=True))
    stacks = [st for s in decoded for row in s.stacks for st in (row.kernel, row.user)]
    frames = [f for st in stacks for f in st]
    one: dict[tuple[Frame, ...], tuple[Frame, ...]] = {}
    assert all(one.setdefault(st, st) is st for st in stacks)  # equal stacks: one tuple
    assert len(one) < len(stacks) / 2  # (the synthetic snapshots repeat their stacks)
    assert len({id(f) for f in frames}) == len(set(frames)) < len(frames) / 10


def test_plain_and_gzipped_json_output_replays_too(tmp_path: Path,
                                                   snaps: list[Snapshot]) -> None:
    text = "".join(snapshot_json_line(s) for s in snaps)
    plain = tmp_path / "out.jsonl"
    plain.write_text(text.rstrip("\n"))  # a last line without its newline
    zipped = tmp_path / "out.jsonl.gz"
    zipped.write_bytes(gzip.compress(text.encode()))  # one stream, many lines
    for path in (plain, zipped):
        rec = load_recording(path)
        assert rec.header is None and not rec.cut_short
        assert [snapshot_json_line(s) for s in rec.timeline] == \
            [snapshot_json_line(s) for s in snaps]


@pytest.mark.parametrize("cut", ["inside-the-last-interval", "garbage-after-the-last"])
def test_a_recording_cut_short_keeps_every_whole_interval(tmp_path: Path, snaps: list[Snapshot],
                                                          cut: str) -> None:
    path = record(tmp_path / "r.gz", snaps)
    data = path.read_bytes()
    if cut == "inside-the-last-interval":
        last = len(gzip.compress(snapshot_json_line(snaps[-1]).encode(), mtime=0))
        path.write_bytes(data[:-last // 2])
        kept = snaps[:-1]
    else:
        path.write_bytes(data + b"\0" * 4096)  # e.g. preallocated blocks of a crashed writer
        kept = snaps
    rec = load_recording(path)
    assert rec.cut_short
    assert [snapshot_json_line(s) for s in rec.timeline] == [snapshot_json_line(s) for s in kept]
    src = ReplaySource.from_file(path, realtime=False)
    src.start()
    first = src.next_snapshot(1.0, threading.Event())
    assert first is not None and "cut short" in first.notices[0]


def test_a_recording_of_a_header_only_holds_no_snapshots(tmp_path: Path) -> None:
    with pytest.raises(RecordingError, match="holds no snapshots"):
        load_recording(record(tmp_path / "r.gz", []))


def _member(obj: Any) -> bytes:
    return gzip.compress((json.dumps(obj) + "\n").encode())


def _good(n: int = 1) -> list[Any]:
    return [json.loads(snapshot_json_line(s)) for s in synthetic_snapshots(n)]


BAD_FILES: list[tuple[str, Callable[[], bytes], list[str]]] = [
    ("zstd", lambda: b"\x28\xb5\x2f\xfd" + b"\0" * 64, ["zstd", "unzstd"]),
    ("newer-format", lambda: _member({**HEADER.to_json(), "offtop_recording": 99})
     + _member(_good()[0]), ["line 1", "format 99 is newer"]),
    ("header-host-a-number", lambda: _member({**HEADER.to_json(), "host": 5}),
     ["line 1", "header.host: expected a string, found 5"]),
    ("header-twice", lambda: _member(HEADER.to_json()) + _member(_good()[0])
     + _member(HEADER.to_json()), ["line 3", "header after the first line"]),
    ("not-gzip-at-all", lambda: b"\x1f\x8b" + b"\xff" * 64, ["not a valid gzip file"]),
    ("bad-field-in-a-member", lambda: _member(HEADER.to_json())
     + _member({**_good()[0], "tasks": [{**_good()[0]["tasks"][0], "pid": -1}]}),
     ["line 2", "tasks[0].pid"]),
    ("line-longer-than-64-MiB-inflated",
     lambda: _member(HEADER.to_json()) + gzip.compress(b"[" + b" " * (65 << 20) + b"]\n"),
     ["line 2", "longer than 64 MiB"]),
]


@pytest.mark.parametrize(("make", "needles"), [(m, n) for _, m, n in BAD_FILES],
                         ids=[name for name, _, _ in BAD_FILES])
def test_what_is_not_a_recording_is_refused_with_one_line(tmp_path: Path,
                                                          make: Callable[[], bytes],
                                                          needles: list[str]) -> None:
    path = tmp_path / "bad.gz"
    path.write_bytes(make())
    with pytest.raises(RecordingError) as e:
        load_recording(path)
    msg = str(e.value)
    assert "\n" not in msg
    for n in needles:
        assert n in msg, msg
    r = run_offtop("--batch", "--replay", str(path))
    assert_one_line_error(r, "cannot read recording", *needles)
    assert r.returncode == 2


def test_a_zip_bomb_stops_at_the_inflated_cap(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    import offtop.recording as recording

    monkeypatch.setattr(recording, "MAX_INFLATED_BYTES", 8 << 20)
    path = tmp_path / "bomb.gz"
    line = snapshot_json_line(synthetic_snapshots(1)[0]).encode()
    path.write_bytes(gzip.compress(line * ((16 << 20) // len(line))))  # 16 MiB of lines
    with pytest.raises(RecordingError, match="more than"):
        load_recording(path)


# --- the codec checks every field it reads ------------------------------------------------

K = (Frame("schedule", "kernel", True), Frame("pipe_read", "kernel", True))
U = (Frame("read", "libc.so.6"), Frame("main", "app"))
WAKER = Waker(pid=9, tid=10, comm="writer", kind="task", kernel=K, user=U)


def rich_snapshot() -> Snapshot:
    """A snapshot with every field the JSON codec carries set to something."""
    return Snapshot(
        seq=4, time=1_700_000_004.0, interval_s=1.0, threshold_ns=500_000_000,
        tasks=(TaskRow(1, 2, "app", 900, 3, 400, {"S": 800, "D": 100}, 5000, 1),),
        processes=(ProcessRow(1, "app", 2, 900, 3, 400, {"S": 900}, 5000, 1, "root",
                              "app --serve"),),
        stacks=(StackRow(1, 2, "app", "S", 900, 3, 400, K, U, before_start=True,
                         waker_rows=(WakerRow(WAKER, 600, 2),)),),
        long_blocks=(LongBlock(1_700_000_003.5, 1, 2, "app", "S", 600_000_000, K, U, 77,
                               before_start=True, waker=WAKER),),
        blocked_now=(BlockedNow(1, 2, "app", "D", 9_000_000, K, U, before_start=True),),
        stats=CaptureStats(events=1, lost=2, events_total=3, lost_total=4,
                           stack_errors={"user EFAULT": 5}, drops={"ring": 6},
                           truncated_stacks=7, symbol_misses=8, agg_entries=9, stacks_used=10,
                           stacks_capacity=11, stacks_reclaimed=12, probe_run_ns=13,
                           probe_runs=14, flood_threshold_ns=15, symbol_deadline_misses=16,
                           depth_limited_stacks=17, user_stacks_lost=18,
                           symbol_errors={"bad ELF": 19}, python_failures={"no GIL": 20},
                           offtop_cpu_pct=2.5, offtop_rss_bytes=21),
        notices=("pid 3 exited",), finished="nothing left to watch: pid 3 exited",
    )


#: What the writer adds that the reader derives or does not need (never read back).
NOT_READ = {"stats.stack_errors", "stats.probe_ns_per_switch", "stats.probe_cpu_pct",
            "stats.switches_per_s", "stats.events_per_s", "omitted", "omitted.tasks",
            "omitted.processes", "omitted.stacks", "omitted.long_blocks"}


def _leaves(obj: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    """Every path into a JSON value (objects' keys and lists' first items)."""
    if path:
        yield path
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _leaves(v, (*path, k))
    elif isinstance(obj, list) and obj:
        yield from _leaves(obj[0], (*path, 0))


def _name(path: tuple[Any, ...]) -> str:
    return ".".join(str(p) for p in path if not isinstance(p, int))


def test_every_field_written_is_read_back_and_checked() -> None:
    """Each field `snapshot_to_json` writes, given a value of the wrong type, is refused
    with a message naming it. A field added to the writer and not to the reader, or read
    without a check, fails here."""
    good = snapshot_to_json(rich_snapshot())
    assert same(snapshot_from_json(json.loads(json.dumps(good))), rich_snapshot())
    checked = 0
    for path in _leaves(good):
        if _name(path) in NOT_READ:
            continue
        bad = json.loads(json.dumps(good))
        node = bad
        for p in path[:-1]:
            node = node[p]
        # A value of the wrong type whatever the field holds.
        node[path[-1]] = [{"x": 1}] if isinstance(node[path[-1]], dict) else {"wrong": 1}
        with pytest.raises(SnapshotJsonError) as e:
            snapshot_from_json(bad)
        named = [str(p) for p in path[-2:] if not isinstance(p, int)]
        assert any(n in str(e.value) for n in named), (path, e.value)
        checked += 1
    assert checked > 80  # every field of every row kind, waker and stats


def test_the_codec_refuses_what_json_allows_but_offtop_never_writes() -> None:
    for text, needle in (('{"time": NaN}', "NaN"), ("[1]", "found a list"),
                         ("1" * 5000, "not JSON"), ("[" * 100_000, "nested too deeply"),
                         (b"\xff\xfe", "not UTF-8")):
        with pytest.raises(SnapshotJsonError, match=needle):
            snapshot_from_json(parse_json(text))


# --- replay: time travel -----------------------------------------------------------------


def seqs(src: ReplaySource, n: int) -> list[int]:
    stop = threading.Event()
    out = []
    for _ in range(n):
        s = src.next_snapshot(1.0, stop)
        out.append(-1 if s is None else s.seq)
    return out


@pytest.fixture
def replay(snaps: list[Snapshot]) -> ReplaySource:
    src = ReplaySource(snaps, realtime=False)
    src.start()
    return src


def test_replay_plays_in_order_then_ends(replay: ReplaySource) -> None:
    assert (replay.position, replay.length, replay.at_end) == (-1, 6, False)
    assert seqs(replay, 7) == [1, 2, 3, 4, 5, 6, -1]
    assert replay.position == 5 and replay.at_end


def test_steps_go_back_and_forth_and_pause(replay: ReplaySource) -> None:
    assert seqs(replay, 3) == [1, 2, 3]
    assert replay.step(-1) == 1 and replay.paused
    assert seqs(replay, 1) == [2] and replay.position == 1
    replay.step(+1)
    assert replay.step(+1) == 3  # steps add up until shown
    assert seqs(replay, 1) == [4]
    assert replay.step(-5) == 0  # clamped at the first
    assert replay.step(+100) == 5  # and at the last
    assert seqs(replay, 1) == [6] and replay.at_end and replay.paused


def test_step_back_from_the_first_and_forward_shows_each_once(replay: ReplaySource) -> None:
    seqs(replay, 4)
    shown = []
    for delta in (-1, -1, -1, +1, +1):
        replay.step(delta)
        shown += seqs(replay, 1)
    assert shown == [3, 2, 1, 2, 3]
    assert replay.paused


def test_seek_by_index_and_by_time(replay: ReplaySource, snaps: list[Snapshot]) -> None:
    assert replay.seek(3) == 3 and seqs(replay, 1) == [4]
    assert not replay.paused  # a seek keeps playing
    assert seqs(replay, 1) == [5]
    assert replay.seek_time(snaps[1].time - 0.5) == 1 and seqs(replay, 1) == [2]
    assert replay.seek_time(0) == 0 and replay.seek_time(1e10) == 5
    assert replay.time_at(2) == snaps[2].time and replay.times[0] == snaps[0].time


def test_a_paused_replay_waits_until_resumed_or_stopped(replay: ReplaySource) -> None:
    replay.pause()
    stop = threading.Event()
    got: list[Snapshot | None] = []
    t = threading.Thread(target=lambda: got.append(replay.next_snapshot(1.0, stop)))
    t.start()
    time.sleep(0.3)
    assert not got, "a paused replay gave a snapshot"
    replay.resume()
    t.join(2)
    assert got and got[0] is not None and got[0].seq == 1
    replay.pause()
    t = threading.Thread(target=lambda: got.append(replay.next_snapshot(1.0, stop)))
    t.start()
    t0 = time.monotonic()
    stop.set()
    t.join(2)
    assert got[-1] is None and time.monotonic() - t0 < 0.5
    assert replay.toggle_pause() is False and replay.toggle_pause() is True


def test_a_seek_wakes_a_waiting_replay_at_once(snaps: list[Snapshot]) -> None:
    src = ReplaySource(snaps, realtime=True)
    src.start()
    stop = threading.Event()
    assert src.next_snapshot(30.0, stop) is not None  # the first comes at once
    threading.Timer(0.2, src.seek, (4,)).start()
    t0 = time.monotonic()
    snap = src.next_snapshot(30.0, stop)
    assert snap is not None and snap.seq == 5 and time.monotonic() - t0 < 2.0


def test_speed_scales_the_wait(snaps: list[Snapshot]) -> None:
    src = ReplaySource(snaps, realtime=True)
    src.start()
    stop = threading.Event()

    def gap() -> float:
        t0 = time.monotonic()
        assert src.next_snapshot(0.8, stop) is not None
        return time.monotonic() - t0

    gap()  # the first, at once
    assert gap() >= 0.75
    assert src.set_speed(8) == 8 and src.speed == 8
    assert gap() < 0.5
    assert src.slower() == 4 and src.faster() == 8
    assert src.set_speed(1000) == ReplaySource.MAX_SPEED
    assert src.set_speed(1e-9) == ReplaySource.MIN_SPEED
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError):
            src.set_speed(bad)


def test_holding_at_the_end_lets_time_travel_go_back(snaps: list[Snapshot]) -> None:
    src = ReplaySource(snaps[:2], realtime=False, hold_at_end=True)
    src.start()
    stop = threading.Event()
    assert seqs(src, 2) == [1, 2] and src.at_end
    got: list[Snapshot | None] = []
    t = threading.Thread(target=lambda: got.append(src.next_snapshot(1.0, stop)))
    t.start()
    time.sleep(0.3)
    assert not got, "the replay went past its end"
    src.step(-1)
    t.join(2)
    assert got and got[0] is not None and got[0].seq == 1
    looped = ReplaySource(snaps[:2], realtime=False, loop=True)
    looped.start()
    assert seqs(looped, 5) == [1, 2, 1, 2, 1]


def test_thresholds_are_the_recorded_ones_until_one_is_set(snaps: list[Snapshot]) -> None:
    varied = [dataclasses.replace(s, threshold_ns=(i + 1) * 1000) for i, s in enumerate(snaps)]
    src = ReplaySource(varied, realtime=False)
    src.start()
    stop = threading.Event()
    assert [s.threshold_ns for s in (src.next_snapshot(1, stop), src.next_snapshot(1, stop))
            if s is not None] == [1000, 2000]
    assert src.threshold_ns == 2000
    src.set_threshold(7)
    s = src.next_snapshot(1, stop)
    assert s is not None and s.threshold_ns == 7 == src.threshold_ns
    assert src.threshold_writes == [7]


def test_blocked_waits_follow_the_interval_shown(replay: ReplaySource,
                                                 snaps: list[Snapshot]) -> None:
    seqs(replay, 3)
    replay.step(-2)
    seqs(replay, 1)
    tids = [b.tid for b in snaps[0].blocked_now]
    assert replay.blocked_waits(tids) == {b.tid: b.blocked_ns for b in snaps[0].blocked_now}


def test_a_replay_shows_the_recorded_machine_not_this_one(tmp_path: Path,
                                                          snaps: list[Snapshot]) -> None:
    src = ReplaySource.from_file(record(tmp_path / "r.gz", snaps))
    assert src.info == SourceInfo(host="db-7", kernel="6.1.0-27-amd64", scope="pid 4242",
                                  stacks="kernel+user", kind="replay")
    plain = tmp_path / "plain.jsonl"
    plain.write_text("".join(snapshot_json_line(s) for s in snaps))
    info = ReplaySource.from_file(plain).info
    assert (info.host, info.kernel) == ("(not recorded)", "(not recorded)")
    assert info.host != platform.node()


# --- recording from the TUI's side: the tee ----------------------------------------------


def test_the_tee_records_every_snapshot_the_app_gets(tmp_path: Path,
                                                     snaps: list[Snapshot]) -> None:
    inner = ReplaySource(snaps, realtime=False)
    path = tmp_path / "tui.gz"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    header = recording_header(inner.info, threshold_ns=inner.threshold_ns, interval_s=1.0)
    outputs = Outputs(RecordOutput(str(path), fd, header))
    tee = TeeSource(inner, outputs)
    tee.start()
    stop = threading.Event()
    got = [tee.next_snapshot(1.0, stop) for _ in range(len(snaps) + 1)]
    assert got[-1] is None
    assert outputs.close() == []
    assert [snapshot_json_line(s) for s in load_recording(path).timeline] == \
        [snapshot_json_line(s) for s in snaps]
    # The app still sees what its source offers: blocked waits, time travel.
    from offtop.source import BlockedWaits

    assert isinstance(tee, BlockedWaits) and tee.length == len(snaps)

    class Bare:
        info = inner.info
        threshold_ns = 0

    assert not isinstance(TeeSource(Bare(), Outputs()), BlockedWaits)  # type: ignore[arg-type]


def test_a_recording_that_cannot_be_written_is_one_line(tmp_path: Path,
                                                        snaps: list[Snapshot]) -> None:
    from offtop.cli_io import OutputError

    fd = os.open("/dev/full", os.O_WRONLY)
    with pytest.raises(OutputError, match=r"cannot write --record /x: No space left on device"):
        RecordOutput("/x", fd, HEADER)


# --- end to end: real BPF, the real command line -------------------------------------------


def without_derived(line: str) -> dict[str, Any]:
    """A JSON line without the stats derived from others (rates are recomputed on replay)."""
    d: dict[str, Any] = json.loads(line)
    for name in NOT_READ:
        if name.startswith("stats."):
            d["stats"].pop(name.removeprefix("stats."))
    return d


@pytest.mark.bpf
def test_batch_records_what_it_prints_and_replays_it(bpf_available: None, workloads: Any,
                                                    tmp_path: Path) -> None:
    w = workloads("sleep", "100")
    path = tmp_path / "run.offtop.gz"
    r = run_offtop("--batch", "--format", "json", "--limit", "0", "--count", "3",
                   "--interval", "0.5", "-p", str(w.pid), "--record", str(path))
    assert r.returncode == 0, r.stderr
    printed = r.stdout.splitlines()
    assert len(printed) == 3
    assert oct(path.stat().st_mode & 0o777) == "0o600"  # names and command lines of others
    rec = load_recording(path)
    assert rec.header is not None
    h = rec.header
    assert (h.host, h.kernel, h.scope, h.stacks, h.states) == (
        platform.node(), platform.release(), f"pid {w.pid}", "kernel+user", "SDI")
    assert (h.threshold_ns, h.interval_s, h.offtop_version) == (500_000_000, 0.5, __version__)
    with gzip.open(path, "rt") as f:
        assert f.read().splitlines()[1:] == printed  # each interval, exactly as printed
    assert any(st.tid == w.tid and any(f.name == "offtop_wl_sleep" for f in st.user)
               for s in rec.timeline for st in s.stacks)
    replayed = run_offtop("--batch", "--format", "json", "--limit", "0", "--replay", str(path))
    assert replayed.returncode == 0, replayed.stderr
    assert [without_derived(ln) for ln in replayed.stdout.splitlines()] == \
        [without_derived(ln) for ln in printed]


@pytest.mark.bpf
def test_a_signal_records_the_unfinished_interval_too(bpf_available: None, workloads: Any,
                                                     tmp_path: Path) -> None:
    w = workloads("sleep", "100")
    path = tmp_path / "run.gz"
    p = subprocess.Popen([sys.executable, "-m", "offtop.cli", "--batch", "--format", "json",
                          "-p", str(w.pid), "--record", str(path)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    assert p.stdout is not None
    for _ in range(2):
        assert p.stdout.readline()
    time.sleep(0.4)
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=10)
    assert p.returncode == 0, err
    timeline = load_recording(path).timeline
    assert len(timeline) == 3
    assert timeline[2].interval_s < 0.9  # the unfinished one


def _record_in_the_tui(path: Path, pid: int, interval: str, shown: str,
                       then_s: float = 0.0) -> None:
    """`offtop -p PID --interval INTERVAL --record PATH` in tmux, quit with q `then_s`
    after the header's snapshot number matches `shown` (a regex); it must exit 0."""
    from tests.test_faults import Tmux

    tmux = Tmux()
    try:
        tmux.type(f"cd {ROOT} && {sys.executable} -m offtop.cli -p {pid} --interval {interval} "
                  f"--record {path}; echo offtop-exit=$?")
        assert wait_until(lambda: re.search(shown, tmux.screen()) is not None,
                          timeout=60), tmux.screen()
        time.sleep(then_s)
        tmux.run("send-keys", "-t", "t", "q")
        assert wait_until(lambda: "offtop-exit=0" in tmux.screen(), timeout=10), tmux.screen()
    finally:
        tmux.close()


@pytest.mark.bpf
def test_the_tui_records_while_it_runs(bpf_available: None, workloads: Any,
                                       tmp_path: Path) -> None:
    w = workloads("sleep", "100")
    path = tmp_path / "tui.gz"
    _record_in_the_tui(path, w.pid, "0.5", r" #(?:[3-9]|\d\d+) ")
    rec = load_recording(path)
    assert rec.header is not None and rec.header.scope == f"pid {w.pid}" and not rec.cut_short
    assert len(rec.timeline) >= 3
    assert any(st.tid == w.tid for s in rec.timeline for st in s.stacks)


@pytest.mark.bpf
def test_q_records_the_unfinished_interval_too(bpf_available: None, workloads: Any,
                                               tmp_path: Path) -> None:
    """Quitting the TUI keeps what happened since the last snapshot in the recording,
    as a signal does in batch mode: 5 s intervals, q ~2 s after the first snapshot."""
    w = workloads("sleep", "100")
    path = tmp_path / "tui.gz"
    _record_in_the_tui(path, w.pid, "5", r" #1 ", then_s=2.0)
    timeline = load_recording(path).timeline
    assert len(timeline) == 2, [s.interval_s for s in timeline]
    last = timeline[1]
    assert 1.5 < last.interval_s < 4.9  # the unfinished one: from the first snapshot to q
    assert any(st.tid == w.tid and st.offcpu_ns > 1_000_000_000 for st in last.stacks)


def test_a_recording_that_fills_its_disk_ends_the_run_with_one_line(tmp_path: Path) -> None:
    """The disk fills in the middle of a run: status 1, one line, what was written still plays."""
    from tests.conftest import need_root

    need_root()
    source = record(tmp_path / "big.gz", synthetic_snapshots(20, tasks=300, stacks=2000))
    small = tmp_path / "small"
    small.mkdir()
    r = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c",
         f"mount -t tmpfs -o size=256k none {small} || exit 99; "
         f'"$0" -m offtop.cli --batch --replay {source} --record {small}/r.gz > /dev/null; '
         f"s=$?; cp {small}/r.gz {tmp_path}/kept.gz; exit $s", sys.executable],
        capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode != 99, r.stderr
    assert_one_line_error(r, f"cannot write --record {small}/r.gz: No space left on device")
    assert r.returncode == 1
    kept = load_recording(tmp_path / "kept.gz")
    assert 0 < len(kept.timeline) < 20 and kept.header is not None
    # Re-recorded from a replay: the recorded machine, still.
    assert (kept.header.host, kept.header.kernel, kept.header.scope) == (
        HEADER.host, HEADER.kernel, HEADER.scope)
