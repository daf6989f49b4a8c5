"""Wire contracts: the event envelope, every event and command, and their JSON Schema.

Pydantic v2 models only: no I/O and no logic beyond validation.
"""

from schemas.commands import COMMAND_ADAPTER, Command, Reallocate, Stop
from schemas.common import CONTROLPLANE_SOURCE, MAX_EVENT_BYTES, JobState, Phase, Role
from schemas.events import (
    CONTROLPLANE_EVENT_TYPES,
    EVENT_ADAPTER,
    MEMBER_EVENT_TYPES,
    SCHEMA_VERSIONS,
    EnvelopeBase,
    Event,
    JobPolicy,
)

__all__ = [
    "COMMAND_ADAPTER",
    "CONTROLPLANE_EVENT_TYPES",
    "CONTROLPLANE_SOURCE",
    "EVENT_ADAPTER",
    "MAX_EVENT_BYTES",
    "MEMBER_EVENT_TYPES",
    "SCHEMA_VERSIONS",
    "Command",
    "EnvelopeBase",
    "Event",
    "JobPolicy",
    "JobState",
    "Phase",
    "Reallocate",
    "Role",
    "Stop",
]
