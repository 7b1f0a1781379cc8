/**
 * The recovery journal's service over a storage backend, the same for every store: the latest
 * record per session, the one check of whether a record changes anything, the records' fields,
 * serialized writes with group commit, and when to compact. A backend says only where records go (a
 * file's lines, a table's rows, nowhere).
 */
import * as Clock from "effect/Clock"
import * as Effect from "effect/Effect"
import * as Exit from "effect/Exit"
import * as Option from "effect/Option"
import * as Ref from "effect/Ref"
import * as Runtime from "effect/Runtime"
import * as Schema from "effect/Schema"
import {
  type JournalInput,
  JournalRecord,
  RecoveryJournal,
  RecoveryJournalError,
  type RecoveryJournalService
} from "../../RecoveryJournal.js"

/** Where records go. */
export interface Backend {
  /** Makes one new record durable (its session's latest). */
  readonly append: (record: JournalRecord) => Effect.Effect<void, RecoveryJournalError>
  /**
   * Makes several new records durable at once, in order (a file: one write, one fsync); without
   * it they are appended one by one.
   */
  readonly appendAll?: (records: ReadonlyArray<JournalRecord>) => Effect.Effect<void, RecoveryJournalError>
  /** Keeps only `records`, one per session (a file is rewritten; a table is that already). */
  readonly compact: (records: ReadonlyArray<JournalRecord>) => Effect.Effect<void, RecoveryJournalError>
  /** Drops a session's records; `records` are those that stay. */
  readonly remove: (activeSessionId: string, records: ReadonlyArray<JournalRecord>) => Effect.Effect<void, RecoveryJournalError>
}

/** A record waiting for its write, and how it is answered. */
interface Waiter {
  readonly input: JournalInput
  readonly answer: (exit: Exit.Exit<boolean, RecoveryJournalError>) => void
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

/** Records more than sessions past which the backend is compacted even with some session busy. */
export const DEFAULT_COMPACT_BUSY_AFTER = 10_000

/**
 * Whether the backend is due for compaction: it holds more records than sessions and every
 * session is idle (a quiet moment), or, should the sessions never be idle together, it holds
 * `busyAfter` records too many.
 */
export const shouldCompact = (
  lines: number,
  latest: ReadonlyMap<string, JournalRecord>,
  busyAfter: number = DEFAULT_COMPACT_BUSY_AFTER
): boolean => {
  const extra = lines - latest.size
  return extra > 0 && (allIdle(latest) || extra >= busyAfter)
}

/** When compactions run. */
export interface CompactPolicy {
  /**
   * Runs a compaction due at an idle moment a little later (the file journal: after a short
   * quiet period, see its `compactDelayMs`); without it, it runs at once, inside the record.
   */
  readonly later?: (compaction: Effect.Effect<void>) => Effect.Effect<void>
  /** See {@link shouldCompact}. */
  readonly busyAfter?: number
}

export const makeService = (
  initial: State,
  backend: Backend,
  policy: CompactPolicy = {}
): Effect.Effect<RecoveryJournalService> =>
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
    const compactQuietly = compactLocked.pipe(
      Effect.catchAll((error) => Effect.logWarning(`recovery journal compaction failed: ${error.message}`))
    )
    /** A compaction put off to a quiet moment: run only if that moment is still quiet. */
    const compactIfDue = serialized(Effect.gen(function*() {
      const current = yield* Ref.get(state)
      if (current.lines > current.latest.size && allIdle(current.latest)) yield* compactQuietly
    }))

    /**
     * Group commit: records asked for while a write is under way are written together by the
     * next one (one write and one fsync for the lot), each answered once durable. One at a time,
     * 200 sessions starting their turns at once queued 200 write+fsync round trips behind the
     * event logs' fdatasyncs: prompts were answered after more than 60 s. A record only joins the
     * queue and waits for its answer; one writer at a time (a fiber of its own, under the permit)
     * writes what is queued until nothing is. A record that took the permit itself, with a span
     * and a Deferred, cost the daemon ~0.2 ms of CPU, two per turn (bench/streaming.ts).
     */
    const queued: Array<Waiter> = []
    let writing = false
    const runFork = Runtime.runFork(yield* Effect.runtime<never>())

    /** Writes one batch; every record of it is answered, whatever happens. */
    const writeBatch = (batch: ReadonlyArray<Waiter>) =>
      Effect.gen(function*() {
        const current = yield* Ref.get(state)
        const now = yield* Clock.currentTimeMillis
        const entries: Array<JournalRecord> = []
        // The batch's records against the latest ones (a record that says nothing new is not
        // written), the latest map changed only once they are durable.
        const pending = new Map<string, JournalRecord>()
        const changed = batch.map(({ input }) => {
          const previous = pending.get(input.activeSessionId) ?? current.latest.get(input.activeSessionId)
          if (previous !== undefined && sameState(previous, input)) return false
          const entry = makeRecord(input, now)
          pending.set(entry.activeSessionId, entry)
          entries.push(entry)
          return true
        })
        if (entries.length > 0) {
          yield* backend.appendAll !== undefined ? backend.appendAll(entries) : Effect.forEach(entries, backend.append, { discard: true })
          const latest = new Map(current.latest)
          for (const [id, entry] of pending) latest.set(id, entry)
          yield* Ref.set(state, { latest, lines: current.lines + entries.length })
          if (shouldCompact(current.lines + entries.length, latest, policy.busyAfter)) {
            // The records are durable already: a failed compaction only leaves a longer file.
            if (allIdle(latest) && policy.later !== undefined) yield* policy.later(compactIfDue)
            else yield* compactQuietly
          }
        }
        return changed
      }).pipe(
        Effect.exit,
        Effect.map((exit) => {
          for (let i = 0; i < batch.length; i++) batch[i]!.answer(Exit.map(exit, (changed) => changed[i]!))
        })
      )

    /** Writes what is queued, batch after batch, until nothing is; then there is no writer. */
    const writer: Effect.Effect<void> = Effect.suspend(() => {
      if (queued.length === 0) {
        writing = false
        return Effect.void
      }
      return Effect.zipRight(
        serialized(Effect.suspend(() => {
          // Empty when every record queued was given up while the writer waited for the permit.
          const batch = queued.splice(0)
          return batch.length === 0 ? Effect.void : writeBatch(batch)
        })),
        writer
      )
    })

    /**
     * The writer, should it ever end otherwise (`writeBatch` answers every failure and defect of
     * its own, so only an interruption of the writer's fiber, which nothing here does, or a
     * defect outside it would): what is queued is answered with an error, and the next record
     * starts another writer, rather than wait for one that is gone.
     */
    const guardedWriter = Effect.onExit(writer, (exit) =>
      Exit.isSuccess(exit) ? Effect.void : Effect.sync(() => {
        writing = false
        const error = new RecoveryJournalError({ operation: "append", path: "(the journal's writer)", cause: new Error("the writer stopped before it wrote the record") })
        for (const waiter of queued.splice(0)) waiter.answer(Exit.fail(error))
      }))

    const record = (input: JournalInput) =>
      Effect.async<boolean, RecoveryJournalError>((answer) => {
        const waiter: Waiter = { input, answer }
        queued.push(waiter)
        if (!writing) {
          writing = true
          runFork(guardedWriter)
        }
        // Given up before a write took it: it is not written.
        return Effect.sync(() => {
          const at = queued.indexOf(waiter)
          if (at >= 0) queued.splice(at, 1)
        })
      })

    const compact = Effect.fn("RecoveryJournal.compact")(function*() {
      // One line per session already (a torn or stale line counts as a line): nothing to rewrite.
      yield* serialized(Effect.flatMap(Ref.get(state), (s) => s.lines > s.latest.size ? compactLocked : Effect.void))
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
