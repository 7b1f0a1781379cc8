/**
 * A stopping daemon ends (docs/protocol.md sections 3, 6, 8 and 9): after `shutdown`, SIGTERM or
 * SIGINT, clients get a bounded grace period (`--shutdown-grace-ms`) to read what they are owed,
 * then every connection is closed, whatever the client does, and the daemon exits 0. A client
 * that never reads, one that half-closed and never reads, and a stopped (SIGSTOP) worker must
 * not keep it alive.
 *
 * Every wait is bounded: on a daemon that hangs, these tests fail, they do not hang. Needs
 * `npm run build` first.
 */
import * as net from "node:net"
import { describe, expect, it } from "vitest"
import {
  cleanUpAfterTests,
  type Client,
  collectTurn,
  createSession,
  type Daemon,
  isEvent,
  type Msg,
  PROTOCOL,
  sleep,
  useDaemon,
  waitGone
} from "./harness.js"

cleanUpAfterTests()

/** The grace period the daemons of these tests are started with. */
const GRACE_MS = 1_500
/** What the daemon may take beyond the grace period to end (a loaded machine). */
const SLACK_MS = 6_000

/**
 * A session whose history is larger than a socket's buffers (so a client that does not read
 * leaves the daemon with writes that never complete), with a long turn running.
 */
const busySessionWithHistory = async (d: Daemon, ctl: Client): Promise<string> => {
  const { id, data } = await createSession(ctl)
  d.recordWorkers(data["state"])
  await ctl.ok({ type: "attach", activeSessionId: id })
  await ctl.ok({ type: "prompt", activeSessionId: id, message: "/bulk 3000000" })
  await collectTurn(ctl, id, 30_000)
  await ctl.ok({ type: "prompt", activeSessionId: id, message: "/sleep 60000" })
  await ctl.waitFor(isEvent("tool_execution_start"), 10_000)
  d.recordWorkers(await ctl.ok({ type: "status" }))
  return id
}

/** A raw connection that attaches to a session and then never reads a byte. */
const stuckClient = async (d: Daemon, id: string, halfClose: boolean): Promise<net.Socket> => {
  const socket = net.createConnection({ path: d.socketPath })
  await new Promise<void>((resolve, reject) => {
    socket.once("connect", resolve)
    socket.once("error", reject)
  })
  socket.on("error", () => {})
  // Never read: the kernel's buffers fill and the daemon's writes to it stop completing.
  socket.pause()
  const line = { type: "command", id: `stuck-${halfClose}`, protocol: PROTOCOL, command: { type: "attach", activeSessionId: id } }
  socket.write(JSON.stringify(line) + "\n")
  // Half-closed: the write side ends, the read side stays open (and unread).
  if (halfClose) socket.end()
  return socket
}

/** Waits until the daemon has exited, at most `ms`; the elapsed time. */
const exitWithin = async (d: Daemon, ms: number): Promise<number> => {
  const started = Date.now()
  await Promise.race([d.exited, sleep(ms)])
  return Date.now() - started
}

describe("a stopping daemon ends", () => {
  for (const how of ["shutdown", "SIGTERM", "SIGINT"] as const) {
    it(`${how}: a client that never reads and a half-closed one that never reads do not keep it alive; exit 0 within the grace period`, async () => {
      // The setting by its variable, and (SIGINT) by its flag.
      const d = await useDaemon(how === "SIGINT"
        ? { extraArgs: ["--shutdown-grace-ms", String(GRACE_MS)] }
        : { env: { AGENTD_SHUTDOWN_GRACE_MS: String(GRACE_MS) } })
      const ctl = await d.connect("ctl")
      const id = await busySessionWithHistory(d, ctl)
      const sockets = [await stuckClient(d, id, false), await stuckClient(d, id, true)]
      try {
        // Both attached (the daemon answers the status with both connections counted) and
        // with writes to them outstanding.
        await sleep(500)
        const workers = d.workerProcesses()
        if (how === "shutdown") {
          const r = await ctl.request({ type: "shutdown" }, 10_000)
          expect(r["success"], JSON.stringify(r)).toBe(true)
        } else {
          d.signal(how)
        }
        const elapsed = await exitWithin(d, GRACE_MS + SLACK_MS)
        expect(d.running, `daemon still running ${elapsed} ms after ${how}\n${d.output}`).toBe(false)
        expect({ code: d.exitCode, signal: d.exitSignal }, d.output).toEqual({ code: 0, signal: null })
        expect(await waitGone([...workers, ...d.recordedWorkerPids], 3_000), "workers left").toEqual([])
      } finally {
        for (const s of sockets) s.destroy()
      }
    }, 90_000)
  }

  it("a well-behaved client still gets what it is owed, then daemon_closing, then the close, beside stuck ones", async () => {
    const d = await useDaemon({ env: { AGENTD_SHUTDOWN_GRACE_MS: String(GRACE_MS) } })
    const ctl = await d.connect("ctl")
    const id = await busySessionWithHistory(d, ctl)
    const sockets = [await stuckClient(d, id, false), await stuckClient(d, id, true)]
    try {
      const good = await d.connect("good")
      await good.ok({ type: "attach", activeSessionId: id })
      await good.waitFor((m) => m["type"] === "session_attached", 10_000)
      // A command waiting for the turn's end: answered shutting_down before daemon_closing.
      const checkpointId = good.sendCommand({ type: "checkpoint", activeSessionId: id })
      await sleep(500)
      const shutdownId = ctl.sendCommand({ type: "shutdown" })
      const elapsed = await exitWithin(d, GRACE_MS + SLACK_MS)
      expect(d.running, `daemon still running ${elapsed} ms after shutdown\n${d.output}`).toBe(false)
      expect(d.exitCode, d.output).toBe(0)
      for (const c of [ctl, good]) expect(await c.waitClosed(2_000), `${c.label}: connection still open`).toBe(true)
      const shutdown = ctl.all.find((m) => m["type"] === "response" && m["id"] === shutdownId)
      expect(shutdown, "the shutdown response").toMatchObject({ success: true, data: {} })
      const trace = good.all.slice(-8).map((m: Msg) => `${m["type"]}${m["id"] === undefined ? "" : `:${m["id"]}`}`).join(", ")
      const checkpoint = good.all.findIndex((m) => m["type"] === "response" && m["id"] === checkpointId)
      const closing = good.all.findIndex((m) => m["type"] === "daemon_closing")
      expect(checkpoint, `the checkpoint's answer / ${trace}`).toBeGreaterThanOrEqual(0)
      expect(good.all[checkpoint]!["error"]?.code).toBe("shutting_down")
      expect(closing, `daemon_closing / ${trace}`).toBeGreaterThan(checkpoint)
      // Nothing after the goodbye.
      expect(good.all.slice(closing + 1), trace).toEqual([])
      for (const c of [ctl]) expect(c.all.some((m) => m["type"] === "daemon_closing"), `${c.label}: daemon_closing`).toBe(true)
    } finally {
      for (const s of sockets) s.destroy()
    }
  }, 90_000)

  for (const how of ["shutdown", "SIGTERM"] as const) {
    it(`${how}: a stopped (SIGSTOP) worker is killed, and the daemon exits 0`, async () => {
      const d = await useDaemon({ env: { AGENTD_SHUTDOWN_GRACE_MS: String(GRACE_MS) } })
      const ctl = await d.connect("ctl")
      const { id } = await createSession(ctl)
      await ctl.ok({ type: "attach", activeSessionId: id })
      await ctl.ok({ type: "prompt", activeSessionId: id, message: "/sleep 60000" })
      await ctl.waitFor(isEvent("tool_execution_start"), 10_000)
      const state = await ctl.ok({ type: "get_state", activeSessionId: id })
      d.recordWorkers(state)
      const pid = state["workerPid"] as number
      expect(typeof pid).toBe("number")
      // A stopped process does not act on SIGTERM: only the SIGKILL that follows it ends it.
      process.kill(pid, "SIGSTOP")
      try {
        if (how === "shutdown") {
          const r = await ctl.request({ type: "shutdown" }, 10_000)
          expect(r["success"], JSON.stringify(r)).toBe(true)
        } else {
          d.signal("SIGTERM")
        }
        // The worker's SIGKILL comes 2 s after its SIGTERM.
        const elapsed = await exitWithin(d, 2_000 + GRACE_MS + SLACK_MS)
        expect(d.running, `daemon still running ${elapsed} ms after ${how} with a stopped worker\n${d.output}`).toBe(false)
        expect({ code: d.exitCode, signal: d.exitSignal }, d.output).toEqual({ code: 0, signal: null })
        expect(await waitGone([pid], 3_000), "the stopped worker is left").toEqual([])
      } finally {
        try {
          process.kill(pid, "SIGKILL")
        } catch {
          // gone
        }
      }
    }, 60_000)
  }

  it("--shutdown-grace-ms: a stuck client is given the whole grace period, which ends as soon as every connection is closed", async () => {
    const d = await useDaemon({ extraArgs: ["--shutdown-grace-ms", "60000"] })
    const ctl = await d.connect("ctl")
    const id = await busySessionWithHistory(d, ctl)
    const sockets = [await stuckClient(d, id, true)]
    try {
      await sleep(500)
      const r = await ctl.request({ type: "shutdown" }, 10_000)
      expect(r["success"], JSON.stringify(r)).toBe(true)
      // Well within its 60 s grace period, the daemon still waits for the stuck client...
      await exitWithin(d, 3_000)
      expect(d.running, `the daemon did not wait for its grace period\n${d.output}`).toBe(true)
      // ...and ends once that client has gone.
      for (const s of sockets) s.destroy()
      const elapsed = await exitWithin(d, SLACK_MS)
      expect(d.running, `daemon still running ${elapsed} ms after its last client closed\n${d.output}`).toBe(false)
      expect(d.exitCode, d.output).toBe(0)
    } finally {
      for (const s of sockets) s.destroy()
    }
  }, 60_000)
})
