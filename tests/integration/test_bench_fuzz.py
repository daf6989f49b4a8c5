"""``elasticctl bench fuzz`` on a short run: every case stored or dead-lettered, serve up,
no stall, and the job training alongside completes."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from controlplane.bench.fuzz import Generator
from controlplane.decode import decode
from controlplane.store.postgres import encode_row
from schemas.events import EnvelopeBase

pytestmark = pytest.mark.services


def test_bench_fuzz_accounts_for_every_case_while_a_job_trains():
    env = {k: v for k, v in os.environ.items()
           if k not in {"ELASTIC_NATS_URL", "ELASTIC_DATABASE_URL"}}  # fmt: skip
    done = subprocess.run(
        [sys.executable, "-m", "controlplane", "bench", "fuzz", "--cases", "500",
         "--steps", "60", "--seed", "1", "--json"],
        env={**env, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    out = json.loads(done.stdout)
    assert out["cases"] == 500 and out["refused_by_nats"] == 0
    assert out["stored"] + out["dead_lettered"] == 500
    assert out["unaccounted"] == 0
    assert out["crashes"] == 0
    assert out["stalls"] == 0 and out["max_commit_gap_s"] <= 2.0
    assert out["job_completed"] is True
    assert out["stored"] > 0 and out["dead_lettered"] > 0
    assert "generating 500 fuzz cases" in done.stderr  # progress goes to stderr
    # Every mutation was tried.
    assert {"nul", "int", "utf8", "subject", "truncate", "random"} <= set(out["kinds"])


def test_the_generator_makes_valid_cases_that_decode_and_mutated_ones_that_do_not_crash():
    cases = Generator(seed=3, run="t").cases(2000)
    valid = [c for c in cases if c.kind == "valid"]
    assert valid and len(valid) < len(cases)
    for case in cases:
        decoded = decode(case.subject.decode(errors="backslashreplace"), case.data, 1)
        if case.kind == "valid":
            assert isinstance(decoded, EnvelopeBase), decoded
        if isinstance(decoded, EnvelopeBase):
            assert decoded.event_id == case.event_id
            encode_row(decoded)  # what the store would COPY
    assert len({c.event_id for c in cases}) == len(cases)
