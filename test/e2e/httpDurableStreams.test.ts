/**
 * A client no one here wrote: `@durable-streams/client` (npm) follows a session's events through
 * the HTTP front (docs/protocol.md section 10) across a daemon restart and sees every event
 * exactly once: in long-poll mode across a SIGKILL; in SSE mode across a graceful stop (SIGTERM)
 * and a worker SIGKILL. (Its SSE reader reconnects only after a stream that ended cleanly: a
 * connection cut by a SIGKILLed daemon fails it with `terminated`, a limit of that client; the
 * browser EventSource test and httpEvents.test.ts cover SSE across a daemon SIGKILL.)
 */
import { stream } from "@durable-streams/client"
import { describe, expect, it } from "vitest"
import { cleanUpAfterTests, cursorGap, type Msg, sleep } from "./harness.js"
import { freePort, type HttpDaemon, request, useHttpDaemon } from "./httpHarness.js"

cleanUpAfterTests()

const cursorsOf = (msgs: ReadonlyArray<Msg>) => msgs.map((m) => `${m["meta"].cursor.generation}:${m["meta"].cursor.sequence}`)
const isEventOf = (type: string) => (m: Msg) => m["type"] === "session_event" && m["event"]?.type === type

const waitIdle = async (h: HttpDaemon, id: string, timeoutMs = 20_000) => {
  const deadline = Date.now() + timeoutMs
  for (;;) {
    const s = await request(h, "GET", `/v1/sessions/${id}`).catch(() => undefined)
    // A graceful stop passivates idle sessions: no worker until the next prompt.
    if ((s?.json?.worker === "ready" || s?.json?.worker === "passivated") && s.json.busy === false) {
      h.daemon.recordWorkers(s.json)
      return s.json
    }
    if (Date.now() > deadline) throw new Error(`session ${id} not idle: ${s?.text}`)
    await sleep(50)
  }
}

const waitUntil = async (pred: () => boolean, what: string, timeoutMs = 20_000) => {
  const deadline = Date.now() + timeoutMs
  while (!pred()) {
    if (Date.now() > deadline) throw new Error(`not reached within ${timeoutMs} ms: ${what}`)
    await sleep(50)
  }
}

const readAll = async (h: HttpDaemon, id: string) => {
  const out: Array<Msg> = []
  let offset = "-1"
  for (;;) {
    const res = await request(h, "GET", `/v1/sessions/${id}/events?offset=${offset}`)
    out.push(...res.json)
    offset = String(res.headers["stream-next-offset"])
    if (res.headers["stream-up-to-date"] === "true") return out
  }
}

describe("@durable-streams/client against the HTTP front (e2e)", () => {
  for (const [live, signal] of [["sse", "SIGTERM"], ["long-poll", "SIGKILL"]] as const) {
    it(`live=${live}: follows a session across a daemon ${signal} and restart${live === "sse" ? " and a worker SIGKILL" : ""}, every event once`, async () => {
      const port = await freePort()
      let h = await useHttpDaemon({ port })
      const stateDir = h.daemon.stateDir
      const token = h.token
      const id = (await request(h, "POST", "/v1/sessions", { body: JSON.stringify({ config: { tokenDelayMs: 30 } }) })).json.activeSessionId as string
      await waitIdle(h, id)
      const received: Array<Msg> = []
      const errors: Array<string> = []
      const controller = new AbortController()
      const res = await stream<Msg>({
        url: `http://127.0.0.1:${port}/v1/sessions/${id}/events`,
        headers: { authorization: `Bearer ${token}` },
        offset: "-1",
        live,
        json: true,
        signal: controller.signal,
        warnOnHttp: false,
        backoffOptions: { initialDelay: 50, maxDelay: 500, multiplier: 1.5 },
        onError: (e) => {
          errors.push(String(e))
          // Keep following: a daemon restart is a passing outage.
          return {}
        }
      })
      res.subscribeJson((batch) => {
        received.push(...batch.items)
      })
      try {
        const words = Array.from({ length: 40 }, (_, i) => `w${i}`).join(" ")
        await request(h, "POST", `/v1/sessions/${id}/prompt`, { body: JSON.stringify({ message: words }) })
        await waitUntil(() => received.filter(isEventOf("message_update")).length >= 5, "deltas before the kill")
        if (signal === "SIGKILL") await h.daemon.sigkill()
        else expect((await h.daemon.stop("SIGTERM")).code).toBe(0)
        h = await useHttpDaemon({ port, stateDir })
        const reason = signal === "SIGKILL" ? "daemon_restarted" : "daemon_shutdown"
        await waitUntil(() => received.some((m) => isEventOf("turn_interrupted")(m) && m["event"].reason === reason), `turn_interrupted(${reason})`, 30_000)
        await waitIdle(h, id)
        if (live === "sse") {
          await request(h, "POST", `/v1/sessions/${id}/prompt`, { body: JSON.stringify({ message: words }) })
          const before = received.filter(isEventOf("message_update")).length
          await waitUntil(() => received.filter(isEventOf("message_update")).length >= before + 5, "deltas before the worker kill")
          const state = (await request(h, "GET", `/v1/sessions/${id}`)).json
          h.daemon.recordWorkers(state)
          process.kill(state.workerPid as number, "SIGKILL")
          await waitUntil(() => received.some((m) => isEventOf("turn_interrupted")(m) && m["event"].reason === "worker_crashed"), "turn_interrupted(worker_crashed)")
          await waitIdle(h, id)
        }
        await request(h, "POST", `/v1/sessions/${id}/prompt`, { body: JSON.stringify({ message: "after restart" }) })
        await waitUntil(() => received.filter(isEventOf("agent_end")).length >= 1, "agent_end after the restart")
        await waitIdle(h, id)
        const truth = await readAll(h, id)
        await waitUntil(() => received.length >= truth.length, "the client catching up with the log")
        await sleep(300)
        expect(cursorGap(received)).toBeUndefined()
        expect(cursorsOf(received)).toEqual(cursorsOf(truth))
      } finally {
        controller.abort()
        res.cancel()
      }
    })
  }
})
