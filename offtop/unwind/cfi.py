"""DWARF call-frame information (.eh_frame, .debug_frame) to per-FDE rule rows.

The format is DWARF 5 section 6.4 plus the LSB's .eh_frame changes (CIE
pointers relative to the field, augmentation strings, pointer encodings).
Every read is checked: the bytes come from files other processes map, so a
length that runs past the section, a CIE pointer into nowhere, an unknown
opcode or a program that never ends cost one counted bad entry, never a
hang: the number of entries and of interpreted instructions are capped.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from offtop.unwind.rules import RBP, RSP, CfaKind, RegKind

_U16 = struct.Struct("<H").unpack_from
_U32 = struct.Struct("<I").unpack_from
_U64 = struct.Struct("<Q").unpack_from
_S16 = struct.Struct("<h").unpack_from
_S32 = struct.Struct("<i").unpack_from
_S64 = struct.Struct("<q").unpack_from
_MASK64 = (1 << 64) - 1

DW_EH_PE_omit = 0xFF
DW_EH_PE_indirect = 0x80

#: One interpreter state: (cfa kind, reg, off, arg), (ra kind, reg, off), (rbp kind, reg, off).
State = tuple[tuple[int, int, int, int], tuple[int, int, int], tuple[int, int, int]]
#: A row's rule as interned: the state, and whether the CIE marks a signal frame ('S').
StateKey = tuple[tuple[int, int, int, int], tuple[int, int, int], tuple[int, int, int], bool]
#: Rows of one FDE: (pc relative to the FDE's start, interned rule id).
Rows = tuple[tuple[int, int], ...]


class CfiError(ValueError):
    """A malformed or unsupported entry."""


@dataclass(frozen=True, slots=True)
class CfiLimits:
    """Caps that bound the work and memory spent on one file."""

    max_entries: int = 1_000_000  #: CIEs + FDEs read per section (libLLVM-15 has ~100k)
    max_ops_per_program: int = 20_000  #: CFA instructions interpreted per FDE
    max_state_stack: int = 64  #: depth of DW_CFA_remember_state
    max_rows: int = 4_000_000  #: rows in one full table (libLLVM-15 has ~1M)
    max_build_s: float = 10.0  #: time one full table may take to build (libLLVM-15: ~1.7 s)


@dataclass(slots=True)
class ParseStats:
    """What parsing one section found, errors counted by cause."""

    fdes: int = 0
    cies: int = 0
    bad_entries: dict[str, int] = field(default_factory=dict)
    truncated: bool = False  #: a cap was reached: later entries were not read

    def bad(self, cause: str) -> None:
        """Count one entry that could not be used."""
        self.bad_entries[cause] = self.bad_entries.get(cause, 0) + 1


@dataclass(frozen=True, slots=True)
class Bases:
    """Where a section is, for pointer encodings relative to something."""

    section_vaddr: int  #: the section's own address (pcrel)
    text: int | None = None  #: DW_EH_PE_textrel base
    data: int | None = None  #: DW_EH_PE_datarel base (the GOT in .eh_frame)
    read_u64: Callable[[int], int | None] | None = None  #: reads a pointer for DW_EH_PE_indirect


def uleb(data: bytes, pos: int) -> tuple[int, int]:
    """An unsigned LEB128 at `pos`: (value, next position)."""
    b = data[pos]
    if b < 0x80:
        return b, pos + 1
    result = b & 0x7F
    shift = 7
    while True:
        pos += 1
        b = data[pos]
        result |= (b & 0x7F) << shift
        if b < 0x80:
            return result, pos + 1
        shift += 7
        if shift > 70:
            raise CfiError("LEB128 longer than 10 bytes")


def sleb(data: bytes, pos: int) -> tuple[int, int]:
    """A signed LEB128 at `pos`: (value, next position)."""
    result = 0
    shift = 0
    while True:
        b = data[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        shift += 7
        if b < 0x80:
            if b & 0x40:
                result -= 1 << shift
            return result, pos
        if shift > 70:
            raise CfiError("LEB128 longer than 10 bytes")


def read_encoded(data: bytes, pos: int, enc: int, bases: Bases, *, apply: bool = True) -> tuple[int, int]:
    """A pointer in DW_EH_PE encoding `enc` at `pos`: (value, next position).

    `apply=False` reads only the value's format (an FDE's address range is
    encoded like its start but is a length, never relative).
    """
    fmt = enc & 0x0F
    if fmt == 0x0B:
        v, end = _S32(data, pos)[0], pos + 4
    elif fmt in (0x00, 0x04):
        v, end = _U64(data, pos)[0], pos + 8
    elif fmt == 0x03:
        v, end = _U32(data, pos)[0], pos + 4
    elif fmt == 0x0C:
        v, end = _S64(data, pos)[0], pos + 8
    elif fmt == 0x02:
        v, end = _U16(data, pos)[0], pos + 2
    elif fmt == 0x0A:
        v, end = _S16(data, pos)[0], pos + 2
    elif fmt == 0x01:
        v, end = uleb(data, pos)
    elif fmt == 0x09:
        v, end = sleb(data, pos)
    else:
        raise CfiError(f"pointer format {fmt:#x}")
    if not apply:
        return v, end
    app = enc & 0x70
    if app == 0x10:
        v += bases.section_vaddr + pos
    elif app == 0x30:
        if bases.data is None:
            raise CfiError("datarel pointer without a data base")
        v += bases.data
    elif app == 0x20:
        if bases.text is None:
            raise CfiError("textrel pointer without a text base")
        v += bases.text
    elif app != 0:
        raise CfiError(f"pointer application {app:#x}")
    v &= _MASK64
    if enc & DW_EH_PE_indirect:
        target = bases.read_u64(v) if bases.read_u64 is not None else None
        if target is None:
            raise CfiError("indirect pointer not readable from the file")
        v = target
    return v, end


@dataclass(slots=True)
class Cie:
    """A Common Information Entry, as far as unwinding needs it."""

    code_align: int
    data_align: int
    ra_reg: int
    fde_enc: int  #: DW_EH_PE encoding of FDE addresses
    has_aug_data: bool  #: 'z': FDEs carry an augmentation data length
    signal_frame: bool  #: 'S': frames of this CIE are signal trampolines
    initial: bytes  #: initial instructions
    init_state: State | None = None  #: state after `initial` (computed on first use)


@dataclass(frozen=True, slots=True)
class Fde:
    """One FDE: [start, start+size) and its instruction bytes."""

    start: int
    size: int
    cie_offset: int
    program: bytes


def parse_cie(data: bytes, pos: int, end: int, bases: Bases) -> Cie:
    """The CIE whose body (after the CIE id) runs from `pos` to `end`."""
    version = data[pos]
    pos += 1
    if version not in (1, 3, 4):
        raise CfiError(f"CIE version {version}")
    nul = data.find(b"\0", pos, end)
    if nul < 0:
        raise CfiError("CIE augmentation string not terminated")
    aug = data[pos:nul].decode("ascii", "replace")
    pos = nul + 1
    if aug and aug[0] != "z" and aug != "S":
        # "eh" (pre-2000 GCC) and vendor strings change the layout: unusable.
        raise CfiError(f"augmentation {aug!r}")
    if version == 4:
        address_size, segment_size = data[pos], data[pos + 1]
        pos += 2
        if address_size != 8 or segment_size != 0:
            raise CfiError(f"address size {address_size}, segment size {segment_size}")
    code_align, pos = uleb(data, pos)
    data_align, pos = sleb(data, pos)
    if version == 1:
        ra_reg = data[pos]
        pos += 1
    else:
        ra_reg, pos = uleb(data, pos)
    fde_enc = 0x00  # absptr unless 'R' says otherwise
    signal = False
    has_z = aug.startswith("z")
    if has_z:
        aug_len, pos = uleb(data, pos)
        aug_end = pos + aug_len
        if aug_end > end:
            raise CfiError("CIE augmentation data runs past the CIE")
        for ch in aug[1:]:
            if ch == "R":
                fde_enc = data[pos]
                pos += 1
            elif ch == "L":
                pos += 1  # the LSDA encoding: exception tables are not our business
            elif ch == "P":
                penc = data[pos]
                # The personality routine's address is skipped: read only its size.
                _, pos = read_encoded(data, pos + 1, penc & 0x7F, bases, apply=False)
            elif ch == "S":
                signal = True
            elif ch == "B":
                pass  # AArch64 BTI marker: no data
            elif "R" in aug[aug.index(ch):]:
                raise CfiError(f"augmentation {aug!r}: unknown data before the FDE encoding")
            else:
                break  # unknown, and nothing we need after it: the length skips the rest
        pos = aug_end
    elif aug == "S":
        signal = True
    if code_align == 0 or code_align > 1 << 16 or abs(data_align) > 1 << 16:
        raise CfiError(f"alignment factors {code_align}, {data_align}")
    return Cie(code_align, data_align, ra_reg, fde_enc, has_z, signal, data[pos:end])


@dataclass(frozen=True, slots=True)
class _Entry:
    """Where one CIE or FDE is: [start, end), its body from `body`."""

    start: int
    body: int
    end: int
    is_cie: bool
    cie_at: int  #: for an FDE: the section offset of its CIE


def _entry(data: bytes, pos: int, *, eh: bool) -> _Entry | None:
    """The entry at `pos`; None for a zero length (the .eh_frame terminator)."""
    n = len(data)
    start = pos
    length = _U32(data, pos)[0]
    pos += 4
    if length == 0:
        return None
    wide = length == 0xFFFFFFFF
    if wide:
        length = _U64(data, pos)[0]
        pos += 8
    end = pos + length
    id_size = 8 if wide and not eh else 4  # .eh_frame's CIE pointer is 4 bytes even then
    if end > n or length < id_size:
        raise CfiError("entry length runs past the section")
    id_pos = pos
    cie_id = (_U64 if id_size == 8 else _U32)(data, pos)[0]
    if eh:
        is_cie = cie_id == 0
        cie_at = id_pos - cie_id
    else:
        is_cie = cie_id == (_MASK64 if id_size == 8 else 0xFFFFFFFF)
        cie_at = cie_id
    return _Entry(start, pos + id_size, end, is_cie, cie_at)


def iter_entries(data: bytes, bases: Bases, *, eh: bool, limits: CfiLimits,
                 stats: ParseStats) -> Iterator[tuple[Fde, Cie]]:
    """Every usable FDE of a .eh_frame (`eh`) or .debug_frame section, with its CIE.

    Bad entries are counted in `stats` and skipped; a length that leaves the
    section ends the walk (nothing after it can be found again).
    """
    cies: dict[int, Cie | None] = {}
    pos = 0
    n = len(data)
    entries = 0
    while pos + 4 <= n:
        entries += 1
        if entries > limits.max_entries:
            stats.truncated = True
            return
        try:
            e = _entry(data, pos, eh=eh)
        except (CfiError, struct.error):
            stats.bad("length")
            return
        if e is None:
            if eh:
                return  # the .eh_frame terminator
            pos += 4
            continue
        try:
            if e.is_cie:
                stats.cies += 1
                if e.start not in cies:
                    cies[e.start] = parse_cie(data, e.body, e.end, bases)
            else:
                fde = _parse_fde(data, e.body, e.end, e.cie_at, cies, bases, eh=eh)
                if fde is None:
                    if cies.get(e.cie_at) is None:
                        stats.bad("fde_of_bad_cie")
                else:
                    stats.fdes += 1
                    yield fde, fde_cie(cies, fde)
        except (CfiError, IndexError, struct.error) as err:
            if e.is_cie:
                cies[e.start] = None
            stats.bad("format" if isinstance(err, CfiError) else type(err).__name__)
        pos = e.end


def fde_cie(cies: dict[int, Cie | None], fde: Fde) -> Cie:
    """The (already parsed) CIE of an FDE returned by this module."""
    cie = cies[fde.cie_offset]
    assert cie is not None
    return cie


#: The longest .eh_frame entry `fde_read` reads (real ones are well under 1 KB).
MAX_ENTRY_BYTES = 1 << 20


def fde_read(read: Callable[[int, int], bytes], size: int, pos: int, bases: Bases,
             cies: dict[int, Cie | None]) -> Fde | None:
    """The .eh_frame FDE at section offset `pos` (as .eh_frame_hdr points to it), of a
    section of `size` bytes read piecewise: `read(offset, n)` gives its bytes at
    `offset` (fewer past its end). Only the FDE's own bytes are read, and its CIE's
    the first time (kept in `cies` by section offset).

    None when `pos` holds no usable FDE; CfiError (or IndexError) when malformed.
    """
    if not 0 <= pos <= size - 8:
        raise CfiError("FDE pointer outside the section")
    window = _entry_bytes(read, size, pos)
    e = _entry(window, 0, eh=True)
    if e is None or e.is_cie:
        return None
    cie_at = pos + e.cie_at
    if cie_at not in cies:
        if not 0 <= cie_at < size - 8:
            raise CfiError("CIE pointer outside the section")
        try:
            cies[cie_at] = _parse_cie_at(_entry_bytes(read, size, cie_at), 0,
                                         _moved(bases, cie_at), eh=True)
        except (CfiError, IndexError, struct.error):
            cies[cie_at] = None
            raise
    return _parse_fde(window, e.body, e.end, cie_at, cies, _moved(bases, pos), eh=True)


def _entry_bytes(read: Callable[[int, int], bytes], size: int, at: int) -> bytes:
    """The whole entry at section offset `at` (its length field first)."""
    head = read(at, 12)
    if len(head) < 4:
        raise CfiError("entry runs past the section")
    length = _U32(head, 0)[0]
    total = 4 + length
    if length == 0xFFFFFFFF:
        if len(head) < 12:
            raise CfiError("entry runs past the section")
        total = 12 + _U64(head, 4)[0]
    if total > MAX_ENTRY_BYTES or at + total > size:
        raise CfiError("entry length runs past the section")
    window = read(at, total)
    if len(window) != total:
        raise CfiError("entry not read whole")
    return window


def _moved(bases: Bases, pos: int) -> Bases:
    """`bases` for bytes that begin `pos` into the section (pc-relative pointers)."""
    return Bases(bases.section_vaddr + pos, bases.text, bases.data, bases.read_u64)


def _parse_fde(data: bytes, pos: int, end: int, cie_at: int, cies: dict[int, Cie | None],
               bases: Bases, *, eh: bool) -> Fde | None:
    if cie_at not in cies:
        # A CIE after its FDEs (legal in .debug_frame), or first seen through
        # .eh_frame_hdr: parse it where it is, once.
        if not 0 <= cie_at < len(data) - 8:
            raise CfiError("CIE pointer outside the section")
        try:
            cies[cie_at] = _parse_cie_at(data, cie_at, bases, eh=eh)
        except (CfiError, IndexError, struct.error):
            cies[cie_at] = None
            raise
    cie = cies[cie_at]
    if cie is None:
        return None
    start, pos = read_encoded(data, pos, cie.fde_enc, bases)
    size, pos = read_encoded(data, pos, cie.fde_enc & 0x0F, bases, apply=False)
    if cie.has_aug_data:
        aug_len, pos = uleb(data, pos)
        pos += aug_len
    if pos > end:
        raise CfiError("FDE header runs past the FDE")
    size &= _MASK64
    if size == 0 or start == 0:
        return None  # a discarded function's FDE (the linker zeroes it): no code
    if start + size > _MASK64:
        raise CfiError("FDE range runs past the address space")
    return Fde(start, size, cie_at, data[pos:end])


def _parse_cie_at(data: bytes, at: int, bases: Bases, *, eh: bool) -> Cie | None:
    length = _U32(data, at)[0]
    if length in (0, 0xFFFFFFFF):
        raise CfiError("CIE pointer to a terminator or a 64-bit entry")
    end = at + 4 + length
    if end > len(data):
        raise CfiError("CIE runs past the section")
    cie_id = _U32(data, at + 4)[0]
    if cie_id != (0 if eh else 0xFFFFFFFF):
        raise CfiError("CIE pointer to an FDE")
    return parse_cie(data, at + 8, end, bases)


# --- the CFA program interpreter ---------------------------------------------

# Plain ints in the hot loop: IntEnum comparisons and hashes cost several times more.
_C_NONE = int(CfaKind.NONE)
_C_RSP = int(CfaKind.RSP)
_C_RBP = int(CfaKind.RBP)
_C_REG = int(CfaKind.REG)
_C_DEREF = int(CfaKind.DEREF)
_C_PLT = int(CfaKind.PLT)
_C_UNSUPPORTED = int(CfaKind.UNSUPPORTED)
_R_SAME = int(RegKind.SAME)
_R_UNDEFINED = int(RegKind.UNDEFINED)
_R_OFFSET = int(RegKind.OFFSET)
_R_VAL_OFFSET = int(RegKind.VAL_OFFSET)
_R_REGISTER = int(RegKind.REGISTER)
_R_AT_REG = int(RegKind.AT_REG)
_R_UNSUPPORTED = int(RegKind.UNSUPPORTED)

_NO_RULE: tuple[int, int, int, int] = (_C_NONE, 0, 0, 0)
_SAME: tuple[int, int, int] = (_R_SAME, 0, 0)
_UNDEF: tuple[int, int, int] = (_R_UNDEFINED, 0, 0)
_UNSUP: tuple[int, int, int] = (_R_UNSUPPORTED, 0, 0)
_CFA_UNSUP: tuple[int, int, int, int] = (_C_UNSUPPORTED, 0, 0, 0)
_RSP_CFA = [(int(_C_RSP), RSP, off, 0) for off in range(128)]
#: Offsets beyond this are nonsense for a stack frame: the rule is unsupported.
_MAX_OFFSET = 1 << 31


def _cfa_reg(reg: int, off: int) -> tuple[int, int, int, int]:
    if abs(off) >= _MAX_OFFSET:
        return _CFA_UNSUP
    if reg == RSP:
        return (_C_RSP, RSP, off, 0)
    if reg == RBP:
        return (_C_RBP, RBP, off, 0)
    if reg < 17:
        return (_C_REG, reg, off, 0)
    return _CFA_UNSUP


def cfa_expression(expr: bytes) -> tuple[int, int, int, int]:
    """The CFA rule of a DW_CFA_def_cfa_expression, for the patterns unwinders meet.

    Recognized: `breg7 N; breg16 0; lit15; and; litK; ge; lit3; shl; plus`
    (ld's PLT entries: CFA = rsp + N, plus 8 once the entry has pushed its
    index), and `bregR N; deref [; plus_uconst M]` with R rsp or rbp (stacks
    realigned by GCC: CFA = *(R + N) + M). Anything else is unsupported.
    """
    try:
        op = expr[0]
        if op == 0x77:  # DW_OP_breg7 (rsp)
            n, p = sleb(expr, 1)
            tail = expr[p:]
            if (len(tail) == 9 and tail[:4] == b"\x80\x00\x3f\x1a" and 0x30 <= tail[4] <= 0x4F
                    and tail[5:] == b"\x2a\x33\x24\x22"):
                return (_C_PLT, RSP, n, tail[4] - 0x30)
        if op in (0x76, 0x77):  # DW_OP_breg6 (rbp), DW_OP_breg7 (rsp)
            n, p = sleb(expr, 1)
            if expr[p:p + 1] == b"\x06":  # DW_OP_deref
                p += 1
                m = 0
                if p < len(expr) and expr[p] == 0x23:  # DW_OP_plus_uconst
                    m, p = uleb(expr, p + 1)
                if p == len(expr) and abs(n) < _MAX_OFFSET and m < _MAX_OFFSET:
                    return (_C_DEREF, op - 0x70, n, m)
    except (IndexError, CfiError):
        pass
    return _CFA_UNSUP


def _reg_expression(expr: bytes) -> tuple[int, int, int]:
    # DW_CFA_expression with a lone `bregR N`: saved at R + N (GCC's realigned
    # frames save rbp this way: DW_OP_breg6 0).
    try:
        if 0x70 <= expr[0] <= 0x80:
            n, p = sleb(expr, 1)
            if p == len(expr) and abs(n) < _MAX_OFFSET:
                return (_R_AT_REG, expr[0] - 0x70, n)
    except (IndexError, CfiError):
        pass
    return _UNSUP


def initial_state(cie: Cie, limits: CfiLimits, intern: dict[StateKey, int]) -> State:
    """The state after a CIE's initial instructions (cached on the CIE)."""
    if cie.init_state is None:
        start: State = (_NO_RULE, _SAME, _SAME)
        _, final = run_program(cie.initial, cie, start, start, 0, limits, intern)
        cie.init_state = final
    return cie.init_state


def run_program(code: bytes, cie: Cie, init: State, state: State, pc_begin: int,
                limits: CfiLimits, intern: dict[StateKey, int]) -> tuple[list[tuple[int, int]], State]:
    """Interpret CFA instructions: rows (pc - pc_begin, rule id) and the final state.

    `init` is the CIE's state (what DW_CFA_restore returns to), `state` the
    state to start from. Rules of registers other than the CFA, rbp and the
    return address are not kept. Rule ids come from `intern`, shared by a
    whole file so equal rules get one id.
    """
    cfa, ra, bp = state
    ra_reg = cie.ra_reg
    caf = cie.code_align
    daf = cie.data_align
    stack: list[State] = []
    signal = cie.signal_frame
    rows: list[tuple[int, int]] = []
    loc = 0
    pos = 0
    n = len(code)
    ops = 0
    max_ops = limits.max_ops_per_program

    # The state last recorded: an advance with nothing changed since adds no row.
    last: list[object] = [None, None, None]

    def record() -> None:
        last[0], last[1], last[2] = cfa, ra, bp
        key = (cfa, ra, bp, signal)
        rid = intern.get(key)
        if rid is None:
            rid = intern[key] = len(intern) + 1  # 0 means "no rule"
        if rows and rows[-1][0] == loc:
            rows[-1] = (loc, rid)
            if len(rows) > 1 and rows[-2][1] == rid:
                rows.pop()
        elif not rows or rows[-1][1] != rid:
            rows.append((loc, rid))

    while pos < n:
        ops += 1
        if ops > max_ops:
            raise CfiError("CFA program too long")
        op = code[pos]
        pos += 1
        hi = op & 0xC0
        reg = -1
        rule: tuple[int, int, int] | None = None
        if hi == 0x40:  # DW_CFA_advance_loc
            if cfa is not last[0] or ra is not last[1] or bp is not last[2]:
                record()
            loc += (op & 0x3F) * caf
            continue
        if hi == 0x80:  # DW_CFA_offset
            reg = op & 0x3F
            off, pos = uleb(code, pos)
            rule = (_R_OFFSET, 0, off * daf)
        elif hi == 0xC0:  # DW_CFA_restore
            reg = op & 0x3F
            rule = init[1] if reg == ra_reg else init[2]
        elif op == 0x0E:  # DW_CFA_def_cfa_offset
            off = code[pos]
            if off < 0x80 and cfa[0] == _C_RSP:  # the push/pop fast path
                pos += 1
                cfa = _RSP_CFA[off]
            else:
                off, pos = uleb(code, pos)
                cfa = (_cfa_reg(cfa[1], off) if cfa[0] in (_C_RSP, _C_RBP, _C_REG)
                       else _CFA_UNSUP)
        elif op == 0x0C:  # DW_CFA_def_cfa
            r, pos = uleb(code, pos)
            off, pos = uleb(code, pos)
            cfa = _cfa_reg(r, off)
        elif op == 0x0D:  # DW_CFA_def_cfa_register
            r, pos = uleb(code, pos)
            cfa = _cfa_reg(r, cfa[2]) if cfa[0] in (_C_RSP, _C_RBP, _C_REG) else _CFA_UNSUP
        elif op == 0x02:  # DW_CFA_advance_loc1
            if cfa is not last[0] or ra is not last[1] or bp is not last[2]:
                record()
            loc += code[pos] * caf
            pos += 1
        elif op == 0x03:  # DW_CFA_advance_loc2
            if cfa is not last[0] or ra is not last[1] or bp is not last[2]:
                record()
            loc += _U16(code, pos)[0] * caf
            pos += 2
        elif op == 0x04:  # DW_CFA_advance_loc4
            if cfa is not last[0] or ra is not last[1] or bp is not last[2]:
                record()
            loc += _U32(code, pos)[0] * caf
            pos += 4
        elif op == 0x0A:  # DW_CFA_remember_state
            if len(stack) >= limits.max_state_stack:
                raise CfiError("DW_CFA_remember_state nested too deep")
            stack.append((cfa, ra, bp))
        elif op == 0x0B:  # DW_CFA_restore_state
            if not stack:
                raise CfiError("DW_CFA_restore_state without remember_state")
            # DWARF: the CFA rule is restored too (GCC relies on it after epilogues).
            cfa, ra, bp = stack.pop()
        elif op == 0x00:  # DW_CFA_nop
            pass
        elif op == 0x2E:  # DW_CFA_GNU_args_size: only matters for landing pads
            _, pos = uleb(code, pos)
        elif op == 0x05:  # DW_CFA_offset_extended
            reg, pos = uleb(code, pos)
            off, pos = uleb(code, pos)
            rule = (_R_OFFSET, 0, off * daf)
        elif op == 0x11:  # DW_CFA_offset_extended_sf
            reg, pos = uleb(code, pos)
            off, pos = sleb(code, pos)
            rule = (_R_OFFSET, 0, off * daf)
        elif op == 0x2F:  # DW_CFA_GNU_negative_offset_extended
            reg, pos = uleb(code, pos)
            off, pos = uleb(code, pos)
            rule = (_R_OFFSET, 0, -off * daf)
        elif op == 0x14:  # DW_CFA_val_offset
            reg, pos = uleb(code, pos)
            off, pos = uleb(code, pos)
            rule = (_R_VAL_OFFSET, 0, off * daf)
        elif op == 0x15:  # DW_CFA_val_offset_sf
            reg, pos = uleb(code, pos)
            off, pos = sleb(code, pos)
            rule = (_R_VAL_OFFSET, 0, off * daf)
        elif op == 0x06:  # DW_CFA_restore_extended
            reg, pos = uleb(code, pos)
            rule = init[1] if reg == ra_reg else init[2]
        elif op == 0x07:  # DW_CFA_undefined
            reg, pos = uleb(code, pos)
            rule = _UNDEF
        elif op == 0x08:  # DW_CFA_same_value
            reg, pos = uleb(code, pos)
            rule = _SAME
        elif op == 0x09:  # DW_CFA_register
            reg, pos = uleb(code, pos)
            r2, pos = uleb(code, pos)
            rule = (_R_REGISTER, r2, 0) if r2 < 17 else _UNSUP
        elif op == 0x12:  # DW_CFA_def_cfa_sf
            r, pos = uleb(code, pos)
            off, pos = sleb(code, pos)
            cfa = _cfa_reg(r, off * daf)
        elif op == 0x13:  # DW_CFA_def_cfa_offset_sf
            off, pos = sleb(code, pos)
            cfa = (_cfa_reg(cfa[1], off * daf) if cfa[0] in (_C_RSP, _C_RBP, _C_REG)
                   else _CFA_UNSUP)
        elif op == 0x0F:  # DW_CFA_def_cfa_expression
            size, pos = uleb(code, pos)
            if pos + size > n:
                raise CfiError("expression runs past the program")
            cfa = cfa_expression(code[pos:pos + size])
            pos += size
        elif op in (0x10, 0x16):  # DW_CFA_expression, DW_CFA_val_expression
            reg, pos = uleb(code, pos)
            size, pos = uleb(code, pos)
            if pos + size > n:
                raise CfiError("expression runs past the program")
            rule = _reg_expression(code[pos:pos + size]) if op == 0x10 else _UNSUP
            pos += size
        elif op == 0x01:  # DW_CFA_set_loc: absolute, so rows are relative to pc_begin
            if cie.fde_enc & 0xF0:
                raise CfiError("DW_CFA_set_loc with a relative encoding")
            addr, pos = read_encoded(code, pos, cie.fde_enc, Bases(0), apply=False)
            record()
            loc = addr - pc_begin
            if loc < 0:
                raise CfiError("DW_CFA_set_loc before the FDE")
        else:
            raise CfiError(f"CFA opcode {op:#x}")
        if rule is not None:
            if rule[0] == _R_OFFSET and abs(rule[2]) >= _MAX_OFFSET:
                rule = _UNSUP
            if reg == ra_reg:
                ra = rule
            elif reg == RBP:
                bp = rule
    if pos > n:
        raise CfiError("instruction runs past the program")
    record()
    return rows, (cfa, ra, bp)


def fde_rows(fde: Fde, cie: Cie, limits: CfiLimits, intern: dict[StateKey, int]) -> Rows:
    """The rows of one FDE: (pc - fde.start, rule id), the first at 0."""
    init = initial_state(cie, limits, intern)
    rows, _ = run_program(fde.program, cie, init, init, fde.start, limits, intern)
    return tuple(rows)
