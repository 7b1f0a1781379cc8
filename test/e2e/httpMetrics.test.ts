/**
 * The daemon-wide metrics of `GET /metrics` (docs/protocol.md section 10) after a known
 * workload: a socket client attached to a session through two turns, a checkpoint and a worker
 * SIGKILL, a second socket client that stops reading through a large turn (paused, then caught
 * up from the log), an SSE reader of the same session from its start, a WebSocket open beside.
 * The counters must be exact: every event appended once, delivered once to each reader, one turn
 * duration per turn, one checkpoint, one crash and its restart. And a socket client and an SSE
 * reader that stop reading while the events they lack are pruned: exactly two resyncs.
 */
import { assert, describe, it } from "vitest"
import WebSocket from "ws"
import { cleanUpAfterTests, collectTurn, createSession, isAlive, sleep, waitIdle } from "./harness.js"
import { type HttpDaemon, request, SseFollower, useHttpDaemon } from "./httpHarness.js"

cleanUpAfterTests()

/** `name{labels} value` lines of a Prometheus text, by `name{labels}`. */
const parse = (text: string): Map<string, number> => {
  const out = new Map<string, number>()
  for (const line of text.split("\n")) {
    if (line.startsWith("#") || line.trim() === "") continue
    const at = line.lastIndexOf(" ")
    out.set(line.slice(0, at), Number(line.slice(at + 1)))
  }
  return out
}

const scrapeOf = (h: HttpDaemon) => async () => parse((await request(h, "GET", "/metrics")).text)

describe("GET /metrics: daemon-wide metrics (e2e)", () => {
  it("a known workload gives exact counts: appended, delivered by transport, clients, turns, checkpoints, crashes, restarts", async () => {
    // A small outbox: a client that does not read is paused early.
    const h = await useHttpDaemon({ env: { AGENTD_OUTBOX_BYTES: String(64 * 1024) } })
    const scrape = async () => parse((await request(h, "GET", "/metrics")).text)
    const before = await scrape()
    for (const name of ["agentd_events_appended_total", "agentd_slow_client_pauses_total", "agentd_worker_crashes_total"]) {
      assert.isTrue(before.has(name), `${name} is listed before its first use`)
    }
    assert.strictEqual(before.get("agentd_events_appended_total"), 0)

    const c = await h.daemon.connect("metrics")
    const { id } = await createSession(c)
    await c.ok({ type: "attach", activeSessionId: id, capabilities: ["event_sequence", "slim_attach"] })
    await c.waitFor((m) => m["type"] === "session_attached")
    c.sendCommand({ type: "prompt", activeSessionId: id, message: "one two three" })
    await collectTurn(c, id)
    await waitIdle(c, id)

    const sse = new SseFollower(() => h, `/v1/sessions/${id}/events?offset=-1&live=sse`)
    try {
      await sse.waitFor((f) => f.messages.length === c.sequenced(id).length, 15_000, "the SSE reader caught up")
      await c.ok({ type: "checkpoint", activeSessionId: id })
      const state = await c.ok({ type: "get_state", activeSessionId: id })
      h.daemon.recordWorkers(state)
      const pid = state["workerPid"] as number
      process.kill(pid, "SIGKILL")
      for (let i = 0; i < 200 && isAlive(pid); i++) await sleep(25)
      await c.waitFor((m) => m["type"] === "session_status" && m["state"]?.worker === "ready" && m["state"]?.workerPid !== pid, 20_000)
      // A client that stops reading through a turn of 4 MB.
      const slow = await h.daemon.connect("slow")
      await slow.ok({ type: "attach", activeSessionId: id, capabilities: ["event_sequence", "slim_attach"] })
      await slow.waitFor((m) => m["type"] === "session_attached")
      slow.socket.pause()
      c.sendCommand({ type: "prompt", activeSessionId: id, message: "/bulk 4000000" })
      await collectTurn(c, id)
      await waitIdle(c, id)
      slow.socket.resume()
      // It attached after the checkpoint: it has the current generation's events, each once.
      const cursors = (cl: typeof c) => cl.sequenced(id).map((m) => JSON.stringify(m["meta"].cursor))
      // Up to 30 s: the paused client reads 4 MB back through a 64 KB outbox (2.3-2.9 s at load 8-10).
      for (let i = 0; i < 1200 && cursors(slow).at(-1) !== cursors(c).at(-1); i++) await sleep(25)
      assert.deepStrictEqual(cursors(slow), cursors(c).slice(-cursors(slow).length))

      const ws = new WebSocket(`ws://127.0.0.1:${h.port}/v1/socket`, { headers: { authorization: `Bearer ${h.token}` } })
      await new Promise<void>((resolve, reject) => {
        ws.once("message", () => resolve())
        ws.once("error", reject)
      })
      try {
        const events = c.sequenced(id)
        await sse.waitFor((f) => f.messages.length === events.length, 15_000, "the SSE reader has every event")
        const after = await scrape()
        // Every sequenced message of the only session, once: the socket client saw them all.
        assert.strictEqual(after.get("agentd_events_appended_total"), events.length)
        // Each socket client (the slow one too, paused and caught up) got each event once.
        assert.strictEqual(after.get('agentd_events_delivered_total{transport="socket"}'), events.length + slow.sequenced(id).length)
        assert.strictEqual(after.get('agentd_events_delivered_total{transport="http"}'), sse.messages.length)
        assert.isAbove(after.get('agentd_delivered_bytes_total{transport="socket"}')!, events.length * 50)
        assert.strictEqual(after.get('agentd_clients{transport="sse"}'), 1)
        assert.strictEqual(after.get('agentd_clients{transport="ws"}'), 1)
        // The two socket clients and the WebSocket's bridge.
        assert.strictEqual(after.get('agentd_clients{transport="socket"}'), 3)
        assert.strictEqual(after.get("agentd_turn_duration_seconds_count"), 2)
        assert.strictEqual(after.get('agentd_turn_duration_seconds_bucket{le="+Inf"}'), 2)
        assert.strictEqual(after.get("agentd_checkpoint_duration_seconds_count"), 1)
        assert.strictEqual(after.get("agentd_worker_crashes_total"), 1)
        assert.strictEqual(after.get("agentd_worker_restarts_total"), 1)
        assert.isAtLeast(after.get("agentd_worker_starts_total")!, 2)
        assert.isAtLeast(after.get("agentd_workers_live")!, 1)
        // The slow client at least (a reader of a 4 MB batch may be paused too: it reads it after).
        assert.isAtLeast(after.get("agentd_slow_client_pauses_total")!, 1)
        assert.strictEqual(after.get("agentd_slow_client_resyncs_total"), 0)
        // The token never reaches the metrics.
        assert.notInclude((await request(h, "GET", "/metrics")).text, h.token)
      } finally {
        ws.terminate()
      }
    } finally {
      sse.stop()
    }
    // Both readers gone: the gauges come back down.
    for (let i = 0; i < 100; i++) {
      const m = await scrape()
      if (m.get('agentd_clients{transport="sse"}') === 0 && m.get('agentd_clients{transport="ws"}') === 0) return
      await sleep(50)
    }
    assert.fail("the client gauges did not come back to 0")
  }, 60_000)

  it("the resync counter counts exactly the resyncs of a paused socket client and a paused SSE reader", async () => {
    // A small outbox (a client that does not read is paused early), one generation retained
    // (the checkpoint prunes the events a paused client lacks).
    const h = await useHttpDaemon({ env: { AGENTD_OUTBOX_BYTES: String(64 * 1024), AGENTD_RETAIN_GENERATIONS: "1" } })
    const scrape = scrapeOf(h)
    // The driver is not attached during the bulk turns: with a 64 KB outbox a reader that lags
    // by a few hundred KB (a busy test process) is paused and, once the turn's checkpoint prunes
    // what it lacks, resynced too; the count would then say 3. It follows by get_state.
    const c = await h.daemon.connect("driver")
    const { id } = await createSession(c)
    await waitIdle(c, id)
    const slowSocket = await h.daemon.connect("slow")
    await slowSocket.ok({ type: "attach", activeSessionId: id, capabilities: ["event_sequence", "slim_attach"] })
    await slowSocket.waitFor((m) => m["type"] === "session_attached")
    slowSocket.socket.pause()
    const slowSse = new SseFollower(() => h, `/v1/sessions/${id}/events?offset=now&live=sse`)
    try {
      await slowSse.waitFor((f) => f.events.length > 0, 10_000, "the SSE reader at the tail")
      slowSse.pause()
      // 8 MB: more than the kernel's socket buffers take in for the SSE reader (its response is
      // paused only once they are full), so it is still owed events at the checkpoint.
      for (let i = 0; i < 2; i++) {
        await c.ok({ type: "prompt", activeSessionId: id, message: "/bulk 4000000" })
        await waitIdle(c, id, 30_000)
      }
      assert.strictEqual((await scrape()).get("agentd_slow_client_resyncs_total"), 0)
      await c.ok({ type: "checkpoint", activeSessionId: id })
      slowSocket.socket.resume()
      slowSse.resume()
      // The socket client gets the current generation's snapshot as a resync; the SSE reader a
      // `lost: resync` control event (its stream ends there; its reconnection answers 410).
      await slowSocket.waitFor((m) => m["type"] === "session_snapshot_begin" && m["purpose"] === "resync", 20_000)
      await slowSse.waitFor((f) => f.events.some((e) => e.event === "control" && JSON.parse(e.data).lost === "resync"), 20_000, "the resync control event")
      await slowSse.waitFor((f) => f.statuses.includes(410), 10_000, "the 410 after the resync")
      assert.strictEqual((await scrape()).get("agentd_slow_client_resyncs_total"), 2)
      // A reader attached now follows a further turn, and nobody is resynced by it.
      await c.ok({ type: "attach", activeSessionId: id, capabilities: ["event_sequence", "slim_attach"] })
      await c.waitFor((m) => m["type"] === "session_attached")
      c.sendCommand({ type: "prompt", activeSessionId: id, message: "after" })
      await collectTurn(c, id)
      assert.strictEqual((await scrape()).get("agentd_slow_client_resyncs_total"), 2)
    } finally {
      slowSse.stop()
    }
  }, 60_000)
})
