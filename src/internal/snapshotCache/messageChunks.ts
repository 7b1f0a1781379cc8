/**
 * Chunking of a snapshot's messages into `session_snapshot_chunk` lines (docs/protocol.md
 * section 5) from messages in memory: pure, no file or Effect. Apart from ./chunking.ts (which
 * re-exports it and chunks transcript files) because a worker chunks its snapshots with it, and
 * ./chunking.ts's file reading would load the file system layer, and with it `node:crypto`
 * (~2 MB of a worker's RSS), into every worker.
 */

/** The protocol's default chunk budget (docs/protocol.md section 5): 512 KiB. */
export const DEFAULT_TARGET_CHUNK_BYTES = 524_288

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
export class ChunkBudget {
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
