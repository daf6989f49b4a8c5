"""``elasticctl bench fuzz``: the real ingest fed hostile bytes while a real job trains.

The control plane runs as its own process (``elasticctl serve``) over NATS and PostgreSQL
(embedded, or ELASTIC_NATS_URL / ELASTIC_DATABASE_URL), and a small job trains alongside
(``elasticctl run`` of ``examples/train.py``). Once the job trains, this process publishes
the fuzz cases over the raw NATS protocol (so a subject may hold a NUL) to fuzz jobs of
their own: valid member events, and valid events mutated in every way a buggy trainer or an
attacker would (a NUL or a lone surrogate in any string, bytes that are not UTF-8, integers
beyond int64, NaN and infinities, wrong types, truncated JSON, random bytes, a subject that
contradicts the envelope, forged control-plane types, implausible and replayed seqs, deep
nesting, oversized messages, instants out of range). A subject that is not UTF-8 is not a
case: a member's credential names literal subjects only, and the server refuses every other
(``tests/integration/test_bus_identity.py``); this stack runs without credentials.

Every case JetStream acknowledged must end stored (by event_id) or dead-lettered (by stream
sequence, or by event_id for an event the sequence rules or the store refused), or, for a
backup report at or below its source's highest seq and in no hole, be dropped as a repeat of
a packed report (``repeated_reports``: the store keeps no report's event_id to tell a repeat
from a replayed seq): ``unaccounted`` counts those that did none of these. ``crashes``:
serve exited before it was stopped. ``stalls``: gaps of more than ``STALL_S`` between two
commits (PostgreSQL's commit timestamps of the rows written) while input flowed: from the
first publish to the last commit, or to giving up (30 s without progress) when cases are
still owed.
``job_completed``: the training job reached COMPLETED.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import psycopg

from controlplane.bench import BenchError
from controlplane.bench.stack import Stack, stack
from controlplane.core.fold import fold
from controlplane.core.records import DeadLetter
from controlplane.decode import decode, storable
from controlplane.errors import StoreRefused
from controlplane.settings import DATABASE_URL_ENV, NATS_URL_ENV, libpq_url
from controlplane.store.memory import refusal
from controlplane.store.postgres import (
    CATALOG_PAYLOADS,
    PostgresEventStore,
    catalog_reports,
    encode_row,
)
from schemas.common import IDENT_PATTERN, MAX_EVENT_BYTES, JobState
from schemas.events import CONTROLPLANE_EVENT_TYPES, MEMBER_EVENT_TYPES
from schemas.subjects import event_subject

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
#: The training job's policy: timeouts long enough that a busy machine does not fail it
#: (what is measured is the ingest; a fault of the job would be a different story).
JOB_POLICY = (
    "backup_interval=10,heartbeat_interval_s=0.5,recovery_deadline_s=120,"
    'heartbeat_timeout_s={"init":120,"train":60,"waiting":60,"backup":60,"restore":60}'
)
#: A gap between two commits longer than this, while input flows, is a stall.
STALL_S = 2.0
_ACK_PREFIX = b"_INBOX.fuzz"
UUID_A = "0b8f3c1e-4a2d-4f6b-9c1d-2e3f4a5b6c7d"
INT64 = 2**63


# --------------------------------------------------------------------------- the cases


def _payload(type_: str, rng: random.Random, node: str) -> dict[str, Any]:
    """A valid payload of a member event type."""
    step = rng.randrange(0, 10_000)
    checksum = f"crc32:{rng.getrandbits(32):08x}"
    member = f"m{rng.randrange(8)}"
    payloads: dict[str, dict[str, Any]] = {
        "member.joined": {"node": node, "rack": "r0", "host": f"h-{node}",
                          "pid": rng.randrange(1, 1 << 22), "role": rng.choice(["worker", "spare"]),
                          "device": "cpu", "backup_endpoint": f"h-{node}:7000"},
        "member.heartbeat": {"step": step, "phase": rng.choice(["init", "train", "waiting"])},
        "train.step": {"step": step, "loss": rng.random(), "step_seconds": rng.random() / 10,
                       "samples": 64},
        "backup.snapshot": {"step": step, "shard": rng.randrange(4),
                            "nbytes": rng.randrange(1 << 20), "checksum": checksum,
                            "seconds": 0.01},
        "backup.replicated": {"step": step, "shard": rng.randrange(4), "owner": member,
                              "nbytes": rng.randrange(1 << 20), "checksum": checksum,
                              "seconds": 0.01},
        "checkpoint.saved": {"step": step, "shard": 0, "shards": 2, "path": f"/ckpt/{step}/0.pt",
                             "nbytes": 100, "checksum": checksum, "seconds": 0.1},
        "member.fault": {"kind": rng.choice(["exception", "oom", "other"]),
                         "detail": "RuntimeError: boom", "step": step, "suspects": [member]},
        "member.exited": {"member": member, "exit_code": rng.choice([0, 1, -9])},
        "command.acked": {"command_id": str(uuid.UUID(int=rng.getrandbits(128), version=4))},
        "restore.completed": {"generation": 1, "step": step, "bytes": 10, "seconds": 0.1,
                              "sources": {"0": member}},
        "train.resumed": {"generation": 1, "step": step},
        "train.completed": {"step": step, "loss": 0.01},
    }  # fmt: skip
    return payloads[type_]


#: Member event types this generator can make a valid payload of (heartbeats and steps twice:
#: they are most of a real job's events).
_KNOWN = ("member.heartbeat", "train.step") * 2 + (
    "member.joined", "backup.snapshot", "backup.replicated", "checkpoint.saved", "member.fault",
    "member.exited", "command.acked", "restore.completed", "train.resumed", "train.completed",
)  # fmt: skip
_TYPES = [t for t in _KNOWN if t in MEMBER_EVENT_TYPES]


@dataclass(slots=True)
class Case:
    """One message to publish: its subject and bytes, and the event_id it was made with."""

    subject: bytes
    data: bytes
    event_id: str
    kind: str


def _leaves(node: Any, path: tuple[Any, ...] = ()) -> list[tuple[tuple[Any, ...], Any]]:
    if isinstance(node, dict):
        return [leaf for k, v in node.items() for leaf in _leaves(v, (*path, k))]
    if isinstance(node, list):
        return [leaf for i, v in enumerate(node) for leaf in _leaves(v, (*path, i))]
    return [(path, node)]


def _set(node: Any, path: tuple[Any, ...], value: Any) -> None:
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value


def _nasty_int(rng: random.Random) -> int:
    return rng.choice(
        [INT64, INT64 - 1, INT64 + 1, 2**64, -INT64 - 1, -INT64, -1, 10**30, -(10**30), 10**400]
    )


def _wrong_type(rng: random.Random) -> Any:
    return rng.choice([None, True, [], {}, [1, 2], {"a": 1}, "1", "", 1.5, 0, "\u0000"])


def _splice(data: bytes, rng: random.Random, insert: bytes) -> bytes:
    """``insert`` placed inside a JSON string of ``data`` (just after an opening quote)."""
    quotes = [i for i in range(len(data)) if data[i] == 0x22]
    at = rng.choice(quotes) + 1 if quotes else 0
    return data[:at] + insert + data[at:]


class Generator:
    """Makes fuzz cases for a few fuzz jobs; valid ones carry per-source increasing seqs."""

    def __init__(self, seed: int, run: str, jobs: int = 4, nodes: int = 4, members: int = 8):
        self.rng = random.Random(seed)
        self.jobs = [f"fuzz-{run}-{j}" for j in range(jobs)]
        self.nodes = [f"n{n}" for n in range(nodes)]
        self.members = [f"m{m}" for m in range(members)]
        self.incarnation = f"inc-{run}"
        self._seq: dict[tuple[str, str, str], int] = {}

    def envelope(self) -> tuple[dict[str, Any], tuple[str, str, str]]:
        rng = self.rng
        job, node, member = rng.choice(self.jobs), rng.choice(self.nodes), rng.choice(self.members)
        type_ = rng.choice(_TYPES)
        key = (job, node, member)
        seq = self._seq.get(key, 0) + 1
        self._seq[key] = seq
        envelope = {
            "event_id": str(uuid.UUID(int=rng.getrandbits(128), version=4)),
            "job_id": job,
            "type": type_,
            "v": 1,
            "source": f"{node}/{member}",
            "incarnation": self.incarnation,
            "seq": seq,
            "generation": 0,
            "emitted_at": "2026-01-01T00:00:00+00:00",
            "payload": _payload(type_, rng, node),
        }
        return envelope, key

    def case(self) -> Case:
        rng = self.rng
        env, (job, node, member) = self.envelope()
        event_id = env["event_id"]
        subject = event_subject(job, node, member, env["type"]).encode()
        kind = rng.choice(_MUTATIONS)
        data: bytes
        if kind == "valid":
            data = json.dumps(env).encode()
        elif kind in _ENVELOPE_MUTATIONS:
            subject, data = _ENVELOPE_MUTATIONS[kind](self, env, subject)
        else:
            data = _BYTE_MUTATIONS[kind](rng, json.dumps(env).encode())
        return Case(subject, data, event_id, kind)

    def cases(self, n: int) -> list[Case]:
        return [self.case() for _ in range(n)]


def _leaf_of(env: dict[str, Any], rng: random.Random, kinds: tuple[type, ...]) -> tuple[Any, ...]:
    """A random leaf path of ``env`` holding one of ``kinds`` (never event_id: every case
    keeps its own, so it is found again), or the payload's first field."""
    leaves = [
        p for p, v in _leaves(env)
        if isinstance(v, kinds) and not isinstance(v, bool) and p != ("event_id",)
    ]  # fmt: skip
    return rng.choice(leaves) if leaves else ("seq",)


def _m_nul(g: Generator, env: dict[str, Any], subject: bytes) -> tuple[bytes, bytes]:
    path = _leaf_of(env, g.rng, (str,))
    value = str(_get(env, path))
    at = g.rng.randrange(len(value) + 1)
    _set(env, path, value[:at] + "\u0000" + value[at:])
    return subject, json.dumps(env).encode()


def _m_surrogate(g: Generator, env: dict[str, Any], subject: bytes) -> tuple[bytes, bytes]:
    path = _leaf_of(env, g.rng, (str,))
    _set(env, path, str(_get(env, path)) + g.rng.choice(["\ud800", "\udfff", "\udc80x"]))
    text = json.dumps(env, ensure_ascii=g.rng.random() < 0.5)
    return subject, text.encode("utf-8", "surrogatepass")  # escaped, or raw CESU-8 bytes


def _m_int(g: Generator, env: dict[str, Any], subject: bytes) -> tuple[bytes, bytes]:
    rng = g.rng
    path = rng.choice([("seq",), ("generation",), _leaf_of(env, rng, (int,))])
    _set(env, path, _nasty_int(rng))
    return subject, json.dumps(env).encode()


def _m_float(g: Generator, env: dict[str, Any], subject: bytes) -> tuple[bytes, bytes]:
    path = _leaf_of(env, g.rng, (float, int))
    _set(env, path, g.rng.choice([float("nan"), float("inf"), float("-inf"), 1e308, -0.0]))
    text = json.dumps(env, allow_nan=True)
    if g.rng.random() < 0.3:
        text = text.replace("Infinity", "1e999")
    return subject, text.encode()


def _m_type(g: Generator, env: dict[str, Any], subject: bytes) -> tuple[bytes, bytes]:
    path = _leaf_of(env, g.rng, (str, int, float))
    _set(env, path, _wrong_type(g.rng))
    return subject, json.dumps(env).encode()


def _m_subject(g: Generator, env: dict[str, Any], subject: bytes) -> tuple[bytes, bytes]:
    rng = g.rng
    parts = subject.split(b".", 5)
    spot = rng.randrange(2, 6)
    parts[spot] = rng.choice(
        [b"other", b"n9", b"m9", b"member.exited", b"launcher", b"\x00", b"a-b", b"controlplane"]
    )
    return b".".join(parts), json.dumps(env).encode()


def _m_forged(g: Generator, env: dict[str, Any], subject: bytes) -> tuple[bytes, bytes]:
    type_ = g.rng.choice(sorted(CONTROLPLANE_EVENT_TYPES))
    env["type"] = type_
    parts = subject.split(b".", 5)
    parts[5] = type_.encode()
    return b".".join(parts), json.dumps(env).encode()


def _m_version(g: Generator, env: dict[str, Any], subject: bytes) -> tuple[bytes, bytes]:
    rng = g.rng
    choice = rng.randrange(4)
    if choice == 0:
        env["v"] = rng.choice([0, 2, 99, -1, INT64])
    elif choice == 1:
        env["type"] = "member.bogus"
        subject = subject.rsplit(b".", 2)[0] + b".member.bogus"
    elif choice == 2:
        env["extra"] = {"x": 1}
    else:
        env["payload"]["extra"] = "y"
    return subject, json.dumps(env).encode()


def _m_seq(g: Generator, env: dict[str, Any], subject: bytes) -> tuple[bytes, bytes]:
    rng = g.rng
    env["seq"] = rng.choice(
        [env["seq"] + 10**7, env["seq"] + 10**12, INT64 - 1, max(1, env["seq"] - 1), 0]
    )
    return subject, json.dumps(env).encode()


def _m_time(g: Generator, env: dict[str, Any], subject: bytes) -> tuple[bytes, bytes]:
    env["emitted_at"] = g.rng.choice(
        ["9999-12-31T23:59:59-12:00", "0001-01-01T00:00:00+14:00", "2026-13-01T00:00:00Z",
         "2026-01-01T00:00:00", "2026-01-01T24:00:00Z", 1767225600, "9999-12-31T23:59:59Z"]
    )  # fmt: skip
    return subject, json.dumps(env).encode()


def _m_text(g: Generator, env: dict[str, Any], subject: bytes) -> tuple[bytes, bytes]:
    rng = g.rng
    choice = rng.randrange(3)
    if choice == 0:  # text beyond the limits
        path = _leaf_of(env, rng, (str,))
        _set(env, path, "x" * rng.choice([257, 4097, 60_000]))
    elif choice == 1:  # a NUL or a long key in a dict
        env["type"], env["payload"] = "restore.completed", {
            "generation": 1, "step": 1, "bytes": 1, "seconds": 0.1,
            "sources": {rng.choice(["0\u0000", "k" * 300, "\u0000"]): "m0"},
        }  # fmt: skip
        subject = subject.rsplit(b".", 2)[0] + b".restore.completed"
    else:  # unicode that is fine
        path = _leaf_of(env, rng, (str,))
        _set(env, path, "héllo \U0001f600 \u2028 \\ \t")
    return subject, json.dumps(env, ensure_ascii=rng.random() < 0.5).encode()


def _m_nesting(g: Generator, env: dict[str, Any], subject: bytes) -> tuple[bytes, bytes]:
    depth = g.rng.choice([100, 5000, 20_000])
    data = json.dumps(env).encode()
    nested = b"[" * depth + b"]" * depth
    return subject, data.replace(b'"payload": {', b'"payload": ' + nested + b', "p": {', 1)


def _get(node: Any, path: tuple[Any, ...]) -> Any:
    for key in path:
        node = node[key]
    return node


def _b_truncate(rng: random.Random, data: bytes) -> bytes:
    return data[: rng.randrange(len(data))]


def _b_random(rng: random.Random, data: bytes) -> bytes:
    return rng.randbytes(rng.randrange(0, 300))


def _b_flip(rng: random.Random, data: bytes) -> bytes:
    out = bytearray(data)
    # Never inside the event_id (first in the envelope): a flipped hex digit makes another
    # valid id, and the case could not be found again by its own.
    after_id = data.find(b'", ') + 1
    for _ in range(rng.randrange(1, 8)):
        out[rng.randrange(after_id, len(out))] = rng.randrange(256)
    return bytes(out)


def _b_utf8(rng: random.Random, data: bytes) -> bytes:
    return _splice(data, rng, rng.choice([b"\xff", b"\xc3", b"\xed\xa0\x80", b"\xf4\x90\x80\x80"]))


def _b_oversized(rng: random.Random, data: bytes) -> bytes:
    return data[:-1] + b', "pad": "' + b"x" * (MAX_EVENT_BYTES + 10) + b'"}'


def _b_wrapped(rng: random.Random, data: bytes) -> bytes:
    return rng.choice([b"\xef\xbb\xbf" + data, b"[" + data + b"]", data + b" trailing",
                       b"  \n" + data + b"\n ", data + data, b"null", b"", b'"x"'])  # fmt: skip


_ENVELOPE_MUTATIONS: dict[str, Callable[[Generator, dict[str, Any], bytes], tuple[bytes, bytes]]]
_ENVELOPE_MUTATIONS = {
    "nul": _m_nul, "surrogate": _m_surrogate, "int": _m_int, "float": _m_float,
    "type": _m_type, "subject": _m_subject, "forged": _m_forged, "version": _m_version,
    "seq": _m_seq, "time": _m_time, "text": _m_text, "nesting": _m_nesting,
}  # fmt: skip
_BYTE_MUTATIONS: dict[str, Callable[[random.Random, bytes], bytes]] = {
    "truncate": _b_truncate, "random": _b_random, "flip": _b_flip, "utf8": _b_utf8,
    "oversized": _b_oversized, "wrapped": _b_wrapped,
}  # fmt: skip
#: What a case is made by, drawn uniformly: a third valid, the rest one mutation each.
_MUTATIONS = ["valid"] * 9 + [*_ENVELOPE_MUTATIONS, *_BYTE_MUTATIONS]


# --------------------------------------------------------------------------- one input


class Unstorable(AssertionError):
    """A property of ``check_one`` failed: what the fuzz targets look for."""


def check_one(subject: str, data: bytes, store: Any | None = None, stream_seq: int = 1) -> str:
    """Decode -> encode -> (append) one message and check that it ends storable; return
    "event" or "dead". The fuzz targets' property (hypothesis in the tests, atheris in
    ``tests/fuzz/ingest_target.py``). Raises ``Unstorable`` (or whatever decode raised, which
    it never may) when the input could stop the ingest: an event the schemas let through
    that PostgreSQL would refuse, or a dead letter whose text columns it would refuse.
    With ``store`` (any ``EventStore``), the result is appended there too, and must be (give
    each input its own ``stream_seq``: dead letters are idempotent by it)."""
    decoded = decode(subject, data, stream_seq)
    if isinstance(decoded, DeadLetter):
        letter = storable(decoded)
        for text in (letter.subject, letter.reason, letter.job_id or "", letter.event_id or ""):
            if "\x00" in text:
                raise Unstorable(f"a NUL stays in a dead letter: {letter!r}")
            text.encode("utf-8")  # strict: a lone surrogate raises
        if store is not None:
            store.append((), [decoded])
        return "dead"
    encode_row(decoded)
    why = refusal(decoded)
    if why is not None:
        raise Unstorable(f"the schemas let through what PostgreSQL refuses: {why}")
    if store is not None:
        try:
            store.append([decoded])
        except StoreRefused as exc:
            raise Unstorable(f"the store refused a decoded event: {exc}") from exc
    return "event"


# --------------------------------------------------------------------------- publishing


@dataclass
class _Acks:
    #: case index -> stream sequence (None: JetStream answered with an error)
    seqs: dict[int, int | None] = field(default_factory=dict)
    progress: asyncio.Event = field(default_factory=asyncio.Event)
    pong: asyncio.Event = field(default_factory=asyncio.Event)
    errors: list[str] = field(default_factory=list)


async def _read_acks(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, acks: _Acks
) -> None:
    buf = b""
    while True:
        data = await reader.read(1 << 16)
        if not data:
            return
        buf += data
        at = 0
        while True:
            nl = buf.find(b"\r\n", at)
            if nl < 0:
                break
            line = buf[at:nl]
            if line.startswith(b"MSG "):
                parts = line.split()
                end = nl + 2 + int(parts[-1]) + 2
                if len(buf) < end:
                    break
                index = int(parts[1].rsplit(b".", 1)[1])
                try:
                    body = json.loads(buf[nl + 2 : end - 2])
                    acks.seqs[index] = int(body["seq"]) if "seq" in body else None
                except (ValueError, KeyError, TypeError):
                    acks.seqs[index] = None
                at = end
                acks.progress.set()
                continue
            if line.startswith(b"PING"):
                writer.write(b"PONG\r\n")
            elif line.startswith(b"PONG"):
                acks.pong.set()
            elif line.startswith(b"-ERR"):
                acks.errors.append(line.decode(errors="replace"))
                acks.progress.set()
            at = nl + 2
        buf = buf[at:]


async def publish_raw(
    url: str,
    messages: Sequence[tuple[bytes, bytes]],
    *,
    window: int = 2000,
    wait_s: float = 10.0,
    on_progress: Callable[[int], None] | None = None,
) -> dict[int, int | None]:
    """Publish (subject, data) pairs over the raw NATS protocol, any bytes in the subject,
    each asking for a JetStream acknowledgement; return index -> stream sequence for those
    acknowledged (None where JetStream refused it). At most ``window`` are in flight; a
    message unanswered ``wait_s`` after the last answer is left out."""
    parts = urlsplit(url)
    reader, writer = await asyncio.open_connection(parts.hostname, parts.port or 4222)
    acks = _Acks()
    reading = asyncio.ensure_future(_read_acks(reader, writer, acks))
    try:
        options: dict[str, Any] = {"verbose": False, "pedantic": False, "lang": "fuzz"}
        if parts.username:
            options["user"] = parts.username
            options["pass"] = parts.password or ""
        writer.write(
            b"CONNECT %s\r\nSUB %s.* 1\r\nPING\r\n" % (json.dumps(options).encode(), _ACK_PREFIX)
        )
        await asyncio.wait_for(acks.pong.wait(), 10)
        sent = 0
        while sent < len(messages):
            while sent - len(acks.seqs) >= window:
                acks.progress.clear()
                try:
                    await asyncio.wait_for(acks.progress.wait(), wait_s)
                except TimeoutError:
                    break
            upto = min(len(messages), sent + max(1, window - (sent - len(acks.seqs))))
            frames = [
                b"PUB %s %s.%d %d\r\n%s\r\n" % (subject, _ACK_PREFIX, i, len(data), data)
                for i, (subject, data) in enumerate(messages[sent:upto], start=sent)
            ]
            writer.write(b"".join(frames))
            await writer.drain()
            sent = upto
            if on_progress is not None:
                on_progress(len(acks.seqs))
        deadline = time.monotonic() + wait_s
        while len(acks.seqs) < len(messages) and time.monotonic() < deadline:
            acks.progress.clear()
            try:
                await asyncio.wait_for(acks.progress.wait(), max(0.01, deadline - time.monotonic()))
                deadline = time.monotonic() + wait_s
            except TimeoutError:
                break
    finally:
        reading.cancel()
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()
    return dict(acks.seqs)


# --------------------------------------------------------------------------- accounting


@dataclass(slots=True)
class Accounting:
    """Where the published cases ended."""

    stored: int = 0
    dead_lettered: int = 0
    #: Backup reports at or below their source's highest seq and in no hole: the store takes
    #: each for a repeat of a report it packed (whose event_id it does not keep) and drops
    #: it as a duplicate (``core.catalog.is_repeated_report``), by design.
    repeated_reports: int = 0
    unaccounted: list[int] = field(default_factory=list)
    #: Dead-letter reasons by their first words (what the ingest said about the cases).
    reasons: Counter[str] = field(default_factory=Counter)


def account(database_url: str, cases: Sequence[Case], seqs: dict[int, int | None]) -> Accounting:
    """Match every acknowledged case with a stored event or a dead letter."""
    ids = [cases[i].event_id for i, s in seqs.items() if s is not None]
    with psycopg.connect(libpq_url(database_url)) as conn:
        stored = {
            str(r[0])
            for r in conn.execute(
                "SELECT event_id FROM events WHERE event_id = ANY(%s::uuid[])", (ids,)
            ).fetchall()
        }
        # A backup report the store packed is in a catalog of its job, by its source,
        # incarnation and seq.
        packed: set[tuple[str, str, str, int]] = set()
        jobs = {_job_of(cases[i].subject) for i in seqs}
        for job in (j for j in jobs if j is not None):
            payloads = conn.execute(CATALOG_PAYLOADS, {"job": job}).fetchall()
            packed.update((job, *key) for key in catalog_reports(r[0] for r in payloads))
        cursors = {
            (str(r[0]), str(r[1]), str(r[2])): (int(r[3]), r[4])
            for r in conn.execute(
                "SELECT job_id, source, incarnation, last_seq, holes FROM source_cursors"
            ).fetchall()
        }
        letters = conn.execute(
            "SELECT stream_seq, event_id, reason FROM dead_letters WHERE stream_seq = ANY(%s)"
            " OR event_id = ANY(%s)",
            ([s for s in seqs.values() if s is not None], ids),
        ).fetchall()
    by_seq = {int(r[0]): r[2] for r in letters if r[0] is not None}
    by_id = {str(r[1]): r[2] for r in letters if r[1] is not None}
    out = Accounting()
    for index, seq in seqs.items():
        if seq is None:
            continue
        event_id = cases[index].event_id
        report = _report_key(cases[index].data)
        if event_id in stored or report in packed:
            out.stored += 1
            continue
        reason = by_seq.get(seq) or by_id.get(event_id)
        if reason is None:
            if report is not None and _repeated(report, cursors):
                out.repeated_reports += 1
            else:
                out.unaccounted.append(index)
            continue
        out.dead_lettered += 1
        out.reasons[_reason_kind(reason)] += 1
    return out


def _job_of(subject: bytes) -> str | None:
    """The job a case was published to (its subject's third token), when it is a job id."""
    parts = subject.split(b".")
    if len(parts) < 3:
        return None
    job = parts[2].decode("utf-8", "replace")
    return job if re.fullmatch(IDENT_PATTERN, job) else None


def _repeated(report: tuple[str, str, str, int], cursors: dict[Any, Any]) -> bool:
    """Whether a report's seq is at or below its source's highest and in none of its holes
    (what the store drops as a repeat of a packed report)."""
    job, source, incarnation, seq = report
    cursor = cursors.get((job, source, incarnation))
    if cursor is None:
        return False
    last, holes = cursor
    return seq <= last and not any(lo <= seq <= hi for lo, hi in holes)


def _report_key(data: bytes) -> tuple[str, str, str, int] | None:
    """(job, source, incarnation, seq) of a case that is a backup report, else None."""
    try:
        env = json.loads(data)
        if env.get("type") != "backup.snapshot":
            return None
        return str(env["job_id"]), str(env["source"]), str(env["incarnation"]), int(env["seq"])
    except (
        ValueError,
        TypeError,
        KeyError,
        AttributeError,
        RecursionError,
        OverflowError,
    ):  # any bytes (a seq of Infinity included)
        return None


def _reason_kind(reason: str) -> str:
    head = reason.split(":", 1)[0]
    return head if len(head) <= 40 else head[:40]


def commit_gaps(
    database_url: str, start: datetime, end: datetime, *, until_end: bool
) -> list[float]:
    """Seconds between consecutive commits (of events or dead letters) from ``start`` to
    ``end`` (PostgreSQL's clock; needs ``track_commit_timestamp``), ``start`` included; the
    gap from the last commit to ``end`` too with ``until_end`` (input was still owed)."""
    with psycopg.connect(libpq_url(database_url)) as conn:
        rows = conn.execute(
            "SELECT DISTINCT t FROM ("
            " SELECT pg_xact_commit_timestamp(xmin) AS t FROM events"
            " UNION ALL SELECT pg_xact_commit_timestamp(xmin) FROM dead_letters) c"
            " WHERE t BETWEEN %s AND %s ORDER BY t",
            (start, end),
        ).fetchall()
    times = [start, *(r[0] for r in rows), *([end] if until_end else [])]
    return [(b - a).total_seconds() for a, b in itertools.pairwise(times)]


def _landed(database_url: str, jobs: Sequence[str]) -> int:
    """Stored events of the fuzz jobs plus dead letters: cheap to poll, and at least the
    cases accounted for once it reaches their number."""
    with psycopg.connect(libpq_url(database_url)) as conn:
        row = conn.execute(
            "SELECT (SELECT count(*) FROM events WHERE job_id = ANY(%s))"
            " + (SELECT count(*) FROM dead_letters)",
            (list(jobs),),
        ).fetchone()
    assert row is not None
    return int(row[0])


def _db_now(database_url: str) -> datetime:
    with psycopg.connect(libpq_url(database_url)) as conn:
        row = conn.execute("SELECT clock_timestamp()").fetchone()
    assert row is not None
    return row[0]  # type: ignore[no-any-return]


# --------------------------------------------------------------------------- the run


def _example(name: str) -> Path:
    path = EXAMPLES / name
    if not path.is_file():
        raise BenchError(f"{path} is missing: run the benchmark from a source checkout")
    return path


def _start_job(
    services: Stack, job_id: str, ranks: int, steps: int, log: Path
) -> subprocess.Popen[bytes]:
    command = [
        sys.executable, "-m", "controlplane", "run", "--nproc", str(ranks),
        "--nodes", str(ranks), "--job-id", job_id,
        "--policy", JOB_POLICY,
        str(_example("train.py")), "--steps", str(steps),
    ]  # fmt: skip
    env = {
        **os.environ,
        NATS_URL_ENV: services.nats_url,
        "ELASTIC_LOG_LEVEL": "WARNING",
        "OMP_NUM_THREADS": "1",
    }
    with log.open("wb") as out:
        return subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT)


def _job_state(store: PostgresEventStore, job_id: str) -> tuple[JobState | None, int]:
    events = store.read(job_id=job_id)
    view = fold(None, events) if events else None
    if view is None:
        return None, 0
    return view.state, view.last_step


@dataclass(slots=True)
class _Run:
    """What one run saw, filled in as it goes."""

    seqs: dict[int, int | None] = field(default_factory=dict)
    accounting: Accounting = field(default_factory=Accounting)
    publish_s: float = 0.0
    drain_s: float = 0.0
    overlap: bool = False
    state: JobState | None = None
    trained: int = 0
    crashed: bool = False
    job_exit: int | None = None
    serve_exit: int | None = None
    gaps: list[float] = field(default_factory=list)


@contextlib.contextmanager
def _serving(
    services: Stack, log: Path, out: _Run, say: Callable[[str], None]
) -> Iterator[subprocess.Popen[bytes]]:
    """``elasticctl serve``, its output to ``log`` (a warning per fuzzed source's sequence
    gap would flood stderr); stopped on the way out, killed (and counted a crash) when it
    does not stop within 30 s. Its log's end is shown when it did not end cleanly."""
    env = {
        **os.environ,
        NATS_URL_ENV: services.nats_url,
        DATABASE_URL_ENV: services.database_url,
        "ELASTIC_LOG_LEVEL": "WARNING",
        "ELASTIC_RENDEZVOUS_PORT": "0",
    }
    with log.open("wb") as sink:
        process = subprocess.Popen(
            [sys.executable, "-m", "controlplane", "serve"], env=env, stdout=sink, stderr=sink
        )
    try:
        yield process
    finally:
        out.crashed = out.crashed or process.poll() is not None
        process.terminate()
        try:
            out.serve_exit = process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
            out.crashed, out.serve_exit = True, None
        text = log.read_text(errors="replace")
        if out.crashed or out.serve_exit != 0 or "Traceback" in text:
            lines = [line for line in text.splitlines() if "sequence gap" not in line]
            say("serve did not end cleanly; the end of its log:\n" + "\n".join(lines[-40:]))


def _wait_training(
    store: PostgresEventStore, job_id: str, job: Any, serve: Any, until: float
) -> None:
    while _job_state(store, job_id)[1] < 1:
        if job.poll() is not None or serve.poll() is not None:
            raise BenchError("the job or serve ended before the job trained")
        if time.monotonic() > until:
            raise BenchError("the job did not start training")
        time.sleep(0.2)


def _drain(
    database_url: str, gen: Generator, cases: Sequence[Case], out: _Run, *, serve: Any, until: float
) -> None:
    """Wait until every case is accounted for, or nothing landed for 30 s (polling a count;
    the full match runs once the count says it may be complete)."""
    acknowledged = sum(1 for s in out.seqs.values() if s is not None)
    changed, landed = time.monotonic(), -1
    while serve.poll() is None and time.monotonic() < until:
        now = _landed(database_url, gen.jobs)
        if now != landed:
            changed, landed = time.monotonic(), now
        if now >= acknowledged:
            out.accounting = account(database_url, cases, out.seqs)
            if not out.accounting.unaccounted:
                return
        elif time.monotonic() - changed > 30:
            break
        time.sleep(0.2)
    out.accounting = account(database_url, cases, out.seqs)


def _wait_job(
    store: PostgresEventStore, job_id: str, job: Any, serve: Any, *, until: float, out: _Run
) -> None:
    """Until the job's view is COMPLETED or STOPPED; once its process ended, for at most
    another 60 s (its last events may be queued behind the fuzz cases)."""
    ended: float | None = None
    while True:
        out.state, out.trained = _job_state(store, job_id)
        if out.state in {JobState.COMPLETED, JobState.STOPPED} or serve.poll() is not None:
            return
        now = time.monotonic()
        if ended is None and job.poll() is not None:
            ended = now
        if now > until or (ended is not None and now - ended > 60):
            return
        time.sleep(0.5)


def run_fuzz_bench(
    *,
    cases: int = 100_000,
    seed: int = 0,
    ranks: int = 2,
    steps: int = 300,
    timeout_s: float = 600.0,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Run the benchmark (see the module docstring) and return its figures."""
    say = progress or (lambda _message: None)
    run_id = uuid.uuid4().hex[:8]
    job_id = f"fuzz-train-{run_id}"
    say(f"generating {cases:,} fuzz cases (seed {seed})")
    gen = Generator(seed, run_id)
    generated = gen.cases(cases)
    messages = [(c.subject, c.data) for c in generated]
    out = _Run()
    with (
        tempfile.TemporaryDirectory(prefix="elastic-bench-fuzz-") as tmp,
        stack(commit_times=True) as services,
        _serving(services, Path(tmp) / "serve.log", out, say) as serve,
    ):
        database_url = services.database_url
        store = PostgresEventStore.from_url(database_url)
        until = time.monotonic() + timeout_s
        say(f"job {job_id}: {ranks} ranks, {steps} steps; waiting for it to train")
        job = _start_job(services, job_id, ranks, steps, Path(tmp) / "job.log")
        try:
            try:
                _wait_training(store, job_id, job, serve, until)
            except BenchError as exc:
                raise BenchError(f"{exc}; see {tmp}/job.log") from None
            say(f"publishing {cases:,} cases while the job trains")
            started_at, started = _db_now(database_url), time.monotonic()
            out.seqs = asyncio.run(
                publish_raw(services.nats_url, messages, on_progress=_every(say, cases))
            )
            out.publish_s = time.monotonic() - started
            out.overlap = job.poll() is None
            say(f"published in {out.publish_s:.1f}s; accounting for every case")
            _drain(database_url, gen, generated, out, serve=serve, until=until)
            ended_at = _db_now(database_url)
            say("waiting for the job to complete")
            _wait_job(store, job_id, job, serve, until=until, out=out)
            out.crashed = serve.poll() is not None
        finally:
            if job.poll() is None:
                job.terminate()
            out.job_exit = job.wait(30)
            if out.state != JobState.COMPLETED:
                log = (Path(tmp) / "job.log").read_text(errors="replace").splitlines()
                say("the job did not complete; the end of its log:\n" + "\n".join(log[-40:]))
            store.close()
        out.gaps = commit_gaps(
            database_url, started_at, ended_at, until_end=bool(out.accounting.unaccounted)
        )
        # From the first publish to the last commit (or to giving up).
        out.drain_s = sum(out.gaps)
        where = services.where
    acknowledged = sum(1 for s in out.seqs.values() if s is not None)
    return {
        "cases": acknowledged,
        "stored": out.accounting.stored,
        "dead_lettered": out.accounting.dead_lettered,
        "repeated_reports": out.accounting.repeated_reports,
        "unaccounted": len(out.accounting.unaccounted),
        # What the unaccounted cases were, by kind (where to look when there are any).
        "unaccounted_kinds": dict(
            Counter(generated[i].kind for i in out.accounting.unaccounted).most_common()
        ),
        "crashes": int(out.crashed),
        "serve_exit": out.serve_exit,
        "stalls": sum(1 for g in out.gaps if g > STALL_S),
        "job_completed": out.state == JobState.COMPLETED,
        "generated": cases,
        "refused_by_nats": cases - acknowledged,
        "max_commit_gap_s": round(max(out.gaps, default=0.0), 3),
        "publish_s": round(out.publish_s, 3),
        "drain_s": round(out.drain_s, 3),
        "cases_per_s": round(acknowledged / out.drain_s, 1) if out.drain_s else None,
        "job_trained_while_publishing": out.overlap,
        "job_steps": out.trained,
        "job_state": None if out.state is None else out.state.value,
        "job_exit": out.job_exit,
        "kinds": dict(sorted(Counter(c.kind for c in generated).items())),
        "dead_letter_reasons": dict(out.accounting.reasons.most_common()),
        "seed": seed,
        **where,
    }


def _every(say: Callable[[str], None], total: int) -> Callable[[int], None]:
    step = max(1, total // 10)
    mark = [step]

    def report(acked: int) -> None:
        if acked >= mark[0]:
            say(f"  {acked:,} of {total:,} acknowledged by JetStream")
            mark[0] += step

    return report
