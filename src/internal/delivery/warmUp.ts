/**
 * The daemon's event path, run on made-up events at start: the first turn after a start was
 * about twice as slow as the next ones, most of it the daemon compiling (and optimizing) the
 * code each event goes through. What runs here is that code's pure part, on the same shapes of
 * data: a worker's bytes split into lines, each line read as an event frame, the log record and
 * the wire line of each event encoded into one buffer per batch. Nothing is logged or sent.
 */
import * as Effect from "effect/Effect"
import type * as Cursor from "../../Cursor.js"
import { LineDecoder } from "../../JsonLines.js"
import type { AgentEvent } from "../../Protocol.js"
import * as WorkerProtocol from "../../WorkerProtocol.js"
import { recordOpen } from "../eventLog/records.js"
import * as Utf8Batch from "../utf8Batch.js"
import { eventMessage, logged, wireLineTail } from "./wireLines.js"

/** Events of one made-up worker chunk (about 64 KB, as a worker's pipe delivers them). */
const EVENTS_PER_CHUNK = 600

/**
 * Set once a session's worker has sent frames: the warm-up then stops at its next chunk. It is
 * there to spare a first turn the compiling, so it must never run inside one: a client that
 * prompts within a second of the start (a busy machine stretches the warm-up's 0.15 s of CPU
 * over more) would otherwise pay for both.
 */
let eventPathInUse = false

/** Says that real frames take the event path now (the warm-up gives way). */
export const realFramesArrived = (): void => {
  eventPathInUse = true
}

const CLOSE_RECORD = Buffer.from("}\n")

/**
 * Runs `rounds` chunks of made-up `message_update` events through the path; returns how many
 * bytes of wire lines it encoded (checked by its test: a warm-up that silently stopped running
 * the path warms nothing). Yields between chunks: it never holds the daemon up; stops once a
 * session's worker sends frames ({@link realFramesArrived}).
 */
export const warmUpEventPath = (rounds: number): Effect.Effect<number> =>
  Effect.gen(function*() {
    const sessionJson = JSON.stringify("s-00000000-0000-0000-0000-000000000000")
    Utf8Batch.begin()
    for (let i = 0; i < EVENTS_PER_CHUNK; i++) {
      const event = { type: "message_update", messageId: "warm-up-a", delta: ` w${i}` } as unknown as AgentEvent
      WorkerProtocol.putEventFrame(event)
    }
    const chunk = Utf8Batch.take()
    let wireBytes = 0
    let sequence = 0
    for (let round = 0; round < rounds && !eventPathInUse; round++) {
      const emittedAt = Date.now()
      const messages = []
      for (const line of new LineDecoder(Number.MAX_SAFE_INTEGER).push(chunk)) {
        if (typeof line !== "string") continue
        const frame = WorkerProtocol.readWorkerLine(line) as WorkerProtocol.EventFrame
        messages.push(eventMessage(frame.eventType, frame.eventJson))
      }
      const cursors: Array<Cursor.Cursor> = messages.map(() => ({ generation: 1, sequence: sequence++ }))
      Utf8Batch.begin()
      messages.forEach((m, i) => {
        Utf8Batch.put(recordOpen(cursors[i]!))
        Utf8Batch.put(logged(m, emittedAt).json)
        Utf8Batch.putBytes(CLOSE_RECORD)
      })
      Utf8Batch.take()
      Utf8Batch.begin()
      messages.forEach((m, i) => {
        Utf8Batch.put(m.head)
        Utf8Batch.put(m.body)
        Utf8Batch.put(wireLineTail(sessionJson, cursors[i]!, emittedAt, false))
      })
      wireBytes += Utf8Batch.take().length
      yield* Effect.yieldNow()
    }
    return wireBytes
  })
