/**
 * The bound on live session workers (`maxWorkers`). A worker holds a slot from before its spawn
 * until its process has exited, however it ends (stopped, passivated, crashed, killed). A
 * session that needs a worker when every slot is held waits for one (a prompt to it waits
 * too, reserved); meanwhile sessions between turns give theirs up (passivation). The warm
 * spare is not a session's worker and holds no slot.
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
  /** How many spawns wait for a slot now: while any does, sessions between turns give theirs up. */
  readonly waiting: () => number
}

/** `fork` runs the wait for a worker's exit (it must outlive the session that spawned it). */
export const make = (max: number, fork: (effect: Effect.Effect<void>) => Effect.Effect<void>): Effect.Effect<WorkerSlots> =>
  Effect.gen(function*() {
    const semaphore = yield* Effect.makeSemaphore(max)
    let held = 0
    let waiting = 0
    const release = Effect.suspend(() => {
      held--
      return semaphore.release(1)
    })
    const take = (onWait: Effect.Effect<void>) =>
      Effect.suspend(() => {
        // Takes are served in order: behind those already waiting, a new one waits too.
        if (held + waiting < max) return semaphore.take(1)
        waiting++
        return Effect.ensuring(
          Effect.zipRight(onWait, semaphore.take(1)),
          Effect.sync(() => waiting--)
        )
      })
    const withSlot = <E>(spawn: Effect.Effect<WorkerHandle, E>, onWait: Effect.Effect<void>) =>
      Effect.uninterruptibleMask((restore) =>
        Effect.gen(function*() {
          yield* restore(take(onWait))
          held++
          const spawned = yield* Effect.exit(restore(spawn))
          if (Exit.isFailure(spawned)) {
            yield* release
            return yield* spawned
          }
          const worker = spawned.value
          // Interruptible (a fiber forked here would inherit this region's mask): the daemon's
          // close interrupts it, whether or not its worker has exited by then.
          yield* fork(Effect.interruptible(Effect.zipRight(Deferred.await(worker.exited), release)))
          return worker
        })
      )
    return { withSlot, waiting: () => waiting }
  })
