"""Peer replication over loopback TCP: verified before kept, served back, bounded memory, and
with the job's secret authenticated both ways (no secret, a wrong one, a replayed request,
tampered bytes: refused)."""

from __future__ import annotations

import json
import os
import socket

import pytest

from rank_runtime.replication import (
    DigestMismatch,
    Held,
    PeerStore,
    ReplicationError,
    bind_address,
    digest,
    fetch,
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


def test_a_copy_is_kept_reported_and_served_back(store):
    seen: list[Held] = []
    store.on_held = lambda copy, seconds: seen.append(copy)
    data = b"x" * 100_000
    send(store.endpoint, owner="m1", shard=1, step=10, generation=2, data=data,
         digest=digest(data))  # fmt: skip
    assert [(c.owner, c.shard, c.step, c.generation) for c in seen] == [("m1", 1, 10, 2)]
    assert seen[0].checksum == digest(data) and seen[0].checksum.startswith("sha256:")
    assert fetch(store.endpoint, owner="m1", shard=1, step=10) == data


def test_a_corrupt_copy_is_refused_and_not_kept(store):
    data = b"payload"
    with pytest.raises(ReplicationError, match="digest"):
        send(store.endpoint, owner="m1", shard=0, step=5, generation=1, data=data,
             digest=digest(b"other"))  # fmt: skip
    assert store.held("m1", 0, 5) is None
    with pytest.raises(ReplicationError, match="no shard 0"):
        fetch(store.endpoint, owner="m1", shard=0, step=5)


def test_only_the_newest_steps_are_kept(store):
    for step in (10, 20, 30):
        data = bytes([step]) * 1000
        send(store.endpoint, owner="m2", shard=2, step=step, generation=1, data=data,
             digest=digest(data, "crc32"))  # fmt: skip
    assert store.held("m2", 2, 10) is None
    assert store.held("m2", 2, 20) is not None and store.held("m2", 2, 30) is not None
    assert store.nbytes() == 2000


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

    def spy(self, body, data=b""):  # type: ignore[no-untyped-def]
        real(self, body, data)
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


def test_tampered_bytes_in_a_put_are_refused(secure):
    """A man in the middle cannot change the bytes: the MAC binds their digest."""
    data = b"A" * 4096
    with pytest.raises(ReplicationError, match="digest"):
        send(secure.endpoint, owner="w0", shard=0, step=10, generation=1,
             data=b"B" + data[1:], digest=digest(data), secret=SECRET)  # fmt: skip
    assert secure.held("w0", 0, 10) is None


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
