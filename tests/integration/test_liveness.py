"""Liveness as soft state through the real service (NATS core heartbeats, PostgreSQL, the
control plane): a hang is decided one timeout after the last heartbeat, with the evidence in
the log and no heartbeat stored; re-deciding from the log reproduces every decision; a bad
heartbeat is refused without stopping anything; a restarted control plane is whole within
one timeout."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from datetime import UTC, datetime

import nats
import pytest

from controlplane.bench.members import SimMember, SimulatedJob
from controlplane.core.fold import fold
from controlplane.core.replay import redecide
from controlplane.settings import Settings
from schemas.commands import Reallocate, Start
from tests.integration.helpers import running_controlplane, wait_until
from tests.integration.test_decisions import Commands, listen

pytestmark = pytest.mark.usefixtures("clean_stream")

POLICY = {
    "world_size": 4,
    "min_world": 2,
    "heartbeat_interval_s": 0.25,
    "liveness_summary_interval_s": 2.0,
    "heartbeat_timeout_s": {"init": 10.0, "train": 1.0, "waiting": 5.0, "backup": 5.0,
                            "restore": 5.0},
    "recovery_deadline_s": 30.0,
}  # fmt: skip
WORKERS = ["w0", "w1", "w2", "w3"]


@pytest.fixture
async def bus(settings: Settings) -> AsyncIterator[nats.NATS]:
    nc = await nats.connect(settings.nats_url)
    yield nc
    await nc.close()


def cluster(js: nats.js.JetStreamContext, job_id: str) -> SimulatedJob:
    return SimulatedJob(js, job_id, [SimMember(m, f"node-{m}", "rack0") for m in WORKERS])


class Beating:
    """Members heartbeating on NATS core every ``interval_s`` until told to stop (each)."""

    def __init__(self, nc: nats.NATS, job: SimulatedJob, interval_s: float = 0.25) -> None:
        self.nc, self.job, self.interval_s = nc, job, interval_s
        self.alive = set(job.members)
        self.last: dict[str, datetime] = {}
        self._task: asyncio.Task[None] | None = None

    async def _run(self) -> None:
        while True:
            for name in sorted(self.alive):
                await self.job.beat(self.nc, [name], 5)
                self.last[name] = datetime.now(UTC)
            await asyncio.sleep(self.interval_s)

    def __enter__(self) -> Beating:
        self._task = asyncio.create_task(self._run())
        return self

    def __exit__(self, *_: object) -> None:
        assert self._task is not None
        self._task.cancel()


async def start(job: SimulatedJob, commands: Commands) -> Start:
    await job.join(job.members, policy=POLICY)
    [command] = await commands.next(Start)
    await job.obey(command)
    return command


async def test_a_hang_is_decided_from_soft_heartbeats_and_replays_exactly(settings, pg_store, bus):
    async with running_controlplane(settings):
        job = cluster(bus.jetstream(), "job-soft")
        commands = await listen(bus, "job-soft")
        with Beating(bus, job) as beating:
            await start(job, commands)
            await asyncio.sleep(2.5)  # at least one interval summary
            beating.alive.discard("w3")  # hung: its heartbeats stop
            [command] = await commands.next(Reallocate, timeout=10)
        assert command.mode == "shrink" and command.world == ["w0", "w1", "w2"]
        log = pg_store.read(job_id="job-soft")
    # Soft state: no heartbeat was stored (but the four the simulator sends durably as its
    # answer to the start, SimulatedJob.obey: an old member's kind).
    assert len([s for s in log if s.event.type == "member.heartbeat"]) == len(WORKERS)
    [detected] = [s for s in log if s.event.type == "fault.detected"]
    payload = detected.event.payload
    assert payload.reason == "heartbeat_timeout" and payload.members == ["w3"]
    [evidence] = payload.evidence
    # The evidence is in the log before the decision: the summary recorded just before it.
    assert evidence.what == "liveness.summary" and evidence.position < detected.position
    summary = next(s for s in log if s.position == evidence.position)
    assert summary.event.payload.reason == "decision"
    entry = next(e for e in summary.event.payload.rows() if e.member == "w3")
    assert entry.last_at == evidence.at
    # The last heartbeat the control plane heard is the one the member sent last.
    assert abs((evidence.at - beating.last["w3"]).total_seconds()) < 0.1
    late = (detected.recorded_at - evidence.at).total_seconds()
    assert 1.0 < late < 1.5, late  # one timeout (1 s) after its last heartbeat
    assert "timeout 1s" in payload.detail
    # Interval summaries too: the log knows every member's liveness at that resolution.
    reasons = [s.event.payload.reason for s in log if s.event.type == "liveness.summary"]
    assert "interval" in reasons and reasons[-1] == "decision"
    # Re-deciding from the log reproduces every recorded decision.
    redecided = redecide(log)
    assert redecided and all(r.matches for r in redecided)
    view = fold(None, log)
    assert view.heartbeats["w3"].at == evidence.at


async def test_bad_heartbeats_are_refused_and_the_rest_go_on(settings, pg_store, bus):
    async with running_controlplane(settings) as cp:
        job = cluster(bus.jetstream(), "job-badbeat")
        commands = await listen(bus, "job-badbeat")
        with Beating(bus, job):
            await start(job, commands)
            good = job.beat_message("w0", 5)
            body = json.loads(good.data)
            w0 = job.members["w0"]

            def relayed(node: str, member: str) -> bytes:
                return json.dumps({"job_id": "job-badbeat", "type": "node.heartbeat", "v": 1,
                                   "source": f"{node}/launcher", "emitted_at": body["emitted_at"],
                                   "members": [member], "incarnation": [w0.incarnation],
                                   "generation": [0], "age_ms": [0], "step": [5],
                                   "phase": ["waiting"], "step_ms": [0]}).encode()  # fmt: skip

            bad = [
                (good.subject, b"\xff not json"),
                (good.subject, json.dumps({**body, "source": "node-w1/w1"}).encode()),
                (good.subject, json.dumps({**body, "job_id": "job-other"}).encode()),
                (good.subject, json.dumps({**body, "incarnation": "old0"}).encode()),
                (good.subject, json.dumps({**body, "payload": {"step": -1}}).encode()),
                ("elastic.hb.job-badbeat.node-w0.launcher", good.data),
                # A launcher speaks for its own node's members only, and never for a launcher.
                ("elastic.hb.job-badbeat.node-w1.launcher", relayed("node-w1", "w0")),
                ("elastic.hb.job-badbeat.node-w0.launcher", relayed("node-w0", "launcher")),
                ("elastic.hb.job-badbeat.node-w1.member", good.data),  # another node's member
                (good.subject, b"x" * 70_000),
            ]
            for subject, data in bad:
                await bus.publish(subject, data)
            await bus.flush()
            assert cp.heartbeats is not None
            await wait_until(
                lambda: sum(cp.heartbeats.stats.refused.values()) >= len(bad), 10, "refusals"
            )
            accepted = cp.heartbeats.stats.accepted
            await wait_until(
                lambda: cp.heartbeats.stats.accepted > accepted + 8, 10, "good heartbeats"
            )
            refused = cp.heartbeats.stats.refused
            assert {"not JSON", "forged source", "job mismatch", "stale_incarnation",
                    "forged node", "forged", "oversized"} <= set(refused), refused  # fmt: skip
            assert cp.liveness is not None
            heard = cp.liveness.heard("job-badbeat", "w0")
            assert heard is not None and heard.incarnation == job.members["w0"].incarnation
            # Nothing was decided: every member is heard.
            await asyncio.sleep(1.5)
        assert pg_store.read(job_id="job-badbeat", types=["fault.detected"]) == []


async def test_a_restarted_control_plane_is_whole_within_one_timeout(settings, pg_store, bus):
    job = cluster(bus.jetstream(), "job-restart-soft")
    commands = await listen(bus, "job-restart-soft")
    with Beating(bus, job) as beating:
        async with running_controlplane(settings):
            await start(job, commands)
            await asyncio.sleep(1.0)
        beating.alive.discard("w2")  # hangs while no control plane runs
        await asyncio.sleep(2.0)
        async with running_controlplane(settings) as cp:
            assert cp.liveness is not None
            started = cp.liveness.started_at
            [command] = await commands.next(Reallocate, timeout=10)
            assert command.world == ["w0", "w1", "w3"]
        log = pg_store.read(job_id="job-restart-soft")
    [detected] = [s for s in log if s.event.type == "fault.detected"]
    assert detected.event.payload.members == ["w2"]  # the others were heard in time
    [evidence] = detected.event.payload.evidence
    # Its last heartbeat is not known to the new table: it counted as heard at the start.
    assert evidence.at == started
    late = (detected.recorded_at - started).total_seconds()
    assert 1.0 < late < 1.5, late
    assert all(r.matches for r in redecide(log))
