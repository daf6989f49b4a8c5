"""Cold checkpoints in DCP's format: when they are due, exact round trips, the atomic commit,
digests, pruning, the background writer, and FSDP2 state restored into another world size."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import textwrap
import threading
import warnings
from collections import OrderedDict
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from rank_runtime import checkpoint
from rank_runtime.checkpoint import CheckpointError, ColdWriter, Saved
from tests.groups import leave_group

ROOT = Path(__file__).resolve().parents[2]


def _state() -> dict[str, Any]:
    """What a DDP rank's cold checkpoint holds: its unique state and the replicated part."""
    torch.manual_seed(0)
    model: OrderedDict[str, Any] = OrderedDict(
        w=torch.randn(4, 3), half=torch.randn(5, dtype=torch.bfloat16), empty=torch.zeros(0, 2)
    )
    model._metadata = {"": {"version": 1}}  # type: ignore[attr-defined]
    view = torch.arange(10.0)[2:5]  # a view: only its own elements are written
    optimizer = {
        "state": {0: {"step": torch.tensor(7.0), "exp_avg": torch.randn(4, 3)}},
        "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "params": [0, 1]}],
    }
    unique = {
        "state": {"sampler": {"epoch": 2, "seen": b"\x00\x01", None: 1.5, 3: [True, "x"]}},
        "rng": {"cpu": torch.get_rng_state()},
        "view": view,
        "again": view,
    }
    return {"unique": unique, "__replicated__": {"model": model, "optimizer": optimizer}}


def _same_tree(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return list(a) == list(b) and all(_same_tree(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(_same_tree(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def _files(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


def test_every_m_backups_on_every_rank_alike():
    due = [s for s in range(1, 61) if checkpoint.is_due(s, backup_interval=5, every=3)]
    assert due == [15, 30, 45, 60]
    assert not any(checkpoint.is_due(s, 5, 0) for s in range(1, 61))  # 0: never


def test_a_shard_is_a_dcp_checkpoint_that_reads_back_exactly(tmp_path):
    state = _state()
    saved = checkpoint.write(tmp_path, "job", 20, shard=1, shards=4, state=state)
    step = tmp_path / "job" / "step-000000020"
    manifest = step / "shard-00001-of-00004.pt"
    [data] = step.glob("shard-00001-of-00004.*.distcp")
    assert _files(step) == sorted([manifest.name, data.name])  # nothing staged is left
    assert saved.path == str(manifest)
    assert saved.nbytes == manifest.stat().st_size + data.stat().st_size
    assert saved.checksum.startswith("sha256:") and len(saved.checksum) == 7 + 64
    # The manifest names the data file and carries DCP's own metadata for it.
    body = torch.load(manifest, weights_only=True)
    assert json.loads(body["header"])["data"] == data.name
    metadata = pickle.loads(body["metadata"])
    assert {info.relative_path for info in metadata.storage_data.values()} == {data.name}
    assert set(metadata.state_dict_metadata) == {"shard-00001/__rest__"}  # no capture in it
    loaded = checkpoint.read(tmp_path, "job", 20, 1)
    assert (loaded.path, loaded.nbytes, loaded.checksum) == (manifest, saved.nbytes, saved.checksum)
    assert _same_tree(loaded.state, state)  # types, keys, dtypes and bits
    assert loaded.state["unique"]["view"].untyped_storage().nbytes() == 3 * 4  # not the base
    model = loaded.state["__replicated__"]["model"]
    assert model._metadata == {"": {"version": 1}}
    assert loaded.state["unique"]["again"] is loaded.state["unique"]["view"]
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
    # Shard 0 of step 20, moved to where shard 0 of step 10 belongs.
    saved = checkpoint.write(tmp_path, "job", 20, shard=0, shards=2, state={"x": torch.ones(2)})
    for path in Path(saved.path).parent.iterdir():
        os.replace(path, bad.parent / path.name)
    with pytest.raises(CheckpointError, match="is not shard 0 of step 10"):
        checkpoint.read(tmp_path, "job", 10, 0)


def test_a_corrupted_file_is_refused_by_its_digest(tmp_path):
    saved = checkpoint.write(tmp_path, "job", 10, shard=0, shards=1, state=_state())
    manifest = Path(saved.path)
    [data] = manifest.parent.glob("*.distcp")
    original = data.read_bytes()
    flipped = bytearray(original)
    flipped[len(flipped) // 2] ^= 0x01  # one bit, in a tensor's bytes or in an object's
    data.write_bytes(bytes(flipped))
    with pytest.raises(CheckpointError, match="does not match its digest"):
        checkpoint.read(tmp_path, "job", 10, 0)
    with pytest.raises(CheckpointError, match="does not match its digest"):
        checkpoint.step_reader(tmp_path, "job", 10)
    data.write_bytes(original[:-1])  # truncated
    with pytest.raises(CheckpointError, match="does not match its digest"):
        checkpoint.read(tmp_path, "job", 10, 0)
    data.write_bytes(original)
    assert _same_tree(checkpoint.read(tmp_path, "job", 10, 0).state, _state())
    # The metadata (what says where each tensor is) is covered too.
    body = torch.load(manifest, weights_only=True)
    metadata = pickle.loads(body["metadata"])
    metadata.storage_meta = None
    body["metadata"] = pickle.dumps(metadata)
    torch.save(body, manifest)
    with pytest.raises(CheckpointError, match="does not match its digest"):
        checkpoint.read(tmp_path, "job", 10, 0)


_CRASH = """
import os, sys, torch
torch.set_num_threads(1)
from rank_runtime import checkpoint
def die(*args):
    os._exit(3)  # the writer dies here: no cleanup, no event
setattr(os, sys.argv[2], die)
checkpoint.write(sys.argv[1], "job", 30, shard=0, shards=2, state={"w": torch.ones(64)})
"""


@pytest.mark.parametrize(
    ("at", "left_behind"),
    [("fsync", "shard-00000-of-00002.*.distcp"), ("replace", ".shard-00000-of-00002.*.tmp")],
    ids=["syncing-the-data", "renaming-the-manifest"],
)
def test_a_crash_mid_write_leaves_no_shard_that_counts(tmp_path, at, left_behind):
    checkpoint.write(tmp_path, "job", 30, shard=1, shards=2, state={"w": torch.zeros(64)})
    died = subprocess.run([sys.executable, "-c", textwrap.dedent(_CRASH), str(tmp_path), at],
                          cwd=ROOT, capture_output=True, timeout=60)  # fmt: skip
    assert died.returncode == 3, died.stderr.decode()
    step = checkpoint.step_dir(tmp_path, "job", 30)
    assert list(step.glob(left_behind))  # the dead writer's files...
    assert "shard-00000-of-00002.pt" not in _files(step)  # ...and no manifest: nothing counts
    with pytest.raises(CheckpointError, match="no shard 0 of the step 30"):
        checkpoint.read(tmp_path, "job", 30, 0)
    # The checkpoint is incomplete: shard 1 alone counts, and a complete reader is refused.
    assert sorted(checkpoint._world_of(tmp_path, "job", 30)[1]) == [1]
    with pytest.raises(CheckpointError, match=r"lacks shards \[0\] of 2"):
        checkpoint.step_reader(tmp_path, "job", 30)
    # The next write of that shard commits and clears what the dead writer left.
    checkpoint.write(tmp_path, "job", 30, shard=0, shards=2, state={"w": torch.ones(64)})
    assert len([n for n in _files(step) if n.startswith("shard-00000-of-00002.")]) == 2
    assert not [n for n in _files(step) if n.startswith(".")]
    assert torch.equal(checkpoint.read(tmp_path, "job", 30, 0).state["w"], torch.ones(64))


def test_a_rewrite_replaces_the_shard_atomically(tmp_path):
    first = checkpoint.write(tmp_path, "job", 10, shard=0, shards=1, state={"v": 1})
    second = checkpoint.write(tmp_path, "job", 10, shard=0, shards=1, state={"v": 2})
    assert first.path == second.path and first.checksum != second.checksum
    assert len(list(Path(second.path).parent.glob("*.distcp"))) == 1  # the first one's went
    assert checkpoint.read(tmp_path, "job", 10, 0).state == {"v": 2}


def test_a_shard_keeps_its_two_newest_checkpoints(tmp_path):
    for step in (10, 20, 30):
        for shard in (0, 1):
            if (step, shard) != (30, 1):  # shard 1 never finished step 30
                checkpoint.write(tmp_path, "job", step, shard=shard, shards=2, state=step)
        if step == 10:  # a writer of shard 0 died in step 10: what it left goes with the step
            (checkpoint.step_dir(tmp_path, "job", 10) / ".shard-00000-of-00002.dead.tmp").touch()
        for shard in (0, 1):
            checkpoint.prune(tmp_path, "job", shard)
    job = tmp_path / "job"
    left = sorted(p.relative_to(job).as_posix() for p in job.rglob("*.pt"))
    # Each shard keeps its own two newest: step 20 stays complete while step 30 is partial.
    assert left == [
        "step-000000010/shard-00001-of-00002.pt",
        "step-000000020/shard-00000-of-00002.pt",
        "step-000000020/shard-00001-of-00002.pt",
        "step-000000030/shard-00000-of-00002.pt",
    ]
    assert sorted(p.parent.name + "/" + p.name.split(".")[0] for p in job.rglob("*.distcp")) == [
        s.removesuffix(".pt") for s in left
    ]
    assert not [n for n in _files(job / "step-000000010") if n.startswith(".")]
    assert checkpoint.shards_at(tmp_path, "job", 30) == [0, 1]  # its world, not its count


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
    assert torch.equal(checkpoint.read(tmp_path, "job", 20, 0).state["x"], torch.ones(3))


# -- FSDP2: written by 2 ranks, restored into 1 -----------------------------------------------


def _fsdp_worker(rank: int, port: int, tmp_dir: str) -> None:
    torch.set_num_threads(1)
    from rank_runtime import sharded
    from rank_runtime.snapshot import HotSnapshot
    from tests.unit.test_sharded import _build, _full_state, _train_step

    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2,
                            timeout=timedelta(seconds=60))  # fmt: skip
    try:
        model, opt, dp = _build(2)
        for step in range(3):
            _train_step(model, opt, dp, step)
        # What a session backs up for FSDP2 (its unique state), through the hot snapshot.
        hot = HotSnapshot()
        rng = {"cpu": torch.get_rng_state()}
        unique = {"sharded": sharded.capture(model, opt), "state": {}, "rng": rng}
        assert hot.take(3, unique) is not None
        checkpoint.write(tmp_dir, "job", 3, shard=rank, shards=2, state=hot.get(3).state)
        full = _full_state(model, opt)
        if rank == 0:
            torch.save(full, Path(tmp_dir) / "full.pt")
    finally:
        leave_group()
        store.set(f"exit-{rank}", "1")  # rank 0 hosts the store: it leaves last
        store.wait(["exit-0", "exit-1"])


def test_fsdp2_state_written_by_two_ranks_restores_into_one(tmp_path):
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
    from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

    from rank_runtime import sharded
    from tests.unit.test_sharded import _build, _free_port, _full_state, _same

    torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.start_processes(_fsdp_worker, args=(_free_port(), str(tmp_path)), nprocs=2,
                       start_method="spawn")  # fmt: skip
    full = torch.load(tmp_path / "full.pt", weights_only=True)
    assert checkpoint.shards_at(tmp_path, "job", 3) == [0, 1]
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        # The runtime's way: each shard read back whole, resharded by sharded.load (2 -> 1).
        shards = {r: checkpoint.read(tmp_path, "job", 3, r).state["sharded"] for r in (0, 1)}
        model, opt, _ = _build(1, seed=1, lr=0.5)
        sharded.load(model, opt, shards)
        assert _same(_full_state(model, opt), full) == []
        # The shards together are a DCP checkpoint of the model: DCP's own planner loads it.
        fresh, _, _ = _build(1, seed=2)
        target = {"model": get_model_state_dict(fresh)}
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp_load(target, storage_reader=checkpoint.step_reader(tmp_path, "job", 3),
                     no_dist=True)  # fmt: skip
        set_model_state_dict(fresh, target["model"])
        for name, param in fresh.named_parameters():
            assert torch.equal(param.full_tensor(), full[name]), name
    finally:
        dist.destroy_process_group()
