/**
 * Frames between the supervisor and a worker process (PROTOCOL.md section 6), one JSON object
 * per line on the worker's private pipe (fd 3), never on its stdout/stderr.
 *
 * A worker starts empty (a warm spare) and becomes a session's worker on `load`. Snapshots use
 * the public begin/chunk/end/failed frames with purpose `checkpoint`.
 */
import * as Either from "effect/Either"
import * as ParseResult from "effect/ParseResult"
import * as Schema from "effect/Schema"
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

// Supervisor -> worker ---------------------------------------------------------------------------

/** Makes this worker the worker of a session: fresh, or restored from its files. */
export const Load = Tagged("load", {
  activeSessionId: Schema.String,
  engine: Schema.String,
  config: optional(JsonObject),
  /** Where the session's files are; absent for a brand-new session. */
  restore: optional(
    Schema.Struct({
      /** The recovery journal: says whether a turn was running when the last worker died. */
      journalPath: Schema.String,
      /** The SessionStore root, holding the session's transcripts. */
      storeRoot: Schema.String,
      /** The EventLog root, holding the events after the latest transcript. */
      eventLogRoot: Schema.String,
      /** What cut the running turn, if one was running (default `worker_crashed`). */
      interruptedReason: optional(InterruptReason)
    })
  )
})

/** Starts a turn. */
export const RunPrompt = Tagged("prompt", { turnId: Schema.String, message: Schema.String })

/** Aborts the turn `turnId` if it is still running (a turn that already ended is left alone). */
export const AbortTurn = Tagged("abort", { turnId: Schema.String })

/** Streams the session state as a checkpoint snapshot. */
export const TakeCheckpoint = Tagged("checkpoint", {
  snapshotId: Schema.String,
  targetChunkBytes: Schema.Int.pipe(Schema.positive())
})

/** Asks the worker to exit cleanly. */
export const Stop = Tagged("stop", {})

/** Every frame the supervisor sends. */
export const SupervisorFrame = Schema.Union(Load, RunPrompt, AbortTurn, TakeCheckpoint, Stop)
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

/** One frame as a JSON line. */
export const encodeFrame = (frame: SupervisorFrame | WorkerFrame): string => JSON.stringify(frame) + "\n"
