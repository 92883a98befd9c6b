"""The loader: artifacts checked on read, a cache that trusts only root's files, maps by fd,
and offcpu.c loaded, attached and detached without bcc in the process.

Unit tests need nothing; the cache's trust checks need root (files are
given away to another owner); the rest loads real BPF (`bpf` marker).
"""

from __future__ import annotations

import base64
import errno
import json
import os
import struct
import subprocess
import sys
import threading
from collections.abc import Iterator, Mapping
from dataclasses import replace
from importlib import resources
from pathlib import Path
from typing import Any

import pytest

from offtop.bpf import maps
from offtop.bpf.config import EngineConfig, EngineError
from offtop.bpf.loader import cache as cache_mod
from offtop.bpf.loader import compiler
from offtop.bpf.loader.artifact import (
    FORMAT,
    PROG_TYPE_TRACEPOINT,
    Artifact,
    ArtifactInvalid,
    CompilerId,
    Constant,
    Program,
    decode,
    encode,
    patched,
)
from offtop.bpf.loader.cache import ArtifactCache, cache_key
from offtop.bpf.loader.compiler import ConstantNotFound, artifact_from_module
from offtop.bpf.loader.load import COMPILE_FLAGS, PLACEHOLDERS, split_constants
from offtop.bpf.maps import BpfMap, MapSpec
from tests.conftest import wait_until

ROOT = Path(__file__).resolve().parent.parent
KEY = "ab" * 32
NOBODY = 65534
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="trust checks need root")


# --- hand-made instructions -----------------------------------------------------------


def insn(code: int, dst: int = 0, src: int = 0, off: int = 0, imm: int = 0) -> bytes:
    return struct.pack("<BBhi", code, src << 4 | dst, off, imm)


def ld_map(dst: int, fd: int, src: int = 1) -> bytes:
    """ld_imm64 dst, map fd: two slots."""
    return insn(0x18, dst, src, 0, fd) + insn(0, 0, 0, 0, 0)


MOV_R0_0 = insn(0xB7, 0, 0, 0, 0)   # r0 = 0
EXIT = insn(0x95)
JEQ_R1 = 0x15                        # if r1 == imm goto +off


def tiny_artifact(*, key: str = KEY, map_type: int = maps.ARRAY, flags: int = 0,
                  constant: bool = False) -> Artifact:
    """A map reference, optionally a compare against a placeholder, return 0."""
    code = ld_map(1, 0) + MOV_R0_0
    sites: tuple[tuple[int, int], ...] = ()
    if constant:
        code += insn(JEQ_R1, 1, 0, 0, PLACEHOLDERS["OFFTOP_SELF_TGID"])
        sites = ((0, 3),)
    code += EXIT
    return Artifact(
        key=key, license="GPL", kern_version=0,
        compiler=CompilerId("0.26.0", "/nonexistent/libbcc.so.0", 1, 2),
        maps=(MapSpec("cfg", map_type, 4, 8, 4, flags),),
        programs=(Program("tracepoint__sched__sched_switch", PROG_TYPE_TRACEPOINT, code,
                          ((0, 0),)),),
        constants=(Constant("OFFTOP_SELF_TGID", PLACEHOLDERS["OFFTOP_SELF_TGID"], sites),)
        if constant else (),
    )


def rewrite_body(data: bytes, edit: Any) -> bytes:
    """An artifact file with its body changed by `edit` and the header's hash made to fit."""
    import hashlib

    header, _, body = data.partition(b"\n")
    doc = json.loads(body)
    edit(doc)
    new = json.dumps(doc).encode()
    parts = header.split(b" ")
    parts[3] = hashlib.sha256(new).hexdigest().encode()
    return b" ".join(parts) + b"\n" + new


# --- the artifact format ----------------------------------------------------------------


def test_artifact_round_trip() -> None:
    a = tiny_artifact(constant=True)
    assert decode(encode(a), KEY) == a


@pytest.mark.parametrize("damage", ["flip", "cut", "key", "format", "magic"])
def test_damaged_artifact_is_refused(damage: str) -> None:
    data = encode(tiny_artifact())
    if damage == "flip":
        data = data[:-5] + bytes([data[-5] ^ 1]) + data[-4:]
    elif damage == "cut":
        data = data[:-10]
    elif damage == "key":
        data = data.replace(KEY.encode(), b"cd" * 32, 1)
    elif damage == "format":
        data = data.replace(b" %d " % FORMAT, b" 999 ", 1)
    else:
        data = b"x" + data
    with pytest.raises(ArtifactInvalid):
        decode(data, KEY)


def test_artifact_for_another_key_is_refused() -> None:
    with pytest.raises(ArtifactInvalid, match="another key"):
        decode(encode(tiny_artifact()), "cd" * 32)


@pytest.mark.parametrize(("edit", "why"), [
    (lambda d: d["maps"][0].update(type=31337), "unknown"),
    (lambda d: d["maps"][0].update(flags=1 << 20), "unknown"),
    (lambda d: d["maps"][0].update(key_size=0), "key_size"),
    (lambda d: d["programs"][0].update(type=1), "is not of type 5"),
    # A program's type follows from its name: an iterator is only ever `bpf_iter__*`.
    (lambda d: d["programs"][0].update(type=26), "is not of type 5"),
    (lambda d: d["programs"][0].update(name="bpf_iter__task"), "is not of type 26"),
    (lambda d: d["programs"][0].update(map_refs=[]), "map references"),
    (lambda d: d["programs"][0].update(map_refs=[[0, 5]]), "bad entry"),
    (lambda d: d["programs"][0].update(insns="!!"), "base64"),
    (lambda d: d["programs"][0].update(name="a/b"), "valid name"),
    (lambda d: d.update(license=7), "license"),
])
def test_bad_fields_are_refused(edit: Any, why: str) -> None:
    data = rewrite_body(encode(tiny_artifact()), edit)
    with pytest.raises(ArtifactInvalid, match=why):
        decode(data, KEY)


def test_unlisted_or_unknown_relocations_are_refused() -> None:
    """An unpatched map reference would hand the kernel one of offtop's fds by number."""
    two_refs = ld_map(1, 0) + ld_map(2, 0) + MOV_R0_0 + EXIT
    b64 = base64.b64encode(two_refs).decode()
    data = rewrite_body(encode(tiny_artifact()),
                        lambda d: d["programs"][0].update(insns=b64, map_refs=[[0, 0]]))
    with pytest.raises(ArtifactInvalid, match="map references"):
        decode(data, KEY)
    value_ref = base64.b64encode(ld_map(1, 0, src=2) + MOV_R0_0 + EXIT).decode()
    data = rewrite_body(encode(tiny_artifact()),
                        lambda d: d["programs"][0].update(insns=value_ref, map_refs=[]))
    with pytest.raises(ArtifactInvalid, match="relocation kind 2"):
        decode(data, KEY)


def test_constant_site_must_hold_the_placeholder() -> None:
    data = rewrite_body(encode(tiny_artifact(constant=True)),
                        lambda d: d["constants"][0].update(sites=[[0, 2]]))
    with pytest.raises(ArtifactInvalid, match="does not hold it"):
        decode(data, KEY)


def test_patched_writes_map_fds_and_this_runs_constants() -> None:
    a = tiny_artifact(constant=True)
    code = patched(a, 0, [77], {"OFFTOP_SELF_TGID": 4242})
    assert struct.unpack_from("<i", code, 4)[0] == 77
    assert struct.unpack_from("<i", code, 3 * 8 + 4)[0] == 4242
    with pytest.raises(ArtifactInvalid):
        patched(a, 0, [77], {})


def test_per_run_constants_are_compiled_as_placeholders() -> None:
    flags, values = split_constants(["-DOFFTOP_SELF_TGID=1234", "-DOFFTOP_WAKERS=1"])
    assert flags == [f"-DOFFTOP_SELF_TGID={PLACEHOLDERS['OFFTOP_SELF_TGID']}", "-DOFFTOP_WAKERS=1"]
    assert values == {"OFFTOP_SELF_TGID": 1234}
    # 0 turns the check off in the source (#if): compiled as it is.
    assert split_constants(["-DOFFTOP_SELF_TGID=0"]) == (["-DOFFTOP_SELF_TGID=0"], {})


def _module(code: bytes, fd: int = 9) -> dict[str, Any]:
    """What the compiler process prints (see bcc_child.py)."""
    return {"license": "GPL", "kern_version": 1,
            "compiler": {"bcc": "0.26.0", "libbcc": ["/x", 1, 2]},
            "maps": [{"name": "cfg", "fd": fd, "type": 2, "key_size": 4, "value_size": 8,
                      "max_entries": 4, "flags": 0}],
            "functions": [{"name": "tracepoint__sched__sched_switch",
                           "insns": base64.b64encode(code).decode()}]}


def test_compiler_output_becomes_map_indexes_and_constant_sites() -> None:
    p = PLACEHOLDERS["OFFTOP_SELF_TGID"]
    code = ld_map(1, 9) + insn(JEQ_R1, 1, 0, 0, p) + MOV_R0_0 + EXIT
    a = artifact_from_module(_module(code), KEY, {"OFFTOP_SELF_TGID": p})
    prog = a.programs[0]
    assert prog.map_refs == ((0, 0),)
    assert struct.unpack_from("<i", prog.insns, 4)[0] == 0  # the child's fd is not kept
    assert a.constants[0].sites == ((0, 2),)
    with pytest.raises(ConstantNotFound):
        artifact_from_module(_module(ld_map(1, 9) + MOV_R0_0 + EXIT), KEY,
                             {"OFFTOP_SELF_TGID": p})
    with pytest.raises(ArtifactInvalid, match="no map of the module"):
        artifact_from_module(_module(ld_map(1, 5) + MOV_R0_0 + EXIT), KEY, {})


# --- the cache -----------------------------------------------------------------------


@pytest.fixture
def cache(tmp_path: Path) -> ArtifactCache:
    base = tmp_path / "cache"
    base.mkdir(mode=0o755)
    return ArtifactCache(base / "offtop")


@pytest.fixture
def real_libbcc(tmp_path: Path) -> Path:
    """A stand-in libbcc file, so an artifact's compiler check passes."""
    lib = tmp_path / "libbcc.so.0"
    lib.write_bytes(b"lib")
    return lib


def _stored(cache: ArtifactCache, lib: Path, key: str = KEY) -> Artifact:
    st = lib.stat()
    a = replace(tiny_artifact(key=key),
                compiler=CompilerId("0.26.0", str(lib), st.st_size, st.st_mtime_ns))
    assert cache.put(a) == ""
    return a


@needs_root
def test_cache_round_trip_and_modes(cache: ArtifactCache, real_libbcc: Path) -> None:
    a = _stored(cache, real_libbcc)
    assert cache.get(KEY).artifact == a
    assert (cache.directory.stat().st_mode & 0o777) == 0o700
    f = cache.path_of(KEY)
    assert f.stat().st_uid == 0 and (f.stat().st_mode & 0o777) == 0o600
    assert cache.get("cd" * 32).why == "miss"
    assert [p.name for p in cache.directory.iterdir()] == [f.name]  # no temporary left


@needs_root
@pytest.mark.parametrize("tamper", ["owner", "mode", "symlink", "hardlink", "content",
                                    "renamed", "fifo", "dir_mode", "dir_owner", "parent_mode"])
def test_cache_refuses_what_others_could_have_written(cache: ArtifactCache, real_libbcc: Path,
                                                      tmp_path: Path, tamper: str) -> None:
    _stored(cache, real_libbcc)
    f = cache.path_of(KEY)
    if tamper == "owner":
        os.chown(f, NOBODY, NOBODY)
    elif tamper == "mode":
        f.chmod(0o646)
    elif tamper == "symlink":
        target = tmp_path / "elsewhere"
        target.write_bytes(f.read_bytes())
        f.unlink()
        f.symlink_to(target)
    elif tamper == "hardlink":
        os.link(f, tmp_path / "second-name")
    elif tamper == "content":
        f.write_bytes(f.read_bytes() + b" ")
    elif tamper == "renamed":  # a valid artifact of another key, under this key's name
        _stored(cache, real_libbcc, key="cd" * 32)
        os.replace(cache.path_of("cd" * 32), f)
    elif tamper == "fifo":
        f.unlink()
        os.mkfifo(f, 0o600)
    elif tamper == "dir_mode":
        cache.directory.chmod(0o755)
    elif tamper == "dir_owner":
        os.chown(cache.directory, NOBODY, NOBODY)
    else:
        cache.directory.parent.chmod(0o777)
    found = cache.get(KEY)
    assert found.artifact is None, tamper
    assert found.why not in ("hit", "miss"), found.why


@needs_root
def test_a_changed_libbcc_is_a_miss(cache: ArtifactCache, real_libbcc: Path) -> None:
    _stored(cache, real_libbcc)
    real_libbcc.write_bytes(b"a newer lib")
    assert "changed" in cache.get(KEY).why


@needs_root
def test_cache_keeps_the_most_recently_used(tmp_path: Path, real_libbcc: Path) -> None:
    c = ArtifactCache(tmp_path / "c", keep=3)
    keys = [f"{i:02x}" * 32 for i in range(5)]
    for i, k in enumerate(keys):
        _stored(c, real_libbcc, key=k)
        os.utime(c.path_of(k), (1000 + i, 1000 + i))
    c.put(replace(c.get(keys[4]).artifact))  # type: ignore[arg-type]
    assert sorted(p.name[:2] for p in c.directory.iterdir()) == ["02", "03", "04"]


def test_key_follows_source_flags_kernel_and_bcc(monkeypatch: pytest.MonkeyPatch) -> None:
    src = "TRACEPOINT_PROBE(sched, sched_switch) { return 0; }"
    base = cache_key(src, ["-DA=1"], None)
    assert cache_key(src, ["-DA=1"], None) == base
    assert cache_key(src + " ", ["-DA=1"], None) != base
    assert cache_key(src, ["-DA=2"], None) != base
    u = os.uname()
    stale = os.uname_result((u.sysname, u.nodename, u.release + "-old", u.version, u.machine))
    monkeypatch.setattr(cache_mod.os, "uname", lambda: stale)
    assert cache_key(src, ["-DA=1"], None) != base  # a kernel upgrade is a miss
    monkeypatch.undo()
    monkeypatch.setattr(cache_mod, "bcc_version", lambda: "0.99.0")
    assert cache_key(src, ["-DA=1"], None) != base


def test_key_follows_the_tracepoint_formats(tmp_path: Path) -> None:
    """bcc builds `args` from tracefs formats: a kernel rebuilt with other fields misses."""
    fmt = tmp_path / "events" / "sched" / "sched_switch" / "format"
    fmt.parent.mkdir(parents=True)
    fmt.write_text("field:int prev_pid; offset:8;")
    src = "TRACEPOINT_PROBE(sched, sched_switch) { return 0; }"
    before = cache_key(src, [], tmp_path)
    fmt.write_text("field:int prev_pid; offset:12;")
    assert cache_key(src, [], tmp_path) != before


# --- maps against the kernel -------------------------------------------------------------


@pytest.fixture
def new_map(bpf_available: None) -> Iterator[Any]:
    made: list[BpfMap] = []

    def make(mtype: int, key_size: int, value_size: int, entries: int, flags: int = 0) -> BpfMap:
        spec = MapSpec(f"t{len(made)}", mtype, key_size, value_size, entries, flags)
        m = BpfMap(maps.create_map(spec), spec)
        made.append(m)
        return m

    yield make
    for m in made:
        m.close()


def u32(v: int) -> bytes:
    return struct.pack("<I", v)


def u64(v: int) -> bytes:
    return struct.pack("<Q", v)


@pytest.mark.bpf
def test_deleting_many_from_a_map_without_batch_commands_deletes_one_by_one(
        new_map: Any) -> None:
    """A stack map has no batch delete (the kernel says ENOTSUPP without writing
    the count back): the ids are deleted one at a time, not an error."""
    m = new_map(maps.STACK_TRACE, 4, 8 * 16, 64)
    assert m.delete_many([u32(1), u32(2)]) == 0  # none there: nothing went, nothing failed
    assert m.batch_ok is False


@pytest.mark.bpf
def test_deleting_many_skips_keys_gone_already_wherever_they_are(new_map: Any) -> None:
    """A sweep deletes ids some of which the program's LRU has evicted already:
    each gone key stops the kernel's batch, and the rest is deleted past it."""
    m = new_map(maps.HASH, 4, 8, 4096)
    for i in range(0, 2000, 2):
        m.update(u32(i), u64(i))
    asked = [u32(i) for i in range(2000)] + [u32(0)]  # every other one gone; one twice
    assert m.delete_many(asked) == 1000
    assert m.batch_ok is True and m.items() == []
    assert m.delete_many([]) == 0


@pytest.mark.bpf
def test_deleting_some_stops_once_too_many_keys_were_gone_already(new_map: Any) -> None:
    """Each key found gone costs a command of its own: past `max_gone` of them the
    rest is left untried, and said (how many were tried), for the caller to
    read what the map still holds first. In order, batch or one by one."""
    for batch in (None, False):
        m = new_map(maps.HASH, 4, 8, 4096)
        for i in (0, 1, 3, 6, 7, 8):
            m.update(u32(i), u64(i))
        m.batch_ok = batch
        asked = [u32(i) for i in range(9)]  # 2, 4 and 5 gone already
        assert m.delete_some(asked, max_gone=2) == (3, 6)  # 0, 1, 3 went; 5 was the third gone
        assert sorted(m.all_keys()) == [u32(6), u32(7), u32(8)]
        assert m.delete_some(asked[5:], max_gone=2) == (3, 4)  # 5 gone; 6, 7, 8 went
        assert m.delete_some([], max_gone=0) == (0, 0)
        assert m.delete_some([u32(1), u32(2)]) == (0, 2)  # no bound: every key tried


@pytest.mark.bpf
@pytest.mark.parametrize("mtype", [maps.HASH, maps.LRU_HASH])
def test_hash_map_operations(new_map: Any, mtype: int) -> None:
    m = new_map(mtype, 4, 8, 4096)  # an LRU map evicts early when nearly full: room enough
    info = maps.map_info(m.fd)
    assert (info.type, info.key_size, info.value_size, info.max_entries) == (mtype, 4, 8, 4096)
    assert m.lookup(u32(1)) is None
    m.update(u32(1), u64(10))
    assert m.lookup(u32(1)) == u64(10)
    if mtype == maps.HASH:
        assert m.try_update(u32(1), u64(11), maps.BPF_NOEXIST) == -errno.EEXIST
        assert m.try_update(u32(2), u64(11), maps.BPF_EXIST) == -errno.ENOENT
    m.update(u32(1), u64(12), maps.BPF_EXIST)
    assert m.lookup(u32(1)) == u64(12)
    assert m.delete(u32(1)) and not m.delete(u32(1))
    with pytest.raises(ValueError):
        m.lookup(b"\0")
    for i in range(600):
        m.update(u32(i), u64(i * 3))
    want = {u32(i): u64(i * 3) for i in range(600)}
    assert dict(m.items()) == want
    assert m.batch_ok is True
    assert sorted(m.all_keys()) == sorted(want)
    assert sorted(m.keys_by_walk()) == sorted(want)
    keys, values, n = m.items_raw(chunk_bytes=64)  # many small batches
    assert n == 600 and len(keys) == 600 * 4 and len(values) == 600 * 8
    # Keys only (all_keys: a stack map's values are ~1 kB each): the values
    # are never gathered.
    keys, values, n = m.items_raw(chunk_bytes=64, values=False)
    assert n == 600 and sorted(keys[i:i + 4] for i in range(0, len(keys), 4)) == sorted(want)
    assert values == b""
    assert m.delete_many([u32(i) for i in range(100)] + [u32(5000)]) == 100
    m.batch_ok = False  # an old kernel: the same answers by walking
    assert dict(m.items()) == {k: v for k, v in want.items() if struct.unpack("<I", k)[0] >= 100}
    m.batch_ok = None
    drained = dict(m.items(delete=True))
    assert len(drained) == 500 and m.items() == []


@pytest.mark.bpf
def test_an_element_reader_answers_as_the_map_does(new_map: Any) -> None:
    """The stack store's cheap lookups: the same values, absent keys, bad keys."""
    m = new_map(maps.LRU_HASH, 4, 24, 64)
    reader = maps.ElementReader(m)
    assert reader.lookup(u32(1)) is None
    m.update(u32(1), u64(1) + u64(2) + u64(3))
    m.update(u32(2), u64(7) * 3)
    for k in (1, 2, 1):  # buffers reused: no value leaks into the next answer
        assert reader.lookup(u32(k)) == m.lookup(u32(k))
    assert reader.lookup(u32(3)) is None
    with pytest.raises(ValueError):
        reader.lookup(b"\0")


@pytest.mark.bpf
def test_lookup_and_delete_batch_falls_back_to_a_walk(new_map: Any) -> None:
    m = new_map(maps.HASH, 4, 8, 64)
    for i in range(10):
        m.update(u32(i), u64(i))
    m.batch_ok = False
    assert len(m.items(delete=True)) == 10 and m.items() == []


@pytest.mark.bpf
def test_percpu_values(new_map: Any) -> None:
    m = new_map(maps.PERCPU_ARRAY, 4, 8, 4)
    n = maps.possible_cpus()
    assert m.value_bytes == 8 * n
    m.update(u32(2), b"".join(u64(c + 1) for c in range(n)))
    assert m.lookup_percpu(u32(2)) == [u64(c + 1) for c in range(n)]
    items = dict(m.items())
    assert len(items) == 4 and items[u32(2)] == b"".join(u64(c + 1) for c in range(n))
    odd = new_map(maps.PERCPU_ARRAY, 4, 12, 1)  # values padded to 8 bytes per CPU
    assert odd.value_bytes == 16 * n
    odd.update(u32(0), b"".join(bytes([c + 1]) * 12 + b"\0" * 4 for c in range(n)))
    assert odd.lookup_percpu(u32(0)) == [bytes([c + 1]) * 12 for c in range(n)]


@pytest.mark.bpf
def test_mmapable_array_and_map_without_batch_commands(new_map: Any) -> None:
    import mmap

    arr = new_map(maps.ARRAY, 4, 8, 512, maps.BPF_F_MMAPABLE)
    assert maps.map_info(arr.fd).map_flags == maps.BPF_F_MMAPABLE
    mm = mmap.mmap(arr.fd, 4096, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    try:
        arr.update(u32(3), u64(99))
        assert struct.unpack_from("<Q", mm, 24)[0] == 99
    finally:
        mm.close()
    stacks = new_map(maps.STACK_TRACE, 4, 8 * 8, 16)  # no batch commands for stack maps
    assert stacks.items() == [] and stacks.batch_ok is False
    assert list(stacks.all_keys()) == []


@pytest.mark.bpf
def test_cgroup_array_takes_a_cgroup_directory(new_map: Any) -> None:
    mounts = [line.split(" - ")[0].split()[4]
              for line in Path("/proc/self/mountinfo").read_text().splitlines()
              if " - cgroup2 " in line]
    if not mounts:
        pytest.skip("no cgroup2 mount")
    m = new_map(maps.CGROUP_ARRAY, 4, 4, 1)
    m.set_cgroup(0, mounts[0])
    with pytest.raises(OSError):
        m.set_cgroup(0, "/nonexistent-cgroup")


# --- offcpu.c, loaded ----------------------------------------------------------------------


class CountingCompiler:
    """compiler.compile_artifact, counted (a cache hit must not call it)."""

    def __init__(self, wrap: Any = None) -> None:
        self.calls = 0
        self.wrap = wrap

    def __call__(self, source: str, cflags: list[str], key: str,
                 placeholders: Mapping[str, int]) -> Artifact:
        self.calls += 1
        art = compiler.compile_artifact(source, cflags, key, placeholders)
        return self.wrap(art) if self.wrap else art


def _probe(cache: ArtifactCache, comp: CountingCompiler, **cfg: Any) -> Any:
    from offtop.bpf.probe import Probe

    p = Probe(EngineConfig(**cfg), cache=cache, compile=comp)
    p.load(123_000_000)
    return p


def _perf_links(pid: int) -> list[dict[str, Any]]:
    r = subprocess.run(["bpftool", "-j", "perf", "list"], capture_output=True, text=True,
                       check=True)
    return [e for e in json.loads(r.stdout or "[]") if e.get("pid") == pid]


def _prog_exists(prog_id: int) -> bool:
    r = subprocess.run(["bpftool", "-j", "prog", "show", "id", str(prog_id)],
                       capture_output=True, text=True)
    return r.returncode == 0


def _prog_id(fd: int) -> int:
    for line in Path(f"/proc/self/fdinfo/{fd}").read_text().splitlines():
        if line.startswith("prog_id:"):
            return int(line.split()[1])
    raise AssertionError("no prog_id")


@pytest.fixture(scope="module")
def warm(tmp_path_factory: pytest.TempPathFactory) -> ArtifactCache:
    """One cache per module: one compile serves the tests that need a cached artifact."""
    return ArtifactCache(tmp_path_factory.mktemp("warm") / "offtop")


@pytest.mark.bpf
def test_miss_compiles_then_hit_loads_without_compiling(bpf_available: None,
                                                       warm: ArtifactCache) -> None:
    comp = CountingCompiler()
    p = _probe(warm, comp)
    try:
        assert comp.calls == 1 and p.report.how == "compiled", p.report
        assert p.kernel_threshold() == 123_000_000
        p.set_threshold(7)
        assert p.kernel_threshold() == 7
    finally:
        p.close()
    files = list(warm.directory.iterdir())
    assert len(files) == 1 and files[0].stat().st_uid == 0
    q = _probe(warm, comp)
    try:
        assert comp.calls == 1 and q.report.how == "cache hit", q.report
        assert q.counters()["start_full"] == 0
    finally:
        q.close()


@pytest.mark.bpf
def test_a_compile_begun_ahead_is_the_one_loaded(bpf_available: None, tmp_path: Path) -> None:
    """A first start's compile is begun as soon as the options are known (the CLI,
    before the engine's imports and the TUI's): `load` takes it, compiling nothing
    itself; a program cached already begins none; one of other options is not taken."""
    from offtop.bpf import environment
    from offtop.bpf.loader.load import AheadCompile, compile_ahead
    from offtop.bpf.probe import Probe, offcpu_source

    cache = ArtifactCache(tmp_path / "offtop")
    tracefs = environment.tracefs_dir()
    assert tracefs is not None
    cfg = EngineConfig()
    comp = CountingCompiler()
    ahead = compile_ahead(offcpu_source(), cfg.cflags(), cache=cache, tracefs=tracefs,
                          compile=comp)
    assert ahead is not None and wait_until(lambda: comp.calls == 1)  # under way, in its thread
    p = Probe(cfg, cache=cache, compile=comp, ahead=ahead)
    p.load(123_000_000)
    p.close()
    assert comp.calls == 1 and p.report.how == "compiled ahead", p.report
    assert compile_ahead(offcpu_source(), cfg.cflags(), cache=cache, tracefs=tracefs,
                         compile=comp) is None  # cached by that load

    def wrong() -> Artifact:
        raise AssertionError("another program's compile was taken")

    other = EngineConfig(kernel_stacks=False)
    p = Probe(other, cache=cache, compile=comp, ahead=AheadCompile("another key", wrong))
    p.load(123_000_000)
    p.close()
    assert comp.calls == 2 and p.report.how == "compiled", p.report


def test_a_compile_ahead_never_fails_a_start(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Only time is at stake: a cache directory that cannot be looked into begins the
    compile anyway; a machine that fails the checks begins none (the load says why)."""
    from offtop.bpf import environment
    from offtop.bpf.loader.load import compile_ahead
    from offtop.bpf.probe import compile_ahead_of

    class Unreadable(ArtifactCache):
        def path_of(self, key: str) -> Path:
            raise PermissionError(errno.EACCES, "Permission denied")

    made = object()
    ahead = compile_ahead("int x;", [], cache=Unreadable(tmp_path), tracefs=tmp_path,
                          compile=lambda *a: made)  # type: ignore[arg-type,return-value]
    assert ahead is not None and ahead.result() is made

    def broken() -> None:
        raise EngineError("the checks broke")

    monkeypatch.setattr(environment, "prepare", broken)
    assert compile_ahead_of(EngineConfig()) is None


@pytest.mark.bpf
def test_a_compile_begun_ahead_that_failed_fails_the_load_as_one_line(bpf_available: None,
                                                                      tmp_path: Path) -> None:
    from offtop.bpf import environment
    from offtop.bpf.loader.load import compile_ahead
    from offtop.bpf.probe import Probe, offcpu_source

    def broken(source: str, cflags: list[str], key: str, placeholders: Mapping[str, int]) -> Artifact:
        raise EngineError("could not load the BPF program: the compiler broke")

    cache = ArtifactCache(tmp_path / "offtop")
    cfg = EngineConfig()
    tracefs = environment.tracefs_dir()
    assert tracefs is not None
    ahead = compile_ahead(offcpu_source(), cfg.cflags(), cache=cache, tracefs=tracefs,
                          compile=broken)
    p = Probe(cfg, cache=cache, compile=CountingCompiler(), ahead=ahead)
    with pytest.raises(EngineError, match="the compiler broke"):
        p.load(123_000_000)
    p.close()


@pytest.mark.bpf
@pytest.mark.parametrize("tamper", ["content", "owner", "mode"])
def test_tampered_cache_file_is_refused_and_recompiled(bpf_available: None, warm: ArtifactCache,
                                                       tamper: str) -> None:
    _probe(warm, CountingCompiler()).close()  # make sure it is there
    (f,) = list(warm.directory.iterdir())
    if tamper == "content":
        data = bytearray(f.read_bytes())
        data[-20] ^= 0x20
        f.write_bytes(bytes(data))
    elif tamper == "owner":
        os.chown(f, NOBODY, NOBODY)
    else:
        f.chmod(0o666)
    comp = CountingCompiler()
    p = _probe(warm, comp)
    p.close()
    assert comp.calls == 1 and p.report.how == "compiled", p.report
    assert p.report.cache_note, p.report
    st = f.stat()  # replaced by a good one
    assert st.st_uid == 0 and st.st_mode & 0o777 == 0o600
    q = _probe(warm, comp)
    q.close()
    assert q.report.how == "cache hit"


def _refused_by_the_verifier(art: Artifact) -> Artifact:
    """The artifact with sched_switch made to start by reading r9, never set: refused.

    Put before the first instruction, so every later index moves by one.
    """
    i = next(i for i, p in enumerate(art.programs) if p.name.endswith("sched_switch"))
    p = art.programs[i]
    bad = Program(p.name, p.type, insn(0x79, 0, 9) + p.insns,
                  tuple((at + 1, m) for at, m in p.map_refs))
    consts = tuple(replace(c, sites=tuple((pi, at + 1 if pi == i else at) for pi, at in c.sites))
                   for c in art.constants)
    return replace(art, programs=(*art.programs[:i], bad, *art.programs[i + 1:]),
                   constants=consts)


@pytest.mark.bpf
def test_cached_program_the_verifier_refuses_is_compiled_afresh_once(
        bpf_available: None, tmp_path: Path) -> None:
    c = ArtifactCache(tmp_path / "offtop")
    comp = CountingCompiler()
    _probe(c, comp).close()
    (f,) = list(c.directory.iterdir())
    good = decode(f.read_bytes(), f.name.removesuffix(".bpfo"))
    assert c.put(_refused_by_the_verifier(good)) == ""
    p = _probe(c, comp)
    p.close()
    assert comp.calls == 2 and p.report.how == "compiled", p.report
    assert "refused" in p.report.cache_note
    # A compiler whose every answer is refused: one try, then one line, never a loop.
    c.put(_refused_by_the_verifier(good))
    bad = CountingCompiler(wrap=_refused_by_the_verifier)
    with pytest.raises(EngineError, match=r"could not load the BPF program.*full log in") as e:
        _probe(c, bad)
    assert bad.calls == 1
    log = Path(str(e.value).rsplit("full log in ", 1)[1])
    assert "processed " in log.read_text()
    log.unlink()


@pytest.mark.bpf
def test_unknown_map_type_in_cache_is_a_miss(bpf_available: None, tmp_path: Path) -> None:
    c = ArtifactCache(tmp_path / "offtop")
    comp = CountingCompiler()
    _probe(c, comp).close()
    (f,) = list(c.directory.iterdir())
    f.write_bytes(rewrite_body(f.read_bytes(), lambda d: d["maps"][0].update(type=4242)))
    p = _probe(c, comp)
    p.close()
    assert comp.calls == 2 and "unknown" in p.report.cache_note, p.report


@pytest.mark.bpf
def test_attached_in_order_and_detached_on_close(bpf_available: None,
                                                 warm: ArtifactCache) -> None:
    p = _probe(warm, CountingCompiler())
    try:
        links = _perf_links(os.getpid())
        by_tp: dict[str, list[dict[str, Any]]] = {}
        for e in sorted(links, key=lambda e: e["fd"]):
            by_tp.setdefault(e["tracepoint"], []).append(e)
        switch_id = _prog_id(p.prog_fd)
        assert [e["prog_id"] for e in by_tp["sched_switch"]] == [switch_id]
        assert {"sched_process_free", "sched_process_exec", "cgroup_attach_task",
                "cgroup_transfer_tasks"} <= set(by_tp)
        # One program on sched_waking, the interrupt check; it tail-calls the waker
        # program and that one the interrupt's path (a program array: read from here,
        # its slots give the programs' ids).
        assert p._obj is not None
        progs = p._obj.progs
        waking = [e["prog_id"] for e in by_tp["sched_waking"]]
        assert waking == [_prog_id(progs["tracepoint__sched__sched_waking"])]
        table = p._obj.maps["waking_next"]
        called = [table.lookup(struct.pack("<I", slot)) for slot in (0, 1)]
        assert [struct.unpack("<I", v)[0] if v else None for v in called] == [
            _prog_id(progs["on_sched_waking"]), _prog_id(progs["on_irq_waker"])]
        ids = [e["prog_id"] for e in links] + [_prog_id(progs["on_irq_waker"])]
    finally:
        p.close()
    assert _perf_links(os.getpid()) == []
    # The kernel frees a program once its last reference goes (after a grace period).
    assert wait_until(lambda: not any(_prog_exists(i) for i in ids)), ids
    p.close()  # twice is fine


def _btf(types: list[tuple[str, int, int, bytes]]) -> bytes:
    """A BTF blob: (name, kind, vlen, the bytes after the record) per type."""
    strings, body = b"\0", b""
    for name, kind, vlen, extra in types:
        off = len(strings)
        strings += name.encode() + b"\0"
        body += struct.pack("<III", off, (kind << 24) | vlen, 0) + extra
    hdr = struct.pack("<HBBI4I", 0xEB9F, 1, 0, 24, 0, len(body), len(body), len(strings))
    return hdr + body + strings


def test_btf_function_ids_by_stepping_over_every_kind() -> None:
    from offtop.bpf.btf import func_id_in

    data = _btf([("int", 1, 0, b"\0" * 4), ("s", 4, 2, b"\0" * 24), ("e", 6, 3, b"\0" * 24),
                 ("proto", 13, 1, b"\0" * 8), ("bpf_iter_task", 13, 0, b""),  # not a FUNC
                 ("bpf_iter_task", 12, 0, b""), ("x", 12, 0, b"")])
    assert func_id_in(data, "bpf_iter_task") == 6
    assert func_id_in(data, "x") == 7
    assert func_id_in(data, "bpf_iter") is None and func_id_in(data, "nothing") is None


@pytest.mark.parametrize("damage", ["magic", "short", "sections", "kind"])
def test_btf_that_is_not_is_refused_not_misread(damage: str) -> None:
    from offtop.bpf.btf import BtfError, func_id_in

    data = bytearray(_btf([("q", 31, 0, b""), ("f", 12, 0, b"")]))
    if damage == "magic":
        data[0:2] = b"\x9f\xeb"
    elif damage == "short":
        del data[20:]
    elif damage == "sections":
        struct.pack_into("<I", data, 12, 1 << 30)
    with pytest.raises(BtfError):
        func_id_in(bytes(data), "f")  # "kind": kind 31 is unknown: nothing past it can be sized


def test_saved_registers_are_off_without_the_kernel_s_btf(tmp_path: Path) -> None:
    from offtop.bpf.task_regs import TaskRegisters

    class NeverLoaded:
        """A fake program (for this test): loading must not even be tried."""

        def load_iterator(self, function: str, attach_btf_id: int) -> int:
            raise AssertionError("loaded without a BTF id")

    missing = TaskRegisters(NeverLoaded(), btf_path=str(tmp_path / "none"))
    assert missing.of(os.getpid()) is None and "kernel BTF" in missing.unavailable
    junk = tmp_path / "junk"
    junk.write_bytes(b"\0" * 64)
    bad = TaskRegisters(NeverLoaded(), btf_path=str(junk))
    assert bad.of(os.getpid()) is None and "not BTF" in bad.unavailable
    assert bad.of(os.getpid()) is None and bad.reads == 0  # asked once, then off for good


@pytest.mark.bpf
def test_saved_user_registers_of_a_blocked_thread(bpf_available: None,
                                                   warm: ArtifactCache) -> None:
    from offtop.unwind.regs import read_syscall_regs

    p = _probe(warm, CountingCompiler())
    sleeper = subprocess.Popen(["/usr/bin/sleep", "30"])
    try:
        assert wait_until(lambda: read_syscall_regs(sleeper.pid, sleeper.pid) is not None)
        assert p._obj is not None and "bpf_iter__task" not in p._obj.progs  # not until asked
        got = p.user_regs(sleeper.pid)
        want = read_syscall_regs(sleeper.pid, sleeper.pid)
        assert got is not None and want is not None, p.task_regs_unavailable()
        assert (got.pc, got.sp) == (want.pc, want.sp)
        # (rbp, which /proc never shows, is checked by unwinding with it:
        # test_truth_e2e's frame-pointer program blocked before the start.)
        assert "bpf_iter__task" in p._obj.progs
        assert p.user_regs(2) is None  # kthreadd: no user registers
        assert p.user_regs(0x3FFFFFF0) is None  # no such thread
    finally:
        sleeper.kill()
        sleeper.wait()
        p.close()


@pytest.mark.bpf
def test_maps_as_the_compiler_defined_them(bpf_available: None, warm: ArtifactCache) -> None:
    p = _probe(warm, CountingCompiler())
    try:
        assert p._obj is not None
        for name, m in p._obj.maps.items():
            info = maps.map_info(m.fd)
            spec = m.spec
            assert (info.type, info.key_size, info.value_size, info.max_entries,
                    info.map_flags) == (spec.type, spec.key_size, spec.value_size,
                                        spec.max_entries, spec.flags), name
        assert p._obj.maps["offcpu_slots"].spec.flags & maps.BPF_F_MMAPABLE
        assert p._obj.maps["offcpu_events"].spec.max_entries == maps.possible_cpus()
    finally:
        p.close()


_NO_LLVM = """
import json, os, sys
from pathlib import Path
from offtop.bpf import environment
environment.prepare()  # every check offtop makes before it loads, bcc's among them
from offtop.bpf.config import EngineConfig
from offtop.bpf.probe import Probe
from offtop.bpf.loader.cache import ArtifactCache
p = Probe(EngineConfig(), cache=ArtifactCache(Path(sys.argv[1])))
p.load(10**9)
libs = [l for l in open("/proc/self/maps") if "libLLVM" in l or "libclang" in l or "libbcc" in l]
print(json.dumps({"how": p.report.how, "libs": libs, "bcc": "bcc" in sys.modules}))
p.close()
"""


@pytest.mark.bpf
def test_llvm_never_enters_the_process(bpf_available: None, tmp_path: Path) -> None:
    """A miss compiles in a child; neither it, nor a hit, nor the checks before them map
    libbcc or LLVM here (importing bcc to check it is there mapped ~55 MB of them)."""
    for how in ("compiled", "cache hit"):
        r = subprocess.run([sys.executable, "-c", _NO_LLVM, str(tmp_path / "offtop")],
                           capture_output=True, text=True, cwd=ROOT, timeout=300)
        assert r.returncode == 0, r.stderr
        out = json.loads(r.stdout)
        assert out == {"how": how, "libs": [], "bcc": False}, out


def test_user_strings_never_reach_the_compiled_text(monkeypatch: pytest.MonkeyPatch,
                                                    tmp_path: Path) -> None:
    """What the compiler is handed is offcpu.c byte for byte and validated -D integers."""
    from offtop.bpf import environment
    from offtop.bpf.engine import BpfSource

    hostile = "x\"); system(\"id\"); //"
    seen: dict[str, Any] = {}

    def fake(source: str, cflags: list[str], key: str, placeholders: Mapping[str, int]) -> Artifact:
        seen.update(text=source, cflags=cflags)
        raise EngineError("could not load the BPF program: stopped here")

    monkeypatch.setattr(compiler, "compile_artifact", fake)
    monkeypatch.setattr(environment, "prepare", lambda: None)
    monkeypatch.setenv("OFFTOP_CACHE_DIR", str(tmp_path / "empty"))
    cfg = EngineConfig(pids=(os.getpid(),), tids=(os.getpid(),), cgroup=hostile, scope=hostile)
    if environment.tracefs_dir() is None:
        pytest.skip("no tracefs to key the cache with")
    with pytest.raises(EngineError, match="stopped here"):
        BpfSource(cfg).start()
    assert seen["text"] == resources.files("offtop.bpf").joinpath("offcpu.c").read_text()
    assert seen["cflags"] == [*split_constants(cfg.cflags())[0], *COMPILE_FLAGS]
    blob = seen["text"] + "\n".join(seen["cflags"])
    assert hostile not in blob and str(os.getpid()) not in "\n".join(seen["cflags"])


_CHILD_DROP = """
import ctypes, importlib.util, sys
spec = importlib.util.spec_from_file_location("child", sys.argv[1])
child = importlib.util.module_from_spec(spec)
spec.loader.exec_module(child)
def rss_kb():
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmRSS"))
ctypes.CDLL("libbcc.so.0")
before = rss_kb()
dropped = child._drop_pages_loading_touched()
print(dropped, before, rss_kb())
"""


@pytest.mark.bpf
def test_compiler_process_gives_back_what_loading_llvm_touched(bpf_available: None) -> None:
    """The compiler process runs isolated (-I: nothing of offtop on its path), finds
    compiler_memory.py by its path, and drops the clean LLVM pages dlopen faulted in
    (~34 MB here; each MB of it would add to offtop's peak while the compile runs)."""
    child = ROOT / "offtop" / "bpf" / "loader" / "bcc_child.py"
    r = subprocess.run([sys.executable, "-I", "-c", _CHILD_DROP, str(child)],
                       capture_output=True, text=True, timeout=60, check=True)
    dropped, before, after = map(int, r.stdout.split())
    assert dropped > 0
    assert before - after >= 10 * 1024, (before, after)


def _bcc_child() -> Any:
    import importlib.util

    spec = importlib.util.spec_from_file_location("bcc_child", compiler.CHILD)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_helper_symbols_are_the_bpf_lines_as_they_are() -> None:
    kallsyms = (b"ffffffff81000000 T _stext\n"
                b"ffffffff814cb760 T bpf_probe_read_kernel\n"
                b"ffffffff814cb7c0 T __pfx_bpf_probe_read_kernel_str\n"
                b"ffffffff814cb800 t bpf_probe_read_kernel_str\n"
                b"ffffffffc0001000 t helper_bpf_x\t[some_mod]\n"
                b"ffffffffc0002000 t bpf_in_module\t[bpf_mod]\n"
                b"ffffffff814ce250 T bpf_probe_read_user")  # the last line, no newline
    assert _bcc_child().helper_symbols(kallsyms) == (
        b"ffffffff814cb760 T bpf_probe_read_kernel\n"
        b"ffffffff814cb800 t bpf_probe_read_kernel_str\n"
        b"ffffffffc0002000 t bpf_in_module\t[bpf_mod]\n"
        b"ffffffff814ce250 T bpf_probe_read_user\n")


_TWO_COMPILES = """
import ctypes, importlib.util, json, sys
spec = importlib.util.spec_from_file_location("child", sys.argv[1])
child = importlib.util.module_from_spec(spec)
spec.loader.exec_module(child)
req = json.loads(sys.stdin.read())
lib = ctypes.CDLL("libbcc.so.0", use_errno=True)
child._declare(lib)
full = child.compile_module(lib, req["source"], req["cflags"])
bound = child._show_bcc_only_helper_symbols()
with open("/proc/kallsyms", "rb") as f:
    seen = f.read()
only = child.compile_module(lib, req["source"], req["cflags"])
print(json.dumps({"full": full, "only": only, "bound": bound,
                  "seen_lines": seen.count(b"\\n"), "all_bpf": all(
                      l.split()[2].startswith(b"bpf_") for l in seen.splitlines())}))
"""


@pytest.mark.bpf
def test_bcc_sees_only_bpf_symbols_and_compiles_the_same(bpf_available: None) -> None:
    """The compiler process binds the bpf_* lines of kallsyms over /proc/kallsyms in a
    mount namespace of its own: bcc compiles exactly what it compiled from the whole
    file, and nothing of it is seen outside (no mount, no file left in /tmp)."""
    from offtop.bpf import environment

    choice = environment.find_kernel_headers()
    env = {**os.environ, **({"BCC_KERNEL_SOURCE": choice.source_env} if choice.source_env else {})}
    src = resources.files("offtop.bpf").joinpath("offcpu.c").read_text()
    flags, _ = split_constants(EngineConfig().cflags())
    mounts, leftovers = Path("/proc/self/mounts").read_text(), set(Path("/tmp").glob("offtop-kallsyms-*"))
    r = subprocess.run([sys.executable, "-I", "-c", _TWO_COMPILES, str(compiler.CHILD)],
                       input=json.dumps({"source": src, "cflags": flags}), capture_output=True,
                       text=True, env=env, timeout=300, check=True)
    out = json.loads(r.stdout)
    assert out["bound"] and out["all_bpf"] and 0 < out["seen_lines"] < 20_000, out["seen_lines"]
    ident = {"bcc": "0.26.0", "libbcc": ["/x", 1, 2]}  # as main() adds it
    programs = [artifact_from_module({**out[k], "compiler": ident}, KEY, {}).programs
                for k in ("full", "only")]
    assert programs[0] == programs[1]
    assert Path("/proc/self/mounts").read_text() == mounts
    assert set(Path("/tmp").glob("offtop-kallsyms-*")) == leftovers
    assert Path("/proc/kallsyms").stat().st_size == 0  # procfs's own file, not a bound one
    with open("/proc/kallsyms", "rb") as f:
        assert f.read().count(b"\n") > out["seen_lines"]


@pytest.mark.bpf
def test_setup_compiles_what_starts_with_no_option_with_p_and_with_c_load(
        bpf_available: None, tmp_path: Path) -> None:
    """`make setup` (loader.precompile) fills the cache with the programs `offtop`,
    `offtop -p/-t` and `offtop -c` load, whatever pids or cgroup they name: their
    first starts are hits; other options still compile."""
    from offtop.bpf.loader.precompile import SETUP_ARGS, config_of, default_config, precompile
    from offtop.cgroups import cgroup2_mounts

    cache = ArtifactCache(tmp_path / "offtop")
    configs = [config_of(argv) for argv in SETUP_ARGS]
    assert None not in configs  # this machine has a cgroup v2 mount
    for argv, cfg in zip(SETUP_ARGS, configs, strict=True):
        assert cfg is not None
        said = precompile(cfg, cache)
        assert said.startswith("compiled offtop's BPF program into"), (argv, said)
        assert precompile(cfg, cache) == ""  # quiet once it is there
    from offtop.bpf.probe import Probe
    from offtop.cli_args import build_parser, config_from_args

    def config(*argv: str) -> EngineConfig:
        return config_from_args(build_parser().parse_args(list(argv)))[0]

    assert config("--batch", "--format", "json").cflags() == default_config().cflags()
    root = cgroup2_mounts()[0]
    cgroup = next((p for p in sorted(root.iterdir()) if (p / "cgroup.procs").exists()), root)
    starts = [(), ("--batch", "--format", "json"), ("-p", "1"), ("-p", f"1,{os.getpid()}"),
              ("-t", str(threading.get_native_id())), ("-c", str(cgroup))]
    for argv in starts:
        comp = CountingCompiler()
        q = Probe(config(*argv), cache=cache, compile=comp)
        q.load(1_000_000)
        q.close()
        assert comp.calls == 0 and q.report.how == "cache hit", (argv, q.report)
    r = _probe(cache, comp, wakers=False)
    r.close()
    assert comp.calls == 1 and r.report.how == "compiled"


class FakeProgLoad:
    """syscalls.bpf for BPF_PROG_LOAD (a fake: the kernel is not asked): the answers
    given in turn, the last one from then on."""

    def __init__(self, *answers: int) -> None:
        self.answers = list(answers)
        self.calls = 0

    def __call__(self, cmd: int, attr: Any) -> int:
        self.calls += 1
        return self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]


def test_a_load_the_verifier_stopped_on_a_signal_is_tried_again(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The verifier gives up with EAGAIN when a signal is pending (a profiler
    attaching): offtop's start failed on it. It is tried again, as libbpf does."""
    from offtop.bpf import syscalls
    from offtop.bpf.loader import kernel

    fake = FakeProgLoad(-errno.EAGAIN, -errno.EAGAIN, -errno.EAGAIN, 42)
    monkeypatch.setattr(syscalls, "bpf", fake)
    assert kernel.load_program(1, "p", b"\0" * 16, "GPL", 0) == 42
    assert fake.calls == 4

    fake = FakeProgLoad(-errno.EAGAIN)  # for good: refused, the artifact not blamed
    monkeypatch.setattr(syscalls, "bpf", fake)
    with pytest.raises(kernel.LoadFailed) as e:
        kernel.load_program(1, "p", b"\0" * 16, "GPL", 0)
    assert not e.value.artifact_fault
    assert fake.calls == 2 * kernel.PROG_LOAD_TRIES  # without a log, then with one
