"""Publish events to JetStream at least once, re-sending what the server did not acknowledge.

Messages carry ``Nats-Msg-Id`` (the event_id) so JetStream drops a re-send it already holds;
the store drops anything older by event_id. A re-sent event may land after later ones of its
source: the sequence rules accept it into the gap it left.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from nats.js import JetStreamContext

from schemas.subjects import MSG_ID_HEADER

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Outgoing:
    """One message to publish."""

    subject: str
    data: bytes
    msg_id: str | None = None


@dataclass(slots=True)
class PublishStats:
    """What publishing took."""

    messages: int = 0
    sends: int = 0
    rounds: int = 0


async def publish_all(
    js: JetStreamContext,
    messages: Sequence[Outgoing],
    *,
    window: int = 2000,
    ack_timeout_s: float = 5.0,
    on_progress: Callable[[int], None] | None = None,
) -> PublishStats:
    """Publish every message until the server acknowledged each, in order within each round."""
    stats = PublishStats(messages=len(messages))
    todo = list(range(len(messages)))
    backoff = 0.05
    while todo:
        stats.rounds += 1
        failed: list[int] = []
        for start in range(0, len(todo), window):
            chunk = todo[start : start + window]
            futures: list[tuple[int, asyncio.Future[Any]]] = []
            for i in chunk:
                m = messages[i]
                headers = {MSG_ID_HEADER: m.msg_id} if m.msg_id else None
                try:
                    futures.append((i, await js.publish_async(m.subject, m.data, headers=headers)))
                    stats.sends += 1
                except Exception as exc:
                    log.debug("publish failed: %s", exc)
                    failed.append(i)
            if futures:
                await asyncio.wait([f for _, f in futures], timeout=ack_timeout_s)
            acked = 0
            for i, future in futures:
                if future.done() and not future.cancelled() and future.exception() is None:
                    acked += 1
                    continue
                future.cancel()  # releases its slot in the client's pending-ack window
                failed.append(i)
            if on_progress is not None:
                on_progress(acked)
        if failed:
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 1.0)
        todo = sorted(failed)
    return stats
