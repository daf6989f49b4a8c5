"""PNG figures of ``elasticctl simulate --sweep``: ETTR against the swept value (scale,
backup interval, spares, any model field), a line a strategy, Young/Daly's interval marked
where the sweep is of one.

matplotlib is the ``plot`` extra (``pip install 'elastic-controlplane[plot]'``), imported
only here and only when a figure is drawn, with its file-only backend.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

#: Young/Daly's optimum in the sweep's terms, where the swept field is an interval.
_OPTIMA = {
    "checkpoint_interval_s": "checkpoint_interval_s",
    "backup_interval": "backup_interval_steps",
}
_LABELS = {
    "ranks": "ranks",
    "spares": "spare nodes",
    "backup_interval": "backup interval (steps)",
    "checkpoint_interval_s": "checkpoint interval (s)",
}


class PlotError(Exception):
    """A figure cannot be drawn (matplotlib missing, nothing swept)."""


def ettr_figure(out: Mapping[str, Any], path: Path) -> Path:
    """Draw ``out`` (``elasticctl simulate --json`` of a sweep) to the PNG ``path``."""
    runs: Sequence[Mapping[str, Any]] = out["runs"]
    swept = [run for run in runs if "sweep" in run]
    if not swept:
        raise PlotError("--plot draws a sweep: give --sweep FIELD=V1,V2,...")
    try:
        import matplotlib as mpl

        mpl.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise PlotError(
            f"--plot needs matplotlib ({exc}): pip install 'elastic-controlplane[plot]'"
        ) from None
    field = next(iter(swept[0]["sweep"]))
    lines: dict[str, list[tuple[float, float]]] = {}
    for run in swept:
        lines.setdefault(run["strategy"], []).append((run["sweep"][field], run["ettr"]))
    figure, axes = plt.subplots(figsize=(7, 4.2), dpi=120)
    try:
        for strategy, points in lines.items():
            points.sort()
            axes.plot([x for x, _ in points], [y for _, y in points], marker="o", label=strategy)
        optimum = out.get("young_daly", {}).get(_OPTIMA.get(field, ""))
        if optimum:
            axes.axvline(optimum, linestyle="--", color="grey", label=f"Young/Daly {optimum:g}")
        if field == "ranks":
            axes.set_xscale("log", base=2)
        axes.set_xlabel(_LABELS.get(field, field))
        axes.set_ylabel("ETTR (productive / wall time)")
        axes.set_title(
            f"{out['days']:g} days, {out['preset']} failures, seed {out['seed']}"
            + ("" if field == "ranks" else f", {out['ranks']:,} ranks"),
            fontsize=10,
        )
        axes.grid(alpha=0.3)
        axes.legend(fontsize=8)
        figure.tight_layout()
        path.parent.mkdir(parents=True, exist_ok=True)
        figure.savefig(path, format="png")
    finally:
        plt.close(figure)
    return path
