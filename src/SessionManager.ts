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
import * as FiberMap from "effect/FiberMap"
import * as FiberSet from "effect/FiberSet"
import * as Layer from "effect/Layer"
import * as Option from "effect/Option"
import * as Queue from "effect/Queue"
import * as Stream from "effect/Stream"
import { randomUUID } from "node:crypto"
import * as path from "node:path"
import * as Cursor from "./Cursor.js"
import { DaemonConfig } from "./DaemonConfig.js"
import { Engine } from "./Engine.js"
import { EventLog, type EventRecord } from "./EventLog.js"
import {
  bodyMessage,
  eventMessage,
  logged,
  type LoggedBody,
  type Outgoing,
  wireLine,
  wireLineOfRecord
} from "./internal/delivery/wireLines.js"
import {
  type AnyFrame,
  type CheckpointReply,
  type Input,
  type PendingPrompt,
  type Phase,
  type TurnEnd,
  workerOf,
  workerStateOf
} from "./internal/session/phase.js"
import * as Protocol from "./Protocol.js"
import type { AgentMessage, CommandOf, ErrorCode, SessionSummary, WorkerState } from "./Protocol.js"
import { RecoveryJournal } from "./RecoveryJournal.js"
import { type SessionMeta, SessionStore } from "./SessionStore.js"
import { ChunkBuilder, SnapshotCache } from "./SnapshotCache.js"
import {
  defaultRestartPolicy,
  restartSchedule,
  stepRestart,
  WorkerCrashed,
  type WorkerHandle,
  WorkerPool
} from "./WorkerPool.js"
import type * as WorkerProtocol from "./WorkerProtocol.js"

/**
 * Events of one worker read are logged and sent in batches of about this many bytes (one write,
 * one fsync, one encode for every client). A slow client is checked against its outbox limit
 * between batches, so it can go past the limit by one batch (or one larger event).
 */
const PUBLISH_BATCH_BYTES = 256 * 1024

/** More than the readers of one session's baseline at any one time. */
const READ_GATE_PERMITS = 1_000_000

/** A command failed with one of the documented error codes. */
export class CommandError extends Data.TaggedError("CommandError")<{
  readonly code: ErrorCode
  readonly message: string
}> {}

const notFound = (id: string) => new CommandError({ code: "session_not_found", message: `No session \`${id}\`.` })

/**
 * What the core needs of a client's connection: a queue of outgoing bytes it can fill without
 * waiting, and the means to wait for it to drain (the backpressure rules of PROTOCOL.md
 * section 5). The socket server's outbox is one; tests use an in-memory one.
 */
export interface ConnectionPort {
  /** Queues a line (or pre-encoded lines); never waits. Dropped once the connection is gone. */
  offer(data: string | Uint8Array): void
  /** Bytes queued and not yet written out. */
  readonly queuedBytes: number
  readonly isClosed: boolean
  /** Waits until fewer than `bytes` are queued (or the connection is gone). */
  awaitBelow(bytes: number): Effect.Effect<void>
}

/** Where the daemon's files live and what generation of supervisor this is. */
export class SupervisorInfo extends Context.Tag("agentd/SupervisorInfo")<SupervisorInfo, {
  readonly generation: number
  readonly startedAt: number
  readonly journalPath: string
  readonly storeRoot: string
  readonly eventLogRoot: string
}>() {}

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
    readonly outbox: ConnectionPort,
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
  attachments: Set<Attachment>
  /** Serializes appends so cursors are published in order. */
  publishLock: Effect.Semaphore
  /** Readers of the current generation take one permit; a checkpoint's completion takes them all. */
  readGate: Effect.Semaphore
  lastUsed: number
  launchEnv: Record<string, string> | undefined
  clientEnv: Record<string, string> | undefined
  /** The snapshot cache entry of the current generation, if built. */
  snapshotId: string | undefined
  closed: boolean
  // The lifecycle: read by anyone, changed only by the session's entity.
  phase: Phase
  /** Bumped at every worker start and stop: inputs of an older attempt are ignored. */
  epoch: number
  mailbox: Queue.Queue<Input>
  pendingPrompt: PendingPrompt | undefined
  /** A turn cut by a crash (of the worker or the daemon) whose `turn_interrupted` is owed. */
  cutTurn: Protocol.InterruptReason | undefined
  /** Checkpoints asked for, run when the session is next idle (during a turn: at its end). */
  checkpointWaiters: Array<CheckpointReply>
  /** An automatic checkpoint is due (one mark, however many turns asked). */
  checkpointDue: boolean
  passivationWanted: boolean
  retryWaiters: Array<Deferred.Deferred<SessionSummary, CommandError>>
  restarts: number
  /** The state of the restart schedule (the crashes in its window). */
  restartState: unknown
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
  readonly attach: (connectionId: string, outbox: ConnectionPort, cmd: CommandOf<"attach">) => Effect.Effect<AttachOutcome, CommandError>
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
  /** Each session's entity fiber, by activeSessionId. */
  const entities = yield* FiberMap.make<string>()
  const runtime = yield* Effect.runtime<never>()
  const sessions = new Map<string, Session>()
  /** connectionId -> its attachments. */
  const connections = new Map<string, Map<string, Attachment>>()
  const restartPolicy = {
    ...defaultRestartPolicy,
    maxRestarts: config.maxRestarts,
    restartWindowMs: config.restartWindowMs
  }
  const restarts = restartSchedule(restartPolicy)

  const fork = <A, E>(effect: Effect.Effect<A, E>) => FiberSet.run(fibers, effect).pipe(Effect.asVoid)

  const summary = (s: Session): SessionSummary => {
    const out: {
      -readonly [K in keyof SessionSummary]: SessionSummary[K]
    } = {
      activeSessionId: s.meta.activeSessionId,
      engine: s.meta.engine,
      createdAt: s.meta.createdAt,
      messageCount: s.messageCount,
      busy: s.phase._tag === "Running" || s.pendingPrompt !== undefined || s.cutTurn !== undefined,
      worker: workerStateOf(s.phase),
      restarts: s.restarts,
      telemetry: s.meta.telemetry
    }
    if (s.meta.name !== undefined) out.name = s.meta.name
    const worker = workerOf(s.phase)
    if (worker !== undefined) out.workerPid = worker.pid
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
  // The session entity: one fiber owns the lifecycle and takes every input from one mailbox
  // ------------------------------------------------------------------------------------------

  const workerEnv = (s: Session): Record<string, string> | undefined =>
    s.launchEnv === undefined && s.clientEnv === undefined ? undefined : { ...s.clientEnv, ...s.launchEnv }

  /**
   * Hands an input to the session's entity. Checked and offered in one synchronous step: once
   * the entity has closed the session nothing more is offered, so nothing waits forever.
   */
  const send = <A>(s: Session, make: (reply: Deferred.Deferred<A, CommandError>) => Input) =>
    Effect.flatMap(Deferred.make<A, CommandError>(), (reply) =>
      Effect.suspend(() => {
        if (s.closed) return Effect.fail(notFound(s.meta.activeSessionId))
        s.mailbox.unsafeOffer(make(reply))
        return Deferred.await(reply)
      }))

  /** Posts an input that needs no answer (from the session's own fibers). */
  const post = (s: Session, input: Input) =>
    Effect.sync(() => {
      if (!s.closed) s.mailbox.unsafeOffer(input)
    })

  const failed = (s: Session, message: string) => new CommandError({ code: "session_failed", message })

  /**
   * Starts a worker for the session (a new session, a wake-up, a restore): the acquisition runs
   * beside the entity, which stays free to answer; its outcome comes back through the mailbox.
   */
  const startWorker = (s: Session, worker: WorkerState & ("starting" | "recovering"), restoring: boolean) =>
    Effect.gen(function*() {
      const epoch = ++s.epoch
      const before = summary(s).worker
      s.phase = { _tag: "Starting", worker: undefined, state: worker, epoch }
      if (before !== worker) yield* publishStatus(s)
      const restore = restoring
        ? {
          journalPath: info.journalPath,
          storeRoot: info.storeRoot,
          eventLogRoot: info.eventLogRoot,
          ...(s.cutTurn === undefined ? {} : { interruptedReason: s.cutTurn })
        }
        : undefined
      const load: WorkerProtocol.SupervisorFrame = {
        type: "load",
        activeSessionId: s.meta.activeSessionId,
        engine: s.meta.engine,
        ...(s.meta.config === undefined ? {} : { config: s.meta.config as Record<string, unknown> }),
        ...(restore === undefined ? {} : { restore })
      }
      yield* fork(
        Effect.gen(function*() {
          yield* passivateBeyondLimit(s)
          const worker = yield* pool.acquire(s.meta.activeSessionId, workerEnv(s))
          // Sent at once, before the pool starts its next spare (a process booting beside a
          // restore slows it down); should this attempt be stale by now, the worker is stopped.
          yield* worker.send(load)
          return worker
        }).pipe(
          Effect.matchEffect({
            onFailure: (error) => post(s, { _tag: "AcquireFailed", epoch, message: error.message }),
            onSuccess: (w) => post(s, { _tag: "Acquired", epoch, worker: w })
          })
        )
      )
    })

  /** Pumps a worker's frames to the entity until the pipe closes, then reports the exit. */
  const pump = (s: Session, worker: WorkerHandle) =>
    Effect.gen(function*() {
      while (true) {
        const frames = yield* worker.takeFrames
        if (frames.length === 0) break
        // Waits until the entity has handled them: the worker's pipe is the backpressure.
        const handled = yield* Deferred.make<void>()
        yield* post(s, { _tag: "Frames", worker, frames, handled })
        if (s.closed) break
        yield* Deferred.await(handled)
      }
      const exit = yield* Deferred.await(worker.exited)
      yield* post(s, { _tag: "Exited", worker, exit })
    })

  /** The turn is over: its end is out, the journal says idle, the idle status follows. */
  const endTurn = (s: Session, how: TurnEnd, publishIdle: boolean) =>
    Effect.gen(function*() {
      const phase = s.phase
      const aborts = phase._tag === "Running" ? phase.aborts : []
      s.cutTurn = undefined
      if (phase._tag === "Running") s.phase = { _tag: "Idle", worker: phase.worker }
      yield* record(s, false, "turn_end")
      if (publishIdle) yield* publishStatus(s)
      for (const a of aborts) yield* Deferred.succeed(a, { aborted: how === "aborted" })
      if (s.generationEvents >= config.checkpointEvents || s.generationBytes >= config.checkpointBytes) s.checkpointDue = true
    })

  /** Starts the turn of the reserved prompt (the session is Idle). */
  const startTurn = (s: Session, worker: WorkerHandle, prompt: PendingPrompt) =>
    Effect.gen(function*() {
      s.pendingPrompt = undefined
      const turnId = `t-${randomUUID()}`
      s.phase = { _tag: "Running", worker, turnId, aborts: [] }
      s.lastUsed = Date.now()
      yield* record(s, true, "prompt")
      yield* publishStatus(s)
      yield* worker.send({ type: "prompt", turnId, message: prompt.message })
      yield* Deferred.succeed(prompt.reply, { accepted: true as const })
    })

  /** Asks the worker for its state: the first step of a checkpoint (the rest comes as frames). */
  const beginCheckpoint = (s: Session, worker: WorkerHandle) =>
    Effect.gen(function*() {
      const generation = s.generation + 1
      const snapshotId = snapshotIdOf(s, generation)
      const waiters = s.checkpointWaiters
      s.checkpointWaiters = []
      s.checkpointDue = false
      s.phase = { _tag: "Checkpointing", worker, snapshotId, generation, waiters, began: false }
      yield* record(s, false, "snapshot_begin")
      yield* worker.send({ type: "checkpoint", snapshotId, targetChunkBytes: config.targetChunkBytes })
    })

  /**
   * The worker's snapshot is complete in the cache: the transcript is written from it and the
   * log moves on to the new generation, in one step of the entity (no event can come between
   * the snapshot's cursor and the new generation).
   */
  const completeCheckpoint = (s: Session, phase: Extract<Phase, { _tag: "Checkpointing" }>) =>
    s.readGate.withPermits(READ_GATE_PERMITS)(Effect.gen(function*() {
      const { generation, snapshotId } = phase
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

  /** A checkpoint's snapshot that will not be completed: gone, so that a retry can take its id. */
  const discardSnapshot = (snapshotId: string, why: string) =>
    Effect.zipRight(Effect.ignore(cache.markFailed(snapshotId, why)), Effect.ignore(cache.dispose(snapshotId)))

  /** A snapshot frame of the running checkpoint; returns true when the checkpoint is over. */
  const snapshotFrame = (s: Session, phase: Extract<Phase, { _tag: "Checkpointing" }>, frame: AnyFrame) =>
    Effect.gen(function*() {
      if (frame["snapshotId"] !== phase.snapshotId) {
        yield* Effect.logWarning(`unexpected snapshot frame ${frame.type} from ${s.meta.activeSessionId}`)
        return false
      }
      const id = phase.snapshotId
      const outcome = yield* Effect.either(Effect.gen(function*(): Effect.fn.Return<{ generation: number; snapshotId: string } | undefined, CommandError> {
        switch (frame.type) {
          case "session_snapshot_begin":
            phase.began = true
            yield* cache.create(id, {
              activeSessionId: s.meta.activeSessionId,
              messageCount: frame["messageCount"] as number,
              targetChunkBytes: frame["targetChunkBytes"] as number,
              cursor: s.lastCursor
            }).pipe(Effect.mapError(internal("snapshot cache")))
            return undefined
          case "session_snapshot_chunk":
            yield* cache.appendChunk(id, Buffer.from(JSON.stringify(frame) + "\n")).pipe(Effect.mapError(internal("snapshot cache")))
            return undefined
          case "session_snapshot_end":
            yield* cache.markComplete(id, {
              chunkCount: frame["chunkCount"] as number,
              lastEventSequence: s.lastCursor?.sequence ?? -1,
              lastEventCursor: s.lastCursor
            }).pipe(Effect.mapError(internal("snapshot cache")))
            return yield* completeCheckpoint(s, phase)
          default:
            return yield* new CommandError({ code: "internal", message: `the worker could not snapshot: ${JSON.stringify(frame["error"])}` })
        }
      }))
      if (Either.isRight(outcome)) {
        const done = outcome.right
        if (done === undefined) return false
        s.phase = { _tag: "Idle", worker: phase.worker }
        for (const w of phase.waiters) yield* Deferred.succeed(w, done)
        return true
      }
      s.phase = { _tag: "Idle", worker: phase.worker }
      if (phase.began) yield* discardSnapshot(id, outcome.left.message)
      for (const w of phase.waiters) yield* Deferred.fail(w, outcome.left)
      return true
    })

  /**
   * The worker's frames, in order; consecutive events are logged together, in batches of about
   * PUBLISH_BATCH_BYTES (a slow client is checked against its limit between batches).
   */
  const onFrames = (s: Session, frames: ReadonlyArray<WorkerProtocol.ReceivedFrame>) =>
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
        const frame = raw as AnyFrame
        const phase = s.phase
        switch (frame.type) {
          case "worker_event": {
            const { eventJson, eventType } = raw as WorkerProtocol.EventFrame
            events.push(eventMessage(eventType, eventJson))
            eventBytes += eventJson.length
            if (eventBytes >= PUBLISH_BATCH_BYTES) yield* flushEvents
            if (eventType === "tool_execution_start" || eventType === "tool_execution_end") {
              yield* flushEvents
              yield* record(s, true, eventType === "tool_execution_start" ? "tool_start" : "tool_end")
            } else if (eventType === "agent_end" || eventType === "turn_interrupted") {
              yield* flushEvents
              const how: TurnEnd = eventType === "agent_end"
                ? "agent_end"
                : (JSON.parse(eventJson) as Extract<Protocol.AgentEvent, { type: "turn_interrupted" }>).reason
              // A restored worker reports the turn its predecessor was cut in: the `ready`
              // status that follows is that turn's idle status.
              if (phase._tag === "Running") yield* endTurn(s, how, true)
              else if (s.cutTurn !== undefined) yield* endTurn(s, how, false)
            }
            break
          }
          case "worker_ready": {
            yield* flushEvents
            if (phase._tag === "Starting" && phase.worker !== undefined) {
              // The turn cut by a crash ends before the worker is ready, whatever the worker said.
              if (s.cutTurn !== undefined) {
                yield* publish(s, { type: "session_event", event: { type: "turn_interrupted", reason: s.cutTurn } as Protocol.AgentEvent })
                yield* endTurn(s, s.cutTurn, false)
              }
              s.phase = { _tag: "Idle", worker: phase.worker }
              yield* publishStatus(s)
              for (const w of s.retryWaiters.splice(0)) yield* Deferred.succeed(w, summary(s))
            }
            break
          }
          case "worker_error": {
            yield* flushEvents
            yield* Effect.logWarning(`worker of ${s.meta.activeSessionId}: ${String(frame["message"])}`)
            // A worker that cannot load its session is as good as crashed.
            if (phase._tag === "Starting" && phase.worker !== undefined) phase.worker.kill()
            break
          }
          case "session_snapshot_begin":
          case "session_snapshot_chunk":
          case "session_snapshot_end":
          case "session_snapshot_failed": {
            yield* flushEvents
            if (phase._tag === "Checkpointing") yield* snapshotFrame(s, phase, frame)
            else yield* Effect.logWarning(`snapshot frame ${frame.type} of ${s.meta.activeSessionId} outside a checkpoint`)
            break
          }
          default:
            yield* Effect.logWarning(`worker of ${s.meta.activeSessionId}: unknown frame ${frame.type}`)
        }
      }
      yield* flushEvents
    })

  /** The worker exited without being asked to: the typed failure that triggers the restore. */
  const onCrash = (s: Session, crash: WorkerCrashed) =>
    Effect.gen(function*() {
      yield* Effect.logWarning(crash.message)
      const phase = s.phase
      if (phase._tag === "Running") s.cutTurn = "worker_crashed"
      if (phase._tag === "Checkpointing") {
        // The checkpoint is taken again from the replacement worker.
        if (phase.began) yield* discardSnapshot(phase.snapshotId, "the worker crashed")
        s.checkpointWaiters = [...phase.waiters, ...s.checkpointWaiters]
      }
      if (phase._tag === "Running") for (const a of phase.aborts) yield* Deferred.succeed(a, { aborted: false })
      s.restarts++
      const { state, step: decision } = yield* stepRestart(restarts, s.restartState, crash)
      s.restartState = state
      if (decision._tag === "failed") {
        return yield* failSession(s, `its worker crashed ${decision.crashes} times within ${restartPolicy.restartWindowMs} ms`)
      }
      const epoch = ++s.epoch
      s.phase = { _tag: "Starting", worker: undefined, state: "recovering", epoch }
      yield* publishStatus(s)
      // The first restart is immediate; later ones back off on the Clock.
      if (decision.delayMs === 0) return yield* startWorker(s, "recovering", true)
      yield* fork(Effect.zipRight(Effect.sleep(Duration.millis(decision.delayMs)), post(s, { _tag: "RestartDue", epoch })))
    })

  /**
   * The session cannot run: its worker keeps crashing or cannot be spawned, or its events
   * cannot be logged. Every request waiting on a worker is answered; a cut turn ends; the
   * session is `failed` until `retry_worker`.
   */
  const failSession = (s: Session, why: string) =>
    Effect.gen(function*() {
      // The new state in one synchronous step: `failed`, and not busy, for anyone who looks.
      const phase = s.phase
      const worker = workerOf(phase)
      const cut = phase._tag === "Running" ? "worker_crashed" as const : s.cutTurn
      const aborts = phase._tag === "Running" ? phase.aborts : []
      if (phase._tag === "Checkpointing") s.checkpointWaiters = [...phase.waiters, ...s.checkpointWaiters]
      s.epoch++
      s.phase = { _tag: "Failed" }
      s.cutTurn = undefined
      const error = failed(s, `Session \`${s.meta.activeSessionId}\` failed: ${why}; use retry_worker.`)
      const waiting = answerWaiting(s, error)
      for (const a of aborts) yield* Deferred.succeed(a, { aborted: false })
      yield* waiting
      if (worker !== undefined) yield* fork(Effect.asVoid(worker.stop()))
      if (cut !== undefined) {
        yield* Effect.catchAllCause(
          publish(s, { type: "session_event", event: { type: "turn_interrupted", reason: cut } as Protocol.AgentEvent }),
          () => Effect.void
        )
        yield* record(s, false, "failed")
      }
      // Tell attached clients if the log takes it; it may well not.
      yield* Effect.catchAllCause(publishStatus(s), () => Effect.void)
    })

  /**
   * Takes, synchronously, every request that waits for a worker (the session is no longer busy
   * with a reserved prompt from here); the effect returned answers them with `error`.
   */
  const answerWaiting = (s: Session, error: CommandError): Effect.Effect<void> => {
    const prompt = s.pendingPrompt
    s.pendingPrompt = undefined
    const checkpoints = s.checkpointWaiters.splice(0)
    const retries = s.retryWaiters.splice(0)
    s.checkpointDue = false
    return Effect.gen(function*() {
      if (prompt !== undefined) yield* Deferred.fail(prompt.reply, error)
      for (const w of checkpoints) yield* Deferred.fail(w, error)
      for (const w of retries) yield* Deferred.fail(w, error)
    })
  }

  /** Idle with work waiting: a checkpoint first (asked during the turn, or due), then a prompt. */
  const drain = (s: Session) =>
    Effect.gen(function*() {
      const phase = s.phase
      if (phase._tag !== "Idle") return
      if (s.checkpointWaiters.length > 0 || s.checkpointDue) return yield* beginCheckpoint(s, phase.worker)
      if (s.pendingPrompt !== undefined) return yield* startTurn(s, phase.worker, s.pendingPrompt)
      if (s.passivationWanted) {
        s.passivationWanted = false
        if (s.generationEvents > 0) {
          // Checkpoint first; passivation is asked again once it is done.
          s.checkpointDue = true
          s.passivationWanted = true
          return yield* beginCheckpoint(s, phase.worker)
        }
        s.epoch++
        s.phase = { _tag: "Passivated" }
        yield* fork(Effect.asVoid(phase.worker.stop()))
        yield* publishStatus(s)
      }
    })

  /** Wakes a passivated session (or retries a failed one): a worker that restores it. */
  const wake = (s: Session) => startWorker(s, s.phase._tag === "Failed" ? "recovering" : "starting", true)

  const onInput = (s: Session, input: Input): Effect.Effect<void> => {
    const phase = s.phase
    switch (input._tag) {
      case "Prompt": {
        s.lastUsed = Date.now()
        if (phase._tag === "Failed") {
          return Deferred.fail(input.reply, failed(s, `Session \`${s.meta.activeSessionId}\` has failed; use retry_worker.`))
        }
        if (phase._tag === "Running" || s.pendingPrompt !== undefined || s.cutTurn !== undefined) {
          return Deferred.fail(input.reply, new CommandError({ code: "session_busy", message: `Session \`${s.meta.activeSessionId}\` is running a turn.` }))
        }
        // Reserved now (busy); runs once the session is idle with a worker.
        s.pendingPrompt = { message: input.message, reply: input.reply }
        if (phase._tag === "Passivated") return wake(s)
        // Said to attached clients at once, as a prompt that runs at once does; but not during a
        // checkpoint: nothing may be logged between the snapshot's cursor and its generation
        // (the status goes out when the turn starts, right after).
        return phase._tag === "Idle" || phase._tag === "Checkpointing" ? Effect.void : publishStatus(s)
      }
      case "Abort": {
        // Only a running turn can be aborted; a prompt that has not started yet is not a turn.
        if (phase._tag !== "Running") return Deferred.succeed(input.reply, { aborted: false })
        phase.aborts.push(input.reply)
        return phase.worker.send({ type: "abort", turnId: phase.turnId })
      }
      case "Checkpoint": {
        if (phase._tag === "Failed") {
          return Deferred.fail(input.reply, failed(s, `Session \`${s.meta.activeSessionId}\` has failed; use retry_worker.`))
        }
        if (phase._tag === "Checkpointing") {
          // The checkpoint under way answers it (its snapshot is the state when it was asked).
          phase.waiters.push(input.reply)
          return Effect.void
        }
        s.checkpointWaiters.push(input.reply)
        return phase._tag === "Passivated" ? wake(s) : Effect.void
      }
      case "Retry": {
        if (phase._tag !== "Failed") return Deferred.succeed(input.reply, summary(s))
        s.restartState = restarts.initial
        s.retryWaiters.push(input.reply)
        return wake(s)
      }
      case "Passivate": {
        if (phase._tag === "Idle" && s.pendingPrompt === undefined && s.checkpointWaiters.length === 0) s.passivationWanted = true
        return Effect.void
      }
      case "Kill":
        return killSession(s, input.reply)
      case "Acquired": {
        if (phase._tag !== "Starting" || phase.epoch !== input.epoch) return Effect.asVoid(input.worker.stop())
        s.phase = { ...phase, worker: input.worker }
        return fork(pump(s, input.worker))
      }
      case "AcquireFailed": {
        if (phase._tag !== "Starting" || phase.epoch !== input.epoch) return Effect.void
        // A spawn that fails counts as a crash: retried with backoff, then `failed`.
        return Effect.zipRight(
          Effect.logError(`no worker for ${s.meta.activeSessionId}: ${input.message}`),
          onCrash(s, new WorkerCrashed({ activeSessionId: s.meta.activeSessionId, pid: 0, exitCode: null, signal: null }))
        )
      }
      case "Restore":
        return phase._tag === "Passivated" ? startWorker(s, "recovering", true) : Effect.void
      case "RestartDue": {
        if (phase._tag !== "Starting" || phase.epoch !== input.epoch || phase.worker !== undefined) return Effect.void
        return startWorker(s, "recovering", true)
      }
      case "Frames": {
        if (workerOf(phase) !== input.worker) return Deferred.succeed(input.handled, undefined)
        return Effect.ensuring(onFrames(s, input.frames), Deferred.succeed(input.handled, undefined))
      }
      case "Exited": {
        if (workerOf(phase) !== input.worker || input.worker.stopping) return Effect.void
        return onCrash(s, new WorkerCrashed({
          activeSessionId: s.meta.activeSessionId,
          pid: input.worker.pid,
          exitCode: input.exit.code,
          signal: input.exit.signal
        }))
      }
    }
  }

  /** `kill`: closed for everyone, the worker stops, the files move to the archive. */
  const killSession = (s: Session, reply: Deferred.Deferred<{}, CommandError>) =>
    Effect.gen(function*() {
      const id = s.meta.activeSessionId
      const phase = s.phase
      const worker = workerOf(phase)
      yield* Effect.catchAllCause(publish(s, { type: "session_closed", reason: "killed" }), () => Effect.void)
      s.epoch++
      s.phase = { _tag: "Closed" }
      s.closed = true
      s.cutTurn = undefined
      for (const a of [...s.attachments]) detachAttachment(a)
      // Stopped before the answer: once `kill` is answered the worker is gone.
      if (worker !== undefined) yield* Effect.asVoid(worker.stop())
      const gone = notFound(id)
      if (phase._tag === "Running") for (const a of phase.aborts) yield* Deferred.fail(a, gone)
      if (phase._tag === "Checkpointing") for (const w of phase.waiters) yield* Deferred.fail(w, gone)
      yield* answerWaiting(s, gone)
      const archived = yield* Effect.either(Effect.gen(function*() {
        yield* record(s, false, "closed")
        yield* Effect.ignoreLogged(journal.forget(id))
        const dir = yield* store.archive(id).pipe(Effect.mapError(internal("session store")))
        yield* log.remove(id, { archiveTo: path.join(dir, "events") }).pipe(Effect.mapError(internal("event log")))
      }))
      if (s.snapshotId !== undefined) yield* Effect.ignore(cache.dispose(s.snapshotId))
      sessions.delete(id)
      if (Either.isLeft(archived)) yield* Deferred.fail(reply, archived.left)
      else yield* Deferred.succeed(reply, {})
    })

  /** The reply of an input, if it has one (to answer it when the session is gone). */
  const answerGone = (s: Session, input: Input): Effect.Effect<void> => {
    const gone = notFound(s.meta.activeSessionId)
    switch (input._tag) {
      case "Prompt":
      case "Abort":
      case "Checkpoint":
      case "Retry":
      case "Kill":
        return Deferred.fail(input.reply as Deferred.Deferred<unknown, CommandError>, gone).pipe(Effect.asVoid)
      case "Acquired":
        return Effect.asVoid(input.worker.stop())
      case "Frames":
        return Deferred.succeed(input.handled, undefined).pipe(Effect.asVoid)
      default:
        return Effect.void
    }
  }

  /** Something broke inside a transition (the log refuses writes): the session fails, loudly. */
  const onDefect = (s: Session, cause: Cause.Cause<unknown>) =>
    Effect.gen(function*() {
      yield* Effect.logError(`session ${s.meta.activeSessionId} failed: a transition could not complete`, cause)
      if (s.closed) return
      const squashed = Cause.squash(cause)
      yield* failSession(s, squashed instanceof Error ? squashed.message : "its events could not be logged")
    }).pipe(Effect.catchAllCause((again) => Effect.logError(`session ${s.meta.activeSessionId}: could not fail cleanly`, again)))

  /** The entity: takes one input at a time; after each, idle work waiting runs. */
  const runEntity = (s: Session): Effect.Effect<void> =>
    Effect.gen(function*() {
      while (!s.closed) {
        const input = yield* Queue.take(s.mailbox)
        yield* onInput(s, input).pipe(Effect.catchAllCause((cause) => onDefect(s, cause)))
        if (!s.closed) yield* drain(s).pipe(Effect.catchAllCause((cause) => onDefect(s, cause)))
      }
      // Closed: nothing more is offered; what was offered before is answered.
      for (const input of yield* Queue.takeAll(s.mailbox)) yield* answerGone(s, input)
    })

  /** Asks the least recently used idle sessions to passivate so a new worker fits under maxWorkers. */
  const passivateBeyondLimit = (except: Session) =>
    Effect.gen(function*() {
      const withWorkers = [...sessions.values()].filter((x) => x !== except && workerOf(x.phase) !== undefined)
      let excess = withWorkers.length + 1 - config.maxWorkers
      if (excess <= 0) return
      const idle = withWorkers
        .filter((x) => x.phase._tag === "Idle" && x.pendingPrompt === undefined && !x.passivationWanted)
        .sort((a, b) => a.lastUsed - b.lastUsed)
      for (const victim of idle) {
        if (excess-- <= 0) break
        yield* post(victim, { _tag: "Passivate" })
      }
    })

  /** Chunks of a snapshot entry as the messages they hold. */
  const entryMessages = (snapshotId: string) =>
    cache.stream(snapshotId).pipe(
      Stream.mapConcat((bytes) => (JSON.parse(Buffer.from(bytes).toString("utf8")) as { messages: Array<unknown> }).messages)
    )

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
        // The very end of a pruned generation is the current snapshot's cursor: nothing after
        // it is missing.
        const atSnapshot = oldest === s.generation && s.snapshotCursor !== undefined &&
          resume.generation === s.snapshotCursor.generation && resume.sequence === s.snapshotCursor.sequence
        if (!atSnapshot) return { kind: "baseline", replay: { status: "partial", reason: "cursor_expired" } }
        return { kind: "complete", after: resume }
      }
      if (resume.generation < last.generation) {
        const lastSeq = yield* lastSequenceOf(s, resume.generation)
        if (resume.sequence > lastSeq) {
          return { kind: "baseline", replay: { status: "unavailable", reason: "cursor_unknown" } }
        }
      }
      return { kind: "complete", after: resume }
    })

  /** Replaces a client's state with the current generation's snapshot; false when it must re-attach. */
  const resync = (a: Attachment) =>
    Effect.gen(function*() {
      const s = a.session
      const chosen = yield* Effect.either(s.readGate.withPermits(1)(
        Effect.map(currentSnapshotEntry(s), (entry) => ({ entry, cursor: s.snapshotCursor }))
      ))
      if (Either.isLeft(chosen)) {
        // The client must hear that its state is gone: it attaches again.
        yield* Effect.logWarning(`resync of ${s.meta.activeSessionId} failed: ${chosen.left.message}`)
        a.outbox.offer(Protocol.encode({
          type: "session_snapshot_failed",
          activeSessionId: s.meta.activeSessionId,
          snapshotId: s.snapshotId ?? snapshotIdOf(s, s.generation),
          error: { code: "internal", message: chosen.left.message }
        }))
        return false
      }
      if (!(yield* streamSnapshot(a, chosen.right.entry, "resync"))) return false
      a.delivered = chosen.right.cursor
      a.resumed = true
      return true
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
        const pruned = yield* log.read(id, a.delivered).pipe(
          Stream.takeWhile((r) => !Cursor.isAfter(r.cursor, target)),
          Stream.runForEach((r) =>
            Effect.gen(function*() {
              if (a.detached) return yield* Effect.interrupt
              if (a.outbox.queuedBytes >= a.limit) {
                yield* a.outbox.awaitBelow(a.limit)
                // Detached while it waited: its detach is answered, nothing may follow.
                if (a.detached) return yield* Effect.interrupt
              }
              const replayed = a.resumed || (a.attachCursor !== undefined && !Cursor.isAfter(r.cursor, a.attachCursor))
              a.outbox.offer(wireLineOfRecord(sessionJson, r, replayed))
              a.delivered = r.cursor
            })
          ),
          Effect.as(false),
          Effect.catchAll((e) => Effect.succeed(e.reason === "GenerationNotFound")),
          Effect.catchAllCause((cause) => Effect.as(Effect.logDebug("catch-up stopped", cause), false))
        )
        // The events after what the client has were pruned while it was paused: it gets the
        // current generation's snapshot (a resync), then that generation's events.
        if (pruned && !(yield* resync(a))) return detachAttachment(a)
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

  // A baseline (snapshot, its messages, its generation's events) is read under the session's
  // read gate, which a checkpoint's completion takes whole: a baseline never mixes generations.
  const attach = (connectionId: string, outbox: ConnectionPort, cmd: CommandOf<"attach">) =>
    Effect.flatMap(get(cmd.activeSessionId), (s) => s.readGate.withPermits(1)(Effect.gen(function*() {
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
    })))

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
        // Detached while it waited: its detach is answered, nothing may follow.
        if (a.detached || a.outbox.isClosed) return false
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

  const newSession = (meta: SessionMeta, phase: Phase): Effect.Effect<Session> =>
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
        attachments: new Set(),
        publishLock: yield* Effect.makeSemaphore(1),
        readGate: yield* Effect.makeSemaphore(READ_GATE_PERMITS),
        lastUsed: Date.now(),
        launchEnv: undefined,
        clientEnv: undefined,
        snapshotId: undefined,
        closed: false,
        phase,
        epoch: 0,
        mailbox: yield* Queue.unbounded<Input>(),
        pendingPrompt: undefined,
        cutTurn: undefined,
        checkpointWaiters: [],
        checkpointDue: false,
        passivationWanted: false,
        retryWaiters: [],
        restarts: 0,
        restartState: restarts.initial
      }
    })

  /** Registers a session and starts its entity. */
  const register = (s: Session) =>
    Effect.gen(function*() {
      sessions.set(s.meta.activeSessionId, s)
      yield* FiberMap.run(entities, s.meta.activeSessionId, runEntity(s))
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
      const s = yield* newSession(meta, { _tag: "Starting", worker: undefined, state: "starting", epoch: 0 })
      s.launchEnv = cmd.launchEnv === undefined ? undefined : { ...cmd.launchEnv }
      s.clientEnv = filterEnv(cmd.env)
      yield* record(s, false, "created")
      // The first worker starts before the entity takes any input (nothing can race it yet).
      yield* startWorker(s, "starting", false)
      yield* register(s)
      return { activeSessionId, state: summary(s) }
    })

  // ------------------------------------------------------------------------------------------
  // Start-up: load every session; restore those that were busy when the last daemon died.
  // ------------------------------------------------------------------------------------------

  const loadSession = (meta: SessionMeta) =>
    Effect.gen(function*() {
      const id = meta.activeSessionId
      const s = yield* newSession(meta, { _tag: "Passivated" })
      let status = yield* log.status(id)
      const snapshot = yield* store.latestSnapshot(id)
      if (Option.isSome(snapshot) && snapshot.value.header.generation > status.generation) {
        // The daemon died between writing a checkpoint's transcript and starting its generation:
        // the transcript is complete and durable, so finish that checkpoint.
        // (The loop once tested a status read before it, so it never ended: the daemon never
        // listened, and started generations by the thousand.)
        let generation = status.generation
        while (generation < snapshot.value.header.generation) generation = yield* log.startGeneration(id)
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
      let lastStatusBusy = false
      s.snapshotCursor = isCurrent ? after : undefined
      s.baseMessageCount = s.messageCount
      yield* log.read(id, after).pipe(
        Stream.runForEach((r) =>
          Effect.sync(() => {
            const body = r.event as unknown as LoggedBody
            if (body.type === "session_event" && body.event.type === "message_end") s.messageCount++
            if (body.type === "session_status") lastStatusBusy = body.state.busy
            // Without a transcript of the current generation, its snapshot is what was folded
            // before its first event.
            if (!isCurrent && r.cursor.generation < status.generation) {
              s.snapshotCursor = r.cursor
              s.baseMessageCount = s.messageCount
            }
          })
        )
      )
      return { session: s, lastStatusBusy }
    })

  const metas = yield* store.list().pipe(Effect.orDie)
  const latest = yield* journal.latest()
  for (const meta of metas) {
    const loaded = yield* Effect.either(loadSession(meta))
    if (Either.isLeft(loaded)) {
      yield* Effect.logError(`cannot load session ${meta.activeSessionId}: ${String(loaded.left)}`)
      continue
    }
    const { session: s, lastStatusBusy } = loaded.right
    // It was running a turn when the daemon died: restored now, and the cut turn reported.
    if (latest.get(meta.activeSessionId)?.busy === true) {
      s.cutTurn = "daemon_restarted"
      yield* post(s, { _tag: "Restore" })
    } else if (lastStatusBusy) {
      // The daemon died between a turn's end and its idle status: the status is owed.
      yield* Effect.catchAllCause(publishStatus(s), (cause) => Effect.logError(`session ${meta.activeSessionId}: idle status`, cause))
    }
    yield* register(s)
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
          return { pid: w.pid, activeSessionId: w.activeSessionId!, state: s === undefined ? "closed" : summary(s).worker, restarts: s?.restarts ?? 0 }
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
    prompt: (cmd) =>
      Effect.flatMap(get(cmd.activeSessionId), (s) =>
        send<{ accepted: true }>(s, (reply) => ({ _tag: "Prompt", message: cmd.message, reply }))),
    abort: (cmd) =>
      Effect.flatMap(get(cmd.activeSessionId), (s) =>
        send<{ aborted: boolean }>(s, (reply) => ({ _tag: "Abort", reply }))),
    getState: (id) => Effect.map(get(id), summary),
    getMessages: (cmd) =>
      Effect.gen(function*() {
        const s = yield* get(cmd.activeSessionId)
        return yield* s.readGate.withPermits(1)(Effect.gen(function*() {
          const total = s.messageCount
          const messages = yield* transcript(s).pipe(
            Stream.drop(cmd.offset ?? 0),
            Stream.take(cmd.limit ?? 100),
            Stream.runCollect
          )
          return { messages: Chunk.toReadonlyArray(messages), total }
        }))
      }),
    checkpoint: (id) =>
      Effect.flatMap(get(id), (s) =>
        send<{ generation: number; snapshotId: string }>(s, (reply) => ({ _tag: "Checkpoint", reply }))),
    retryWorker: (id) =>
      Effect.flatMap(get(id), (s) => send<SessionSummary>(s, (reply) => ({ _tag: "Retry", reply }))),
    kill: (id) => Effect.flatMap(get(id), (s) => send<{}>(s, (reply) => ({ _tag: "Kill", reply })))
  })
})

/** The session manager over its storage, worker pool and configuration. */
export const layer: Layer.Layer<
  SessionManager,
  never,
  DaemonConfig | Engine | SupervisorInfo | EventLog | SessionStore | RecoveryJournal | SnapshotCache | WorkerPool
> = Layer.scoped(SessionManager, make)
