"""Where CPython 3.8-3.13 keep the fields a stack reader follows, per minor version.

The numbers are `offsetof()`/`sizeof()` of CPython's own structs, taken by
compiling `tests/workloads/pystacks_offsets.c` against each version's
headers (Include/internal with Py_BUILD_CORE) for x86-64 (LP64). The
tests compile it again against every header tree found on the machine and
compare, so a table that drifts from its headers fails a test. Structs and
fields, by version:

- runtime `_PyRuntimeState`: `interpreters.head`; 3.8-3.11 also `ceval.gil`
  (`struct _gil_runtime_state`, the GIL itself). 3.13 starts with
  `_Py_DebugOffsets` (cookie "xdebugpy"), which `debug_offsets_layout`
  reads; its numbers take precedence over the table's.
- `PyInterpreterState`: `next`, the thread list head (`tstate_head` up to
  3.10, `threads.head` from 3.11), and from 3.12 `ceval.gil`, a pointer to
  the GIL (per interpreter since PEP 684).
- `struct _gil_runtime_state`: `last_holder` (a PyThreadState*), `locked`.
- `PyThreadState`: `next`, `interp`, `thread_id` (the pthread_t),
  `native_thread_id` (3.11+), and the innermost frame: `frame`
  (PyFrameObject*, 3.8-3.10), `cframe->current_frame` (3.11-3.12),
  `current_frame` (3.13).
- frames: 3.8-3.10 `PyFrameObject` (`f_back`, `f_code`, `f_lasti`); 3.11+
  `_PyInterpreterFrame` (`previous`, `f_code`/`f_executable`,
  `prev_instr`/`instr_ptr`, `owner`, and 3.11's `is_entry`).
- `PyCodeObject`: `co_filename`, `co_name`, `co_qualname` (3.11+),
  `co_firstlineno`, the line table (`co_lnotab` 3.8-3.9, `co_linetable`
  3.10+), `co_code_adaptive` (3.11+, where the bytecode starts).
- str: `PyASCIIObject.length`, `.state`, `sizeof(PyASCIIObject)` and
  `sizeof(PyCompactUnicodeObject)` (where the characters start);
  bytes: `ob_size`, `ob_sval`.

Release builds only: a --with-pydebug build (python3.Xd) adds fields to
every object and is refused by the consistency checks, not misread.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, replace
from typing import Literal

FrameKind = Literal["object", "interpreter"]
LineFormat = Literal["lnotab", "linetable310", "locations"]

#: `_PyInterpreterFrame.owner` values (3.11+).
OWNED_BY_THREAD = 0
OWNED_BY_GENERATOR = 1
OWNED_BY_FRAME_OBJECT = 2
OWNED_BY_CSTACK = 3
"""3.12+: the shim frame a C-level call of the evaluation loop pushes first."""


@dataclass(frozen=True, slots=True)
class Layout:
    """Field offsets of one CPython minor version (see the module docstring)."""

    version: tuple[int, int]
    runtime_interpreters_head: int
    runtime_gil: int | None
    interp_next: int
    interp_threads_head: int
    interp_gil_ptr: int | None
    gil_last_holder: int
    gil_locked: int
    gil_size: int
    tstate_next: int
    tstate_interp: int
    tstate_thread_id: int
    tstate_native_thread_id: int | None
    tstate_frame: int
    """Offset of the innermost frame pointer, or of `cframe` when `cframe_current_frame` is set."""
    cframe_current_frame: int | None
    frame_kind: FrameKind
    frame_back: int
    frame_code: int
    frame_lasti: int | None
    frame_instr: int | None
    frame_is_entry: int | None
    frame_owner: int | None
    frame_read: int
    """How many bytes of a frame hold every field above."""
    code_filename: int
    code_name: int
    code_qualname: int | None
    code_firstlineno: int
    code_linetable: int
    code_adaptive: int | None
    code_read: int
    line_format: LineFormat
    unicode_length: int
    unicode_state: int
    unicode_ascii_size: int
    unicode_compact_size: int
    bytes_size: int
    bytes_sval: int


_V38 = Layout(
    version=(3, 8), runtime_interpreters_head=32, runtime_gil=1152,
    interp_next=0, interp_threads_head=8, interp_gil_ptr=None,
    gil_last_holder=8, gil_locked=16, gil_size=208,
    tstate_next=8, tstate_interp=16, tstate_thread_id=176, tstate_native_thread_id=None,
    tstate_frame=24, cframe_current_frame=None,
    frame_kind="object", frame_back=24, frame_code=32, frame_lasti=104, frame_instr=None,
    frame_is_entry=None, frame_owner=None, frame_read=112,
    code_filename=104, code_name=112, code_qualname=None, code_firstlineno=40, code_linetable=120,
    code_adaptive=None, code_read=128, line_format="lnotab",
    unicode_length=16, unicode_state=32, unicode_ascii_size=48, unicode_compact_size=72,
    bytes_size=16, bytes_sval=32,
)
# 3.9 moved the GIL up in _PyRuntimeState (the pending-calls state went to the interpreter).
_V39 = replace(_V38, version=(3, 9), runtime_gil=352)
# 3.10: f_lasti counts code units, and co_linetable (PEP 626) replaced co_lnotab.
_V310 = replace(_V39, version=(3, 10), frame_lasti=96, frame_read=104, line_format="linetable310")
_V311 = Layout(
    version=(3, 11), runtime_interpreters_head=40, runtime_gil=360,
    interp_next=0, interp_threads_head=16, interp_gil_ptr=None,
    gil_last_holder=8, gil_locked=16, gil_size=208,
    tstate_next=8, tstate_interp=16, tstate_thread_id=152, tstate_native_thread_id=160,
    tstate_frame=56, cframe_current_frame=8,
    frame_kind="interpreter", frame_back=48, frame_code=32, frame_lasti=None, frame_instr=56,
    frame_is_entry=68, frame_owner=69, frame_read=72,
    code_filename=112, code_name=120, code_qualname=128, code_firstlineno=72, code_linetable=136,
    code_adaptive=184, code_read=144, line_format="locations",
    unicode_length=16, unicode_state=32, unicode_ascii_size=48, unicode_compact_size=72,
    bytes_size=16, bytes_sval=32,
)
_V312 = replace(
    _V311, version=(3, 12), interp_threads_head=72, interp_gil_ptr=384, runtime_gil=None,
    tstate_thread_id=136, tstate_native_thread_id=144, cframe_current_frame=0,
    frame_back=8, frame_code=0, frame_is_entry=None, frame_owner=70,
    code_firstlineno=68, code_adaptive=192,
    unicode_ascii_size=40, unicode_compact_size=56,
)
_V313 = replace(
    _V312, version=(3, 13), runtime_interpreters_head=632, interp_next=7264, interp_threads_head=7344,
    interp_gil_ptr=16, tstate_thread_id=152, tstate_native_thread_id=160, tstate_frame=72,
    cframe_current_frame=None, code_adaptive=200,
)

LAYOUTS: dict[tuple[int, int], Layout] = {
    layout.version: layout for layout in (_V38, _V39, _V310, _V311, _V312, _V313)
}

DEBUG_COOKIE = b"xdebugpy"

# _Py_DebugOffsets of 3.13 (Include/internal/pycore_runtime.h): after the
# 8-byte cookie, uint64_t fields in this order. 3.14 changed the struct, so
# only 3.13.x is read this way.
_DEBUG_FIELDS_313 = (
    "version", "free_threaded",
    "runtime.size", "runtime.finalizing", "runtime.interpreters_head",
    "interp.size", "interp.id", "interp.next", "interp.threads_head", "interp.gc",
    "interp.imports_modules", "interp.sysdict", "interp.builtins", "interp.ceval_gil",
    "interp.gil_runtime_state", "interp.gil_enabled", "interp.gil_locked", "interp.gil_holder",
    "tstate.size", "tstate.prev", "tstate.next", "tstate.interp", "tstate.current_frame",
    "tstate.thread_id", "tstate.native_thread_id", "tstate.datastack_chunk", "tstate.status",
    "frame.size", "frame.previous", "frame.executable", "frame.instr_ptr", "frame.localsplus",
    "frame.owner",
    "code.size", "code.filename", "code.name", "code.qualname", "code.linetable",
    "code.firstlineno", "code.argcount", "code.localsplusnames", "code.localspluskinds",
    "code.co_code_adaptive",
    "object.size", "object.ob_type",
    "type.size", "type.tp_name", "type.tp_repr", "type.tp_flags",
    "tuple.size", "tuple.ob_item", "tuple.ob_size",
    "list.size", "list.ob_item", "list.ob_size",
    "dict.size", "dict.ma_keys", "dict.ma_values",
    "float.size", "float.ob_fval",
    "long.size", "long.lv_tag", "long.ob_digit",
    "bytes.size", "bytes.ob_size", "bytes.ob_sval",
    "unicode.size", "unicode.state", "unicode.length", "unicode.asciiobject_size",
)
#: Bytes of `_PyRuntime` to read for the 3.13 debug offsets.
DEBUG_OFFSETS_SIZE = len(DEBUG_COOKIE) + 8 * len(_DEBUG_FIELDS_313)
#: No field of any struct read here lies further in than this: a bigger
#: "offset" in the debug offsets is garbage, not a layout.
_MAX_FIELD_OFFSET = 1 << 16


class LayoutError(ValueError):
    """Debug offsets that are not a 3.13 layout offtop can use."""


def debug_offsets_version(raw: bytes) -> int | None:
    """PY_VERSION_HEX from the start of `_PyRuntime` if it begins with the debug cookie."""
    if len(raw) < 16 or raw[:8] != DEBUG_COOKIE:
        return None
    return int(struct.unpack_from("<Q", raw, 8)[0])


def debug_offsets_layout(raw: bytes) -> Layout:
    """The 3.13 layout, with every field `_Py_DebugOffsets` gives taken from it."""
    if len(raw) < DEBUG_OFFSETS_SIZE or raw[:8] != DEBUG_COOKIE:
        raise LayoutError("no debug offsets")
    values = dict(zip(_DEBUG_FIELDS_313, struct.unpack_from(f"<{len(_DEBUG_FIELDS_313)}Q", raw, 8),
                      strict=True))
    if values["version"] >> 16 != 0x030D:
        raise LayoutError(f"debug offsets of version {values['version']:#x}, not 3.13")
    if values["free_threaded"]:
        raise LayoutError("free-threaded build")
    # Sizes of whole structs may be large (PyInterpreterState is ~100 KiB); offsets of fields read are not.
    fields = {k: v for k, v in values.items() if not k.endswith((".size", "version", "threaded"))}
    if any(v > _MAX_FIELD_OFFSET for v in fields.values()):
        raise LayoutError("debug offsets out of range")
    frame_fields = ("frame.previous", "frame.executable", "frame.instr_ptr")
    code_fields = ("code.filename", "code.name", "code.qualname", "code.linetable", "code.firstlineno")
    return replace(
        _V313,
        runtime_interpreters_head=values["runtime.interpreters_head"],
        interp_next=values["interp.next"],
        interp_threads_head=values["interp.threads_head"],
        interp_gil_ptr=values["interp.ceval_gil"],
        tstate_next=values["tstate.next"],
        tstate_interp=values["tstate.interp"],
        tstate_frame=values["tstate.current_frame"],
        tstate_thread_id=values["tstate.thread_id"],
        tstate_native_thread_id=values["tstate.native_thread_id"],
        frame_back=values["frame.previous"],
        frame_code=values["frame.executable"],
        frame_instr=values["frame.instr_ptr"],
        frame_owner=values["frame.owner"],
        # Pointers end 8 bytes in, `owner` (a char) 1 byte in; rounded up to 8.
        frame_read=(max(*(values[f] + 8 for f in frame_fields), values["frame.owner"] + 1) + 7) // 8 * 8,
        code_filename=values["code.filename"],
        code_name=values["code.name"],
        code_qualname=values["code.qualname"],
        code_linetable=values["code.linetable"],
        code_firstlineno=values["code.firstlineno"],
        code_adaptive=values["code.co_code_adaptive"],
        code_read=max(values[f] for f in code_fields) + 8,
        unicode_state=values["unicode.state"],
        unicode_length=values["unicode.length"],
        unicode_ascii_size=values["unicode.asciiobject_size"],
        # PyCompactUnicodeObject adds utf8_length and utf8 to PyASCIIObject (3.12+).
        unicode_compact_size=values["unicode.asciiobject_size"] + 16,
        bytes_size=values["bytes.ob_size"],
        bytes_sval=values["bytes.ob_sval"],
    )
