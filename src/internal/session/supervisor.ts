/**
 * A session's worker, as its entity supervises it: the worker is acquired beside the entity
 * (which stays free to answer) and its outcome comes back through the mailbox; a pump hands the
 * worker's frames to the entity and reports its exit. An exit nobody asked for is a
 * {@link WorkerCrashed}: the restore effect starts a replacement on the restart schedule (the
 * first at once, later ones backed off on the Clock), or the session fails.
 */
import * as Deferred from "effect/Deferred"
import * as Duration from "effect/Duration"
import * as Effect from "effect/Effect"
import * as Scope from "effect/Scope"
import { randomUUID } from "node:crypto"
import type * as Protocol from "../../Protocol.js"
import type { WorkerState } from "../../Protocol.js"
import * as StateLayout from "../../StateLayout.js"
import { stepRestart, WorkerCrashed, type WorkerHandle } from "../../WorkerPool.js"
import type * as WorkerProtocol from "../../WorkerProtocol.js"
import { eventMessage, type Outgoing } from "../delivery/wireLines.js"
import { journalSaysBusy, sendRestore } from "./restore.js"
import type { Checkpoints } from "./checkpoint.js"
import type { AnyFrame, PendingPrompt, Phase, TurnEnd } from "./phase.js"
import { workerOf } from "./phase.js"
import { type CoreError, failed } from "./errors.js"
import { type Core, PUBLISH_BATCH_BYTES, type Session, type StorageFailed, storageUnavailable } from "./session.js"

/**
 * How often a session whose turn storage cut tries again to log that turn's end (a full disk
 * freed, file descriptors given back).
 */
export const STORAGE_RETRY_INTERVAL = "1500 millis"

/** The seam of the worker supervisor, as the session's entity drives it. */
export interface Supervisor {
  /** Starts a worker (acquired beside the entity; its outcome comes back through the mailbox). */
  readonly startWorker: (s: Session, worker: WorkerState & ("starting" | "recovering"), restoring: boolean) => Effect.Effect<void, StorageFailed>
  /** Pumps a worker's frames to the entity until the pipe closes, then reports the exit. */
  readonly pump: (s: Session, worker: WorkerHandle) => Effect.Effect<void>
  /** Starts the turn of the reserved prompt (the session is Idle). */
  readonly startTurn: (s: Session, worker: WorkerHandle, prompt: PendingPrompt) => Effect.Effect<void, StorageFailed>
  /** The worker exited without being asked to: restored on the schedule, or the session fails. */
  readonly onCrash: (s: Session, crash: WorkerCrashed) => Effect.Effect<void, StorageFailed>
  /** The worker's frames, in order. */
  readonly onFrames: (s: Session, frames: ReadonlyArray<WorkerProtocol.ReceivedFrame>) => Effect.Effect<void, StorageFailed>
  /** The session cannot run: `failed` until `retry_worker`. */
  readonly failSession: (s: Session, why: string) => Effect.Effect<void>
  /** Takes every request that waits for a worker; the effect answers them with `error`. */
  readonly answerWaiting: (s: Session, error: CoreError) => Effect.Effect<void>
  /** The daemon stops and the worker did not cut its turn: cut here. */
  readonly cutForShutdown: (s: Session, phase: Extract<Phase, { _tag: "Running" }>) => Effect.Effect<void, StorageFailed>
  /** The daemon stops while a cut turn waits for its end: said now. */
  readonly endCutTurnForShutdown: (s: Session) => Effect.Effect<void, StorageFailed>
  /** Storage failed under the session: it stalls, and retries. */
  readonly onStorageFailed: (s: Session, error: StorageFailed) => Effect.Effect<void>
  /** Tries again to end the turn that storage cut. */
  readonly retryStorage: (s: Session) => Effect.Effect<void, StorageFailed>
}

/** Worker supervision: start, frame pump, turns, crash -> restore on the restart schedule, failure. */
export const makeSupervisor = (core: Core, checkpoints: Checkpoints): Supervisor => {
  const { config, info, pool, restartPolicy, restarts, sessions, slots, fork, post, publish, publishAll, publishStatus, record, recordBestEffort, summary, workerEnv, forkIn } = core
  const { abandonRewrite, rewriteFrame } = checkpoints

  /**
   * Starts a worker for the session (a new session, a wake-up, a restore): the acquisition runs
   * beside the entity, which stays free to answer; its outcome comes back through the mailbox.
   */
  const startWorker = (s: Session, worker: WorkerState & ("starting" | "recovering"), restoring: boolean) =>
    Effect.gen(function*() {
      const epoch = ++s.epoch
      const before = summary(s).worker
      const starting = () => (s.phase = { _tag: "Starting", worker: undefined, state: worker, epoch })
      if (before !== worker) yield* publishStatus(s, starting)
      else starting()
      // The journal as it stands now (the entity is its only writer for this session): a turn
      // it says was running is reported cut by the restored worker.
      const restore = restoring
        ? {
          busy: yield* journalSaysBusy(core, s.meta.activeSessionId),
          ...(s.cutTurn?._tag === "InterruptOwed" ? { interruptedReason: s.cutTurn.reason } : {})
        }
        : undefined
      const load: WorkerProtocol.SupervisorFrame = {
        type: "load",
        activeSessionId: s.meta.activeSessionId,
        engine: s.meta.engine,
        workDir: StateLayout.sessionStorePaths(info.storeRoot).workDir(s.meta.activeSessionId),
        targetChunkBytes: config.targetChunkBytes,
        ...(s.meta.config === undefined ? {} : { config: s.meta.config as Record<string, unknown> }),
        ...(restore === undefined ? {} : { restore })
      }
      /**
       * A restoring worker is sent the session after its `load`, read here through the storage
       * layers (never by the worker), under a read permit so no checkpoint moves the generation
       * meanwhile. Beside the entity: it waits on the worker's pipe. A read that fails is told to
       * the worker, which reports it and is replaced like a worker that crashed.
       */
      const sendSession = (worker: WorkerHandle) =>
        s.readGate.withPermits(1)(sendRestore(core, s.meta.activeSessionId, worker)).pipe(
          Effect.catchAll((error) => Effect.logError(`session ${s.meta.activeSessionId}: restore read failed: ${error.message}`))
        )
      // A `kill` meanwhile interrupts the wait for a slot or the spawn (closing the session's
      // scope): the pool then stops the worker it was starting. Once the pool has handed the
      // worker over, nothing interrupts until it is the entity's, or stopped (its session was
      // killed): a worker left in between would run on, holding its slot. The restore is sent
      // once the entity has the worker (interruptible: a kill, a worker wedged on a full pipe).
      // The pool's next spare starts once the restore is sent (or soon after, whatever happens):
      // a process booting beside a restore slows it down.
      const holdSpare = restore === undefined ? undefined : pool.holdSpare
      const acquire = (scope: Scope.Scope) =>
        holdSpare === undefined
          ? pool.acquire(s.meta.activeSessionId, workerEnv(s))
          : Effect.zipRight(Scope.extend(holdSpare, scope), pool.acquire(s.meta.activeSessionId, workerEnv(s)))
      yield* forkIn(
        s,
        Effect.scopeWith((scope) => Effect.uninterruptibleMask((interruptible) =>
          // Under maxWorkers: with every slot held, this waits (and asks idle sessions to stop).
          interruptible(slots.withSlot(acquire(scope), passivateForSlots(s))).pipe(
            // Sent at once, before the pool starts its next spare (a process booting beside a
            // restore slows it down); should this attempt be stale by now, the worker is stopped.
            Effect.tap((worker) => worker.send(load)),
            Effect.matchEffect({
              onFailure: (error) => post(s, { _tag: "AcquireFailed", epoch, message: error.message }),
              onSuccess: (w) =>
                s.closed
                  ? Effect.asVoid(w.stop())
                  : Effect.zipRight(
                    post(s, { _tag: "Acquired", epoch, worker: w }),
                    restore === undefined ? Effect.void : interruptible(sendSession(w))
                  )
            })
          )
        )).pipe(Effect.scoped)
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

  /** The running turn is over: its end is out, the journal says idle, the idle status follows. */
  const endTurn = (s: Session, phase: Extract<Phase, { _tag: "Running" }>, how: TurnEnd) =>
    Effect.gen(function*() {
      // The end is logged: should the journal still say busy, a restart finds it there and cuts nothing.
      yield* recordBestEffort(s, false, "turn_end")
      // Not busy from here, and said so at once, under the publish lock: nobody reading under it
      // (`get_state`, an attach) sees busy:false before the stream does. A status that cannot
      // be logged leaves the turn's end out and only its status owed.
      yield* publishStatus(s, () => (s.phase = { _tag: "Idle", worker: phase.worker })).pipe(
        Effect.tapError(() => Effect.sync(() => (s.cutTurn = { _tag: "StatusOwed" })))
      )
      for (const a of phase.aborts) yield* Deferred.succeed(a, { aborted: how === "aborted" })
      checkDue(s)
    })

  /** An automatic checkpoint is due once the generation has grown past its thresholds. */
  const checkDue = (s: Session) => {
    if (s.generationEvents >= config.checkpointEvents || s.generationBytes >= config.checkpointBytes) s.checkpointDue = true
  }

  /**
   * A cut turn's `turn_interrupted` is out (the restored worker's, or the supervisor's): the
   * journal says idle; the session stays busy until the status that ends the turn.
   */
  const interruptReported = (s: Session) =>
    Effect.gen(function*() {
      s.cutTurn = { _tag: "StatusOwed" }
      yield* recordBestEffort(s, false, "turn_end")
      checkDue(s)
    })

  /**
   * Publishes the status that ends a cut turn (busy:false, whatever `change` makes the phase):
   * the first status after its `turn_interrupted`. A prompt that waited for it is reserved
   * then, and said so by a status of its own unless its turn starts right away (Idle).
   */
  const endCutTurn = (s: Session, change: () => void) =>
    Effect.gen(function*() {
      yield* publishStatus(s, () => {
        change()
        s.cutTurn = undefined
      })
      const waiting = s.promptAfterCut
      if (waiting === undefined) return
      s.promptAfterCut = undefined
      s.pendingPrompt = waiting
      if (s.phase._tag !== "Idle") yield* publishStatus(s)
    })

  /** Starts the turn of the reserved prompt (the session is Idle). */
  const startTurn = (s: Session, worker: WorkerHandle, prompt: PendingPrompt) =>
    Effect.gen(function*() {
      s.pendingPrompt = undefined
      const turnId = `t-${randomUUID()}`
      s.lastUsed = Date.now()
      // Accepted only once durable: the journal says busy (a crash from here is a cut turn it
      // finds) and the log holds the busy status. Else refused, and nothing of it remains.
      const durable = yield* Effect.either(Effect.zipRight(
        record(s, true, "prompt"),
        publishStatus(s, () => (s.phase = { _tag: "Running", worker, turnId, aborts: [] }))
      ))
      if (durable._tag === "Left") {
        yield* Effect.logError(`session ${s.meta.activeSessionId}: prompt refused: ${durable.left.message}`)
        yield* Deferred.fail(prompt.reply, storageUnavailable(s.meta.activeSessionId, durable.left))
        if (durable.left.what === "event log") yield* recordBestEffort(s, false, "prompt_refused")
        // The stream showed the prompt waiting (busy): it says it is gone.
        if (s.publishedBusy) yield* publishStatus(s)
        return
      }
      yield* worker.send({ type: "prompt", turnId, message: prompt.message })
      yield* Deferred.succeed(prompt.reply, { accepted: true as const })
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
            if (eventType === "turn_interrupted" && phase._tag !== "Running" && s.cutTurn?._tag !== "InterruptOwed") {
              // A restored worker reports a cut turn because the journal said busy, but no turn
              // is owed its end (its end is logged; the journal's idle record could not be
              // written): a second end would be a lie.
              yield* Effect.logWarning(`worker of ${s.meta.activeSessionId}: a cut turn it reported is not owed one (its end is logged): not published`)
              break
            }
            events.push(eventMessage(eventType, eventJson))
            eventBytes += eventJson.length
            if (eventBytes >= PUBLISH_BATCH_BYTES) yield* flushEvents
            if (eventType === "tool_execution_start" || eventType === "tool_execution_end") {
              yield* flushEvents
              // The journal said busy when the turn began: a restart cuts it either way.
              yield* recordBestEffort(s, true, eventType === "tool_execution_start" ? "tool_start" : "tool_end")
            } else if (eventType === "agent_end" || eventType === "turn_interrupted") {
              yield* flushEvents
              const how: TurnEnd = eventType === "agent_end"
                ? "agent_end"
                : (JSON.parse(eventJson) as Extract<Protocol.AgentEvent, { type: "turn_interrupted" }>).reason
              // A restored worker reports the turn its predecessor was cut in: the next status
              // (`ready`, or `recovering` should it crash first) is that turn's idle status.
              if (phase._tag === "Running") yield* endTurn(s, phase, how)
              else if (s.cutTurn?._tag === "InterruptOwed") yield* interruptReported(s)
            }
            break
          }
          case "worker_ready": {
            yield* flushEvents
            if (phase._tag === "Starting" && phase.worker !== undefined) {
              // The turn cut by a crash ends before the worker is ready, whatever the worker said.
              if (s.cutTurn?._tag === "InterruptOwed") {
                yield* publish(s, { type: "session_event", event: { type: "turn_interrupted", reason: s.cutTurn.reason } as Protocol.AgentEvent })
                yield* interruptReported(s)
              }
              const worker = phase.worker
              const ready = () => (s.phase = { _tag: "Idle", worker })
              // The `ready` status ends a cut turn; a prompt that waited for it runs next.
              if (s.cutTurn === undefined) yield* publishStatus(s, ready)
              else yield* endCutTurn(s, ready)
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
            // The only snapshot a worker sends: its engine rewrote the transcript during a turn.
            if (phase._tag === "Running") yield* rewriteFrame(s, phase.worker, frame)
            else yield* Effect.logWarning(`snapshot frame ${frame.type} of ${s.meta.activeSessionId} outside a turn`)
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
      if (phase._tag === "Running") s.cutTurn = { _tag: "InterruptOwed", reason: "worker_crashed" }
      // A rewrite cut short never happened: the replacement restores what the files hold.
      yield* abandonRewrite(s, "the worker crashed")
      if (phase._tag === "Running") for (const a of phase.aborts) yield* Deferred.succeed(a, { aborted: false })
      s.restarts++
      const { state, step: decision } = yield* stepRestart(restarts, s.restartState, crash)
      s.restartState = state
      if (decision._tag === "failed") {
        return yield* failSession(s, `its worker crashed ${decision.crashes} times within ${restartPolicy.restartWindowMs} ms`)
      }
      const epoch = ++s.epoch
      const recovering = () => (s.phase = { _tag: "Starting", worker: undefined, state: "recovering", epoch })
      // A replacement that crashed after reporting the cut turn: this status ends that turn.
      if (s.cutTurn?._tag === "StatusOwed") yield* endCutTurn(s, recovering)
      else yield* publishStatus(s, recovering)
      // The first restart is immediate; later ones back off on the Clock.
      if (decision.delayMs === 0) return yield* startWorker(s, "recovering", true)
      yield* forkIn(s, Effect.zipRight(Effect.sleep(Duration.millis(decision.delayMs)), post(s, { _tag: "RestartDue", epoch })))
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
      // A cut turn not reported yet is reported now; one reported is ended by the failed status.
      const cut = phase._tag === "Running" ? "worker_crashed" as const : s.cutTurn?._tag === "InterruptOwed" ? s.cutTurn.reason : undefined
      const aborts = phase._tag === "Running" ? phase.aborts : []
      yield* abandonRewrite(s, "the session failed")
      s.epoch++
      s.phase = { _tag: "Failed" }
      s.cutTurn = undefined
      // A stall on storage ends here: the failed status says the session's state from now on.
      s.stalled = undefined
      const error = failed(`Session \`${s.meta.activeSessionId}\` failed: ${why}; use retry_worker.`)
      const waiting = answerWaiting(s, error)
      for (const a of aborts) yield* Deferred.succeed(a, { aborted: false })
      yield* waiting
      if (worker !== undefined) yield* fork(Effect.asVoid(worker.stop()))
      if (cut !== undefined) {
        yield* Effect.catchAllCause(
          publish(s, { type: "session_event", event: { type: "turn_interrupted", reason: cut } as Protocol.AgentEvent }),
          () => Effect.void
        )
        yield* recordBestEffort(s, false, "failed")
      }
      // Tell attached clients if the log takes it; it may well not.
      yield* Effect.catchAllCause(publishStatus(s), () => Effect.void)
    })

  /**
   * The daemon stops and the worker did not end its turn when asked (or is gone): the turn is
   * cut here, as a failed session's is (a message it was streaming is not kept: only its worker
   * could end it), and the worker is stopped. The journal says idle, so the next daemon start does not restore it.
   * The session shows `passivated`: its worker is on its way out, and any late frame of it is
   * no longer the session's.
   */
  const cutForShutdown = (s: Session, phase: Extract<Phase, { _tag: "Running" }>) =>
    Effect.gen(function*() {
      yield* abandonRewrite(s, "the daemon stopped")
      s.epoch++
      yield* publish(s, { type: "session_event", event: { type: "turn_interrupted", reason: "daemon_shutdown" } as Protocol.AgentEvent })
      yield* recordBestEffort(s, false, "turn_end")
      yield* publishStatus(s, () => (s.phase = { _tag: "Passivated" }))
      for (const a of phase.aborts) yield* Deferred.succeed(a, { aborted: false })
      yield* fork(Effect.asVoid(phase.worker.stop()))
    })

  /**
   * The daemon stops while a turn cut by a crash still waits for its end (the worker
   * recovering): that end is said now, with the crash's reason, and the status that ends the
   * turn follows; the worker being restored is stopped. The journal says idle, so the next
   * start does not cut that turn again (`daemon_restarted`) nor restore the session at once.
   */
  const endCutTurnForShutdown = (s: Session) =>
    Effect.gen(function*() {
      const cut = s.cutTurn
      if (cut === undefined) return
      const worker = workerOf(s.phase)
      s.epoch++
      if (cut._tag === "InterruptOwed") {
        yield* publish(s, { type: "session_event", event: { type: "turn_interrupted", reason: cut.reason } as Protocol.AgentEvent })
        s.cutTurn = { _tag: "StatusOwed" }
        yield* recordBestEffort(s, false, "turn_end")
      }
      yield* endCutTurn(s, () => {
        s.phase = { _tag: "Passivated" }
        s.stalled = undefined
      })
      if (worker !== undefined) yield* fork(Effect.asVoid(worker.stop()))
    })

  /**
   * Storage failed under the session (`error`): the event log or the journal did not take a
   * write that a step depended on. A running turn is cut (`turn_interrupted {storage_failed}`
   * owed; a turn already cut keeps its reason), its worker stopped (it holds events that were
   * not logged) and the session stalls: it shows what the stream shows (busy) and tries again
   * every STORAGE_RETRY_INTERVAL to log the owed end, then the status that follows it; then a
   * worker restores the session from what is logged, as after a crash. A status that could not
   * be logged with no turn at stake is the same, with no end owed.
   */
  const onStorageFailed = (s: Session, error: StorageFailed) =>
    Effect.gen(function*() {
      if (s.closed) return
      yield* Effect.logError(`session ${s.meta.activeSessionId}: storage failed: ${error.message}`)
      if (s.stalled !== undefined) return yield* retryStorageLater(s)
      const phase = s.phase
      if (phase._tag === "Failed") return
      s.stalled = summary(s)
      if (phase._tag === "Running") {
        if (s.cutTurn === undefined) s.cutTurn = { _tag: "InterruptOwed", reason: "storage_failed" }
        for (const a of phase.aborts) yield* Deferred.succeed(a, { aborted: false })
      }
      yield* abandonRewrite(s, "storage failed")
      const worker = workerOf(phase)
      const epoch = ++s.epoch
      // No worker until the end is out; the next one restores what the log holds.
      s.phase = { _tag: "Starting", worker: undefined, state: "recovering", epoch }
      // A prompt waiting to start is refused: it cannot be made durable now.
      const waiting = [s.promptAfterCut, s.pendingPrompt].filter((p) => p !== undefined)
      s.promptAfterCut = undefined
      s.pendingPrompt = undefined
      for (const p of waiting) yield* Deferred.fail(p.reply, storageUnavailable(s.meta.activeSessionId, error))
      if (worker !== undefined) yield* fork(Effect.asVoid(worker.stop()))
      yield* retryStorageLater(s)
    })

  const retryStorageLater = (s: Session) =>
    Effect.suspend(() => {
      const epoch = s.epoch
      return forkIn(s, Effect.zipRight(Effect.sleep(STORAGE_RETRY_INTERVAL), post(s, { _tag: "StorageRetry", epoch })))
    })

  /** Tries again to end the turn that storage cut: its end, its status, then a worker. */
  const retryStorage = (s: Session) =>
    Effect.gen(function*() {
      const cut = s.cutTurn
      if (cut?._tag === "InterruptOwed") {
        yield* publish(s, { type: "session_event", event: { type: "turn_interrupted", reason: cut.reason } as Protocol.AgentEvent })
        s.cutTurn = { _tag: "StatusOwed" }
      }
      // Before any worker restores it: a journal still saying busy would have that worker
      // report the turn cut once more.
      yield* record(s, false, "turn_end")
      // The status that ends the turn: not busy, `recovering`.
      yield* endCutTurn(s, () => (s.stalled = undefined))
      yield* startWorker(s, "recovering", true)
    })

  /**
   * Takes, synchronously, every request that waits for a worker (the session is no longer busy
   * with a reserved prompt from here); the effect returned answers them with `error`.
   */
  const answerWaiting = (s: Session, error: CoreError): Effect.Effect<void> => {
    const prompts = [s.pendingPrompt, s.promptAfterCut].filter((p) => p !== undefined)
    s.pendingPrompt = undefined
    s.promptAfterCut = undefined
    const checkpoints = s.checkpointWaiters.splice(0)
    const retries = s.retryWaiters.splice(0)
    s.checkpointDue = false
    return Effect.gen(function*() {
      for (const p of prompts) yield* Deferred.fail(p.reply, error)
      for (const w of checkpoints) yield* Deferred.fail(w, error)
      for (const w of retries) yield* Deferred.fail(w, error)
    })
  }

  /**
   * Every worker slot is held and spawns wait: the least recently used idle sessions are asked
   * to passivate, one per waiting spawn that no worker on its way out will serve (sessions idle
   * later give theirs up between turns).
   */
  const passivateForSlots = (except: Session) =>
    Effect.suspend(() => {
      const idle = [...sessions.values()]
        .filter((x) => x !== except && x.phase._tag === "Idle" && x.pendingPrompt === undefined && !x.passivationWanted)
        .sort((a, b) => a.lastUsed - b.lastUsed)
      return Effect.forEach(idle.slice(0, slots.wanted()), (victim) => post(victim, { _tag: "Passivate" }), { discard: true })
    })

  return {
    startWorker,
    pump,
    startTurn,
    onCrash,
    onFrames,
    failSession,
    answerWaiting,
    cutForShutdown,
    endCutTurnForShutdown,
    onStorageFailed,
    retryStorage
  }
}
