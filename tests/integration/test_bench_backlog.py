"""``elasticctl bench backlog`` on a small job: each backup stored whole, in parts, and
folded the same both ways."""

from __future__ import annotations

import asyncio
import gc

import pytest

from controlplane.bench.backlog import _run

pytestmark = pytest.mark.services


@pytest.mark.parametrize("collect", [True, False])
def test_bench_backlog_times_each_step_of_a_backups_ingest(database_url, collect):
    out = asyncio.run(_run(database_url, ranks=32, backups=2, part=8, collect=collect))
    assert gc.isenabled()
    # Each part of 8 reports is one catalog; both backups are complete.
    assert out["rows_per_backup"] == 4
    assert out["complete_backup"] == 20
    for phase in ("decode", "encode", "append", "fold", "fold_as_events"):
        assert out[f"{phase}_ms"] >= 0 and len(out["per_backup_ms"][phase]) == 2
