/**
 * A connection's outbound queue: lines are offered without waiting, one writer drains them to
 * the socket in batches (one write per batch: a write per line was 15x slower), and the byte count is what the
 * backpressure rules of docs/protocol.md section 5 look at.
 *
 * A batch is what was offered in one synchronous run (a `process.nextTick` after the first
 * offer), e.g. every session's delivery from one commit of the event log. The next batch goes as
 * soon as the kernel has taken the last one (at once, unless the socket is backed up). It used
 * to wait for a `setImmediate` after that: with a loaded daemon, whose turns of the event loop
 * take ~10 ms, every live event reached its client a turn of the loop late (200 streaming
 * sessions: 10-15 ms of the 30-40 ms from `emittedAt` to the client).
 */
import * as Effect from "effect/Effect"
import type * as net from "node:net"

export class Outbox {
  private items: Array<string | Uint8Array> = []
  private queued = 0
  /** The `done` callbacks of what `items` holds. */
  private dones: Array<() => void> = []
  /** A flush is scheduled (a `process.nextTick`). */
  private scheduled = false
  /** A batch was handed to the socket and the kernel has not taken all of it yet. */
  private writing = false
  private waiters: Array<{ readonly below: number; readonly resume: () => void }> = []
  private closed = false
  private endAfterFlush = false
  /** Set by `endWith`: nothing more is taken, what is queued is written, then the write side ends. */
  private sealed = false

  constructor(private readonly socket: net.Socket) {
    socket.on("close", () => this.close())
  }

  /** Bytes offered and not yet taken by the kernel. */
  get queuedBytes(): number {
    return this.queued
  }

  /** The socket is gone, or the connection takes nothing more (see `endWith`). */
  get isClosed(): boolean {
    return this.closed || this.sealed
  }

  /**
   * Queues a line (or pre-encoded bytes); never waits. Dropped once the socket is gone. `done`
   * runs once the socket holds `data` no more: the kernel took it, or it was dropped.
   */
  offer(data: string | Uint8Array, done?: () => void): void {
    if (this.isClosed) return done?.()
    this.items.push(data)
    if (done !== undefined) this.dones.push(done)
    this.queued += typeof data === "string" ? Buffer.byteLength(data) : data.byteLength
    this.flushSoon()
  }

  /** Flushes once the current synchronous run is over, so that what it offers goes as one batch. */
  private flushSoon() {
    if (this.scheduled || this.writing) return
    this.scheduled = true
    process.nextTick(() => {
      this.scheduled = false
      this.flush()
    })
  }

  /** Waits until fewer than `bytes` are queued (or the socket is gone). */
  awaitBelow(bytes: number): Effect.Effect<void> {
    return Effect.async<void>((resume) => {
      if (this.isClosed || this.queued < bytes) return resume(Effect.void)
      const waiter = { below: bytes, resume: () => resume(Effect.void) }
      this.waiters.push(waiter)
      return Effect.sync(() => {
        this.waiters = this.waiters.filter((w) => w !== waiter)
      })
    })
  }

  /** Ends the socket's write side once everything queued is written. */
  endWhenFlushed(): void {
    this.endAfterFlush = true
    if (!this.writing && !this.scheduled && this.items.length === 0) this.finish()
  }

  /**
   * Queues `data` as the last thing this connection gets (a delivery still running drops what it
   * offers after it), then ends the write side once everything queued is written.
   */
  endWith(data: string | Uint8Array): void {
    this.offer(data)
    this.sealed = true
    // Whoever waits for room to offer more stops waiting: nothing more is taken.
    this.wakeWaiters()
    this.endWhenFlushed()
  }

  private finish() {
    if (!this.closed && !this.socket.destroyed) this.socket.end()
  }

  private flush() {
    if (this.closed || this.writing) return
    if (this.socket.destroyed) return this.close()
    if (this.items.length === 0) {
      if (this.endAfterFlush) this.finish()
      return
    }
    this.writing = true
    const batch = this.items
    this.items = []
    const dones = this.dones
    this.dones = []
    // Runs of lines are joined as text and encoded once; pre-encoded chunks are kept as they are.
    const buffers: Array<Uint8Array> = []
    let text = ""
    for (const item of batch) {
      if (typeof item === "string") {
        text += item
        continue
      }
      if (text.length > 0) buffers.push(Buffer.from(text, "utf8"))
      text = ""
      buffers.push(item)
    }
    if (text.length > 0) buffers.push(Buffer.from(text, "utf8"))
    let size = 0
    for (const buf of buffers) size += buf.byteLength
    // The byte count drops only when the kernel has taken the batch: that is what bounds memory.
    const written = (error?: Error | null) => {
      this.writing = false
      this.queued -= size
      // The socket holds none of the batch's buffers any more (also after an error: its write
      // request is over).
      for (const done of dones) done()
      // A write that failed (the peer gone, the socket destroyed): what is queued is dropped and
      // the waiters released now, not at the socket's close event.
      if (error != null || this.socket.destroyed) return this.close()
      this.wakeWaiters()
      // What was offered meanwhile goes now (in its own batch, unless a flush is scheduled).
      if (!this.scheduled) this.flush()
    }
    // Several buffers go out corked, as one writev: the same bytes are shared by every client
    // of a session, and joining them per client was the fan-out's main cost (Buffer.concat).
    this.socket.cork()
    buffers.forEach((buf, i) => this.socket.write(buf, i === buffers.length - 1 ? written : undefined))
    this.socket.uncork()
  }

  private wakeWaiters() {
    if (this.waiters.length === 0) return
    const ready = this.waiters.filter((w) => this.isClosed || this.queued < w.below)
    if (ready.length === 0) return
    this.waiters = this.waiters.filter((w) => !ready.includes(w))
    for (const w of ready) w.resume()
  }

  /** The socket is gone: drop everything and release every waiter. */
  close(): void {
    if (this.closed) return
    this.closed = true
    this.items = []
    this.queued = 0
    // Dropped before any write: the socket never saw them. (A batch being written calls its
    // own when its write ends.)
    const dones = this.dones
    this.dones = []
    for (const done of dones) done()
    this.wakeWaiters()
  }
}
