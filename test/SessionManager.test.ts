import { assert, describe, it } from "@effect/vitest"
import * as Effect from "effect/Effect"
import { SessionManager } from "../src/SessionManager.js"
import { WorkerPool } from "../src/WorkerPool.js"
import { coreLayer, MemoryConnection, waitFor } from "./support/core.js"

describe("SessionManager (in-process)", () => {
  it.scopedLive("a prompt runs a turn; a killed worker is restored and the session goes on", () =>
    Effect.gen(function*() {
      const sm = yield* SessionManager
      const pool = yield* WorkerPool
      const { activeSessionId } = yield* sm.create({ type: "create" } as any)
      const conn = new MemoryConnection("c1")
      const outcome = yield* sm.attach("c1", conn, { type: "attach", activeSessionId } as any)
      yield* Effect.forkScoped(outcome.deliver)
      yield* sm.prompt({ type: "prompt", activeSessionId, message: "hello" } as any)
      yield* waitFor("agent_end", () => conn.sequenced().some((l) => l.event?.type === "agent_end"))
      const [worker] = yield* pool.live
      worker!.kill()
      yield* waitFor("recovering, then ready", () => {
        const workers = conn.sequenced().filter((l) => l.type === "session_status").map((l) => l.state.worker)
        return workers.lastIndexOf("ready") > workers.indexOf("recovering") && workers.includes("recovering")
      })
      yield* sm.prompt({ type: "prompt", activeSessionId, message: "again" } as any)
      yield* waitFor("second agent_end", () => conn.sequenced().filter((l) => l.event?.type === "agent_end").length === 2)
      const state = yield* sm.getState(activeSessionId)
      assert.strictEqual(state.messageCount, 4)
      assert.strictEqual(state.restarts, 1)
    }).pipe(Effect.provide(coreLayer())))
})
