"""Simulated members of a job that speak to a real control plane over NATS.

For benchmarks and service tests: each member publishes valid envelopes on its own subject
(real JetStream publishes, ``Nats-Msg-Id`` set), with real clocks, and can answer commands the
way a rank does (ack, restore, resume, step). No torch, no training: only the protocol.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from nats.aio.client import Client
from nats.js import JetStreamContext

from controlplane.publish import Outgoing, publish_all
from schemas.commands import Reallocate, Start
from schemas.ids import new_event_id
from schemas.subjects import MSG_ID_HEADER, event_subject, heartbeat_subject


@dataclass(slots=True)
class SimMember:
    """One simulated member: where it runs, and its per-incarnation sequence."""

    member: str
    node: str
    rack: str
    role: str = "worker"
    incarnation: str = ""
    seq: int = 0
    generation: int = 0


class SimulatedJob:
    """Members of one job on a JetStream context; events go out in one publish per call."""

    def __init__(
        self, js: JetStreamContext | None, job_id: str, members: Iterable[SimMember]
    ) -> None:
        self.js = js
        self.job_id = job_id
        self.members = {m.member: m for m in members}
        for m in self.members.values():
            m.incarnation = m.incarnation or uuid.uuid4().hex[:12]
        #: node -> its launcher (``<node>/launcher``: announces members, reports exits).
        self.launchers: dict[str, SimMember] = {}

    def launcher(self, member: str) -> SimMember:
        """The launcher of ``member``'s node."""
        node = self.members[member].node
        found = self.launchers.get(node)
        if found is None:
            found = self.launchers[node] = SimMember(
                "launcher", node, self.members[member].rack, incarnation=uuid.uuid4().hex[:12]
            )
        return found

    def envelope(
        self, member: str, type_: str, payload: dict[str, Any], *, by: SimMember | None = None
    ) -> Outgoing:
        """An event of ``member`` (or of ``by``, its launcher)."""
        m = by or self.members[member]
        m.seq += 1
        event_id = new_event_id()
        data = {
            "event_id": event_id,
            "job_id": self.job_id,
            "type": type_,
            "v": 1,
            "source": f"{m.node}/{m.member}",
            "incarnation": m.incarnation,
            "seq": m.seq,
            "generation": m.generation,
            "emitted_at": datetime.now(UTC).isoformat(),
            "payload": payload,
        }
        subject = event_subject(self.job_id, m.node, m.member, type_)
        return Outgoing(subject, json.dumps(data, separators=(",", ":")).encode(), event_id)

    async def send(self, messages: Sequence[Outgoing]) -> None:
        assert self.js is not None, "a job built without a JetStream context only encodes"
        if len(messages) == 1:
            m = messages[0]
            assert m.msg_id is not None
            await self.js.publish(m.subject, m.data, headers={MSG_ID_HEADER: m.msg_id})
            return
        await publish_all(self.js, messages)

    def joined(self, name: str, policy: dict[str, Any] | None = None) -> dict[str, Any]:
        """The ``member.joined`` payload of ``name`` (with the policy it asks for, if any)."""
        m = self.members[name]
        payload: dict[str, Any] = {
            "node": m.node, "rack": m.rack, "host": f"host-{m.node}", "pid": 1,
            "role": m.role, "device": "cpu", "backup_endpoint": f"{m.node}:7000",
        }  # fmt: skip
        if policy is not None:
            payload["policy"] = policy
        return payload

    def launched(self, names: Sequence[str]) -> list[Outgoing]:
        """Each member's launcher announcing it (a spare counts only then)."""
        return [
            self.envelope(n, "member.launched",
                          {"member": n, "role": self.members[n].role, "pid": 1},
                          by=self.launcher(n))
            for n in names
        ]  # fmt: skip

    def joining(self, names: Sequence[str], policy: dict[str, Any] | None = None) -> list[Outgoing]:
        """``launched``, then each member's join; the first one asks for ``policy``."""
        return self.launched(names) + [
            self.envelope(n, "member.joined", self.joined(n, policy if i == 0 else None))
            for i, n in enumerate(names)
        ]

    async def join(self, members: Iterable[str], policy: dict[str, Any] | None = None) -> None:
        """Each member's launcher announces it, then it joins (each asking for ``policy``)."""
        names = list(members)
        await self.send(
            self.launched(names)
            + [self.envelope(n, "member.joined", self.joined(n, policy)) for n in names]
        )

    async def heartbeat(self, members: Iterable[str], step: int, phase: str = "train") -> None:
        await self.send(
            [self.envelope(m, "member.heartbeat", {"step": step, "phase": phase}) for m in members]
        )

    def beat_message(self, member: str, step: int, phase: str = "train") -> Outgoing:
        """A heartbeat of ``member`` on its NATS core subject (soft state, not stored)."""
        m = self.members[member]
        data = {
            "job_id": self.job_id,
            "type": "member.heartbeat",
            "v": 1,
            "source": f"{m.node}/{m.member}",
            "incarnation": m.incarnation,
            "generation": m.generation,
            "emitted_at": datetime.now(UTC).isoformat(),
            "payload": {"step": step, "phase": phase},
        }
        subject = heartbeat_subject(self.job_id, m.node, m.member)
        return Outgoing(subject, json.dumps(data, separators=(",", ":")).encode(), None)

    def node_beats_message(self, node: str, members: Iterable[str], step: int) -> Outgoing:
        """``members``' heartbeats as ``node``'s launcher relays them (``node.heartbeat``, on
        the launcher's NATS core subject), each heard as the message leaves."""
        names = [self.members[name] for name in members]
        data = {
            "job_id": self.job_id,
            "type": "node.heartbeat",
            "v": 1,
            "source": f"{node}/launcher",
            "emitted_at": datetime.now(UTC).isoformat(),
            "members": [m.member for m in names],
            "incarnation": [m.incarnation for m in names],
            "generation": [m.generation for m in names],
            "age_ms": [0] * len(names),
            "step": [step] * len(names),
            "phase": ["train" if m.generation else "waiting" for m in names],
            "step_ms": [0] * len(names),
        }
        subject = heartbeat_subject(self.job_id, node, "launcher")
        return Outgoing(subject, json.dumps(data, separators=(",", ":")).encode(), None)

    async def beat(
        self, nc: Client, members: Iterable[str], step: int, phase: str = "train"
    ) -> None:
        """Each of ``members`` heartbeats once on NATS core (``nc``: a core connection)."""
        for name in members:
            message = self.beat_message(name, step, phase)
            await nc.publish(message.subject, message.data)
        await nc.flush()

    async def exited(self, member: str, signal: int = 9) -> None:
        """The launcher of ``member``'s node reports its exit."""
        await self.send([self.envelope(member, "member.exited", {"member": member,
                                                                 "signal": signal},
                                       by=self.launcher(member))])  # fmt: skip

    async def step(self, members: Iterable[str], step: int, loss: float = 1.0) -> None:
        await self.send(
            [
                self.envelope(m, "train.step", {"step": step, "loss": loss,
                                                "step_seconds": 0.01, "samples": 8})
                for m in members
            ]
        )  # fmt: skip

    async def backup(self, world: Sequence[str], placement: Sequence[Any], step: int) -> None:
        """Snapshot every shard at ``step`` and replicate it to the placed holders."""
        out = []
        for shard, owner in enumerate(world):
            checksum = f"crc32:{step:04x}{shard:04x}"
            out.append(self.envelope(owner, "backup.snapshot", {
                "step": step, "shard": shard, "nbytes": 64, "checksum": checksum,
                "seconds": 0.001}))  # fmt: skip
            for holder in placement[shard]:
                out.append(self.envelope(holder, "backup.replicated", {
                    "step": step, "shard": shard, "owner": owner, "nbytes": 64,
                    "checksum": checksum, "seconds": 0.001}))  # fmt: skip
        await self.send(out)

    async def obey(self, command: Start | Reallocate) -> None:
        """What ranks do with a command: move to its generation; for a reallocation, ack,
        restore and resume, then take the first step of the new generation."""
        for name in command.world:
            self.members[name].generation = command.generation
        if isinstance(command, Start):
            await self.heartbeat(command.world, 0)
            return
        world = command.world
        g, step = command.generation, command.restore_step
        out = [self.envelope(m, "command.acked", {"command_id": str(command.command_id)})
               for m in world]  # fmt: skip
        out += [self.envelope(m, "restore.completed", {"generation": g, "step": step,
                                                       "bytes": 64, "seconds": 0.001})
                for m in world]  # fmt: skip
        out += [self.envelope(m, "train.resumed", {"generation": g, "step": step})
                for m in world]  # fmt: skip
        out += [self.envelope(m, "train.step", {"step": step + 1, "loss": 1.0,
                                                "step_seconds": 0.01, "samples": 8})
                for m in world]  # fmt: skip
        await self.send(out)
