"""``elasticctl storage``: the log's size on disk and each job's part of it, by event type."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from controlplane.store.postgres import PostgresEventStore
from tests.factories import Events

pytestmark = pytest.mark.services


def fill(store: PostgresEventStore) -> None:
    small, big = Events("job-small"), Events("job-big")
    events = [small.joined("m0", incarnation="inc1")]
    events += [big.joined(f"m{i}", incarnation="inc1") for i in range(3)]
    step = {"loss": 1.0, "step_seconds": 0.1, "samples": 4}
    events += [big.make("train.step", {**step, "step": s}, source="n0/m0") for s in range(1, 201)]
    store.append(events)


def test_each_job_s_rows_and_share_of_the_table_by_type(pg_store: PostgresEventStore) -> None:
    fill(pg_store)
    found = pg_store.storage()
    jobs = {j.job_id: j for j in found.jobs}
    assert set(jobs) == {"job-small", "job-big"}
    big, small = jobs["job-big"], jobs["job-small"]
    assert (big.events, small.events) == (203, 1)
    assert big.by_type["train.step"][0] == 200 and big.by_type["member.joined"][0] == 3
    assert big.row_bytes == sum(b for _, b in big.by_type.values()) > 200 * 100
    assert small.row_bytes > 0 and big.first_at <= big.last_at
    # The table with its indexes is split in proportion to the rows.
    assert found.events_total_bytes >= found.events_table_bytes + found.events_index_bytes > 0
    shares = found.share_bytes(big) + found.share_bytes(small)
    assert abs(shares - found.events_total_bytes) <= 1
    assert found.share_bytes(big) > 100 * found.share_bytes(small)


def test_the_command_reports_a_job_and_refuses_an_unknown_one(
    pg_store: PostgresEventStore, database_url: str
) -> None:
    fill(pg_store)
    env = {**os.environ, "ELASTIC_DATABASE_URL": database_url}
    command = [sys.executable, "-m", "controlplane", "storage"]
    done = subprocess.run([*command, "--job", "job-big", "--json"], env=env,
                          capture_output=True, text=True, timeout=60, check=True)  # fmt: skip
    report = json.loads(done.stdout)
    [job] = report["jobs"]
    assert job["job_id"] == "job-big" and job["events"] == 203
    assert next(iter(job["by_type"])) == "train.step"  # the largest first
    assert job["by_type"]["train.step"]["events"] == 200
    assert 0 < job["share_bytes"] <= report["events_total_bytes"]
    text = subprocess.run(command, env=env, capture_output=True, text=True, timeout=60,
                          check=True).stdout  # fmt: skip
    assert "job-small: 1 events" in text and "job-big: 203 events" in text
    refused = subprocess.run([*command, "--job", "nope"], env=env, capture_output=True,
                             text=True, timeout=60)  # fmt: skip
    assert refused.returncode == 1 and "no job 'nope'" in refused.stderr
