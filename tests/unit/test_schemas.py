"""Wire contracts: every event round-trips, and the envelope and payloads are strict."""

from __future__ import annotations

import json
import uuid
from datetime import UTC, datetime
from typing import Any

import pytest
from pydantic import ValidationError
from typer.testing import CliRunner

from controlplane.cli import app
from schemas.catalog import CatalogColumns, encode
from schemas.commands import COMMAND_ADAPTER, Reallocate, Stop
from schemas.common import MAX_TEXT, MAX_WORLD, JobState, Phase
from schemas.events import (
    CONTROLPLANE_EVENT_TYPES,
    EVENT_ADAPTER,
    MEMBER_EVENT_TYPES,
    SCHEMA_VERSIONS,
    EnvelopeBase,
    JobPolicy,
    JobStateChanged,
)
from schemas.export import export_json_schemas, json_schemas
from tests.factories import MEMBER_JOINED

ALL_TYPES = {**MEMBER_EVENT_TYPES, **CONTROLPLANE_EVENT_TYPES}

UUID_A = "0b8f3c1e-4a2d-4f6b-9c1d-2e3f4a5b6c7d"
UUID_B = "1c9e4d2f-5b3e-4a7c-8d2e-3f4a5b6c7d8e"

#: The smallest valid payload of every event type.
MINIMAL_PAYLOADS: dict[str, dict[str, Any]] = {
    "member.joined": dict(MEMBER_JOINED),
    "member.heartbeat": {"step": 0, "phase": "train"},
    "train.step": {"step": 1, "loss": 0.5, "step_seconds": 0.1, "samples": 32},
    "backup.snapshot": {
        "step": 1,
        "shard": 0,
        "nbytes": 10,
        "checksum": "crc32:deadbeef",
        "seconds": 0.1,
    },
    "backup.replicated": {
        "step": 1,
        "shard": 0,
        "owner": "m1",
        "nbytes": 10,
        "checksum": "crc32:deadbeef",
        "seconds": 0.1,
    },
    "checkpoint.saved": {
        "step": 10,
        "shard": 0,
        "shards": 4,
        "path": "/ckpt/step-10/shard-0.pt",
        "nbytes": 10,
        "checksum": "crc32:deadbeef",
        "seconds": 0.1,
    },
    "member.fault": {"kind": "oom"},
    "member.exited": {"member": "m0"},
    "member.launched": {"member": "m0", "role": "spare", "pid": 1},
    "command.acked": {"command_id": UUID_A},
    "command.refused": {"subject": "elastic.cmd.job1.all", "reason": "unsigned"},
    "restore.completed": {"generation": 1, "step": 1, "bytes": 0, "seconds": 0.0},
    "train.resumed": {"generation": 1, "step": 1},
    "train.completed": {"step": 1},
    "train.anomaly": {"step": 3, "kind": "non_finite_loss"},
    "anomaly.detected": {
        "incident_id": UUID_A,
        "kind": "non_finite_loss",
        "step": 3,
        "detail": "non_finite_loss at step 3 on m0",
    },
    "job.registered": {},
    "generation.started": {"generation": 0, "world": ["m0"], "rendezvous": "h0:29500"},
    "fault.detected": {
        "incident_id": UUID_A,
        "members": ["m0"],
        "reason": "exited",
        "detail": "exit code 1",
    },
    "member.slow": {
        "member": "m1",
        "rank": 1,
        "compute_s": 0.15,
        "baseline_s": 0.1,
        "mad_s": 0.0,
        "threshold_s": 0.12,
        "peers": 3,
        "window_s": 20.0,
        "evidence": {"member": "m1", "what": "liveness.summary", "position": 7},
        "action": "replace",
        "projected_loss_s": 200.0,
        "recovery_cost_s": 30.0,
        "reason": "m1 computes 0.150s a step against the job's 0.100s",
    },
    "job.state_changed": {"from": "RUNNING", "to": "DEGRADED", "reason": "member lost"},
    "reallocation.issued": {
        "incident_id": UUID_A,
        "command_id": UUID_B,
        "generation": 1,
        "mode": "replace",
        "world": ["m0", "m1"],
        "restore_step": 0,
        "rendezvous": "h0:29500",
        "reason": "replace m2",
    },
    "incident.resolved": {"incident_id": UUID_A, "downtime_s": 1.5, "steps_lost": 0},
    "job.stopped": {"reason": "operator"},
    "job.completed": {},
    "liveness.summary": {"reason": "interval", "at": "2026-01-01T00:00:00+00:00"},
    "backup.catalog": {
        "step": 10,
        "count": 1,
        "packed": encode(
            CatalogColumns(["n0/m0"], ["i1"], [3], [0], [64], ["sha256:ab"], [0.01], [["m1"]])
        ),
    },
}

#: Payloads with every optional field set, to round-trip nested models too.
FULL_PAYLOADS: dict[str, dict[str, Any]] = {
    "job.registered": {
        "name": "llama",
        "policy": {
            "min_world": 2,
            "max_world": 8,
            "heartbeat_interval_s": 0.5,
            "heartbeat_timeout_s": {"train": 3.0, "init": 20.0},
            "backup_interval": 5,
            "redundancy": 1,
            "recovery_deadline_s": 30.0,
            "checkpoint_every": 4,
        },
    },
    "member.fault": {
        "kind": "collective_error",
        "detail": "NCCL timeout",
        "step": 12,
        "suspects": ["m1", "m2"],
    },
    "member.exited": {"member": "m0", "exit_code": -9, "signal": 9},
    "restore.completed": {
        "generation": 2,
        "step": 10,
        "bytes": 1024,
        "seconds": 0.25,
        "sources": {"0": "m0", "1": "m3"},
    },
    "train.completed": {"step": 100, "loss": 0.01},
    "generation.started": {
        "generation": 3,
        "world": ["m0", "m1"],
        "rendezvous": "h0:29500",
        "placement": [
            ["m1"],
            ["m0"],
        ],
        "placement_note": "one rack only",
    },
    "fault.detected": {
        "incident_id": UUID_A,
        "members": ["m0", "m1"],
        "reason": "heartbeat_timeout",
        "detail": "no heartbeat for 5s",
        "evidence": [
            {"member": "m0", "what": "last heartbeat", "position": 7, "at": "2026-01-01T00:00:05Z"},
            {"member": "m1", "what": "reported"},
        ],
    },
    "reallocation.issued": {
        "incident_id": UUID_A,
        "command_id": UUID_B,
        "generation": 1,
        "mode": "shrink",
        "world": ["m0"],
        "restore_step": 10,
        "restore_from": "checkpoint",
        "plan": ["m0"],
        "rendezvous": "h0:29500",
        "reason": "shrink",
        "skip": [[5, 5], [12, 14]],
    },
    "train.anomaly": {"step": 12, "kind": "non_finite_grad_norm", "detail": "grad_norm=inf"},
    "anomaly.detected": {
        "incident_id": UUID_A,
        "kind": "loss_spike",
        "step": 40,
        "members": [],
        "detail": "loss 9.5 at step 40 above 2.1",
        "evidence": [{"member": "m0", "what": "train.step", "position": 80}],
        "loss": 9.5,
        "threshold": 2.1,
    },
    "incident.resolved": {
        "incident_id": UUID_A,
        "phases": {"detect": 0.5, "restore": 1.0},
        "downtime_s": 1.5,
        "steps_lost": 3,
    },
    "job.completed": {"step": 100},
    "liveness.summary": {
        "reason": "decision",
        "since": "2026-01-01T00:00:00+00:00",
        "at": "2026-01-01T00:00:10+00:00",
        "part": 1,
        "parts": 1,
        "members": [
            {
                "member": "m0",
                "node": "n0",
                "incarnation": "i1",
                "generation": 1,
                "last_at": "2026-01-01T00:00:09.750000+00:00",
                "assumed": False,
                "first_at": "2026-01-01T00:00:00.250000+00:00",
                "beats": 39,
                "max_gap_s": 0.5,
                "max_gap_at": "2026-01-01T00:00:03+00:00",
                "phase": "train",
                "step": 12,
            }
        ],
    },
}


def envelope(type_: str, payload: dict[str, Any] | None = None, **over: Any) -> dict[str, Any]:
    """A valid envelope dict (JSON-ready) of ``type_``."""
    source = "controlplane" if type_ in CONTROLPLANE_EVENT_TYPES else "n0/m0"
    env = {
        "event_id": str(uuid.uuid4()),
        "job_id": "job1",
        "type": type_,
        "v": max(SCHEMA_VERSIONS[type_]),
        "source": source,
        "incarnation": "inc1",
        "seq": 1,
        "generation": 0,
        "emitted_at": "2026-01-01T00:00:00Z",
        "payload": MINIMAL_PAYLOADS[type_] if payload is None else payload,
    }
    env.update(over)
    return env


def validate(env: dict[str, Any]) -> EnvelopeBase:
    return EVENT_ADAPTER.validate_json(json.dumps(env).encode())


def rejected(env: dict[str, Any]) -> ValidationError:
    with pytest.raises(ValidationError) as info:
        validate(env)
    return info.value


def heartbeat(**over: Any) -> dict[str, Any]:
    return envelope("member.heartbeat", **over)


# --------------------------------------------------------------------------- catalog


def test_catalog_is_covered_and_disjoint():
    assert set(MINIMAL_PAYLOADS) == set(ALL_TYPES)
    assert not set(MEMBER_EVENT_TYPES) & set(CONTROLPLANE_EVENT_TYPES)
    assert set(SCHEMA_VERSIONS) == set(ALL_TYPES)
    # Every type is at version 1 but the catalog, at 2 (packed); logs still hold its 1.
    assert {t: v for t, v in SCHEMA_VERSIONS.items() if v != frozenset({1})} == {
        "backup.catalog": frozenset({1, 2})
    }
    assert set(FULL_PAYLOADS) <= set(ALL_TYPES)


@pytest.mark.parametrize("type_", sorted(ALL_TYPES))
def test_every_event_type_round_trips(type_: str):
    event = validate(envelope(type_))
    assert isinstance(event, EnvelopeBase)
    assert event.type == type_
    assert type(event).__name__.endswith("Event")
    assert isinstance(event.payload, ALL_TYPES[type_])
    again = EVENT_ADAPTER.validate_json(event.model_dump_json())
    assert type(again) is type(event)
    assert again == event
    # and through Python objects (strict mode accepts the model's own dump)
    assert EVENT_ADAPTER.validate_python(event.model_dump()) == event


@pytest.mark.parametrize("type_", sorted(FULL_PAYLOADS))
def test_full_payloads_round_trip(type_: str):
    event = validate(envelope(type_, FULL_PAYLOADS[type_]))
    assert isinstance(event.payload, ALL_TYPES[type_])
    again = EVENT_ADAPTER.validate_json(event.model_dump_json())
    assert again == event
    assert json.loads(again.model_dump_json()) == json.loads(event.model_dump_json())


def test_envelope_fields_are_parsed():
    event = validate(heartbeat(seq=7, generation=3, incarnation="run-2"))
    assert event.seq == 7
    assert event.generation == 3
    assert event.incarnation == "run-2"
    assert event.emitted_at == datetime(2026, 1, 1, tzinfo=UTC)
    assert event.payload.phase is Phase.TRAIN
    assert event.member == "m0"


def test_member_property_is_none_for_the_control_plane():
    event = validate(envelope("job.registered"))
    assert event.source == "controlplane"
    assert event.member is None


def test_job_registered_defaults_a_policy():
    event = validate(envelope("job.registered"))
    assert event.payload.name == ""
    assert event.payload.policy == JobPolicy()
    assert event.payload.policy.heartbeat_timeout_s[Phase.TRAIN] == 5.0


def test_events_are_frozen():
    event = validate(heartbeat())
    with pytest.raises(ValidationError):
        event.seq = 2  # type: ignore[misc]
    with pytest.raises(ValidationError):
        event.payload.step = 3  # type: ignore[misc]


def test_event_with_offset_timezone_is_accepted():
    event = validate(heartbeat(emitted_at="2026-01-01T02:00:00+02:00"))
    assert event.emitted_at == datetime(2026, 1, 1, tzinfo=UTC)


# --------------------------------------------------------------------------- strictness


def test_unknown_envelope_field_rejected():
    err = rejected(heartbeat(extra=1))
    assert any(e["type"] == "extra_forbidden" for e in err.errors())


def test_unknown_payload_field_rejected():
    err = rejected(heartbeat(payload={"step": 0, "phase": "train", "rank": 3}))
    assert any(e["type"] == "extra_forbidden" for e in err.errors())


@pytest.mark.parametrize("field", ["event_id", "job_id", "source", "seq", "payload", "emitted_at"])
def test_missing_envelope_field_rejected(field: str):
    env = heartbeat()
    del env[field]
    rejected(env)


@pytest.mark.parametrize("seq", ["1", 1.0, True, None, 0, -1])
def test_bad_seq_rejected(seq: Any):
    rejected(heartbeat(seq=seq))


@pytest.mark.parametrize("generation", ["0", -1, 0.5, None])
def test_bad_generation_rejected(generation: Any):
    rejected(heartbeat(generation=generation))


def test_negative_step_rejected():
    rejected(heartbeat(payload={"step": -1, "phase": "train"}))
    rejected(envelope("train.step", {**MINIMAL_PAYLOADS["train.step"], "step": -1}))
    rejected(envelope("member.fault", {"kind": "oom", "step": -1}))


def test_unknown_enum_value_rejected():
    rejected(heartbeat(payload={"step": 0, "phase": "dancing"}))
    rejected(envelope("member.fault", {"kind": "cosmic_ray"}))


@pytest.mark.parametrize(
    "job_id", ["a.b", "a b", "", "-job", "job*", "job>", "job1\n", "j" * 65, "jöb"]
)
def test_bad_job_id_rejected(job_id: str):
    rejected(heartbeat(job_id=job_id))


def test_longest_identifier_accepted():
    assert validate(heartbeat(job_id="j" * 64, incarnation="i" * 64)).job_id == "j" * 64


@pytest.mark.parametrize(
    "source",
    [
        "n.0/m0",
        "n 0/m0",
        "n0/m.0",
        "n0/m 0",
        "n0",
        "n0/",
        "/m0",
        "n0/m0/x",
        "controlplane/",
        "Controlplane ",
        "n0/m0\n",
        "",
    ],
)
def test_bad_source_rejected(source: str):
    rejected(heartbeat(source=source))


@pytest.mark.parametrize("incarnation", ["a.b", "a b", ""])
def test_bad_incarnation_rejected(incarnation: str):
    rejected(heartbeat(incarnation=incarnation))


@pytest.mark.parametrize(
    "event_id",
    [
        "0B8F3C1E-4A2D-4F6B-9C1D-2E3F4A5B6C7D",  # uppercase
        "0b8f3c1e4a2d4f6b9c1d2e3f4a5b6c7d",  # no hyphens
        "{0b8f3c1e-4a2d-4f6b-9c1d-2e3f4a5b6c7d}",
        "0b8f3c1e-4a2d-4f6b-9c1d-2e3f4a5b6c7",
        "0b8f3c1e-4a2d-4f6b-9c1d-2e3f4a5b6c7d\n",
        "not-a-uuid",
    ],
)
def test_event_id_must_be_canonical_uuid(event_id: str):
    rejected(heartbeat(event_id=event_id))


def test_canonical_event_id_accepted():
    assert validate(heartbeat(event_id=UUID_A)).event_id == UUID_A


@pytest.mark.parametrize("at", ["2026-01-01T00:00:00", "2026-01-01", "yesterday", 1767225600])
def test_naive_or_bad_datetime_rejected(at: Any):
    rejected(heartbeat(emitted_at=at))


def test_naive_datetime_rejected_in_python_mode_too():
    env = heartbeat(emitted_at=datetime(2026, 1, 1))
    with pytest.raises(ValidationError):
        EVENT_ADAPTER.validate_python(env, strict=False)


@pytest.mark.parametrize("loss", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_loss_rejected(loss: float):
    step = envelope("train.step", {**MINIMAL_PAYLOADS["train.step"], "loss": loss})
    with pytest.raises(ValidationError):
        EVENT_ADAPTER.validate_python(step, strict=False)
    done = envelope("train.completed", {"step": 1, "loss": loss})
    with pytest.raises(ValidationError):
        EVENT_ADAPTER.validate_python(done, strict=False)


@pytest.mark.parametrize("literal", [b"NaN", b"Infinity", b"-Infinity"])
def test_non_finite_loss_rejected_from_json(literal: bytes):
    raw = json.dumps(envelope("train.step")).encode().replace(b'"loss": 0.5', b'"loss": ' + literal)
    assert literal in raw
    with pytest.raises(ValidationError):
        EVENT_ADAPTER.validate_json(raw)


@pytest.mark.parametrize("bad", [-0.1, float("nan"), float("inf")])
def test_negative_or_non_finite_seconds_rejected(bad: float):
    env = envelope("train.step", {**MINIMAL_PAYLOADS["train.step"], "step_seconds": bad})
    with pytest.raises(ValidationError):
        EVENT_ADAPTER.validate_python(env, strict=False)


def test_member_fault_detail_length_limit():
    ok = validate(envelope("member.fault", {"kind": "exception", "detail": "x" * MAX_TEXT}))
    assert len(ok.payload.detail) == MAX_TEXT
    rejected(envelope("member.fault", {"kind": "exception", "detail": "x" * (MAX_TEXT + 1)}))


def test_suspects_are_identifiers_and_bounded():
    rejected(envelope("member.fault", {"kind": "oom", "suspects": ["m.1"]}))
    rejected(envelope("member.fault", {"kind": "oom", "suspects": [f"m{i}" for i in range(65)]}))


def test_checksum_format():
    snap = MINIMAL_PAYLOADS["backup.snapshot"]
    for bad in ["deadbeef", "CRC32:deadbeef", "crc32:DEADBEEF", "crc32:", "crc32:xyz"]:
        rejected(envelope("backup.snapshot", {**snap, "checksum": bad}))


def test_a_member_reports_no_loss_spike():
    rejected(envelope("train.anomaly", {"step": 3, "kind": "loss_spike"}))


def test_anomaly_policy_fields_are_bounded():
    assert JobPolicy().anomaly_action == "rollback" and JobPolicy().anomaly_skip_steps == 1
    assert JobPolicy().loss_spike_k == 0  # spikes are looked for only when asked
    for bad in (
        {"anomaly_action": "ignore"},
        {"anomaly_skip_steps": -1},
        {"max_rollbacks": -1},
        {"loss_spike_k": -1.0},
        {"loss_spike_window": 2},
    ):
        with pytest.raises(ValidationError):
            JobPolicy.model_validate(bad, strict=False)


def test_fault_detected_needs_a_member():
    rejected(envelope("fault.detected", {**MINIMAL_PAYLOADS["fault.detected"], "members": []}))


def test_exit_signal_range():
    assert validate(envelope("member.exited", {"member": "m0", "signal": 64})).payload.signal == 64
    rejected(envelope("member.exited", {"member": "m0", "signal": 0}))
    rejected(envelope("member.exited", {"member": "m0", "signal": 65}))


def test_command_acked_needs_a_uuid():
    rejected(envelope("command.acked", {"command_id": "not-a-uuid"}))


def test_unknown_type_and_version_rejected():
    rejected(heartbeat(type="member.dance"))
    rejected(heartbeat(v=2))
    rejected(heartbeat(v="1"))


def test_payload_of_another_type_rejected():
    rejected(envelope("member.heartbeat", MINIMAL_PAYLOADS["train.step"]))


# --------------------------------------------------------------------------- job.state_changed


def test_state_changed_uses_from_alias():
    event = validate(envelope("job.state_changed"))
    assert isinstance(event.payload, JobStateChanged)
    assert event.payload.from_ is JobState.RUNNING
    assert event.payload.to is JobState.DEGRADED
    dumped = json.loads(event.model_dump_json())
    assert dumped["payload"]["from"] == "RUNNING"
    assert "from_" not in dumped["payload"]
    assert event.model_dump()["payload"]["from"] == JobState.RUNNING


def test_state_changed_rejects_unknown_state():
    rejected(envelope("job.state_changed", {"from": "NAPPING", "to": "RUNNING", "reason": "x"}))


# --------------------------------------------------------------------------- JobPolicy


def test_job_policy_rejects_min_above_max():
    with pytest.raises(ValidationError, match="min_world"):
        JobPolicy(min_world=5, max_world=4)
    assert JobPolicy(min_world=4, max_world=4).min_world == 4


def test_job_policy_rejected_inside_an_event():
    payload = {"policy": {"min_world": 3, "max_world": 2}}
    rejected(envelope("job.registered", payload))


@pytest.mark.parametrize(
    "over",
    [
        {"min_world": 0},
        {"max_world": MAX_WORLD + 1},
        {"heartbeat_interval_s": 0.0},
        {"heartbeat_timeout_s": {"train": 0.0}},
        {"heartbeat_timeout_s": {"sleeping": 1.0}},
        {"backup_interval": 0},
        {"redundancy": 9},
        {"redundancy": -1},
        {"recovery_deadline_s": -1.0},
        {"checkpoint_every": -1},
        {"surprise": 1},
    ],
)
def test_job_policy_bounds(over: dict[str, Any]):
    with pytest.raises(ValidationError):
        JobPolicy.model_validate(over, strict=False)


def test_job_policy_max_world_limit_accepted():
    assert JobPolicy(max_world=MAX_WORLD).max_world == MAX_WORLD


# --------------------------------------------------------------------------- commands


def reallocate() -> Reallocate:
    return Reallocate.model_validate(
        {
            "command_id": UUID_A,
            "job_id": "job1",
            "decision_position": 42,
            "issued_at": "2026-01-01T00:00:00Z",
            "incident_id": UUID_B,
            "generation": 2,
            "mode": "replace",
            "world": ["m0", "m1"],
            "restore_step": 10,
            "restore_from": "memory",
            "plan": ["m1"],
            "placement": [["m1"]],
            "rendezvous": "h0:29500",
        },
        strict=False,
    )


def stop() -> Stop:
    return Stop.model_validate(
        {
            "command_id": UUID_A,
            "job_id": "job1",
            "decision_position": 7,
            "issued_at": "2026-01-01T00:00:00Z",
            "reason": "no spare left",
        },
        strict=False,
    )


@pytest.mark.parametrize("make", [reallocate, stop])
def test_command_round_trips(make):
    command = make()
    raw = command.model_dump_json()
    assert json.loads(raw)["kind"] == command.kind
    again = COMMAND_ADAPTER.validate_json(raw)
    assert type(again) is type(command)
    assert again == command


def test_command_discriminator():
    assert reallocate().kind == "reallocate"
    assert stop().kind == "stop"
    raw = json.loads(stop().model_dump_json())
    with pytest.raises(ValidationError):
        COMMAND_ADAPTER.validate_json(json.dumps({**raw, "kind": "explode"}))
    del raw["kind"]
    with pytest.raises(ValidationError):
        COMMAND_ADAPTER.validate_json(json.dumps(raw))


def test_command_rejects_unknown_field():
    raw = json.loads(stop().model_dump_json())
    with pytest.raises(ValidationError):
        COMMAND_ADAPTER.validate_json(json.dumps({**raw, "force": True}))


def test_stop_command_as_reallocate_rejected():
    raw = json.loads(stop().model_dump_json())
    with pytest.raises(ValidationError):
        COMMAND_ADAPTER.validate_json(json.dumps({**raw, "kind": "reallocate"}))


# --------------------------------------------------------------------------- JSON Schema


def test_export_json_schemas(tmp_path):
    target = tmp_path / "nested" / "dir"
    written = export_json_schemas(target)
    names = {p.name for p in written}
    assert names == {"event.schema.json", "command.schema.json"}
    for path in written:
        assert path.parent == target
        assert isinstance(json.loads(path.read_text()), dict)
    event_text = (target / "event.schema.json").read_text()
    for type_ in ALL_TYPES:
        assert f'"{type_}"' in event_text, type_
    assert '"from"' in event_text  # the alias, not the Python name
    assert '"from_"' not in event_text
    command_text = (target / "command.schema.json").read_text()
    assert '"reallocate"' in command_text
    assert '"stop"' in command_text


def test_export_is_idempotent(tmp_path):
    export_json_schemas(tmp_path)
    first = {p.name: p.read_text() for p in tmp_path.iterdir()}
    export_json_schemas(tmp_path)
    assert {p.name: p.read_text() for p in tmp_path.iterdir()} == first


def test_json_schemas_match_the_files(tmp_path):
    export_json_schemas(tmp_path)
    for name, schema in json_schemas().items():
        assert json.loads((tmp_path / name).read_text()) == schema


def test_cli_schemas_export(tmp_path):
    result = CliRunner().invoke(app, ["schemas", "export", str(tmp_path)])
    assert result.exit_code == 0, result.output
    for name in ("event.schema.json", "command.schema.json"):
        assert (tmp_path / name).is_file()
        assert str(tmp_path / name) in result.output
        assert isinstance(json.loads((tmp_path / name).read_text()), dict)


def test_cli_schemas_export_needs_a_directory():
    result = CliRunner().invoke(app, ["schemas", "export"])
    assert result.exit_code != 0


def test_event_ids_are_time_ordered_uuid7_in_canonical_form() -> None:
    from pydantic import TypeAdapter

    from schemas.common import EventId
    from schemas.ids import new_event_id, uuid7

    canonical = TypeAdapter(EventId)
    ms = 1_767_225_600_000  # 2026-01-01T00:00:00Z
    ids = [uuid7(ms + i, (i * 0x9E3779B97F4A7C15) % (1 << 74)) for i in range(1000)]
    assert ids == sorted(ids)  # text order is time order: inserts share the index's right edge
    for text in [*ids[:50], new_event_id()]:
        value = uuid.UUID(canonical.validate_python(text))
        assert (value.version, value.variant) == (7, uuid.RFC_4122)
        assert str(value) == text
    assert uuid.UUID(ids[0]).int >> 80 == ms  # the first 48 bits are the time in milliseconds
    for rand in (0, (1 << 74) - 1, 0x2AA_AAAA_AAAA_AAAA_AAAA):  # all 74 random bits are kept
        value = uuid.UUID(uuid7(ms, rand)).int
        assert ((value >> 64) & 0xFFF, value & ((1 << 62) - 1)) == (rand >> 62, rand % (1 << 62))
    assert len({new_event_id() for _ in range(1000)}) == 1000


# --------------------------------------------------------------------------- storable (issue 20)
#
# What PostgreSQL cannot store is refused by the schemas, with a reason naming the field: a NUL
# in text (``text`` and ``jsonb`` refuse it), integers outside int64 (``bigint`` columns; jsonb
# numbers are held to it too), non-finite floats, instants no reader can load.

INT64_MAX = 2**63 - 1


def _reason(env: dict[str, Any]) -> str:
    from controlplane.decode import explain

    return explain(rejected(env))


@pytest.mark.parametrize(
    ("type_", "field"),
    [
        ("member.fault", "detail"),
        ("member.joined", "host"),
        ("member.joined", "device"),
        ("member.joined", "backup_endpoint"),
        ("checkpoint.saved", "path"),
        ("job.registered", "name"),
        ("job.stopped", "reason"),
        ("job.state_changed", "reason"),
    ],
)
def test_a_nul_in_any_text_field_is_refused_with_its_field(type_: str, field: str):
    payload = {**FULL_PAYLOADS.get(type_, MINIMAL_PAYLOADS[type_])}
    payload[field] = "bad\u0000nul"
    reason = _reason(envelope(type_, payload))
    assert f"at payload.{field}:" in reason and "NUL character" in reason, reason
    payload[field] = "bad nul"
    validate(envelope(type_, payload))


def test_a_nul_in_a_dict_key_is_refused():
    payload = {"generation": 1, "step": 1, "bytes": 0, "seconds": 0.0, "sources": {"0\u0000": "m0"}}
    assert "NUL character" in _reason(envelope("restore.completed", payload))
    phases = {**FULL_PAYLOADS["incident.resolved"], "phases": {"detect\u0000": 1.0}}
    assert "NUL character" in _reason(envelope("incident.resolved", phases))


def test_a_lone_surrogate_is_refused_from_json_and_from_python():
    data = json.dumps(envelope("member.fault", {"kind": "oom", "detail": "x"})).encode()
    with pytest.raises(ValidationError) as info:
        EVENT_ADAPTER.validate_json(data.replace(b'"x"', b'"\\ud800"'))
    assert info.value.errors()[0]["type"] == "json_invalid"
    env = envelope("member.fault", {"kind": "oom", "detail": "\ud800"})
    with pytest.raises(ValidationError) as info:
        EVENT_ADAPTER.validate_python(env, strict=False)
    from controlplane.decode import explain

    assert "lone surrogate" in explain(info.value)


@pytest.mark.parametrize("field", ["seq", "generation"])
def test_envelope_integers_beyond_int64_are_refused(field: str):
    assert getattr(validate(heartbeat(**{field: INT64_MAX})), field) == INT64_MAX
    for bad in (INT64_MAX + 1, 2**64, 10**30):
        reason = _reason(heartbeat(**{field: bad}))
        assert reason.startswith(f"schema violation at {field}:") and "int64" in reason, reason


@pytest.mark.parametrize(
    ("type_", "field"),
    [
        ("member.heartbeat", "step"),
        ("train.step", "samples"),
        ("backup.snapshot", "nbytes"),
        ("backup.snapshot", "shard"),
        ("backup.replicated", "nbytes"),
        ("member.joined", "pid"),
        ("member.exited", "exit_code"),
        ("restore.completed", "bytes"),
        ("restore.completed", "generation"),
        ("train.resumed", "step"),
        ("incident.resolved", "steps_lost"),
    ],
)
def test_payload_integers_beyond_int64_are_refused(type_: str, field: str):
    payload = {**FULL_PAYLOADS.get(type_, MINIMAL_PAYLOADS[type_])}
    payload[field] = INT64_MAX
    validate(envelope(type_, payload))
    payload[field] = INT64_MAX + 1
    reason = _reason(envelope(type_, payload))
    assert f"at payload.{field}:" in reason and "int64" in reason, reason


def test_exit_code_below_int64_is_refused():
    assert "int64" in _reason(
        envelope("member.exited", {"member": "m0", "exit_code": -(2**63) - 1})
    )
    validate(envelope("member.exited", {"member": "m0", "exit_code": -(2**63)}))


def _integer_bounds(node: Any, defs: dict[str, Any], path: str, out: list[str]) -> None:
    if isinstance(node, dict):
        if node.get("type") == "integer":
            low, high = node.get("minimum"), node.get("maximum")
            if low is None or high is None or low < -(2**63) or high > INT64_MAX:
                out.append(path)
        for key, value in node.items():
            if key != "$defs":
                _integer_bounds(value, defs, f"{path}.{key}", out)
    elif isinstance(node, list):
        for i, value in enumerate(node):
            _integer_bounds(value, defs, f"{path}[{i}]", out)


def test_every_integer_of_every_event_lies_within_int64():
    """A field added later without bounds fails here (its value would fail the COPY)."""
    schema = EVENT_ADAPTER.json_schema()
    unbounded: list[str] = []
    for name, model in schema["$defs"].items():
        if name == "EnvelopeBase":
            continue
        _integer_bounds(model, schema["$defs"], name, unbounded)
    # ``v`` is a literal per event; everything else needs both bounds.
    assert [p for p in unbounded if not p.endswith(".properties.v")] == []


@pytest.mark.parametrize(
    "at",
    ["9999-12-31T23:00:00-05:00", "0001-01-01T00:00:00+05:00", "9999-12-31T00:00:00Z"],
)
def test_instants_no_reader_can_load_are_refused(at: str):
    reason = _reason(heartbeat(emitted_at=at))
    assert reason.startswith("schema violation at emitted_at:"), reason
    assert "9999-12-30" in reason or "0001-01-02" in reason, reason


@pytest.mark.parametrize("literal", [b"1e999", b"-1e999"])
def test_a_float_overflowing_to_infinity_is_refused(literal: bytes):
    data = (
        json.dumps(envelope("train.step")).encode().replace(b'"loss": 0.5', b'"loss": ' + literal)
    )
    with pytest.raises(ValidationError) as info:
        EVENT_ADAPTER.validate_json(data)
    assert info.value.errors()[0]["loc"][-1] == "loss"
