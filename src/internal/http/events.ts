/**
 * `GET /v1/sessions/:id/events` (docs/protocol.md section 10): the Durable Streams read protocol
 * over the socket's own delivery. A read attaches a {@link StreamPort} to the session with the
 * offset's cursor as its resume cursor: the replay decision, the catch-up from the EventLog, the
 * turn to live delivery without gap or duplicate, the pause and log re-read of a slow reader and
 * the replacement snapshot of a history rewrite are all the socket's (internal/delivery). This
 * module only turns what the port receives into JSON arrays or SSE events.
 */
import * as Chunk from "effect/Chunk"
import * as Clock from "effect/Clock"
import * as Data from "effect/Data"
import * as Effect from "effect/Effect"
import * as Option from "effect/Option"
import * as Stream from "effect/Stream"
import * as Cursor from "../../Cursor.js"
import * as Metrics from "../../Metrics.js"
import type { EventLogService } from "../../EventLog.js"
import type * as Protocol from "../../Protocol.js"
import type { CommandError } from "../../SessionManager.js"
import { wireLineOfRecord } from "../delivery/wireLines.js"
import { cursorOfLine, isClosedAt, isClosedLine, isSequencedAt, type Item, LineSorter } from "./lines.js"
import * as Offset from "./offset.js"
import { StreamPort } from "./port.js"

/** A read that cannot be served: its error code and message (statuses in errors.ts). */
export class ReadRefused extends Data.TaggedError("ReadRefused")<{
  readonly code: string
  readonly message: string
  readonly headers: Record<string, string>
}> {}

const readRefused = (code: string, message: string, headers: Record<string, string> = {}) => new ReadRefused({ code, message, headers })

/** What a read needs of the SessionManager: the socket's attach and detach. */
export interface Attacher {
  readonly getState: (id: string) => Effect.Effect<Protocol.SessionSummary, CommandError>
  readonly attach: (
    connectionId: string,
    port: StreamPort,
    cmd: Protocol.CommandOf<"attach">
  ) => Effect.Effect<{ readonly data: Protocol.DaemonAttachResult; readonly deliver: Effect.Effect<void> }, CommandError>
  readonly detachAll: (connectionId: string) => Effect.Effect<void>
}

/** An attached read: its port, where it starts and the session's tail when it attached. */
export interface Reader {
  readonly port: StreamPort
  readonly sorter: LineSorter
  /** Items to hand out before the port's (the very first event, for a read from the start). */
  readonly pending: Array<Item>
  /** The offset the read starts after (undefined: before the first event). */
  readonly from: Cursor.Cursor | undefined
  /** The session's last event when the read attached. */
  readonly target: Cursor.Cursor | undefined
  /**
   * The offset is from before a history rewrite: the read starts with the rewrite (the
   * replacement snapshot's frames, sorted into a Rewrite item), then the events after it.
   */
  readonly rewritten: boolean
}

const CAPABILITIES = ["attach_snapshot", "event_sequence", "slim_attach", "chunked_snapshot"]

/** The snapshot link of a 410 (and of a rewrite's control event). */
export const snapshotLink = (id: string, snapshotId?: string) =>
  `/v1/sessions/${encodeURIComponent(id)}/snapshot${snapshotId === undefined ? "" : `?id=${encodeURIComponent(snapshotId)}`}`

const gone = (id: string, why: string) =>
  readRefused("offset_gone", `${why}; read the session's snapshot, then follow on from the offset it ends with.`, {
    link: `<${snapshotLink(id)}>; rel="snapshot"`
  })

/** How a read is to go on. */
export interface ReaderOptions {
  /** For a one-page read: the most bytes it takes (see StreamPort); none for a stream. */
  readonly budget?: number
}

/**
 * Attaches a read of session `id` after `requested`, in the current scope (closing it detaches).
 * Fails with the socket's error for the session (not found, damaged) or a ReadRefused.
 */
export const openReader = (
  manager: Attacher,
  log: EventLogService,
  connectionId: string,
  id: string,
  requested: Offset.Requested,
  { budget }: ReaderOptions = {}
): Effect.Effect<Reader, CommandError | ReadRefused, import("effect/Scope").Scope> =>
  Effect.gen(function*() {
    for (let attempt = 0;; attempt++) {
      const state = yield* manager.getState(id)
      const last = state.lastEventCursor
      let resume: Cursor.Cursor | undefined
      const pending: Array<Item> = []
      if (requested._tag === "After") {
        resume = requested.cursor
      } else if (requested._tag === "Now") {
        resume = last
      } else if (last !== undefined) {
        // From the start: the first event, then the events after it. The socket's attach has
        // no cursor for "before the first event", so the first one is read here.
        const first = yield* log.read(id).pipe(Stream.take(1), Stream.runHead, Effect.orElseSucceed(() => Option.none()))
        if (Option.isNone(first) || !Cursor.equals(first.value.cursor, Cursor.initial)) {
          return yield* Effect.fail(gone(id, "The first events of this session were pruned"))
        }
        resume = first.value.cursor
        pending.push({ _tag: "Event", line: wireLineOfRecord(JSON.stringify(id), first.value, true).slice(0, -1), cursor: resume })
      }
      const port = new StreamPort(budget)
      yield* Effect.addFinalizer(() => Effect.zipRight(Effect.sync(() => port.close()), manager.detachAll(connectionId)))
      const outcome = yield* manager.attach(connectionId, port, {
        type: "attach",
        activeSessionId: id,
        capabilities: CAPABILITIES,
        ...(resume === undefined ? {} : { resumeCursor: resume })
      })
      const replay = outcome.data.replay
      if (resume !== undefined && replay.status !== "complete") {
        if (replay.reason === "cursor_expired") return yield* Effect.fail(gone(id, "The events after this offset were pruned"))
        if (replay.reason !== "transcript_replaced") {
          return yield* Effect.fail(readRefused("invalid_offset", `The offset names no event of this session (${replay.reason}).`))
        }
        // Not a 410, in every read mode: the offset a rewrite's snapshot ends with is its
        // cursor, which is also an offset of the history before the rewrite, so only the
        // snapshot's id tells a reader that already holds it (from the snapshot route) from one
        // that does not; and an EventSource cannot get past a 410. The read says which snapshot
        // (the replacement's frames, sorted into a rewrite control), and the reader decides.
      }
      if (resume === undefined && outcome.data.snapshot.cursor !== undefined) {
        // Events came (and a checkpoint) between the state read and the attach: the baseline
        // is not the stream's start any more. Again, now with a first event to start from.
        yield* manager.detachAll(connectionId)
        port.close()
        if (attempt < 3) continue
        return yield* Effect.fail(readRefused("internal", "The session changed under the read; try again."))
      }
      // Interruptible whatever the caller's region is (a forked fiber inherits it): closing the
      // read's scope must be able to stop it.
      yield* Effect.forkScoped(Effect.interruptible(outcome.deliver))
      return {
        port,
        sorter: new LineSorter(),
        pending,
        from: resume,
        target: outcome.data.lastEventCursor,
        rewritten: resume !== undefined && replay.status !== "complete"
      } satisfies Reader
    }
  })

/** Items from the port (after the pending ones), waiting for some only if `wait`. */
export const nextItems = (r: Reader, wait: boolean): Effect.Effect<Array<Item>> =>
  Effect.gen(function*() {
    const out = r.pending.splice(0)
    while (out.length === 0 || r.port.hasItems) {
      if (!r.port.hasItems) {
        // A spent budget: nothing more comes for this read; the page ends where it is.
        if (!wait || r.port.isClosed || r.port.exhausted) break
        yield* r.port.awaitItems
        if (!r.port.hasItems) break
      }
      for (const data of r.port.takeAll()) r.sorter.push(data, out)
      // The frames of a replacement snapshot are passed over whole before anything is handed out.
      if (out.length > 0 && !r.sorter.inSnapshot) break
    }
    return out
  })

/** A history rewrite as a reader is told of it (a control event, or a catch-up page's first element). */
export interface RewriteControl {
  readonly snapshotId: string
  /** The replacement snapshot's cursor: the offset to follow on from once it is read. */
  readonly cursor: Cursor.Cursor | undefined
}

/** One page of a catch-up (or long-poll) read. */
export interface Page {
  /** The read's offset was from before a history rewrite: the page starts with it. */
  readonly rewrite: RewriteControl | undefined
  readonly lines: Array<string>
  readonly next: Cursor.Cursor | undefined
  readonly upToDate: boolean
}

/**
 * Reads from `r.from` up to the tail as it was at attach (`r.target`), at most `maxBytes` of
 * lines, stopping before a rewrite or a loss (the next read from that offset starts with the
 * rewrite, or answers 410). A read from before a rewrite starts with it (`rewrite`), then the
 * events after it. `waitMs`: a long-poll with nothing to read waits that long for the first
 * event (after the rewrite, for one that starts with a rewrite).
 */
export const readPage = (r: Reader, maxBytes: number, waitMs: number | undefined): Effect.Effect<Page> =>
  Effect.gen(function*() {
    const lines: Array<string> = []
    let next = r.from
    let bytes = 0
    let rewrite: RewriteControl | undefined
    // The rewrite is known at attach, its frames come after: a read waits for them.
    let awaitingRewrite = r.rewritten
    const reached = () => r.target === undefined || (next !== undefined && !Cursor.isBefore(next, r.target))
    let stop = false
    const drain = Effect.gen(function*() {
      while (!stop && (awaitingRewrite || !reached() || r.pending.length > 0 || r.port.hasItems) && bytes < maxBytes) {
        const items = yield* nextItems(r, awaitingRewrite || !reached())
        if (items.length === 0) break
        for (let i = 0; i < items.length; i++) {
          const item = items[i]!
          if (item._tag === "Rewrite" && awaitingRewrite && lines.length === 0) {
            // What follows extends the replacement snapshot, whose cursor it continues from.
            awaitingRewrite = false
            rewrite = { snapshotId: item.snapshotId, cursor: item.cursor }
            if (item.cursor !== undefined) next = item.cursor
            continue
          }
          if (item._tag !== "Event" || bytes >= maxBytes) {
            // Left for the next read (which starts from `next`).
            stop = true
            break
          }
          lines.push(item.line)
          bytes += item.line.length
          next = item.cursor
        }
      }
    })
    const awaitFirst = Effect.gen(function*() {
      const first = yield* Effect.interruptible(nextItems(r, true)).pipe(Effect.timeout(waitMs!), Effect.option)
      if (Option.isSome(first)) r.pending.push(...first.value)
    })
    // Long-poll at the tail: wait for the first new event.
    if (!awaitingRewrite && reached() && waitMs !== undefined) yield* awaitFirst
    yield* drain
    if (rewrite !== undefined && lines.length === 0 && !stop && reached() && waitMs !== undefined) {
      // A long-poll told only of a rewrite waits for the first event after it too, so that a
      // reader going on from the rewrite's cursor (which again starts with the rewrite) polls.
      yield* awaitFirst
      yield* drain
    }
    return { rewrite, lines, next, upToDate: !stop && reached() && r.pending.length === 0 && !r.port.hasItems }
  })

/** A rewrite as its control says it: the replacement snapshot and the offset after it. */
export const rewriteFields = (c: RewriteControl, link: (snapshotId: string) => string) => ({
  snapshotId: c.snapshotId,
  snapshot: link(c.snapshotId),
  ...(c.cursor === undefined ? {} : { cursor: c.cursor }),
  offset: Offset.encode(c.cursor)
})

const encoder = new TextEncoder()

/** The SSE data event of a batch of whole event lines, shared by every reader of the batch. */
interface SharedDataEvent {
  readonly bytes: Uint8Array
  /** The batch's last cursor: the event's `id:`. */
  readonly last: Cursor.Cursor
  /** The batch ends with `session_closed`. */
  readonly closes: boolean
  readonly count: number
  readonly lineBytes: number
}

/** The SSE data event of a piece made only of whole event lines, by piece (null: not such a piece). */
const dataEvents = new WeakMap<Uint8Array, SharedDataEvent | null>()

const sharedDataEvent = (piece: Uint8Array) => {
  let found = dataEvents.get(piece)
  if (found === undefined) {
    found = dataEventOf(piece)
    dataEvents.set(piece, found)
  }
  return found ?? undefined
}

const NEWLINE = 0x0a
const DATA_SEPARATOR = Buffer.from(",\ndata: ")
const DATA_END = Buffer.from("\ndata: ]\n\n")
/** How much of a line's end holds its `meta` (its cursor, `emittedAt`, `replayed`), with room to spare. */
const META_TAIL_BYTES = 256

/**
 * `event: data`, `id:` the last line's offset, and the lines as a JSON array, one a `data:` line,
 * made from the piece's bytes: the lines are copied as they are, never decoded to strings, parsed
 * or encoded again (that was most of what SSE cost more than the socket per event). Null when the
 * piece is not made only of whole sequenced lines (the caller sorts it line by line instead).
 */
export const dataEventOf = (piece: Uint8Array): SharedDataEvent | null => {
  const bytes = Buffer.isBuffer(piece) ? piece : Buffer.from(piece.buffer, piece.byteOffset, piece.byteLength)
  const size = bytes.length
  if (size === 0 || bytes[size - 1] !== NEWLINE) return null
  const ends: Array<number> = []
  for (let at = 0; at < size;) {
    if (!isSequencedAt(bytes, at)) return null
    const nl = bytes.indexOf(NEWLINE, at)
    ends.push(nl)
    at = nl + 1
  }
  const count = ends.length
  const lastStart = count === 1 ? 0 : ends[count - 2]! + 1
  const lastEnd = ends[count - 1]!
  // The cursor is read from the line's end as cursorOfLine reads it; latin1 maps bytes to
  // characters one to one, and the `meta` it looks for is ASCII.
  const last = cursorOfLine(bytes.toString("latin1", Math.max(lastStart, lastEnd - META_TAIL_BYTES), lastEnd))
  if (last === undefined) return null
  const head = `event: data\nid: ${Offset.encode(last)}\ndata: [\ndata: `
  const out = Buffer.allocUnsafe(head.length + (size - count) + (count - 1) * DATA_SEPARATOR.length + DATA_END.length)
  let pos = out.write(head, 0, "latin1")
  let start = 0
  for (let i = 0; i < count; i++) {
    if (i > 0) pos += DATA_SEPARATOR.copy(out, pos)
    pos += bytes.copy(out, pos, start, ends[i])
    start = ends[i]! + 1
  }
  DATA_END.copy(out, pos)
  return { bytes: out, last, closes: isClosedAt(bytes, lastStart), count, lineBytes: size - count }
}

const KEEP_ALIVE = encoder.encode(": keep-alive\n\n")

/**
 * The SSE stream of a read: data events (JSON arrays, `id:` = next offset), control events,
 * keep-alives. It ends after a `session_closed`, as a socket client's connection to a killed
 * session does: nothing can follow it, and a reconnect from its offset is answered 404.
 */
export const sseStream = (
  r: Reader,
  options: { readonly keepAliveMs: number; readonly cursor: () => string; readonly snapshotLink: (snapshotId: string) => string }
): Stream.Stream<Uint8Array> => {
  let next = r.from
  let ended = false
  let first = true
  /** When the stream last wrote (Clock millis): a keep-alive is due `keepAliveMs` after it. */
  let lastWrite = 0
  let keepAliveDue = false
  // One timer for the stream's life that wakes an idle reader for its keep-alive, rather than a
  // timeout around every wait for items: an Effect.timeout per step (a race of two fibers) cost
  // more than all the rest of a step, and a step is taken per batch per reader.
  const keepAlive = Effect.gen(function*() {
    for (;;) {
      const now = yield* Clock.currentTimeMillis
      const wait = lastWrite + options.keepAliveMs - now
      if (wait > 0) {
        yield* Effect.sleep(wait)
        continue
      }
      keepAliveDue = true
      lastWrite = now
      r.port.nudge()
    }
  })
  const control = (extra: Record<string, unknown>) =>
    `event: control\ndata: ${JSON.stringify({ streamNextOffset: Offset.encode(next), streamCursor: options.cursor(), ...extra })}\n\n`
  const caughtUp = () => r.target === undefined || (next !== undefined && !Cursor.isBefore(next, r.target))
  // Each step's pieces go out as one chunk of the stream, each its own write (the server corks a
  // tick's writes into one writev): a shared data event is written as it is, never copied per
  // reader (a Buffer.concat of it per reader was the largest per-reader cost at 100 readers).
  const step: Effect.Effect<Chunk.Chunk<Uint8Array>, Option.Option<never>> = Effect.gen(function*() {
    if (ended) return yield* Effect.fail(Option.none())
    if (first) {
      first = false
      lastWrite = yield* Clock.currentTimeMillis
      // Retry hint for EventSource, and the reader told at once where it stands when nothing is owed.
      const head = `retry: 1000\n\n${caughtUp() && r.pending.length === 0 ? control({ upToDate: true }) : ""}`
      return Chunk.of(encoder.encode(head))
    }
    if (r.pending.length === 0) {
      if (!r.port.hasItems && !keepAliveDue) yield* Effect.interruptible(r.port.awaitItems)
      lastWrite = yield* Clock.currentTimeMillis
      const due = keepAliveDue
      keepAliveDue = false
      if (due && !r.port.hasItems && !r.port.isClosed) return Chunk.of(KEEP_ALIVE)
    }
    const out: Array<Uint8Array> = []
    let text = ""
    let batch: Array<string> = []
    /** Events (and their bytes) this step sends, for the metrics. */
    let sent = 0
    let sentBytes = 0
    const flushText = () => {
      if (text.length > 0) out.push(encoder.encode(text))
      text = ""
    }
    const flush = () => {
      if (batch.length === 0) return
      text += `event: data\nid: ${Offset.encode(next)}\ndata: [\ndata: ${batch.join(",\ndata: ")}\ndata: ]\n\n`
      batch = []
      text += control(caughtUp() && !r.port.hasItems ? { upToDate: true } : {})
    }
    const handle = (items: ReadonlyArray<Item>) => {
      for (const item of items) {
        if (ended) return
        if (item._tag === "Event") {
          batch.push(item.line)
          sent++
          sentBytes += item.line.length
          next = item.cursor
          if (isClosedLine(item.line)) {
            flush()
            ended = true
          }
          continue
        }
        flush()
        if (item._tag === "Rewrite") {
          // The events that follow extend the replacement snapshot, not what the reader holds.
          text += control({ rewrite: rewriteFields(item, options.snapshotLink) })
        } else {
          // Events the reader lacked are gone: it reconnects from its offset and is told so (410).
          text += control({ lost: item.reason })
          ended = true
        }
      }
    }
    handle(r.pending.splice(0))
    const pieces = r.port.takeAll()
    if (pieces.length === 0 && out.length === 0 && text.length === 0 && batch.length === 0) {
      // The port closed (the daemon stops, or the session's delivery ended).
      ended = true
      return yield* Effect.fail(Option.none())
    }
    for (const piece of pieces) {
      if (ended) break
      // A batch of live events is one array shared by every reader of the session: its SSE data
      // event is made once and shared too (per-reader work was the fan-out's cost).
      const shared = typeof piece === "string" || r.sorter.pending ? undefined : sharedDataEvent(piece)
      if (shared !== undefined) {
        flush()
        flushText()
        out.push(shared.bytes)
        sent += shared.count
        sentBytes += shared.lineBytes
        next = shared.last
        text += control(caughtUp() && !r.port.hasItems ? { upToDate: true } : {})
        if (shared.closes) ended = true
        continue
      }
      const items: Array<Item> = []
      r.sorter.push(piece, items)
      handle(items)
    }
    flush()
    flushText()
    if (sent > 0) Metrics.delivered("http", sent, sentBytes)
    return Chunk.unsafeFromArray(out)
  })
  return Stream.unwrapScoped(Effect.as(Effect.forkScoped(keepAlive), Stream.repeatEffectChunkOption(step)))
}
