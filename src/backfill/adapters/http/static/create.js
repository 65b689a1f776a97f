// Upload a JSONL file and create a batch from it. A refused upload shows the API's message as
// it was sent, with the line and field it names.
// @ts-check

import { ApiError, call, getJson, postJson } from "./api.js";
import { apiMessage, h, replace } from "./dom.js";

const ENDPOINTS = ["/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/embeddings"];

/**
 * @param {HTMLElement} root
 * @param {import("./dom.js").ViewContext} context
 */
export function createView(root, context) {
  const writable = context.canWrite();
  const message = h("div", { class: "message-area", id: "create-message" });
  const endpoint = h(
    "select",
    { id: "endpoint", name: "endpoint" },
    ENDPOINTS.map((e) => h("option", { value: e }, e)),
  );
  const submit = h(
    "button",
    { type: "submit", id: "create", disabled: !writable, "aria-describedby": writable ? null : "read-only-reason" },
    "Upload and create batch",
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
    writable ? null : h("p", { class: "hint", id: "read-only-reason" }, context.readOnlyReason()),
    submit,
  );
  replace(
    root,
    h("h1", {}, "New batch"),
    h("p", {}, "The file is checked line by line as it uploads; nothing is stored unless every line is valid."),
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
  const fields = /** @type {HTMLFormControlsCollection & Record<"file" | "window" | "description", HTMLInputElement>} */ (
    form.elements
  );

  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    const file = /** @type {FileList} */ (fields.file.files)[0];
    if (!file) return;
    submit.disabled = true;
    replace(message, h("p", { role: "status" }, `Uploading ${file.name}…`));
    let uploaded;
    try {
      const data = new FormData();
      data.append("purpose", "batch");
      data.append("file", file, file.name);
      uploaded = await (await call("POST", "/v1/files", { form: data })).json();
    } catch (error) {
      submit.disabled = !writable;
      if (error instanceof ApiError) replace(message, apiMessage(error, "The upload was refused:"));
      else replace(message, h("p", { class: "error", role: "alert" }, `The upload failed: ${/** @type {Error} */ (error).message}`));
      return;
    }
    replace(message, h("p", { role: "status" }, `Uploaded ${uploaded.id}; creating the batch…`));
    /** @type {{ input_file_id: string, endpoint: string, completion_window: string, metadata?: Record<string, string> }} */
    const body = {
      input_file_id: uploaded.id,
      endpoint: endpoint.value,
      completion_window: fields.window.value.trim(),
    };
    const description = fields.description.value.trim();
    if (description) body.metadata = { description };
    try {
      const batch = await postJson("/v1/batches", body);
      location.hash = `#/batch/${encodeURIComponent(batch.id)}`;
    } catch (error) {
      submit.disabled = !writable;
      if (error instanceof ApiError) replace(message, apiMessage(error, `The file ${uploaded.id} was uploaded, but the batch was refused:`));
      else replace(message, h("p", { class: "error", role: "alert" }, `The batch could not be created: ${/** @type {Error} */ (error).message}`));
    }
  });
}
