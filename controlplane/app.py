"""Bootstrap: the one place that wires the real adapters (PostgreSQL, NATS) around the core."""

from __future__ import annotations

import asyncio
import errno
import logging
import signal
import time
from collections.abc import Callable, Iterable
from datetime import datetime
from typing import TYPE_CHECKING

from nats.aio.client import Client
from nats.js import JetStreamContext

from controlplane import bus, gctune, snapshots
from controlplane.backoff import Backoff
from controlplane.core.decide import Context
from controlplane.core.liveness import Beats, LivenessTable, take_beats
from controlplane.core.view import JobView
from controlplane.decider import CommandPublisher, ControlFault, Decider, utcnow
from controlplane.errors import BusUnavailable, StoreUnavailable
from controlplane.ingest import Fetcher
from controlplane.lock import AdvisoryLock
from controlplane.rendezvous import RendezvousHost, RendezvousLimits, server_tls
from controlplane.service import Session, Views
from controlplane.settings import Settings, master_secret
from controlplane.store.migrate import check_schema
from controlplane.store.port import EventStore
from controlplane.store.postgres import PostgresEventStore
from schemas.auth import CommandSigner
from schemas.nats import Failover

if TYPE_CHECKING:
    from controlplane.api.metrics import LogMetrics, MetricsExporter

log = logging.getLogger(__name__)

#: How long a new leader tries to bind the rendezvous port while the control plane that led
#: before still holds it (it lets go once it finds the lock taken: ``lock_retry_s`` or so).
RENDEZVOUS_BIND_WAIT_S = 30.0


def load_views(store: EventStore) -> dict[str, JobView]:
    """Every job's view: from the store's view snapshot and the log after it (``snapshots``)."""
    return snapshots.load(store).views


class ControlPlane:
    """The control-plane service: ingest, the live views folded from what it commits, and
    the decider that records decisions and publishes commands. One process holds the lock
    and does all of it; others stand by."""

    def __init__(self, settings: Settings, store: PostgresEventStore | None = None) -> None:
        self.settings = settings
        self._store = store
        #: Every job's view, folded from what this process commits (their one owner).
        self.folded = Views()
        #: The current session (its loop and stats), while this process ingests.
        self.ingest: Session | None = None
        self.decider: Decider | None = None
        #: The heartbeats heard this session (soft state) and the listener that hears them.
        self.liveness: LivenessTable | None = None
        self.heartbeats: bus.HeartbeatListener | None = None
        #: How many times this process took the ingest lock and started ingesting.
        self.sessions = 0
        #: Whether this process holds the ingest lock (``elastic_leader``).
        self.leading = False
        #: How the views of the current session were folded at its start.
        self.loaded: snapshots.Loaded | None = None
        #: Records the views as the log grows (None: ``snapshot_interval_s`` is 0).
        self.snapshotter: snapshots.Snapshotter | None = None
        #: Prometheus metrics of what this process commits (``ELASTIC_METRICS_PORT``).
        self.metrics: LogMetrics | None = None
        #: The installation secret: authenticates the rendezvous store, signs commands.
        self.master = master_secret(settings)
        self.rendezvous = (
            RendezvousHost(
                settings.rendezvous_host,
                settings.rendezvous_port,
                listen=settings.rendezvous_listen or settings.rendezvous_host,
                master=self.master,
                limits=RendezvousLimits(
                    max_keys=settings.rendezvous_max_keys, max_bytes=settings.rendezvous_max_bytes
                ),
                admit=self._started_generation,
                ssl_context=server_tls(settings.tls_cert, settings.tls_key),
            )
            if settings.rendezvous
            else None
        )

    @property
    def views(self) -> dict[str, JobView]:
        """Every job's view as this process folded it (replaced at every fold)."""
        return self.folded.current

    def _started_generation(self, job_id: str, generation: int) -> bool:
        """Whether ``generation`` of ``job_id`` was recorded (the rendezvous store admits
        no other; called from the store's thread, reading the current views)."""
        view = self.views.get(job_id)
        return view is not None and 0 < generation <= view.generation

    def _heartbeat_taker(self, table: LivenessTable) -> Callable[[Beats, datetime], list[str]]:
        """Takes validated heartbeats into ``table``: each only from its member's current
        process (its joined incarnation, on its node); why each other one was not taken."""

        def take(beats: Beats, at: datetime) -> list[str]:
            return take_beats(table, self.views.get(beats.job_id), beats, at)

        return take

    async def run(self, stop: asyncio.Event) -> None:
        """Serve until ``stop`` is set. Raises ``SchemaNotMigrated`` on an unmigrated database."""
        settings = self.settings
        store = self._store or PostgresEventStore.from_url(settings.database_url)
        backoff = Backoff(max_s=settings.retry_max_s)
        while not stop.is_set():
            try:
                await asyncio.to_thread(check_schema, store.engine)
                break
            except StoreUnavailable as exc:
                log.warning("waiting for PostgreSQL: %s", exc)
                await backoff.sleep(stop)
        lock = AdvisoryLock(settings.database_url)
        try:
            while not stop.is_set():
                if not await lock.acquire(
                    stop, retry_s=settings.lock_retry_s, on_standby=self._stand_by
                ):
                    break
                self.leading = True
                try:
                    # Fold what the log holds now: another process may have ingested before.
                    loaded = self.loaded = await asyncio.to_thread(snapshots.load, store)
                    gctune.freeze()  # the folded views are no garbage: keep them out of collections
                except StoreUnavailable as exc:
                    log.warning("waiting for PostgreSQL: %s", exc)
                    self.leading = False
                    await lock.release()
                    await backoff.sleep(stop)
                    continue
                backoff.reset()
                log.info(
                    "folded %d job(s) in %.2f s: %s, and %d event(s) after it", len(loaded.views),
                    loaded.seconds, "the whole log" if loaded.snapshot is None else
                    f"the view snapshot at position {loaded.snapshot}", loaded.tail,
                )  # fmt: skip
                self.snapshotter = (
                    snapshots.Snapshotter(store, loaded, settings.snapshot_interval_s)
                    if settings.snapshot_interval_s > 0
                    else None
                )
                self.folded = Views(
                    loaded.views, snapshotter=self.snapshotter, metrics=self.metrics
                )
                self.sessions += 1
                await self._ingest_while_held(store, lock, stop)
                self.leading = False
                await lock.release()
        finally:
            self.leading = False
            await lock.release()
            if self.rendezvous is not None:
                self.rendezvous.close()
            if self._store is None:
                store.close()

    async def _stand_by(self) -> None:
        """Another control plane leads: stop serving the rendezvous (its port is the
        leader's; it binds it once its session starts)."""
        if self.rendezvous is not None:
            await asyncio.to_thread(self.rendezvous.close)

    async def _serve_rendezvous(self, stop: asyncio.Event) -> str | None:
        """Start the rendezvous store; its address ("" with none). A control plane that led
        before may hold the port a moment longer (it lets go once it sees the lock taken,
        ``_stand_by``): the bind is tried again for ``RENDEZVOUS_BIND_WAIT_S``; None when
        the port stayed taken (or ``stop``)."""
        if self.rendezvous is None:
            return ""
        deadline = time.monotonic() + RENDEZVOUS_BIND_WAIT_S
        backoff = Backoff(max_s=1.0)
        warned = False
        while True:
            try:
                return await asyncio.to_thread(self.rendezvous.start)
            except OSError as exc:
                if exc.errno != errno.EADDRINUSE:
                    raise
                if time.monotonic() > deadline or stop.is_set():
                    log.error("the rendezvous port stayed in use (%s): not leading for now", exc)
                    return None
                if not warned:
                    log.warning("the rendezvous port is in use (%s): trying again", exc)
                    warned = True
            await backoff.sleep(stop)

    async def _ingest_while_held(
        self, store: PostgresEventStore, lock: AdvisoryLock, stop: asyncio.Event
    ) -> None:
        """Connect, then run the service loop (``service.Session``) until ``stop`` or until
        the lock is lost (its connection ended)."""
        settings = self.settings
        failover = Failover()
        # Heartbeats sent while the connection was away were not heard: no silence of that
        # time is judged (the table counts every member heard at the reconnection).
        table: LivenessTable | None = None

        def heard_again() -> None:
            if table is not None:
                table.resume(utcnow())

        nc = await _connect(settings, stop, failover, heard_again)
        appender = store.appender()
        publisher: CommandPublisher | None = None
        try:
            if nc is None:
                return
            js = nc.jetstream()
            publisher = CommandPublisher(
                js,
                settings.command_retry_s,
                signer=CommandSigner(self.master) if self.master is not None else None,
            )
            base = await self._serve_rendezvous(stop)
            if base is None:
                return  # its port stayed taken: the lock goes back, and is tried again
            # Liveness is soft state: a new session (a restart, a takeover) starts a table of
            # its own, whole within one timeout (core/liveness.py).
            table = self.liveness = LivenessTable(started_at=utcnow())
            heartbeats = self.heartbeats = bus.HeartbeatListener(nc, self._heartbeat_taker(table))
            await heartbeats.start()
            await _ensure_commands(js, settings, stop)
            folded = self.folded
            session: Session | None = None

            async def refresh(job_id: str) -> None:
                assert session is not None
                await session.refresh(job_id)

            consumer = bus.EventConsumer(nc, settings)
            beacon = bus.Beacon(nc, consumer, failover)
            beaconing = asyncio.create_task(beacon.run(stop))
            decider = self.decider = Decider(
                views=lambda: folded.current,
                apply=folded.apply,
                refresh=refresh,
                appender=appender,
                publisher=publisher,
                context=Context(rendezvous=base),
                liveness=table,
                hear=heartbeats.catch_up,
                hold=heartbeats.held,
                events_current=consumer.answering,
                fault=ControlFault(settings.control_fault) if settings.control_fault else None,
            )
            session = self.ingest = Session(
                views=folded,
                store=store,
                appender=appender,
                fetcher=Fetcher(
                    appender,
                    consumer,
                    batch=settings.ingest_batch,
                    part=settings.ingest_part,
                    fetch_wait_s=settings.ingest_fetch_timeout_s,
                    retry_max_s=settings.retry_max_s,
                ),
                decider=decider,
                # The collector held off during a turn, its work done after (gctune).
                turn=gctune.without_gc(decider.turn, decider.stats, folded.settled),
                decide_interval_s=settings.decide_interval_s,
                retry_max_s=settings.retry_max_s,
                lock_held=lock.held,
                lock_retry_s=settings.lock_retry_s,
            )
            log.info("ingesting from %s into PostgreSQL; deciding", settings.nats_url)
            try:
                await session.run(stop)
            finally:
                beaconing.cancel()
        finally:
            if self.heartbeats is not None:
                await self.heartbeats.stop()
            if publisher is not None:
                await publisher.close()
            await appender.close()
            if nc is not None:
                await nc.close()


async def _ensure_commands(js: JetStreamContext, settings: Settings, stop: asyncio.Event) -> None:
    backoff = Backoff(max_s=settings.retry_max_s)
    while not stop.is_set():
        try:
            await bus.ensure_command_stream(js, settings)
            return
        except Exception as exc:
            log.warning("could not set up the command stream (%s); retrying", exc)
            await backoff.sleep(stop)


async def _connect(
    settings: Settings,
    stop: asyncio.Event,
    failover: Failover,
    on_reconnect: Callable[[], None],
) -> Client | None:
    backoff = Backoff(max_s=settings.retry_max_s)
    while not stop.is_set():
        try:
            return await bus.connect(settings, failover=failover, on_reconnect=on_reconnect)
        except BusUnavailable as exc:
            log.warning("waiting for NATS: %s", exc)
            await backoff.sleep(stop)
    return None


def _metrics_exporter(settings: Settings, plane: ControlPlane) -> MetricsExporter:
    """Serve ``plane``'s Prometheus metrics on ``ELASTIC_METRICS_HOST``/``_PORT``."""
    from controlplane.api.auth import TokenAuth
    from controlplane.api.metrics import exporter

    def views() -> Iterable[JobView]:
        return plane.views.values()

    served = exporter(
        views,
        settings.metrics_host,
        settings.metrics_port,
        TokenAuth.from_setting(settings.api_tokens),
        leader=lambda: plane.leading,
    )
    plane.metrics = served.metrics
    log.info("metrics at http://%s:%d/metrics", settings.metrics_host, served.port)
    return served


def serve(settings: Settings) -> None:
    """Run the control plane until SIGINT or SIGTERM."""
    gctune.tune_service()

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        plane = ControlPlane(settings)
        exporter = _metrics_exporter(settings, plane) if settings.metrics_port else None
        try:
            await plane.run(stop)
        finally:
            if exporter is not None:
                exporter.close()

    loop_factory: Callable[[], asyncio.AbstractEventLoop] = asyncio.new_event_loop
    try:
        import uvloop

        loop_factory = uvloop.new_event_loop
    except ImportError:  # the standard loop works, a little slower
        pass
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        runner.run(main())
