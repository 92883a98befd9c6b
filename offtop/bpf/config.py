"""What is fixed for a run of the probe, validated before anything is compiled."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from offtop.bpf.decode import DEFAULT_STATES, state_mask


class EngineError(RuntimeError):
    """The engine could not start; the message is one line for users."""


def default_slots(pid_max_path: str = "/proc/sys/kernel/pid_max") -> int:
    """Per-thread record slots (offcpu.c OFFTOP_SLOTS, the slot of a thread is its
    tid modulo this): as many as the tids the kernel hands out (kernel.pid_max,
    up to a power of two), from 4,096 to 65,536. With a slot for every tid no two
    threads ever want one; beyond, a thread takes one of the next slots, or the
    overflow hash. Each slot is 320 bytes of kernel memory, mapped into offtop
    (its RSS): 20 MiB at 65,536 where pid_max is 32,768 left half of them unused."""
    try:
        with open(pid_max_path, "rb") as f:
            pid_max = int(f.read(32))
    except (OSError, ValueError):
        return 65_536
    return min(65_536, max(4_096, 1 << max(0, pid_max - 1).bit_length()))


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Everything fixed for a run; only the threshold changes while running."""

    threshold_ns: int = 500_000_000
    states: str = DEFAULT_STATES
    kthreads: bool = False
    user_stacks: bool = True
    kernel_stacks: bool = True
    pids: tuple[int, ...] = ()
    tids: tuple[int, ...] = ()
    cgroup: str | None = None
    stack_entries: int = 16_384
    #: User stacks get a map of their own size: there are more distinct ones
    #: (20,000 on a busy server), and each entry is ~1 KB of kernel memory.
    ustack_entries: int = 32_768
    start_entries: int = field(default_factory=default_slots)
    agg_entries: int = 65_536
    kstack_depth: int = 48
    ustack_depth: int = 127
    #: Unwinding rules taught to the probe at most, over the processes alive
    #: (offcpu.c unwind_rules holds 65,536; a gone process's are deleted).
    unwind_rules: int = 65_536
    #: Pages of the events' ring per CPU (~120 bytes an event), at most: a machine
    #: with more CPUs gets smaller rings, all of them within `perf_pages_total`
    #: (`perf_ring.ring_pages`), so that their memory does not grow with its CPUs:
    #: 1 MiB a CPU up to 8 CPUs, then 8 MiB in all (64 KiB a CPU at least).
    perf_pages: int = 256
    perf_pages_total: int = 2048
    #: Pages per CPU of the ring new user stacks come through (~150 bytes each, ~5 KiB
    #: with a copy of the stack's top: `stack_copies`), at most, and in all: 256 KiB a
    #: CPU up to 8 CPUs, then 2 MiB (32 KiB at least).
    new_stack_pages: int = 64
    new_stack_pages_total: int = 512
    #: New user stacks per CPU that wake the interval loop between sub-ticks, so that
    #: a new process is seen (its unwinding rules taught) within milliseconds.
    new_stack_wakeup: int = 32
    #: Pages per CPU of the ring the kernel's exec and mapping records come through
    #: (offtop.bpf.sent_maps; ~1 KiB an exec), at most, and in all; 0: none read.
    sent_map_pages: int = 32
    sent_map_pages_total: int = 256
    wakeup_events: int = 64
    subtick_s: float = 0.25
    #: The kernel's sums are read at each snapshot's cut and at most this far
    #: apart, or 1.5 times this: a read due less than half of this before the
    #: cut waits for it. Sub-ticks between those reads resolve the new user
    #: stacks only (while their processes live: `BpfSource._resolve_new_stacks`):
    #: reading every key at each sub-tick was a quarter of offtop's CPU on a
    #: busy server.
    drain_s: float = 1.0
    first_interval_s: float = 0.5
    blocked_min_ns: int = 5_000_000
    blocked_max: int = 200
    long_blocks_max: int = 1_000
    #: Flood control: above this many long-block events a second, the
    #: threshold in the kernel is raised (the blocks are summed there
    #: instead) until the flood passes. 0: never.
    event_budget_per_s: int = 100_000
    #: Symbolizing may take at most this share of each sub-tick.
    symbol_budget_s: float = 0.05
    #: Unwinding blocked threads' user stacks (call-frame information) may take
    #: at most this much of each snapshot; the rest wait for the next one.
    unwind_budget_s: float = 0.05
    #: Python frames of blocked CPython threads (read from their memory, never stopped).
    python_stacks: bool = True
    #: Reading them may take at most this much of each snapshot.
    python_budget_s: float = 0.02
    #: Who wakes each block (sched_waking and the interrupt tracepoints).
    wakers: bool = True
    #: Take a waker's stacks only for blocks at least this long: wakeups are as
    #: frequent as switches, and short blocks rarely need the why.
    waker_stacks_min_ns: int = 1_000_000
    exclude_self: bool = True
    #: A new user stack whose walk ended on a broken rbp chain comes with a copy of
    #: its top 4 KiB, which Python learns all its unwinding rules from at once
    #: (offcpu.c copy_stack); without, each walk of it reveals one frame more.
    stack_copies: bool = True
    scope: str = field(default="", compare=False)

    def cflags(self) -> list[str]:
        """The -D flags for offcpu.c: validated integers only, never user text."""
        ints = {
            "OFFTOP_STATE_MASK": state_mask(self.states),
            "OFFTOP_KTHREADS": int(self.kthreads),
            "OFFTOP_USER_STACKS": int(self.user_stacks),
            "OFFTOP_KERNEL_STACKS": int(self.kernel_stacks),
            "OFFTOP_FILTER_PID": int(bool(self.pids or self.tids)),
            "OFFTOP_FILTER_TID": int(bool(self.pids or self.tids)),
            "OFFTOP_FILTER_CGROUP": int(self.cgroup is not None),
            "OFFTOP_SELF_TGID": os.getpid() if self.exclude_self else 0,
            "OFFTOP_STACK_ENTRIES": self.stack_entries,
            "OFFTOP_USTACK_ENTRIES": self.ustack_entries,
            "OFFTOP_SLOTS": self.start_entries,
            "OFFTOP_AGG_ENTRIES": self.agg_entries,
            "OFFTOP_KSTACK_DEPTH": self.kstack_depth,
            "OFFTOP_USTACK_DEPTH": self.ustack_depth,
            "OFFTOP_WAKERS": int(self.wakers),
            "OFFTOP_STACK_COPIES": int(self.stack_copies),
        }
        for name, v in ints.items():
            if not isinstance(v, int) or isinstance(v, bool) or v < 0 or v > 1 << 24:
                raise ValueError(f"{name}={v!r} is not a valid setting")
        if self.start_entries % 8:  # offcpu_touched: a byte per slot, in u64 words
            raise ValueError(f"OFFTOP_SLOTS={self.start_entries!r} is not a multiple of 8")
        return [f"-D{k}={v}" for k, v in ints.items()]

    @property
    def stack_mode(self) -> str:
        """A short label: kernel+user, kernel, user or none."""
        parts = [n for n, on in (("kernel", self.kernel_stacks), ("user", self.user_stacks)) if on]
        return "+".join(parts) or "no stacks"
