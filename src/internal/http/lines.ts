/**
 * What an HTTP reader makes of the lines the session core offers its port: the sequenced
 * messages (with their cursors, read from the line's end without parsing it), a history
 * rewrite (the replacement snapshot's frames, reduced to its id), or a loss (a resync: the
 * events the reader lacked were pruned while it was paused), which ends an HTTP read.
 */
import * as Cursor from "../../Cursor.js"

export type Item =
  | { readonly _tag: "Event"; readonly line: string; readonly cursor: Cursor.Cursor }
  | { readonly _tag: "Rewrite"; readonly snapshotId: string; readonly cursor: Cursor.Cursor | undefined }
  | { readonly _tag: "Lost"; readonly reason: string }

/** How a `session_closed` line starts: a session's last line. */
const CLOSED = '{"type":"session_closed"'
const SEQUENCED = ['{"type":"session_event"', '{"type":"session_status"', CLOSED]
const META = ',"meta":{"cursor":{"generation":'
const META_PATTERN = /^,"meta":\{"cursor":\{"generation":(\d+),"sequence":(\d+)\}/

/** The cursor of a sequenced wire line: its `meta` is the line's last field (wireLines.ts). */
export const cursorOfLine = (line: string): Cursor.Cursor | undefined => {
  const at = line.lastIndexOf(META)
  if (at < 0) return undefined
  const m = META_PATTERN.exec(line.slice(at, at + 80))
  return m === null ? undefined : Cursor.make(Number(m[1]), Number(m[2]))
}

const decoder = new TextDecoder()

const SEQUENCED_BYTES = SEQUENCED.map((p) => Buffer.from(p))
const CLOSED_BYTES = Buffer.from(CLOSED)

/** Do the bytes at `at` start with `prefix`? */
const startsWithAt = (bytes: Uint8Array, at: number, prefix: Uint8Array): boolean => {
  if (at + prefix.length > bytes.length) return false
  for (let i = 0; i < prefix.length; i++) if (bytes[at + i] !== prefix[i]) return false
  return true
}

/** Is the line starting at `at` a sequenced message (what {@link LineSorter} sorts as an Event)? */
export const isSequencedAt = (bytes: Uint8Array, at: number): boolean => {
  for (let i = 0; i < SEQUENCED_BYTES.length; i++) if (startsWithAt(bytes, at, SEQUENCED_BYTES[i]!)) return true
  return false
}

/** Is this line a `session_closed` (a session's last line)? */
export const isClosedLine = (line: string): boolean => line.startsWith(CLOSED)

/** Is the line starting at `at` a `session_closed` (a session's last line)? */
export const isClosedAt = (bytes: Uint8Array, at: number): boolean => startsWithAt(bytes, at, CLOSED_BYTES)

export class LineSorter {
  private carry = ""
  /** The replacement snapshot whose frames are being passed over. */
  private rewrite: { readonly snapshotId: string; readonly cursor: Cursor.Cursor | undefined } | undefined
  private skipping = false

  /** Sorts what was offered (whole lines, possibly several in one piece) into `out`. */
  push(data: string | Uint8Array, out: Array<Item>): void {
    const text = this.carry + (typeof data === "string" ? data : decoder.decode(data))
    let start = 0
    for (;;) {
      const nl = text.indexOf("\n", start)
      if (nl < 0) break
      this.line(text.slice(start, nl), out)
      start = nl + 1
    }
    this.carry = text.slice(start)
  }

  private line(line: string, out: Array<Item>): void {
    if (SEQUENCED.some((p) => line.startsWith(p))) {
      const cursor = cursorOfLine(line)
      if (cursor !== undefined) out.push({ _tag: "Event", line, cursor })
      return
    }
    if (line.startsWith('{"type":"session_snapshot_chunk"')) return
    if (line.startsWith('{"type":"session_snapshot_begin"')) {
      const begin = JSON.parse(line) as { snapshotId: string; purpose: string; cursor?: Cursor.Cursor }
      this.skipping = true
      if (begin.purpose === "replacement") this.rewrite = { snapshotId: begin.snapshotId, cursor: begin.cursor }
      // A resync: events after what the reader has were pruned while it was paused.
      else if (begin.purpose === "resync") out.push({ _tag: "Lost", reason: "resync" })
      return
    }
    if (line.startsWith('{"type":"session_snapshot_end"')) {
      if (this.rewrite !== undefined) out.push({ _tag: "Rewrite", ...this.rewrite })
      this.rewrite = undefined
      this.skipping = false
      return
    }
    if (line.startsWith('{"type":"session_snapshot_failed"')) {
      out.push({ _tag: "Lost", reason: "snapshot_failed" })
    }
    // session_attached and anything else: not part of the event stream.
  }

  get inSnapshot(): boolean {
    return this.skipping
  }

  /** Part of a line is held, or snapshot frames are being passed over: the next piece is not whole. */
  get pending(): boolean {
    return this.carry.length > 0 || this.skipping
  }
}
