/**
 * The session core in-process: the SessionManager over the memory layers, with workers that
 * run the echo engine as fibers of the test's process (WorkerPool.layerInProcess), and
 * connections that are in-memory ports. Nothing is spawned and no socket is opened.
 *
 * With a {@link SpawnControl} (always, through {@link withCore}) a test can hold a worker at a
 * chosen step (gates: the spawn, the `load`, a `/hold` turn, the supervisor's reads of a
 * worker's frames), make spawns fail, and make a worker die right
 * after a chosen frame (`crashAfter`): a command then lands in a given phase of the session
 * entity deterministically, without sleeps.
 */
import type * as Context from "effect/Context"
import * as Deferred from "effect/Deferred"
import * as Effect from "effect/Effect"
import * as Exit from "effect/Exit"
import * as FiberId from "effect/FiberId"
import * as Layer from "effect/Layer"
import * as Ref from "effect/Ref"
import type * as Scope from "effect/Scope"
import * as Stream from "effect/Stream"
import { DaemonConfig, type DaemonConfigShape, defaults } from "../../src/DaemonConfig.js"
import { Engine, type EngineSession, type TurnInput } from "../../src/Engine.js"
import * as EchoEngine from "../../src/engines/EchoEngine.js"
import type { AgentEvent, AgentMessage } from "../../src/Protocol.js"
import * as EventLog from "../../src/EventLog.js"
import * as RecoveryJournal from "../../src/RecoveryJournal.js"
import { type ConnectionPort, type SessionManager, SupervisorInfo } from "../../src/SessionManager.js"
import * as SessionManagerModule from "../../src/SessionManager.js"
import * as PostgresStore from "../../src/PostgresStore.js"
import * as SessionStore from "../../src/SessionStore.js"
import * as SnapshotCache from "../../src/SnapshotCache.js"
import * as WorkerPool from "../../src/WorkerPool.js"
import type * as WorkerProtocol from "../../src/WorkerProtocol.js"
import { freshSchema } from "./postgres.js"

/**
 * A gate a fiber may have to pass: open by default; `close()` makes every fiber that reaches
 * it wait until `open()`. `waiting` says how many wait there now (to wait for "it is blocked").
 */
export class Gate {
  private deferred: Deferred.Deferred<void> | undefined
  /** Fibers waiting at the gate now. */
  waiting = 0
  /** Fibers that found the gate closed, ever. */
  stopped = 0

  close(): void {
    if (this.deferred === undefined) this.deferred = Deferred.unsafeMake<void>(FiberId.none)
  }

  open(): void {
    const d = this.deferred
    this.deferred = undefined
    if (d !== undefined) Deferred.unsafeDone(d, Exit.void)
  }

  get isOpen(): boolean {
    return this.deferred === undefined
  }

  readonly pass: Effect.Effect<void> = Effect.suspend(() => {
    const d = this.deferred
    if (d === undefined) return Effect.void
    this.waiting++
    this.stopped++
    return Effect.ensuring(Deferred.await(d), Effect.sync(() => this.waiting--))
  })
}

/**
 * Spawn failures on demand: while `failing` is set, every worker start fails. The gates hold a
 * worker at a chosen step, so that a test can act while the session is in a given phase.
 */
export interface SpawnControl {
  readonly failing: Ref.Ref<string | undefined>
  /** Starts attempted, failed or not. */
  readonly starts: Ref.Ref<number>
  /** Passed before each worker start (the session is `Starting`, with no worker yet). */
  readonly spawnGate: Gate
  /** Passed by a worker handling its `load` (the worker exists and is not ready). */
  readonly loadGate: Gate
  /**
   * Passed by the turns of the test prompts: `/hold` (after its user message) and
   * `/hold-after-end` (after its `agent_end`: the worker's turn fiber is still running, so a
   * checkpoint the worker is asked for waits for it).
   */
  readonly holdGate: Gate
  /**
   * Passed by a `/hold` turn interrupted while it holds (an abort reached the worker): its
   * interruption, and so the turn's end, waits for it.
   */
  readonly cutGate: Gate
  /**
   * Passed by the supervisor before each read of a worker's frames: while it is closed, what
   * workers write waits in their links (the supervisor has not seen it yet).
   */
  readonly frameGate: Gate
  /**
   * Passed by every `retain` of the snapshot cache, before the entry is retained: an attach
   * streaming a snapshot waits there, between its answer and its first frame.
   */
  readonly retainGate: Gate
  /** Turns whose engine stream has ended (its last event written to the worker's link). */
  readonly turnsEnded: Ref.Ref<number>
  /**
   * One shot: the first frame a worker writes that matches (`type`, and `eventType` for an
   * agent event) is its last: the worker dies right after writing it (what followed it in the
   * same read is lost, as if never written), so the supervisor sees exactly that frame, then
   * the link closing and the exit. Set it, and it clears itself once it has struck.
   */
  crashAfter: ((frame: WorkerProtocol.ReceivedFrame) => boolean) | undefined
  /**
   * One shot: the first frame a worker writes that matches is the last the supervisor reads
   * before `frameGate` opens (the gate closes right after it; the frames that followed it in
   * the same read wait for the next one). Two frames a worker writes back to back are then
   * seen in two steps of the session, with the test acting in between.
   */
  pauseAfter: ((frame: WorkerProtocol.ReceivedFrame) => boolean) | undefined
  /** Opens every gate (so that nothing is left waiting when the test ends). */
  readonly openAll: Effect.Effect<void>
}

export const makeSpawnControl = Effect.gen(function*() {
  const spawnGate = new Gate()
  const loadGate = new Gate()
  const holdGate = new Gate()
  const cutGate = new Gate()
  const frameGate = new Gate()
  const retainGate = new Gate()
  const control: SpawnControl = {
    failing: yield* Ref.make<string | undefined>(undefined),
    starts: yield* Ref.make(0),
    turnsEnded: yield* Ref.make(0),
    spawnGate,
    loadGate,
    holdGate,
    cutGate,
    frameGate,
    retainGate,
    crashAfter: undefined,
    pauseAfter: undefined,
    openAll: Effect.sync(() => {
      for (const g of [spawnGate, loadGate, holdGate, cutGate, frameGate, retainGate]) g.open()
    })
  }
  return control
})

const testMessage = (id: string, role: AgentMessage["role"], content: string): AgentMessage => ({
  id,
  role,
  content,
  timestamp: Date.now()
})

/** `/hold`: the user message, then the hold gate (the cut gate if interrupted there), then `held`. */
const holdTurn = (input: TurnInput, gate: Gate, cut: Gate): Stream.Stream<AgentEvent> => {
  const user = testMessage(`${input.turnId}-u`, "user", input.message)
  const id = `${input.turnId}-a`
  return Stream.make<Array<AgentEvent>>(
    { type: "agent_start" },
    { type: "turn_start" },
    { type: "message_start", message: user },
    { type: "message_end", message: user }
  ).pipe(
    Stream.concat(Stream.drain(Stream.fromEffect(Effect.onInterrupt(gate.pass, () => cut.pass)))),
    Stream.concat(Stream.suspend(() =>
      Stream.make<Array<AgentEvent>>(
        { type: "message_start", message: testMessage(id, "assistant", "") },
        { type: "message_update", messageId: id, delta: "held" },
        { type: "message_end", message: testMessage(id, "assistant", "held") },
        { type: "turn_end" },
        { type: "agent_end" }
      )
    ))
  )
}

/** The echo engine, plus the gates of `control` (see {@link SpawnControl}). */
export const testEngine = (control: SpawnControl): Layer.Layer<Engine> =>
  Layer.effect(
    Engine,
    Effect.map(Engine, (echo) =>
      Engine.of({
        names: echo.names,
        validate: echo.validate,
        make: (name, config) =>
          Effect.zipRight(
            control.loadGate.pass,
            Effect.map(echo.make(name, config), (session): EngineSession => ({
              runTurn: (input: TurnInput) =>
                (input.message === "/hold"
                  ? holdTurn(input, control.holdGate, control.cutGate)
                  : input.message === "/hold-after-end"
                  ? Stream.concat(session.runTurn(input), Stream.drain(Stream.fromEffect(control.holdGate.pass)))
                  : session.runTurn(input)).pipe(
                    Stream.onEnd(Ref.update(control.turnsEnded, (n) => n + 1))
                  )
            }))
          )
      }))
  ).pipe(Layer.provide(EchoEngine.layer))

/** A worker as the supervisor sees it, whose frames pass {@link SpawnControl.crashAfter}. */
class CrashingWorker implements WorkerPool.WorkerHandle {
  /** Struck by `crashAfter`: nothing it wrote after that frame is read (its link is closed). */
  private struck = false
  /** Read, and held back by `pauseAfter`: the next read returns them. */
  private held: Array<WorkerProtocol.ReceivedFrame> = []
  constructor(readonly inner: WorkerPool.WorkerHandle, private readonly control: SpawnControl) {}
  get pid() {
    return this.inner.pid
  }
  get exited() {
    return this.inner.exited
  }
  get activeSessionId() {
    return this.inner.activeSessionId
  }
  set activeSessionId(id: string | undefined) {
    this.inner.activeSessionId = id
  }
  get stopping() {
    return this.inner.stopping
  }
  get takeFrames(): Effect.Effect<Array<WorkerProtocol.ReceivedFrame>> {
    const read = Effect.suspend(() => {
      const held = this.held
      this.held = []
      return held.length > 0 ? Effect.succeed(held) : this.inner.takeFrames
    })
    const take = Effect.map(Effect.zipRight(this.control.frameGate.pass, read), (frames) => {
      if (this.struck) return []
      const pause = this.control.pauseAfter
      const paused = pause === undefined ? -1 : frames.findIndex(pause)
      if (paused >= 0) {
        this.control.pauseAfter = undefined
        this.control.frameGate.close()
        this.held = frames.slice(paused + 1)
        frames = frames.slice(0, paused + 1)
      }
      const strike = this.control.crashAfter
      if (strike === undefined) return frames
      const at = frames.findIndex(strike)
      if (at < 0) return frames
      this.control.crashAfter = undefined
      this.struck = true
      this.inner.kill()
      return frames.slice(0, at + 1)
    })
    return Effect.suspend(() => (this.struck ? Effect.succeed([]) : take))
  }
  send(frame: WorkerProtocol.SupervisorFrame) {
    return this.inner.send(frame)
  }
  sendRaw(data: string | Uint8Array) {
    return this.inner.sendRaw(data)
  }
  stop(graceMs?: number) {
    return this.inner.stop(graceMs)
  }
  kill() {
    this.inner.kill()
  }
}

/**
 * The pool, its workers wrapped in {@link CrashingWorker}s (`live` lists the wrappers too).
 */
const crashingPool = (control: SpawnControl) =>
  Layer.effect(
    WorkerPool.WorkerPool,
    Effect.map(WorkerPool.WorkerPool, (inner) => {
      const wrapped = new WeakMap<WorkerPool.WorkerHandle, CrashingWorker>()
      const wrap = (w: WorkerPool.WorkerHandle) => {
        let proxy = wrapped.get(w)
        if (proxy === undefined) wrapped.set(w, proxy = new CrashingWorker(w, control))
        return proxy
      }
      return WorkerPool.WorkerPool.of({
        acquire: (id, env) => Effect.map(inner.acquire(id, env), wrap),
        live: Effect.map(inner.live, (ws) => ws.map(wrap))
      })
    })
  )

/**
 * The storage the cores run over: memory, or with `AGENTD_TEST_CORE_STORE=postgres` the
 * PostgreSQL store over a fresh schema of the test server (the same core tests, as a contract
 * check of that store under the session core). Measured: SessionManager 44 of 45 and its
 * shutdown suite 7 of 9 pass; the 3 others read a connection right after a response or a gate
 * and so count on storage that answers at once, as memory does.
 */
const durableLayer = (): Layer.Layer<EventLog.EventLog | SessionStore.SessionStore | RecoveryJournal.RecoveryJournal> =>
  process.env["AGENTD_TEST_CORE_STORE"] === "postgres"
    ? Layer.unwrapScoped(Effect.map(freshSchema, (url) => PostgresStore.layerStorage({ url }))).pipe(Layer.orDie)
    : Layer.mergeAll(EventLog.layerMemory, SessionStore.layerMemory, RecoveryJournal.layerMemory)

/** What outlives a daemon: the event log, the session store and the recovery journal. */
export type StoredContext = Context.Context<EventLog.EventLog | SessionStore.SessionStore | RecoveryJournal.RecoveryJournal>

/**
 * Memory storage built once (in the caller's scope) to run several cores over it one after the
 * other, as daemon restarts over the same state dir would.
 */
export const makeStored: Effect.Effect<StoredContext, never, Scope.Scope> = Effect.suspend(() => Layer.build(durableLayer()))

/**
 * The core's layers. Storage, journal and cache are in memory; `config` overrides the
 * daemon's defaults (the state dir is never touched: nothing is written to disk).
 */
/** The memory cache, its `retain` passing `gate` first. */
const gatedCache = (gate: Gate): Layer.Layer<SnapshotCache.SnapshotCache> =>
  Layer.effect(
    SnapshotCache.SnapshotCache,
    Effect.map(SnapshotCache.SnapshotCache, (cache) => ({
      ...cache,
      retain: (snapshotId: string) => Effect.zipRight(gate.pass, cache.retain(snapshotId))
    }))
  ).pipe(Layer.provide(SnapshotCache.layerMemory))

export const coreLayer = (config: Partial<DaemonConfigShape> = {}, spawn?: SpawnControl, stored?: StoredContext) => {
  const durable = stored === undefined ? durableLayer() : Layer.succeedContext(stored)
  const storage = Layer.mergeAll(
    durable,
    spawn === undefined ? SnapshotCache.layerMemory : gatedCache(spawn.retainGate),
    spawn === undefined ? EchoEngine.layer : testEngine(spawn)
  )
  const pool = WorkerPool.layerInProcess({
    beforeStart: (activeSessionId) =>
      spawn === undefined ? Effect.void : Effect.gen(function*() {
        yield* Ref.update(spawn.starts, (n) => n + 1)
        yield* spawn.spawnGate.pass
        const failing = yield* Ref.get(spawn.failing)
        if (failing !== undefined) {
          return yield* new WorkerPool.WorkerSpawnError({ message: `${failing} (${activeSessionId})` })
        }
      })
  }).pipe(
    (inProcess) => spawn === undefined ? inProcess : crashingPool(spawn).pipe(Layer.provide(inProcess)),
    Layer.provideMerge(storage)
  )
  const settings = Layer.succeed(DaemonConfig, { ...defaults("/nonexistent/agentd-in-process"), warmSpare: false, ...config })
  const info = Layer.succeed(SupervisorInfo, {
    generation: 1,
    startedAt: Date.now(),
    journalPath: "/nonexistent/recovery.jsonl",
    storeRoot: "/nonexistent",
    eventLogRoot: "/nonexistent/events"
  })
  return SessionManagerModule.layer.pipe(Layer.provideMerge(Layer.mergeAll(pool, settings, info)))
}

/**
 * Runs `body` over a fresh core (see {@link coreLayer}) with its {@link SpawnControl}. The body
 * runs in a scope of its own (fibers it forks with `forkScoped` end with it), and every gate is
 * opened when it ends, before the core is closed (a worker held at a gate would block that).
 */
export const withCore = <A, E>(
  config: Partial<DaemonConfigShape>,
  body: (
    control: SpawnControl
  ) => Effect.Effect<
    A,
    E,
    | SessionManager
    | WorkerPool.WorkerPool
    | EventLog.EventLog
    | RecoveryJournal.RecoveryJournal
    | SnapshotCache.SnapshotCache
    | Scope.Scope
  >
  ,
  stored?: StoredContext
): Effect.Effect<A, E> =>
  Effect.flatMap(makeSpawnControl, (control) =>
    Effect.scoped(Effect.ensuring(body(control), control.openAll)).pipe(Effect.provide(coreLayer(config, control, stored))))

/**
 * A client connection in memory: everything offered is kept as parsed lines. `paused` models a
 * client that stops reading: its bytes stay queued until `resume`.
 */
export class MemoryConnection implements ConnectionPort {
  readonly lines: Array<Record<string, any>> = []
  private queued = 0
  private paused = false
  private closed = false
  private waiters: Array<{ readonly below: number; readonly resume: () => void }> = []
  private pendingText: Array<string> = []

  constructor(readonly id: string) {}

  offer(data: string | Uint8Array): void {
    if (this.closed) return
    const text = typeof data === "string" ? data : Buffer.from(data).toString("utf8")
    if (this.paused) {
      this.pendingText.push(text)
      this.queued += Buffer.byteLength(text)
      return
    }
    this.take(text)
  }

  private take(text: string) {
    for (const line of text.split("\n")) if (line.length > 0) this.lines.push(JSON.parse(line))
  }

  get queuedBytes(): number {
    return this.queued
  }

  get isClosed(): boolean {
    return this.closed
  }

  awaitBelow(bytes: number): Effect.Effect<void> {
    return Effect.async<void>((resume) => {
      if (this.closed || this.queued < bytes) return resume(Effect.void)
      const waiter = { below: bytes, resume: () => resume(Effect.void) }
      this.waiters.push(waiter)
      return Effect.sync(() => {
        this.waiters = this.waiters.filter((w) => w !== waiter)
      })
    })
  }

  pause(): void {
    this.paused = true
  }

  /** Delivers what was queued and reads on. */
  resume(): void {
    this.paused = false
    for (const text of this.pendingText.splice(0)) this.take(text)
    this.queued = 0
    const waiters = this.waiters
    this.waiters = []
    for (const w of waiters) w.resume()
  }

  close(): void {
    this.closed = true
    for (const w of this.waiters.splice(0)) w.resume()
  }

  /** The session events (`session_event`, `session_status`, ...) seen, with cursors. */
  sequenced(): Array<Record<string, any>> {
    return this.lines.filter((l) => l["meta"]?.cursor !== undefined)
  }
}

/**
 * Yields before a wait gives up: a core in-process on the TestClock runs without time passing,
 * so what a test waits for either comes once some fibers ran, or never (a timer the test did
 * not advance, a wedge).
 */
const MAX_YIELDS = 100_000

/** Waits (on the TestClock: no time passes, other fibers run) until `check` holds; dies naming `what`. */
export const waitUntil = <E, R>(what: string, check: Effect.Effect<boolean, E, R>) =>
  Effect.gen(function*() {
    for (let i = 0; i < MAX_YIELDS; i++) {
      if (yield* check) return
      yield* Effect.yieldNow()
    }
    return yield* Effect.dieMessage(`never: ${what}`)
  })

/** Waits until `pred` holds (no time passes: see {@link waitUntil}). */
export const until = (what: string, pred: () => boolean) => waitUntil(what, Effect.sync(pred))

/** Gives every fiber that can run a chance to (for "nothing happened" checks, without time passing). */
export const settle: Effect.Effect<void> = Effect.gen(function*() {
  for (let i = 0; i < 500; i++) yield* Effect.yieldNow()
})

/** Waits (polling, real time) until `pred` holds for the connection; fails after `ms`. */
export const waitFor = (what: string, pred: () => boolean, ms = 10_000) =>
  Effect.gen(function*() {
    const deadline = Date.now() + ms
    while (!pred()) {
      if (Date.now() > deadline) return yield* Effect.dieMessage(`timed out waiting for ${what}`)
      yield* Effect.sleep("5 millis")
    }
  })
