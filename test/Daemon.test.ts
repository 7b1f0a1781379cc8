import { assert, describe, it } from "@effect/vitest"
import type * as Context from "effect/Context"
import * as Effect from "effect/Effect"
import * as Exit from "effect/Exit"
import * as Layer from "effect/Layer"
import * as Scope from "effect/Scope"
import * as fs from "node:fs"
import * as os from "node:os"
import * as path from "node:path"
import * as ConfigProvider from "effect/ConfigProvider"
import { type DaemonStartError, DaemonLive } from "../src/Daemon.js"
import * as DaemonConfig from "../src/DaemonConfig.js"
import * as EventLog from "../src/EventLog.js"
import * as RecoveryJournal from "../src/RecoveryJournal.js"
import { SessionManager } from "../src/SessionManager.js"
import * as SessionStore from "../src/SessionStore.js"
import * as SnapshotCache from "../src/SnapshotCache.js"
import * as WorkerPool from "../src/WorkerPool.js"
import { MemoryConnection, waitFor } from "./support/core.js"

const tempRoot = Effect.acquireRelease(
  Effect.sync(() => fs.mkdtempSync(path.join(os.tmpdir(), "agentd-daemon-test-"))),
  (dir) => Effect.sync(() => fs.rmSync(dir, { recursive: true, force: true }))
)

/** A new session with a connection attached, and one turn run to its agent_end. */
const oneTurn = (sm: Context.Tag.Service<typeof SessionManager>, message: string) =>
  Effect.gen(function*() {
    const { activeSessionId } = yield* sm.create({ type: "create" } as any)
    const conn = new MemoryConnection("c")
    const attached = yield* sm.attach("c", conn, { type: "attach", activeSessionId } as any)
    yield* Effect.forkScoped(attached.deliver)
    yield* sm.prompt({ type: "prompt", activeSessionId, message } as any)
    yield* waitFor("the turn's end", () => conn.sequenced().some((l) => l["event"]?.type === "agent_end"))
    return { activeSessionId, conn }
  })

describe("DaemonLive", () => {
  it.scoped("fails to start with a typed DaemonStartError (an unknown engine), touching nothing", () =>
    Effect.gen(function*() {
      const stateDir = path.join(fs.mkdtempSync(path.join(os.tmpdir(), "agentd-daemon-test-")), "state")
      const error: DaemonStartError = yield* Effect.flip(Layer.build(DaemonLive({ stateDir, engine: "no-such-engine" })))
      // The union is exhaustive: a switch on its tags needs no default.
      switch (error._tag) {
        case "EngineError":
          assert.strictEqual(error.reason, "unknown_engine")
          break
        case "FsError":
        case "StateDirLocked":
        case "StateDirLockError":
        case "ServerStartError":
        case "EventLogError":
        case "SessionStoreError":
        case "RecoveryJournalError":
          assert.fail(`unexpected ${error._tag}: ${error.message}`)
      }
      assert.isFalse(fs.existsSync(stateDir), "the state dir was not created")
      fs.rmSync(path.dirname(stateDir), { recursive: true, force: true })
    }))

  it.live("an embedder of DaemonLive holds the state dir's lock: a second one (another socket) fails StateDirLocked, writing nothing, until the first's scope closes", () =>
    Effect.gen(function*() {
      const root = yield* tempRoot
      const stateDir = path.join(root, "state")
      const layers = { recoveryJournal: RecoveryJournal.layerMemory, workerPool: WorkerPool.layerInProcess() }
      const first = yield* Scope.make()
      yield* Layer.buildWithScope(DaemonLive({ stateDir, warmSpare: false }, layers), first)
      const before = fs.readdirSync(stateDir).sort().map((f) => [f, fs.statSync(path.join(stateDir, f)).mtimeMs])
      const other = path.join(root, "other.sock")
      const error = yield* Effect.flip(Layer.build(DaemonLive({ stateDir, socketPath: other, warmSpare: false }, layers)))
      assert.strictEqual(error._tag, "StateDirLocked")
      assert.strictEqual(error.message, `another daemon (pid ${process.pid}, socket ${path.join(stateDir, "agentd.sock")}) holds ${stateDir}`)
      assert.deepStrictEqual(fs.readdirSync(stateDir).sort().map((f) => [f, fs.statSync(path.join(stateDir, f)).mtimeMs]), before)
      assert.strictEqual(fs.readFileSync(path.join(stateDir, "supervisor-generation"), "utf8"), "1\n")
      assert.isFalse(fs.existsSync(other))
      yield* Scope.close(first, Exit.void)
      // Released with the scope: the next one starts.
      yield* Layer.build(DaemonLive({ stateDir, socketPath: other, warmSpare: false }, layers))
      assert.strictEqual(fs.readFileSync(path.join(stateDir, "supervisor-generation"), "utf8"), "2\n")
    }).pipe(Effect.scoped))

  it.live("an embedder replaces its layers: memory storage and journal, in-process workers; the state dir holds only the socket and the generation", () =>
    Effect.gen(function*() {
      const stateDir = path.join(yield* tempRoot, "state")
      const context = yield* Layer.build(DaemonLive({ stateDir, warmSpare: false }, {
        eventLog: EventLog.layerMemory,
        sessionStore: SessionStore.layerMemory,
        recoveryJournal: RecoveryJournal.layerMemory,
        snapshotCache: SnapshotCache.layerMemory,
        workerPool: WorkerPool.layerInProcess()
      }))
      const sm = yield* Effect.provide(SessionManager, context)
      const { activeSessionId } = yield* oneTurn(sm, "in memory")
      const { messages } = yield* sm.getMessages({ type: "get_messages", activeSessionId } as any)
      assert.deepStrictEqual(messages.map((m) => m.content), ["in memory", "echo: in memory"])
      yield* sm.checkpoint(activeSessionId)
      // Nothing of the sessions reached the disk (the snapshot cache did not spill either).
      assert.deepStrictEqual(fs.readdirSync(stateDir).sort(), ["agentd.sock", "supervisor-generation"])
    }).pipe(Effect.scoped))

  it.live("the memory journal alone: sessions on disk, no recovery.jsonl", () =>
    Effect.gen(function*() {
      const stateDir = path.join(yield* tempRoot, "state")
      const context = yield* Layer.build(DaemonLive({ stateDir, warmSpare: false }, {
        recoveryJournal: RecoveryJournal.layerMemory,
        workerPool: WorkerPool.layerInProcess()
      }))
      const sm = yield* Effect.provide(SessionManager, context)
      const { conn } = yield* oneTurn(sm, "journal")
      yield* waitFor("idle", () => conn.sequenced().some((l) => l["type"] === "session_status" && l["state"]?.busy === false))
      assert.isTrue(fs.existsSync(path.join(stateDir, "events")), "the event log is on disk")
      assert.isFalse(fs.existsSync(path.join(stateDir, "recovery.jsonl")), "no journal file")
    }).pipe(Effect.scoped))

  it.scoped("the configuration as a layer: a DaemonConfig layer over the embedder's ConfigProvider replaces it whole", () =>
    Effect.gen(function*() {
      const stateDir = path.join(yield* tempRoot, "state")
      const provider = ConfigProvider.fromMap(new Map([["AGENTD_MAX_WORKERS", "0"]]))
      const config = DaemonConfig.layer({ stateDir }).pipe(Layer.provide(Layer.setConfigProvider(provider)))
      const error = yield* Effect.flip(Layer.build(DaemonLive(config)))
      assert.include(String(error), "AGENTD_MAX_WORKERS")
      assert.isFalse(fs.existsSync(stateDir), "the state dir was not created")
    }))
})
