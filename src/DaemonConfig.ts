/**
 * The daemon's configuration as a service: embedded defaults, overridable per field
 * (`layer(partial)`) or from the environment (`layerFromEnv`).
 */
import * as Context from "effect/Context"
import * as Layer from "effect/Layer"
import * as path from "node:path"
import { defaultStateDir, resolveSocketPath } from "./StatePaths.js"

export interface DaemonConfigShape {
  /** Where sessions, logs, the journal and the socket live. */
  readonly stateDir: string
  /** The socket path (`<stateDir>/agentd.sock` by default). */
  readonly socketPath: string
  /** The engine of a `create` that names none. */
  readonly engine: string
  /** Live worker processes beyond which idle sessions are passivated. */
  readonly maxWorkers: number
  /** Longest inbound line. */
  readonly maxLineBytes: number
  /** Automatic checkpoint after a turn once the generation holds this many events... */
  readonly checkpointEvents: number
  /** ... or this many bytes of events. */
  readonly checkpointBytes: number
  /** Generations whose events and snapshots are kept. */
  readonly retainGenerations: number
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
   * The worker program to spawn; by default this package's `bin/worker.js` next to the module
   * that spawns it. The bundled CLI names the worker bundled next to it.
   */
  readonly workerEntry?: string
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
  warmSpare: true
})

/** Numeric settings that may come from the environment, by variable name. */
const numericEnv: ReadonlyArray<readonly [string, keyof DaemonConfigShape]> = [
  ["AGENTD_MAX_WORKERS", "maxWorkers"],
  ["AGENTD_MAX_LINE_BYTES", "maxLineBytes"],
  ["AGENTD_CHECKPOINT_EVENTS", "checkpointEvents"],
  ["AGENTD_CHECKPOINT_BYTES", "checkpointBytes"],
  ["AGENTD_RETAIN_GENERATIONS", "retainGenerations"],
  ["AGENTD_OUTBOX_BYTES", "outboxBytes"],
  ["AGENTD_MEMORY_CACHE_BYTES", "memoryCacheBytes"],
  ["AGENTD_TARGET_CHUNK_BYTES", "targetChunkBytes"],
  ["AGENTD_MAX_RESTARTS", "maxRestarts"],
  ["AGENTD_RESTART_WINDOW_MS", "restartWindowMs"]
]

/** The settings the environment gives (`AGENTD_*`); invalid values are ignored. */
export const fromEnv = (env: NodeJS.ProcessEnv = process.env): Partial<DaemonConfigShape> => {
  const out: Record<string, unknown> = {}
  for (const [name, key] of numericEnv) {
    const raw = env[name]
    if (raw === undefined) continue
    const value = Number(raw)
    if (Number.isSafeInteger(value) && value >= (key === "maxRestarts" ? 0 : 1)) out[key] = value
  }
  const keys = env["AGENTD_CLIENT_ENV_KEYS"]
  if (keys !== undefined) out["clientEnvKeys"] = keys.split(",").map((k) => k.trim()).filter((k) => k.length > 0)
  if (env["AGENTD_WARM_SPARE"] !== undefined) out["warmSpare"] = env["AGENTD_WARM_SPARE"] !== "0"
  return out as Partial<DaemonConfigShape>
}

/** Builds a full configuration: defaults for the state dir, then the environment, then the overrides. */
export const make = (overrides: Partial<DaemonConfigShape> = {}, env: NodeJS.ProcessEnv = process.env): DaemonConfigShape => {
  const stateDir = path.resolve(overrides.stateDir ?? defaultStateDir(env))
  return {
    ...defaults(stateDir),
    socketPath: resolveSocketPath(stateDir, undefined, env),
    ...fromEnv(env),
    ...overrides,
    stateDir
  }
}

/** The configuration from defaults, the environment and `overrides`. */
export const layer = (overrides: Partial<DaemonConfigShape> = {}): Layer.Layer<DaemonConfig> =>
  Layer.sync(DaemonConfig, () => make(overrides))
