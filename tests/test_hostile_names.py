"""Hostile names: what a process controls must never crash, corrupt or hijack offtop.

A process picks its own comm (prctl PR_SET_NAME), its threads' comms, its
command line and the JIT symbol names in /tmp/perf-PID.map. offtop runs as
root and shows them all, so each one is tried here with what a terminal
would act on (escape sequences, CR, LF, BS), a byte that is not UTF-8, and
Rich markup. Everywhere they reach a terminal (the TUI, `--format text`,
`--format folded`) control characters must appear as visible escapes
(`\\x1b`); JSON must hold the decoded strings exactly.

Three layers, as in the rest of the suite: the rendering helpers and
reports on their own, the TUI through Pilot with a replay source, and the
real command line and TUI (in tmux) against a hostile helper program built
here with gcc.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from rich.text import Text
from textual.content import Content

import offtop.app as app_module
from offtop.app import OfftopApp
from offtop.model import Aggregator, BlockedNow, CaptureStats, Frame, LongBlock, Sample, Snapshot
from offtop.procinfo import ProcessInfoCache
from offtop.safe_text import printable
from offtop.source import ReplaySource, SourceInfo
from offtop.widgets.callchain_tree import CallchainTree
from offtop.widgets.header import OfftopHeader
from offtop.widgets.long_blocks_log import LongBlocksLog, long_block_line
from offtop.widgets.render import chain_summary, frame_text, task_label
from tests.conftest import ROOT, wait_until
from tests.test_faults import Tmux
from tests.test_ui_app import SIZE, FakeClock, FakeLiveReplay, fake_source, shown

#: What a hostile process names itself, as the kernel stores it (bytes).
HOSTILE_COMMS: dict[str, bytes] = {
    "not-utf8": b"\xff",
    "osc-title": b"\x1b]0;PWNED\x07",
    "clear-screen": b"\x1b[2J",
    "cr": b"\r",
    "lf": b"\n",
    "bs": b"\x08",
    "markup": b"[bold]x[/]",
}
#: The JIT symbol the helper writes to its perf map (one line of that file:
#: no CR or LF, which would end the line for every reader of perf maps).
HOSTILE_JIT = b"jit\x1b]0;PWNED\x07\x1b[2J\x08[bold]x[/]"
#: Characters a terminal acts on: none may reach it from untrusted text.
CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")
OSC = "\x1b]0;PWNED\x07"


def decoded(raw: bytes) -> str:
    """What JSON must hold for a name: UTF-8, invalid bytes replaced."""
    return raw.decode("utf-8", errors="replace")


def assert_shown_escaped(text: str | Text, *expected: str, lines: bool = False) -> None:
    """No control character in `text`, and each of `expected` shown escaped.

    `lines`: `text` is laid out in lines by its widget (a line break there
    is layout, not a character sent to the terminal).
    """
    plain = text.plain if isinstance(text, Text) else text
    assert not CONTROL.search(plain.replace("\n", "") if lines else plain), repr(plain)
    for e in expected:
        assert printable(e) in plain, (printable(e), plain)


# --- the rendering helpers and reports (no root) ------------------------------------------------

EVIL_K = (Frame("schedule", "kernel", True), Frame("evil\x1b[2J\rk", "kernel", True))
EVIL_U = (Frame(f"jit{OSC}\x08", "lib\x1b[2J.so"), Frame("main\n", "app"))


def test_render_helpers_escape_control_characters() -> None:
    assert_shown_escaped(task_label(OSC, 1, 2), OSC)
    assert_shown_escaped(frame_text(EVIL_U[0], module=True), EVIL_U[0].name, "lib\x1b[2J.so")
    assert_shown_escaped(chain_summary(EVIL_K, EVIL_U), "evil\x1b[2J\rk", EVIL_U[0].name)
    line = long_block_line(LongBlock(1.0, 1, 2, "a\rb\x08", "S", 10**9, EVIL_K, EVIL_U, 0))
    assert_shown_escaped(line, "a\rb\x08", "evil\x1b[2J\rk")
    # Markup-like names are literal, not parsed.
    assert task_label("[bold]x[/]", 1).plain.startswith("[bold]x[/]")


def test_command_lines_are_exact_and_decoded_with_replacement() -> None:
    """psutil decodes /proc with surrogateescape (JSON then holds lone surrogates)
    and in text mode (a CR in an argument comes back as LF)."""
    code = "import time; time.sleep(30)"
    proc = subprocess.Popen([os.fsencode(sys.executable), b"-c", code.encode(), b"\xff\x1b\r"])
    try:
        assert wait_until(lambda: Path(f"/proc/{proc.pid}/cmdline").read_bytes()
                          .endswith(b"\xff\x1b\r\0"), timeout=5)
        info = ProcessInfoCache().get(proc.pid)
        assert info is not None
        assert info.cmdline == f"{sys.executable} -c {code} \ufffd\x1b\r"
        info.cmdline.encode("utf-8")  # strict: valid UTF-8 for JSON readers
    finally:
        proc.kill()
        proc.wait()


def test_the_metadata_of_processes_gone_is_let_go() -> None:
    """The cache of users and command lines was bounded by a count alone (8,192
    processes); under churn it held the processes gone: `forget_gone` drops them."""
    from offtop.targets import task_start_time

    cache = ProcessInfoCache()
    gone = subprocess.Popen(["sleep", "30"])
    stays = subprocess.Popen(["sleep", "30"])
    try:
        assert cache.get(gone.pid) is not None and cache.get(stays.pid) is not None
        gone.kill()
        gone.wait()
        assert cache.forget_gone(task_start_time) == 1
        assert cache.forget_gone(task_start_time) == 0
    finally:
        for p in (gone, stays):
            p.kill()
            p.wait()


# --- the TUI through Pilot (replay source) ------------------------------------------------------


@pytest.mark.parametrize("typed", ["[/usr]", "[@click=app.quit]x"])
async def test_filter_text_is_shown_literally_not_as_markup(typed: str) -> None:
    app = OfftopApp(fake_source(), clock=FakeClock())
    async with app.run_test(size=SIZE) as pilot:
        await shown(pilot, app)
        await pilot.press("slash", *typed)
        await pilot.pause()
        assert app.is_running and app.return_code is None
        subtitle = Content.from_markup(str(app.query_one("#tasks-pane").border_subtitle)).plain
        assert f"“{typed}”" in subtitle, subtitle
        await pilot.press("escape")
        await pilot.pause()
        assert app.is_running


def hostile_snapshot() -> Snapshot:
    """One interval of a hostile process: every name it controls is an attack."""
    comm = f"{OSC}\r\n"
    return Aggregator().build(
        [Sample(66, 66, comm, "S", 900_000_000, 3, 300_000_000, EVIL_K, EVIL_U),
         Sample(66, 67, "\x1b[2J\x08", "S", 800_000_000, 3, 300_000_000, EVIL_K, EVIL_U)],
        time=1_700_000_000.5, interval_s=1.0, threshold_ns=100_000_000,
        long_blocks=[LongBlock(1_700_000_000.2, 66, 66, comm, "S", 300_000_000, EVIL_K, EVIL_U,
                               0)],
        blocked_now=[BlockedNow(66, 67, "\x1b[2J\x08", "S", 9_000_000, EVIL_K, EVIL_U)],
        stats=CaptureStats(interval_s=1.0),
        process_meta=lambda pid: (f"us{OSC}er", f"/bin/x {OSC} \x1b[2J"),
    )


class RecordingApp(OfftopApp):
    """The app, recording what it notifies (to check what a toast would show)."""

    CSS_PATH = str(Path(app_module.__file__).with_name("app.tcss"))

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.notified: list[str] = []

    def notify(self, message: str, *args: Any, **kwargs: Any) -> None:  # type: ignore[override]
        self.notified.append(message + str(kwargs.get("title", "")))
        super().notify(message, *args, **kwargs)


async def test_tui_shows_hostile_names_escaped_in_every_pane() -> None:
    snap = hostile_snapshot()
    info = SourceInfo(host="h", kernel="k", scope=f"cgroup /sys/fs/cgroup/{OSC}",
                      kind="replay")
    app = OfftopApp(ReplaySource([snap], realtime=False, info=info), clock=FakeClock())
    async with app.run_test(size=SIZE) as pilot:
        await shown(pilot, app)
        assert_shown_escaped(app.query_one(OfftopHeader).render(), f"cgroup /sys/fs/cgroup/{OSC}",
                             lines=True)
        log = app.query_one(LongBlocksLog)
        assert log.lines
        for strip in log.lines:
            assert_shown_escaped(strip.text, f"{OSC}\r\n")
        stacks_title = Content.from_markup(str(app.query_one("#stacks-pane").border_title)).plain
        assert_shown_escaped(stacks_title)
        assert printable(f"{OSC}\r\n") in stacks_title or printable("\x1b[2J\x08") in stacks_title
        # Processes: the title adds the user and the command line.
        await pilot.press("t")
        await pilot.pause()
        title = Content.from_markup(str(app.query_one("#stacks-pane").border_title)).plain
        assert_shown_escaped(title, f"us{OSC}er", f"/bin/x {OSC} \x1b[2J")
        # The callchain tree: its root label (the task) and every frame.
        await pilot.press("enter")
        await pilot.pause()
        tree = app.query_one(CallchainTree)
        assert app.drilled
        labels = [tree.root.label]
        todo = list(tree.root.children)
        while todo:
            node = todo.pop()
            labels.append(node.label)
            todo.extend(node.children)
        assert len(labels) > 3
        for label in labels:
            assert isinstance(label, Text)
            assert_shown_escaped(label)
        joined = " ".join(str(label) for label in labels)
        assert printable(EVIL_U[0].name) in joined and printable("evil\x1b[2J\rk") in joined


class FakeHostileFailure(FakeLiveReplay):
    """A source whose start fails with a message naming a hostile path."""

    def start(self) -> None:
        raise RuntimeError(f"cannot read /tmp/{OSC}[bold]x")


class FakeFailsLater(FakeLiveReplay):
    """A source that fails after one snapshot, with a hostile message."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.served = False

    def next_snapshot(self, interval_s: float, stop: threading.Event) -> Snapshot | None:
        if self.served:
            raise RuntimeError(f"map read failed at /tmp/{OSC}\x1b[2J[bold]x")
        self.served = True
        return super().next_snapshot(interval_s, stop)


async def failed(pilot: Any, app: OfftopApp) -> None:
    """Wait until the app has taken in its source's failure."""
    for _ in range(500):
        if app.source_error is not None:
            break
        await pilot.pause(0.01)
    assert app.source_error is not None
    await pilot.pause()


async def test_source_errors_are_shown_escaped() -> None:
    app = RecordingApp(FakeHostileFailure([], realtime=False), clock=FakeClock())
    async with app.run_test(size=SIZE) as pilot:
        await failed(pilot, app)
        error = str(app.query_one("#error").render()).splitlines()
        assert_shown_escaped(next(line for line in error if "RuntimeError" in line),
                             f"/tmp/{OSC}[bold]x")
    later = RecordingApp(FakeFailsLater([hostile_snapshot()], realtime=False), clock=FakeClock())
    async with later.run_test(size=SIZE) as pilot:
        await shown(pilot, later)
        await failed(pilot, later)
        failure = [n for n in later.notified if "map read failed" in n]
        assert failure, later.notified
        assert_shown_escaped(failure[0], f"/tmp/{OSC}\x1b[2J[bold]x")


# --- the real thing: a hostile helper program, offtop's command line and TUI --------------------

HELPER_C = r"""
/* A hostile process: names itself and a thread NAME (argv[1]), runs its
 * thread's sleeps through a JIT stub named JITNAME (argv[2]) in
 * /tmp/perf-PID.map, and blocks forever in sleeps offtop can see. */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

/* mov eax, SYS_nanosleep; syscall; ret */
static const unsigned char stub[] = {0xb8, SYS_nanosleep, 0, 0, 0, 0x0f, 0x05, 0xc3};
typedef long (*sleeper)(const struct timespec *, struct timespec *);

static const char *name;
static sleeper jit_sleep;
static pthread_barrier_t ready;
static long thread_tid;

static void *thread_main(void *arg)
{
    struct timespec ts = {0, 250 * 1000 * 1000};
    (void)arg;
    prctl(PR_SET_NAME, name, 0, 0, 0);
    thread_tid = syscall(SYS_gettid);
    pthread_barrier_wait(&ready);
    for (;;)
        jit_sleep(&ts, NULL);
    return NULL;
}

int main(int argc, char **argv)
{
    struct timespec ts = {0, 300 * 1000 * 1000};
    char path[64];
    pthread_t t;
    FILE *f;
    void *code;

    if (argc != 3)
        return 2;
    name = argv[1];
    code = mmap(NULL, 4096, PROT_READ | PROT_WRITE | PROT_EXEC,
                MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (code == MAP_FAILED) {
        perror("mmap");
        return 1;
    }
    memcpy(code, stub, sizeof stub);
    jit_sleep = (sleeper)code;
    snprintf(path, sizeof path, "/tmp/perf-%d.map", getpid());
    f = fopen(path, "w");
    if (f == NULL) {
        perror(path);
        return 1;
    }
    fprintf(f, "%lx %zx %s\n", (unsigned long)code, sizeof stub, argv[2]);
    fclose(f);
    prctl(PR_SET_NAME, name, 0, 0, 0);
    pthread_barrier_init(&ready, NULL, 2);
    pthread_create(&t, NULL, thread_main, NULL);
    pthread_barrier_wait(&ready);
    printf("ready pid=%d tid=%ld\n", getpid(), thread_tid);
    fflush(stdout);
    for (;;)
        nanosleep(&ts, NULL);
}
"""


@dataclass(frozen=True)
class Hostile:
    """One running helper: the name it gave itself, its pid and its thread's tid."""

    label: str
    raw: bytes
    binary: bytes
    pid: int
    tid: int

    @property
    def comm(self) -> str:
        """The comm as JSON must hold it."""
        return decoded(self.raw)

    @property
    def cmdline(self) -> str:
        """The command line as JSON must hold it (its arguments joined by spaces)."""
        return " ".join(decoded(a) for a in (self.binary, self.raw, HOSTILE_JIT))


@pytest.fixture(scope="module")
def hostile_bin(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The hostile helper, compiled."""
    cc = shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        pytest.fail("no C compiler: run the README's test command (it installs gcc)")
    d = tmp_path_factory.mktemp("hostile")
    (d / "hostile.c").write_text(HELPER_C)
    subprocess.run([cc, "-O1", "-fno-omit-frame-pointer", "-pthread", "-o", str(d / "hostile"),
                    str(d / "hostile.c")], check=True)
    return d / "hostile"


@pytest.fixture(scope="module")
def hostiles(hostile_bin: Path) -> Iterator[list[Hostile]]:
    """One helper per hostile name, all running for the module's tests."""
    procs: list[subprocess.Popen[bytes]] = []
    out: list[Hostile] = []
    try:
        for label, raw in HOSTILE_COMMS.items():
            p = subprocess.Popen([bytes(hostile_bin), raw, HOSTILE_JIT], stdout=subprocess.PIPE,
                                 start_new_session=True)
            procs.append(p)
            assert p.stdout is not None
            m = re.match(rb"ready pid=(\d+) tid=(\d+)", p.stdout.readline())
            assert m, f"hostile helper {label} did not start"
            out.append(Hostile(label, raw, bytes(hostile_bin), int(m.group(1)), int(m.group(2))))
        yield out
    finally:
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait(timeout=5)
            Path(f"/tmp/perf-{p.pid}.map").unlink(missing_ok=True)


def run_offtop_bytes(*args: str) -> subprocess.CompletedProcess[bytes]:
    """The real command line, output kept as bytes (text mode would turn CR into LF)."""
    return subprocess.run([sys.executable, "-m", "offtop.cli", *args], capture_output=True,
                          timeout=90, cwd=ROOT)


def folded_name(raw: bytes) -> str:
    """A comm as a folded line shows it (';' and ' ' are flamegraph.pl's separators)."""
    return printable(decoded(raw)).replace(";", ":").replace(" ", "_")


@pytest.mark.bpf
@pytest.mark.parametrize("fmt", ["text", "json", "folded"])
@pytest.mark.parametrize("scope", ["system-wide", "pids"])
def test_batch_output_with_hostile_names(bpf_available: None, hostiles: list[Hostile], fmt: str,
                                         scope: str) -> None:
    args = ["--batch", "--format", fmt, "--count", "3", "--interval", "0.5"]
    if scope == "pids":
        args += ["-p", ",".join(str(h.pid) for h in hostiles)]
    r = run_offtop_bytes(*args)
    err = r.stderr.decode(errors="replace")
    assert r.returncode == 0, err
    assert b"Traceback" not in r.stdout and b"Traceback" not in r.stderr, err
    out = r.stdout.decode("utf-8")  # strict: whatever was read, the output is UTF-8
    lines = out.splitlines()
    assert lines

    if fmt == "json":
        snaps = [json.loads(line) for line in lines]
        assert len(snaps) == 3
        for h in hostiles:
            tasks = [t for s in snaps for t in s["tasks"] if t["pid"] == h.pid]
            assert {t["tid"] for t in tasks} == {h.pid, h.tid}, (h.label, tasks)
            assert all(t["comm"] == h.comm for t in tasks), (h.label, tasks)
            procs = [p for s in snaps for p in s["processes"] if p["pid"] == h.pid]
            assert procs and all(p["comm"] == h.comm for p in procs), (h.label, procs)
            assert any(p["cmdline"] == h.cmdline for p in procs), (h.label, procs, h.cmdline)
            stacks = [s for snap in snaps for s in snap["stacks"] if s["pid"] == h.pid]
            assert stacks and all(s["comm"] == h.comm for s in stacks), (h.label, stacks)
            # The thread sleeps in the JIT stub: its perf-map name, exactly.
            assert any(s["user"][:1] == [decoded(HOSTILE_JIT)] for s in stacks
                       if s["tid"] == h.tid), (h.label, stacks)
            blocked = [b for s in snaps for b in s["blocked_now"] if b["pid"] == h.pid]
            assert all(b["comm"] == h.comm for b in blocked), (h.label, blocked)
        return

    # text and folded: nothing a terminal would act on, anywhere.
    for line in lines:
        assert line.isprintable(), repr(line)
    if fmt == "folded":
        for line in lines:
            m = re.fullmatch(r"(\S+) (\d+)", line)
            assert m, repr(line)
            assert all(m.group(1).split(";")), repr(line)
        firsts = {line.split(";", 1)[0] for line in lines}
        for h in hostiles:
            assert folded_name(h.raw) in firsts, (h.label, sorted(firsts))
        if scope == "pids":
            assert firsts <= {folded_name(h.raw) for h in hostiles}, sorted(firsts)
            assert any(folded_name(HOSTILE_JIT) in line for line in lines), lines
    elif scope == "pids":
        for h in hostiles:  # its task rows: PID TID COMM ...
            row = re.compile(rf"^\s*{h.pid}\s+\d+ {re.escape(printable(h.comm))}\s", re.M)
            assert row.search(out), (h.label, out)
        # The text report shows the top 5 stacks: whether the JIT threads' rank
        # there among the main threads' (300 ms blocks against 250 ms, one or
        # two ends in an interval) depends on the phase (CI saw the main
        # threads' alone, once). Watched alone (-t), their stacks are all there
        # is: the JIT name, escaped.
        jit = run_offtop_bytes(*args[:-2], "-t", ",".join(str(h.tid) for h in hostiles))
        assert jit.returncode == 0, jit.stderr
        jit_out = jit.stdout.decode("utf-8")
        assert all(line.isprintable() for line in jit_out.splitlines()), jit_out
        assert printable(decoded(HOSTILE_JIT)) in jit_out, jit_out


@pytest.mark.bpf
def test_tui_in_a_real_terminal_with_hostile_names(bpf_available: None,
                                                   hostiles: list[Hostile]) -> None:
    if shutil.which("tmux") is None:
        pytest.fail("tmux is missing: `make test` installs it")
    tmux = Tmux()
    tmux.run("set-option", "-t", "t", "window-size", "manual")
    # Tall enough for all 14 hostile threads in blocked now, where each name is shown
    # whole (the task table's COMM column cuts the longest escaped name short): at 45
    # rows it held 8, and which 8 depends on how long each had slept at the refresh.
    tmux.run("resize-window", "-t", "t", "-x", "160", "-y", "72")
    title_before = tmux.run("display-message", "-t", "t", "-p", "#{pane_title}").strip()
    pids = ",".join(str(h.pid) for h in hostiles)
    try:
        tmux.type(f"cd {ROOT} && env -u COLUMNS -u LINES {sys.executable} -m offtop.cli "
                  f"-p {pids} --interval 0.5; echo offtop-exit=$?")
        escaped = [printable(h.comm) for h in hostiles]
        assert wait_until(lambda: all(e in tmux.screen() for e in escaped), timeout=20), \
            tmux.screen()
        # Into the tree of the selected task: its frames, the JIT one among them.
        tmux.run("send-keys", "-t", "t", "Enter")
        assert wait_until(lambda: "Callchain of" in tmux.screen(), timeout=5), tmux.screen()
        tmux.run("send-keys", "-t", "t", "Escape")
        # Let several refreshes redraw every hostile name, then look.
        first = re.search(r" #(\d+) ", tmux.screen())
        assert first, tmux.screen()
        assert wait_until(lambda: (m := re.search(r" #(\d+) ", tmux.screen())) is not None
                          and int(m.group(1)) >= int(first.group(1)) + 3, timeout=10)
        # A screen that shows every name: a thread blocked for less than 5 ms at a
        # snapshot is not blocked now (EngineConfig.blocked_min_ns), and the longest
        # escaped name is whole only there (the task table cuts it). The helpers'
        # two threads wake every 300 and 250 ms, in step every 1.5 s, so now and
        # then a snapshot finds both just woken (once in ~13 suite runs).
        shown = [""]

        def every_name() -> bool:
            shown[0] = tmux.screen()
            return all(e in shown[0] for e in escaped)

        assert wait_until(every_name, timeout=10), shown[0]
        screen = shown[0]
        lines = screen.splitlines()
        # Nothing set the terminal's title...
        title = tmux.run("display-message", "-t", "t", "-p", "#{pane_title}").strip()
        assert title == title_before and "PWNED" not in title, title
        # ...nor cleared the screen or moved the cursor back over it: the frame
        # drawn once (header, borders, key bar) is all still there, in place.
        assert lines[0].startswith(" offtop "), screen
        # The header is three lines.
        pane = next(i for i, line in enumerate(lines) if "Threads by off-CPU time" in line)
        assert pane == 3 and lines[pane].startswith("╭"), screen
        assert any(line.startswith("╰") for line in lines[-6:]), screen
        assert "Quit" in lines[-1] or "Quit" in lines[-2], screen
        assert sum(line.startswith(("╭", "│", "╰")) for line in lines) >= 40, screen
        for e in escaped:
            assert e in screen, (e, screen)
        tmux.run("send-keys", "-t", "t", "q")
        assert wait_until(lambda: re.search(r"offtop-exit=\d", tmux.screen()) is not None,
                          timeout=5), tmux.screen()
        assert "offtop-exit=0" in tmux.screen(), tmux.screen()
        assert "Traceback" not in tmux.screen()
    finally:
        tmux.close()
