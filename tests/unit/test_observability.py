"""Prometheus metrics, JSON logs and the Grafana dashboard, checked against what the exporters
really expose:

- the API's metrics and the control plane's exporter (scraped over HTTP) expose exactly the
  families ``METRICS`` declares, with their labels; every counter's samples end in ``_total``;
  the MTTR histogram's buckets start at 10 ms;
- every metric name a query of ``deploy/grafana/elastic.json`` uses is one they expose;
- the control plane counts the dead letters of its appends; ``elastic_leader`` follows it;
- ``ELASTIC_LOG_FORMAT=json`` writes one JSON object a record, with the job, member and
  incident the decider's records concern.
"""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
import urllib.request
from datetime import timedelta
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from controlplane.api.metrics import METRICS, MTTR_BUCKETS, LogMetrics, exporter
from controlplane.core.goodput import GoodputCounter, goodput
from controlplane.core.view import SlowMark
from controlplane.decider import _log_decision
from controlplane.service import Views
from controlplane.store.port import AppendResult
from schemas import logjson
from tests.recorded import final_view, two_incidents

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "elastic.json"


def samples(text: str) -> dict[str, set[frozenset[str]]]:
    """Each sample name exposed -> the label-name sets it comes with."""
    found: dict[str, set[frozenset[str]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            found.setdefault(sample.name, set()).add(frozenset(sample.labels))
    return found


def families(text: str) -> dict[str, str]:
    """Each family exposed (counters under their ``_total`` name) -> its type."""
    out = {}
    for family in text_string_to_metric_families(text):
        if family.name.endswith("_created"):  # prometheus_client's creation times of counters
            continue
        name = family.name + "_total" if family.type == "counter" else family.name
        out[name] = family.type
    return out


def api_scrape() -> str:
    view = final_view()
    counter = GoodputCounter()
    counter.count(two_incidents())
    found = goodput(view, counter, view.registered_at + timedelta(hours=1))
    assert found is not None
    metrics = LogMetrics(lambda: [view], lambda: [found], dead_letters=lambda: 3)
    return metrics.exposition().decode()


def controlplane_scrape(leading: list[bool]) -> str:
    served = exporter(lambda: [final_view()], "127.0.0.1", 0, leader=lambda: leading[0])
    try:
        served.metrics.appended(2)
        with urllib.request.urlopen(f"http://127.0.0.1:{served.port}/metrics", timeout=5) as r:
            return r.read().decode()
    finally:
        served.close()


def test_the_exporters_expose_what_is_declared() -> None:
    api, plane = api_scrape(), controlplane_scrape([True])
    assert families(api) == {
        name: kind for name, (kind, _) in METRICS.items() if name != "elastic_leader"
    }
    goodput_names = {"elastic_job_wall_seconds", "elastic_job_goodput_seconds", "elastic_job_ettr"}
    assert families(plane) == {
        name: kind for name, (kind, _) in METRICS.items() if name not in goodput_names
    }
    for text in (api, plane):
        exposed = samples(text)
        for name, (kind, labels) in METRICS.items():
            if name not in families(text):
                continue
            if kind == "histogram":
                assert exposed[name + "_bucket"] == {frozenset({*labels, "le"})}
                assert exposed[name + "_count"] == {frozenset(labels)}
            elif kind == "counter":
                assert name.endswith("_total") and exposed[name] == {frozenset(labels)}
            else:
                assert exposed[name] == {frozenset(labels)}, name
        # No counter sample without ``_total`` (prometheus_client's ``_created`` aside).
        for family in text_string_to_metric_families(text):
            if family.type == "counter":
                assert {s.name for s in family.samples} <= {
                    family.name + "_total",
                    family.name + "_created",
                }
    assert MTTR_BUCKETS[0] == 0.01 and tuple(sorted(MTTR_BUCKETS)) == MTTR_BUCKETS
    assert re.search(r'^elastic_mttr_seconds_bucket\{job_id="[^"]+",le="0\.01"\} ', api, re.M)
    assert re.search(r"^elastic_dead_letters_total 3\.0$", api, re.M)  # the store's count
    assert re.search(r"^elastic_dead_letters_total 2\.0$", plane, re.M)  # its appends'
    assert re.search(r"^elastic_leader 1\.0$", plane, re.M)
    assert re.search(r"^elastic_leader 0\.0$", controlplane_scrape([False]), re.M)


def test_the_control_plane_counts_the_dead_letters_it_commits() -> None:
    metrics = LogMetrics(lambda: [])
    views = Views(metrics=metrics)
    views.apply(AppendResult(dead_letters=2))
    views.apply(AppendResult(dead_letters=1))
    text = metrics.exposition().decode()
    assert re.search(r"^elastic_dead_letters_total 3\.0$", text, re.M)


def dashboard_exprs() -> list[str]:
    dash = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    for var in dash["templating"]["list"]:
        query = var.get("query")
        if isinstance(query, dict):
            exprs.append(query["query"])
    return exprs


def test_the_dashboard_queries_only_what_is_exposed() -> None:
    exposed = set(samples(api_scrape())) | set(samples(controlplane_scrape([True])))
    exprs = dashboard_exprs()
    used = {name for expr in exprs for name in re.findall(r"\belastic_[a-z_]+\b", expr)}
    assert used, exprs
    assert used <= exposed, used - exposed
    # What the dashboard is for: MTTR quantiles, incidents, ETTR and goodput per job, dead
    # letters, discounted evidence, the leader.
    for needed in ("elastic_mttr_seconds_bucket", "elastic_incidents", "elastic_job_ettr",
                   "elastic_job_goodput_seconds", "elastic_dead_letters_total",
                   "elastic_events_discounted_total", "elastic_leader"):  # fmt: skip
        assert needed in used, needed
    assert any("histogram_quantile" in e for e in exprs)
    # Per-job labels are job_id (``job`` is Prometheus' own target label).
    assert not any(re.search(r"\bjob\s*[=!]~?", e) for e in exprs), exprs


def test_json_records_carry_what_they_concern() -> None:
    formatter = logjson.JsonFormatter()
    log = logging.getLogger("controlplane.test")
    record = log.makeRecord(
        log.name, logging.WARNING, __file__, 1, "lost %d", (3,), None,
        extra=logjson.about(job="j1", member="w0"),
    )  # fmt: skip
    out = json.loads(formatter.format(record))
    assert out["level"] == "WARNING" and out["logger"] == "controlplane.test"
    assert out["message"] == "lost 3" and out["job"] == "j1" and out["member"] == "w0"
    assert "incident" not in out and out["time"].endswith("+00:00")
    with logjson.concerning(job="j2", incident="i9"):
        plain = log.makeRecord(log.name, logging.INFO, __file__, 1, "x", (), None)
        inside = json.loads(formatter.format(plain))
    assert inside["job"] == "j2" and inside["incident"] == "i9"
    outside = json.loads(formatter.format(plain))
    assert "job" not in outside


def test_the_deciders_records_name_the_job_member_and_incident(caplog) -> None:
    decided = [
        e for e in two_incidents() if e.event.type == "fault.detected"
    ]  # fmt: skip
    with caplog.at_level(logging.INFO, logger="controlplane.decider"):
        _log_decision(decided[0])
    [record] = caplog.records
    payload = decided[0].event.payload
    assert record.job == decided[0].event.job_id  # type: ignore[attr-defined]
    assert record.incident == str(payload.incident_id)  # type: ignore[attr-defined]
    line = json.loads(logjson.JsonFormatter().format(record))
    assert line["job"] == decided[0].event.job_id and line["incident"] == str(payload.incident_id)


@pytest.mark.parametrize("fmt", ["json", "text"])
def test_elastic_log_format_configures_the_commands(fmt: str) -> None:
    code = (
        "import logging; from controlplane.cli import _settings; _settings();"
        " from schemas.logjson import about;"
        " logging.getLogger('controlplane.ingest').warning('gap', extra=about(job='j7'))"
    )
    env = {**os.environ, "ELASTIC_LOG_FORMAT": fmt, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    [line] = done.stderr.splitlines()
    if fmt == "json":
        record = json.loads(line)
        assert {k: record[k] for k in ("level", "logger", "message", "job")} == {
            "level": "WARNING", "logger": "controlplane.ingest", "message": "gap", "job": "j7"
        }  # fmt: skip
    else:
        assert line.endswith("WARNING controlplane.ingest: gap")


def test_slow_members_are_counted_by_the_action_taken() -> None:
    view = final_view()
    members = sorted(view.members)
    at = view.registered_at
    view.slow = {
        members[0]: SlowMark(view.generation, 10, at, "ignore", "not worth a recovery"),
        members[1]: SlowMark(view.generation, 11, at, "replace", "worth it"),
        members[2]: SlowMark(view.generation, 12, at, "replace", "worth it"),
    }
    text = LogMetrics(lambda: [view]).exposition().decode()
    job = view.job_id
    assert f'elastic_slow_members{{action="ignore",job_id="{job}"}} 1.0' in text
    assert f'elastic_slow_members{{action="replace",job_id="{job}"}} 2.0' in text
    # An incident kind no job had yet is exposed at zero, the rollbacks' among them.
    assert re.search(rf'^elastic_incidents\{{job_id="{job}",kind="anomaly",outcome="open"\}} 0\.0$',
                     text, re.M)  # fmt: skip
