/**
 * The recovery journal in PostgreSQL: `agentd_journal`, one row per session (keyed by its
 * escaped id, as the session store's) holding its latest record (JSON), upserted by `record` (committed, so durable, before it returns). A table keyed
 * by session is already what the file journal's compaction makes, so `compact` has nothing to
 * do. Records are loaded once at start (the daemon is the store's only writer); a row that does
 * not decode is skipped with one warning, as a torn line of the file is.
 */
import * as SqlClient from "@effect/sql/SqlClient"
import type { SqlError } from "@effect/sql/SqlError"
import * as Clock from "effect/Clock"
import * as Effect from "effect/Effect"
import * as Either from "effect/Either"
import * as Option from "effect/Option"
import * as Ref from "effect/Ref"
import * as Schema from "effect/Schema"
import {
  type JournalInput,
  JournalRecord,
  RecoveryJournal,
  RecoveryJournalError,
  type RecoveryJournalService
} from "../../RecoveryJournal.js"
import { safeSegment } from "../../StateLayout.js"

const decode = Schema.decodeUnknownEither(Schema.parseJson(JournalRecord))

const TABLE = "postgres:agentd_journal"

const failWith = (operation: string) => (cause: SqlError) => new RecoveryJournalError({ operation, path: TABLE, cause })

const sameState = (a: JournalRecord, b: JournalInput): boolean =>
  a.busy === b.busy && a.operation === b.operation && a.sessionFile === b.sessionFile

/** Builds the PostgreSQL journal over the store's SqlClient (./store.ts), loading its records. */
export const make: Effect.Effect<RecoveryJournalService, RecoveryJournalError, SqlClient.SqlClient> = Effect.gen(function*() {
  const sql = yield* SqlClient.SqlClient
  const rows = yield* sql<{ active_session_id: string; record: string }>`
    SELECT active_session_id, record FROM agentd_journal`.pipe(Effect.mapError(failWith("read")))
  const initial = new Map<string, JournalRecord>()
  const skipped: Array<string> = []
  for (const row of rows) {
    const decoded = decode(row.record)
    if (Either.isRight(decoded) && safeSegment(decoded.right.activeSessionId) === row.active_session_id) {
      initial.set(decoded.right.activeSessionId, decoded.right)
    }
    else skipped.push(JSON.stringify(row.active_session_id))
  }
  if (skipped.length > 0) {
    yield* Effect.logWarning(`recovery journal ${TABLE}: skipped ${skipped.length} invalid record(s): ${skipped.slice(0, 5).join(", ")}`)
  }
  const state = yield* Ref.make<ReadonlyMap<string, JournalRecord>>(initial)
  const semaphore = yield* Effect.makeSemaphore(1)
  // Uninterruptible inside the permit: the memory state follows what was committed.
  const serialized = <A, E>(effect: Effect.Effect<A, E>): Effect.Effect<A, E> =>
    semaphore.withPermits(1)(Effect.uninterruptible(effect))

  const record = Effect.fn("RecoveryJournal.record")(function*(input: JournalInput) {
    yield* Effect.annotateCurrentSpan({ activeSessionId: input.activeSessionId, operation: input.operation })
    return yield* serialized(Effect.gen(function*() {
      const current = yield* Ref.get(state)
      const previous = current.get(input.activeSessionId)
      if (previous !== undefined && sameState(previous, input)) return false
      const now = yield* Clock.currentTimeMillis
      const entry: JournalRecord = {
        version: 1,
        activeSessionId: input.activeSessionId,
        sessionId: input.sessionId,
        busy: input.busy,
        operation: input.operation,
        ...(input.sessionFile !== undefined ? { sessionFile: input.sessionFile } : {}),
        recordedAt: new Date(now).toISOString()
      }
      yield* sql`INSERT INTO agentd_journal (active_session_id, record) VALUES (${safeSegment(entry.activeSessionId)}, ${JSON.stringify(entry)})
        ON CONFLICT (active_session_id) DO UPDATE SET record = EXCLUDED.record`.pipe(Effect.mapError(failWith("append")))
      yield* Ref.set(state, new Map(current).set(entry.activeSessionId, entry))
      return true
    }))
  })

  const forget = Effect.fn("RecoveryJournal.forget")(function*(activeSessionId: string) {
    yield* serialized(Effect.gen(function*() {
      const current = yield* Ref.get(state)
      if (!current.has(activeSessionId)) return
      const latest = new Map(current)
      latest.delete(activeSessionId)
      // Gone from `latest()` even if the delete fails (as with the file journal's compaction).
      yield* Ref.set(state, latest)
      yield* sql`DELETE FROM agentd_journal WHERE active_session_id = ${safeSegment(activeSessionId)}`.pipe(Effect.mapError(failWith("compact")))
    }))
  })

  return RecoveryJournal.of({
    record,
    latest: () => Ref.get(state),
    get: (activeSessionId) => Effect.map(Ref.get(state), (s) => Option.fromNullable(s.get(activeSessionId))),
    // One row per session already.
    compact: () => Effect.void,
    forget
  })
})
