// The org's credit, its spend caps and its ledger: credits added and what each batch was charged.
// @ts-check

/**
 * @typedef {{
 *   id: string, type: string, created_at: number, amount: import("./api.js").Amount,
 *   reserved?: import("./api.js").Amount | null, note?: string | null,
 *   batch_id?: string, batch_status?: string | null, model?: string | null,
 * }} LedgerEntry
 */

/**
 * @typedef {{
 *   scope: "org" | "key", key_id: string | null, period: string, limit: string,
 *   charged: string, reserved: string, left: string,
 *   window_start: number | null, resets_at: number | null,
 * }} SpendCap
 */

import { ApiError, getJson, query } from "./api.js";
import { apiMessage, h, replace, statusBadge, time, usd } from "./dom.js";

const PAGE = 20;
/** @type {(string | null)[]} */
const history = [];

/** @param {LedgerEntry} entry */
function entryRow(entry) {
  const what =
    entry.type === "credit"
      ? [h("strong", {}, "Credit"), entry.note ? [h("br"), h("small", {}, entry.note)] : null]
      : [
          h("a", { href: `#/batch/${encodeURIComponent(/** @type {string} */ (entry.batch_id))}` }, entry.batch_id),
          h("br"),
          h("small", { class: "muted" }, entry.model || ""),
          " ",
          entry.batch_status ? statusBadge(entry.batch_status) : null,
        ];
  return h(
    "tr",
    { "data-entry": entry.id },
    h("td", { "data-label": "Date" }, time(entry.created_at)),
    h("td", { "data-label": "Entry" }, what),
    h("td", { "data-label": "Amount", class: "num" }, usd(entry.amount.usd)),
    h("td", { "data-label": "Reserved", class: "num" }, entry.reserved && entry.reserved.value !== "0" ? usd(entry.reserved.usd) : "—"),
  );
}

const PERIOD = { day: "Day (UTC)", week: "Week (UTC, from Monday)", month: "Month (UTC)", total: "In all" };

/** @param {SpendCap} cap */
function capRow(cap) {
  const period = /** @type {Record<string, string>} */ (PERIOD)[cap.period] || cap.period;
  return h(
    "tr",
    { "data-cap": `${cap.key_id || "org"}:${cap.period}` },
    h("td", { "data-label": "Cap of" }, cap.scope === "org" ? "The organization" : h("code", {}, cap.key_id)),
    h("td", { "data-label": "Period" }, period),
    h("td", { "data-label": "Cap", class: "num" }, usd(cap.limit)),
    h("td", { "data-label": "Charged", class: "num" }, usd(cap.charged)),
    h("td", { "data-label": "Reserved", class: "num" }, usd(cap.reserved)),
    h("td", { "data-label": "Left", class: "num", "data-cap-left": "" }, usd(cap.left)),
    h("td", { "data-label": "Resets" }, cap.resets_at === null ? "never" : time(cap.resets_at)),
  );
}

/** @param {SpendCap[]} caps */
function capsSection(caps) {
  if (!caps.length) return h("p", { class: "muted", id: "spend-caps" }, "No spend caps: batches are limited by the credit available only.");
  return h(
    "div",
    { class: "table-wrap", id: "spend-caps" },
    h(
      "table",
      { class: "responsive caps" },
      h("thead", {}, h("tr", {}, ["Cap of", "Period", "Cap", "Charged", "Reserved", "Left", "Resets"].map((c) => h("th", { scope: "col" }, c)))),
      h("tbody", {}, caps.map(capRow)),
    ),
  );
}

/**
 * @param {HTMLElement} root
 * @param {import("./dom.js").ViewContext} _context
 * @param {URLSearchParams} params
 */
export function accountView(root, _context, params) {
  const after = params.get("after") || null;
  if (!after) history.length = 0;
  const credit = h("div", { id: "credit" }, h("p", { class: "muted" }, "Loading…"));
  const tbody = h("tbody");
  const message = h("div", { class: "message-area" });
  const previous = h("button", { type: "button", disabled: !after }, "Previous");
  const next = h("button", { type: "button", disabled: true }, "Next");
  replace(
    root,
    h("h1", {}, "Credit"),
    credit,
    h("h2", {}, "Ledger"),
    h("p", { class: "muted" }, "Credits added, and what each batch was charged so far (and still holds reserved while it runs). GPU time of private deployments is in the totals above."),
    message,
    h(
      "div",
      { class: "table-wrap" },
      h(
        "table",
        { class: "responsive ledger" },
        h("thead", {}, h("tr", {}, ["Date", "Entry", "Amount", "Reserved"].map((c) => h("th", { scope: "col" }, c)))),
        tbody,
      ),
    ),
    h("nav", { class: "pager", "aria-label": "Pages" }, previous, next),
  );
  /** @type {string | null} */
  let nextCursor = null;
  previous.addEventListener("click", () => {
    location.hash = `#/account${query({ after: history.pop() ?? null })}`;
  });
  next.addEventListener("click", () => {
    history.push(after);
    location.hash = `#/account${query({ after: nextCursor })}`;
  });

  (async () => {
    try {
      const org = await getJson("/v1/organization");
      const c = org.credit;
      replace(
        credit,
        h("p", {}, "Organization ", h("strong", {}, org.name), " ", h("small", { class: "muted" }, org.id)),
        h(
          "dl",
          { class: "tiles" },
          [
            ["Available", c.available, "available"],
            ["Balance", c.balance, "balance"],
            ["Reserved by running batches", c.reserved, "reserved"],
            ["Credits, all time", c.credits, "credits"],
            ["Charges, all time", c.charges, "charges"],
          ].map(([label, value, name]) => h("div", { class: "tile" }, h("dt", {}, label), h("dd", { "data-credit": name }, usd(value)))),
        ),
        h("h2", {}, "Spend caps"),
        h(
          "p",
          { class: "muted" },
          "The most this organization, or one of its keys, may spend in each window. A batch counts in the window it was created in: what it was charged, and what it still holds reserved while it runs. A batch that would go past a cap is refused (402 spend_cap_reached).",
        ),
        capsSection(org.spend_caps || []),
      );
      /** @type {import("./api.js").Page<LedgerEntry>} */
      const page = await getJson(`/v1/organization/ledger${query({ limit: PAGE, after })}`);
      replace(tbody, page.data.length ? page.data.map(entryRow) : h("tr", {}, h("td", { colspan: 4 }, "No entries.")));
      nextCursor = page.has_more ? page.last_id : null;
      next.disabled = !nextCursor;
    } catch (error) {
      if (error instanceof ApiError) replace(message, apiMessage(error, "The ledger could not be read."));
      else throw error;
    }
  })();
}
