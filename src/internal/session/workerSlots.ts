/**
 * The bound on live session workers (`maxWorkers`). A worker holds a slot from before its spawn
 * until its process has exited, however it ends (stopped, passivated, crashed, killed). A
 * session that needs a worker when every slot is held waits for one (a prompt to it waits
 * too, reserved); meanwhile sessions between turns give theirs up (passivation). The warm
 * spare is not a session's worker and holds no slot.
 *
 * Owns: the slot count, the spawns waiting, the workers on their way out (no session field).
 */
import * as Deferred from "effect/Deferred"
import * as Effect from "effect/Effect"
import * as Exit from "effect/Exit"
import type { WorkerHandle } from "../../WorkerPool.js"

export interface WorkerSlots {
  /**
   * Runs `spawn` holding a slot: taken first, after `onWait` when none is free (first come,
   * first served); released once the worker's process has exited, or at once should `spawn`
   * fail or be interrupted (while it waits, nothing is held).
   */
  readonly withSlot: <E>(spawn: Effect.Effect<WorkerHandle, E>, onWait: Effect.Effect<void>) => Effect.Effect<WorkerHandle, E>
  /**
   * How many workers should give up their slot now: the spawns waiting, less the workers
   * already on their way out (so that two sessions ending turns together do not both give
   * theirs up for one waiting spawn). A session between turns passivates while it is above 0.
   */
  readonly wanted: () => number
  /** `worker` is on its way out (its session passivates): counted so until its process exits. */
  readonly leaving: (worker: WorkerHandle) => void
  /** How many spawns wait for a slot now. */
  readonly waiting: () => number
}

/**
 * The slots' accounting, without the waiting itself (a plain value the simulation in
 * test/transition.sim.test.ts drives too): how many are held, how many spawns wait, which
 * workers hold one and which of those are on their way out.
 */
export class SlotBook<W> {
  held = 0
  waiting = 0
  /** The workers holding a slot (until their exit). */
  readonly holders = new Set<W>()
  readonly onTheirWayOut = new Set<W>()
  constructor(readonly max: number) {}
  /** Whether a spawn takes a slot at once: takes are served in order, behind those waiting. */
  free(): boolean {
    return this.held + this.waiting < this.max
  }
  /** A spawned worker holds the slot its spawn took. */
  hold(worker: W): void {
    this.holders.add(worker)
  }
  /** A slot is given back (its worker exited, or its spawn failed: `worker` undefined). */
  release(worker: W | undefined): void {
    this.held--
    if (worker !== undefined) {
      this.holders.delete(worker)
      this.onTheirWayOut.delete(worker)
    }
  }
  wanted(): number {
    return Math.max(0, this.waiting - this.onTheirWayOut.size)
  }
  /**
   * A worker that has exited already (killed while its session was idle, say) frees nothing
   * more: counted, it would hide a waiting spawn for good.
   */
  leaving(worker: W): void {
    if (this.holders.has(worker)) this.onTheirWayOut.add(worker)
  }
}

/** `fork` runs the wait for a worker's exit (it must outlive the session that spawned it). */
export const make = (max: number, fork: (effect: Effect.Effect<void>) => Effect.Effect<void>): Effect.Effect<WorkerSlots> =>
  Effect.gen(function*() {
    const semaphore = yield* Effect.makeSemaphore(max)
    const book = new SlotBook<WorkerHandle>(max)
    const release = (worker: WorkerHandle | undefined) =>
      Effect.suspend(() => {
        book.release(worker)
        return semaphore.release(1)
      })
    const take = (onWait: Effect.Effect<void>) =>
      Effect.suspend(() => {
        // Takes are served in order: behind those already waiting, a new one waits too.
        if (book.free()) return semaphore.take(1)
        book.waiting++
        return Effect.ensuring(
          Effect.zipRight(onWait, semaphore.take(1)),
          Effect.sync(() => book.waiting--)
        )
      })
    const withSlot = <E>(spawn: Effect.Effect<WorkerHandle, E>, onWait: Effect.Effect<void>) =>
      Effect.uninterruptibleMask((restore) =>
        Effect.gen(function*() {
          yield* restore(take(onWait))
          book.held++
          const spawned = yield* Effect.exit(restore(spawn))
          if (Exit.isFailure(spawned)) {
            yield* release(undefined)
            return yield* spawned
          }
          const worker = spawned.value
          book.hold(worker)
          // Interruptible (a fiber forked here would inherit this region's mask): the daemon's
          // close interrupts it, whether or not its worker has exited by then.
          yield* fork(Effect.interruptible(Effect.zipRight(Deferred.await(worker.exited), release(worker))))
          return worker
        })
      )
    return {
      withSlot,
      wanted: () => book.wanted(),
      leaving: (worker) => book.leaving(worker),
      waiting: () => book.waiting
    }
  })
