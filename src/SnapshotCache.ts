/**
 * Chunked, reference-counted, memory-then-disk snapshot buffers (docs/protocol.md sections 5 and 6).
 *
 * A snapshot (a session's transcript at a checkpoint) is streamed once by its producer (the
 * worker, through the supervisor) as `session_snapshot_chunk` lines and read by any number of
 * clients, each at its own pace. The cache keeps one entry per `snapshotId`: the producer
 * appends pre-encoded chunk lines and ends the entry with `markComplete` or `markFailed`;
 * readers `retain` the entry and ask for chunk after chunk, parking until it exists.
 *
 * Memory is bounded across the whole cache: chunks stay in memory while the cache holds at most
 * `memoryCacheBytes` of chunk bytes; an entry whose next chunk would pass that limit moves all its
 * chunks to `<cacheRoot>/<sanitized snapshotId>/<index>.jsonl` and its later chunks go straight
 * to disk. Readers of a spilled chunk read it back from its file, so streaming a snapshot of any
 * size holds at most one chunk per reader in memory.
 *
 * This module holds the interface, the errors and the layers; the implementation (one for both
 * layers) and the chunking live under internal/snapshotCache/.
 */
import * as FileSystem from "@effect/platform/FileSystem"
import * as Context from "effect/Context"
import * as Data from "effect/Data"
import * as Effect from "effect/Effect"
import * as Layer from "effect/Layer"
import type * as Scope from "effect/Scope"
import type * as Stream from "effect/Stream"
import * as NodePath from "node:path"
import type { Cursor } from "./Cursor.js"
import { DEFAULT_MEMORY_CACHE_BYTES } from "./internal/snapshotCache/chunking.js"
import { makeWith } from "./internal/snapshotCache/cache.js"
import * as StateLayout from "./StateLayout.js"

export {
  ChunkBuilder,
  chunkMessages,
  chunkRanges,
  DEFAULT_MEMORY_CACHE_BYTES,
  DEFAULT_TARGET_CHUNK_BYTES
} from "./internal/snapshotCache/chunking.js"

// ---------------------------------------------------------------------------------------------
// Public types
// ---------------------------------------------------------------------------------------------

/** Why a cache operation failed. */
export type SnapshotCacheErrorReason =
  /** The snapshotId is empty. */
  | "InvalidSnapshotId"
  /** `create` for a snapshotId that already has an entry. */
  | "AlreadyExists"
  /** No entry has this snapshotId (never created, or disposed and released). */
  | "NotFound"
  /** The entry was disposed: no new readers, no more writes; waiters of an unfinished entry fail. */
  | "Disposed"
  /** A write to an entry that is already complete or failed. */
  | "NotWritable"
  /** A chunk that is empty or not a `\n`-terminated line. */
  | "InvalidChunk"
  /** `markComplete` named a chunk count different from the chunks appended. */
  | "ChunkCountMismatch"
  /** A chunk index that is not a non-negative integer. */
  | "InvalidIndex"
  /** The producer reported a failure (`markFailed`); `message` is its error text verbatim. */
  | "SnapshotFailed"
  /** A reader handle used after its release. */
  | "Released"
  /** The cache was shut down (its layer's scope closed). */
  | "Closed"
  /** A spill file could not be written, read or removed. */
  | "Io"

/** The error of every `SnapshotCache` operation (local: it never crosses the wire as such). */
export class SnapshotCacheError extends Data.TaggedError("SnapshotCacheError")<{
  readonly reason: SnapshotCacheErrorReason
  readonly message: string
  readonly snapshotId?: string
  readonly cause?: unknown
}> {}

/** What a reader needs to send `session_snapshot_begin` (the purpose is the reader's own). */
export interface SnapshotMeta {
  readonly activeSessionId: string
  readonly messageCount: number
  readonly targetChunkBytes: number
  /** The cursor of the last event before the snapshot's generation (absent for generation 1). */
  readonly cursor?: Cursor | undefined
}

/** The end of a complete snapshot, as in `session_snapshot_end`. */
export interface SnapshotEnd {
  readonly chunkCount: number
  readonly lastEventSequence: number
  readonly lastEventCursor?: Cursor | undefined
}

/**
 * What `waitForChunk` found: the chunk's line bytes, or the end of the snapshot. The bytes are
 * shared with the cache and with other readers (never copied per reader): treat them as read-only.
 *
 * `release` says the reader is done with the bytes (for a socket: the kernel took them); a chunk
 * read from a file then lends its buffer to a later read. Calling it is optional (bytes never
 * released are garbage collected like any buffer) and it runs once however often it is called,
 * but after it the bytes must not be read or written anywhere.
 */
export type ChunkResult =
  | { readonly _tag: "Chunk"; readonly index: number; readonly bytes: Uint8Array; readonly release: () => void }
  | { readonly _tag: "End"; readonly end: SnapshotEnd }

/** A retained entry, as seen by one reader. */
export interface SnapshotReader {
  readonly snapshotId: string
  readonly meta: SnapshotMeta
  /**
   * Chunk `index` (its exact line bytes), parking until it is appended; `End` once the snapshot
   * is complete and `index >= chunkCount`. Fails with reason `SnapshotFailed` (or `Disposed`,
   * `Closed`, `Io`) when the snapshot failed, even for chunks that exist: the reader starts over.
   */
  readonly waitForChunk: (index: number) => Effect.Effect<ChunkResult, SnapshotCacheError>
  /** Every chunk from index 0, in order; ends after the last one of a complete snapshot. */
  readonly stream: Stream.Stream<Uint8Array, SnapshotCacheError>
  /** Waits until the snapshot is complete (its end) or failed. */
  readonly awaitEnd: Effect.Effect<SnapshotEnd, SnapshotCacheError>
  /** Releases the reader now (idempotent; the retaining scope's finalizer then does nothing). */
  readonly release: Effect.Effect<void>
}

/** A point-in-time view of one entry (for status, tests and logs). */
export interface SnapshotInfo {
  readonly snapshotId: string
  readonly meta: SnapshotMeta
  readonly status: "open" | "complete" | "failed"
  readonly end: SnapshotEnd | undefined
  readonly chunkCount: number
  /** Bytes of every chunk appended, wherever they are. */
  readonly totalBytes: number
  /** Bytes of this entry's chunks held in memory (0 once spilled). */
  readonly memoryBytes: number
  readonly spilled: boolean
  /** Where the entry's chunks go when it spills (undefined for `layerMemory`). */
  readonly spillDirectory: string | undefined
  readonly readers: number
  readonly disposed: boolean
}

/** A point-in-time view of the whole cache. */
export interface SnapshotCacheStats {
  readonly entries: number
  readonly spilledEntries: number
  /** Chunk bytes held in memory across every entry. */
  readonly memoryBytes: number
  readonly memoryCacheBytes: number
}

/**
 * Whole lines `[start, end)` of a file that only ever grows or is replaced whole (a transcript),
 * one JSON message per `\n`-terminated line: a chunk the cache reads from there when a reader
 * needs it, instead of holding or spilling a copy.
 */
export interface FileRange {
  readonly path: string
  readonly start: number
  readonly end: number
}

/** The operations of the snapshot cache. */
export interface SnapshotCacheService {
  /** Starts an entry; fails with `AlreadyExists` when the snapshotId is taken (even if disposing). */
  readonly create: (snapshotId: string, meta: SnapshotMeta) => Effect.Effect<void, SnapshotCacheError>
  /**
   * Appends the next chunk (its index is the number of chunks before it) and returns its index.
   * `chunkBytes` must be one whole `\n`-terminated line; the cache owns it from now on (it keeps a
   * view that is exactly the chunk, copying it only when it is a slice of a larger buffer). An
   * I/O failure while spilling also fails the entry, so that no reader waits forever.
   */
  readonly appendChunk: (snapshotId: string, chunkBytes: Uint8Array) => Effect.Effect<number, SnapshotCacheError>
  /**
   * Appends the next chunk as the messages on `range`'s lines (see {@link chunkRanges}): the
   * cache keeps only where they are, and makes the chunk's line from the file for the readers
   * who ask for it (one read shared by readers who move together). Returns its index.
   */
  readonly appendRange: (snapshotId: string, range: FileRange) => Effect.Effect<number, SnapshotCacheError>
  /** Ends the entry; `end.chunkCount` must equal the chunks appended (else the entry fails too). */
  readonly markComplete: (snapshotId: string, end: SnapshotEnd) => Effect.Effect<void, SnapshotCacheError>
  /** Fails the entry: every waiter, present and future, gets `SnapshotFailed` with `error`. */
  readonly markFailed: (snapshotId: string, error: string) => Effect.Effect<void, SnapshotCacheError>
  /**
   * Takes a reader reference for the life of the scope (or until `release`). A disposed entry
   * cannot be retained; its existing readers keep every chunk until they release.
   */
  readonly retain: (snapshotId: string) => Effect.Effect<SnapshotReader, SnapshotCacheError, Scope.Scope>
  /** `retain` around one `waitForChunk`. */
  readonly waitForChunk: (snapshotId: string, index: number) => Effect.Effect<ChunkResult, SnapshotCacheError>
  /** A reader's chunks as a stream, retaining the entry from its start to its end. */
  readonly stream: (snapshotId: string) => Stream.Stream<Uint8Array, SnapshotCacheError>
  /**
   * Drops the entry once its last reader releases (at once when there is none): memory is
   * freed and the spill directory removed. An unfinished entry fails its waiters with `Disposed`.
   * Idempotent; an unknown snapshotId is not an error.
   */
  readonly dispose: (snapshotId: string) => Effect.Effect<void, SnapshotCacheError>
  /** The entry's current state. */
  readonly info: (snapshotId: string) => Effect.Effect<SnapshotInfo, SnapshotCacheError>
  /** The cache's current totals. */
  readonly stats: Effect.Effect<SnapshotCacheStats>
}

/** The snapshot cache service. */
export class SnapshotCache extends Context.Tag("agentd/SnapshotCache")<SnapshotCache, SnapshotCacheService>() {}

/** Options of the file-backed cache. */
export interface SnapshotCacheOptions {
  /** Directory that holds one spill directory per entry, e.g. `<stateDir>/snapshot-cache/<gen>`. */
  readonly cacheRoot: string
  /** Chunk bytes kept in memory across the whole cache before entries spill (default 4 MiB). */
  readonly memoryCacheBytes?: number | undefined
}

// ---------------------------------------------------------------------------------------------
// Spill paths
// ---------------------------------------------------------------------------------------------

/**
 * The spill directory name of a snapshotId: StateLayout's one sanitizer (so `.` and `/` never
 * appear, no name is `.` or `..`, and distinct ids give distinct names).
 */
export const spillDirectoryName = (snapshotId: string): string => StateLayout.safeSegment(snapshotId)

/**
 * A file-backed cache (scoped: closing the scope fails unfinished entries with `Closed` and removes
 * every spill directory). The cache root is created (0700) at the first spill, not before.
 */
export const make = (
  options: SnapshotCacheOptions
): Effect.Effect<SnapshotCacheService, never, FileSystem.FileSystem | Scope.Scope> =>
  Effect.flatMap(FileSystem.FileSystem, (fs) =>
    makeWith(
      options.memoryCacheBytes ?? DEFAULT_MEMORY_CACHE_BYTES,
      { fs, root: NodePath.resolve(options.cacheRoot) }
    ))

/** A memory-only cache (scoped), which never spills: for tests and embedding. */
export const makeMemory: Effect.Effect<SnapshotCacheService, never, Scope.Scope> = Effect.suspend(() =>
  makeWith(Number.POSITIVE_INFINITY, undefined)
)

/** The file-backed cache: memory up to `memoryCacheBytes` (default 4 MiB), then spills to `cacheRoot`. */
export const layer = (options: SnapshotCacheOptions): Layer.Layer<SnapshotCache, never, FileSystem.FileSystem> =>
  Layer.scoped(SnapshotCache, make(options))

/** The memory-only cache: never spills, unbounded; for tests and for embedding without a disk. */
export const layerMemory: Layer.Layer<SnapshotCache> = Layer.scoped(SnapshotCache, makeMemory)

