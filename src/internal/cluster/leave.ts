/**
 * A runner's graceful stop hands its shards over at once (docs/cluster.md section 5). Without
 * it, @effect/cluster lets go of a stopping runner's shards only when its sharding closes, after
 * the daemon's own stop (the clients' grace period): the others waited for that, and a runner
 * that stops is then no different from one that died.
 *
 * `leave` (called once the runner's sessions are settled: running turns cut `daemon_shutdown`,
 * their idle status logged) removes the runner from the runners table, so that the others drop
 * it from their ring at their next read and assign its shards to themselves; and makes this
 * runner's own view say the same: it reads itself unhealthy, so its sharding takes itself out of
 * its ring too and lets go of every shard the usual way (each shard's entities stopped, which
 * evicts their sessions), takes no shard again, and does not register itself back. Once every
 * shard is let go of, the runner releases all its locks in one statement, and the others take
 * them.
 *
 * Owns: whether this runner is leaving, and its own `Runner` record (what it reads of itself
 * once its row is gone).
 */
import type * as MachineId from "@effect/cluster/MachineId"
import type * as Runner from "@effect/cluster/Runner"
import type * as RunnerAddress from "@effect/cluster/RunnerAddress"
import * as RunnerStorage from "@effect/cluster/RunnerStorage"
import * as Context from "effect/Context"
import * as Effect from "effect/Effect"
import * as Equal from "effect/Equal"
import * as Layer from "effect/Layer"

/** Takes this runner out of the cluster now (idempotent). */
export class Leave extends Context.Tag("agentd/cluster/Leave")<Leave, {
  readonly leave: Effect.Effect<void>
  /** Shards let go of since {@link leave} (their entities stopped; their locks still held). */
  readonly released: () => number
  /** Releases every lock of this runner at once (once every shard it held was let go of). */
  readonly releaseAll: Effect.Effect<void>
  /** Whether {@link leave} was called: the runner is stopping. */
  readonly leaving: () => boolean
}>() {}

/** The runner storage given, able to leave; and {@link Leave}. */
export const layer = (self: RunnerAddress.RunnerAddress): Layer.Layer<RunnerStorage.RunnerStorage | Leave, never, RunnerStorage.RunnerStorage> =>
  Layer.effectContext(Effect.gen(function*() {
    const inner = yield* RunnerStorage.RunnerStorage
    let leaving = false
    let released = 0
    let me: Runner.Runner | undefined
    let machineId: MachineId.MachineId | undefined
    const isSelf = (address: RunnerAddress.RunnerAddress) => Equal.equals(address, self)

    const storage = RunnerStorage.RunnerStorage.of({
      ...inner,
      register: (runner, healthy) =>
        Effect.suspend(() => {
          // Not back in the table once left (the cluster registers a runner it does not see).
          if (leaving && machineId !== undefined && isSelf(runner.address)) return Effect.succeed(machineId)
          return Effect.tap(inner.register(runner, healthy), (id) =>
            Effect.sync(() => {
              if (isSelf(runner.address)) {
                me = runner
                machineId = id
              }
            }))
        }),
      getRunners: Effect.suspend(() =>
        leaving
          ? Effect.map(inner.getRunners, (runners) => [
            ...runners.filter(([runner]) => !isSelf(runner.address)),
            // Present (else the cluster registers it again) and unhealthy (out of its own ring).
            ...(me === undefined ? [] : [[me, false] as const])
          ])
          : inner.getRunners
      ),
      acquire: (address, shardIds) => (leaving && isSelf(address) ? Effect.succeed([]) : inner.acquire(address, shardIds)),
      // Leaving, the shards are let go of one by one (each once its entities stopped), but
      // their locks are released together by `releaseAll`: a hundred releases queued on the one
      // lock connection each waited past its deadline (the cluster's third of the lease) and
      // were retried for ever, and the runner's stop never ended.
      release: (address, shardId) =>
        Effect.suspend(() => {
          if (!leaving || !isSelf(address)) return inner.release(address, shardId)
          released++
          return Effect.void
        })
    })

    const leave = Effect.suspend(() => {
      if (leaving) return Effect.void
      leaving = true
      return Effect.zipRight(
        Effect.logInfo("cluster: this runner is stopping: it leaves the cluster, its shards go to the others now"),
        // Failing (the store unreachable), the others drop it when its heartbeat is older than the lease.
        Effect.catchAllCause(inner.unregister(self), (cause) => Effect.logWarning("cluster: could not leave the runners table", cause))
      )
    })

    const releaseAll = Effect.catchAllCause(
      inner.releaseAll(self),
      (cause) => Effect.logWarning("cluster: could not release the shard locks (they go with the connection)", cause)
    )
    return Context.make(RunnerStorage.RunnerStorage, storage).pipe(
      Context.add(Leave, Leave.of({ leave, released: () => released, releaseAll, leaving: () => leaving }))
    )
  }))
