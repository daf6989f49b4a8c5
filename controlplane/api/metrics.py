"""Prometheus metrics of the log and the job views, for the API's ``/metrics`` and the control
plane's exporter (``ELASTIC_METRICS_PORT``).

- ``elastic_events_ingested_total``: events folded by this process (the API counts the
  events of the view snapshot it starts from too, so its count is the log's; the control
  plane counts what it committed);
- ``elastic_log_position``: the last log position folded;
- ``elastic_ingest_lag_seconds``: ``recorded_at - emitted_at`` of the newest member event
  folded (how long the newest event took from its producer into the log);
- ``elastic_incidents{job_id, outcome, kind}``: a job's incidents by outcome (``open``,
  ``recovered``, ``stopped``) and kind (``fault``, ``growth``, ``anomaly``: a loss anomaly's
  rollback);
- ``elastic_slow_members{job_id, action}``: members of a job recorded slow (``member.slow``,
  the newest record of each) by what the policy made of it (``ignore``, ``replace``);
- ``elastic_mttr_seconds{job_id}``: histogram of the downtime of a job's recovered faults (its
  fault to the first step of the new generation), buckets from 10 ms;
- ``elastic_events_discounted_total{job_id, reason}``: evidence the fold did not believe;
- ``elastic_dead_letters_total``: input the log refused (the control plane counts what it
  commits, the API what the store keeps);
- ``elastic_leader``: 1 on the control plane holding the ingest lock, 0 on a standby (the
  control plane's exporter only);
- ``elastic_jobs{state}``: jobs by state;
- ``elastic_job_wall_seconds{job_id}``, ``elastic_job_goodput_seconds{job_id, term}`` and
  ``elastic_job_ettr{job_id}``: each registered job's wall time, its split by term and its
  ETTR (``core.goodput``; the API's ``/metrics`` only).

Per-job metrics are labelled ``job_id``, not ``job``: Prometheus gives every scraped series
the ``job`` of its scrape configuration, and would rename an exposed one ``exported_job``.
Every counter is exposed with the ``_total`` suffix (``prometheus_client`` adds it to the
names given here); ``METRICS`` lists every family and ``tests/unit/test_metrics_names.py``
checks the exporters expose exactly those.

Everything but the counter, the position and the lag is computed from the views at scrape
time, so nothing on the ingest path is added for it.
"""

from __future__ import annotations

import bisect
import logging
import threading
from collections import Counter as Tally
from collections.abc import Callable, Iterable, Iterator, Sequence
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest, make_wsgi_app
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from controlplane.api.auth import Denied, TokenAuth
from controlplane.core.goodput import TERMS, Goodput
from controlplane.core.records import StoredEvent
from controlplane.core.view import DiscountReason, JobView
from controlplane.errors import StoreError
from schemas.common import CONTROLPLANE_SOURCE, JobState

#: Upper bounds of the MTTR histogram's buckets, in seconds.
#: From 10 ms: a recovery from a hot backup takes about 0.1 s (docs/benchmarks.md).
MTTR_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
    300.0,
    600.0,
)
INCIDENT_OUTCOMES = ("open", "recovered", "stopped")
#: Every metric family the exporters expose: name -> (type, labels). The API's ``/metrics``
#: has all but ``elastic_leader``; the control plane's all but the goodput gauges.
METRICS: dict[str, tuple[str, tuple[str, ...]]] = {
    "elastic_events_ingested_total": ("counter", ()),
    "elastic_log_position": ("gauge", ()),
    "elastic_ingest_lag_seconds": ("gauge", ()),
    "elastic_jobs": ("gauge", ("state",)),
    "elastic_incidents": ("gauge", ("job_id", "outcome", "kind")),
    "elastic_slow_members": ("gauge", ("job_id", "action")),
    "elastic_events_discounted_total": ("counter", ("job_id", "reason")),
    "elastic_mttr_seconds": ("histogram", ("job_id",)),
    "elastic_dead_letters_total": ("counter", ()),
    "elastic_leader": ("gauge", ()),
    "elastic_job_wall_seconds": ("gauge", ("job_id",)),
    "elastic_job_goodput_seconds": ("gauge", ("job_id", "term")),
    "elastic_job_ettr": ("gauge", ("job_id",)),
}
#: The content type of the text exposition format.
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

log = logging.getLogger(__name__)


class _ViewCollector(Collector):
    """Metrics derived from the job views when scraped."""

    def __init__(
        self,
        views: Callable[[], Iterable[JobView]],
        goodputs: Callable[[], Iterable[Goodput]] | None = None,
    ) -> None:
        self._views = views
        self._goodputs = goodputs

    def collect(self) -> Iterator[Metric]:
        states: Tally[JobState] = Tally()
        jobs = GaugeMetricFamily("elastic_jobs", "Jobs by state.", labels=["state"])
        incidents = GaugeMetricFamily(
            "elastic_incidents",
            "A job's incidents by outcome (open, recovered, stopped) and kind.",
            labels=["job_id", "outcome", "kind"],
        )
        slow = GaugeMetricFamily(
            "elastic_slow_members",
            "Members of a job recorded slow (member.slow, each member's newest record), by what"
            " the policy made of it (ignore, replace).",
            labels=["job_id", "action"],
        )
        discounted = CounterMetricFamily(
            "elastic_events_discounted",
            "Events stored in the log that the control plane did not believe, by job and"
            " reason (see the discounts of GET /api/v1/jobs/{job}/cluster).",
            labels=["job_id", "reason"],
        )
        mttr = HistogramMetricFamily(
            "elastic_mttr_seconds",
            "Downtime of a job's recovered faults: the fault to the first step of the new"
            " generation.",
            labels=["job_id"],
        )
        reasons = sorted(r.value for r in DiscountReason)
        for view in self._views():
            job = view.job_id
            states[view.state] += 1
            outcomes: Tally[tuple[str, str]] = Tally()
            downtimes: list[float] = []
            for incident in view.incidents.values():
                outcome = incident.outcome or "open"
                outcomes[outcome, incident.kind] += 1
                if (
                    outcome == "recovered"
                    and incident.kind == "fault"
                    and incident.downtime_s is not None
                ):
                    downtimes.append(incident.downtime_s)
            kinds = sorted({"fault", "growth", "anomaly", *(kind for _, kind in outcomes)})
            for outcome in INCIDENT_OUTCOMES:
                for kind in kinds:
                    incidents.add_metric([job, outcome, kind], outcomes[outcome, kind])
            actions = Tally(mark.action for mark in view.slow.values())
            for action in sorted({"ignore", "replace", *actions}):
                slow.add_metric([job, action], actions[action])
            counts = view.discount_counts
            for reason in sorted({*reasons, *counts}):
                discounted.add_metric([job, reason], counts.get(reason, 0))
            buckets, total = _buckets(downtimes)
            mttr.add_metric([job], buckets, total)
        for state in JobState:
            jobs.add_metric([state.value], states[state])
        yield jobs
        yield incidents
        yield slow
        yield discounted
        yield mttr
        if self._goodputs is not None:
            yield from _goodput_metrics(self._goodputs())


class _ProcessCollector(Collector):
    """What this process is: the ingest leader or a standby (the control plane only), and
    the dead letters the store keeps (the API only, counted when scraped)."""

    def __init__(
        self, leader: Callable[[], bool] | None, dead_letters: Callable[[], int] | None
    ) -> None:
        self._leader = leader
        self._dead_letters = dead_letters

    def collect(self) -> Iterator[Metric]:
        if self._leader is not None:
            yield GaugeMetricFamily(
                "elastic_leader",
                "1 on the control plane holding the ingest lock (ingesting and deciding),"
                " 0 on a standby.",
                value=1.0 if self._leader() else 0.0,
            )
        if self._dead_letters is not None:
            try:
                kept = self._dead_letters()
            except StoreError as exc:  # the rest is still served; healthz reports the database
                log.warning("elastic_dead_letters_total left out: %s", exc)
                return
            yield CounterMetricFamily(
                "elastic_dead_letters",
                "Input the log refused (schema violations, forged sources, out-of-order"
                " sequence numbers, ...), as the dead letters table keeps it.",
                value=float(kept),
            )


def _goodput_metrics(found: Iterable[Goodput]) -> Iterator[Metric]:
    wall = GaugeMetricFamily(
        "elastic_job_wall_seconds",
        "A job's wall time: its registration to its end, or now.",
        labels=["job_id"],
    )
    terms = GaugeMetricFamily(
        "elastic_job_goodput_seconds",
        "A job's wall time by term (docs/design.md, Goodput accounting): productive,"
        " recomputation, backup, stragglers, detection, decision, restore, resume, waiting,"
        " idle.",
        labels=["job_id", "term"],
    )
    ettr = GaugeMetricFamily(
        "elastic_job_ettr", "A job's effective training time ratio: productive / wall.",
        labels=["job_id"],
    )  # fmt: skip
    for g in found:
        wall.add_metric([g.job_id], g.wall_s)
        for term in TERMS:
            terms.add_metric([g.job_id, term], g.seconds[term])
        if g.ettr is not None:
            ettr.add_metric([g.job_id], g.ettr)
    yield wall
    yield terms
    yield ettr


def _buckets(values: list[float]) -> tuple[list[tuple[str, float]], float]:
    """The cumulative buckets of ``values`` (``MTTR_BUCKETS``) and their sum."""
    values.sort()
    buckets: list[tuple[str, float]] = [
        (repr(bound), float(bisect.bisect_right(values, bound))) for bound in MTTR_BUCKETS
    ]
    buckets.append(("+Inf", float(len(values))))
    return buckets, sum(values)


class LogMetrics:
    """The metrics of one process, in a registry of their own."""

    def __init__(
        self,
        views: Callable[[], Iterable[JobView]],
        goodputs: Callable[[], Iterable[Goodput]] | None = None,
        *,
        leader: Callable[[], bool] | None = None,
        dead_letters: Callable[[], int] | None = None,
    ) -> None:
        """``leader``: whether this process holds the ingest lock (the control plane's);
        ``dead_letters``: how many the store keeps (the API's); without it, the dead letters
        of the appends ``appended`` is told of are counted."""
        self.registry = CollectorRegistry()
        self._dead_letters = (
            Counter(
                "elastic_dead_letters",
                "Input the log refused (schema violations, forged sources, out-of-order"
                " sequence numbers, ...), as this process committed it.",
                registry=self.registry,
            )
            if dead_letters is None
            else None
        )
        self._events = Counter(
            "elastic_events_ingested",
            "Events folded from the log by this process.",
            registry=self.registry,
        )
        self._position = Gauge(
            "elastic_log_position", "The last log position folded.", registry=self.registry
        )
        self._lag = Gauge(
            "elastic_ingest_lag_seconds",
            "recorded_at - emitted_at of the newest member event folded.",
            registry=self.registry,
        )
        self.registry.register(_ViewCollector(views, goodputs))
        self.registry.register(_ProcessCollector(leader, dead_letters))

    def started(self, views: Sequence[JobView], position: int) -> None:
        """The views start from a snapshot at ``position``: count the events it holds."""
        self._events.inc(sum(view.events for view in views))
        self._position.set(position)

    def observe(self, events: Sequence[StoredEvent]) -> None:
        """Count a batch folded (O(1) unless its tail is all control-plane events)."""
        if not events:
            return
        self._events.inc(len(events))
        self._position.set(events[-1].position)
        for stored in reversed(events):
            if stored.event.source != CONTROLPLANE_SOURCE:
                lag = (stored.recorded_at - stored.event.emitted_at).total_seconds()
                self._lag.set(max(lag, 0.0))
                return

    def appended(self, dead_letters: int) -> None:
        """An append committed ``dead_letters`` dead letters."""
        if dead_letters and self._dead_letters is not None:
            self._dead_letters.inc(dead_letters)

    def exposition(self) -> bytes:
        """The text exposition of every metric."""
        return generate_latest(self.registry)


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        """Log no requests."""


class _ThreadingServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class MetricsExporter:
    """Serves a ``LogMetrics`` over HTTP from a thread (the control plane's exporter)."""

    def __init__(
        self, metrics: LogMetrics, host: str, port: int, auth: TokenAuth | None = None
    ) -> None:
        self.metrics = metrics
        self._auth = auth
        self._serve = make_wsgi_app(metrics.registry)
        self._server = make_server(
            host, port, self._app, server_class=_ThreadingServer, handler_class=_QuietHandler
        )
        self.port = int(self._server.server_address[1])
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="metrics-exporter", daemon=True
        )
        self._thread.start()

    def _app(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> list[bytes]:
        if environ.get("PATH_INFO") not in ("/metrics", "/"):
            start_response("404 Not Found", [("Content-Type", "text/plain")])
            return [b"not found: the metrics are at /metrics\n"]
        if self._auth is not None:
            try:
                self._auth.check(environ.get("HTTP_AUTHORIZATION"))
            except Denied as denied:
                status = "401 Unauthorized" if denied.status == 401 else "403 Forbidden"
                start_response(
                    status,
                    [("Content-Type", "text/plain"), ("WWW-Authenticate", denied.challenge)],
                )
                return [denied.detail.encode() + b"\n"]
        return list(self._serve(environ, start_response))

    def close(self) -> None:
        """Stop serving and release the port."""
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)


def exporter(
    views: Callable[[], Iterable[JobView]],
    host: str,
    port: int,
    auth: TokenAuth | None = None,
    *,
    leader: Callable[[], bool] | None = None,
) -> MetricsExporter:
    """Start serving metrics of ``views`` on ``host:port`` (0: any free port); ``leader``:
    whether this process holds the ingest lock."""
    return MetricsExporter(LogMetrics(views, leader=leader), host, port, auth)
