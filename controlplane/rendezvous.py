"""The rendezvous store every generation's ranks meet in, hosted by the control plane.

A rank that dies must not take the rendezvous with it, so the store lives here, not on rank 0.
It is the project's own key-value server (torch's TCPStore has no authentication and lists its
keys to anyone who connects), run on an asyncio loop in a thread of its own, so neither its
connections nor their waits touch the control plane's event loop. Ranks reach it through
``rank_runtime.rendezvous.RendezvousStore``, a ``torch.distributed.Store`` that gloo's
``init_process_group`` uses like any other store.

The endpoint handed to ranks is ``tcp://<host>:<port>/<job>/<generation>`` (``parse_endpoint``).
A connection is bound to one job's generation at its handshake, and every key it reads or
writes lives in that generation's key space, which the server keeps (a client cannot name a
key outside it: there is no prefix to choose, and no ``list_keys``).

**The protocol** (frames, the handshake, sealed requests, the limits) is
``schemas.rendezvous``, shared with the ranks' client.

Without an installation secret (``ELASTIC_SECRET`` unset) the key is empty: the same protocol,
no protection (a warning is logged once). Keys and bytes are bounded per job
(``RendezvousLimits``); a request past a bound is refused with an error naming the bound.
Only the newest two generations of a job are kept; older ones are dropped as a newer one
connects, and the least recently used job without a connection is dropped past ``max_jobs``.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import os
import re
import ssl
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from schemas.auth import job_secret
from schemas.rendezvous import (
    ADD,
    APPEND,
    CAS,
    CHECK,
    DELETE,
    ERROR,
    GET,
    HANDSHAKE_TIMEOUT_S,
    MAGIC,
    MAX_FRAME_BYTES,
    MAX_HELLO_BYTES,
    MAX_WAIT_S,
    MULTI_GET,
    MULTI_SET,
    NONCE_BYTES,
    NUM_KEYS,
    OK,
    SET,
    TIMEOUT,
    WAIT,
    RendezvousError,
    decode_int,
    encode_int,
    frame,
    frame_length,
    hello_mac,
    open_sealed,
    pack_fields,
    seal,
    session_key,
    unpack_fields,
    welcome_mac,
)

log = logging.getLogger(__name__)

_JOB = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$")


def server_tls(cert: str | None, key: str | None) -> ssl.SSLContext | None:
    """The TLS context the store serves with (None without a certificate)."""
    if not cert:
        return None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(cert, key or None)
    return context


# --------------------------------------------------------------------------- the server


@dataclass(frozen=True, slots=True)
class RendezvousLimits:
    """What one job may hold (its kept generations together), and the server in all."""

    max_keys: int = 100_000
    max_bytes: int = 64 << 20
    max_key_bytes: int = 4096
    max_value_bytes: int = 4 << 20
    max_jobs: int = 4096
    max_connections: int = 65_536


@dataclass(slots=True)
class _Space:
    """One generation's keys."""

    job: _Job
    generation: int
    keys: dict[str, bytes] = field(default_factory=dict)
    waiters: dict[str, list[asyncio.Future[None]]] = field(default_factory=dict)
    dropped: bool = False


@dataclass(slots=True)
class _Job:
    job_id: str
    spaces: dict[int, _Space] = field(default_factory=dict)
    keys: int = 0
    bytes: int = 0
    connections: int = 0


class _Refused(Exception):
    """A request refused with a message for the client."""


@dataclass(slots=True)
class RendezvousStats:
    """What the server did since start."""

    connections: int = 0
    authenticated: int = 0
    refused_handshakes: int = 0
    refused_requests: int = 0
    requests: int = 0


class RendezvousServer:
    """The store's server: an asyncio loop in a daemon thread. ``start`` binds and returns."""

    def __init__(
        self,
        listen: str = "127.0.0.1",
        port: int = 0,
        *,
        master: bytes | None = None,
        limits: RendezvousLimits | None = None,
        admit: Callable[[str, int], bool] | None = None,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        self._listen = listen
        self._port = port
        self._master = master
        self.limits = limits or RendezvousLimits()
        self._admit = admit
        self._ssl = ssl_context
        self._jobs: OrderedDict[str, _Job] = OrderedDict()
        self._job_keys: dict[str, bytes] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.Server | None = None
        self._thread: threading.Thread | None = None
        self._open = 0
        self._writers: set[asyncio.StreamWriter] = set()
        self.stats = RendezvousStats()
        self.port = 0

    @property
    def secured(self) -> bool:
        return self._master is not None

    def start(self) -> int:
        """Bind and serve from a thread of its own; return the port (idempotent)."""
        if self._thread is not None:
            return self.port
        if self._master is None:
            log.warning(
                "rendezvous store without authentication: ELASTIC_SECRET is unset, so anyone"
                " who reaches %s:%d can read and write a generation's keys",
                self._listen,
                self._port,
            )
        ready = threading.Event()
        failure: list[BaseException] = []

        def run() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            try:
                self._server = loop.run_until_complete(
                    asyncio.start_server(
                        self._connection, self._listen, self._port, ssl=self._ssl, backlog=4096
                    )
                )
                self.port = self._server.sockets[0].getsockname()[1]
            except BaseException as exc:
                failure.append(exc)
                ready.set()
                loop.close()
                return
            ready.set()
            try:
                loop.run_forever()
            finally:
                self._server.close()
                # Aborted connections end their handlers (a read fails); what is left after a
                # moment is cancelled.
                for writer in list(self._writers):
                    writer.transport.abort()
                tasks = asyncio.all_tasks(loop)
                if tasks:
                    loop.run_until_complete(asyncio.wait(tasks, timeout=1.0))
                for task in tasks:
                    task.cancel()
                with contextlib.suppress(Exception):
                    loop.run_until_complete(self._server.wait_closed())
                loop.close()

        self._thread = threading.Thread(target=run, name="elastic-rendezvous", daemon=True)
        self._thread.start()
        ready.wait()
        if failure:
            self._thread = None
            raise failure[0]
        log.info("rendezvous store listening on %s:%d", self._listen, self.port)
        return self.port

    def close(self) -> None:
        """Stop serving (and drop every key)."""
        loop, thread = self._loop, self._thread
        if loop is None or thread is None:
            return
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
        self._thread = None
        self._loop = None
        self._jobs.clear()

    # ------------------------------------------------------------------ bookkeeping

    def _key_of(self, job_id: str) -> bytes:
        if self._master is None:
            return b""
        key = self._job_keys.get(job_id)
        if key is None:
            if len(self._job_keys) > 4 * self.limits.max_jobs:
                self._job_keys.clear()
            key = self._job_keys[job_id] = job_secret(self._master, job_id)
        return key

    def _space(self, job_id: str, generation: int) -> _Space:
        """The key space of ``job_id``'s ``generation`` (made and counted), dropping the
        job's generations older than the newest two."""
        job = self._jobs.get(job_id)
        if job is None:
            if len(self._jobs) >= self.limits.max_jobs:
                idle = next((j for j in self._jobs.values() if j.connections == 0), None)
                if idle is None:
                    raise _Refused(f"too many jobs (max_jobs={self.limits.max_jobs})")
                self._drop_job(idle)
            job = self._jobs[job_id] = _Job(job_id)
        self._jobs.move_to_end(job_id)
        space = job.spaces.get(generation)
        if space is None:
            newest = max(job.spaces, default=-1)
            if generation < newest - 1:
                raise _Refused(f"generation {generation} of {job_id} is superseded by {newest}")
            space = job.spaces[generation] = _Space(job, generation)
            for old in [g for g in job.spaces if g < max(newest, generation) - 1]:
                self._drop_space(job.spaces.pop(old))
        return space

    def _drop_space(self, space: _Space) -> None:
        space.dropped = True
        job = space.job
        job.keys -= len(space.keys)
        job.bytes -= sum(len(k) + len(v) for k, v in space.keys.items())
        space.keys = {}
        for waiters in space.waiters.values():
            for waiter in waiters:
                if not waiter.done():
                    waiter.set_result(None)
        space.waiters = {}

    def _drop_job(self, job: _Job) -> None:
        for space in job.spaces.values():
            self._drop_space(space)
        self._jobs.pop(job.job_id, None)

    def keys_of(self, job_id: str) -> int:
        """Keys ``job_id`` holds now (for tests and metrics)."""
        job = self._jobs.get(job_id)
        return 0 if job is None else job.keys

    # ------------------------------------------------------------------ a connection

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.stats.connections += 1
        if self._open >= self.limits.max_connections:
            writer.close()
            return
        self._open += 1
        self._writers.add(writer)
        space: _Space | None = None
        try:
            try:
                bound, key = await asyncio.wait_for(
                    self._handshake(reader, writer), HANDSHAKE_TIMEOUT_S
                )
            except (TimeoutError, RendezvousError, _Refused, asyncio.IncompleteReadError) as exc:
                self.stats.refused_handshakes += 1
                reason = str(exc) or type(exc).__name__
                log.warning("rendezvous: refused a connection from %s: %s",
                            writer.get_extra_info("peername"), reason)  # fmt: skip
                with contextlib.suppress(Exception):
                    writer.write(frame(bytes([ERROR]) + reason.encode()[:512]))
                    await writer.drain()
                return
            space = bound
            space.job.connections += 1
            await self._serve(space, key, reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        except RendezvousError as exc:
            self.stats.refused_requests += 1
            log.warning("rendezvous: closed a connection of job %s: %s",
                        space and space.job.job_id, exc)  # fmt: skip
        finally:
            self._open -= 1
            self._writers.discard(writer)
            if space is not None:
                space.job.connections -= 1
            with contextlib.suppress(Exception):
                writer.close()

    async def _read(self, reader: asyncio.StreamReader, limit: int) -> bytes:
        size = frame_length(await reader.readexactly(4))
        if size > limit:
            raise RendezvousError(f"frame of {size} bytes (at most {limit})")
        return await reader.readexactly(size)

    async def _handshake(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> tuple[_Space, bytes]:
        server_nonce = os.urandom(NONCE_BYTES)
        writer.write(frame(MAGIC + server_nonce))
        await writer.drain()
        fields = unpack_fields(await self._read(reader, MAX_HELLO_BYTES))
        if len(fields) != 4:
            raise RendezvousError("malformed hello")
        job_raw, gen_raw, client_nonce, tag = fields
        job_id = job_raw.decode("utf-8", "replace")
        if not _JOB.match(job_id) or len(client_nonce) != NONCE_BYTES:
            raise RendezvousError("malformed hello")
        generation = decode_int(gen_raw)
        if generation < 0:
            raise RendezvousError("malformed hello")
        key = self._key_of(job_id)
        if not hmac.compare_digest(
            tag, hello_mac(key, server_nonce, client_nonce, job_id, generation)
        ):
            raise _Refused(f"authentication failed for job {job_id} (not its secret)")
        if self._admit is not None and not self._admit(job_id, generation):
            raise _Refused(
                f"generation {generation} of {job_id} was not started by the control plane"
            )
        space = self._space(job_id, generation)
        writer.write(frame(bytes([OK]) + welcome_mac(key, server_nonce, client_nonce)))
        await writer.drain()
        self.stats.authenticated += 1
        return space, session_key(key, server_nonce, client_nonce)

    async def _serve(
        self,
        space: _Space,
        key: bytes,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
    ) -> None:
        counter = 0
        while True:
            payload = await self._read(reader, MAX_FRAME_BYTES)
            counter += 1
            body = open_sealed(key, counter, payload)
            if not body:
                raise RendezvousError("empty request")
            self.stats.requests += 1
            try:
                if space.dropped:
                    raise _Refused(f"generation {space.generation} was superseded and dropped")
                status, fields = OK, await self._apply(space, body[0], unpack_fields(body[1:]))
            except _Refused as exc:
                self.stats.refused_requests += 1
                status, fields = ERROR, [str(exc).encode()]
            except TimeoutError:
                status, fields = TIMEOUT, [b"wait timeout"]
            counter += 1
            writer.write(frame(seal(key, counter, bytes([status]) + pack_fields(fields))))
            await writer.drain()

    # ------------------------------------------------------------------ the operations

    def _put(self, space: _Space, name: bytes, value: bytes) -> None:
        limits = self.limits
        if len(name) > limits.max_key_bytes:
            raise _Refused(f"key of {len(name)} bytes (max_key_bytes={limits.max_key_bytes})")
        if len(value) > limits.max_value_bytes:
            raise _Refused(
                f"value of {len(value)} bytes (max_value_bytes={limits.max_value_bytes})"
            )
        key = name.decode("utf-8", "surrogateescape")
        job = space.job
        old = space.keys.get(key)
        grow = len(value) - (len(old) if old is not None else -len(name))
        if old is None and job.keys + 1 > limits.max_keys:
            raise _Refused(f"job {job.job_id} holds {job.keys} keys (max_keys={limits.max_keys})")
        if job.bytes + grow > limits.max_bytes:
            raise _Refused(
                f"job {job.job_id} holds {job.bytes} bytes (max_bytes={limits.max_bytes})"
            )
        space.keys[key] = value
        job.bytes += grow
        if old is None:
            job.keys += 1
        for waiter in space.waiters.pop(key, ()):
            if not waiter.done():
                waiter.set_result(None)

    async def _wait(self, space: _Space, names: Sequence[str], timeout_s: float) -> None:
        deadline = time.monotonic() + min(max(timeout_s, 0.0), MAX_WAIT_S)
        loop = asyncio.get_running_loop()
        for name in names:
            while name not in space.keys:
                if space.dropped:
                    raise _Refused(f"generation {space.generation} was superseded and dropped")
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError
                waiter: asyncio.Future[None] = loop.create_future()
                space.waiters.setdefault(name, []).append(waiter)
                try:
                    await asyncio.wait_for(waiter, remaining)
                except TimeoutError:
                    waiters = space.waiters.get(name)
                    if waiters is not None and waiter in waiters:
                        waiters.remove(waiter)
                        if not waiters:
                            del space.waiters[name]
                    raise

    async def _apply(self, space: _Space, op: int, args: list[bytes]) -> list[bytes]:
        keys = space.keys

        def name(raw: bytes) -> str:
            return raw.decode("utf-8", "surrogateescape")

        def need(count: int) -> None:
            if len(args) != count:
                raise _Refused(f"operation {op}: {len(args)} arguments, {count} expected")

        if op == SET:
            need(2)
            self._put(space, args[0], args[1])
            return []
        if op == GET:
            need(2)
            await self._wait(space, [name(args[0])], decode_int(args[1]) / 1000)
            return [keys[name(args[0])]]
        if op == ADD:
            need(2)
            current = keys.get(name(args[0]), b"0")
            try:
                total = int(current) + decode_int(args[1])
            except ValueError:
                raise _Refused(f"add to a key that holds no integer: {args[0]!r}") from None
            self._put(space, args[0], str(total).encode())
            return [encode_int(total)]
        if op == CAS:
            need(3)
            current_value = keys.get(name(args[0]))
            if current_value is None:
                if args[1]:
                    return [args[1]]
                self._put(space, args[0], args[2])
                return [args[2]]
            if current_value == args[1]:
                self._put(space, args[0], args[2])
                return [args[2]]
            return [current_value]
        if op == WAIT:
            if not args:
                raise _Refused("wait without a timeout")
            await self._wait(space, [name(a) for a in args[1:]], decode_int(args[0]) / 1000)
            return []
        if op == CHECK:
            return [b"1" if all(name(a) in keys for a in args) else b"0"]
        if op == DELETE:
            need(1)
            value = keys.pop(name(args[0]), None)
            if value is None:
                return [b"0"]
            space.job.keys -= 1
            space.job.bytes -= len(args[0]) + len(value)
            return [b"1"]
        if op == NUM_KEYS:
            return [encode_int(len(keys))]
        if op == MULTI_GET:
            if not args:
                raise _Refused("multi_get without a timeout")
            names = [name(a) for a in args[1:]]
            await self._wait(space, names, decode_int(args[0]) / 1000)
            return [keys[n] for n in names]
        if op == MULTI_SET:
            if len(args) % 2:
                raise _Refused("multi_set of an odd number of fields")
            for i in range(0, len(args), 2):
                self._put(space, args[i], args[i + 1])
            return []
        if op == APPEND:
            need(2)
            self._put(space, args[0], keys.get(name(args[0]), b"") + args[1])
            return []
        raise _Refused(f"unknown operation {op}")


class RendezvousHost:
    """The control plane's rendezvous store. The constructor does no I/O; ``start`` binds."""

    def __init__(
        self,
        advertise: str,
        port: int = 0,
        *,
        listen: str = "127.0.0.1",
        master: bytes | None = None,
        limits: RendezvousLimits | None = None,
        admit: Callable[[str, int], bool] | None = None,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        self._advertise = advertise
        self.server = RendezvousServer(
            listen, port, master=master, limits=limits, admit=admit, ssl_context=ssl_context
        )
        self._started = False

        self._scheme = "tls" if ssl_context is not None else "tcp"

    def start(self) -> str:
        """Start the server (idempotent) and return the base endpoint ``tcp://host:port``
        (``tls://`` with TLS)."""
        self.server.start()
        self._started = True
        return f"{self._scheme}://{self._advertise}:{self.server.port}"

    @property
    def base(self) -> str | None:
        """The base endpoint once started."""
        return f"{self._scheme}://{self._advertise}:{self.server.port}" if self._started else None

    def close(self) -> None:
        """Stop serving."""
        self.server.close()
        self._started = False
