"""Whether a job's log holds what its members sent, once each: every member process's events
(``source``, ``incarnation``) numbered 1 to its last with no number missing and none twice.
Members number what they send (``seq``) and publish until JetStream acknowledges it, so a
number missing from the log is an acknowledged event lost, and one stored twice a duplicate;
backup reports packed into catalogs count one by one."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from controlplane.core.catalog import unpacked
from controlplane.core.records import StoredEvent
from schemas.common import CONTROLPLANE_SOURCE


@dataclass(frozen=True, slots=True)
class LogAudit:
    """What the log of one job holds against what its members numbered."""

    #: Events of members and launchers (a catalog's reports one by one).
    events: int
    #: Member and launcher processes that sent them (source, incarnation).
    processes: int
    #: Numbers absent below each process's last: events lost.
    missing: int
    #: Events stored more than once (an event id, or a process's number, twice).
    duplicated: int
    #: Up to ten of the processes with a number missing or twice, for the reader.
    examples: tuple[str, ...] = ()

    @property
    def whole(self) -> bool:
        return self.missing == 0 and self.duplicated == 0

    def summary(self) -> dict[str, Any]:
        return {
            "events": self.events, "processes": self.processes, "missing": self.missing,
            "duplicated": self.duplicated, "whole": self.whole, "examples": list(self.examples),
        }  # fmt: skip


def audit(log: Iterable[StoredEvent]) -> LogAudit:
    """Audit ``log`` (one job's, as the store reads it)."""
    stored = list(log)
    ids = [s.event.event_id for s in stored]
    duplicated = len(ids) - len(set(ids))
    seqs: dict[tuple[str, str], list[int]] = {}
    for item in unpacked(stored):
        event = item.event
        if event.source != CONTROLPLANE_SOURCE:
            seqs.setdefault((event.source, event.incarnation), []).append(event.seq)
    missing = 0
    examples: list[str] = []
    for (source, incarnation), got in seqs.items():
        absent = max(got) - len(set(got))
        twice = len(got) - len(set(got))
        missing += absent
        duplicated += twice
        if (absent or twice) and len(examples) < 10:
            examples.append(f"{source} ({incarnation}): {absent} missing, {twice} twice")
    return LogAudit(sum(len(v) for v in seqs.values()), len(seqs), missing, duplicated,
                    tuple(examples))  # fmt: skip
