/**
 * Spawns and watches worker processes (docs/protocol.md section 6).
 *
 * A worker is a real child process running `bin/worker.js`, talking JSON lines on a private
 * pipe (fd 3); its stdout and stderr are copied to the daemon log prefixed with the session id.
 * The pool keeps one warm spare already started, so a restore does not wait for Node's and the
 * modules' start-up. An exit the supervisor did not ask for becomes a {@link WorkerCrashed}.
 *
 * The spawn goes through `node:child_process` rather than @effect/platform's Command: Command
 * gives no extra fds and reports a signal only inside an error message (measured on Effect 3).
 */
import * as Context from "effect/Context"
import * as Data from "effect/Data"
import * as Clock from "effect/Clock"
import * as Deferred from "effect/Deferred"
import * as Duration from "effect/Duration"
import * as Effect from "effect/Effect"
import * as Exit from "effect/Exit"
import * as FiberId from "effect/FiberId"
import * as FiberSet from "effect/FiberSet"
import * as Layer from "effect/Layer"
import * as Option from "effect/Option"
import * as Schedule from "effect/Schedule"
import * as ScheduleDecision from "effect/ScheduleDecision"
import * as ScheduleInterval from "effect/ScheduleInterval"
import * as ScheduleIntervals from "effect/ScheduleIntervals"
import * as Schema from "effect/Schema"
import type * as Scope from "effect/Scope"
import { type ChildProcess, spawn } from "node:child_process"
import { chmodSync, existsSync, mkdirSync, mkdtempSync, readdirSync, rmSync, statSync, writeFileSync } from "./internal/fileIoSync.js"
import * as net from "node:net"
import * as os from "node:os"
import * as path from "node:path"
import { fileURLToPath } from "node:url"
import * as Metrics from "./Metrics.js"
import type { Engine } from "./Engine.js"
import { LineDecoder } from "./JsonLines.js"
import { FrameInbox } from "./internal/frameInbox.js"
import { deadDaemonDirs, probeSocket } from "./internal/liveness.js"
import * as Worker from "./Worker.js"
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

/**
 * A started worker as the supervisor sees it, whether a child process ({@link WorkerProcess})
 * or a fiber of this process ({@link layerInProcess}).
 */
export interface WorkerHandle {
  /**
   * The worker's process id; for an in-process worker ({@link layerInProcess}) a number of its
   * own from 10,000,000 up, which names no process: never signal it.
   */
  readonly pid: number
  /** Completes when the worker has exited. */
  readonly exited: Deferred.Deferred<WorkerExit>
  /** The session this worker serves (set when it is assigned). */
  activeSessionId: string | undefined
  /** True once the supervisor asked it to stop: its exit is then not a crash. */
  readonly stopping: boolean
  /**
   * The next frames received and not yet taken (those of about TAKE_BYTES of the pipe),
   * waiting for at least one; an empty array means the link closed (the worker is gone or
   * going). Event frames come as {@link WorkerProtocol.EventFrame} (the supervisor treats agent
   * events as opaque JSON, the bytes they came in); other frames as JSON values, trusted as
   * WorkerProtocol frames.
   */
  readonly takeFrames: Effect.Effect<Array<WorkerProtocol.ReceivedFrame>>
  /**
   * Optional, `takeFrames` outside any fiber: the frames here now, an empty array once the link
   * closed, or undefined while none is here (then {@link whenFrames}).
   */
  readonly framesNow?: () => Array<WorkerProtocol.ReceivedFrame> | undefined
  /** With `framesNow`: calls `wake` once when frames may be here; returns a function that forgets it. */
  readonly whenFrames?: (wake: () => void) => () => void
  /** Sends one frame; waits while the link is full. */
  readonly send: (frame: WorkerProtocol.SupervisorFrame) => Effect.Effect<void>
  /**
   * Sends bytes of JSON lines as they are (a restore's messages as the store holds them); the
   * bytes of one call need not end with a whole line, those of the next go on with it. Waits
   * while the link holds more than RAW_HIGH_WATER_BYTES not yet taken.
   */
  readonly sendRaw: (data: string | Uint8Array) => Effect.Effect<void>
  /** Asks the worker to exit, and waits until it has (forcing it after `graceMs`). */
  readonly stop: (graceMs?: number) => Effect.Effect<WorkerExit>
  /** Kills the worker at once, as SIGKILL would: its exit is a crash. */
  readonly kill: () => void
}

/** A worker that has not said `worker_ready` by then is given up (and stopped): a failed spawn. */
const READY_TIMEOUT_MS = 30_000

/** Bytes written to a worker and not yet taken by its pipe past which a sender waits. */
const RAW_HIGH_WATER_BYTES = 4 * 1024 * 1024

/** The supervisor's end of a link to a worker: frames in (decoded when taken), frames and raw lines out. */
abstract class WorkerLink {
  private readonly inbox: FrameInbox

  constructor(readonly pipe: net.Socket, warn: (message: string) => void) {
    this.inbox = new FrameInbox((message) => warn(`worker ${this.pid}: ${message}`), {
      pause: () => pipe.pause(),
      resume: () => {
        if (pipe.isPaused()) pipe.resume()
      }
    })
    pipe.on("data", (chunk: Buffer) => this.inbox.push(chunk))
    const end = () => this.inbox.end()
    pipe.on("end", end)
    pipe.on("close", end)
    pipe.on("error", end)
  }

  abstract get pid(): number

  get takeFrames(): Effect.Effect<Array<WorkerProtocol.ReceivedFrame>> {
    return this.inbox.take
  }

  framesNow(): Array<WorkerProtocol.ReceivedFrame> | undefined {
    return this.inbox.takeNow()
  }

  whenFrames(wake: () => void): () => void {
    return this.inbox.whenReady(wake)
  }

  send(frame: WorkerProtocol.SupervisorFrame): Effect.Effect<void> {
    return this.sendRaw(WorkerProtocol.encodeFrame(frame))
  }

  sendRaw(data: string | Uint8Array): Effect.Effect<void> {
    return Effect.async<void>((resume) => {
      if (this.pipe.destroyed || !this.pipe.writable) return resume(Effect.void)
      // Some bytes may wait in the process (the next read of a restore goes on meanwhile, and
      // the pipe never runs dry between two writes), not without bound.
      if (this.pipe.write(data) || this.pipe.writableLength < RAW_HIGH_WATER_BYTES) return resume(Effect.void)
      const done = () => {
        this.pipe.off("drain", done)
        this.pipe.off("close", done)
        resume(Effect.void)
      }
      this.pipe.on("drain", done)
      this.pipe.on("close", done)
    })
  }
}

/** A worker child process, on a private pipe (its fd 3). */
export class WorkerProcess extends WorkerLink implements WorkerHandle {
  readonly exited: Deferred.Deferred<WorkerExit>
  activeSessionId: string | undefined
  stopping = false

  constructor(
    readonly child: ChildProcess,
    pipe: net.Socket,
    exited: Deferred.Deferred<WorkerExit>,
    /** Logs through the daemon's logger. */
    warn: (message: string) => void = () => {}
  ) {
    super(pipe, warn)
    this.exited = exited
  }

  get pid(): number {
    return this.child.pid ?? -1
  }

  /** Whether the process has exited (its `exit` event may still be on its way to `exited`). */
  get gone(): boolean {
    return this.child.exitCode !== null || this.child.signalCode !== null
  }

  kill(): void {
    this.child.kill("SIGKILL")
  }

  /** `stop`: the pipe's end and SIGTERM, then SIGKILL after `graceMs`. */
  stop(graceMs = 2000): Effect.Effect<WorkerExit> {
    return Effect.suspend(() => {
      this.stopping = true
      if (this.child.exitCode === null && this.child.signalCode === null) {
        this.pipe.end()
        this.child.kill("SIGTERM")
        // A timer, not an Effect timeout: stops run in finalizers (the pool's, a session's),
        // which are uninterruptible, and a timeout there cannot cut the wait for the exit, so
        // its SIGKILL never came. A stopped (SIGSTOP) or wedged worker then never exited and
        // the daemon's stop hung. The timer fires however this stop is waited for, or not.
        const fallback = setTimeout(() => {
          if (this.child.exitCode === null && this.child.signalCode === null) this.child.kill("SIGKILL")
        }, graceMs)
        // Unref'd: the child's own handle keeps the loop alive while it runs.
        fallback.unref()
        this.child.once("exit", () => clearTimeout(fallback))
      }
      return Deferred.await(this.exited)
    })
  }
}

/**
 * How long a hosted session's connection may be closed before its host's exit is known, for the
 * session to end with the host's exit (a crash of the host) rather than as a session of its own.
 */
const HOST_EXIT_WAIT_MS = 1000

/**
 * A session in a worker host (`sessionsPerWorker` > 1): its own connection to a process that runs
 * several. Its pid is the host's; it ends when its connection closes: asked to (`stop`), killed
 * (`kill`: its connection cut, as SIGKILL would cut a worker's pipe), or with the host, whose exit
 * (a crash: code, signal) is then its own.
 */
export class HostedWorker extends WorkerLink implements WorkerHandle {
  readonly exited = Deferred.unsafeMake<WorkerExit>(FiberId.none)
  activeSessionId: string | undefined
  stopping = false
  /** Set by `kill` (its end is a crash, as a worker's SIGKILL is). */
  killed = false

  constructor(readonly host: WorkerProcess, pipe: net.Socket, warn: (message: string) => void) {
    super(pipe, warn)
    pipe.once("close", () => this.closed())
  }

  get pid(): number {
    return this.host.pid
  }

  private closed(): void {
    const done = (exit: WorkerExit) => Deferred.unsafeDone(this.exited, Exit.succeed(exit))
    if (this.stopping) return done({ code: 0, signal: null })
    if (this.killed) return done({ code: null, signal: "SIGKILL" })
    // Not asked to end: the host is dying (its exit is on its way), or the session's program
    // in it ended by itself, a crash of that session alone. (Through the host's `exited`, not a
    // listener on its process per session: a host of 20 that crashed added 20.)
    Effect.runFork(
      Deferred.await(this.host.exited).pipe(
        Effect.timeoutTo({
          duration: HOST_EXIT_WAIT_MS,
          onSuccess: (exit): WorkerExit => exit,
          onTimeout: (): WorkerExit => ({ code: 1, signal: null })
        }),
        Effect.map(done)
      )
    )
  }

  kill(): void {
    this.killed = true
    this.pipe.destroy()
  }

  /** `stop`: the connection's end (the host ends the session's program), cut after `graceMs`. */
  stop(graceMs = 2000): Effect.Effect<WorkerExit> {
    return Effect.suspend(() => {
      this.stopping = true
      if (!this.pipe.destroyed) {
        this.pipe.end()
        const fallback = setTimeout(() => this.pipe.destroy(), graceMs)
        fallback.unref()
        this.pipe.once("close", () => clearTimeout(fallback))
      }
      return Deferred.await(this.exited)
    })
  }
}

/** Options of the pool. */
export interface WorkerPoolOptions {
  /** Keep one worker started ahead of need (default true). */
  readonly warmSpare?: boolean
  /** Niceness (1-19) given to each worker and its autogroup as it starts (see `lowerPriority`); unset or 0: none. */
  readonly nice?: number
  /** The spare warms up its restore and turn paths while it waits (default true). */
  readonly warmUp?: boolean
  /** The worker entry script (default: `bin/worker.js` next to this module). */
  readonly workerEntry?: string
  /** Extra arguments for node before the entry (e.g. `--import tsx` when running from source). */
  readonly execArgv?: ReadonlyArray<string>
  /**
   * Workers booting at once, at most (default: the CPUs, at least 2); later starts wait for
   * one of them to be ready. See {@link defaultStartConcurrency}.
   */
  readonly startConcurrency?: number
  /**
   * Sessions one worker process runs at most (default 1: a process of its own per session).
   * Above 1, sessions started with no environment of their own share worker hosts
   * (Worker.ts, `runHost`), each on a connection of its own; one with an environment (`acquire`'s
   * `env`) still gets a process of its own.
   */
  readonly sessionsPerWorker?: number
}

/**
 * How many workers boot at once by default: one per CPU, at least 2. A worker's start is
 * ~0.1-0.3 s of CPU; 200 sessions created together (bench/streaming.ts) started 200 processes
 * at once on 2 cores, each then took more than the 30 s a start is given, and the failed starts
 * were retried, into more of the same (load average 146; the prompts waited over 60 s). Started
 * a few at a time, each start takes what it costs and the ready timeout measures one start, not
 * a queue.
 */
export const defaultStartConcurrency = (): number => Math.max(2, os.availableParallelism())

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
  ) => Effect.Effect<WorkerHandle, WorkerSpawnError>
  /** Every live worker (spare included). */
  readonly live: Effect.Effect<ReadonlyArray<WorkerHandle>>
  /**
   * Holds the next spare's start until the scope closes (a worker's acquisition and its
   * restore), or for SPARE_HOLD_MS at most: a process booting beside a restore slows it down.
   * Optional: a pool without spares need not have it.
   */
  readonly holdSpare?: Effect.Effect<void, never, Scope.Scope>
  /**
   * Holds the next spare's start for SPARE_HOLD_MS: a turn is starting. A new session's first
   * turn runs right after it took the spare, and the next one booting beside it (its start and
   * warm-up: ~150 ms of CPU) slowed that turn down on a 2-core machine. Optional, as holdSpare.
   */
  readonly deferSpare?: Effect.Effect<void>
  /**
   * A fence: entering it SIGKILLs every worker given to a session, and every acquisition waits
   * until the scope closes (a worker that was starting meanwhile is not handed over). A cluster
   * runner's self-fence (docs/cluster.md section 5). Optional.
   */
  readonly fence?: Effect.Effect<void, never, Scope.Scope>
}>() {}

/**
 * The longest the next spare's start is held from when it was wanted, however many holds come
 * and go meanwhile (a worker wedged in its restore, or turns that never stop starting, would
 * hold it for ever).
 */
const SPARE_HOLD_MS = 2_000

/**
 * `bin/worker.js` next to this module; when this module is bundled into the CLI
 * (`dist/src/bin/agentd.js`, scripts/bundle.mjs), the worker bundle is right next to it.
 */
const defaultEntry = () => {
  const compiled = fileURLToPath(new URL("./bin/worker.js", import.meta.url))
  return existsSync(compiled) ? compiled : fileURLToPath(new URL("./worker.js", import.meta.url))
}

/**
 * Node's own flags for every worker (`AGENTD_WORKER_NODE_ARGS`, space-separated, e.g.
 * `--cpu-prof --cpu-prof-dir=/tmp/p` to profile them: Node refuses `--cpu-prof` in NODE_OPTIONS).
 */
const workerNodeArgs = (): ReadonlyArray<string> =>
  (process.env["AGENTD_WORKER_NODE_ARGS"] ?? "").split(" ").filter((arg) => arg.length > 0)

/**
 * V8's flags for every worker, before any of the above (which can turn one off: `--opt`): a
 * worker trades JIT compilers it does not need for memory. A worker's JavaScript is glue
 * between an engine and a pipe (the heavy work, JSON and buffers, is in V8's and Node's
 * builtins), and with 200 sessions the workers' memory is what runs out. Measured with
 * bench/workerMemory.ts and bench/hotPath.ts on the 2-core machine: an idle echo worker's RSS
 * went from 65 MB to 49 MB (a bare `node`: 39 MB), its CPU per event in a burst stayed within
 * the noise (9 us). `--lite-mode` saves a little more but implies `--jitless`, which removes
 * WebAssembly, and with it `fetch` (undici parses HTTP in WebAssembly): the model engines' HTTP.
 * `--expose-gc` lets an idle worker collect its garbage (Worker.ts, `IdleCollector`), which
 * makes V8's memory reducer redundant: `--no-memory-reducer` cut a paced echo worker's CPU per
 * token by 10-17% (its full GCs ran during turns), idle RSS unchanged (bench/workerMemory.ts).
 * `--single-threaded-gc`: the GC's helper threads left memory of their own resident after the
 * idle compaction (glibc's heaps: 1 worker in 3 kept 1.8 MB more, and some 7 MB more), idle
 * echo worker 48.1-49.9 -> 47.1 MB in 4 runs of 4, spread 0.1 MB; a burst's worker CPU per
 * event the same (hotPath, 3 runs each alternating, load 7-11: 6.2-7.2 us without, 6.0-6.8 with).
 */
export const LEAN_WORKER_FLAGS: ReadonlyArray<string> = [
  "--no-opt",
  "--no-sparkplug",
  "--optimize-for-size",
  "--expose-gc",
  "--no-memory-reducer",
  "--single-threaded-gc"
]

/**
 * Lowers a new worker's priority to `nice`: the process's own niceness (inherited by what it
 * runs) and, on Linux with autogroups, its scheduling group's. A worker has a session of its
 * own (`detached`), so it is alone in its autogroup, and the kernel shares the CPU between
 * autogroups first: with 200 busy workers the daemon's group, fsync threads included, had a
 * 200th of it, and the log's appends took seconds (bench/streaming.ts). Raising niceness needs
 * no privilege; a failure is logged and the worker runs as it is.
 */
const lowerPriority = (pid: number, nice: number, warn: (message: string) => void) => {
  try {
    os.setPriority(pid, nice)
  } catch (e) {
    warn(`worker ${pid}: cannot set its niceness to ${nice}: ${String(e)}`)
  }
  try {
    writeFileSync(`/proc/${pid}/autogroup`, String(nice))
  } catch (e) {
    // No autogroups here (another OS, a kernel without them): the niceness above is what counts.
    if ((e as NodeJS.ErrnoException).code !== "ENOENT") warn(`worker ${pid}: cannot set its autogroup's niceness to ${nice}: ${String(e)}`)
  }
}

/** Waits for the first frame of a new worker (`worker_ready`), or its death. */
const awaitReady = <W extends WorkerHandle>(worker: W): Effect.Effect<W, WorkerSpawnError> =>
  Effect.gen(function*() {
    const frames = yield* worker.takeFrames.pipe(
      Effect.timeoutFail({
        duration: Duration.millis(READY_TIMEOUT_MS),
        onTimeout: () => new WorkerSpawnError({ message: `worker ${worker.pid} did not start within ${READY_TIMEOUT_MS} ms` })
      }),
      Effect.tapError(() => worker.stop(500))
    )
    const first = frames[0] as { type?: string } | undefined
    if (first?.type !== "worker_ready") {
      yield* worker.stop(500)
      return yield* new WorkerSpawnError({ message: `worker ${worker.pid} did not start (${JSON.stringify(first)})` })
    }
    return worker
  })

/**
 * Starts a worker and waits for it to be ready. Interruptible while it waits: a caller that
 * gives up (its session was killed) stops the worker rather than leave it running.
 */
const startAndAwaitReady = <W extends WorkerHandle, E>(start: Effect.Effect<W, E>): Effect.Effect<W, E | WorkerSpawnError> =>
  Effect.uninterruptibleMask((restore) =>
    Effect.flatMap(start, (worker) => restore(awaitReady(worker)).pipe(Effect.onInterrupt(() => worker.stop(500))))
  )

const HOST_DIR_PREFIX = "agentd-hosts-"

/** The socket the pool listens on in its host directory while it lives: how a directory is known to be in use. */
const HOST_DIR_MARKER = "daemon.sock"

/**
 * The private directory (0700) of this daemon's worker hosts' sockets, in the temp dir: a state
 * dir's path may be too long for a Unix socket's. Named after the daemon's pid, and marked as in
 * use by a socket the pool listens on (see {@link removeStaleHostDirs}); `close` removes both.
 */
const makeHostDir = (): { readonly dir: string; readonly close: () => void } => {
  const dir = mkdtempSync(path.join(os.tmpdir(), `${HOST_DIR_PREFIX}${process.pid}-`))
  const marker = net.createServer((socket) => socket.destroy())
  marker.on("error", () => {})
  marker.listen(path.join(dir, HOST_DIR_MARKER), () => chmodSync(path.join(dir, HOST_DIR_MARKER), 0o600))
  marker.unref()
  return {
    dir,
    close: () => {
      marker.close()
      rmSync(dir, { recursive: true, force: true })
    }
  }
}

/** How old a host directory without its marker must be to be taken for a dead daemon's (not one being made). */
const UNMARKED_DIR_AGE_MS = 60_000

/**
 * Removes the host directories of daemons that are gone (SIGKILLed: no pool finalizer removed
 * them). Gone means: its pid runs no process here, and its marker socket does not answer (or is
 * missing from a directory a minute old). A daemon in another pid namespace sharing this /tmp
 * has a pid that may run nothing here; its marker answers (a silent one is taken as alive).
 */
const removeStaleHostDirs = async (): Promise<void> => {
  for (const dir of deadDaemonDirs(HOST_DIR_PREFIX)) {
    try {
      const marked = readdirSync(dir).includes(HOST_DIR_MARKER)
      const inUse = marked
        ? (await probeSocket(path.join(dir, HOST_DIR_MARKER))) !== "refused"
        : Date.now() - statSync(dir).mtimeMs < UNMARKED_DIR_AGE_MS
      if (!inUse) rmSync(dir, { recursive: true, force: true })
    } catch {
      // Best effort: a leftover directory holds no session data, only dead sockets.
    }
  }
}

/** A worker host of the pool and the sessions it runs. */
interface Host {
  readonly control: WorkerProcess
  readonly socketPath: string
  readonly sessions: Set<HostedWorker>
  /** Sessions on their way in (connecting). */
  reserved: number
  /** It could not be reached: it takes no more sessions, and is stopped once it has none. */
  unreachable: boolean
}

/** Builds the pool; every worker is stopped when the scope closes. */
export const make = (options: WorkerPoolOptions = {}) =>
  Effect.gen(function*() {
    const entry = options.workerEntry ?? defaultEntry()
    const execArgv = [...LEAN_WORKER_FLAGS, ...(options.execArgv ?? workerNodeArgs())]
    const workers = new Set<WorkerProcess>()
    const starts = Effect.unsafeMakeSemaphore(Math.max(1, options.startConcurrency ?? defaultStartConcurrency()))
    /**
     * Spawns a worker and waits until it is ready, once one of the `starts` permits is free. The
     * worker gets the daemon's environment of now, when it is asked for, not of when it spawns.
     */
    const startLimited = (env: Readonly<Record<string, string>> | undefined, spare = false, hostPath?: string) => {
      const now: Record<string, string> = {}
      for (const [key, value] of Object.entries(process.env)) if (value !== undefined) now[key] = value
      return starts.withPermits(1)(startAndAwaitReady(spawnWorker(env === undefined ? now : Object.assign(now, env), spare, hostPath)))
    }
    /** Sessions whose worker crashed: their next worker counts as a restart (metrics). */
    const crashed = new Set<string>()
    let spare: Effect.Effect<WorkerProcess, WorkerSpawnError> | undefined
    let closing = false
    // Callbacks of node's child processes log and fork in the pool's fibers (the daemon's
    // runtime: its logger), supervised by the pool's scope.
    const spareFibers = yield* FiberSet.make()
    const runSpare = yield* FiberSet.runtime(spareFibers)<never>()
    const warn = (message: string) => {
      runSpare(Effect.logWarning(message))
    }

    const copyOutput = (worker: WorkerProcess, stream: NodeJS.ReadableStream | null, label: string, role: string) => {
      if (stream === null) return
      const decoder = new LineDecoder()
      stream.on("data", (chunk: Buffer) => {
        for (const line of decoder.push(chunk)) {
          if (typeof line === "string") {
            process.stderr.write(`[worker ${worker.pid} ${worker.activeSessionId ?? role} ${label}] ${line}\n`)
          }
        }
      })
    }

    /** A spare also warms up its restore path while it waits (see `Worker.warmUpRestore`). */
    const spawnWorker = (env: Readonly<Record<string, string>> | undefined, spare = false, hostPath?: string) =>
      Effect.gen(function*() {
        if (closing) return yield* new WorkerSpawnError({ message: "the daemon is stopping" })
        const exited = yield* Deferred.make<WorkerExit>()
        const child = yield* Effect.try({
          try: () =>
            spawn(process.execPath, [
              ...execArgv,
              entry,
              // A host warms up as a spare does: it is one until its first session comes.
              ...((spare || hostPath !== undefined) && options.warmUp !== false ? [WorkerProtocol.WARM_UP_FLAG] : []),
              ...(hostPath === undefined ? [] : [`${WorkerProtocol.HOST_FLAG}${hostPath}`])
            ], {
              stdio: ["ignore", "pipe", "pipe", "pipe"],
              env: env === undefined ? process.env : { ...process.env, ...env },
              // A process group (and session) of its own: a terminal's Ctrl-C, sent to the
              // foreground group, reaches only the daemon, which stops its workers itself (a
              // graceful stop); a worker dead of that signal would be recorded as a crash.
              detached: true
            }),
          catch: (e) => new WorkerSpawnError({ message: `cannot spawn a worker: ${String(e)}` })
        })
        // A spawn that fails at run time (EMFILE, EAGAIN...) says so with an 'error' event (and
        // leaves no stdio): heard at once, else it is thrown as unhandled and takes the daemon down.
        child.on("error", (err) => {
          if (child.pid === undefined) warn(`cannot spawn a worker: ${err.message}`)
        })
        const pipe = child.stdio?.[3] as net.Socket | null | undefined
        if (child.pid !== undefined && options.nice !== undefined && options.nice > 0) lowerPriority(child.pid, options.nice, warn)
        if (child.pid === undefined) {
          // Never `child.kill()` here: until the 'error' event is emitted, node still holds the
          // failed spawn's handle, whose pid is 0, and kill(0, SIGKILL) kills the daemon's own
          // process group (the daemon itself, silently).
          return yield* new WorkerSpawnError({ message: "cannot spawn a worker: no process was started" })
        }
        if (pipe === null || pipe === undefined) {
          child.kill("SIGKILL")
          return yield* new WorkerSpawnError({ message: "cannot spawn a worker: no pipe to it" })
        }
        const worker = new WorkerProcess(child, pipe, exited, warn)
        workers.add(worker)
        Metrics.count(Metrics.workerStarts)
        Metrics.gaugeBy(Metrics.liveWorkers, 1)
        // Neither the child nor its pipes keep the daemon's event loop alive: the daemon lives as
        // long as its runtime does, and stops its workers itself; a worker exits when its pipe
        // closes, so it never outlives the daemon, however the daemon ends.
        child.unref()
        for (const stream of [child.stdout, child.stderr, pipe]) (stream as net.Socket | null)?.unref()
        child.on("exit", (code, signal) => {
          workers.delete(worker)
          Metrics.gaugeBy(Metrics.liveWorkers, -1)
          // Not asked to stop: a crash. Its session's next worker is a restart.
          if (!worker.stopping && !closing) {
            Metrics.count(Metrics.workerCrashes)
            if (worker.activeSessionId !== undefined) crashed.add(worker.activeSessionId)
          }
          pipe.destroy()
          Deferred.unsafeDone(exited, Effect.succeed({ code, signal }))
        })
        child.on("error", (err) => warn(`worker ${worker.pid}: ${err.message}`))
        const role = hostPath === undefined ? "spare" : "host"
        copyOutput(worker, child.stdout, "out", role)
        copyOutput(worker, child.stderr, "err", role)
        return worker
      })

    // Worker hosts (`sessionsPerWorker` > 1): processes running several sessions, each reached
    // on a Unix socket of its own in a private directory (0700, removed when the pool closes).
    const perWorker = Math.max(1, Math.floor(options.sessionsPerWorker ?? 1))
    const hostDirHandle = perWorker > 1 ? makeHostDir() : undefined
    const hostDir = hostDirHandle?.dir
    if (hostDir !== undefined) runSpare(Effect.promise(removeStaleHostDirs))
    const hosts = new Set<Host>()
    /** A host being started (the spare, or one a session waits for): at most one at a time. */
    let hostStarting: Effect.Effect<Host | undefined> | undefined
    let hostCount = 0
    /** A host can take a session: alive, not being stopped, not given up on, with room. */
    const hasRoom = (host: Host) =>
      hosts.has(host) && !host.unreachable && !host.control.gone && !host.control.stopping &&
      host.sessions.size + host.reserved < perWorker
    /** The fullest host with room: sessions packed into as few processes as they need. */
    const hostWithRoom = (): Host | undefined => {
      let best: Host | undefined
      for (const host of hosts) {
        if (hasRoom(host) && (best === undefined || host.sessions.size + host.reserved > best.sessions.size + best.reserved)) best = host
      }
      return best
    }
    /** Takes a host out of the pool (it takes no more sessions) and stops it. */
    const dropHost = (host: Host) => {
      hosts.delete(host)
      runSpare(Effect.asVoid(host.control.stop()))
    }
    /**
     * Starts a host in the pool's fibers; whoever needs it awaits `hostStarting` (undefined: it
     * failed, and was logged, or the pool is closing).
     */
    const startHost = () => {
      const socketPath = path.join(hostDir!, `h${hostCount++}.sock`)
      const outcome = Deferred.unsafeMake<Host | undefined>(FiberId.none)
      const settle = (host: Host | undefined) =>
        Effect.sync(() => {
          if (hostStarting === started) hostStarting = undefined
          Deferred.unsafeDone(outcome, Exit.succeed(host))
        })
      const started = Deferred.await(outcome)
      hostStarting = started
      runSpare(Effect.suspend(() => {
        // Made again if it went away (its socket dir is the pool's own, but /tmp is cleaned by others).
        mkdirSync(hostDir!, { recursive: true, mode: 0o700 })
        return startLimited(undefined, false, socketPath)
      }).pipe(
        Effect.map((control) => {
          const host: Host = { control, socketPath, sessions: new Set(), reserved: 0, unreachable: false }
          hosts.add(host)
          control.child.once("exit", () => {
            hosts.delete(host)
            rmSync(socketPath, { force: true })
          })
          return host
        }),
        Effect.tapError((e) => Effect.logWarning(e.message)),
        Effect.option,
        Effect.flatMap((host) => settle(Option.getOrUndefined(host))),
        // Interrupted (the pool closing): nobody waits for ever.
        Effect.onInterrupt(() => settle(undefined))
      ))
      return started
    }
    /** A host that has no session left is stopped, unless it is the only room for the next one. */
    const retireIfEmpty = (host: Host) => {
      if (closing || !hosts.has(host) || host.sessions.size > 0 || host.reserved > 0 || host.control.gone) return
      if (host.unreachable) return dropHost(host)
      for (const other of hosts) {
        if (other !== host && hasRoom(other)) return dropHost(host)
      }
    }
    const connectTo = (host: Host) =>
      Effect.async<net.Socket, WorkerSpawnError>((resume) => {
        const socket = net.createConnection(host.socketPath)
        const failed = (err: Error) => resume(Effect.fail(new WorkerSpawnError({ message: `cannot reach worker host ${host.control.pid}: ${err.message}` })))
        socket.once("error", failed)
        socket.once("connect", () => {
          socket.off("error", failed)
          // Like a worker's pipe, a session's connection does not keep the daemon alive.
          socket.unref()
          resume(Effect.succeed(socket))
        })
        // Given up while it connects: nobody owns the connection.
        return Effect.sync(() => socket.destroy())
      })
    /** A session's connection to `host`, registered with it; only the connecting is interruptible. */
    const joinHost = (host: Host) =>
      Effect.uninterruptibleMask((restore) =>
        Effect.suspend(() => {
          host.reserved++
          return restore(connectTo(host)).pipe(
            Effect.ensuring(Effect.sync(() => host.reserved--)),
            Effect.map((socket) => {
              const worker = new HostedWorker(host.control, socket, warn)
              host.sessions.add(worker)
              worker.pipe.once("close", () => {
                // Its `exited` completes with the host's exit when the host died.
                Deferred.await(worker.exited).pipe(
                  Effect.map(() => {
                    host.sessions.delete(worker)
                    // The session's next worker counts as a restart unless it was asked to end.
                    if (!worker.stopping && !closing && worker.activeSessionId !== undefined) {
                      crashed.add(worker.activeSessionId)
                    }
                    retireIfEmpty(host)
                  }),
                  runSpare
                )
              })
              return worker
            }),
            Effect.tapError((e) =>
              Effect.sync(() => {
                // A host that cannot be reached (dying, its socket gone) takes no more sessions;
                // those it runs go on, and it is stopped once they are gone.
                if (host.unreachable) return
                host.unreachable = true
                warn(`${e.message}: it takes no more sessions`)
                retireIfEmpty(host)
              })
            )
          )
        })
      )
    /** A session's place in a host with room; a new host when none has any, or the chosen one cannot be reached. */
    const acquireHosted: Effect.Effect<HostedWorker, WorkerSpawnError> = Effect.gen(function*() {
      for (let attempt = 0;; attempt++) {
        let host = hostWithRoom()
        while (host === undefined) {
          if (closing) return yield* new WorkerSpawnError({ message: "the daemon is stopping" })
          const started = yield* (hostStarting ?? startHost())
          if (started === undefined) return yield* new WorkerSpawnError({ message: "cannot start a worker host" })
          host = hostWithRoom()
        }
        // The next session will need a host of its own: start it ahead, as a spare.
        if (host.sessions.size + host.reserved + 1 >= perWorker) setImmediate(() => startSpare())
        const joined = yield* Effect.either(joinHost(host))
        if (joined._tag === "Right") return yield* startAndAwaitReady(Effect.succeed(joined.right))
        // That host was dropped: another (or a new one), a few times at most.
        if (attempt >= 3) return yield* Effect.fail(joined.left)
      }
    })

    /** Acquisitions (and their restores) under way, and turns starting, that hold the next spare's start. */
    let holds = 0
    /** The next spare is wanted and held: a timer starts it SPARE_HOLD_MS after it was first wanted. */
    let heldSpareTimer: ReturnType<typeof setTimeout> | undefined
    /** Starts the next spare, unless some hold holds it (`held`: the timer of a held spare, which starts it anyway). */
    const startSpare = (held = false) => {
      if (options.warmSpare === false || closing) return
      if (holds > 0 && !held) {
        if (heldSpareTimer === undefined) {
          heldSpareTimer = setTimeout(() => startSpare(true), SPARE_HOLD_MS)
          heldSpareTimer.unref()
        }
        return
      }
      if (heldSpareTimer !== undefined) {
        clearTimeout(heldSpareTimer)
        heldSpareTimer = undefined
      }
      if (perWorker > 1) {
        // A host with room is the spare.
        if (hostStarting === undefined && hostWithRoom() === undefined) startHost()
        return
      }
      // Started now: the process boots while nobody waits for it; whoever takes it waits for its outcome.
      const outcome = Deferred.unsafeMake<WorkerProcess, WorkerSpawnError>(FiberId.none)
      runSpare(Effect.flatMap(Effect.exit(startLimited(undefined, true)), (exit) => Deferred.done(outcome, exit)))
      spare = Deferred.await(outcome)
    }

    yield* Effect.addFinalizer(() =>
      Effect.suspend(() => {
        closing = true
        return Effect.forEach([...workers], (w) => w.stop(), { concurrency: "unbounded", discard: true }).pipe(
          Effect.ensuring(Effect.sync(() => {
            hostDirHandle?.close()
          }))
        )
      })
    )
    startSpare()

    /** Fences up (see `fence`): while any is, no worker is handed to a session. */
    let fences = 0
    const unfenced = Effect.unsafeMakeLatch(true)

    const acquire = (activeSessionId: string, env?: Readonly<Record<string, string>>): Effect.Effect<WorkerHandle, WorkerSpawnError> =>
      Effect.gen(function*() {
        yield* unfenced.await
        const worker = yield* acquireUnfenced(env)
        // Checked and handed over in one step: a fence coming up later kills it with the others.
        if (fences > 0) {
          yield* worker.stop(0)
          return yield* acquire(activeSessionId, env)
        }
        worker.activeSessionId = activeSessionId
        if (crashed.delete(activeSessionId)) Metrics.count(Metrics.workerRestarts)
        return worker
      })

    const acquireUnfenced = (env?: Readonly<Record<string, string>>): Effect.Effect<WorkerHandle, WorkerSpawnError> =>
      Effect.gen(function*() {
        // A session with an environment of its own gets a process of its own.
        if (perWorker > 1 && env === undefined) return yield* acquireHosted
        let worker: WorkerProcess | undefined
        if (env === undefined && spare !== undefined) {
          const taken = spare
          spare = undefined
          // Spawning is synchronous and takes milliseconds: let the caller send the taken
          // worker its `load` first (a restore waits for it), then start the next spare.
          setImmediate(() => startSpare())
          worker = yield* Effect.orElseSucceed(taken, () => undefined).pipe(
            // Given up while the spare boots (its session was killed): it is stopped once it is
            // up, before the interruption completes, so that a `kill` answers with it gone.
            Effect.onInterrupt(() => Effect.ignore(Effect.flatMap(taken, (w) => w.stop())))
          )
          // A spare that died meanwhile is no use: fall through to a fresh spawn.
          if (worker?.gone === true) worker = undefined
        }
        if (worker === undefined) worker = yield* startLimited(env)
        return worker
      })

    const fence: Effect.Effect<void, never, Scope.Scope> = Effect.acquireRelease(
      Effect.sync(() => {
        fences++
        unfenced.unsafeClose()
        for (const worker of workers) if (worker.activeSessionId !== undefined) worker.kill()
        for (const host of hosts) if (host.sessions.size > 0 || host.reserved > 0) host.control.kill()
      }),
      () =>
        Effect.sync(() => {
          fences--
          if (fences === 0) unfenced.unsafeOpen()
        })
    )

    /** Takes a hold; the release it returns may be called any number of times. */
    const hold = () => {
      holds++
      let released = false
      const release = () => {
        if (released) return
        released = true
        clearTimeout(timer)
        holds--
        if (holds === 0 && heldSpareTimer !== undefined) startSpare()
      }
      const timer = setTimeout(release, SPARE_HOLD_MS)
      timer.unref()
      return release
    }
    const holdSpare: Effect.Effect<void, never, Scope.Scope> = Effect.asVoid(Effect.acquireRelease(Effect.sync(hold), (release) => Effect.sync(release)))
    const deferSpare: Effect.Effect<void> = Effect.sync(() => void hold())

    return WorkerPool.of({
      acquire,
      live: Effect.sync(() => {
        const live: Array<WorkerHandle> = [...workers]
        for (const host of hosts) live.push(...host.sessions)
        return live
      }),
      holdSpare,
      deferSpare,
      fence
    })
  })

/** The pool as a layer; closing it stops every worker (SIGTERM, then SIGKILL). */
export const layer = (options: WorkerPoolOptions = {}): Layer.Layer<WorkerPool> => Layer.scoped(WorkerPool, make(options))

/** Options of the in-process pool. */
export interface InProcessOptions {
  /**
   * Runs before each worker starts, with what a process would be spawned with: a failure is
   * the spawn failing (for tests of spawn failures).
   */
  readonly beforeStart?: (
    activeSessionId: string,
    env: Readonly<Record<string, string>> | undefined
  ) => Effect.Effect<void, WorkerSpawnError>
}

/** Pids of in-process workers: above any real pid (Linux's pid_max is at most 2^22). */
let nextInProcessPid = 10_000_000

/**
 * A worker running as a fiber of this process, linked to the supervisor by in-memory queues
 * that carry the same JSON lines as a pipe. `kill` ends it as SIGKILL would a process.
 */
class InProcessWorker implements WorkerHandle {
  readonly pid = nextInProcessPid++
  readonly inbox = new FrameInbox(() => {}, { pause: () => {}, resume: () => {} })
  activeSessionId: string | undefined
  stopping = false
  private closed = false
  private toWorker: Array<string> = []
  /** The supervisor's bytes as lines, as the worker's end of a pipe reads them. */
  private readonly toWorkerLines = new LineDecoder(Number.MAX_SAFE_INTEGER)
  private onLine: ((line: string) => void) | undefined
  private closeLink: (() => void) | undefined

  constructor(readonly exited: Deferred.Deferred<WorkerExit>) {}

  /** The worker's end of the link. */
  readonly pipe: Worker.WorkerPipe = {
    send: (frame) => this.pipe.sendRaw(WorkerProtocol.encodeFrame(frame)),
    sendRaw: (data) => Effect.sync(() => this.pipe.write(data)),
    write: (data) => {
      if (!this.closed) this.inbox.push(typeof data === "string" ? Buffer.from(data, "utf8") : data)
      return undefined
    },
    lines: (onLine) =>
      new Promise<void>((resolve) => {
        if (this.closed) return resolve()
        this.onLine = onLine
        this.closeLink = resolve
        for (const line of this.toWorker.splice(0)) onLine(line)
      })
  }

  get takeFrames(): Effect.Effect<Array<WorkerProtocol.ReceivedFrame>> {
    return this.inbox.take
  }

  framesNow(): Array<WorkerProtocol.ReceivedFrame> | undefined {
    return this.inbox.takeNow()
  }

  whenFrames(wake: () => void): () => void {
    return this.inbox.whenReady(wake)
  }

  send(frame: WorkerProtocol.SupervisorFrame): Effect.Effect<void> {
    return this.sendRaw(WorkerProtocol.encodeFrame(frame))
  }

  sendRaw(data: string | Uint8Array): Effect.Effect<void> {
    return Effect.sync(() => {
      if (this.closed) return
      for (const line of this.toWorkerLines.push(typeof data === "string" ? Buffer.from(data, "utf8") : data)) {
        if (typeof line !== "string") continue
        if (this.onLine === undefined) this.toWorker.push(line)
        else this.onLine(line)
      }
    })
  }

  /** Whether it has exited (its fiber may still be ending: it is no live worker any more). */
  get gone(): boolean {
    return this.closed
  }

  /** The worker is gone: the link closes both ways and `exited` completes (which ends its fiber). */
  exit(how: WorkerExit): void {
    this.closed = true
    this.inbox.end()
    this.closeLink?.()
    Deferred.unsafeDone(this.exited, Effect.succeed(how))
  }

  kill(): void {
    this.exit({ code: null, signal: "SIGKILL" })
  }

  stop(): Effect.Effect<WorkerExit> {
    return Effect.suspend(() => {
      this.stopping = true
      this.exit({ code: 0, signal: null })
      return Deferred.await(this.exited)
    })
  }
}

/**
 * A pool whose workers run the worker program ({@link Worker.run}) inside this process, on the
 * engines in context (a restore is sent to them by the supervisor, as to any worker): the
 * session core can then be tested over the memory layers without spawning anything. Its workers' pids (`workerPid` in a session's summary) are
 * numbers from 10,000,000 up that name no process.
 */
export const makeInProcess = (options: InProcessOptions = {}) =>
  Effect.gen(function*() {
    const context = yield* Effect.context<Engine>()
    const fibers = yield* FiberSet.make()
    const workers = new Set<InProcessWorker>()
    yield* Effect.addFinalizer(() => Effect.sync(() => {
      for (const w of workers) w.exit({ code: 0, signal: null })
    }))
    const acquire = (activeSessionId: string, env?: Readonly<Record<string, string>>) =>
      Effect.gen(function*() {
        if (options.beforeStart !== undefined) yield* options.beforeStart(activeSessionId, env)
        const started = Effect.gen(function*() {
          const worker = new InProcessWorker(yield* Deferred.make<WorkerExit>())
          workers.add(worker)
          const program = Worker.run(worker.pipe, {
            pid: worker.pid,
            exit: Effect.sync(() => worker.exit({ code: 0, signal: null }))
          }).pipe(
            Effect.provide(context),
            Effect.matchCause({
              onFailure: () => worker.exit({ code: 1, signal: null }),
              onSuccess: () => worker.exit({ code: 0, signal: null })
            }),
            // A kill ends the program wherever it is.
            Effect.raceFirst(Deferred.await(worker.exited)),
            Effect.ensuring(Effect.sync(() => workers.delete(worker)))
          )
          // Interruptible whatever the caller's region: `kill` must end it wherever it is.
          yield* FiberSet.run(fibers, Effect.interruptible(program))
          return worker
        })
        const ready = yield* startAndAwaitReady(started)
        ready.activeSessionId = activeSessionId
        return ready as WorkerHandle
      })

    // An exited worker is not live, as a process that exited is not, even while its fiber ends
    // (its slot is free already: listed, it looked like one worker too many).
    return WorkerPool.of({ acquire, live: Effect.sync(() => [...workers].filter((w) => !w.gone)) })
  })

/** {@link makeInProcess} as a layer. */
export const layerInProcess = (
  options: InProcessOptions = {}
): Layer.Layer<WorkerPool, never, Engine> =>
  Layer.scoped(WorkerPool, makeInProcess(options))

/** Restart policy of docs/protocol.md section 6. */
export interface RestartPolicy {
  /** Crashes allowed inside the window before the session is marked failed (default 5). */
  readonly maxRestarts: number
  /** The window (default 60 s). */
  readonly restartWindowMs: number
  /** The first backoff after the immediate restart (default 100 ms), doubled each time. */
  readonly backoffBaseMs: number
}

export const defaultRestartPolicy: RestartPolicy = { maxRestarts: 5, restartWindowMs: 60_000, backoffBaseMs: 100 }

/** The delay before a session's next restart, or the end of its restarts (the session fails). */
export type RestartStep = { readonly _tag: "restart"; readonly delayMs: number; readonly crashes: number } | {
  readonly _tag: "failed"
  readonly crashes: number
}

/**
 * The restart policy as a Schedule, stepped once per crash at the Clock's time: the first crash
 * in the window restarts at once, later ones back off exponentially, and more than
 * `maxRestarts` within the window end it. Its state is the crash times still in the window;
 * its output, how many there are.
 */
export const restartSchedule = (policy: RestartPolicy): Schedule.Schedule<number, unknown> =>
  Schedule.makeWithState<ReadonlyArray<number>, unknown, number>([], (now, _crash, crashTimes) => {
    const recent = [...crashTimes.filter((t) => now - t < policy.restartWindowMs), now]
    if (recent.length > policy.maxRestarts) return Effect.succeed([recent, recent.length, ScheduleDecision.done] as const)
    const delayMs = recent.length <= 1 ? 0 : policy.backoffBaseMs * 2 ** (recent.length - 2)
    return Effect.succeed(
      [recent, recent.length, ScheduleDecision.continueWith(ScheduleInterval.after(now + delayMs))] as const
    )
  })

/**
 * Steps a restart schedule for a crash now; returns the step and the schedule's next state
 * (start from `schedule.initial`, and again after a `retry_worker`).
 */
export const stepRestart = (schedule: Schedule.Schedule<number, unknown>, state: unknown, crash: unknown) =>
  Effect.gen(function*() {
    const now = yield* Clock.currentTimeMillis
    const [next, crashes, decision] = yield* schedule.step(now, crash, state)
    const step: RestartStep = ScheduleDecision.isDone(decision)
      ? { _tag: "failed", crashes }
      : { _tag: "restart", delayMs: Math.max(0, ScheduleIntervals.start(decision.intervals) - now), crashes }
    return { step, state: next as unknown }
  })
