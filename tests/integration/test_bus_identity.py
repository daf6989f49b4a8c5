"""Identity on the bus: per-node NKey credentials (``elasticctl creds``) against a real
nats-server that loads the user list they come with.

A node's credentials publish only as that node of that job (its members never as its
launcher), read only that job's commands, and receive only on an inbox of their own: no
events, no ``_INBOX.>``, nothing of another job. The control plane's credential does what
``elasticctl serve`` does. Every refusal here is the server's (a permissions violation).
"""

from __future__ import annotations

import asyncio
import json
import os
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import nats
import nats.errors
import pytest
from nats.aio.client import Client

from controlplane import bus, creds
from controlplane.devstack import NatsServer
from controlplane.settings import Settings
from rank_runtime import launcher
from rank_runtime.client import EventClient
from rank_runtime.identity import NATS_CREDS_ENV, NATS_PASSWORD_ENV, NATS_USER_ENV, Identity
from schemas.auth import COMMAND_KEY_ENV, JOB_SECRET_ENV, command_public_key, job_secret
from schemas.commands import Stop
from schemas.common import Role
from schemas.creds import CREDS_DIR_ENV, nkey_connect_options
from schemas.subjects import MSG_ID_HEADER, command_subject, event_subject, heartbeat_subject

pytestmark = [pytest.mark.services, pytest.mark.timeout(90)]

JOB_A = "job-a"
JOB_B = "job-b"
SETTINGS = Settings()
ROOT = Path(__file__).resolve().parents[2]
EVENTS = SETTINGS.stream
COMMANDS = SETTINGS.command_stream


@dataclass
class Secured:
    url: str
    creds: Path
    master: bytes

    def seed(self, job: str, node: str, kind: str) -> Path:
        return self.creds / job / node / f"{kind}.nk"

    @property
    def controlplane(self) -> Path:
        return self.creds / creds.CONTROLPLANE_FILE


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Secured]:
    """A nats-server whose only users are the ones ``elasticctl creds`` issued: job A on
    nodes n0 and n1, job B on node m0, and the control plane."""
    root = tmp_path_factory.mktemp("bus-identity")
    master = os.urandom(32)
    creds.issue(master, root / "creds", JOB_A, ["n0", "n1"])
    creds.issue(master, root / "creds", JOB_B, ["m0"])
    config = root / "nats.conf"
    config.write_text(f'authorization {{\n  include "creds/{creds.USERS_FILE}"\n}}\n')
    server = NatsServer(root / "nats", config=config).start()
    try:
        yield Secured(server.url, root / "creds", master)
    finally:
        server.stop()


class Conn:
    """A raw connection under one credential, with the server's asynchronous errors."""

    def __init__(self) -> None:
        self.errors: list[str] = []
        self.nc: Client | None = None

    async def open(self, url: str, path: Path) -> Conn:
        async def error(exc: Exception) -> None:
            self.errors.append(str(exc))

        options = nkey_connect_options(path)
        assert options is not None
        self.nc = await nats.connect(url, error_cb=error, **options)
        return self

    @property
    def client(self) -> Client:
        assert self.nc is not None
        return self.nc

    async def violation(self, what: str, subject: str, timeout: float = 5.0) -> None:
        """Wait for the server's permissions violation naming ``subject``."""
        deadline = time.monotonic() + timeout
        needle = f'permissions violation for {what} to "{subject.lower()}"'
        while not any(needle in e.lower() for e in self.errors):
            assert time.monotonic() < deadline, f"no {what} violation for {subject}: {self.errors}"
            await asyncio.sleep(0.02)


@pytest.fixture
async def connect(secured: Secured) -> AsyncIterator[Any]:
    opened: list[Conn] = []

    async def open_(path: Path) -> Conn:
        conn = await Conn().open(secured.url, path)
        opened.append(conn)
        return conn

    yield open_
    for conn in opened:
        if conn.nc is not None:
            await conn.nc.close()


@pytest.fixture
async def controlplane(connect: Any, secured: Secured) -> Conn:
    cp: Conn = await connect(secured.controlplane)
    js = cp.client.jetstream()
    await bus.ensure_stream(js, SETTINGS)
    await bus.ensure_command_stream(js, SETTINGS)
    return cp


async def stored(cp: Conn, subject: str | None = None) -> int:
    """Messages of the events stream (on ``subject``, when given)."""
    js = cp.client.jetstream()
    if subject is None:
        return int((await js.stream_info(EVENTS)).state.messages)
    info = await js.stream_info(EVENTS, subjects_filter=subject)
    return int((info.state.subjects or {}).get(subject, 0))


def exited(node: str, member: str) -> bytes:
    """A well-formed ``member.exited`` envelope from ``node``'s launcher about ``member``."""
    return json.dumps(
        {
            "event_id": str(uuid.uuid4()),
            "job_id": JOB_A,
            "type": "member.exited",
            "v": 1,
            "source": f"{node}/launcher",
            "seq": 1,
            "generation": 1,
            "emitted_at": datetime.now(UTC).isoformat(),
            "payload": {"member": member, "signal": 9},
        }
    ).encode()


async def refused_publish(conn: Conn, subject: str, data: bytes = b"{}") -> None:
    js = conn.client.jetstream()
    with pytest.raises((nats.errors.TimeoutError, nats.errors.NoRespondersError)):
        await js.publish(subject, data, timeout=1)
    await conn.violation("publish", subject)


# --------------------------------------------------------------------------- publishing


async def test_another_nodes_forged_member_exited_is_refused_by_nats(
    secured: Secured, controlplane: Conn, connect: Any
) -> None:
    """Node n0's credentials (its launcher's, its members') cannot report an exit of a member
    of node n1, nor of any node of another job: the server refuses, the stream gets nothing."""
    before = await stored(controlplane)
    for kind in creds.KINDS:
        attacker: Conn = await connect(secured.seed(JOB_A, "n0", kind))
        for subject in (
            event_subject(JOB_A, "n1", "launcher", "member.exited"),
            event_subject(JOB_A, "n1", "w1", "member.exited"),
            event_subject(JOB_B, "m0", "launcher", "member.exited"),
            # its own node, but as another job
            event_subject(JOB_B, "n0", "launcher", "member.exited"),
        ):
            await refused_publish(attacker, subject, exited("n1", "w1"))
    assert await stored(controlplane) == before, "a forged event reached the stream"
    # Node n1's launcher reports its own member's exit.
    honest: Conn = await connect(secured.seed(JOB_A, "n1", creds.LAUNCHER))
    subject = event_subject(JOB_A, "n1", "launcher", "member.exited")
    ack = await honest.client.jetstream().publish(subject, exited("n1", "w1"), timeout=5)
    assert ack.stream == EVENTS
    assert await stored(controlplane, subject) == 1
    assert not honest.errors


async def test_a_member_cannot_publish_as_its_launcher(
    secured: Secured, controlplane: Conn, connect: Any
) -> None:
    member: Conn = await connect(secured.seed(JOB_A, "n0", creds.MEMBER))
    forged = event_subject(JOB_A, "n0", "launcher", "member.exited")
    await refused_publish(member, forged, exited("n0", "w2"))
    assert await stored(controlplane, forged) == 0
    # What members publish, as themselves, goes through.
    own = event_subject(JOB_A, "n0", "w0", "member.heartbeat")
    ack = await member.client.jetstream().publish(own, b"{}", timeout=5)
    assert ack.stream == EVENTS


async def _publish_raw_as(url: str, seed: bytes, frames: list[tuple[bytes, bytes]]) -> list[str]:
    """Publish ``frames`` (subject, data: any bytes in the subject) over the raw NATS protocol
    under an NKey seed; the server's errors, read until the PONG after them."""
    import base64

    import nkeys

    host, port = url.removeprefix("nats://").rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        info = json.loads((await reader.readline()).split(b" ", 1)[1])
        kp = nkeys.from_seed(seed)
        sig = base64.urlsafe_b64encode(kp.sign(info["nonce"].encode())).rstrip(b"=").decode()
        options = {"verbose": False, "pedantic": False, "nkey": kp.public_key.decode(), "sig": sig}
        out = [b"CONNECT " + json.dumps(options).encode() + b"\r\n"]
        out += [b"PUB %s %d\r\n%s\r\n" % (subject, len(data), data) for subject, data in frames]
        writer.write(b"".join(out) + b"PING\r\n")
        await writer.drain()
        errors = []
        while True:
            line = await asyncio.wait_for(reader.readline(), 5)
            if line.startswith(b"PONG") or not line:
                return errors
            if line.startswith(b"-ERR"):
                errors.append(line.decode(errors="backslashreplace"))
    finally:
        writer.close()


async def test_a_member_publishes_only_on_subjects_the_control_plane_named(
    secured: Secured, controlplane: Conn
) -> None:
    """A node credential lists literal subjects only: a subject that is not UTF-8 (which would
    stop nats-py's reader in the control plane), an event type of its own, a member's name
    in the role's place: the server refuses each, and the stream gets none."""
    before = await stored(controlplane)
    base = f"elastic.evt.{JOB_A}.n0.member"
    frames = [
        (f"{base}.member.heartbeat".encode() + b"\xff", b"{}"),
        (f"{base}.member.\xc3".encode(), b"{}"),
        (f"elastic.evt.{JOB_A}.n0.".encode() + b"\xed\xa0\x80.member.heartbeat", b"{}"),
        (f"{base}.member.bogus".encode(), b"{}"),
        (f"elastic.evt.{JOB_A}.n0.w0.member.heartbeat".encode(), b"{}"),
        (f"elastic.hb.{JOB_A}.n0.w0".encode(), b"{}"),
        (f"elastic.hb.{JOB_A}.n0.member".encode() + b"\xff", b"{}"),
    ]
    seed = secured.seed(JOB_A, "n0", creds.MEMBER).read_bytes().strip()
    errors = await _publish_raw_as(secured.url, seed, frames)
    assert len(errors) == len(frames), errors
    assert all("permissions violation for publish" in e.lower() for e in errors), errors
    # The same connection's honest publication is not refused.
    own = event_subject(JOB_A, "n0", "w0", "member.heartbeat").encode()
    assert await _publish_raw_as(secured.url, seed, [(own, b"{}")]) == []
    await asyncio.sleep(0.2)
    assert await stored(controlplane) == before + 1, "a refused subject reached the stream"


async def test_heartbeats_go_only_as_the_nodes_own_members_and_only_to_the_control_plane(
    secured: Secured, controlplane: Conn, connect: Any
) -> None:
    """Heartbeats are NATS core messages (not stored): a node's member credential publishes
    them as its own node's members only (not as its launcher, another node's member or
    another job's), its launcher credential the node's relayed ones on its own subject only,
    the control plane receives them, and a node credential cannot listen."""
    got: list[str] = []

    async def heard(msg: Any) -> None:
        got.append(msg.subject)

    await controlplane.client.subscribe("elastic.hb.>", cb=heard)
    await controlplane.client.flush()
    member: Conn = await connect(secured.seed(JOB_A, "n0", creds.MEMBER))
    launcher: Conn = await connect(secured.seed(JOB_A, "n0", creds.LAUNCHER))
    for conn, subject in (
        (member, heartbeat_subject(JOB_A, "n0", "launcher")),
        (member, heartbeat_subject(JOB_A, "n1", "w1")),
        (member, heartbeat_subject(JOB_B, "n0", "w0")),
        (launcher, heartbeat_subject(JOB_A, "n0", "w0")),
        (launcher, heartbeat_subject(JOB_A, "n1", "launcher")),
        (launcher, heartbeat_subject(JOB_B, "n0", "launcher")),
    ):
        await conn.client.publish(subject, b"{}")
        await conn.client.flush()
        await conn.violation("publish", subject)
    own = heartbeat_subject(JOB_A, "n0", "w0")
    relayed = heartbeat_subject(JOB_A, "n0", "launcher")
    for conn, subject in ((member, own), (launcher, relayed)):
        await conn.client.publish(subject, b"{}")
        await conn.client.flush()
    deadline = time.monotonic() + 5
    while len(got) < 2:
        assert time.monotonic() < deadline, "the control plane did not receive the heartbeats"
        await asyncio.sleep(0.02)
    await asyncio.sleep(0.1)
    # None of the refused ones. (Two connections: either may reach the server first.)
    assert sorted(got) == sorted([own, relayed])
    await member.client.subscribe("elastic.hb.>")
    await member.violation("subscription", "elastic.hb.>")


# --------------------------------------------------------------------------- reading


async def test_a_node_credential_cannot_read_events(
    secured: Secured, controlplane: Conn, connect: Any
) -> None:
    """No consumer on the events stream, no message of it, no subscription to events or to
    another identity's inbox (``_INBOX.>``: where pulled events travel to the control plane)."""
    cp_inbox = creds.inbox_prefix(creds.public_key(secured.controlplane.read_bytes().strip()))
    for kind in creds.KINDS:
        node: Conn = await connect(secured.seed(JOB_A, "n0", kind))
        nc = node.client
        for subject in ("_INBOX.>", f"{cp_inbox}.>", "elastic.evt.>", f"elastic.evt.{JOB_A}.>"):
            await nc.subscribe(subject)
            await node.violation("subscription", subject)
        for api in (
            f"$JS.API.CONSUMER.CREATE.{EVENTS}",
            f"$JS.API.CONSUMER.CREATE.{EVENTS}.spy.elastic.evt.{JOB_A}.>",
            f"$JS.API.CONSUMER.DURABLE.CREATE.{EVENTS}.spy",
            f"$JS.API.CONSUMER.MSG.NEXT.{EVENTS}.{SETTINGS.ingest_durable}",
            f"$JS.API.STREAM.MSG.GET.{EVENTS}",
            f"$JS.API.DIRECT.GET.{EVENTS}",
            f"$JS.API.STREAM.INFO.{EVENTS}",
            f"$JS.API.CONSUMER.CREATE.{COMMANDS}",  # unfiltered: any job's commands
        ):
            with pytest.raises((nats.errors.TimeoutError, nats.errors.NoRespondersError)):
                await nc.request(api, b"{}", timeout=0.5)
            await node.violation("publish", api)


async def test_a_node_credential_reads_its_own_jobs_commands_only(
    secured: Secured, controlplane: Conn, connect: Any
) -> None:
    """Its own job's commands, as they are published and the one in force by its subject;
    nothing of another job's, and no consumer of the commands stream at all."""
    cp_js = controlplane.client.jetstream()
    secret_b = f"for-{JOB_B}-{uuid.uuid4().hex}".encode()
    await cp_js.publish(command_subject(JOB_B), secret_b)
    own = f"for-{JOB_A}-{uuid.uuid4().hex}".encode()
    await cp_js.publish(command_subject(JOB_A), own)
    spy: Conn = await connect(secured.seed(JOB_A, "n0", creds.MEMBER))
    nc = spy.client
    # Core subscriptions to another job's commands, or to every job's: refused.
    for subject in (f"elastic.cmd.{JOB_B}.>", command_subject(JOB_B), "elastic.cmd.>"):
        await nc.subscribe(subject)
        await spy.violation("subscription", subject)
    # Its own job's command in force, by its subject: allowed.
    js = nc.jetstream()
    last = await js.get_last_msg(COMMANDS, command_subject(JOB_A), direct=True)
    assert last.data == own
    # Another job's by its subject, any by its sequence, a consumer on any filter, the
    # stream's per-subject counts (they name every job's members): refused.
    refused: list[tuple[str, bytes]] = [
        (f"$JS.API.DIRECT.GET.{COMMANDS}.{command_subject(JOB_B)}", b""),
        (f"$JS.API.DIRECT.GET.{COMMANDS}", json.dumps({"seq": 1}).encode()),
        (f"$JS.API.STREAM.MSG.GET.{COMMANDS}", json.dumps({"seq": 1}).encode()),
        (f"$JS.API.STREAM.INFO.{COMMANDS}", json.dumps({"subjects_filter": ">"}).encode()),
    ]
    for name, subject in (("spy1", command_subject(JOB_B)), ("spy2", command_subject(JOB_A))):
        config = {"name": name, "filter_subject": subject, "deliver_subject": nc.new_inbox(),
                  "deliver_policy": "all", "ack_policy": "none"}  # fmt: skip
        refused.append((
            f"$JS.API.CONSUMER.CREATE.{COMMANDS}.{name}.{subject}",
            json.dumps({"stream_name": COMMANDS, "config": config}).encode(),
        ))  # fmt: skip
    for api, body in refused:
        with pytest.raises((nats.errors.TimeoutError, nats.errors.NoRespondersError)):
            await nc.request(api, body, timeout=0.5)
        await spy.violation("publish", api)


# --------------------------------------------------------------------------- doing the work


async def test_each_credential_does_its_part(secured: Secured, controlplane: Conn) -> None:
    """The control plane's credential ensures the streams, pulls and acks events, publishes
    commands; a member (EventClient, as the launcher starts it) publishes and follows its
    job's commands; the launcher's credential reports exits as ``<node>/launcher``."""
    job = JOB_A
    identity = Identity(
        job, "n1", "rack0", "w1", Role.WORKER, secured.url,
        nats_creds=str(secured.seed(job, "n1", creds.MEMBER)),
    )  # fmt: skip
    member = EventClient(identity).start()
    reporter = EventClient(
        Identity(
            job,
            "n1",
            "rack0",
            "launcher",
            Role.WORKER,
            secured.url,
            nats_creds=str(secured.seed(job, "n1", creds.LAUNCHER)),
        ),
        commands=False,
    ).start()
    settings = Settings(nats_url=secured.url, nats_creds=str(secured.controlplane))
    nc = await bus.connect(settings)
    try:
        member.publish("member.heartbeat", {"step": 0, "phase": "init"})
        reporter.publish("member.exited", {"member": "w1", "signal": 9})
        deadline = time.monotonic() + 20
        while member.stats.acked < 1 or reporter.stats.acked < 1:
            assert time.monotonic() < deadline, (member.stats, reporter.stats)
            await asyncio.sleep(0.05)
        consumer = bus.EventConsumer(nc, settings)
        got: list[bus.Delivery] = []
        # The stream is the module's: an earlier test's events may come first.
        wanted = {
            event_subject(job, "n1", "w1", "member.heartbeat"),
            event_subject(job, "n1", "launcher", "member.exited"),
        }
        while not wanted <= {d.subject for d in got}:
            assert time.monotonic() < deadline, f"the control plane received {got}"
            got += await consumer.fetch(10, 1.0)
        assert await consumer.ack_through(got[-1], consumer.epoch)
        stop = Stop(
            command_id=uuid.uuid4(),
            job_id=job,
            decision_position=1,
            issued_at=datetime.now(UTC),
            reason="test",
        )
        await nc.jetstream().publish(
            command_subject(job),
            stop.model_dump_json().encode(),
            headers={MSG_ID_HEADER: str(stop.command_id)},
        )
        received = await asyncio.to_thread(member.next_command, 20.0)
        assert isinstance(received, Stop) and received.command_id == stop.command_id
    finally:
        member.close(flush_s=0.5)
        reporter.close(flush_s=0.5)
        await nc.close()


async def test_a_member_follows_commands_across_a_server_restart(tmp_path: Path) -> None:
    """When the server comes back the member's subscriptions are made again and the command in
    force read again: it gets the next command."""
    master = os.urandom(32)
    creds.issue(master, tmp_path / "creds", JOB_A, ["n0"])
    config = tmp_path / "nats.conf"
    config.write_text(f'authorization {{\n  include "creds/{creds.USERS_FILE}"\n}}\n')
    server = NatsServer(tmp_path / "nats", config=config).start()
    settings = Settings(nats_url=server.url, nats_creds=str(tmp_path / "creds" / "controlplane.nk"))
    member = EventClient(
        Identity(
            JOB_A,
            "n0",
            "rack0",
            "w0",
            Role.WORKER,
            server.url,
            nats_creds=str(tmp_path / "creds" / JOB_A / "n0" / "member.nk"),
        )
    ).start()

    async def command(reason: str) -> Stop:
        stop = Stop(
            command_id=uuid.uuid4(),
            job_id=JOB_A,
            decision_position=1,
            issued_at=datetime.now(UTC),
            reason=reason,
        )
        nc = await bus.connect(settings)
        try:
            js = nc.jetstream()
            await bus.ensure_command_stream(js, settings)
            await js.publish(command_subject(JOB_A), stop.model_dump_json().encode())
        finally:
            await nc.close()
        return stop

    try:
        first = await command("before")
        got = await asyncio.to_thread(member.next_command, 20.0)
        assert got is not None and got.command_id == first.command_id
        server.stop()
        server.start()
        second = await command("after")
        got = await asyncio.to_thread(member.next_command, 40.0)
        assert got is not None and got.command_id == second.command_id
    finally:
        member.close(flush_s=0.0)
        server.stop()


# --------------------------------------------------------------------------- the launcher


def test_the_launcher_takes_its_nodes_credentials_and_hands_members_theirs(
    tmp_path: Path,
) -> None:
    master = os.urandom(32)
    creds.issue(master, tmp_path, JOB_A, ["node0", "node1"])
    base = {
        CREDS_DIR_ENV: str(tmp_path),
        NATS_USER_ENV: "trainer",
        NATS_PASSWORD_ENV: "shared",
        NATS_CREDS_ENV: str(tmp_path / creds.CONTROLPLANE_FILE),
    }
    found = launcher._node_credentials(base, JOB_A, launcher.layout(3, 1, 2, 1))
    assert set(found) == {"node0", "node1"}
    assert found["node1"].launcher == tmp_path / JOB_A / "node1" / "launcher.nk"
    assert found["node1"].member == tmp_path / JOB_A / "node1" / "member.nk"
    # Members get the job's secret and the command key, and no other credential.
    assert base == {
        JOB_SECRET_ENV: job_secret(master, JOB_A).hex(),
        COMMAND_KEY_ENV: command_public_key(master).hex(),
    }
    # A node with no credentials stops the launch before any member starts.
    with pytest.raises(creds.CredentialsError, match="node2"):
        launcher._node_credentials(
            {CREDS_DIR_ENV: str(tmp_path)}, JOB_A, launcher.layout(3, 0, 3, 1)
        )
    assert launcher._node_credentials({}, JOB_A, launcher.layout(1, 0, 1, 1)) == {}


def test_credentials_are_derived_and_distinct(tmp_path: Path) -> None:
    master = os.urandom(32)
    one = creds.node_seed(master, JOB_A, "n0", creds.MEMBER)
    assert one == creds.node_seed(master, JOB_A, "n0", creds.MEMBER)
    seeds = {
        creds.controlplane_seed(master),
        one,
        creds.node_seed(master, JOB_A, "n0", creds.LAUNCHER),
        creds.node_seed(master, JOB_A, "n1", creds.MEMBER),
        creds.node_seed(master, JOB_B, "n0", creds.MEMBER),
        creds.node_seed(os.urandom(32), JOB_A, "n0", creds.MEMBER),
    }
    assert len(seeds) == 6
    with pytest.raises(creds.CredentialsError):
        creds.node_seed(master, "a.b", "n0", creds.MEMBER)  # a dot would widen a subject
    with pytest.raises(creds.CredentialsError):
        creds.node_seed(master, JOB_A, "n>", creds.MEMBER)
    issued = creds.issue(master, tmp_path, JOB_A, ["n0"])
    assert oct(issued.nodes["n0"].member.stat().st_mode & 0o777) == "0o600"
    text = issued.users_file.read_text()
    for path in (issued.controlplane, issued.nodes["n0"].launcher, issued.nodes["n0"].member):
        seed = path.read_bytes().strip()
        assert seed.decode() not in text  # public keys only, never a seed
        assert creds.public_key(seed) in text
    assert issued.users == 3


# --------------------------------------------------------------------------- TLS


def _certificates(directory: Path) -> tuple[Path, Path, Path]:
    """A CA, and a server certificate it signed for 127.0.0.1: (ca, cert, key) files."""
    import datetime as dt
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = dt.datetime.now(dt.UTC)

    def name(text: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, text)])

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (
        x509.CertificateBuilder()
        .subject_name(name("elastic test CA"))
        .issuer_name(name("elastic test CA"))
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(hours=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(name("nats"))
        .issuer_name(ca.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(hours=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    paths = directory / "ca.crt", directory / "server.crt", directory / "server.key"
    paths[0].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths[1].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    paths[2].write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return paths


async def test_nats_over_tls_with_the_settings_url(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """TLS is a URL away: ``tls://`` in ELASTIC_NATS_URL, the CA in SSL_CERT_FILE (Python's
    default context verifies the server's certificate and name). A plain client is refused."""
    import ssl

    async def once(url: str, path: str) -> None:
        """One connection attempt, no retries: raise what made it fail."""
        errors: list[Exception] = []

        async def error(exc: Exception) -> None:
            errors.append(exc)

        options = nkey_connect_options(path) or {}
        try:
            nc = await asyncio.wait_for(
                nats.connect(url, allow_reconnect=False, error_cb=error, **options), 10
            )
        except nats.errors.NoServersError:
            raise errors[0] if errors else AssertionError("no error reported") from None
        await nc.close()

    ca, cert, key = _certificates(tmp_path)
    master = os.urandom(32)
    creds.issue(master, tmp_path / "creds", JOB_A, ["n0"])
    config = tmp_path / "nats.conf"
    config.write_text(
        f'tls {{\n  cert_file: "{cert}"\n  key_file: "{key}"\n}}\n'
        f'authorization {{\n  include "creds/{creds.USERS_FILE}"\n}}\n'
    )
    server = NatsServer(tmp_path / "nats", config=config).start()
    tls_url = server.url.replace("nats://", "tls://")
    cp_creds = str(tmp_path / "creds" / creds.CONTROLPLANE_FILE)
    member: EventClient | None = None
    try:
        # Without the CA the server's certificate is not trusted.
        monkeypatch.setenv("SSL_CERT_FILE", str(tmp_path / "no-such-ca.crt"))
        with pytest.raises(ssl.SSLCertVerificationError):
            await once(tls_url, cp_creds)
        monkeypatch.setenv("SSL_CERT_FILE", str(ca))
        nc = await bus.connect(Settings(nats_url=tls_url, nats_creds=cp_creds))
        try:
            js = nc.jetstream()
            await bus.ensure_stream(js, SETTINGS)
            member = EventClient(
                Identity(
                    JOB_A,
                    "n0",
                    "rack0",
                    "w0",
                    Role.WORKER,
                    tls_url,
                    nats_creds=str(tmp_path / "creds" / JOB_A / "n0" / "member.nk"),
                ),
                commands=False,
            ).start()
            member.publish("member.heartbeat", {"step": 0, "phase": "init"})
            deadline = time.monotonic() + 20
            while member.stats.acked < 1:
                assert time.monotonic() < deadline, member.stats
                await asyncio.sleep(0.05)
            assert nc._current_server is not None and nc._current_server.uri.scheme == "tls"
        finally:
            await nc.close()
        # A client that does not speak TLS gets nothing but the demand for it (nats-py
        # upgrades on its own when told; the raw protocol shows what plain text gets).
        reader, writer = await asyncio.open_connection(server.host, server.port)
        try:
            info = json.loads((await reader.readline()).split(b" ", 1)[1])
            assert info["tls_required"] is True
            writer.write(b'CONNECT {"verbose": false}\r\nPING\r\n')
            await writer.drain()
            answer = await asyncio.wait_for(reader.read(4096), 10)
            assert b"PONG" not in answer, answer
        finally:
            writer.close()
    finally:
        if member is not None:
            member.close(flush_s=0.5)
        server.stop()


async def test_a_launcher_runs_its_members_under_their_nodes_credentials(
    secured: Secured, controlplane: Conn, tmp_path: Path
) -> None:
    """``elasticctl run``'s launcher with ELASTIC_NATS_CREDS_DIR, against the secured server:
    each member publishes with its node's member credential (and nothing more in its
    environment), and its exit is reported with the node's launcher credential."""
    import textwrap

    script = tmp_path / "member.py"
    script.write_text(
        textwrap.dedent("""
        import json, os, sys, time
        from rank_runtime.client import EventClient
        from rank_runtime.identity import Identity
        env = os.environ
        node, job = env["ELASTIC_NODE"], env["ELASTIC_JOB_ID"]
        assert env["ELASTIC_NATS_CREDS"].endswith(f"/{job}/{node}/member.nk"), env
        assert "ELASTIC_NATS_CREDS_DIR" not in env and "ELASTIC_SECRET" not in env
        assert env["ELASTIC_JOB_SECRET"] and env["ELASTIC_COMMAND_KEY"]
        client = EventClient(Identity.from_env(), commands=False).start()
        client.publish("member.heartbeat", {"step": 0, "phase": "init"})
        deadline = time.monotonic() + 20
        while client.stats.acked < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        client.close(flush_s=1.0)
        sys.exit(0 if client.stats.acked else 5)
    """)
    )
    job = JOB_A  # issued on nodes n0 and n1 only: lay the members out by hand over those
    env = {
        **os.environ,
        CREDS_DIR_ENV: str(secured.creds),
        "ELASTIC_SECRET": secured.master.hex(),  # must not reach the members
        "PYTHONPATH": str(ROOT),
    }
    results = []
    for node in ("n0", "n1"):
        results.append(
            await asyncio.to_thread(
                launcher.run,
                [str(script)],
                nproc=1,
                job_id=job,
                nats_url=secured.url,
                env=env,
                node=node,
            )
        )
    assert all(r.ok for r in results), [r.exits for r in results]
    subjects = set()
    deadline = time.monotonic() + 20
    for node in ("n0", "n1"):
        beat = event_subject(job, node, f"{node}-w0", "member.heartbeat")
        while not await stored(controlplane, beat):
            assert time.monotonic() < deadline, f"no heartbeat from {node}"
            await asyncio.sleep(0.1)
        subjects.add(beat)
    info = await controlplane.client.jetstream().stream_info(
        EVENTS, subjects_filter=f"elastic.evt.{job}.*.*.member.exited"
    )
    exits = set((info.state.subjects or {}).keys())
    assert len(exits) == 2, exits  # each launcher reported its member's exit
