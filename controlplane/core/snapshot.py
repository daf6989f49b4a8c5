"""Job views as bytes: what a new leader or a restarted one starts from instead of the log.

A view snapshot is every job's view folded through one log position; a process starts from
the newest one and folds only the log after it (``controlplane.app.load_views``), so its
start-up costs what the tail costs, not what the log's age does. A snapshot is a cache of the
fold, never a source of truth: the log stays whole, replay and export read the log only, and a
snapshot whose ``fold_version()`` is not this release's is ignored (the log is folded again and
a new snapshot taken). The version names the fold's logic (bump ``FOLD_REVISION`` when a
fold case changes what it makes of an event) and the views' shape (a fingerprint of their
JSON schema, so a field added to ``JobView`` or ``Member`` retires old snapshots by itself).

The encoding is pydantic's JSON of the dataclasses, zlib-compressed (JSON with a key per
field compresses well); decoding validates it back into the same dataclasses, equal to the
view encoded. Pure: no I/O.
"""

from __future__ import annotations

import functools
import hashlib
import json
import zlib
from typing import Final

from pydantic import TypeAdapter

from controlplane.core.view import JobView

#: Raised with every change to what the fold makes of the log (a fold case, a rule).
FOLD_REVISION: Final = 11

_VIEW: Final = TypeAdapter(JobView)


@functools.cache
def fold_version() -> str:
    """What a snapshot must have been written by to be read: the fold's revision and a
    fingerprint of the views' shape."""
    schema = json.dumps(_VIEW.json_schema(mode="serialization"), sort_keys=True)
    return f"fold-{FOLD_REVISION}-{hashlib.sha256(schema.encode()).hexdigest()[:12]}"


#: zlib level: the fastest (the encoding is done on the leader's loop).
_LEVEL: Final = 1


class SnapshotUnreadable(ValueError):
    """A snapshot's bytes are not a view this release can read."""


def encode_view(view: JobView) -> bytes:
    """``view`` as a snapshot's bytes."""
    return zlib.compress(_VIEW.dump_json(view), _LEVEL)


def decode_view(body: bytes) -> JobView:
    """The view ``encode_view`` made ``body`` of (``SnapshotUnreadable`` if it is not one)."""
    try:
        return _VIEW.validate_json(zlib.decompress(body))
    except (zlib.error, ValueError) as exc:
        raise SnapshotUnreadable(f"not a job view: {exc}") from exc
