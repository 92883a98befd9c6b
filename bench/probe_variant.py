"""offtop's command line with another probe: for A/B runs of probe changes.

    python bench/probe_variant.py [--source FILE.c] [--set FIELD=VALUE]...
                                  [--cflag -DNAME=N]... -- OFFTOP-ARGS...

`--source` loads FILE.c instead of offtop/bpf/offcpu.c, `--set` overrides an
EngineConfig field (e.g. kstack_depth=16), `--cflag` adds a compiler flag,
`bench/run.py switch --variant NAME=SPEC` runs such a command next to the
stock offtop in the same rounds, so a probe change is measured side by side
with what it replaces. Nothing here is part of offtop itself.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any


def _value(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


def main(argv: list[str]) -> int:
    """Patch the engine as asked, then run offtop's own main()."""
    if "--" in argv:
        cut = argv.index("--")
        own, rest = argv[:cut], argv[cut + 1:]
    else:
        own, rest = argv, []
    p = argparse.ArgumentParser(prog="probe_variant")
    p.add_argument("--source", type=Path)
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE")
    p.add_argument("--cflag", action="append", default=[])
    args = p.parse_args(own)
    overrides = {}
    for item in args.set:
        name, _, value = item.partition("=")
        overrides[name] = _value(value)
    text = args.source.read_text() if args.source else None

    from offtop.bpf import engine, environment

    if overrides:
        stock = engine.EngineConfig
        for name in overrides:
            if name not in {f.name for f in dataclasses.fields(stock)}:
                p.error(f"EngineConfig has no field {name!r}")

        def config(**kw: Any) -> Any:
            return dataclasses.replace(stock(**kw), **overrides)

        engine.EngineConfig = config  # type: ignore[assignment,misc]

    if text is not None or args.cflag:
        prepare = environment.prepare

        def prepare_then_patch(*a: Any, **kw: Any) -> Any:
            out = prepare(*a, **kw)
            import bcc  # only now: bcc reads tracefs and headers at import

            stock_bpf = bcc.BPF
            if getattr(stock_bpf, "_offtop_variant", False):
                return out

            class VariantBPF(stock_bpf):  # type: ignore[misc,valid-type]
                _offtop_variant = True

                def __init__(self, *a: Any, **kw: Any) -> None:
                    if text is not None and "text" in kw:
                        kw["text"] = text
                    kw["cflags"] = [*kw.get("cflags", []), *args.cflag]
                    super().__init__(*a, **kw)

            bcc.BPF = VariantBPF
            return out

        environment.prepare = prepare_then_patch  # type: ignore[assignment]

    from offtop import cli

    return cli.main(rest)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
