/**
 * The event log in PostgreSQL: `agentd_events` keyed by (session, generation, sequence) and one
 * `agentd_generations` row per retained generation saying where the history stood when it
 * began (see ./store.ts).
 *
 * Group commit (../eventLog/appendQueue.ts, grouped per store), across sessions: `append` assigns the cursor and
 * queues the event synchronously, then waits; one flusher fiber takes everything queued, in
 * every session, and writes it as one multi-row INSERT (one statement: one transaction, one WAL
 * flush; a flush that also starts generations is one explicit transaction), and acknowledges
 * those appends only once the commit returned (durable: `synchronous_commit` is on by default).
 * Appends arriving meanwhile form the next batch. (One flusher per session, as on disk, was
 * 3x slower with 8 busy sessions, measured: 8 commits, each waiting for its own WAL flush.)
 * The daemon is the store's only writer (its advisory lock), so each session's generation, next
 * cursor and retained generations are kept in memory once read.
 */
import * as SqlClient from "@effect/sql/SqlClient"
import type { SqlError } from "@effect/sql/SqlError"
import * as Chunk from "effect/Chunk"
import * as Effect from "effect/Effect"
import * as Option from "effect/Option"
import { isRecord } from "effect/Predicate"
import type * as Scope from "effect/Scope"
import * as Stream from "effect/Stream"
import * as Cursor from "../../Cursor.js"
import { EventLogError, type EventLogService, type EventLogStatus, type EventRecord, sanitizeSessionId } from "../../EventLog.js"
import * as AppendQueue from "../eventLog/appendQueue.js"
import { checkReadable, fail, makeService, recordBytes } from "../eventLog/records.js"

const sqlFail = (sessionId: string, what: string) => (cause: SqlError) =>
  fail("Io", sessionId, `${what}: ${cause.message}`, cause)

/** The same sum in SQL, over a generation's rows (for a session opened from the database). */
const RECORD_BYTES_SQL =
  `coalesce(sum(octet_length(event) + octet_length('{"cursor":{"generation":' || generation || ',"sequence":' || sequence || '},"event":}') + 1), 0)`

/** One open session; the fields under `// durable` describe what is committed. */
interface Handle extends AppendQueue.QueueHandle {
  /**
   * Its rows' key: the id escaped as the file layer names its directory (injective, and free of
   * the NUL byte PostgreSQL text cannot hold).
   */
  readonly key: string
  // durable
  /** Retained generation -> the last cursor before it. Empty until the first write. */
  starts: Map<number, Option.Option<Cursor.Cursor>>
  generation: number
  count: number
  bytes: number
  last: Option.Option<Cursor.Cursor>
}

const segmentsOf = (h: Handle): Array<number> => [...h.starts.keys()].sort((a, b) => a - b)

const startOf = (row: { after_generation: number | null; after_sequence: number | null }): Option.Option<Cursor.Cursor> =>
  row.after_generation === null || row.after_sequence === null
    ? Option.none()
    : Option.some(Cursor.make(row.after_generation, row.after_sequence))

const toRecord = (row: { generation: number; sequence: number; event: string }, sessionId: string): EventRecord | EventLogError => {
  let event: unknown
  try {
    event = JSON.parse(row.event)
  } catch (cause) {
    return fail("Corrupt", sessionId, `event ${row.generation}:${row.sequence} is not JSON`, cause)
  }
  if (!isRecord(event)) return fail("Corrupt", sessionId, `event ${row.generation}:${row.sequence} is not a JSON object`)
  return { cursor: Cursor.make(row.generation, row.sequence), event, json: row.event }
}

/** Rows fetched per query when streaming a log. */
const PAGE = 2000

/**
 * Builds the PostgreSQL event log over the store's SqlClient (./store.ts: schema and lock); its
 * scope owns the flusher fibers.
 */
export const make: Effect.Effect<EventLogService, never, SqlClient.SqlClient | Scope.Scope> = Effect.gen(function*() {
  const sql = yield* SqlClient.SqlClient
  const openHandle = (sessionId: string): Effect.Effect<Handle, EventLogError> =>
    Effect.gen(function*() {
      const name = sanitizeSessionId(sessionId)
      if (name._tag === "Left") return yield* Effect.fail(name.left)
      const h: Handle = {
        sessionId,
        key: name.right,
        starts: new Map(),
        generation: 1,
        count: 0,
        bytes: 0,
        last: Option.none(),
        next: Cursor.initial,
        queue: [],
        dead: undefined
      }
      const generations = yield* sql<{ generation: number; after_generation: number | null; after_sequence: number | null }>`
        SELECT generation, after_generation, after_sequence FROM agentd_generations
        WHERE session_id = ${h.key} ORDER BY generation`
      if (generations.length === 0) return h
      for (const row of generations) h.starts.set(row.generation, startOf(row))
      const newest = generations[generations.length - 1]!
      const [tail] = yield* sql.unsafe<{ count: string; bytes: string }>(
        `SELECT count(*) AS count, ${RECORD_BYTES_SQL} AS bytes FROM agentd_events WHERE session_id = $1 AND generation = $2`,
        [h.key, newest.generation]
      )
      const count = Number(tail?.count ?? 0)
      h.generation = newest.generation
      h.count = count
      h.bytes = Number(tail?.bytes ?? 0)
      h.last = count > 0 ? Option.some(Cursor.make(newest.generation, count - 1)) : startOf(newest)
      h.next = Cursor.make(newest.generation, count)
      return h
    }).pipe(Effect.catchTag("SqlError", (e) => Effect.fail(sqlFail(sessionId, "opening the session's log failed")(e))))

  const insertEvents = (key: string, generation: number, ops: ReadonlyArray<AppendQueue.AppendOp>) =>
    sql.unsafe(
      `INSERT INTO agentd_events (session_id, generation, sequence, event)
       SELECT $1, $2, s, e FROM unnest($3::integer[], $4::text[]) AS t(s, e)`,
      [key, generation, ops.map((op) => op.cursor.sequence), ops.map((op) => op.json)]
    )

  const insertGeneration = (key: string, generation: number, after: Option.Option<Cursor.Cursor>) =>
    sql`INSERT INTO agentd_generations (session_id, generation, after_generation, after_sequence)
      VALUES (${key}, ${generation}, ${Option.isSome(after) ? after.value.generation : null},
        ${Option.isSome(after) ? after.value.sequence : null})`

  type Batch = AppendQueue.Batch<Handle>
  type Op = AppendQueue.Op

  /** The statements of one session's ops (the general path: generations started, a first write). */
  const writeOps = (h: Handle, ops: ReadonlyArray<Op>) =>
    Effect.gen(function*() {
      if (h.starts.size === 0) yield* insertGeneration(h.key, 1, Option.none())
      let generation = h.generation
      let last = h.last
      let run: Array<AppendQueue.AppendOp> = []
      const flushRun = Effect.suspend(() => {
        const appends = run
        run = []
        return appends.length === 0 ? Effect.void : insertEvents(h.key, generation, appends)
      })
      for (const op of ops) {
        if (op._tag === "Append") {
          run.push(op)
          last = Option.some(op.cursor)
        } else {
          yield* flushRun
          yield* insertGeneration(h.key, op.generation, last)
          generation = op.generation
        }
      }
      yield* flushRun
    })

  /**
   * Appends only, to sessions already written: one INSERT for every session of the batch (one
   * statement is its own transaction), so a flush costs one round trip and one WAL flush however
   * many sessions it carries.
   */
  const insertAll = (batch: Batch) => {
    const keys: Array<string> = []
    const generations: Array<number> = []
    const sequences: Array<number> = []
    const events: Array<string> = []
    for (const [h, ops] of batch) {
      for (const op of ops) {
        const append = op as AppendQueue.AppendOp
        keys.push(h.key)
        generations.push(append.cursor.generation)
        sequences.push(append.cursor.sequence)
        events.push(append.json)
      }
    }
    return sql.unsafe(
      `INSERT INTO agentd_events (session_id, generation, sequence, event)
       SELECT * FROM unnest($1::text[], $2::integer[], $3::integer[], $4::text[])`,
      [keys, generations, sequences, events]
    )
  }

  /** Applies one session's committed ops to its handle and answers them. */
  const applied = (h: Handle, ops: ReadonlyArray<Op>): void => {
    if (h.starts.size === 0) h.starts.set(1, Option.none())
    for (const op of ops) {
      if (op._tag === "Append") {
        h.count++
        h.bytes += recordBytes(op.cursor, op.json)
        h.last = Option.some(op.cursor)
        op.resume(Effect.succeed(op.cursor))
      } else {
        h.starts.set(op.generation, h.last)
        h.generation = op.generation
        h.count = 0
        h.bytes = 0
        op.resume(Effect.succeed(op.generation))
      }
    }
  }

  /**
   * Writes one flush, all of it or nothing (one statement, or one transaction), then answers its
   * ops. On a failure every op of it fails and its sessions' handles are dropped (each is read
   * again from the database at its next use).
   */
  const writeBatch = (all: Batch): Effect.Effect<void> => {
    const batch: Array<readonly [Handle, ReadonlyArray<Op>]> = []
    for (const [h, ops] of all) {
      if (h.dead === undefined) batch.push([h, ops])
      else for (const op of ops) op.resume(Effect.fail(h.dead))
    }
    if (batch.length === 0) return Effect.void
    const simple = batch.every(([h, ops]) => h.starts.size > 0 && ops.every((op) => op._tag === "Append"))
    const write = simple
      ? insertAll(batch)
      : sql.withTransaction(Effect.forEach(batch, ([h, ops]) => writeOps(h, ops), { discard: true }))
    return write.pipe(
      Effect.matchCauseEffect({
        onFailure: (cause) =>
          Effect.forEach(batch, ([h, ops]) => {
            const error = h.dead ?? fail("Io", h.sessionId, `writing the event log failed: ${cause.toString()}`, cause)
            for (const op of ops) op.resume(Effect.fail(error))
            return queue.kill(h, error)
          }, { discard: true }),
        onSuccess: () =>
          Effect.sync(() => {
            for (const [h, ops] of batch) applied(h, ops)
          })
      }),
      Effect.uninterruptible
    )
  }

  /** Held by a flush while it writes, and by prune/remove, so that they never interleave. */
  const writeLock = Effect.unsafeMakeSemaphore(1)

  const queue = yield* AppendQueue.make<Handle>({
    open: openHandle,
    flush: writeBatch,
    grouping: { _tag: "Store", lock: writeLock }
  })
  const { append, appendAll, handleFor, startGeneration } = queue

  const statusOf = (h: Handle): EventLogStatus => ({
    generation: h.generation,
    lastCursor: h.last,
    generations: h.starts.size === 0 ? [h.generation] : segmentsOf(h),
    generationEvents: h.count,
    generationBytes: h.bytes
  })

  const notRetained = (sessionId: string, generation: number) =>
    fail("GenerationNotFound", sessionId, `generation ${generation} is not retained`)

  type Row = {
    generation: number
    sequence: number
    event: string
    after_generation: number | null
    after_sequence: number | null
  }

  /** Committed rows strictly after (generation, sequence), each with its generation's start. */
  const page = (h: Handle, generation: number, sequence: number, onlyGeneration?: number) =>
    sql.unsafe<Row>(
      `SELECT e.generation, e.sequence, e.event, g.after_generation, g.after_sequence
       FROM agentd_events e JOIN agentd_generations g ON g.session_id = e.session_id AND g.generation = e.generation
       WHERE e.session_id = $1 AND (e.generation, e.sequence) > ($2, $3)
       ${onlyGeneration === undefined ? "" : "AND e.generation = $5"}
       ORDER BY e.generation, e.sequence LIMIT $4`,
      onlyGeneration === undefined ? [h.key, generation, sequence, PAGE] : [h.key, generation, sequence, PAGE, onlyGeneration]
    ).pipe(Effect.mapError(sqlFail(h.sessionId, "reading the event log failed")))

  const read = (sessionId: string, after?: Cursor.Cursor): Stream.Stream<EventRecord, EventLogError> =>
    Stream.unwrap(Effect.map(handleFor(sessionId), (h) => {
      const segments = segmentsOf(h)
      // What the log already knows is gone: fail before reading anything.
      const gone = checkReadable(sessionId, h.starts, segments, after)
      if (gone !== undefined) return Stream.fail(gone)
      // Each row is checked against the one before it (or the cursor read after), so a prune
      // during the read is seen as the read reaches the gap, never skipped.
      let previous: Cursor.Cursor | undefined = after
      let done = false
      const check = (row: Row): EventRecord | EventLogError => {
        const record = toRecord(row, sessionId)
        if (record instanceof EventLogError) return record
        const prev = previous
        if (prev !== undefined && row.generation === prev.generation) {
          if (row.sequence !== prev.sequence + 1) {
            return fail("Corrupt", sessionId, `event ${row.generation}:${prev.sequence + 1} is missing`)
          }
        } else {
          const start = startOf(row)
          const whole = prev === undefined
            ? Option.isNone(start) && row.sequence === 0
            : Option.isSome(start) && !Cursor.isBefore(prev, start.value) && row.sequence === 0
          if (!whole) {
            return fail(
              "GenerationNotFound",
              sessionId,
              prev === undefined
                ? `events before generation ${row.generation} were pruned`
                : `the events after ${prev.generation}:${prev.sequence} were pruned`
            )
          }
        }
        previous = record.cursor
        return record
      }
      const pull: Effect.Effect<Chunk.Chunk<EventRecord>, Option.Option<EventLogError>> = Effect.suspend(() => {
        if (done) return Effect.fail(Option.none())
        const from = previous ?? Cursor.make(0, 0)
        return page(h, from.generation, from.sequence).pipe(
          Effect.mapError(Option.some),
          Effect.flatMap((rows) => {
            if (rows.length < PAGE) done = true
            if (rows.length === 0) return Effect.fail(Option.none())
            const out: Array<EventRecord> = []
            for (const row of rows) {
              const record = check(row)
              if (record instanceof EventLogError) return Effect.fail(Option.some(record))
              out.push(record)
            }
            return Effect.succeed(Chunk.unsafeFromArray(out))
          })
        )
      })
      return Stream.repeatEffectChunkOption(pull)
    })).pipe(Stream.withSpan("EventLog.read"))

  const readGeneration = (sessionId: string, generation: number): Stream.Stream<EventRecord, EventLogError> =>
    Stream.unwrap(Effect.map(handleFor(sessionId), (h) => {
      if (h.starts.size === 0 && generation === h.generation) return Stream.empty
      if (!h.starts.has(generation)) return Stream.fail(notRetained(sessionId, generation))
      let next = 0
      let done = false
      const pull: Effect.Effect<Chunk.Chunk<EventRecord>, Option.Option<EventLogError>> = Effect.suspend(() => {
        if (done) return Effect.fail(Option.none())
        return page(h, generation, next - 1, generation).pipe(
          Effect.mapError(Option.some),
          Effect.flatMap((rows) => {
            if (rows.length < PAGE) done = true
            if (rows.length === 0) {
              // Pruned while it was read: say so rather than end short.
              return next > 0 && !h.starts.has(generation)
                ? Effect.fail(Option.some(notRetained(sessionId, generation)))
                : Effect.fail(Option.none())
            }
            const out: Array<EventRecord> = []
            for (const row of rows) {
              const record = toRecord(row, sessionId)
              if (record instanceof EventLogError) return Effect.fail(Option.some(record))
              if (row.sequence !== next) {
                return Effect.fail(Option.some(fail("Corrupt", sessionId, `event ${generation}:${next} is missing`)))
              }
              next++
              out.push(record)
            }
            return Effect.succeed(Chunk.unsafeFromArray(out))
          })
        )
      })
      return Stream.repeatEffectChunkOption(pull)
    })).pipe(Stream.withSpan("EventLog.readGeneration"))

  const prune = Effect.fn("EventLog.prune")(function*(sessionId: string, keepFromGeneration: number) {
    const h = yield* handleFor(sessionId)
    return yield* writeLock.withPermits(1)(Effect.gen(function*() {
      const keep = Math.min(keepFromGeneration, h.generation)
      const doomed = segmentsOf(h).filter((g) => g < keep)
      if (doomed.length === 0) return []
      // Readers look generations up as they go: forget them before deleting.
      for (const g of doomed) h.starts.delete(g)
      yield* sql.withTransaction(Effect.zipRight(
        sql`DELETE FROM agentd_events WHERE session_id = ${h.key} AND generation < ${keep}`,
        sql`DELETE FROM agentd_generations WHERE session_id = ${h.key} AND generation < ${keep}`
      )).pipe(Effect.mapError(sqlFail(sessionId, "pruning the event log failed")))
      return doomed
    }))
  })

  const remove = Effect.fn("EventLog.remove")(
    function*(sessionId: string, options?: { readonly archiveTo?: string }) {
      const h = yield* handleFor(sessionId)
      yield* writeLock.withPermits(1)(Effect.gen(function*() {
        yield* queue.kill(h, fail("Closed", sessionId, "the session's event log was removed"))
        // Archived: the rows move under another key (`:` is never in an escaped id), nothing is deleted.
        const move = (table: string) =>
          options?.archiveTo !== undefined
            ? sql.unsafe(`UPDATE ${table} SET session_id = $2 WHERE session_id = $1`, [h.key, `archive:${options.archiveTo}`])
            : sql.unsafe(`DELETE FROM ${table} WHERE session_id = $1`, [h.key])
        yield* sql.withTransaction(Effect.zipRight(move("agentd_events"), move("agentd_generations"))).pipe(
          Effect.mapError(sqlFail(sessionId, "removing the event log failed"))
        )
      }))
    }
  )

  // The database keeps every row whole (a transaction commits all of a batch or none of it): no repair.
  return makeService(handleFor, statusOf, (_, h, generation) => Effect.succeed(h.starts.get(generation) ?? Option.none()), {
    append, appendAll, read, readGeneration, startGeneration, prune, remove
  })
})
