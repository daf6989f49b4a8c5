"""Export a store's log to a JSONL file, and import such a file into a store."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from typing import Any, BinaryIO

from controlplane.core.records import StoredEvent
from controlplane.postmortem.logfile import encode_line
from controlplane.store.port import EventStore

#: Events read from the store per page on export (memory stays constant).
EXPORT_PAGE = 5_000
#: Events appended per transaction on import.
IMPORT_BATCH = 5_000


@dataclass(slots=True)
class ExportSummary:
    """What an export wrote."""

    events: int = 0
    first_position: int | None = None
    last_position: int | None = None
    #: The log's head when the export began: the export holds what was committed up to it.
    head: int = 0
    jobs: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def export_log(
    store: EventStore,
    out: BinaryIO,
    *,
    job_id: str | None = None,
    after: int = 0,
    progress: Callable[[int], None] | None = None,
    page: int = EXPORT_PAGE,
) -> ExportSummary:
    """Write every event after ``after`` (of ``job_id``, or of every job) in position order,
    one line each, streaming a page at a time. The export stops at the head the log had when
    it began, so it is a consistent prefix of the log even while events keep coming.
    ``progress`` is called with each page's last position."""
    summary = ExportSummary(head=store.last_position())
    jobs: dict[str, None] = {}
    write = out.write
    for stored in store.iter_events(job_id=job_id, after=after, batch=page):
        if stored.position > summary.head:
            break
        write(encode_line(stored))
        if summary.first_position is None:
            summary.first_position = stored.position
        summary.last_position = stored.position
        summary.events += 1
        jobs.setdefault(stored.event.job_id)
        if progress is not None and summary.events % page == 0:
            progress(stored.position)
    if progress is not None:
        progress(summary.head)
    summary.jobs = list(jobs)
    return summary


@dataclass(slots=True)
class ImportSummary:
    """What an import did with a file's events."""

    read: int = 0
    imported: int = 0
    #: Events whose event_id the log already held: skipped (an import is idempotent).
    duplicates: int = 0
    #: Events the sequence rules refused (kept as dead letters, with the reason).
    rejected: int = 0
    gaps: int = 0
    #: Imported events that got the position they had in the file.
    same_positions: int = 0
    first_position: int | None = None
    last_position: int | None = None
    jobs: list[str] = field(default_factory=list)

    @property
    def positions_kept(self) -> bool:
        """Every imported event kept its position (a complete export into an empty log)."""
        return self.same_positions == self.imported

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "positions_kept": self.positions_kept}


def import_log(
    store: EventStore,
    events: Iterable[StoredEvent],
    *,
    batch: int = IMPORT_BATCH,
    progress: Callable[[ImportSummary], None] | None = None,
) -> ImportSummary:
    """Append ``events`` (a log file's, in position order) to ``store`` in batches, each
    keeping its recorded time (``EventStore.import_events``). Importing twice stores nothing
    twice. ``progress`` is called after each batch with the summary so far."""
    summary = ImportSummary()
    jobs: dict[str, None] = {}
    pending: list[StoredEvent] = []

    def flush() -> None:
        result = store.import_events(pending)
        summary.read += len(pending)
        summary.imported += len(result.stored)
        summary.duplicates += result.duplicates
        summary.rejected += len(result.rejected)
        summary.gaps += len(result.gaps)
        if result.stored:
            by_id = {s.event.event_id: s.position for s in pending}
            summary.same_positions += sum(
                1 for s in result.stored if by_id.get(s.event.event_id) == s.position
            )
            if summary.first_position is None:
                summary.first_position = result.stored[0].position
            summary.last_position = result.stored[-1].position
        pending.clear()
        if progress is not None:
            progress(summary)

    for stored in events:
        jobs.setdefault(stored.event.job_id)
        pending.append(stored)
        if len(pending) >= batch:
            flush()
    if pending:
        flush()
    summary.jobs = list(jobs)
    return summary


__all__ = ["ExportSummary", "ImportSummary", "export_log", "import_log"]
