/**
 * The HTTP front's long-lived streams against the real daemon (docs/protocol.md section 10): a
 * slow SSE reader is paused and caught up from the log (every event once), the WebSocket speaks
 * the socket protocol unchanged, and a graceful stop ends every open stream and exits 0.
 */
import { spawn } from "node:child_process"
import * as http from "node:http"
import { describe, expect, it } from "vitest"
import { cleanUpAfterTests, cursorGap, type Msg, sleep } from "./harness.js"
import { type HttpDaemon, request, SseFollower, useHttpDaemon } from "./httpHarness.js"

cleanUpAfterTests()

const cursorsOf = (msgs: ReadonlyArray<Msg>) => msgs.map((m) => `${m["meta"].cursor.generation}:${m["meta"].cursor.sequence}`)

const waitIdle = async (h: HttpDaemon, id: string, timeoutMs = 30_000) => {
  const deadline = Date.now() + timeoutMs
  for (;;) {
    const s = await request(h, "GET", `/v1/sessions/${id}`)
    if (s.json?.worker === "ready" && s.json.busy === false) {
      h.daemon.recordWorkers(s.json)
      return s.json
    }
    if (Date.now() > deadline) throw new Error(`session ${id} not idle: ${s.text}`)
    await sleep(50)
  }
}

const readAll = async (h: HttpDaemon, id: string) => {
  const out: Array<Msg> = []
  let offset = "-1"
  for (;;) {
    const res = await request(h, "GET", `/v1/sessions/${id}/events?offset=${offset}`, { timeoutMs: 60_000 })
    out.push(...res.json)
    offset = String(res.headers["stream-next-offset"])
    if (res.headers["stream-up-to-date"] === "true") return out
  }
}

// eslint-disable-next-line @typescript-eslint/no-explicit-any
const loadWs = async (): Promise<any> => (await import("ws" as string)).default

describe("HTTP streams (e2e)", () => {
  it("a slow SSE reader is paused, then caught up from the log: every event once, in order", async () => {
    const h = await useHttpDaemon({ env: { AGENTD_OUTBOX_BYTES: "65536" } })
    const id = (await request(h, "POST", "/v1/sessions")).json.activeSessionId as string
    await waitIdle(h, id)
    const messages: Array<Msg> = []
    let paused = true
    const res = await new Promise<http.IncomingMessage>((resolve, reject) => {
      const req = http.request({
        host: "127.0.0.1",
        port: h.port,
        path: `/v1/sessions/${id}/events?offset=-1&live=sse`,
        headers: { authorization: `Bearer ${h.token}` },
        agent: false
      })
      req.on("error", reject)
      req.on("response", resolve)
      req.end()
    })
    res.pause()
    // Big turns while the reader reads nothing: far more than the outbox limit.
    const words = Array.from({ length: 4000 }, (_, i) => `word-${i}-${"x".repeat(40)}`).join(" ")
    for (let i = 0; i < 3; i++) {
      await request(h, "POST", `/v1/sessions/${id}/prompt`, { body: JSON.stringify({ message: words }) })
      await waitIdle(h, id)
    }
    expect(paused).toBe(true)
    const truth = await readAll(h, id)
    expect(truth.length).toBeGreaterThan(3 * 4000)
    let buffer = ""
    res.setEncoding("utf8")
    res.on("data", (text: string) => {
      buffer += text
      for (;;) {
        const end = buffer.indexOf("\n\n")
        if (end < 0) break
        const block = buffer.slice(0, end)
        buffer = buffer.slice(end + 2)
        if (!block.startsWith("event: data")) continue
        const data = block.split("\n").filter((l) => l.startsWith("data: ")).map((l) => l.slice(6)).join("\n")
        messages.push(...(JSON.parse(data) as Array<Msg>))
      }
    })
    paused = false
    res.resume()
    const deadline = Date.now() + 60_000
    while (messages.length < truth.length && Date.now() < deadline) await sleep(100)
    res.destroy()
    expect(cursorGap(messages)).toBeUndefined()
    expect(cursorsOf(messages)).toEqual(cursorsOf(truth))
  })

  it("two readers of one session sending the same X-Request-Id each get every event (each read is its own connection)", async () => {
    const h = await useHttpDaemon()
    const id = (await request(h, "POST", "/v1/sessions")).json.activeSessionId as string
    await waitIdle(h, id)
    const a = new SseFollower(() => h, `/v1/sessions/${id}/events?offset=-1&live=sse`, 100, { "x-request-id": "same" })
    const b = new SseFollower(() => h, `/v1/sessions/${id}/events?offset=-1&live=sse`, 100, { "x-request-id": "same" })
    try {
      await a.waitFor((f) => f.events.length > 0, 10_000, "a open")
      await b.waitFor((f) => f.events.length > 0, 10_000, "b open")
      await request(h, "POST", `/v1/sessions/${id}/prompt`, { body: JSON.stringify({ message: "both" }) })
      await waitIdle(h, id)
      const truth = await readAll(h, id)
      for (const f of [a, b]) {
        await f.waitFor((x) => x.messages.length >= truth.length, 10_000, "all events")
        expect(cursorsOf(f.messages)).toEqual(cursorsOf(truth))
        expect(f.connections).toBe(1)
      }
    } finally {
      a.stop()
      b.stop()
    }
  })

  it("curl -N reads the SSE stream", async () => {
    const h = await useHttpDaemon()
    const id = (await request(h, "POST", "/v1/sessions")).json.activeSessionId as string
    await waitIdle(h, id)
    const curl = spawn("curl", ["-N", "-s", "-H", `Authorization: Bearer ${h.token}`, `${h.url}/v1/sessions/${id}/events?offset=now&live=sse`], {
      stdio: ["ignore", "pipe", "pipe"]
    })
    let out = ""
    curl.stdout.setEncoding("utf8")
    curl.stdout.on("data", (t: string) => (out += t))
    const spawned = await new Promise<boolean>((resolve) => {
      curl.once("error", () => resolve(false))
      curl.once("spawn", () => resolve(true))
    })
    if (!spawned) return void console.warn("curl is not installed: skipped")
    try {
      const deadline = Date.now() + 10_000
      while (!out.includes("upToDate") && Date.now() < deadline) await sleep(50)
      await request(h, "POST", `/v1/sessions/${id}/prompt`, { body: JSON.stringify({ message: "curl me" }) })
      while (!out.includes("echo: curl me") && Date.now() < deadline + 10_000) await sleep(50)
      expect(out).toMatch(/event: data\nid: \d{16}_\d{16}\ndata: \[/)
      expect(out).toContain("\"content\":\"echo: curl me\"")
    } finally {
      curl.kill("SIGKILL")
    }
  })

  it("GET /v1/socket speaks the socket protocol over a WebSocket: hello, commands, attach, events; refused without the token", async () => {
    const WebSocket = await loadWs()
    const h = await useHttpDaemon()
    const refused = await new Promise<number>((resolve) => {
      const ws = new WebSocket(`ws://127.0.0.1:${h.port}/v1/socket`)
      ws.on("unexpected-response", (_req: unknown, res: http.IncomingMessage) => resolve(res.statusCode ?? 0))
      ws.on("open", () => resolve(101))
      ws.on("error", () => {})
    })
    expect(refused).toBe(401)
    const foreign = await new Promise<number>((resolve) => {
      const ws = new WebSocket(`ws://127.0.0.1:${h.port}/v1/socket`, { headers: { authorization: `Bearer ${h.token}` }, origin: "http://evil.example" })
      ws.on("unexpected-response", (_req: unknown, res: http.IncomingMessage) => resolve(res.statusCode ?? 0))
      ws.on("open", () => resolve(101))
      ws.on("error", () => {})
    })
    expect(foreign).toBe(403)

    const ws = new WebSocket(`ws://127.0.0.1:${h.port}/v1/socket`, { headers: { authorization: `Bearer ${h.token}` } })
    const received: Array<Msg> = []
    const waiters: Array<() => void> = []
    ws.on("message", (data: Buffer) => {
      received.push(JSON.parse(data.toString("utf8")))
      for (const w of waiters.splice(0)) w()
    })
    const waitFor = async (pred: (m: Msg) => boolean, what: string) => {
      const deadline = Date.now() + 15_000
      for (;;) {
        const found = received.find(pred)
        if (found !== undefined) return found
        if (Date.now() > deadline) throw new Error(`WebSocket: no ${what}; got ${received.map((m) => m["type"]).join(",")}`)
        await Promise.race([new Promise<void>((r) => waiters.push(r)), sleep(100)])
      }
    }
    try {
      await new Promise<void>((resolve, reject) => {
        ws.on("open", () => resolve())
        ws.on("error", reject)
      })
      const hello = await waitFor((m) => m["type"] === "daemon_hello", "daemon_hello")
      expect(hello["protocol"]).toEqual({ name: "agentd", version: 1 })
      expect(hello["supervisorPid"]).toBe(h.daemon.pid)
      ws.send(JSON.stringify({ type: "create", id: "c1" }))
      const created = await waitFor((m) => m["type"] === "response" && m["id"] === "c1", "create response")
      expect(created["success"]).toBe(true)
      const id = created["data"].activeSessionId as string
      h.daemon.recordWorkers(created["data"])
      // A bad line gets its error, as on the socket, and the connection lives on.
      ws.send("{not json")
      const bad = await waitFor((m) => m["type"] === "response" && m["command"] === "parse", "parse error")
      expect(bad["error"].code).toBe("parse_error")
      ws.send(JSON.stringify({ type: "command", id: "a1", protocol: { name: "agentd", version: 1 }, command: { type: "attach", activeSessionId: id } }))
      expect((await waitFor((m) => m["type"] === "response" && m["id"] === "a1", "attach response"))["success"]).toBe(true)
      await waitFor((m) => m["type"] === "session_attached", "session_attached")
      ws.send(JSON.stringify({ type: "prompt", id: "p1", activeSessionId: id, message: "over the web" }))
      await waitFor((m) => m["type"] === "session_event" && m["event"].type === "agent_end", "agent_end")
      const events = received.filter((m) => m["type"] === "session_event" || m["type"] === "session_status")
      expect(cursorGap(events)).toBeUndefined()
      expect(received.some((m) => m["type"] === "session_event" && m["event"].type === "message_end" && m["event"].message.content === "echo: over the web")).toBe(true)
    } finally {
      ws.close()
    }
  })

  // (This checks that nothing is lost or repeated; it does not tell the bridge's pause from the
  // daemon's own pauses under load, which happen either way with so small an outbox.)
  it("a WebSocket client that stops reading through large turns, then reads again: every event once, in order", async () => {
    const WebSocket = await loadWs()
    // Every generation kept: the truth is read from the start at the end.
    const h = await useHttpDaemon({ env: { AGENTD_OUTBOX_BYTES: "65536", AGENTD_RETAIN_GENERATIONS: "1000" } })
    const id = (await request(h, "POST", "/v1/sessions")).json.activeSessionId as string
    await waitIdle(h, id)
    const ws = new WebSocket(`ws://127.0.0.1:${h.port}/v1/socket`, { headers: { authorization: `Bearer ${h.token}` } })
    const received: Array<Msg> = []
    ws.on("message", (data: Buffer) => received.push(JSON.parse(data.toString("utf8"))))
    ws.on("error", () => {})
    try {
      await new Promise<void>((resolve, reject) => {
        ws.on("open", () => resolve())
        ws.on("error", reject)
      })
      ws.send(JSON.stringify({ type: "attach", id: "a1", activeSessionId: id, capabilities: ["event_sequence", "slim_attach"] }))
      const deadline = Date.now() + 15_000
      while (!received.some((m) => m["type"] === "session_attached") && Date.now() < deadline) await sleep(20)
      // Stop reading: the frames pile up in the kernel, then in the server's WebSocket.
      ws._socket.pause()
      const words = Array.from({ length: 6000 }, (_, i) => `word-${i}-${"x".repeat(60)}`).join(" ")
      for (let i = 0; i < 6; i++) {
        await request(h, "POST", `/v1/sessions/${id}/prompt`, { body: JSON.stringify({ message: words }) })
        await waitIdle(h, id, 60_000)
      }
      const truth = await readAll(h, id)
      ws._socket.resume()
      const until = Date.now() + 60_000
      const events = () => received.filter((m) => m["type"] === "session_event" || m["type"] === "session_status")
      while (events().length < truth.length && Date.now() < until) await sleep(100)
      expect(cursorGap(events())).toBeUndefined()
      expect(cursorsOf(events())).toEqual(cursorsOf(truth))
    } finally {
      ws.terminate()
    }
  })

  it("a graceful stop ends open SSE streams, long-polls and WebSockets, and exits 0", async () => {
    const WebSocket = await loadWs()
    const h = await useHttpDaemon({ env: { AGENTD_HTTP_LONG_POLL_MS: "60000" } })
    const id = (await request(h, "POST", "/v1/sessions")).json.activeSessionId as string
    await waitIdle(h, id)
    const follower = new SseFollower(() => h, `/v1/sessions/${id}/events?offset=-1&live=sse`, 60_000)
    const longPoll = request(h, "GET", `/v1/sessions/${id}/events?offset=now&live=long-poll`, { timeoutMs: 60_000 }).then(
      (r) => r.status,
      () => "closed"
    )
    const ws = new WebSocket(`ws://127.0.0.1:${h.port}/v1/socket`, { headers: { authorization: `Bearer ${h.token}` } })
    const wsClosed = new Promise<void>((resolve) => ws.on("close", () => resolve()))
    ws.on("error", () => {})
    try {
      await follower.waitFor((f) => f.connections === 1 && f.events.length > 0, 10_000, "the SSE stream open")
      await sleep(300)
      const stopped = await h.daemon.stop("SIGTERM", 15_000)
      expect(stopped.code).toBe(0)
      expect(await longPoll).toBeDefined()
      await Promise.race([wsClosed, sleep(5_000)])
      expect(ws.readyState).toBe(WebSocket.CLOSED)
    } finally {
      follower.stop()
      ws.terminate()
    }
  })
})
