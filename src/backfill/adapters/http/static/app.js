// The Batches page: sign in, then one view at a time, chosen by the URL's fragment.
// @ts-check

import { ApiError, getJson, session, whenUnauthorized } from "./api.js";
import { h, replace } from "./dom.js";
import { accountView } from "./account.js";
import { adminView } from "./admin.js";
import { batchView } from "./batch.js";
import { batchesView } from "./batches.js";
import { createView } from "./create.js";

const WRITE = "inference:write";
// Every id it is given is in index.html.
const $ = (/** @type {string} */ id) => /** @type {HTMLElement} */ (document.getElementById(id));
const secretInput = () => /** @type {HTMLInputElement} */ ($("secret"));

/** @typedef {import("./api.js").KeyIdentity} KeyIdentity */

// What the signed-in secret is: a key (its scopes and org) or the admin token.
/** @type {{ identity: import("./api.js").Identity | null, cleanup: (() => void) | null }} */
const state = { identity: null, cleanup: null };

function canWrite() {
  return Boolean(/** @type {Partial<KeyIdentity> | null} */ (state.identity)?.scopes?.includes(WRITE));
}

/** @type {import("./dom.js").ViewContext} */
const context = {
  canWrite,
  identity: () => state.identity,
  readOnlyReason: () =>
    `This key can read but not change anything: it lacks the '${WRITE}' scope. ` +
    "Sign in with a key that has it to create, cancel or rerun batches.",
};

/** @type {[string, string][]} */
const KEY_ROUTES = [
  ["#/batches", "Batches"],
  ["#/new", "New batch"],
  ["#/account", "Credit"],
];
/** @type {[string, string][]} */
const ADMIN_ROUTES = [["#/admin", "Operations"]];

function renderNav() {
  const routes = session.role() === "admin" ? ADMIN_ROUTES : KEY_ROUTES;
  const current = location.hash.split("?")[0] || routes[0][0];
  replace(
    $("nav"),
    h(
      "ul",
      {},
      routes.map(([href, label]) =>
        h(
          "li",
          {},
          h("a", { href, "aria-current": current.startsWith(href) ? "page" : null }, label),
        ),
      ),
    ),
  );
  $("nav").hidden = false;
  const who = /** @type {KeyIdentity} */ (state.identity);
  $("who-text").textContent =
    session.role() === "admin"
      ? "Administrator"
      : `${who.organization.name} · key ${who.prefix}…${canWrite() ? "" : " (read-only)"}`;
  $("who").hidden = false;
}

/** @param {string} [message] */
function showSignIn(message) {
  if (state.cleanup) state.cleanup();
  state.cleanup = null;
  state.identity = null;
  $("nav").hidden = true;
  $("who").hidden = true;
  replace($("view"));
  $("sign-in").hidden = false;
  $("sign-in-error").textContent = message || "";
  document.title = "Sign in · Backfill";
  secretInput().focus();
}

/** @param {string} [message] */
function signOut(message) {
  session.clear();
  if (location.hash) history.replaceState(null, "", location.pathname);
  showSignIn(message);
}

// An API key reads who it is at /v1/api_key; anything else is tried as the admin token.
// Keys start with "bf-", so a mistyped key never counts as a failed admin sign-in.
/**
 * @param {string} secret
 * @returns {Promise<{ role: string, identity: import("./api.js").Identity }>}
 */
async function identify(secret) {
  if (secret.startsWith("bf-")) {
    return { role: "key", identity: await getJson("/v1/api_key", { secret }) };
  }
  await getJson("/admin/v1/engines", { secret });
  return { role: "admin", identity: { admin: true } };
}

/** @param {SubmitEvent} event */
async function signIn(event) {
  event.preventDefault();
  const secret = secretInput().value.trim();
  $("sign-in-error").textContent = "";
  if (!secret) return;
  const button = /** @type {HTMLButtonElement} */ (event.submitter || $("sign-in-form").querySelector("button"));
  button.disabled = true;
  try {
    const { role, identity } = await identify(secret);
    session.save(secret, role);
    state.identity = identity;
    secretInput().value = "";
    $("sign-in").hidden = true;
    location.hash = role === "admin" ? "#/admin" : "#/batches";
    route();
  } catch (error) {
    $("sign-in-error").textContent =
      error instanceof ApiError ? error.message : `Could not reach Backfill: ${/** @type {Error} */ (error).message}`;
  } finally {
    button.disabled = false;
  }
}

// An address the page has no view for (a batch id that is not well-formed percent-encoding,
// say): said in words, with the way back; the address is shown as text.
/**
 * @param {HTMLElement} root
 * @param {string} address
 */
function notFoundView(root, address) {
  replace(
    root,
    h("p", {}, h("a", { href: "#/batches" }, "← All batches")),
    h("h1", {}, "Not found"),
    h("p", {}, "Nothing is at ", h("code", { class: "break" }, address), ". Open a batch from the list."),
  );
}

// The batch id of a "#/batch/{id}" path; null when the rest is empty or not well-formed
// percent-encoding (decodeURIComponent throws URIError on "%E0%A").
/** @param {string} path */
function batchIdOf(path) {
  try {
    return decodeURIComponent(path.slice("/batch/".length)) || null;
  } catch (error) {
    if (error instanceof URIError) return null;
    throw error;
  }
}

function route() {
  if (!session.secret() || !state.identity) return;
  if (state.cleanup) state.cleanup();
  state.cleanup = null;
  const [path, search] = (location.hash || "").slice(1).split("?");
  const params = new URLSearchParams(search || "");
  const view = $("view");
  const admin = session.role() === "admin";
  /** @type {(() => void) | void} */
  let cleanup;
  if (admin) {
    cleanup = adminView(view);
  } else if (path.startsWith("/batch/")) {
    const batchId = batchIdOf(path);
    cleanup = batchId === null ? notFoundView(view, `#${path}`) : batchView(view, context, batchId);
  } else if (path === "/new") {
    cleanup = createView(view, context);
  } else if (path === "/account") {
    cleanup = accountView(view, context, params);
  } else {
    cleanup = batchesView(view, context, params);
  }
  state.cleanup = typeof cleanup === "function" ? cleanup : null;
  renderNav();
  const heading = view.querySelector("h1");
  if (heading) {
    heading.tabIndex = -1;
    document.title = `${heading.textContent} · Backfill`;
    // Focus follows the view for keyboard and screen-reader users, except at first load.
    if (document.activeElement && document.activeElement !== document.body) heading.focus();
  }
}

async function start() {
  $("sign-in-form").addEventListener("submit", signIn);
  $("sign-out").addEventListener("click", () => signOut("Signed out. The secret was removed from this tab."));
  whenUnauthorized((error) => signOut(error.message));
  window.addEventListener("hashchange", route);
  const secret = session.secret();
  if (!secret) {
    showSignIn();
    return;
  }
  try {
    const { role, identity } = await identify(secret);
    session.save(secret, role);
    state.identity = identity;
    $("sign-in").hidden = true;
    route();
  } catch (error) {
    signOut(error instanceof ApiError ? error.message : `Could not reach Backfill: ${/** @type {Error} */ (error).message}`);
  }
}

start();
