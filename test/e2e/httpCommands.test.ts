/**
 * The HTTP front's commands against the real daemon (docs/protocol.md section 10): every route,
 * the socket's data as the result, the socket's error codes mapped to statuses by one table,
 * and bad requests (malformed JSON, a body over the line limit, an unknown route or method, a
 * bad parameter) answered with a JSON error, never a hang, a crash or a stack trace.
 */
import { describe, expect, it } from "vitest"
import { cleanUpAfterTests, summaryProblems } from "./harness.js"
import { type HttpDaemon, request, useHttpDaemon } from "./httpHarness.js"

cleanUpAfterTests()

const MAX_LINE = 4096

/** Waits until the session is idle with its worker ready. */
const waitReady = async (h: HttpDaemon, id: string) => {
  const deadline = Date.now() + 15_000
  for (;;) {
    const s = await request(h, "GET", `/v1/sessions/${id}`)
    if (s.json?.worker === "ready" && s.json?.busy === false) return s.json
    if (Date.now() > deadline) throw new Error(`session ${id} not ready: ${s.text}`)
    await new Promise((r) => setTimeout(r, 50))
  }
}

const expectError = (res: { status: number; json: any; text: string }, status: number, code: string, what: string) => {
  expect(res.status, `${what}: ${res.text}`).toBe(status)
  expect(res.json?.error?.code, what).toBe(code)
  expect(typeof res.json?.error?.message, what).toBe("string")
  expect(res.json?.error?.requestId, what).toMatch(/.+/)
  expect(res.text, what).not.toMatch(/\n\s+at /)
}

describe("HTTP commands (e2e)", () => {
  it("every route answers with the socket's data", async () => {
    const h = await useHttpDaemon({ env: { AGENTD_MAX_LINE_BYTES: String(MAX_LINE) } })
    const status = await request(h, "GET", "/v1/status")
    expect(status.status).toBe(200)
    expect(status.json.pid).toBe(h.daemon.pid)
    expect(status.json.sessions).toBe(0)
    expect((await request(h, "GET", "/healthz")).json).toEqual({ ok: true })

    const created = await request(h, "POST", "/v1/sessions", { body: JSON.stringify({ name: "web" }) })
    expect(created.status).toBe(201)
    const id = created.json.activeSessionId as string
    expect(created.json.state.name).toBe("web")
    h.daemon.recordWorkers(created.json)
    // An empty body creates too.
    const bare = await request(h, "POST", "/v1/sessions")
    expect(bare.status).toBe(201)

    const list = await request(h, "GET", "/v1/sessions")
    expect(list.json.sessions.map((s: any) => s.activeSessionId).sort()).toEqual([id, bare.json.activeSessionId].sort())
    const state = await waitReady(h, id)
    expect(summaryProblems(state)).toEqual([])
    h.daemon.recordWorkers(state)

    const prompt = await request(h, "POST", `/v1/sessions/${id}/prompt`, { body: JSON.stringify({ message: "hello web" }) })
    expect(prompt.status).toBe(200)
    expect(prompt.json).toEqual({ accepted: true })
    await waitReady(h, id)
    const messages = await request(h, "GET", `/v1/sessions/${id}/messages?offset=1&limit=1`)
    expect(messages.status).toBe(200)
    expect(messages.json.total).toBe(2)
    expect(messages.json.messages.map((m: any) => m.content)).toEqual(["echo: hello web"])
    expect((await request(h, "GET", `/v1/sessions/${id}/messages`)).json.messages.length).toBe(2)

    const abortIdle = await request(h, "POST", `/v1/sessions/${id}/abort`)
    expect(abortIdle.json).toEqual({ aborted: false })
    await request(h, "POST", `/v1/sessions/${id}/prompt`, { body: JSON.stringify({ message: "/sleep 5000" }) })
    const busy = await request(h, "POST", `/v1/sessions/${id}/prompt`, { body: JSON.stringify({ message: "again" }) })
    expectError(busy, 409, "session_busy", "prompt while busy")
    const abort = await request(h, "POST", `/v1/sessions/${id}/abort`, { body: "{}" })
    expect(abort.json).toEqual({ aborted: true })
    await waitReady(h, id)

    const checkpoint = await request(h, "POST", `/v1/sessions/${id}/checkpoint`)
    expect(checkpoint.status).toBe(200)
    expect(checkpoint.json.generation).toBe(2)
    expect(typeof checkpoint.json.snapshotId).toBe("string")
    const retry = await request(h, "POST", `/v1/sessions/${id}/retry`)
    expect(retry.status).toBe(200)
    expect(retry.json.activeSessionId).toBe(id)

    // Names are the daemon's: a rename to a name in use is 409 name_taken, as is a create.
    const renamed = await request(h, "POST", `/v1/sessions/${id}/rename`, { body: JSON.stringify({ name: "web-2" }) })
    expect(renamed.status, renamed.text).toBe(200)
    expect(renamed.json.name).toBe("web-2")
    await request(h, "POST", `/v1/sessions/${bare.json.activeSessionId}/rename`, { body: JSON.stringify({ name: "taken" }) })
    expectError(await request(h, "POST", `/v1/sessions/${id}/rename`, { body: JSON.stringify({ name: "taken" }) }), 409, "name_taken", "rename to a name in use")
    expectError(await request(h, "POST", "/v1/sessions", { body: JSON.stringify({ name: "web-2" }) }), 409, "name_taken", "create with a name in use")
    expect((await request(h, "GET", `/v1/sessions/${id}`)).json.name).toBe("web-2")

    const metrics = await request(h, "GET", "/metrics")
    expect(metrics.status).toBe(200)
    expect(metrics.headers["content-type"]).toMatch(/text\/plain/)
    expect(metrics.text).toMatch(/^# TYPE agentd_http_requests_total counter$/m)
    expect(metrics.text).toMatch(/^agentd_http_requests_total\{status="200"\} \d+$/m)
    expect(metrics.text).toMatch(/^agentd_sessions\{worker="ready"\} [12]$/m)

    const killed = await request(h, "DELETE", `/v1/sessions/${id}`)
    expect(killed.status).toBe(200)
    expect(killed.json).toEqual({})
    expectError(await request(h, "GET", `/v1/sessions/${id}`), 404, "session_not_found", "state after kill")
    expectError(await request(h, "DELETE", `/v1/sessions/${id}`), 404, "session_not_found", "kill after kill")
  })

  it("errors: one table of codes to statuses; malformed, oversized and misrouted requests get a JSON error, and the daemon lives on", async () => {
    const h = await useHttpDaemon({ env: { AGENTD_MAX_LINE_BYTES: String(MAX_LINE) } })
    const nope = "s-00000000-0000-0000-0000-000000000000"
    for (const [method, target] of [
      ["GET", `/v1/sessions/${nope}`],
      ["DELETE", `/v1/sessions/${nope}`],
      ["POST", `/v1/sessions/${nope}/prompt`],
      ["POST", `/v1/sessions/${nope}/abort`],
      ["POST", `/v1/sessions/${nope}/checkpoint`],
      ["POST", `/v1/sessions/${nope}/retry`],
      ["GET", `/v1/sessions/${nope}/messages`],
      ["GET", `/v1/sessions/${nope}/events`],
      ["GET", `/v1/sessions/${nope}/events?live=sse`],
      ["GET", `/v1/sessions/${nope}/snapshot`]
    ] as const) {
      const body = target.endsWith("/prompt") ? JSON.stringify({ message: "x" }) : undefined
      expectError(await request(h, method, target, { body }), 404, "session_not_found", `${method} ${target}`)
    }
    const id = (await request(h, "POST", "/v1/sessions")).json.activeSessionId as string
    await waitReady(h, id)

    expectError(await request(h, "POST", "/v1/sessions", { body: "{\"name\":" }), 400, "parse_error", "malformed JSON")
    expectError(await request(h, "POST", "/v1/sessions", { body: "[1,2]" }), 400, "invalid_command", "an array body")
    expectError(await request(h, "POST", "/v1/sessions", { body: "\"x\"" }), 400, "invalid_command", "a string body")
    const badEngine = await request(h, "POST", "/v1/sessions", { body: JSON.stringify({ engine: "no-such-engine" }) })
    expectError(badEngine, 400, "invalid_command", "unknown engine")
    expect(badEngine.json.error.message).toMatch(/engine/)
    const noMessage = await request(h, "POST", `/v1/sessions/${id}/prompt`, { body: "{}" })
    expectError(noMessage, 400, "invalid_command", "prompt without message")
    expect(noMessage.json.error.message).toMatch(/message/)
    const badType = await request(h, "POST", `/v1/sessions/${id}/prompt`, { body: JSON.stringify({ message: 42 }) })
    expectError(badType, 400, "invalid_command", "prompt with a number")
    const tooMany = await request(h, "GET", `/v1/sessions/${id}/messages?limit=5000`)
    expectError(tooMany, 400, "invalid_command", "limit 5000")
    expect(tooMany.json.error.message).toMatch(/limit/)
    expectError(await request(h, "GET", `/v1/sessions/${id}/messages?offset=abc`), 400, "invalid_command", "offset abc")
    expectError(await request(h, "GET", `/v1/sessions/${id}/messages?offset=-1`), 400, "invalid_command", "offset -1")

    // A body over the line limit: 413, whether its length is declared or it comes chunked.
    const big = JSON.stringify({ message: "x".repeat(MAX_LINE * 4) })
    expectError(await request(h, "POST", `/v1/sessions/${id}/prompt`, { body: big }), 413, "line_too_long", "declared big body")
    expectError(await request(h, "POST", `/v1/sessions/${id}/prompt`, { body: big, chunked: true }), 413, "line_too_long", "chunked big body")
    // Just under the limit is fine.
    const fits = JSON.stringify({ message: "y".repeat(MAX_LINE - 100) })
    expect((await request(h, "POST", `/v1/sessions/${id}/prompt`, { body: fits })).status).toBe(200)
    await waitReady(h, id)

    expectError(await request(h, "GET", "/v1/nowhere"), 404, "not_found", "unknown route")
    expectError(await request(h, "GET", `/v1/sessions/${id}/nowhere`), 404, "not_found", "unknown sub-route")
    expectError(await request(h, "GET", "/v2/status"), 404, "not_found", "unknown version")
    for (const [method, target, allow] of [
      ["PUT", "/v1/sessions", "GET, POST"],
      ["DELETE", "/v1/status", "GET"],
      ["GET", `/v1/sessions/${id}/prompt`, "POST"],
      ["POST", `/v1/sessions/${id}/events`, "GET"],
      ["PATCH", `/v1/sessions/${id}`, "GET, DELETE"]
    ] as const) {
      const res = await request(h, method, target, { body: method === "GET" ? undefined : "{}" })
      expectError(res, 405, "method_not_allowed", `${method} ${target}`)
      expect(res.headers.allow).toBe(allow)
    }
    expectError(await request(h, "GET", `/v1/sessions/${id}/events?offset=banana`), 400, "invalid_offset", "bad offset")
    expectError(await request(h, "GET", `/v1/sessions/${id}/events?live=forever`), 400, "invalid_offset", "bad live mode")
    expectError(await request(h, "GET", "/v1/sessions/%E0%A4%A/events"), 404, "not_found", "bad percent-encoding")
    // A client's request id is echoed.
    const echoed = await request(h, "GET", "/v1/nowhere", { headers: { "x-request-id": "mine-1" } })
    expect(echoed.json.error.requestId).toBe("mine-1")
    expect(echoed.headers["x-request-id"]).toBe("mine-1")

    // After all that, the daemon and the session are as they were.
    expect(h.daemon.running).toBe(true)
    const prompt = await request(h, "POST", `/v1/sessions/${id}/prompt`, { body: JSON.stringify({ message: "still here" }) })
    expect(prompt.status).toBe(200)
    await waitReady(h, id)
    expect((await request(h, "GET", `/v1/sessions/${id}/messages?offset=0`)).json.messages.map((m: any) => m.content)).toEqual([
      "y".repeat(MAX_LINE - 100),
      `echo: ${"y".repeat(MAX_LINE - 100)}`,
      "still here",
      "echo: still here"
    ])
  })
})
