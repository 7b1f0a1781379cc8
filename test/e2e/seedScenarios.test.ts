/**
 * Two regression scenarios of the chaos seeds, as plain e2e tests against the real daemon:
 * - a history rewrite (`/compact`) lands while another client is half-way through a chunked
 *   baseline (it stopped reading: the daemon's delivery to it is paused): both clients end
 *   with the same transcript, the daemon's;
 * - a client cut off in the middle of a chunked snapshot by a daemon restart (SIGKILL) resumes
 *   with `snapshotResume` on the restarted daemon and ends with the daemon's transcript, every
 *   event after the snapshot once.
 *
 * Needs `npm run build` first.
 */
import { describe, expect, it } from "vitest"
import { attachAndReplay } from "./attach.js"
import { allMessages, cleanUpAfterTests, type Client, collectTurn, createSession, cursorGap, cursorOf, type Msg, useDaemon } from "./harness.js"

cleanUpAfterTests()

/**
 * Turns of 2 MB replies behind the baseline: 12 MB, more than a paused client's 8 MiB outbox and
 * its socket buffers, so that its baseline is still under way when the rewrite lands.
 */
const TURNS = Number(process.env["AGENTD_E2E_SEED_TURNS"] ?? 6)

/**
 * The transcript a raw client folds from what it received, in order: each snapshot's frames
 * (begin, chunks, end) replace its state (a chunk stream that restarts at index 0 starts over),
 * then each `message_end` appends.
 */
const fold = (messages: ReadonlyArray<Msg>, id: string, start: ReadonlyArray<Msg> = []): Array<Msg> => {
  let state = [...start]
  let pending: Array<Msg> | undefined
  for (const m of messages) {
    if (m["activeSessionId"] !== id) continue
    if (m["type"] === "session_snapshot_begin") pending = []
    else if (m["type"] === "session_snapshot_chunk") pending!.push(...(m["messages"] as Array<Msg>))
    else if (m["type"] === "session_snapshot_end") {
      state = pending!
      pending = undefined
    } else if (m["type"] === "session_event" && m["event"].type === "message_end") state.push(m["event"].message)
  }
  return state
}

const brief = (m: Msg) => `${m["id"]}:${m["role"]}:${String(m["content"]).length}:${String(m["content"]).slice(0, 24)}`

/** A session holding TURNS replies of 2 MB, checkpointed. */
const bigSession = async (ctl: Client): Promise<string> => {
  const { id } = await createSession(ctl)
  await attachAndReplay(ctl, { activeSessionId: id, capabilities: ["event_sequence", "slim_attach"] })
  for (let i = 0; i < TURNS; i++) {
    await ctl.ok({ type: "prompt", activeSessionId: id, message: "/bulk 2000000" })
    await collectTurn(ctl, id, 30_000)
    ctl.drain()
  }
  await ctl.ok({ type: "checkpoint", activeSessionId: id }, 30_000)
  return id
}

describe("seed scenarios (e2e)", () => {
  it("a client cut off mid-snapshot by a daemon restart resumes it; then a history rewrite while another client is half-way through a chunked baseline: both end with the daemon's transcript", async () => {
    const d = await useDaemon()
    const ctl = await d.connect("ctl")
    const id = await bigSession(ctl)
    const transcript = await allMessages(ctl, id)
    const reader = await d.connect("reader")
    reader.sendCommand({ type: "attach", activeSessionId: id, capabilities: ["chunked_snapshot", "event_sequence"] })
    const begin = await reader.waitFor((m) => m["type"] === "session_snapshot_begin", 30_000, "session_snapshot_begin")
    reader.socket.pause()
    await d.sigkill()
    reader.socket.resume()
    await reader.waitClosed()
    const before = reader.received((m) => m["type"] === "session_snapshot_chunk")
    expect(reader.received((m) => m["type"] === "session_snapshot_end"), "the restart did not cut the snapshot").toEqual([])
    expect(before.map((m) => m["index"])).toEqual(before.map((_, i) => i))

    const d2 = await useDaemon({ stateDir: d.stateDir })
    const ctl2 = await d2.connect("ctl2")
    await attachAndReplay(ctl2, { activeSessionId: id, capabilities: ["event_sequence", "slim_attach"] })
    const again = await d2.connect("again")
    const resumed = await attachAndReplay(again, {
      activeSessionId: id,
      capabilities: ["chunked_snapshot", "event_sequence"],
      snapshotResume: { snapshotId: begin["snapshotId"], fromChunk: before.length }
    })
    const chunks = again.received((m) => m["type"] === "session_snapshot_chunk")
    // The restarted daemon streams it from the chunk where it stopped while it holds that
    // snapshot (same id: ids are stable across restarts), else from chunk 0 as a plain attach
    // (a fresh daemon holds no snapshot until a reader asks for one): then the client starts over.
    expect(resumed.data["snapshotStream"]?.["id"]).toBe(begin["snapshotId"])
    expect([0, before.length]).toContain(chunks[0]!["index"])
    const whole = chunks[0]!["index"] === 0 ? chunks : [...before, ...chunks]
    expect(whole.map((m) => m["index"])).toEqual(whole.map((_, i) => i))
    const folded = [
      ...whole.flatMap((m) => m["messages"] as Array<Msg>),
      ...resumed.replayed.filter((m) => m["event"]?.type === "message_end").map((m) => m["event"]["message"] as Msg)
    ]
    expect(folded.map(brief)).toEqual(transcript.map(brief))
    // Then live events, after the snapshot's cursor with no gap.
    await ctl2.ok({ type: "prompt", activeSessionId: id, message: "after the restart" })
    await collectTurn(again, id, 30_000)
    await collectTurn(ctl2, id, 30_000)
    expect(cursorGap(again.sequenced(id), begin["cursor"])).toBeUndefined()
    const foldedAgain = [
      ...whole.flatMap((m) => m["messages"] as Array<Msg>),
      ...again.sequenced(id).filter((m) => m["event"]?.type === "message_end").map((m) => m["event"]["message"] as Msg)
    ]
    expect(foldedAgain.map(brief)).toEqual((await allMessages(ctl2, id)).map(brief))

    // The same session on the restarted daemon (still past a paused client's buffers): a rewrite
    // lands while another client is half-way through its chunked baseline.
    const slow = await d2.connect("slow")
    const attachId = slow.sendCommand({ type: "attach", activeSessionId: id, capabilities: ["chunked_snapshot", "event_sequence"] })
    await slow.waitFor((m) => m["type"] === "session_snapshot_begin", 30_000, "session_snapshot_begin")
    slow.socket.pause()
    // The rewrite and a turn after it land while the slow client's baseline is under way.
    await ctl2.ok({ type: "prompt", activeSessionId: id, message: "/compact" })
    await collectTurn(ctl2, id, 30_000)
    await ctl2.ok({ type: "prompt", activeSessionId: id, message: "after the rewrite" })
    const lastTurn = await collectTurn(ctl2, id, 30_000)
    const last = cursorOf(lastTurn.at(-1)!)
    expect(slow.received((m) => m["type"] === "session_snapshot_end"), "the baseline was not half-way").toEqual([])
    slow.socket.resume()
    const response = await slow.response(attachId, 30_000)
    expect(response["success"], JSON.stringify(response["error"])).toBe(true)
    await slow.waitFor((m) => m["type"] === "session_event" && cursorOf(m).generation === last.generation && cursorOf(m).sequence >= last.sequence - 1, 60_000, "the last turn")
    await slow.waitFor((m) => m["type"] === "session_status" && cursorOf(m).generation === last.generation && cursorOf(m).sequence === last.sequence, 30_000, "the last status")

    const rewritten = await allMessages(ctl2, id)
    expect(rewritten.map((m) => m["content"])).toEqual(["compacted " + String(2 * TURNS + 3) + " messages", "after the rewrite", "echo: after the rewrite"])
    expect(fold(slow.all, id).map(brief)).toEqual(rewritten.map(brief))
    // The slow client's baseline completed (its end frame came) or was superseded by the
    // replacement snapshot; either way the replacement came, then the events after it, once.
    const begins = slow.received((m) => m["type"] === "session_snapshot_begin")
    expect(begins.at(-1)!["purpose"]).toBe("replacement")
    // The older baseline, a separate cache entry, was delivered whole first.
    expect(begins[0]!["purpose"]).toBe("attach")
    const ends = slow.received((m) => m["type"] === "session_snapshot_end")
    expect(ends.map((m) => m["snapshotId"])).toEqual(begins.map((m) => m["snapshotId"]))
    expect(slow.received((m) => m["type"] === "session_snapshot_failed")).toEqual([])
    const afterReplacement = slow.all.slice(slow.all.indexOf(begins.at(-1)!)).filter((m) => m["type"] === "session_event" || m["type"] === "session_status")
    expect(cursorGap(afterReplacement, begins.at(-1)!["cursor"])).toBeUndefined()
    // ctl (attached all along, not chunked) folds to the same transcript.
    expect(fold(ctl2.all, id).slice(-3).map(brief)).toEqual(rewritten.map(brief))
  }, 150_000)
})
