"""The benchmarks' raw-protocol publisher against a real JetStream: every frame acknowledged,
on one connection kept open across sends, or on one of its own."""

from __future__ import annotations

import nats
import pytest

from controlplane.bench import loadgen
from controlplane.bus import ensure_stream
from controlplane.publish import Outgoing
from controlplane.settings import Settings
from schemas.subjects import event_subject

pytestmark = [pytest.mark.services, pytest.mark.usefixtures("clean_stream")]


def _messages(first: int, count: int) -> list[Outgoing]:
    subject = event_subject("job-loadgen", "n0", "m0", "member.heartbeat")
    return [Outgoing(subject, b'{"n":%d}' % i, f"loadgen-{i}") for i in range(first, first + count)]


async def _stored(url: str) -> int:
    nc = await nats.connect(url)
    try:
        info = await nc.jetstream().stream_info(Settings().stream)
        return int(info.state.messages)
    finally:
        await nc.close()


async def test_a_kept_connection_sends_again_and_again(services):
    nc = await nats.connect(services.nats_url)
    await ensure_stream(nc.jetstream(), Settings())
    await nc.close()
    publisher = await loadgen.Publisher.connect(services.nats_url)
    try:
        # Sizes below, at and above the window: each send waits for its own acknowledgements.
        assert await publisher.send(loadgen.frames(_messages(0, 5)), window=8) == 0
        assert await _stored(services.nats_url) == 5
        assert await publisher.send(loadgen.frames(_messages(5, 8)), window=8) == 0
        assert await publisher.send(loadgen.frames(_messages(13, 300)), window=8) == 0
        assert await _stored(services.nats_url) == 313
        # A repeated message id is acknowledged (as a duplicate), not stored twice.
        assert await publisher.send(loadgen.frames(_messages(0, 2))) == 0
        assert await _stored(services.nats_url) == 313
    finally:
        await publisher.close()
    # The one-shot form opens and closes a connection of its own.
    assert await loadgen.send(services.nats_url, loadgen.frames(_messages(313, 7))) == 0
    assert await _stored(services.nats_url) == 320
