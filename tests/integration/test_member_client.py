"""The member's event client against real NATS and the control plane: events land in the log,
heartbeats go on through a slow step and stop with a stopped process, an outage delays events
without blocking the caller, and commands arrive once, even to a member that connects late."""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path

import nats
import pytest
from pydantic import SecretStr

from controlplane.bus import ensure_command_stream, ensure_stream
from controlplane.devstack import NatsServer
from controlplane.settings import Settings
from rank_runtime.client import EventClient
from rank_runtime.identity import Identity, IdentityError
from rank_runtime.launcher import Running, Slot, _follow, _Followed
from schemas.auth import SIGNATURE_HEADER, CommandSigner, command_message, command_public_key
from schemas.commands import Reallocate, Start, Stop
from schemas.common import Phase, ReallocationMode, RestoreFrom, Role
from schemas.subjects import MSG_ID_HEADER
from tests.integration.helpers import running_controlplane, wait_until

pytestmark = pytest.mark.usefixtures("clean_stream")


def identity(job_id: str, nats_url: str, member: str = "m0") -> Identity:
    return Identity(
        job_id=job_id, node="node-a", rack="rack-a", member=member, role=Role.WORKER,
        nats_url=nats_url, host="host-a",
    )  # fmt: skip


def joined() -> dict[str, object]:
    return {"node": "node-a", "rack": "rack-a", "host": "host-a", "pid": os.getpid(),
            "role": "worker", "device": "cpu"}  # fmt: skip


class Beats:
    """The heartbeats of one job as they arrive on their NATS core subjects (received at)."""

    def __init__(self) -> None:
        self.times: list[datetime] = []
        self.messages: list[dict[str, object]] = []

    async def listen(self, url: str, job_id: str) -> nats.NATS:
        nc = await nats.connect(url)

        async def handler(msg: nats.aio.msg.Msg) -> None:
            self.times.append(datetime.now(UTC))
            self.messages.append(json.loads(msg.data))

        await nc.subscribe(f"elastic.hb.{job_id}.>", cb=handler)
        return nc


async def test_events_reach_the_log_and_heartbeats_go_on_through_a_slow_step(settings, pg_store):
    beats = Beats()
    async with running_controlplane(settings) as cp:
        listener = await beats.listen(settings.nats_url, "job-client")
        client = EventClient(identity("job-client", settings.nats_url)).start()
        try:
            client.publish("member.joined", joined())
            client.phase = Phase.TRAIN
            client.start_heartbeats(0.1)
            started = datetime.now(UTC)
            await asyncio.to_thread(time.sleep, 1.5)  # one slow training step
            ended = datetime.now(UTC)
            client.publish("train.step", {"step": 1, "loss": 0.5, "step_seconds": 1.5,
                                          "samples": 8})  # fmt: skip
            await wait_until(
                lambda: len(pg_store.read(job_id="job-client", types=["train.step"])) == 1,
                10,
                "the step to be stored",
            )
            # The control plane heard them (in memory) from the member's current process.
            assert cp.liveness is not None
            heard = cp.liveness.heard("job-client", "m0")
            assert heard is not None and heard.incarnation == client.incarnation
            assert heard.last_at > started
        finally:
            client.close()
            await listener.close()
    during = [t for t in beats.times if started <= t <= ended]
    assert len(during) >= 10, during
    gaps = [(b - a).total_seconds() for a, b in itertools.pairwise(during)]
    assert max(gaps) < 0.5
    assert client.stats.dropped == 0 and client.pending() == 0
    assert beats.messages[0]["source"] == "node-a/m0" and beats.messages[0]["type"] == (
        "member.heartbeat"
    )
    # Heartbeats are soft state: none was stored.
    assert pg_store.read(job_id="job-client", types=["member.heartbeat"]) == []


_MEMBER_SCRIPT = textwrap.dedent(
    """
    import sys, time
    from rank_runtime.client import EventClient
    from rank_runtime.identity import Identity
    from schemas.common import Phase
    client = EventClient(Identity.from_env()).start()
    client.phase = Phase.TRAIN
    client.start_heartbeats(0.1)
    print("ready", flush=True)
    while True:
        time.sleep(1)
    """
)


async def test_heartbeats_stop_while_the_process_is_stopped(settings, pg_store):
    env = {
        **os.environ,
        "ELASTIC_JOB_ID": "job-sigstop",
        "ELASTIC_NODE": "node-a",
        "ELASTIC_RACK": "rack-a",
        "ELASTIC_MEMBER": "m0",
        "ELASTIC_NATS_URL": settings.nats_url,
    }
    beats = Beats()
    listener = await beats.listen(settings.nats_url, "job-sigstop")
    async with running_controlplane(settings):
        proc = subprocess.Popen(
            [sys.executable, "-c", _MEMBER_SCRIPT], env=env, stdout=subprocess.PIPE
        )
        try:
            assert proc.stdout is not None
            assert proc.stdout.readline().strip() == b"ready"
            await wait_until(lambda: len(beats.times) >= 5, 20, "heartbeats")
            proc.send_signal(signal.SIGSTOP)
            stopped = datetime.now(UTC)
            await asyncio.sleep(1.5)
            resumed = datetime.now(UTC)  # before it runs again
            proc.send_signal(signal.SIGCONT)
            await wait_until(
                lambda: any(t > resumed for t in beats.times), 10, "heartbeats after SIGCONT"
            )
        finally:
            proc.kill()
            proc.wait(10)
            if proc.stdout is not None:
                proc.stdout.close()
            await listener.close()
    times = beats.times
    # Nothing was sent while stopped (allowing for one already on its way).
    inside = [t for t in times if (stopped - t).total_seconds() < -0.2 and t < resumed]
    assert inside == [], inside


async def test_an_outage_delays_events_and_never_blocks_the_caller(tmp_path: Path):
    server = NatsServer(tmp_path / "nats")  # not started yet: the member starts first
    client = EventClient(identity("job-outage", server.url)).start()
    try:
        slowest = 0.0
        for step in range(200):
            began = time.perf_counter()
            client.publish("member.heartbeat", {"step": step, "phase": "train"})
            slowest = max(slowest, time.perf_counter() - began)
        assert slowest < 0.05, f"a publish took {slowest:.3f}s while NATS was down"
        assert client.pending() == 200
        server.start()
        nc = await nats.connect(server.url)
        try:
            await ensure_stream(nc.jetstream(), Settings())
            await wait_until(lambda: client.pending() == 0, 20, "the buffer to flush")
            info = await nc.jetstream().stream_info(Settings().stream)
            assert info.state.messages == 200
        finally:
            await nc.close()
    finally:
        client.close()
        server.stop()


async def test_commands_arrive_once_even_to_a_member_that_connects_late(settings):
    job_id = f"job-cmd-{uuid.uuid4().hex[:6]}"
    nc = await nats.connect(settings.nats_url)
    js = nc.jetstream()
    await ensure_command_stream(js, settings)
    stop = Stop(
        command_id=uuid.uuid4(), job_id=job_id, decision_position=7,
        issued_at=datetime.now(UTC), reason="test",
    )  # fmt: skip
    data = stop.model_dump_json().encode()
    subject = f"elastic.cmd.{job_id}.all"
    await js.publish(subject, data, headers={MSG_ID_HEADER: str(stop.command_id)})
    client = EventClient(identity(job_id, settings.nats_url)).start()
    try:
        got = await asyncio.to_thread(client.next_command, 10.0)
        assert got == stop  # the command in force, though sent before the member connected
        await nc.publish(subject, data)  # a re-published copy
        assert await asyncio.to_thread(client.next_command, 1.0) is None
    finally:
        client.close()
        await nc.close()


def test_identity_comes_from_the_launcher_s_environment():
    env = {"ELASTIC_JOB_ID": "j1", "ELASTIC_NODE": "n1", "ELASTIC_RACK": "r1",
           "ELASTIC_MEMBER": "m1", "ELASTIC_ROLE": "spare"}  # fmt: skip
    got = Identity.from_env(env)
    assert (got.source, got.role) == ("n1/m1", Role.SPARE)
    with pytest.raises(IdentityError, match="ELASTIC_RACK, ELASTIC_MEMBER unset"):
        Identity.from_env({"ELASTIC_JOB_ID": "j1", "ELASTIC_NODE": "n1"})
    with pytest.raises(IdentityError, match=r"ELASTIC_NODE='a\.b'"):
        Identity.from_env({**env, "ELASTIC_NODE": "a.b"})
    with pytest.raises(IdentityError, match="worker or spare"):
        Identity.from_env({**env, "ELASTIC_ROLE": "boss"})


def test_an_invalid_event_is_refused_at_the_source():
    client = EventClient(identity("job-x", "nats://127.0.0.1:1"))
    with pytest.raises(ValueError, match=r"invalid member\.heartbeat"):
        client.publish("member.heartbeat", {"step": -1, "phase": "train"})
    assert client.pending() == 0


# --------------------------------------------------------------------------- signed commands

MASTER = bytes(range(100, 132))


def _secured(settings: Settings) -> Settings:
    return settings.model_copy(update={"secret": SecretStr(MASTER.hex())})


def _stop(job_id: str) -> Stop:
    return Stop(command_id=uuid.uuid4(), job_id=job_id, decision_position=1,
                issued_at=datetime.now(UTC), reason="forged")  # fmt: skip


async def test_a_forged_command_is_refused_and_reported_and_a_signed_one_obeyed(settings, pg_store):
    """With the control plane's key configured, a member obeys the Start the real control
    plane signed, and refuses (and reports) an unsigned Stop, one signed with another key, and
    a genuinely signed one moved to its job's subject from another job's."""
    job_id = f"job-sig-{uuid.uuid4().hex[:6]}"
    subject = f"elastic.cmd.{job_id}.all"
    async with running_controlplane(_secured(settings)) as cp:
        client = EventClient(
            identity(job_id, settings.nats_url), command_key=command_public_key(MASTER).hex()
        ).start()
        nc = await nats.connect(settings.nats_url)
        try:
            client.publish("member.joined", {**joined(), "policy": {"world_size": 1}})
            start = await asyncio.to_thread(client.next_command, 20.0)
            assert isinstance(start, Start) and start.world == ["m0"]  # signed by serve: obeyed
            js = nc.jetstream()
            unsigned = _stop(job_id).model_dump_json().encode()
            await js.publish(subject, unsigned)
            wrong = _stop(job_id).model_dump_json().encode()
            forged = CommandSigner(os.urandom(32)).sign(command_message(subject, wrong))
            await js.publish(subject, wrong, headers={SIGNATURE_HEADER: forged})
            elsewhere = "elastic.cmd.job-other.all"
            moved = _stop(job_id).model_dump_json().encode()
            genuine_there = CommandSigner(MASTER).sign(command_message(elsewhere, moved))
            await js.publish(subject, moved, headers={SIGNATURE_HEADER: genuine_there})
            assert await asyncio.to_thread(client.next_command, 2.0) is None
            assert client.stats.refused == 3

            def refusals() -> list[str]:
                return [s.event.payload.reason
                        for s in pg_store.read(job_id=job_id, types=["command.refused"])]  # fmt: skip

            await wait_until(lambda: len(refusals()) == 3, 10, "three refusals in the log")
            assert sorted(refusals()) == sorted(
                ["unsigned", "signature does not verify", "signature does not verify"]
            )
            await wait_until(
                lambda: sum("refused a command" in a for a in cp.views[job_id].anomalies) == 3,
                10, "the refusals in the job's view",
            )  # fmt: skip
            # A genuinely signed command for this job is still obeyed.
            stop = _stop(job_id)
            data = stop.model_dump_json().encode()
            signature = CommandSigner(MASTER).sign(command_message(subject, data))
            await js.publish(subject, data, headers={SIGNATURE_HEADER: signature})
            assert await asyncio.to_thread(client.next_command, 10.0) == stop
        finally:
            client.close()
            await nc.close()


def _reallocate(job_id: str, generation: int, world: list[str]) -> Reallocate:
    return Reallocate(
        command_id=uuid.uuid4(), job_id=job_id, decision_position=generation,
        issued_at=datetime.now(UTC), generation=generation, world=world,
        rendezvous=f"tcp://127.0.0.1:1/{job_id}/{generation}", incident_id=uuid.uuid4(),
        mode=ReallocationMode.SHRINK, restore_step=0, restore_from=RestoreFrom.INITIAL, plan=[],
    )  # fmt: skip


async def test_the_launchers_fencing_obeys_only_signed_current_commands(settings):
    """The launcher's fencing watcher kills a member that a Reallocate leaves out: never for
    an unsigned one, nor for a genuinely signed one of an older generation (a replay)."""
    job_id = f"job-fence-{uuid.uuid4().hex[:6]}"
    subject = f"elastic.cmd.{job_id}.all"
    nc = await nats.connect(settings.nats_url)
    js = nc.jetstream()
    await ensure_command_stream(js, settings)
    signer = CommandSigner(MASTER)

    async def send(command: Reallocate, *, signed: bool) -> None:
        data = command.model_dump_json().encode()
        headers = {SIGNATURE_HEADER: signer.sign(command_message(subject, data))} if signed else {}
        await js.publish(subject, data, headers=headers)

    watcher = EventClient(
        identity(job_id, settings.nats_url, member="launcher-test"),
        command_key=command_public_key(MASTER).hex(),
    ).start()
    members = [
        Running(Slot(name, "node-a", "rack-a", Role.WORKER),
                subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]),
                EventClient(identity(job_id, settings.nats_url, member=name), commands=False))
        for name in ("w0", "w1", "w2")
    ]  # fmt: skip
    followed = _Followed(in_world={"w0", "w1", "w2"})

    async def fence_for(seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            _follow(watcher, members, followed, fence=True)
            await asyncio.sleep(0.05)

    try:
        assert watcher.wait_connected(10)
        await send(_reallocate(job_id, 2, ["w1", "w2"]), signed=False)  # forged: w0 out
        await fence_for(2.0)
        assert members[0].process.poll() is None and watcher.stats.refused == 1
        await send(_reallocate(job_id, 3, ["w0", "w2"]), signed=True)  # genuine: w1 out
        await fence_for(2.0)
        assert members[1].process.wait(5) is not None and members[1].killed_by_launcher
        # A genuine command of generation 2 (older), signed and replayed: w2 stays.
        await send(_reallocate(job_id, 2, ["w0"]), signed=True)
        await fence_for(2.0)
        assert members[0].process.poll() is None and members[2].process.poll() is None
    finally:
        watcher.close(flush_s=0.0)
        for m in members:
            m.process.kill()
            m.process.wait()
        await nc.close()


def test_refusals_are_reported_at_most_ten_a_minute_and_the_rest_counted():
    """A flood of forged commands is not multiplied into a flood of events by every member."""
    from types import SimpleNamespace

    client = EventClient(
        identity("job-flood", "nats://127.0.0.1:1"), command_key=command_public_key(MASTER).hex()
    )
    subject = "elastic.cmd.job-flood.all"
    for _ in range(25):
        data = _stop("job-flood").model_dump_json().encode()
        forged = SimpleNamespace(subject=subject, data=data, headers=None)
        asyncio.run(client._on_command(forged))  # type: ignore[arg-type]
    assert client.stats.refused == 25 and client.next_command() is None
    reports = [json.loads(body)["payload"] for _, _, body in client._buffer]
    assert len(reports) == 10 and all(r["reason"] == "unsigned" for r in reports)
    assert all(uuid.UUID(r["command_id"]) for r in reports)
    # The next report (after the minute) carries the 15 that were not reported.
    client._refusal_times.clear()
    data = _stop("job-flood").model_dump_json().encode()
    asyncio.run(client._on_command(SimpleNamespace(subject=subject, data=data, headers=None)))  # type: ignore[arg-type]
    assert json.loads(client._buffer[-1][2])["payload"]["suppressed"] == 15


def test_the_same_forged_command_read_twice_is_one_refusal():
    """A command is read through its subscription and again as the one in force at a
    (re)connection: a forged one seen both ways is refused and reported once."""
    client = EventClient(
        identity("job-twice", "nats://127.0.0.1:1"), command_key=command_public_key(MASTER).hex()
    )
    subject = "elastic.cmd.job-twice.all"
    data = _stop("job-twice").model_dump_json().encode()
    for _ in range(2):
        client._take_command(subject, data, None)
    assert client.stats.refused == 1 and client.stats.published == 1
    client._take_command(subject, _stop("job-twice").model_dump_json().encode(), None)
    assert client.stats.refused == 2
