"""Commands the control plane publishes on ``elastic.cmd.<job>.<member|all>``."""

from __future__ import annotations

from typing import Annotated, Literal, Union
from uuid import UUID

from pydantic import AwareDatetime, Field, TypeAdapter

from schemas.common import (
    MAX_WORLD,
    Checksum,
    Ident,
    NonNegInt,
    ReallocationMode,
    RestoreFrom,
    ShortText,
    Step,
    Strict,
    Text,
)
from schemas.events import Members, Placement


class CommandBase(Strict):
    """Fields every command carries."""

    command_id: UUID
    job_id: Ident
    #: Position of the decision event in the log that this command publishes.
    decision_position: NonNegInt
    issued_at: AwareDatetime


#: Member -> ``host:port`` of its peer store (where its backup copies are sent and fetched).
Endpoints = Annotated[dict[str, ShortText], Field(max_length=65_536)]


class WorldCommand(CommandBase):
    """Fields of a command that forms a generation: ``world[r]`` runs rank ``r``."""

    generation: NonNegInt
    world: Members
    #: ``placement[r]``: the members that hold copies of rank ``r``'s shard.
    placement: Placement = Field(default_factory=list)
    rendezvous: ShortText
    endpoints: Endpoints = Field(default_factory=dict)


class Reallocate(WorldCommand):
    """Re-form the world as ``generation`` and restore ``restore_step``."""

    kind: Literal["reallocate"] = "reallocate"
    incident_id: UUID
    mode: ReallocationMode
    restore_step: Step
    restore_from: RestoreFrom
    #: ``plan[s]``: the member to take shard ``s`` of the restore step from.
    plan: Members
    #: ``digests[s]``: what shard ``s`` must hash to (``<alg>:<hex>``, its owner's report);
    #: a copy that does not is refused. Empty from a control plane that records none.
    digests: Annotated[list[Checksum], Field(max_length=MAX_WORLD)] = Field(default_factory=list)


class Start(WorldCommand):
    """Form the first generation."""

    kind: Literal["start"] = "start"


class Stop(CommandBase):
    """Stop training; the job cannot go on."""

    kind: Literal["stop"] = "stop"
    reason: Text


Command = Annotated[Union[Start, Reallocate, Stop], Field(discriminator="kind")]  # noqa: UP007
COMMAND_ADAPTER: TypeAdapter[Start | Reallocate | Stop] = TypeAdapter(Command)
