"""A generation's device mesh: ranks, coordinates and replicas (pure arithmetic).

``JobPolicy.mesh`` declares the mesh at full size. Rank ``r`` sits at the coordinate of ``r``
in row-major order over the mesh's dimensions, the first outermost (the order of
``torch.distributed.init_device_mesh``). A replica is the set of ranks that share one
coordinate of the replica dimensions; replicas are numbered row-major over those dimensions,
and a rank's place inside its replica (``intra``) row-major over the other dimensions. A
generation with fewer (or again more) replicas than the full mesh keeps every other degree:
with one replica dimension it holds the replicas there; with several, the outermost holds
them and the others are 1 (``Layout.with_replicas``). Shrinking renumbers the replicas that
remain densely, keeping each member's ``intra`` place.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import product

from schemas.events import Mesh


@dataclass(frozen=True, slots=True)
class Layout:
    """The mesh of one generation: dimension names and degrees (outermost first), which
    dimensions identify a replica and which stay inside a node."""

    names: tuple[str, ...]
    degrees: tuple[int, ...]
    #: Indices (into ``names``) of the replica dimensions, in order.
    replica_axes: tuple[int, ...]
    #: Indices of the node-local dimensions that are not replica dimensions, in order.
    local_axes: tuple[int, ...]

    # ------------------------------------------------------------------ sizes

    @property
    def size(self) -> int:
        return math.prod(self.degrees)

    @property
    def replicas(self) -> int:
        out = 1
        for axis in self.replica_axes:
            out *= self.degrees[axis]
        return out

    @property
    def replica_size(self) -> int:
        return self.size // self.replicas

    @property
    def other_axes(self) -> tuple[int, ...]:
        """The dimensions that are not replica dimensions, in order."""
        replica = set(self.replica_axes)
        return tuple(a for a in range(len(self.names)) if a not in replica)

    def _strides(self) -> tuple[int, ...]:
        out = [1] * len(self.degrees)
        for axis in range(len(self.degrees) - 2, -1, -1):
            out[axis] = out[axis + 1] * self.degrees[axis + 1]
        return tuple(out)

    # ------------------------------------------------------------------ coordinates

    def coordinate(self, rank: int) -> tuple[int, ...]:
        """The coordinate of ``rank`` (row-major, the first dimension outermost)."""
        out = []
        for stride, degree in zip(self._strides(), self.degrees, strict=True):
            out.append((rank // stride) % degree)
        return tuple(out)

    def rank(self, coordinate: tuple[int, ...]) -> int:
        return sum(c * s for c, s in zip(coordinate, self._strides(), strict=True))

    def describe_rank(self, rank: int) -> str:
        """``dp=3 tp=1 pp=0``."""
        return " ".join(f"{n}={c}" for n, c in zip(self.names, self.coordinate(rank), strict=True))

    def replica_of(self, rank: int) -> int:
        coordinate = self.coordinate(rank)
        out = 0
        for axis in self.replica_axes:
            out = out * self.degrees[axis] + coordinate[axis]
        return out

    def intra(self, rank: int) -> int:
        """The place of ``rank`` inside its replica (row-major over the other dimensions)."""
        coordinate = self.coordinate(rank)
        out = 0
        for axis in self.other_axes:
            out = out * self.degrees[axis] + coordinate[axis]
        return out

    def rank_of(self, replica: int, intra: int) -> int:
        """The rank of place ``intra`` of replica ``replica``."""
        coordinate = [0] * len(self.degrees)
        for axis in reversed(self.replica_axes):
            replica, coordinate[axis] = divmod(replica, self.degrees[axis])
        for axis in reversed(self.other_axes):
            intra, coordinate[axis] = divmod(intra, self.degrees[axis])
        return self.rank(tuple(coordinate))

    def replica_ids(self) -> list[int]:
        """``replica_ids()[r]``: the replica of rank ``r``, for every rank (fast path)."""
        strides = self._strides()
        size = self.size
        if not self.replica_axes:
            return [0] * size
        if len(self.replica_axes) == 1:
            axis = self.replica_axes[0]
            stride, degree = strides[axis], self.degrees[axis]
            return [(r // stride) % degree for r in range(size)]
        return [self.replica_of(r) for r in range(size)]

    def local_group(self, rank: int) -> tuple[int, ...]:
        """What the ranks of ``rank``'s node-local group share: its coordinate without the
        node-local dimensions (every rank is its own group when there are none)."""
        if not self.local_axes:
            return (rank,)
        local = set(self.local_axes)
        coordinate = self.coordinate(rank)
        return tuple(c for a, c in enumerate(coordinate) if a not in local)

    def local_peers(self, rank: int) -> list[int]:
        """The ranks of ``rank``'s node-local group, ``rank`` among them (only ``rank``
        when no dimension is node-local)."""
        if not self.local_axes:
            return [rank]
        coordinate = list(self.coordinate(rank))
        out = []
        for values in product(*(range(self.degrees[a]) for a in self.local_axes)):
            for axis, value in zip(self.local_axes, values, strict=True):
                coordinate[axis] = value
            out.append(self.rank(tuple(coordinate)))
        return out

    def describe_replica(self, replica: int) -> str:
        """``dp=3``: the replica's coordinate over the replica dimensions."""
        if not self.replica_axes:
            return "the whole mesh"
        rank = self.rank_of(replica, 0)
        coordinate = self.coordinate(rank)
        return " ".join(f"{self.names[a]}={coordinate[a]}" for a in self.replica_axes)

    def remap(self, new: Layout, dense: list[int | None]) -> list[int | None]:
        """Per rank of this layout, its rank in ``new`` when its replica ``q`` becomes replica
        ``dense[q]`` there (None: its replica is dropped); its place inside the replica
        stays."""
        size = self.size
        if len(self.replica_axes) == 1 and new.replica_axes == self.replica_axes:
            # One replica dimension: only that coordinate changes (arithmetic per rank).
            axis = self.replica_axes[0]
            stride = self._strides()[axis]
            block = stride * self.degrees[axis]
            new_block = stride * new.degrees[axis]
            out: list[int | None] = []
            append = out.append
            for r in range(size):
                hi, rest = divmod(r, block)
                q, lo = divmod(rest, stride)
                target = dense[q]
                append(None if target is None else hi * new_block + target * stride + lo)
            return out
        remapped: list[int | None] = []
        for r in range(size):
            target = dense[self.replica_of(r)]
            remapped.append(None if target is None else new.rank_of(target, self.intra(r)))
        return remapped

    # ------------------------------------------------------------------ filling

    def intra_fill_order(self) -> list[int]:
        """The places of a replica in the order workers sorted by topology fill them: the
        node-local dimensions vary fastest, so a node-local group lands on consecutive
        workers (one node, when nodes hold whole groups)."""
        others = self.other_axes
        local = set(self.local_axes)
        order = [a for a in others if a not in local] + [a for a in others if a in local]
        position = {axis: i for i, axis in enumerate(others)}
        out = []
        for values in product(*(range(self.degrees[a]) for a in order)):
            coordinate = [0] * len(others)
            for axis, value in zip(order, values, strict=True):
                coordinate[position[axis]] = value
            intra = 0
            for axis, value in zip(others, coordinate, strict=True):
                intra = intra * self.degrees[axis] + value
            out.append(intra)
        return out

    def fill_order(self) -> list[int]:
        """Every rank, in the order workers sorted by topology fill them: replica by replica,
        each in ``intra_fill_order``."""
        places = self.intra_fill_order()
        return [self.rank_of(q, j) for q in range(self.replicas) for j in places]

    def arrange(self, members: list[str]) -> tuple[str, ...]:
        """The world that puts ``members`` (sorted by topology, ``size`` of them) on the mesh."""
        world: list[str] = [""] * self.size
        for member, rank in zip(members, self.fill_order(), strict=True):
            world[rank] = member
        return tuple(world)

    # ------------------------------------------------------------------ resizing

    def with_replicas(self, replicas: int, full: Layout | None = None) -> Layout:
        """This mesh with ``replicas`` replicas: the full mesh's degrees when that is its
        count, else the outermost replica dimension holds them and any other is 1."""
        if full is not None and replicas == full.replicas:
            return full
        if not self.replica_axes:
            if replicas != 1:
                raise ValueError("a mesh without replica dimensions has one replica")
            return self
        degrees = list(self.degrees)
        first, *rest = self.replica_axes
        degrees[first] = replicas
        for axis in rest:
            degrees[axis] = 1
        return Layout(self.names, tuple(degrees), self.replica_axes, self.local_axes)

    def as_dict(self) -> dict[str, int]:
        return dict(zip(self.names, self.degrees, strict=True))

    def describe(self) -> str:
        return " x ".join(f"{n}={d}" for n, d in zip(self.names, self.degrees, strict=True))


def full_layout(mesh: Mesh) -> Layout:
    """The layout of the full mesh."""
    names = mesh.names
    replica = set(mesh.replica_names)
    local = set(mesh.node_local)
    return Layout(
        names,
        mesh.degrees,
        tuple(i for i, n in enumerate(names) if n in replica),
        tuple(i for i, n in enumerate(names) if n in local and n not in replica),
    )


def layout(mesh: Mesh, world_size: int) -> Layout | None:
    """The layout of a generation of ``world_size`` ranks on ``mesh`` (whole replicas of the
    full mesh's replica size), or None when ``world_size`` is not whole replicas."""
    full = full_layout(mesh)
    per = full.replica_size
    if world_size <= 0 or world_size % per:
        return None
    replicas = world_size // per
    if replicas == full.replicas:
        return full
    if not full.replica_axes:
        return None
    return full.with_replicas(replicas)


def degrees(mesh: Mesh | None, world_size: int) -> dict[str, int] | None:
    """The degrees of a generation of ``world_size`` ranks on ``mesh`` (None: no mesh, or a
    world that is not whole replicas)."""
    if mesh is None:
        return None
    found = layout(mesh, world_size)
    return found.as_dict() if found is not None else None
