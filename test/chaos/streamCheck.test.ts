/**
 * The chaos harness's delivery checker must catch what it exists to catch (a skipped event, a
 * duplicate, a jump over a pruned generation without a resync, a client that goes on across a
 * history rewrite, a rewrite that is not the compaction of what the client held) and accept what
 * the protocol allows (a baseline, a resync, a replacement, a resume).
 */
import { assert, describe, it } from "vitest"
import { type Cursor, type Msg, SessionStream, Truth, Violation } from "./streamCheck.js"

const ID = "s1"
const ev = (g: number, s: number, type = "message_update", extra: Msg = {}): Msg => ({
  type: "session_event",
  activeSessionId: ID,
  event: { type, ...extra },
  meta: { cursor: { generation: g, sequence: s }, emittedAt: 1_700_000_000_000 + g * 1000 + s }
})
const attachOk = (data: Msg): Msg => ({ type: "response", command: "attach", success: true, data })
const baselineAttach = (cursor?: Cursor, last?: Cursor): Msg =>
  attachOk({
    replay: { status: "unavailable", reason: "no_cursor" },
    snapshot: { snapshotId: "x", messageCount: 0, messages: [], ...(cursor ? { cursor } : {}) },
    ...(last ? { lastEventCursor: last } : {})
  })

const attached = (stream: SessionStream, cursor?: Cursor, last?: Cursor) => {
  stream.attachSent(undefined)
  stream.attachResponse(baselineAttach(cursor, last))
  stream.receive({ type: "session_attached", activeSessionId: ID })
}

const violation = (f: () => void): string => {
  try {
    f()
  } catch (e) {
    if (e instanceof Violation) return e.invariant
    throw e
  }
  return "none"
}

describe("SessionStream", () => {
  it("frames of a resync still in flight when the client attaches again belong to the earlier attachment", () => {
    const s = new SessionStream(ID, "c", new Truth(ID))
    attached(s)
    s.receive(ev(1, 0))
    const frame = { activeSessionId: ID, snapshotId: "g3" }
    s.receive({ type: "session_snapshot_begin", ...frame, purpose: "resync", messageCount: 2, cursor: { generation: 2, sequence: 4 } })
    s.receive({ type: "session_snapshot_chunk", ...frame, index: 0, messages: [{ id: "a", role: "user", content: "a" }] })
    // The client attaches again (from no cursor) while the resync streams.
    s.attachSent(undefined)
    s.receive({ type: "session_snapshot_chunk", ...frame, index: 1, messages: [{ id: "b", role: "assistant", content: "b" }] })
    s.receive({ type: "session_snapshot_end", ...frame, chunkCount: 2 })
    s.receive(ev(3, 0))
    s.attachResponse(baselineAttach({ generation: 2, sequence: 4 }))
    s.receive({ type: "session_attached", activeSessionId: ID })
    s.receive(ev(3, 0))
    // A chunk out of its snapshot is still caught.
    s.attachSent(undefined)
    assert.strictEqual(violation(() => s.receive({ type: "session_snapshot_chunk", ...frame, index: 0, messages: [] })), "snapshot frames")
  })

  it("an attach sent after the session was closed must be refused: an error passes, a success is caught", () => {
    const s = new SessionStream(ID, "c", new Truth(ID))
    attached(s)
    s.receive(ev(1, 0))
    s.receive({ ...ev(1, 1), type: "session_closed", reason: "killed" })
    s.attachSent({ generation: 1, sequence: 1 })
    s.attachResponse({ type: "response", command: "attach", success: false, error: { code: "session_not_found", message: "No session." } })
    s.attachSent({ generation: 1, sequence: 1 })
    assert.strictEqual(violation(() => s.attachResponse(baselineAttach())), "closed for good")
  })

  it("accepts a contiguous stream across a generation and folds message_end", () => {
    const truth = new Truth(ID)
    const s = new SessionStream(ID, "c", truth)
    attached(s)
    s.receive(ev(1, 0))
    s.receive(ev(1, 1, "message_end", { message: { id: "m1", role: "user", content: "hi" } }))
    s.receive(ev(2, 0))
    truth.checkJumps(true)
    assert.deepStrictEqual(s.fold, [{ id: "m1", role: "user", content: "hi" }])
    assert.strictEqual(s.events, 3)
  })

  it("catches a skipped and a repeated event", () => {
    const s = new SessionStream(ID, "c", new Truth(ID))
    attached(s)
    s.receive(ev(1, 0))
    assert.strictEqual(violation(() => s.receive(ev(1, 2))), "cursor order, each once, no gap")
    const t = new SessionStream(ID, "d", new Truth(ID))
    attached(t)
    t.receive(ev(1, 0))
    assert.strictEqual(violation(() => t.receive(ev(1, 0))), "cursor order, each once, no gap")
  })

  it("catches a jump over events another client saw (a pruned generation skipped without resync)", () => {
    const truth = new Truth(ID)
    const full = new SessionStream(ID, "full", truth)
    const paused = new SessionStream(ID, "paused", truth)
    attached(full)
    attached(paused)
    for (const [g, n] of [[1, 3], [2, 2], [3, 1], [4, 1]] as const) {
      for (let i = 0; i < n; i++) full.receive(ev(g, i))
    }
    paused.receive(ev(1, 0))
    paused.receive(ev(1, 1))
    paused.receive(ev(4, 0)) // locally plausible: sequence 0 of a later generation
    assert.strictEqual(violation(() => truth.checkJumps(true)), "no gap")
  })

  it("catches a busy status right after a turn's end; accepts the idle one, and a resync between", () => {
    const status = (g: number, seq: number, busy: boolean, worker = "ready"): Msg => ({
      type: "session_status",
      activeSessionId: ID,
      state: { busy, worker },
      meta: { cursor: { generation: g, sequence: seq }, emittedAt: 1_700_000_000_000 + seq }
    })
    const s = new SessionStream(ID, "c", new Truth(ID))
    attached(s)
    s.receive(ev(1, 0, "agent_start"))
    s.receive(ev(1, 1, "agent_end"))
    s.receive(status(1, 2, false))
    s.receive(status(1, 3, true))
    s.receive(status(1, 4, true, "recovering"))
    s.receive(ev(1, 5, "turn_interrupted", { reason: "worker_crashed" }))
    assert.strictEqual(violation(() => s.receive(status(1, 6, true, "recovering"))), "an idle status after a turn's end")
    // A resync after the turn's end: the status it skipped is inside its snapshot.
    const t = new SessionStream(ID, "d", new Truth(ID))
    attached(t)
    t.receive(ev(1, 0, "agent_end"))
    t.receive({ type: "session_snapshot_begin", activeSessionId: ID, snapshotId: "r", purpose: "resync", messageCount: 0, cursor: { generation: 2, sequence: 3 } })
    t.receive({ type: "session_snapshot_end", activeSessionId: ID, snapshotId: "r", chunkCount: 0 })
    t.receive(status(3, 0, true))
  })

  it("takes turn_interrupted {daemon_shutdown} as a turn's end (its idle status next); refuses an undocumented reason", () => {
    const status = (seq: number, busy: boolean): Msg => ({
      type: "session_status",
      activeSessionId: ID,
      state: { busy, worker: "ready" },
      meta: { cursor: { generation: 1, sequence: seq }, emittedAt: 1_700_000_000_000 + seq }
    })
    const s = new SessionStream(ID, "c", new Truth(ID))
    attached(s)
    s.receive(ev(1, 0, "agent_start"))
    s.receive(ev(1, 1, "turn_interrupted", { reason: "daemon_shutdown" }))
    assert.strictEqual(violation(() => s.receive(status(2, true))), "an idle status after a turn's end")
    const t = new SessionStream(ID, "d", new Truth(ID))
    attached(t)
    t.receive(ev(1, 0, "agent_start"))
    t.receive(ev(1, 1, "turn_interrupted", { reason: "daemon_shutdown" }))
    t.receive(status(2, false))
    const u = new SessionStream(ID, "e", new Truth(ID))
    attached(u)
    assert.strictEqual(violation(() => u.receive(ev(1, 0, "turn_interrupted", { reason: "daemon_stopped" }))), "turn_interrupted reasons")
  })

  it("accepts a resync snapshot in the middle of a stream and starts over from it", () => {
    const truth = new Truth(ID)
    const s = new SessionStream(ID, "c", truth)
    attached(s)
    s.receive(ev(1, 0))
    s.receive({ type: "session_snapshot_begin", activeSessionId: ID, snapshotId: "g4", messageCount: 1, purpose: "resync", cursor: { generation: 3, sequence: 5 } })
    s.receive({ type: "session_snapshot_chunk", activeSessionId: ID, snapshotId: "g4", index: 0, messages: [{ id: "a", role: "assistant", content: "x" }] })
    s.receive({ type: "session_snapshot_end", activeSessionId: ID, snapshotId: "g4", chunkCount: 1 })
    s.receive(ev(4, 0))
    truth.checkJumps(true)
    assert.strictEqual(s.resyncs, 1)
    assert.deepStrictEqual(s.fold, [{ id: "a", role: "assistant", content: "x" }])
  })

  it("catches an event in the middle of a snapshot and a live-flagged event that existed at attach", () => {
    const s = new SessionStream(ID, "c", new Truth(ID))
    attached(s)
    s.receive({ type: "session_snapshot_begin", activeSessionId: ID, snapshotId: "g2", messageCount: 0, purpose: "resync", cursor: { generation: 1, sequence: 5 } })
    assert.strictEqual(violation(() => s.receive(ev(2, 0))), "attach order")
    const t = new SessionStream(ID, "d", new Truth(ID))
    attached(t, undefined, { generation: 1, sequence: 3 })
    assert.strictEqual(violation(() => t.receive(ev(1, 0))), "replayed flag")
  })

  describe("history rewrites (replacement snapshots)", () => {
    const user = (id: string, content: string) => ({ id, role: "user", content })
    const compacted = (n: number) => ({ id: "t9-c", role: "assistant", content: `compacted ${n} messages` })
    /** A /compact turn's start in generation 1: agent_start, turn_start, a user message_end; `at` earlier messages. */
    const compactTurn = (s: SessionStream, from: number) => {
      s.receive(ev(1, from, "agent_start"))
      s.receive(ev(1, from + 1, "message_end", { message: user("t9-u", "/compact") }))
    }
    const replacement = (s: SessionStream, cursor: Cursor | undefined, messages: Array<Msg>, chunkSizes = [messages.length]) => {
      s.receive({ type: "session_snapshot_begin", activeSessionId: ID, snapshotId: "r", messageCount: messages.length, purpose: "replacement", ...(cursor ? { cursor } : {}) })
      let at = 0
      chunkSizes.forEach((n, index) => {
        s.receive({ type: "session_snapshot_chunk", activeSessionId: ID, snapshotId: "r", index, messages: messages.slice(at, at + n) })
        at += n
      })
      s.receive({ type: "session_snapshot_end", activeSessionId: ID, snapshotId: "r", chunkCount: chunkSizes.length })
    }

    it("a live replacement explains the jump, and the new generation's events from sequence 0 are clean", () => {
      const truth = new Truth(ID)
      const s = new SessionStream(ID, "c", truth)
      attached(s)
      s.receive(ev(1, 0, "message_end", { message: user("u1", "hi") }))
      compactTurn(s, 1)
      // The rewrite at 1:2, in two chunks (a client without chunked_snapshot gets frames too).
      replacement(s, { generation: 1, sequence: 2 }, [compacted(2)], [1, 0])
      assert.deepStrictEqual(s.fold, [compacted(2)])
      s.receive(ev(2, 0, "turn_end"))
      s.receive(ev(2, 1, "agent_end"))
      s.receive(ev(2, 2, "message_end", { message: user("u2", "after") }))
      truth.checkJumps(true)
      assert.deepStrictEqual(s.fold, [compacted(2), user("u2", "after")])
      assert.strictEqual(s.replacements, 1)
      assert.strictEqual(s.resyncs, 1)
      assert.strictEqual(s.skips, 0) // the turn's end follows the replacement: nothing skipped
      assert.strictEqual(s.compactionsChecked, 1)
      assert.strictEqual(truth.rewrites.get("1:2"), 2)
      assert.strictEqual(truth.compactions.get("t9-c"), 2)
      assert.deepStrictEqual(s.last, { generation: 2, sequence: 2 })
    })

    it("a replacement past the client's cursor (it was paused, generations went on) explains the jump and counts as a skip", () => {
      const truth = new Truth(ID)
      const full = new SessionStream(ID, "full", truth)
      const paused = new SessionStream(ID, "paused", truth)
      attached(full)
      attached(paused)
      compactTurn(full, 0)
      compactTurn(paused, 0)
      replacement(full, { generation: 1, sequence: 1 }, [compacted(1)])
      for (let i = 0; i < 3; i++) full.receive(ev(2, i))
      full.receive(ev(3, 0))
      // The paused client gets the current (generation 3) snapshot of the rewritten history.
      paused.receive({ type: "session_snapshot_begin", activeSessionId: ID, snapshotId: "g3", messageCount: 1, purpose: "replacement", cursor: { generation: 2, sequence: 2 } })
      paused.receive({ type: "session_snapshot_chunk", activeSessionId: ID, snapshotId: "g3", index: 0, messages: [compacted(1)] })
      paused.receive({ type: "session_snapshot_end", activeSessionId: ID, snapshotId: "g3", chunkCount: 1 })
      paused.receive(ev(3, 0))
      truth.checkJumps(true)
      assert.strictEqual(paused.skips, 1)
      assert.strictEqual(paused.compactionsChecked, 0)
    })

    it("a jump no resync or replacement explains is still caught", () => {
      const truth = new Truth(ID)
      const full = new SessionStream(ID, "full", truth)
      const other = new SessionStream(ID, "other", truth)
      attached(full)
      attached(other)
      compactTurn(full, 0)
      replacement(full, { generation: 1, sequence: 1 }, [compacted(1)])
      full.receive(ev(2, 0))
      full.receive(ev(2, 1))
      full.receive(ev(3, 0))
      // A replacement whose cursor is 2:0 followed by 3:0 skips 2:1, which exists.
      other.receive(ev(1, 0, "agent_start"))
      replacement(other, { generation: 2, sequence: 0 }, [compacted(1)])
      other.receive(ev(3, 0))
      assert.strictEqual(violation(() => truth.checkJumps(true)), "no gap")
      // Events that do not start a generation after the replacement's cursor.
      const t = new SessionStream(ID, "t", new Truth(ID))
      attached(t)
      compactTurn(t, 0)
      replacement(t, { generation: 1, sequence: 1 }, [compacted(1)])
      assert.strictEqual(violation(() => t.receive(ev(2, 1))), "no gap after a baseline")
    })

    it("a client that goes on into the rewritten generation without the replacement is caught", () => {
      const truth = new Truth(ID)
      const full = new SessionStream(ID, "full", truth)
      const missed = new SessionStream(ID, "missed", truth)
      attached(full)
      attached(missed)
      compactTurn(full, 0)
      compactTurn(missed, 0)
      replacement(full, { generation: 1, sequence: 1 }, [compacted(1)])
      full.receive(ev(2, 0))
      missed.receive(ev(2, 0)) // locally plausible: sequence 0 of the next generation
      assert.strictEqual(violation(() => truth.checkJumps(true)), "replay never crosses a rewrite")
    })

    it("a replacement that is not the compaction of what the client held is caught", () => {
      for (const [messages, what] of [
        [[compacted(3)], "wrong N"],
        [[compacted(2), user("x", "y")], "more than the compaction"],
        [[user("u1", "hi"), user("t9-u", "/compact")], "not a compaction"]
      ] as const) {
        const s = new SessionStream(ID, "c", new Truth(ID))
        attached(s)
        s.receive(ev(1, 0, "message_end", { message: user("u1", "hi") }))
        compactTurn(s, 1)
        assert.strictEqual(violation(() => replacement(s, { generation: 1, sequence: 2 }, [...messages])), "transcript after a rewrite", what)
      }
    })

    it("the same replacement again, after a reconnect from its cursor (partial/transcript_replaced), is accepted", () => {
      const truth = new Truth(ID)
      const s = new SessionStream(ID, "c", truth)
      attached(s)
      compactTurn(s, 0)
      replacement(s, { generation: 1, sequence: 1 }, [compacted(1)])
      // Cut off before any event of generation 2: it resumes from 1:1, still before the rewrite.
      s.connectionLost()
      s.attachSent({ generation: 1, sequence: 1 })
      s.attachResponse(attachOk({
        replay: { status: "partial", reason: "transcript_replaced", eventCount: 0 },
        snapshot: { snapshotId: "r", cursor: { generation: 1, sequence: 1 }, messageCount: 1, messages: [] },
        snapshotStream: { id: "r", messageCount: 1, targetChunkBytes: 2048 }
      }))
      replacement(s, { generation: 1, sequence: 1 }, [compacted(1)])
      s.receive({ type: "session_attached", activeSessionId: ID })
      s.receive(ev(2, 0, "turn_end"))
      truth.checkJumps(true)
      assert.strictEqual(s.replacements, 2)
      assert.strictEqual(s.compactionsChecked, 1)
      assert.deepStrictEqual(s.fold, [compacted(1)])
    })

    it("a replacement never moves the client back", () => {
      const s = new SessionStream(ID, "c", new Truth(ID))
      attached(s)
      compactTurn(s, 0)
      s.receive(ev(1, 2))
      assert.strictEqual(violation(() => replacement(s, { generation: 1, sequence: 1 }, [compacted(1)])), "a resync or replacement never rewinds")
    })

    it("a resume from before a rewrite: partial/transcript_replaced is a baseline with purpose replacement, inline or as frames", () => {
      for (const streamed of [false, true]) {
        const truth = new Truth(ID)
        const s = new SessionStream(ID, "c", truth)
        attached(s)
        s.receive(ev(1, 0, "message_end", { message: user("u1", "hi") }))
        compactTurn(s, 1)
        s.connectionLost()
        s.attachSent({ generation: 1, sequence: 2 })
        const snapshot = { snapshotId: "r", cursor: { generation: 1, sequence: 2 }, messageCount: 1, messages: streamed ? [] : [compacted(2)] }
        s.attachResponse(attachOk({
          replay: { status: "partial", reason: "transcript_replaced", eventCount: 2 },
          snapshot,
          lastEventCursor: { generation: 2, sequence: 1 },
          ...(streamed ? { snapshotStream: { id: "r", messageCount: 1, targetChunkBytes: 2048 } } : {})
        }))
        if (streamed) replacement(s, { generation: 1, sequence: 2 }, [compacted(2)])
        s.receive({ type: "session_attached", activeSessionId: ID })
        s.receive({ ...ev(2, 0, "turn_end"), meta: { ...ev(2, 0)["meta"], replayed: true } })
        s.receive({ ...ev(2, 1, "agent_end"), meta: { ...ev(2, 1)["meta"], replayed: true } })
        truth.checkJumps(true)
        assert.deepStrictEqual(s.fold, [compacted(2)])
        assert.strictEqual(s.replacements, 1)
        assert.strictEqual(s.compactionsChecked, 1)
        assert.strictEqual(s.lastReplayStatus, "partial/transcript_replaced")
      }
      // Frames whose purpose is not the one the replay reason says.
      const t = new SessionStream(ID, "t", new Truth(ID))
      attached(t)
      t.receive(ev(1, 0))
      t.connectionLost()
      t.attachSent({ generation: 1, sequence: 0 })
      t.attachResponse(attachOk({
        replay: { status: "partial", reason: "transcript_replaced" },
        snapshot: { snapshotId: "r", messageCount: 1, messages: [] },
        snapshotStream: { id: "r", messageCount: 1, targetChunkBytes: 2048 }
      }))
      assert.strictEqual(
        violation(() => t.receive({ type: "session_snapshot_begin", activeSessionId: ID, snapshotId: "r", messageCount: 1, purpose: "attach" })),
        "snapshot frames"
      )
    })

    it("a replacement that reaches the earlier attachment while a re-attach is in flight belongs to it", () => {
      const truth = new Truth(ID)
      const s = new SessionStream(ID, "c", truth)
      attached(s)
      compactTurn(s, 0)
      s.attachSent(undefined) // a re-attach on the same connection
      s.receive({ type: "session_snapshot_begin", activeSessionId: ID, snapshotId: "r", messageCount: 1, purpose: "replacement", cursor: { generation: 1, sequence: 1 } })
      // The daemon ended the earlier attachment in the middle of its frames; the attach's baseline follows.
      s.attachResponse(attachOk({
        replay: { status: "unavailable", reason: "no_cursor" },
        snapshot: { snapshotId: "g2", cursor: { generation: 1, sequence: 1 }, messageCount: 1, messages: [compacted(1)] },
        lastEventCursor: { generation: 2, sequence: 0 }
      }))
      s.receive({ type: "session_attached", activeSessionId: ID })
      s.receive({ ...ev(2, 0), meta: { ...ev(2, 0)["meta"], replayed: true } })
      truth.checkJumps(true)
      assert.strictEqual(s.events, 3)
      assert.deepStrictEqual(s.fold, [compacted(1)])
      assert.strictEqual(s.compactionsChecked, 1) // the attach baseline at the client's cursor is the compaction
    })
  })

  it("resumes after its own last cursor on a complete replay", () => {
    const s = new SessionStream(ID, "c", new Truth(ID))
    attached(s)
    s.receive(ev(1, 0))
    s.connectionLost()
    s.attachSent({ generation: 1, sequence: 0 })
    s.attachResponse(attachOk({ replay: { status: "complete", eventCount: 1 }, snapshot: { snapshotId: "x", messageCount: 0, messages: [] } }))
    s.receive({ type: "session_attached", activeSessionId: ID })
    assert.strictEqual(violation(() => s.receive({ ...ev(1, 2), meta: { ...ev(1, 2)["meta"], replayed: true } })), "cursor order, each once, no gap")
  })
})
