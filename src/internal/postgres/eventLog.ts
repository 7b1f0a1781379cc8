/**
 * The event log in PostgreSQL: `agentd_event_batches`, one row per session and generation of a
 * flush keyed by (session, generation, first sequence), and one `agentd_generations` row per
 * retained generation saying where the history stood when it began (see ./store.ts).
 *
 * Group commit (../eventLog/appendQueue.ts, grouped per store), across sessions: `append` assigns the cursor and
 * queues the event synchronously, then waits; one flusher fiber takes everything queued, in
 * every session, and writes it as one INSERT of one row per session (one statement: one
 * transaction, one WAL flush; a flush that also starts generations is one explicit
 * transaction), and acknowledges
 * those appends only once the commit returned (durable: `synchronous_commit` is on by default).
 * Appends arriving meanwhile form the next batch. (One flusher per session, as on disk, was
 * 3x slower with 8 busy sessions, measured: 8 commits, each waiting for its own WAL flush.)
 * The daemon is the store's only writer of a session (its advisory lock; in a cluster, the runner
 * holding the session's shard), so each session's generation, next cursor and retained
 * generations are kept in memory once read, until `forget` (a session moving between runners).
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
import { checkReadable, fail, makeService, recordBytes, textOf } from "../eventLog/records.js"

const sqlFail = (sessionId: string, what: string) => (cause: SqlError) =>
  fail("Io", sessionId, `${what}: ${cause.message}`, cause)

/** The decimal digits of 0, 1, ..., n - 1 together. */
const digitsBelow = (n: number): number => {
  let total = 0
  for (let digits = 1, low = 0, high = 10; low < n; digits++, low = high, high *= 10) {
    total += (Math.min(n, high) - low) * digits
  }
  return total
}

/**
 * `recordBytes` summed over a generation of `count` events (sequences 0 to count - 1) whose
 * texts take `eventBytes` bytes in UTF-8 (for a session opened from the database).
 */
const generationBytes = (generation: number, count: number, eventBytes: number): number =>
  count === 0 ? 0 : eventBytes + count * (recordBytes(Cursor.make(generation, 0), "") - 1) + digitsBelow(count)

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

/** One row of `agentd_event_batches` as read, with its generation's start. */
interface BatchRow {
  readonly generation: number
  readonly first_sequence: number
  readonly count: number
  readonly lengths: ReadonlyArray<number> | null
  readonly events: string
  readonly after_generation: number | null
  readonly after_sequence: number | null
}

/** One event of a batch row. */
interface Row {
  readonly generation: number
  readonly sequence: number
  readonly event: string
  readonly after_generation: number | null
  readonly after_sequence: number | null
}

/** The events of a batch row, in order, from the first whose sequence is `from` or more. */
const eventsOf = (row: BatchRow, sessionId: string, from: number): Array<Row> | EventLogError => {
  const { after_generation, after_sequence, count, generation } = row
  const first = row.first_sequence
  const lengths = row.lengths ?? (count === 1 ? [row.events.length] : [])
  if (lengths.length !== count || lengths.reduce((a, b) => a + b, 0) !== row.events.length) {
    return fail("Corrupt", sessionId, `the events ${generation}:${first} to ${generation}:${first + count - 1} do not add up`)
  }
  const out: Array<Row> = []
  let offset = 0
  for (let i = 0; i < count; i++) {
    const end = offset + lengths[i]!
    if (first + i >= from) {
      out.push({ generation, sequence: first + i, event: row.events.slice(offset, end), after_generation, after_sequence })
    }
    offset = end
  }
  return out
}

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

/**
 * Batch rows fetched per query when streaming a log (a flush of one session is at most about
 * 256 KB of events and usually far less: see PUBLISH_BATCH_BYTES).
 */
const PAGE = 64

/**
 * The channel of the event log's notifications: one per group commit per session written (its
 * payload the session's key, see {@link sessionKey}), sent in the commit's own statement or
 * transaction so that it is delivered once the events are readable, never before.
 */
export const NOTIFY_CHANNEL = "agentd_events"

/** The key of a session's rows, which a notification carries (undefined: an id no log can hold). */
export const sessionKey = (sessionId: string): string | undefined => {
  const name = sanitizeSessionId(sessionId)
  return name._tag === "Left" ? undefined : name.right
}

/** Options of {@link makeWith}. */
export interface Options {
  /** Notify {@link NOTIFY_CHANNEL} at every group commit (the runners of a cluster read each other's logs). */
  readonly notify: boolean
  /**
   * A reader of a log another process writes (a cluster runner's log tail of a session owned
   * elsewhere): nothing is kept in memory, every operation reads where the log stands; its
   * writes are defects. (The writer's view, kept once read, would be stale at once.)
   */
  readonly readOnly?: boolean | undefined
}

/**
 * Builds the PostgreSQL event log over the store's SqlClient (./store.ts: schema and lock); its
 * scope owns the flusher fibers.
 */
export const make: Effect.Effect<EventLogService, never, SqlClient.SqlClient | Scope.Scope> = Effect.suspend(() =>
  makeWith({ notify: false })
)

/** {@link make} with its options (a cluster runner's store notifies; a log tail reads only). */
export const makeWith = (options: Options): Effect.Effect<EventLogService, never, SqlClient.SqlClient | Scope.Scope> => Effect.gen(function*() {
  const sql = yield* SqlClient.SqlClient
  const openHandle = (sessionId: string): Effect.Effect<Handle, EventLogError> => open(sessionId, true)
  /** A handle whose generations only are read (a reader's, for reading events). */
  const openStarts = (sessionId: string): Effect.Effect<Handle, EventLogError> => open(sessionId, false)
  const open = (sessionId: string, counted: boolean): Effect.Effect<Handle, EventLogError> =>
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
      h.generation = newest.generation
      if (!counted) return h
      const [tail] = yield* sql.unsafe<{ count: string; bytes: string }>(
        `SELECT coalesce(sum(count), 0) AS count, coalesce(sum(octet_length(events)), 0) AS bytes
         FROM agentd_event_batches WHERE session_id = $1 AND generation = $2`,
        [h.key, newest.generation]
      )
      const count = Number(tail?.count ?? 0)
      h.generation = newest.generation
      h.count = count
      h.bytes = generationBytes(newest.generation, count, Number(tail?.bytes ?? 0))
      h.last = count > 0 ? Option.some(Cursor.make(newest.generation, count - 1)) : startOf(newest)
      h.next = Cursor.make(newest.generation, count)
      return h
    }).pipe(Effect.catchTag("SqlError", (e) => Effect.fail(sqlFail(sessionId, "opening the session's log failed")(e))))

  /** A run of consecutive appends of one session and generation: one row. */
  interface BatchInsert {
    readonly key: string
    readonly generation: number
    readonly ops: ReadonlyArray<AppendQueue.AppendOp>
  }

  /**
   * Writes runs of appends in one statement, a row each: the events' texts one after the other,
   * and their lengths (a text holds any character, so no separator could be trusted).
   */
  const insertBatches = (runs: ReadonlyArray<BatchInsert>) => {
    const keys: Array<string> = []
    const generations: Array<number> = []
    const firsts: Array<number> = []
    const counts: Array<number> = []
    const lengths: Array<string | null> = []
    const events: Array<string> = []
    for (const run of runs) {
      keys.push(run.key)
      generations.push(run.generation)
      firsts.push(run.ops[0]!.cursor.sequence)
      counts.push(run.ops.length)
      let text = ""
      let lengthList = ""
      for (const op of run.ops) {
        const json = textOf(op.json)
        text += json
        lengthList += lengthList === "" ? String(json.length) : `,${json.length}`
      }
      lengths.push(run.ops.length === 1 ? null : lengthList)
      events.push(text)
    }
    // One session (the usual flush): plain parameters, nothing for the driver to quote.
    if (runs.length === 1) {
      const insert = `INSERT INTO agentd_event_batches (session_id, generation, first_sequence, count, lengths, events)
         VALUES ($1, $2, $3, $4, string_to_array($5, ',')::integer[], $6)`
      return sql.unsafe(
        options.notify ? `WITH i AS (${insert} RETURNING session_id) ${NOTIFY_SELECT}` : insert,
        [keys[0]!, generations[0]!, firsts[0]!, counts[0]!, lengths[0]!, events[0]!]
      )
    }
    const insert = `INSERT INTO agentd_event_batches (session_id, generation, first_sequence, count, lengths, events)
       SELECT k, g, f, c, string_to_array(l, ',')::integer[], e
       FROM unnest($1::text[], $2::integer[], $3::integer[], $4::integer[], $5::text[], $6::text[]) AS t(k, g, f, c, l, e)`
    return sql.unsafe(
      options.notify ? `WITH i AS (${insert} RETURNING session_id) ${NOTIFY_SELECT}` : insert,
      [keys, generations, firsts, counts, lengths, events]
    )
  }

  /**
   * The notification of each session a statement inserted, in that statement: one statement is
   * one transaction, and PostgreSQL delivers a notification at its transaction's commit.
   */
  const NOTIFY_SELECT = `SELECT pg_notify('${NOTIFY_CHANNEL}', k) FROM (SELECT DISTINCT session_id AS k FROM i) AS n`

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
        return appends.length === 0 ? Effect.void : insertBatches([{ key: h.key, generation, ops: appends }])
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
      // In the flush's transaction (delivered at its commit), for a generation started too.
      if (options.notify) yield* sql`SELECT pg_notify(${NOTIFY_CHANNEL}, ${h.key})`
    })

  /**
   * Appends only, to sessions already written: one INSERT for every session of the batch (one
   * statement is its own transaction), so a flush costs one round trip and one WAL flush however
   * many sessions it carries.
   */
  const insertAll = (batch: Batch) => {
    const runs: Array<BatchInsert> = []
    for (const [h, ops] of batch) {
      // One generation per session here (no generation starts in this flush), but say so.
      let run: Array<AppendQueue.AppendOp> = []
      for (const op of ops) {
        const append = op as AppendQueue.AppendOp
        if (run.length > 0 && run[0]!.cursor.generation !== append.cursor.generation) {
          runs.push({ key: h.key, generation: run[0]!.cursor.generation, ops: run })
          run = []
        }
        run.push(append)
      }
      if (run.length > 0) runs.push({ key: h.key, generation: run[0]!.cursor.generation, ops: run })
    }
    return insertBatches(runs)
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
  const readOnly = options.readOnly === true
  /** The handle for status reads: the writer's, kept; a reader's, read again each time. */
  const handleFor = readOnly ? openHandle : queue.handleFor
  /** The handle for event reads (they need its generations only; a reader counts nothing). */
  const startsFor = readOnly ? openStarts : queue.handleFor
  const readOnlyWrite = Effect.dieMessage("a read-only event log was written")
  const { append, appendAll, startGeneration } = readOnly
    ? { append: () => readOnlyWrite, appendAll: () => readOnlyWrite, startGeneration: () => readOnlyWrite }
    : queue
  const { forget } = queue

  const statusOf = (h: Handle): EventLogStatus => ({
    generation: h.generation,
    lastCursor: h.last,
    generations: h.starts.size === 0 ? [h.generation] : segmentsOf(h),
    generationEvents: h.count,
    generationBytes: h.bytes
  })

  const notRetained = (sessionId: string, generation: number) =>
    fail("GenerationNotFound", sessionId, `generation ${generation} is not retained`)

  /**
   * Committed batch rows holding an event strictly after (generation, sequence), each with its
   * generation's start (the first may hold events before it too).
   */
  const page = (h: Handle, generation: number, sequence: number, onlyGeneration?: number) =>
    sql.unsafe<BatchRow>(
      `SELECT e.generation, e.first_sequence, e.count, e.lengths, e.events, g.after_generation, g.after_sequence
       FROM agentd_event_batches e JOIN agentd_generations g ON g.session_id = e.session_id AND g.generation = e.generation
       WHERE e.session_id = $1 AND e.generation >= $2 AND (e.generation > $2 OR e.first_sequence + e.count > $3 + 1)
       ${onlyGeneration === undefined ? "" : "AND e.generation = $5"}
       ORDER BY e.generation, e.first_sequence LIMIT $4`,
      onlyGeneration === undefined ? [h.key, generation, sequence, PAGE] : [h.key, generation, sequence, PAGE, onlyGeneration]
    ).pipe(Effect.mapError(sqlFail(h.sessionId, "reading the event log failed")))

  const read = (sessionId: string, after?: Cursor.Cursor): Stream.Stream<EventRecord, EventLogError> =>
    Stream.unwrap(Effect.map(startsFor(sessionId), (h) => {
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
            for (const batch of rows) {
              // A row may begin before the cursor read after: its events up to it are skipped.
              const prev = previous
              const events = eventsOf(batch, sessionId, prev !== undefined && prev.generation === batch.generation ? prev.sequence + 1 : 0)
              if (events instanceof EventLogError) return Effect.fail(Option.some(events))
              for (const row of events) {
                const record = check(row)
                if (record instanceof EventLogError) return Effect.fail(Option.some(record))
                out.push(record)
              }
            }
            return Effect.succeed(Chunk.unsafeFromArray(out))
          })
        )
      })
      return Stream.repeatEffectChunkOption(pull)
    })).pipe(Stream.withSpan("EventLog.read"))

  const readGeneration = (sessionId: string, generation: number): Stream.Stream<EventRecord, EventLogError> =>
    Stream.unwrap(Effect.map(startsFor(sessionId), (h) => {
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
            for (const batch of rows) {
              const events = eventsOf(batch, sessionId, next)
              if (events instanceof EventLogError) return Effect.fail(Option.some(events))
              for (const row of events) {
                const record = toRecord(row, sessionId)
                if (record instanceof EventLogError) return Effect.fail(Option.some(record))
                if (row.sequence !== next) {
                  return Effect.fail(Option.some(fail("Corrupt", sessionId, `event ${generation}:${next} is missing`)))
                }
                next++
                out.push(record)
              }
            }
            return Effect.succeed(Chunk.unsafeFromArray(out))
          })
        )
      })
      return Stream.repeatEffectChunkOption(pull)
    })).pipe(Stream.withSpan("EventLog.readGeneration"))

  const prune = Effect.fn("EventLog.prune")(function*(sessionId: string, keepFromGeneration: number) {
    if (readOnly) return yield* readOnlyWrite
    const h = yield* handleFor(sessionId)
    return yield* writeLock.withPermits(1)(Effect.gen(function*() {
      const keep = Math.min(keepFromGeneration, h.generation)
      const doomed = segmentsOf(h).filter((g) => g < keep)
      if (doomed.length === 0) return []
      // Readers look generations up as they go: forget them before deleting.
      for (const g of doomed) h.starts.delete(g)
      yield* sql.withTransaction(Effect.zipRight(
        sql`DELETE FROM agentd_event_batches WHERE session_id = ${h.key} AND generation < ${keep}`,
        sql`DELETE FROM agentd_generations WHERE session_id = ${h.key} AND generation < ${keep}`
      )).pipe(Effect.mapError(sqlFail(sessionId, "pruning the event log failed")))
      return doomed
    }))
  })

  const remove = Effect.fn("EventLog.remove")(
    function*(sessionId: string, options?: { readonly archiveTo?: string }) {
      if (readOnly) return yield* readOnlyWrite
      const h = yield* handleFor(sessionId)
      yield* writeLock.withPermits(1)(Effect.gen(function*() {
        yield* queue.kill(h, fail("Closed", sessionId, "the session's event log was removed"))
        // Archived: the rows move under another key (`:` is never in an escaped id), nothing is deleted.
        const move = (table: string) =>
          options?.archiveTo !== undefined
            ? sql.unsafe(`UPDATE ${table} SET session_id = $2 WHERE session_id = $1`, [h.key, `archive:${options.archiveTo}`])
            : sql.unsafe(`DELETE FROM ${table} WHERE session_id = $1`, [h.key])
        yield* sql.withTransaction(Effect.zipRight(move("agentd_event_batches"), move("agentd_generations"))).pipe(
          Effect.mapError(sqlFail(sessionId, "removing the event log failed"))
        )
      }))
    }
  )

  // The database keeps every row whole (a transaction commits all of a batch or none of it): no repair.
  return makeService(handleFor, statusOf, (_, h, generation) => Effect.succeed(h.starts.get(generation) ?? Option.none()), {
    append, appendAll, read, readGeneration, startGeneration, prune, remove, forget
  })
})

