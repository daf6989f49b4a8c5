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
from schemas.events import MAX_MESH_DIMS, Members, MeshDegree, MeshDimName, Placement, StepRanges

#: A generation's mesh: dimension -> degree, outermost first (rank ``r`` is at the row-major
#: coordinate of ``r``); after a shrink the replica dimension holds fewer replicas.
MeshDegrees = Annotated[dict[MeshDimName, MeshDegree], Field(max_length=MAX_MESH_DIMS)]


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
    #: ``incarnations[r]``: the process of ``world[r]`` the generation is for (its
    #: ``member.joined``'s incarnation). Another process of that name (a launcher restarted
    #: with its pod) is not named by it: it waits until a generation names it. Empty from a
    #: control plane that did not say.
    incarnations: Members = Field(default_factory=list)
    #: The generation's mesh (``JobPolicy.mesh`` at this generation's size: its replica
    #: dimension shrunk or grown by whole replicas); None for a flat world.
    mesh: MeshDegrees | None = None


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
    #: Members of the replicas this shrink dropped that survive: not in ``world``, they become
    #: warm spares (not to be fenced, nor told the job goes on without them).
    demoted: Members = Field(default_factory=list)
    #: Steps the loop does not run from now on (inclusive ranges): the batches the job's
    #: rollbacks skipped (``ReallocationIssued.skip``).
    skip: StepRanges = Field(default_factory=list)


class Start(WorldCommand):
    """Form the first generation."""

    kind: Literal["start"] = "start"


#: How a job ended, as a ``Stop`` says: ``completed`` (training reached its last step) or
#: ``stopped`` (the job could not go on).
JobOutcome = Literal["completed", "stopped"]


class Stop(CommandBase):
    """Stop training: the job ended (completed, or it cannot go on); members still alive
    leave."""

    kind: Literal["stop"] = "stop"
    reason: Text
    #: The job's end (its state, COMPLETED or STOPPED); what a launcher exits with. None from a
    #: control plane that does not say (the launcher then judges by its members' exits).
    outcome: JobOutcome | None = None


Command = Annotated[Union[Start, Reallocate, Stop], Field(discriminator="kind")]  # noqa: UP007
COMMAND_ADAPTER: TypeAdapter[Start | Reallocate | Stop] = TypeAdapter(Command)
