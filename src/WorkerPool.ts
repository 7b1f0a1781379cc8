/**
 * Spawns and watches worker processes (PROTOCOL.md section 6).
 *
 * A worker is a real child process running `bin/worker.js`, talking JSON lines on a private
 * pipe (fd 3); its stdout and stderr are copied to the daemon log prefixed with the session id.
 * The pool keeps one warm spare already started, so a restore does not wait for Node's and the
 * modules' start-up. An exit the supervisor did not ask for becomes a {@link WorkerCrashed}.
 *
 * The spawn goes through `node:child_process` rather than @effect/platform's Command: Command
 * gives no extra fds and reports a signal only inside an error message (DESIGN.md).
 */
import * as Context from "effect/Context"
import * as Data from "effect/Data"
import * as Deferred from "effect/Deferred"
import * as Duration from "effect/Duration"
import * as Effect from "effect/Effect"
import * as FiberSet from "effect/FiberSet"
import * as Layer from "effect/Layer"
import * as Runtime from "effect/Runtime"
import * as Schema from "effect/Schema"
import { type ChildProcess, spawn } from "node:child_process"
import * as fs from "node:fs"
import type * as net from "node:net"
import { fileURLToPath } from "node:url"
import { LineDecoder } from "./JsonLines.js"
import * as WorkerProtocol from "./WorkerProtocol.js"

/** A worker exited without being asked to: the typed failure that triggers a restore. */
export class WorkerCrashed extends Schema.TaggedError<WorkerCrashed>()("WorkerCrashed", {
  activeSessionId: Schema.String,
  pid: Schema.Int,
  exitCode: Schema.NullOr(Schema.Int),
  signal: Schema.NullOr(Schema.String)
}) {
  override get message(): string {
    return `worker ${this.pid} of session ${this.activeSessionId} exited unexpectedly (${
      this.signal ?? `code ${this.exitCode}`
    })`
  }
}

/** A worker process could not be started. */
export class WorkerSpawnError extends Data.TaggedError("WorkerSpawnError")<{ readonly message: string }> {}

/** How a worker process ended. */
export interface WorkerExit {
  readonly code: number | null
  readonly signal: string | null
}

/** Bytes of decoded-but-unconsumed frames past which the pipe stops reading (backpressure). */
const HIGH_WATER_BYTES = 4 * 1024 * 1024

/** A running worker process. */
export class WorkerProcess {
  private readonly decoder = new LineDecoder(Number.MAX_SAFE_INTEGER)
  private frames: Array<WorkerProtocol.ReceivedFrame> = []
  private queuedBytes = 0
  private ended = false
  private wake: (() => void) | undefined
  /** Completes when the process has exited. */
  readonly exited: Deferred.Deferred<WorkerExit>
  /** The session this worker serves (set when it is assigned). */
  activeSessionId: string | undefined
  /** True once the supervisor asked it to stop: its exit is then not a crash. */
  stopping = false

  constructor(
    readonly child: ChildProcess,
    readonly pipe: net.Socket,
    exited: Deferred.Deferred<WorkerExit>,
    /** Logs through the daemon's logger. */
    private readonly warn: (message: string) => void = () => {}
  ) {
    this.exited = exited
    pipe.on("data", (chunk: Buffer) => {
      for (const item of this.decoder.push(chunk)) {
        if (typeof item !== "string") continue
        try {
          this.frames.push(WorkerProtocol.readWorkerLine(item))
          this.queuedBytes += item.length
        } catch {
          this.warn(`worker ${this.pid}: unreadable frame dropped: ${item.slice(0, 200)}`)
        }
      }
      if (this.queuedBytes > HIGH_WATER_BYTES) pipe.pause()
      // A chunk inside a long line completes no frame: nothing to hand over yet.
      if (this.frames.length > 0) this.notify()
    })
    const end = () => {
      this.ended = true
      this.notify()
    }
    pipe.on("end", end)
    pipe.on("close", end)
    pipe.on("error", end)
  }

  get pid(): number {
    return this.child.pid ?? -1
  }

  private notify() {
    const wake = this.wake
    this.wake = undefined
    wake?.()
  }

  /**
   * Every frame received and not yet taken, waiting for at least one; an empty array means
   * the pipe closed (the worker is gone or going). Event frames come as
   * {@link WorkerProtocol.EventFrame} (the supervisor treats agent events as opaque JSON text);
   * other frames as JSON values, trusted as WorkerProtocol frames.
   */
  readonly takeFrames: Effect.Effect<Array<WorkerProtocol.ReceivedFrame>> = Effect.async((resume) => {
    const deliver = () => {
      const frames = this.frames
      this.frames = []
      this.queuedBytes = 0
      if (this.pipe.isPaused()) this.pipe.resume()
      resume(Effect.succeed(frames))
    }
    if (this.frames.length > 0 || this.ended) return deliver()
    this.wake = deliver
    return Effect.sync(() => {
      if (this.wake === deliver) this.wake = undefined
    })
  })

  /** Sends one frame; waits while the pipe is full. */
  send(frame: WorkerProtocol.SupervisorFrame): Effect.Effect<void> {
    return Effect.async<void>((resume) => {
      if (this.pipe.destroyed || !this.pipe.writable) return resume(Effect.void)
      if (this.pipe.write(WorkerProtocol.encodeFrame(frame))) return resume(Effect.void)
      const done = () => {
        this.pipe.off("drain", done)
        this.pipe.off("close", done)
        resume(Effect.void)
      }
      this.pipe.on("drain", done)
      this.pipe.on("close", done)
    })
  }

  /** Asks the worker to exit: `stop` frame and SIGTERM, then SIGKILL after `graceMs`. */
  stop(graceMs = 2000): Effect.Effect<WorkerExit> {
    return Effect.suspend(() => {
      this.stopping = true
      if (this.child.exitCode === null && this.child.signalCode === null) {
        this.pipe.end()
        this.child.kill("SIGTERM")
      }
      return Deferred.await(this.exited).pipe(
        Effect.timeoutTo({
          duration: Duration.millis(graceMs),
          onSuccess: Effect.succeed,
          onTimeout: () =>
            Effect.suspend(() => {
              this.child.kill("SIGKILL")
              return Deferred.await(this.exited)
            })
        }),
        Effect.flatten
      )
    })
  }
}

/** Options of the pool. */
export interface WorkerPoolOptions {
  /** Keep one worker started ahead of need (default true). */
  readonly warmSpare?: boolean
  /** The worker entry script (default: `bin/worker.js` next to this module). */
  readonly workerEntry?: string
  /** Extra arguments for node before the entry (e.g. `--import tsx` when running from source). */
  readonly execArgv?: ReadonlyArray<string>
}

/** Starts and tracks worker processes. */
export class WorkerPool extends Context.Tag("agentd/WorkerPool")<WorkerPool, {
  /**
   * A started worker for a session. With no `env`, the warm spare is taken when there is one;
   * with `env` (a session's `launchEnv`, restore variables) a new process is spawned with it
   * merged over the daemon's environment.
   */
  readonly acquire: (
    activeSessionId: string,
    env?: Readonly<Record<string, string>>
  ) => Effect.Effect<WorkerProcess, WorkerSpawnError>
  /** Every live worker process (spare included). */
  readonly live: Effect.Effect<ReadonlyArray<WorkerProcess>>
}>() {}

/**
 * `bin/worker.js` next to this module; when this module is bundled into the CLI
 * (`dist/src/bin/agentd.js`, scripts/bundle.mjs), the worker bundle is right next to it.
 */
const defaultEntry = () => {
  const compiled = fileURLToPath(new URL("./bin/worker.js", import.meta.url))
  return fs.existsSync(compiled) ? compiled : fileURLToPath(new URL("./worker.js", import.meta.url))
}

/** Waits for the first frame of a new worker (`worker_ready`), or its death. */
const awaitReady = (worker: WorkerProcess): Effect.Effect<WorkerProcess, WorkerSpawnError> =>
  Effect.gen(function*() {
    const frames = yield* worker.takeFrames
    const first = frames[0] as { type?: string } | undefined
    if (first?.type !== "worker_ready") {
      yield* worker.stop(500)
      return yield* new WorkerSpawnError({ message: `worker ${worker.pid} did not start (${JSON.stringify(first)})` })
    }
    return worker
  })

/** Builds the pool; every worker is stopped when the scope closes. */
export const make = (options: WorkerPoolOptions = {}) =>
  Effect.gen(function*() {
    const entry = options.workerEntry ?? defaultEntry()
    const execArgv = options.execArgv ?? []
    const workers = new Set<WorkerProcess>()
    let spare: Effect.Effect<WorkerProcess, WorkerSpawnError> | undefined
    let closing = false
    // Callbacks of node's child processes log and fork in the daemon's runtime.
    const runtime = yield* Effect.runtime<never>()
    const warn = (message: string) => {
      Runtime.runFork(runtime)(Effect.logWarning(message))
    }
    const spareFibers = yield* FiberSet.make()
    const runSpare = yield* FiberSet.runtime(spareFibers)<never>()

    const copyOutput = (worker: WorkerProcess, stream: NodeJS.ReadableStream | null, label: string) => {
      if (stream === null) return
      const decoder = new LineDecoder()
      stream.on("data", (chunk: Buffer) => {
        for (const line of decoder.push(chunk)) {
          if (typeof line === "string") {
            process.stderr.write(`[worker ${worker.pid} ${worker.activeSessionId ?? "spare"} ${label}] ${line}\n`)
          }
        }
      })
    }

    /** A spare also warms up its restore path while it waits (see `Worker.warmUpRestore`). */
    const spawnWorker = (env: Readonly<Record<string, string>> | undefined, spare = false) =>
      Effect.gen(function*() {
        if (closing) return yield* new WorkerSpawnError({ message: "the daemon is stopping" })
        const exited = yield* Deferred.make<WorkerExit>()
        const child = yield* Effect.try({
          try: () =>
            spawn(process.execPath, [...execArgv, entry, ...(spare ? [WorkerProtocol.WARM_UP_FLAG] : [])], {
              stdio: ["ignore", "pipe", "pipe", "pipe"],
              env: env === undefined ? process.env : { ...process.env, ...env }
            }),
          catch: (e) => new WorkerSpawnError({ message: `cannot spawn a worker: ${String(e)}` })
        })
        const pipe = child.stdio[3] as net.Socket | null
        if (pipe === null || child.pid === undefined) {
          child.kill("SIGKILL")
          return yield* new WorkerSpawnError({ message: "cannot spawn a worker: no pid or pipe" })
        }
        const worker = new WorkerProcess(child, pipe, exited, warn)
        workers.add(worker)
        child.on("exit", (code, signal) => {
          workers.delete(worker)
          pipe.destroy()
          Deferred.unsafeDone(exited, Effect.succeed({ code, signal }))
        })
        child.on("error", (err) => warn(`worker ${worker.pid}: ${err.message}`))
        copyOutput(worker, child.stdout, "out")
        copyOutput(worker, child.stderr, "err")
        return worker
      })

    const startSpare = () => {
      if (options.warmSpare === false || closing) return
      // Memoized and started now: the process boots while nobody waits for it.
      const started = Runtime.runSync(runtime)(Effect.cached(Effect.flatMap(spawnWorker(undefined, true), awaitReady)))
      runSpare(Effect.ignore(started))
      spare = started
    }

    yield* Effect.addFinalizer(() =>
      Effect.suspend(() => {
        closing = true
        return Effect.forEach([...workers], (w) => w.stop(), { concurrency: "unbounded", discard: true })
      })
    )
    startSpare()

    const acquire = (activeSessionId: string, env?: Readonly<Record<string, string>>) =>
      Effect.gen(function*() {
        let worker: WorkerProcess | undefined
        if (env === undefined && spare !== undefined) {
          const taken = spare
          spare = undefined
          // Spawning is synchronous and takes milliseconds: let the caller send the taken
          // worker its `load` first (a restore waits for it), then start the next spare.
          setImmediate(startSpare)
          worker = yield* Effect.orElseSucceed(taken, () => undefined)
          // A spare that died meanwhile is no use: fall through to a fresh spawn.
          if (worker !== undefined && (worker.child.exitCode !== null || worker.child.signalCode !== null)) {
            worker = undefined
          }
        }
        if (worker === undefined) worker = yield* Effect.flatMap(spawnWorker(env), awaitReady)
        worker.activeSessionId = activeSessionId
        return worker
      })

    return WorkerPool.of({
      acquire,
      live: Effect.sync(() => [...workers])
    })
  })

/** The pool as a layer; closing it stops every worker (SIGTERM, then SIGKILL). */
export const layer = (options: WorkerPoolOptions = {}): Layer.Layer<WorkerPool> => Layer.scoped(WorkerPool, make(options))

/** Restart policy of PROTOCOL.md section 6. */
export interface RestartPolicy {
  /** Crashes allowed inside the window before the session is marked failed (default 5). */
  readonly maxRestarts: number
  /** The window (default 60 s). */
  readonly restartWindowMs: number
  /** The first backoff after the immediate restart (default 100 ms), doubled each time. */
  readonly backoffBaseMs: number
}

export const defaultRestartPolicy: RestartPolicy = { maxRestarts: 5, restartWindowMs: 60_000, backoffBaseMs: 100 }

/**
 * What to do after a crash at `now`, given the earlier crash times of the session (kept in
 * the window by the caller): restart after `delayMs`, or give up (`failed`).
 * The first crash in the window restarts at once; later ones back off exponentially.
 */
export const nextRestart = (
  policy: RestartPolicy,
  crashTimes: ReadonlyArray<number>,
  now: number
): { readonly _tag: "restart"; readonly delayMs: number } | { readonly _tag: "failed" } => {
  const recent = crashTimes.filter((t) => now - t < policy.restartWindowMs).length
  if (recent > policy.maxRestarts) return { _tag: "failed" }
  return { _tag: "restart", delayMs: recent <= 1 ? 0 : policy.backoffBaseMs * 2 ** (recent - 2) }
}

