"""Coverage-guided fuzz target (atheris, libFuzzer) over decode -> encode -> append.

    python tests/fuzz/ingest_target.py CORPUS_DIR -max_total_time=60

The property is ``controlplane.bench.fuzz.check_one``: nothing raises, and whatever a message
becomes (an event or a dead letter) PostgreSQL stores; with ELASTIC_DATABASE_URL set (a
migrated database) each input is appended to it for real, else to the in-memory store, which
refuses what PostgreSQL refuses. An empty CORPUS_DIR is seeded with valid events from the
bench's generator. The first input byte picks the subject: the envelope's own (most inputs),
a fixed one, or the rest of the first line of the input.
"""

from __future__ import annotations

import itertools
import os
import sys
from pathlib import Path

import atheris

with atheris.instrument_imports():
    from controlplane.bench.fuzz import Generator, check_one
    from controlplane.store.memory import InMemoryEventStore

_FIXED = "elastic.evt.fuzz-h-0.n0.m0.member.heartbeat"


def _store() -> object:
    url = os.environ.get("ELASTIC_DATABASE_URL")
    if not url:
        return InMemoryEventStore()
    from controlplane.store.postgres import PostgresEventStore

    return PostgresEventStore.from_url(url)


STORE = _store()


def _subject(data: bytes) -> tuple[str, bytes]:
    if not data:
        return _FIXED, data
    pick, rest = data[0] % 4, data[1:]
    if pick == 3:
        line, _, body = rest.partition(b"\n")
        return line.decode(errors="backslashreplace"), body
    if pick == 2:
        return _FIXED, rest
    # The subject the envelope claims, so that valid-looking inputs get past the subject check.
    import json

    try:
        env = json.loads(rest)
        subject = f"elastic.evt.{env['job_id']}.{env['source'].replace('/', '.')}.{env['type']}"
    except Exception:
        subject = _FIXED
    return subject, rest


_COUNT = itertools.count(1)


def test_one_input(data: bytes) -> None:
    subject, body = _subject(data)
    check_one(subject, body, STORE, next(_COUNT))


def _seed(corpus: Path) -> None:
    corpus.mkdir(parents=True, exist_ok=True)
    if any(corpus.iterdir()):
        return
    for i, case in enumerate(Generator(seed=0, run="h", jobs=1).cases(300)):
        if case.kind == "valid":
            (corpus / f"seed-{i}").write_bytes(b"\x00" + case.data)


if __name__ == "__main__":
    dirs = [a for a in sys.argv[1:] if not a.startswith("-")]
    if dirs:
        _seed(Path(dirs[0]))
    atheris.Setup(sys.argv, test_one_input)
    atheris.Fuzz()
