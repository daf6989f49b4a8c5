"""Per-source sequence rules: repeats refused, gaps recorded and fillable, restarts accepted.

A source numbers its events with ``seq``, strictly increasing within one incarnation (one run
of the producing process); a new incarnation starts its own sequence. When a seq jumps ahead,
the numbers skipped are a *hole*: recorded as a gap, and still accepted if they arrive late
(a producer that retries a failed publish delivers it after later ones). Any other seq at or
below the highest seen is out of order and refused.

A seq more than ``MAX_SEQ_JUMP`` past its source's highest (or, for a source's first event,
past 0) is implausible: no client skips that many (the member client buffers at most 100,000
events and drops the oldest beyond that), so it is refused as a dead letter and the cursor
does not move. Accepted, it would record a hole nobody can fill and let one bad number
(up to 2^63 - 1) decide what the source's honest later events count as.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from schemas.events import EnvelopeBase

#: (job_id, source, incarnation)
CursorKey = tuple[str, str, str]
Holes = tuple[tuple[int, int], ...]
#: Open holes kept per cursor; a late event for an older, forgotten hole is refused.
MAX_HOLES = 32
#: The furthest a seq may land past its source's highest: the member client's buffer
#: (``rank_runtime.client.EventClient``, 100,000 events) ten times over.
MAX_SEQ_JUMP = 1_000_000


@dataclass(frozen=True, slots=True)
class Cursor:
    """Highest seq accepted, and the inclusive ranges below it that never arrived."""

    last_seq: int = 0
    holes: Holes = ()


@dataclass(frozen=True, slots=True)
class SeqGap:
    """Events a source numbered but that had not arrived (before ``next_seq``)."""

    job_id: str
    source: str
    incarnation: str
    after_seq: int
    next_seq: int

    @property
    def missing(self) -> int:
        """How many sequence numbers were skipped."""
        return self.next_seq - self.after_seq - 1


@dataclass(slots=True)
class Sequenced:
    """The outcome of checking a batch against the cursors."""

    accepted: list[EnvelopeBase] = field(default_factory=list)
    #: Positions in the input of the accepted events.
    accepted_at: list[int] = field(default_factory=list)
    #: Events at or below their source's highest seq and in no hole, or implausibly far
    #: past it (``MAX_SEQ_JUMP``), with the reason.
    stale: list[tuple[EnvelopeBase, str]] = field(default_factory=list)
    #: The event_ids of the stale events at or below their source's highest seq and in no
    #: hole (not the implausible ones): repeats of an accepted seq, or out of order.
    repeated: set[str] = field(default_factory=set)
    gaps: list[SeqGap] = field(default_factory=list)
    #: Events accepted into a hole (late, after later events of their source).
    late: int = 0
    #: Cursors this batch moved, with their new values.
    cursors: dict[CursorKey, Cursor] = field(default_factory=dict)


def _fill(holes: Holes, seq: int) -> Holes | None:
    """The holes with ``seq`` taken out, or None when ``seq`` is in none of them."""
    for i, (lo, hi) in enumerate(holes):
        if lo <= seq <= hi:
            split = tuple((a, b) for a, b in ((lo, seq - 1), (seq + 1, hi)) if a <= b)
            return holes[:i] + split + holes[i + 1 :]
    return None


def sequence(events: Iterable[EnvelopeBase], cursors: Mapping[CursorKey, Cursor]) -> Sequenced:
    """Check events in order against the cursors; pure, the cursors are not changed."""
    out = Sequenced()
    last: dict[CursorKey, int] = {}
    holes: dict[CursorKey, Holes] = {}
    accepted, accepted_at = out.accepted, out.accepted_at
    for index, event in enumerate(events):
        key = (event.job_id, event.source, event.incarnation)
        top = last.get(key)
        if top is None:
            cursor = cursors.get(key)
            top = last[key] = cursor.last_seq if cursor else 0
            holes[key] = cursor.holes if cursor else ()
        seq = event.seq
        if seq == top + 1:  # the common case
            last[key] = seq
        elif seq - top > MAX_SEQ_JUMP:
            out.stale.append(
                (
                    event,
                    f"implausible seq: {seq} is {seq - top} past {top} from {event.source} "
                    f"(incarnation {event.incarnation}); a source skips at most {MAX_SEQ_JUMP}",
                )
            )
            continue
        elif seq > top:
            out.gaps.append(SeqGap(event.job_id, event.source, event.incarnation, top, seq))
            holes[key] = (*holes[key], (top + 1, seq - 1))[-MAX_HOLES:]
            last[key] = seq
        else:
            filled = _fill(holes[key], seq)
            if filled is None:
                out.repeated.add(event.event_id)
                out.stale.append(
                    (
                        event,
                        f"out-of-order seq: {seq} after {top} from {event.source} "
                        f"(incarnation {event.incarnation})",
                    )
                )
                continue
            holes[key] = filled[-MAX_HOLES:]
            out.late += 1
        accepted.append(event)
        accepted_at.append(index)
    for key, top in last.items():
        before = cursors.get(key)
        if before is None or before.last_seq != top or before.holes != holes[key]:
            out.cursors[key] = Cursor(top, holes[key])
    return out
