"""``elasticctl demo`` end to end, as a newcomer runs it: its own embedded NATS and PostgreSQL,
the control plane, the API, 4 ranks and a spare, a crash and a hang; then nothing left behind.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from datetime import datetime
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parents[2]
#: The installed command, as a newcomer types it (else the same entry point through -m).
_SCRIPT = Path(sys.executable).with_name("elasticctl")
ELASTICCTL = [str(_SCRIPT)] if _SCRIPT.exists() else [sys.executable, "-m", "controlplane"]
#: Shorter than the defaults; the faults still land after a backup and on different ranks.
SHORT = ["--steps", "40", "--crash-at", "15", "--hang-at", "28", "--backup-interval", "10"]


def demo(tmp_path: Path, *args: str) -> tuple[subprocess.Popen[bytes], Path]:
    """Start ``elasticctl demo`` in a session of its own (as a shell runs it in the
    foreground), on embedded services whatever the environment says."""
    env = {
        k: v for k, v in os.environ.items() if k not in ("ELASTIC_NATS_URL", "ELASTIC_DATABASE_URL")
    }
    stderr = tmp_path / "demo.err"
    with stderr.open("wb") as err, (tmp_path / "demo.out").open("wb") as out:
        proc = subprocess.Popen(
            [*ELASTICCTL, "demo", "--plain", *args],
            stdout=out,
            stderr=err,
            env=env,
            cwd=ROOT,
            start_new_session=True,
        )
    return proc, stderr


class Family:
    """Every process descended from ``pid`` seen while it ran (sampled), for the check that
    none outlives it. Servers that daemonize (the postmaster) are found by the state
    directory on their command line instead."""

    def __init__(self, pid: int) -> None:
        self.root = psutil.Process(pid)
        self.seen: dict[int, psutil.Process] = {}
        self.cmdlines: dict[int, str] = {}
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        while not self._done.is_set():
            try:
                for child in self.root.children(recursive=True):
                    self.seen.setdefault(child.pid, child)
                    with suppress(psutil.Error):  # again each time: a fork execs later
                        if cmdline := child.cmdline():  # a zombie's reads empty: keep the last
                            self.cmdlines[child.pid] = " ".join(cmdline)
            except psutil.Error:
                return
            self._done.wait(0.2)

    def names(self) -> set[str]:
        """The command lines seen."""
        return set(self.cmdlines.values())

    def close(self) -> None:
        self._done.set()
        self._thread.join(5)


def alive(proc: psutil.Process) -> bool:
    try:
        return bool(proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE)
    except psutil.Error:
        return False


def leftovers(family: Family, state_dir: Path) -> list[str]:
    """What still runs of the demo: its sampled descendants, anything naming its state dir."""
    found = {p.pid: p for p in family.seen.values() if alive(p)}
    for proc in psutil.process_iter(["cmdline"]):
        if any(str(state_dir) in part for part in proc.info["cmdline"] or []) and alive(proc):
            found[proc.pid] = proc
    out = []
    for pid, proc in found.items():
        with suppress(psutil.Error):
            out.append(f"{pid}: {' '.join(proc.cmdline())}")
    return out


@contextmanager
def reaped(proc: subprocess.Popen[bytes]) -> Iterator[None]:
    """Never leave the demo itself behind, whatever the test found."""
    try:
        yield
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.fixture
def state() -> Iterator[Path]:
    """A state directory for the demo to create (and remove). Not under pytest's tmp_path:
    another pytest session may make that private again (0700) while the demo runs, and the
    embedded PostgreSQL runs as its own user when the tests run as root."""
    parent = Path(tempfile.mkdtemp(prefix="elastic-demo-test-"))
    try:
        yield parent / "state"
    finally:
        shutil.rmtree(parent, ignore_errors=True)


def ettr_of(log: str) -> float:
    """Productive time over wall time, read from a JSONL export: wall from job.registered to
    the job's end; productive, each generation's step records from the first beyond the
    highest step an older generation reported (or its first) to its last, less every
    incident's window (its earliest evidence to its new generation's first step beyond the
    restore step). Backup copies are left in (the caller bounds their share)."""

    def at(text: str) -> datetime:
        return datetime.fromisoformat(text)

    events = sorted(
        (json.loads(line) for line in log.splitlines() if line), key=lambda e: e["position"]
    )
    start = next(at(e["recorded_at"]) for e in events if e["type"] == "job.registered")
    end = min(
        at(e["recorded_at"])
        for e in events
        if e["type"] in ("job.completed", "job.stopped")
        or (e["type"] == "job.state_changed" and e["payload"]["to"] in ("COMPLETED", "STOPPED"))
    )
    steps: dict[int, list[tuple[int, datetime]]] = {}
    for e in events:
        if e["type"] == "train.step":
            records = steps.setdefault(e["generation"], [])
            if not records or e["payload"]["step"] > records[-1][0]:
                records.append((e["payload"]["step"], at(e["recorded_at"])))
    windows = []
    for e in events:
        if e["type"] != "fault.detected":
            continue
        incident = e["payload"]["incident_id"]
        cited = [
            at(x["at"])
            for d in events
            if d["type"] == "fault.detected" and d["payload"]["incident_id"] == incident
            for x in d["payload"]["evidence"]
            if x.get("at")
        ]
        opened = min([at(e["recorded_at"]), *cited])
        last = [
            d
            for d in events
            if d["type"] == "reallocation.issued" and d["payload"]["incident_id"] == incident
        ][-1]["payload"]
        first = next(t for s, t in steps.get(last["generation"], []) if s > last["restore_step"])
        if not any(w[0] == opened for w in windows):
            windows.append((opened, first))
    productive = 0.0
    for generation, records in steps.items():
        high = max((r[-1][0] for g, r in steps.items() if g < generation), default=None)
        below = [t for s, t in records if high is not None and s <= high]
        lo, hi = (below[-1] if below else records[0][1]), records[-1][1]
        if hi <= lo:
            continue
        length = (hi - lo).total_seconds()
        for a, b in windows:
            overlap = (min(b, hi) - max(a, lo)).total_seconds()
            length -= max(0.0, overlap)
        productive += length
    return productive / (end - start).total_seconds()


def check_metrics(scrapes: dict, summary: dict, incidents: tuple[dict, ...]) -> None:
    """The final scrapes of the API's and the control plane's ``/metrics``, after the demo's
    faults: the names and labels declared, the job's recoveries in the MTTR histogram (each in
    the bucket its downtime falls in), and the crash's below 1 s."""
    from prometheus_client.parser import text_string_to_metric_families

    from controlplane.api.metrics import METRICS, MTTR_BUCKETS

    job = summary["job_id"]
    downtimes = [i["downtime_s"] for i in incidents]
    for source in ("api", "controlplane"):
        text = scrapes[source]
        assert text, (source, scrapes)
        values: dict[tuple[str, frozenset], float] = {}
        labels: dict[str, set[frozenset[str]]] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                values[sample.name, frozenset(sample.labels.items())] = sample.value
                labels.setdefault(sample.name, set()).add(frozenset(sample.labels))
        for name, (kind, names) in METRICS.items():
            if source == "api" and name == "elastic_leader":
                continue
            if source == "controlplane" and name.startswith("elastic_job_"):
                continue
            exposed = name + "_count" if kind == "histogram" else name
            assert labels.get(exposed) == {frozenset(names)}, (source, name, labels.get(exposed))

        def at(name: str, values: dict = values, **label: str) -> float:
            return values[name, frozenset(label.items())]

        assert at("elastic_incidents", job_id=job, outcome="recovered", kind="fault") == 2
        assert at("elastic_incidents", job_id=job, outcome="open", kind="fault") == 0
        assert at("elastic_mttr_seconds_count", job_id=job) == 2
        assert at("elastic_mttr_seconds_sum", job_id=job) == pytest.approx(sum(downtimes), abs=0.01)
        for bound in MTTR_BUCKETS:
            # Rounded to 1 ms in the summary: a downtime within 1 ms of a bound is not checked.
            if all(abs(d - bound) > 0.001 for d in downtimes):
                below = sum(d <= bound for d in downtimes)
                assert at("elastic_mttr_seconds_bucket", job_id=job, le=repr(bound)) == below
        # The crash (a replacement from a hot backup, no detection delay) is resolved below
        # 1 s; the hang's downtime holds the heartbeat timeout it was found by.
        crash = incidents[0]["downtime_s"]
        assert crash < 1.0, incidents[0]
        under = min(b for b in MTTR_BUCKETS if b >= crash + 0.001)
        assert under < 1.0 and at("elastic_mttr_seconds_bucket", job_id=job, le=repr(under)) >= 1
        assert at("elastic_events_discounted_total", job_id=job, reason="stale_exit") >= 0
        assert at("elastic_dead_letters_total") >= 0
        assert at("elastic_events_ingested_total") > 0
    assert "elastic_leader 1.0" in scrapes["controlplane"]  # it held the ingest lock
    ettr = float(
        next(
            line.split()[-1]
            for line in scrapes["api"].splitlines()
            if line.startswith(f'elastic_job_ettr{{job_id="{job}"}}')
        )
    )
    assert ettr == pytest.approx(summary["ettr"], rel=0.01)


def check_counterfactual(exported: Path, job: str, hang: dict) -> None:  # type: ignore[type-arg]
    """The demo's log replayed under a 10 s heartbeat timeout (the demo's is 5 s): the hang
    is found by that timeout about 10 s after w2's last heartbeat and costs about 10 s. The
    launcher's fencing exit of w2 and the collective errors it released in the survivors
    answer the recorded decision, and move with the counterfactual's, which comes later."""
    from typer.testing import CliRunner

    from controlplane.cli import app

    args = ["replay", str(exported), "--job", job, "--policy", "heartbeat_timeout=10", "--json"]
    replayed = CliRunner().invoke(app, args)
    assert replayed.exit_code == 0, replayed.output
    out = json.loads(replayed.stdout)
    print("counterfactual notes:", *out["notes"], sep="\n  ")
    _, pair = out["incidents"]
    ours = pair["counterfactual"]
    assert ours["reasons"][0] == "heartbeat_timeout", pair
    silent = datetime.fromisoformat(ours["detected_at"]) - datetime.fromisoformat(ours["fault_at"])
    assert 10 <= silent.total_seconds() < 10.5, pair
    assert 10 <= ours["downtime_s"] < hang["downtime_s"] + 6, pair
    assert any("fencing exit" in note for note in out["notes"]), out["notes"]


def completed_demo(tmp_path: Path, *args: str) -> tuple[dict, str, Family]:  # type: ignore[type-arg]
    """Run ``elasticctl demo *args`` (with ``--json``) to its end, exit status 0: its summary,
    its progress lines, and the processes it ran."""
    proc, stderr = demo(tmp_path, *args)
    family = Family(proc.pid)
    with reaped(proc):
        proc.wait(timeout=400)
    family.close()
    log = stderr.read_text()
    print(log)
    assert proc.returncode == 0, log[-3000:]
    [line] = (tmp_path / "demo.out").read_text().splitlines()  # one JSON object, no more
    summary = json.loads(line)
    print(json.dumps(summary, indent=1))
    return summary, log, family


@pytest.mark.timeout(420)
def test_demo_recovers_every_fault_and_ends_at_the_reference_loss(tmp_path, state):
    started = time.monotonic()
    exported = tmp_path / "demo.jsonl"
    scraped = tmp_path / "metrics.json"
    proc, stderr = demo(tmp_path, "--json", "--state-dir", str(state), "--export", str(exported),
                        "--metrics-out", str(scraped), *SHORT)  # fmt: skip
    family = Family(proc.pid)
    with reaped(proc):
        proc.wait(timeout=400)
    family.close()
    out = (tmp_path / "demo.out").read_text()
    wall = time.monotonic() - started
    log = stderr.read_text()
    print(log)
    assert proc.returncode == 0, log[-3000:]
    [line] = out.splitlines()  # one JSON object, nothing else on stdout
    summary = json.loads(line)
    print(f"demo wall time {wall:.1f}s:", json.dumps(summary, indent=1))

    assert summary["faults_injected"] == ["crash@15:rank=1", "hang@28:rank=2"]
    assert summary["recovered"] is True
    assert summary["job_state"] == "COMPLETED" and summary["completed_step"] == 40
    crash, hang = summary["incidents"]
    assert crash["fault"] == "crash@15:rank=1" and hang["fault"] == "hang@28:rank=2"
    assert "heartbeat_timeout" in hang["detected_by"]
    assert crash["mode"] == "replace"  # the spare takes the crashed rank ...
    assert hang["mode"] == "shrink"  # ... and the world shrinks to 3 after the hang
    for incident in (crash, hang):
        assert incident["outcome"] == "recovered", incident
        for key in ("detect_s", "decide_s", "ack_s", "restore_s", "resume_s", "downtime_s"):
            assert incident[key] is not None and incident[key] >= 0, (key, incident)
        assert 0 < incident["downtime_s"] < 60, incident
        assert incident["steps_lost"] is not None and incident["steps_lost"] <= 10, incident
    assert crash["restore_step"] == 10 and hang["restore_step"] == 20

    final, reference = summary["final_loss"], summary["reference_loss"]
    assert final is not None and reference is not None
    assert abs(final - reference) <= 1e-3 * abs(reference), (final, reference)
    assert summary["loss_ok"] is True
    assert summary["reference"]["job_id"] and summary["reference"]["what"]
    if summary["api_url"]:
        assert summary["timeline_url"] == f"{summary['api_url']}/ui/jobs/{summary['job_id']}"
    else:
        assert summary["api_note"]

    # Goodput: every second of the job's wall time in one term; the ETTR recomputed from the
    # exported log by this test's own reading of the definitions agrees within 1%.
    breakdown = summary["goodput"]
    assert summary["ettr"] == breakdown["ettr"] and 0 < summary["ettr"] < 1
    assert sum(breakdown["seconds"].values()) == pytest.approx(breakdown["wall_s"], rel=1e-4)
    assert breakdown["productive_steps"] == 40
    assert breakdown["recomputed_steps"] == sum(i["steps_lost"] for i in (crash, hang))
    assert [i["steps_lost"] for i in breakdown["incidents"]] == [
        crash["steps_lost"],
        hang["steps_lost"],
    ]
    for incident, line in zip(breakdown["incidents"], (crash, hang), strict=True):
        assert sum(incident["phases"].values()) == pytest.approx(line["downtime_s"], abs=2e-3)
    # The backup copies of this small model are short; the test's own reading leaves them in
    # its productive time, so it lies between the ETTR and the ETTR with every backup second
    # added back (a demo's ETTR is a few percent: its backup copies are not negligible beside it).
    seconds, wall = breakdown["seconds"], breakdown["wall_s"]
    # A small share of the wall time (a few milliseconds a backup: 0.1-0.2% on an idle
    # machine, more on a busy one; the bracket below is the check).
    assert seconds["backup"] < 0.02 * wall, (seconds, wall)
    ettr = ettr_of(exported.read_text())
    ceiling = (seconds["productive"] + seconds["backup"]) / wall
    assert summary["ettr"] * 0.99 <= ettr <= ceiling * 1.01, (ettr, summary["ettr"], ceiling)

    check_metrics(json.loads(scraped.read_text()), summary, (crash, hang))
    check_counterfactual(exported, summary["job_id"], hang)

    kinds = " ".join(family.names())
    assert "nats-server" in kinds and "examples/train.py" in kinds, kinds
    assert leftovers(family, state) == []
    assert not state.exists()  # the state directory goes with the stack


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("sig", "when"),
    [(signal.SIGINT, "training"), (signal.SIGTERM, "starting")],
    ids=["ctrl-c-while-training", "sigterm-while-starting"],
)
def test_a_signal_at_any_point_stops_everything(tmp_path, state, sig, when):
    # Long enough that the signal surely comes before the end.
    proc, stderr = demo(tmp_path, "--state-dir", str(state), "--steps", "100000",
                        "--crash-at", "0", "--hang-at", "0", "--no-reference")  # fmt: skip
    family = Family(proc.pid)
    with reaped(proc):
        deadline = time.monotonic() + 240
        marker = "demo: job demo-" if when == "training" else "starting NATS"
        while not any(
            marker in line and ("is RUNNING" in line or when == "starting")
            for line in stderr.read_text().splitlines()
        ):
            assert proc.poll() is None, stderr.read_text()
            assert time.monotonic() < deadline, stderr.read_text()
            time.sleep(0.2)
        if when == "training":
            time.sleep(1.0)  # well into the steps
            assert any("train.py" in n for n in family.names()), family.names()
        # A terminal's Ctrl-C goes to the foreground process group: the demo's.
        os.killpg(proc.pid, sig)
        stopped = time.monotonic()
        proc.wait(90)
        took = time.monotonic() - stopped
    family.close()
    log = stderr.read_text()
    print(f"stopped {took:.1f}s after {sig.name}:\n{log[-2000:]}")
    assert proc.returncode == 128 + sig, log[-3000:]
    assert f"{sig.name} received" in log
    assert leftovers(family, state) == []
    assert not state.exists()


@pytest.mark.timeout(420)
def test_a_nan_rolls_the_same_world_back_and_ends_at_a_reference_skipping_its_batch(
    tmp_path, state
):
    summary, log, family = completed_demo(
        tmp_path, "--json", "--state-dir", str(state), "--steps", "40", "--backup-interval",
        "10", "--crash-at", "0", "--hang-at", "0", "--nan-at", "25", "--nan-rank", "1",
    )  # fmt: skip

    assert summary["faults_injected"] == ["nan@25:rank=1"]
    assert summary["recovered"] is True
    assert summary["job_state"] == "COMPLETED" and summary["completed_step"] == 40
    [anomaly] = summary["incidents"]
    assert anomaly["kind"] == "anomaly" and anomaly["fault"] == "nan@25:rank=1"
    assert anomaly["detected_by"] == ["non_finite_loss"] and anomaly["anomaly_step"] == 25
    # The same world rolled back to the backup before the NaN, its batch skipped.
    assert anomaly["mode"] == "rollback" and anomaly["restore_step"] == 20
    assert anomaly["skipped_steps"] == [25]
    assert anomaly["outcome"] == "recovered"
    assert anomaly["downtime_s"] is not None and 0 < anomaly["downtime_s"] < 60, anomaly
    assert anomaly["steps_lost"] is not None and anomaly["steps_lost"] <= 10, anomaly
    assert "loss anomaly at step 25" in log and "rollback" in log  # the live lines say it

    # The reference skipped the same batch: the final losses agree.
    assert summary["reference"]["skip_steps"] == [25]
    final, reference = summary["final_loss"], summary["reference_loss"]
    assert final is not None and reference is not None
    assert abs(final - reference) <= 1e-3 * abs(reference), (final, reference)
    assert summary["loss_ok"] is True
    assert leftovers(family, state) == []
    assert not state.exists()


@pytest.mark.timeout(420)
def test_the_demo_on_a_nats_cluster_goes_on_with_the_events_leader_killed(tmp_path, state):
    """``--nats-cluster 3 --nats-kill-at``: three nats-servers, the streams at R3; the node
    leading the events stream killed mid-run, the faults around it: both recovered, the run
    completed on the other two nodes, and nothing left behind."""
    summary, log, family = completed_demo(
        tmp_path, "--json", "--state-dir", str(state), "--no-reference", "--nats-cluster", "3",
        "--nats-kill-at", "20", *SHORT,
    )  # fmt: skip
    assert summary["recovered"] is True
    assert summary["job_state"] == "COMPLETED" and summary["completed_step"] == 40
    nats = summary["nats"]
    assert nats["nodes"] == 3 and nats["killed"]["led"] == "ELASTIC_EVENTS"
    assert 20 <= nats["killed"]["after_step"] < 40  # (the demo polls the log: a few steps late)
    assert "a JetStream cluster of 3, streams at R3" in log
    assert f"killed NATS node {nats['killed']['node']}" in log
    crash, hang = summary["incidents"]
    assert crash["outcome"] == hang["outcome"] == "recovered", summary["incidents"]
    assert sum("nats-server" in name for name in family.names()) >= 3
    assert leftovers(family, state) == []
    assert not state.exists()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("point", ["record", "publish"])
def test_the_standby_finishes_a_recovery_whose_leader_exited_mid_decision(tmp_path, state, point):
    """``--control-plane-exit``: the leading control plane exits (as a kill would) once it has
    recorded the crash's decision (its commands unpublished), or once JetStream acknowledged
    them (no member acked yet); the standby takes the lock and the rendezvous port, sends
    what the log says is owed, and both faults recover by the one decision each, the log
    holding every member's events once."""
    summary, log, family = completed_demo(
        tmp_path, "--json", "--state-dir", str(state), "--no-reference",
        "--control-plane-exit", point, *SHORT,
    )  # fmt: skip
    assert summary["recovered"] is True
    assert summary["job_state"] == "COMPLETED" and summary["completed_step"] == 40
    assert summary["control_plane"] == {
        "standby": True,
        "exited": {"point": point, "generation": 2,
                   "seen_after_step": summary["control_plane"]["exited"]["seen_after_step"]},
    }  # fmt: skip
    assert "the standby takes over" in log
    crash, hang = summary["incidents"]
    assert crash["decisions"] == hang["decisions"] == 1, summary["incidents"]
    assert crash["mode"] == "replace" and crash["outcome"] == hang["outcome"] == "recovered"
    audit = summary["log"]
    assert audit["whole"] and audit["missing"] == audit["duplicated"] == 0 and audit["events"]
    assert sum(line.endswith("controlplane serve") for line in family.cmdlines.values()) == 2
    assert leftovers(family, state) == []
