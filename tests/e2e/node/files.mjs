// Seed 004, "Manage files": list, retrieve and delete files, with the SDK's own methods; a
// deleted file is then not found (the SDK throws its NotFoundError). Usage: node files.mjs
import fs from "fs";

import OpenAI from "openai";

import { chatLine, client, report } from "./client.mjs";

fs.writeFileSync(
  "filesinput.jsonl",
  chatLine("file-1", "You are a helpful assistant.", "What is the capital of Peru?") + "\n",
);
const uploaded = await client.files.create({
  file: fs.createReadStream("filesinput.jsonl"),
  purpose: "batch",
});

const listed = [];
for await (const file of client.files.list({ limit: 20 })) {
  listed.push(file.id);
}
const batchInputs = [];
for await (const file of client.files.list({ purpose: "batch" })) {
  batchInputs.push({ id: file.id, purpose: file.purpose });
}

const retrieved = await client.files.retrieve(uploaded.id);
const deleted = await client.files.delete(uploaded.id);

let afterDelete;
try {
  await client.files.retrieve(uploaded.id);
  afterDelete = { found: true };
} catch (err) {
  afterDelete = {
    found: false,
    notFoundError: err instanceof OpenAI.NotFoundError,
    status: err.status ?? null,
    error: err.error ?? null,
  };
}

report({ uploaded, listed, batchInputs, retrieved, deleted, afterDelete });
