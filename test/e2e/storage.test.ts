/**
 * Storage failures against the real daemon (docs/protocol.md sections 3, 4, 6): a full disk or
 * no file descriptor left is a turn failure, never a silent loss. A prompt that cannot be made
 * durable is refused `storage_unavailable`; a turn cut by a failed write ends with
 * `turn_interrupted {storage_failed}` before any state that depends on it; `get_state` never
 * shows what the stream has not; once storage works again the session goes on by itself.
 *
 * The full disk is a real small tmpfs (needs root: mount); the test is skipped where tmpfs cannot
 * be mounted. Needs `npm run build` first.
 */
import { execFileSync } from "node:child_process"
import * as fs from "node:fs"
import * as os from "node:os"
import * as path from "node:path"
import { describe, expect, it, onTestFinished } from "vitest"
import { attachAndReplay } from "./attach.js"
import { until } from "./cliRun.js"
import {
  cleanUpAfterTests,
  type Client,
  collectTurn,
  collectUntil,
  compareCursor,
  type Cursor,
  cursorOf,
  createSession,
  cursorGap,
  type Daemon,
  describeMsg,
  isEvent,
  isIdleStatus,
  type Msg,
  sleep,
  useDaemon,
  waitIdle
} from "./harness.js"

cleanUpAfterTests()

/** A tmpfs of `sizeMiB` on a new temp dir, unmounted after the test; undefined if not allowed. */
const tmpfs = (sizeMiB: number): string | undefined => {
  const dir = fs.mkdtempSync(path.join(os.tmpdir(), "agentd-tmpfs-"))
  try {
    execFileSync("mount", ["-t", "tmpfs", "-o", `size=${sizeMiB}m,mode=0700`, "tmpfs", dir], { stdio: "ignore" })
  } catch {
    fs.rmdirSync(dir)
    return undefined
  }
  onTestFinished(() => {
    try {
      execFileSync("umount", ["-l", dir], { stdio: "ignore" })
      fs.rmdirSync(dir)
    } catch {
      // best effort
    }
  })
  return dir
}

const canMountTmpfs = (() => {
  if (process.getuid?.() !== 0) return false
  const dir = fs.mkdtempSync(path.join(os.tmpdir(), "agentd-tmpfs-probe-"))
  try {
    execFileSync("mount", ["-t", "tmpfs", "-o", "size=1m", "tmpfs", dir], { stdio: "ignore" })
    execFileSync("umount", [dir], { stdio: "ignore" })
    return true
  } catch {
    return false
  } finally {
    fs.rmdirSync(dir)
  }
})()

/** Fills the file system of `dir` with a file, leaving about `leaveBytes` free; returns its path. */
const fill = (dir: string, leaveBytes = 0): string => {
  const file = path.join(dir, "filler")
  const fd = fs.openSync(file, "a")
  try {
    const chunk = Buffer.alloc(64 * 1024, 120)
    for (;;) {
      const free = fs.statfsSync(dir).bavail * fs.statfsSync(dir).bsize
      if (free <= leaveBytes) break
      const piece = Math.min(chunk.length, free - leaveBytes)
      try {
        fs.writeSync(fd, chunk, 0, piece)
      } catch {
        break // ENOSPC: full
      }
    }
  } finally {
    fs.closeSync(fd)
  }
  return file
}

/**
 * Polls `get_state` beside the stream: every summary it gives must be the one the stream showed
 * last up to the summary's `lastEventCursor` (busy and worker state), never one ahead of it.
 */
const watchState = (c: Client, watcher: Client, id: string) => {
  const problems: Array<string> = []
  let stop = false
  const run = (async () => {
    while (!stop) {
      const r = await watcher.request({ type: "get_state", activeSessionId: id }).catch(() => undefined)
      if (r === undefined || r["success"] !== true) break
      const state = r["data"] as Msg
      const at = state["lastEventCursor"] as Cursor | undefined
      if (at !== undefined) {
        // What the stream had shown by that cursor (`c` may still be reading it).
        const upTo = () => c.sequenced(id).filter((m) => compareCursor(cursorOf(m), at) <= 0)
        for (let i = 0; i < 100 && !upTo().some((m) => compareCursor(cursorOf(m), at) === 0); i++) await sleep(20)
        const status = upTo().filter((m) => m["type"] === "session_status").pop()
        if (status !== undefined && (status["state"]["busy"] !== state["busy"] || status["state"]["worker"] !== state["worker"])) {
          problems.push(`get_state ${JSON.stringify(state)} differs from the stream's last status ${describeMsg(status)}`)
        }
      }
      await sleep(20)
    }
  })()
  return {
    problems,
    done: async () => {
      stop = true
      await run
    }
  }
}

/** The turn's sequenced messages must end it: its end before the first `busy: false` status. */
const expectEndedBeforeIdle = (turn: ReadonlyArray<Msg>, reason?: string) => {
  const shown = turn.map(describeMsg).join(", ")
  const end = turn.findIndex((m) => isEvent("agent_end")(m) || isEvent("turn_interrupted")(m))
  const idle = turn.findIndex(isIdleStatus)
  expect(end, shown).toBeGreaterThanOrEqual(0)
  expect(idle, shown).toBeGreaterThan(end)
  if (reason !== undefined) expect(turn[end]!["event"], shown).toMatchObject({ type: "turn_interrupted", reason })
}

/** An idle connection that holds one of the daemon's fds; undefined once the daemon has none left. */
const hog = async (d: Daemon, label: string): Promise<Client | undefined> => {
  const c = await d.connect(label, { awaitHello: false }).catch(() => undefined)
  if (c === undefined) return undefined
  const hello = await c.waitFor((m) => m["type"] === "daemon_hello", 1_500, "hello").catch(() => undefined)
  if (hello === undefined || c.closed) {
    c.close()
    return undefined
  }
  return c
}

/** How a daemon that should be running ended, with the end of its log (for a failure message). */
const diedHow = (d: Daemon): string => `exited with code ${d.exitCode}, signal ${d.exitSignal}; its log ends:\n${d.stderr.slice(-3000)}`

describe("storage failures", () => {
  it.skipIf(!canMountTmpfs)("a disk that fills during a turn: turn_interrupted {storage_failed} before the idle status, get_state never ahead; freed, the session goes on by itself; a restart keeps it closed", async () => {
    const root = tmpfs(24)!
    const stateDir = path.join(root, "state")
    // No automatic checkpoint: the turn's events stay in the log.
    const d = await useDaemon({ stateDir, env: { AGENTD_CHECKPOINT_BYTES: String(2 ** 40), AGENTD_CHECKPOINT_EVENTS: "1000000" } })
    const c = await d.connect("c")
    const watcher = await d.connect("watcher")
    const { id } = await createSession(c)
    await waitIdle(c, id)
    await attachAndReplay(c, { activeSessionId: id })
    await c.ok({ type: "prompt", activeSessionId: id, message: "before the fault" })
    await collectTurn(c, id)
    // About 1 MB left; the turn writes 6 MB.
    const filler = fill(root, 1024 * 1024)
    const watch = watchState(c, watcher, id)
    const prompt = await c.request({ type: "prompt", activeSessionId: id, message: "/bulk 6000000" })
    let turn: Array<Msg> = []
    if (prompt["success"] === true) {
      // The end may be owed until space comes back: it is freed once the fault is seen.
      const seen = (async () => {
        for (let i = 0; i < 400 && !d.stderr.includes("storage failed"); i++) await sleep(50)
        await sleep(2_000)
        fs.rmSync(filler)
      })()
      turn = await collectTurn(c, id, 30_000)
      await seen
      expectEndedBeforeIdle(turn, "storage_failed")
      console.log(`turn cut: ${turn.slice(-4).map(describeMsg).join(", ")}`)
    } else {
      expect(prompt["error"]["code"], JSON.stringify(prompt)).toBe("storage_unavailable")
      fs.rmSync(filler, { force: true })
    }
    fs.rmSync(filler, { force: true })
    // By itself: a worker restores the session from what was logged.
    await waitIdle(c, id, 20_000)
    await watch.done()
    expect(watch.problems).toEqual([])
    // The restored worker's `ready` status (busy: false) is not part of the next turn.
    await collectUntil(c, id, (m) => m["type"] === "session_status" && m["state"]["worker"] === "ready" && m["state"]["busy"] === false)
    await c.ok({ type: "prompt", activeSessionId: id, message: "after the fault" })
    const next = await collectTurn(c, id)
    expectEndedBeforeIdle(next)
    const all = c.sequenced(id)
    expect(cursorGap(all)).toBeUndefined()
    const { messages } = await c.ok({ type: "get_messages", activeSessionId: id, limit: 1000 })
    const contents = (messages as Array<Msg>).map((m) => `${m["role"]}:${String(m["content"]).slice(0, 20)}`)
    expect(contents[0]).toBe("user:before the fault")
    expect(contents).toContain("user:after the fault")
    // Every accepted prompt's turn ended, once.
    const ends = all.filter((m) => isEvent("agent_end")(m) || isEvent("turn_interrupted")(m)).length
    expect(ends, all.map(describeMsg).join(", ")).toBe(prompt["success"] === true ? 3 : 2)

    // A restart: nothing reopens the cut turn, nothing is lost.
    await d.stop("SIGTERM")
    const d2 = await useDaemon({ stateDir })
    const c2 = await d2.connect("c2")
    const { messages: after } = await c2.ok({ type: "get_messages", activeSessionId: id, limit: 1000 })
    expect(after).toEqual(messages)
    const replay = await attachAndReplay(c2, { activeSessionId: id })
    void replay
    await sleep(500)
    expect(c2.sequenced(id).filter((m) => isEvent("turn_interrupted")(m) && m["meta"]["replayed"] !== true)).toEqual([])
    expect((await c2.ok({ type: "get_state", activeSessionId: id }))["busy"]).toBe(false)
  }, 120_000)

  it.skipIf(!canMountTmpfs)("a prompt on a full disk is refused storage_unavailable or its turn ends turn_interrupted {storage_failed}; never accepted then dropped", async () => {
    const root = tmpfs(16)!
    const stateDir = path.join(root, "state")
    const d = await useDaemon({ stateDir })
    const c = await d.connect("c")
    const watcher = await d.connect("watcher")
    const { id } = await createSession(c)
    await waitIdle(c, id)
    await attachAndReplay(c, { activeSessionId: id })
    await c.ok({ type: "prompt", activeSessionId: id, message: "before" })
    await collectTurn(c, id)
    const filler = fill(root)
    const watch = watchState(c, watcher, id)
    const prompt = await c.request({ type: "prompt", activeSessionId: id, message: "/bulk 20000" })
    if (prompt["success"] === true) {
      // Accepted: its turn ends, whatever the disk does, before the session says idle.
      const freeLater = (async () => {
        for (let i = 0; i < 200 && !d.stderr.includes("storage failed"); i++) await sleep(50)
        await sleep(3_000)
        fs.rmSync(filler, { force: true })
      })()
      const turn = await collectTurn(c, id, 20_000)
      await freeLater
      expectEndedBeforeIdle(turn)
    } else {
      expect(prompt["error"]["code"], JSON.stringify(prompt)).toBe("storage_unavailable")
      expect(prompt["error"]["message"]).toMatch(/ENOSPC|journal|event log/)
    }
    fs.rmSync(filler, { force: true })
    await waitIdle(c, id, 20_000)
    await watch.done()
    expect(watch.problems).toEqual([])
    // Space is back: turns run, and the transcript holds every turn that was not cut.
    await c.ok({ type: "prompt", activeSessionId: id, message: "after" })
    await collectUntil(c, id, isEvent("agent_end"), 20_000)
    await waitIdle(c, id)
    const { messages } = await c.ok({ type: "get_messages", activeSessionId: id, limit: 1000 })
    const users = (messages as Array<Msg>).filter((m) => m["role"] === "user").map((m) => m["content"])
    expect(users[0]).toBe("before")
    expect(users[users.length - 1]).toBe("after")
    const all = c.sequenced(id)
    expect(cursorGap(all)).toBeUndefined()
    // Every accepted prompt's turn ended, once.
    const accepted = prompt["success"] === true ? 3 : 2
    const ends = all.filter((m) => isEvent("agent_end")(m) || isEvent("turn_interrupted")(m)).length
    expect(ends, all.map(describeMsg).join(", ")).toBe(accepted)
  }, 90_000)

  it("a worker that crashes while the daemon has no fd left: its replacement cannot be spawned, the daemon lives on, and once fds come back the session runs again", async () => {
    const d = await useDaemon()
    const c = await d.connect("c")
    const { id } = await createSession(c)
    const ready = await waitIdle(c, id)
    await attachAndReplay(c, { activeSessionId: id })
    // The session's worker and the warm spare are up: every fd the daemon needs now is open.
    await until("the warm spare", () => d.workerProcesses().length >= 2)
    await sleep(300)
    // No new fd: the limit is the lowest free fd number (those open above it stay usable).
    // Then only the 3 fds the dead worker's pipes free come back, and a spawn, which needs 8
    // at once, fails with EMFILE, whatever the load (no idle connections racing for fds).
    const open = new Set(fs.readdirSync(`/proc/${d.pid}/fd`).map(Number))
    let limit = 0
    while (open.has(limit)) limit++
    // The soft limit only: raising it back needs no privilege.
    const [soft, hard] = fs.readFileSync(`/proc/${d.pid}/limits`, "utf8").match(/^Max open files\s+(\d+)\s+(\d+)/m)!.slice(1)
    execFileSync("prlimit", ["--pid", String(d.pid), `--nofile=${limit}:${hard}`])
    const logged = d.stderr.length
    process.kill(ready["workerPid"] as number, "SIGKILL")
    await until("a failed spawn", () => /cannot spawn a worker/.test(d.stderr.slice(logged)) || !d.running, 15_000)
    await sleep(1_000)
    // A failed spawn once killed the daemon's own process group (kill(0, SIGKILL)), silently.
    expect(d.running, diedHow(d)).toBe(true)
    expect((await c.ok({ type: "ping" }))["pong"]).toBe(true)
    execFileSync("prlimit", ["--pid", String(d.pid), `--nofile=${soft}:${hard}`])
    const state = await c.ok({ type: "get_state", activeSessionId: id })
    if (state["worker"] === "failed") await c.ok({ type: "retry_worker", activeSessionId: id })
    await waitIdle(c, id, 30_000)
    await c.ok({ type: "prompt", activeSessionId: id, message: "after" })
    await collectUntil(c, id, isEvent("agent_end"), 20_000)
    expect(d.running, diedHow(d)).toBe(true)
  }, 90_000)

  it("at the fd limit, a prompt whose journal record cannot be written is refused storage_unavailable and status says so; fds back, turns run and a crash is still caught", async () => {
    const d = await useDaemon({ fdLimit: 64 })
    const c = await d.connect("c")
    const { id } = await createSession(c)
    await waitIdle(c, id)
    await attachAndReplay(c, { activeSessionId: id })
    // One turn: its end compacts the journal, which closes the journal's file (opened again at the next record).
    await c.ok({ type: "prompt", activeSessionId: id, message: "one" })
    await collectTurn(c, id)
    // Idle connections take every fd the daemon has left.
    const hogs: Array<Client> = []
    for (let i = 0; i < 200; i++) {
      const h = await hog(d, `hog-${i}`)
      if (h === undefined) break
      hogs.push(h)
    }
    let refused: Msg | undefined
    for (let attempt = 0; attempt < 5 && refused === undefined; attempt++) {
      const r = await c.request({ type: "prompt", activeSessionId: id, message: "/sleep 4000" })
      if (r["success"] === true) {
        // Accepted: it must be durable, so the test cannot tell (a leftover fd): it ends, try again.
        await collectTurn(c, id, 20_000)
        for (let i = 0; i < 20; i++) {
          const h = await hog(d, `hog-more-${attempt}-${i}`)
          if (h === undefined) break
          hogs.push(h)
        }
        continue
      }
      refused = r
    }
    expect(refused?.["error"]?.["code"], JSON.stringify(refused)).toBe("storage_unavailable")
    expect(refused!["error"]["message"]).toMatch(/journal/)
    const status = await c.ok({ type: "status" })
    expect(status["storage"]).toMatchObject({ ok: false })
    expect(String(status["storage"]["error"])).toMatch(/EMFILE/)
    // Nothing was published for the refused prompt: the session is idle as the stream says.
    const state = await c.ok({ type: "get_state", activeSessionId: id })
    expect(state).toMatchObject({ busy: false, worker: "ready" })
    // A worker spawned now (the warm spare the pool starts again once this session takes it)
    // fails EMFILE: the session's create is answered, and the daemon lives on.
    const created = await c.request({ type: "create" })
    expect(created["type"]).toBe("response")
    await sleep(500)
    expect((await c.ok({ type: "ping" }))["pong"]).toBe(true)
    expect(d.running).toBe(true)
    for (const h of hogs) h.close()
    await sleep(500)
    // Killed once there are fds again: its archive opens directories (at the limit it may not).
    if (created["success"] === true) await c.ok({ type: "kill", activeSessionId: created["data"]["activeSessionId"] })
    await c.ok({ type: "prompt", activeSessionId: id, message: "/sleep 4000" })
    await collectUntil(c, id, isEvent("tool_execution_start"))
    expect((await c.ok({ type: "status" }))["storage"]).toEqual({ ok: true })
    // The journal knows the turn runs: a daemon killed now is a turn cut at the restart.
    const stateDir = d.stateDir
    await d.sigkill()
    await sleep(200)
    const d2 = await useDaemon({ stateDir })
    const c2 = await d2.connect("c2")
    await attachAndReplay(c2, { activeSessionId: id })
    const rest = await collectTurn(c2, id, 20_000)
    expectEndedBeforeIdle(rest, "daemon_restarted")
  }, 120_000)
})

