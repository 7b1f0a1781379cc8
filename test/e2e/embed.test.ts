/**
 * Embedding: an app's own engine runs in real worker processes; the core runs without the socket server. The daemon's layers are built
 * in this process (`DaemonLive` with the app's engine registry); the workers are spawned from a
 * one-line entry calling `Worker.main` with the same registry (test/fixtures/shoutWorker.ts,
 * compiled by `npm run build`).
 */
import { assert, describe, it } from "@effect/vitest"
import * as Effect from "effect/Effect"
import * as Either from "effect/Either"
import * as Layer from "effect/Layer"
import * as fs from "node:fs"
import * as os from "node:os"
import * as path from "node:path"
import { fileURLToPath } from "node:url"
import { CoreLive, DaemonLive } from "../../src/Daemon.js"
import { SessionManager } from "../../src/SessionManager.js"
import { WORKER_TITLE_PREFIX, workerTitleKey } from "../../src/WorkerProtocol.js"
import * as ShoutEngine from "../fixtures/shoutEngine.js"
import { MemoryConnection, waitFor } from "../support/core.js"

const workerEntry = path.resolve(path.dirname(fileURLToPath(import.meta.url)), "..", "..", "dist", "test", "fixtures", "shoutWorker.js")
/** The daemon's own worker entry, built. */
const builtWorker = path.resolve(path.dirname(fileURLToPath(import.meta.url)), "..", "..", "dist", "src", "bin", "worker.js")

describe("embedding (e2e)", () => {
  it.live("an embedder's engine registry: create checks it, and real workers run its engine", () =>
    Effect.gen(function*() {
      const root = fs.mkdtempSync(path.join(os.tmpdir(), "agentd-embed-"))
      yield* Effect.addFinalizer(() => Effect.sync(() => fs.rmSync(root, { recursive: true, force: true })))
      const context = yield* Layer.build(DaemonLive(
        { stateDir: path.join(root, "state"), workerEntry, warmSpare: false },
        { engines: ShoutEngine.layer }
      ))
      const sm = yield* Effect.provide(SessionManager, context)
      const unknown = yield* Effect.either(sm.create({ type: "create", engine: "nope" } as any))
      assert.isTrue(Either.isLeft(unknown), "unknown engine refused")
      if (Either.isLeft(unknown)) {
        assert.strictEqual(unknown.left.code, "invalid_command")
        assert.include(unknown.left.message, "shout")
      }
      const { activeSessionId } = yield* sm.create({ type: "create", engine: "shout" } as any)
      const conn = new MemoryConnection("c")
      const attached = yield* sm.attach("c", conn, { type: "attach", activeSessionId } as any)
      yield* Effect.forkScoped(attached.deliver)
      yield* sm.prompt({ type: "prompt", activeSessionId, message: "hello embedder" } as any)
      yield* waitFor("the turn's end", () => conn.sequenced().some((l) => l["event"]?.type === "agent_end"), 20_000)
      const { messages } = yield* sm.getMessages({ type: "get_messages", activeSessionId } as any)
      assert.deepStrictEqual(messages.map((m) => m.content), ["hello embedder", "HELLO EMBEDDER"])
      // A real process (the shout engine's answer above comes from the embedder's entry), which
      // titles itself with the session it runs.
      const pid = (yield* sm.getState(activeSessionId)).workerPid!
      assert.strictEqual(fs.realpathSync(`/proc/${pid}/exe`), fs.realpathSync(process.execPath))
      assert.include(fs.readFileSync(`/proc/${pid}/cmdline`, "utf8"), `${WORKER_TITLE_PREFIX}${workerTitleKey(activeSessionId)}`)
      // The built-in engine is still there.
      const echo = yield* sm.create({ type: "create", engine: "echo" } as any)
      assert.strictEqual(echo.state.engine, "echo")
    }).pipe(Effect.scoped), 30_000)

  it.live("the core without the socket server: SessionManager + file storage + real workers run a turn and restore a killed worker, the socket path never touched", () =>
    Effect.gen(function*() {
      const root = fs.mkdtempSync(path.join(os.tmpdir(), "agentd-core-"))
      yield* Effect.addFinalizer(() => Effect.sync(() => fs.rmSync(root, { recursive: true, force: true })))
      // A socket path no server could claim (a regular file): the core must not need it.
      const socketPath = path.join(root, "not-a-socket")
      fs.writeFileSync(socketPath, "left alone\n")
      const stateDir = path.join(root, "state")
      const context = yield* Layer.build(CoreLive({ stateDir, socketPath, workerEntry: builtWorker }))
      const sm = yield* Effect.provide(SessionManager, context)
      const { activeSessionId } = yield* sm.create({ type: "create" } as any)
      const conn = new MemoryConnection("in-process")
      const attached = yield* sm.attach("in-process", conn, { type: "attach", activeSessionId } as any)
      yield* Effect.forkScoped(attached.deliver)
      const turnEnds = () => conn.sequenced().filter((l) => l["event"]?.type === "agent_end").length
      yield* sm.prompt({ type: "prompt", activeSessionId, message: "no socket here" } as any)
      yield* waitFor("the first turn's end", () => turnEnds() === 1, 20_000)
      yield* sm.checkpoint(activeSessionId)
      // A real worker process: killed, it is restored by the supervisor from the file storage.
      const pid = (yield* sm.getState(activeSessionId)).workerPid!
      assert.strictEqual(fs.realpathSync(`/proc/${pid}/exe`), fs.realpathSync(process.execPath))
      assert.include(fs.readFileSync(`/proc/${pid}/cmdline`, "utf8"), `${WORKER_TITLE_PREFIX}${workerTitleKey(activeSessionId)}`)
      process.kill(pid, "SIGKILL")
      yield* waitFor("the restored worker", () =>
        conn.sequenced().some((l) => l["type"] === "session_status" && l["state"]?.worker === "ready" && l["state"]?.workerPid !== pid), 20_000)
      yield* sm.prompt({ type: "prompt", activeSessionId, message: "/compact" } as any)
      yield* waitFor("the second turn's end", () => turnEnds() === 2, 20_000)
      const { messages } = yield* sm.getMessages({ type: "get_messages", activeSessionId } as any)
      // The restored worker held both messages of the first turn (and counts its own prompt).
      assert.deepStrictEqual(messages.map((m) => m.content), ["compacted 3 messages"])
      assert.strictEqual(fs.readFileSync(socketPath, "utf8"), "left alone\n")
      assert.isFalse(fs.existsSync(path.join(stateDir, "agentd.sock")))
    }).pipe(Effect.scoped), 60_000)
})
