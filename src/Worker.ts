/**
 * The worker program: one process per active session, running its engine (docs/protocol.md
 * section 6), or a host running several (`runHost`, `--sessions-per-worker`), each session then
 * on a connection of its own speaking the same protocol. It speaks WorkerProtocol in JSON lines
 * on fd 3, a private pipe to the supervisor; stdout and stderr are only logs. It exits by itself
 * when that pipe closes, so a worker never outlives its daemon, even one killed with SIGKILL.
 *
 * A worker starts empty (the pool's warm spare) and becomes a session's worker on `load`,
 * either fresh or restoring: the supervisor sends it the latest complete transcript and the
 * logged events after it in restore frames (read through the daemon's storage layers; a worker
 * never opens the state dir), it folds them, and reports `turn_interrupted` when the journal
 * said a turn was running.
 */
import * as Chunk from "effect/Chunk"
import type * as Context from "effect/Context"
import * as Effect from "effect/Effect"
import * as Either from "effect/Either"
import * as Exit from "effect/Exit"
import * as Fiber from "effect/Fiber"
import * as FiberId from "effect/FiberId"
import * as FiberSet from "effect/FiberSet"
import * as Layer from "effect/Layer"
import * as Logger from "effect/Logger"
import { isRecord } from "effect/Predicate"
import * as Queue from "effect/Queue"
import * as Stream from "effect/Stream"
import * as net from "node:net"
import { Engine, type EngineError, type EngineSession, foldEvent, TranscriptReplaced, type TurnInput, type TurnOutput } from "./Engine.js"
import * as BuiltinEngines from "./engines/builtin.js"
import { SessionWorkDir } from "./engines/SessionWorkDir.js"
import { LineDecoder } from "./JsonLines.js"
import type { AgentEvent, AgentMessage, InterruptReason } from "./Protocol.js"
// Not from ./SnapshotCache.js: that module reads files, and would load the file system layer and node:crypto into every worker.
import { chunkMessages, DEFAULT_TARGET_CHUNK_BYTES } from "./internal/snapshotCache/messageChunks.js"
import * as WorkerProtocol from "./WorkerProtocol.js"
import { chmodSync } from "./internal/fileIoSync.js"

type LoadFrame = typeof WorkerProtocol.Load.Type

/** The worker's end of its link to the supervisor: frames out (with backpressure), lines in. */
export interface WorkerPipe {
  /** Writes one frame; resolves once it is taken (or the link is gone). */
  readonly send: (frame: WorkerProtocol.WorkerFrame) => Effect.Effect<void>
  /** Writes frames already encoded as JSON lines. */
  readonly sendRaw: (data: string | Uint8Array) => Effect.Effect<void>
  /**
   * The same as `sendRaw`, called from a plain callback (a pushed turn's events): undefined when
   * the bytes were taken, else a promise that resolves once the pipe drained (or is gone).
   */
  readonly write: (data: string | Uint8Array) => Promise<void> | undefined
  /** Calls `onLine` for every line from the supervisor; resolves when the supervisor's end closes. */
  readonly lines: (onLine: (line: string) => void) => Promise<void>
}

/** How long a worker whose pipe closed may take to wind down before it exits anyway. */
const EXIT_GRACE_MS = 2000

/** A link to the supervisor over a socket: a worker's fd 3, or a hosted session's connection. */
class SocketPipe implements WorkerPipe {
  constructor(protected readonly socket: net.Socket) {}

  /** Writes a frame; resolves once the kernel took it or the pipe drained. */
  send(frame: WorkerProtocol.WorkerFrame): Effect.Effect<void> {
    return this.sendRaw(WorkerProtocol.encodeFrame(frame))
  }

  sendRaw(data: string | Uint8Array): Effect.Effect<void> {
    return Effect.suspend(() => {
      const full = this.write(data)
      return full === undefined ? Effect.void : Effect.promise(() => full)
    })
  }

  write(data: string | Uint8Array): Promise<void> | undefined {
    if (this.socket.destroyed || this.socket.write(data)) return undefined
    return new Promise((resolve) => {
      const done = () => {
        this.socket.off("drain", done)
        this.socket.off("close", done)
        resolve()
      }
      this.socket.once("drain", done)
      this.socket.once("close", done)
    })
  }

  /** Calls `onLine` for every line; resolves when the supervisor's end closes. */
  lines(onLine: (line: string) => void): Promise<void> {
    // The supervisor is trusted: a restore frame holding one large message can pass the
    // protocol's line limit.
    const decoder = new LineDecoder(Number.MAX_SAFE_INTEGER)
    return new Promise((resolve) => {
      this.socket.on("data", (chunk: Buffer) => {
        for (const item of decoder.push(chunk)) if (typeof item === "string") onLine(item)
      })
      this.socket.on("end", resolve)
      this.socket.on("close", resolve)
      this.socket.on("error", resolve)
    })
  }

  /** Ends the link from this side (a hosted session's `stop`). */
  end(): void {
    this.socket.end()
  }
}

/** The private pipe on an inherited fd (a worker process's fd 3). */
class FdPipe extends SocketPipe {
  constructor(fd: number) {
    super(new net.Socket({ fd, readable: true, writable: true }))
    // The supervisor is gone: the program winds down (its turn interrupted, its warm-up dir
    // removed), but a worker must never outlive its pipe, whatever hangs on the way out.
    const exitSoon = () => setTimeout(() => process.exit(0), EXIT_GRACE_MS).unref()
    this.socket.once("end", exitSoon)
    this.socket.once("close", exitSoon)
  }
}

/**
 * A turn's abort: set once (by the `abort` frame), with the reason its `turn_interrupted` gives;
 * the turn hears it by a callback. A plain object: racing a Deferred's await against the turn
 * forked two fibers per turn, about half of a worker's CPU for a short echo turn (866-870 ->
 * 526-532 us, lean flags, in-process).
 */
export class TurnAbort {
  reason: InterruptReason | undefined
  private listener: (() => void) | undefined

  abort(reason: InterruptReason): void {
    if (this.reason !== undefined) return
    this.reason = reason
    this.listener?.()
  }

  /**
   * Calls `f` once aborted (at once if it is already); the function returned unregisters it.
   * One listener at a time: a turn's.
   */
  on(f: () => void): () => void {
    if (this.reason !== undefined) {
      f()
      return () => {}
    }
    this.listener = f
    return () => {
      if (this.listener === f) this.listener = undefined
    }
  }
}

interface RunningTurn {
  readonly turnId: string
  readonly fiber: Fiber.RuntimeFiber<void, never>
  readonly abort: TurnAbort
}

interface LoadedSession {
  readonly activeSessionId: string
  readonly engine: EngineSession
  /** The transcript (replaced whole when the engine rewrites history). */
  messages: Array<AgentMessage>
  readonly targetChunkBytes: number
  turn: RunningTurn | undefined
}

/** A session's transcript as a worker restores it, and whether a turn was cut. */
export interface RestoredSession {
  readonly messages: Array<AgentMessage>
  readonly busy: boolean
  /** The message the cut turn was streaming when it was cut (its logged deltas), if any. */
  readonly streaming?: AgentMessage | undefined
}

/**
 * Follows the message a turn is streaming (`message_start`, its `message_update` deltas) until
 * it ends. For an engine that asks for it (`EngineSession.endsCutMessages`), a turn cut in the
 * middle of a message still ends that message, with the text streamed so far and
 * `interrupted: true`, before its `turn_interrupted`: the text a client saw stays in the
 * transcript instead of vanishing with the turn.
 */
export class StreamingMessage {
  private message: AgentMessage | undefined
  private deltas: Array<string> = []

  track(event: { readonly type: string }): void {
    switch (event.type) {
      case "message_start":
        this.message = (event as Extract<AgentEvent, { type: "message_start" }>).message
        this.deltas = []
        break
      case "message_update": {
        const update = event as Extract<AgentEvent, { type: "message_update" }>
        if (this.message?.id === update.messageId) this.deltas.push(update.delta)
        break
      }
      case "message_end":
      case "agent_end":
      case "turn_interrupted":
        this.message = undefined
        this.deltas = []
    }
  }

  /** The message being streamed, ended here as interrupted; undefined when there is none. */
  take(): AgentMessage | undefined {
    const m = this.message
    this.message = undefined
    if (m === undefined) return undefined
    const content = m.content + this.deltas.join("")
    this.deltas = []
    return { ...m, content, timestamp: Date.now(), interrupted: true }
  }
}

/** A restore frame, as the worker takes it in. */
type RestoreFrame =
  | typeof WorkerProtocol.RestoreMessages.Type
  | typeof WorkerProtocol.RestoreEvents.Type
  | typeof WorkerProtocol.RestoreEnd.Type
  | typeof WorkerProtocol.RestoreFailed.Type

/**
 * A session being restored from the supervisor's restore frames: the transcript's messages in
 * order, then the logged events after it folded in (following a message a cut turn was
 * streaming). A `restore_messages` or `restore_events` frame announces how many of the next
 * lines are messages or records ({@link RestoreIntake.wantsLine}): those lines go to
 * {@link RestoreIntake.line}, not to the frame decoder. The supervisor reads them through its own
 * storage layers; the worker never opens the state dir.
 */
export class RestoreIntake {
  readonly messages: Array<AgentMessage> = []
  private readonly streaming = new StreamingMessage()
  private received = 0
  private folding = false
  /** Lines still owed to the last `restore_messages` / `restore_events` frame. */
  private owed = 0
  private error: string | undefined

  /** Whether the next line is one of the lines a frame announced (not a frame itself). */
  get wantsLine(): boolean {
    return this.owed > 0
  }

  /** One announced line: a message, or a logged record whose agent event is folded in. */
  line(text: string): void {
    this.owed--
    if (this.error !== undefined) return
    let value: unknown
    try {
      value = JSON.parse(text)
    } catch {
      this.error = `an unreadable ${this.folding ? "event record" : "transcript message"} line: ${text.slice(0, 200)}`
      return
    }
    if (!this.folding) {
      this.messages.push(value as AgentMessage)
      this.received++
      return
    }
    // A log record holds the wire body (`session_event`, ...); the agent event is inside.
    if (!isRecord(value) || value["type"] !== "session_event" || !isRecord(value["event"])) return
    const event = value["event"] as AgentEvent
    foldEvent(this.messages, event)
    this.streaming.track(event)
  }

  /**
   * Takes one restore frame: undefined while the restore goes on, else its outcome (the
   * restored session, or why the restore failed).
   */
  take(frame: RestoreFrame, busy: boolean): Either.Either<RestoredSession, string> | undefined {
    switch (frame.type) {
      case "restore_messages":
        // Events are folded into the whole transcript: a message after them would be out of order.
        if (this.folding && this.error === undefined) this.error = "transcript messages came after logged events"
        this.owed = frame.count
        return undefined
      case "restore_events":
        this.folding = true
        this.owed = frame.count
        return undefined
      case "restore_end":
        if (this.error !== undefined) return Either.left(this.error)
        return this.received === frame.messageCount
          ? Either.right({ messages: this.messages, busy, streaming: this.streaming.take() })
          : Either.left(`${this.received} transcript messages arrived, ${frame.messageCount} were sent`)
      case "restore_failed":
        return Either.left(frame.message)
    }
  }
}

/**
 * Runs the restore path `rounds` times on a scratch session in memory: the frames a supervisor
 * sends for a small transcript with events after it, through the same line decoder, frame
 * decoder and fold as a real restore. Returns the restored message count; fails if the path
 * did not restore the scratch session (a warm-up that silently stopped working warms nothing).
 */
export const warmUpRestorePath = (rounds: number): Effect.Effect<number, string> =>
  Effect.gen(function*() {
    const message = (id: string, content: string): AgentMessage => ({ id, role: "assistant", content, timestamp: Date.now() })
    const messages = Array.from({ length: 64 }, (_, i) => JSON.stringify(message(`m${i}`, "warm-up ".repeat(64 * (i % 8 + 1)))))
    const records = [
      { type: "message_start", message: message("m64", "") },
      ...Array.from({ length: 32 }, () => ({ type: "message_update", messageId: "m64", delta: "warm-up " })),
      { type: "message_end", message: message("m64", "warm-up ".repeat(32)) },
      { type: "agent_end" }
    ].map((event) => JSON.stringify({ type: "session_event", event, emittedAt: 0 }))
    const frames = Buffer.from(
      WorkerProtocol.encodeRestoreMessages(messages.slice(0, 32)) +
        WorkerProtocol.encodeRestoreMessages(messages.slice(32)) +
        WorkerProtocol.encodeRestoreEvents(records) +
        WorkerProtocol.encodeFrame({ type: "restore_end", messageCount: messages.length }),
      "utf8"
    )
    let restored = 0
    for (let round = 0; round < rounds; round++) {
      const intake = new RestoreIntake()
      let outcome: Either.Either<RestoredSession, string> | undefined
      for (const line of new LineDecoder(Number.MAX_SAFE_INTEGER).push(frames)) {
        if (typeof line !== "string") continue
        if (intake.wantsLine) {
          intake.line(line)
          continue
        }
        const frame = WorkerProtocol.decodeSupervisorFrame(line)
        if (Either.isLeft(frame)) return yield* Effect.fail(`a warm-up frame did not decode: ${frame.left}`)
        if (!isRestoreFrame(frame.right)) return yield* Effect.fail(`a warm-up frame is no restore frame: ${line}`)
        outcome = intake.take(frame.right, false)
      }
      if (outcome === undefined) return yield* Effect.fail("the warm-up restore did not end")
      if (Either.isLeft(outcome)) return yield* Effect.fail(outcome.left)
      restored = outcome.right.messages.length
      // The first real frame interrupts the warm-up between two rounds.
      yield* Effect.yieldNow()
    }
    return restored
  })

/**
 * While a spare waits to be needed it runs the restore path a few times: the first run of that
 * code in a process pays for compiling it. Interrupted by the first real frame; a failure only
 * means the first real restore runs cold.
 */
const warmUpRestore: Effect.Effect<void> = warmUpRestorePath(20).pipe(
  // Whatever went wrong, the spare is still a worker.
  Effect.catchAllCause((cause) => Effect.logDebug("warm-up skipped", cause))
)

/** A spare's (or an empty host's) warm-up: the restore path, then the turn path; never fails. */
const warmUpSpare = (engines: Context.Tag.Service<typeof Engine>): Effect.Effect<void> =>
  warmUpRestore.pipe(
    Effect.zipRight(warmUpTurnPath(engines, 3)),
    // An embedder's registry without `echo`: the restore path was warmed all the same.
    Effect.catchAllCause((cause) => Effect.logDebug("turn warm-up skipped", cause))
  )

/**
 * Runs one turn of `engine`: every batch of its outputs is made bytes by `encode` and written by
 * `write` (a promise back: the pipe is full, and the turn waits for it). The engine pushes its
 * outputs when it can (`pushTurn`: at a model's pace, a worker's CPU per event is then its
 * wake-up, not a fiber resumed and a Stream pulled per event), else its Stream is pulled.
 * Interrupting the effect cancels the turn; so does `abort` (the effect then succeeds: the
 * caller says how the turn ended).
 */
export const runTurnOutputs = (
  engine: EngineSession,
  input: TurnInput,
  encode: (outputs: ReadonlyArray<TurnOutput>) => Uint8Array,
  write: (bytes: Uint8Array) => Promise<void> | undefined,
  abort?: TurnAbort
): Effect.Effect<void, EngineError> => {
  const push = engine.pushTurn
  if (push === undefined) {
    const pulled = engine.runTurn(input).pipe(
      // One write per chunk of outputs the engine has ready, not one per output.
      Stream.runForEachChunk((outputs) =>
        Effect.suspend(() => {
          const full = write(encode(Chunk.toReadonlyArray(outputs)))
          return full === undefined ? Effect.void : Effect.promise(() => full)
        })
      )
    )
    // Raced once per turn, not at every pull of the stream (`Stream.interruptWhenDeferred` forked
    // a fiber per event: half of a worker's CPU per event at a model's pace).
    return abort === undefined ? pulled : Effect.raceFirst(pulled, Effect.async<void>((resume) => Effect.sync(abort.on(() => resume(Effect.void)))))
  }
  return Effect.async<void, EngineError>((resume) => {
    let over = false
    let cancel: (() => void) | undefined
    let unlisten: (() => void) | undefined
    const finish = (exit: Effect.Effect<void, EngineError>) => {
      if (over) return
      over = true
      unlisten?.()
      // An engine's cancel that throws still ends its turn (the throw goes to the caller).
      try {
        cancel?.()
      } finally {
        resume(exit)
      }
    }
    cancel = push(input, {
      emit: (outputs) => {
        if (over) return undefined
        try {
          return write(encode(outputs))
        } catch (defect) {
          // Thrown in an engine's timer, it would take the process down: the turn dies instead.
          finish(Effect.die(defect))
          return undefined
        }
      },
      end: (error) => finish(error === undefined ? Effect.void : Effect.fail(error))
    })
    // It ended (or died) before `pushTurn` even returned.
    if (over) cancel()
    // Aborted (at once, if that came before: the engine's first outputs, written as it started,
    // are the turn's last; the user's message among them stays in the transcript): it ends here.
    else if (abort !== undefined) unlisten = abort.on(() => finish(Effect.void))
    return Effect.sync(() => {
      over = true
      unlisten?.()
      cancel?.()
    })
  })
}

/**
 * Runs `rounds` echo turns of a made-up prompt on a scratch session, through the same engine,
 * fold and frame encoding as a real turn, and discards their frames: a spare runs them while it
 * waits, so that the first real turn does not pay for compiling that path (it made the first
 * turn after a start twice as slow as the next). Returns the bytes of frames encoded; fails
 * when the registry has no `echo` engine.
 */
export const warmUpTurnPath = (engines: Context.Tag.Service<typeof Engine>, rounds: number) =>
  Effect.gen(function*() {
    const engine = yield* engines.make("echo", {})
    const message = Array.from({ length: 2000 }, (_, i) => `w${i}`).join(" ")
    let bytes = 0
    for (let round = 0; round < rounds; round++) {
      const messages: Array<AgentMessage> = []
      const streaming = new StreamingMessage()
      const encode = (outputs: ReadonlyArray<TurnOutput>): Uint8Array => {
        let text = ""
        for (const output of outputs) {
          if (output instanceof TranscriptReplaced) continue
          foldEvent(messages, output)
          streaming.track(output)
          text += WorkerProtocol.encodeEventFrame(output)
        }
        const batch = Buffer.from(text, "utf8")
        bytes += batch.length
        return batch
      }
      yield* runTurnOutputs(engine, { turnId: `warm-up-${round}`, message, history: messages }, encode, () => undefined)
      // The first real frame interrupts the warm-up between two turns.
      yield* Effect.yieldNow()
    }
    return bytes
  })

const isRestoreFrame = (frame: WorkerProtocol.SupervisorFrame): frame is RestoreFrame =>
  frame.type === "restore_messages" || frame.type === "restore_events" || frame.type === "restore_end" ||
  frame.type === "restore_failed"

/** How long a worker is idle before it collects its garbage. */
const IDLE_GC_MS = 1000

/**
 * Collects the garbage of a worker idle for a moment (a spare warmed up, a session loaded, a
 * turn ended). A waiting worker allocates nothing, so V8 has no reason to collect, and what a
 * warm-up or a turn left behind stays resident until the next turn: an idle echo worker's RSS
 * went down by ~1.5 MB (bench/workerMemory.ts). It needs `--expose-gc` (WorkerPool's
 * LEAN_WORKER_FLAGS); without it nothing is done.
 *
 * When that leaves a megabyte or more free in the old space (and an eighth of what it uses), it
 * compacts (idleGc). A full GC frees dead objects but keeps every page that still holds a live
 * one, and V8 picks a page to compact only when 20% of it or more is free (with
 * --optimize-for-size): after a warm-up and a
 * turn, 2.3 MB of an echo worker's old space were free bytes spread thin over its ~30 pages,
 * committed and resident (old space 7.7 MB for 5.4 used), or not, depending on where the last
 * objects landed (the idle RSS moved by 2 MB from one build to the next with no change of its
 * own). Compacting moves the live objects together and gives the emptied pages back: 49.9-51.6
 * -> 48.2 MB (bench/workerMemory.ts). Only when idle: `--compact-on-every-full-gc` as a start
 * flag saved as much but compacted every full GC of a turn too, a worker's CPU per event in a
 * burst 6.7 -> 8.8 us (bench/hotPath.ts, 3 runs each, load 4-5).
 */
export class IdleCollector {
  private timer: ReturnType<typeof setTimeout> | undefined
  /** Sessions of this process that are busy (a host runs several: it collects when all are idle). */
  private busyMembers = 0

  /** A session's (or a spare's) say in when the process is idle; it starts busy. */
  member(): { readonly idle: () => void; readonly busy: () => void } {
    let busy = true
    this.busyMembers++
    this.cancel()
    return {
      idle: () => {
        if (busy) {
          busy = false
          this.busyMembers--
        }
        if (this.busyMembers === 0) this.schedule()
      },
      busy: () => {
        if (!busy) {
          busy = true
          this.busyMembers++
        }
        this.cancel()
      }
    }
  }

  private schedule(): void {
    this.cancel()
    const gc = globalThis.gc
    if (typeof gc !== "function") return
    this.timer = setTimeout(() => {
      this.timer = undefined
      idleGc(gc)
    }, IDLE_GC_MS)
    this.timer.unref()
  }

  private cancel(): void {
    if (this.timer !== undefined) clearTimeout(this.timer)
    this.timer = undefined
  }
}

/** Free bytes in the old space's pages after a full GC from which an idle worker compacts it. */
export const COMPACT_FREE_BYTES = 1024 * 1024

/**
 * A full GC, then, if it left COMPACT_FREE_BYTES or more free in the old space's pages, and at
 * least an eighth of what is used there, a full GC that compacts every page it can. It copies
 * the whole live heap, ~3x a plain collection's CPU (an idle echo worker: 43-50 ms against
 * 14-16, load 4-6): worth it for a megabyte of a small heap, not for one of a session whose
 * transcript fills 50 MB. V8 reads the flag when a full GC picks the pages to evacuate, at the
 * start of its marking; it is set back before any other code runs. node:v8 is loaded at the
 * first idle collection: ~0.3 MB, most of what it needs (streams) a worker has loaded already.
 */
export const idleGc = (gc: () => void): void => {
  gc()
  const v8 = process.getBuiltinModule("node:v8")
  const old = v8.getHeapSpaceStatistics().find((space) => space.space_name === "old_space")
  if (old === undefined) return
  const free = old.space_size - old.space_used_size
  if (free < COMPACT_FREE_BYTES || free * 8 < old.space_used_size) return
  v8.setFlagsFromString("--compact-on-every-full-gc")
  try {
    gc()
  } finally {
    v8.setFlagsFromString("--no-compact-on-every-full-gc")
  }
}

/** How a worker runs: in its own process (the defaults), or inside the daemon's (tests). */
export interface RunOptions {
  /** Run the restore path once on a scratch session while waiting for a session (a warm spare). */
  readonly warmUp?: boolean
  /** The pid the worker reports (default: this process's). */
  readonly pid?: number
  /** What the `stop` frame does (default: exit the process). */
  readonly exit?: Effect.Effect<void>
  /** Told the session's id when the `load` frame comes, before anything else of the session. */
  readonly onSession?: (activeSessionId: string) => void
  /**
   * Collect garbage whenever the worker goes idle (its own process only: see IdleCollector):
   * `true` for a collector of its own, or the collector it shares with the other sessions of
   * its process (a host), which collects once all of them are idle.
   */
  readonly collectWhenIdle?: boolean | IdleCollector
}

/**
 * The worker's main program over an already open pipe; returns when the supervisor's end
 * closes. Frames are handled one at a time, in order; a turn runs in a fiber of its own (so
 * that an `abort` can reach it) and is interrupted when the program ends.
 */
export const run = (pipe: WorkerPipe, options: RunOptions = {}) =>
  Effect.gen(function*() {
    const engines = yield* Engine
    const pid = options.pid ?? process.pid
    const fibers = yield* FiberSet.make()
    const collector = options.collectWhenIdle === undefined || options.collectWhenIdle === false
      ? undefined
      : (options.collectWhenIdle === true ? new IdleCollector() : options.collectWhenIdle).member()
    // A session leaving a host must not keep it busy for the others.
    if (collector !== undefined) yield* Effect.addFinalizer(() => Effect.sync(() => collector.idle()))
    let session: LoadedSession | undefined
    /** A session whose restore frames are coming in (between `load` and `restore_end`). */
    let restoring: {
      readonly load: LoadFrame
      /** Undefined when it could not be made (reported): the restore's lines are only consumed. */
      readonly engine: EngineSession | undefined
      readonly intake: RestoreIntake
    } | undefined

    const fail = (message: string) => pipe.send({ type: "worker_error", message })

    const emit = (event: AgentEvent) => pipe.send({ type: "worker_event", event })

    /** A turn's end by interruption: the message it was streaming ends first, as interrupted. */
    const cutTurn = (messages: Array<AgentMessage>, partial: AgentMessage | undefined, reason: InterruptReason) =>
      Effect.suspend(() => {
        if (partial === undefined) return emit({ type: "turn_interrupted", reason })
        const end: AgentEvent = { type: "message_end", message: partial }
        foldEvent(messages, end)
        return pipe.sendRaw(
          WorkerProtocol.encodeFrame({ type: "worker_event", event: end }) +
            WorkerProtocol.encodeFrame({ type: "worker_event", event: { type: "turn_interrupted", reason } })
        )
      })

    /**
     * One turn. An abort (`abort`) ends the engine's turn; the turn then reports
     * `turn_interrupted` unless its `agent_end` is already out (a turn ends with exactly one of
     * the two). A signal rather than an interruption of the turn's fiber: an abort that arrives
     * before that fiber has even started must still end the turn.
     */
    const runTurn = (s: LoadedSession, turnId: string, message: string, abort: TurnAbort) => {
      let ended = false
      const streaming = new StreamingMessage()
      const interrupted = Effect.gen(function*() {
        if (ended) return
        ended = true
        const partial = streaming.take()
        // The abort's reason (a graceful daemon stop says `daemon_shutdown`); a turn cut because
        // the worker itself ends has nobody left to tell.
        const reason: InterruptReason = abort.reason ?? "aborted"
        yield* cutTurn(s.messages, s.engine.endsCutMessages === true ? partial : undefined, reason)
      })
      const encode = (outputs: ReadonlyArray<TurnOutput>): Uint8Array => {
        // The batch's frames joined as text and encoded once. Writing each frame's pieces into
        // one buffer (Utf8Batch) cost 2.5x as much per event here: three calls into node:buffer's
        // JavaScript per event, and a worker runs interpreted (LEAN_WORKER_FLAGS). A batch is at
        // most 256 events or about 1 MB of deltas, so the text's one flattening is small.
        let text = ""
        for (const output of outputs) {
          if (output instanceof TranscriptReplaced) {
            // The transcript is replaced; the supervisor is sent the new one, in order with
            // the events, as the snapshot of the generation that starts with it.
            s.messages = [...output.messages]
            text += replacementFrames(s, `${turnId}-replacement`)
            continue
          }
          foldEvent(s.messages, output)
          streaming.track(output)
          if (output.type === "agent_end") ended = true
          text += WorkerProtocol.encodeEventFrame(output)
        }
        return Buffer.from(text, "utf8")
      }
      // The abort ends the engine's turn (runTurnOutputs hears it once per turn).
      return runTurnOutputs(s.engine, { turnId, message, history: s.messages }, encode, (bytes) => pipe.write(bytes), abort).pipe(
        Effect.catchAll((e) => fail(e.message)),
        Effect.zipRight(interrupted),
        // The worker itself is ending (its pipe closed).
        Effect.onInterrupt(() => interrupted),
        Effect.ensuring(Effect.sync(() => {
          if (s.turn?.turnId === turnId) s.turn = undefined
          collector?.idle()
        }))
      )
    }

    /** A transcript replaced by the engine, as snapshot frames (purpose `replacement`). */
    const replacementFrames = (s: LoadedSession, snapshotId: string): string => {
      const base = { activeSessionId: s.activeSessionId, snapshotId }
      const chunks = chunkMessages(s.activeSessionId, snapshotId, s.messages, s.targetChunkBytes)
      return WorkerProtocol.encodeFrame({
        type: "session_snapshot_begin",
        ...base,
        messageCount: s.messages.length,
        targetChunkBytes: s.targetChunkBytes,
        purpose: "replacement"
      }) + chunks.map((chunk) => Buffer.from(chunk).toString("utf8")).join("") +
        WorkerProtocol.encodeFrame({ type: "session_snapshot_end", ...base, chunkCount: chunks.length, lastEventSequence: -1 })
    }

    /** The session is loaded (a restored one first reports the turn that was cut), and says so. */
    const loaded = (
      frame: LoadFrame,
      engine: EngineSession,
      messages: Array<AgentMessage>,
      interrupted: InterruptReason | undefined,
      partial: AgentMessage | undefined
    ) =>
      Effect.gen(function*() {
        session = {
          activeSessionId: frame.activeSessionId,
          engine,
          messages,
          targetChunkBytes: frame.targetChunkBytes ?? DEFAULT_TARGET_CHUNK_BYTES,
          turn: undefined
        }
        if (interrupted !== undefined) yield* cutTurn(messages, partial, interrupted)
        yield* pipe.send({ type: "worker_ready", pid, activeSessionId: frame.activeSessionId, messageCount: messages.length })
        collector?.idle()
      })

    const handle = (frame: WorkerProtocol.SupervisorFrame): Effect.Effect<void> => {
      switch (frame.type) {
        case "load":
          return Effect.gen(function*() {
            if (session !== undefined || restoring !== undefined) return yield* fail("this worker already runs a session")
            // The spare's idle collection (a compaction: tens of ms) must not land in the load
            // or the restore; `loaded` schedules the next one.
            collector?.busy()
            options.onSession?.(frame.activeSessionId)
            const engine = yield* Effect.either(engines.make(frame.engine, frame.config ?? {}).pipe(
              // The session's work dir, for engines whose tools need one.
              frame.workDir === undefined ? (e) => e : Effect.provideService(SessionWorkDir, frame.workDir)
            ))
            // The restore's frames and lines that follow are still taken in, and dropped.
            if (frame.restore !== undefined) {
              restoring = { load: frame, engine: Either.getOrUndefined(engine), intake: new RestoreIntake() }
            }
            if (Either.isLeft(engine)) return yield* fail(engine.left.message)
            if (frame.restore === undefined) yield* loaded(frame, engine.right, [], undefined, undefined)
          })
        case "restore_messages":
        case "restore_events":
        case "restore_end":
        case "restore_failed":
          return Effect.gen(function*() {
            const r = restoring
            if (r === undefined || r.load.restore === undefined) return yield* fail(`${frame.type} with no restore under way`)
            const outcome = r.intake.take(frame, r.load.restore.busy)
            if (outcome === undefined) return
            restoring = undefined
            if (r.engine === undefined) return
            if (Either.isLeft(outcome)) return yield* fail(`restore failed: ${outcome.left}`)
            const restored = outcome.right
            const interrupted = restored.busy ? r.load.restore.interruptedReason ?? "worker_crashed" : undefined
            const partial = interrupted !== undefined && r.engine.endsCutMessages === true ? restored.streaming : undefined
            yield* loaded(r.load, r.engine, restored.messages, interrupted, partial)
          })
        case "prompt":
          return Effect.gen(function*() {
            const s = session
            if (s === undefined) return yield* fail("no session is loaded")
            // The supervisor sends a prompt only once the previous turn's end was logged; the
            // previous fiber may still be finishing (its last write, its clean-up): let it.
            if (s.turn !== undefined) yield* Fiber.await(s.turn.fiber)
            collector?.busy()
            const abort = new TurnAbort()
            const fiber = yield* FiberSet.run(fibers, runTurn(s, frame.turnId, frame.message, abort))
            s.turn = { turnId: frame.turnId, fiber, abort }
          })
        case "abort": {
          const turn = session?.turn
          return turn === undefined || turn.turnId !== frame.turnId
            ? Effect.void
            : Effect.sync(() => turn.abort.abort(frame.reason ?? "aborted"))
        }
        case "stop":
          return options.exit ?? Effect.sync(() => process.exit(0))
      }
    }

    yield* pipe.send({ type: "worker_ready", pid, messageCount: 0 })
    // The warm-up runs while nobody needs this worker: the first frame interrupts it (its
    // scratch dir is removed on the way), without waiting for it to wind down.
    let warmUp = options.warmUp === true
      ? yield* FiberSet.run(fibers, warmUpSpare(engines).pipe(Effect.zipRight(Effect.sync(() => collector?.idle()))))
      : undefined
    if (warmUp === undefined) collector?.idle()
    const lines = yield* Queue.unbounded<string | undefined>()
    yield* FiberSet.run(
      fibers,
      Effect.promise(() => pipe.lines((line) => lines.unsafeOffer(line))).pipe(Effect.zipRight(lines.offer(undefined)))
    )
    // Lines are taken in batches: a restore brings one line per message.
    let open = true
    while (open) {
      for (const line of yield* Queue.takeBetween(lines, 1, 4096)) {
        if (line === undefined) {
          open = false
          break
        }
        if (warmUp !== undefined) {
          yield* FiberSet.run(fibers, Fiber.interrupt(warmUp))
          warmUp = undefined
        }
        // A message or record line a restore frame announced: no frame to decode.
        if (restoring?.intake.wantsLine === true) {
          restoring.intake.line(line)
          continue
        }
        const decoded = WorkerProtocol.decodeSupervisorFrame(line)
        yield* (Either.isLeft(decoded) ? fail(`bad frame: ${decoded.left}`) : handle(decoded.right)).pipe(
          Effect.catchAllCause((cause) => Effect.logError("a frame could not be handled", cause))
        )
      }
    }
  }).pipe(Effect.scoped)

/**
 * A worker host: one process running several sessions (the pool's `sessionsPerWorker`), each on a
 * connection of its own that the supervisor opens to `socketPath` (a Unix socket in a private
 * directory of the daemon's), and over which it speaks WorkerProtocol exactly as to a worker of
 * its own: `load` (fresh or restoring), prompts, aborts, `stop`. The host's fd 3 is its lifeline:
 * it says `worker_ready` there once it listens, and exits when that pipe closes, taking its
 * sessions with it. A session's `stop` ends its connection; the host goes on with the others.
 *
 * What it buys: a process woken by a timer costs ~120-150 us of CPU per wake-up here whatever it
 * does (bench/streaming.ts), so sessions streaming at a model's pace each in a process of its own
 * spend most of the machine waking processes up. What it costs: a crash of the host is a crash of
 * every session it runs (each is restored, as after any worker crash), and its sessions share one
 * process's CPU and heap.
 */
export const runHost = (control: WorkerPipe, socketPath: string, warmUp: boolean) =>
  Effect.gen(function*() {
    const engines = yield* Engine
    const fibers = yield* FiberSet.make()
    const runFork = yield* FiberSet.runtime(fibers)<Engine>()
    const collector = new IdleCollector()
    const spareMember = collector.member()
    // Warmed like a spare (when the pool asks it to), until its first session connects.
    let warming: Fiber.RuntimeFiber<void> | undefined = warmUp
      ? runFork(warmUpSpare(engines).pipe(Effect.ensuring(Effect.sync(() => spareMember.idle()))))
      : undefined
    if (warming === undefined) spareMember.idle()
    const server = net.createServer((socket) => {
      if (warming !== undefined) {
        warming.unsafeInterruptAsFork(FiberId.none)
        warming = undefined
      }
      const pipe = new SocketPipe(socket)
      socket.on("error", () => {})
      runFork(
        run(pipe, { collectWhenIdle: collector, exit: Effect.sync(() => pipe.end()) }).pipe(
          Effect.catchAllCause((cause) => Effect.logError("a hosted session failed", cause)),
          Effect.ensuring(Effect.sync(() => socket.destroy()))
        )
      )
    })
    yield* Effect.async<void, Error>((resume) => {
      server.once("error", (err) => resume(Effect.fail(err)))
      server.listen(socketPath, () => {
        // From now on an error (EMFILE accepting a connection) is logged: it must not take the
        // host, and every session in it, down.
        server.on("error", (err) => process.stderr.write(`worker host: ${err.message}\n`))
        resume(Effect.void)
      })
    })
    // Only the daemon's user may connect (its directory is private too).
    chmodSync(socketPath, 0o600)
    yield* Effect.addFinalizer(() => Effect.sync(() => server.close()))
    yield* control.send({ type: "worker_ready", pid: process.pid, messageCount: 0 })
    // The supervisor sends nothing else on this pipe: it closes it (or sends `stop`) to end the host.
    yield* Effect.promise(() => control.lines(() => process.exit(0)))
  }).pipe(Effect.scoped)

/**
 * The worker process entry: fd 3 is the pipe; exits when the supervisor goes away. `engines`
 * is the registry the worker loads a session's engine from by name: an embedder with engines of
 * its own writes a one-line entry calling `main(itsEngines)` and names it as the daemon's
 * `workerEntry` (giving the daemon the same registry, `DaemonLive(config, { engines })`).
 */
export const main = (engines: Layer.Layer<Engine> = BuiltinEngines.layer): void => {
  const pipe = new FdPipe(3)
  // The pool starts workers in a process group of their own (detached), so no signal to the
  // daemon's group reaches them: the closing pipe is how a worker learns its daemon is gone.
  // Should the pipe stay open (a descendant holding the daemon's end), being orphaned (another
  // parent) says it too.
  const parent = process.ppid
  setInterval(() => {
    if (process.ppid !== parent) process.exit(0)
  }, 1000).unref()
  // A profiled worker (AGENTD_WORKER_NODE_ARGS=--cpu-prof) is stopped by SIGTERM: exiting
  // from it lets Node write the profile, which a death by the signal would not.
  if (process.execArgv.some((arg) => arg.startsWith("--cpu-prof"))) process.once("SIGTERM", () => process.exit(0))
  const hostPath = process.argv.find((arg) => arg.startsWith(WorkerProtocol.HOST_FLAG))?.slice(WorkerProtocol.HOST_FLAG.length)
  const logged = <A, E>(program: Effect.Effect<A, E, Engine>) =>
    program.pipe(
      Effect.tapErrorCause((cause) => Effect.logError("the worker failed", cause)),
      // stdout and stderr are copied to the daemon's log; the default logger would use stdout.
      Effect.provide(Layer.merge(engines, Logger.replace(Logger.defaultLogger, Logger.prettyLogger({ stderr: true, colors: false }))))
    )
  const warmUp = process.argv.includes(WorkerProtocol.WARM_UP_FLAG)
  // The supervisor is gone (or we failed): a worker never outlives its pipe.
  const exitWith = (exit: Exit.Exit<unknown, unknown>) => process.exit(Exit.isSuccess(exit) ? 0 : 1)
  if (hostPath !== undefined) {
    process.title = `${WorkerProtocol.WORKER_TITLE_PREFIX}${WorkerProtocol.HOST_TITLE_KEY}`
    Effect.runPromiseExit(logged(runHost(pipe, hostPath, warmUp))).then(exitWith)
    return
  }
  // The process table names the session this worker runs (`/proc/PID/cmdline` on Linux, which
  // keeps a title within the length of the original argv: see `workerTitleKey`), so that "at
  // most one live worker per session" can be checked from outside, across runners and daemons
  // (test/support/workerCensus.ts).
  const onSession = (id: string) => {
    process.title = `${WorkerProtocol.WORKER_TITLE_PREFIX}${WorkerProtocol.workerTitleKey(id)}`
  }
  Effect.runPromiseExit(logged(run(pipe, { warmUp, onSession, collectWhenIdle: true }))).then(exitWith)
}
