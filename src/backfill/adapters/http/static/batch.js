// One batch: progress over time, its status timeline, usage and cost, error codes, metadata,
// notifications; cancel, download its files, rerun what failed. Request content appears only
// when the user asks for results.
// @ts-check

/**
 * @typedef {import("./api.js").Batch} Batch
 * @typedef {import("./api.js").BatchCharges} BatchCharges
 * @typedef {import("./dom.js").Child} Child
 * @typedef {{
 *   channel: string, event: string, target: string, status: string, attempts: number,
 *   next_attempt_at?: number | null, last_status_code?: number | null, last_error?: string | null,
 * }} Notification
 * @typedef {{
 *   data?: { code: string, count: number }[], rows_read: number, truncated: boolean,
 *   complete: boolean,
 * }} ErrorCodes
 */

import { ApiError, call, getJson, postJson } from "./api.js";
import { addSample, historyPoints, loadSamples, progressChart } from "./chart.js";
import {
  Poller,
  TERMINAL,
  apiMessage,
  count,
  duration,
  h,
  replace,
  statusBadge,
  time,
} from "./dom.js";
import { costCell, progressCell } from "./batches.js";

const REFRESH_MS = 2000;
// The server's progress curve is read again with the poll, at most this often while it runs.
const HISTORY_MS = 5000;
/** @type {[keyof Batch, string][]} */
const TIMELINE = [
  ["created_at", "Created"],
  ["in_progress_at", "In progress"],
  ["cancelling_at", "Cancelling"],
  ["finalizing_at", "Finalizing"],
  ["completed_at", "Completed"],
  ["failed_at", "Failed"],
  ["expired_at", "Expired"],
  ["cancelled_at", "Cancelled"],
];

/**
 * @param {string} title
 * @param {string} id
 * @param {Child[]} children
 */
function section(title, id, ...children) {
  return h("section", { class: "card", "aria-labelledby": id }, h("h2", { id }, title), ...children);
}

/** @param {([string, Child] | null)[]} pairs */
function dl(pairs) {
  return h(
    "dl",
    { class: "pairs" },
    pairs.filter((pair) => pair !== null).map(([name, value]) => [h("dt", {}, name), h("dd", {}, value)]),
  );
}

/**
 * Why the batch does not move (docs/api.md, "Why a batch waits"): the server's message, since
 * when, and when it is expected to move again where the server says.
 * @param {Batch["waiting_on"]} w
 */
function waitingNote(w) {
  if (!w || typeof w !== "object") return null;
  return h(
    "p",
    { class: "warning", id: "batch-waiting", "data-code": w.code || "" },
    h("strong", {}, "Waiting: "),
    h("span", { class: "message" }, w.message || w.code || "waiting"),
    w.since ? [" (since ", h("span", { "data-field": "since" }, time(w.since)), ")"] : null,
    w.resumes_at ? [" Expected to move again about ", h("span", { "data-field": "resumes_at" }, time(w.resumes_at)), "."] : null,
  );
}

/** @param {Batch} batch */
function timeline(batch) {
  const events = TIMELINE.filter(([field]) => batch[field]).map(
    ([field, label]) => /** @type {[number, string, string]} */ ([batch[field], label, field]),
  );
  events.sort((a, b) => a[0] - b[0]);
  const items = events.map(([at, label, field], i) =>
    h(
      "li",
      { "data-event": field },
      h("span", { class: "event" }, label),
      " ",
      time(at),
      i > 0 ? h("small", { class: "muted" }, ` (+${duration(at - events[i - 1][0])})`) : null,
    ),
  );
  if (batch.estimated_completion_at && !TERMINAL.has(batch.status)) {
    items.push(h("li", { class: "future" }, h("span", { class: "event" }, "Estimated completion"), " ", time(batch.estimated_completion_at)));
  }
  if (!TERMINAL.has(batch.status)) {
    items.push(h("li", { class: "future" }, h("span", { class: "event" }, "Deadline"), " ", time(batch.expires_at)));
  }
  return h("ol", { class: "timeline" }, items);
}

/**
 * @param {Batch} batch
 * @param {BatchCharges | null} charges
 */
function usage(batch, charges) {
  /** @type {import("./api.js").Usage} */
  const u = batch.usage || {};
  const pricing = batch.pricing;
  return dl([
    ["Input tokens", count(u.input_tokens)],
    ["Cached input tokens", count(u.input_tokens_details?.cached_tokens)],
    ["Output tokens", count(u.output_tokens)],
    ["Billing", batch.billing === "gpu_time" ? "GPU time of a private deployment" : "Per token (catalog prices)"],
    pricing
      ? ["Prices", `input ${pricing.input}, cached ${pricing.cached_input}, output ${pricing.output} (${pricing.unit.replaceAll("_", " ")})`]
      : null,
    ["Cost so far and reserved", costCell(charges, batch)],
  ]);
}

/** @param {Batch} batch */
function metadata(batch) {
  const entries = Object.entries(batch.metadata || {});
  /** @type {([string, Child] | null)[]} */
  const pairs = [
    ["Model", batch.model],
    ["Endpoint", batch.endpoint],
    ["Completion window", batch.completion_window],
    ["Input file", batch.input_file_id],
    batch.retry_of ? ["Reruns", h("a", { href: `#/batch/${encodeURIComponent(batch.retry_of)}` }, batch.retry_of)] : null,
    ["Priority", String(batch.priority ?? 0)],
    batch.paused_at ? ["Paused since", time(batch.paused_at)] : null,
    batch.output_validation ? ["Answers checked", "against each line's response_format schema"] : null,
    batch.webhook_url ? ["Webhook", batch.webhook_url] : null,
    ...entries.map(([k, v]) => /** @type {[string, Child]} */ ([k, v])),
  ];
  return dl(pairs);
}

/** @param {Notification} n */
function lastAnswer(n) {
  const parts = [n.last_status_code ? `HTTP ${n.last_status_code}` : "", n.last_error || ""];
  return parts.filter(Boolean).join(" ") || "—";
}

/** @param {Notification[]} list */
function notificationsTable(list) {
  if (!list.length) return h("p", { class: "muted" }, "No notifications: none are configured, or the batch has not ended.");
  return h(
    "div",
    { class: "table-wrap" },
    h(
      "table",
      { class: "responsive" },
      h("thead", {}, h("tr", {}, ["Channel", "Event", "Target", "Delivery", "Attempts", "Last answer"].map((c) => h("th", { scope: "col" }, c)))),
      h(
        "tbody",
        {},
        list.map((n) =>
          h(
            "tr",
            {},
            h("td", { "data-label": "Channel" }, n.channel),
            h("td", { "data-label": "Event" }, n.event),
            h("td", { "data-label": "Target", class: "wrap" }, n.target),
            h("td", { "data-label": "Delivery" }, h("span", { class: `badge delivery-${n.status}` }, n.status), n.next_attempt_at ? [h("br"), h("small", {}, "next try "), time(n.next_attempt_at)] : null),
            h("td", { "data-label": "Attempts" }, String(n.attempts)),
            h("td", { "data-label": "Last answer", class: "wrap" }, lastAnswer(n)),
          ),
        ),
      ),
    ),
  );
}

/** @param {ErrorCodes} found */
function errorCodesTable(found) {
  const rows = found.data || [];
  const note = found.truncated
    ? `Counted over the first ${count(found.rows_read)} failed results only.`
    : found.complete
      ? `Final counts over all ${count(found.rows_read)} failed results.`
      : `Counted over the ${count(found.rows_read)} failed results stored so far.`;
  if (!rows.length) return [h("p", {}, "No failed requests."), h("p", { class: "muted" }, note)];
  return [
    h(
      "table",
      { class: "codes" },
      h("thead", {}, h("tr", {}, h("th", { scope: "col" }, "Error code"), h("th", { scope: "col", class: "num" }, "Requests"))),
      h("tbody", {}, rows.map((r) => h("tr", { "data-code": r.code }, h("td", {}, h("code", {}, r.code)), h("td", { class: "num" }, count(r.count))))),
    ),
    h("p", { class: "muted" }, note),
  ];
}

// Saves the file through a Blob: the key travels in a header, never in a URL.
/**
 * @param {string} fileId
 * @param {string} name
 * @param {HTMLElement} area
 */
async function download(fileId, name, area) {
  try {
    const response = await call("GET", `/v1/files/${encodeURIComponent(fileId)}/content`);
    const blob = await response.blob();
    const url = URL.createObjectURL(blob);
    const link = h("a", { href: url, download: name, hidden: true });
    document.body.append(link);
    link.click();
    link.remove();
    setTimeout(() => URL.revokeObjectURL(url), 60_000);
  } catch (error) {
    if (error instanceof ApiError) replace(area, apiMessage(error, `The file ${fileId} could not be downloaded.`));
    else throw error;
  }
}

/** @param {string} text */
function resultRows(text) {
  const rows = text.split("\n").filter(Boolean);
  if (!rows.length) return h("p", { class: "muted" }, "No results stored yet.");
  return h(
    "ol",
    { class: "results" },
    rows.map((line) => {
      /** @type {any} */
      let parsed = null;
      try {
        parsed = JSON.parse(line);
      } catch {
        parsed = null;
      }
      const ok = parsed && !parsed.error && parsed.response?.status_code === 200;
      const label = parsed ? `${parsed.custom_id} — ${ok ? "ok" : parsed.error?.code || `HTTP ${parsed.response?.status_code}`}` : "unreadable row";
      return h("li", {}, h("details", {}, h("summary", {}, label), h("pre", {}, parsed ? JSON.stringify(parsed, null, 2) : line)));
    }),
  );
}

/**
 * @param {HTMLElement} root
 * @param {import("./dom.js").ViewContext} context
 * @param {string} batchId
 */
export function batchView(root, context, batchId) {
  const status = h("span", { id: "batch-status" });
  const waiting = h("div", { class: "waiting", role: "status" });
  const actions = h("div", { class: "actions" });
  const actionMessage = h("div", { class: "message-area", "aria-live": "polite" });
  const progress = h("div", { id: "progress" });
  const chart = h("figure", { class: "chart-box" });
  const timelineBox = h("div");
  const usageBox = h("div");
  const codesBox = h("div", { id: "error-codes" });
  const metaBox = h("div");
  const notifyBox = h("div");
  const resultsBox = h("div", { id: "results" });
  // Status changes are announced to screen readers; the counts are not (too chatty).
  const announce = h("p", { class: "sr-only", role: "status", "aria-live": "polite" });
  const samples = loadSamples(batchId);
  /** @type {import("./chart.js").Point[]} */
  let history = [];
  let historyReadAt = 0;
  /** @type {Batch | null} */
  let batch = null;
  /** @type {BatchCharges | null} */
  let charges = null;
  /** @type {Poller | null} */
  let poller = null;
  let closed = false;
  let countedAtEnd = false;

  replace(
    root,
    h("p", {}, h("a", { href: "#/batches" }, "← All batches")),
    h("div", { class: "title-row" }, h("h1", { class: "batch-id" }, batchId), status),
    waiting,
    announce,
    actions,
    actionMessage,
    section("Progress", "h-progress", progress, chart),
    h(
      "div",
      { class: "grid" },
      section("Status timeline", "h-timeline", timelineBox),
      section("Usage and cost", "h-usage", usageBox),
      section(
        "Error codes",
        "h-codes",
        codesBox,
        h("button", { type: "button", class: "secondary", onclick: () => countCodes() }, "Count again"),
      ),
      section("Details and metadata", "h-meta", metaBox),
    ),
    section("Notifications", "h-notify", notifyBox),
    section(
      "Results",
      "h-results",
      h("p", { class: "muted" }, "Results hold the content of requests and answers; they load only when you ask."),
      h("button", { type: "button", class: "secondary", id: "show-results", onclick: () => showResults() }, "Show the first 20 results"),
      resultsBox,
    ),
  );

  const confirmDialog = h(
    "dialog",
    { id: "confirm-cancel", "aria-labelledby": "confirm-title" },
    h("h2", { id: "confirm-title" }, "Cancel this batch?"),
    h("p", {}, "Requests already running finish; the others end with the error batch_cancelled. This cannot be undone."),
    h(
      "form",
      { method: "dialog", class: "dialog-actions" },
      h("button", { type: "submit", value: "keep", class: "secondary", autofocus: true }, "Keep it running"),
      h("button", { type: "submit", value: "cancel", class: "danger" }, "Cancel batch"),
    ),
  );
  root.append(confirmDialog);
  confirmDialog.addEventListener("close", async () => {
    if (confirmDialog.returnValue !== "cancel") return;
    await act("Cancelling…", () => postJson(`/v1/batches/${encodeURIComponent(batchId)}/cancel`, undefined), (b) => {
      render(b);
      startPolling();
    });
  });

  /**
   * @param {string} pending
   * @param {() => Promise<Batch>} fn
   * @param {(batch: Batch) => void} done
   */
  async function act(pending, fn, done) {
    replace(actionMessage, h("p", { role: "status" }, pending));
    try {
      const result = await fn();
      replace(actionMessage);
      done(result);
    } catch (error) {
      if (error instanceof ApiError) replace(actionMessage, apiMessage(error, "The server refused:"));
      else replace(actionMessage, h("p", { class: "error", role: "alert" }, String(/** @type {{ message?: string }} */ (error).message || error)));
    }
  }

  /** @param {Batch} batch */
  function renderActions(batch) {
    const writable = context.canWrite();
    const terminal = TERMINAL.has(batch.status);
    const cancellable = !terminal && batch.status !== "cancelling";
    const rerunnable = terminal && (batch.status !== "completed" || batch.request_counts.failed > 0);
    // Only a batch that can still start requests can be paused, resumed or reprioritised.
    const controllable = batch.status === "validating" || batch.status === "in_progress";
    const paused = Boolean(batch.paused_at);
    const priorityInput = h("input", {
      type: "number",
      id: "priority-input",
      step: "1",
      value: String(batch.priority ?? 0),
      "aria-label": "Priority (higher runs first among your organization's batches)",
      disabled: !writable || !controllable,
    });
    const reason = writable ? null : h("p", { class: "hint", id: "read-only-reason" }, context.readOnlyReason());
    const buttons = [
      h(
        "button",
        {
          type: "button",
          id: "cancel",
          class: "danger",
          disabled: !writable || !cancellable,
          "aria-describedby": writable ? null : "read-only-reason",
          onclick: () => confirmDialog.showModal(),
        },
        "Cancel batch",
      ),
      h(
        "button",
        {
          type: "button",
          id: "download-output",
          disabled: !batch.output_file_id,
          onclick: () => download(/** @type {string} */ (batch.output_file_id), `${batch.id}-output.jsonl`, actionMessage),
        },
        "Download output",
      ),
      h(
        "button",
        {
          type: "button",
          id: "download-errors",
          disabled: !batch.error_file_id,
          onclick: () => download(/** @type {string} */ (batch.error_file_id), `${batch.id}-errors.jsonl`, actionMessage),
        },
        "Download errors",
      ),
      h(
        "button",
        {
          type: "button",
          id: "rerun",
          disabled: !writable || !rerunnable,
          "aria-describedby": writable ? null : "read-only-reason",
          onclick: () =>
            act("Creating a rerun of the failed lines…", () => postJson(`/v1/batches/${encodeURIComponent(batchId)}/retry`, {}), (b) => {
              location.hash = `#/batch/${encodeURIComponent(b.id)}`;
            }),
        },
        "Rerun failed lines",
      ),
      h(
        "button",
        {
          type: "button",
          id: paused ? "resume" : "pause",
          class: "secondary",
          disabled: !writable || !controllable,
          "aria-describedby": writable ? null : "read-only-reason",
          onclick: () =>
            act(paused ? "Resuming…" : "Pausing…", () => postJson(`/v1/batches/${encodeURIComponent(batchId)}/${paused ? "resume" : "pause"}`, {}), render),
        },
        paused ? "Resume" : "Pause",
      ),
      h(
        "span",
        { class: "inline-control" },
        priorityInput,
        h(
          "button",
          {
            type: "button",
            id: "set-priority",
            class: "secondary",
            disabled: !writable || !controllable,
            "aria-describedby": writable ? null : "read-only-reason",
            onclick: () =>
              act("Changing the priority…", () => postJson(`/v1/batches/${encodeURIComponent(batchId)}`, { priority: Number(/** @type {HTMLInputElement} */ (priorityInput).value) }), render),
          },
          "Set priority",
        ),
      ),
    ];
    replace(actions, buttons, reason);
  }

  /** @param {Batch} fresh */
  function render(fresh) {
    if (batch && batch.status !== fresh.status) announce.textContent = `The batch is now ${fresh.status.replace("_", " ")}.`;
    batch = fresh;
    addSample(batchId, samples, batch);
    replace(status, statusBadge(batch.status));
    replace(waiting, waitingNote(batch.waiting_on));
    if (!actions.contains(document.activeElement)) renderActions(batch);
    else if (/** @type {Element} */ (document.activeElement).id === "priority-input") {
      // A priority being typed is kept until it is set.
    } else {
      // Keep the focused button in place; only its state changes.
      const focused = /** @type {Element} */ (document.activeElement).id;
      renderActions(batch);
      document.getElementById(focused)?.focus();
    }
    const counts = batch.request_counts;
    const done = counts.completed + counts.failed;
    const percent = counts.total ? Math.floor((done / counts.total) * 100) : 0;
    replace(
      progress,
      progressCell(batch),
      h("p", { class: "big" }, h("span", { id: "done-count" }, count(done)), ` of ${count(counts.total)} requests done (${percent} %)`),
    );
    const source = history.length
      ? "Requests done over time, from when the server stored each result."
      : "Requests done over time; sampled every 2 s while this page is open (the server has no history for this batch yet).";
    replace(chart, progressChart(batch, samples, history), h("figcaption", { class: "muted" }, source));
    replace(timelineBox, timeline(batch));
    replace(usageBox, usage(batch, charges));
    replace(metaBox, metadata(batch));
    if (batch.errors?.data?.length) {
      replace(
        codesBox,
        h("p", {}, "The batch could not start:"),
        h("ul", {}, batch.errors.data.map((e) => h("li", {}, h("code", {}, e.code || "error"), " ", e.message || ""))),
      );
    }
  }

  // ``final``: the batch ended, so its curve is read once more whenever it was read last.
  /** @param {boolean} final */
  async function loadHistory(final) {
    if (!final && Date.now() - historyReadAt < HISTORY_MS) return;
    historyReadAt = Date.now();
    try {
      history = historyPoints(await getJson(`/v1/batches/${encodeURIComponent(batchId)}/progress`));
    } catch {
      // Refused or unreachable (a 401 still signs out, in call()): the points read last, or
      // the page's own samples, draw the chart until the next read.
    }
  }

  async function loadCharges() {
    /** @type {{ data: BatchCharges[] }} */
    const found = await getJson(`/v1/organization/batch_charges?ids=${encodeURIComponent(batchId)}`);
    charges = found.data[0] || null;
  }

  async function countCodes() {
    if (batch?.errors?.data?.length) return;
    try {
      /** @type {ErrorCodes} */
      const found = await getJson(`/v1/batches/${encodeURIComponent(batchId)}/error_codes`);
      if (!closed) replace(codesBox, errorCodesTable(found));
    } catch (error) {
      if (error instanceof ApiError) replace(codesBox, apiMessage(error, "The error codes could not be counted."));
    }
  }

  async function loadNotifications() {
    try {
      /** @type {{ data: Notification[] }} */
      const found = await getJson(`/v1/batches/${encodeURIComponent(batchId)}/notifications`);
      if (!closed) replace(notifyBox, notificationsTable(found.data));
    } catch (error) {
      if (error instanceof ApiError) replace(notifyBox, apiMessage(error, "Notifications could not be read."));
    }
  }

  async function showResults() {
    try {
      const response = await call("GET", `/v1/batches/${encodeURIComponent(batchId)}/results?limit=20`);
      replace(resultsBox, resultRows(await response.text()));
    } catch (error) {
      if (error instanceof ApiError) replace(resultsBox, apiMessage(error, "Results could not be read."));
    }
  }

  async function refresh() {
    /** @type {Batch} */
    const fresh = await getJson(`/v1/batches/${encodeURIComponent(batchId)}`);
    await loadCharges();
    await loadHistory(TERMINAL.has(fresh.status));
    if (closed) return false;
    render(fresh);
    if (TERMINAL.has(fresh.status)) {
      if (!countedAtEnd) {
        countedAtEnd = true;
        countCodes();
        loadNotifications();
      }
      return false;
    }
    return true;
  }

  function startPolling() {
    if (poller && !poller.stopped) return;
    poller = new Poller(refresh, REFRESH_MS).start();
  }

  (async () => {
    try {
      /** @type {Batch} */
      const first = await getJson(`/v1/batches/${encodeURIComponent(batchId)}`);
      await loadCharges();
      await loadHistory(true);
      if (closed) return;
      render(first);
      countedAtEnd = TERMINAL.has(first.status);
      countCodes();
      loadNotifications();
      if (!TERMINAL.has(first.status)) startPolling();
    } catch (error) {
      if (error instanceof ApiError) replace(root, h("p", {}, h("a", { href: "#/batches" }, "← All batches")), h("h1", {}, batchId), apiMessage(error, "This batch could not be read."));
      else throw error;
    }
  })();

  return () => {
    closed = true;
    if (poller) poller.stop();
    if (confirmDialog.open) confirmDialog.close();
  };
}
