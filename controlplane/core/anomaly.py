"""Loss anomalies: the robust spike threshold, the window a rollback skips, step ranges.

Pure. A rank reports a non-finite loss or gradient norm itself (``train.anomaly``); a spike
is found here, from the job's step records, against the losses before it: a loss above
``median + k x MAD`` of the last ``loss_spike_window`` losses of the current timeline. The
median and the MAD ignore the few outliers a window holds, where a mean and a standard
deviation would rise with them.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence

#: A MAD of zero (a flat loss) would make any rise a spike: the spread is at least this
#: fraction of the median's magnitude.
MIN_SPREAD = 1e-3

Ranges = tuple[tuple[int, int], ...]


def spike_threshold(losses: Sequence[float], k: float) -> float:
    """``median + k x MAD`` of ``losses`` (the MAD at least ``MIN_SPREAD`` of the median's
    magnitude, and never zero)."""
    median = statistics.median(losses)
    mad = statistics.median(abs(x - median) for x in losses)
    spread = max(mad, MIN_SPREAD * abs(median), 1e-12)
    return median + k * spread


def window(anomaly_step: int, restore_step: int, skip_steps: int) -> tuple[int, int] | None:
    """The steps a rollback to ``restore_step`` skips for an anomaly at ``anomaly_step``: the
    ``skip_steps`` steps ending at it, none at or before the restore step (None: none)."""
    if skip_steps <= 0 or anomaly_step <= restore_step:
        return None
    return max(restore_step + 1, anomaly_step - skip_steps + 1), anomaly_step


def merged(ranges: Iterable[tuple[int, int]], extra: tuple[int, int] | None = None) -> Ranges:
    """``ranges`` and ``extra`` as ascending, disjoint inclusive ranges (adjacent ones
    joined)."""
    items = sorted([*ranges, *([extra] if extra is not None else [])])
    out: list[tuple[int, int]] = []
    for first, last in items:
        if out and first <= out[-1][1] + 1:
            out[-1] = (out[-1][0], max(out[-1][1], last))
        else:
            out.append((first, last))
    return tuple(out)


def skipped(step: int, ranges: Iterable[tuple[int, int]]) -> bool:
    """Whether ``step`` lies in one of ``ranges``."""
    return any(first <= step <= last for first, last in ranges)


def describe(ranges: Iterable[tuple[int, int]]) -> str:
    """``25, 31-33`` for a person to read."""
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in ranges)
