"""Bad input: one line on stderr, exit status 2, no traceback.

Each case runs the real command line in a subprocess, as a user would. What
the machine lacks (root, bcc, headers, tracefs) is tested in
test_environment.py; closed streams, signals, replay files and namespaces in
test_plumbing.py.
"""

from __future__ import annotations

import os
import pty
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from offtop.cgroups import CgroupError, cgroup2_mounts, resolve_cgroup
from tests.conftest import (  # NOBODY, _python_for_nobody: test_security imports them from here
    NOBODY,  # noqa: F401
    ROOT,
    _python_for_nobody,  # noqa: F401
    assert_one_line_error,
    need_root,
    offtop_json,
    remove_cgroup,
    run_as_nobody,
    run_offtop,
    task_of,
)


def free_pid() -> int:
    """A pid no process or thread has right now."""
    pid_max = int(Path("/proc/sys/kernel/pid_max").read_text())
    for pid in range(pid_max - 1, 1, -1):
        if not Path(f"/proc/{pid}").exists():
            return pid
    raise AssertionError("no free pid")


# --- options -----------------------------------------------------------------

BAD_OPTIONS = [
    (["--threshold", "abc"], ["--threshold", "'abc'"]),
    (["--threshold", "-5ms"], ["--threshold", "negative"]),
    (["--threshold=-5ms"], ["--threshold", "negative"]),
    (["--threshold", "1e99"], ["--threshold", "too large"]),
    (["--threshold", "10 parsecs"], ["--threshold", "unknown unit 'parsecs'"]),
    (["--threshold", "inf"], ["--threshold", "'inf'"]),
    (["--threshold", "nan"], ["--threshold", "'nan'"]),
    (["--threshold", ""], ["--threshold"]),
    (["--interval", "0"], ["--interval", "too short"]),
    (["--interval", "-1"], ["--interval", "negative"]),
    (["--interval", "-0.5"], ["--interval", "negative"]),
    (["--interval", "1e9"], ["--interval", "too large"]),
    (["--interval", "99999999"], ["--interval", "too large"]),
    (["--interval", "0.001"], ["--interval", "too short"]),
    (["--interval", "soon"], ["--interval", "'soon'"]),
    (["--count", "0"], ["--count", "positive"]),
    (["--count", "-1"], ["--count", "positive"]),
    (["--count", "abc"], ["--count", "positive"]),
    (["--count", "1.5"], ["--count", "positive"]),
    (["-p", "abc"], ["pid", "'abc'"]),
    (["-p", "-1"], ["pid", "'-1'"]),
    (["-p", "0"], ["pid", "'0'"]),
    (["-p", ""], ["pid", "''"]),
    (["-p", "1,,2"], ["pid", "''"]),
    (["-p", "1.5"], ["pid", "'1.5'"]),
    (["-p", "99999999999"], ["pid", "larger than any pid"]),
    (["-t", "abc"], ["tid", "'abc'"]),
    (["-t", "-7"], ["tid", "'-7'"]),
    (["-t", "0"], ["tid", "'0'"]),
    (["--states", "XQ"], ["state", "'Q'"]),
    (["--format", "xml"], ["--format", "xml"]),
    (["--frobnicate"], ["unrecognized", "--frobnicate"]),
    (["--threshold"], ["--threshold", "expected one argument"]),
    (["--replay", "/nonexistent/recording.jsonl"], ["recording", "No such file"]),
    (["--limit", "abc"], ["--limit", "'abc'", "whole number"]),
    (["--limit", "-3"], ["--limit", "'-3'"]),
    (["--format", "folded", "--limit", "5"], ["--limit applies to --format json only"]),
    (["--push", "ftp://example.com"], ["invalid push URL", "http(s)://"]),
    (["--push", "not a url"], ["invalid push URL"]),
    (["--push", "http://127.0.0.1:9", "--push-label", "novalue"], ["--push-label", "KEY=VALUE"]),
    (["--push", "http://127.0.0.1:9", "--push-label", "bad key=v"], ["invalid push label"]),
    (["--push", "http://127.0.0.1:9", "--push-label", "env=a,b"], ["invalid value", "env"]),
    (["--push", "http://127.0.0.1:9", "--push-name", "my app"], ["invalid push name"]),
    (["--push", "http://127.0.0.1:9", "--push-header", "X-Org"], ["--push-header", "NAME: VALUE"]),
    (["--push", "http://127.0.0.1:9", "--push-header", "X-Org: a\r\nHost: evil"],
     ["--push-header X-Org", "control character"]),
    (["--push-label", "env=prod"], ["need --push URL"]),
    (["--push-name", "x"], ["need --push URL"]),
    (["-o", "/nonexistent-dir/x.pb.gz", "--format", "pprof"], ["cannot write -o", "No such file"]),
    (["-o", "/tmp", "--format", "pprof"], ["-o /tmp: a directory", "leave out -o"]),
    (["-o", "/dev/null"], ["-o /dev/null: a device", "not a regular file"]),
]


@pytest.mark.parametrize(("args", "needles"), BAD_OPTIONS,
                         ids=[" ".join(a) or "empty" for a, _ in BAD_OPTIONS])
def test_bad_option_is_one_line(args: list[str], needles: list[str]) -> None:
    r = run_offtop("--batch", "--count", "1", *args) if "--count" not in args else \
        run_offtop("--batch", *args)
    assert_one_line_error(r, *needles)
    assert r.returncode == 2


def test_pid_that_does_not_exist_is_an_error() -> None:
    """Decision (cli.parse_ids): -p/-t of a pid that does not exist is an error."""
    pid = free_pid()
    r = run_offtop("--batch", "--count", "1", "-p", str(pid))
    assert_one_line_error(r, "no such pid", str(pid))
    r = run_offtop("--batch", "--count", "1", "-t", str(pid))
    assert_one_line_error(r, "no such tid", str(pid))
    r = run_offtop("--batch", "--count", "1", "-p", f"{os.getpid()},{pid}")
    assert_one_line_error(r, "no such pid", str(pid))


def test_repeated_pid_and_tid_options_all_count() -> None:
    """`-p A -p B` watches both (argparse's default kept only the last, silently);
    a bad id in any of them is the error it is alone."""
    from offtop.cli_args import build_parser, config_from_args

    me, parent = os.getpid(), os.getppid()
    cfg = config_from_args(build_parser().parse_args(
        ["--batch", "-p", str(me), "-p", str(parent), "-t", str(me), "--tid", str(me)]))[0]
    assert (cfg.pids, cfg.tids) == ((me, parent), (me,))
    pid = free_pid()
    r = run_offtop("--batch", "--count", "1", "-p", str(me), "-p", str(pid))
    assert_one_line_error(r, "no such pid", str(pid))


@pytest.mark.parametrize("args", [["--format", "pprof"], ["--format", "speedscope"],
                                  ["-o", "x"], ["--limit", "5"]],
                         ids=["pprof", "speedscope", "output", "limit"])
def test_batch_only_options_in_the_tui_are_one_line(args: list[str]) -> None:
    r = run_offtop(*args)
    assert_one_line_error(r, "needs --batch")
    assert r.returncode == 2


def test_a_recording_refused_from_the_start_is_one_line() -> None:
    r = run_offtop("--batch", "--count", "1", "--record", "/proc/self/status")
    assert_one_line_error(r, "cannot write --record /proc/self/status: Invalid argument")
    assert r.returncode == 1


def test_pprof_is_never_written_to_a_terminal() -> None:
    master, slave = pty.openpty()
    try:
        r = subprocess.run([sys.executable, "-m", "offtop.cli", "--batch", "--format", "pprof",
                            "--count", "1"], stdin=subprocess.DEVNULL, stdout=slave,
                           stderr=subprocess.PIPE, text=True, timeout=60, cwd=ROOT)
    finally:
        os.close(slave)
        os.close(master)
    assert r.returncode == 2
    assert r.stderr.splitlines() == ["offtop: error: --format pprof is binary: give -o FILE "
                                     "or redirect stdout"], r.stderr


def test_output_files_are_never_written_through_a_link_or_over_the_replay(
        tmp_path: Path) -> None:
    target = tmp_path / "precious"
    target.write_text("keep me")
    link = tmp_path / "profile.pb.gz"
    link.symlink_to(target)  # as someone could plant in /tmp
    for opt in ("-o", "--record"):
        r = run_offtop("--batch", "--format", "pprof", "--count", "1", opt, str(link))
        assert_one_line_error(r, f"{opt} {link}: a symbolic link")
        assert target.read_text() == "keep me"
    rec = tmp_path / "rec.jsonl"
    rec.write_text("{}\n")
    for opt in ("-o", "--record"):
        r = run_offtop("--batch", "--replay", str(rec), opt, str(rec))
        assert_one_line_error(r, f"{opt} {rec} is the file being replayed")
        assert rec.read_text() == "{}\n"
    r = run_offtop("--replay", str(rec), "--record", str(tmp_path / "x.gz"))
    assert_one_line_error(r, "--record and --push with --replay need --batch")


def test_corrupt_recording_is_one_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"seq": 1, "tasks": [\n')
    r = run_offtop("--batch", "--replay", str(bad))
    assert_one_line_error(r, "cannot read recording", str(bad))


def test_tui_without_a_terminal_suggests_batch() -> None:
    r = run_offtop()  # stdout is a pipe here
    assert_one_line_error(r, "not a terminal", "--batch")
    assert r.returncode == 2


def test_tui_with_stdin_not_a_terminal_suggests_batch() -> None:
    master, slave = pty.openpty()
    try:
        r = subprocess.run([sys.executable, "-m", "offtop.cli"], stdin=subprocess.DEVNULL,
                           stdout=slave, stderr=subprocess.PIPE, text=True, timeout=60, cwd=ROOT)
    finally:
        os.close(slave)
        os.close(master)
    assert r.returncode == 2
    assert "Traceback" not in r.stderr
    assert len(r.stderr.splitlines()) == 1, r.stderr
    assert "stdin is not a terminal" in r.stderr and "--batch" in r.stderr


@pytest.mark.bpf
def test_threshold_zero_makes_every_block_an_event(bpf_available: None, workloads) -> None:
    w = workloads("sleep", "20")
    snaps = offtop_json("--threshold", "0", "-p", str(w.pid), count=2, interval="1")
    last = snaps[-1]
    assert last["threshold_ns"] == 0
    t = task_of(last, w.tid)
    assert t is not None, last["tasks"]
    # 20 ms sleeps: about 50 blocks a second, every one of them an event.
    assert t["count"] >= 20
    assert t["events"] == t["count"]
    assert sum(1 for b in last["long_blocks"] if b["tid"] == w.tid) >= 20


# --- -c ------------------------------------------------------------------------


@pytest.fixture
def v2_root() -> Path:
    need_root()
    roots = cgroup2_mounts()
    if not roots:
        pytest.skip("no cgroup v2 mount")
    return roots[0]


@pytest.fixture
def make_cgroup() -> Iterator:
    """Create cgroup directories; move their tasks out and remove them at the end."""
    made: list[Path] = []

    def make(parent: Path, name: str | None = None) -> Path:
        d = parent / (name or f"offtop-test-{uuid.uuid4().hex[:8]}")
        d.mkdir()
        made.append(d)
        return d

    yield make
    for d in reversed(made):
        remove_cgroup(d)


def _move(pid: int, cgroup: Path) -> None:
    (cgroup / "cgroup.procs").write_text(f"{pid}\n")


def test_cgroup_does_not_exist(tmp_path: Path) -> None:
    r = run_offtop("--batch", "--count", "1", "-c", str(tmp_path / "nope"))
    assert_one_line_error(r, "does not exist", "nope")
    r = run_offtop("--batch", "--count", "1", "-c", "no-such-cgroup-offtop")
    assert_one_line_error(r, "does not exist", "no-such-cgroup-offtop")


def test_cgroup_not_a_directory(tmp_path: Path) -> None:
    f = tmp_path / "file"
    f.write_text("x")
    r = run_offtop("--batch", "--count", "1", "-c", str(f))
    assert_one_line_error(r, "not a directory", str(f))


def test_cgroup_not_a_cgroup(tmp_path: Path) -> None:
    r = run_offtop("--batch", "--count", "1", "-c", str(tmp_path))
    assert_one_line_error(r, "not a cgroup", str(tmp_path))
    r = run_offtop("--batch", "--count", "1", "-c", "/tmp")
    assert_one_line_error(r, "/tmp is not a cgroup")


def test_cgroup_v1_is_refused_with_the_v2_path_of_its_tasks(
        v2_root: Path, make_cgroup, workloads) -> None:
    v1 = Path("/sys/fs/cgroup/cpu")
    if not (v1 / "cgroup.procs").exists():
        pytest.skip("no cgroup v1 cpu hierarchy")
    w = workloads("sleep", "50")
    v1_dir = make_cgroup(v1)
    _move(w.pid, v1_dir)
    v2_rel = next(line[3:] for line in Path(f"/proc/{w.pid}/cgroup").read_text().splitlines()
                  if line.startswith("0::"))
    expected = str(v2_root / v2_rel.lstrip("/"))
    r = run_offtop("--batch", "--count", "1", "-c", str(v1_dir))
    line = assert_one_line_error(r, "cgroup v1", str(v1_dir))
    assert f"its tasks are in the v2 cgroup {expected}" in line
    w.stop()


def test_cgroup_v1_without_tasks_names_the_v2_mount(v2_root: Path, make_cgroup) -> None:
    v1 = Path("/sys/fs/cgroup/cpu")
    if not (v1 / "cgroup.procs").exists():
        pytest.skip("no cgroup v1 cpu hierarchy")
    v1_dir = make_cgroup(v1)
    r = run_offtop("--batch", "--count", "1", "-c", str(v1_dir))
    assert_one_line_error(r, "cgroup v1", f"cgroup v2 is mounted at {v2_root}")


def test_cgroup_that_cannot_be_read(v2_root: Path, make_cgroup) -> None:
    locked = make_cgroup(v2_root)
    locked.chmod(0o700)
    inner = make_cgroup(locked)
    r = run_as_nobody("--batch", "--count", "1", "-c", str(locked))
    assert_one_line_error(r, "cannot open cgroup", str(locked), "Permission denied")
    r = run_as_nobody("--batch", "--count", "1", "-c", str(inner))
    assert_one_line_error(r, "cannot access cgroup", "permission denied")


def test_relative_cgroup_prefers_the_v2_tree(v2_root: Path, make_cgroup, tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    cg = make_cgroup(v2_root)
    (tmp_path / cg.name).mkdir()  # a same-named plain directory in the working directory
    monkeypatch.chdir(tmp_path)
    assert resolve_cgroup(cg.name) == cg
    assert resolve_cgroup("/" + cg.name) == cg
    with pytest.raises(CgroupError, match="not a cgroup"):
        resolve_cgroup(str(tmp_path / cg.name))


@pytest.mark.bpf
def test_relative_cgroup_path_works(bpf_available: None, v2_root: Path, make_cgroup,
                                    workloads) -> None:
    cg = make_cgroup(v2_root)
    inside = workloads("sleep", "50")
    outside = workloads("sleep", "50")
    _move(inside.pid, cg)
    try:
        snaps = offtop_json("-c", cg.name, count=2, interval="1")
    finally:
        inside.stop()
    last = snaps[-1]
    assert task_of(last, inside.tid) is not None, last["tasks"]
    assert task_of(last, outside.tid) is None
    assert {t["pid"] for t in last["tasks"]} <= {inside.pid}


def test_a_ctrl_c_before_the_streams_are_claimed_ends_offtop_quietly(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """The first thing `main` does (tuning malloc, which finds libc by running
    ldconfig) can meet a Ctrl-C: status 0, nothing printed (it was a traceback:
    a fresh clone's test_batch_signal_during_startup_exits_at_once[0.1])."""
    from offtop import cli

    def interrupted() -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "tune_malloc", interrupted)
    try:
        status = cli.main(["--batch"])
    except KeyboardInterrupt:  # would end the test session itself
        pytest.fail("the Ctrl-C escaped main()")
    assert status == 0
    assert capsys.readouterr() == ("", "")
