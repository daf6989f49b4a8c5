"""Examples of the API's answers for the OpenAPI document (a unit test validates each one)."""

from __future__ import annotations

from typing import Any

from controlplane.core.goodput import NOT_MEASURED

_AT = "2026-01-01T00:00:20Z"

JOB_SUMMARY: dict[str, Any] = {
    "job_id": "job-recorded",
    "name": "",
    "state": "RUNNING",
    "generation": 2,
    "world_size": 3,
    "last_step": 48,
    "last_loss": 0.344828,
    "incidents": 2,
    "open_incident": None,
    "events": 1327,
    "last_position": 1327,
    "registered_at": "2026-01-01T00:00:00Z",
    "last_event_at": "2026-01-01T00:00:46.500000Z",
}

JOB_LIST: dict[str, Any] = {"jobs": [JOB_SUMMARY]}

JOB_DETAIL: dict[str, Any] = {
    **JOB_SUMMARY,
    "policy": {"min_world": 2, "max_world": 4, "world_size": 4, "backup_interval": 5},
    "completed_step": None,
    "history": [
        {
            "position": 9,
            "at": "2026-01-01T00:00:00Z",
            "from_state": "PENDING",
            "to_state": "RUNNING",
            "reason": "4 workers joined",
        }
    ],
}

EVENT_PAGE: dict[str, Any] = {
    "events": [
        {
            "position": 781,
            "recorded_at": _AT,
            "event_id": "3f2d8a56-4a0e-4d7e-9a43-6d8e0e8f2b11",
            "job_id": "job-recorded",
            "type": "member.exited",
            "v": 1,
            "source": "node-0-1/w01",
            "incarnation": "inc1",
            "seq": 85,
            "generation": 0,
            "emitted_at": _AT,
            "payload": {"member": "w01", "exit_code": None, "signal": 9},
        }
    ],
    "next_after": 781,
}

INCIDENT: dict[str, Any] = {
    "incident_id": "0b6f5c1e-8f1a-5d0e-9b7c-2e4f1a3c5d7e",
    "kind": "fault",
    "opened_at": _AT,
    "opened_position": 782,
    "members": ["w01"],
    "reasons": ["exited"],
    "outcome": "recovered",
    "downtime_s": 0.8,
    "steps_lost": 3,
    "decisions": 1,
}

INCIDENTS: list[dict[str, Any]] = [INCIDENT]

_POINTS = [
    ("fault", 781, "2026-01-01T00:00:20Z"),
    ("detected", 782, "2026-01-01T00:00:20Z"),
    ("decided", 784, "2026-01-01T00:00:20Z"),
    ("acked", 790, "2026-01-01T00:00:20.100000Z"),
    ("restored", 794, "2026-01-01T00:00:20.500000Z"),
    ("first_step", 802, "2026-01-01T00:00:20.800000Z"),
]

TIMELINE: dict[str, Any] = {
    **INCIDENT,
    "points": [{"name": n, "position": p, "at": at} for n, p, at in _POINTS],
    "phases": [
        {"name": "detect", "start": "fault", "end": "detected", "seconds": 0.0},
        {"name": "decide", "start": "detected", "end": "decided", "seconds": 0.0},
        {"name": "ack", "start": "decided", "end": "acked", "seconds": 0.1},
        {"name": "restore", "start": "acked", "end": "restored", "seconds": 0.4},
        {"name": "resume", "start": "restored", "end": "first_step", "seconds": 0.3},
    ],
    "step_at_fault": 38,
    "resolved_at": "2026-01-01T00:00:20.800000Z",
    "resolved_position": 806,
    "detections": [782],
    "history": [
        {
            "position": 784,
            "at": _AT,
            "command_id": "7a1c3e5f-2b4d-5f6a-8c9e-0a1b2c3d4e5f",
            "generation": 1,
            "mode": "replace",
            "world": ["w00", "spare0", "w10", "w11"],
            "restore_step": 35,
            "restore_from": "memory",
            "reason": "w01 exited; spare0 takes its rank",
        }
    ],
}

CLUSTER: dict[str, Any] = {
    "job_id": "job-recorded",
    "state": "RUNNING",
    "generation": 1,
    "world": ["w00", "spare0"],
    "rendezvous": "tcp://controlplane:29400/job-recorded/1",
    "placement": [["spare0"], ["w00"]],
    "placement_note": "",
    "members": [
        {
            "member_id": "w00",
            "node": "node-0-0",
            "rack": "rack0",
            "host": "h-node-0-0",
            "role": "worker",
            "status": "active",
            "rank": 0,
            "phase": "train",
            "step": 40,
            "last_heartbeat_at": _AT,
            "joined_at": "2026-01-01T00:00:00Z",
            "failed_reason": None,
        }
    ],
    "topology": {"rack0": {"node-0-0": ["w00"]}, "rack1": {"spare-node-0": ["spare0"]}},
    "backups": [
        {
            "step": 40,
            "generation": 1,
            "complete": True,
            "shards": [
                {"shard": 0, "owner": "w00", "nbytes": 100, "verified_holders": ["spare0"]},
                {"shard": 1, "owner": "spare0", "nbytes": 100, "verified_holders": ["w00"]},
            ],
        }
    ],
    "last_complete_backup": 40,
}

LOSS: dict[str, Any] = {
    "points": [
        {"step": 37, "loss": 0.425532, "at": "2026-01-01T00:00:19Z"},
        {"step": 38, "loss": 0.416667, "at": "2026-01-01T00:00:19.500000Z"},
    ],
    "faults": {"0b6f5c1e-8f1a-5d0e-9b7c-2e4f1a3c5d7e": 38},
}

HEALTH: dict[str, Any] = {"status": "ok", "database": True, "last_position": 1327}

PROBLEM_NOT_FOUND: dict[str, Any] = {"detail": "no job 'job-x'"}


#: The recorded two-incident run (tests/recorded.py) at its end.
GOODPUT: dict[str, Any] = {
    "job_id": "job-recorded",
    "started_at": "2026-01-01T00:00:00Z",
    "ended_at": "2026-01-01T00:00:55.500000Z",
    "final": True,
    "wall_s": 55.5,
    "seconds": {
        "productive": 44.33,
        "recomputation": 1.4,
        "backup": 0.18,
        "stragglers": 0.0,
        "detection": 5.0,
        "decision": 0.0,
        "restore": 1.0,
        "resume": 0.6,
        "waiting": 1.0,
        "idle": 1.99,
    },
    "ettr": 0.798739,
    "productive_steps": 90,
    "recomputed_steps": 6,
    "goodput_steps_per_s": 1.621622,
    "incidents": [
        {
            "incident_id": "96444964-18c8-5654-a54d-e4b74025b13b",
            "kind": "fault",
            "outcome": "recovered",
            "phases": {"detection": 0.0, "decision": 0.0, "restore": 0.5, "resume": 0.3},
            "recomputation_s": 0.7,
            "steps_lost": 3,
            "cost_s": 1.5,
            "ettr_lost": 0.027027,
        },
        {
            "incident_id": "66e54e45-0fd8-547c-9d23-caaeb87ed01d",
            "kind": "fault",
            "outcome": "recovered",
            "phases": {"detection": 5.0, "decision": 0.0, "restore": 0.5, "resume": 0.3},
            "recomputation_s": 0.7,
            "steps_lost": 3,
            "cost_s": 6.5,
            "ettr_lost": 0.117117,
        },
    ],
    "generations": [
        {
            "generation": 1,
            "started_at": "2026-01-01T00:00:00Z",
            "ended_at": "2026-01-01T00:00:20Z",
            "wall_s": 20.0,
            "seconds": {
                "productive": 18.43,
                "recomputation": 0.0,
                "backup": 0.07,
                "stragglers": 0.0,
                "detection": 0.0,
                "decision": 0.0,
                "restore": 0.0,
                "resume": 0.0,
                "waiting": 1.0,
                "idle": 0.5,
            },
            "productive_steps": 38,
            "recomputed_steps": 0,
            "ettr": 0.9215,
            "goodput_steps_per_s": 1.9,
        },
        {
            "generation": 2,
            "started_at": "2026-01-01T00:00:20Z",
            "ended_at": "2026-01-01T00:00:45Z",
            "wall_s": 25.0,
            "seconds": {
                "productive": 17.43,
                "recomputation": 0.7,
                "backup": 0.07,
                "stragglers": 0.0,
                "detection": 5.0,
                "decision": 0.0,
                "restore": 0.5,
                "resume": 0.3,
                "waiting": 0.0,
                "idle": 1.0,
            },
            "productive_steps": 35,
            "recomputed_steps": 3,
            "ettr": 0.6972,
            "goodput_steps_per_s": 1.4,
        },
        {
            "generation": 3,
            "started_at": "2026-01-01T00:00:45Z",
            "ended_at": "2026-01-01T00:00:55.500000Z",
            "wall_s": 10.5,
            "seconds": {
                "productive": 8.47,
                "recomputation": 0.7,
                "backup": 0.04,
                "stragglers": 0.0,
                "detection": 0.0,
                "decision": 0.0,
                "restore": 0.5,
                "resume": 0.3,
                "waiting": 0.0,
                "idle": 0.49,
            },
            "productive_steps": 17,
            "recomputed_steps": 3,
            "ettr": 0.806667,
            "goodput_steps_per_s": 1.619048,
        },
    ],
    "not_measured": list(NOT_MEASURED),
}
