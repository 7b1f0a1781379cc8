/**
 * Findings of the session-12 black-box audit: each test failed on the code it was found on (main
 * at 7092896) and passes with its fix. The findings, as found:
 *
 * 1. `serve --max-workers 0` is accepted (`AGENTD_MAX_WORKERS=0` is refused), and then no
 *    session ever gets a worker: every prompt waits forever, sessions stay `starting`, busy.
 * 2. An invalid `--http` (or `AGENTD_HTTP`) value is found only after the daemon took the state
 *    dir, bumped its supervisor generation and listened on its socket; it exits 1 (a usage
 *    error is 2), and for `AGENTD_HTTP` the message names `--http`, not the variable.
 * 3. `AGENTD_STORE=bogus` exits 1; section 8 says `--store` or `AGENTD_STORE` with any other
 *    value exits 2 (`invalid store ...`), which `--store bogus` does.
 * 4. `HEAD /login?token=...` answers 405, where `GET` answers 303 ("HEAD works where GET does").
 * 5. An HTTP/1.1 request without a `Host` header gets Node's bare 400 (no body, no
 *    `X-Request-Id`) instead of the JSON error every other refusal gets (421
 *    `misdirected_request`, as an HTTP/1.0 request without `Host` already gets).
 * 6. The first `/metrics` scrape lacks `agentd_http_requests_total` (section 10: "Every metric
 *    below is listed from the first scrape, at 0 until used"); it shows up from the second.
 * 7. An SSE event stream (`live=sse`) of a session that is killed delivers `session_closed` and
 *    then stays open for ever (keep-alives; `agentd_clients{transport="sse"}` stays 1), though
 *    nothing can follow: a long-poll at the tail answers with `session_closed`, a half-closed
 *    socket client attached to it is ended, and the next read of the stream is a 404.
 * 8. A socket client that sends commands and reads no response makes the daemon hold every
 *    response in memory: it goes on reading and answering the client's commands however far
 *    behind the client is (500 `get_messages` of a 1 MB message took the daemon's RSS from
 *    158 MB to 359 MB and rising). Section 5: "A slow client is never allowed to grow the
 *    daemon's memory without bound"; bounded, it would stop reading such a client's commands
 *    once its outbox is full (8 MiB), and the client's own writes would back up.
 * 9. `GET /v1/sessions/:id/messages?limit=-1` (or `1.5`, `1e2`) answers `Expected number,
 *    actual "-1"`: the query value is a number, the message should say what is wrong with it
 *    (the socket says `Expected a non-negative number, actual -1`).
 * 10. A path with a doubled slash (`GET //v1/status`) is answered `No route for GET /status.`:
 *    the path is read as a URL whose host is `v1`, so the message names a path never sent.
 * 11. A second SIGTERM (or SIGINT: Ctrl-C pressed twice) during a graceful stop kills the daemon
 *    by the signal (exit 143 / 130, the shell's "Terminated") instead of the stop ending with
 *    exit 0 (section 8: "exits 0 on SIGINT/SIGTERM after a graceful stop"); what was left of
 *    the stop (the clients' grace period, the workers' stop) is skipped. If a second signal is
 *    meant to force the stop, that is undocumented and should still be a deliberate exit.
 */
import { spawn } from "node:child_process"
import { randomUUID } from "node:crypto"
import * as fs from "node:fs"
import * as nodeHttp from "node:http"
import * as net from "node:net"
import * as path from "node:path"
import { describe, expect, it } from "vitest"
import { killQuietly, processesWithEnv } from "../support/procfs.js"
import {
  cleanUpAfterTests,
  createSession,
  DAEMON_BIN,
  freshStateDir,
  sharedDaemon,
  sleep,
  useDaemon,
  waitIdle
} from "./harness.js"
import { httpPortOf, request } from "./httpHarness.js"

cleanUpAfterTests()

/** The environment of a daemon run by `runServe`: no AGENTD_ setting of the test run's own. */
const cleanEnv = (extra: Record<string, string>, mark: string): Record<string, string> => {
  const env: Record<string, string> = {}
  for (const [k, v] of Object.entries(process.env)) {
    if (v === undefined || k.startsWith("AGENTD_") || k.startsWith("VITEST")) continue
    env[k] = v
  }
  return { ...env, AGENTD_WARM_SPARE: "0", ...extra, AGENTD_E2E_MARK: mark }
}

/**
 * Runs `agentd serve ARGS` and waits up to `timeoutMs` for it to exit by itself; a daemon still
 * running then is SIGKILLed (its group and anything carrying its mark) and reported `code: null`.
 */
const runServe = async (
  args: ReadonlyArray<string>,
  env: Record<string, string> = {},
  timeoutMs = 8_000
): Promise<{ readonly code: number | null; readonly stderr: string }> => {
  const mark = randomUUID()
  const child = spawn(process.execPath, [DAEMON_BIN, "serve", ...args], {
    env: cleanEnv(env, mark),
    stdio: ["ignore", "ignore", "pipe"],
    detached: true
  })
  let stderr = ""
  child.stderr!.setEncoding("utf8").on("data", (d: string) => (stderr += d))
  const exited = new Promise<number | null>((resolve) => child.once("exit", (code) => resolve(code)))
  const code = await Promise.race([exited, sleep(timeoutMs).then(() => "running" as const)])
  if (code === "running") {
    try {
      process.kill(-child.pid!, "SIGKILL")
    } catch {
      // gone meanwhile
    }
    await Promise.race([exited, sleep(3_000)])
    for (const p of processesWithEnv("AGENTD_E2E_MARK", mark)) killQuietly(p, "SIGKILL")
    return { code: null, stderr }
  }
  return { code, stderr }
}

/** One raw HTTP exchange on a TCP connection: what the daemon wrote until it closed. */
const rawHttp = (port: number, text: string, timeoutMs = 5_000): Promise<string> =>
  new Promise((resolve) => {
    const socket = net.createConnection({ host: "127.0.0.1", port })
    let out = ""
    const done = () => {
      clearTimeout(timer)
      socket.destroy()
      resolve(out)
    }
    const timer = setTimeout(done, timeoutMs)
    socket.setEncoding("utf8")
    socket.on("data", (d: string) => {
      out += d
      // One whole answer (headers and a Content-Length body) is enough.
      const head = out.indexOf("\r\n\r\n")
      const len = /content-length: *(\d+)/i.exec(out)
      if (head >= 0 && len !== null && out.length >= head + 4 + Number(len[1])) done()
    })
    socket.on("close", done)
    socket.on("error", done)
    socket.on("connect", () => socket.write(text))
  })

describe("audit findings (session 12)", () => {
  it("1: `serve --max-workers 0` is a usage error (exit 2) like AGENTD_MAX_WORKERS=0, not a daemon whose prompts never run", async () => {
    const stateDir = freshStateDir()
    const r = await runServe(["--state-dir", stateDir, "--max-workers", "0"])
    // On main it runs (then every prompt waits forever for a worker): killed here, code null.
    expect(r.code, r.stderr).toBe(2)
    expect(r.stderr).toMatch(/--max-workers/)
    expect(fs.existsSync(stateDir)).toBe(false)
  })

  it("2: an invalid --http or AGENTD_HTTP is refused before the state dir is touched (exit 2, naming what was given)", async () => {
    for (const bad of ["garbage", "127.0.0.1:99999"]) {
      const stateDir = freshStateDir()
      const r = await runServe(["--state-dir", stateDir, "--http", bad])
      expect(r.code, r.stderr).toBe(2)
      expect(r.stderr).toMatch(/--http/)
      // On main the daemon first listens and writes supervisor-generation, events/, sessions/.
      expect(r.stderr).not.toMatch(/agentd listening at/)
      expect(fs.existsSync(stateDir), `${bad}: ${fs.existsSync(stateDir) ? fs.readdirSync(stateDir).join(",") : ""}`).toBe(false)
    }
    const stateDir = freshStateDir()
    const env = await runServe(["--state-dir", stateDir], { AGENTD_HTTP: "garbage" })
    expect(env.code, env.stderr).not.toBe(0)
    expect(env.code, env.stderr).not.toBe(null)
    expect(env.stderr).toMatch(/AGENTD_HTTP/)
    expect(env.stderr).not.toMatch(/agentd listening at/)
    expect(fs.existsSync(stateDir)).toBe(false)
  })

  it("3: AGENTD_STORE with an invalid value exits 2 (`invalid store ...`), as --store does", async () => {
    const stateDir = freshStateDir()
    const flag = await runServe(["--state-dir", stateDir, "--store", "bogus"])
    expect(flag.code, flag.stderr).toBe(2)
    const env = await runServe(["--state-dir", stateDir], { AGENTD_STORE: "bogus" })
    expect(env.code, env.stderr).toBe(2)
    expect(env.stderr).toMatch(/invalid store/)
    expect(fs.existsSync(stateDir)).toBe(false)
  })

  it("11: a second SIGTERM during a graceful stop does not kill the daemon by the signal: it still exits 0", async () => {
    const daemon = await useDaemon()
    const c = await daemon.connect()
    const { id } = await createSession(c)
    await c.ok({ type: "prompt", activeSessionId: id, message: "/sleep 5000" })
    daemon.signal("SIGTERM")
    await sleep(300)
    daemon.signal("SIGTERM")
    await Promise.race([daemon.exited, sleep(15_000)])
    // On main: exitCode null, exitSignal SIGTERM.
    expect({ code: daemon.exitCode, signal: daemon.exitSignal }, daemon.output).toEqual({ code: 0, signal: null })
  })

  describe("one shared daemon (with --http)", () => {
    const getDaemon = sharedDaemon({ extraArgs: ["--http", "127.0.0.1:0"] })
    const http = async () => {
      const daemon = getDaemon()
      const port = await httpPortOf(daemon)
      const token = fs.readFileSync(path.join(daemon.stateDir, "http-token"), "utf8").trim()
      return { port, token }
    }

    // First in this block: the scrape must be the daemon's first HTTP request.
    it("6: the first /metrics scrape lists agentd_http_requests_total", async () => {
      const h = await http()
      const first = await request(h, "GET", "/metrics")
      expect(first.status).toBe(200)
      expect(first.text).toMatch(/^# TYPE agentd_events_appended_total counter$/m)
      expect(first.text).toMatch(/^# TYPE agentd_http_requests_total counter$/m)
    })

    it("7: an SSE stream of a session that is killed ends after its session_closed", async () => {
      const h = await http()
      const created = await request(h, "POST", "/v1/sessions", { body: "{}" })
      expect(created.status).toBe(201)
      const id = created.json.activeSessionId as string
      let text = ""
      let ended = false
      const req = nodeHttp.get({
        host: "127.0.0.1",
        port: h.port,
        path: `/v1/sessions/${id}/events?offset=now&live=sse`,
        headers: { host: `127.0.0.1:${h.port}`, authorization: `Bearer ${h.token}` },
        agent: false
      })
      try {
        const res = await new Promise<nodeHttp.IncomingMessage>((resolve, reject) => {
          req.once("response", resolve)
          req.once("error", reject)
        })
        expect(res.statusCode).toBe(200)
        res.setEncoding("utf8")
        res.on("data", (d: string) => (text += d))
        res.on("end", () => (ended = true))
        res.on("close", () => (ended = true))
        const killed = await request(h, "DELETE", `/v1/sessions/${id}`)
        expect(killed.status).toBe(200)
        const deadline = Date.now() + 8_000
        while (!ended && Date.now() < deadline) await sleep(50)
        expect(text).toMatch(/"session_closed"/)
        // On main the stream is still open here (and for ever).
        expect(ended, "the SSE stream is still open after session_closed").toBe(true)
      } finally {
        req.destroy()
      }
    })

    it("8: a client that reads no response is not answered without bound: the daemon stops reading its commands", async () => {
      const daemon = getDaemon()
      const c = await daemon.connect("writer")
      const { id } = await createSession(c)
      await c.ok({ type: "prompt", activeSessionId: id, message: "/bulk 1000000" })
      await waitIdle(c, id, 30_000)
      // 64 commands of 100 KB (an unknown field is ignored), each answered with ~1 MB.
      const line = JSON.stringify({ type: "get_messages", activeSessionId: id, pad: "p".repeat(100_000) }) + "\n"
      const s = net.createConnection({ path: daemon.socketPath })
      try {
        s.pause()
        await new Promise<void>((resolve, reject) => {
          s.once("connect", () => resolve())
          s.once("error", reject)
        })
        for (let i = 0; i < 64; i++) s.write(line)
        // On main every command is read (nothing stays unsent) and ~64 MB of answers pile up.
        await sleep(3_000)
        expect(s.writableLength, "the daemon read every command of a client that reads nothing").toBeGreaterThan(0)
      } finally {
        s.destroy()
      }
    })

    it("9: a bad messages?limit or offset gets a message that says what is wrong with the number", async () => {
      const h = await http()
      const created = await request(h, "POST", "/v1/sessions", { body: "{}" })
      const id = created.json.activeSessionId as string
      for (const q of ["limit=-1", "offset=-1", "limit=1.5"]) {
        const r = await request(h, "GET", `/v1/sessions/${id}/messages?${q}`)
        expect(r.status).toBe(400)
        expect(r.json.error.code).toBe("invalid_command")
        expect(r.json.error.message, q).not.toMatch(/Expected number, actual/)
        expect(r.json.error.message, q).toMatch(/non-negative|integer|whole number|>= ?0/)
      }
    })

    it("10: a 404 for a path with a doubled slash names the path as sent", async () => {
      const h = await http()
      const r = await request(h, "GET", "//v1/status")
      expect(r.status).toBe(404)
      expect(r.json.error.message).toContain("//v1/status")
    })

    it("4: HEAD /login answers as GET /login does (303 with the cookie), not 405", async () => {
      const h = await http()
      const get = await request(h, "GET", `/login?token=${h.token}`, { noAuth: true })
      expect(get.status).toBe(303)
      const head = await request(h, "HEAD", `/login?token=${h.token}`, { noAuth: true })
      expect(head.status, head.text).toBe(303)
      expect(String(head.headers["set-cookie"] ?? "")).toMatch(/agentd_token=/)
    })

    it("5: an HTTP/1.1 request without Host gets a JSON error with its request id (421 misdirected_request), not a bare 400", async () => {
      const h = await http()
      const http10 = await rawHttp(h.port, `GET /v1/status HTTP/1.0\r\nAuthorization: Bearer ${h.token}\r\n\r\n`)
      expect(http10).toMatch(/^HTTP\/1\.1 421/)
      const http11 = await rawHttp(h.port, `GET /v1/status HTTP/1.1\r\nAuthorization: Bearer ${h.token}\r\nConnection: close\r\n\r\n`)
      expect(http11.split("\r\n")[0]).toBe("HTTP/1.1 421 Misdirected Request")
      expect(http11).toMatch(/x-request-id:/i)
      const body = http11.slice(http11.indexOf("\r\n\r\n") + 4)
      expect(JSON.parse(body).error.code).toBe("misdirected_request")
    })
  })
})
