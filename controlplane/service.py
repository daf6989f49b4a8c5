"""The control plane's one service loop, while this process holds the ingest lock.

One place says what happens to an event, in order::

    fetch → validate → append → fold → ack → decide → append → fold → publish

``Session.run`` is an ``asyncio.TaskGroup``: the fetcher pulls and decodes batches from
JetStream (``ingest.Fetcher``), the decider's clock wants a turn at each deadline
(``Decider.tick``), the lock is watched, the views are snapshotted now and then; and the loop
itself (``Session._loop``), one step at a time, appends a fetched batch (``ingest.commit``,
retrying while PostgreSQL is away), folds what was stored into the views (``Views.apply``:
each event once), acknowledges the batch to JetStream (so nothing unacknowledged was ever
lost: the server redelivers it, the store skips what it holds), and gives the decider its
turn when a commit or a deadline asks for one: decide, append the decisions, fold them,
publish the commands. Nothing else appends or folds, so a decision is always taken on the
log's own view (its append fails only when another process wrote; the view is then read
again from the log).

Heartbeats do not pass through here: they are soft state, taken by the heartbeat listener
into the liveness table as they arrive (``bus.HeartbeatListener``, ``core/liveness.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING

from controlplane.backoff import Backoff
from controlplane.core.fold import fold, fold_jobs
from controlplane.core.records import StoredEvent
from controlplane.core.statemachine import TERMINAL
from controlplane.core.view import JobView
from controlplane.decider import Decider
from controlplane.errors import StoreUnavailable
from controlplane.ingest import Batch, Fetcher, IngestStats, commit
from controlplane.snapshots import Snapshotter
from controlplane.store.port import Appender, AppendResult, EventLog
from schemas.logjson import about

if TYPE_CHECKING:
    from controlplane.api.metrics import LogMetrics

log = logging.getLogger(__name__)


class Views:
    """Every job's view, folded from what this process commits: their one owner.

    ``current`` is a mapping replaced (never changed in place) at every fold, so a reader in
    another thread (the rendezvous store's) sees one version or the next."""

    def __init__(
        self,
        views: dict[str, JobView] | None = None,
        *,
        snapshotter: Snapshotter | None = None,
        metrics: LogMetrics | None = None,
    ) -> None:
        self.current: dict[str, JobView] = views or {}
        self.snapshotter = snapshotter
        self.metrics = metrics

    def apply(self, result: AppendResult) -> None:
        """Fold what an append stored (each event once, in log order)."""
        if self.metrics is not None:
            self.metrics.appended(result.dead_letters)
        if not result.stored:
            return
        if self.snapshotter is not None:
            self.current = self.snapshotter.fold(self.current, result)
        else:
            self.current = fold_jobs(self.current, result.stored)
        if self.metrics is not None:
            self.metrics.observe(result.stored)

    def refreshed(self, job_id: str, events: Sequence[StoredEvent]) -> None:
        """Fold ``events`` of ``job_id`` that another writer appended (read from the log)."""
        if not events:
            return
        view = self.current.get(job_id)
        self.current = {**self.current, job_id: fold(view, events)}
        if self.snapshotter is not None:
            self.snapshotter.lost_track(f"{len(events)} event(s) of {job_id} another wrote")

    def settled(self) -> bool:
        """No job is recovering (none has an open incident)."""
        return not any(
            v.open_incident is not None and v.state not in TERMINAL for v in self.current.values()
        )


class Session:
    """One ingest session: the loop, and the tasks beside it (see the module docstring)."""

    def __init__(
        self,
        *,
        views: Views,
        store: EventLog,
        appender: Appender,
        fetcher: Fetcher,
        decider: Decider,
        turn: Callable[[], Awaitable[None]] | None = None,
        decide_interval_s: float,
        retry_max_s: float,
        lock_held: Callable[[], Awaitable[bool]],
        lock_retry_s: float,
    ) -> None:
        self.views = views
        self._store = store
        self._appender = appender
        self.fetcher = fetcher
        self.decider = decider
        #: The decider's turn (``decider.turn``, or it wrapped).
        self._turn_of = turn or decider.turn
        self._decide_interval_s = decide_interval_s
        self._retry_max_s = retry_max_s
        self._lock_held = lock_held
        self._lock_retry_s = lock_retry_s
        self.stats: IngestStats = fetcher.stats
        #: Set when the lock was found lost (the session ended for that).
        self.lost_lock = False

    async def run(self, stop: asyncio.Event) -> None:
        """Serve until ``stop`` is set or the lock is lost; the batch being appended then is
        finished and acknowledged."""
        done = asyncio.Event()
        batches: asyncio.Queue[Batch] = asyncio.Queue(maxsize=2)
        snapshotter = self.views.snapshotter
        async with asyncio.TaskGroup() as group:
            beside = [
                group.create_task(self._until(stop, done), name="stop"),
                group.create_task(self._watch_lock(done), name="lock"),
                group.create_task(self.fetcher.run(batches, done), name="fetch"),
                group.create_task(self.decider.tick(done, self._decide_interval_s), name="tick"),
            ]
            if snapshotter is not None:
                beside.append(group.create_task(
                    snapshotter.run(done, lambda: self.views.current, self.views.settled),
                    name="snapshots",
                ))  # fmt: skip
            try:
                await self._loop(batches, done)
            finally:
                # What was fetched and not appended is not acknowledged: it comes again.
                done.set()
                for task in beside:
                    task.cancel()

    async def _until(self, stop: asyncio.Event, done: asyncio.Event) -> None:
        waits = [asyncio.ensure_future(e.wait()) for e in (stop, done)]
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for waiter in waits:
                waiter.cancel()
        done.set()

    async def _watch_lock(self, done: asyncio.Event) -> None:
        while not done.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(done.wait(), self._lock_retry_s)
            if not done.is_set() and not await self._lock_held():
                log.warning("lost the ingest lock; stopping ingest until it is ours again")
                self.lost_lock = True
                done.set()

    async def _loop(self, batches: asyncio.Queue[Batch], done: asyncio.Event) -> None:
        decider = self.decider
        while True:
            if decider.wanted.is_set():
                await self._turn()
            batch = await self._next(batches, done)
            if batch is None:
                return
            result = await self._append(batch, done)
            if result is None:
                return  # stopped while PostgreSQL was away: the batch comes again, unacked
            self.views.apply(result)
            try:
                await self.fetcher.ack(batch)
            except Exception as exc:
                # Committed but not acked: the messages come again and are skipped.
                log.warning("ack failed (%s); the batch will be redelivered and skipped", exc)
            self.fetcher.count(batch, result)
            decider.on_commit(result)

    async def _next(self, batches: asyncio.Queue[Batch], done: asyncio.Event) -> Batch | None:
        """The next fetched batch, or None once done; a turn the decider wants meanwhile is
        given first."""
        while True:
            if not batches.empty():
                return batches.get_nowait()
            waits = {
                asyncio.ensure_future(batches.get()),
                asyncio.ensure_future(done.wait()),
                asyncio.ensure_future(self.decider.wanted.wait()),
            }
            finished, pending = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            for waiter in pending:
                waiter.cancel()
            for waiter in finished:
                got = waiter.result()
                if isinstance(got, Batch):
                    return got
            if done.is_set():
                return None
            await self._turn()

    async def _turn(self) -> None:
        """The decider's turn (decide → append → fold → publish); the fetcher pauses its
        decoding meanwhile, so the turn's round trips to PostgreSQL wait for nothing."""
        self.decider.wanted.clear()
        with self.fetcher.paused():
            try:
                await self._turn_of()
            except Exception:
                log.exception("the decider's turn failed; the loop goes on")

    async def _append(self, batch: Batch, done: asyncio.Event) -> AppendResult | None:
        """Append ``batch``, retrying while PostgreSQL is away; None if done first."""
        backoff = Backoff(max_s=self._retry_max_s)
        while True:
            try:
                return await commit(
                    self._appender, batch.events, batch.dead_letters, batch.encoded, batch.origins
                )
            except StoreUnavailable as exc:
                self.stats.store_retries += 1
                if done.is_set():
                    log.warning("stopping with a batch not appended (%s)", exc)
                    return None
                log.warning("PostgreSQL unavailable (%s); retrying the batch", exc)
                await backoff.sleep(done)

    async def refresh(self, job_id: str) -> None:
        """Fold what the log holds for ``job_id`` beyond its view (another writer's events)."""
        view = self.views.current.get(job_id)
        after = view.last_position if view is not None else 0
        try:
            events = await asyncio.to_thread(self._store.read, job_id=job_id, after=after)
        except StoreUnavailable as exc:
            log.warning("could not refresh %s: %s", job_id, exc, extra=about(job=job_id))
            return
        self.views.refreshed(job_id, events)
