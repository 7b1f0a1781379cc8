/**
 * The supervisor's side of a restore (src/internal/session/restore.ts): transcript bytes cut at
 * whole lines and counted as a worker's line decoder will yield them, without being decoded.
 * And the warm spare's warm-up, which must go on running the worker's real restore path.
 */
import { assert, describe, it } from "@effect/vitest"
import * as Effect from "effect/Effect"
import { LineCutter } from "../src/internal/session/restore.js"
import { LineDecoder } from "../src/JsonLines.js"
import * as EchoEngine from "../src/engines/EchoEngine.js"
import { registry } from "../src/Engine.js"
import { warmUpRestorePath, warmUpTurnPath } from "../src/Worker.js"

/** Feeds `pieces` through a cutter; returns the bytes it let through, and its counts per cut. */
const cutAll = (pieces: ReadonlyArray<string>) => {
  const cutter = new LineCutter()
  const out: Array<Buffer> = []
  const counts: Array<number> = []
  for (const piece of pieces) {
    const cut = cutter.push(Buffer.from(piece, "utf8"))
    if (typeof cut === "string") return { error: cut, out, counts, total: cutter.count }
    if (cut !== undefined && cut.lines > 0) {
      // A cut always ends with a whole line.
      assert.strictEqual(cut.bytes.at(-1)!.at(-1), 0x0a)
      counts.push(cut.lines)
      out.push(...cut.bytes.map((b) => Buffer.from(b)))
    }
  }
  const last = cutter.end()
  if (last !== undefined) {
    counts.push(last.lines)
    out.push(...last.bytes.map((b) => Buffer.from(b)))
  }
  return { error: undefined, out, counts, total: cutter.count }
}

/** What a worker's decoder makes of bytes. */
const decoded = (bytes: ReadonlyArray<Buffer>) => new LineDecoder(Number.MAX_SAFE_INTEGER).push(Buffer.concat(bytes))

describe("LineCutter", () => {
  it("cuts at whole lines, however the pieces split them, and counts what a line decoder yields", () => {
    const lines = ['{"id":"a"}', '{"id":"b","content":"' + "x".repeat(5000) + '"}', '{"id":"c"}']
    const text = lines.join("\n") + "\n"
    for (const size of [1, 2, 7, 100, 4096, text.length]) {
      const pieces: Array<string> = []
      for (let i = 0; i < text.length; i += size) pieces.push(text.slice(i, i + size))
      const { counts, error, out, total } = cutAll(pieces)
      assert.isUndefined(error)
      assert.strictEqual(total, 3)
      assert.strictEqual(counts.reduce((a, b) => a + b, 0), 3)
      // What was let through decodes to the lines, in order.
      assert.deepStrictEqual(decoded(out), lines)
    }
  })

  it("blank lines are not counted (a decoder drops them); a last line without a newline is counted and ended", () => {
    const { counts, out, total } = cutAll(["\n  \r\n{\"id\":\"a\"}\r\n\n", "\t\n{\"id\":", "\"b\"}"])
    assert.strictEqual(total, 2)
    assert.deepStrictEqual(counts, [1, 1])
    assert.deepStrictEqual(decoded(out), ['{"id":"a"}', '{"id":"b"}'])
  })

  it("a line that cannot be a JSON value is refused before any of it is let through", () => {
    const { error, out } = cutAll(['{"id":"a"}\n', "\u00a0{}\n"])
    assert.include(error, "0xc2")
    assert.deepStrictEqual(decoded(out), ['{"id":"a"}'])
  })
})

describe("warm-up", () => {
  it.effect("the spare's warm-up restores its scratch session through the restore path (64 messages, a streamed one folded in)", () =>
    Effect.gen(function*() {
      assert.strictEqual(yield* warmUpRestorePath(3), 65)
    }))

  it.effect("the spare's turn warm-up runs echo turns through the engine and the frame encoding (2000 words each)", () =>
    Effect.gen(function*() {
      const bytes = yield* warmUpTurnPath(registry(EchoEngine.engines), 2)
      // Two turns of 2001 message_update frames at least: the path really ran.
      assert.isAbove(bytes, 2 * 2001 * 60)
      // A registry without `echo` fails (the spare then logs and skips it).
      assert.isTrue((yield* Effect.either(warmUpTurnPath(registry({}), 1)))._tag === "Left")
    }))
})
