"""Priming a freshly built DDP: its real steps reduce in the steady bucket layout, and the
priming leaves nothing behind (gradients, buffers, random streams)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from rank_runtime.ddp import prime_buckets


@pytest.fixture
def group() -> Iterator[None]:
    """A one-rank gloo group in this process (DDP still buckets and all-reduces)."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Dropout(0.5), nn.Linear(8, 1))


def _layouts(model: DistributedDataParallel) -> list[list[tuple[int, ...]]]:
    """Record each all-reduced bucket's parameters (by shape), in the bucket's order."""
    seen: list[list[tuple[int, ...]]] = []

    # No annotations: DDP checks them as objects, and this module's are strings.
    def hook(state, bucket):  # type: ignore[no-untyped-def]
        seen.append([tuple(p.shape) for p in bucket.parameters()])
        work = dist.all_reduce(bucket.buffer(), async_op=True)
        assert work is not None
        return work.get_future().then(lambda f: f.value()[0])

    model.register_comm_hook(None, hook)
    return seen


def _step(model: DistributedDataParallel, x: torch.Tensor) -> None:
    model(x).square().sum().backward()
    model.module.zero_grad(set_to_none=True)


@pytest.mark.usefixtures("group")
def test_a_primed_ddp_reduces_every_real_step_in_the_steady_layout():
    x = torch.randn(16, 4)
    plain = DistributedDataParallel(_net())
    plain_layouts = _layouts(plain)
    for _ in range(3):
        _step(plain, x)
    first, *steady = plain_layouts
    assert steady[0] == steady[1] != first, "the first step's layout is the one to avoid"

    primed = DistributedDataParallel(_net())
    primed_layouts = _layouts(primed)
    prime_buckets(primed, lambda ddp: ddp(x[:2]))
    assert primed_layouts == [first]  # the priming backward spent it
    for _ in range(3):
        _step(primed, x)
    assert primed_layouts[1:] == [steady[0]] * 3


@pytest.mark.usefixtures("group")
def test_priming_leaves_no_gradient_buffer_change_or_random_draw():
    net = _net()
    model = DistributedDataParallel(net)
    buffers = {n: b.clone() for n, b in net.named_buffers()}
    params = {n: p.detach().clone() for n, p in net.named_parameters()}
    rng = torch.get_rng_state()
    prime_buckets(model, lambda ddp: ddp(torch.randn(8, 4) + 3))  # moves batch-norm statistics
    assert torch.equal(torch.get_rng_state(), rng)  # the forward's randn and dropout: forked
    for name, value in net.named_buffers():
        assert torch.equal(value, buffers[name]), name
    for name, param in net.named_parameters():
        assert param.grad is None, name
        assert torch.equal(param.detach(), params[name]), name
