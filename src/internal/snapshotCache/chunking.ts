/**
 * Chunking of a snapshot's messages into `session_snapshot_chunk` lines (docs/protocol.md
 * section 5): from messages in memory, or from a transcript file's byte ranges. The public
 * module, ../../SnapshotCache.ts, re-exports it.
 */
import * as Effect from "effect/Effect"
import { type FileRange, SnapshotCacheError, type SnapshotCacheErrorReason } from "../../SnapshotCache.js"
import * as FileIo from "../fileIo.js"

export const NEWLINE = 0x0a

/** A SnapshotCacheError (the cache's too). */
export const error = (reason: SnapshotCacheErrorReason, message: string, snapshotId?: string, cause?: unknown) =>
  new SnapshotCacheError({
    reason,
    message,
    ...(snapshotId !== undefined ? { snapshotId } : {}),
    ...(cause !== undefined ? { cause } : {})
  })

/** The protocol's default chunk budget (docs/protocol.md section 5): 512 KiB. */
export const DEFAULT_TARGET_CHUNK_BYTES = 524_288

/** The default in-memory budget of a file-backed cache (docs/protocol.md section 6): 4 MiB. */
export const DEFAULT_MEMORY_CACHE_BYTES = 4 * 1024 * 1024

/**
 * Splits a snapshot's messages into `session_snapshot_chunk` lines, each encoded once.
 *
 * Size measure: a chunk's size is the UTF-8 byte length of `JSON.stringify(chunkMessages)`, that
 * is `2 + sum(bytes(JSON.stringify(m))) + (n - 1)` for its `n` messages (the brackets and the
 * commas count, the frame around the array does not). Chunks are filled greedily in order: a
 * message joins the current chunk when the chunk stays `<= targetChunkBytes`, otherwise it starts
 * the next one; a message whose own array (`[m]`) is larger than the target travels alone.
 * Zero messages give zero chunks.
 *
 * Each result is the exact line
 * `{"type":"session_snapshot_chunk","activeSessionId":..,"snapshotId":..,"index":i,"messages":[..]}\n`
 * as UTF-8 bytes, ready for `SnapshotCache.appendChunk` and for the socket, never re-encoded.
 * Every message is stringified exactly once and every chunk is joined once: linear time.
 * Values JSON cannot represent inside an array (`undefined`, functions) become `null`, as in
 * `JSON.stringify([..])`; a value JSON.stringify rejects (a BigInt, a cycle) throws its TypeError.
 *
 * @throws RangeError when `targetChunkBytes` is not a positive integer.
 */
export const chunkMessages = (
  activeSessionId: string,
  snapshotId: string,
  messages: ReadonlyArray<unknown>,
  targetChunkBytes: number = DEFAULT_TARGET_CHUNK_BYTES
): Array<Uint8Array> => {
  const builder = new ChunkBuilder(activeSessionId, snapshotId, targetChunkBytes)
  const chunks: Array<Uint8Array> = []
  for (const message of messages) {
    const done = builder.add(JSON.stringify(message) ?? "null")
    if (done !== undefined) chunks.push(done)
  }
  const last = builder.finish()
  if (last !== undefined) chunks.push(last)
  return chunks
}

/**
 * The incremental form of {@link chunkMessages}, fed with messages already encoded as JSON (a
 * transcript's lines): `add` returns a chunk line when one is full, `finish` the last one. Lets a
 * snapshot be chunked while it is read from disk, without holding it whole.
 */
/**
 * The chunking rule of {@link chunkMessages}, on message sizes alone: the current chunk's array
 * bytes ("[" + "]", each message, the commas between them), and whether the next message must
 * start a new chunk. Shared by every producer, so their chunk boundaries are the same.
 */
class ChunkBudget {
  private size = 2
  count = 0

  constructor(readonly targetChunkBytes: number) {}

  /** True when a message of `bytes` does not fit in the current (non-empty) chunk. */
  isFullFor(bytes: number): boolean {
    return this.count > 0 && this.size + 1 + bytes > this.targetChunkBytes
  }

  add(bytes: number): void {
    this.size += this.count > 0 ? bytes + 1 : bytes
    this.count++
  }

  reset(): void {
    this.size = 2
    this.count = 0
  }
}

export class ChunkBuilder {
  private readonly prefix: string
  private parts: Array<string> = []
  private readonly budget: ChunkBudget
  private index = 0

  constructor(activeSessionId: string, snapshotId: string, readonly targetChunkBytes: number = DEFAULT_TARGET_CHUNK_BYTES) {
    if (!Number.isSafeInteger(targetChunkBytes) || targetChunkBytes <= 0) {
      throw new RangeError(`targetChunkBytes must be a positive integer, got ${targetChunkBytes}`)
    }
    this.prefix = `{"type":"session_snapshot_chunk","activeSessionId":${JSON.stringify(activeSessionId)},` +
      `"snapshotId":${JSON.stringify(snapshotId)},"index":`
    this.budget = new ChunkBudget(targetChunkBytes)
  }

  /** How many chunks were produced so far. */
  get chunkCount(): number {
    return this.index
  }

  /** Adds one message's JSON; returns the previous chunk if this message did not fit in it. */
  add(json: string): Uint8Array | undefined {
    const bytes = Buffer.byteLength(json, "utf8")
    const full = this.budget.isFullFor(bytes) ? this.flush() : undefined
    this.budget.add(bytes)
    this.parts.push(json)
    return full
  }

  /** The last, partly filled chunk, if any message is left. */
  finish(): Uint8Array | undefined {
    return this.parts.length > 0 ? this.flush() : undefined
  }

  private flush(): Uint8Array {
    const chunk = Buffer.from(`${this.prefix}${this.index++},"messages":[${this.parts.join(",")}]}\n`, "utf8")
    this.parts = []
    this.budget.reset()
    return chunk
  }
}

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
