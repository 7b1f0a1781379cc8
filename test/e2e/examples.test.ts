/**
 * The examples (examples/*.ts) run as a user runs them: compiled by `npm run build` to
 * dist/examples, started with plain `node`, importing `agentd`, `agentd/client` and
 * `agentd/worker` by name (Node resolves the package's own name through its exports map).
 * stream and follow talk to the built daemon; embed is the daemon.
 *
 * Needs `npm run build` first.
 */
import { type ChildProcess, spawn } from "node:child_process"
import { randomUUID } from "node:crypto"
import * as fs from "node:fs"
import * as os from "node:os"
import * as path from "node:path"
import { describe, expect, it, onTestFinished } from "vitest"
import * as Client from "../../src/client.js"
import { killQuietly, processesWithEnv } from "../support/procfs.js"
import { cleanUpAfterTests, PROJECT_ROOT, sleep, useDaemon } from "./harness.js"

cleanUpAfterTests()

const EXAMPLES = path.join(PROJECT_ROOT, "dist", "examples")

/** A running example: its output so far, and waits on it. */
class Example {
  stdout = ""
  stderr = ""
  readonly exited: Promise<number | null>

  constructor(readonly proc: ChildProcess, readonly name: string) {
    proc.stdout!.setEncoding("utf8").on("data", (d: string) => (this.stdout += d))
    proc.stderr!.setEncoding("utf8").on("data", (d: string) => (this.stderr += d))
    this.exited = new Promise((resolve) => proc.once("exit", (code) => resolve(code)))
  }

  get lines(): Array<string> {
    return this.stdout.split("\n").filter((l) => l !== "")
  }

  get output(): string {
    return `--- ${this.name} stdout ---\n${this.stdout.slice(-4000)}\n--- stderr ---\n${this.stderr.slice(-3000)}`
  }

  async waitFor(pattern: RegExp, timeoutMs = 20_000): Promise<void> {
    const deadline = Date.now() + timeoutMs
    while (!this.lines.some((l) => pattern.test(l))) {
      if (this.proc.exitCode !== null) throw new Error(`${this.name} exited (${this.proc.exitCode}) before printing ${pattern}\n${this.output}`)
      if (Date.now() > deadline) throw new Error(`${this.name} printed no ${pattern} within ${timeoutMs} ms\n${this.output}`)
      await sleep(20)
    }
  }

  async exit(timeoutMs = 30_000): Promise<number | null> {
    const code = await Promise.race([this.exited, sleep(timeoutMs).then(() => "timeout" as const)])
    if (code === "timeout") throw new Error(`${this.name} did not exit within ${timeoutMs} ms\n${this.output}`)
    return code
  }
}

/**
 * Starts `node dist/examples/<name>.js args` with `env`; it and every process it started (they
 * carry a marker in their environment) are killed when the test ends.
 */
const runExample = (name: string, args: ReadonlyArray<string>, env: Readonly<Record<string, string>>): Example => {
  const file = path.join(EXAMPLES, `${name}.js`)
  if (!fs.existsSync(file)) throw new Error(`${file} does not exist: run \`npm run build\` first`)
  const mark = randomUUID()
  const base: Record<string, string> = {}
  for (const [k, v] of Object.entries(process.env)) {
    if (v !== undefined && !k.startsWith("AGENTD_") && !k.startsWith("VITEST") && k !== "NODE_OPTIONS") base[k] = v
  }
  const proc = spawn(process.execPath, [file, ...args], {
    cwd: os.tmpdir(),
    env: { ...base, ...env, AGENTD_E2E_MARK: mark },
    stdio: ["ignore", "pipe", "pipe"]
  })
  onTestFinished(() => {
    if (proc.exitCode === null) killQuietly(proc.pid!, "SIGKILL")
    for (const pid of processesWithEnv("AGENTD_E2E_MARK", mark)) killQuietly(pid, "SIGKILL")
  })
  return new Example(proc, name)
}

const drain = async (events: AsyncIterable<unknown>) => {
  for await (const _ of events) {
    // the turn's events
  }
}

/** Fails with `label` (and the follower's output) when `promise` takes more than `ms`, so a hang names its step. */
const within = async <A>(label: string, promise: Promise<A>, output: () => string, ms = 20_000): Promise<A> => {
  let timer: NodeJS.Timeout | undefined
  const timeout = new Promise<never>((_, reject) => {
    timer = setTimeout(() => reject(new Error(`${label}: no result within ${ms} ms\n${output()}`)), ms)
  })
  try {
    return await Promise.race([promise, timeout])
  } finally {
    clearTimeout(timer)
  }
}

/** `g:s` at the start of a follow line. */
const cursorOf = (line: string): { generation: number; sequence: number } | undefined => {
  const m = /^(\d+):(\d+) /.exec(line)
  return m === null ? undefined : { generation: Number(m[1]), sequence: Number(m[2]) }
}

describe("examples (e2e)", () => {
  it("stream.ts: creates a session, prompts it and prints the reply as it streams; run again, it reuses that session by name", async () => {
    const daemon = await useDaemon()
    const example = runExample("stream", ["hello from the example test"], { AGENTD_SOCKET: daemon.socketPath })
    expect(await example.exit(), example.output).toBe(0)
    const lines = example.lines
    expect(lines[0], example.output).toMatch(/^session s-/)
    expect(lines).toContain("echo: hello from the example test")
    expect(lines.at(-1)).toBe("2 messages")
    const again = runExample("stream", ["once more"], { AGENTD_SOCKET: daemon.socketPath })
    expect(await again.exit(), again.output).toBe(0)
    expect(again.lines[0], again.output).toBe(lines[0])
    expect(again.lines).toContain("echo: once more")
    expect(again.lines.at(-1)).toBe("4 messages")
  })

  it("follow.ts: prints every event once, in order, across a worker SIGKILL and a daemon SIGKILL + restart; its transcript is get_messages'", async () => {
    const first = await useDaemon()
    const driver = await Client.connect({ socketPath: first.socketPath })
    const session = await driver.create({ name: "followed", config: { tokenDelayMs: 1 } })
    const id = session.activeSessionId
    await within("prompt before the follower", drain(session.prompt("before the follower")), () => "")
    const follower = runExample("follow", [id], { AGENTD_SOCKET: first.socketPath })
    let daemons = [first]
    const output = () => [follower.output, ...daemons.map((d) => `--- daemon ${d.pid} ---\n${d.output.slice(-3000)}`)].join("\n")
    // Generation 1's snapshot is the empty session: the baseline's events are the first turn's.
    await follower.waitFor(/^baseline attach: 0 messages$/)
    await follower.waitFor(/ message_end assistant: "echo: before the follower"$/)
    await within("prompt one two three", drain(session.prompt("one two three")), output)
    await follower.waitFor(/ message_end assistant: "echo: one two three"$/)

    // A worker SIGKILL in the middle of a turn.
    const sleeping = drain(session.prompt("/sleep 2000")).then(() => "ended", (e: { reason?: string }) => e.reason)
    await follower.waitFor(/ tool_execution_start$/)
    const state = await within("get_state before the worker kill", session.getState(), output)
    first.recordWorkers(state)
    process.kill(state.workerPid!, "SIGKILL")
    expect(await within("the /sleep turn's end after the worker kill", sleeping, output)).toBe("worker_crashed")
    await follower.waitFor(/ turn_interrupted worker_crashed$/)
    await within("prompt after the crash", drain(session.prompt("after the crash")), output)
    await follower.waitFor(/ message_end assistant: "echo: after the crash"$/)
    first.recordWorkers(await within("status before the daemon kill", driver.status(), output))
    await driver.close()

    // The daemon SIGKILLed while the follower is connected, then a new one on the same state dir.
    await within("the first daemon's exit", first.sigkill(), output)
    await sleep(300)
    const second = await useDaemon({ stateDir: first.stateDir })
    daemons = [first, second]
    const driver2 = await within("connect to the second daemon", Client.connect({ socketPath: second.socketPath }), output)
    const session2 = driver2.session(id)
    await within("prompt after the restart", drain(session2.prompt("after the restart")), output)
    await follower.waitFor(/ message_end assistant: "echo: after the restart"$/)
    const { total } = await within("get_messages", session2.getMessages(), output)
    second.recordWorkers(await within("get_state after the restart", session2.getState(), output))
    await within("kill", session2.kill(), output)
    await driver2.close()

    // session_closed ends the follow: it prints the transcript's size and exits.
    expect(await follower.exit(), follower.output).toBe(0)
    const lines = follower.lines
    expect(lines.at(-2), follower.output).toMatch(/ closed killed$/)
    expect(lines.at(-1)).toBe(`transcript: ${total} messages`)
    // One baseline: every reconnect resumed after the last event printed.
    const baselines = lines.filter((l) => l.startsWith("baseline "))
    expect(baselines, follower.output).toHaveLength(1)
    const after = /up to (\d+):(\d+)$/.exec(baselines[0]!)
    let previous = after === null ? { generation: 1, sequence: -1 } : { generation: Number(after[1]), sequence: Number(after[2]) }
    const problems: Array<string> = []
    for (const line of lines) {
      const c = cursorOf(line)
      if (c === undefined) continue
      const follows = (c.generation === previous.generation && c.sequence === previous.sequence + 1) ||
        (c.generation > previous.generation && c.sequence === 0)
      if (!follows) problems.push(`${line} after ${previous.generation}:${previous.sequence}`)
      previous = c
    }
    expect(problems, follower.output).toEqual([])
    // Every turn, each once.
    for (const text of ["echo: before the follower", "echo: one two three", "echo: after the crash", "echo: after the restart"]) {
      expect(lines.filter((l) => l.endsWith(`message_end assistant: "${text}"`)), text).toHaveLength(1)
    }
  }, 90_000)

  it("embed.ts: the daemon's layers with its own engine in real workers and the memory journal", async () => {
    const root = fs.mkdtempSync(path.join(os.tmpdir(), "agentd-embed-example-"))
    onTestFinished(() => fs.rmSync(root, { recursive: true, force: true }))
    const stateDir = path.join(root, "state")
    const example = runExample("embed", [stateDir], {})
    expect(await example.exit(), example.output).toBe(0)
    const lines = example.lines
    for (
      const expected of [
        "> one two three",
        "three two one",
        "> four five six",
        "six five four",
        "restarts: 1, worker ready",
        "user: one two three",
        "assistant: three two one",
        "user: four five six",
        "assistant: six five four",
        "journal: in memory"
      ]
    ) expect(lines, example.output).toContain(expected)
    expect(lines.some((l) => /^worker \d+ killed$/.test(l)), example.output).toBe(true)
    expect(fs.existsSync(path.join(stateDir, "recovery.jsonl"))).toBe(false)
    // The socket went with the program.
    expect(fs.existsSync(path.join(stateDir, "agentd.sock"))).toBe(false)
  }, 60_000)
})
