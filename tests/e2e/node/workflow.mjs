// Seed 004, "Run a batch job": upload the input file with fs.createReadStream, create the
// batch with metadata (and a webhook_url when BACKFILL_WEBHOOK_URL is set), retrieve it until
// it ends, and download the output with files.content(...).text().
import fs from "fs";

import { chatLine, client, report, waitForTerminal } from "./client.mjs";

fs.writeFileSync(
  "batchinput.jsonl",
  [
    chatLine("request-1", "You are a helpful assistant.", "What is the capital of France?"),
    chatLine("request-2", "You are an unhelpful assistant.", "What is the capital of Belgium?"),
  ].join("\n") + "\n",
);

const batchInputFile = await client.files.create({
  file: fs.createReadStream("batchinput.jsonl"),
  purpose: "batch",
});

const webhookUrl = process.env.BACKFILL_WEBHOOK_URL;
const batch = await client.batches.create({
  input_file_id: batchInputFile.id,
  endpoint: "/v1/chat/completions",
  completion_window: "24h",
  metadata: {
    description: "nightly eval job",
  },
  // Not in the SDK's types: the SDK sends body fields it does not know as they are.
  ...(webhookUrl ? { webhook_url: webhookUrl } : {}),
});

const { batch: retrievedBatch, seen } = await waitForTerminal(batch.id);

let fileContents = null;
if (retrievedBatch.output_file_id) {
  const fileResponse = await client.files.content(retrievedBatch.output_file_id);
  fileContents = await fileResponse.text();
}

report({
  uploaded: batchInputFile,
  created: batch,
  statuses: seen,
  retrieved: retrievedBatch,
  output: fileContents,
});
