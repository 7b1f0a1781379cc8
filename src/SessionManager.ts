/**
 * Sessions' lifecycle and fan-out (PROTOCOL.md sections 3-6).
 *
 * Every sequenced message of a session goes through {@link publish}: it is appended to the
 * EventLog (which assigns the cursor and makes it durable), then handed to every attachment
 * that is live. An attachment that is not live (streaming its baseline, catching up, or paused
 * because its client does not read) reads the events it lacks from the EventLog and turns live
 * in the same synchronous step in which it finds itself caught up, so nothing is lost or sent
 * twice. Event history is never held in memory per client.
 *
 * Each session's worker runs under a supervising fiber: the worker's frames are pumped until
 * it exits; an exit the supervisor did not ask for fails with WorkerCrashed, which runs the
 * restore effect (replacement worker, same activeSessionId, `recovering` then `ready`).
 */
import * as Cause from "effect/Cause"
import * as Chunk from "effect/Chunk"
import * as Context from "effect/Context"
import * as Data from "effect/Data"
import * as Deferred from "effect/Deferred"
import * as Duration from "effect/Duration"
import * as Effect from "effect/Effect"
import * as Either from "effect/Either"
import * as FiberSet from "effect/FiberSet"
import * as Layer from "effect/Layer"
import * as Option from "effect/Option"
import * as Stream from "effect/Stream"
import { randomUUID } from "node:crypto"
import * as path from "node:path"
import * as Cursor from "./Cursor.js"
import { DaemonConfig } from "./DaemonConfig.js"
import { Engine } from "./Engine.js"
import { EncodedEvent, EventLog, type EventRecord } from "./EventLog.js"
import type { Outbox } from "./internal/outbox.js"
import * as Protocol from "./Protocol.js"
import type { AgentMessage, CommandOf, ErrorCode, SessionSummary, WorkerState } from "./Protocol.js"
import { RecoveryJournal } from "./RecoveryJournal.js"
import { type SessionMeta, SessionStore } from "./SessionStore.js"
import { ChunkBuilder, SnapshotCache } from "./SnapshotCache.js"
import { defaultRestartPolicy, nextRestart, WorkerCrashed, WorkerPool, type WorkerProcess } from "./WorkerPool.js"
import type * as WorkerProtocol from "./WorkerProtocol.js"

/**
 * Events of one worker read are logged and sent in batches of about this many bytes (one write,
 * one fsync, one encode for every client). A slow client is checked against its outbox limit
 * between batches, so it can go past the limit by one batch (or one larger event).
 */
const PUBLISH_BATCH_BYTES = 256 * 1024

/** A command failed with one of the documented error codes. */
export class CommandError extends Data.TaggedError("CommandError")<{
  readonly code: ErrorCode
  readonly message: string
}> {}

const notFound = (id: string) => new CommandError({ code: "session_not_found", message: `No session \`${id}\`.` })

/** Where the daemon's files live and what generation of supervisor this is. */
export class SupervisorInfo extends Context.Tag("agentd/SupervisorInfo")<SupervisorInfo, {
  readonly generation: number
  readonly startedAt: number
  readonly journalPath: string
  readonly storeRoot: string
  readonly eventLogRoot: string
}>() {}

/** What a sequenced message looks like in the EventLog: its wire form without session and meta. */
type LoggedBody =
  | { readonly type: "session_event"; readonly event: { readonly type: string } }
  | { readonly type: "session_status"; readonly state: SessionSummary }
  | { readonly type: "session_closed"; readonly reason: string }

/**
 * A sequenced message before it has a cursor: the JSON text of its {@link LoggedBody} without
 * the closing brace. It is built once and is the start of both its log record and its wire line,
 * so an agent event is serialized once, by the worker, and never parsed on the live path.
 */
interface Outgoing {
  readonly open: string
  /** For a `session_event`, the agent event's type. */
  readonly eventType?: string
}

/** A worker's event, from its JSON text. */
const eventMessage = (eventType: string, eventJson: string): Outgoing => ({
  open: `{"type":"session_event","event":${eventJson}`,
  eventType
})

/** A message the supervisor makes itself (status, closed, an interruption it reports). */
const bodyMessage = (body: LoggedBody): Outgoing => {
  const json = JSON.stringify(body)
  return body.type === "session_event" ? { open: json.slice(0, -1), eventType: body.event.type } : { open: json.slice(0, -1) }
}

/** The log record of a message: its body and when it was emitted (`emittedAt` last). */
const logged = (m: Outgoing, emittedAt: number) => new EncodedEvent(`${m.open},"emittedAt":${emittedAt}}`)

const EMITTED_AT = `,"emittedAt":`

/** The wire line of a message: its body, then `activeSessionId` and `meta`. */
const wireLine = (sessionJson: string, open: string, cursor: Cursor.Cursor, emittedAt: number, replayed: boolean) =>
  `${open},"activeSessionId":${sessionJson},"meta":{"cursor":{"generation":${cursor.generation},"sequence":${cursor.sequence}},"emittedAt":${emittedAt}${
    replayed ? ",\"replayed\":true" : ""
  }}}\n`

/** The wire line of a logged record (replay, catch-up), from its text: `emittedAt` moves into meta. */
const wireLineOfRecord = (sessionJson: string, r: EventRecord, replayed: boolean) => {
  const emittedAt = r.event["emittedAt"]
  const at = r.json.lastIndexOf(EMITTED_AT)
  if (typeof emittedAt === "number" && at > 0 && r.json.slice(at + EMITTED_AT.length, -1) === String(emittedAt)) {
    return wireLine(sessionJson, r.json.slice(0, at), r.cursor, emittedAt, replayed)
  }
  // Not in the shape `logged` writes: rebuild it from the parsed record.
  const { emittedAt: _, ...body } = r.event
  return wireLine(sessionJson, JSON.stringify(body).slice(0, -1), r.cursor, typeof emittedAt === "number" ? emittedAt : 0, replayed)
}

/** One connection's subscription to one session. */
class Attachment {
  /** `live`: published events are written directly; otherwise the catch-up fiber reads the log. */
  mode: "catchup" | "live" | "paused" = "catchup"
  /** The last cursor written to the client (undefined: nothing of the session yet). */
  delivered: Cursor.Cursor | undefined
  /** Set after a backpressure pause: re-sent events are flagged replayed. */
  resumed = false
  wake: (() => void) | undefined
  detached = false

  constructor(
    readonly session: Session,
    readonly outbox: Outbox,
    readonly connectionId: string,
    readonly limit: number,
    /** Events up to this cursor existed at attach time: they are flagged replayed. */
    readonly attachCursor: Cursor.Cursor | undefined
  ) {}

  /**
   * Called by publish, synchronously, for every batch of new events (`lines`, the last one at
   * `last`). A client over its limit is paused before the batch and later resumed from the log.
   */
  onLive(last: Cursor.Cursor, lines: Uint8Array) {
    if (this.mode !== "live" || this.detached) return
    if (this.outbox.queuedBytes > this.limit) {
      this.mode = "paused"
      this.signal()
      return
    }
    this.outbox.offer(lines)
    this.delivered = last
  }

  signal() {
    const wake = this.wake
    this.wake = undefined
    wake?.()
  }
}

/** A session's state in the supervisor. */
interface Session {
  meta: SessionMeta
  /**
   * Messages in the transcript. The transcript itself is never held here: it is the current
   * generation's snapshot file plus the `message_end` events logged since (the worker holds it).
   */
  messageCount: number
  /** How many messages the current generation's snapshot holds. */
  baseMessageCount: number
  generation: number
  /** The cursor of the last event before the current generation (the snapshot's cursor). */
  snapshotCursor: Cursor.Cursor | undefined
  generationEvents: number
  generationBytes: number
  lastCursor: Cursor.Cursor | undefined
  worker: WorkerProcess | undefined
  workerState: WorkerState
  /** Resolved when the worker state leaves starting/recovering. */
  ready: Deferred.Deferred<void, CommandError>
  busy: boolean
  /** The running turn's end (agent_end or turn_interrupted) has been received; its idle status is on its way. */
  turnEnding: boolean
  /** Resolved at the end of the running turn. */
  turnEnded: Deferred.Deferred<void>
  /** The running (or last) turn's id, and how the last turn ended. */
  turnId: string
  lastTurnEnd: "agent_end" | Protocol.InterruptReason | undefined
  restarts: number
  crashTimes: Array<number>
  attachments: Set<Attachment>
  /** Serializes appends so cursors are published in order. */
  publishLock: Effect.Semaphore
  /** Serializes lifecycle changes (start, checkpoint, passivate, kill). */
  lifecycle: Effect.Semaphore
  lastUsed: number
  launchEnv: Record<string, string> | undefined
  clientEnv: Record<string, string> | undefined
  /** The worker's checkpoint being received: its cache entry and where to resolve. */
  incomingSnapshot: { readonly snapshotId: string; readonly done: Deferred.Deferred<void, CommandError> } | undefined
  /** The snapshot cache entry of the current generation, if built. */
  snapshotId: string | undefined
  closed: boolean
}

const snapshotIdOf = (s: Session, generation: number) => `${s.meta.activeSessionId}~g${generation}`

export interface AttachOutcome {
  readonly data: Protocol.DaemonAttachResult
  /** Sends the snapshot frames, `session_attached` and the events; run after the response. */
  readonly deliver: Effect.Effect<void>
}

/** The sessions of this daemon. */
export class SessionManager extends Context.Tag("agentd/SessionManager")<SessionManager, {
  readonly create: (cmd: CommandOf<"create">) => Effect.Effect<{ activeSessionId: string; state: SessionSummary }, CommandError>
  readonly list: Effect.Effect<{ sessions: Array<SessionSummary> }>
  readonly status: Effect.Effect<unknown>
  readonly attach: (connectionId: string, outbox: Outbox, cmd: CommandOf<"attach">) => Effect.Effect<AttachOutcome, CommandError>
  readonly detach: (connectionId: string, activeSessionId: string) => Effect.Effect<void, CommandError>
  readonly detachAll: (connectionId: string) => Effect.Effect<void>
  /** How many sessions a connection is attached to. */
  readonly attachedCount: (connectionId: string) => number
  readonly prompt: (cmd: CommandOf<"prompt">) => Effect.Effect<{ accepted: true }, CommandError>
  readonly abort: (cmd: CommandOf<"abort">) => Effect.Effect<{ aborted: boolean }, CommandError>
  readonly getState: (activeSessionId: string) => Effect.Effect<SessionSummary, CommandError>
  readonly getMessages: (cmd: CommandOf<"get_messages">) => Effect.Effect<{ messages: ReadonlyArray<AgentMessage>; total: number }, CommandError>
  readonly checkpoint: (activeSessionId: string) => Effect.Effect<{ generation: number; snapshotId: string }, CommandError>
  readonly retryWorker: (activeSessionId: string) => Effect.Effect<SessionSummary, CommandError>
  readonly kill: (activeSessionId: string) => Effect.Effect<{}, CommandError>
}>() {}

const internal = (what: string) => (e: { readonly message: string }) =>
  new CommandError({ code: "internal", message: `${what}: ${e.message}` })

export const make = Effect.gen(function*() {
  const config = yield* DaemonConfig
  const engines = yield* Engine
  const info = yield* SupervisorInfo
  const log = yield* EventLog
  const store = yield* SessionStore
  const journal = yield* RecoveryJournal
  const cache = yield* SnapshotCache
  const pool = yield* WorkerPool
  const fibers = yield* FiberSet.make()
  const runtime = yield* Effect.runtime<never>()
  const sessions = new Map<string, Session>()
  /** connectionId -> its attachments. */
  const connections = new Map<string, Map<string, Attachment>>()
  const restartPolicy = {
    ...defaultRestartPolicy,
    maxRestarts: config.maxRestarts,
    restartWindowMs: config.restartWindowMs
  }

  const fork = <A, E>(effect: Effect.Effect<A, E>) => FiberSet.run(fibers, effect).pipe(Effect.asVoid)

  const summary = (s: Session): SessionSummary => {
    const out: {
      -readonly [K in keyof SessionSummary]: SessionSummary[K]
    } = {
      activeSessionId: s.meta.activeSessionId,
      engine: s.meta.engine,
      createdAt: s.meta.createdAt,
      messageCount: s.messageCount,
      busy: s.busy,
      worker: s.workerState,
      restarts: s.restarts,
      telemetry: s.meta.telemetry
    }
    if (s.meta.name !== undefined) out.name = s.meta.name
    if (s.worker !== undefined) out.workerPid = s.worker.pid
    if (s.lastCursor !== undefined) out.lastEventCursor = s.lastCursor
    return out
  }

  const get = (id: string) =>
    Effect.suspend(() => {
      const s = sessions.get(id)
      return s === undefined || s.closed ? Effect.fail(notFound(id)) : Effect.succeed(s)
    })

  // ------------------------------------------------------------------------------------------
  // Publishing
  // ------------------------------------------------------------------------------------------

  /** Appends messages to the log (one group commit) and hands them to live attachments. */
  const publishAll = (s: Session, messages: ReadonlyArray<Outgoing>) =>
    s.publishLock.withPermits(1)(Effect.gen(function*() {
      if (messages.length === 0) return
      const emittedAt = Date.now()
      // One write and one fsync for the batch; cursors follow the array order.
      const cursors = yield* log.appendAll(s.meta.activeSessionId, messages.map((m) => logged(m, emittedAt)))
      const sessionJson = JSON.stringify(s.meta.activeSessionId)
      let text = ""
      for (let i = 0; i < messages.length; i++) {
        const m = messages[i]!
        text += wireLine(sessionJson, m.open, cursors[i]!, emittedAt, false)
        // Counted once logged, so the count never runs ahead of what get_messages can read.
        if (m.eventType === "message_end") s.messageCount++
      }
      // Encoded once for the whole batch, shared by every attached client.
      const lines = Buffer.from(text, "utf8")
      const last = cursors[cursors.length - 1]!
      s.lastCursor = last
      s.generationEvents += messages.length
      s.generationBytes += lines.byteLength
      for (const a of s.attachments) a.onLive(last, lines)
    })).pipe(Effect.orDie)

  const publish = (s: Session, body: LoggedBody) => publishAll(s, [bodyMessage(body)])

  const publishStatus = (s: Session) => publish(s, { type: "session_status", state: summary(s) })

  const record = (s: Session, busy: boolean, operation: string, sessionFile?: string) =>
    journal.record({
      activeSessionId: s.meta.activeSessionId,
      sessionId: s.meta.sessionId,
      busy,
      operation,
      ...(sessionFile === undefined ? {} : { sessionFile })
    }).pipe(Effect.catchAll((e) => Effect.logError(`journal: ${e.message}`)))

  // ------------------------------------------------------------------------------------------
  // Workers
  // ------------------------------------------------------------------------------------------

  const endTurn = (s: Session, publishIdle: boolean) =>
    Effect.gen(function*() {
      if (!s.busy) return
      const ended = s.turnEnded
      // The session stays busy until its idle status is out: a prompt accepted earlier would
      // start the next turn before this one's `busy: false` (and get_state would run ahead of
      // the events). Even if logging fails, the turn is over: never leave the session busy.
      yield* Effect.gen(function*() {
        yield* record(s, false, "turn_end")
        if (publishIdle) yield* publish(s, { type: "session_status", state: { ...summary(s), busy: false } })
      }).pipe(Effect.ensuring(Effect.suspend(() => {
        s.busy = false
        return Deferred.succeed(ended, undefined)
      })))
      if (publishIdle && (s.generationEvents >= config.checkpointEvents || s.generationBytes >= config.checkpointBytes)) {
        yield* fork(Effect.ignoreLogged(checkpointSession(s)))
      }
    })

  /** Handles the frames of one batch, in order; consecutive events are logged together. */
  const handleFrames = (
    s: Session,
    worker: WorkerProcess,
    frames: ReadonlyArray<WorkerProtocol.ReceivedFrame>,
    loading: { value: boolean }
  ) =>
    Effect.gen(function*() {
      let events: Array<Outgoing> = []
      let eventBytes = 0
      const flushEvents = Effect.suspend(() => {
        const batch = events
        events = []
        eventBytes = 0
        return publishAll(s, batch)
      })
      for (const raw of frames) {
        const frame = raw as { readonly type: string; readonly [k: string]: unknown }
        switch (frame.type) {
          case "worker_event": {
            const { eventJson, eventType } = raw as WorkerProtocol.EventFrame
            events.push(eventMessage(eventType, eventJson))
            eventBytes += eventJson.length
            // A client is paused between batches: the cap bounds how far past its limit it gets.
            if (eventBytes >= PUBLISH_BATCH_BYTES) yield* flushEvents
            if (eventType === "tool_execution_start" || eventType === "tool_execution_end") {
              yield* flushEvents
              yield* record(s, true, eventType === "tool_execution_start" ? "tool_start" : "tool_end")
            } else if (eventType === "agent_end" || eventType === "turn_interrupted") {
              s.turnEnding = true
              s.lastTurnEnd = eventType === "agent_end"
                ? "agent_end"
                : (JSON.parse(eventJson) as Extract<Protocol.AgentEvent, { type: "turn_interrupted" }>).reason
              yield* flushEvents
              // During a restore the `ready` status that follows is the turn's idle status.
              yield* endTurn(s, !loading.value)
            }
            break
          }
          case "worker_ready": {
            yield* flushEvents
            if (loading.value) {
              loading.value = false
              // Like busy: get_state says ready only once the `ready` status is logged.
              yield* publish(s, { type: "session_status", state: { ...summary(s), worker: "ready" } })
              s.workerState = "ready"
              yield* Deferred.succeed(s.ready, undefined)
            }
            break
          }
          case "worker_error": {
            yield* flushEvents
            yield* Effect.logWarning(`worker ${worker.pid} of ${s.meta.activeSessionId}: ${String(frame["message"])}`)
            if (loading.value) {
              // A worker that cannot load its session is as good as crashed.
              worker.child.kill("SIGKILL")
            }
            break
          }
          case "session_snapshot_begin":
          case "session_snapshot_chunk":
          case "session_snapshot_end":
          case "session_snapshot_failed": {
            yield* flushEvents
            yield* handleSnapshotFrame(s, frame)
            break
          }
          default:
            yield* Effect.logWarning(`worker ${worker.pid}: unknown frame ${frame.type}`)
        }
      }
      yield* flushEvents
    })

  /** Pumps a worker's frames until it exits; an exit nobody asked for is a WorkerCrashed. */
  const pump = (s: Session, worker: WorkerProcess) =>
    Effect.gen(function*() {
      const loading = { value: true }
      while (true) {
        const frames = yield* worker.takeFrames
        if (frames.length === 0) break
        yield* handleFrames(s, worker, frames, loading)
      }
      const exit = yield* Deferred.await(worker.exited)
      if (s.worker === worker) s.worker = undefined
      if (worker.stopping || s.closed) return
      return yield* new WorkerCrashed({
        activeSessionId: s.meta.activeSessionId,
        pid: worker.pid,
        exitCode: exit.code,
        signal: exit.signal
      })
    })

  const workerEnv = (s: Session): Record<string, string> | undefined =>
    s.launchEnv === undefined && s.clientEnv === undefined ? undefined : { ...s.clientEnv, ...s.launchEnv }

  /** Starts a worker for the session and supervises it (restores it after each crash). */
  const startWorker = (s: Session, interruptedReason: "worker_crashed" | "daemon_restarted" | undefined, restoring: boolean) =>
    Effect.gen(function*() {
      yield* passivateBeyondLimit(s)
      const worker = yield* pool.acquire(s.meta.activeSessionId, workerEnv(s)).pipe(
        Effect.mapError(internal("worker"))
      )
      s.worker = worker
      const load: WorkerProtocol.SupervisorFrame = {
        type: "load",
        activeSessionId: s.meta.activeSessionId,
        engine: s.meta.engine,
        ...(s.meta.config === undefined ? {} : { config: s.meta.config as Record<string, unknown> }),
        ...(restoring
          ? {
            restore: {
              journalPath: info.journalPath,
              storeRoot: info.storeRoot,
              eventLogRoot: info.eventLogRoot,
              ...(interruptedReason === undefined ? {} : { interruptedReason })
            }
          }
          : {})
      }
      yield* worker.send(load)
      yield* fork(supervise(s, worker))
    })

  /** Runs the pump; on WorkerCrashed, the restore effect. */
  const supervise = (s: Session, worker: WorkerProcess): Effect.Effect<void> =>
    pump(s, worker).pipe(
      Effect.catchTag("WorkerCrashed", (crash) => restore(s, crash)),
      Effect.catchAllCause((cause) => failSession(s, worker, cause))
    )

  /**
   * The supervisor of a session failed for another reason than its worker's exit: its events
   * cannot be logged (a full disk, an unwritable state dir). The session is `failed`, never
   * left busy or starting: the worker stops, a running turn ends for everyone waiting on it,
   * prompts get `session_failed` until `retry_worker`.
   */
  const failSession = (s: Session, worker: WorkerProcess, cause: Cause.Cause<unknown>) =>
    Effect.gen(function*() {
      const id = s.meta.activeSessionId
      yield* Effect.logError(`session ${id} failed: its supervisor stopped`, cause)
      if (s.worker === worker) s.worker = undefined
      if (!s.closed) s.workerState = "failed"
      s.lastTurnEnd = "worker_crashed"
      yield* fork(Effect.asVoid(worker.stop()))
      const failure = new CommandError({
        code: "session_failed",
        message: `Session \`${id}\` failed: ${Cause.squash(cause) instanceof Error ? (Cause.squash(cause) as Error).message : "its events could not be logged"}; use retry_worker.`
      })
      yield* Deferred.fail(s.ready, failure)
      if (s.busy) {
        s.busy = false
        yield* Deferred.succeed(s.turnEnded, undefined)
      }
      // Tell attached clients if the log takes it; it may well not.
      yield* Effect.catchAllCause(publishStatus(s), () => Effect.void)
    })

  /** The restore effect: a replacement worker under the same activeSessionId. */
  const restore = (s: Session, crash: WorkerCrashed) =>
    Effect.gen(function*() {
      yield* Effect.logWarning(crash.message)
      const now = Date.now()
      s.crashTimes = s.crashTimes.filter((t) => now - t < restartPolicy.restartWindowMs)
      s.crashTimes.push(now)
      s.restarts++
      const decision = nextRestart(restartPolicy, s.crashTimes, now)
      if (s.workerState !== "recovering") {
        s.workerState = "recovering"
        s.ready = yield* Deferred.make<void, CommandError>()
        yield* publishStatus(s)
      }
      if (decision._tag === "failed") {
        s.workerState = "failed"
        if (s.busy) {
          yield* publish(s, { type: "session_event", event: { type: "turn_interrupted", reason: "worker_crashed" } as Protocol.AgentEvent })
          s.busy = false
          const ended = s.turnEnded
          yield* record(s, false, "failed")
          yield* Deferred.succeed(ended, undefined)
        }
        yield* publishStatus(s)
        yield* Deferred.fail(s.ready, new CommandError({ code: "session_failed", message: `Session \`${s.meta.activeSessionId}\` failed: its worker crashed ${s.crashTimes.length} times within ${restartPolicy.restartWindowMs} ms.` }))
        return
      }
      if (decision.delayMs > 0) yield* Effect.sleep(Duration.millis(decision.delayMs))
      if (s.closed) return
      yield* startWorker(s, "worker_crashed", true).pipe(
        Effect.catchAll((e) =>
          Effect.gen(function*() {
            yield* Effect.logError(`restore of ${s.meta.activeSessionId}: ${e.message}`)
            s.workerState = "failed"
            yield* publishStatus(s)
            yield* Deferred.fail(s.ready, e)
          })
        )
      )
    })

  /** Makes sure the session has a worker (starting one for a passivated or failed-over session). */
  const ensureWorker = (s: Session) =>
    Effect.gen(function*() {
      s.lastUsed = Date.now()
      if (s.workerState === "failed") {
        return yield* new CommandError({ code: "session_failed", message: `Session \`${s.meta.activeSessionId}\` has failed; use retry_worker.` })
      }
      if (s.workerState === "passivated" || (s.worker === undefined && s.workerState === "ready")) {
        yield* s.lifecycle.withPermits(1)(Effect.gen(function*() {
          if (s.workerState !== "passivated" && s.worker !== undefined) return
          s.workerState = "starting"
          s.ready = yield* Deferred.make<void, CommandError>()
          yield* publishStatus(s)
          yield* startWorker(s, undefined, true)
        }))
      }
      yield* Deferred.await(s.ready)
    })

  /** Stops the least recently used idle workers so a new one fits under maxWorkers. */
  const passivateBeyondLimit = (except: Session) =>
    Effect.gen(function*() {
      const withWorkers = [...sessions.values()].filter((x) => x.worker !== undefined && x !== except)
      let excess = withWorkers.length + 1 - config.maxWorkers
      if (excess <= 0) return
      const idle = withWorkers
        .filter((x) => !x.busy && x.workerState === "ready" && x.incomingSnapshot === undefined)
        .sort((a, b) => a.lastUsed - b.lastUsed)
      for (const victim of idle) {
        if (excess-- <= 0) break
        yield* fork(passivate(victim))
      }
    })

  /** Checkpoint, then stop the worker; the next use restores it. */
  const passivate = (s: Session) =>
    Effect.gen(function*() {
      if (s.generationEvents > 0) yield* Effect.ignoreLogged(checkpointSession(s))
      yield* s.lifecycle.withPermits(1)(Effect.gen(function*() {
        const worker = s.worker
        if (worker === undefined || s.busy) return
        s.worker = undefined
        yield* worker.stop()
        s.workerState = "passivated"
        yield* publishStatus(s)
      }))
    })

  // ------------------------------------------------------------------------------------------
  // Snapshots and checkpoints
  // ------------------------------------------------------------------------------------------

  const handleSnapshotFrame = (s: Session, frame: { readonly type: string; readonly [k: string]: unknown }) =>
    Effect.gen(function*() {
      const incoming = s.incomingSnapshot
      if (incoming === undefined || frame["snapshotId"] !== incoming.snapshotId) {
        return yield* Effect.logWarning(`unexpected snapshot frame ${frame.type} from ${s.meta.activeSessionId}`)
      }
      const id = incoming.snapshotId
      const fail = (message: string) =>
        Effect.gen(function*() {
          s.incomingSnapshot = undefined
          yield* Effect.ignore(cache.markFailed(id, message))
          yield* Deferred.fail(incoming.done, new CommandError({ code: "internal", message }))
        })
      const result = yield* Effect.either(Effect.gen(function*() {
        switch (frame.type) {
          case "session_snapshot_begin":
            yield* cache.create(id, {
              activeSessionId: s.meta.activeSessionId,
              messageCount: frame["messageCount"] as number,
              targetChunkBytes: frame["targetChunkBytes"] as number,
              cursor: s.lastCursor
            })
            return
          case "session_snapshot_chunk":
            yield* cache.appendChunk(id, Buffer.from(JSON.stringify(frame) + "\n"))
            return
          case "session_snapshot_end": {
            yield* cache.markComplete(id, {
              chunkCount: frame["chunkCount"] as number,
              lastEventSequence: s.lastCursor?.sequence ?? -1,
              lastEventCursor: s.lastCursor
            })
            s.incomingSnapshot = undefined
            yield* Deferred.succeed(incoming.done, undefined)
            return
          }
          case "session_snapshot_failed":
            return yield* fail(`the worker could not snapshot: ${JSON.stringify(frame["error"])}`)
        }
      }))
      if (Either.isLeft(result)) yield* fail(result.left.message)
    })

  /** Chunks of a snapshot entry as the messages they hold. */
  const entryMessages = (snapshotId: string) =>
    cache.stream(snapshotId).pipe(
      Stream.mapConcat((bytes) => (JSON.parse(Buffer.from(bytes).toString("utf8")) as { messages: Array<unknown> }).messages)
    )

  /**
   * A new generation: the worker streams its state into the snapshot cache, the transcript is
   * written from it, then the event log moves on. Never in the middle of a turn.
   */
  const checkpointSession = (s: Session): Effect.Effect<{ generation: number; snapshotId: string }, CommandError> =>
    Effect.gen(function*() {
      while (s.busy) yield* Deferred.await(s.turnEnded)
      yield* ensureWorker(s)
      return yield* s.lifecycle.withPermits(1)(Effect.gen(function*() {
        // The lifecycle lock may have been taken by a turn start meanwhile.
        while (s.busy) yield* Deferred.await(s.turnEnded)
        const worker = s.worker
        if (worker === undefined) return yield* new CommandError({ code: "internal", message: "no worker to checkpoint" })
        const generation = s.generation + 1
        const snapshotId = snapshotIdOf(s, generation)
        const done = yield* Deferred.make<void, CommandError>()
        s.incomingSnapshot = { snapshotId, done }
        yield* record(s, false, "snapshot_begin")
        yield* worker.send({ type: "checkpoint", snapshotId, targetChunkBytes: config.targetChunkBytes })
        yield* Deferred.await(done)
        const snapshotCursor = s.lastCursor
        const messageCount = (yield* cache.info(snapshotId).pipe(Effect.mapError(internal("snapshot")))).meta.messageCount
        const written = yield* store.writeSnapshot(
          s.meta.activeSessionId,
          { snapshotId, generation, messageCount, ...(snapshotCursor === undefined ? {} : { cursor: snapshotCursor }) },
          entryMessages(snapshotId)
        ).pipe(Effect.mapError(internal("transcript")))
        yield* log.startGeneration(s.meta.activeSessionId).pipe(Effect.mapError(internal("event log")))
        const previous = s.snapshotId
        s.generation = generation
        s.snapshotCursor = snapshotCursor
        s.baseMessageCount = messageCount
        s.generationEvents = 0
        s.generationBytes = 0
        s.snapshotId = snapshotId
        if (previous !== undefined) yield* Effect.ignore(cache.dispose(previous))
        yield* record(s, false, "snapshot_end", written.path)
        const keepFrom = generation - config.retainGenerations + 1
        if (keepFrom > 1) {
          yield* Effect.ignoreLogged(log.prune(s.meta.activeSessionId, keepFrom))
          yield* Effect.ignoreLogged(store.pruneSnapshots(s.meta.activeSessionId, keepFrom))
        }
        return { generation, snapshotId }
      }))
    })

  /** The messages of the current generation's snapshot, read from its transcript file. */
  const snapshotLines = (s: Session): Stream.Stream<string, CommandError> =>
    s.generation === 1
      ? Stream.empty
      : store.readSnapshotLines(s.meta.activeSessionId, s.generation).pipe(Stream.mapError(internal("transcript")))

  /** Every message of the transcript: the snapshot, then the messages ended since. */
  const transcript = (s: Session): Stream.Stream<AgentMessage, CommandError> =>
    Stream.concat(
      Stream.map(snapshotLines(s), (line) => JSON.parse(line) as AgentMessage),
      log.readGeneration(s.meta.activeSessionId, s.generation).pipe(
        Stream.filterMap((r) => {
          const body = r.event as unknown as LoggedBody
          return body.type === "session_event" && body.event.type === "message_end"
            ? Option.some((body.event as Extract<Protocol.AgentEvent, { type: "message_end" }>).message)
            : Option.none()
        }),
        Stream.mapError(internal("event log"))
      )
    )

  /**
   * The current generation's snapshot in the cache: the entry the worker's checkpoint filled,
   * or one chunked now from the transcript file (after a restart), without reading it whole.
   */
  const currentSnapshotEntry = (s: Session) =>
    Effect.gen(function*() {
      const existing = s.snapshotId
      if (existing !== undefined) {
        const ok = yield* Effect.either(cache.info(existing))
        if (Either.isRight(ok) && !ok.right.disposed && ok.right.status !== "failed") return existing
      }
      const snapshotId = `${snapshotIdOf(s, s.generation)}~${randomUUID().slice(0, 8)}`
      yield* cache.create(snapshotId, {
        activeSessionId: s.meta.activeSessionId,
        messageCount: s.baseMessageCount,
        targetChunkBytes: config.targetChunkBytes,
        cursor: s.snapshotCursor
      }).pipe(Effect.mapError(internal("snapshot cache")))
      const builder = new ChunkBuilder(s.meta.activeSessionId, snapshotId, config.targetChunkBytes)
      const filled = yield* Effect.either(Effect.gen(function*() {
        yield* snapshotLines(s).pipe(
          Stream.runForEach((line) => {
            const chunk = builder.add(line)
            return chunk === undefined ? Effect.void : Effect.asVoid(cache.appendChunk(snapshotId, chunk))
          })
        )
        const last = builder.finish()
        if (last !== undefined) yield* cache.appendChunk(snapshotId, last)
        yield* cache.markComplete(snapshotId, {
          chunkCount: builder.chunkCount,
          lastEventSequence: s.snapshotCursor?.sequence ?? -1,
          lastEventCursor: s.snapshotCursor
        })
      }))
      if (Either.isLeft(filled)) {
        yield* Effect.ignore(cache.markFailed(snapshotId, filled.left.message))
        return yield* internal("snapshot")(filled.left)
      }
      if (existing !== undefined) yield* Effect.ignore(cache.dispose(existing))
      s.snapshotId = snapshotId
      return snapshotId
    })

  // ------------------------------------------------------------------------------------------
  // Attach and delivery
  // ------------------------------------------------------------------------------------------

  /** The last sequence of a generation, read from the log (only for cursor_unknown checks). */
  const lastSequenceOf = (s: Session, generation: number) =>
    log.readGeneration(s.meta.activeSessionId, generation).pipe(
      Stream.runFold(-1, (_, r: EventRecord) => r.cursor.sequence),
      Effect.orElseSucceed(() => -1)
    )

  type Decision =
    | { readonly kind: "complete"; readonly after: Cursor.Cursor }
    | { readonly kind: "baseline"; readonly replay: Protocol.Replay }

  const decide = (s: Session, resume: Cursor.Cursor | undefined) =>
    Effect.gen(function*(): Effect.fn.Return<Decision, CommandError> {
      if (resume === undefined) return { kind: "baseline", replay: { status: "unavailable", reason: "no_cursor" } }
      const last = s.lastCursor
      if (last === undefined || Cursor.isAfter(resume, last)) {
        return { kind: "baseline", replay: { status: "unavailable", reason: "cursor_ahead" } }
      }
      const generations = yield* log.generations(s.meta.activeSessionId).pipe(Effect.mapError(internal("event log")))
      const oldest = generations[0] ?? s.generation
      if (resume.generation < oldest) {
        return { kind: "baseline", replay: { status: "partial", reason: "cursor_expired" } }
      }
      if (resume.generation < last.generation) {
        const lastSeq = yield* lastSequenceOf(s, resume.generation)
        if (resume.sequence > lastSeq) {
          return { kind: "baseline", replay: { status: "unavailable", reason: "cursor_unknown" } }
        }
      }
      return { kind: "complete", after: resume }
    })

  /** Reads the events after `a.delivered` up to the session's last, then turns live. */
  const catchUp = (a: Attachment) =>
    Effect.gen(function*() {
      const s = a.session
      const id = s.meta.activeSessionId
      const sessionJson = JSON.stringify(id)
      while (!a.detached && !a.outbox.isClosed) {
        const target = s.lastCursor
        if (target === undefined || (a.delivered !== undefined && !Cursor.isBefore(a.delivered, target))) {
          // Caught up: from now on publish writes to this client directly.
          a.mode = "live"
          yield* Effect.async<void>((resume) => {
            if (a.mode !== "live" || a.detached) return resume(Effect.void)
            a.wake = () => resume(Effect.void)
          })
          if (a.detached || a.outbox.isClosed) return
          // Paused: wait for the client to drain, then re-send what it missed from the log.
          yield* a.outbox.awaitBelow(Math.max(1, a.limit / 2))
          a.resumed = true
          a.mode = "catchup"
          continue
        }
        yield* log.read(id, a.delivered).pipe(
          Stream.takeWhile((r) => !Cursor.isAfter(r.cursor, target)),
          Stream.runForEach((r) =>
            Effect.gen(function*() {
              if (a.detached) return yield* Effect.interrupt
              if (a.outbox.queuedBytes >= a.limit) yield* a.outbox.awaitBelow(a.limit)
              const replayed = a.resumed || (a.attachCursor !== undefined && !Cursor.isAfter(r.cursor, a.attachCursor))
              a.outbox.offer(wireLineOfRecord(sessionJson, r, replayed))
              a.delivered = r.cursor
            })
          ),
          Effect.catchAllCause((cause) => Effect.logDebug("catch-up stopped", cause))
        )
      }
    })

  const detachAttachment = (a: Attachment) => {
    a.detached = true
    a.session.attachments.delete(a)
    a.signal()
    const byConn = connections.get(a.connectionId)
    if (byConn?.get(a.session.meta.activeSessionId) === a) byConn.delete(a.session.meta.activeSessionId)
    if (byConn?.size === 0) connections.delete(a.connectionId)
  }

  const filterEnv = (env: Record<string, string> | undefined) => {
    if (env === undefined) return undefined
    const out: Record<string, string> = {}
    for (const key of config.clientEnvKeys) if (Object.hasOwn(env, key)) out[key] = env[key]!
    return out
  }

  const attach = (connectionId: string, outbox: Outbox, cmd: CommandOf<"attach">) =>
    Effect.gen(function*() {
      const s = yield* get(cmd.activeSessionId)
      if (cmd.telemetryDisabled === true && s.meta.telemetry) {
        return yield* new CommandError({
          code: "telemetry_policy_violation",
          message: `Session \`${s.meta.activeSessionId}\` was created with telemetry on; it cannot be attached with telemetryDisabled.`
        })
      }
      if (cmd.launchEnv !== undefined) s.launchEnv = { ...cmd.launchEnv }
      if (cmd.env !== undefined) s.clientEnv = filterEnv(cmd.env)
      const capabilities = cmd.capabilities ?? Protocol.DEFAULT_CLIENT_CAPABILITIES
      const chunked = capabilities.includes("chunked_snapshot")
      const slim = capabilities.includes("slim_attach")
      const decision = yield* decide(s, cmd.resumeCursor)
      // From here to the registration nothing yields: the attachment sees every later event.
      const previous = connections.get(connectionId)?.get(s.meta.activeSessionId)
      if (previous !== undefined) detachAttachment(previous)
      const lastCursor = s.lastCursor
      const attachment = new Attachment(s, outbox, connectionId, config.outboxBytes, lastCursor)
      const state = summary(s)
      let replay: Protocol.Replay
      let snapshotId = `${snapshotIdOf(s, s.generation)}`
      let snapshotMessages: ReadonlyArray<AgentMessage> = []
      let stream: string | undefined
      if (decision.kind === "complete") {
        attachment.delivered = decision.after
        const count = lastCursor === undefined ? 0 : yield* countEvents(s, decision.after, lastCursor)
        replay = count === 0
          ? { status: "complete", eventCount: 0 }
          : { status: "complete", fromCursor: yield* firstAfter(s, decision.after), toCursor: lastCursor!, eventCount: count }
      } else {
        attachment.delivered = s.snapshotCursor
        const count = s.generationEvents
        replay = { ...decision.replay, eventCount: count }
        if (count > 0 && lastCursor !== undefined) {
          replay = { ...replay, fromCursor: Cursor.make(s.generation, 0), toCursor: lastCursor }
        }
        if (chunked) {
          stream = yield* currentSnapshotEntry(s)
          snapshotId = stream
        } else {
          snapshotMessages = Chunk.toReadonlyArray(
            yield* Stream.runCollect(Stream.map(snapshotLines(s), (line) => JSON.parse(line) as AgentMessage))
          )
        }
      }
      s.attachments.add(attachment)
      let byConn = connections.get(connectionId)
      if (byConn === undefined) connections.set(connectionId, byConn = new Map())
      byConn.set(s.meta.activeSessionId, attachment)

      const data: { -readonly [K in keyof Protocol.DaemonAttachResult]: Protocol.DaemonAttachResult[K] } = {
        protocol: Protocol.PROTOCOL,
        activeSessionId: s.meta.activeSessionId,
        snapshot: {
          snapshotId,
          ...(s.snapshotCursor === undefined ? {} : { cursor: s.snapshotCursor }),
          messageCount: decision.kind === "complete" ? 0 : s.baseMessageCount,
          messages: snapshotMessages
        },
        replay,
        lastEventSequence: lastCursor?.sequence ?? -1,
        client: { id: connectionId, capabilities }
      }
      if (!slim) {
        data.state = state
        data.messages = snapshotMessages
      }
      if (lastCursor !== undefined) data.lastEventCursor = lastCursor
      if (stream !== undefined) {
        data.snapshotStream = { id: stream, messageCount: s.baseMessageCount, targetChunkBytes: config.targetChunkBytes }
      }
      const purpose: Protocol.SnapshotPurpose = decision.kind === "baseline" && decision.replay.status === "partial"
        ? "resync"
        : "attach"
      const deliver = Effect.gen(function*() {
        if (stream !== undefined) {
          const ok = yield* streamSnapshot(attachment, stream, purpose)
          if (!ok) {
            detachAttachment(attachment)
            return
          }
        }
        outbox.offer(Protocol.encode({
          type: "session_attached",
          activeSessionId: s.meta.activeSessionId,
          state,
          replay,
          ...(lastCursor === undefined ? {} : { lastEventCursor: lastCursor })
        }))
        yield* catchUp(attachment)
      })
      return { data: data as Protocol.DaemonAttachResult, deliver }
    })

  /** Sends begin, every chunk and end (or failed); false when the client must re-attach. */
  const streamSnapshot = (a: Attachment, snapshotId: string, purpose: Protocol.SnapshotPurpose) =>
    Effect.scoped(Effect.gen(function*() {
      const s = a.session
      const base = { activeSessionId: s.meta.activeSessionId, snapshotId }
      const reader = yield* cache.retain(snapshotId)
      a.outbox.offer(Protocol.encode({
        type: "session_snapshot_begin",
        ...base,
        messageCount: reader.meta.messageCount,
        targetChunkBytes: reader.meta.targetChunkBytes,
        purpose,
        ...(reader.meta.cursor === undefined ? {} : { cursor: reader.meta.cursor })
      }))
      let index = 0
      while (true) {
        if (a.detached || a.outbox.isClosed) return false
        if (a.outbox.queuedBytes >= a.limit) yield* a.outbox.awaitBelow(a.limit)
        const next = yield* reader.waitForChunk(index)
        if (next._tag === "End") {
          a.outbox.offer(Protocol.encode({
            type: "session_snapshot_end",
            ...base,
            chunkCount: next.end.chunkCount,
            lastEventSequence: next.end.lastEventSequence,
            ...(next.end.lastEventCursor === undefined ? {} : { lastEventCursor: next.end.lastEventCursor })
          }))
          return true
        }
        a.outbox.offer(next.bytes)
        index++
      }
    })).pipe(
      Effect.catchAll((e) =>
        Effect.sync(() => {
          a.outbox.offer(Protocol.encode({
            type: "session_snapshot_failed",
            activeSessionId: a.session.meta.activeSessionId,
            snapshotId,
            error: { code: "internal", message: e.message }
          }))
          return false
        })
      )
    )

  const countEvents = (s: Session, after: Cursor.Cursor, until: Cursor.Cursor) =>
    after.generation === until.generation
      ? Effect.succeed(until.sequence - after.sequence)
      : log.read(s.meta.activeSessionId, after).pipe(
        Stream.takeWhile((r) => !Cursor.isAfter(r.cursor, until)),
        Stream.runCount,
        Effect.mapError(internal("event log"))
      )

  const firstAfter = (s: Session, after: Cursor.Cursor) =>
    log.read(s.meta.activeSessionId, after).pipe(
      Stream.take(1),
      Stream.runHead,
      Effect.map(Option.match({ onNone: () => Cursor.next(after), onSome: (r) => r.cursor })),
      Effect.mapError(internal("event log"))
    )

  // ------------------------------------------------------------------------------------------
  // Commands
  // ------------------------------------------------------------------------------------------

  const newSession = (meta: SessionMeta, workerState: WorkerState): Effect.Effect<Session> =>
    Effect.gen(function*() {
      return {
        meta,
        messageCount: 0,
        baseMessageCount: 0,
        generation: 1,
        snapshotCursor: undefined,
        generationEvents: 0,
        generationBytes: 0,
        lastCursor: undefined,
        worker: undefined,
        workerState,
        ready: yield* Deferred.make<void, CommandError>(),
        busy: false,
        turnEnding: false,
        turnEnded: yield* Deferred.make<void>(),
        turnId: "",
        lastTurnEnd: undefined,
        restarts: 0,
        crashTimes: [],
        attachments: new Set(),
        publishLock: yield* Effect.makeSemaphore(1),
        lifecycle: yield* Effect.makeSemaphore(1),
        lastUsed: Date.now(),
        launchEnv: undefined,
        clientEnv: undefined,
        incomingSnapshot: undefined,
        snapshotId: undefined,
        closed: false
      }
    })

  const create = (cmd: CommandOf<"create">) =>
    Effect.gen(function*() {
      const engine = cmd.engine ?? config.engine
      yield* engines.validate(engine, cmd.config ?? {}).pipe(
        Effect.mapError((e) =>
          new CommandError({
            code: "invalid_command",
            message: `Invalid \`create\` command: \`${e.reason === "unknown_engine" ? "engine" : "config"}\`: ${e.message}`
          })
        )
      )
      const activeSessionId = `s-${randomUUID()}`
      const meta: SessionMeta = {
        activeSessionId,
        sessionId: activeSessionId,
        engine,
        telemetry: cmd.telemetry ?? false,
        createdAt: new Date().toISOString(),
        ...(cmd.name === undefined ? {} : { name: cmd.name }),
        ...(cmd.config === undefined ? {} : { config: cmd.config as Record<string, unknown> })
      }
      yield* store.create(meta).pipe(Effect.mapError(internal("session store")))
      const s = yield* newSession(meta, "starting")
      s.launchEnv = cmd.launchEnv === undefined ? undefined : { ...cmd.launchEnv }
      s.clientEnv = filterEnv(cmd.env)
      sessions.set(activeSessionId, s)
      yield* record(s, false, "created")
      yield* s.lifecycle.withPermits(1)(startWorker(s, undefined, false)).pipe(
        Effect.catchAll((e) =>
          Effect.gen(function*() {
            s.workerState = "failed"
            yield* Deferred.fail(s.ready, e)
          })
        )
      )
      return { activeSessionId, state: summary(s) }
    })

  const prompt = (cmd: CommandOf<"prompt">) =>
    Effect.gen(function*() {
      const s = yield* get(cmd.activeSessionId)
      // A turn whose end is out is over for the client that saw it: its prompt waits for the
      // turn's idle status (and the prompts that wait with it race for the session).
      if (s.busy && s.turnEnding) {
        yield* Deferred.await(s.turnEnded)
        // Killed meanwhile: the session is gone.
        if (s.closed) return yield* Effect.fail(notFound(s.meta.activeSessionId))
      }
      if (s.busy) {
        return yield* new CommandError({ code: "session_busy", message: `Session \`${s.meta.activeSessionId}\` is running a turn.` })
      }
      // Taken before any wait, so a second prompt meanwhile gets session_busy.
      s.busy = true
      s.turnEnding = false
      s.turnEnded = yield* Deferred.make<void>()
      const started = yield* Effect.either(Effect.gen(function*() {
        yield* ensureWorker(s)
        yield* s.lifecycle.withPermits(1)(Effect.gen(function*() {
          const worker = s.worker
          if (worker === undefined || s.workerState !== "ready") {
            return yield* new CommandError({ code: "session_failed", message: `Session \`${s.meta.activeSessionId}\` has no worker.` })
          }
          yield* record(s, true, "prompt")
          yield* publishStatus(s)
          s.turnId = `t-${randomUUID()}`
          yield* worker.send({ type: "prompt", turnId: s.turnId, message: cmd.message })
        }))
      }))
      if (Either.isLeft(started)) {
        s.busy = false
        yield* Deferred.succeed(s.turnEnded, undefined)
        return yield* started.left
      }
      return { accepted: true as const }
    })

  const kill = (id: string) =>
    Effect.gen(function*() {
      const s = yield* get(id)
      yield* s.lifecycle.withPermits(1)(Effect.gen(function*() {
        yield* publish(s, { type: "session_closed", reason: "killed" })
        s.closed = true
        for (const a of [...s.attachments]) detachAttachment(a)
        const worker = s.worker
        s.worker = undefined
        s.workerState = "closed"
        if (worker !== undefined) yield* worker.stop()
        yield* record(s, false, "closed")
        yield* Effect.ignoreLogged(journal.forget(id))
        const archived = yield* store.archive(id).pipe(Effect.mapError(internal("session store")))
        yield* log.remove(id, { archiveTo: path.join(archived, "events") }).pipe(Effect.mapError(internal("event log")))
        if (s.snapshotId !== undefined) yield* Effect.ignore(cache.dispose(s.snapshotId))
        s.busy = false
        yield* Deferred.succeed(s.turnEnded, undefined)
        yield* Deferred.fail(s.ready, notFound(id))
        sessions.delete(id)
      }))
      return {}
    })

  // ------------------------------------------------------------------------------------------
  // Start-up: load every session; restore those that were busy when the last daemon died.
  // ------------------------------------------------------------------------------------------

  const loadSession = (meta: SessionMeta) =>
    Effect.gen(function*() {
      const id = meta.activeSessionId
      const s = yield* newSession(meta, "passivated")
      let status = yield* log.status(id)
      const snapshot = yield* store.latestSnapshot(id)
      if (Option.isSome(snapshot) && snapshot.value.header.generation > status.generation) {
        // The daemon died between writing a checkpoint's transcript and starting its generation:
        // the transcript is complete and durable, so finish that checkpoint.
        while (status.generation < snapshot.value.header.generation) yield* log.startGeneration(id)
        status = yield* log.status(id)
      }
      s.generation = status.generation
      s.lastCursor = Option.getOrUndefined(status.lastCursor)
      s.generationEvents = status.generationEvents
      s.generationBytes = status.generationBytes
      let after: Cursor.Cursor | undefined
      if (Option.isSome(snapshot)) {
        s.messageCount = snapshot.value.header.messageCount
        after = snapshot.value.header.cursor
      }
      const isCurrent = Option.isSome(snapshot) && snapshot.value.header.generation === status.generation
      s.snapshotCursor = isCurrent ? after : undefined
      s.baseMessageCount = s.messageCount
      yield* log.read(id, after).pipe(
        Stream.runForEach((r) =>
          Effect.sync(() => {
            const body = r.event as unknown as LoggedBody
            if (body.type === "session_event" && body.event.type === "message_end") s.messageCount++
            // Without a transcript of the current generation, its snapshot is what was folded
            // before its first event.
            if (!isCurrent && r.cursor.generation < status.generation) {
              s.snapshotCursor = r.cursor
              s.baseMessageCount = s.messageCount
            }
          })
        )
      )
      yield* Deferred.succeed(s.ready, undefined)
      sessions.set(id, s)
      return s
    })

  const metas = yield* store.list().pipe(Effect.orDie)
  const latest = yield* journal.latest()
  for (const meta of metas) {
    const loaded = yield* Effect.either(loadSession(meta))
    if (Either.isLeft(loaded)) {
      yield* Effect.logError(`cannot load session ${meta.activeSessionId}: ${String(loaded.left)}`)
      continue
    }
    const s = loaded.right
    const rec = latest.get(meta.activeSessionId)
    if (rec?.busy === true) {
      // It was running a turn when the daemon died: restore now, the worker reports the cut.
      s.busy = true
      s.workerState = "recovering"
      s.ready = yield* Deferred.make<void, CommandError>()
      yield* publishStatus(s)
      yield* startWorker(s, "daemon_restarted", true).pipe(
        Effect.catchAll((e) => Effect.logError(`restore of ${meta.activeSessionId}: ${e.message}`))
      )
    }
  }

  return SessionManager.of({
    create,
    list: Effect.sync(() => ({ sessions: [...sessions.values()].filter((s) => !s.closed).map(summary) })),
    status: Effect.gen(function*() {
      const live = yield* pool.live
      return {
        supervisorGeneration: info.generation,
        pid: process.pid,
        uptimeMs: Date.now() - info.startedAt,
        sessions: sessions.size,
        workers: live.filter((w) => w.activeSessionId !== undefined).map((w) => {
          const s = sessions.get(w.activeSessionId!)
          return { pid: w.pid, activeSessionId: w.activeSessionId!, state: s?.workerState ?? "closed", restarts: s?.restarts ?? 0 }
        })
      }
    }),
    attach,
    detach: (connectionId, id) =>
      Effect.gen(function*() {
        yield* get(id)
        const a = connections.get(connectionId)?.get(id)
        if (a !== undefined) detachAttachment(a)
      }),
    detachAll: (connectionId) =>
      Effect.sync(() => {
        for (const a of [...(connections.get(connectionId)?.values() ?? [])]) detachAttachment(a)
      }),
    attachedCount: (connectionId) => connections.get(connectionId)?.size ?? 0,
    prompt,
    abort: (cmd) =>
      Effect.gen(function*() {
        const s = yield* get(cmd.activeSessionId)
        if (!s.busy || s.worker === undefined || s.workerState !== "ready") return { aborted: false }
        // The turn may end by itself before the abort reaches the worker: answer with how it
        // actually ended.
        const ended = s.turnEnded
        yield* s.worker.send({ type: "abort", turnId: s.turnId })
        yield* Deferred.await(ended)
        return { aborted: s.lastTurnEnd === "aborted" }
      }),
    getState: (id) => Effect.map(get(id), summary),
    getMessages: (cmd) =>
      Effect.gen(function*() {
        const s = yield* get(cmd.activeSessionId)
        const total = s.messageCount
        const messages = yield* transcript(s).pipe(
          Stream.drop(cmd.offset ?? 0),
          Stream.take(cmd.limit ?? 100),
          Stream.runCollect
        )
        return { messages: Chunk.toReadonlyArray(messages), total }
      }),
    checkpoint: (id) => Effect.flatMap(get(id), checkpointSession),
    retryWorker: (id) =>
      Effect.gen(function*() {
        const s = yield* get(id)
        if (s.workerState === "failed") {
          yield* s.lifecycle.withPermits(1)(Effect.gen(function*() {
            s.crashTimes = []
            s.workerState = "recovering"
            s.ready = yield* Deferred.make<void, CommandError>()
            yield* publishStatus(s)
            yield* startWorker(s, undefined, true)
          }))
          yield* Deferred.await(s.ready)
        }
        return summary(s)
      }),
    kill
  })
})

/** The session manager over its storage, worker pool and configuration. */
export const layer: Layer.Layer<
  SessionManager,
  never,
  DaemonConfig | Engine | SupervisorInfo | EventLog | SessionStore | RecoveryJournal | SnapshotCache | WorkerPool
> = Layer.scoped(SessionManager, make)
