"""Off-CPU profiles in the formats people already use.

- `accumulator`: snapshots summed over a run, bounded in memory (`ProfileData`);
- `pprof`: gzipped profile.proto, read by `go tool pprof`, Pyroscope, Parca;
- `speedscope`: speedscope's JSON file format;
- `push`: a pprof profile per interval to a Pyroscope-compatible `/ingest`;
- `cgroup_names`: cgroup ids (from long blocks) to paths, for the `cgroup` label.

Nothing here touches the screen or BPF: exporters take frozen data and
return bytes or text.
"""

from __future__ import annotations

from offtop.export.accumulator import ProfileAccumulator, ProfileData, StackTotal
from offtop.export.cgroup_names import CgroupNames
from offtop.export.pprof import pprof_bytes
from offtop.export.push import Pusher, PushStats
from offtop.export.speedscope import speedscope_document, speedscope_json

__all__ = [
    "CgroupNames",
    "ProfileAccumulator",
    "ProfileData",
    "PushStats",
    "Pusher",
    "StackTotal",
    "pprof_bytes",
    "speedscope_document",
    "speedscope_json",
]
