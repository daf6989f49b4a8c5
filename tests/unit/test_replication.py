"""Peer replication over loopback TCP: verified before kept, served back, bounded memory."""

from __future__ import annotations

import pytest

from rank_runtime.replication import (
    Held,
    PeerStore,
    ReplicationError,
    checksum,
    fetch,
    send,
)


@pytest.fixture
def store():
    peer = PeerStore()
    peer.start()
    yield peer
    peer.close()


def test_a_copy_is_kept_reported_and_served_back(store):
    seen: list[Held] = []
    store.on_held = lambda copy, seconds: seen.append(copy)
    data = b"x" * 100_000
    send(store.endpoint, owner="m1", shard=1, step=10, generation=2, data=data,
         digest=checksum(data))  # fmt: skip
    assert [(c.owner, c.shard, c.step, c.generation) for c in seen] == [("m1", 1, 10, 2)]
    assert fetch(store.endpoint, owner="m1", shard=1, step=10) == data


def test_a_corrupt_copy_is_refused_and_not_kept(store):
    data = b"payload"
    with pytest.raises(ReplicationError, match="checksum"):
        send(store.endpoint, owner="m1", shard=0, step=5, generation=1, data=data,
             digest=checksum(b"other"))  # fmt: skip
    assert store.held("m1", 0, 5) is None
    with pytest.raises(ReplicationError, match="no shard 0"):
        fetch(store.endpoint, owner="m1", shard=0, step=5)


def test_only_the_newest_steps_are_kept(store):
    for step in (10, 20, 30):
        data = bytes([step]) * 1000
        send(store.endpoint, owner="m2", shard=2, step=step, generation=1, data=data,
             digest=checksum(data))  # fmt: skip
    assert store.held("m2", 2, 10) is None
    assert store.held("m2", 2, 20) is not None and store.held("m2", 2, 30) is not None
    assert store.nbytes() == 2000


def test_an_unreachable_peer_is_a_replication_error():
    peer = PeerStore()
    endpoint = peer.start()
    peer.close()
    with pytest.raises(ReplicationError, match="sending shard 3"):
        send(endpoint, owner="m", shard=3, step=1, generation=1, data=b"1", digest=checksum(b"1"),
             timeout=2)  # fmt: skip
