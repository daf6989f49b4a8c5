"""Identity on the bus: one NATS NKey user per node of a job and role, issued by the project.

From the installation secret (``ELASTIC_SECRET``, schemas/auth.py) ``elasticctl creds`` derives,
deterministically, an Ed25519 NKey seed for

- the control plane (``controlplane.nk``): administers both streams, pulls and acks events,
  publishes commands; the only identity that can read events;
- each node of a job, twice: its launcher (``<job>/<node>/launcher.nk``), which may publish
  ``elastic.evt.<job>.<node>.launcher.<type>`` (its members' exits as ``<node>/launcher``) and
  the NATS core subject ``elastic.hb.<job>.<node>.launcher`` (the heartbeats it relays), and
  its members (``<job>/<node>/member.nk``), which may publish
  ``elastic.evt.<job>.<node>.member.<type>`` and their heartbeats on the NATS core subject
  ``elastic.hb.<job>.<node>.member``; ``<type>`` is each member event type, one literal
  subject each (no wildcard: the server refuses every other subject, so a member cannot make
  the control plane read bytes that are not UTF-8 in a subject, nor fill the stream with
  subjects of its own).

The control plane also publishes its beacon (``elastic.beacon``, NATS core), which both node
identities may subscribe to. Both node identities read only their own job's commands: they
subscribe to
``elastic.cmd.<job>.>`` (NATS core: commands as they are published) and read the command in
force from the commands stream by its subject (``$JS.API.DIRECT.GET.<stream>.elastic.cmd.
<job>.<target>``: the subject read is in the request's own), and receive replies only on an
inbox of their own, ``_INBOX_<public key>``: they cannot subscribe to ``_INBOX.>``, to events,
to another job's commands or to another identity's inbox.

Beside the seeds it writes each job's secret (``<job>/job-secret``) and the command-verifying key
(``<job>/command-key``), which the launcher hands its members (ELASTIC_JOB_SECRET,
ELASTIC_COMMAND_KEY), and the NATS server's user list (``nats-users.conf``, public keys and
permissions only: not a secret) for every job issued into the directory; the server loads it
through an ``include`` in its ``authorization`` block and reloads it on SIGHUP
(``nats-server --signal reload``).

Reading them (the directory layout, a seed file's connect options) is ``schemas/creds.py``,
shared with the launcher.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import nkeys

from schemas.auth import command_public_key, derive, job_secret
from schemas.common import IDENT_PATTERN
from schemas.creds import (
    COMMAND_KEY_FILE,
    JOB_SECRET_FILE,
    KINDS,
    LAUNCHER,
    MEMBER,
    SEED_PREFIX,
    CredentialsError,
    NodeCredentials,
    check_name,
    inbox_prefix,
    node_dir,
    public_key,
)
from schemas.events import MEMBER_EVENT_TYPES
from schemas.subjects import (
    BEACON_SUBJECT,
    COMMAND_PREFIX,
    EVENT_PREFIX,
    HEARTBEAT_PREFIX,
    LAUNCHER_MEMBER,
    MEMBER_ROLE,
)

CONTROLPLANE = "controlplane"
CONTROLPLANE_FILE = "controlplane.nk"
USERS_FILE = "nats-users.conf"

_IDENT = re.compile(IDENT_PATTERN)


def _seed(master: bytes, label: str) -> bytes:
    raw = derive(master, f"elastic/nats/{label}")
    seed: bytes = nkeys.encode_seed(raw, nkeys.PREFIX_BYTE_USER)
    return seed


def controlplane_seed(master: bytes) -> bytes:
    """The control plane's NKey seed (``SU...``)."""
    return _seed(master, CONTROLPLANE)


def node_seed(master: bytes, job_id: str, node: str, kind: str) -> bytes:
    """The NKey seed of a node's launcher or members (``kind``: launcher | member)."""
    if kind not in KINDS:
        raise CredentialsError(f"kind must be one of {KINDS}, not {kind!r}")
    return _seed(master, f"{check_name('job', job_id)}/{check_name('node', node)}/{kind}")


# --------------------------------------------------------------------------- permissions


def controlplane_permissions(public: str, *, events_stream: str) -> dict[str, Any]:
    """What ``elasticctl serve`` (and the demo, the API's tools) may do on NATS."""
    return {
        "publish": {
            "allow": [
                f"{COMMAND_PREFIX}.>",
                "$JS.API.>",
                f"$JS.ACK.{events_stream}.>",
                BEACON_SUBJECT,
            ],
        },
        # Heartbeats: NATS core subjects, soft state (core/liveness.py).
        "subscribe": {"allow": [f"{inbox_prefix(public)}.>", f"{HEARTBEAT_PREFIX}.>"]},
    }


def node_permissions(
    job_id: str, node: str, kind: str, public: str, *, command_stream: str
) -> dict[str, Any]:
    """What one node's launcher (``kind`` launcher) or members (``member``) may do."""
    # Literal subjects only, each token named here (the role, the event types): a member
    # cannot publish a subject the control plane did not name, so none that is not UTF-8
    # (nats-py's reader stops at one) and no unbounded set of subjects in the stream.
    role = LAUNCHER_MEMBER if kind == LAUNCHER else MEMBER_ROLE
    events = f"{EVENT_PREFIX}.{job_id}.{node}.{role}"
    publish: dict[str, list[str]] = {
        "allow": [
            *(f"{events}.{type_}" for type_ in MEMBER_EVENT_TYPES),
            # Heartbeats (NATS core, not stored): a member's own, or those the launcher relays.
            f"{HEARTBEAT_PREFIX}.{job_id}.{node}.{role}",
            # The job's commands in force: find the stream, read the last command of a
            # subject of this job only (direct get names the subject in its own). Not
            # STREAM.INFO: its per-subject counts would name every job's members.
            "$JS.API.STREAM.NAMES",
            f"$JS.API.DIRECT.GET.{command_stream}.{COMMAND_PREFIX}.{job_id}.>",
        ]
    }
    # Commands as they are published (NATS core), this job's only; replies on its own inbox;
    # the control plane's beacon (a server it stops on is cut off from the control plane).
    subscribe = [f"{inbox_prefix(public)}.>", f"{COMMAND_PREFIX}.{job_id}.>", BEACON_SUBJECT]
    return {"publish": publish, "subscribe": {"allow": subscribe}}


# --------------------------------------------------------------------------- files


def _write(path: Path, data: bytes, mode: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)
    os.chmod(tmp, mode)
    os.replace(tmp, path)


@dataclass(frozen=True, slots=True)
class Issued:
    """What ``issue`` wrote."""

    controlplane: Path
    nodes: dict[str, NodeCredentials]
    users_file: Path
    users: int


def issue(
    master: bytes,
    directory: str | Path,
    job_id: str,
    nodes: Iterable[str],
    *,
    events_stream: str = "ELASTIC_EVENTS",
    command_stream: str = "ELASTIC_COMMANDS",
) -> Issued:
    """Write the credentials of ``nodes`` of ``job_id`` (and the control plane's) under
    ``directory``, then the server's user list for every job found there."""
    root = Path(directory)
    names = [check_name("node", n) for n in nodes]
    if not names:
        raise CredentialsError("no node to issue credentials for")
    root.mkdir(parents=True, exist_ok=True)
    cp = root / CONTROLPLANE_FILE
    _write(cp, controlplane_seed(master) + b"\n", 0o600)
    job_root = root / check_name("job", job_id)
    _write(job_root / JOB_SECRET_FILE, job_secret(master, job_id).hex().encode() + b"\n", 0o600)
    _write(job_root / COMMAND_KEY_FILE, command_public_key(master).hex().encode() + b"\n", 0o644)
    issued = {}
    for node in names:
        where = node_dir(root, job_id, node)
        for kind in KINDS:
            _write(where / f"{kind}.nk", node_seed(master, job_id, node, kind) + b"\n", 0o600)
        issued[node] = NodeCredentials(where / f"{LAUNCHER}.nk", where / f"{MEMBER}.nk")
    users_file, users = write_users_file(
        root, events_stream=events_stream, command_stream=command_stream
    )
    return Issued(cp, issued, users_file, users)


def _read_seed(path: Path) -> bytes:
    seed = path.read_bytes().strip()
    if not seed.startswith(SEED_PREFIX):
        raise CredentialsError(f"{path} is not an NKey user seed")
    return seed


def users(
    directory: str | Path, *, events_stream: str, command_stream: str
) -> list[dict[str, Any]]:
    """The server's ``users`` entries for every credential under ``directory``."""
    root = Path(directory)
    cp = public_key(_read_seed(root / CONTROLPLANE_FILE))
    entries = [
        {"nkey": cp, "permissions": controlplane_permissions(cp, events_stream=events_stream)}
    ]
    for job_root in sorted(p for p in root.iterdir() if p.is_dir() and _IDENT.match(p.name)):
        for where in sorted(p for p in job_root.iterdir() if p.is_dir() and _IDENT.match(p.name)):
            for kind in KINDS:
                path = where / f"{kind}.nk"
                if not path.is_file():
                    continue
                public = public_key(_read_seed(path))
                permissions = node_permissions(
                    job_root.name, where.name, kind, public, command_stream=command_stream
                )
                entries.append({"nkey": public, "permissions": permissions})
    return entries


def write_users_file(
    directory: str | Path, *, events_stream: str, command_stream: str
) -> tuple[Path, int]:
    """Write ``nats-users.conf`` (public keys and permissions); return it and its users."""
    root = Path(directory)
    entries = users(root, events_stream=events_stream, command_stream=command_stream)
    text = (
        "# Written by `elasticctl creds`: one NKey user per node of a job and role (launcher,\n"
        "# member), and the control plane. Public keys only. Included from the `authorization`\n"
        "# block of nats.conf; after adding a job: nats-server --signal reload (or SIGHUP).\n"
        f"users: {json.dumps(entries, indent=2)}\n"
    )
    path = root / USERS_FILE
    _write(path, text.encode(), 0o644)
    return path, len(entries)
