/**
 * Process lifecycle of the real daemon (docs/protocol.md sections 1, 2 and 8): `--socket`, `shutdown`,
 * SIGTERM/SIGINT, and a refused second start. Every test here starts (and stops) daemons of its
 * own.
 *
 * Needs `npm run build` first.
 */
import * as fs from "node:fs"
import * as path from "node:path"
import { describe, expect, it } from "vitest"
import {
  cleanUpAfterTests,
  collectTurn,
  createSession,
  cursorGap,
  type Daemon,
  freshStateDir,
  isEvent,
  modeOf,
  type Msg,
  sleep,
  startDaemon,
  useDaemon,
  waitGone
} from "./harness.js"
import { unflag } from "./attach.js"

cleanUpAfterTests()


/** Tries to start a daemon on a state dir; a started one is cleaned up at once. */
const tryStart = async (stateDir: string): Promise<{ started: boolean; error: string }> => {
  let started: Daemon | undefined
  let error = ""
  try {
    started = await startDaemon({ stateDir })
  } catch (e) {
    error = String(e)
  }
  if (started !== undefined) await started.cleanup()
  return { started: started !== undefined, error }
}

describe("process lifecycle", () => {
  it("creates the --socket directory 0700 and listens there, 0600", async () => {
    const stateDir = freshStateDir()
    const sockDir = path.join(path.dirname(stateDir), "sockdir", "nested")
    const sock = path.join(sockDir, "a.sock")
    const d = await useDaemon({ stateDir, socket: sock })
    expect(modeOf(sockDir).toString(8)).toBe("700")
    expect(modeOf(sock).toString(8)).toBe("600")
    expect(fs.existsSync(path.join(stateDir, "agentd.sock"))).toBe(false)
    const c = await d.connect()
    expect(await c.ok({ type: "ping" })).toEqual({ pong: true })
  }, 30_000)

  it("shutdown answers {} then daemon_closing, and the daemon exits 0 leaving no worker", async () => {
    const d = await useDaemon()
    const c = await d.connect()
    const { id, data } = await createSession(c)
    d.recordWorkers(data["state"])
    await c.ok({ type: "prompt", activeSessionId: id, message: "x" })
    const st = await c.ok({ type: "get_state", activeSessionId: id })
    d.recordWorkers(st)
    const workers = d.workerProcesses()
    const sid = c.sendCommand({ type: "shutdown" })
    const r = await c.response(sid)
    expect(r).toMatchObject({ command: "shutdown", success: true, data: {} })
    const closing = await c.waitFor((m) => m["type"] === "daemon_closing", 10_000)
    expect(closing).toEqual({ type: "daemon_closing", reason: "shutdown" })
    expect(c.all.indexOf(r)).toBeLessThan(c.all.indexOf(closing))
    await Promise.race([d.exited, sleep(15_000)])
    expect(d.running, "daemon still running 15 s after shutdown").toBe(false)
    expect(d.exitCode, d.output).toBe(0)
    expect(await waitGone([...workers, ...d.recordedWorkerPids], 3_000)).toEqual([])
  }, 30_000)
  it("SIGTERM and SIGINT stop the daemon gracefully with exit 0: daemon_closing to clients, the session's worker stopped before the exit, socket removed, no worker left, clients disconnected", async () => {
    // Both signals at once, each on a daemon of its own.
    await Promise.all((["SIGTERM", "SIGINT"] as const).map(async (sig) => {
      const d = await useDaemon()
      const c = await d.connect()
      const { id, data } = await createSession(c)
      d.recordWorkers(data["state"])
      await c.ok({ type: "attach", activeSessionId: id })
      await c.ok({ type: "prompt", activeSessionId: id, message: "hi" })
      await collectTurn(c, id)
      const worker = (await c.ok({ type: "get_state", activeSessionId: id }))["workerPid"] as number
      d.recordWorkers(await c.ok({ type: "status" }))
      const procs = d.workerProcesses()
      expect(procs.length).toBeGreaterThan(0)
      const { code, signal } = await d.stop(sig)
      expect({ sig, code, signal }, d.output).toEqual({ sig, code: 0, signal: null })
      // The session's worker is stopped before the daemon exits, not merely after it.
      expect(fs.existsSync(`/proc/${worker}`), `${sig}: the session's worker outlived the daemon`).toBe(false)
      expect(c.received((m) => m["type"] === "daemon_closing"), sig).toHaveLength(1)
      expect(fs.existsSync(d.socketPath), `${sig}: socket left`).toBe(false)
      expect(await waitGone([...procs, ...d.recordedWorkerPids], 3_000), `${sig}: workers left`).toEqual([])
      expect(await c.waitClosed(2_000), `${sig}: client connection still open`).toBe(true)
    }))
  }, 45_000)

  it("every command waiting when the daemon stops is answered shutting_down: shutdown on its connection, on another, SIGTERM", async () => {
    await Promise.all((["same connection", "other connection", "SIGTERM"] as const).map(async (how) => {
      const d = await useDaemon()
      const c = await d.connect(how)
      const { id } = await createSession(c)
      await c.ok({ type: "attach", activeSessionId: id })
      await c.ok({ type: "prompt", activeSessionId: id, message: "/sleep 20000" })
      await c.waitFor((m) => m["type"] === "session_event" && m["event"]?.type === "tool_execution_start")
      // Both wait for the turn's end, which the daemon will not wait for.
      const checkpointId = c.sendCommand({ type: "checkpoint", activeSessionId: id })
      const secondId = c.sendCommand({ type: "checkpoint", activeSessionId: id })
      // Time for both to reach the daemon and wait there. Nothing shows that they do (a ping
      // behind them would be answered after them), so this is a generous guess for a loaded
      // machine: a checkpoint still in flight at the shutdown would be answered after
      // daemon_closing.
      await sleep(1_000)
      const started = Date.now()
      const trace = () => `${how}: ${c.all.slice(-8).map((m) => `${m["type"]}${m["id"] === undefined ? "" : `:${m["id"]}`}${m["error"] === undefined ? "" : `:${m["error"].code}`}`).join(", ")}`
      let shutdown: Msg | undefined
      if (how === "SIGTERM") {
        const { code } = await d.stop("SIGTERM")
        expect(code, `exit code / ${trace()}`).toBe(0)
      } else {
        const s = how === "same connection" ? c : await d.connect("other")
        shutdown = await s.response(s.sendCommand({ type: "shutdown" }), 10_000)
        expect(shutdown, how).toMatchObject({ success: true, data: {} })
        await s.waitFor((m) => m["type"] === "daemon_closing", 10_000)
      }
      for (const commandId of [checkpointId, secondId]) {
        const r = await c.response(commandId, 10_000)
        expect(r["error"]?.code, `${JSON.stringify(r)} / ${trace()}`).toBe("shutting_down")
      }
      // In the order of their commands, then the daemon's goodbye (which may reach this
      // connection a moment after the other one's).
      for (let waited = 0; waited < 5_000 && !c.all.some((m) => m["type"] === "daemon_closing"); waited += 20) await sleep(20)
      const closing = c.all.findIndex((m) => m["type"] === "daemon_closing")
      const answers = [checkpointId, secondId].map((commandId) => c.all.findIndex((m) => m["type"] === "response" && m["id"] === commandId))
      if (shutdown !== undefined && how === "same connection") answers.push(c.all.indexOf(shutdown))
      expect(answers, trace()).toEqual([...answers].sort((a, b) => a - b))
      expect(answers.every((i) => i < closing), `answered before daemon_closing / ${trace()}`).toBe(true)
      expect(Date.now() - started, `${how}: the daemon did not wait for the turn`).toBeLessThan(10_000)
      await Promise.race([d.exited, sleep(15_000)])
      expect(d.exitCode, d.output).toBe(0)
    }))
  }, 60_000)

  it("a refused second start does not disturb the running daemon's turn or event log", async () => {
    const d = await useDaemon()
    const a = await d.connect("a")
    const { id } = await createSession(a)
    await a.ok({ type: "attach", activeSessionId: id })
    await a.ok({ type: "prompt", activeSessionId: id, message: "/sleep 2000" })
    await a.waitFor(isEvent("tool_execution_start"), 10_000)
    const second = await tryStart(d.stateDir)
    expect(second.started, "a second daemon must not start on the same socket").toBe(false)
    // The running turn is undisturbed.
    const turn = await collectTurn(a, id, 10_000)
    expect(turn.filter(isEvent("turn_interrupted"))).toEqual([])
    expect(turn.some(isEvent("agent_end"))).toBe(true)
    const log = a.sequenced(id).map(unflag)
    expect(cursorGap(log)).toBeUndefined()
    // After a clean restart the durable log is exactly what the client saw, nothing more.
    await d.stop("SIGTERM")
    const d2 = await useDaemon({ stateDir: d.stateDir })
    const b = await d2.connect("b")
    const att = await b.ok({ type: "attach", activeSessionId: id })
    expect(att["lastEventCursor"]).toEqual(log[log.length - 1]!["meta"].cursor)
    await b.waitFor((m) => m["type"] === "session_attached")
    const replayed: Array<Msg> = []
    while (replayed.length < log.length) {
      replayed.push(await b.waitFor((m) => m["type"] === "session_event" || m["type"] === "session_status", 5_000))
    }
    expect(replayed.map(unflag)).toEqual(log)
  }, 40_000)

  // Not literally required by docs/protocol.md, but a daemon that refuses to start because another
  // one is listening must not change that daemon's state dir. (An earlier build bumped the
  // persisted supervisor generation and deleted <stateDir>/snapshot-cache/*, the live daemon's
  // spilled snapshot chunks, before it probed the socket.)
  it("a refused second start leaves the state dir alone (supervisor generation, spilled snapshot cache)", async () => {
    const d = await useDaemon()
    const a = await d.connect("a")
    const { id } = await createSession(a)
    await a.ok({ type: "attach", activeSessionId: id })
    // > memoryCacheBytes (4 MiB), so the checkpoint's chunks spill to snapshot-cache/.
    await a.ok({ type: "prompt", activeSessionId: id, message: "/bulk 5000000" })
    await collectTurn(a, id, 30_000)
    await a.ok({ type: "checkpoint", activeSessionId: id }, 30_000)
    const cacheDir = path.join(d.stateDir, "snapshot-cache")
    const listCache = (): Array<string> => (fs.existsSync(cacheDir) ? fs.readdirSync(cacheDir, { recursive: true }).map(String).sort() : [])
    const genFile = path.join(d.stateDir, "supervisor-generation")
    const readGen = (): string | undefined => (fs.existsSync(genFile) ? fs.readFileSync(genFile, "utf8") : undefined)
    const cacheBefore = listCache()
    const genBefore = readGen()
    const second = await tryStart(d.stateDir)
    expect(second.started).toBe(false)
    expect(listCache(), "the live daemon's snapshot-cache entries").toEqual(cacheBefore)
    expect(readGen(), "the persisted supervisor generation").toEqual(genBefore)
    // Observable on the wire: the next real start is exactly +1.
    const gen = d.hello!["supervisorGeneration"] as number
    await d.stop("SIGTERM")
    const d2 = await useDaemon({ stateDir: d.stateDir })
    expect(d2.hello!["supervisorGeneration"], "generation after stop + start, with a refused start in between").toBe(gen + 1)
  }, 60_000)
})
