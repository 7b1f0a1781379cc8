/**
 * JSON-lines framing (docs/protocol.md section 1): bytes to lines and messages to bytes.
 *
 * Inbound: `\n` ends a line, a `\r` before it is dropped, a last line without `\n` still counts,
 * empty and whitespace-only lines are skipped, UTF-8 split across chunks is reassembled (invalid
 * bytes become U+FFFD). A line longer than `maxLineBytes` yields one {@link LineTooLong}, which
 * keeps a copy of the line's first bytes (at most {@link TOO_LONG_HEAD_BYTES}: enough to read its
 * id), and the rest of it is discarded without being buffered, so the next line decodes normally.
 *
 * The decoder is linear in the input: it keeps the pieces of a pending line in a list and joins
 * them once, so a 64 MiB line arriving in 1-byte chunks costs the same per byte as one chunk.
 */
import * as Chunk from "effect/Chunk"
import * as Stream from "effect/Stream"

/** Default bound of one inbound line: 16 MiB. */
export const DEFAULT_MAX_LINE_BYTES = 16 * 1024 * 1024

/**
 * How many of a too-long line's first bytes {@link LineTooLong} keeps (or `maxLineBytes`, when
 * smaller: a line over the limit always has that many, however its bytes arrive).
 */
export const TOO_LONG_HEAD_BYTES = 64 * 1024

/** Reported, once, in place of a line longer than the limit. */
export class LineTooLong {
  readonly _tag = "LineTooLong"
  constructor(
    /** The limit that was exceeded. */
    readonly maxLineBytes: number,
    /**
     * The line's first `min(TOO_LONG_HEAD_BYTES, maxLineBytes)` bytes (a copy), from which its
     * id may still be read; the same whatever the chunks the line came in.
     */
    readonly head: Uint8Array = new Uint8Array(0)
  ) {}
}

/** One unit of decoded input: a line's text (without its terminator), or a too-long marker. */
export type LineItem = string | LineTooLong

const LF = 0x0a
const CR = 0x0d

/** True for lines that carry nothing but whitespace. */
const isBlank = (text: string): boolean => {
  for (let i = 0; i < text.length; i++) {
    const c = text.charCodeAt(i)
    // space, \t, \n, \v, \f, \r
    if (c !== 0x20 && (c < 0x09 || c > 0x0d)) return text.trim() === ""
  }
  return true
}

/** True for a line of bytes that carries nothing but whitespace (as {@link isBlank}, for ASCII whitespace). */
export const isBlankBytes = (buf: Uint8Array, start: number, end: number): boolean => {
  for (let i = start; i < end; i++) {
    const c = buf[i]!
    if (c !== 0x20 && (c < 0x09 || c > 0x0d)) return false
  }
  return true
}

/**
 * A stateful bytes-to-lines decoder. `push` each chunk as it arrives, `end` once at end of
 * stream. Each call returns the items completed by it.
 */
export class LineDecoder {
  private pieces: Array<Uint8Array> = []
  private pendingBytes = 0
  private discarding = false

  constructor(readonly maxLineBytes: number = DEFAULT_MAX_LINE_BYTES) {}

  push(chunk: Uint8Array): Array<LineItem> {
    const out: Array<LineItem> = []
    this.scan(chunk, textInto(out), out)
    return out
  }

  /**
   * Like {@link push}, for a reader that takes each line's bytes instead of its text: `onLine`
   * gets a buffer and the line's range in it (a view of the chunk, or a buffer of its own for a
   * line that came in several chunks), `\r` and empty lines dropped. The bytes are the line's
   * as received, not checked as UTF-8, and whitespace-only lines are not skipped. A too-long
   * line is dropped (a reader that must report it uses push).
   */
  pushLines(chunk: Uint8Array, onLine: (buf: Buffer, start: number, end: number) => void): void {
    this.scan(chunk, onLine, undefined)
  }

  private scan(chunk: Uint8Array, onLine: (buf: Buffer, start: number, end: number) => void, tooLong: Array<LineItem> | undefined): void {
    const buf = Buffer.isBuffer(chunk) ? chunk : Buffer.from(chunk.buffer, chunk.byteOffset, chunk.byteLength)
    let start = 0
    while (start < buf.length) {
      const nl = buf.indexOf(LF, start)
      const end = nl === -1 ? buf.length : nl
      if (this.discarding) {
        // Skip the rest of a too-long line without keeping any of it.
      } else if (this.pendingBytes + (end - start) > this.maxLineBytes) {
        if (tooLong !== undefined) tooLong.push(new LineTooLong(this.maxLineBytes, this.headOf(buf.subarray(start, end))))
        this.pieces = []
        this.pendingBytes = 0
        this.discarding = true
      } else if (nl !== -1 && this.pieces.length === 0) {
        // The common case, a whole line inside one chunk: straight from the chunk.
        emitRange(buf, start, end, onLine)
      } else if (end > start) {
        this.pieces.push(buf.subarray(start, end))
        this.pendingBytes += end - start
      }
      if (nl === -1) break
      if (this.discarding) {
        this.discarding = false
      } else if (this.pieces.length > 0) {
        this.flushPieces(onLine)
      }
      start = nl + 1
    }
  }

  /** Ends the stream: a last line without `\n` still counts. */
  end(): Array<LineItem> {
    const out: Array<LineItem> = []
    if (!this.discarding && this.pieces.length > 0) this.flushPieces(textInto(out))
    this.pieces = []
    this.pendingBytes = 0
    this.discarding = false
    return out
  }

  /** A copy of the first bytes of the pending line followed by `rest` (see {@link LineTooLong}). */
  private headOf(rest: Uint8Array): Uint8Array {
    const size = Math.min(TOO_LONG_HEAD_BYTES, this.maxLineBytes)
    const head = Buffer.alloc(size)
    let at = 0
    for (const piece of [...this.pieces, rest]) {
      if (at >= size) break
      const n = Math.min(piece.length, size - at)
      head.set(piece.subarray(0, n), at)
      at += n
    }
    return head.subarray(0, at)
  }

  private flushPieces(onLine: (buf: Buffer, start: number, end: number) => void): void {
    const joined = this.pieces.length === 1 ? this.pieces[0]! : Buffer.concat(this.pieces, this.pendingBytes)
    this.pieces = []
    this.pendingBytes = 0
    const buf = Buffer.isBuffer(joined) ? joined : Buffer.from(joined.buffer, joined.byteOffset, joined.byteLength)
    emitRange(buf, 0, buf.length, onLine)
  }
}

/** Decodes each line it is given and adds it to `out`, unless it is blank (push's lines). */
const textInto = (out: Array<LineItem>) => (buf: Buffer, start: number, end: number): void => {
  const text = buf.toString("utf8", start, end)
  if (!isBlank(text)) out.push(text)
}

/** Hands on a line's range, without its `\r`, unless it is empty. */
const emitRange = (buf: Buffer, start: number, end: number, onLine: (buf: Buffer, start: number, end: number) => void): void => {
  if (end > start && buf[end - 1] === CR) end--
  if (end > start) onLine(buf, start, end)
}

/** Splits all of `input` into line items at once (for tests and tools). */
export const splitAll = (input: Iterable<Uint8Array>, maxLineBytes?: number): Array<LineItem> => {
  const decoder = new LineDecoder(maxLineBytes)
  const out: Array<LineItem> = []
  for (const chunk of input) out.push(...decoder.push(chunk))
  out.push(...decoder.end())
  return out
}

/** A Stream transform from bytes to line items. */
export const splitLines = (options?: { readonly maxLineBytes?: number | undefined }) =>
<E, R>(self: Stream.Stream<Uint8Array, E, R>): Stream.Stream<LineItem, E, R> =>
  Stream.suspend(() => {
    const decoder = new LineDecoder(options?.maxLineBytes ?? DEFAULT_MAX_LINE_BYTES)
    return self.pipe(
      Stream.mapChunks((chunk) => {
        const out: Array<LineItem> = []
        for (const bytes of chunk) {
          const items = decoder.push(bytes)
          for (let i = 0; i < items.length; i++) out.push(items[i]!)
        }
        return Chunk.unsafeFromArray(out)
      }),
      Stream.concat(Stream.suspend(() => Stream.fromIterable(decoder.end())))
    )
  })

/** Encodes values as JSON lines into one buffer, ready for a single write. */
export const encodeBatch = (values: Iterable<unknown>): Uint8Array => {
  let text = ""
  for (const value of values) text += JSON.stringify(value) + "\n"
  return Buffer.from(text, "utf8")
}

/**
 * A Stream transform from values to bytes that batches: every chunk of values that is
 * available at once becomes one buffer (one write), instead of one write per line.
 */
export const encodeLines = <A, E, R>(self: Stream.Stream<A, E, R>): Stream.Stream<Uint8Array, E, R> =>
  Stream.mapChunks(self, (chunk) => (Chunk.isEmpty(chunk) ? Chunk.empty() : Chunk.of(encodeBatch(chunk))))
