"""A survivor restores its own shard from its hot snapshot without reading its bytes again:
when the slot still holds what its cached digest names (the replicator digested it once),
nothing is hashed, serialized or decoded, and what it gets is a copy, not the slot's memory."""

from __future__ import annotations

import pytest
import torch

from rank_runtime import elastic as elastic_module
from rank_runtime import snapshot as snapshot_module
from tests.unit.test_restore_member import command, member


def _no_hashing(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*_args: object, **_kwargs: object) -> None:
        raise AssertionError("a byte was hashed")

    monkeypatch.setattr(snapshot_module, "_hasher", refuse)
    monkeypatch.setattr(elastic_module, "digest", refuse)


def test_own_memory_digested_once_is_restored_with_no_hashing_and_as_a_copy(monkeypatch):
    survivor = member(monkeypatch, "w1", 1, own=3.0)
    reported = survivor.hot.stream_digest(20)  # what replicating it computed and cached
    size = survivor.hot.nbytes(20)
    _no_hashing(monkeypatch)
    shards, nbytes, sources = survivor._restore(command(["w0", "w1"], ["sha256:00", reported], {}))
    assert torch.equal(shards[1]["w"], torch.full((8,), 3.0)) and sources == {"1": "w1"}
    assert nbytes == size
    shards[1]["w"].fill_(9.0)  # a copy: the snapshot keeps what it took
    assert torch.equal(survivor.hot.get(20).state["w"], torch.full((8,), 3.0))


def test_another_digest_than_the_cached_one_goes_through_the_verifying_path(monkeypatch):
    survivor = member(monkeypatch, "w1", 1, own=3.0)
    survivor.hot.stream_digest(20)
    with pytest.raises(elastic_module._RefusedCopy) as info:
        survivor._restore(command(["w0", "w1"], ["sha256:00", "sha256:" + "0" * 64], {}))
    assert (info.value.shard, info.value.source) == (1, "w1")
