/**
 * `DaemonLive`: every layer composed into the daemon `agentd serve` runs, over a state dir:
 *
 * ```
 * <stateDir>/agentd.sock                 the socket (0600)
 * <stateDir>/supervisor-generation       +1 at every start
 * <stateDir>/recovery.jsonl              the recovery journal
 * <stateDir>/events/<session>/...        the event log
 * <stateDir>/sessions/<session>/...      metadata and transcripts (SessionStore)
 * <stateDir>/archive/                    killed sessions
 * <stateDir>/snapshot-cache/<gen>/       snapshot chunks spilled to disk
 * ```
 */
import * as NodeFileSystem from "@effect/platform-node/NodeFileSystem"
import type * as ConfigError from "effect/ConfigError"
import * as Deferred from "effect/Deferred"
import * as Effect from "effect/Effect"
import * as Layer from "effect/Layer"
import * as fs from "node:fs"
import * as path from "node:path"
import { DaemonConfig, type DaemonConfigShape } from "./DaemonConfig.js"
import * as DaemonConfigModule from "./DaemonConfig.js"
import * as DaemonServer from "./DaemonServer.js"
import { Engine, EngineError } from "./Engine.js"
import * as BuiltinEngines from "./engines/builtin.js"
import * as EventLog from "./EventLog.js"
import * as Fsx from "./internal/fsx.js"
import * as RecoveryJournal from "./RecoveryJournal.js"
import * as SessionManager from "./SessionManager.js"
import * as SessionStore from "./SessionStore.js"
import * as SnapshotCache from "./SnapshotCache.js"
import * as WorkerPool from "./WorkerPool.js"

/** Reads, increments and durably stores the supervisor generation of a state dir. */
export const nextSupervisorGeneration = (stateDir: string) =>
  Effect.gen(function*() {
    const file = path.join(stateDir, "supervisor-generation")
    const previous = yield* Fsx.readFileIfExists(file)
    const last = previous._tag === "Some" ? Number.parseInt(previous.value.trim(), 10) : 0
    const generation = (Number.isSafeInteger(last) && last > 0 ? last : 0) + 1
    yield* Fsx.writeFileAtomic(file, `${generation}\n`)
    return generation
  })

/** Paths and generation of this supervisor; creates the state dir (0700). */
export const supervisorInfoLayer: Layer.Layer<
  SessionManager.SupervisorInfo,
  Fsx.FsError | DaemonServer.ServerStartError,
  DaemonConfig
> = Layer.effect(
  SessionManager.SupervisorInfo,
  Effect.gen(function*() {
    const config = yield* DaemonConfig
    yield* Fsx.ensureDir(config.stateDir)
    // Before the state dir is touched: a second daemon on a live socket must change nothing.
    yield* DaemonServer.claimSocketPath(config.socketPath)
    const generation = yield* nextSupervisorGeneration(config.stateDir)
    // Spilled chunks of earlier supervisors are of no use to anyone now.
    const cacheDir = path.join(config.stateDir, "snapshot-cache")
    if (fs.existsSync(cacheDir)) {
      for (const entry of fs.readdirSync(cacheDir)) fs.rmSync(path.join(cacheDir, entry), { recursive: true, force: true })
    }
    return {
      generation,
      startedAt: Date.now(),
      journalPath: path.join(config.stateDir, "recovery.jsonl"),
      storeRoot: config.stateDir,
      eventLogRoot: path.join(config.stateDir, "events")
    }
  })
)

/**
 * The engines the workers run (`create` checks a session's engine and config against them),
 * once the configured default engine is found among them: checked before the state dir is
 * touched, so `serve --engine <unknown>` changes nothing.
 */
const checkEngines: Layer.Layer<never, EngineError, DaemonConfig | Engine> = Layer.effectDiscard(
  Effect.gen(function*() {
    const config = yield* DaemonConfig
    const engines = yield* Engine
    if (!engines.names.includes(config.engine)) {
      return yield* new EngineError({
        reason: "unknown_engine",
        message: `unknown engine \`${config.engine}\` (known: ${engines.names.join(", ")})`
      })
    }
  })
)

/** The storage layers over the state dir and supervisor generation. */
const storageLayer = Layer.unwrapEffect(
  Effect.gen(function*() {
    const config = yield* DaemonConfig
    const info = yield* SessionManager.SupervisorInfo
    return Layer.mergeAll(
      EventLog.layer({ root: info.eventLogRoot }),
      SessionStore.layer({ root: info.storeRoot }),
      RecoveryJournal.layer({ path: info.journalPath }),
      SnapshotCache.layer({
        cacheRoot: path.join(config.stateDir, "snapshot-cache", String(info.generation)),
        memoryCacheBytes: config.memoryCacheBytes
      }).pipe(Layer.provide(NodeFileSystem.layer)),
      WorkerPool.layer({
        warmSpare: config.warmSpare,
        ...(config.workerEntry === undefined ? {} : { workerEntry: config.workerEntry })
      })
    )
  })
)

/**
 * Why the daemon could not start: an invalid setting, its state dir or socket (another daemon
 * listens, no access), an unknown engine, or storage that cannot be opened.
 */
export type DaemonStartError =
  | ConfigError.ConfigError
  | Fsx.FsError
  | DaemonServer.ServerStartError
  | EngineError
  | EventLog.EventLogError
  | SessionStore.SessionStoreError
  | RecoveryJournal.RecoveryJournalError

/** Every layer of the daemon over a configuration: the socket server and what it needs. */
export const DaemonLive = (
  config: Partial<DaemonConfigShape> = {},
  options: {
    /**
     * The engine registry `create` checks sessions against (default: the built-in engines, `echo` and the model engines). The
     * workers must load the same engines: give them an entry calling `Worker.main(engines)` as
     * `config.workerEntry`.
     */
    readonly engines?: Layer.Layer<Engine>
  } = {}
): Layer.Layer<DaemonServer.DaemonServer | SessionManager.SessionManager, DaemonStartError> => {
  const configLayer = DaemonConfigModule.layer(config)
  const enginesLayer = checkEngines.pipe(Layer.provideMerge(options.engines ?? BuiltinEngines.layer))
  const info = supervisorInfoLayer.pipe(Layer.provideMerge(enginesLayer), Layer.provideMerge(configLayer))
  const storage = storageLayer.pipe(Layer.provideMerge(info))
  const manager = SessionManager.layer.pipe(Layer.provideMerge(storage))
  return DaemonServer.layer.pipe(Layer.provideMerge(manager))
}

/** Runs the daemon until a client sends `shutdown` (or the fiber is interrupted by a signal). */
export const serve = (config: Partial<DaemonConfigShape> = {}) =>
  Effect.gen(function*() {
    const server = yield* DaemonServer.DaemonServer
    yield* Deferred.await(server.shutdownRequested)
    yield* Effect.logInfo("shutdown requested")
  }).pipe(Effect.provide(DaemonLive(config)))
