/**
 * History rewrites against the real daemon (docs/protocol.md sections 4, 5 and 7): echo's `/compact`
 * replaces the transcript in the middle of its turn. Clients attached at that moment get the new
 * snapshot as `replacement` frames, then the new generation's events; a client resuming from
 * before the rewrite gets the baseline with `partial`/`transcript_replaced`; the rewritten
 * history survives a worker SIGKILL and a daemon SIGKILL.
 *
 * Needs `npm run build` first.
 */
import { describe, expect, it } from "vitest"
import { attachAndReplay } from "./attach.js"
import {
  allMessages,
  compareCursor,
  cleanUpAfterTests,
  type Client,
  collectTurn,
  createSession,
  cursorGap,
  cursorOf,
  describeMsg,
  isEvent,
  isSequenced,
  type Msg,
  useDaemon
} from "./harness.js"

cleanUpAfterTests()

const CHUNKED = ["attach_snapshot", "event_sequence", "chunked_snapshot"]

/** What a client saw of the session, from `from` on: the replacement frames and the events around them. */
const around = (client: Client, id: string, from: number) => {
  const seen = client.all.slice(from).filter((m) => m["activeSessionId"] === id)
  const begin = seen.findIndex((m) => m["type"] === "session_snapshot_begin")
  const end = seen.findIndex((m) => m["type"] === "session_snapshot_end")
  return {
    seen,
    begin: seen[begin],
    end: seen[end],
    chunks: seen.slice(begin, end).filter((m) => m["type"] === "session_snapshot_chunk"),
    before: seen.slice(0, begin).filter(isSequenced),
    after: seen.slice(end + 1).filter(isSequenced)
  }
}

describe("history rewrites (/compact)", () => {
  it("two attached clients get replacement frames then contiguous events; a resuming client gets partial/transcript_replaced; it survives crashes", async () => {
    const d = await useDaemon()
    const driver = await d.connect("driver")
    const { id } = await createSession(driver)
    await attachAndReplay(driver, { activeSessionId: id })
    const chunked = await d.connect("chunked")
    await attachAndReplay(chunked, { activeSessionId: id, capabilities: CHUNKED })
    for (const text of ["one two", "/bulk 300000", "three"]) {
      await driver.ok({ type: "prompt", activeSessionId: id, message: text })
      await collectTurn(driver, id)
    }
    const beforeRewrite = cursorOf(driver.sequenced(id).at(-1)!)
    // The chunked client may lag behind the driver: it is marked once it has what the driver has.
    await chunked.waitFor((m) => m["activeSessionId"] === id && isSequenced(m) && compareCursor(cursorOf(m), beforeRewrite) === 0, 10_000, "the chunked client at the driver's last event")
    const marks = [driver.all.length, chunked.all.length]

    await driver.ok({ type: "prompt", activeSessionId: id, message: "/compact" })
    await collectTurn(driver, id)
    // (Its queue still holds the earlier turns' events: the rewrite's turn ends in the new generation.)
    await chunked.waitFor((m) => m["activeSessionId"] === id && isEvent("agent_end")(m) && cursorOf(m).generation > beforeRewrite.generation, 10_000, "the chunked client's agent_end")

    for (const [client, mark] of [[driver, marks[0]!], [chunked, marks[1]!]] as const) {
      const { begin, end, chunks, before, after } = around(client, id, mark)
      const what = `${client.label}: ${client.all.slice(mark).map(describeMsg).join(", ")}`
      // Whatever the client's capabilities: the new snapshot as frames, purpose replacement.
      expect(begin?.["purpose"], what).toBe("replacement")
      expect(begin!["messageCount"]).toBe(1)
      expect(end?.["snapshotId"]).toBe(begin!["snapshotId"])
      expect(end!["chunkCount"]).toBe(chunks.length)
      expect(chunks.flatMap((c) => c["messages"]).map((m: Msg) => m["content"])).toEqual(["compacted 7 messages"])
      // Before the frames: the old generation (the turn's start and its user message); after:
      // the new one from sequence 0, contiguous, the turn's end included.
      const g = beforeRewrite.generation
      expect(before.every((m) => cursorOf(m).generation === g), what).toBe(true)
      expect(before.filter((m) => isEvent("message_end")(m)).map((m) => m["event"]["message"]["content"])).toEqual(["/compact"])
      expect(cursorOf(after[0]!)).toEqual({ generation: g + 1, sequence: 0 })
      expect(cursorGap(after)).toBeUndefined()
      expect(after.filter((m) => m["type"] === "session_event").map((m) => m["event"]["type"])).toEqual(["turn_end", "agent_end"])
      expect(after.some((m) => m["meta"]["replayed"] === true), what).toBe(false)
      expect(begin!["cursor"]).toEqual(cursorOf(before.at(-1)!))
    }
    expect((await allMessages(driver, id)).map((m) => m["content"])).toEqual(["compacted 7 messages"])

    // A client that resumes from before the rewrite: the new state, never a replay across it.
    for (const capabilities of [undefined, CHUNKED]) {
      const late = await d.connect("late")
      const { data, replayed } = await attachAndReplay(late, {
        activeSessionId: id,
        resumeCursor: beforeRewrite,
        ...(capabilities === undefined ? {} : { capabilities })
      })
      expect(data["replay"]["status"]).toBe("partial")
      expect(data["replay"]["reason"]).toBe("transcript_replaced")
      if (capabilities === undefined) {
        expect(data["snapshot"]["messages"].map((m: Msg) => m["content"])).toEqual(["compacted 7 messages"])
      } else {
        const begin = late.received((m) => m["type"] === "session_snapshot_begin")
        expect(begin.map((m) => m["purpose"])).toEqual(["replacement"])
      }
      expect(replayed.map((m) => cursorOf(m).generation)).toEqual(replayed.map(() => beforeRewrite.generation + 1))
      late.close()
    }

    // The rewritten history goes on: live turns, a worker SIGKILL, a daemon SIGKILL.
    await driver.ok({ type: "prompt", activeSessionId: id, message: "after" })
    await collectTurn(driver, id)
    const state = await driver.ok({ type: "get_state", activeSessionId: id })
    process.kill(state["workerPid"] as number, "SIGKILL")
    await driver.waitFor((m) => m["activeSessionId"] === id && m["type"] === "session_status" && m["state"]["worker"] === "ready", 15_000, "ready after the crash")
    expect((await allMessages(driver, id)).map((m) => m["content"])).toEqual(["compacted 7 messages", "after", "echo: after"])
    for (const c of [driver, chunked]) expect(cursorGap(c.sequenced(id)), c.label).toBeUndefined()

    await d.sigkill()
    const d2 = await useDaemon({ stateDir: d.stateDir })
    const again = await d2.connect("again")
    const { data } = await attachAndReplay(again, { activeSessionId: id, resumeCursor: beforeRewrite })
    expect(data["replay"]["reason"]).toBe("transcript_replaced")
    expect((await allMessages(again, id)).map((m) => m["content"])).toEqual(["compacted 7 messages", "after", "echo: after"])
    await again.ok({ type: "prompt", activeSessionId: id, message: "/compact" })
    await collectTurn(again, id)
    expect((await allMessages(again, id)).map((m) => m["content"])).toEqual(["compacted 4 messages"])
  }, 60_000)
})
