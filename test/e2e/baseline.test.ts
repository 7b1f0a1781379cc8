/**
 * Large baselines against the real daemon (docs/protocol.md section 5), on a 40 MB (or 100 MB) session built by
 * turns with the default (automatic) checkpoints: a client without `chunked_snapshot` gets the
 * baseline as frames (its response line would pass the line limit), and a client cut off in the
 * middle of a chunked snapshot continues it with `snapshotResume` from the chunk where it
 * stopped: the daemon sends only the chunks from there. With a small line limit, a baseline is
 * inlined exactly while its response line fits.
 *
 * Needs `npm run build` first.
 */
import { describe, expect, it } from "vitest"
import { attachAndReplay } from "./attach.js"
import {
  cleanUpAfterTests,
  collectTurn,
  createSession,
  cursorGap,
  cursorOf,
  isSequenced,
  type Msg,
  useDaemon
} from "./harness.js"

cleanUpAfterTests()

// What the tests need is a baseline well past the line limit and several checkpoints deep. By
// default the daemon's limits are cut to a quarter (a 4 MiB line, a checkpoint every 2 MiB) and the
// session is 4 turns of 2.5 MB: the same shape as the protocol's 40 MB example at a quarter of the
// time. AGENTD_BASELINE_TURNS=N runs the full size on the default limits (N turns of 10 MB; 10
// makes the 100 MB session of the protocol's examples).
const FULL = process.env["AGENTD_BASELINE_TURNS"] !== undefined
const TURNS = FULL ? Number(process.env["AGENTD_BASELINE_TURNS"]) : 4
const BULK = FULL ? 10_485_760 : 2_621_440
const LINE_LIMIT = FULL ? 16 * 1024 * 1024 : 4 * 1024 * 1024
const LIMITS = FULL ? {} : { AGENTD_MAX_LINE_BYTES: String(LINE_LIMIT), AGENTD_CHECKPOINT_BYTES: String(2 * 1024 * 1024) }

/** A message as the test compares it (its large content by length and first bytes). */
const brief = (m: Msg) => `${m["id"]}:${m["role"]}:${String(m["content"]).length}:${String(m["content"]).slice(0, 20)}`

describe("large baselines", () => {
  it(`a ${(TURNS * BULK / 1e6).toFixed(0)} MB baseline goes to a client without chunked_snapshot as frames; a chunked snapshot cut off at its middle chunk resumes from there`, async () => {
    const d = await useDaemon({ env: LIMITS })
    const ctl = await d.connect("ctl")
    const { id } = await createSession(ctl)
    await attachAndReplay(ctl, { activeSessionId: id, capabilities: ["event_sequence", "slim_attach"] })
    for (let i = 0; i < TURNS; i++) {
      await ctl.ok({ type: "prompt", activeSessionId: id, message: `/bulk ${BULK}` }, 30_000)
      await collectTurn(ctl, id, 60_000)
      ctl.drain()
    }
    const state = await ctl.ok({ type: "get_state", activeSessionId: id })
    expect(state["lastEventCursor"]["generation"], "automatic checkpoints happened").toBeGreaterThan(1)
    // The transcript as get_messages says it (checked by id, role, length and first bytes).
    const transcript: Array<string> = []
    for (let offset = 0; offset < state["messageCount"]; offset += 2) {
      const page = await ctl.ok({ type: "get_messages", activeSessionId: id, offset, limit: 2 }, 30_000)
      transcript.push(...(page["messages"] as Array<Msg>).map(brief))
    }
    expect(transcript.length).toBe(TURNS * 2)

    // No chunked_snapshot: the response would be far past the line limit, so frames follow it.
    const plain = await d.connect("plain")
    const { data, replayed } = await attachAndReplay(plain, { activeSessionId: id })
    expect(data["snapshotStream"]).toBeDefined()
    expect(data["snapshot"]["messages"]).toEqual([])
    expect(data["messages"]).toEqual([])
    const frames = plain.received((m) => String(m["type"]).startsWith("session_snapshot_"))
    expect(frames[0]!["purpose"]).toBe("attach")
    expect(frames.at(-1)!["type"]).toBe("session_snapshot_end")
    const fromFrames = frames.filter((m) => m["type"] === "session_snapshot_chunk").flatMap((m) => m["messages"] as Array<Msg>)
    const fromEvents = replayed.filter((m) => m["event"]?.type === "message_end").map((m) => m["event"]["message"] as Msg)
    expect([...fromFrames, ...fromEvents].map(brief)).toEqual(transcript)
    expect(Math.max(...plain.received().map((m) => plain.lineBytes.get(m) ?? 0))).toBeLessThanOrEqual(LINE_LIMIT)
    plain.close()

    // A chunked attach cut off in the middle of its snapshot.
    const first = await d.connect("first")
    const attachId = first.sendCommand({ type: "attach", activeSessionId: id, capabilities: ["chunked_snapshot", "event_sequence"] })
    const begin = await first.waitFor((m) => m["type"] === "session_snapshot_begin", 30_000, "session_snapshot_begin")
    const snapshotId = begin["snapshotId"] as string
    // Every message travels alone here (a 2.5 MB one is past the 512 KiB target, and a prompt
    // does not fit beside it): one chunk per message.
    const messageCount = (await first.response(attachId, 30_000))["data"]["snapshotStream"]["messageCount"] as number
    expect(messageCount).toBeGreaterThan(2)
    const middle = Math.floor(messageCount / 2)
    await first.waitFor((m) => m["type"] === "session_snapshot_chunk" && m["index"] === middle - 1, 60_000, `chunk ${middle - 1}`)
    first.socket.destroy()
    const before = first.received((m) => m["type"] === "session_snapshot_chunk" && m["index"] < middle)
    expect(before.map((m) => m["index"])).toEqual(Array.from({ length: middle }, (_, i) => i))

    const second = await d.connect("second")
    const resumed = await attachAndReplay(second, {
      activeSessionId: id,
      capabilities: ["chunked_snapshot", "event_sequence"],
      snapshotResume: { snapshotId, fromChunk: middle }
    })
    expect(resumed.data["snapshotStream"]["id"]).toBe(snapshotId)
    const chunks = second.received((m) => m["type"] === "session_snapshot_chunk")
    const end = second.received((m) => m["type"] === "session_snapshot_end")[0]!
    // Only the chunks from the middle on, in order, same snapshot, same boundaries.
    expect(end["chunkCount"]).toBe(messageCount)
    expect(chunks.map((m) => m["index"])).toEqual(Array.from({ length: end["chunkCount"] - middle }, (_, i) => middle + i))
    expect(chunks.every((m) => m["snapshotId"] === snapshotId)).toBe(true)
    const whole = [...before, ...chunks].flatMap((m) => m["messages"] as Array<Msg>)
    const events = resumed.replayed.filter((m) => m["event"]?.type === "message_end").map((m) => m["event"]["message"] as Msg)
    expect([...whole, ...events].map(brief)).toEqual(transcript)
    // Then the events after the snapshot, as the first attach would have had them, then live ones.
    expect(cursorGap(second.sequenced(id), begin["cursor"])).toBeUndefined()
    await ctl.ok({ type: "prompt", activeSessionId: id, message: "live" })
    await collectTurn(second, id)
    expect(cursorGap(second.received(isSequenced), begin["cursor"])).toBeUndefined()
    expect(cursorOf(second.sequenced(id).at(-1)!)).toEqual(cursorOf(ctl.sequenced(id).at(-1)!))

    // A snapshotId the daemon does not hold: answered as a plain attach (from chunk 0).
    const third = await d.connect("third")
    const plainAgain = await attachAndReplay(third, {
      activeSessionId: id,
      capabilities: ["chunked_snapshot", "event_sequence"],
      snapshotResume: { snapshotId: "s-nope~g1", fromChunk: 3 }
    })
    expect(third.received((m) => m["type"] === "session_snapshot_chunk")[0]!["index"]).toBe(0)
    expect(plainAgain.data["snapshotStream"]).toBeDefined()
  }, 150_000)

  it("with a small maxLineBytes: a baseline inlined while its response line fits, as frames once it would not (slim_attach counts the messages once)", async () => {
    const LIMIT = 20_000
    const d = await useDaemon({ env: { AGENTD_MAX_LINE_BYTES: String(LIMIT) } })
    const ctl = await d.connect("ctl")
    const { id } = await createSession(ctl)
    await attachAndReplay(ctl, { activeSessionId: id, capabilities: ["event_sequence", "slim_attach"] })
    const turn = async (message: string) => {
      await ctl.ok({ type: "prompt", activeSessionId: id, message })
      await collectTurn(ctl, id)
      await ctl.ok({ type: "checkpoint", activeSessionId: id })
    }
    const attach = async (capabilities?: ReadonlyArray<string>) => {
      const c = await d.connect(`attach-${String(capabilities)}`)
      const r = await attachAndReplay(c, { activeSessionId: id, ...(capabilities === undefined ? {} : { capabilities }) })
      const lines = c.received().map((m) => c.lineBytes.get(m) ?? 0)
      c.close()
      return { data: r.data, longest: Math.max(...lines) }
    }
    // About 2 KB of messages: far below the limit, inlined for every client without chunked_snapshot.
    await turn("/bulk 2000")
    for (const capabilities of [undefined, ["attach_snapshot", "event_sequence"], ["slim_attach"]]) {
      const { data, longest } = await attach(capabilities)
      expect(data["snapshotStream"], `capabilities ${String(capabilities)}`).toBeUndefined()
      expect(data["snapshot"]["messages"]).toHaveLength(2)
      expect(longest).toBeLessThanOrEqual(LIMIT)
    }
    // About 11 KB: twice that passes the limit, once does not.
    await turn("/bulk 9000")
    const full = await attach()
    expect(full.data["snapshotStream"]).toBeDefined()
    expect(full.data["snapshot"]["messages"]).toEqual([])
    expect(full.longest).toBeLessThanOrEqual(LIMIT)
    const slim = await attach(["slim_attach", "event_sequence"])
    expect(slim.data["snapshotStream"]).toBeUndefined()
    expect(slim.data["snapshot"]["messages"]).toHaveLength(4)
    expect(slim.longest).toBeLessThanOrEqual(LIMIT)
  }, 30_000)
})
