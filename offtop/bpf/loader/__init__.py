"""offcpu.c compiled once, cached, and loaded without bcc.

bcc is only a compiler here, and only on a cache miss, in a child process
(`compiler`), so LLVM never enters offtop's own process. What the compile
leaves is an `artifact`: each program's instructions, its license and
kern_version, every map's definition, and where each instruction refers to
a map. The `cache` keeps it under /var/cache/offtop, named by a hash of
everything the compiled code depends on, and trusts a file only after
checking who could have written it and that its content is whole. `kernel`
then does what bcc did at load: create the maps, patch their fds into the
instructions, load each program (the verifier's log only on failure), and
attach it to its tracepoint.
"""
