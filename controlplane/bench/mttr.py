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

``phases_median_s``: the median of each phase of the incidents' timelines
(``controlplane.core.timeline``: detect, decide, ack, restore, resume). ``restore_gbps``: per
incident, the bytes every member of the new world restored (their ``restore.completed``
events) over the longest of their restores' seconds (they restore at once), in GB/s; the
median over the incidents, with ``restore_bytes``.

``example`` (``mlp`` or ``transformer``): ``mlp`` is ``examples/train.py`` (DDP + ZeRO);
``transformer`` is ``examples/transformer.py`` (FSDP2 tinygpt) with ``TRANSFORMER_ARGS``
(``example_args`` replace them): a 2^20-row input embedding of hashed byte trigrams
(``tinygpt.HashedNgrams``, row-sharded over the ranks and never gathered: a step moves only
its lookups' activations) holds nearly all of its 1.1 GB of parameters and AdamW state, and
the head is over the 256 bytes, so a step stays cheap. The baseline has no transformer
version: it is skipped there.

``ELASTIC_BENCH_TRACE=DIR``: the members of each elastic run write the timing marks of their
recoveries under ``DIR/<job>`` (``rank_runtime.trace``), and the result gains ``trace``: per
incident and per role (``spare``: the member that took the lost rank; ``survivor``: the
slowest of the others), the seconds of each timed part, when each part ended after the
incident's fault (``*_at``), and the median of each over the incidents
(``trace_median``).

``security`` (``off``, ``on`` or ``both``): with ``on`` the control plane has an installation
secret (``ELASTIC_SECRET``: an authenticated rendezvous store, signed commands) and the
launcher hands its members the job's secret and the command key, as deployed. ``both`` runs
the elastic job with security on and off, alternating (on, off; then off, on; ...) for
``rounds`` rounds on the same services, and reports each one's MTTR and ``security_ratio``
(median MTTR on over off).
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
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from controlplane.bench import BenchError
from controlplane.bench.stack import Stack, serving, stack
from controlplane.core.fold import fold
from controlplane.core.timeline import PHASES, timeline
from controlplane.core.view import JobView
from controlplane.settings import NATS_URL_ENV
from controlplane.store.postgres import PostgresEventStore
from schemas.auth import (
    COMMAND_KEY_ENV,
    JOB_SECRET_ENV,
    MASTER_SECRET_ENV,
    command_public_key,
    job_secret,
)
from schemas.common import JobState

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
#: A directory: the members' recovery timing marks go there (``rank_runtime.trace``).
TRACE_ENV = "ELASTIC_BENCH_TRACE"
#: The members' variable for it (``rank_runtime.trace.TRACE_DIR_ENV``).
_MEMBER_TRACE_ENV = "ELASTIC_TRACE_DIR"
RANKS = 4
#: The policy of the elastic run: heartbeats every 0.2 s (hangs are not measured here).
POLICY = (
    "redundancy=2,heartbeat_interval_s=0.2,recovery_deadline_s=60,"
    'heartbeat_timeout_s={"init":60,"train":5,"waiting":30,"backup":15,"restore":30}'
)
#: The transformer's: one peer copy of each shard (two of 1.1 GB of state do not fit beside
#: the ranks on a small machine) and the time a model of that size takes to build and step.
TRANSFORMER_POLICY = (
    "redundancy=1,heartbeat_interval_s=0.2,recovery_deadline_s=300,"
    'heartbeat_timeout_s={"init":300,"train":60,"waiting":300,"backup":60,"restore":120}'
)
#: The transformer's model: two blocks of width 88 over bytes, and a 2^20 x 88 row-sharded
#: hashed-trigram embedding (92M parameters; with AdamW's two moments 1.11 GB over the ranks,
#: 277 MB a rank), fused AdamW.
TRANSFORMER_ARGS = (
    "--ngram-rows", "1048576", "--dim", "88", "--layers", "2", "--heads", "4", "--seq", "64",
    "--global-batch", "16", "--fused-adamw",
)  # fmt: skip


@dataclass(frozen=True, slots=True)
class Example:
    """A training script of ``examples/`` the bench runs, with its defaults."""

    script: str
    args: tuple[str, ...]
    policy: str
    faults: int
    backup_interval: int
    timeout_s: float


EXAMPLES_RUN = {
    "mlp": Example("train.py", (), POLICY, faults=5, backup_interval=10, timeout_s=600.0),
    "transformer": Example(
        "transformer.py", TRANSFORMER_ARGS, TRANSFORMER_POLICY, faults=3, backup_interval=10,
        timeout_s=600.0,
    ),
}  # fmt: skip


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
    master: bytes | None = None,
    example: Example = EXAMPLES_RUN["mlp"],
    example_args: Sequence[str] | None = None,
    restores: list[dict[str, Any]] | None = None,
    traces: Path | None = None,
) -> JobView:
    """Run the job with in-process recovery; return its folded view once it completed.
    ``master``: the control plane's installation secret, whose job secret and command key
    the launcher hands the members (None: security off). ``example_args`` replace the
    example's own; ``restores`` (when given) receives the payloads of the job's
    ``restore.completed`` events; ``traces``: a directory the members write their timing
    marks under (``<job>/``)."""
    job_id = f"bench-mttr-{uuid.uuid4().hex[:8]}"
    command = [
        sys.executable, "-m", "controlplane", "run", "--nproc", str(RANKS),
        "--spares", str(len(crashes)), "--nodes", str(RANKS), "--racks", "2",
        "--job-id", job_id, "--policy", f"backup_interval={backup_interval},{example.policy}",
    ]  # fmt: skip
    for step, rank in crashes:
        command += ["--fault", f"crash@{step}:rank={rank}"]
    command += [str(_example(example.script)), "--steps", str(steps)]
    command += list(example.args if example_args is None else example_args)
    env = {**os.environ, NATS_URL_ENV: services.nats_url, "ELASTIC_LOG_LEVEL": "WARNING"}
    for name in (MASTER_SECRET_ENV, JOB_SECRET_ENV, COMMAND_KEY_ENV, _MEMBER_TRACE_ENV):
        env.pop(name, None)
    if traces is not None:
        env[_MEMBER_TRACE_ENV] = str(traces / job_id)
    if master is not None:
        env[JOB_SECRET_ENV] = job_secret(master, job_id).hex()
        env[COMMAND_KEY_ENV] = command_public_key(master).hex()
    _run(command, env, timeout, workdir / f"elastic-{job_id}.log")
    store = PostgresEventStore.from_url(services.database_url)
    try:
        deadline = time.monotonic() + 30
        while True:
            events = list(store.read(job_id=job_id))
            view = fold(None, events)
            if view is not None and view.state in {JobState.COMPLETED, JobState.STOPPED}:
                if restores is not None:
                    restores += restored(events)
                return view
            if time.monotonic() > deadline:
                state = view.state.value if view is not None else "no events"
                raise BenchError(f"job {job_id} did not complete ({state}); see {workdir}")
            time.sleep(0.5)
    finally:
        store.close()


def restored(events: Iterable[Any]) -> list[dict[str, Any]]:
    """The payloads of the ``restore.completed`` events among ``events`` (stored events)."""
    return [
        stored.event.payload.model_dump(mode="json")
        for stored in events
        if stored.event.type == "restore.completed"
    ]


def _restore_rate(incident: Any, restores: list[dict[str, Any]]) -> tuple[int | None, float | None]:
    """(bytes, GB/s) of ``incident``'s restore: what every member of its last decision's world
    restored over the longest member's restore seconds (they restore at once)."""
    decision = incident.decisions[-1] if incident.decisions else None
    if decision is None:
        return None, None
    mine = [r for r in restores if r["generation"] == decision.generation]
    nbytes = sum(int(r["bytes"]) for r in mine)
    seconds = max((float(r["seconds"]) for r in mine), default=0.0)
    return nbytes, (nbytes / seconds / 1e9 if seconds > 0 and nbytes else None)


def elastic_mttr(
    view: JobView, restores: list[dict[str, Any]] | None = None
) -> list[dict[str, Any]]:
    """Each incident's downtime and phases, in order; every one must have recovered. With
    ``restores`` (``restore.completed`` payloads), each one's restored bytes and rate too."""
    out = []
    for incident in view.incidents.values():
        line = timeline(incident)
        if line.outcome != "recovered" or line.downtime_s is None:
            raise BenchError(f"incident {incident.incident_id} ended {line.outcome!r}")
        record: dict[str, Any] = {
            "members": incident.members, "downtime_s": line.downtime_s,
            "steps_lost": line.steps_lost, "phases": line.phases,
        }  # fmt: skip
        fault, first = line.points["fault"], line.points["first_step"]
        if incident.decisions and fault is not None and first is not None:
            record["generation"] = incident.decisions[-1].generation
            record["fault_at"], record["first_step_at"] = fault.at.timestamp(), first.at.timestamp()
        if restores is not None:
            record["restore_bytes"], record["restore_gbps"] = _restore_rate(incident, restores)
        out.append(record)
    return out


def trace_summary(directory: Path, incidents: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per incident, what the members' timing marks under ``directory`` say (the module's
    docstring): for the ``spare`` and the slowest ``survivor``, each part's seconds and when
    it ended after the fault (``<part>_at``), with ``ready_at`` (the state loaded)."""
    marks: dict[str, list[dict[str, Any]]] = {}  # per process
    for path in sorted(directory.glob("*.jsonl")):
        for text in path.read_text().splitlines():
            marks.setdefault(path.stem, []).append(json.loads(text))
    out = []
    for incident in incidents:
        generation, fault = incident.get("generation"), incident.get("fault_at")
        if generation is None or fault is None:
            continue
        end = incident["first_step_at"] + 5.0
        roles: dict[str, list[dict[str, float]]] = {"spare": [], "survivor": []}
        for lines in marks.values():
            mine = [m for m in lines if fault - 1.0 <= m["start"] + m["seconds"] <= end and
                    m["generation"] in (None, generation)]  # fmt: skip
            if not any(m["what"] == "load" and m["generation"] == generation for m in mine):
                continue  # not a member of this incident's new world
            role = "spare" if any(m["what"] == "start.wait" for m in mine) else "survivor"
            parts: dict[str, float] = {}
            for m in mine:
                what = m["what"]
                parts[what] = parts.get(what, 0.0) + m["seconds"]
                parts[f"{what}_at"] = m["start"] + m["seconds"] - fault
            parts["ready_at"] = parts.get("load_at", 0.0)
            roles[role].append(parts)
        summary: dict[str, Any] = {"generation": generation}
        for role, found in roles.items():
            if found:  # the member ready last, for survivors
                summary[role] = max(found, key=lambda p: p["ready_at"])
        out.append(summary)
    return out


def _trace_medians(traced: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """The median of each part over the incidents, per role."""
    medians: dict[str, dict[str, float]] = {}
    for role in ("spare", "survivor"):
        keys = sorted({k for t in traced for k in t.get(role, {})})
        medians[role] = {
            k: statistics.median(t[role][k] for t in traced if k in t.get(role, {})) for k in keys
        }
    return medians


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


#: The installation secret of a run with security on (fixed: a benchmark, not a deployment).
BENCH_SECRET = bytes(range(32))
SECURITY = ("off", "on", "both")


def _summary(incidents: list[dict[str, Any]], crashes: list[tuple[int, int]]) -> dict[str, Any]:
    mttr = [i["downtime_s"] for i in incidents]
    if len(mttr) != len(crashes):
        raise BenchError(f"{len(crashes)} faults injected, {len(mttr)} incidents recorded")
    summary: dict[str, Any] = {
        "faults": len(crashes),
        "recovered": len(mttr),
        "mttr_median_s": statistics.median(mttr),
        "mttr_p90_s": _percentile(mttr, 0.9),
        "mttr_s": mttr,
        "phases_median_s": _phase_medians(incidents),
        "steps_lost": [i["steps_lost"] for i in incidents],
    }
    rates = [i["restore_gbps"] for i in incidents if i.get("restore_gbps") is not None]
    if rates:
        summary["restore_gbps"] = statistics.median(rates)
        summary["restore_bytes"] = statistics.median(
            i["restore_bytes"] for i in incidents if i.get("restore_gbps") is not None
        )
    return summary


def _phase_medians(incidents: list[dict[str, Any]]) -> dict[str, float | None]:
    """The median of each timeline phase over ``incidents`` (None: a phase none reached)."""
    phases: dict[str, float | None] = {}
    for phase in PHASES:
        values = [i["phases"][phase] for i in incidents if i["phases"].get(phase) is not None]
        phases[phase] = statistics.median(values) if values else None
    return phases


def _modes(security: str, rounds: int) -> list[bool]:
    """Security on (True) or off for each elastic run, in order."""
    if security == "on":
        return [True] * rounds
    if security == "off":
        return [False] * rounds
    return [m for r in range(rounds) for m in ((True, False) if r % 2 == 0 else (False, True))]


def run_mttr_bench(
    *,
    faults: int | None = None,
    backup_interval: int | None = None,
    baseline: bool = True,
    security: str = "off",
    rounds: int = 1,
    example: str = "mlp",
    example_args: Sequence[str] | None = None,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Run both and summarise (see the module docstring). ``faults`` and
    ``backup_interval`` default to the example's."""
    if security not in SECURITY:
        raise BenchError(f"security is one of {', '.join(SECURITY)}, not {security!r}")
    if example not in EXAMPLES_RUN:
        raise BenchError(f"example is one of {', '.join(EXAMPLES_RUN)}, not {example!r}")
    chosen = EXAMPLES_RUN[example]
    faults = chosen.faults if faults is None else faults
    backup_interval = chosen.backup_interval if backup_interval is None else backup_interval
    say = progress or (lambda _message: None)
    if baseline and example != "mlp":
        say(f"baseline: skipped (the torchrun baseline trains the mlp, not the {example})")
        baseline = False
    crashes = schedule(faults, backup_interval)
    steps = crashes[-1][0] + 2 * backup_interval
    with tempfile.TemporaryDirectory(prefix="elastic-bench-mttr-") as tmp:
        workdir = Path(tmp)
        runs: dict[bool, list[dict[str, Any]]] = {True: [], False: []}
        elastic_seconds = 0.0
        trace_dir = Path(os.environ[TRACE_ENV]) if os.environ.get(TRACE_ENV) else None
        traced: list[dict[str, Any]] = []
        with stack() as services:
            for secured in _modes(security, max(1, rounds)):
                label = "on" if secured else "off"
                # Any free port: another control plane on this machine may hold 29400.
                env = {"ELASTIC_RENDEZVOUS_PORT": "0"}
                if secured:
                    env[MASTER_SECRET_ENV] = BENCH_SECRET.hex()
                with serving(services, **env):
                    say(f"elastic (security {label}): {RANKS} ranks + {faults} spares,"
                        f" {steps} steps, kills at {crashes}")  # fmt: skip
                    started = time.monotonic()
                    restores: list[dict[str, Any]] = []
                    view = elastic_run(
                        services, crashes, steps=steps, backup_interval=backup_interval,
                        workdir=workdir, master=BENCH_SECRET if secured else None,
                        timeout=chosen.timeout_s, example=chosen, example_args=example_args,
                        restores=restores, traces=trace_dir,
                    )  # fmt: skip
                    elastic_seconds += time.monotonic() - started
                incidents = elastic_mttr(view, restores)
                if trace_dir is not None:
                    traced += trace_summary(trace_dir / view.job_id, incidents)
                _summary(incidents, crashes)
                runs[secured] += incidents
                say(f"elastic (security {label}): downtimes"
                    f" {[round(i['downtime_s'], 3) for i in incidents]}")  # fmt: skip
        main = runs[True] if security == "on" else runs[False] if security == "off" else runs[True]
        result: dict[str, Any] = {
            **_summary(main, crashes * (len(main) // len(crashes))),
            "faults": len(crashes),
            "security": security,
            "example": example,
            "example_args": list(chosen.args if example_args is None else example_args),
            "elastic_run_s": elastic_seconds,
            "ranks": RANKS,
            "steps": steps,
            "backup_interval": backup_interval,
        }
        if trace_dir is not None:
            result |= {"trace": traced, "trace_median": _trace_medians(traced)}
        if security == "both":
            on, off = (_summary(runs[m], crashes * max(1, rounds)) for m in (True, False))
            ratio = on["mttr_median_s"] / off["mttr_median_s"]
            result |= {
                "security_on": on,
                "security_off": off,
                "rounds": max(1, rounds),
                "security_ratio": ratio,
                "security_within_10pct": abs(ratio - 1.0) <= 0.10,
            }
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
                "ratio": result["mttr_median_s"] / statistics.median(base),
            }
    return result
