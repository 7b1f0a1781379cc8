/**
 * A session's worker, as its entity supervises it: the worker is acquired beside the entity
 * (which stays free to answer) and its outcome comes back through the mailbox (`Acquired`,
 * `AcquireFailed`); a pump hands the worker's frames to the entity and reports its exit. What
 * a crash leads to (a restore on the restart schedule, or a failed session) is `step`'s.
 *
 * Owns: the acquisition of a worker (slot, spawn, `load`, the restore read) and its pump.
 */
import * as Deferred from "effect/Deferred"
import * as Effect from "effect/Effect"
import * as Scope from "effect/Scope"
import type * as Protocol from "../../Protocol.js"
import * as StateLayout from "../../StateLayout.js"
import type { WorkerHandle } from "../../WorkerPool.js"
import type * as WorkerProtocol from "../../WorkerProtocol.js"
import { journalSaysBusy, sendRestore } from "./restore.js"
import { type Core, isClosed, type Session } from "./session.js"

/**
 * How often a session whose turn storage cut tries again to log that turn's end (a full disk
 * freed, file descriptors given back).
 */
export const STORAGE_RETRY_INTERVAL = "1500 millis"

/** The seam of the worker supervisor, as the session's entity drives it. */
export interface Supervisor {
  /**
   * Starts a worker for attempt `epoch` (acquired beside the entity; its outcome comes back
   * through the mailbox). `restore`: it is sent the session's state; `interruptedReason`: the
   * turn cut by a crash it reports.
   */
  readonly startWorker: (
    s: Session,
    epoch: number,
    restore: boolean,
    interruptedReason: Protocol.InterruptReason | undefined
  ) => Effect.Effect<void>
  /** Pumps a worker's frames to the entity until the pipe closes, then reports the exit. */
  readonly pump: (s: Session, worker: WorkerHandle) => Effect.Effect<void>
}

/** Worker supervision: a worker's acquisition and its frame pump. */
export const makeSupervisor = (core: Core): Supervisor => {
  const { config, info, pool, sessions, slots, post, workerEnv, forkIn } = core

  /**
   * Starts a worker for the session (a new session, a wake-up, a restore): the acquisition runs
   * beside the entity, which stays free to answer; its outcome comes back through the mailbox.
   */
  const startWorker = (s: Session, epoch: number, restoring: boolean, interruptedReason: Protocol.InterruptReason | undefined) =>
    Effect.gen(function*() {
      // The journal as it stands now (the entity is its only writer for this session): a turn
      // it says was running is reported cut by the restored worker.
      const restore = restoring
        ? {
          busy: yield* journalSaysBusy(core, s.meta.activeSessionId),
          ...(interruptedReason === undefined ? {} : { interruptedReason })
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
      // a process booting beside a restore slows it down. A new session's worker defers it as a
      // turn's start does (for the pool's hold time): its first prompt usually follows at once,
      // and the next spare booting beside that first turn (~150 ms of CPU) slowed it down.
      const holdSpare = restore === undefined ? undefined : pool.holdSpare
      const acquire = (scope: Scope.Scope) =>
        holdSpare === undefined
          ? Effect.zipRight(pool.deferSpare ?? Effect.void, pool.acquire(s.meta.activeSessionId, workerEnv(s)))
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
                isClosed(s)
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
      const { framesNow, whenFrames } = worker
      yield* framesNow !== undefined && whenFrames !== undefined
        ? pumpNow(s, worker, framesNow.bind(worker), whenFrames.bind(worker))
        : pumpFrames(s, worker)
      const exit = yield* Deferred.await(worker.exited)
      yield* post(s, { _tag: "Exited", worker, exit })
    })

  /**
   * Posts each take of the worker's frames to the entity, until the pipe closes. The next take is
   * decoded while the entity handles this one (most of that time it waits for its log's
   * fdatasync); it is posted once this one is handled: the worker's pipe is the backpressure,
   * and at most two takes are decoded at a time.
   */
  const pumpFrames = (s: Session, worker: WorkerHandle) =>
    Effect.gen(function*() {
      let frames = yield* worker.takeFrames
      while (frames.length > 0) {
        const handled = Effect.unsafeMakeLatch(false)
        yield* post(s, { _tag: "Frames", worker, frames, handled: () => handled.unsafeOpen() })
        if (isClosed(s)) break
        const next = yield* worker.takeFrames
        yield* handled.await
        frames = next
      }
    })

  /**
   * `pumpFrames` outside any fiber's steps, for a worker that hands its frames over synchronously
   * (`framesNow`): run from the pipe's callbacks and the entity's `handled`, with no fiber woken
   * but the entity. At a model's pace every take is one event, and the pump's own wake-ups were
   * a good part of its cost. Ends once the pipe has closed and every take was handled.
   */
  const pumpNow = (
    s: Session,
    worker: WorkerHandle,
    framesNow: () => Array<WorkerProtocol.ReceivedFrame> | undefined,
    whenFrames: (wake: () => void) => () => void
  ) =>
    Effect.async<void>((resume) => {
      /** A take is posted and not yet handled. */
      let posted = false
      /** The next take, decoded while the entity handles the one posted. */
      let ahead: Array<WorkerProtocol.ReceivedFrame> | undefined
      let forget = () => {}
      let ended = false
      const end = () => {
        ended = true
        forget()
        resume(Effect.void)
      }
      const handled = () => {
        posted = false
        next()
      }
      const next = (): void => {
        if (ended) return
        if (ahead === undefined) {
          ahead = framesNow()
          if (ahead === undefined) {
            forget = whenFrames(next)
            return
          }
        }
        if (posted) return
        const frames = ahead
        ahead = undefined
        if (frames.length === 0 || isClosed(s)) return end()
        posted = true
        s.mailbox.unsafeOffer({ _tag: "Frames", worker, frames, handled })
        next()
      }
      next()
      return Effect.sync(() => {
        ended = true
        forget()
      })
    })

  /**
   * Every worker slot is held and spawns wait: the least recently used idle sessions are asked
   * to passivate, one per waiting spawn that no worker on its way out will serve (sessions idle
   * later give theirs up between turns).
   */
  const passivateForSlots = (except: Session) =>
    Effect.suspend(() => {
      const idle = [...sessions.values()]
        .filter((x) => x !== except && x.state._tag === "Idle" && !x.state.stopping)
        .sort((a, b) => a.lastUsed - b.lastUsed)
      return Effect.forEach(idle.slice(0, slots.wanted()), (victim) => post(victim, { _tag: "Passivate" }), { discard: true })
    })

  return { startWorker, pump }
}
