/**
 * The daemon's configuration as a service: embedded defaults, then the `AGENTD_*` settings of
 * the configuration provider (effect/Config: the environment unless an embedder provides
 * another), then per-field overrides (`layer(partial)`; the CLI's flags).
 */
import * as Config from "effect/Config"
import type * as ConfigError from "effect/ConfigError"
import * as Context from "effect/Context"
import * as Effect from "effect/Effect"
import * as Layer from "effect/Layer"
import * as Option from "effect/Option"
import { parseListen } from "./internal/http/listen.js"
import * as path from "node:path"
import { defaultStateDir, resolveSocketPath } from "./StatePaths.js"

export interface DaemonConfigShape {
  /** Where sessions, logs, the journal and the socket live. */
  readonly stateDir: string
  /** The socket path (`<stateDir>/agentd.sock` by default). */
  readonly socketPath: string
  /** The engine of a `create` that names none. */
  readonly engine: string
  /** Live session workers beyond which idle sessions are passivated. */
  readonly maxWorkers: number
  /**
   * Sessions one worker process runs at most (1: a process of its own per session). Above 1,
   * sessions with no environment of their own share worker hosts: far less CPU for sessions streaming at a
   * model's pace (a process's wake-up is what they cost), but a host's crash interrupts every
   * session in it (each is restored). See WorkerPool's `sessionsPerWorker`.
   */
  readonly sessionsPerWorker: number
  /** Longest inbound line. */
  readonly maxLineBytes: number
  /** Automatic checkpoint after a turn once the generation holds this many events... */
  readonly checkpointEvents: number
  /** ... or this many bytes of events. */
  readonly checkpointBytes: number
  /** Generations whose events and snapshots are kept. */
  readonly retainGenerations: number
  /**
   * Bytes a write-ahead file of the file event log holds before the next one starts and the
   * segments it wrote to are fdatasynced (default 32 MiB; see EventLogOptions).
   */
  readonly writeAheadBytes?: number
  /** Outbound bytes queued for one client past which it is paused. */
  readonly outboxBytes: number
  /** Snapshot bytes kept in memory before chunks spill to disk. */
  readonly memoryCacheBytes: number
  /** Target size of a snapshot chunk's messages. */
  readonly targetChunkBytes: number
  /** Crashes tolerated within `restartWindowMs` before a session is `failed`. */
  readonly maxRestarts: number
  readonly restartWindowMs: number
  /** Keys of a client's `env` that reach the worker. */
  readonly clientEnvKeys: ReadonlyArray<string>
  /** Keep a started worker ready for the next session or restore. */
  readonly warmSpare: boolean
  /**
   * The niceness (0-19) of worker processes, and of their scheduling group (Linux autogroup), so
   * that on a machine short of CPU the daemon (the log's fsyncs, every client's stream and
   * command) is not starved by its workers. 0: as the daemon. See WorkerPool's `nice`.
   */
  readonly workerNice?: number
  /**
   * Compile the hot paths while nobody waits: the spare runs a few restores and echo turns, the
   * daemon made-up events, 2 s after its start (~0.1-0.2 s of CPU each). Off: the first restore
   * and turn of each worker are slower (a machine short of CPU, a test suite).
   */
  readonly warmUp: boolean
  /**
   * At a graceful stop, how long clients are given to read what they are owed (the last
   * responses and events, `daemon_closing`) before every connection is closed, read or not.
   */
  readonly shutdownGraceMs: number
  /**
   * Where sessions, events and the recovery journal are stored: the state dir's files (absent,
   * or `files`: the default) or a PostgreSQL database (`postgres://...`; `--store`,
   * `AGENTD_STORE`). The socket and the workers' directories stay in the state dir either way.
   */
  readonly store?: string
  /**
   * The worker program to spawn; by default this package's `bin/worker.js` next to the module
   * that spawns it. The bundled CLI names the worker bundled next to it.
   */
  readonly workerEntry?: string
  /** `HOST:PORT` of the HTTP front (docs/protocol.md section 10); none when undefined. */
  readonly http?: string | undefined
  /** Allow the HTTP front on an address that is not loopback (TLS is expected in front). */
  readonly httpInsecure: boolean
  /** How long an idle SSE stream waits before a keep-alive comment. */
  readonly httpKeepAliveMs: number
  /** How long a long-poll read at the tail waits for an event before answering 204. */
  readonly httpLongPollMs: number
  /**
   * Run as a runner of a cluster over the PostgreSQL store (`--cluster`, `AGENTD_CLUSTER=1`;
   * docs/cluster.md): needs `store` to be a PostgreSQL URL.
   */
  readonly cluster?: boolean | undefined
  /** `HOST:PORT` other runners reach this one at, and where it listens (`--runner-address`; default `<hostname>:34431`). */
  readonly runnerAddress?: string | undefined
  /**
   * How long a runner's shard locks last without a refresh (`AGENTD_CLUSTER_LEASE_MS`, default
   * 35000): the refresh runs every third of it, and a dead runner's shards move once it passed.
   */
  readonly clusterLeaseMs?: number | undefined
  /**
   * The bound on a runner's graceful stop (`AGENTD_CLUSTER_STOP_TIMEOUT_MS`, default the clients'
   * grace period plus 30 s): past it the runner kills its workers and exits 1 (docs/cluster.md).
   */
  readonly clusterStopTimeoutMs?: number | undefined
}

/** The configuration of the running daemon. */
export class DaemonConfig extends Context.Tag("agentd/DaemonConfig")<DaemonConfig, DaemonConfigShape>() {}

export { defaultStateDir, resolveSocketPath } from "./StatePaths.js"

/** The embedded defaults for a state dir. */
export const defaults = (stateDir: string = defaultStateDir()): DaemonConfigShape => ({
  stateDir,
  socketPath: path.join(stateDir, "agentd.sock"),
  engine: "echo",
  maxWorkers: 32,
  sessionsPerWorker: 1,
  maxLineBytes: 16 * 1024 * 1024,
  checkpointEvents: 1000,
  checkpointBytes: 8 * 1024 * 1024,
  retainGenerations: 4,
  outboxBytes: 8 * 1024 * 1024,
  memoryCacheBytes: 4 * 1024 * 1024,
  targetChunkBytes: 524_288,
  maxRestarts: 5,
  restartWindowMs: 60_000,
  clientEnvKeys: ["TERM", "LANG", "TZ"],
  warmSpare: true,
  warmUp: true,
  shutdownGraceMs: 3000,
  httpInsecure: false,
  httpKeepAliveMs: 15_000,
  httpLongPollMs: 20_000
})

/** `0` (off; `off` says what that means) or `1` under `name`, if set; anything else is refused. */
const onOff = (name: string, off: string) =>
  Config.option(Config.map(
    Config.string(name).pipe(Config.validate({ message: `must be 0 (${off}) or 1`, validation: (v) => v === "0" || v === "1" })),
    (v) => v === "1"
  ))

/** A whole number of at least `min` under `name`, if set. */
const count = (name: string, min: number) =>
  Config.option(Config.integer(name).pipe(Config.validate({ message: `must be an integer >= ${min}`, validation: (n) => n >= min })))

/**
 * The settings the configuration provider gives (by default the environment, `AGENTD_*`). A
 * value that is set but invalid fails with a ConfigError naming it: the daemon does not start
 * on a setting it would have to guess.
 */
export const settings: Config.Config<Partial<DaemonConfigShape>> = Config.all({
  maxWorkers: count("AGENTD_MAX_WORKERS", 1),
  sessionsPerWorker: count("AGENTD_SESSIONS_PER_WORKER", 1),
  maxLineBytes: count("AGENTD_MAX_LINE_BYTES", 1),
  checkpointEvents: count("AGENTD_CHECKPOINT_EVENTS", 1),
  checkpointBytes: count("AGENTD_CHECKPOINT_BYTES", 1),
  retainGenerations: count("AGENTD_RETAIN_GENERATIONS", 1),
  writeAheadBytes: count("AGENTD_WRITE_AHEAD_BYTES", 1),
  outboxBytes: count("AGENTD_OUTBOX_BYTES", 1),
  memoryCacheBytes: count("AGENTD_MEMORY_CACHE_BYTES", 1),
  targetChunkBytes: count("AGENTD_TARGET_CHUNK_BYTES", 1),
  maxRestarts: count("AGENTD_MAX_RESTARTS", 0),
  restartWindowMs: count("AGENTD_RESTART_WINDOW_MS", 1),
  clientEnvKeys: Config.option(Config.map(Config.string("AGENTD_CLIENT_ENV_KEYS"), (keys) =>
    keys.split(",").map((k) => k.trim()).filter((k) => k.length > 0))),
  warmUp: onOff("AGENTD_WARM_UP", "no warm-up"),
  warmSpare: onOff("AGENTD_WARM_SPARE", "no spare"),
  workerNice: Config.option(Config.integer("AGENTD_WORKER_NICE").pipe(
    Config.validate({ message: "must be an integer from 0 to 19", validation: (n) => n >= 0 && n <= 19 })
  )),
  shutdownGraceMs: count("AGENTD_SHUTDOWN_GRACE_MS", 0),
  // Checked with `--store` by the daemon (InvalidStore): one message and one exit code for both.
  store: Config.option(Config.string("AGENTD_STORE")),
  // Empty is off, as unset.
  http: Config.option(Config.string("AGENTD_HTTP").pipe(
    Config.validate({
      message: "must be HOST:PORT, e.g. 127.0.0.1:7433",
      validation: (value) => value.trim() === "" || typeof parseListen(value) !== "string"
    }),
    Config.map((value) => (value.trim() === "" ? undefined : value))
  )),
  httpInsecure: Config.option(Config.map(Config.string("AGENTD_HTTP_INSECURE"), (v) => v !== "0" && v !== "")),
  httpKeepAliveMs: count("AGENTD_HTTP_KEEPALIVE_MS", 1),
  httpLongPollMs: count("AGENTD_HTTP_LONG_POLL_MS", 1),
  cluster: onOff("AGENTD_CLUSTER", "a single daemon"),
  runnerAddress: Config.option(Config.string("AGENTD_RUNNER_ADDRESS").pipe(
    Config.validate({ message: "must be HOST:PORT, e.g. 10.0.0.5:34431", validation: (value) => typeof parseListen(value) !== "string" })
  )),
  clusterLeaseMs: count("AGENTD_CLUSTER_LEASE_MS", 300),
  clusterStopTimeoutMs: count("AGENTD_CLUSTER_STOP_TIMEOUT_MS", 1000)
}).pipe(Config.map((all) => {
  const out: Record<string, unknown> = {}
  for (const [key, value] of Object.entries(all) as Array<[string, Option.Option<unknown>]>) {
    if (Option.isSome(value)) out[key] = value.value
  }
  return out as Partial<DaemonConfigShape>
}))

/**
 * A configuration error in one line that names each setting at fault, e.g.
 * `AGENTD_MAX_WORKERS: Expected an integer value but received "abc"` (a lone ConfigError's
 * own message leaves the name out).
 */
export const describeConfigError = (error: ConfigError.ConfigError): string => {
  switch (error._op) {
    case "And":
    case "Or":
      return `${describeConfigError(error.left)}; ${describeConfigError(error.right)}`
    case "InvalidData":
    case "MissingData":
    case "SourceUnavailable":
    case "Unsupported":
      return `${error.path.length === 0 ? "" : `${error.path.join(".")}: `}${error.message}`
  }
}

/** Builds a full configuration: defaults for the state dir, then `settings`, then the overrides. */
export const make = (
  overrides: Partial<DaemonConfigShape> = {},
  env: NodeJS.ProcessEnv = process.env
): Effect.Effect<DaemonConfigShape, ConfigError.ConfigError> =>
  Effect.map(settings, (fromConfig) => {
    const stateDir = path.resolve(overrides.stateDir ?? defaultStateDir(env))
    return {
      ...defaults(stateDir),
      socketPath: resolveSocketPath(stateDir, undefined, env),
      ...fromConfig,
      ...overrides,
      stateDir
    }
  })

/** The configuration from defaults, the configuration provider and `overrides`. */
export const layer = (overrides: Partial<DaemonConfigShape> = {}): Layer.Layer<DaemonConfig, ConfigError.ConfigError> =>
  Layer.effect(DaemonConfig, make(overrides))
