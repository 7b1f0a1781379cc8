/**
 * The in-memory event log (same semantics as the file layer, nothing durable): for tests of the
 * modules that use one. It keeps record lines as JSON text, so events are copied as on disk.
 */
import * as Effect from "effect/Effect"
import * as Option from "effect/Option"
import * as Stream from "effect/Stream"
import * as Cursor from "../../Cursor.js"
import {
  type EncodedEvent,
  type EventData,
  type EventLogError,
  type EventLogService,
  type EventLogStatus,
  type EventRecord,
  sanitizeSessionId
} from "../../EventLog.js"
import {
  checkReadable,
  fail,
  makeService,
  parseRecord,
  recordLine,
  serializeChecked,
  serializeCheckedNow
} from "./records.js"

interface MemorySession {
  /** Generation -> record lines (JSON text, so events are copied as the file layer would). */
  readonly segments: Map<number, Array<string>>
  /** Generation -> the last cursor before it (a file segment's header). */
  readonly starts: Map<number, Option.Option<Cursor.Cursor>>
  generation: number
  bytes: number
  last: Option.Option<Cursor.Cursor>
}

/** Builds the in-memory service. */
export const make: Effect.Effect<EventLogService> = Effect.sync(() => {
  const sessions = new Map<string, MemorySession>()
  const sessionFor = (sessionId: string): Effect.Effect<MemorySession, EventLogError> =>
    Effect.suspend(() => {
      const name = sanitizeSessionId(sessionId)
      if (name._tag === "Left") return Effect.fail(name.left)
      let s = sessions.get(sessionId)
      if (s === undefined) {
        s = { segments: new Map(), starts: new Map(), generation: 1, bytes: 0, last: Option.none() }
        sessions.set(sessionId, s)
      }
      return Effect.succeed(s)
    })
  const ensureFirst = (s: MemorySession) => {
    if (s.segments.size === 0) s.segments.set(1, [])
  }
  const statusOf = (s: MemorySession): EventLogStatus => ({
    generation: s.generation,
    lastCursor: s.last,
    generations: s.segments.size === 0 ? [s.generation] : [...s.segments.keys()],
    generationEvents: s.segments.get(s.generation)?.length ?? 0,
    generationBytes: s.bytes
  })
  const toRecords = (generation: number, lines: ReadonlyArray<string>, fromSequence: number): Array<EventRecord> =>
    lines.slice(fromSequence).map((text) => parseRecord(text, generation)!)

  /** Appends one record line to the session's current generation. */
  const push = (s: MemorySession, json: string): Cursor.Cursor => {
    ensureFirst(s)
    const lines = s.segments.get(s.generation)!
    const cursor = Cursor.make(s.generation, lines.length)
    const line = recordLine(cursor, json)
    lines.push(line.slice(0, -1))
    s.bytes += Buffer.byteLength(line, "utf8")
    s.last = Option.some(cursor)
    return cursor
  }

  const append = Effect.fnUntraced(function*(sessionId: string, event: EventData | EncodedEvent) {
    const json = yield* serializeChecked(sessionId, event)
    return push(yield* sessionFor(sessionId), json)
  })
  const appendAll = Effect.fn("EventLog.appendAll")(
    function*(sessionId: string, events: ReadonlyArray<EventData | EncodedEvent>) {
      if (events.length === 0) return []
      const jsons = yield* Effect.forEach(events, (event) => serializeChecked(sessionId, event))
      const s = yield* sessionFor(sessionId)
      return jsons.map((json) => push(s, json))
    }
  )
  /**
   * The hot path as the file log has it: the events are appended at once and `done` is called
   * later (a microtask: other fibers run in between, as they would while a group commit is
   * fdatasynced), so that the tests of the session core over this log run the path a daemon
   * runs, that window included. Not a later turn of the event loop: those tests wait a bounded
   * number of yields, counting on storage that answers without one. Declined for a session not
   * appended to yet (the file log declines one not open).
   */
  const appendAllNow = (
    sessionId: string,
    events: ReadonlyArray<EventData | EncodedEvent>,
    _tracer: unknown,
    done: (error: EventLogError | undefined) => void
  ): ReadonlyArray<Cursor.Cursor> | EventLogError | undefined => {
    const s = sessions.get(sessionId)
    if (s === undefined || events.length === 0) return undefined
    const jsons: Array<string> = []
    for (const event of events) {
      const json = serializeCheckedNow(sessionId, event)
      if (typeof json !== "string") return json
      jsons.push(json)
    }
    const cursors = jsons.map((json) => push(s, json))
    queueMicrotask(() => done(undefined))
    return cursors
  }
  const startGeneration = Effect.fn("EventLog.startGeneration")(function*(sessionId: string) {
    const s = yield* sessionFor(sessionId)
    ensureFirst(s)
    s.generation += 1
    s.bytes = 0
    s.segments.set(s.generation, [])
    s.starts.set(s.generation, s.last)
    return s.generation
  })
  const read = (sessionId: string, after?: Cursor.Cursor): Stream.Stream<EventRecord, EventLogError> =>
    Stream.unwrap(Effect.map(sessionFor(sessionId), (s) => {
      const gone = checkReadable(sessionId, s.starts, [...s.segments.keys()], after)
      if (gone !== undefined) return Stream.fail(gone)
      return Stream.fromIterable(
        [...s.segments.entries()]
          .filter(([g]) => after === undefined || g >= after.generation)
          .flatMap(([g, lines]) =>
            toRecords(g, lines, after !== undefined && g === after.generation ? after.sequence + 1 : 0)
          )
      )
    }))
  const readGeneration = (sessionId: string, generation: number): Stream.Stream<EventRecord, EventLogError> =>
    Stream.unwrap(Effect.map(sessionFor(sessionId), (s) => {
      const lines = s.segments.get(generation)
      if (lines !== undefined) return Stream.fromIterable(toRecords(generation, lines, 0))
      if (s.segments.size === 0 && generation === s.generation) return Stream.empty
      return Stream.fail(fail("GenerationNotFound", sessionId, `generation ${generation} is not retained`))
    }))
  const prune = Effect.fn("EventLog.prune")(function*(sessionId: string, keepFromGeneration: number) {
    const s = yield* sessionFor(sessionId)
    const keep = Math.min(keepFromGeneration, s.generation)
    const doomed = [...s.segments.keys()].filter((g) => g < keep)
    for (const g of doomed) s.segments.delete(g)
    return doomed
  })
  const remove = Effect.fn("EventLog.remove")(function*(sessionId: string, _options?: { readonly archiveTo?: string }) {
    yield* sessionFor(sessionId)
    sessions.delete(sessionId)
  })
  // Nothing in memory is ever damaged: no repair.
  return makeService(sessionFor, statusOf, (_, s, generation) => Effect.succeed(s.starts.get(generation) ?? Option.none()), {
    append, appendAll, appendAllNow, read, readGeneration, startGeneration, prune, remove
  })
})

