/**
 * Frames between the supervisor and a worker process (docs/protocol.md section 6), one JSON object
 * per line on the worker's private pipe (fd 3), never on its stdout/stderr.
 *
 * A worker starts empty (a warm spare) and becomes a session's worker on `load`. Checkpoints
 * need no worker (the supervisor writes them from its event log); the one snapshot a worker
 * sends is a history rewrite (its engine replaced the transcript during a turn), with the public
 * begin/chunk/end/failed frames and purpose `replacement`.
 */
import * as Either from "effect/Either"
import * as ParseResult from "effect/ParseResult"
import { isRecord } from "effect/Predicate"
import * as Schema from "effect/Schema"
import { isUtf8 } from "node:buffer"
import {
  AgentEvent,
  InterruptReason,
  JsonObject,
  optional,
  SnapshotBegin,
  SnapshotChunk,
  SnapshotEnd,
  SnapshotFailed,
  Tagged
} from "./Protocol.js"

/** The worker argument that asks it to warm up its restore path while it waits for its first frame (the pool's spare). */
export const WARM_UP_FLAG = "--warm-up"

/**
 * The worker argument that makes it a host of several sessions (`--host=<socket path>`): each
 * session on a connection of its own to that Unix socket (Worker.ts, `runHost`).
 */
export const HOST_FLAG = "--host="

/** What follows WORKER_TITLE_PREFIX in a worker host's title (a host runs several sessions: it names none). */
export const HOST_TITLE_KEY = "host"

/**
 * A worker's process title once it runs a session: this prefix, then {@link workerTitleKey} of
 * the session's id.
 */
export const WORKER_TITLE_PREFIX = "agentd-worker "

/**
 * The session as a worker's title names it: the first 20 characters of its id (`s-` and 72 bits
 * of its UUID). Linux keeps a title within the bytes of the process's original argv (the node
 * binary's path and the worker entry's): a whole id (38 characters) was cut short where the
 * install's path is short (`/usr/bin/node /srv/x/dist/src/bin/worker.js`); this fits any.
 */
export const workerTitleKey = (activeSessionId: string): string => activeSessionId.slice(0, 20)

// Supervisor -> worker ---------------------------------------------------------------------------

/**
 * Makes this worker the worker of a session: fresh, or restored. A restore is streamed by the
 * supervisor right after this frame, read through its own storage layers: the transcript as
 * {@link RestoreMessages} frames (each followed by its message lines), the logged events after
 * it as {@link RestoreEvents} frames (each followed by its record lines), then
 * {@link RestoreEnd} (or {@link RestoreFailed}). A worker never opens the daemon's state dir.
 */
export const Load = Tagged("load", {
  activeSessionId: Schema.String,
  engine: Schema.String,
  config: optional(JsonObject),
  /** The session's own working directory (`<stateDir>/sessions/<id>/work`), for engines with tools. */
  workDir: optional(Schema.String),
  /** The chunk size of the snapshot frames of a history rewrite (default: the protocol's). */
  targetChunkBytes: optional(Schema.Int.pipe(Schema.positive())),
  /** Present when the session is restored: its messages follow in restore frames. */
  restore: optional(
    Schema.Struct({
      /** The recovery journal says a turn was running when the last worker died. */
      busy: Schema.Boolean,
      /** What cut the running turn, if one was running (default `worker_crashed`). */
      interruptedReason: optional(InterruptReason)
    })
  )
})

/**
 * The next `count` lines on the pipe are messages of the restored transcript, in order, one JSON
 * value each, exactly as the session store holds them (the supervisor passes the store's bytes
 * on without parsing them). A transcript is sent as many of these, each covering about
 * {@link RESTORE_CHUNK_BYTES}: a 100 MB transcript is never one line nor one buffer.
 */
export const RestoreMessages = Tagged("restore_messages", { count: Schema.Int.pipe(Schema.nonNegative()) })

/**
 * The next `count` lines are the `session_event` records logged after the restored transcript,
 * in order, as the event log holds them (`{"type":"session_event","event":{...},...}`): the
 * worker folds their `event` into the transcript.
 */
export const RestoreEvents = Tagged("restore_events", { count: Schema.Int.pipe(Schema.nonNegative()) })

/** The restore is complete: `messageCount` messages were sent (the worker checks it). */
export const RestoreEnd = Tagged("restore_end", { messageCount: Schema.Int.pipe(Schema.nonNegative()) })

/** The supervisor could not read the session: the worker reports `restore failed` and loads nothing. */
export const RestoreFailed = Tagged("restore_failed", { message: Schema.String })

/** About how many bytes of messages or events one restore frame covers (a bigger message goes alone). */
export const RESTORE_CHUNK_BYTES = 1024 * 1024

/** A {@link RestoreMessages} frame followed by its lines (JSON texts without newlines), as one string. */
export const encodeRestoreMessages = (jsonMessages: ReadonlyArray<string>): string =>
  `{"type":"restore_messages","count":${jsonMessages.length}}\n${jsonMessages.map((m) => m + "\n").join("")}`

/** A {@link RestoreEvents} frame followed by its lines (logged `session_event` records), as one string. */
export const encodeRestoreEvents = (jsonRecords: ReadonlyArray<string>): string =>
  `{"type":"restore_events","count":${jsonRecords.length}}\n${jsonRecords.map((r) => r + "\n").join("")}`

/** Starts a turn. */
export const RunPrompt = Tagged("prompt", { turnId: Schema.String, message: Schema.String })

/**
 * Aborts the turn `turnId` if it is still running (a turn that already ended is left alone).
 * `reason` is what its `turn_interrupted` says: `aborted` (the default, a client's `abort`) or
 * `daemon_shutdown` (the daemon stops gracefully and cuts the turn first).
 */
export const AbortTurn = Tagged("abort", {
  turnId: Schema.String,
  reason: optional(Schema.Literal("aborted", "daemon_shutdown"))
})

/** Asks the worker to exit cleanly. */
export const Stop = Tagged("stop", {})

/** Every frame the supervisor sends. */
export const SupervisorFrame = Schema.Union(Load, RestoreMessages, RestoreEvents, RestoreEnd, RestoreFailed, RunPrompt, AbortTurn, Stop)
export type SupervisorFrame = typeof SupervisorFrame.Type

// Worker -> supervisor ---------------------------------------------------------------------------

/** The worker is up (no session yet) or has loaded its session. */
export const WorkerReady = Tagged("worker_ready", {
  pid: Schema.Int,
  activeSessionId: optional(Schema.String),
  messageCount: Schema.Int.pipe(Schema.nonNegative())
})

/** An event of the running turn, to be logged and fanned out by the supervisor. */
export const WorkerEvent = Tagged("worker_event", { event: AgentEvent })

/** The worker could not do what it was asked; it stays up. */
export const WorkerError = Tagged("worker_error", { message: Schema.String })

/** Every frame a worker sends. */
export const WorkerFrame = Schema.Union(
  WorkerReady,
  WorkerEvent,
  WorkerError,
  SnapshotBegin,
  SnapshotChunk,
  SnapshotEnd,
  SnapshotFailed
)
export type WorkerFrame = typeof WorkerFrame.Type

const decodeWorker = Schema.decodeUnknownEither(Schema.parseJson(WorkerFrame))
const decodeSupervisor = Schema.decodeUnknownEither(Schema.parseJson(SupervisorFrame))

/** Decodes a line from a worker; the error is a readable sentence. */
export const decodeWorkerFrame = (line: string): Either.Either<WorkerFrame, string> =>
  Either.mapLeft(decodeWorker(line), (e) => ParseResult.TreeFormatter.formatErrorSync(e))

/** Decodes a line from the supervisor; the error is a readable sentence. */
export const decodeSupervisorFrame = (line: string): Either.Either<SupervisorFrame, string> =>
  Either.mapLeft(decodeSupervisor(line), (e) => ParseResult.TreeFormatter.formatErrorSync(e))

/**
 * One frame as a JSON line. A `worker_event` frame is always `{"type":"worker_event","event":
 * {"type":"<event type>",...}}`, the event's own `type` first, so the supervisor can read the
 * type and take the event's JSON as the bytes it came in ({@link readWorkerBytes}).
 */
export const encodeFrame = (frame: SupervisorFrame | WorkerFrame): string =>
  frame.type === "worker_event" ? encodeEventFrame(frame.event) : JSON.stringify(frame) + "\n"

const EVENT_FRAME_OPEN = `{"type":"worker_event","event":`
const TYPE_KEY = `{"type":"`

/** The `worker_event` frame of one event, as a JSON line (see {@link encodeFrame}). */
export const encodeEventFrame = (event: AgentEvent): string => `${EVENT_FRAME_OPEN}${eventJsonOf(event)}}\n`

/** An event's JSON text, its `type` first. */
const eventJsonOf = (event: AgentEvent): string => {
  const json = JSON.stringify(event)
  // Events are built with `type` first; put it first for one that was not.
  return json.startsWith(TYPE_KEY) ? json : JSON.stringify(Object.assign({ type: event.type }, event))
}

/** A `worker_event` frame as the supervisor reads it: the event's type and its JSON text. */
export interface EventFrame {
  readonly type: "worker_event"
  readonly eventType: string
  /** The event exactly as the worker serialized it, UTF-8: a view of the bytes it came in. */
  readonly eventBytes: Buffer
}

/** A line from a worker, as the supervisor holds it: an event frame, or another frame's JSON value. */
export type ReceivedFrame = EventFrame | { readonly type?: unknown; readonly [key: string]: unknown }

/** An event frame's event, as text (for the few readers that parse it: never on the live path). */
export const eventTextOf = (frame: EventFrame): string => frame.eventBytes.toString("utf8")

const EVENT_PREFIX_BYTES = Buffer.from(EVENT_FRAME_OPEN + TYPE_KEY)
const QUOTE = 0x22
const BACKSLASH = 0x5c
const CLOSE_BRACE = 0x7d

/**
 * Event types seen, as their bytes and their string, so that a frame's type is one of a few
 * strings instead of a new one per event (the type is 7-20 ASCII bytes: compared in place).
 */
const knownTypes: Array<{ readonly bytes: Buffer; readonly type: string }> = []
const KNOWN_TYPES_MAX = 64

const typeAt = (buf: Buffer, start: number, end: number): string => {
  const length = end - start
  for (let k = 0; k < knownTypes.length; k++) {
    const known = knownTypes[k]!
    if (known.bytes.length !== length) continue
    let same = true
    for (let i = 0; i < length; i++) {
      if (known.bytes[i] !== buf[start + i]) {
        same = false
        break
      }
    }
    if (same) return known.type
  }
  const type = buf.toString("utf8", start, end)
  if (knownTypes.length < KNOWN_TYPES_MAX) knownTypes.push({ bytes: Buffer.from(type, "utf8"), type })
  return type
}

/**
 * Reads one line from a worker, `buf[start, end)`. An event frame is not parsed: its type is
 * read from its fixed prefix and its JSON is kept as the bytes it came in, to be logged and sent
 * to clients without being decoded, parsed or encoded again on the supervisor's hottest path.
 * The bytes are trusted as the text of a JSON value: they come from the worker's own
 * `JSON.stringify` over a private pipe, and a line only counts once its newline has arrived, so
 * a worker killed mid-write leaves no torn frame. They are checked as UTF-8 (a native scan):
 * clients are promised UTF-8 lines, and every store must count and keep the same text; a line
 * that is not takes the slow path, where invalid bytes become U+FFFD as a decoder makes them.
 * Any other line is parsed (and throws if it is not JSON, or is an event frame without an
 * event); other frames are trusted as WorkerProtocol frames.
 */
export const readWorkerBytes = (buf: Buffer, start: number, end: number): ReceivedFrame => {
  const prefix = EVENT_PREFIX_BYTES.length
  if (end - start > prefix + 2 && buf[end - 1] === CLOSE_BRACE && buf[end - 2] === CLOSE_BRACE && buf.compare(EVENT_PREFIX_BYTES, 0, prefix, start, start + prefix) === 0) {
    const typeStart = start + prefix
    // The type's closing quote, within the line; an escape inside the type would need decoding:
    // such a line is left to JSON.parse.
    let typeEnd = typeStart
    while (typeEnd < end && buf[typeEnd] !== QUOTE && buf[typeEnd] !== BACKSLASH) typeEnd++
    if (typeEnd > typeStart && typeEnd < end && buf[typeEnd] === QUOTE) {
      const eventBytes = buf.subarray(start + EVENT_FRAME_OPEN.length, end - 1)
      if (isUtf8(eventBytes)) return { type: "worker_event", eventType: typeAt(buf, typeStart, typeEnd), eventBytes }
    }
  }
  const value: unknown = JSON.parse(buf.toString("utf8", start, end))
  if (!isRecord(value)) return {}
  if (value["type"] === "worker_event") {
    const event = value["event"]
    if (!isRecord(event) || typeof event["type"] !== "string") {
      // Never logged: an event without a type is no AgentEvent (and the log would hold `undefined`).
      throw new Error("a worker_event frame whose event is not an object with a string `type`")
    }
    return { type: "worker_event", eventType: event["type"], eventBytes: Buffer.from(JSON.stringify(event), "utf8") }
  }
  return value
}

/** {@link readWorkerBytes} of a line given as text (tests, tools). */
export const readWorkerLine = (line: string): ReceivedFrame => {
  const buf = Buffer.from(line, "utf8")
  return readWorkerBytes(buf, 0, buf.length)
}
