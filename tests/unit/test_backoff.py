"""controlplane.backoff: delays double up to the cap, reset starts over, a stop cuts a wait."""

from __future__ import annotations

import asyncio
import time

from controlplane.backoff import Backoff


async def test_delays_double_to_the_cap_and_reset_starts_over() -> None:
    backoff = Backoff(first_s=0.01, max_s=0.04)
    stop = asyncio.Event()
    took = []
    for _ in range(4):
        started = time.monotonic()
        await backoff.sleep(stop)
        took.append(time.monotonic() - started)
    assert all(t >= d * 0.9 for t, d in zip(took, (0.01, 0.02, 0.04, 0.04), strict=True)), took
    backoff.reset()
    started = time.monotonic()
    await backoff.sleep(stop)
    assert time.monotonic() - started < 0.04


async def test_a_stop_request_ends_the_wait_at_once() -> None:
    backoff = Backoff(first_s=30.0, max_s=30.0)
    stop = asyncio.Event()
    asyncio.get_running_loop().call_later(0.05, stop.set)
    started = time.monotonic()
    await backoff.sleep(stop)
    assert time.monotonic() - started < 5.0
