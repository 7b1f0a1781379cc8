import { assert, describe, it } from "@effect/vitest"
import * as Chunk from "effect/Chunk"
import * as Effect from "effect/Effect"
import * as FastCheck from "effect/FastCheck"
import * as Stream from "effect/Stream"
import * as JsonLines from "../src/JsonLines.js"

const bytes = (s: string) => Buffer.from(s, "utf8")

/** Splits a buffer at the given cut points (sorted, deduplicated, within bounds). */
const cutAt = (buf: Buffer, cuts: ReadonlyArray<number>): Array<Buffer> => {
  const points = [...new Set(cuts.map((c) => c % (buf.length + 1)))].sort((a, b) => a - b)
  const out: Array<Buffer> = []
  let prev = 0
  for (const p of points) {
    out.push(buf.subarray(prev, p))
    prev = p
  }
  out.push(buf.subarray(prev))
  return out
}

describe("JsonLines", () => {
  it("splits on LF, drops CR before LF, keeps a last line without LF, skips blank lines", () => {
    const items = JsonLines.splitAll([bytes("a\nb\r\n\n  \t\r\n{\"x\":1}\nlast")])
    assert.deepStrictEqual(items, ["a", "b", "{\"x\":1}", "last"])
  })

  it("keeps a CR that is not before LF", () => {
    assert.deepStrictEqual(JsonLines.splitAll([bytes("a\rb\n")]), ["a\rb"])
  })

  it("reassembles UTF-8 split across chunks and replaces invalid bytes", () => {
    const text = "héllo wörld 🎉\n"
    const buf = bytes(text)
    const oneByteChunks = [...buf].map((b) => Buffer.from([b]))
    assert.deepStrictEqual(JsonLines.splitAll(oneByteChunks), ["héllo wörld 🎉"])
    assert.deepStrictEqual(JsonLines.splitAll([Buffer.from([0x61, 0xff, 0x62, 0x0a])]), ["a\uFFFDb"])
  })

  it("reports line_too_long once per long line, skips the rest of it, and the next line decodes", () => {
    const long = "x".repeat(100)
    const input = bytes(`ok1\n${long}\nok2\n${long}${long}\n${"y".repeat(10)}\n`)
    for (const chunkSize of [1, 3, 7, 64, 1000]) {
      const chunks: Array<Buffer> = []
      for (let i = 0; i < input.length; i += chunkSize) chunks.push(input.subarray(i, i + chunkSize))
      const items = JsonLines.splitAll(chunks, 50)
      assert.strictEqual(items.length, 5, `chunk size ${chunkSize}`)
      assert.strictEqual(items[0], "ok1")
      assert.instanceOf(items[1], JsonLines.LineTooLong)
      assert.strictEqual(items[2], "ok2")
      assert.instanceOf(items[3], JsonLines.LineTooLong)
      assert.strictEqual(items[4], "y".repeat(10))
    }
  })

  it("a line of exactly maxLineBytes passes; one byte more does not; a long last line without LF is reported", () => {
    assert.deepStrictEqual(JsonLines.splitAll([bytes("abcde\n")], 5), ["abcde"])
    assert.instanceOf(JsonLines.splitAll([bytes("abcdef\n")], 5)[0], JsonLines.LineTooLong)
    const items = JsonLines.splitAll([bytes("abc"), bytes("def")], 5)
    assert.strictEqual(items.length, 1)
    assert.instanceOf(items[0], JsonLines.LineTooLong)
  })

  it.prop(
    "a too-long line keeps its first min(64 KiB, maxLineBytes) bytes, however it is chunked; the next line decodes",
    [
      FastCheck.constantFrom(50, 1000, 64 * 1024, 100_000),
      FastCheck.nat(200_000),
      FastCheck.array(FastCheck.nat(), { maxLength: 12 })
    ],
    ([max, extra, cuts]) => {
      // Varied bytes (multi-byte characters may be cut), so that a wrong offset shows.
      const line = Buffer.from(Array.from({ length: max + 1 + extra }, (_, i) => (i % 251 === 0 ? "é" : String.fromCharCode(0x30 + (i % 43)))).join(""))
      const input = Buffer.concat([bytes("ok1\n"), line, bytes("\nok2\n")])
      const items = JsonLines.splitAll(cutAt(input, cuts), max)
      assert.strictEqual(items.length, 3)
      assert.strictEqual(items[0], "ok1")
      const tooLong = items[1]
      if (!(tooLong instanceof JsonLines.LineTooLong)) return assert.fail("expected LineTooLong")
      assert.deepStrictEqual(Buffer.from(tooLong.head), line.subarray(0, Math.min(JsonLines.TOO_LONG_HEAD_BYTES, max)))
      assert.strictEqual(items[2], "ok2")
    },
    { fastCheck: { numRuns: 40 } }
  )

  it.prop(
    "any chunking of a byte stream yields the same lines",
    [
      FastCheck.array(
        FastCheck.oneof(
          FastCheck.string({ unit: "grapheme", maxLength: 40 }),
          FastCheck.constantFrom("", " ", "\r", "{\"type\":\"ping\"}")
        ),
        { maxLength: 20 }
      ),
      FastCheck.array(FastCheck.nat(), { maxLength: 30 }),
      FastCheck.constantFrom("\n", "\r\n"),
      FastCheck.integer({ min: 8, max: 200 })
    ],
    ([lines, cuts, eol, max]) => {
      const buf = bytes(lines.join(eol))
      const whole = JsonLines.splitAll([buf], max)
      const cut = JsonLines.splitAll(cutAt(buf, cuts), max)
      assert.deepStrictEqual(cut, whole)
      const oneByOne = JsonLines.splitAll([...buf].map((b) => Buffer.from([b])), max)
      assert.deepStrictEqual(oneByOne, whole)
    },
    { fastCheck: { numRuns: 300 } }
  )

  it("stays linear on a 16 MiB line in 1-byte to 64 KiB chunks", () => {
    const size = 16 * 1024 * 1024
    const payload = Buffer.alloc(size, 0x61)
    // Tiny chunks over the first 1 MiB, growing up to 64 KiB after: well over a million pushes.
    const decoder = new JsonLines.LineDecoder(size + 1)
    let offset = 0
    let chunk = 1
    let early = 0
    // A decoder that re-copies its pending bytes on every push would need ~5 * 10^11 byte copies
    // here and never finish within the test timeout; a linear one takes about a second.
    while (offset < size) {
      const n = Math.min(chunk, size - offset)
      early += decoder.push(payload.subarray(offset, offset + n)).length
      offset += n
      if (offset > 1024 * 1024) chunk = Math.min(chunk * 2, 65536)
    }
    const items = decoder.push(bytes("\n"))
    assert.strictEqual(early, 0)
    assert.strictEqual(items.length, 1)
    assert.strictEqual((items[0] as string).length, size)
  })

  it.effect("splitLines as a Stream transform matches splitAll", () =>
    Effect.gen(function*() {
      const input = [bytes("{\"a\":"), bytes("1}\n\n{\"b\""), bytes(":2}\r\ntail")]
      const items = yield* Stream.fromIterable(input).pipe(JsonLines.splitLines(), Stream.runCollect)
      assert.deepStrictEqual(Chunk.toReadonlyArray(items), JsonLines.splitAll(input))
    }))

  it.effect("encodeLines writes one buffer per chunk of values", () =>
    Effect.gen(function*() {
      const out = yield* Stream.fromIterable([{ a: 1 }, { b: "é" }, { c: [1] }]).pipe(
        Stream.rechunk(3),
        JsonLines.encodeLines,
        Stream.runCollect
      )
      assert.strictEqual(Chunk.size(out), 1)
      assert.strictEqual(Buffer.from(Chunk.unsafeGet(out, 0)).toString("utf8"), "{\"a\":1}\n{\"b\":\"é\"}\n{\"c\":[1]}\n")
      assert.deepStrictEqual(JsonLines.splitAll([Chunk.unsafeGet(out, 0)]), ["{\"a\":1}", "{\"b\":\"é\"}", "{\"c\":[1]}"])
    }))
})
