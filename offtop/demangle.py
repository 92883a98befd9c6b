"""Symbol names as programmers wrote them: C++, Rust legacy and Rust v0 demangling.

C++ goes through libstdc++'s own demangler. Rust is demangled here, after
the Rust project's documented manglings (the legacy `_ZN...17h<hash>E`
scheme and the v0 scheme, RFC 2603), and printed as `rustc-demangle`'s
alternate form prints them: no crate disambiguators, no legacy hash.

Names come from files other users control, so every demangler here is
bounded: inputs longer than `MAX_MANGLED` are left as they are, v0 parsing
stops at `MAX_DEPTH` levels of nesting and back-references may only point
backwards, and output past `MAX_OUTPUT` characters abandons demangling (a
short v0 name can otherwise expand exponentially through back-references).
A name that does not demangle is returned unchanged.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import string
from collections.abc import Callable
from typing import Any

#: Longer mangled names are not demangled (they are shown as they are).
MAX_MANGLED = 2048
#: Demangled output longer than this abandons demangling.
MAX_OUTPUT = 4096
#: Nesting of paths, types and back-references a v0 name may use.
MAX_DEPTH = 200


def demangle(name: str) -> str:
    """`name` demangled if it is a C++ or Rust symbol, else `name` itself."""
    if len(name) > MAX_MANGLED or not name.startswith("_"):
        return name
    if name.startswith("_R"):
        return demangle_rust_v0(name) or name
    if name.startswith("_ZN"):
        rust = demangle_rust_legacy(name)
        if rust is not None:
            return rust
    if name.startswith("_Z"):
        return _cxx.demangle(name) or name
    return name


# --- shared -----------------------------------------------------------------------


def _split_llvm_suffix(name: str) -> str:
    # ThinLTO appends ".llvm.<hex>" (and sometimes "@@<version>") to local
    # symbols; it names nothing a reader needs.
    i = name.find(".llvm.")
    if i >= 0 and all(c in string.hexdigits or c == "@" for c in name[i + 6:]):
        return name[:i]
    return name


def _symbol_like(suffix: str) -> bool:
    # What rustc-demangle keeps after a path: ".0.0", ".exit.i.i" (LLVM clones).
    return all(c.isascii() and (c.isalnum() or c in string.punctuation) for c in suffix)


# --- Rust legacy (_ZN ... 17h<16 hex digits>E) --------------------------------------

_LEGACY_ESCAPES = {"SP": "@", "BP": "*", "RF": "&", "LT": "<", "GT": ">", "LP": "(", "RP": ")", "C": ","}


def _is_rust_hash(element: str) -> bool:
    return len(element) == 17 and element[0] == "h" and all(c in string.hexdigits for c in element[1:])


def demangle_rust_legacy(name: str) -> str | None:
    """A legacy Rust symbol (`_ZN..17h<hash>E`) demangled without its hash, or None."""
    if not name.startswith("_ZN") or not name.isascii():
        return None
    inner = _split_llvm_suffix(name)[3:]
    elements: list[str] = []
    i = 0
    n = len(inner)
    while True:
        if i >= n:
            return None
        if inner[i] == "E":
            i += 1
            break
        j = i
        while j < n and j - i < 6 and inner[j].isdigit():
            j += 1
        if j == i:
            return None
        length = int(inner[i:j])
        if length == 0 or j + length > n:
            return None
        elements.append(inner[j:j + length])
        i = j + length
    suffix = inner[i:]
    # The hash element is what tells a Rust symbol from a C++ nested name.
    if len(elements) < 2 or not _is_rust_hash(elements[-1]):
        return None
    if suffix and not (suffix.startswith(".") and _symbol_like(suffix)):
        return None
    return "::".join(_legacy_element(e) for e in elements[:-1]) + suffix


def _legacy_element(e: str) -> str:
    if e.startswith("_$"):
        e = e[1:]
    out: list[str] = []
    while e:
        if e.startswith(".."):
            out.append("::")
            e = e[2:]
        elif e.startswith("$"):
            end = e.find("$", 1)
            if end < 0:
                break
            code = e[1:end]
            text = _LEGACY_ESCAPES.get(code)
            if text is None and code.startswith("u") and 1 < len(code) <= 7 and all(
                    c in "0123456789abcdef" for c in code[1:]):
                v = int(code[1:], 16)
                # Control characters stay escaped: they never reach a terminal.
                if 0x20 <= v < 0x110000 and not 0x7F <= v < 0xA0 and not 0xD800 <= v < 0xE000:
                    text = chr(v)
            if text is None:
                break
            out.append(text)
            e = e[end + 1:]
        else:
            stop = min((k for k in (e.find("$"), e.find("..")) if k > 0), default=len(e))
            out.append(e[:stop])
            e = e[stop:]
    out.append(e)
    return "".join(out)


# --- Rust v0 (_R...) ----------------------------------------------------------------

_BASIC_TYPES = {
    "a": "i8", "b": "bool", "c": "char", "d": "f64", "e": "str", "f": "f32", "h": "u8",
    "i": "isize", "j": "usize", "l": "i32", "m": "u32", "n": "i128", "o": "u128", "p": "_",
    "s": "i16", "t": "u16", "u": "()", "v": "...", "x": "i64", "y": "u64", "z": "!",
}
_DIGITS_62 = string.digits + string.ascii_lowercase + string.ascii_uppercase


class _Invalid(Exception):
    """The name is not valid v0, or demangling it would exceed a bound."""


class _V0Printer:
    """Parses a v0 mangled name (without `_R`) and prints it as it goes.

    `skip` > 0 parses without printing (and without following back-references,
    which only repeat what was already parsed): used for an impl's own path
    and to validate the instantiating crate.
    """

    def __init__(self, sym: str) -> None:
        self.s = sym
        self.pos = 0
        self.depth = 0
        self.skip = 0
        self.out: list[str] = []
        self.size = 0
        self.bound_lifetimes = 0

    # - input -

    def peek(self) -> str:
        return self.s[self.pos] if self.pos < len(self.s) else ""

    def eat(self, c: str) -> bool:
        if self.peek() == c:
            self.pos += 1
            return True
        return False

    def next(self) -> str:
        c = self.peek()
        if not c:
            raise _Invalid
        self.pos += 1
        return c

    def push(self) -> None:
        self.depth += 1
        if self.depth > MAX_DEPTH:
            raise _Invalid

    def pop(self) -> None:
        self.depth -= 1

    def emit(self, text: str) -> None:
        if self.skip:
            return
        self.size += len(text)
        if self.size > MAX_OUTPUT:
            raise _Invalid
        self.out.append(text)

    def integer_62(self) -> int:
        if self.eat("_"):
            return 0
        x = 0
        while not self.eat("_"):
            d = _DIGITS_62.find(self.next())
            if d < 0:
                raise _Invalid
            x = x * 62 + d
            if x >= 1 << 64:
                raise _Invalid
        return x + 1

    def opt_integer_62(self, tag: str) -> int:
        return self.integer_62() + 1 if self.eat(tag) else 0

    def decimal(self) -> int:
        c = self.peek()
        if not ("0" <= c <= "9"):
            raise _Invalid
        self.pos += 1
        n = int(c)
        if n:
            while "0" <= self.peek() <= "9" and self.peek():
                n = n * 10 + int(self.next())
                if n > len(self.s):
                    raise _Invalid
        return n

    def ident(self) -> tuple[str, str]:
        """(ascii part, punycode part) of an identifier."""
        puny = self.eat("u")
        n = self.decimal()
        self.eat("_")
        start, end = self.pos, self.pos + n
        if end > len(self.s):
            raise _Invalid
        self.pos = end
        raw = self.s[start:end]
        if not puny:
            return raw, ""
        k = raw.rfind("_")
        ascii_part, code = (raw[:k], raw[k + 1:]) if k >= 0 else ("", raw)
        if not code:
            raise _Invalid
        return ascii_part, code

    def follow_backref(self, fn: Callable[[], Any]) -> Any:
        at = self.pos - 1  # the "B" tag
        target = self.integer_62()
        if target >= at:  # only backwards: no loops
            raise _Invalid
        if self.skip:
            return None
        saved = self.pos
        self.pos = target
        self.push()
        r = fn()
        self.pop()
        self.pos = saved
        return r

    def sep_list(self, fn: Callable[[], Any], sep: str) -> int:
        n = 0
        while not self.eat("E"):
            if n:
                self.emit(sep)
            fn()
            n += 1
        return n

    # - grammar -

    def path(self, in_value: bool) -> None:
        self.push()
        tag = self.next()
        if tag == "C":
            self.opt_integer_62("s")
            self.emit(_ident_text(*self.ident()))
        elif tag == "N":
            ns = self.next()
            if not ns.isalpha() or not ns.isascii():
                raise _Invalid
            self.path(in_value)
            dis = self.opt_integer_62("s")
            name = _ident_text(*self.ident())
            if ns.isupper():  # closures, shims and other special namespaces
                kind = {"C": "closure", "S": "shim"}.get(ns, ns)
                self.emit("::{" + kind + (":" + name if name else "") + f"#{dis}}}")
            elif name:
                self.emit("::" + name)
        elif tag in "MXY":
            if tag != "Y":
                self.opt_integer_62("s")
                self.skip += 1  # the impl's own path: not printed
                self.path(False)
                self.skip -= 1
            self.emit("<")
            self.type()
            if tag != "M":
                self.emit(" as ")
                self.path(False)
            self.emit(">")
        elif tag == "I":
            self.path(in_value)
            self.emit("::<" if in_value else "<")
            self.sep_list(self.generic_arg, ", ")
            self.emit(">")
        elif tag == "B":
            self.follow_backref(lambda: self.path(in_value))
        else:
            raise _Invalid
        self.pop()

    def generic_arg(self) -> None:
        if self.eat("L"):
            self.lifetime(self.integer_62())
        elif self.eat("K"):
            self.const(False)
        else:
            self.type()

    def lifetime(self, lt: int) -> None:
        if self.skip:
            return
        if lt == 0:
            self.emit("'_")
            return
        depth = self.bound_lifetimes - lt
        if depth < 0:
            raise _Invalid
        self.emit("'" + (chr(ord("a") + depth) if depth < 26 else f"_{depth}"))

    def binder(self, fn: Callable[[], Any]) -> None:
        n = self.opt_integer_62("G")
        if self.skip:
            fn()
            return
        if n:
            self.emit("for<")
            for i in range(n):  # bounded by MAX_OUTPUT through emit()
                if i:
                    self.emit(", ")
                self.bound_lifetimes += 1
                self.lifetime(1)
            self.emit("> ")
        fn()
        self.bound_lifetimes -= n

    def type(self) -> None:
        tag = self.next()
        basic = _BASIC_TYPES.get(tag)
        if basic is not None:
            self.emit(basic)
            return
        self.push()
        if tag in "RQ":
            self.emit("&")
            if self.eat("L"):
                lt = self.integer_62()
                if lt:
                    self.lifetime(lt)
                    self.emit(" ")
            if tag == "Q":
                self.emit("mut ")
            self.type()
        elif tag in "PO":
            self.emit("*const " if tag == "P" else "*mut ")
            self.type()
        elif tag in "AS":
            self.emit("[")
            self.type()
            if tag == "A":
                self.emit("; ")
                self.const(True)
            self.emit("]")
        elif tag == "T":
            self.emit("(")
            if self.sep_list(self.type, ", ") == 1:
                self.emit(",")
            self.emit(")")
        elif tag == "F":
            self.binder(self.fn_sig)
        elif tag == "D":
            self.emit("dyn ")
            self.binder(lambda: self.sep_list(self.dyn_trait, " + "))
            if not self.eat("L"):
                raise _Invalid
            lt = self.integer_62()
            if lt:
                self.emit(" + ")
                self.lifetime(lt)
        elif tag == "B":
            self.follow_backref(self.type)
        elif tag == "W":
            self.type()
            self.emit(" is ")
            self.pattern()
        else:
            self.pos -= 1
            self.path(False)
        self.pop()

    def fn_sig(self) -> None:
        unsafe = self.eat("U")
        abi = None
        if self.eat("K"):
            if self.eat("C"):
                abi = "C"
            else:
                ascii_part, puny = self.ident()
                if not ascii_part or puny:
                    raise _Invalid
                abi = ascii_part.replace("_", "-")
        if unsafe:
            self.emit("unsafe ")
        if abi is not None:
            self.emit(f'extern "{abi}" ')
        self.emit("fn(")
        self.sep_list(self.type, ", ")
        self.emit(")")
        if not self.eat("u"):
            self.emit(" -> ")
            self.type()

    def dyn_trait(self) -> None:
        is_open = self.path_maybe_open_generics()
        while self.eat("p"):
            self.emit(", " if is_open else "<")
            is_open = True
            self.emit(_ident_text(*self.ident()) + " = ")
            if self.eat("K"):
                self.const(False)
            else:
                self.type()
        if is_open:
            self.emit(">")

    def path_maybe_open_generics(self) -> bool:
        if self.eat("B"):
            return bool(self.follow_backref(self.path_maybe_open_generics))
        if self.eat("I"):
            self.path(False)
            self.emit("<")
            self.sep_list(self.generic_arg, ", ")
            return True
        self.path(False)
        return False

    def pattern(self) -> None:
        tag = self.next()
        if tag == "R":
            self.const(False)
            self.emit("..=")
            self.const(False)
        elif tag == "O":
            self.push()
            self.pattern()
            while not self.eat("E"):
                self.emit(" | ")
                self.pattern()
            self.pop()
        elif tag == "N":
            self.emit("!null")
        else:
            raise _Invalid

    def hex_nibbles(self) -> str:
        start = self.pos
        while True:
            c = self.next()
            if c == "_":
                return self.s[start:self.pos - 1]
            if c not in "0123456789abcdef":
                raise _Invalid

    def const_uint(self) -> None:
        nibbles = self.hex_nibbles()
        digits = nibbles.lstrip("0")
        self.emit(str(int(digits or "0", 16)) if len(digits) <= 16 else "0x" + nibbles)

    def const(self, in_value: bool) -> None:
        tag = self.next()
        self.push()
        braced = False

        def brace() -> None:
            nonlocal braced
            if not in_value:
                braced = True
                self.emit("{")

        if tag == "p":
            self.emit("_")
        elif tag in "htmyoj":
            self.const_uint()
        elif tag in "aslxni":
            if self.eat("n"):
                self.emit("-")
            self.const_uint()
        elif tag == "b":
            v = self.hex_nibbles().lstrip("0")
            if v not in ("", "1"):
                raise _Invalid
            self.emit("true" if v == "1" else "false")
        elif tag == "c":
            v = self.hex_nibbles().lstrip("0")
            if len(v) > 6 or int(v or "0", 16) >= 0x110000 or 0xD800 <= int(v or "0", 16) < 0xE000:
                raise _Invalid
            self.emit(_quoted("'", chr(int(v or "0", 16))))
        elif tag == "e":
            brace()
            self.emit("*")
            self.emit(self.str_literal())
        elif tag in "RQ":
            if tag == "R" and self.eat("e"):
                self.emit(self.str_literal())
            else:
                brace()
                self.emit("&" if tag == "R" else "&mut ")
                self.const(True)
        elif tag == "A":
            brace()
            self.emit("[")
            self.sep_list(lambda: self.const(True), ", ")
            self.emit("]")
        elif tag == "T":
            brace()
            self.emit("(")
            if self.sep_list(lambda: self.const(True), ", ") == 1:
                self.emit(",")
            self.emit(")")
        elif tag == "V":
            brace()
            self.path(True)
            kind = self.next()
            if kind == "T":
                self.emit("(")
                self.sep_list(lambda: self.const(True), ", ")
                self.emit(")")
            elif kind == "S":
                self.emit(" { ")
                self.sep_list(self.const_field, ", ")
                self.emit(" }")
            elif kind != "U":
                raise _Invalid
        elif tag == "B":
            self.follow_backref(lambda: self.const(in_value))
        else:
            raise _Invalid
        if braced:
            self.emit("}")
        self.pop()

    def const_field(self) -> None:
        self.opt_integer_62("s")
        self.emit(_ident_text(*self.ident()) + ": ")
        self.const(True)

    def str_literal(self) -> str:
        nibbles = self.hex_nibbles()
        if len(nibbles) % 2:
            raise _Invalid
        try:
            text = bytes.fromhex(nibbles).decode("utf-8")
        except ValueError:
            raise _Invalid from None
        return _quoted('"', text)


def _quoted(quote: str, text: str) -> str:
    out = [quote]
    for c in text:
        if c in "'\"" and c != quote:
            out.append(c)
        elif c in "\\'\"":
            out.append("\\" + c)
        elif c in "\t\r\n":
            out.append({"\t": "\\t", "\r": "\\r", "\n": "\\n"}[c])
        elif c == "\0":
            out.append("\\0")
        elif c.isprintable():
            out.append(c)
        else:
            out.append(f"\\u{{{ord(c):x}}}")
    out.append(quote)
    return "".join(out)


def _ident_text(ascii_part: str, puny: str) -> str:
    if not puny:
        return ascii_part
    decoded = _punycode_decode(ascii_part, puny)
    if decoded is not None:
        return decoded
    return "punycode{" + (ascii_part + "-" if ascii_part else "") + puny + "}"


def _punycode_decode(ascii_part: str, code: str, limit: int = 128) -> str | None:
    """RFC 3492 decoding of Rust's punycode identifiers (None if invalid or too long)."""
    base, t_min, t_max, skew = 36, 1, 26, 38
    damp, bias, i, n = 700, 72, 0, 0x80
    out = list(ascii_part)
    pos = 0
    while pos < len(code):
        delta, w, k = 0, 1, 0
        while True:
            k += base
            t = min(max(k - bias, t_min), t_max)
            if pos >= len(code):
                return None
            c = code[pos]
            pos += 1
            if "a" <= c <= "z":
                d = ord(c) - ord("a")
            elif "0" <= c <= "9":
                d = 26 + ord(c) - ord("0")
            else:
                return None
            delta += d * w
            if delta >= 1 << 32:
                return None
            if d < t:
                break
            w *= base - t
        length = len(out) + 1
        i += delta
        n += i // length
        i %= length
        if n >= 0x110000 or 0xD800 <= n < 0xE000 or length > limit:
            return None
        out.insert(i, chr(n))
        i += 1
        # Bias adaptation.
        delta //= damp
        damp = 2
        delta += delta // length
        k = 0
        while delta > ((base - t_min) * t_max) // 2:
            delta //= base - t_min
            k += base
        bias = k + ((base - t_min + 1) * delta) // (delta + skew)
    return "".join(out)


def demangle_rust_v0(name: str) -> str | None:
    """A v0 Rust symbol (`_R...`) demangled, or None when it is not one."""
    if not name.startswith("_R") or not name.isascii():
        return None
    inner = _split_llvm_suffix(name)[2:]
    if not inner or not ("A" <= inner[0] <= "Z"):
        return None
    p = _V0Printer(inner)
    try:
        p.path(True)
        if "A" <= p.peek() <= "Z" and p.peek():  # the instantiating crate: not shown
            p.skip += 1
            p.path(False)
            p.skip -= 1
    except (_Invalid, RecursionError):
        return None
    suffix = inner[p.pos:]
    if suffix and not (suffix.startswith(".") and _symbol_like(suffix)):
        return None
    return "".join(p.out) + suffix


# --- C++ ---------------------------------------------------------------------------


class _CxxDemangler:
    """libstdc++'s __cxa_demangle through ctypes, loaded on first use."""

    def __init__(self) -> None:
        self._fn: Any = None
        self._free: Any = None
        self._loaded = False

    def _load(self) -> None:
        self._loaded = True
        try:
            lib = ctypes.CDLL(ctypes.util.find_library("stdc++") or "libstdc++.so.6")
            fn = getattr(lib, "__cxa_demangle")  # not lib.__x: a class body would mangle it
            fn.restype = ctypes.c_void_p
            fn.argtypes = [ctypes.c_char_p, ctypes.c_void_p, ctypes.c_void_p,
                           ctypes.POINTER(ctypes.c_int)]
            libc = ctypes.CDLL(ctypes.util.find_library("c"))
            libc.free.argtypes = [ctypes.c_void_p]
            self._fn, self._free = fn, libc.free
        except (OSError, AttributeError):
            self._fn = None

    def demangle(self, name: str) -> str | None:
        """The C++ name demangled, or None."""
        if not self._loaded:
            self._load()
        if self._fn is None or not name.isascii() or "\0" in name:
            return None
        status = ctypes.c_int(0)
        ptr = self._fn(name.encode(), None, None, ctypes.byref(status))
        if not ptr:
            return None
        try:
            if status.value != 0:
                return None
            out = ctypes.string_at(ptr)
            return out.decode("utf-8", "replace") if len(out) <= MAX_OUTPUT else None
        finally:
            self._free(ptr)


_cxx = _CxxDemangler()
