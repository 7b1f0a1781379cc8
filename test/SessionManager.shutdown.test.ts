/**
 * The session core at a graceful stop (docs/protocol.md sections 4 and 6), in-process: a running
 * turn is cut with `turn_interrupted {daemon_shutdown}` and its idle status, by its worker or,
 * when the worker does not end it in time, by the supervisor; a worker exit while the daemon
 * stops is no crash; a turn cut by a crash whose restore is under way ends with that crash's
 * reason; the journal says idle, so the next start (a second core over the same storage) cuts
 * nothing again. On the TestClock: the supervisor's grace passes only when a test moves the clock.
 */
import { assert, describe, it } from "@effect/vitest"
import * as Context from "effect/Context"
import * as Effect from "effect/Effect"
import * as Fiber from "effect/Fiber"
import * as Option from "effect/Option"
import * as TestClock from "effect/TestClock"
import * as RecoveryJournal from "../src/RecoveryJournal.js"
import { SessionManager } from "../src/SessionManager.js"
import { WorkerPool } from "../src/WorkerPool.js"
import { describeMsg } from "./chaos/streamCheck.js"
import { makeStored, MemoryConnection, settle, until, withCore } from "./support/core.js"

type Line = Record<string, any>
type Manager = SessionManager["Type"]

const seq = (conn: MemoryConnection): Array<Line> => conn.sequenced()
const show = (lines: ReadonlyArray<Line>) => lines.map((l) => describeMsg(l)).join(" ")
/** The messages without their cursors, as describeMsg writes them. */
const plain = (lines: ReadonlyArray<Line>) => lines.map((l) => describeMsg(l).replace(/@.*/, ""))
const statuses = (lines: ReadonlyArray<Line>) =>
  lines.filter((l) => l["type"] === "session_status").map((l) => `${l["state"].worker}/${l["state"].busy ? "busy" : "idle"}`)
const eventTypes = (lines: ReadonlyArray<Line>) => lines.filter((l) => l["type"] === "session_event").map((l) => l["event"].type as string)

const open = (sm: Manager) =>
  Effect.gen(function*() {
    const { activeSessionId: id } = yield* sm.create({ type: "create" } as any)
    const conn = new MemoryConnection("c1")
    const outcome = yield* sm.attach(conn.id, conn, { type: "attach", activeSessionId: id } as any)
    yield* Effect.forkScoped(outcome.deliver)
    yield* until("a ready, idle session", () => statuses(seq(conn)).at(-1) === "ready/idle")
    return { id, conn }
  })

const prompt = (sm: Manager, id: string, message: string) => sm.prompt({ type: "prompt", activeSessionId: id, message } as any)

const journalBusy = (id: string) =>
  Effect.gen(function*() {
    const journal = yield* RecoveryJournal.RecoveryJournal
    return (yield* journal.latest()).get(id)?.busy
  })

describe("SessionManager at a graceful stop (in-process)", () => {
  it.scoped("a turn in a tool call: its worker cuts it (daemon_shutdown), the idle status follows, the journal says idle; later commands are shutting_down", () =>
    withCore({}, () =>
      Effect.gen(function*() {
        const sm = yield* SessionManager
        const { conn, id } = yield* open(sm)
        yield* prompt(sm, id, "/sleep 10000")
        yield* until("tool_execution_start", () => eventTypes(seq(conn)).includes("tool_execution_start"))
        const start = seq(conn).length
        // No time passes (TestClock): settled at all, the worker cut the turn (the supervisor's
        // fallback waits 2 s).
        yield* sm.settleForShutdown
        // Settled once the turn has ended: what it says is logged and delivered by then.
        assert.deepStrictEqual(plain(seq(conn).slice(start)), ["ev:turn_interrupted(daemon_shutdown)", "status(busy=false,worker=ready)"], show(seq(conn)))
        assert.isFalse(yield* journalBusy(id))
        const refused = yield* Effect.either(prompt(sm, id, "more"))
        assert.strictEqual(refused._tag === "Left" ? refused.left.code : "accepted", "shutting_down")
        // Settling again (the server's finalizer after a `shutdown`) adds nothing.
        yield* sm.settleForShutdown
        assert.strictEqual(seq(conn).length, start + 2)
      })))

  it.scoped("a worker that does not end its turn when asked: the supervisor cuts it after its grace; what the worker says later is not the session's", () =>
    withCore({}, (ctl) =>
      Effect.gen(function*() {
        const sm = yield* SessionManager
        const { conn, id } = yield* open(sm)
        ctl.holdGate.close()
        // Interrupted while it holds, the turn's end waits at the cut gate: the worker hangs.
        ctl.cutGate.close()
        yield* prompt(sm, id, "/hold")
        yield* until("the turn held", () => ctl.holdGate.waiting === 1)
        yield* until("the held turn's user message out", () => eventTypes(seq(conn)).includes("message_end"))
        const start = seq(conn).length
        const settling = yield* Effect.fork(sm.settleForShutdown)
        yield* until("the worker asked to cut its turn", () => ctl.cutGate.waiting === 1)
        yield* TestClock.adjust("1999 millis")
        yield* settle
        assert.isTrue(Option.isNone(yield* Fiber.poll(settling)), "the supervisor waits for the worker first (2 s)")
        assert.strictEqual(seq(conn).length, start, show(seq(conn)))
        yield* TestClock.adjust("1 millis")
        yield* Fiber.join(settling)
        assert.deepStrictEqual(plain(seq(conn).slice(start)), ["ev:turn_interrupted(daemon_shutdown)", "status(busy=false,worker=passivated)"], show(seq(conn)))
        assert.isFalse(yield* journalBusy(id))
        const state = yield* sm.getState(id)
        assert.isFalse(state.busy)
        // The worker, let go, ends its turn its own way: nothing more is logged.
        ctl.cutGate.open()
        ctl.holdGate.open()
        yield* until("the worker's turn ended its own way", () => ctl.cutGate.stopped === 1 && ctl.cutGate.waiting === 0)
        yield* settle
        assert.strictEqual(seq(conn).length, start + 2, show(seq(conn)))
      })))

  it.scoped("a worker that exits while the daemon stops is no crash: no recovering, the turn ends daemon_shutdown", () =>
    withCore({}, (ctl) =>
      Effect.gen(function*() {
        const sm = yield* SessionManager
        const pool = yield* WorkerPool
        const { conn, id } = yield* open(sm)
        ctl.holdGate.close()
        ctl.cutGate.close()
        yield* prompt(sm, id, "/hold")
        yield* until("the turn held", () => ctl.holdGate.waiting === 1)
        yield* until("the held turn's user message out", () => eventTypes(seq(conn)).includes("message_end"))
        const start = seq(conn).length
        const settling = yield* Effect.fork(sm.settleForShutdown)
        yield* until("the worker asked to cut its turn", () => ctl.cutGate.waiting === 1)
        const [worker] = yield* pool.live
        worker!.kill()
        yield* Fiber.join(settling)
        const after = seq(conn).slice(start)
        assert.deepStrictEqual(plain(after), ["ev:turn_interrupted(daemon_shutdown)", "status(busy=false,worker=passivated)"], show(after))
        assert.strictEqual((yield* sm.getState(id)).restarts, 0)
        assert.isFalse(yield* journalBusy(id))
      })))

  it.scoped("a turn cut by a crash whose restore is under way ends then with the crash's reason and its idle status; the next start cuts nothing again", () =>
    Effect.gen(function*() {
      const stored = yield* makeStored
      const before = yield* withCore({}, (ctl) =>
        Effect.gen(function*() {
          const sm = yield* SessionManager
          const pool = yield* WorkerPool
          const { conn, id } = yield* open(sm)
          yield* prompt(sm, id, "/sleep 10000")
          yield* until("tool_execution_start", () => eventTypes(seq(conn)).includes("tool_execution_start"))
          // The replacement is held while it loads: the cut turn's end is still owed.
          ctl.loadGate.close()
          const start = seq(conn).length
          const [worker] = yield* pool.live
          worker!.kill()
          yield* until("recovering", () => statuses(seq(conn).slice(start)).includes("recovering/busy"))
          yield* until("the replacement loading", () => ctl.loadGate.waiting === 1)
          yield* sm.settleForShutdown
          assert.deepStrictEqual(plain(seq(conn).slice(start)), [
            "status(busy=true,worker=recovering)",
            "ev:turn_interrupted(worker_crashed)",
            "status(busy=false,worker=passivated)"
          ], show(seq(conn)))
          assert.isFalse(yield* journalBusy(id))
          return { id, lines: seq(conn) }
        }), stored)
      // The next start: the session is idle, nothing is added to its history.
      yield* withCore({}, () =>
        Effect.gen(function*() {
          const sm = yield* SessionManager
          const c = new MemoryConnection("c2")
          const outcome = yield* sm.attach(c.id, c, { type: "attach", activeSessionId: before.id, resumeCursor: before.lines.at(-1)!["meta"].cursor } as any)
          yield* Effect.forkScoped(outcome.deliver)
          assert.strictEqual(outcome.data.replay.status, "complete")
          const state = yield* sm.getState(before.id)
          assert.isFalse(state.busy)
          assert.strictEqual(state.worker, "passivated")
          yield* settle
          assert.deepStrictEqual(seq(c), [], show(seq(c)))
          assert.isFalse((yield* Context.get(stored, RecoveryJournal.RecoveryJournal).latest()).get(before.id)?.busy)
        }), stored)
    }))
})
