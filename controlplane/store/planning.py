"""What an append keeps, skips and refuses: the rules every store shares, kept pure."""

from __future__ import annotations

from collections.abc import Container, Sequence
from dataclasses import dataclass

from controlplane.core.catalog import is_repeated_report
from controlplane.core.records import DeadLetter
from controlplane.core.sequence import SeqGap, Sequenced
from schemas.events import EnvelopeBase


@dataclass(slots=True)
class Unique:
    """A batch with repeated event_ids removed (the first occurrence stays)."""

    events: list[EnvelopeBase]
    encoded: list[bytes] | None
    repeats: int


def unique(events: Sequence[EnvelopeBase], encoded: Sequence[bytes] | None) -> Unique:
    """Drop events whose event_id appeared earlier in the same batch."""
    seen: set[str] = set()
    kept: list[EnvelopeBase] = []
    kept_encoded: list[bytes] | None = None if encoded is None else []
    for i, event in enumerate(events):
        event_id = event.event_id
        if event_id in seen:
            continue
        seen.add(event_id)
        kept.append(event)
        if kept_encoded is not None and encoded is not None:
            kept_encoded.append(encoded[i])
    return Unique(kept, kept_encoded, len(events) - len(kept))


def split_stale(
    sequenced: Sequenced, known_ids: Container[str]
) -> tuple[int, list[tuple[EnvelopeBase, str]]]:
    """Stale events already in the log are duplicates, and so are repeated backup reports
    (their seq was accepted and packed: ``is_repeated_report``); the others are refused
    (out of order)."""
    duplicates = 0
    refused = []
    repeated = sequenced.repeated
    for event, reason in sequenced.stale:
        if event.event_id in known_ids or is_repeated_report(event, repeated):
            duplicates += 1
        else:
            refused.append((event, reason))
    return duplicates, refused


def refused_letters(refused: Sequence[tuple[EnvelopeBase, str]]) -> list[DeadLetter]:
    """Dead letters for events the sequence rules refused."""
    return [
        DeadLetter(
            reason=reason,
            raw=event.model_dump_json().encode(),
            job_id=event.job_id,
            event_id=event.event_id,
        )
        for event, reason in refused
    ]


def gap_rows(gaps: Sequence[SeqGap]) -> list[tuple[str, str, str, int, int]]:
    """Gaps as (job_id, source, incarnation, after_seq, next_seq) rows."""
    return [(g.job_id, g.source, g.incarnation, g.after_seq, g.next_seq) for g in gaps]
