// Every API call of the page: the secret from this tab's session storage, sent as a bearer
// header. No cookies are sent or kept, so another site cannot act with them.
// @ts-check

// The shapes of the API's answers the page reads (docs/api.md), for the type checker only:
// `make check` runs tsc over these files (tools/js/tsconfig.json); nothing here runs.
/**
 * @typedef {{ message?: string, code?: string | null, param?: string | null, line?: number | null }} ErrorBody
 * @typedef {{ value: string, usd: string }} Amount
 * @typedef {{ total: number, completed: number, failed: number }} RequestCounts
 * @typedef {{ code?: string, message?: string, since?: number | null, resumes_at?: number | null }} WaitingOn
 * @typedef {{ input: string, cached_input: string, output: string, unit: string }} Pricing
 * @typedef {{ input_tokens?: number, output_tokens?: number, input_tokens_details?: { cached_tokens?: number } }} Usage
 * @typedef {{
 *   id: string, status: string, model?: string | null, endpoint?: string | null,
 *   completion_window?: string, input_file_id?: string, output_file_id?: string | null,
 *   error_file_id?: string | null, retry_of?: string | null, webhook_url?: string | null,
 *   billing?: string, pricing?: Pricing | null, usage?: Usage | null,
 *   request_counts: RequestCounts, waiting_on?: WaitingOn | null,
 *   metadata?: Record<string, string> | null,
 *   errors?: { data?: { code?: string, message?: string }[] } | null,
 *   estimated_completion_at?: number | null,
 *   priority?: number, paused_at?: number | null, output_validation?: boolean,
 *   created_at: number, expires_at?: number | null, in_progress_at?: number | null,
 *   cancelling_at?: number | null, finalizing_at?: number | null, completed_at?: number | null,
 *   failed_at?: number | null, expired_at?: number | null, cancelled_at?: number | null,
 * }} Batch
 * @typedef {{ id: string, billing?: string, charged: Amount, reserved: Amount }} BatchCharges
 */
/**
 * @template T
 * @typedef {{ data: T[], has_more: boolean, last_id: string | null }} Page
 */
/**
 * @typedef {{ name: string, id: string }} Organization
 * @typedef {{ prefix: string, scopes: string[], organization: Organization }} KeyIdentity
 * @typedef {KeyIdentity | { admin: true }} Identity
 */

const SECRET = "backfill.secret";
const ROLE = "backfill.role";

export class ApiError extends Error {
  /**
   * @param {number} status
   * @param {ErrorBody} error
   */
  constructor(status, error) {
    super(error.message || `The server answered ${status}.`);
    this.status = status;
    this.code = error.code || null;
    this.param = error.param || null;
    this.line = error.line ?? null;
  }
}

export const session = {
  secret: () => sessionStorage.getItem(SECRET),
  role: () => sessionStorage.getItem(ROLE),
  /**
   * @param {string} secret
   * @param {string} role
   */
  save(secret, role) {
    sessionStorage.setItem(SECRET, secret);
    sessionStorage.setItem(ROLE, role);
  },
  clear: () => sessionStorage.clear(),
};

// Called when a signed-in call is refused with 401 (a revoked key): the app signs out.
/** @type {(error: ApiError) => void} */
let onUnauthorized = () => {};
/** @param {(error: ApiError) => void} handler */
export function whenUnauthorized(handler) {
  onUnauthorized = handler;
}

/** @param {Response} response */
async function errorOf(response) {
  let body = null;
  try {
    body = await response.json();
  } catch {
    body = null;
  }
  const error = body && typeof body.error === "object" && body.error ? body.error : {};
  return new ApiError(response.status, error);
}

/**
 * @typedef {{ json?: unknown, form?: FormData, secret?: string }} CallOptions
 * @param {string} method
 * @param {string} path
 * @param {CallOptions} [options]
 */
export async function call(method, path, { json, form, secret } = {}) {
  /** @type {Record<string, string>} */
  const headers = { Authorization: `Bearer ${secret ?? session.secret() ?? ""}` };
  /** @type {string | FormData | undefined} */
  let body;
  if (json !== undefined) {
    headers["Content-Type"] = "application/json";
    body = JSON.stringify(json);
  } else if (form !== undefined) {
    body = form;
  }
  const response = await fetch(path, {
    method,
    headers,
    body,
    cache: "no-store",
    credentials: "omit",
    referrerPolicy: "no-referrer",
  });
  if (!response.ok) {
    const error = await errorOf(response);
    if (response.status === 401 && secret === undefined) onUnauthorized(error);
    throw error;
  }
  return response;
}

// The answer's JSON, as the API documents it: its type is the caller's to state.
/**
 * @param {string} path
 * @param {CallOptions} [options]
 * @returns {Promise<any>}
 */
export async function getJson(path, options) {
  return (await call("GET", path, options)).json();
}

/**
 * @param {string} path
 * @param {unknown} json
 * @returns {Promise<any>}
 */
export async function postJson(path, json) {
  return (await call("POST", path, { json })).json();
}

/** @param {Record<string, string | number | null | undefined>} params */
export function query(params) {
  const search = new URLSearchParams();
  for (const [name, value] of Object.entries(params)) {
    if (value !== null && value !== undefined && value !== "") search.set(name, String(value));
  }
  const text = search.toString();
  return text ? `?${text}` : "";
}
