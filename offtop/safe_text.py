"""Untrusted text made safe to show: process names, paths, symbols, perf-map names.

Everything a process controls reaches offtop as bytes or as strings decoded
with replacement. Before it reaches a terminal (the TUI, text and folded
output) every character that a terminal would act on rather than print is
replaced by a visible escape, so a comm such as "\\x1b]0;PWNED\\x07" can
neither set the window title nor clear the screen, and a newline cannot
split a folded line. JSON output is exact instead: the JSON encoder escapes
control characters itself.
"""

from __future__ import annotations

import re

# C0 controls, DEL, C1 controls (a terminal may act on a lone 0x9b as CSI),
# the Unicode line/paragraph separators and bidirectional overrides, which
# reorder or split what follows them on screen, and lone surrogates: what
# Python's surrogateescape makes of undecodable bytes (os and psutil use it
# for /proc), which no UTF-8 writer can encode.
_UNSAFE = re.compile(
    "[\x00-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069\ud800-\udfff]"
)

# Surrogates that surrogateescape never makes (it maps bytes 0x80-0xff to
# U+DC80-U+DCFF only).
_STRAY_SURROGATE = re.compile("[\ud800-\udc7f\udd00-\udfff]")


def _escape(m: re.Match[str]) -> str:
    c = ord(m.group())
    if 0xDC80 <= c <= 0xDCFF:  # surrogateescape's stand-in for the byte c - 0xdc00
        return f"\\x{c - 0xDC00:02x}"
    return f"\\x{c:02x}" if c < 0x100 else f"\\u{c:04x}"


def printable(text: str) -> str:
    """`text` with every control character replaced by a visible escape (`\\x1b`).

    A lone surrogate left by surrogateescape shows as the byte it stands for
    (`\\xff`). Idempotent: what it returns has nothing left to escape.
    """
    if text.isprintable():
        return text
    return _UNSAFE.sub(_escape, text)


def printable_lines(text: str) -> str:
    """`printable` line by line, keeping the line breaks (`\\n` only).

    For multi-line messages drawn by a widget, which lays lines out itself:
    there a line break moves nothing on the terminal, and an error with a
    compiler log stays readable.
    """
    return "\n".join(printable(line) for line in text.split("\n"))


def decode(raw: bytes) -> str:
    """Bytes from a process (a comm, a path, a symbol): UTF-8, invalid bytes replaced."""
    return raw.decode("utf-8", errors="replace")


def redecode(text: str) -> str:
    """A string decoded with surrogateescape (os, psutil), as `decode` would have it.

    Lone surrogates are not valid in UTF-8: JSON carrying them is rejected by
    strict readers, and writing them to a UTF-8 stream fails.
    """
    if text.isascii():
        return text
    text = _STRAY_SURROGATE.sub("\ufffd", text)  # they stand for no byte
    return decode(text.encode("utf-8", errors="surrogateescape"))
