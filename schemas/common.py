"""Shared field types and limits for every wire model."""

from __future__ import annotations

from datetime import UTC, datetime
from enum import StrEnum
from typing import Annotated

from pydantic import AfterValidator, AwareDatetime, BaseModel, ConfigDict, Field, StringConstraints

# An identifier must be a single NATS subject token: no dots, spaces or wildcards.
IDENT_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$"
SOURCE_PATTERN = r"^(controlplane|[A-Za-z0-9][A-Za-z0-9_-]{0,63}/[A-Za-z0-9][A-Za-z0-9_-]{0,63})$"

CONTROLPLANE_SOURCE = "controlplane"

#: Largest encoded event a member may publish; larger ones are dead-lettered.
MAX_EVENT_BYTES = 64 * 1024
#: Largest number of members a single job's world may list.
MAX_WORLD = 65_536
MAX_TEXT = 4096

#: What PostgreSQL's ``bigint`` holds (``seq``, ``generation``, positions; jsonb numbers are
#: kept to it too, so every integer a member sends reads back as a machine integer).
INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1
#: Instants PostgreSQL's ``timestamptz`` stores and psycopg reads back into a ``datetime``
#: (whatever the session's time zone): a day inside Python's years 1 to 9999, in UTC.
EARLIEST = datetime(1, 1, 2, tzinfo=UTC)
LATEST = datetime(9999, 12, 30, tzinfo=UTC)


def storable_text(value: str) -> str:
    """Refuse what PostgreSQL's ``text`` and ``jsonb`` cannot hold: the NUL character.

    Lone surrogates never get this far: pydantic refuses them (``string_unicode``) and JSON
    parsing refuses their escapes (``json_invalid``).
    """
    if "\x00" in value:
        at = value.index("\x00")
        raise ValueError(f"NUL character (U+0000) at offset {at}: PostgreSQL text cannot hold it")
    return value


Ident = Annotated[str, StringConstraints(pattern=IDENT_PATTERN)]
#: A UUID in canonical form (lowercase, hyphenated): the idempotency key of an event.
EventId = Annotated[
    str,
    StringConstraints(pattern=r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$"),
]
Source = Annotated[str, StringConstraints(pattern=SOURCE_PATTERN)]
ShortText = Annotated[str, StringConstraints(max_length=256), AfterValidator(storable_text)]
Text = Annotated[str, StringConstraints(max_length=MAX_TEXT), AfterValidator(storable_text)]
Checksum = Annotated[str, StringConstraints(pattern=r"^[a-z0-9]{1,16}:[0-9a-f]{1,128}$")]
Int64 = Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)]
Step = Annotated[int, Field(ge=0, le=INT64_MAX)]
NonNegInt = Annotated[int, Field(ge=0, le=INT64_MAX)]
PositiveInt = Annotated[int, Field(ge=1, le=INT64_MAX)]
#: A finite float (JSON has no NaN or infinity; ``1e999`` parses as infinity and is refused).
Finite = Annotated[float, Field(allow_inf_nan=False)]
#: An aware time PostgreSQL stores and reads back (bounds checked in pydantic-core: a Python
#: validator here cost 1.3 us per event, five times the parsing).
Timestamp = Annotated[AwareDatetime, Field(ge=EARLIEST, le=LATEST)]
Seconds = Annotated[float, Field(ge=0, allow_inf_nan=False)]
PositiveSeconds = Annotated[float, Field(gt=0, allow_inf_nan=False)]
#: A member's compute time of one step, as it reports it: finite, non-negative, at most an hour.
ComputeSeconds = Annotated[float, Field(ge=0, le=3600, allow_inf_nan=False)]


class Strict(BaseModel):
    """Base of every wire model: immutable, strict, unknown fields rejected."""

    model_config = ConfigDict(
        extra="forbid",
        frozen=True,
        strict=True,
        validate_by_name=True,
        validate_by_alias=True,
        serialize_by_alias=True,
    )


class JobState(StrEnum):
    """States of a job; see the state machine in DESIGN.md."""

    PENDING = "PENDING"
    RUNNING = "RUNNING"
    DEGRADED = "DEGRADED"
    REALLOCATING = "REALLOCATING"
    RECOVERING = "RECOVERING"
    COMPLETED = "COMPLETED"
    STOPPED = "STOPPED"


class Role(StrEnum):
    """What a member process is for."""

    WORKER = "worker"
    SPARE = "spare"


class Phase(StrEnum):
    """What a member reported doing in its last heartbeat."""

    INIT = "init"
    TRAIN = "train"
    BACKUP = "backup"
    RESTORE = "restore"
    WAITING = "waiting"


class FaultKind(StrEnum):
    """What a member saw go wrong."""

    COLLECTIVE_ERROR = "collective_error"
    EXCEPTION = "exception"
    OOM = "oom"
    NAN_LOSS = "nan_loss"
    TIMEOUT = "timeout"
    #: Restoring after a reallocation failed: the plan's source could not be reached.
    RESTORE_FAILED = "restore_failed"
    OTHER = "other"


class FaultReason(StrEnum):
    """Why the control plane considers a member failed."""

    EXITED = "exited"
    REPORTED = "reported"
    HEARTBEAT_TIMEOUT = "heartbeat_timeout"
    #: It did not finish its part of a recovery before the policy's deadline.
    RECOVERY_DEADLINE = "recovery_deadline"
    #: Its compute time per step stayed above the job's baseline (``member.slow``) and the
    #: policy replaces it (``slow_action``).
    SLOW = "slow"
    #: Peers whose gradients of a step were ready waited in its collectives for it longer
    #: than the step timeout (docs/design.md, "Stalled steps").
    STALLED = "stalled"


class ReallocationMode(StrEnum):
    """How a job goes on after a fault."""

    REPLACE = "replace"
    SHRINK = "shrink"
    GROW = "grow"
    #: The same world goes back to an older backup (a loss anomaly: a non-finite loss or
    #: gradient norm, a loss spike); no member failed.
    ROLLBACK = "rollback"


class AnomalyKind(StrEnum):
    """What went wrong with a step's numbers while every process was well."""

    #: A rank's loss was NaN or infinite (reported by the rank).
    NON_FINITE_LOSS = "non_finite_loss"
    #: A rank's gradient norm was NaN or infinite (reported by the rank).
    NON_FINITE_GRAD_NORM = "non_finite_grad_norm"
    #: The job's loss rose above its robust threshold (found by the control plane).
    LOSS_SPIKE = "loss_spike"


#: What ranks report themselves; a spike is the control plane's to find.
REPORTED_ANOMALIES = frozenset({AnomalyKind.NON_FINITE_LOSS, AnomalyKind.NON_FINITE_GRAD_NORM})


class AnomalyAction(StrEnum):
    """What a loss anomaly leads to (``JobPolicy.anomaly_action``)."""

    #: Roll back in process to the newest complete backup before it, skipping the batches
    #: of the policy's window.
    ROLLBACK = "rollback"
    #: Stop the job.
    STOP = "stop"


class RestoreFrom(StrEnum):
    """Where the restore step's state comes from."""

    MEMORY = "memory"
    CHECKPOINT = "checkpoint"
    #: Nothing was ever backed up: every rank rebuilds the initial state from the seed.
    INITIAL = "initial"
