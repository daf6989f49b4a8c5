"""The packed form of a ``backup.catalog`` (version 2): a catalog's columns in one string.

A catalog keeps, for each backup report it packs, what binds the report to its sender
(source, incarnation, seq) and what the report says (shard, nbytes, checksum, seconds,
holders). Version 1 kept each as a JSON list; at a backup every ten seconds that was about
170 bytes a rank a backup on disk (``jsonb`` puts a 4-byte entry and a numeric's header on
every value, and a sha256 digest took 43 characters of base64). Version 2 keeps the same
values, exactly, in one string: the columns laid out one after the other, compressed with
zlib, in unpadded base64url. What repeats from one report to the next compresses away (the
seqs, shards and sizes as differences from the previous report, the names' common parts);
what cannot is each report's digest (32 bytes, kept as bytes) and its process's incarnation.

Layout, before compression (integers little-endian)::

    u8   layout (1)
    u32  n, the reports
    i64  shard[i] - shard[i-1] - 1        (n of them; shard[-1] = -1)
    i64  seq[i] - seq[i-1]                (seq[-1] = 0)
    i64  nbytes[i] - nbytes[i-1]          (nbytes[-1] = 0)
    f64  seconds[i]
    4 x (u32 length, text): the sources, the incarnations, each report's holders (joined by
         ","), each report's checksum ("" for a sha256 in lowercase hex: its digest is below);
         a text's values are joined by "\\n" (no identifier or checksum holds either)
    32 bytes for each report whose checksum is "" above: its sha256 digest, in order

Pure: standard library only, no I/O.
"""

from __future__ import annotations

import base64
import math
import re
import struct
import zlib
from array import array
from dataclasses import dataclass
from itertools import accumulate
from typing import Final

from schemas.common import IDENT_PATTERN, INT64_MAX, SOURCE_PATTERN

#: The layout byte this module writes (and the only one it reads).
LAYOUT: Final = 1
#: A sha256 checksum as members send it; kept as its 32 bytes.
SHA256_HEX: Final = re.compile(r"sha256:[0-9a-f]{64}\Z")
_SHA256_PREFIX = "sha256:"
#: Holders per report at most (as ``backup.snapshot`` allows).
MAX_HOLDERS: Final = 8
#: Bytes a packed body may take once decompressed, per report (a zip bomb is refused): four
#: 8-byte columns, the longest source, incarnation, eight holders and a checksum, a digest.
_MAX_REPORT_BYTES: Final = 32 + 130 + 65 + 8 * 65 + 146 + 32

_IDENT = IDENT_PATTERN.strip("^$")
_SOURCE = SOURCE_PATTERN.strip("^$")
_CHECKSUM = r"[a-z0-9]{1,16}:[0-9a-f]{1,128}"
#: One regular expression over a whole text: every value valid, one C-level match.
_SOURCES = re.compile(rf"(?:{_SOURCE})(?:\n(?:{_SOURCE}))*\Z")
_INCARNATIONS = re.compile(rf"(?:{_IDENT})(?:\n(?:{_IDENT}))*\Z")
_HOLDER_LIST = rf"(?:(?:{_IDENT})(?:,(?:{_IDENT})){{0,{MAX_HOLDERS - 1}}})?"
_HOLDERS = re.compile(rf"{_HOLDER_LIST}(?:\n{_HOLDER_LIST})*\Z")
_CHECKSUMS = re.compile(rf"(?:{_CHECKSUM})?(?:\n(?:{_CHECKSUM})?)*\Z")
_HEADER = struct.Struct("<BI")
_LENGTH = struct.Struct("<I")


class PackError(ValueError):
    """A packed catalog that does not decode, or holds a value its report could not."""


@dataclass(frozen=True, slots=True)
class CatalogColumns:
    """A catalog's reports as columns, one value per report, each as its member sent it."""

    sources: list[str]
    incarnations: list[str]
    seqs: list[int]
    shards: list[int]
    nbytes: list[int]
    checksums: list[str]
    seconds: list[float]
    holders: list[list[str]]

    def __len__(self) -> int:
        return len(self.sources)


def _deltas(values: list[int], offset: int) -> bytes:
    previous = -offset
    out = array("q")
    for value in values:
        out.append(value - previous - offset)
        previous = value
    return out.tobytes()


def _text(values: list[str]) -> bytes:
    data = "\n".join(values).encode()
    return _LENGTH.pack(len(data)) + data


def encode(columns: CatalogColumns) -> str:
    """The packed string of ``columns`` (validated values: ``decode`` gives them back)."""
    checksums: list[str] = []
    digests = bytearray()
    for checksum in columns.checksums:
        if SHA256_HEX.match(checksum):
            checksums.append("")
            digests += bytes.fromhex(checksum[len(_SHA256_PREFIX) :])
        else:
            checksums.append(checksum)
    body = b"".join((
        _HEADER.pack(LAYOUT, len(columns)),
        _deltas(columns.shards, 1),
        _deltas(columns.seqs, 0),
        _deltas(columns.nbytes, 0),
        array("d", columns.seconds).tobytes(),
        _text(columns.sources),
        _text(columns.incarnations),
        _text([",".join(h) for h in columns.holders]),
        _text(checksums),
        bytes(digests),
    ))  # fmt: skip
    return base64.urlsafe_b64encode(zlib.compress(body, 3)).rstrip(b"=").decode()


def _ints(body: memoryview, at: int, n: int, offset: int) -> tuple[list[int], int]:
    deltas = array("q")
    deltas.frombytes(body[at : at + 8 * n])
    if offset:
        values = list(accumulate(deltas, lambda previous, d: previous + d + offset, initial=-1))
        return values[1:], at + 8 * n
    return list(accumulate(deltas)), at + 8 * n


def decode(packed: str, count: int) -> CatalogColumns:
    """The columns ``packed`` holds, each value checked as its report's field is; ``count``:
    the reports it must hold. ``PackError`` says what is wrong."""
    try:
        compressed = base64.urlsafe_b64decode(packed + "=" * (-len(packed) % 4))
        inflater = zlib.decompressobj()
        raw = inflater.decompress(compressed, count * _MAX_REPORT_BYTES + 64)
    except (ValueError, zlib.error) as exc:
        raise PackError(f"packed catalog does not decode: {exc}") from None
    if inflater.unconsumed_tail or not inflater.eof or inflater.unused_data:
        raise PackError("packed catalog: not one whole zlib stream of its reports' size")
    body = memoryview(raw)
    if len(body) < _HEADER.size:
        raise PackError("packed catalog: no header")
    layout, n = _HEADER.unpack_from(body)
    if n < 1:
        raise PackError("packed catalog holds no report")
    if layout != LAYOUT:
        raise PackError(f"packed catalog: layout {layout}, this build reads {LAYOUT}")
    if n != count:
        raise PackError(f"packed catalog holds {n} reports, count says {count}")
    at = _HEADER.size
    if len(body) < at + 32 * n:
        raise PackError("packed catalog: columns cut short")
    shards, at = _ints(body, at, n, 1)
    seqs, at = _ints(body, at, n, 0)
    nbytes, at = _ints(body, at, n, 0)
    seconds = array("d")
    seconds.frombytes(body[at : at + 8 * n])
    at += 8 * n
    texts: list[str] = []
    for _ in range(4):
        if len(body) < at + _LENGTH.size:
            raise PackError("packed catalog: texts cut short")
        (length,) = _LENGTH.unpack_from(body, at)
        at += _LENGTH.size
        if len(body) < at + length:
            raise PackError("packed catalog: texts cut short")
        try:
            texts.append(bytes(body[at : at + length]).decode())
        except UnicodeDecodeError:
            raise PackError("packed catalog: a text is not UTF-8") from None
        at += length
    sources_text, incarnations_text, holders_text, checksums_text = texts
    for text, pattern, name in (
        (sources_text, _SOURCES, "a source"),
        (incarnations_text, _INCARNATIONS, "an incarnation"),
        (holders_text, _HOLDERS, "a report's holders"),
        (checksums_text, _CHECKSUMS, "a checksum"),
    ):
        if not pattern.match(text):
            raise PackError(f"packed catalog: {name} is not valid")
    sources = sources_text.split("\n")
    incarnations = incarnations_text.split("\n")
    holders = [h.split(",") if h else [] for h in holders_text.split("\n")]
    checksums = checksums_text.split("\n")
    if not len(sources) == len(incarnations) == len(holders) == len(checksums) == n:
        raise PackError(f"packed catalog: a text does not hold {n} values")
    if "controlplane" in sources:
        raise PackError("a backup report comes from a member, not the control plane")
    digests = checksums.count("")
    if len(body) != at + 32 * digests:
        raise PackError(f"packed catalog: {len(body) - at} bytes of digests for {digests}")
    for i, checksum in enumerate(checksums):
        if not checksum:
            checksums[i] = _SHA256_PREFIX + body[at : at + 32].hex()
            at += 32
    if min(seqs) < 1 or min(shards) < 0 or min(nbytes) < 0:
        raise PackError("packed catalog: a seq below 1, or a shard or size below 0")
    if max(*seqs, *shards, *nbytes) > INT64_MAX:
        raise PackError("packed catalog: a seq, shard or size beyond int64")
    if not all(s >= 0 and math.isfinite(s) for s in seconds):
        raise PackError("packed catalog: seconds below 0 or not finite")
    return CatalogColumns(
        sources, incarnations, seqs, shards, nbytes, checksums, seconds.tolist(), holders
    )
