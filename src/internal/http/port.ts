/**
 * A ConnectionPort for an HTTP response: the session core offers lines to it exactly as to a
 * socket's outbox (same attach, catch-up from the EventLog, pause and resume of a slow reader),
 * and the response's stream takes them. Bytes count as queued until the response takes them,
 * and the response takes the next batch only once the previous one was written (drained), so
 * a slow reader holds at most the outbox limit plus what the kernel buffers.
 */
import * as Effect from "effect/Effect"
import type { ConnectionPort } from "../../SessionManager.js"

const FRAME = '{"type":"session_snapshot_'
const FRAME_BYTES = Buffer.from(FRAME)

const isSnapshotFrame = (data: string | Uint8Array) =>
  typeof data === "string"
    ? data.startsWith(FRAME)
    : data.byteLength >= FRAME_BYTES.length && Buffer.from(data.buffer, data.byteOffset, FRAME_BYTES.length).equals(FRAME_BYTES)

export class StreamPort implements ConnectionPort {
  /** What the delivery's metrics read: an HTTP read counts the events it sends itself. */
  readonly transport = "http"
  private items: Array<string | Uint8Array> = []
  private queued = 0
  /** Bytes offered in all (for the budget). */
  private offered = 0

  /**
   * `budget`: the most bytes a one-page read will take. Once that much was offered the port
   * counts as full for good, so the session's catch-up stops reading the log for it (it would
   * otherwise read on up to the outbox limit, twice a page, for lines the page drops).
   */
  constructor(private readonly budget: number = Number.POSITIVE_INFINITY) {}

  /** The budget is spent: nothing more will be offered until the port closes. */
  get exhausted(): boolean {
    return this.offered >= this.budget
  }
  private closed = false
  private waiters: Array<{ readonly below: number; readonly resume: () => void }> = []
  private reader: (() => void) | undefined

  get queuedBytes(): number {
    return this.exhausted ? Number.MAX_SAFE_INTEGER : this.queued
  }

  get isClosed(): boolean {
    return this.closed
  }

  offer(data: string | Uint8Array): void {
    if (this.closed) return
    this.items.push(data)
    const bytes = typeof data === "string" ? Buffer.byteLength(data) : data.byteLength
    this.queued += bytes
    // A replacement snapshot's frames are passed over by a read from before a rewrite, not
    // returned: they do not spend the page's budget (or a large one would end the read).
    if (!isSnapshotFrame(data)) this.offered += bytes
    const reader = this.reader
    this.reader = undefined
    reader?.()
  }

  awaitBelow(bytes: number): Effect.Effect<void> {
    return Effect.async<void>((resume) => {
      if (this.closed || this.queuedBytes < bytes) return resume(Effect.void)
      const waiter = { below: bytes, resume: () => resume(Effect.void) }
      this.waiters.push(waiter)
      return Effect.sync(() => {
        this.waiters = this.waiters.filter((w) => w !== waiter)
      })
    })
  }

  /** Everything offered so far (possibly nothing); the bytes stop counting as queued. */
  takeAll(): Array<string | Uint8Array> {
    const items = this.items
    this.items = []
    this.queued = 0
    this.wake()
    return items
  }

  /** Waits until something is offered or the port closes. */
  readonly awaitItems: Effect.Effect<void> = Effect.async<void>((resume) => {
    if (this.closed || this.items.length > 0) return resume(Effect.void)
    this.reader = () => resume(Effect.void)
    return Effect.sync(() => {
      this.reader = undefined
    })
  })

  /** Resumes a reader waiting in `awaitItems` with nothing offered (its stream has something of its own to write). */
  nudge(): void {
    const reader = this.reader
    this.reader = undefined
    reader?.()
  }

  get hasItems(): boolean {
    return this.items.length > 0
  }

  /** The response is gone: nothing more is taken, every waiter is released. */
  close(): void {
    if (this.closed) return
    this.closed = true
    this.items = []
    this.queued = 0
    this.wake()
    const reader = this.reader
    this.reader = undefined
    reader?.()
  }

  private wake() {
    if (this.waiters.length === 0) return
    const ready = this.waiters.filter((w) => this.closed || this.queuedBytes < w.below)
    this.waiters = this.waiters.filter((w) => !ready.includes(w))
    for (const w of ready) w.resume()
  }
}
