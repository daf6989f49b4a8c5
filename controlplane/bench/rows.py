"""Rows written per rank per minute: the example trained under the launcher for a while,
against a control plane of its own, and the log's rows counted by type.

What it measures is what heartbeats cost the durable log: with heartbeats as soft state
(NATS core, core/liveness.py) none is a row, and liveness costs a ``liveness.summary`` per
job every ``liveness_summary_interval_s`` (and one before each decision). Rows are counted
from the first ``generation.started`` to the end of the run, per rank of its world.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psycopg

from controlplane.bench.stack import serving, stack

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "train.py"
JOB = "job-rows"


def run_rows_bench(*, seconds: float, nproc: int, policy: str) -> dict[str, Any]:
    """Train ``nproc`` ranks for ``seconds`` after the job starts; count rows by type."""
    with stack() as services, serving(services):
        env = {**os.environ, "ELASTIC_NATS_URL": services.nats_url, "ELASTIC_LOG_LEVEL": "ERROR"}
        command = [
            sys.executable, "-m", "controlplane", "run", "--nproc", str(nproc),
            "--job-id", JOB, "--policy", policy, str(EXAMPLE), "--steps", "10000000",
        ]  # fmt: skip
        proc = subprocess.Popen(command, env=env, cwd=ROOT, stdout=subprocess.DEVNULL)
        try:
            with psycopg.connect(services.database_url, autocommit=True) as conn:
                started = _wait_started(conn, 120)
                time.sleep(seconds)
                ended = conn.execute("SELECT now()").fetchone()
                assert ended is not None
                rows = conn.execute(
                    "SELECT type, count(*) FROM events WHERE job_id = %s AND recorded_at >= %s"
                    " AND recorded_at < %s GROUP BY type ORDER BY type",
                    (JOB, started, ended[0]),
                ).fetchall()
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    minutes = seconds / 60.0
    by_type = {str(kind): int(count) for kind, count in rows}
    total = sum(by_type.values())
    return {
        "seconds": seconds,
        "ranks": nproc,
        "policy": policy,
        "rows": by_type,
        "rows_per_rank_per_minute": round(total / nproc / minutes, 1),
        "by_type_per_rank_per_minute": {
            k: round(v / nproc / minutes, 1) for k, v in by_type.items()
        },
    }


def _wait_started(conn: psycopg.Connection[Any], timeout_s: float) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        row = conn.execute(
            "SELECT min(recorded_at) FROM events WHERE job_id = %s AND type = 'generation.started'",
            (JOB,),
        ).fetchone()
        if row is not None and row[0] is not None:
            return row[0]
        time.sleep(0.2)
    raise TimeoutError("the job did not start")
