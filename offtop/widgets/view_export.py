"""Writing what a pane shows to a file: folded stacks, pprof or speedscope.

The stacks pane hands over the stacks of its current view (`ViewData`);
`write_view` turns them into one of `FORMATS` with offtop's exporters and
writes a new file (never over an existing one, never through a symlink).
It runs in a worker thread: a pprof profile of 20,000 stacks takes a moment.
"""

from __future__ import annotations

import dataclasses
import os
import re
import time
from pathlib import Path

from offtop.export import ProfileData, pprof_bytes, speedscope_json
from offtop.widgets.flame_graph import FlameTree
from offtop.widgets.stacks_pane import ViewData

#: Format id → (what the menu says, file name suffix).
FORMATS: dict[str, tuple[str, str]] = {
    "folded": ("folded stacks (flamegraph.pl, speedscope, inferno)", ".folded"),
    "pprof": ("pprof profile (go tool pprof, Pyroscope, Parca)", ".pb.gz"),
    "speedscope": ("speedscope JSON (speedscope.app)", ".speedscope.json"),
}


def view_bytes(view: ViewData, fmt: str) -> bytes:
    """The stacks of `view` in format `fmt`, with only the frames the view shows."""
    stacks = [dataclasses.replace(s, kernel=s.kernel if view.show_kernel else (),
                                  user=s.user if view.show_user else ())
              for s in view.stacks]
    if fmt == "folded":
        tree = FlameTree(stacks, title=view.title)
        return "".join(line + "\n" for line in tree.folded_lines()).encode()
    data = ProfileData.from_stacks(stacks, start=view.start, end=view.end,
                                   comments=(f"offtop: {view.title}",))
    if fmt == "pprof":
        return pprof_bytes(data)
    if fmt == "speedscope":
        return speedscope_json(data, name=f"offtop off-CPU: {view.title}").encode()
    raise ValueError(f"unknown export format {fmt!r}")


def export_name(view: ViewData, fmt: str, when: float | None = None) -> str:
    """`offtop-20240102-120000-<scope>.<suffix>`: a file name from the view's title."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(time.time() if when is None else when))
    slug = re.sub(r"[^A-Za-z0-9_.-]+", "-", view.title).strip("-.")[:40] or "view"
    return f"offtop-{stamp}-{slug}{FORMATS[fmt][1]}"


def write_view(view: ViewData, fmt: str, directory: Path) -> Path:
    """Write the view to a new file in `directory`; returns its path.

    An existing name gets a number (`-2`, `-3`…): nothing is overwritten,
    and `O_NOFOLLOW` keeps a planted symlink from redirecting the write.
    """
    data = view_bytes(view, fmt)
    name = export_name(view, fmt)
    stem, suffix = name[: -len(FORMATS[fmt][1])], FORMATS[fmt][1]
    for n in range(1, 100):
        path = directory / (name if n == 1 else f"{stem}-{n}{suffix}")
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                         | os.O_CLOEXEC, 0o644)
        except FileExistsError:
            continue
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        return path.resolve()
    raise FileExistsError(f"too many exports named {name} in {directory}")
