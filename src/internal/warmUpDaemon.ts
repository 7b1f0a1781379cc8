/**
 * The daemon's event path, run at start through its real parts on a throwaway session: the first
 * turn after a start cost the daemon two to three times the CPU per event of the third (22-28 us
 * against 6-9: bench/hotPath.ts), most of it the daemon compiling (and optimizing) the code each
 * event goes through; a warm-up on made-up data warmed only the pure part of it, and real data
 * then deoptimized some of what it had warmed.
 *
 * Here the same code runs on the same shapes of data as a real echo turn: a session of a second
 * SessionManager (its entity, `step`, the publisher), an event log of files (group commit,
 * fdatasync) in a temp dir, a worker handle of the pool's own class (`WorkerProcess`: its frame
 * inbox, the line decoder) fed real-sized chunks of worker frames over a Unix socket, and one
 * attachment on the socket server's own outbox class over another, read and dropped.
 *
 * Never visible: the manager is not the daemon's (nothing in `list`, no name taken), its files
 * are in a temp dir outside the state dir (removed at the end), its engine and worker are made
 * up (no worker process, no slot of `maxWorkers`), its storage is not wrapped by the metrics and
 * its session's deliveries are not metered (`Attachment.metered`). It gives way the moment a real session's worker sends frames
 * (`realFramesArrived`): it stops feeding its worker at its next chunk and tears down.
 *
 * What it spares and what it costs (bench/hotPath.ts, session 16): a first turn prompted right
 * after the start, ~12% of the daemon's CPU (30 us per event against 34, median of 6 runs each);
 * 0.6-0.7 s of CPU after the start. A session's first turn still costs more than a warm one
 * (28-31 us once the warm-up is done): a real session's first turn leaves the daemon warmer
 * (17.5-21 us for the next session's) in a way this one does not yet.
 */
import * as Context from "effect/Context"
import * as Deferred from "effect/Deferred"
import * as Effect from "effect/Effect"
import * as Exit from "effect/Exit"
import * as FiberId from "effect/FiberId"
import * as Layer from "effect/Layer"
import type { ChildProcess } from "node:child_process"
import { randomUUID } from "node:crypto"
import { EventEmitter } from "node:events"
import * as fs from "node:fs"
import * as net from "node:net"
import * as os from "node:os"
import * as path from "node:path"
import { DaemonConfig } from "../DaemonConfig.js"
import { Engine, registry } from "../Engine.js"
import * as EventLog from "../EventLog.js"
import { LineDecoder } from "../JsonLines.js"
import type { AgentEvent, CommandOf } from "../Protocol.js"
import * as RecoveryJournal from "../RecoveryJournal.js"
import * as SessionManagerModule from "../SessionManager.js"
import { SessionManager, SupervisorInfo } from "../SessionManager.js"
import * as SessionStore from "../SessionStore.js"
import * as SnapshotCache from "../SnapshotCache.js"
import { WorkerPool, type WorkerExit, WorkerProcess } from "../WorkerPool.js"
import * as WorkerProtocol from "../WorkerProtocol.js"
import { eventPathInUse, WARM_UP_SESSION_PREFIX } from "./delivery/warmUp.js"
import { deadDaemonDirs } from "./liveness.js"
import { Outbox } from "./outbox.js"

/** The made-up engine of the warm-up's session (its worker is made up too: no engine runs). */
const ENGINE = "agentd-warm-up"

/** Bytes of worker frames per write to the worker's pipe: what a worker's pipe delivers at a time. */
const CHUNK_BYTES = 64 * 1024

/** The longest a warm-up turn is waited for (a machine at load 30 included): then it is given up. */
const TURN_TIMEOUT = "60 seconds"

/** What a warm-up did: the turns its session ended, and the events its worker sent. */
export interface WarmUpOutcome {
  readonly turns: number
  readonly events: number
  /** The bytes its attached client was sent: a warm-up that stopped running the path sent none. */
  readonly deliveredBytes: number
}

/** The frames of one echo turn of `words` words, as a worker writes them, cut in CHUNK_BYTES chunks. */
const echoTurnChunks = (words: number): Array<Buffer> => {
  const frames: Array<AgentEvent> = []
  const add = (event: Record<string, unknown>) => frames.push(event as unknown as AgentEvent)
  const text = Array.from({ length: words }, (_, i) => `w${i}`).join(" ")
  const user = { id: "m-warm-up-user", role: "user", content: text }
  add({ type: "agent_start" })
  add({ type: "turn_start" })
  add({ type: "message_start", message: user })
  add({ type: "message_end", message: user })
  add({ type: "message_start", message: { id: "m-warm-up-echo", role: "assistant", content: "" } })
  add({ type: "message_update", messageId: "m-warm-up-echo", delta: "echo:" })
  for (let i = 0; i < words; i++) add({ type: "message_update", messageId: "m-warm-up-echo", delta: ` w${i}` })
  add({ type: "message_end", message: { id: "m-warm-up-echo", role: "assistant", content: `echo: ${text}` } })
  add({ type: "turn_end" })
  add({ type: "agent_end" })
  const all = Buffer.from(frames.map(WorkerProtocol.encodeEventFrame).join(""), "utf8")
  const chunks: Array<Buffer> = []
  // Cut anywhere, as a pipe does: lines across two chunks take the decoder's other path.
  for (let at = 0; at < all.length; at += CHUNK_BYTES) chunks.push(all.subarray(at, at + CHUNK_BYTES))
  return chunks
}

/** Two ends of one connection over a Unix socket in `dir`. */
const connectionPair = (dir: string, name: string) =>
  Effect.acquireRelease(
    Effect.async<{ readonly server: net.Server; readonly near: net.Socket; readonly far: net.Socket }, Error>((resume) => {
      const server = net.createServer()
      server.once("error", (e) => resume(Effect.fail(e)))
      server.listen(path.join(dir, name), () => {
        server.once("connection", (near) => resume(Effect.succeed({ server, near, far })))
        const far = net.createConnection(path.join(dir, name))
        far.once("error", (e) => resume(Effect.fail(e)))
      })
    }),
    ({ far, near, server }) =>
      Effect.sync(() => {
        near.destroy()
        far.destroy()
        server.close()
      })
  )

/**
 * The warm-up's worker: the daemon's end is a `WorkerProcess` over one end of a socket; on the
 * other, a `load` is answered `worker_ready` and each `prompt` with an echo turn's frames,
 * written chunk by chunk (each waiting for the pipe to take the last) while no real session
 * sends frames.
 */
const makeWorker = (pipe: { readonly near: net.Socket; readonly far: net.Socket }, chunks: ReadonlyArray<Buffer>, sent: { events: number }) => {
  const exited = Deferred.unsafeMake<WorkerExit>(FiberId.none)
  const child = new EventEmitter() as EventEmitter & { exitCode: number | null; signalCode: string | null; kill: (signal?: string) => boolean }
  child.exitCode = null
  child.signalCode = null
  child.kill = (signal) => {
    if (child.exitCode !== null || child.signalCode !== null) return false
    child.signalCode = signal ?? "SIGTERM"
    pipe.far.destroy()
    Deferred.unsafeDone(exited, Exit.succeed({ code: null, signal: child.signalCode }))
    child.emit("exit", null, child.signalCode)
    return true
  }
  const handle = new WorkerProcess(child as unknown as ChildProcess, pipe.near, exited)
  const eventsPerTurn = chunks.reduce((n, c) => n + c.reduce((k, b) => k + (b === 0x0a ? 1 : 0), 0), 0)
  const streamTurn = async () => {
    for (const chunk of chunks) {
      if (eventPathInUse() || pipe.far.destroyed) return
      if (!pipe.far.write(chunk)) await new Promise((resolve) => pipe.far.once("drain", resolve).once("close", resolve))
    }
    sent.events += eventsPerTurn
  }
  const decoder = new LineDecoder(Number.MAX_SAFE_INTEGER)
  pipe.far.on("data", (data: Buffer) => {
    for (const line of decoder.push(data)) {
      if (typeof line !== "string") continue
      // Never thrown out of a socket's handler (that would take the daemon down): skipped.
      let frame: { readonly type?: unknown }
      try {
        frame = JSON.parse(line) as { readonly type?: unknown }
      } catch {
        continue
      }
      if (frame.type === "load") {
        pipe.far.write(WorkerProtocol.encodeFrame({ type: "worker_ready", pid: 0, messageCount: 0 }))
      } else if (frame.type === "prompt") {
        void streamTurn()
      }
    }
  })
  pipe.far.on("error", () => {})
  return handle
}

/** The warm-up's temp dirs: `agentd-warm-up-<the daemon's pid>-<random>`. */
const TEMP_PREFIX = "agentd-warm-up-"

/**
 * Removes the temp dirs of warm-ups whose daemon is gone (SIGKILLed while it warmed up: a clean
 * stop removes its own). Only dirs of this user (see `deadDaemonDirs`).
 */
const removeOrphans = (): void => {
  for (const dir of deadDaemonDirs(TEMP_PREFIX)) fs.rmSync(dir, { recursive: true, force: true })
}

/**
 * Runs up to `turns` echo turns of `words` words through the daemon's event path, on a
 * throwaway session (see the header); stops early once a real session's worker sends frames.
 * Never fails: a warm-up that cannot run (no temp dir) only logs at debug level.
 */
export const warmUpDaemon = (options: { readonly turns: number; readonly words: number }): Effect.Effect<WarmUpOutcome, never, DaemonConfig> =>
  Effect.gen(function*() {
    const config = yield* DaemonConfig
    const dir = yield* Effect.acquireRelease(
      Effect.sync(() => {
        removeOrphans()
        return fs.mkdtempSync(path.join(os.tmpdir(), `${TEMP_PREFIX}${process.pid}-`))
      }),
      (dir) => Effect.sync(() => fs.rmSync(dir, { recursive: true, force: true }))
    )
    const sent = { events: 0 }
    let deliveredBytes = 0
    const workerPipe = yield* connectionPair(dir, "worker.sock")
    const clientPipe = yield* connectionPair(dir, "client.sock")
    clientPipe.far.on("data", (data: Buffer) => (deliveredBytes += data.length))
    const chunks = echoTurnChunks(options.words)
    const worker = makeWorker(workerPipe, chunks, sent)
    yield* Effect.addFinalizer(() => Effect.sync(() => worker.kill()))
    const storage = yield* Layer.build(Layer.mergeAll(
      EventLog.layer({ root: path.join(dir, "events") }),
      SessionStore.layerMemory,
      RecoveryJournal.layerMemory,
      SnapshotCache.layerMemory
    ))
    const context = storage.pipe(
      Context.add(DaemonConfig, {
        ...config,
        stateDir: dir,
        socketPath: path.join(dir, "agentd.sock"),
        engine: ENGINE,
        maxWorkers: 1,
        // No checkpoint: the made-up worker sends no snapshot.
        checkpointEvents: Number.MAX_SAFE_INTEGER,
        checkpointBytes: Number.MAX_SAFE_INTEGER
      }),
      Context.add(Engine, registry({ [ENGINE]: { validate: () => Effect.void, make: () => Effect.dieMessage("the warm-up's engine runs nowhere") } })),
      Context.add(SupervisorInfo, {
        generation: 1,
        startedAt: Date.now(),
        journalPath: path.join(dir, "recovery.jsonl"),
        storeRoot: path.join(dir, "sessions"),
        eventLogRoot: path.join(dir, "events")
      }),
      Context.add(WorkerPool, WorkerPool.of({ acquire: () => Effect.succeed(worker), live: Effect.succeed([worker]) }))
    )
    // Built in the warm-up's scope: closed at its end (the session's fibers interrupted, the log closed).
    const manager = Context.get(yield* Layer.build(SessionManagerModule.layer.pipe(Layer.provide(Layer.succeedContext(context)))), SessionManager)
    const { activeSessionId } = yield* manager.create({ type: "create" } as CommandOf<"create">, `${WARM_UP_SESSION_PREFIX}${randomUUID()}`)
    const attached = yield* manager.attach("warm-up", new Outbox(clientPipe.near), {
      type: "attach",
      activeSessionId,
      capabilities: ["event_sequence", "slim_attach"]
    } as CommandOf<"attach">)
    yield* Effect.forkScoped(attached.deliver)
    let turns = 0
    while (turns < options.turns && !eventPathInUse()) {
      yield* manager.prompt({ type: "prompt", activeSessionId, message: "warm-up" } as CommandOf<"prompt">)
      const ended = yield* waitIdle(manager, activeSessionId).pipe(Effect.timeout(TURN_TIMEOUT), Effect.option)
      if (ended._tag === "None" || eventPathInUse()) break
      turns++
    }
    return { turns, events: sent.events, deliveredBytes }
  }).pipe(
    Effect.scoped,
    Effect.catchAllCause((cause) => Effect.as(Effect.logDebug("the daemon's warm-up did not run", cause), { turns: 0, events: 0, deliveredBytes: 0 }))
  )

/** Waits until the session is idle again (its turn ended and said so), or a real session needs the daemon. */
const waitIdle = (manager: Context.Tag.Service<typeof SessionManager>, id: string) =>
  Effect.gen(function*() {
    while (!eventPathInUse()) {
      const state = yield* manager.getState(id)
      if (!state.busy) return
      yield* Effect.sleep("5 millis")
    }
  })
