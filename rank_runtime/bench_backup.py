"""``elasticctl bench backup``: what hot snapshots cost a training loop, and how fast they copy.

A small MLP trains with Adam on synthetic data (one CPU thread, or the GPU when there is one).
Blocks of ``every`` steps alternate (ABBA, so drift cancels) between plain training and training
after one ``HotSnapshot.take`` of the whole rank state (model, optimizer, RNG, data position):
the snapshot's cost is amortized over the block, as with a backup every ``every`` steps.
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
member does: it serializes the snapshot, computes its sha256 digest and sends it over loopback
TCP to that many real peer stores (``rank_runtime.replication``, in a process of their own, as
the members of other nodes are), each of which hashes what it receives and keeps it. It runs
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
import json
import math
import os
import queue
import statistics
import subprocess
import sys
import threading
import time
from typing import Any

import torch

from rank_runtime.replication import ReplicationError, digest, send
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
        self.errors: list[str] = []
        self.thread = threading.Thread(target=self._run, name="replicator", daemon=True)

    def _run(self) -> None:
        while (step := self.steps.get()) is not None:
            started = time.perf_counter()
            try:
                data = self.hot.to_bytes(step)
                reported = digest(data, self.algorithm)
                for endpoint in self.endpoints:
                    send(endpoint, owner="bench", shard=0, step=step, generation=1,
                         data=data, digest=reported, secret=self.secret)  # fmt: skip
                self.seconds.append(time.perf_counter() - started)
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


def run_backup_bench(
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
