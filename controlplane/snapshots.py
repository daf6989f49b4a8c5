"""The leader's start-up from a view snapshot, and the snapshots it takes as the log grows.

``load`` starts from the snapshot the store holds (``core.snapshot``: every job's view folded
through one log position, written by this release's fold) and folds only the log after it; a
snapshot of another fold, an unreadable one, or one beyond the log's end (a database restored
from an older backup) is passed over, and the whole log folded. ``Snapshotter`` then records
the leader's views every ``snapshot_interval_s`` while the log grew: only the jobs whose views
moved since the last snapshot, in one transaction that also moves the snapshot's position.

A snapshot is whole through a position only when every event up to it is in the views: the
leader folds what it appends, and its appends follow each other in the log unless another
process wrote in between (an import while it runs). The snapshotter follows the positions the
leader folds; when they stop following each other, it takes no snapshot again in this
session (a restart folds that writer's events from the log).

The views a leader holds are the log's fold (the heartbeats it hears stay in its liveness
table, soft state), so a snapshot holds what folding the log gives; a new leader's table
counts every member as heard at its own start.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime

from controlplane.core.fold import fold_jobs, fold_jobs_counting
from controlplane.core.snapshot import SnapshotUnreadable, decode_view, encode_view, fold_version
from controlplane.core.steps import JobSteps, encode_steps
from controlplane.core.view import JobView
from controlplane.errors import StoreUnavailable
from controlplane.store.port import AppendResult, EventStore, ViewSnapshot

log = logging.getLogger(__name__)

#: Events read from the log at a time while folding the tail.
_BATCH = 10_000


@dataclass(slots=True)
class Loaded:
    """What a start-up folded: the views, and how it got them."""

    views: dict[str, JobView]
    #: Every event up to this log position is in ``views``.
    position: int
    #: The snapshot's position it started from (None: it folded the whole log).
    snapshot: int | None = None
    #: Events folded after the snapshot (or from the log's start).
    tail: int = 0
    seconds: float = 0.0
    #: Why a snapshot the store held was passed over (None: there was none, or it was used).
    passed_over: str | None = None
    #: job -> the last position of its view as the snapshot holds it.
    snapshotted: dict[str, int] = field(default_factory=dict)
    #: job -> what the events folded after the snapshot counted (``core.steps``).
    steps: dict[str, JobSteps] = field(default_factory=dict)


def load(store: EventStore, *, use_snapshot: bool = True) -> Loaded:
    """Every job's view: from the store's snapshot when it can be read, plus the log after it."""
    started = time.perf_counter()
    views: dict[str, JobView] = {}
    loaded = Loaded(views, 0)
    snapshot = store.load_snapshot() if use_snapshot else None
    if snapshot is not None:
        views, reason = decoded(snapshot, store.last_position())
        if reason is None:
            loaded = Loaded(
                views, snapshot.position, snapshot=snapshot.position,
                snapshotted={job: v.last_position for job, v in views.items()},
            )  # fmt: skip
        else:
            log.warning("view snapshot passed over (%s): folding the whole log", reason)
            views = {}
            loaded.passed_over = reason
    while True:
        batch = store.read(after=loaded.position, limit=_BATCH)
        if not batch:
            break
        views = fold_jobs_counting(views, batch, loaded.steps)
        loaded.position = batch[-1].position
        loaded.tail += len(batch)
    loaded.views = views
    loaded.seconds = time.perf_counter() - started
    return loaded


def decoded(snapshot: ViewSnapshot, last_position: int) -> tuple[dict[str, JobView], str | None]:
    """The views ``snapshot`` holds, or why a reader of a log ending at ``last_position``
    must pass it over (another fold's, beyond the log's end, unreadable)."""
    if snapshot.fold_version != fold_version():
        return {}, f"written by {snapshot.fold_version}, this release folds {fold_version()}"
    if snapshot.position > last_position:
        return {}, f"at position {snapshot.position}, beyond the log's end ({last_position})"
    try:
        return {job: decode_view(body) for job, body in snapshot.bodies.items()}, None
    except SnapshotUnreadable as exc:
        return {}, str(exc)


class Snapshotter:
    """Records the leader's views in the store as the log grows (see the module docstring)."""

    def __init__(self, store: EventStore, loaded: Loaded, interval_s: float) -> None:
        self._store = store
        self.interval_s = interval_s
        #: Every event up to here is folded into the views (None: no longer known).
        self.through: int | None = loaded.position
        #: The snapshot's position in the store, and each job's view position in it.
        self.position: int | None = loaded.snapshot
        self._saved: dict[str, int] = dict(loaded.snapshotted)
        #: What the events folded since the snapshot counted, per job (recorded with the next).
        self.steps: dict[str, JobSteps] = loaded.steps
        self.taken = 0
        #: Jobs the last snapshot wrote (the others' views had not moved).
        self.written = 0

    def applied(self, result: AppendResult) -> None:
        """The leader folded ``result``: follow its positions."""
        stored = result.stored
        if not stored or self.through is None:
            return
        if stored[0].position != self.through + 1:
            self.lost_track(f"the log went from {self.through} to {stored[0].position}")
            return
        self.through = stored[-1].position

    def lost_track(self, why: str) -> None:
        """The views stopped being the log's through a known position."""
        if self.through is not None:
            log.warning("no more view snapshots this session: %s (another writer?)", why)
        self.through = None

    def fold(self, views: Mapping[str, JobView], result: AppendResult) -> dict[str, JobView]:
        """The leader's fold of what it appended: ``views`` with ``result`` folded in, its
        positions followed and its steps counted toward the next snapshot."""
        self.applied(result)
        if self.through is None:
            return fold_jobs(views, result.stored)
        return fold_jobs_counting(views, result.stored, self.steps)

    def _restore(self, counted: dict[str, JobSteps]) -> None:
        """Put back steps a snapshot did not record, before those counted since."""
        for job, later in self.steps.items():
            known = counted.get(job)
            if known is None:
                counted[job] = later
            else:
                known.extend(later)
        self.steps = counted

    def due(self) -> bool:
        through = self.through
        return through is not None and (self.position is None or through > self.position)

    async def take(self, views: Mapping[str, JobView]) -> bool:
        """Record the views whose jobs moved since the last snapshot; True when recorded."""
        through = self.through
        if through is None:
            return False
        whole = self.position is None
        started = time.perf_counter()
        changed = {
            job: (view.last_position, encode_view(view))
            for job, view in views.items()
            if whole or self._saved.get(job) != view.last_position
        }
        # The steps counted through ``through``; what is folded while this is written counts
        # toward the next snapshot.
        counted, self.steps = self.steps, {}
        chunks = {job: encode_steps(steps) for job, steps in counted.items() if steps.seen}
        encoded = time.perf_counter()
        try:
            saved = await asyncio.to_thread(
                self._store.save_snapshot, through, fold_version(), changed,
                taken_at=datetime.now(UTC), whole=whole, steps=chunks,
            )  # fmt: skip
        except BaseException:
            self._restore(counted)
            raise
        if not saved:
            self.lost_track("the store holds a later snapshot")
            return False
        self.position = through
        self._saved.update((job, at) for job, (at, _) in changed.items())
        self.taken += 1
        self.written = len(changed)
        log.info(
            "view snapshot at position %d: %d of %d job(s), %d bytes; encoded in %.0f ms,"
            " written in %.0f ms", through, len(changed), len(views),
            sum(len(body) for _, body in changed.values()), (encoded - started) * 1e3,
            (time.perf_counter() - encoded) * 1e3,
        )  # fmt: skip
        return True

    async def run(
        self,
        stop: asyncio.Event,
        views: Callable[[], Mapping[str, JobView]],
        settled: Callable[[], bool],
    ) -> None:
        """Take a snapshot every ``interval_s`` the log grew, while no job recovers (the
        encoding holds the loop: it waits for no recovery)."""
        while not stop.is_set() and self.through is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.interval_s)
            while not stop.is_set() and not settled():
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), 1.0)
            if stop.is_set() or not self.due():
                continue
            try:
                await self.take(views())
            except StoreUnavailable as exc:
                log.warning("view snapshot not recorded (%s); at the next interval", exc)
