// Seed 004's examples in TypeScript, checked by `tsc --strict` (tests/e2e/test_node_sdk.py):
// the SDK's own types describe what Backfill returns. Compile-only; the .mjs scripts beside it
// run the same calls against a live server.
import fs from "fs";

import OpenAI from "openai";
import type { Batch, BatchCreateParams } from "openai/resources/batches";
import type { FileDeleted, FileObject } from "openai/resources/files";

const client = new OpenAI({
  baseURL: process.env.BACKFILL_BASE_URL ?? "http://127.0.0.1:8000/v1",
  apiKey: process.env.BACKFILL_API_KEY,
});

const TERMINAL: ReadonlySet<Batch["status"]> = new Set([
  "completed",
  "failed",
  "expired",
  "cancelled",
]);

export async function runBatch(path: string): Promise<Map<string, unknown>> {
  const batchInputFile: FileObject = await client.files.create({
    file: fs.createReadStream(path),
    purpose: "batch",
  });

  const batch: Batch = await client.batches.create({
    input_file_id: batchInputFile.id,
    endpoint: "/v1/chat/completions",
    completion_window: "24h",
    metadata: {
      description: "nightly eval job",
    },
    // Optional. Must be HTTPS.
    webhook_url: "https://example.com/my_webhook",
  } as BatchCreateParams);

  let retrievedBatch: Batch = await client.batches.retrieve(batch.id);
  while (!TERMINAL.has(retrievedBatch.status)) {
    await new Promise((resolve) => setTimeout(resolve, 1000));
    retrievedBatch = await client.batches.retrieve(batch.id);
  }

  const results = new Map<string, unknown>();
  if (retrievedBatch.output_file_id !== null && retrievedBatch.output_file_id !== undefined) {
    const fileResponse: Response = await client.files.content(retrievedBatch.output_file_id);
    const fileContents: string = await fileResponse.text();
    for (const line of fileContents.split("\n").filter((l) => l !== "")) {
      const row = JSON.parse(line) as { custom_id: string; response: unknown };
      results.set(row.custom_id, row.response);
    }
  }
  return results;
}

export async function listBatches(after?: string): Promise<Batch[]> {
  const seen: Batch[] = [];
  for await (const b of client.batches.list({ limit: 10, ...(after ? { after } : {}) })) {
    seen.push(b);
  }
  return seen;
}

export async function cancel(batchId: string): Promise<Batch["status"]> {
  const cancelled: Batch = await client.batches.cancel(batchId);
  return cancelled.status;
}

export async function manageFiles(fileId: string): Promise<boolean> {
  const names: string[] = [];
  for await (const file of client.files.list({ limit: 20, purpose: "batch" })) {
    names.push(file.filename);
  }
  const file: FileObject = await client.files.retrieve(fileId);
  const deleted: FileDeleted = await client.files.delete(file.id);
  try {
    await client.files.retrieve(fileId);
  } catch (err) {
    if (err instanceof OpenAI.NotFoundError) {
      return deleted.deleted;
    }
    throw err;
  }
  return false;
}
