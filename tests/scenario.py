"""A job's log built step by step in tests, with the decider run the way the service runs it.

``Scenario`` keeps the stored log (positions, recorded times), the folded view, and a clock
that only moves when a test says so. ``decide()`` records what the decider returns at that
time exactly as the service does (one batch, the clock's time as ``recorded_at``).
"""

from __future__ import annotations

import itertools
import uuid
from datetime import datetime, timedelta
from typing import Any

from controlplane.core.decide import Context, Decided, decide, envelope
from controlplane.core.fold import fold
from controlplane.core.liveness import LivenessTable
from controlplane.core.records import StoredEvent
from controlplane.core.view import JobView
from schemas.common import CONTROLPLANE_SOURCE, JobState, Phase
from schemas.events import EVENT_CLASSES, EnvelopeBase, JobPolicy
from tests.factories import T0, Events

RENDEZVOUS = "tcp://controlplane:29400"


class Scenario:
    """One job: add member events at chosen times, decide, inspect the log and view."""

    def __init__(self, job_id: str = "job1", **policy: Any) -> None:
        self.job_id = job_id
        self.ev = Events(job_id)
        self.policy = JobPolicy(**policy)
        self.log: list[StoredEvent] = []
        self.view: JobView | None = None
        self.now: datetime = T0
        self.context = Context(rendezvous=RENDEZVOUS)
        self._cp_seq = itertools.count(1)
        #: member -> node, for sources.
        self.nodes: dict[str, str] = {}
        self._first_join = True

    # ------------------------------------------------------------------ clock and log

    def at(self, seconds: float) -> Scenario:
        """Move the clock to ``T0 + seconds`` (never backwards)."""
        moment = T0 + timedelta(seconds=seconds)
        assert moment >= self.now, "the clock only moves forward"
        self.now = moment
        return self

    def add(self, *events: EnvelopeBase) -> list[StoredEvent]:
        """Record member events at the current time and fold them."""
        stored = [
            StoredEvent(len(self.log) + i, self.now, e) for i, e in enumerate(events, start=1)
        ]
        self.log.extend(stored)
        self.view = fold(self.view, stored)
        return stored

    def decide(self) -> list[Decided]:
        """Run the decider at the current time and record its decisions as one batch."""
        assert self.view is not None
        decided = decide(self.view, self.now, self.context)
        if decided:
            self.add(
                *(envelope(self.job_id, d, self.now, next(self._cp_seq), "cp") for d in decided)
            )
        return decided

    @property
    def v(self) -> JobView:
        assert self.view is not None
        return self.view

    def of_type(self, type_: str) -> list[Any]:
        """Payloads of every recorded event of ``type_``."""
        return [s.event.payload for s in self.log if s.event.type == type_]

    # ------------------------------------------------------------------ member events

    def join(
        self,
        member: str,
        node: str,
        rack: str,
        role: str = "worker",
        *,
        policy: JobPolicy | None = None,
        announce: bool = True,
    ) -> None:
        """``member`` joins on ``node``, and its launcher announces it (``announce``; after
        the join, the order a fast member and a slow launcher give: it counts from then)."""
        self.nodes[member] = node
        payload: dict[str, Any] = {"role": role}
        if self._first_join:
            payload["policy"] = (policy or self.policy).model_dump(mode="json")
            self._first_join = False
        self.add(self.ev.joined(member, node=node, rack=rack, payload=payload))
        if announce:
            self.launched(member, node, role)

    def cluster(self, racks: int, nodes_per_rack: int, spares: int = 0) -> list[str]:
        """Join one worker per node over ``racks`` racks, then ``spares`` spares (rack by
        rack); return the workers in join order."""
        workers = []
        for r in range(racks):
            for n in range(nodes_per_rack):
                member = f"w{r}{n}" if racks < 10 and nodes_per_rack < 10 else f"w{r}.{n}"
                self.join(member, f"node-{r}-{n}", f"rack{r}")
                workers.append(member)
        for s in range(spares):
            r = s % racks
            self.join(f"spare{s}", f"spare-node-{s}", f"rack{r}", role="spare")
        return workers

    def launched(
        self, member: str, node: str, role: str = "worker", *, pid: int = 1, source: str = ""
    ) -> None:
        """The launcher of ``node`` (or ``source``) announces that it started ``member``."""
        self.add(
            self.ev.make(
                "member.launched",
                {"member": member, "role": role, "pid": pid},
                source=source or f"{node}/launcher",
            )
        )

    def _src(self, member: str) -> str:
        return f"{self.nodes[member]}/{member}"

    def _gen(self) -> int:
        return self.v.generation

    def heartbeat(self, *members: str, step: int = 0, phase: str = "train") -> None:
        self.add(
            *(
                self.ev.make(
                    "member.heartbeat",
                    {"step": step, "phase": phase},
                    source=self._src(m),
                    generation=self._gen(),
                )
                for m in members
            )
        )

    def heartbeat_all(self, step: int = 0, phase: str = "train") -> None:
        """A heartbeat from every active member."""
        alive = [m for m, member in self.v.members.items() if member.status.value == "active"]
        self.heartbeat(*alive, step=step, phase=phase)

    def exited(
        self, member: str, *, signal: int | None = 9, code: int | None = None, source: str = ""
    ) -> None:
        """The launcher of ``member``'s node (or ``source``) reports its exit."""
        self.add(
            self.ev.make(
                "member.exited",
                {"member": member, "signal": signal, "exit_code": code},
                source=source or f"{self.nodes[member]}/launcher",
            )
        )

    def fault(self, reporter: str, kind: str, suspects: list[str] | None = None) -> None:
        self.add(
            self.ev.make(
                "member.fault",
                {"kind": kind, "detail": "boom", "suspects": suspects or []},
                source=self._src(reporter),
                generation=self._gen(),
            )
        )

    def step(self, step: int, loss: float = 1.0) -> None:
        """Every member of the world reports ``step``."""
        self.add(
            *(
                self.ev.make(
                    "train.step",
                    {"step": step, "loss": loss, "step_seconds": 0.1, "samples": 8},
                    source=self._src(m),
                    generation=self._gen(),
                )
                for m in self.v.world
            )
        )

    def start_and_train(self, *, replicate: bool = True) -> Scenario:
        """Start generation 1 (the decider forms it; it must be RUNNING), everyone heartbeats
        at t=1, complete backups at steps 10 and 20, last step 23."""
        self.decide()
        assert self.v.state is JobState.RUNNING and self.v.generation == 1, self.v.state
        self.at(1)
        self.heartbeat_all()
        for step in (10, 20):
            self.step(step)
            self.backup(step, replicate=replicate)
        self.step(23)
        return self

    def backup(
        self, step: int, *, replicate: bool = True, named: bool = False, unheard: Any = ()
    ) -> None:
        """Every rank snapshots its shard at ``step``; holders named by the current
        placement replicate it (when ``replicate``), each reporting its copy, or the owner
        names them in its report (when ``named``, as the runtime does now). Nothing is heard
        of the shards of the owners in ``unheard``."""
        events = []
        for shard, owner in enumerate(self.v.world):
            if owner in unheard:
                continue
            checksum = f"crc32:{step:04x}{shard:04x}"
            payload: dict[str, Any] = {
                "step": step, "shard": shard, "nbytes": 100, "checksum": checksum,
                "seconds": 0.01,
            }  # fmt: skip
            if named:
                payload["holders"] = list(self.v.placement[shard])
            events.append(
                self.ev.make(
                    "backup.snapshot", payload, source=self._src(owner), generation=self._gen()
                )
            )
            if not replicate or named:
                continue
            for holder in self.v.placement[shard]:
                events.append(
                    self.ev.make(
                        "backup.replicated",
                        {"step": step, "shard": shard, "owner": owner, "nbytes": 100,
                         "checksum": checksum, "seconds": 0.01},
                        source=self._src(holder),
                        generation=self._gen(),
                    )
                )  # fmt: skip
        self.add(*events)

    def checkpoint(self, step: int) -> None:
        """Every rank reports its shard of a cold checkpoint at ``step``."""
        n = len(self.v.world)
        self.add(
            *(
                self.ev.make(
                    "checkpoint.saved",
                    {"step": step, "shard": shard, "shards": n, "path": f"/ckpt/{step}/{shard}",
                     "nbytes": 100, "checksum": "crc32:00", "seconds": 0.1},
                    source=self._src(owner),
                    generation=self._gen(),
                )
                for shard, owner in enumerate(self.v.world)
            )
        )  # fmt: skip

    def recover(self, *, members: list[str] | None = None, first_step: bool = True) -> None:
        """The world of the latest decision acks, restores and resumes (all, or
        ``members``), then takes its first step."""
        incident = self.v.incidents[self.v.open_incident or ""]
        decision = incident.decisions[-1]
        who = members if members is not None else list(decision.world)
        g = decision.generation
        for kind, payload in (
            ("command.acked", {"command_id": decision.command_id}),
            ("restore.completed", {"generation": g, "step": decision.restore_step,
                                   "bytes": 100, "seconds": 0.1}),
            ("train.resumed", {"generation": g, "step": decision.restore_step}),
        ):  # fmt: skip
            self.add(*(self.ev.make(kind, payload, source=self._src(m), generation=g) for m in who))
        if first_step:
            self.step(decision.restore_step + 1)


class SoftScenario(Scenario):
    """A scenario whose heartbeats are soft state, as the service keeps them: ``heartbeat``
    goes into the decider's in-memory table (no event), and ``decide`` runs as
    ``controlplane.decider.Decider.turn`` does: whether anything is due asked of the view
    with the table's heartbeats (``LivenessTable.probe``), and before a decision (or every
    ``liveness_summary_interval_s``) a ``liveness.summary`` recorded, the decision then taken
    on the view that folded it."""

    def __init__(self, job_id: str = "job1", **policy: Any) -> None:
        super().__init__(job_id, **policy)
        self.table = LivenessTable(started_at=self.now)

    def heartbeat(
        self,
        *members: str,
        step: int = 0,
        phase: str = "train",
        compute: float | dict[str, float] | None = None,
        step_seconds: float = 0.0,
        since: dict[str, float | None] | None = None,
        ready: dict[str, float | None] | None = None,
    ) -> None:
        """``compute``: each member's mean compute time per step since its previous
        heartbeat (one value for all, or by member; None: none reported); ``step_seconds``:
        the longest step each finished since; ``since``, ``ready``: by member, the seconds
        since its last step and since the next step's gradients were ready."""
        window_s = self.v.effective_policy.slow_window_s
        since, ready = since or {}, ready or {}
        for name in members:
            member = self.v.members[name]
            self.table.observe(
                self.job_id,
                name,
                node=member.node,
                incarnation=member.incarnation,
                generation=self._gen(),
                at=self.now,
                step=step,
                phase=Phase(phase),
                compute_seconds=compute.get(name) if isinstance(compute, dict) else compute,
                window_s=window_s,
                step_seconds=step_seconds,
                since_step_seconds=since.get(name),
                ready_seconds=ready.get(name),
            )

    def summarize(self, reason: str) -> None:
        parts = self.table.summarize(self.v, self.now, reason)
        self.add(
            *(
                EVENT_CLASSES["liveness.summary"](
                    event_id=str(
                        uuid.uuid5(uuid.NAMESPACE_URL, f"{self.job_id}/{len(self.log)}/{i}")
                    ),
                    job_id=self.job_id,
                    type="liveness.summary",
                    v=1,
                    source=CONTROLPLANE_SOURCE,
                    incarnation="cp",
                    seq=next(self._cp_seq),
                    generation=self.v.generation,
                    emitted_at=self.now,
                    payload=part,
                )
                for i, part in enumerate(parts)
            )
        )
        self.table.summarized(self.job_id, self.now, reason)

    def decide(self) -> list[Decided]:
        view = self.v
        if decide(self.table.probe(view), self.now, self.context, rounds=1):
            self.summarize("decision")
            return super().decide()
        interval = view.effective_policy.liveness_summary_interval_s
        if self.now >= self.table.summary_due(self.job_id, interval):
            self.summarize("interval")
        return []
