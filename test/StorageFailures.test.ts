/**
 * Storage failures in the session core (docs/protocol.md sections 3, 4, 6), in-process over
 * memory storage whose event log and journal fail on demand: a prompt that cannot be made
 * durable is refused `storage_unavailable`; a turn whose events cannot be logged ends with
 * `turn_interrupted {storage_failed}`, owed and retried until the log takes it, before any
 * status that depends on it; `get_state` shows what the stream shows meanwhile; the session
 * goes on by itself once storage works; a restart in between ends the turn `daemon_restarted`.
 */
import { assert, describe, it } from "@effect/vitest"
import * as Context from "effect/Context"
import * as Effect from "effect/Effect"
import * as Either from "effect/Either"
import * as Fiber from "effect/Fiber"
import * as Option from "effect/Option"
import type * as Scope from "effect/Scope"
import * as Stream from "effect/Stream"
import { EventLog, EventLogError } from "../src/EventLog.js"
import * as RecoveryJournal from "../src/RecoveryJournal.js"
import { SessionManager } from "../src/SessionManager.js"
import { describeMsg } from "./chaos/streamCheck.js"
import { makeStored, MemoryConnection, type SpawnControl, type StoredContext, waitFor, withCore } from "./support/core.js"

type Line = Record<string, any>
type Manager = SessionManager["Type"]

const seq = (conn: MemoryConnection): Array<Line> => conn.sequenced()
const show = (lines: ReadonlyArray<Line>) => lines.map((l) => describeMsg(l).replace(/@.*/, "")).join(" ")
const statuses = (lines: ReadonlyArray<Line>) =>
  lines.filter((l) => l["type"] === "session_status").map((l) => `${l["state"].worker}/${l["state"].busy ? "busy" : "idle"}`)
const eventTypes = (lines: ReadonlyArray<Line>) => lines.filter((l) => l["type"] === "session_event").map((l) => l["event"].type as string)

/** What the test can break: the log's appends, the journal's records. */
interface Faults {
  log: boolean
  journal: boolean
  /** The log's next generation start happens, then reports a failure (a step after the new segment's rename failed). */
  rotateThenFail?: boolean
  /** The log's reads fail (a descriptor short: EMFILE). */
  reads?: boolean
  /**
   * The hot path's next appends are held (their answers kept in `held`): `succeed`, logged and
   * answered once released; `fail`, not logged, answered ENOSPC once released.
   */
  hold?: "succeed" | "fail" | undefined
  held?: Array<() => void>
}

/** The stored context with an event log and a journal that fail while `faults` say so. */
const faulty = (stored: StoredContext, faults: Faults): StoredContext => {
  const log = Context.get(stored, EventLog)
  const journal = Context.get(stored, RecoveryJournal.RecoveryJournal)
  const enospc = (sessionId: string) =>
    new EventLogError({ reason: "Io", sessionId, message: "writing the event log failed: write: ENOSPC: no space left on device" })
  const emfile = (sessionId: string) =>
    new EventLogError({ reason: "Io", sessionId, message: `open /state/events/${sessionId}/1.jsonl failed: EMFILE: too many open files` })
  return stored.pipe(
    Context.add(EventLog, {
      ...log,
      append: (id, event) => faults.log ? Effect.fail(enospc(id)) : log.append(id, event),
      appendAll: (id, events) => faults.log ? Effect.fail(enospc(id)) : log.appendAll(id, events),
      // The hot path's append fails as a write does: through its answer, here before it returns.
      appendAllNow: (id, events, tracer, done) => {
        if (faults.hold === "succeed") {
          return log.appendAllNow?.(id, events, tracer, (error) => (faults.held ??= []).push(() => done(error)))
        }
        if (faults.hold === "fail") {
          ;(faults.held ??= []).push(() => done(enospc(id)))
          return events.map((_, i) => ({ generation: 0, sequence: i }))
        }
        if (!faults.log) return log.appendAllNow?.(id, events, tracer, done)
        done(enospc(id))
        return []
      },
      read: (id, after) => faults.reads ? Stream.fail(emfile(id)) : log.read(id, after),
      readGeneration: (id, generation) => faults.reads ? Stream.fail(emfile(id)) : log.readGeneration(id, generation),
      generations: (id) => faults.reads ? Effect.fail(emfile(id)) : log.generations(id),
      startGeneration: (id) =>
        faults.rotateThenFail
          ? Effect.zipRight(log.startGeneration(id), Effect.fail(new EventLogError({ reason: "Io", sessionId: id, message: "fsync: EMFILE: too many open files" })))
          : log.startGeneration(id)
    }),
    Context.add(RecoveryJournal.RecoveryJournal, {
      ...journal,
      record: (input) =>
        faults.journal
          ? Effect.fail(new RecoveryJournal.RecoveryJournalError({ operation: "open", path: "/state/recovery.jsonl", cause: new Error("EMFILE: too many open files") }))
          : journal.record(input)
    })
  )
}

const prompt = (sm: Manager, id: string, message: string) => sm.prompt({ type: "prompt", activeSessionId: id, message } as any)

const open = (sm: Manager) =>
  Effect.gen(function*() {
    const created = yield* sm.create({ type: "create" } as any)
    const conn = new MemoryConnection("c1")
    const outcome = yield* sm.attach(conn.id, conn, { type: "attach", activeSessionId: created.activeSessionId } as any)
    yield* Effect.forkScoped(outcome.deliver)
    yield* waitFor("ready", () => statuses(seq(conn)).at(-1) === "ready/idle")
    return { id: created.activeSessionId, conn }
  })

/** The core over storage that fails while `faults` say so, with one session ready and connection `c1` attached from its start. */
const withOpenSession = <A, E>(
  body: (t: { readonly sm: Manager; readonly conn: MemoryConnection; readonly id: string; readonly faults: Faults; readonly ctl: SpawnControl }) => Effect.Effect<
    A,
    E,
    SessionManager | RecoveryJournal.RecoveryJournal | Scope.Scope
  >
) =>
  Effect.gen(function*() {
    const faults: Faults = { log: false, journal: false }
    const stored = faulty(yield* makeStored, faults)
    return yield* withCore({}, (ctl) =>
      Effect.gen(function*() {
        const sm = yield* SessionManager
        const { conn, id } = yield* open(sm)
        return yield* body({ sm, conn, id, faults, ctl })
      }), stored)
  })

const codeOf = <A>(outcome: Either.Either<A, { readonly code: string }>) => Either.isLeft(outcome) ? outcome.left.code : "accepted"

describe("storage failures (in-process)", () => {
  it.scopedLive("a journal that cannot be written: the prompt is refused storage_unavailable, nothing is published, status says so; the next write clears it", () =>
    Effect.gen(function*() {
      yield* withOpenSession(({ sm, conn, id, faults }) =>
        Effect.gen(function*() {
          const before = seq(conn).length
          faults.journal = true
          const refused = yield* Effect.either(prompt(sm, id, "hello"))
          assert.strictEqual(codeOf(refused), "storage_unavailable")
          if (Either.isLeft(refused)) assert.match(refused.left.message, /recovery journal.*EMFILE/)
          assert.deepStrictEqual(seq(conn).slice(before), [], "nothing of a refused prompt is published")
          const state = yield* sm.getState(id)
          assert.strictEqual(state.busy, false)
          assert.strictEqual(state.worker, "ready")
          assert.deepStrictEqual((yield* sm.status as Effect.Effect<any>).storage, {
            ok: false,
            error: "recovery journal: open /state/recovery.jsonl failed: EMFILE: too many open files"
          })
          faults.journal = false
          assert.deepStrictEqual(yield* prompt(sm, id, "hello"), { accepted: true })
          yield* waitFor("the turn's end", () => eventTypes(seq(conn)).includes("agent_end"))
          assert.deepStrictEqual((yield* sm.status as Effect.Effect<any>).storage, { ok: true })
          const journal = yield* RecoveryJournal.RecoveryJournal
          yield* waitFor("idle", () => statuses(seq(conn)).at(-1) === "ready/idle")
          const record = yield* journal.get(id)
          assert.isTrue(Option.isSome(record) && record.value.busy === false)
        }))
    }))

  it.scopedLive("a log that fails mid-turn: the turn stalls busy (get_state as the stream), prompts are refused; once the log works: turn_interrupted {storage_failed}, idle, a worker restores it, turns go on", () =>
    Effect.gen(function*() {
      yield* withOpenSession(({ sm, conn, id, faults, ctl }) =>
        Effect.gen(function*() {
          ctl.holdGate.close()
          assert.deepStrictEqual(yield* prompt(sm, id, "/hold"), { accepted: true })
          yield* waitFor("the user message", () => eventTypes(seq(conn)).includes("message_end"))
          yield* waitFor("the turn held", () => ctl.holdGate.waiting === 1)
          const shown = seq(conn).length
          faults.log = true
          ctl.holdGate.open()
          // Several retries fail meanwhile (one every 1.5 s).
          yield* Effect.sleep("3500 millis")
          assert.strictEqual(seq(conn).length, shown, `nothing could be logged: ${show(seq(conn).slice(shown))}`)
          const stalled = yield* sm.getState(id)
          assert.isTrue(stalled.busy, "the stream's last status said busy")
          assert.strictEqual(stalled.worker, "ready")
          assert.strictEqual(codeOf(yield* Effect.either(prompt(sm, id, "meanwhile"))), "storage_unavailable")
          faults.log = false
          yield* waitFor("the session ready again", () => statuses(seq(conn)).at(-1) === "ready/idle", 10_000)
          const after = seq(conn).slice(shown)
          assert.deepStrictEqual(show(after).split(" "), [
            "ev:turn_interrupted(storage_failed)",
            "status(busy=false,worker=recovering)",
            "status(busy=false,worker=ready)"
          ], show(after))
          // What was logged before the fault stands: the user message.
          const messages = yield* sm.getMessages({ type: "get_messages", activeSessionId: id, limit: 100 } as any)
          assert.deepStrictEqual(messages.messages.map((m) => `${m.role}:${m.content}`), ["user:/hold"])
          assert.deepStrictEqual(yield* prompt(sm, id, "after"), { accepted: true })
          yield* waitFor("the next turn's end", () => eventTypes(seq(conn)).filter((t) => t === "agent_end").length === 1)
          const journal = yield* RecoveryJournal.RecoveryJournal
          yield* waitFor("idle", () => statuses(seq(conn)).at(-1) === "ready/idle")
          const record = yield* journal.get(id)
          assert.isTrue(Option.isSome(record) && record.value.busy === false)
        }))
    }), { timeout: 30_000 })

  // A worker's event that changes nothing in the session (a token) is published beside the
  // entity when it waits with nothing queued (the entity is not woken): as if the entity had
  // taken it. Its publish held, a command sent meanwhile is not taken until it is done; failed,
  // its failure is taken before that command.
  const heldCases = [
    { outcome: "succeed", abort: true },
    { outcome: "fail", abort: true },
    // Nothing else to take (the worker's next frames held back): the failure wakes the entity itself.
    { outcome: "fail", abort: false }
  ] as const
  for (const { abort: withAbort, outcome } of heldCases) {
    const title = outcome === "succeed"
      ? "an abort sent meanwhile waits for it; then the turn is aborted after that token"
      : withAbort
      ? "an abort sent meanwhile waits for it; its failure is taken first: the turn ends storage_failed, the abort finds none"
      : "nothing else sent: its failure alone ends the turn storage_failed"
    it.scopedLive(`a token's publish held (${outcome}): ${title}`, () =>
      Effect.gen(function*() {
        const faults: Faults = { log: false, journal: false }
        const stored = faulty(yield* makeStored, faults)
        yield* withCore({}, (ctl) =>
          Effect.gen(function*() {
            const sm = yield* SessionManager
            const created = yield* sm.create({ type: "create", config: { tokenDelayMs: 60 } } as any)
            const id = created.activeSessionId
            const conn = new MemoryConnection("c1")
            const attached = yield* sm.attach(conn.id, conn, { type: "attach", activeSessionId: id } as any)
            yield* Effect.forkScoped(attached.deliver)
            yield* waitFor("ready", () => statuses(seq(conn)).at(-1) === "ready/idle")
            const words = Array.from({ length: 30 }, (_, i) => `w${i}`).join(" ")
            assert.deepStrictEqual(yield* prompt(sm, id, words), { accepted: true })
            yield* waitFor("the first token", () => eventTypes(seq(conn)).includes("message_update"))
            faults.hold = outcome
            if (!withAbort) ctl.pauseAfter = (f) => f["type"] === "worker_event"
            yield* waitFor("a token's publish held", () => (faults.held?.length ?? 0) === 1)
            const shown = seq(conn).length
            const abort = withAbort ? yield* Effect.fork(sm.abort({ type: "abort", activeSessionId: id } as any)) : undefined
            // Several tokens' time: the entity takes nothing until the held publish is done.
            yield* Effect.sleep("400 millis")
            if (abort !== undefined) assert.isNull(abort.unsafePoll(), "the abort waits for the held publish")
            assert.strictEqual(faults.held!.length, 1, "nothing else was published meanwhile")
            assert.strictEqual(seq(conn).length, shown)
            faults.hold = undefined
            faults.held!.shift()!()
            if (!withAbort) {
              // Taken with no other input: the turn ends (its owed end logged by the retry).
              yield* waitFor("the failure taken", () => eventTypes(seq(conn)).includes("turn_interrupted"), 5_000)
              ctl.frameGate.open()
            }
            const answer = abort === undefined ? undefined : yield* Effect.either(Fiber.join(abort))
            yield* waitFor("the session idle", () => statuses(seq(conn)).at(-1) === "ready/idle", 10_000)
            const after = show(seq(conn).slice(shown)).split(" ")
            if (outcome === "succeed") {
              assert.deepStrictEqual(answer, Either.right({ aborted: true }))
              assert.strictEqual(after[0], "ev:message_update", `the held token first: ${after.join(" ")}`)
              assert.include(after, "ev:turn_interrupted(aborted)")
            } else {
              assert.deepStrictEqual(after.slice(0, 2), ["ev:turn_interrupted(storage_failed)", "status(busy=false,worker=recovering)"], after.join(" "))
              assert.notInclude(after, "ev:turn_interrupted(aborted)")
              if (answer !== undefined) assert.deepStrictEqual(answer, Either.right({ aborted: false }))
              // What was logged stands, the held token not: the transcript has no hole.
              const messages = yield* sm.getMessages({ type: "get_messages", activeSessionId: id, limit: 100 } as any)
              assert.deepStrictEqual(messages.messages.map((m) => m.role), ["user"])
            }
            // Every event once, in cursor order, whatever the path.
            const cursors = seq(conn).filter((l) => l["cursor"] !== undefined).map((l) => `${l["cursor"].generation}:${l["cursor"].sequence}`)
            assert.strictEqual(new Set(cursors).size, cursors.length)
          }), stored)
      }), { timeout: 30_000 })
  }

  it.scopedLive("a checkpoint whose generation start is reported failed but happened: the session moves with the log; later checkpoints and a restored worker see every message", () =>
    Effect.gen(function*() {
      yield* withOpenSession(({ sm, conn, id, faults, ctl }) =>
        Effect.gen(function*() {
          const turn = (message: string, ends: number) =>
            Effect.gen(function*() {
              assert.deepStrictEqual(yield* prompt(sm, id, message), { accepted: true })
              yield* waitFor(`turn ${ends}`, () => eventTypes(seq(conn)).filter((t) => t === "agent_end").length === ends)
              yield* waitFor("idle", () => statuses(seq(conn)).at(-1) === "ready/idle")
            })
          const checkpoint = Effect.either(sm.checkpoint(id))
          yield* turn("one", 1)
          faults.rotateThenFail = true
          const first = yield* checkpoint
          faults.rotateThenFail = false
          assert.isTrue(Either.isRight(first), `the checkpoint is whole: ${JSON.stringify(first)}`)
          yield* turn("two", 2)
          // Before, the session stayed a generation behind its log: this read the old one and failed.
          const second = yield* checkpoint
          assert.isTrue(Either.isRight(second), `the next checkpoint: ${JSON.stringify(second)}`)
          yield* turn("three", 3)
          const logged = (yield* sm.getMessages({ type: "get_messages", activeSessionId: id, limit: 100 } as any)).messages.length
          // A restored worker holds every message (its transcript is the snapshot and the log's tail).
          ctl.crashAfter = (frame) => frame.type === "worker_event" && (frame as { eventType?: string }).eventType === "agent_start"
          assert.deepStrictEqual(yield* prompt(sm, id, "cut"), { accepted: true })
          yield* waitFor("the cut turn's end", () => eventTypes(seq(conn)).includes("turn_interrupted"), 10_000)
          yield* waitFor("restored", () => statuses(seq(conn)).at(-1) === "ready/idle", 10_000)
          yield* turn("/compact", 4)
          const after = (yield* sm.getMessages({ type: "get_messages", activeSessionId: id, limit: 100 } as any)).messages
          // The compaction counts what the restored worker held, with the /compact message itself.
          assert.strictEqual(`${after.at(-1)?.role}:${after.at(-1)?.content}`, `assistant:compacted ${logged + 1} messages`, JSON.stringify(after))
        }))
    }), { timeout: 30_000 })

  it.scopedLive("a restart while the owed end cannot be logged: the journal still says busy, the turn ends daemon_restarted, once", () =>
    Effect.gen(function*() {
      const faults: Faults = { log: false, journal: false }
      const stored = faulty(yield* makeStored, faults)
      const before = yield* withCore({}, (ctl) =>
        Effect.gen(function*() {
          const sm = yield* SessionManager
          const { conn, id } = yield* open(sm)
          ctl.holdGate.close()
          yield* prompt(sm, id, "/hold")
          yield* waitFor("the turn held", () => ctl.holdGate.waiting === 1)
          faults.log = true
          ctl.holdGate.open()
          yield* Effect.sleep("500 millis")
          assert.isTrue((yield* sm.getState(id)).busy)
          return { id, lines: seq(conn) }
        }), stored)
      faults.log = false
      yield* withCore({}, () =>
        Effect.gen(function*() {
          const sm = yield* SessionManager
          const conn = new MemoryConnection("c2")
          const outcome = yield* sm.attach(conn.id, conn, {
            type: "attach",
            activeSessionId: before.id,
            resumeCursor: before.lines.at(-1)!["meta"].cursor
          } as any)
          yield* Effect.forkScoped(outcome.deliver)
          yield* waitFor("ready", () => statuses(seq(conn)).at(-1) === "ready/idle", 10_000)
          assert.deepStrictEqual(show(seq(conn)).split(" "), [
            "status(busy=true,worker=recovering)",
            "ev:turn_interrupted(daemon_restarted)",
            "status(busy=false,worker=ready)"
          ], show(seq(conn)))
        }), stored)
    }), { timeout: 30_000 })

  it.scopedLive("a log that cannot be read: attach from a cursor and get_messages answer storage_unavailable naming the file, not internal; once it reads, both work", () =>
    Effect.gen(function*() {
      yield* withOpenSession(({ sm, conn, id, faults }) =>
        Effect.gen(function*() {
          assert.deepStrictEqual(yield* prompt(sm, id, "hello"), { accepted: true })
          yield* waitFor("idle after the turn", () => eventTypes(seq(conn)).includes("agent_end") && statuses(seq(conn)).at(-1) === "ready/idle")
          const from = seq(conn)[1]!["meta"]["cursor"]
          faults.reads = true
          const other = new MemoryConnection("c2")
          const errorOf = <A>(outcome: Either.Either<A, { readonly code: string; readonly message: string }>) =>
            Either.isLeft(outcome) ? `${outcome.left.code}: ${outcome.left.message}` : "answered"
          const refusals = {
            attach: errorOf(yield* Effect.either(sm.attach(other.id, other, { type: "attach", activeSessionId: id, resumeCursor: from } as any))),
            get_messages: errorOf(yield* Effect.either(sm.getMessages({ type: "get_messages", activeSessionId: id } as any)))
          }
          for (const [what, error] of Object.entries(refusals)) {
            assert.match(error, /^storage_unavailable: the event log could not be read: open \/state\/events\/.*EMFILE/, what)
          }
          faults.reads = false
          const attached = yield* sm.attach(other.id, other, { type: "attach", activeSessionId: id, resumeCursor: from } as any)
          yield* Effect.forkScoped(attached.deliver)
          yield* waitFor("the events after the cursor", () => eventTypes(seq(other)).includes("agent_end"))
          assert.isAbove((yield* sm.getMessages({ type: "get_messages", activeSessionId: id } as any)).messages.length, 0)
        }))
    }))
})
