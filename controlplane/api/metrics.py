"""Prometheus metrics of the log and the job views, for the API's ``/metrics`` and the control
plane's exporter (``ELASTIC_METRICS_PORT``).

- ``elastic_events_ingested_total``: events folded by this process (the API counts the
  events of the view snapshot it starts from too, so its count is the log's; the control
  plane counts what it committed);
- ``elastic_log_position``: the last log position folded;
- ``elastic_ingest_lag_seconds``: ``recorded_at - emitted_at`` of the newest member event
  folded (how long the newest event took from its producer into the log);
- ``elastic_incidents{outcome, kind}``: incidents by outcome (``open``, ``recovered``,
  ``stopped``) and kind (``fault``, ``growth``);
- ``elastic_mttr_seconds``: histogram of the downtime of every recovered fault (its fault to
  the first step of the new generation);
- ``elastic_jobs{state}``: jobs by state;
- ``elastic_job_wall_seconds{job}``, ``elastic_job_goodput_seconds{job, term}`` and
  ``elastic_job_ettr{job}``: each registered job's wall time, its split by term and its
  ETTR (``core.goodput``; the API's ``/metrics`` only).

Everything but the counter, the position and the lag is computed from the views at scrape
time, so nothing on the ingest path is added for it.
"""

from __future__ import annotations

import bisect
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
from schemas.common import CONTROLPLANE_SOURCE, JobState

#: Upper bounds of the MTTR histogram's buckets, in seconds.
MTTR_BUCKETS = (0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0)
INCIDENT_OUTCOMES = ("open", "recovered", "stopped")
#: The content type of the text exposition format.
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


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
        outcomes: Tally[tuple[str, str]] = Tally()
        downtimes: list[float] = []
        discounted: Tally[str] = Tally()
        for view in self._views():
            states[view.state] += 1
            discounted.update(view.discount_counts)
            for incident in view.incidents.values():
                outcome = incident.outcome or "open"
                outcomes[outcome, incident.kind] += 1
                if (
                    outcome == "recovered"
                    and incident.kind == "fault"
                    and incident.downtime_s is not None
                ):
                    downtimes.append(incident.downtime_s)
        jobs = GaugeMetricFamily("elastic_jobs", "Jobs by state.", labels=["state"])
        for state in JobState:
            jobs.add_metric([state.value], states[state])
        yield jobs
        incidents = GaugeMetricFamily(
            "elastic_incidents", "Incidents by outcome and kind.", labels=["outcome", "kind"]
        )
        kinds = sorted({"fault", "growth", *(kind for _, kind in outcomes)})
        for outcome in INCIDENT_OUTCOMES:
            for kind in kinds:
                incidents.add_metric([outcome, kind], outcomes[outcome, kind])
        yield incidents
        events = CounterMetricFamily(
            "elastic_events_discounted",
            "Events stored in the log that the control plane did not believe, by reason"
            " (see the discounts of GET /api/v1/jobs/{job}/cluster).",
            labels=["reason"],
        )
        for reason in sorted({*(r.value for r in DiscountReason), *discounted}):
            events.add_metric([reason], discounted[reason])
        yield events
        yield _histogram(
            "elastic_mttr_seconds",
            "Downtime of recovered faults: the fault to the first step of the new generation.",
            downtimes,
        )
        if self._goodputs is not None:
            yield from _goodput_metrics(self._goodputs())


def _goodput_metrics(found: Iterable[Goodput]) -> Iterator[Metric]:
    wall = GaugeMetricFamily(
        "elastic_job_wall_seconds",
        "A job's wall time: its registration to its end, or now.",
        labels=["job"],
    )
    terms = GaugeMetricFamily(
        "elastic_job_goodput_seconds",
        "A job's wall time by term (docs/design.md, Goodput accounting): productive,"
        " recomputation, backup, detection, decision, restore, resume, waiting, idle.",
        labels=["job", "term"],
    )
    ettr = GaugeMetricFamily(
        "elastic_job_ettr", "A job's effective training time ratio: productive / wall.",
        labels=["job"],
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


def _histogram(name: str, documentation: str, values: list[float]) -> HistogramMetricFamily:
    values.sort()
    buckets: list[tuple[str, float]] = [
        (repr(bound), float(bisect.bisect_right(values, bound))) for bound in MTTR_BUCKETS
    ]
    buckets.append(("+Inf", float(len(values))))
    family = HistogramMetricFamily(name, documentation)
    family.add_metric([], buckets, sum(values))
    return family


class LogMetrics:
    """The metrics of one process, in a registry of their own."""

    def __init__(
        self,
        views: Callable[[], Iterable[JobView]],
        goodputs: Callable[[], Iterable[Goodput]] | None = None,
    ) -> None:
        self.registry = CollectorRegistry()
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
    views: Callable[[], Iterable[JobView]], host: str, port: int, auth: TokenAuth | None = None
) -> MetricsExporter:
    """Start serving metrics of ``views`` on ``host:port`` (0: any free port)."""
    return MetricsExporter(LogMetrics(views), host, port, auth)
