"""Hot snapshots of a rank's training state in preallocated CPU memory, double-buffered.

A state is a tree of ``dict``/``OrderedDict``/``list``/``tuple`` whose leaves are tensors or
plain values (``None``, ``bool``, ``int``, ``float``, ``str``, ``bytes``), such as
``{"model": model.state_dict(), "optimizer": opt.state_dict(), "data": {"step": 10}}``.
It is flattened into its tensors and a *skeleton* (the same tree with a placeholder per tensor).

Two slots hold two snapshots. ``take`` writes into the slot that is not the newest complete
one, marks it *writing* first and *complete* only after every tensor has landed, so a failure
at any point of a copy (an exception, ``KeyboardInterrupt``) leaves the newest complete snapshot
untouched; a dying process takes its memory with it. Each slot is one flat byte buffer,
allocated on the first snapshot (pinned when the sources are CUDA tensors) and reused until the
tensors' shapes change. CUDA tensors are copied on a side stream without the CPU waiting: the
copy follows what the step queued, the training stream's later work waits for it on the GPU,
and readers wait for its event before they read. Readers (``latest``, ``checksum``,
``iter_bytes``) pin the slot they read so that ``take`` never overwrites it mid-read: a
``take`` whose only writable slot is pinned is skipped (returns ``None``) rather than blocking
training.

Checksums stay off ``take``'s path: ``checksum(step)`` computes one on demand over the same
bytes that ``iter_bytes(step)`` streams to a peer, and ``from_bytes``/``SnapshotDecoder``
rebuild a state from those bytes after verifying them.

Wire format (all integers little-endian)::

    b"ESNAP01\\n" | u64 header length | header (JSON) | skeleton (pickle) |
    tensor data (each tensor at a 64-byte aligned offset, zero padding) |
    u16 trailer length | trailer: the checksum "<algorithm>:<hex>" of everything before it
"""

from __future__ import annotations

import hashlib
import io
import json
import pickle
import re
import struct
import threading
import time
import zlib
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import torch

MAGIC = b"ESNAP01\n"
#: Tensor data offsets are multiples of this (and of every dtype's element size).
ALIGN = 64
DEFAULT_ALGORITHM = "crc32"
DEFAULT_CHUNK_BYTES = 4 * 1024 * 1024
#: Bytes hashed at a time when two hashes go over a snapshot in one pass (stays in cache:
#: crc32 and sha256 together over 1 MiB chunks took 0.31 s per 300 MB here, apart 0.40 s).
_DIGEST_CHUNK = 1024 * 1024
#: Largest JSON header a decoder accepts (a header lists one dtype and shape per tensor).
MAX_HEADER_BYTES = 64 * 1024 * 1024

CHECKSUM_PATTERN = re.compile(r"^[a-z0-9]{1,16}:[0-9a-f]{1,128}$")
_U64 = struct.Struct("<Q")
_U16 = struct.Struct("<H")
_PICKLE_PROTOCOL = 5
_LEAF_TYPES: frozenset[type] = frozenset({type(None), bool, int, float, str, bytes})
_DTYPES: dict[str, torch.dtype] = {
    str(value).removeprefix("torch."): value
    for value in vars(torch).values()
    if isinstance(value, torch.dtype)
}

SlotState = Literal["empty", "writing", "complete"]


class SnapshotError(Exception):
    """Base of every error a snapshot raises on purpose."""


class UnsupportedState(SnapshotError, TypeError):
    """The state holds a value that a snapshot cannot carry."""


class SnapshotNotFound(SnapshotError, LookupError):
    """No complete snapshot holds the requested step."""


class CorruptSnapshot(SnapshotError, ValueError):
    """Snapshot bytes are truncated, malformed, or fail their checksum."""


@dataclass(frozen=True)
class Restored:
    """A snapshot rebuilt as a nested state of CPU tensors and plain values."""

    step: int
    state: Any


@dataclass(frozen=True)
class SnapshotInfo:
    """What one ``take`` did."""

    step: int
    #: Tensor bytes copied (without alignment padding).
    nbytes: int
    seconds: float
    slot: int
    #: The slot's buffer was (re)allocated by this take.
    allocated: bool


@dataclass(frozen=True)
class Serialized:
    """A snapshot's serialized form as views of its slot (``HotSnapshot.serialized``)."""

    step: int
    #: Prefix (magic, header, skeleton), the tensor bytes, trailer: concatenated, the form
    #: ``iter_bytes`` yields. Valid while the ``serialized`` block runs.
    parts: tuple[memoryview, memoryview, memoryview]
    nbytes: int
    #: The digest of the whole form, trailer included (``<algorithm>:<hex>``).
    digest: str


@dataclass(frozen=True)
class SlotStatus:
    """The state of one slot, for diagnostics and tests."""

    state: SlotState
    step: int | None
    readers: int


class _TensorRef:
    """Stand in for the tensor at ``index`` in a skeleton."""

    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index

    def __reduce__(self) -> tuple[type[_TensorRef], tuple[int]]:
        return (_TensorRef, (self.index,))

    def __repr__(self) -> str:
        return f"_TensorRef({self.index})"


@dataclass(frozen=True)
class _Spec:
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        numel = 1
        for size in self.shape:
            numel *= size
        return numel * self.dtype.itemsize


def _align(offset: int) -> int:
    return (offset + ALIGN - 1) // ALIGN * ALIGN


def _layout(specs: Sequence[_Spec]) -> tuple[list[int], int]:
    """Return each tensor's offset in the data region and the region's size."""
    offsets = []
    end = 0
    for spec in specs:
        start = _align(end)
        offsets.append(start)
        end = start + spec.nbytes
    return offsets, _align(end)


def _views(
    buffer: torch.Tensor, specs: Sequence[_Spec], offsets: Sequence[int]
) -> list[torch.Tensor]:
    return [
        buffer[offset : offset + spec.nbytes].view(spec.dtype).view(spec.shape)
        for spec, offset in zip(specs, offsets, strict=True)
    ]


def _bytes_of(buffer: torch.Tensor) -> memoryview:
    """Return the bytes of a flat CPU uint8 tensor, without copying."""
    # numpy's stubs declare the buffer protocol for Python 3.12+ only.
    return memoryview(buffer.numpy()).cast("B")  # type: ignore[arg-type]


# --- checksums ---------------------------------------------------------------------------------


class _Hasher(Protocol):
    def update(self, data: bytes | bytearray | memoryview) -> None: ...

    def hexdigest(self) -> str: ...


class _Crc32:
    def __init__(self) -> None:
        self._value = 0

    def update(self, data: bytes | bytearray | memoryview) -> None:
        self._value = zlib.crc32(data, self._value)

    def hexdigest(self) -> str:
        return f"{self._value:08x}"


_HASHERS: dict[str, tuple[Callable[[], _Hasher], int]] = {
    # name: (factory, hex digits)
    "crc32": (_Crc32, 8),
    "sha256": (hashlib.sha256, 64),
}


def _hasher(algorithm: str) -> _Hasher:
    try:
        return _HASHERS[algorithm][0]()
    except KeyError:
        known = ", ".join(sorted(_HASHERS))
        raise ValueError(f"unknown checksum algorithm {algorithm!r} (known: {known})") from None


def _trailer_nbytes(algorithm: str) -> int:
    return _U16.size + len(algorithm) + 1 + _HASHERS[algorithm][1]


# --- flattening --------------------------------------------------------------------------------


class _Unsupported(Exception):
    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason
        #: Where, innermost first: "[key]" or ".attribute".
        self.path: list[str] = []


def _child(item: object, where: str, tensors: list[torch.Tensor], seen: dict[int, int]) -> object:
    try:
        return _flatten(item, tensors, seen)
    except _Unsupported as exc:
        exc.path.append(where)
        raise


def _flatten(value: object, tensors: list[torch.Tensor], seen: dict[int, int]) -> object:
    """Return ``value``'s skeleton, appending its tensors (each object once) to ``tensors``."""
    if isinstance(value, torch.Tensor):
        index = seen.get(id(value))
        if index is None:
            if value.layout != torch.strided or value.is_meta:
                where = f"{value.layout} tensor on {value.device}"
                raise _Unsupported(f"a {where}: it has no strided bytes to copy")
            index = seen[id(value)] = len(tensors)
            tensors.append(value)
        return _TensorRef(index)
    kind = type(value)
    if kind in _LEAF_TYPES:
        return value
    if kind is dict or kind is OrderedDict:
        assert isinstance(value, dict)
        out: dict[object, object] = kind()
        for key, item in value.items():
            if type(key) not in _LEAF_TYPES:
                raise _Unsupported(f"a key of type {type(key).__qualname__}")
            out[key] = _child(item, f"[{key!r}]", tensors, seen)
        if kind is OrderedDict:
            # Attributes too, e.g. the ``_metadata`` that Module.state_dict() attaches.
            for name, item in vars(value).items():
                setattr(out, name, _child(item, f".{name}", tensors, seen))
        return out
    if kind is list or kind is tuple:
        assert isinstance(value, list | tuple)
        items = [_child(item, f"[{i}]", tensors, seen) for i, item in enumerate(value)]
        return items if kind is list else tuple(items)
    raise _Unsupported(f"a value of type {kind.__qualname__}")


def _flatten_state(state: object) -> tuple[object, list[torch.Tensor]]:
    tensors: list[torch.Tensor] = []
    try:
        skeleton = _flatten(state, tensors, {})
    except _Unsupported as exc:
        where = "state" + "".join(reversed(exc.path))
        raise UnsupportedState(
            f"{where}: cannot snapshot {exc.reason}; a state holds dict, OrderedDict, list, "
            "tuple, tensors, None, bool, int, float, str and bytes"
        ) from None
    return skeleton, tensors


def _build(node: object, tensors: Sequence[torch.Tensor]) -> Any:
    """Return the state that ``node`` describes, with ``tensors`` in place of its refs."""
    kind = type(node)
    if kind is _TensorRef:
        assert isinstance(node, _TensorRef)
        if not 0 <= node.index < len(tensors):
            raise CorruptSnapshot(f"skeleton refers to tensor {node.index} of {len(tensors)}")
        return tensors[node.index]
    if kind in _LEAF_TYPES:
        return node
    if kind is dict or kind is OrderedDict:
        assert isinstance(node, dict)
        out: dict[object, object] = kind()
        for key, item in node.items():
            if type(key) not in _LEAF_TYPES:
                raise CorruptSnapshot(f"skeleton holds a key of type {type(key).__qualname__}")
            out[key] = _build(item, tensors)
        for name, item in vars(node).items() if kind is OrderedDict else ():
            if not isinstance(name, str) or name.startswith("__"):
                raise CorruptSnapshot(f"skeleton sets attribute {name!r}")
            setattr(out, name, _build(item, tensors))
        return out
    if kind is list:
        assert isinstance(node, list)
        return [_build(item, tensors) for item in node]
    if kind is tuple:
        assert isinstance(node, tuple)
        return tuple(_build(item, tensors) for item in node)
    raise CorruptSnapshot(f"skeleton holds a value of type {kind.__qualname__}")


class _SkeletonUnpickler(pickle.Unpickler):
    """Unpickle a skeleton, refusing every global but the two a skeleton uses."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == (__name__, "_TensorRef"):
            return _TensorRef
        if (module, name) == ("collections", "OrderedDict"):
            return OrderedDict
        raise CorruptSnapshot(f"skeleton refers to {module}.{name}, which a snapshot never holds")


def _load_skeleton(data: bytes) -> object:
    try:
        return _SkeletonUnpickler(io.BytesIO(data)).load()
    except CorruptSnapshot:
        raise
    except Exception as exc:
        raise CorruptSnapshot(f"skeleton does not unpickle: {exc}") from exc


def _header(step: int, algorithm: str, specs: Sequence[_Spec], skeleton: int, data: int) -> bytes:
    body = {
        "step": step,
        "checksum": algorithm,
        "tensors": [[str(s.dtype).removeprefix("torch."), list(s.shape)] for s in specs],
        "skeleton": skeleton,
        "data": data,
    }
    return json.dumps(body, separators=(",", ":"), sort_keys=True).encode()


# --- the double buffer -------------------------------------------------------------------------


class _Slot:
    """One of the two buffers, with what it holds."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.state: SlotState = "empty"
        self.step = -1
        #: Completion order: the newest complete slot has the largest.
        self.seq = -1
        self.readers = 0
        self.buffer: torch.Tensor | None = None
        self.pinned = False
        self.specs: tuple[_Spec, ...] = ()
        self.offsets: list[int] = []
        self.size = 0
        self.views: list[torch.Tensor] = []
        self.skeleton: object = None
        self.skeleton_bytes: bytes | None = None
        self.checksums: dict[str, str] = {}
        #: The CUDA event of a copy still in flight on the side stream (None: none).
        self.pending: Any = None

    @property
    def capacity(self) -> int:
        return 0 if self.buffer is None else self.buffer.numel()

    def reset(self, state: SlotState) -> None:
        if self.pending is not None:  # never rewrite a buffer a copy still lands in
            self.pending.synchronize()
            self.pending = None
        self.state = state
        self.step = -1
        self.seq = -1
        self.skeleton = None
        self.skeleton_bytes = None
        self.checksums = {}

    def fit(self, specs: tuple[_Spec, ...], pinned: bool) -> bool:
        """Lay the buffer out for ``specs``; return whether it had to be allocated."""
        if specs == self.specs and pinned == self.pinned and self.buffer is not None:
            return False
        offsets, size = _layout(specs)
        allocated = self.buffer is None or size > self.capacity or pinned != self.pinned
        if allocated:
            self.buffer, self.views = None, []  # free the old buffer before allocating
            self.specs, self.offsets, self.size = (), [], 0
            # Zeroing faults every page in now rather than during a later take.
            self.buffer = torch.zeros(max(size, 1), dtype=torch.uint8, pin_memory=pinned)
            self.pinned = pinned
        else:
            assert self.buffer is not None
            self.buffer.zero_()  # padding reads as zeros in every layout
        self.specs, self.offsets, self.size = specs, offsets, size
        self.views = _views(self.buffer, specs, offsets)
        return allocated

    def skeleton_blob(self) -> bytes:
        if self.skeleton_bytes is None:
            self.skeleton_bytes = pickle.dumps(self.skeleton, protocol=_PICKLE_PROTOCOL)
        return self.skeleton_bytes

    def prefix(self, algorithm: str) -> bytes:
        """Return the bytes before the tensor data: magic, header, skeleton."""
        skeleton = self.skeleton_blob()
        header = _header(self.step, algorithm, self.specs, len(skeleton), self.size)
        return MAGIC + _U64.pack(len(header)) + header + skeleton

    def data(self) -> memoryview:
        assert self.buffer is not None
        return _bytes_of(self.buffer[: self.size]).toreadonly()


class _Behind:
    """CPU tensors copied into a slot on a thread of their own (``take``'s ``later``), while
    the caller goes on: ``synchronize`` waits until they landed."""

    def __init__(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self._error: BaseException | None = None
        self._thread = threading.Thread(
            target=self._run, args=(pairs,), name="elastic-take", daemon=True
        )
        self._thread.start()

    def _run(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        try:
            with torch.no_grad():
                for dst, src in pairs:
                    dst.copy_(src)  # lets go of the GIL: the step goes on beside it
        except BaseException as exc:  # handed to synchronize's caller
            self._error = exc

    def synchronize(self) -> None:
        self._thread.join()
        if self._error is not None:
            raise RuntimeError(f"a snapshot's copy failed: {self._error}") from self._error


class HotSnapshot:
    """Keep the two newest snapshots of one rank's state in preallocated CPU memory."""

    def __init__(
        self, *, algorithm: str = DEFAULT_ALGORITHM, chunk_bytes: int = DEFAULT_CHUNK_BYTES
    ) -> None:
        """Prepare two empty slots; memory is allocated by the first ``take``."""
        _hasher(algorithm)
        if chunk_bytes < 1:
            raise ValueError("chunk_bytes must be positive")
        self.algorithm = algorithm
        self.chunk_bytes = chunk_bytes
        self._slots = (_Slot(0), _Slot(1))
        self._lock = threading.Lock()  # guards slot states, steps and readers
        self._writer = threading.Lock()  # one take at a time
        self._seq = 0
        self._allocations = 0
        self._skipped = 0
        #: One side stream per CUDA device, for copies that never block the step.
        self._streams: dict[Any, Any] = {}

    # -- writing --------------------------------------------------------------------------------

    def take(
        self,
        step: int,
        state: object,
        *,
        later: Callable[[torch.Tensor], bool] | None = None,
    ) -> SnapshotInfo | None:
        """Copy ``state`` into the slot that is not the newest complete one, then mark it complete.

        Returns ``None`` (and counts a skip) when that slot is being read. An exception raised
        during the copy leaves that slot empty and the newest complete snapshot untouched.

        ``later``: the CPU tensors it selects are copied on a thread of their own while the
        caller goes on (``SnapshotInfo.seconds`` is then what the caller waited): they must
        not change until ``settle`` returned (the session calls it before the optimizer's
        next step). Readers of the slot wait for them.
        """
        if step < 0:
            raise ValueError(f"step must be non-negative, got {step}")
        with self._writer:
            started = time.perf_counter()
            skeleton, tensors = _flatten_state(state)
            specs = tuple(_Spec(t.dtype, tuple(t.shape)) for t in tensors)
            cuda = {t.device for t in tensors if t.is_cuda}
            pinned = bool(cuda) and torch.cuda.is_available()
            with self._lock:
                slot = self._writable()
                if slot is None:
                    self._skipped += 1
                    return None
                slot.reset("writing")
            try:
                allocated = self._prepare(slot, specs, pinned)
                if pinned:
                    slot.pending = self._copy_on_side_stream(slot.views, tensors, cuda)
                else:
                    behind: list[tuple[torch.Tensor, torch.Tensor]] = []
                    with torch.no_grad():
                        for dst, src in zip(slot.views, tensors, strict=True):
                            if later is not None and not src.is_cuda and later(src):
                                behind.append((dst, src))
                            else:
                                dst.copy_(src)
                    if behind:
                        slot.pending = _Behind(behind)
            except BaseException:
                if cuda:  # no copy still in flight may land in a slot that is reused
                    for device in cuda:
                        torch.cuda.synchronize(device)
                with self._lock:
                    slot.reset("empty")
                raise
            with self._lock:
                self._seq += 1
                slot.state, slot.step, slot.seq = "complete", step, self._seq
                slot.skeleton = skeleton
            nbytes = sum(spec.nbytes for spec in specs)
            return SnapshotInfo(step, nbytes, time.perf_counter() - started, slot.index, allocated)

    def settle(self) -> None:
        """Wait until the copies ``take`` left to a thread (``later``) landed."""
        for slot in self._slots:
            pending = slot.pending
            if isinstance(pending, _Behind):
                pending.synchronize()

    def _copy_on_side_stream(
        self, views: Sequence[torch.Tensor], tensors: Sequence[torch.Tensor], devices: set[Any]
    ) -> Any:
        """Copy CUDA ``tensors`` into the pinned ``views`` on a side stream, without waiting:
        the copy starts after what the training stream queued so far (it sees the step's
        results), and the training stream's later work waits for it on the GPU (the next
        step's updates never race the copy), so the CPU goes on at once. Returns the event
        that marks the copy done; readers wait for it (``_reading``)."""
        (device,) = devices  # one GPU per member
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]
        training = torch.cuda.current_stream(device)
        stream.wait_stream(training)
        done = torch.cuda.Event()  # type: ignore[no-untyped-call]
        with torch.no_grad(), torch.cuda.stream(stream):
            for dst, src in zip(views, tensors, strict=True):
                if src.is_cuda:
                    src.record_stream(stream)  # its memory outlives the copy
                dst.copy_(src, non_blocking=src.is_cuda)
        done.record(stream)
        training.wait_stream(stream)
        return done

    def _writable(self) -> _Slot | None:
        newest = self._newest()
        free = [s for s in self._slots if s is not newest and s.readers == 0]
        return free[0] if free else None

    def _prepare(self, slot: _Slot, specs: tuple[_Spec, ...], pinned: bool) -> bool:
        first = all(s.buffer is None for s in self._slots)
        allocated = slot.fit(specs, pinned)
        self._allocations += allocated
        if first:  # both slots up front, so the second snapshot costs what every later one does
            other = self._slots[1 - slot.index]
            self._allocations += other.fit(specs, pinned)
        return allocated

    def discard(self, step: int) -> bool:
        """Forget the complete snapshot of ``step`` (e.g. one newer than a restore step)."""
        with self._lock:
            slot = self._find(step)
            if slot is None:
                return False
            slot.reset("empty")
            return True

    # -- reading --------------------------------------------------------------------------------

    def _newest(self) -> _Slot | None:
        complete = [s for s in self._slots if s.state == "complete"]
        return max(complete, key=lambda s: s.seq) if complete else None

    def _find(self, step: int) -> _Slot | None:
        matches = [s for s in self._slots if s.state == "complete" and s.step == step]
        return max(matches, key=lambda s: s.seq) if matches else None

    @contextmanager
    def _reading(self, step: int | None) -> Iterator[_Slot]:
        """Pin the snapshot of ``step`` (the newest when ``None``) while the block reads it."""
        with self._lock:
            slot = self._newest() if step is None else self._find(step)
            if slot is None:
                what = "any step" if step is None else f"step {step}"
                raise SnapshotNotFound(f"no complete snapshot of {what} (have {self._steps()})")
            slot.readers += 1
        try:
            if slot.pending is not None:  # a copy on the side stream: wait until it landed
                slot.pending.synchronize()
                slot.pending = None
            yield slot
        finally:
            with self._lock:
                slot.readers -= 1

    def _steps(self) -> list[int]:
        complete = sorted((s for s in self._slots if s.state == "complete"), key=lambda s: -s.seq)
        return [s.step for s in complete]

    def steps(self) -> list[int]:
        """Return the steps of the complete snapshots, newest first."""
        with self._lock:
            return self._steps()

    def status(self) -> tuple[SlotStatus, SlotStatus]:
        """Return each slot's state, step and reader count."""
        with self._lock:
            a, b = (
                SlotStatus(s.state, s.step if s.state == "complete" else None, s.readers)
                for s in self._slots
            )
            return a, b

    def latest(self, *, copy: bool = True) -> Restored | None:
        """Return the newest complete snapshot, or ``None`` when there is none.

        With ``copy`` (the default) its tensors are fresh clones. Without, they are views of the
        slot's buffer, valid only until the second ``take`` after this call; treat them as
        read-only and load them (``load_state_dict`` copies) before snapshotting again.
        """
        try:
            return self._restore(None, copy)
        except SnapshotNotFound:
            return None

    def get(self, step: int, *, copy: bool = True) -> Restored:
        """Return the complete snapshot of ``step``, tensors cloned as in ``latest``."""
        return self._restore(step, copy)

    def _restore(self, step: int | None, copy: bool) -> Restored:
        with self._reading(step) as slot:
            tensors = [v.clone() for v in slot.views] if copy else list(slot.views)
            return Restored(slot.step, _build(slot.skeleton, tensors))

    # -- checksums and bytes --------------------------------------------------------------------

    def checksum(self, step: int, algorithm: str | None = None) -> str:
        """Compute (once, then cached) the checksum of the snapshot's serialized bytes."""
        algorithm = algorithm or self.algorithm
        with self._reading(step) as slot:
            cached = slot.checksums.get(algorithm)
            if cached is None:
                cached = slot.checksums[algorithm] = self._hash(slot, algorithm)
            return cached

    def verify(self, step: int, checksum: str) -> bool:
        """Return whether the snapshot of ``step`` still hashes to ``checksum`` (re-reading it)."""
        if not CHECKSUM_PATTERN.match(checksum):
            raise ValueError(f"malformed checksum {checksum!r}")
        with self._reading(step) as slot:
            return self._hash(slot, checksum.partition(":")[0]) == checksum

    @staticmethod
    def _hash(slot: _Slot, algorithm: str) -> str:
        hasher = _hasher(algorithm)
        hasher.update(slot.prefix(algorithm))
        hasher.update(slot.data())
        return f"{algorithm}:{hasher.hexdigest()}"

    def nbytes(self, step: int) -> int:
        """Return the size of the snapshot's serialized form (what ``iter_bytes`` yields)."""
        with self._reading(step) as slot:
            return len(slot.prefix(self.algorithm)) + slot.size + _trailer_nbytes(self.algorithm)

    def iter_bytes(self, step: int, *, chunk_bytes: int | None = None) -> Iterator[memoryview]:
        """Yield the snapshot's serialized form in chunks, checksum trailer last.

        Chunks are read-only views of the slot, valid until the next one is requested. The slot
        stays pinned (``take`` skips rather than overwrite it) until the iterator is exhausted
        or closed: close it when abandoning a transfer. The step is looked up on the first
        ``next``.
        """
        size = chunk_bytes or self.chunk_bytes
        with self._reading(step) as slot:
            cached = slot.checksums.get(self.algorithm)
            hasher = None if cached is not None else _hasher(self.algorithm)
            prefix = memoryview(slot.prefix(self.algorithm))
            data = slot.data()
            for part in (prefix, data):
                for start in range(0, len(part), size):
                    chunk = part[start : start + size]
                    if hasher is not None:
                        hasher.update(chunk)
                    yield chunk
            if hasher is not None:
                cached = slot.checksums[self.algorithm] = f"{self.algorithm}:{hasher.hexdigest()}"
            assert cached is not None
            tail = cached.encode()
            yield memoryview(_U16.pack(len(tail)) + tail)

    def to_bytes(self, step: int) -> bytes:
        """Return the snapshot's serialized form in one piece."""
        return b"".join(self.iter_bytes(step))

    @contextmanager
    def serialized(
        self, step: int, digest: str = "sha256", *, check: Callable[[], None] | None = None
    ) -> Iterator[Serialized]:
        """Pin the snapshot of ``step`` while the block sends its serialized form as it is:
        three read-only views (prefix, the slot's tensor bytes, trailer), no copy, with the
        ``digest`` of the whole form (trailer included; ``<algorithm>:<hex>``, as
        ``replication.digest`` of ``to_bytes`` gives it). The digest and the trailer's
        checksum are computed in one pass over the bytes, once per snapshot (cached).
        ``check`` is called between the digest's chunks: what it raises abandons the digest
        (nothing is cached) and leaves the block unentered."""
        with self._reading(step) as slot:
            whole = self._stream_digest(slot, digest, check=check)
            trailer = slot.checksums[self.algorithm].encode()
            parts = (
                memoryview(slot.prefix(self.algorithm)),
                slot.data(),
                memoryview(_U16.pack(len(trailer)) + trailer),
            )
            yield Serialized(slot.step, parts, sum(len(p) for p in parts), whole)

    def stream_digest(self, step: int, algorithm: str = "sha256", *, cached: bool = True) -> str:
        """The ``algorithm`` digest of the snapshot's serialized form, trailer included (what
        ``iter_bytes`` yields), computed once (then cached; ``cached=False``: recomputed, the
        trailer's checksum too, as for a snapshot seen for the first time)."""
        with self._reading(step) as slot:
            return self._stream_digest(slot, algorithm, cached)

    def _stream_digest(
        self,
        slot: _Slot,
        algorithm: str,
        cached: bool = True,
        check: Callable[[], None] | None = None,
    ) -> str:
        key = f"stream:{algorithm}"
        known = slot.checksums.get(key)
        if known is not None and cached:
            return known
        whole = _hasher(algorithm)
        own = slot.checksums.get(self.algorithm) if cached else None
        # The trailer's checksum, when not known yet, in the same pass: each chunk is hashed
        # twice while it is in cache (chunks of _DIGEST_CHUNK bytes).
        trailer = None if own is not None else _hasher(self.algorithm)
        for part in (memoryview(slot.prefix(self.algorithm)), slot.data()):
            for start in range(0, len(part), _DIGEST_CHUNK):
                if check is not None:
                    check()
                chunk = part[start : start + _DIGEST_CHUNK]
                whole.update(chunk)
                if trailer is not None:
                    trailer.update(chunk)
        if trailer is not None:
            own = slot.checksums[self.algorithm] = f"{self.algorithm}:{trailer.hexdigest()}"
        assert own is not None
        tail = own.encode()
        whole.update(_U16.pack(len(tail)) + tail)
        known = slot.checksums[key] = f"{algorithm}:{whole.hexdigest()}"
        return known

    # -- accounting -----------------------------------------------------------------------------

    @property
    def reserved_bytes(self) -> int:
        """Bytes of CPU memory held by the two slots."""
        return sum(slot.capacity for slot in self._slots)

    @property
    def allocations(self) -> int:
        """Slot buffers allocated so far (two on the first take, one per later reshape)."""
        return self._allocations

    @property
    def skipped(self) -> int:
        """Takes skipped because the slot to write was being read."""
        return self._skipped


# --- decoding ----------------------------------------------------------------------------------


class SnapshotDecoder:
    """Rebuild a snapshot from its serialized form fed in chunks of any size."""

    def __init__(
        self, *, checksum: str | None = None, max_bytes: int | None = None, trusted: bool = False
    ) -> None:
        """Expect the bytes to carry ``checksum`` when given, and at most ``max_bytes`` of data.
        ``trusted``: the caller has verified these exact bytes, trailer included, against a
        digest of the whole stream that it trusts (the one the control plane recorded), so
        the trailer's checksum is not computed again; the structure is checked all the same."""
        if checksum is not None and not CHECKSUM_PATTERN.match(checksum):
            raise ValueError(f"malformed checksum {checksum!r}")
        self._expected = checksum
        self._trusted = trusted
        self._max_bytes = max_bytes
        self._received = 0
        self._phase: Literal["prefix", "data", "trailer"] = "prefix"
        #: Prefix bytes (magic, header, skeleton), later the trailer's.
        self._pending = bytearray()
        self._header_len = -1
        self._skeleton_len = -1
        self._step = -1
        self._algorithm = DEFAULT_ALGORITHM
        self._specs: list[_Spec] = []
        self._skeleton = b""
        self._hasher: _Hasher | None = None
        #: Each tensor gets its own storage (``torch.set_rng_state`` crashes on a view at an
        #: offset); the data region's bytes are routed to them, padding skipped.
        self._tensors: list[torch.Tensor] = []
        self._segments: list[tuple[int, int, memoryview]] = []  # (start, stop, target)
        self._next_segment = 0
        self._data_size = 0
        self._written = 0
        #: As a sink: whether the last ``writable`` named a tensor's memory, or the scratch.
        self._direct = False
        self._scratch = bytearray()

    def _prefix_needed(self) -> int:
        head = len(MAGIC) + _U64.size
        if self._header_len < 0:
            return head
        if self._skeleton_len < 0:
            return head + self._header_len
        return head + self._header_len + self._skeleton_len

    def feed(self, chunk: bytes | bytearray | memoryview) -> None:
        """Consume the next chunk."""
        view = memoryview(chunk).cast("B")
        self._received += len(view)
        while len(view):
            if self._phase == "prefix":
                take = min(len(view), self._prefix_needed() - len(self._pending))
                self._pending += view[:take]
                view = view[take:]
                if len(self._pending) == self._prefix_needed():
                    self._parse_prefix()
            elif self._phase == "data":
                take = min(len(view), self._data_size - self._written)
                part = view[:take]
                if self._hasher is not None:
                    self._hasher.update(part)
                self._route(part)
                self._written += take
                view = view[take:]
                if self._written == self._data_size:
                    self._phase = "trailer"
            else:
                self._pending += view
                view = view[len(view) :]
                if len(self._pending) >= _U16.size:
                    (length,) = _U16.unpack_from(self._pending)
                    extra = len(self._pending) - _U16.size - length
                    if extra > 0:
                        raise CorruptSnapshot(f"{extra} bytes after the checksum trailer")

    # -- as a sink (rank_runtime.replication.fetch_into): bytes read straight into place ----

    def writable(self, limit: int) -> memoryview:
        """The memory the stream's next bytes go to (at most ``limit``, at least one): in the
        data region the tensor they belong to, so a socket reads into it with no copy; else
        a scratch buffer (the prefix exactly, the padding, the trailer), then ``feed``."""
        self._direct = False
        if self._phase == "data":
            start = self._written
            while (
                self._next_segment < len(self._segments)
                and self._segments[self._next_segment][1] <= start
            ):
                self._next_segment += 1
            if self._next_segment < len(self._segments):
                low, high, target = self._segments[self._next_segment]
                if low <= start:
                    self._direct = True
                    return target[start - low : start - low + min(limit, high - start)]
                limit = min(limit, low - start)  # padding up to the next tensor
            else:
                limit = min(limit, self._data_size - start)
        elif self._phase == "prefix":
            limit = min(limit, self._prefix_needed() - len(self._pending))
        # Fresh each time (the prefix, a padding, the trailer: small): memory once named is
        # not written again, so its bytes may still be hashed on another thread.
        self._scratch = bytearray(limit)
        return memoryview(self._scratch)

    def wrote(self, count: int) -> None:
        """``count`` bytes landed where ``writable`` said."""
        if not self._direct:
            self.feed(memoryview(self._scratch)[:count])
            return
        low, _, target = self._segments[self._next_segment]
        if self._hasher is not None:
            offset = self._written - low
            self._hasher.update(target[offset : offset + count])
        self._received += count
        self._written += count
        if self._written == self._data_size:
            self._phase = "trailer"

    def _parse_prefix(self) -> None:
        """Advance past the part of the prefix that ``_pending`` now completes."""
        pending = self._pending
        head = len(MAGIC) + _U64.size
        if self._header_len < 0:
            if pending[: len(MAGIC)] != MAGIC:
                raise CorruptSnapshot("not a snapshot (bad magic bytes)")
            (header_len,) = _U64.unpack_from(pending, len(MAGIC))
            if header_len > MAX_HEADER_BYTES:
                raise CorruptSnapshot(f"header of {header_len} bytes is implausibly large")
            self._header_len = header_len
        elif self._skeleton_len < 0:
            self._read_header(bytes(pending[head:]))
        else:
            self._skeleton = bytes(pending[head + self._header_len :])
            if not self._trusted:
                self._hasher = _hasher(self._algorithm)
                self._hasher.update(pending)
            self._pending = bytearray()
            self._phase = "data" if self._data_size else "trailer"
            return
        if len(pending) == self._prefix_needed():  # an empty header or skeleton
            self._parse_prefix()

    def _read_header(self, raw: bytes) -> None:
        try:
            header = json.loads(raw)
            step, algorithm = header["step"], header["checksum"]
            skeleton, data = header["skeleton"], header["data"]
            specs = [_Spec(_DTYPES[dtype], tuple(shape)) for dtype, shape in header["tensors"]]
        except (ValueError, KeyError, TypeError) as exc:
            raise CorruptSnapshot(f"malformed header: {exc!r}") from exc
        ints = [step, skeleton, data, *(size for spec in specs for size in spec.shape)]
        if any(type(n) is not int or n < 0 for n in ints):
            raise CorruptSnapshot("malformed header: sizes must be non-negative integers")
        if algorithm not in _HASHERS:
            raise CorruptSnapshot(f"unknown checksum algorithm {algorithm!r}")
        offsets, size = _layout(specs)
        if size != data:
            raise CorruptSnapshot(f"header says {data} data bytes, its tensors need {size}")
        if self._max_bytes is not None and data > self._max_bytes:
            raise CorruptSnapshot(
                f"snapshot of {data} bytes exceeds the limit of {self._max_bytes}"
            )
        self._step, self._algorithm, self._specs = step, algorithm, specs
        self._skeleton_len = skeleton
        self._data_size = size
        self._tensors = [torch.empty(spec.shape, dtype=spec.dtype) for spec in specs]
        self._segments = [
            (offset, offset + spec.nbytes, _bytes_of(tensor.reshape(-1).view(torch.uint8)))
            for spec, offset, tensor in zip(specs, offsets, self._tensors, strict=True)
        ]

    def _route(self, part: memoryview) -> None:
        """Copy ``part``, the data region's bytes from ``_written`` on, into the tensors."""
        start, end = self._written, self._written + len(part)
        while self._next_segment < len(self._segments):
            low, high, target = self._segments[self._next_segment]
            if low >= end:
                return
            a, b = max(low, start), min(high, end)
            if a < b:
                target[a - low : b - low] = part[a - start : b - start]
            if high > end:
                return
            self._next_segment += 1

    def finish(self) -> Restored:
        """Verify the checksum and return the rebuilt state, each tensor in its own storage."""
        complete = self._phase == "trailer" and len(self._pending) >= _U16.size
        if not complete or len(self._pending) != _U16.size + _U16.unpack_from(self._pending)[0]:
            raise CorruptSnapshot(
                f"truncated snapshot: the stream ended after {self._received} bytes"
            )
        try:
            carried = bytes(self._pending[_U16.size :]).decode("ascii")
        except UnicodeDecodeError as exc:
            raise CorruptSnapshot("malformed checksum trailer") from exc
        if self._trusted:  # these bytes, trailer included, hash to a digest the caller trusts
            computed = carried
        else:
            assert self._hasher is not None
            computed = f"{self._algorithm}:{self._hasher.hexdigest()}"
        if carried != computed:
            raise CorruptSnapshot(
                f"checksum mismatch at step {self._step}: the bytes hash to {computed}, "
                f"their trailer says {carried}"
            )
        if self._expected is not None and self._expected != computed:
            raise CorruptSnapshot(
                f"checksum mismatch at step {self._step}: the bytes hash to {computed}, "
                f"expected {self._expected}"
            )
        skeleton = _load_skeleton(self._skeleton)
        return Restored(self._step, _build(skeleton, self._tensors))


def from_bytes(
    data: bytes | bytearray | memoryview | Iterable[bytes | bytearray | memoryview],
    *,
    checksum: str | None = None,
    max_bytes: int | None = None,
    trusted: bool = False,
) -> Restored:
    """Rebuild a snapshot from its serialized form (one buffer or an iterable of chunks).

    Raises ``CorruptSnapshot`` when the bytes are truncated or malformed, or hash to anything
    but their trailer's checksum (and ``checksum`` when given). ``trusted``: the caller
    verified the whole stream against a digest it trusts (``SnapshotDecoder``), so the
    trailer's checksum is read but not recomputed.
    """
    decoder = SnapshotDecoder(checksum=checksum, max_bytes=max_bytes, trusted=trusted)
    chunks = [data] if isinstance(data, bytes | bytearray | memoryview) else data
    for chunk in chunks:
        decoder.feed(chunk)
    return decoder.finish()
