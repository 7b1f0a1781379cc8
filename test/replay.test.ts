import { assert, describe, it } from "@effect/vitest"
import * as Cursor from "../src/Cursor.js"
import { type Decision, decideReplay, needsLastSequence, type ReplayView } from "../src/internal/delivery/replay.js"

const c = Cursor.make
/**
 * A session in generation 5 whose log holds generations 4 and 5; generation 4 began after 3:6,
 * generation 5 (its snapshot) after 4:9.
 */
const view = (resume: Cursor.Cursor | undefined, over: Partial<ReplayView> = {}): ReplayView => ({
  resume,
  last: c(5, 20),
  generation: 5,
  oldestGeneration: 4,
  oldestGenerationStart: c(3, 6),
  lastSequenceOfResumeGeneration: resume?.generation === 4 ? 9 : undefined,
  ...over
})

describe("replay decision", () => {
  it("no cursor: a baseline (no_cursor)", () => {
    assert.deepStrictEqual(decideReplay(view(undefined)), { kind: "baseline", replay: { status: "unavailable", reason: "no_cursor" } })
  })

  it("a cursor past the session's last, or any cursor on a session without events: cursor_ahead", () => {
    const ahead: Decision = { kind: "baseline", replay: { status: "unavailable", reason: "cursor_ahead" } }
    assert.deepStrictEqual(decideReplay(view(c(5, 21))), ahead)
    assert.deepStrictEqual(decideReplay(view(c(6, 0))), ahead)
    assert.deepStrictEqual(decideReplay(view(c(1, 0), { last: undefined })), ahead)
  })

  it("a cursor in the current generation or at the session's last: complete after it", () => {
    assert.deepStrictEqual(decideReplay(view(c(5, 3))), { kind: "complete", after: c(5, 3) })
    assert.deepStrictEqual(decideReplay(view(c(5, 20))), { kind: "complete", after: c(5, 20) })
  })

  it("a cursor in an older generation the log holds: complete up to its last sequence, cursor_unknown past it", () => {
    assert.deepStrictEqual(decideReplay(view(c(4, 2))), { kind: "complete", after: c(4, 2) })
    assert.deepStrictEqual(decideReplay(view(c(4, 9))), { kind: "complete", after: c(4, 9) })
    assert.deepStrictEqual(decideReplay(view(c(4, 10))), { kind: "baseline", replay: { status: "unavailable", reason: "cursor_unknown" } })
    assert.isTrue(needsLastSequence(c(4, 2), c(5, 20), 4))
    assert.isFalse(needsLastSequence(c(5, 2), c(5, 20), 4))
    assert.isFalse(needsLastSequence(c(3, 2), c(5, 20), 4))
  })

  it("a cursor in a pruned generation: partial (cursor_expired), complete at the very last event before the oldest kept generation, cursor_unknown past it", () => {
    const expired: Decision = { kind: "baseline", replay: { status: "partial", reason: "cursor_expired" } }
    const unknown: Decision = { kind: "baseline", replay: { status: "unavailable", reason: "cursor_unknown" } }
    assert.deepStrictEqual(decideReplay(view(c(3, 4))), expired)
    assert.deepStrictEqual(decideReplay(view(c(2, 100))), expired)
    // The end of pruned generation 3, while 4 and 5 are kept: every event after it is in the log.
    assert.deepStrictEqual(decideReplay(view(c(3, 6))), { kind: "complete", after: c(3, 6) })
    assert.deepStrictEqual(decideReplay(view(c(3, 7))), unknown)
    // Where the oldest kept generation began is unknown: expired.
    assert.deepStrictEqual(decideReplay(view(c(3, 6), { oldestGenerationStart: undefined })), expired)
    // Only generation 5 is kept: its snapshot's cursor is the end of pruned generation 4.
    const onlyCurrent = { oldestGeneration: 5, oldestGenerationStart: c(4, 9), lastSequenceOfResumeGeneration: undefined }
    assert.deepStrictEqual(decideReplay(view(c(4, 9), onlyCurrent)), { kind: "complete", after: c(4, 9) })
    assert.deepStrictEqual(decideReplay(view(c(4, 8), onlyCurrent)), expired)
    assert.deepStrictEqual(decideReplay(view(c(4, 10), onlyCurrent)), unknown)
    // Generation 4 was empty and is pruned: 3:6 is still the last event before generation 5.
    const emptyBetween = { oldestGeneration: 5, oldestGenerationStart: c(3, 6), lastSequenceOfResumeGeneration: undefined }
    assert.deepStrictEqual(decideReplay(view(c(3, 6), emptyBetween)), { kind: "complete", after: c(3, 6) })
    assert.deepStrictEqual(decideReplay(view(c(4, 0), emptyBetween)), unknown)
  })
})
