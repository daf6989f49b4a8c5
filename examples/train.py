"""A small elastic training job: DDP + ZeroRedundancyOptimizer on gloo, CPU, no downloads.

Run it under the launcher (a control plane must be serving)::

    elasticctl run --nproc 4 --spares 1 --nodes 4 --racks 2 examples/train.py --steps 60

The data is a synthetic regression problem generated from a seed; the global batch of each
step is a function of the step (``StepSampler``), split over whatever world exists, so every
world size sees the same samples at the same step. Each rank backs up its unique state (its
ZeRO optimizer shard, plus the model, RNG and data position) every ``backup_interval`` steps.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel

from rank_runtime.data import StepSampler, synthetic_regression
from rank_runtime.ddp import prime_buckets
from rank_runtime.elastic import Elastic, GenerationSuperseded
from rank_runtime.zero import consolidate, shard_state


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
    return parser


def problem(
    args: argparse.Namespace,
) -> tuple[nn.Module, torch.Tensor, torch.Tensor, StepSampler]:
    """The model (seeded), the dataset and the step sampler of a run."""
    torch.manual_seed(args.seed)
    net = nn.Sequential(nn.Linear(args.features, args.hidden), nn.Tanh(), nn.Linear(args.hidden, 1))
    x, y = synthetic_regression(args.samples, args.features, seed=args.seed)
    return net, x, y, StepSampler(len(x), args.global_batch, seed=args.seed)


def main() -> None:
    args = arguments(__doc__).parse_args()
    torch.set_num_threads(1)

    elastic = Elastic()
    world = elastic.start()
    if world is None:  # a spare the job never needed
        return
    net, x, y, sampler = problem(args)

    def build() -> tuple[DistributedDataParallel, ZeroRedundancyOptimizer]:
        """DDP and the ZeRO optimizer on the process group of the current generation."""
        model = DistributedDataParallel(net)
        # Every build, so every step reduces gradients in the same bucket layout and a
        # recovered run continues bit for bit (rank_runtime.ddp).
        prime_buckets(model, lambda ddp: ddp(x[:1]))
        optimizer = ZeroRedundancyOptimizer(
            net.parameters(), optimizer_class=torch.optim.Adam, lr=args.lr
        )
        return model, optimizer

    def load(optimizer: ZeroRedundancyOptimizer, shards: dict[int, dict[str, Any]]) -> None:
        """Restore from the shards the control plane's plan named: this rank's own after a
        replacement, all of them after a shrink (the optimizer state is re-partitioned)."""
        if not shards:
            return  # the initial state
        any_shard = next(iter(shards.values()))
        net.load_state_dict(any_shard["model"])  # the model is replicated: any copy will do
        optimizer.load_state_dict(consolidate([s["zero"] for s in shards.values()], optimizer))

    model: DistributedDataParallel | None = None
    optimizer: ZeroRedundancyOptimizer | None = None

    def state() -> dict[str, object]:
        """This rank's state for its hot backup; its ZeRO shard is what only it has."""
        assert optimizer is not None
        return {
            "model": net.state_dict(),
            "zero": shard_state(optimizer),
            "sampler": sampler.state_dict(),
        }

    def train_step(
        model: DistributedDataParallel, optimizer: ZeroRedundancyOptimizer, step: int, world: Any
    ) -> tuple[float, int]:
        """One step on this rank's part of the global batch; the global mean loss and the
        samples used. Its tensors die with its frame (recovery drops the traceback)."""
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

    loss_value = float("nan")
    step = elastic.resume_step
    while step < args.steps:
        world = elastic.world
        assert world is not None
        started = time.perf_counter()
        try:
            if model is None or optimizer is None:
                # Building DDP and ZeRO talks to every rank: a peer lost now is recovered
                # like one lost mid-step.
                model, optimizer = build()
                load(optimizer, elastic.restored_shards)
            loss_value, samples = train_step(model, optimizer, step + 1, world)
        except RuntimeError as exc:  # a peer died mid-collective: the control plane decides
            model = optimizer = None  # they hold the broken group
            elastic.recover(exc, step + 1)
            step = elastic.resume_step
            continue
        step += 1
        sampler.step = step
        try:
            elastic.step_done(
                step,
                loss=loss_value,
                samples=samples,
                seconds=time.perf_counter() - started,
                state=state,
            )
        except GenerationSuperseded as exc:  # a newer generation was decided meanwhile
            model = optimizer = None
            elastic.recover(exc, step)
            step = elastic.resume_step
    if args.out and world.rank == 0:
        torch.save({"params": net.state_dict(), "loss": loss_value}, args.out)
    elastic.finish(step, loss_value)


if __name__ == "__main__":
    main()
