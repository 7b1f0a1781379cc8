/**
 * `agentd serve` in the foreground: the daemon (all its layers) until SIGINT, SIGTERM or a
 * `shutdown`, its log on stderr. A separate module, loaded only by `serve`.
 */
import * as NodeRuntime from "@effect/platform-node/NodeRuntime"
import * as ConfigError from "effect/ConfigError"
import * as Effect from "effect/Effect"
import * as Logger from "effect/Logger"
import * as LogLevel from "effect/LogLevel"
import * as fs from "node:fs"
import * as Daemon from "../Daemon.js"
import { capYoungGeneration, DAEMON_SEMI_SPACE_MIB } from "../internal/youngGeneration.js"
import { describeConfigError } from "../DaemonConfig.js"
import type { ServeOptions } from "./main.js"

const levels: Record<string, LogLevel.LogLevel> = {
  debug: LogLevel.Debug,
  info: LogLevel.Info,
  warning: LogLevel.Warning,
  error: LogLevel.Error,
  none: LogLevel.None
}

/**
 * Runs the daemon; the process exits when it stops (0 after a graceful stop). `workerEntry`
 * is the worker program's file (default: worker.js next to the running bin); `layers`, the
 * daemon's parts an embedder replaces (its engines, which its `workerEntry` loads too).
 */
export const serve = (options: ServeOptions & { readonly workerEntry: string }, layers: Daemon.DaemonLayers = {}): void => {
  ioThreads()
  capYoungGeneration(DAEMON_SEMI_SPACE_MIB)
  holdSecondSignals()
  runDaemon(options, layers)
}

/** libuv's thread pool for the daemon, unless UV_THREADPOOL_SIZE says otherwise (see {@link ioThreads}). */
export const DAEMON_IO_THREADS = 64

/**
 * Sizes libuv's thread pool, which runs every fdatasync of the event log (one per session's
 * group commit: an event goes to clients once it is durable). With libuv's default of 4
 * threads, 200 sessions streaming 50 events/s each queued their syncs 4 at a time: a sync takes
 * a few ms on a plain disk, so an event waited ~150 ms for its turn (p50), though the kernel
 * commits concurrent fdatasyncs of many files in one journal commit. With 64 in flight they
 * share commits: append -> durable p50 141 -> 7.5 ms, p99 352 -> 85 ms (200 files, one append
 * every 20 ms each, 2-core machine at load 11-22). Set before the pool's first use (it is
 * created then, at its size of that moment): here, before any layer runs, when the process
 * was started from the package's bin (agentd.cjs, CommonJS). Started from an ES module
 * (dist/src/bin/agentd.js), Node's module loader has made the pool already, at libuv's size
 * (4, or UV_THREADPOOL_SIZE given to the process); an embedder sets UV_THREADPOOL_SIZE itself.
 */
const ioThreads = (): void => {
  if (process.env["UV_THREADPOOL_SIZE"] !== undefined) return
  process.env["UV_THREADPOOL_SIZE"] = String(DAEMON_IO_THREADS)
  // The first piece of pool work creates the pool, reading the variable there and then; the
  // workers, which inherit the daemon's environment, keep libuv's default.
  fs.stat(".", () => {})
  delete process.env["UV_THREADPOOL_SIZE"]
}

/**
 * The runtime below listens for the first SIGINT or SIGTERM only, and starts the graceful stop;
 * a second one (Ctrl-C pressed twice) would then kill the process by the signal, skipping the
 * rest of the stop (the clients' grace period, the workers). This listener stays: a later
 * signal is only noted, and the stop, bounded by its grace period, ends with exit 0.
 */
const holdSecondSignals = (): void => {
  let received = 0
  const note = (signal: NodeJS.Signals) => {
    if (++received > 1) process.stderr.write(`agentd: ${signal} again: the daemon is already stopping\n`)
  }
  process.on("SIGINT", note)
  process.on("SIGTERM", note)
}

const runDaemon = (options: ServeOptions & { readonly workerEntry: string }, layers: Daemon.DaemonLayers): void =>
  Daemon.serve({
    stateDir: options.stateDir,
    socketPath: options.socketPath,
    workerEntry: options.workerEntry,
    ...(options.engine === undefined ? {} : { engine: options.engine }),
    ...(options.maxWorkers === undefined ? {} : { maxWorkers: options.maxWorkers }),
    ...(options.sessionsPerWorker === undefined ? {} : { sessionsPerWorker: options.sessionsPerWorker }),
    ...(options.shutdownGraceMs === undefined ? {} : { shutdownGraceMs: options.shutdownGraceMs }),
    ...(options.store === undefined ? {} : { store: options.store }),
    ...(options.http === undefined ? {} : { http: options.http }),
    ...(options.httpInsecure === true ? { httpInsecure: true } : {}),
    ...(options.cluster === true ? { cluster: true } : {}),
    ...(options.runnerAddress === undefined ? {} : { runnerAddress: options.runnerAddress })
  }, layers).pipe(
    // The daemon logs to stderr; stdout stays free.
    Effect.provide(Logger.replace(Logger.defaultLogger, Logger.prettyLogger({ stderr: true, colors: false }))),
    Logger.withMinimumLogLevel(levels[options.logLevel ?? "info"] ?? LogLevel.Info),
    Effect.catchAll((error) =>
      Effect.sync(() => {
        const message = ConfigError.isConfigError(error) ? `invalid setting: ${describeConfigError(error)}` : error.message
        process.stderr.write(`agentd: ${message}\n`)
        // `--engine` naming an engine that does not exist is a usage error.
        process.exitCode = error._tag === "EngineError" || error._tag === "InvalidStore" || error._tag === "ClusterNeedsPostgres" ? 2 : 1
      })
    ),
    NodeRuntime.runMain({ disableErrorReporting: false, disablePrettyLogger: true })
  )
