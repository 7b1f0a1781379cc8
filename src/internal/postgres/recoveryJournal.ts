/**
 * The recovery journal in PostgreSQL: `agentd_journal`, one row per session (keyed by its
 * escaped id, as the session store's) holding its latest record (JSON), upserted by `record` (committed, so
 * durable, before it returns; the service over it is ../recoveryJournal/service.ts). A table keyed
 * by session is already what the file journal's compaction makes, so `compact` has nothing to
 * do. Records are loaded once at start (the daemon is the store's only writer); a row that does
 * not decode is skipped with one warning, as a torn line of the file is.
 */
import * as SqlClient from "@effect/sql/SqlClient"
import type { SqlError } from "@effect/sql/SqlError"
import * as Effect from "effect/Effect"
import * as Either from "effect/Either"
import { type JournalRecord, RecoveryJournalError, type RecoveryJournalService } from "../../RecoveryJournal.js"
import { safeSegment } from "../../StateLayout.js"
import { decodeRecord, makeService } from "../recoveryJournal/service.js"

const TABLE = "postgres:agentd_journal"

const failWith = (operation: string) => (cause: SqlError) => new RecoveryJournalError({ operation, path: TABLE, cause })

/** Builds the PostgreSQL journal over the store's SqlClient (./store.ts), loading its records. */
export const make: Effect.Effect<RecoveryJournalService, RecoveryJournalError, SqlClient.SqlClient> = Effect.gen(function*() {
  const sql = yield* SqlClient.SqlClient
  const rows = yield* sql<{ active_session_id: string; record: string }>`
    SELECT active_session_id, record FROM agentd_journal`.pipe(Effect.mapError(failWith("read")))
  const initial = new Map<string, JournalRecord>()
  const skipped: Array<string> = []
  for (const row of rows) {
    const decoded = decodeRecord(row.record)
    if (Either.isRight(decoded) && safeSegment(decoded.right.activeSessionId) === row.active_session_id) {
      initial.set(decoded.right.activeSessionId, decoded.right)
    }
    else skipped.push(JSON.stringify(row.active_session_id))
  }
  if (skipped.length > 0) {
    yield* Effect.logWarning(`recovery journal ${TABLE}: skipped ${skipped.length} invalid record(s): ${skipped.slice(0, 5).join(", ")}`)
  }
  return yield* makeService({ latest: initial, lines: initial.size }, {
    // Upserted, and committed before `record` returns.
    append: (entry) =>
      sql`INSERT INTO agentd_journal (active_session_id, record) VALUES (${safeSegment(entry.activeSessionId)}, ${JSON.stringify(entry)})
        ON CONFLICT (active_session_id) DO UPDATE SET record = EXCLUDED.record`.pipe(Effect.asVoid, Effect.mapError(failWith("append"))),
    // One row per session already.
    compact: () => Effect.void,
    remove: (activeSessionId) =>
      sql`DELETE FROM agentd_journal WHERE active_session_id = ${safeSegment(activeSessionId)}`.pipe(
        Effect.asVoid,
        Effect.mapError(failWith("compact"))
      )
  })
})
