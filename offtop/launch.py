"""The `offtop` command: loads the command line, and a Ctrl-C that comes first ends it quietly.

Loading offtop (Textual, Rich, the engine) takes a few hundred milliseconds,
seconds on a loaded machine. Python's default SIGINT handler raises
KeyboardInterrupt wherever the import is; without this, that showed as a
traceback. Nothing has started yet, so there is nothing to undo or say:
status 0, as for any stop by signal. (SIGTERM and SIGHUP end the process by
default in that window, silently too.) A Ctrl-C whose KeyboardInterrupt
Python dropped is noted all the same (`offtop.early_signal`).

Once offtop has run, the process ends without the interpreter's teardown
(`offtop.cli_io.end_process`): everything is closed by then.
"""

from __future__ import annotations


def main() -> int:
    """The console entry point (see pyproject.toml)."""
    from offtop import early_signal

    early_signal.install()  # a Ctrl-C lost within an import is still seen
    try:
        from offtop.cli import main as cli_main
    except KeyboardInterrupt:
        return 0
    if early_signal.noted():
        return 0
    from offtop.cli_io import end_process

    end_process(cli_main())
