/**
 * The session core in-process: the SessionManager over the memory layers, with workers that
 * run the echo engine as fibers of the test's process (WorkerPool.layerInProcess), and
 * connections that are in-memory ports. Nothing is spawned and no socket is opened.
 */
import * as Effect from "effect/Effect"
import * as Layer from "effect/Layer"
import * as Ref from "effect/Ref"
import { DaemonConfig, type DaemonConfigShape, defaults } from "../../src/DaemonConfig.js"
import * as EchoEngine from "../../src/engines/EchoEngine.js"
import * as EventLog from "../../src/EventLog.js"
import * as RecoveryJournal from "../../src/RecoveryJournal.js"
import { type ConnectionPort, SupervisorInfo } from "../../src/SessionManager.js"
import * as SessionManagerModule from "../../src/SessionManager.js"
import * as SessionStore from "../../src/SessionStore.js"
import * as SnapshotCache from "../../src/SnapshotCache.js"
import * as WorkerPool from "../../src/WorkerPool.js"

/** Spawn failures on demand: while `failing` is set, every worker start fails. */
export interface SpawnControl {
  readonly failing: Ref.Ref<string | undefined>
  /** Starts attempted, failed or not. */
  readonly starts: Ref.Ref<number>
}

export const makeSpawnControl = Effect.gen(function*() {
  return { failing: yield* Ref.make<string | undefined>(undefined), starts: yield* Ref.make(0) } satisfies SpawnControl
})

/**
 * The core's layers. Storage, journal and cache are in memory; `config` overrides the
 * daemon's defaults (the state dir is never touched: nothing is written to disk).
 */
export const coreLayer = (config: Partial<DaemonConfigShape> = {}, spawn?: SpawnControl) => {
  const storage = Layer.mergeAll(
    EventLog.layerMemory,
    SessionStore.layerMemory,
    RecoveryJournal.layerMemory,
    SnapshotCache.layerMemory,
    EchoEngine.layer
  )
  const pool = WorkerPool.layerInProcess({
    beforeStart: (activeSessionId) =>
      spawn === undefined ? Effect.void : Effect.gen(function*() {
        yield* Ref.update(spawn.starts, (n) => n + 1)
        const failing = yield* Ref.get(spawn.failing)
        if (failing !== undefined) {
          return yield* new WorkerPool.WorkerSpawnError({ message: `${failing} (${activeSessionId})` })
        }
      })
  }).pipe(Layer.provideMerge(storage))
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

/** Waits (polling, real time) until `pred` holds for the connection; fails after `ms`. */
export const waitFor = (what: string, pred: () => boolean, ms = 10_000) =>
  Effect.gen(function*() {
    const deadline = Date.now() + ms
    while (!pred()) {
      if (Date.now() > deadline) return yield* Effect.dieMessage(`timed out waiting for ${what}`)
      yield* Effect.sleep("5 millis")
    }
  })
