"""A three-node JetStream cluster (``devstack.NatsCluster``) with the streams at R3: a node
killed mid-run, the one leading the events stream, loses and duplicates nothing, and a job's
incident completes while a node is down."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import Iterator

import nats
import nats.js.errors
import pytest

from controlplane.core.statemachine import TERMINAL
from controlplane.core.timeline import timeline
from controlplane.devstack import NatsCluster, NatsServer
from controlplane.errors import ConfigurationError
from controlplane.settings import Settings
from controlplane.store.postgres import PostgresEventStore
from controlplane.synth import SyntheticJob
from schemas.common import JobState
from tests.e2e.test_recovery import run_job
from tests.integration.helpers import (
    assert_sequences_whole,
    publish,
    running_controlplane,
    valid_messages,
    wait_until,
)
from tests.integration.test_ingest import _assert_exactly, _member_events

pytestmark = [pytest.mark.services, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NatsCluster]:
    try:
        nodes = NatsCluster(tmp_path_factory.mktemp("cluster"), 3).start()
    except ConfigurationError as exc:  # an external NATS and no nats-server here
        pytest.skip(str(exc))
    try:
        yield nodes
    finally:
        nodes.stop()


@pytest.fixture
def cluster_settings(cluster: NatsCluster, settings: Settings) -> Settings:
    """The service's test settings on the cluster, its streams replicated on every node."""
    return settings.model_copy(update={"nats_url": cluster.url, "stream_replicas": 3})


async def _stream_leader(settings: Settings, cluster: NatsCluster) -> NatsServer:
    """The node that leads the events stream, once it has a leader and both followers."""
    nc = await nats.connect(servers=cluster.url.split(","))
    try:
        async with asyncio.timeout(30):
            while True:  # (the control plane creates the stream as it starts)
                # Not there yet, or the cluster's JetStream API not answering yet (its meta
                # leader being elected, on a loaded machine): ask again.
                with contextlib.suppress(
                    nats.js.errors.NotFoundError,
                    nats.js.errors.ServiceUnavailableError,
                    nats.errors.TimeoutError,
                ):
                    info = await nc.jetstream().stream_info(settings.stream)
                    if info.cluster is not None and info.cluster.leader is not None:
                        break
                await asyncio.sleep(0.1)
    finally:
        await nc.close()
    assert info.config.num_replicas == 3
    assert len(info.cluster.replicas or []) == 2
    [leader] = [n for n in cluster.nodes if n.cluster and n.cluster.name == info.cluster.leader]
    return leader


async def _drop_streams(settings: Settings) -> None:
    nc = await nats.connect(servers=settings.nats_url.split(","))
    try:
        for stream in (settings.stream, settings.command_stream):
            with contextlib.suppress(nats.js.errors.NotFoundError):
                await nc.jetstream().delete_stream(stream)
    finally:
        await nc.close()


async def test_the_events_stream_leader_killed_loses_and_duplicates_nothing(
    cluster, cluster_settings, pg_store
):
    settings = cluster_settings
    await _drop_streams(settings)
    job = SyntheticJob("job-cluster", members=8, seed=4)
    messages = valid_messages(job, 20_000)
    async with running_controlplane(settings):
        leader = await _stream_leader(settings, cluster)
        publisher = asyncio.create_task(
            publish(settings.nats_url, messages, window=500, ack_timeout_s=2.0)
        )
        await wait_until(lambda: pg_store.last_position() >= 3000, 60, "ingest to get going")
        leader.kill()
        down_at = pg_store.last_position()
        await asyncio.wait_for(publisher, 120)
        await wait_until(lambda: _member_events(pg_store) >= len(messages), 120, "every event")
        await asyncio.sleep(2.5)  # past ack_wait: redeliveries would land now
        # Back, it catches up with what the others took while it was down.
        leader.start()
        cluster.wait_healthy(60, [leader])
    assert down_at < len(messages), "killed too late to mean anything"
    _assert_exactly(pg_store, messages)


async def test_a_jobs_incident_completes_with_a_nats_node_down(
    cluster, cluster_settings, pg_store: PostgresEventStore, tmp_path
):
    """A node of the cluster (the events stream's leader) killed while the job trains, a rank
    killed soon after: its exit report waits in the stream while a new leader is elected, and
    the control plane judges no silence until the stream answers again; the rank is
    replaced and the job completes. Every member's events are in the log once each, in an
    unbroken sequence (a backup's reports unpacked from the catalog the store packed them
    into)."""
    settings = cluster_settings
    await _drop_streams(settings)
    job = f"job-nc-{uuid.uuid4().hex[:6]}"
    async with running_controlplane(settings) as cp:
        leader = await _stream_leader(settings, cluster)
        running = asyncio.create_task(
            run_job(settings, job, tmp_path / "out.pt", ["crash@25:rank=1"])
        )
        await wait_until(
            lambda: (job in cp.views and cp.views[job].last_step >= 10) or running.done(),
            120, "the job to train",
        )  # fmt: skip
        leader.kill()
        code = await running
        # The launcher ends with the job; the log may still be catching up with the stream.
        await wait_until(lambda: cp.views[job].state in TERMINAL, 60, "the log to catch up")
        view = cp.views[job]
        leader.start()
        cluster.wait_healthy(60, [leader])
    assert view.state is JobState.COMPLETED, [(h.to_state, h.reason) for h in view.history]
    assert code == 0
    [incident] = view.incidents.values()
    assert timeline(incident).outcome == "recovered"
    assert_sequences_whole(pg_store, job)
