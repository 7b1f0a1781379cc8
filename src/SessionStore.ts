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
 * This module holds the interface, the errors and the layers; the implementations live under
 * internal/sessionStore/ (file, memory) and internal/postgres/.
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
import * as Context from "effect/Context"
import * as Data from "effect/Data"
import * as Effect from "effect/Effect"
import * as Layer from "effect/Layer"
import type * as Option from "effect/Option"
import * as Schema from "effect/Schema"
import type * as Stream from "effect/Stream"
import { Cursor } from "./Cursor.js"
import * as FileSessionStore from "./internal/sessionStore/file.js"
import * as MemorySessionStore from "./internal/sessionStore/memory.js"

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
  /** The name is held by another live session of the store (checked by a shared store, across daemons). */
  | "NameTaken"
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

/** A session's directory as {@link SessionStoreService.list} finds it. */
export type SessionListing =
  | { readonly _tag: "Loaded"; readonly meta: SessionMeta }
  | { readonly _tag: "Unreadable"; readonly activeSessionId: string; readonly reason: string }

/** The id of a listed session. */
export const listingId = (listing: SessionListing): string =>
  listing._tag === "Loaded" ? listing.meta.activeSessionId : listing.activeSessionId

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
// Layers

/** Options of the file store. */
export interface Options {
  /** The directory holding `sessions/` and `archive/` (normally the state dir). */
  readonly root: string
}

/** The store on disk under `options.root`, which is created 0700 if missing. */
export const make = (options: Options): Effect.Effect<SessionStoreService, SessionStoreError> =>
  FileSessionStore.make(options)

/** The store on disk under `options.root`. */
export const layer = (options: Options): Layer.Layer<SessionStore, SessionStoreError> =>
  Layer.effect(SessionStore, make(options))

/**
 * A store in memory with the same semantics (validation, exclusivity, atomic transcripts,
 * archive); paths are reported under `memory:/`.
 */
export const makeMemory: Effect.Effect<SessionStoreService> = Effect.suspend(() => MemorySessionStore.make)

export const layerMemory: Layer.Layer<SessionStore> = Layer.effect(SessionStore, makeMemory)
