/**
 * An overall bound on a runner's graceful stop (docs/cluster.md section 5). A finalizer of the
 * cluster's layers that never ends hangs the stop for ever (seen: a log tail that could not be
 * interrupted, logTail.ts; the process stayed, holding its store connections, its worker gone or
 * not). The stop's own steps are bounded one by one; this bounds the whole, whatever hangs.
 *
 * Armed when the stop begins (the router's `settleForShutdown`, the first step of every graceful
 * stop: a signal or `shutdown`). Once the bound has passed, the runner SIGKILLs every worker it
 * started (as a SIGKILLed runner leaves none: their pipes close, they exit), logs the last step
 * the stop reached and the kinds of handles still open, and exits 1. A plain timer, not a fiber
 * of a scope: it must outlive the scopes whose closing it bounds, and it holds the process
 * open for nothing (unref'd). A second timer exits even if the runtime runs nothing more.
 *
 * Owns: whether the bound is armed, and the last step the stop reported.
 */
import * as Effect from "effect/Effect"
import * as Runtime from "effect/Runtime"
import { WorkerPool } from "../../WorkerPool.js"

/** The exit code of a stop cut by the bound (EXIT.failed of the command line). */
const EXIT_STOP_CUT = 1
/** How long the runtime has to kill the workers and log before the process exits anyway. */
const LAST_RESORT_MS = 2_000

export interface StopBound {
  /** Starts the bound (once; later calls do nothing). */
  readonly arm: Effect.Effect<void>
  /** Notes the step the stop has reached (for the log, should the bound pass). */
  readonly reached: (step: string) => void
}

/** Kinds of the handles keeping the event loop alive, counted: `TCPSocketWrap x3, Timeout x2`. */
const openHandles = (): string => {
  const counts = new Map<string, number>()
  for (const kind of process.getActiveResourcesInfo()) counts.set(kind, (counts.get(kind) ?? 0) + 1)
  return [...counts].map(([kind, n]) => `${kind} x${n}`).join(", ") || "none"
}

export const make = (boundMs: number): Effect.Effect<StopBound, never, WorkerPool> =>
  Effect.gen(function*() {
    const pool = yield* WorkerPool
    const runtime = yield* Effect.runtime<never>()
    let armed = false
    let step = "settling its sessions"

    const expire = Effect.gen(function*() {
      const workers = yield* pool.live
      for (const worker of workers) worker.kill()
      yield* Effect.logError(
        `cluster: the runner's stop did not end within ${boundMs} ms (its last step: ${step}): ` +
          `${workers.length} worker(s) SIGKILLed; still open: ${openHandles()}; exiting ${EXIT_STOP_CUT}`
      )
      process.exit(EXIT_STOP_CUT)
    })

    const arm = Effect.sync(() => {
      if (armed) return
      armed = true
      setTimeout(() => {
        setTimeout(() => process.exit(EXIT_STOP_CUT), LAST_RESORT_MS).unref()
        Runtime.runFork(runtime)(expire)
      }, boundMs).unref()
    })

    return {
      arm,
      reached: (s: string) => {
        step = s
      }
    }
  })
