"""The collector around the decider's turns (``gctune.without_gc``)."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

from controlplane.decider import DeciderStats
from controlplane.gctune import without_gc


@pytest.fixture(autouse=True)
def _thawed() -> Iterator[None]:
    """Each test starts and ends with nothing frozen (a freeze is process-wide)."""
    gc.unfreeze()
    yield
    gc.unfreeze()


def _turn(stats: DeciderStats, *, records: bool, seen: list[bool]):
    async def turn() -> None:
        seen.append(gc.isenabled())
        if records:
            stats.batches += 1

    return turn


@pytest.mark.parametrize(
    ("records", "settled", "frozen"),
    [(True, True, True), (True, False, False), (False, True, False)],
)
async def test_a_turn_that_recorded_decisions_freezes_once_no_job_recovers(
    records: bool, settled: bool, frozen: bool
) -> None:
    stats, seen = DeciderStats(), []
    survivor = [object() for _ in range(10)]  # tracked, alive: frozen by a freeze
    run = without_gc(_turn(stats, records=records, seen=seen), stats, lambda: settled)
    await run()
    assert seen == [False]  # the collector was off during the turn
    assert gc.isenabled()
    assert (gc.get_freeze_count() > 0) is frozen
    assert survivor


async def test_the_collector_stays_off_if_it_was_off() -> None:
    stats, seen = DeciderStats(), []
    gc.disable()
    try:
        await without_gc(_turn(stats, records=True, seen=seen), stats)()
        assert not gc.isenabled()
        assert gc.get_freeze_count() == 0  # no collection is forced on a process without one
    finally:
        gc.enable()
