/**
 * The PostgreSQL store's connection, schema and single-writer lock, shared by its three layers
 * (event log, session store, recovery journal).
 *
 * Schema (`@effect/sql` Migrator, table `agentd_migrations`), in the connection's schema
 * (`search_path`): one store is one schema of one database.
 * - `agentd_event_batches (session_id, generation, first_sequence) -> count, lengths, events`
 *   the event log, one row per session and generation of a flush (a group commit): its `count`
 *   events from `first_sequence` on, their JSON texts exactly as logged one after the other in
 *   `events` (text, not jsonb: jsonb reorders keys), `lengths` each text's length in UTF-16
 *   code units (NULL for a row of one event). A row per event cost PostgreSQL a heap and an
 *   index entry each and made live delivery half as fast as on files (measured); migration 2
 *   moved the first schema's `agentd_events` rows here, one event each.
 * - `agentd_generations (session_id, generation) -> after_generation, after_sequence` one row
 *   per retained generation of a session's log: where the history stood when it began (a file
 *   segment's header).
 * - `agentd_sessions (active_session_id) -> meta, created_at` the session registry.
 * - `agentd_session_names (name) -> active_session_id`: who holds each name (migration 3), so
 *   that names are unique across every daemon of the store, written with the session's meta.
 * - `agentd_snapshots (active_session_id, generation) -> header, body_bytes` one row per
 *   published transcript header, as the file store's; `agentd_transcript_lines
 *   (active_session_id, epoch, line_no) -> line` the append-only transcripts: an ordinary
 *   checkpoint adds only its new lines and a header naming the first `messageCount` lines of
 *   its epoch; `agentd_snapshot_lines (active_session_id, generation, line_no) -> line` the
 *   messages of a transcript written whole (a history rewrite). Session ids are keyed escaped
 *   as the file store names their directories (PostgreSQL text cannot hold a NUL byte); an
 *   archived session's rows move under an `archive/...` key.
 * - `agentd_journal (active_session_id) -> record` the latest recovery record of each session.
 * - `agentd_holder (id = 1) -> pid, socket_path, host, started_at` who holds the store.
 *
 * Single writer: the daemon takes a session-level advisory lock on a connection it keeps for
 * its whole life. PostgreSQL releases it when that connection ends, which it does when the
 * daemon dies however it dies (SIGKILL included: the socket closes), so a restart takes it at
 * once. A second daemon finds it taken and is refused, naming the holder. The lock is checked
 * every 2 s and taken again after the server restarted (which ends every session's locks).
 */
import * as Migrator from "@effect/sql/Migrator"
import * as SqlClient from "@effect/sql/SqlClient"
import type * as SqlConnection from "@effect/sql/SqlConnection"
import type { SqlError } from "@effect/sql/SqlError"
import * as PgClient from "@effect/sql-pg/PgClient"
import * as Context from "effect/Context"
import * as Data from "effect/Data"
import * as Effect from "effect/Effect"
import * as ExecutionStrategy from "effect/ExecutionStrategy"
import * as Exit from "effect/Exit"
import * as Layer from "effect/Layer"
import * as Redacted from "effect/Redacted"
import * as Schedule from "effect/Schedule"
import * as Scope from "effect/Scope"
import * as os from "node:os"
import { isRunning } from "../liveness.js"
import { nameOfMetaText } from "./sessionStore.js"

/** The store could not be reached or its schema could not be made. */
export class PostgresStoreError extends Data.TaggedError("PostgresStoreError")<{
  readonly url: string
  readonly detail: string
  readonly cause?: unknown
}> {
  override get message(): string {
    return `PostgreSQL store ${this.url}: ${this.detail}`
  }
}

/** Another daemon holds the store (its advisory lock). */
export class PostgresStoreLocked extends Data.TaggedError("PostgresStoreLocked")<{
  readonly url: string
  readonly pid: number | undefined
  readonly socketPath: string | undefined
  readonly host: string | undefined
  /** How many cluster runners hold the store together (docs/cluster.md), when they are what holds it. */
  readonly runners?: number | undefined
}> {
  override get message(): string {
    if (this.runners !== undefined && this.runners > 0) {
      return `${this.runners} cluster runner${this.runners === 1 ? "" : "s"} (serve --cluster) hold the store ${this.url}: a single daemon cannot share it`
    }
    return this.pid === undefined
      ? `another daemon (pid unknown, socket unknown: it left no holder record) holds the store ${this.url}`
      : `another daemon (pid ${this.pid}${this.host === undefined || this.host === os.hostname() ? "" : ` on ${this.host}`}, socket ${this.socketPath}) holds the store ${this.url}`
  }
}

/** The URL without its password, for messages and logs. */
export const redactUrl = (url: string): string => {
  try {
    const parsed = new URL(url)
    if (parsed.password !== "") parsed.password = "***"
    return parsed.toString()
  } catch {
    return "<invalid PostgreSQL URL>"
  }
}

export { isPostgresUrl } from "./url.js"

// ---------------------------------------------------------------------------------------------
// Schema

const migrations = Migrator.fromRecord({
  "1_initial": Effect.gen(function*() {
    const sql = yield* SqlClient.SqlClient
    yield* sql`CREATE TABLE agentd_events (
      session_id text NOT NULL,
      generation integer NOT NULL,
      sequence integer NOT NULL,
      event text NOT NULL,
      PRIMARY KEY (session_id, generation, sequence)
    )`
    yield* sql`CREATE TABLE agentd_generations (
      session_id text NOT NULL,
      generation integer NOT NULL,
      after_generation integer,
      after_sequence integer,
      PRIMARY KEY (session_id, generation)
    )`
    yield* sql`CREATE TABLE agentd_sessions (
      active_session_id text PRIMARY KEY,
      meta text NOT NULL,
      created_at text NOT NULL
    )`
    yield* sql`CREATE TABLE agentd_snapshots (
      active_session_id text NOT NULL,
      generation integer NOT NULL,
      header text NOT NULL,
      body_bytes bigint NOT NULL,
      PRIMARY KEY (active_session_id, generation)
    )`
    yield* sql`CREATE TABLE agentd_snapshot_lines (
      active_session_id text NOT NULL,
      generation integer NOT NULL,
      line_no integer NOT NULL,
      line text NOT NULL,
      PRIMARY KEY (active_session_id, generation, line_no)
    )`
    yield* sql`CREATE TABLE agentd_transcript_lines (
      active_session_id text NOT NULL,
      epoch integer NOT NULL,
      line_no integer NOT NULL,
      line text NOT NULL,
      PRIMARY KEY (active_session_id, epoch, line_no)
    )`
    yield* sql`CREATE TABLE agentd_journal (
      active_session_id text PRIMARY KEY,
      record text NOT NULL
    )`
    yield* sql`CREATE TABLE agentd_holder (
      id integer PRIMARY KEY,
      pid integer NOT NULL,
      socket_path text NOT NULL,
      host text NOT NULL,
      started_at text NOT NULL
    )`
  }),
  "2_event_batches": Effect.gen(function*() {
    const sql = yield* SqlClient.SqlClient
    yield* sql`CREATE TABLE agentd_event_batches (
      session_id text NOT NULL,
      generation integer NOT NULL,
      first_sequence integer NOT NULL,
      count integer NOT NULL,
      lengths integer[],
      events text NOT NULL,
      PRIMARY KEY (session_id, generation, first_sequence)
    )`
    yield* sql`INSERT INTO agentd_event_batches (session_id, generation, first_sequence, count, lengths, events)
      SELECT session_id, generation, sequence, 1, NULL, event FROM agentd_events`
    yield* sql`DROP TABLE agentd_events`
  }),
  // Names unique among live sessions across every daemon of the store (the runners of a cluster
  // each know only their own sessions): one row per claimed name. Sessions of an older store that
  // share a name keep it; the oldest holds the claim.
  "3_session_names": Effect.gen(function*() {
    const sql = yield* SqlClient.SqlClient
    yield* sql`CREATE TABLE agentd_session_names (
      name text PRIMARY KEY,
      active_session_id text NOT NULL UNIQUE
    )`
    const rows = yield* sql<{ active_session_id: string; meta: string }>`SELECT active_session_id, meta FROM agentd_sessions
      WHERE active_session_id NOT LIKE 'archive/%' ORDER BY created_at, active_session_id`
    for (const row of rows) {
      const name = nameOfMetaText(row.meta)
      if (name === undefined) continue
      yield* sql`INSERT INTO agentd_session_names (name, active_session_id) VALUES (${name}, ${row.active_session_id})
        ON CONFLICT DO NOTHING`
    }
  })
})


const migrate = Migrator.make({})({ loader: migrations, table: "agentd_migrations" })

/**
 * PostgreSQL's answers to a `CREATE TABLE IF NOT EXISTS` (or index, or type) that raced the same
 * statement of another session: the catalog's unique index (23505), or the object made meanwhile
 * (42P07, 42710). Daemons that start together on a new store (a cluster's runners) meet them.
 */
const SCHEMA_RACE_CODES = new Set(["23505", "42P07", "42710"])

/** Whether `error` (or a cause under it) is a lost race to create the same schema object. */
export const isSchemaRace = (error: unknown): boolean => {
  for (let e = error, depth = 0; typeof e === "object" && e !== null && depth < 4; e = (e as { cause?: unknown }).cause, depth++) {
    const code = (e as { code?: unknown }).code
    if (typeof code === "string" && SCHEMA_RACE_CODES.has(code)) return true
  }
  return false
}

/**
 * Setting up a schema again after losing such a race: the other session's objects exist by then,
 * and `IF NOT EXISTS` passes. A few tries, 100 ms apart; any other failure is not retried.
 */
export const retrySchemaRace = Schedule.intersect(Schedule.spaced("100 millis"), Schedule.recurs(10)).pipe(
  Schedule.whileInput(isSchemaRace)
)

/** A lost schema race that a layer raised as a defect, carried as a failure while it is retried. */
class SchemaRaceDefect {
  constructor(readonly cause: unknown) {}
}

/**
 * `layer`, built again after a lost schema race ({@link retrySchemaRace}), whether the race
 * reached it as a failure or as a defect (@effect/cluster's storages run their migrations under
 * `orDie`).
 */
export const retryingSchemaRace = <A, E, R>(layer: Layer.Layer<A, E, R>): Layer.Layer<A, E, R> =>
  Layer.scopedContext(
    Layer.build(layer).pipe(
      Effect.catchAllDefect((defect) => isSchemaRace(defect) ? Effect.fail(new SchemaRaceDefect(defect)) : Effect.die(defect)),
      Effect.retry(retrySchemaRace),
      Effect.catchIf((e): e is SchemaRaceDefect => e instanceof SchemaRaceDefect, (e) => Effect.die(e.cause))
    )
  )

// ---------------------------------------------------------------------------------------------
// The store

/** The store this daemon holds: its URL (redacted) and the lock's connection. */
export class PostgresStore extends Context.Tag("agentd/PostgresStore")<PostgresStore, {
  readonly url: string
  /**
   * Held in share mode by the runners of a cluster: then every group commit of the event log
   * also notifies the other runners (their log tails: internal/cluster/logTail.ts).
   */
  readonly shared: boolean
}>() {}

/** Options of {@link layer}. */
export interface Options {
  /** `postgres://user:password@host:port/database` (`?host=/dir` for a Unix socket dir). */
  readonly url: string
  /** What a refused daemon is told about this one (its socket). */
  readonly socketPath?: string | undefined
  /** Connections in the pool besides the lock's (default 8). */
  readonly maxConnections?: number | undefined
  /**
   * `exclusive` (the default): one daemon holds the store. `shared`: the runners of a cluster
   * (docs/cluster.md) hold it together; a single daemon and a runner still exclude each other.
   */
  readonly lock?: "exclusive" | "shared" | undefined
}

/** The advisory lock's key: one per schema, so two stores in one database do not collide. */
const LOCK_KEY = "agentd-store"

/**
 * Takes the store's advisory lock on a connection kept for the scope's life, then says who holds
 * it. Fails {@link PostgresStoreLocked} naming the holder when another session has it.
 */
const lock = (url: string, socketPath: string, waitForDeadHolder = true, shared = false) =>
  Effect.gen(function*() {
    const sql = yield* SqlClient.SqlClient
    const connection = yield* sql.reserve
    for (let attempt = 1;; attempt++) {
      const rows = yield* connection.executeValues(
        shared
          ? "SELECT pg_try_advisory_lock_shared(hashtext($1 || current_schema()))"
          : "SELECT pg_try_advisory_lock(hashtext($1 || current_schema()))",
        [LOCK_KEY]
      )
      if (rows[0]?.[0] === true) break
      if (!shared) {
        // Runners hold the key in share mode (bigint keys show as classid, the high half, and objid).
        const runners = yield* connection.executeValues(
          `SELECT count(*)::int FROM pg_locks WHERE locktype = 'advisory' AND mode = 'ShareLock' AND granted
             AND objsubid = 1 AND ((classid::bigint << 32) | objid::bigint) = hashtext($1 || current_schema())::bigint`,
          [LOCK_KEY]
        )
        const count = Number(runners[0]?.[0] ?? 0)
        if (count > 0) return yield* new PostgresStoreLocked({ url, pid: undefined, socketPath: undefined, host: undefined, runners: count })
      }
      const holder = yield* sql<{ pid: number; socket_path: string; host: string }>`
        SELECT pid, socket_path, host FROM agentd_holder WHERE id = 1`
      const h = holder[0]
      // A holder SIGKILLed a moment ago still holds the lock until its server process sees the
      // connection closed (milliseconds): when the holder named is a dead process of this
      // machine, wait for that, for up to 5 s; a live holder refuses at once.
      const dead = h !== undefined && h.host === os.hostname() && !isRunning(h.pid)
      if (!dead || !waitForDeadHolder || attempt >= 50) {
        return yield* new PostgresStoreLocked({ url, pid: h?.pid, socketPath: h?.socket_path, host: h?.host })
      }
      yield* Effect.sleep("100 millis")
    }
    // The holder record names the one daemon that holds the store; runners holding it together
    // leave it as it is (docs/cluster.md: `status` lists them).
    if (shared) return connection
    yield* sql`INSERT INTO agentd_holder (id, pid, socket_path, host, started_at)
      VALUES (1, ${process.pid}, ${socketPath}, ${os.hostname()}, ${new Date().toISOString()})
      ON CONFLICT (id) DO UPDATE SET pid = EXCLUDED.pid, socket_path = EXCLUDED.socket_path,
        host = EXCLUDED.host, started_at = EXCLUDED.started_at`
    return connection
  })

/** How often the lock's connection is checked. */
const LOCK_CHECK = "2 seconds"

/**
 * The lock taken in a scope of its own, a child of `parent`: closing it gives the lock's
 * connection back to the pool. Closed at once when the lock is not taken (its reserved
 * connection with it).
 */
const lockIn = (parent: Scope.Scope, url: string, socketPath: string, waitForDeadHolder: boolean, shared: boolean) =>
  Effect.gen(function*() {
    const held = yield* Scope.fork(parent, ExecutionStrategy.sequential)
    const connection = yield* Scope.extend(lock(url, socketPath, waitForDeadHolder, shared), held).pipe(
      Effect.onError((cause) => Scope.close(held, Exit.failCause(cause)))
    )
    return { connection, held }
  })

/**
 * Keeps the lock: PostgreSQL restarted (or the connection cut) ends the session holding it, and
 * with it the lock. Checked every {@link LOCK_CHECK}; once lost it is taken again on a new
 * connection as soon as the server answers, and the lost one is given back to the pool (which
 * drops it). Held until the store closed, each lost connection kept a place of the pool: a
 * runner whose link to the database went down now and then (a partition, the server restarted)
 * had one connection fewer each time, and with none left every read and write of the store
 * would wait for ever. Should another daemon have taken it meanwhile, that is logged at ERROR,
 * naming it, and retried: two writers on one store is a broken promise to be seen, not a reason
 * to stop serving in the middle of turns.
 */
const keepLock = (
  url: string,
  socketPath: string,
  first: { readonly connection: SqlConnection.Connection; readonly held: Scope.CloseableScope },
  shared: boolean
) =>
  Effect.gen(function*() {
    const scope = yield* Effect.scope
    let { connection, held } = first
    let lost = false
    const check = Effect.gen(function*() {
      if (!lost) {
        const alive = yield* Effect.isSuccess(connection.executeValues("SELECT 1", []))
        if (alive) return
        lost = true
        yield* Effect.logWarning(`PostgreSQL store ${url}: the connection holding the store's lock is gone; taking the lock again`)
        yield* Scope.close(held, Exit.void)
      }
      const again = yield* Effect.either(lockIn(scope, url, socketPath, false, shared))
      if (again._tag === "Right") {
        connection = again.right.connection
        held = again.right.held
        lost = false
        yield* Effect.logInfo(`PostgreSQL store ${url}: the store's lock is held again`)
      } else if (again.left._tag === "PostgresStoreLocked") {
        yield* Effect.logError(`PostgreSQL store ${url}: lost the store's lock: ${again.left.message}`)
      }
    })
    yield* Effect.forkScoped(Effect.forever(Effect.zipRight(Effect.sleep(LOCK_CHECK), check)))
  })


const toStoreError = (url: string, what: string) => (cause: SqlError | Migrator.MigrationError) =>
  new PostgresStoreError({ url, detail: `${what}: ${cause.message}`, cause })

/**
 * Connects (a pool), migrates the schema and takes the single-writer lock, for the scope's life.
 * The SqlClient it gives is what the store's layers run on.
 */
export const layer = (options: Options): Layer.Layer<
  PostgresStore | SqlClient.SqlClient,
  PostgresStoreError | PostgresStoreLocked
> => {
  const url = redactUrl(options.url)
  const client = PgClient.layer({
    url: Redacted.make(options.url),
    // The lock's connection is one of them, held for good.
    maxConnections: (options.maxConnections ?? 8) + 1,
    applicationName: "agentd"
  }).pipe(Layer.mapError(toStoreError(url, "cannot connect")))
  const store = Layer.scoped(
    PostgresStore,
    Effect.gen(function*() {
      yield* migrate.pipe(Effect.retry(retrySchemaRace), Effect.mapError(toStoreError(url, "schema migration failed")))
      const shared = options.lock === "shared"
      const first = yield* lockIn(yield* Effect.scope, url, options.socketPath ?? "", true, shared).pipe(
        Effect.catchTag("SqlError", toStoreError(url, "cannot take the store's lock"))
      )
      yield* keepLock(url, options.socketPath ?? "", first, shared)
      return { url, shared }
    })
  )
  return store.pipe(Layer.provideMerge(client))
}
