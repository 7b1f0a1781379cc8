/**
 * The PostgreSQL store (`agentd serve --store postgres://...`): the event log, the session store
 * (registry, transcripts, snapshot headers) and the recovery journal in one PostgreSQL schema,
 * instead of the state dir's files. The socket, the worker processes' directories and the
 * snapshot cache's spill stay in the state dir.
 *
 * ```ts
 * const storage = PostgresStore.layer({ url: "postgres://agentd@db/agentd" })
 * DaemonLive({ stateDir }, {
 *   eventLog: PostgresStore.eventLog.pipe(Layer.provide(storage)),
 *   ...
 * })
 * ```
 * or simply `DaemonLive({ stateDir, store: "postgres://..." })`.
 *
 * {@link layer} connects, brings the schema up to date (`@effect/sql` Migrator) and takes the
 * store's single-writer lock (an advisory lock held for the layer's life on a connection of its
 * own): a second daemon on the same database and schema is refused with
 * {@link PostgresStoreLocked}, naming the first one's pid and socket. The storage layers below
 * run on the SqlClient it provides.
 *
 * A separate module, so that what does not use PostgreSQL (the worker, the CLI's client
 * commands) never loads its driver.
 *
 * @since 0.1.0
 */
import type * as SqlClient from "@effect/sql/SqlClient"
import * as Effect from "effect/Effect"
import * as Layer from "effect/Layer"
import { EventLog } from "./EventLog.js"
import * as PgEventLog from "./internal/postgres/eventLog.js"
import * as PgRecoveryJournal from "./internal/postgres/recoveryJournal.js"
import * as PgSessionStore from "./internal/postgres/sessionStore.js"
import * as Store from "./internal/postgres/store.js"
import { RecoveryJournal, type RecoveryJournalError } from "./RecoveryJournal.js"
import { SessionStore } from "./SessionStore.js"

export {
  /** Connection, schema and lock of a store (what the storage layers run on). */
  layer,
  /** The store could not be reached, or its schema not made. */
  PostgresStoreError,
  /** Another daemon holds the store. */
  PostgresStoreLocked,
  /** The store this process holds. */
  PostgresStore,
  /** Whether a `--store` value names a PostgreSQL store. */
  isPostgresUrl,
  /** A store URL without its password. */
  redactUrl
} from "./internal/postgres/store.js"
export type { Options } from "./internal/postgres/store.js"

/**
 * The event log in the store: one row per session and generation of a group commit, keyed by
 * (session, generation, first sequence).
 */
export const eventLog: Layer.Layer<EventLog, never, SqlClient.SqlClient | Store.PostgresStore> = Layer.scoped(
  EventLog,
  Effect.flatMap(Store.PostgresStore, (store) => PgEventLog.makeWith({ notify: store.shared }))
)

/** The session registry, snapshot headers and append-only transcripts in the store. */
export const sessionStore: Layer.Layer<SessionStore, never, SqlClient.SqlClient | Store.PostgresStore> = Layer.effect(
  SessionStore,
  PgSessionStore.make
)

/** The recovery journal in the store: the latest record of each session, one row each. */
export const recoveryJournal: Layer.Layer<RecoveryJournal, RecoveryJournalError, SqlClient.SqlClient | Store.PostgresStore> =
  Layer.effect(RecoveryJournal, PgRecoveryJournal.make)

/** The three storage layers over one store (connection, schema and lock: {@link layer}, built once). */
export const layerStorage = (options: Store.Options): Layer.Layer<
  EventLog | SessionStore | RecoveryJournal,
  Store.PostgresStoreError | Store.PostgresStoreLocked | RecoveryJournalError
> => Layer.mergeAll(eventLog, sessionStore, recoveryJournal).pipe(Layer.provide(Store.layer(options)))
