/**
 * The server around the sessions: graceful stop, stale and live sockets, backpressure on a
 * client that stops reading, and what reaches a worker's environment.
 */
import * as fs from "node:fs"
import * as path from "node:path"
import { spawnSync } from "node:child_process"
import { describe, expect, it } from "vitest"
import {
  createSession,
  cursorGap,
  DAEMON_BIN,
  freshStateDir,
  isEvent,
  sleep,
  useDaemon,
  waitIdle
} from "./harness.js"

const rssKb = (pid: number): number => {
  const status = fs.readFileSync(`/proc/${pid}/status`, "utf8")
  return Number(/VmRSS:\s+(\d+)/.exec(status)?.[1] ?? 0)
}

const environOf = (pid: number): Record<string, string> =>
  Object.fromEntries(
    fs.readFileSync(`/proc/${pid}/environ`, "utf8").split("\0").filter((kv) => kv.includes("=")).map((kv) => {
      const i = kv.indexOf("=")
      return [kv.slice(0, i), kv.slice(i + 1)]
    })
  )

describe("server (e2e)", () => {
  it("SIGTERM: daemon_closing to clients, workers stopped, socket removed, exit 0", async () => {
    const daemon = await useDaemon()
    const client = await daemon.connect()
    const { id } = await createSession(client)
    const state = await waitIdle(client, id)
    const worker = state["workerPid"] as number
    const { code } = await daemon.stop("SIGTERM")
    expect(code).toBe(0)
    expect(client.received((m) => m["type"] === "daemon_closing")).toHaveLength(1)
    expect(fs.existsSync(daemon.socketPath)).toBe(false)
    expect(fs.existsSync(`/proc/${worker}`)).toBe(false)
  }, 30_000)

  it("a stale socket file is replaced; a live daemon on the path makes a second one exit non-zero", async () => {
    const stateDir = freshStateDir()
    fs.mkdirSync(stateDir, { recursive: true, mode: 0o700 })
    // A socket file nobody listens on (what SIGKILL leaves behind).
    const stale = spawnSync(process.execPath, ["-e", `
      const s = require("net").createServer().listen(${JSON.stringify(path.join(stateDir, "agentd.sock"))}, () => process.exit(0))
    `])
    expect(stale.status).toBe(0)
    expect(fs.existsSync(path.join(stateDir, "agentd.sock"))).toBe(true)
    const daemon = await useDaemon({ stateDir })
    const client = await daemon.connect()
    expect((await client.ok({ type: "ping" }))["pong"]).toBe(true)

    const second = spawnSync(process.execPath, [DAEMON_BIN, "serve", "--state-dir", stateDir], { encoding: "utf8", timeout: 20_000 })
    expect(second.status).not.toBe(0)
    expect(second.stderr).toContain(`another daemon is listening at ${path.join(stateDir, "agentd.sock")}`)
    // The first daemon is unharmed.
    expect((await client.ok({ type: "ping" }))["pong"]).toBe(true)
  }, 40_000)

  it("a client that stops reading while 100 MB stream is paused, then resumed from its cursor with nothing lost", async () => {
    const daemon = await useDaemon()
    const driver = await daemon.connect("driver")
    const { id } = await createSession(driver)
    await waitIdle(driver, id)
    const stuck = await daemon.connect("stuck")
    await stuck.ok({ type: "attach", activeSessionId: id, capabilities: ["event_sequence", "slim_attach"] })
    await driver.ok({ type: "attach", activeSessionId: id, capabilities: ["event_sequence", "slim_attach"] })
    await sleep(100)
    const before = rssKb(daemon.pid)
    stuck.socket.pause()
    await driver.ok({ type: "prompt", activeSessionId: id, message: "/bulk 100000000" })
    let peak = before
    const sampler = setInterval(() => {
      peak = Math.max(peak, rssKb(daemon.pid))
    }, 20)
    try {
      await driver.waitFor(isEvent("agent_end"), 120_000, "agent_end of the 100 MB turn")
      await driver.waitFor((m) => m["type"] === "session_status" && m["state"]?.busy === false, 10_000)
      peak = Math.max(peak, rssKb(daemon.pid))
    } finally {
      clearInterval(sampler)
    }
    // The stuck client's backlog lives in the event log, not in the daemon's memory. (A loose
    // guard: the turn itself is 100 MB; a daemon that buffered it for the client would be far over.)
    expect((peak - before) / 1024).toBeLessThan(80)

    stuck.socket.resume()
    const last = (await driver.ok({ type: "get_state", activeSessionId: id }))["lastEventCursor"]
    await stuck.waitFor(
      (m) => m["meta"]?.cursor?.generation === last.generation && m["meta"]?.cursor?.sequence === last.sequence,
      120_000,
      "the last event"
    )
    const seen = stuck.sequenced(id)
    expect(cursorGap(seen)).toBeUndefined()
    const bytes = seen.filter(isEvent("message_update")).reduce((n, m) => n + (m["event"].delta as string).length, 0)
    // The user prompt is short; the assistant's deltas carry exactly the 100 MB.
    expect(bytes).toBe(100_000_000)
    // Events re-sent after the pause are flagged replayed.
    expect(seen.some((m) => m["meta"].replayed === true)).toBe(true)
  }, 180_000)

  it("launchEnv and allow-listed env reach the worker; other env keys do not; neither is written to disk", async () => {
    const daemon = await useDaemon()
    const client = await daemon.connect()
    const { id } = await createSession(client, {
      env: { TERM: "xterm-test", SECRET_TOKEN: "nope" },
      launchEnv: { AGENTD_TEST_LAUNCH: "launch-value" }
    })
    const state = await waitIdle(client, id)
    const env = environOf(state["workerPid"] as number)
    expect(env["AGENTD_TEST_LAUNCH"]).toBe("launch-value")
    expect(env["TERM"]).toBe("xterm-test")
    expect(env["SECRET_TOKEN"]).toBeUndefined()
    const grep = spawnSync("grep", ["-rl", "launch-value", daemon.stateDir], { encoding: "utf8" })
    expect(grep.stdout).toBe("")
  }, 30_000)
})
