/**
 * The recovery journal (docs/protocol.md section 6): `<stateDir>/recovery.jsonl`, one JSON record per
 * line saying, per session, whether a turn was running (`busy`), what the supervisor was doing
 * (`operation`) and which transcript file restores it (`sessionFile`).
 *
 * After a crash (of a worker or of the daemon) the journal answers "which sessions were busy and
 * from which file do they come back". It is therefore written before the state it describes is
 * relied upon: `record` returns only once the line is fsynced. A crash can tear at most the line
 * being written; readers skip such lines (and any other invalid one) and never fail on content.
 *
 * The file only grows while some session is busy: once every session has been idle for a moment
 * (`Options.compactDelayMs`) it is compacted to one line per session through a temp file, fsync
 * and rename, so a reader sees either the old journal or the compacted one, never a mix. Closing
 * the journal (a clean stop) compacts it too.
 *
 * This module holds the interface, the errors and the layers; the implementations live under
 * internal/recoveryJournal/ (one service over a backend: file, memory) and internal/postgres/.
 */
import * as Context from "effect/Context"
import * as Data from "effect/Data"
import * as Effect from "effect/Effect"
import * as Layer from "effect/Layer"
import type * as Option from "effect/Option"
import * as Schema from "effect/Schema"
import type * as Scope from "effect/Scope"
import * as FileJournal from "./internal/recoveryJournal/file.js"
import * as JournalService from "./internal/recoveryJournal/service.js"
/** One journal line. `version` is checked on read: records of an unknown version are skipped. */
export const JournalRecord = Schema.Struct({
  version: Schema.Literal(1),
  activeSessionId: Schema.String,
  sessionId: Schema.String,
  busy: Schema.Boolean,
  operation: Schema.String,
  sessionFile: Schema.optional(Schema.String),
  recordedAt: Schema.String.pipe(
    Schema.filter((s) => !Number.isNaN(Date.parse(s)) || "recordedAt must be an ISO 8601 date")
  )
})

/** One journal line, decoded. */
export type JournalRecord = typeof JournalRecord.Type

/** What a caller records; `version` and `recordedAt` are filled in by the journal. */
export interface JournalInput {
  readonly activeSessionId: string
  readonly sessionId: string
  readonly busy: boolean
  readonly operation: string
  readonly sessionFile?: string | undefined
}

/** The journal file could not be read or written. */
export class RecoveryJournalError extends Data.TaggedError("RecoveryJournalError")<{
  readonly operation: string
  readonly path: string
  readonly cause: unknown
}> {
  override get message(): string {
    const detail = this.cause instanceof Error ? this.cause.message : String(this.cause)
    return `recovery journal: ${this.operation} ${this.path} failed: ${detail}`
  }
}

/** The recovery journal service. */
export interface RecoveryJournalService {
  /**
   * Appends a record for `input.activeSessionId` and fsyncs it. Returns `false` without writing
   * when the session's latest record already has the same `busy`, `operation` and `sessionFile`.
   * Calls are serialized; a record that leaves every session idle has the file compacted (see
   * `Options.compactDelayMs`).
   */
  readonly record: (input: JournalInput) => Effect.Effect<boolean, RecoveryJournalError>
  /** The latest record of every session, keyed by `activeSessionId`. */
  readonly latest: () => Effect.Effect<ReadonlyMap<string, JournalRecord>>
  /** The latest record of one session. */
  readonly get: (activeSessionId: string) => Effect.Effect<Option.Option<JournalRecord>>
  /** Rewrites the file to one line per session (temp file, fsync, rename, fsync dir), unless it has that already. */
  readonly compact: () => Effect.Effect<void, RecoveryJournalError>
  /**
   * Drops a session (killed or archived) from the journal. The file is compacted at once so that
   * a reader after a restart does not see the session again; if that write fails the session is
   * still gone from `latest()` and leaves the file at the next compaction.
   */
  readonly forget: (activeSessionId: string) => Effect.Effect<void, RecoveryJournalError>
}

/** The recovery journal: a file in production, memory in tests. */
export class RecoveryJournal extends Context.Tag("agentd/RecoveryJournal")<RecoveryJournal, RecoveryJournalService>() {}

// ---------------------------------------------------------------------------------------------
// Layers

/**
 * Reads a journal without opening it for writing: for a process that only restores. A missing
 * file is an empty journal; torn, garbage and unknown-version lines are skipped with one
 * warning. Fails only when the file cannot be read.
 */
export const readLatest = (path: string): Effect.Effect<ReadonlyMap<string, JournalRecord>, RecoveryJournalError> =>
  FileJournal.readLatest(path)

/** Options of the file journal. */
export interface Options {
  /** The journal file, normally `<stateDir>/recovery.jsonl`. Its directory is created 0700. */
  readonly path: string
  /**
   * How long every session must stay idle before the file is compacted, in ms (default 200; 0:
   * at once, inside the record that left them idle). A compaction is a temp file, two fsyncs and a
   * rename, and the next record reopens the file and fsyncs its directory: done at once, a lone
   * session's every turn paid it (its idle record 4.7 ms instead of 0.75, the next prompt's busy
   * record 2.6 ms instead of 0.7), and a prompt sent right after a turn waited behind it.
   */
  readonly compactDelayMs?: number
  /**
   * Lines more than there are sessions past which the file is compacted at once even though some
   * session is busy (default 10,000): sessions that are never idle together.
   */
  readonly compactBusyAfter?: number
}

/**
 * Opens (creating if needed) the journal file and loads its latest records. The file handle is
 * closed when the scope closes.
 */
export const make = (options: Options): Effect.Effect<RecoveryJournalService, RecoveryJournalError, Scope.Scope> =>
  FileJournal.make(options)

/** The journal in a file (`options.path`). */
export const layer = (options: Options): Layer.Layer<RecoveryJournal, RecoveryJournalError> =>
  Layer.scoped(RecoveryJournal, make(options))

/** A journal kept in memory only, with the same semantics (dedupe, forget); for tests. */
export const makeMemory: Effect.Effect<RecoveryJournalService> = Effect.suspend(() =>
  JournalService.makeService(
    { latest: new Map(), lines: 0 },
    { append: () => Effect.void, compact: () => Effect.void, remove: () => Effect.void }
  )
)

/** The in-memory journal. */
export const layerMemory: Layer.Layer<RecoveryJournal> = Layer.effect(RecoveryJournal, makeMemory)
