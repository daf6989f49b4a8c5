"""The loop integration: a training loop made elastic by a handful of lines.

::

    session = Session(build, state={"sampler": sampler})  # build(world) -> (model, optimizer)
    for step in session.steps(total_steps):                # from the restored step on
        with session.step():                               # a lost peer: recover, go on
            loss, samples = train_step(session.model, session.optimizer, step)
            session.report(loss=loss, samples=samples)
    session.finish()

The step's tensors, the model and the optimizer hold the generation's process group: keep them
in ``train_step``'s frame, not in the loop's, so that a recovery drops them with the broken
group (a survivor a collective still waits on then closes its connections at once instead of
at the collective timeout). After a recovery, the memory of the dropped generation's FSDP2
shards and optimizer state is reused for the restored optimizer state (memory written before
costs no page faults): a tensor of the old model kept past the recovery does not keep its
values.

``build(world)`` wraps the model on the current generation's process group (DDP, FSDP2's
``fully_shard``, tensor parallelism over ``session.mesh(...)``) and creates the optimizer; it is
called at the start and again after every recovery, and must make a fresh model from the
job's seed each time (what it returns is then restored from the backup; a newcomer's state
fetched from a peer arrives while ``build`` runs). When the generation
restores its state right after ``build`` (``session.restoring``), ``build`` may skip the random
initialisation: make the model on the meta device and allocate it (``to_empty``), since the
restore writes every parameter, persistent buffer and optimizer state. The session reads and
restores the state by what it is given:

- a model whose parameters are DTensors (FSDP2, TP, both): each rank's local shards with their
  global layout (``rank_runtime.sharded``), resharded in memory when the world changed;
- a ``ZeroRedundancyOptimizer``: this rank's optimizer shard (``rank_runtime.zero``); the
  model is the same on every rank;
- any other optimizer over a replicated (DDP) model: model and optimizer alike everywhere.

``state`` registers more of what a rank must resume with: objects with ``state_dict`` and
``load_state_dict`` (a sampler, a data loader's position, a scheduler kept outside ``build``),
or ``(get, set)`` pairs of callables.

What only this rank has (shards, its random number generators, the ``state`` objects) is backed
up to peers every ``backup_interval`` steps; what every rank has alike is kept in this process
only, and after a recovery a survivor hands it to the newcomer over the new group.

Only an error that means the group or a peer is gone starts a recovery (``is_peer_failure``):
torch.distributed's ``DistError`` family, gloo's and NCCL's transport errors and timeouts, and
the runtime's own ``GenerationSuperseded``. Any other exception (a shape error, an out-of-memory,
a ``ValueError`` of the loop) leaves the ``with`` block as it would without the session.

A step whose reported loss (or ``grad_norm``, when the loop gives it) is NaN or infinite is a
loss anomaly: the rank reports it (``train.anomaly``), is not backed up at that step, and
waits for the control plane, which rolls the job back to an older backup (every rank restores
in process, as after a fault) and may skip the batches of the anomaly: ``steps`` then never
yields those steps (``Reallocate.skip``; ``Session(skip=...)`` adds steps of the loop's own,
e.g. a fault-free run that skips the same batches).

The low-level ``Elastic`` calls (``start``, ``step_done``, ``recover``, ``finish``) stay
available for loops that need another shape.
"""

from __future__ import annotations

import gc
import io
import logging
import math
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from types import TracebackType
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from rank_runtime import sharded, trace
from rank_runtime.elastic import Elastic, GenerationSuperseded, LossAnomaly, World
from schemas.common import RestoreFrom

log = logging.getLogger(__name__)

__all__ = ["Parts", "Session", "is_peer_failure", "unique_state"]


class Stateful(Protocol):
    def state_dict(self) -> Any: ...

    def load_state_dict(self, state: Any, /) -> Any: ...


#: Marks of an error raised because the group or a peer is gone, in the messages of gloo's and
#: NCCL's transports and of torch.distributed's stores (they raise a plain RuntimeError).
_PEER_MARKS = (
    "gloo/transport",
    "Connection closed by peer",
    "Connection reset by peer",
    "Connection refused",
    "Broken pipe",
    "Timed out waiting",
    "Socket Timeout",
    "NCCL error",
    "NCCL communicator",
    "ProcessGroupNCCL",
    "ProcessGroupGloo",
    "has been aborted",
    "Watchdog caught collective operation timeout",
)


def is_peer_failure(error: BaseException) -> bool:
    """Whether ``error`` (or an error it was raised from) means a peer or the group is gone,
    so that the control plane, not the loop, decides what follows."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, GenerationSuperseded | LossAnomaly | dist.DistError):
            return True
        if isinstance(current, RuntimeError) and any(m in str(current) for m in _PEER_MARKS):
            return True
        current = current.__cause__ or current.__context__
    return False


def _module(model: nn.Module) -> nn.Module:
    """The module under a DDP wrapper (DDP keeps its parameters in ``.module``)."""
    inner = getattr(model, "module", None)
    return inner if isinstance(inner, nn.Module) else model


def _cloned(state: Any) -> Any:
    """``state`` with each tensor in it cloned (restored state that may be views of a backup,
    handed to code that may keep or write into it)."""
    if isinstance(state, torch.Tensor):
        return state.clone()
    if isinstance(state, dict):
        return type(state)((key, _cloned(value)) for key, value in state.items())
    if isinstance(state, list | tuple) and not hasattr(state, "_fields"):
        return type(state)(_cloned(value) for value in state)
    return state


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: Mapping[str, Any]) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


class _Parts:
    """What ``build`` returned, and how its state is read and restored."""

    def __init__(self, model: nn.Module, optimizer: Optimizer) -> None:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        self.model = model
        self.optimizer = optimizer
        self.module = _module(model)
        self.kind = (
            "sharded"
            if sharded.is_sharded(self.module)
            else "zero"
            if isinstance(optimizer, ZeroRedundancyOptimizer)
            else "replicated"
        )
        group = getattr(model, "process_group", None)  # DDP's (None: not DDP)
        if (
            self.kind == "replicated"
            and group is not None
            and dist.get_world_size(group) != dist.get_world_size()
        ):
            # DDP over a sub-group (a pipeline stage's data-parallel group): alike only
            # within that group, so the world cannot share it: each rank backs it up whole.
            self.kind = "local"
        #: When the step's last gradient was ready on this rank (``time.perf_counter``;
        #: None: no backward this step, or not measured).
        self.grads_ready: float | None = None
        #: Gradients accumulated this step, of how many; ``on_ready`` is called when all are
        #: (with ``grads_ready``): a stalled step's evidence (``EventClient.gradients_ready``).
        self.accumulated = 0
        self.gradients = 0
        self.on_ready: Callable[[], None] | None = None
        if self.kind in ("replicated", "zero"):
            self._time_gradients()

    def _time_gradients(self) -> None:
        """Note when each parameter's gradient is accumulated: the last one marks the end
        of this rank's forward and backward compute. DDP's all-reduce of the gradients runs
        beside the backward (gloo and NCCL work asynchronously) and is waited for only
        after it, so the time from the step's start to that mark is the rank's own compute,
        apart from the wait for slower peers. (FSDP2's and a pipeline's backwards block on
        peers inside it, so they are not timed: no compute time is reported for them.)"""

        def ready(_: torch.Tensor) -> None:
            self.grads_ready = time.perf_counter()
            self.accumulated += 1
            if self.accumulated == self.gradients and self.on_ready is not None:
                self.on_ready()

        for parameter in self.module.parameters():
            if parameter.requires_grad:
                parameter.register_post_accumulate_grad_hook(ready)  # type: ignore[no-untyped-call]
                self.gradients += 1

    def unique(self) -> dict[str, Any]:
        """What only this rank has of the model and optimizer."""
        if self.kind == "sharded":
            return {"sharded": sharded.capture(self.module, self.optimizer)}
        if self.kind == "zero":
            from rank_runtime.zero import shard_state

            return {"zero": shard_state(self.optimizer)}  # type: ignore[arg-type]
        if self.kind == "local":
            return {"model": self.module.state_dict(), "optimizer": self.optimizer.state_dict()}
        return {}

    def stepped(self) -> Callable[[torch.Tensor], bool]:
        """Whether a tensor of a backup is memory only the optimizer's step writes (its
        parameters' and its state's): a backup copies those on a thread while the next
        step's forward and backward run, and the optimizer's step waits for the copy
        (``Session`` hooks it); anything else (buffers a forward updates, registered state)
        is copied at once."""
        owned: set[int] = set()
        optimizers = [self.optimizer, getattr(self.optimizer, "optim", None)]  # ZeRO's local
        for optimizer in optimizers:
            if not isinstance(optimizer, Optimizer):
                continue
            values: list[Any] = [p for group in optimizer.param_groups for p in group["params"]]
            values += [
                v for state in optimizer.state.values() if isinstance(state, Mapping)
                for v in state.values()
            ]  # fmt: skip
            for value in values:
                local = value.to_local() if isinstance(value, DTensor) else value
                if isinstance(local, torch.Tensor) and not local.is_cuda:
                    owned.add(local.untyped_storage().data_ptr())
        return lambda tensor: tensor.untyped_storage().data_ptr() in owned

    def replicated(self) -> dict[str, Any] | None:
        """What every rank of the group has alike (None: nothing)."""
        if self.kind in ("sharded", "local"):
            return None
        state: dict[str, Any] = {"model": self.module.state_dict()}
        if self.kind == "replicated":
            state["optimizer"] = self.optimizer.state_dict()
        return state

    def load(
        self,
        shards: Mapping[int, Any],
        replicated: Any,
        own: int | None = None,
        *,
        adopt: bool = False,
        memory: sharded.Memory | None = None,
    ) -> None:
        """Set the parts from the restored ``shards`` (and ``replicated``). For FSDP2 state,
        ``adopt``: the shards' tensors are this load's to keep (none is a view of a backup);
        ``memory``: a previous generation's tensors to make new state of
        (``sharded.load``)."""
        if self.kind == "sharded":
            captures = {r: s["sharded"] for r, s in shards.items()}
            sharded.load(self.module, self.optimizer, captures, adopt=adopt, memory=memory)
            return
        if self.kind == "local":
            if own is None or own not in shards or len(shards) != 1:
                raise RuntimeError(
                    "DDP over a sub-group restores only a replacement (each rank its own "
                    "shard); to re-partition after a shrink, shard with FSDP2 (DTensor)"
                )
            self.module.load_state_dict(shards[own]["model"])
            self.optimizer.load_state_dict(shards[own]["optimizer"])
            return
        if replicated is None:
            raise RuntimeError("no member of the group holds the replicated state to restore")
        self.module.load_state_dict(replicated["model"])
        if self.kind == "zero":
            from rank_runtime.zero import consolidate

            zero = [s["zero"] for s in shards.values()]
            self.optimizer.load_state_dict(consolidate(zero, self.optimizer))  # type: ignore[arg-type]
        else:
            self.optimizer.load_state_dict(replicated["optimizer"])


#: What ``build`` returned, read as a ``Session`` reads it (``unique()``, ``replicated()``):
#: public for tools that measure a backup without running a job (``elasticctl bench backup``).
Parts = _Parts


def unique_state(
    parts: _Parts,
    state: Mapping[str, Stateful | tuple[Callable[[], Any], Callable[[Any], Any]]],
) -> dict[str, Any]:
    """What a ``Session`` backs up to peers for this rank: ``parts.unique()``, the state of
    each ``state`` object (as ``Session(state=...)`` takes them), and this process's random
    number generators."""
    unique = parts.unique()
    unique["state"] = {
        name: item[0]() if isinstance(item, tuple) else item.state_dict()
        for name, item in state.items()
    }
    unique["rng"] = _rng_state()
    return unique


class Session:
    """One member's elastic training loop (see the module's docstring)."""

    def __init__(
        self,
        build: Callable[[World], tuple[nn.Module, Optimizer]],
        *,
        state: Mapping[str, Stateful | tuple[Callable[[], Any], Callable[[Any], Any]]]
        | None = None,
        elastic: Elastic | None = None,
        skip: Iterable[int] = (),
    ) -> None:
        self.elastic = elastic if elastic is not None else Elastic()
        #: Steps this loop never runs, besides those the job's rollbacks skip.
        self._skip = frozenset(skip)
        # An injected ``nan@STEP`` or ``spike@STEP`` spoils the model as a bad update would.
        self.elastic.poison = self._poison
        # The state a newcomer fetches arrives while ``build`` runs (``_enter_generation``).
        self.elastic.defer_restore = True
        self._build = build
        #: name -> (get, set): an object's ``state_dict``/``load_state_dict``, or a pair.
        self._state = {
            name: item if isinstance(item, tuple) else (item.state_dict, item.load_state_dict)
            for name, item in (state or {}).items()
        }
        self._parts: _Parts | None = None
        self._next = 1
        self._step: int | None = None
        self._report: tuple[float, int, float | None] | None = None
        self._last_loss: float | None = None
        self._running = False
        #: The generation whose first step is still to finish (timed: ``rank_runtime.trace``).
        self._first: int | None = None
        #: The dropped generation's FSDP2 tensors, for the next load to reuse (``_recover``).
        self._memory: sharded.Memory | None = None

    # ------------------------------------------------------------------ the world

    @property
    def world(self) -> World:
        """The current generation (rank, size, members)."""
        world = self.elastic.world
        if world is None:
            raise RuntimeError("the session has no world yet: iterate over steps() first")
        return world

    @property
    def restoring(self) -> bool:
        """Whether the current generation's state is restored from a backup (in memory or a
        cold checkpoint) right after ``build``: ``build`` may then leave the model
        uninitialised (the meta device and ``to_empty``), as every parameter, persistent
        buffer and optimizer state is overwritten. False at a fresh start."""
        return self.elastic.restored_from in (RestoreFrom.MEMORY, RestoreFrom.CHECKPOINT)

    @property
    def device(self) -> torch.device:
        """This member's device (the GPU of its LOCAL_RANK, or the CPU)."""
        device: torch.device = self.elastic.device
        return device

    def mesh(
        self, shape: tuple[int, ...] | None = None, names: tuple[str, ...] | None = None
    ) -> Any:
        """A device mesh over the current generation's ranks (for ``fully_shard`` and
        ``parallelize_module`` in ``build``); its product must be the world's size. Without
        ``shape`` and ``names``: the generation's mesh as the control plane decided it (the
        job's ``JobPolicy.mesh``, with fewer replicas after a shrink)."""
        from torch.distributed.device_mesh import init_device_mesh

        if shape is None or names is None:
            decided = self.world.mesh
            if decided is None:
                raise ValueError("the job's policy declares no mesh: pass shape and names")
            shape, names = tuple(decided.values()), tuple(decided)
        return init_device_mesh(self.device.type, shape, mesh_dim_names=names)

    # ------------------------------------------------------------------ the loop

    def steps(self, total: int) -> Iterator[int]:
        """The steps to run, from the one after the restored step to ``total``. Joins the job
        first (a spare waits here until it takes a rank; nothing is yielded to a spare the
        job never needed), and builds the parts of each generation before its first step."""
        if not self._running:
            if self.elastic.start() is None:
                return
            self._running = True
            self._next = self.elastic.resume_step + 1
        while self._next <= total:
            if self.elastic.world is None:  # demoted to a spare, and the job ended
                return
            if self._parts is None:
                try:
                    self._enter_generation()
                except Exception as exc:
                    if not is_peer_failure(exc):
                        raise
                    self._recover(exc, self._next)
                    continue
            if self.skips(self._next):
                self._next += 1
                continue
            self._step = self._next
            yield self._next

    @property
    def model(self) -> Any:
        """The model ``build`` returned for the current generation."""
        return self._current().model

    @property
    def optimizer(self) -> Any:
        """The optimizer ``build`` returned for the current generation."""
        return self._current().optimizer

    def _current(self) -> _Parts:
        if self._parts is None:
            raise RuntimeError("no parts built: use them inside `for step in session.steps(n)`")
        return self._parts

    def step(self) -> _StepGuard:
        """The guard of the current step: ``with session.step():``. It yields the model and
        the optimizer too, but names bound in the loop's own frame outlive a recovery and keep
        the old group's objects alive: prefer ``session.model`` inside ``train_step``."""
        if self._parts is None or self._step is None:
            raise RuntimeError("session.step() belongs inside `for step in session.steps(n)`")
        return _StepGuard(self)

    def skips(self, step: int) -> bool:
        """Whether ``steps`` leaves ``step`` out (a rollback skipped its batch, or
        ``Session(skip=...)`` names it)."""
        return step in self._skip or self.elastic.skips(step)

    def report(self, *, loss: float, samples: int, grad_norm: float | None = None) -> None:
        """The step's global loss and the samples this rank used (published when the step's
        ``with`` block ends); ``grad_norm``, when the loop has it, is checked too (a
        non-finite one, like a non-finite loss, is a loss anomaly)."""
        self._report = (float(loss), int(samples), None if grad_norm is None else float(grad_norm))

    def finish(self) -> None:
        """Report the end of training and leave (a no-op for a spare never used)."""
        if not self._running:
            return
        self._running = False
        if self.elastic.world is None:  # a spare again (its replica dropped): nothing to report
            self.elastic.close()
            return
        self.elastic.finish(self._next - 1, self._last_loss)

    # ------------------------------------------------------------------ internals

    def _enter_generation(self) -> None:
        """Build on the new group and restore what the control plane's decision names.

        A state still on its way (a newcomer fetching its shard from a peer) arrives while
        ``build`` runs: the restore is completed after it (``Elastic.complete_restore``), and
        when a refused or lost copy made the member follow a newer decision meanwhile, the
        parts are built again on that generation's group."""
        elastic = self.elastic
        while True:
            if elastic.restore_ready():  # here already (a survivor's own): reported first
                elastic.complete_restore()
            started, wall = time.perf_counter(), time.time()
            generation = self.world.generation
            # Sub-groups (a device mesh's) connect here: leaving the generation ends them too.
            with elastic.group_sockets.recording():
                model, optimizer = self._build(self.world)
            parts = _Parts(model, optimizer)
            parts.on_ready = elastic.client.gradients_ready
            built = time.perf_counter()
            trace.mark("build", wall, built - started, generation=generation)
            if not elastic.complete_restore():
                break
            del model, optimizer, parts  # built on a group the member has left
            gc.collect()
        wall = time.time()
        loading = time.perf_counter()
        adopt, reused = False, 0
        # FSDP2 state is loaded by copying every chunk into the new parts' own tensors, so the
        # next recovery may restore this member's backup as views of its slots (no clone).
        elastic.own_views = parts.kind == "sharded"
        self._next = elastic.resume_step + 1
        if self.restoring:
            shards = {
                r: shard
                if r not in elastic.restored_views
                # Views of this member's backup: only FSDP2 state is copied on load, the rest
                # is cloned here.
                else {k: v if k == "sharded" and parts.kind == "sharded" else _cloned(v)
                      for k, v in shard.items()}
                for r, shard in elastic.restored_shards.items()
            }  # fmt: skip
            # FSDP2 and sub-group DDP state has no part every rank holds alike: nothing to
            # share, and no collective, so survivors load while a newcomer still fetches.
            replicated = (
                None
                if parts.kind in ("sharded", "local")
                else self._share_replicated(elastic.restored_replicated)
            )
            own = elastic.own_shard if elastic.own_shard in shards else min(shards, default=None)
            # A shard fetched or read for this restore is the load's to keep as its optimizer
            # state (no copy); views of this member's backup are copied, into the memory the
            # last generation's parts leave (written before: no page faults) where it fits.
            adopt = own is not None and own not in elastic.restored_views
            parts.load(shards, replicated, own, adopt=adopt, memory=self._memory)
            reused = self._memory.taken if self._memory is not None else 0
            if own is not None:
                mine = shards[own]
                for name, (_, put) in self._state.items():
                    if name in mine.get("state", {}):
                        put(mine["state"][name])
                if "rng" in mine:
                    _set_rng_state(mine["rng"])
            # What was restored may be views of this member's backup: it is loaded, let it go.
            elastic.restored_shards, elastic.restored = {}, None
        self._memory = None  # what the load did not take goes back to the allocator
        loaded = time.perf_counter()
        trace.mark("load", wall, loaded - loading, generation=generation, adopt=adopt,
                   reused=reused)  # fmt: skip
        self._first = generation
        log.info("generation %d: built in %.3fs, state loaded in %.3fs", self.world.generation,
                 built - started, loaded - loading)  # fmt: skip
        # A backup's copy of what the optimizer's step writes (``_Parts.stepped``) runs beside
        # the next forward and backward; the step waits for it.
        parts.optimizer.register_step_pre_hook(lambda *_: elastic.settle())
        self._parts = parts

    def _share_replicated(self, mine: Any) -> Any:
        """The replicated state of the restore step on every rank: this member's own copy, or
        one a survivor sends over the new group (collective: every rank calls it)."""
        world = self.world
        have = torch.zeros(world.size, dtype=torch.int64, device=self._comm_device())
        have[world.rank] = 0 if mine is None else 1
        dist.all_reduce(have)
        holders = [r for r in range(world.size) if have[r]]
        if not holders or len(holders) == world.size:
            return mine
        source = holders[0]
        if world.rank == source:
            buffer = io.BytesIO()
            torch.save(mine, buffer)
            payload = torch.frombuffer(bytearray(buffer.getbuffer()), dtype=torch.uint8)
            length = torch.tensor([payload.numel()], dtype=torch.int64)
        else:
            length = torch.zeros(1, dtype=torch.int64)
        length = length.to(self._comm_device())
        dist.broadcast(length, source)
        if world.rank != source:
            payload = torch.empty(int(length.item()), dtype=torch.uint8)
        moved = payload.to(self._comm_device())
        dist.broadcast(moved, source)
        if world.rank == source:
            return mine
        log.info("replicated state of the restore step from rank %d (%d bytes)", source,
                 moved.numel())  # fmt: skip
        data = moved.cpu().numpy().tobytes()
        return torch.load(io.BytesIO(data), weights_only=True)

    def _comm_device(self) -> torch.device:
        return self.device if dist.get_backend() == "nccl" else torch.device("cpu")

    def _unique(self) -> dict[str, Any]:
        assert self._parts is not None
        return unique_state(self._parts, self._state)

    def _replicated(self) -> Any:
        assert self._parts is not None
        return self._parts.replicated()

    def _done(self, step: int, seconds: float, compute: float | None = None) -> None:
        if self._report is None:
            raise RuntimeError(f"step {step} ended without session.report(loss=..., samples=...)")
        loss, samples, grad_norm = self._report
        self._report = None
        if math.isfinite(loss):  # what ``finish`` reports (a non-finite one is rolled back)
            self._last_loss = loss
        self._next = step + 1
        first, self._first = self._first, None
        done = time.time()
        assert self._parts is not None
        self.elastic.step_done(step, loss=loss, samples=samples, seconds=seconds,
                               compute_seconds=compute, state=self._unique,
                               replicated=self._replicated, later=self._parts.stepped,
                               grad_norm=grad_norm)  # fmt: skip
        if first is not None:  # the generation's first step, and its report
            trace.mark("first_step", done - seconds, seconds, generation=first)
            trace.mark("step_done", done, time.time() - done, generation=first)

    def _poison(self, factor: float) -> None:
        """Multiply the current model's floating-point parameters by ``factor`` (NaN for
        ``nan@STEP``, which makes them all NaN; a spike's factor for ``spike@STEP``)."""
        if self._parts is None:
            return
        with torch.no_grad():
            for parameter in self._parts.module.parameters():
                local = parameter.to_local() if isinstance(parameter, DTensor) else parameter
                if local.is_floating_point():
                    local.mul_(factor)

    def _recover(self, error: BaseException, step: int) -> None:
        """Drop the parts (they hold the broken group) and follow the control plane."""
        # A backup's copy still reading the parts' memory lands first: that memory is
        # reused below, and written by the next load.
        self.elastic.settle()
        parts, self._parts = self._parts, None
        # The local tensors of FSDP2 state hold no group: their memory serves the next load.
        if parts is not None and parts.kind == "sharded":
            self._memory = sharded.Memory.of(parts.module, parts.optimizer)
        del parts
        self._report = None
        self._first = None
        with trace.span("recover.gc"):
            gc.collect()
        self.elastic.recover(error, step)
        self._next = self.elastic.resume_step + 1


class _StepGuard:
    """The ``with`` block of one step: times it, reports it, and turns a lost peer into a
    recovery (the next iteration of ``steps`` goes on from the restored step)."""

    def __init__(self, session: Session) -> None:
        self._session = session

    def __enter__(self) -> tuple[Any, Any]:
        parts = self._session._parts
        assert parts is not None
        parts.grads_ready = None
        parts.accumulated = 0
        self._session.elastic.client.step_began(self._session._step)
        self._started = time.perf_counter()
        return parts.model, parts.optimizer

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> bool:
        session = self._session
        step = session._step
        assert step is not None
        session._step = None
        if error is None:
            ended = time.perf_counter()
            parts = session._parts
            ready = parts.grads_ready if parts is not None else None
            compute = ready - self._started if ready is not None else None
            try:
                session._done(step, ended - self._started, compute)
            except (GenerationSuperseded, LossAnomaly) as newer:  # decided, or to be
                session._recover(newer, step)
            return False
        if not isinstance(error, Exception) or not is_peer_failure(error):
            return False  # the loop's own error: it propagates untouched
        del traceback  # its frames hold the step's tensors and, through them, the old group
        session._recover(error, step)
        return True
