/**
 * A cluster runner (`agentd serve --store postgres://... --cluster`; docs/cluster.md): the
 * daemon joins the other runners of its PostgreSQL store through @effect/cluster, owns the
 * sessions of the shards it holds, and routes every other session's commands to its owner.
 *
 * {@link layer} replaces the SessionManager it is given (the runner's own sessions, built to
 * load none at start: `SessionManager.LoadAtStart`) with the routing one. It opens its own
 * connections to the store (the sharding's shard locks live on one of them). A separate module,
 * loaded only by a daemon started with `--cluster`.
 *
 * @since 0.1.0
 */
import * as PgClient from "@effect/sql-pg/PgClient"
import * as Layer from "effect/Layer"
import * as Redacted from "effect/Redacted"
import type { DaemonConfig } from "./DaemonConfig.js"
import * as LogTail from "./internal/cluster/logTail.js"
import * as Runner from "./internal/cluster/runner.js"
import type { RecoveryJournal } from "./RecoveryJournal.js"
import type { SessionManager, SupervisorInfo } from "./SessionManager.js"
import type { SessionStore } from "./SessionStore.js"
import type { SnapshotCache } from "./SnapshotCache.js"
import type { WorkerPool } from "./WorkerPool.js"

export { SessionEntity, RemoteCommandError } from "./internal/cluster/entity.js"
export { DEFAULT_LEASE_MS, DEFAULT_RUNNER_PORT, runnerAddressOf, shardingSettings } from "./internal/cluster/runner.js"

/** The runner over the store at `url`: sharding, the `Session` entity, the routing SessionManager. */
export const layer = (url: string): Layer.Layer<
  SessionManager,
  never,
  SessionManager | SessionStore | DaemonConfig | SupervisorInfo | RecoveryJournal | SnapshotCache | WorkerPool
> =>
  Runner.layer.pipe(
    Layer.provide(LogTail.layer(url)),
    Layer.provide(
      PgClient.layer({ url: Redacted.make(url), maxConnections: 8, applicationName: "agentd-cluster" }).pipe(
        // The store answered the daemon's own connection a moment ago: a failure here is a defect.
        Layer.orDie
      )
    )
  )
