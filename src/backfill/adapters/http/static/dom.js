// Building the page from data: text always goes in as text nodes, never as markup.
// @ts-check

/**
 * What h() and replace() append: nodes, text, numbers; nested arrays are flattened and null,
 * undefined and false are skipped. (A JSDoc type cannot name itself: three levels of arrays
 * are checked, any deeper is not.)
 * @typedef {Node | string | number | boolean | null | undefined} Leaf
 * @typedef {Leaf | Array<Leaf | Array<Leaf | Array<Leaf | unknown[]>>>} Child
 * @typedef {Record<string, unknown>} Attrs
 */
/**
 * What app.js hands every view.
 * @typedef {{
 *   canWrite: () => boolean,
 *   identity: () => import("./api.js").Identity | null,
 *   readOnlyReason: () => string,
 * }} ViewContext
 */

/**
 * @template {keyof HTMLElementTagNameMap} K
 * @param {K} tag
 * @param {Attrs} [attrs]
 * @param {Child[]} children
 * @returns {HTMLElementTagNameMap[K]}
 */
export function h(tag, attrs = {}, ...children) {
  const element = document.createElement(tag);
  setAttributes(element, attrs);
  append(element, children);
  return element;
}

const SVG_NS = "http://www.w3.org/2000/svg";

/**
 * @template {keyof SVGElementTagNameMap} K
 * @param {K} tag
 * @param {Attrs} [attrs]
 * @param {Child[]} children
 * @returns {SVGElementTagNameMap[K]}
 */
export function svg(tag, attrs = {}, ...children) {
  const element = document.createElementNS(SVG_NS, tag);
  setAttributes(element, attrs);
  append(element, children);
  return element;
}

/**
 * @param {Element} element
 * @param {Attrs} attrs
 */
function setAttributes(element, attrs) {
  for (const [name, value] of Object.entries(attrs)) {
    if (value === null || value === undefined || value === false) continue;
    if (name.startsWith("on") && typeof value === "function") {
      element.addEventListener(name.slice(2), /** @type {EventListener} */ (value));
    } else if (name === "class") {
      element.setAttribute("class", /** @type {string} */ (value));
    } else {
      element.setAttribute(name, value === true ? "" : String(value));
    }
  }
}

/**
 * @param {Element} element
 * @param {Child[]} children
 */
function append(element, children) {
  for (const child of /** @type {Child[]} */ (children.flat(Infinity))) {
    if (child === null || child === undefined || child === false) continue;
    element.append(child instanceof Node ? child : String(child));
  }
}

/**
 * @param {Element} element
 * @param {Child[]} children
 */
export function replace(element, ...children) {
  element.replaceChildren();
  append(element, children);
}

const pad = (/** @type {number} */ n) => String(n).padStart(2, "0");

/** @param {number | null | undefined} unix */
export function time(unix) {
  if (unix === null || unix === undefined) return h("span", { class: "muted" }, "—");
  const date = new Date(unix * 1000);
  const text =
    `${date.getFullYear()}-${pad(date.getMonth() + 1)}-${pad(date.getDate())} ` +
    `${pad(date.getHours())}:${pad(date.getMinutes())}:${pad(date.getSeconds())}`;
  return h("time", { datetime: date.toISOString() }, text);
}

/** @param {number} seconds */
export function duration(seconds) {
  const s = Math.max(0, Math.round(seconds));
  if (s < 90) return `${s} s`;
  if (s < 5400) return `${Math.round(s / 60)} min`;
  if (s < 172800) return `${(s / 3600).toFixed(1)} h`;
  return `${(s / 86400).toFixed(1)} d`;
}

/** @param {string | null | undefined} text */
export function usd(text) {
  if (text === null || text === undefined) return "—";
  const value = String(text);
  return value.startsWith("-") ? `−$${value.slice(1)}` : `$${value}`;
}

/** @param {unknown} n */
export function count(n) {
  return typeof n === "number" ? n.toLocaleString("en-US") : "—";
}

export const TERMINAL = new Set(["completed", "failed", "expired", "cancelled"]);

export const STATUSES = [
  "validating",
  "in_progress",
  "finalizing",
  "completed",
  "failed",
  "expired",
  "cancelling",
  "cancelled",
];

/** @param {string} status */
export function statusBadge(status) {
  return h("span", { class: `badge status-${status}` }, status.replace("_", " "));
}

// A message from the API as it was sent: the text, and the line, field and code beside it.
/**
 * @param {import("./api.js").ApiError} error
 * @param {string} [prefix]
 */
export function apiMessage(error, prefix) {
  /** @type {[string, string][]} */
  const details = [];
  if (error.line !== null && error.line !== undefined) details.push(["Line", String(error.line)]);
  if (error.param) details.push(["Field", error.param]);
  if (error.code) details.push(["Code", error.code]);
  if (error.status) details.push(["HTTP", String(error.status)]);
  return h(
    "div",
    { class: "api-error", role: "alert" },
    prefix ? h("p", { class: "prefix" }, prefix) : null,
    h("p", { class: "message" }, error.message),
    details.length
      ? h("dl", { class: "inline" }, details.map(([name, value]) => [h("dt", {}, name), h("dd", { "data-field": name.toLowerCase() }, value)]))
      : null,
  );
}

// Runs ``fn`` every ``intervalMs`` while the tab is visible and until it returns false:
// nothing is asked of the server for a hidden tab or for batches that will not change.
export class Poller {
  /**
   * @param {() => Promise<boolean | void>} fn
   * @param {number} intervalMs
   */
  constructor(fn, intervalMs) {
    this.fn = fn;
    this.intervalMs = intervalMs;
    /** @type {number | undefined} */
    this.timer = undefined;
    this.stopped = true;
    this.running = false;
    this.onVisibility = () => {
      if (document.visibilityState === "visible") this.schedule(0);
      else clearTimeout(this.timer);
    };
  }

  start(delayMs = this.intervalMs) {
    this.stopped = false;
    document.addEventListener("visibilitychange", this.onVisibility);
    this.schedule(delayMs);
    return this;
  }

  /** @param {number} ms */
  schedule(ms) {
    clearTimeout(this.timer);
    if (this.stopped || this.running || document.visibilityState === "hidden") return;
    this.timer = setTimeout(() => this.tick(), ms);
  }

  async tick() {
    this.running = true;
    let again = true;
    try {
      again = (await this.fn()) !== false;
    } catch (error) {
      // A passing failure (a restart, a dropped connection): try again at the next tick.
      console.warn("refresh failed", error);
    } finally {
      this.running = false;
    }
    if (again) this.schedule(this.intervalMs);
    else this.stop();
  }

  stop() {
    this.stopped = true;
    clearTimeout(this.timer);
    document.removeEventListener("visibilitychange", this.onVisibility);
  }
}
