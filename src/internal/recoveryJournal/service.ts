/**
 * The recovery journal's service over a storage backend, the same for every store: the latest
 * record per session, the one check of whether a record changes anything, the records' fields,
 * serialized writes, and compaction once every session is idle. A backend says only where
 * records go (a file's lines, a table's rows, nowhere).
 */
import * as Clock from "effect/Clock"
import * as Effect from "effect/Effect"
import * as Option from "effect/Option"
import * as Ref from "effect/Ref"
import * as Schema from "effect/Schema"
import {
  type JournalInput,
  JournalRecord,
  RecoveryJournal,
  type RecoveryJournalError,
  type RecoveryJournalService
} from "../../RecoveryJournal.js"

/** Where records go. */
export interface Backend {
  /** Makes one new record durable (its session's latest). */
  readonly append: (record: JournalRecord) => Effect.Effect<void, RecoveryJournalError>
  /** Keeps only `records`, one per session (a file is rewritten; a table is that already). */
  readonly compact: (records: ReadonlyArray<JournalRecord>) => Effect.Effect<void, RecoveryJournalError>
  /** Drops a session's records; `records` are those that stay. */
  readonly remove: (activeSessionId: string, records: ReadonlyArray<JournalRecord>) => Effect.Effect<void, RecoveryJournalError>
}

export interface State {
  readonly latest: ReadonlyMap<string, JournalRecord>
  /** Records the backend holds: when it exceeds the number of sessions, compaction shrinks it. */
  readonly lines: number
}

/**
 * A stored record (a file's line, a table's row), or why it is not one (unknown version, bad
 * date, not JSON). A function, not a constant: this module loads while the public one, which
 * defines the schema, is still being evaluated.
 */
export const decodeRecord = (text: string) => Schema.decodeUnknownEither(Schema.parseJson(JournalRecord))(text)

/** Whether a record would say nothing new about its session. */
export const sameState = (a: JournalRecord, b: JournalInput): boolean =>
  a.busy === b.busy && a.operation === b.operation && a.sessionFile === b.sessionFile

/** The record of `input` made at `now`. */
export const makeRecord = (input: JournalInput, now: number): JournalRecord => ({
  version: 1,
  activeSessionId: input.activeSessionId,
  sessionId: input.sessionId,
  busy: input.busy,
  operation: input.operation,
  ...(input.sessionFile !== undefined ? { sessionFile: input.sessionFile } : {}),
  recordedAt: new Date(now).toISOString()
})

const allIdle = (latest: ReadonlyMap<string, JournalRecord>): boolean => {
  for (const record of latest.values()) if (record.busy) return false
  return true
}

export const makeService = (initial: State, backend: Backend): Effect.Effect<RecoveryJournalService> =>
  Effect.gen(function*() {
    const state = yield* Ref.make(initial)
    const semaphore = yield* Effect.makeSemaphore(1)
    // Uninterruptible inside the permit: an interrupted fs promise keeps running, and releasing
    // the permit under it would let the next append interleave with its bytes.
    const serialized = <A, E>(effect: Effect.Effect<A, E>): Effect.Effect<A, E> =>
      semaphore.withPermits(1)(Effect.uninterruptible(effect))

    const compactLocked = Effect.gen(function*() {
      const current = yield* Ref.get(state)
      yield* backend.compact(Array.from(current.latest.values()))
      yield* Ref.set(state, { latest: current.latest, lines: current.latest.size })
    })

    const record = Effect.fn("RecoveryJournal.record")(function*(input: JournalInput) {
      yield* Effect.annotateCurrentSpan({ activeSessionId: input.activeSessionId, operation: input.operation })
      return yield* serialized(Effect.gen(function*() {
        const current = yield* Ref.get(state)
        const previous = current.latest.get(input.activeSessionId)
        if (previous !== undefined && sameState(previous, input)) return false
        const entry = makeRecord(input, yield* Clock.currentTimeMillis)
        yield* backend.append(entry)
        const latest = new Map(current.latest).set(entry.activeSessionId, entry)
        yield* Ref.set(state, { latest, lines: current.lines + 1 })
        if (allIdle(latest) && current.lines + 1 > latest.size) {
          // The record is durable already: a failed compaction only leaves a longer file.
          yield* compactLocked.pipe(
            Effect.catchAll((error) => Effect.logWarning(`recovery journal compaction failed: ${error.message}`))
          )
        }
        return true
      }))
    })

    const compact = Effect.fn("RecoveryJournal.compact")(function*() {
      yield* serialized(compactLocked)
    })

    const forget = Effect.fn("RecoveryJournal.forget")(function*(activeSessionId: string) {
      yield* serialized(Effect.gen(function*() {
        const current = yield* Ref.get(state)
        if (!current.latest.has(activeSessionId)) return
        const latest = new Map(current.latest)
        latest.delete(activeSessionId)
        // Gone from `latest()` even if the backend's write fails.
        yield* Ref.set(state, { latest, lines: current.lines })
        yield* backend.remove(activeSessionId, Array.from(latest.values()))
        yield* Ref.set(state, { latest, lines: latest.size })
      }))
    })

    return RecoveryJournal.of({
      record,
      latest: () => Effect.map(Ref.get(state), (s) => s.latest),
      get: (activeSessionId) => Effect.map(Ref.get(state), (s) => Option.fromNullable(s.latest.get(activeSessionId))),
      compact,
      forget
    })
  })
