"""A Ctrl-C that comes before batch mode or the TUI takes SIGINT over: never lost.

Until then SIGINT raises KeyboardInterrupt wherever the main thread is, and
`offtop.cli` ends quietly on it. But Python drops an exception raised where
it cannot propagate: in a weakref callback (importlib's module-lock cleanup,
run during any import), a `__del__`, a GC callback. The Ctrl-C was then lost
and offtop ran on (seen in CI: a SIGINT 0.1 s after launch, then a report a
second, for good). So the handler also notes the signal, and whoever takes
SIGINT over asks `hand_over()` first and stops at once on a noted one.
"""

from __future__ import annotations

import signal
import sys

TYPE_CHECKING = False  # typing itself is not imported: ~2.5 ms more of a window Python owns
if TYPE_CHECKING:
    from types import FrameType
    from typing import Any

_noted = False
_python_unraisable = sys.unraisablehook


def _on_sigint(signum: int, frame: FrameType | None) -> None:
    global _noted
    _noted = True
    raise KeyboardInterrupt


def _unraisable(args: Any) -> None:
    # The lost KeyboardInterrupt is noted: not printed as "Exception ignored in ...".
    if not (_noted and isinstance(args.exc_value, KeyboardInterrupt)):
        _python_unraisable(args)


def install() -> None:
    """Note every SIGINT from now on, besides raising KeyboardInterrupt (main thread only)."""
    global _noted
    _noted = False
    signal.signal(signal.SIGINT, _on_sigint)
    sys.unraisablehook = _unraisable


def noted() -> bool:
    """Whether a SIGINT came since `install()` (its KeyboardInterrupt may have been lost)."""
    return _noted


def hand_over() -> bool:
    """SIGINT back to Python's default handler; whether one came meanwhile."""
    if signal.getsignal(signal.SIGINT) is _on_sigint:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    return _noted
