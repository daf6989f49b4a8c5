"""examples/tinygpt.py: the model trains, the data is a function of the step, FSDP2 state moves."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests.groups import leave_group

ROOT = Path(__file__).resolve().parents[2]


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("tinygpt", ROOT / "examples" / "tinygpt.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("tinygpt", module)
    spec.loader.exec_module(module)
    return module


tinygpt = _load()


def test_the_corpus_is_stdlib_text_and_named_by_its_digest() -> None:
    text = tinygpt.corpus()
    assert len(text) > 200_000
    assert b"def dedent(" in text  # textwrap
    assert tinygpt.corpus_digest() == tinygpt.corpus_digest() and len(tinygpt.corpus_digest()) == 16


def test_a_step_batch_depends_on_the_step_alone_and_splits_over_any_world() -> None:
    data = tinygpt.TextData(seq=32, global_batch=10, seed=3)
    other = tinygpt.TextData(seq=32, global_batch=10, seed=3)
    x, y = data.batch(7)
    assert x.shape == y.shape == (10, 32) and x.dtype == torch.long
    assert torch.equal(x[:, 1:], y[:, :-1])  # targets are the inputs shifted by one
    assert torch.equal(x, other.batch(7)[0])
    assert not torch.equal(x, data.batch(8)[0])
    for world in (3, 4, 12):
        parts = [data.batch(7, rank, world) for rank in range(world)]
        assert torch.equal(torch.cat([p[0] for p in parts]), x)
        assert torch.equal(torch.cat([p[1] for p in parts]), y)
    assert data.batch(7, 11, 12)[0].shape == (0, 32)  # more ranks than samples: empty shard


def test_step_loss_averaged_over_ranks_is_the_global_mean() -> None:
    torch.set_num_threads(1)
    model = tinygpt.build_model(256, 32, 1, 2, 16, seed=0)
    data = tinygpt.TextData(seq=16, global_batch=7)
    x, y = data.batch(0)
    full = torch.nn.functional.cross_entropy(model(x).reshape(-1, 256), y.reshape(-1))
    world = 3
    parts = [tinygpt.step_loss(model, *data.batch(0, r, world), world, 7) for r in range(world)]
    assert torch.allclose(sum(parts) / world, full, rtol=1e-5)
    empty = tinygpt.step_loss(model, *data.batch(0, 7, 8), 8, 7)
    assert empty.item() == 0.0 and empty.requires_grad


def test_build_model_is_deterministic_and_leaves_the_global_rng_alone() -> None:
    state = torch.random.get_rng_state()
    a = tinygpt.build_model(256, 32, 2, 4, 16, seed=5)
    b = tinygpt.build_model(256, 32, 2, 4, 16, seed=5, tied=False)
    assert torch.equal(torch.random.get_rng_state(), state)
    assert a.head.weight is a.tok.weight and b.head.weight is not b.tok.weight
    sa, sb = a.state_dict(), b.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa if k != "head.weight")


def test_forty_steps_lower_the_loss() -> None:
    torch.set_num_threads(1)
    model = tinygpt.build_model(256, 64, 2, 4, 64, seed=0)
    data = tinygpt.TextData(seq=64, global_batch=16)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for step in range(40):
        loss = tinygpt.step_loss(model, *data.batch(step), 1, 16)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[0] > 5.0  # about ln(256) = 5.55 at the start
    assert sum(losses[-5:]) / 5 < 0.75 * sum(losses[:5]) / 5, losses


@pytest.mark.parametrize("tied", [True, False])
def test_fsdp2_shards_move_through_rank_runtime_sharded(tied: bool) -> None:
    """World 1 (FSDP2 over one gloo rank): capture -> HotSnapshot bytes -> load into a fresh
    sharded model; the next step is the same bit for bit, tied head included."""
    from torch.distributed.device_mesh import init_device_mesh

    from rank_runtime import sharded
    from rank_runtime.snapshot import HotSnapshot, from_bytes

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        data = tinygpt.TextData(seq=16, global_batch=4)

        def make(seed: int) -> tuple[Any, torch.optim.Optimizer]:
            model = tinygpt.shard(tinygpt.build_model(256, 32, 2, 2, 16, seed, tied=tied), mesh)
            return model, torch.optim.AdamW(model.parameters(), lr=1e-3)

        def train(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
            loss = tinygpt.step_loss(model, *data.batch(step), 1, 4)
            opt.zero_grad()
            loss.backward()
            opt.step()

        model, opt = make(0)
        assert sharded.is_sharded(model)
        for step in range(2):
            train(model, opt, step)
        hot = HotSnapshot()
        hot.take(2, sharded.capture(model, opt))
        fresh, fresh_opt = make(1)
        sharded.load(fresh, fresh_opt, {0: from_bytes(hot.to_bytes(2)).state})
        if tied:
            assert fresh.head.weight is fresh.tok.weight
        train(model, opt, 2)
        train(fresh, fresh_opt, 2)
        for (name, p), q in zip(model.named_parameters(), fresh.parameters(), strict=True):
            assert torch.equal(p.full_tensor(), q.full_tensor()), name
    finally:
        dist.destroy_process_group()


def test_a_tied_weight_is_captured_and_stored_once() -> None:
    """The tied head is the embedding's memory under a second name: one tensor in the capture,
    so a snapshot stores (and a peer receives) it once. Untied, the head adds its weight and
    its two Adam moments and its step counter: the difference is exactly that."""
    from torch.distributed.device_mesh import init_device_mesh

    from rank_runtime import sharded
    from rank_runtime.snapshot import HotSnapshot

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        data = tinygpt.TextData(seq=16, global_batch=4)
        sizes = {}
        for tied in (True, False):
            model = tinygpt.shard(tinygpt.build_model(256, 32, 2, 2, 16, 0, tied=tied), mesh)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
            loss = tinygpt.step_loss(model, *data.batch(0), 1, 4)
            loss.backward()
            opt.step()
            info = HotSnapshot().take(1, sharded.capture(model, opt))
            assert info is not None
            sizes[tied] = info.nbytes
        embedding = 256 * 32 * 4  # float32
        step = 4  # the head's own Adam step counter (a float32 scalar), untied only
        # Stored twice (the tied weight under both names), the difference would be 2 x.
        assert sizes[False] - sizes[True] == 3 * embedding + step, sizes
    finally:
        dist.destroy_process_group()


# -- HashedNgrams: rows sharded over the ranks, never gathered -----------------------------------

NGRAM_WORLD = 3
NGRAM_ROWS = 1000  # 334, 334, 332 rows over 3 ranks; the global batch of 4 splits 2, 1, 1


class _FullNgrams(torch.nn.Module):
    """The single-process reference: the same rows as one plain embedding."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding.from_pretrained(weight.clone(), freeze=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.emb(tinygpt.trigram_ids(tokens, NGRAM_ROWS))
        return out


def _ngram_worker(rank: int, port: int, tmp_dir: str) -> None:
    import json
    import traceback
    from datetime import timedelta

    from torch.distributed.device_mesh import init_device_mesh

    from rank_runtime import sharded
    from rank_runtime.snapshot import HotSnapshot, from_bytes

    torch.set_num_threads(1)
    record: dict[str, Any] = {}
    store = dist.TCPStore("127.0.0.1", port, NGRAM_WORLD, rank == 0, timeout=timedelta(seconds=60))
    try:
        dist.init_process_group("gloo", store=store, rank=rank, world_size=NGRAM_WORLD)
        mesh = init_device_mesh("cpu", (NGRAM_WORLD,))
        data = tinygpt.TextData(seq=16, global_batch=4)

        def make(init: bool) -> tuple[Any, torch.optim.Optimizer]:
            with torch.device("meta") if not init else torch.device("cpu"):
                net = tinygpt.build_model(256, 32, 1, 2, 16, 0, tied=False)
            net.ngrams = tinygpt.HashedNgrams(NGRAM_ROWS, 32, mesh, seed=7, init=init)
            model = tinygpt.shard(net, mesh)
            if not init:
                model.to_empty(device="cpu")
            return model, torch.optim.AdamW(model.parameters(), lr=1e-2)

        def train(model: Any, opt: torch.optim.Optimizer, step: int, world: int) -> float:
            part = rank if world > 1 else 0
            loss = tinygpt.step_loss(model, *data.batch(step, part, world), world, 4)
            opt.zero_grad()
            loss.backward()
            opt.step()
            total = loss.detach().clone()
            if world > 1:
                dist.all_reduce(total)
            return total.item() / world

        model, opt = make(init=True)
        ngrams = model.ngrams
        record["rows"] = [ngrams.lo, ngrams.hi]
        record["sharded"] = sharded.is_sharded(model)
        reference = tinygpt.build_model(256, 32, 1, 2, 16, 0, tied=False)
        reference.ngrams = _FullNgrams(tinygpt.ngram_rows(NGRAM_ROWS, 32, 7, 0, NGRAM_ROWS))
        ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
        record["initial_rows_equal"] = torch.equal(
            ngrams.weight.to_local(), reference.ngrams.emb.weight[ngrams.lo : ngrams.hi]
        )
        # The gradients of one step (Adam's update hides a wrong scale: compare them first).
        tinygpt.step_loss(model, *data.batch(0, rank, NGRAM_WORLD), NGRAM_WORLD, 4).backward()
        tinygpt.step_loss(reference, *data.batch(0), 1, 4).backward()
        ref_grad = reference.ngrams.emb.weight.grad[ngrams.lo : ngrams.hi]
        ngram_grad = ngrams.weight.grad.to_local()
        record["grad_rows_off"] = (ngram_grad - ref_grad).abs().max().item()
        record["grad_rows_max"] = ref_grad.abs().max().item()
        ref_head = reference.head.weight.grad
        record["grad_head_off"] = (
            (model.head.weight.grad.full_tensor() - ref_head).abs().max().item()
        )
        record["grad_head_max"] = ref_head.abs().max().item()
        opt.zero_grad()
        ref_opt.zero_grad()
        record["losses"] = [train(model, opt, s, NGRAM_WORLD) for s in range(3)]
        record["ref_losses"] = [train(reference, ref_opt, s, 1) for s in range(3)]
        rows = reference.ngrams.emb.weight.detach()[ngrams.lo : ngrams.hi]
        record["rows_off"] = (ngrams.weight.to_local() - rows).abs().max().item()
        named = dict(reference.named_parameters())
        record["params_off"] = max(
            (p.full_tensor() - named[n]).abs().max().item()
            for n, p in model.named_parameters()
            if not n.startswith("ngrams.")
        )
        # Back up, then a fresh build on the meta device (no init) restores it exactly.
        hot = HotSnapshot()
        hot.take(3, sharded.capture(model, opt))
        fresh, fresh_opt = make(init=False)
        sharded.load(fresh, fresh_opt, {rank: from_bytes(hot.to_bytes(3)).state})
        train(model, opt, 3, NGRAM_WORLD)
        train(fresh, fresh_opt, 3, NGRAM_WORLD)
        record["restored_equal"] = all(
            torch.equal(p.to_local(), q.to_local())
            for p, q in zip(model.parameters(), fresh.parameters(), strict=True)
        )
    except Exception:
        record["error"] = traceback.format_exc()
    finally:
        (Path(tmp_dir) / f"ngram-{rank}.json").write_text(json.dumps(record))
        leave_group()


def test_hashed_ngrams_train_as_one_embedding_and_restore_into_an_uninitialised_build(
    tmp_path: Path,
) -> None:
    """Three gloo ranks, uneven rows and batches: a step with the row-sharded embedding is the
    single-process step with one plain embedding of the same rows (to float rounding: sums in
    another order); each rank holds its rows only; a capture loads into a model built on the
    meta device with no initialisation, and the next step is the same bit for bit."""
    import json
    import os
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.start_processes(
        _ngram_worker, args=(port, str(tmp_path)), nprocs=NGRAM_WORLD, start_method="spawn"
    )
    records = [json.loads((tmp_path / f"ngram-{r}.json").read_text()) for r in range(NGRAM_WORLD)]
    for r, record in enumerate(records):
        assert "error" not in record, f"rank {r}:\n{record['error']}"
    assert [r["rows"] for r in records] == [[0, 334], [334, 668], [668, 1000]]
    for record in records:
        assert record["sharded"] and record["initial_rows_equal"]
        assert record["losses"] == pytest.approx(record["ref_losses"], rel=1e-5)
        assert record["grad_rows_max"] > 1e-4 and record["grad_head_max"] > 1e-4, record
        assert record["grad_rows_off"] < 1e-5 * record["grad_rows_max"], record
        assert record["grad_head_off"] < 1e-5 * record["grad_head_max"], record
        # After three AdamW steps (lr 1e-2: up to 3e-2 of movement): Adam's normalisation of
        # near-zero gradients turns rounding into small differences of the update.
        assert record["rows_off"] < 1e-4 and record["params_off"] < 1e-3, record
        assert record["restored_equal"]


def test_a_load_adopts_a_received_shard_and_reuses_a_dropped_generation_s_memory() -> None:
    """``sharded.load`` of one capture in the rank's own layout: with ``adopt`` the optimizer
    state is the received tensors themselves (no copy; parameters are copied); with
    ``memory`` it is made of what a dropped generation's parts leave, never of the backup it
    reads; either way the next step is the same bit for bit as the original's."""
    from torch.distributed.device_mesh import init_device_mesh

    from rank_runtime import sharded
    from rank_runtime.snapshot import HotSnapshot, from_bytes

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        data = tinygpt.TextData(seq=16, global_batch=4)

        def make(init: bool) -> tuple[Any, torch.optim.Optimizer]:
            with torch.device("meta") if not init else torch.device("cpu"):
                net = tinygpt.build_model(256, 32, 1, 2, 16, 0)
            net.ngrams = tinygpt.HashedNgrams(16384, 32, mesh, seed=7, init=init)  # 2 MiB
            model = tinygpt.shard(net, mesh)
            if not init:
                model.to_empty(device="cpu")
            return model, torch.optim.AdamW(model.parameters(), lr=1e-2)

        def train(model: Any, opt: torch.optim.Optimizer, step: int) -> None:
            loss = tinygpt.step_loss(model, *data.batch(step), 1, 4)
            opt.zero_grad()
            loss.backward()
            opt.step()

        def big_state(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
            return [v.to_local() for s in opt.state.values() for v in s.values()
                    if isinstance(v, torch.Tensor) and v.numel() * 4 >= 1 << 20]  # fmt: skip

        model, opt = make(init=True)
        for step in range(2):
            train(model, opt, step)
        hot = HotSnapshot()
        hot.take(2, sharded.capture(model, opt))

        received = from_bytes(hot.to_bytes(2)).state
        adopted, adopted_opt = make(init=False)
        assert sharded.load(adopted, adopted_opt, {0: received}, adopt=True) == "same-layout"
        captured = received["tensors"]
        moments = [captured[f"optim.state.ngrams.weight.{k}"]["chunks"][0]["data"]
                   for k in ("exp_avg", "exp_avg_sq")]  # fmt: skip
        state = adopted_opt.state[adopted.ngrams.weight]
        assert [state[k].to_local().data_ptr() for k in ("exp_avg", "exp_avg_sq")] == [
            m.data_ptr() for m in moments
        ]
        weight = captured["model.ngrams.weight"]["chunks"][0]["data"]
        assert adopted.ngrams.weight.to_local().data_ptr() != weight.data_ptr()

        donor, donor_opt = make(init=True)
        train(donor, donor_opt, 0)
        memory = sharded.Memory.of(donor, donor_opt)
        lent = {t.data_ptr() for t in [donor.ngrams.weight.to_local(), *big_state(donor_opt)]}
        del donor, donor_opt
        reused, reused_opt = make(init=False)
        sharded.load(reused, reused_opt, {0: hot.get(2, copy=False).state}, memory=memory)
        taken = {t.data_ptr() for t in big_state(reused_opt)}
        assert len(taken) == 2 and taken <= lent and memory.taken == 2 * 16384 * 32 * 4
        slots = [(s.buffer.data_ptr(), s.buffer.data_ptr() + s.capacity)
                 for s in hot._slots if s.buffer is not None]  # fmt: skip
        assert not any(lo <= p < hi for p in taken for lo, hi in slots)

        before = moments[0].clone()
        for m, o in ((model, opt), (adopted, adopted_opt), (reused, reused_opt)):
            train(m, o, 2)
        assert not torch.equal(moments[0], before)  # adopted: the state trained in place
        for p, q, r in zip(model.parameters(), adopted.parameters(), reused.parameters(),
                           strict=True):  # fmt: skip
            assert torch.equal(p.to_local(), q.to_local())
            assert torch.equal(p.to_local(), r.to_local())
        kept = hot.get(2).state["tensors"]  # training the reused parts left the backup alone
        assert torch.equal(kept["optim.state.ngrams.weight.exp_avg"]["chunks"][0]["data"],
                           before)  # fmt: skip
    finally:
        dist.destroy_process_group()


def test_memory_lends_only_whole_unshared_tensors_of_a_layout() -> None:
    from rank_runtime.sharded import Memory

    whole = torch.zeros(64, 8)
    memory = Memory([whole, whole.view(64, 8), torch.zeros(128, 8)[:64], torch.zeros(0, 8)])
    assert memory.nbytes == whole.numel() * 4  # the view of ``whole`` once, no partial view
    assert memory.take(torch.empty(8, 64)) is None  # another layout
    lent = memory.take(torch.empty(64, 8))
    assert lent is not None and lent.data_ptr() == whole.data_ptr()
    assert memory.take(torch.empty(64, 8)) is None and memory.taken == whole.numel() * 4
