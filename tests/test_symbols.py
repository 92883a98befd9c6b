"""Unit tests of symbol resolution: kallsyms, tracer frames, per-process caches."""

from __future__ import annotations

import ctypes as ct
from pathlib import Path
from typing import Any

from offtop.model import Frame
from offtop.symbols import KernelSymbols, UserSymbols, strip_tracer_frames


def test_kallsyms_bisects_and_strips_tracer_frames(tmp_path: Path) -> None:
    ks = tmp_path / "kallsyms"
    ks.write_text(
        "ffffffff81000100 T bpf_prog_abc_tp\n"
        "ffffffff81000000 T schedule\n"
        "ffffffff81000200 t do_nanosleep\n"
        "ffffffff81000300 d some_data\n"
    )
    k = KernelSymbols(str(ks))
    assert k.resolve(0xFFFFFFFF81000010).name == "schedule"
    assert k.resolve(0xFFFFFFFF81000310).name == "do_nanosleep"  # data symbols are skipped
    frames = k.resolve_stack([0xFFFFFFFF81000110, 0xFFFFFFFF81000010, 0xFFFFFFFF81000210])
    assert [f.name for f in frames] == ["schedule", "do_nanosleep"]
    assert all(f.kernel for f in frames)


def test_tracer_frames_only_stripped_from_the_innermost_end() -> None:
    fs = [Frame("perf_trace_sched_switch"), Frame("__schedule"), Frame("bpf_prog_x")]
    assert [f.name for f in strip_tracer_frames(fs)] == ["__schedule", "bpf_prog_x"]


class FakeBcc:
    """A fake of bcc's symcache calls (UI-free unit test: no kernel involved)."""

    def __init__(self, table: dict[tuple[int, int], tuple[bytes, bytes]]) -> None:
        self.table = table  # (cache id, addr) -> (name, module)
        self.opened: list[int] = []
        self.freed: list[int] = []
        self.next = 1

    def bcc_symcache_new(self, pid: int, opts: Any) -> int:
        self.opened.append(pid)
        self.next += 1
        return self.next

    def bcc_symcache_resolve(self, cache: int, addr: Any, sym: Any) -> int:
        entry = self.table.get((cache, addr.value))
        if entry is None:
            return -1
        name, module = entry
        sym = sym._obj
        sym.name = name
        sym.module = ct.cast(ct.c_char_p(module), ct.POINTER(ct.c_char))
        self._keep = module
        return 0

    def bcc_free_symcache(self, cache: int, pid: int) -> None:
        self.freed.append(pid)


def test_user_symbols_never_cross_a_reused_pid() -> None:
    starts = {42: 1000}
    clock = [0.0]
    fake = FakeBcc({(2, 0x10): (b"old_fn", b"/bin/old"), (3, 0x10): (b"new_fn", b"/bin/new")})
    u = UserSymbols(fake, clock=lambda: clock[0], start_time=starts.get, grace_s=5)
    assert [f.name for f in u.resolve_stack(42, [0x10])] == ["old_fn"]
    assert u.resolve_stack(42, [0x10])[0].module == "old"
    starts[42] = 2000  # the pid now belongs to a new process
    assert [f.name for f in u.resolve_stack(42, [0x10])] == ["new_fn"]
    assert fake.freed == [42]


def test_user_symbols_degrade_and_evict_dead_processes() -> None:
    starts: dict[int, int] = {7: 1}
    clock = [0.0]
    fake = FakeBcc({(2, 0x10): (b"fn", b"/bin/x")})
    u = UserSymbols(fake, clock=lambda: clock[0], start_time=starts.get, grace_s=5)
    assert u.resolve_stack(7, [0x10, 0x20])[1].name == "0x20"  # unresolvable address
    del starts[7]  # the process exits
    assert u.resolve_stack(7, [0x10])[0].name == "fn"  # resolved while alive: kept
    assert u.resolve_stack(7, [0x30])[0].name == "0x30"  # new address after death: degraded
    clock[0] = 10.0
    assert u.evict() == 1 and u.cached_processes == 0
    assert u.resolve_stack(99, [0x10])[0].name == "0x10"  # never seen alive
    assert u.misses >= 3
