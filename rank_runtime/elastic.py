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
publishes ``train.step``, keeps the heartbeat's step current, takes the hot backup every
``backup_interval`` steps (a copy into preallocated, double-buffered memory: the only part on
the training path) and hands it to a background thread that checksums it, publishes
``backup.snapshot`` and sends it to the holders the control plane placed it on (each holder
verifies and publishes ``backup.replicated``); training does not wait for replication.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from controlplane.rendezvous import parse_endpoint
from rank_runtime import faults
from rank_runtime.client import EventClient
from rank_runtime.identity import Identity
from rank_runtime.replication import Held, PeerStore, ReplicationError, checksum, fetch, send
from rank_runtime.snapshot import HotSnapshot, SnapshotNotFound, from_bytes
from schemas.commands import Reallocate, Start, Stop
from schemas.common import FaultKind, Phase, ReallocationMode, RestoreFrom, Role
from schemas.events import JobPolicy

log = logging.getLogger(__name__)

#: Replications waiting for the background sender before the oldest is dropped.
_REPLICATION_QUEUE = 4


class JobStoppedError(RuntimeError):
    """The control plane stopped the job."""


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


class Elastic:
    """This process's membership in an elastic job. The constructor does no I/O."""

    def __init__(
        self,
        identity: Identity | None = None,
        *,
        policy: JobPolicy | None = None,
        collective_timeout_s: float = 60.0,
    ) -> None:
        self.identity = identity if identity is not None else Identity.from_env()
        if policy is None and self.identity.policy_json:
            policy = JobPolicy.model_validate_json(self.identity.policy_json)
        self._requested = policy
        self.policy = policy if policy is not None else JobPolicy()
        self.client = EventClient(self.identity)
        self.peers = PeerStore(advertise=os.environ.get("ELASTIC_ADVERTISE", "127.0.0.1"))
        self.world: World | None = None
        #: The step training goes on from (0 for a fresh start).
        self.resume_step = 0
        #: The state to load before going on from ``resume_step`` (None: the initial state):
        #: this rank's shard after a replacement.
        self.restored: Any = None
        #: Every shard restored, by its rank in the backup's generation: this rank's after a
        #: replacement, all of them after a shrink or a growth (for re-partitioning).
        self.restored_shards: dict[int, Any] = {}
        #: This member's rank when its newest backups were taken (its shard number there).
        self._backup_shard: int | None = None
        self._faults = faults.from_env()
        self._faults_state = os.environ.get(faults.FAULTS_STATE_ENV)
        self._collective_timeout = timedelta(seconds=collective_timeout_s)
        #: This rank's own copies: two preallocated slots, the newest complete one whole.
        self.hot = HotSnapshot()
        self._replicas: queue.Queue[tuple[int, float] | None] = queue.Queue(_REPLICATION_QUEUE)
        self._replicator: threading.Thread | None = None

    # ------------------------------------------------------------------ start

    def start(self, timeout_s: float = 600.0) -> World | None:
        """Join the job and wait for a rank; None when the job ended before needing us."""
        identity = self.identity
        self.client.start()
        self.peers.on_held = self._on_held
        self.peers.own = self._own_copy
        endpoint = self.peers.start()
        joined: dict[str, Any] = {
            "node": identity.node, "rack": identity.rack, "host": identity.host or "localhost",
            "pid": os.getpid(), "role": identity.role.value, "device": "cpu",
            "backup_endpoint": endpoint,
        }  # fmt: skip
        if self._requested is not None:
            joined["policy"] = json.loads(self._requested.model_dump_json())
        self.client.publish("member.joined", joined)
        self.client.phase = Phase.WAITING if identity.role is Role.SPARE else Phase.INIT
        self.client.start_heartbeats(self.policy.heartbeat_interval_s)
        command = self._wait_for_world(timeout_s)
        if command is None:
            return None
        if isinstance(command, Reallocate):
            self._rejoin(command)  # a spare taking a rank: its state comes from peers
        else:
            self._form(command)
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
        while time.monotonic() < deadline:
            command = self.client.next_command(timeout=1.0)
            if command is None:
                continue
            if isinstance(command, Stop):
                log.info("the job ended: %s", command.reason)
                return None
            if command.generation > current and member in command.world:
                return command
            if command.generation > current and self.world is not None:
                # A newer world without this member of the old one: it was dropped (found
                # hung, say). A spare just keeps waiting.
                raise JobStoppedError(f"generation {command.generation} goes on without {member}")
        raise TimeoutError(f"no generation named {member} within {timeout_s:g}s")

    # ------------------------------------------------------------------ recovery

    def recover(self, error: BaseException, step: int, timeout_s: float = 300.0) -> None:
        """After a collective failed: report it, wait for the control plane's decision, join
        the new generation and fetch the state to restore (``restored``, ``resume_step``).

        Raises ``JobStoppedError`` when the job stops or goes on without this member.
        """
        log.warning("step %d failed (%s); waiting for the control plane", step, error)
        self.report_fault(FaultKind.COLLECTIVE_ERROR, f"{type(error).__name__}: {error}", step=step)
        self.client.phase = Phase.WAITING
        # Leave the broken group now: closing its connections fails the collectives that
        # peers still wait in, so every survivor gets here in milliseconds, not at the
        # collective timeout. (The caller drops its DDP and optimizer first: they hold it.)
        self._leave_group()
        self._drain_replication()
        command = self._wait_for_world(timeout_s)
        if command is None:
            raise JobStoppedError("the job stopped while this member waited to recover")
        if not isinstance(command, Reallocate):
            raise JobStoppedError(f"expected a reallocation, got {command.kind}")
        self._rejoin(command)

    def _rejoin(self, command: Reallocate) -> None:
        """Ack ``command``, leave the broken group, form the new one, restore its step."""
        self.client.publish("command.acked", {"command_id": str(command.command_id)})
        self._leave_group()
        self.client.phase = Phase.RESTORE
        self._form(command)
        self.client.phase = Phase.RESTORE
        started = time.perf_counter()
        shards, nbytes, sources = self._restore(command)
        world = self._world()
        self.client.generation = command.generation
        self.restored_shards = shards
        self.restored = shards.get(world.rank) if command.mode is ReallocationMode.REPLACE else None
        self.resume_step = command.restore_step
        self.client.step = command.restore_step
        self.client.publish(
            "restore.completed",
            {"generation": command.generation, "step": command.restore_step, "bytes": nbytes,
             "seconds": time.perf_counter() - started, "sources": sources},
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
        log.info("generation %d: rank %d of %d from step %d", world.generation, world.rank,
                 world.size, command.restore_step)  # fmt: skip

    @staticmethod
    def _leave_group() -> None:
        import gc

        import torch.distributed as dist

        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception as exc:  # the old group is broken; it only has to go
                log.debug("tearing down the old group: %s", exc)
        gc.collect()  # DDP reducers in reference cycles keep the group's sockets open

    def _restore(self, command: Reallocate) -> tuple[dict[int, Any], int, dict[str, str]]:
        """The shards to restore: this rank's after a replacement, every shard after a shrink
        or a growth. Each from this member's memory when it took it, else from the plan's
        source. Returns (shard -> state, bytes, shard -> source)."""
        if command.restore_from is RestoreFrom.INITIAL:
            return {}, 0, {}
        if command.restore_from is not RestoreFrom.MEMORY:
            raise JobStoppedError(f"restoring from {command.restore_from.value} is not supported")
        world = self._world()
        wanted = (
            [world.rank] if command.mode is ReallocationMode.REPLACE else range(len(command.plan))
        )
        shards: dict[int, Any] = {}
        sources: dict[str, str] = {}
        nbytes = 0
        for shard in wanted:
            source = command.plan[shard] if shard < len(command.plan) else self.identity.member
            data = self._own_copy(shard, command.restore_step)
            if data is None:
                endpoint = command.endpoints.get(source, "")
                data = fetch(endpoint, owner=None, shard=shard, step=command.restore_step)
            else:
                source = self.identity.member
            shards[shard] = from_bytes(data).state
            sources[str(shard)] = source
            nbytes += len(data)
        return shards, nbytes, sources

    def _own_copy(self, shard: int, step: int) -> bytes | None:
        """This member's own backup of ``shard`` at ``step``, if it took it."""
        if shard != self._backup_shard:
            return None
        try:
            return self.hot.to_bytes(step)
        except SnapshotNotFound:
            return None

    def _form(self, command: Start | Reallocate) -> None:
        """Join the generation's process group through the control plane's rendezvous."""
        import torch.distributed as dist

        rank = command.world.index(self.identity.member)
        endpoint = parse_endpoint(command.rendezvous)
        client = dist.TCPStore(  # type: ignore[attr-defined]
            endpoint.host, endpoint.port, is_master=False, timeout=self._collective_timeout
        )
        store = dist.PrefixStore(endpoint.prefix, client)  # type: ignore[attr-defined]
        dist.init_process_group(
            "gloo",
            store=store,
            rank=rank,
            world_size=len(command.world),
            timeout=self._collective_timeout,
        )
        self.client.generation = command.generation
        self.world = World(
            generation=command.generation,
            rank=rank,
            size=len(command.world),
            members=tuple(command.world),
            placement=tuple(tuple(h) for h in command.placement),
            endpoints=dict(command.endpoints),
            rendezvous=command.rendezvous,
        )
        self.client.phase = Phase.TRAIN

    # ------------------------------------------------------------------ the loop

    def step_done(
        self,
        step: int,
        *,
        loss: float,
        samples: int,
        seconds: float = 0.0,
        state: Callable[[], Any] | None = None,
    ) -> None:
        """Report a finished step; back up when due; carry out injected faults."""
        world = self._world()
        self.client.step = step
        self.client.publish(
            "train.step",
            {"step": step, "loss": float(loss), "step_seconds": max(0.0, seconds),
             "samples": samples},
        )  # fmt: skip
        if state is not None and step % self.policy.backup_interval == 0:
            self.backup(step, state())
        faults.inject(self._faults, step, world.rank, self._faults_state)

    def backup(self, step: int, state: Any) -> None:
        """Copy ``state`` (this rank's unique shard) into preallocated memory now; checksum,
        report and replicate it from the background thread."""
        self._world()
        self.client.phase = Phase.BACKUP
        try:
            info = self.hot.take(step, state)
        finally:
            self.client.phase = Phase.TRAIN
        self._backup_shard = self._world().rank
        if info is None:
            log.warning("backup of step %d skipped: the previous one is still being sent", step)
            return
        try:
            self._replicas.put_nowait((step, info.seconds))
        except queue.Full:  # the sender lags: the newest backup matters most
            dropped = self._replicas.get_nowait()
            log.warning("replication lags; dropping the copy of step %s", dropped and dropped[0])
            self._replicas.put_nowait((step, info.seconds))

    def report_fault(
        self, kind: FaultKind, detail: str, *, step: int | None = None, suspects: Sequence[str] = ()
    ) -> None:
        """Tell the control plane what went wrong here (e.g. a collective lost ``suspects``)."""
        self.client.publish(
            "member.fault",
            {"kind": kind.value, "detail": detail[:4096], "step": step,
             "suspects": list(suspects)[:64]},
        )  # fmt: skip

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

    def _drain_replication(self) -> None:
        replicator, self._replicator = self._replicator, None
        if replicator is not None:
            self._replicas.put(None)
            replicator.join(30)

    def close(self) -> None:
        """Stop replicating, flush events, tear down the process group."""
        self._drain_replication()
        self.client.close()
        self.peers.close()
        try:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception as exc:  # a broken group cannot always be torn down cleanly
            log.debug("process group teardown: %s", exc)

    # ------------------------------------------------------------------ replication

    def _world(self) -> World:
        if self.world is None:
            raise RuntimeError("call start() first: this member has no rank yet")
        return self.world

    def _replicate(self) -> None:
        while True:
            item = self._replicas.get()
            if item is None:
                return
            step, copy_seconds = item
            world = self._world()
            shard = world.rank
            try:
                data = self.hot.to_bytes(step)
            except SnapshotNotFound:
                continue  # overwritten by two newer backups meanwhile
            digest = checksum(data)
            self.client.publish(
                "backup.snapshot",
                {"step": step, "shard": shard, "nbytes": len(data), "checksum": digest,
                 "seconds": copy_seconds},
            )  # fmt: skip
            holders = world.placement[shard] if shard < len(world.placement) else ()
            for holder in holders:
                endpoint = world.endpoints.get(holder)
                if not endpoint:
                    log.warning("no endpoint for holder %s of shard %d", holder, shard)
                    continue
                try:
                    send(endpoint, owner=self.identity.member, shard=shard, step=step,
                         generation=world.generation, data=data, digest=digest)  # fmt: skip
                except ReplicationError as exc:
                    log.warning("%s", exc)

    def _on_held(self, copy: Held, seconds: float) -> None:
        """A peer's shard arrived verified: say so (the holder publishes the replica)."""
        self.client.publish(
            "backup.replicated",
            {"step": copy.step, "shard": copy.shard, "owner": copy.owner,
             "nbytes": len(copy.data), "checksum": copy.checksum, "seconds": seconds},
        )  # fmt: skip
