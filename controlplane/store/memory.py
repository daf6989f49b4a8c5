"""An in-memory event store with the same contract as the PostgreSQL one, for unit tests."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from datetime import UTC, datetime

from controlplane.core.catalog import pack, unpacked
from controlplane.core.records import DeadLetter, StoredEvent
from controlplane.core.sequence import Cursor, CursorKey, SeqGap, sequence
from controlplane.errors import ConcurrencyError, StoreRefused
from controlplane.store.planning import refused_letters, split_stale, unique
from controlplane.store.port import AppendResult, JobHead, StoredDeadLetter, ViewSnapshot, paged
from schemas.common import INT64_MAX
from schemas.events import EnvelopeBase


def _utcnow() -> datetime:
    return datetime.now(UTC)


def refusal(event: EnvelopeBase) -> str | None:
    """Why PostgreSQL would refuse to store ``event`` (None: it would not), so that this
    store refuses the same input (``StoreRefused``) as the PostgreSQL one. The schemas let
    none of it through; an event built without validation (``model_construct``) can hold it."""
    for name in ("seq", "generation"):
        if not 0 <= getattr(event, name) <= INT64_MAX:
            return f"value {getattr(event, name)} is out of range for type bigint ({name})"
    if "\\u0000" in event.model_dump_json():
        return "unsupported Unicode escape sequence: \\u0000 cannot be converted to text"
    return None


class InMemoryEventStore:
    """A log kept in process memory; a lock makes it the single writer."""

    def __init__(self, clock: Callable[[], datetime] = _utcnow) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._events: list[StoredEvent] = []
        self._job_heads: dict[str, int] = {}
        self._ids: set[str] = set()
        self._cursors: dict[CursorKey, Cursor] = {}
        self._gaps: list[SeqGap] = []
        self._dead: list[StoredDeadLetter] = []
        self._dead_keys: set[tuple[str, object]] = set()
        self._snapshot: ViewSnapshot | None = None

    def append(
        self,
        events: Sequence[EnvelopeBase],
        dead_letters: Sequence[DeadLetter] = (),
        *,
        expected: JobHead | None = None,
        encoded: Sequence[bytes] | None = None,
    ) -> AppendResult:
        return self._append(events, dead_letters, expected, encoded, None)

    def import_events(self, events: Sequence[StoredEvent]) -> AppendResult:
        """See ``EventStore.import_events``."""
        events = list(unpacked(events))
        recorded_at: dict[str, datetime] = {}
        for stored in events:
            recorded_at.setdefault(stored.event.event_id, stored.recorded_at)
        return self._append([s.event for s in events], (), None, None, recorded_at)

    def _append(
        self,
        events: Sequence[EnvelopeBase],
        dead_letters: Sequence[DeadLetter],
        expected: JobHead | None,
        encoded: Sequence[bytes] | None,
        recorded_at: Mapping[str, datetime] | None,
    ) -> AppendResult:
        with self._lock:
            head = len(self._events)
            if expected is not None:
                last = self._job_heads.get(expected.job_id, 0)
                if last != expected.position:
                    raise ConcurrencyError(
                        f"job {expected.job_id} is at {last}, writer expected {expected.position}"
                    )
                if expected.log is not None and head != expected.log:
                    raise ConcurrencyError(
                        f"the log is at {head}, writer expected {expected.log}", log_head=head
                    )
            for event in events:
                if (why := refusal(event)) is not None:
                    raise StoreRefused(f"event {event.event_id}: {why}")
            batch = unique(events, encoded)
            sequenced = sequence(batch.events, self._cursors)
            duplicates, refused = split_stale(sequenced, self._ids)
            now = self._clock()
            stored: list[StoredEvent] = []
            accepted = sequenced.accepted
            for event, first in pack(accepted):
                if event.event_id in self._ids:  # an event_id reused under a new seq
                    duplicates += 1
                    continue
                at = now if recorded_at is None else recorded_at[accepted[first].event_id]
                stored.append(StoredEvent(head + len(stored) + 1, at, event))
                self._ids.add(event.event_id)
            added = 0
            for letter in [*dead_letters, *refused_letters(refused)]:
                keys = [("stream", letter.stream_seq), ("event", letter.event_id)]
                if any(k[1] is not None and k in self._dead_keys for k in keys):
                    continue
                self._dead_keys.update(k for k in keys if k[1] is not None)
                self._dead.append(StoredDeadLetter(len(self._dead) + 1, letter, now))
                added += 1
            self._events.extend(stored)
            for s in stored:
                self._job_heads[s.event.job_id] = s.position
            self._cursors.update(sequenced.cursors)
            self._gaps.extend(sequenced.gaps)
            return AppendResult(
                stored=stored,
                duplicates=batch.repeats + duplicates,
                rejected=refused,
                dead_letters=added,
                gaps=sequenced.gaps,
                late=sequenced.late,
            )

    def read(
        self,
        *,
        job_id: str | None = None,
        after: int = 0,
        limit: int | None = None,
        types: Sequence[str] | None = None,
    ) -> list[StoredEvent]:
        with self._lock:
            tail = self._events[max(after, 0) :]
        wanted = set(types) if types else None
        out = []
        for stored in tail:
            if job_id is not None and stored.event.job_id != job_id:
                continue
            if wanted is not None and stored.event.type not in wanted:
                continue
            out.append(stored)
            if limit is not None and len(out) >= limit:
                break
        return out

    def iter_events(
        self, *, job_id: str | None = None, after: int = 0, batch: int = 10_000
    ) -> Iterator[StoredEvent]:
        return paged(self.read, job_id=job_id, after=after, batch=batch)

    def last_position(self) -> int:
        with self._lock:
            return len(self._events)

    def dead_letters(self, *, after_id: int = 0, limit: int = 1000) -> list[StoredDeadLetter]:
        with self._lock:
            return self._dead[after_id : after_id + limit]

    def count_dead_letters(self) -> int:
        with self._lock:
            return len(self._dead)

    def seq_gaps(self) -> list[SeqGap]:
        with self._lock:
            return list(self._gaps)

    def job_ids(self) -> list[str]:
        with self._lock:
            return list(dict.fromkeys(e.event.job_id for e in self._events))

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
        with self._lock:
            old = self._snapshot
            if old is not None and old.position > position:
                return False
            if not whole and (old is None or old.fold_version != fold_version):
                raise ValueError("a partial snapshot needs a whole one of the same fold before it")
            kept = {} if whole or old is None else dict(old.bodies)
            kept.update((job, body) for job, (_, body) in bodies.items())
            chunks = {} if whole or old is None else {j: list(c) for j, c in old.steps.items()}
            for job, chunk in (steps or {}).items():
                chunks.setdefault(job, []).append(chunk)
            self._snapshot = ViewSnapshot(position, fold_version, taken_at, kept, chunks)
            return True

    def load_snapshot(self, *, steps: bool = False) -> ViewSnapshot | None:
        with self._lock:
            snapshot = self._snapshot
        if snapshot is None or steps:
            return snapshot
        return dataclasses.replace(snapshot, steps={})
