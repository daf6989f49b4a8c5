"""Which errors the loop integration takes for a lost peer (``is_peer_failure``), and the
compute time it measures apart from the wait for slower peers."""

from __future__ import annotations

import os
import time
from typing import Any

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


# --------------------------------------------------------------------------- compute time


def _timed_rank(rank: int, store: str, out: Any) -> None:
    """One of two gloo ranks: rank 1 sleeps 0.2 s before its forward (a slow device); each
    reports when its last gradient was ready and when its backward ended (DDP's wait)."""
    import torch
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel

    from rank_runtime.session import Parts

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 1))
        model = DistributedDataParallel(net)
        parts = Parts(model, torch.optim.SGD(net.parameters(), lr=0.1))
        x = torch.randn(32, 16)
        for _ in range(3):  # the first two rebuild DDP's buckets (a collective in forward)
            parts.grads_ready = None
            started = time.perf_counter()
            if rank == 1:
                time.sleep(0.2)
            model(x).sum().backward()
            ended = time.perf_counter()
        assert parts.grads_ready is not None
        out.put((rank, parts.grads_ready - started, ended - started))
        # Both ranks done with the group before either leaves.
        dist.barrier()
    except BaseException:
        dist.destroy_process_group()
        raise
    # The group goes with the process (as in test_group.py): tearing gloo's pairs down while
    # the other rank's threads still use them can abort it ("terminate called without an
    # active exception"), even after the barrier. The SimpleQueue's put is written already.
    os._exit(0)


def test_a_rank_s_compute_time_leaves_out_its_wait_for_a_slower_peer(tmp_path) -> None:
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    out = ctx.SimpleQueue()
    procs = [
        ctx.Process(target=_timed_rank, args=(r, str(tmp_path / "store"), out)) for r in (0, 1)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    timed = {rank: (compute, step) for rank, compute, step in (out.get(), out.get())}
    # Both backwards end together (rank 0 waits in DDP's all-reduce for rank 1) ...
    assert timed[0][1] > 0.15 and timed[1][1] > 0.15
    # ... but only the slow rank computed for that long.
    assert timed[1][0] > 0.15 and timed[0][0] < 0.1, timed
