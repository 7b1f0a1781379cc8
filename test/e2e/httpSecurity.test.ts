/**
 * The HTTP front's gate against the real daemon (docs/protocol.md section 10): each attack is
 * tried and must be refused (no token, wrong token, foreign Origin, a rebinding Host), the
 * login URL sets an HttpOnly SameSite=Strict cookie, no CORS header is ever sent, a
 * non-loopback bind is refused without --http-insecure, and the token never reaches the logs.
 */
import { spawnSync } from "node:child_process"
import * as fs from "node:fs"
import * as path from "node:path"
import { describe, expect, it } from "vitest"
import { cleanUpAfterTests, DAEMON_BIN, freshStateDir, modeOf, useDaemon } from "./harness.js"
import { request, useHttpDaemon } from "./httpHarness.js"

cleanUpAfterTests()

/** Every route (GET forms), each must be refused without the token. */
const ROUTES: ReadonlyArray<readonly [string, string]> = [
  ["GET", "/"],
  ["GET", "/healthz"],
  ["GET", "/metrics"],
  ["GET", "/v1/status"],
  ["GET", "/v1/sessions"],
  ["POST", "/v1/sessions"],
  ["GET", "/v1/sessions/s-x"],
  ["DELETE", "/v1/sessions/s-x"],
  ["POST", "/v1/sessions/s-x/prompt"],
  ["POST", "/v1/sessions/s-x/abort"],
  ["POST", "/v1/sessions/s-x/checkpoint"],
  ["POST", "/v1/sessions/s-x/retry"],
  ["GET", "/v1/sessions/s-x/messages"],
  ["GET", "/v1/sessions/s-x/events?offset=-1&live=sse"],
  ["GET", "/v1/sessions/s-x/snapshot"],
  ["GET", "/v1/socket"],
  ["GET", "/nowhere"]
]

const expectNoCors = (headers: Record<string, unknown>) => {
  for (const name of Object.keys(headers)) expect(name.toLowerCase().startsWith("access-control-")).toBe(false)
}

describe("HTTP security (e2e)", () => {
  it("the token: made at first start, 0600 in the 0700 state dir, printed by `agentd http-token`, kept across restarts", async () => {
    const h = await useHttpDaemon()
    const file = path.join(h.daemon.stateDir, "http-token")
    expect(modeOf(file)).toBe(0o600)
    expect(modeOf(h.daemon.stateDir)).toBe(0o700)
    expect(h.token).toMatch(/^[A-Za-z0-9_-]{43}$/)
    const printed = spawnSync(process.execPath, [DAEMON_BIN, "http-token", "--state-dir", h.daemon.stateDir], { encoding: "utf8" })
    expect(printed.status).toBe(0)
    expect(printed.stdout.trim()).toBe(h.token)
    await h.daemon.stop()
    const again = await useHttpDaemon({ stateDir: h.daemon.stateDir })
    expect(again.token).toBe(h.token)
  })

  it("no token, a wrong token, a wrong cookie: 401 on every route, a JSON error, no stack trace", async () => {
    const h = await useHttpDaemon()
    const wrongSameLength = h.token.slice(0, -1) + (h.token.endsWith("A") ? "B" : "A")
    for (const [method, target] of ROUTES) {
      for (const headers of [
        {},
        { authorization: `Bearer ${wrongSameLength}` },
        { authorization: `Bearer ${h.token}x` },
        { authorization: `Basic ${Buffer.from(`x:${h.token}`).toString("base64")}` },
        { cookie: `agentd_token=${wrongSameLength}` },
        // A real token in a cookie of another name is not ours.
        { cookie: `other=${h.token}` }
      ]) {
        const res = await request(h, method, target, { noAuth: true, headers: { ...headers, ...(target === "/v1/socket" ? { upgrade: "websocket", connection: "Upgrade", "sec-websocket-version": "13", "sec-websocket-key": "dGhlIHNhbXBsZSBub25jZQ==" } : {}) } })
        expect(res.status, `${method} ${target} ${JSON.stringify(headers)}`).toBe(401)
        expect(res.json?.error?.code).toBe("unauthorized")
        expect(typeof res.json?.error?.requestId).toBe("string")
        expect(res.text).not.toMatch(/at .*\.js:\d+/)
        expectNoCors(res.headers)
      }
    }
    // The right one passes.
    expect((await request(h, "GET", "/v1/status")).status).toBe(200)
  })

  it("a foreign Origin is refused (403), even with the token; our own origin passes; no CORS, not even to a preflight", async () => {
    const h = await useHttpDaemon()
    for (const origin of ["http://evil.example", `http://evil.example:${h.port}`, "null", `http://127.0.0.1:${h.port + 1}`, `https://localhost.evil.example:${h.port}`, "file://"]) {
      for (const [method, target] of [["GET", "/v1/status"], ["POST", "/v1/sessions"], ["GET", "/v1/sessions/s-x/events?live=sse"]] as const) {
        const res = await request(h, method, target, { headers: { origin }, body: method === "POST" ? "{}" : undefined })
        expect(res.status, `${origin} ${method} ${target}`).toBe(403)
        expect(res.json?.error?.code).toBe("forbidden_origin")
        expectNoCors(res.headers)
      }
    }
    // No session was created by any of them.
    expect((await request(h, "GET", "/v1/sessions")).json.sessions).toEqual([])
    for (const origin of [`http://127.0.0.1:${h.port}`, `http://localhost:${h.port}`]) {
      const res = await request(h, "GET", "/v1/status", { headers: { origin } })
      expect(res.status, origin).toBe(200)
      expectNoCors(res.headers)
    }
    const preflight = await request(h, "OPTIONS", "/v1/sessions", {
      headers: { origin: "http://evil.example", "access-control-request-method": "POST" },
      noAuth: true
    })
    expect(preflight.status).not.toBe(200)
    expect(preflight.status).not.toBe(204)
    expectNoCors(preflight.headers)
  })

  it("a rebinding Host (a foreign name on our address) is refused (421), even with the token", async () => {
    const h = await useHttpDaemon()
    for (const host of [`evil.example:${h.port}`, "evil.example", `127.0.0.1:${h.port + 1}`, `localhost.evil.example:${h.port}`, `127.0.0.1.nip.io:${h.port}`, ""]) {
      const res = await request(h, "GET", "/v1/status", { headers: { host } })
      expect(res.status, host).toBe(421)
      expect(res.json?.error?.code).toBe("misdirected_request")
      // The login URL is checked too: a rebound page cannot log itself in.
      const login = await request(h, "GET", `/login?token=${h.token}`, { headers: { host }, noAuth: true })
      expect(login.status, host).toBe(421)
      expect(login.headers["set-cookie"]).toBeUndefined()
    }
    for (const host of [`127.0.0.1:${h.port}`, `localhost:${h.port}`, `LOCALHOST:${h.port}`]) {
      expect((await request(h, "GET", "/v1/status", { headers: { host } })).status, host).toBe(200)
    }
  })

  it("login: a wrong token sets nothing; the right one redirects to / with an HttpOnly SameSite=Strict cookie that then works", async () => {
    const h = await useHttpDaemon()
    const wrong = await request(h, "GET", "/login?token=nope", { noAuth: true })
    expect(wrong.status).toBe(401)
    expect(wrong.headers["set-cookie"]).toBeUndefined()
    const none = await request(h, "GET", "/login", { noAuth: true })
    expect(none.status).toBe(401)
    const res = await request(h, "GET", `/login?token=${encodeURIComponent(h.token)}`, { noAuth: true })
    expect(res.status).toBe(303)
    expect(res.headers.location).toBe("/")
    const cookie = String(res.headers["set-cookie"])
    expect(cookie).toMatch(/HttpOnly/)
    expect(cookie).toMatch(/SameSite=Strict/)
    expect(cookie).toMatch(/Path=\//)
    const pair = cookie.split(";")[0]!
    const status = await request(h, "GET", "/v1/status", { noAuth: true, headers: { cookie: `x=1; ${pair}` } })
    expect(status.status).toBe(200)
    expect(status.json.pid).toBe(h.daemon.pid)
    const page = await request(h, "GET", "/", { noAuth: true, headers: { cookie: pair } })
    expect(page.status).toBe(200)
    expect(page.headers["content-type"]).toMatch(/text\/html/)
    // The cookie does not cross origins for the browser; here: a foreign Origin with the cookie is still refused.
    expect((await request(h, "GET", "/v1/status", { noAuth: true, headers: { cookie: pair, origin: "http://evil.example" } })).status).toBe(403)
  })

  it("a non-loopback bind is refused without --http-insecure (nothing listens, exit 1); allowed with it", async () => {
    const stateDir = freshStateDir()
    const refused = spawnSync(process.execPath, [DAEMON_BIN, "serve", "--state-dir", stateDir, "--http", "0.0.0.0:0"], {
      encoding: "utf8",
      timeout: 30_000,
      env: { ...process.env, AGENTD_HTTP: "" }
    })
    expect(refused.status, refused.stderr).toBe(1)
    expect(refused.stderr).toMatch(/not a loopback address.*--http-insecure/)
    const env = { AGENTD_HTTP_INSECURE: "1" }
    const daemon = await useDaemon({ extraArgs: ["--http", "0.0.0.0:0"], env })
    expect(daemon.stderr).toMatch(/agentd HTTP at http:\/\/0\.0\.0\.0:\d+/)
    const flagged = await useDaemon({ extraArgs: ["--http", "0.0.0.0:0", "--http-insecure"] })
    expect(flagged.stderr).toMatch(/agentd HTTP at http:\/\/0\.0\.0\.0:\d+/)
  })

  it("the token never reaches the daemon's logs (debug level), whatever the requests carry", async () => {
    const h = await useHttpDaemon({ extraArgs: ["--log-level", "debug"] })
    await request(h, "GET", `/login?token=${h.token}`, { noAuth: true })
    await request(h, "GET", `/login?token=${h.token}x`, { noAuth: true })
    await request(h, "GET", `/v1/sessions/${h.token}`)
    await request(h, "GET", `/v1/nowhere/${h.token}`)
    await request(h, "POST", "/v1/sessions", { body: `{"name":"${h.token}",` })
    await request(h, "POST", "/v1/sessions", { body: JSON.stringify({ engine: h.token }) })
    await request(h, "GET", "/v1/status", { headers: { host: `${h.token}:${h.port}` } })
    await request(h, "GET", `/v1/sessions/x/events?offset=${h.token}`)
    const sessions = await request(h, "POST", "/v1/sessions", { body: "{}" })
    const id = sessions.json.activeSessionId as string
    await request(h, "POST", `/v1/sessions/${id}/prompt`, { body: JSON.stringify({ message: "hello" }) })
    await h.daemon.stop()
    expect(h.daemon.stderr.length).toBeGreaterThan(0)
    expect(h.daemon.stderr).not.toContain(h.token)
    expect(h.daemon.stdout).not.toContain(h.token)
    for (const f of fs.readdirSync(h.daemon.stateDir)) {
      if (f === "http-token" || !f.endsWith(".log")) continue
      expect(fs.readFileSync(path.join(h.daemon.stateDir, f), "utf8")).not.toContain(h.token)
    }
  })
})
