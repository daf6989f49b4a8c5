"""Synthetic, valid event streams of a training job, for benchmarks and tests.

Deterministic for a seed: the same job produces the same events (ids included).
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

from controlplane.core.placement import Slot, place
from schemas.common import CONTROLPLANE_SOURCE
from schemas.ids import uuid7
from schemas.subjects import event_subject


class SyntheticJob:
    """A job of ``members`` workers on ``racks`` x ``nodes_per_rack`` nodes."""

    def __init__(
        self,
        job_id: str = "job-synth",
        *,
        members: int = 8,
        racks: int = 2,
        nodes_per_rack: int = 2,
        backup_interval: int = 10,
        seed: int = 0,
        start: datetime | None = None,
    ) -> None:
        self.job_id = job_id
        self.rng = random.Random(seed)
        self.start = start or datetime(2026, 1, 1, tzinfo=UTC)
        self.backup_interval = backup_interval
        nodes = [(f"n{r}-{k}", f"rack{r}") for r in range(racks) for k in range(nodes_per_rack)]
        self.members = [
            (f"m{i}", nodes[i % len(nodes)][0], nodes[i % len(nodes)][1]) for i in range(members)
        ]
        self.redundancy = min(2, members - 1)
        self.placement = place(
            [Slot(m, node, rack) for m, node, rack in self.members], self.redundancy
        )
        self.incarnation = f"inc{seed}"
        self._seq: dict[str, int] = {}
        self._tick = 0

    def _uuid(self) -> str:
        # Time-ordered, as members' ids are; the time is the event's synthetic emitted_at.
        unix_ms = int(self.start.timestamp() * 1000) + self._tick
        return uuid7(unix_ms, self.rng.getrandbits(74))

    def envelope(self, source: str, type_: str, payload: dict[str, Any]) -> dict[str, Any]:
        """A complete, valid envelope from ``source`` with the next seq."""
        seq = self._seq.get(source, 0) + 1
        self._seq[source] = seq
        self._tick += 1
        return {
            "event_id": self._uuid(),
            "job_id": self.job_id,
            "type": type_,
            "v": 1,
            "source": source,
            "incarnation": self.incarnation,
            "seq": seq,
            "generation": 0,
            "emitted_at": (self.start + timedelta(milliseconds=self._tick)).isoformat(),
            "payload": payload,
        }

    def controlplane_events(self) -> list[dict[str, Any]]:
        """What the control plane records first: the registration and generation 0."""
        world = [m for m, _, _ in self.members]
        placement = [list(h) for h in self.placement.holders]
        return [
            self.envelope(CONTROLPLANE_SOURCE, "job.registered", {
                "name": "synthetic",
                "policy": {"backup_interval": self.backup_interval, "redundancy": self.redundancy},
            }),
            self.envelope(CONTROLPLANE_SOURCE, "generation.started", {
                "generation": 0, "world": world, "rendezvous": "tcp://127.0.0.1:0/g0",
                "placement": placement, "placement_note": self.placement.note,
            }),
        ]  # fmt: skip

    def member_events(self, count: int) -> Iterator[dict[str, Any]]:
        """``count`` member events: joins first, then training with periodic backups."""
        emitted = 0
        for member, node, rack in self.members:
            if emitted == count:
                return
            yield self.envelope(f"{node}/{member}", "member.joined", {
                "node": node, "rack": rack, "host": f"host-{node}", "pid": 1000 + emitted,
                "role": "worker", "device": "cpu", "backup_endpoint": f"{node}:7000",
            })  # fmt: skip
            emitted += 1
        holds: dict[str, list[int]] = {m: [] for m, _, _ in self.members}
        for shard, holders in enumerate(self.placement.holders):
            for holder in holders:
                holds[holder].append(shard)
        step = 0
        while emitted < count:
            step += 1
            for r, (member, node, _) in enumerate(self.members):
                source = f"{node}/{member}"
                batch: list[tuple[str, dict[str, Any]]] = [
                    ("member.heartbeat", {"step": step, "phase": "train"}),
                    ("train.step", {
                        "step": step,
                        "loss": round(2.0 / (1 + 0.01 * step) + self.rng.random() * 1e-3, 6),
                        "step_seconds": 0.05, "samples": 32,
                    }),
                ]  # fmt: skip
                if step % self.backup_interval == 0:
                    batch.append(("backup.snapshot", {
                        "step": step, "shard": r, "nbytes": 4096,
                        "checksum": self._checksum(step, r), "seconds": 0.001,
                    }))  # fmt: skip
                    for shard in holds[member]:
                        batch.append(("backup.replicated", {
                            "step": step, "shard": shard, "owner": self.members[shard][0],
                            "nbytes": 4096, "checksum": self._checksum(step, shard),
                            "seconds": 0.002,
                        }))  # fmt: skip
                for type_, payload in batch:
                    if emitted == count:
                        return
                    yield self.envelope(source, type_, payload)
                    emitted += 1

    @staticmethod
    def _checksum(step: int, shard: int) -> str:
        return f"crc32:{(step * 2654435761 + shard * 40503) & 0xFFFFFFFF:08x}"

    @staticmethod
    def message(envelope: dict[str, Any]) -> tuple[str, bytes]:
        """The subject and bytes a member publishes ``envelope`` as."""
        node, _, member = envelope["source"].partition("/")
        subject = event_subject(envelope["job_id"], node, member, envelope["type"])
        return subject, json.dumps(envelope, separators=(",", ":")).encode()
