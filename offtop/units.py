"""Durations typed by users and durations shown to them."""

from __future__ import annotations

import math
import re

_UNITS_NS = {"ns": 1, "us": 1_000, "µs": 1_000, "ms": 1_000_000, "s": 1_000_000_000}
_DURATION = re.compile(
    r"^\s*(-?)((?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?)\s*(ns|us|µs|ms|s)?\s*$"
)
_UNKNOWN_UNIT = re.compile(r"^\s*-?[0-9.]+(?:[eE][+-]?[0-9]+)?\s*([^\s0-9.].*?)\s*$")

#: The largest threshold accepted: one hour. Longer blocks than that are rare
#: enough that "never dump" is what such a value would mean; say so instead.
MAX_THRESHOLD_NS = 3_600 * 1_000_000_000


class DurationError(ValueError):
    """A duration that could not be understood; the message is for users."""


def parse_duration_ns(
    text: str, *, default_unit: str = "ms", max_ns: int = MAX_THRESHOLD_NS
) -> int:
    """Parse `500ms`, `2s`, `100us`, `0`, or a bare number in `default_unit`.

    Negative, non-finite, unit-less garbage and values above `max_ns` are refused
    with a `DurationError` whose message can be shown as is.
    """
    m = _DURATION.match(text)
    if not m:
        bad_unit = _UNKNOWN_UNIT.match(text)
        if bad_unit:
            raise DurationError(
                f"invalid duration {text!r}: unknown unit {bad_unit.group(1)!r} "
                "(use ns, us, ms or s)"
            )
        raise DurationError(
            f"invalid duration {text!r}: expected a number with an optional unit "
            "(ns, us, ms, s), e.g. 500ms"
        )
    value = float(m.group(2))
    unit = m.group(3) or default_unit
    if m.group(1) and value != 0:
        raise DurationError(f"duration {text!r} is negative")
    ns = value * _UNITS_NS[unit]
    if not math.isfinite(ns) or ns > max_ns:
        raise DurationError(f"duration {text!r} is too large (at most {format_ns(max_ns)})")
    return round(ns)


def parse_interval_s(text: str) -> float:
    """Parse a refresh interval in seconds (a bare number means seconds), 0.05 s to 1 h."""
    try:
        ns = parse_duration_ns(text, default_unit="s", max_ns=3_600 * 1_000_000_000)
    except DurationError as e:
        raise DurationError(str(e).replace("duration", "interval", 1)) from None
    if ns < 50_000_000:
        raise DurationError(f"interval {text!r} is too short (at least 0.05 s)")
    return ns / 1e9


def format_ns(ns: float) -> str:
    """A short human duration: 0, 950ns, 12.3us, 4.56ms, 1.23s, 2m03s."""
    if ns <= 0:
        return "0"
    if ns < 1_000:
        return f"{ns:.0f}ns"
    if ns < 1_000_000:
        return _three(ns / 1_000, "us")
    if ns < 1_000_000_000:
        return _three(ns / 1_000_000, "ms")
    s = ns / 1e9
    if s < 60:
        return _three(s, "s")
    m, sec = divmod(int(s), 60)
    if m < 60:
        return f"{m}m{sec:02d}s"
    h, m = divmod(m, 60)
    return f"{h}h{m:02d}m"


def _three(v: float, unit: str) -> str:
    """Three significant digits, without a trailing '.0'."""
    if v >= 100:
        return f"{v:.0f}{unit}"
    if v >= 10:
        return f"{v:.1f}{unit}"
    return f"{v:.2f}{unit}"
