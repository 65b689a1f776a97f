// Seed 004, "Cancel a batch": create a batch of LINES requests and cancel it at once; then
// retrieve it until it ends. Usage: node cancel.mjs LINES
import fs from "fs";

import { chatLine, client, report, waitForTerminal } from "./client.mjs";

const lines = Number(process.argv[2] ?? "100");
const rows = [];
for (let i = 0; i < lines; i++) {
  rows.push(chatLine(`slow-${i}`, "You are a helpful assistant.", `Count to ${i}.`));
}
fs.writeFileSync("slowinput.jsonl", rows.join("\n") + "\n");

const inputFile = await client.files.create({
  file: fs.createReadStream("slowinput.jsonl"),
  purpose: "batch",
});
const batch = await client.batches.create({
  input_file_id: inputFile.id,
  endpoint: "/v1/chat/completions",
  completion_window: "24h",
});

const cancelled = await client.batches.cancel(batch.id);
const { batch: ended, seen } = await waitForTerminal(batch.id);
// Cancelling a batch that has ended returns it unchanged.
const again = await client.batches.cancel(batch.id);

report({ created: batch, cancelled, statuses: seen, ended, again });
