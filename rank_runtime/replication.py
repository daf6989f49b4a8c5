"""Peer replication of hot backups: each member keeps copies of other ranks' shards in memory.

Every member runs a ``PeerStore``: a small TCP server (a thread per connection) that accepts a
shard (``put``), verifies its checksum before keeping it, and serves it back (``get``) for a
restore. The protocol is one JSON header line, then the raw bytes; the answer is one JSON line
(and, for ``get``, the bytes). Memory stays bounded: per (owner, shard) the newest
``keep`` steps are kept, older ones evicted once a newer one is complete.
"""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import socketserver
import threading
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

#: Largest header line accepted.
_MAX_HEADER = 64 * 1024


class ReplicationError(RuntimeError):
    """A peer refused or failed a transfer."""


def checksum(data: bytes | memoryview) -> str:
    """The checksum of a serialized shard, as events carry it (``crc32:<hex>``)."""
    return f"crc32:{zlib.crc32(data) & 0xFFFFFFFF:08x}"


@dataclass(frozen=True, slots=True)
class Held:
    """A copy of one shard at one step, verified."""

    owner: str
    shard: int
    step: int
    generation: int
    checksum: str
    data: bytes


#: Called after a copy is verified and kept: (copy, seconds the transfer took).
OnHeld = Callable[[Held, float], None]


class PeerStore:
    """Copies of other members' shards, served over TCP. No I/O before ``start``."""

    def __init__(self, *, advertise: str = "127.0.0.1", port: int = 0, keep: int = 2) -> None:
        self._advertise = advertise
        self._port = port
        self._keep = keep
        self._lock = threading.Lock()
        self._held: dict[tuple[str, int], dict[int, Held]] = {}
        self._server: socketserver.ThreadingTCPServer | None = None
        self._thread: threading.Thread | None = None
        self.on_held: OnHeld | None = None
        #: The member's own shard, served like a held copy: (shard, step) -> bytes or None.
        self.own: Callable[[int, int], bytes | None] | None = None

    @property
    def endpoint(self) -> str:
        """``host:port`` peers connect to (after ``start``)."""
        if self._server is None:
            raise RuntimeError("the peer store is not started")
        return f"{self._advertise}:{self._server.server_address[1]}"

    def start(self) -> str:
        """Listen in a background thread; return the endpoint."""
        if self._server is None:
            store = self

            class Handler(socketserver.StreamRequestHandler):
                def handle(self) -> None:
                    store._handle(self.rfile, self.wfile)

            socketserver.ThreadingTCPServer.allow_reuse_address = True
            server = socketserver.ThreadingTCPServer(("0.0.0.0", self._port), Handler)
            server.daemon_threads = True
            self._server = server
            self._thread = threading.Thread(
                target=server.serve_forever, name="elastic-peer-store", daemon=True
            )
            self._thread.start()
        return self.endpoint

    def close(self) -> None:
        """Stop serving and drop every copy."""
        server, self._server = self._server, None
        if server is not None:
            server.shutdown()
            server.server_close()
        with self._lock:
            self._held.clear()

    def held(self, owner: str | None, shard: int, step: int) -> Held | None:
        """The verified copy of ``owner``'s ``shard`` at ``step`` (any owner's: None)."""
        with self._lock:
            if owner is not None:
                return self._held.get((owner, shard), {}).get(step)
            for (_, held_shard), steps in self._held.items():
                if held_shard == shard and step in steps:
                    return steps[step]
            return None

    def nbytes(self) -> int:
        """Bytes held for others."""
        with self._lock:
            return sum(len(c.data) for steps in self._held.values() for c in steps.values())

    def keep(self, copy: Held) -> None:
        """Keep a verified copy, evicting the oldest steps beyond ``keep``."""
        with self._lock:
            steps = self._held.setdefault((copy.owner, copy.shard), {})
            steps[copy.step] = copy
            for old in sorted(steps)[: max(0, len(steps) - self._keep)]:
                del steps[old]

    def _handle(self, rfile: Any, wfile: Any) -> None:
        try:
            header = json.loads(rfile.readline(_MAX_HEADER))
            op = header.get("op")
            if op == "put":
                self._put(header, rfile, wfile)
            elif op == "get":
                self._get(header, wfile)
            else:
                _answer(wfile, {"ok": False, "error": f"unknown op {op!r}"})
        except (ValueError, KeyError, OSError) as exc:
            log.warning("peer transfer failed: %s", exc)
            with contextlib.suppress(OSError):
                _answer(wfile, {"ok": False, "error": str(exc)})

    def _put(self, header: dict[str, Any], rfile: Any, wfile: Any) -> None:
        started = time.perf_counter()
        size = int(header["nbytes"])
        data = rfile.read(size)
        if len(data) != size:
            raise ValueError(f"short transfer: {len(data)} of {size} bytes")
        got = checksum(data)
        if got != header["checksum"]:
            _answer(wfile, {"ok": False, "error": f"checksum {got} != {header['checksum']}"})
            return
        copy = Held(
            owner=str(header["owner"]),
            shard=int(header["shard"]),
            step=int(header["step"]),
            generation=int(header["generation"]),
            checksum=got,
            data=data,
        )
        self.keep(copy)
        # Reported before the sender hears back, so "sent" implies "reported" (no race).
        if self.on_held is not None:
            self.on_held(copy, time.perf_counter() - started)
        _answer(wfile, {"ok": True})

    def _get(self, header: dict[str, Any], wfile: Any) -> None:
        owner = header.get("owner")
        shard, step = int(header["shard"]), int(header["step"])
        copy = self.held(None if owner is None else str(owner), shard, step)
        data = copy.data if copy is not None else None
        if data is None and self.own is not None:
            data = self.own(shard, step)
        if data is None:
            _answer(wfile, {"ok": False, "error": "not held"})
            return
        _answer(wfile, {"ok": True, "nbytes": len(data), "checksum": checksum(data)})
        wfile.write(data)
        wfile.flush()


def _answer(wfile: Any, body: dict[str, Any]) -> None:
    wfile.write(json.dumps(body).encode() + b"\n")
    wfile.flush()


def _connect(endpoint: str, timeout: float) -> socket.socket:
    host, _, port = endpoint.rpartition(":")
    return socket.create_connection((host, int(port)), timeout=timeout)


def send(
    endpoint: str,
    *,
    owner: str,
    shard: int,
    step: int,
    generation: int,
    data: bytes,
    digest: str,
    timeout: float = 30.0,
) -> None:
    """Give a copy to the peer at ``endpoint``; raise ``ReplicationError`` if it refuses."""
    header = {
        "op": "put", "owner": owner, "shard": shard, "step": step, "generation": generation,
        "nbytes": len(data), "checksum": digest,
    }  # fmt: skip
    try:
        with _connect(endpoint, timeout) as sock, sock.makefile("rwb") as stream:
            stream.write(json.dumps(header).encode() + b"\n")
            stream.write(data)
            stream.flush()
            answer = json.loads(stream.readline(_MAX_HEADER) or b"{}")
    except (OSError, ValueError) as exc:
        raise ReplicationError(f"sending shard {shard} to {endpoint}: {exc}") from exc
    if not answer.get("ok"):
        raise ReplicationError(f"{endpoint} refused shard {shard}: {answer.get('error')}")


def fetch(
    endpoint: str, *, owner: str | None, shard: int, step: int, timeout: float = 30.0
) -> bytes:
    """Take back a verified copy from the peer at ``endpoint`` (``owner`` None: whoever's)."""
    header = {"op": "get", "owner": owner, "shard": shard, "step": step}
    try:
        with _connect(endpoint, timeout) as sock, sock.makefile("rwb") as stream:
            stream.write(json.dumps(header).encode() + b"\n")
            stream.flush()
            answer = json.loads(stream.readline(_MAX_HEADER) or b"{}")
            if not answer.get("ok"):
                raise ReplicationError(f"{endpoint} has no shard {shard}: {answer.get('error')}")
            data = stream.read(int(answer["nbytes"]))
    except (OSError, ValueError) as exc:
        raise ReplicationError(f"fetching shard {shard} from {endpoint}: {exc}") from exc
    if checksum(data) != answer["checksum"]:
        raise ReplicationError(f"shard {shard} from {endpoint} does not match its checksum")
    return bytes(data)
