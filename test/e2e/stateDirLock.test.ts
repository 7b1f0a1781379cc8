/**
 * One daemon per state dir, with the built `agentd serve`: a second one on the same state dir,
 * whatever its socket (`--socket`, `AGENTD_SOCKET`, `--detach`), exits 1 naming the first and
 * leaves the state dir byte for byte as it was; the lock outlives the socket file during a
 * graceful stop; a SIGKILLed daemon's successor starts at once; two started at the same moment
 * on one state dir: exactly one runs, every round (`AGENTD_LOCK_ROUNDS` rounds, default 5).
 */
import { type ChildProcess, spawn } from "node:child_process"
import { createHash, randomUUID } from "node:crypto"
import * as fs from "node:fs"
import * as path from "node:path"
import { describe, expect, it, onTestFinished } from "vitest"
import { descendantsOf, killQuietly, processesWithEnv } from "../support/procfs.js"
import {
  cleanUpAfterTests,
  Client,
  compactedJournal,
  createSession,
  DAEMON_BIN,
  freshStateDir,
  type Msg,
  sharedDaemon,
  sleep,
  useDaemon,
  waitGone,
  waitIdle
} from "./harness.js"

cleanUpAfterTests()

const ROUNDS = Number(process.env["AGENTD_LOCK_ROUNDS"] ?? 5)

/** Every file and dir under `dir` with its type, mode and (files) content hash, sorted. */
const fingerprint = (dir: string): Array<string> => {
  const out: Array<string> = []
  const walk = (d: string) => {
    for (const name of fs.readdirSync(d).sort()) {
      const p = path.join(d, name)
      const st = fs.lstatSync(p)
      const rel = path.relative(dir, p)
      const mode = (st.mode & 0o7777).toString(8)
      if (st.isDirectory()) {
        out.push(`d ${rel} ${mode}`)
        walk(p)
      } else if (st.isFile()) {
        out.push(`f ${rel} ${mode} ${st.size} ${createHash("sha256").update(fs.readFileSync(p)).digest("hex")}`)
      } else {
        out.push(`${st.isSocket() ? "s" : "o"} ${rel} ${mode}`)
      }
    }
  }
  walk(dir)
  return out
}

/**
 * The state dir's fingerprint once the daemon holding it is quiet: its recovery journal is
 * compacted a moment after every session went idle, and that rewrite is the holder's own, not a
 * refused start's.
 */
const settledFingerprint = async (dir: string): Promise<Array<string>> => {
  await compactedJournal(dir)
  return fingerprint(dir)
}

/** A `serve` run by the test (not through the harness, which expects it to start). */
interface Serve {
  readonly proc: ChildProcess
  readonly socketPath: string
  output: string
  code: number | null | undefined
  readonly exited: Promise<void>
}

/**
 * Spawns `agentd serve ARGS` with a mark in its environment; every process carrying the mark
 * (it, its workers, a detached daemon) is killed when the test finishes, pass or fail.
 */
const serveProcess = (args: ReadonlyArray<string>, socketPath: string, env: Record<string, string> = {}): Serve => {
  const mark = randomUUID()
  const base: Record<string, string> = {}
  for (const [k, v] of Object.entries(process.env)) {
    if (v === undefined || k.startsWith("AGENTD_") || k.startsWith("VITEST") || k === "NODE_OPTIONS") continue
    base[k] = v
  }
  const proc = spawn(process.execPath, [DAEMON_BIN, "serve", ...args], {
    env: { ...base, ...env, AGENTD_E2E_MARK: mark },
    stdio: ["ignore", "pipe", "pipe"],
    detached: true
  })
  const serve: Serve = {
    proc,
    socketPath,
    output: "",
    code: undefined,
    exited: new Promise((resolve) => proc.once("exit", (code) => {
      serve.code = code
      resolve()
    }))
  }
  proc.stdout!.setEncoding("utf8")
  proc.stderr!.setEncoding("utf8")
  proc.stdout!.on("data", (d: string) => (serve.output += d))
  proc.stderr!.on("data", (d: string) => (serve.output += d))
  onTestFinished(async () => {
    const pids = [proc.pid!, ...descendantsOf(proc.pid!), ...processesWithEnv("AGENTD_E2E_MARK", mark)]
    for (const pid of pids) killQuietly(pid, "SIGKILL")
    await waitGone(pids, 5000)
  })
  return serve
}

/** Waits for the process to exit; fails (it started, as it must not) if it runs on. */
const exitOf = async (serve: Serve, timeoutMs = 20_000): Promise<number | null> => {
  const timer = new Promise<"running">((resolve) => setTimeout(() => resolve("running"), timeoutMs))
  if ((await Promise.race([serve.exited.then(() => "exited" as const), timer])) === "running") {
    throw new Error(`the second serve did not exit within ${timeoutMs} ms (it started beside the first):\n${serve.output}`)
  }
  return serve.code!
}

/** The hello on `socketPath` if the daemon there greets as `pid`. */
const greets = async (socketPath: string, pid: number): Promise<Msg | undefined> => {
  try {
    const c = await Client.connect(socketPath, "probe", { awaitHello: false })
    try {
      const hello = await c.waitFor((m) => m["type"] === "daemon_hello", 3000, "daemon_hello")
      return hello["supervisorPid"] === pid ? hello : undefined
    } finally {
      c.close()
    }
  } catch {
    return undefined
  }
}

const refusal = (pid: number, socketPath: string, stateDir: string) =>
  `agentd: another daemon (pid ${pid}, socket ${socketPath}) holds ${stateDir}\n`

describe("one daemon per state dir (e2e)", () => {
  describe("a state dir a daemon holds", () => {
    // The refused starts leave the first daemon as it was (each test checks it): they share it.
    const held = sharedDaemon()

    it("a second serve with another --socket (or AGENTD_SOCKET) exits 1 naming the first, and changes nothing on disk", async () => {
      const first = held()
      const client = await first.connect()
      const { id } = await createSession(client)
      await waitIdle(client, id)
      await client.ok({ type: "prompt", activeSessionId: id, message: "before" })
      await waitIdle(client, id)
      const before = await settledFingerprint(first.stateDir)
      expect(before).toContain(`f supervisor-generation 600 2 ${createHash("sha256").update("1\n").digest("hex")}`)
      const other = path.join(path.dirname(first.stateDir), "other.sock")

      const viaFlag = serveProcess(["--state-dir", first.stateDir, "--socket", other], other)
      expect(await exitOf(viaFlag), viaFlag.output).toBe(1)
      expect(viaFlag.output).toBe(refusal(first.pid, first.socketPath, first.stateDir))

      const viaEnv = serveProcess(["--state-dir", first.stateDir], other, { AGENTD_SOCKET: other })
      expect(await exitOf(viaEnv), viaEnv.output).toBe(1)
      expect(viaEnv.output).toBe(refusal(first.pid, first.socketPath, first.stateDir))

      // Byte for byte as it was (the generation counter too), and no socket at the other path.
      expect(fingerprint(first.stateDir)).toEqual(before)
      expect(fs.existsSync(other)).toBe(false)
      // The first daemon is unharmed.
      await client.ok({ type: "prompt", activeSessionId: id, message: "after" })
      await waitIdle(client, id)
      expect((await client.ok({ type: "status" }))["supervisorGeneration"]).toBe(1)
    }, 60_000)

    it("the same state dir through a symlink, a relative path or a trailing slash is the same lock", async () => {
      const first = held()
      const root = path.dirname(first.stateDir)
      const link = path.join(root, "link")
      fs.symlinkSync(first.stateDir, link)
      const before = await settledFingerprint(first.stateDir)
      const other = path.join(root, "other.sock")
      for (const [named, shown] of [[link, link], [`${first.stateDir}/`, first.stateDir]] as const) {
        const second = serveProcess(["--state-dir", named, "--socket", other], other)
        expect(await exitOf(second), second.output).toBe(1)
        expect(second.output).toBe(refusal(first.pid, first.socketPath, shown))
      }
      // Relative to the working directory of the command.
      const relative = serveProcess(["--state-dir", path.relative(process.cwd(), first.stateDir), "--socket", other], other)
      expect(await exitOf(relative), relative.output).toBe(1)
      expect(relative.output).toBe(refusal(first.pid, first.socketPath, first.stateDir))
      expect(fingerprint(first.stateDir)).toEqual(before)
    }, 60_000)

    it("serve --detach on a held state dir exits 1 with the same message and writes nothing (no log either)", async () => {
      const first = held()
      const before = await settledFingerprint(first.stateDir)
      const other = path.join(path.dirname(first.stateDir), "other.sock")
      const detached = serveProcess(["--detach", "--state-dir", first.stateDir, "--socket", other], other)
      expect(await exitOf(detached, 40_000), detached.output).toBe(1)
      expect(detached.output).toBe(refusal(first.pid, first.socketPath, first.stateDir))
      expect(fingerprint(first.stateDir)).toEqual(before)
      expect(fs.existsSync(path.join(first.stateDir, "agentd.log"))).toBe(false)
      expect(fs.existsSync(other)).toBe(false)
    }, 60_000)
  })

  it("after SIGKILL of the first, a new serve (any socket) starts at once on the same state dir", async () => {
    const first = await useDaemon()
    const client = await first.connect()
    const { id } = await createSession(client)
    await waitIdle(client, id)
    await first.sigkill()
    const other = path.join(path.dirname(first.stateDir), "other.sock")
    const second = await useDaemon({ stateDir: first.stateDir, socket: other })
    expect(second.hello?.["supervisorGeneration"]).toBe(2)
    const c2 = await second.connect()
    expect((await c2.ok({ type: "list" }))["sessions"].map((s: Msg) => s["activeSessionId"])).toEqual([id])
  }, 60_000)

  it("during a graceful stop the lock outlives the socket file: a second serve is refused until the first has exited", async () => {
    const first = await useDaemon()
    const client = await first.connect()
    const { id } = await createSession(client)
    const state = await waitIdle(client, id)
    // A stopped worker does not take its SIGTERM: the first daemon waits for it after its
    // socket file is gone, still alive, still the state dir's owner (as it is while it waits
    // for anything else at that point of its stop).
    const worker = state["workerPid"] as number
    process.kill(worker, "SIGSTOP")
    onTestFinished(() => killQuietly(worker, "SIGKILL"))
    await client.ok({ type: "shutdown" })
    while (fs.existsSync(first.socketPath)) await sleep(5)
    expect(first.running).toBe(true)
    const before = await settledFingerprint(first.stateDir)
    const second = serveProcess(["--state-dir", first.stateDir], first.socketPath)
    expect(await exitOf(second), second.output).toBe(1)
    expect(second.output).toBe(refusal(first.pid, first.socketPath, first.stateDir))
    expect(fingerprint(first.stateDir)).toEqual(before)
    // The lock goes with the process: once the first has exited, a new one starts. (On a
    // loaded machine the first may already have given up on the stopped worker and killed it.)
    killQuietly(worker, "SIGCONT")
    await first.exited
    expect(first.exitCode).toBe(0)
    const third = await useDaemon({ stateDir: first.stateDir })
    expect(third.hello?.["supervisorGeneration"]).toBe(2)
  }, 60_000)

  it(`two serve started at the same moment on one state dir: exactly one runs, ${ROUNDS} rounds; then SIGKILL and a new one at once`, async () => {
    const t0 = Date.now()
    const root = path.dirname(freshStateDir())
    let stateDir = path.join(root, "state-0")
    let generation = 0
    for (let round = 0; round < ROUNDS; round++) {
      // Every third round a fresh state dir (both create it), else the previous round's.
      if (round % 3 === 0) {
        stateDir = path.join(root, `state-${round}`)
        generation = 0
      }
      const sockets = [path.join(root, `a-${round}.sock`), path.join(root, `b-${round}.sock`)]
      const pair = sockets.map((s) => serveProcess(["--state-dir", stateDir, "--socket", s], s))
      // Exactly one greets; the other exits 1 naming it.
      let winner: Serve | undefined
      let hello: Msg | undefined
      const deadline = Date.now() + 30_000
      while (winner === undefined && Date.now() < deadline) {
        for (const s of pair) {
          if (s.code !== undefined) continue
          const h = await greets(s.socketPath, s.proc.pid!)
          if (h !== undefined) [winner, hello] = [s, h]
        }
        if (pair.every((s) => s.code !== undefined)) break
        await sleep(20)
      }
      if (winner === undefined) throw new Error(`round ${round}: no daemon started:\n${pair.map((s) => s.output).join("\n---\n")}`)
      const loser = pair.find((s) => s !== winner)!
      expect(await exitOf(loser), `round ${round}: ${loser.output}`).toBe(1)
      expect(loser.output, `round ${round}`).toBe(refusal(winner.proc.pid!, winner.socketPath, stateDir))
      expect(fs.existsSync(loser.socketPath), `round ${round}: the loser's socket`).toBe(false)
      expect(hello?.["supervisorGeneration"], `round ${round}: one start counted`).toBe(++generation)
      expect(fs.readFileSync(path.join(stateDir, "supervisor-generation"), "utf8")).toBe(`${generation}\n`)
      winner.proc.kill("SIGKILL")
      await winner.exited
    }
    // After a SIGKILL, a new serve starts at once.
    const next = await useDaemon({ stateDir })
    expect(next.hello?.["supervisorGeneration"]).toBe(generation + 1)
    console.log(`${ROUNDS} racing rounds of two serve: ${Date.now() - t0} ms`)
  }, 30_000 + ROUNDS * 15_000)
})
