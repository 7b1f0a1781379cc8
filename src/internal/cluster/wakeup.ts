/**
 * The wake-up of one log tail (logTail.ts): notifications coalesce (any number of them while the
 * tail reads make one more read, never one each), and a tail that hears nothing still reads
 * after the safety interval (a notification lost with its connection is then late, not lost).
 *
 * Owns: whether a read is owed, and the one waiter.
 */
import * as Duration from "effect/Duration"
import * as Effect from "effect/Effect"

export class Wakeup {
  /** A notification came since the last {@link wait} returned. */
  private owed = false
  private waiter: (() => void) | undefined

  /** Something was written: the tail reads (now if it waits, else right after its current read). */
  notify(): void {
    this.owed = true
    const waiter = this.waiter
    this.waiter = undefined
    waiter?.()
  }

  /**
   * Waits for a notification or `poll`, whichever comes first: `true` when notified. Returns at
   * once (`true`) when one came meanwhile; either way no notification is owed afterwards.
   */
  wait(poll: Duration.DurationInput): Effect.Effect<boolean> {
    return Effect.suspend(() => {
      if (this.owed) {
        this.owed = false
        return Effect.succeed(true)
      }
      const notified = Effect.async<boolean>((resume) => {
        // Checked again here: a notification may come between the check above and this
        // registration (the race starts this fiber later), and must not wait for the poll.
        if (this.owed) return resume(Effect.succeed(true))
        this.waiter = () => resume(Effect.succeed(true))
        return Effect.sync(() => {
          this.waiter = undefined
        })
      })
      return Effect.raceFirst(notified, Effect.as(Effect.sleep(poll), false)).pipe(
        Effect.tap(() =>
          Effect.sync(() => {
            this.owed = false
          })
        )
      )
    })
  }
}
