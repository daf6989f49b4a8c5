"""Job views kept in memory for the API, caught up by tailing the log by position.

The views start from the leader's newest view snapshot (``controlplane.snapshots``: every
job's view through one log position, and the steps its events counted, ``core.steps``) when
the store holds one this release can read, else from the log's first event; the log after
that is folded once (at start-up, in the background) and then incrementally: a request
that finds the views checked longer ago than ``refresh_s`` reads what was appended since the
last position folded (positions are gap-free and in commit order, so tailing never skips an
event) and folds it. No request folds the whole log. Folded views are never mutated
(``controlplane.core.fold``), so a request renders the view it took while the tail moves on.
Rendered responses are cached per job and per view version (the job's last position).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Hashable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime

from anyio import to_thread

from controlplane import gctune
from controlplane.core.fold import by_job, fold_noting
from controlplane.core.goodput import Goodput, GoodputCounter, goodput, goodput_types
from controlplane.core.records import StoredEvent
from controlplane.core.steps import (
    JobSteps,
    StepHistory,
    StepsUnreadable,
    decimated,
    loss_count,
    loss_points,
    start_after,
)
from controlplane.core.view import JobView
from controlplane.snapshots import decoded
from controlplane.store.port import EventStore, ViewSnapshot

#: Reads the log: (after, limit) -> up to ``limit`` events of every job after that position.
Reader = Callable[[int, int], list[StoredEvent]]
#: Called with each batch folded (metrics).
Observer = Callable[[Sequence[StoredEvent]], None]
#: Reads the view snapshot with its steps chunks (``ViewSnapshots.load_snapshot``).
SnapshotReader = Callable[[], ViewSnapshot | None]
#: Called with the views a start from a snapshot found, and the snapshot's position.
Started = Callable[[Sequence[JobView], int], None]
#: Reads one job's events of some types: (job, after, limit, types) -> up to ``limit`` of them.
TypedReader = Callable[[str, int, int, Sequence[str]], list[StoredEvent]]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Rendered:
    """A response body as sent, for one version of a job's view."""

    version: int
    body: bytes
    etag: str
    #: The response may be cached for good (a closed incident: nothing can change it).
    final: bool = False


@dataclass(slots=True)
class JobEntry:
    """One job: its folded view, its steps (loss by step, time marks), and responses
    rendered from them."""

    view: JobView
    #: What the events folded here counted (``core.steps``).
    steps: JobSteps = field(default_factory=JobSteps)
    #: What the events before those counted, from the view snapshot started from (None:
    #: every event of the job was folded here).
    history: StepHistory | None = None
    rendered: dict[Hashable, Rendered] = field(default_factory=dict)
    #: Its generations' step and backup records (``core.goodput``), counted from its events;
    #: ``counted_all``: from its first one (not so after a start from a snapshot, until
    #: ``LiveViews.goodput`` read the rest).
    goodput: GoodputCounter = field(default_factory=GoodputCounter)
    counted_all: bool = True

    def after(self, since: datetime) -> int:
        """A position whose events and all before it were recorded before ``since`` (0 when
        none is known): where a scan for events recorded since then may start."""
        return start_after(self.history, self.steps, since)

    def loss_points(self, limit: int | None = None) -> Iterator[tuple[int, float, datetime]]:
        """(step, mean loss, time of its last report) by step (``core.steps.loss_points``);
        with ``limit``, at most that many (``core.steps.decimated``)."""
        points = loss_points(self.history, self.steps)
        if limit is None:
            return points
        return decimated(points, loss_count(self.history, self.steps), limit)

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
        snapshot: SnapshotReader | None = None,
        started: Started | None = None,
    ) -> None:
        self._reader = reader
        #: Where the warm-up starts from (None: the log's first event).
        self._snapshot = snapshot
        self._started = started
        #: The snapshot's position the views started from (None: the whole log was folded).
        self.started_from: int | None = None
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
            if self._snapshot is not None and not self._position:
                self._start_from_snapshot()  # the first fold, whoever asks for it
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

    def goodput(self, job: str, read: TypedReader, now: datetime) -> Goodput | None:
        """``job``'s goodput at ``now`` (``core.goodput``; None before its registration).
        After a start from a snapshot, its records up to the views' position are read once
        (``read``), as the counter needs them from its first event."""
        with self._lock:
            entry = self._jobs[job]
            return goodput(entry.view, self._counted(entry, read), now)

    def goodputs(self, read: TypedReader, now: datetime) -> list[Goodput]:
        """Every registered job's goodput at ``now``."""
        with self._lock:
            found = [goodput(e.view, self._counted(e, read), now) for e in self._jobs.values()]
        return [g for g in found if g is not None]

    def _counted(self, entry: JobEntry, read: TypedReader, batch: int = 10_000) -> GoodputCounter:
        if entry.counted_all:
            return entry.goodput
        counter = GoodputCounter()
        # What the fold did not believe, as far as the view still names it.
        ignored = frozenset(d.position for d in entry.view.discounts)
        types = goodput_types(bool(entry.view.slow))
        after = 0
        while after < self._position:
            events = [
                e
                for e in read(entry.view.job_id, after, batch, types)
                if e.position <= self._position
            ]
            if not events:
                break
            counter.count(events, ignored)
            after = events[-1].position
        entry.goodput, entry.counted_all = counter, True
        return counter

    @contextmanager
    def locked(self) -> Iterator[None]:
        """Hold off catching up (to read the loss tables, which it mutates)."""
        with self._lock:
            yield

    def start_from_snapshot(self) -> bool:
        """Start from the store's view snapshot and its steps, before anything is folded (the
        first catch-up does it by itself); False when there is none or it is passed over (the
        whole log is folded then)."""
        with self._lock:
            if self._position or self._snapshot is None:
                raise RuntimeError("a start from a snapshot comes before any fold")
            return self._start_from_snapshot()

    def _start_from_snapshot(self) -> bool:
        assert self._snapshot is not None
        snapshot = self._snapshot()
        # Tried once: a snapshot passed over is not read again (a store error is raised, and
        # the next catch-up tries again).
        self._snapshot = None
        if snapshot is None:
            return False
        views, reason = decoded(snapshot, self._head())
        histories: dict[str, StepHistory] = {}
        if reason is None:
            try:
                histories = {job: StepHistory.of(snapshot.steps.get(job, ())) for job in views}
            except StepsUnreadable as exc:
                reason = str(exc)
        if reason is not None:
            log.warning("view snapshot passed over (%s): folding the whole log", reason)
            return False

        def first_position(job: str) -> int:  # a job's first event is its first mark
            marks = histories[job].mark_positions
            return marks[0] if marks else views[job].last_position

        order = sorted(views, key=first_position)
        self._jobs = {
            job: JobEntry(views[job], history=histories[job], counted_all=False) for job in order
        }
        self._position = self.started_from = snapshot.position
        if self._started is not None:
            self._started([views[job] for job in order], snapshot.position)
        log.info(
            "started from the view snapshot at position %d: %d job(s), %d step(s) of history",
            snapshot.position, len(views), sum(len(h) for h in histories.values()),
        )  # fmt: skip
        return True

    def _apply(self, events: list[StoredEvent]) -> None:
        jobs = self._jobs
        added: dict[str, JobEntry] = {}
        for job_id, batch in by_job(events).items():
            entry = jobs.get(job_id)
            # The fold says which events it did not believe: their steps and losses count
            # nowhere (a forged step of 10^15 is in the log, not on the loss curve).
            view, ignored = fold_noting(entry.view if entry is not None else None, batch)
            if entry is None:
                entry = added[job_id] = JobEntry(view)
            else:
                entry.view = view
            entry.steps.count(batch, ignored)
            entry.goodput.count(batch, ignored)
        if added:
            self._jobs = {**jobs, **added}
        self._position = events[-1].position
        if self._observe is not None:
            self._observe(events)
