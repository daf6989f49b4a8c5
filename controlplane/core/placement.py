"""Where each shard's hot backups live: deterministic, topology-aware, balanced.

The rule (DESIGN.md): ``redundancy`` holders per shard, one on another node of the owner's rack
(fast to reach, survives the owner's node), the rest in other racks (survive a rack), spread
over as many racks as possible. With a single holder, it goes to another rack: a copy that
survives losing a rack beats a nearby one, and no shard should have every copy in one rack.

Ties are broken by load, then by distance along the ring of ranks, so the result is a pure
function of the world and never random. When the topology cannot satisfy the rule, the best
available placement is made and the note says why.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

#: Shortfalls spelled out in a placement note before the rest are only counted.
_NOTE_DETAILS = 8


@dataclass(frozen=True, slots=True)
class Slot:
    """A member of the world and where it runs."""

    member: str
    node: str
    rack: str


@dataclass(frozen=True, slots=True)
class Shard:
    """One rank's shard and the members holding its copies."""

    shard: int
    owner: str
    holders: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Placement:
    """Holders for every shard, and why the rule was not met where it was not."""

    shards: tuple[Shard, ...]
    note: str = ""

    def load(self) -> dict[str, int]:
        """How many shards each member holds a copy of."""
        out: dict[str, int] = {}
        for shard in self.shards:
            for holder in shard.holders:
                out[holder] = out.get(holder, 0) + 1
        return out


def place(world: Sequence[Slot], redundancy: int) -> Placement:
    """Choose ``redundancy`` holders for the shard of each rank ``r`` (owned by ``world[r]``)."""
    if redundancy < 0:
        raise ValueError("redundancy must be >= 0")
    members = [s.member for s in world]
    if len(set(members)) != len(members):
        raise ValueError("a member appears twice in the world")
    n = len(world)
    load = [0] * n
    shortfalls: list[str] = []
    shards = []
    for r, owner in enumerate(world):

        def key(i: int, r: int = r) -> tuple[int, int]:
            return (load[i], (i - r) % n)

        chosen: list[int] = []
        same_rack = [
            i for i in range(n) if world[i].rack == owner.rack and world[i].node != owner.node
        ]
        other_racks = [i for i in range(n) if world[i].rack != owner.rack]
        if redundancy >= 2 and same_rack:
            chosen.append(min(same_rack, key=key))
        elif redundancy >= 2 and other_racks:
            shortfalls.append(f"shard {r}: no other node in rack {owner.rack}")
        while len(chosen) < redundancy:
            racks_used = {world[i].rack for i in chosen} | {owner.rack}
            fresh = [i for i in other_racks if i not in chosen and world[i].rack not in racks_used]
            again = [i for i in other_racks if i not in chosen]
            pool = fresh or again
            if not pool:
                break
            chosen.append(min(pool, key=key))
        if len(chosen) < redundancy:
            # Fewer racks or nodes than the rule needs: same rack, then same node, is better
            # than no copy at all.
            rest = [i for i in same_rack if i not in chosen]
            rest += [i for i in range(n) if i != r and world[i].node == owner.node]
            while len(chosen) < redundancy and rest:
                pick = min(rest, key=key)
                rest.remove(pick)
                chosen.append(pick)
                if world[pick].node == owner.node:
                    shortfalls.append(f"shard {r}: a copy on the owner's own node {owner.node}")
        if len(chosen) < redundancy:
            shortfalls.append(f"shard {r}: holders {len(chosen)} of {redundancy} wanted")
        if redundancy >= 1 and chosen and not other_racks:
            shortfalls.append(
                f"shard {r}: one rack only, no copy survives losing rack {owner.rack}"
            )
        for i in chosen:
            load[i] += 1
        shards.append(Shard(r, owner.member, tuple(world[i].member for i in chosen)))
    return Placement(tuple(shards), _note(shortfalls))


def _note(shortfalls: list[str]) -> str:
    if not shortfalls:
        return ""
    shown = "; ".join(shortfalls[:_NOTE_DETAILS])
    more = len(shortfalls) - _NOTE_DETAILS
    return shown + (f"; and {more} more" if more > 0 else "")
