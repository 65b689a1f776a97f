// Seed 004, "List batches": `for await` over batches.list, which fetches the next page (after
// the last id of this one) while has_more is true. Usage: node list_batches.mjs PAGE_SIZE
// [AFTER_BATCH_ID]
import { client, report } from "./client.mjs";

const limit = Number(process.argv[2] ?? "2");
const after = process.argv[3];

const all = [];
for await (const b of client.batches.list({ limit })) {
  all.push(b.id);
}

// The same listing a page at a time, to count the pages it took.
const pageSizes = [];
let page = await client.batches.list({ limit });
pageSizes.push(page.data.length);
while (page.hasNextPage()) {
  page = await page.getNextPage();
  pageSizes.push(page.data.length);
}

// The seed's own example: the batches created before `after`.
let afterIds = null;
if (after) {
  afterIds = [];
  const list = await client.batches.list({
    limit: 10,
    after,
  });
  for await (const b of list) {
    afterIds.push(b.id);
  }
}

report({ all, pageSizes, after: afterIds });
