import { assert, describe, it } from "@effect/vitest"
import * as FastCheck from "effect/FastCheck"
import * as Utf8Batch from "../src/internal/utf8Batch.js"
import type { AgentEvent } from "../src/Protocol.js"
import * as WorkerProtocol from "../src/WorkerProtocol.js"

/** What the batch must equal: the pieces joined, then encoded as Buffer.from does. */
const expected = (pieces: ReadonlyArray<string | Uint8Array>) =>
  Buffer.concat(pieces.map((p) => (typeof p === "string" ? Buffer.from(p, "utf8") : Buffer.from(p))))

const build = (pieces: ReadonlyArray<string | Uint8Array>) => {
  Utf8Batch.begin()
  for (const p of pieces) typeof p === "string" ? Utf8Batch.put(p) : Utf8Batch.putBytes(p)
  return Utf8Batch.take()
}

describe("utf8Batch", () => {
  it("gives the bytes of Buffer.from of the joined pieces, whatever the text (multi-byte, surrogate pairs, lone surrogates)", () => {
    const piece = FastCheck.oneof(
      FastCheck.fullUnicodeString({ maxLength: 64 }),
      // Lone surrogates and pairs: encoded (as replacement characters) exactly as Buffer.from does.
      FastCheck.constantFrom("\ud800", "\udfff", "\ud83d\ude00", "é", "\u0000", "\n"),
      FastCheck.uint8Array({ maxLength: 32 })
    )
    FastCheck.assert(FastCheck.property(FastCheck.array(piece, { maxLength: 40 }), (pieces) => {
      assert.deepStrictEqual(build(pieces), expected(pieces))
    }), { numRuns: 100 })
  })

  it("putUint writes what String(n) does, for every non-negative safe integer, between other pieces", () => {
    const edges = [0, 9, 10, 99, 100, 2 ** 31 - 1, 2 ** 31, 2 ** 32, 1_733_224_800_000, Number.MAX_SAFE_INTEGER]
    const n = FastCheck.oneof(FastCheck.constantFrom(...edges), FastCheck.nat(), FastCheck.maxSafeNat())
    FastCheck.assert(FastCheck.property(FastCheck.array(FastCheck.tuple(FastCheck.string({ maxLength: 8 }), n), { maxLength: 30 }), (items) => {
      Utf8Batch.begin()
      for (const [text, value] of items) {
        Utf8Batch.put(text)
        Utf8Batch.putUint(value)
      }
      assert.strictEqual(Utf8Batch.take().toString("utf8"), items.map(([text, value]) => `${text}${value}`).join(""))
    }), { numRuns: 200 })
  })

  it("grows past its scratch buffer (one large piece, many pieces) and starts small again after", () => {
    const large = "é".repeat(1536 * 1024) // 3 MiB of UTF-8 (room for 4.5 MiB asked): past the scratch buffer kept
    const many = Array.from({ length: 20_000 }, (_, i) => `{"type":"message_update","delta":" w${i}"}\n`)
    for (const pieces of [[large], many, ["a", large, "b"], ["after"]]) {
      assert.isTrue(build(pieces).equals(expected(pieces)))
    }
  })

  it("a batch a builder abandoned halfway is dropped by the next begin", () => {
    Utf8Batch.begin()
    Utf8Batch.put("left over")
    assert.strictEqual(build(["fresh"]).toString(), "fresh")
  })

  it("a batch's buffer is its own: the next batch does not change it", () => {
    const first = build(["first batch"])
    build(["second batch, longer than the first"])
    assert.strictEqual(first.toString(), "first batch")
  })

  it("view gives the same bytes as take, without a copy, and a large batch's view outlives the scratch it came from", () => {
    const many = Array.from({ length: 20_000 }, (_, i) => `{"type":"message_update","delta":" w${i}"}\n`)
    for (const pieces of [["small"], many, ["é".repeat(2_200_000)]]) {
      Utf8Batch.begin()
      for (const p of pieces) Utf8Batch.put(p)
      const view = Utf8Batch.view()
      assert.isTrue(view.equals(expected(pieces)))
      // The next batch reuses the scratch buffer (a small one's view is overwritten: used at once
      // or not at all), but a view of a grown scratch is left alone.
      const copy = Buffer.from(view)
      build(["next batch"])
      if (view.length > 4 * 1024 * 1024) assert.isTrue(view.equals(copy))
    }
  })

  it("encodeEventFrame writes an event's frame type first, read back as the same event", () => {
    const events = [
      { type: "message_update", messageId: "m1", delta: " wé\ud83d\ude00" },
      // Built without `type` first: it is moved first.
      { messageId: "m2", delta: "x", type: "message_update" },
      { type: "agent_end" }
    ] as unknown as ReadonlyArray<AgentEvent>
    const text = Buffer.from(events.map(WorkerProtocol.encodeEventFrame).join(""), "utf8").toString("utf8")
    for (const line of text.trimEnd().split("\n")) assert.isTrue(line.startsWith('{"type":"worker_event","event":{"type":"'), line)
    for (const line of text.trimEnd().split("\n")) {
      const frame = WorkerProtocol.readWorkerLine(line) as WorkerProtocol.EventFrame
      assert.strictEqual(frame.type, "worker_event")
      assert.deepStrictEqual(JSON.parse(WorkerProtocol.eventTextOf(frame)), JSON.parse(line).event)
    }
  })
})
