/**
 * Self-fencing on the runner's own clock (docs/cluster.md section 5). A runner cut off from
 * PostgreSQL keeps its shard locks until the server notices the dead connection; the others
 * take its shards once its heartbeat is older than the lease. @effect/cluster drops the shards
 * (and so their sessions' workers) only when a lock refresh fails or times out, which a loaded
 * machine can make late. The fence does not wait for that: once no refresh has succeeded for
 * half the lease, the runner kills every session's worker and holds every new worker's start,
 * whatever the cluster says, until a refresh succeeds again.
 *
 * Measured with the monotonic clock of this process only (Effect's `Clock`, `process.hrtime`),
 * from the *start* of the last refresh that succeeded: the heartbeat it wrote was written after
 * that start, so the others cannot count this runner dead before that start plus the lease.
 * Killing at half the lease leaves the other half for the kill and for a timer that fires late.
 * A refresh that is late (queued on the lock connection, or slow under load) is backed by a
 * probe that writes the heartbeat on another connection (`probing`): its success counts as a
 * refresh's, so a late refresh alone no longer kills the workers of a runner that is not cut off.
 *
 * Owns: the start time of the last refresh that succeeded, and whether the fence is up.
 */
import * as RunnerStorage from "@effect/cluster/RunnerStorage"
import * as Clock from "effect/Clock"
import * as Duration from "effect/Duration"
import * as Effect from "effect/Effect"
import * as Layer from "effect/Layer"
import type * as Scope from "effect/Scope"
import * as SqlClient from "@effect/sql/SqlClient"
import { WorkerPool } from "../../WorkerPool.js"

/** The part of the lease without a successful refresh after which the fence comes up. */
export const FENCE_FRACTION = 0.5
/**
 * The part of the fence's window after which, no lock operation that started since having
 * succeeded, the heartbeat probe runs (a refresh is due every two thirds of the window: it is
 * late by then).
 */
export const PROBE_AFTER = 0.75

export interface Fence {
  /** A lock operation (a refresh, an acquisition, a release), its success recorded (with the time it started). */
  readonly timed: <A, E, R>(refresh: Effect.Effect<A, E, R>) => Effect.Effect<A, E, R>
  /**
   * Runs the fence for ever: `hold` (which kills the workers and holds new starts until its scope
   * closes) is entered when no refresh started within `windowMs` succeeded, left once one did.
   */
  readonly run: Effect.Effect<never>
  /** Whether the fence is up (for `status` and tests). */
  readonly up: () => boolean
  /**
   * Runs the heartbeat probe for ever: once no lock operation that started within
   * {@link PROBE_AFTER} of the window has succeeded, `probe` (which writes this runner's
   * heartbeat) runs, timed as a lock operation, again every sixth of the window while late.
   */
  readonly probing: (probe: Effect.Effect<void, unknown>) => Effect.Effect<never>
}

export const make = (windowMs: number, hold: Effect.Effect<void, never, Scope.Scope>): Effect.Effect<Fence> =>
  Effect.gen(function*() {
    const window = BigInt(Math.round(windowMs * 1e6))
    // As if a refresh had just succeeded: the runner holds nothing yet, nothing to fence.
    let lastGood = yield* Clock.currentTimeNanos
    let isUp = false
    /** Woken at each success while the fence is up. */
    let waiter: (() => void) | undefined

    const timed = <A, E, R>(refresh: Effect.Effect<A, E, R>): Effect.Effect<A, E, R> =>
      Effect.flatMap(Clock.currentTimeNanos, (started) =>
        Effect.tap(refresh, () =>
          Effect.sync(() => {
            // Refreshes may overlap (a late one answering after the next began): keep the newest.
            if (started > lastGood) lastGood = started
            const w = waiter
            waiter = undefined
            w?.()
          })))

    /** Until a refresh succeeded that started less than the window ago. */
    const fresh = Effect.gen(function*() {
      while ((yield* Clock.currentTimeNanos) - lastGood >= window) {
        yield* Effect.async<void>((resume) => {
          waiter = () => resume(Effect.void)
          return Effect.sync(() => {
            waiter = undefined
          })
        })
      }
    })

    const run: Effect.Effect<never> = Effect.forever(Effect.gen(function*() {
      const since = (yield* Clock.currentTimeNanos) - lastGood
      if (since < window) return yield* Effect.sleep(Duration.nanos(window - since))
      const silentMs = Number(since / 1_000_000n)
      yield* Effect.scoped(Effect.gen(function*() {
        yield* hold
        isUp = true
        yield* Effect.logError(
          `cluster: no shard lock refresh succeeded for ${silentMs} ms (fence at ${windowMs} ms, half the lease): ` +
            "every session's worker is killed, and no worker starts until one succeeds"
        )
        yield* fresh
      }).pipe(Effect.ensuring(Effect.sync(() => {
        isUp = false
      }))))
      yield* Effect.logWarning("cluster: a shard lock refresh succeeded again: workers may start")
    }))

    const probeDue = BigInt(Math.round(windowMs * PROBE_AFTER * 1e6))
    const probing = (probe: Effect.Effect<void, unknown>): Effect.Effect<never> =>
      Effect.forever(Effect.gen(function*() {
        const since = (yield* Clock.currentTimeNanos) - lastGood
        if (since < probeDue) return yield* Effect.sleep(Duration.nanos(probeDue - since))
        // One at a time, each bounded: a probe that cannot answer (a partition) does not pile up.
        yield* Effect.ignore(timed(Effect.timeoutFail(probe, { duration: Duration.millis(windowMs / 2), onTimeout: () => "timeout" })))
        yield* Effect.sleep(Duration.millis(windowMs / 6))
      }))

    return { timed, run, up: () => isUp, probing }
  })

/**
 * The runner storage given, its lock operations timed, with the fence running beside it over the
 * worker pool (its `fence`) for as long as the layer lives.
 */
export const layer = (
  leaseMs: number,
  /** `HOST:PORT` of this runner: its row of the runners table. */
  self: string,
  runnersTable: string
): Layer.Layer<RunnerStorage.RunnerStorage, never, RunnerStorage.RunnerStorage | WorkerPool | SqlClient.SqlClient> =>
  Layer.scoped(
    RunnerStorage.RunnerStorage,
    Effect.gen(function*() {
      const inner = yield* RunnerStorage.RunnerStorage
      const pool = yield* WorkerPool
      const sql = yield* SqlClient.SqlClient
      if (pool.fence === undefined) {
        yield* Effect.logWarning("cluster: this worker pool cannot be fenced: a runner cut off from the store relies on the cluster alone")
        return inner
      }
      const fence = yield* make(leaseMs * FENCE_FRACTION, pool.fence)
      yield* Effect.forkScoped(fence.run)
      // The heartbeat probe, on a connection of the pool, not the lock connection (where a late
      // refresh waits, queued behind the lock operations before it). What lets the others take
      // this runner's shards is its heartbeat older than the lease (then its locks, freed): a
      // heartbeat written at a probe that started at T keeps them off until T plus the lease, as
      // a refresh's does, so its success counts as one. Under load a refresh answered late (over a
      // sixth of the lease after it was due) and the fence killed the workers of a runner that
      // was not cut off; a probe that answers in time spares them. A runner cut off answers no
      // probe either: the fence comes up as before, not later. None once the runner left the
      // table (a stopping runner: its row is gone, nothing is written).
      yield* Effect.forkScoped(fence.probing(
        sql<{ one: number }>`UPDATE ${sql(runnersTable)} SET last_heartbeat = now() WHERE address = ${self} RETURNING 1 AS one`.pipe(
          Effect.flatMap((rows) => (rows.length === 0 ? Effect.fail("not registered") : Effect.void))
        )
      ))
      // Every operation on the lock connection counts, not the refresh alone: a rebalance
      // releases or takes 150 locks one by one on that connection, and the refresh queued
      // behind them answered over a second late (a false alarm at every runner joining). Each
      // success says the connection holding the locks was alive when it started, so that no
      // other runner could take them then. A refresh starved for longer than its own timeout (a
      // third of the lease) is still the cluster's to act on: it drops the shards.
      return RunnerStorage.RunnerStorage.of({
        ...inner,
        acquire: (address, shardIds) => fence.timed(inner.acquire(address, shardIds)),
        refresh: (address, shardIds) => fence.timed(inner.refresh(address, shardIds)),
        release: (address, shardId) => fence.timed(inner.release(address, shardId))
      })
    })
  )
