"""Cold checkpoints: the fallback when every hot copy of a shard is gone.

Every ``checkpoint_every`` backups (the job's policy) each rank writes the state it just
backed up to a directory every member can read (a shared filesystem in a real cluster),
from a background thread: ``torch.save`` into memory, a temporary file, ``fsync``, then an
atomic rename to ``<dir>/<job>/step-<N>/shard-<s>-of-<n>.pt``, and ``checkpoint.saved`` tells
the control plane. A shard keeps its two newest checkpoints, so a newer one that never
completes (its writer died first) leaves the older, complete one in place. The decider restores
from a checkpoint only when no complete hot backup survives; members then read the shards of
that step (``read``), the same way they would have fetched them from peers.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rank_runtime.replication import checksum

log = logging.getLogger(__name__)

CHECKPOINT_DIR_ENV = "ELASTIC_CHECKPOINT_DIR"
#: Checkpoint steps each shard keeps on disk.
KEEP = 2


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be read (missing, or not what it claims to be)."""


@dataclass(frozen=True, slots=True)
class Saved:
    """One shard of a checkpoint, durable in place."""

    step: int
    shard: int
    shards: int
    path: str
    nbytes: int
    checksum: str
    seconds: float


def is_due(step: int, backup_interval: int, every: int) -> bool:
    """True when the backup of ``step`` is also a cold checkpoint (the same steps on every
    rank, so checkpoints complete)."""
    return every > 0 and step % backup_interval == 0 and (step // backup_interval) % every == 0


def step_dir(root: str | Path, job_id: str, step: int) -> Path:
    return Path(root) / job_id / f"step-{step:09d}"


def shard_path(root: str | Path, job_id: str, step: int, shard: int, shards: int) -> Path:
    return step_dir(root, job_id, step) / f"shard-{shard:05d}-of-{shards:05d}.pt"


def write(
    root: str | Path, job_id: str, step: int, *, shard: int, shards: int, state: Any
) -> Saved:
    """Write ``state`` as shard ``shard`` of ``shards`` at ``step``; atomic and durable."""
    import torch

    started = time.perf_counter()
    buffer = io.BytesIO()
    torch.save({"step": step, "shard": shard, "shards": shards, "state": state}, buffer)
    data = buffer.getbuffer()
    target = shard_path(root, job_id, step, shard, shards)
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    with open(partial, "wb") as out:
        out.write(data)
        out.flush()
        os.fsync(out.fileno())
    os.replace(partial, target)
    directory = os.open(target.parent, os.O_RDONLY)
    try:
        os.fsync(directory)  # the rename itself is durable
    finally:
        os.close(directory)
    return Saved(step, shard, shards, str(target), len(data), checksum(data),
                 time.perf_counter() - started)  # fmt: skip


def shards_at(root: str | Path, job_id: str, step: int) -> list[int]:
    """Every shard of the checkpoint at ``step`` (its world size when it was written)."""
    names = sorted(step_dir(root, job_id, step).glob("shard-*-of-*.pt"))
    if not names:
        raise CheckpointError(f"no checkpoint of step {step} under {Path(root) / job_id}")
    return list(range(int(names[0].stem.rsplit("-of-", 1)[1])))


def read(root: str | Path, job_id: str, step: int, shard: int) -> tuple[Path, Any]:
    """Where shard ``shard`` of the checkpoint at ``step`` is, and its state."""
    import torch

    matches = sorted(step_dir(root, job_id, step).glob(f"shard-{shard:05d}-of-*.pt"))
    if not matches:
        raise CheckpointError(f"no shard {shard} of the step {step} checkpoint under {root}")
    path = matches[-1]
    try:
        saved = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as exc:
        raise CheckpointError(f"{path}: unreadable ({exc})") from exc
    if not isinstance(saved, dict) or saved.get("step") != step or saved.get("shard") != shard:
        raise CheckpointError(f"{path} is not shard {shard} of step {step}")
    return path, saved["state"]


def prune(root: str | Path, job_id: str, shard: int, keep: int = KEEP) -> None:
    """Delete this shard's checkpoints older than its ``keep`` newest (and emptied steps)."""
    job = Path(root) / job_id
    if not job.is_dir():
        return
    mine = sorted(job.glob(f"step-*/shard-{shard:05d}-of-*.pt"), key=lambda p: p.parent.name)
    for old in mine[:-keep] if keep > 0 else mine:
        old.unlink(missing_ok=True)
        with contextlib.suppress(OSError):  # only when no other shard is left in it
            old.parent.rmdir()


class ColdWriter:
    """Writes checkpoints from a background thread; training never waits on the disk.

    ``submit`` hands over a step whose state ``load`` will produce when the thread gets to
    it; when a write is still running, the newest submission replaces a waiting one.
    """

    def __init__(self, root: str | Path, job_id: str, on_saved: Callable[[Saved], None]) -> None:
        self.root = Path(root)
        self.job_id = job_id
        self.on_saved = on_saved
        self._queue: queue.Queue[tuple[int, int, int, Callable[[], Any]] | None] = queue.Queue(1)
        self._thread = threading.Thread(target=self._run, name="elastic-checkpoint", daemon=True)
        self._thread.start()

    def submit(self, step: int, shard: int, shards: int, load: Callable[[], Any]) -> None:
        item = (step, shard, shards, load)
        try:
            self._queue.put_nowait(item)
        except queue.Full:
            with contextlib.suppress(queue.Empty):
                dropped = self._queue.get_nowait()
                skipped = dropped[0] if dropped else None
                log.warning("cold checkpoint of step %s skipped: the disk lags", skipped)
            self._queue.put_nowait(item)

    def close(self, timeout: float = 60.0) -> None:
        """Finish the write in progress (and a waiting one), then stop."""
        if not self._thread.is_alive():
            return
        self._queue.put(None)
        self._thread.join(timeout)

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            step, shard, shards, load = item
            try:
                state = load()
                saved = write(self.root, self.job_id, step, shard=shard, shards=shards, state=state)
                prune(self.root, self.job_id, shard)
            except Exception as exc:  # a full disk must not kill training
                log.warning("cold checkpoint of step %d failed: %s", step, exc)
                continue
            self.on_saved(saved)
