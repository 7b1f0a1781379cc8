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
 * The file only grows while some session is busy: as soon as every session is idle it is
 * compacted to one line per session through a temp file, fsync and rename, so a reader sees
 * either the old journal or the compacted one, never a mix.
 */
import type { FileHandle } from "node:fs/promises"
import * as fsp from "node:fs/promises"
import * as nodePath from "node:path"
import * as Clock from "effect/Clock"
import * as Context from "effect/Context"
import * as Data from "effect/Data"
import * as Effect from "effect/Effect"
import * as Either from "effect/Either"
import * as Layer from "effect/Layer"
import * as Option from "effect/Option"
import * as ParseResult from "effect/ParseResult"
import * as Ref from "effect/Ref"
import * as Schema from "effect/Schema"
import type * as Scope from "effect/Scope"
import * as Fsx from "./internal/fsx.js"

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
   * Calls are serialized; when the record leaves every session idle the file is compacted.
   */
  readonly record: (input: JournalInput) => Effect.Effect<boolean, RecoveryJournalError>
  /** The latest record of every session, keyed by `activeSessionId`. */
  readonly latest: () => Effect.Effect<ReadonlyMap<string, JournalRecord>>
  /** The latest record of one session. */
  readonly get: (activeSessionId: string) => Effect.Effect<Option.Option<JournalRecord>>
  /** Rewrites the file to one line per session (temp file, fsync, rename, fsync dir). */
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
// Reading

const decodeLine = Schema.decodeUnknownEither(Schema.parseJson(JournalRecord))

/** The outcome of parsing a journal's text. */
interface Parsed {
  readonly latest: Map<string, JournalRecord>
  /** Non-empty lines, valid or not: more lines than sessions means compaction would shrink it. */
  readonly lines: number
  /** The file does not end with `\n`: the next append must start a new line. */
  readonly torn: boolean
  readonly skipped: ReadonlyArray<string>
}

const parse = (text: string): Parsed => {
  const latest = new Map<string, JournalRecord>()
  const skipped: Array<string> = []
  const torn = text.length > 0 && !text.endsWith("\n")
  const rows = text.split("\n")
  let lines = 0
  rows.forEach((row, index) => {
    const line = row.endsWith("\r") ? row.slice(0, -1) : row
    if (line.trim().length === 0) return
    lines++
    const decoded = decodeLine(line)
    if (Either.isRight(decoded)) {
      latest.set(decoded.right.activeSessionId, decoded.right)
    } else {
      const where = torn && index === rows.length - 1 ? `line ${index + 1} (torn last line)` : `line ${index + 1}`
      skipped.push(`${where}: ${firstLineOf(ParseResult.TreeFormatter.formatErrorSync(decoded.left))}`)
    }
  })
  return { latest, lines, torn, skipped }
}

const firstLineOf = (message: string): string => {
  const cut = message.split("\n").slice(0, 3).join(" ").replace(/\s+/g, " ")
  return cut.length > 200 ? `${cut.slice(0, 200)}...` : cut
}

/** One warning per read, however many lines were skipped. */
const warnSkipped = (path: string, parsed: Parsed): Effect.Effect<void> =>
  parsed.skipped.length === 0
    ? Effect.void
    : Effect.logWarning(
      `recovery journal ${path}: skipped ${parsed.skipped.length} invalid line(s): ` +
        parsed.skipped.slice(0, 5).join("; ") + (parsed.skipped.length > 5 ? "; ..." : "")
    )

const readParsed = (path: string): Effect.Effect<Parsed, RecoveryJournalError> =>
  Fsx.readFileIfExists(path).pipe(
    Effect.mapError((e) => new RecoveryJournalError({ operation: "read", path, cause: e.cause })),
    Effect.map(Option.match({ onNone: () => parse(""), onSome: parse })),
    Effect.tap((parsed) => warnSkipped(path, parsed))
  )

/**
 * Reads a journal without opening it for writing: for a process that only restores (a worker
 * given `AGENTD_WORKER_RECOVERY_JOURNAL`). A missing file is an empty journal; torn, garbage and
 * unknown-version lines are skipped with one warning. Fails only when the file cannot be read.
 */
export const readLatest = (path: string): Effect.Effect<ReadonlyMap<string, JournalRecord>, RecoveryJournalError> =>
  readParsed(path).pipe(
    Effect.map((parsed): ReadonlyMap<string, JournalRecord> => parsed.latest),
    Effect.withSpan("RecoveryJournal.readLatest", { attributes: { path } })
  )

// ---------------------------------------------------------------------------------------------
// The service, over a storage backend

/** Where lines go: the file, or nowhere (memory). */
interface Backend {
  readonly append: (line: string) => Effect.Effect<void, RecoveryJournalError>
  readonly rewrite: (records: ReadonlyArray<JournalRecord>) => Effect.Effect<void, RecoveryJournalError>
}

interface State {
  readonly latest: ReadonlyMap<string, JournalRecord>
  /** Lines in the file: when it exceeds the number of sessions, compaction shrinks the file. */
  readonly lines: number
}

const encodeLine = (record: JournalRecord): string => JSON.stringify(record)

const sameState = (a: JournalRecord, b: JournalInput): boolean =>
  a.busy === b.busy && a.operation === b.operation && a.sessionFile === b.sessionFile

const allIdle = (latest: ReadonlyMap<string, JournalRecord>): boolean => {
  for (const record of latest.values()) if (record.busy) return false
  return true
}

const makeService = (initial: State, backend: Backend): Effect.Effect<RecoveryJournalService> =>
  Effect.gen(function*() {
    const state = yield* Ref.make(initial)
    const semaphore = yield* Effect.makeSemaphore(1)
    // Uninterruptible inside the permit: an interrupted fs promise keeps running, and releasing
    // the permit under it would let the next append interleave with its bytes.
    const serialized = <A, E>(effect: Effect.Effect<A, E>): Effect.Effect<A, E> =>
      semaphore.withPermits(1)(Effect.uninterruptible(effect))

    const compactLocked = Effect.gen(function*() {
      const current = yield* Ref.get(state)
      yield* backend.rewrite(Array.from(current.latest.values()))
      yield* Ref.set(state, { latest: current.latest, lines: current.latest.size })
    })

    const record = Effect.fn("RecoveryJournal.record")(function*(input: JournalInput) {
      yield* Effect.annotateCurrentSpan({ activeSessionId: input.activeSessionId, operation: input.operation })
      return yield* serialized(Effect.gen(function*() {
        const current = yield* Ref.get(state)
        const previous = current.latest.get(input.activeSessionId)
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
        yield* backend.append(encodeLine(entry))
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
        yield* Ref.set(state, { latest, lines: current.lines })
        yield* compactLocked
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

// ---------------------------------------------------------------------------------------------
// File backend

/** Options of the file journal. */
export interface Options {
  /** The journal file, normally `<stateDir>/recovery.jsonl`. Its directory is created 0700. */
  readonly path: string
}

/**
 * Opens (creating if needed) the journal file and loads its latest records. The file handle is
 * closed when the scope closes.
 */
export const make = (options: Options): Effect.Effect<RecoveryJournalService, RecoveryJournalError, Scope.Scope> =>
  Effect.gen(function*() {
    const path = nodePath.resolve(options.path)
    const dir = nodePath.dirname(path)
    const fail = (operation: string) => (error: Fsx.FsError) =>
      new RecoveryJournalError({ operation, path: error.path, cause: error.cause })

    yield* Fsx.ensureDir(dir).pipe(Effect.mapError(fail("mkdir")))
    const parsed = yield* readParsed(path)
    // An existing journal may predate us or have been created under a loose umask.
    yield* Fsx.attempt("chmod", path, () => fsp.chmod(path, Fsx.FILE_MODE)).pipe(
      Effect.catchIf(Fsx.isNotFound, () => Effect.void),
      Effect.mapError(fail("chmod"))
    )

    let handle: FileHandle | undefined
    // A torn last line has no `\n`: the next append starts a new line instead of gluing onto it.
    let needsNewline = parsed.torn

    const closeHandle = Effect.suspend(() => {
      const current = handle
      handle = undefined
      return current === undefined ? Effect.void : Fsx.closeQuietly(current)
    })
    yield* Effect.addFinalizer(() => closeHandle)

    const openHandle = Effect.suspend(() =>
      handle !== undefined
        ? Effect.succeed(handle)
        : Fsx.openAppend(path).pipe(
          // The file may have just been created (or re-created by compaction's rename).
          Effect.tap(() => Fsx.fsyncDir(dir)),
          Effect.tap((opened) =>
            Effect.sync(() => {
              handle = opened
            })
          ),
          Effect.mapError(fail("open"))
        )
    )

    const backend: Backend = {
      append: (line) =>
        Effect.gen(function*() {
          const target = yield* openHandle
          yield* Fsx.appendDurable(target, path, (needsNewline ? "\n" : "") + line + "\n").pipe(
            Effect.tapError(() =>
              Effect.zipRight(
                // Part of the line may be on disk: start a fresh line and a fresh handle next time.
                Effect.sync(() => {
                  needsNewline = true
                }),
                closeHandle
              )
            ),
            Effect.mapError(fail("append"))
          )
          needsNewline = false
        }),
      rewrite: (records) =>
        Effect.gen(function*() {
          // The rename replaces the inode: the old append handle would write into the void.
          yield* closeHandle
          const text = records.map((r) => encodeLine(r) + "\n").join("")
          yield* Fsx.writeFileAtomic(path, text).pipe(Effect.mapError(fail("compact")))
          needsNewline = false
        })
    }

    // A writer killed mid-compaction leaves its temp file behind; this process is the only writer.
    const prefix = `.${nodePath.basename(path)}.`
    const leftovers = yield* Fsx.attempt("readdir", dir, () => fsp.readdir(dir)).pipe(
      Effect.map((names) => names.filter((name) => name.startsWith(prefix) && Fsx.isTempName(name))),
      Effect.orElseSucceed((): Array<string> => [])
    )
    yield* Effect.forEach(leftovers, (name) => Fsx.unlinkQuietly(nodePath.join(dir, name)), { discard: true })

    let lines = parsed.lines
    if (parsed.skipped.length > 0) {
      // Repair now rather than at the next compaction: a torn line left in the middle of the file
      // by the append that follows it would read as garbage to everyone after us.
      yield* backend.rewrite(Array.from(parsed.latest.values())).pipe(
        Effect.tap(() =>
          Effect.sync(() => {
            lines = parsed.latest.size
          })
        ),
        Effect.catchAll((error) => Effect.logWarning(`recovery journal repair failed: ${error.message}`))
      )
    }

    return yield* makeService({ latest: parsed.latest, lines }, backend)
  })

/** The journal in a file (`options.path`). */
export const layer = (options: Options): Layer.Layer<RecoveryJournal, RecoveryJournalError> =>
  Layer.scoped(RecoveryJournal, make(options))

/** A journal kept in memory only, with the same semantics (dedupe, forget); for tests. */
export const makeMemory: Effect.Effect<RecoveryJournalService> = makeService(
  { latest: new Map(), lines: 0 },
  { append: () => Effect.void, rewrite: () => Effect.void }
)

/** The in-memory journal. */
export const layerMemory: Layer.Layer<RecoveryJournal> = Layer.effect(RecoveryJournal, makeMemory)
