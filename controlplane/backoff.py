"""Exponential back-off for the service's retries (a store or a bus that is away)."""

from __future__ import annotations

import asyncio
import contextlib


class Backoff:
    """Exponential back-off that a stop request interrupts."""

    def __init__(self, first_s: float = 0.05, max_s: float = 5.0) -> None:
        self.first_s = first_s
        self.max_s = max_s
        self._next = first_s

    def reset(self) -> None:
        self._next = self.first_s

    async def sleep(self, stop: asyncio.Event) -> None:
        delay, self._next = self._next, min(self._next * 2, self.max_s)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), delay)
