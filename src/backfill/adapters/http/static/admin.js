// With the admin token: engines (health, last error, in-flight, limit), the queue by model,
// and every organization with its credit. Engines and the queue refresh every 5 s.
// @ts-check

/**
 * An engine as GET /admin/v1/engines answers it; fields this page does not place are shown
 * under "More".
 * @typedef {{
 *   id: string, worker: string, url?: string | null, healthy: boolean, state?: string | null,
 *   healthy_since?: number | null, down_since?: number | null, last_error?: string | null,
 *   in_flight?: number, concurrency_limit?: number, max_concurrency?: number,
 *   mode?: string | null, signal?: string | null, pressure?: number | null,
 *   models?: string[] | null, checked_at?: number | null, [field: string]: unknown,
 * }} Engine
 * @typedef {{
 *   model: string, batches: number, in_progress: number, remaining_requests: number,
 *   requests_per_s: number | null,
 * }} QueueModel
 * @typedef {{
 *   id: string, name: string, weight: number, created_at: number,
 *   credit: { available: string, balance: string, reserved: string },
 * }} OrgRow
 * @typedef {import("./dom.js").Child} Child
 */

import { ApiError, getJson, query } from "./api.js";
import { Poller, apiMessage, count, h, replace, time, usd } from "./dom.js";

const REFRESH_MS = 5000;
const PAGE = 20;

// The fields of an engine object (docs/api.md, "Admin: engines") this page places in a
// column; any field the API adds later is shown as it is, under "More".
const ENGINE_COLUMNS = ["Engine", "Health", "Last error", "In flight", "Limit", "Mode", "Models", "Checked", "More"];
const PLACED = new Set([
  "id", "object", "worker", "url", "healthy", "state", "healthy_since", "down_since",
  "last_error", "in_flight", "concurrency_limit", "max_concurrency", "mode", "signal",
  "pressure", "models", "checked_at",
]);

/**
 * @param {string} key
 * @param {unknown} value
 */
function show(key, value) {
  if (value === null || value === undefined || value === "") return "—";
  if (typeof value === "number" && /(_at|_since)$/.test(key)) return time(value);
  if (typeof value === "object") return JSON.stringify(value);
  return String(value);
}

/** @param {Engine} engine */
function health(engine) {
  /** @type {Child[]} */
  const parts = [h("span", { class: `badge ${engine.healthy ? "healthy" : "unhealthy"}` }, engine.healthy ? "healthy" : "unhealthy")];
  // "standby": stopped on purpose until work waits for its models; "starting": started for it.
  if (engine.state && engine.state !== (engine.healthy ? "up" : "down")) parts.push(" ", h("small", {}, engine.state));
  const since = engine.healthy ? engine.healthy_since : engine.down_since;
  if (since) parts.push(h("br"), h("small", { class: "muted" }, "since "), h("small", {}, time(since)));
  return parts;
}

/** @param {Engine} engine */
function engineRow(engine) {
  const mode = [engine.mode, engine.signal && engine.signal !== "fixed" ? `(${engine.signal})` : null]
    .filter(Boolean)
    .join(" ");
  const extra = Object.entries(engine).filter(([k]) => !PLACED.has(k));
  /** @type {Child[]} */
  const cells = [
    [
      h("strong", {}, show("id", engine.id)),
      h("br"),
      h("small", { class: "muted break" }, `worker ${show("worker", engine.worker)}`),
      engine.url ? [h("br"), h("small", { class: "muted break" }, engine.url)] : null,
    ],
    health(engine),
    show("last_error", engine.last_error),
    count(engine.in_flight),
    [count(engine.concurrency_limit), h("small", { class: "muted" }, ` of ${count(engine.max_concurrency)}`)],
    [mode || "—", engine.pressure !== null && engine.pressure !== undefined ? [h("br"), h("small", { class: "muted" }, `pressure ${engine.pressure}`)] : null],
    Array.isArray(engine.models) ? engine.models.join(", ") : "—",
    show("checked_at", engine.checked_at),
    extra.length ? extra.map(([k, v]) => h("div", {}, h("small", {}, `${k}: `), h("small", {}, show(k, v)))) : "—",
  ];
  return h(
    "tr",
    { "data-engine": engine.id, "data-worker": engine.worker },
    cells.map((cell, i) => h("td", { "data-label": ENGINE_COLUMNS[i], class: i === 2 || i === 8 ? "wrap" : null }, cell)),
  );
}

/**
 * @param {string} caption
 * @param {string[]} headers
 * @param {HTMLElement[]} rows
 * @param {string} empty
 */
function table(caption, headers, rows, empty) {
  return h(
    "div",
    { class: "table-wrap" },
    h(
      "table",
      { class: "responsive" },
      h("caption", { class: "sr-only" }, caption),
      h("thead", {}, h("tr", {}, headers.map((c) => h("th", { scope: "col" }, c)))),
      h("tbody", {}, rows.length ? rows : h("tr", {}, h("td", { colspan: headers.length }, empty))),
    ),
  );
}

/** @param {HTMLElement} root */
export function adminView(root) {
  const engines = h("div", { id: "engines" }, h("p", { class: "muted" }, "Loading…"));
  const queue = h("div", { id: "queue" }, h("p", { class: "muted" }, "Loading…"));
  const orgs = h("div", { id: "orgs" }, h("p", { class: "muted" }, "Loading…"));
  const previous = h("button", { type: "button", disabled: true }, "Previous");
  const next = h("button", { type: "button", disabled: true }, "Next");
  replace(
    root,
    h("h1", {}, "Operations"),
    h("section", { class: "card", "aria-labelledby": "h-engines" }, h("h2", { id: "h-engines" }, "Engines"), engines),
    h("section", { class: "card", "aria-labelledby": "h-queue" }, h("h2", { id: "h-queue" }, "Queue by model"), queue),
    h(
      "section",
      { class: "card", "aria-labelledby": "h-orgs" },
      h("h2", { id: "h-orgs" }, "Organizations and credit"),
      orgs,
      h("nav", { class: "pager", "aria-label": "Organization pages" }, previous, next),
    ),
  );

  async function refresh() {
    try {
      /** @type {{ data: Engine[] }} */
      const found = await getJson("/admin/v1/engines");
      replace(
        engines,
        table("Engines", ENGINE_COLUMNS, found.data.map(engineRow), "No engines in this process (an API-only server)."),
      );
    } catch (error) {
      if (error instanceof ApiError) replace(engines, apiMessage(error, "Engines could not be read."));
      else throw error;
    }
    try {
      /** @type {{ data: QueueModel[] }} */
      const found = await getJson("/admin/v1/queue");
      replace(
        queue,
        table(
          "Unfinished batches by model",
          ["Model", "Batches", "Running", "Requests left", "Measured rate"],
          found.data.map((q) =>
            h(
              "tr",
              { "data-model": q.model },
              h("td", { "data-label": "Model" }, q.model),
              h("td", { "data-label": "Batches", class: "num" }, count(q.batches)),
              h("td", { "data-label": "Running", class: "num" }, count(q.in_progress)),
              h("td", { "data-label": "Requests left", class: "num" }, count(q.remaining_requests)),
              h("td", { "data-label": "Measured rate", class: "num" }, q.requests_per_s === null ? "not measured yet" : `${q.requests_per_s.toFixed(2)} req/s`),
            ),
          ),
          "The queue is empty.",
        ),
      );
    } catch (error) {
      if (error instanceof ApiError) replace(queue, apiMessage(error, "The queue could not be read."));
      else throw error;
    }
  }

  /** @type {(string | null)[]} */
  const cursors = [];
  /** @type {string | null} */
  let current = null;
  /** @type {string | null} */
  let nextCursor = null;
  /** @param {string | null} after */
  async function loadOrgs(after) {
    try {
      /** @type {import("./api.js").Page<OrgRow>} */
      const page = await getJson(`/admin/v1/orgs${query({ limit: PAGE, after })}`);
      current = after;
      nextCursor = page.has_more ? page.last_id : null;
      next.disabled = !nextCursor;
      previous.disabled = !cursors.length;
      replace(
        orgs,
        table(
          "Organizations",
          ["Organization", "Weight", "Available", "Balance", "Reserved", "Created"],
          page.data.map((o) =>
            h(
              "tr",
              { "data-org": o.name },
              h("td", { "data-label": "Organization" }, h("strong", {}, o.name), h("br"), h("small", { class: "muted" }, o.id)),
              h("td", { "data-label": "Weight", class: "num" }, String(o.weight)),
              h("td", { "data-label": "Available", class: "num" }, usd(o.credit.available)),
              h("td", { "data-label": "Balance", class: "num" }, usd(o.credit.balance)),
              h("td", { "data-label": "Reserved", class: "num" }, usd(o.credit.reserved)),
              h("td", { "data-label": "Created" }, time(o.created_at)),
            ),
          ),
          "No organizations.",
        ),
      );
    } catch (error) {
      if (error instanceof ApiError) replace(orgs, apiMessage(error, "Organizations could not be read."));
      else throw error;
    }
  }
  next.addEventListener("click", () => {
    cursors.push(current);
    loadOrgs(nextCursor);
  });
  previous.addEventListener("click", () => loadOrgs(cursors.pop() ?? null));

  const poller = new Poller(refresh, REFRESH_MS).start(0);
  loadOrgs(null);
  return () => poller.stop();
}
