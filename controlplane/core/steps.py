"""What a reader counts of a job's events beside its view: the loss by step, and time marks.

The API serves a job's loss curve and scans its events from a time; neither is in the view
(a view stays small whatever the job's age). ``JobSteps`` counts them from folded events: the
losses of the ``train.step`` events the fold believed (``fold_noting``: a forged step of 10^15
is in the log, not on the curve), and a mark (time, position) every ``TIME_MARK_EVERY``-th
event, from which a scan for events recorded since a time may start.

So that a reader need not read the whole log for them, the leader records them beside its
view snapshots (``controlplane.snapshots``): each snapshot adds, per job, what the events
folded since the last one counted, as one *chunk* (``encode_steps``); a reader starts from the
snapshot's chunks (``StepHistory``: columns, extended chunk by chunk) and counts the tail
itself. A step's losses form a monoid (``StepLoss.merge``: the newest generation's reports,
summed), so chunks combine in log order into exactly what counting every event would have
made. Pure: no I/O.
"""

from __future__ import annotations

import bisect
import struct
import sys
import zlib
from array import array
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Final

from controlplane.core.records import StoredEvent

#: One position in this many of a job's events is kept with its time (see ``JobSteps.after``).
TIME_MARK_EVERY: Final = 1024

_EPOCH: Final = datetime(1970, 1, 1, tzinfo=UTC)
#: A chunk's head: its steps, its marks, whether its times follow its positions, its first and
#: last event's time (µs since the epoch; 0 with no event).
_HEAD: Final = struct.Struct("<4sIIBqq")
_MAGIC: Final = b"stp1"


class StepsUnreadable(ValueError):
    """A chunk's bytes are not what ``encode_steps`` writes."""


def _us(at: datetime) -> int:
    return (at - _EPOCH) // timedelta(microseconds=1)


def _at(us: int) -> datetime:
    return _EPOCH + timedelta(microseconds=us)


@dataclass(slots=True)
class StepLoss:
    """The losses reported at one step by the newest generation that reported it."""

    generation: int
    total: float
    count: int
    #: When the last of those reports was recorded.
    at: datetime

    def add(self, generation: int, loss: float, at: datetime) -> None:
        """Count one report; a newer generation replaces what older ones reported."""
        if generation > self.generation:
            self.generation, self.total, self.count, self.at = generation, loss, 1, at
        elif generation == self.generation:
            self.total += loss
            self.count += 1
            self.at = max(self.at, at)

    def merge(self, later: StepLoss) -> StepLoss:
        """What counting this step's reports and then ``later``'s makes (a new value)."""
        if later.generation > self.generation:
            return StepLoss(later.generation, later.total, later.count, later.at)
        if later.generation < self.generation:
            return StepLoss(self.generation, self.total, self.count, self.at)
        return StepLoss(
            self.generation, self.total + later.total, self.count + later.count,
            max(self.at, later.at),
        )  # fmt: skip


@dataclass(slots=True)
class JobSteps:
    """A job's losses by step and time marks, counted from its events in log order."""

    losses: dict[int, StepLoss] = field(default_factory=dict)
    #: Every TIME_MARK_EVERY-th event counted (the first is one): its time and position.
    mark_times: list[datetime] = field(default_factory=list)
    mark_positions: list[int] = field(default_factory=list)
    #: Every event counted was recorded no earlier than the one before it.
    monotone: bool = True
    first_at: datetime | None = None
    last_at: datetime | None = None
    seen: int = 0

    def count(self, events: Sequence[StoredEvent], ignored: frozenset[int] = frozenset()) -> None:
        """Count ``events`` (of this job, in log order, after those counted); those at the
        positions in ``ignored`` (the fold did not believe them) add no loss."""
        losses = self.losses
        for stored in events:
            at = stored.recorded_at
            if self.last_at is None:
                self.first_at = at
            elif at < self.last_at:
                self.monotone = False
            self.last_at = at
            if self.seen % TIME_MARK_EVERY == 0:
                self.mark_times.append(at)
                self.mark_positions.append(stored.position)
            self.seen += 1
            event = stored.event
            if event.type != "train.step" or (ignored and stored.position in ignored):
                continue
            step, loss = event.payload.step, event.payload.loss
            known = losses.get(step)
            if known is None:
                losses[step] = StepLoss(event.generation, loss, 1, at)
            else:
                known.add(event.generation, loss, at)

    def extend(self, later: JobSteps) -> None:
        """Add what ``later`` counted of the events after these (in place)."""
        losses = self.losses
        for step, loss in later.losses.items():
            known = losses.get(step)
            losses[step] = loss if known is None else known.merge(loss)
        if later.first_at is None:
            return
        if self.last_at is not None and later.first_at < self.last_at:
            self.monotone = False
        self.monotone = self.monotone and later.monotone
        if self.first_at is None:
            self.first_at = later.first_at
        self.last_at = later.last_at
        self.mark_times.extend(later.mark_times)
        self.mark_positions.extend(later.mark_positions)
        self.seen += later.seen

    def after(self, since: datetime) -> int:
        """A position whose events and all before it were recorded before ``since`` (0 when
        none is known): where a scan for events recorded since then may start. Exact, as it
        relies on the order of times only where it was seen to hold."""
        if not self.monotone:
            return 0
        i = bisect.bisect_left(self.mark_times, since) - 1
        return self.mark_positions[i] if i >= 0 else 0


def _native(column: array[int] | array[float]) -> bytes:
    if sys.byteorder == "big":
        column = array(column.typecode, column)
        column.byteswap()
    return column.tobytes()


def encode_steps(steps: JobSteps) -> bytes:
    """``steps`` as a chunk's bytes: columns by step, then the marks (little-endian),
    zlib-compressed."""
    order = sorted(steps.losses)
    losses = [steps.losses[s] for s in order]
    head = _HEAD.pack(
        _MAGIC, len(order), len(steps.mark_positions), steps.monotone,
        _us(steps.first_at) if steps.first_at is not None else 0,
        _us(steps.last_at) if steps.last_at is not None else 0,
    )  # fmt: skip
    columns = (
        array("q", order),
        array("q", [loss.generation for loss in losses]),
        array("d", [loss.total for loss in losses]),
        array("q", [loss.count for loss in losses]),
        array("q", [_us(loss.at) for loss in losses]),
        array("q", [_us(at) for at in steps.mark_times]),
        array("q", steps.mark_positions),
    )
    return zlib.compress(head + b"".join(_native(c) for c in columns), 1)


def _ints(view: memoryview, offset: int, size: int) -> array[int]:
    column = array("q")
    column.frombytes(view[offset : offset + 8 * size])
    if sys.byteorder == "big":
        column.byteswap()
    return column


@dataclass(slots=True)
class StepHistory:
    """The steps of a job's events up to a snapshot, in columns (a loss curve of millions of
    steps costs tens of bytes a step), made of the snapshot's chunks in log order."""

    steps: array[int] = field(default_factory=lambda: array("q"))
    generations: array[int] = field(default_factory=lambda: array("q"))
    totals: array[float] = field(default_factory=lambda: array("d"))
    counts: array[int] = field(default_factory=lambda: array("q"))
    at_us: array[int] = field(default_factory=lambda: array("q"))
    mark_us: array[int] = field(default_factory=lambda: array("q"))
    mark_positions: array[int] = field(default_factory=lambda: array("q"))
    monotone: bool = True
    first_us: int | None = None
    last_us: int | None = None

    @classmethod
    def of(cls, chunks: Iterable[bytes]) -> StepHistory:
        """The history the chunks make, in the order given (log order)."""
        history = cls()
        for chunk in chunks:
            history.extend(chunk)
        return history

    def extend(self, chunk: bytes) -> None:
        """Add one chunk, of the events after those already in (``StepsUnreadable`` if it is
        not one)."""
        try:
            chunk = zlib.decompress(chunk)
        except zlib.error as exc:
            raise StepsUnreadable(f"not a steps chunk: {exc}") from exc
        view = memoryview(chunk)
        try:
            magic, n, marks, monotone, first_us, last_us = _HEAD.unpack_from(view)
        except struct.error as exc:
            raise StepsUnreadable(f"not a steps chunk: {exc}") from exc
        if magic != _MAGIC or len(chunk) != _HEAD.size + 8 * (5 * n + 2 * marks):
            raise StepsUnreadable("not a steps chunk: a wrong head or length")
        ints = [_ints(view, _HEAD.size + 8 * n * k, n) for k in (0, 1, 3, 4)]
        totals = array("d")
        totals.frombytes(view[_HEAD.size + 16 * n : _HEAD.size + 24 * n])
        if sys.byteorder == "big":
            totals.byteswap()
        steps, generations, counts, at_us = ints
        mark_us = _ints(view, _HEAD.size + 40 * n, marks)
        mark_positions = _ints(view, _HEAD.size + 40 * n + 8 * marks, marks)
        if n:
            self._extend_losses(steps, generations, totals, counts, at_us)
        if marks:
            if self.last_us is not None and first_us < self.last_us:
                self.monotone = False
            self.monotone = self.monotone and bool(monotone)
            if self.first_us is None:
                self.first_us = first_us
            self.last_us = last_us
            self.mark_us.extend(mark_us)
            self.mark_positions.extend(mark_positions)

    def _extend_losses(
        self,
        steps: array[int],
        generations: array[int],
        totals: array[float],
        counts: array[int],
        at_us: array[int],
    ) -> None:
        if not self.steps or steps[0] > self.steps[-1]:  # the common case: later steps
            self.steps.extend(steps)
            self.generations.extend(generations)
            self.totals.extend(totals)
            self.counts.extend(counts)
            self.at_us.extend(at_us)
            return
        # A roll-back: steps reported again. Merge the overlap (a short tail) step by step.
        cut = bisect.bisect_left(self.steps, steps[0])
        merged = {
            self.steps[i]: StepLoss(
                self.generations[i], self.totals[i], self.counts[i], _at(self.at_us[i])
            )
            for i in range(cut, len(self.steps))
        }
        for i, step in enumerate(steps):
            loss = StepLoss(generations[i], totals[i], counts[i], _at(at_us[i]))
            known = merged.get(step)
            merged[step] = loss if known is None else known.merge(loss)
        for column in (self.steps, self.generations, self.totals, self.counts, self.at_us):
            del column[cut:]
        for step in sorted(merged):
            loss = merged[step]
            self.steps.append(step)
            self.generations.append(loss.generation)
            self.totals.append(loss.total)
            self.counts.append(loss.count)
            self.at_us.append(_us(loss.at))

    def __len__(self) -> int:
        return len(self.steps)

    def loss(self, i: int) -> StepLoss:
        """The ``i``-th step's losses."""
        return StepLoss(self.generations[i], self.totals[i], self.counts[i], _at(self.at_us[i]))


def loss_points(
    history: StepHistory | None, tail: JobSteps
) -> Iterator[tuple[int, float, datetime]]:
    """(step, mean loss, time of its last report) by step: the history's, then the tail's
    counts merged in (a step in both: ``StepLoss.merge``)."""
    tail_steps = sorted(tail.losses)
    first_tail = tail_steps[0] if tail_steps else None
    if history is not None and len(history):
        steps, totals, counts, at_us = history.steps, history.totals, history.counts, history.at_us
        end = len(steps) if first_tail is None else bisect.bisect_left(steps, first_tail)
        for i in range(end):
            yield steps[i], totals[i] / counts[i], _at(at_us[i])
        overlap = {steps[i]: history.loss(i) for i in range(end, len(steps))}
    else:
        overlap = {}
    for step, loss in tail.losses.items():
        known = overlap.get(step)
        overlap[step] = loss if known is None else known.merge(loss)
    for step in sorted(overlap):
        loss = overlap[step]
        yield step, loss.total / loss.count, loss.at


def loss_count(history: StepHistory | None, tail: JobSteps) -> int:
    """How many points ``loss_points`` gives."""
    tail_steps = sorted(tail.losses)
    if history is None or not len(history):
        return len(tail_steps)
    end = len(history.steps) if not tail_steps else bisect.bisect_left(history.steps, tail_steps[0])
    return end + len(set(history.steps[end:]) | set(tail_steps))


def decimated(
    points: Iterable[tuple[int, float, datetime]], count: int, limit: int
) -> Iterator[tuple[int, float, datetime]]:
    """At most ``limit`` (≥ 2) of ``count`` ``points`` in step order, for a chart: the points
    cut into ``limit // 2`` runs of consecutive steps, and of each run its lowest and its
    highest loss (one point when they are the same), so a spike or a dip of a single step is
    kept however long the curve. All of them when ``count`` ≤ ``limit``."""
    if count <= limit:
        yield from points
        return
    size = -(-count // (limit // 2))  # steps per run
    run: list[tuple[int, float, datetime]] = []
    for point in points:
        run.append(point)
        if len(run) == size:
            yield from _extremes(run)
            run = []
    if run:
        yield from _extremes(run)


def _extremes(run: list[tuple[int, float, datetime]]) -> list[tuple[int, float, datetime]]:
    low = min(run, key=lambda p: p[1])
    high = max(run, key=lambda p: p[1])
    return [low] if low is high else sorted((low, high), key=lambda p: p[0])


def start_after(history: StepHistory | None, tail: JobSteps, since: datetime) -> int:
    """``JobSteps.after`` over the history and then the tail: exact where times were seen to
    follow positions across both."""
    if history is None or history.first_us is None:
        return tail.after(since)
    if not history.monotone or not tail.monotone:
        return 0
    if (
        tail.first_at is not None
        and history.last_us is not None
        and _us(tail.first_at) < history.last_us
    ):
        return 0
    found = tail.after(since)
    if found:
        return found
    i = bisect.bisect_left(history.mark_us, _us(since)) - 1
    return history.mark_positions[i] if i >= 0 else 0
