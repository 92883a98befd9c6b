"""Source to loaded object: the cache first, bcc (in a child) on a miss, one retry at most.

    key = hash(source, cflags, kernel, bcc)
    cached artifact for key, trusted and whole?  -> load it
        the kernel refuses it (verifier, map)?   -> forget it, compile afresh, load that
    otherwise                                     -> compile, load, store
    a fresh artifact refused                      -> EngineError (one line, the log in a file)

A miss can be known before the program is needed (`compile_ahead`): the compile
(~0.6 s of one CPU) then runs beside the rest of offtop's start (its imports, the
TUI's screen) instead of after it.

Per-run constants (offtop's own pid) are compiled as placeholders, so that
one artifact serves every run, and written in at load (`artifact.patched`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from offtop.bpf import environment
from offtop.bpf.config import EngineError
from offtop.bpf.loader import compiler
from offtop.bpf.loader.artifact import Artifact
from offtop.bpf.loader.cache import ArtifactCache, cache_key
from offtop.bpf.loader.compiler import ConstantNotFound
from offtop.bpf.loader.kernel import LoadedObject, LoadFailed

#: What each per-run -D constant is compiled as: far above any pid (pid_max <= 2^22),
#: below 2^31 (an instruction's immediate), and unlike any constant in offcpu.c.
PLACEHOLDERS: dict[str, int] = {"OFFTOP_SELF_TGID": 0x6F667470}

#: How every compile runs, after offcpu.c's own -D settings (in the cache key with them).
#: -g0: bcc turns on debug info to build BTF, which an artifact never carries (it
#: holds instructions and map definitions): the same instructions, ~10% less compile.
#: -disable-llvm-passes: clang hands bcc its IR unoptimized, so that bcc's own -O3
#: pipeline is the only one run (not clang's -O2, then -O3 again over its output):
#: ~35% less compile, and a program half the size (loops unrolled once, not twice).
COMPILE_FLAGS = ("-g0", "-Xclang", "-disable-llvm-passes")

Compile = Callable[[str, list[str], str, Mapping[str, int]], Artifact]


@dataclass(slots=True)
class LoadReport:
    """How the program came to be loaded (for notices and benchmarks)."""

    how: str = ""  # "cache hit", "compiled", "compiled ahead", "compiled (not cacheable)"
    cache_note: str = ""     # why the cache was not used or not written ('' if it was)
    compile_s: float = 0.0   # time in the compiler process
    load_s: float = 0.0      # maps created and programs verified


def split_constants(cflags: list[str]) -> tuple[list[str], dict[str, int]]:
    """`cflags` with per-run -D values replaced by placeholders, and those values."""
    out, values = [], {}
    for flag in cflags:
        name, eq, value = flag.removeprefix("-D").partition("=")
        if flag.startswith("-D") and eq and name in PLACEHOLDERS and value.isdigit() \
                and int(value) != 0:
            values[name] = int(value)
            flag = f"-D{name}={PLACEHOLDERS[name]}"
        out.append(flag)
    return out, values


def _request(source: str, cflags: list[str], tracefs: Path
             ) -> tuple[list[str], dict[str, int], dict[str, int], str]:
    """What a compile of `source` with `cflags` is asked for, and cached under: the
    flags with per-run values as placeholders, those values, the placeholders, the
    key. One derivation for `compile_ahead` and `load_object`, so that a compile
    begun ahead is always of the key the load looks for."""
    build_flags, values = split_constants([*cflags, *COMPILE_FLAGS])
    placeholders = {n: PLACEHOLDERS[n] for n in values}
    return build_flags, values, placeholders, cache_key(source, build_flags, tracefs)


def artifact_key(source: str, cflags: list[str], tracefs: Path) -> str:
    """The cache key `load_object(source, cflags, ...)` looks for."""
    return _request(source, cflags, tracefs)[3]


class AheadCompile:
    """A compile begun before the program is loaded (`compile_ahead`), in a thread
    that waits for the compiler process; `load_object` takes its result."""

    def __init__(self, key: str, run: Callable[[], Artifact]) -> None:
        self.key = key
        self._done = threading.Event()
        self._artifact: Artifact | None = None
        self._error: BaseException | None = None
        # A daemon: offtop quitting does not wait for it (the compiler process
        # dies with this thread, `bcc_child.py`).
        threading.Thread(target=self._run, args=(run,), name="offtop-compile",
                         daemon=True).start()

    def _run(self, run: Callable[[], Artifact]) -> None:
        try:
            self._artifact = run()
        except BaseException as e:  # raised where the result is taken
            self._error = e
        finally:
            self._done.set()

    def result(self) -> Artifact:
        """The artifact, once compiled (what the compile raised, if it did)."""
        self._done.wait()
        if self._error is not None:
            raise self._error
        assert self._artifact is not None
        return self._artifact


def compile_ahead(source: str, cflags: list[str], *, cache: ArtifactCache | None,
                  tracefs: Path, compile: Compile | None = None) -> AheadCompile | None:
    """The compile `load_object(source, cflags, ...)` will need, begun now, if the cache
    has no file for it (a file there is read and checked by `load_object`: a bad
    one is compiled afresh then, as without this)."""
    build_flags, _values, placeholders, key = _request(source, cflags, tracefs)
    if cache is not None:
        try:
            if cache.path_of(key).is_file():
                return None
        except OSError:  # a directory root may not read (FUSE): `load_object` says so
            pass
    compile = compile or compiler.compile_artifact
    return AheadCompile(key, lambda: compile(source, build_flags, key, placeholders))


def _fail(e: LoadFailed) -> EngineError:
    if e.log:
        return EngineError(environment.load_failure(e.message, e.log))
    return EngineError(f"could not load the BPF program: {e.message}")


def load_object(source: str, cflags: list[str], *, cache: ArtifactCache | None,
                tracefs: Path, compile: Compile | None = None,
                ahead: AheadCompile | None = None) -> tuple[LoadedObject, LoadReport]:
    """The program compiled from `source` with `cflags`, its maps created, loaded, not attached.

    `compile` is `compiler.compile_artifact` unless given (looked up at each
    call, so a test may replace it). `ahead`: a compile begun before
    (`compile_ahead`), taken if it is of this key.
    """
    compile = compile or compiler.compile_artifact
    report = LoadReport()
    build_flags, values, placeholders, key = _request(source, cflags, tracefs)
    if cache is not None:
        found = cache.get(key)
        report.cache_note = "" if found.artifact else found.why
        if found.artifact is not None:
            t0 = time.monotonic()
            try:
                obj = LoadedObject.load(found.artifact, values, tracefs)
            except LoadFailed as e:
                if not e.artifact_fault:
                    raise _fail(e) from None
                cache.discard(key)
                report.cache_note = f"cached program refused ({e.message}): compiled afresh"
            else:
                report.how, report.load_s = "cache hit", time.monotonic() - t0
                return obj, report
    else:
        report.cache_note = "no cache"

    t0 = time.monotonic()
    try:
        if ahead is not None and ahead.key == key:
            art = ahead.result()
            report.how = "compiled ahead"
        else:
            art = compile(source, build_flags, key, placeholders)
            report.how = "compiled"
    except ConstantNotFound:
        # The compiler folded a placeholder away: compile this run's values in, uncached.
        values = {}
        flags = [*cflags, *COMPILE_FLAGS]
        art = compile(source, flags, cache_key(source, flags, tracefs), {})
        report.how = "compiled (not cacheable)"
        cache = None
    report.compile_s = time.monotonic() - t0
    t0 = time.monotonic()
    try:
        obj = LoadedObject.load(art, values, tracefs)
    except LoadFailed as e:
        raise _fail(e) from None
    report.load_s = time.monotonic() - t0
    if cache is not None:  # only what the kernel took is kept
        why = cache.put(art)
        if why:
            report.cache_note = why
    return obj, report
