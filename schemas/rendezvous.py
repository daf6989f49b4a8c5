"""The rendezvous store's wire protocol, shared by its server and its clients.

The server is the control plane's (``controlplane.rendezvous``); ranks reach it through
``rank_runtime.rendezvous.RendezvousStore``. The endpoint handed to ranks is
``tcp://<host>:<port>/<job>/<generation>`` (``tls://`` when the store speaks TLS;
``parse_endpoint``).

**The protocol.** Frames are a 4-byte big-endian length and a body.

1. The server says ``ELRZ1`` and a fresh 32-byte nonce ``Ns``.
2. The client answers with the job, the generation, its own nonce ``Nc`` and
   ``HMAC(K, "hello" | Ns | Nc | job | generation)``, where ``K`` is the job's secret
   (``schemas.auth.job_secret``; members have it as ``ELASTIC_JOB_SECRET``).
3. The server checks it, and answers ``HMAC(K, "welcome" | Nc | Ns)`` (so the client knows the
   server holds the secret too) or an error, and closes.
4. Every request and every answer after that carries a counter (strictly increasing by one)
   and ``HMAC(S, counter | body)`` with the session key ``S = HMAC(K, "session" | Ns | Nc)``:
   a recorded session cannot be replayed (the next connection has another ``Ns``), and no
   request can be dropped, reordered or repeated within one.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from collections.abc import Sequence
from typing import NamedTuple
from urllib.parse import urlsplit

#: What the server says first, before its nonce.
MAGIC = b"ELRZ1"
NONCE_BYTES = 32
MAC_BYTES = 32
#: Longest handshake frame (job, generation, nonce, MAC).
MAX_HELLO_BYTES = 1024
#: Longest frame after the handshake.
MAX_FRAME_BYTES = 8 << 20
#: How long a client has to complete the handshake.
HANDSHAKE_TIMEOUT_S = 10.0
#: Longest wait a client may ask for.
MAX_WAIT_S = 3600.0

# Operations (the first byte of a request's body after the counter).
SET, GET, ADD, CAS, WAIT, CHECK, DELETE, NUM_KEYS, MULTI_GET, MULTI_SET, APPEND = range(1, 12)
# Answer status.
OK, ERROR, TIMEOUT = 0, 1, 2

_COUNTER = struct.Struct(">Q")
_LENGTH = struct.Struct(">I")
_INT = struct.Struct(">q")


class RendezvousError(RuntimeError):
    """A rendezvous request the server refused, or a broken protocol."""


class Endpoint(NamedTuple):
    """Where a generation rendezvouses: the store's address and the generation's key space."""

    host: str
    port: int
    prefix: str
    #: The store speaks TLS (``tls://`` endpoints).
    tls: bool = False

    @property
    def job_id(self) -> str:
        return self.prefix.rpartition("/")[0]

    @property
    def generation(self) -> int:
        return int(self.prefix.rpartition("/")[2])


def parse_endpoint(endpoint: str) -> Endpoint:
    """Split ``tcp://host:port/<job>/<generation>`` (``tls://`` when the store speaks TLS);
    ValueError when it is not one."""
    parts = urlsplit(endpoint)
    if parts.scheme not in ("tcp", "tls") or not parts.hostname or parts.port is None:
        raise ValueError(f"not a rendezvous endpoint (tcp://host:port/job/gen): {endpoint!r}")
    prefix = parts.path.strip("/")
    return Endpoint(parts.hostname, parts.port, prefix, parts.scheme == "tls")


# --------------------------------------------------------------------------- the wire


def mac(key: bytes, *parts: bytes) -> bytes:
    """HMAC-SHA256 of the concatenation of ``parts``."""
    return hmac.digest(key, b"".join(parts), hashlib.sha256)


def hello_mac(key: bytes, server_nonce: bytes, client_nonce: bytes, job: str, gen: int) -> bytes:
    return mac(key, b"hello", server_nonce, client_nonce, job.encode(), _COUNTER.pack(gen))


def welcome_mac(key: bytes, server_nonce: bytes, client_nonce: bytes) -> bytes:
    return mac(key, b"welcome", client_nonce, server_nonce)


def session_key(key: bytes, server_nonce: bytes, client_nonce: bytes) -> bytes:
    return mac(key, b"session", server_nonce, client_nonce)


def pack_fields(fields: Sequence[bytes]) -> bytes:
    """Length-prefixed fields."""
    return b"".join(_LENGTH.pack(len(f)) + f for f in fields)


def unpack_fields(data: bytes) -> list[bytes]:
    """The fields of ``pack_fields``; RendezvousError when ``data`` is not that."""
    out = []
    i, n = 0, len(data)
    while i < n:
        if i + 4 > n:
            raise RendezvousError("truncated field")
        (size,) = _LENGTH.unpack_from(data, i)
        i += 4
        if i + size > n:
            raise RendezvousError("truncated field")
        out.append(data[i : i + size])
        i += size
    return out


def seal(key: bytes, counter: int, body: bytes) -> bytes:
    """A frame's payload: counter, body, MAC over both."""
    head = _COUNTER.pack(counter)
    return head + body + mac(key, head, body)


def open_sealed(key: bytes, counter: int, payload: bytes) -> bytes:
    """The body of a sealed payload numbered ``counter``; RendezvousError when its MAC or its
    counter is not the expected one."""
    if len(payload) < 8 + MAC_BYTES:
        raise RendezvousError("short frame")
    head, body, tag = payload[:8], payload[8:-MAC_BYTES], payload[-MAC_BYTES:]
    if not hmac.compare_digest(tag, mac(key, head, body)):
        raise RendezvousError("bad MAC (not this job's secret, or a tampered request)")
    if _COUNTER.unpack(head)[0] != counter:
        raise RendezvousError("out-of-order or replayed request")
    return body


def frame(payload: bytes) -> bytes:
    return _LENGTH.pack(len(payload)) + payload


def frame_length(head: bytes) -> int:
    """The size of the payload a frame's 4-byte head announces."""
    (size,) = _LENGTH.unpack(head)
    return int(size)


def encode_int(value: int) -> bytes:
    return _INT.pack(value)


def decode_int(data: bytes) -> int:
    if len(data) != 8:
        raise RendezvousError("bad integer")
    return int(_INT.unpack(data)[0])
