"""View snapshots: a start-up from one and the log after it folds to the views the whole log
folds to; a snapshot another fold wrote, or that the log cannot hold, is passed over; the
leader's snapshotter records only what moved, and stops when its views stop being the log's."""

from __future__ import annotations

import functools
from datetime import UTC, datetime

import pytest

from controlplane import snapshots
from controlplane.core.fold import fold, fold_jobs
from controlplane.core.records import StoredEvent
from controlplane.core.snapshot import SnapshotUnreadable, decode_view, encode_view, fold_version
from controlplane.store.memory import InMemoryEventStore
from controlplane.store.port import AppendResult
from tests.recorded import two_incidents_scenario
from tests.scenario import Scenario, SoftScenario

NOW = datetime(2026, 12, 3, tzinfo=UTC)


@functools.cache
def recorded():  # type: ignore[no-untyped-def]
    return two_incidents_scenario(SoftScenario, liveness_summary_interval_s=5.0).log


def store_of(log) -> InMemoryEventStore:  # type: ignore[no-untyped-def]
    store = InMemoryEventStore()
    store.import_events(log)
    return store


def test_every_view_of_a_recorded_run_decodes_to_itself():
    """Members, incidents, backups, lineage, discounts: whatever a view holds comes back equal
    (at every event of a run with two incidents and soft liveness)."""
    view = None
    for stored in recorded():
        view = fold(view, [stored])
        assert decode_view(encode_view(view)) == view, stored.position


def test_what_is_not_a_view_is_unreadable():
    for body in (b"", b"not zlib", encode_view(fold(None, recorded()[:3]))[:-4]):
        with pytest.raises(SnapshotUnreadable):
            decode_view(body)


@pytest.mark.parametrize("cut", [1, 17, 200, -1])
def test_a_start_from_a_snapshot_folds_to_the_whole_logs_views(cut):
    log = recorded()
    store = store_of(log)
    position = log[cut].position
    through = fold_jobs({}, log[: log.index(log[cut]) + 1])
    store.save_snapshot(
        position, fold_version(),
        {job: (v.last_position, encode_view(v)) for job, v in through.items()},
        taken_at=NOW, whole=True,
    )  # fmt: skip
    loaded = snapshots.load(store)
    assert loaded.snapshot == position and loaded.passed_over is None
    assert loaded.tail == len(log) - position
    assert loaded.position == log[-1].position
    assert loaded.views == fold_jobs({}, log)


def _saved(store: InMemoryEventStore, position: int, version: str, body: bytes) -> None:
    store.save_snapshot(position, version, {"job-recorded": (position, body)}, taken_at=NOW,
                        whole=True)  # fmt: skip


@pytest.mark.parametrize(
    ("why", "version", "position", "body"),
    [
        ("another fold", "fold-0-000000000000", 10, None),
        ("beyond the log's end", None, 10**6, None),
        ("unreadable", None, 10, b"\x78\x01garbage"),
    ],
)
def test_a_snapshot_that_cannot_be_read_is_passed_over(why, version, position, body):
    log = recorded()
    store = store_of(log)
    head = fold_jobs({}, log[:10])["job-recorded"]
    _saved(store, position, version or fold_version(), body or encode_view(head))
    loaded = snapshots.load(store)
    assert loaded.snapshot is None and loaded.passed_over, why
    assert loaded.tail == len(log)
    assert loaded.views == fold_jobs({}, log)


def test_the_store_keeps_the_later_snapshot_and_a_partial_one_needs_a_whole_one():
    store = InMemoryEventStore()
    with pytest.raises(ValueError, match="whole"):
        store.save_snapshot(5, fold_version(), {}, taken_at=NOW, whole=False)
    assert store.save_snapshot(9, "v", {"a": (9, b"a9")}, taken_at=NOW, whole=True)
    assert not store.save_snapshot(8, "v", {"a": (8, b"a8")}, taken_at=NOW, whole=True)
    assert store.save_snapshot(12, "v", {"b": (12, b"b12")}, taken_at=NOW, whole=False)
    snapshot = store.load_snapshot()
    assert snapshot is not None and snapshot.position == 12
    assert snapshot.bodies == {"a": b"a9", "b": b"b12"}


async def test_the_snapshotter_records_what_moved_and_stops_when_its_views_are_not_the_logs():
    log = recorded()
    half = len(log) // 2
    other = Scenario("job-other", world_size=2, min_world=1)
    other.cluster(racks=1, nodes_per_rack=2)
    other.decide()
    store = InMemoryEventStore()
    store.import_events(log[:half])
    store.import_events(other.log)
    loaded = snapshots.load(store)  # no snapshot yet: the whole log
    snapshotter = snapshots.Snapshotter(store, loaded, interval_s=60.0)
    assert snapshotter.due() and await snapshotter.take(loaded.views)
    assert snapshotter.written == 2 and not snapshotter.due()
    # The leader appends the rest of one job's run and folds it: only that job is written.
    store.import_events(log[half:])
    tail = store.read(after=loaded.position)
    views = fold_jobs(loaded.views, tail)
    snapshotter.applied(AppendResult(stored=tail))
    assert await snapshotter.take(views) and snapshotter.written == 1
    restarted = snapshots.load(store)
    assert restarted.snapshot == store.last_position() and restarted.tail == 0
    assert restarted.views == fold_jobs({}, store.read()) == views
    # Another writer's events: the positions the leader folds no longer follow each other.
    late = StoredEvent(store.last_position() + 2, NOW, log[-1].event)
    snapshotter.applied(AppendResult(stored=[late]))
    assert snapshotter.through is None and not snapshotter.due()
    assert not await snapshotter.take(views)
