/**
 * One session's state machine (DESIGN: "the session core"). A single fiber owns the session's
 * phase and takes every input from one mailbox: commands (each with its own Deferred), the
 * worker's frames and exit, timers. Every transition settles the requests that can no longer
 * complete where it leads; after each input, work waiting for an idle session runs (a
 * checkpoint first, then a reserved prompt, then a passivation).
 */
import * as Cause from "effect/Cause"
import * as Deferred from "effect/Deferred"
import * as FiberId from "effect/FiberId"
import * as FiberRef from "effect/FiberRef"
import * as Effect from "effect/Effect"
import * as Either from "effect/Either"
import * as Exit from "effect/Exit"
import * as Queue from "effect/Queue"
import * as Scope from "effect/Scope"
import * as StateLayout from "../../StateLayout.js"
import { WorkerCrashed } from "../../WorkerPool.js"
import type { Delivery } from "../delivery/attach.js"
import type { Checkpoints } from "./checkpoint.js"
import type { Input } from "./phase.js"
import { CommandTakesEffect, workerOf } from "./phase.js"
import { type CoreError, failed, internal, notFound, SessionBusy, shuttingDown, StorageUnavailable } from "./errors.js"
import { type Core, type Session, type StorageFailed } from "./session.js"
import type { Supervisor } from "./supervisor.js"

/** How long the workers have to cut their running turns at a graceful stop, before the supervisor does. */
const SHUTDOWN_CUT_GRACE = "2 seconds"

/** The session entity: one fiber per session takes every input from its mailbox, one at a time. */
export const makeEntity = (core: Core, checkpoints: Checkpoints, supervisor: Supervisor, delivery: Delivery) => {
  const { cache, journal, log, restarts, sessions, store, publish, publishStatus, record, summary, fork, forkIn } = core
  const { abandonRewrite, runCheckpoint } = checkpoints
  const { answerWaiting, cutForShutdown, endCutTurnForShutdown, failSession, onCrash, onFrames, onStorageFailed, pump, retryStorage, startTurn, startWorker } = supervisor
  const { detachAttachment } = delivery

  /**
   * Hands an input to the session's entity. Checked and offered in one synchronous step: once
   * the entity has closed the session nothing more is offered, so nothing waits forever.
   */
  /** Set once the daemon stops: commands are refused from then on (see {@link settleForShutdown}). */
  let stopping = false
  /** Who waits for a session's running turn to be cut before the daemon closes its sockets. */
  const turnCutWaiters = new Map<Session, Array<Deferred.Deferred<void>>>()
  /** Completes the waits for a cut once no turn runs (or the session is gone). */
  const releaseCutWaiters = (s: Session) =>
    Effect.suspend(() => {
      const waiting = turnCutWaiters.get(s)
      if (waiting === undefined || (s.phase._tag === "Running" && !s.closed)) return Effect.void
      turnCutWaiters.delete(s)
      return Effect.forEach(waiting, (d) => Deferred.succeed(d, undefined), { discard: true })
    })

  const send = <A>(
    s: Session,
    make: (command: { readonly reply: Deferred.Deferred<A, CoreError>; readonly taken: Deferred.Deferred<void> | undefined }) => Input
  ) =>
    Effect.gen(function*() {
      const reply = yield* Deferred.make<A, CoreError>()
      const taken = yield* FiberRef.get(CommandTakesEffect)
      if (stopping) return yield* Effect.fail(shuttingDown())
      if (s.closed) return yield* Effect.fail(notFound(s.meta.activeSessionId))
      s.mailbox.unsafeOffer(make({ reply, taken }))
      return yield* Deferred.await(reply)
    })

  /**
   * Between turns, work waiting runs: a checkpoint first (asked during the turn, or due; it
   * needs no worker, so a passivated session takes it too), then a reserved prompt, then a
   * passivation.
   */
  const drain = (s: Session) =>
    Effect.gen(function*() {
      // The daemon stops: nothing new starts (what waited was answered `shutting_down`).
      if (stopping) return
      const betweenTurns = (s.phase._tag === "Idle" || s.phase._tag === "Passivated") && s.cutTurn === undefined
      if (betweenTurns && (s.checkpointWaiters.length > 0 || s.checkpointDue)) yield* runCheckpoint(s)
      const phase = s.phase
      if (phase._tag !== "Idle") return
      if (s.pendingPrompt !== undefined) return yield* startTurn(s, phase.worker, s.pendingPrompt)
      // Between turns while another session waits for a worker slot: this one gives up its own.
      if (s.checkpointWaiters.length === 0 && core.slots.wanted() > 0) s.passivationWanted = true
      if (s.passivationWanted) {
        core.slots.leaving(phase.worker)
        s.passivationWanted = false
        // What the generation added is written first: a restore then reads it from the transcript.
        if (s.generationEvents > 0) yield* runCheckpoint(s)
        s.epoch++
        // The session's fibers end with its worker; whatever it does next runs in a new scope.
        const previous = s.scope
        Object.assign(s, yield* core.sessionScope)
        yield* fork(Effect.zipRight(phase.worker.stop(), Scope.close(previous, Exit.void)))
        yield* publishStatus(s, () => (s.phase = { _tag: "Passivated" }))
      }
    })

  /** Wakes a passivated session (or retries a failed one): a worker that restores it. */
  const wake = (s: Session) => startWorker(s, s.phase._tag === "Failed" ? "recovering" : "starting", true)

  const onInput = (s: Session, input: Input): Effect.Effect<void, StorageFailed> => {
    const phase = s.phase
    switch (input._tag) {
      case "Prompt": {
        s.lastUsed = Date.now()
        if (phase._tag === "Failed") {
          return Deferred.fail(input.reply, failed(`Session \`${s.meta.activeSessionId}\` has failed; use retry_worker.`))
        }
        if (s.stalled !== undefined) {
          return Deferred.fail(
            input.reply,
            new StorageUnavailable({
              message: `Session \`${s.meta.activeSessionId}\` cannot take a prompt: storage failed and the end of its last turn is not logged yet.`
            })
          )
        }
        if (phase._tag === "Running" || s.pendingPrompt !== undefined || s.promptAfterCut !== undefined) {
          return Deferred.fail(
            input.reply,
            new SessionBusy({ activeSessionId: s.meta.activeSessionId, message: `Session \`${s.meta.activeSessionId}\` is running a turn.` })
          )
        }
        if (s.cutTurn !== undefined) {
          // The worker recovers from a crash that cut a turn: the prompt waits for it, and is
          // taken once that turn has ended (its turn_interrupted, then the idle status).
          s.promptAfterCut = { message: input.message, reply: input.reply }
          return Effect.void
        }
        // Reserved now (busy); runs once the session is idle with a worker.
        s.pendingPrompt = { message: input.message, reply: input.reply }
        if (phase._tag === "Passivated") return wake(s)
        // Said to attached clients at once, as a prompt that runs at once does (when idle, the
        // turn starts right after this input, with its status).
        return phase._tag === "Idle" ? Effect.void : publishStatus(s)
      }
      case "Abort": {
        // Only a running turn can be aborted; a prompt that has not started yet is not a turn.
        if (phase._tag !== "Running") return Deferred.succeed(input.reply, { aborted: false })
        phase.aborts.push(input.reply)
        return phase.worker.send({ type: "abort", turnId: phase.turnId })
      }
      case "Checkpoint": {
        if (phase._tag === "Failed") {
          return Deferred.fail(input.reply, failed(`Session \`${s.meta.activeSessionId}\` has failed; use retry_worker.`))
        }
        // Taken once the session is between turns (at once when it is).
        s.checkpointWaiters.push(input.reply)
        return Effect.void
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
      case "SetEnv":
        return Effect.sync(() => {
          if (input.launchEnv !== undefined) s.launchEnv = input.launchEnv
          if (input.clientEnv !== undefined) s.clientEnv = input.clientEnv
        })
      case "ShuttingDown": {
        // What would wait for a turn's end or a worker is answered now: the daemon will not wait.
        const error = shuttingDown()
        const aborts = phase._tag === "Running" ? phase.aborts.splice(0) : []
        return Effect.gen(function*() {
          for (const a of aborts) yield* Deferred.fail(a, error)
          yield* answerWaiting(s, error)
          if (phase._tag !== "Running") {
            // An owed end that storage still refuses stays owed: the journal says busy, and the
            // next start ends that turn `daemon_restarted`.
            return yield* endCutTurnForShutdown(s).pipe(
              Effect.catchAll((e) => Effect.logError(`session ${s.meta.activeSessionId}: ${e.message}`)),
              Effect.ensuring(Deferred.succeed(input.done, undefined))
            )
          }
          // A running turn is cut before the sockets close, so that its end reaches the clients
          // attached and the journal says idle (the next start restores nothing, reports no
          // crash). The worker cuts it as it does an abort (the message it was streaming ends
          // as such); its `turn_interrupted {daemon_shutdown}` ends the turn as any turn ends.
          turnCutWaiters.set(s, [...(turnCutWaiters.get(s) ?? []), input.done])
          if (input.force === true) return yield* cutForShutdown(s, phase)
          yield* phase.worker.send({ type: "abort", turnId: phase.turnId, reason: "daemon_shutdown" })
        })
      }
      case "Acquired": {
        if (phase._tag !== "Starting" || phase.epoch !== input.epoch) return Effect.asVoid(input.worker.stop())
        s.phase = { ...phase, worker: input.worker }
        return forkIn(s, pump(s, input.worker))
      }
      case "AcquireFailed": {
        // A spawn refused because the daemon stops is no crash.
        if (phase._tag !== "Starting" || phase.epoch !== input.epoch || stopping) return Effect.void
        // A spawn that fails counts as a crash: retried with backoff, then `failed`.
        return Effect.zipRight(
          Effect.logError(`no worker for ${s.meta.activeSessionId}: ${input.message}`),
          onCrash(s, new WorkerCrashed({ activeSessionId: s.meta.activeSessionId, pid: 0, exitCode: null, signal: null }))
        )
      }
      case "Restore":
        return phase._tag === "Passivated" ? startWorker(s, "recovering", true) : Effect.void
      case "StorageRetry": {
        if (phase._tag !== "Starting" || phase.epoch !== input.epoch || s.stalled === undefined || stopping) return Effect.void
        return retryStorage(s)
      }
      case "RestartDue": {
        if (phase._tag !== "Starting" || phase.epoch !== input.epoch || phase.worker !== undefined || stopping) return Effect.void
        return startWorker(s, "recovering", true)
      }
      case "Frames": {
        if (workerOf(phase) !== input.worker) return Deferred.succeed(input.handled, undefined)
        return Effect.ensuring(onFrames(s, input.frames), Deferred.succeed(input.handled, undefined))
      }
      case "Exited": {
        if (workerOf(phase) !== input.worker || input.worker.stopping) return Effect.void
        // The daemon stops (its workers are on their way out): no crash, no restore; a turn still
        // running ends `daemon_shutdown`.
        if (stopping) return phase._tag === "Running" ? cutForShutdown(s, phase) : Effect.void
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
  const killSession = (s: Session, reply: Deferred.Deferred<{}, CoreError>) =>
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
      // Its pump and timers end; a worker still being acquired is waited for and stopped.
      yield* Scope.close(s.scope, Exit.void)
      const gone = notFound(id)
      if (phase._tag === "Running") for (const a of phase.aborts) yield* Deferred.fail(a, gone)
      yield* abandonRewrite(s, "the session was killed")
      yield* answerWaiting(s, gone)
      // Inputs queued before the kill are answered now, before the kill's own answer: a worker
      // handed over just before it (an `Acquired` not taken in yet) is stopped by then, not
      // after `kill` answered (it ran on beside the next spare, past --max-workers).
      for (const input of yield* Queue.takeAll(s.mailbox)) yield* answerGone(s, input)
      const archived = yield* Effect.either(Effect.gen(function*() {
        yield* core.recordBestEffort(s, false, "closed")
        yield* Effect.ignoreLogged(journal.forget(id))
        const dir = yield* store.archive(id).pipe(Effect.mapError(internal("session store")))
        yield* log.remove(id, { archiveTo: StateLayout.archivedEventsDir(dir) }).pipe(Effect.mapError(internal("event log")))
      }))
      yield* checkpoints.disposeSnapshotEntry(s)
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
        return Deferred.fail(input.reply as Deferred.Deferred<unknown, CoreError>, gone).pipe(Effect.asVoid)
      case "Acquired":
        return Effect.asVoid(input.worker.stop())
      case "Frames":
        return Deferred.succeed(input.handled, undefined).pipe(Effect.asVoid)
      case "ShuttingDown":
        return Deferred.succeed(input.done, undefined).pipe(Effect.asVoid)
      default:
        return Effect.void
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
        if (s.closed || (force && s.phase._tag !== "Running")) continue
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

  /**
   * Something broke inside a transition that is no storage failure (those are typed, and cut the
   * turn: `onStorageFailed`): a broken invariant. The session fails, loudly.
   */
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
        yield* onInput(s, input).pipe(Effect.catchTag("StorageFailed", (e) => onStorageFailed(s, e)), Effect.catchAllCause((cause) => onDefect(s, cause)))
        if (!s.closed) {
          yield* drain(s).pipe(Effect.catchTag("StorageFailed", (e) => onStorageFailed(s, e)), Effect.catchAllCause((cause) => onDefect(s, cause)))
        }
        yield* releaseCutWaiters(s)
        if ("taken" in input && input.taken !== undefined) yield* Deferred.succeed(input.taken, undefined)
      }
      // Closed: nothing more is offered; what was offered before is answered.
      for (const input of yield* Queue.takeAll(s.mailbox)) yield* answerGone(s, input)
      yield* releaseCutWaiters(s)
    })

  return { send, runEntity, settleForShutdown }
}
