/**
 * The chaos harness's delivery checker must catch what it exists to catch (a skipped event, a
 * duplicate, a jump over a pruned generation without a resync) and accept what the protocol
 * allows (a baseline, a resync, a resume).
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
