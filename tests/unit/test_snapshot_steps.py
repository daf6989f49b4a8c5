"""The steps beside the view snapshots (``core.steps``): chunks counted between snapshots make,
in order, the loss curve and the time marks of counting every event; the API starts from them
and serves what a fold of the whole log serves; a snapshot not recorded keeps its steps for
the next one."""

from __future__ import annotations

import asyncio
import functools
import random
import zlib
from datetime import UTC, datetime, timedelta

import pytest

from controlplane import snapshots
from controlplane.api.metrics import LogMetrics
from controlplane.api.views import LiveViews, store_reader
from controlplane.core.fold import fold_jobs, fold_jobs_counting, fold_noting
from controlplane.core.records import StoredEvent
from controlplane.core.steps import (
    JobSteps,
    StepHistory,
    StepsUnreadable,
    decimated,
    encode_steps,
    loss_count,
    loss_points,
    start_after,
)
from controlplane.errors import StoreUnavailable
from controlplane.store.memory import InMemoryEventStore
from controlplane.store.port import AppendResult
from tests.recorded import two_incidents_scenario
from tests.scenario import Scenario

NOW = datetime(2026, 12, 3, tzinfo=UTC)


@functools.cache
def recorded() -> list[StoredEvent]:
    return two_incidents_scenario().log


def counted(events: list[StoredEvent]) -> JobSteps:
    """Every event counted at once, as a fold of the whole log would."""
    _, ignored = fold_noting(None, events)
    steps = JobSteps()
    steps.count(events, ignored)
    return steps


def chunked(events: list[StoredEvent], cuts: list[int]) -> tuple[StepHistory, JobSteps]:
    """The events counted between snapshots at ``cuts`` (indexes), as chunks; the tail after
    the last cut counted on its own."""
    steps: dict[str, JobSteps] = {}
    views: dict = {}  # type: ignore[type-arg]
    chunks: list[bytes] = []
    start = 0
    for cut in [*cuts, len(events)]:
        views = fold_jobs_counting(views, events[start:cut], steps)
        if cut < len(events):
            chunks.append(encode_steps(steps.pop(events[0].event.job_id, JobSteps())))
        start = cut
    return StepHistory.of(chunks), steps.get(events[0].event.job_id, JobSteps())


def test_the_recorded_run_reports_steps_again_after_a_roll_back():
    """What makes the merge of chunks matter: steps reported by two generations."""
    by_step: dict[int, set[int]] = {}
    for s in recorded():
        if s.event.type == "train.step":
            by_step.setdefault(s.event.payload.step, set()).add(s.event.generation)
    assert any(len(generations) > 1 for generations in by_step.values())


@pytest.mark.parametrize("seed", range(12))
def test_chunks_between_any_snapshots_make_the_loss_curve_of_every_event(seed):
    log = recorded()
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(log)), rng.randint(1, 30)))
    history, tail = chunked(log, cuts)
    whole = counted(log)
    assert list(loss_points(history, tail)) == list(loss_points(None, whole))
    assert len(history) + len(tail.losses) >= len(whole.losses)
    # Where a scan for events since a time may start: sound, whichever the marks.
    for since in (log[0].recorded_at, log[len(log) // 2].recorded_at, log[-1].recorded_at,
                  log[-1].recorded_at + timedelta(hours=1)):  # fmt: skip
        start = start_after(history, tail, since)
        assert all(s.recorded_at < since for s in log if s.position <= start)
    assert start_after(history, tail, log[-1].recorded_at) > 0


def test_the_count_of_loss_points_is_what_they_are_whichever_the_chunks():
    log = recorded()
    for cuts in ([], [len(log) // 3], [10, len(log) // 2, len(log) - 5]):
        history, tail = chunked(log, cuts)
        assert loss_count(history, tail) == len(list(loss_points(history, tail)))
    assert loss_count(None, JobSteps()) == 0


def test_a_decimated_curve_keeps_every_run_s_extremes_in_step_order():
    at = datetime(2026, 1, 1, tzinfo=UTC)
    rng = random.Random(5)
    points = [(s, 2.0 - s / 20_000 + rng.random() / 100, at) for s in range(1, 10_001)]
    points[7_345] = (7_346, 9.5, at)  # a one-step spike
    points[2_222] = (2_223, -3.0, at)  # a one-step dip
    for limit in (2, 3, 10, 100, 1_000):
        kept = list(decimated(iter(points), len(points), limit))
        assert len(kept) <= limit
        assert [p[0] for p in kept] == sorted({p[0] for p in kept})  # step order, no repeat
        assert (7_346, 9.5, at) in kept and (2_223, -3.0, at) in kept
    assert list(decimated(iter(points), len(points), len(points))) == points
    flat = [(s, 1.0, at) for s in range(1, 101)]
    assert len(list(decimated(iter(flat), 100, 10))) == 5  # a run of one loss: one point


def test_a_time_out_of_order_across_chunks_gives_no_shortcut():
    log = recorded()
    cut = len(log) // 2
    back = [StoredEvent(s.position, s.recorded_at - timedelta(days=1), s.event) for s in log[cut:]]
    history, tail = chunked(log[:cut] + back, [cut])
    assert history.monotone and tail.monotone
    assert start_after(history, tail, log[-1].recorded_at) == 0


def test_what_is_not_a_chunk_is_unreadable():
    good = encode_steps(counted(recorded()))
    for body in (b"", b"not zlib", good[:-3], zlib.compress(b"stp1" + b"\0" * 40)):
        with pytest.raises(StepsUnreadable):
            StepHistory.of([body])


def _snapshotted_store(cuts: list[int]) -> tuple[InMemoryEventStore, list[StoredEvent]]:
    """Two jobs' runs appended by a leader that recorded a snapshot after each cut."""
    other = Scenario("job-other", world_size=2, min_world=1)
    other.cluster(racks=1, nodes_per_rack=2)
    other.decide()
    store = InMemoryEventStore(clock=lambda: NOW)
    store.import_events(other.log)
    loaded = snapshots.load(store)
    snapshotter = snapshots.Snapshotter(store, loaded, interval_s=60.0)
    views = loaded.views
    assert asyncio.run(snapshotter.take(views))  # whole: the other job's run
    events = [s.event for s in recorded()]
    start = 0
    for cut in [*cuts, len(events)]:
        result = store.append(events[start:cut])
        views = snapshotter.fold(views, result)
        if cut < len(events):
            assert asyncio.run(snapshotter.take(views))
        start = cut
    return store, store.read()


@pytest.mark.parametrize("cuts", [[], [5], [40, 41, 200], [len(two_incidents_scenario().log)]])
def test_the_api_started_from_a_snapshot_serves_what_the_whole_log_folds_to(cuts):
    store, log = _snapshotted_store(cuts)
    whole = LiveViews(store_reader(store), store.last_position)
    whole.catch_up(force=True)
    metrics = LogMetrics(lambda: [])
    started = LiveViews(store_reader(store), store.last_position,
                        snapshot=lambda: store.load_snapshot(steps=True), started=metrics.started,
                        observe=metrics.observe)  # fmt: skip
    assert started.start_from_snapshot()
    assert started.started_from == store.load_snapshot().position
    started.catch_up(force=True)
    assert list(started.jobs) == list(whole.jobs) == ["job-other", "job-recorded"]
    assert started.views() == whole.views()
    for job in whole.jobs:
        assert list(started.jobs[job].loss_points()) == list(whole.jobs[job].loss_points())
    exposition = metrics.exposition().decode()
    assert f"elastic_events_ingested_total {float(len(log))}" in exposition


def test_the_first_catch_up_starts_from_the_snapshot_whoever_asks():
    store, log = _snapshotted_store([50])
    views = LiveViews(store_reader(store), store.last_position,
                      snapshot=lambda: store.load_snapshot(steps=True))  # fmt: skip
    assert views.catch_up(force=True) == log[-1].position  # a request before the warm-up
    assert views.started_from == store.load_snapshot().position
    assert views.views() == list(fold_jobs({}, log).values())
    with pytest.raises(RuntimeError):
        views.start_from_snapshot()


def test_the_api_passes_over_a_snapshot_with_unreadable_steps():
    store, log = _snapshotted_store([50])
    snapshot = store.load_snapshot(steps=True)
    assert snapshot is not None
    broken = snapshot.__class__(snapshot.position, snapshot.fold_version, snapshot.taken_at,
                                snapshot.bodies, {"job-recorded": [b"garbage"]})  # fmt: skip
    views = LiveViews(store_reader(store), store.last_position, snapshot=lambda: broken)
    assert not views.start_from_snapshot() and views.started_from is None
    views.catch_up(force=True)
    assert views.views() == list(fold_jobs({}, log).values())


async def test_a_snapshot_not_recorded_keeps_its_steps_for_the_next():
    log = recorded()
    store = InMemoryEventStore(clock=lambda: NOW)
    snapshotter = snapshots.Snapshotter(store, snapshots.load(store), interval_s=60.0)
    events = [s.event for s in log]
    views = snapshotter.fold({}, store.append(events[:100]))
    failing = store.save_snapshot

    def down(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise StoreUnavailable("the database is away")

    store.save_snapshot = down  # type: ignore[method-assign]
    with pytest.raises(StoreUnavailable):
        await snapshotter.take(views)
    store.save_snapshot = failing  # type: ignore[method-assign]
    views = snapshotter.fold(views, store.append(events[100:]))
    assert await snapshotter.take(views)
    snapshot = store.load_snapshot(steps=True)
    assert snapshot is not None and snapshot.position == store.last_position()
    history = StepHistory.of(snapshot.steps["job-recorded"])
    assert list(loss_points(history, JobSteps())) == list(loss_points(None, counted(store.read())))


def test_the_snapshotter_counts_no_steps_once_it_lost_track():
    log = recorded()
    store = InMemoryEventStore(clock=lambda: NOW)
    snapshotter = snapshots.Snapshotter(store, snapshots.load(store), interval_s=60.0)
    snapshotter.lost_track("a test")
    views = snapshotter.fold({}, AppendResult(stored=log))
    assert views == fold_jobs({}, log) and snapshotter.steps == {}
