"""Container health checks of docker-compose.yml (standard library and psycopg only).

``python deploy/healthcheck.py api``: the API answers ``/healthz`` with 200 (its database
answers too). ``python deploy/healthcheck.py controlplane``: this control plane's metrics
exporter answers (it is alive), and some control plane holds the ingest lock in the database
(one of them leads; a standby is healthy while another leads). Exit status 0 when healthy.
"""

from __future__ import annotations

import json
import os
import sys
import urllib.error
import urllib.request

#: ``controlplane.lock.INGEST_LOCK_KEY``: "elastic" in ASCII (repeated so that this script
#: runs without importing the package; tests/unit/test_deploy.py keeps them equal).
INGEST_LOCK_KEY = 0x656C6173746963
TIMEOUT_S = 3.0


def _get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=TIMEOUT_S) as response:
            return int(response.status), response.read()
    except urllib.error.HTTPError as exc:
        return int(exc.code), b""


def api() -> str | None:
    """None when healthy, else why not."""
    port = os.environ.get("ELASTIC_API_PORT", "8080")
    try:
        status, body = _get(f"http://127.0.0.1:{port}/healthz")
    except OSError as exc:
        return f"the API does not answer on port {port}: {exc}"
    if status != 200:
        return f"/healthz answered {status}: {body[:200]!r}"
    return None if json.loads(body).get("status") == "ok" else f"/healthz: {body[:200]!r}"


def controlplane() -> str | None:
    """None when healthy, else why not."""
    port = os.environ.get("ELASTIC_METRICS_PORT", "0")
    if port not in ("", "0"):
        try:
            status, _ = _get(f"http://127.0.0.1:{port}/metrics")
        except OSError as exc:
            return f"the control plane's exporter does not answer on port {port}: {exc}"
        if status >= 500:
            return f"/metrics answered {status}"
    import psycopg

    url = os.environ.get("ELASTIC_DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/postgres")
    url = url.replace("postgresql+psycopg://", "postgresql://", 1)
    high, low = INGEST_LOCK_KEY >> 32, INGEST_LOCK_KEY & 0xFFFFFFFF
    try:
        with psycopg.connect(url, connect_timeout=int(TIMEOUT_S)) as conn:
            row = conn.execute(
                "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted"
                " AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"
                " AND classid = %s AND objid = %s AND objsubid = 1",
                (high, low),
            ).fetchone()
    except psycopg.Error as exc:
        return f"the database does not answer: {type(exc).__name__}"
    return None if row and row[0] else "no control plane holds the ingest lock yet"


def main(argv: list[str]) -> int:
    checks = {"api": api, "controlplane": controlplane}
    if len(argv) != 2 or argv[1] not in checks:
        print(f"usage: healthcheck.py {'|'.join(checks)}", file=sys.stderr)
        return 2
    why = checks[argv[1]]()
    if why is not None:
        print(f"unhealthy: {why}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
