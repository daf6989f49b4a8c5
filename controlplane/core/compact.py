"""Lists of members written against the world in force, as a decision records them.

A decision at 16,384 ranks that replaces one member keeps every other rank where it was, and
recording its world, its restore plan and its placement a name per rank made megabytes of
JSON that PostgreSQL parsed inside the append a fault waits for. So ``reallocation.issued``
and ``generation.started`` record them against what the fold has when it folds them (the
world and placement of the generation before): a list as ``Spans`` (names, and ``[i, j]``
for the base's ranks ``i`` to ``j - 1``), a placement as the ranks whose holders changed.
``decide`` returns the lists whole (what a replay compares, what tests read); the decider
writes them so as it records them (``compacted``). The fold expands them; the commands are
built from the folded view, whole. Pure.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from schemas.events import GenerationStarted, ReallocationIssued

if TYPE_CHECKING:
    from controlplane.core.decide import Decided
    from controlplane.core.view import JobView

Span = str | tuple[int, int]


def spans(items: Sequence[str], base: Sequence[str]) -> list[Span] | None:
    """``items`` as spans of ``base`` and names; None when that is not shorter than the list
    (a first world, a world reordered)."""
    if not items or not base:
        return None
    out: list[Span] = []
    if len(items) == len(base):
        # The common case (a replacement): the few ranks that differ.
        differ = [r for r, (a, b) in enumerate(zip(items, base, strict=True)) if a != b]
        if 2 * len(differ) < len(items):
            start = 0
            for r in differ:
                if r > start:
                    out.append((start, r))
                out.append(items[r])
                start = r + 1
            if start < len(items):
                out.append((start, len(items)))
            if 2 * len(out) < len(items):
                return out
            out = []
    index = {m: i for i, m in enumerate(base)}
    i, n = 0, len(items)
    while i < n:
        j = index.get(items[i])
        if j is None:
            out.append(items[i])
            i += 1
            continue
        k = i + 1
        while k < n and j + k - i < len(base) and base[j + k - i] == items[k]:
            k += 1
        out.append((j, j + k - i))
        i = k
    return out if 2 * len(out) < len(items) else None


def expand(written: Sequence[Span], base: Sequence[str]) -> list[str]:
    """The list ``spans`` wrote against ``base``."""
    out: list[str] = []
    for item in written:
        if isinstance(item, str):
            out.append(item)
        else:
            i, j = item
            out.extend(base[i:j])
    return out


def changes(
    world: Sequence[str],
    holders: Sequence[tuple[str, ...]],
    previous: Mapping[str, Sequence[str]],
) -> list[tuple[int, list[str]]] | None:
    """The ranks of ``world`` whose ``holders`` are not those their member had (``previous``:
    member -> holders in the generation before); None when that is not shorter than the
    placement."""
    if not previous:
        return None
    before = [tuple(previous.get(m, ())) for m in world]
    out = [(r, list(h)) for r, (h, b) in enumerate(zip(holders, before, strict=True)) if h != b]
    return out if 2 * len(out) < len(world) else None


def placed(
    world: Sequence[str],
    written: Sequence[tuple[int, Sequence[str]]],
    previous: Mapping[str, tuple[str, ...]],
) -> tuple[tuple[str, ...], ...]:
    """The placement ``changes`` wrote for ``world`` against ``previous``."""
    out = [previous.get(m, ()) for m in world]
    for rank, chosen in written:
        out[rank] = tuple(chosen)
    return tuple(out)


def compacted(view: JobView, decided: Sequence[Decided]) -> list[Decided]:
    """``decided`` (decisions on ``view``, in order) with each ``reallocation.issued`` and
    ``generation.started`` writing its lists against the world and placement in force where
    it is folded (``view``'s, then each generation's it starts), where that is shorter."""
    from controlplane.core.decide import Decided

    world: Sequence[str] = view.world
    placement: Sequence[tuple[str, ...]] = view.placement
    out: list[Decided] = []
    for d in decided:
        p = d.payload
        if isinstance(p, ReallocationIssued) and p.world_spans is None:
            world_spans = spans(p.world, world)
            plan_spans = spans(p.plan, world)
            if world_spans is not None or plan_spans is not None:
                p = p.model_copy(
                    update={
                        "world": [] if world_spans is not None else p.world,
                        "world_spans": world_spans,
                        "plan": [] if plan_spans is not None else p.plan,
                        "plan_spans": plan_spans,
                    }
                )
        elif isinstance(p, GenerationStarted) and p.world_spans is None:
            new, holders = p.world, [tuple(h) for h in p.placement]
            previous = dict(zip(world, placement, strict=False))
            world_spans = spans(new, world)
            changed = changes(new, holders, previous) if len(holders) == len(new) else None
            if world_spans is not None or changed is not None:
                p = p.model_copy(
                    update={
                        "world": [] if world_spans is not None else p.world,
                        "world_spans": world_spans,
                        "placement": [] if changed is not None else p.placement,
                        "placement_changes": changed,
                    }
                )
            world, placement = new, holders
        out.append(d if p is d.payload else Decided(d.event_id, d.type, d.generation, p))
    return out
