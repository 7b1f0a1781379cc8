/**
 * `DaemonLive`: every layer composed into the daemon `agentd serve` runs, over a state dir whose
 * paths are all named in StateLayout (the state dir's lock is not a file: see StateDirLock),
 * the HTTP front's token (`http-token`, 0600) among them.
 * `CoreLive`: the same without the socket server.
 */
import type * as FileSystem from "@effect/platform/FileSystem"
import * as NodeFileSystem from "@effect/platform-node/NodeFileSystem"
import type * as ConfigError from "effect/ConfigError"
import * as Data from "effect/Data"
import * as Deferred from "effect/Deferred"
import * as Effect from "effect/Effect"
import * as Layer from "effect/Layer"
import * as path from "node:path"
import { DaemonConfig, type DaemonConfigShape } from "./DaemonConfig.js"
import * as DaemonConfigModule from "./DaemonConfig.js"
import * as DaemonServer from "./DaemonServer.js"
import { Engine, EngineError } from "./Engine.js"
import * as BuiltinEngines from "./engines/builtin.js"
import * as EventLog from "./EventLog.js"
import * as Metrics from "./Metrics.js"
import * as HttpServer from "./HttpServer.js"
import * as Fsx from "./internal/fileIo.js"
import { isPostgresUrl } from "./internal/postgres/url.js"
import type * as PostgresStore from "./PostgresStore.js"
import * as RecoveryJournal from "./RecoveryJournal.js"
import * as SessionManager from "./SessionManager.js"
import * as SessionStore from "./SessionStore.js"
import * as SnapshotCache from "./SnapshotCache.js"
import * as StateDirLock from "./StateDirLock.js"
import * as StateLayout from "./StateLayout.js"
import * as WorkerPool from "./WorkerPool.js"
import { warmUpDaemon } from "./internal/warmUpDaemon.js"

/** Reads, increments and durably stores the supervisor generation of a state dir. */
export const nextSupervisorGeneration = (stateDir: string) =>
  Effect.gen(function*() {
    const file = StateLayout.make(stateDir).generationFile
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
 * dir's lock first: a second daemon on the same state dir is refused before it writes anything
 * (the generation counter included). `beforeStateDir` runs once the lock is held, before the
 * state dir is touched (`serve` claims its socket path there).
 */
const makeSupervisorInfoLayer = <E>(beforeStateDir: Effect.Effect<void, E, DaemonConfig>): Layer.Layer<
  SessionManager.SupervisorInfo,
  Fsx.FsError | E | StateDirLock.StateDirLocked | StateDirLock.StateDirLockError,
  DaemonConfig
> =>
  Layer.effect(
    SessionManager.SupervisorInfo,
    Effect.gen(function*() {
      const config = yield* DaemonConfig
      yield* StateDirLock.StateDirLock
      yield* Fsx.ensureDir(config.stateDir)
      yield* beforeStateDir
      const generation = yield* nextSupervisorGeneration(config.stateDir)
      const layout = StateLayout.make(config.stateDir)
      // Spilled chunks of earlier supervisors are of no use to anyone now.
      const cacheDir = layout.snapshotCacheRoot
      for (const entry of yield* Fsx.readdirOrEmpty(cacheDir)) yield* Fsx.removeTree(path.join(cacheDir, entry))
      return {
        generation,
        startedAt: Date.now(),
        journalPath: layout.journalFile,
        storeRoot: layout.storeRoot,
        eventLogRoot: layout.eventLogRoot
      }
    })
  ).pipe(Layer.provide(stateDirLockLayer))

/** The supervisor's paths and generation, with no socket: what {@link CoreLive} is built over. */
export const supervisorInfoLayer: Layer.Layer<
  SessionManager.SupervisorInfo,
  Fsx.FsError | StateDirLock.StateDirLocked | StateDirLock.StateDirLockError,
  DaemonConfig
> = makeSupervisorInfoLayer(Effect.void)

/**
 * {@link supervisorInfoLayer} for a daemon that serves the socket: the socket path is claimed
 * before the state dir is touched, so a second daemon on a live socket changes nothing.
 */
export const servedSupervisorInfoLayer: Layer.Layer<
  SessionManager.SupervisorInfo,
  Fsx.FsError | DaemonServer.ServerStartError | StateDirLock.StateDirLocked | StateDirLock.StateDirLockError,
  DaemonConfig
> = makeSupervisorInfoLayer(Effect.flatMap(DaemonConfig, (config) => DaemonServer.claimSocketPath(config.socketPath)))

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
  Effect.map(Effect.all([SessionManager.SupervisorInfo, DaemonConfig]), ([info, config]) =>
    EventLog.layer({
      root: info.eventLogRoot,
      ...(config.writeAheadBytes === undefined ? {} : { writeAheadRotateBytes: config.writeAheadBytes })
    }))
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
      cacheRoot: StateLayout.make(config.stateDir).snapshotCacheDir(info.generation),
      memoryCacheBytes: config.memoryCacheBytes
    })
  }))

/** Worker processes spawned from `config.workerEntry` (the default of {@link DaemonLayers.workerPool}). */
export const workerPoolLayer: Layer.Layer<WorkerPool.WorkerPool, never, StorageContext> = Layer.unwrapEffect(
  Effect.map(DaemonConfig, (config) =>
    WorkerPool.layer({
      warmSpare: config.warmSpare,
      warmUp: config.warmUp,
      sessionsPerWorker: config.sessionsPerWorker,
      ...(config.workerNice === undefined ? {} : { nice: config.workerNice }),
      ...(config.workerEntry === undefined ? {} : { workerEntry: config.workerEntry })
    }))
)

/** `store` (`--store`, `AGENTD_STORE`) names neither `files` nor a PostgreSQL URL. */
export class InvalidStore extends Data.TaggedError("InvalidStore")<{ readonly store: string }> {
  override get message(): string {
    return `invalid store \`${this.store}\`: expected \`files\` or a PostgreSQL URL (postgres://...)`
  }
}

/** `cluster` (`--cluster`) without a PostgreSQL store: runners share their sessions through one. */
export class ClusterNeedsPostgres extends Data.TaggedError("ClusterNeedsPostgres")<{ readonly store: string }> {
  override get message(): string {
    return `--cluster needs a PostgreSQL store (--store postgres://...), not \`${this.store}\`: the runners share their sessions, events and shard locks through it`
  }
}

/** The configured store is one there is: checked before the state dir is touched, as the engine is. */
const checkStore: Layer.Layer<never, InvalidStore | ClusterNeedsPostgres, DaemonConfig> = Layer.effectDiscard(
  Effect.flatMap(DaemonConfig, (config): Effect.Effect<void, InvalidStore | ClusterNeedsPostgres> =>
    config.store !== undefined && config.store !== "files" && !isPostgresUrl(config.store)
      ? Effect.fail(new InvalidStore({ store: config.store }))
      : config.cluster === true && (config.store === undefined || !isPostgresUrl(config.store))
      ? Effect.fail(new ClusterNeedsPostgres({ store: config.store ?? "files" }))
      : Effect.void)
)

/**
 * The event log, session store and recovery journal: `layers`' own where given, else the
 * configured store's (`config.store`): the state dir's files, or PostgreSQL, where the three
 * share one connection pool and the store's single-writer lock (PostgresStore.layer), taken
 * once the state dir's lock is held.
 */
const storageLayers = (layers: DaemonLayers): Layer.Layer<
  EventLog.EventLog | SessionStore.SessionStore | RecoveryJournal.RecoveryJournal,
  | EventLog.EventLogError
  | SessionStore.SessionStoreError
  | RecoveryJournal.RecoveryJournalError
  | PostgresStore.PostgresStoreError
  | PostgresStore.PostgresStoreLocked
  | InvalidStore,
  StorageContext
> =>
  Layer.unwrapEffect(Effect.gen(function*() {
    const config = yield* DaemonConfig
    const store = config.store ?? "files"
    if (store === "files") {
      return Layer.mergeAll(
        layers.eventLog ?? eventLogLayer,
        layers.sessionStore ?? sessionStoreLayer,
        layers.recoveryJournal ?? recoveryJournalLayer
      )
    }
    if (!isPostgresUrl(store)) return yield* new InvalidStore({ store })
    // Loaded only here: the PostgreSQL client's modules cost a files daemon ~0.1-0.2 s of CPU
    // at every start (pg's load also loads Node's fetch implementation).
    const pg = yield* Effect.promise(() => import("./PostgresStore.js"))
    return Layer.mergeAll(
      layers.eventLog ?? pg.eventLog,
      layers.sessionStore ?? pg.sessionStore,
      layers.recoveryJournal ?? pg.recoveryJournal
    ).pipe(Layer.provide(pg.layer({
      url: store,
      socketPath: config.socketPath,
      // Runners hold the store together; a single daemon still excludes them (and they it).
      ...(config.cluster === true ? { lock: "shared" as const } : {})
    })))
  }))

/**
 * The SessionManager the fronts use: the local one, or, with `cluster` (`--cluster`), the
 * routing one of a cluster runner over it (Cluster.ts, loaded only then).
 */
const sessionsFront: Layer.Layer<
  SessionManager.SessionManager,
  never,
  | SessionManager.SessionManager
  | SessionManager.SupervisorInfo
  | SessionStore.SessionStore
  | RecoveryJournal.RecoveryJournal
  | SnapshotCache.SnapshotCache
  | WorkerPool.WorkerPool
  | DaemonConfig
> = Layer.unwrapEffect(Effect.gen(function*() {
  const config = yield* DaemonConfig
  if (config.cluster !== true || config.store === undefined) {
    return Layer.effect(SessionManager.SessionManager, SessionManager.SessionManager)
  }
  const Cluster = yield* Effect.promise(() => import("./Cluster.js"))
  return Cluster.layer(config.store)
}))

/** A cluster runner's SessionManager loads no session at start: it adopts those of the shards it gains. */
const loadAtStart: Layer.Layer<SessionManager.LoadAtStart, never, DaemonConfig> = Layer.unwrapEffect(
  Effect.map(DaemonConfig, (config) => Layer.succeed(SessionManager.LoadAtStart, config.cluster !== true))
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
  /** Default {@link eventLogLayer} (with `store: "postgres://..."`, `PostgresStore.eventLog`); e.g. `EventLog.layerMemory`. */
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
   * Default {@link workerPoolLayer}. Workers never read storage: a restore is sent to them by the
   * supervisor, read through the layers above, whatever they are.
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
  | PostgresStore.PostgresStoreError
  | PostgresStore.PostgresStoreLocked
  | InvalidStore
  | ClusterNeedsPostgres
  | HttpServer.HttpStartError

/** Why the core ({@link CoreLive}) could not start: {@link DaemonStartError} less the socket's and the HTTP front's. */
export type CoreStartError = Exclude<DaemonStartError, DaemonServer.ServerStartError | HttpServer.HttpStartError>

const configLayerOf = (config: Partial<DaemonConfigShape> | Layer.Layer<DaemonConfig, ConfigError.ConfigError>) =>
  Layer.isLayer(config)
    ? config as Layer.Layer<DaemonConfig, ConfigError.ConfigError>
    : DaemonConfigModule.layer(config as Partial<DaemonConfigShape>)

/** The core over a supervisor info layer: engines, storage, workers, sessions. */
const coreOver = <E>(
  configLayer: Layer.Layer<DaemonConfig, ConfigError.ConfigError>,
  infoLayer: Layer.Layer<SessionManager.SupervisorInfo, E, DaemonConfig>,
  layers: DaemonLayers
) => {
  const enginesLayer = Layer.merge(checkEngines, checkStore).pipe(Layer.provideMerge(layers.engines ?? BuiltinEngines.layer))
  const info = infoLayer.pipe(Layer.provideMerge(enginesLayer), Layer.provideMerge(configLayer))
  const storage = Layer.mergeAll(
    // Wrapped for the daemon's metrics (appends, turn and checkpoint durations), whatever the store.
    Layer.map(storageLayers(layers), Metrics.instrumentStorage),
    (layers.snapshotCache ?? snapshotCacheLayer).pipe(Layer.provide(layers.fileSystem ?? NodeFileSystem.layer))
  ).pipe(Layer.provideMerge(info))
  const workers = (layers.workerPool ?? workerPoolLayer).pipe(Layer.provideMerge(storage))
  return sessionsFront.pipe(
    Layer.provideMerge(SessionManager.layer.pipe(Layer.provide(loadAtStart), Layer.provideMerge(workers)))
  )
}

/**
 * The embeddable core: the SessionManager with its storage, workers and engines, over a state
 * dir (its lock held), and no socket server: for an app that talks to sessions in-process
 * (`SessionManager.attach` takes any `ConnectionPort`). `config` and `layers` as for
 * {@link DaemonLive}; the socket path is never touched.
 */
export const CoreLive = (
  config: Partial<DaemonConfigShape> | Layer.Layer<DaemonConfig, ConfigError.ConfigError> = {},
  layers: DaemonLayers = {}
): Layer.Layer<SessionManager.SessionManager | SessionManager.SupervisorInfo | DaemonConfig, CoreStartError> =>
  coreOver(configLayerOf(config), supervisorInfoLayer, layers)

/**
 * Every layer of the daemon: the socket server on top of the core ({@link CoreLive}).
 *
 * `config`: overrides of the configuration (each field left out comes from the `AGENTD_*`
 * settings of the `ConfigProvider`, the environment by default, else the embedded defaults;
 * see `DaemonConfig.make`), or a `DaemonConfig` layer that replaces it whole. `layers`: the
 * parts to replace (see {@link DaemonLayers}).
 */
export const DaemonLive = (
  config: Partial<DaemonConfigShape> | Layer.Layer<DaemonConfig, ConfigError.ConfigError> = {},
  layers: DaemonLayers = {}
): Layer.Layer<DaemonServer.DaemonServer | SessionManager.SessionManager | DaemonConfig, DaemonStartError> =>
  // The HTTP front, when asked for, starts after the socket and stops before it.
  HttpServer.layerIfConfigured.pipe(
    Layer.provideMerge(DaemonServer.layer.pipe(Layer.provideMerge(coreOver(configLayerOf(config), servedSupervisorInfoLayer, layers))))
  )

/**
 * Runs the daemon until a client sends `shutdown` (or the fiber is interrupted by a signal).
 * `layers`: as for {@link DaemonLive} (an embedder's engines, with its `workerEntry`).
 */
export const serve = (config: Partial<DaemonConfigShape> = {}, layers: DaemonLayers = {}) =>
  Effect.gen(function*() {
    const server = yield* DaemonServer.DaemonServer
    const manager = yield* SessionManager.SessionManager
    const { warmUp } = yield* DaemonConfig
    // The event path is compiled while nobody waits for it, not during the first turn: at once,
    // since a first prompt can come within a second of the start (it gives way to the first
    // real frames). It yields between its chunks, so the start's own work (sessions restored,
    // clients reconnecting) runs beside it. It was started 2 s late: it then ran inside the
    // first turn of a client that prompted at once and added ~10 us of daemon CPU per event to
    // it (bench/hotPath.ts).
    if (warmUp) yield* Effect.forkScoped(warmUpDaemon(EVENT_PATH_WARM_UP))
    // The sessions hear of the stop first, before the warm-up is stopped or any layer closes: a
    // signal that reaches the daemon's group (a terminal's Ctrl-C) can kill a worker being
    // spawned too (between its fork and its own process group), and its exit, taken in before
    // the stop, was a crash restored (a `recovering` status) during a graceful stop (chaos seed
    // 4343: 240 ms after a start, the warm-up's own stop still under way). Only begun here (its
    // first step is synchronous): the server's close waits for it, bounded, as on `shutdown`.
    yield* Effect.addFinalizer(() => Effect.asVoid(Effect.forkDaemon(manager.settleForShutdown)))
    yield* Deferred.await(server.shutdownRequested)
    yield* Effect.logInfo("shutdown requested")
  }).pipe(Effect.scoped, Effect.provide(DaemonLive(config, layers)))

/** The echo turns the daemon runs through its event path at start (see warmUpDaemon). */
const EVENT_PATH_WARM_UP = { turns: 2, words: 10_000 }
