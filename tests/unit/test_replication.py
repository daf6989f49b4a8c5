"""Peer replication over loopback TCP: kept under the owner's digest and verified by whoever
fetches it (or, opted in, by the holder before it keeps it), served back, bounded memory with
receive buffers reused, and with the job's secret authenticated both ways (no secret, a wrong
one, a replayed request: refused; tampered bytes: refused at fetch)."""

from __future__ import annotations

import json
import os
import socket
import sys
import time

import pytest

from rank_runtime.replication import (
    DigestMismatch,
    PeerStore,
    ReplicationError,
    bind_address,
    digest,
    fetch,
    fetch_into,
    send,
)

SECRET = bytes(range(32))
OTHER = bytes(range(1, 33))


@pytest.fixture
def store():
    peer = PeerStore()
    peer.start()
    yield peer
    peer.close()


@pytest.fixture
def secure():
    peer = PeerStore(secret=SECRET)
    peer.start()
    yield peer
    peer.close()


def test_a_copy_is_kept_once_sent_and_served_back(store):
    data = b"x" * 100_000
    send(store.endpoint, owner="m1", shard=1, step=10, generation=2, data=data,
         digest=digest(data))  # fmt: skip
    seen = [c for c in [store.held("m1", 1, 10)] if c is not None]  # kept when send returned
    assert [(c.owner, c.shard, c.step, c.generation) for c in seen] == [("m1", 1, 10, 2)]
    assert seen[0].checksum == digest(data) and seen[0].checksum.startswith("sha256:")
    assert fetch(store.endpoint, owner="m1", shard=1, step=10) == data


def test_a_corrupt_copy_is_kept_unverified_and_refused_when_fetched(store):
    """By default the holder does not hash a put: the copy is kept under the digest its owner
    claimed, and whoever fetches it hashes it and refuses it."""
    data = b"payload"
    send(store.endpoint, owner="m1", shard=0, step=5, generation=1, data=data,
         digest=digest(b"other"))  # fmt: skip
    held = store.held("m1", 0, 5)
    assert held is not None and held.checksum == digest(b"other") and not held.verified
    with pytest.raises(DigestMismatch, match="its holder announced"):
        fetch(store.endpoint, owner="m1", shard=0, step=5)
    with pytest.raises(DigestMismatch):
        fetch(store.endpoint, owner="m1", shard=0, step=5, expected=digest(b"other"))


@pytest.mark.parametrize("how", ["argument", "env"])
def test_a_verifying_holder_refuses_a_corrupt_copy_and_keeps_none(monkeypatch, how):
    if how == "env":
        monkeypatch.setenv("ELASTIC_PEER_VERIFY", "1")
    peer = PeerStore(verify=True) if how == "argument" else PeerStore()
    assert peer.verify
    peer.start()
    try:
        with pytest.raises(ReplicationError, match="digest"):
            send(peer.endpoint, owner="m1", shard=0, step=5, generation=1, data=b"payload",
                 digest=digest(b"other"))  # fmt: skip
        assert peer.held("m1", 0, 5) is None
        with pytest.raises(ReplicationError, match="no shard 0"):
            fetch(peer.endpoint, owner="m1", shard=0, step=5)
        good = b"payload"
        send(peer.endpoint, owner="m1", shard=0, step=6, generation=1, data=good,
             digest=digest(good))  # fmt: skip
        held = peer.held("m1", 0, 6)
        assert held is not None and held.verified and held.data == good
    finally:
        peer.close()
    monkeypatch.setenv("ELASTIC_PEER_VERIFY", "0")
    assert not PeerStore().verify


def test_a_copy_sent_in_parts_arrives_whole():
    parts = [b"head", memoryview(bytearray(b"x" * 70_000)), b"", b"tail"]
    whole = b"".join(bytes(p) for p in parts)
    peer = PeerStore(verify=True)  # the holder hashes what arrives: the digest of the whole
    peer.start()
    try:
        send(peer.endpoint, owner="m1", shard=0, step=1, generation=1, data=parts,
             digest=digest(whole))  # fmt: skip
        assert fetch(peer.endpoint, owner="m1", shard=0, step=1, expected=digest(whole)) == whole
    finally:
        peer.close()


def test_receive_buffers_are_reused_and_memory_stays_at_keep_plus_one(store):
    """Per (owner, shard) the evicted copy's buffer receives the next put of its size."""
    buffers = []
    for step in range(1, 7):
        data = bytes([step]) * 50_000
        send(store.endpoint, owner="m1", shard=0, step=step, generation=1, data=data,
             digest=digest(data))  # fmt: skip
        held = store.held("m1", 0, step)
        assert held is not None and held.data == data
        buffers.append(id(held.data))
        # Two copies kept, one spare buffer at most: never more than keep + 1 buffers.
        assert store.nbytes() <= 3 * 50_000
        assert store.held("m1", 0, step - 1) is not None if step > 1 else True
        assert store.held("m1", 0, step - 2) is None
    # From the fourth put on, each lands in the buffer the put before last evicted.
    assert buffers[3] == buffers[0] and buffers[4] == buffers[1] and buffers[5] == buffers[2]
    # A put of another size gets a fresh buffer; the older copies are intact throughout.
    other = b"z" * 1000
    send(store.endpoint, owner="m1", shard=0, step=7, generation=1, data=other,
         digest=digest(other))  # fmt: skip
    assert store.held("m1", 0, 6).data == bytes([6]) * 50_000
    assert fetch(store.endpoint, owner="m1", shard=0, step=7, expected=digest(other)) == other


def test_a_buffer_being_served_is_not_reused_by_a_put(store):
    """A get still streaming an evicted copy keeps its buffer from being received into."""
    first = b"a" * 1000
    send(store.endpoint, owner="m1", shard=0, step=1, generation=1, data=first,
         digest=digest(first))  # fmt: skip
    held = store.held("m1", 0, 1)
    assert held is not None
    with store._lock:
        store._serving[id(held.data)] = 1  # as _get marks it while it writes
    for step in (2, 3):  # step 1 is evicted while "served"
        data = bytes([step]) * 1000
        send(store.endpoint, owner="m1", shard=0, step=step, generation=1, data=data,
             digest=digest(data))  # fmt: skip
    assert held.data == first  # not overwritten
    assert all(store.held("m1", 0, s).data is not held.data for s in (2, 3))


def test_only_the_newest_steps_are_kept(store):
    for step in (10, 20, 30):
        data = bytes([step]) * 1000
        send(store.endpoint, owner="m2", shard=2, step=step, generation=1, data=data,
             digest=digest(data, "crc32"))  # fmt: skip
    assert store.held("m2", 2, 10) is None
    assert store.held("m2", 2, 20) is not None and store.held("m2", 2, 30) is not None
    assert store.nbytes() == 3000  # two copies and step 10's buffer, kept for the next put


def test_an_unreachable_peer_is_a_replication_error():
    peer = PeerStore()
    endpoint = peer.start()
    peer.close()
    with pytest.raises(ReplicationError, match="sending shard 3"):
        send(endpoint, owner="m", shard=3, step=1, generation=1, data=b"1", digest=digest(b"1"),
             timeout=2)  # fmt: skip


def test_copies_are_keyed_by_owner_and_a_get_prefers_the_recorded_digest(store):
    mine, theirs = b"a" * 64, b"b" * 64
    for owner, data in (("w1", mine), ("s0", theirs)):
        send(store.endpoint, owner=owner, shard=1, step=20, generation=1, data=data,
             digest=digest(data))  # fmt: skip
    assert store.held("w1", 1, 20).data == mine and store.held("s0", 1, 20).data == theirs
    for data in (mine, theirs):
        assert fetch(store.endpoint, owner=None, shard=1, step=20, expected=digest(data)) == data


# ---------------------------------------------------------------------- with the job's secret


def test_with_the_secret_a_copy_goes_and_comes_back(secure):
    data = os.urandom(1 << 20)
    send(secure.endpoint, owner="w0", shard=0, step=10, generation=1, data=data,
         digest=digest(data), secret=SECRET)  # fmt: skip
    back = fetch(secure.endpoint, owner="w0", shard=0, step=10, expected=digest(data),
                 secret=SECRET)  # fmt: skip
    assert back == data and secure.refused == 0


@pytest.mark.parametrize("secret", [None, OTHER], ids=["no-secret", "wrong-secret"])
def test_a_put_without_the_secret_is_refused_and_not_kept(secure, secret):
    data = b"forged weights"
    with pytest.raises(ReplicationError, match="unauthenticated"):
        send(secure.endpoint, owner="w0", shard=0, step=10, generation=1, data=data,
             digest=digest(data), secret=secret)  # fmt: skip
    assert secure.held("w0", 0, 10) is None and secure.nbytes() == 0
    assert secure.refused == 1


@pytest.mark.parametrize("secret", [None, OTHER], ids=["no-secret", "wrong-secret"])
def test_a_get_without_the_secret_is_refused_and_serves_no_byte(secure, secret):
    data = b"model and optimizer state" * 100
    send(secure.endpoint, owner="w0", shard=0, step=10, generation=1, data=data,
         digest=digest(data), secret=SECRET)  # fmt: skip
    with pytest.raises(ReplicationError, match="unauthenticated"):
        fetch(secure.endpoint, owner="w0", shard=0, step=10, secret=secret)
    # A raw client that ignores the answer: the connection carries no byte of the shard.
    host, port = secure.address
    with socket.create_connection((host, port), timeout=5) as sock:
        stream = sock.makefile("rwb")
        json.loads(stream.readline())
        request = {"op": "get", "owner": "w0", "shard": 0, "step": 10, "nonce": "00" * 16}
        stream.write(json.dumps(request).encode() + b"\n")
        stream.flush()
        sock.shutdown(socket.SHUT_WR)
        rest = stream.read()
    assert b"model" not in rest and b"unauthenticated" in rest


def _recorded_request(endpoint: str) -> tuple[dict[str, object], bytes]:
    """A get as an honest member sends it, captured on the wire by a man in the middle."""
    from rank_runtime import replication

    captured: dict[str, object] = {}
    real = replication._Session.request

    def spy(self, body, parts=()):  # type: ignore[no-untyped-def]
        real(self, body, parts)
        captured.update(
            {**body, "nonce": self.client_nonce.hex(),
             "mac": replication._mac(self.key, replication._REQUEST, self.server_nonce,
                                     replication._canonical({**body,
                                                             "nonce": self.client_nonce.hex()}))}
        )  # fmt: skip

    replication._Session.request = spy  # type: ignore[method-assign]
    try:
        data = fetch(endpoint, owner="w0", shard=0, step=10, secret=SECRET)
    finally:
        replication._Session.request = real  # type: ignore[method-assign]
    return captured, bytes(data)


def test_a_recorded_get_replayed_later_is_refused(secure):
    data = b"secret state" * 1000
    send(secure.endpoint, owner="w0", shard=0, step=10, generation=1, data=data,
         digest=digest(data), secret=SECRET)  # fmt: skip
    recorded, served = _recorded_request(secure.endpoint)
    assert served == data and recorded["mac"]
    host, port = secure.address
    with socket.create_connection((host, port), timeout=5) as sock:
        stream = sock.makefile("rwb")
        hello = json.loads(stream.readline())
        stream.write(json.dumps(recorded).encode() + b"\n")
        stream.flush()
        answer = json.loads(stream.readline())
        sock.shutdown(socket.SHUT_WR)
        rest = stream.read()
    assert hello["nonce"] != "" and answer["ok"] is False and "unauthenticated" in answer["error"]
    assert b"secret state" not in rest and secure.refused == 1


def test_tampered_bytes_in_a_put_are_refused_at_fetch(secure):
    """A man in the middle can change a put's bytes, not the digest the MAC binds them to: the
    holder keeps a copy that no fetch accepts (with verification on, it refuses it at once)."""
    data = b"A" * 4096
    send(secure.endpoint, owner="w0", shard=0, step=10, generation=1,
         data=b"B" + data[1:], digest=digest(data), secret=SECRET)  # fmt: skip
    held = secure.held("w0", 0, 10)
    assert held is not None and held.checksum == digest(data) and not held.verified
    with pytest.raises(DigestMismatch, match="its holder announced"):
        fetch(secure.endpoint, owner="w0", shard=0, step=10, expected=digest(data),
              secret=SECRET)  # fmt: skip
    secure.verify = True
    with pytest.raises(ReplicationError, match="digest"):
        send(secure.endpoint, owner="w0", shard=0, step=20, generation=1,
             data=b"B" + data[1:], digest=digest(data), secret=SECRET)  # fmt: skip
    assert secure.held("w0", 0, 20) is None


def test_a_put_s_claimed_digest_cannot_be_changed_without_the_secret(secure):
    """The digest a holder keeps a copy under is the owner's: a man in the middle who rewrites
    the header (to match forged bytes) breaks its MAC, and the put is refused."""
    from rank_runtime import replication

    forged = b"forged!" * 100
    real = replication._Session.request

    def rewrite(self, body, parts=(), abandoned=None):  # type: ignore[no-untyped-def]
        body = {**body, "nonce": self.client_nonce.hex()}
        body["mac"] = replication._mac(self.key, replication._REQUEST, self.server_nonce,
                                       replication._canonical(body))  # fmt: skip
        body["digest"] = digest(forged)  # changed after the owner's MAC
        self.sock.sendall(json.dumps(body).encode() + b"\n")
        self.sock.sendall(forged)

    replication._Session.request = rewrite  # type: ignore[method-assign]
    try:
        with pytest.raises(ReplicationError, match="unauthenticated"):
            send(secure.endpoint, owner="w0", shard=0, step=10, generation=1,
                 data=forged, digest=digest(b"genuine"), secret=SECRET)  # fmt: skip
    finally:
        replication._Session.request = real  # type: ignore[method-assign]
    assert secure.held("w0", 0, 10) is None and secure.refused == 1


def test_a_holder_serving_tampered_bytes_is_refused_even_with_a_valid_mac(secure):
    """An insider holder (it has the secret, so its answer's MAC is valid) forges the copy
    and announces the forged bytes' own digest: the fetcher checks the recorded digest."""
    data = b"genuine" * 1000
    send(secure.endpoint, owner="w0", shard=0, step=10, generation=1, data=data,
         digest=digest(data), secret=SECRET)  # fmt: skip
    secure.tamper = lambda raw: bytes(raw).replace(b"genuine", b"forged!")
    with pytest.raises(DigestMismatch, match="the control plane recorded"):
        fetch(secure.endpoint, owner="w0", shard=0, step=10, expected=digest(data),
              secret=SECRET)  # fmt: skip


def test_a_member_with_the_secret_refuses_a_store_that_does_not_authenticate(store):
    data = b"x" * 10
    with pytest.raises(ReplicationError, match="does not authenticate"):
        send(store.endpoint, owner="w0", shard=0, step=1, generation=1, data=data,
             digest=digest(data), secret=SECRET)  # fmt: skip
    assert store.held("w0", 0, 1) is None


def test_an_answer_without_a_valid_mac_is_refused(secure):
    """A store impersonating a holder (it lacks the secret) cannot feed a fetcher."""
    impostor = PeerStore(secret=OTHER)
    impostor.start()
    try:
        data = b"x" * 10
        send(impostor.endpoint, owner="w0", shard=0, step=1, generation=1, data=data,
             digest=digest(data), secret=OTHER)  # fmt: skip
        with pytest.raises(ReplicationError, match=r"unauthenticated|without a valid MAC"):
            fetch(impostor.endpoint, owner="w0", shard=0, step=1, secret=SECRET)
    finally:
        impostor.close()


def test_the_store_listens_only_where_configured():
    assert bind_address("10.1.2.3", {}) == "10.1.2.3"
    assert bind_address("10.1.2.3", {"ELASTIC_PEER_BIND": "0.0.0.0"}) == "0.0.0.0"
    peer = PeerStore(advertise="127.0.0.1")
    try:
        peer.start()
        assert peer.address[0] == "127.0.0.1"
    finally:
        peer.close()


# ---------------------------------------------------------------------- TLS (optional)


def _certificates(directory):
    """A CA and a certificate it signed for 127.0.0.1: (ca, cert, key) paths."""
    import datetime as dt
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = dt.datetime.now(dt.UTC)

    def build(subject, issuer, public_key, signer, *extensions):
        builder = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
            .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer)]))
            .public_key(public_key)
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + dt.timedelta(hours=1))
        )
        for extension, critical in extensions:
            builder = builder.add_extension(extension, critical=critical)
        return builder.sign(signer, hashes.SHA256())

    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca = build("test CA", "test CA", ca_key.public_key(), ca_key,
               (x509.BasicConstraints(ca=True, path_length=None), True))  # fmt: skip
    ip = x509.IPAddress(ipaddress.ip_address("127.0.0.1"))
    cert = build("peer", "test CA", key.public_key(), ca_key,
                 (x509.SubjectAlternativeName([ip]), False))  # fmt: skip
    paths = directory / "ca.crt", directory / "peer.crt", directory / "peer.key"
    paths[0].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths[1].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    paths[2].write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                           serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))  # fmt: skip
    return paths


def test_with_a_certificate_the_store_serves_tls_verified_against_the_ca(tmp_path):
    from rank_runtime.replication import client_tls, server_tls

    ca, cert, key = _certificates(tmp_path)
    assert server_tls({}) is None
    peer = PeerStore(secret=SECRET, tls=server_tls({"ELASTIC_TLS_CERT": str(cert),
                                                    "ELASTIC_TLS_KEY": str(key)}))  # fmt: skip
    try:
        endpoint = peer.start()
        assert endpoint.startswith("tls://127.0.0.1:")
        data = os.urandom(3 << 20)
        trusted = client_tls(str(ca))
        send(endpoint, owner="w0", shard=0, step=10, generation=1, data=data,
             digest=digest(data), secret=SECRET, tls=trusted)  # fmt: skip
        assert fetch(endpoint, owner="w0", shard=0, step=10, expected=digest(data),
                     secret=SECRET, tls=trusted) == data  # fmt: skip
        # Not verified against the CA (the system's CAs do not know it): refused.
        with pytest.raises(ReplicationError, match="CERTIFICATE_VERIFY_FAILED"):
            fetch(endpoint, owner="w0", shard=0, step=10, secret=SECRET, tls=client_tls(None))
        # A plain client gets no byte of it either.
        host, port = peer.address
        with pytest.raises(ReplicationError):
            fetch(f"{host}:{port}", owner="w0", shard=0, step=10, secret=SECRET, timeout=3)
    finally:
        peer.close()


def test_a_forging_holder_s_copy_decodes_with_a_valid_crc32_but_not_the_digest():
    """``tamper@serve``: the forgery is a well-formed snapshot (crc32 is no defence); only the
    recorded digest tells it from the genuine copy."""
    import torch

    from rank_runtime import faults
    from rank_runtime.snapshot import HotSnapshot, from_bytes

    assert str(faults.parse("tamper@serve:rank=0")) == "tamper@serve:rank=0"
    assert faults.tampers(faults.from_env({"ELASTIC_FAULTS": "tamper@serve:rank=2"}), 2)
    with pytest.raises(faults.FaultSpecError, match="tamper@serve"):
        faults.parse("tamper@10:rank=0")
    hot = HotSnapshot()
    hot.take(20, {"w": torch.ones(4), "step": torch.tensor([20])})
    genuine = hot.to_bytes(20)
    forged = faults.forge(genuine)
    restored = from_bytes(forged)  # decodes: its checksum trailer is valid
    assert torch.equal(restored.state["w"], torch.full((4,), faults.FORGE_FACTOR))
    assert torch.equal(restored.state["step"], torch.tensor([20]))
    assert digest(forged) != digest(genuine)


def test_a_copy_fetched_into_a_decoder_lands_in_its_tensors_and_a_forgery_is_refused(store):
    """``fetch_into``: the socket reads the data region straight into the tensors a decoder
    makes (no buffer of the whole copy); the state is the one ``fetch`` + ``from_bytes`` give,
    and a forged copy is refused by its digest after the bytes have gone in."""
    import torch

    from rank_runtime import faults
    from rank_runtime.snapshot import HotSnapshot, SnapshotDecoder, from_bytes

    hot = HotSnapshot()
    hot.take(20, {"w": torch.randn(3000, 700), "b": torch.arange(5), "step": 20})
    genuine = hot.to_bytes(20)
    send(store.endpoint, owner="m1", shard=0, step=20, generation=1, data=genuine,
         digest=digest(genuine))  # fmt: skip
    sizes: list[int] = []
    decoder = SnapshotDecoder(trusted=True)

    def into(size: int) -> SnapshotDecoder:
        sizes.append(size)
        return decoder

    size = fetch_into(store.endpoint, into, owner=None, shard=0, step=20,
                      expected=digest(genuine))  # fmt: skip
    assert size == len(genuine) and sizes == [size]
    restored = decoder.finish().state
    expected = from_bytes(genuine).state
    assert torch.equal(restored["w"], expected["w"]) and torch.equal(restored["b"], expected["b"])
    assert restored["step"] == 20
    forged = faults.forge(genuine)
    send(store.endpoint, owner="m2", shard=1, step=20, generation=1, data=forged,
         digest=digest(genuine))  # fmt: skip
    with pytest.raises(DigestMismatch):
        fetch_into(store.endpoint, lambda _: SnapshotDecoder(trusted=True), owner="m2",
                   shard=1, step=20, expected=digest(genuine))  # fmt: skip


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a thread's own priority")
def test_background_priority_lowers_only_the_calling_thread(monkeypatch):
    import threading

    from rank_runtime.replication import background_priority

    seen: dict[str, object] = {}

    def lowered() -> None:
        tid = threading.get_native_id()
        before = os.getpriority(os.PRIO_PROCESS, tid)
        seen["done"] = background_priority(3)
        seen["change"] = os.getpriority(os.PRIO_PROCESS, tid) - before

    main_before = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    thread = threading.Thread(target=lowered)
    thread.start()
    thread.join()
    assert seen == {"done": True, "change": min(3, 19 - main_before)}
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == main_before
    monkeypatch.setenv("ELASTIC_REPLICATION_NICE", "0")
    assert background_priority() is False


def test_a_large_copy_is_hashed_on_another_thread_while_it_arrives_and_checked_all_the_same(
    store, monkeypatch
):
    """From ``_BEHIND_MIN`` bytes on, the fetcher hashes each part on a thread of its own
    while the next one is received: the state is the one sent, every byte was hashed (in
    order: the digest matches), and a forged copy is still refused."""
    import threading

    import torch

    from rank_runtime import faults, replication
    from rank_runtime.snapshot import HotSnapshot, SnapshotDecoder

    threads: set[str] = set()
    real = replication.hasher

    class Recording:
        def __init__(self, algorithm: str) -> None:
            self._inner = real(algorithm)

        def update(self, data) -> None:  # type: ignore[no-untyped-def]
            threads.add(threading.current_thread().name)
            self._inner.update(data)

        def hexdigest(self) -> str:
            return self._inner.hexdigest()

    hot = HotSnapshot()
    big = torch.randn(replication._BEHIND_MIN // 4 + 12345)
    hot.take(20, {"w": big, "small": torch.arange(7), "step": 20})
    genuine = hot.to_bytes(20)
    send(store.endpoint, owner="m1", shard=0, step=20, generation=1, data=genuine,
         digest=digest(genuine))  # fmt: skip
    expected = digest(genuine)
    monkeypatch.setattr(replication, "hasher", Recording)
    decoder = SnapshotDecoder(trusted=True)
    fetch_into(store.endpoint, lambda _: decoder, owner=None, shard=0, step=20,
               expected=expected)  # fmt: skip
    assert threads == {"elastic-digest"}
    monkeypatch.undo()
    restored = decoder.finish().state
    assert torch.equal(restored["w"], big) and torch.equal(restored["small"], torch.arange(7))
    forged = faults.forge(genuine)
    send(store.endpoint, owner="m2", shard=1, step=20, generation=1, data=forged,
         digest=digest(genuine))  # fmt: skip
    with pytest.raises(DigestMismatch):
        fetch_into(store.endpoint, lambda _: SnapshotDecoder(trusted=True), owner="m2",
                   shard=1, step=20, expected=digest(genuine))  # fmt: skip


def _deaf_holder() -> tuple[socket.socket, list[socket.socket]]:
    """A peer that greets as a store and then never reads: a send to it blocks."""
    import threading

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    accepted: list[socket.socket] = []

    def serve() -> None:
        conn, _ = server.accept()
        accepted.append(conn)
        conn.sendall(json.dumps({"peer": 2, "nonce": "00" * 16, "auth": False}).encode() + b"\n")

    threading.Thread(target=serve, daemon=True).start()
    return server, accepted


def test_an_abandoned_send_ends_midway_even_when_the_holder_stops_reading():
    """``Abandon.set`` from another thread ends a send blocked on a holder that does not read
    (its connection is shut down): ``Abandoned``, long before the socket's timeout."""
    import threading
    import time

    from rank_runtime.replication import Abandon, Abandoned

    server, accepted = _deaf_holder()
    abandon = Abandon()
    outcome: list[BaseException] = []

    def sending() -> None:
        try:
            send(f"127.0.0.1:{server.getsockname()[1]}", owner="m1", shard=0, step=10,
                 generation=1, data=bytes(64 * 1024 * 1024), digest="sha256:" + "0" * 64,
                 timeout=60.0, abandon=abandon)  # fmt: skip
        except BaseException as exc:
            outcome.append(exc)

    thread = threading.Thread(target=sending)
    thread.start()
    deadline = time.monotonic() + 10
    while not accepted and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.2)  # blocked in sendall by now: the holder reads nothing
    assert thread.is_alive()
    abandon.set()
    thread.join(10)
    server.close()
    for conn in accepted:
        conn.close()
    assert not thread.is_alive() and len(outcome) == 1
    assert isinstance(outcome[0], Abandoned)
    with pytest.raises(Abandoned):  # still set: the next send does not even connect
        send("127.0.0.1:1", owner="m1", shard=0, step=10, generation=1, data=b"x",
             digest="sha256:" + "0" * 64, abandon=abandon)  # fmt: skip
    abandon.clear()
    with pytest.raises(ReplicationError) as refused:  # cleared: sends are attempted again
        send("127.0.0.1:1", owner="m1", shard=0, step=10, generation=1, data=b"x",
             digest="sha256:" + "0" * 64, abandon=abandon)  # fmt: skip
    assert not isinstance(refused.value, Abandoned)


def test_members_on_hosts_that_do_not_answer_are_named_and_those_that_refuse_are_not(caplog):
    """After a failed collective a member probes its peers' hosts: one that accepts the
    connection, and one that refuses it (its kernel answered; its process may be gone), are
    reachable; one that does not answer at all (a partition drops what is sent to it) is named,
    with every member on it. This member's own host is never probed. A probe is no request: the
    store it reaches logs nothing."""
    from rank_runtime.replication import unreachable

    listening = socket.create_server(("127.0.0.2", 0))
    closed = socket.create_server(("127.0.0.3", 0))
    refusing = closed.getsockname()[1]
    closed.close()
    # A host that drops what it is sent: a listener whose queue of connections is full
    # (Linux then drops a new connection's SYN, as a partition does, and the connect times
    # out).
    silent = socket.socket()
    silent.bind(("127.0.0.5", 0))
    silent.listen(0)
    cut = silent.getsockname()[1]
    filling = socket.create_connection(("127.0.0.5", cut), timeout=2)
    peer = PeerStore(advertise="127.0.0.4")
    try:
        endpoints = {
            "me": "127.0.0.1:1",
            "beside-me": "127.0.0.1:2",  # (nothing there: never probed)
            "up": f"127.0.0.2:{listening.getsockname()[1]}",
            "refusing": f"127.0.0.3:{refusing}",
            "store": peer.start(),
            "cut-a": f"127.0.0.5:{cut}",
            "cut-b": "127.0.0.5:1",
        }
        with caplog.at_level("WARNING", logger="rank_runtime.replication"):
            assert unreachable(endpoints, "me", timeout_s=0.5) == ["cut-a", "cut-b"]
            time.sleep(0.3)  # (the store's handler of the probe runs on a thread of its own)
        assert not caplog.records, caplog.records
    finally:
        for sock in (listening, filling, silent):
            sock.close()
        peer.close()


def test_each_host_is_probed_by_as_many_others_however_large_the_world(monkeypatch):
    """Every member probes at most ``hosts`` hosts: those after its own in sorted order,
    wrapping around; so each host is probed by that many others, and a world of thousands
    of hosts costs each member a few connections."""
    from rank_runtime import replication

    probed: dict[str, list[str]] = {}
    me = [""]

    def answers(endpoint: str, timeout_s: float) -> bool:
        probed.setdefault(endpoint.rpartition(":")[0], []).append(me[0])
        return True

    monkeypatch.setattr(replication, "_answers", answers)
    hosts = [f"10.0.{i // 250}.{i % 250}" for i in range(40)]
    endpoints = {f"m{i}-{j}": f"{h}:{29500 + j}" for i, h in enumerate(hosts) for j in range(2)}
    for member in endpoints:
        me[0] = member
        assert replication.unreachable(endpoints, member, hosts=3) == []
    assert sorted(probed) == sorted(hosts)
    # Each host: by both members of each of the 3 hosts before it (one probe a host each).
    assert all(len(by) == 6 for by in probed.values()), probed
    assert all(not by.startswith(f"m{i}-") for i, h in enumerate(hosts) for by in probed[h])
