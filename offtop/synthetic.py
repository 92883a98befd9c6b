"""Deterministic synthetic snapshots, for UI tests, demos and the UI benchmark.

The data looks like a busy server: a database, a web server, a JVM (with
an unresolved frame), a Python program (with Python frames, `py:`), a few
daemons and one process whose name contains markup-like brackets (process
names are untrusted and must be shown literally). It has what a real
capture has too: a task blocked since before offtop started, counted
errors, offtop's own cost, and a notice. Everything is derived from a
seeded `random.Random`, and times are fixed, so the same arguments always
give the same snapshots: snapshot tests depend on it.

With `wakers`, every block says who ended it, as a capture with wakers
does: the timer interrupt for sleeps, a sibling thread for futexes and page
faults, a task of another process for pipes, network softirqs for sockets
and polls, a device interrupt for reads from disk and a kernel thread (one
offtop never lists: it spends no time off the CPU here) for fsync; a tenth
of the pipe waits' time has no waker seen. The wakers take no draw from the
seeded generator: with or without them the same arguments give the same
times (a stack's time split between its wakers).

Stacks follow the model's conventions: `kernel[0]` and `user[0]` are the
innermost frames (where the task stopped), the last entries the outermost.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from offtop.model import (
    Aggregator,
    BlockedNow,
    CaptureStats,
    Frame,
    LongBlock,
    Sample,
    Snapshot,
    Waker,
)

#: Kernel callchains (innermost first) and the state a task waits in there.
_KERNEL_CHAINS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("S", ("schedule", "do_nanosleep", "hrtimer_nanosleep", "__x64_sys_clock_nanosleep",
           "do_syscall_64", "entry_SYSCALL_64_after_hwframe")),
    ("S", ("schedule", "futex_wait_queue", "futex_wait", "do_futex", "__x64_sys_futex",
           "do_syscall_64", "entry_SYSCALL_64_after_hwframe")),
    ("S", ("schedule", "pipe_read", "vfs_read", "ksys_read", "do_syscall_64",
           "entry_SYSCALL_64_after_hwframe")),
    ("S", ("schedule", "schedule_hrtimeout_range_clock", "ep_poll", "do_epoll_wait",
           "__x64_sys_epoll_wait", "do_syscall_64", "entry_SYSCALL_64_after_hwframe")),
    ("D", ("schedule", "io_schedule", "folio_wait_bit_common", "filemap_read",
           "ext4_file_read_iter", "vfs_read", "__x64_sys_pread64", "do_syscall_64",
           "entry_SYSCALL_64_after_hwframe")),
    ("D", ("schedule", "io_schedule", "bit_wait_io", "__wait_on_bit", "jbd2_log_wait_commit",
           "ext4_sync_file", "__x64_sys_fsync", "do_syscall_64",
           "entry_SYSCALL_64_after_hwframe")),
    ("S", ("schedule", "schedule_timeout", "wait_woken", "sk_wait_data", "tcp_recvmsg",
           "sock_recvmsg", "__sys_recvfrom", "do_syscall_64", "entry_SYSCALL_64_after_hwframe")),
    ("D", ("schedule", "rwsem_down_read_slowpath", "down_read", "do_user_addr_fault",
           "exc_page_fault", "asm_exc_page_fault")),
)

#: The libc entry a kernel chain above is reached from (innermost user frame).
_LIBC_ENTRY = ("clock_nanosleep", "pthread_cond_wait", "read", "epoll_wait", "pread64",
               "fsync", "recv", "memcpy")


@dataclass(frozen=True, slots=True)
class _Program:
    comm: str
    binary: str
    threads: tuple[str, ...]
    loops: tuple[str, ...]
    #: Frames between the libc entry and the loop: Python functions, or a
    #: frame that could not be resolved.
    inner: tuple[tuple[str, str], ...] = ()


_PROGRAMS: tuple[_Program, ...] = (
    _Program("postgres", "postgres", ("postgres",),
             ("WaitEventSetWait", "WalWriterMain", "BackgroundWriterMain", "PostgresMain",
              "XLogFlush", "mdread")),
    _Program("nginx", "nginx", ("nginx",),
             ("ngx_epoll_process_events", "ngx_process_events_and_timers",
              "ngx_worker_process_cycle")),
    _Program("java", "libjvm.so", ("java", "GC Thread#0", "C2 CompilerThre", "VM Thread",
                                   "http-nio-8080-e", "Finalizer"),
             ("Monitor::wait", "Parker::park", "ObjectMonitor::wait", "JavaThread::run",
              "SafepointSynchronize::block"),
             (("libjvm.so+0x4f2a10", "libjvm.so"),)),
    _Program("redis-server", "redis-server", ("redis-server", "bio_close_file", "bio_aof"),
             ("aeProcessEvents", "aeMain", "bioProcessBackgroundJobs")),
    _Program("python3", "python3.11", ("python3",),
             ("time_sleep", "_PyEval_EvalFrameDefault", "PyRun_SimpleFileExFlags"),
             (("py:Queue.get (queue.py:171)", "/usr/lib/python3.11/queue.py"),
              ("py:worker (app.py:42)", "/srv/app.py"))),
    _Program("sshd", "sshd", ("sshd",), ("server_loop2", "do_authenticated")),
    _Program("evil[red]comm", "evil", ("evil[red]comm",),
             ("worker_loop", "handle[bold]request", "main")),
    _Program("containerd", "containerd", ("containerd", "containerd-shim"),
             ("runtime.futex", "runtime.notesleep", "runtime.mPark", "runtime.schedule")),
)


@dataclass(frozen=True, slots=True)
class _Stack:
    state: str
    kernel: tuple[Frame, ...]
    user: tuple[Frame, ...]
    weight: float


@dataclass(frozen=True, slots=True)
class _Task:
    pid: int
    tid: int
    comm: str
    stacks: tuple[_Stack, ...]
    busy: float  # fraction of the interval this task tends to spend off-CPU
    flaky: bool  # skips an interval now and then (no off-CPU time to report)


def _kernel_frames(names: tuple[str, ...]) -> tuple[Frame, ...]:
    return tuple(Frame(name=n, module="kernel", kernel=True) for n in names)


def _build_tasks(rng: random.Random, tasks: int, stacks: int) -> list[_Task]:
    """Threads grouped into processes, each with its own set of stacks."""
    out: list[_Task] = []
    pid = 1000
    per_task = max(1, stacks // max(1, tasks))
    extra = max(0, stacks - per_task * tasks)
    i = 0
    while len(out) < tasks:
        prog = _PROGRAMS[i % len(_PROGRAMS)]
        i += 1
        pid += rng.randint(3, 97)
        nthreads = min(tasks - len(out), 1 if len(prog.threads) == 1 and rng.random() < 0.6
                       else rng.randint(2, 12))
        for t in range(nthreads):
            tid = pid if t == 0 else pid + t
            comm = prog.threads[t % len(prog.threads)]
            n = per_task + (1 if extra > 0 else 0)
            extra -= 1 if extra > 0 else 0
            task_stacks: list[_Stack] = []
            for s in range(n):
                chain = rng.randrange(len(_KERNEL_CHAINS))
                state, knames = _KERNEL_CHAINS[chain]
                loop = prog.loops[(s + t) % len(prog.loops)]
                outer = ["_start", "__libc_start_main", "main"] if t == 0 else [
                    "clone3", "start_thread"]
                middle = [loop] if s < len(prog.loops) else [loop, f"{loop}_step{s}"]
                user_names = [_LIBC_ENTRY[chain], *reversed(middle), *reversed(outer)]
                user = tuple(
                    Frame(name=u, module="libc.so.6" if k == 0 else prog.binary)
                    for k, u in enumerate(user_names)
                )
                inner = tuple(Frame(name=n, module=m) for n, m in prog.inner)
                user = (*user[:1], *inner, *user[1:])
                task_stacks.append(
                    _Stack(state=state, kernel=_kernel_frames(knames), user=user,
                           weight=rng.paretovariate(1.2))
                )
            out.append(
                _Task(pid=pid, tid=tid, comm=comm, stacks=tuple(task_stacks),
                      busy=min(0.97, 0.05 + rng.random() ** 2), flaky=rng.random() < 0.05)
            )
        pid += nthreads
    return out


def _kernel_waker(kind: str, comm: str, names: tuple[str, ...]) -> Waker:
    return Waker(0, 0, comm, kind, _kernel_frames(names))


_TIMER = _kernel_waker("timer", "", ("hrtimer_wakeup", "__hrtimer_run_queues",
                                     "hrtimer_interrupt", "__sysvec_apic_timer_interrupt",
                                     "sysvec_apic_timer_interrupt"))
_NET_RX = _kernel_waker("softirq", "NET_RX", (
    "sock_def_readable", "tcp_data_queue", "tcp_rcv_established", "tcp_v4_do_rcv",
    "ip_local_deliver_finish", "__netif_receive_skb_one_core", "net_rx_action",
    "__do_softirq"))
_DISK = _kernel_waker("irq", "", ("folio_end_read", "blk_update_request", "blk_mq_end_request",
                                  "nvme_irq", "__handle_irq_event_percpu", "handle_irq_event"))
_JBD2 = Waker(412, 412, "jbd2/sda1-8", "task", _kernel_frames((
    "__wake_up_common", "__wake_up", "jbd2_journal_commit_transaction", "kjournald2",
    "kthread", "ret_from_fork")))

#: The kernel frames a task wakes another from, for each chain of `_KERNEL_CHAINS`
#: that a task (not an interrupt) ends.
_WAKE_FRAMES = {
    1: ("wake_up_q", "futex_wake", "do_futex", "__x64_sys_futex", "do_syscall_64"),
    2: ("__wake_up_common", "__wake_up_sync_key", "pipe_write", "vfs_write", "ksys_write",
        "do_syscall_64"),
    7: ("rwsem_wake", "up_read", "do_user_addr_fault", "exc_page_fault"),
}


def _task_waker(task: _Task, chain: int) -> Waker:
    user = (Frame("write" if chain == 2 else "__lll_unlock_wake", "libc.so.6"),
            *(task.stacks[0].user[1:] if task.stacks else ()))
    return Waker(task.pid, task.tid, task.comm, "task", _kernel_frames(_WAKE_FRAMES[chain]),
                 user)


def _wakers_of(model: list[_Task], i: int, chain: int) -> tuple[tuple[Waker | None, int], ...]:
    """Who ends the blocks of `model[i]` in `chain`, each with its tenths of the time."""
    task = model[i]
    if chain in (1, 7):  # a sibling thread, else the one before in the list
        sibling = next((t for t in model if t.pid == task.pid and t.tid != task.tid),
                       model[i - 1])
        return ((_task_waker(sibling, chain), 8), (_TIMER, 2))
    if chain == 2:  # a task of another process; a tenth not seen
        other = next(t for t in model[i + 1:] + model[:i] if t.pid != task.pid)
        return ((_task_waker(other, chain), 9), (None, 1))
    if chain in (3, 6):
        return ((_NET_RX, 7), (_TIMER, 3))
    if chain == 4:
        return ((_DISK, 10),)
    if chain == 5:
        return ((_JBD2, 10),)
    return ((_TIMER, 10),)


def synthetic_snapshots(
    n: int,
    *,
    tasks: int = 50,
    stacks: int = 200,
    seed: int = 0,
    start_time: float = 1_700_000_000.0,
    interval_s: float = 1.0,
    threshold_ns: int = 100_000_000,
    wakers: bool = False,
) -> list[Snapshot]:
    """`n` consecutive snapshots of a plausible busy machine, fully deterministic.

    `tasks` threads share `stacks` distinct callchains; rankings shift a little
    from one snapshot to the next (so re-sorting can be seen), a few blocks per
    interval exceed `threshold_ns` and show up as long blocks, and a handful of
    tasks are blocked right now, their waits growing from snapshot to snapshot.
    With `wakers`, each block says who ended it (see module docstring).
    """
    rng = random.Random(seed)
    model = _build_tasks(rng, tasks, stacks)
    # Which of `_KERNEL_CHAINS` each stack blocks in (its wakers depend on it).
    chain_of = {_kernel_frames(names): c for c, (_, names) in enumerate(_KERNEL_CHAINS)}
    place = {id(t): i for i, t in enumerate(model)}
    known: dict[tuple[int, int], tuple[tuple[Waker | None, int], ...]] = {}

    def who_wakes(task: _Task, stack: _Stack) -> tuple[tuple[Waker | None, int], ...]:
        key = (place[id(task)], chain_of[stack.kernel])
        found = known.get(key)
        if found is None:
            found = known[key] = _wakers_of(model, *key)
        return found
    agg = Aggregator(max_stacks=max(20_000, stacks))
    # Tasks blocked right now, with the stack they are blocked in: D waits first.
    stuck: list[tuple[_Task, _Stack]] = []
    for want in ("D", "S"):
        for t in model:
            s = next((s for s in t.stacks if s.state == want), None)
            seen = {task.comm for task, _ in stuck}
            if s is not None and t.comm not in seen and len(stuck) < (2 if want == "D" else 5):
                stuck.append((t, s))
    # Every process's user and command line (as psutil would give them).
    meta = {t.pid: ("root" if t.comm != "postgres" else "postgres",
                    f"/usr/bin/{t.comm} --workers 8 --config /etc/{t.comm}.conf")
            for t in model if t.tid == t.pid}
    snaps: list[Snapshot] = []
    interval_ns = int(interval_s * 1e9)
    for i in range(n):
        now = start_time + (i + 1) * interval_s
        samples: list[Sample] = []
        long_blocks: list[LongBlock] = []
        for task in model:
            # Most tasks show up in most intervals; a few skip one now and then.
            if task.flaky and rng.random() < 0.5:
                continue
            budget = min(interval_ns * task.busy * (0.7 + 0.6 * rng.random()), 0.99 * interval_ns)
            total_w = sum(s.weight for s in task.stacks)
            for s in task.stacks:
                ns = int(budget * s.weight / total_w)
                if ns <= 0:
                    continue
                count = max(1, int(ns / rng.choice((50_000, 400_000, 2_000_000, 20_000_000))))
                max_ns = min(ns, int(ns / count * (1.0 + 3.0 * rng.random())))
                sample = Sample(pid=task.pid, tid=task.tid, comm=task.comm, state=s.state,
                                offcpu_ns=ns, count=count, max_ns=max(max_ns, 1),
                                kernel=s.kernel, user=s.user)
                if not wakers:
                    samples.append(sample)
                    continue
                parts = who_wakes(task, s)
                if count < len(parts):  # one block: one waker
                    parts = ((parts[0][0], 10),)
                left_ns, left_count = ns, count
                for j, (waker, tenths) in enumerate(parts):
                    last = j == len(parts) - 1
                    part_ns = left_ns if last else ns * tenths // 10
                    part_count = left_count if last else max(1, count * tenths // 10)
                    left_ns, left_count = left_ns - part_ns, left_count - part_count
                    if part_ns > 0:
                        samples.append(Sample(task.pid, task.tid, task.comm, s.state, part_ns,
                                              part_count, min(sample.max_ns, part_ns),
                                              s.kernel, s.user, waker=waker))
        for k in range(1 + rng.randrange(3)):
            task = model[rng.randrange(len(model))]
            if not task.stacks:
                continue
            s = task.stacks[rng.randrange(len(task.stacks))]
            dur = int(threshold_ns * (1.0 + 9.0 * rng.random() ** 3))
            long_blocks.append(
                LongBlock(time=now - interval_s + (k + 1) * interval_s / 4, pid=task.pid,
                          tid=task.tid, comm=task.comm, state=s.state, duration_ns=dur,
                          kernel=s.kernel, user=s.user, cgroup_id=4242,
                          before_start=i == 0 and k == 0,
                          waker=who_wakes(task, s)[0][0] if wakers else None)
            )
        blocked = [
            BlockedNow(pid=t.pid, tid=t.tid, comm=t.comm, state=s.state,
                       blocked_ns=int(interval_ns * (i + 1) * (1.7 if j == 0 else 1) / (j + 1)
                                      + 3_100_000 * j),
                       kernel=s.kernel, user=s.user, before_start=j == 0)
            for j, (t, s) in enumerate(stuck)
        ]
        runs = 20_000 + rng.randrange(5_000)
        stats = CaptureStats(
            events=len(long_blocks),
            lost=1 if i == 2 else 0,
            events_total=0,
            lost_total=1 if i >= 2 else 0,
            stack_errors={"EEXIST": 2} if i % 2 else {},
            truncated_stacks=2,
            depth_limited_stacks=1,
            user_stacks_lost=i,
            symbol_misses=3,
            symbol_errors={"bad ELF": 1},
            agg_entries=len(samples),
            stacks_used=min(stacks, 16_384),
            stacks_capacity=16_384,
            probe_run_ns=runs * (280 + rng.randrange(60)),
            probe_runs=runs,
            interval_s=interval_s,
            offtop_cpu_pct=1.5 + rng.random(),
            offtop_rss_bytes=(80 + i) << 20,
        )
        snaps.append(
            agg.build(samples, time=now, interval_s=interval_s, threshold_ns=threshold_ns,
                      long_blocks=long_blocks, blocked_now=blocked, stats=stats,
                      process_meta=meta.get, notices=("pid 4321 exited",) if i == 1 else ())
        )
    return snaps
