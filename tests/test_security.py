"""Security: what reaches the BPF compiler, what reaches a shell, and privileges.

- Only validated integers reach offcpu.c (as -D flags); user strings go
  through maps (pids, tids, the cgroup's fd), never into compiled text.
- No shell is ever run, with or without user input.
- Without privileges offtop refuses and explains; it never tries to escalate.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
from importlib import resources
from pathlib import Path
from typing import Any

import pytest

from offtop.bpf import environment
from offtop.bpf.engine import BpfSource, EngineConfig
from offtop.bpf.loader import compiler
from offtop.bpf.loader.load import COMPILE_FLAGS, split_constants
from tests.conftest import REQUIRE_BPF, ROOT

PACKAGE = ROOT / "offtop"
CFLAG = re.compile(r"^-D[A-Z][A-Z0-9_]*=[0-9]+$")
HOSTILE = '/sys/fs/cgroup/unified/x"; system("id"); //\n#include </etc/shadow>'


# --- what reaches the compiler -------------------------------------------------------


def test_cflags_are_integers_only() -> None:
    for cfg in (EngineConfig(), EngineConfig(states="SDR", kthreads=True, user_stacks=False,
                                             pids=(1, 2), tids=(3,), cgroup=HOSTILE,
                                             scope=HOSTILE)):
        flags = cfg.cflags()
        assert flags and all(CFLAG.match(f) for f in flags), flags
        assert not any(HOSTILE in f or "system" in f for f in flags)


@pytest.mark.parametrize("field", ["stack_entries", "ustack_entries", "start_entries", "agg_entries",
                                   "kstack_depth", "ustack_depth"])
@pytest.mark.parametrize("bad", ["64", "64); system(\"id\"", 1.5, True, -1, 1 << 40, None],
                         ids=["str", "injection", "float", "bool", "negative", "huge", "none"])
def test_cflags_refuse_anything_but_a_sane_integer(field: str, bad: Any) -> None:
    cfg = EngineConfig(**{field: bad})
    with pytest.raises(ValueError, match="not a valid setting"):
        cfg.cflags()


@pytest.mark.parametrize("states", ["S\n#define X 1", "S;D", "SD ", "s", "$(id)"])
def test_states_are_letters_from_a_fixed_set(states: str) -> None:
    with pytest.raises(ValueError, match="unknown state"):
        EngineConfig(states=states).cflags()


class _Captured(Exception):
    pass


def test_user_strings_never_reach_the_compiled_text(monkeypatch: pytest.MonkeyPatch,
                                                    tmp_path: Path) -> None:
    """Start the engine with an empty cache and the compiler replaced: what it would
    compile is offcpu.c, byte for byte, and integer -D flags (offtop's own pid as a
    placeholder, written in at load)."""
    seen: dict[str, Any] = {}

    def fake_compile(source: str, cflags: list[str], key: str, placeholders: Any = None,
                     **kw: Any) -> Any:
        seen.update(text=source, cflags=cflags, key=key, placeholders=placeholders, kw=kw)
        raise _Captured("stop here")

    monkeypatch.setenv("OFFTOP_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(compiler, "compile_artifact", fake_compile)
    monkeypatch.setattr(environment, "prepare", lambda: None)
    cfg = EngineConfig(pids=(os.getpid(),), tids=(os.getpid(),), cgroup=HOSTILE, scope=HOSTILE,
                       states="SD")
    with pytest.raises(_Captured):
        BpfSource(cfg).start()
    assert seen["text"] == resources.files("offtop.bpf").joinpath("offcpu.c").read_text()
    settings = split_constants(cfg.cflags())[0]
    assert seen["cflags"] == [*settings, *COMPILE_FLAGS]
    assert all(CFLAG.match(f) for f in settings)
    # The text is offcpu.c itself; the flags and what goes with them hold no user string
    # and not offtop's own pid (a placeholder: one compiled program serves every run).
    blob = "\n".join(seen["cflags"]) + repr(seen["kw"]) + repr(seen["placeholders"])
    for s in (HOSTILE, "system(", f"={os.getpid()}"):
        assert s not in blob


def test_the_bpf_source_has_no_include_of_user_paths() -> None:
    text = resources.files("offtop.bpf").joinpath("offcpu.c").read_text()
    assert "#include" not in text  # bcc's own helpers only; nothing from the filesystem


# --- no shell -------------------------------------------------------------------------

_SHELL_CALLS = {("os", "system"), ("os", "popen"), ("os", "execl"), ("os", "execlp"),
                ("os", "execv"), ("os", "execvp"), ("os", "execve"), ("os", "execvpe"),
                ("os", "spawnl"), ("os", "spawnlp"), ("os", "spawnv"), ("os", "spawnvp"),
                ("os", "posix_spawn"), ("os", "posix_spawnp"), ("pty", "spawn"),
                ("subprocess", "getoutput"), ("subprocess", "getstatusoutput")}
_ESCALATION = {("os", "setuid"), ("os", "seteuid"), ("os", "setreuid"), ("os", "setresuid"),
               ("os", "setgid"), ("os", "setegid"), ("os", "setregid"), ("os", "setresgid")}


def _sources() -> list[Path]:
    files = sorted(PACKAGE.rglob("*.py"))
    assert len(files) > 10
    return files


def _calls(tree: ast.AST) -> list[tuple[ast.Call, str]]:
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            f = node.func
            if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name):
                out.append((node, f"{f.value.id}.{f.attr}"))
            elif isinstance(f, ast.Name):
                out.append((node, f.id))
    return out


def test_no_shell_anywhere_in_the_package() -> None:
    problems = []
    for path in _sources():
        text = path.read_text()
        tree = ast.parse(text, str(path))
        for node, name in _calls(tree):
            where = f"{path.relative_to(ROOT)}:{node.lineno}"
            if tuple(name.split(".", 1)) in _SHELL_CALLS:
                problems.append(f"{where} calls {name}")
            if name in ("eval", "exec"):
                problems.append(f"{where} calls {name}")
            for kw in node.keywords:
                if kw.arg == "shell" and not (isinstance(kw.value, ast.Constant)
                                              and kw.value.value is False):
                    problems.append(f"{where} passes shell=... to {name}")
            if name.startswith("subprocess.") and node.args and not isinstance(
                    node.args[0], (ast.List, ast.Tuple)):
                problems.append(f"{where}: {name} with a command that is not a literal list")
        for imp in ("commands", "pexpect"):
            if re.search(rf"^\s*(import|from)\s+{imp}\b", text, re.M):
                problems.append(f"{path.relative_to(ROOT)} imports {imp}")
    assert not problems, problems


def test_no_privilege_changes_in_the_package() -> None:
    escalators = {"sudo", "su", "pkexec", "doas", "runuser", "setpriv", "capsh", "setcap"}
    problems = []
    for path in _sources():
        for node, name in _calls(ast.parse(path.read_text(), str(path))):
            where = f"{path.relative_to(ROOT)}:{node.lineno}"
            if tuple(name.split(".", 1)) in _ESCALATION:
                problems.append(f"{where} calls {name}")
            # Advice in messages ("run it with sudo") is fine; running it is not.
            if name.startswith(("subprocess.", "os.")) and node.args and isinstance(
                    node.args[0], (ast.List, ast.Tuple)) and node.args[0].elts:
                first = node.args[0].elts[0]
                if isinstance(first, ast.Constant) and \
                        os.path.basename(str(first.value)) in escalators:
                    problems.append(f"{where} runs {first.value}")
    assert not problems, problems


# --- unprivileged: refuse, explain, never escalate ----------------------------------------


def test_unprivileged_refuses_and_never_escalates(tmp_path: Path) -> None:
    """As nobody with no capabilities; sudo/su/pkexec/doas on PATH are traps that log a call."""
    if os.geteuid() != 0:
        if REQUIRE_BPF:
            pytest.fail("OFFTOP_REQUIRE_BPF=1 but not root")
        pytest.skip("needs root to become nobody")
    traps = tmp_path / "bin"
    traps.mkdir()
    log = tmp_path / "called"
    log.touch()
    log.chmod(0o666)
    tmp_path.chmod(0o755)
    for name in ("sudo", "su", "pkexec", "doas", "mount", "capsh", "setcap"):
        trap = traps / name
        trap.write_text(f"#!/bin/sh\necho {name} \"$@\" >> {log}\nexit 1\n")
        trap.chmod(0o755)
    from tests.test_cli_errors import NOBODY, _python_for_nobody

    py, env = _python_for_nobody()
    env = {**env, "PATH": f"{traps}:{env.get('PATH', '/usr/bin:/bin')}"}
    for args in (["--batch", "--count", "1"], [], ["--batch", "--format", "json", "-p", "1"]):
        r = subprocess.run([*NOBODY, *py, "-m", "offtop.cli", *args], capture_output=True,
                           text=True, timeout=60, cwd=ROOT, env=env)
        assert r.returncode != 0
        assert "Traceback" not in r.stderr
        assert len(r.stderr.splitlines()) == 1, r.stderr
        if args and args[0] == "--batch":
            assert "needs root" in r.stderr and "CAP_BPF" in r.stderr, r.stderr
            assert r.returncode == 1
    assert log.read_text() == "", f"offtop ran: {log.read_text()!r}"
