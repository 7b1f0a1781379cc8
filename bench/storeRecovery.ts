/**
 * Recovery on both stores, in one run: bench/recovery.ts's measurement (worker SIGKILL to the
 * `ready` status, ~1 MB and ~51 MB transcripts) with one daemon on the state dir's files and one
 * with `--store postgres://...`, side by side, the kills alternating between them (the same
 * load for both). Prints each store's medians and PostgreSQL / files. PostgreSQL as in
 * bench/storeAppend.ts.
 */
import { measureRecovery } from "./recovery.js"
import { benchStore } from "./storeAppend.js"

export default async function storeRecovery(): Promise<void> {
  const store = await benchStore("recovery")
  try {
    await measureRecovery([{ name: "PostgreSQL", extraArgs: ["--store", store.url] }, { name: "files" }])
  } finally {
    await store.close()
  }
}
