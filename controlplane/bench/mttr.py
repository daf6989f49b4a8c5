"""``elasticctl bench mttr``: time to recover from a killed rank, in-process vs. restart-all.

Both runs train the same model (``examples/train.py``'s) on the same steps, 4 ranks on gloo,
and lose the same ranks at the same steps (SIGKILL of itself, after the step):

- **elastic**: the launcher runs the job with one warm spare per fault against a real control
  plane (``elasticctl serve``, its own process) over NATS and PostgreSQL. MTTR of a fault is
  its incident's downtime as the log records it: from the recorded exit (the launcher reports
  it within ~20 ms of the kill) to the first step the new generation completed.
- **baseline**, torchrun-style: ``torchrun --max-restarts`` runs ``examples/train_torchrun.py``,
  which checkpoints with ``torch.save`` to disk at the same interval. On a death every worker
  is stopped and restarted; each new process imports torch, joins the group, loads the newest
  checkpoint and goes on. MTTR of a fault: from the crashing rank's last clock reading before
  SIGKILL to the first step completed after the restart. torchrun polls its workers every
  0.1 s (``--monitor-interval``), so its detection is as quick as the launcher's.

``ratio`` is ``mttr_median_s / baseline_median_s``, both measured in this one run.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from controlplane.bench import BenchError
from controlplane.bench.stack import Stack, serving, stack
from controlplane.core.fold import fold
from controlplane.core.timeline import timeline
from controlplane.core.view import JobView
from controlplane.settings import NATS_URL_ENV
from controlplane.store.postgres import PostgresEventStore
from schemas.common import JobState

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
RANKS = 4
#: The policy of the elastic run: heartbeats every 0.2 s (hangs are not measured here).
POLICY = (
    "redundancy=2,heartbeat_interval_s=0.2,recovery_deadline_s=60,"
    'heartbeat_timeout_s={"init":60,"train":5,"waiting":30,"backup":15,"restore":30}'
)


def schedule(faults: int, backup_interval: int) -> list[tuple[int, int]]:
    """(step, rank) of each fault: half way between backups, every other interval, each
    rank in turn (rank 0 included)."""
    return [
        (backup_interval * (2 + 2 * i) + backup_interval // 2, (i + 1) % RANKS)
        for i in range(faults)
    ]


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))
    return ordered[index]


def _example(name: str) -> Path:
    path = EXAMPLES / name
    if not path.is_file():
        raise BenchError(f"{path} is missing: run the benchmark from a source checkout")
    return path


def _run(command: list[str], env: dict[str, str], timeout: float, log: Path) -> int:
    with log.open("wb") as out:
        process = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT)
        try:
            return process.wait(timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
            raise BenchError(f"{' '.join(command[1:4])} ran past {timeout:g}s; see {log}") from None


def elastic_run(
    services: Stack,
    crashes: list[tuple[int, int]],
    *,
    steps: int,
    backup_interval: int,
    workdir: Path,
    timeout: float = 600.0,
) -> JobView:
    """Run the job with in-process recovery; return its folded view once it completed."""
    job_id = f"bench-mttr-{uuid.uuid4().hex[:8]}"
    command = [
        sys.executable, "-m", "controlplane", "run", "--nproc", str(RANKS),
        "--spares", str(len(crashes)), "--nodes", str(RANKS), "--racks", "2",
        "--job-id", job_id, "--policy", f"backup_interval={backup_interval},{POLICY}",
    ]  # fmt: skip
    for step, rank in crashes:
        command += ["--fault", f"crash@{step}:rank={rank}"]
    command += [str(_example("train.py")), "--steps", str(steps)]
    env = {**os.environ, NATS_URL_ENV: services.nats_url, "ELASTIC_LOG_LEVEL": "WARNING"}
    _run(command, env, timeout, workdir / "elastic.log")
    store = PostgresEventStore.from_url(services.database_url)
    try:
        deadline = time.monotonic() + 30
        while True:
            view = fold(None, store.read(job_id=job_id))
            if view is not None and view.state in {JobState.COMPLETED, JobState.STOPPED}:
                return view
            if time.monotonic() > deadline:
                state = view.state.value if view is not None else "no events"
                raise BenchError(f"job {job_id} did not complete ({state}); see {workdir}")
            time.sleep(0.5)
    finally:
        store.close()


def elastic_mttr(view: JobView) -> list[dict[str, Any]]:
    """Each incident's downtime and phases, in order; every one must have recovered."""
    out = []
    for incident in view.incidents.values():
        line = timeline(incident)
        if line.outcome != "recovered" or line.downtime_s is None:
            raise BenchError(f"incident {incident.incident_id} ended {line.outcome!r}")
        out.append(
            {"members": incident.members, "downtime_s": line.downtime_s,
             "steps_lost": line.steps_lost, "phases": line.phases}
        )  # fmt: skip
    return out


def baseline_run(
    crashes: list[tuple[int, int]],
    *,
    steps: int,
    backup_interval: int,
    workdir: Path,
    timeout: float = 900.0,
) -> list[float]:
    """Run the torchrun baseline; return each fault's kill-to-first-step seconds."""
    timing = workdir / "baseline.jsonl"
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(RANKS),
        "--max-restarts", str(len(crashes)), "--monitor-interval", "0.1", "--standalone",
        str(_example("train_torchrun.py")), "--steps", str(steps),
        "--checkpoint-dir", str(workdir / "checkpoints"),
        "--checkpoint-every", str(backup_interval), "--timing", str(timing),
    ]  # fmt: skip
    for step, rank in crashes:
        command += ["--crash", f"{step}:{rank}"]
    code = _run(command, {**os.environ}, timeout, workdir / "baseline.log")
    if code != 0:
        raise BenchError(f"the torchrun baseline failed ({code}); see {workdir}/baseline.log")
    records = [json.loads(line) for line in timing.read_text().splitlines()]
    seconds = []
    for kill in (r for r in records if "crash" in r):
        after = [r for r in records if "step" in r and r["restart"] == kill["restart"] + 1]
        if not after:
            raise BenchError(f"no step after the restart that followed {kill}")
        seconds.append(after[0]["t"] - kill["t"])
    return seconds


def run_mttr_bench(
    *,
    faults: int = 5,
    backup_interval: int = 10,
    baseline: bool = True,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Run both and summarise (see the module docstring)."""
    say = progress or (lambda _message: None)
    crashes = schedule(faults, backup_interval)
    steps = crashes[-1][0] + 2 * backup_interval
    with tempfile.TemporaryDirectory(prefix="elastic-bench-mttr-") as tmp:
        workdir = Path(tmp)
        with stack() as services, serving(services):
            say(f"elastic: {RANKS} ranks + {faults} spares, {steps} steps, kills at {crashes}")
            started = time.monotonic()
            view = elastic_run(
                services, crashes, steps=steps, backup_interval=backup_interval, workdir=workdir
            )
            elastic_seconds = time.monotonic() - started
        incidents = elastic_mttr(view)
        mttr = [i["downtime_s"] for i in incidents]
        say(f"elastic: {len(mttr)} recoveries, downtimes {[round(m, 2) for m in mttr]}")
        result: dict[str, Any] = {
            "faults": len(crashes),
            "recovered": len(mttr),
            "mttr_median_s": statistics.median(mttr),
            "mttr_p90_s": _percentile(mttr, 0.9),
            "mttr_s": mttr,
            "phases_median_s": {
                phase: statistics.median(i["phases"][phase] for i in incidents)
                for phase in incidents[0]["phases"]
            },
            "steps_lost": [i["steps_lost"] for i in incidents],
            "elastic_run_s": elastic_seconds,
            "ranks": RANKS,
            "steps": steps,
            "backup_interval": backup_interval,
        }
        if len(mttr) != len(crashes):
            raise BenchError(f"{len(crashes)} faults injected, {len(mttr)} incidents recorded")
        if baseline:
            say("baseline: torchrun --max-restarts, torch.save checkpoints")
            started = time.monotonic()
            base = baseline_run(
                crashes, steps=steps, backup_interval=backup_interval, workdir=workdir
            )
            say(f"baseline: restarts took {[round(b, 2) for b in base]}")
            result |= {
                "baseline_median_s": statistics.median(base),
                "baseline_p90_s": _percentile(base, 0.9),
                "baseline_s": base,
                "baseline_run_s": time.monotonic() - started,
                "ratio": statistics.median(mttr) / statistics.median(base),
            }
    return result
