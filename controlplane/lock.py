"""One active ingest per database: a session-level PostgreSQL advisory lock.

The holder keeps a dedicated connection; PostgreSQL releases the lock the moment that
connection ends (the process died, the server restarted), and a standby's next try wins.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import psycopg

from controlplane.settings import libpq_url

log = logging.getLogger(__name__)

#: The lock's key (a bigint): "elastic" in ASCII, so it is recognisable in pg_locks.
INGEST_LOCK_KEY = 0x656C6173746963


class AdvisoryLock:
    """Acquire, watch and release one advisory lock. The constructor does no I/O."""

    def __init__(self, database_url: str, key: int = INGEST_LOCK_KEY) -> None:
        self._url = libpq_url(database_url)
        self._key = key
        self._conn: psycopg.AsyncConnection[Any] | None = None

    async def try_acquire(self) -> bool:
        """Take the lock if it is free; False if someone else holds it or the server is down."""
        try:
            if self._conn is None or self._conn.closed:
                self._conn = await psycopg.AsyncConnection.connect(self._url, autocommit=True)
            cur = await self._conn.execute("SELECT pg_try_advisory_lock(%s)", (self._key,))
            row = await cur.fetchone()
            return bool(row and row[0])
        except psycopg.Error as exc:
            log.debug("advisory lock not taken: %s", exc)
            await self.release()
            return False

    async def acquire(
        self,
        stop: asyncio.Event,
        retry_s: float = 1.0,
        on_standby: Callable[[], Awaitable[None]] | None = None,
    ) -> bool:
        """Wait until the lock is ours (True) or ``stop`` is set (False).

        A standby waits inside PostgreSQL (``pg_advisory_lock`` under a ``lock_timeout`` of
        ``retry_s``), so it takes the lock the moment the holder's connection ends, not at
        its next try; ``stop`` is looked at between waits. ``on_standby`` is awaited once,
        when another control plane is found holding the lock (not while the server is
        down): what only the leader may keep (a listening port) is let go then."""
        waiting = False
        others = False
        while not stop.is_set():
            if await self._wait(retry_s):
                if waiting:
                    log.info("took over the ingest lock")
                return True
            if not waiting:
                log.info("another control plane holds the ingest lock; standing by")
                waiting = True
            if not others and self._conn is not None and on_standby is not None:
                others = True  # the server answered: the lock is someone else's
                await on_standby()
            if self._conn is None:  # the server is down: no wait happened inside it
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), retry_s)
        return False

    async def _wait(self, wait_s: float) -> bool:
        """Take the lock, waiting up to ``wait_s`` for its holder to let it go; False if it
        did not (the connection is kept) or the server is down (it is closed)."""
        try:
            if self._conn is None or self._conn.closed:
                self._conn = await psycopg.AsyncConnection.connect(self._url, autocommit=True)
            await self._conn.execute(f"SET lock_timeout = {max(1, round(wait_s * 1000))}")
            await self._conn.execute("SELECT pg_advisory_lock(%s)", (self._key,))
            return True
        except psycopg.errors.LockNotAvailable:
            return False
        except psycopg.Error as exc:
            log.debug("advisory lock not taken: %s", exc)
            await self.release()
            return False

    async def held(self) -> bool:
        """Whether the lock's connection is still alive (so the lock is still ours)."""
        conn = self._conn
        if conn is None or conn.closed:
            return False
        try:
            await conn.execute("SELECT 1")
            return True
        except psycopg.Error:
            return False

    async def release(self) -> None:
        """Give the lock back by closing its connection."""
        conn, self._conn = self._conn, None
        if conn is not None and not conn.closed:
            with contextlib.suppress(psycopg.Error):
                await conn.close()
