"""A job whose own code fails: rank 1 raises ``ValueError`` in its step (a bug of the loop, not
a lost peer). Run by ``tests/e2e/test_session.py`` under the launcher."""

from __future__ import annotations

import argparse

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from rank_runtime.elastic import World
from rank_runtime.session import Session


def bad_batch(step: int) -> None:
    raise ValueError(f"bad batch at step {step}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--fail-at", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)

    def build(world: World) -> tuple[nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        model = DistributedDataParallel(nn.Linear(4, 1))
        return model, torch.optim.SGD(model.parameters(), lr=0.1)

    def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, step: int) -> float:
        if step == args.fail_at and session.world.rank == 1:
            bad_batch(step)
        loss = model(torch.ones(2, 4)).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        return float(loss)

    session = Session(build)
    for step in session.steps(10):
        with session.step():
            session.report(loss=train_step(session.model, session.optimizer, step), samples=2)
    session.finish()


if __name__ == "__main__":
    main()
