"""An artifact into the kernel: its maps created, its programs loaded and attached.

What bcc did at `BPF(...)` and `attach_tracepoint`, through the raw
system calls: BPF_MAP_CREATE for each map (same type, sizes and flags; a
perf event array gets one slot per possible CPU, as bcc gives it),
each map's new fd written into the instructions that refer to it,
BPF_PROG_LOAD (the verifier's log is asked for only when a program is
refused, by loading it again with a log), and for each tracepoint a perf
event (perf_event_open of its id in tracefs) given the program with
PERF_EVENT_IOC_SET_BPF and enabled. Programs on one tracepoint run in the
order they were attached.
"""

from __future__ import annotations

import contextlib
import ctypes as ct
import errno
import os
import re
import resource
import threading
from collections.abc import Mapping
from pathlib import Path

from offtop.bpf import syscalls
from offtop.bpf.loader.artifact import PROG_TYPE_TRACEPOINT, PROG_TYPE_TRACING, Artifact, patched
from offtop.bpf.maps import BPF_OBJ_NAME_LEN, PERF_EVENT_ARRAY, BpfMap, MapSpec, create_map, possible_cpus
from offtop.bpf.perf_ring import PERF_EVENT_IOC_DISABLE, PERF_EVENT_IOC_ENABLE, PerfEventAttr

PERF_TYPE_TRACEPOINT = 2
#: enum bpf_attach_type: an iterator's.
BPF_TRACE_ITER = 28
PERF_FLAG_FD_CLOEXEC = 1 << 3
#: _IOW('$', 8, __u32) (linux/perf_event.h).
PERF_EVENT_IOC_SET_BPF = 0x40042408
#: The verifier's log of a refused program; its end says why, and a longer
#: one is cut from the front (kernel 6.4+) or fails with ENOSPC (older).
LOG_BYTES = 16 << 20
_EVENT_NAME = re.compile(r"[A-Za-z0-9_]{1,128}\Z")


class LoadFailed(Exception):
    """The kernel refused a map, a program or an attachment.

    `message` is one line; `log` the verifier's log (empty if none);
    `artifact_fault` says whether another compile could help (a refused
    program or map) or not (no permission, no such tracepoint).
    """

    def __init__(self, message: str, log: str = "", *, artifact_fault: bool = True) -> None:
        super().__init__(message)
        self.message = message
        self.log = log
        self.artifact_fault = artifact_fault


class _ProgLoadAttr(ct.Structure):
    """`union bpf_attr` as BPF_PROG_LOAD reads it, up to attach_btf_id."""

    _fields_ = [
        ("prog_type", ct.c_uint32),
        ("insn_cnt", ct.c_uint32),
        ("insns", ct.c_uint64),
        ("license", ct.c_uint64),
        ("log_level", ct.c_uint32),
        ("log_size", ct.c_uint32),
        ("log_buf", ct.c_uint64),
        ("kern_version", ct.c_uint32),
        ("prog_flags", ct.c_uint32),
        ("prog_name", ct.c_char * BPF_OBJ_NAME_LEN),
        ("prog_ifindex", ct.c_uint32),
        ("expected_attach_type", ct.c_uint32),
        ("prog_btf_fd", ct.c_uint32),
        ("func_info_rec_size", ct.c_uint32),
        ("func_info", ct.c_uint64),
        ("func_info_cnt", ct.c_uint32),
        ("line_info_rec_size", ct.c_uint32),
        ("line_info", ct.c_uint64),
        ("line_info_cnt", ct.c_uint32),
        ("attach_btf_id", ct.c_uint32),
    ]


def prog_name(function: str) -> bytes:
    """The kernel's name for a program: as bcc names it (no `tracepoint__`, 15 bytes)."""
    for prefix in ("tracepoint__", "raw_tracepoint__", "kprobe__", "kretprobe__"):
        if function.startswith(prefix):
            function = function[len(prefix):]
            break
    return function.encode()[: BPF_OBJ_NAME_LEN - 1]


def _raise_memlock() -> None:
    """Kernels before 5.11 charge BPF memory to RLIMIT_MEMLOCK: lift it (as bcc does)."""
    with contextlib.suppress(OSError, ValueError):
        resource.setrlimit(resource.RLIMIT_MEMLOCK, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))


def load_program(prog_type: int, name: str, insns: bytes, license: str, kern_version: int, *,
                 attach_type: int = 0, attach_btf_id: int = 0) -> int:
    """BPF_PROG_LOAD: the program's fd; LoadFailed with the verifier's log if refused.

    `attach_type` and `attach_btf_id`: what a program that attaches by BTF
    (an iterator) is for; 0 for a tracepoint's.
    """
    code = ct.create_string_buffer(insns, len(insns))
    lic = ct.create_string_buffer(license.encode())
    attr = _ProgLoadAttr(prog_type=prog_type, insn_cnt=len(insns) // 8, insns=ct.addressof(code),
                         license=ct.addressof(lic), kern_version=kern_version,
                         prog_name=prog_name(name), expected_attach_type=attach_type,
                         attach_btf_id=attach_btf_id)
    fd = _prog_load(attr)
    if fd == -errno.EPERM:
        _raise_memlock()
        fd = _prog_load(attr)
    if fd >= 0:
        return fd
    err = -fd
    # Loaded again, with a log: only a refused program pays for one.
    log = ct.create_string_buffer(LOG_BYTES)
    attr.log_level, attr.log_size, attr.log_buf = 1, LOG_BYTES, ct.addressof(log)
    again = _prog_load(attr)
    if again >= 0:  # it passed this time (a transient failure, e.g. ENOMEM): keep it
        return again
    text = log.value.decode(errors="replace")
    raise LoadFailed(f"Failed to load BPF program {name}: {os.strerror(err)}", text,
                     artifact_fault=err not in (errno.EPERM, errno.ENOMEM, errno.EAGAIN))


#: Loads tried while the verifier gives up on a signal (EAGAIN), as libbpf does.
PROG_LOAD_TRIES = 5


def _prog_load(attr: _ProgLoadAttr) -> int:
    """BPF_PROG_LOAD, again while it fails with EAGAIN: the verifier stops when a signal
    is pending (a debugger or profiler attaching, a terminal resized), and offtop's
    start failed on it ("Resource temporarily unavailable" under py-spy)."""
    for _ in range(PROG_LOAD_TRIES):
        fd = syscalls.bpf(syscalls.BPF_PROG_LOAD, attr)
        if fd != -errno.EAGAIN:
            break
    return fd


def tracepoint_id(tracefs: Path, category: str, event: str) -> int:
    """The id of tracepoint `category:event` (tracefs events/<category>/<event>/id)."""
    if not (_EVENT_NAME.match(category) and _EVENT_NAME.match(event)):
        raise LoadFailed(f"not a tracepoint name: {category}:{event}", artifact_fault=False)
    try:
        return int((tracefs / "events" / category / event / "id").read_text().strip())
    except (OSError, ValueError) as e:
        raise LoadFailed(f"no tracepoint {category}:{event} in {tracefs}: {e}",
                         artifact_fault=False) from None


def attach_tracepoint(prog_fd: int, tp_id: int, what: str) -> int:
    """A perf event on tracepoint `tp_id` running `prog_fd`: its fd (closing it detaches)."""
    attr = PerfEventAttr()
    attr.type = PERF_TYPE_TRACEPOINT
    attr.size = ct.sizeof(PerfEventAttr)
    attr.config = tp_id
    attr.sample_period = 1
    attr.wakeup_events = 1
    # pid -1 with cpu 0 is how bcc opens it: a tracepoint's program runs on every CPU.
    pfd = syscalls.perf_event_open(attr, -1, 0, -1, PERF_FLAG_FD_CLOEXEC)
    if pfd < 0:
        raise LoadFailed(f"could not attach to {what}: perf_event_open: {os.strerror(-pfd)}",
                         artifact_fault=False)
    for req, arg, doing in ((PERF_EVENT_IOC_SET_BPF, prog_fd, "PERF_EVENT_IOC_SET_BPF"),
                            (PERF_EVENT_IOC_ENABLE, 0, "PERF_EVENT_IOC_ENABLE")):
        res = syscalls.ioctl(pfd, req, arg)
        if res < 0:
            os.close(pfd)
            raise LoadFailed(f"could not attach to {what}: {doing}: {os.strerror(-res)}",
                             artifact_fault=False)
    return pfd


def detach(perf_fd: int) -> None:
    """Disable and close one tracepoint perf event (the last one waits a grace period)."""
    syscalls.ioctl(perf_fd, PERF_EVENT_IOC_DISABLE, 0)
    syscalls.close_quietly(perf_fd)


class LoadedObject:
    """An artifact's maps and programs in the kernel, and the tracepoints they are on."""

    def __init__(self, artifact: Artifact, tracefs: Path) -> None:
        self.artifact = artifact
        self.tracefs = tracefs
        self.maps: dict[str, BpfMap] = {}
        self.progs: dict[str, int] = {}
        #: The maps' fds in the artifact's order (for programs loaded later).
        self.map_fds: list[int] = []
        self.constants: Mapping[str, int] = {}
        #: (tracepoint, perf event fd), in the order attached.
        self.attached: list[tuple[str, int]] = []

    @classmethod
    def load(cls, artifact: Artifact, constants: Mapping[str, int], tracefs: Path) -> LoadedObject:
        """Create every map and load every tracepoint program (nothing attached yet).

        LoadFailed if refused. Iterators are loaded when first wanted
        (`load_iterator`): they need the kernel's BTF looked up, and most
        runs never use one.
        """
        obj = cls(artifact, tracefs)
        obj.constants = constants
        try:
            fds = []
            for spec in artifact.maps:
                if spec.type == PERF_EVENT_ARRAY:
                    # One slot per possible CPU, as bcc sizes it where it compiles.
                    spec = MapSpec(spec.name, spec.type, spec.key_size, spec.value_size,
                                   possible_cpus(), spec.flags)
                try:
                    fd = create_map(spec)
                except OSError as e:
                    raise LoadFailed(f"could not create BPF map {spec.name}: {e.strerror}",
                                     artifact_fault=e.errno not in (errno.EPERM, errno.ENOMEM)
                                     ) from None
                obj.maps[spec.name] = BpfMap(fd, spec)
                fds.append(fd)
            obj.map_fds = fds
            for i, prog in enumerate(artifact.programs):
                if prog.type == PROG_TYPE_TRACEPOINT:
                    obj.progs[prog.name] = obj._load(i)
        except BaseException:
            obj.close()
            raise
        return obj

    @property
    def artifact_programs(self) -> frozenset[str]:
        """The name of every program in the artifact, loaded or not."""
        return frozenset(p.name for p in self.artifact.programs)

    def load_iterator(self, function: str, attach_btf_id: int) -> int:
        """Load iterator `function` (`bpf_iter__<target>`), for the kernel function with
        BTF id `attach_btf_id`; its fd, kept and closed with the rest. LoadFailed if refused."""
        if function in self.progs:
            return self.progs[function]
        for i, prog in enumerate(self.artifact.programs):
            if prog.name == function and prog.type == PROG_TYPE_TRACING:
                fd = self.progs[function] = self._load(i, attach_type=BPF_TRACE_ITER,
                                                       attach_btf_id=attach_btf_id)
                return fd
        raise LoadFailed(f"no iterator {function} in the program", artifact_fault=False)

    def _load(self, index: int, *, attach_type: int = 0, attach_btf_id: int = 0) -> int:
        """Program `index` of the artifact, its maps' fds and this run's constants
        written in, into the kernel: its fd."""
        prog, art = self.artifact.programs[index], self.artifact
        insns = patched(art, index, self.map_fds, self.constants)
        return load_program(prog.type, prog.name, insns, art.license, art.kern_version,
                            attach_type=attach_type, attach_btf_id=attach_btf_id)

    def attach(self, function: str, tracepoint: str) -> None:
        """Run program `function` on `tracepoint` ("category:event"), after those attached before."""
        category, _, event = tracepoint.partition(":")
        fd = self.progs.get(function)
        if fd is None:
            raise LoadFailed(f"no program {function} to attach to {tracepoint}")
        tp = tracepoint_id(self.tracefs, category, event)
        self.attached.append((tracepoint, attach_tracepoint(fd, tp, tracepoint)))

    def attach_autoload(self) -> None:
        """Attach each `tracepoint__<category>__<event>` program to its tracepoint (bcc's rule)."""
        for name in self.progs:
            if name.startswith("tracepoint__"):
                self.attach(name, name[len("tracepoint__"):].replace("__", ":", 1))

    def detach_all(self) -> None:
        """Close every tracepoint's perf event at once.

        The last perf user of a tracepoint waits for an RCU grace period as
        it goes (tens of ms here); one after another, a dozen would hold
        offtop's exit for over a second. Each close runs in its own thread
        (the system calls let go of the GIL), so the waits overlap.
        """
        closers = [threading.Thread(target=detach, args=(fd,), name="offtop-detach", daemon=True)
                   for _, fd in self.attached]
        for t in closers:
            t.start()
        for t in closers:
            t.join(timeout=5.0)
        self.attached.clear()

    def close(self) -> None:
        """Detach, then close every program and map (the kernel frees them); safe twice."""
        self.detach_all()
        for fd in self.progs.values():
            syscalls.close_quietly(fd)
        self.progs.clear()
        for m in self.maps.values():
            m.close()
        self.maps.clear()
