/**
 * Offsets of the HTTP event stream (docs/protocol.md section 10): a cursor as an opaque string
 * that sorts lexicographically in cursor order, `<generation>_<sequence>` each zero-padded to
 * 16 digits. An offset names the last event a reader has: a read returns the events after it.
 * `-1` (and the all-zero offset `0000000000000000_0000000000000000`, which is what a read of an
 * empty stream gives back) means before the first event; `now` means the session's tail.
 */
import * as Cursor from "../../Cursor.js"

const WIDTH = 16
const PATTERN = /^(\d{16})_(\d{16})$/

/** Before any event (generation 0 precedes every real one). */
export const START = `${"0".repeat(WIDTH)}_${"0".repeat(WIDTH)}`

export const encode = (c: Cursor.Cursor | undefined): string =>
  c === undefined ? START : `${String(c.generation).padStart(WIDTH, "0")}_${String(c.sequence).padStart(WIDTH, "0")}`

/** What an `offset` parameter asks for. */
export type Requested =
  | { readonly _tag: "Start" }
  | { readonly _tag: "Now" }
  | { readonly _tag: "After"; readonly cursor: Cursor.Cursor }

/** Parses an `offset` (or `Last-Event-ID`); undefined when it is not one of ours. */
export const decode = (text: string): Requested | undefined => {
  if (text === "-1" || text === START) return { _tag: "Start" }
  if (text === "now") return { _tag: "Now" }
  const m = PATTERN.exec(text)
  if (m === null) return undefined
  const generation = Number(m[1])
  const sequence = Number(m[2])
  if (!Number.isSafeInteger(generation) || !Number.isSafeInteger(sequence) || generation < 1) return undefined
  return { _tag: "After", cursor: Cursor.make(generation, sequence) }
}
