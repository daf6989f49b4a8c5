"""``elasticctl simulate``: a job's weeks on simulated members and a simulated clock, with every
incident decided by the real decider.

A job of ``ranks`` ranks (8 a node, 16 nodes a rack) and ``spares`` spare nodes runs for
``days``; failures are drawn from a process (``Rates``: crashes, hangs and node losses per
node-day, rack losses per rack-day; a preset from published figures, or a trace file), or
replayed from a trace. What happens next depends on the strategy:

- ``spares``, ``shrink``, ``mixed`` (hot backups in peer memory): the job's log is made as the
  control plane would record it (``simlog``: members announced and joined, a backup of every
  rank before a fault, the launcher's exit report of a crash, the silence of a hang or a lost
  node as the liveness table would hear it), and the real fold and decider (``core.fold``,
  ``core.decide``) decide it: who is found and when (a heartbeat timeout from the policy),
  which spare takes which rank, or how the world shrinks, and which backup it restores. The
  recovery's phases after the decision are timed by ``Model`` (ack, restore at
  ``transfer_gbps``, re-forming the group, the first step), and the new generation's first
  step is recorded then, which resolves the incident as in a live job. A lost node comes back
  after ``repair_s`` as a node of spares, which the decider may grow the world with at the
  next backup (``shrink``, ``mixed``). ``spares`` never shrinks: without a spare the job waits
  for a repair.
- ``restart`` (the baseline, no control plane): every failure restarts every process from the
  newest disk checkpoint (``restart_s`` + ``checkpoint_load_s``), checkpoints every
  ``checkpoint_interval_s`` of training costing ``checkpoint_cost_s`` each; a hang is found
  by the collective timeout (``restart_hang_detect_s``).

The wall time is cut into the terms of the goodput accounting (``core.goodput``):
``productive``, ``recomputation`` (steps done again after a restore to an older backup or
checkpoint), ``backup`` (the blocking copy of each backup or checkpoint), ``detection``,
``decision``, ``restore`` (ack and restore, or restart and checkpoint load), ``resume``
(re-forming the group and the first step), ``waiting`` (the job's start, and for a spare),
``shrunk`` (the capacity a smaller world leaves unused) and ``idle`` (the rest). ETTR is
productive time over wall time; the clock starts at the first generation's first step.

``plan`` checks what the command (and the API's plan view) asks for, a ``Plan`` lists its
runs, ``run_plan`` runs them (side by side in processes: ``run_all``) and shapes the command's
JSON. ``REPRODUCTIONS`` are published figures with the runs that reproduce them and what each
had to assume (``reproduce``).

Failures during an incident's recovery are applied when it ends (a cascade is not
simulated). Pure apart from the decider's own work: time is an argument, randomness comes
from the seed, and the same inputs give the same result.
"""

from __future__ import annotations

import functools
import json
import math
import multiprocessing
import os
import random
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from dataclasses import asdict, dataclass, field, replace
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, Final, Literal

from controlplane import gctune
from controlplane.core.view import MAX_STEP_LEAD
from controlplane.postmortem.simlog import SimJob, SimLog
from schemas.common import MAX_WORLD, JobState
from schemas.events import TrainStep

Strategy = Literal["spares", "shrink", "mixed", "restart"]
STRATEGIES: Final[tuple[Strategy, ...]] = ("spares", "shrink", "mixed", "restart")
KINDS: Final = ("crash", "hang", "node", "rack")
#: Ranks a node hosts, and nodes a rack holds.
NODE_RANKS: Final = 8
RACK_NODES: Final = 16
#: The breakdown's terms, in the order they are shown.
TERMS: Final = (
    "productive",
    "recomputation",
    "backup",
    "detection",
    "decision",
    "restore",
    "resume",
    "waiting",
    "shrunk",
    "idle",
)
#: The simulated clock's origin.
EPOCH: Final = datetime(2026, 1, 1, tzinfo=UTC)
_DAY: Final = 86_400.0


@dataclass(frozen=True, slots=True)
class Rates:
    """Failures per node-day (crash: a process exits; hang: a process stops, silent; node: a
    node and its launcher are lost) and per rack-day (rack: every node of a rack)."""

    crash: float = 0.0
    hang: float = 0.0
    node: float = 0.0
    rack: float = 0.0

    def per_day(self, nodes: int, racks: int) -> float:
        """Failures a day of ``nodes`` nodes in ``racks`` racks."""
        return (self.crash + self.hang + self.node) * nodes + self.rack * racks


def _split(per_node_day: float) -> Rates:
    """A total rate split as the presets assume: 70% processes that exit (GPU, memory and
    software errors), 10% hangs, 20% whole nodes (host, network, power)."""
    return Rates(crash=0.7 * per_node_day, hang=0.1 * per_node_day, node=0.2 * per_node_day)


@dataclass(frozen=True, slots=True)
class Preset:
    rates: Rates
    source: str


PRESETS: Final[dict[str, Preset]] = {
    "llama3": Preset(
        _split(419 / 54 / 2048),
        "Llama 3 (Dubey et al., 2024): 419 unexpected interruptions in 54 days on 16,384"
        " GPUs (2,048 nodes of 8)",
    ),
    "rsc": Preset(
        _split(24 / 1.8 / 2048),
        "Kokolis et al., HPCA'25: mean time to failure 1.8 h at 16,384 GPUs",
    ),
    "seed512": Preset(_split(8 / 64), "8 failures a day on 512 GPUs (64 nodes of 8)"),
    "none": Preset(Rates(), "no failures"),
}


@dataclass(frozen=True, slots=True)
class Model:
    """The job and its recovery, in seconds unless said (docs/simulate.md says where each
    default comes from)."""

    step_s: float = 2.0
    #: Hot backups: every this many steps, each blocking the loop ``backup_cost_s``.
    backup_interval: int = 10
    backup_cost_s: float = 0.05
    #: Detection: a crash's exit reported by its launcher; a silent member found by the
    #: policy's heartbeat timeout in training.
    exit_report_s: float = 0.05
    heartbeat_interval_s: float = 1.0
    heartbeat_timeout_s: float = 5.0
    #: The decider's turn (fault to decision recorded).
    decide_s: float = 0.12
    #: After the decision: every rank's ack, the restore of ``state_gb`` per rank from peer
    #: memory at ``transfer_gbps``, re-forming the group, then the first step.
    ack_s: float = 0.1
    state_gb: float = 1.0
    transfer_gbps: float = 10.0
    reinit_s: float = 20.0
    #: A lost node comes back (as spares) after this long; a lost process's launcher starts
    #: a new one (a spare) after ``respawn_s``.
    repair_s: float = 12 * 3600.0
    respawn_s: float = 60.0
    #: Checkpoint-restart: restart every process, load the checkpoint, checkpoint every
    #: ``checkpoint_interval_s`` of training at ``checkpoint_cost_s`` each; a hang is found by
    #: the collective timeout.
    restart_s: float = 600.0
    checkpoint_load_s: float = 120.0
    checkpoint_interval_s: float = 1800.0
    checkpoint_cost_s: float = 20.0
    restart_hang_detect_s: float = 600.0

    def recovery_s(self) -> tuple[float, float]:
        """(restore, resume) after a decision: ack + restore, re-form + first step."""
        return self.ack_s + self.state_gb / self.transfer_gbps, self.reinit_s + self.step_s

    def backup_share(self) -> float:
        """The fraction of training time the hot backups block."""
        return self.backup_cost_s / (self.backup_interval * self.step_s + self.backup_cost_s)


def model_with(model: Model, overrides: Mapping[str, object]) -> Model:
    """``model`` with fields set (``--model step_s=4,repair_s=3600``): positive numbers,
    whole ones for whole fields."""
    values: dict[str, Any] = {}
    for key, given in overrides.items():
        if key not in Model.__dataclass_fields__:
            known = ", ".join(Model.__dataclass_fields__)
            raise ValueError(f"unknown model field {key!r}; known: {known}")
        try:
            value = float(str(given))
        except ValueError:
            raise ValueError(f"{key}={given!r}: not a number") from None
        if not math.isfinite(value) or value <= 0:
            raise ValueError(f"{key}={given!r}: must be a positive number")
        if isinstance(getattr(model, key), int):
            if value != int(value):
                raise ValueError(f"{key}={given!r}: must be a whole number")
            values[key] = int(value)
        else:
            values[key] = value
    return replace(model, **values)


@dataclass(frozen=True, slots=True)
class Reproduction:
    """A published figure and the run that reproduces it, its assumptions in the open:
    ETTR (``ettr``; ``above``: the figure is a lower bound) and the recovery a failure
    costs (``recovery_s``: detection to the first step, a wait for a spare left out), each
    None where the source gives none, within ``tolerance`` (relative)."""

    claim: str
    source: str
    strategy: Strategy
    ranks: int
    days: float
    preset: str
    spares: int
    model: Mapping[str, float]
    ettr: float | None
    recovery_s: float | None
    assumptions: str
    above: bool = False
    tolerance: float = 0.2


_SEED_TABLE = (
    "the project's seed: 512 GPUs, 8 failures a day; recovery 45 min / 3 min / 90 s and"
    " utilization 42% / 78% / 89% for checkpoint-restart / hot backup + rebuild / hot backup"
    " + elastic scheduling"
)

REPRODUCTIONS: Final[dict[str, Reproduction]] = {
    "seed512-restart": Reproduction(
        claim="checkpoint-restart: 45 min a recovery, 42% utilization",
        source=_SEED_TABLE, strategy="restart", ranks=512, days=30, preset="seed512",
        spares=0, ettr=0.42, recovery_s=2700.0,
        model={"restart_s": 2400, "checkpoint_load_s": 300, "checkpoint_interval_s": 10_800,
               "checkpoint_cost_s": 60},
        assumptions="restart and checkpoint load 45 min; the seed gives no checkpoint"
        " interval: 42% needs one every 3 h (at Young/Daly's 19 min for a 1-minute checkpoint,"
        " 72%); a hang or a lost node is found by the 10-minute collective timeout",
    ),
    "seed512-rebuild": Reproduction(
        claim="hot backup + rebuild: 3 min a recovery, 78% utilization",
        source=_SEED_TABLE, strategy="spares", ranks=512, days=30, preset="seed512",
        spares=1, ettr=0.78, recovery_s=180.0, model={"reinit_s": 170},
        assumptions="one spare node; a lost node is rebuilt in 12 h and the job waits for it"
        " when no spare is left (the waits are most of what is lost); re-forming the group"
        " 170 s makes the recovery 3 min",
    ),
    "seed512-elastic": Reproduction(
        claim="hot backup + elastic scheduling: 90 s a recovery, 89% utilization",
        source=_SEED_TABLE, strategy="mixed", ranks=512, days=30, preset="seed512",
        spares=1, ettr=0.89, recovery_s=90.0, model={"reinit_s": 80},
        assumptions="one spare node, then the world shrinks by a replica (a node) and grows"
        " back after the repair; re-forming the group 80 s makes the recovery 90 s. The"
        " simulation finds more (about 98%): the seed's figure counts losses it does not"
        " state",
    ),
    "llama3-restart": Reproduction(
        claim="Llama 3: effective training time above 90% with checkpoint-restart",
        source="Dubey et al., 2024: 419 unexpected interruptions in 54 days on 16,384 GPUs",
        strategy="restart", ranks=16_384, days=54, preset="llama3", spares=0, ettr=0.90,
        recovery_s=None, above=True,
        model={"restart_s": 300, "checkpoint_load_s": 60, "restart_hang_detect_s": 60,
               "checkpoint_interval_s": 667, "checkpoint_cost_s": 20},
        assumptions="the paper gives no restart time or checkpoint interval: above 90% needs"
        " a restart and load within about 6 min, hangs found within a minute (NCCL's flight"
        " recorder, not its 10-minute timeout) and a 20 s checkpoint at Young/Daly's interval"
        " for the MTBF of 3.1 h (667 s); with the defaults (10 min + 2 min, hangs found by"
        " the 10-minute timeout, 30-minute checkpoints), 83%",
    ),
}  # fmt: skip


def reproduce(
    name: str, *, seed: int = 0, progress: Callable[[float], None] | None = None
) -> dict[str, Any]:
    """Run reproduction ``name``: the published figures, the simulated ones, and whether
    each is within the tolerance (at or above, for a lower bound)."""
    case = REPRODUCTIONS[name]
    model = model_with(Model(), case.model)
    result = simulate(case.strategy, ranks=case.ranks, days=case.days, spares=case.spares,
                      rates=PRESETS[case.preset].rates, model=model, seed=seed,
                      progress=progress)  # fmt: skip
    spent = [
        sum(v for k, v in i.phases.items() if k != "waiting")
        for i in result.incidents
        if i.kind != "growth"
    ]
    simulated = {
        "ettr": round(result.ettr, 4),
        "recovery_s": round(sum(spent) / len(spent), 1) if spent else None,
    }
    published = {"ettr": case.ettr, "recovery_s": case.recovery_s}
    within: dict[str, bool] = {}
    for key, figure in published.items():
        value = simulated[key]
        if figure is None or value is None:
            continue
        close = abs(value - figure) <= case.tolerance * figure
        within[key] = value >= figure if case.above and key == "ettr" else close
    return {
        "name": name, "claim": case.claim, "source": case.source,
        "assumptions": case.assumptions, "strategy": case.strategy, "ranks": case.ranks,
        "days": case.days, "seed": seed, "tolerance": case.tolerance, "above": case.above,
        "published": published, "simulated": simulated, "within": within,
        "run": result.summary(),
    }  # fmt: skip


@dataclass(frozen=True, slots=True)
class Failure:
    """A failure at ``at_s`` seconds into the job: its kind and the node (or rack) it hits."""

    at_s: float
    kind: str
    target: int


def draw(rates: Rates, nodes: int, racks: int, seconds: float, seed: int) -> list[Failure]:
    """Failures of a Poisson process per kind over ``seconds`` (targets uniform), in time
    order; the same seed gives the same failures."""
    rng = random.Random(seed)
    out: list[Failure] = []
    for kind in KINDS:
        count = racks if kind == "rack" else nodes
        rate = getattr(rates, kind) * count / _DAY
        if rate <= 0:
            continue
        at = rng.expovariate(rate)
        while at < seconds:
            out.append(Failure(at, kind, rng.randrange(count)))
            at += rng.expovariate(rate)
    out.sort(key=lambda f: (f.at_s, KINDS.index(f.kind), f.target))
    return out


def read_trace(path: Path) -> list[Failure]:
    """A failure trace: one JSON object a line, ``{"at_s": 3600.5, "kind": "crash", "node":
    12}`` (``"rack"`` for a rack's loss); raise ``ValueError`` naming the bad line."""
    out: list[Failure] = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
            kind = item["kind"]
            target = int(item["rack"] if kind == "rack" else item["node"])
            at = float(item["at_s"])
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{path}:{number}: {exc!r}: expected at_s, kind, node") from None
        if kind not in KINDS or not math.isfinite(at) or at < 0 or target < 0:
            raise ValueError(f"{path}:{number}: kind one of {', '.join(KINDS)}, at_s >= 0")
        out.append(Failure(at, kind, target))
    out.sort(key=lambda f: (f.at_s, KINDS.index(f.kind), f.target))
    return out


@dataclass(slots=True)
class Incident:
    """One incident as simulated: what failed, how it was found, and its phases."""

    at_s: float
    kind: str
    members: int
    reason: str
    mode: str
    downtime_s: float
    steps_lost: int
    phases: dict[str, float]


@dataclass(slots=True)
class Result:
    """A simulated run: ETTR, the breakdown of its wall time, incidents."""

    strategy: str
    ranks: int
    days: float
    seed: int
    failures: dict[str, int]
    breakdown: dict[str, float]
    incidents: list[Incident] = field(default_factory=list)
    spares_used: int = 0
    decisions: int = 0
    final_world: int = 0
    #: Why the decider stopped the job (None: it ran to the end); the rest is idle.
    stopped: str | None = None
    seconds: float = 0.0

    @property
    def wall_s(self) -> float:
        return self.days * _DAY

    @property
    def ettr(self) -> float:
        return self.breakdown["productive"] / self.wall_s

    def summary(self) -> dict[str, Any]:
        downtimes = [i.downtime_s for i in self.incidents]
        return {
            "strategy": self.strategy, "ranks": self.ranks, "days": self.days,
            "seed": self.seed, "ettr": round(self.ettr, 6),
            "breakdown_s": {k: round(v, 3) for k, v in self.breakdown.items()},
            "failures": self.failures, "incidents": len(self.incidents),
            "mean_downtime_s": round(sum(downtimes) / len(downtimes), 3) if downtimes else None,
            "max_downtime_s": round(max(downtimes), 3) if downtimes else None,
            "steps_lost": sum(i.steps_lost for i in self.incidents),
            "decisions": self.decisions, "spares_used": self.spares_used,
            "final_world": self.final_world, "stopped": self.stopped,
            "simulated_in_s": round(self.seconds, 2),
        }  # fmt: skip


def _new_result(strategy: str, ranks: int, days: float, seed: int) -> Result:
    return Result(strategy, ranks, days, seed, {k: 0 for k in KINDS}, dict.fromkeys(TERMS, 0.0))


# ------------------------------------------------------------------------- restart-all


def simulate_restart(
    ranks: int, days: float, failures: Sequence[Failure], model: Model, seed: int = 0
) -> Result:
    """Checkpoint-restart: every failure costs detection, a restart of every process and a
    checkpoint load, and the training since the newest checkpoint."""
    result = _new_result("restart", ranks, days, seed)
    terms = result.breakdown
    end = days * _DAY
    interval, cost = model.checkpoint_interval_s, model.checkpoint_cost_s
    t = 0.0  # training (re)started here, from a checkpoint
    nodes = math.ceil(ranks / NODE_RANKS)
    for failure in failures:
        if failure.at_s < t:
            continue  # the job was down: the failure is absorbed by the restart under way
        if failure.at_s >= end:
            break
        if failure.kind == "rack":
            if failure.target * RACK_NODES >= nodes:
                continue  # a rack of no node of the job's
        elif failure.target >= nodes:
            continue  # a spare node's: a restart-all job has none
        result.failures[failure.kind] += 1
        trained = failure.at_s - t
        saved = math.floor(trained / (interval + cost))
        terms["productive"] += saved * interval
        terms["backup"] += saved * cost
        terms["recomputation"] += trained - saved * (interval + cost)
        detect = model.exit_report_s if failure.kind == "crash" else model.restart_hang_detect_s
        phases = {"detection": detect, "restore": model.restart_s + model.checkpoint_load_s}
        down = sum(phases.values())
        for term, seconds in phases.items():
            terms[term] += seconds
        lost = trained - saved * (interval + cost)
        result.incidents.append(
            Incident(failure.at_s, failure.kind, NODE_RANKS if failure.kind != "crash" else 1,
                     "restart", "restart", down, round(lost / model.step_s), phases)
        )  # fmt: skip
        t = failure.at_s + down
    if t < end:  # the last stretch: its work counts, its checkpoints cost
        trained = end - t
        saved = math.floor(trained / (interval + cost))
        terms["backup"] += saved * cost
        terms["productive"] += trained - saved * cost
    else:
        _end_down(result, t - end)
    result.final_world = ranks
    return result


# -------------------------------------------------------- hot backups, the real decider


@dataclass(slots=True)
class _Fault:
    """A failure the decider is to recover from: when, what, how many members, the phases
    so far (detection, decision, waiting)."""

    at_s: float
    kind: str
    members: int
    phases: dict[str, float]
    #: Since when it waits for a spare (None: not waiting).
    waiting_since: float | None = None


class _Run:
    """A job on the real decider (see the module docstring)."""

    def __init__(
        self,
        strategy: Strategy,
        *,
        ranks: int,
        spares: int,
        days: float,
        model: Model,
        seed: int,
        every_turn: bool = False,
        pack: bool = True,
    ) -> None:
        self.strategy, self.ranks, self.model = strategy, ranks, model
        #: Take the decider's turn at every repair, as the service does; by default only
        #: where the decider can decide (see ``repair``).
        self.every_turn = every_turn
        self.result = _new_result(strategy, ranks, days, seed)
        self.end = days * _DAY
        self.rng = random.Random(seed + 1)
        self.log = SimLog(f"sim-{strategy}", 0, random.Random(seed))
        self.job = SimJob(self.log, model.heartbeat_interval_s, pack=pack)
        self.workers = math.ceil(ranks / NODE_RANKS)
        self.nodes = self.workers + spares
        #: node -> its live members (its current processes); nodes down, and their repairs.
        self.on_node: dict[int, list[str]] = {}
        self.down: set[int] = set()
        self.repairs: list[tuple[float, int, int]] = []
        self.rejoins = 0
        #: The job's step (``base`` and the steps trained since, ``progress``), the time
        #: trained to, and whether the world is training.
        self.step = self.base = 0
        self.progress = 0.0
        self.step_at = 0.0
        self.training = False
        #: The newest generation whose first step was recorded, the newest backup recorded.
        self.stepped = 0
        self.backed_up = 0
        #: A fault not recovered yet (the job waits for a spare).
        self.waiting: _Fault | None = None
        #: When the decider is to look at growing a smaller world with new spares.
        self.growth_due: float | None = None

    def at(self, seconds: float) -> datetime:
        return EPOCH + timedelta(seconds=seconds)

    # training -----------------------------------------------------------------------------

    def advance(self, to: float) -> None:
        """Train from ``step_at`` to ``to``: productive time, the backups' share of it, the
        capacity a smaller world leaves unused (continuous: a step's time counts as it
        passes), and the steps done."""
        if to <= self.step_at:
            return
        span, self.step_at = to - self.step_at, to
        if not self.training:
            return
        model = self.model
        share = len(self.log.v.world) / self.ranks
        blocked = span * model.backup_share()
        terms = self.result.breakdown
        terms["productive"] += (span - blocked) * share
        terms["shrunk"] += (span - blocked) * (1 - share)
        terms["backup"] += blocked
        self.progress += span / (model.step_s + model.backup_cost_s / model.backup_interval)
        self.step = self.base + math.floor(self.progress)

    def record_step(self, seconds: float, *, backup: bool = True) -> None:
        """What the log holds of training up to ``seconds``: the newest backup (every rank's
        report; not with ``backup`` false, when no decision is to restore it) and rank 0's
        step record."""
        self.advance(seconds)
        view = self.log.v
        if not self.training or not view.world:
            return
        at = self.at(seconds)
        # Rank 0 records every step; these records stand for them: no two more than the
        # fold's plausible lead apart.
        per = self.model.step_s + self.model.backup_cost_s / self.model.backup_interval
        mark = view.last_step
        while self.step - mark > MAX_STEP_LEAD:
            mark += MAX_STEP_LEAD
            then = self.at(self.step_at - (self.step - mark) * per)
            self._step_record(mark, then, view.generation, view.world[0])
        newest = self.step - self.step % self.model.backup_interval
        if backup and newest > self.backed_up:
            self.job.backup(newest, at)
            self.backed_up = newest
        if self.step > view.last_step:
            self._step_record(self.step, at, view.generation, view.world[0])

    def _step_record(self, step: int, at: datetime, generation: int, member: str) -> None:
        payload = TrainStep.model_construct(step=step, loss=1.0, step_seconds=self.model.step_s,
                                            samples=8)  # fmt: skip
        source = self.log.source(member)
        self.log.add([self.log.event(source, "train.step", payload, at, generation)], at)

    # the job -------------------------------------------------------------------------------

    def start(self) -> None:
        """Join every node's members (the first asks for the policy); the decider starts the
        first generation, which steps once the group formed."""
        model = self.model
        policy = {
            "world_size": self.ranks, "max_world": self.ranks,
            # Data parallel over nodes, tensor parallel in each: a replica is a node's eight
            # ranks (min_world counts replicas).
            "mesh": {"dims": [["dp", self.ranks // NODE_RANKS], ["tp", NODE_RANKS]],
                     "node_local": ["tp"]},
            "min_world": self.workers if self.strategy == "spares" else 1,
            "backup_interval": model.backup_interval, "redundancy": 2,
            "heartbeat_interval_s": model.heartbeat_interval_s,
            "heartbeat_timeout_s": {"train": model.heartbeat_timeout_s},
            "recovery_deadline_s": max(60.0, 2 * model.repair_s),
            # Slowdowns are not simulated: no compute times to keep per member.
            "slow_window_s": 0,
        }  # fmt: skip
        names: list[tuple[str, str, str, str]] = []
        for node in range(self.nodes):
            spare = node >= self.workers
            count = NODE_RANKS if spare else min(NODE_RANKS, self.ranks - node * NODE_RANKS)
            members = [f"n{node}-{k}" for k in range(count)]
            self.on_node[node] = members
            rack = f"r{node // RACK_NODES}"
            names += [(m, f"n{node}", rack, "spare" if spare else "worker") for m in members]
        self.job.join(names, self.at(0), policy)
        # A turn may only register the job (its policy is then in force): the service takes
        # the next one at once, as anything is due.
        for _ in range(3):
            if not self.job.turn(self.at(0)) or self.log.v.generation:
                break
        if self.log.v.generation != 1:
            raise RuntimeError("the decider did not start the simulated job")
        # The clock starts with the first generation's first step (the job's start is not
        # what is simulated).
        self._first_step(0.0)

    def _first_step(self, seconds: float) -> None:
        """The newest generation's first step at ``seconds``, and the turn it wakes."""
        view = self.log.v
        self.step = self.base = self.step + 1
        self.progress = 0.0
        self.step_at = seconds
        self._step_record(self.step, self.at(seconds), view.generation, view.world[0])
        self.stepped = view.generation
        self.training = True
        self.job.turn(self.at(seconds))  # the job is running again (a decision)

    def fail(self, failure: Failure) -> None:
        """``failure`` at its time: record what the control plane would hear, take the
        decider's turn when it would find it, recover."""
        now = failure.at_s
        targets = (
            [n for n in range(self.nodes) if n // RACK_NODES == failure.target]
            if failure.kind == "rack"
            else [failure.target]
            if failure.target < self.nodes
            else []
        )
        nodes = [n for n in targets if n not in self.down]
        active = [m for n in nodes for m in self.on_node.get(n, ())]
        if not active:
            return  # a node already down, or one with no process of the job
        self.result.failures[failure.kind] += 1
        self.record_step(now)
        model = self.model
        if failure.kind == "crash":
            victims = [self.rng.choice(active)]
            found = now + model.exit_report_s
            exited = {"member": victims[0], "signal": 9}
            launcher = self.job.launcher(self.job.where[victims[0]][0])
            event = self.log.validated(launcher, "member.exited", exited, self.at(found), 0)
            self.log.add([event], self.at(found))
            silent: dict[str, datetime] = {}
        else:
            victims = [self.rng.choice(active)] if failure.kind == "hang" else active
            silent = {m: self.at(now) for m in victims}
            # Found at the first turn past the timeout (the service wakes at the deadline).
            found = now + model.heartbeat_timeout_s + model.heartbeat_interval_s
        for m in victims:
            for members in self.on_node.values():
                if m in members:
                    members.remove(m)
                    break
        if failure.kind in ("node", "rack"):
            for n in nodes:
                self.down.add(n)
                self.repairs.append((now + model.repair_s, n, NODE_RANKS))
        else:  # its launcher starts a new process in the lost one's place, as a spare
            node = int(self.job.where[victims[0]][0][1:])
            self.repairs.append((found + model.decide_s + model.respawn_s, node, 1))
        self.repairs.sort()
        in_world = bool(set(self.log.v.world) & set(victims))
        if in_world:
            self.training = False
        self.job.turn(self.at(found + model.decide_s), silent)
        if not in_world:  # spares lost: the pool is smaller (the turn may have grown it)
            self._recover(found + model.decide_s, None)
            return
        phases = {"detection": found - now, "decision": model.decide_s}
        self._recover(found + model.decide_s, _Fault(now, failure.kind, len(victims), phases))

    def repair(self, node: int, seconds: float, count: int) -> None:
        """``node`` is back (``count`` of a node's processes), or its launcher started a new
        process for a lost one (1): spares, which the decider may take (a waiting job), or
        grow a smaller world with at the next backup."""
        if node in self.down and count < NODE_RANKS:
            return  # the node was lost since: its repair brings the processes back
        self.down.discard(node)
        self.rejoins += 1
        members = [f"n{node}-r{self.rejoins}-{k}" for k in range(count)]
        self.on_node.setdefault(node, []).extend(members)
        # Spares joining restore nothing: the backup a waiting job restores was recorded
        # before its fault (it has not trained since), and a growth records its own.
        self.record_step(seconds, backup=False)
        rack = f"r{node // RACK_NODES}"
        self.job.join([(m, f"n{node}", rack, "spare") for m in members], self.at(seconds))
        # Spares joining change a decision only for a job that waits for them (a smaller
        # world grows at a backup, ``backup_turn``): the turn, which costs a liveness table
        # of every member, is taken then, or when asked (a test checks that the decisions
        # are the same either way).
        if self.every_turn or self.waiting is not None:
            self.job.turn(self.at(seconds))
            self._recover(seconds, self.waiting)
        if self.strategy != "spares" and len(self.log.v.world) < self.ranks:
            # Growth waits for a backup newer than the spares' joining.
            self.growth_due = self.step_at + (self.model.backup_interval + 1) * self.model.step_s

    def backup_turn(self, seconds: float) -> None:
        """A turn at a backup boundary (growth is decided at a backup newer than the spares
        that wait to join)."""
        self.record_step(seconds)
        self.job.turn(self.at(seconds))
        self._recover(seconds, None)

    def _recover(self, seconds: float, fault: _Fault | None) -> None:
        """After a turn at ``seconds``: a new generation decided recovers (the model's phases,
        then its first step, whose turn resolves the incident); without one, a fault's job
        waits for a spare."""
        view = self.log.v
        waiting = self.waiting
        if fault is not None and waiting is not None and fault is not waiting:
            # Down already, waiting for spares: a failure now is part of the same stop (its
            # detection and decision overlap the wait, counted once).
            waiting.members += fault.members
            fault = waiting
        if view.generation <= self.stepped:
            if fault is not None and fault.waiting_since is None:
                fault.waiting_since = seconds
                self.waiting = fault
            return
        found = [
            (incident, d)
            for incident in reversed(view.incidents.values())
            for d in incident.decisions
            if d.generation == view.generation
        ]
        if not found:
            raise RuntimeError(f"generation {view.generation} began without a decision")
        incident, decision = found[0]
        model = self.model
        terms = self.result.breakdown
        if fault is None:  # a growth: the world stops at its backup
            fault = _Fault(seconds, "growth", len(view.world) - len(decision.world), {})
        elif fault.waiting_since is not None:
            fault.phases["waiting"] = seconds - fault.waiting_since
        self.waiting = None
        self.advance(seconds)
        lost = max(0, self.step - decision.restore_step)
        restore, resume = model.recovery_s()
        fault.phases.update(restore=restore, resume=resume)
        for term, value in fault.phases.items():
            terms[term] += value
        # The steps after the restored backup are done again: their time was not productive.
        done_again = lost * model.step_s
        terms["recomputation"] += done_again
        terms["productive"] -= done_again
        self.step = decision.restore_step
        self.backed_up = min(self.backed_up, decision.restore_step)
        self.training = False
        first = seconds + restore + resume
        self.result.decisions += len(incident.decisions)
        self.result.incidents.append(
            Incident(fault.at_s, fault.kind, fault.members, "; ".join(incident.reasons)[:200],
                     str(decision.mode), first - fault.at_s, lost, dict(fault.phases))
        )  # fmt: skip
        self._first_step(first)


def _drive(
    run: _Run,
    failures: Sequence[Failure],
    keep: bool,
    progress: Callable[[float], None] | None,
) -> None:
    """Run the started job through ``failures``, the repairs and growths they bring, to its
    end (or its stop)."""
    queue = list(failures)
    i = 0
    while True:
        due_failure = queue[i].at_s if i < len(queue) else math.inf
        due_repair = run.repairs[0][0] if run.repairs else math.inf
        due_growth = run.growth_due if run.growth_due is not None else math.inf
        nxt = min(due_failure, due_repair, due_growth)
        # What happens during a recovery happens when it ends (no cascades).
        when = max(nxt, run.step_at)
        if when >= run.end or run.log.v.state is JobState.STOPPED:
            break
        if nxt == due_repair:
            _, node, count = run.repairs.pop(0)
            run.repair(node, when, count)
        elif nxt == due_failure:
            i += 1
            run.fail(replace(queue[i - 1], at_s=when))
        else:
            run.growth_due = None
            run.backup_turn(when)
        if not keep:
            run.log.take()
        if progress is not None:
            progress(min(1.0, nxt / run.end))


def simulate_decider(
    strategy: Strategy,
    *,
    ranks: int,
    spares: int,
    days: float,
    failures: Sequence[Failure],
    model: Model,
    seed: int = 0,
    progress: Callable[[float], None] | None = None,
    keep: bool = True,
    every_turn: bool = False,
) -> tuple[Result, SimLog]:
    """A run of a hot-backup strategy on the real decider (see the module docstring); the
    result and the log it made (what the control plane would have recorded; with ``keep``
    false, only what was made since the last failure, repair or growth, its backups' catalogs
    not packed: a long run's log does not fit in memory, and no one reads it)."""
    began = time.perf_counter()
    run = _Run(strategy, ranks=ranks, spares=spares, days=days, model=model, seed=seed,
               every_turn=every_turn, pack=keep)  # fmt: skip
    # The run keeps a job's views alive (hundreds of thousands of objects at 16,384 ranks)
    # and makes almost no reference cycles: the collector, walking them, took 40% of it.
    with gctune.held_off():
        run.start()
        _drive(run, failures, keep, progress)
    run.advance(run.end)
    view = run.log.v
    result = run.result
    _end_down(result, run.step_at - run.end)
    _close(result)
    result.final_world = len(view.world)
    if view.state is JobState.STOPPED:
        result.stopped = view.history[-1].reason
    result.spares_used = sum(1 for m in view.world if view.members[m].role == "spare")
    result.seconds = time.perf_counter() - began
    return result, run.log


def simulate(
    strategy: Strategy,
    *,
    ranks: int,
    days: float,
    spares: int = 2,
    failures: Sequence[Failure] | None = None,
    rates: Rates | None = None,
    model: Model = Model(),
    seed: int = 0,
    progress: Callable[[float], None] | None = None,
) -> Result:
    """One strategy's run (failures drawn from ``rates`` with ``seed`` unless given)."""
    # Drawn over the job's nodes and the spares, whatever the strategy: the strategies of
    # one seed meet the same failures (a spare node's hits no job without spares).
    nodes = math.ceil(ranks / NODE_RANKS) + spares
    racks = math.ceil(nodes / RACK_NODES)
    if failures is None:
        failures = draw(rates or Rates(), nodes, racks, days * _DAY, seed)
    if strategy == "restart":
        began = time.perf_counter()
        result = simulate_restart(ranks, days, failures, model, seed)
        _close(result)
        result.seconds = time.perf_counter() - began
        return result
    used = spares if strategy in ("spares", "mixed") else 0
    result, _ = simulate_decider(strategy, ranks=ranks, spares=used, days=days,
                                 failures=failures, model=model, seed=seed,
                                 progress=progress, keep=False)  # fmt: skip
    return result


def cores() -> int:
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


#: A worker's view of the runs' progress (shared memory, one fraction a run).
_SHARED: Any = None


def _share(shared: Any) -> None:
    global _SHARED  # noqa: PLW0603  (a worker process's one handle, set as it starts)
    _SHARED = shared


def _one(index: int, kwargs: dict[str, Any]) -> Result:
    def mark(fraction: float) -> None:
        _SHARED[index] = fraction

    return simulate(**kwargs, progress=mark)


def run_all(
    runs: Sequence[Mapping[str, Any]],
    *,
    workers: int = 1,
    progress: Callable[[int, float], None] | None = None,
) -> list[Result]:
    """Each of ``runs`` (``simulate``'s keyword arguments), the results in order. The runs
    are independent (each its own log, fold and decider), so with ``workers`` above one they
    run side by side in that many processes; ``progress(i, fraction)`` says how far run
    ``i`` is."""
    if workers <= 1 or len(runs) <= 1:
        return [
            simulate(**run, progress=None if progress is None else functools.partial(progress, i))
            for i, run in enumerate(runs)
        ]
    context = multiprocessing.get_context("spawn")  # no fork of a process with threads
    shared = context.Array("d", len(runs), lock=False)
    with ProcessPoolExecutor(min(workers, len(runs)), mp_context=context,
                             initializer=_share, initargs=(shared,)) as pool:  # fmt: skip
        futures = [pool.submit(_one, i, dict(run)) for i, run in enumerate(runs)]
        pending = set(futures)
        while pending:
            _, pending = wait(pending, timeout=0.25, return_when=FIRST_COMPLETED)
            if progress is not None:
                for i, future in enumerate(futures):
                    progress(i, 1.0 if future.done() else shared[i])
        return [future.result() for future in futures]


@dataclass(frozen=True, slots=True)
class Plan:
    """What ``elasticctl simulate`` (and the API's planning page) runs: ``strategies`` side
    by side on the same failures, once, or once per value of ``field`` (a model field,
    ``ranks`` or ``spares``). Made by ``plan``, which checks every value."""

    ranks: int
    days: float
    strategies: tuple[Strategy, ...]
    preset: str
    spares: int
    seed: int
    model: Model
    failures: tuple[Failure, ...] | None = None
    #: Where ``failures`` come from (a trace file), None for the preset.
    source: str | None = None
    field: str | None = None
    values: tuple[float, ...] = ()

    def runs(self) -> list[tuple[str, dict[str, Any], dict[str, float] | None]]:
        """Each run: its label, ``simulate``'s keyword arguments, the swept value."""
        out: list[tuple[str, dict[str, Any], dict[str, float] | None]] = []
        rates = PRESETS[self.preset].rates
        failures = list(self.failures) if self.failures is not None else None
        for value in self.values or (None,):
            sized = {"ranks": self.ranks, "spares": self.spares}
            model = self.model
            swept = None
            if self.field is not None and value is not None:
                swept = {self.field: value}
                if self.field in sized:
                    sized[self.field] = int(value)
                else:
                    model = model_with(model, swept)
            for strategy in self.strategies:
                label = f"{strategy} {self.field}={value:g}" if swept else strategy
                kwargs = {"strategy": strategy, **sized, "days": self.days, "failures": failures,
                          "rates": rates, "model": model, "seed": self.seed}  # fmt: skip
                out.append((label, kwargs, swept))
        return out

    def outcome(self, results: Sequence[Result]) -> dict[str, Any]:
        """The JSON of ``elasticctl simulate``: the runs, the failure rate and Young/Daly's
        intervals at the plan's size, the best run of a sweep."""
        runs: list[dict[str, Any]] = []
        for result, (_, _, swept) in zip(results, self.runs(), strict=True):
            summary = result.summary()
            if swept:
                summary["sweep"] = swept
            runs.append(summary)
        nodes = math.ceil(self.ranks / NODE_RANKS)
        per_day = PRESETS[self.preset].rates.per_day(
            nodes + self.spares, math.ceil(nodes / RACK_NODES)
        )
        out: dict[str, Any] = {
            "ranks": self.ranks, "days": self.days, "preset": self.preset, "seed": self.seed,
            "failures_source": self.source or PRESETS[self.preset].source,
            "failures_per_day": round(per_day, 3),
            "model": asdict(self.model), "runs": runs,
        }  # fmt: skip
        if out["failures_per_day"] > 0:
            mtbf = _DAY / out["failures_per_day"]
            model = self.model
            out["young_daly"] = {
                "mtbf_s": round(mtbf, 1),
                "checkpoint_interval_s": round(young_daly(model.checkpoint_cost_s, mtbf), 1),
                "backup_interval_steps": round(
                    young_daly(model.backup_cost_s, mtbf) / model.step_s, 1
                ),
            }
        if self.field is not None and runs:
            best = max(runs, key=lambda r: r["ettr"])
            out["best"] = {"strategy": best["strategy"], **best["sweep"], "ettr": best["ettr"]}
        return out


#: Sizes a sweep may set besides the model's fields.
SIZES: Final = ("ranks", "spares")


def plan(
    *,
    ranks: int,
    days: float,
    strategies: str,
    preset: str = "llama3",
    spares: int = 2,
    seed: int = 0,
    model: Mapping[str, object] | None = None,
    sweep: str | None = None,
    failures: Sequence[Failure] | None = None,
    source: str | None = None,
) -> Plan:
    """A checked ``Plan`` (``strategies``: comma-separated; ``sweep``: ``FIELD=V1,V2,...``);
    ``ValueError`` saying what is wrong."""
    chosen = tuple(s.strip() for s in strategies.split(",") if s.strip())
    if not chosen or any(s not in STRATEGIES for s in chosen):
        raise ValueError(f"--strategy: one or more of {', '.join(STRATEGIES)}")
    if preset not in PRESETS:
        raise ValueError(f"--preset: one of {', '.join(PRESETS)}")
    if _whole_nodes(ranks) is None or spares < 0 or not 0 < days <= 3_650:
        raise ValueError(
            f"ranks a multiple of {NODE_RANKS} from {NODE_RANKS} to {MAX_WORLD:,} (whole nodes:"
            f" a replica is a node), spares 0 or more, days up to 3,650"
        )
    base = model_with(Model(), model or {})
    field: str | None = None
    values: tuple[float, ...] = ()
    if sweep:
        name, _, listed = sweep.partition("=")
        given = [v.strip() for v in listed.split(",") if v.strip()]
        if not name or not given:
            raise ValueError("--sweep FIELD=V1,V2,...")
        numbers = []
        for value in given:
            if name in SIZES:
                numbers.append(float(_size(name, value)))
            else:
                swept = model_with(base, {name: value})
                numbers.append(float(getattr(swept, name)))
        field, values = name, tuple(numbers)
    return Plan(ranks, days, chosen, preset, spares, seed, base,  # type: ignore[arg-type]
                None if failures is None else tuple(failures), source, field, values)  # fmt: skip


def _whole_nodes(ranks: int) -> int | None:
    """``ranks`` when they fill whole nodes (``NODE_RANKS`` each, up to ``MAX_WORLD``)."""
    return ranks if NODE_RANKS <= ranks <= MAX_WORLD and ranks % NODE_RANKS == 0 else None


def _size(field: str, value: str) -> int:
    """A swept ``ranks`` (whole nodes, up to ``MAX_WORLD``) or ``spares`` (0 or more) value."""
    try:
        number = int(value)
    except ValueError:
        raise ValueError(f"{field}={value!r}: not a whole number") from None
    if field == "ranks" and _whole_nodes(number) is None:
        raise ValueError(
            f"{field}={value!r}: must be a multiple of {NODE_RANKS} from {NODE_RANKS} to"
            f" {MAX_WORLD:,}"
        )
    if field == "spares" and not 0 <= number <= MAX_WORLD:
        raise ValueError(f"{field}={value!r}: must be 0 to {MAX_WORLD:,}")
    return number


def run_plan(
    planned: Plan,
    *,
    workers: int = 1,
    progress: Callable[[int, float], None] | None = None,
) -> dict[str, Any]:
    """Run ``planned`` (in up to ``workers`` processes: the runs on the decider take the
    time, checkpoint-restart is arithmetic) and return its outcome."""
    runs = planned.runs()
    heavy = sum(1 for _, kwargs, _ in runs if kwargs["strategy"] != "restart")
    results = run_all([kwargs for _, kwargs, _ in runs], workers=max(1, min(workers, heavy)),
                      progress=progress)  # fmt: skip
    return planned.outcome(results)


def _end_down(result: Result, over: float) -> None:
    """The job ended ``over`` seconds into its last incident's recovery: only what fits in
    the wall time counts (the phases cut from the latest back)."""
    if over <= 0 or not result.incidents:
        return
    last = result.incidents[-1]
    for term in ("resume", "restore", "waiting", "decision", "detection"):
        cut = min(over, last.phases.get(term, 0.0))
        result.breakdown[term] -= cut
        over -= cut


def _close(result: Result) -> None:
    """The rest of the wall time is idle (the terms never overlap: a negative rest is a
    bug)."""
    terms = result.breakdown
    rest = result.wall_s - sum(v for k, v in terms.items() if k != "idle")
    if rest < -1e-6 * result.wall_s:
        raise AssertionError(f"the terms add up to more than the wall time: {terms}")
    terms["idle"] = max(0.0, rest)


def young_daly(cost_s: float, mtbf_s: float) -> float:
    """Young/Daly's checkpoint interval: sqrt(2 x cost x MTBF)."""
    return math.sqrt(2 * cost_s * mtbf_s)


def as_json(results: Iterable[Result]) -> list[dict[str, Any]]:
    return [r.summary() for r in results]


__all__ = [
    "KINDS", "PRESETS", "REPRODUCTIONS", "SIZES", "STRATEGIES", "TERMS", "Failure", "Model",
    "Plan", "Rates", "Reproduction", "Result", "asdict", "cores", "draw", "model_with", "plan",
    "read_trace", "reproduce", "run_all", "run_plan", "simulate", "young_daly",
]  # fmt: skip
