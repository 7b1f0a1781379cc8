/**
 * The recovery journal in a file (the public module, ../../RecoveryJournal.ts, holds its
 * interface): `<stateDir>/recovery.jsonl`, one JSON record per line. `record` returns only once
 * the line is fsynced; a crash can tear at most the line being written, and readers skip such
 * lines (and any other invalid one) and never fail on content. The file only grows while some
 * session is busy: once every session has been idle for `compactDelayMs` it is compacted to one
 * line per session through a temp file, fsync and rename, so a reader sees either the old journal
 * or the compacted one.
 */
import * as nodePath from "node:path"
import * as Effect from "effect/Effect"
import * as FiberHandle from "effect/FiberHandle"
import * as Either from "effect/Either"
import * as Option from "effect/Option"
import * as ParseResult from "effect/ParseResult"
import type * as Scope from "effect/Scope"
import { type JournalRecord, type Options, RecoveryJournalError, type RecoveryJournalService } from "../../RecoveryJournal.js"
import * as Fsx from "../fileIo.js"
import { type Backend, decodeRecord, makeService } from "./service.js"

/** How long every session stays idle before the journal is compacted (see `Options.compactDelayMs`). */
export const DEFAULT_COMPACT_DELAY_MS = 200


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
    const decoded = decodeRecord(line)
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
    yield* Fsx.chmod(path, Fsx.FILE_MODE).pipe(
      Effect.catchIf(Fsx.isNotFound, () => Effect.void),
      Effect.mapError(fail("chmod"))
    )

    let handle: Fsx.FileHandle | undefined
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

    const rewrite = (records: ReadonlyArray<JournalRecord>) =>
      Effect.gen(function*() {
        // The rename replaces the inode: the old append handle would write into the void.
        yield* closeHandle
        const text = records.map((r) => JSON.stringify(r) + "\n").join("")
        yield* Fsx.writeFileAtomic(path, text).pipe(Effect.mapError(fail("compact")))
        needsNewline = false
      })

    /** Appends lines and fsyncs once. */
    const appendLines = (records: ReadonlyArray<JournalRecord>) =>
      Effect.gen(function*() {
        const lines = records.map((record) => JSON.stringify(record) + "\n").join("")
        const target = yield* openHandle
        yield* Fsx.appendDurable(target, path, (needsNewline ? "\n" : "") + lines).pipe(
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
      })

    const backend: Backend = {
      append: (record) => appendLines([record]),
      appendAll: appendLines,
      compact: rewrite,
      remove: (_, records) => rewrite(records)
    }

    // A writer killed mid-compaction leaves its temp file behind; this process is the only writer.
    const prefix = `.${nodePath.basename(path)}.`
    const leftovers = yield* Fsx.readdir(dir).pipe(
      Effect.map((names) => names.filter((name) => name.startsWith(prefix) && Fsx.isTempName(name))),
      Effect.orElseSucceed((): Array<string> => [])
    )
    yield* Effect.forEach(leftovers, (name) => Fsx.unlinkQuietly(nodePath.join(dir, name)), { discard: true })

    let lines = parsed.lines
    if (parsed.skipped.length > 0) {
      // Repair now rather than at the next compaction: a torn line left in the middle of the file
      // by the append that follows it would read as garbage to everyone after us.
      yield* rewrite(Array.from(parsed.latest.values())).pipe(
        Effect.tap(() =>
          Effect.sync(() => {
            lines = parsed.latest.size
          })
        ),
        Effect.catchAll((error) => Effect.logWarning(`recovery journal repair failed: ${error.message}`))
      )
    }

    // A compaction due at an idle moment waits for the moment to last: a prompt that follows a
    // turn at once would otherwise wait for it, and its record reopen the file.
    const delayMs = options.compactDelayMs ?? DEFAULT_COMPACT_DELAY_MS
    const pending = yield* FiberHandle.make<void, never>()
    const later = (compaction: Effect.Effect<void>) =>
      Effect.asVoid(FiberHandle.run(pending, Effect.delay(compaction, delayMs), { onlyIfMissing: true }))
    const service = yield* makeService({ latest: parsed.latest, lines }, backend, {
      // Without a delay, the record that leaves every session idle compacts, under its own permit.
      ...(delayMs > 0 ? { later } : {}),
      ...(options.compactBusyAfter === undefined ? {} : { busyAfter: options.compactBusyAfter })
    })
    // A clean stop leaves the journal compact (one line per session), whatever the bound.
    yield* Effect.addFinalizer(() =>
      service.compact().pipe(Effect.catchAll((error) => Effect.logWarning(`recovery journal compaction failed: ${error.message}`)))
    )
    return service
  })
