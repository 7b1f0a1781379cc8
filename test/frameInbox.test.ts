import { assert, describe, it } from "@effect/vitest"
import * as Effect from "effect/Effect"
import * as FastCheck from "effect/FastCheck"
import * as Fiber from "effect/Fiber"
import { FrameInbox, HIGH_WATER_BYTES, TAKE_BYTES } from "../src/internal/frameInbox.js"
import * as WorkerProtocol from "../src/WorkerProtocol.js"

const tick = () => new Promise((resolve) => setImmediate(resolve))

/**
 * Feeds `bytes` to an inbox in chunks of the given sizes, as a pipe would (no chunk while the
 * inbox has paused it), and takes frames meanwhile at random moments. Fails on a deadlock: a
 * take waiting while the pipe is paused, or the stream never ending.
 */
const feed = async (bytes: Buffer, chunkSizes: ReadonlyArray<number>, takeChances: ReadonlyArray<number>) => {
  let paused = false
  let pauses = 0
  const warnings: Array<string> = []
  const inbox = new FrameInbox((m) => warnings.push(m), { pause: () => ((paused = true), pauses++), resume: () => (paused = false) })
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
      if (frames.length === 0) return { takes, warnings, pauses }
      takes.push(frames)
    } else if (offset < bytes.length) {
      if (paused) {
        // Only a take can resume the pipe: one must be possible.
        taking ??= Effect.runFork(inbox.take)
        await tick()
        if (taking.unsafePoll() === null && paused) throw new Error(`deadlock: paused at ${offset} of ${bytes.length} with a take waiting`)
        continue
      }
      // A size of 0 pushes an empty chunk (it must change nothing).
      const size = chunkSizes[step % chunkSizes.length]!
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
        // Mostly small lines, some of 100-300 KB: a run can pass the high water mark (4 MB).
        FastCheck.array(FastCheck.oneof({ weight: 9, arbitrary: FastCheck.nat({ max: 3000 }) }, { weight: 1, arbitrary: FastCheck.integer({ min: 100_000, max: 300_000 }) }), { minLength: 1, maxLength: 400 }),
        FastCheck.array(FastCheck.integer({ min: 0, max: 70_000 }), { minLength: 1, maxLength: 20 }).map((sizes) => (sizes.some((n) => n > 0) ? sizes : [...sizes, 1])),
        FastCheck.array(FastCheck.double({ min: 0, max: 1, noNaN: true }), { minLength: 1, maxLength: 10 }),
        async (pads, chunkSizes, takeChances) => {
          // Other frames, `\r\n` line ends and blank lines between the events, as a pipe may carry them.
          const lines = pads.map((pad, i) =>
            i % 50 === 7 ? `{"type":"worker_ready"}\n` : i % 37 === 5 ? eventLine(i, pad).replace(/\n$/, "\r\n") : eventLine(i, pad)
          )
          const text = lines.map((line, i) => (i % 29 === 3 ? `   \n${line}\n` : line)).join("")
          const { takes, warnings } = await feed(Buffer.from(text), chunkSizes, takeChances)
          assert.deepStrictEqual(warnings, [])
          const frames = takes.flat()
          assert.strictEqual(frames.length, lines.length)
          frames.forEach((f, i) => assert.deepStrictEqual(f, WorkerProtocol.readWorkerLine(lines[i]!.trimEnd()), `frame ${i}`))
          // A take decodes about TAKE_BYTES: at most that plus one chunk and one line.
          for (const t of takes) {
            const bytes = t.reduce((n, f) => n + ("eventBytes" in f ? (f.eventBytes as Buffer).length + 40 : 30), 0)
            assert.isAtMost(bytes, TAKE_BYTES + 70_000 + 300_100)
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
      const { pauses, takes } = await feed(Buffer.from(lines.join("")), [chunk], takeChances)
      // The pipe was paused (it holds more than the high water mark), and resumed.
      if (takeChances[0] === 0.9) assert.isAbove(pauses, 0)
      const frames = takes.flat()
      assert.strictEqual(frames.length, 3)
      assert.strictEqual((frames[1] as WorkerProtocol.EventFrame).eventBytes.length, long.length - 33)
    }
  }, 60_000)
})
