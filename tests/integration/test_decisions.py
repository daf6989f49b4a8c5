"""The decider through the real service: NATS, PostgreSQL, the control plane, simulated members.

Recorded before published, commands on ``elastic.cmd.<job>.all``, timeouts acted on when they
expire, owed commands re-published after a restart, one decider with a standby taking over,
and the rendezvous store hosted by the control plane.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from collections import Counter
from collections.abc import AsyncIterator, Callable, Coroutine
from datetime import timedelta
from typing import Any

import nats
import pytest
from nats.aio.msg import Msg

from controlplane.bench.members import SimMember, SimulatedJob
from controlplane.core.fold import fold
from controlplane.core.replay import redecide
from controlplane.core.view import Incident, JobView
from controlplane.settings import Settings
from controlplane.store.postgres import PostgresEventStore
from schemas.commands import COMMAND_ADAPTER, Reallocate, Start, Stop
from schemas.common import JobState, Phase
from schemas.events import FaultDetected
from schemas.rendezvous import parse_endpoint
from schemas.subjects import command_wildcard
from tests.integration.helpers import running_controlplane, wait_until

pytestmark = pytest.mark.usefixtures("clean_stream")

POLICY = {
    "world_size": 4,
    "min_world": 2,
    "backup_interval": 10,
    "redundancy": 2,
    "heartbeat_timeout_s": {"init": 10.0, "train": 1.0, "waiting": 5.0, "backup": 5.0,
                            "restore": 5.0},
    "recovery_deadline_s": 30.0,
}  # fmt: skip
WORKERS = ["w00", "w01", "w10", "w11"]


def cluster(js: nats.js.JetStreamContext, job_id: str, spares: int = 1) -> SimulatedJob:
    members = [SimMember(m, f"node-{m[1]}-{m[2]}", f"rack{m[1]}") for m in WORKERS]
    members += [
        SimMember(f"spare{s}", f"spare-node-{s}", f"rack{s % 2}", role="spare")
        for s in range(spares)
    ]
    return SimulatedJob(js, job_id, members)


class Commands:
    """Every command published for one job, as members receive them."""

    def __init__(self) -> None:
        self.received: list[Start | Reallocate | Stop] = []
        self.copies = 0
        self.arrived = asyncio.Event()

    async def handler(self, msg: Msg) -> None:
        command = COMMAND_ADAPTER.validate_json(msg.data)
        self.copies += 1
        # Members apply a command once: a re-published copy is recognised by its id.
        if all(c.command_id != command.command_id for c in self.received):
            self.received.append(command)
        self.arrived.set()

    def of(self, kind: type) -> list:  # type: ignore[type-arg]
        return [c for c in self.received if isinstance(c, kind)]

    async def next(self, kind: type, count: int = 1, timeout: float = 20) -> list:  # type: ignore[type-arg]
        await wait_until(lambda: len(self.of(kind)) >= count, timeout, f"{count} {kind.__name__}")
        return self.of(kind)


@pytest.fixture
async def bus(settings: Settings) -> AsyncIterator[nats.NATS]:
    nc = await nats.connect(settings.nats_url)
    yield nc
    await nc.close()


async def listen(nc: nats.NATS, job_id: str) -> Commands:
    commands = Commands()
    await nc.subscribe(command_wildcard(job_id), cb=commands.handler)
    return commands


async def start_job(job: SimulatedJob, commands: Commands) -> Start:
    await job.join(job.members, policy=POLICY)
    [start] = await commands.next(Start)
    await job.obey(start)
    return start


async def test_crash_is_recorded_then_published_and_the_job_recovers(settings, pg_store, bus):
    async with running_controlplane(settings) as cp:
        job = cluster(bus.jetstream(), "job-crash")
        commands = await listen(bus, "job-crash")
        start = await start_job(job, commands)
        assert start.world == WORKERS and start.generation == 1
        assert len(start.placement) == 4 and start.rendezvous.endswith("/job-crash/1")
        await job.step(WORKERS, 10)
        await job.backup(start.world, start.placement, 10)
        await wait_until(
            lambda: cp.views["job-crash"].last_complete_backup == 10, 10, "backup 10 complete"
        )

        await job.exited("w01")
        [command] = await commands.next(Reallocate)
        assert command.world == ["w00", "spare0", "w10", "w11"]
        assert command.restore_step == 10 and command.generation == 2
        # Recorded before published: the command names the decision's position in the log.
        [decision] = pg_store.read(job_id="job-crash", after=command.decision_position - 1, limit=1)
        assert decision.event.type == "reallocation.issued"
        assert str(decision.event.payload.command_id) == str(command.command_id)
        detected = pg_store.read(job_id="job-crash", types=["fault.detected"])
        assert [d.event.payload.reason for d in detected] == ["exited"]
        assert detected[0].position < decision.position

        await job.obey(command)
        await wait_until(
            lambda: (
                cp.views["job-crash"].state is JobState.RUNNING
                and cp.views["job-crash"].open_incident is None
            ),
            10,
            "the incident to be resolved",
        )
        [resolved] = pg_store.read(job_id="job-crash", types=["incident.resolved"])
        assert resolved.event.payload.steps_lost == 0
        assert set(resolved.event.payload.phases) == {"detect", "decide", "ack", "restore",
                                                       "resume"}  # fmt: skip
        # The live view is the fold of the log.
        assert cp.views["job-crash"] == fold(None, pg_store.read(job_id="job-crash"))


async def silence_found(
    store: PostgresEventStore,
    job_id: str,
    commands: Commands,
    alive: list[str],
    beating: Coroutine[Any, Any, None],
) -> tuple[FaultDetected, float]:
    """While ``alive`` beat (``beating``), w11 is silent: the world shrinks to ``alive``. The
    detection, and how long after w11's last heartbeat it was recorded."""
    task = asyncio.create_task(beating)
    try:
        [command] = await commands.next(Reallocate, timeout=10)
    finally:
        task.cancel()
    assert command.mode == "shrink" and command.world == alive
    [detected] = store.read(job_id=job_id, types=["fault.detected"])
    payload = detected.event.payload
    assert isinstance(payload, FaultDetected)
    assert payload.reason == "heartbeat_timeout" and payload.members == ["w11"]
    return payload, (detected.recorded_at - payload.evidence[0].at).total_seconds()


async def test_a_hang_is_decided_when_its_heartbeat_timeout_expires(settings, pg_store, bus):
    async with running_controlplane(settings) as cp:
        job = cluster(bus.jetstream(), "job-hang", spares=0)
        commands = await listen(bus, "job-hang")
        await start_job(job, commands)
        alive = ["w00", "w01", "w10"]

        async def beat() -> None:
            for _ in range(40):
                await job.heartbeat(alive, 5)
                await asyncio.sleep(0.2)

        payload, late = await silence_found(pg_store, "job-hang", commands, alive, beat())
        assert [(t.mode, t.seconds) for t in payload.thresholds or ()] == [("fixed", 1.0)]
        # Decided within a fraction of a second of the 1 s timeout expiring.
        assert 1.0 < late < 1.5, late
        assert cp.views["job-hang"].state is JobState.RECOVERING


async def test_a_restarted_control_plane_republishes_what_no_member_acked(settings, pg_store, bus):
    job = cluster(bus.jetstream(), "job-restart")
    commands = await listen(bus, "job-restart")
    async with running_controlplane(settings):
        await start_job(job, commands)
        await job.exited("w10")
        [first] = await commands.next(Reallocate)
    decisions_before = len(pg_store.read(job_id="job-restart", types=["reallocation.issued"]))

    copies = commands.copies
    async with running_controlplane(settings) as cp:
        await wait_until(lambda: commands.copies > copies, 20, "the owed command again")
        assert commands.of(Reallocate) == [first]  # the same command, not a new decision
        await job.obey(first)
        await wait_until(
            lambda: cp.views["job-restart"].open_incident is None, 10, "the incident to resolve"
        )
    # Nothing was decided twice.
    assert len(pg_store.read(job_id="job-restart", types=["reallocation.issued"])) == (
        decisions_before
    )


async def test_the_rendezvous_store_lives_in_the_control_plane(settings, bus):
    from rank_runtime.rendezvous import RendezvousStore

    async with running_controlplane(settings) as cp:
        job = cluster(bus.jetstream(), "job-rdzv")
        commands = await listen(bus, "job-rdzv")
        start = await start_job(job, commands)
        assert cp.rendezvous is not None and cp.rendezvous.base is not None
        assert start.rendezvous == f"{cp.rendezvous.base}/job-rdzv/1"
        assert parse_endpoint(start.rendezvous).prefix == "job-rdzv/1"

        def meet() -> bytes:
            # No ELASTIC_SECRET in these settings: the store runs unauthenticated.
            store = RendezvousStore.connect(start.rendezvous, None, timeout=timedelta(seconds=5))
            store.set("rank0", "here")
            got = store.get("rank0")
            store.close()
            return got

        assert await asyncio.to_thread(meet) == b"here"


def _serve(settings: Settings) -> subprocess.Popen[bytes]:
    env = {
        **os.environ,
        "ELASTIC_NATS_URL": settings.nats_url,
        "ELASTIC_DATABASE_URL": settings.database_url,
        "ELASTIC_RENDEZVOUS_PORT": "0",
        "ELASTIC_LOCK_RETRY_S": "0.5",
        "ELASTIC_COMMAND_RETRY_S": "0.5",
        "ELASTIC_LOG_LEVEL": "WARNING",
    }
    return subprocess.Popen([sys.executable, "-m", "controlplane", "serve"], env=env)


async def test_two_deciders_one_leader_and_a_standby_that_takes_over(
    settings, pg_store: PostgresEventStore, bus
):
    first, second = _serve(settings), None
    try:
        job = cluster(bus.jetstream(), "job-ha2", spares=2)
        commands = await listen(bus, "job-ha2")
        await job.join(job.members, policy=POLICY)
        [start] = await commands.next(Start, timeout=30)
        second = _serve(settings)
        await job.obey(start)
        await job.exited("w00")
        [one] = await commands.next(Reallocate)
        await job.obey(one)
        await wait_until(
            lambda: len(pg_store.read(job_id="job-ha2", types=["incident.resolved"])) == 1,
            10,
            "the first incident to resolve",
        )

        first.send_signal(signal.SIGKILL)
        first.wait(10)
        killed = asyncio.get_running_loop().time()
        await job.exited("w11")
        [_, two] = await commands.next(Reallocate, count=2, timeout=30)
        took = asyncio.get_running_loop().time() - killed
        assert took < 10, f"the standby took {took:.1f}s to decide"
        assert two.generation == 3 and "w11" not in two.world
    finally:
        for proc in (first, second):
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                proc.wait(20)
    # No split brain: one decision per generation, and positions without gaps.
    log = pg_store.read(job_id="job-ha2")
    generations = Counter(
        s.event.payload.generation for s in log if s.event.type == "generation.started"
    )
    assert generations == {1: 1, 2: 1, 3: 1}
    sources = {s.event.incarnation for s in log if s.event.source == "controlplane"}
    assert len(sources) == 2, "two deciders, one after the other"


async def test_re_deciding_the_recorded_log_reproduces_the_decisions(settings, pg_store, bus):
    """Record a crash, its recovery, a hang and a cascade through the real service; then
    re-run the decider over the log (member events in, times from the log): every recorded
    decision comes out again, ids included."""
    async with running_controlplane(settings) as cp:
        job = cluster(bus.jetstream(), "job-replay", spares=1)
        commands = await listen(bus, "job-replay")
        start = await start_job(job, commands)
        await job.step(WORKERS, 10)
        await job.backup(start.world, start.placement, 10)
        await wait_until(lambda: cp.views["job-replay"].last_complete_backup == 10, 10, "backup 10")
        await job.exited("w01")
        [first] = await commands.next(Reallocate)
        await job.obey(first)
        await wait_until(
            lambda: cp.views["job-replay"].open_incident is None, 10, "the first recovery"
        )
        alive = ["w00", "spare0", "w10"]  # w11 hangs
        beating = asyncio.create_task(_beat(job, alive))
        try:
            [_, second] = await commands.next(Reallocate, count=2, timeout=10)
            await job.exited("w10")  # while recovering: a cascade
            await wait_until(
                lambda: len(_last_incident(cp.views["job-replay"]).detections) == 2,
                10,
                "the cascade to be decided",
            )
        finally:
            beating.cancel()
        assert second.mode == "shrink"
    log = pg_store.read(job_id="job-replay")
    batches = redecide(log)
    assert len(batches) >= 4
    for batch in batches:
        assert batch.matches, [s.event.type for s in batch.recorded]
    reasons = [s.event.payload.reason for s in log if s.event.type == "fault.detected"]
    assert reasons == ["exited", "heartbeat_timeout", "exited"]


def _last_incident(view: JobView) -> Incident:
    return list(view.incidents.values())[-1]


async def _beat(job: SimulatedJob, members: list[str]) -> None:
    while True:
        await job.heartbeat(members, 11)
        await asyncio.sleep(0.2)


async def test_one_control_plane_decides_for_many_jobs(settings, pg_store, bus):
    async with running_controlplane(settings) as cp:
        jobs = {name: cluster(bus.jetstream(), name) for name in ("job-many-a", "job-many-b")}
        listening = {name: await listen(bus, name) for name in jobs}
        starts = {name: await start_job(jobs[name], listening[name]) for name in jobs}
        assert all(s.generation == 1 for s in starts.values())
        await jobs["job-many-a"].exited("w10")
        [command] = await listening["job-many-a"].next(Reallocate)
        assert command.job_id == "job-many-a" and "w10" not in command.world
        await asyncio.sleep(0.5)
        assert listening["job-many-b"].of(Reallocate) == []
        assert cp.views["job-many-a"].state is JobState.RECOVERING
        assert cp.views["job-many-b"].state is JobState.RUNNING
        for name in jobs:
            assert cp.views[name] == fold(None, pg_store.read(job_id=name))


async def test_a_hang_is_decided_at_the_timeout_derived_from_the_observed_gaps(
    settings, pg_store, bus
):
    """``heartbeat_timeout_mode=auto`` through the real service: the liveness summaries
    record the members' heartbeat gaps, the fold derives the train timeout from them (far
    below the fixed 10 s), and the silent member is found at that derived timeout, the
    detection naming it and how it was derived."""
    policy = {
        **POLICY,
        "heartbeat_timeout_s": {**POLICY["heartbeat_timeout_s"], "train": 10.0},
        "heartbeat_timeout_mode": "auto",
        # 5 x the 0.2 s gaps: a busy machine may stretch a healthy member's gap to 0.6 s.
        "heartbeat_timeout_k": 5.0,
        "heartbeat_timeout_min_gaps": 8,
        "heartbeat_timeout_floor_s": 0.5,
        "liveness_summary_interval_s": 0.5,
    }
    async with running_controlplane(settings) as cp:
        job = cluster(bus.jetstream(), "job-auto", spares=0)
        commands = await listen(bus, "job-auto")
        await job.join(job.members, policy=policy)
        [start] = await commands.next(Start)
        await job.obey(start)
        alive = ["w00", "w01", "w10"]

        def derived() -> bool:
            threshold = cp.views["job-auto"].thresholds.get(Phase.TRAIN)
            return threshold is not None and threshold.mode == "auto"

        async def beat(members: list[str], until: Callable[[], bool] | None, beats: int) -> None:
            for _ in range(beats):
                if until is not None and until():
                    return
                await job.beat(bus, members, 5)  # on NATS core, as members do
                await asyncio.sleep(0.2)

        # Every member beats until the summaries hold enough gaps for a derived timeout.
        await beat(WORKERS, derived, 100)
        assert derived(), "no timeout derived from the gaps within 20 s"
        payload, late = await silence_found(
            pg_store, "job-auto", commands, alive, beat(alive, None, 100)
        )
    [threshold] = payload.thresholds
    assert threshold.mode == "auto" and threshold.phase is Phase.TRAIN
    assert threshold.gaps >= 8 and threshold.k == 5.0 and threshold.gap_s is not None
    # k x the gap quantile, clamped: the members beat every 0.2 s (a busy machine stretches
    # a gap, never shortens it).
    assert threshold.seconds == max(0.5, min(300.0, 5.0 * threshold.gap_s))
    assert 0.15 <= threshold.gap_s < 3.0, threshold
    assert threshold.how.startswith(f"timeout {threshold.seconds:g}s = 5 x p99 gap"), threshold.how
    print(f"found {late:.2f} s after its last heartbeat: {threshold.how}")
    # Found once the derived timeout passed, long before the fixed 10 s would have.
    assert threshold.seconds <= late < 10.0, (late, threshold)
