"""What the post-mortem commands print: JSON objects (the REST API's models where there is
one) and rich tables."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import asdict
from datetime import datetime
from typing import Any

from rich.console import Console, Group, RenderableType
from rich.table import Table
from rich.text import Text

from controlplane.api.render import history_out, incident_timeline, member_out
from controlplane.core.decide import natural_key
from controlplane.core.goodput import INCIDENT_TERMS, TERMS, Goodput
from controlplane.core.replay import Counterfactual, IncidentFacts
from controlplane.core.timeline import PHASES, POINTS, timeline
from controlplane.core.view import Incident, JobView, Member
from controlplane.postmortem.replay import Replayed
from schemas.events import JobPolicy

# --------------------------------------------------------------------------- JSON


def incidents_of(view: JobView) -> list[Incident]:
    """A job's incidents in the order they opened."""
    return sorted(view.incidents.values(), key=lambda i: i.opened_position)


def _members(view: JobView) -> list[Member]:
    return sorted(
        view.members.values(),
        key=lambda m: (m.rank is None, m.rank or 0, natural_key(m.member_id)),
    )


def view_json(replayed: Replayed) -> dict[str, Any]:
    """``elasticctl replay --json``: the job's view at the point replayed to."""
    view = replayed.view
    return {
        "job_id": view.job_id,
        "name": view.name,
        "state": view.state.value,
        "generation": view.generation,
        "world": list(view.world),
        "last_step": view.last_step,
        "last_loss": view.last_loss,
        "completed_step": view.completed_step,
        "position": view.last_position,
        "at": _iso(view.last_recorded_at),
        "events": replayed.events,
        "stopped_early": replayed.stopped,
        "policy": view.policy.model_dump(mode="json") if view.policy is not None else None,
        "members": [
            member_out(m, heartbeat=view.heartbeats.get(m.member_id)).model_dump(mode="json")
            for m in _members(view)
        ],
        "history": [h.model_dump(mode="json") for h in history_out(view)],
        "incidents": [incident_timeline(i).model_dump(mode="json") for i in incidents_of(view)],
        "anomalies": list(view.anomalies),
    }


def timeline_json(view: JobView) -> dict[str, Any]:
    """``elasticctl timeline --json``: every incident's timeline (the API's model)."""
    return {
        "job_id": view.job_id,
        "state": view.state.value,
        "position": view.last_position,
        "incidents": [incident_timeline(i).model_dump(mode="json") for i in incidents_of(view)],
    }


def _iso(moment: datetime | None) -> str | None:
    return moment.isoformat() if moment is not None else None


def _seconds(a: datetime | None, b: datetime | None) -> float | None:
    return None if a is None or b is None else round((b - a).total_seconds(), 6)


def _diff(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else round(b - a, 6)


def facts_json(facts: IncidentFacts | None) -> dict[str, Any] | None:
    if facts is None:
        return None
    out = asdict(facts)
    for key, value in out.items():
        if isinstance(value, datetime):
            out[key] = value.isoformat()
        elif isinstance(value, tuple):
            out[key] = list(value)
    out["decision"] = facts.decision
    return out


def changed_policy(before: JobPolicy | None, after: JobPolicy) -> dict[str, Any]:
    """Fields of ``after`` that differ from ``before`` (the defaults when None)."""
    old = (before or JobPolicy()).model_dump(mode="json")
    new = after.model_dump(mode="json")
    return {
        k: {"recorded": old.get(k), "counterfactual": v} for k, v in new.items() if old.get(k) != v
    }


def _pair_json(
    r: IncidentFacts | None, b: IncidentFacts | None, c: IncidentFacts | None
) -> dict[str, Any]:
    return {
        "recorded": facts_json(r),
        "redecided": facts_json(b),
        "counterfactual": facts_json(c),
        # Against the recording, and against the same replay under the recorded policy
        # (what the policy alone changes).
        "detection_shift_s": _seconds(r.detected_at, c.detected_at) if r and c else None,
        "downtime_shift_s": _diff(r.downtime_s, c.downtime_s) if r and c else None,
        "policy_detection_shift_s": (_seconds(b.detected_at, c.detected_at) if b and c else None),
        "policy_downtime_shift_s": _diff(b.downtime_s, c.downtime_s) if b and c else None,
    }


def _side(result: Counterfactual) -> dict[str, Any]:
    return {
        "state": result.replayed.state.value,
        "incidents": len(result.incidents),
        "last_step": result.replayed.last_step,
        "decisions": len(result.decisions),
        "member_events": result.member_events,
        "unplayed": result.unplayed,
        # Until when it replays the recording; a simulation after (None: throughout).
        "replay_until": (
            result.replay_until.isoformat() if result.replay_until is not None else None
        ),
    }


def counterfactual_json(result: Counterfactual, baseline: Counterfactual) -> dict[str, Any]:
    """``elasticctl replay --policy ... --json``: the recording, the re-decided baseline (the
    same replay under the recorded policy) and the counterfactual, incident by incident."""
    return {
        "job_id": result.job_id,
        "overrides": dict(result.overrides),
        "policy": {
            "recorded": (
                result.recorded_policy.model_dump(mode="json")
                if result.recorded_policy is not None
                else None
            ),
            "counterfactual": result.policy.model_dump(mode="json"),
            "changed": changed_policy(result.recorded_policy, result.policy),
        },
        "recorded": {
            "state": result.recorded.state.value,
            "incidents": len(result.recorded_incidents),
            "last_step": result.recorded.last_step,
        },
        "redecided": _side(baseline),
        "counterfactual": _side(result),
        "incidents": [
            _pair_json(r, b, c)
            for r, b, c in itertools.zip_longest(
                result.recorded_incidents, baseline.incidents, result.incidents
            )
        ],
        "notes": list(result.notes),
    }


# --------------------------------------------------------------------------- terminal


def _clock(moment: datetime | None) -> str:
    if moment is None:
        return "-"
    return moment.strftime("%Y-%m-%d %H:%M:%S.") + f"{moment.microsecond // 1000:03d}"


def _secs(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}s"


def timeline_table(incident: Incident) -> RenderableType:
    """One incident: its points (with the event behind each), phases, downtime, steps lost."""
    line = timeline(incident)
    fault = line.points["fault"]
    title = (
        f"incident {incident.incident_id} · {incident.kind} · {incident.outcome or 'open'}"
        f" · members {', '.join(incident.members) or '-'}"
    )
    table = Table(title=title, title_justify="left", expand=False)
    table.add_column("point")
    table.add_column("position", justify="right")
    table.add_column("at (UTC)")
    table.add_column("since fault", justify="right")
    table.add_column("phase to next")
    table.add_column("seconds", justify="right")
    phases = dict(zip(POINTS, [*PHASES, ""], strict=True))
    for name in POINTS:
        mark = line.points[name]
        phase = phases[name]
        table.add_row(
            name,
            str(mark.position) if mark else "-",
            _clock(mark.at) if mark else "not reached",
            _secs(_seconds(fault.at, mark.at)) if mark and fault else "-",
            phase,
            _secs(line.phases.get(phase)) if phase else "",
        )
    downtime = incident.downtime_s if incident.downtime_s is not None else line.downtime_s
    lost = incident.steps_lost if incident.steps_lost is not None else line.steps_lost
    foot = Text(
        f"downtime {_secs(downtime)} · steps lost {'-' if lost is None else lost}"
        f" · decisions {len(incident.decisions)}"
    )
    reasons = Text("; ".join(incident.reasons)[:500], style="dim")
    return Group(table, foot, reasons, Text(""))


def print_timelines(console: Console, view: JobView) -> None:
    incidents = incidents_of(view)
    console.print(
        f"[bold]{view.job_id}[/bold] {view.state.value} · generation {view.generation}"
        f" · {len(incidents)} incident(s) · log position {view.last_position}"
    )
    if not incidents:
        console.print("no incidents")
    for incident in incidents:
        console.print(timeline_table(incident))


def print_view(console: Console, replayed: Replayed) -> None:
    """``elasticctl replay``: the state, the world, the members and the incidents."""
    view = replayed.view
    point = f"position {view.last_position} ({_clock(view.last_recorded_at)} UTC)"
    console.print(
        f"[bold]{view.job_id}[/bold] {view.state.value} at {point}: {replayed.events} events"
        f" folded{' (the log goes on after)' if replayed.stopped else ''}"
    )
    loss = f" (loss {view.last_loss:g})" if view.last_loss is not None else ""
    console.print(
        f"generation {view.generation} · world {len(view.world)}: {' '.join(view.world) or '-'}"
        f" · last step {view.last_step}{loss}"
    )
    members = Table(title="members", title_justify="left")
    for column in ("member", "node", "rack", "role", "status", "rank", "phase", "step"):
        members.add_column(column, justify="right" if column in ("rank", "step") else "left")
    for m in _members(view):
        members.add_row(
            m.member_id, m.node, m.rack, m.role.value, m.status.value,
            "-" if m.rank is None else str(m.rank), view.phase(m.member_id).value, str(m.step),
        )  # fmt: skip
    console.print(members)
    if view.history:
        history = Table(title="state machine", title_justify="left")
        for column in ("position", "at (UTC)", "from", "to", "reason"):
            history.add_column(column)
        for h in view.history:
            history.add_row(
                str(h.position), _clock(h.at), h.from_state.value, h.to_state.value,
                h.reason[:120],
            )  # fmt: skip
        console.print(history)
    for incident in incidents_of(view):
        console.print(timeline_table(incident))
    if view.anomalies:
        console.print(f"[yellow]{len(view.anomalies)} fold anomalies[/yellow], e.g. "
                      f"{view.anomalies[0]}")  # fmt: skip


def _time(moment: datetime | None) -> str:
    if moment is None:
        return "-"
    return moment.strftime("%H:%M:%S.") + f"{moment.microsecond // 1000:03d}"


def _decision(f: IncidentFacts) -> str:
    if f.mode is None:
        return "-"
    return f"{f.mode} to {len(f.world)}, gen {f.generation}, step {f.restore_step}"


#: Rows of the side-by-side table: label, how to show a side, and the field a shift is of.
_ROWS: tuple[tuple[str, Callable[[IncidentFacts], str], str | None], ...] = (
    ("fault", lambda f: _time(f.fault_at), "fault_at"),
    ("detected", lambda f: _time(f.detected_at), "detected_at"),
    ("reason", lambda f: ", ".join(f.reasons) or "-", None),
    ("members", lambda f: ", ".join(f.members) or "-", None),
    ("decided", lambda f: _time(f.decided_at), "decided_at"),
    ("decision", _decision, None),
    ("first step", lambda f: _time(f.first_step_at), "first_step_at"),
    ("downtime", lambda f: _secs(f.downtime_s), "downtime_s"),
    ("steps lost", lambda f: "-" if f.steps_lost is None else str(f.steps_lost), None),
    ("outcome", lambda f: f.outcome or "open", None),
)


def _shift(a_facts: IncidentFacts | None, b_facts: IncidentFacts | None, key: str | None) -> str:
    if a_facts is None or b_facts is None or key is None:
        return ""
    a, b = getattr(a_facts, key), getattr(b_facts, key)
    value = _seconds(a, b) if isinstance(a, datetime) or isinstance(b, datetime) else _diff(a, b)
    return "" if value is None else f"{value:+.3f}s"


def print_counterfactual(
    console: Console, result: Counterfactual, baseline: Counterfactual
) -> None:
    """``elasticctl replay --policy``: the recorded incidents, the same replay under the
    recorded policy, and the counterfactual, side by side."""
    changed = changed_policy(result.recorded_policy, result.policy)
    what = ", ".join(f"{k}: {v['recorded']} -> {v['counterfactual']}" for k, v in changed.items())
    console.print(f"[bold]{result.job_id}[/bold] counterfactual: {what or 'no change'}")
    console.print(
        f"recorded: {result.recorded.state.value}, {len(result.recorded_incidents)} incident(s)"
        f" · counterfactual: {result.replayed.state.value}, {len(result.incidents)}"
        f" incident(s), {len(result.decisions)} decisions over {result.member_events}"
        " member events (times UTC)"
    )
    pairs = itertools.zip_longest(result.recorded_incidents, baseline.incidents, result.incidents)
    for n, (r, b, c) in enumerate(pairs, start=1):
        day = next((f.fault_at for f in (r, b, c) if f is not None), None)
        table = Table(
            title=f"incident {n}" + (f" · {day:%Y-%m-%d}" if day else ""), title_justify="left"
        )
        for column in ("", "recorded", "re-decided", "counterfactual"):
            table.add_column(column)
        table.add_column("vs recorded", justify="right")
        table.add_column("vs re-decided", justify="right")
        for label, show, key in _ROWS:
            table.add_row(
                label,
                *(show(f) if f is not None else "-" for f in (r, b, c)),
                _shift(r, c, key),
                _shift(b, c, key),
            )
        console.print(table)
    if not result.recorded_incidents and not result.incidents:
        console.print("no incidents on either side")
    console.print(
        "[dim]re-decided: the same replay under the recorded policy (the decider run after"
        " each member event and just after its deadlines); 'vs re-decided' is what the"
        " policy alone changes.[/dim]"
    )
    for note in result.notes:
        console.print(f"[dim]note: {note}[/dim]")


def print_goodput(console: Console, found: Goodput) -> None:
    """``elasticctl goodput``: the job's wall time by term, each incident's cost, each
    generation's terms."""
    end = "ended" if found.final else "so far"
    ettr = "-" if found.ettr is None else f"{found.ettr:.4f}"
    console.print(
        f"[bold]{found.job_id}[/bold] wall {found.wall_s:.2f}s ({end}) · ETTR {ettr} ·"
        f" {found.productive_steps} productive step(s), {found.recomputed_steps} recomputed"
    )
    terms = Table(title="wall time by term", title_justify="left")
    terms.add_column("term")
    terms.add_column("seconds", justify="right")
    terms.add_column("share", justify="right")
    for term in TERMS:
        value = found.seconds[term]
        share = f"{value / found.wall_s:.2%}" if found.wall_s else "-"
        terms.add_row(term, f"{value:.3f}", share)
    console.print(terms)
    if found.incidents:
        costs = Table(title="incidents", title_justify="left")
        for column in ("incident", "kind", "outcome", *INCIDENT_TERMS, "recomputation",
                       "steps lost", "cost", "ETTR lost"):  # fmt: skip
            left = column in ("incident", "kind", "outcome")
            costs.add_column(column, justify="left" if left else "right")
        for i in found.incidents:
            costs.add_row(
                i.incident_id[:8], i.kind, i.outcome or "open",
                *(f"{i.phases[t]:.3f}" for t in INCIDENT_TERMS), f"{i.recomputation_s:.3f}",
                "-" if i.steps_lost is None else str(i.steps_lost), f"{i.cost_s:.3f}",
                f"{i.ettr_lost:.2%}",
            )  # fmt: skip
        console.print(costs)
    gens = Table(title="generations", title_justify="left")
    gens.add_column("generation", justify="right")
    gens.add_column("wall", justify="right")
    for term in TERMS:
        gens.add_column(term, justify="right")
    gens.add_column("ETTR", justify="right")
    for g in found.generations:
        gens.add_row(
            str(g.generation), f"{g.wall_s:.3f}", *(f"{g.seconds[t]:.3f}" for t in TERMS),
            "-" if g.ettr is None else f"{g.ettr:.4f}",
        )  # fmt: skip
    console.print(gens)
    for note in found.not_measured:
        console.print(f"not measured: {note}", highlight=False)
