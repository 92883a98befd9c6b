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
# and the Unicode line/paragraph separators and bidirectional overrides,
# which reorder or split what follows them on screen.
_UNSAFE = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]")


def _escape(m: re.Match[str]) -> str:
    c = ord(m.group())
    return f"\\x{c:02x}" if c < 0x100 else f"\\u{c:04x}"


def printable(text: str) -> str:
    """`text` with every control character replaced by a visible escape (`\\x1b`)."""
    if text.isprintable():
        return text
    return _UNSAFE.sub(_escape, text)


def decode(raw: bytes) -> str:
    """Bytes from a process (a comm, a path, a symbol): UTF-8, invalid bytes replaced."""
    return raw.decode("utf-8", errors="replace")
