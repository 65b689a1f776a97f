// Upload a JSONL file and create a batch from it. A chosen file is uploaded at once and the
// batch it would make is estimated (POST /v1/batches/estimate, nothing stored) before the
// Create button is pressed. A refused upload shows the API's message as it was sent, with the
// line and field it names.
// @ts-check

import { ApiError, call, getJson, postJson } from "./api.js";
import { apiMessage, count, duration, h, replace, time, usd } from "./dom.js";

const ENDPOINTS = ["/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/embeddings"];

/**
 * The answer of POST /v1/batches/estimate (docs/api.md, "Estimating a batch").
 * @typedef {{ status: number, code: string, type: string, message: string, param: string | null }} Refusal
 * @typedef {{
 *   input_file_id: string, model: string, request_count: number, billing: string,
 *   worst_case: { input_tokens: number, output_tokens: number, cost: string },
 *   expected: {
 *     input_tokens: number, output_tokens: number, cost: string | null, basis: string,
 *     sample: { size: number, output_tokens_per_request: number | null },
 *   },
 *   admission: { admitted: boolean, available_credit: string, error: Refusal | null },
 *   estimated_completion_at: number | null,
 * }} BatchEstimate
 * @typedef {{ input_file_id: string, endpoint: string, completion_window: string, metadata?: Record<string, string>, output_validation?: boolean, priority?: number }} CreateBody
 */

/**
 * @param {[string, string, import("./dom.js").Child][]} rows
 */
function pairs(rows) {
  return h(
    "dl",
    { class: "pairs" },
    rows.map(([key, name, value]) => [h("dt", {}, name), h("dd", { "data-estimate": key }, value)]),
  );
}

/** @param {BatchEstimate} found */
function expectedText(found) {
  const { expected } = found;
  const tokens = `${count(expected.input_tokens)} input and ${count(expected.output_tokens)} output tokens`;
  const basis =
    expected.basis === "measured"
      ? `${expected.sample.output_tokens_per_request} output tokens per request, measured over your last ${count(expected.sample.size)} answers of ${found.model}`
      : `no answer of ${found.model} measured yet: each line at its max_tokens`;
  const cost = found.billing === "gpu_time" ? "Billed by GPU time" : usd(expected.cost);
  return [cost, h("br"), h("small", { class: "muted", "data-estimate": "sample" }, `${tokens}; ${basis}`)];
}

/** @param {BatchEstimate} found */
function admissionText(found) {
  const { admission } = found;
  if (admission.admitted || !admission.error) {
    return h("span", { "data-admitted": "true" }, `Would be accepted now (${usd(admission.available_credit)} available)`);
  }
  const error = admission.error;
  return h(
    "span",
    { "data-admitted": "false", class: "error" },
    `Would be refused now: ${error.message}`,
    h("br"),
    h("small", { "data-estimate": "code" }, `${error.code} (HTTP ${error.status})`),
  );
}

/** @param {number | null} at */
function completionText(at) {
  if (!at) return h("span", { class: "muted" }, "Unknown: the model's rate is not measured yet");
  return [time(at), ` (in about ${duration(at - Date.now() / 1000)})`];
}

/** @param {BatchEstimate} found */
function estimateView(found) {
  const worst = found.worst_case;
  return [
    h("h2", {}, `Estimate for ${count(found.request_count)} requests`),
    pairs([
      [
        "worst-case",
        "Worst case, reserved at creation",
        [
          usd(worst.cost),
          h("br"),
          h("small", { class: "muted" }, `${count(worst.input_tokens)} input and ${count(worst.output_tokens)} output tokens at most`),
        ],
      ],
      ["expected", "Expected cost", expectedText(found)],
      ["admission", "Admission", admissionText(found)],
      ["completion", "Estimated completion", completionText(found.estimated_completion_at)],
    ]),
  ];
}

/**
 * @param {HTMLElement} root
 * @param {import("./dom.js").ViewContext} context
 */
export function createView(root, context) {
  const writable = context.canWrite();
  const message = h("div", { class: "message-area", id: "create-message" });
  const estimate = h("section", { class: "card", id: "estimate", "aria-live": "polite", hidden: true });
  const endpoint = h(
    "select",
    { id: "endpoint", name: "endpoint" },
    ENDPOINTS.map((e) => h("option", { value: e }, e)),
  );
  const submit = h(
    "button",
    { type: "submit", id: "create", disabled: !writable, "aria-describedby": writable ? null : "read-only-reason" },
    "Create batch",
  );
  const form = h(
    "form",
    { class: "stack", id: "create-form" },
    h("label", { for: "file" }, "Input file (JSONL, one request per line)"),
    h("input", { id: "file", name: "file", type: "file", accept: ".jsonl,.json,application/jsonl,application/json,text/plain", required: true }),
    h("label", { for: "endpoint" }, "Endpoint"),
    endpoint,
    h("label", { for: "window" }, "Completion window"),
    h("input", { id: "window", name: "window", type: "text", value: "24h", required: true, "aria-describedby": "window-hint", inputmode: "text" }),
    h("p", { class: "hint", id: "window-hint" }, "A number and a unit, e.g. 24h or 7d; the server's range applies."),
    h("label", { for: "description" }, "Description (optional metadata)"),
    h("input", { id: "description", name: "description", type: "text", maxlength: 512 }),
    h("label", { for: "priority" }, "Priority"),
    h("input", { id: "priority", name: "priority", type: "number", step: 1, value: "0", "aria-describedby": "priority-hint", inputmode: "numeric" }),
    h("p", { class: "hint", id: "priority-hint" }, "Higher first among your organization's batches (another organization's share is not taken); 0 by default, up to your organization's cap. It can be changed while the batch runs."),
    h("label", { for: "output-validation" }, h("input", { id: "output-validation", name: "output_validation", type: "checkbox" }), " Check answers against each line's response_format schema"),
    writable ? null : h("p", { class: "hint", id: "read-only-reason" }, context.readOnlyReason()),
    estimate,
    submit,
  );
  replace(
    root,
    h("h1", {}, "New batch"),
    h(
      "p",
      {},
      "The file is checked line by line as it uploads; nothing is stored unless every line is valid. " +
        "Once it is in, the batch it would make is estimated: what it may cost, whether it would be accepted, and when it would finish.",
    ),
    form,
    message,
  );

  // The endpoint of the models this org may use, so the first choice is usually right.
  getJson("/v1/models")
    .then((models) => {
      /** @type {{ batch?: { endpoints?: string[] } | null }[]} */
      const data = models.data;
      const first = data.find((m) => m.batch)?.batch?.endpoints?.[0];
      if (first && ENDPOINTS.includes(first)) endpoint.value = first;
    })
    .catch(() => {});

  // The form's fields by name (form.elements.file and so on).
  const fields = /** @type {HTMLFormControlsCollection & Record<"file" | "window" | "description" | "priority", HTMLInputElement>} */ (
    form.elements
  );

  // The chosen file's upload, shared by the estimate and the creation: one upload per file.
  /** @type {{ file: File, upload: Promise<{ id: string }> } | null} */
  let current = null;
  /** @param {File} file */
  function uploadOf(file) {
    if (current && current.file === file) return current.upload;
    const data = new FormData();
    data.append("purpose", "batch");
    data.append("file", file, file.name);
    const upload = call("POST", "/v1/files", { form: data }).then((response) => response.json());
    const entry = { file, upload };
    current = entry;
    // A failed upload is not kept: choosing or submitting again tries again.
    upload.catch(() => {
      if (current === entry) current = null;
    });
    return upload;
  }

  // What creation sends; the estimate sends the same, so it answers for exactly this batch.
  /**
   * @param {string} fileId
   * @returns {CreateBody}
   */
  function requestBody(fileId) {
    /** @type {CreateBody} */
    const body = {
      input_file_id: fileId,
      endpoint: endpoint.value,
      completion_window: fields.window.value.trim(),
    };
    const description = fields.description.value.trim();
    if (description) body.metadata = { description };
    // Sent as typed: the server says what is wrong with a priority (not whole, over the cap).
    const priority = fields.priority.value.trim();
    if (priority && priority !== "0") body.priority = Number(priority);
    // An answer off its line's schema becomes an error row (output_schema_mismatch).
    if (/** @type {HTMLInputElement} */ (form.elements.namedItem("output_validation")).checked) body.output_validation = true;
    return body;
  }

  // The API's refusal as it was sent; a failure to reach it (no answer at all) says so.
  /**
   * @param {unknown} error
   * @param {string} refused
   * @param {string} failed
   */
  function failure(error, refused, failed) {
    if (error instanceof ApiError) return apiMessage(error, refused);
    return h("p", { class: "error", role: "alert" }, `${failed} ${/** @type {Error} */ (error).message}`);
  }

  // Answers of an older choice (another file, another window) are dropped when they arrive.
  let round = 0;
  async function showEstimate() {
    const file = fields.file.files?.[0];
    const mine = ++round;
    // What the last choice left (a refused upload) is about another file.
    replace(message);
    if (!file || !writable) {
      estimate.hidden = true;
      return;
    }
    estimate.hidden = false;
    replace(estimate, h("p", { role: "status" }, `Uploading ${file.name} and estimating its batch…`));
    let uploaded;
    try {
      uploaded = await uploadOf(file);
    } catch (error) {
      if (mine !== round) return;
      estimate.hidden = true;
      replace(message, failure(error, "The upload was refused:", "The upload failed:"));
      return;
    }
    if (mine !== round) return;
    try {
      /** @type {BatchEstimate} */
      const found = await postJson("/v1/batches/estimate", requestBody(uploaded.id));
      if (mine === round) replace(estimate, estimateView(found));
    } catch (error) {
      if (mine !== round) return;
      const prefix = `The file ${uploaded.id} was uploaded, but this batch could not be estimated:`;
      replace(estimate, failure(error, prefix, prefix));
    }
  }
  fields.file.addEventListener("change", showEstimate);
  endpoint.addEventListener("change", showEstimate);
  fields.window.addEventListener("change", showEstimate);
  fields.priority.addEventListener("change", showEstimate);

  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    const file = /** @type {FileList} */ (fields.file.files)[0];
    if (!file) return;
    submit.disabled = true;
    replace(message, h("p", { role: "status" }, `Uploading ${file.name}…`));
    let uploaded;
    try {
      uploaded = await uploadOf(file);
    } catch (error) {
      submit.disabled = !writable;
      replace(message, failure(error, "The upload was refused:", "The upload failed:"));
      return;
    }
    replace(message, h("p", { role: "status" }, `Uploaded ${uploaded.id}; creating the batch…`));
    try {
      const batch = await postJson("/v1/batches", requestBody(uploaded.id));
      location.hash = `#/batch/${encodeURIComponent(batch.id)}`;
    } catch (error) {
      submit.disabled = !writable;
      replace(message, failure(error, `The file ${uploaded.id} was uploaded, but the batch was refused:`, "The batch could not be created:"));
    }
  });
}
