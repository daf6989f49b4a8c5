"""Where each shard's hot backups live: deterministic, topology-aware, balanced.

The rule (DESIGN.md): ``redundancy`` holders per shard, one on another node of the owner's rack
(fast to reach, survives the owner's node), the rest in other racks (survive a rack), spread
over as many racks as possible. With a single holder, it goes to another rack: a copy that
survives losing a rack beats a nearby one, and no shard should have every copy in one rack.

Balance is greedy: each copy goes to the least-loaded member allowed by the rule (ties broken by
rank), and the other racks are taken least-loaded (per member) first. Heaps keep that at
O(n * redundancy * log n), a few milliseconds for thousands of ranks, so the decider can place a
new generation on the hot path. The result is a pure function of the world, never random. When
the topology cannot satisfy the rule, the best available placement is made and the note says
why.
"""

from __future__ import annotations

import heapq
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


class _Loads:
    """Copies held per member and per rack, with lazy min-heaps over both."""

    def __init__(self, world: Sequence[Slot]) -> None:
        self.world = world
        self.load = [0] * len(world)
        self.racks: list[str] = []
        self.rack_of: list[int] = []
        index: dict[str, int] = {}
        for slot in world:
            if slot.rack not in index:
                index[slot.rack] = len(self.racks)
                self.racks.append(slot.rack)
            self.rack_of.append(index[slot.rack])
        self.size = [0] * len(self.racks)
        for rack in self.rack_of:
            self.size[rack] += 1
        self.rack_load = [0] * len(self.racks)
        self.members: list[list[tuple[int, int]]] = [[] for _ in self.racks]
        for i, rack in enumerate(self.rack_of):
            self.members[rack].append((0, i))  # already a heap: equal loads, rising index
        self.rack_heap = [(0.0, rack) for rack in range(len(self.racks))]
        self.nodes: dict[str, list[int]] = {}
        node_index: dict[str, int] = {}
        self.node_of: list[int] = []
        for i, slot in enumerate(world):
            self.nodes.setdefault(slot.node, []).append(i)
            self.node_of.append(node_index.setdefault(slot.node, len(node_index)))

    def add(self, i: int) -> None:
        self.load[i] += 1
        rack = self.rack_of[i]
        self.rack_load[rack] += 1
        heapq.heappush(self.members[rack], (self.load[i], i))
        heapq.heappush(self.rack_heap, (self.rack_load[rack] / self.size[rack], rack))

    def least_in_rack(self, rack: int, node: int | None, chosen: list[int]) -> int | None:
        """The least-loaded member of ``rack`` off ``node`` and not in ``chosen``."""
        heap = self.members[rack]
        load = self.load
        node_of = self.node_of
        skipped: list[tuple[int, int]] = []
        found = None
        while heap:
            entry = heapq.heappop(heap)
            if entry[0] != load[entry[1]]:
                continue  # stale: a newer entry for this member is in the heap
            skipped.append(entry)
            i = entry[1]
            if node_of[i] != node and i not in chosen:
                found = i
                break
        for entry in skipped:
            heapq.heappush(heap, entry)
        return found  # add() makes its entry stale when the member is chosen

    def least_rack(
        self, excluded: set[int], node: int | None = None, chosen: list[int] | None = None
    ) -> int | None:
        """The rack not in ``excluded`` with the fewest copies per member; with ``chosen``,
        only a rack that still has a member off ``node`` and not in ``chosen``."""
        heap = self.rack_heap
        skipped: list[tuple[float, int]] = []
        found = None
        while heap:
            entry = heapq.heappop(heap)
            key, rack = entry
            if key != self.rack_load[rack] / self.size[rack]:
                continue
            skipped.append(entry)
            if rack in excluded:
                continue
            if chosen is None or self.least_in_rack(rack, node, chosen) is not None:
                found = rack
                break
        for entry in skipped:
            heapq.heappush(heap, entry)
        return found


def place(world: Sequence[Slot], redundancy: int) -> Placement:
    """Choose ``redundancy`` holders for the shard of each rank ``r`` (owned by ``world[r]``)."""
    if redundancy < 0:
        raise ValueError("redundancy must be >= 0")
    members = [s.member for s in world]
    if len(set(members)) != len(members):
        raise ValueError("a member appears twice in the world")
    loads = _Loads(world)
    multi_rack = len(loads.racks) > 1
    shortfalls: list[str] = []
    shards = []
    for r, owner in enumerate(world):
        own_rack = loads.rack_of[r]
        own_node = loads.node_of[r]
        chosen: list[int] = []
        if redundancy >= 2:
            pick = loads.least_in_rack(own_rack, own_node, chosen)
            if pick is not None:
                chosen.append(pick)
                loads.add(pick)
            elif multi_rack:
                shortfalls.append(f"shard {r}: no other node in rack {owner.rack}")
        racks_used = {own_rack}
        while len(chosen) < redundancy and multi_rack:
            rack = loads.least_rack(racks_used)
            if rack is None:  # every other rack holds a copy already: use one again
                rack = loads.least_rack({own_rack}, own_node, chosen)
            if rack is None:
                break
            pick = loads.least_in_rack(rack, own_node, chosen)
            assert pick is not None
            chosen.append(pick)
            loads.add(pick)
            racks_used.add(rack)
        if len(chosen) < redundancy:
            # Fewer racks or nodes than the rule needs: same rack, then same node, is better
            # than no copy at all.
            while len(chosen) < redundancy:
                pick = loads.least_in_rack(own_rack, own_node, chosen)
                if pick is None:
                    break
                chosen.append(pick)
                loads.add(pick)
            same_node = [i for i in loads.nodes[owner.node] if i != r]
            while len(chosen) < redundancy:
                rest = [i for i in same_node if i not in chosen]
                if not rest:
                    break
                pick = min(rest, key=lambda i: (loads.load[i], i))
                chosen.append(pick)
                loads.add(pick)
                shortfalls.append(f"shard {r}: a copy on the owner's own node {owner.node}")
        if len(chosen) < redundancy:
            shortfalls.append(f"shard {r}: holders {len(chosen)} of {redundancy} wanted")
        if redundancy >= 1 and chosen and not multi_rack:
            shortfalls.append(
                f"shard {r}: one rack only, no copy survives losing rack {owner.rack}"
            )
        shards.append(Shard(r, owner.member, tuple(world[i].member for i in chosen)))
    return Placement(tuple(shards), _note(shortfalls))


def _note(shortfalls: list[str]) -> str:
    if not shortfalls:
        return ""
    shown = "; ".join(shortfalls[:_NOTE_DETAILS])
    more = len(shortfalls) - _NOTE_DETAILS
    return shown + (f"; and {more} more" if more > 0 else "")
