// loraplane dashboard: polls the query pack's JSON API and draws SVG line charts per adapter.
"use strict";

const COLORS = ["#4dabf7", "#ffa94d", "#69db7c", "#f783ac", "#b197fc", "#ffd43b", "#63e6be",
                "#ff8787", "#74c0fc", "#e599f7"];
const SVG = "http://www.w3.org/2000/svg";
const form = document.getElementById("filters");
const statusEl = document.getElementById("status");

function params() {
  const p = new URLSearchParams();
  for (const [k, v] of new FormData(form)) if (k !== "pct" && v) p.set(k, v);
  return p;
}

async function query(name) {
  const res = await fetch(`/api/query/${name}?${params()}`, {cache: "no-store"});
  const body = await res.json();
  if (!res.ok) throw new Error(body.error || res.statusText);
  return body.rows;
}

function el(tag, attrs, text) {
  const node = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
  if (text !== undefined) node.textContent = text;
  return node;
}

function fmt(v) {
  if (v === null || v === undefined) return "–";
  if (typeof v !== "number") return String(v);
  if (Number.isInteger(v)) return String(v);
  return Math.abs(v) < 1 ? v.toFixed(3) : v.toFixed(1);
}

// series: Map adapter -> [{t: Date, y: number}]
function drawChart(section, series, opts) {
  section.replaceChildren();
  const h2 = document.createElement("h2");
  h2.textContent = section.dataset.title + (opts.suffix ? ` (${opts.suffix})` : "");
  section.appendChild(h2);
  const W = 600, H = 220, L = 46, R = 10, T = 10, B = 22;
  const svg = el("svg", {viewBox: `0 0 ${W} ${H}`, preserveAspectRatio: "none",
                         role: "img", "aria-label": section.dataset.title});
  section.appendChild(svg);
  const pts = [...series.values()].flat().filter(p => p.y !== null);
  if (!pts.length) {
    svg.appendChild(el("text", {x: W / 2, y: H / 2, "text-anchor": "middle", class: "empty"},
                       "no data in this window"));
    return;
  }
  const t0 = Math.min(...pts.map(p => +p.t)), t1 = Math.max(...pts.map(p => +p.t));
  const yMax = opts.yMax ?? (Math.max(...pts.map(p => p.y)) * 1.1 || 1);
  const x = t => L + (t1 === t0 ? (W - L - R) / 2 : (+t - t0) / (t1 - t0) * (W - L - R));
  const y = v => T + (1 - v / yMax) * (H - T - B);
  for (let i = 0; i <= 4; i++) {
    const v = yMax * i / 4;
    svg.appendChild(el("line", {x1: L, x2: W - R, y1: y(v), y2: y(v), class: "gridline"}));
    svg.appendChild(el("text", {x: L - 4, y: y(v) + 3, "text-anchor": "end", class: "axis"},
                       fmt(opts.yMax === 1 ? +v.toFixed(2) : Math.round(v))));
  }
  const ticks = t1 === t0 ? [[t0, "middle"]] : [[t0, "start"], [t1, "end"]];
  for (const [t, anchor] of ticks) {
    svg.appendChild(el("text", {x: x(t), y: H - 6, "text-anchor": anchor, class: "axis"},
                       new Date(t).toISOString().slice(11, 16) + "Z"));
  }
  const legend = document.createElement("div");
  legend.className = "legend";
  [...series.keys()].sort().forEach((name, i) => {
    const color = COLORS[i % COLORS.length];
    const data = series.get(name).filter(p => p.y !== null).sort((a, b) => a.t - b.t);
    if (!data.length) return;
    const g = el("g", {class: "series", "data-series": name});
    g.appendChild(el("polyline", {fill: "none", stroke: color, "stroke-width": 2,
      points: data.map(p => `${x(p.t).toFixed(1)},${y(p.y).toFixed(1)}`).join(" ")}));
    for (const p of data) {
      const c = el("circle", {cx: x(p.t), cy: y(p.y), r: 2.5, fill: color, class: "pt",
                              "data-series": name, "data-t": p.t.toISOString(), "data-y": p.y});
      c.appendChild(el("title", {}, `${name} ${p.t.toISOString().slice(11, 16)}Z ${fmt(p.y)}`));
      g.appendChild(c);
    }
    svg.appendChild(g);
    const item = document.createElement("span");
    item.dataset.series = name;
    const swatch = document.createElement("i");
    swatch.style.background = color;  // through the CSSOM: the CSP allows no style attribute
    item.appendChild(swatch);
    item.append(name);
    const last = document.createElement("b");
    last.textContent = fmt(data[data.length - 1].y);
    item.appendChild(last);
    legend.appendChild(item);
  });
  section.appendChild(legend);
}

function bySeries(rows, field) {
  const out = new Map();
  for (const r of rows) {
    if (!out.has(r.adapter_id)) out.set(r.adapter_id, []);
    out.get(r.adapter_id).push({t: new Date(r.minute), y: r[field]});
  }
  for (const points of out.values()) points.sort((a, b) => a.t - b.t);  // rows: newest first
  return out;
}

function drawSummary(rows) {
  const body = document.querySelector("#summary tbody");
  body.replaceChildren();
  const cols = ["adapter_id", "adapter_version", "tenant_id", "requests", "gpu_hits",
                "host_hits", "cold", "base_fallbacks", "hot_adapter_hit_rate", "ttft_p50_ms",
                "ttft_p95_ms", "ttft_p99_ms"];
  for (const r of rows) {
    const tr = document.createElement("tr");
    tr.dataset.adapter = r.adapter_id;
    for (const c of cols) {
      const td = document.createElement("td");
      td.dataset.col = c;
      td.textContent = fmt(r[c]);
      tr.appendChild(td);
    }
    body.appendChild(tr);
  }
}

function cells(tr, values) {
  for (const [col, value] of Object.entries(values)) {
    const td = document.createElement("td");
    td.dataset.col = col;
    td.textContent = Array.isArray(value) ? (value.join(", ") || "–") : fmt(value);
    tr.appendChild(td);
  }
}

// The fleet view of /api/fleet (loraplane/router/fleet_view.py): one row per worker and base model.
async function refreshFleet() {
  const status = document.getElementById("fleet-status");
  const section = document.getElementById("fleet");
  try {
    const res = await fetch("/api/fleet", {cache: "no-store"});
    const body = await res.json();
    if (!res.ok) throw new Error(body.error || res.statusText);
    const workers = document.querySelector("#fleet-workers tbody");
    const models = document.querySelector("#fleet-models tbody");
    workers.replaceChildren();
    models.replaceChildren();
    for (const b of body.base_models) {
      for (const w of b.workers) {
        const tr = document.createElement("tr");
        tr.dataset.worker = w.worker_id;
        tr.dataset.live = String(w.live);
        cells(tr, {base_model: b.base_model, worker_id: w.worker_id,
                   live: w.live ? (w.not_run ? `not run: ${w.not_run}` : "yes") : "drained",
                   heartbeat_age_s: w.heartbeat_age_s,
                   gpu_slots_used: w.gpu_slots_used, gpu_slots_free: w.gpu_slots_free,
                   gpu_loras: w.gpu_loras, host_loras: w.host_loras, in_flight: w.in_flight,
                   cold_loads_last_minute: w.cold_loads_last_minute});
        workers.appendChild(tr);
      }
      const tr = document.createElement("tr");
      tr.dataset.baseModel = b.base_model;
      cells(tr, {base_model: b.base_model, live_workers: b.live_workers,
                 serving_workers: b.serving_workers, gpu_slots_free: b.gpu_slots_free, in_flight: b.in_flight,
                 queue_depth: b.queue_depth,  // null when no router reports its queues
                 replicas: Object.entries(b.replicas).map(([n, c]) => `${n} ×${c}`)});
      models.appendChild(tr);
    }
    status.className = "";
    status.textContent = body.base_models.length ? "" : "no worker has reported a state yet";
    section.dataset.loaded = "true";
  } catch (err) {
    status.className = "error";
    status.textContent = `error: ${err.message}`;
  }
}

async function refresh() {
  const pct = new FormData(form).get("pct");
  try {
    const [req, cache, summary] = await Promise.all(
      [query("timeseries_requests"), query("timeseries_cache"), query("adapter_summary")]);
    drawChart(document.getElementById("chart-hit-rate"),
              bySeries(req, "hot_adapter_hit_rate"), {yMax: 1});
    drawChart(document.getElementById("chart-ttft"), bySeries(req, `ttft_${pct}_ms`),
              {suffix: pct});
    drawChart(document.getElementById("chart-swap"), bySeries(cache, `swap_${pct}_ms`),
              {suffix: pct});
    drawChart(document.getElementById("chart-cold"), bySeries(req, "cold_n"), {});
    drawSummary(summary);
    statusEl.className = "";
    statusEl.textContent = `updated ${new Date().toISOString().slice(11, 19)}Z`;
    document.body.dataset.loaded = "true";
  } catch (err) {
    statusEl.className = "error";
    statusEl.textContent = `error: ${err.message}`;
  }
}

for (const [k, v] of new URLSearchParams(location.search)) {
  if (form.elements[k]) form.elements[k].value = v;
}
form.addEventListener("change", refresh);
refresh();
refreshFleet();
setInterval(() => { refresh(); refreshFleet(); },
            Number(document.body.dataset.refreshMs) || 5000);
