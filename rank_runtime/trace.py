"""Timing marks of a member's recovery, for benchmarks: off unless ``ELASTIC_TRACE_DIR`` is set.

With ``ELASTIC_TRACE_DIR`` set, each member appends one JSON line per timed part of its
recovery to ``<dir>/<member>-<pid>.jsonl``: what was timed (``what``), the generation it
belongs to (``generation``: the one being entered; None before the member knows it), when it
started (``start``: ``time.time()``, comparable across the processes of one machine) and how
long it took (``seconds``: ``time.perf_counter()`` around it), with a few fields of its own.
``elasticctl bench mttr`` sets it (``ELASTIC_BENCH_TRACE``) and reports each part's median per
role (``Trace.summary``). Without the variable ``span`` and ``mark`` cost a dictionary lookup.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from collections.abc import Iterator
from typing import Any

from rank_runtime.identity import MEMBER_ENV

#: Where members write their timing marks (unset: nowhere).
TRACE_DIR_ENV = "ELASTIC_TRACE_DIR"

_lock = threading.RLock()
#: The open trace file and its path (``_out``).
_open: dict[str, Any] = {}


def enabled() -> bool:
    """Whether this process writes timing marks."""
    return bool(os.environ.get(TRACE_DIR_ENV))


def _out() -> Any:
    directory = os.environ.get(TRACE_DIR_ENV, "")
    member = os.environ.get(MEMBER_ENV, "member")
    path = os.path.join(directory, f"{member}-{os.getpid()}.jsonl")
    if _open.get("path") != path:
        close()
        os.makedirs(directory, exist_ok=True)
        _open["file"] = open(path, "a", buffering=1, encoding="utf-8")  # noqa: SIM115
        _open["path"] = path
    return _open["file"]


def close() -> None:
    """Close the trace file (the next mark opens it again)."""
    with _lock, contextlib.suppress(KeyError):
        _open.pop("path", None)
        _open.pop("file").close()


def mark(what: str, start: float, seconds: float, **fields: Any) -> None:
    """Record that ``what`` started at ``start`` (``time.time()``) and took ``seconds``
    (``fields``: ``generation`` and anything of its own)."""
    if not enabled():
        return
    record = {"what": what, "generation": fields.pop("generation", None), "start": start,
              "seconds": seconds, "pid": os.getpid(), **fields}  # fmt: skip
    line = json.dumps(record, separators=(",", ":"), default=str)
    with _lock:
        _out().write(line + "\n")


@contextlib.contextmanager
def span(what: str, **fields: Any) -> Iterator[dict[str, Any]]:
    """Time the block as ``what`` (``mark`` when it ends, also when it raises). The block may
    add fields (``generation``) to the dictionary it is given."""
    if not enabled():
        yield fields
        return
    start, began = time.time(), time.perf_counter()
    try:
        yield fields
    finally:
        mark(what, start, time.perf_counter() - began, **fields)
