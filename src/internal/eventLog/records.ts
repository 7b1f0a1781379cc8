/**
 * What every event log store shares about one event: the error constructor, the event's JSON
 * text (or why it cannot be logged), and the record line the file layer writes, which the
 * memory layer keeps and whose length every store counts (`generationBytes`), so automatic
 * checkpoints come at the same points on every store.
 */
import * as Effect from "effect/Effect"
import * as Option from "effect/Option"
import { isRecord } from "effect/Predicate"
import * as Cursor from "../../Cursor.js"
import {
  EncodedEvent,
  EventLog,
  type EventData,
  EventLogError,
  type EventLogErrorReason,
  type EventLogService,
  type EventLogStatus,
  type EventRecord,
  withAppendAllNow
} from "../../EventLog.js"
import * as Utf8Batch from "../utf8Batch.js"

export const fail = (reason: EventLogErrorReason, sessionId: string, message: string, cause?: unknown) =>
  new EventLogError(cause === undefined ? { reason, sessionId, message } : { reason, sessionId, message, cause })

/** An event's JSON text: one string, or an {@link EncodedEvent}'s parts (never joined to be written). */
export type EventText = string | EncodedEvent

/** The text as one string (for the stores that keep strings). */
export const textOf = (text: EventText): string => (typeof text === "string" ? text : text.json)

/** The event as JSON text, or why it cannot be logged (an EncodedEvent is trusted as it is). */
export const serialize = (sessionId: string, event: EventData | EncodedEvent): EventText | EventLogError => {
  if (event instanceof EncodedEvent) return event
  if (typeof event !== "object" || event === null || Array.isArray(event)) {
    return fail("InvalidEvent", sessionId, "an event must be a JSON object")
  }
  try {
    return JSON.stringify(event)
  } catch (cause) {
    return fail("InvalidEvent", sessionId, `event is not serializable as JSON: ${String(cause)}`, cause)
  }
}

/** Like {@link serialize}, and an {@link EncodedEvent} is checked too (the memory layer's). */
export const serializeCheckedNow = (sessionId: string, event: EventData | EncodedEvent): string | EventLogError => {
  if (event instanceof EncodedEvent) {
    let value: unknown
    try {
      value = JSON.parse(event.json)
    } catch (cause) {
      return fail("InvalidEvent", sessionId, `an encoded event is not JSON: ${String(cause)}`, cause)
    }
    if (!isRecord(value)) return fail("InvalidEvent", sessionId, "an event must be a JSON object")
  }
  const json = serialize(sessionId, event)
  return json instanceof EventLogError ? json : textOf(json)
}

/** {@link serializeCheckedNow} as an Effect. */
export const serializeChecked = (sessionId: string, event: EventData | EncodedEvent): Effect.Effect<string, EventLogError> =>
  Effect.suspend(() => {
    const json = serializeCheckedNow(sessionId, event)
    return json instanceof EventLogError ? Effect.fail(json) : Effect.succeed(json)
  })

/** A record line up to its event, built by hand: cursors are plain integers. */
export const recordOpen = (cursor: Cursor.Cursor): string =>
  `{"cursor":{"generation":${cursor.generation},"sequence":${cursor.sequence}},"event":`

const RECORD_OPEN_GENERATION = Buffer.from(`{"cursor":{"generation":`)
const RECORD_OPEN_SEQUENCE = Buffer.from(`,"sequence":`)
const RECORD_OPEN_EVENT = Buffer.from(`},"event":`)
const RECORD_CLOSE = Buffer.from("}\n")

/**
 * Writes {@link recordOpen}'s bytes into the open Utf8Batch without making its string (one per
 * record on the group commit's path).
 */
export const putRecordOpen = (cursor: Cursor.Cursor): void => {
  Utf8Batch.putBytes(RECORD_OPEN_GENERATION)
  Utf8Batch.putUint(cursor.generation)
  Utf8Batch.putBytes(RECORD_OPEN_SEQUENCE)
  Utf8Batch.putUint(cursor.sequence)
  Utf8Batch.putBytes(RECORD_OPEN_EVENT)
}

/** Writes a record line's end (after its event) into the open Utf8Batch. */
export const putRecordClose = (): void => Utf8Batch.putBytes(RECORD_CLOSE)

/** One record line: the event is already JSON text. */
export const recordLine = (cursor: Cursor.Cursor, eventJson: string): string => `${recordOpen(cursor)}${eventJson}}\n`

/** The bytes {@link recordLine} takes, without building it (the prefix is ASCII). */
export const recordBytes = (cursor: Cursor.Cursor, eventJson: EventText): number => {
  let bytes = recordOpen(cursor).length + 2
  if (typeof eventJson === "string") return bytes + Buffer.byteLength(eventJson, "utf8")
  for (const part of eventJson.parts) bytes += typeof part === "string" ? Buffer.byteLength(part, "utf8") : part.length
  return bytes
}

export const isCursor = (u: unknown): u is Cursor.Cursor =>
  isRecord(u) && Number.isSafeInteger(u["generation"]) && (u["generation"] as number) >= 1 &&
  Number.isSafeInteger(u["sequence"]) && (u["sequence"] as number) >= 0

/** Parses a record line; `undefined` when it is not a well-formed record of `generation`. */
export const parseRecord = (text: string, generation: number): EventRecord | undefined => {
  let value: unknown
  try {
    value = JSON.parse(text)
  } catch {
    return undefined
  }
  if (!isRecord(value) || !isCursor(value["cursor"]) || !isRecord(value["event"])) return undefined
  if (value["cursor"].generation !== generation) return undefined
  const cursor = Cursor.make(value["cursor"].generation, value["cursor"].sequence)
  // Lines this module wrote hold the event's text after a fixed prefix: take it as it is.
  const open = recordOpen(cursor)
  const json = text.startsWith(open) && text.endsWith("}") ? text.slice(open.length, -1) : JSON.stringify(value["event"])
  return { cursor, event: value["event"], json }
}

/**
 * The check every store makes before it reads from the start of a log, or after a cursor, that
 * what it would return is whole: fails when the generations the read needs were pruned.
 * `starts` maps each retained generation to the last cursor before it.
 */
export const checkReadable = (
  sessionId: string,
  starts: ReadonlyMap<number, Option.Option<Cursor.Cursor>>,
  retained: ReadonlyArray<number>,
  after: Cursor.Cursor | undefined
): EventLogError | undefined => {
  if (retained.length === 0) return undefined
  if (after !== undefined && !retained.includes(after.generation)) {
    const next = retained.find((g) => g > after.generation)
    const start = next === undefined ? Option.none() : (starts.get(next) ?? Option.none())
    if (next !== undefined && !(Option.isSome(start) && !Cursor.isBefore(after, start.value))) {
      return fail("GenerationNotFound", sessionId, `the events after ${after.generation}:${after.sequence} were pruned`)
    }
  }
  if (after === undefined && !retained.includes(1)) {
    // Read from the very start, but the first generations were pruned: fail, never skip.
    const first = retained[0]!
    if (Option.isSome(starts.get(first) ?? Option.none())) {
      return fail("GenerationNotFound", sessionId, `events before generation ${first} were pruned`)
    }
  }
  return undefined
}

/** What a store builds itself; {@link makeService} adds the reads every store answers alike. */
export type StoreOperations = Omit<
  EventLogService,
  "currentGeneration" | "lastCursor" | "generations" | "status" | "generationStart" | "repair" | "forget"
> & Partial<Pick<EventLogService, "repair" | "forget">>

/**
 * A store's service from its own operations and two views of an open session: its status, and
 * where a retained generation began (`startOf`, asked only for a generation in
 * `status.generations`; before anything was written that is the current one, and its answer
 * must be `None`). A store that omits `repair` keeps every record whole and repairs nothing; one
 * that omits `forget` keeps nothing in memory but the log itself (the memory log).
 */
export const makeService = <H>(
  open: (sessionId: string) => Effect.Effect<H, EventLogError>,
  statusOf: (h: H) => EventLogStatus,
  startOf: (sessionId: string, h: H, generation: number) => Effect.Effect<Option.Option<Cursor.Cursor>, EventLogError>,
  operations: StoreOperations
): EventLogService => {
  const status = (sessionId: string) => Effect.map(open(sessionId), statusOf)
  const { appendAllNow, ...rest } = operations
  return withAppendAllNow(EventLog.of({
    repair: () => Effect.succeed(Option.none()),
    forget: () => Effect.void,
    ...rest,
    currentGeneration: (sessionId) => Effect.map(status(sessionId), (s) => s.generation),
    lastCursor: (sessionId) => Effect.map(status(sessionId), (s) => s.lastCursor),
    generations: (sessionId) => Effect.map(status(sessionId), (s) => s.generations),
    status: (sessionId) => status(sessionId).pipe(Effect.withSpan("EventLog.status", { captureStackTrace: false })),
    generationStart: (sessionId, generation) =>
      Effect.flatMap(open(sessionId), (h) =>
        statusOf(h).generations.includes(generation)
          ? startOf(sessionId, h, generation)
          : Effect.fail(fail("GenerationNotFound", sessionId, `generation ${generation} is not retained`)))
  }), appendAllNow)
}
