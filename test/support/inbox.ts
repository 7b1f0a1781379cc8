/**
 * The receiving side of a test or benchmark client: messages that arrived and were not claimed
 * yet, and the waits for them. `waitFor` removes and returns the first message that matches,
 * waiting for one if needed, so several waits can interleave without stealing each other's
 * messages.
 */
export class Inbox<M> {
  private pending: Array<M> = []
  private waiters: Array<{ readonly pred: (m: M) => boolean; readonly resolve: (m: M) => void; readonly reject: (e: Error) => void }> = []

  constructor(
    /** Names the client in error messages. */
    private readonly label: string,
    /** What to say about the client when a wait times out (closed? what came last?). */
    private readonly state: () => string
  ) {}

  /** Hands a message to the first wait it matches, or keeps it for a later one. */
  deliver(m: M): void {
    const i = this.waiters.findIndex((w) => w.pred(m))
    if (i >= 0) this.waiters.splice(i, 1)[0]!.resolve(m)
    else this.pending.push(m)
  }

  /** Removes and returns the first unclaimed message matching `pred`, if there is one. */
  take(pred: (m: M) => boolean): M | undefined {
    const i = this.pending.findIndex(pred)
    return i >= 0 ? this.pending.splice(i, 1)[0] : undefined
  }

  /** Removes and returns the first unclaimed message matching `pred`, waiting up to `timeoutMs`. */
  waitFor(pred: (m: M) => boolean, timeoutMs: number, what: string): Promise<M> {
    const taken = this.take(pred)
    if (taken !== undefined) return Promise.resolve(taken)
    return new Promise((resolve, reject) => {
      const waiter = {
        pred,
        resolve: (m: M) => {
          clearTimeout(timer)
          resolve(m)
        },
        reject: (e: Error) => {
          clearTimeout(timer)
          reject(new Error(`${e.message} (waiting for ${what})`))
        }
      }
      const timer = setTimeout(() => {
        this.waiters = this.waiters.filter((w) => w !== waiter)
        reject(new Error(`[${this.label}] timed out after ${timeoutMs} ms waiting for ${what}; ${this.state()}`))
      }, timeoutMs)
      this.waiters.push(waiter)
    })
  }

  /** Fails every wait now (nothing more will arrive). */
  failWaits(error: Error): void {
    for (const w of this.waiters.splice(0)) w.reject(error)
  }

  /** Forgets every unclaimed message. */
  drain(): void {
    this.pending = []
  }
}
