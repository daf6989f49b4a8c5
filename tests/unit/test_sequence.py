"""Per-source sequence rules: in order, gaps, late fills, repeats, incarnations, hole limit."""

from __future__ import annotations

import itertools
from types import MappingProxyType

from hypothesis import given, settings
from hypothesis import strategies as st

from controlplane.core.sequence import MAX_HOLES, Cursor, SeqGap, Sequenced, sequence
from tests.factories import Events

KEY = ("job1", "n0/m0", "inc1")


def beats(*seqs: int, incarnation: str = "inc1") -> list:
    """Heartbeats of n0/m0 in job1 with the given seqs, in that order."""
    ev = Events()
    return [ev.heartbeat("m0", seq=s, incarnation=incarnation) for s in seqs]


def seqs_of(events) -> list[int]:
    return [e.seq for e in events]


def test_empty_batch():
    out = sequence([], {KEY: Cursor(3)})
    assert out == Sequenced()


def test_in_order_accepted_and_cursor_moved():
    events = beats(1, 2, 3)
    out = sequence(events, {})
    assert out.accepted == events
    assert out.accepted_at == [0, 1, 2]
    assert out.stale == []
    assert out.gaps == []
    assert out.late == 0
    assert out.cursors == {KEY: Cursor(3, ())}


def test_continues_from_the_given_cursor():
    out = sequence(beats(6, 7), {KEY: Cursor(5)})
    assert seqs_of(out.accepted) == [6, 7]
    assert out.gaps == []
    assert out.cursors == {KEY: Cursor(7)}


def test_accepts_any_iterable():
    out = sequence(iter(beats(1, 2)), {})
    assert seqs_of(out.accepted) == [1, 2]


def test_jump_records_a_gap():
    out = sequence(beats(1, 5), {})
    assert seqs_of(out.accepted) == [1, 5]
    assert out.gaps == [SeqGap("job1", "n0/m0", "inc1", after_seq=1, next_seq=5)]
    assert out.gaps[0].missing == 3
    assert out.cursors == {KEY: Cursor(5, ((2, 4),))}


def test_first_event_above_one_is_a_gap():
    out = sequence(beats(3), {})
    assert out.accepted_at == [0]
    assert out.gaps == [SeqGap("job1", "n0/m0", "inc1", 0, 3)]
    assert out.gaps[0].missing == 2
    assert out.cursors == {KEY: Cursor(3, ((1, 2),))}


def test_gap_after_a_cursor():
    out = sequence(beats(10), {KEY: Cursor(8)})
    assert out.gaps == [SeqGap("job1", "n0/m0", "inc1", 8, 10)]
    assert out.gaps[0].missing == 1
    assert out.cursors == {KEY: Cursor(10, ((9, 9),))}


def test_late_event_inside_a_hole_splits_it():
    out = sequence(beats(1, 5, 3), {})
    assert seqs_of(out.accepted) == [1, 5, 3]
    assert out.accepted_at == [0, 1, 2]
    assert out.late == 1
    assert out.stale == []
    assert len(out.gaps) == 1
    assert out.cursors == {KEY: Cursor(5, ((2, 2), (4, 4)))}


def test_late_events_at_the_edges_of_a_hole_shrink_it():
    out = sequence(beats(1, 6, 2, 5), {})
    assert out.late == 2
    assert out.cursors == {KEY: Cursor(6, ((3, 4),))}


def test_filling_a_whole_hole_removes_it():
    out = sequence(beats(1, 4, 3, 2), {})
    assert out.late == 2
    assert out.cursors == {KEY: Cursor(4, ())}


def test_late_event_fills_a_hole_from_an_earlier_batch():
    cursors = {KEY: Cursor(5, ((2, 3),))}
    out = sequence(beats(2, 4), cursors)
    assert seqs_of(out.accepted) == [2]
    assert out.late == 1
    assert [seqs_of([e]) for e, _ in out.stale] == [[4]]
    assert out.cursors == {KEY: Cursor(5, ((3, 3),))}


def test_same_seq_again_is_stale():
    events = beats(1, 2, 2)
    assert events[1].event_id != events[2].event_id
    out = sequence(events, {})
    assert out.accepted == events[:2]
    assert out.accepted_at == [0, 1]
    assert len(out.stale) == 1
    event, reason = out.stale[0]
    assert event is events[2]
    assert "out-of-order seq" in reason
    assert "2 after 2" in reason
    assert "n0/m0" in reason
    assert "inc1" in reason
    assert out.cursors == {KEY: Cursor(2)}


def test_old_seq_outside_any_hole_is_stale():
    out = sequence(beats(1, 2, 3, 1), {})
    assert out.accepted_at == [0, 1, 2]
    assert [e.seq for e, _ in out.stale] == [1]
    assert "1 after 3" in out.stale[0][1]


def test_seq_at_or_below_cursor_is_stale():
    out = sequence(beats(5, 3), {KEY: Cursor(5)})
    assert out.accepted == []
    assert [e.seq for e, _ in out.stale] == [5, 3]
    assert out.cursors == {}  # nothing moved


def test_filled_hole_cannot_be_filled_twice():
    out = sequence(beats(1, 3, 2, 2), {})
    assert seqs_of(out.accepted) == [1, 3, 2]
    assert out.late == 1
    assert [e.seq for e, _ in out.stale] == [2]


def test_accepted_at_skips_stale_events():
    out = sequence(beats(1, 1, 2, 1, 3), {})
    assert out.accepted_at == [0, 2, 4]
    assert seqs_of(out.accepted) == [1, 2, 3]
    assert len(out.stale) == 2


def test_new_incarnation_starts_at_one_independently():
    ev = Events()
    first = [ev.heartbeat("m0", seq=s, incarnation="inc1") for s in (1, 2, 3)]
    second = [ev.heartbeat("m0", seq=s, incarnation="inc2") for s in (1, 2)]
    out = sequence([*first, *second], {})
    assert len(out.accepted) == 5
    assert out.gaps == []
    assert out.stale == []
    assert out.cursors == {
        ("job1", "n0/m0", "inc1"): Cursor(3),
        ("job1", "n0/m0", "inc2"): Cursor(2),
    }


def test_new_incarnation_after_a_stored_cursor():
    out = sequence(beats(1, incarnation="inc2"), {KEY: Cursor(100)})
    assert len(out.accepted) == 1
    assert out.gaps == []
    assert out.cursors == {("job1", "n0/m0", "inc2"): Cursor(1)}


def test_old_incarnation_still_checked_after_a_restart():
    ev = Events()
    events = [
        ev.heartbeat("m0", seq=1, incarnation="inc1"),
        ev.heartbeat("m0", seq=1, incarnation="inc2"),
        ev.heartbeat("m0", seq=1, incarnation="inc1"),  # repeat of the old run
    ]
    out = sequence(events, {})
    assert out.accepted_at == [0, 1]
    assert len(out.stale) == 1


def test_sources_and_jobs_are_independent():
    a = Events(job_id="jobA")
    b = Events(job_id="jobB")
    events = [
        a.heartbeat("m0", seq=1),
        a.heartbeat("m1", seq=1),
        b.heartbeat("m0", seq=1),
        a.heartbeat("m0", node="n1", seq=1),  # same member name, other node
        a.heartbeat("m0", seq=2),
        b.heartbeat("m0", seq=3),
        a.heartbeat("m1", seq=1),  # repeat for m1 only
    ]
    out = sequence(events, {})
    assert out.accepted_at == [0, 1, 2, 3, 4, 5]
    assert [e.source for e, _ in out.stale] == ["n0/m1"]
    assert out.gaps == [SeqGap("jobB", "n0/m0", "inc1", 1, 3)]
    assert out.cursors == {
        ("jobA", "n0/m0", "inc1"): Cursor(2),
        ("jobA", "n0/m1", "inc1"): Cursor(1),
        ("jobB", "n0/m0", "inc1"): Cursor(3, ((2, 2),)),
        ("jobA", "n1/m0", "inc1"): Cursor(1),
    }


def test_control_plane_source_is_sequenced_too():
    ev = Events()
    events = [ev.cp("job.stopped", {"reason": "x"}, seq=s) for s in (1, 1)]
    out = sequence(events, {})
    assert out.accepted_at == [0]
    assert out.cursors == {("job1", "controlplane", "inc1"): Cursor(1)}


def test_input_cursors_are_not_mutated():
    cursors = {KEY: Cursor(2, ((1, 1),)), ("job1", "n0/m1", "inc1"): Cursor(4)}
    before = dict(cursors)
    out = sequence(beats(1, 3, 7), cursors)
    assert cursors == before
    assert out.cursors is not cursors
    assert out.cursors == {KEY: Cursor(7, ((4, 6),))}


def test_read_only_cursor_mapping_is_enough():
    cursors = MappingProxyType({KEY: Cursor(1)})
    out = sequence(beats(2), cursors)
    assert out.cursors == {KEY: Cursor(2)}


def test_only_moved_cursors_are_returned():
    other = ("job1", "n0/m1", "inc1")
    cursors = {KEY: Cursor(3), other: Cursor(2)}
    ev = Events()
    out = sequence([ev.heartbeat("m0", seq=2), ev.heartbeat("m1", seq=3)], cursors)
    assert out.cursors == {other: Cursor(3)}


def test_filling_a_hole_moves_the_cursor_without_raising_it():
    out = sequence(beats(3), {KEY: Cursor(4, ((3, 3),))})
    assert out.late == 1
    assert out.cursors == {KEY: Cursor(4, ())}


def test_holes_beyond_max_keep_only_the_newest():
    # 1, 3, 5, ... leaves a one-seq hole before each event after the first
    top = 2 * (MAX_HOLES + 1) + 1
    out = sequence(beats(*range(1, top + 1, 2)), {})
    assert len(out.gaps) == MAX_HOLES + 1  # every gap is still reported
    cursor = out.cursors[KEY]
    assert cursor.last_seq == top
    assert len(cursor.holes) == MAX_HOLES
    assert cursor.holes[0] == (4, 4)  # (2, 2) was forgotten
    assert cursor.holes[-1] == (top - 1, top - 1)

    late = sequence(beats(2, 4), out.cursors)
    assert [e.seq for e, _ in late.stale] == [2]
    assert "out-of-order seq" in late.stale[0][1]
    assert seqs_of(late.accepted) == [4]
    assert late.late == 1
    assert late.cursors[KEY].holes == cursor.holes[1:]


def test_hole_limit_applies_to_stored_holes():
    holes = tuple((2 * i, 2 * i) for i in range(1, MAX_HOLES + 1))
    top = 2 * MAX_HOLES + 1
    out = sequence(beats(top + 2), {KEY: Cursor(top, holes)})
    assert out.cursors[KEY].holes == (*holes[1:], (top + 1, top + 1))


def test_splitting_a_hole_keeps_only_the_newest_holes():
    """A split that overflows MAX_HOLES forgets the oldest hole, as a new gap does."""
    holes = tuple((4 * i, 4 * i + 2) for i in range(1, MAX_HOLES + 1))
    top = 4 * MAX_HOLES + 3
    out = sequence(beats(5), {KEY: Cursor(top, holes)})
    assert out.late == 1
    split = out.cursors[KEY].holes
    assert len(split) == MAX_HOLES
    assert split[0] == (6, 6)  # (4, 4), the oldest, is forgotten

    after = sequence(beats(top + 2), out.cursors)
    assert after.cursors[KEY].holes == (*split[1:], (top + 1, top + 1))
    assert sequence(beats(4), after.cursors).stale  # a late event for a forgotten hole


def test_holes_stay_bounded_when_late_events_split_a_wide_hole():
    cursors = {KEY: Cursor(10_000, ((1, 9_999),))}
    out = sequence(beats(*range(2, 200, 2)), cursors)
    assert out.late == 99
    assert len(out.cursors[KEY].holes) <= MAX_HOLES


# --------------------------------------------------------------------------- properties


@settings(max_examples=200)
@given(
    st.integers(min_value=1, max_value=2 * MAX_HOLES + 1).flatmap(
        lambda n: st.permutations(range(1, n + 1))
    )
)
def test_any_permutation_is_accepted_whole(order: list[int]):
    """Every permutation of 1..n is accepted, once each, while the holes fit.

    Open holes are disjoint runs of missing seqs, each followed by a seen seq, so k holes
    below the top need at least 2k seqs; with n <= 2 * MAX_HOLES + 1 the hole list never
    exceeds MAX_HOLES and nothing is forgotten.
    """
    n = len(order)
    out = sequence(beats(*order), {})
    assert sorted(seqs_of(out.accepted)) == list(range(1, n + 1))
    assert out.accepted_at == list(range(n))
    assert out.stale == []
    assert out.cursors == {KEY: Cursor(n, ())}
    # a seq is late exactly when a higher one came before it
    expected_late = sum(1 for i, s in enumerate(order) if any(p > s for p in order[:i]))
    assert out.late == expected_late
    # every seq skipped by a gap arrives later, as a late event
    assert sum(g.missing for g in out.gaps) == expected_late


def test_hole_limit_is_reachable_just_above_the_bound():
    """The bound in the property above is tight: 2 * (MAX_HOLES + 1) seqs can lose one."""
    n = 2 * (MAX_HOLES + 1)
    order = [*range(2, n + 1, 2), *range(1, n, 2)]
    out = sequence(beats(*order), {})
    assert [e.seq for e, _ in out.stale] == [1]
    assert len(out.accepted) == n - 1


@settings(max_examples=200)
@given(st.lists(st.integers(min_value=1, max_value=40), max_size=60))
def test_no_seq_is_accepted_twice(seqs: list[int]):
    events = beats(*seqs)
    out = sequence(events, {})
    accepted = seqs_of(out.accepted)
    assert len(accepted) == len(set(accepted))
    assert len(out.accepted) + len(out.stale) == len(seqs)
    assert out.accepted_at == sorted(set(out.accepted_at))
    assert [events[i] for i in out.accepted_at] == out.accepted
    if seqs:
        cursor = out.cursors[KEY]
        assert cursor.last_seq == max(seqs)
        seen = set(accepted)
        for lo, hi in cursor.holes:
            assert 1 <= lo <= hi < cursor.last_seq
            assert not seen & set(range(lo, hi + 1))
    else:
        assert out.cursors == {}


@settings(max_examples=200)
@given(
    st.lists(st.integers(min_value=1, max_value=30), max_size=40),
    st.lists(st.integers(min_value=0, max_value=40), max_size=5),
)
def test_batches_compose(seqs: list[int], cuts: list[int]):
    """Splitting the input into batches, carrying the cursors, gives the same outcome."""
    events = beats(*seqs)
    whole = sequence(events, {})

    bounds = sorted({0, len(events), *(min(c, len(events)) for c in cuts)})
    cursors: dict = {}
    accepted, stale, gaps, late = [], [], [], 0
    for lo, hi in itertools.pairwise(bounds):
        part = sequence(events[lo:hi], cursors)
        accepted += part.accepted
        stale += part.stale
        gaps += part.gaps
        late += part.late
        cursors = {**cursors, **part.cursors}
    assert accepted == whole.accepted
    assert stale == whole.stale
    assert gaps == whole.gaps
    assert late == whole.late
    assert cursors == whole.cursors


# --------------------------------------------------------------------------- plausibility (issue 20)


def test_a_seq_implausibly_far_ahead_is_refused_and_moves_nothing():
    from controlplane.core.sequence import MAX_SEQ_JUMP

    events = beats(1, 1 + MAX_SEQ_JUMP + 1, 2, 3)
    out = sequence(events, {})
    assert seqs_of(out.accepted) == [1, 2, 3]
    assert out.gaps == [] and out.late == 0
    [(event, reason)] = out.stale
    assert event is events[1]
    assert reason.startswith("implausible seq: ") and f"at most {MAX_SEQ_JUMP}" in reason
    assert out.cursors == {KEY: Cursor(3, ())}


def test_the_largest_plausible_jump_is_a_gap():
    from controlplane.core.sequence import MAX_SEQ_JUMP

    out = sequence(beats(1 + MAX_SEQ_JUMP), {KEY: Cursor(1)})
    assert seqs_of(out.accepted) == [1 + MAX_SEQ_JUMP]
    assert out.gaps == [SeqGap("job1", "n0/m0", "inc1", 1, 1 + MAX_SEQ_JUMP)]


def test_a_first_seq_of_2_63_minus_1_does_not_lock_out_the_source():
    out = sequence(beats(2**63 - 1, 1, 2), {})
    assert seqs_of(out.accepted) == [1, 2]
    assert [e.seq for e, _ in out.stale] == [2**63 - 1]
    assert out.cursors == {KEY: Cursor(2, ())}


@settings(max_examples=100)
@given(st.lists(st.integers(min_value=1, max_value=2**63 - 1), max_size=30))
def test_no_hole_is_ever_wider_than_the_jump_limit(seqs: list[int]):
    from controlplane.core.sequence import MAX_SEQ_JUMP

    out = sequence(beats(*seqs), {})
    for gap in out.gaps:
        assert gap.missing < MAX_SEQ_JUMP
    for cursor in out.cursors.values():
        assert all(hi - lo < MAX_SEQ_JUMP for lo, hi in cursor.holes)
    assert len(out.accepted) + len(out.stale) == len(seqs)
