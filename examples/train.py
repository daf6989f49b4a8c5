"""A small elastic training job: DDP + ZeroRedundancyOptimizer on gloo, CPU, no downloads.

Run it under the launcher (a control plane must be serving)::

    elasticctl run --nproc 4 --spares 1 --nodes 4 --racks 2 examples/train.py --steps 60

The data is a synthetic regression problem generated from a seed; the global batch of each
step is a function of the step (``StepSampler``), split over whatever world exists, so every
world size sees the same samples at the same step. The loop is made elastic by
``rank_runtime.session.Session``: every ``backup_interval`` steps each rank backs up to its
peers what only it has (its ZeRO optimizer shard, its RNG and data position); the model, the
same on every rank, stays in its own memory, and a survivor hands it to a newcomer.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel

from rank_runtime.data import StepSampler, synthetic_regression
from rank_runtime.ddp import prime_buckets
from rank_runtime.elastic import World
from rank_runtime.session import Session


def step_list(text: str) -> list[int]:
    """``25,31-33`` -> [25, 31, 32, 33]."""
    out: list[int] = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        first, _, last = part.partition("-")
        out.extend(range(int(first), int(last or first) + 1))
    return out


def arguments(description: str | None) -> argparse.ArgumentParser:
    """The model, data and run options (shared with ``train_torchrun.py``, the baseline)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--global-batch", type=int, default=64)
    parser.add_argument("--features", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--samples", type=int, default=4096)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="", help="rank 0 saves the final parameters here")
    parser.add_argument(
        "--skip-steps",
        type=step_list,
        default=[],
        help="steps whose batches the run skips, e.g. 25,31-33 (a fault-free run that skips"
        " what a rollback skipped)",
    )
    parser.add_argument(
        "--step-time",
        type=float,
        default=0.0,
        help="seconds each forward pass waits, a stand-in for a larger model's compute"
        " (elasticctl chaos gives the tiny model steps of a realistic length)",
    )
    return parser


#: How long one of ``device_time``'s waits lasts, seconds.
KERNEL_S = 0.005


def device_time(seconds: float) -> Callable[..., None]:
    """A forward pre-hook that waits ``seconds`` as a device runs a larger model: kernel after
    kernel, each ``KERNEL_S`` long. A process stopped part of the time (a throttled node, as
    ``elasticctl chaos`` makes one) launches its kernels that much later, and computes that
    much slower; one long sleep would end on time whatever stopped it."""
    kernels = max(1, round(seconds / KERNEL_S))

    def wait(*_: object) -> None:
        for _ in range(kernels):
            time.sleep(seconds / kernels)

    return wait


def problem(
    args: argparse.Namespace,
) -> tuple[nn.Module, torch.Tensor, torch.Tensor, StepSampler]:
    """The model (seeded), the dataset and the step sampler of a run."""
    torch.manual_seed(args.seed)
    net = nn.Sequential(nn.Linear(args.features, args.hidden), nn.Tanh(), nn.Linear(args.hidden, 1))
    if args.step_time:  # each forward pass lasts that much longer: a larger model's compute
        net.register_forward_pre_hook(device_time(args.step_time))
    x, y = synthetic_regression(args.samples, args.features, seed=args.seed)
    return net, x, y, StepSampler(len(x), args.global_batch, seed=args.seed)


def main() -> None:
    args = arguments(__doc__).parse_args()
    torch.set_num_threads(1)
    _, x, y, sampler = problem(args)

    def build(world: World) -> tuple[DistributedDataParallel, ZeroRedundancyOptimizer]:
        """DDP and the ZeRO optimizer on the current generation's group, from the seed."""
        net, *_ = problem(args)
        model = DistributedDataParallel(net)
        # Every build, so every step reduces gradients in the same bucket layout and a
        # recovered run continues bit for bit (rank_runtime.ddp).
        prime_buckets(model, lambda ddp: ddp(x[:1]))
        return model, ZeroRedundancyOptimizer(net.parameters(), torch.optim.Adam, lr=args.lr)

    def train_step(
        model: DistributedDataParallel, optimizer: ZeroRedundancyOptimizer, step: int
    ) -> tuple[float, int]:
        """One step on this rank's part of the global batch: the global mean loss and the
        samples used. Its tensors die with its frame (a recovery must not keep the old group
        alive through them)."""
        world = session.world
        index = torch.tensor(sampler.shard(step, world.rank, world.size), dtype=torch.long)
        per_sample = ((model(x[index]) - y[index]) ** 2).sum()
        # Sum over this rank's samples, scaled so DDP's average is the global batch's mean.
        loss = per_sample * (world.size / args.global_batch)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        total = per_sample.detach().clone()
        dist.all_reduce(total)
        return total.item() / args.global_batch, len(index)

    session = Session(build, state={"sampler": sampler}, skip=args.skip_steps)
    loss = float("nan")
    for step in session.steps(args.steps):
        with session.step():
            loss, samples = train_step(session.model, session.optimizer, step)
            session.report(loss=loss, samples=samples)
            sampler.step = step  # the data position, backed up with the rank's state
    if args.out and session.elastic.world is not None and session.world.rank == 0:
        torch.save({"params": session.model.module.state_dict(), "loss": loss}, args.out)
    session.finish()


if __name__ == "__main__":
    main()
