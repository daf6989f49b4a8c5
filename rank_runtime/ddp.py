"""Make a DDP built after a recovery reduce gradients exactly as the fault-free run's did.

A freshly built ``DistributedDataParallel`` lays its gradient buckets out in the module's
parameter order for its first backward, then rebuilds them once in the order the gradients
became ready (``Reducer._rebuild_buckets``). A bucket is all-reduced as one flat tensor cut into
chunks, and the order in which the ranks' values of an element are added depends on the chunk
the element falls in: the layout decides it. In a fault-free run only step 1 sees the first
layout; a DDP rebuilt on the new group after a recovery sees it again at the first step it
replays. The sums differ in their last bits there, and the run drifts from the fault-free one
by a few ulps (4e-8 on the example's weights after 20 steps).

``prime_buckets`` spends that first layout on a backward of zero: every rank runs it on the new
group (it is collective, like building DDP), the gradients it leaves are dropped, and the next
forward rebuilds the buckets into their steady order. Prime every DDP a job builds, at the start
as after each recovery, and every real step of every run reduces with the same layout: a run
that replaces a rank restores and then continues bit for bit as the fault-free run of the same
seed (``tests/e2e/test_recovery.py``). It costs one forward and backward of whatever input the
caller passes (one sample is enough). After a shrink the world and its shards differ, so the
sums do too: that run ends near the fault-free one, not on it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.nn.parallel import DistributedDataParallel


def prime_buckets(
    model: DistributedDataParallel, forward: Callable[[DistributedDataParallel], torch.Tensor]
) -> None:
    """Run one backward of zero through ``model`` so that its next forward rebuilds its
    gradient buckets; ``forward(model)`` computes any output of the model (a sample's loss).

    Collective: every rank of the group calls it, right after building ``model``. Leaves no
    trace in the training state: the random number generators are forked around the forward
    (dropout draws nothing from the run's stream), the module's buffers (batch-norm
    statistics) are put back, and the gradients are dropped.
    """
    module = model.module
    buffers = [(b, b.detach().clone()) for b in module.buffers()]
    devices = sorted({t.device.index or 0 for t in module.parameters() if t.device.type == "cuda"})
    with torch.random.fork_rng(devices=devices):
        output = forward(model)
        torch.autograd.backward(output.sum() * 0)
    with torch.no_grad():
        for buffer, saved in buffers:
            buffer.copy_(saved)
    module.zero_grad(set_to_none=True)


__all__ = ["prime_buckets"]
