"""Which step a job restores to after a fault, and where each shard's state comes from.

The restore step is the newest backup step of the current timeline (``of_current_timeline``:
taken by a generation no later generation rolled back past, with a shard per rank of the world
that took it) for which every shard has a checksum-verified copy on a surviving member (the
owner's own snapshot counts while the owner survives; a member that rejoined as a new process
lost whatever its earlier process held). Each shard
then comes from the member that will run it if that member holds a copy (local memory), else
from a surviving holder on the same node, then the same rack, then anywhere, the least used
source first, so one holder does not serve every shard (members in ``avoid``, survivors that
leave the world such as those of a replica a shrink dropped, serve only shards no one else
holds). A copy that a restore refused (it did
not hash to the digest its owner reported: ``ShardBackup.refuted``) is never a source again.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence, Set
from dataclasses import dataclass
from typing import Protocol, cast

from controlplane.core.view import Decision, JobView, ShardBackup, StepBackup


class Located(Protocol):
    """Where a member runs (a ``Slot``, or the view's ``Member``)."""

    @property
    def node(self) -> str: ...

    @property
    def rack(self) -> str: ...


@dataclass(frozen=True, slots=True)
class RestorePlan:
    """The step to roll back to and, per shard, the member to take it from."""

    step: int
    generation: int
    #: ``sources[s]``: the member to take shard ``s`` from.
    sources: tuple[str, ...]


def surviving_copies(
    shard: ShardBackup, survivors: Set[str], since: Mapping[str, int] | None = None
) -> list[str]:
    """Surviving members with a verified copy of ``shard`` (the owner first).

    ``since`` maps a member to the log position its current process joined at: a copy
    reported before that belonged to an earlier process of the same name and is gone.
    """
    if shard.checksum is None:
        return []
    refuted = shard.refuted

    def holds(member: str, position: int | None) -> bool:
        if member not in survivors or (refuted and member in refuted):
            return False
        return since is None or position is None or position > since.get(member, 0)

    owner = shard.owner
    first = [owner] if owner is not None and holds(owner, shard.snapshot_position) else []
    return first + [
        h for h in shard.verified_holders() if h != owner and holds(h, shard.replicas[h].position)
    ]


def restorable(
    backup: StepBackup, survivors: Set[str], since: Mapping[str, int] | None = None
) -> bool:
    """Every shard of ``backup`` has a verified copy on a survivor."""
    if len(backup.shards) < backup.num_shards:
        return False
    return all(surviving_copies(s, survivors, since) for s in backup.shards.values())


def plan_restore(
    view: JobView,
    survivors: Set[str],
    receivers: Mapping[int, str],
    slots: Mapping[str, Located],
    avoid: Set[str] = frozenset(),
    *,
    before: int | None = None,
) -> RestorePlan | None:
    """The newest restorable step (strictly before ``before``, when given: a rollback's) and
    a source per shard; None when no hot copy is whole.

    ``receivers`` maps each shard to the member that will need it (its new owner);
    ``slots`` locates members on nodes and racks; a survivor in ``avoid`` is a source only
    of a shard no other survivor holds.
    """
    staying = set(receivers.values())
    members = view.members
    since = {k: m.joined_position for k, m in members.items()}
    for step in sorted(view.backups, reverse=True):
        if before is not None and step >= before:
            continue
        backup = view.backups[step]
        if not of_current_timeline(view, backup):
            continue
        sources = _sources(
            backup,
            survivors=survivors,
            since=since,
            staying=staying,
            receivers=receivers,
            slots=slots,
            avoid=avoid,
            unreported=_unreported(view, backup, survivors, since),
        )
        if sources is not None:
            return RestorePlan(step, backup.generation, sources)
    return None


def _unreported(
    view: JobView, backup: StepBackup, survivors: Set[str], since: Mapping[str, int]
) -> dict[int, list[str]]:
    """Shard -> the surviving members the current placement gave copies of it to, for the
    shards of ``backup`` whose owner's report never came because the owner is gone: a member
    cut off from the control plane (its reports unheard while it trained on with its peers),
    or one that died before its report left. Only for a backup of the current generation that
    the job went past (a later step was reported, or heartbeats carried a step at least two
    later: every rank, the silent owner too, took a later step's collectives), whose every
    other shard its owner reported; a holder's process must have joined before the step's
    first report. Empty when none applies. The heartbeats count because the member that
    reports the job's steps (rank 0) may be the one cut off: then no step is reported.

    Such a copy's digest is only the one its holder keeps (its owner's claim, under the job's
    secret): a plan with one restores without the owners' digests (``restore_digests``).
    One a restore found missing is refuted and never planned from again."""
    world = view.world
    past = max(view.last_step, view.heard_step - 1)
    if backup.generation != view.generation or backup.step >= past:
        return {}
    placement = view.placement
    shards = backup.shards
    missing = [
        n for n in range(backup.num_shards) if (s := shards.get(n)) is None or s.checksum is None
    ]
    if not missing or len(missing) == backup.num_shards or len(placement) != len(world):
        return {}
    reported = [s.snapshot_position for s in shards.values() if s.snapshot_position is not None]
    first = min(reported, default=None)
    if first is None:
        return {}
    out: dict[int, list[str]] = {}
    for n in missing:
        if n >= len(world) or world[n] in survivors:
            return {}  # its owner lives (and may report yet)
        refuted = shards[n].refuted if n in shards else ()
        holders = [
            h
            for h in placement[n]
            if h in survivors and h not in refuted and since.get(h, 0) < first
        ]
        if not holders:
            return {}
        out[n] = holders
    return out


def of_current_timeline(view: JobView, backup: StepBackup) -> bool:
    """Whether ``backup`` is a state of the current timeline, whole in its own world: the
    generation that took it started a world of ``num_shards`` ranks, and no later generation
    restored an older step (which abandoned it). Any such step can be restored into the
    current world, whatever its size (the state is re-partitioned)."""
    record = view.started(backup.generation)
    return (
        record is not None
        and record.world_size == backup.num_shards
        and view.on_timeline(backup.generation, backup.step)
    )


def _sources(
    backup: StepBackup,
    *,
    survivors: Set[str],
    since: Mapping[str, int],
    staying: Set[str],
    receivers: Mapping[int, str],
    slots: Mapping[str, Located],
    avoid: Set[str] = frozenset(),
    unreported: Mapping[int, list[str]] | None = None,
) -> tuple[str, ...] | None:
    """A source per shard of ``backup``, or None when some shard has no surviving copy.
    ``unreported``: shards whose owner's report never came, and where copies were sent
    (``_unreported``)."""
    if unreported:
        return _sources_unreported(backup, unreported, survivors=survivors, since=since,
                                   receivers=receivers, slots=slots, avoid=avoid)  # fmt: skip
    numbers = range(backup.num_shards)
    if not all(map(backup.shards.__contains__, numbers)):
        return None
    present = list(map(backup.shards.__getitem__, numbers))
    if None in [s.checksum for s in present]:
        return None
    # Each owner is set with its snapshot (a checksum, above).
    owners = cast("list[str]", [s.owner for s in present])
    snapshots = [s.snapshot_position or 0 for s in present]
    # The common case, tested for every shard at once: an owner that stays in the world and
    # survives keeps its shard in its own memory (even where ranks moved: a shrink, or a
    # backup of an older generation) if its current process took the snapshot.
    home = set(staying).intersection(survivors)
    # The joins of ``home`` by subscript (``plan_restore`` gives every member's; one it does
    # not know counts as joined at 0).
    joins = since if home <= since.keys() else {m: since.get(m, 0) for m in home}
    elsewhere = [
        shard_no
        for shard_no, owner, snapshot in zip(range(len(owners)), owners, snapshots, strict=True)
        if owner not in home or snapshot <= joins[owner]
    ]
    # An owner whose own copy a restore refused (its memory does not match its report).
    refuted = [n for n in numbers if present[n].refuted and owners[n] in present[n].refuted]
    if refuted:
        elsewhere = sorted({*elsewhere, *refuted})
    sources = owners  # its owner, but ``elsewhere``: replaced below
    # The rest in shard order, each from the closest surviving copy, the least used source
    # first (counted in C, over the sources chosen before it, only when needed).
    served: Counter[str] = Counter()
    counted = 0
    for shard_no in elsewhere:
        shard = present[shard_no]
        owner = owners[shard_no]
        receiver = owner if owner in staying else receivers.get(shard_no)
        copies = surviving_copies(shard, survivors, since)
        if not copies:
            return None
        served.update(sources[counted:shard_no])
        counted = shard_no
        sources[shard_no] = _closest(copies, receiver, slots, served, owner, avoid=avoid)
    return tuple(sources)


def _sources_unreported(
    backup: StepBackup,
    unreported: Mapping[int, list[str]],
    *,
    survivors: Set[str],
    since: Mapping[str, int],
    receivers: Mapping[int, str],
    slots: Mapping[str, Located],
    avoid: Set[str],
) -> tuple[str, ...] | None:
    """``_sources`` for a backup with shards whose owner's report never came (rare: no fast
    path); their owners are gone, so every shard comes from a copy somewhere."""
    served: Counter[str] = Counter()
    out: list[str] = []
    for n in range(backup.num_shards):
        shard = backup.shards.get(n)
        guessed = unreported.get(n)
        if guessed is not None:
            copies = guessed
            owner = None
        elif shard is None:
            return None
        else:
            copies = surviving_copies(shard, survivors, since)
            owner = shard.owner
        if not copies:
            return None
        source = _closest(copies, receivers.get(n), slots, served, owner, avoid=avoid)
        served[source] += 1
        out.append(source)
    return tuple(out)


def restore_digests(view: JobView, step: int, sources: Sequence[str]) -> tuple[str, ...]:
    """What each shard of backup ``step`` must hash to: its owner's reported digest, parallel
    to ``sources`` (empty without sources: a restore from a checkpoint or the initial state)."""
    backup = view.backups.get(step)
    if not sources or backup is None:
        return ()
    shards = backup.shards
    digests = [shards[n].checksum if n in shards else None for n in range(len(sources))]
    return () if None in digests else cast("tuple[str, ...]", tuple(digests))


def refused_sources(view: JobView, decision: Decision) -> list[tuple[int, str]]:
    """(shard, source) of ``decision``'s plan whose copy a restore has since refused."""
    backup = view.backups.get(decision.restore_step)
    if backup is None or not decision.plan:
        return []
    out = []
    for shard_no, shard in backup.shards.items():
        if shard.refuted and shard_no < len(decision.plan):
            source = decision.plan[shard_no]
            if source in shard.refuted:
                out.append((shard_no, source))
    return sorted(out)


def _closest(
    copies: list[str],
    receiver: str | None,
    slots: Mapping[str, Located],
    served: Mapping[str, int],
    owner: str | None = None,
    *,
    avoid: Set[str] = frozenset(),
) -> str:
    if receiver is not None and receiver in copies:
        return receiver  # already in its own memory
    if avoid:
        copies = [c for c in copies if c not in avoid] or copies
    here = slots.get(receiver) if receiver is not None else None

    def distance(member: str) -> tuple[int, int, bool, str]:
        slot = slots.get(member)
        if here is None or slot is None:
            near = 2
        elif slot.node == here.node:
            near = 0
        elif slot.rack == here.rack:
            near = 1
        else:
            near = 2
        # Ties: the owner's own copy, then by name; never by the order the copies were
        # reported in (simultaneous reports reach the log in any order).
        return (near, served.get(member, 0), member != owner, member)

    return min(copies, key=distance)
