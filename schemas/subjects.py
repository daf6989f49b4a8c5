"""NATS subject layout (DESIGN.md): events per job/node/role/type, commands per job/member.

Shared by both sides: members publish on these subjects, the control plane reads them.
"""

from __future__ import annotations

from typing import NamedTuple

EVENT_PREFIX = "elastic.evt"
COMMAND_PREFIX = "elastic.cmd"
#: Heartbeats: NATS core subjects ``elastic.hb.<job>.<node>.<role>``, outside the events
#: stream (soft state: the control plane keeps them in memory, docs/design.md "Liveness").
HEARTBEAT_PREFIX = "elastic.hb"
HEARTBEATS_WILDCARD = f"{HEARTBEAT_PREFIX}.>"
#: The control plane's beacon (NATS core, every ``BEACON_INTERVAL_S``; no stream keeps it):
#: a member's or launcher's connection that hears none for ``BEACON_TIMEOUT_S`` after it
#: heard one is on a server cut off from the control plane's side of the cluster, and moves
#: to another server (``rank_runtime.client``).
BEACON_SUBJECT = "elastic.beacon"
BEACON_INTERVAL_S = 0.5
BEACON_TIMEOUT_S = 2.0
#: What the events stream captures.
EVENTS_WILDCARD = f"{EVENT_PREFIX}.>"
BROADCAST = "all"
#: The header JetStream de-duplicates a publication by (the event's or command's id).
MSG_ID_HEADER = "Nats-Msg-Id"
#: How long a member's publication of an event waits for JetStream's acknowledgement before
#: it is sent again (the same id: stored once). While a clustered stream elects a leader,
#: nothing is acknowledged: the control plane counts on this to know when what members sent
#: meanwhile has arrived (``controlplane.bus.EVENTS_SETTLE_S``).
EVENT_ACK_TIMEOUT_S = 5.0


#: The member name a node's launcher publishes under (``<node>/launcher``): no member may use it.
LAUNCHER_MEMBER = "launcher"
#: The role token of a subject a member publishes on (its name is in the envelope's source).
MEMBER_ROLE = "member"
#: The role tokens of events' and heartbeats' subjects: a member's, or its node's launcher's.
ROLES = (MEMBER_ROLE, LAUNCHER_MEMBER)


def role_of(member: str) -> str:
    """The role token a member (or the launcher, ``launcher``) publishes under."""
    return LAUNCHER_MEMBER if member == LAUNCHER_MEMBER else MEMBER_ROLE


class EventSubject(NamedTuple):
    """The parts of ``elastic.evt.<job>.<node>.<role>.<type>`` (``role``: ``member`` or
    ``launcher``).

    Every token is one the control plane names in the publisher's NATS permissions (the job and
    node of its credential, a role, an event type): no token is free, so the server refuses
    whatever else a member sends, bytes that are not UTF-8 included (docs/security.md). The
    member's own name travels in the envelope's ``source``, bound to the subject by ``binds``.
    """

    job_id: str
    node: str
    role: str
    type: str

    @property
    def bound(self) -> str:
        """The sources this subject binds, as a refusal names them (``<node>/launcher`` or
        ``<node>/<member>``)."""
        return f"{self.node}/{LAUNCHER_MEMBER if self.role == LAUNCHER_MEMBER else '<member>'}"

    def binds(self, source: str) -> bool:
        """Whether an envelope's ``source`` (``<node>/<member>``) may come on this subject:
        the subject's node, and the launcher exactly when the role is the launcher's."""
        node, slash, member = source.partition("/")
        return (
            slash == "/"
            and node == self.node
            and bool(member)
            and (member == LAUNCHER_MEMBER) == (self.role == LAUNCHER_MEMBER)
        )


def event_subject(job_id: str, node: str, member: str, type_: str) -> str:
    """The subject ``member`` (or the launcher) of ``node`` publishes an event of ``type_`` on."""
    return f"{EVENT_PREFIX}.{job_id}.{node}.{role_of(member)}.{type_}"


def parse_event_subject(subject: str) -> EventSubject | None:
    """Split an event subject, or None when it is not one."""
    parts = subject.split(".", 5)
    if (
        len(parts) != 6
        or f"{parts[0]}.{parts[1]}" != EVENT_PREFIX
        or not all(parts)
        or parts[4] not in ROLES
    ):
        return None
    return EventSubject(parts[2], parts[3], parts[4], parts[5])


def command_subject(job_id: str, member: str = BROADCAST) -> str:
    """The subject of a command for one member, or for every member of the job."""
    return f"{COMMAND_PREFIX}.{job_id}.{member}"


def command_wildcard(job_id: str) -> str:
    """Every command subject of one job."""
    return f"{COMMAND_PREFIX}.{job_id}.*"


def heartbeat_subject(job_id: str, node: str, member: str) -> str:
    """The subject ``member`` of ``node`` publishes its heartbeats on (the launcher, those it
    relays): ``elastic.hb.<job>.<node>.<role>``."""
    return f"{HEARTBEAT_PREFIX}.{job_id}.{node}.{role_of(member)}"


def parse_heartbeat_subject(subject: str) -> EventSubject | None:
    """Split a heartbeat subject (``type`` is ``member.heartbeat``), or None."""
    parts = subject.split(".")
    if (
        len(parts) != 5
        or f"{parts[0]}.{parts[1]}" != HEARTBEAT_PREFIX
        or not all(parts)
        or parts[4] not in ROLES
    ):
        return None
    return EventSubject(parts[2], parts[3], parts[4], "member.heartbeat")
