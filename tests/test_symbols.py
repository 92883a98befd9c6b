"""Unit tests of symbol resolution: kallsyms, tracer frames, per-process caches."""

from __future__ import annotations

from pathlib import Path

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


def test_user_symbols_resolve_this_process_through_its_maps_and_elf() -> None:
    import ctypes
    import os

    libc = ctypes.CDLL("libc.so.6")
    getpid = ctypes.cast(libc.getpid, ctypes.c_void_p).value
    assert getpid
    u = UserSymbols()
    frames = u.resolve_stack(os.getpid(), [getpid + 1, 0x10])
    assert frames[0].name in ("getpid", "__getpid") and frames[0].module == "libc.so.6"
    assert frames[1].name == "0x10" and frames[1].unknown  # in no mapping
    assert u.misses == 1


def test_read_maps_keeps_executable_file_mappings(tmp_path: Path) -> None:
    from offtop.symbols import read_maps

    (tmp_path / "77").mkdir()
    (tmp_path / "77" / "maps").write_text(
        "55d0a000-55d0b000 r--p 00000000 fe:00 12 /usr/bin/app\n"
        "55d0b000-55d0c000 r-xp 00001000 fe:00 12 /usr/bin/app\n"
        "7f00000-7f01000 r-xp 00000000 00:00 0 [vdso]\n"
        "7f10000-7f11000 r-xp 00002000 fe:00 13 /tmp/gone (deleted)\n"
    )
    maps = read_maps(77, proc=str(tmp_path))
    assert [(m.start, m.offset, m.module) for m in maps] == [
        (0x7F10000, 0x2000, "gone"), (0x55D0B000, 0x1000, "app")]
    assert maps[1].handle == f"{tmp_path}/77/map_files/55d0b000-55d0c000"
