"""`w`: write the stacks pane's view to a file, in a format picked from a menu.

The file is written in a worker thread (a pprof profile of 20,000 stacks
takes a moment); a notification says where it went, or why it did not.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any

from textual.app import App

from offtop.gc_pacing import Parcel
from offtop.safe_text import printable_lines
from offtop.widgets.choice_screen import ChoiceScreen
from offtop.widgets.stacks_pane import ViewData
from offtop.widgets.view_export import FORMATS, write_view


def export_view(app: App[Any], view: ViewData, directory: Path) -> None:
    """Ask for a format, then write `view` into `directory` off the event loop."""

    def chosen(fmt: str | None) -> None:
        if fmt:
            app.run_worker(partial(_write, app, Parcel(view), fmt, directory), thread=True,
                           group="export", exit_on_error=False)

    app.push_screen(ChoiceScreen(f"Write {len(view.stacks):,} stacks as",
                                 [(fmt, what) for fmt, (what, _) in FORMATS.items()],
                                 subtitle=f"into {printable_lines(str(directory))} · Esc closes"),
                    chosen)


def _write(app: App[Any], parcel: Parcel[ViewData], fmt: str, directory: Path) -> None:
    """Write the file (in a worker thread); say where, or why not."""
    view = parcel.take()
    if view is None:
        return
    try:
        path = write_view(view, fmt, directory)
    except (OSError, ValueError) as error:
        app.notify(f"could not write the view: {error}", severity="error", markup=False)
        return
    app.notify(f"{len(view.stacks):,} stacks written to {printable_lines(str(path))}",
               title="view written", timeout=10, markup=False)
