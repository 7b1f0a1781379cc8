import { assert, describe, it } from "@effect/vitest"
import * as FastCheck from "effect/FastCheck"
import type * as Cursor from "../src/Cursor.js"
import { liveTailWriter, wireLineTail } from "../src/internal/delivery/wireLines.js"
import { EncodedEvent } from "../src/EventLog.js"
import { putRecordClose, putRecordOpen, recordBytes, recordLine } from "../src/internal/eventLog/records.js"
import * as Utf8Batch from "../src/internal/utf8Batch.js"

const cursor = FastCheck.record({ generation: FastCheck.integer({ min: 1, max: 2 ** 40 }), sequence: FastCheck.maxSafeNat() })
/** Cursors of one batch: runs in one generation, sometimes crossing into the next. */
const batchCursors = FastCheck.array(FastCheck.tuple(FastCheck.boolean(), FastCheck.nat({ max: 1_000_000 })), { minLength: 1, maxLength: 40 })
  .chain((steps) =>
    cursor.map((first) => {
      const out: Array<Cursor.Cursor> = []
      let c = first
      for (const [rotate, gap] of steps) {
        out.push(c)
        c = rotate ? { generation: c.generation + 1, sequence: 0 } : { generation: c.generation, sequence: c.sequence + 1 + (gap % 3) }
      }
      return out
    })
  )

describe("wire and record bytes written without strings", () => {
  it("liveTailWriter writes wireLineTail's bytes, line after line, across generations", () => {
    const session = FastCheck.oneof(FastCheck.string({ maxLength: 40 }), FastCheck.fullUnicodeString({ maxLength: 10 }))
    FastCheck.assert(FastCheck.property(session, FastCheck.maxSafeNat(), batchCursors, (id, emittedAt, cursors) => {
      const sessionJson = JSON.stringify(id)
      const putTail = liveTailWriter(sessionJson, emittedAt)
      Utf8Batch.begin()
      for (const c of cursors) {
        Utf8Batch.put("{body")
        putTail(c)
      }
      const expected = cursors.map((c) => `{body${wireLineTail(sessionJson, c, emittedAt, false)}`).join("")
      assert.strictEqual(Utf8Batch.take().toString("utf8"), expected)
    }), { numRuns: 200 })
  })

  it("an EncodedEvent with parts of bytes: its text, its prefixes, its record's size as the file layer writes it", () => {
    const piece = FastCheck.oneof(FastCheck.fullUnicodeString({ maxLength: 12 }), FastCheck.constantFrom("é", "\ud83d\ude00", "\n", ""))
    FastCheck.assert(FastCheck.property(cursor, FastCheck.array(FastCheck.tuple(piece, FastCheck.boolean()), { maxLength: 6 }), (c, pieces) => {
      const head = `{"type":"session_event","event":{"type":"agent_start"`
      const parts = [head, ...pieces.map(([text, asBytes]) => (asBytes ? Buffer.from(text, "utf8") : text))]
      const text = head + pieces.map(([t]) => t).join("")
      const event = new EncodedEvent(parts)
      assert.strictEqual(event.json, text)
      assert.isTrue(event.startsWith(`{"type":"session_event","event":{"type":"agent_start"`))
      assert.isFalse(event.startsWith(`{"type":"session_event","event":{"type":"agent_end"`))
      assert.strictEqual(event.charCodeAt(42), text.charCodeAt(42))
      // What the file layer writes for it, byte for byte, is what every store counts.
      Utf8Batch.begin()
      putRecordOpen(c)
      for (const part of event.parts) Utf8Batch.putPart(part)
      putRecordClose()
      const written = Utf8Batch.take()
      assert.strictEqual(written.toString("utf8"), recordLine(c, text))
      assert.strictEqual(recordBytes(c, event), written.length)
      assert.strictEqual(recordBytes(c, text), written.length)
    }), { numRuns: 200 })
  })

  it("putRecordOpen and putRecordClose write recordLine's bytes", () => {
    FastCheck.assert(FastCheck.property(FastCheck.array(FastCheck.tuple(cursor, FastCheck.json()), { maxLength: 20 }), (records) => {
      Utf8Batch.begin()
      for (const [c, json] of records) {
        putRecordOpen(c)
        Utf8Batch.put(json)
        putRecordClose()
      }
      assert.strictEqual(Utf8Batch.take().toString("utf8"), records.map(([c, json]) => recordLine(c, json)).join(""))
    }), { numRuns: 200 })
  })
})
