"""View snapshots in PostgreSQL: the store's contract, and a leader that starts from the one
its predecessor recorded."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime

import pytest

from controlplane import snapshots
from controlplane.api.views import LiveViews, store_reader
from controlplane.store.postgres import PostgresEventStore
from controlplane.synth import SyntheticJob
from tests.integration.helpers import publish, running_controlplane, valid_messages, wait_until

pytestmark = [pytest.mark.services, pytest.mark.usefixtures("clean_stream")]

NOW = datetime(2026, 12, 3, tzinfo=UTC)


def test_the_store_keeps_the_later_snapshot_and_the_rows_a_partial_one_leaves(
    pg_store: PostgresEventStore,
):
    assert pg_store.load_snapshot() is None
    with pytest.raises(ValueError, match="whole"):
        pg_store.save_snapshot(5, "v1", {"a": (5, b"a5")}, taken_at=NOW, whole=False)
    assert pg_store.save_snapshot(9, "v1", {"a": (9, b"a9"), "b": (3, b"\0b3")}, taken_at=NOW,
                                  whole=True)  # fmt: skip
    assert not pg_store.save_snapshot(8, "v1", {"a": (8, b"a8")}, taken_at=NOW, whole=True)
    assert pg_store.save_snapshot(12, "v1", {"a": (12, b"a12")}, taken_at=NOW, whole=False)
    snapshot = pg_store.load_snapshot()
    assert snapshot is not None
    assert (snapshot.position, snapshot.fold_version) == (12, "v1")
    assert snapshot.bodies == {"a": b"a12", "b": b"\0b3"}
    with pytest.raises(ValueError, match="whole"):  # another fold's rows are not kept
        pg_store.save_snapshot(13, "v2", {"a": (13, b"a13")}, taken_at=NOW, whole=False)
    assert pg_store.save_snapshot(13, "v2", {"c": (13, b"c13")}, taken_at=NOW, whole=True)
    snapshot = pg_store.load_snapshot()
    assert snapshot is not None and snapshot.bodies == {"c": b"c13"}


def test_the_steps_chunks_come_in_log_order_and_a_whole_snapshot_drops_them(
    pg_store: PostgresEventStore,
):
    def chunks() -> dict[str, list[bytes]]:
        snapshot = pg_store.load_snapshot(steps=True)
        assert snapshot is not None
        return snapshot.steps

    pg_store.save_snapshot(9, "v1", {"a": (9, b"a9")}, taken_at=NOW, whole=True,
                           steps={"a": b"a-9", "b": b"b-9"})  # fmt: skip
    pg_store.save_snapshot(20, "v1", {}, taken_at=NOW, whole=False, steps={"a": b"a-20"})
    pg_store.save_snapshot(110, "v1", {}, taken_at=NOW, whole=False, steps={"a": b"a-110"})
    assert chunks() == {"a": [b"a-9", b"a-20", b"a-110"], "b": [b"b-9"]}
    snapshot = pg_store.load_snapshot()  # not asked for
    assert snapshot is not None and snapshot.steps == {}
    # A writer that lost the lead writes no chunk.
    assert not pg_store.save_snapshot(50, "v1", {}, taken_at=NOW, whole=False, steps={"a": b"x"})
    pg_store.save_snapshot(120, "v2", {"a": (120, b"a120")}, taken_at=NOW, whole=True,
                           steps={"a": b"all"})  # fmt: skip
    assert chunks() == {"a": [b"all"]}


async def test_a_restarted_leader_starts_from_its_predecessors_snapshot(
    settings, pg_store: PostgresEventStore
):
    settings = settings.model_copy(update={"snapshot_interval_s": 0.2})
    job = SyntheticJob("job-snap", members=8, seed=3)
    first, second = valid_messages(job, 600), valid_messages(job, 300)
    async with running_controlplane(settings) as cp:
        await publish(settings.nats_url, first)
        await wait_until(
            lambda: cp.snapshotter is not None and cp.snapshotter.position is not None
            and cp.snapshotter.position >= 600,
            30, "a snapshot of the first events",
        )  # fmt: skip
        assert cp.loaded is not None and cp.loaded.snapshot is None
    snapshot = pg_store.load_snapshot()
    assert snapshot is not None and set(snapshot.bodies) == {"job-snap"}
    # Events the next leader finds in its stream are after the snapshot: a tail to fold.
    await publish(settings.nats_url, second)
    async with running_controlplane(settings) as cp:
        await wait_until(lambda: _members(pg_store) >= 900, 30, "every event stored")
        await asyncio.sleep(0.3)
        assert cp.loaded is not None
        assert cp.loaded.snapshot == snapshot.position
        assert cp.loaded.tail == cp.loaded.position - snapshot.position
        live = cp.views
    whole = snapshots.load(pg_store, use_snapshot=False)
    assert whole.snapshot is None and whole.tail == pg_store.last_position()
    assert live == whole.views
    assert snapshots.load(pg_store).views == whole.views
    # The API starts from the same snapshot and its steps: the loss curve of the whole log.
    api = LiveViews(store_reader(pg_store), pg_store.last_position,
                    snapshot=lambda: pg_store.load_snapshot(steps=True))  # fmt: skip
    assert api.start_from_snapshot() and api.started_from == pg_store.load_snapshot().position
    api.catch_up(force=True)
    folded = LiveViews(store_reader(pg_store), pg_store.last_position)
    folded.catch_up(force=True)
    assert api.views() == folded.views() == list(whole.views.values())
    points = list(api.jobs["job-snap"].loss_points())
    assert points and points == list(folded.jobs["job-snap"].loss_points())


def _members(store: PostgresEventStore) -> int:
    return len([s for s in store.read() if s.event.source != "controlplane"])
