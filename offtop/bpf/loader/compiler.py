"""A cache miss: bcc compiles offcpu.c in a child process; its output becomes an artifact.

The child (`bcc_child.py`) reports the module as bcc built it: each
function's instructions, with the child's own map fds in its map
references, and each map's definition and fd. Here that becomes an
`Artifact`: fds turned into map indexes (and zeroed), per-run constants
found, and the whole checked exactly as a cached file would be.
"""

from __future__ import annotations

import base64
import binascii
import json
import os
import signal
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from offtop.bpf import environment
from offtop.bpf.config import EngineError
from offtop.bpf.loader.artifact import (
    FORMAT,
    INSN_SIZE,
    Artifact,
    ArtifactInvalid,
    constant_sites,
    from_body,
    insn_fields,
    program_type,
    scan,
)


class ConstantNotFound(ArtifactInvalid):
    """A per-run constant's placeholder is nowhere in the code: compile with the value itself."""


CHILD = Path(__file__).with_name("bcc_child.py")
#: A compile under heavy load took 3 s here; anything near this is a hang.
TIMEOUT_S = 300.0


def compile_artifact(source: str, cflags: list[str], key: str,
                     placeholders: Mapping[str, int] | None = None,
                     *, python: str = sys.executable, timeout_s: float = TIMEOUT_S) -> Artifact:
    """Compile `source` with bcc in a child process; the artifact for `key`.

    `placeholders` names the -D values (already in `cflags`) that stand for
    per-run constants, to be found in the code. A compile error is an
    EngineError whose message is one line, with the log in a file (as
    `environment.load_failure` writes it); a missing bcc is the
    EnvironmentProblem `environment.check_bcc_importable` would raise;
    ConstantNotFound if a placeholder is not in the code.
    """
    request = json.dumps({"source": source, "cflags": cflags, "parent": os.getpid()})
    try:
        # -I: a root process must not take PYTHONPATH & co from the environment.
        r = subprocess.run([python, "-I", str(CHILD)], input=request.encode(),
                           capture_output=True, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired:
        raise EngineError(f"could not load the BPF program: bcc took over {timeout_s:.0f} s "
                          "to compile it") from None
    except OSError as e:
        raise EngineError(f"could not start the BPF compiler ({python}): {e.strerror}") from None
    log = r.stderr.decode(errors="replace")
    try:
        doc = json.loads(r.stdout) if r.stdout else None
    except ValueError:
        doc = None
    if not isinstance(doc, dict):
        raise EngineError(_died(r.returncode, log))
    if "error" in doc:
        message = str(doc.get("message", ""))
        if doc["error"] == "import":
            environment.check_bcc_importable()  # raises the problem, worded for users
            raise EngineError(f"bcc's library could not be loaded ({message})")
        raise EngineError(environment.load_failure(message, log))
    try:
        return artifact_from_module(doc, key, placeholders or {})
    except ConstantNotFound:
        raise
    except ArtifactInvalid as e:
        raise EngineError(f"could not load the BPF program: bcc's output cannot be loaded "
                          f"without bcc ({e})") from None


def _died(status: int, log: str) -> str:
    """One line for a compiler process that ended without an answer."""
    if status < 0 and environment.address_space_limit() is not None:
        return environment.memory_problem("while bcc compiled the BPF program")
    how = (f"died of {signal.Signals(-status).name}" if status < 0
           else f"exited with status {status}")
    return environment.load_failure(f"the BPF compiler process {how}", log)


def artifact_from_module(doc: Mapping[str, Any], key: str,
                         placeholders: Mapping[str, int]) -> Artifact:
    """The child's description of a module (see bcc_child.py), as a checked artifact."""
    maps = doc.get("maps")
    funcs = doc.get("functions")
    if not isinstance(maps, list) or not isinstance(funcs, list):
        raise ArtifactInvalid("the compiler's answer has no maps or functions")
    index_of_fd: dict[int, int] = {}
    for i, m in enumerate(maps):
        if not isinstance(m, dict) or not isinstance(m.get("fd"), int) or m["fd"] in index_of_fd:
            raise ArtifactInvalid("a map without a distinct fd")
        index_of_fd[m["fd"]] = i
    programs = []
    sites: dict[str, list[list[int]]] = {name: [] for name in placeholders}
    for pi, f in enumerate(funcs):
        if not isinstance(f, dict) or not isinstance(f.get("insns"), str):
            raise ArtifactInvalid("a function without instructions")
        try:
            insns = bytearray(base64.b64decode(f["insns"], validate=True))
        except (binascii.Error, ValueError):
            raise ArtifactInvalid("instructions are not base64") from None
        refs, problems = scan(bytes(insns))
        if problems:
            raise ArtifactInvalid(f"{f.get('name')}: {problems[0]}")
        map_refs = []
        for at in refs:
            fd = insn_fields(bytes(insns), at)[2]
            if fd not in index_of_fd:
                raise ArtifactInvalid(f"{f.get('name')}: instruction {at} refers to fd {fd}, "
                                      "no map of the module")
            map_refs.append([at, index_of_fd[fd]])
            insns[at * INSN_SIZE + 4: at * INSN_SIZE + 8] = b"\0\0\0\0"
        for name, value in placeholders.items():
            sites[name] += [[pi, at] for at in constant_sites(bytes(insns), value)]
        programs.append({"name": f.get("name"), "type": program_type(str(f.get("name"))),
                         "insns": base64.b64encode(bytes(insns)).decode(), "map_refs": map_refs})
    for name, found in sites.items():
        if not found:
            # The compiler folded the value into something else: it cannot be patched.
            raise ConstantNotFound(f"{name} is not found in the code as compiled")
    body = {
        "format": FORMAT, "key": key,
        "license": doc.get("license"), "kern_version": doc.get("kern_version"),
        "compiler": doc.get("compiler"),
        "maps": [{k: m.get(k) for k in ("name", "type", "key_size", "value_size",
                                         "max_entries", "flags")} for m in maps],
        "programs": programs,
        "constants": [{"name": n, "placeholder": placeholders[n], "sites": s}
                      for n, s in sites.items()],
    }
    return from_body(body, key)
