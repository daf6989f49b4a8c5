"""``elasticctl bench backup``: what backups cost a training loop, in bytes, memory and time.

Three examples, each backing up as ``rank_runtime.session.Session`` does (its ``Parts`` and
``unique_state``: what only this rank has goes to peers, what every rank has alike stays in
this rank's own memory):

- ``ddp`` (the default): ``examples/train.py``'s model, DDP and ``ZeroRedundancyOptimizer``
  Adam on ``world`` real gloo ranks (processes of their own), each with a real ``Elastic``:
  ``Elastic.backup`` every ``every`` steps, its replicator thread sending each backup to the
  peer stores of the next ``redundancy`` ranks (a ring placement). Reports what each rank
  sends per backup (``bytes_replicated_per_backup``: R times its unique snapshot) beside the
  sizing formula's prediction (``sizing``; docs/operations.md), ``model_bytes``, whether any
  of the model's bytes are in what was sent or held (``model_replicated``: searched for, and
  found in the rank's own replicated backup as a check of the search), and each rank's
  ``Elastic.backup_memory()`` beside the formula's. Its step times run 4 ranks on however
  many cores there are.
- ``transformer``: ``examples/tinygpt.py``'s decoder under FSDP2 (one gloo rank in this
  process), AdamW, a snapshot every ``every`` steps replicated in the background to
  ``redundancy`` real peer stores in a process of their own (as ``mlp`` below, ABBA blocks):
  ``overhead``, ``blocking_ms_per_gb`` (the step's wait per GB snapshotted: the take, whose
  parameters and optimizer state are copied on a thread beside the next forward and
  backward, plus the optimizer step's wait for that copy, ``settle_s``), ``snapshot_gbps``
  (a whole take with nothing left to a thread, training paused), then, training
  paused, the replicator's phases on the same bytes, as ``Elastic._replicate`` runs them
  (``digest_s``: one pass of sha256 and the snapshot trailer's crc32,
  ``HotSnapshot.stream_digest``; ``serialize_s``: pinning the slot's views,
  ``HotSnapshot.serialized``, no copy; ``send_s``: ``replication.send`` of those views to one
  store, which receives them into the buffer it evicted last and keeps them under the
  digest without hashing them) alternating with plain sockets (``sendall`` to a process that
  ``recv_into``s one reused buffer): ``replication_gbps`` (one ``send``) and
  ``tcp_loopback_gbps``, ``replicator_gbps`` (a whole replication per copy).
- ``mlp``: one process, below.

``mlp``: a small MLP trains with Adam on synthetic data (one CPU thread, or the GPU when
there is one). Blocks of ``every`` steps alternate (ABBA, so drift cancels) between plain
training and training after one ``HotSnapshot.take`` of the whole rank state (model,
optimizer, RNG, data position): the snapshot's cost is amortized over the block, as with a
backup every ``every`` steps.
Medians over the blocks give ``step_s_no_backup``, ``step_s_backup`` and ``overhead``
(``step_s_backup / step_s_no_backup - 1``). On a shared machine the blocks' noise (several
percent) can exceed a 1-2 % effect, so ``take_share`` also reports the cost predicted from the
median ``take`` alone (``take_s / (every * step_s_no_backup)``); it misses indirect costs such
as evicted caches, which ``overhead`` includes.

Then, after further training and apart from the timed blocks, takes alternate with a plain
``dst.copy_(src)`` of the same tensors into preallocated buffers: ``snapshot_gbps`` (state bytes
over the median take, flattening included), ``copy_gbps`` and ``copy_fraction`` (their ratio).
GB are 10**9 bytes; MB are MiB.

With ``replicas`` > 0 a background thread plays the replicator after every snapshot, as a
member does: it computes the snapshot's sha256 digest and sends the slot's bytes over loopback
TCP to that many real peer stores (``rank_runtime.replication``, in a process of their own, as
the members of other nodes are), each of which keeps it under that digest. It runs
during the snapshot's block and is awaited after it, untimed: its interference with the
block's steps counts in ``overhead``; the time it takes beyond them does not (a training loop
never waits for it) and is reported as ``replicate_s``.

``security`` says how the replicator runs: ``off`` (no job secret, no MACs) or ``on`` (the
job's secret: both ends authenticated), or ``both``: then backup blocks of both kinds
alternate with the plain ones in one run (plain, off, on, on, off, plain), so ``overhead_off``
and ``overhead_on`` come from the same training; ``security_cost`` is the step time with
backups on over off, minus one, and ``within_10pct`` whether it is at most 10 % either way.
Without ``security`` (None) the replicator runs as ``off``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import json
import math
import multiprocessing
import os
import pathlib
import queue
import socket
import statistics
import subprocess
import sys
import threading
import time
from typing import Any

import torch

from rank_runtime.replication import ReplicationError, background_priority, send
from rank_runtime.snapshot import HotSnapshot, SnapshotNotFound

#: How the replicator authenticates: no secret, the job's secret, or one kind of block each.
SECURITY_MODES = ("off", "on", "both")

GB = 1e9
MIB = 2**20


def _progress(enabled: bool, message: str) -> None:
    if enabled:
        print(message, file=sys.stderr, flush=True)


def _tensor_leaves(state: object) -> list[torch.Tensor]:
    """Return the tensors of a nested state, each object once, in order."""
    out: list[torch.Tensor] = []
    seen: set[int] = set()
    stack = [state]
    while stack:
        node = stack.pop()
        if isinstance(node, torch.Tensor):
            if id(node) not in seen:
                seen.add(id(node))
                out.append(node)
        elif isinstance(node, dict):
            stack.extend(reversed(list(node.values())))
        elif isinstance(node, list | tuple):
            stack.extend(reversed(node))
    return out


class _Replicator:
    """Serialize, digest and send each new snapshot to ``replicas`` peer stores over loopback,
    off the loop, as a member's replicator does (with the job's secret when ``secret``)."""

    def __init__(self, hot: HotSnapshot, replicas: int, secret: bytes | None = None) -> None:
        self.hot = hot
        self.replicas = replicas
        self.secret = secret
        self.algorithm = "sha256"  # a member's shard digest, with or without the secret
        self.endpoints: list[str] = []
        self.holders: subprocess.Popen[str] | None = None
        self.steps: queue.Queue[int | None] = queue.Queue()
        self.seconds: list[float] = []
        #: Per replication: (serialize, digest, send to every holder) seconds.
        self.phases: list[tuple[float, float, float]] = []
        self.nbytes = 0
        self.errors: list[str] = []
        #: Recompute a snapshot's digest each time it is replicated (the same step sent again,
        #: timed as a new one would be).
        self.fresh = False
        self.thread = threading.Thread(target=self._run, name="replicator", daemon=True)

    def _run(self) -> None:
        background_priority()  # as Elastic._replicate
        while (step := self.steps.get()) is not None:
            started = time.perf_counter()
            try:
                # What Elastic._replicate does, in its order: one digest pass (sha256, with
                # the trailer's crc32 in the same pass), then the slot's bytes as they are.
                reported = self.hot.stream_digest(step, self.algorithm, cached=not self.fresh)
                digested = time.perf_counter()
                with self.hot.serialized(step, self.algorithm) as form:
                    serialized = time.perf_counter()  # views of the slot: no copy
                    for endpoint in self.endpoints:
                        send(endpoint, owner="bench", shard=0, step=step, generation=1,
                             data=form.parts, digest=reported, secret=self.secret)  # fmt: skip
                    self.nbytes = form.nbytes
                ended = time.perf_counter()
                self.seconds.append(ended - started)
                self.phases.append((serialized - digested, digested - started, ended - serialized))
            except (ReplicationError, SnapshotNotFound) as exc:
                self.errors.append(str(exc))
            finally:
                self.steps.task_done()

    def __enter__(self) -> _Replicator:
        # The holders live in a process of their own, as the members of other nodes do.
        env = {**os.environ, "ELASTIC_JOB_SECRET": self.secret.hex() if self.secret else ""}
        self.holders = subprocess.Popen(
            [sys.executable, "-m", "rank_runtime.replication", str(self.replicas)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
        )  # fmt: skip
        assert self.holders.stdout is not None
        self.endpoints = json.loads(self.holders.stdout.readline())
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.steps.put(None)
        self.thread.join()
        if self.holders is not None:
            assert self.holders.stdin is not None and self.holders.stdout is not None
            self.holders.stdin.close()
            self.holders.wait(30)
            self.holders.stdout.close()


def _run_mlp(
    *,
    params_mb: float = 4.0,
    steps: int = 1000,
    every: int = 10,
    batch: int = 64,
    replicas: int = 0,
    security: str | None = None,
    progress: bool = True,
) -> dict[str, Any]:
    """Train with and without a snapshot every ``every`` steps; return the JSON result."""
    if params_mb <= 0 or steps < 1 or every < 1 or batch < 1 or replicas < 0:
        raise ValueError("params_mb, steps, every and batch must be positive, replicas >= 0")
    if security is not None and security not in SECURITY_MODES:
        raise ValueError(f"security must be one of {', '.join(SECURITY_MODES)}")
    if security is not None and replicas == 0:
        replicas = 2  # the policy's default redundancy: security is about the transfers
    torch.set_num_threads(1)
    torch.manual_seed(0)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")

    # Three square hidden layers hold almost all parameters: 3 * width**2 ~ params.
    width = max(8, int(math.sqrt(params_mb * MIB / 4 / 3)) // 8 * 8)
    model = torch.nn.Sequential(
        torch.nn.Linear(width, width),
        torch.nn.ReLU(),
        torch.nn.Linear(width, width),
        torch.nn.ReLU(),
        torch.nn.Linear(width, width),
        torch.nn.ReLU(),
        torch.nn.Linear(width, 10),
    ).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    batches = [
        (torch.randn(batch, width, device=device), torch.randint(0, 10, (batch,), device=device))
        for _ in range(4)
    ]
    params = sum(p.numel() for p in model.parameters())

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(device)

    def train_step(step: int) -> None:
        x, y = batches[step % len(batches)]
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        torch.autograd.backward(loss)
        opt.step()

    def rank_state(step: int) -> dict[str, Any]:
        rng: dict[str, Any] = {"torch": torch.get_rng_state()}
        if cuda:
            rng["cuda"] = torch.cuda.get_rng_state_all()
        return {
            "model": model.state_dict(),
            "optimizer": opt.state_dict(),
            "rng": rng,
            "data": {"step": step, "position": step * batch},
        }

    _progress(progress, f"bench backup: {params:,} parameters (width {width}) on {device.type}")
    hot = HotSnapshot()
    step = 0
    for _ in range(2 * every):  # Adam's state exists from the first step on
        train_step(step)
        step += 1
    sync()
    started = time.perf_counter()
    first = hot.take(step, rank_state(step))  # allocates both slots
    first_take_s = time.perf_counter() - started
    assert first is not None
    nbytes = first.nbytes
    sources = _tensor_leaves(rank_state(step))
    copy_nbytes = sum(t.numel() * t.element_size() for t in sources)
    targets = [torch.empty(t.shape, dtype=t.dtype, pin_memory=cuda and t.is_cuda) for t in sources]

    def plain_copy() -> float:
        started = time.perf_counter()
        with torch.no_grad():
            for dst, src in zip(targets, sources, strict=True):
                dst.copy_(src, non_blocking=cuda)
        sync()
        return time.perf_counter() - started

    plain_copy()
    plain_copy()

    modes = ["off", "on"] if security == "both" else [security or "off"]
    secret = os.urandom(32)
    replicators = (
        {m: _Replicator(hot, replicas, secret if m == "on" else None) for m in modes}
        if replicas
        else {}
    )

    def block(kind: str | None) -> tuple[float, float | None]:
        """Run a snapshot (``kind``: its replication's security; None: no snapshot), then
        ``every`` steps; return the block's and take's times.

        A replication runs during the block of its snapshot and is awaited after it, untimed:
        its interference with the block's steps is charged to that block and not to a plain
        one, while the time it takes beyond them is not (training never waits for it; see
        ``replicate_s``).
        """
        nonlocal step
        replicator = replicators.get(kind) if kind is not None else None
        started = time.perf_counter()
        take_s = None
        if kind is not None:
            info = hot.take(step, rank_state(step))
            if info is not None:
                take_s = info.seconds
                if replicator is not None:
                    replicator.steps.put(step)
        for _ in range(every):
            train_step(step)
            step += 1
        sync()
        elapsed = time.perf_counter() - started
        if replicator is not None:
            replicator.steps.join()
        return elapsed, take_s

    plain: list[float] = []
    backed: dict[str, list[float]] = {m: [] for m in modes}
    takes: list[float] = []
    groups = max(1, steps // every // 2)
    # Each group is a palindrome of block kinds (ABBA; with both modes A B C C B A, and
    # A C B B C A in every other group), so a linear drift of the machine's speed cancels
    # between them, and no mode keeps the places next to the plain blocks.
    orders: list[list[str | None]] = [
        [None, *order, *reversed(order), None] for order in (modes, modes[::-1])
    ]

    def train_phase() -> None:
        for _ in range(2):  # warm up every kind of block
            for kind in orders[0][: len(modes) + 1]:
                block(kind)
        for i in range(groups):
            for kind in orders[i % 2]:
                seconds, take_s = block(kind)
                (plain if kind is None else backed[kind]).append(seconds)
                if take_s is not None:
                    takes.append(take_s)
            if (i + 1) % max(1, groups // 5) == 0:
                _progress(progress, f"  training: {i + 1}/{groups} ABBA groups")

    with contextlib.ExitStack() as running:
        for replicator in replicators.values():
            running.enter_context(replicator)
        train_phase()

    # Throughput, apart from the timed blocks (a copy there would burden the plain blocks too):
    # after some training, a take and a plain copy of the same tensors, in alternating order.
    bench_takes: list[float] = []
    copies: list[float] = []
    for i in range(max(10, groups)):
        for _ in range(every):
            train_step(step)
            step += 1
        sync()
        for is_take in (True, False) if i % 2 else (False, True):
            if is_take:
                info = hot.take(step, rank_state(step))
                if info is not None:
                    bench_takes.append(info.seconds)
            else:
                copies.append(plain_copy())
    _progress(progress, f"  throughput: {len(bench_takes)} takes, {len(copies)} plain copies")

    latest = hot.steps()[0]
    checksum = hot.checksum(latest)
    verifies = []
    for _ in range(3):
        started = time.perf_counter()
        hot.verify(latest, checksum)
        verifies.append(time.perf_counter() - started)

    step_plain = statistics.median(plain) / every
    step_by_mode = {m: statistics.median(backed[m]) / every for m in modes}
    step_backed = step_by_mode[modes[-1]]
    take_s = statistics.median(takes)
    copy_s = statistics.median(copies)
    snapshot_gbps = nbytes / statistics.median(bench_takes) / GB
    copy_gbps = copy_nbytes / copy_s / GB
    result: dict[str, Any] = {
        "device": device.type,
        "threads": torch.get_num_threads(),
        "params": params,
        "batch": batch,
        "every": every,
        "steps": len(plain) * every,
        "replicas": replicas,
        "security": security or "off",
        "state_mb": round(nbytes / MIB, 3),
        "step_s_no_backup": round(step_plain, 6),
        "step_s_backup": round(step_backed, 6),
        "overhead": round(step_backed / step_plain - 1, 4),
        # The cost predicted from the take alone: less noisy, blind to indirect costs.
        "take_share": round(take_s / (every * step_plain), 4),
        "take_s": round(take_s, 6),
        "first_take_s": round(first_take_s, 6),
        "snapshot_gbps": round(snapshot_gbps, 3),
        "copy_gbps": round(copy_gbps, 3),
        "copy_fraction": round(snapshot_gbps / copy_gbps, 3),
        "checksum_gbps": round(hot.nbytes(latest) / statistics.median(verifies) / GB, 3),
        "skipped": hot.skipped,
        "reserved_mb": round(hot.reserved_bytes / MIB, 3),
    }
    if replicators:
        result["replication_errors"] = sum(len(r.errors) for r in replicators.values())
    for mode, replicator in replicators.items():
        if replicator.seconds:
            tail = f"_{mode}" if len(modes) > 1 else ""
            result[f"replicate_s{tail}"] = round(statistics.median(replicator.seconds), 6)
    if len(modes) > 1:
        for mode in modes:
            result[f"step_s_backup_{mode}"] = round(step_by_mode[mode], 6)
            result[f"overhead_{mode}"] = round(step_by_mode[mode] / step_plain - 1, 4)
        # The step time with backups, security on over off (minus one): the cost of security.
        ratio = step_by_mode["on"] / step_by_mode["off"] - 1
        result["security_cost"] = round(ratio, 4)
        result["within_10pct"] = abs(ratio) <= 0.10
    return result


# ---------------------------------------------------------------------- the sizing formula

#: How a rank's state splits (``rank_runtime.session.Parts.kind``): a ZeRO optimizer over a
#: replicated model, FSDP2/DTensor shards, or a plain optimizer over a replicated model.
KINDS = ("zero", "sharded", "replicated")


def sizing(
    kind: str,
    *,
    params: float,
    param_bytes: float,
    optimizer_bytes: float,
    world: int,
    redundancy: int,
    keep: int = 2,
    partition: float | None = None,
    held_unique: float | None = None,
) -> dict[str, float]:
    """The CPU bytes one rank holds for backups (docs/operations.md, "Sizing backup memory").

    ``params`` (P) parameters of ``param_bytes`` (p) bytes each and ``optimizer_bytes`` (o)
    bytes of optimizer state per parameter (fp32 Adam: 8), over ``world`` (W) ranks, each
    backup copied to ``redundancy`` (R) peers that keep ``keep`` steps of it. ``partition``:
    the parameters in this rank's ZeRO partition (ZeRO partitions whole tensors; default the
    balanced P/W); ``held_unique``: the sum of the U of the shards this rank holds copies of
    (default R·U, R shards the size of its own). The RNG and data position (a few KB per
    backup) are left out.

    - ``unique`` U: what only this rank has, its backup's size: ZeRO o·P/W, FSDP2 (p+o)·P/W,
      plain DDP 0;
    - ``replicated`` M: what every rank has alike, kept in its own memory only: ZeRO p·P,
      FSDP2 0, plain DDP (p+o)·P;
    - ``sent_per_backup``: R·U, what a rank sends its peers per backup;
    - ``own_unique`` 2U and ``own_replicated`` 2M: the two slots of each ``HotSnapshot``;
    - ``held`` (keep+1)·R·U: the peers' copies its store keeps (R shards on average, ``keep``
      steps each) and, per shard, the buffer evicted last, which the next copy arrives in;
    - ``sending`` 0: the replicator sends the slot's bytes as they are (no serialized copy);
    - ``total``: (2 + (keep+1)·R)·U + 2M.
    """
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {', '.join(KINDS)}")
    if world < 1 or redundancy < 0 or keep < 1:
        raise ValueError("world must be positive, redundancy >= 0, keep >= 1")
    if kind == "zero":
        share = params / world if partition is None else partition
        unique, replicated = optimizer_bytes * share, param_bytes * params
    elif kind == "sharded":
        unique, replicated = (param_bytes + optimizer_bytes) * params / world, 0.0
    else:
        unique, replicated = 0.0, (param_bytes + optimizer_bytes) * params
    parts = {
        "own_unique": 2 * unique,
        "own_replicated": 2 * replicated,
        "held": (keep + 1) * (redundancy * unique if held_unique is None else held_unique),
        "sending": 0.0,
    }
    return {
        "unique": unique,
        "replicated": replicated,
        "sent_per_backup": redundancy * unique,
        **parts,
        "total": sum(parts.values()),
    }


# ---------------------------------------------------------------------- the examples

_EXAMPLES = pathlib.Path(__file__).resolve().parents[1] / "examples"
EXAMPLES = ("ddp", "transformer", "mlp")


def _example(name: str) -> Any:
    """``examples/<name>.py`` as a module (the directory is on ``sys.path`` first, as when the
    script runs: ``transformer.py`` imports ``tinygpt`` beside it)."""
    if str(_EXAMPLES) not in sys.path:
        sys.path.insert(0, str(_EXAMPLES))
    return importlib.import_module(name)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _nbytes(state: object) -> int:
    return sum(t.numel() * t.element_size() for t in _tensor_leaves(state))


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


# ---------------------------------------------------------------------- ddp: train.py, ZeRO


@dataclasses.dataclass(frozen=True)
class _DdpConfig:
    world: int
    port: int
    features: int
    hidden: int
    global_batch: int
    steps: int
    every: int
    redundancy: int


def _ddp_rank(rank: int, config: _DdpConfig, out: Any) -> None:
    """One rank of ``examples/train.py``'s job (DDP + ZeRO Adam, gloo), backing up through a
    real ``Elastic`` (its ``backup``, its replicator thread, its peer store) to its peers."""
    import logging

    import torch.distributed as dist
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel

    from rank_runtime.ddp import prime_buckets
    from rank_runtime.elastic import Elastic, World
    from rank_runtime.identity import Identity
    from rank_runtime.session import Parts, unique_state
    from rank_runtime.snapshot import from_bytes
    from schemas.common import Role
    from schemas.events import JobPolicy

    torch.set_num_threads(1)
    logging.disable(logging.WARNING)  # no control plane: the client's warnings say so
    try:
        train = _example("train")
        args = train.arguments(None).parse_args(
            ["--features", str(config.features), "--hidden", str(config.hidden),
             "--global-batch", str(config.global_batch)]
        )  # fmt: skip
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{config.port}",
                                rank=rank, world_size=config.world)  # fmt: skip
        _, x, y, sampler = train.problem(args)
        net, *_ = train.problem(args)  # build(world), as train.py's
        model = DistributedDataParallel(net)
        prime_buckets(model, lambda ddp: ddp(x[:1]))
        optimizer = ZeroRedundancyOptimizer(net.parameters(), torch.optim.Adam, lr=args.lr)
        parts = Parts(model, optimizer)
        optimizer.register_step_pre_hook(lambda *_: elastic.settle())  # as the session does
        assert parts.kind == "zero"

        members = tuple(f"m{r}" for r in range(config.world))
        identity = Identity(job_id="bench-backup", node=f"node{rank}", rack="rack0",
                            member=members[rank], role=Role.WORKER,
                            nats_url="nats://127.0.0.1:1")  # fmt: skip
        policy = JobPolicy(redundancy=config.redundancy, backup_interval=config.every)
        elastic = Elastic(identity, policy=policy)
        endpoint = elastic.peers.start()
        endpoints: list[str] = [""] * config.world
        dist.all_gather_object(endpoints, endpoint)
        # A ring: rank r's shard goes to the next R ranks (what the control plane's placement
        # gives when every rank is on a node of its own).
        placement = tuple(
            tuple(members[(r + i) % config.world] for i in range(1, config.redundancy + 1))
            for r in range(config.world)
        )
        where = dict(zip(members, endpoints, strict=True))
        elastic.world = World(generation=1, rank=rank, size=config.world, members=members,
                              placement=placement, endpoints=where, rendezvous="")  # fmt: skip
        # Elastic.start() would start this thread after joining the job; no control plane here.
        replicator = threading.Thread(target=elastic._replicate, daemon=True)
        elastic._replicator = replicator
        replicator.start()
        owners = [o for o in range(config.world) if members[rank] in placement[o]]
        state = {"sampler": sampler}

        def train_step(step: int) -> None:  # train.py's
            index = torch.tensor(sampler.shard(step, rank, config.world), dtype=torch.long)
            per_sample = ((model(x[index]) - y[index]) ** 2).sum()
            loss = per_sample * (config.world / args.global_batch)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            total = per_sample.detach().clone()
            dist.all_reduce(total)
            sampler.step = step

        def backup(step: int) -> float:
            """What ``step_done`` does at a backup step; the seconds the step waits."""
            started = time.perf_counter()
            elastic.backup(step, unique_state(parts, state), parts.replicated(),
                           later=parts.stepped())  # fmt: skip
            return time.perf_counter() - started

        def replicated_everywhere(step: int) -> None:
            """Wait (untimed) until this rank holds its owners' copies of ``step``."""
            deadline = time.monotonic() + 60
            while any(elastic.peers.held(members[o], o, step) is None for o in owners):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"rank {rank}: copies of step {step} never arrived")
                time.sleep(0.002)
            dist.barrier()

        step = 0
        for _ in range(2 * config.every):
            step += 1
            train_step(step)
        plain: list[float] = []
        backed: list[float] = []
        blocking: list[float] = []
        for i in range(max(1, config.steps // config.every // 2)):
            for with_backup in (False, True, True, False) if i % 2 == 0 else (True, False):
                dist.barrier()
                started = time.perf_counter()
                if with_backup:
                    blocking.append(backup(step))
                for _ in range(config.every):
                    step += 1
                    train_step(step)
                elapsed = time.perf_counter() - started
                (backed if with_backup else plain).append(elapsed / config.every)
                if with_backup:
                    replicated_everywhere(step - config.every)

        # The measured backup: the last step's, with nothing trained after it.
        backup(step)
        replicated_everywhere(step)
        module = parts.module
        model_state = module.state_dict()
        chunks = [t.detach().numpy().tobytes()[:4096] for t in model_state.values()
                  if t.numel() * t.element_size() >= 64]  # fmt: skip
        sent = elastic.hot.to_bytes(step)
        own_replicated = elastic.hot_replicated.to_bytes(step)
        held_keys: list[list[str]] = []
        in_held = 0
        for o in owners:
            copy = elastic.peers.held(members[o], o, step)
            assert copy is not None
            held_keys.append(sorted(from_bytes(copy.data).state))
            in_held += sum(chunk in copy.data for chunk in chunks)
        unique = unique_state(parts, state)
        partition = optimizer._partition_parameters()[rank]  # type: ignore[attr-defined]
        result = {
            "rank": rank,
            "holders": len(placement[rank]),
            "unique_bytes": len(sent),
            "unique_tensor_bytes": _nbytes(unique),
            "zero_tensor_bytes": _nbytes(unique["zero"]),
            "partition_params": sum(p.numel() for g in partition for p in g["params"]),
            "replicated_bytes": len(own_replicated),
            "model_bytes": _nbytes(model_state),
            "sent_keys": sorted(from_bytes(sent).state),
            "held_keys": held_keys,
            # Chunks of the model's tensors found in what was sent (0) and, as a check that
            # the search finds them where they are, in this rank's own replicated backup.
            "model_chunks": len(chunks),
            "model_chunks_in_sent": sum(chunk in sent for chunk in chunks),
            "model_chunks_in_held": in_held,
            "model_chunks_in_own_replicated": sum(chunk in own_replicated for chunk in chunks),
            "memory": elastic.backup_memory(),
            "step_s_no_backup": _median(plain),
            "step_s_backup": _median(backed),
            "blocking_s": _median(blocking),
        }
        del sent, own_replicated
        dist.barrier()  # no holder leaves while a peer still reads it
        elastic.close()
        out.put(json.dumps(result))
    except BaseException as exc:
        out.put(json.dumps({"rank": rank, "error": f"{type(exc).__name__}: {exc}"}))
        raise


def _run_ddp(
    *,
    params_mb: float,
    world: int,
    steps: int,
    every: int,
    redundancy: int,
    progress: bool,
) -> dict[str, Any]:
    """``examples/train.py``'s job on ``world`` gloo ranks; its backups measured and predicted."""
    if world < 2 or not 1 <= redundancy < world:
        raise ValueError("the ddp example needs world >= 2 and 1 <= replicas < world")
    features = 256
    # train.py's model: Linear(features, hidden), Tanh, Linear(hidden, 1).
    hidden = max(8, round(params_mb * MIB / 4 / (features + 2)))
    config = _DdpConfig(world=world, port=_free_port(), features=features, hidden=hidden,
                        global_batch=64, steps=steps, every=every,
                        redundancy=redundancy)  # fmt: skip
    params = features * hidden + 2 * hidden + 1
    _progress(progress, f"bench backup: examples/train.py, {params:,} parameters, DDP + ZeRO"
                        f" Adam on {world} gloo ranks, redundancy {redundancy}")  # fmt: skip
    context = multiprocessing.get_context("spawn")
    out = context.SimpleQueue()
    env = {"OMP_NUM_THREADS": "1", "ELASTIC_JOB_SECRET": ""}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        processes = [
            context.Process(target=_ddp_rank, args=(r, config, out), daemon=True)
            for r in range(world)
        ]
        for process in processes:
            process.start()
        ranks = [json.loads(out.get()) for _ in range(world)]
        for process in processes:
            process.join(60)
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    errors = [r["error"] for r in ranks if "error" in r]
    if errors:
        raise RuntimeError(f"bench backup ranks failed: {'; '.join(errors)}")
    ranks.sort(key=lambda r: r["rank"])
    optimizer_bytes = 8  # Adam's exp_avg and exp_avg_sq, fp32
    shares = [r["partition_params"] for r in ranks]
    predicted = [
        sizing("zero", params=params, param_bytes=4, optimizer_bytes=optimizer_bytes,
               world=world, redundancy=redundancy, partition=shares[r],
               # the ring: rank r holds the shards of the R ranks before it
               held_unique=sum(optimizer_bytes * shares[(r - i) % world]
                               for i in range(1, redundancy + 1)))
        for r in range(world)
    ]  # fmt: skip
    balanced = sizing("zero", params=params, param_bytes=4, optimizer_bytes=optimizer_bytes,
                      world=world, redundancy=redundancy)  # fmt: skip
    sent = [r["holders"] * r["unique_bytes"] for r in ranks]
    formula_sent = [p["sent_per_backup"] for p in predicted]
    memory = [r["memory"] for r in ranks]
    plain = _median([r["step_s_no_backup"] for r in ranks])
    backed = _median([r["step_s_backup"] for r in ranks])
    model_bytes = ranks[0]["model_bytes"]
    return {
        "example": "ddp",
        "kind": "zero",
        "world": world,
        "redundancy": redundancy,
        "params": params,
        "every": every,
        "steps": steps,
        "model_bytes": model_bytes,
        "bytes_replicated_per_backup": sent,
        "formula_bytes_replicated_per_backup": [round(v) for v in formula_sent],
        # Measured minus predicted: each snapshot's RNG state (5 KB), data position, header
        # and skeleton, which the formula leaves out, times R.
        "formula_difference_bytes": [round(s - f) for s, f in zip(sent, formula_sent, strict=True)],
        "bytes_replicated_per_backup_total": sum(sent),
        "formula_bytes_replicated_per_backup_total": round(sum(formula_sent)),
        "formula_balanced_bytes_replicated_per_backup": round(balanced["sent_per_backup"]),
        "unique_bytes": [r["unique_bytes"] for r in ranks],
        "zero_tensor_bytes": [r["zero_tensor_bytes"] for r in ranks],
        "partition_params": [r["partition_params"] for r in ranks],
        "replicated_bytes": [r["replicated_bytes"] for r in ranks],
        "sent_keys": ranks[0]["sent_keys"],
        "model_replicated": any(
            r["model_chunks_in_sent"] or r["model_chunks_in_held"] or "model" in r["sent_keys"]
            for r in ranks
        ),
        "model_chunks": ranks[0]["model_chunks"],
        "model_chunks_in_sent": sum(r["model_chunks_in_sent"] for r in ranks),
        "model_chunks_in_held": sum(r["model_chunks_in_held"] for r in ranks),
        "model_chunks_in_own_replicated": min(r["model_chunks_in_own_replicated"] for r in ranks),
        "backup_memory": memory,
        "formula_backup_memory": [round(p["total"]) for p in predicted],
        "step_s_no_backup": round(plain, 6),
        "step_s_backup": round(backed, 6),
        "overhead": round(backed / plain - 1, 4),
        "blocking_s": round(_median([r["blocking_s"] for r in ranks]), 6),
    }


# ---------------------------------------------------------------------- transformer: FSDP2


def _tcp_sink() -> None:
    """Receive length-prefixed blobs into one reused buffer, answering one byte each, until
    stdin closes: the plain-socket baseline's receiver, in a process of its own."""
    listener = socket.create_server(("127.0.0.1", 0))
    print(json.dumps(listener.getsockname()[1]), flush=True)
    buffer = bytearray()

    def serve() -> None:
        nonlocal buffer
        while True:
            conn, _ = listener.accept()
            with conn:
                head = bytearray(8)
                view = memoryview(head)
                got = 0
                while got < 8:
                    got += conn.recv_into(view[got:])
                size = int.from_bytes(head, "little")
                if len(buffer) < size:
                    buffer = bytearray(size)
                view = memoryview(buffer)[:size]
                got = 0
                while got < size:
                    n = conn.recv_into(view[got:])
                    if not n:
                        break
                    got += n
                conn.sendall(b"k")

    threading.Thread(target=serve, daemon=True).start()
    sys.stdin.read()


class _Sink:
    """The plain-socket receiver (``_tcp_sink``) in a process of its own."""

    def __enter__(self) -> _Sink:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "rank_runtime.bench_backup", "--tcp-sink"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        assert self.process.stdout is not None
        self.port = int(json.loads(self.process.stdout.readline()))
        return self

    def send(self, data: bytes | memoryview) -> float:
        """Seconds to send ``data`` (length first) and hear back: plain sendall/recv_into."""
        started = time.perf_counter()
        with socket.create_connection(("127.0.0.1", self.port), timeout=60) as sock:
            sock.sendall(len(data).to_bytes(8, "little"))
            sock.sendall(data)
            if sock.recv(1) != b"k":
                raise RuntimeError("the TCP sink did not answer")
        return time.perf_counter() - started

    def __exit__(self, *exc: object) -> None:
        assert self.process.stdin is not None and self.process.stdout is not None
        self.process.stdin.close()
        self.process.wait(30)
        self.process.stdout.close()


def _run_transformer(
    *,
    params_mb: float,
    steps: int,
    every: int,
    global_batch: int,
    redundancy: int,
    rounds: int,
    progress: bool,
) -> dict[str, Any]:
    """``examples/tinygpt.py``'s model under FSDP2 (one gloo rank, in this process), backed up
    as a ``Session`` does; the replicator's path against plain sockets, the same bytes."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from rank_runtime.session import Parts, unique_state

    if redundancy < 1:
        raise ValueError("the transformer example sends to at least one peer (replicas >= 1)")
    torch.set_num_threads(1)
    tinygpt = _example("tinygpt")
    layers, seq = 2, 64
    # TinyGPT: about 12 * layers * dim**2 parameters in the blocks, plus the embeddings.
    dim = max(64, int(math.sqrt(params_mb * MIB / 4 / (12 * layers))) // 64 * 64)
    if dist.is_initialized():
        raise RuntimeError("bench backup --example transformer needs a process without a group")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}",
                            rank=0, world_size=1)  # fmt: skip
    try:
        net = tinygpt.build_model(256, dim, layers, dim // 64, seq, 0)
        model = tinygpt.shard(net, init_device_mesh("cpu", (1,), mesh_dim_names=("dp",)))
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
        data = tinygpt.TextData(seq, global_batch, seed=0)
        parts = Parts(model, optimizer)
        assert parts.kind == "sharded" and parts.replicated() is None
        params = sum(p.numel() for p in model.parameters())
        state = {"sampler": data.sampler}
        _progress(progress, f"bench backup: examples/tinygpt.py, {params:,} parameters"
                            f" (dim {dim}, {layers} layers) under FSDP2, AdamW,"
                            f" {redundancy} peer stores")  # fmt: skip

        def train_step(step: int) -> None:
            inputs, targets = data.batch(step)
            loss = tinygpt.step_loss(model, inputs, targets, 1, global_batch)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            data.sampler.step = step

        hot = HotSnapshot()
        # As the session does: what the optimizer's step writes is copied beside the next
        # forward and backward, and the step waits for it (that wait is timed: it blocks).
        waited = [0.0]

        def settle(*_: object) -> None:
            started = time.perf_counter()
            hot.settle()
            waited[0] += time.perf_counter() - started

        optimizer.register_step_pre_hook(settle)
        step = 0
        for _ in range(2):
            step += 1
            train_step(step)
        first = hot.take(step, unique_state(parts, state))  # allocates both slots
        assert first is not None
        takes: list[float] = []
        settles: list[float] = []
        plain: list[float] = []
        backed: list[float] = []
        with _Replicator(hot, redundancy) as replicator:

            def block(with_backup: bool) -> float:
                nonlocal step
                started = time.perf_counter()
                info = None
                if with_backup:
                    info = hot.take(step, unique_state(parts, state), later=parts.stepped())
                    if info is not None:
                        replicator.steps.put(step)
                waited[0] = 0.0
                for _ in range(every):
                    step += 1
                    train_step(step)
                elapsed = time.perf_counter() - started
                if info is not None:  # what the step waited for: the take and its settle
                    takes.append(info.seconds)
                    settles.append(waited[0])
                replicator.steps.join()  # untimed: training never waits for it
                return elapsed

            block(True)  # warm up both kinds of block
            block(False)
            groups = max(1, steps // every // 4)
            for i in range(groups):
                for kind in (False, True, True, False):
                    (backed if kind else plain).append(block(kind) / every)
                _progress(progress, f"  training: {i + 1}/{groups} ABBA groups")
            during = list(replicator.phases)
            # The replicator's path against plain sockets, the same bytes, alternating, with
            # training paused (so neither competes with it for the two cores).
            payload = hot.to_bytes(hot.steps()[0])
            nbytes = len(payload)
            tcp: list[float] = []
            replicator.phases.clear()
            replicator.fresh = True
            with _Sink() as sink:
                sink.send(payload)
                for i in range(rounds):
                    for plain_first in (i % 2 == 0, i % 2 == 1):
                        if plain_first:
                            tcp.append(sink.send(payload))
                        else:
                            replicator.steps.put(hot.steps()[0])
                            replicator.steps.join()
            del payload
            isolated = list(replicator.phases)
            # The copy's own rate, untimed in the blocks: whole takes, nothing left behind.
            copies = []
            for _ in range(rounds):
                info = hot.take(step, unique_state(parts, state))
                if info is not None:
                    copies.append(info.seconds)
        if replicator.errors:
            raise RuntimeError(f"replication failed: {replicator.errors[0]}")
    finally:
        dist.destroy_process_group()
    unique_bytes = hot.nbytes(hot.steps()[0])
    formula = sizing("sharded", params=params, param_bytes=4, optimizer_bytes=8, world=1,
                     redundancy=redundancy)  # fmt: skip
    step_plain, step_backed = _median(plain), _median(backed)
    take_s, settle_s = _median(takes), _median(settles)
    blocking_s = _median([a + b for a, b in zip(takes, settles, strict=True)])
    serialize_s = _median([p[0] for p in isolated])
    digest_s = _median([p[1] for p in isolated])
    send_s = _median([p[2] for p in isolated]) / redundancy  # to one holder
    tcp_s = _median(tcp)
    # One copy over the replicator's wire path (``send``: the header, the slot's bytes, the
    # holder receiving them into a reused buffer and answering) against plain sockets.
    replication_gbps = nbytes / send_s / GB
    tcp_gbps = nbytes / tcp_s / GB
    # A whole replication, per copy: serialized and digested once, sent to every holder.
    replicator_gbps = redundancy * nbytes / (serialize_s + digest_s + redundancy * send_s) / GB
    return {
        "example": "transformer",
        "kind": "sharded",
        "world": 1,
        "redundancy": redundancy,
        "params": params,
        "dim": dim,
        "layers": layers,
        "tokens_per_step": global_batch * seq,
        "every": every,
        "steps": len(plain) * every,
        "unique_bytes": unique_bytes,
        "state_mb": round(unique_bytes / MIB, 3),
        "formula_unique_bytes": round(formula["unique"]),
        "step_s_no_backup": round(step_plain, 6),
        "step_s_backup": round(step_backed, 6),
        "overhead": round(step_backed / step_plain - 1, 4),
        "overhead_target_met": step_backed / step_plain - 1 <= 0.01,
        "take_share": round(blocking_s / (every * step_plain), 4),
        "take_s": round(take_s, 6),
        "settle_s": round(settle_s, 6),
        "blocking_ms_per_gb": round(blocking_s * 1e3 / (unique_bytes / GB), 3),
        "snapshot_gbps": round(first.nbytes / _median(copies) / GB, 3),
        "replicate_s_during_training": round(_median([sum(p) for p in during]), 6),
        "serialize_s": round(serialize_s, 6),
        "digest_s": round(digest_s, 6),
        "send_s": round(send_s, 6),
        "tcp_loopback_s": round(tcp_s, 6),
        # What the protocol and the holder add to a plain transfer (header, MAC, answer).
        "holder_extra_s": round(send_s - tcp_s, 6),
        "serialize_gbps": round(nbytes / serialize_s / GB, 3),
        "digest_gbps": round(nbytes / digest_s / GB, 3),
        "replication_gbps": round(replication_gbps, 3),
        "tcp_loopback_gbps": round(tcp_gbps, 3),
        "replication_fraction": round(replication_gbps / tcp_gbps, 3),
        "replication_target_met": replication_gbps >= 0.8 * tcp_gbps,
        "replicator_gbps": round(replicator_gbps, 3),
        "replication_errors": len(replicator.errors),
        "reserved_mb": round(hot.reserved_bytes / MIB, 3),
    }


def run_backup_bench(
    *,
    example: str | None = None,
    params_mb: float | None = None,
    steps: int | None = None,
    every: int = 10,
    batch: int | None = None,
    replicas: int | None = None,
    world: int = 4,
    rounds: int = 5,
    security: str | None = None,
    progress: bool = True,
) -> dict[str, Any]:
    """The ``example``'s bench (``ddp``: examples/train.py's split over ``world`` gloo ranks;
    ``transformer``: examples/tinygpt.py under FSDP2; ``mlp``: one process, the overhead and
    security bench; None: ``mlp`` with ``security``, else ``ddp``); its JSON result."""
    if example is None:
        example = "mlp" if security is not None else "ddp"
    if example not in EXAMPLES:
        raise ValueError(f"example must be one of {', '.join(EXAMPLES)}")
    if security is not None and security not in SECURITY_MODES:
        raise ValueError(f"security must be one of {', '.join(SECURITY_MODES)}")
    if security is not None and example != "mlp":
        raise ValueError("security applies to --example mlp")
    given = [v for v in (params_mb, steps, batch) if v is not None]
    if every < 1 or any(v <= 0 for v in given):
        raise ValueError("params_mb, steps, every and batch must be positive")
    if example == "mlp":
        return _run_mlp(params_mb=params_mb or 4.0, steps=steps or 1000, every=every,
                        batch=batch or 64, replicas=replicas or 0, security=security,
                        progress=progress)  # fmt: skip
    redundancy = 2 if replicas is None else replicas
    if example == "ddp":
        return _run_ddp(params_mb=params_mb or 4.0, world=world, steps=steps or 200,
                        every=every, redundancy=redundancy, progress=progress)  # fmt: skip
    return _run_transformer(params_mb=params_mb or 100.0, steps=steps or 80, every=every,
                            global_batch=batch or 8, redundancy=redundancy, rounds=rounds,
                            progress=progress)  # fmt: skip


if __name__ == "__main__":  # python -m rank_runtime.bench_backup --tcp-sink
    if sys.argv[1:] == ["--tcp-sink"]:
        _tcp_sink()
    else:
        sys.exit("usage: python -m rank_runtime.bench_backup --tcp-sink")
