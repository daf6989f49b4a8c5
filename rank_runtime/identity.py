"""Who this process is and where the control plane is: read from the launcher's environment."""

from __future__ import annotations

import os
import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass

from schemas.common import IDENT_PATTERN, Role
from schemas.subjects import LAUNCHER_MEMBER

#: The job this member trains in (a name: letters, digits, ``_``, ``-``, at most 64); required.
JOB_ID_ENV = "ELASTIC_JOB_ID"
#: The node this member runs on (a name); required.
NODE_ENV = "ELASTIC_NODE"
#: The rack of its node (a name): placement spreads backup copies over racks; required.
RACK_ENV = "ELASTIC_RACK"
#: The member's name (not ``launcher``: that names the node's launcher); required.
MEMBER_ENV = "ELASTIC_MEMBER"
#: ``worker`` (default) or ``spare`` (a warm spare waits until a decision gives it a rank).
ROLE_ENV = "ELASTIC_ROLE"
#: NATS server URL(s), comma-separated (default ``nats://127.0.0.1:4222``).
NATS_URL_ENV = "ELASTIC_NATS_URL"
#: NATS user (with ``ELASTIC_NATS_PASSWORD``).
NATS_USER_ENV = "ELASTIC_NATS_USER"
#: NATS password.
NATS_PASSWORD_ENV = "ELASTIC_NATS_PASSWORD"
#: The member's NATS credential: an NKey seed file from ``elasticctl creds``, or a JWT
#: ``.creds`` file.
NATS_CREDS_ENV = "ELASTIC_NATS_CREDS"
#: The policy the job asks for, as JSON (``JobPolicy``: world sizes, heartbeat interval and
#: timeouts per phase, backup interval, redundancy, ``checkpoint_every``, recovery deadline,
#: mesh, ...); the first member to join registers it.
POLICY_ENV = "ELASTIC_POLICY"
#: The incarnation the launcher gave this process (one per process it starts): every event
#: of the process carries it, and the launcher names it in the process's ``member.exited``,
#: so the control plane applies the exit to this process and no other of the same name.
INCARNATION_ENV = "ELASTIC_INCARNATION"
#: The launcher's Unix datagram socket for this node's heartbeats: a member it started sends
#: its heartbeats there, and the launcher sends the node's in one message an interval
#: (``rank_runtime/relay.py``). Unset: the member heartbeats on NATS itself.
HEARTBEAT_RELAY_ENV = "ELASTIC_HEARTBEAT_RELAY"

_IDENT = re.compile(IDENT_PATTERN)


class IdentityError(ValueError):
    """The environment does not say who this process is."""


@dataclass(frozen=True, slots=True)
class Identity:
    """One member of one job: its names, its place in the topology, and the bus to talk on."""

    job_id: str
    node: str
    rack: str
    member: str
    role: Role
    nats_url: str
    host: str = ""
    nats_user: str | None = None
    nats_password: str | None = None
    nats_creds: str | None = None
    #: The policy the launcher asks for, as JSON (the first member's registers the job).
    policy_json: str | None = None
    #: The incarnation the launcher chose for this process (None: the client draws one).
    incarnation: str | None = None
    #: The launcher's socket that relays this node's heartbeats (None: beat on NATS).
    heartbeat_relay: str | None = None

    @property
    def source(self) -> str:
        """The envelope ``source`` this member publishes under."""
        return f"{self.node}/{self.member}"

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Identity:
        """Read the ``ELASTIC_*`` variables the launcher sets; name every one missing or bad."""
        env = os.environ if env is None else env
        missing = [
            name for name in (JOB_ID_ENV, NODE_ENV, RACK_ENV, MEMBER_ENV) if not env.get(name)
        ]
        if missing:
            raise IdentityError(
                f"not started by a launcher: {', '.join(missing)} unset"
                " (run the script with `elasticctl run`, or set them)"
            )
        bad = [
            f"{name}={env[name]!r}"
            for name in (JOB_ID_ENV, NODE_ENV, RACK_ENV, MEMBER_ENV, INCARNATION_ENV)
            if env.get(name) and not _IDENT.match(env[name])
        ]
        if bad:
            raise IdentityError(
                f"not a valid name (letters, digits, '-', '_'; at most 64): {', '.join(bad)}"
            )
        if env[MEMBER_ENV] == LAUNCHER_MEMBER:
            raise IdentityError(
                f"{MEMBER_ENV}={LAUNCHER_MEMBER!r} is reserved for the launcher of a node"
            )
        role_text = env.get(ROLE_ENV, Role.WORKER.value)
        try:
            role = Role(role_text)
        except ValueError:
            raise IdentityError(f"{ROLE_ENV}={role_text!r}: expected worker or spare") from None
        return cls(
            job_id=env[JOB_ID_ENV],
            node=env[NODE_ENV],
            rack=env[RACK_ENV],
            member=env[MEMBER_ENV],
            role=role,
            nats_url=env.get(NATS_URL_ENV, "nats://127.0.0.1:4222"),
            host=socket.gethostname(),
            nats_user=env.get(NATS_USER_ENV) or None,
            nats_password=env.get(NATS_PASSWORD_ENV) or None,
            nats_creds=env.get(NATS_CREDS_ENV) or None,
            policy_json=env.get(POLICY_ENV) or None,
            incarnation=env.get(INCARNATION_ENV) or None,
            heartbeat_relay=env.get(HEARTBEAT_RELAY_ENV) or None,
        )
