// One job: summary, the state machine's history (a band over time and a table), the loss
// curve with the faults marked, and each incident's timeline (phases as bars on a time axis,
// every point linking to the event behind it, shown in the side panel).
"use strict";

(() => {
  const { el, svg, get, run, status, time, seconds, number, ticks, axes, ms, stateBadge, ApiError } = Elastic;

  /** [[25, 25], [31, 33]] -> "25, 31-33" (the steps a rollback skipped); "" for none. */
  function stepRanges(ranges) {
    return (ranges || []).map(([a, b]) => (a === b ? String(a) : `${a}-${b}`)).join(", ");
  }

  const JOB = decodeURIComponent(location.pathname.replace(/\/+$/, "").split("/").pop());
  const JOB_PATH = "/jobs/" + encodeURIComponent(JOB);
  const TERMINAL = new Set(["COMPLETED", "STOPPED"]);
  const REFRESH_MS = 5000;
  const WIDTH = 960;
  // The loss curve asks for at most this many points (a long job has a step a second).
  const LOSS_POINTS = 4 * WIDTH;
  const POINT_LABELS = {
    fault: "fault", detected: "detected", decided: "decided", acked: "acked by all",
    restored: "restored by all", first_step: "first step",
  };
  let refresh = null;

  document.getElementById("job-id").textContent = JOB;
  document.title = JOB + " · elastic control plane";

  function eventLink(position, text) {
    return el("a", {
      href: "#event-" + position, class: "event-link", dataset: { position },
      text: text || "#" + position,
    });
  }

  /** A <dl> of [label, value] pairs, each pair in its own <div> (one grid cell). */
  function factList(facts, dataset) {
    return el("dl", { class: "facts", dataset },
      facts.map(([k, v]) => el("div", {}, el("dt", { text: k }), el("dd", {}, v))));
  }

  // ---------------------------------------------------------------- summary

  function renderSummary(job) {
    const facts = [
      ["state", stateBadge(job.state)],
      ["generation", job.generation],
      ["world size", job.world_size],
      ["last step", job.last_step],
      ["last loss", number(job.last_loss, 5)],
      ["completed at step", job.completed_step ?? "—"],
      ["incidents", job.incidents + (job.open_incident ? " (one open)" : "")],
      ["events", job.events],
      ["registered (UTC)", time(job.registered_at)],
      ["last event (UTC)", time(job.last_event_at)],
    ];
    const list = factList(facts);
    const nodes = [list];
    if (job.policy) {
      const rows = Object.entries(job.policy).map(([k, v]) => el(
        "tr", {}, el("th", { text: k }), el("td", { text: typeof v === "object" ? JSON.stringify(v) : v }),
      ));
      nodes.push(el("details", { class: "policy" }, el("summary", { text: "Policy" }),
        el("table", { class: "table compact" }, el("tbody", {}, rows))));
    }
    document.getElementById("summary").replaceChildren(...nodes);
  }

  // ---------------------------------------------------------------- axes

  /** A horizontal time axis (seconds after t0) along y, from x0 to x1. */
  function timeAxis(scale, t0Ms, spanS, y, x0, x1) {
    const group = svg("g", { class: "axis" }, svg("line", { x1: x0, x2: x1, y1: y, y2: y }));
    for (const s of ticks(0, spanS, 8)) {
      const x = scale(t0Ms + s * 1000);
      group.append(
        svg("line", { x1: x, x2: x, y1: y, y2: y + 4 }),
        svg("text", { x, y: y + 16, "text-anchor": "middle", text: "+" + seconds(s) }),
      );
    }
    return group;
  }

  // ---------------------------------------------------------------- state machine

  function renderStates(job) {
    const history = job.history || [];
    const startMs = Math.min(...[job.registered_at, history[0] && history[0].at].filter(Boolean).map(ms));
    let endMs = Math.max(...[job.last_event_at, ...history.map((h) => h.at)].filter(Boolean).map(ms));
    const segments = [];
    let state = history.length ? history[0].from_state : job.state;
    let from = startMs;
    for (const change of history) {
      segments.push({ state, from, to: ms(change.at), position: null });
      state = change.to_state;
      from = ms(change.at);
    }
    segments.push({ state, from, to: endMs });
    if (!(endMs > startMs)) endMs = startMs + 1000;
    const left = 24, right = 24, top = 8, band = 34;
    const scale = (t) => left + ((t - startMs) / (endMs - startMs)) * (WIDTH - left - right);
    const root = svg("svg", {
      class: "chart-svg", viewBox: `0 0 ${WIDTH} ${top + band + 30}`, role: "img",
      "aria-label": "the job's state over time",
    });
    for (const seg of segments) {
      if (!(seg.to >= seg.from) || Number.isNaN(seg.from)) continue;
      const x = scale(seg.from);
      const w = Math.max(2, scale(seg.to) - x);
      const g = svg("g", { class: "segment", dataset: { state: seg.state } },
        svg("title", { text: `${seg.state}: ${time(new Date(seg.from).toISOString())} → ${time(new Date(seg.to).toISOString())} (${seconds((seg.to - seg.from) / 1000)})` }),
        svg("rect", { class: "seg state-" + seg.state.toLowerCase(), x, y: top, width: w, height: band }));
      if (w > 8 * seg.state.length) {
        g.append(svg("text", { class: "seg-label", x: x + w / 2, y: top + band / 2 + 4, "text-anchor": "middle", text: seg.state }));
      }
      root.append(g);
    }
    root.append(timeAxis(scale, startMs, (endMs - startMs) / 1000, top + band + 4, left, WIDTH - right));
    document.getElementById("state-band").replaceChildren(root);

    const rows = history.map((h) => el(
      "tr", { dataset: { position: h.position } },
      el("td", { text: time(h.at) }),
      el("td", {}, stateBadge(h.from_state)),
      el("td", {}, stateBadge(h.to_state)),
      el("td", { text: h.reason }),
      el("td", {}, eventLink(h.position)),
    ));
    document.querySelector("#history tbody").replaceChildren(...rows);
  }

  // ---------------------------------------------------------------- goodput

  const TERMS = ["productive", "recomputation", "backup", "stragglers", "detection", "decision",
    "restore", "resume", "waiting", "idle"];

  /** One bar of the wall time, a segment per term, and each incident's cost. */
  function renderGoodput(found) {
    const target = document.getElementById("goodput-bar");
    const body = document.querySelector("#goodput-incidents tbody");
    if (!found || !(found.wall_s > 0)) {
      target.replaceChildren(el("p", { class: "hint", text: "No wall time yet." }));
      body.replaceChildren();
      return;
    }
    const left = 24, right = 24, top = 24, band = 30;
    const width = WIDTH - left - right;
    const root = svg("svg", {
      class: "chart-svg", viewBox: `0 0 ${WIDTH} ${top + band + 8}`, role: "img",
      "aria-label": "the job's wall time by term",
    });
    root.append(svg("text", { x: left, y: 16, text:
      `wall ${seconds(found.wall_s)} · ETTR ${number(found.ettr, 4)} · ` +
      `${found.productive_steps} productive step(s), ${found.recomputed_steps} recomputed` }));
    let x = left;
    for (const term of TERMS) {
      const value = found.seconds[term] || 0;
      if (!(value > 0)) continue;
      const w = (value / found.wall_s) * width;
      const share = ((100 * value) / found.wall_s).toFixed(1) + "%";
      const g = svg("g", { class: "segment", dataset: { term } },
        svg("title", { text: `${term}: ${seconds(value)} (${share})` }),
        svg("rect", { class: "seg term-" + term, x, y: top, width: Math.max(1, w), height: band }));
      if (w > 7 * term.length) {
        g.append(svg("text", { class: "seg-label", x: x + w / 2, y: top + band / 2 + 4, "text-anchor": "middle", text: term }));
      }
      root.append(g);
      x += w;
    }
    target.replaceChildren(root);
    body.replaceChildren(...found.incidents.map((i) => el("tr", { dataset: { incident: i.incident_id } },
      el("td", { text: i.incident_id.slice(0, 8) }),
      el("td", { text: i.kind }),
      ...["detection", "decision", "restore", "resume"].map((t) => el("td", { text: seconds(i.phases[t]) })),
      el("td", { text: seconds(i.recomputation_s) }),
      el("td", { text: i.steps_lost ?? "—" }),
      el("td", { text: seconds(i.cost_s) }),
      el("td", { text: (100 * i.ettr_lost).toFixed(2) + "%" }),
    )));
  }

  // ---------------------------------------------------------------- loss curve

  function renderLoss(curve, incidents) {
    const target = document.getElementById("loss-chart");
    const points = (curve && curve.points) || [];
    if (!points.length) {
      target.replaceChildren(el("p", { class: "hint", text: "No step reported a loss yet." }));
      return;
    }
    const height = 300, left = 64, right = 20, top = 24, bottom = 36;
    const steps = points.map((p) => p.step);
    const losses = points.map((p) => p.loss);
    const faults = Object.entries((curve && curve.faults) || {});
    let s0 = Math.min(...steps, ...faults.map(([, s]) => s));
    let s1 = Math.max(...steps, ...faults.map(([, s]) => s));
    if (s1 === s0) s1 = s0 + 1;
    let l0 = Math.min(...losses), l1 = Math.max(...losses);
    const pad = (l1 - l0) * 0.05 || Math.abs(l1) * 0.05 || 1;
    l0 -= pad;
    l1 += pad;
    const x = (s) => left + ((s - s0) / (s1 - s0)) * (WIDTH - left - right);
    const y = (l) => top + (1 - (l - l0) / (l1 - l0)) * (height - top - bottom);
    const root = svg("svg", {
      class: "chart-svg", viewBox: `0 0 ${WIDTH} ${height}`, role: "img",
      "aria-label": "loss by step, faults marked",
    });
    const box = { width: WIDTH, height, left, right, top, bottom };
    root.append(axes(box, x, y, ticks(s0, s1, 10), ticks(l0, l1, 6), "step"));
    const order = new Map(incidents.map((inc, i) => [inc.incident_id, i + 1]));
    for (const [incidentId, step] of faults) {
      const n = order.get(incidentId) || "?";
      const link = svg("a", { href: "#incident-" + incidentId, class: "fault-marker", dataset: { incident: incidentId, step } },
        svg("title", { text: `incident ${n}: fault at step ${step}` }),
        svg("line", { x1: x(step), x2: x(step), y1: top - 6, y2: height - bottom }),
        svg("text", {
          x: x(step) + (x(step) > WIDTH * 0.75 ? -4 : 4), y: top + 4,
          "text-anchor": x(step) > WIDTH * 0.75 ? "end" : "start", text: `incident ${n} · step ${step}`,
        }));
      root.append(link);
    }
    root.append(svg("polyline", {
      class: "loss-line", fill: "none",
      points: points.map((p) => `${x(p.step).toFixed(1)},${y(p.loss).toFixed(1)}`).join(" "),
      dataset: { points: points.length },
    }));
    const last = points[points.length - 1];
    root.append(svg("circle", { class: "loss-last", cx: x(last.step), cy: y(last.loss), r: 3 },
      svg("title", { text: `step ${last.step}: loss ${last.loss}` })));
    target.replaceChildren(root);
  }

  // ---------------------------------------------------------------- incidents

  function timelineChart(incident) {
    const points = incident.points || [];
    const at = Object.fromEntries(points.map((p) => [p.name, ms(p.at)]));
    if (!points.length) return el("p", { class: "hint", text: "No point of this timeline is known yet." });
    const t0 = Math.min(...points.map((p) => ms(p.at)));
    let t1 = Math.max(...points.map((p) => ms(p.at)));
    if (!(t1 > t0)) t1 = t0 + 1;
    const phases = incident.phases || [];
    const left = 130, right = 90, rowH = 24, top = 6, levelH = 20;
    const scale = (t) => left + ((t - t0) / (t1 - t0)) * (WIDTH - left - right);
    // Close points go on separate levels: each takes the first level whose last marker is
    // far enough to its left.
    const ends = [];
    const levels = points.map((p) => {
      const px = scale(ms(p.at));
      let level = ends.findIndex((end) => px - end >= 20);
      if (level < 0) level = ends.push(-Infinity) - 1;
      ends[level] = px;
      return level;
    });
    const markerRow = ends.length * levelH + 8;
    const height = top + markerRow + phases.length * rowH + 30;
    const root = svg("svg", {
      class: "chart-svg timeline", viewBox: `0 0 ${WIDTH} ${height}`, role: "img",
      "aria-label": "incident timeline: phases on a time axis",
    });
    const barsTop = top + markerRow;
    // Vertical guides from each point down through the phase rows.
    points.forEach((p) => {
      const px = scale(ms(p.at));
      root.append(svg("line", { class: "guide", x1: px, x2: px, y1: top + 12, y2: barsTop + phases.length * rowH }));
    });
    phases.forEach((phase, i) => {
      const y = barsTop + i * rowH;
      const row = svg("g", { class: "phase", dataset: { phase: phase.name, seconds: phase.seconds ?? "" } },
        svg("text", { class: "phase-name", x: left - 8, y: y + rowH / 2 + 4, "text-anchor": "end", text: phase.name }));
      const a = at[phase.start], b = at[phase.end];
      if (a !== undefined && b !== undefined) {
        const x = scale(a);
        row.append(svg("rect", {
          class: "phase-bar phase-" + phase.name, x, y: y + 4, height: rowH - 8,
          width: Math.max(3, scale(b) - x),
        }, svg("title", { text: `${phase.name}: ${phase.start} → ${phase.end}, ${seconds(phase.seconds)}` })));
      }
      row.append(svg("text", { class: "phase-seconds", x: WIDTH - right + 8, y: y + rowH / 2 + 4, text: phase.seconds === null || phase.seconds === undefined ? "not reached" : seconds(phase.seconds) }));
      root.append(row);
    });
    // Point markers, numbered; each one is a link to the event behind it.
    points.forEach((p, i) => {
      const px = scale(ms(p.at));
      const py = top + 10 + levels[i] * levelH;
      root.append(svg("a", { href: "#event-" + p.position, class: "point", dataset: { point: p.name, position: p.position } },
        svg("title", { text: `${i + 1}. ${POINT_LABELS[p.name] || p.name} at ${time(p.at)} (event #${p.position})` }),
        svg("circle", { cx: px, cy: py, r: 8 }),
        svg("text", { x: px, y: py + 4, "text-anchor": "middle", text: i + 1 })));
    });
    root.append(timeAxis(scale, t0, (t1 - t0) / 1000, barsTop + phases.length * rowH + 2, left, WIDTH - right));
    return root;
  }

  function renderIncident(incident, n) {
    const t0 = incident.points && incident.points.length ? ms(incident.points[0].at) : NaN;
    const facts = [
      ["outcome", incident.outcome || "open"],
      ["members", (incident.members || []).join(", ") || "—"],
      ["opened (UTC)", time(incident.opened_at)],
      ["step at fault", incident.step_at_fault],
      ["downtime", seconds(incident.downtime_s)],
      ["steps lost", incident.steps_lost ?? "—"],
      ["decisions", incident.decisions],
      ["detected by", (incident.detections || []).map((p) => eventLink(p))],
    ];
    const pointRows = (incident.points || []).map((p, i) => el(
      "tr", { dataset: { point: p.name } },
      el("td", { class: "num", text: i + 1 }),
      el("td", { text: POINT_LABELS[p.name] || p.name }),
      el("td", { text: time(p.at) }),
      el("td", { class: "num", text: "+" + seconds((ms(p.at) - t0) / 1000) }),
      el("td", {}, eventLink(p.position, "event #" + p.position)),
    ));
    const decisionRows = (incident.history || []).map((d) => el(
      "tr", {},
      el("td", { text: time(d.at) }),
      el("td", { class: "num", text: d.generation }),
      el("td", { text: d.mode }),
      el("td", { text: (d.world || []).join(", ") }),
      el("td", { class: "num", text: d.restore_step }),
      el("td", { text: d.restore_from }),
      el("td", { class: "skips", text: stepRanges(d.skip) }),
      el("td", { text: d.reason }),
      el("td", {}, eventLink(d.position)),
    ));
    const last = (incident.history || [])[(incident.history || []).length - 1];
    const skipped = incident.anomaly_step !== null && incident.anomaly_step !== undefined && last ? stepRanges(last.skip) : "";
    return el("article", { class: "incident", id: "incident-" + incident.incident_id, dataset: { incidentId: incident.incident_id } },
      el("h3", {}, `Incident ${n} · ${incident.kind} · `, el("span", { class: "outcome outcome-" + (incident.outcome || "open"), text: incident.outcome || "open" }),
        incident.downtime_s !== null && incident.downtime_s !== undefined ? ` · ${seconds(incident.downtime_s)} down` : "",
        incident.steps_lost !== null && incident.steps_lost !== undefined ? ` · ${incident.steps_lost} steps lost` : "",
        incident.anomaly_step !== null && incident.anomaly_step !== undefined ? ` · anomaly at step ${incident.anomaly_step}` : "",
        skipped ? ` · skips step${skipped.includes(",") || skipped.includes("-") ? "s" : ""} ${skipped}` : ""),
      el("p", { class: "reasons", text: (incident.reasons || []).join("; ") }),
      factList(facts),
      el("div", { class: "chart" }, timelineChart(incident)),
      el("table", { class: "table points" },
        el("thead", {}, el("tr", {}, ["", "point", "at (UTC)", "after the fault", "event"].map((h) => el("th", { text: h })))),
        el("tbody", {}, pointRows)),
      decisionRows.length ? el("details", { class: "decisions" },
        el("summary", { text: `Decisions (${decisionRows.length})` }),
        el("table", { class: "table" },
          el("thead", {}, el("tr", {}, ["at (UTC)", "generation", "mode", "world", "restore step", "from", "skipped steps", "why", "event"].map((h) => el("th", { text: h })))),
          el("tbody", {}, decisionRows))) : null,
    );
  }

  // ---------------------------------------------------------------- the event panel

  const eventCache = new Map();

  async function fetchEvent(position) {
    if (!eventCache.has(position)) {
      const page = await get(`${JOB_PATH}/events?after=${position - 1}&limit=1`);
      const found = (page.events || []).find((e) => e.position === position);
      if (!found) throw new ApiError(404, `event #${position} is not one of this job's`);
      eventCache.set(position, found);
    }
    return eventCache.get(position);
  }

  async function showEvent() {
    const panel = document.getElementById("event-panel");
    const match = /^#event-(\d+)$/.exec(location.hash);
    if (!match) {
      panel.hidden = true;
      return;
    }
    const position = Number(match[1]);
    const body = document.getElementById("event-body");
    document.getElementById("event-title").textContent = "Event #" + position;
    body.replaceChildren(el("p", { text: "Loading…" }));
    panel.hidden = false;
    panel.dataset.position = position;
    document.querySelectorAll("main .selected").forEach((n) => n.classList.remove("selected"));
    document.querySelectorAll(`main [data-position="${position}"]`).forEach((n) => n.classList.add("selected"));
    try {
      const event = await fetchEvent(position);
      if (panel.dataset.position !== String(position)) return;
      const facts = [
        ["type", event.type], ["source", event.source], ["generation", event.generation],
        ["seq", event.seq], ["emitted (UTC)", time(event.emitted_at)],
        ["recorded (UTC)", time(event.recorded_at)], ["event id", event.event_id],
      ];
      body.replaceChildren(
        factList(facts, { type: event.type }),
        el("pre", { class: "payload", text: JSON.stringify(event.payload, null, 2) }),
      );
    } catch (exc) {
      body.replaceChildren(el("p", { class: "error", text: exc.message }));
    }
  }

  document.getElementById("event-close").addEventListener("click", (event) => {
    event.preventDefault();
    history.replaceState(null, "", location.pathname + location.search);
    showEvent();
  });
  window.addEventListener("hashchange", showEvent);

  // ---------------------------------------------------------------- loading

  async function load() {
    if (refresh !== null) clearTimeout(refresh);
    const [job, listed, curve, found] = await Promise.all([
      get(JOB_PATH), get(JOB_PATH + "/incidents"), get(JOB_PATH + "/loss?points=" + LOSS_POINTS),
      get(JOB_PATH + "/goodput").catch((e) => (e instanceof ApiError && e.status === 404 ? null : Promise.reject(e))),
    ]);
    const summaries = Array.isArray(listed) ? listed : listed.incidents || [];
    const incidents = await Promise.all(summaries.map(
      (i) => get(JOB_PATH + "/incidents/" + encodeURIComponent(i.incident_id))));
    incidents.sort((a, b) => a.opened_position - b.opened_position);
    renderSummary(job);
    renderStates(job);
    renderGoodput(found);
    renderLoss(curve, incidents);
    const list = document.getElementById("incident-list");
    list.replaceChildren(...incidents.map((inc, i) => renderIncident(inc, i + 1)));
    if (!incidents.length) list.append(el("p", { class: "hint", text: "No incident: nothing went wrong." }));
    status("");
    document.getElementById("content").hidden = false;
    await showEvent();
    if (!TERMINAL.has(job.state)) refresh = setTimeout(() => run(load), REFRESH_MS);
  }

  run(load);
})();
