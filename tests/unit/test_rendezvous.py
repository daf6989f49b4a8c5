"""The rendezvous store's protocol: authenticated, scoped, bounded; gloo forms over it.

The server runs in-process (its own thread); clients are the rank runtime's
``RendezvousStore``, raw sockets speaking (or replaying) the protocol, and torch's TCPStore.
"""

from __future__ import annotations

import os
import socket
import ssl
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from controlplane.rendezvous import RendezvousLimits, RendezvousServer
from rank_runtime.rendezvous import RendezvousAuthError, RendezvousStore
from schemas.auth import job_secret
from schemas.rendezvous import (
    ERROR,
    MAGIC,
    OK,
    SET,
    RendezvousError,
    encode_int,
    frame,
    hello_mac,
    pack_fields,
    seal,
    session_key,
)
from tests.certs import self_signed

MASTER = bytes(range(32))
ROOT = Path(__file__).resolve().parents[2]
SHORT = timedelta(seconds=5)


#: Every client the tests opened, closed after each test.
OPENED: list[RendezvousStore] = []


@pytest.fixture(autouse=True)
def _close_clients() -> Iterator[None]:
    yield
    while OPENED:
        OPENED.pop().close()


@pytest.fixture
def server() -> Iterator[RendezvousServer]:
    srv = RendezvousServer(
        master=MASTER,
        limits=RendezvousLimits(max_keys=50, max_bytes=4096, max_value_bytes=1024, max_jobs=8),
    )
    srv.start()
    yield srv
    srv.close()


def connect(
    server: RendezvousServer, job: str = "job-a", gen: int = 1, secret: bytes | None = None
) -> RendezvousStore:
    key = job_secret(MASTER, job) if secret is None else secret
    store = RendezvousStore.connect(
        f"tcp://127.0.0.1:{server.port}/{job}/{gen}", key, timeout=SHORT
    )
    OPENED.append(store)
    return store


def read_frame(sock: socket.socket) -> bytes:
    size = int.from_bytes(sock.recv(4, socket.MSG_WAITALL), "big")
    return sock.recv(size, socket.MSG_WAITALL)


def test_every_operation_of_the_store_api(server: RendezvousServer) -> None:
    store = connect(server)
    store.set("a", b"1")
    store.set("s", "text")
    assert store.get("a") == b"1" and store.get("s") == b"text"
    assert store.add("n", 3) == 3 and store.add("n", -1) == 2 and store.get("n") == b"2"
    assert store.compare_set("c", b"", b"x") == b"x"  # absent, nothing expected: set
    assert store.compare_set("c", b"y", b"z") == b"x"  # present, not expected: unchanged
    assert store.compare_set("c", b"x", b"z") == b"z"
    assert store.compare_set("absent", b"e", b"d") == b"e"  # TCPStore's answer for this case
    assert store.check(["a", "c"]) and not store.check(["a", "nope"])
    assert store.num_keys() == 4
    assert store.delete_key("a") and not store.delete_key("a")
    store.multi_set(["m1", "m2"], [b"v1", b"v2"])
    assert store.multi_get(["m1", "m2"]) == [b"v1", b"v2"]
    store.append("m1", b"+")
    assert store.get("m1") == b"v1+"
    with pytest.raises(dist.DistStoreError, match="timeout"):
        store.wait(["never"], timedelta(milliseconds=100))
    other = store.clone()
    OPENED.append(other)
    other.set("from-clone", b"1")
    store.wait(["from-clone"], timedelta(seconds=1))
    other.close()
    store.close()


def test_a_store_that_goes_away_mid_handshake_is_reached_at_its_successor() -> None:
    """The port's first owner accepts and drops connections before its greeting (a control
    plane exiting), then a new server takes the port (its standby): the client gets there."""
    import threading

    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    successor: list[RendezvousServer] = []

    def dying_then_replaced() -> None:
        for _ in range(2):
            conn, _ = listener.accept()
            conn.close()
        listener.close()
        srv = RendezvousServer(master=MASTER, port=port)
        srv.start()
        successor.append(srv)

    thread = threading.Thread(target=dying_then_replaced)
    thread.start()
    try:
        store = RendezvousStore.connect(
            f"tcp://127.0.0.1:{port}/job-a/1", job_secret(MASTER, "job-a"), timeout=SHORT
        )
        OPENED.append(store)
        store.set("k", b"v")
        assert store.get("k") == b"v"
    finally:
        thread.join(5)
        for srv in successor:
            srv.close()


def test_a_wait_is_released_by_another_clients_set(server: RendezvousServer) -> None:
    import threading

    waiter, setter = connect(server), connect(server)
    got: list[bytes] = []
    thread = threading.Thread(target=lambda: got.append(waiter.get("late")))
    thread.start()
    setter.set("late", b"here")
    thread.join(5)
    assert got == [b"here"]


def test_a_client_without_the_jobs_secret_can_neither_read_nor_write(
    server: RendezvousServer,
) -> None:
    honest = connect(server)
    honest.set("arrived/0", b"w0")
    for secret in (
        b"",
        os.urandom(32),
        job_secret(MASTER, "job-b"),
        job_secret(b"x" * 32, "job-a"),
    ):
        with pytest.raises(RendezvousAuthError, match="authentication failed"):
            RendezvousStore.connect(
                f"tcp://127.0.0.1:{server.port}/job-a/1", secret or None, timeout=SHORT
            )
    # Nothing the refused clients sent reached the generation; a pre-set of the next one
    # (generation 2) was refused as well.
    with pytest.raises(RendezvousAuthError):
        connect(server, gen=2, secret=job_secret(MASTER, "job-b"))
    assert honest.num_keys() == 1 and honest.get("arrived/0") == b"w0"
    assert server.stats.refused_handshakes == 5 and server.keys_of("job-a") == 1


def test_torchs_tcpstore_client_gets_nothing(server: RendezvousServer) -> None:
    honest = connect(server)
    honest.set("secret-ish", b"value")
    with pytest.raises(Exception):  # noqa: B017 - torch raises its own kinds
        client = dist.TCPStore(  # type: ignore[attr-defined]
            "127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=2)
        )
        client.get("job-a/1/secret-ish")
    assert honest.num_keys() == 1


def _handshake(sock: socket.socket, key: bytes, job: str, gen: int) -> tuple[bytes, bytes]:
    """Speak the client's half of the handshake; return (what was sent, the session key)."""
    hello = read_frame(sock)
    assert hello.startswith(MAGIC)
    server_nonce = hello[len(MAGIC) :]
    client_nonce = os.urandom(32)
    tag = hello_mac(key, server_nonce, client_nonce, job, gen)
    sent = frame(pack_fields([job.encode(), encode_int(gen), client_nonce, tag]))
    sock.sendall(sent)
    assert read_frame(sock)[0] == OK
    return sent, session_key(key, server_nonce, client_nonce)


def test_a_recorded_session_cannot_be_replayed(server: RendezvousServer) -> None:
    key = job_secret(MASTER, "job-a")
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sent, session = _handshake(sock, key, "job-a", 1)
        request = frame(seal(session, 1, bytes([SET]) + pack_fields([b"k", b"v1"])))
        sock.sendall(request)
        assert read_frame(sock)[8] == OK
        # The same request again on the same connection: refused, connection closed.
        sock.sendall(request)
        assert sock.recv(1) == b""
    # The whole recording on a new connection: the server's nonce differs, so its hello
    # does not authenticate, and nothing of it is applied.
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        read_frame(sock)
        sock.sendall(sent + request)
        answer = read_frame(sock)
        assert answer[0] == ERROR and b"authentication failed" in answer
    honest = connect(server)
    assert honest.get("k") == b"v1" and honest.num_keys() == 1


def test_keys_are_scoped_by_the_server_per_job_and_generation(server: RendezvousServer) -> None:
    a1, a2, b1 = connect(server, "job-a", 1), connect(server, "job-a", 2), connect(server, "job-b")
    a1.set("arrived/0", b"a1")
    assert not a2.check(["arrived/0"]) and not b1.check(["arrived/0"])
    # A key name that looks like another space's path is just a key of this one.
    b1.set("../job-a/1/arrived/1", b"x")
    assert not a1.check(["arrived/1"]) and a1.num_keys() == 1


def test_bounds_per_job_are_enforced_and_named(server: RendezvousServer) -> None:
    store = connect(server)
    with pytest.raises(RendezvousError, match="max_value_bytes=1024"):
        store.set("big", b"x" * 1025)
    with pytest.raises(RendezvousError, match="max_key_bytes"):
        store.set("k" * 5000, b"")
    for i in range(4):
        store.set(f"v{i}", b"x" * 1000)
    with pytest.raises(RendezvousError, match="max_bytes=4096"):
        store.set("v4", b"x" * 1000)
    for i in range(4):
        assert store.delete_key(f"v{i}")
    other_generation = connect(server, gen=2)
    for i in range(50):
        other_generation.set(f"n{i}", b"")
    with pytest.raises(RendezvousError, match="max_keys=50"):
        store.set("one-more", b"")  # the bound is the job's, over its generations
    # The connection survives a refusal; another job is not affected.
    assert store.num_keys() == 0
    connect(server, "job-b").set("fine", b"1")


def test_old_generations_are_dropped_and_refused(server: RendezvousServer) -> None:
    g1 = connect(server, gen=1)
    g1.set("k", b"1")
    connect(server, gen=2).set("k", b"2")
    assert server.keys_of("job-a") == 2
    connect(server, gen=3)  # generation 1 goes
    assert server.keys_of("job-a") == 1
    with pytest.raises(RendezvousError, match="superseded"):
        g1.get("k")
    with pytest.raises(RendezvousAuthError, match="superseded"):
        connect(server, gen=1)


def test_only_generations_the_control_plane_started_are_admitted() -> None:
    srv = RendezvousServer(master=MASTER, admit=lambda job, gen: job == "job-a" and gen <= 2)
    srv.start()
    try:
        connect(srv, "job-a", 2).set("k", b"")
        with pytest.raises(RendezvousAuthError, match="not started"):
            connect(srv, "job-a", 3)
        with pytest.raises(RendezvousAuthError, match="not started"):
            connect(srv, "job-z", 1)
    finally:
        srv.close()


def test_without_an_installation_secret_it_runs_unauthenticated() -> None:
    srv = RendezvousServer(master=None)
    srv.start()
    try:
        store = RendezvousStore.connect(f"tcp://127.0.0.1:{srv.port}/job-a/1", None, timeout=SHORT)
        OPENED.append(store)
        store.set("k", b"v")
        assert store.get("k") == b"v"
    finally:
        srv.close()


MEMBER = textwrap.dedent(
    """
    import sys, time
    from datetime import timedelta
    import torch, torch.distributed as dist
    torch.set_num_threads(1)
    from rank_runtime.rendezvous import RendezvousStore
    port, rank, secret = int(sys.argv[1]), int(sys.argv[2]), bytes.fromhex(sys.argv[3])
    for generation in (1, 2, 3):
        began = time.perf_counter()
        store = RendezvousStore.connect(
            f"tcp://127.0.0.1:{port}/job-g/{generation}", secret, timeout=timedelta(seconds=60)
        )
        dist.init_process_group("gloo", store=store, rank=rank, world_size=3,
                                timeout=timedelta(seconds=60))
        t = torch.full((4,), float(rank + generation))
        dist.all_reduce(t)
        dist.destroy_process_group()
        store.close()
        print(generation, t[0].item(), round((time.perf_counter() - began) * 1e3, 1), flush=True)
    """
)


def test_a_gloo_group_of_three_forms_and_reforms_over_the_store(
    server: RendezvousServer, tmp_path: Path
) -> None:
    script = tmp_path / "member.py"
    script.write_text(MEMBER)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    secret = job_secret(MASTER, "job-g").hex()
    members = [
        subprocess.Popen(
            [sys.executable, str(script), str(server.port), str(rank), secret],
            env=env,
            stdout=subprocess.PIPE,
            text=True,
        )
        for rank in range(3)
    ]
    outputs = [m.communicate(timeout=120)[0] for m in members]
    assert [m.returncode for m in members] == [0, 0, 0]
    for out in outputs:
        lines = [line.split() for line in out.splitlines()]
        # sum over ranks of (rank + generation) = 3 + 3 * generation
        assert [(int(g), float(v)) for g, v, _ in lines] == [(g, 3.0 + 3 * g) for g in (1, 2, 3)]


def _self_signed(tmp_path: Path) -> tuple[str, str]:
    cert, key = self_signed(tmp_path, "rendezvous")
    return str(cert), str(key)


def test_tls_endpoints_are_verified_against_the_ca(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from controlplane.rendezvous import RendezvousHost, server_tls

    cert, key = _self_signed(tmp_path)
    host = RendezvousHost("127.0.0.1", listen="127.0.0.1", master=MASTER,
                          ssl_context=server_tls(cert, key))  # fmt: skip
    base = host.start()
    try:
        assert base.startswith("tls://127.0.0.1:")
        secret = job_secret(MASTER, "job-t")
        monkeypatch.setenv("ELASTIC_TLS_CA", cert)
        store = RendezvousStore.connect(f"{base}/job-t/1", secret, timeout=SHORT)
        OPENED.append(store)
        store.set("k", b"over tls")
        assert store.get("k") == b"over tls"
        # Without the CA the server's certificate is not trusted; plain TCP gets no greeting.
        monkeypatch.delenv("ELASTIC_TLS_CA")
        with pytest.raises(ssl.SSLCertVerificationError):
            RendezvousStore.connect(f"{base}/job-t/1", secret, timeout=SHORT)
        plain = base.replace("tls://", "tcp://")
        with pytest.raises((RendezvousError, ConnectionError)):
            RendezvousStore.connect(f"{plain}/job-t/1", secret, timeout=SHORT)
    finally:
        host.close()
