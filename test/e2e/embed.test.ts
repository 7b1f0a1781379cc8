/**
 * Embedding: an app's own engine runs in real worker processes. The daemon's layers are built
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
import { DaemonLive } from "../../src/Daemon.js"
import { SessionManager } from "../../src/SessionManager.js"
import * as ShoutEngine from "../fixtures/shoutEngine.js"
import { MemoryConnection, waitFor } from "../support/core.js"

const workerEntry = path.resolve(path.dirname(fileURLToPath(import.meta.url)), "..", "..", "dist", "test", "fixtures", "shoutWorker.js")

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
      // A real process, started from the embedder's entry.
      const pid = (yield* sm.getState(activeSessionId)).workerPid!
      assert.include(fs.readFileSync(`/proc/${pid}/cmdline`, "utf8"), "shoutWorker.js")
      // The built-in engine is still there.
      const echo = yield* sm.create({ type: "create", engine: "echo" } as any)
      assert.strictEqual(echo.state.engine, "echo")
    }).pipe(Effect.scoped), 30_000)
})
