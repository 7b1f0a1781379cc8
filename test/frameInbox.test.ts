import { assert, describe, it } from "@effect/vitest"
import * as Effect from "effect/Effect"
import * as FastCheck from "effect/FastCheck"
import * as Fiber from "effect/Fiber"
import { FrameInbox, HIGH_WATER_BYTES, TAKE_BYTES } from "../src/WorkerPool.js"
import * as WorkerProtocol from "../src/WorkerProtocol.js"

const tick = () => new Promise((resolve) => setImmediate(resolve))

/**
 * Feeds `bytes` to an inbox in chunks of the given sizes, as a pipe would (no chunk while the
 * inbox has paused it), and takes frames meanwhile at random moments. Fails on a deadlock: a
 * take waiting while the pipe is paused, or the stream never ending.
 */
const feed = async (bytes: Buffer, chunkSizes: ReadonlyArray<number>, takeChances: ReadonlyArray<number>) => {
  let paused = false
  const warnings: Array<string> = []
  const inbox = new FrameInbox((m) => warnings.push(m), { pause: () => (paused = true), resume: () => (paused = false) })
  const takes: Array<Array<WorkerProtocol.ReceivedFrame>> = []
  let offset = 0
  let step = 0
  let taking: Fiber.RuntimeFiber<Array<WorkerProtocol.ReceivedFrame>> | undefined
  for (let rounds = 0; rounds < 1_000_000; rounds++) {
    if (taking === undefined && takeChances[step % takeChances.length]! < 0.5) taking = Effect.runFork(inbox.take)
    await tick()
    const done = taking?.unsafePoll()
    if (done !== undefined && done !== null) {
      taking = undefined
      const frames = await Effect.runPromise(done)
      if (frames.length === 0) return { takes, warnings, paused }
      takes.push(frames)
    } else if (offset < bytes.length) {
      if (paused) {
        // Only a take can resume the pipe: one must be possible.
        taking ??= Effect.runFork(inbox.take)
        await tick()
        if (taking.unsafePoll() === null && paused) throw new Error(`deadlock: paused at ${offset} of ${bytes.length} with a take waiting`)
        continue
      }
      const size = Math.max(1, chunkSizes[step % chunkSizes.length]!)
      inbox.push(bytes.subarray(offset, offset + size))
      offset += size
      if (offset >= bytes.length) inbox.end()
    } else {
      taking ??= Effect.runFork(inbox.take)
    }
    step++
  }
  throw new Error("the stream never ended")
}

const eventLine = (i: number, pad: number) => WorkerProtocol.encodeEventFrame({ type: "message_update", messageId: "m", delta: ` w${i}${"x".repeat(pad)}` } as never)

describe("FrameInbox", () => {
  it("every frame arrives once and in order, takes are bounded, whatever the chunking and timing", async () => {
    await FastCheck.assert(
      FastCheck.asyncProperty(
        FastCheck.array(FastCheck.nat({ max: 3000 }), { minLength: 1, maxLength: 400 }),
        FastCheck.array(FastCheck.integer({ min: 1, max: 70_000 }), { minLength: 1, maxLength: 20 }),
        FastCheck.array(FastCheck.double({ min: 0, max: 1, noNaN: true }), { minLength: 1, maxLength: 10 }),
        async (pads, chunkSizes, takeChances) => {
          const lines = pads.map((pad, i) => i % 50 === 7 ? `{"type":"worker_ready"}\n` : eventLine(i, pad))
          const { takes, warnings } = await feed(Buffer.from(lines.join("")), chunkSizes, takeChances)
          assert.deepStrictEqual(warnings, [])
          const frames = takes.flat()
          assert.strictEqual(frames.length, lines.length)
          frames.forEach((f, i) => assert.deepStrictEqual(f, WorkerProtocol.readWorkerLine(lines[i]!.slice(0, -1)), `frame ${i}`))
          // A take decodes about TAKE_BYTES: at most that plus one chunk and one line.
          for (const t of takes) {
            const bytes = t.reduce((n, f) => n + ("eventBytes" in f ? (f.eventBytes as Buffer).length + 40 : 30), 0)
            assert.isAtMost(bytes, TAKE_BYTES + 70_000 + 3100)
          }
        }
      ),
      { numRuns: 40 }
    )
  }, 60_000)

  it("a line longer than the high water mark arrives whole: the pipe is not paused before its newline", async () => {
    const long = eventLine(0, HIGH_WATER_BYTES + 1_000_000)
    const lines = [eventLine(1, 10), long, eventLine(2, 10)]
    for (const [chunk, takeChances] of [[65_536, [0.9]], [65_536, [0.1]], [1_000, [0.1, 0.9]]] as const) {
      const { takes } = await feed(Buffer.from(lines.join("")), [chunk], takeChances)
      const frames = takes.flat()
      assert.strictEqual(frames.length, 3)
      assert.strictEqual((frames[1] as WorkerProtocol.EventFrame).eventBytes.length, long.length - 33)
    }
  }, 60_000)
})
