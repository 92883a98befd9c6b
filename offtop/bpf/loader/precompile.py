"""`make setup`: offcpu.c compiled ahead into offtop's cache, for the options users start with.

Those are no option, `-p`/`-t` (one program for any pids and tids) and
`-c` (for any cgroup): the ways in to a server and to a process that hung
before offtop started. A fresh machine's first `offtop`, `offtop -p PID`
or `offtop -c CGROUP` then starts from the cache (no compile at start:
~0.5 s of CPU and ~100 MB of compiler held beside offtop). This
is only a head start: the cache is checked at every start as before (the
key follows the source, the flags, the kernel and bcc; files must be
root's), so a kernel or offtop changed since setup, other options, or a
cache that is missing, damaged or not to be trusted, all compile at start
as on a machine without this step.

Quiet when the programs are cached already; one line when it compiles them
or cannot (setup goes on: offtop compiles at its first start instead).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from offtop.bpf import environment
from offtop.bpf.config import EngineConfig, EngineError
from offtop.bpf.loader.cache import ArtifactCache
from offtop.bpf.loader.kernel import LoadFailed
from offtop.bpf.loader.load import artifact_key, load_object

#: The command lines whose programs setup compiles (each program serves any
#: pids or cgroup: only whether there is a filter is compiled in).
SETUP_ARGS: tuple[tuple[str, ...], ...] = ((), ("-p", "{pid}"), ("-c", "{cgroup2}"))


def config_of(argv: tuple[str, ...] = ()) -> EngineConfig | None:
    """The configuration of `offtop ARGV` (built as the command line builds it;
    `{pid}` stands for this process's pid, `{cgroup2}` for the cgroup v2 root).
    None if ARGV names a cgroup and there is no cgroup v2 (nothing to filter by)."""
    from offtop.cgroups import cgroup2_mounts
    from offtop.cli_args import build_parser, config_from_args

    roots = cgroup2_mounts() if "{cgroup2}" in argv else [Path("/")]
    if not roots:
        return None
    args = [a.replace("{pid}", str(os.getpid())).replace("{cgroup2}", str(roots[0]))
            for a in argv]
    return config_from_args(build_parser().parse_args(args))[0]


def default_config() -> EngineConfig:
    """The configuration of `offtop` with no option."""
    config = config_of()
    assert config is not None
    return config


def precompile(config: EngineConfig, cache: ArtifactCache) -> str:
    """Make sure `cache` holds the program for `config`; '' if it did, else what was done."""
    from offtop.bpf.probe import offcpu_source

    tracefs = environment.tracefs_dir()
    if tracefs is None:
        raise EngineError("tracefs is not mounted")
    source = offcpu_source()
    key = artifact_key(source, config.cflags(), tracefs)
    if cache.get(key).artifact is not None:
        return ""
    t0 = time.monotonic()
    # Loaded (not attached) as at a start: only what the kernel takes is kept.
    obj, report = load_object(source, config.cflags(), cache=cache, tracefs=tracefs)
    obj.close()
    if cache.get(key).artifact is None:
        raise EngineError(f"{report.how}, but not cached: {report.cache_note}")
    return (f"compiled offtop's BPF program into {cache.directory} "
            f"({time.monotonic() - t0:.1f} s)")


def main() -> int:
    """Run by `make setup`; always status 0 (setup goes on without it)."""
    if os.geteuid() != 0:
        return 0  # only root's cache is trusted; offtop needs root anyway
    from offtop.bpf.probe import default_cache
    from offtop.cli_args import UsageError

    try:
        environment.prepare()
    except environment.EnvironmentProblem as e:
        print(f"offtop setup: the BPF program is not compiled ahead ({e}); "
              "offtop compiles it at its first start", file=sys.stderr)
        return 0
    for argv in SETUP_ARGS:
        shown = " ".join(("offtop", *argv)).replace("{pid}", "PID").replace("{cgroup2}", "CGROUP")
        try:
            config = config_of(argv)
            if config is None:
                continue
            done = precompile(config, default_cache())
        except (EngineError, LoadFailed, OSError, UsageError) as e:
            print(f"offtop setup: the BPF program of `{shown}` is not compiled ahead ({e}); "
                  "offtop compiles it at its first start", file=sys.stderr)
            continue
        if done:
            print(f"offtop setup: {done} for `{shown}`")
    return 0


if __name__ == "__main__":
    sys.exit(main())
