/**
 * What a cluster runner asks of its SessionManager (docs/cluster.md): a manager built with
 * `LoadAtStart` false loads no session; `evict` drops a session mid-turn without writing anything
 * for it (its worker killed, a command waiting in it answered `internal`); `adopt` loads it as a
 * daemon start does, and restores at once one whose shared log says a turn was running (the
 * journal a runner read at its start cannot say it). In-process workers, memory storage shared
 * by two cores one after the other, as two runners share the store.
 */
import { assert, describe, it } from "@effect/vitest"
import * as Effect from "effect/Effect"
import * as Either from "effect/Either"
import * as Fiber from "effect/Fiber"
import * as Stream from "effect/Stream"
import { EventLog } from "../src/EventLog.js"
import { LoadAtStart, SessionManager } from "../src/SessionManager.js"
import { WorkerPool } from "../src/WorkerPool.js"
import { makeStored, MemoryConnection, settle, until, withCore } from "./support/core.js"

describe("SessionManager for a cluster runner", () => {
  it.scopedLive("evict drops a session mid-turn and writes nothing; a manager that loads none at start adopts it, its cut turn ended daemon_restarted", () =>
    Effect.gen(function*() {
      const stored = yield* makeStored
      const { id, lastBefore } = yield* withCore({}, () =>
        Effect.gen(function*() {
          const sm = yield* SessionManager
          const pool = yield* WorkerPool
          const log = yield* EventLog
          const { activeSessionId: id } = yield* sm.create({ type: "create" } as any)
          const conn = new MemoryConnection("c1")
          const outcome = yield* sm.attach("c1", conn, { type: "attach", activeSessionId: id } as any)
          yield* Effect.forkScoped(outcome.deliver)
          yield* sm.prompt({ type: "prompt", activeSessionId: id, message: "/sleep 60000" } as any)
          yield* until("tool_execution_start", () => conn.sequenced().some((l) => l["event"]?.type === "tool_execution_start"))
          // A checkpoint waits for the turn's end: it must still get its one answer.
          const waiting = yield* Effect.fork(Effect.either(sm.checkpoint(id)))
          yield* settle
          const lastBefore = yield* log.lastCursor(id)
          assert.isTrue(sm.holds(id))

          yield* sm.evict(id)
          assert.isFalse(sm.holds(id))
          assert.deepStrictEqual((yield* pool.live).filter((w) => w.activeSessionId === id), [])
          const answer = yield* Fiber.join(waiting)
          assert.isTrue(Either.isLeft(answer) && answer.left.code === "internal" && answer.left.message.includes("left this runner"), JSON.stringify(answer))
          const gone = yield* Effect.either(sm.getState(id))
          assert.isTrue(Either.isLeft(gone) && gone.left.code === "session_not_found")
          // Nothing was written for it: the next owner finds the log as the turn left it.
          assert.deepStrictEqual(yield* log.lastCursor(id), lastBefore)
          return { id, lastBefore }
        }), stored)

      yield* withCore({}, () =>
        Effect.gen(function*() {
          const sm = yield* SessionManager
          const log = yield* EventLog
          assert.deepStrictEqual((yield* sm.list).sessions, [])
          assert.isFalse(sm.holds(id))
          yield* sm.adopt("s-no-such-session")
          assert.isFalse(sm.holds("s-no-such-session"))

          yield* sm.adopt(id)
          assert.isTrue(sm.holds(id))
          yield* sm.adopt(id) // held already: untouched
          const until_ = (what: string, f: (s: { busy: boolean; worker: string }) => boolean) =>
            Effect.gen(function*() {
              for (let i = 0; i < 2000; i++) {
                if (f(yield* sm.getState(id))) return
                yield* Effect.sleep("5 millis")
              }
              assert.fail(what)
            })
          yield* until_("restored and idle", (s) => s.worker === "ready" && !s.busy)
          const after = yield* Stream.runCollect(log.read(id, lastBefore._tag === "Some" ? lastBefore.value : undefined))
          const bodies = Array.from(after, (r) => r.event as any)
          const interrupted = bodies.filter((b) => b.type === "session_event" && b.event.type === "turn_interrupted").map((b) => b.event.reason)
          assert.deepStrictEqual(interrupted, ["daemon_restarted"])
          // And it takes a new turn.
          yield* sm.prompt({ type: "prompt", activeSessionId: id, message: "again" } as any)
          yield* until_("the new turn's end", (s) => !s.busy)
          assert.strictEqual((yield* sm.getState(id)).messageCount, 3)
        }), stored).pipe(Effect.provideService(LoadAtStart, false))
    }), { timeout: 30_000 })
})
