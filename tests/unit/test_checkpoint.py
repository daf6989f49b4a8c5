"""Cold checkpoints: when they are due, atomic writes, reads, pruning, the background writer."""

from __future__ import annotations

import threading

import pytest
import torch

from rank_runtime import checkpoint
from rank_runtime.checkpoint import CheckpointError, ColdWriter, Saved
from rank_runtime.replication import checksum


def test_every_m_backups_on_every_rank_alike():
    due = [s for s in range(1, 61) if checkpoint.is_due(s, backup_interval=5, every=3)]
    assert due == [15, 30, 45, 60]
    assert not any(checkpoint.is_due(s, 5, 0) for s in range(1, 61))  # 0: never


def test_a_written_shard_reads_back_and_nothing_partial_is_left(tmp_path):
    state = {"w": torch.arange(6.0).reshape(2, 3), "step": 20}
    saved = checkpoint.write(tmp_path, "job", 20, shard=1, shards=4, state=state)
    path = tmp_path / "job" / "step-000000020" / "shard-00001-of-00004.pt"
    assert saved.path == str(path)
    assert saved.nbytes == path.stat().st_size
    assert saved.checksum == checksum(path.read_bytes())
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary file
    where, back = checkpoint.read(tmp_path, "job", 20, 1)
    assert where == path
    assert torch.equal(back["w"], state["w"]) and back["step"] == 20
    assert checkpoint.shards_at(tmp_path, "job", 20) == [0, 1, 2, 3]


def test_missing_or_foreign_files_are_clear_errors(tmp_path):
    with pytest.raises(CheckpointError, match="no shard 0 of the step 10"):
        checkpoint.read(tmp_path, "job", 10, 0)
    with pytest.raises(CheckpointError, match="no checkpoint of step 10"):
        checkpoint.shards_at(tmp_path, "job", 10)
    bad = checkpoint.shard_path(tmp_path, "job", 10, 0, 2)
    bad.parent.mkdir(parents=True)
    bad.write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointError, match="unreadable"):
        checkpoint.read(tmp_path, "job", 10, 0)
    torch.save({"step": 20, "shard": 0, "shards": 2, "state": 1}, bad)
    with pytest.raises(CheckpointError, match="is not shard 0 of step 10"):
        checkpoint.read(tmp_path, "job", 10, 0)


def test_a_shard_keeps_its_two_newest_checkpoints(tmp_path):
    for step in (10, 20, 30):
        for shard in (0, 1):
            if (step, shard) != (30, 1):  # shard 1 never finished step 30
                checkpoint.write(tmp_path, "job", step, shard=shard, shards=2, state=step)
        for shard in (0, 1):
            checkpoint.prune(tmp_path, "job", shard)
    left = sorted(p.relative_to(tmp_path / "job").as_posix()
                  for p in (tmp_path / "job").rglob("*.pt"))  # fmt: skip
    # Each shard keeps its own two newest: step 20 stays complete while step 30 is partial.
    assert left == [
        "step-000000010/shard-00001-of-00002.pt",
        "step-000000020/shard-00000-of-00002.pt",
        "step-000000020/shard-00001-of-00002.pt",
        "step-000000030/shard-00000-of-00002.pt",
    ]


def test_the_writer_works_in_the_background_and_survives_a_failed_write(tmp_path):
    saved: list[Saved] = []
    done = threading.Event()

    def on_saved(s: Saved) -> None:
        saved.append(s)
        if s.step == 20:
            done.set()

    writer = ColdWriter(tmp_path, "job", on_saved)
    writer.submit(10, 0, 1, lambda: 1 / 0)  # the state cannot be produced: logged, skipped
    writer.close()
    writer = ColdWriter(tmp_path, "job", on_saved)
    writer.submit(20, 0, 1, lambda: {"x": torch.ones(3)})
    assert done.wait(30)
    writer.close()
    assert [(s.step, s.shard, s.shards) for s in saved] == [(20, 0, 1)]
    assert torch.equal(checkpoint.read(tmp_path, "job", 20, 0)[1]["x"], torch.ones(3))
