/**
 * Workers through the real daemon: a worker SIGKILLed mid-stream is restored under the same
 * session with nothing logged lost; a crash loop ends in `failed` and `retry_worker` brings it
 * back; beyond --max-workers idle sessions are passivated and restored on demand.
 */
import { describe, expect, it } from "vitest"
import {
  allMessages,
  cleanUpAfterTests,
  collectTurn,
  collectUntil,
  createSession,
  cursorGap,
  isAlive,
  isEvent,
  sleep,
  useDaemon,
  waitIdle
} from "./harness.js"

cleanUpAfterTests()

describe("workers (e2e)", () => {
  it("a worker SIGKILLed in the middle of a /bulk stream is restored with every logged event", async () => {
    const daemon = await useDaemon()
    const client = await daemon.connect()
    const { id } = await createSession(client, { config: { tokenDelayMs: 20 } })
    await waitIdle(client, id)
    await client.ok({ type: "attach", activeSessionId: id, capabilities: ["event_sequence", "slim_attach"] })
    await client.ok({ type: "prompt", activeSessionId: id, message: "/bulk 4000000" })
    // Some deltas have gone out: the assistant message is half streamed.
    await collectUntil(client, id, (m) => isEvent("message_update")(m) && (m["event"].delta as string).length > 0)
    await collectUntil(client, id, isEvent("message_update"))
    const before = await client.ok({ type: "get_state", activeSessionId: id })
    const pid = before["workerPid"] as number
    process.kill(pid, "SIGKILL")
    const rest = await collectUntil(client, id, (m) => m["type"] === "session_status" && m["state"].worker === "ready", 20_000)
    const kinds = rest.map((m) => (m["type"] === "session_event" ? m["event"].type : `status:${m["state"]?.worker}`))
    // The cut assistant message ends (interrupted, with what was streamed) before turn_interrupted.
    expect(kinds.slice(-4)).toEqual(["status:recovering", "message_end", "turn_interrupted", "status:ready"])
    expect(rest.at(-2)!["event"].reason).toBe("worker_crashed")

    const after = await client.ok({ type: "get_state", activeSessionId: id })
    expect(after["activeSessionId"]).toBe(id)
    expect(after["workerPid"]).not.toBe(pid)
    expect(after["restarts"]).toBe(1)
    // The user message's message_end was logged; the cut assistant message was ended by the
    // restored worker with the text streamed before the crash, marked interrupted.
    const messages = await allMessages(client, id)
    expect(messages.map((m) => m["role"])).toEqual(["user", "assistant"])
    expect(messages[0]!["content"]).toBe("/bulk 4000000")
    expect(messages[1]!["interrupted"]).toBe(true)
    expect((messages[1]!["content"] as string).length).toBeGreaterThan(0)
    expect((messages[1]!["content"] as string).length).toBeLessThan(4000000)

    // Everything logged is still in the log: a full replay from the start has no gap.
    const reader = await daemon.connect("reader")
    await reader.ok({ type: "attach", activeSessionId: id, resumeCursor: { generation: 1, sequence: 0 } })
    const replayed = await collectUntil(reader, id, (m) => m["meta"].cursor.sequence === after["lastEventCursor"].sequence)
    expect(cursorGap(replayed, { generation: 1, sequence: 0 })).toBeUndefined()
    expect(replayed.filter(isEvent("turn_interrupted"))).toHaveLength(1)

    // The next prompt works on the replacement.
    await client.ok({ type: "prompt", activeSessionId: id, message: "still here" })
    const turn = await collectTurn(client, id)
    const end = turn.filter(isEvent("message_end")).map((m) => m["event"].message.content)
    expect(end).toEqual(["still here", "echo: still here"])
    expect(isAlive(pid)).toBe(false)
  }, 60_000)

  it("a crash loop ends in failed after maxRestarts; retry_worker brings the session back", async () => {
    const daemon = await useDaemon({ env: { AGENTD_MAX_RESTARTS: "3" } })
    const client = await daemon.connect()
    const { id } = await createSession(client)
    await waitIdle(client, id)
    await client.ok({ type: "attach", activeSessionId: id, capabilities: ["event_sequence", "slim_attach"] })
    const killed: Array<number> = []
    const deadline = Date.now() + 30_000
    for (;;) {
      const state = await client.ok({ type: "get_state", activeSessionId: id })
      if (state["worker"] === "failed") break
      const pid = state["workerPid"] as number | undefined
      if (state["worker"] === "ready" && pid !== undefined && !killed.includes(pid)) {
        process.kill(pid, "SIGKILL")
        killed.push(pid)
      }
      if (Date.now() > deadline) throw new Error(`not failed after killing ${killed.length} workers: ${JSON.stringify(state)}`)
      await sleep(20)
    }
    // maxRestarts restarts were allowed; the crash after them marked the session failed.
    expect(killed).toHaveLength(4)
    const failedStatus = await client.waitFor(
      (m) => m["type"] === "session_status" && m["state"]?.worker === "failed",
      5_000,
      "a failed session_status"
    )
    expect(failedStatus["state"].restarts).toBe(4)
    const refused = await client.request({ type: "prompt", activeSessionId: id, message: "hello" })
    expect(refused["error"]?.code).toBe("session_failed")

    const retried = await client.ok({ type: "retry_worker", activeSessionId: id }, 20_000)
    expect(retried["worker"]).toBe("ready")
    expect(retried["activeSessionId"]).toBe(id)
    await client.ok({ type: "prompt", activeSessionId: id, message: "back" })
    await waitIdle(client, id)
    const messages = await allMessages(client, id)
    expect(messages.map((m) => m["content"])).toEqual(["back", "echo: back"])
  }, 60_000)

  it("beyond --max-workers the least recently used idle session is passivated and restored on its next prompt", async () => {
    const daemon = await useDaemon({ extraArgs: ["--max-workers", "2"] })
    const client = await daemon.connect()
    const ids: Array<string> = []
    for (let i = 0; i < 3; i++) {
      const { id } = await createSession(client, { name: `s${i}` })
      await waitIdle(client, id, 20_000)
      await client.ok({ type: "prompt", activeSessionId: id, message: `hello ${i}` })
      await waitIdle(client, id, 20_000)
      ids.push(id)
    }
    await sleep(300)
    const first = await client.ok({ type: "get_state", activeSessionId: ids[0] })
    expect(first["worker"]).toBe("passivated")
    expect(first["workerPid"]).toBeUndefined()
    const status = await client.ok({ type: "status" })
    expect((status["workers"] as Array<unknown>).length).toBeLessThanOrEqual(2)

    // The passivated session comes back with its transcript on the next prompt.
    await client.ok({ type: "prompt", activeSessionId: ids[0], message: "again" }, 20_000)
    await waitIdle(client, ids[0]!, 20_000)
    const messages = await allMessages(client, ids[0]!)
    expect(messages.map((m) => m["content"])).toEqual(["hello 0", "echo: hello 0", "again", "echo: again"])
    await sleep(300)
    const later = await client.ok({ type: "status" })
    expect((later["workers"] as Array<unknown>).length).toBeLessThanOrEqual(2)
  }, 60_000)
})
