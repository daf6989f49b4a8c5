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

With ``replicas`` > 0 a background thread plays the replicator after every snapshot: it
computes the checksum and streams the serialized snapshot that many times into a memory sink,
as a stand-in for the peer transport (which this benchmark does not include). It runs during
the snapshot's block, which awaits it at its end, so its interference counts in ``overhead``.
"""

from __future__ import annotations

import math
import queue
import statistics
import sys
import threading
import time
from typing import Any

import torch

from rank_runtime.snapshot import HotSnapshot

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
    """Checksum and stream each new snapshot ``replicas`` times into memory, off the loop."""

    def __init__(self, hot: HotSnapshot, replicas: int) -> None:
        self.hot = hot
        self.replicas = replicas
        self.steps: queue.Queue[int | None] = queue.Queue()
        self.seconds: list[float] = []
        self.sink = bytearray()
        self.thread = threading.Thread(target=self._run, name="replicator", daemon=True)

    def _run(self) -> None:
        while (step := self.steps.get()) is not None:
            started = time.perf_counter()
            self.hot.checksum(step)
            for _ in range(self.replicas):
                size = self.hot.nbytes(step)
                if len(self.sink) < size:
                    self.sink = bytearray(size)
                position = 0
                for chunk in self.hot.iter_bytes(step, chunk_bytes=MIB):
                    self.sink[position : position + len(chunk)] = chunk
                    position += len(chunk)
            self.seconds.append(time.perf_counter() - started)
            self.steps.task_done()

    def __enter__(self) -> _Replicator:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.steps.put(None)
        self.thread.join()


def run_backup_bench(
    *,
    params_mb: float = 4.0,
    steps: int = 1000,
    every: int = 10,
    batch: int = 64,
    replicas: int = 0,
    progress: bool = True,
) -> dict[str, Any]:
    """Train with and without a snapshot every ``every`` steps; return the JSON result."""
    if params_mb <= 0 or steps < 1 or every < 1 or batch < 1 or replicas < 0:
        raise ValueError("params_mb, steps, every and batch must be positive, replicas >= 0")
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

    def block(with_backup: bool, replicator: _Replicator | None) -> tuple[float, float | None]:
        """Run a snapshot (or not), then ``every`` steps; return the block's and take's times.

        A replication runs during the block of its snapshot and is awaited at its end, so its
        interference is charged to that block and not to a plain one.
        """
        nonlocal step
        started = time.perf_counter()
        take_s = None
        if with_backup:
            info = hot.take(step, rank_state(step))
            if info is not None:
                take_s = info.seconds
                if replicator is not None:
                    replicator.steps.put(step)
        for _ in range(every):
            train_step(step)
            step += 1
        sync()
        if replicator is not None:
            replicator.steps.join()
        return time.perf_counter() - started, take_s

    plain: list[float] = []
    backed: list[float] = []
    takes: list[float] = []
    groups = max(1, steps // every // 2)

    def train_phase(replicator: _Replicator | None) -> None:
        for _ in range(2):  # warm up both kinds of block
            block(False, replicator)
            block(True, replicator)
        for i in range(groups):
            for with_backup in (False, True, True, False):
                seconds, take_s = block(with_backup, replicator)
                (backed if with_backup else plain).append(seconds)
                if take_s is not None:
                    takes.append(take_s)
            if (i + 1) % max(1, groups // 5) == 0:
                _progress(progress, f"  training: {i + 1}/{groups} ABBA groups")

    replicator = _Replicator(hot, replicas) if replicas else None
    if replicator is not None:
        with replicator:
            train_phase(replicator)
    else:
        train_phase(None)

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
    step_backed = statistics.median(backed) / every
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
    if replicator is not None and replicator.seconds:
        result["replicate_s"] = round(statistics.median(replicator.seconds), 6)
    return result
