// Progress over time, drawn as inline SVG. The server keeps when each result was stored and
// answers a batch's curve (GET /v1/batches/{id}/progress); batches whose results were stored
// before it kept those times have none, and for them the page samples the counts while it is
// open, kept in this tab's session storage so the chart survives a reload. The batch's own
// timestamps add the points it knows for sure.
// @ts-check

/**
 * A point of the chart: [unix time in seconds, requests done].
 * @typedef {[number, number]} Point
 * @typedef {import("./api.js").Batch} Batch
 */

import { svg, time } from "./dom.js";

const MAX_SAMPLES = 400;
const key = (/** @type {string} */ id) => `backfill.samples.${id}`;

/**
 * @param {string} id
 * @returns {Point[]}
 */
export function loadSamples(id) {
  try {
    const stored = JSON.parse(sessionStorage.getItem(key(id)) || "[]");
    return Array.isArray(stored) ? stored.filter((/** @type {unknown} */ p) => Array.isArray(p) && p.length === 2) : [];
  } catch {
    return [];
  }
}

/**
 * @param {string} id
 * @param {Point[]} samples
 * @param {Batch} batch
 */
export function addSample(id, samples, batch) {
  /** @type {Partial<import("./api.js").RequestCounts>} */
  const counts = batch.request_counts || {};
  const done = (counts.completed || 0) + (counts.failed || 0);
  const now = Date.now() / 1000;
  const last = samples[samples.length - 1];
  // A flat run keeps its two ends only: the line is the same, the storage smaller.
  if (last && last[1] === done && samples.length >= 2 && samples[samples.length - 2][1] === done) {
    last[0] = now;
  } else {
    samples.push([now, done]);
  }
  while (samples.length > MAX_SAMPLES) samples.splice(1, 1);
  try {
    sessionStorage.setItem(key(id), JSON.stringify(samples));
  } catch {
    // Storage full: the chart still draws from memory.
  }
  return samples;
}

/** @param {Batch} batch */
function knownPoints(batch) {
  /** @type {Partial<import("./api.js").RequestCounts>} */
  const counts = batch.request_counts || {};
  const done = (counts.completed || 0) + (counts.failed || 0);
  /** @type {Point[]} */
  const points = [];
  if (batch.created_at) points.push([batch.created_at, 0]);
  if (batch.in_progress_at) points.push([batch.in_progress_at, 0]);
  const end = batch.completed_at || batch.failed_at || batch.expired_at || batch.cancelled_at;
  if (batch.finalizing_at) points.push([batch.finalizing_at, done]);
  if (end) points.push([end, done]);
  return points;
}

// The server's points ({at, done}) as [time, done] pairs; none when it has no history.
/**
 * @param {{ points?: unknown } | null | undefined} progress
 * @returns {Point[]}
 */
export function historyPoints(progress) {
  /** @type {{ at?: unknown, done?: unknown }[]} */
  const points = Array.isArray(progress?.points) ? progress.points : [];
  return points
    .filter((p) => Number.isFinite(p?.at) && Number.isFinite(p?.done))
    .map((p) => [/** @type {number} */ (p.at), /** @type {number} */ (p.done)]);
}

// ``history``: the server's points; the page's samples stand in only when it has none.
/**
 * @param {Batch} batch
 * @param {Point[]} samples
 * @param {Point[]} [history]
 * @returns {Point[]}
 */
export function series(batch, samples, history = []) {
  const end = batch.completed_at || batch.failed_at || batch.expired_at || batch.cancelled_at;
  // Once the batch ended, samples taken after its end say nothing new.
  const kept = history.length ? history : end ? samples.filter(([t]) => t <= end) : samples;
  const points = [...knownPoints(batch), ...kept];
  points.sort((a, b) => a[0] - b[0]);
  // Counts never go down: a sample taken before a known point cannot be above it.
  /** @type {Point[]} */
  const out = [];
  let best = 0;
  for (const [t, done] of points) {
    best = Math.max(best, done);
    out.push([t, best]);
  }
  return out;
}

/**
 * @param {Batch} batch
 * @param {Point[]} samples
 * @param {Point[]} [history]
 */
export function progressChart(batch, samples, history = []) {
  const W = 640;
  const H = 220;
  const pad = { left: 56, right: 16, top: 16, bottom: 40 };
  const total = Math.max(1, batch.request_counts?.total || 0);
  const points = series(batch, samples, history);
  const t0 = points.length ? points[0][0] : Date.now() / 1000;
  const t1 = points.length ? Math.max(points[points.length - 1][0], t0 + 1) : t0 + 1;
  const x = (/** @type {number} */ t) => pad.left + ((t - t0) / (t1 - t0)) * (W - pad.left - pad.right);
  const y = (/** @type {number} */ v) => H - pad.bottom - (v / total) * (H - pad.top - pad.bottom);
  const done = points.length ? points[points.length - 1][1] : 0;
  const label = `Progress over time: ${done} of ${batch.request_counts?.total || 0} requests done`;
  const line = points.map(([t, v]) => `${x(t).toFixed(1)},${y(v).toFixed(1)}`).join(" ");
  const area = points.length
    ? `${x(t0).toFixed(1)},${y(0)} ${line} ${x(points[points.length - 1][0]).toFixed(1)},${y(0)}`
    : "";
  const chart = svg(
    "svg",
    {
      class: "chart",
      viewBox: `0 0 ${W} ${H}`,
      role: "img",
      "aria-label": label,
      "data-points": points.length,
      "data-source": history.length ? "server" : "page",
    },
    svg("title", {}, label),
    // Grid at 0, 50 and 100 %.
    [0, 0.5, 1].map((f) => [
      svg("line", { class: "gridline", x1: pad.left, x2: W - pad.right, y1: y(f * total), y2: y(f * total) }),
      svg("text", { class: "axis", x: pad.left - 6, y: y(f * total) + 4, "text-anchor": "end" }, String(Math.round(f * total))),
    ]),
    area ? svg("polygon", { class: "area", points: area }) : null,
    line ? svg("polyline", { class: "line", points: line }) : null,
    points.map(([t, v]) => svg("circle", { class: "dot", cx: x(t).toFixed(1), cy: y(v).toFixed(1), r: 2.5 })),
    svg("text", { class: "axis", x: pad.left, y: H - pad.bottom + 18, "text-anchor": "start" }, clock(t0)),
    svg("text", { class: "axis", x: W - pad.right, y: H - pad.bottom + 18, "text-anchor": "end" }, clock(t1)),
  );
  const span = document.createElement("p");
  span.className = "muted chart-span";
  span.append("From ", time(t0), " to ", time(t1), ".");
  return [chart, span];
}

/** @param {number} unix */
function clock(unix) {
  const d = new Date(unix * 1000);
  return [d.getHours(), d.getMinutes(), d.getSeconds()].map((n) => String(n).padStart(2, "0")).join(":");
}
