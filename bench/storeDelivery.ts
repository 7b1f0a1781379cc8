/**
 * Live delivery on both stores, in one run: bench/delivery.ts's daemon measurement (one long
 * echo turn, from the `prompt` until every attached client has every `message_update`) with the
 * state dir's files, then with `--store postgres://...`, at 1 and 100 clients. Prints both rates
 * and PostgreSQL / files (the storage issue's goal: >= 0.8x). PostgreSQL as in
 * bench/storeAppend.ts.
 */
import { EVENTS, measureOurs, type Result } from "./delivery.js"
import { benchStore } from "./storeAppend.js"

const COUNTS = [1, 100]

const rate = (r: Result) => (EVENTS * r.clients) / r.seconds
const fmt = (n: number) => Math.round(n).toLocaleString("en-US")

export default async function storeDelivery(): Promise<void> {
  const files = await measureOurs([], COUNTS)
  const store = await benchStore("delivery")
  let postgres: ReadonlyArray<Result>
  try {
    postgres = (await measureOurs(["--store", store.url], COUNTS)).ours
  } finally {
    await store.close()
  }
  for (const [i, n] of COUNTS.entries()) {
    const f = files.ours[i]!
    const p = postgres[i]!
    console.log(`live delivery to ${n} client${n === 1 ? "" : "s"} (aggregate), files:      ${fmt(rate(f))} events/s`)
    console.log(`live delivery to ${n} client${n === 1 ? "" : "s"} (aggregate), PostgreSQL: ${fmt(rate(p))} events/s`)
    console.log(`ratio PostgreSQL / files (${n} client${n === 1 ? "" : "s"}): ${(rate(p) / rate(f)).toFixed(2)}x (goal >= 0.8x)`)
  }
  console.log("  (median of 3 runs each, after 3 warm-up turns; files first, then PostgreSQL)")
}
