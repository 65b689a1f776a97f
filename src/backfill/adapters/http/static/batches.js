// The batches of the org, newest first, a page at a time with the API's own cursor. While a
// batch on the page runs, the page is read again every 2 s: one list call, one charges call.
// @ts-check

/**
 * @typedef {import("./api.js").Batch} Batch
 * @typedef {import("./api.js").BatchCharges} BatchCharges
 * @typedef {{ shown: Batch[], read: number, next: string | null }} ListPage
 */

import { ApiError, getJson, query } from "./api.js";
import {
  Poller,
  STATUSES,
  TERMINAL,
  apiMessage,
  count,
  h,
  replace,
  statusBadge,
  time,
  usd,
} from "./dom.js";

const PAGE = 20;
// With a status filter the page reads API pages until it has a page of matches or has read
// this many: a filter never turns into a walk over every batch ever made.
const MAX_SCANNED_PAGES = 5;
const REFRESH_MS = 2000;

// Cursors of the pages before this one, for "Previous" (kept for the tab, as the URL holds
// only the current cursor).
/** @type {(string | null)[]} */
const history = [];

/**
 * @param {BatchCharges | null | undefined} charges
 * @param {Batch | null} [batch]
 */
export function costCell(charges, batch) {
  if (!charges) return h("span", { class: "muted" }, "—");
  if (charges.billing === "gpu_time" || batch?.billing === "gpu_time") {
    return h("span", {}, "GPU time", h("br"), h("small", { class: "muted" }, "billed per deployment"));
  }
  return h(
    "span",
    {},
    h("span", { "data-cost": "charged" }, usd(charges.charged.usd)),
    h("br"),
    h("small", { class: "muted", "data-cost": "reserved" }, `${usd(charges.reserved.usd)} reserved`),
  );
}

/** @param {Batch} batch */
export function progressCell(batch) {
  const counts = batch.request_counts || { total: 0, completed: 0, failed: 0 };
  const done = counts.completed + counts.failed;
  const label = `${count(done)} of ${count(counts.total)} done`;
  return h(
    "div",
    { class: "progress" },
    h("progress", { max: Math.max(counts.total, 1), value: done, "aria-label": label }),
    h(
      "span",
      { class: "counts" },
      h("span", { "data-count": "completed" }, count(counts.completed)),
      " ok · ",
      h("span", { "data-count": "failed" }, count(counts.failed)),
      " failed · ",
      h("span", { "data-count": "total" }, count(counts.total)),
      " total",
    ),
  );
}

/** @param {Batch} batch */
function waitingNote(batch) {
  const waiting = batch.waiting_on;
  if (!waiting || typeof waiting !== "object") return null;
  return h("small", { class: "warning", "data-waiting": waiting.code || "" }, waiting.message || waiting.code || "waiting");
}

/**
 * @param {Batch} batch
 * @param {BatchCharges | undefined} charges
 */
function row(batch, charges) {
  return h(
    "tr",
    { "data-batch": batch.id, "data-status": batch.status },
    h(
      "td",
      { "data-label": "Batch" },
      h("a", { href: `#/batch/${encodeURIComponent(batch.id)}` }, batch.id),
      h("br"),
      h("small", { class: "muted" }, `${batch.model || ""} ${batch.endpoint || ""}`),
    ),
    h("td", { "data-label": "Status" }, statusBadge(batch.status), waitingNote(batch) ? [h("br"), waitingNote(batch)] : null),
    h("td", { "data-label": "Progress" }, progressCell(batch)),
    h("td", { "data-label": "Cost", "data-cell": "cost" }, costCell(charges, batch)),
    h("td", { "data-label": "Created" }, time(batch.created_at)),
    h("td", { "data-label": "Deadline" }, time(batch.expires_at)),
  );
}

/**
 * @param {string[]} ids
 * @returns {Promise<Map<string, BatchCharges>>}
 */
async function chargesOf(ids) {
  if (!ids.length) return new Map();
  /** @type {import("./api.js").Page<BatchCharges>} */
  const found = await getJson(`/v1/organization/batch_charges${query({ ids: ids.join(",") })}`);
  return new Map(found.data.map((c) => [c.id, c]));
}

// The batches of ``data`` (API rows, newest first) that a page shows: the first ``PAGE`` that
// match the filter. ``read`` is how many API rows that took, ``next`` where Next continues
// (the last row read, when any row follows it).
/**
 * @param {Batch[]} data
 * @param {boolean} hasMore
 * @param {string} status
 * @returns {ListPage}
 */
function pageOf(data, hasMore, status) {
  /** @type {Batch[]} */
  const shown = [];
  let read = 0;
  for (const batch of data) {
    read++;
    if (status && batch.status !== status) continue;
    shown.push(batch);
    if (shown.length === PAGE) break;
  }
  const more = read < data.length || hasMore;
  return { shown, read, next: more && read ? data[read - 1].id : null };
}

// One page of matches: API pages of ``PAGE`` read from ``after`` on, at most
// ``MAX_SCANNED_PAGES`` of them with a filter.
/**
 * @param {string | null} after
 * @param {string} status
 */
async function loadPage(after, status) {
  /** @type {Batch[]} */
  const data = [];
  let hasMore = true;
  for (let scanned = 0; scanned < (status ? MAX_SCANNED_PAGES : 1) && hasMore; scanned++) {
    const cursor = data.length ? data[data.length - 1].id : after;
    /** @type {import("./api.js").Page<Batch>} */
    const page = await getJson(`/v1/batches${query({ limit: PAGE, after: cursor })}`);
    hasMore = page.has_more;
    data.push(...page.data);
    if (page.data.length === 0 || pageOf(data, false, status).shown.length === PAGE) break;
  }
  return pageOf(data, hasMore, status);
}

/**
 * @param {HTMLElement} root
 * @param {import("./dom.js").ViewContext} context
 * @param {URLSearchParams} params
 */
export function batchesView(root, context, params) {
  const after = params.get("after") || null;
  const status = params.get("status") || "";
  if (!after) history.length = 0;
  const filter = h(
    "select",
    { id: "status-filter", name: "status" },
    h("option", { value: "" }, "Any status"),
    STATUSES.map((s) => h("option", { value: s, selected: s === status }, s.replace("_", " "))),
  );
  filter.addEventListener("change", () => {
    history.length = 0;
    location.hash = `#/batches${query({ status: filter.value })}`;
  });
  const tbody = h("tbody");
  const message = h("div", { class: "message-area" });
  const summary = h("p", { class: "muted", role: "status" }, "Loading…");
  const previous = h("button", { type: "button", disabled: !after }, "Previous");
  const next = h("button", { type: "button", disabled: true }, "Next");
  replace(
    root,
    h("div", { class: "title-row" }, h("h1", {}, "Batches"), context.canWrite() ? h("a", { class: "button", href: "#/new" }, "New batch") : null),
    h(
      "form",
      { class: "toolbar", onsubmit: (/** @type {Event} */ e) => e.preventDefault() },
      h("label", { for: "status-filter" }, "Status"),
      filter,
    ),
    message,
    summary,
    h(
      "div",
      { class: "table-wrap" },
      h(
        "table",
        { class: "batches responsive" },
        h("caption", { class: "sr-only" }, "Batches, newest first"),
        h(
          "thead",
          {},
          h("tr", {}, ["Batch", "Status", "Progress", "Cost", "Created", "Deadline"].map((c) => h("th", { scope: "col" }, c))),
        ),
        tbody,
      ),
    ),
    h("nav", { class: "pager", "aria-label": "Pages" }, previous, next),
  );

  /** @type {string | null} */
  let nextCursor = null;
  previous.addEventListener("click", () => {
    const before = history.pop() ?? null;
    location.hash = `#/batches${query({ after: before, status })}`;
  });
  next.addEventListener("click", () => {
    if (!nextCursor) return;
    history.push(after);
    location.hash = `#/batches${query({ after: nextCursor, status })}`;
  });

  /** @type {Poller | null} */
  let poller = null;
  let closed = false;
  // The API rows the page was built from: each refresh reads them again with one call.
  let span = PAGE;
  let shownIds = "";

  /**
   * @param {ListPage} page
   * @param {Map<string, BatchCharges>} charges
   */
  function render({ shown, next: cursor }, charges) {
    nextCursor = cursor;
    next.disabled = !cursor;
    const rows = shown.map((batch) => row(batch, charges.get(batch.id)));
    const ids = shown.map((batch) => batch.id).join(",");
    if (ids === shownIds) {
      // The same batches: only rows that changed are replaced, so focus stays where it is.
      for (const fresh of rows) {
        const old = tbody.querySelector(`tr[data-batch="${CSS.escape(/** @type {string} */ (fresh.dataset.batch))}"]`);
        if (old && !old.isEqualNode(fresh)) old.replaceWith(fresh);
      }
    } else {
      replace(tbody, rows);
      shownIds = ids;
    }
    summary.textContent = shown.length
      ? `${shown.length} batch${shown.length === 1 ? "" : "es"}${status ? ` with status ${status.replace("_", " ")}` : ""} on this page.`
      : status
        ? `No ${status.replace("_", " ")} batches here${cursor ? "; try Next" : ""}.`
        : "No batches yet.";
    return shown.some((b) => !TERMINAL.has(b.status));
  }

  // The visible page again, with one list call from the same cursor and one charges call.
  async function refresh() {
    let found;
    try {
      /** @type {import("./api.js").Page<Batch>} */
      const page = await getJson(`/v1/batches${query({ limit: span, after })}`);
      found = pageOf(page.data, page.has_more, status);
    } catch (error) {
      // A cursor that no longer names a batch (deleted meanwhile) will not work next time
      // either: say so and stop. Anything else may pass: the poller tries again.
      if (!(error instanceof ApiError) || error.status !== 400) throw error;
      if (!closed) replace(message, apiMessage(error, "The list could not be refreshed; go back to the first page."));
      return false;
    }
    const charges = await chargesOf(found.shown.map((b) => b.id));
    if (closed) return false;
    return render(found, charges);
  }

  (async () => {
    try {
      const found = await loadPage(after, status);
      const charges = await chargesOf(found.shown.map((b) => b.id));
      if (closed) return;
      span = Math.max(found.read, 1);
      if (render(found, charges)) poller = new Poller(refresh, REFRESH_MS).start();
    } catch (error) {
      summary.textContent = "";
      if (error instanceof ApiError) replace(message, apiMessage(error, "The batches could not be listed."));
      else throw error;
    }
  })();

  return () => {
    closed = true;
    if (poller) poller.stop();
  };
}
