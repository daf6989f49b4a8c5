"""Peer replication of hot backups: each member keeps copies of other ranks' shards in memory.

Every member runs a ``PeerStore``: a small TCP server (a thread per connection) that accepts a
shard (``put``), keeps it under the digest its owner gave, and serves it back (``get``) for a
restore. Memory stays bounded: per (owner, shard) the newest ``keep`` steps are kept, older ones
evicted once a newer one is complete, and the buffer evicted last receives the next put of the
same size (``keep`` + 1 buffers per (owner, shard)); one put is at most ``max_bytes``.

The protocol, one request per connection (JSON lines, then raw bytes)::

    server: {"peer": 2, "nonce": <16 random bytes, hex>, "auth": true|false}
    client: {"op": "put"|"get", ...fields, "nonce": <client nonce>, "mac": <hex>}  [+ bytes]
    server: {"ok": ..., ...fields, "mac": <hex>}                                   [+ bytes]

With the job's secret (``ELASTIC_JOB_SECRET``, see ``schemas.auth``) both sides are
authenticated: the request's MAC is HMAC-SHA256 under the peer-store key over the server's
fresh nonce and the request (so a recorded request replayed on a new connection is refused,
and so is any request from someone without the secret), the answer's MAC covers both nonces and
the answer. The MACs cover a few hundred bytes; the shard's bytes are bound to its owner end to
end, by the digest, and checked where they are used:

- a put's header carries the shard's size and digest (``sha256:<hex>``, computed once by its
  owner, the one it reports to the control plane in ``backup.snapshot``) under the MAC, so only
  a member with the secret can store a copy, and the digest a copy is kept and served under is
  the one its sender claimed. The holder does not hash the bytes before it answers (they arrive
  at loopback/network speed, into a reused buffer) unless it verifies puts (``verify``,
  ``ELASTIC_PEER_VERIFY=1``): then it hashes them as they arrive and refuses a copy that does
  not match, so a corrupt copy is caught at backup time rather than at restore;
- a get's answer carries the copy's digest under the MAC, and the fetcher hashes every byte it
  receives and refuses the copy (``DigestMismatch``) unless it matches that digest and, when
  given, the digest the control plane recorded from the owner (``expected``). The restore
  (``Elastic._restore``) always gives it, so a refused copy is reported and the control plane
  re-plans from another copy, an older step or the cold checkpoint.

Why this is sound: the bytes a restore loads must hash to the digest the owner reported on its
own NATS credential, whatever a holder says. A path that changes a put's bytes, or a holder
that keeps or serves other bytes (even an insider with the secret, whose MACs are valid), can
only make its copy unusable — refused at restore, which costs a re-plan — never make a restore
load bytes other than the owner's; changing the digest in a put's header breaks its MAC. What
an unverified copy loses is only how early corruption is noticed: a holder's
``backup.replicated`` says it holds ``nbytes`` under the owner's digest, not that it hashed
them (``Held.verified``). Each byte is hashed once by its owner and once by whoever restores
it (twice with ``verify``). Without a secret the same protocol runs unauthenticated (no MACs),
as before, and the same digests guard against corruption.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import logging
import os
import queue
import secrets
import socket
import socketserver
import ssl
import sys
import threading
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import cache
from typing import Any, Protocol

from schemas.auth import derive

log = logging.getLogger(__name__)

#: Where the peer store listens (an address of this host); default: the advertised address.
BIND_ENV = "ELASTIC_PEER_BIND"
#: The address peers are told to reach this member's store at.
ADVERTISE_ENV = "ELASTIC_ADVERTISE"
#: TLS (optional): the store's certificate and key (PEM); with them it serves ``tls://``.
TLS_CERT_ENV = "ELASTIC_TLS_CERT"
TLS_KEY_ENV = "ELASTIC_TLS_KEY"
#: The CA bundle (PEM) a ``tls://`` store's certificate is verified with (else the system's).
TLS_CA_ENV = "ELASTIC_TLS_CA"
_TLS_SCHEME = "tls://"
#: ``1``: a holder hashes each put as it arrives and refuses one that does not match the
#: owner's digest (a corrupt copy caught at backup time); default: the fetcher checks it.
VERIFY_ENV = "ELASTIC_PEER_VERIFY"
#: How much lower (``nice``) than training a replicator thread and a holder's put run.
BACKGROUND_NICE = 5
#: How much lower (``nice``, default 5) than training the replicator thread and a holder's
#: receiving threads run (Linux; 0: at training's priority).
NICE_ENV = "ELASTIC_REPLICATION_NICE"
#: Largest header line accepted.
_MAX_HEADER = 64 * 1024
#: Bytes received (and hashed) per read, and sent per write.
_CHUNK = 4 * 1024 * 1024
#: Largest shard a holder accepts by default (one put).
DEFAULT_MAX_BYTES = 64 * 1024**3
_PROTOCOL = 2
#: Seconds a holder waits on one read or write of a connection before dropping it.
_IDLE_S = 60.0
_REQUEST = b"elastic-peer/request"
_ANSWER = b"elastic-peer/answer"


#: Bytes as they can be sent: one buffer, or the parts of one in order.
Buffer = bytes | bytearray | memoryview


def _parts(data: Buffer | Sequence[Buffer]) -> list[memoryview]:
    """``data`` as byte views, one per part (no copy)."""
    pieces = [data] if isinstance(data, bytes | bytearray | memoryview) else data
    return [memoryview(piece).cast("B") for piece in pieces]


class ReplicationError(RuntimeError):
    """A peer refused or failed a transfer."""


class DigestMismatch(ReplicationError):
    """A peer served bytes that do not hash to the digest they must have."""


class NotHeld(ReplicationError):
    """The peer answered, and holds no copy of what was asked (it never got it, or has
    evicted it since)."""


class Abandoned(ReplicationError):
    """The sender gave a transfer up midway (``Abandon.set``)."""


class Abandon:
    """Giving up, from another thread, the transfers ``send`` is making under it: ``set``
    ends each one midway, also one blocked on a holder that does not read (its connection
    is shut down), and ``send`` raises ``Abandoned``; ``clear`` lets later ones run."""

    def __init__(self) -> None:
        self._set = threading.Event()
        self._lock = threading.Lock()
        self._sockets: set[socket.socket] = set()

    def is_set(self) -> bool:
        return self._set.is_set()

    def set(self) -> None:
        with self._lock:
            self._set.set()
            for sock in self._sockets:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)

    def clear(self) -> None:
        self._set.clear()

    def check(self) -> None:
        """Raise ``Abandoned`` once set."""
        if self._set.is_set():
            raise Abandoned("the transfer was given up")

    @contextlib.contextmanager
    def watching(self, sock: socket.socket) -> Iterator[None]:
        """Make ``set`` end ``sock`` while the block runs (at once when already set)."""
        with self._lock:
            self.check()
            self._sockets.add(sock)
        try:
            yield
        finally:
            with self._lock:
                self._sockets.discard(sock)


def checksum(data: bytes | bytearray | memoryview) -> str:
    """A crc32 of ``data`` (``crc32:<hex>``): a fast corruption check, no defence against people."""
    return f"crc32:{zlib.crc32(data) & 0xFFFFFFFF:08x}"


class _Hasher(Protocol):
    def update(self, data: bytes | bytearray | memoryview, /) -> None: ...

    def hexdigest(self) -> str: ...


class _Crc32:
    def __init__(self) -> None:
        self._value = 0

    def update(self, data: bytes | bytearray | memoryview, /) -> None:
        self._value = zlib.crc32(data, self._value)

    def hexdigest(self) -> str:
        return f"{self._value:08x}"


#: Digest algorithms a shard may be reported with: sha256 (cryptographic, with security on;
#: SHA-NI makes it the fastest here) and crc32 (corruption only, without a secret).
DIGESTS: dict[str, Callable[[], _Hasher]] = {"sha256": hashlib.sha256, "crc32": _Crc32}


def hasher(algorithm: str) -> _Hasher:
    """A fresh hasher of ``algorithm``; ValueError when it is not one of ``DIGESTS``."""
    try:
        return DIGESTS[algorithm]()
    except KeyError:
        raise ValueError(f"unknown digest algorithm {algorithm!r}") from None


def digest(data: bytes | bytearray | memoryview, algorithm: str = "sha256") -> str:
    """The digest of ``data`` as events carry it (``<algorithm>:<hex>``)."""
    h = hasher(algorithm)
    h.update(data)
    return f"{algorithm}:{h.hexdigest()}"


def peer_key(job_secret: bytes) -> bytes:
    """The key the peer store's MACs use, derived from the job's secret (one purpose each)."""
    return derive(job_secret, "elastic/peer-store")


def _canonical(body: dict[str, Any]) -> bytes:
    return json.dumps(
        {k: v for k, v in body.items() if k != "mac"}, sort_keys=True, separators=(",", ":")
    ).encode()


def _mac(key: bytes, label: bytes, *parts: bytes) -> str:
    mac = hmac.new(key, label, hashlib.sha256)
    for part in parts:
        mac.update(len(part).to_bytes(8, "little"))
        mac.update(part)
    return mac.hexdigest()


def _valid(key: bytes, body: dict[str, Any], label: bytes, *parts: bytes) -> bool:
    given = body.get("mac")
    if not isinstance(given, str):
        return False
    return hmac.compare_digest(given, _mac(key, label, *parts, _canonical(body)))


def _nonce(body: dict[str, Any]) -> bytes:
    value = body.get("nonce")
    if not isinstance(value, str) or len(value) != 32:
        raise ValueError("missing or malformed nonce")
    return bytes.fromhex(value)


class Sink(Protocol):
    """Where received bytes go, in order: ``writable`` names the memory the next bytes are
    read into (at most ``limit`` of them, at least one), ``wrote`` says how many landed.
    Memory once named is not written again by the sink (the bytes that landed there may
    still be hashed, on another thread, after ``wrote``)."""

    def writable(self, limit: int) -> memoryview: ...

    def wrote(self, count: int) -> None: ...


class _Buffer:
    """A ``Sink`` filling one buffer from its start."""

    def __init__(self, data: bytearray) -> None:
        self.data = data
        self._view = memoryview(data)
        self._position = 0

    def writable(self, limit: int) -> memoryview:
        return self._view[self._position : self._position + limit]

    def wrote(self, count: int) -> None:
        self._position += count


def _receive(
    rfile: Any, size: int, algorithm: str | None, into: bytearray | None = None
) -> tuple[bytearray, str | None]:
    """Read exactly ``size`` bytes into ``into`` (when it has that size; else a new buffer),
    hashing them as they arrive with ``algorithm`` (None: not hashed)."""
    data = into if into is not None and len(into) == size else bytearray(size)
    return data, _receive_into(rfile, size, algorithm, _Buffer(data))


#: Transfers at least this large are hashed on a thread of their own while they arrive.
_BEHIND_MIN = 4 * _CHUNK


class _HashBehind:
    """A hasher fed on a thread of its own, in order: the parts that landed are hashed while
    the next ones are received (the socket's copy and the hash overlap, on two cores)."""

    def __init__(self, algorithm: str) -> None:
        self._hasher = hasher(algorithm)
        self._parts: queue.SimpleQueue[memoryview | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="elastic-digest", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while (part := self._parts.get()) is not None:
            self._hasher.update(part)  # hashlib lets go of the GIL over large buffers

    def update(self, part: memoryview) -> None:
        self._parts.put(part)

    def close(self) -> None:
        """Wait until every part given is hashed (idempotent)."""
        if self._thread.is_alive():
            self._parts.put(None)
            self._thread.join()

    def hexdigest(self) -> str:
        self.close()
        return self._hasher.hexdigest()


def _receive_into(rfile: Any, size: int, algorithm: str | None, sink: Sink) -> str | None:
    """Read exactly ``size`` bytes into the memory ``sink`` names, hashing each part where it
    landed (while it is in cache; from ``_BEHIND_MIN`` bytes on, on a thread of its own while
    the next part arrives); the digest (None without ``algorithm``), once every byte is
    hashed."""
    if algorithm is None:
        h: _Hasher | _HashBehind | None = None
    else:
        h = _HashBehind(algorithm) if size >= _BEHIND_MIN else hasher(algorithm)
    position = 0
    try:
        while position < size:
            part = sink.writable(min(_CHUNK, size - position))
            got = rfile.readinto(part)
            if not got:
                raise ValueError(f"short transfer: {position} of {size} bytes")
            if h is not None:
                h.update(part[:got])
            sink.wrote(got)
            position += got
        return None if h is None else f"{algorithm}:{h.hexdigest()}"
    finally:
        if isinstance(h, _HashBehind):
            h.close()


def _algorithm(text: object) -> str:
    if not isinstance(text, str) or ":" not in text:
        raise ValueError(f"malformed digest {text!r}")
    algorithm = text.partition(":")[0]
    if algorithm not in DIGESTS:
        raise ValueError(f"unknown digest algorithm {algorithm!r}")
    return algorithm


@dataclass(frozen=True, slots=True)
class Held:
    """A copy of one shard at one step, kept under the digest its owner gave for it (in the
    put's header, under the MAC with the job's secret). ``verified``: the holder hashed the
    bytes and they match it (``PeerStore(verify=True)``); otherwise the fetcher checks them."""

    owner: str
    shard: int
    step: int
    generation: int
    checksum: str
    data: bytes | bytearray
    verified: bool = False


#: This member's own shard, served like a held copy: (shard, step) -> (bytes, digest) or None.
OwnCopy = Callable[[int, int], "tuple[bytes | bytearray, str] | None"]


def server_tls(env: dict[str, str] | None = None) -> ssl.SSLContext | None:
    """The TLS context a peer store serves with: ``ELASTIC_TLS_CERT`` (and ``_KEY``) when set,
    else None (plain TCP)."""
    values = os.environ if env is None else env
    cert = values.get(TLS_CERT_ENV, "").strip()
    if not cert:
        return None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(cert, values.get(TLS_KEY_ENV, "").strip() or None)
    return context


@cache
def client_tls(cafile: str | None = None) -> ssl.SSLContext:
    """The context a ``tls://`` store is reached with: its certificate and host name verified
    against ``cafile`` (``ELASTIC_TLS_CA``) or the system's CAs."""
    context = ssl.create_default_context(cafile=cafile)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    return context


def background_priority(nice: int | None = None) -> bool:
    """Lower the calling thread's CPU priority by ``nice`` (default ``ELASTIC_REPLICATION_NICE``,
    else ``BACKGROUND_NICE``), so that where replication and training contend for a core,
    training wins. Linux only, where a thread has a priority of its own (elsewhere it would
    lower the whole process): returns whether it was done."""
    if nice is None:
        text = os.environ.get(NICE_ENV, "").strip()
        nice = int(text) if text.isdigit() else BACKGROUND_NICE
    if not sys.platform.startswith("linux") or nice <= 0:
        return False
    try:
        tid = threading.get_native_id()
        current = os.getpriority(os.PRIO_PROCESS, tid)
        os.setpriority(os.PRIO_PROCESS, tid, min(19, current + nice))
    except OSError:
        return False
    return True


def verify_from_env(env: dict[str, str] | None = None) -> bool:
    """Whether a holder hashes every put before it keeps it (``ELASTIC_PEER_VERIFY=1``)."""
    value = (os.environ if env is None else env).get(VERIFY_ENV, "").strip().lower()
    return value in {"1", "true", "yes", "on"}


def bind_address(advertise: str, env: dict[str, str] | None = None) -> str:
    """Where a peer store listens: ``ELASTIC_PEER_BIND`` when set, else the advertised address
    (never every interface unless asked: ``ELASTIC_PEER_BIND=0.0.0.0``)."""
    value = (os.environ if env is None else env).get(BIND_ENV, "").strip()
    return value or advertise


class PeerStore:
    """Copies of other members' shards, served over TCP. No I/O before ``start``.

    ``secret`` is the job's secret: with it every request and answer is authenticated; without
    it (None) the store accepts anyone, as before the job secret existed. ``verify``: hash
    each put as it arrives and refuse it unless it matches its owner's digest (default:
    ``ELASTIC_PEER_VERIFY``; off: the copy is kept under the owner's digest and checked by
    whoever fetches it, see the module's docstring).

    Receive buffers are reused: per (owner, shard) the buffer of the copy evicted last is kept
    (unless a get still serves it) and the next put of the same size is received into it, so
    a holder's memory stays at ``keep`` + 1 buffers per (owner, shard), as it peaked before
    during each put, and a put's bytes land in memory already faulted in.
    """

    def __init__(
        self,
        *,
        advertise: str = "127.0.0.1",
        bind: str | None = None,
        port: int = 0,
        keep: int = 2,
        secret: bytes | None = None,
        max_bytes: int = DEFAULT_MAX_BYTES,
        tls: ssl.SSLContext | None = None,
        verify: bool | None = None,
    ) -> None:
        self._advertise = advertise
        #: Hash each put before keeping it (None: ``ELASTIC_PEER_VERIFY``).
        self.verify = verify_from_env() if verify is None else verify
        #: The TLS context to serve with (None: plain TCP); read by ``start``.
        self.tls = tls
        self._bind = bind if bind is not None else advertise
        self._port = port
        self._keep = keep
        self._key = peer_key(secret) if secret is not None else None
        self._max_bytes = max_bytes
        self._lock = threading.Lock()
        self._held: dict[tuple[str, int], dict[int, Held]] = {}
        #: Per (owner, shard): the buffer of the copy evicted last, for the next put.
        self._spare: dict[tuple[str, int], bytearray] = {}
        #: id(buffer) -> gets serving it now (such a buffer is never reused).
        self._serving: dict[int, int] = {}
        self._server: socketserver.ThreadingTCPServer | None = None
        self._thread: threading.Thread | None = None
        self.own: OwnCopy | None = None
        #: Fault injection only (``rank_runtime.faults``): rewrites the bytes a get serves.
        self.tamper: Callable[[bytes | bytearray], bytes] | None = None
        #: Requests refused for a missing or wrong MAC (each also logged).
        self.refused = 0

    @property
    def authenticated(self) -> bool:
        """Whether requests need the job's secret."""
        return self._key is not None

    @property
    def endpoint(self) -> str:
        """``host:port`` peers connect to (after ``start``)."""
        if self._server is None:
            raise RuntimeError("the peer store is not started")
        scheme = _TLS_SCHEME if self.tls is not None else ""
        return f"{scheme}{self._advertise}:{self._server.server_address[1]}"

    @property
    def address(self) -> tuple[str, int]:
        """The address the store listens on (after ``start``)."""
        if self._server is None:
            raise RuntimeError("the peer store is not started")
        host, port = self._server.server_address[:2]
        return str(host), int(port)

    def start(self) -> str:
        """Listen in a background thread; return the endpoint."""
        if self._server is None:
            store = self
            family = socket.AF_INET6 if ":" in self._bind else socket.AF_INET
            tls = self.tls

            class Handler(socketserver.StreamRequestHandler):
                timeout = _IDLE_S  # per read or write: an idle client does not hold a thread

                def handle(self) -> None:
                    store._handle(self.rfile, self.wfile, self.client_address)

            class Server(socketserver.ThreadingTCPServer):
                allow_reuse_address = True
                daemon_threads = True
                address_family = family

                def get_request(self) -> tuple[socket.socket, Any]:
                    sock, address = super().get_request()
                    if tls is None:
                        return sock, address
                    # The handshake happens on the first read or write, in the handler's thread.
                    return tls.wrap_socket(sock, server_side=True,
                                           do_handshake_on_connect=False), address  # fmt: skip

            server = Server((self._bind, self._port), Handler)
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
            self._spare.clear()

    def held(
        self, owner: str | None, shard: int, step: int, digest: str | None = None
    ) -> Held | None:
        """The verified copy of ``owner``'s ``shard`` at ``step`` (any owner's: None), the one
        with ``digest`` first when given."""
        with self._lock:
            if owner is not None:
                found = self._held.get((owner, shard), {}).get(step)
                return found
            candidates = [
                steps[step]
                for (_, held_shard), steps in self._held.items()
                if held_shard == shard and step in steps
            ]
        for copy in candidates:
            if digest is None or copy.checksum == digest:
                return copy
        return candidates[0] if candidates else None

    def nbytes(self) -> int:
        """Bytes held for others: their copies and the receive buffers kept for reuse."""
        with self._lock:
            held = sum(len(c.data) for steps in self._held.values() for c in steps.values())
            return held + sum(len(b) for b in self._spare.values())

    def keep(self, copy: Held) -> None:
        """Keep a copy, evicting the oldest steps beyond ``keep`` (the last one evicted, when
        no get serves it, becomes the receive buffer of the next put of that shard)."""
        with self._lock:
            key = (copy.owner, copy.shard)
            steps = self._held.setdefault(key, {})
            replaced = steps.get(copy.step)
            steps[copy.step] = copy
            dropped = [steps.pop(old) for old in sorted(steps)[: max(0, len(steps) - self._keep)]]
            for gone in [replaced, *dropped]:
                data = None if gone is None else gone.data
                reusable = data is not copy.data and id(data) not in self._serving
                if isinstance(data, bytearray) and reusable:
                    self._spare[key] = data

    def _buffer(self, owner: str, shard: int, size: int) -> bytearray | None:
        """The spare buffer of (owner, shard) when it has ``size`` bytes (else it is freed)."""
        with self._lock:
            spare = self._spare.pop((owner, shard), None)
        return spare if spare is not None and len(spare) == size else None

    # ------------------------------------------------------------------ serving

    def _handle(self, rfile: Any, wfile: Any, peer: Any = None) -> None:
        server_nonce = secrets.token_bytes(16)
        client_nonce = b""
        try:
            hello = {"peer": _PROTOCOL, "nonce": server_nonce.hex(), "auth": self.authenticated}
            try:
                wfile.write(json.dumps(hello).encode() + b"\n")
                first = rfile.readline(_MAX_HEADER)
            except (ssl.SSLEOFError, ConnectionResetError, BrokenPipeError):
                first = b""  # (a TLS store: gone during the handshake)
            if not first:
                return  # closed before asking anything: a reachability probe (``unreachable``)
            header = json.loads(first)
            if not isinstance(header, dict):
                raise ValueError("the request is not a JSON object")
            client_nonce = _nonce(header)
            if self._key is not None and not _valid(self._key, header, _REQUEST, server_nonce):
                self.refused += 1
                log.warning(
                    "peer store refused %s %s from %s: no valid MAC with the job's secret",
                    header.get("op"), header.get("shard"), peer,
                )  # fmt: skip
                self._answer(wfile, server_nonce, client_nonce,
                             {"ok": False, "error": "unauthenticated: no valid MAC"})  # fmt: skip
                return
            op = header.get("op")
            if op == "put":
                self._put(header, rfile, wfile, server_nonce, client_nonce)
            elif op == "get":
                self._get(header, wfile, server_nonce, client_nonce)
            else:
                self._answer(wfile, server_nonce, client_nonce,
                             {"ok": False, "error": f"unknown op {op!r}"})  # fmt: skip
        except (ValueError, KeyError, TypeError, OSError) as exc:
            log.warning("peer transfer from %s failed: %s", peer, exc)
            with contextlib.suppress(OSError, ValueError):
                self._answer(wfile, server_nonce, client_nonce, {"ok": False, "error": str(exc)})

    def _answer(
        self, wfile: Any, server_nonce: bytes, client_nonce: bytes, body: dict[str, Any]
    ) -> None:
        if self._key is not None:
            body = {**body, "mac": _mac(self._key, _ANSWER, server_nonce, client_nonce,
                                        _canonical(body))}  # fmt: skip
        wfile.write(json.dumps(body).encode() + b"\n")
        wfile.flush()

    def _put(
        self,
        header: dict[str, Any],
        rfile: Any,
        wfile: Any,
        server_nonce: bytes,
        client_nonce: bytes,
    ) -> None:
        background_priority()  # this connection's thread: receiving yields to training
        size = int(header["nbytes"])
        if not 0 <= size <= self._max_bytes:
            raise ValueError(f"a shard of {size} bytes exceeds this holder's {self._max_bytes}")
        claimed = header["digest"]
        algorithm = _algorithm(claimed)
        owner, shard = str(header["owner"]), int(header["shard"])
        step, generation = int(header["step"]), int(header["generation"])
        verify = self.verify
        data, got = _receive(rfile, size, algorithm if verify else None,
                             self._buffer(owner, shard, size))  # fmt: skip
        if verify and got != claimed:
            self._answer(wfile, server_nonce, client_nonce,
                         {"ok": False, "error": f"digest {got} != {claimed}"})  # fmt: skip
            return
        copy = Held(owner=owner, shard=shard, step=step, generation=generation,
                    checksum=claimed, data=data, verified=verify)  # fmt: skip
        self.keep(copy)
        # Answered once kept: the owner names only holders that hold its copy.
        self._answer(wfile, server_nonce, client_nonce, {"ok": True})

    def _get(
        self, header: dict[str, Any], wfile: Any, server_nonce: bytes, client_nonce: bytes
    ) -> None:
        owner = header.get("owner")
        wanted = header.get("digest")
        shard, step = int(header["shard"]), int(header["step"])
        copy = self.held(None if owner is None else str(owner), shard, step, wanted)
        found: tuple[bytes | bytearray, str] | None = None
        if copy is not None and (wanted is None or copy.checksum == wanted):
            found = copy.data, copy.checksum
        if found is None and self.own is not None:
            found = self.own(shard, step)
        if found is None and copy is not None:
            found = copy.data, copy.checksum  # not the wanted one: the fetcher will say so
        if found is None:
            self._answer(wfile, server_nonce, client_nonce, {"ok": False, "error": "not held"})
            return
        data, known = found
        if self.tamper is not None:
            data = self.tamper(data)
            known = digest(data, _algorithm(known))
        with self._lock:  # a buffer being served is not reused for a put meanwhile
            self._serving[id(data)] = self._serving.get(id(data), 0) + 1
        try:
            self._answer(wfile, server_nonce, client_nonce,
                         {"ok": True, "nbytes": len(data), "digest": known})  # fmt: skip
            wfile.write(memoryview(data))
            wfile.flush()
        finally:
            with self._lock:
                left = self._serving.pop(id(data)) - 1
                if left:
                    self._serving[id(data)] = left


# ---------------------------------------------------------------------- clients

#: Hosts a member probes after a failed collective (``unreachable``), and how long it waits
#: for each to answer.
PROBE_HOSTS = 8
PROBE_TIMEOUT_S = 1.0


def _address(endpoint: str) -> tuple[str, str]:
    """(host, port) of ``endpoint`` (``host:port``, ``[v6]:port``, or ``tls://`` either)."""
    host, _, port = endpoint.removeprefix(_TLS_SCHEME).rpartition(":")
    return host.strip("[]"), port


def _answers(endpoint: str, timeout_s: float) -> bool:
    """Whether ``endpoint``'s host answers a TCP connection at all: accepted, or refused
    (its kernel answered: the host is reachable, whatever became of that process); not a
    timeout or an unreachable network."""
    host, port = _address(endpoint)
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except ConnectionRefusedError:
        return True
    except (OSError, ValueError):
        return False
    return True


def unreachable(
    endpoints: dict[str, str],
    own: str,
    *,
    hosts: int = PROBE_HOSTS,
    timeout_s: float = PROBE_TIMEOUT_S,
) -> list[str]:
    """The members (of ``endpoints``: member -> its peer store) on hosts that do not answer
    a connection from here, for a failed collective's report. A partition between hosts shows
    in no heartbeat and fails every side's collectives alike, naming nobody; a host's peers
    that cannot reach it name it, and the control plane finds it once members on two nodes
    agree (``controlplane.core.detect``), while what the cut-off host says of the others is
    corroborated by no one.

    One store a host is probed (a host answers for every member on it), at most ``hosts``
    hosts, in parallel: the ones after this member's own in sorted order, wrapping around,
    so that every host is probed by that many others however large the world. Members on
    this member's own host are never named."""
    by_host: dict[str, list[str]] = {}
    for member, endpoint in endpoints.items():
        if endpoint:
            by_host.setdefault(_address(endpoint)[0], []).append(member)
    mine = _address(endpoints.get(own, ""))[0]
    others = sorted(h for h in by_host if h != mine)
    later = [h for h in others if h > mine]
    chosen = (later + others[: len(others) - len(later)])[:hosts]
    if not chosen:
        return []
    answered: dict[str, bool] = {}

    def probe(host: str) -> None:
        answered[host] = _answers(endpoints[min(by_host[host])], timeout_s)

    threads = [threading.Thread(target=probe, args=(h,), daemon=True) for h in chosen]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout_s + 1.0)
    return sorted(m for h in chosen if not answered.get(h, False) for m in by_host[h])


def _connect(endpoint: str, timeout: float, tls: ssl.SSLContext | None = None) -> socket.socket:
    """A connection to ``endpoint`` (``host:port``, or ``tls://host:port``: TLS, verified with
    ``tls`` or else ``client_tls(ELASTIC_TLS_CA)``)."""
    secure = endpoint.startswith(_TLS_SCHEME)
    host, port = _address(endpoint)
    sock = socket.create_connection((host, int(port)), timeout=timeout)
    if not secure:
        return sock
    context = tls if tls is not None else client_tls(os.environ.get(TLS_CA_ENV) or None)
    try:
        return context.wrap_socket(sock, server_hostname=host)
    except BaseException:
        sock.close()
        raise


class _Session:
    """One request to a peer store: the hello read, the request sent, the answer checked."""

    def __init__(self, sock: socket.socket, endpoint: str, secret: bytes | None) -> None:
        self.sock = sock
        self.endpoint = endpoint
        self.rfile = sock.makefile("rb")
        self.key = peer_key(secret) if secret is not None else None
        hello = json.loads(self.rfile.readline(_MAX_HEADER) or b"{}")
        if not isinstance(hello, dict) or hello.get("peer") != _PROTOCOL:
            raise ValueError(f"{endpoint} does not speak the peer-store protocol {_PROTOCOL}")
        self.server_nonce = _nonce(hello)
        if self.key is not None and not hello.get("auth"):
            raise ReplicationError(
                f"{endpoint} does not authenticate (no job secret there): refusing to use it"
            )
        self.client_nonce = secrets.token_bytes(16)

    def request(
        self, body: dict[str, Any], parts: Sequence[memoryview] = (), abandon: Abandon | None = None
    ) -> None:
        body = {**body, "nonce": self.client_nonce.hex()}
        if self.key is not None:
            body["mac"] = _mac(self.key, _REQUEST, self.server_nonce, _canonical(body))
        self.sock.sendall(json.dumps(body).encode() + b"\n")
        for part in parts:  # as they are: no copy into one buffer
            for start in range(0, len(part), _CHUNK):
                if abandon is not None:
                    abandon.check()
                self.sock.sendall(part[start : start + _CHUNK])

    def answer(self) -> dict[str, Any]:
        answer = json.loads(self.rfile.readline(_MAX_HEADER) or b"{}")
        if not isinstance(answer, dict):
            raise ValueError("the answer is not a JSON object")
        if self.key is not None and not _valid(
            self.key, answer, _ANSWER, self.server_nonce, self.client_nonce
        ):
            said = f" (it says: {answer.get('error')})" if answer.get("error") else ""
            raise ReplicationError(f"{self.endpoint} answered without a valid MAC{said}")
        return answer

    def close(self) -> None:
        self.rfile.close()


@contextlib.contextmanager
def _unwatched(_sock: socket.socket) -> Iterator[None]:
    yield


def send(
    endpoint: str,
    *,
    owner: str,
    shard: int,
    step: int,
    generation: int,
    data: Buffer | Sequence[Buffer],
    digest: str,
    secret: bytes | None = None,
    timeout: float = 30.0,
    tls: ssl.SSLContext | None = None,
    abandon: Abandon | None = None,
) -> None:
    """Give a copy to the peer at ``endpoint``; raise ``ReplicationError`` if it refuses.

    ``data``: the bytes, or their parts in order (e.g. a snapshot slot's views, sent as they
    are). ``digest`` is their digest (``digest(data)``, computed once by the owner), which the
    holder keeps the copy under (and checks as the bytes arrive when it verifies puts).
    ``abandon``: once it is set, the transfer ends midway (the holder keeps nothing) and
    ``Abandoned`` is raised.
    """
    parts = _parts(data)
    header = {
        "op": "put", "owner": owner, "shard": shard, "step": step, "generation": generation,
        "nbytes": sum(len(part) for part in parts), "digest": digest,
    }  # fmt: skip
    watching = abandon.watching if abandon is not None else _unwatched
    try:
        with _connect(endpoint, timeout, tls) as sock, watching(sock):
            session = _Session(sock, endpoint, secret)
            try:
                session.request(header, parts, abandon)
                answer = session.answer()
            finally:
                session.close()
    except Abandoned:
        raise
    except (OSError, ValueError) as exc:
        if abandon is not None and abandon.is_set():  # its connection was shut down
            raise Abandoned(f"sending shard {shard} to {endpoint} given up") from exc
        raise ReplicationError(f"sending shard {shard} to {endpoint}: {exc}") from exc
    if not answer.get("ok"):
        raise ReplicationError(f"{endpoint} refused shard {shard}: {answer.get('error')}")


def fetch(
    endpoint: str,
    *,
    owner: str | None,
    shard: int,
    step: int,
    expected: str | None = None,
    secret: bytes | None = None,
    timeout: float = 30.0,
    tls: ssl.SSLContext | None = None,
) -> bytearray:
    """Take back a verified copy from the peer at ``endpoint`` (``owner`` None: whoever's).

    The bytes must hash to the digest the holder's answer names and, when given, to
    ``expected`` (the digest the control plane recorded): ``DigestMismatch`` otherwise.
    """
    buffers: list[_Buffer] = []

    def into(size: int) -> Sink:
        buffers.append(_Buffer(bytearray(size)))
        return buffers[0]

    fetch_into(endpoint, into, owner=owner, shard=shard, step=step, expected=expected,
               secret=secret, timeout=timeout, tls=tls)  # fmt: skip
    return buffers[0].data


def fetch_into(
    endpoint: str,
    into: Callable[[int], Sink],
    *,
    owner: str | None,
    shard: int,
    step: int,
    expected: str | None = None,
    secret: bytes | None = None,
    timeout: float = 30.0,
    tls: ssl.SSLContext | None = None,
) -> int:
    """``fetch``, the bytes going where the sink that ``into(size)`` returns says (a decoder
    writing them straight into the tensors they make: no buffer of the whole copy). Returns
    the size. The sink has seen every byte before the digest is checked: on
    ``DigestMismatch`` (or any error) the caller drops what it built."""
    header: dict[str, Any] = {"op": "get", "owner": owner, "shard": shard, "step": step}
    if expected is not None:
        header["digest"] = expected
    try:
        with _connect(endpoint, timeout, tls) as sock:
            session = _Session(sock, endpoint, secret)
            try:
                session.request(header)
                answer = session.answer()
                if not answer.get("ok"):
                    error = answer.get("error")
                    raise (NotHeld if error == "not held" else ReplicationError)(
                        f"{endpoint} has no shard {shard} of step {step}: {error}"
                    )
                claimed = answer["digest"]
                algorithm = _algorithm(expected if expected is not None else claimed)
                size = int(answer["nbytes"])
                got = _receive_into(session.rfile, size, algorithm, into(size))
            finally:
                session.close()
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ReplicationError(f"fetching shard {shard} from {endpoint}: {exc}") from exc
    if got != claimed:
        raise DigestMismatch(
            f"shard {shard} of step {step} from {endpoint} hashes to {got}, not to the"
            f" {claimed} its holder announced"
        )
    if expected is not None and got != expected:
        raise DigestMismatch(
            f"shard {shard} of step {step} from {endpoint} hashes to {got}, not to the"
            f" {expected} the control plane recorded: refused"
        )
    return size


def serve(count: int, secret: bytes | None, *, bind: str = "127.0.0.1") -> None:
    """Run ``count`` peer stores in this process until stdin closes, having printed their
    endpoints (one JSON list) first: holders in a process of their own, as a benchmark's
    stand-in for the members of other nodes."""
    stores = [PeerStore(advertise=bind, secret=secret) for _ in range(count)]
    try:
        print(json.dumps([store.start() for store in stores]), flush=True)
        sys.stdin.read()
    finally:
        for store in stores:
            store.close()


if __name__ == "__main__":  # python -m rank_runtime.replication COUNT (secret from the env)
    _secret = os.environ.get("ELASTIC_JOB_SECRET", "")
    serve(int(sys.argv[1]) if len(sys.argv) > 1 else 1, bytes.fromhex(_secret) if _secret else None)
