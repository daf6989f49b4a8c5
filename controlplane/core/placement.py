"""Where each shard's hot backups live: deterministic, topology-aware, balanced.

The rule (DESIGN.md): ``redundancy`` holders per shard, one on another node of the owner's rack
(fast to reach, survives the owner's node), the rest in other racks (survive a rack), spread
over as many racks as possible. With a single holder, it goes to another rack: a copy that
survives losing a rack beats a nearby one, and no shard should have every copy in one rack.

Balance is greedy: each copy goes to the least-loaded member allowed by the rule (ties broken by
rank), and the other racks are taken least-loaded (per member) first; heaps keep that at
O(n * redundancy * log n). When the topology cannot satisfy the rule, the best available
placement is made and the note says why.

A new generation keeps what it can of the previous one (``previous``, with failed members
``substitute``-d by their replacements): every copy that is still on a valid holder stays where
it is, and only the shards that lost a holder (or gained an owner) are placed again. After a
failure, then, a handful of ranks re-replicate instead of all of them, and placing 4,096 ranks
takes a few milliseconds on the decider's hot path. Either way the result is a pure function of
its arguments (the world, and the previous generation's placement), never random.

With a mesh (``replicas``: the replica of each rank), a shard's holders are also outside its
owner's replica: one in the owner's rack off the owner's replica and node, the rest in other
racks, so that losing a whole replica (or its node, or its rack) leaves a copy. Only when the
topology leaves no such member does a copy go inside the replica (off the owner's node), then
on the owner's node, and the note says so. A replacement that came from another replica (a
survivor of a dropped one) has its copies checked again.

Replacements are placed by node liveness (``silent_nodes``): a node's liveness is judged as a
whole. Once a member is found silent (its heartbeat timed out), every other member of its node
whose last heartbeat is also older than the bound (``detect.silence_limit``: 3 heartbeat
intervals, which a live member never misses) is taken as silent too, and that node is no
place to take a replacement from, nor a silent member a restore source: a spare in the
``waiting`` phase (a longer timeout) on the node that just died otherwise still looks alive.
"""

from __future__ import annotations

import heapq
import itertools
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import NamedTuple

from controlplane.core.view import Heartbeat, Member, MemberStatus

#: Shortfalls spelled out in a placement note before the rest are only counted.
_NOTE_DETAILS = 8


class Slot(NamedTuple):
    """A member of the world and where it runs (a tuple: a world of them is built on every
    decision, and a tuple costs about half what a frozen dataclass does to make)."""

    member: str
    node: str
    rack: str


@dataclass(frozen=True, slots=True)
class Placement:
    """``holders[r]``: the members holding copies of rank ``r``'s shard (owned by
    ``world[r]``), and why the rule was not met where it was not."""

    world: tuple[str, ...]
    holders: tuple[tuple[str, ...], ...]
    note: str = ""

    def load(self) -> dict[str, int]:
        """How many shards each member holds a copy of."""
        out: dict[str, int] = {}
        for holders in self.holders:
            for holder in holders:
                out[holder] = out.get(holder, 0) + 1
        return out


class _Loads:
    """Copies held per member and per rack, with lazy min-heaps over both.

    A rack's heap of members is built the first time a holder is looked for in that rack:
    after a failure only the few shards that lost a holder are placed again, and they look
    in a handful of racks, not in all of them.
    """

    def __init__(
        self,
        nodes: Sequence[str],
        racks: Sequence[str],
        load: list[int],
        replicas: Sequence[int] | None = None,
    ) -> None:
        self.nodes = nodes
        self.replicas = replicas
        self.load = load
        self.racks: list[str] = []
        self.rack_of: list[int] = []
        index: dict[str, int] = {}
        in_rack: list[list[int]] = []
        rack_of = self.rack_of
        for i, rack in enumerate(racks):
            k = index.get(rack)
            if k is None:
                k = index[rack] = len(self.racks)
                self.racks.append(rack)
                in_rack.append([])
            rack_of.append(k)
            in_rack[k].append(i)
        self._in_rack = in_rack
        self.size = [len(ms) for ms in in_rack]
        self.rack_load = [sum([load[i] for i in ms]) for ms in in_rack]
        #: Per rack, a heap of (load, member) entries once built (None until then).
        self.members: list[list[tuple[int, int]] | None] = [None] * len(in_rack)
        self.rack_heap = [
            (self.rack_load[rack] / self.size[rack], rack) for rack in range(len(self.racks))
        ]
        heapq.heapify(self.rack_heap)

    def _heap(self, rack: int) -> list[tuple[int, int]]:
        heap = self.members[rack]
        if heap is None:
            load = self.load
            heap = self.members[rack] = [(load[i], i) for i in self._in_rack[rack]]
            heapq.heapify(heap)
        return heap

    def same_node(self, node: str) -> list[int]:
        """The members on ``node``, in world order."""
        return [i for i, n in enumerate(self.nodes) if n == node]

    def add(self, i: int) -> None:
        self.load[i] += 1
        rack = self.rack_of[i]
        self.rack_load[rack] += 1
        heap = self.members[rack]
        if heap is not None:  # else it is built from the loads when first needed
            heapq.heappush(heap, (self.load[i], i))
        heapq.heappush(self.rack_heap, (self.rack_load[rack] / self.size[rack], rack))

    def least_in_rack(
        self, rack: int, node: str | None, chosen: list[int], replica: int | None = None
    ) -> int | None:
        """The least-loaded member of ``rack`` off ``node``, not in ``chosen`` (and, with
        ``replica``, outside that replica)."""
        heap = self._heap(rack)
        load = self.load
        nodes = self.nodes
        replicas = self.replicas if replica is not None else None
        skipped: list[tuple[int, int]] = []
        found = None
        while heap:
            entry = heapq.heappop(heap)
            if entry[0] != load[entry[1]]:
                continue  # stale: a newer entry for this member is in the heap
            skipped.append(entry)
            i = entry[1]
            if (
                nodes[i] != node
                and i not in chosen
                and (replicas is None or replicas[i] != replica)
            ):
                found = i
                break
        for entry in skipped:
            heapq.heappush(heap, entry)
        return found  # add() makes its entry stale when the member is chosen

    def least_rack(
        self,
        excluded: set[int],
        node: str | None = None,
        chosen: list[int] | None = None,
        replica: int | None = None,
    ) -> int | None:
        """The rack not in ``excluded`` with the fewest copies per member; with ``chosen``,
        only a rack that still has a member off ``node``, not in ``chosen`` (and outside
        ``replica``)."""
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
            if chosen is None or self.least_in_rack(rack, node, chosen, replica) is not None:
                found = rack
                break
        for entry in skipped:
            heapq.heappush(heap, entry)
        return found


def place(
    world: Sequence[Slot],
    redundancy: int,
    previous: Mapping[str, Sequence[str]] | None = None,
    substitute: Mapping[str, str] | None = None,
    replicas: Sequence[int] | None = None,
) -> Placement:
    """Choose ``redundancy`` holders for the shard of each rank ``r`` (owned by ``world[r]``).

    ``previous`` maps an owner to the holders its shard had (the last generation); copies on
    holders that are still valid stay. ``substitute`` renames members first (a failed member
    -> its replacement), as owners and as holders. ``replicas[r]`` (a mesh) is the replica of
    rank ``r``: holders go outside the owner's replica.
    """
    # Columns of the world, transposed in C (a world is a sequence of tuples).
    members, nodes, racks = (list(c) for c in zip(*world, strict=True)) if world else ([], [], [])
    return place_columns(
        members,
        nodes,
        racks,
        redundancy,
        previous=previous,
        substitute=substitute,
        replicas=replicas,
    )


def place_columns(
    members: Sequence[str],
    nodes: Sequence[str],
    racks: Sequence[str],
    redundancy: int,
    *,
    previous: Mapping[str, Sequence[str]] | None = None,
    substitute: Mapping[str, str] | None = None,
    replicas: Sequence[int] | None = None,
) -> Placement:
    """``place`` of the world ``zip(members, nodes, racks)``, given as its columns (what a
    decider has at hand: building a ``Slot`` per rank costs more than placing)."""
    if redundancy < 0:
        raise ValueError("redundancy must be >= 0")
    if not len(members) == len(nodes) == len(racks):
        raise ValueError("members, nodes and racks differ in length")
    if replicas is not None:
        if len(replicas) != len(members):
            raise ValueError("replicas and members differ in length")
        if len(set(replicas)) < 2:
            replicas = None  # one replica: the rule has no other to use
    index = dict(zip(members, range(len(members)), strict=True))
    if len(index) != len(members):
        raise ValueError("a member appears twice in the world")
    multi_rack = len(set(racks)) > 1
    kept, unsettled = _kept(
        members,
        nodes,
        racks,
        index,
        redundancy=redundancy,
        previous=previous or {},
        substitute=substitute or {},
        multi_rack=multi_rack,
        replicas=replicas,
    )
    loads: _Loads | None = None  # built on the first shard that needs a holder
    shortfalls: list[str] = []
    # The kept holders as they are (tuples: the same copies), then the unsettled ranks in
    # order, each with the loads the ranks before it left.
    holders = list(kept)
    for r in unsettled:
        chosen = kept[r]
        assert isinstance(chosen, list)
        if len(chosen) < redundancy:
            if loads is None:
                loads = _Loads(nodes, racks, _load(kept, unsettled, members), replicas)
            _fill(loads, r, chosen, redundancy, shortfalls)
        if redundancy >= 1 and chosen and not multi_rack:
            shortfalls.append(f"shard {r}: one rack only, no copy survives losing rack {racks[r]}")
        holders[r] = tuple([members[i] for i in chosen])
    return Placement(tuple(members), tuple(holders), _note(shortfalls))  # type: ignore[arg-type]


def _load(
    kept: Sequence[tuple[str, ...] | list[int]], unsettled: Sequence[int], members: Sequence[str]
) -> list[int]:
    """Copies each member holds: the kept names counted in C (the indices of the unsettled
    ranks are counted there too, under int keys no member has), then those indices."""
    named = Counter(itertools.chain.from_iterable(kept))
    load = list(map(named.get, members, itertools.repeat(0)))
    for r in unsettled:
        for i in kept[r]:
            load[i] += 1  # type: ignore[index]
    return load


def _kept(
    members: Sequence[str],
    nodes: Sequence[str],
    racks: Sequence[str],
    index: Mapping[str, int],
    *,
    redundancy: int,
    previous: Mapping[str, Sequence[str]],
    substitute: Mapping[str, str],
    multi_rack: bool,
    replicas: Sequence[int] | None = None,
) -> tuple[list[tuple[str, ...] | list[int]], list[int]]:
    """Per rank, the previous holders that remain valid: in the world, not the owner, not on
    its node, not in its replica (``replicas``), and not leaving every copy in the owner's rack
    while other racks exist.

    A shard nothing happened to (same owner, every holder still there, none renamed) keeps
    its holders as they were (a tuple of names); the others get the indices kept (a list)
    and are listed, in rank order, as the unsettled ranks.
    """
    if not previous or redundancy == 0:
        return [[] for _ in members], list(range(len(members)))
    origin = {new: old for old, new in substitute.items()}
    renamed = set(substitute)
    present = set(index)
    empty: tuple[str, ...] = ()
    # Every rank first keeps its previous holders as they were (mapped in C) ...
    out: list[tuple[str, ...] | list[int]] = list(
        map(tuple, map(previous.get, members, itertools.repeat(empty)))
    )
    # ... then the few that cannot are found: the owners with a holder that left or was
    # renamed (or the wrong number of holders, or themselves among them), and the ranks whose
    # owner is new (a replacement, or no previous shard). One pass over the previous owners
    # (a comprehension: Python 3.11 runs it faster than chains of ``map`` over ``operator``
    # functions).
    # With replicas, a replacement may come from another replica (a survivor of a dropped
    # one): the copies it held are checked again.
    moved = set(origin) if replicas is not None else set()
    suspect = {
        owner
        for owner, before in previous.items()
        if len(before) != redundancy
        or owner in before
        or not present.issuperset(before)
        or (renamed and not renamed.isdisjoint(before))
        or (moved and not moved.isdisjoint(before))
    }
    redo = (suspect & present) | (present - previous.keys()) | (origin.keys() & present)
    unsettled = sorted(index[name] for name in redo)
    for r in unsettled:
        name = members[r]
        was = origin.get(name)
        before = previous.get(name if was is None else was, empty)
        node, rack = nodes[r], racks[r]
        chosen: list[int] = []
        elsewhere = False
        for held_by in before:
            i = index.get(substitute.get(held_by, held_by))
            if i is None or i == r or nodes[i] == node or i in chosen:
                continue
            if replicas is not None and replicas[i] == replicas[r]:
                continue
            if len(chosen) == redundancy:
                break
            chosen.append(i)
            elsewhere = elsewhere or racks[i] != rack
        if multi_rack and chosen and not elsewhere:
            chosen.pop()  # the refill goes to another rack
        out[r] = chosen
    return out, unsettled


def _fill(loads: _Loads, r: int, chosen: list[int], redundancy: int, shortfalls: list[str]) -> None:
    """Add holders for rank ``r`` until ``redundancy``, by the rule, least-loaded first."""
    own_rack = loads.rack_of[r]
    own_node = loads.nodes[r]
    multi_rack = len(loads.racks) > 1
    # With replicas: holders outside the owner's replica (None: no replica to keep out of).
    replica = loads.replicas[r] if loads.replicas is not None else None
    if redundancy >= 2 and not any(loads.rack_of[i] == own_rack for i in chosen):
        pick = loads.least_in_rack(own_rack, own_node, chosen, replica)
        if pick is not None:
            chosen.append(pick)
            loads.add(pick)
        elif multi_rack:
            outside = " outside its replica" if replica is not None else ""
            shortfalls.append(f"shard {r}: no other node{outside} in rack {loads.racks[own_rack]}")
    racks_used = {own_rack, *(loads.rack_of[i] for i in chosen)}
    while len(chosen) < redundancy and multi_rack:
        if replica is None:
            rack = loads.least_rack(racks_used)
        else:  # a rack may hold only the owner's replica
            rack = loads.least_rack(racks_used, own_node, chosen, replica)
        if rack is None:  # every other rack holds a copy already: use one again
            rack = loads.least_rack({own_rack}, own_node, chosen, replica)
        if rack is None:
            break
        pick = loads.least_in_rack(rack, own_node, chosen, replica)
        assert pick is not None
        chosen.append(pick)
        loads.add(pick)
        racks_used.add(rack)
    if len(chosen) < redundancy:
        # Fewer racks or nodes than the rule needs: same rack, then (with replicas) inside
        # the owner's replica, then same node, is better than no copy at all.
        while len(chosen) < redundancy:
            pick = loads.least_in_rack(own_rack, own_node, chosen, replica)
            if pick is None:
                break
            chosen.append(pick)
            loads.add(pick)
        while replica is not None and len(chosen) < redundancy:
            pick = loads.least_in_rack(own_rack, own_node, chosen)
            if pick is None:
                rack = loads.least_rack({own_rack}, own_node, chosen)
                pick = loads.least_in_rack(rack, own_node, chosen) if rack is not None else None
            if pick is None:
                break
            chosen.append(pick)
            loads.add(pick)
            shortfalls.append(f"shard {r}: a copy inside its own replica")
        same_node = [i for i in loads.same_node(own_node) if i != r]
        while len(chosen) < redundancy:
            rest = [i for i in same_node if i not in chosen]
            if not rest:
                break
            pick = min(rest, key=lambda i: (loads.load[i], i))
            chosen.append(pick)
            loads.add(pick)
            shortfalls.append(f"shard {r}: a copy on the owner's own node {own_node}")
    if len(chosen) < redundancy:
        shortfalls.append(f"shard {r}: holders {len(chosen)} of {redundancy} wanted")


def _note(shortfalls: list[str]) -> str:
    if not shortfalls:
        return ""
    shown = "; ".join(shortfalls[:_NOTE_DETAILS])
    more = len(shortfalls) - _NOTE_DETAILS
    return shown + (f"; and {more} more" if more > 0 else "")


# --------------------------------------------------------------------------- node liveness


@dataclass(frozen=True, slots=True)
class SilentNode:
    """A node with a member found silent and at least one more member silent past the bound:
    the node is taken as gone (none of its members replaces anyone; its silent members serve
    no restore)."""

    node: str
    #: Members of the node found silent (their heartbeat timed out), in name order.
    found: tuple[str, ...]
    #: The node's other members silent past the bound, with their silence in seconds.
    silent: tuple[tuple[str, float], ...]

    def describe(self) -> str:
        """``node N is silent: w01 timed out, spare0 silent 5.0s``."""
        others = ", ".join(f"{m} silent {s:.1f}s" for m, s in self.silent[:8])
        more = f" and {len(self.silent) - 8} more" if len(self.silent) > 8 else ""
        return f"node {self.node} is silent: {', '.join(self.found[:8])} timed out, {others}{more}"


def silent_nodes(
    members: Mapping[str, Member],
    found: Iterable[str],
    now: datetime,
    bound_s: float,
    *,
    heartbeats: Mapping[str, Heartbeat],
) -> dict[str, SilentNode]:
    """The nodes of ``found`` (members found silent by their heartbeat timeout) that have
    another live member not heard from for more than ``bound_s`` seconds at ``now`` (its
    last heartbeat in ``heartbeats``, else its join).

    Only members still active and not yet detected count as the node's other silent members
    (a member already failed is no candidate and no source anyway). Pure: a function of the
    members, their heartbeats, the time and the bound.
    """
    by_node: dict[str, list[str]] = {}
    for member_id in found:
        member = members.get(member_id)
        if member is not None:
            by_node.setdefault(member.node, []).append(member_id)
    if not by_node:
        return {}
    cutoff = now - timedelta(seconds=bound_s)
    quiet: dict[str, list[tuple[str, float]]] = {}
    for member_id, member in members.items():
        if (
            member.node not in by_node
            or member_id in by_node[member.node]
            or member.status is not MemberStatus.ACTIVE
            or member.detected_position is not None
        ):
            continue
        heartbeat = heartbeats.get(member_id)
        last = heartbeat.at if heartbeat is not None else member.joined_at
        if last < cutoff:
            quiet.setdefault(member.node, []).append((member_id, (now - last).total_seconds()))
    return {
        node: SilentNode(node, tuple(sorted(by_node[node])), tuple(sorted(quiet[node])))
        for node in sorted(quiet)
    }
