"""Hot snapshots: round trips, double buffering under failures mid-copy, checksums, bytes."""

from __future__ import annotations

import json
import pickle
import random
import threading
import zlib
from collections import OrderedDict

import pytest
import torch
from pydantic import TypeAdapter

from rank_runtime import snapshot as snap
from rank_runtime.snapshot import (
    CorruptSnapshot,
    HotSnapshot,
    SnapshotDecoder,
    SnapshotNotFound,
    UnsupportedState,
    from_bytes,
)
from schemas.common import Checksum

torch.set_num_threads(1)


def tiny_model() -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Linear(6, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(), torch.nn.Linear(16, 3)
    )


def train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(8, 6, generator=gen)
        y = torch.randint(0, 3, (8,), generator=gen)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()


def training_state(seed: int = 0, steps: int = 2, position: int = 1234) -> dict:
    torch.manual_seed(seed)
    model = tiny_model()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    train(model, opt, steps, seed)
    return {
        "model": model.state_dict(),
        "optimizer": opt.state_dict(),
        "rng": {"torch": torch.get_rng_state(), "python": random.getstate()},
        "data": {"step": steps, "position": position, "name": "synthetic", "blob": b"\x00\x01"},
    }


def small_state(value: float, step: int) -> dict:
    return {
        "w": torch.full((64, 32), value),
        "b": torch.arange(32, dtype=torch.int64) + int(value),
        "data": {"step": step, "position": step * 10},
    }


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def assert_same(a: object, b: object) -> None:
    """Assert two states are equal: same container types, bitwise-equal tensors."""
    assert type(a) is type(b), (type(a), type(b))
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor)
        assert a.dtype == b.dtype and a.shape == b.shape and a.device.type == "cpu"
        assert torch.equal(bits(a), bits(b))
    elif isinstance(a, dict):
        assert isinstance(b, dict)
        assert list(a) == list(b)
        for key in a:
            assert_same(a[key], b[key])
        assert vars(a) == vars(b) if isinstance(a, OrderedDict) else True
    elif isinstance(a, list | tuple):
        assert isinstance(b, list | tuple)
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert_same(x, y)
    else:
        assert a == b


def exploding(error: BaseException, on_copy=None) -> type[torch.Tensor]:
    """A tensor type whose copy raises ``error`` (after calling ``on_copy``)."""

    class Exploding(torch.Tensor):
        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            if func is torch.Tensor.copy_:
                if on_copy is not None:
                    on_copy()
                raise error
            return super().__torch_function__(func, types, args, kwargs or {})

    return Exploding


def poisoned(value: float, step: int, error: BaseException, on_copy=None) -> dict:
    """A state whose third tensor fails to copy, after the first two have been copied."""
    state = small_state(value, step)
    return {
        "w": state["w"],
        "b": state["b"],
        "bad": torch.ones(16).as_subclass(exploding(error, on_copy)),
        "late": torch.full((8,), value),
        "data": state["data"],
    }


# --- round trips -------------------------------------------------------------------------------


def test_nothing_before_the_first_take():
    hot = HotSnapshot()
    assert hot.latest() is None
    assert hot.steps() == []
    assert hot.reserved_bytes == 0
    with pytest.raises(SnapshotNotFound, match="no complete snapshot of step 3"):
        hot.get(3)
    with pytest.raises(SnapshotNotFound):
        hot.checksum(3)


def test_a_realistic_state_round_trips_and_training_resumes_identically():
    state = training_state()
    hot = HotSnapshot()
    info = hot.take(2, state)
    assert info is not None and info.step == 2 and info.allocated
    assert info.nbytes == sum(t.numel() * t.element_size() for t in _tensors(state))

    restored = hot.latest()
    assert restored is not None and restored.step == 2
    assert_same(restored.state, state)
    assert restored.state["model"]._metadata == state["model"]._metadata
    torch.set_rng_state(restored.state["rng"]["torch"])  # crashes on a view at an offset
    wire = from_bytes(hot.to_bytes(2))
    assert wire.step == 2
    assert_same(wire.state, state)

    # Load the restored copy into fresh objects; both runs then train identically.
    torch.manual_seed(0)
    original = tiny_model()
    original_opt = torch.optim.Adam(original.parameters(), lr=0.01)
    train(original, original_opt, 2, seed=0)
    resumed = tiny_model()
    resumed_opt = torch.optim.Adam(resumed.parameters(), lr=0.01)
    resumed.load_state_dict(wire.state["model"])
    resumed_opt.load_state_dict(wire.state["optimizer"])
    torch.set_rng_state(wire.state["rng"]["torch"])
    train(original, original_opt, 3, seed=7)
    train(resumed, resumed_opt, 3, seed=7)
    for a, b in zip(original.state_dict().values(), resumed.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    assert wire.state["rng"]["python"] == state["rng"]["python"]


def _tensors(state: object) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []

    def walk(node: object) -> None:
        if isinstance(node, torch.Tensor):
            out.append(node)
        elif isinstance(node, dict):
            for value in node.values():
                walk(value)
        elif isinstance(node, list | tuple):
            for value in node:
                walk(value)

    walk(state)
    return out


def test_copies_are_independent_of_the_source_and_of_the_slot():
    state = small_state(1.0, 1)
    hot = HotSnapshot()
    hot.take(1, state)
    state["w"].add_(5)
    state["data"]["position"] = -1
    clone = hot.latest()
    assert clone is not None
    assert torch.equal(clone.state["w"], torch.full((64, 32), 1.0))
    assert clone.state["data"]["position"] == 10
    clone.state["w"].zero_()
    clone.state["data"]["step"] = 99
    again = hot.latest()
    assert again is not None
    assert torch.equal(again.state["w"], torch.full((64, 32), 1.0))
    assert again.state["data"]["step"] == 1


def test_a_later_copy_runs_beside_the_caller_and_readers_and_settle_wait_for_it(monkeypatch):
    release = threading.Event()
    run = snap._Behind._run

    def held(self, pairs):
        release.wait(10)
        run(self, pairs)

    monkeypatch.setattr(snap._Behind, "_run", held)
    state = {"w": torch.full((64, 32), 1.0), "b": torch.full((8,), 2.0)}
    hot = HotSnapshot()
    info = hot.take(1, state, later=lambda t: t is state["w"])
    assert info is not None  # returned while the copy of "w" is held
    state["b"].add_(5)  # copied at once: the snapshot keeps 2.0
    settled = threading.Event()
    waiter = threading.Thread(target=lambda: (hot.settle(), settled.set()))
    waiter.start()
    assert not settled.wait(0.2), "settle returned before the copy landed"
    release.set()
    waiter.join(10)
    assert settled.is_set()
    state["w"].add_(7)  # after settle: the optimizer's step may write it
    got = hot.latest()
    assert got is not None
    assert torch.equal(got.state["w"], torch.full((64, 32), 1.0))
    assert torch.equal(got.state["b"], torch.full((8,), 2.0))


def test_a_reader_waits_for_a_later_copy(monkeypatch):
    release = threading.Event()
    run = snap._Behind._run
    monkeypatch.setattr(
        snap._Behind, "_run", lambda self, pairs: (release.wait(10), run(self, pairs))
    )
    hot = HotSnapshot()
    state = {"w": torch.full((16,), 3.0)}
    hot.take(4, state, later=lambda t: True)
    threading.Timer(0.2, release.set).start()
    got = hot.latest()  # waits for the copy, then reads it
    assert got is not None and torch.equal(got.state["w"], torch.full((16,), 3.0))
    assert release.is_set()


def test_views_share_the_slot_until_it_is_rewritten():
    hot = HotSnapshot()
    hot.take(1, small_state(1.0, 1))
    view = hot.latest(copy=False)
    assert view is not None
    hot.take(2, small_state(2.0, 2))  # the other slot
    assert torch.equal(view.state["w"], torch.full((64, 32), 1.0))
    hot.take(3, small_state(3.0, 3))  # the viewed slot
    assert torch.equal(view.state["w"], torch.full((64, 32), 3.0))


def test_unusual_tensors_round_trip():
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    shared = torch.randn(5)
    state = OrderedDict(
        transposed=base.t(),
        strided=base[:, ::2],
        scalar=torch.tensor(3.5, dtype=torch.float64),
        empty=torch.empty(0, 7),
        mask=torch.tensor([True, False, True]),
        half=torch.randn(3, dtype=torch.bfloat16),
        complex=torch.randn(2, dtype=torch.complex64),
        odd=torch.arange(3, dtype=torch.uint8),
        after_odd=torch.randn(3, dtype=torch.float64),
        tied=(shared, [shared]),
        values=[None, True, 7, -2.5, float("inf"), "s", b"b", (), {}],
    )
    state.note = {"version": 3}  # type: ignore[attr-defined]
    hot = HotSnapshot()
    info = hot.take(5, state)
    assert info is not None
    assert (
        info.nbytes
        == sum(t.numel() * t.element_size() for t in state.values() if isinstance(t, torch.Tensor))
        + 20
    )
    for restored in (hot.get(5), from_bytes(hot.to_bytes(5))):
        assert_same(restored.state, state)
        assert restored.state.note == {"version": 3}
        first, (second,) = restored.state["tied"]
        assert first.data_ptr() == second.data_ptr()  # a tensor listed twice is copied once


def test_unsupported_values_are_refused_with_their_place_and_no_damage():
    hot = HotSnapshot()
    hot.take(1, small_state(1.0, 1))
    with pytest.raises(
        UnsupportedState,
        match=r"state\['data'\]\['seen'\]\[1\]: cannot snapshot a value of type set",
    ):
        hot.take(2, {"data": {"seen": [1, {2}]}})
    with pytest.raises(UnsupportedState, match="a key of type tuple"):
        hot.take(2, {(1, 2): 3})
    assert hot.steps() == [1]
    assert hot.status()[1].state == "empty"


# --- double buffering --------------------------------------------------------------------------


def test_the_two_newest_snapshots_are_kept():
    hot = HotSnapshot()
    hot.take(10, small_state(1.0, 10))
    hot.take(20, small_state(2.0, 20))
    assert hot.steps() == [20, 10]
    latest = hot.latest()
    assert latest is not None and latest.step == 20
    hot.take(30, small_state(3.0, 30))
    assert hot.steps() == [30, 20]
    assert hot.get(20).state["data"] == {"step": 20, "position": 200}
    with pytest.raises(SnapshotNotFound):
        hot.get(10)


@pytest.mark.parametrize(
    "error",
    [RuntimeError("disk? no: a copy failed"), KeyboardInterrupt()],
    ids=["exception", "keyboard-interrupt"],
)
def test_a_failure_mid_copy_leaves_the_previous_snapshot_whole(error):
    hot = HotSnapshot()
    hot.take(10, small_state(1.0, 10))
    hot.take(20, small_state(2.0, 20))
    checksum = hot.checksum(20)
    before = hot.to_bytes(20)

    seen = []

    def during_copy():
        # Two tensors of step 30 already overwrote the slot of step 10.
        seen.append((hot.status(), hot.latest()))

    with pytest.raises(type(error)):
        hot.take(30, poisoned(3.0, 30, error, during_copy))

    (status, latest_then) = seen[0]
    assert sorted((s.state, s.step) for s in status) == [("complete", 20), ("writing", None)]
    assert latest_then is not None and latest_then.step == 20
    latest = hot.latest()
    assert latest is not None and latest.step == 20
    assert_same(latest.state, small_state(2.0, 20))
    assert hot.to_bytes(20) == before  # bit-identical, skeleton included
    assert hot.verify(20, checksum)
    assert hot.steps() == [20]
    assert sorted(s.state for s in hot.status()) == ["complete", "empty"]

    # The failed slot is reused by the next take; step 20 survives that too.
    hot.take(40, small_state(4.0, 40))
    assert hot.steps() == [40, 20]
    assert hot.verify(20, checksum)


def test_a_take_during_a_read_skips_instead_of_overwriting():
    hot = HotSnapshot()
    hot.take(10, small_state(1.0, 10))
    hot.take(20, small_state(2.0, 20))
    stream = hot.iter_bytes(10, chunk_bytes=1024)
    first = bytes(next(stream))  # pins step 10, the slot the next take would write
    assert hot.take(30, small_state(3.0, 30)) is None
    assert hot.skipped == 1
    rest = b"".join(bytes(chunk) for chunk in stream)  # exhausting the stream unpins
    assert from_bytes(first + rest).state["data"]["step"] == 10
    assert hot.take(30, small_state(3.0, 30)) is not None
    assert hot.steps() == [30, 20]


def test_an_abandoned_stream_unpins_when_closed():
    hot = HotSnapshot()
    hot.take(10, small_state(1.0, 10))
    hot.take(20, small_state(2.0, 20))
    stream = hot.iter_bytes(10, chunk_bytes=1024)
    next(stream)
    assert [s.readers for s in hot.status()] == [1, 0]
    stream.close()
    assert [s.readers for s in hot.status()] == [0, 0]
    assert hot.take(30, small_state(3.0, 30)) is not None


def test_concurrent_streams_never_see_a_torn_snapshot():
    """A replicator thread streams whatever is newest while the training thread keeps taking."""
    hot = HotSnapshot(chunk_bytes=4096)

    def state(step: int) -> dict:
        return {
            "a": torch.full((256, 64), float(step)),
            "b": torch.full((1000,), step),
            "step": step,
        }

    hot.take(0, state(0))
    done = threading.Event()
    decoded: list[int] = []
    errors: list[BaseException] = []

    def replicate() -> None:
        try:
            while not done.is_set():
                newest = hot.steps()[0]
                try:
                    restored = from_bytes(hot.iter_bytes(newest), checksum=hot.checksum(newest))
                except SnapshotNotFound:
                    continue  # overwritten between the lookup and the pin: take the next one
                step = restored.state["step"]
                assert step == newest
                assert torch.all(restored.state["a"] == float(step))
                assert torch.all(restored.state["b"] == step)
                decoded.append(step)
        except BaseException as exc:
            errors.append(exc)

    reader = threading.Thread(target=replicate)
    reader.start()
    try:
        taken = 0
        for step in range(1, 400):
            taken += hot.take(step, state(step)) is not None
    finally:
        done.set()
        reader.join(timeout=30)
    assert not errors, errors
    assert decoded and taken + hot.skipped == 399
    assert hot.allocations == 2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_tensors_snapshot_into_pinned_memory():
    model = torch.nn.Linear(32, 8).cuda()
    state = {"model": model.state_dict(), "cuda_rng": torch.cuda.get_rng_state_all(), "step": 3}
    hot = HotSnapshot()
    hot.take(3, state)
    assert all(s.pinned for s in hot._slots)
    restored = hot.latest()
    assert restored is not None
    for key, tensor in state["model"].items():
        assert restored.state["model"][key].device.type == "cpu"
        assert torch.equal(restored.state["model"][key], tensor.cpu())
    assert_same(from_bytes(hot.to_bytes(3)).state, restored.state)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_cuda_snapshot_does_not_wait_for_its_copy_and_sees_the_step_not_the_next():
    weight = torch.randn(4096, 4096, device="cuda")  # 64 MB: a copy long enough to overlap
    before = weight.clone()
    hot = HotSnapshot()
    hot.take(1, {"w": weight})
    hot.take(2, {"w": weight})  # both slots allocated: the timed take below reuses one
    weight.add_(1.0)  # queued after the copy of step 2 on the training stream
    torch.cuda.synchronize()
    before_3 = weight.clone()
    info = hot.take(3, {"w": weight})
    assert info is not None
    weight.mul_(0.0)  # the next step's update: ordered after the copy, never racing it
    restored = hot.get(3)  # waits for the copy's event
    assert torch.equal(restored.state["w"], before_3.cpu())
    assert torch.equal(hot.get(2).state["w"], before.cpu())


def test_discard_forgets_a_step():
    hot = HotSnapshot()
    hot.take(10, small_state(1.0, 10))
    hot.take(20, small_state(2.0, 20))
    assert hot.discard(20)
    assert not hot.discard(20)
    assert hot.steps() == [10]
    hot.take(30, small_state(3.0, 30))
    assert hot.steps() == [30, 10]


# --- memory ------------------------------------------------------------------------------------


def test_memory_stays_bounded_over_many_takes():
    hot = HotSnapshot()
    hot.take(0, small_state(0.0, 0))
    assert hot.allocations == 2  # both slots, on the first take
    reserved = hot.reserved_bytes
    for step in range(1, 60):
        info = hot.take(step, small_state(float(step), step))
        assert info is not None and not info.allocated
    assert hot.allocations == 2
    assert hot.reserved_bytes == reserved
    assert hot.steps() == [59, 58]


def test_a_shape_change_reallocates_only_the_slot_written():
    hot = HotSnapshot()
    hot.take(1, small_state(1.0, 1))
    grown = {**small_state(2.0, 2), "exp_avg": torch.full((128, 64), 2.0)}
    info = hot.take(2, grown)
    assert info is not None and info.allocated
    assert hot.allocations == 3
    assert_same(hot.get(1).state, small_state(1.0, 1))  # the other slot, untouched
    assert_same(hot.get(2).state, grown)
    info = hot.take(3, {**grown, "data": {"step": 3}})
    assert info is not None and info.allocated  # the old slot is now reshaped too
    info = hot.take(4, {**grown, "data": {"step": 4}})
    assert info is not None and not info.allocated
    assert hot.allocations == 4

    shrunk = small_state(5.0, 5)  # fits in the existing buffer: laid out again, not allocated
    info = hot.take(5, shrunk)
    assert info is not None and not info.allocated
    assert_same(hot.get(5).state, shrunk)
    assert from_bytes(hot.to_bytes(5)).state["data"] == {"step": 5, "position": 50}


# --- checksums and bytes -----------------------------------------------------------------------


def test_checksums_have_the_wire_format_and_follow_the_content():
    hot = HotSnapshot()
    hot.take(1, small_state(1.0, 1))
    hot.take(2, small_state(1.0, 1))
    first = hot.checksum(1)
    TypeAdapter(Checksum).validate_python(first)
    assert first.startswith("crc32:")
    assert hot.checksum(1) == first and hot.verify(1, first)
    assert hot.to_bytes(1).endswith(first.encode())

    changed = small_state(1.0, 1)
    changed["w"][3, 4] = 1.0000001
    hot.take(3, changed)
    assert hot.checksum(3) != first
    hot.take(4, {**small_state(1.0, 1), "data": {"step": 1, "position": 11}})
    assert hot.checksum(4) != first
    assert not hot.verify(4, first)


def test_verify_rereads_the_bytes():
    hot = HotSnapshot()
    hot.take(1, small_state(1.0, 1))
    checksum = hot.checksum(1)
    view = hot.latest(copy=False)
    assert view is not None
    view.state["w"][0, 0] = 42.0  # memory corruption of the slot
    assert not hot.verify(1, checksum)


def test_sha256_is_available():
    hot = HotSnapshot(algorithm="sha256")
    hot.take(1, small_state(1.0, 1))
    checksum = hot.checksum(1)
    TypeAdapter(Checksum).validate_python(checksum)
    assert checksum.startswith("sha256:") and len(checksum) == 7 + 64
    assert from_bytes(hot.to_bytes(1), checksum=checksum).step == 1
    assert hot.verify(1, checksum)
    assert hot.verify(1, hot.checksum(1, "crc32"))


def test_nbytes_is_the_serialized_size():
    hot = HotSnapshot()
    hot.take(1, training_state())
    assert hot.nbytes(1) == len(hot.to_bytes(1))


def test_streams_in_any_chunking_decode_the_same():
    hot = HotSnapshot(chunk_bytes=333)
    state = training_state()
    hot.take(7, state)
    chunks = [bytes(c) for c in hot.iter_bytes(7)]
    assert max(len(c) for c in chunks) <= 333
    whole = b"".join(chunks)
    rng = random.Random(1)
    decoder = SnapshotDecoder(checksum=hot.checksum(7))
    pos = 0
    while pos < len(whole):
        size = rng.choice([1, 2, 5, 64, 1000, 10_000])
        decoder.feed(whole[pos : pos + size])
        pos += size
    restored = decoder.finish()
    assert restored.step == 7
    assert_same(restored.state, state)
    assert_same(from_bytes(iter(chunks)).state, state)


def read_as_a_socket(decoder: SnapshotDecoder, stream: bytes, seed: int) -> None:
    """Drive ``decoder`` as ``replication.fetch_into`` does, with short reads of any size."""
    rng = random.Random(seed)
    pos = 0
    while pos < len(stream):
        part = decoder.writable(min(rng.choice([1, 3, 64, 1000, 70_000]), len(stream) - pos))
        assert len(part) > 0 and not part.readonly
        got = min(len(part), rng.choice([1, 7, 500, 100_000]))
        part[:got] = stream[pos : pos + got]
        decoder.wrote(got)
        pos += got


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_bytes_read_into_the_decoders_tensors_decode_as_fed_ones(seed):
    """The sink path (a socket reading straight into the tensors) against ``feed``."""
    state = {
        **training_state(),
        "empty": torch.empty(0),
        "odd": torch.arange(7, dtype=torch.int8),
        "big": torch.randn(300, 70, dtype=torch.float64),
    }
    hot = HotSnapshot()
    hot.take(5, state)
    stream = hot.to_bytes(5)
    decoder = SnapshotDecoder(checksum=hot.checksum(5))
    read_as_a_socket(decoder, stream, seed)
    restored = decoder.finish()
    assert restored.step == 5
    assert_same(restored.state, from_bytes(stream).state)
    assert_same(restored.state, state)


def test_a_flipped_data_byte_read_into_place_is_caught_unless_the_stream_was_verified():
    hot = HotSnapshot()
    hot.take(3, small_state(1.0, 3))
    data = bytearray(hot.to_bytes(3))
    header_len = int.from_bytes(data[8:16], "little")
    skeleton = json.loads(data[16 : 16 + header_len])["skeleton"]
    data[16 + header_len + skeleton + 100] ^= 0x01
    decoder = SnapshotDecoder()
    read_as_a_socket(decoder, bytes(data), 0)
    with pytest.raises(CorruptSnapshot, match="checksum mismatch at step 3"):
        decoder.finish()
    # trusted: the caller hashed the whole stream against a digest it trusts (a fetch does,
    # and drops the result when they differ), so the trailer is not hashed again; the
    # structure still is checked.
    trusted = SnapshotDecoder(trusted=True)
    read_as_a_socket(trusted, bytes(data), 0)
    assert trusted.finish().step == 3
    with pytest.raises(CorruptSnapshot, match="truncated snapshot"):
        from_bytes(bytes(data[:-3]), trusted=True)


def test_an_empty_state_round_trips():
    hot = HotSnapshot()
    hot.take(0, {})
    assert from_bytes(hot.to_bytes(0)).state == {}
    latest = hot.latest()
    assert latest is not None and latest.state == {}


@pytest.mark.parametrize("where", ["header", "skeleton", "data", "trailer"])
def test_from_bytes_rejects_a_flipped_byte(where):
    hot = HotSnapshot()
    hot.take(3, small_state(1.0, 3))
    data = bytearray(hot.to_bytes(3))
    header_len = int.from_bytes(data[8:16], "little")
    header = json.loads(data[16 : 16 + header_len])
    position = {
        "header": 16 + header_len - 2,
        "skeleton": 16 + header_len + header["skeleton"] - 3,
        "data": 16 + header_len + header["skeleton"] + 100,
        "trailer": len(data) - 1,
    }[where]
    data[position] ^= 0x01
    with pytest.raises(CorruptSnapshot) as caught:
        from_bytes(bytes(data))
    if where in ("skeleton", "data"):
        assert "checksum mismatch at step 3" in str(caught.value)


def test_from_bytes_rejects_broken_streams_clearly():
    hot = HotSnapshot()
    hot.take(3, small_state(1.0, 3))
    good = hot.to_bytes(3)
    with pytest.raises(CorruptSnapshot, match="truncated snapshot"):
        from_bytes(good[:-5])
    with pytest.raises(CorruptSnapshot, match="truncated snapshot"):
        from_bytes(good[:1000])
    with pytest.raises(CorruptSnapshot, match="bad magic"):
        from_bytes(b"X" + good[1:])
    with pytest.raises(CorruptSnapshot, match="bytes after the checksum trailer"):
        from_bytes(good + b"\x00")
    with pytest.raises(CorruptSnapshot, match="expected crc32:00000000"):
        from_bytes(good, checksum="crc32:00000000")
    with pytest.raises(CorruptSnapshot, match="exceeds the limit"):
        from_bytes(good, max_bytes=100)


def test_a_skeleton_cannot_smuggle_code():
    """Even with a valid checksum, the skeleton may only name the placeholder and OrderedDict."""

    class Evil:
        def __reduce__(self):
            return (print, ("pwned",))

    skeleton = pickle.dumps({"x": Evil()}, protocol=5)
    header = snap._header(1, "crc32", [], len(skeleton), 0)
    body = snap.MAGIC + len(header).to_bytes(8, "little") + header + skeleton
    trailer = f"crc32:{zlib.crc32(body):08x}".encode()
    payload = body + len(trailer).to_bytes(2, "little") + trailer
    with pytest.raises(CorruptSnapshot, match=r"builtins\.print"):
        from_bytes(payload)


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="unknown checksum algorithm"):
        HotSnapshot(algorithm="md4")
    hot = HotSnapshot()
    with pytest.raises(ValueError, match="non-negative"):
        hot.take(-1, {})
    hot.take(1, {})
    with pytest.raises(ValueError, match="malformed checksum"):
        hot.verify(1, "CRC:xyz")


@pytest.mark.parametrize("first", ["serialized", "iter_bytes"])
def test_serialized_views_are_the_stream_without_a_copy_and_digested_in_one_pass(first):
    """``serialized`` gives the slot's bytes as they are (prefix, tensor data, trailer), with
    the sha256 of the whole stream, equal to hashing ``to_bytes``; whichever of it and
    ``iter_bytes`` computes the trailer's crc32 first, both agree."""
    import hashlib

    import numpy

    hot = HotSnapshot()
    hot.take(5, training_state())
    if first == "iter_bytes":
        expected_bytes = hot.to_bytes(5)
    with hot.serialized(5) as form:
        joined = b"".join(bytes(part) for part in form.parts)
        assert form.step == 5 and form.nbytes == len(joined) == hot.nbytes(5)
        # The tensor bytes are a view of the slot itself, not a copy.
        slot = next(s for s in hot._slots if s.step == 5)
        assert slot.buffer is not None
        assert form.parts[1].obj is not None and form.parts[1].readonly
        assert form.parts[1].nbytes == slot.size
        slot_address = slot.buffer.data_ptr()
        view_address = numpy.frombuffer(form.parts[1], dtype=numpy.uint8).ctypes.data
        assert view_address == slot_address
        # Pinned while the block runs: a take skips rather than overwrite it.
        hot.take(6, training_state())
        assert hot.take(7, training_state()) is None
    if first == "serialized":
        expected_bytes = hot.to_bytes(5)
    assert joined == expected_bytes
    assert form.digest == "sha256:" + hashlib.sha256(expected_bytes).hexdigest()
    assert hot.stream_digest(5) == form.digest == hot.stream_digest(5, cached=False)
    assert from_bytes(joined).step == 5
    assert hot.take(7, training_state()) is not None  # unpinned after the block


def test_a_stream_digest_follows_the_content_and_a_missing_step_is_not_found():
    hot = HotSnapshot()
    hot.take(1, small_state(1.0, 1))
    hot.take(2, small_state(2.0, 2))
    assert hot.stream_digest(1) != hot.stream_digest(2)
    with pytest.raises(SnapshotNotFound), hot.serialized(3):
        pass


@pytest.mark.parametrize("seed", [0, 1])
def test_memory_the_decoder_names_is_not_written_again(seed):
    """A fetch may hash what landed on another thread after ``wrote``: every piece of memory
    ``writable`` named (tensor data, prefix, padding, trailer) still holds the bytes that
    landed there once the whole stream is in."""
    state = {**training_state(), "odd": torch.arange(7, dtype=torch.int8)}
    hot = HotSnapshot()
    hot.take(5, state)
    stream = hot.to_bytes(5)
    decoder = SnapshotDecoder(trusted=True)
    rng = random.Random(seed)
    landed: list[tuple[memoryview, bytes]] = []
    pos = 0
    while pos < len(stream):
        part = decoder.writable(min(rng.choice([1, 5, 64, 1000, 70_000]), len(stream) - pos))
        got = min(len(part), rng.choice([1, 9, 500, 100_000]))
        part[:got] = stream[pos : pos + got]
        landed.append((part[:got], stream[pos : pos + got]))
        decoder.wrote(got)
        pos += got
    assert all(bytes(view) == data for view, data in landed)
    assert_same(decoder.finish().state, state)


def test_a_digest_abandoned_midway_caches_nothing_and_the_block_is_not_entered():
    """``serialized(check=...)``: what ``check`` raises between the digest's chunks ends it;
    nothing is cached, the slot is unpinned, and a later digest is the whole stream's."""
    import hashlib

    hot = HotSnapshot()
    hot.take(5, {"w": torch.randn(3 * snap._DIGEST_CHUNK // 4)})
    calls = []

    def check() -> None:
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("given up")

    entered = False
    with pytest.raises(RuntimeError, match="given up"), hot.serialized(5, check=check):
        entered = True
    assert not entered and len(calls) == 2
    slot = next(s for s in hot._slots if s.step == 5)
    assert slot.readers == 0 and not any(k.startswith("stream:") for k in slot.checksums)
    with hot.serialized(5, check=lambda: None) as form:
        assert form.digest == "sha256:" + hashlib.sha256(hot.to_bytes(5)).hexdigest()
