"""The integration API for a training loop: join, form the world, report steps, back up.

A few lines in an ordinary DDP loop::

    elastic = Elastic()                      # reads the launcher's environment; no I/O
    world = elastic.start()                  # joins, waits for its rank, forms the group
    ...                                      # build the model, DDP, the optimizer
    for step in range(elastic.resume_step + 1, steps + 1):
        ...                                  # forward, backward, optimizer step
        elastic.step_done(step, loss=loss.item(), samples=n, state=lambda: {...})
    elastic.finish(step)

``start`` returns None for a spare the job never needed (the job ended first). ``step_done``
puts the step and its time on the heartbeats, publishes ``train.step`` (rank 0 every step, the
others their first step of each generation), takes the hot backup every ``backup_interval``
steps (a copy into preallocated, double-buffered memory: the only part on the training path)
and hands it to a background thread that digests it, sends the slot's bytes as they are to the
holders the control plane placed it on (each keeps it under that digest and answers once it
has), then publishes ``backup.snapshot`` naming the holders that answered (one record per rank
per backup); a restore verifies every copy against the digest. Training does not wait for
replication.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import importlib
import json
import logging
import math
import os
import queue
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from rank_runtime import checkpoint, faults, trace
from rank_runtime.client import EventClient
from rank_runtime.group import GroupSockets, backend_for, forget_failed_group, member_device
from rank_runtime.identity import Identity
from rank_runtime.replication import (
    ADVERTISE_ENV,
    Abandon,
    Abandoned,
    DigestMismatch,
    NotHeld,
    PeerStore,
    ReplicationError,
    background_priority,
    bind_address,
    digest,
    fetch_into,
    send,
    server_tls,
    unreachable,
)
from rank_runtime.snapshot import (
    CorruptSnapshot,
    HotSnapshot,
    SnapshotDecoder,
    SnapshotNotFound,
    from_bytes,
)
from schemas.auth import JOB_SECRET_ENV, parse_secret
from schemas.commands import Reallocate, Start, Stop
from schemas.common import AnomalyKind, FaultKind, Phase, ReallocationMode, RestoreFrom, Role
from schemas.events import JobPolicy

log = logging.getLogger(__name__)

#: Replications waiting for the background sender before the oldest is dropped.
_REPLICATION_QUEUE = 4
#: The cold checkpoint's key for the replicated part of a rank's state (``_cold_state``).
REPLICATED_KEY = "__replicated__"
#: How often a member waiting at a rendezvous looks for a newer command.
_ARRIVAL_POLL_S = 0.05
#: The least time forming a generation's group waits for its ranks (``Elastic._form_timeout``).
FORM_TIMEOUT_S = 60.0
#: The least a step open when a newer generation is decided may run before its group's
#: connections are ended (``Elastic._on_command``): twice the longest recent step, or this.
RELEASE_GRACE_S = 0.25
#: Modes whose world keeps the restore step's layout: a rank needs only its own shard.
_SAME_LAYOUT = frozenset({ReallocationMode.REPLACE, ReallocationMode.ROLLBACK})


#: What the first DDP (or FSDP) construction in a process imports — ``torch._dynamo`` alone
#: takes seconds — and what the session imports to tell a ZeRO optimizer apart
#: (``torch.distributed.optim``: 0.15 s). Every member imports them before it joins, so a warm
#: spare called in to take a rank builds its model as fast as the survivors do.
WARM_IMPORTS = (
    "torch.distributed",
    "torch.distributed.optim",
    "torch.nn.parallel",
    "torch._dynamo",
)


def _warm_up() -> None:
    started = time.perf_counter()
    for name in WARM_IMPORTS:
        importlib.import_module(name)
    # What exists now lives as long as the process: full collections (recovery runs one to
    # drop the broken group) skip it, which makes them several times shorter.
    gc.freeze()
    log.debug("warmed up in %.2fs", time.perf_counter() - started)


class JobStoppedError(RuntimeError):
    """The control plane stopped the job."""


class GenerationSuperseded(RuntimeError):
    """A newer generation naming this member was decided while it trained in an older one
    (``step_done`` raises it): pass it to ``recover`` like a failed collective. Without a
    launcher's fence, survivors released by a hung peer that resumed would otherwise carry
    on a generation the control plane abandoned."""

    def __init__(self, command: Start | Reallocate) -> None:
        super().__init__(f"generation {command.generation} was decided")
        self.command = command


class LossAnomaly(RuntimeError):
    """This rank's step came out non-finite (its loss or its gradients' norm); ``step_done``
    reported it (``train.anomaly``) and raises it: pass it to ``recover``, which waits, in the
    group, for the control plane's decision (a rollback to an older backup, or a stop)."""

    def __init__(self, step: int, kind: AnomalyKind, detail: str) -> None:
        super().__init__(f"step {step}: {detail} ({kind.value})")
        self.step = step
        self.kind = kind


def _non_finite(loss: float, grad_norm: float | None) -> tuple[AnomalyKind, str] | None:
    """What is not finite of a step's numbers (None: both are)."""
    if not math.isfinite(loss):
        return AnomalyKind.NON_FINITE_LOSS, f"loss={loss}"
    if grad_norm is not None and not math.isfinite(grad_norm):
        return AnomalyKind.NON_FINITE_GRAD_NORM, f"grad_norm={grad_norm}"
    return None


class _Superseded(Exception):  # control flow, not an error
    """A newer command overtook the one this member was carrying out (None: one that leaves
    this spare out, so it waits again)."""

    def __init__(self, command: Start | Reallocate | None) -> None:
        super().__init__(f"generation {command.generation}" if command else "left out")
        self.command = command


def _suspects(error: BaseException, command: Reallocate) -> list[str]:
    """The members a failed restore could not reach (named by their endpoint in the error);
    none when the source answered (it lacked the copy, say): it is alive."""
    if not isinstance(error.__cause__, OSError):
        return []
    text = str(error)
    return sorted({m for m, e in command.endpoints.items() if e and e in text})[:64]


class _RefusedCopy(ReplicationError):
    """A restore refused ``source``'s copy of ``shard``: it does not match its digest."""

    def __init__(self, shard: int, source: str, detail: str) -> None:
        super().__init__(detail)
        self.shard = shard
        self.source = source


def _drop_tracebacks(error: BaseException) -> None:
    """Clear the tracebacks of ``error`` and of every error it was raised from or during."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        current.__traceback__ = None
        current = current.__cause__ or current.__context__


class _Fetch:
    """``restore(command, rank)`` on a thread of its own; ``result()`` waits for it."""

    def __init__(self, restore: Callable[..., Any], command: Reallocate, rank: int) -> None:
        self._restore = restore
        self._command = command
        self._rank = rank
        self._out: Any = None
        self._error: BaseException | None = None
        #: How long the restore took (its own time, not the wait in ``result``).
        self.seconds = 0.0
        self._thread = threading.Thread(target=self._run, name="elastic-fetch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        started, wall = time.perf_counter(), time.time()
        try:
            self._out = self._restore(self._command, self._rank)
        except BaseException as exc:  # handed to result()'s caller
            self._error = exc
        finally:
            self.seconds = time.perf_counter() - started
            trace.mark("restore.fetch", wall, self.seconds, generation=self._command.generation)

    def done(self) -> bool:
        """Whether the restore ended (``result`` returns at once)."""
        return not self._thread.is_alive()

    def result(self) -> Any:
        self._thread.join()
        error, self._error = self._error, None
        if error is not None:
            raise error
        return self._out


def _by_step(key: tuple[int, int]) -> int:
    return key[1]


def _close_at_exit(ref: weakref.ref[Elastic]) -> None:
    """``Elastic.close`` at interpreter exit, for a runtime not closed yet."""
    elastic = ref()
    if elastic is None or elastic._closed:
        return
    try:
        elastic.close()
    except Exception as exc:  # leaving anyway: the exit status is the loop's
        log.debug("closing at exit: %s", exc)


def _matches(data: bytes | bytearray, expected: str) -> bool:
    """Whether ``data`` hashes to ``expected`` (``<alg>:<hex>``); False for an unknown alg."""
    try:
        return digest(data, expected.partition(":")[0]) == expected
    except ValueError:
        return False


@dataclass(frozen=True, slots=True)
class World:
    """One generation as this member sees it."""

    generation: int
    rank: int
    size: int
    members: tuple[str, ...]
    #: ``placement[r]``: the members holding copies of rank ``r``'s shard.
    placement: tuple[tuple[str, ...], ...]
    endpoints: dict[str, str]
    rendezvous: str
    #: The generation's mesh (dimension -> degree, outermost first; rank ``r`` at the
    #: row-major coordinate of ``r``), when the job's policy declares one.
    mesh: dict[str, int] | None = None


class Elastic:
    """This process's membership in an elastic job. The constructor does no I/O."""

    def __init__(
        self,
        identity: Identity | None = None,
        *,
        policy: JobPolicy | None = None,
        collective_timeout_s: float | None = None,
    ) -> None:
        self.identity = identity if identity is not None else Identity.from_env()
        if policy is None and self.identity.policy_json:
            policy = JobPolicy.model_validate_json(self.identity.policy_json)
        self._requested = policy
        self.policy = policy if policy is not None else JobPolicy()
        self.client = EventClient(self.identity)
        secret_hex = os.environ.get(JOB_SECRET_ENV, "")
        #: The job's secret: it authenticates the peer store both ways (None: security off).
        self._secret = parse_secret(secret_hex, what=JOB_SECRET_ENV) if secret_hex else None
        #: What a shard's digest is, with or without the secret: the restore checks it.
        self._digest_algorithm = "sha256"
        advertise = os.environ.get(ADVERTISE_ENV, "127.0.0.1")
        self.peers = PeerStore(
            advertise=advertise, bind=bind_address(advertise), secret=self._secret
        )
        #: (shard, step) -> the digest this member reported for its own backup.
        self._digests: dict[tuple[int, int], str] = {}
        self.world: World | None = None
        #: The step training goes on from (0 for a fresh start).
        self.resume_step = 0
        #: The generation of this member's last stored ``train.step`` (None: none yet).
        self._stepped_generation: int | None = None
        #: The state to load before going on from ``resume_step`` (None: the initial state):
        #: this rank's shard after a replacement.
        self.restored: Any = None
        #: Every shard restored, by its rank in the backup's generation: this rank's after a
        #: replacement, all of them after a shrink or a growth (for re-partitioning).
        self.restored_shards: dict[int, Any] = {}
        #: Restore this member's own backup as views of its hot snapshot's slot rather than
        #: clones (no copy of the shard): only for a caller that copies every restored tensor
        #: into its own before the next backup is taken, and never writes into them (the
        #: session sets it for FSDP2 state, whose load copies chunk by chunk).
        self.own_views = False
        #: The restored shards whose tensors are views of this member's own snapshot slots
        #: (``own_views``); the others' tensors were made for the restore alone, and the
        #: caller may keep them as its own (no copy).
        self.restored_views: frozenset[int] = frozenset()
        #: This member's rank when its newest backups were taken (its shard number there).
        self._backup_shard: int | None = None
        self._faults = faults.from_env()
        self._faults_state = os.environ.get(faults.FAULTS_STATE_ENV)
        #: The steps the loop does not run (inclusive ranges): those the job's rollbacks
        #: skipped, as the command this member follows says (``Reallocate.skip``).
        self.skip: tuple[tuple[int, int], ...] = ()
        #: Called when an injected ``nan@STEP`` or ``spike@STEP`` fires: multiplies the model's
        #: floating-point parameters by its argument (NaN, or the spike's factor; the
        #: session's).
        self.poison: Callable[[float], None] | None = None
        #: A lasting ``slow`` fault that fired in this process (None: none).
        self._slowdown: faults.Slowdown | None = None
        #: A newer command ``step_done`` found, for ``recover`` to follow.
        self._pending: Start | Reallocate | None = None
        #: Let ``start`` and ``recover`` return once the new group formed, the state to
        #: restore still on its way: the caller builds its model meanwhile, then calls
        #: ``complete_restore`` (the session does). False: they return with it restored.
        self.defer_restore = False
        #: A restore ``_rejoin`` left on its way (``defer_restore``): the command, its fetch
        #: (None: read when completed) and the seconds the group took to form.
        self._restoring: tuple[Reallocate, _Fetch | None, float] | None = None
        #: How long a collective waits for peers (default: the policy's).
        collective = collective_timeout_s or self.policy.collective_timeout_s
        self._collective_timeout = timedelta(seconds=collective)
        #: How long forming a generation's group waits for its ranks (the rendezvous store,
        #: their arrival): never less than ``FORM_TIMEOUT_S``, however short the collective
        #: timeout, since survivors first leave the broken group, which takes longer when a
        #: peer's host does not answer.
        self._form_timeout = timedelta(seconds=max(collective, FORM_TIMEOUT_S))
        #: This rank's own copies of its unique state (what peers hold copies of): two
        #: preallocated slots, the newest complete one whole.
        self.hot = HotSnapshot()
        #: This rank's copies of the state every rank of its group has alike (a DDP model):
        #: kept here only, never sent; a survivor shares it with a newcomer at restore.
        self.hot_replicated = HotSnapshot()
        #: What the last restore brought: how (``None``: the job's initial state), the
        #: replicated state this member holds for that step (None: it holds none), and the
        #: shard of its own rank in the backup's world (None: it had none).
        self.restored_from: RestoreFrom | None = None
        self.restored_mode: ReallocationMode | None = None
        self.restored_replicated: Any = None
        self.own_shard: int | None = None
        self._replicas: queue.Queue[tuple[int, float] | None] = queue.Queue(_REPLICATION_QUEUE)
        self._replicator: threading.Thread | None = None
        #: Set while a recovery stops the replicator: what it digests or sends is abandoned.
        self._abandon = Abandon()
        #: Where cold checkpoints go (a directory every member can read); None: nowhere.
        self.checkpoint_dir = os.environ.get(checkpoint.CHECKPOINT_DIR_ENV) or None
        self._cold: checkpoint.ColdWriter | None = None
        self._device: Any = None
        #: A shrink dropped this member's replica: it waits as a spare (``_demote``).
        self.demoted = False
        #: The job's generation names an earlier process of this member's name (this one was
        #: started again, with its pod say): it waits as a spare until a generation names it.
        self.successor = False
        #: The connections the current generation's groups opened (ended when it is left);
        #: the session adds those of the sub-groups its ``build`` creates.
        self.group_sockets = GroupSockets({})
        self._closed = False
        #: Set when the member closes: the collective watchdog (``_watch``) stops.
        self._closing = threading.Event()
        self._watchdog: threading.Thread | None = None
        self.client.on_command = self._on_command
        # An error of the loop (or a script that never calls finish) ends the interpreter with
        # the background threads running: close while the interpreter is whole. Daemon threads
        # cut off inside torch at finalization, and a process group destroyed that late, can
        # abort the process and hide the exit status the loop's error gives.
        atexit.register(_close_at_exit, weakref.ref(self))

    @property
    def device(self) -> Any:
        """This member's ``torch.device`` (``member_device``); set as current on CUDA."""
        if self._device is None:
            self._device = member_device()
            if self._device.type == "cuda":
                import torch

                torch.cuda.set_device(self._device)
        return self._device

    # ------------------------------------------------------------------ start

    def start(self, timeout_s: float = 600.0) -> World | None:
        """Join the job and wait for a rank; None when the job ended before needing us. A
        spare called in restores its rank's state (``defer_restore``: ``complete_restore``
        does)."""
        identity = self.identity
        _warm_up()
        self.client.start()
        self.peers.own = self._own_served
        if self._secret is None:
            log.warning("%s is unset: this member's peer store accepts and serves shards"
                        " without authentication, and it meets the rendezvous store without"
                        " it", JOB_SECRET_ENV)  # fmt: skip
        self.peers.tls = server_tls()  # with ELASTIC_TLS_CERT: the store serves tls://
        endpoint = self.peers.start()
        joined: dict[str, Any] = {
            "node": identity.node, "rack": identity.rack, "host": identity.host or "localhost",
            "pid": os.getpid(), "role": identity.role.value, "device": str(self.device),
            "backup_endpoint": endpoint,
        }  # fmt: skip
        if self._requested is not None:
            joined["policy"] = json.loads(self._requested.model_dump_json())
        self.client.publish("member.joined", joined)
        self.client.phase = Phase.WAITING if identity.role is Role.SPARE else Phase.INIT
        self.client.start_heartbeats(self.policy.heartbeat_interval_s)
        if self.policy.collective_probe_s > 0 and self._watchdog is None:
            self._watchdog = threading.Thread(
                target=self._watch, name="elastic-watchdog", daemon=True
            )
            self._watchdog.start()
        if self.checkpoint_dir and self.policy.checkpoint_every > 0:
            self._cold = checkpoint.ColdWriter(
                self.checkpoint_dir, identity.job_id, self._on_checkpoint
            )
        with trace.span("start.wait") as timed:
            command = self._wait_for_world(timeout_s)
            timed["generation"] = None if command is None else command.generation
        if command is None:
            return None
        if not self._enter(command, timeout_s):  # a spare taking a rank: state from peers
            return None
        if self.world is not None and faults.tampers(self._faults, self.world.rank):
            log.warning("fault injection: this member's peer store serves forged copies")
            self.peers.tamper = faults.forge
        if self._replicator is None:
            self._replicator = threading.Thread(
                target=self._replicate, name="elastic-replicate", daemon=True
            )
            self._replicator.start()
        return self.world

    def _wait_for_world(self, timeout_s: float) -> Start | Reallocate | None:
        deadline = time.monotonic() + timeout_s
        member = self.identity.member
        current = self.world.generation if self.world is not None else 0
        pending, self._pending = self._pending, None
        if pending is not None and pending.generation > current:
            return pending
        # A spare (or a member demoted meanwhile) waits as long as the job runs: until a
        # command names it, or the Stop.
        while time.monotonic() < deadline or self._waits_as_spare():
            command = self.client.next_command(timeout=1.0)
            if command is None:
                continue
            if isinstance(command, Stop):
                log.info("the job ended: %s", command.reason)
                return None
            if self._judge(command, current) is not None:
                return command
        raise TimeoutError(f"no generation named {member} within {timeout_s:g}s")

    def _judge(self, command: Start | Reallocate, current: int) -> Start | Reallocate | None:
        """``command`` when it is a generation newer than ``current`` that names this member;
        None when it is not for this member to act on. Raises ``JobStoppedError`` when a newer
        world goes on without a member that had a rank (it was dropped, found hung say); a
        spare just keeps waiting."""
        if command.generation <= current:
            return None
        member = self.identity.member
        if member in command.world:
            incarnations = command.incarnations
            named = (
                incarnations[command.world.index(member)]
                if len(incarnations) == len(command.world)
                else None  # a control plane that did not say: the name is enough
            )
            mine = self.client.incarnation
            if named is None or named == mine:
                return command
            # The generation is another process's of this name: not this one's to act on.
            if self.world is not None:
                raise JobStoppedError(
                    f"generation {command.generation} is for another process of {member}"
                    f" (incarnation {named}, not {mine})"
                )
            if not self.successor:
                log.warning("generation %d names an earlier process of %s: waiting until one"
                            " names this one", command.generation, member)  # fmt: skip
                self.successor = True
                self.client.phase = Phase.WAITING
            return None
        if isinstance(command, Reallocate) and self.identity.member in command.demoted:
            self._demote(command)  # its replica was dropped: a warm spare from now on
            return None
        if self.world is not None:
            raise JobStoppedError(
                f"generation {command.generation} goes on without {self.identity.member}"
            )
        return None

    def _waits_as_spare(self) -> bool:
        return self.world is None and (
            self.demoted or self.successor or self.identity.role is Role.SPARE
        )

    def _demote(self, command: Reallocate) -> None:
        """Leave the world for ``command``, which dropped this member's replica: wait as a
        warm spare (the peer store keeps serving what it holds) until a generation names it."""
        if self.world is not None:
            log.warning("generation %d drops this member's replica: waiting as a spare",
                        command.generation)  # fmt: skip
            self._leave_group()
        self.world = None
        self.demoted = True
        self.client.generation = command.generation
        self.client.phase = Phase.WAITING

    def _enter(self, command: Start | Reallocate, timeout_s: float) -> bool:
        """Join ``command``'s generation (and restore, for a reallocation); when a newer
        command overtakes it midway (another fault during the recovery, a lost holder), follow
        the newer one instead. False when the job ended while this spare, left out by a newer
        decision, waited again."""
        while True:
            try:
                if isinstance(command, Reallocate):
                    self._rejoin(command)
                else:
                    self._form(command)
                return True
            except _Superseded as newer:
                overtaking = newer.command
                log.warning("generation %d overtaken (%s)", command.generation, newer)
                if overtaking is None:
                    overtaking = self._wait_for_world(timeout_s)
                    if overtaking is None:
                        return False
                command = overtaking

    def _newer(self, generation: int, timeout: float) -> Start | Reallocate | None:
        """A command newer than ``generation`` naming this member, if one arrives within
        ``timeout``; ``JobStoppedError`` when the job stops or goes on without it
        (``_Superseded(None)`` for a spare, which waits again)."""
        command = self.client.next_command(timeout=timeout)
        if command is None:
            return None
        if isinstance(command, Stop):
            raise JobStoppedError(f"the job stopped: {command.reason}")
        judged = self._judge(command, generation)
        if judged is None and command.generation > generation and self.world is None:
            raise _Superseded(None)
        return judged

    # ------------------------------------------------------------------ recovery

    def recover(self, error: BaseException, step: int, timeout_s: float = 300.0) -> None:
        """After a collective failed: report it, wait for the control plane's decision, join
        the new generation and fetch the state to restore (``restored``, ``resume_step``;
        with ``defer_restore``, ``complete_restore`` waits for the state and keeps it). After
        ``LossAnomaly`` (reported already) the member waits in its group for the rollback.

        Raises ``JobStoppedError`` when the job stops or goes on without this member. Returns
        with ``world`` None when a shrink demoted this member to a spare and the job ended
        before it needed it again.
        """
        log.warning("step %d failed (%s); waiting for the control plane", step, error)
        self.client.step_abandoned()
        self._drop_restore()  # a restore still on its way belongs to the failed generation
        # A collective that failed once a newer generation was decided failed because of it
        # (``_on_command`` ended the group): a consequence of the decision, not evidence.
        decided = self.world is not None and self.client.newest_generation > self.world.generation
        # A loss anomaly was reported as such, and its rank is well: it stays in the group
        # until the decision comes, so the peers it holds in a collective fail only then,
        # in a generation the decision ended (their reports are stale, not evidence).
        anomaly = isinstance(error, LossAnomaly)
        if not decided and not isinstance(error, GenerationSuperseded | LossAnomaly):
            self.report_fault(
                FaultKind.COLLECTIVE_ERROR,
                f"{type(error).__name__}: {error}",
                step=step,
                suspects=self._unreachable(),
            )
        self.client.phase = Phase.WAITING
        left = time.time(), time.perf_counter()
        # The traceback keeps the failed step's frames, their tensors and, through the
        # autograd graph's hooks, DDP (or FSDP's parameter groups) and the broken group alive:
        # drop it, and those of the errors it was raised from or during.
        _drop_tracebacks(error)
        # Leave the broken group now: closing its connections fails the collectives that
        # peers still wait in, so every survivor gets here in milliseconds, not at the
        # collective timeout. (The caller drops its DDP and optimizer first: they hold it.)
        if not anomaly:
            self._leave_group()
        # Stop the replication of the old world now, while the control plane decides, rather
        # than after the decision came (``_rejoin`` then finds it stopped). What it still
        # digests or sends is abandoned: the decision restores what was recorded before the
        # fault, so a copy finished now would serve no one, and a backup of 300 MB still on
        # its way (the replicator yields to training) would hold the recovery up for seconds.
        self._drain_replication(abandon=True)
        trace.mark("recover.leave", left[0], time.perf_counter() - left[1])
        with trace.span("recover.wait") as timed:
            command = self._wait_for_world(timeout_s)
            timed["generation"] = None if command is None else command.generation
        if command is None and self.demoted and self.world is None:
            return  # the job ended while this member, demoted, waited as a spare
        if command is None:
            raise JobStoppedError("the job stopped while this member waited to recover")
        if not isinstance(command, Reallocate):
            raise JobStoppedError(f"expected a reallocation, got {command.kind}")
        if self.world is not None:
            faults.inject(self._faults, faults.RECOVER, self.world.rank, self._faults_state)
        if not self._enter(command, timeout_s):
            raise JobStoppedError("the job stopped while this member recovered")

    def _rejoin(self, command: Reallocate) -> None:
        """Ack ``command``, leave the broken group, form the new one, restore its step (or,
        with ``defer_restore``, leave the restore for ``complete_restore``)."""
        self._drop_restore()
        acked = time.time(), time.perf_counter()
        self.client.publish("command.acked", {"command_id": str(command.command_id)})
        self._leave_group()
        self._drain_replication(abandon=True)  # its queued copies belong to the old world
        trace.mark("rejoin.ack", acked[0], time.perf_counter() - acked[1],
                   generation=command.generation)  # fmt: skip
        self.client.phase = Phase.RESTORE
        # The shards of a memory restore come from this member's memory and the plan's
        # holders, not over the group: fetch them while the group forms.
        fetching = (
            _Fetch(self._restore, command, command.world.index(self.identity.member))
            if command.restore_from is RestoreFrom.MEMORY
            else None
        )
        forming, wall = time.perf_counter(), time.time()
        try:
            self._form(command)
        except _Superseded:
            if fetching is not None:  # its shards belong to the overtaken generation
                with contextlib.suppress(Exception):
                    fetching.result()
            raise
        formed = time.perf_counter() - forming
        trace.mark("rejoin.form", wall, formed, generation=command.generation)
        # What the command says of the restore is known now: a deferred restore's caller
        # builds on it (``restoring``) before the state has arrived.
        self.restored_from = command.restore_from
        self.restored_mode = command.mode
        self.resume_step = command.restore_step
        self.skip = tuple((first, last) for first, last in command.skip)
        if self.defer_restore:
            self._restoring = (command, fetching, formed)
            return
        self._complete(command, fetching, formed)

    def restore_ready(self) -> bool:
        """Whether ``complete_restore`` would not wait for a transfer (its state is here, or
        none is pending)."""
        pending = self._restoring
        return pending is None or pending[1] is None or pending[1].done()

    def complete_restore(self, timeout_s: float = 300.0) -> bool:
        """Finish the restore that ``start`` or ``recover`` left on its way
        (``defer_restore``): wait for its state, check it and report it, as they do
        otherwise. True when the generation changed meanwhile: a copy refused or lost made
        this member follow the newer decision (its group formed, its restore done), so what
        was built on the old group must be built again; False otherwise (also when nothing
        was pending). ``JobStoppedError`` as ``recover``."""
        changed = False
        while (pending := self._restoring) is not None:
            self._restoring = None
            try:
                self._complete(*pending)
            except _Superseded as newer:
                log.warning("generation %d overtaken (%s)", pending[0].generation, newer)
                changed = True
                command = newer.command or self._wait_for_world(timeout_s)
                if command is None or not self._enter(command, timeout_s):
                    raise JobStoppedError("the job stopped while this member restored") from None
        return changed

    def _drop_restore(self) -> None:
        """Forget a deferred restore (its generation failed first), once its fetch ended."""
        pending, self._restoring = self._restoring, None
        if pending is not None and pending[1] is not None:
            with contextlib.suppress(Exception):
                pending[1].result()

    def _complete(self, command: Reallocate, fetching: _Fetch | None, formed: float) -> None:
        """The restore of ``command`` once its group formed: wait for the fetch (or read the
        shards), check it, keep what it restored, report it. ``_Superseded`` when a copy is
        refused or lost (reported): the newer decision is to be followed."""
        self.client.phase = Phase.RESTORE
        try:
            started, wall = time.perf_counter(), time.time()
            if fetching is not None:
                shards, nbytes, sources = fetching.result()
            else:
                shards, nbytes, sources = self._restore(command)
            trace.mark("rejoin.fetched", wall, time.perf_counter() - started,
                       generation=command.generation)  # fmt: skip
            seconds = fetching.seconds if fetching is not None else time.perf_counter() - started
        except (ReplicationError, checkpoint.CheckpointError) as exc:
            # A holder died (or a file is missing), or its copy is not what the owner
            # reported: say so (naming the refused copy), and follow the control plane's next
            # decision, which plans around what is lost or refused.
            # Every rank formed the group first: one still forming when this rank leaves
            # would fail there, or wait in it, deaf to the decision this report brings.
            newer = self._await_formed(command)
            refused = exc if isinstance(exc, _RefusedCopy) else None
            self.report_fault(FaultKind.RESTORE_FAILED, str(exc), step=command.restore_step,
                              suspects=_suspects(exc, command),
                              shard=refused.shard if refused else None,
                              source=refused.source if refused else None)  # fmt: skip
            self._leave_group()
            raise _Superseded(newer or self._await_newer(command.generation)) from exc
        world = self._world()
        self.client.generation = command.generation
        replicated = self._own_replicated(command.restore_step)
        for shard, state in shards.items():  # a cold checkpoint's shards carry it too
            if isinstance(state, dict) and set(state) == {"unique", REPLICATED_KEY}:
                shards[shard] = state["unique"]
                if replicated is None:
                    replicated = state[REPLICATED_KEY]
        self.restored_shards = shards
        own_only = command.mode in _SAME_LAYOUT and set(shards) <= {world.rank}
        self.restored = shards.get(world.rank) if own_only else None
        self.restored_from = command.restore_from
        self.restored_mode = command.mode
        self.restored_replicated = replicated
        if own_only:
            self.own_shard = world.rank
        else:
            own = self._backup_shard
            self.own_shard = own if own in shards else None
        self.resume_step = command.restore_step
        self.client.step = command.restore_step
        self.client.publish(
            "restore.completed",
            {"generation": command.generation, "step": command.restore_step, "bytes": nbytes,
             "seconds": seconds, "sources": sources},
        )  # fmt: skip
        self.client.publish(
            "train.resumed", {"generation": command.generation, "step": command.restore_step}
        )
        self.client.phase = Phase.TRAIN
        if self._replicator is None:
            self._replicator = threading.Thread(
                target=self._replicate, name="elastic-replicate", daemon=True
            )
            self._replicator.start()
        log.info("generation %d: rank %d of %d from step %d (group formed in %.3fs; %d bytes"
                 " restored in %.3fs, from %s)", world.generation, world.rank, world.size,
                 command.restore_step, formed, nbytes, seconds, sources)  # fmt: skip

    def _on_command(self, command: Start | Reallocate | Stop) -> None:
        """On the client's thread, as a command arrives: a newer generation ends this one, so
        a step blocked in its collectives is released (the group's connections ended:
        ``rank_runtime.group``) rather than at the collective timeout, which is the only
        release when the peer it waits for is on a host cut off from this one (its own end
        of the connections, closed when it is fenced, never reaches here). ``recover`` then
        follows the decision without reporting the failure it caused.

        A step still running its course (begun less than twice the longest recent step ago,
        and at least ``RELEASE_GRACE_S``) is left to end: the member then finds the newer
        generation between steps and leaves a group with nothing in flight. Ending
        connections under collectives in flight is what can leave a gloo send waiting the
        whole timeout (``rank_runtime.group``); a step that waits on a peer the decision
        removed has run past its course by the time the decision comes, and is released at
        once. A decision that rolls back a healthy world comes mid-step, to every member."""
        # Read before the world: a member that entered the newer generation meanwhile holds
        # that one's connections, and its world says so (nothing is ended then).
        sockets = self.group_sockets
        world = self.world
        if isinstance(command, Stop) or world is None or command.generation <= world.generation:
            return
        opened = self.client.open_step()
        if opened is None:
            return  # between steps: the next one finds the newer generation first
        course = opened.began + max(2 * opened.longest, RELEASE_GRACE_S) - time.monotonic()
        if course <= 0:
            self._release(sockets, command.generation, world, opened.began)
            return
        timer = threading.Timer(
            course, self._release, (sockets, command.generation, world, opened.began)
        )
        timer.daemon = True
        timer.start()

    def _release(self, sockets: GroupSockets, generation: int, world: World, began: float) -> None:
        """End ``world``'s connections if the step that began at ``began`` is still open in
        it (a later step, a recovery or a newer group: nothing to release)."""
        opened = self.client.open_step()
        if opened is None or opened.began != began or self.world is not world:
            return
        if self.group_sockets is not sockets:
            return
        ended = sockets.shutdown()
        if ended:
            log.warning("generation %d decided during a step of generation %d: ended the"
                        " group's %d connections", generation, world.generation,
                        ended)  # fmt: skip

    def _watch(self) -> None:
        """The collective watchdog: while a step's collectives keep this member waiting past
        the policy's ``collective_probe_s`` (since its gradients were all ready; without that
        evidence, past twice its longest recent step), probe its peers' hosts, and when some
        do not answer, report them as it still waits (``collective_error``, once a step). The
        probe is repeated after twice the wait each time. Without it, a host cut from its
        peers (and not from the control plane) is found only once the collectives time out:
        no heartbeat stops, and every side waits with its gradients ready."""
        limit = self.policy.collective_probe_s
        tick = min(0.5, limit / 4)
        began_at: float | None = None  # the open step the probes below are of
        due, reported = limit, False
        while not self._closing.wait(tick):
            opened = self.client.open_step()
            world = self.world
            if opened is None or world is None:
                continue
            began, ready, longest = opened.began, opened.ready, opened.longest
            if began != began_at:
                began_at, due, reported = began, limit, False
            now = time.monotonic()
            waited = now - ready if ready is not None else now - began - 2 * longest
            if waited < due or reported:
                continue
            due *= 2
            gone = self._unreachable()
            still = self.client.open_step()
            if not gone or still is None or still.began != began or self.world is not world:
                continue  # everyone answers (a slow peer: the stall detector's), or it went on
            reported = True
            step = opened.step
            self.report_fault(
                FaultKind.COLLECTIVE_ERROR,
                f"waited {waited:.1f}s in step {step}'s collectives (generation"
                f" {world.generation}); no answer from the hosts of {', '.join(gone[:8])}",
                step=step,
                suspects=gone,
            )

    def _leave_group(self) -> None:
        import torch.distributed as dist

        # Peers blocked in a collective with this member are released now (rank_runtime.group).
        ended = self.group_sockets.shutdown()
        if ended:
            log.debug("ended %d connections of the old group", ended)
        if not dist.is_initialized():
            forget_failed_group()
            return
        try:
            if dist.get_backend() == "nccl":
                # A broken NCCL communicator can block destroy (and any collective) forever:
                # abort it first, which returns at once and fails what still waits on it.
                from torch.distributed.distributed_c10d import _abort_process_group

                _abort_process_group()
            dist.destroy_process_group()
        except Exception as exc:  # the old group is broken; it only has to go
            log.debug("tearing down the old group: %s", exc)
        gc.collect()  # DDP reducers in reference cycles keep the group's sockets open

    def _restore(
        self, command: Reallocate, rank: int | None = None
    ) -> tuple[dict[int, Any], int, dict[str, str]]:
        """The shards to restore: this rank's after a replacement, every shard after a shrink
        or a growth. Each from this member's memory when it took it, else from the plan's
        source. Returns (shard -> state, bytes, shard -> source). ``rank``: this member's in
        ``command``'s world (default: the current world's, once formed)."""
        if command.restore_from is RestoreFrom.INITIAL:
            return {}, 0, {}
        if command.restore_from is RestoreFrom.CHECKPOINT:
            return self._restore_cold(command)
        if command.restore_from is not RestoreFrom.MEMORY:
            raise JobStoppedError(f"restoring from {command.restore_from.value} is not supported")
        if rank is None:
            rank = self._world().rank
        # A replacement in a world laid out as the restore step's (as many shards as ranks)
        # needs only its own shard; otherwise (a shrink, a growth, or a replacement restoring
        # a step an earlier, larger world backed up) every shard, to re-partition.
        own_only = command.mode in _SAME_LAYOUT and len(command.plan) == len(command.world)
        wanted = [rank] if own_only else range(len(command.plan))
        shards: dict[int, Any] = {}
        sources: dict[str, str] = {}
        nbytes = 0
        me = self.identity.member
        self.restored_views = frozenset()
        views: set[int] = set()
        for shard in wanted:
            source = command.plan[shard] if shard < len(command.plan) else me
            expected = command.digests[shard] if shard < len(command.digests) else None
            with trace.span("restore.own", generation=command.generation):
                own = self._own_state(shard, command.restore_step, expected)
            if own is not None:  # this member's own snapshot, unchanged since it was digested
                shards[shard], size = own
                sources[str(shard)] = me
                nbytes += size
                if self.own_views:
                    views.add(shard)
                continue
            data: bytes | bytearray | None = self._own_copy(shard, command.restore_step)
            if data is not None and expected is not None and not _matches(data, expected):
                log.warning("own copy of shard %d does not match its digest %s", shard, expected)
                if source == me:
                    what = f"own copy of shard {shard} of step {command.restore_step}"
                    raise _RefusedCopy(shard, me, f"{what} does not match {expected}")
                data = None  # take the plan's copy instead
            # With the recorded digest, the whole stream is hashed against it (the fetch, or
            # _matches): the trailer's checksum is not computed a second time.
            decoder = SnapshotDecoder(trusted=expected is not None)
            try:
                with trace.span("restore.receive", generation=command.generation) as timed:
                    if data is None:
                        size = self._fetch_into(decoder, shard, source, command, expected)
                    else:
                        source, size = me, len(data)
                        decoder.feed(data)
                    timed["bytes"] = size
                with trace.span("restore.decode", generation=command.generation):
                    shards[shard] = decoder.finish().state
            except CorruptSnapshot as exc:  # a copy that does not decode
                raise _RefusedCopy(shard, source, f"shard {shard} from {source}: {exc}") from exc
            sources[str(shard)] = source
            nbytes += size
        self.restored_views = frozenset(views)
        return shards, nbytes, sources

    def _fetch_into(
        self,
        decoder: SnapshotDecoder,
        shard: int,
        source: str,
        command: Reallocate,
        expected: str | None,
    ) -> int:
        """Fetch ``shard`` from ``source`` (the plan's holder) straight into ``decoder``'s
        tensors; its size. A copy that does not hash to ``expected`` is refused."""
        try:
            return fetch_into(command.endpoints.get(source, ""), lambda _: decoder, owner=None,
                              shard=shard, step=command.restore_step, expected=expected,
                              secret=self._secret)  # fmt: skip
        except (DigestMismatch, NotHeld) as exc:  # that copy is not to be had from there
            raise _RefusedCopy(shard, source, str(exc)) from exc
        except ReplicationError as exc:
            if isinstance(exc.__cause__, CorruptSnapshot):
                raise exc.__cause__ from exc
            raise

    def _restore_cold(self, command: Reallocate) -> tuple[dict[int, Any], int, dict[str, str]]:
        """The shards of the cold checkpoint at the restore step: this rank's own memory when
        it still holds that step, else the checkpoint directory (each shard read back whole,
        as a hot one: the session reshards FSDP2 state and consolidates ZeRO's)."""
        self.restored_views = frozenset()
        if not self.checkpoint_dir:
            raise JobStoppedError(
                f"the job restores the step {command.restore_step} checkpoint, but this member"
                f" has no checkpoint directory ({checkpoint.CHECKPOINT_DIR_ENV})"
            )
        world = self._world()
        step = command.restore_step
        wanted = checkpoint.shards_at(self.checkpoint_dir, self.identity.job_id, step)
        if command.mode in _SAME_LAYOUT and len(wanted) == world.size:
            wanted = [world.rank]  # the same layout: its own shard is all it needs
        shards: dict[int, Any] = {}
        sources: dict[str, str] = {}
        nbytes = 0
        for shard in wanted:
            data = self._own_copy(shard, step)
            if data is not None:
                shards[shard] = from_bytes(data).state
                sources[str(shard)] = self.identity.member
                nbytes += len(data)
                continue
            # Verified against its sha256 digest (a CheckpointError otherwise: restore_failed).
            loaded = checkpoint.read(self.checkpoint_dir, self.identity.job_id, step, shard)
            shards[shard] = loaded.state
            sources[str(shard)] = "checkpoint"
            nbytes += loaded.nbytes
        return shards, nbytes, sources

    def _on_checkpoint(self, saved: checkpoint.Saved) -> None:
        self.client.publish(
            "checkpoint.saved",
            {"step": saved.step, "shard": saved.shard, "shards": saved.shards,
             "path": saved.path, "nbytes": saved.nbytes, "checksum": saved.checksum,
             "seconds": saved.seconds},
        )  # fmt: skip

    def _own_replicated(self, step: int) -> Any:
        """The replicated state this member backed up at ``step`` (None: it took none)."""
        try:
            return self.hot_replicated.get(step).state
        except SnapshotNotFound:
            return None

    def _own_state(self, shard: int, step: int, expected: str | None) -> tuple[Any, int] | None:
        """This member's own backup of ``shard`` at ``step`` as state (a copy of the slot's
        tensors, or views of them with ``own_views``) and its serialized size, when the slot
        still holds what was digested as ``expected``: the digest its snapshot cached when it
        was replicated, so no byte is hashed, serialized or decoded again. None otherwise (not
        its shard, not that step any more, another digest): the caller then reads and verifies
        the bytes."""
        if shard != self._backup_shard or expected is None:
            return None
        try:
            if self.hot.stream_digest(step, expected.partition(":")[0]) != expected:
                return None
            return self.hot.get(step, copy=not self.own_views).state, self.hot.nbytes(step)
        except (SnapshotNotFound, ValueError):
            return None

    def _own_copy(self, shard: int, step: int) -> bytes | None:
        """This member's own backup of ``shard`` at ``step``, if it took it."""
        if shard != self._backup_shard:
            return None
        try:
            return self.hot.to_bytes(step)
        except SnapshotNotFound:
            return None

    def _own_served(self, shard: int, step: int) -> tuple[bytes, str] | None:
        """This member's own backup served to a peer, with the digest it reported for it."""
        data = self._own_copy(shard, step)
        if data is None:
            return None
        known = self._digests.get((shard, step))
        return data, known if known is not None else digest(data, self._digest_algorithm)

    def _form(self, command: Start | Reallocate) -> None:
        """Join the generation's process group through the control plane's rendezvous: one
        connection, authenticated with the job's secret and bound by the store to this
        generation's keys (``rank_runtime.rendezvous``)."""
        import torch.distributed as dist

        from rank_runtime.rendezvous import RendezvousStore

        rank = command.world.index(self.identity.member)
        previous = getattr(self, "_rendezvous_store", None)
        if previous is not None:  # the last generation's (its group is gone)
            previous.close()
        with trace.span("form.connect", generation=command.generation):
            store = self._rendezvous_store = RendezvousStore.connect(
                command.rendezvous, self._secret, timeout=self._form_timeout
            )
        with trace.span("form.arrive", generation=command.generation):
            self._arrive(store, rank, command)
        device = self.device
        self.group_sockets = GroupSockets({})
        try:
            with (
                self.group_sockets.recording(),
                trace.span("form.init", generation=command.generation),
            ):
                dist.init_process_group(
                    backend_for(device),
                    store=store,
                    rank=rank,
                    world_size=len(command.world),
                    timeout=self._collective_timeout,
                    # NCCL: this device's communicator, created now (not at the first
                    # collective), so a recovery's first step does not pay for it.
                    device_id=device if device.type == "cuda" else None,
                )
        except RuntimeError as exc:
            # A peer died or left while the group formed (a replacement that refused its
            # copy leaves at once, while slower ranks still connect to it): a fault of this
            # generation, reported as a failed collective is; then follow the decision
            # that replaces the generation, as a failed collective's recovery does.
            self.client.generation = command.generation
            log.warning("generation %d: forming the group failed (%s); waiting for the"
                        " control plane", command.generation, exc)  # fmt: skip
            self.report_fault(
                FaultKind.COLLECTIVE_ERROR,
                f"forming generation {command.generation}: {type(exc).__name__}: {exc}",
                step=command.restore_step if isinstance(command, Reallocate) else None,
            )
            self._leave_group()
            raise _Superseded(self._await_newer(command.generation)) from exc
        # Formed: a rank that must leave at once (a refused copy) waits for this first.
        store.set(f"formed/{rank}", self.identity.member)
        self.client.generation = command.generation
        self.world = World(
            generation=command.generation,
            rank=rank,
            size=len(command.world),
            members=tuple(command.world),
            placement=tuple(tuple(h) for h in command.placement),
            endpoints=dict(command.endpoints),
            rendezvous=command.rendezvous,
            mesh=dict(command.mesh) if command.mesh else None,
        )
        self.client.phase = Phase.TRAIN

    def _arrive(self, store: Any, rank: int, command: Start | Reallocate) -> None:
        """Wait until every rank of the generation reached its rendezvous, watching for a
        newer command meanwhile: a member that dies before it arrives is replaced by a newer
        decision, which this member then follows (``_Superseded``) instead of waiting in
        ``init_process_group`` until the collective timeout."""
        try:
            newer = self._barrier(store, "arrived", rank, command)
        except TimeoutError:
            raise JobStoppedError(
                f"generation {command.generation}: not every rank arrived within"
                f" {self._form_timeout.total_seconds():g}s and no newer decision came"
            ) from None
        if newer is not None:
            raise _Superseded(newer)

    def _await_formed(self, command: Reallocate) -> Start | Reallocate | None:
        """Before leaving a generation just formed (a refused copy, a lost holder): wait
        until every rank formed it, or a newer decision came (returned). A rank still in
        ``init_process_group`` when this one leaves fails there, or waits in it until the
        collective timeout, deaf to the next decision."""
        store = getattr(self, "_rendezvous_store", None)
        if store is None or self.world is None:
            return None
        try:
            return self._barrier(store, "formed", self.world.rank, command)
        except TimeoutError:
            return None  # a rank that never formed it: leave anyway

    def _barrier(
        self, store: Any, name: str, rank: int, command: Start | Reallocate
    ) -> Start | Reallocate | None:
        """Set ``name/<rank>`` and wait until every rank of ``command``'s world set its own;
        a newer command for this member, if one comes first (None: all are there).
        ``TimeoutError`` after the forming timeout (``FORM_TIMEOUT_S`` at least)."""
        import torch.distributed as dist

        store.set(f"{name}/{rank}", self.identity.member)
        keys = [f"{name}/{r}" for r in range(len(command.world))]
        deadline = time.monotonic() + self._form_timeout.total_seconds()
        poll = timedelta(seconds=_ARRIVAL_POLL_S)
        while True:
            # The store answers as soon as the last rank arrives (polling with check() and
            # sleeping between cost the last arrival up to a whole poll on the recovery path).
            try:
                store.wait(keys, poll)
                return None
            except dist.DistStoreError:  # not everyone yet
                pass
            newer = self._newer(command.generation, timeout=0.0)
            if newer is not None:
                return newer
            if time.monotonic() > deadline:
                raise TimeoutError(f"{name}: not every rank within the forming timeout")

    def _await_newer(self, generation: int, timeout_s: float = 300.0) -> Start | Reallocate:
        """Wait for the decision that replaces ``generation``."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            newer = self._newer(generation, timeout=1.0)
            if newer is not None:
                return newer
        raise JobStoppedError(f"no decision replaced generation {generation} in {timeout_s:g}s")

    # ------------------------------------------------------------------ the loop

    def step_done(
        self,
        step: int,
        *,
        loss: float,
        samples: int,
        seconds: float = 0.0,
        compute_seconds: float | None = None,
        state: Callable[[], Any] | None = None,
        replicated: Callable[[], Any] | None = None,
        later: Callable[[], Callable[[Any], bool]] | None = None,
        grad_norm: float | None = None,
    ) -> None:
        """Report a finished step; back up when due (``state()``: what only this rank has,
        copied to peers; ``replicated()``: what every rank has alike, kept here only;
        ``later()``: ``backup``'s ``later``); carry out injected faults. A non-finite
        ``loss`` or ``grad_norm`` is reported as a ``train.anomaly`` instead, and raised
        (``LossAnomaly``: pass it to ``recover``); that step is not backed up.
        ``compute_seconds``: the part of the step this rank spent computing, apart from time
        blocked in collectives (None: not measured), what straggler detection compares."""
        world = self._world()
        if faults.poisons(self._faults, step, world.rank, self._faults_state):
            log.warning("fault injection: step %d's loss is NaN on this rank", step)
            loss = float("nan")
            if self.poison is not None:
                self.poison(loss)
        anomaly = _non_finite(loss, grad_norm)
        if anomaly is not None:
            kind, detail = anomaly
            self.client.publish("train.anomaly", {"step": step, "kind": kind.value,
                                                  "detail": detail})  # fmt: skip
            raise LossAnomaly(step, kind, detail)
        compute = self._slowed(step, world.rank, seconds, compute_seconds)
        # Every member's step, step time and compute time go on its heartbeats (not stored).
        self.client.finished_step(step, max(0.0, seconds), compute)
        # The log keeps one record per step for the job, rank 0's (its loss is the job's
        # loss, as the loop reports it), and each member's first step of each generation (so
        # the timelines' resume of every member stays exact): not a row per rank per step.
        if world.rank == 0 or self._stepped_generation != world.generation:
            self._stepped_generation = world.generation
            self.client.publish(
                "train.step",
                {"step": step, "loss": float(loss), "step_seconds": max(0.0, seconds),
                 "samples": samples},
            )  # fmt: skip
        if state is not None and step % self.policy.backup_interval == 0:
            self.backup(
                step,
                state(),
                replicated() if replicated is not None else None,
                later=later() if later is not None else None,
            )
        factor = faults.spike(self._faults, step, world.rank, self._faults_state)
        if factor != 1.0 and self.poison is not None:
            log.warning("fault injection: parameters times %g on this rank after step %d",
                        factor, step)  # fmt: skip
            self.poison(factor)
        faults.inject(self._faults, step, world.rank, self._faults_state)
        self._superseded(world.generation)

    def skips(self, step: int) -> bool:
        """Whether the loop does not run ``step`` (a rollback skipped its batch: ``skip``)."""
        return any(first <= step <= last for first, last in self.skip)

    def _slowed(self, step: int, rank: int, seconds: float, compute: float | None) -> float | None:
        """Carry out injected slow steps: a lasting slowdown (``slow@STEP:rank=R:FACTOR``)
        sleeps its share of this step's compute time (of the step's time when compute is not
        measured), a one-step one its seconds; the sleep counts as compute, as a slower
        device's would. The compute time to report."""
        if not self._faults:
            return compute
        now = time.monotonic()
        if self._slowdown is None:
            self._slowdown = faults.slowdown(self._faults, step, rank, self._faults_state, now)
        # A one-step slow (``slow@STEP:rank=R:SECONDSs``) counts as that step's compute too.
        pause = faults.pause(self._faults, step, rank, self._faults_state)
        if self._slowdown is not None:
            pause += self._slowdown.pause(compute if compute is not None else seconds, now)
        if pause > 0:
            time.sleep(pause)
        return None if compute is None else compute + pause

    def settle(self) -> None:
        """Wait until the copies a backup left to a thread (``later``) landed."""
        self.hot_replicated.settle()
        self.hot.settle()

    def _superseded(self, generation: int) -> None:
        """Between steps, without waiting: when a newer generation was decided meanwhile,
        this one ends here (``GenerationSuperseded``; ``JobStoppedError`` when the newer one
        goes on without this member, or the job stopped)."""
        command = self.client.next_command()
        if command is None:
            return
        if isinstance(command, Stop):
            raise JobStoppedError(f"the job stopped: {command.reason}")
        newer = self._judge(command, generation)
        if newer is not None:
            self._pending = newer
            raise GenerationSuperseded(newer)
        if self.world is None:  # demoted: this generation ends here, the member waits
            raise GenerationSuperseded(command)

    def backup(
        self,
        step: int,
        state: Any,
        replicated: Any = None,
        *,
        later: Callable[[Any], bool] | None = None,
    ) -> None:
        """Copy ``state`` (this rank's unique shard) into preallocated memory now; checksum,
        report and replicate it from the background thread. ``replicated`` (state every rank
        of the group has alike) is copied too, but stays in this process. ``later``: the
        tensors it selects are copied on a thread while training goes on
        (``HotSnapshot.take``); the caller calls ``settle`` before they change."""
        self._world()
        self.client.phase = Phase.BACKUP
        try:
            if (
                replicated is not None
                and self.hot_replicated.take(step, replicated, later=later) is None
            ):
                log.warning("backup of step %d skipped: its replicated part is being read", step)
                return
            info = self.hot.take(step, state, later=later)
        finally:
            self.client.phase = Phase.TRAIN
        self._backup_shard = self._world().rank
        if info is None:
            log.warning("backup of step %d skipped: the previous one is still being sent", step)
            return
        if self._cold is not None and checkpoint.is_due(
            step, self.policy.backup_interval, self.policy.checkpoint_every
        ):
            world = self._world()
            self._cold.submit(step, world.rank, world.size, lambda: self._cold_state(step))
        try:
            self._replicas.put_nowait((step, info.seconds))
        except queue.Full:  # the sender lags: the newest backup matters most
            dropped = self._replicas.get_nowait()
            log.warning("replication lags; dropping the copy of step %s", dropped and dropped[0])
            self._replicas.put_nowait((step, info.seconds))

    def backup_memory(self) -> dict[str, int]:
        """CPU bytes this member holds for backups now: ``unique`` (the two slots of its own
        unique state), ``replicated`` (the two slots of the state every rank has alike),
        ``held`` (the copies of peers' shards its store keeps, ``keep`` steps each, and one
        reused receive buffer per shard), ``sending`` (0: the replicator sends the slot's bytes
        as they are, no serialized copy) and ``total``. docs/operations.md gives the sizing
        formula."""
        unique = self.hot.reserved_bytes
        replicated = self.hot_replicated.reserved_bytes
        held = self.peers.nbytes()
        sending = 0
        return {"unique": unique, "replicated": replicated, "held": held, "sending": sending,
                "total": unique + replicated + held + sending}  # fmt: skip

    def _cold_state(self, step: int) -> Any:
        """What a cold checkpoint of ``step`` holds for this rank: its unique state, and the
        replicated part beside it (under ``REPLICATED_KEY``) when there is one, so a restore
        with no survivor still finds it."""
        state = self.hot.get(step).state
        try:
            replicated = self.hot_replicated.get(step).state
        except SnapshotNotFound:
            return state
        return {"unique": state, REPLICATED_KEY: replicated}

    def _unreachable(self) -> list[str]:
        """The members of this member's world on hosts that do not answer from here (a
        partition between hosts: ``replication.unreachable``), named in a failed collective's
        report."""
        world = self.world
        if world is None:
            return []
        endpoints = {m: world.endpoints.get(m, "") for m in world.members}
        started = time.perf_counter()
        gone = unreachable(endpoints, self.identity.member)
        if gone:
            log.warning("no answer from the hosts of %s (%.1f s)", ", ".join(gone[:8]),
                        time.perf_counter() - started)  # fmt: skip
        return gone

    def report_fault(
        self,
        kind: FaultKind,
        detail: str,
        *,
        step: int | None = None,
        suspects: Sequence[str] = (),
        shard: int | None = None,
        source: str | None = None,
    ) -> None:
        """Tell the control plane what went wrong here (e.g. a collective lost ``suspects``;
        a restore refused ``source``'s copy of ``shard``)."""
        payload: dict[str, Any] = {"kind": kind.value, "detail": detail[:4096], "step": step,
                                   "suspects": list(suspects)[:64]}  # fmt: skip
        if shard is not None and source is not None:
            payload.update(shard=shard, source=source)
        self.client.publish("member.fault", payload)

    def finish(self, step: int, loss: float | None = None) -> None:
        """Report the end of training and leave (flushing events).

        Every rank first finishes sending its last backup, then waits for the others (a
        barrier), so no holder leaves while a peer still sends it a copy.
        """
        self._drain_replication()
        try:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.barrier()
        except Exception as exc:  # a broken group: leave anyway
            log.warning("final barrier failed: %s", exc)
        self.client.publish("train.completed", {"step": step, "loss": loss})
        self.close()

    def _drain_replication(self, *, abandon: bool = False) -> None:
        """Stop the replicator once it sent what is queued (``abandon``: at once, abandoning
        the copies it digests or sends, and those queued)."""
        replicator, self._replicator = self._replicator, None
        if replicator is None:
            return
        if abandon:
            self._abandon.set()
        try:
            self._replicas.put(None)
            replicator.join(30)
        finally:
            self._abandon.clear()

    def close(self) -> None:
        """Stop replicating, flush events, tear down the process group (once)."""
        if self._closed:
            return
        self._closed = True
        self._closing.set()
        self._drop_restore()
        self._drain_replication()
        if self._cold is not None:
            self._cold.close()
        self.client.close()
        self.peers.close()
        self._leave_group()  # its sockets ended first: a broken group is torn down all the same

    # ------------------------------------------------------------------ replication

    def _world(self) -> World:
        if self.world is None:
            raise RuntimeError("call start() first: this member has no rank yet")
        return self.world

    def _replicate(self) -> None:
        background_priority()  # where it contends with training for a core, training wins
        while True:
            item = self._replicas.get()
            if item is None:
                return
            step, copy_seconds = item
            if self._abandon.is_set():
                continue  # a recovery stops the replicator: the old world's copies are moot
            try:
                self._replicate_step(step, copy_seconds)
            except SnapshotNotFound:
                continue  # overwritten by two newer backups meanwhile
            except Abandoned:
                log.info("replication of step %d abandoned: a recovery started", step)

    def _replicate_step(self, step: int, copy_seconds: float) -> None:
        """Digest the backup of ``step`` once, send it to each holder (the slot's bytes as
        they are, pinned meanwhile: a ``take`` skips rather than overwrite them), then report
        it with the holders that answered they keep it: one record per rank per backup, not
        one more per copy."""
        world = self._world()
        shard = world.rank
        with self.hot.serialized(step, self._digest_algorithm, check=self._abandon.check) as form:
            reported = form.digest
            self._digests[(shard, step)] = reported
            for old in sorted(self._digests, key=_by_step)[: max(0, len(self._digests) - 4)]:
                del self._digests[old]
            holders = world.placement[shard] if shard < len(world.placement) else ()
            kept: list[str] = []
            for holder in holders:
                endpoint = world.endpoints.get(holder)
                if not endpoint:
                    log.warning("no endpoint for holder %s of shard %d", holder, shard)
                    continue
                try:
                    send(endpoint, owner=self.identity.member, shard=shard, step=step,
                         generation=world.generation, data=form.parts, digest=reported,
                         secret=self._secret, abandon=self._abandon)  # fmt: skip
                except Abandoned:
                    raise
                except ReplicationError as exc:
                    log.warning("%s", exc)
                    continue
                kept.append(holder)  # it answered once the copy was kept (verified, if so set)
            self.client.publish(
                "backup.snapshot",
                {"step": step, "shard": shard, "nbytes": form.nbytes, "checksum": reported,
                 "seconds": copy_seconds, "holders": kept},
            )  # fmt: skip
