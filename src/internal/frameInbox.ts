/**
 * A worker's frames on their way from its pipe to the one fiber that takes them (WorkerPool's
 * worker handles): raw chunks queued off the JS heap, decoded a bounded take at a time.
 */
import * as Effect from "effect/Effect"
import { isBlankBytes, LineDecoder } from "../JsonLines.js"
import * as WorkerProtocol from "../WorkerProtocol.js"

/** Bytes read from a worker and not yet taken past which the link stops reading (backpressure). */
export const HIGH_WATER_BYTES = 4 * 1024 * 1024

/**
 * Bytes of lines one take decodes at most (about one publish batch: see PUBLISH_BATCH_BYTES).
 * The rest stays as read, off the JS heap, until the next take.
 */
export const TAKE_BYTES = 256 * 1024

const LF = 10

/** For chunks inside a line: they complete none. */
const noLine = () => {}

/**
 * Holds a worker's bytes as read and hands them to the one fiber that takes them, decoded into
 * frames a bounded take at a time. Decoding when taken, not when read, is for the heap: a
 * worker runs ahead of the daemon (a turn's events come faster than they are logged and sent),
 * and frames decoded as they arrived waited as JS objects through the group commits before
 * them, survived the young generation's collections and were promoted (bench/hotPath.ts: a
 * third of a warm turn's daemon CPU was GC). Raw chunks wait outside the heap instead.
 */
export class FrameInbox {
  private readonly decoder = new LineDecoder(Number.MAX_SAFE_INTEGER)
  /** Chunks read and not yet decoded, oldest first. */
  private chunks: Array<Uint8Array> = []
  private chunkBytes = 0
  private ended = false
  private wake: (() => void) | undefined

  constructor(
    private readonly warn: (message: string) => void,
    /** Called when the bytes waiting pass HIGH_WATER_BYTES, and when a take brings them under. */
    private readonly flow: { readonly pause: () => void; readonly resume: () => void }
  ) {}

  push(chunk: Uint8Array): void {
    if (chunk.length === 0) return
    const completesLine = chunk.indexOf(LF) !== -1
    if (!completesLine && this.chunks.length === 0) {
      // Inside a long line, with nothing before it left to decode: the decoder keeps it (a view,
      // off the heap) until the line ends, and it holds back no frame. Queued, a line longer
      // than HIGH_WATER_BYTES would pause the pipe before the newline that completes it came
      // (behind queued chunks it can: the next take, finding no frame, decodes them all).
      this.decoder.pushLines(chunk, noLine)
      return
    }
    this.chunks.push(chunk)
    this.chunkBytes += chunk.length
    if (this.chunkBytes > HIGH_WATER_BYTES) this.flow.pause()
    // A chunk inside a long line completes no frame: nothing to hand over yet.
    if (completesLine) this.notify()
  }

  end(): void {
    this.ended = true
    this.notify()
  }

  private notify() {
    const wake = this.wake
    this.wake = undefined
    wake?.()
  }

  /**
   * Decodes the oldest chunks, about TAKE_BYTES of them, into frames; all of them when those
   * give none (inside a long line), so that a take that finds nothing leaves nothing queued.
   */
  private decode(): Array<WorkerProtocol.ReceivedFrame> {
    const frames: Array<WorkerProtocol.ReceivedFrame> = []
    let used = 0
    let bytes = 0
    const onLine = (buf: Buffer, start: number, end: number) => {
      if (isBlankBytes(buf, start, end)) return
      try {
        frames.push(WorkerProtocol.readWorkerBytes(buf, start, end))
      } catch {
        this.warn(`unreadable frame dropped: ${buf.toString("utf8", start, Math.min(end, start + 200))}`)
      }
    }
    while (used < this.chunks.length && (bytes < TAKE_BYTES || frames.length === 0)) {
      const chunk = this.chunks[used++]!
      bytes += chunk.length
      this.decoder.pushLines(chunk, onLine)
    }
    this.chunks = used === this.chunks.length ? [] : this.chunks.slice(used)
    this.chunkBytes -= bytes
    if (this.chunkBytes <= HIGH_WATER_BYTES) this.flow.resume()
    return frames
  }

  /**
   * The next frames, if any is here: undefined while none is (see {@link whenReady}); an empty
   * array once the pipe has ended and every frame was taken.
   */
  takeNow(): Array<WorkerProtocol.ReceivedFrame> | undefined {
    const frames = this.decode()
    // Chunks inside a long line gave nothing: wait for the chunk that ends it.
    return frames.length === 0 && !this.ended ? undefined : frames
  }

  /**
   * Calls `wake` once, when frames may be here (a line completed, or the pipe ended), in place of
   * an earlier one; returns a function that forgets it.
   */
  whenReady(wake: () => void): () => void {
    const once = () => wake()
    this.wake = once
    return () => {
      if (this.wake === once) this.wake = undefined
    }
  }

  /** The next frames; none once the pipe has ended and every frame was taken. */
  readonly take: Effect.Effect<Array<WorkerProtocol.ReceivedFrame>> = Effect.async((resume) => {
    let forget = () => {}
    const deliver = () => {
      const frames = this.takeNow()
      if (frames === undefined) forget = this.whenReady(deliver)
      else resume(Effect.succeed(frames))
    }
    deliver()
    return Effect.sync(() => forget())
  })
}

