"""A small decoder-only transformer trained with FSDP2 on text that ships with Python.

Run it under the launcher (a control plane must be serving)::

    elasticctl run --nproc 4 --spares 1 --nodes 4 --racks 2 examples/transformer.py --steps 40

The model (``tinygpt.build_model``) is sharded with ``fully_shard`` over the current world;
each rank's parameters and AdamW state are DTensor shards. With ``--tp N`` the world is a
(dp, tp) mesh: each block's MLP is tensor-parallel over the N ranks of a data-parallel replica
(``tinygpt.tensor_parallel``), and FSDP2 shards across replicas. The loop integration is the
same as ``train.py``'s (``rank_runtime.session.Session``): every ``backup_interval`` steps each
rank backs up its shards with their global layout to peers; a spare that takes a lost rank
gets exactly its shards, and a world that shrinks re-partitions the surviving shards in memory
(``rank_runtime.sharded``). Byte-level tokens of the standard library's sources (no
download); the global batch of each step is fixed by the step, whatever the world.

``--ngram-rows N`` adds ``tinygpt.HashedNgrams``: an N-row input embedding of hashed byte
trigrams, row-sharded over the data-parallel ranks and never gathered (only the activations of
its lookups move), so its state can reach gigabytes while a step stays cheap (``elasticctl
bench mttr --example transformer`` trains it). When the generation restores its state anyway
(``session.restoring``), ``build`` makes the model on the meta device and allocates it without
initialising it: the restore writes every value.
"""

from __future__ import annotations

import argparse
import contextlib
from typing import Any

import torch
import torch.distributed as dist
from tinygpt import (  # beside this script
    HashedNgrams,
    TextData,
    build_model,
    shard,
    step_loss,
    tensor_parallel,
)
from torch import nn

from rank_runtime.elastic import World
from rank_runtime.session import Session


def arguments() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--global-batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=256, help="at least 256 (bytes)")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument(
        "--tp", type=int, default=1, help="tensor-parallel degree inside each replica"
    )
    parser.add_argument(
        "--ngram-rows", type=int, default=0,
        help="rows of a hashed-trigram input embedding, row-sharded over the ranks (0: none)",
    )  # fmt: skip
    parser.add_argument(
        "--fused-adamw", action="store_true",
        help="AdamW's fused kernel (one pass over each parameter's state per step)",
    )  # fmt: skip
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="", help="rank 0 saves the final parameters here")
    return parser


def main() -> None:
    args = arguments().parse_args()
    torch.set_num_threads(1)
    data = TextData(args.seq, args.global_batch, seed=args.seed)

    meshes: dict[str, Any] = {}

    def build(world: World) -> tuple[nn.Module, torch.optim.Optimizer]:
        """The model from the seed on the current world's (dp, tp) mesh — tensor parallelism
        inside each data-parallel replica, FSDP2 across replicas — and its optimizer."""
        if world.size % args.tp:
            raise ValueError(f"a world of {world.size} ranks does not split into tp={args.tp}")
        if args.ngram_rows and args.tp > 1:
            raise ValueError("--ngram-rows shards its rows over all ranks: use it with --tp 1")
        mesh = session.mesh((world.size // args.tp, args.tp), ("dp", "tp"))
        meshes.update(dp=mesh["dp"], tp=mesh["tp"])
        # A restore overwrites every value: no initialisation then, only memory (meta first).
        restoring = session.restoring
        with torch.device("meta") if restoring else contextlib.nullcontext():
            net = build_model(args.vocab, args.dim, args.layers, args.heads, args.seq, args.seed)
        if not restoring:
            net = net.to(session.device)
        if args.tp > 1:
            tensor_parallel(net, mesh["tp"])
        if args.ngram_rows:
            net.ngrams = HashedNgrams(
                args.ngram_rows, args.dim, mesh["dp"], args.seed, init=not restoring
            )
        model = shard(net, mesh["dp"])
        if restoring:
            model.to_empty(device=session.device)
        fused = {"fused": True} if args.fused_adamw else {}
        return model, torch.optim.AdamW(model.parameters(), lr=args.lr, **fused)

    def train_step(
        model: nn.Module, optimizer: torch.optim.Optimizer, step: int
    ) -> tuple[float, int]:
        """One step on this replica's part of the global batch (the ranks of a replica see the
        same samples): the global mean token loss and the samples used."""
        dp = meshes["dp"]
        rank, size = dp.get_local_rank(), dp.size()
        inputs, targets = data.batch(step, rank, size)
        loss = step_loss(model, inputs.to(session.device), targets.to(session.device),
                         size, args.global_batch)  # fmt: skip
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        total = loss.detach().clone()
        dist.all_reduce(total, group=dp.get_group())  # the replicas' parts: the global mean
        return total.item() / size, len(inputs)

    session = Session(build, state={"sampler": data.sampler})
    loss = float("nan")
    for step in session.steps(args.steps):
        with session.step():
            loss, samples = train_step(session.model, session.optimizer, step)
            session.report(loss=loss, samples=samples)
    if args.out and session.elastic.world is not None:
        save(session.model, args.out, loss)
    session.finish()


def save(model: nn.Module, path: str, loss: float) -> None:
    """Rank 0 writes the full parameters (collective: every rank gathers its shards)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    full = get_model_state_dict(
        model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    if dist.get_rank() == 0:
        torch.save({"params": full, "loss": loss}, path)


if __name__ == "__main__":
    main()
