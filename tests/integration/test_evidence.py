"""Events are evidence bound to their sender, against a real ``elasticctl serve`` (issue 20).

Real NATS, PostgreSQL and the control plane as a process of its own; simulated members
(``controlplane.bench.members``) publish on their own subjects. Two attacks from inside the
right node: a member forges its neighbour's exit, and a member accuses a healthy peer. Each
is discounted or waits, visibly, and the genuine evidence that follows is acted on.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator

import nats
import pytest
from nats.aio.msg import Msg

from controlplane.api.render import cluster as render_cluster
from controlplane.bench.members import SimMember, SimulatedJob
from controlplane.core.fold import fold
from controlplane.core.view import DiscountReason, JobView, MemberStatus
from controlplane.settings import Settings
from controlplane.store.postgres import PostgresEventStore
from schemas.commands import COMMAND_ADAPTER, Reallocate, Start, Stop
from schemas.subjects import command_wildcard
from tests.integration.helpers import wait_until

pytestmark = pytest.mark.usefixtures("clean_stream")

POLICY = {
    "world_size": 4,
    "min_world": 2,
    "heartbeat_interval_s": 0.5,  # a suspect's silence corroborates after 1.5 s
    "heartbeat_timeout_s": {"init": 10.0, "train": 2.0, "waiting": 5.0, "backup": 5.0,
                            "restore": 5.0},
    "recovery_deadline_s": 30.0,
}  # fmt: skip
WORKERS = ["w00", "w01", "w10", "w11"]
#: w01's neighbour: a member of w01's node (node-0-1), not its launcher.
NEIGHBOUR = "x01"


@pytest.fixture
def serve(settings: Settings) -> Iterator[subprocess.Popen[bytes]]:
    """``elasticctl serve`` as a process of its own."""
    env = {
        **os.environ,
        "ELASTIC_NATS_URL": settings.nats_url,
        "ELASTIC_DATABASE_URL": settings.database_url,
        "ELASTIC_RENDEZVOUS_PORT": "0",
        "ELASTIC_LOG_LEVEL": "WARNING",
    }
    proc = subprocess.Popen([sys.executable, "-m", "controlplane", "serve"], env=env)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(20)
    assert proc.returncode == 0, "serve did not stop cleanly"


@pytest.fixture
async def bus(settings: Settings) -> AsyncIterator[nats.NATS]:
    nc = await nats.connect(settings.nats_url)
    yield nc
    await nc.close()


class Commands:
    def __init__(self) -> None:
        self.received: list[Start | Reallocate | Stop] = []

    async def handler(self, msg: Msg) -> None:
        command = COMMAND_ADAPTER.validate_json(msg.data)
        if all(c.command_id != command.command_id for c in self.received):
            self.received.append(command)

    def of(self, kind: type) -> list:  # type: ignore[type-arg]
        return [c for c in self.received if isinstance(c, kind)]


async def started(bus: nats.NATS, job_id: str) -> tuple[SimulatedJob, Commands]:
    """Four workers (one per node), a spare, and ``x01``: a second spare on w01's node."""
    members = [SimMember(m, f"node-{m[1]}-{m[2]}", f"rack{m[1]}") for m in WORKERS]
    members += [
        SimMember("spare0", "spare-node-0", "rack0", role="spare"),
        SimMember(NEIGHBOUR, "node-0-1", "rack0", role="spare"),
    ]
    job = SimulatedJob(bus.jetstream(), job_id, members)
    commands = Commands()
    await bus.subscribe(command_wildcard(job_id), cb=commands.handler)
    await job.join(job.members, policy=POLICY)
    await wait_until(lambda: bool(commands.of(Start)), 30, "the job to start")
    [start] = commands.of(Start)
    assert start.world == WORKERS
    await job.obey(start)
    return job, commands


@contextlib.asynccontextmanager
async def beating(job: SimulatedJob) -> AsyncIterator[None]:
    """Every member heartbeats every 0.2 s: all of them are healthy."""

    async def beat() -> None:
        while True:
            await job.heartbeat(list(job.members), 5)
            await asyncio.sleep(0.2)

    task = asyncio.create_task(beat())
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def view_of(store: PostgresEventStore, job_id: str) -> JobView:
    """The job as the control plane and the API see it: the fold of its log."""
    return fold(None, store.read(job_id=job_id))


async def test_an_exit_forged_from_the_member_s_own_node_is_discounted(serve, pg_store, bus):
    job_id = "job-forged-exit"
    job, commands = await started(bus, job_id)
    async with beating(job):
        # x01 is a real member of w01's node and publishes on its own subject
        # (elastic.evt.<job>.node-0-1.x01.member.exited): not the launcher.
        await job.send([job.envelope(NEIGHBOUR, "member.exited", {"member": "w01", "signal": 9})])
        await wait_until(
            lambda: view_of(pg_store, job_id).discount_counts.get("exit_not_from_launcher"),
            10,
            "the forged exit to be stored and discounted",
        )
        await asyncio.sleep(2.0)  # a believed exit is decided within tens of ms
        assert commands.of(Reallocate) == []
        view = view_of(pg_store, job_id)
        assert view.members["w01"].status is MemberStatus.ACTIVE
        assert view.world == tuple(WORKERS) and view.incidents == {}
        [discount] = view.discounts
        assert (discount.type, discount.source, discount.reason) == (
            "member.exited",
            f"node-0-1/{NEIGHBOUR}",
            DiscountReason.EXIT_NOT_FROM_LAUNCHER,
        )
        # Visible where an operator looks: the cluster resource of the API.
        served = render_cluster(view)
        assert served.discount_counts == {"exit_not_from_launcher": 1}
        assert served.discounts[0].detail == (
            f"exit of w01 reported by node-0-1/{NEIGHBOUR}: only node-0-1/launcher, the"
            " launcher of its node, reports its exit"
        )

        # The genuine report, from w01's launcher, is believed at once.
        await job.exited("w01")
        await wait_until(lambda: bool(commands.of(Reallocate)), 10, "the replacement")
    [command] = commands.of(Reallocate)
    assert command.world == ["w00", "spare0", "w10", "w11"]


async def test_a_fault_naming_a_healthy_heartbeating_peer_does_not_fence_it(serve, pg_store, bus):
    job_id = "job-accused"
    job, commands = await started(bus, job_id)
    async with beating(job):
        await job.send([job.envelope("w00", "member.fault", {
            "kind": "collective_error", "detail": "Connection reset by peer",
            "suspects": ["w11"]})])  # fmt: skip
        await wait_until(
            lambda: view_of(pg_store, job_id).members["w00"].last_fault is not None,
            10,
            "the report to be stored",
        )
        await asyncio.sleep(3.0)  # twice the silence that would corroborate it
        assert commands.of(Reallocate) == []
        view = view_of(pg_store, job_id)
        assert view.members["w11"].status is MemberStatus.ACTIVE
        assert view.world == tuple(WORKERS) and view.incidents == {}
        # The report is recorded and waits, visibly.
        served = {m.member_id: m for m in render_cluster(view).members}
        assert served["w11"].suspected_by == ["w00"]

        # A second reporter, on another node, corroborates the first.
        await job.send([job.envelope("w10", "member.fault", {
            "kind": "collective_error", "detail": "Connection reset by peer",
            "suspects": ["w11"]})])  # fmt: skip
        await wait_until(lambda: bool(commands.of(Reallocate)), 10, "the corroborated decision")
    [command] = commands.of(Reallocate)
    assert "w11" not in command.world
    [detected] = pg_store.read(job_id=job_id, types=["fault.detected"])
    assert detected.event.payload.members == ["w11"]
    assert "corroborated by 2 reporters on 2 nodes (w00, w10)" in detected.event.payload.detail
