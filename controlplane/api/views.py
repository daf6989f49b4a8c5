"""Job views kept in memory for the API, caught up by tailing the log by position.

The log is folded once (at start-up, in the background) and then incrementally: a request
that finds the views checked longer ago than ``refresh_s`` reads what was appended since the
last position folded (positions are gap-free and in commit order, so tailing never skips an
event) and folds it. No request folds the whole log. Folded views are never mutated
(``controlplane.core.fold``), so a request renders the view it took while the tail moves on.
Rendered responses are cached per job and per view version (the job's last position).
"""

from __future__ import annotations

import asyncio
import bisect
import threading
import time
from collections.abc import Awaitable, Callable, Hashable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime

from anyio import to_thread

from controlplane import gctune
from controlplane.api.render import StepLoss
from controlplane.core.fold import fold_noting
from controlplane.core.records import StoredEvent
from controlplane.core.view import JobView
from controlplane.store.port import EventStore

#: Reads the log: (after, limit) -> up to ``limit`` events of every job after that position.
Reader = Callable[[int, int], list[StoredEvent]]
#: Called with each batch folded (metrics).
Observer = Callable[[Sequence[StoredEvent]], None]


@dataclass(frozen=True, slots=True)
class Rendered:
    """A response body as sent, for one version of a job's view."""

    version: int
    body: bytes
    etag: str
    #: The response may be cached for good (a closed incident: nothing can change it).
    final: bool = False


#: One position in this many of a job's events is kept with its time (see ``JobEntry.after``).
TIME_MARK_EVERY = 1024


@dataclass(slots=True)
class JobEntry:
    """One job: its folded view, its loss by step, and responses rendered from them."""

    view: JobView
    losses: dict[int, StepLoss] = field(default_factory=dict)
    rendered: dict[Hashable, Rendered] = field(default_factory=dict)
    #: Every TIME_MARK_EVERY-th event of the job: its recorded time and position.
    mark_times: list[datetime] = field(default_factory=list)
    mark_positions: list[int] = field(default_factory=list)
    #: Every event folded so far was recorded no earlier than the one before it.
    monotone: bool = True
    _seen: int = 0
    _last_at: datetime | None = None

    def count_times(self, events: list[StoredEvent]) -> None:
        """Keep the time marks and check that recorded times follow positions."""
        for stored in events:
            at = stored.recorded_at
            if self._last_at is not None and at < self._last_at:
                self.monotone = False
            self._last_at = at
            if self._seen % TIME_MARK_EVERY == 0:
                self.mark_times.append(at)
                self.mark_positions.append(stored.position)
            self._seen += 1

    def after(self, since: datetime) -> int:
        """A position whose events and all before it were recorded before ``since`` (0 when
        none is known): where a scan for events recorded since then may start. Exact, as it
        relies on the order of times only where it was seen to hold."""
        if not self.monotone:
            return 0
        i = bisect.bisect_left(self.mark_times, since) - 1
        return self.mark_positions[i] if i >= 0 else 0

    def cached(self, key: Hashable, version: int) -> Rendered | None:
        """The body rendered for ``key`` from this version of the view, if any."""
        hit = self.rendered.get(key)
        return hit if hit is not None and hit.version == version else None


def store_reader(store: EventStore) -> Reader:
    """Read any store through its port (``read`` of every job after a position)."""
    return lambda after, limit: store.read(after=after, limit=limit)


class LiveViews:
    """Every job's view, folded from the log and kept current by tailing it."""

    def __init__(
        self,
        reader: Reader,
        head: Callable[[], int],
        *,
        refresh_s: float = 0.05,
        batch: int = 10_000,
        observe: Observer | None = None,
        async_head: Callable[[], Awaitable[int]] | None = None,
        freeze_heap: bool = False,
    ) -> None:
        self._reader = reader
        self._head = head
        #: The head read without a thread (the common case: nothing new to fold).
        self._async_head = async_head
        self._checking: asyncio.Lock | None = None
        self.refresh_s = refresh_s
        self._batch = batch
        self._observe = observe
        #: Serializes catching up, and the loss tables it mutates.
        self._lock = threading.Lock()
        #: Replaced (never mutated) when a job appears, so readers can iterate it freely.
        self._jobs: dict[str, JobEntry] = {}
        self._position = 0
        self._checked = -float("inf")
        self._warming: threading.Thread | None = None
        self._closing = False
        #: Settle the heap at start-up and after the warm-up (``gctune.settle_heap``): a server's.
        self._freeze_heap = freeze_heap

    @property
    def position(self) -> int:
        """The last log position folded."""
        return self._position

    @property
    def jobs(self) -> Mapping[str, JobEntry]:
        """Every job folded so far, in order of first appearance."""
        return self._jobs

    def views(self) -> list[JobView]:
        """The current view of every job."""
        return [entry.view for entry in self._jobs.values()]

    def is_fresh(self) -> bool:
        """The log was checked less than ``refresh_s`` ago."""
        return time.monotonic() - self._checked < self.refresh_s

    def catch_up(self, *, force: bool = False) -> int:
        """Fold what the log holds beyond the views (unless checked within ``refresh_s``, or
        ``force``); return the position folded."""
        with self._lock:
            if not force and self.is_fresh():
                return self._position
            started = time.monotonic()
            head = self._head()
            while self._position < head and not self._closing:
                events = self._reader(self._position, self._batch)
                if not events:
                    break
                self._apply(events)
            self._checked = started
            return self._position

    async def fresh(self, *, force: bool = False) -> LiveViews:
        """Catch up unless fresh. One request at a time checks the head; only when the log
        moved does a worker thread read and fold what is new."""
        if not force and self.is_fresh():
            return self
        if self._async_head is None:
            await to_thread.run_sync(lambda: self.catch_up(force=force))
            return self
        if self._checking is None:
            self._checking = asyncio.Lock()
        async with self._checking:
            if not force and self.is_fresh():  # another request just checked
                return self
            started = time.monotonic()
            if await self._async_head() > self._position:
                await to_thread.run_sync(lambda: self.catch_up(force=True))
            else:
                self._checked = max(self._checked, started)
        return self

    def warm_up(self) -> None:
        """Start folding the log in the background (start-up of a server)."""
        if self._freeze_heap:
            gctune.settle_heap()
        if self._warming is None:
            self._warming = threading.Thread(
                target=self._warm, name="api-views-warm-up", daemon=True
            )
            self._warming.start()

    def close(self, timeout_s: float = 30.0) -> None:
        """Stop folding: wait for the warm-up to end (it holds a connection of the store)."""
        self._closing = True
        if self._warming is not None:
            self._warming.join(timeout_s)

    def _warm(self) -> None:
        try:
            self.catch_up(force=True)
        except Exception:  # a request retries, and reports the error
            self._checked = -float("inf")
        if self._freeze_heap:
            gctune.settle_heap()

    @contextmanager
    def locked(self) -> Iterator[None]:
        """Hold off catching up (to read the loss tables, which it mutates)."""
        with self._lock:
            yield

    def _apply(self, events: list[StoredEvent]) -> None:
        by_job: dict[str, list[StoredEvent]] = {}
        for stored in events:
            by_job.setdefault(stored.event.job_id, []).append(stored)
        jobs = self._jobs
        added: dict[str, JobEntry] = {}
        for job_id, batch in by_job.items():
            entry = jobs.get(job_id)
            # The fold says which events it did not believe: their steps and losses count
            # nowhere (a forged step of 10^15 is in the log, not on the loss curve).
            view, ignored = fold_noting(entry.view if entry is not None else None, batch)
            if entry is None:
                entry = added[job_id] = JobEntry(view)
            else:
                entry.view = view
            _count_losses(entry.losses, batch, ignored)
            entry.count_times(batch)
        if added:
            self._jobs = {**jobs, **added}
        self._position = events[-1].position
        if self._observe is not None:
            self._observe(events)


def _count_losses(
    losses: dict[int, StepLoss], events: list[StoredEvent], ignored: frozenset[int] = frozenset()
) -> None:
    for stored in events:
        event = stored.event
        if event.type != "train.step" or (ignored and stored.position in ignored):
            continue
        step, loss = event.payload.step, event.payload.loss
        known = losses.get(step)
        if known is None:
            losses[step] = StepLoss(event.generation, loss, 1, stored.recorded_at)
        else:
            known.add(event.generation, loss, stored.recorded_at)
