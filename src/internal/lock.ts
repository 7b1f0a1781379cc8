/**
 * A lock with one holder that can also be taken synchronously when it is free. Effect's
 * Semaphore takes even a free permit through an async step (a fiber suspension and resume), and
 * its state is internal: the session's hot path (a worker's event logged and handed to the
 * clients, ~10k times a second with 200 sessions streaming) takes the session's publish lock and
 * its log's write lock in its own synchronous step when they are free, and waits only when not.
 *
 * A waiter is woken when the lock is released and takes it in its own fiber (as Effect's
 * Semaphore does): a waiter interrupted before it ran never held it. Every waiter is woken, and
 * those that find it taken again wait again, so that one interrupted after its wake-up leaves no
 * other waiting on a free lock.
 */
import * as Effect from "effect/Effect"

export class Lock {
  private held = false
  private waiters: Array<() => void> = []

  /** Whether someone holds it. */
  get isHeld(): boolean {
    return this.held
  }

  /** Takes it now if it is free (nobody holds it): then the caller must {@link release} it. */
  tryTake(): boolean {
    if (this.held) return false
    this.held = true
    return true
  }

  /**
   * Takes it, waiting while it is held. Call it in an uninterruptible region and pass that
   * region's `restore`: only the wait is interruptible, and the lock is taken in the caller's own
   * uninterruptible step, so no interruption falls between taking it and the caller's release.
   */
  take(restore: <A, E, R>(effect: Effect.Effect<A, E, R>) => Effect.Effect<A, E, R>): Effect.Effect<void> {
    return Effect.suspend(() => (this.tryTake() ? Effect.void : Effect.zipRight(restore(this.woken), this.take(restore))))
  }

  /**
   * Waits for the next release, or not at all if it was let go meanwhile: the run loop may yield
   * between a `take`'s failed try and this registration, and a release then found no waiter.
   */
  private readonly woken: Effect.Effect<void> = Effect.async<void>((resume) => {
    if (!this.held) return resume(Effect.void)
    const wake = () => resume(Effect.void)
    this.waiters.push(wake)
    return Effect.sync(() => {
      const i = this.waiters.indexOf(wake)
      if (i >= 0) this.waiters.splice(i, 1)
    })
  })

  /** Lets it go and wakes its waiters (the first to run takes it). */
  release(): void {
    this.held = false
    if (this.waiters.length === 0) return
    const woken = this.waiters
    this.waiters = []
    for (const wake of woken) wake()
  }

  /** Runs `self` holding the lock; only the wait for it is interruptible. */
  withLock<A, E, R>(self: Effect.Effect<A, E, R>): Effect.Effect<A, E, R> {
    return Effect.uninterruptibleMask((restore) =>
      Effect.zipRight(this.take(restore), Effect.ensuring(restore(self), Effect.sync(() => this.release())))
    )
  }
}
