"""offtop: a live, top-like view of off-CPU time on Linux, built on BPF."""

__version__ = "0.1.0"
