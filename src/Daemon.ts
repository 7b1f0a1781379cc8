/**
 * `DaemonLive`: every layer composed into the daemon `agentd serve` runs, over a state dir:
 *
 * ```
 * <stateDir>/agentd.sock                 the socket (0600)
 *                                        (the state dir's lock is not a file: see StateDirLock)
 * <stateDir>/supervisor-generation       +1 at every start
 * <stateDir>/recovery.jsonl              the recovery journal
 * <stateDir>/events/<session>/...        the event log
 * <stateDir>/sessions/<session>/...      metadata and transcripts (SessionStore)
 * <stateDir>/archive/                    killed sessions
 * <stateDir>/snapshot-cache/<gen>/       snapshot chunks spilled to disk
 * <stateDir>/http-token                  the HTTP front's token (0600)
 * ```
 */
import type * as FileSystem from "@effect/platform/FileSystem"
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
import * as HttpServer from "./HttpServer.js"
import * as Fsx from "./internal/fsx.js"
import * as RecoveryJournal from "./RecoveryJournal.js"
import * as SessionManager from "./SessionManager.js"
import * as SessionStore from "./SessionStore.js"
import * as SnapshotCache from "./SnapshotCache.js"
import * as StateDirLock from "./StateDirLock.js"
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

/**
 * The state dir's lock (see StateDirLock), taken for the daemon's whole life: built before every
 * other layer that touches the state dir, it is released after all of them, last.
 */
export const stateDirLockLayer: Layer.Layer<
  StateDirLock.StateDirLock,
  StateDirLock.StateDirLocked | StateDirLock.StateDirLockError,
  DaemonConfig
> = Layer.scoped(
  StateDirLock.StateDirLock,
  Effect.flatMap(DaemonConfig, (config) => StateDirLock.acquire({ stateDir: config.stateDir, socketPath: config.socketPath }))
)

/**
 * Paths and generation of this supervisor; creates the state dir (0700). It takes the state
 * dir's lock first: a second daemon on the same state dir, whatever its socket, is refused
 * before it writes anything (the generation counter included).
 */
export const supervisorInfoLayer: Layer.Layer<
  SessionManager.SupervisorInfo,
  Fsx.FsError | DaemonServer.ServerStartError | StateDirLock.StateDirLocked | StateDirLock.StateDirLockError,
  DaemonConfig
> = Layer.effect(
  SessionManager.SupervisorInfo,
  Effect.gen(function*() {
    const config = yield* DaemonConfig
    yield* StateDirLock.StateDirLock
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
).pipe(Layer.provide(stateDirLockLayer))

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

/** What the default storage and worker layers are built over: the configuration and this supervisor's paths. */
export type StorageContext = DaemonConfig | SessionManager.SupervisorInfo

/** The event log under `<stateDir>/events` (the default of {@link DaemonLayers.eventLog}). */
export const eventLogLayer: Layer.Layer<EventLog.EventLog, EventLog.EventLogError, StorageContext> = Layer.unwrapEffect(
  Effect.map(SessionManager.SupervisorInfo, (info) => EventLog.layer({ root: info.eventLogRoot }))
)

/** Session metadata and transcripts under `<stateDir>/sessions` (the default of {@link DaemonLayers.sessionStore}). */
export const sessionStoreLayer: Layer.Layer<SessionStore.SessionStore, SessionStore.SessionStoreError, StorageContext> = Layer
  .unwrapEffect(Effect.map(SessionManager.SupervisorInfo, (info) => SessionStore.layer({ root: info.storeRoot })))

/** The recovery journal `<stateDir>/recovery.jsonl` (the default of {@link DaemonLayers.recoveryJournal}). */
export const recoveryJournalLayer: Layer.Layer<RecoveryJournal.RecoveryJournal, RecoveryJournal.RecoveryJournalError, StorageContext> =
  Layer.unwrapEffect(Effect.map(SessionManager.SupervisorInfo, (info) => RecoveryJournal.layer({ path: info.journalPath })))

/**
 * The snapshot cache, spilling past `memoryCacheBytes` to `<stateDir>/snapshot-cache/<generation>`
 * through the `FileSystem` (the default of {@link DaemonLayers.snapshotCache}).
 */
export const snapshotCacheLayer: Layer.Layer<SnapshotCache.SnapshotCache, never, StorageContext | FileSystem.FileSystem> = Layer
  .unwrapEffect(Effect.gen(function*() {
    const config = yield* DaemonConfig
    const info = yield* SessionManager.SupervisorInfo
    return SnapshotCache.layer({
      cacheRoot: path.join(config.stateDir, "snapshot-cache", String(info.generation)),
      memoryCacheBytes: config.memoryCacheBytes
    })
  }))

/** Worker processes spawned from `config.workerEntry` (the default of {@link DaemonLayers.workerPool}). */
export const workerPoolLayer: Layer.Layer<WorkerPool.WorkerPool, never, StorageContext> = Layer.unwrapEffect(
  Effect.map(DaemonConfig, (config) =>
    WorkerPool.layer({
      warmSpare: config.warmSpare,
      ...(config.workerEntry === undefined ? {} : { workerEntry: config.workerEntry })
    }))
)

/**
 * The layers {@link DaemonLive} is made of that an embedder may replace; each one left out is
 * the default named on it. A replacement may use what the defaults use: the configuration
 * (`DaemonConfig`) and this supervisor's paths and generation (`SessionManager.SupervisorInfo`);
 * the worker pool may also use the storage and the engines (as `WorkerPool.layerInProcess` does).
 *
 * ```ts
 * DaemonLive({ stateDir }, { engines: MyEngines, recoveryJournal: RecoveryJournal.layerMemory })
 * ```
 */
export interface DaemonLayers {
  /**
   * The engine registry: `create` checks sessions against it (default: the built-in engines,
   * `echo` and the model engines). The workers must load the same engines: give them an entry
   * calling `Worker.main(engines)` as `config.workerEntry`.
   */
  readonly engines?: Layer.Layer<Engine> | undefined
  /** Where the snapshot cache spills (default: `NodeFileSystem.layer`). */
  readonly fileSystem?: Layer.Layer<FileSystem.FileSystem> | undefined
  /** Default {@link eventLogLayer}; e.g. `EventLog.layerMemory`. */
  readonly eventLog?: Layer.Layer<EventLog.EventLog, EventLog.EventLogError, StorageContext> | undefined
  /** Default {@link sessionStoreLayer}; e.g. `SessionStore.layerMemory`. */
  readonly sessionStore?: Layer.Layer<SessionStore.SessionStore, SessionStore.SessionStoreError, StorageContext> | undefined
  /**
   * Default {@link recoveryJournalLayer}; e.g. `RecoveryJournal.layerMemory` (nothing written:
   * after a daemon restart no session is known to have been busy, so none is restored at once
   * and no turn gets `turn_interrupted {reason: "daemon_restarted"}`).
   */
  readonly recoveryJournal?:
    | Layer.Layer<RecoveryJournal.RecoveryJournal, RecoveryJournal.RecoveryJournalError, StorageContext>
    | undefined
  /** Default {@link snapshotCacheLayer}; e.g. `SnapshotCache.layerMemory` (never spills). */
  readonly snapshotCache?: Layer.Layer<SnapshotCache.SnapshotCache, never, StorageContext | FileSystem.FileSystem> | undefined
  /**
   * Default {@link workerPoolLayer}. Workers that read the daemon's files when they restore (the
   * default ones do) need the default `eventLog` and `sessionStore`.
   */
  readonly workerPool?:
    | Layer.Layer<
      WorkerPool.WorkerPool,
      never,
      | StorageContext
      | Engine
      | EventLog.EventLog
      | SessionStore.SessionStore
      | RecoveryJournal.RecoveryJournal
      | SnapshotCache.SnapshotCache
    >
    | undefined
}

/**
 * Why the daemon could not start: an invalid setting, its state dir or socket (another daemon
 * holds the state dir or listens on the socket, no access), an unknown engine, or storage that cannot be opened.
 */
export type DaemonStartError =
  | ConfigError.ConfigError
  | StateDirLock.StateDirLocked
  | StateDirLock.StateDirLockError
  | Fsx.FsError
  | DaemonServer.ServerStartError
  | EngineError
  | EventLog.EventLogError
  | SessionStore.SessionStoreError
  | RecoveryJournal.RecoveryJournalError
  | HttpServer.HttpStartError

/**
 * Every layer of the daemon: the socket server and what it needs.
 *
 * `config`: overrides of the configuration (each field left out comes from the `AGENTD_*`
 * settings of the `ConfigProvider`, the environment by default, else the embedded defaults;
 * see `DaemonConfig.make`), or a `DaemonConfig` layer that replaces it whole. `layers`: the
 * parts to replace (see {@link DaemonLayers}).
 */
export const DaemonLive = (
  config: Partial<DaemonConfigShape> | Layer.Layer<DaemonConfig, ConfigError.ConfigError> = {},
  layers: DaemonLayers = {}
): Layer.Layer<DaemonServer.DaemonServer | SessionManager.SessionManager, DaemonStartError> => {
  const configLayer = Layer.isLayer(config)
    ? config as Layer.Layer<DaemonConfig, ConfigError.ConfigError>
    : DaemonConfigModule.layer(config as Partial<DaemonConfigShape>)
  const enginesLayer = checkEngines.pipe(Layer.provideMerge(layers.engines ?? BuiltinEngines.layer))
  const info = supervisorInfoLayer.pipe(Layer.provideMerge(enginesLayer), Layer.provideMerge(configLayer))
  const storage = Layer.mergeAll(
    layers.eventLog ?? eventLogLayer,
    layers.sessionStore ?? sessionStoreLayer,
    layers.recoveryJournal ?? recoveryJournalLayer,
    (layers.snapshotCache ?? snapshotCacheLayer).pipe(Layer.provide(layers.fileSystem ?? NodeFileSystem.layer))
  ).pipe(Layer.provideMerge(info))
  const workers = (layers.workerPool ?? workerPoolLayer).pipe(Layer.provideMerge(storage))
  const manager = SessionManager.layer.pipe(Layer.provideMerge(workers))
  // The HTTP front, when asked for, starts after the socket and stops before it.
  return HttpServer.layerIfConfigured.pipe(Layer.provideMerge(DaemonServer.layer.pipe(Layer.provideMerge(manager))))
}

/** Runs the daemon until a client sends `shutdown` (or the fiber is interrupted by a signal). */
export const serve = (config: Partial<DaemonConfigShape> = {}) =>
  Effect.gen(function*() {
    const server = yield* DaemonServer.DaemonServer
    yield* Deferred.await(server.shutdownRequested)
    yield* Effect.logInfo("shutdown requested")
  }).pipe(Effect.provide(DaemonLive(config)))
