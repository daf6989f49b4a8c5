// Shared by the pages: reading the API (with the reader's bearer token), building DOM and SVG
// nodes (text always as text, never parsed as HTML), formatting times and durations.
"use strict";

const Elastic = (() => {
  const TOKEN_KEY = "elastic.apiToken";
  // The app may be mounted under a prefix: everything before "/ui" is the app's root.
  const ROOT = location.pathname.replace(/\/ui(\/.*)?$/, "");
  const API = ROOT + "/api/v1";
  const SVG_NS = "http://www.w3.org/2000/svg";

  class ApiError extends Error {
    constructor(status, detail) {
      super(detail);
      this.status = status;
    }
  }

  function token() {
    try {
      return sessionStorage.getItem(TOKEN_KEY) || "";
    } catch (_) {
      return "";
    }
  }

  function setToken(value) {
    try {
      if (value) sessionStorage.setItem(TOKEN_KEY, value);
      else sessionStorage.removeItem(TOKEN_KEY);
    } catch (_) {
      // storage disabled: the token lasts as long as the page
    }
    memoryToken = value;
  }
  let memoryToken = "";

  async function get(path) {
    const headers = { Accept: "application/json" };
    const bearer = token() || memoryToken;
    if (bearer) headers.Authorization = "Bearer " + bearer;
    let response;
    try {
      response = await fetch(API + path, { headers, cache: "no-cache" });
    } catch (exc) {
      throw new ApiError(0, "the API cannot be reached (" + exc.message + ")");
    }
    if (!response.ok) {
      let detail = response.statusText || "error";
      try {
        const body = await response.json();
        if (body && body.detail) detail = typeof body.detail === "string" ? body.detail : JSON.stringify(body.detail);
      } catch (_) {
        // not JSON: keep the status text
      }
      throw new ApiError(response.status, detail);
    }
    return response.json();
  }

  function fill(node, attrs, children) {
    for (const [key, value] of Object.entries(attrs || {})) {
      if (value === undefined || value === null || value === false) continue;
      if (key === "text") node.textContent = String(value);
      else if (key === "dataset") Object.assign(node.dataset, value);
      else if (key.startsWith("on")) node.addEventListener(key.slice(2), value);
      else node.setAttribute(key, value === true ? "" : String(value));
    }
    for (const child of children.flat(Infinity)) {
      if (child === undefined || child === null || child === false) continue;
      node.append(child instanceof Node ? child : document.createTextNode(String(child)));
    }
    return node;
  }

  /** An HTML element: el("td", {class: "x"}, "text", otherNode). */
  function el(tag, attrs, ...children) {
    return fill(document.createElement(tag), attrs, children);
  }

  /** An SVG element (same arguments as el). */
  function svg(tag, attrs, ...children) {
    return fill(document.createElementNS(SVG_NS, tag), attrs, children);
  }

  function ms(iso) {
    return iso ? Date.parse(iso) : NaN;
  }

  /** "2026-01-01 00:00:20.800" (UTC). */
  function time(iso) {
    if (!iso) return "—";
    const d = new Date(iso);
    if (Number.isNaN(d.getTime())) return String(iso);
    return d.toISOString().replace("T", " ").replace(/Z$/, "").replace(/\.000$/, "");
  }

  /** "0.4 s", "5.0 s", "2 min 3 s". */
  function seconds(value) {
    if (value === null || value === undefined) return "—";
    if (value < 60) return (value < 10 ? value.toFixed(value < 1 ? 2 : 1) : value.toFixed(0)) + " s";
    const minutes = Math.floor(value / 60);
    return minutes + " min " + Math.round(value - minutes * 60) + " s";
  }

  function number(value, digits) {
    if (value === null || value === undefined) return "—";
    return typeof value === "number" && digits !== undefined ? value.toPrecision(digits) : String(value);
  }

  /** Round tick values covering [lo, hi], about `count` of them. */
  function ticks(lo, hi, count) {
    if (!(hi > lo)) return [lo];
    const raw = (hi - lo) / Math.max(1, count);
    const power = Math.pow(10, Math.floor(Math.log10(raw)));
    const step = [1, 2, 5, 10].map((m) => m * power).find((s) => s >= raw) || raw;
    const out = [];
    for (let v = Math.ceil(lo / step) * step; v <= hi + step * 1e-9; v += step) out.push(Number(v.toPrecision(12)));
    return out;
  }

  /**
   * A chart's axes: the x axis along the bottom with ticks at `xTicks`, the y axis on the left
   * with a grid line at each of `yTicks`, `xLabel` at the bottom right. `box` is
   * {width, height, left, right, top, bottom}; `x`, `y` map values to the chart's coordinates.
   */
  function axes(box, x, y, xTicks, yTicks, xLabel) {
    const { width, height, left, right, top, bottom } = box;
    const group = svg("g", { class: "axis" },
      svg("line", { x1: left, x2: width - right, y1: height - bottom, y2: height - bottom }),
      svg("line", { x1: left, x2: left, y1: top, y2: height - bottom }));
    for (const v of xTicks) {
      group.append(svg("line", { x1: x(v), x2: x(v), y1: height - bottom, y2: height - bottom + 4 }),
        svg("text", { x: x(v), y: height - bottom + 17, "text-anchor": "middle", text: v }));
    }
    for (const v of yTicks) {
      group.append(svg("line", { class: "grid", x1: left, x2: width - right, y1: y(v), y2: y(v) }),
        svg("text", { x: left - 6, y: y(v) + 4, "text-anchor": "end", text: Number(v.toPrecision(4)) }));
    }
    group.append(svg("text", { x: width - right, y: height - 4, "text-anchor": "end", text: xLabel }));
    return group;
  }

  function status(text, state) {
    const node = document.getElementById("status");
    node.textContent = text;
    node.hidden = !text;
    node.className = "status" + (state ? " " + state : "");
  }

  /**
   * The token box in the page header: a field to type a bearer token when the API asks for
   * one (kept in sessionStorage: this tab only), and a way to forget it.
   */
  function tokenBox(onChange, reason) {
    const box = document.getElementById("token");
    box.replaceChildren();
    if (reason) {
      const input = el("input", {
        type: "password", id: "token-input", autocomplete: "off", placeholder: "bearer token",
        "aria-label": "API bearer token",
      });
      const form = el(
        "form", { class: "token-form", onsubmit: (event) => {
          event.preventDefault();
          setToken(input.value.trim());
          onChange();
        } },
        el("span", { class: "token-reason", text: reason }), input,
        el("button", { type: "submit", text: "Use token" }),
      );
      box.append(form);
      input.focus();
    } else if (token() || memoryToken) {
      box.append(el("button", {
        type: "button", class: "link", text: "Forget token",
        onclick: () => { setToken(""); onChange(); },
      }));
    }
  }

  /** Run `load`; on 401/403 ask for a token and run it again once given. */
  async function run(load) {
    document.body.dataset.state = "loading";
    try {
      await load();
      tokenBox(() => run(load), "");
      document.body.dataset.state = "ready";
    } catch (exc) {
      if (exc instanceof ApiError && (exc.status === 401 || exc.status === 403)) {
        const why = exc.status === 401
          ? "The API needs a bearer token (read scope)."
          : "This token lacks the read scope.";
        tokenBox(() => run(load), why);
        status(why + " " + exc.message, "error");
        document.body.dataset.state = "auth";
      } else {
        status("Could not load: " + (exc && exc.message ? exc.message : String(exc)), "error");
        document.body.dataset.state = "error";
        if (!(exc instanceof ApiError)) console.error(exc);
      }
    }
  }

  function stateBadge(state) {
    return el("span", { class: "badge state-" + String(state).toLowerCase(), text: state });
  }

  return { API, ROOT, ApiError, get, el, svg, ms, time, seconds, number, ticks, axes, status, run, stateBadge };
})();
