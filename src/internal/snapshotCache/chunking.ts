/**
 * Chunking of a snapshot's messages into `session_snapshot_chunk` lines (docs/protocol.md
 * section 5): from messages in memory (./messageChunks.ts, re-exported here), or from a transcript
 * file's byte ranges. The public module, ../../SnapshotCache.ts, re-exports it.
 */
import * as Effect from "effect/Effect"
import { type FileRange, SnapshotCacheError, type SnapshotCacheErrorReason } from "../../SnapshotCache.js"
import * as FileIo from "../fileIo.js"
import { ChunkBudget } from "./messageChunks.js"

export { ChunkBudget, ChunkBuilder, chunkMessages, DEFAULT_TARGET_CHUNK_BYTES } from "./messageChunks.js"

export const NEWLINE = 0x0a

/** A SnapshotCacheError (the cache's too). */
export const error = (reason: SnapshotCacheErrorReason, message: string, snapshotId?: string, cause?: unknown) =>
  new SnapshotCacheError({
    reason,
    message,
    ...(snapshotId !== undefined ? { snapshotId } : {}),
    ...(cause !== undefined ? { cause } : {})
  })

/** The default in-memory budget of a file-backed cache (docs/protocol.md section 6): 4 MiB. */
export const DEFAULT_MEMORY_CACHE_BYTES = 4 * 1024 * 1024

/**
 * The chunks of the messages on lines `[start, end)` of a file (one JSON message per
 * `\n`-terminated line), as the byte ranges of their lines, chunked by the rule of
 * {@link chunkMessages}; and the number of messages. Only newlines are looked at: the file is
 * read in blocks, never decoded.
 */
export const chunkRanges = (
  path: string,
  start: number,
  end: number,
  targetChunkBytes: number,
  onChunk: (range: FileRange) => Effect.Effect<unknown, SnapshotCacheError>
): Effect.Effect<{ readonly chunks: number; readonly messages: number }, SnapshotCacheError> =>
  Effect.gen(function*() {
    const handle = yield* Effect.acquireRelease(
      FileIo.open(path, "r").pipe(
        Effect.mapError((e) => error("Io", `could not open ${path}: ${String(e.cause)}`, undefined, e.cause))
      ),
      (h) => Effect.promise(() => h.close().catch(() => undefined))
    )
    const block = Buffer.allocUnsafe(1024 * 1024)
    let chunks = 0
    let messages = 0
    let chunkStart = start
    let lineStart = start
    const budget = new ChunkBudget(targetChunkBytes)
    for (let position = start; position < end;) {
      const { bytesRead } = yield* Effect.tryPromise({
        try: () => handle.read(block, 0, Math.min(block.length, end - position), position),
        catch: (cause) => error("Io", `could not read ${path}: ${String(cause)}`, undefined, cause)
      })
      if (bytesRead === 0) return yield* Effect.fail(error("Io", `${path} ends before byte ${end}`))
      for (let at = block.indexOf(NEWLINE); at !== -1 && at < bytesRead; at = block.indexOf(NEWLINE, at + 1)) {
        const lineEnd = position + at + 1
        const bytes = lineEnd - 1 - lineStart
        if (budget.isFullFor(bytes)) {
          yield* onChunk({ path, start: chunkStart, end: lineStart })
          chunks++
          chunkStart = lineStart
          budget.reset()
        }
        budget.add(bytes)
        messages++
        lineStart = lineEnd
      }
      position += bytesRead
    }
    if (lineStart !== end) return yield* Effect.fail(error("Io", `${path}: bytes ${start}-${end} do not end with a whole line`))
    if (budget.count > 0) {
      yield* onChunk({ path, start: chunkStart, end: lineStart })
      chunks++
    }
    return { chunks, messages }
  }).pipe(Effect.scoped)
