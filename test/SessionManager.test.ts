/**
 * The session entity in-process (docs/protocol.md sections 3-6, docs/protocol.md section 9): every
 * transition of its Phase, and above all every request that a transition must settle. Workers
 * are fibers of this process (test/support/core.ts); gates hold a worker at a chosen step so that
 * a command lands in a given phase deterministically (no fixed sleeps as synchronisation).
 * Every test runs on the TestClock: no real time passes, a wait is the other fibers running
 * (bounded: what never comes fails the test by name), and a timer fires only when a test moves
 * the clock (a tool call's sleep, a restart's backoff). What `step` decides alone, phase by
 * input, is in test/transition.table.test.ts.
 */
import { assert, describe, it } from "@effect/vitest"
import * as Deferred from "effect/Deferred"
import * as Effect from "effect/Effect"
import * as Either from "effect/Either"
import * as Fiber from "effect/Fiber"
import * as Option from "effect/Option"
import * as Stream from "effect/Stream"
import * as TestClock from "effect/TestClock"
import * as Chunk from "effect/Chunk"
import * as Context from "effect/Context"
import * as Ref from "effect/Ref"
import { EventLog } from "../src/EventLog.js"
import * as RecoveryJournal from "../src/RecoveryJournal.js"
import { type CommandError, CommandTakesEffect, SessionManager } from "../src/SessionManager.js"
import { type WorkerHandle, WorkerPool } from "../src/WorkerPool.js"
import { describeMsg } from "./chaos/streamCheck.js"
import * as SessionStore from "../src/SessionStore.js"
import { coreLayer, Gate, makeStored, MemoryConnection, settle, type SpawnControl, until, waitUntil, withCore } from "./support/core.js"

// ---------------------------------------------------------------------------------------------
// Helpers
// ---------------------------------------------------------------------------------------------

type Line = Record<string, any>
type Manager = SessionManager["Type"]

const seq = (conn: MemoryConnection): Array<Line> => conn.sequenced()
const cur = (l: Line) => `${l["meta"].cursor.generation}:${l["meta"].cursor.sequence}`
const cursors = (lines: ReadonlyArray<Line>) => lines.map(cur)
const show = (lines: ReadonlyArray<Line>) => lines.map((l) => describeMsg(l)).join(" ")
const statusOf = (l: Line) => `${l["state"].worker}/${l["state"].busy ? "busy" : "idle"}`
const statuses = (lines: ReadonlyArray<Line>) => lines.filter((l) => l["type"] === "session_status").map(statusOf)
/** Consecutive equal entries folded into one (a repeated status says nothing new). */
const dedupe = (xs: ReadonlyArray<string>) => xs.filter((x, i) => i === 0 || xs[i - 1] !== x)
const events = (lines: ReadonlyArray<Line>) => lines.filter((l) => l["type"] === "session_event").map((l) => l["event"])
const eventTypes = (lines: ReadonlyArray<Line>) => events(lines).map((e) => e.type as string)
const isTurnEnd = (l: Line) =>
  l["type"] === "session_event" && (l["event"].type === "agent_end" || l["event"].type === "turn_interrupted")
/** Without `meta.replayed` (and `emittedAt`): what two clients must agree on. */
const body = (l: Line) => JSON.stringify({ ...l, meta: { cursor: l["meta"].cursor } })

/** Turns whose end (agent_end or turn_interrupted) was followed by an idle status. */
const turnsDone = (lines: ReadonlyArray<Line>) => {
  let done = 0
  let ended = false
  for (const l of lines) {
    if (isTurnEnd(l)) ended = true
    else if (ended && l["type"] === "session_status" && l["state"].busy === false) {
      done++
      ended = false
    }
  }
  return done
}

/**
 * Every consecutive pair of cursors is contiguous: the next sequence of the same generation,
 * or sequence 0 of a later generation (`strictGenerations`: of the next one).
 */
const assertContiguous = (lines: ReadonlyArray<Line>, strictGenerations = false) => {
  for (let i = 1; i < lines.length; i++) {
    const a = lines[i - 1]!["meta"].cursor
    const b = lines[i]!["meta"].cursor
    const ok = a.generation === b.generation
      ? b.sequence === a.sequence + 1
      : b.generation > a.generation && b.sequence === 0 && (!strictGenerations || b.generation === a.generation + 1)
    if (!ok) assert.fail(`cursor gap or duplicate between ${cur(lines[i - 1]!)} and ${cur(lines[i]!)}: ${show(lines)}`)
  }
}

/** A connection that saw everything from the start saw exactly the event log (nothing pruned). */
const assertMatchesLog = (id: string, lines: ReadonlyArray<Line>) =>
  Effect.gen(function*() {
    const log = yield* EventLog
    const records = Chunk.toReadonlyArray(yield* Stream.runCollect(log.read(id)).pipe(Effect.orDie))
    assert.deepStrictEqual(
      cursors(lines),
      records.map((r) => `${r.cursor.generation}:${r.cursor.sequence}`),
      `the client's cursors are the log's: ${show(lines)}`
    )
  })

const create = (sm: Manager) => sm.create({ type: "create" } as any)
const prompt = (sm: Manager, id: string, message: string) =>
  sm.prompt({ type: "prompt", activeSessionId: id, message } as any)
const abort = (sm: Manager, id: string) => sm.abort({ type: "abort", activeSessionId: id } as any)
const messagesOf = (sm: Manager, id: string) =>
  Effect.map(sm.getMessages({ type: "get_messages", activeSessionId: id, limit: 1000 } as any), (r) => ({
    total: r.total,
    contents: r.messages.map((m) => `${m.role}:${m.content}`),
    ids: r.messages.map((m) => m.id)
  }))

/** Attaches `conn` (delivery forked into the test's scope). */
const attach = (sm: Manager, id: string, conn: MemoryConnection, extra: Record<string, unknown> = {}) =>
  Effect.gen(function*() {
    const outcome = yield* sm.attach(conn.id, conn, { type: "attach", activeSessionId: id, ...extra } as any)
    yield* Effect.forkScoped(outcome.deliver)
    return outcome.data
  })

/** A new session with a connection attached from its start. */
const open = (sm: Manager, name = "c1") =>
  Effect.gen(function*() {
    const created = yield* create(sm)
    const conn = new MemoryConnection(name)
    yield* attach(sm, created.activeSessionId, conn)
    return { id: created.activeSessionId, conn, created }
  })

/**
 * Time passes while the test waits (forked into the test's scope): 10 ms of the TestClock each
 * time the fibers had a chance to run. For tests that go through restart backoffs without
 * being about their timing (the backoff test is).
 */
const ticking = Effect.forkScoped(Effect.forever(Effect.zipRight(settle, TestClock.adjust("10 millis"))))

const waitReady = (conn: MemoryConnection) => until("a ready, idle session", () => statuses(seq(conn)).at(-1) === "ready/idle")

/** A new session in the middle of a turn: the tool call of its `/sleep 10000` has started. */
const openInToolCall = (sm: Manager) =>
  Effect.gen(function*() {
    const { conn, id } = yield* open(sm)
    yield* waitReady(conn)
    yield* prompt(sm, id, "/sleep 10000")
    yield* until("tool_execution_start", () => eventTypes(seq(conn)).includes("tool_execution_start"))
    return { conn, id }
  })

/** Prompts and waits for the turn's end and its idle status. */
const runTurn = (sm: Manager, id: string, conn: MemoryConnection, message: string) =>
  Effect.gen(function*() {
    const before = turnsDone(seq(conn))
    const accepted = yield* prompt(sm, id, message)
    assert.deepStrictEqual(accepted, { accepted: true })
    yield* until(`the end of turn "${message}"`, () => turnsDone(seq(conn)) > before)
  })

/** Joins a fiber, failing the test if it is never done while the core runs (a request left hanging). */
const joinWithin = <A, E>(what: string, fiber: Fiber.Fiber<A, E>) =>
  Effect.zipRight(
    waitUntil(`${what} answered`, Effect.map(Fiber.poll(fiber), Option.isSome)).pipe(
      Effect.catchAllDefect(() => Effect.dieMessage(`${what} was never answered`))
    ),
    Effect.either(Fiber.join(fiber))
  )

/** The error code of a request that must fail. */
const expectCode = <A>(what: string, outcome: Either.Either<A, CommandError>, code: string) => {
  if (Either.isRight(outcome)) return assert.fail(`${what}: expected ${code}, got ${JSON.stringify(outcome.right)}`)
  assert.strictEqual(outcome.left.code, code, `${what}: ${outcome.left.message}`)
}
const failsWith = <A, R>(what: string, effect: Effect.Effect<A, CommandError, R>, code: string) =>
  Effect.map(Effect.either(effect), (outcome) => expectCode(what, outcome, code))

/** A new session whose worker's spawn is held at the gate, and `send` (a prompt) forked: the session reserved. */
const promptWhileSpawnHeld = <A, E>(sm: Manager, ctl: SpawnControl, send: (id: string) => Effect.Effect<A, E>) =>
  Effect.gen(function*() {
    ctl.spawnGate.close()
    const { conn, id } = yield* open(sm)
    yield* until("the spawn held", () => ctl.spawnGate.waiting === 1)
    const first = yield* Effect.fork(send(id))
    yield* waitUntil("the prompt reserved the session", Effect.map(sm.getState(id), (s) => s.busy))
    return { conn, id, first }
  })
const isPending = <A, E>(fiber: Fiber.Fiber<A, E>) => Effect.map(Fiber.poll(fiber), Option.isNone)

/** The session's live worker (the one the pool runs for it). */
const workerOf = (id: string) =>
  Effect.gen(function*() {
    const pool = yield* WorkerPool
    const all: Array<WorkerHandle> = []
    for (const w of yield* pool.live) {
      if (w.activeSessionId === id && !w.stopping && !(yield* Deferred.isDone(w.exited))) all.push(w)
    }
    assert.strictEqual(all.length, 1, `one live worker for ${id}`)
    return all[0]!
  })

/**
 * A request that goes through the session's mailbox: once answered, every earlier input was
 * handled. (`retry_worker` changes nothing unless the session has failed: never used then.)
 */
const barrier = (sm: Manager, id: string) => Effect.ignore(sm.retryWorker(id))

/** Rounds of the abort-versus-natural-end race (AGENTD_TEST_ABORT_RACES; small by default, the suite is on a budget). */
const ABORT_RACES = Number(process.env["AGENTD_TEST_ABORT_RACES"] ?? 18)

/** Lines after the `n` first sequenced ones. */
const since = (conn: MemoryConnection, n: number) => seq(conn).slice(n)

// ---------------------------------------------------------------------------------------------

describe("SessionManager (in-process)", () => {
  it.scoped("a prompt runs a turn; a killed worker is restored and the session goes on", () =>
    withCore({}, () =>
      Effect.gen(function*() {
        const sm = yield* SessionManager
        const pool = yield* WorkerPool
        const { activeSessionId } = yield* sm.create({ type: "create" } as any)
        const conn = new MemoryConnection("c1")
        const outcome = yield* sm.attach("c1", conn, { type: "attach", activeSessionId } as any)
        yield* Effect.forkScoped(outcome.deliver)
        yield* sm.prompt({ type: "prompt", activeSessionId, message: "hello" } as any)
        yield* until("agent_end", () => conn.sequenced().some((l) => l.event?.type === "agent_end"))
        const [worker] = yield* pool.live
        worker!.kill()
        yield* until("recovering, then ready", () => {
          const workers = conn.sequenced().filter((l) => l.type === "session_status").map((l) => l.state.worker)
          return workers.lastIndexOf("ready") > workers.indexOf("recovering") && workers.includes("recovering")
        })
        yield* sm.prompt({ type: "prompt", activeSessionId, message: "again" } as any)
        yield* until("second agent_end", () => conn.sequenced().filter((l) => l.event?.type === "agent_end").length === 2)
        const state = yield* sm.getState(activeSessionId)
        assert.strictEqual(state.messageCount, 4)
        assert.strictEqual(state.restarts, 1)
      })))

  describe("start and prompt", () => {
    it.scoped("create with a config too deeply nested to store: invalid_command, and no session is left", () =>
      withCore({}, () =>
        Effect.gen(function*() {
          const sm = yield* SessionManager
          let config: Record<string, unknown> = {}
          for (let i = 0; i < 20_000; i++) config = { a: config }
          const refused = yield* Effect.either(sm.create({ type: "create", config: { deep: config } } as any))
          assert.isTrue(Either.isLeft(refused))
          if (Either.isLeft(refused)) assert.strictEqual(refused.left.code, "invalid_command")
          assert.deepStrictEqual((yield* sm.list).sessions, [])
        })))

    it.scoped("create answers `starting`; the worker's `ready` status is the first event (1:0), idle", () =>
      withCore({}, () =>
        Effect.gen(function*() {
          const sm = yield* SessionManager
          const { conn, created, id } = yield* open(sm)
          assert.strictEqual(created.state.worker, "starting")
          assert.isFalse(created.state.busy)
          assert.strictEqual(created.state.messageCount, 0)
          assert.strictEqual(created.state.restarts, 0)
          assert.isUndefined(created.state.lastEventCursor)
          yield* waitReady(conn)
          assert.deepStrictEqual(cursors(seq(conn)), ["1:0"])
          assert.deepStrictEqual(statuses(seq(conn)), ["ready/idle"])
          const state = yield* sm.getState(id)
          assert.strictEqual(state.worker, "ready")
          assert.isFalse(state.busy)
          assert.isNumber(state.workerPid)
          assert.deepStrictEqual(state.lastEventCursor, { generation: 1, sequence: 0 })
          assert.deepStrictEqual((yield* sm.list).sessions.map((s) => s.activeSessionId), [id])
        })))

    it.scoped("a tagged prompt sent again while the first waits for its worker gets the first's answer, and one turn runs; a new id is session_busy", () =>
      withCore({}, (ctl) =>
        Effect.gen(function*() {
          const sm = yield* SessionManager
          const tagged = (id: string, promptId: string) => sm.prompt({ type: "prompt", activeSessionId: id, message: "hello", promptId } as any)
          const { conn, id, first } = yield* promptWhileSpawnHeld(sm, ctl, (id) => tagged(id, "p-1"))
          const again = yield* Effect.fork(tagged(id, "p-1"))
          yield* failsWith("another id while one is reserved", tagged(id, "p-2"), "session_busy")
          assert.isTrue(yield* isPending(again), "the resend waits for the first's answer")
          ctl.spawnGate.open()
          assert.deepStrictEqual(yield* joinWithin("the first", first), Either.right({ accepted: true as const }))
          assert.deepStrictEqual(yield* joinWithin("the resend", again), Either.right({ accepted: true as const }))
          yield* until("the turn's end", () => turnsDone(seq(conn)) === 1)
          // Once its turn started, the id is answered at once, without a turn.
          assert.deepStrictEqual(yield* tagged(id, "p-1"), { accepted: true })
          yield* settle
          assert.strictEqual(turnsDone(seq(conn)), 1)
          assert.strictEqual((yield* sm.getState(id)).messageCount, 2)
          assert.deepStrictEqual(seq(conn).filter((l) => l["promptId"] !== undefined).map((l) => l["promptId"]), ["p-1"])
        })))

    it.scoped("a prompt reserved while the worker starts runs once, when it is ready; meanwhile a second prompt is session_busy and abort is {aborted:false}", () =>
      withCore({}, (ctl) =>
        Effect.gen(function*() {
          const sm = yield* SessionManager
          const { conn, id, first } = yield* promptWhileSpawnHeld(sm, ctl, (id) => prompt(sm, id, "hello world"))
          assert.deepStrictEqual(statuses(seq(conn)), ["starting/busy"])
          yield* failsWith("a second prompt while one is reserved", prompt(sm, id, "other"), "session_busy")
          assert.deepStrictEqual(yield* abort(sm, id), { aborted: false })
          assert.isTrue(yield* isPending(first), "the reserved prompt waits for the worker")
          ctl.spawnGate.open()
          const answer = yield* joinWithin("the reserved prompt", first)
          assert.deepStrictEqual(answer, Either.right({ accepted: true as const }))
          yield* until("the turn's end", () => turnsDone(seq(conn)) === 1)
          const lines = seq(conn)
          assert.deepStrictEqual(dedupe(statuses(lines)), ["starting/busy", "ready/busy", "ready/idle"], show(lines))
          assert.deepStrictEqual(eventTypes(lines), [
            "agent_start",
            "turn_start",
            "message_start",
            "message_end",
            "message_start",
            "message_update",
            "message_update",
            "message_update",
            "message_end",
            "turn_end",
            "agent_end"
          ])
          // The turn's busy status comes before its first event, its idle status last.
          const agentStart = lines.findIndex((l) => l["event"]?.type === "agent_start")
          assert.strictEqual(statusOf(lines[agentStart - 1]!), "ready/busy")
          assert.strictEqual(statusOf(lines.at(-1)!), "ready/idle")
          assertContiguous(lines, true)
          yield* assertMatchesLog(id, lines)
          assert.deepStrictEqual((yield* messagesOf(sm, id)).contents, ["user:hello world", "assistant:echo: hello world"])
          assert.strictEqual(yield* Ref.get(ctl.starts), 1)
          const state = yield* sm.getState(id)
          assert.isFalse(state.busy)
          assert.strictEqual(state.messageCount, 2)
        })))

    it.scoped("a prompt during a turn is session_busy; once the turn's idle status is out the next is accepted", () =>
      withCore({}, (ctl) =>
        Effect.gen(function*() {
          const sm = yield* SessionManager
          const { conn, id } = yield* open(sm)
          yield* waitReady(conn)
          ctl.holdGate.close()
          assert.deepStrictEqual(yield* prompt(sm, id, "/hold"), { accepted: true })
          yield* failsWith("a prompt during a turn", prompt(sm, id, "x"), "session_busy")
          assert.isTrue((yield* sm.getState(id)).busy)
          ctl.holdGate.open()
          yield* until("the held turn's end", () => turnsDone(seq(conn)) === 1)
          assert.isFalse((yield* sm.getState(id)).busy)
          yield* runTurn(sm, id, conn, "next")
          assert.deepStrictEqual((yield* messagesOf(sm, id)).contents, [
            "user:/hold",
            "assistant:held",
            "user:next",
            "assistant:echo: next"
          ])
          assertContiguous(seq(conn), true)
        })))
  })

  describe("abort", () => {
    it.scoped("with no turn running: {aborted:false} at once, and nothing is logged", () =>
      withCore({}, () =>
        Effect.gen(function*() {
          const sm = yield* SessionManager
          const { conn, id } = yield* open(sm)
          yield* waitReady(conn)
          yield* runTurn(sm, id, conn, "one")
          const before = seq(conn).length
          assert.deepStrictEqual(yield* abort(sm, id), { aborted: false })
          yield* barrier(sm, id)
          assert.strictEqual(seq(conn).length, before)
          assert.isFalse((yield* sm.getState(id)).busy)
        })))

    it.scoped("during a /sleep turn: {aborted:true}, the turn ends with turn_interrupted{aborted}, then one idle status", () =>
      withCore({}, () =>
        Effect.gen(function*() {
          const sm = yield* SessionManager
          const { conn, id } = yield* open(sm)
          yield* waitReady(conn)
          const start = seq(conn).length
          yield* prompt(sm, id, "/sleep 10000")
          yield* until("tool_execution_start", () => eventTypes(seq(conn)).includes("tool_execution_start"))
          // No time passes (TestClock): an answer at all says the sleep was cut, not waited for.
          assert.deepStrictEqual(yield* abort(sm, id), { aborted: true })
          yield* until("the idle status", () => turnsDone(seq(conn)) === 1)
          const turn = since(conn, start)
          assert.deepStrictEqual(eventTypes(turn), [
            "agent_start",
            "turn_start",
            "message_start",
            "message_end",
            "tool_execution_start",
            "turn_interrupted"
          ], show(turn))
          assert.deepStrictEqual(events(turn).at(-1), { type: "turn_interrupted", reason: "aborted" })
          const end = turn.findIndex(isTurnEnd)
          assert.deepStrictEqual(turn.slice(end + 1).map(statusOf), ["ready/idle"], show(turn))
          assert.isFalse((yield* sm.getState(id)).busy)
          assert.deepStrictEqual((yield* messagesOf(sm, id)).contents, ["user:/sleep 10000"])
          yield* runTurn(sm, id, conn, "after")
          assertContiguous(seq(conn), true)
          yield* assertMatchesLog(id, seq(conn))
        })))

    it.scoped("an abort waits for a turn that cannot be cut yet; two aborts get the same answer", () =>
      withCore({}, (ctl) =>
        Effect.gen(function*() {
          const sm = yield* SessionManager
          const { conn, id } = yield* open(sm)
          yield* waitReady(conn)
          ctl.holdGate.close()
          ctl.cutGate.close()
          yield* prompt(sm, id, "/hold")
          yield* until("the hold", () => ctl.holdGate.waiting === 1)
          const a1 = yield* Effect.fork(abort(sm, id))
          const a2 = yield* Effect.fork(abort(sm, id))
          // The worker cuts the turn, whose end waits at the cut gate.
          yield* until("the turn being cut", () => ctl.cutGate.waiting === 1)
          yield* barrier(sm, id)
          assert.isTrue(yield* isPending(a1), "an abort is answered at its turn's end")
          assert.isTrue(yield* isPending(a2))
          assert.isTrue((yield* sm.getState(id)).busy)
          ctl.cutGate.open()
          assert.deepStrictEqual(yield* joinWithin("abort 1", a1), Either.right({ aborted: true }), show(seq(conn)))
          assert.deepStrictEqual(yield* joinWithin("abort 2", a2), Either.right({ aborted: true }))
          yield* until("the idle status", () => turnsDone(seq(conn)) === 1)
          const lines = seq(conn)
          assert.deepStrictEqual(events(lines).filter((e) => e.type === "turn_interrupted"), [{
            type: "turn_interrupted",
            reason: "aborted"
          }])
          assert.notInclude(eventTypes(lines), "agent_end")
          assert.isFalse((yield* sm.getState(id)).busy)
        })))

    it.scoped("an abort that reaches the worker after its agent_end (not yet read by the supervisor): {aborted:false}, the turn ends with agent_end only", () =>
      withCore({}, (ctl) =>
        Effect.gen(function*() {
          const sm = yield* SessionManager
          const { conn, id } = yield* open(sm)
          yield* waitReady(conn)
          const start = seq(conn).length
          ctl.frameGate.close()
          yield* prompt(sm, id, "quick one")
          // The worker has written the whole turn; the supervisor has read none of it.
          yield* waitUntil("the worker's turn over", Effect.map(Ref.get(ctl.turnsEnded), (n) => n === 1))
          const aborting = yield* Effect.fork(abort(sm, id))
          yield* barrier(sm, id)
          assert.isTrue(yield* isPending(aborting), "the turn is running for the supervisor")
          ctl.frameGate.open()
          assert.deepStrictEqual(yield* joinWithin("the abort", aborting), Either.right({ aborted: false }))
          yield* until("the idle status", () => turnsDone(since(conn, start)) === 1)
          const turn = since(conn, start)
          assert.deepStrictEqual(eventTypes(turn).filter((t) => t === "agent_end" || t === "turn_interrupted"), ["agent_end"], show(turn))
          assert.strictEqual(statusOf(turn.at(-1)!), "ready/idle")
          assert.deepStrictEqual((yield* messagesOf(sm, id)).contents, ["user:quick one", "assistant:echo: quick one"])
        })))

    it.scoped("abort racing the turn's natural end: answered once, and `aborted` says how the turn ended", () =>
      withCore({}, () =>
        Effect.gen(function*() {
          const sm = yield* SessionManager
          const { conn, id } = yield* open(sm)
          yield* waitReady(conn)
          const outcomes = { aborted: 0, completed: 0 }
          for (let i = 0; i < ABORT_RACES; i++) {
            const start = seq(conn).length
            const message = i % 2 === 0 ? `/sleep ${i % 3}` : `race ${i}`
            yield* prompt(sm, id, message)
            for (let k = 0; k < i % 9; k++) yield* Effect.yieldNow()
            const [r1, r2] = yield* Effect.all([abort(sm, id), abort(sm, id)], { concurrency: "unbounded" })
            yield* until(`turn ${i}'s idle status`, () => turnsDone(since(conn, start)) === 1)
            const turn = since(conn, start)
            const ends = events(turn).filter((e) => e.type === "agent_end" || e.type === "turn_interrupted")
            assert.strictEqual(ends.length, 1, `one end for turn ${i}: ${show(turn)}`)
            // An abort answered during the turn says how it ended; one handled after its end
            // finds no turn ({aborted:false}). So: cut exactly when some abort says so.
            if (r1.aborted || r2.aborted) {
              assert.deepStrictEqual(ends[0], { type: "turn_interrupted", reason: "aborted" }, show(turn))
              outcomes.aborted++
            } else {
              assert.deepStrictEqual(ends[0], { type: "agent_end" }, show(turn))
              outcomes.completed++
            }
            assert.strictEqual(statusOf(turn.at(-1)!), "ready/idle")
            assert.strictEqual(turn.filter((l) => l["type"] === "session_status" && !l["state"].busy).length, 1)
            assert.isFalse((yield* sm.getState(id)).busy)
          }
          assertContiguous(seq(conn), true)
          yield* assertMatchesLog(id, seq(conn))
          // Both ends must have been seen (a /sleep is cut, a plain prompt reaches agent_end first).
          assert.isAbove(outcomes.aborted, 0)
          assert.isAbove(outcomes.completed, 0)
        })))
  })

  describe("checkpoint", () => {
    it.scoped("idle: a new generation; attach shows it; cursors go on at generation+1, sequence 0", () =>
      withCore({}, () =>
        Effect.gen(function*() {
          const sm = yield* SessionManager
          const { conn, id } = yield* open(sm)
          yield* waitReady(conn)
          yield* runTurn(sm, id, conn, "a b")
          const lastOfG1 = cur(seq(conn).at(-1)!)
          assert.deepStrictEqual(yield* sm.checkpoint(id), { generation: 2, snapshotId: `${id}~g2` })
          assert.deepStrictEqual((yield* sm.getState(id)).lastEventCursor, seq(conn).at(-1)!["meta"].cursor)
          const c2 = new MemoryConnection("c2")
          const data = yield* attach(sm, id, c2)
          assert.strictEqual(data.snapshot.snapshotId, `${id}~g2`)
          assert.strictEqual(`${data.snapshot.cursor?.generation}:${data.snapshot.cursor?.sequence}`, lastOfG1)
          assert.strictEqual(data.snapshot.messageCount, 2)
          assert.deepStrictEqual(data.snapshot.messages.map((m) => m.content), ["a b", "echo: a b"])
          assert.strictEqual(data.replay.eventCount, 0)
          const before = seq(conn).length
          yield* runTurn(sm, id, conn, "c")
          const g2 = since(conn, before)
          assert.strictEqual(cur(g2[0]!), "2:0")
          assertContiguous(seq(conn), true)
          yield* assertMatchesLog(id, seq(conn))
          yield* until("c2 has the turn", () => seq(c2).length === g2.length)
          assert.deepStrictEqual(cursors(seq(c2)), cursors(g2))
          assert.deepStrictEqual((yield* messagesOf(sm, id)).contents, ["user:a b", "assistant:echo: a b", "user:c", "assistant:echo: c"])
          // A checkpoint with nothing new since the last one still starts a generation (empty).
          assert.deepStrictEqual(yield* sm.checkpoint(id), { generation: 3, snapshotId: `${id}~g3` })
          assert.deepStrictEqual(yield* sm.checkpoint(id), { generation: 4, snapshotId: `${id}~g4` })
          const n = seq(conn).length
          yield* runTurn(sm, id, conn, "d")
          assert.strictEqual(cur(since(conn, n)[0]!), "4:0")
          assertContiguous(seq(conn))
          yield* assertMatchesLog(id, seq(conn))
        })))

    it.scoped("asked while the worker starts: answered once it is ready, before a prompt that waited too", () =>
      withCore({}, (ctl) =>
        Effect.gen(function*() {
          const sm = yield* SessionManager
          ctl.spawnGate.close()
          const { conn, id } = yield* open(sm)
          yield* until("the spawn held", () => ctl.spawnGate.waiting === 1)
          const checkpoint = yield* Effect.fork(sm.checkpoint(id))
          const waiting = yield* Effect.fork(prompt(sm, id, "then"))
          yield* barrier(sm, id)
          assert.isTrue(yield* isPending(checkpoint))
          ctl.spawnGate.open()
          assert.deepStrictEqual(yield* joinWithin("the checkpoint", checkpoint), Either.right({ generation: 2, snapshotId: `${id}~g2` }))
          assert.deepStrictEqual(yield* joinWithin("the prompt", waiting), Either.right({ accepted: true as const }))
          yield* until("the turn", () => turnsDone(seq(conn)) === 1)
          const lines = seq(conn)
          // The prompt's reservation and the ready status are in generation 1; its turn in 2.
          assert.deepStrictEqual(lines.filter((l) => l["meta"].cursor.generation === 1).map(statusOf), ["starting/busy", "ready/busy"])
          assert.strictEqual(cur(lines.find((l) => l["event"]?.type === "agent_start")!), "2:1")
          assertContiguous(lines, true)
          yield* assertMatchesLog(id, lines)
        })))

    it.scoped("asked during a turn: answered after the turn's end, with the turn in its snapshot", () =>
      withCore({}, () =>
        Effect.gen(function*() {
          const sm = yield* SessionManager
          const { conn, id } = yield* open(sm)
          yield* waitReady(conn)
          yield* prompt(sm, id, "/sleep 150")
          yield* until("tool_execution_start", () => eventTypes(seq(conn)).includes("tool_execution_start"))
          const checkpoint = yield* Effect.fork(sm.checkpoint(id))
          yield* barrier(sm, id)
          assert.isTrue(yield* isPending(checkpoint), "a checkpoint waits for the turn")
          assert.notInclude(eventTypes(seq(conn)), "agent_end")
          // The tool call's 150 ms pass: the turn ends, then the checkpoint runs.
          yield* TestClock.adjust("150 millis")
          const answer = yield* joinWithin("the checkpoint", checkpoint)
          assert.deepStrictEqual(answer, Either.right({ generation: 2, snapshotId: `${id}~g2` }))
          const lines = seq(conn)
          assert.strictEqual(turnsDone(lines), 1)
          const c2 = new MemoryConnection("c2")
          const data = yield* attach(sm, id, c2)
          // The snapshot is the state after the turn's idle status.
          assert.strictEqual(`${data.snapshot.cursor?.generation}:${data.snapshot.cursor?.sequence}`, cur(lines.at(-1)!))
          assert.deepStrictEqual(data.snapshot.messages.map((m) => `${m.role}:${m.content}`), [
            "user:/sleep 150",
            "tool:slept 150 ms",
            "assistant:done"
          ])
        })))

    it.scoped("two checkpoints asked during a turn are joined (one generation); two while idle are two", () =>
      withCore({}, (ctl) =>
        Effect.gen(function*() {
          const sm = yield* SessionManager
          const { conn, id } = yield* open(sm)
          yield* waitReady(conn)
          ctl.holdGate.close()
          yield* prompt(sm, id, "/hold")
          const both = yield* Effect.fork(Effect.all([sm.checkpoint(id), sm.checkpoint(id)], { concurrency: "unbounded" }))
          yield* barrier(sm, id)
          ctl.holdGate.open()
          const during = yield* joinWithin("two checkpoints asked during a turn", both)
          const g2 = { generation: 2, snapshotId: `${id}~g2` }
          assert.deepStrictEqual(during, Either.right([g2, g2]))
          // While idle each is taken at once, one after the other (a checkpoint is one step).
          const idle = yield* Effect.all([sm.checkpoint(id), sm.checkpoint(id)], { concurrency: "unbounded" })
          assert.deepStrictEqual(idle.map((c) => c.generation).sort(), [3, 4])
          assert.deepStrictEqual(yield* sm.checkpoint(id), { generation: 5, snapshotId: `${id}~g5` })
        })))

    it.scoped("a checkpoint needs no worker: with the worker's turn fiber still held past its agent_end it is answered at once; a prompt then runs at g+1:0", () =>
      withCore({}, (ctl) =>
        Effect.gen(function*() {
          const sm = yield* SessionManager
          const { conn, id } = yield* open(sm)
          yield* waitReady(conn)
          ctl.holdGate.close()
          yield* runTurn(sm, id, conn, "/hold-after-end")
          const logged = seq(conn).length
          assert.deepStrictEqual(yield* sm.checkpoint(id), { generation: 2, snapshotId: `${id}~g2` })
          assert.strictEqual(seq(conn).length, logged, "a checkpoint logs nothing")
          const waiting = yield* Effect.fork(prompt(sm, id, "after"))
          assert.deepStrictEqual(yield* joinWithin("the prompt", waiting), Either.right({ accepted: true as const }))
          ctl.holdGate.open()
          yield* until("the prompt's turn", () => turnsDone(seq(conn)) === 2)
          const after = since(conn, logged)
          assert.strictEqual(cur(after[0]!), "2:0")
          assert.strictEqual(statusOf(after[0]!), "ready/busy")
          assertContiguous(seq(conn), true)
          yield* assertMatchesLog(id, seq(conn))
          const data = yield* attach(sm, id, new MemoryConnection("c2"))
          assert.deepStrictEqual(data.snapshot.messages.map((m) => m.content), ["/hold-after-end", "echo: /hold-after-end"])
        })))

    it.scoped("a checkpoint and a prompt sent together: the checkpoint first, the prompt at g+1:0", () =>
      withCore({ retainGenerations: 100 }, () =>
        Effect.gen(function*() {
          const sm = yield* SessionManager
          const { conn, id } = yield* open(sm)
          yield* waitReady(conn)
          yield* runTurn(sm, id, conn, "first")
          for (let g = 2; g <= 5; g++) {
            const before = seq(conn).length
            const [checkpoint, accepted] = yield* Effect.all([sm.checkpoint(id), prompt(sm, id, `turn ${g}`)], {
              concurrency: "unbounded"
            })
            assert.deepStrictEqual(checkpoint, { generation: g, snapshotId: `${id}~g${g}` })
            assert.deepStrictEqual(accepted, { accepted: true })
            yield* until("the turn", () => turnsDone(since(conn, before)) === 1)
            assert.strictEqual(cur(since(conn, before)[0]!), `${g}:0`)
          }
          assertContiguous(seq(conn), true)
          yield* assertMatchesLog(id, seq(conn))
          assert.strictEqual((yield* messagesOf(sm, id)).total, 10)
        })))

    it.scoped("automatic checkpoints (checkpointEvents: 5) never leave a prompt unanswered, even one sent right at agent_end", () =>
      withCore({ checkpointEvents: 5 }, () =>
        Effect.gen(function*() {
          const sm = yield* SessionManager
          const { conn, id } = yield* open(sm)
          yield* waitReady(conn)
          const n = 15
          for (let i = 0; i < n; i++) {
            const ends = eventTypes(seq(conn)).filter((t) => t === "agent_end").length
            const answer = yield* joinWithin(`prompt ${i}`, yield* Effect.fork(prompt(sm, id, `p${i}`)))
            assert.deepStrictEqual(answer, Either.right({ accepted: true as const }), `prompt ${i}`)
            // The next prompt goes as soon as agent_end is seen, maybe before the idle status.
            yield* until(`agent_end ${i}`, () => eventTypes(seq(conn)).filter((t) => t === "agent_end").length > ends)
          }
          yield* until("every turn's idle status", () => turnsDone(seq(conn)) === n)
          const lines = seq(conn)
          assertContiguous(lines, true)
          const generations = new Set(lines.map((l) => l["meta"].cursor.generation))
          assert.isAbove(generations.size, 3, `automatic checkpoints happened: ${show(lines)}`)
          const messages = yield* messagesOf(sm, id)
          assert.strictEqual(messages.total, 2 * n)
          assert.deepStrictEqual(
            messages.contents,
            Array.from({ length: n }, (_, i) => [`user:p${i}`, `assistant:echo: p${i}`]).flat()
          )
          const state = yield* sm.getState(id)
          assert.isFalse(state.busy)
          assert.strictEqual(state.messageCount, 2 * n)
        })))
  })

  describe("worker crash", () => {
    it.scoped("mid-turn: recovering, turn_interrupted{worker_crashed}, ready (idle); the next prompt works; every logged message is kept", () =>
      withCore({}, () =>
        Effect.gen(function*() {
          const sm = yield* SessionManager
          const { conn, id } = yield* open(sm)
          yield* waitReady(conn)
          yield* runTurn(sm, id, conn, "before")
          yield* prompt(sm, id, "/sleep 10000")
          yield* until("tool_execution_start", () => eventTypes(seq(conn)).includes("tool_execution_start"))
          const old = yield* workerOf(id)
          const start = seq(conn).length
          old.kill()
          yield* until("ready again", () => statuses(since(conn, start)).includes("ready/idle"))
          const after = since(conn, start)
          assert.deepStrictEqual(after.map((l) => describeMsg(l).replace(/@.*/, "")), [
            "status(busy=true,worker=recovering)",
            "ev:turn_interrupted(worker_crashed)",
            "status(busy=false,worker=ready)"
          ])
          const state = yield* sm.getState(id)
          assert.isFalse(state.busy)
          assert.strictEqual(state.restarts, 1)
          assert.notStrictEqual(state.workerPid, old.pid)
          yield* runTurn(sm, id, conn, "after crash")
          const logged = events(seq(conn)).filter((e) => e.type === "message_end").map((e) => e.message.id)
          const messages = yield* messagesOf(sm, id)
          assert.deepStrictEqual(messages.ids, logged)
          assert.deepStrictEqual(messages.contents, [
            "user:before",
            "assistant:echo: before",
            "user:/sleep 10000",
            "user:after crash",
            "assistant:echo: after crash"
          ])
          assertContiguous(seq(conn), true)
          yield* assertMatchesLog(id, seq(conn))
        })))

    it.scoped("an idle worker's crash: a prompt sent while it recovers waits and runs once ready", () =>
      withCore({}, (ctl) =>
        Effect.gen(function*() {
          const sm = yield* SessionManager
          const { conn, id } = yield* open(sm)
          yield* waitReady(conn)
          yield* runTurn(sm, id, conn, "one")
          ctl.loadGate.close()
          const start = seq(conn).length
          ;(yield* workerOf(id)).kill()
          yield* until("the replacement loading", () => ctl.loadGate.waiting === 1)
          const waiting = yield* Effect.fork(prompt(sm, id, "two"))
          yield* waitUntil("reserved", Effect.map(sm.getState(id), (s) => s.busy))
          assert.deepStrictEqual(yield* abort(sm, id), { aborted: false })
          assert.isTrue(yield* isPending(waiting))
          ctl.loadGate.open()
          assert.deepStrictEqual(yield* joinWithin("the prompt", waiting), Either.right({ accepted: true as const }))
          yield* until("its turn", () => turnsDone(since(conn, start)) === 1)
          const after = since(conn, start)
          assert.deepStrictEqual(dedupe(statuses(after)), ["recovering/idle", "recovering/busy", "ready/busy", "ready/idle"], show(after))
          assert.notInclude(eventTypes(after), "turn_interrupted")
          assert.deepStrictEqual((yield* messagesOf(sm, id)).contents, ["user:one", "assistant:echo: one", "user:two", "assistant:echo: two"])
        })))

    it.scoped("the replacement crashes while it loads: backoff, a third worker; one turn_interrupted; a checkpoint and a prompt asked meanwhile are answered", () =>
      withCore({}, (ctl) =>
        Effect.gen(function*() {
          const sm = yield* SessionManager
          yield* ticking
          const { conn, id } = yield* openInToolCall(sm)
          const start = seq(conn).length
          const first = yield* workerOf(id)
          ctl.loadGate.close()
          first.kill()
          yield* until("the replacement loading", () => ctl.loadGate.waiting === 1)
          yield* waitUntil("the replacement is the session's", Effect.map(sm.getState(id), (s) => s.workerPid !== undefined && s.workerPid !== first.pid))
          const second = yield* workerOf(id)
          // Meanwhile: the cut turn has not ended yet (busy); a prompt waits for its end (a second
          // one is refused), a checkpoint waits for a worker.
          const waiting = yield* Effect.fork(prompt(sm, id, "x"))
          yield* barrier(sm, id)
          yield* failsWith("a second prompt while one waits", prompt(sm, id, "y"), "session_busy")
          assert.isTrue((yield* sm.getState(id)).busy)
          assert.deepStrictEqual(yield* abort(sm, id), { aborted: false })
          const checkpoint = yield* Effect.fork(sm.checkpoint(id))
          yield* barrier(sm, id)
          second.kill()
          yield* until("the third worker loading", () => ctl.loadGate.stopped === 2 && ctl.loadGate.waiting === 1)
          assert.isTrue(yield* isPending(checkpoint))
          ctl.loadGate.open()
          assert.deepStrictEqual(yield* joinWithin("the checkpoint", checkpoint), Either.right({ generation: 2, snapshotId: `${id}~g2` }))
          assert.deepStrictEqual(yield* joinWithin("the waiting prompt", waiting), Either.right({ accepted: true as const }))
          yield* until("the cut turn and the waiting prompt's turn", () => turnsDone(since(conn, start)) === 2)
          const after = since(conn, start)
          // The cut turn ends, then the waiting prompt's turn runs (after the checkpoint).
          assert.deepStrictEqual(after.slice(0, 5).map((l) => describeMsg(l).replace(/@.*/, "")), [
            "status(busy=true,worker=recovering)",
            "status(busy=true,worker=recovering)",
            "ev:turn_interrupted(worker_crashed)",
            "status(busy=false,worker=ready)",
            "status(busy=true,worker=ready)"
          ], show(after))
          assert.deepStrictEqual(after.slice(0, 4).map((l) => l["state"]?.restarts), [1, 2, undefined, 2])
          const state = yield* sm.getState(id)
          assert.strictEqual(state.restarts, 2)
          assert.isFalse(state.busy)
          assert.deepStrictEqual((yield* messagesOf(sm, id)).contents, ["user:/sleep 10000", "user:x", "assistant:echo: x"])
          assertContiguous(seq(conn), true)
          yield* assertMatchesLog(id, seq(conn))
        })))

    it.scoped("a checkpoint waiting on a turn cut by a crash is taken from the replacement", () =>
      withCore({}, () =>
        Effect.gen(function*() {
          const sm = yield* SessionManager
          const { conn, id } = yield* openInToolCall(sm)
          const checkpoint = yield* Effect.fork(sm.checkpoint(id))
          yield* barrier(sm, id)
          ;(yield* workerOf(id)).kill()
          assert.deepStrictEqual(yield* joinWithin("the checkpoint", checkpoint), Either.right({ generation: 2, snapshotId: `${id}~g2` }))
          const lines = seq(conn)
          assert.strictEqual(turnsDone(lines), 1)
          const data = yield* attach(sm, id, new MemoryConnection("c2"))
          assert.strictEqual(`${data.snapshot.cursor?.generation}:${data.snapshot.cursor?.sequence}`, cur(lines.at(-1)!))
          assert.deepStrictEqual(data.snapshot.messages.map((m) => m.content), ["/sleep 10000"])
        })))

    for (const [where, frame] of [["after its begin frame", "session_snapshot_begin"], ["after its first chunk", "session_snapshot_chunk"]] as const) {
      it.scoped(`a crash while a history rewrite streams in (${where}): the rewrite never happened; the turn is cut and the transcript is the files' one`, () =>
        withCore({ targetChunkBytes: 64 }, (ctl) =>
          Effect.gen(function*() {
            const sm = yield* SessionManager
            const { conn, id } = yield* open(sm)
            yield* waitReady(conn)
            for (const m of ["one", "two", "three"]) yield* runTurn(sm, id, conn, `${m} words to fill more than one chunk`)
            const start = seq(conn).length
            ctl.crashAfter = (f) => f.type === frame
            yield* prompt(sm, id, "/compact")
            yield* until("the cut turn's end", () => turnsDone(since(conn, start)) === 1)
            assert.isUndefined(ctl.crashAfter, "the worker died mid-rewrite")
            const after = since(conn, start)
            assert.deepStrictEqual(events(after).find((e) => e.type === "turn_interrupted"), { type: "turn_interrupted", reason: "worker_crashed" })
            assert.isTrue(after.every((l) => l["meta"].cursor.generation === 1), show(after))
            assert.notInclude(conn.lines.map((l) => l["purpose"]), "replacement")
            const messages = yield* messagesOf(sm, id)
            assert.strictEqual(messages.total, 7, "six messages and the cut turn's user message")
            assert.strictEqual(messages.contents.at(-1), "user:/compact")
            // The session goes on, and a later rewrite works.
            yield* runTurn(sm, id, conn, "/compact")
            assert.deepStrictEqual((yield* messagesOf(sm, id)).contents, ["assistant:compacted 8 messages"])
            assertContiguous(seq(conn))
            yield* assertMatchesLog(id, seq(conn))
          })))
    }

    it.scoped("/compact: a new generation at once, its snapshot sent as `replacement` frames before any of its events; a resume from before it is transcript_replaced", () =>
      withCore({ retainGenerations: 100 }, () =>
        Effect.gen(function*() {
          const sm = yield* SessionManager
          const { conn, id } = yield* open(sm)
          yield* waitReady(conn)
          const chunked = new MemoryConnection("chunked")
          yield* attach(sm, id, chunked, { capabilities: ["attach_snapshot", "event_sequence", "chunked_snapshot"] })
          for (const m of ["one", "two"]) yield* runTurn(sm, id, conn, m)
          const resumeFrom = seq(conn).at(-1)!["meta"].cursor
          const start = seq(conn).length
          const linesBefore = conn.lines.length
          yield* runTurn(sm, id, conn, "/compact")
          for (const c of [conn, chunked]) {
            const lines = c.lines.slice(c === conn ? linesBefore : 0)
            const begin = lines.findIndex((l) => l["type"] === "session_snapshot_begin" && l["purpose"] === "replacement")
            assert.isAtLeast(begin, 0, `${c.id}: replacement frames`)
            const end = lines.findIndex((l, i) => i > begin && l["type"] === "session_snapshot_end")
            assert.strictEqual(lines[begin]!["snapshotId"], `${id}~g2`)
            assert.deepStrictEqual(lines.slice(begin, end).filter((l) => l["type"] === "session_snapshot_chunk").flatMap((l) => l["messages"]).map((m: any) => m.content), ["compacted 5 messages"])
            // Before the frames: generation 1 only; after: generation 2 from 2:0.
            assert.isTrue(lines.slice(0, begin).filter((l) => l["meta"]).every((l) => l["meta"].cursor.generation === 1), `${c.id}`)
            const later = lines.slice(end).filter((l) => l["meta"])
            assert.strictEqual(cur(later[0]!), "2:0")
            assert.isTrue(later.every((l) => l["meta"].cursor.generation === 2))
          }
          const after = since(conn, start)
          assert.deepStrictEqual(eventTypes(after), ["agent_start", "turn_start", "message_start", "message_end", "turn_end", "agent_end"])
          assert.deepStrictEqual((yield* messagesOf(sm, id)).contents, ["assistant:compacted 5 messages"])
          assertContiguous(seq(conn))
          yield* assertMatchesLog(id, seq(conn))
          // A client that resumes from before the rewrite gets the new state (never a replay across it).
          const resumed = new MemoryConnection("resumed")
          const data = yield* attach(sm, id, resumed, { resumeCursor: resumeFrom })
          assert.deepStrictEqual(data.replay, { status: "partial", reason: "transcript_replaced", fromCursor: { generation: 2, sequence: 0 }, toCursor: seq(conn).at(-1)!["meta"].cursor, eventCount: seq(conn).filter((l) => l["meta"].cursor.generation === 2).length })
          assert.deepStrictEqual(data.snapshot.messages.map((m) => m.content), ["compacted 5 messages"])
          // And one from after it gets a plain replay.
          const fresh = yield* attach(sm, id, new MemoryConnection("fresh"), { resumeCursor: { generation: 2, sequence: 0 } })
          assert.strictEqual(fresh.replay.status, "complete")
          // The rewritten history goes on, through checkpoints and a restart of the worker.
          yield* runTurn(sm, id, conn, "three")
          assert.deepStrictEqual(yield* sm.checkpoint(id), { generation: 3, snapshotId: `${id}~g3` })
          ;(yield* workerOf(id)).kill()
          yield* until("recovered", () => statuses(seq(conn)).at(-1) === "ready/idle" && statuses(seq(conn)).includes("recovering/idle"))
          yield* runTurn(sm, id, conn, "/compact")
          assert.deepStrictEqual((yield* messagesOf(sm, id)).contents, ["assistant:compacted 4 messages"])
        })))

    it.scoped("a crash right after the turn's agent_end: the turn ended normally (no turn_interrupted); an idle recovery follows", () =>
      withCore({}, (ctl) =>
        Effect.gen(function*() {
          const sm = yield* SessionManager
          const { conn, id } = yield* open(sm)
          yield* waitReady(conn)
          const start = seq(conn).length
          ctl.crashAfter = (f) => f["eventType"] === "agent_end"
          yield* prompt(sm, id, "last words")
          yield* until("ready after the crash", () => statuses(since(conn, start)).at(-1) === "ready/idle" && statuses(since(conn, start)).includes("recovering/idle"))
          const after = since(conn, start)
          assert.deepStrictEqual(eventTypes(after).filter((t) => t === "agent_end" || t === "turn_interrupted"), ["agent_end"], show(after))
          assert.deepStrictEqual(dedupe(statuses(after)), ["ready/busy", "ready/idle", "recovering/idle", "ready/idle"], show(after))
          assert.deepStrictEqual((yield* messagesOf(sm, id)).contents, ["user:last words", "assistant:echo: last words"])
          yield* runTurn(sm, id, conn, "next")
          assertContiguous(seq(conn), true)
        })))

    it.scoped("the replacement crashes right after it reports the cut turn: exactly one turn_interrupted, then idle", () =>
      withCore({}, (ctl) =>
        Effect.gen(function*() {
          const sm = yield* SessionManager
          yield* ticking
          const { conn, id } = yield* openInToolCall(sm)
          const start = seq(conn).length
          ctl.crashAfter = (f) => f["eventType"] === "turn_interrupted"
          ;(yield* workerOf(id)).kill()
          yield* until("ready", () => statuses(since(conn, start)).at(-1) === "ready/idle")
          assert.isUndefined(ctl.crashAfter, "the replacement reported the cut turn and died")
          const after = since(conn, start)
          assert.deepStrictEqual(after.map((l) => describeMsg(l).replace(/@.*/, "")), [
            "status(busy=true,worker=recovering)",
            "ev:turn_interrupted(worker_crashed)",
            "status(busy=false,worker=recovering)",
            "status(busy=false,worker=ready)"
          ], show(after))
          assert.strictEqual((yield* sm.getState(id)).restarts, 2)
          yield* runTurn(sm, id, conn, "next")
          assertContiguous(seq(conn), true)
          yield* assertMatchesLog(id, seq(conn))
        })))

    it.scoped("a prompt between the replacement's turn_interrupted and its worker_ready waits: the next status after turn_interrupted is busy:false", () =>
      withCore({}, (ctl) =>
        Effect.gen(function*() {
          const sm = yield* SessionManager
          const { conn, id } = yield* openInToolCall(sm)
          const start = seq(conn).length
          // The replacement reports the cut turn; its worker_ready is not read yet.
          ctl.pauseAfter = (f) => f["eventType"] === "turn_interrupted"
          ;(yield* workerOf(id)).kill()
          yield* until("turn_interrupted", () => eventTypes(since(conn, start)).includes("turn_interrupted"))
          // What a client reads now: the turn is reported cut, its idle status not out yet.
          const state = yield* sm.getState(id)
          assert.isTrue(state.busy, "busy until the status that ends the cut turn")
          assert.strictEqual(cur({ meta: { cursor: state.lastEventCursor } }), cur(seq(conn).at(-1)!))
          const waiting = yield* Effect.fork(prompt(sm, id, "x"))
          yield* barrier(sm, id)
          yield* failsWith("a second prompt while one waits", prompt(sm, id, "y"), "session_busy")
          ctl.frameGate.open()
          assert.deepStrictEqual(yield* joinWithin("the waiting prompt", waiting), Either.right({ accepted: true as const }))
          yield* until("the cut turn and the waiting prompt's turn", () => turnsDone(since(conn, start)) === 2)
          const after = since(conn, start)
          assert.deepStrictEqual(after.slice(0, 4).map((l) => describeMsg(l).replace(/@.*/, "")), [
            "status(busy=true,worker=recovering)",
            "ev:turn_interrupted(worker_crashed)",
            "status(busy=false,worker=ready)",
            "status(busy=true,worker=ready)"
          ], show(after))
          assert.deepStrictEqual((yield* messagesOf(sm, id)).contents, ["user:/sleep 10000", "user:x", "assistant:echo: x"])
          assertContiguous(seq(conn), true)
          yield* assertMatchesLog(id, seq(conn))
        })))

    it.scoped("a crash right after worker_ready, with a prompt waiting: the prompt is accepted, its turn is cut (worker_crashed), then idle", () =>
      withCore({}, (ctl) =>
        Effect.gen(function*() {
          const sm = yield* SessionManager
          ctl.spawnGate.close()
          const { conn, id } = yield* open(sm)
          yield* until("the spawn held", () => ctl.spawnGate.waiting === 1)
          const waiting = yield* Effect.fork(prompt(sm, id, "first"))
          yield* barrier(sm, id)
          ctl.crashAfter = (f) => f.type === "worker_ready" && f["activeSessionId"] !== undefined
          ctl.spawnGate.open()
          assert.deepStrictEqual(yield* joinWithin("the prompt", waiting), Either.right({ accepted: true as const }))
          yield* until("idle again", () => turnsDone(seq(conn)) === 1)
          const lines = seq(conn)
          assert.deepStrictEqual(dedupe(statuses(lines)), ["starting/busy", "ready/busy", "recovering/busy", "ready/idle"], show(lines))
          assert.deepStrictEqual(events(lines).filter((e) => e.type === "turn_interrupted" || e.type === "agent_end"), [{
            type: "turn_interrupted",
            reason: "worker_crashed"
          }])
          assert.isFalse((yield* sm.getState(id)).busy)
          yield* runTurn(sm, id, conn, "second")
          assertContiguous(seq(conn), true)
        })))

    it.scoped("a crash while an abort waits for the turn to be cut: the abort is {aborted:false}, the turn ends worker_crashed", () =>
      withCore({}, (ctl) =>
        Effect.gen(function*() {
          const sm = yield* SessionManager
          const { conn, id } = yield* open(sm)
          yield* waitReady(conn)
          ctl.holdGate.close()
          ctl.cutGate.close()
          yield* prompt(sm, id, "/hold")
          yield* until("the hold", () => ctl.holdGate.waiting === 1)
          const waitingAbort = yield* Effect.fork(abort(sm, id))
          yield* until("the turn being cut", () => ctl.cutGate.waiting === 1)
          yield* barrier(sm, id)
          const start = seq(conn).length
          ;(yield* workerOf(id)).kill()
          assert.deepStrictEqual(yield* joinWithin("the abort", waitingAbort), Either.right({ aborted: false }))
          yield* until("ready", () => statuses(since(conn, start)).at(-1) === "ready/idle")
          const after = since(conn, start)
          assert.deepStrictEqual(after.map((l) => describeMsg(l).replace(/@.*/, "")), [
            "status(busy=true,worker=recovering)",
            "ev:turn_interrupted(worker_crashed)",
            "status(busy=false,worker=ready)"
          ], show(after))
        })))
  })

  describe("spawn failures", () => {
    it.scoped("no worker can be spawned: `failed` after maxRestarts; a reserved prompt and a checkpoint get session_failed; retry_worker brings it back", () =>
      withCore({ maxRestarts: 2 }, (ctl) =>
        Effect.gen(function*() {
          const sm = yield* SessionManager
          yield* ticking
          yield* Ref.set(ctl.failing, "no spawn")
          // The first spawn is held until the prompt and the checkpoint wait for it.
          ctl.spawnGate.close()
          const { conn, id } = yield* open(sm)
          yield* until("the spawn held", () => ctl.spawnGate.waiting === 1)
          const waitingPrompt = yield* Effect.fork(prompt(sm, id, "hello"))
          const waitingCheckpoint = yield* Effect.fork(sm.checkpoint(id))
          yield* barrier(sm, id)
          ctl.spawnGate.open()
          expectCode("the reserved prompt", yield* joinWithin("the reserved prompt", waitingPrompt), "session_failed")
          expectCode("the waiting checkpoint", yield* joinWithin("the checkpoint", waitingCheckpoint), "session_failed")
          yield* until("failed", () => statuses(seq(conn)).at(-1) === "failed/idle")
          assert.deepStrictEqual(dedupe(statuses(seq(conn))), ["starting/busy", "recovering/busy", "failed/idle"], show(seq(conn)))
          assert.strictEqual(yield* Ref.get(ctl.starts), 3)
          const state = yield* sm.getState(id)
          assert.strictEqual(state.worker, "failed")
          assert.isFalse(state.busy)
          assert.strictEqual(state.restarts, 3)
          yield* failsWith("a prompt to a failed session", prompt(sm, id, "x"), "session_failed")
          yield* failsWith("a checkpoint of a failed session", sm.checkpoint(id), "session_failed")
          assert.deepStrictEqual(yield* abort(sm, id), { aborted: false })
          // A retry whose own spawns fail is answered session_failed.
          yield* failsWith("retry_worker while spawns fail", sm.retryWorker(id), "session_failed")
          assert.strictEqual(yield* Ref.get(ctl.starts), 6)
          assert.strictEqual((yield* sm.getState(id)).worker, "failed")
          yield* Ref.set(ctl.failing, undefined)
          const retried = yield* sm.retryWorker(id)
          assert.strictEqual(retried.worker, "ready")
          assert.isFalse(retried.busy)
          yield* runTurn(sm, id, conn, "back")
          assert.deepStrictEqual((yield* messagesOf(sm, id)).contents, ["user:back", "assistant:echo: back"])
          assertContiguous(seq(conn), true)
          yield* assertMatchesLog(id, seq(conn))
          // retry_worker of a session that has not failed: its summary, at once.
          assert.strictEqual((yield* sm.retryWorker(id)).worker, "ready")
        })))

    it.scoped("a turn cut by a crash whose replacements cannot spawn: turn_interrupted{worker_crashed} then `failed`; its waiting checkpoint gets session_failed", () =>
      withCore({ maxRestarts: 2 }, (ctl) =>
        Effect.gen(function*() {
          const sm = yield* SessionManager
          yield* ticking
          const { conn, id } = yield* openInToolCall(sm)
          const checkpoint = yield* Effect.fork(sm.checkpoint(id))
          yield* barrier(sm, id)
          yield* Ref.set(ctl.failing, "no spawn")
          const start = seq(conn).length
          ;(yield* workerOf(id)).kill()
          expectCode("the waiting checkpoint", yield* joinWithin("the checkpoint", checkpoint), "session_failed")
          yield* until("failed", () => statuses(seq(conn)).at(-1) === "failed/idle")
          const after = since(conn, start)
          assert.deepStrictEqual(after.map((l) => describeMsg(l).replace(/@.*/, "")), [
            "status(busy=true,worker=recovering)",
            "status(busy=true,worker=recovering)",
            "ev:turn_interrupted(worker_crashed)",
            "status(busy=false,worker=failed)"
          ], show(after))
          assert.isFalse((yield* sm.getState(id)).busy)
          assert.deepStrictEqual((yield* messagesOf(sm, id)).contents, ["user:/sleep 10000"])
          yield* Ref.set(ctl.failing, undefined)
          yield* sm.retryWorker(id)
          yield* runTurn(sm, id, conn, "again")
          assert.notInclude(eventTypes(since(conn, start + after.length)), "turn_interrupted")
          assertContiguous(seq(conn), true)
        })))
  })

  it.scoped("restart backoff on the Clock: the first restart is immediate, the next after 100 ms, then 200 ms; a new window starts over", () =>
    withCore({}, (ctl) =>
      Effect.gen(function*() {
        const sm = yield* SessionManager
        const starts = () => Effect.runSync(Ref.get(ctl.starts))
        const readies = (conn: MemoryConnection) => statuses(seq(conn)).filter((s) => s === "ready/idle").length
        const { conn, id } = yield* open(sm)
        yield* until("ready", () => readies(conn) === 1)
        const kill = Effect.map(workerOf(id), (w) => w.kill())

        yield* kill
        yield* until("the immediate restart", () => readies(conn) === 2)
        assert.strictEqual(starts(), 2)

        yield* kill
        yield* until("recovering", () => statuses(seq(conn)).at(-1) === "recovering/idle")
        yield* settle
        assert.strictEqual(starts(), 2, "the second restart waits")
        yield* TestClock.adjust("99 millis")
        yield* settle
        assert.strictEqual(starts(), 2, "not before 100 ms")
        yield* TestClock.adjust("1 millis")
        yield* until("the restart after 100 ms", () => readies(conn) === 3)
        assert.strictEqual(starts(), 3)

        yield* kill
        yield* until("recovering", () => statuses(seq(conn)).at(-1) === "recovering/idle")
        yield* TestClock.adjust("199 millis")
        yield* settle
        assert.strictEqual(starts(), 3, "not before 200 ms")
        yield* TestClock.adjust("1 millis")
        yield* until("the restart after 200 ms", () => readies(conn) === 4)
        assert.strictEqual(starts(), 4)

        // Past the window the crashes are forgotten: immediate again.
        yield* TestClock.adjust("61 seconds")
        yield* kill
        yield* until("an immediate restart in a new window", () => readies(conn) === 5)
        assert.strictEqual(starts(), 5)
        const state = yield* sm.getState(id)
        assert.strictEqual(state.restarts, 4)
        assert.strictEqual(state.worker, "ready")
      })))

  describe("kill", () => {
    it.scoped("while the worker starts: the reserved prompt and a checkpoint get session_not_found; the worker started meanwhile is stopped", () =>
      withCore({}, (ctl) =>
        Effect.gen(function*() {
          const sm = yield* SessionManager
          const pool = yield* WorkerPool
          ctl.spawnGate.close()
          const { conn, id } = yield* open(sm)
          yield* until("the spawn held", () => ctl.spawnGate.waiting === 1)
          const waitingPrompt = yield* Effect.fork(prompt(sm, id, "hello"))
          const waitingCheckpoint = yield* Effect.fork(sm.checkpoint(id))
          assert.deepStrictEqual(yield* abort(sm, id), { aborted: false })
          // kill waits for the spawn under way (then stops its worker before it answers); the
          // session is closed for new commands at once.
          const kill = yield* Effect.fork(sm.kill(id))
          yield* until("session_closed", () => seq(conn).at(-1)?.["type"] === "session_closed")
          const last = seq(conn).at(-1)!
          assert.strictEqual(last["reason"], "killed")
          yield* failsWith("prompt after kill", prompt(sm, id, "x"), "session_not_found")
          ctl.spawnGate.open()
          assert.deepStrictEqual(yield* joinWithin("kill", kill), Either.right({}))
          expectCode("the reserved prompt", yield* joinWithin("the reserved prompt", waitingPrompt), "session_not_found")
          expectCode("the checkpoint", yield* joinWithin("the checkpoint", waitingCheckpoint), "session_not_found")
          const left = []
          for (const w of yield* pool.live) {
            if (w.activeSessionId === id && !(yield* Deferred.isDone(w.exited))) left.push(w.pid)
          }
          assert.deepStrictEqual(left, [], "the worker spawned meanwhile has stopped when kill answers")
          assert.strictEqual(yield* Ref.get(ctl.starts), 1)
        })))

    it.scoped("during a turn: a waiting abort and checkpoint get session_not_found, clients get session_closed, then every command is session_not_found", () =>
      withCore({}, (ctl) =>
        Effect.gen(function*() {
          const sm = yield* SessionManager
          const { conn, id } = yield* open(sm)
          yield* waitReady(conn)
          ctl.holdGate.close()
          ctl.cutGate.close()
          yield* prompt(sm, id, "/hold")
          yield* until("the hold", () => ctl.holdGate.waiting === 1)
          const waitingAbort = yield* Effect.fork(abort(sm, id))
          const waitingCheckpoint = yield* Effect.fork(sm.checkpoint(id))
          yield* until("the turn being cut", () => ctl.cutGate.waiting === 1)
          yield* barrier(sm, id)
          assert.isTrue(yield* isPending(waitingAbort))
          const worker = yield* workerOf(id)
          const c2 = new MemoryConnection("c2")
          yield* attach(sm, id, c2)
          // Caught up, maybe not live yet: session_closed reaches it either way.
          yield* until("c2 caught up", () => seq(c2).length === seq(conn).length)
          assert.deepStrictEqual(yield* sm.kill(id), {})
          assert.isTrue(yield* Deferred.isDone(worker.exited), "kill answers once the worker has stopped")
          expectCode("the waiting abort", yield* joinWithin("the abort", waitingAbort), "session_not_found")
          expectCode("the waiting checkpoint", yield* joinWithin("the checkpoint", waitingCheckpoint), "session_not_found")
          for (const c of [conn, c2]) {
            const last = seq(c).at(-1)!
            assert.strictEqual(last["type"], "session_closed", show(seq(c)))
            assert.strictEqual(last["reason"], "killed")
            assert.strictEqual(c.lines.at(-1), last, "nothing after session_closed")
          }
          assert.deepStrictEqual(cursors(seq(c2)), cursors(seq(conn)))
          const n = conn.lines.length
          yield* failsWith("prompt", prompt(sm, id, "x"), "session_not_found")
          yield* failsWith("abort", abort(sm, id), "session_not_found")
          yield* failsWith("checkpoint", sm.checkpoint(id), "session_not_found")
          yield* failsWith("get_state", sm.getState(id), "session_not_found")
          yield* failsWith("get_messages", sm.getMessages({ type: "get_messages", activeSessionId: id } as any), "session_not_found")
          yield* failsWith("attach", sm.attach("c3", new MemoryConnection("c3"), { type: "attach", activeSessionId: id } as any), "session_not_found")
          yield* failsWith("detach", sm.detach("c1", id), "session_not_found")
          yield* failsWith("retry_worker", sm.retryWorker(id), "session_not_found")
          yield* failsWith("kill", sm.kill(id), "session_not_found")
          assert.deepStrictEqual((yield* sm.list).sessions, [])
          assert.strictEqual(sm.attachedCount("c1"), 0)
          assert.strictEqual(conn.lines.length, n)
        })))
  })

  describe("kill (more)", () => {
    it.scoped("clients still catching up (attached just before the kill) or paused get session_closed, last, once", () =>
      withCore({ outboxBytes: 256 }, () =>
        Effect.gen(function*() {
          const sm = yield* SessionManager
          const { conn, id } = yield* open(sm)
          // c3 stops reading: past outboxBytes its attachment is paused, resumed from the log later.
          const c3 = new MemoryConnection("c3")
          c3.pause()
          yield* attach(sm, id, c3)
          yield* waitReady(conn)
          yield* runTurn(sm, id, conn, "hello there, a turn of some length")
          // c2 attaches from the first cursor: its catch-up reads the log, not live yet at the kill.
          const c2 = new MemoryConnection("c2")
          yield* attach(sm, id, c2, { resumeCursor: { generation: 1, sequence: 0 } })
          assert.deepStrictEqual(yield* sm.kill(id), {})
          yield* settle
          c3.resume()
          for (const c of [conn, c2, c3]) {
            const lines = seq(c)
            assert.strictEqual(lines.at(-1)?.["type"], "session_closed", `${c.id}: ${show(lines)}`)
            assert.strictEqual(lines.filter((l) => l["type"] === "session_closed").length, 1, `${c.id}: ${show(lines)}`)
            for (let i = 1; i < lines.length; i++) {
              assert.isTrue(lines[i]!["meta"].cursor.sequence > lines[i - 1]!["meta"].cursor.sequence, `${c.id}: in order, no duplicate: ${show(lines)}`)
            }
          }
        })))

    it.scoped("while a worker's spawn never completes: kill, and the prompt waiting for that worker, are still answered", () =>
      withCore({}, (ctl) =>
        Effect.gen(function*() {
          const sm = yield* SessionManager
          ctl.spawnGate.close()
          const { id } = yield* open(sm)
          yield* until("the spawn held", () => ctl.spawnGate.waiting === 1)
          const waiting = yield* Effect.fork(prompt(sm, id, "hello"))
          yield* barrier(sm, id)
          // The spawn stays stuck (a worker that never becomes ready): nothing it would decide.
          const kill = yield* Effect.fork(sm.kill(id))
          assert.deepStrictEqual(yield* joinWithin("kill", kill), Either.right({}))
          expectCode("the waiting prompt", yield* joinWithin("the prompt", waiting), "session_not_found")
        })))
  })

  it.scoped("passivation (maxWorkers: 2): a new session passivates the least recently used idle one; a prompt wakes it (passivated, starting, ready) with its transcript", () =>
    withCore({ maxWorkers: 2 }, () =>
      Effect.gen(function*() {
        const sm = yield* SessionManager
        const pool = yield* WorkerPool
        const a = yield* open(sm, "ca")
        yield* waitReady(a.conn)
        yield* runTurn(sm, a.id, a.conn, "a1")
        const b = yield* open(sm, "cb")
        yield* waitReady(b.conn)
        yield* runTurn(sm, b.id, b.conn, "b1")
        const c = yield* open(sm, "cc")
        yield* waitReady(c.conn)
        yield* until("a passivated", () => statuses(seq(a.conn)).at(-1) === "passivated/idle")
        const liveSessions = Effect.map(pool.live, (ws) => ws.filter((w) => !w.stopping).map((w) => w.activeSessionId).sort())
        yield* waitUntil("two workers: b's and c's", Effect.map(liveSessions, (ids) => ids.join() === [b.id, c.id].sort().join()))
        assert.notInclude(statuses(seq(b.conn)), "passivated/idle", "b was used more recently than a")
        const stateA = yield* sm.getState(a.id)
        assert.strictEqual(stateA.worker, "passivated")
        assert.isUndefined(stateA.workerPid)
        // Passivation checkpoints first: attach needs no worker.
        const data = yield* attach(sm, a.id, new MemoryConnection("ca2"))
        assert.strictEqual(data.snapshot.snapshotId, `${a.id}~g2`)
        assert.deepStrictEqual(data.snapshot.messages.map((m) => m.content), ["a1", "echo: a1"])
        const start = seq(a.conn).length
        yield* runTurn(sm, a.id, a.conn, "a2")
        assert.deepStrictEqual(dedupe(statuses(since(a.conn, start - 1))), ["passivated/idle", "starting/busy", "ready/busy", "ready/idle"])
        assert.deepStrictEqual((yield* messagesOf(sm, a.id)).contents, ["user:a1", "assistant:echo: a1", "user:a2", "assistant:echo: a2"])
        // Now b is the least recently used idle one.
        yield* until("b passivated", () => statuses(seq(b.conn)).at(-1) === "passivated/idle")
        assert.notInclude(statuses(seq(c.conn)), "passivated/idle")
        // A checkpoint of a passivated session needs no worker: answered, and it stays passivated.
        assert.deepStrictEqual(yield* sm.checkpoint(b.id), { generation: 3, snapshotId: `${b.id}~g3` })
        assert.strictEqual((yield* sm.getState(b.id)).worker, "passivated")
        assert.deepStrictEqual((yield* messagesOf(sm, b.id)).contents, ["user:b1", "assistant:echo: b1"])
        for (const s of [a, b, c]) {
          assertContiguous(seq(s.conn), true)
          yield* assertMatchesLog(s.id, seq(s.conn))
        }
      })))

  it.scoped("maxWorkers 2, both workers busy: a third session waits for a slot (its prompt too), never a third live worker; it runs once a turn ends and that session gives up its worker", () =>
    withCore({ maxWorkers: 2 }, (ctl) =>
      Effect.gen(function*() {
        const sm = yield* SessionManager
        const pool = yield* WorkerPool
        // Live workers, sampled all along (stopping ones count: a slot is held until the exit).
        let most = 0
        yield* Effect.forkScoped(Effect.forever(Effect.zipRight(
          Effect.map(pool.live, (ws) => void (most = Math.max(most, ws.length))),
          Effect.yieldNow()
        )))
        const a = yield* open(sm, "ca")
        const b = yield* open(sm, "cb")
        yield* waitReady(a.conn)
        yield* waitReady(b.conn)
        ctl.holdGate.close()
        yield* prompt(sm, a.id, "/hold")
        yield* prompt(sm, b.id, "/hold")
        yield* until("both turns held", () => ctl.holdGate.waiting === 2)
        const c = yield* open(sm, "cc")
        const waiting = yield* Effect.fork(prompt(sm, c.id, "c1"))
        yield* barrier(sm, c.id)
        yield* settle
        const stateC = yield* sm.getState(c.id)
        assert.strictEqual(stateC.worker, "starting")
        assert.isTrue(stateC.busy, "its prompt is reserved")
        assert.isTrue(yield* isPending(waiting))
        assert.strictEqual((yield* pool.live).length, 2)
        ctl.holdGate.open()
        assert.deepStrictEqual(yield* joinWithin("c's prompt", waiting), Either.right({ accepted: true as const }))
        yield* until("c's turn", () => turnsDone(seq(c.conn)) === 1)
        assert.deepStrictEqual((yield* messagesOf(sm, c.id)).contents, ["user:c1", "assistant:echo: c1"])
        assert.isAtLeast([a, b].filter((x) => statuses(seq(x.conn)).includes("passivated/idle")).length, 1, "a or b gave up its worker")
        assert.isAtMost(most, 2, "never more than maxWorkers live workers")
        // The one passivated comes back on its next prompt, within the bound too.
        for (const x of [a, b]) yield* runTurn(sm, x.id, x.conn, "again")
        assert.isAtMost(most, 2)
        for (const x of [a, b, c]) assertContiguous(seq(x.conn), true)
      })))

  it.scoped("a passivated session whose worker cannot be spawned: the waking prompt gets session_failed; retry_worker restores it with its transcript", () =>
    withCore({ maxWorkers: 1, maxRestarts: 1 }, (ctl) =>
      Effect.gen(function*() {
        const sm = yield* SessionManager
        const a = yield* open(sm, "ca")
        yield* waitReady(a.conn)
        yield* runTurn(sm, a.id, a.conn, "a1")
        const b = yield* open(sm, "cb")
        yield* waitReady(b.conn)
        yield* until("a passivated", () => statuses(seq(a.conn)).at(-1) === "passivated/idle")
        yield* Ref.set(ctl.failing, "no spawn")
        const start = seq(a.conn).length
        yield* failsWith("a prompt that wakes it", prompt(sm, a.id, "a2"), "session_failed")
        // The prompt is answered first, then the failed status is logged and sent.
        yield* until("a failed", () => statuses(since(a.conn, start)).includes("failed/idle"))
        const after = since(a.conn, start)
        assert.deepStrictEqual(dedupe(statuses(after)), ["starting/busy", "recovering/busy", "failed/idle"], show(after))
        assert.notInclude(eventTypes(after), "turn_interrupted")
        yield* Ref.set(ctl.failing, undefined)
        assert.strictEqual((yield* sm.retryWorker(a.id)).worker, "ready")
        yield* runTurn(sm, a.id, a.conn, "a3")
        assert.deepStrictEqual((yield* messagesOf(sm, a.id)).contents, ["user:a1", "assistant:echo: a1", "user:a3", "assistant:echo: a3"])
        assertContiguous(seq(a.conn), true)
        yield* assertMatchesLog(a.id, seq(a.conn))
      })))

  describe("delivery", () => {
    it.scoped("a client paused past outboxBytes gets every event once resumed: no gap, no duplicate, re-sent ones flagged replayed", () =>
      withCore({ outboxBytes: 4096 }, () =>
        Effect.gen(function*() {
          const sm = yield* SessionManager
          const { conn: c1, id } = yield* open(sm)
          yield* waitReady(c1)
          const c2 = new MemoryConnection("c2")
          yield* attach(sm, id, c2)
          yield* until("c2's baseline", () => seq(c2).length === 1)
          c2.pause()
          for (let i = 0; i < 4; i++) yield* runTurn(sm, id, c1, "/bulk 3000")
          assert.isAbove(c2.queuedBytes, 4096)
          c2.resume()
          yield* until("c2 caught up", () => seq(c2).length === seq(c1).length)
          yield* runTurn(sm, id, c1, "live again")
          yield* until("c2 has the live turn", () => seq(c2).length === seq(c1).length)
          assert.deepStrictEqual(cursors(seq(c2)), cursors(seq(c1)))
          assert.deepStrictEqual(seq(c2).map(body), seq(c1).map(body))
          assertContiguous(seq(c2), true)
          yield* assertMatchesLog(id, seq(c2))
          // After the baseline: live, then replayed (the catch-up), then live again.
          const flags = seq(c2).slice(1).map((l) => (l["meta"].replayed === true ? "r" : "l")).join("")
          assert.match(flags, /^l+r+l+$/, flags)
          assert.isTrue(seq(c1).slice(1).every((l) => l["meta"].replayed === undefined))
        })))

    it.scoped("paused while checkpoints prune what it lacks (retainGenerations: 1): a resync snapshot, then contiguous events; never a silent jump", () =>
      withCore({ outboxBytes: 4096, retainGenerations: 1 }, () =>
        Effect.gen(function*() {
          const sm = yield* SessionManager
          const { conn: c1, id } = yield* open(sm)
          yield* waitReady(c1)
          const c2 = new MemoryConnection("c2")
          yield* attach(sm, id, c2)
          yield* until("c2's baseline", () => seq(c2).length === 1)
          c2.pause()
          yield* runTurn(sm, id, c1, "/bulk 3000")
          yield* runTurn(sm, id, c1, "/bulk 3000")
          assert.deepStrictEqual(yield* sm.checkpoint(id), { generation: 2, snapshotId: `${id}~g2` })
          yield* runTurn(sm, id, c1, "/bulk 3000")
          const lastOfG2 = seq(c1).at(-1)!["meta"].cursor
          assert.deepStrictEqual(yield* sm.checkpoint(id), { generation: 3, snapshotId: `${id}~g3` })
          yield* runTurn(sm, id, c1, "in g3")
          c2.resume()
          yield* until("c2 caught up", () => seq(c2).at(-1) !== undefined && cur(seq(c2).at(-1)!) === cur(seq(c1).at(-1)!))
          yield* runTurn(sm, id, c1, "live")
          yield* until("c2 has the live turn", () => cur(seq(c2).at(-1)!) === cur(seq(c1).at(-1)!))

          const lines = c2.lines
          const begins = lines.filter((l) => l["type"] === "session_snapshot_begin")
          assert.strictEqual(begins.length, 1, show(lines))
          const begin = begins[0]!
          assert.strictEqual(begin["purpose"], "resync")
          assert.strictEqual(begin["snapshotId"], `${id}~g3`)
          assert.deepStrictEqual(begin["cursor"], lastOfG2)
          const at = lines.indexOf(begin)
          const endAt = lines.findIndex((l) => l["type"] === "session_snapshot_end")
          const chunks = lines.slice(at + 1, endAt)
          assert.deepStrictEqual(chunks.map((l) => l["type"]), chunks.map(() => "session_snapshot_chunk"))
          assert.deepStrictEqual(chunks.map((l) => l["index"]), chunks.map((_, i) => i))
          assert.strictEqual(lines[endAt]!["chunkCount"], chunks.length)
          const snapshotIds = chunks.flatMap((l) => l["messages"]).map((m: any) => m.id)
          assert.strictEqual(snapshotIds.length, begin["messageCount"])
          assert.deepStrictEqual(snapshotIds, (yield* messagesOf(sm, id)).ids.slice(0, snapshotIds.length))
          // Before the resync: a contiguous prefix of what c1 saw; after it: generation 3 from 3:0.
          const before = lines.slice(0, at).filter((l) => l["meta"]?.cursor !== undefined)
          const after = lines.slice(endAt + 1).filter((l) => l["meta"]?.cursor !== undefined)
          assert.deepStrictEqual(cursors(before), cursors(seq(c1)).slice(0, before.length))
          assert.strictEqual(before.at(-1)!["meta"].cursor.generation, 1, "c2 was paused in generation 1")
          const fromG3 = seq(c1).filter((l) => l["meta"].cursor.generation === 3)
          assert.deepStrictEqual(cursors(after), cursors(fromG3))
          assert.deepStrictEqual(after.map(body), fromG3.map(body))
          assertContiguous(before, true)
          assertContiguous(after, true)
          const flags = after.map((l) => (l["meta"].replayed === true ? "r" : "l")).join("")
          assert.match(flags, /^r+l+$/, flags)
          // A resume cursor from the pruned generation: partial, cursor_expired, a resync baseline.
          const c3 = new MemoryConnection("c3")
          const data = yield* attach(sm, id, c3, {
            resumeCursor: { generation: 1, sequence: 0 },
            capabilities: ["attach_snapshot", "event_sequence", "chunked_snapshot"]
          })
          assert.strictEqual(data.replay.status, "partial")
          assert.strictEqual(data.replay.reason, "cursor_expired")
          yield* until("c3 caught up", () => seq(c3).length === fromG3.length)
          assert.strictEqual(c3.lines.find((l) => l["type"] === "session_snapshot_begin")?.["purpose"], "resync")
          assert.deepStrictEqual(cursors(seq(c3)), cursors(fromG3))
        })))

    it.scoped("attach with a resume cursor replays exactly the events after it (across a checkpoint), then live ones", () =>
      withCore({}, () =>
        Effect.gen(function*() {
          const sm = yield* SessionManager
          const { conn: c1, id } = yield* open(sm)
          yield* waitReady(c1)
          yield* runTurn(sm, id, c1, "one two")
          const mark = seq(c1).findIndex((l) => l["event"]?.type === "agent_end")
          const resume = seq(c1)[mark]!["meta"].cursor
          yield* runTurn(sm, id, c1, "three")
          yield* sm.checkpoint(id)
          yield* runTurn(sm, id, c1, "four")
          const expected = seq(c1).slice(mark + 1)
          const c3 = new MemoryConnection("c3")
          const data = yield* attach(sm, id, c3, { resumeCursor: resume })
          assert.deepStrictEqual(data.replay, {
            status: "complete",
            fromCursor: expected[0]!["meta"].cursor,
            toCursor: expected.at(-1)!["meta"].cursor,
            eventCount: expected.length
          })
          assert.deepStrictEqual(data.snapshot.messages, [])
          yield* until("c3's replay", () => seq(c3).length === expected.length)
          assert.strictEqual(c3.lines[0]!["type"], "session_attached")
          assert.deepStrictEqual(cursors(seq(c3)), cursors(expected))
          assert.deepStrictEqual(seq(c3).map(body), expected.map(body))
          assert.isTrue(seq(c3).every((l) => l["meta"].replayed === true))
          const n = seq(c3).length
          yield* runTurn(sm, id, c1, "five")
          yield* until("c3 live", () => seq(c3).length === seq(c1).length - mark - 1)
          assert.deepStrictEqual(cursors(seq(c3)), cursors(seq(c1).slice(mark + 1)))
          assert.isTrue(since(c3, n).every((l) => l["meta"].replayed === undefined))
          // The last cursor: complete, nothing to replay.
          const last = seq(c1).at(-1)!["meta"].cursor
          const c4 = new MemoryConnection("c4")
          const upToDate = yield* attach(sm, id, c4, { resumeCursor: last })
          assert.deepStrictEqual(upToDate.replay, { status: "complete", eventCount: 0 })
          // Ahead of the session, or naming no event: a baseline.
          const ahead = yield* attach(sm, id, new MemoryConnection("c5"), { resumeCursor: { generation: 2, sequence: 999 } })
          assert.strictEqual(ahead.replay.reason, "cursor_ahead")
          const unknown = yield* attach(sm, id, new MemoryConnection("c6"), { resumeCursor: { generation: 1, sequence: 999 } })
          assert.strictEqual(unknown.replay.reason, "cursor_unknown")
          assert.strictEqual(unknown.snapshot.messageCount, 4)
        })))

    it.scoped("attaching again on the same connection replaces the earlier attachment; detach ends delivery", () =>
      withCore({}, () =>
        Effect.gen(function*() {
          const sm = yield* SessionManager
          const { conn: c1, id } = yield* open(sm)
          yield* waitReady(c1)
          yield* runTurn(sm, id, c1, "one")
          const c2 = new MemoryConnection("c2")
          yield* attach(sm, id, c2)
          yield* until("c2's baseline", () => seq(c2).length === seq(c1).length)
          const last = seq(c2).at(-1)!["meta"].cursor
          yield* attach(sm, id, c2, { resumeCursor: last })
          assert.strictEqual(sm.attachedCount("c2"), 1)
          yield* runTurn(sm, id, c1, "two")
          yield* until("c2 has the turn", () => cur(seq(c2).at(-1)!) === cur(seq(c1).at(-1)!))
          assert.deepStrictEqual(cursors(seq(c2)), cursors(seq(c1)), "no event twice")
          yield* sm.detach("c2", id)
          assert.strictEqual(sm.attachedCount("c2"), 0)
          const n = c2.lines.length
          yield* runTurn(sm, id, c1, "three")
          assert.strictEqual(c2.lines.length, n, "nothing after detach")
        })))

    // An attach's snapshot frames follow its answer from another fiber: between the two, its
    // connection may attach again or detach. The old attachment must then send nothing, not even
    // the begin of a snapshot it was about to stream (chaos seed 830 saw a stale begin arrive in
    // the middle of the new attachment's frames: "snapshot_begin in phase snapshot").
    const CHUNKED = ["attach_snapshot", "event_sequence", "chunked_snapshot"]
    for (const then of ["attach again", "detach"] as const) {
      it.scoped(`an attach held before its snapshot's first frame, then ${then === "detach" ? "detached" : "replaced by a new attach on its connection"}, sends nothing more`, () =>
        withCore({}, (control) =>
          Effect.gen(function*() {
            const sm = yield* SessionManager
            const { conn: c1, id } = yield* open(sm)
            yield* waitReady(c1)
            yield* runTurn(sm, id, c1, "one two")
            const c2 = new MemoryConnection("c2")
            control.retainGate.close()
            const held = yield* attach(sm, id, c2, { capabilities: CHUNKED })
            assert.isDefined(held.snapshotStream, "a baseline streamed as frames")
            yield* until("the first attach at the cache's retain", () => control.retainGate.waiting === 1)
            if (then === "detach") yield* sm.detach("c2", id)
            else {
              const again = yield* attach(sm, id, c2, { resumeCursor: seq(c1).at(-1)!["meta"].cursor, capabilities: CHUNKED })
              assert.deepStrictEqual(again.replay, { status: "complete", eventCount: 0 })
              yield* until("the new attachment's session_attached", () => c2.lines.some((l) => l["type"] === "session_attached"))
            }
            const before = c2.lines.map((l) => l["type"])
            control.retainGate.open()
            yield* settle
            assert.deepStrictEqual(c2.lines.map((l) => l["type"]), before, "nothing from the replaced attachment")
            assert.notInclude(before, "session_snapshot_begin")
            // The connection's live attachment (if any) still gets the next turn, once.
            yield* runTurn(sm, id, c1, "three")
            yield* settle
            if (then === "detach") assert.deepStrictEqual(c2.lines.map((l) => l["type"]), before)
            else {
              const fresh = seq(c2)
              assert.deepStrictEqual(cursors(fresh), cursors(seq(c1)).slice(-fresh.length))
              assert.isAbove(fresh.length, 0)
              assert.strictEqual(c2.lines.filter((l) => l["type"] === "session_attached").length, 1)
            }
          })))
    }
  })
  describe("daemon restart (a second core over the same storage)", () => {
    it.scoped("a session busy at the restart is restored with turn_interrupted{daemon_restarted}; an idle one is passivated and woken on demand; cursors go on", () =>
      Effect.gen(function*() {
        const stored = yield* makeStored
        const before = yield* withCore({}, () =>
          Effect.gen(function*() {
            const sm = yield* SessionManager
            const busy = yield* open(sm, "cb")
            const idle = yield* open(sm, "ci")
            yield* waitReady(busy.conn)
            yield* waitReady(idle.conn)
            yield* runTurn(sm, busy.id, busy.conn, "before")
            yield* runTurn(sm, idle.id, idle.conn, "idle before")
            yield* prompt(sm, busy.id, "/sleep 10000")
            yield* until("tool_execution_start", () => eventTypes(seq(busy.conn)).includes("tool_execution_start"))
            return { busy: { id: busy.id, lines: seq(busy.conn) }, idle: { id: idle.id, lines: seq(idle.conn) } }
          }), stored)
        yield* withCore({}, () =>
          Effect.gen(function*() {
            const sm = yield* SessionManager
            const c1 = new MemoryConnection("c1")
            const data = yield* attach(sm, before.busy.id, c1, { resumeCursor: before.busy.lines.at(-1)!["meta"].cursor })
            assert.strictEqual(data.replay.status, "complete")
            yield* until("ready", () => statuses(seq(c1)).at(-1) === "ready/idle")
            assert.deepStrictEqual(seq(c1).map((l) => describeMsg(l).replace(/@.*/, "")), [
              "status(busy=true,worker=recovering)",
              "ev:turn_interrupted(daemon_restarted)",
              "status(busy=false,worker=ready)"
            ], show(seq(c1)))
            assertContiguous([...before.busy.lines, ...seq(c1)], true)
            yield* runTurn(sm, before.busy.id, c1, "after")
            assert.deepStrictEqual((yield* messagesOf(sm, before.busy.id)).contents, [
              "user:before",
              "assistant:echo: before",
              "user:/sleep 10000",
              "user:after",
              "assistant:echo: after"
            ])
            // The idle one waits for its next prompt, passivated.
            const idle = yield* sm.getState(before.idle.id)
            assert.strictEqual(idle.worker, "passivated")
            assert.isFalse(idle.busy)
            const c2 = new MemoryConnection("c2")
            yield* attach(sm, before.idle.id, c2, { resumeCursor: before.idle.lines.at(-1)!["meta"].cursor })
            yield* runTurn(sm, before.idle.id, c2, "idle after")
            assert.deepStrictEqual(dedupe(statuses(seq(c2))), ["starting/busy", "ready/busy", "ready/idle"], show(seq(c2)))
            assertContiguous([...before.idle.lines, ...seq(c2)], true)
            assert.deepStrictEqual((yield* messagesOf(sm, before.idle.id)).contents, [
              "user:idle before",
              "assistant:echo: idle before",
              "user:idle after",
              "assistant:echo: idle after"
            ])
          }), stored)
      }))

    it.scoped("a turn whose agent_end was logged but not journaled when the daemon died is not cut: its idle status comes, no turn_interrupted", () =>
      Effect.gen(function*() {
        const stored = yield* makeStored
        const before = yield* withCore({}, () =>
          Effect.gen(function*() {
            const sm = yield* SessionManager
            const { conn, id } = yield* openInToolCall(sm)
            return { id, lines: seq(conn) }
          }), stored)
        // The journal still says busy; the log got the turn's end, as it does just before the
        // supervisor journals it.
        const log = Context.get(stored, EventLog)
        yield* log.append(before.id, { type: "session_event", event: { type: "agent_end" }, emittedAt: Date.now() })
        yield* withCore({}, () =>
          Effect.gen(function*() {
            const sm = yield* SessionManager
            const c1 = new MemoryConnection("c1")
            yield* attach(sm, before.id, c1, { resumeCursor: before.lines.at(-1)!["meta"].cursor })
            yield* until("the idle status", () => statuses(seq(c1)).length > 0)
            assert.deepStrictEqual(seq(c1).map((l) => describeMsg(l).replace(/@.*/, "")), [
              "ev:agent_end",
              "status(busy=false,worker=passivated)"
            ], show(seq(c1)))
            const journal = Context.get(stored, RecoveryJournal.RecoveryJournal)
            assert.isFalse((yield* journal.latest()).get(before.id)?.busy, "the journal says idle")
            yield* runTurn(sm, before.id, c1, "after")
            assertContiguous([...before.lines, ...seq(c1)], true)
            assert.notInclude(eventTypes(seq(c1)), "turn_interrupted")
          }), stored)
      }))
  })

  it.scoped("a prompt takes effect at its session's step, before its writes: `taken` then, `settled` and the answer once its busy record is durable", () =>
    Effect.gen(function*() {
      const stored = yield* makeStored
      const journal = Context.get(stored, RecoveryJournal.RecoveryJournal)
      const gate = new Gate()
      const gated = Context.add(stored, RecoveryJournal.RecoveryJournal, { ...journal, record: (input) => Effect.zipRight(gate.pass, journal.record(input)) })
      yield* withCore({}, () =>
        Effect.gen(function*() {
          const sm = yield* SessionManager
          const { conn, id } = yield* open(sm)
          yield* waitReady(conn)
          gate.close()
          const progress = { taken: yield* Deferred.make<void>(), settled: yield* Deferred.make<void>() }
          const prompting = yield* Effect.fork(Effect.locally(prompt(sm, id, "hello"), CommandTakesEffect, progress))
          yield* until("the busy record under way", () => gate.waiting === 1)
          assert.isTrue(yield* Deferred.isDone(progress.taken), "taken once stepped")
          assert.isFalse(yield* Deferred.isDone(progress.settled), "not settled while its record waits")
          assert.isNull(prompting.unsafePoll(), "not answered while its record waits")
          assert.strictEqual((yield* sm.getState(id)).busy, false, "its busy status is not out yet")
          gate.open()
          assert.deepStrictEqual(yield* Fiber.join(prompting), { accepted: true })
          assert.isTrue(yield* Deferred.isDone(progress.settled))
          assert.strictEqual((yield* sm.getState(id)).busy, true)
        }), gated)
    }))

  describe("names", () => {

    it.scoped("a rename holds the old name until the new one is durable: a create of either name meanwhile is name_taken; a failed save gives the old one back", () =>
      Effect.gen(function*() {
        const stored = yield* makeStored
        const store = Context.get(stored, SessionStore.SessionStore)
        // A save that waits at the gate, then fails (the disk is full).
        const gate = new Gate()
        const failing = { on: false }
        const saves = Context.add(stored, SessionStore.SessionStore, {
          ...store,
          saveMeta: (meta) =>
            Effect.zipRight(
              gate.pass,
              failing.on ? Effect.fail(new SessionStore.SessionStoreError({ reason: "Io", detail: "ENOSPC" })) : store.saveMeta(meta)
            )
        })
        yield* withCore({}, () =>
          Effect.gen(function*() {
            const sm = yield* SessionManager
            const a = yield* sm.create({ type: "create", name: "x" } as any)
            const b = yield* sm.create({ type: "create" } as any)
            gate.close()
            failing.on = true
            const renaming = yield* Effect.fork(sm.rename({ type: "rename", activeSessionId: a.activeSessionId, name: "y" } as any))
            yield* until("the rename's save under way", () => gate.waiting === 1)
            // Both names are held while the save may yet fail: the old one is not free.
            yield* failsWith("a create of the old name", sm.create({ type: "create", name: "x" } as any), "name_taken")
            yield* failsWith("a create of the new name", sm.create({ type: "create", name: "y" } as any), "name_taken")
            yield* failsWith("another session renamed to the old name", sm.rename({ type: "rename", activeSessionId: b.activeSessionId, name: "x" } as any), "name_taken")
            gate.open()
            const outcome = yield* Effect.either(Fiber.join(renaming))
            expectCode("the rename whose save failed", outcome, "internal")
            const named = (yield* sm.list).sessions.filter((s) => s.name === "x").map((s) => s.activeSessionId)
            assert.deepStrictEqual(named, [a.activeSessionId], "the old name is the renamed session's again, and only its")
            // Storage back: the rename goes through, and the old name is free.
            failing.on = false
            assert.strictEqual((yield* sm.rename({ type: "rename", activeSessionId: a.activeSessionId, name: "y" } as any)).name, "y")
            assert.strictEqual((yield* sm.create({ type: "create", name: "x" } as any)).state.name, "x")
            assert.strictEqual((yield* store.loadMeta(a.activeSessionId)).name, "y", "durable")
          }), saves)
      }))

    it.scoped("renames and creates racing for one name: exactly one wins, every other is name_taken; each answered once", () =>
      withCore({}, () =>
        Effect.gen(function*() {
          const sm = yield* SessionManager
          const RACERS = 8
          const ids: Array<string> = []
          for (let i = 0; i < RACERS; i++) ids.push((yield* sm.create({ type: "create", name: `own-${i}` } as any)).activeSessionId)
          const racers: Array<Effect.Effect<string, CommandError>> = []
          for (let i = 0; i < RACERS; i++) {
            racers.push(Effect.map(sm.rename({ type: "rename", activeSessionId: ids[i]!, name: "r" } as any), (s) => s.activeSessionId))
            racers.push(Effect.map(sm.create({ type: "create", name: "r" } as any), (c) => c.activeSessionId))
          }
          const outcomes = yield* Effect.all(racers.map(Effect.either), { concurrency: "unbounded" })
          const won = outcomes.filter(Either.isRight)
          assert.strictEqual(won.length, 1, JSON.stringify(outcomes))
          for (const o of outcomes) if (Either.isLeft(o)) assert.strictEqual(o.left.code, "name_taken", o.left.message)
          const named = (yield* sm.list).sessions.filter((s) => s.name === "r").map((s) => s.activeSessionId)
          assert.deepStrictEqual(named, [won[0]!.right])
        })))
  })

  describe("the in-process pool", () => {
    it.scoped("a killed in-process worker ends at once (its turn does not run on), even though the core acquires it in an uninterruptible region", () =>
      Effect.gen(function*() {
        const sm = yield* SessionManager
        const pool = yield* WorkerPool
        const { conn, id } = yield* open(sm)
        yield* waitReady(conn)
        yield* prompt(sm, id, "/sleep 1500")
        yield* until("tool_execution_start", () => eventTypes(seq(conn)).includes("tool_execution_start"))
        const [worker] = yield* pool.live
        worker!.kill()
        yield* waitUntil("the killed worker gone from the pool", Effect.map(pool.live, (ws) => !ws.includes(worker!)))
      }).pipe(Effect.scoped, Effect.provide(coreLayer())))
  })
})
