// The client of seed 004's examples, with only the base URL, key and model taken from the
// environment (BACKFILL_BASE_URL, BACKFILL_API_KEY, BACKFILL_MODEL).
import OpenAI from "openai";

function required(name) {
  const value = process.env[name];
  if (!value) {
    console.error(`Set ${name}: the Backfill base URL (…/v1), an API key and a model id.`);
    process.exit(2);
  }
  return value;
}

export const client = new OpenAI({
  baseURL: required("BACKFILL_BASE_URL"),
  apiKey: required("BACKFILL_API_KEY"),
});

export const model = required("BACKFILL_MODEL");

export const TERMINAL = new Set(["completed", "failed", "expired", "cancelled"]);

export const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

// One request line of seed 004's input file, with the model changed.
export function chatLine(customId, system, question) {
  return JSON.stringify({
    custom_id: customId,
    method: "POST",
    url: "/v1/chat/completions",
    body: {
      model,
      messages: [
        { role: "system", content: system },
        { role: "user", content: question },
      ],
      max_tokens: 1000,
    },
  });
}

// Retrieve a batch until it reaches a final status; returns it and the statuses it passed.
export async function waitForTerminal(batchId, pollMs = 100) {
  const seen = [];
  let batch = await client.batches.retrieve(batchId);
  seen.push(batch.status);
  while (!TERMINAL.has(batch.status)) {
    await sleep(pollMs);
    batch = await client.batches.retrieve(batchId);
    if (seen[seen.length - 1] !== batch.status) seen.push(batch.status);
  }
  return { batch, seen };
}

// Each script prints one JSON document on stdout: what the test asserts on.
export function report(value) {
  process.stdout.write(JSON.stringify(value) + "\n");
}
