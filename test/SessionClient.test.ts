/**
 * SessionClient's fold (test/e2e/sessionClient.test.ts runs it against the real daemon): scripted
 * message sequences in wire order, checked for the folded transcript, the message being
 * streamed, busy/worker, the cursors, what is emitted, snapshot reassembly (attach, resync,
 * replacement), overlapping replays, and the protocol violations it refuses; the cursor file.
 */
import { assert, describe, it } from "@effect/vitest"
import * as Effect from "effect/Effect"
import * as Either from "effect/Either"
import * as fs from "node:fs"
import * as os from "node:os"
import * as path from "node:path"
import type * as Protocol from "../src/Protocol.js"
import * as Chunk from "effect/Chunk"
import * as Schedule from "effect/Schedule"
import * as Fiber from "effect/Fiber"
import * as Stream from "effect/Stream"
import * as TestClock from "effect/TestClock"
import * as net from "node:net"
import * as SessionClient from "../src/SessionClient.js"
import { readCursorFile, SessionFold, type FollowEvent, writeCursorFileSync } from "../src/SessionClient.js"

const ID = "s-test"
const c = (generation: number, sequence: number) => ({ generation, sequence })
const msg = (id: string, role: "user" | "assistant" = "assistant", content = id): Protocol.AgentMessage => ({ id, role, content, timestamp: 1 })
const meta = (g: number, s: number, replayed = false) => ({ cursor: c(g, s), emittedAt: 1, ...(replayed ? { replayed: true as const } : {}) })
const summary = (busy: boolean, worker: Protocol.WorkerState = "ready"): Protocol.SessionSummary => ({
  activeSessionId: ID,
  engine: "echo",
  createdAt: "2024-01-01T00:00:00.000Z",
  messageCount: 0,
  busy,
  worker,
  restarts: 0,
  telemetry: false
})
const ev = (g: number, s: number, event: Protocol.AgentEvent): Protocol.PushMessage => ({ type: "session_event", activeSessionId: ID, event, meta: meta(g, s) })
const status = (g: number, s: number, busy: boolean, worker: Protocol.WorkerState = "ready"): Protocol.PushMessage => ({
  type: "session_status",
  activeSessionId: ID,
  state: summary(busy, worker),
  meta: meta(g, s)
})
const attachedMsg = (status: "complete" | "partial" | "unavailable" = "unavailable"): Protocol.PushMessage => ({
  type: "session_attached",
  activeSessionId: ID,
  state: summary(false),
  replay: { status }
})
const attachResult = (
  replay: Protocol.Replay,
  snapshot: { cursor?: Protocol.DaemonAttachResult["snapshot"]["cursor"]; messages: ReadonlyArray<Protocol.AgentMessage> } | undefined,
  streamed = false
): Protocol.DaemonAttachResult => ({
  protocol: { name: "agentd", version: 1 },
  activeSessionId: ID,
  snapshot: {
    snapshotId: `${ID}~g1`,
    ...(snapshot?.cursor === undefined ? {} : { cursor: snapshot.cursor }),
    messageCount: snapshot?.messages.length ?? 0,
    messages: streamed ? [] : snapshot?.messages ?? []
  },
  replay,
  lastEventSequence: -1,
  ...(streamed ? { snapshotStream: { id: `${ID}~g1`, messageCount: snapshot?.messages.length ?? 0, targetChunkBytes: 100 } } : {}),
  client: { id: "c1", capabilities: [] }
})
const begin = (snapshotId: string, purpose: "attach" | "resync" | "replacement", count: number, cursor?: { generation: number; sequence: number }): Protocol.PushMessage => ({
  type: "session_snapshot_begin",
  activeSessionId: ID,
  snapshotId,
  messageCount: count,
  targetChunkBytes: 100,
  purpose,
  ...(cursor === undefined ? {} : { cursor })
})
const chunk = (snapshotId: string, index: number, messages: Array<Protocol.AgentMessage>): Protocol.PushMessage => ({
  type: "session_snapshot_chunk",
  activeSessionId: ID,
  snapshotId,
  index,
  messages
})
const end = (snapshotId: string, chunkCount: number): Protocol.PushMessage => ({
  type: "session_snapshot_end",
  activeSessionId: ID,
  snapshotId,
  chunkCount,
  lastEventSequence: -1
})

/** A user message and an echo reply, as the echo engine streams them. */
const turn = (g: number, s0: number, text: string): Array<Protocol.PushMessage> => {
  let s = s0
  const user = msg(`u-${text}`, "user", text)
  const reply = { ...msg(`a-${text}`), content: "" }
  const words = text.split(" ")
  const deltas = ["echo:", ...words.map((w) => ` ${w}`)]
  return [
    status(g, s++, true),
    ev(g, s++, { type: "agent_start" }),
    ev(g, s++, { type: "message_start", message: user }),
    ev(g, s++, { type: "message_end", message: user }),
    ev(g, s++, { type: "message_start", message: reply }),
    ...deltas.map((delta) => ev(g, s++, { type: "message_update", messageId: reply.id, delta })),
    ev(g, s++, { type: "message_end", message: { ...reply, content: deltas.join("") } }),
    ev(g, s++, { type: "agent_end" }),
    status(g, s++, false)
  ]
}

/** Feeds messages; fails the test on a Left. */
const feed = (fold: SessionFold, messages: ReadonlyArray<Protocol.PushMessage>): Array<FollowEvent> => {
  const out: Array<FollowEvent> = []
  for (const m of messages) {
    const r = fold.receive(m)
    if (Either.isLeft(r)) assert.fail(`unexpected ${r.left._tag}: ${r.left.message}`)
    out.push(...r.right)
  }
  return out
}
const cursors = (events: ReadonlyArray<FollowEvent>) =>
  events.flatMap((e) => (e.type === "baseline" ? [] : [`${e.meta.cursor.generation}:${e.meta.cursor.sequence}`]))
const contents = (fold: SessionFold) => fold.messages.map((m) => m.content)

describe("SessionFold", () => {
  it("an inline baseline, then a turn: transcript, streamed message, busy, cursors; every event emitted once", () => {
    const fold = new SessionFold(ID)
    assert.deepStrictEqual(fold.attaching(), {})
    const first = fold.attached(attachResult({ status: "unavailable", reason: "no_cursor" }, { messages: [msg("m0", "user", "old")] }))
    assert.isTrue(Either.isRight(first))
    if (Either.isRight(first)) {
      assert.strictEqual(first.right.length, 1)
      const b = first.right[0]!
      assert.strictEqual(b.type, "baseline")
      if (b.type === "baseline") {
        assert.strictEqual(b.purpose, "attach")
        assert.isFalse(b.skipped)
      }
    }
    const t = turn(1, 0, "hello big world")
    const out = feed(fold, [attachedMsg(), ...t.slice(0, 7)])
    assert.isTrue(fold.busy)
    assert.strictEqual(fold.streaming?.content, "echo: hello")
    assert.deepStrictEqual(contents(fold), ["old", "hello big world"])
    out.push(...feed(fold, t.slice(7)))
    assert.isFalse(fold.busy)
    assert.strictEqual(fold.worker, "ready")
    assert.strictEqual(fold.streaming, undefined)
    assert.deepStrictEqual(contents(fold), ["old", "hello big world", "echo: hello big world"])
    assert.deepStrictEqual(cursors(out), t.map((_, i) => `1:${i}`))
    assert.deepStrictEqual(fold.lastCursor, c(1, t.length - 1))
    assert.deepStrictEqual(fold.emittedCursor, c(1, t.length - 1))
  })

  it("a turn that ends failed (agent_end with an error): turnError holds it, the error message keeps isError; the next turn clears it", () => {
    const fold = new SessionFold(ID)
    fold.attached(attachResult({ status: "unavailable", reason: "no_cursor" }, { messages: [] }))
    const user = msg("u1", "user", "hi")
    const failed = { ...msg("t1-e", "assistant", "Error: boom"), isError: true }
    const error = { code: "http_status", message: "boom", status: 500 }
    feed(fold, [
      attachedMsg(),
      status(1, 0, true),
      ev(1, 1, { type: "agent_start" }),
      ev(1, 2, { type: "message_start", message: user }),
      ev(1, 3, { type: "message_end", message: user }),
      ev(1, 4, { type: "message_start", message: { ...failed, content: "" } })
    ])
    assert.isTrue(fold.streaming?.isError)
    feed(fold, [
      ev(1, 5, { type: "message_update", messageId: failed.id, delta: failed.content }),
      ev(1, 6, { type: "message_end", message: failed }),
      ev(1, 7, { type: "turn_end" }),
      ev(1, 8, { type: "agent_end", error })
    ])
    assert.deepStrictEqual(fold.snapshot().turnError, error)
    assert.isTrue(fold.messages.at(-1)!.isError)
    feed(fold, [status(1, 9, false), ...turn(1, 10, "again")])
    assert.isUndefined(fold.snapshot().turnError)
  })

  it("reassembles a chunked attach snapshot; the next generation's events follow its cursor", () => {
    const fold = new SessionFold(ID)
    fold.attaching()
    assert.deepStrictEqual(fold.attached(attachResult({ status: "unavailable", reason: "no_cursor" }, { cursor: c(2, 9), messages: [msg("a"), msg("b"), msg("c")] }, true)), Either.right([]))
    const out = feed(fold, [begin("s~g3", "attach", 3, c(2, 9)), chunk("s~g3", 0, [msg("a"), msg("b")]), chunk("s~g3", 1, [msg("c")]), end("s~g3", 2)])
    assert.strictEqual(out.length, 1)
    const b = out[0]!
    assert.strictEqual(b.type === "baseline" && b.purpose, "attach")
    assert.deepStrictEqual(contents(fold), ["a", "b", "c"])
    assert.deepStrictEqual(fold.lastCursor, c(2, 9))
    const t = turn(3, 0, "x")
    assert.deepStrictEqual(cursors(feed(fold, [attachedMsg(), ...t])), t.map((_, i) => `3:${i}`))
    assert.deepStrictEqual(contents(fold), ["a", "b", "c", "x", "echo: x"])
  })

  it("a resync snapshot mid-stream replaces the state; a replacement too; events go on after their cursors", () => {
    const fold = new SessionFold(ID)
    fold.attaching()
    fold.attached(attachResult({ status: "unavailable", reason: "no_cursor" }, { messages: [] }))
    feed(fold, [attachedMsg(), ...turn(1, 0, "one")])
    // The events from 1:10 to 4:x were pruned while this client was paused: a resync.
    const out = feed(fold, [begin("s~g5", "resync", 2, c(4, 7)), chunk("s~g5", 0, [msg("p"), msg("q")]), end("s~g5", 1)])
    const b = out[0]!
    assert.isTrue(b.type === "baseline" && b.purpose === "resync" && b.skipped)
    assert.deepStrictEqual(contents(fold), ["p", "q"])
    assert.deepStrictEqual(fold.lastCursor, c(4, 7))
    assert.deepStrictEqual(fold.emittedCursor, c(4, 7))
    const t = turn(5, 0, "two")
    assert.deepStrictEqual(cursors(feed(fold, t)), t.map((_, i) => `5:${i}`))
    assert.deepStrictEqual(contents(fold), ["p", "q", "two", "echo: two"])
    // A history rewrite: the new generation's snapshot, then its events.
    const r = feed(fold, [begin("s~g6", "replacement", 1, c(5, t.length - 1)), chunk("s~g6", 0, [msg("compacted 4 messages")]), end("s~g6", 1)])
    assert.strictEqual(r[0]!.type === "baseline" && r[0]!.purpose, "replacement")
    assert.deepStrictEqual(contents(fold), ["compacted 4 messages"])
    feed(fold, turn(6, 0, "three"))
    assert.deepStrictEqual(contents(fold), ["compacted 4 messages", "three", "echo: three"])
  })

  it("after a resync mid-stream, the summary get_state read is taken (the snapshot swallowed the idle status), unless a newer status came", () => {
    const fold = new SessionFold(ID)
    fold.attaching()
    fold.attached(attachResult({ status: "unavailable", reason: "no_cursor" }, { messages: [] }))
    feed(fold, [attachedMsg(), ...turn(1, 0, "one").slice(0, 3)])
    assert.isTrue(fold.busy)
    // The turn's end and its idle status were pruned while this client was paused.
    feed(fold, [begin("s~g3", "resync", 2, c(2, 4)), chunk("s~g3", 0, [msg("u", "user", "one"), msg("echo: one")]), end("s~g3", 1)])
    assert.isTrue(fold.busy, "the last status folded said busy")
    fold.refreshed({ ...summary(false), lastEventCursor: c(2, 4) })
    assert.isFalse(fold.busy)
    // A status newer than what get_state read wins over it.
    feed(fold, [status(3, 0, true)])
    fold.refreshed({ ...summary(false), lastEventCursor: c(2, 4) })
    assert.isTrue(fold.busy)
  })

  it("a connection cut off in the middle of a chunked snapshot resumes it from its next chunk (snapshotResume); another snapshot starts over", () => {
    const fold = new SessionFold(ID)
    fold.attaching()
    const streamed = attachResult({ status: "unavailable", reason: "no_cursor" }, { cursor: c(2, 9), messages: [msg("a"), msg("b"), msg("c")] }, true)
    fold.attached(streamed)
    feed(fold, [begin(`${ID}~g1`, "attach", 3, c(2, 9)), chunk(`${ID}~g1`, 0, [msg("a")]), chunk(`${ID}~g1`, 1, [msg("b")])])
    // Dropped after two chunks: the next attach asks for the rest.
    assert.deepStrictEqual(fold.attaching(), { snapshotResume: { snapshotId: `${ID}~g1`, fromChunk: 2 } })
    assert.deepStrictEqual(fold.attached(streamed), Either.right([]))
    const out = feed(fold, [begin(`${ID}~g1`, "attach", 3, c(2, 9)), chunk(`${ID}~g1`, 2, [msg("c")]), end(`${ID}~g1`, 3)])
    assert.strictEqual(out[0]!.type, "baseline")
    assert.deepStrictEqual(contents(fold), ["a", "b", "c"])
    // Cut off again, but the daemon streams another snapshot (the first one is gone): from chunk 0.
    const again = new SessionFold(ID)
    again.attaching()
    again.attached(streamed)
    feed(again, [begin(`${ID}~g1`, "attach", 3, c(2, 9)), chunk(`${ID}~g1`, 0, [msg("a")])])
    assert.deepStrictEqual(again.attaching(), { snapshotResume: { snapshotId: `${ID}~g1`, fromChunk: 1 } })
    const other = { ...streamed, snapshotStream: { id: `${ID}~g2`, messageCount: 2, targetChunkBytes: 100 } }
    again.attached(other)
    feed(again, [begin(`${ID}~g2`, "attach", 2, c(3, 1)), chunk(`${ID}~g2`, 0, [msg("x"), msg("y")]), end(`${ID}~g2`, 1)])
    assert.deepStrictEqual(contents(again), ["x", "y"])
  })

  it("a reconnect resumes from the last cursor; an overlapping replay is dropped up to it", () => {
    const fold = new SessionFold(ID)
    fold.attaching()
    fold.attached(attachResult({ status: "unavailable", reason: "no_cursor" }, { messages: [] }))
    const t = turn(1, 0, "a b")
    feed(fold, [attachedMsg(), ...t.slice(0, 5)])
    // The connection drops; the next attach resumes from 1:4.
    assert.deepStrictEqual(fold.attaching(), { resumeCursor: c(1, 4) })
    assert.deepStrictEqual(fold.attached(attachResult({ status: "complete", fromCursor: c(1, 5) }, undefined)), Either.right([]))
    // Even if the daemon sent some again, nothing at or before 1:4 is folded or emitted twice.
    const out = feed(fold, [attachedMsg("complete"), ...t.slice(2).map((m) => ({ ...m, meta: { ...(m as { meta: Protocol.EventMeta }).meta, replayed: true as const } }))])
    assert.deepStrictEqual(cursors(out), t.slice(5).map((_, i) => `1:${i + 5}`))
    assert.deepStrictEqual(contents(fold), ["a b", "echo: a b"])
  })

  it("a partial replay (cursor expired) on reconnect: the inline baseline replaces the state", () => {
    const fold = new SessionFold(ID)
    fold.attaching()
    fold.attached(attachResult({ status: "unavailable", reason: "no_cursor" }, { messages: [] }))
    feed(fold, [attachedMsg(), ...turn(1, 0, "a")])
    fold.attaching()
    const r = fold.attached(attachResult({ status: "partial", reason: "cursor_expired" }, { cursor: c(3, 2), messages: [msg("x"), msg("y")] }))
    assert.isTrue(Either.isRight(r) && r.right[0]?.type === "baseline" && r.right[0].purpose === "resync" && r.right[0].skipped)
    assert.deepStrictEqual(contents(fold), ["x", "y"])
    assert.deepStrictEqual(cursors(feed(fold, [attachedMsg("partial"), ...turn(4, 0, "b")])).length, 10)
  })

  it("started from a cursor: the state is rebuilt from the baseline, only the events after the cursor are emitted", () => {
    const fold = new SessionFold(ID, c(1, 4))
    fold.attaching()
    const r = fold.attached(attachResult({ status: "unavailable", reason: "no_cursor" }, { messages: [] }))
    assert.isTrue(Either.isRight(r) && r.right[0]?.type === "baseline" && !r.right[0].skipped)
    const t = turn(1, 0, "a")
    const out = feed(fold, [attachedMsg(), ...t.map((m) => ({ ...m, meta: { ...(m as { meta: Protocol.EventMeta }).meta, replayed: true as const } }))])
    assert.deepStrictEqual(cursors(out), t.slice(5).map((_, i) => `1:${i + 5}`))
    assert.deepStrictEqual(contents(fold), ["a", "echo: a"])
  })

  it("refuses a gap, chunks out of order or missing, events inside a snapshot; a failed snapshot is SnapshotFailed", () => {
    const started = () => {
      const fold = new SessionFold(ID)
      fold.attaching()
      fold.attached(attachResult({ status: "unavailable", reason: "no_cursor" }, { messages: [] }))
      feed(fold, [attachedMsg(), ev(1, 0, { type: "agent_start" })])
      return fold
    }
    const leftOf = (fold: SessionFold, ms: ReadonlyArray<Protocol.PushMessage>) => {
      for (const m of ms) {
        const r = fold.receive(m)
        if (Either.isLeft(r)) return r.left
      }
      return assert.fail("expected a Left")
    }
    const gap = leftOf(started(), [ev(1, 2, { type: "turn_start" })])
    assert.strictEqual(gap._tag, "SessionProtocolViolation")
    assert.include(gap.message, "does not follow 1:0")
    assert.strictEqual(leftOf(started(), [begin("x", "resync", 2), chunk("x", 1, [msg("a")])])._tag, "SessionProtocolViolation")
    assert.include(leftOf(started(), [begin("x", "resync", 2), chunk("x", 0, [msg("a")]), end("x", 1)]).message, "announced 2 messages, 1 came")
    assert.include(leftOf(started(), [begin("x", "resync", 1), ev(1, 1, { type: "turn_start" })]).message, "inside snapshot")
    const failed = leftOf(started(), [begin("x", "resync", 1), {
      type: "session_snapshot_failed",
      activeSessionId: ID,
      snapshotId: "x",
      error: { code: "internal", message: "gone" }
    }])
    assert.strictEqual(failed._tag, "SnapshotFailed")
    // Other sessions' messages are not this follower's business.
    const fold = started()
    assert.deepStrictEqual(fold.receive({ ...ev(9, 9, { type: "agent_end" }), activeSessionId: "s-other" } as Protocol.PushMessage), Either.right([]))
  })
})

describe("cursor file", () => {
  it.effect("written atomically with mode 0600, read back; another session's file is an error", () =>
    Effect.gen(function*() {
      const dir = fs.mkdtempSync(path.join(os.tmpdir(), "agentd-cursor-"))
      try {
        const file = path.join(dir, "follow.json")
        assert.strictEqual(yield* readCursorFile(file, ID), undefined)
        writeCursorFileSync(file, ID, c(3, 14))
        assert.strictEqual(fs.statSync(file).mode & 0o777, 0o600)
        assert.deepStrictEqual(fs.readdirSync(dir), ["follow.json"])
        assert.deepStrictEqual(yield* readCursorFile(file, ID), c(3, 14))
        const other = yield* Effect.flip(readCursorFile(file, "s-other"))
        assert.include(other.message, "holds the cursor of session s-test")
        fs.writeFileSync(file, "garbage")
        assert.strictEqual((yield* Effect.flip(readCursorFile(file, ID)))._tag, "CursorFileError")
      } finally {
        fs.rmSync(dir, { recursive: true, force: true })
      }
    }))
})

describe("SessionClient: the reconnect schedule (TestClock)", () => {
  /** Waits in real time (the TestClock does not move by itself), polling `pred`. */
  const until = (what: string, pred: () => Effect.Effect<boolean>, ms = 10_000) =>
    Effect.gen(function*() {
      const deadline = Date.now() + ms
      while (!(yield* pred())) {
        if (Date.now() > deadline) return yield* Effect.dieMessage(`timed out waiting for ${what}`)
        yield* Effect.promise(() => new Promise((resolve) => setTimeout(resolve, 5)))
      }
    })

  it.scoped("with the default schedule a follower reconnects after 50, 100, 200, 400, 800, 1600 ms, then every 2 s", () =>
    Effect.gen(function*() {
      // A "daemon" that accepts each connection and closes it before any hello: every attempt
      // fails DaemonUnreachable, which the follower retries.
      const dir = yield* Effect.acquireRelease(
        Effect.sync(() => fs.mkdtempSync(path.join(os.tmpdir(), "agentd-reconnect-"))),
        (d) => Effect.sync(() => fs.rmSync(d, { recursive: true, force: true }))
      )
      const socketPath = path.join(dir, "d.sock")
      let attempts = 0
      const server = net.createServer((socket) => {
        attempts++
        socket.destroy()
      })
      yield* Effect.acquireRelease(
        Effect.async<void>((resume) => void server.listen(socketPath, () => resume(Effect.void))),
        () => Effect.async<void>((resume) => void server.close(() => resume(Effect.void)))
      )
      // No `reconnect`: SessionClient.defaultReconnect.
      const follower = yield* SessionClient.make({ activeSessionId: ID, socketPath })
      const fiber = yield* Effect.fork(Stream.runDrain(follower.events))
      yield* until("the first attempt", () => Effect.succeed(attempts === 1))
      for (const [i, delay] of [50, 100, 200, 400, 800, 1600, 2000, 2000].entries()) {
        // The follower now sleeps on the clock until its next attempt: exactly `delay` from now.
        const now = yield* TestClock.currentTimeMillis
        yield* until(`the sleep before attempt ${i + 2}`, () => Effect.map(TestClock.sleeps(), (s) => Chunk.some(s, (t) => t === now + delay)))
        yield* TestClock.adjust(delay - 1)
        yield* Effect.promise(() => new Promise((resolve) => setTimeout(resolve, 30)))
        assert.strictEqual(attempts, i + 1, `no attempt ${i + 2} before ${delay} ms`)
        yield* TestClock.adjust(1)
        yield* until(`attempt ${i + 2}, ${delay} ms after the last`, () => Effect.succeed(attempts === i + 2))
      }
      // Still retrying, never failed.
      assert.isNull(fiber.unsafePoll())
      yield* Fiber.interrupt(fiber)
    }))

  it.scoped("a reconnect schedule that gives up ends the follow with the last connection error", () =>
    Effect.gen(function*() {
      const dir = yield* Effect.acquireRelease(
        Effect.sync(() => fs.mkdtempSync(path.join(os.tmpdir(), "agentd-reconnect-"))),
        (d) => Effect.sync(() => fs.rmSync(d, { recursive: true, force: true }))
      )
      // Nothing listens there.
      const follower = yield* SessionClient.make({
        activeSessionId: ID,
        socketPath: path.join(dir, "none.sock"),
        reconnect: Schedule.recurs(3).pipe(Schedule.intersect(Schedule.spaced("1 second")))
      })
      const fiber = yield* Effect.fork(Effect.either(Stream.runDrain(follower.events)))
      for (let i = 0; i < 3; i++) {
        const now = yield* TestClock.currentTimeMillis
        yield* until(`retry ${i + 1}`, () => Effect.map(TestClock.sleeps(), (s) => Chunk.some(s, (t) => t === now + 1000)))
        yield* TestClock.adjust("1 second")
      }
      const result = yield* Fiber.join(fiber)
      assert.isTrue(Either.isLeft(result))
      if (Either.isLeft(result)) assert.strictEqual(result.left._tag, "DaemonUnreachable")
    }))
})
