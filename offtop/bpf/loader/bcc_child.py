"""The compiler process: bcc compiles offcpu.c here, and what it made is printed.

Run by `offtop.bpf.loader.compiler` as ``python -I bcc_child.py`` (isolated:
no PYTHON* variables, no user site, not even this file's directory on the
path), so it imports nothing but the standard library and libbcc (and
offtop's standard-library-only `compiler_memory.py`, by its path), and
LLVM's ~100 MB live and die with this process, never offtop's.

Input (stdin, JSON): {"source", "cflags", "parent"}. Output (the original
stdout, JSON): the module as bcc built it, or {"error": kind, "message"}.
Everything C code prints goes to stderr, which the parent keeps as the
compile log. The compile is exactly `bcc.BPF(text=source, cflags=cflags)`'s
(`bpf_module_create_c_from_string` with debug 0 and allow_rlimit, after an
empty USDT prologue), without its autoload: nothing is verified or
attached here; the parent loads the programs itself.
"""

from __future__ import annotations

import base64
import contextlib
import ctypes as ct
import importlib.util
import json
import os
import re
import shutil
import signal
import sys
import tempfile
from pathlib import Path
from typing import Any

PR_SET_PDEATHSIG = 1
CLONE_NEWNS = 0x00020000
MS_BIND = 0x1000
MS_REC = 0x4000
MS_PRIVATE = 1 << 18
KALLSYMS = "/proc/kallsyms"


def _die_with_parent(parent: int) -> None:
    """SIGKILL this process when the thread that started it goes (offtop exits, is killed)."""
    try:
        libc = ct.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent:  # gone before the line above took effect
        os._exit(1)


def _bcc_version() -> str:
    """bcc's version, from its Python package (not imported: nothing of it is needed)."""
    spec = importlib.util.find_spec("bcc")
    if spec is None or spec.origin is None:
        return "unknown"
    try:
        with open(os.path.join(os.path.dirname(spec.origin), "version.py")) as f:
            m = re.search(r"__version__\s*=\s*['\"]([^'\"]+)['\"]", f.read())
    except OSError:
        return "unknown"
    return m.group(1) if m else "unknown"


def _mapped_path(fragment: str) -> str:
    """The file of a shared library this process has mapped, by part of its name."""
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(None, 5)
            if len(parts) == 6 and fragment in os.path.basename(parts[5].strip()):
                return parts[5].strip()
    return ""


def _declare(lib: Any) -> None:
    """Prototypes of the libbcc functions used here (bcc_common.h)."""
    vp, sz, cp, i = ct.c_void_p, ct.c_size_t, ct.c_char_p, ct.c_int
    protos: dict[str, tuple[Any, list[Any]]] = {
        "bpf_module_create_c_from_string": (vp, [cp, ct.c_uint, ct.POINTER(cp), i, ct.c_bool, cp]),
        "bpf_module_destroy": (None, [vp]),
        "bpf_module_license": (cp, [vp]),
        "bpf_module_kern_version": (ct.c_uint, [vp]),
        "bpf_num_functions": (sz, [vp]),
        "bpf_function_name": (cp, [vp, sz]),
        "bpf_function_start": (vp, [vp, cp]),
        "bpf_function_size": (sz, [vp, cp]),
        "bpf_num_tables": (sz, [vp]),
        "bpf_table_name": (cp, [vp, sz]),
        "bpf_table_fd_id": (i, [vp, sz]),
        "bpf_table_type_id": (i, [vp, sz]),
        "bpf_table_max_entries_id": (sz, [vp, sz]),
        "bpf_table_flags_id": (i, [vp, sz]),
        "bpf_table_key_size_id": (sz, [vp, sz]),
        "bpf_table_leaf_size_id": (sz, [vp, sz]),
    }
    for name, (res, args) in protos.items():
        fn = getattr(lib, name)
        fn.restype = res
        fn.argtypes = args


def _drop_pages_loading_touched() -> int:
    """Give back the clean pages of libLLVM and libclang that loading them touched.

    Their static constructors and the relocations at dlopen fault in ~34 MB
    of clean text and read-only data all over both libraries (fault-around
    maps 64 KB per fault); a compile then reads only part of it again. Those
    pages are file-backed and unmodified, so dropping them is free: what the
    compile needs comes back from the page cache. This process's peak RSS,
    which adds to offtop's while it runs, falls from ~130 MB to ~103 MB.
    `offtop/bpf/compiler_memory.py` (standard library only) does it; it is
    loaded by its path, as this file was, since nothing of offtop is on
    this process's path.
    """
    path = Path(__file__).resolve().parent.parent / "compiler_memory.py"
    spec = importlib.util.spec_from_file_location("offtop_compiler_memory", path)
    if spec is None or spec.loader is None:
        return 0
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return int(module.release_compiler_memory())


def helper_symbols(kallsyms: bytes) -> bytes:
    """The lines of `kallsyms` that name a function whose name starts with bpf_, as they are."""
    out = []
    i = kallsyms.find(b" bpf_")
    while i >= 0:
        start = kallsyms.rfind(b"\n", 0, i) + 1
        end = kallsyms.find(b"\n", i)
        end = len(kallsyms) if end < 0 else end + 1
        line = kallsyms[start:end]
        fields = line.split()
        if len(fields) >= 3 and fields[2].startswith(b"bpf_"):
            out.append(line if line.endswith(b"\n") else line + b"\n")
        i = kallsyms.find(b" bpf_", end)
    return b"".join(out)


def _show_bcc_only_helper_symbols() -> bool:
    """Let bcc's look-up of kernel symbols see only the bpf_* ones; False if it cannot be.

    Each compile, bcc's front end reads the whole of /proc/kallsyms (~120,000
    lines) into a hash table (`bcc_symcache_new`), only to ask whether
    bpf_probe_read_kernel and bpf_probe_read_user exist (which helper its
    rewrite of memory reads calls); that was ~40% of a compile here and
    ~10 MB of its peak. In a mount namespace of this process's own (private:
    nothing propagates out), a file with the real kallsyms lines of every
    bpf_* symbol is bound over /proc/kallsyms: the same answers, from 1,600
    lines. The file is root's, in a directory only root can enter, and gone
    from the file system once bound. Any failure leaves the process as it
    was (a full read, as before).
    """
    try:
        with open(KALLSYMS, "rb") as f:
            lines = helper_symbols(f.read())
    except OSError:
        return False
    libc = ct.CDLL(None, use_errno=True)
    libc.mount.argtypes = [ct.c_char_p, ct.c_char_p, ct.c_char_p, ct.c_ulong, ct.c_void_p]
    if libc.unshare(CLONE_NEWNS) != 0:
        return False
    if libc.mount(None, b"/", None, MS_REC | MS_PRIVATE, None) != 0:
        return False  # nothing bound: the namespace is a copy of the one we came from
    # Created after unshare, so that its mount is one of this namespace's.
    directory = tempfile.mkdtemp(prefix="offtop-kallsyms-", dir="/tmp")
    try:
        path = os.path.join(directory, "kallsyms")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                     0o400)
        with os.fdopen(fd, "wb") as f:
            f.write(lines)
        return bool(libc.mount(path.encode(), KALLSYMS.encode(), None, MS_BIND, None) == 0)
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def _emit(out: Any, doc: dict[str, Any]) -> None:
    out.write(json.dumps(doc))
    out.flush()


def compile_module(lib: Any, source: str, cflags: list[str]) -> dict[str, Any] | None:
    """Compile with bcc and describe the module; None if it did not compile."""
    arr = (ct.c_char_p * len(cflags))(*[f.encode() for f in cflags])
    mod = lib.bpf_module_create_c_from_string(source.encode(), 0, arr, len(cflags), True, None)
    if not mod:
        return None
    try:
        maps = []
        for i in range(lib.bpf_num_tables(mod)):
            maps.append({
                "name": lib.bpf_table_name(mod, i).decode(),
                "fd": lib.bpf_table_fd_id(mod, i),
                "type": lib.bpf_table_type_id(mod, i),
                "key_size": lib.bpf_table_key_size_id(mod, i),
                "value_size": lib.bpf_table_leaf_size_id(mod, i),
                "max_entries": lib.bpf_table_max_entries_id(mod, i),
                "flags": lib.bpf_table_flags_id(mod, i),
            })
        functions = []
        for i in range(lib.bpf_num_functions(mod)):
            name = lib.bpf_function_name(mod, i)
            start = lib.bpf_function_start(mod, name)
            size = lib.bpf_function_size(mod, name)
            functions.append({"name": name.decode(),
                              "insns": base64.b64encode(ct.string_at(start, size)).decode()})
        return {"license": (lib.bpf_module_license(mod) or b"").decode(),
                "kern_version": lib.bpf_module_kern_version(mod),
                "maps": maps, "functions": functions}
    finally:
        lib.bpf_module_destroy(mod)


def main() -> int:
    """Read the request, compile, print the module (see the module docstring)."""
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # whatever C code prints on stdout joins the log
    req = json.loads(sys.stdin.read())
    _die_with_parent(int(req["parent"]))
    try:
        lib = ct.CDLL("libbcc.so.0", use_errno=True)  # as bcc.libbcc loads it
        _declare(lib)
    except (OSError, AttributeError) as e:
        _emit(out, {"error": "import", "message": str(e)})
        return 1
    # Only time and memory are at stake, never the compile.
    with contextlib.suppress(OSError, ImportError, AttributeError):
        _drop_pages_loading_touched()
    with contextlib.suppress(OSError, AttributeError):
        _show_bcc_only_helper_symbols()
    module = compile_module(lib, req["source"], list(req["cflags"]))
    if module is None:
        _emit(out, {"error": "compile", "message": "Failed to compile BPF module <text>"})
        return 1
    path = _mapped_path("libbcc.so")
    try:
        st = os.stat(path)
        ident = [path, st.st_size, st.st_mtime_ns]
    except OSError:
        ident = [path, 0, 0]
    module["compiler"] = {"bcc": _bcc_version(), "libbcc": ident}
    _emit(out, module)
    return 0


if __name__ == "__main__":
    sys.exit(main())
