"""``elasticctl bench api``: the REST API's latency on a big log, under concurrent clients.

The log is one of two:

- ``events`` events of one job of ``workers`` ranks and a few warm spares that train
  (heartbeats, steps, hot backups replicated to the holders the placement names) and, every
  ``crash_every`` steps, lose a rank: the real decider (``controlplane.core.decide``)
  detects the exit, reallocates the rank to a spare and resolves the incident when the new
  generation steps; the lost rank comes back as a spare (``RecordedJob``). It is appended
  through the store (COPY, large batches), then vacuumed and analysed as after any bulk
  load; ``elasticctl api`` folds it (``catch_up_s``);
- with ``ranks``, the history of ``days`` of a job of that many ranks, as ``bench takeover``
  writes its history (``controlplane.bench.history``: as many rows as that job writes, its
  incidents decided by the real decider), with the view snapshot and steps chunks a leader
  would have recorded; ``elasticctl api`` starts from that snapshot (``cold_start_s``: the
  process's start to its first answer for the job; ``api_started_from``: the snapshot's
  position, as it logs it), and the report adds the log's rows and bytes.

Then ``clients`` concurrent clients (asyncio, one keep-alive connection each, each sending
its next request when the last one answered; raw HTTP/1.1, or httpx with ``client="httpx"``)
call one route for ``seconds`` after a second of warm-up: the incident timeline (a random
incident), then a page of events (a random cursor; every fourth request filtered by type,
every eighth by member). One answer of each route is validated with the schemas first. Per
route: requests per second, p50, p99 and the largest latency, the API's CPU time per request
(its process's user and system time over the requests it answered) and the mean body.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
from pydantic import BaseModel

from controlplane.bench import BenchError
from controlplane.bench.history import (
    INCIDENTS_PER_DAY,
    history_rows_per_day,
    log_size,
    settle,
    write_history,
)
from controlplane.bench.stack import stack
from controlplane.core.decide import Context, decide, envelope
from controlplane.core.fold import fold
from controlplane.core.records import StoredEvent
from controlplane.core.view import JobView, MemberStatus
from controlplane.devstack import free_port
from controlplane.settings import DATABASE_URL_ENV
from controlplane.store.port import AppendResult
from controlplane.store.postgres import PostgresEventStore
from schemas.api import EventPage, IncidentTimeline
from schemas.events import EVENT_CLASSES, EnvelopeBase, JobPolicy
from schemas.ids import uuid7

#: Events appended per transaction while filling the log.
FILL_BATCH = 50_000
_START = datetime(2026, 1, 1, tzinfo=UTC)


def _progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


@dataclass(slots=True)
class _Source:
    node: str
    rack: str
    incarnation: str
    seq: int = 0


@dataclass(slots=True)
class RecordedJob:
    """A job's log made in memory: member events at simulated times, decided as the service
    decides (after each batch of member events, at the batch's time)."""

    job_id: str
    workers: int = 64
    spares: int = 4
    racks: int = 4
    nodes_per_rack: int = 4
    backup_interval: int = 10
    crash_every: int = 400
    view: JobView | None = None
    now: datetime = _START
    #: What was recorded and not yet handed out by ``take``.
    out: list[EnvelopeBase] = field(default_factory=list)
    sources: dict[str, _Source] = field(default_factory=dict)
    #: node -> its launcher (``<node>/launcher``: announces members, reports exits).
    launchers: dict[str, _Source] = field(default_factory=dict)
    position: int = 0
    recorded: int = 0
    #: Recorded and not yet folded: (recorded time, event).
    unfolded: list[tuple[datetime, EnvelopeBase]] = field(default_factory=list)
    rng: random.Random = field(default_factory=lambda: random.Random(0))
    _cp_seq: Iterator[int] = field(default_factory=lambda: itertools.count(1))
    _rejoined: int = 0

    # ------------------------------------------------------------------ recording

    @property
    def v(self) -> JobView:
        """The view of everything recorded (folded on demand, a batch at a time)."""
        return self._fold()

    def _fold(self) -> JobView:
        if self.unfolded:
            stored = [
                StoredEvent(self.position + i, at, e) for i, (at, e) in enumerate(self.unfolded, 1)
            ]
            self.position += len(stored)
            self.view = fold(self.view, stored)
            self.unfolded = []
        assert self.view is not None
        return self.view

    def _event_id(self) -> str:
        # Time-ordered, as members' ids are (``schemas.ids``); the time is the event's.
        return uuid7(int(self.now.timestamp() * 1000), self.rng.getrandbits(74))

    def _event(
        self, member: str, type_: str, payload: dict[str, Any], *, launcher: bool = False
    ) -> EnvelopeBase:
        """An event of ``member`` (``launcher``: of the launcher of its node)."""
        source = self.sources[member]
        if launcher:
            node = source.node
            source = self.launchers.setdefault(node, _Source(node, source.rack, f"l-{node}"))
            member = "launcher"
        source.seq += 1
        return EVENT_CLASSES[type_].model_validate(
            {
                "event_id": self._event_id(),
                "job_id": self.job_id,
                "type": type_,
                "v": 1,
                "source": f"{source.node}/{member}",
                "incarnation": source.incarnation,
                "seq": source.seq,
                # Only decisions change it, and they are folded at once (``_decide``).
                "generation": self.view.generation if self.view is not None else 0,
                "emitted_at": self.now,
                "payload": payload,
            },
            strict=False,
        )

    def _add(self, events: list[EnvelopeBase]) -> None:
        self.unfolded.extend((self.now, e) for e in events)
        self.out.extend(events)
        self.recorded += len(events)

    def _decide(self) -> int:
        """Fold, decide, fold the decisions. Between two calls the roster (world, members)
        does not change, so member events are made from the view of the last call."""
        decided = decide(self.v, self.now, Context(rendezvous="tcp://controlplane:29400"))
        if decided:
            self._add([envelope(self.job_id, d, self.now, next(self._cp_seq)) for d in decided])
            self._fold()
        return len(decided)

    @property
    def _roster(self) -> JobView:
        """The view as of the last decision (see ``_decide``), not folded again."""
        assert self.view is not None
        return self.view

    def _join(self, member: str, node: str, rack: str, role: str, policy: JobPolicy | None) -> None:
        self.sources[member] = _Source(node, rack, uuid.uuid4().hex[:12])
        payload: dict[str, Any] = {
            "node": node, "rack": rack, "host": f"h-{node}", "pid": 1000 + len(self.sources),
            "role": role, "device": "cpu", "backup_endpoint": f"{node}:7000",
        }  # fmt: skip
        if policy is not None:
            payload["policy"] = policy.model_dump(mode="json")
        launched = {"member": member, "role": role, "pid": payload["pid"]}
        self._add([self._event(member, "member.launched", launched, launcher=True),
                   self._event(member, "member.joined", payload)])  # fmt: skip

    def _active(self) -> list[str]:
        return [m for m, s in self._roster.members.items() if s.status is MemberStatus.ACTIVE]

    def start(self) -> None:
        """Join the workers (spread over racks and nodes) and the spares; start the job."""
        policy = JobPolicy(
            min_world=max(1, self.workers // 2),
            max_world=self.workers,
            world_size=self.workers,
            backup_interval=self.backup_interval,
            redundancy=2,
        )
        nodes = [(f"n{r}-{k}", f"rack{r}") for r in range(self.racks)
                 for k in range(self.nodes_per_rack)]  # fmt: skip
        for i in range(self.workers):
            node, rack = nodes[i % len(nodes)]
            self._join(f"w{i}", node, rack, "worker", policy if i == 0 else None)
        for s in range(self.spares):
            self._join(f"spare{s}", f"sp{s}", f"rack{s % self.racks}", "spare", None)
        self._decide()

    def _step(self, step: int, loss: float) -> None:
        world = set(self._roster.world)
        beats = [
            self._event(m, "member.heartbeat",
                        {"step": step, "phase": "train" if m in world else "waiting"})
            for m in self._active()
        ]  # fmt: skip
        steps = [
            self._event(m, "train.step",
                        {"step": step, "loss": loss, "step_seconds": 0.5, "samples": 32})
            for m in self._roster.world
        ]  # fmt: skip
        self._add(beats + steps)

    def _backup(self, step: int) -> None:
        events = []
        roster = self._roster
        for shard, owner in enumerate(roster.world):
            checksum = f"crc32:{step:06x}{shard:04x}"
            events.append(self._event(owner, "backup.snapshot", {
                "step": step, "shard": shard, "nbytes": 4096, "checksum": checksum,
                "seconds": 0.01,
            }))  # fmt: skip
            for holder in roster.placement[shard]:
                events.append(self._event(holder, "backup.replicated", {
                    "step": step, "shard": shard, "owner": owner, "nbytes": 4096,
                    "checksum": checksum, "seconds": 0.01,
                }))  # fmt: skip
        self._add(events)

    def _crash(self, victim: str) -> int:
        """``victim`` is killed; the world recovers; return the step training goes on from."""
        self._add([self._event(victim, "member.exited",
                               {"member": victim, "signal": 9, "exit_code": None},
                               launcher=True)])  # fmt: skip
        if not self._decide():
            raise RuntimeError(f"the decider did not act on {victim}'s exit")
        incident = self.v.incidents[self.v.open_incident or ""]
        decision = incident.decisions[-1]
        g = decision.generation
        for offset, kind, payload in (
            (0.1, "command.acked", {"command_id": decision.command_id}),
            (0.5, "restore.completed",
             {"generation": g, "step": decision.restore_step, "bytes": 4096, "seconds": 0.3}),
            (0.6, "train.resumed", {"generation": g, "step": decision.restore_step}),
        ):  # fmt: skip
            self.now += timedelta(seconds=offset)
            self._add([self._event(m, kind, payload) for m in decision.world])
        self.now += timedelta(seconds=0.2)
        self._step(decision.restore_step + 1, _loss(decision.restore_step + 1))
        self._decide()
        if self.v.open_incident is not None:
            raise RuntimeError("the incident did not resolve")
        # The lost rank's node starts a new process: a warm spare.
        source = self.sources[victim]
        self._rejoined += 1
        self._join(f"re{self._rejoined}", source.node, source.rack, "spare", None)
        self._decide()
        return decision.restore_step + 2

    def run(self) -> Iterator[list[EnvelopeBase]]:
        """Train, back up and recover forever; yield what was recorded, a batch at a time."""
        self.start()
        step, crashes = 1, 0
        while True:
            self.now += timedelta(seconds=0.5)
            self._step(step, _loss(step))
            if step % self.backup_interval == 0:
                self._backup(step)
            if step % self.backup_interval == 0 and self._decide():
                raise RuntimeError(f"an unexpected decision at step {step}")
            if step % self.crash_every == self.crash_every // 2:
                crashes += 1
                world = self.v.world
                step = self._crash(world[(crashes * 7) % len(world)])
            else:
                step += 1
            if len(self.out) >= FILL_BATCH:
                yield self.take()

    def take(self) -> list[EnvelopeBase]:
        """Hand out what was recorded since the last call."""
        out, self.out = self.out, []
        return out


def _loss(step: int) -> float:
    return round(2.0 / (1.0 + 0.01 * step), 6)


def fill(store: PostgresEventStore, job: RecordedJob, events: int, progress: bool) -> int:
    """Append ``events`` events of ``job``; return how many were stored. A batch is appended
    (COPY, in a thread: PostgreSQL does the work) while the next one is recorded."""
    stored = 0
    with ThreadPoolExecutor(1, thread_name_prefix="bench-fill") as writer:
        pending: Future[AppendResult] | None = None
        recorded = 0
        for recorded_batch in job.run():
            batch = recorded_batch[: events - recorded]
            recorded += len(batch)
            if pending is not None:
                stored += len(pending.result().stored)
                if progress:
                    _progress(f"  {stored:,} events stored")
            pending = writer.submit(store.append, batch)
            if recorded >= events:
                break
        if pending is not None:
            stored += len(pending.result().stored)
    return stored


# --------------------------------------------------------------------------- the load


@dataclass(slots=True)
class _Route:
    name: str
    url: Callable[[random.Random], str]
    latencies_ms: list[float] = field(default_factory=list)
    errors: int = 0
    #: Bytes of the bodies of the answers measured.
    body_bytes: int = 0


class _RawConnection:
    """One keep-alive HTTP/1.1 connection that sends GETs and reads whole answers: a client
    that costs a few tens of microseconds a request (httpx costs several times the API's
    own time per request, so on a small machine it would measure itself)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader = reader
        self._writer = writer

    @classmethod
    async def open(cls, host: str, port: int) -> _RawConnection:
        reader, writer = await asyncio.open_connection(host, port)
        return cls(reader, writer)

    async def get(self, path: str) -> tuple[int, bytes]:
        self._writer.write(f"GET {path} HTTP/1.1\r\nHost: api\r\n\r\n".encode())
        head = await self._reader.readuntil(b"\r\n\r\n")
        status = int(head[9:12])
        length = 0
        for line in head.split(b"\r\n"):
            if line[:15].lower() == b"content-length:":
                length = int(line[15:])
        return status, await self._reader.readexactly(length)

    async def sized(self, path: str) -> tuple[int, int]:
        status, body = await self.get(path)
        return status, len(body)

    async def close(self) -> None:
        self._writer.close()
        await self._writer.wait_closed()


#: A GET: the answer's status and its body's length.
Getter = Callable[[str], Awaitable[tuple[int, int]]]


async def _client(
    get: Getter, route: _Route, rng: random.Random, until: float, measure: float
) -> None:
    """One client: the next request as soon as the last one is answered."""
    while True:
        url = route.url(rng)
        started = time.perf_counter()
        if started >= until:
            return
        status, size = await get(url)
        elapsed = (time.perf_counter() - started) * 1e3
        if status != 200:
            route.errors += 1
        elif started >= measure:
            route.latencies_ms.append(elapsed)
            route.body_bytes += size


async def _load(base: str, route: _Route, clients: int, seconds: float, client: str) -> None:
    """``clients`` clients on ``route`` for a second of warm-up and ``seconds`` measured."""
    getters: list[Getter] = []
    closers: list[Callable[[], Awaitable[None]]] = []
    if client == "httpx":
        limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
        pool = httpx.AsyncClient(base_url=base, limits=limits, timeout=60.0)

        async def get(url: str) -> tuple[int, int]:
            response = await pool.get(url)
            return response.status_code, len(response.content)

        getters = [get] * clients
        closers.append(pool.aclose)
    else:
        host, port = base.removeprefix("http://").split(":")
        for _ in range(clients):
            conn = await _RawConnection.open(host, int(port))
            getters.append(conn.sized)
            closers.append(conn.close)
    try:
        warm = time.perf_counter() + 1.0
        until = warm + seconds
        await asyncio.gather(
            *(_client(g, route, random.Random(i), until, warm) for i, g in enumerate(getters))
        )
    finally:
        for close in closers:
            await close()


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def _figures(latencies: list[float], seconds: float) -> dict[str, Any]:
    if not latencies:
        return {"requests": 0}
    return {
        "requests": len(latencies),
        "per_s": round(len(latencies) / seconds, 1),
        "p50_ms": round(statistics.median(latencies), 2),
        "p99_ms": round(_percentile(latencies, 0.99), 2),
        "max_ms": round(max(latencies), 2),
    }


# --------------------------------------------------------------------------- the API process

#: What ``elasticctl api`` logs once it has read a view snapshot (``api.views``).
_STARTED = re.compile(r"started from the view snapshot at position (\d+)")


def start_api(
    database_url: str, *, hot: bool = True, log: Path | None = None
) -> tuple[subprocess.Popen[bytes], str]:
    """``elasticctl api`` as its own process on a free port (with its hot routes or
    without; its log at INFO in ``log``, else only warnings, on stderr): the process and
    its base URL."""
    port = free_port()
    env = {**os.environ, DATABASE_URL_ENV: database_url}
    env["ELASTIC_LOG_LEVEL"] = "INFO" if log is not None else "WARNING"
    env.pop("ELASTIC_API_TOKENS", None)
    env["ELASTIC_API_HOT_ROUTES"] = "true" if hot else "false"
    command = [sys.executable, "-m", "controlplane", "api", "--host", "127.0.0.1"]
    command += ["--port", str(port)]
    if log is None:
        return subprocess.Popen(command, env=env), f"http://127.0.0.1:{port}"
    with log.open("ab") as out:
        api = subprocess.Popen(command, env=env, stderr=out)
    return api, f"http://127.0.0.1:{port}"


def stop_api(api: subprocess.Popen[bytes]) -> None:
    """Stop the API (killed when it does not stop in 30 s: still folding in its warm-up)."""
    api.terminate()
    try:
        api.wait(30)
    except subprocess.TimeoutExpired:
        api.kill()
        api.wait(30)


def first_answer(base: str, path: str, api: subprocess.Popen[bytes], wait_s: float) -> float | None:
    """Seconds until the API answers ``path`` with a 200 (asked every 50 ms), None when it
    did not within ``wait_s``; RuntimeError when it exits."""
    started = time.monotonic()
    with httpx.Client(base_url=base, timeout=wait_s) as client:
        while time.monotonic() - started < wait_s:
            if api.poll() is not None:
                raise RuntimeError(f"the API exited with status {api.returncode}")
            try:
                response = client.get(path)
            except httpx.TransportError:
                time.sleep(0.05)
                continue
            if response.status_code == 200:
                return time.monotonic() - started
            time.sleep(0.05)
    return None


def _wait_caught_up(base: str, job_id: str, events: int, api: subprocess.Popen[bytes]) -> float:
    """Wait until the API's view of ``job_id`` holds ``events`` events; return how long."""
    started = time.monotonic()
    with httpx.Client(base_url=base, timeout=600.0) as client:
        while True:
            if api.poll() is not None:
                raise RuntimeError(f"the API exited with status {api.returncode}")
            try:
                response = client.get(f"/api/v1/jobs/{job_id}")
            except httpx.TransportError:
                time.sleep(0.05)
                continue
            if response.status_code == 200 and response.json()["events"] >= events:
                return time.monotonic() - started
            time.sleep(0.05)


def _check(base: str, routes: list[_Route]) -> None:
    """The answers the load will get are valid (one of each route, through the schemas)."""
    rng = random.Random(-1)
    models: dict[str, type[BaseModel]] = {"timeline": IncidentTimeline, "events": EventPage}
    with httpx.Client(base_url=base) as client:
        for route in routes:
            response = client.get(route.url(rng))
            response.raise_for_status()
            models[route.name].model_validate_json(response.content)


def _cpu_s(pid: int) -> float:
    import psutil

    times = psutil.Process(pid).cpu_times()
    return float(times.user + times.system)


def _measure(
    base: str, api: subprocess.Popen[bytes], routes: list[_Route], options: _Options
) -> dict[str, float]:
    """Run the load on each route; return the API's CPU time per request, per route."""
    cpu: dict[str, float] = {}
    for route in routes:
        if options.progress:
            _progress(
                f"{options.clients} clients on the {route.name} route for {options.seconds:.0f}s"
            )
        before = _cpu_s(api.pid)
        asyncio.run(_load(base, route, options.clients, options.seconds, options.client))
        # The warm-up second is not measured, but the API worked in it too.
        requests = len(route.latencies_ms) * (options.seconds + 1.0) / options.seconds
        cpu[route.name] = round((_cpu_s(api.pid) - before) / max(requests, 1.0) * 1e6, 1)
    return cpu


@dataclass(frozen=True, slots=True)
class _Options:
    clients: int
    seconds: float
    client: str
    progress: bool


@dataclass(frozen=True, slots=True)
class _Log:
    """The log the API serves: its job, how to know the API is ready, what to ask for."""

    job_id: str
    #: The job's members (the member filter picks one).
    members: list[str]
    #: The API is ready when its view of the job holds this many events (None: when it
    #: first answers for the job: a start from the history's view snapshot).
    events: int | None


def run_api_bench(
    *,
    events: int = 1_000_000,
    ranks: int | None = None,
    days: float = 1.0,
    clients: int = 32,
    seconds: float = 10.0,
    client: str = "raw",
    progress: bool = True,
    compare_plain: bool = False,
) -> dict[str, Any]:
    """Run the benchmark and return its figures. The log: ``events`` events of a 64-worker
    job (``RecordedJob``), or with ``ranks`` the history of ``days`` of a job of that many
    ranks (``bench.history``, its incidents at ``INCIDENTS_PER_DAY`` a day, at least one),
    with the view snapshot it comes with. ``compare_plain``: measure again against an API
    without its hot routes (``ELASTIC_API_HOT_ROUTES=false``), on the same log."""
    options = _Options(clients, seconds, client, progress)
    load_before = os.getloadavg()[0]
    result: dict[str, Any] = {}
    with stack() as services:
        filled = time.monotonic()
        if ranks is None:
            store = PostgresEventStore.from_url(services.database_url)
            job = RecordedJob(f"bench-{uuid.uuid4().hex[:8]}")
            if progress:
                _progress(f"recording and appending {events:,} events")
            try:
                stored = fill(store, job, events, progress)
            finally:
                store.close()
            fill_s = time.monotonic() - filled
            settle(services.database_url)
            served = _Log(job.job_id, list(job.v.members), stored)
            result |= {"events": stored, "fill_s": round(fill_s, 1),
                       "fill_events_per_s": round(stored / fill_s, 1)}  # fmt: skip
        else:
            rows = round(history_rows_per_day(ranks) * days)
            incidents = max(1, round(INCIDENTS_PER_DAY * days))
            if progress:
                _progress(f"history: {rows:,} rows ({days:g} days of a {ranks:,}-rank job,"
                          f" {incidents} incident(s))")  # fmt: skip
            written = write_history(
                services.database_url, rows, days, ranks=ranks, incidents=incidents,
                progress=progress,
            )  # fmt: skip
            log_rows, log_bytes = log_size(services.database_url)
            served = _Log(written.job_id, list(written.members), None)
            result |= {"ranks": ranks, "days": days, "history_rows": written.rows,
                       "history_written_s": round(time.monotonic() - filled, 1),
                       "log_rows": log_rows, "log_bytes": log_bytes}  # fmt: skip
        hot = _serve_and_measure(services.database_url, served, options, hot=True)
        plain = (
            _serve_and_measure(services.database_url, served, options, hot=False)
            if compare_plain
            else None
        )
    result = {
        **{k: v for k, v in result.items() if k in ("events", "ranks", "days")},
        "clients": clients,
        "client": client,
        "seconds": seconds,
        **hot,
        **{k: v for k, v in result.items() if k not in ("events", "ranks", "days")},
        # The machine is shared: its load when the benchmark started, and at the end.
        "load_avg_1m": [round(load_before, 2), round(os.getloadavg()[0], 2)],
        "cpus": os.cpu_count(),
        **services.where,
    }
    if plain is not None:
        result["plain"] = plain
        # Requests per second with the hot routes over without, per route (same run).
        result["hot_routes_speedup"] = {
            name: round(route["per_s"] / plain["routes"][name]["per_s"], 2)
            for name, route in hot["routes"].items()
            if plain["routes"][name].get("per_s")
        }
    return result


def _serve_and_measure(
    database_url: str, served: _Log, options: _Options, *, hot: bool
) -> dict[str, Any]:
    """Start ``elasticctl api`` over the log (with its hot routes or without), wait until it
    is ready (caught up with the log, or its first answer for the job: its cold start), and
    run the load on both routes; their figures."""
    job_id = served.job_id
    with tempfile.TemporaryDirectory(prefix="bench-api-") as tmp:
        log = Path(tmp) / "api.log"
        api, base = start_api(database_url, hot=hot, log=log)
        try:
            if options.progress:
                _progress(f"starting the API ({'with' if hot else 'without'} its hot routes)")
            ready: dict[str, Any]
            if served.events is None:
                cold = first_answer(base, f"/api/v1/jobs/{job_id}", api, 600.0)
                if cold is None:
                    raise BenchError("the API did not answer for the job within 600 s")
                found = _STARTED.findall(log.read_text(errors="replace"))
                ready = {"cold_start_s": round(cold, 3),
                         "api_started_from": int(found[-1]) if found else None}  # fmt: skip
            else:
                ready = {"catch_up_s": round(_wait_caught_up(base, job_id, served.events, api), 1)}
            with httpx.Client(base_url=base, timeout=60.0) as http:
                incidents = [
                    i["incident_id"] for i in http.get(f"/api/v1/jobs/{job_id}/incidents").json()
                ]
                last = http.get(f"/api/v1/jobs/{job_id}").json()["last_position"]
            if not incidents:
                raise BenchError(
                    "the log ends before the job's first incident: the timeline route needs"
                    " one; ask for more events"
                )
            members = served.members
            routes = [
                _Route(
                    "timeline",
                    lambda rng: f"/api/v1/jobs/{job_id}/incidents/{rng.choice(incidents)}",
                ),
                _Route("events", lambda rng: _events_url(job_id, last, members, rng)),
            ]
            _check(base, routes)
            cpu = _measure(base, api, routes, options)
            rss = _rss_bytes(api.pid)
        finally:
            stop_api(api)
    everything = [x for r in routes for x in r.latencies_ms]
    overall = _figures(everything, options.seconds * len(routes))
    return {
        "p50_ms": overall.get("p50_ms"),
        "p99_ms": overall.get("p99_ms"),
        "routes": {
            r.name: {
                **_figures(r.latencies_ms, options.seconds),
                "errors": r.errors,
                "api_cpu_us_per_request": cpu[r.name],
                "body_bytes_mean": round(r.body_bytes / max(1, len(r.latencies_ms))),
            }
            for r in routes
        },
        "incidents": len(incidents),
        **ready,
        "api_rss_bytes": rss,
    }


def _rss_bytes(pid: int) -> int:
    import psutil

    return int(psutil.Process(pid).memory_info().rss)


def _events_url(job_id: str, last: int, members: list[str], rng: random.Random) -> str:
    url = f"/api/v1/jobs/{job_id}/events?after={rng.randrange(0, last)}"
    draw = rng.randrange(8)
    if draw == 0:
        return f"{url}&member={rng.choice(members)}"
    if draw in (1, 5):
        return f"{url}&type=train.step"
    return url
