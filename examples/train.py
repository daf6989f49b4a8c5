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

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel

from rank_runtime.data import StepSampler, synthetic_regression
from rank_runtime.elastic import Elastic


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--global-batch", type=int, default=64)
    parser.add_argument("--features", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--samples", type=int, default=4096)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(1)

    elastic = Elastic()
    world = elastic.start()
    if world is None:  # a spare the job never needed
        return
    torch.manual_seed(args.seed)
    model = DistributedDataParallel(
        nn.Sequential(nn.Linear(args.features, args.hidden), nn.Tanh(), nn.Linear(args.hidden, 1))
    )
    optimizer = ZeroRedundancyOptimizer(
        model.parameters(), optimizer_class=torch.optim.Adam, lr=args.lr
    )
    x, y = synthetic_regression(args.samples, args.features, seed=args.seed)
    sampler = StepSampler(len(x), args.global_batch, seed=args.seed)

    def state() -> dict[str, object]:
        return {
            "model": model.module.state_dict(),
            "optimizer_shard": optimizer.optim.state_dict(),
            "rng": torch.get_rng_state(),
            "sampler": sampler.state_dict(),
        }

    loss_value = float("nan")
    step = elastic.resume_step
    for step in range(elastic.resume_step + 1, args.steps + 1):
        started = time.perf_counter()
        index = torch.tensor(sampler.shard(step, world.rank, world.size), dtype=torch.long)
        sampler.step = step
        prediction = model(x[index])
        per_sample = ((prediction - y[index]) ** 2).sum()
        # Sum over this rank's samples, scaled so DDP's average is the global batch's mean.
        loss = per_sample * (world.size / args.global_batch)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        total = per_sample.detach().clone()
        dist.all_reduce(total)
        loss_value = total.item() / args.global_batch
        elastic.step_done(
            step,
            loss=loss_value,
            samples=len(index),
            seconds=time.perf_counter() - started,
            state=state,
        )
    elastic.finish(step, loss_value)


if __name__ == "__main__":
    main()
