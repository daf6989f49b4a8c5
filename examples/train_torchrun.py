"""The conventional way, as a baseline: ``train.py``'s model and data, restarted torchrun-style.

Run under ``torchrun --max-restarts K``: every ``--checkpoint-every`` steps each rank writes
its state (the replicated model, its ZeRO shard, the data position) with ``torch.save`` to
``--checkpoint-dir/step-N/rank-R.pt`` (a temporary file renamed into place). When any worker
dies, torchrun stops every worker and starts them all again; each new process imports torch,
joins the process group, loads the newest checkpoint every rank finished, and goes on.
``elasticctl bench mttr`` compares this with in-process recovery.

``--crash STEP:RANK`` (repeatable) makes that rank kill itself with SIGKILL after STEP, once
per run (a marker file in the checkpoint directory); ``--timing FILE`` appends one JSON line
per completed step (rank 0) and per injected crash, with this machine's wall clock.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel
from train import arguments, problem

from rank_runtime.zero import consolidate, shard_state


def _record(path: str, **fields: Any) -> None:
    if path:
        with open(path, "a") as out:
            out.write(json.dumps({"t": time.time(), **fields}) + "\n")


def _newest_complete(directory: Path, world: int) -> Path | None:
    """The newest step directory that holds a file from every rank."""
    steps = sorted(
        (p for p in directory.glob("step-*") if p.is_dir()),
        key=lambda p: int(p.name.split("-")[1]),
        reverse=True,
    )
    for step_dir in steps:
        if all((step_dir / f"rank-{r}.pt").exists() for r in range(world)):
            return step_dir
    return None


def main() -> None:
    parser = arguments(__doc__)
    parser.add_argument("--checkpoint-dir", required=True)
    parser.add_argument("--checkpoint-every", type=int, default=10)
    parser.add_argument("--crash", action="append", default=[], metavar="STEP:RANK")
    parser.add_argument("--timing", default="")
    args = parser.parse_args()
    torch.set_num_threads(1)
    crashes = {tuple(int(v) for v in c.split(":")) for c in args.crash}
    checkpoints = Path(args.checkpoint_dir)
    checkpoints.mkdir(parents=True, exist_ok=True)

    # torchrun's environment: RANK, WORLD_SIZE, MASTER_ADDR/PORT (the agent's store). Keys
    # are kept per restart: a restarted group must not read the addresses of the dead one.
    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    agent_store = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False
    )
    store = dist.PrefixStore(f"baseline/restart-{restart}", agent_store)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=size)
    net, x, y, sampler = problem(args)
    model = DistributedDataParallel(net)
    optimizer = ZeroRedundancyOptimizer(
        net.parameters(), optimizer_class=torch.optim.Adam, lr=args.lr
    )
    step = 0
    newest = _newest_complete(checkpoints, size)
    if newest is not None:
        shards = [torch.load(newest / f"rank-{r}.pt", weights_only=False) for r in range(size)]
        net.load_state_dict(shards[rank]["model"])
        optimizer.load_state_dict(consolidate([s["zero"] for s in shards], optimizer))
        step = int(newest.name.split("-")[1])

    loss_value = float("nan")
    while step < args.steps:
        step += 1
        if step in args.skip_steps:
            continue
        index = torch.tensor(sampler.shard(step, rank, size), dtype=torch.long)
        per_sample = ((model(x[index]) - y[index]) ** 2).sum()
        loss = per_sample * (size / args.global_batch)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        total = per_sample.detach().clone()
        dist.all_reduce(total)
        loss_value = total.item() / args.global_batch
        sampler.step = step
        if rank == 0:
            _record(args.timing, step=step, restart=restart, loss=loss_value)
        if step % args.checkpoint_every == 0:
            target = checkpoints / f"step-{step}"
            target.mkdir(exist_ok=True)
            state = {"model": net.state_dict(), "zero": shard_state(optimizer),
                     "sampler": sampler.state_dict()}  # fmt: skip
            partial = target / f".rank-{rank}.pt.tmp"
            torch.save(state, partial)
            os.replace(partial, target / f"rank-{rank}.pt")
        if (step, rank) in crashes:
            marker = checkpoints / f".crashed-{step}-{rank}"
            try:
                os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
            except FileExistsError:
                continue
            _record(args.timing, crash=step, rank=rank, restart=restart)
            os.kill(os.getpid(), signal.SIGKILL)
    if args.out and rank == 0:
        torch.save({"params": net.state_dict(), "loss": loss_value}, args.out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
