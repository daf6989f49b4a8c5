"""Back up and restore FSDP2 / tensor-parallel (DTensor) training state across worlds, in memory.

``capture`` records this rank's local shards of the model's and optimizer's state, as
``torch.distributed.checkpoint.state_dict`` presents them (``get_model_state_dict``,
``get_optimizer_state_dict``: sharded DTensors keyed by fully qualified name), with the global
layout of every shard: the flattened DCP key (``"model.<fqn>"``, ``"optim.state.<fqn>.exp_avg"``,
``"optim.param_groups.0.lr"``...), the global shape and dtype, and each local chunk's offsets and
sizes in the global tensor. The result is a plain tree (dicts, lists, ints, strs, plain CPU
tensors) that a :class:`~rank_runtime.snapshot.HotSnapshot` carries and ``from_bytes`` rebuilds::

    {"format": "sharded-dcp/1", "rank": 2, "world": 4, "stateless": [],
     "tensors": {"model.w": {"shape": [64, 32], "dtype": "float32", "chunks": [
                     {"offsets": [32, 0], "sizes": [16, 32], "data": <tensor>}]}, ...},
     "objects": {"optim.param_groups.0.lr": 0.001, ...}}

(``stateless``: the parameters the optimizer holds no state for yet, e.g. before its first step.)

``load`` sets a model and optimizer built on the current world's mesh (any world size, any
placement) from any set of captures. It runs DCP's own load path, ``dcp.load``, with the
default load planner (which computes, per target chunk, the overlaps with the saved chunks: the
resharding) over :class:`InMemoryReader`, a ``StorageReader`` whose "checkpoint" is the given
captures: ``read_metadata`` returns the union of their chunks as DCP ``Metadata``, and
``read_data`` copies each planned overlap from the captured chunk straight into the target
tensor. Nothing touches a disk. Then ``set_model_state_dict`` / ``set_optimizer_state_dict``
install the result.

``dcp.load`` runs with ``no_dist=True``: no collective at all (its ``_DistWrapper`` then turns
gather/scatter/barrier into local calls). That is correct for DTensor state in torch 2.13
because the default planner plans each rank's reads from its own DTensors' chunks alone
(``create_default_local_load_plan`` via ``__create_chunk_list__``, which reads the mesh
coordinate, not DCP's rank), its global step is the identity (``create_default_global_load_plan``),
and the metadata is the same on every rank by construction. So each rank only needs captures that
cover its own chunks: on a replace, only the shard the dead rank held (or a replica's, under
HSDP); on a shrink or grow, all of them (or any set that covers). The ``get_``/``set_`` state
dict calls issue no collective either for sharded (non-full) state dicts: under FSDP2 one rank
runs ``load`` and ``capture`` alone in the tests.

Three traps of that path, handled here:

- DCP wraps any error raised while planning or reading into a ``CheckpointException``, which is
  a ``BaseException``: ``load`` re-raises the original exception (our ``ValueError``).
- ``get_optimizer_state_dict`` initialises an empty optimizer state with a zero-lr step, but
  silently skips that when any parameter holds a gradient, and then a load would restore no
  optimizer state at all: ``load`` hides the gradients meanwhile, and ``capture`` of an
  optimizer that never stepped records no state (and leaves it unstepped: Adam's step count).
- An empty per-parameter entry (a ``defaultdict`` lookup creates one) counts as state for that
  check; ``capture`` drops such entries.

DCP's planner issues reads only where saved and requested chunks overlap and never checks that
a requested chunk is covered, so a missing shard would leave a tensor silently unloaded. The
planner here counts, per key, the elements its reads cover against the elements this rank
needs (saved chunks are deduplicated and checked pairwise disjoint first, so the count is
exact) and raises ``ValueError`` before anything is written.
"""

from __future__ import annotations

import io
import math
import warnings
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.storage import StorageReader
from torch.distributed.tensor import DTensor
from torch.futures import Future

__all__ = ["FORMAT", "InMemoryReader", "Memory", "capture", "is_sharded", "load"]

#: The ``format`` of a capture; ``load`` refuses any other.
FORMAT = "sharded-dcp/1"
_MODEL = "model"
_OPTIM = "optim"
#: Flattened keys of the optimizer's per-parameter state start with this.
_OPTIM_STATE = f"{_OPTIM}.state."
_DTYPES: dict[str, torch.dtype] = {
    str(value).removeprefix("torch."): value
    for value in vars(torch).values()
    if isinstance(value, torch.dtype)
}


def is_sharded(model: nn.Module) -> bool:
    """Whether any parameter of ``model`` is a DTensor (FSDP2 ``fully_shard``, tensor parallel)."""
    return any(isinstance(p, DTensor) for p in model.parameters())


# -- capture ----------------------------------------------------------------------------------


def _drop_empty_state(optimizer: torch.optim.Optimizer) -> None:
    """Remove empty per-parameter entries (a defaultdict lookup makes them; they mean "no state",
    but DCP's ``_init_optim_state`` takes any entry for an initialised optimizer)."""
    for param in [p for p, state in optimizer.state.items() if not state]:
        del optimizer.state[param]


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _plain(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s data as a contiguous CPU tensor, without a copy when it already is one."""
    data = tensor.detach()
    if data.device.type != "cpu":
        data = data.cpu()
    return data if data.is_contiguous() else data.contiguous()


#: What identifies one piece of memory seen through two names (a tied embedding and head).
_Alias = tuple[int, int, tuple[int, ...], tuple[int, ...], torch.dtype]


def _once(data: torch.Tensor, seen: dict[_Alias, torch.Tensor]) -> torch.Tensor:
    """``data``, or the tensor captured before over the same memory in the same layout: a
    parameter reached under two names (weight tying) is then one object, which a snapshot
    stores and sends once."""
    key = (data.untyped_storage().data_ptr(), int(data.storage_offset()), tuple(data.shape),
           tuple(data.stride()), data.dtype)  # fmt: skip
    return seen.setdefault(key, data)


def _chunks_of(
    fqn: str, value: torch.Tensor, seen: dict[_Alias, torch.Tensor]
) -> list[dict[str, Any]]:
    if isinstance(value, DTensor):
        if value.device_mesh.get_coordinate() is None:
            return []  # this rank is outside the DTensor's (sub)mesh: it holds none of it
        # Raises for Partial placements: a pending reduction is not state one can back up.
        metas = cast(list[ChunkStorageMetadata], value.__create_chunk_list__())  # type: ignore[no-untyped-call]
        if len(metas) == 1:
            locals_ = [value.to_local()]
        else:  # a local tensor subclass holding several chunks
            locals_ = [
                value.__get_tensor_shard__(MetadataIndex(fqn, m.offsets))  # type: ignore[no-untyped-call]
                for m in metas
            ]
        return [
            {"offsets": list(m.offsets), "sizes": list(m.sizes), "data": _once(_plain(t), seen)}
            for m, t in zip(metas, locals_, strict=True)
        ]
    return [
        {"offsets": [0] * value.dim(), "sizes": list(value.shape),
         "data": _once(_plain(value), seen)}
    ]  # fmt: skip


def capture(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """This rank's local shards of ``model``'s and ``optimizer``'s state with their global layout.

    No collective; the tensors are views of the live state where they can be (a snapshot copies
    them). An optimizer that has not stepped yet is recorded as such (its parameter groups
    only), and left without state as it was.
    """
    _drop_empty_state(optimizer)
    initialized = bool(optimizer.state)
    model_sd = get_model_state_dict(model)
    optim_sd = get_optimizer_state_dict(model, optimizer)
    if not initialized:
        # get_optimizer_state_dict initialises an empty state with a zero-gradient, zero-lr
        # step; keeping it would make the next real step Adam's second (bias correction).
        optimizer.state.clear()
        optim_sd = {k: v for k, v in optim_sd.items() if k != "state"}
    with_state = set(cast(dict[str, Any], optim_sd.get("state", {})))
    stateless = sorted(
        fqn
        for group in cast(list[dict[str, Any]], optim_sd["param_groups"])
        for fqn in group["params"]
        if fqn not in with_state
    )
    flat, _ = flatten_state_dict({_MODEL: model_sd, _OPTIM: optim_sd})
    tensors: dict[str, Any] = {}
    objects: dict[str, Any] = {}
    seen: dict[_Alias, torch.Tensor] = {}
    for fqn, value in flat.items():
        if isinstance(value, torch.Tensor):
            tensors[fqn] = {
                "shape": list(value.shape),
                "dtype": _dtype_name(value.dtype),
                "chunks": _chunks_of(fqn, value, seen),
            }
        else:
            objects[fqn] = value
    initialised_pg = dist.is_available() and dist.is_initialized()
    return {
        "format": FORMAT,
        "rank": dist.get_rank() if initialised_pg else 0,
        "world": dist.get_world_size() if initialised_pg else 1,
        "stateless": stateless,
        "tensors": tensors,
        "objects": objects,
    }


# -- the in-memory checkpoint -----------------------------------------------------------------


def _volume(sizes: Sequence[int]) -> int:
    return math.prod(sizes)


def _disjoint(a: ChunkStorageMetadata, b: ChunkStorageMetadata) -> bool:
    return any(
        oa >= ob + sb or ob >= oa + sa
        for oa, sa, ob, sb in zip(a.offsets, a.sizes, b.offsets, b.sizes, strict=True)
    )


class InMemoryReader(StorageReader):
    """A DCP ``StorageReader`` over captured shards held in memory.

    ``read_metadata`` presents every captured key as DCP checkpoint metadata: a tensor as
    ``TensorStorageMetadata`` (global shape, dtype, the union of the captured chunks, identical
    replicas deduplicated, empty chunks dropped), anything else as ``BytesStorageMetadata``.
    ``read_data`` serves the planner's ``ReadItem``\\ s: a tensor item copies the planned
    region of the captured chunk into the tensor the planner resolves, a bytes item hands the
    captured value to ``planner.load_bytes`` (``torch.save`` into a ``BytesIO``, as DCP's
    ``load_bytes`` expects).
    """

    def __init__(self, shards: Mapping[int, Mapping[str, Any]]) -> None:
        super().__init__()
        self.ranks = sorted(shards)
        tensors: dict[str, TensorStorageMetadata] = {}
        data: dict[str, list[torch.Tensor]] = {}
        objects: dict[str, Any] = {}
        for rank in self.ranks:
            shard = shards[rank]
            if not isinstance(shard, Mapping) or shard.get("format") != FORMAT:
                raise ValueError(f"the shard of rank {rank} is not a capture in format {FORMAT}")
            if shard.get("rank") != rank:
                raise ValueError(
                    f"the shard given as rank {rank}'s was captured by rank {shard.get('rank')}"
                )
            for fqn, entry in shard["tensors"].items():
                size = torch.Size(entry["shape"])
                dtype = _DTYPES.get(entry["dtype"])
                if dtype is None:
                    raise ValueError(f"{fqn}: unknown dtype {entry['dtype']!r}")
                md = tensors.get(fqn)
                if md is None:
                    md = tensors[fqn] = TensorStorageMetadata(
                        properties=TensorProperties(dtype=dtype), size=size, chunks=[]
                    )
                    data[fqn] = []
                elif md.size != size or md.properties.dtype != dtype:
                    raise ValueError(
                        f"{fqn}: the captures disagree on its layout ({list(md.size)} "
                        f"{_dtype_name(md.properties.dtype)} vs rank {rank}'s {list(size)} "
                        f"{_dtype_name(dtype)})"
                    )
                for chunk in entry["chunks"]:
                    self._add_chunk(fqn, rank, md, data[fqn], chunk)
            for fqn, value in shard["objects"].items():
                objects.setdefault(fqn, value)
        overlap = set(tensors) & set(objects)
        if overlap:
            raise ValueError(f"captured both as tensor and as object: {sorted(overlap)}")
        self._data = data
        self._objects = objects
        self._metadata = Metadata(
            state_dict_metadata={
                **tensors,
                **{fqn: BytesStorageMetadata() for fqn in objects},
            }
        )

    @staticmethod
    def _add_chunk(
        fqn: str,
        rank: int,
        md: TensorStorageMetadata,
        data: list[torch.Tensor],
        chunk: Mapping[str, Any],
    ) -> None:
        offsets, sizes = torch.Size(chunk["offsets"]), torch.Size(chunk["sizes"])
        tensor: torch.Tensor = chunk["data"]
        if (
            len(offsets) != len(md.size)
            or len(sizes) != len(md.size)
            or tuple(tensor.shape) != tuple(sizes)
            or any(o < 0 or o + s > n for o, s, n in zip(offsets, sizes, md.size, strict=True))
        ):
            raise ValueError(
                f"{fqn}: rank {rank}'s chunk at {list(offsets)} of size {list(sizes)} "
                f"(data {list(tensor.shape)}) does not fit the tensor {list(md.size)}"
            )
        if _volume(sizes) == 0:
            return
        new = ChunkStorageMetadata(offsets=offsets, sizes=sizes)
        for old in md.chunks:
            if old.offsets == offsets and old.sizes == sizes:
                return  # a replica (e.g. across a tensor-parallel or replicate dimension)
            if not _disjoint(old, new):
                raise ValueError(
                    f"{fqn}: rank {rank}'s chunk at {list(offsets)} of size {list(sizes)} "
                    f"partly overlaps another capture's chunk at {list(old.offsets)} of size "
                    f"{list(old.sizes)}: the captures are not of one layout"
                )
        md.chunks.append(new)
        data.append(tensor)

    # StorageReader ----------------------------------------------------------------------------

    def reset(self, checkpoint_id: Any = None) -> None:
        """Nothing to reset: the checkpoint is the captures given to the constructor."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """The captured keys as a DCP checkpoint's metadata."""
        return self._metadata

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        """Check that DCP plans against this reader's own metadata."""
        if metadata is not self._metadata:
            raise ValueError("InMemoryReader set up with metadata it did not produce")

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        """No storage-side planning: every chunk is already in memory."""
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        """No storage-side planning: every chunk is already in memory."""
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Copy each planned region from its captured chunk into the planner's target tensor."""
        for item in plan.items:
            if item.type == LoadItemType.BYTE_IO:
                buffer = io.BytesIO()
                torch.save(self._objects[item.storage_index.fqn], buffer)
                buffer.seek(0)
                planner.load_bytes(item, buffer)
                continue
            source = self._source(item)
            target = planner.resolve_tensor(item).detach()
            if target.shape != source.shape:
                raise ValueError(
                    f"{item.dest_index.fqn}: planned a read of {list(source.shape)} "
                    f"into {list(target.shape)}"
                )
            target.copy_(source)
            planner.commit_tensor(item, target)
        future: Future[None] = Future()
        future.set_result(None)
        return future

    def _source(self, item: ReadItem) -> torch.Tensor:
        index = item.storage_index
        md = self._metadata.state_dict_metadata[index.fqn]
        assert isinstance(md, TensorStorageMetadata)
        i = index.index
        if i is None or not 0 <= i < len(md.chunks) or md.chunks[i].offsets != index.offset:
            i = next(j for j, c in enumerate(md.chunks) if c.offsets == index.offset)
        source = self._data[index.fqn][i]
        for dim, (start, length) in enumerate(zip(item.storage_offsets, item.lengths, strict=True)):
            source = source.narrow(dim, start, length)
        return source

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        """Never chosen by a checkpoint id: it is only ever passed explicitly."""
        return False


class _CoveringPlanner(DefaultLoadPlanner):
    """DCP's default load planner, refusing a plan that would leave part of a tensor unread."""

    def __init__(self, ranks: Iterable[int]) -> None:
        super().__init__()
        self.ranks = list(ranks)

    def create_local_plan(self) -> LoadPlan:
        metadata = self.metadata
        assert metadata is not None
        stored = metadata.state_dict_metadata
        missing = sorted(fqn for fqn in self.state_dict if fqn not in stored)
        if missing:
            raise ValueError(
                f"the captures (of old ranks {self.ranks}) lack {len(missing)} key(s) the new "
                f"model and optimizer hold: {', '.join(missing[:8])}"
                + (", ..." if len(missing) > 8 else "")
            )
        plan = super().create_local_plan()
        read: dict[str, int] = {}
        for item in plan.items:
            if item.type != LoadItemType.BYTE_IO:
                fqn = item.dest_index.fqn
                read[fqn] = read.get(fqn, 0) + _volume(item.lengths)
        short: list[str] = []
        for fqn, obj in self.state_dict.items():
            md = stored[fqn]
            if not isinstance(md, TensorStorageMetadata):
                if isinstance(obj, torch.Tensor):
                    raise ValueError(f"{fqn}: the captures hold a non-tensor, the target a tensor")
                continue
            if not isinstance(obj, torch.Tensor):
                raise ValueError(f"{fqn}: the captures hold a tensor, the target does not")
            if isinstance(obj, DTensor):
                if obj.device_mesh.get_coordinate() is None:
                    continue
                chunks = cast(list[ChunkStorageMetadata], obj.__create_chunk_list__())  # type: ignore[no-untyped-call]
            else:
                chunks = [ChunkStorageMetadata(torch.Size([0] * obj.dim()), obj.shape)]
            needed = sum(_volume(c.sizes) for c in chunks)
            if read.get(fqn, 0) != needed:
                where = "; ".join(f"at {list(c.offsets)} size {list(c.sizes)}" for c in chunks)
                short.append(
                    f"{fqn} (needs {needed} elements {where}, the captures cover "
                    f"{read.get(fqn, 0)})"
                )
        if short:
            raise ValueError(
                f"the captures of old ranks {self.ranks} do not cover what this rank needs: "
                + ", ".join(short[:8])
                + (f", and {len(short) - 8} more" if len(short) > 8 else "")
            )
        return plan


# -- load -------------------------------------------------------------------------------------


def _local_view(value: torch.Tensor) -> tuple[torch.Tensor, list[tuple[list[int], list[int]]]]:
    """The local tensor of ``value`` and its chunks in the global tensor (offsets, sizes)."""
    if isinstance(value, DTensor):
        if value.device_mesh.get_coordinate() is None:
            return value.to_local(), []
        metas = cast(list[ChunkStorageMetadata], value.__create_chunk_list__())  # type: ignore[no-untyped-call]
        return value.to_local(), [(list(m.offsets), list(m.sizes)) for m in metas]
    return value, [([0] * value.dim(), list(value.shape))]


def _fits(entry: Mapping[str, Any], value: torch.Tensor) -> torch.Tensor | None:
    """The captured chunk of ``entry`` when it is exactly ``value``'s local chunk (same global
    shape, dtype, offsets and sizes); None otherwise."""
    local, chunks = _local_view(value)
    if (
        list(entry["shape"]) != list(value.shape)
        or entry["dtype"] != _dtype_name(value.dtype)
        or len(chunks) != 1
        or len(entry["chunks"]) != 1
    ):
        return None
    (chunk,) = entry["chunks"]
    data = chunk["data"]
    if (list(chunk["offsets"]), list(chunk["sizes"])) != chunks[0] or tuple(data.shape) != tuple(
        local.shape
    ):
        return None
    return cast(torch.Tensor, data)


class Memory:
    """Memory a load may make the optimizer state it creates of, in place of fresh
    allocations: tensors that nothing else uses any more (the local shards of a previous
    generation's model and optimizer, dropped with its group), by shape, stride, dtype and
    device. Memory a process has written before costs no page faults when it is written
    again; fresh memory does, on every page (a third of a load's time, measured here).
    """

    def __init__(self, tensors: Iterable[torch.Tensor] = ()) -> None:
        self._free: dict[tuple[Any, ...], list[torch.Tensor]] = {}
        #: Bytes handed out by ``take``.
        self.taken = 0
        seen: set[int] = set()
        for tensor in tensors:
            storage = tensor.untyped_storage()
            whole = (
                tensor.storage_offset() == 0
                and tensor.is_contiguous()
                and storage.nbytes() == tensor.numel() * tensor.element_size()
            )
            if not whole or tensor.numel() == 0 or storage.data_ptr() in seen:
                continue  # a view into more (or shared) memory is not free to take
            seen.add(storage.data_ptr())
            self._free.setdefault(self._key(tensor), []).append(tensor.detach())

    @staticmethod
    def _key(tensor: torch.Tensor) -> tuple[Any, ...]:
        return (tuple(tensor.shape), tuple(tensor.stride()), tensor.dtype, tensor.device)

    @classmethod
    def of(
        cls, model: nn.Module, optimizer: torch.optim.Optimizer, min_bytes: int = 1 << 20
    ) -> Memory:
        """The local tensors of ``model``'s parameters and ``optimizer``'s state (those of
        ``min_bytes`` or more), to be reused once both are dropped."""
        tensors: list[torch.Tensor] = []
        values = [*model.parameters()] + [
            value for state in optimizer.state.values() for value in state.values()
        ]
        with torch.no_grad():
            for value in values:
                if not isinstance(value, torch.Tensor):
                    continue
                local = value.to_local() if isinstance(value, DTensor) else value
                if local.numel() * local.element_size() >= min_bytes:
                    tensors.append(local.detach())
        return cls(tensors)

    @property
    def nbytes(self) -> int:
        """Bytes still free to take."""
        return sum(t.numel() * t.element_size() for ts in self._free.values() for t in ts)

    def take(self, like: torch.Tensor) -> torch.Tensor | None:
        """Free memory laid out as ``like`` (a plain tensor), or None."""
        free = self._free.get(self._key(like))
        if not free:
            return None
        tensor = free.pop()
        self.taken += tensor.numel() * tensor.element_size()
        return tensor


def _adoptable(data: torch.Tensor, local: torch.Tensor) -> bool:
    """Whether ``data`` can serve as ``local`` itself (same layout, dtype and device)."""
    return (
        data.dtype == local.dtype
        and data.device == local.device
        and tuple(data.shape) == tuple(local.shape)
        and tuple(data.stride()) == tuple(local.stride())
        and not data.requires_grad
    )


def _state_like(param: torch.Tensor, local: torch.Tensor | None) -> torch.Tensor:
    """An optimizer state tensor laid out as ``param`` (a DTensor of its spec when it is one)
    over ``local``'s memory; fresh memory when ``local`` is None."""
    if local is None:
        return torch.empty_like(param)
    if isinstance(param, DTensor):
        return DTensor.from_local(
            local, param.device_mesh, param.placements, run_check=False, shape=param.shape,
            stride=param.stride(),
        )  # fmt: skip
    return local


def _load_same_layout(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    capture: Mapping[str, Any],
    *,
    adopt: bool = False,
    memory: Memory | None = None,
) -> bool:
    """Load one capture taken in this rank's own layout (a replacement, or a survivor of one)
    by copying each captured chunk into the tensor it came from: no resharding plan, no
    optimizer initialisation. False, having written nothing, when anything differs (a key, a
    shape, a chunk, the parameter order of the optimizer): ``load``'s general path then runs.

    The optimizer state it creates is made of the captured tensors themselves with ``adopt``
    (they are the caller's to give away: no copy), else of ``memory`` where it has a tensor of
    the layout, else fresh memory. Parameters are always copied into.
    """
    if capture.get("format") != FORMAT:
        return False
    tensors: Mapping[str, Any] = capture["tensors"]
    objects: Mapping[str, Any] = capture["objects"]
    copies: list[tuple[torch.Tensor, torch.Tensor]] = []
    model_sd = get_model_state_dict(model)
    model_keys = {f"{_MODEL}.{fqn}" for fqn in model_sd}
    if {k for k in tensors if k.startswith(f"{_MODEL}.")} != model_keys or any(
        k.startswith(f"{_MODEL}.") for k in objects
    ):
        return False
    for fqn, value in model_sd.items():
        if not isinstance(value, torch.Tensor):
            return False
        data = _fits(tensors[f"{_MODEL}.{fqn}"], value)
        if data is None:
            return False
        copies.append((_local_view(value)[0], data))
    names = {id(p): fqn for fqn, p in model.named_parameters()}
    stateless = set(capture.get("stateless", ()))
    groups: list[dict[str, Any]] = []
    states: list[tuple[torch.Tensor, dict[str, Any]]] = []
    used = set(model_keys)
    adopted: set[int] = set()
    for i, group in enumerate(optimizer.param_groups):
        prefix = f"{_OPTIM}.param_groups.{i}."
        fqns = [names.get(id(p), "") for p in group["params"]]
        if objects.get(f"{prefix}params") != fqns:
            return False
        settings: dict[str, Any] = {}
        for key, current in group.items():
            if key == "params":
                continue
            if f"{prefix}{key}" not in objects:
                return False
            saved = objects[f"{prefix}{key}"]
            settings[key] = tuple(saved) if isinstance(current, tuple) else saved
        used.update(f"{prefix}{key}" for key in group)
        groups.append(settings)
        for param, fqn in zip(group["params"], fqns, strict=True):
            mine = f"{_OPTIM_STATE}{fqn}."
            keys = [k for k in tensors if k.startswith(mine)] + [
                k for k in objects if k.startswith(mine)
            ]
            if not keys:
                if fqn not in stateless:
                    return False
                continue
            entry: dict[str, Any] = {}
            for key in keys:
                name = key[len(mine) :]
                if "." in name:  # nested per-parameter state: the general path handles it
                    return False
                if key in objects:
                    entry[name] = objects[key]
                    continue
                spec = tensors[key]
                like = param if list(spec["shape"]) == list(param.shape) else None
                if like is not None and spec["dtype"] == _dtype_name(param.dtype):
                    data = _fits(spec, param)  # the state is laid out as the parameter
                    if data is None:
                        return False
                    local = _local_view(param)[0]
                    if adopt and id(data) not in adopted and _adoptable(data, local):
                        adopted.add(id(data))
                        entry[name] = _state_like(param, data)
                        continue
                    target = _state_like(param, memory.take(local) if memory else None)
                else:
                    dtype = _DTYPES.get(spec["dtype"])
                    if dtype is None or len(spec["chunks"]) != 1:
                        return False
                    target = torch.empty(spec["shape"], dtype=dtype, device=param.device)
                data = _fits(spec, target)
                if data is None:
                    return False
                copies.append((_local_view(target)[0], data))
                entry[name] = target
            used.update(keys)
            states.append((param, entry))
    if used != set(tensors) | set(objects):
        return False  # the capture holds state this optimizer has no place for
    with torch.no_grad():
        for target, data in copies:
            target.copy_(data)
    optimizer.state.clear()
    for param, entry in states:
        optimizer.state[param] = entry
    for group, settings in zip(optimizer.param_groups, groups, strict=True):
        group.update(settings)
    return True


def load(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    shards: Mapping[int, dict[str, Any]],
    *,
    adopt: bool = False,
    memory: Memory | None = None,
) -> str:
    """Set ``model`` and ``optimizer`` (built on the current mesh) from captured ``shards``.

    ``shards`` maps old ranks to what ``capture`` returned there; they must cover every chunk
    this rank holds (its own old shard on a replace, all of them on a shrink or grow). No
    collective is issued, so ranks may call it independently. Raises ``ValueError`` (before
    writing anything) when a key or a region is missing.

    One capture in this rank's own layout (a replace) is copied chunk by chunk into the live
    tensors (``"same-layout"``); anything else goes through DCP's planner (``"resharded"``).
    Returns which. On the first path, ``adopt`` (the capture's tensors are the caller's to
    give away, not views of memory anything else uses) makes the optimizer state of the
    captured tensors themselves, and ``memory`` lends its tensors to what is not adopted
    (``_load_same_layout``).
    """
    if not shards:
        raise ValueError("no shards to load from")
    if len(shards) == 1:
        (capture,) = shards.values()
        if _load_same_layout(model, optimizer, capture, adopt=adopt, memory=memory):
            return "same-layout"
    reader = InMemoryReader(shards)
    stored = reader.read_metadata().state_dict_metadata
    # A fresh optimizer's state is replaced wholesale; clearing it lets get_optimizer_state_dict
    # initialise every parameter's state (a zero-lr step), which DCP then overwrites in place.
    optimizer.state.clear()
    model_sd = get_model_state_dict(model)
    # That initialisation is skipped when any parameter has a gradient, and then nothing of the
    # captured optimizer state would be loaded: hide the gradients meanwhile.
    grads = {p: p.grad for group in optimizer.param_groups for p in group["params"]}
    try:
        for param in grads:
            param.grad = None
        optim_sd = get_optimizer_state_dict(model, optimizer)
    finally:
        for param, grad in grads.items():
            param.grad = grad
    saved_groups = cast(list[dict[str, Any]], optim_sd["param_groups"])
    own_names = [list(group["params"]) for group in saved_groups]
    param_of = {
        fqn: param
        for saved, group in zip(saved_groups, optimizer.param_groups, strict=True)
        for fqn, param in zip(cast(list[str], saved["params"]), group["params"], strict=True)
    }
    state = cast(dict[str, dict[str, Any]], optim_sd.get("state", {}))
    # Parameters that had no optimizer state when captured (not stepped yet) get none here
    # either; any other parameter whose state is missing is left to the planner to refuse.
    captured_stateless = {fqn for shard in shards.values() for fqn in shard.get("stateless", ())}
    stateless = [
        fqn
        for fqn, entry in state.items()
        if fqn in captured_stateless
        and not any(f"{_OPTIM_STATE}{fqn}.{key}" in stored for key in entry)
    ]
    target: dict[str, Any] = {
        _MODEL: model_sd,
        _OPTIM: {**optim_sd, "state": {f: v for f, v in state.items() if f not in stateless}},
    }
    try:
        with warnings.catch_warnings():
            # no_dist=True is the point (no collective); DCP warns that it "assumes" it.
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp_load(
                target,
                storage_reader=reader,
                planner=_CoveringPlanner(reader.ranks),
                no_dist=True,
            )
    except CheckpointException as exc:
        # DCP wraps whatever a step raised into a CheckpointException, a BaseException that an
        # ``except Exception`` misses; with no_dist there is one failure, this rank's own.
        failures = list(exc.failures.values())
        if len(failures) == 1:
            raise failures[0][0] from None
        raise RuntimeError(f"loading the captured shards failed: {exc}") from None
    # A group's parameter names are this model's structure, not state: the captures' may be
    # another part's (a pipeline stage's), and the reader keeps the lowest rank's value.
    loaded_groups = cast(list[dict[str, Any]], optim_sd["param_groups"])
    for group, names in zip(loaded_groups, own_names, strict=True):
        group["params"] = names
    # DCP loaded model_sd and optim_sd's tensors and param_groups values in place.
    set_model_state_dict(model, model_sd)
    set_optimizer_state_dict(model, optimizer, optim_sd)
    for fqn in stateless:
        optimizer.state.pop(param_of[fqn], None)
    return "resharded"
