"""The event store port: what the control plane needs from a log, whatever keeps it."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import NamedTuple, Protocol

from controlplane.core.records import DeadLetter, StoredEvent
from controlplane.core.sequence import SeqGap
from schemas.events import EnvelopeBase


class JobHead(NamedTuple):
    """What a decider expects: the position of the newest event of ``job_id`` in the log,
    and with ``log`` the log's own last position (of any job) too: a batch whose events
    cite one another's positions (a decision citing the summary appended with it) is
    stored at ``log + 1`` on, or not at all."""

    job_id: str
    position: int
    log: int | None = None


@dataclass(slots=True)
class AppendResult:
    """What one append did with its batch."""

    stored: list[StoredEvent] = field(default_factory=list)
    #: Events whose event_id was already in the log: skipped, not an error.
    duplicates: int = 0
    #: Events refused by the sequence rules (out of order); they went to the dead letters.
    rejected: list[tuple[EnvelopeBase, str]] = field(default_factory=list)
    dead_letters: int = 0
    gaps: list[SeqGap] = field(default_factory=list)
    #: Events accepted late into a gap their source had left.
    late: int = 0


@dataclass(frozen=True, slots=True)
class StoredDeadLetter:
    """A dead letter as kept by the store."""

    id: int
    letter: DeadLetter
    received_at: object


class EventLog(Protocol):
    """An append-only log of events with gap-free positions in commit order.

    Appends are idempotent by ``event_id``; per-source ``seq`` rules apply (see
    ``controlplane.core.sequence``). A reader that tails by position never skips an event.
    """

    def append(
        self,
        events: Sequence[EnvelopeBase],
        dead_letters: Sequence[DeadLetter] = (),
        *,
        expected: JobHead | None = None,
        encoded: Sequence[bytes] | None = None,
    ) -> AppendResult:
        """Append a batch atomically; dead letters commit in the same transaction.

        With ``expected``, raise ``ConcurrencyError`` unless the newest event of that job is
        at that position (optimistic concurrency for decisions: whatever the decider did not
        see makes the append fail), and with ``expected.log`` unless the log's newest
        position is that one (``ConcurrencyError.log_head`` says where it is): the batch
        then takes the positions after it. ``encoded``, parallel to ``events``, is what the store's
        own ``encode`` made of them ahead of time (an empty row: one it left to the append).
        """
        ...

    def import_events(self, events: Sequence[StoredEvent]) -> AppendResult:
        """Append events recorded by another log (an export), in the order given, keeping
        each one's ``recorded_at`` (aware) so that times derived from them stay the same.

        Everything else is ``append``'s: one transaction, event_ids already in the log are
        skipped (counted as duplicates), the per-source sequence rules apply (refused events
        become dead letters, gaps are recorded) and positions are this log's next ones; so a
        complete export imported into an empty log keeps its positions. The positions of
        ``events`` are not used.
        """
        ...

    def read(
        self,
        *,
        job_id: str | None = None,
        after: int = 0,
        limit: int | None = None,
        types: Sequence[str] | None = None,
    ) -> list[StoredEvent]:
        """Events with ``position > after`` in position order, optionally filtered."""
        ...

    def iter_events(
        self, *, job_id: str | None = None, after: int = 0, batch: int = 10_000
    ) -> Iterator[StoredEvent]:
        """Stream every matching event in position order, a batch at a time."""
        ...

    def last_position(self) -> int:
        """Position of the newest event (0 for an empty log)."""
        ...

    def seq_gaps(self) -> list[SeqGap]:
        """Every sequence gap recorded, oldest first."""
        ...

    def job_ids(self) -> list[str]:
        """Every job that has an event, in order of first appearance."""
        ...


class DeadLetters(Protocol):
    """What was refused, kept with its reason (written in the appends' transactions)."""

    def dead_letters(self, *, after_id: int = 0, limit: int = 1000) -> list[StoredDeadLetter]:
        """Dead letters in arrival order."""
        ...

    def count_dead_letters(self) -> int:
        """How many dead letters are kept."""
        ...


@dataclass(frozen=True, slots=True)
class ViewSnapshot:
    """Every job's encoded view (``controlplane.core.snapshot``), whole through ``position``:
    each holds every event of its job up to there."""

    position: int
    #: The fold that wrote it (``core.snapshot.fold_version``): another's is not read.
    fold_version: str
    taken_at: datetime
    #: job -> encoded view.
    bodies: dict[str, bytes]
    #: job -> its steps chunks through ``position`` in log order (``core.steps``), when asked.
    steps: dict[str, list[bytes]] = field(default_factory=dict)


class ViewSnapshots(Protocol):
    """A cache of the fold beside the log: where a leader's start-up begins (never a source of
    truth: emptied, nothing is lost but time)."""

    def save_snapshot(
        self,
        position: int,
        fold_version: str,
        bodies: Mapping[str, tuple[int, bytes]],
        *,
        taken_at: datetime,
        whole: bool,
        steps: Mapping[str, bytes] | None = None,
    ) -> bool:
        """Record the views in ``bodies`` (job -> (its view's last position, encoded view))
        and that the snapshot is whole through ``position``, with ``steps`` (job -> a chunk of
        what the events since the previous snapshot counted, ``core.steps``) at ``position``.
        ``whole``: ``bodies`` has every job and ``steps`` counts every event, and rows of
        others are dropped; else the jobs not in it keep their rows (their views did not
        change). Nothing is written, and False returned, when the snapshot recorded already
        is of a later position (a writer that lost the lead)."""
        ...

    def load_snapshot(self, *, steps: bool = False) -> ViewSnapshot | None:
        """The snapshot recorded (None: none yet), with its steps chunks if ``steps``."""
        ...


class EventStore(EventLog, DeadLetters, ViewSnapshots, Protocol):
    """A store of every role: the event log, the dead letters its appends refused, and the
    views' snapshots."""


class Appender(Protocol):
    """The event log's append, asynchronous: where the ingest and the decider commit
    (``AsyncAppender``, or a synchronous store adapted by ``SyncAppender``)."""

    async def append(
        self,
        events: Sequence[EnvelopeBase],
        dead_letters: Sequence[DeadLetter] = (),
        *,
        expected: JobHead | None = None,
        encoded: Sequence[bytes] | None = None,
    ) -> AppendResult: ...

    def encode(self, events: Sequence[EnvelopeBase]) -> list[bytes] | None:
        """Pre-encode events for ``append(encoded=...)``; None when the store needs nothing."""
        ...


def paged(
    read: Callable[..., list[StoredEvent]], *, job_id: str | None, after: int, batch: int
) -> Iterator[StoredEvent]:
    """Every event after ``after``, read ``batch`` at a time with a store's ``read``."""
    while True:
        page = read(job_id=job_id, after=after, limit=batch)
        yield from page
        if len(page) < batch:
            return
        after = page[-1].position
