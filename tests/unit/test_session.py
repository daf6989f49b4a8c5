"""Which errors the loop integration takes for a lost peer (``is_peer_failure``)."""

from __future__ import annotations

import torch.distributed as dist

from rank_runtime.elastic import GenerationSuperseded
from rank_runtime.session import is_peer_failure
from schemas.commands import Reallocate

# What gloo raised here when a peer was killed mid-collective (torch 2.13, CPU).
GLOO_CLOSED = (
    "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed"
    " by peer [127.0.0.1]:21735. This is typically caused by a remote worker crashing."
)
GLOO_TIMEOUT = (
    "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out"
    " waiting 60000ms for recv operation to complete"
)


def test_collective_errors_are_peer_failures() -> None:
    assert is_peer_failure(RuntimeError(GLOO_CLOSED))
    assert is_peer_failure(RuntimeError(GLOO_TIMEOUT))
    assert is_peer_failure(dist.DistBackendError("NCCL communicator was aborted"))
    assert is_peer_failure(dist.DistNetworkError("connect() timed out"))
    assert is_peer_failure(dist.DistStoreError("wait timeout"))


def test_the_runtimes_own_supersession_is_a_peer_failure() -> None:
    command = Reallocate.model_construct(generation=3)
    assert is_peer_failure(GenerationSuperseded(command))


def test_errors_of_the_loop_are_not() -> None:
    assert not is_peer_failure(ValueError("bad batch"))
    assert not is_peer_failure(
        RuntimeError("mat1 and mat2 shapes cannot be multiplied (2x4 and 5x1)")
    )
    assert not is_peer_failure(RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert not is_peer_failure(KeyError("loss"))


def test_a_peer_failure_behind_another_error_counts() -> None:
    try:
        try:
            raise RuntimeError(GLOO_CLOSED)
        except RuntimeError as inner:
            raise ValueError("while reducing the loss") from inner
    except ValueError as outer:
        assert is_peer_failure(outer)
