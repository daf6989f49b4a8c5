"""A small decoder-only transformer trained with pipeline stages (PP x DP) on CPU/gloo.

Run it under the launcher with a (dp, pp) mesh in the job's policy (a control plane must be
serving)::

    elasticctl run --nproc 4 --spares 1 --nodes 4 --racks 2 \\
        --policy 'mesh={"dims":[["dp",2],["pp",2]]}' examples/pipeline.py --steps 40

The world is the control plane's mesh (``session.mesh()``), ``dp`` outermost, ``pp`` inner:
rank ``r`` is stage ``r % pp`` of data-parallel replica ``r // pp``, so a replica is one whole
pipeline and a shrink drops whole pipelines. The model (``tinygpt.build_model``, untied head)
is cut into ``pp`` stages (``tinygpt.split_stages``: the embeddings and the first blocks, ...,
the last blocks, final norm and head); each rank builds its stage, shards it with FSDP2 over
its stage's data-parallel group (``fully_shard`` per block, then the stage: its parameters and
AdamW state are DTensor shards, backed up and restored as in ``transformer.py``), and runs it
as a ``torch.distributed.pipelining.PipelineStage`` over its replica's pp group, under the
GPipe schedule (``--schedule 1f1b``: 1F1B; ``--microbatches`` of the replica's part of the
global batch; activations and their gradients travel by gloo's point-to-point send/recv).
The loop integration is the same as ``train.py``'s and ``transformer.py``'s
(``rank_runtime.session.Session``).

The last stage computes the loss of each microbatch (mean token cross-entropy); the schedule
averages the microbatches' gradients and FSDP2 the replicas', so a step's gradient is the
global batch's mean, whatever the number of replicas. The reported loss is the global mean,
the same on every rank (one ``all_reduce`` over the world).
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from tinygpt import GPTStage, TextData, build_model, split_stages  # beside this script
from torch import nn

from rank_runtime.elastic import World
from rank_runtime.session import Session


def arguments() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--global-batch", type=int, default=16)
    parser.add_argument("--microbatches", type=int, default=4, help="per replica and step")
    parser.add_argument("--schedule", choices=sorted(SCHEDULES), default="gpipe")
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=256, help="at least 256 (bytes)")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="", help="rank 0 saves the final parameters here")
    return parser


#: The pipeline schedules to choose from (``torch.distributed.pipelining``'s names).
SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B"}


def token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """A microbatch's mean token cross-entropy (the last stage's ``loss_fn``)."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def build_pipeline(
    args: argparse.Namespace, mesh: Any, device: torch.device
) -> tuple[GPTStage, Any]:
    """This rank's stage of the model made from the seed, sharded with FSDP2 over ``mesh["dp"]``,
    and the schedule (``--schedule``) that runs it over ``mesh["pp"]``."""
    from torch.distributed import pipelining
    from torch.distributed.fsdp import fully_shard

    dp, pp = mesh["dp"], mesh["pp"]
    replica_batch, left = divmod(args.global_batch, dp.size())
    micro, uneven = divmod(replica_batch, args.microbatches)
    if left or uneven or not micro:
        raise ValueError(
            f"a global batch of {args.global_batch} does not split into {dp.size()} replicas "
            f"of {args.microbatches} equal microbatches"
        )
    index, stages = pp.get_local_rank(), pp.size()
    net = build_model(args.vocab, args.dim, args.layers, args.heads, args.seq, args.seed,
                      tied=False)  # fmt: skip
    stage = split_stages(net, stages)[index].to(device)
    for block in stage.blocks.values():
        # Kept unsharded between the microbatches' forwards and backwards (one all-gather).
        fully_shard(block, mesh=dp, reshard_after_forward=False)
    fully_shard(stage, mesh=dp, reshard_after_forward=False)
    # What a stage receives and sends (static: no inference round before the first step).
    # Activations require grad: their gradients travel back (the derived metadata of one that
    # does not is "no gradient").
    hidden = torch.empty(micro, args.seq, args.dim, device=device, requires_grad=True)
    first = torch.empty(micro, args.seq, dtype=torch.long, device=device)
    last = torch.empty(micro, args.seq, args.vocab, device=device, requires_grad=True)
    runner = pipelining.PipelineStage(
        stage,
        index,
        stages,
        device,
        input_args=first if index == 0 else hidden,
        output_args=last if index == stages - 1 else hidden,
        group=pp.get_group(),
    )
    kind = getattr(pipelining, SCHEDULES[args.schedule])
    schedule = kind(runner, n_microbatches=args.microbatches, loss_fn=token_loss)
    return stage, schedule


def main() -> None:
    args = arguments().parse_args()
    torch.set_num_threads(1)
    data = TextData(args.seq, args.global_batch, seed=args.seed)

    #: The current generation's sub-meshes and schedule (filled by ``build``).
    pipeline: dict[str, Any] = {}

    def build(world: World) -> tuple[nn.Module, torch.optim.Optimizer]:
        """This rank's stage, from the seed, on the generation's (dp, pp) mesh, and its
        optimizer; the schedule goes to ``pipeline``."""
        pipeline.clear()
        mesh = session.mesh()
        if mesh.mesh_dim_names != ("dp", "pp"):
            raise ValueError(f"the job's mesh must be (dp, pp), not {mesh.mesh_dim_names}")
        stage, schedule = build_pipeline(args, mesh, session.device)
        pipeline.update(dp=mesh["dp"], pp=mesh["pp"], schedule=schedule)
        return stage, torch.optim.AdamW(stage.parameters(), lr=args.lr)

    def train_step(
        model: nn.Module, optimizer: torch.optim.Optimizer, step: int
    ) -> tuple[float, int]:
        """One step of this replica's part of the global batch through the pipeline: the global
        mean token loss and the samples used."""
        dp, pp, schedule = pipeline["dp"], pipeline["pp"], pipeline["schedule"]
        inputs, targets = data.batch(step, dp.get_local_rank(), dp.size())
        index, stages = pp.get_local_rank(), pp.size()
        losses: list[torch.Tensor] = []
        optimizer.zero_grad()
        if index == 0:
            schedule.step(inputs.to(session.device))
        elif index == stages - 1:
            schedule.step(target=targets.to(session.device), losses=losses)
        else:
            schedule.step()
        optimizer.step()
        # The last stages hold their replica's mean loss; the world's sum over replicas.
        mine = torch.stack(losses).mean().detach() if losses else torch.zeros(())
        total = mine.reshape(1).to(session.device, torch.float32)
        dist.all_reduce(total)
        return total.item() / dp.size(), len(inputs)

    session = Session(build, state={"sampler": data.sampler})
    loss = float("nan")
    for step in session.steps(args.steps):
        with session.step():
            loss, samples = train_step(session.model, session.optimizer, step)
            session.report(loss=loss, samples=samples)
    if args.out and session.elastic.world is not None:
        save(session.model, pipeline["dp"], args.out, loss)
    session.finish()


def save(model: nn.Module, dp: Any, path: str, loss: float) -> None:
    """Rank 0 writes the whole model's parameters, its stages' together (collective: each
    stage gathers its shards over its dp group, the first replica's ranks send theirs)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    # Every rank gets its whole stage (cpu_offload would keep it on the world's rank 0 only).
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    first = dp.get_local_rank() == 0
    tensors = {name: t.detach().cpu() for name, t in full.items() if isinstance(t, torch.Tensor)}
    mine = tensors if first else None
    root = dist.get_rank() == 0
    parts: list[Any] = [None] * dist.get_world_size()
    dist.gather_object(mine, parts if root else None, dst=0)
    if root:
        params = {name: t for part in parts if part for name, t in part.items()}
        torch.save({"params": params, "loss": loss}, path)


if __name__ == "__main__":
    main()
