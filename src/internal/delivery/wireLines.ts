/**
 * Sequenced messages as they are logged and as they go on the wire (docs/protocol.md section 4).
 * An agent event is serialized once, by the worker: its JSON text is the start of both its log
 * record and its wire line, and it is never parsed on the live path.
 */
import type * as Cursor from "../../Cursor.js"
import { EncodedEvent, type EventRecord } from "../../EventLog.js"
import type { SessionSummary } from "../../Protocol.js"
import * as Utf8Batch from "../utf8Batch.js"

/** What a sequenced message looks like in the EventLog: its wire form without session and meta. */
export type LoggedBody =
  | { readonly type: "session_event"; readonly event: { readonly type: string } }
  | { readonly type: "session_status"; readonly state: SessionSummary; readonly promptId?: string }
  | { readonly type: "session_closed"; readonly reason: string }

/**
 * A sequenced message before it has a cursor: the JSON text of its {@link LoggedBody} without
 * the closing brace, `head` then `body`. It is built once and is the start of both its log
 * record and its wire line, so an agent event is serialized once, by the worker, and never
 * parsed on the live path. The two parts are written one after the other, never joined: the
 * body of an agent event is a slice of its worker's frame, and a joined string would be a new
 * copy of the whole event at each write (see EncodedEvent).
 */
export interface Outgoing {
  readonly head: string
  /** A worker's event as the UTF-8 bytes it came in, or a message the supervisor made, as text. */
  readonly body: string | Uint8Array
  /** For a `session_event`, the agent event's type. */
  readonly eventType?: string
}

const EVENT_HEAD = `{"type":"session_event","event":`

/** A worker's event, from its JSON as the bytes it came in. */
export const eventMessage = (eventType: string, eventBytes: Uint8Array): Outgoing => ({ head: EVENT_HEAD, body: eventBytes, eventType })

/** A message the supervisor makes itself (status, closed, an interruption it reports). */
export const bodyMessage = (body: LoggedBody): Outgoing => {
  const json = JSON.stringify(body)
  return body.type === "session_event"
    ? { head: "", body: json.slice(0, -1), eventType: body.event.type }
    : { head: "", body: json.slice(0, -1) }
}

/** The log record of a message: its body and when it was emitted (`emittedAt` last). */
export const logged = (m: Outgoing, emittedAt: number) => loggedWith(m, loggedTail(emittedAt))

/** What follows a logged message's body: `emittedAt` and the record's end (one string for a batch). */
export const loggedTail = (emittedAt: number) => `,"emittedAt":${emittedAt}}`

/** {@link logged}, with the tail of its batch. */
export const loggedWith = (m: Outgoing, tail: string) => new EncodedEvent([m.head, m.body, tail])

const EMITTED_AT = `,"emittedAt":`

/** The wire line of a message: its body, then `activeSessionId` and `meta`. */
export const wireLine = (sessionJson: string, open: string, cursor: Cursor.Cursor, emittedAt: number, replayed: boolean) =>
  `${open}${wireLineTail(sessionJson, cursor, emittedAt, replayed)}`

/** What follows a message's body in its wire line: `activeSessionId`, `meta`, the line's end. */
export const wireLineTail = (sessionJson: string, cursor: Cursor.Cursor, emittedAt: number, replayed: boolean) =>
  `,"activeSessionId":${sessionJson},"meta":{"cursor":{"generation":${cursor.generation},"sequence":${cursor.sequence}},"emittedAt":${emittedAt}${
    replayed ? ",\"replayed\":true" : ""
  }}}\n`

/**
 * Writes {@link wireLineTail} of live messages (not replayed) of one batch into the open
 * Utf8Batch, without making its string: the session and `emittedAt` are the batch's, so only
 * the sequence changes from one line to the next (a string per line, flattened again to be
 * encoded, was the largest thing the daemon allocated per event).
 */
export const liveTailWriter = (sessionJson: string, emittedAt: number): (cursor: Cursor.Cursor) => void => {
  let generation = -1
  let open = Buffer.alloc(0)
  const close = Buffer.from(`},"emittedAt":${emittedAt}}}\n`)
  return (cursor) => {
    if (cursor.generation !== generation) {
      generation = cursor.generation
      open = Buffer.from(`,"activeSessionId":${sessionJson},"meta":{"cursor":{"generation":${generation},"sequence":`)
    }
    Utf8Batch.putBytes(open)
    Utf8Batch.putUint(cursor.sequence)
    Utf8Batch.putBytes(close)
  }
}

/** The wire line of a logged record (replay, catch-up), from its text: `emittedAt` moves into meta. */
export const wireLineOfRecord = (sessionJson: string, r: EventRecord, replayed: boolean) => {
  const emittedAt = r.event["emittedAt"]
  const at = r.json.lastIndexOf(EMITTED_AT)
  if (typeof emittedAt === "number" && at > 0 && r.json.slice(at + EMITTED_AT.length, -1) === String(emittedAt)) {
    return wireLine(sessionJson, r.json.slice(0, at), r.cursor, emittedAt, replayed)
  }
  // Not in the shape `logged` writes: rebuild it from the parsed record.
  const { emittedAt: _, ...body } = r.event
  return wireLine(sessionJson, JSON.stringify(body).slice(0, -1), r.cursor, typeof emittedAt === "number" ? emittedAt : 0, replayed)
}
