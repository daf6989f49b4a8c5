"""The ingest's fast protocol parser delivers exactly what nats-py's parser delivers."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from nats.protocol.parser import Parser

from controlplane.bus import _RawParser

RAW_SID, OTHER_SID = 7, 9


class _Client:
    """What a parser calls back on: raw handlers for RAW_SID, nats-py's path for the rest."""

    def __init__(self) -> None:
        self.got: list[Any] = []
        self.stats = {"in_msgs": 0, "in_bytes": 0}
        self._raw_handlers = {RAW_SID: self._raw}

    def _raw(self, subject: Any, reply: Any, data: bytes, headers: bytes | None) -> None:
        self.got.append(("raw", bytes(subject), bytes(reply), data, headers))

    async def _process_msg(
        self, sid: int, subject: bytes, reply: bytes, data: bytes, headers: bytes | None
    ) -> None:
        if sid in self._raw_handlers:
            self._raw_handlers[sid](subject, reply, data, headers)
        else:
            self.got.append(("msg", sid, bytes(subject), bytes(reply), data, headers))

    async def _process_ping(self) -> None:
        self.got.append("ping")

    async def _process_pong(self) -> None:
        self.got.append("pong")

    async def _process_info(self, info: dict[str, Any]) -> None:
        self.got.append(("info", info))


def _stream() -> bytes:
    frames = []
    for i in range(40):
        data = b'{"n":%d}' % i
        header = b"NATS/1.0\r\nNats-Msg-Id: id-%d\r\n\r\n" % i
        reply = b"$JS.ACK.S.C.1.%d.%d.1764470000000000000.%d" % (i + 1, i + 1, 40 - i)
        frames.append(
            b"HMSG elastic.evt.j.n.m%d.t %d %s %d %d\r\n%s%s\r\n"
            % (i, RAW_SID, reply, len(header), len(header) + len(data), header, data)
        )
        if i % 7 == 3:  # a core message without headers or reply
            frames.append(b"MSG plain.subject %d %d\r\n%s\r\n" % (RAW_SID, len(data), data))
        if i % 11 == 5:  # another subscription's message goes nats-py's way
            frames.append(b"MSG other %d _INBOX.x %d\r\n%s\r\n" % (OTHER_SID, len(data), data))
        if i % 13 == 6:
            frames.append(b"PING\r\n")
        if i == 20:  # a status: headers only (the end of a pull request)
            status = b"NATS/1.0 408 Request Timeout\r\n\r\n"
            frames.append(
                b"HMSG _INBOX.y %d %d %d\r\n%s\r\n" % (RAW_SID, len(status), len(status), status)
            )
    frames.append(b'INFO {"server_id":"x"}\r\n+OK\r\nPONG\r\n')
    return b"".join(frames)


async def _parse(parser_class: type[Parser], chunks: list[bytes]) -> list[Any]:
    client = _Client()
    parser = parser_class(client)
    for chunk in chunks:
        await parser.parse(chunk)
    return client.got


@pytest.mark.parametrize("size", [1, 2, 3, 7, 50, 97, 512, 1 << 20])
def test_same_deliveries_whatever_the_read_boundaries(size: int) -> None:
    stream = _stream()
    chunks = [stream[i : i + size] for i in range(0, len(stream), size)]
    expected = asyncio.run(_parse(Parser, [stream]))
    got = asyncio.run(_parse(_RawParser, chunks))
    assert got == expected
    assert sum(1 for g in got if g[0] == "raw") == 40 + 6 + 1  # HMSGs, MSGs to RAW_SID, status
    assert "ping" in got and got[[g[0] for g in got].index("msg")][:2] == ("msg", OTHER_SID)
