"""The compiled program as offtop keeps it: the artifact format, checked on every read.

A file is one header line, then a JSON body::

    offtop-bpf-artifact <FORMAT> <key> <sha256 of the body>\\n
    {"format": 1, "key": ..., "license": "GPL", "kern_version": ...,
     "compiler": {"bcc": "0.26.0", "libbcc": [path, size, mtime_ns]},
     "maps": [{"name", "type", "key_size", "value_size", "max_entries", "flags"}, ...],
     "programs": [{"name", "type", "insns": base64, "map_refs": [[insn, map], ...]}, ...],
     "constants": [{"name", "placeholder", "sites": [[program, insn], ...]}, ...]}

`insns` are the program's eBPF instructions as bcc's LLVM emitted them,
with the immediate of every map reference (an ld_imm64 whose src_reg is
BPF_PSEUDO_MAP_FD, which held the compiling process's fd) zeroed: the
loader writes its own maps' fds there (`map_refs` says where and which).
`constants` are -D values that differ from run to run (offtop's own pid):
compiled as a placeholder, found in the instructions by the compiler and
patched at load, so that one artifact serves every run.

Whatever reads an artifact trusts nothing in it: `decode` checks the
header, the hash, every field's type and range, that every map reference
is listed (an unlisted one would hand the kernel one of offtop's own fds
by number) and that no instruction needs a relocation this loader does not
do. A file that fails is a cache miss, never an error.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import re
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from offtop.bpf.maps import KNOWN_MAP_FLAGS, MAP_TYPES, MapSpec

#: Bumped whenever the layout or meaning of any field changes.
FORMAT = 1
MAGIC = b"offtop-bpf-artifact"
#: Larger than any artifact of offcpu.c by far (about 100 KB).
MAX_BYTES = 16 << 20

#: enum bpf_prog_type: the kinds offcpu.c has. A program's type follows from
#: its function name (bcc's rule): `bpf_iter__<target>` is an iterator
#: (BPF_PROG_TYPE_TRACING, attached as BPF_TRACE_ITER), any other a tracepoint's.
PROG_TYPE_TRACEPOINT = 5
PROG_TYPE_TRACING = 26
ITER_PREFIX = "bpf_iter__"


def program_type(function: str) -> int:
    """The program type of function `function` of offcpu.c (see above)."""
    return PROG_TYPE_TRACING if function.startswith(ITER_PREFIX) else PROG_TYPE_TRACEPOINT

# eBPF instruction encoding (linux/bpf.h, linux/bpf_common.h).
INSN_SIZE = 8
BPF_LD_IMM64 = 0x18           # BPF_LD | BPF_IMM | BPF_DW: two instruction slots
BPF_CALL = 0x85               # BPF_JMP | BPF_CALL
BPF_EXIT = 0x95               # BPF_JMP | BPF_EXIT
BPF_PSEUDO_MAP_FD = 1         # ld_imm64 src_reg: imm is a map fd
BPF_PSEUDO_CALL = 1           # call src_reg: a call within the program
_CLASS_ST, _CLASS_ALU, _CLASS_JMP, _CLASS_JMP32, _CLASS_ALU64 = 2, 4, 5, 6, 7
_BPF_X = 0x08                 # source operand is a register, not imm
MAX_INSNS = 1_000_000         # BPF_COMPLEXITY_LIMIT_INSNS

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.]{0,127}\Z")
_HEX64 = re.compile(r"[0-9a-f]{64}\Z")
_IMM = struct.Struct("<i")


class ArtifactInvalid(ValueError):
    """An artifact that must not be used; the message says why (for the log, not users)."""


@dataclass(frozen=True, slots=True)
class Program:
    """One program: its function name in offcpu.c, type and instructions."""

    name: str
    type: int
    insns: bytes
    #: (instruction index, map index) of every map reference.
    map_refs: tuple[tuple[int, int], ...]

    @property
    def insn_count(self) -> int:
        """How many 8-byte instruction slots."""
        return len(self.insns) // INSN_SIZE


@dataclass(frozen=True, slots=True)
class Constant:
    """A per-run -D value, compiled as `placeholder` at each (program, instruction) site."""

    name: str
    placeholder: int
    sites: tuple[tuple[int, int], ...]


@dataclass(frozen=True, slots=True)
class CompilerId:
    """Which bcc compiled it: its version and the libbcc file as it was then."""

    bcc_version: str
    libbcc_path: str
    libbcc_size: int
    libbcc_mtime_ns: int


@dataclass(frozen=True, slots=True)
class Artifact:
    """A compiled offcpu.c: everything needed to load it without a compiler."""

    key: str
    license: str
    kern_version: int
    compiler: CompilerId
    maps: tuple[MapSpec, ...]
    programs: tuple[Program, ...]
    constants: tuple[Constant, ...] = ()

    def program(self, name: str) -> Program | None:
        """The program compiled from function `name`, if any."""
        return next((p for p in self.programs if p.name == name), None)


# --- instructions ---------------------------------------------------------------


def insn_fields(insns: bytes, i: int) -> tuple[int, int, int]:
    """(opcode, src_reg, imm) of instruction `i`."""
    at = i * INSN_SIZE
    return insns[at], insns[at + 1] >> 4, _IMM.unpack_from(insns, at + 4)[0]


def carries_imm(code: int) -> bool:
    """Whether an opcode's imm is a plain operand (where a -D constant can end up)."""
    cls = code & 0x07
    if cls in (_CLASS_ALU, _CLASS_ALU64, _CLASS_JMP, _CLASS_JMP32):
        return not code & _BPF_X and code not in (BPF_CALL, BPF_EXIT)
    return cls == _CLASS_ST or code == BPF_LD_IMM64


def scan(insns: bytes) -> tuple[list[int], list[str]]:
    """Where `insns` refer to maps, and what in them this loader cannot relocate.

    Returns (indexes of ld_imm64 with src_reg BPF_PSEUDO_MAP_FD, problems).
    A 64-bit load with any other src_reg (a map value, a BTF id, a
    function) or a call to anything but a helper or a function of the same
    program would need a relocation this loader does not do.
    """
    refs: list[int] = []
    problems: list[str] = []
    n = len(insns) // INSN_SIZE
    i = 0
    while i < n:
        code, src, _imm = insn_fields(insns, i)
        if code == BPF_LD_IMM64:
            if i + 1 >= n:
                problems.append(f"ld_imm64 at {i} is cut off")
                break
            if src == BPF_PSEUDO_MAP_FD:
                if _IMM.unpack_from(insns, (i + 1) * INSN_SIZE + 4)[0] != 0:
                    problems.append(f"map reference at {i} has an offset")
                refs.append(i)
            elif src != 0:
                problems.append(f"ld_imm64 at {i} needs relocation kind {src}")
            i += 2
            continue
        if code == BPF_CALL and src not in (0, BPF_PSEUDO_CALL):
            problems.append(f"call at {i} needs relocation kind {src}")
        i += 1
    return refs, problems


def constant_sites(insns: bytes, value: int) -> list[int]:
    """Instructions whose immediate operand is `value` (a -D placeholder)."""
    n = len(insns) // INSN_SIZE
    out: list[int] = []
    i = 0
    while i < n:
        code, _src, imm = insn_fields(insns, i)
        if carries_imm(code) and imm == value:
            out.append(i)
        i += 2 if code == BPF_LD_IMM64 else 1
    return out


def patched(artifact: Artifact, index: int, map_fds: list[int],
            constants: Mapping[str, int]) -> bytes:
    """Program `index`'s instructions with the maps' fds and this run's constants written in."""
    prog = artifact.programs[index]
    out = bytearray(prog.insns)
    for at, m in prog.map_refs:
        _IMM.pack_into(out, at * INSN_SIZE + 4, map_fds[m])
    for c in artifact.constants:
        value = constants.get(c.name)
        if value is None:
            raise ArtifactInvalid(f"no value for constant {c.name}")
        if not 0 <= value < 1 << 31:
            raise ArtifactInvalid(f"{c.name}={value} does not fit an immediate")
        for p, at in c.sites:
            if p == index:
                _IMM.pack_into(out, at * INSN_SIZE + 4, value)
    return bytes(out)


# --- the file ---------------------------------------------------------------------


def body_of(a: Artifact) -> dict[str, Any]:
    """The JSON body of an artifact."""
    return {
        "format": FORMAT,
        "key": a.key,
        "license": a.license,
        "kern_version": a.kern_version,
        "compiler": {"bcc": a.compiler.bcc_version,
                     "libbcc": [a.compiler.libbcc_path, a.compiler.libbcc_size,
                                a.compiler.libbcc_mtime_ns]},
        "maps": [{"name": m.name, "type": m.type, "key_size": m.key_size,
                  "value_size": m.value_size, "max_entries": m.max_entries, "flags": m.flags}
                 for m in a.maps],
        "programs": [{"name": p.name, "type": p.type,
                      "insns": base64.b64encode(p.insns).decode(),
                      "map_refs": [list(r) for r in p.map_refs]} for p in a.programs],
        "constants": [{"name": c.name, "placeholder": c.placeholder,
                       "sites": [list(s) for s in c.sites]} for c in a.constants],
    }


def encode(a: Artifact) -> bytes:
    """The bytes of an artifact file."""
    body = json.dumps(body_of(a), separators=(",", ":"), sort_keys=True).encode()
    digest = hashlib.sha256(body).hexdigest()
    return b"%s %d %s %s\n" % (MAGIC, FORMAT, a.key.encode(), digest.encode()) + body


def decode(data: bytes, key: str) -> Artifact:
    """The artifact in `data`, which must be the one for `key`; ArtifactInvalid otherwise."""
    if len(data) > MAX_BYTES:
        raise ArtifactInvalid("too large")
    header, nl, body = data.partition(b"\n")
    if not nl or len(header) > 256:
        raise ArtifactInvalid("no header line")
    parts = header.split(b" ")
    if len(parts) != 4 or parts[0] != MAGIC:
        raise ArtifactInvalid("not an offtop artifact")
    if parts[1] != str(FORMAT).encode():
        raise ArtifactInvalid(f"format {parts[1]!r}, this offtop reads {FORMAT}")
    if parts[2] != key.encode():
        raise ArtifactInvalid("made for another key than its name says")
    if hashlib.sha256(body).hexdigest().encode() != parts[3]:
        raise ArtifactInvalid("content does not match its hash (cut short or altered)")
    try:
        doc = json.loads(body)
    except (ValueError, UnicodeDecodeError) as e:
        raise ArtifactInvalid(f"body is not JSON: {e}") from None
    return from_body(doc, key)


def _int(doc: Mapping[str, Any], name: str, lo: int, hi: int) -> int:
    v = doc.get(name)
    if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
        raise ArtifactInvalid(f"{name}={v!r} is not an integer in [{lo}, {hi}]")
    return v


def _str(doc: Mapping[str, Any], name: str, pattern: re.Pattern[str] | None = None,
         limit: int = 4096) -> str:
    v = doc.get(name)
    if not isinstance(v, str) or len(v) > limit or not v.isprintable():
        raise ArtifactInvalid(f"{name} is not a short printable string")
    if pattern is not None and not pattern.match(v):
        raise ArtifactInvalid(f"{name}={v!r} is not a valid name")
    return v


def _list(doc: Mapping[str, Any], name: str, limit: int) -> list[Any]:
    v = doc.get(name)
    if not isinstance(v, list) or len(v) > limit:
        raise ArtifactInvalid(f"{name} is not a list of at most {limit}")
    return v


def _dict(v: Any, what: str) -> Mapping[str, Any]:
    if not isinstance(v, dict):
        raise ArtifactInvalid(f"{what} is not an object")
    return v


def _pairs(v: Any, what: str, bounds: tuple[int, int]) -> tuple[tuple[int, int], ...]:
    if not isinstance(v, list) or len(v) > MAX_INSNS:
        raise ArtifactInvalid(f"{what} is not a list")
    out = []
    for pair in v:
        if (not isinstance(pair, list) or len(pair) != 2
                or not all(isinstance(x, int) and not isinstance(x, bool) for x in pair)
                or not (0 <= pair[0] < bounds[0] and 0 <= pair[1] < bounds[1])):
            raise ArtifactInvalid(f"{what} has a bad entry {pair!r}")
        out.append((pair[0], pair[1]))
    return tuple(out)


def from_body(doc: Any, key: str) -> Artifact:
    """An artifact from its parsed JSON body, every field checked (see the module docstring)."""
    doc = _dict(doc, "the body")
    if doc.get("format") != FORMAT or doc.get("key") != key or not _HEX64.match(key):
        raise ArtifactInvalid("format or key inside the body do not match")
    lic = _str(doc, "license", limit=128)
    kern_version = _int(doc, "kern_version", 0, 0xFFFFFFFF)
    comp = _dict(doc.get("compiler"), "compiler")
    lib = comp.get("libbcc")
    if (not isinstance(lib, list) or len(lib) != 3 or not isinstance(lib[0], str)
            or not all(isinstance(x, int) and not isinstance(x, bool) for x in lib[1:])):
        raise ArtifactInvalid("compiler.libbcc is not [path, size, mtime_ns]")
    compiler = CompilerId(_str(comp, "bcc", limit=64), lib[0], lib[1], lib[2])

    maps = []
    for m in _list(doc, "maps", 256):
        m = _dict(m, "a map")
        mtype = _int(m, "type", 0, 1 << 16)
        if mtype not in MAP_TYPES:
            raise ArtifactInvalid(f"map type {mtype} is unknown to this loader")
        flags = _int(m, "flags", 0, 0xFFFFFFFF)
        if flags & ~KNOWN_MAP_FLAGS:
            raise ArtifactInvalid(f"map flags {flags:#x} are unknown to this loader")
        maps.append(MapSpec(_str(m, "name", _NAME), mtype, _int(m, "key_size", 1, 1 << 16),
                            _int(m, "value_size", 1, 1 << 24),
                            _int(m, "max_entries", 1, 1 << 28), flags))
    if len({m.name for m in maps}) != len(maps):
        raise ArtifactInvalid("two maps have one name")

    programs = []
    for p in _list(doc, "programs", 64):
        p = _dict(p, "a program")
        name = _str(p, "name", _NAME)
        ptype = _int(p, "type", 0, 1 << 16)
        if ptype != program_type(name):
            raise ArtifactInvalid(f"program {name} is not of type {program_type(name)}")
        try:
            insns = base64.b64decode(_str(p, "insns", limit=MAX_BYTES), validate=True)
        except (binascii.Error, ValueError):
            raise ArtifactInvalid(f"program {name}: instructions are not base64") from None
        n = len(insns) // INSN_SIZE
        if not insns or len(insns) % INSN_SIZE or n > MAX_INSNS:
            raise ArtifactInvalid(f"program {name}: {len(insns)} bytes of instructions")
        refs = _pairs(p.get("map_refs"), f"{name}.map_refs", (n, len(maps)))
        found, problems = scan(insns)
        if problems:
            raise ArtifactInvalid(f"program {name}: {problems[0]}")
        if sorted(found) != sorted(at for at, _ in refs) or len(set(found)) != len(refs):
            raise ArtifactInvalid(f"program {name}: map references do not match the code")
        programs.append(Program(name, ptype, insns, refs))
    if not programs or len({p.name for p in programs}) != len(programs):
        raise ArtifactInvalid("no programs, or two with one name")

    constants = []
    for c in _list(doc, "constants", 16):
        c = _dict(c, "a constant")
        name = _str(c, "name", _NAME)
        placeholder = _int(c, "placeholder", 1, (1 << 31) - 1)
        sites = _pairs(c.get("sites"), f"{name}.sites",
                       (len(programs), max(p.insn_count for p in programs)))
        for pi, at in sites:
            prog = programs[pi]
            if at >= prog.insn_count:
                raise ArtifactInvalid(f"{name}: site {at} is outside {prog.name}")
            code, _src, imm = insn_fields(prog.insns, at)
            if not carries_imm(code) or imm != placeholder:
                raise ArtifactInvalid(f"{name}: site {at} of {prog.name} does not hold it")
        constants.append(Constant(name, placeholder, sites))
    return Artifact(key, lic, kern_version, compiler, tuple(maps), tuple(programs),
                    tuple(constants))
