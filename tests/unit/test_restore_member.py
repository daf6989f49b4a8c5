"""A member's restore checks every copy against the digest the command carries: the plan's
holder over loopback (a real peer store) and its own memory. No bus: ``_restore`` is called
on an ``Elastic`` whose world is set by hand."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime

import pytest
import torch

from rank_runtime import elastic as elastic_module
from rank_runtime.elastic import Elastic, World
from rank_runtime.identity import Identity
from rank_runtime.replication import PeerStore, digest, send
from rank_runtime.snapshot import HotSnapshot
from schemas.commands import Reallocate
from schemas.common import ReallocationMode, RestoreFrom, Role

SECRET = bytes(range(32))


def shard_bytes(value: float, step: int = 20) -> bytes:
    hot = HotSnapshot()
    hot.take(step, {"w": torch.full((8,), value)})
    return hot.to_bytes(step)


@pytest.fixture
def holder():
    store = PeerStore(secret=SECRET)
    store.start()
    yield store
    store.close()


def member(monkeypatch: pytest.MonkeyPatch, name: str, rank: int, own: float | None) -> Elastic:
    monkeypatch.setenv("ELASTIC_JOB_SECRET", SECRET.hex())
    identity = Identity("job1", f"node-{name}", "rack0", name, Role.WORKER, "nats://unused:1")
    elastic = Elastic(identity)
    elastic.world = World(2, rank, 2, ("w0", name), ((), ()), {}, "x")
    if own is not None:  # this member took the step-20 backup of its shard ``rank``
        elastic.hot.take(20, {"w": torch.full((8,), own)})
        elastic._backup_shard = rank
    return elastic


def command(plan: list[str], digests: list[str], endpoints: dict[str, str]) -> Reallocate:
    return Reallocate(
        command_id=uuid.uuid4(), job_id="job1", decision_position=1,
        issued_at=datetime.now(UTC), generation=3, world=["w0", plan[1]],
        rendezvous="x", endpoints=endpoints, incident_id=uuid.uuid4(),
        mode=ReallocationMode.REPLACE, restore_step=20, restore_from=RestoreFrom.MEMORY,
        plan=plan, digests=digests,
    )  # fmt: skip


def put(holder: PeerStore, data: bytes) -> None:
    send(holder.endpoint, owner="w1", shard=1, step=20, generation=2, data=data,
         digest=digest(data), secret=SECRET)  # fmt: skip


def test_a_copy_from_the_plan_s_holder_that_matches_its_digest_is_restored(monkeypatch, holder):
    genuine = shard_bytes(1.0)
    put(holder, genuine)
    spare = member(monkeypatch, "s0", 1, own=None)
    shards, nbytes, sources = spare._restore(
        command(["w0", "h"], ["sha256:00", digest(genuine)], {"h": holder.endpoint})
    )
    assert torch.equal(shards[1]["w"], torch.ones(8)) and sources == {"1": "h"}
    assert nbytes == len(genuine)


def test_a_forged_copy_with_a_valid_crc32_is_refused_naming_its_holder(monkeypatch, holder):
    genuine, forged = shard_bytes(1.0), shard_bytes(50.0)  # both well-formed snapshots
    put(holder, genuine)
    holder.tamper = lambda data: forged
    spare = member(monkeypatch, "s0", 1, own=None)
    with pytest.raises(elastic_module._RefusedCopy, match="the control plane recorded") as info:
        spare._restore(command(["w0", "h"], ["sha256:00", digest(genuine)],
                               {"h": holder.endpoint}))  # fmt: skip
    assert (info.value.shard, info.value.source) == (1, "h")


def test_own_memory_that_does_not_match_is_replaced_by_the_plan_s_copy(monkeypatch, holder):
    genuine = shard_bytes(1.0)
    put(holder, genuine)
    survivor = member(monkeypatch, "w1", 1, own=7.0)  # its memory is not what it reported
    shards, _, sources = survivor._restore(
        command(["w0", "h"], ["sha256:00", digest(genuine)], {"h": holder.endpoint})
    )
    assert torch.equal(shards[1]["w"], torch.ones(8)) and sources == {"1": "h"}
    # When the plan's source is its own memory, the restore is refused, naming itself.
    with pytest.raises(elastic_module._RefusedCopy) as info:
        survivor._restore(command(["w0", "w1"], ["sha256:00", digest(genuine)], {}))
    assert (info.value.shard, info.value.source) == (1, "w1")


def test_own_memory_that_matches_is_used_without_a_transfer(monkeypatch):
    survivor = member(monkeypatch, "w1", 1, own=3.0)
    mine = survivor.hot.to_bytes(20)
    shards, _, sources = survivor._restore(command(["w0", "w1"], ["sha256:00", digest(mine)], {}))
    assert torch.equal(shards[1]["w"], torch.full((8,), 3.0)) and sources == {"1": "w1"}


def test_a_copy_corrupted_on_its_way_to_a_holder_is_refused_and_another_copy_restored(
    monkeypatch, holder
):
    """A holder does not hash what it receives (``ELASTIC_PEER_VERIFY`` off): a put whose
    bytes changed in transit is kept under the owner's digest. The restore refuses it, naming
    that holder (the control plane re-plans around it); the re-plan's other holder's genuine
    copy is restored."""
    assert not holder.verify
    genuine = shard_bytes(1.0)
    broken = bytearray(genuine)
    broken[-100] ^= 0xFF  # a flipped bit in the tensor bytes, after the owner's digest
    send(holder.endpoint, owner="w1", shard=1, step=20, generation=2, data=broken,
         digest=digest(genuine), secret=SECRET)  # fmt: skip
    assert holder.held("w1", 1, 20) is not None  # kept, unverified
    other = PeerStore(secret=SECRET)
    other.start()
    try:
        put(other, genuine)
        spare = member(monkeypatch, "s0", 1, own=None)
        endpoints = {"h": holder.endpoint, "g": other.endpoint}
        with pytest.raises(elastic_module._RefusedCopy, match="hashes to") as info:
            spare._restore(command(["w0", "h"], ["sha256:00", digest(genuine)], endpoints))
        assert (info.value.shard, info.value.source) == (1, "h")
        shards, _, sources = spare._restore(
            command(["w0", "g"], ["sha256:00", digest(genuine)], endpoints)
        )
        assert torch.equal(shards[1]["w"], torch.ones(8)) and sources == {"1": "g"}
    finally:
        other.close()


def test_a_holder_without_the_copy_is_refused_by_name_and_without_digests_its_own_is_restored(
    monkeypatch, holder
):
    """A plan's holder that answers it holds no such copy (it never got it, or evicted it)
    is named, with the shard, as a refused copy is: the control plane plans around it. A
    plan whose digests were never all recorded (a lost owner's unreported shard) comes with
    none: each copy is checked against the digest its holder keeps it under."""
    spare = member(monkeypatch, "s0", 1, own=None)
    with pytest.raises(elastic_module._RefusedCopy, match="not held") as info:
        spare._restore(command(["w0", "h"], [], {"h": holder.endpoint}))
    assert (info.value.shard, info.value.source) == (1, "h")
    genuine = shard_bytes(1.0)
    put(holder, genuine)
    shards, _, sources = spare._restore(command(["w0", "h"], [], {"h": holder.endpoint}))
    assert torch.equal(shards[1]["w"], torch.ones(8)) and sources == {"1": "h"}
