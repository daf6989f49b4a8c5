"""rank_runtime.sharded: FSDP2 / DTensor state backed up per rank and re-partitioned in memory.

One set of four spawned gloo processes plays every scenario in turn, one process group per
"generation" (a new world each time, as after a fault), and records what it saw; the tests
below each check one scenario's record.

- g1, 4 ranks, FSDP2: train, capture on every rank, round trip through HotSnapshot bytes; a
  fresh model on the same 4 ranks loads only its own shard (replace).
- g2, 3 ranks: load all four captures (shrink), and the error cases.
- g3, 2 ranks: load the four captures (shrink 4 -> 2), train on, capture.
- g4, 4 ranks: load g3's two captures (grow 2 -> 4).
- g5, 4 ranks, 2x2 mesh (FSDP2 over dp x Colwise/Rowwise TP): train, capture, replace; also load
  g1's 1D captures into the 2D model.
- g6, 2 ranks: load g5's 2D captures into a 1D FSDP2 and into a 2x1 mesh.
"""

from __future__ import annotations

import json
import os
import socket
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

WORLD = 4
VOCAB, DIM, HIDDEN = 50, 16, 30


class Tiny(nn.Module):
    """Embedding + two linears; the sizes divide unevenly over 3 (and 4) ranks on purpose."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.l1 = nn.Linear(DIM, HIDDEN)
        self.l2 = nn.Linear(HIDDEN, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l2(torch.relu(self.l1(self.emb(x))))


def _build(world: int, tp: int = 0, seed: int = 0, lr: float = 1e-2) -> tuple[Any, Any, Any]:
    """A Tiny under FSDP2 on ``world`` ranks (``tp`` > 0: a (world/tp, tp) mesh with TP too)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    torch.manual_seed(seed)
    model = Tiny()
    if tp:
        mesh = init_device_mesh("cpu", (world // tp, tp), mesh_dim_names=("dp", "tp"))
        parallelize_module(model, mesh["tp"], {"l1": ColwiseParallel(), "l2": RowwiseParallel()})
        dp = mesh["dp"]
    else:
        dp = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    fully_shard(model.l1, mesh=dp)
    fully_shard(model.l2, mesh=dp)
    fully_shard(model, mesh=dp)
    return model, torch.optim.Adam(model.parameters(), lr=lr), dp


def _train_step(model: nn.Module, opt: Any, dp: Any, step: int) -> None:
    """One step on step ``step``'s global batch of 12 token ids, split over the dp ranks."""
    gen = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, VOCAB, (12,), generator=gen)
    mine = tokens.tensor_split(dp.size())[dp.get_local_rank()]
    loss = nn.functional.cross_entropy(model(mine), (mine + 1) % VOCAB)
    opt.zero_grad()
    loss.backward()
    opt.step()


def _local(t: Any) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _local_state(model: nn.Module, opt: Any) -> dict[str, tuple[Any, torch.Tensor]]:
    """Every local tensor: (kind, local data), kind = the placements or 'plain'."""
    from torch.distributed.tensor import DTensor

    out: dict[str, tuple[Any, torch.Tensor]] = {}
    for name, p in model.named_parameters():
        out[name] = (str(p.placements), p.to_local().detach().clone())
        for key, value in opt.state.get(p, {}).items():
            kind = str(value.placements) if isinstance(value, DTensor) else "plain"
            out[f"{name}/{key}"] = (kind, _local(value).detach().clone())
    return out


def _full_state(model: nn.Module, opt: Any) -> dict[str, torch.Tensor]:
    """Every parameter and Adam state tensor, gathered whole (a collective over the mesh)."""
    from torch.distributed.tensor import DTensor

    out: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        out[name] = p.full_tensor().detach().clone()
        for key, value in sorted(opt.state.get(p, {}).items()):
            full = value.full_tensor() if isinstance(value, DTensor) else value
            out[f"{name}/{key}"] = full.detach().clone()
    out["lr"] = torch.tensor(opt.param_groups[0]["lr"])
    return out


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    """Keys whose tensors differ (or that one side lacks); empty when bit for bit equal."""
    bad = sorted(set(a) ^ set(b))
    bad += [k for k in sorted(set(a) & set(b)) if not torch.equal(a[k], b[k])]
    return bad


def _round_trip(capture: dict[str, Any], step: int) -> tuple[dict[str, Any], bytes]:
    from rank_runtime.snapshot import HotSnapshot, from_bytes

    hot = HotSnapshot()
    assert hot.take(step, capture) is not None
    data = hot.to_bytes(step)
    return from_bytes(data).state, data


def _read_captures(tmp: Path, tag: str, world: int) -> dict[int, dict[str, Any]]:
    from rank_runtime.snapshot import from_bytes

    return {r: from_bytes((tmp / f"{tag}-{r}.bin").read_bytes()).state for r in range(world)}


def _generation(store: Any, rank: int, world: int, gen: int) -> bool:
    """Join generation ``gen``'s process group of ``world`` ranks (False: sit it out)."""
    if dist.is_initialized():
        dist.destroy_process_group()
    if rank >= world:
        return False
    dist.init_process_group(
        "gloo",
        store=dist.PrefixStore(f"gen{gen}", store),
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=60),
    )
    return True


def _worker(rank: int, port: int, tmp_dir: str) -> None:
    torch.set_num_threads(1)
    from rank_runtime import sharded

    tmp = Path(tmp_dir)
    rec: dict[str, Any] = {}
    store = dist.TCPStore("127.0.0.1", port, WORLD, rank == 0, timeout=timedelta(seconds=60))
    began = time.perf_counter()

    def done(tag: str) -> None:
        store.set(f"done-{tag}-{rank}", "1")

    def wait(tag: str, world: int) -> None:
        store.wait([f"done-{tag}-{r}" for r in range(world)])

    try:
        # g1: 4-rank FSDP2, capture, replace.
        _generation(store, rank, 4, 1)
        model, opt, dp = _build(4)
        rec["is_sharded"] = sharded.is_sharded(model) and not sharded.is_sharded(Tiny())
        for s in range(3):
            _train_step(model, opt, dp, s)
        t0 = time.perf_counter()
        cap = sharded.capture(model, opt)
        rec["capture_s"] = time.perf_counter() - t0
        rec["copy_free"] = (
            cap["tensors"]["model.l1.weight"]["chunks"][0]["data"].data_ptr()
            == model.l1.weight.to_local().data_ptr()
        )
        restored, data = _round_trip(cap, 3)
        (tmp / f"g1-{rank}.bin").write_bytes(data)
        full4 = _full_state(model, opt)
        before = _local_state(model, opt)
        fresh, fresh_opt, fresh_dp = _build(4, seed=1)
        t0 = time.perf_counter()
        rec["replace_path"] = sharded.load(fresh, fresh_opt, {rank: restored})
        rec["replace_load_s"] = time.perf_counter() - t0
        after = _local_state(fresh, fresh_opt)
        rec["replace_keys"] = sorted(after) == sorted(before)
        rec["replace_kinds"] = [k for k in before if before[k][0] != after.get(k, ("?",))[0]]
        rec["replace_diff"] = [k for k in before if not torch.equal(before[k][1], after[k][1])]
        rec["replace_step_types"] = sorted(
            {type(fresh_opt.state[p]["step"]).__name__ for p in fresh.parameters()}
        )
        _train_step(model, opt, dp, 3)
        _train_step(fresh, fresh_opt, fresh_dp, 3)
        rec["replace_next_step_diff"] = _same(
            _full_state(model, opt), _full_state(fresh, fresh_opt)
        )
        # Loaded from views of a backup's slot (a survivor's restore, Elastic.own_views): every
        # chunk is copied, so training on never writes into the backup.
        from rank_runtime.snapshot import HotSnapshot

        hot = HotSnapshot()
        hot.take(4, sharded.capture(model, opt))
        pinned = hot.to_bytes(4)
        viewed, viewed_opt, viewed_dp = _build(4, seed=3)
        rec["views_path"] = sharded.load(viewed, viewed_opt, {rank: hot.get(4, copy=False).state})
        _train_step(viewed, viewed_opt, viewed_dp, 4)
        rec["views_backup_intact"] = hot.to_bytes(4) == pinned
        done("g1")
        wait("g1", 4)

        # g2: shrink 4 -> 3, plus the error cases.
        if _generation(store, rank, 3, 2):
            caps = _read_captures(tmp, "g1", 4)
            model, opt, _ = _build(3, seed=2)
            t0 = time.perf_counter()
            sharded.load(model, opt, caps)
            rec["shrink_load_s"] = time.perf_counter() - t0
            rec["shrink_diff"] = _same(full4, _full_state(model, opt))
            shrunk = _local_state(model, opt)
            # No collective inside load or capture: rank 0 runs them alone while ranks 1 and 2
            # wait on the store (a collective would hang until the group's 60 s timeout).
            model, opt, _ = _build(3, seed=2)
            if rank == 0:
                t0 = time.perf_counter()
                sharded.load(model, opt, caps)
                rec["solo_load_s"] = time.perf_counter() - t0
                sharded.capture(model, opt)
                store.set("solo-done", "1")
            else:
                store.wait(["solo-done"])
            now = _local_state(model, opt)
            rec["solo_diff"] = (
                [k for k in shrunk if not torch.equal(shrunk[k][1], now[k][1])] if rank == 0 else []
            )
            # Missing coverage: without old rank 0's shard, new rank 0 lacks rows [0, 13).
            model, opt, _ = _build(3, seed=2)
            untouched = _local_state(model, opt)
            try:
                sharded.load(model, opt, {r: caps[r] for r in (1, 2, 3)})
                rec["uncovered"] = None
            except ValueError as exc:
                rec["uncovered"] = str(exc)
            now = _local_state(model, opt)
            rec["uncovered_untouched"] = [
                k for k in untouched if not torch.equal(untouched[k][1], now[k][1])
            ]
            # A key missing from every capture.
            for c in caps.values():
                del c["tensors"]["optim.state.l2.bias.exp_avg"]
            try:
                sharded.load(model, opt, caps)
                rec["missing_key"] = None
            except ValueError as exc:
                rec["missing_key"] = str(exc)
            # A shard given under the wrong old rank.
            try:
                sharded.load(model, opt, {0: caps[1]})
                rec["wrong_rank"] = None
            except ValueError as exc:
                rec["wrong_rank"] = str(exc)
            done("g2")
        wait("g2", 3)

        # g3: shrink 4 -> 2, train on, capture.
        if _generation(store, rank, 2, 3):
            model, opt, dp = _build(2, seed=3)
            rec["shrink_path"] = sharded.load(model, opt, _read_captures(tmp, "g1", 4))
            rec["shrink2_diff"] = _same(full4, _full_state(model, opt))
            for s in (3, 4):
                _train_step(model, opt, dp, s)
            (tmp / f"g3-{rank}.bin").write_bytes(_round_trip(sharded.capture(model, opt), 5)[1])
            full = _full_state(model, opt)
            if rank == 0:
                torch.save(full, tmp / "g3-full.pt")
            done("g3")
        wait("g3", 2)

        # g4: grow 2 -> 4.
        _generation(store, rank, 4, 4)
        model, opt, _ = _build(4, seed=4)
        t0 = time.perf_counter()
        sharded.load(model, opt, _read_captures(tmp, "g3", 2))
        rec["grow_load_s"] = time.perf_counter() - t0
        rec["grow_diff"] = _same(torch.load(tmp / "g3-full.pt"), _full_state(model, opt))

        # g5: 2x2 mesh (FSDP2 x TP).
        _generation(store, rank, 4, 5)
        model, opt, dp = _build(4, tp=2, seed=5)
        rec["tp_placements"] = str(model.l1.weight.placements)
        for s in range(3):
            _train_step(model, opt, dp, s)
        cap2d = sharded.capture(model, opt)
        rec["tp_chunk"] = [
            cap2d["tensors"]["model.l2.weight"]["chunks"][0][k] for k in ("offsets", "sizes")
        ]
        restored, data = _round_trip(cap2d, 3)
        (tmp / f"g5-{rank}.bin").write_bytes(data)
        full2d = _full_state(model, opt)
        if rank == 0:
            torch.save(full2d, tmp / "g5-full.pt")
        before = _local_state(model, opt)
        fresh, fresh_opt, _ = _build(4, tp=2, seed=6)
        rec["tp_replace_path"] = sharded.load(fresh, fresh_opt, {rank: restored})
        after = _local_state(fresh, fresh_opt)
        rec["tp_replace_diff"] = [
            k
            for k in before
            if before[k][0] != after[k][0] or not torch.equal(before[k][1], after[k][1])
        ]
        # 1D captures into the 2D model.
        fresh, fresh_opt, _ = _build(4, tp=2, seed=7)
        sharded.load(fresh, fresh_opt, _read_captures(tmp, "g1", 4))
        rec["1d_to_2d_diff"] = _same(full4, _full_state(fresh, fresh_opt))
        done("g5")
        wait("g5", 4)

        # g6: 2D captures into a 1D FSDP2 on 2 ranks, and into a 2x1 mesh.
        if _generation(store, rank, 2, 6):
            caps = _read_captures(tmp, "g5", 4)
            ref = torch.load(tmp / "g5-full.pt")
            model, opt, _ = _build(2, seed=8)
            sharded.load(model, opt, caps)
            rec["2d_to_1d_diff"] = _same(ref, _full_state(model, opt))
            model, opt, _ = _build(2, tp=1, seed=9)
            sharded.load(model, opt, caps)
            rec["2d_to_2x1_diff"] = _same(ref, _full_state(model, opt))
            done("g6")
        wait("g6", 2)
    except BaseException:  # CheckpointException is a BaseException
        rec["error"] = traceback.format_exc()
    rec["total_s"] = time.perf_counter() - began
    (tmp / f"rec-{rank}.json").write_text(json.dumps(rec))
    if dist.is_initialized():
        dist.destroy_process_group()
    # Rank 0 hosts the store: leave last.
    store.set(f"exit-{rank}", "1")
    if rank == 0:
        store.wait([f"exit-{r}" for r in range(WORLD)])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def records(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("sharded")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    began = time.perf_counter()
    mp.start_processes(_worker, args=(_free_port(), str(tmp)), nprocs=WORLD, start_method="spawn")
    recs = [json.loads((tmp / f"rec-{r}.json").read_text()) for r in range(WORLD)]
    for r, rec in enumerate(recs):
        assert "error" not in rec, f"rank {r}:\n{rec['error']}"
    print(
        f"\nsharded scenarios: {time.perf_counter() - began:.1f} s wall;",
        {k: round(v, 4) for k, v in recs[0].items() if k.endswith("_s")},
    )
    return recs


def test_is_sharded_and_capture_is_copy_free(records: list[dict[str, Any]]) -> None:
    assert all(r["is_sharded"] and r["copy_free"] for r in records)


def test_replace_gives_the_captured_local_state_and_the_same_next_step(
    records: list[dict[str, Any]],
) -> None:
    for r in records:
        # One capture of this rank's own layout: copied chunk by chunk, no resharding plan.
        assert r["replace_path"] == r["tp_replace_path"] == "same-layout"
        assert r["replace_keys"]
        assert r["replace_kinds"] == []  # same placements, DTensor exp_avg/exp_avg_sq, plain step
        assert r["replace_diff"] == []
        assert r["replace_step_types"] == ["Tensor"]
        assert r["replace_next_step_diff"] == []
        assert r["views_path"] == "same-layout" and r["views_backup_intact"]


def test_shrink_4_to_3_and_to_2_reproduces_the_full_state(records: list[dict[str, Any]]) -> None:
    assert [r["shrink_path"] for r in records[:2]] == ["resharded"] * 2
    for r in records[:3]:
        assert r["shrink_diff"] == []
        assert r["solo_diff"] == []  # rank 0 loaded alone: no collective inside load
    for r in records[:2]:
        assert r["shrink2_diff"] == []


def test_grow_2_to_4_reproduces_the_full_state(records: list[dict[str, Any]]) -> None:
    for r in records:
        assert r["grow_diff"] == []


def test_2d_mesh_replace_and_resharding_across_meshes(records: list[dict[str, Any]]) -> None:
    assert records[0]["tp_placements"] == "(_StridedShard(dim=0, sf=2), Shard(dim=0))"
    # l2 is row-wise: (Shard(0) over dp, Shard(1) over tp): a 2D block per rank.
    assert records[3]["tp_chunk"] == [[25, 15], [25, 15]]
    for r in records:
        assert r["tp_replace_diff"] == []
        assert r["1d_to_2d_diff"] == []
    for r in records[:2]:
        assert r["2d_to_1d_diff"] == []
        assert r["2d_to_2x1_diff"] == []


def test_missing_coverage_or_key_raises_before_writing(records: list[dict[str, Any]]) -> None:
    assert records[0]["uncovered"] is not None and "do not cover" in records[0]["uncovered"]
    assert "model.emb.weight" in records[0]["uncovered"]
    # Ranks 1 and 2 of 3 need only rows that old ranks 1..3 hold.
    assert records[1]["uncovered"] is None and records[2]["uncovered"] is None
    assert records[0]["uncovered_untouched"] == []
    for r in records[:3]:
        assert "optim.state.l2.bias.exp_avg" in r["missing_key"]
        assert "captured by rank 1" in r["wrong_rank"]


def test_an_optimizer_that_never_stepped_stays_fresh(tmp_path: Path) -> None:
    """Single process (world 1): capture before the first step neither steps Adam nor records
    the zero state; a load leaves the new optimizer unstepped, so both first steps agree."""
    from rank_runtime import sharded

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model, opt, dp = _build(1)
        cap = sharded.capture(model, opt)
        assert not opt.state
        assert not any(k.startswith("optim.state.") for k in cap["tensors"])
        fresh, fresh_opt, fresh_dp = _build(1, seed=1, lr=0.5)
        sharded.load(fresh, fresh_opt, {0: _round_trip(cap, 0)[0]})
        assert not fresh_opt.state and fresh_opt.param_groups[0]["lr"] == 1e-2
        _train_step(model, opt, dp, 0)
        _train_step(fresh, fresh_opt, fresh_dp, 0)
        assert _same(_full_state(model, opt), _full_state(fresh, fresh_opt)) == []
        # One parameter without state (as if it had had no gradient yet): recorded as stateless,
        # loaded without state; its whole state missing otherwise is an error.
        del opt.state[model.l2.bias]
        cap = _round_trip(sharded.capture(model, opt), 1)[0]
        assert cap["stateless"] == ["l2.bias"]
        fresh, fresh_opt, fresh_dp = _build(1, seed=2)
        sharded.load(fresh, fresh_opt, {0: cap})
        assert fresh.l2.bias not in fresh_opt.state and len(fresh_opt.state) == 4
        _train_step(model, opt, dp, 1)
        _train_step(fresh, fresh_opt, fresh_dp, 1)
        assert _same(_full_state(model, opt), _full_state(fresh, fresh_opt)) == []
        cap["stateless"] = []
        with pytest.raises(ValueError, match=r"lack 3 key\(s\).*optim\.state\.l2\.bias\.exp_avg"):
            sharded.load(fresh, fresh_opt, {0: cap})
    finally:
        dist.destroy_process_group()
