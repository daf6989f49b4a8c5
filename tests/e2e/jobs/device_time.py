"""A small DDP job whose forward also spends ``--device-ms`` away from the host's CPU (a sleep),
as an accelerator's kernels would: on a 2-core machine four ranks of CPU compute share two
cores, so a rank that sleeps longer (a slow device, ``slow@``) frees a core for the others and
barely changes the job's step time; device time does not. Run by ``tests/e2e/test_straggler.py``
under the launcher."""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from rank_runtime.data import StepSampler, synthetic_regression
from rank_runtime.ddp import prime_buckets
from rank_runtime.elastic import World
from rank_runtime.session import Session


class Device(nn.Module):
    """``net``, whose forward takes ``seconds`` of device time besides its CPU work."""

    def __init__(self, net: nn.Module, seconds: float) -> None:
        super().__init__()
        self.net = net
        self.seconds = seconds

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(self.seconds)
        return self.net(x)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--device-ms", type=float, default=40.0)
    parser.add_argument("--global-batch", type=int, default=64)
    args = parser.parse_args()
    torch.set_num_threads(1)
    x, y = synthetic_regression(4096, 16, seed=0)
    sampler = StepSampler(len(x), args.global_batch, seed=0)

    def build(world: World) -> tuple[nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 1))
        model = DistributedDataParallel(Device(net, args.device_ms / 1000))
        prime_buckets(model, lambda ddp: ddp(x[:1]))
        return model, torch.optim.Adam(net.parameters(), lr=0.01)

    def train_step(
        model: nn.Module, optimizer: torch.optim.Optimizer, step: int
    ) -> tuple[float, int]:
        world = session.world
        index = torch.tensor(sampler.shard(step, world.rank, world.size), dtype=torch.long)
        loss = ((model(x[index]) - y[index]) ** 2).sum() * (world.size / args.global_batch)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        return loss.item(), len(index)

    session = Session(build, state={"sampler": sampler})
    for step in session.steps(args.steps):
        with session.step():
            loss, samples = train_step(session.model, session.optimizer, step)
            session.report(loss=loss, samples=samples)
            sampler.step = step
    session.finish()


if __name__ == "__main__":
    main()
