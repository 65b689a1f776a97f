// Every API call of the page: the secret from this tab's session storage, sent as a bearer
// header. No cookies are sent or kept, so another site cannot act with them.

const SECRET = "backfill.secret";
const ROLE = "backfill.role";

export class ApiError extends Error {
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
  save(secret, role) {
    sessionStorage.setItem(SECRET, secret);
    sessionStorage.setItem(ROLE, role);
  },
  clear: () => sessionStorage.clear(),
};

// Called when a signed-in call is refused with 401 (a revoked key): the app signs out.
let onUnauthorized = () => {};
export function whenUnauthorized(handler) {
  onUnauthorized = handler;
}

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

export async function call(method, path, { json, form, secret } = {}) {
  const headers = { Authorization: `Bearer ${secret ?? session.secret() ?? ""}` };
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

export async function getJson(path, options) {
  return (await call("GET", path, options)).json();
}

export async function postJson(path, json) {
  return (await call("POST", path, { json })).json();
}

export function query(params) {
  const search = new URLSearchParams();
  for (const [name, value] of Object.entries(params)) {
    if (value !== null && value !== undefined && value !== "") search.set(name, String(value));
  }
  const text = search.toString();
  return text ? `?${text}` : "";
}
