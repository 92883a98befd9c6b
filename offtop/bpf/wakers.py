"""Who woke a block, as the model says it: a task, or what an interrupt was doing.

The probe records the waking task's ids, name and stacks, or, for a wakeup
in an interrupt, only that and the interrupt's kernel stack (offcpu.c,
waking_context). What kind of interrupt it was is read off that stack here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from offtop.bpf.decode import WAKER_KINDS, decode_comm
from offtop.model import Frame, Waker
from offtop.recent import Recent

#: A raw waker as the probe keeps it: (tgid, tid, ustack id, kstack id, what, comm bytes).
RawWaker = tuple[int, int, int, int, int, bytes]

#: A softirq's handler, for naming the work an interrupt did (include/linux/interrupt.h).
_SOFTIRQ_WORK = {"run_timer_softirq": "TIMER", "net_rx_action": "NET_RX",
                 "net_tx_action": "NET_TX", "blk_done_softirq": "BLOCK", "rcu_core": "RCU",
                 "tasklet_action": "TASKLET", "tasklet_hi_action": "HI",
                 "hrtimer_run_softirq": "HRTIMER", "run_rebalance_domains": "SCHED",
                 "irq_poll_softirq": "IRQ_POLL"}


def interrupt_kind(kernel: tuple[Frame, ...]) -> tuple[str, str]:
    """What an interrupt that woke a task was, from its kernel stack: (kind, work).

    kind: "timer", "softirq" (work: its vector's name), "irq", or "interrupt"
    when the stack was not taken or says nothing known.
    """
    names = [f.name for f in kernel]
    for n in names:
        work = _SOFTIRQ_WORK.get(n)
        if work is not None:
            return "softirq", work
    if any(n.startswith(("hrtimer_", "__hrtimer_")) or "apic_timer" in n for n in names):
        return "timer", ""
    if any("softirq" in n for n in names):
        return "softirq", ""
    if any(n.startswith(("handle_irq_event", "__handle_irq_event")) for n in names):
        return "irq", ""
    return "interrupt", ""


def interrupt_path(kernel: tuple[Frame, ...]) -> tuple[Frame, ...]:
    """An interrupt's kernel stack up to its entry (`asm_sysvec_apic_timer_interrupt`, ...):
    below it is whatever the interrupt happened to stop, which says nothing of the
    wakeup and would make each timer expiry a waker of its own."""
    for i, f in enumerate(kernel):
        if f.name.startswith("asm_"):
            return kernel[: i + 1]
    return kernel


class Wakers:
    """Turns raw wakers into the model's, one object per distinct waker (cached).

    `kernel(sid)` and `user(pid, sid)` resolve the stack ids.
    """

    def __init__(self, kernel: Callable[[int], tuple[Frame, ...]],
                 user: Callable[[int, int], tuple[Frame, ...]], *, max_kept: int = 50_000) -> None:
        self._kernel = kernel
        self._user = user
        # Keyed by the frame tuples' identity (the stack store hands out the
        # same tuples for the same stack: hashing their frames at every row
        # was most of this); the value holds them, so an id is never reused
        # while it is a key.
        self._cache: Recent[tuple[Any, ...], tuple[Waker, tuple[Frame, ...], tuple[Frame, ...]]] = \
            Recent(max_kept)

    def __len__(self) -> int:
        return len(self._cache)

    def next_interval(self) -> None:
        """Wakers not asked for since the last call are forgotten at the next: those
        of processes gone, and interrupts' stacks through code they no longer stop,
        would pile up (~120 a second on a busy server)."""
        self._cache.rotate()

    def waker(self, raw: RawWaker) -> Waker | None:
        """The model's waker of a raw one (None: the probe saw none)."""
        tgid, tid, us, ks, what, comm = raw
        kind = WAKER_KINDS.get(what >> 24, "")
        if not kind:
            return None
        kernel = self._kernel(ks)
        user = self._user(tgid, us) if kind == "task" and us >= 0 else ()
        key = (tgid, tid, what, comm, id(kernel), id(user))
        hit = self._cache.get(key)
        if hit is not None and hit[1] is kernel and hit[2] is user:
            return hit[0]
        if kind != "task":
            kind, work = interrupt_kind(kernel)
            w = Waker(0, 0, work, kind, interrupt_path(kernel))
        else:
            w = Waker(tgid, tid, decode_comm(comm), kind, kernel, user)
        self._cache.put(key, (w, kernel, user))
        return w
