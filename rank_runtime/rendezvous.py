"""The rank's side of the control plane's rendezvous store: a ``torch.distributed.Store``.

``RendezvousStore.connect(endpoint, secret)`` opens one authenticated connection to the store
named by a generation's endpoint (``tcp://host:port/<job>/<generation>``) and binds it to that
generation's key space; ``init_process_group("gloo", store=...)`` then uses it as it would a
TCPStore (gloo calls ``set``, ``wait`` and ``get``; ``add``, ``compare_set``, ``check``,
``delete_key``, ``num_keys``, ``multi_get``/``multi_set`` and ``append`` work too). The
protocol is ``schemas.rendezvous``; the server is the control plane's. The secret is the job's
(``ELASTIC_JOB_SECRET``, from the launcher); without one the store runs unauthenticated and
says so once.
"""

from __future__ import annotations

import logging
import os
import socket
import ssl
import threading
import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from schemas.rendezvous import (
    ADD,
    APPEND,
    CAS,
    CHECK,
    DELETE,
    ERROR,
    GET,
    MAGIC,
    MAX_FRAME_BYTES,
    MULTI_GET,
    MULTI_SET,
    NONCE_BYTES,
    NUM_KEYS,
    OK,
    SET,
    TIMEOUT,
    WAIT,
    Endpoint,
    RendezvousError,
    decode_int,
    encode_int,
    frame,
    hello_mac,
    open_sealed,
    pack_fields,
    parse_endpoint,
    seal,
    session_key,
    unpack_fields,
    welcome_mac,
)

log = logging.getLogger(__name__)

__all__ = ["RendezvousAuthError", "RendezvousError", "RendezvousStore"]


class RendezvousAuthError(RendezvousError):
    """The server refused this client's handshake (or did not prove it holds the secret)."""


#: A CA bundle (PEM) to verify a ``tls://`` rendezvous store with (else the system's).
TLS_CA_ENV = "ELASTIC_TLS_CA"


def client_tls(env: dict[str, str] | None = None) -> ssl.SSLContext:
    """The TLS context a ``tls://`` store is reached with: verified against
    ``ELASTIC_TLS_CA`` when set, else the system's trusted CAs."""
    cafile = (os.environ if env is None else env).get(TLS_CA_ENV) or None
    context = ssl.create_default_context(cafile=cafile)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    return context


def _recv_exactly(sock: socket.socket, size: int) -> bytes:
    buf = bytearray(size)
    view = memoryview(buf)
    got = 0
    while got < size:
        n = sock.recv_into(view[got:], size - got)
        if n == 0:
            raise ConnectionError("the rendezvous store closed the connection")
        got += n
    return bytes(buf)


class RendezvousStore(dist.Store):  # type: ignore[name-defined,misc]  # torch has no stubs for it
    """One authenticated connection to one generation's key space.

    Calls are serialised (one request in flight); a wait blocks the calling thread only.
    """

    def __init__(
        self,
        endpoint: Endpoint,
        secret: bytes | None,
        *,
        timeout: timedelta = timedelta(seconds=60),
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        super().__init__()
        self.endpoint = endpoint
        self._secret = secret
        self._key = secret or b""
        self._timeout = timeout
        self._ssl = ssl_context if ssl_context is not None or not endpoint.tls else client_tls()
        self._lock = threading.Lock()
        self._counter = 0
        self._sock = self._connected()

    @classmethod
    def connect(
        cls,
        endpoint: str,
        secret: bytes | None,
        *,
        timeout: timedelta = timedelta(seconds=60),
        ssl_context: ssl.SSLContext | None = None,
    ) -> RendezvousStore:
        """Connect to the generation ``endpoint`` names (retrying until ``timeout`` while the
        server is not up yet)."""
        return cls(parse_endpoint(endpoint), secret, timeout=timeout, ssl_context=ssl_context)

    # ------------------------------------------------------------------ the connection

    def _connected(self) -> socket.socket:
        """A connection, open and authenticated; tried again while the server is not up yet,
        or goes away mid-handshake (a control plane that stops as its standby takes the port
        over), until the timeout."""
        deadline = time.monotonic() + self._timeout.total_seconds()
        delay = 0.01
        while True:
            try:
                return self._handshake(self._open_socket(deadline))
            except ssl.SSLError:
                raise  # a TLS misconfiguration: no retry mends it
            except OSError as exc:  # refused, reset, or closed before its greeting
                if time.monotonic() + delay > deadline:
                    raise dist.DistStoreError(
                        f"rendezvous store {self.endpoint.host}:{self.endpoint.port} not"
                        f" reachable within {self._timeout.total_seconds():g}s: {exc}"
                    ) from exc
                time.sleep(delay)
                delay = min(delay * 2, 0.5)

    def _open_socket(self, deadline: float) -> socket.socket:
        sock = socket.create_connection(
            (self.endpoint.host, self.endpoint.port),
            timeout=max(0.1, min(10.0, deadline - time.monotonic())),
        )
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self._ssl is not None:
                return self._ssl.wrap_socket(sock, server_hostname=self.endpoint.host)
        except BaseException:
            sock.close()  # tried again: no socket left behind per try
            raise
        return sock

    def _read_frame(self, sock: socket.socket, limit: int = MAX_FRAME_BYTES) -> bytes:
        size = int.from_bytes(_recv_exactly(sock, 4), "big")
        if size > limit:
            raise RendezvousError(f"frame of {size} bytes from the rendezvous store")
        return _recv_exactly(sock, size)

    def _handshake(self, sock: socket.socket) -> socket.socket:
        endpoint = self.endpoint
        try:
            job, generation = endpoint.job_id, endpoint.generation
        except ValueError:
            sock.close()
            raise RendezvousError(f"no job/generation in {endpoint.prefix!r}") from None
        try:
            hello = self._read_frame(sock, 1024)
            if not hello.startswith(MAGIC) or len(hello) != len(MAGIC) + NONCE_BYTES:
                raise RendezvousError("not a rendezvous store (bad greeting)")
            server_nonce = hello[len(MAGIC) :]
            client_nonce = os.urandom(NONCE_BYTES)
            tag = hello_mac(self._key, server_nonce, client_nonce, job, generation)
            fields = [job.encode(), encode_int(generation), client_nonce, tag]
            sock.sendall(frame(pack_fields(fields)))
            answer = self._read_frame(sock, 1024)
            if not answer or answer[0] != OK:
                reason = answer[1:].decode("utf-8", "replace") if answer else "no answer"
                raise RendezvousAuthError(f"rendezvous store refused {job}/{generation}: {reason}")
            if answer[1:] != welcome_mac(self._key, server_nonce, client_nonce):
                raise RendezvousAuthError("the rendezvous store did not prove the job's secret")
        except TimeoutError:
            sock.close()
            raise RendezvousError(
                f"no answer from the rendezvous store at {endpoint.host}:{endpoint.port}"
                " (a tls:// store reached as tcp://?)"
            ) from None
        except BaseException:
            sock.close()
            raise
        self._session = session_key(self._key, server_nonce, client_nonce)
        sock.settimeout(None)
        return sock

    def _call(self, op: int, fields: Sequence[bytes], wait_s: float = 0.0) -> list[bytes]:
        body = bytes([op]) + pack_fields(fields)
        with self._lock:
            sock = self._sock
            self._counter += 1
            # A wait is bounded by the server; the socket's own timeout only catches a dead one.
            sock.settimeout(wait_s + self._timeout.total_seconds() + 5.0)
            try:
                sock.sendall(frame(seal(self._session, self._counter, body)))
                payload = self._read_frame(sock)
            except TimeoutError as exc:
                raise dist.DistStoreError("the rendezvous store did not answer") from exc
            self._counter += 1
            answer = open_sealed(self._session, self._counter, payload)
        if not answer:
            raise RendezvousError("empty answer")
        status, out = answer[0], unpack_fields(answer[1:])
        if status == OK:
            return out
        message = out[0].decode("utf-8", "replace") if out else "refused"
        if status == TIMEOUT:
            raise dist.DistStoreError(f"rendezvous {self.endpoint.prefix}: {message}")
        if status == ERROR:
            raise RendezvousError(f"rendezvous {self.endpoint.prefix}: {message}")
        raise RendezvousError(f"unknown answer status {status}")

    def _wait_ms(self, timeout: timedelta | None) -> tuple[bytes, float]:
        seconds = (timeout if timeout is not None else self._timeout).total_seconds()
        return encode_int(int(seconds * 1000)), seconds

    def close(self) -> None:
        """Close the connection (the store's keys stay on the server)."""
        self._sock.close()

    # ------------------------------------------------------------------ the Store API

    def set(self, key: str, value: Any) -> None:
        self._call(SET, [key.encode(), _bytes(value)])

    def get(self, key: str) -> bytes:
        ms, seconds = self._wait_ms(None)
        return self._call(GET, [key.encode(), ms], seconds)[0]

    def add(self, key: str, value: int) -> int:
        return decode_int(self._call(ADD, [key.encode(), encode_int(value)])[0])

    def compare_set(self, key: str, expected_value: Any, desired_value: Any) -> bytes:
        fields = [key.encode(), _bytes(expected_value), _bytes(desired_value)]
        return self._call(CAS, fields)[0]

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        ms, seconds = self._wait_ms(timeout)
        self._call(WAIT, [ms, *(k.encode() for k in keys)], seconds)

    def check(self, keys: list[str]) -> bool:
        return self._call(CHECK, [k.encode() for k in keys])[0] == b"1"

    def delete_key(self, key: str) -> bool:
        return self._call(DELETE, [key.encode()])[0] == b"1"

    def num_keys(self) -> int:
        return decode_int(self._call(NUM_KEYS, [])[0])

    def multi_get(self, keys: list[str]) -> list[bytes]:
        ms, seconds = self._wait_ms(None)
        return self._call(MULTI_GET, [ms, *(k.encode() for k in keys)], seconds)

    def multi_set(self, keys: list[str], values: list[Any]) -> None:
        fields: list[bytes] = []
        for key, value in zip(keys, values, strict=True):
            fields += [key.encode(), _bytes(value)]
        self._call(MULTI_SET, fields)

    def append(self, key: str, value: Any) -> None:
        self._call(APPEND, [key.encode(), _bytes(value)])

    def set_timeout(self, timeout: timedelta) -> None:
        self._timeout = timeout

    def clone(self) -> RendezvousStore:
        """A second connection to the same key space."""
        return RendezvousStore(self.endpoint, self._secret, timeout=self._timeout,
                               ssl_context=self._ssl)  # fmt: skip


def _bytes(value: Any) -> bytes:
    if isinstance(value, str):
        return value.encode()
    return bytes(value)
