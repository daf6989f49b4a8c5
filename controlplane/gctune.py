"""The garbage collector, tuned in one place: what the service, the API and a replay change.

CPython's collector walks every tracked object of the generations it collects. The control
plane's long-lived objects (the folded views: hundreds of thousands of objects at 4,096
ranks) and its short-lived ones (a batch's envelopes, a decision's world and placement)
make the default thresholds cost it pauses on the fault-to-command path and CPU for
nothing collected. Each function below says what it changes and what it was measured to
save; nothing else in the project touches ``gc``.
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from typing import Protocol

log = logging.getLogger(__name__)


class _Batches(Protocol):
    #: Decision batches recorded so far (``DeciderStats.batches``).
    batches: int


def tune_service() -> None:
    """Collect less often: the ingest allocates many short-lived objects per event, and a
    default-threshold collector spent as much CPU as the ingest itself (bench ingest).

    A young collection walks every young object still alive, and a batch in the ingest's
    pipeline keeps about six tracked objects per event alive (the delivery, the envelope and
    payload models with their dicts and sets, the stored record): at 50,000 the collector
    ran on every 10,000-event batch, walked it and freed nothing (25-60 ms of CPU each, a
    pause every two seconds with 4,096 members heartbeating). At 400,000 a young collection
    waits for objects that outlive batches (or for garbage cycles), so it runs rarely."""
    gc.freeze()  # what start-up loaded is never garbage
    gc.set_threshold(400_000, 20, 100)
    gc.callbacks.append(_gc_pause)


def without_gc(
    turn: Callable[[], Awaitable[None]],
    stats: _Batches | None = None,
    settled: Callable[[], bool] = lambda: True,
) -> Callable[[], Awaitable[None]]:
    """``turn`` with the collector held off while it runs: a decision allocates thousands of
    containers (a world, its placement, a command), which would otherwise set off a
    collection in the middle of the fault-to-command path. Whatever the turn left for the
    collector is looked at afterwards, off that path.

    After a turn that recorded decisions (``stats.batches`` moved) and left no job
    recovering (``settled``: the turn that resolves an incident, not the one that opens
    it), the young generations are collected and what survives is frozen, as the views
    folded at start-up are: the generation's world, placement and incident (hundreds of
    thousands of objects at 4,096 ranks) are no garbage, and a full collection walking them
    took 180-350 ms whenever it came (a fault reported then waited as long). The young
    collection takes a few milliseconds at 4,096 ranks; full collections then walk only
    what is newer than the last freeze. Frozen objects dropped later are still freed by
    reference counting, unless they sit in a reference cycle: the views hold none, and the
    service's full collections had found nothing to free (bench decide: 0 collected)."""

    async def run() -> None:
        enabled = gc.isenabled()
        batches = stats.batches if stats is not None else 0
        gc.disable()
        try:
            await turn()
        finally:
            if enabled:
                gc.enable()
                if stats is not None and stats.batches != batches and settled():
                    gc.collect(1)
                    gc.freeze()

    return run


_gc_started = [0.0, 0.0]


def _gc_pause(phase: str, info: dict[str, int]) -> None:
    """Log collections long enough to delay a decision (a full one walks every view)."""
    if phase == "start":
        _gc_started[0] = time.perf_counter()
        _gc_started[1] = time.thread_time()
        return
    took = time.perf_counter() - _gc_started[0]
    if took > 0.05:
        log.warning(
            "garbage collection (generation %d) took %.0f ms (%.0f ms of CPU; %d collected)",
            info["generation"],
            took * 1e3,
            (time.thread_time() - _gc_started[1]) * 1e3,
            info["collected"],
        )


def freeze() -> None:
    """What is alive now lives as long as the process (views folded at start-up): move it
    to the permanent generation, which no collection walks (freed by reference counting)."""
    gc.freeze()


def settle_heap() -> None:
    """Collect the garbage, then move every object alive into the garbage collector's
    permanent generation (``gc.freeze``), which no collection traverses.

    A full collection traverses every object, and a server's long-lived ones (the modules,
    pydantic's and SQLAlchemy's schemas, the folded views: over 100,000 objects) cost it
    100 ms of CPU or more, while the event loop waits: a request answered during one takes
    that much longer. Collections come as answers allocate; after this one they traverse only
    what was made since. Objects frozen are still freed when no longer referenced (unless
    they form a cycle), so this is for what lives as long as the process: start-up and the
    warm-up."""
    gc.collect()
    gc.freeze()


@contextmanager
def relaxed() -> Iterator[None]:
    """Collect less often while replaying: a replay allocates many short-lived objects and a
    default-threshold collector costs about a third of it (``bench replay``)."""
    before = gc.get_threshold()
    gc.set_threshold(50_000, 50, 100)
    try:
        yield
    finally:
        gc.set_threshold(*before)


@contextmanager
def held_off() -> Iterator[None]:
    """No collections inside: for work that keeps many objects alive and makes no cycles
    (a replay's parts read ahead: a collector walking them found nothing and cost a fifth
    of the CPU; a simulation's views of a 16,384-rank job: the collector cost 40% of
    ``elasticctl simulate --ranks 16384 --days 3 --strategy spares`` and found about 600
    objects in cycles at its end, freed by the next collection after it)."""
    collecting = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if collecting:
            gc.enable()
