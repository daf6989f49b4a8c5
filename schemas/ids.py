"""Event ids: UUID version 7 (RFC 9562), time-ordered.

An event_id is the producer's idempotency key and the log keeps a unique index on it. Random
(version 4) ids land on a random leaf of that index, so once the index outgrows memory every
insert reads and dirties a different page; version 7 ids start with the time in milliseconds,
so the inserts of a moment share the index's right edge. Any canonical UUID stays valid on the
wire: the order only makes the log cheaper to write.
"""

from __future__ import annotations

import os
import time

_RAND_A = 0xFFF
_RAND_B = (1 << 62) - 1


def uuid7(unix_ms: int, rand: int) -> str:
    """The canonical text of the version 7 UUID of ``unix_ms`` with 74 random bits ``rand``."""
    value = (
        (unix_ms & 0xFFFF_FFFF_FFFF) << 80
        | 0x7 << 76
        | ((rand >> 62) & _RAND_A) << 64
        | 0b10 << 62
        | (rand & _RAND_B)
    )
    h = f"{value:032x}"
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


def new_event_id() -> str:
    """A fresh event id: now, in milliseconds, and 74 bits from the OS's random source."""
    return uuid7(time.time_ns() // 1_000_000, int.from_bytes(os.urandom(10)))
