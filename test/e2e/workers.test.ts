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
    expect(kinds.slice(-3)).toEqual(["status:recovering", "turn_interrupted", "status:ready"])
    expect(rest.at(-2)!["event"].reason).toBe("worker_crashed")

    const after = await client.ok({ type: "get_state", activeSessionId: id })
    expect(after["activeSessionId"]).toBe(id)
    expect(after["workerPid"]).not.toBe(pid)
    expect(after["restarts"]).toBe(1)
    // The user message's message_end was logged; echo's cut assistant message never ended (only
    // engines with endsCutMessages end it, as interrupted).
    const messages = await allMessages(client, id)
    expect(messages.map((m) => m["role"])).toEqual(["user"])
    expect(messages[0]!["content"]).toBe("/bulk 4000000")

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

  it("a prompt sent while the worker recovers (after a worker crash, after a daemon restart) waits and runs once the cut turn has ended", async () => {
    // No warm spare: a recovery spawns its worker, so the prompt surely lands while it recovers.
    const env = { AGENTD_WARM_SPARE: "0" }
    const first = await useDaemon({ env })
    const client = await first.connect()
    const { id } = await createSession(client)
    await waitIdle(client, id)
    await client.ok({ type: "attach", activeSessionId: id, capabilities: ["event_sequence", "slim_attach"] })
    await client.ok({ type: "prompt", activeSessionId: id, message: "/sleep 20000" })
    await collectUntil(client, id, isEvent("tool_execution_start"))
    const pid = (await client.ok({ type: "get_state", activeSessionId: id }))["workerPid"] as number
    process.kill(pid, "SIGKILL")
    await collectUntil(client, id, (m) => m["type"] === "session_status" && m["state"].worker === "recovering", 20_000)
    const accepted = await client.ok({ type: "prompt", activeSessionId: id, message: "after the crash" }, 20_000)
    expect(accepted).toEqual({ accepted: true })
    const turn = await collectUntil(client, id, isEvent("agent_end"), 20_000)
    const shape = (m: Record<string, any>) => (m["type"] === "session_event" ? m["event"].type : `status:${m["state"]?.worker}:${m["state"]?.busy}`)
    const seen = client.sequenced(id).map(shape)
    const cut = seen.lastIndexOf("turn_interrupted")
    // The cut turn ends (turn_interrupted, then ready and idle), then the waiting prompt's turn.
    expect(seen.slice(cut, cut + 4)).toEqual(["turn_interrupted", "status:ready:false", "status:ready:true", "agent_start"])
    expect(turn.filter(isEvent("message_end")).map((m) => m["event"].message.content)).toEqual(["after the crash", "echo: after the crash"])

    // The daemon killed during a turn: the new one restores the session; a prompt sent at once waits the same way.
    await client.ok({ type: "prompt", activeSessionId: id, message: "/sleep 20000" })
    await collectUntil(client, id, isEvent("tool_execution_start"))
    await first.sigkill()
    const second = await useDaemon({ stateDir: first.stateDir, env })
    const again = await second.connect("again")
    const promptId = again.sendCommand({ type: "prompt", activeSessionId: id, message: "after the restart" })
    const response = await again.response(promptId, 20_000)
    expect(response["success"], JSON.stringify(response)).toBe(true)
    await again.ok({ type: "attach", activeSessionId: id, resumeCursor: (await again.ok({ type: "get_state", activeSessionId: id }))["lastEventCursor"] })
    await waitIdle(again, id, 20_000)
    const messages = await allMessages(again, id)
    expect(messages.slice(-2).map((m) => m["content"])).toEqual(["after the restart", "echo: after the restart"])
  }, 90_000)

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

  it("kill right after create, the warm spare still booting: kill answers with the session's worker gone (only the next spare is left)", async () => {
    const daemon = await useDaemon({ extraArgs: ["--max-workers", "1"] })
    const client = await daemon.connect()
    const left: Array<Array<number>> = []
    for (let i = 0; i < 6; i++) {
      const { id } = await createSession(client)
      await client.ok({ type: "kill", activeSessionId: id })
      left.push(daemon.workerProcesses())
      // The next create spawns its worker (a create holds the next spare back for 2 s): still
      // booting when the kill comes.
      await sleep(100)
    }
    expect(left.every((pids) => pids.length <= 1), `worker processes right after each kill: ${JSON.stringify(left)}`).toBe(true)
  }, 60_000)

  it("a new session's first turn runs with no spare booting beside it: the next spare starts once the create's hold (2 s) is over", async () => {
    const daemon = await useDaemon()
    const client = await daemon.connect()
    // The daemon's first spare, up and idle.
    const deadline = Date.now() + 15_000
    while (daemon.workerProcesses().length < 1) {
      if (Date.now() > deadline) throw new Error("no spare after 15 s")
      await sleep(50)
    }
    // The window is measured from before the create (its hold starts when the daemon takes it).
    const createdAt = Date.now()
    const { id } = await createSession(client)
    await client.ok({ type: "attach", activeSessionId: id, capabilities: ["event_sequence", "slim_attach"] })
    await client.ok({ type: "prompt", activeSessionId: id, message: "/sleep 800" })
    const counts: Array<number> = []
    while (Date.now() - createdAt < 1_200) {
      counts.push(daemon.workerProcesses().length)
      await sleep(50)
    }
    expect(counts.every((n) => n === 1), `worker processes in the 1.2 s after the create: ${counts.join(",")}`).toBe(true)
    await collectTurn(client, id)
    while (daemon.workerProcesses().length < 2) {
      if (Date.now() - createdAt > 10_000) throw new Error(`no next spare 10 s after the create: ${daemon.workerProcesses().join(",")}`)
      await sleep(50)
    }
  }, 60_000)

  it("with --max-workers 2 and both workers in turns, a third session's prompt waits for a worker: never more than 2 live, every turn runs", async () => {
    const daemon = await useDaemon({ extraArgs: ["--max-workers", "2"] })
    const client = await daemon.connect()
    const probe = await daemon.connect("probe")
    const ids: Array<string> = []
    for (let i = 0; i < 3; i++) ids.push((await createSession(client, { name: `busy${i}` })).id)
    // Session workers the daemon reports, polled all along (a worker counts until it exits).
    let most = 0
    let polling = true
    const poll = (async () => {
      while (polling) {
        const status = await probe.ok({ type: "status" })
        most = Math.max(most, (status["workers"] as Array<unknown>).length)
        daemon.recordWorkers(status)
        await sleep(10)
      }
    })()
    try {
      // Each prompt is answered when its turn starts: the last one once a worker was freed.
      await Promise.all(ids.map((id) => client.ok({ type: "prompt", activeSessionId: id, message: "/sleep 1500" }, 30_000)))
      // Not busy (a session may be passivated already, to free its worker for another).
      for (const id of ids) {
        const deadline = Date.now() + 30_000
        while ((await client.ok({ type: "get_state", activeSessionId: id }))["busy"] !== false) {
          if (Date.now() > deadline) throw new Error(`session ${id} still busy after 30 s`)
          await sleep(50)
        }
      }
    } finally {
      polling = false
      await poll
    }
    expect(most).toBeLessThanOrEqual(2)
    for (const id of ids) {
      const messages = await allMessages(client, id)
      expect(messages[0]?.["content"]).toBe("/sleep 1500")
      expect(messages.at(-1)?.["role"]).toBe("assistant")
    }
    const states = await Promise.all(ids.map((id) => client.ok({ type: "get_state", activeSessionId: id })))
    expect(states.map((s) => s["worker"]).filter((w) => w === "passivated").length).toBeGreaterThanOrEqual(1)
  }, 60_000)
})
