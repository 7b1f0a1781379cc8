/**
 * One session's entity (DESIGN: "the session core"): the interpreter of `step` (transition.ts).
 * A single fiber per session takes every input from one mailbox (commands with their Deferreds,
 * the worker's frames and exit, timers), names its requests and workers by id, calls `step`
 * with the world as it stands (`Env`), keeps the state it returns and performs its actions in
 * order; what an action comes back with (a worker acquired, a turn refused, storage failing)
 * returns to `step` as an input.
 *
 * Owns: the session's `state` (its only writer), the tables of handles behind its ids, the
 * effect of each action, and the session's other fields that change after its start (`meta` by
 * a rename, the next worker's environment, `lastUsed`); see session.ts for the fields whose
 * owners act within its steps. The lifecycle's rules are `step`'s alone.
 */
import * as Clock from "effect/Clock"
import * as Deferred from "effect/Deferred"
import * as Duration from "effect/Duration"
import * as Effect from "effect/Effect"
import * as Either from "effect/Either"
import * as Exit from "effect/Exit"
import * as FiberId from "effect/FiberId"
import * as FiberRef from "effect/FiberRef"
import * as Scope from "effect/Scope"
import * as Stream from "effect/Stream"
import type * as Tracer from "effect/Tracer"
import { randomUUID } from "node:crypto"
import * as Cursor from "../../Cursor.js"
import type * as Protocol from "../../Protocol.js"
import * as StateLayout from "../../StateLayout.js"
import type { WorkerHandle } from "../../WorkerPool.js"
import * as WorkerProtocol from "../../WorkerProtocol.js"
import type { Delivery } from "../delivery/attach.js"
import type { Attachment } from "../delivery/attachment.js"
import { realFramesArrived } from "../delivery/warmUp.js"
import { eventMessage, type Outgoing, wireLineOfRecord } from "../delivery/wireLines.js"
import type { Checkpoints } from "./checkpoint.js"
import type { AnyFrame, CheckpointReply, CommandProgress, Input } from "./mailbox.js"
import { CommandTakesEffect, progressDone } from "./mailbox.js"
import { type CoreError, CoreInternal, failed, internal, metaWriteFailed, notFound, SessionBusy, shuttingDown, StorageUnavailable } from "./errors.js"
import type { Names } from "./names.js"
import { type Core, isClosed, PUBLISH_BATCH_BYTES, rememberPrompt, type Session, StorageFailed, storageUnavailable } from "./session.js"
import { STORAGE_RETRY_INTERVAL, type Supervisor } from "./supervisor.js"
import * as T from "./transition.js"

/** How long the workers have to cut their running turns at a graceful stop, before the supervisor does. */
const SHUTDOWN_CUT_GRACE = "2 seconds"

/** A worker's event that ends its turn (`TurnEnded`), never one of a batch's pass-through events. */
const endsTurn = (eventType: string) => eventType === "agent_end" || eventType === "turn_interrupted"

/** A tool step: its batch is logged with it, then the journal records the step. */
const isToolStep = (eventType: string) => eventType === "tool_execution_start" || eventType === "tool_execution_end"

/** The session entity: one fiber per session takes every input from its mailbox, one at a time. */
export const makeEntity = (core: Core, checkpoints: Checkpoints, supervisor: Supervisor, delivery: Delivery, names: Names) => {
  const { config, journal, log, pool, restartPolicy, sessions, slots, store, publish, publishAll, publishNow, publishStatus, record, recordBestEffort, summary, fork, forkIn, post } = core
  const { abandonRewrite, rewriteFrame, runCheckpoint } = checkpoints
  const { detachAttachment } = delivery

  /** Set once the daemon stops: commands are refused from then on (see {@link settleForShutdown}). */
  let stopping = false
  /** The last storage failure each session met (the message a prompt refused for it gets). */
  const storageErrors = new WeakMap<Session, string>()

  /**
   * Hands a command to the session's entity. Checked and offered in one synchronous step: once
   * the entity has closed the session nothing more is offered, so nothing waits forever.
   */
  const send = <A>(
    s: Session,
    make: (command: { readonly reply: Deferred.Deferred<A, CoreError>; readonly progress: CommandProgress | undefined }) => Input
  ) =>
    Effect.gen(function*() {
      const reply = yield* Deferred.make<A, CoreError>()
      const progress = yield* FiberRef.get(CommandTakesEffect)
      if (stopping) return yield* Effect.fail(shuttingDown())
      if (isClosed(s)) return yield* Effect.fail(notFound(s.meta.activeSessionId))
      s.mailbox.unsafeOffer(make({ reply, progress }))
      return yield* Deferred.await(reply)
    })

  // ---------------------------------------------------------------------------------------------
  // The tables behind the ids
  // ---------------------------------------------------------------------------------------------

  const request = <A, E>(s: Session, reply: Deferred.Deferred<A, E>): T.ReqId => {
    const id = ++s.handles.nextId
    s.handles.requests.set(id, reply as Deferred.Deferred<any, any>)
    return id
  }

  const takeRequest = (s: Session, id: T.ReqId) => {
    const reply = s.handles.requests.get(id)
    s.handles.requests.delete(id)
    return reply
  }

  const registerWorker = (s: Session, worker: WorkerHandle): T.WorkerId => {
    const known = s.handles.workerIds.get(worker)
    if (known !== undefined) return known
    const id = ++s.handles.nextId
    s.handles.workers.set(id, worker)
    s.handles.workerIds.set(worker, id)
    return id
  }

  const forgetWorker = (s: Session, id: T.WorkerId) => {
    const worker = s.handles.workers.get(id)
    s.handles.workers.delete(id)
    if (worker !== undefined) s.handles.workerIds.delete(worker)
  }

  /** An id no worker has: inputs of a worker the session no longer knows are stale. */
  const UNKNOWN: T.WorkerId = -1

  const envOf = (s: Session) =>
    Effect.map(Clock.currentTimeMillis, (now): T.Env => ({
      now,
      slotsWanted: !stopping && slots.wanted() > 0,
      generationFull: s.generationEvents >= config.checkpointEvents || s.generationBytes >= config.checkpointBytes,
      // A stalled session tries its owed end at every retry: a write that fails is the answer.
      storageOk: true
    }))

  // ---------------------------------------------------------------------------------------------
  // The interpreter
  // ---------------------------------------------------------------------------------------------

  /**
   * One input through `step`: the new state, then its actions. A transition that begins by
   * publishing a turn's end depends on it: should storage refuse it, the transition did not
   * happen (the end is still owed) and `StorageFailed` is taken instead.
   */
  const run = (s: Session, input: T.Input, frame?: FrameContext, stepped?: Deferred.Deferred<void>): Effect.Effect<void> =>
    Effect.gen(function*() {
      const t = T.step(s.state, input, yield* envOf(s), restartPolicy)
      const first = t.actions[0]
      if (first !== undefined && (first._tag === "PublishInterrupt" || (first._tag === "PublishEvents" && first.end !== undefined))) {
        const end = yield* Effect.either(act(s, first, frame))
        if (Either.isLeft(end)) return yield* storageFailed(s, end.left)
        s.state = t.state
        return yield* perform(s, t.actions.slice(1), frame)
      }
      s.state = t.state
      // A command has taken effect once stepped: its writes follow (see `CommandProgress`).
      if (stepped !== undefined) Deferred.unsafeDone(stepped, Exit.void)
      return yield* perform(s, t.actions, frame)
    })

  const storageFailed = (s: Session, e: StorageFailed) =>
    Effect.gen(function*() {
      storageErrors.set(s, e.message)
      yield* Effect.logError(`session ${s.meta.activeSessionId}: storage failed: ${e.message}`)
      if (!isClosed(s)) yield* run(s, { _tag: "StorageFailed" })
    })

  /**
   * Performs actions in order. A write that storage refuses fails what depended on it; the
   * publishes after it are skipped (the stream would have a hole), the rest is done (requests
   * are answered, workers stopped), and `StorageFailed` is the next input.
   */
  const perform = (s: Session, actions: ReadonlyArray<T.Action>, frame?: FrameContext): Effect.Effect<void> =>
    Effect.gen(function*() {
      let failure: StorageFailed | undefined
      for (const action of actions) {
        if (failure !== undefined && writes(action)) continue
        const outcome = yield* Effect.either(act(s, action, frame))
        if (Either.isLeft(outcome)) failure = outcome.left
      }
      if (failure !== undefined) yield* storageFailed(s, failure)
    })

  const writes = (a: T.Action) =>
    a._tag === "PublishStatus" || a._tag === "PublishEvents" || a._tag === "PublishInterrupt" || a._tag === "Journal"

  const interrupted = (reason: Protocol.InterruptReason): Protocol.AgentEvent =>
    ({ type: "turn_interrupted", reason }) as Protocol.AgentEvent

  const act = (s: Session, a: T.Action, frame: FrameContext | undefined): Effect.Effect<void, StorageFailed> => {
    const id = s.meta.activeSessionId
    switch (a._tag) {
      case "PublishStatus":
        return publishStatus(s, { busy: a.busy, worker: a.worker })
      case "PublishEvents":
        return frame === undefined ? Effect.void : frame.add(a.end !== undefined)
      case "PublishInterrupt":
        return publish(s, { type: "session_event", event: interrupted(a.reason) })
      case "PublishClosed":
        return Effect.gen(function*() {
          const before = s.lastCursor
          const closed = yield* Effect.either(publish(s, { type: "session_closed", reason: "killed" }))
          // Attachments that publish did not hand the line to: catching up from the log (an
          // attach just before the kill) or paused (a client over its limit).
          const behind = [...s.attachments].filter((a) => a.mode !== "live")
          for (const attachment of [...s.attachments]) detachAttachment(attachment)
          if (Either.isRight(closed) && behind.length > 0) yield* closedToBehind(s, before, behind)
        })
      case "Journal":
        return a.required ? Effect.asVoid(record(s, a.busy, a.op)) : recordBestEffort(s, a.busy, a.op)
      case "SendAbort": {
        const worker = s.handles.workers.get(a.worker)
        if (worker === undefined) return Effect.void
        const turnId = s.handles.turnId
        return worker.send(a.reason === "aborted" ? { type: "abort", turnId } : { type: "abort", turnId, reason: a.reason })
      }
      case "StartTurn":
        return startTurn(s, a)
      case "StartWorker":
        return supervisor.startWorker(s, a.epoch, a.restore, a.interruptedReason)
      case "Pump": {
        const worker = s.handles.workers.get(a.worker)
        return worker === undefined ? Effect.void : forkIn(s, supervisor.pump(s, worker))
      }
      case "StopWorker": {
        const worker = s.handles.workers.get(a.worker)
        // Its exit, if pumped, is no input of this session's any more.
        forgetWorker(s, a.worker)
        if (worker === undefined) return Effect.void
        // A killed session's worker is gone before `kill` is answered.
        return isClosed(s) ? Effect.asVoid(worker.stop()) : fork(worker.stop())
      }
      case "KillWorker":
        return Effect.sync(() => s.handles.workers.get(a.worker)?.kill())
      case "SlotLeaving": {
        const worker = s.handles.workers.get(a.worker)
        return Effect.sync(() => {
          if (worker !== undefined) slots.leaving(worker)
        })
      }
      case "Settle":
        return settle(s, a.req, a.result)
      case "RunCheckpoint": {
        const waiters: Array<CheckpointReply> = []
        for (const r of a.waiters) {
          const reply = takeRequest(s, r)
          if (reply !== undefined) waiters.push(reply)
        }
        return runCheckpoint(s, waiters)
      }
      case "CheckpointIfGrown":
        // What the generation added is written first: a restore then reads it from the transcript.
        return s.generationEvents > 0 ? runCheckpoint(s, []) : Effect.void
      case "RewriteFrame": {
        const worker = workerHandleOfState(s)
        return frame === undefined || worker === undefined ? Effect.void : rewriteFrame(s, worker, frame.raw)
      }
      case "AbandonRewrite":
        return abandonRewrite(s, "the turn that streamed it ended without it")
      case "ScheduleRestart":
        return forkIn(s, Effect.zipRight(Effect.sleep(Duration.millis(a.delayMs)), post(s, { _tag: "RestartDue", epoch: a.epoch })))
      case "ScheduleStorageRetry":
        return forkIn(s, Effect.zipRight(Effect.sleep(STORAGE_RETRY_INTERVAL), post(s, { _tag: "StorageRetry", epoch: a.epoch })))
      case "CloseScope":
        // Its pump and timers end; a worker still being acquired is waited for and stopped.
        return Scope.close(s.scope, Exit.void)
      case "Archive":
        return archive(s, a.req)
      case "ShutdownDone": {
        const done = takeRequest(s, a.done)
        return done === undefined ? Effect.void : Effect.asVoid(Deferred.succeed(done, undefined))
      }
      case "Rename":
        return rename(s, a.req, a.name)
    }
  }

  /**
   * `rename`: the name is claimed and shown in one synchronous step (no racing create or rename
   * sees it free meanwhile), then saved; a save that fails gives it back. The old name stays
   * held until then, so no other session takes a name this one may have to take back.
   * No `session_status`: a name is no lifecycle fact (the next summary carries it).
   */
  const rename = (s: Session, req: T.ReqId, name: string): Effect.Effect<void> =>
    Effect.gen(function*() {
      const reply = takeRequest(s, req)
      if (reply === undefined) return
      const previous = s.meta
      const id = previous.activeSessionId
      if (previous.name === name) return yield* Deferred.succeed(reply, summary(s))
      const claimed = names.claim(name, id, id)
      if (typeof claimed !== "function") return yield* Deferred.fail(reply, claimed)
      const releaseOld = previous.name === undefined ? undefined : names.hold(previous.name, id)
      s.meta = { ...previous, name }
      // Once in the meta, the new name is held by the session itself.
      claimed()
      const saved = yield* Effect.either(store.saveMeta(s.meta))
      releaseOld?.()
      if (Either.isLeft(saved)) {
        s.meta = previous
        return yield* Deferred.fail(reply, metaWriteFailed(saved.left))
      }
      yield* Deferred.succeed(reply, summary(s))
    })

  /**
   * `session_closed` for attachments that were not live when it was logged: their catch-up
   * (stopped by the detach, so nothing more comes from it) would have read it from the log, but
   * the log moves to the archive next. Sent after what they were sent, whatever they had not
   * caught up on yet (nothing of the session can be read any more). Without it such a client
   * waited forever, told nothing.
   */
  const closedToBehind = (s: Session, before: Cursor.Cursor | undefined, behind: ReadonlyArray<Attachment>) =>
    Effect.gen(function*() {
      const id = s.meta.activeSessionId
      const records = yield* Effect.either(Stream.runCollect(log.read(id, before)))
      if (Either.isLeft(records)) return yield* Effect.logWarning(`session ${id}: session_closed not read back: ${records.left.message}`)
      let last = undefined as Parameters<typeof wireLineOfRecord>[1] | undefined
      for (const r of records.right) last = r
      if (last === undefined) return
      const line = wireLineOfRecord(JSON.stringify(id), last, false)
      for (const a of behind) {
        if (a.outbox.isClosed || (a.delivered !== undefined && !Cursor.isBefore(a.delivered, last.cursor))) continue
        // Not before its attach's `session_attached` (which its delivery then follows with it).
        if (a.streaming) a.outbox.offer(line)
        else a.closedLine = line
      }
    })

  const workerHandleOfState = (s: Session) => {
    const w = T.workerOf(s.state)
    return w === undefined ? undefined : s.handles.workers.get(w)
  }

  /** A request's answer, in the wire's terms (the error's code is chosen at the server edge). */
  const settle = (s: Session, req: T.ReqId, result: T.Settlement): Effect.Effect<void> => {
    const reply = takeRequest(s, req)
    if (reply === undefined) return Effect.void
    const id = s.meta.activeSessionId
    if (result._tag === "Ok") {
      switch (result.value) {
        case "accepted":
          return Effect.asVoid(Deferred.succeed(reply, { accepted: true }))
        case "aborted":
        case "not_aborted":
          return Effect.asVoid(Deferred.succeed(reply, { aborted: result.value === "aborted" }))
        case "summary":
          return Effect.asVoid(Deferred.succeed(reply, summary(s)))
      }
    }
    let error: CoreError
    switch (result.error) {
      case "SessionNotFound":
        error = notFound(id)
        break
      case "SessionBusy":
        error = new SessionBusy({ activeSessionId: id, message: `Session \`${id}\` is running a turn.` })
        break
      case "SessionFailed": {
        // Why it failed, as long as the state remembers: the crashes that exhausted the schedule.
        const crashes = s.state._tag === "Failed" ? s.state.crashes.length : 0
        error = failed(
          crashes > 0
            ? `Session \`${id}\` has failed: its worker crashed ${crashes} times within ${restartPolicy.restartWindowMs} ms; use retry_worker.`
            : `Session \`${id}\` has failed; use retry_worker.`
        )
        break
      }
      case "StorageUnavailable":
        error = new StorageUnavailable({
          message: result.detail === "stalled"
            ? `Session \`${id}\` cannot take a prompt: storage failed and the end of its last turn is not logged yet.`
            : `Session \`${id}\` cannot take a prompt: ${storageErrors.get(s) ?? "storage failed"}`
        })
        break
      case "ShuttingDown":
        error = shuttingDown()
        break
    }
    return Effect.asVoid(Deferred.fail(reply, error))
  }

  /**
   * Starts the turn of a reserved prompt: accepted only once durable (the journal says busy, so a
   * crash from here is a cut turn it finds, and the log holds the busy status); else refused,
   * nothing of it remains, and `TurnRefused` goes back to `step`.
   */
  const startTurn = (s: Session, a: Extract<T.Action, { _tag: "StartTurn" }>) =>
    Effect.gen(function*() {
      const reply = takeRequest(s, a.prompt.req)
      const worker = s.handles.workers.get(a.worker)
      const turnId = `t-${randomUUID()}`
      s.handles.turnId = turnId
      s.lastUsed = Date.now()
      const promptId = a.prompt.promptId
      const durable = yield* Effect.either(Effect.zipRight(record(s, true, "prompt"), publishStatus(s, { busy: true, worker: "ready" }, promptId)))
      if (Either.isLeft(durable)) {
        yield* Effect.logError(`session ${s.meta.activeSessionId}: prompt refused: ${durable.left.message}`)
        if (reply !== undefined) yield* Deferred.fail(reply, storageUnavailable(s.meta.activeSessionId, durable.left))
        return yield* run(s, { _tag: "TurnRefused", turn: a.turn, shownBusy: s.shown.busy })
      }
      // Durable now: the same prompt sent again (to this runner or, through the log, another) starts no turn.
      if (promptId !== undefined) rememberPrompt(s.startedPrompts, promptId)
      // The pool's next spare does not boot beside the turn's start (a new session's first turn
      // follows its taking the spare at once).
      if (pool.deferSpare !== undefined) yield* pool.deferSpare
      if (worker !== undefined) yield* worker.send({ type: "prompt", turnId, message: a.prompt.message })
      if (reply !== undefined) yield* Deferred.succeed(reply, { accepted: true as const })
    })

  /** `kill`'s last step: what was queued is answered, the files move to the archive, then the answer. */
  const archive = (s: Session, req: T.ReqId) =>
    Effect.gen(function*() {
      const id = s.meta.activeSessionId
      // Inputs queued before the kill are answered now, before the kill's own answer: a worker
      // handed over just before it (an `Acquired` not taken in yet) is stopped by then, not
      // after `kill` answered (it ran on beside the next spare, past --max-workers).
      for (const input of s.mailbox.takeAll()) yield* take(s, input)
      const archived = yield* Effect.either(Effect.gen(function*() {
        yield* recordBestEffort(s, false, "closed")
        yield* Effect.ignoreLogged(journal.forget(id))
        const dir = yield* store.archive(id).pipe(Effect.mapError(internal("session store")))
        yield* log.remove(id, { archiveTo: StateLayout.archivedEventsDir(dir) }).pipe(Effect.mapError(internal("event log")))
      }))
      yield* checkpoints.disposeSnapshotEntry(s)
      sessions.delete(id)
      const reply = takeRequest(s, req)
      if (reply === undefined) return
      if (Either.isLeft(archived)) yield* Deferred.fail(reply, archived.left)
      else yield* Deferred.succeed(reply, {})
    })

  // ---------------------------------------------------------------------------------------------
  // The worker's frames
  // ---------------------------------------------------------------------------------------------

  /** The frame being taken, for the actions that publish or store it. */
  interface FrameContext {
    readonly raw: AnyFrame
    /** Publishes the frame's event now (with the batch before it). */
    readonly add: (flush: boolean) => Effect.Effect<void, StorageFailed>
  }

  /**
   * The worker's frames, in order, each an input of `step`. Consecutive events are logged
   * together, in batches of about PUBLISH_BATCH_BYTES (a slow client is checked against its
   * limit between batches). The hot path, an event that changes nothing, allocates no state.
   */
  const onFrames = (s: Session, handle: WorkerHandle, frames: ReadonlyArray<WorkerProtocol.ReceivedFrame>) =>
    Effect.gen(function*() {
      const worker = s.handles.workerIds.get(handle) ?? UNKNOWN
      let events: Array<Outgoing> = []
      let batchBytes = 0
      const flush = Effect.suspend(() => {
        if (events.length === 0) return Effect.void
        const batch = events
        events = []
        batchBytes = 0
        return publishAll(s, batch)
      })
      /** Flushes the batch; storage refusing it is the next input. */
      const flushed = Effect.catchTag(flush, "StorageFailed", (e) => storageFailed(s, e))
      /** A frame's event published now, with the batch before it. */
      const eventNow = (raw: AnyFrame, eventType: string, eventBytes: Uint8Array): FrameContext => ({
        raw,
        add: () =>
          Effect.suspend(() => {
            events.push(eventMessage(eventType, eventBytes))
            return flush
          })
      })
      const eventsInput: T.Input = { _tag: "Events", worker }
      const env = yield* envOf(s)
      // Indexed: a for-of in a generator made an iterator result per frame.
      for (let i = 0; i < frames.length; i++) {
        const raw = frames[i]!
        const frame = raw as AnyFrame
        if (frame.type === "worker_event") {
          const { eventBytes, eventType } = raw as WorkerProtocol.EventFrame
          if (!endsTurn(eventType)) {
            const t = T.step(s.state, eventsInput, env, restartPolicy)
            if (t.actions === HOT) {
              // The hot path: the event joins the batch, nothing else is made.
              events.push(eventMessage(eventType, eventBytes))
              batchBytes += eventBytes.length
              if (batchBytes >= PUBLISH_BATCH_BYTES) yield* flushed
              if (isToolStep(eventType)) {
                yield* flushed
                // The journal said busy when the turn began: a restart cuts it either way.
                yield* recordBestEffort(s, true, eventType === "tool_execution_start" ? "tool_start" : "tool_end")
              }
            } else {
              // A stale worker's event (no actions), or one that changes the state (a passivation
              // waits for it): it is logged before what follows.
              s.state = t.state
              yield* perform(s, t.actions, eventNow(frame, eventType, eventBytes))
            }
            continue
          }
          const how: T.TurnEnd = eventType === "agent_end"
            ? "agent_end"
            : (JSON.parse(WorkerProtocol.eventTextOf(raw as WorkerProtocol.EventFrame)) as Extract<Protocol.AgentEvent, { type: "turn_interrupted" }>).reason
          yield* run(s, { _tag: "TurnEnded", worker, how }, eventNow(frame, eventType, eventBytes))
          yield* flushed
          continue
        }
        yield* flushed
        switch (frame.type) {
          case "worker_ready":
            yield* run(s, { _tag: "Ready", worker })
            break
          case "worker_error":
            yield* Effect.logWarning(`worker of ${s.meta.activeSessionId}: ${String(frame["message"])}`)
            yield* run(s, { _tag: "WorkerError", worker })
            break
          case "session_snapshot_begin":
            yield* run(s, { _tag: "Rewrite", worker, part: "begin" }, noEvents(frame))
            break
          case "session_snapshot_chunk": {
            // A chunk changes no lifecycle fact: stored if the rewrite it belongs to is under way.
            const st = s.state
            if (st._tag === "Running" && st.rewrite && st.worker === worker) yield* rewriteFrame(s, handle, frame)
            break
          }
          case "session_snapshot_end":
            yield* run(s, { _tag: "Rewrite", worker, part: "end" }, noEvents(frame))
            break
          case "session_snapshot_failed":
            yield* run(s, { _tag: "Rewrite", worker, part: "failed" }, noEvents(frame))
            break
          default:
            yield* Effect.logWarning(`worker of ${s.meta.activeSessionId}: unknown frame ${frame.type}`)
        }
      }
      yield* flushed
    })

  const noEvents = (raw: AnyFrame): FrameContext => ({ raw, add: () => Effect.void })

  /**
   * The frames' events as one batch, when every frame is an event that `step` passes through
   * (the hot path of `onFrames`: no state changes, nothing else to do) and the batch is under
   * PUBLISH_BATCH_BYTES; undefined otherwise (then `onFrames` takes them). Decides only:
   * the state is the same after it.
   */
  const hotBatch = (s: Session, worker: T.WorkerId, frames: ReadonlyArray<WorkerProtocol.ReceivedFrame>): Array<Outgoing> | undefined => {
    // An event's step reads `slotsWanted` only (a step that reads more is not hot).
    const env: T.Env = { now: 0, slotsWanted: !stopping && slots.wanted() > 0, generationFull: false, storageOk: true }
    const input: T.Input = { _tag: "Events", worker }
    const events: Array<Outgoing> = []
    let bytes = 0
    for (let i = 0; i < frames.length; i++) {
      const frame = frames[i] as AnyFrame
      if (frame.type !== "worker_event") return undefined
      const { eventBytes, eventType } = frames[i] as WorkerProtocol.EventFrame
      if (endsTurn(eventType) || isToolStep(eventType)) return undefined
      if (T.step(s.state, input, env, restartPolicy).actions !== HOT) return undefined
      bytes += eventBytes.length
      if (bytes >= PUBLISH_BATCH_BYTES) return undefined
      events.push(eventMessage(eventType, eventBytes))
    }
    return events.length > 0 ? events : undefined
  }

  /**
   * A `Frames` input. When its events are all hot (`hotBatch`) and the session can publish
   * outside a fiber (`publishNow`), they are published as the mailbox's bypass would
   * (`publishBeside`) and the entity's one step is the wait for them to be logged and delivered
   * (`besideDone`); otherwise `onFrames`. Either way the pump hears once the frames are handled.
   */
  const takeFrames = (s: Session, input: Extract<Input, { readonly _tag: "Frames" }>): Effect.Effect<void> =>
    Effect.withFiberRuntime((fiber) =>
      publishBeside(s, input, fiber.currentTracer)
        ? besideDone(s)
        : Effect.ensuring(onFrames(s, input.worker, input.frames), Effect.sync(input.handled))
    )

  /** What `step` returns for an event of the current worker that changes nothing. */
  const HOT = T.EVENTS

  /**
   * A batch published beside the entity (`publishBeside`) and not yet taken by it: `outcome` is
   * set once its publish failed (a success removes it); `waiter` is the entity waiting for it.
   */
  interface Beside {
    outcome: { readonly error: StorageFailed | undefined; readonly defect: unknown } | undefined
    waiter: (() => void) | undefined
  }
  /** The sessions with a batch published beside their entity (the entity's state, not the session's). */
  const beside = new WeakMap<Session, Beside>()

  /**
   * Publishes a hot `Frames` input (see `hotBatch`) outside the entity's fiber. Offered while
   * the entity waits in its mailbox with nothing queued (the mailbox's bypass), it is published
   * in the pump's callback and the entity is not woken: at a model's pace every event is such an
   * input, and waking the entity's fiber for it (its take, its wait for the publish) was most of
   * the Effect runtime's share of the daemon's CPU per event. As if the entity had taken it: the
   * entity takes nothing else until it is published (`besideDone`, before every input), and its
   * failure is its next input (`BesideFailed`, or taken by that wait), as is a throw of the
   * publish (a defect the entity reports). `takeFrames` publishes its hot takes the same way.
   * Declines (false) when it cannot.
   */
  const publishBeside = (s: Session, input: Extract<Input, { readonly _tag: "Frames" }>, tracer: Tracer.Tracer): boolean => {
    if (isClosed(s) || beside.has(s)) return false
    const batch = hotBatch(s, s.handles.workerIds.get(input.worker) ?? UNKNOWN, input.frames)
    if (batch === undefined) return false
    const entry: Beside = { outcome: undefined, waiter: undefined }
    const settle = (error: StorageFailed | undefined, defect?: unknown) => {
      if (error === undefined && defect === undefined) beside.delete(s)
      else entry.outcome = { error, defect }
      const waiter = entry.waiter
      entry.waiter = undefined
      if (waiter !== undefined) waiter()
      else if (entry.outcome !== undefined && !isClosed(s)) s.mailbox.unsafeOffer({ _tag: "BesideFailed" })
      input.handled()
    }
    /** Set once publishNow returned: an answer before that (a refusal) is taken after it. */
    let returned = false
    let now: boolean
    beside.set(s, entry)
    // Not inside the pump's offer, which would then post its next take re-entrantly.
    const settleLater = (error: StorageFailed | undefined, defect?: unknown) => process.nextTick(() => settle(error, defect))
    try {
      now = publishNow(s, batch, tracer, (error, defect) => returned ? settle(error, defect) : settleLater(error, defect))
    } catch (defect) {
      now = true
      settleLater(undefined, defect ?? new Error("publish threw"))
    }
    returned = true
    if (!now) beside.delete(s)
    return now
  }

  /**
   * Waits until the batch published beside the entity (if any) is published, then takes its
   * failure, if it failed: run before every input, so that none is taken before it.
   */
  const besideDone = (s: Session): Effect.Effect<void> =>
    Effect.suspend(() => {
      const entry = beside.get(s)
      if (entry === undefined) return Effect.void
      const takeOutcome = Effect.suspend(() => {
        if (beside.get(s) === entry) beside.delete(s)
        const outcome = entry.outcome
        if (outcome === undefined) return Effect.void
        if (outcome.defect !== undefined) return Effect.die(outcome.defect)
        return outcome.error === undefined ? Effect.void : storageFailed(s, outcome.error)
      })
      if (entry.outcome !== undefined) return takeOutcome
      return Effect.zipRight(
        Effect.async<void>((resume) => {
          entry.waiter = () => resume(Effect.void)
          return Effect.sync(() => {
            entry.waiter = undefined
          })
        }),
        takeOutcome
      )
    })

  // ---------------------------------------------------------------------------------------------
  // The mailbox's inputs
  // ---------------------------------------------------------------------------------------------

  /** One input of the mailbox, as `step` names it. */
  const take = (s: Session, input: Input): Effect.Effect<void> => {
    /** A command's `taken`, completed once `step` has taken it (see `run`). */
    const stepped = "progress" in input ? input.progress?.taken : undefined
    switch (input._tag) {
      case "Prompt":
        s.lastUsed = Date.now()
        return run(s, { _tag: "Prompt", req: request(s, input.reply), message: input.message, promptId: input.promptId }, undefined, stepped)
      case "Abort":
        return run(s, { _tag: "Abort", req: request(s, input.reply) }, undefined, stepped)
      case "Checkpoint":
        return run(s, { _tag: "Checkpoint", req: request(s, input.reply) }, undefined, stepped)
      case "Retry":
        return run(s, { _tag: "Retry", req: request(s, input.reply) }, undefined, stepped)
      case "Kill":
        return run(s, { _tag: "Kill", req: request(s, input.reply) }, undefined, stepped)
      case "Rename":
        return run(s, { _tag: "Rename", req: request(s, input.reply), name: input.name }, undefined, stepped)
      case "Passivate":
        return run(s, { _tag: "Passivate" })
      case "SetEnv":
        // The environment of the session's next worker: no lifecycle fact.
        return Effect.sync(() => {
          if (input.launchEnv !== undefined) s.launchEnv = input.launchEnv
          if (input.clientEnv !== undefined) s.clientEnv = input.clientEnv
        })
      case "ShuttingDown":
        return run(s, { _tag: "ShuttingDown", done: request(s, input.done), force: input.force === true })
      case "Restore":
        return run(s, { _tag: "Restore" })
      case "Acquired":
        return run(s, { _tag: "Acquired", epoch: input.epoch, worker: registerWorker(s, input.worker) })
      case "AcquireFailed":
        return Effect.zipRight(
          Effect.logError(`no worker for ${s.meta.activeSessionId}: ${input.message}`),
          run(s, { _tag: "AcquireFailed", epoch: input.epoch })
        )
      case "RestartDue":
        return run(s, { _tag: "RestartDue", epoch: input.epoch })
      case "StorageRetry":
        return run(s, { _tag: "StorageRetry", epoch: input.epoch })
      case "Frames":
        // The daemon's start-up warm-up of this path gives way to the real thing.
        realFramesArrived(s.meta.activeSessionId)
        return takeFrames(s, input)
      case "BesideFailed":
        // Its failure was taken before it (`besideDone`).
        return Effect.void
      case "Exited": {
        const worker = s.handles.workerIds.get(input.worker)
        if (worker === undefined) return Effect.void
        const asked = input.worker.stopping
        if (!asked && !stopping) {
          return Effect.zipRight(
            Effect.logWarning(`worker ${input.worker.pid} of ${s.meta.activeSessionId} exited (code ${input.exit.code}, signal ${input.exit.signal})`),
            Effect.ensuring(run(s, { _tag: "Exited", worker, asked }), Effect.sync(() => forgetWorker(s, worker)))
          )
        }
        return Effect.ensuring(run(s, { _tag: "Exited", worker, asked }), Effect.sync(() => forgetWorker(s, worker)))
      }
    }
  }

  /**
   * The daemon stops: refuses every later command (`shutting_down`) and has each session answer
   * the commands waiting in it the same way (a checkpoint or an abort waiting for a turn's end,
   * a prompt or a retry waiting for a worker), so that every command gets its one response
   * before the connections close. Bounded: an entity stuck in a long step is not waited for.
   */
  const settleForShutdown = Effect.suspend(() => {
    stopping = true
    const dones: Array<Deferred.Deferred<void>> = []
    const ask = (force: boolean) => {
      for (const s of sessions.values()) {
        if (isClosed(s) || (force && s.state._tag !== "Running")) continue
        const done = Deferred.unsafeMake<void>(FiberId.none)
        s.mailbox.unsafeOffer({ _tag: "ShuttingDown", done, force })
        dones.push(done)
      }
    }
    const all = Effect.suspend(() => Effect.forEach(dones, Deferred.await, { discard: true }))
    ask(false)
    // The workers cut their turns; a turn still running after their grace is cut by the
    // supervisor. Bounded as a whole: an entity stuck in a long step is not waited for.
    return all.pipe(
      Effect.timeout(SHUTDOWN_CUT_GRACE),
      Effect.catchTag("TimeoutException", () => Effect.zipRight(Effect.sync(() => ask(true)), all).pipe(Effect.timeout("3 seconds"))),
      Effect.ignore
    )
  })

  /** The answer of an input that could not be taken whole (a no-op for what is answered already). */
  const answerUntaken = (input: Input, message: string): Effect.Effect<void> => {
    if ("reply" in input) return Effect.asVoid(Deferred.fail(input.reply as Deferred.Deferred<unknown, CoreError>, new CoreInternal({ message })))
    if (input._tag === "ShuttingDown") return Effect.asVoid(Deferred.succeed(input.done, undefined))
    return Effect.void
  }
  /** An input whose step hit a defect. */
  const answerBroken = (input: Input) =>
    answerUntaken(input, `the session could not take \`${input._tag}\`: an internal error (see the daemon's log)`)
  /**
   * An input whose step was interrupted: the entity was stopped under it (a cluster runner
   * evicting the session, whose shard moved; a daemon's last moments). The eviction answers the requests it finds in the
   * session; one taken out of them by this step, not yet answered, is answered here.
   */
  const answerInterrupted = (s: Session, input: Input) =>
    answerUntaken(
      input,
      `Session \`${s.meta.activeSessionId}\` stopped while it took \`${input._tag}\` (it left this runner, or the daemon is stopping): send the command again.`
    )

  /** The entity: takes one input at a time until the session is closed. */
  const runEntity = (s: Session): Effect.Effect<void> =>
    Effect.gen(function*() {
      const tracer = yield* Effect.tracer
      s.mailbox.bypass = (input) => {
        if (input._tag !== "Frames" || !publishBeside(s, input, tracer)) return false
        // The daemon's start-up warm-up of this path gives way to the real thing (as in `take`).
        realFramesArrived(s.meta.activeSessionId)
        return true
      }
      while (!isClosed(s)) {
        const input = yield* s.mailbox.take
        yield* besideDone(s).pipe(
          Effect.catchAllDefect((defect) => Effect.logError(`session ${s.meta.activeSessionId}: a batch published beside the entity could not be taken`, defect))
        )
        // A defect here is a broken invariant of the interpreter: logged loudly, never control
        // flow; the command it carried is still answered (`internal`), so no caller waits forever.
        yield* take(s, input).pipe(
          Effect.catchAllDefect((defect) =>
            Effect.zipRight(
              Effect.logError(`session ${s.meta.activeSessionId}: an input could not be taken`, defect),
              answerBroken(input)
            )
          ),
          Effect.onInterrupt(() => answerInterrupted(s, input))
        )
        if ("progress" in input && input.progress !== undefined) yield* progressDone(input.progress)
      }
      // Closed: nothing more is offered; what was offered before is answered.
      for (const input of s.mailbox.takeAll()) yield* take(s, input)
    }).pipe(Effect.ensuring(Effect.sync(() => {
      s.mailbox.bypass = undefined
    })))

  /** Starts the first worker of a new session (its state is `initial`: that start is owed). */
  const startFirstWorker = (s: Session) => supervisor.startWorker(s, s.state.epoch, false, undefined)

  return { send, runEntity, settleForShutdown, startFirstWorker }
}
