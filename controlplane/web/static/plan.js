// The plan view: GET /simulate with the form's values (kept in the address, so a plan can be
// shared), ETTR against the swept value as lines (one a strategy), and the runs as a table.
"use strict";

(() => {
  const { el, svg, get, run, status, ticks, axes, seconds } = Elastic;
  const WIDTH = 900;
  const COLORS = { spares: "#2f6fdf", shrink: "#8a5cd6", mixed: "#2e9e5b", restart: "#c8322d" };
  const form = document.getElementById("plan");

  function query() {
    const data = new FormData(form);
    const params = new URLSearchParams();
    for (const key of ["ranks", "days", "preset", "spares", "seed"]) params.set(key, data.get(key));
    params.set("strategy", data.getAll("strategy").join(","));
    const field = data.get("field");
    const values = String(data.get("values") || "").replace(/\s+/g, "");
    if (field && values) params.set("sweep", field + "=" + values);
    return params;
  }

  function restore(params) {
    for (const key of ["ranks", "days", "preset", "spares", "seed"]) {
      if (params.has(key)) form.elements[key].value = params.get(key);
    }
    if (params.has("strategy")) {
      const chosen = new Set(params.get("strategy").split(","));
      for (const box of form.querySelectorAll("input[name=strategy]")) box.checked = chosen.has(box.value);
    }
    const sweep = params.get("sweep");
    form.elements.field.value = sweep ? sweep.split("=")[0] : "";
    form.elements.values.value = sweep ? sweep.split("=")[1] || "" : "";
  }

  function chart(out) {
    const target = document.getElementById("plan-chart");
    const swept = out.runs.filter((r) => r.sweep);
    if (!swept.length) {
      target.replaceChildren(el("p", { class: "hint", text: "Sweep a value to draw ETTR against it." }));
      return;
    }
    const field = Object.keys(swept[0].sweep)[0];
    const lines = new Map();
    for (const r of swept) {
      if (!lines.has(r.strategy)) lines.set(r.strategy, []);
      lines.get(r.strategy).push([r.sweep[field], r.ettr]);
    }
    const xs = swept.map((r) => r.sweep[field]);
    const ys = swept.map((r) => r.ettr);
    const height = 320, left = 64, right = 130, top = 20, bottom = 40;
    let x0 = Math.min(...xs), x1 = Math.max(...xs);
    if (x1 === x0) x1 = x0 + 1;
    let y0 = Math.min(...ys), y1 = Math.max(...ys);
    const pad = (y1 - y0) * 0.08 || 0.01;
    y0 = Math.max(0, y0 - pad);
    y1 = Math.min(1, y1 + pad);
    if (y1 <= y0) y1 = y0 + 0.01;
    const x = (v) => left + ((v - x0) / (x1 - x0)) * (WIDTH - left - right);
    const y = (v) => top + (1 - (v - y0) / (y1 - y0)) * (height - top - bottom);
    const root = svg("svg", {
      class: "chart-svg", viewBox: `0 0 ${WIDTH} ${height}`, role: "img",
      "aria-label": "ETTR against " + field + ", a line a strategy",
    });
    const box = { width: WIDTH, height, left, right, top, bottom };
    root.append(axes(box, x, y, ticks(x0, x1, 8), ticks(y0, y1, 6), field),
      svg("text", { x: 4, y: top - 6, text: "ETTR" }));
    const optimum = out.young_daly && {
      checkpoint_interval_s: out.young_daly.checkpoint_interval_s,
      backup_interval: out.young_daly.backup_interval_steps,
    }[field];
    if (optimum && optimum >= x0 && optimum <= x1) {
      root.append(svg("g", { class: "fault-marker" },
        svg("line", { x1: x(optimum), x2: x(optimum), y1: top, y2: height - bottom }),
        svg("text", { x: x(optimum) + 4, y: top + 10, text: "Young/Daly " + optimum })));
    }
    let row = 0;
    for (const [strategy, points] of lines) {
      points.sort((a, b) => a[0] - b[0]);
      const color = COLORS[strategy] || "#555";
      root.append(svg("polyline", {
        class: "plan-line", fill: "none", stroke: color, dataset: { strategy },
        points: points.map(([px, py]) => `${x(px).toFixed(1)},${y(py).toFixed(1)}`).join(" "),
      }));
      for (const [px, py] of points) {
        root.append(svg("circle", { cx: x(px), cy: y(py), r: 3, fill: color },
          svg("title", { text: `${strategy}, ${field} ${px}: ETTR ${py}` })));
      }
      const ly = top + 14 + row * 18;
      root.append(svg("line", { x1: WIDTH - right + 12, x2: WIDTH - right + 32, y1: ly - 4, y2: ly - 4, stroke: color, "stroke-width": 2 }),
        svg("text", { x: WIDTH - right + 38, y: ly, text: strategy }));
      row += 1;
    }
    target.replaceChildren(root);
  }

  function table(out) {
    const rows = out.runs.map((r) => {
      const lost = Object.entries(r.breakdown_s)
        .filter(([k, v]) => k !== "productive" && v > 0)
        .sort((a, b) => b[1] - a[1]).slice(0, 3)
        .map(([k, v]) => `${k} ${seconds(v)}`).join(", ");
      const swept = r.sweep ? Object.entries(r.sweep).map(([k, v]) => `${k}=${v}`).join(" ") : "—";
      return el("tr", { dataset: { strategy: r.strategy } },
        el("td", { text: r.strategy }), el("td", { text: swept }),
        el("td", { class: "num", text: r.ettr.toFixed(4) }),
        el("td", { class: "num", text: r.incidents }),
        el("td", { class: "num", text: seconds(r.mean_downtime_s) }),
        el("td", { text: lost || "—" }), el("td", { text: r.stopped || "" }));
    });
    document.getElementById("runs").tBodies[0].replaceChildren(...rows);
    const yd = out.young_daly;
    document.getElementById("young-daly").textContent = yd
      ? `${out.failures_per_day} failures a day (MTBF ${seconds(yd.mtbf_s)}): Young/Daly checkpoints every ${seconds(yd.checkpoint_interval_s)}, backs up every ${yd.backup_interval_steps} steps.`
      : "No failures.";
  }

  async function simulate() {
    const params = new URLSearchParams(location.search);
    status("Simulating…");
    const out = await get("/simulate?" + params.toString());
    chart(out);
    table(out);
    document.getElementById("result").hidden = false;
    status("");
  }

  form.addEventListener("submit", (event) => {
    event.preventDefault();
    history.replaceState(null, "", location.pathname + "?" + query().toString());
    run(simulate);
  });
  const given = new URLSearchParams(location.search);
  if (given.toString()) {
    restore(given);
    run(simulate);
  }
})();
