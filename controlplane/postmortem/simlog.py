"""A job's log made by a program, folded as it is made, and decided by the real decider.

``SimLog`` holds the events in log order with their positions and recording times, folds them
on demand (``core.fold``) and remembers what the fold did not believe. ``SimJob`` is a job of
many members on top of it: its launchers announce and join members, its ranks report
backups (packed as the store packs them), and ``turn`` takes the decider's turn at a given
time as the service takes it: the members' liveness (``core.liveness``) as heard up to then
(a member named in ``silent`` last heard at its time), and, if anything is due, the liveness
summary of the decision, then the decisions of ``core.decide`` on the view that folded it.
Both ``elasticctl simulate`` and the benches' generated histories run on it: what they
record is what the control plane would have recorded for the same member events.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from controlplane.core.catalog import CATALOG, CATALOG_INCARNATION
from controlplane.core.decide import Context, decide, envelope
from controlplane.core.fold import fold_noting
from controlplane.core.liveness import REGULAR_BEATS, Beats, LivenessTable, take_beats
from controlplane.core.records import StoredEvent
from controlplane.core.view import JobView, MemberStatus
from schemas.catalog import CatalogColumns
from schemas.common import CONTROLPLANE_SOURCE, Phase
from schemas.events import (
    CATALOG_ENTRIES,
    EVENT_ADAPTER,
    EVENT_CLASSES,
    BackupCatalog,
    BackupCatalogEvent,
    EnvelopeBase,
    PackedCatalog,
)
from schemas.ids import new_event_id

_MS = timedelta(milliseconds=1)
#: A backup report's seconds are drawn from 0.3 + _SPAN * [0, 1), as ``random.uniform``
#: draws them.
_SPAN = 0.6 - 0.3
#: The rendezvous the decisions of a made log name.
CONTEXT = Context(rendezvous="tcp://simulated:29400")


@dataclass(slots=True)
class Source:
    """One process's events: its source, incarnation and sequence."""

    source: str
    incarnation: str
    seq: int = 0


@dataclass(slots=True)
class SimLog:
    """A job's events, made in log order and folded as they are made (the decider decides on
    the folded view). ``take`` hands out what was made since its last call, with the
    positions the fold did not believe."""

    job_id: str
    position: int
    rng: random.Random
    view: JobView | None = None
    made: list[StoredEvent] = field(default_factory=list)
    unfolded: int = 0
    ignored: set[int] = field(default_factory=set)
    sources: dict[str, Source] = field(default_factory=dict)
    #: The control plane's own sequence (decisions, summaries).
    control: Source = field(default_factory=lambda: Source(CONTROLPLANE_SOURCE, "sim"))
    clock: datetime = field(default_factory=lambda: datetime.min.replace(tzinfo=UTC))

    @property
    def v(self) -> JobView:
        """The view of everything made (folded on demand)."""
        if self.unfolded:
            batch = self.made[len(self.made) - self.unfolded :]
            self.view, ignored = fold_noting(self.view, batch)
            self.ignored |= ignored
            self.unfolded = 0
        assert self.view is not None
        return self.view

    def add(self, events: list[EnvelopeBase], at: datetime) -> None:
        """Record ``events`` at ``at`` (never before what was recorded last)."""
        self.clock = at = max(at, self.clock)
        for event in events:
            self.position += 1
            self.made.append(StoredEvent(self.position, at, event))
        self.unfolded += len(events)

    def take(self) -> tuple[list[StoredEvent], frozenset[int]]:
        _ = self.v  # folded: a writer counts steps with what the fold ignored
        made, self.made = self.made, []
        ignored = frozenset(self.ignored)
        self.ignored = set()
        return made, ignored

    def source(self, member: str) -> Source:
        return self.sources[member]

    def event(
        self, source: Source, type_: str, payload: Any, at: datetime, generation: int
    ) -> EnvelopeBase:
        """An event of ``source``, built without validating again (``payload`` a model of
        the type's payload: the shapes are the schemas', made here)."""
        source.seq += 1
        return EVENT_CLASSES[type_].model_construct(
            event_id=new_event_id(), job_id=self.job_id, type=type_, v=1, source=source.source,
            incarnation=source.incarnation, seq=source.seq, generation=generation,
            emitted_at=at, payload=payload,
        )  # fmt: skip

    def validated(
        self, source: Source, type_: str, payload: dict[str, Any], at: datetime, generation: int
    ) -> EnvelopeBase:
        """An event of ``source`` through the schemas (the rare kinds)."""
        source.seq += 1
        return EVENT_ADAPTER.validate_python(
            {"event_id": new_event_id(), "job_id": self.job_id, "type": type_, "v": 1,
             "source": source.source, "incarnation": source.incarnation, "seq": source.seq,
             "generation": generation, "emitted_at": at, "payload": payload},
            strict=False,
        )  # fmt: skip

    def incarnation(self) -> str:
        return f"{self.rng.getrandbits(48):012x}"


class SimJob:
    """A job of many members on ``log``, started and recovered by the real decider; members
    heartbeat every ``beat_s`` (what ``turn`` hears of them)."""

    def __init__(self, log: SimLog, beat_s: float, *, pack: bool = True) -> None:
        self.log = log
        self.beat_s = beat_s
        #: Backups recorded as the store packs them (``PackedCatalog``); without, as version
        #: 1's lists (``BackupCatalog``): nothing to encode, for a log no one keeps
        #: (``elasticctl simulate``). The fold reads the same columns from either.
        self.pack = pack
        #: node -> its launcher's events.
        self.launchers: dict[str, Source] = {}
        #: member -> (node, rack).
        self.where: dict[str, tuple[str, str]] = {}
        #: Every member in order of joining.
        self.members: list[str] = []

    def launcher(self, node: str) -> Source:
        found = self.launchers.get(node)
        if found is None:
            found = self.launchers[node] = Source(f"{node}/launcher", self.log.incarnation())
        return found

    def join(
        self,
        names: list[tuple[str, str, str, str]],
        at: datetime,
        policy: dict[str, Any] | None = None,
    ) -> None:
        """Each of ``names`` (member, node, rack, role) announced by its node's launcher,
        then joined (the first asking for ``policy``)."""
        log = self.log
        launched, joined = [], []
        for i, (member, node, rack, role) in enumerate(names):
            log.sources[member] = Source(f"{node}/{member}", log.incarnation())
            self.where[member] = (node, rack)
            self.members.append(member)
            announced = {"member": member, "role": role, "pid": 1}
            launched.append(log.validated(self.launcher(node), "member.launched", announced, at, 0))
            payload: dict[str, Any] = {
                "node": node, "rack": rack, "host": f"host-{node}", "pid": 1, "role": role,
                "device": "cuda", "backup_endpoint": f"{node}:7000",
            }  # fmt: skip
            if i == 0 and policy is not None:
                payload["policy"] = policy
            joined.append(log.validated(log.source(member), "member.joined", payload, at, 0))
        log.add(launched + joined, at)

    def turn(self, now: datetime, silent: Mapping[str, datetime] | None = None) -> int:
        """The decider's turn at ``now``, as the service takes it: if anything is due (asked
        of the view with every active member heard until ``now``, or until its time in
        ``silent``), the liveness summary of the decision, then the decisions taken on the
        view that folded it. Return how many decisions were recorded.

        Members are heard as their launchers relay them (``node.heartbeat``, one message a
        node, ``core.liveness.take_beats``), once, at ``now``: a member in ``silent`` as
        last heard at its time (the relayed beat's age), the others just now."""
        log = self.log
        view = log.v
        silent = silent or {}
        since = now - timedelta(seconds=REGULAR_BEATS * self.beat_s)
        table = LivenessTable(since)
        # Each node's active members in columns, in one pass over the members (a turn at
        # 16,384 ranks relays 2,048 nodes).
        generation = view.generation
        columns: dict[str, tuple[list[str], list[str], list[int], list[int], list[Phase]]] = {}
        for member_id, member in view.members.items():
            if member.status is not MemberStatus.ACTIVE:
                continue
            found = columns.get(member.node)
            if found is None:
                found = columns[member.node] = ([], [], [], [], [])
            names, incarnations, generations, steps, phases = found
            names.append(member_id)
            incarnations.append(member.incarnation)
            steps.append(member.step)
            if member.rank is None:
                generations.append(member.generation)
                phases.append(Phase.WAITING)
            else:
                generations.append(generation)
                phases.append(Phase.TRAIN)
        for node, (names, incarnations, generations, steps, phases) in columns.items():
            zeros = [0] * len(names)
            ages = zeros
            if silent and not silent.keys().isdisjoint(names):
                ages = [
                    max(0, round((now - silent[name]) / _MS)) if name in silent else 0
                    for name in names
                ]
            relayed = Beats(log.job_id, node, names, incarnations, generations, steps, phases,
                            zeros, ages)  # fmt: skip
            take_beats(table, view, relayed, now)
        if not decide(table.probe(view), now, CONTEXT, rounds=1):
            return 0
        parts = table.summarize(view, now, "decision")
        log.add(
            [log.event(log.control, "liveness.summary", part, now, view.generation)
             for part in parts],
            now,
        )  # fmt: skip
        decided = decide(log.v, now, CONTEXT)
        events = []
        for d in decided:
            log.control.seq += 1
            events.append(envelope(log.job_id, d, now, log.control.seq, log.control.incarnation))
        log.add(events, now)
        return len(decided)

    def backup(self, step: int, at: datetime, nbytes: int = 1 << 30) -> None:
        """Every rank's report of its backup at ``step`` (its digest, the holders the
        placement names), in the catalogs the store packs them into (``core.catalog``: one
        per ``CATALOG_ENTRIES`` reports of a run), each report sequenced by its member."""
        log = self.log
        view = log.v
        generation, placement, world = view.generation, view.placement, view.world
        events: list[EnvelopeBase] = []
        prefix = log.rng.randbytes(28).hex()
        draw = log.rng.random
        for first in range(0, len(world), CATALOG_ENTRIES):
            shards = range(first, min(len(world), first + CATALOG_ENTRIES))
            sources = [log.source(world[shard]) for shard in shards]
            for source in sources:
                source.seq += 1
            columns = CatalogColumns(
                sources=[source.source for source in sources],
                incarnations=[source.incarnation for source in sources],
                seqs=[source.seq for source in sources],
                shards=list(shards),
                nbytes=[nbytes] * len(shards),
                # Distinct digests of the same shape (a digest a shard, new each backup).
                checksums=[f"sha256:{prefix}{shard:08x}" for shard in shards],
                # ``rng.uniform(0.3, 0.6)``'s draws, without its call per report.
                seconds=[round(0.3 + _SPAN * draw(), 6) for _ in shards],
                holders=[list(placement[shard]) for shard in shards],
            )
            payload = (PackedCatalog if self.pack else BackupCatalog).of(step, columns)
            events.append(BackupCatalogEvent.model_construct(
                event_id=new_event_id(), job_id=log.job_id, type=CATALOG,
                v=2 if self.pack else 1, source=CONTROLPLANE_SOURCE,
                incarnation=CATALOG_INCARNATION, seq=1, generation=generation, emitted_at=at,
                payload=payload,
            ))  # fmt: skip
        log.add(events, at)
