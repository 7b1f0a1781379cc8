/**
 * `agentd`: the daemon as a library, for Effect programs that embed it or build on its
 * services. Each module is exported as a namespace (`SessionManager.SessionManager` is the Tag,
 * `SessionManager.layer` its layer), as Effect's own packages do:
 *
 * ```ts
 * import { DaemonLive, DaemonServer } from "agentd"
 * const program = Effect.gen(function*() {
 *   const server = yield* DaemonServer.DaemonServer
 *   yield* Deferred.await(server.shutdownRequested)
 * }).pipe(Effect.provide(DaemonLive({ stateDir })))
 * ```
 *
 * A client of a running daemon imports `agentd/client` instead, which does not load these.
 */
export * as Cursor from "./Cursor.js"
export * as Daemon from "./Daemon.js"
export { CoreLive, type CoreStartError, DaemonLive, type DaemonLayers, type DaemonStartError } from "./Daemon.js"
export * as DaemonConfig from "./DaemonConfig.js"
export * as DaemonServer from "./DaemonServer.js"
export * as BuiltinEngines from "./engines/builtin.js"
export * as EchoEngine from "./engines/EchoEngine.js"
export * as ModelEngines from "./engines/ModelEngines.js"
export * as Engine from "./Engine.js"
export * as EventLog from "./EventLog.js"
export * as JsonLines from "./JsonLines.js"
export * as Metrics from "./Metrics.js"
export * as Protocol from "./Protocol.js"
export * as RecoveryJournal from "./RecoveryJournal.js"
export * as SessionManager from "./SessionManager.js"
export * as SessionStore from "./SessionStore.js"
export * as SessionTarget from "./SessionTarget.js"
export * as SnapshotCache from "./SnapshotCache.js"
export * as StateDirLock from "./StateDirLock.js"
export * as StateLayout from "./StateLayout.js"
export * as WorkerPool from "./WorkerPool.js"
export * as Worker from "./Worker.js"
