"""A load generator that speaks the NATS protocol directly, as ``nats bench`` does.

Frames are encoded before the clock starts, so publishing costs the machine little and the
benchmark measures the control plane rather than a Python client. Every message asks for a
JetStream acknowledgement and at most ``window`` are unacknowledged at once: JetStream drops
core publishes it cannot keep up with, so flow control is what makes "lost" mean something.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from controlplane.publish import Outgoing
from schemas.subjects import MSG_ID_HEADER

_ACK_PREFIX = b"_INBOX.loadgen"


def frames(messages: Sequence[Outgoing]) -> list[bytes]:
    """The HPUB frame of each message, replying to a per-message ack subject."""
    out = []
    for i, m in enumerate(messages):
        header = b"NATS/1.0\r\n%s: %s\r\n\r\n" % (MSG_ID_HEADER.encode(), (m.msg_id or "").encode())
        out.append(
            b"HPUB %s %s.%d %d %d\r\n%s%s\r\n"
            % (
                m.subject.encode(),
                _ACK_PREFIX,
                i,
                len(header),
                len(header) + len(m.data),
                header,
                m.data,
            )
        )
    return out


@dataclass
class _Acks:
    acked: int = 0
    errors: int = 0
    progress: asyncio.Event = field(default_factory=asyncio.Event)
    pong: asyncio.Event = field(default_factory=asyncio.Event)


async def _read(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, acks: _Acks) -> None:
    buf = b""
    while True:
        data = await reader.read(1 << 16)
        if not data:
            return
        buf += data
        at = 0  # parse by offset: re-slicing the buffer per ack copies it once per message
        while True:
            nl = buf.find(b"\r\n", at)
            if nl < 0:
                break
            if buf.startswith(b"MSG ", at):
                end = nl + 2 + int(buf[buf.rfind(b" ", at, nl) + 1 : nl]) + 2
                if len(buf) < end:
                    break
                acks.acked += 1
                if buf.find(b'"error"', nl + 2, end) >= 0:
                    acks.errors += 1
                at = end
                acks.progress.set()
                continue
            if buf.startswith(b"PING", at):
                writer.write(b"PONG\r\n")
            elif buf.startswith(b"PONG", at):
                acks.pong.set()
            elif buf.startswith(b"-ERR", at):
                raise ConnectionError(buf[at:nl].decode().strip())
            at = nl + 2
        buf = buf[at:]


async def _progress(acks: _Acks, sent: int, wait_s: float = 30.0) -> None:
    """Wait for more acknowledgements; fail clearly when none come."""
    acks.progress.clear()
    try:
        await asyncio.wait_for(acks.progress.wait(), wait_s)
    except TimeoutError:
        raise TimeoutError(
            f"{sent - acks.acked} publishes unacknowledged after {wait_s:.0f}s: "
            "is there a JetStream stream for these subjects?"
        ) from None


class Publisher:
    """One connection to NATS, kept open for any number of ``send`` calls (one at a time), as
    a member's client keeps its connection: what a send times is the publish, not a
    connection's set-up."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writer = writer
        self._acks = _Acks()
        self._reading = asyncio.ensure_future(_read(reader, writer, self._acks))

    @classmethod
    async def connect(cls, url: str) -> Publisher:
        parts = urlsplit(url)
        reader, writer = await asyncio.open_connection(parts.hostname, parts.port or 4222)
        publisher = cls(reader, writer)
        try:
            options = {"verbose": False, "pedantic": False, "headers": True, "lang": "loadgen"}
            if parts.username:
                options["user"] = parts.username
                options["pass"] = parts.password or ""
            writer.write(
                b"CONNECT %s\r\nSUB %s.* 1\r\nPING\r\n"
                % (json.dumps(options).encode(), _ACK_PREFIX)
            )
            await asyncio.wait_for(publisher._pong(), 10)
        except BaseException:
            await publisher.close()
            raise
        return publisher

    async def _pong(self) -> None:
        # The reader ends on a closed connection or an -ERR: then there is no PONG to wait for.
        pong = asyncio.ensure_future(self._acks.pong.wait())
        await asyncio.wait({pong, self._reading}, return_when=asyncio.FIRST_COMPLETED)
        if not pong.done():
            pong.cancel()
            self._reading.result()  # raises what ended the reader
            raise ConnectionError("NATS closed the connection before it answered")

    async def send(self, encoded: Sequence[bytes], *, window: int = 8192) -> int:
        """Publish every frame and wait for its acknowledgement; return how many of these
        were refused."""
        acks = self._acks
        base, refused = acks.acked, acks.errors
        total = base + len(encoded)
        sent = 0
        while sent < len(encoded):
            while base + sent - acks.acked >= window:
                await _progress(acks, base + sent)
            upto = min(len(encoded), acks.acked - base + window)
            self._writer.write(b"".join(encoded[sent:upto]))
            await self._writer.drain()
            sent = upto
        while acks.acked < total:
            await _progress(acks, total)
        return acks.errors - refused

    async def send_core(self, encoded: Sequence[bytes]) -> None:
        """Publish NATS core frames (``PUB``: no acknowledgement asked, none waited for)."""
        self._writer.write(b"".join(encoded))
        await self._writer.drain()

    async def close(self) -> None:
        self._reading.cancel()
        self._writer.close()
        with contextlib.suppress(ConnectionError):
            await self._writer.wait_closed()


async def send(url: str, encoded: Sequence[bytes], *, window: int = 8192) -> int:
    """Publish every frame on a connection of its own and wait for its acknowledgement;
    return how many were refused."""
    publisher = await Publisher.connect(url)
    try:
        return await publisher.send(encoded, window=window)
    finally:
        await publisher.close()
