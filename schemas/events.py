"""The envelope and every event of the catalog, as a discriminated union on ``type``."""

from __future__ import annotations

import base64
import math
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Annotated, Any, Literal, NamedTuple, Union
from uuid import UUID

from pydantic import Field, PrivateAttr, StringConstraints, TypeAdapter, model_validator

from schemas.catalog import SHA256_HEX, CatalogColumns, PackError, decode, encode
from schemas.common import (
    CONTROLPLANE_SOURCE,
    MAX_WORLD,
    REPORTED_ANOMALIES,
    AnomalyAction,
    AnomalyKind,
    Checksum,
    ComputeSeconds,
    EventId,
    FaultKind,
    FaultReason,
    Finite,
    Ident,
    Int64,
    JobState,
    NonNegInt,
    Phase,
    PositiveInt,
    PositiveSeconds,
    ReallocationMode,
    RestoreFrom,
    Role,
    Seconds,
    ShortText,
    Source,
    Step,
    Strict,
    Text,
    Timestamp,
)

Members = Annotated[list[Ident], Field(max_length=MAX_WORLD)]
#: Most step ranges a job skips (``StepRanges``): each rollback adds at most one.
MAX_SKIP_RANGES = 1024
#: Steps a loop does not run, as inclusive ``[first, last]`` ranges, ascending and disjoint
#: (``controlplane.core.anomaly.merged``): the batches a rollback skipped.
StepRanges = Annotated[list[tuple[Step, Step]], Field(max_length=MAX_SKIP_RANGES)]


# --------------------------------------------------------------------------- payloads

#: Dimensions a mesh may have (pp, dp_replicate, dp_shard, dp, cp, ep, tp, ...).
MAX_MESH_DIMS = 8
#: A mesh dimension's name: the usual ``pp``, ``dp_replicate``, ``dp_shard``, ``dp``, ``cp``,
#: ``ep``, ``tp``, or any other lowercase name.
MeshDimName = Annotated[str, StringConstraints(pattern=r"^[a-z][a-z0-9_]{0,31}$")]
MeshDegree = Annotated[int, Field(ge=1, le=MAX_WORLD)]
MeshDimNames = Annotated[list[MeshDimName], Field(max_length=MAX_MESH_DIMS)]
#: The dimensions whose coordinate identifies a data-parallel replica when ``replica_dims``
#: is not given.
DEFAULT_REPLICA_DIMS = ("dp_replicate", "dp")


class Mesh(Strict):
    """A job's device mesh at full size (3D parallelism: data, tensor, pipeline, ...).

    Rank ``r`` sits at the coordinate of ``r`` in row-major order over ``dims``: the first
    dimension is the outermost, the last varies fastest (``numpy.unravel_index(r, degrees)``,
    the order of ``torch.distributed.init_device_mesh(shape, mesh_dim_names=names)``).

    A *replica* is the set of ranks sharing one coordinate of the ``replica_dims`` (its size
    is the product of the other dimensions' degrees); replicas are numbered in row-major order
    over the replica dims. The decider replaces a lost rank at its exact coordinate, or drops
    the whole replica that lost it (a shrink); ``min_world`` counts replicas.
    """

    #: ``(name, degree)`` per dimension, outermost first (a list: a JSON object's key order is
    #: not kept by every store).
    dims: Annotated[
        list[tuple[MeshDimName, MeshDegree]], Field(min_length=1, max_length=MAX_MESH_DIMS)
    ]
    #: The data-parallel dimensions whose coordinate identifies a replica. None: those of
    #: ``dims`` named ``dp_replicate`` or ``dp``. Empty: the whole world is one replica (it
    #: cannot shrink; a lost rank waits for a spare).
    replica_dims: MeshDimNames | None = None
    #: Dimensions kept inside a node (e.g. ``["tp"]``): the ranks that differ only in these
    #: coordinates start on one node, and a replacement goes to their node first.
    node_local: MeshDimNames = Field(default_factory=list)

    @model_validator(mode="after")
    def _consistent(self) -> Mesh:
        names = [name for name, _ in self.dims]
        if len(set(names)) != len(names):
            raise ValueError(f"mesh dims name a dimension twice: {names}")
        size = 1
        for _, degree in self.dims:
            size *= degree
            if size > MAX_WORLD:
                raise ValueError(
                    f"mesh of {' x '.join(f'{n}={d}' for n, d in self.dims)} has more than"
                    f" {MAX_WORLD} ranks"
                )
        for field, listed in (("replica_dims", self.replica_dims), ("node_local", self.node_local)):
            if listed is None:
                continue
            unknown = [n for n in listed if n not in names]
            if unknown:
                raise ValueError(f"mesh {field} names {unknown}, not among the dims {names}")
            if len(set(listed)) != len(listed):
                raise ValueError(f"mesh {field} names a dimension twice: {listed}")
        return self

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.dims)

    @property
    def degrees(self) -> tuple[int, ...]:
        return tuple(degree for _, degree in self.dims)

    @property
    def replica_names(self) -> tuple[str, ...]:
        """The replica dimensions, in ``dims`` order."""
        chosen = self.replica_dims if self.replica_dims is not None else DEFAULT_REPLICA_DIMS
        return tuple(name for name in self.names if name in chosen)

    @property
    def size(self) -> int:
        """Ranks of the full mesh."""
        return math.prod(self.degrees)

    @property
    def replicas(self) -> int:
        """Replicas of the full mesh."""
        replica = set(self.replica_names)
        out = 1
        for name, degree in self.dims:
            if name in replica:
                out *= degree
        return out

    @property
    def replica_size(self) -> int:
        """Ranks per replica."""
        return self.size // self.replicas

    def describe(self) -> str:
        """``dp=64 x tp=8 x pp=8``."""
        return " x ".join(f"{name}={degree}" for name, degree in self.dims)


def _per_phase(value: float | dict[Phase, float], phase: Phase, default: float) -> float:
    """``value`` for ``phase``: one for all, or the phase's (else train's, else ``default``)."""
    if isinstance(value, dict):
        return value.get(phase, value.get(Phase.TRAIN, default))
    return value


class JobPolicy(Strict):
    """How a job is run and recovered; fixed by ``job.registered``."""

    min_world: Annotated[int, Field(ge=1, le=MAX_WORLD)] = 1
    max_world: Annotated[int, Field(ge=1, le=MAX_WORLD)] = 1024
    #: Heartbeats are soft state (NATS core, never stored): sub-second intervals cost no
    #: write (e.g. 0.25 with a train timeout of 1: docs/design.md, "Liveness").
    heartbeat_interval_s: PositiveSeconds = 1.0
    #: The control plane records each member's liveness (``liveness.summary``: last
    #: heartbeat, beats, largest gap) at least this often; heartbeats themselves are soft
    #: state (docs/design.md, "Liveness"). Also the resolution of a counterfactual timeout.
    liveness_summary_interval_s: PositiveSeconds = 10.0
    #: Heartbeat timeout per phase; a phase not listed falls back to ``train``.
    heartbeat_timeout_s: dict[Phase, PositiveSeconds] = Field(
        default_factory=lambda: {
            Phase.INIT: 30.0,
            Phase.TRAIN: 5.0,
            Phase.WAITING: 10.0,
            Phase.BACKUP: 15.0,
            Phase.RESTORE: 30.0,
        }
    )
    #: ``fixed``: the timeouts above. ``auto``: each phase's timeout follows the heartbeat
    #: gaps the log's interval ``liveness.summary`` events show in that phase over the last
    #: ``heartbeat_timeout_window_s``: ``heartbeat_timeout_k`` times their
    #: ``heartbeat_timeout_quantile``, clamped to ``[heartbeat_timeout_floor_s,
    #: heartbeat_timeout_ceiling_s]``; a phase with fewer than ``heartbeat_timeout_min_gaps``
    #: gaps keeps its fixed timeout (docs/design.md, "Detection").
    heartbeat_timeout_mode: Literal["fixed", "auto"] = "fixed"
    heartbeat_timeout_k: Annotated[float, Field(gt=0, le=1000, allow_inf_nan=False)] = 3.0
    heartbeat_timeout_quantile: Annotated[float, Field(gt=0, le=1, allow_inf_nan=False)] = 0.99
    heartbeat_timeout_min_gaps: Annotated[int, Field(ge=1, le=10_000_000)] = 100
    #: One value for every phase, or one per phase (a phase not listed takes train's, else
    #: the default: 1 s and 300 s).
    heartbeat_timeout_floor_s: PositiveSeconds | dict[Phase, PositiveSeconds] = 1.0
    heartbeat_timeout_ceiling_s: PositiveSeconds | dict[Phase, PositiveSeconds] = 300.0
    heartbeat_timeout_window_s: PositiveSeconds = 600.0
    backup_interval: PositiveInt = 10
    redundancy: Annotated[int, Field(ge=0, le=8)] = 2
    recovery_deadline_s: PositiveSeconds = 60.0
    #: A cold checkpoint every this many backups (0: never).
    checkpoint_every: NonNegInt = 0
    #: Workers the first generation waits for (None: ``min_world``).
    world_size: Annotated[int, Field(ge=1, le=MAX_WORLD)] | None = None
    #: After this long in PENDING the job starts with the workers it has (at least
    #: ``min_world``), or stops.
    start_timeout_s: PositiveSeconds = 300.0
    #: Decisions one incident may take (cascades, missed deadlines) before the job stops.
    max_decisions_per_incident: Annotated[int, Field(ge=1, le=1000)] = 8
    #: The job's device mesh (None: a flat world of ranks). With a mesh, ``min_world`` counts
    #: replicas (not ranks), the first generation waits for the whole mesh (``world_size``, if
    #: given, must equal its size; ``max_world`` must hold it), the world grows and shrinks by
    #: whole replicas, and a lost rank that no spare can take and whose replica cannot be
    #: dropped waits for a spare up to ``recovery_deadline_s``, then the job stops.
    mesh: Mesh | None = None
    #: A loss anomaly (a rank's non-finite loss or gradient norm, a loss spike) opens an
    #: incident of its own: ``rollback`` to the newest complete backup strictly before it,
    #: or ``stop`` the job.
    anomaly_action: AnomalyAction = AnomalyAction.ROLLBACK
    #: A rollback skips this many steps' batches, ending at the anomaly's step (0: replays
    #: them all, for a transient fault); never the restore step or one before it.
    anomaly_skip_steps: Annotated[int, Field(ge=0, le=100_000)] = 1
    #: Rollbacks a job may take; the anomaly after the last stops it (a NaN that comes back).
    max_rollbacks: Annotated[int, Field(ge=0, le=MAX_SKIP_RANGES)] = 8
    #: A job loss above median + k x MAD of the ``loss_spike_window`` losses before it is a
    #: spike (0: spikes are not looked for; non-finite losses always are).
    loss_spike_k: Annotated[float, Field(ge=0, le=1e6, allow_inf_nan=False)] = 0.0
    #: Steps of the job's loss the spike threshold is taken over (and at least this many
    #: steps of the current timeline before the first spike can be found).
    loss_spike_window: Annotated[int, Field(ge=8, le=4096)] = 64
    #: Straggler detection (docs/design.md, "Slow ranks"): a member of the world whose
    #: compute time per step (apart from time blocked in collectives) stayed above the job's
    #: baseline for ``slow_window_s`` is recorded as ``member.slow`` (0: never looked for).
    #: The baseline is the median of the other members' and the threshold the larger of
    #: ``slow_ratio`` above it and ``slow_mad_k`` scaled median absolute deviations above it.
    slow_window_s: Annotated[float, Field(ge=0, le=86_400, allow_inf_nan=False)] = 20.0
    slow_ratio: Annotated[float, Field(gt=0, le=100, allow_inf_nan=False)] = 0.2
    slow_mad_k: Annotated[float, Field(ge=0, le=100, allow_inf_nan=False)] = 3.0
    #: What follows a ``member.slow``: ``ignore`` (it is only recorded), or ``replace`` it
    #: with a warm spare when the goodput it is projected to cost over ``slow_horizon_s``
    #: exceeds what a recovery costs (the job's mean downtime so far, else
    #: ``slow_recovery_s``, plus the steps since the newest complete backup).
    slow_action: Literal["ignore", "replace"] = "ignore"
    slow_horizon_s: PositiveSeconds = 600.0
    slow_recovery_s: PositiveSeconds = 30.0
    #: Stalled members (docs/design.md, "Stalled steps"): members of the world whose
    #: gradients of a step are ready wait in its collectives for one that has not reached
    #: that point; once the wait passes the step timeout, the members behind (at most half
    #: the world) have failed (``stalled``). ``fixed``: ``step_timeout_s`` (0: never looked
    #: for). ``auto``: ``step_timeout_k`` times the ``step_timeout_quantile`` of the longest
    #: steps the log's interval ``liveness.summary`` events show over the last
    #: ``step_timeout_window_s``, clamped to ``[step_timeout_floor_s,
    #: step_timeout_ceiling_s]``; with fewer than ``step_timeout_min_steps`` of them the fixed
    #: one holds.
    step_timeout_mode: Literal["fixed", "auto"] = "fixed"
    #: (The default is half the default ``collective_timeout_s``: a wait that long fails the
    #: collectives anyway.)
    step_timeout_s: Annotated[float, Field(ge=0, le=3600, allow_inf_nan=False)] = 30.0
    step_timeout_k: Annotated[float, Field(gt=0, le=1000, allow_inf_nan=False)] = 5.0
    step_timeout_quantile: Annotated[float, Field(gt=0, le=1, allow_inf_nan=False)] = 0.99
    step_timeout_min_steps: Annotated[int, Field(ge=1, le=10_000_000)] = 50
    step_timeout_floor_s: PositiveSeconds = 10.0
    #: (A heartbeat carries a wait of at most an hour: no step timeout is longer.)
    step_timeout_ceiling_s: Annotated[float, Field(gt=0, le=3600, allow_inf_nan=False)] = 1800.0
    step_timeout_window_s: PositiveSeconds = 600.0
    #: How long a member's collective (and the forming of a generation's group) waits for its
    #: peers before it fails: the process group's timeout. A failed collective is reported
    #: with the members on hosts this member cannot reach at all (a partition between hosts,
    #: which no heartbeat shows: ``rank_runtime.replication.unreachable``).
    collective_timeout_s: Annotated[float, Field(ge=1, le=86_400, allow_inf_nan=False)] = 60.0
    #: How long a member waits in a step's collectives (past the moment its gradients were
    #: all ready; without that evidence, past twice its longest recent step) before it probes
    #: its peers' hosts, reporting those that do not answer while it still waits, and again
    #: after twice as long each time (0: only once a collective failed). A host cut from its
    #: peers is then found in seconds rather than at the collective timeout.
    collective_probe_s: Annotated[float, Field(ge=0, le=86_400, allow_inf_nan=False)] = 2.0

    def heartbeat_floor(self, phase: Phase) -> float:
        """The floor of ``phase``'s derived heartbeat timeout (``auto``)."""
        return _per_phase(self.heartbeat_timeout_floor_s, phase, 1.0)

    def heartbeat_ceiling(self, phase: Phase) -> float:
        """The ceiling of ``phase``'s derived heartbeat timeout (``auto``)."""
        return _per_phase(self.heartbeat_timeout_ceiling_s, phase, 300.0)

    @model_validator(mode="after")
    def _world_bounds(self) -> JobPolicy:
        if self.min_world > self.max_world:
            raise ValueError("min_world must not exceed max_world")
        for phase in Phase:
            floor, ceiling = self.heartbeat_floor(phase), self.heartbeat_ceiling(phase)
            if floor > ceiling:
                raise ValueError(
                    f"heartbeat_timeout_floor_s {floor:g} must not exceed"
                    f" heartbeat_timeout_ceiling_s {ceiling:g} (phase {phase.value})"
                )
        if self.step_timeout_floor_s > self.step_timeout_ceiling_s:
            raise ValueError(
                f"step_timeout_floor_s {self.step_timeout_floor_s:g} must not exceed"
                f" step_timeout_ceiling_s {self.step_timeout_ceiling_s:g}"
            )
        if self.world_size is not None and not (
            self.min_world <= self.world_size <= self.max_world
        ):
            raise ValueError("world_size must lie between min_world and max_world")
        mesh = self.mesh
        if mesh is not None:
            shape = mesh.describe()
            if self.world_size is not None and self.world_size != mesh.size:
                raise ValueError(
                    f"world_size {self.world_size} is not the size of the mesh {shape}"
                    f" ({mesh.size} ranks)"
                )
            if mesh.size > self.max_world:
                raise ValueError(
                    f"the mesh {shape} has {mesh.size} ranks, more than max_world {self.max_world}"
                )
            if self.min_world > mesh.replicas:
                raise ValueError(
                    f"min_world {self.min_world} counts replicas with a mesh: the mesh {shape}"
                    f" has {mesh.replicas} (of {mesh.replica_size} ranks each, replica dims"
                    f" {list(mesh.replica_names)})"
                )
        return self

    @property
    def start_world(self) -> int:
        """How many workers the first generation waits for."""
        if self.mesh is not None:
            return self.mesh.size
        return self.world_size if self.world_size is not None else self.min_world


class JobRegistered(Strict):
    name: ShortText = ""
    policy: JobPolicy = Field(default_factory=JobPolicy)


class MemberJoined(Strict):
    node: Ident
    rack: Ident
    host: ShortText
    pid: NonNegInt
    role: Role
    device: ShortText = "cpu"
    backup_endpoint: ShortText = ""
    #: The policy the member's launcher asks for; the first one to join registers the job.
    policy: JobPolicy | None = None


class MemberHeartbeat(Strict):
    step: Step
    phase: Phase
    #: The longest step the member finished since its previous heartbeat (0: none): what a
    #: straggler analysis needs of every rank, with no stored row per rank per step.
    step_seconds: Seconds = 0.0
    #: The mean compute time of the steps it finished since its previous heartbeat, apart
    #: from time blocked in collectives (None: none finished, or not measured).
    compute_seconds: ComputeSeconds | None = None
    #: In phase train: seconds since it finished its last step (``step``; or since it began
    #: training in its generation), and since the gradients of the step after it were ready
    #: on it (None: not yet, or not measured). A stalled step's evidence (docs/design.md,
    #: "Stalled steps"); None outside phase train.
    since_step_seconds: ComputeSeconds | None = None
    ready_seconds: ComputeSeconds | None = None


class HeartbeatMessage(Strict):
    """A heartbeat on ``elastic.hb.<job>.<node>.<member>`` (NATS core, not stored): the
    envelope of an event without ``event_id`` and ``seq`` (it is not part of the member's
    numbered sequence), validated and bound to its subject like one."""

    job_id: Ident
    type: Literal["member.heartbeat"]
    v: Literal[1]
    source: Source
    incarnation: Ident
    generation: NonNegInt
    emitted_at: Timestamp
    payload: MemberHeartbeat


#: Members one ``liveness.summary`` lists at most (a job's summary is split into parts).
SUMMARY_MEMBERS = 200


class LivenessEntry(Strict):
    """One member's heartbeats over one summary window, as the control plane heard them."""

    member: Ident
    node: Ident
    incarnation: Ident
    #: The generation its last heartbeat named.
    generation: NonNegInt
    #: Its last heartbeat (received), or the control plane's start when ``assumed``.
    last_at: Timestamp
    #: No heartbeat heard since the control plane (re)started: counted as heard at its start.
    assumed: bool = False
    #: The first heartbeat heard in the window (None: none).
    first_at: Timestamp | None = None
    beats: NonNegInt = 0
    #: The largest silence in the window (between two heartbeats, or from the window's
    #: start or the previous heartbeat to the first one), and when it began.
    max_gap_s: Seconds = 0.0
    max_gap_at: Timestamp | None = None
    phase: Phase
    step: Step
    #: The longest step it reported finishing in the window (its heartbeats' step_seconds).
    max_step_s: Seconds = 0.0


#: Members one part of a columnar ``liveness.summary`` lists at most.
SUMMARY_COLUMN_MEMBERS = 800
#: Milliseconds a column's offset or duration may span (about 24 days).
_SPAN_MS = 2**31 - 1
_OffsetMs = Annotated[int, Field(ge=-_SPAN_MS, le=_SPAN_MS)]
_DurationMs = Annotated[int, Field(ge=0, le=_SPAN_MS)]
#: A compute time per step in milliseconds (at most an hour, as ``ComputeSeconds``).
_ComputeMs = Annotated[int, Field(ge=0, le=3_600_000)]
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


#: Members one ``node.heartbeat`` carries at most (a node's launcher relays its members).
NODE_BEATS = 512
#: How old a relayed heartbeat may be when its node's message leaves, milliseconds (the
#: launcher relays only what it heard since its previous message, an interval ago).
RELAY_AGE_MAX_MS = 60_000


class NodeHeartbeatMessage(Strict):
    """A node's heartbeats in one message, on ``elastic.hb.<job>.<node>.launcher`` (NATS
    core, not stored): the launcher of the node gathers what its members sent it over the
    interval (their latest each) and sends it once an interval. A column per field, one
    value per member (no field name repeated per member: validating a node's message costs
    little more than one heartbeat's). Bound to its subject like an event (source
    ``<node>/launcher``); each beat is then taken as its member's own."""

    job_id: Ident
    type: Literal["node.heartbeat"]
    v: Literal[1]
    source: Source
    emitted_at: Timestamp
    members: Annotated[list[Ident], Field(max_length=NODE_BEATS)]
    incarnation: list[Ident]
    generation: list[NonNegInt]
    #: How long before the message left the launcher heard each heartbeat.
    age_ms: list[Annotated[int, Field(ge=0, le=RELAY_AGE_MAX_MS)]]
    step: list[Step]
    phase: list[Phase]
    #: The longest step each member finished since its previous heartbeat (its
    #: heartbeat's ``step_seconds``), milliseconds.
    step_ms: list[_DurationMs]
    #: Each member's heartbeat's ``compute_seconds``, milliseconds (None: none; the column
    #: is absent from older launchers' messages).
    compute_ms: list[_ComputeMs | None] | None = None
    #: Each member's heartbeat's ``since_step_seconds`` and ``ready_seconds``, milliseconds
    #: (None: none; a column absent: no member reported one).
    since_step_ms: list[_ComputeMs | None] | None = None
    ready_ms: list[_ComputeMs | None] | None = None

    @model_validator(mode="after")
    def _aligned(self) -> NodeHeartbeatMessage:
        count = len(self.members)
        names = ["incarnation", "generation", "age_ms", "step", "phase", "step_ms"]
        names += [
            n for n in ("compute_ms", "since_step_ms", "ready_ms") if getattr(self, n) is not None
        ]
        for name in names:
            if len(getattr(self, name)) != count:
                raise ValueError(
                    f"column {name} has {len(getattr(self, name))} values, not {count}"
                )
        if len(set(self.members)) != count:
            raise ValueError("a member twice in one node's heartbeats")
        return self


def at_ms(ms: int) -> datetime:
    """The time ``ms`` milliseconds after the Unix epoch (exact: no float on the way)."""
    return _EPOCH + timedelta(milliseconds=ms)


def ms_of(at: datetime) -> int:
    """``at`` (aware) in whole milliseconds since the Unix epoch, rounded down. Exact: the
    float of a time on the millisecond is off by far less than half a millisecond."""
    extra = at.microsecond % 1000
    if extra:
        at = at.replace(microsecond=at.microsecond - extra)
    return round(at.timestamp() * 1000)


class LivenessRow(NamedTuple):
    """One member's line of a summary, whatever its encoding. ``node`` and ``incarnation``
    are None in a columnar summary: it lists only members whose process is the view's when it
    was recorded (folded at once, behind that view), so both are the view's."""

    member: str
    node: str | None
    incarnation: str | None
    generation: int
    last_at: datetime
    assumed: bool
    first_at: datetime | None
    beats: int
    max_gap_s: float
    max_gap_at: datetime | None
    phase: Phase
    step: int
    max_step_s: float
    #: Its sustained compute time per step over the summary's ``compute_window_ms`` (None:
    #: not known over the whole window).
    compute_s: float | None = None


class LivenessColumns(Strict):
    """The members of one summary part, a column per field, times in whole milliseconds:
    offsets from ``epoch_ms`` (Unix ms) for instants, milliseconds for durations: no field
    name and no identity repeated per member, as a ``LivenessEntry`` has."""

    epoch_ms: Annotated[int, Field(ge=0, le=2**53)]
    members: Annotated[list[Ident], Field(max_length=SUMMARY_COLUMN_MEMBERS)]
    generation: list[NonNegInt]
    #: The last heartbeat heard (received), or the control plane's start when ``assumed``.
    last_ms: list[_OffsetMs]
    #: Indices (into ``members``) of those not heard since the control plane (re)started.
    assumed: list[NonNegInt] = Field(default_factory=list)
    #: The first heartbeat heard in the window (None: none).
    first_ms: list[_OffsetMs | None]
    beats: list[NonNegInt]
    #: The largest silence in the window, and when it began (None: no gap).
    max_gap_ms: list[_DurationMs]
    max_gap_at_ms: list[_OffsetMs | None]
    phase: list[Phase]
    step: list[Step]
    max_step_ms: list[_DurationMs]
    #: Each member's sustained compute time per step over the summary's
    #: ``compute_window_ms``: the least of the per-heartbeat means in that window (None: not
    #: known over the whole window). Absent from summaries recorded before.
    compute_ms: list[_ComputeMs | None] | None = None
    #: The phase each member was in when its largest silence began, where that is not its
    #: ``phase`` (None: the same; the column absent: the same for all, or a summary recorded
    #: before). Self-calibrating timeouts charge the gap to it.
    max_gap_phase: list[Phase | None] | None = None
    #: Each member's last heartbeat's ``since_step_seconds`` and ``ready_seconds`` in
    #: milliseconds (None: none; a column absent: none for everyone, or a summary recorded
    #: before): the evidence of a stalled step (docs/design.md, "Stalled steps").
    since_step_ms: list[_ComputeMs | None] | None = None
    ready_ms: list[_ComputeMs | None] | None = None

    @model_validator(mode="after")
    def _aligned(self) -> LivenessColumns:
        count = len(self.members)
        names = ["generation", "last_ms", "first_ms", "beats", "max_gap_ms", "max_gap_at_ms",
                 "phase", "step", "max_step_ms"]  # fmt: skip
        names += [
            n
            for n in ("compute_ms", "max_gap_phase", "since_step_ms", "ready_ms")
            if getattr(self, n) is not None
        ]
        for name in names:
            if len(getattr(self, name)) != count:
                raise ValueError(
                    f"column {name} has {len(getattr(self, name))} values, not {count}"
                )
        if len(set(self.members)) != count:
            raise ValueError("a member is listed twice")
        if any(i >= count for i in self.assumed):
            raise ValueError("assumed names an index past the members")
        return self

    def last_heard(self) -> Iterator[tuple[str, str | None, int, datetime, Phase]]:
        """(member, None, generation, last heartbeat, phase) of each member listed."""
        epoch = self.epoch_ms
        for member, generation, last, phase in zip(
            self.members, self.generation, self.last_ms, self.phase, strict=True
        ):
            yield member, None, generation, at_ms(epoch + last), phase

    def computed(self) -> Iterator[tuple[str, float | None]]:
        """(member, sustained compute seconds or None) of each member listed (none when the
        summary carries no compute column)."""
        if self.compute_ms is not None:
            for member, ms in zip(self.members, self.compute_ms, strict=True):
                yield member, None if ms is None else ms / 1000

    def progress(
        self,
    ) -> Iterator[tuple[str, int, int, datetime, float | None, float | None]]:
        """(member, step, generation, last heartbeat, seconds since its step, seconds since
        the next step's gradients were ready) of each member listed (none when the part
        carries neither column)."""
        opened, ready = self.since_step_ms, self.ready_ms
        if opened is None and ready is None:
            return
        epoch = self.epoch_ms
        for i, member in enumerate(self.members):
            o = None if opened is None else opened[i]
            r = None if ready is None else ready[i]
            yield (
                member, self.step[i], self.generation[i], at_ms(epoch + self.last_ms[i]),
                None if o is None else o / 1000, None if r is None else r / 1000,
            )  # fmt: skip

    def rows(self) -> Iterator[LivenessRow]:
        epoch, assumed = self.epoch_ms, set(self.assumed)
        compute = self.compute_ms
        for i, member in enumerate(self.members):
            first, gap_at = self.first_ms[i], self.max_gap_at_ms[i]
            ms = None if compute is None else compute[i]
            yield LivenessRow(
                member, None, None, self.generation[i], at_ms(epoch + self.last_ms[i]),
                i in assumed, None if first is None else at_ms(epoch + first), self.beats[i],
                self.max_gap_ms[i] / 1000, None if gap_at is None else at_ms(epoch + gap_at),
                self.phase[i], self.step[i], self.max_step_ms[i] / 1000,
                None if ms is None else ms / 1000,
            )  # fmt: skip


class RegularMembers(Strict):
    """The members an interval summary does not list one by one: each was heard all through
    the window, its process the view's, not assumed, its first heartbeat within ``bound_ms``
    of the window's start, its last within ``bound_ms`` of its end, no gap longer, in
    ``phase`` of ``generation``, its step in ``[step_min, step_max]`` and its longest step
    at most ``max_step_ms`` (within a quarter of the window's median). Anyone else is listed
    in ``columns``; a decision's summary lists everyone."""

    members: Annotated[list[Ident], Field(max_length=MAX_WORLD)]
    bound_ms: _DurationMs
    generation: NonNegInt
    phase: Phase
    step_min: Step
    step_max: Step
    max_step_ms: _DurationMs
    #: The largest gap of any of them in the window (at most ``bound_ms``; absent from
    #: summaries recorded before: ``bound_ms`` is what those vouch for).
    max_gap_ms: _DurationMs | None = None
    #: Each one's sustained compute time per step over the summary's ``compute_window_ms``
    #: (None: not known over the whole window), in ``members`` order. Absent from summaries
    #: recorded before.
    compute_ms: list[_ComputeMs | None] | None = None

    @model_validator(mode="after")
    def _aligned(self) -> RegularMembers:
        if self.compute_ms is not None and len(self.compute_ms) != len(self.members):
            raise ValueError(
                f"column compute_ms has {len(self.compute_ms)} values, not {len(self.members)}"
            )
        return self

    def vouched(self, since: datetime | None, at: datetime) -> datetime:
        """A time each was heard at or after: the window's end less the bound (and not
        before the window's start, where each was heard), what the log can vouch for; the
        live table knows more."""
        heard = at - timedelta(milliseconds=self.bound_ms)
        return heard if since is None or heard > since else since

    def last_heard(
        self, since: datetime | None, at: datetime
    ) -> Iterator[tuple[str, str | None, int, datetime, Phase]]:
        """(member, None, generation, ``vouched``, phase) of each."""
        heard = self.vouched(since, at)
        for member in self.members:
            yield member, None, self.generation, heard, self.phase


class LivenessSummary(Strict):
    """``liveness.summary``: every member's liveness from ``since`` to ``at`` (a window),
    recorded every ``liveness_summary_interval_s`` and just before every decision, so the
    decision's inputs are in the log (``reason`` decision). The control plane records them
    as ``columns``; logs recorded before list ``members`` (one ``LivenessEntry`` each)."""

    reason: Literal["interval", "decision"]
    since: Timestamp | None = None
    at: Timestamp
    #: Part ``part`` of ``parts`` (a large job's summary is split).
    part: Annotated[int, Field(ge=1, le=MAX_WORLD)] = 1
    parts: Annotated[int, Field(ge=1, le=MAX_WORLD)] = 1
    members: Annotated[list[LivenessEntry], Field(max_length=SUMMARY_MEMBERS)] = Field(
        default_factory=list
    )
    columns: LivenessColumns | None = None
    #: The members heard regularly (None: none, or a decision's summary that lists every
    #: member in ``columns``): in part 1, and in the next parts when they are more than
    #: ``MAX_WORLD`` (a world that large has spares too).
    regular: RegularMembers | None = None
    #: The window each member's sustained compute time is taken over (``compute_ms``), ms
    #: (None: no compute times, as in summaries recorded before).
    compute_window_ms: _DurationMs | None = None

    def computed(self) -> Iterator[tuple[str, float | None]]:
        """(member, sustained compute seconds or None) of each member the part lists or names
        as regular (nothing when it carries no compute times)."""
        if self.compute_window_ms is None:
            return
        if self.columns is not None:
            yield from self.columns.computed()
        regular = self.regular
        if regular is not None and regular.compute_ms is not None:
            for member, ms in zip(regular.members, regular.compute_ms, strict=True):
                yield member, None if ms is None else ms / 1000

    def last_heard(self) -> Iterator[tuple[str, str | None, int, datetime, Phase]]:
        """(member, incarnation or None, generation, last heartbeat, phase) of each member
        the part lists (what the fold needs; ``rows`` has the rest), and of the regular ones
        (``RegularMembers.last_heard``)."""
        for e in self.members:
            yield e.member, e.incarnation, e.generation, e.last_at, e.phase
        if self.columns is not None:
            yield from self.columns.last_heard()
        if self.regular is not None:
            yield from self.regular.last_heard(self.since, self.at)

    def rows(self) -> Iterator[LivenessRow]:
        """Every member the part lists, whatever its encoding; a regular member (see
        ``RegularMembers``) as heard from the window's start to ``vouched`` without a gap:
        never later than it was (a replay finds a member that stopped just after the window
        as early as it could be found: the next summary lists it with its last heartbeat)."""
        for e in self.members:
            yield LivenessRow(
                e.member, e.node, e.incarnation, e.generation, e.last_at, e.assumed, e.first_at,
                e.beats, e.max_gap_s, e.max_gap_at, e.phase, e.step, e.max_step_s,
            )  # fmt: skip
        if self.columns is not None:
            yield from self.columns.rows()
        regular = self.regular
        if regular is not None:
            last = regular.vouched(self.since, self.at)
            first = self.since if self.since is not None else last
            compute = regular.compute_ms
            for i, member in enumerate(regular.members):
                ms = None if compute is None else compute[i]
                yield LivenessRow(
                    member, None, None, regular.generation, last, False, first, 0, 0.0, None,
                    regular.phase, regular.step_max, regular.max_step_ms / 1000,
                    None if ms is None else ms / 1000,
                )  # fmt: skip


class TrainStep(Strict):
    step: Step
    loss: Finite
    step_seconds: Seconds
    samples: NonNegInt


class TrainAnomaly(Strict):
    """A rank's step came out non-finite (its loss, or its gradients' norm): the rank trains
    no further in its generation and waits for the control plane's decision."""

    step: Step
    kind: AnomalyKind
    #: What the rank saw, e.g. ``loss=nan``.
    detail: ShortText = ""

    @model_validator(mode="after")
    def _reported(self) -> TrainAnomaly:
        if self.kind not in REPORTED_ANOMALIES:
            raise ValueError(f"a member reports no {self.kind.value}: the control plane finds it")
        return self


class BackupSnapshot(Strict):
    """A rank's backup of ``step`` (its shard ``shard``), and the holders that answered they
    keep a copy of it (the rank reports once it has sent them all: one record per rank per
    backup). Logs recorded before name no holders here: each holder's ``backup.replicated``
    said so."""

    step: Step
    shard: NonNegInt
    nbytes: NonNegInt
    checksum: Checksum
    seconds: Seconds
    holders: Annotated[list[Ident], Field(max_length=8)] = Field(default_factory=list)


#: A checksum whose digest a ``backup.catalog`` keeps in base64.
_SHA256_HEX = SHA256_HEX
#: Backup reports one ``backup.catalog`` packs at most (a packed row of about 70 KB).
CATALOG_ENTRIES = 1024


class BackupCatalog(Strict):
    """``backup.catalog`` version 1, as logs recorded before version 2 hold it (still read,
    no longer written): ``backup.snapshot`` reports of one step, from members of one
    generation, that reached the log together, packed by the store into one record, a JSON
    list per field and one value per report. Each report keeps what binds it to its sender
    (``sources``, ``incarnations``, ``seqs``: the ingest checked them against the subject and
    the sequence rules before packing); only its event_id and emission time are not kept.
    The store records it, never a member (the decoder refuses one from the bus); the fold and
    replay read each report as the ``backup.snapshot`` it was
    (``controlplane.core.catalog.unpacked``)."""

    step: Step
    sources: Annotated[list[Source], Field(min_length=1, max_length=CATALOG_ENTRIES)]
    incarnations: list[Ident]
    seqs: list[PositiveInt]
    shards: list[NonNegInt]
    nbytes: list[NonNegInt]
    #: Each report's checksum as it was sent; or, when every one of the run is a sha256
    #: (``sha256:<64 hex>``), ``sha256`` instead: the digests' bytes in unpadded base64url,
    #: 43 characters where the hex form takes 71 (the same digests: ``checksum(i)``).
    checksums: list[Checksum] | None = None
    sha256: list[Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_-]{43}$")]] | None = None
    seconds: list[Seconds]
    holders: list[Annotated[list[Ident], Field(max_length=8)]]

    @classmethod
    def of(cls, step: int, columns: CatalogColumns) -> BackupCatalog:
        """The catalog of ``columns`` (validated reports' values) in this version's lists,
        built without validating again (``PackedCatalog.of``'s twin: nothing encoded)."""
        return cls.model_construct(
            step=step, sources=columns.sources, incarnations=columns.incarnations,
            seqs=columns.seqs, shards=columns.shards, nbytes=columns.nbytes,
            checksums=columns.checksums, sha256=None, seconds=columns.seconds,
            holders=columns.holders,
        )  # fmt: skip

    @staticmethod
    def sha256_of(checksums: list[str]) -> list[str] | None:
        """``checksums`` in the ``sha256`` column's form when every one is a sha256 in
        lowercase hex (what members send), else None (kept as sent, in ``checksums``)."""
        out = []
        for checksum in checksums:
            if not _SHA256_HEX.match(checksum):
                return None
            out.append(base64.urlsafe_b64encode(bytes.fromhex(checksum[7:])).rstrip(b"=").decode())
        return out

    def checksum(self, i: int) -> str:
        """Report ``i``'s checksum, as it was sent."""
        if self.sha256 is not None:
            return "sha256:" + base64.urlsafe_b64decode(self.sha256[i] + "=").hex()
        assert self.checksums is not None
        return self.checksums[i]

    @property
    def count(self) -> int:
        """The reports it packs."""
        return len(self.sources)

    def columns(self) -> CatalogColumns:
        """Its reports as columns (``PackedCatalog.columns``: the same for either form)."""
        checksums = self.checksums or [self.checksum(i) for i in range(len(self.sources))]
        return CatalogColumns(
            self.sources, self.incarnations, self.seqs, self.shards, self.nbytes, checksums,
            self.seconds, self.holders,
        )  # fmt: skip

    @model_validator(mode="after")
    def _aligned(self) -> BackupCatalog:
        count = len(self.sources)
        if (self.checksums is None) == (self.sha256 is None):
            raise ValueError("a catalog has either checksums or sha256")
        digests = "checksums" if self.checksums is not None else "sha256"
        for name in ("incarnations", "seqs", "shards", "nbytes", digests, "seconds",
                     "holders"):  # fmt: skip
            if len(getattr(self, name)) != count:
                raise ValueError(
                    f"column {name} has {len(getattr(self, name))} values, not {count}"
                )
        if any(s == CONTROLPLANE_SOURCE for s in self.sources):
            raise ValueError("a backup report comes from a member, not the control plane")
        return self


class PackedCatalog(Strict):
    """``backup.catalog`` version 2, what the store records: the same reports and values as
    version 1, the columns packed into one string (``schemas.catalog``: a sha256 digest kept
    as its 32 bytes, the rest compressed, about 70 bytes a report where version 1 took about
    170 on disk). Validating it decodes ``packed`` and checks every value as its report's
    field is checked; ``columns`` gives them (decoded once)."""

    step: Step
    #: The reports it packs.
    count: Annotated[int, Field(ge=1, le=CATALOG_ENTRIES)]
    #: ``schemas.catalog.encode`` of the columns: zlib in unpadded base64url.
    packed: Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_-]+$", max_length=1 << 20)]
    _columns: CatalogColumns | None = PrivateAttr(default=None)

    @classmethod
    def of(cls, step: int, columns: CatalogColumns) -> PackedCatalog:
        """The catalog of ``columns`` (validated reports' values), built without validating
        again: its columns are kept as given."""
        body = cls.model_construct(step=step, count=len(columns), packed=encode(columns))
        body.__pydantic_private__ = {"_columns": columns}
        return body

    def columns(self) -> CatalogColumns:
        """Its reports as columns, each value as its member sent it."""
        columns = self._columns
        if columns is None:
            columns = decode(self.packed, self.count)
            self.__pydantic_private__ = {"_columns": columns}
        return columns

    @model_validator(mode="after")
    def _decodes(self) -> PackedCatalog:
        try:
            self.__pydantic_private__ = {"_columns": decode(self.packed, self.count)}
        except PackError as exc:
            raise ValueError(str(exc)) from None
        return self


class BackupReplicated(Strict):
    step: Step
    shard: NonNegInt
    owner: Ident
    nbytes: NonNegInt
    checksum: Checksum
    seconds: Seconds


class CheckpointSaved(Strict):
    """One shard of a cold checkpoint is durable (renamed into place)."""

    step: Step
    shard: NonNegInt
    #: Shards of the checkpoint at this step (the world size that wrote it).
    shards: Annotated[int, Field(ge=1, le=MAX_WORLD)]
    path: Text
    nbytes: NonNegInt
    checksum: Checksum
    seconds: Seconds


class MemberFault(Strict):
    kind: FaultKind
    detail: Text = ""
    step: Step | None = None
    #: Peers the reporter blames, e.g. the rank a collective lost its connection to.
    suspects: Annotated[list[Ident], Field(max_length=64)] = Field(default_factory=list)
    #: ``restore_failed`` only: the shard (of backup ``step``) whose copy was refused, and the
    #: member that served it (the reporter itself for its own memory): its copy does not match
    #: the digest the control plane recorded. Evidence against that copy, not that member.
    shard: NonNegInt | None = None
    source: Ident | None = None


class MemberExited(Strict):
    member: Ident
    exit_code: Int64 | None = None
    signal: Annotated[int, Field(ge=1, le=64)] | None = None
    #: The process that ended, as its launcher knows it: its pid and the incarnation the
    #: launcher gave it (``ELASTIC_INCARNATION``). The exit applies only to that process;
    #: absent (older launchers), to whichever process of the member joined last.
    pid: NonNegInt | None = None
    incarnation: Ident | None = None
    #: Why it ended, where its launcher knows: the generation whose command left it out of
    #: the world, for which the launcher killed it (fencing). A consequence of that
    #: decision, not a fault of its own (a counterfactual replay moves it with the decision).
    fenced_by: PositiveInt | None = None


class MemberLaunched(Strict):
    """A launcher started a member (from ``<node>/launcher``): its spare counts once it joins."""

    member: Ident
    role: Role
    pid: NonNegInt
    #: The incarnation the launcher gave the process (its events carry it); None: not said.
    incarnation: Ident | None = None


class CommandAcked(Strict):
    command_id: UUID


class CommandRefused(Strict):
    """A command a member did not obey: unsigned, or its signature did not verify."""

    #: The subject it came on.
    subject: ShortText
    reason: ShortText
    #: Its ``command_id``, when the refused bytes held a readable one (the forger's claim).
    command_id: UUID | None = None
    #: Refusals since the previous report that were not reported (reports are rate-limited).
    suppressed: NonNegInt = 0


class RestoreCompleted(Strict):
    generation: NonNegInt
    step: Step
    bytes: NonNegInt
    seconds: Seconds
    #: Shard -> member it was restored from (the member itself for local copies).
    sources: Annotated[dict[ShortText, Ident], Field(max_length=MAX_WORLD)] = Field(
        default_factory=dict
    )


class TrainResumed(Strict):
    generation: NonNegInt
    step: Step


class TrainCompleted(Strict):
    step: Step
    loss: Finite | None = None


#: The members holding copies of one shard.
Holders = Annotated[list[Ident], Field(max_length=8)]
#: ``placement[r]``: the holders of rank ``r``'s shard (its owner is ``world[r]``).
Placement = Annotated[list[Holders], Field(max_length=MAX_WORLD)]
#: A list of members written against the world in force where the event is folded (the
#: generation before): each item a member's name, or ``[i, j]``, that world's ranks ``i`` to
#: ``j - 1`` in order (``controlplane.core.compact``). A decision that keeps most of the world
#: records a few items, not a name per rank.
Spans = Annotated[list[Ident | tuple[NonNegInt, NonNegInt]], Field(max_length=MAX_WORLD)]
#: ``[r, holders]``: rank ``r``'s holders where they are not those its member had in the
#: generation before (every other rank keeps them).
PlacementChanges = Annotated[list[tuple[NonNegInt, Holders]], Field(max_length=MAX_WORLD)]


class GenerationStarted(Strict):
    generation: NonNegInt
    #: Rank -> member: ``world[r]`` is the member that runs rank ``r``; empty when
    #: ``world_spans`` gives it.
    world: Members
    rendezvous: ShortText
    placement: Placement = Field(default_factory=list)
    #: Why the placement falls short of the rule, when it does.
    placement_note: Text = ""
    #: The world against the one before (``Spans``), instead of ``world``.
    world_spans: Spans | None = None
    #: The placement as the ranks whose holders changed, instead of ``placement``.
    placement_changes: PlacementChanges | None = None


class Evidence(Strict):
    member: Ident
    what: ShortText
    position: NonNegInt | None = None
    at: Timestamp | None = None


class HeartbeatThreshold(Strict):
    """The heartbeat timeout a detection applied, and how it was derived: the policy's
    fixed value, or (``auto``) ``k`` times the ``quantile`` of the ``gaps`` heartbeat gaps
    the log showed in ``phase`` (``gap_s``), clamped to ``[floor_s, ceiling_s]``."""

    phase: Phase
    seconds: PositiveSeconds
    mode: Literal["fixed", "auto"]
    #: Gaps observed in the phase over the window (auto; below the minimum the fixed holds).
    gaps: NonNegInt = 0
    quantile: Annotated[float, Field(gt=0, le=1, allow_inf_nan=False)] | None = None
    gap_s: Seconds | None = None
    k: Annotated[float, Field(gt=0, allow_inf_nan=False)] | None = None
    floor_s: PositiveSeconds | None = None
    ceiling_s: PositiveSeconds | None = None
    #: The derivation in words ("timeout 2.4s = 3 x p99 gap 0.8s over 412 gaps ...").
    how: Text


class FaultDetected(Strict):
    incident_id: UUID
    members: Annotated[list[Ident], Field(min_length=1, max_length=MAX_WORLD)]
    reason: FaultReason
    detail: Text
    evidence: Annotated[list[Evidence], Field(max_length=1024)] = Field(default_factory=list)
    #: A heartbeat timeout's threshold in force for each member found silent, in
    #: ``members`` order (absent from detections recorded before, and of other reasons); of
    #: a ``stalled`` detection, the step timeout (phase train; ``gaps`` counts the longest
    #: steps it was derived from and ``gap_s`` is their quantile).
    thresholds: Annotated[list[HeartbeatThreshold], Field(max_length=MAX_WORLD)] | None = None


class AnomalyDetected(Strict):
    """A loss anomaly opened an incident (or joined the open one): no member failed; the
    job's state is what went wrong."""

    incident_id: UUID
    kind: AnomalyKind
    #: The step whose numbers went wrong (the first of the anomaly).
    step: Step
    #: The members that reported it (none for a spike, which the job's loss shows).
    members: Members = Field(default_factory=list)
    detail: Text
    evidence: Annotated[list[Evidence], Field(max_length=1024)] = Field(default_factory=list)
    #: A spike's loss and the threshold it crossed (median + k x MAD), None otherwise.
    loss: Finite | None = None
    threshold: Finite | None = None


class MemberSlow(Strict):
    """``member.slow``: a member of the world whose compute time per step stayed above the
    job's baseline over a window, the evidence, and what the policy made of it."""

    member: Ident
    rank: NonNegInt
    #: Its sustained compute time per step over the window (the least per-heartbeat mean).
    compute_s: ComputeSeconds
    #: The median of the other members' sustained compute times, their median absolute
    #: deviation, and the threshold it was judged against.
    baseline_s: ComputeSeconds
    mad_s: ComputeSeconds
    threshold_s: ComputeSeconds
    #: Members the baseline was taken over.
    peers: Annotated[int, Field(ge=1, le=MAX_WORLD)]
    window_s: Seconds
    #: The ``liveness.summary`` that recorded the compute times (its position).
    evidence: Evidence
    action: Literal["ignore", "replace"]
    #: The numbers behind ``action``: the goodput projected lost, and a recovery's cost.
    projected_loss_s: Seconds
    recovery_cost_s: Seconds
    reason: Text


class JobStateChanged(Strict):
    from_: JobState = Field(alias="from")
    to: JobState
    reason: Text


class ReallocationIssued(Strict):
    incident_id: UUID
    command_id: UUID
    generation: NonNegInt
    mode: ReallocationMode
    world: Members
    restore_step: Step
    restore_from: RestoreFrom = RestoreFrom.MEMORY
    #: ``plan[s]``: the member shard ``s`` of the restore step is taken from (the member
    #: itself when it holds it); empty when restoring from a checkpoint or the initial state.
    plan: Members = Field(default_factory=list)
    #: ``digests[s]``: the digest shard ``s``'s owner reported for the restore step (its copy
    #: must hash to it); parallel to ``plan``. Recorded by deciders before fold revision 5;
    #: now empty: the fold takes them from the backup catalog the log holds.
    digests: Annotated[list[Checksum], Field(max_length=MAX_WORLD)] = Field(default_factory=list)
    rendezvous: ShortText
    reason: Text
    #: Members of the replicas a mesh-aware shrink dropped that survive: not in ``world``,
    #: they stay up as warm spares (no one fences them).
    demoted: Members = Field(default_factory=list)
    #: ``world`` and ``plan`` against the world in force (``Spans``), instead of the lists.
    world_spans: Spans | None = None
    plan_spans: Spans | None = None
    #: The steps the new generation's loop does not run: every range the job's rollbacks
    #: skipped so far, this decision's included (a newcomer learns them here).
    skip: StepRanges = Field(default_factory=list)


class IncidentResolved(Strict):
    incident_id: UUID
    #: Phase name -> seconds, in timeline order.
    phases: dict[ShortText, Seconds] = Field(default_factory=dict)
    downtime_s: Seconds
    steps_lost: NonNegInt


class JobStopped(Strict):
    reason: Text


class JobCompleted(Strict):
    step: Step | None = None


# --------------------------------------------------------------------------- envelope


class EnvelopeBase(Strict):
    """Fields every event carries; the store adds ``position`` and ``recorded_at``."""

    event_id: EventId
    job_id: Ident
    type: str
    v: int
    source: Source
    #: Identifies one run of the producing process; ``seq`` restarts with it.
    incarnation: Ident
    seq: PositiveInt
    generation: NonNegInt
    emitted_at: Timestamp
    payload: Any

    @property
    def member(self) -> str | None:
        """Member id of the producer, or None for the control plane."""
        _, sep, member = self.source.partition("/")
        return member if sep else None


class JobRegisteredEvent(EnvelopeBase):
    """``job.registered``, version 1."""

    type: Literal["job.registered"]
    v: Literal[1]
    payload: JobRegistered


class MemberJoinedEvent(EnvelopeBase):
    """``member.joined``, version 1."""

    type: Literal["member.joined"]
    v: Literal[1]
    payload: MemberJoined


class MemberHeartbeatEvent(EnvelopeBase):
    """``member.heartbeat``, version 1."""

    type: Literal["member.heartbeat"]
    v: Literal[1]
    payload: MemberHeartbeat


class TrainStepEvent(EnvelopeBase):
    """``train.step``, version 1."""

    type: Literal["train.step"]
    v: Literal[1]
    payload: TrainStep


class BackupSnapshotEvent(EnvelopeBase):
    """``backup.snapshot``, version 1."""

    type: Literal["backup.snapshot"]
    v: Literal[1]
    payload: BackupSnapshot


class BackupCatalogEvent(EnvelopeBase):
    """``backup.catalog`` (recorded by the store, an observation): version 2 packed
    (``PackedCatalog``, what the store writes), version 1 in JSON lists (``BackupCatalog``,
    logs recorded before)."""

    type: Literal["backup.catalog"]
    v: Literal[1, 2]
    payload: PackedCatalog | BackupCatalog

    @model_validator(mode="after")
    def _form_of_version(self) -> BackupCatalogEvent:
        if (self.v == 2) != isinstance(self.payload, PackedCatalog):
            raise ValueError(f"a backup.catalog of version {self.v} in the other version's form")
        return self


class BackupReplicatedEvent(EnvelopeBase):
    """``backup.replicated``, version 1."""

    type: Literal["backup.replicated"]
    v: Literal[1]
    payload: BackupReplicated


class CheckpointSavedEvent(EnvelopeBase):
    """``checkpoint.saved``, version 1."""

    type: Literal["checkpoint.saved"]
    v: Literal[1]
    payload: CheckpointSaved


class MemberFaultEvent(EnvelopeBase):
    """``member.fault``, version 1."""

    type: Literal["member.fault"]
    v: Literal[1]
    payload: MemberFault


class MemberExitedEvent(EnvelopeBase):
    """``member.exited``, version 1."""

    type: Literal["member.exited"]
    v: Literal[1]
    payload: MemberExited


class MemberLaunchedEvent(EnvelopeBase):
    """``member.launched``, version 1."""

    type: Literal["member.launched"]
    v: Literal[1]
    payload: MemberLaunched


class CommandAckedEvent(EnvelopeBase):
    """``command.acked``, version 1."""

    type: Literal["command.acked"]
    v: Literal[1]
    payload: CommandAcked


class CommandRefusedEvent(EnvelopeBase):
    """``command.refused``, version 1."""

    type: Literal["command.refused"]
    v: Literal[1]
    payload: CommandRefused


class RestoreCompletedEvent(EnvelopeBase):
    """``restore.completed``, version 1."""

    type: Literal["restore.completed"]
    v: Literal[1]
    payload: RestoreCompleted


class TrainResumedEvent(EnvelopeBase):
    """``train.resumed``, version 1."""

    type: Literal["train.resumed"]
    v: Literal[1]
    payload: TrainResumed


class TrainCompletedEvent(EnvelopeBase):
    """``train.completed``, version 1."""

    type: Literal["train.completed"]
    v: Literal[1]
    payload: TrainCompleted


class GenerationStartedEvent(EnvelopeBase):
    """``generation.started``, version 1."""

    type: Literal["generation.started"]
    v: Literal[1]
    payload: GenerationStarted


class FaultDetectedEvent(EnvelopeBase):
    """``fault.detected``, version 1."""

    type: Literal["fault.detected"]
    v: Literal[1]
    payload: FaultDetected


class TrainAnomalyEvent(EnvelopeBase):
    """``train.anomaly``, version 1."""

    type: Literal["train.anomaly"]
    v: Literal[1]
    payload: TrainAnomaly


class AnomalyDetectedEvent(EnvelopeBase):
    """``anomaly.detected``, version 1."""

    type: Literal["anomaly.detected"]
    v: Literal[1]
    payload: AnomalyDetected


class MemberSlowEvent(EnvelopeBase):
    """``member.slow``, version 1."""

    type: Literal["member.slow"]
    v: Literal[1]
    payload: MemberSlow


class JobStateChangedEvent(EnvelopeBase):
    """``job.state_changed``, version 1."""

    type: Literal["job.state_changed"]
    v: Literal[1]
    payload: JobStateChanged


class ReallocationIssuedEvent(EnvelopeBase):
    """``reallocation.issued``, version 1."""

    type: Literal["reallocation.issued"]
    v: Literal[1]
    payload: ReallocationIssued


class IncidentResolvedEvent(EnvelopeBase):
    """``incident.resolved``, version 1."""

    type: Literal["incident.resolved"]
    v: Literal[1]
    payload: IncidentResolved


class LivenessSummaryEvent(EnvelopeBase):
    """``liveness.summary``, version 1 (an observation, not a decision)."""

    type: Literal["liveness.summary"]
    v: Literal[1]
    payload: LivenessSummary


class JobStoppedEvent(EnvelopeBase):
    """``job.stopped``, version 1."""

    type: Literal["job.stopped"]
    v: Literal[1]
    payload: JobStopped


class JobCompletedEvent(EnvelopeBase):
    """``job.completed``, version 1."""

    type: Literal["job.completed"]
    v: Literal[1]
    payload: JobCompleted


#: Events only members (and their launchers) publish.
MEMBER_EVENT_TYPES: dict[str, type[Strict]] = {
    "member.joined": MemberJoined,
    "member.heartbeat": MemberHeartbeat,
    "train.step": TrainStep,
    "backup.snapshot": BackupSnapshot,
    "backup.replicated": BackupReplicated,
    "checkpoint.saved": CheckpointSaved,
    "member.fault": MemberFault,
    "member.exited": MemberExited,
    "member.launched": MemberLaunched,
    "command.acked": CommandAcked,
    "command.refused": CommandRefused,
    "restore.completed": RestoreCompleted,
    "train.resumed": TrainResumed,
    "train.completed": TrainCompleted,
    "train.anomaly": TrainAnomaly,
}
#: Decisions only the control plane records.
CONTROLPLANE_EVENT_TYPES: dict[str, type[Strict]] = {
    "job.registered": JobRegistered,
    "generation.started": GenerationStarted,
    "fault.detected": FaultDetected,
    "anomaly.detected": AnomalyDetected,
    "member.slow": MemberSlow,
    "job.state_changed": JobStateChanged,
    "reallocation.issued": ReallocationIssued,
    "incident.resolved": IncidentResolved,
    "job.stopped": JobStopped,
    "job.completed": JobCompleted,
    "liveness.summary": LivenessSummary,
    "backup.catalog": PackedCatalog,
}
#: What the control plane records that it observed, not decided: replay folds them as inputs.
OBSERVATION_TYPES = frozenset({"liveness.summary", "backup.catalog"})
#: Every event type -> the schema versions this build understands.
SCHEMA_VERSIONS: dict[str, frozenset[int]] = {
    t: frozenset({1}) for t in (*MEMBER_EVENT_TYPES, *CONTROLPLANE_EVENT_TYPES)
}
SCHEMA_VERSIONS["backup.catalog"] = frozenset({1, 2})

Event = Annotated[
    Union[  # noqa: UP007 - a runtime union of generated classes
        JobRegisteredEvent,
        MemberJoinedEvent,
        MemberHeartbeatEvent,
        TrainStepEvent,
        BackupSnapshotEvent,
        BackupReplicatedEvent,
        CheckpointSavedEvent,
        MemberFaultEvent,
        MemberExitedEvent,
        MemberLaunchedEvent,
        CommandAckedEvent,
        CommandRefusedEvent,
        RestoreCompletedEvent,
        TrainResumedEvent,
        TrainCompletedEvent,
        TrainAnomalyEvent,
        GenerationStartedEvent,
        FaultDetectedEvent,
        AnomalyDetectedEvent,
        MemberSlowEvent,
        JobStateChangedEvent,
        ReallocationIssuedEvent,
        IncidentResolvedEvent,
        JobStoppedEvent,
        JobCompletedEvent,
        LivenessSummaryEvent,
        BackupCatalogEvent,
    ],
    Field(discriminator="type"),
]

EVENT_ADAPTER: TypeAdapter[EnvelopeBase] = TypeAdapter(Event)

#: Every event type -> its envelope class.
EVENT_CLASSES: dict[str, type[EnvelopeBase]] = {
    cls.model_fields["type"].annotation.__args__[0]: cls  # type: ignore[union-attr]
    for cls in EnvelopeBase.__subclasses__()
}
