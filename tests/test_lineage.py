"""offtop.bpf.lineage: which living process a gone one's user stacks are resolved in.

The probe's notes are given as plain dicts here (a fake of the BPF map, by
name); the kernel side is tested end to end in test_truth_e2e.py.
"""

from __future__ import annotations

import pytest

from offtop.bpf.lineage import LINEAGE_ENTRY, MAX_HOPS, Forked, Lineage, decode_forked

TICK = 10_000_000  # ns per clock tick (USER_HZ 100)
S = 1_000_000_000


def lineage(notes: dict[int, Forked], starts: dict[int, int]) -> Lineage:
    """`starts`: the living processes' start times, in ticks."""
    return Lineage(notes.get, start_time=starts.get, ns_per_tick=TICK)


def test_a_child_gone_is_resolved_in_the_living_process_it_was_forked_from() -> None:
    notes = {200: Forked(parent=100, fork_ns=50 * S, exec_ns=0)}
    assert lineage(notes, {100: 40 * S // TICK}).stand_in(200) == (100, 40 * S // TICK)
    # Its parent exec'd before the fork: the child has the memory it has now.
    notes[100] = Forked(parent=1, fork_ns=30 * S, exec_ns=35 * S)
    assert lineage(notes, {100: 30 * S // TICK}).stand_in(200) == (100, 30 * S // TICK)


def test_no_stand_in_without_a_note_or_after_an_exec() -> None:
    starts = {100: 40 * S // TICK}
    assert lineage({}, starts).stand_in(200) is None  # forked before offtop started
    # The child exec'd: its memory is another program's.
    notes = {200: Forked(parent=100, fork_ns=50 * S, exec_ns=51 * S)}
    assert lineage(notes, starts).stand_in(200) is None
    # A note made by an exec alone (no fork seen).
    assert lineage({200: Forked(0, 0, 51 * S)}, starts).stand_in(200) is None
    # The parent exec'd after the fork: it is another program now.
    notes = {200: Forked(parent=100, fork_ns=50 * S, exec_ns=0),
             100: Forked(parent=1, fork_ns=0, exec_ns=52 * S)}
    assert lineage(notes, starts).stand_in(200) is None


def test_the_exec_of_the_process_now_under_a_pid_and_its_forker() -> None:
    """What the kernel's mapping records are checked against (offtop.bpf.sent_maps):
    when the process under a pid exec'd, and who forked it (0: not seen forking)."""
    notes = {200: Forked(parent=100, fork_ns=50 * S, exec_ns=51 * S),
             300: Forked(0, 0, 52 * S),  # an exec alone (forked before offtop started)
             400: Forked(parent=100, fork_ns=53 * S, exec_ns=0)}  # forked, not exec'd
    seen = lineage(notes, {})
    assert seen.exec_of(200) == (51 * S, 100) and seen.exec_of(300) == (52 * S, 0)
    assert seen.exec_of(400) is None and seen.exec_of(500) is None


def test_a_pid_reused_since_the_fork_is_not_the_parent() -> None:
    notes = {200: Forked(parent=100, fork_ns=50 * S, exec_ns=0)}
    # Alive under pid 100, but started a second after the fork.
    assert lineage(notes, {100: 51 * S // TICK}).stand_in(200) is None
    # Started within the fork's clock tick: the one that forked.
    assert lineage(notes, {100: 50 * S // TICK}).stand_in(200) == (100, 50 * S // TICK)


def test_up_a_chain_of_forked_processes_gone_to_the_first_alive() -> None:
    notes = {300: Forked(parent=200, fork_ns=52 * S, exec_ns=0),
             200: Forked(parent=100, fork_ns=50 * S, exec_ns=0)}
    assert lineage(notes, {100: 10 * S // TICK}).stand_in(300) == (100, 10 * S // TICK)
    # The middle one had exec'd (before forking 300): its memory is not 100's.
    notes[200] = Forked(parent=100, fork_ns=50 * S, exec_ns=51 * S)
    assert lineage(notes, {100: 10 * S // TICK}).stand_in(300) is None
    # The middle one gone without a note: unknown.
    del notes[200]
    assert lineage(notes, {100: 10 * S // TICK}).stand_in(300) is None
    # The first alive exec'd after the middle one was forked.
    notes[200] = Forked(parent=100, fork_ns=50 * S, exec_ns=0)
    notes[100] = Forked(parent=1, fork_ns=0, exec_ns=51 * S)
    assert lineage(notes, {100: 10 * S // TICK}).stand_in(300) is None


def test_a_loop_or_a_long_chain_ends() -> None:
    loop = {200: Forked(parent=300, fork_ns=50 * S, exec_ns=0),
            300: Forked(parent=200, fork_ns=50 * S, exec_ns=0)}
    assert lineage(loop, {}).stand_in(200) is None
    assert lineage({200: Forked(parent=200, fork_ns=S, exec_ns=0)}, {200: 0}).stand_in(200) is None
    chain = {pid: Forked(parent=pid - 1, fork_ns=pid * S, exec_ns=0) for pid in range(2, 40)}
    top = 39
    assert lineage(chain, {top - MAX_HOPS: 0}).stand_in(top) == (top - MAX_HOPS, 0)
    assert lineage(chain, {top - MAX_HOPS - 1: 0}).stand_in(top) is None


@pytest.mark.parametrize("fields", [(100, 0, 5 * S, 0), (0, 0, 0, 7 * S), (2**32 - 1, 0, 2**64 - 1, 1)])
def test_the_probes_entry_decodes(fields: tuple[int, int, int, int]) -> None:
    parent, _pad, fork_ns, exec_ns = fields
    assert decode_forked(LINEAGE_ENTRY.pack(*fields)) == Forked(parent, fork_ns, exec_ns)
