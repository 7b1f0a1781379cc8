/**
 * Session metadata and transcript (snapshot) files on disk.
 *
 * Layout under `root` (normally the state dir), every directory 0700 and every file 0600:
 * ```
 * sessions/<sanitized id>/meta.json                 SessionMeta, replaced atomically
 * sessions/<sanitized id>/snapshots/<g>.jsonl       transcript of generation g (its header, or whole)
 * sessions/<sanitized id>/transcripts/<e>.jsonl     append-only messages shared by generations e, e+1, ...
 * archive/<sanitized id>-<timestamp>/               a killed session, moved there whole
 * ```
 * A generation's file starts with a header line `{"type":"snapshot_header",snapshotId,
 * generation,cursor?,messageCount,transcript?,rewrittenAt?}`. Written whole
 * ({@link SessionStoreService.writeSnapshot}, a history rewrite) the messages follow it, one
 * (opaque JSON) per line. Written as an extension of the previous generation
 * ({@link SessionStoreService.appendSnapshot}, every ordinary checkpoint) the file is the header
 * alone and `transcript: {epoch, bytes}` says that the messages are the first `bytes` bytes of
 * `transcripts/<epoch>.jsonl`: a checkpoint appends only the new messages there, so it costs
 * what changed, not the size of the transcript. Bytes below a published length never change.
 *
 * Every header is written to a temp file, fsynced and renamed (after the messages it names are
 * synced), so a file with a final name is always complete: the recovery journal may name it as
 * `sessionFile` and a restoring worker may trust it. Transcripts can be 100 MB, so writing and
 * reading are streamed and never hold a whole file in memory. Pruning a generation removes its
 * file, and an append-only transcript once no retained generation reads it.
 *
 * The paths are StateLayout's. Session ids come from the wire: they are turned into a single
 * path segment by {@link StateLayout.safeSegment} (injective, so ids never collide, and `..`/`/`
 * cannot escape `root`).
 * `env` and `launchEnv` are not part of {@link SessionMeta} and are never written.
 */
import * as fs from "node:fs"
import * as fsp from "node:fs/promises"
import * as nodePath from "node:path"
import * as Chunk from "effect/Chunk"
import * as Clock from "effect/Clock"
import * as Context from "effect/Context"
import * as Data from "effect/Data"
import * as Effect from "effect/Effect"
import * as Either from "effect/Either"
import * as Layer from "effect/Layer"
import * as Option from "effect/Option"
import * as ParseResult from "effect/ParseResult"
import * as Predicate from "effect/Predicate"
import * as Ref from "effect/Ref"
import * as Schema from "effect/Schema"
import * as Stream from "effect/Stream"
import { Cursor } from "./Cursor.js"
import * as Fsx from "./internal/fsx.js"
import * as StateLayout from "./StateLayout.js"

// ---------------------------------------------------------------------------------------------
// Schemas

const IsoDate = Schema.String.pipe(
  Schema.filter((s) => !Number.isNaN(Date.parse(s)) || "expected an ISO 8601 date")
)

/** What is persisted about a session. Never `env` or `launchEnv`: encoding drops unknown keys. */
export const SessionMeta = Schema.Struct({
  activeSessionId: Schema.String,
  sessionId: Schema.String,
  name: Schema.optional(Schema.String),
  engine: Schema.String,
  /** Engine options, opaque to the store. */
  config: Schema.optional(Schema.Record({ key: Schema.String, value: Schema.Unknown })),
  telemetry: Schema.Boolean,
  createdAt: IsoDate
})

/** Persisted session metadata. */
export type SessionMeta = typeof SessionMeta.Type

/** First line of a transcript. */
export const SnapshotHeader = Schema.Struct({
  type: Schema.Literal("snapshot_header"),
  snapshotId: Schema.String,
  generation: Schema.Int.pipe(Schema.greaterThanOrEqualTo(1)),
  /** The cursor of the last event before this generation (absent for generation 1). */
  cursor: Schema.optional(Cursor),
  messageCount: Schema.Int.pipe(Schema.nonNegative()),
  /**
   * Where the messages are when they are not in this file: the first `bytes` bytes of the
   * session's append-only transcript `transcripts/<epoch>.jsonl`.
   */
  transcript: Schema.optional(Schema.Struct({
    epoch: Schema.Int.pipe(Schema.greaterThanOrEqualTo(1)),
    bytes: Schema.Int.pipe(Schema.nonNegative())
  })),
  /** The latest generation (up to this one) whose transcript rewrote history instead of extending it. */
  rewrittenAt: Schema.optional(Schema.Int.pipe(Schema.greaterThanOrEqualTo(1)))
})

/** First line of a transcript. */
export type SnapshotHeader = typeof SnapshotHeader.Type

/** What a writer says about the transcript it writes (the `type` tag is added, the store says where). */
export type SnapshotHeaderInput = Omit<SnapshotHeader, "type" | "transcript">

/** A complete transcript: its header and the file it lives in. */
export interface SnapshotInfo {
  readonly header: SnapshotHeader
  readonly path: string
}

/** A generation's messages as lines of a file (see {@link SessionStoreService.transcriptSource}). */
export interface TranscriptSource {
  readonly path: string
  readonly start: number
  readonly end: number
  readonly messageCount: number
}

// ---------------------------------------------------------------------------------------------
// Errors

/** No session with that id (never created, or archived). */
export class SessionNotFound extends Data.TaggedError("SessionNotFound")<{
  readonly activeSessionId: string
}> {
  override get message(): string {
    return `session ${JSON.stringify(this.activeSessionId)} not found`
  }
}

/** Why a store operation failed. */
export type SessionStoreErrorReason =
  | "AlreadyExists"
  | "SnapshotNotFound"
  | "InvalidInput"
  | "Corrupt"
  | "Io"

/** A store operation failed for another reason than a missing session. */
export class SessionStoreError extends Data.TaggedError("SessionStoreError")<{
  readonly reason: SessionStoreErrorReason
  readonly detail: string
  readonly activeSessionId?: string
  readonly path?: string
  readonly cause?: unknown
}> {
  override get message(): string {
    const who = this.activeSessionId === undefined ? "" : ` (session ${JSON.stringify(this.activeSessionId)})`
    return `session store: ${this.reason}${who}: ${this.detail}`
  }
}

const ioError = (activeSessionId: string | undefined) => (error: Fsx.FsError): SessionStoreError =>
  new SessionStoreError({
    reason: "Io",
    detail: error.message,
    ...(activeSessionId !== undefined ? { activeSessionId } : {}),
    path: error.path,
    cause: error.cause
  })

/** A session's directory as {@link SessionStoreService.list} finds it. */
export type SessionListing =
  | { readonly _tag: "Loaded"; readonly meta: SessionMeta }
  | { readonly _tag: "Unreadable"; readonly activeSessionId: string; readonly reason: string }

/** The id of a listed session. */
export const listingId = (listing: SessionListing): string =>
  listing._tag === "Loaded" ? listing.meta.activeSessionId : listing.activeSessionId

const byCreation = (a: SessionMeta, b: SessionMeta) =>
  a.createdAt < b.createdAt ? -1 : a.createdAt > b.createdAt ? 1 : a.activeSessionId < b.activeSessionId ? -1 : 1

// ---------------------------------------------------------------------------------------------
// Service

/** Session metadata and transcripts. */
export interface SessionStoreService {
  /** Stores a new session's metadata; fails `AlreadyExists` if the id is taken. */
  readonly create: (meta: SessionMeta) => Effect.Effect<void, SessionStoreError>
  /** Replaces the metadata of an existing session. */
  readonly saveMeta: (meta: SessionMeta) => Effect.Effect<void, SessionNotFound | SessionStoreError>
  /** The metadata of a session. */
  readonly loadMeta: (activeSessionId: string) => Effect.Effect<SessionMeta, SessionNotFound | SessionStoreError>
  /**
   * Every live (not archived) session, oldest first; a session whose metadata cannot be read is
   * listed too (`Unreadable`, after the others), never skipped: it is shown as damaged.
   */
  readonly list: () => Effect.Effect<ReadonlyArray<SessionListing>, SessionStoreError>
  /**
   * Writes the transcript of `header.generation` from messages (a Stream or an iterable), each
   * encoded as one JSON line. `header.messageCount` must equal the number of messages, else the
   * write fails and nothing is published. Atomic: readers see the previous latest transcript
   * until the new one is complete and durable.
   */
  readonly writeSnapshot: <E = never, R = never>(
    activeSessionId: string,
    header: SnapshotHeaderInput,
    messages: Stream.Stream<unknown, E, R> | Iterable<unknown>
  ) => Effect.Effect<SnapshotInfo, SessionNotFound | SessionStoreError | E, R>
  /**
   * Like {@link SessionStoreService.writeSnapshot} from chunks of already-encoded JSON lines
   * (e.g. the snapshot cache's spilled chunks): one message per `\n`-terminated line, chunks may
   * split lines anywhere. Empty lines are ignored.
   */
  readonly writeSnapshotLines: <E = never, R = never>(
    activeSessionId: string,
    header: SnapshotHeaderInput,
    lines: Stream.Stream<string | Uint8Array, E, R>
  ) => Effect.Effect<SnapshotInfo, SessionNotFound | SessionStoreError | E, R>
  /**
   * Writes the transcript of `header.generation` as that of the generation before it followed by
   * `messages`: the cost is that of the new messages, not of the whole transcript (generation 1
   * has the empty transcript). `header.messageCount` is the new total; a mismatch fails the
   * write and nothing is published. Atomic like {@link SessionStoreService.writeSnapshot}.
   */
  readonly appendSnapshot: <E = never, R = never>(
    activeSessionId: string,
    header: SnapshotHeaderInput,
    messages: Stream.Stream<unknown, E, R> | Iterable<unknown>
  ) => Effect.Effect<SnapshotInfo, SessionNotFound | SessionStoreError | E, R>
  /** The latest complete transcript, `None` when the session has none yet. */
  readonly latestSnapshot: (
    activeSessionId: string
  ) => Effect.Effect<Option.Option<SnapshotInfo>, SessionNotFound | SessionStoreError>
  /**
   * The messages of a transcript, lazily. Fails `Corrupt` at the end if the file holds fewer or
   * more messages than its header says.
   */
  readonly readSnapshot: (
    activeSessionId: string,
    generation: number
  ) => Stream.Stream<unknown, SessionNotFound | SessionStoreError>
  /** The messages of a transcript as their JSON lines, not decoded (for re-chunking). */
  readonly readSnapshotLines: (
    activeSessionId: string,
    generation: number
  ) => Stream.Stream<string, SessionNotFound | SessionStoreError>
  /**
   * Where a generation's messages are on disk: lines `[start, end)` of `path`, one message per
   * line, bytes that never change while the generation is retained (for readers that send them
   * on as they are). `None` for a store without files.
   */
  readonly transcriptSource: (
    activeSessionId: string,
    generation: number
  ) => Effect.Effect<Option.Option<TranscriptSource>, SessionNotFound | SessionStoreError>
  /**
   * Checks, without reading it whole, that a generation's transcript is all there: its file
   * holds at least the bytes its header names, ending with a whole line (`Corrupt` otherwise).
   */
  readonly checkTranscript: (activeSessionId: string, generation: number) => Effect.Effect<void, SessionNotFound | SessionStoreError>
  /** Where the transcript of a generation lives (what the journal records as `sessionFile`). */
  readonly snapshotPath: (activeSessionId: string, generation: number) => string
  /** Deletes the transcripts of generations below `keepFromGeneration`; returns them. */
  readonly pruneSnapshots: (
    activeSessionId: string,
    keepFromGeneration: number
  ) => Effect.Effect<ReadonlyArray<number>, SessionNotFound | SessionStoreError>
  /**
   * Moves the session's directory to `archive/<id>-<timestamp>` (nothing is deleted) and returns
   * that path. Afterwards the session is not found.
   */
  readonly archive: (activeSessionId: string) => Effect.Effect<string, SessionNotFound | SessionStoreError>
}

/** Session metadata and transcripts: files in production, memory in tests. */
export class SessionStore extends Context.Tag("agentd/SessionStore")<SessionStore, SessionStoreService>() {}

// ---------------------------------------------------------------------------------------------
// Shared helpers

/** Paths of a store rooted at `root` (named once, in StateLayout). */
const pathsOf = StateLayout.sessionStorePaths

const encodeMeta = Schema.encode(SessionMeta)
const decodeMetaJson = Schema.decodeUnknownEither(Schema.parseJson(SessionMeta))
const validateHeader = Schema.validate(SnapshotHeader)
const decodeHeaderJson = Schema.decodeUnknownEither(Schema.parseJson(SnapshotHeader))

const invalidInput = (activeSessionId: string, detail: string) =>
  new SessionStoreError({ reason: "InvalidInput", detail, activeSessionId })

/** Validates and strips a meta (drops `env`/`launchEnv` or anything else unknown). */
const cleanMeta = (meta: SessionMeta): Effect.Effect<SessionMeta, SessionStoreError> =>
  encodeMeta(meta).pipe(
    Effect.mapError((e) => invalidInput(meta.activeSessionId, ParseResult.TreeFormatter.formatErrorSync(e)))
  )

const makeHeader = (
  activeSessionId: string,
  input: SnapshotHeaderInput
): Effect.Effect<SnapshotHeader, SessionStoreError> =>
  validateHeader({
    type: "snapshot_header",
    snapshotId: input.snapshotId,
    generation: input.generation,
    ...(input.cursor !== undefined ? { cursor: input.cursor } : {}),
    messageCount: input.messageCount,
    ...(input.rewrittenAt !== undefined ? { rewrittenAt: input.rewrittenAt } : {})
  }).pipe(
    Effect.mapError((e) => invalidInput(activeSessionId, ParseResult.TreeFormatter.formatErrorSync(e)))
  )

const isStream = (u: unknown): u is Stream.Stream<unknown, unknown, unknown> =>
  Predicate.hasProperty(u, Stream.StreamTypeId)

/** Messages -> one string of JSON lines per chunk (one write per chunk, not per message). */
const encodeMessages = <E, R>(
  activeSessionId: string,
  messages: Stream.Stream<unknown, E, R> | Iterable<unknown>
): Stream.Stream<string, E | SessionStoreError, R> =>
  (isStream(messages) ? (messages as Stream.Stream<unknown, E, R>) : Stream.fromIterable(messages)).pipe(
    Stream.mapChunksEffect((chunk) =>
      Effect.try({
        try: () => {
          let text = ""
          for (const message of chunk) {
            const line = JSON.stringify(message) as string | undefined
            if (line === undefined) throw new Error(`a message is not JSON: ${String(message)}`)
            text += line + "\n"
          }
          return Chunk.of(text)
        },
        catch: (cause) =>
          invalidInput(activeSessionId, cause instanceof Error ? cause.message : "a message cannot be encoded")
      })
    )
  )

/**
 * The bytes of a transcript: header line, then the body with every line `\n`-terminated and
 * empty lines dropped, then a check that the body held exactly `header.messageCount` lines.
 * The check fails the stream, which makes the atomic writer discard the temp file.
 */
const frame = <E, R>(
  activeSessionId: string,
  header: SnapshotHeader,
  body: Stream.Stream<string | Uint8Array, E, R>
): Stream.Stream<Uint8Array, E | SessionStoreError, R> =>
  Stream.suspend(() => {
    let count = 0
    let atLineStart = true
    const normalize = (input: string | Uint8Array): Uint8Array => {
      const bytes = typeof input === "string" ? Buffer.from(input, "utf8") : Buffer.from(input.buffer, input.byteOffset, input.byteLength)
      // Count non-empty lines; drop empty ones so that the count and the reader agree.
      let out: Array<Uint8Array> | undefined
      let start = 0
      let newline = bytes.indexOf(0x0a, start)
      while (newline !== -1) {
        if (newline === start && atLineStart) {
          out ??= [bytes.subarray(0, start)]
        } else {
          count++
          out?.push(bytes.subarray(start, newline + 1))
        }
        atLineStart = true
        start = newline + 1
        newline = bytes.indexOf(0x0a, start)
      }
      if (start < bytes.length) {
        atLineStart = false
        out?.push(bytes.subarray(start))
      }
      return out === undefined ? bytes : Buffer.concat(out)
    }
    const trailer = Stream.suspend(() => {
      const tail: Array<Uint8Array> = []
      if (!atLineStart) {
        count++
        tail.push(Buffer.from("\n"))
      }
      return count === header.messageCount
        ? Stream.fromIterable(tail)
        : Stream.fail(
          new SessionStoreError({
            reason: "InvalidInput",
            detail: `snapshot ${header.snapshotId} declares ${header.messageCount} messages but has ${count}`,
            activeSessionId
          })
        )
    })
    return Stream.succeed<Uint8Array>(Buffer.from(JSON.stringify(header) + "\n")).pipe(
      Stream.concat(Stream.map(body, normalize)),
      Stream.concat(trailer)
    )
  })

/** Decodes JSON lines; a line that is not JSON means the file is damaged. */
const parseLines = <E>(
  activeSessionId: string,
  path: string,
  lines: Stream.Stream<string, E>
): Stream.Stream<unknown, E | SessionStoreError> =>
  Stream.mapChunksEffect(lines, (chunk) =>
    Effect.try({
      try: () => Chunk.map(chunk, (line): unknown => JSON.parse(line)),
      catch: (cause) =>
        new SessionStoreError({
          reason: "Corrupt",
          detail: `invalid message line in ${path}`,
          activeSessionId,
          path,
          cause
        })
    }))

/** Counts the messages going by and fails at the end if the header promised another count. */
const checkCount = <E>(
  activeSessionId: string,
  path: string,
  header: SnapshotHeader,
  lines: Stream.Stream<string, E>
): Stream.Stream<string, E | SessionStoreError> =>
  Stream.suspend(() => {
    let count = 0
    return lines.pipe(
      Stream.mapChunks((chunk) => {
        count += chunk.length
        return chunk
      }),
      Stream.concat(Stream.suspend(() =>
        count === header.messageCount ? Stream.empty : Stream.fail(
          new SessionStoreError({
            reason: "Corrupt",
            detail: `${path} holds ${count} messages, its header says ${header.messageCount}`,
            activeSessionId,
            path
          })
        )
      ))
    )
  })

/** Counts the `\n`-terminated lines of encoded messages. */
const countLines = (text: string): number => {
  let count = 0
  for (let i = text.indexOf("\n"); i !== -1; i = text.indexOf("\n", i + 1)) count++
  return count
}

const countMismatch = (activeSessionId: string, header: SnapshotHeader, count: number) =>
  new SessionStoreError({
    reason: "InvalidInput",
    detail: `snapshot ${header.snapshotId} declares ${header.messageCount} messages but has ${count}`,
    activeSessionId
  })

const GENERATION_FILE = /^([1-9][0-9]*)\.jsonl$/
const TEMP_GENERATION = /^\.([1-9][0-9]*)\.jsonl\..*\.tmp$/

/** `20261129T220114404Z`: sortable, no `:` (awkward in paths). */
const compactTimestamp = (millis: number): string => new Date(millis).toISOString().replace(/[-:.]/g, "")

// ---------------------------------------------------------------------------------------------
// File implementation

/** Options of the file store. */
export interface Options {
  /** The directory holding `sessions/` and `archive/` (normally the state dir). */
  readonly root: string
}

/** The store on disk under `options.root`, which is created 0700 if missing. */
export const make = (options: Options): Effect.Effect<SessionStoreService, SessionStoreError> =>
  Effect.gen(function*() {
    const root = nodePath.resolve(options.root)
    const paths = pathsOf(root)
    yield* Fsx.ensureDir(paths.sessions).pipe(Effect.mapError(ioError(undefined)))
    // Metadata writes check-then-write; serializing them makes `create` reliably exclusive.
    const metaLock = yield* Effect.makeSemaphore(1)

    const exists = (path: string) =>
      Fsx.attempt("stat", path, () => fsp.stat(path)).pipe(
        Effect.as(true),
        Effect.catchIf(Fsx.isNotFound, () => Effect.succeed(false))
      )

    const requireSession = (id: string): Effect.Effect<void, SessionNotFound | SessionStoreError> =>
      exists(paths.metaFile(id)).pipe(
        Effect.mapError(ioError(id)),
        Effect.flatMap((found) => (found ? Effect.void : Effect.fail(new SessionNotFound({ activeSessionId: id }))))
      )

    const writeMeta = (meta: SessionMeta) =>
      Effect.gen(function*() {
        const clean = yield* cleanMeta(meta)
        yield* Fsx.writeFileAtomic(paths.metaFile(meta.activeSessionId), JSON.stringify(clean, null, 2) + "\n").pipe(
          Effect.mapError(ioError(meta.activeSessionId))
        )
      })

    const create = Effect.fn("SessionStore.create")(function*(meta: SessionMeta) {
      yield* metaLock.withPermits(1)(Effect.gen(function*() {
        const id = meta.activeSessionId
        if (yield* exists(paths.metaFile(id)).pipe(Effect.mapError(ioError(id)))) {
          return yield* new SessionStoreError({ reason: "AlreadyExists", detail: "session id already in use", activeSessionId: id })
        }
        yield* Fsx.ensureDir(paths.sessionDir(id)).pipe(
          // The new directory's entry must be durable before anything inside it matters.
          Effect.zipRight(Fsx.fsyncDir(paths.sessions)),
          Effect.mapError(ioError(id))
        )
        yield* writeMeta(meta)
      }))
    })

    const saveMeta = Effect.fn("SessionStore.saveMeta")(function*(meta: SessionMeta) {
      yield* metaLock.withPermits(1)(Effect.zipRight(requireSession(meta.activeSessionId), writeMeta(meta)))
    })

    const readMetaFile = (id: string, path: string): Effect.Effect<Option.Option<SessionMeta>, SessionStoreError> =>
      Fsx.readFileIfExists(path).pipe(
        Effect.mapError(ioError(id)),
        Effect.flatMap(Option.match({
          onNone: () => Effect.succeed(Option.none()),
          onSome: (text) => {
            const decoded = decodeMetaJson(text)
            return Either.isRight(decoded)
              ? Effect.succeed(Option.some(decoded.right))
              : Effect.fail(
                new SessionStoreError({
                  reason: "Corrupt",
                  detail: `invalid ${path}: ${ParseResult.TreeFormatter.formatErrorSync(decoded.left)}`,
                  activeSessionId: id,
                  path
                })
              )
          }
        }))
      )

    const loadMeta = Effect.fn("SessionStore.loadMeta")(function*(id: string) {
      const found = yield* readMetaFile(id, paths.metaFile(id))
      if (Option.isNone(found)) return yield* new SessionNotFound({ activeSessionId: id })
      return found.value
    })

    const list = Effect.fn("SessionStore.list")(function*() {
      const names = yield* Fsx.attempt("readdir", paths.sessions, () => fsp.readdir(paths.sessions)).pipe(
        Effect.catchIf(Fsx.isNotFound, () => Effect.succeed<Array<string>>([])),
        Effect.mapError(ioError(undefined))
      )
      const metas: Array<SessionMeta> = []
      const unreadable: Array<SessionListing> = []
      for (const name of names) {
        if (name.startsWith(".")) continue
        const id = StateLayout.segmentId(name)
        const path = nodePath.join(paths.sessions, name, "meta.json")
        const found = yield* Effect.either(readMetaFile(name, path))
        if (Either.isRight(found) && Option.isSome(found.right)) metas.push(found.right.value)
        else if (id === undefined) yield* Effect.logWarning(`session store: ${name} names no session; left alone`)
        else unreadable.push({ _tag: "Unreadable", activeSessionId: id, reason: Either.isLeft(found) ? found.left.detail : `${path} is missing` })
      }
      return [...metas.sort(byCreation).map((meta): SessionListing => ({ _tag: "Loaded", meta })), ...unreadable]
    })

    const writeSnapshotLines = <E = never, R = never>(
      id: string,
      input: SnapshotHeaderInput,
      lines: Stream.Stream<string | Uint8Array, E, R>
    ): Effect.Effect<SnapshotInfo, SessionNotFound | SessionStoreError | E, R> =>
      Effect.gen(function*() {
        const header = yield* makeHeader(id, input)
        yield* requireSession(id)
        yield* Fsx.ensureDir(paths.snapshotsDir(id)).pipe(Effect.mapError(ioError(id)))
        const path = paths.snapshotFile(id, header.generation)
        yield* Fsx.writeAtomicWith(path, (write) => Stream.runForEach(frame(id, header, lines), write)).pipe(
          Effect.mapError((e) => (e instanceof Fsx.FsError ? ioError(id)(e) : e))
        )
        return { header, path }
      }).pipe(Effect.withSpan("SessionStore.writeSnapshot", { attributes: { activeSessionId: id } }))

    const writeSnapshot = <E = never, R = never>(
      id: string,
      header: SnapshotHeaderInput,
      messages: Stream.Stream<unknown, E, R> | Iterable<unknown>
    ): Effect.Effect<SnapshotInfo, SessionNotFound | SessionStoreError | E, R> =>
      writeSnapshotLines(id, header, encodeMessages(id, messages))

    /** The header of a generation's transcript; `SnapshotNotFound` when it has none. */
    const headerOf = (id: string, generation: number): Effect.Effect<SnapshotHeader, SessionStoreError> => {
      const path = paths.snapshotFile(id, generation)
      return readHeader(id, path).pipe(
        Effect.catchIf((e) => Fsx.errnoCode(e.cause) === "ENOENT", () =>
          Effect.fail(
            new SessionStoreError({
              reason: "SnapshotNotFound",
              detail: `no transcript for generation ${generation}`,
              activeSessionId: id,
              path
            })
          )),
        Effect.flatMap(Option.match({
          onNone: () => Effect.fail(new SessionStoreError({ reason: "Corrupt", detail: `invalid header in ${path}`, activeSessionId: id, path })),
          onSome: Effect.succeed
        }))
      )
    }

    const appendSnapshot = <E = never, R = never>(
      id: string,
      input: SnapshotHeaderInput,
      messages: Stream.Stream<unknown, E, R> | Iterable<unknown>
    ): Effect.Effect<SnapshotInfo, SessionNotFound | SessionStoreError | E, R> =>
      Effect.gen(function*() {
        const requested = yield* makeHeader(id, input)
        yield* requireSession(id)
        const baseGeneration = requested.generation - 1
        const base = baseGeneration <= 1 ? undefined : yield* headerOf(id, baseGeneration)
        // A base whose messages are in the file itself (a rewrite, or an older layout) starts a
        // new append-only transcript, once: its messages are copied there first.
        const copied = base !== undefined && base.transcript === undefined
        const epoch = base?.transcript?.epoch ?? requested.generation
        const start = base?.transcript?.bytes ?? 0
        const file = paths.transcriptFile(id, epoch)
        yield* Fsx.ensureDir(paths.transcriptsDir(id)).pipe(Effect.mapError(ioError(id)))
        const body = copied
          ? Stream.concat(Stream.map(readSnapshotLines(id, baseGeneration), (line) => line + "\n"), encodeMessages(id, messages))
          : encodeMessages(id, messages)
        // Written after the base's bytes (anything beyond them is the leftover of a write that
        // never got its header), then cut there, synced, and only then published by the header.
        const { bytes, count } = yield* Effect.acquireUseRelease(
          Fsx.attempt("open", file, () => fsp.open(file, fs.constants.O_RDWR | fs.constants.O_CREAT, Fsx.FILE_MODE)),
          (handle) =>
            Effect.gen(function*() {
              const { size } = yield* Fsx.attempt("stat", file, () => handle.stat())
              if (size < start) {
                return yield* new SessionStoreError({
                  reason: "Corrupt",
                  detail: `${file} holds ${size} bytes, generation ${baseGeneration} says ${start}`,
                  activeSessionId: id,
                  path: file
                })
              }
              let position = start
              let count = 0
              yield* Stream.runForEach(body, (text) => {
                const data = Buffer.from(text, "utf8")
                return Fsx.writeAll(handle, file, data, position).pipe(Effect.tap(() => {
                  position += data.byteLength
                  count += countLines(text)
                }))
              })
              yield* Fsx.attempt("truncate", file, () => handle.truncate(position))
              yield* Fsx.attempt("fsync", file, () => handle.datasync())
              return { bytes: position, count }
            }),
          Fsx.closeQuietly
        ).pipe(Effect.mapError((e) => (e instanceof Fsx.FsError ? ioError(id)(e) : e)))
        const total = (copied ? 0 : base?.messageCount ?? 0) + count
        if (total !== requested.messageCount) return yield* countMismatch(id, requested, total)
        // The transcript file's own entry is durable before a header names it.
        if (start === 0) yield* Fsx.fsyncDir(paths.transcriptsDir(id)).pipe(Effect.mapError(ioError(id)))
        const header: SnapshotHeader = { ...requested, transcript: { epoch, bytes } }
        const path = paths.snapshotFile(id, header.generation)
        yield* Fsx.ensureDir(paths.snapshotsDir(id)).pipe(
          Effect.zipRight(Fsx.writeFileAtomic(path, JSON.stringify(header) + "\n")),
          Effect.mapError(ioError(id))
        )
        return { header, path }
      }).pipe(Effect.withSpan("SessionStore.appendSnapshot", { attributes: { activeSessionId: id } }))

    const generationsOf = (id: string) =>
      Fsx.attempt("readdir", paths.snapshotsDir(id), () => fsp.readdir(paths.snapshotsDir(id))).pipe(
        Effect.catchIf(Fsx.isNotFound, () => Effect.succeed<Array<string>>([])),
        Effect.mapError(ioError(id))
      )

    const readHeader = (id: string, path: string): Effect.Effect<Option.Option<SnapshotHeader>, SessionStoreError> =>
      Fsx.readFirstLine(path).pipe(
        Effect.mapError(ioError(id)),
        Effect.map(Option.flatMap((line) => Either.getRight(decodeHeaderJson(line))))
      )

    const latestSnapshot = Effect.fn("SessionStore.latestSnapshot")(function*(id: string) {
      yield* requireSession(id)
      const generations = (yield* generationsOf(id))
        .flatMap((name) => {
          const match = GENERATION_FILE.exec(name)
          return match?.[1] === undefined ? [] : [Number(match[1])]
        })
        .sort((a, b) => b - a)
      for (const generation of generations) {
        const path = paths.snapshotFile(id, generation)
        const header = yield* readHeader(id, path).pipe(
          Effect.catchIf((e) => e.cause !== undefined && Fsx.errnoCode(e.cause) === "ENOENT", () => Effect.succeed(Option.none()))
        )
        if (Option.isSome(header) && header.value.generation === generation) {
          return Option.some<SnapshotInfo>({ header: header.value, path })
        }
        yield* Effect.logWarning(`session store: ignoring unreadable transcript ${path}`)
      }
      return Option.none<SnapshotInfo>()
    })

    function readSnapshotLines(id: string, generation: number): Stream.Stream<string, SessionNotFound | SessionStoreError> {
      return Stream.unwrap(Effect.gen(function*() {
        yield* requireSession(id)
        const header = yield* headerOf(id, generation)
        const path = header.transcript === undefined
          ? paths.snapshotFile(id, generation)
          : paths.transcriptFile(id, header.transcript.epoch)
        const body = Stream.fromAsyncIterable(
          Fsx.lineBatches(path, header.transcript?.bytes),
          (cause) => ioError(id)(new Fsx.FsError({ op: "read", path, cause }))
        ).pipe(
          Stream.flattenIterables,
          Stream.drop(header.transcript === undefined ? 1 : 0),
          Stream.filter((line) => line.trim().length > 0)
        )
        return checkCount(id, path, header, body)
      }))
    }

    const readSnapshot = (id: string, generation: number): Stream.Stream<unknown, SessionNotFound | SessionStoreError> =>
      parseLines(id, paths.snapshotFile(id, generation), readSnapshotLines(id, generation))

    const checkTranscript = Effect.fn("SessionStore.checkTranscript")(function*(id: string, generation: number) {
      const source = yield* transcriptSource(id, generation)
      if (Option.isNone(source) || source.value.end === source.value.start) return
      const { path, end } = source.value
      const last = yield* Fsx.attempt("read", path, async () => {
        const file = await fsp.open(path, "r")
        try {
          const size = (await file.stat()).size
          const byte = Buffer.alloc(1)
          if (size >= end) await file.read(byte, 0, 1, end - 1)
          return { size, byte: byte[0] }
        } finally {
          await file.close()
        }
      }).pipe(Effect.mapError(ioError(id)))
      const corrupt = (detail: string) => new SessionStoreError({ reason: "Corrupt", detail: `${path}: ${detail}`, activeSessionId: id, path })
      if (last.size < end) return yield* corrupt(`holds ${last.size} bytes, generation ${generation}'s transcript needs ${end}`)
      if (last.byte !== 0x0a) return yield* corrupt(`generation ${generation}'s transcript does not end with a whole line`)
    })

    const transcriptSource = Effect.fn("SessionStore.transcriptSource")(function*(id: string, generation: number) {
      yield* requireSession(id)
      const header = yield* headerOf(id, generation)
      if (header.transcript !== undefined) {
        return Option.some<TranscriptSource>({
          path: paths.transcriptFile(id, header.transcript.epoch),
          start: 0,
          end: header.transcript.bytes,
          messageCount: header.messageCount
        })
      }
      // Written whole: the messages follow the header line, to the end of the file.
      const path = paths.snapshotFile(id, generation)
      const size = yield* Fsx.attempt("stat", path, () => fsp.stat(path)).pipe(
        Effect.map((st) => st.size),
        Effect.mapError(ioError(id))
      )
      const firstLine = yield* Fsx.readFirstLine(path).pipe(Effect.mapError(ioError(id)))
      const headerBytes = Option.match(firstLine, { onNone: () => size, onSome: (line) => Buffer.byteLength(line) + 1 })
      return Option.some<TranscriptSource>({ path, start: Math.min(headerBytes, size), end: size, messageCount: header.messageCount })
    })

    const pruneSnapshots = Effect.fn("SessionStore.pruneSnapshots")(function*(id: string, keepFromGeneration: number) {
      yield* requireSession(id)
      const dir = paths.snapshotsDir(id)
      const removed: Array<number> = []
      for (const name of yield* generationsOf(id)) {
        const final = GENERATION_FILE.exec(name)?.[1]
        // Temp files of old generations are leftovers of a crashed writer.
        const temp = TEMP_GENERATION.exec(name)?.[1]
        const generation = Number(final ?? temp ?? Number.NaN)
        if (!(generation < keepFromGeneration)) continue
        yield* Fsx.attempt("unlink", nodePath.join(dir, name), () => fsp.unlink(nodePath.join(dir, name))).pipe(
          Effect.catchIf(Fsx.isNotFound, () => Effect.void),
          Effect.mapError(ioError(id))
        )
        if (final !== undefined) removed.push(generation)
      }
      if (removed.length > 0) yield* Fsx.fsyncDir(dir).pipe(Effect.mapError(ioError(id)))
      // An append-only transcript goes with the last generation that reads it.
      const referenced = new Set<number>()
      for (const name of yield* generationsOf(id)) {
        const generation = Number(GENERATION_FILE.exec(name)?.[1] ?? Number.NaN)
        if (!(generation >= keepFromGeneration)) continue
        const header = yield* Effect.option(headerOf(id, generation))
        if (Option.isSome(header) && header.value.transcript !== undefined) referenced.add(header.value.transcript.epoch)
      }
      const transcripts = paths.transcriptsDir(id)
      const names = yield* Fsx.attempt("readdir", transcripts, () => fsp.readdir(transcripts)).pipe(
        Effect.catchIf(Fsx.isNotFound, () => Effect.succeed<Array<string>>([])),
        Effect.mapError(ioError(id))
      )
      for (const name of names) {
        const epoch = Number(GENERATION_FILE.exec(name)?.[1] ?? TEMP_GENERATION.exec(name)?.[1] ?? Number.NaN)
        if (!(epoch < keepFromGeneration) || referenced.has(epoch)) continue
        yield* Fsx.unlinkQuietly(nodePath.join(transcripts, name))
      }
      return removed.sort((a, b) => a - b)
    })

    const archive = Effect.fn("SessionStore.archive")(function*(id: string) {
      return yield* metaLock.withPermits(1)(Effect.gen(function*() {
        const source = paths.sessionDir(id)
        if (!(yield* exists(source).pipe(Effect.mapError(ioError(id))))) {
          return yield* new SessionNotFound({ activeSessionId: id })
        }
        yield* Fsx.ensureDir(paths.archive).pipe(Effect.mapError(ioError(id)))
        const base = paths.archiveDir(id, compactTimestamp(yield* Clock.currentTimeMillis))
        // The same id can be created and archived twice within one millisecond.
        let target = base
        for (let n = 1; yield* exists(target).pipe(Effect.mapError(ioError(id))); n++) {
          target = `${base}-${n}`
        }
        const destination = target
        yield* Fsx.attempt("rename", source, () => fsp.rename(source, destination)).pipe(
          Effect.zipRight(Fsx.fsyncDir(paths.sessions)),
          Effect.zipRight(Fsx.fsyncDir(paths.archive)),
          Effect.mapError(ioError(id))
        )
        return destination
      }))
    })

    return SessionStore.of({
      create,
      saveMeta,
      loadMeta,
      list,
      writeSnapshot,
      writeSnapshotLines,
      appendSnapshot,
      latestSnapshot,
      readSnapshot,
      readSnapshotLines,
      transcriptSource,
      checkTranscript,
      snapshotPath: paths.snapshotFile,
      pruneSnapshots,
      archive
    })
  })

/** The store on disk under `options.root`. */
export const layer = (options: Options): Layer.Layer<SessionStore, SessionStoreError> =>
  Layer.effect(SessionStore, make(options))

// ---------------------------------------------------------------------------------------------
// Memory implementation

interface MemorySession {
  readonly meta: SessionMeta
  readonly snapshots: ReadonlyMap<number, { readonly header: SnapshotHeader; readonly lines: ReadonlyArray<string> }>
}

/**
 * A store in memory with the same semantics (validation, exclusivity, atomic transcripts,
 * archive); paths are reported under `memory:/`.
 */
export const makeMemory: Effect.Effect<SessionStoreService> = Effect.gen(function*() {
  const paths = pathsOf("memory:/")
  const sessions = yield* Ref.make<ReadonlyMap<string, MemorySession>>(new Map())
  const archived = yield* Ref.make<ReadonlyArray<{ readonly path: string; readonly session: MemorySession }>>([])

  const getSession = (id: string): Effect.Effect<MemorySession, SessionNotFound> =>
    Effect.flatMap(Ref.get(sessions), (all) => {
      const found = all.get(id)
      return found === undefined ? Effect.fail(new SessionNotFound({ activeSessionId: id })) : Effect.succeed(found)
    })

  const update = (id: string, f: (session: MemorySession) => MemorySession) =>
    Ref.modify(sessions, (all): [boolean, ReadonlyMap<string, MemorySession>] => {
      const found = all.get(id)
      return found === undefined ? [false, all] : [true, new Map(all).set(id, f(found))]
    }).pipe(Effect.flatMap((ok) => (ok ? Effect.void : Effect.fail(new SessionNotFound({ activeSessionId: id })))))

  const create = Effect.fn("SessionStore.create")(function*(meta: SessionMeta) {
    const clean = yield* cleanMeta(meta)
    const created = yield* Ref.modify(sessions, (all): [boolean, ReadonlyMap<string, MemorySession>] =>
      all.has(clean.activeSessionId)
        ? [false, all]
        : [true, new Map(all).set(clean.activeSessionId, { meta: clean, snapshots: new Map() })]
    )
    if (!created) {
      return yield* new SessionStoreError({
        reason: "AlreadyExists",
        detail: "session id already in use",
        activeSessionId: meta.activeSessionId
      })
    }
  })

  const saveMeta = Effect.fn("SessionStore.saveMeta")(function*(meta: SessionMeta) {
    const clean = yield* cleanMeta(meta)
    yield* update(clean.activeSessionId, (s) => ({ ...s, meta: clean }))
  })

  const writeSnapshotLines = <E = never, R = never>(
    id: string,
    input: SnapshotHeaderInput,
    body: Stream.Stream<string | Uint8Array, E, R>
  ): Effect.Effect<SnapshotInfo, SessionNotFound | SessionStoreError | E, R> =>
    Effect.gen(function*() {
      const header = yield* makeHeader(id, input)
      yield* getSession(id)
      const bytes = yield* Stream.runCollect(frame(id, header, body))
      const lines = Buffer.concat(Chunk.toArray(bytes)).toString("utf8").split("\n").slice(1, -1)
      yield* update(id, (s) => ({ ...s, snapshots: new Map(s.snapshots).set(header.generation, { header, lines }) }))
      return { header, path: paths.snapshotFile(id, header.generation) }
    })

  const appendSnapshot = <E = never, R = never>(
    id: string,
    input: SnapshotHeaderInput,
    messages: Stream.Stream<unknown, E, R> | Iterable<unknown>
  ): Effect.Effect<SnapshotInfo, SessionNotFound | SessionStoreError | E, R> =>
    Effect.suspend(() => {
      const base = input.generation - 1
      return writeSnapshotLines(id, input, Stream.concat(
        base <= 1 ? Stream.empty : Stream.map(readSnapshotLines(id, base), (line) => line + "\n"),
        encodeMessages(id, messages)
      ))
    })

  function readSnapshotLines(id: string, generation: number): Stream.Stream<string, SessionNotFound | SessionStoreError> {
    return Stream.unwrap(Effect.gen(function*() {
      const session = yield* getSession(id)
      const snapshot = session.snapshots.get(generation)
      if (snapshot === undefined) {
        return yield* new SessionStoreError({
          reason: "SnapshotNotFound",
          detail: `no transcript for generation ${generation}`,
          activeSessionId: id,
          path: paths.snapshotFile(id, generation)
        })
      }
      return Stream.fromIterable(snapshot.lines)
    }))
  }

  return SessionStore.of({
    create,
    saveMeta,
    loadMeta: Effect.fn("SessionStore.loadMeta")(function*(id: string) {
      return (yield* getSession(id)).meta
    }),
    list: Effect.fn("SessionStore.list")(function*() {
      const all = yield* Ref.get(sessions)
      return Array.from(all.values(), (s) => s.meta).sort(byCreation).map((meta): SessionListing => ({ _tag: "Loaded", meta }))
    }),
    writeSnapshot: (id, header, messages) => writeSnapshotLines(id, header, encodeMessages(id, messages)),
    writeSnapshotLines,
    appendSnapshot,
    latestSnapshot: Effect.fn("SessionStore.latestSnapshot")(function*(id: string) {
      const session = yield* getSession(id)
      const generations = Array.from(session.snapshots.keys()).sort((a, b) => b - a)
      const latest = generations[0] === undefined ? undefined : session.snapshots.get(generations[0])
      return latest === undefined
        ? Option.none<SnapshotInfo>()
        : Option.some<SnapshotInfo>({ header: latest.header, path: paths.snapshotFile(id, latest.header.generation) })
    }),
    readSnapshot: (id, generation) =>
      parseLines(id, paths.snapshotFile(id, generation), readSnapshotLines(id, generation)),
    readSnapshotLines,
    transcriptSource: () => Effect.succeed(Option.none()),
    checkTranscript: () => Effect.void,
    snapshotPath: paths.snapshotFile,
    pruneSnapshots: Effect.fn("SessionStore.pruneSnapshots")(function*(id: string, keepFromGeneration: number) {
      const session = yield* getSession(id)
      const removed = Array.from(session.snapshots.keys()).filter((g) => g < keepFromGeneration).sort((a, b) => a - b)
      yield* update(id, (s) => {
        const snapshots = new Map(s.snapshots)
        for (const g of removed) snapshots.delete(g)
        return { ...s, snapshots }
      })
      return removed
    }),
    archive: Effect.fn("SessionStore.archive")(function*(id: string) {
      const now = yield* Clock.currentTimeMillis
      const session = yield* Ref.modify(sessions, (all): [MemorySession | undefined, ReadonlyMap<string, MemorySession>] => {
        const found = all.get(id)
        if (found === undefined) return [undefined, all]
        const rest = new Map(all)
        rest.delete(id)
        return [found, rest]
      })
      if (session === undefined) return yield* new SessionNotFound({ activeSessionId: id })
      const base = paths.archiveDir(id, compactTimestamp(now))
      return yield* Ref.modify(archived, (list): [string, ReadonlyArray<{ readonly path: string; readonly session: MemorySession }>] => {
        const taken = new Set(list.map((a) => a.path))
        let path = base
        for (let n = 1; taken.has(path); n++) path = `${base}-${n}`
        return [path, [...list, { path, session }]]
      })
    })
  })
})

/** The in-memory store, for tests. */
export const layerMemory: Layer.Layer<SessionStore> = Layer.effect(SessionStore, makeMemory)
