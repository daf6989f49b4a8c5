"""Cold checkpoints: the fallback when every hot copy of a shard is gone.

Every ``checkpoint_every`` backups (the job's policy) each rank writes the state it just
backed up to a directory every member can read (a shared filesystem in a real cluster), from a
background thread, in torch.distributed.checkpoint's (DCP) format, and ``checkpoint.saved``
tells the control plane. The decider restores from a checkpoint only when no complete hot
backup survives; members then read the shards of that step (``read``), the same way they would
have fetched them from peers, and the session loads them as it loads hot shards (FSDP2 state
reshards through ``sharded.load``, ZeRO's through ``zero.consolidate``).

Layout of one step (``W`` ranks wrote it, ``R`` is one of them)::

    <dir>/<job>/step-<N>/shard-<R>-of-<W>.<token>.distcp   DCP data: each item torch.save'd
                                                          (tensors) or as bytes, at an offset
    <dir>/<job>/step-<N>/shard-<R>-of-<W>.pt               the shard's manifest (torch.save of
                                                          str/bytes): its DCP ``Metadata``,
                                                          the data file's name and size, and
                                                          the sha256 digest of all of it

*Saving.* The state is the hot snapshot's copy (taken on the training path already; DCP's
``async_save`` would stage the same copy), so the write needs nothing from training. Each rank
runs DCP's save protocol alone, with no process group (what ``dcp.save(no_dist=True,
use_collectives=False)`` does, without its logging wrapper, which queries the default process
group while a recovery may be destroying it): no collective runs on the training group from the
background thread. The planner writes a ``sharded.capture`` (FSDP2 / tensor parallel) under its
own DCP keys (``model.<fqn>``, ``optim.state.<fqn>.exp_avg``...) with each local chunk at its
offsets in the global tensor, so the shards of a complete step together are a DCP checkpoint of
the model and optimizer, loadable into any world by DCP's own load planner (``step_reader``).
The rest of the tree (DDP's replicated state, ZeRO's shard, random number generators, loader
state: the snapshot's types, a reference in place of each capture's chunk and object) is one
bytes item, ``shard-<R>/__rest__``, one ``torch.save`` read back with ``weights_only``, so a
read rebuilds the exact tree (integer keys, tuples, ``OrderedDict`` metadata, shared tensors)
at the cost the old single-file checkpoint had: DCP's format stores every tensor item as a
``torch.save`` of its own, which the many small tensors of a replicated model would pay for
without anything to gain (no other world loads them by key).

*Atomic commit.* DCP writes and fsyncs the data file under a name unique to this write (no
manifest names it yet), the manifest is written to a temporary file
(``.shard-<R>-of-<W>.<token>.tmp``) and fsynced, renamed into place, and the step's directory
is fsynced. Only a manifest makes a shard count (``shards_at``, ``read``, and
``checkpoint.saved``, which follows the rename), so a writer that dies at any point leaves
nothing that counts (the shard's next write of that step, or pruning, clears what it left); a
rewrite of the same shard never touches the files the current manifest names until its own
manifest replaces it. The control plane takes a step as complete when every shard's
``checkpoint.saved`` arrived.

*Integrity.* The digest is sha256 over the data file's bytes (hashed as DCP writes them), then
the pickled metadata and the manifest's header; ``checkpoint.saved`` reports it and its nbytes.
A read recomputes it from what it reads and refuses the shard (``CheckpointError``) before
anything is decoded when it does not match. (The digest guards against corruption; the manifest
carries it, so it is no defence against someone who may write the directory, which members trust
as they trust their own disks: the metadata is unpickled, as DCP does.)

*Retention.* A shard keeps its two newest checkpoints, so a newer one that never completes (its
writer died first) leaves the older, complete one in place.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import io
import json
import logging
import os
import pickle
import queue
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Generator, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from torch.distributed.checkpoint.filesystem import FileSystemReader
    from torch.distributed.checkpoint.metadata import Metadata

log = logging.getLogger(__name__)

#: Where cold checkpoints go, a directory every member reaches (``elasticctl run
#: --checkpoint-dir``; with the policy's ``checkpoint_every``); unset: none are written.
CHECKPOINT_DIR_ENV = "ELASTIC_CHECKPOINT_DIR"
#: Checkpoint steps each shard keeps on disk.
KEEP = 2
#: The manifest's ``format``; ``read`` refuses any other.
FORMAT = "elastic-dcp/1"
#: The digest of a shard (as ``checkpoint.saved`` reports it).
ALGORITHM = "sha256"
_REST = "__rest__"
_READ_CHUNK = 4 * 1024 * 1024
_PICKLE_PROTOCOL = 5
_LEAVES: frozenset[type] = frozenset({type(None), bool, int, float, str, bytes})


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be read (missing, or not what it claims to be)."""


@dataclass(frozen=True, slots=True)
class Saved:
    """One shard of a checkpoint, durable in place."""

    step: int
    shard: int
    shards: int
    #: Its manifest (the file whose rename committed it).
    path: str
    #: Bytes on disk: the data file and the manifest.
    nbytes: int
    #: ``sha256:<hex>`` (see the module's docstring).
    checksum: str
    seconds: float


@dataclass(frozen=True, slots=True)
class Loaded:
    """One shard of a checkpoint, read back and verified."""

    path: Path
    nbytes: int
    checksum: str
    state: Any


def is_due(step: int, backup_interval: int, every: int) -> bool:
    """True when the backup of ``step`` is also a cold checkpoint (the same steps on every
    rank, so checkpoints complete)."""
    return every > 0 and step % backup_interval == 0 and (step // backup_interval) % every == 0


def step_dir(root: str | Path, job_id: str, step: int) -> Path:
    return Path(root) / job_id / f"step-{step:09d}"


def _stem(shard: int, shards: int) -> str:
    return f"shard-{shard:05d}-of-{shards:05d}"


def shard_path(root: str | Path, job_id: str, step: int, shard: int, shards: int) -> Path:
    """The manifest of shard ``shard`` of ``shards`` at ``step`` (it exists once committed)."""
    return step_dir(root, job_id, step) / f"{_stem(shard, shards)}.pt"


# -- the state as DCP items -------------------------------------------------------------------


class _Ref:
    """Stands in the tree for a capture's chunk at ``offsets`` (a DCP tensor item) or, with
    None, a capture's object (a DCP bytes item)."""

    __slots__ = ("key", "offsets")

    def __init__(self, key: str, offsets: tuple[int, ...] | None) -> None:
        self.key = key
        self.offsets = offsets

    def __reduce__(self) -> tuple[type[_Ref], tuple[str, tuple[int, ...] | None]]:
        return (_Ref, (self.key, self.offsets))


class _Encoder:
    """Turns one shard's state into DCP write items and their data: a capture's chunks and
    objects under their own keys, the rest of the tree as one bytes item."""

    def __init__(self, shard: int) -> None:
        from torch.distributed.checkpoint.metadata import MetadataIndex

        self.rest = f"shard-{shard:05d}/{_REST}"
        self.items: list[Any] = []
        self.data: dict[MetadataIndex, torch.Tensor | bytes] = {}
        self._compact: dict[int, torch.Tensor] = {}

    def encode(self, state: Any) -> None:
        import torch

        buffer = io.BytesIO()
        torch.save(self._walk(state, ""), buffer)
        self._bytes(self.rest, buffer.getvalue())

    def _bytes(self, key: str, blob: bytes) -> _Ref:
        from torch.distributed.checkpoint.metadata import MetadataIndex
        from torch.distributed.checkpoint.planner import WriteItem, WriteItemType

        index = MetadataIndex(key)
        self.items.append(WriteItem(index=index, type=WriteItemType.BYTE_IO))
        self.data[index] = blob
        return _Ref(key, None)

    def _tensor(self, key: str, tensor: torch.Tensor, offsets: list[int], size: list[int]) -> _Ref:
        import torch
        from torch.distributed.checkpoint.metadata import (
            ChunkStorageMetadata,
            MetadataIndex,
            TensorProperties,
        )
        from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

        at = torch.Size(offsets)
        index = MetadataIndex(key, at)
        whole = list(tensor.shape) == list(size)
        self.items.append(
            WriteItem(
                index=index,
                type=WriteItemType.TENSOR if whole else WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=at, sizes=tensor.shape),
                    properties=TensorProperties.create_from_tensor(tensor),
                    size=torch.Size(size),
                ),
            )
        )
        self.data[index] = tensor
        return _Ref(key, tuple(at))

    def _walk(self, value: Any, path: str) -> Any:
        """``value`` with each capture in it encoded (refused: what a snapshot cannot hold)."""
        import torch

        if isinstance(value, torch.Tensor):
            if value.layout != torch.strided or value.is_meta:
                raise CheckpointError(f"state{path}: a {value.layout} tensor on {value.device}")
            if value.is_contiguous() and value.untyped_storage().nbytes() == value.nbytes:
                return value
            # torch.save writes a tensor's whole storage: a view goes as a copy of itself.
            compact = self._compact.get(id(value))
            if compact is None:
                compact = self._compact[id(value)] = value.clone(
                    memory_format=torch.contiguous_format
                )
            return compact
        kind = type(value)
        if kind in _LEAVES:
            return value
        if kind is dict and _is_capture(value) and not self._taken(value):
            return self._capture(value)
        if kind is dict or kind is OrderedDict:
            out = kind()
            for key, item in value.items():
                if type(key) not in _LEAVES:
                    raise CheckpointError(f"state{path}: a key of type {type(key).__qualname__}")
                out[key] = self._walk(item, f"{path}[{key!r}]")
            for name, item in vars(value).items() if kind is OrderedDict else ():
                setattr(out, name, self._walk(item, f"{path}.{name}"))
            return out
        if kind is list or kind is tuple:
            items = [self._walk(item, f"{path}[{i}]") for i, item in enumerate(value)]
            return items if kind is list else tuple(items)
        raise CheckpointError(f"state{path}: cannot checkpoint a {kind.__qualname__}")

    def _taken(self, capture: dict[str, Any]) -> bool:
        """Whether a key of ``capture`` is already an item (a second capture: kept whole)."""
        from torch.distributed.checkpoint.metadata import MetadataIndex

        keys = {i.fqn for i in self.data}
        return any(MetadataIndex(k) in self.data or k in keys
                   for k in (*capture["tensors"], *capture["objects"]))  # fmt: skip

    def _capture(self, capture: dict[str, Any]) -> dict[str, Any]:
        """A ``sharded.capture``: each chunk under its own DCP key at its global offsets, each
        object a DCP bytes item under its key (the layout ``dcp.save`` gives the model)."""
        import torch

        tensors: dict[str, Any] = {}
        for fqn, entry in capture["tensors"].items():
            size = list(entry["shape"])
            chunks = [
                {**c, "data": self._tensor(fqn, c["data"], list(c["offsets"]), size)}
                for c in entry["chunks"]
            ]
            tensors[fqn] = {**entry, "chunks": chunks}
        objects: dict[str, Any] = {}
        for fqn, value in capture["objects"].items():
            buffer = io.BytesIO()
            torch.save(value, buffer)
            objects[fqn] = self._bytes(fqn, buffer.getvalue())
        return {**capture, "tensors": tensors, "objects": objects}


def _is_capture(value: dict[Any, Any]) -> bool:
    if "format" not in value or "tensors" not in value:
        return False
    import torch

    from rank_runtime.sharded import FORMAT as CAPTURE

    return (
        value["format"] == CAPTURE
        and isinstance(value["tensors"], dict)
        and isinstance(value.get("objects"), dict)
        and all(isinstance(k, str) for k in (*value["tensors"], *value["objects"]))
        and all(
            isinstance(c.get("data"), torch.Tensor)
            for e in value["tensors"].values()
            for c in e.get("chunks", ())
        )
    )


def _decode(node: Any, tensors: Mapping[tuple[str, tuple[int, ...]], Any],
            blobs: Mapping[str, bytes]) -> Any:  # fmt: skip
    """``node`` with each ``_Ref`` replaced by what DCP read for it."""
    import torch

    kind = type(node)
    if kind is _Ref:
        if node.offsets is None:
            if node.key not in blobs:
                raise CheckpointError(f"the checkpoint lacks the object {node.key}")
            return torch.load(io.BytesIO(blobs[node.key]), weights_only=True)
        found = tensors.get((node.key, tuple(node.offsets)))
        if found is None:
            raise CheckpointError(f"the checkpoint lacks {node.key} at {list(node.offsets)}")
        return found
    if kind is dict or kind is OrderedDict:
        out = kind()
        for key, item in node.items():
            out[key] = _decode(item, tensors, blobs)
        for name, item in vars(node).items() if kind is OrderedDict else ():
            setattr(out, name, _decode(item, tensors, blobs))
        return out
    if kind is list or kind is tuple:
        items = [_decode(item, tensors, blobs) for item in node]
        return items if kind is list else tuple(items)
    return node  # a tensor or a plain value


# -- DCP: planners, storage -------------------------------------------------------------------


@functools.cache
def _dcp() -> SimpleNamespace:
    """The DCP planners and storage of a shard (defined on first use: DCP imports torch)."""
    import torch
    from torch.distributed.checkpoint.default_planner import create_default_global_save_plan
    from torch.distributed.checkpoint.filesystem import (
        CURRENT_DCP_VERSION,
        FileSystem,
        FileSystemReader,
        FileSystemWriter,
    )
    from torch.distributed.checkpoint.metadata import (
        Metadata,
        MetadataIndex,
        TensorStorageMetadata,
    )
    from torch.distributed.checkpoint.planner import (
        LoadItemType,
        LoadPlan,
        LoadPlanner,
        ReadItem,
        SavePlan,
        SavePlanner,
        WriteItem,
    )

    class HashingFile(io.RawIOBase):
        """A file being written whose bytes are hashed as they go."""

        def __init__(self, raw: Any, fs: HashingFileSystem) -> None:
            super().__init__()
            self._raw, self._fs = raw, fs

        def writable(self) -> bool:
            return True

        def write(self, data: Any) -> int:
            view = memoryview(data).cast("B")
            written: int = self._raw.write(view)
            self._fs.hasher.update(view[:written])
            self._fs.nbytes += written
            return written

        def tell(self) -> int:
            position: int = self._raw.tell()
            return position

        def fileno(self) -> int:
            self._raw.flush()  # DCP fsyncs the descriptor: nothing may wait in a buffer
            number: int = self._raw.fileno()
            return number

        def flush(self) -> None:
            self._raw.flush()

    class HashingFileSystem(FileSystem):
        def __init__(self) -> None:
            self.hasher = hashlib.sha256()
            self.nbytes = 0

        @contextlib.contextmanager
        def create_stream(self, path: str | os.PathLike[str], mode: str) -> Generator[Any]:
            if mode != "wb":
                with super().create_stream(path, mode) as stream:
                    yield stream
                return
            with open(path, "wb") as raw, HashingFile(raw, self) as stream:
                yield stream

    class ShardWriter(FileSystemWriter):
        """DCP's file system writer for one shard: one data file of the given name, fsynced,
        hashed as written; the metadata stays in memory (the manifest carries it)."""

        def __init__(self, path: Path, data_name: str) -> None:
            super().__init__(path, single_file_per_rank=True, sync_files=True, thread_count=1)
            self.fs = HashingFileSystem()
            self.data_name = data_name
            self.metadata: Metadata | None = None

        def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
            return plan

        def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
            return plans

        def write_data(self, plan: SavePlan, planner: SavePlanner) -> Any:
            files: queue.Queue[Any] = queue.Queue()
            files.put((self.fs.concat_path(self.path, self.data_name), self.data_name, plan.items))
            return self._write_data(planner, files)

        def finish(self, metadata: Metadata, results: list[list[Any]]) -> None:
            metadata.version = CURRENT_DCP_VERSION
            metadata.storage_data = {r.index: r.storage_data for rs in results for r in rs}
            metadata.storage_meta = self.storage_meta()
            self.metadata = metadata

    class ShardSavePlanner(SavePlanner):
        """Writes exactly the encoder's items (tensors at their offsets, bytes)."""

        def __init__(self, encoder: _Encoder) -> None:
            self.encoder = encoder

        def set_up_planner(self, state_dict: Any, storage_meta: Any = None,
                           is_coordinator: bool = False) -> None:  # fmt: skip
            pass

        def create_local_plan(self) -> SavePlan:
            return SavePlan(list(self.encoder.items))

        def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
            return create_default_global_save_plan(all_plans)

        def finish_plan(self, new_plan: SavePlan) -> SavePlan:
            return new_plan

        def resolve_data(self, write_item: WriteItem) -> torch.Tensor | io.BytesIO:
            value = self.encoder.data[write_item.index]
            if isinstance(value, bytes):
                return io.BytesIO(value)
            tensor = value.detach()
            if tensor.device.type != "cpu":
                tensor = tensor.cpu()
            # torch.save writes a tensor's whole storage: a view is written as a copy.
            if not tensor.is_contiguous() or tensor.untyped_storage().nbytes() != tensor.nbytes:
                tensor = tensor.clone(memory_format=torch.contiguous_format)
            return tensor

    class ShardLoadPlanner(LoadPlanner):
        """Reads every item of one shard's metadata back as it was saved."""

        def __init__(self) -> None:
            self.tensors: dict[tuple[str, tuple[int, ...]], torch.Tensor] = {}
            self.blobs: dict[str, bytes] = {}

        def set_up_planner(self, state_dict: Any, metadata: Metadata | None = None,
                           is_coordinator: bool = False) -> None:  # fmt: skip
            assert metadata is not None
            self.metadata = metadata

        def create_local_plan(self) -> LoadPlan:
            items = []
            for fqn, md in self.metadata.state_dict_metadata.items():
                if not isinstance(md, TensorStorageMetadata):
                    index, zero = MetadataIndex(fqn), torch.Size([0])
                    items.append(ReadItem(LoadItemType.BYTE_IO, index, zero, index, zero, zero))
                    continue
                for i, chunk in enumerate(md.chunks):
                    index = MetadataIndex(fqn, chunk.offsets, i)
                    zero = torch.Size([0] * len(chunk.sizes))
                    items.append(
                        ReadItem(LoadItemType.TENSOR, index, zero, index, zero, chunk.sizes)
                    )
            return LoadPlan(items)

        def create_global_plan(self, global_plan: list[LoadPlan]) -> list[LoadPlan]:
            return global_plan

        def finish_plan(self, central_plan: LoadPlan) -> LoadPlan:
            return central_plan

        def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
            self.blobs[read_item.dest_index.fqn] = value.getvalue()

        def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
            index = read_item.dest_index
            md = self.metadata.state_dict_metadata[index.fqn]
            assert isinstance(md, TensorStorageMetadata) and index.offset is not None
            tensor = torch.empty(read_item.lengths, dtype=md.properties.dtype)
            self.tensors[(index.fqn, tuple(index.offset))] = tensor
            return tensor

        def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
            pass

    class VerifiedReader(FileSystemReader):
        """DCP's file system reader over a step directory, with metadata already verified."""

        def __init__(self, path: Path, metadata: Metadata) -> None:
            super().__init__(path)
            self._verified = metadata

        def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
            return self._verified

    return SimpleNamespace(
        ShardWriter=ShardWriter,
        ShardSavePlanner=ShardSavePlanner,
        ShardLoadPlanner=ShardLoadPlanner,
        VerifiedReader=VerifiedReader,
        Metadata=Metadata,
    )


def _save(planner: Any, writer: Any) -> Metadata:
    """DCP's save protocol on one rank without a process group (``dcp.save``'s steps with
    ``no_dist=True, use_collectives=False``)."""
    planner.set_up_planner(state_dict={}, storage_meta=writer.storage_meta(), is_coordinator=True)
    writer.set_up_storage_writer(True, rank=0, use_collectives=False)
    plan = writer.prepare_local_plan(planner.create_local_plan())
    plans, metadata = planner.create_global_plan([plan])
    plan = planner.finish_plan(writer.prepare_global_plan(plans)[0])
    results = writer.write_data(plan, planner)
    results.wait()
    writer.finish(metadata=metadata, results=[results.value()])
    return writer.metadata  # type: ignore[no-any-return]


def _load(planner: Any, reader: Any) -> None:
    """DCP's load protocol on one rank without a process group."""
    metadata = reader.read_metadata()
    planner.set_up_planner({}, metadata, True)
    reader.set_up_storage_reader(metadata, True, rank=0, use_collectives=False)
    plan = reader.prepare_local_plan(planner.create_local_plan())
    plan = planner.finish_plan(reader.prepare_global_plan(planner.create_global_plan([plan]))[0])
    reader.read_data(plan, planner).wait()


# -- write ------------------------------------------------------------------------------------


def _header(step: int, shard: int, shards: int, data: str, nbytes: int) -> str:
    body = {"format": FORMAT, "step": step, "shard": shard, "shards": shards, "data": data,
            "nbytes": nbytes}  # fmt: skip
    return json.dumps(body, sort_keys=True, separators=(",", ":"))


def _fsync_dir(path: Path) -> None:
    directory = os.open(path, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)


def write(
    root: str | Path, job_id: str, step: int, *, shard: int, shards: int, state: Any
) -> Saved:
    """Write ``state`` as shard ``shard`` of ``shards`` at ``step``; atomic and durable."""
    import torch

    started = time.perf_counter()
    directory = step_dir(root, job_id, step)
    directory.mkdir(parents=True, exist_ok=True)
    stem, token = _stem(shard, shards), uuid.uuid4().hex[:12]
    # The data goes straight to its own name (nothing names it until the manifest does), the
    # manifest through a temporary file whose rename commits the shard.
    data_name = f"{stem}.{token}.distcp"
    partial = directory / f".{stem}.{token}.tmp"
    target = directory / f"{stem}.pt"
    try:
        encoder = _Encoder(shard)
        encoder.encode(state)
        dcp = _dcp()
        writer = dcp.ShardWriter(directory, data_name)
        metadata = pickle.dumps(_save(dcp.ShardSavePlanner(encoder), writer), _PICKLE_PROTOCOL)
        header = _header(step, shard, shards, data_name, writer.fs.nbytes)
        hasher = writer.fs.hasher  # the data file's bytes, as written
        hasher.update(metadata)
        hasher.update(header.encode())
        digest = f"{ALGORITHM}:{hasher.hexdigest()}"
        buffer = io.BytesIO()
        torch.save({"header": header, "metadata": metadata, "digest": digest}, buffer)
        with open(partial, "wb") as out:
            out.write(buffer.getbuffer())
            out.flush()
            os.fsync(out.fileno())
        os.replace(partial, target)  # the commit: from here on the shard counts
        _fsync_dir(directory)
    except BaseException:
        partial.unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            (directory / data_name).unlink(missing_ok=True)
        raise
    # What a predecessor of this shard's write left here: data the manifest no longer names, or
    # the partial files of a writer that died.
    for stale in directory.glob(f"{stem}.*.distcp"):
        if stale.name != data_name:
            stale.unlink(missing_ok=True)
    for stale in directory.glob(f".{stem}.*.tmp"):
        stale.unlink(missing_ok=True)
    return Saved(step, shard, shards, str(target), writer.fs.nbytes + len(buffer.getbuffer()),
                 digest, time.perf_counter() - started)  # fmt: skip


# -- read -------------------------------------------------------------------------------------


def _manifests(root: str | Path, job_id: str, step: int) -> dict[int, dict[int, Path]]:
    """Committed shards at ``step``: world size -> shard -> manifest."""
    found: dict[int, dict[int, Path]] = {}
    for path in step_dir(root, job_id, step).glob("shard-*-of-*.pt"):
        shard, _, shards = path.stem.removeprefix("shard-").partition("-of-")
        with contextlib.suppress(ValueError):
            found.setdefault(int(shards), {})[int(shard)] = path
    return found


def _world_of(root: str | Path, job_id: str, step: int) -> tuple[int, dict[int, Path]]:
    """The world size that wrote ``step`` (a complete one first, then the newest), its shards."""
    found = _manifests(root, job_id, step)
    if not found:
        raise CheckpointError(f"no checkpoint of step {step} under {Path(root) / job_id}")

    def rank(item: tuple[int, dict[int, Path]]) -> tuple[bool, float]:
        shards, paths = item
        newest = max(p.stat().st_mtime for p in paths.values())
        return len(paths) == shards, newest

    return max(found.items(), key=rank)


def shards_at(root: str | Path, job_id: str, step: int) -> list[int]:
    """Every shard of the checkpoint at ``step`` (its world size when it was written)."""
    return list(range(_world_of(root, job_id, step)[0]))


def _verify(path: Path, step: int, shard: int) -> tuple[Metadata, int, str]:
    """The metadata of the shard whose manifest is ``path``, after checking its digest; with
    the shard's bytes on disk and its digest."""
    import torch

    try:
        body = torch.load(path, map_location="cpu", weights_only=True)
        text, metadata, digest = body["header"], body["metadata"], body["digest"]
        if not (isinstance(text, str) and isinstance(metadata, bytes) and isinstance(digest, str)):
            raise TypeError("not a manifest")
        header = json.loads(text)
        data = path.parent / str(header["data"])
        expected = int(header["nbytes"])
        claims = (header.get("format"), header.get("step"), header.get("shard"))
    except Exception as exc:
        raise CheckpointError(f"{path}: unreadable ({exc})") from exc
    if claims != (FORMAT, step, shard):
        raise CheckpointError(f"{path} is not shard {shard} of step {step} in format {FORMAT}")
    if data.parent != path.parent:
        raise CheckpointError(f"{path}: unreadable (a manifest naming {header['data']!r})")
    hasher = hashlib.sha256()
    try:
        with open(data, "rb") as stream:
            while chunk := stream.read(_READ_CHUNK):
                hasher.update(chunk)
                expected -= len(chunk)
    except OSError as exc:
        raise CheckpointError(f"{path}: its data {data.name} is unreadable ({exc})") from exc
    hasher.update(metadata)
    hasher.update(text.encode())
    actual = f"{ALGORITHM}:{hasher.hexdigest()}"
    if expected != 0 or actual != digest:
        raise CheckpointError(f"{path}: its data does not match its digest {digest} ({actual})")
    try:
        loaded = pickle.loads(metadata)
    except Exception as exc:
        raise CheckpointError(f"{path}: its metadata does not unpickle ({exc})") from exc
    if not isinstance(loaded, _dcp().Metadata):
        raise CheckpointError(f"{path}: its metadata is a {type(loaded).__qualname__}")
    return loaded, int(header["nbytes"]) + path.stat().st_size, digest


def read(root: str | Path, job_id: str, step: int, shard: int) -> Loaded:
    """Shard ``shard`` of the checkpoint at ``step``, verified against its digest."""
    try:
        path = _world_of(root, job_id, step)[1][shard]
    except (CheckpointError, KeyError):
        raise CheckpointError(
            f"no shard {shard} of the step {step} checkpoint under {Path(root) / job_id}"
        ) from None
    metadata, nbytes, digest = _verify(path, step, shard)
    dcp = _dcp()
    planner = dcp.ShardLoadPlanner()
    try:
        _load(planner, dcp.VerifiedReader(path.parent, metadata))
        import torch

        rest = io.BytesIO(planner.blobs[f"shard-{shard:05d}/{_REST}"])
        with torch.serialization.safe_globals([_Ref]):
            tree = torch.load(rest, map_location="cpu", weights_only=True)
        state = _decode(tree, planner.tensors, planner.blobs)
    except CheckpointError:
        raise
    except Exception as exc:
        raise CheckpointError(f"{path}: undecodable ({exc})") from exc
    return Loaded(path, nbytes, digest, state)


def step_reader(root: str | Path, job_id: str, step: int) -> FileSystemReader:
    """A DCP ``StorageReader`` over the whole checkpoint at ``step``, every shard verified:
    ``dcp.load`` through it, with DCP's planner, loads a model and optimizer that the shards'
    ``sharded.capture``\\ s hold into any world (e.g. under FSDP2 on another number of ranks)."""
    from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

    shards, paths = _world_of(root, job_id, step)
    missing = sorted(set(range(shards)) - set(paths))
    if missing:
        raise CheckpointError(f"the step {step} checkpoint lacks shards {missing} of {shards}")
    merged = Metadata(state_dict_metadata={}, storage_data={})
    for shard in range(shards):
        metadata = _verify(paths[shard], step, shard)[0]
        for fqn, md in metadata.state_dict_metadata.items():
            have = merged.state_dict_metadata.setdefault(fqn, md)
            if have is md or not isinstance(have, TensorStorageMetadata):
                continue
            assert isinstance(md, TensorStorageMetadata)
            known = {(tuple(c.offsets), tuple(c.sizes)) for c in have.chunks}
            have.chunks += [c for c in md.chunks if (tuple(c.offsets), tuple(c.sizes)) not in known]
        for index, info in metadata.storage_data.items():
            merged.storage_data.setdefault(index, info)
    reader: FileSystemReader = _dcp().VerifiedReader(step_dir(root, job_id, step), merged)
    return reader


# -- retention, the background writer ---------------------------------------------------------


def _step_of(path: Path) -> str:
    return path.parent.name


def prune(root: str | Path, job_id: str, shard: int, keep: int = KEEP) -> None:
    """Delete this shard's checkpoints older than its ``keep`` newest (and emptied steps)."""
    job = Path(root) / job_id
    if not job.is_dir():
        return
    mine = sorted(job.glob(f"step-*/shard-{shard:05d}-of-*.pt"), key=_step_of)
    kept = {_step_of(p) for p in mine[-keep:]} if keep > 0 else set()
    for directory in sorted(job.glob("step-*")):
        if directory.name in kept or (kept and directory.name > max(kept)):
            continue  # kept, or newer than every committed one (being written)
        for old in _files_of(directory, shard):
            old.unlink(missing_ok=True)
        with contextlib.suppress(OSError):  # only when no other shard is left in it
            directory.rmdir()


def _files_of(directory: Path, shard: int) -> Iterator[Path]:
    """The manifest first (uncommitting it), then the data and what a writer that died left."""
    stem = f"shard-{shard:05d}-of-"
    yield from directory.glob(f"{stem}*.pt")
    yield from directory.glob(f"{stem}*.distcp")
    yield from directory.glob(f".{stem}*.tmp")


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
        try:
            _dcp()  # DCP's imports take a while: not on the first checkpoint's time
        except Exception as exc:
            log.warning("cold checkpoints cannot be written: %s", exc)
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
