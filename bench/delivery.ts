/**
 * Live event delivery: events/s from the engine to 1, 10 and 100 attached clients. Every client
 * has its own connection and is attached to the same session; one long turn (a plain prompt of
 * WORDS words: the echo engine streams one `message_update` per word, plus its `echo:` delta)
 * is timed from the `prompt` until every client has received every `message_update`.
 * Aggregate events/s = events x clients / time.
 *
 * Baseline in the same run: a plain `node:net` relay over Unix sockets in a temp dir. A source
 * process writes the same JSON lines (a copy of the daemon's `message_update` lines, same
 * sizes), one write per line, to a relay process that forwards every complete line to the
 * 1/10/100 connected clients (the complete lines of each read go out in one write per client);
 * the clients are the same code as the daemon's, in this process, counting the same way.
 *
 * Both sides count lines by a prefix check without parsing them, so the clients cost little.
 * Each client must receive exactly the expected number of `message_update` lines.
 */
import { type ChildProcess, spawn } from "node:child_process"
import * as fs from "node:fs"
import * as os from "node:os"
import * as path from "node:path"
import {
  Client,
  createSession,
  type Daemon,
  isEvent,
  isIdleStatus,
  type Msg,
  nowMs,
  runTurn,
  sleep,
  waitReady,
  withDaemon
} from "./daemonHarness.js"
import { printRatio } from "./report.js"

const WORDS = 20_000
/** `echo:` then one delta per word. */
export const EVENTS = WORDS + 1
const CLIENT_COUNTS = [1, 10, 100] as const
const TURN_TIMEOUT_MS = 60_000
const WARM_UP_TURNS = 3
/** Each figure is the median of this many runs (one run takes well under a second at 1 client). */
const RUNS = 3
const TARGETS: Record<number, number | undefined> = { 1: 0.5, 100: 0.3 }
const UPDATE_MARK = '"type":"message_update"'

export interface Result {
  readonly clients: number
  readonly seconds: number
  readonly perClient: ReadonlyArray<number>
}

/** Counts `message_update` lines on each client; resolves when all have `expected`. */
const countOn = (clients: ReadonlyArray<Client>, expected: number) => {
  const counts = clients.map(() => 0)
  let complete = 0
  let resolve!: () => void
  const done = new Promise<void>((r) => (resolve = r))
  clients.forEach((client, i) => {
    client.rawHook = (prefix) => {
      if (!prefix.includes(UPDATE_MARK)) return false
      if (++counts[i]! === expected && ++complete === clients.length) resolve()
      return true
    }
  })
  return { counts, done }
}

/** The run of median duration. */
const median = (runs: ReadonlyArray<Result>): Result => [...runs].sort((a, b) => a.seconds - b.seconds)[Math.floor(runs.length / 2)]!

const phases: Array<string> = []
const phase = (what: string, since: number) => phases.push(`${what} ${((nowMs() - since) / 1000).toFixed(1)}`)

const withTimeout = <A>(p: Promise<A>, ms: number, what: () => string): Promise<A> => {
  let timer: NodeJS.Timeout | undefined
  const timeout = new Promise<never>((_, reject) => {
    timer = setTimeout(() => reject(new Error(`timed out after ${ms} ms: ${what()}`)), ms)
  })
  return Promise.race([p, timeout]).finally(() => clearTimeout(timer))
}

// ---------------------------------------------------------------------------------------------
// agentd
// ---------------------------------------------------------------------------------------------

const message = (): string => Array.from({ length: WORDS }, (_, i) => `w${i}`).join(" ")

const measureDaemon = async (daemon: Daemon, ctl: Client, id: string, n: number): Promise<Result> => {
  const clients: Array<Client> = []
  try {
    const t = nowMs()
    // Attach from the session's last cursor: a complete (empty) replay, no snapshot to send.
    const state = await ctl.ok({ type: "get_state", activeSessionId: id })
    const resumeCursor = state["lastEventCursor"]
    await Promise.all(
      Array.from({ length: n }, async (_, i) => {
        const c = await daemon.connect(`c${n}-${i}`)
        clients.push(c)
        const data = await c.ok({ type: "attach", activeSessionId: id, capabilities: ["event_sequence", "slim_attach"], resumeCursor })
        if (data["replay"]?.status !== "complete") throw new Error(`attach from the last cursor gave replay ${JSON.stringify(data["replay"])}`)
        await c.waitFor((m) => m["type"] === "session_attached", 15_000, "session_attached")
        c.drain()
      })
    )
    phase(`attach ${n} clients`, t)
    const { counts, done } = countOn(clients, EVENTS)
    const text = message()
    const started = nowMs()
    await ctl.ok({ type: "prompt", activeSessionId: id, message: text })
    await withTimeout(done, TURN_TIMEOUT_MS, () => `${n} clients receiving ${EVENTS} message_update events (got ${counts.join(",")})`)
    const seconds = (nowMs() - started) / 1000
    // The turn's end on every client, then no stray extra update may have arrived.
    await Promise.all(
      clients.map(async (c) => {
        const end = await c.waitFor((m) => m["activeSessionId"] === id && (isEvent("agent_end")(m) || isEvent("turn_interrupted")(m)), 30_000, "agent_end")
        if (isEvent("turn_interrupted")(end)) throw new Error(`turn interrupted: ${JSON.stringify(end["event"])}`)
        await c.waitFor((m) => m["activeSessionId"] === id && isIdleStatus(m), 30_000, "idle status")
      })
    )
    const wrong = counts.filter((k) => k !== EVENTS)
    if (wrong.length > 0) throw new Error(`clients received ${wrong.join(",")} message_update events, expected ${EVENTS} each`)
    return { clients: n, seconds, perClient: counts }
  } finally {
    for (const c of clients) c.close()
  }
}

// ---------------------------------------------------------------------------------------------
// Baseline: source process -> relay process -> clients
// ---------------------------------------------------------------------------------------------

const RELAY_SRC = `
const net = require("net")
const [clientPath, sourcePath] = process.argv.slice(1)
const clients = []
net.createServer((sock) => {
  clients.push(sock)
  sock.on("error", () => {})
  sock.on("close", () => { const i = clients.indexOf(sock); if (i >= 0) clients.splice(i, 1) })
  sock.write('{"type":"daemon_hello"}\\n')
}).listen(clientPath, () => {
  net.createServer((src) => {
    let rest = null
    src.on("data", (data) => {
      const buf = rest === null ? data : Buffer.concat([rest, data])
      const last = buf.lastIndexOf(10)
      if (last < 0) { rest = buf; return }
      const lines = buf.subarray(0, last + 1)
      rest = last + 1 < buf.length ? buf.subarray(last + 1) : null
      for (const c of clients) c.write(lines)
    })
  }).listen(sourcePath, () => process.stdout.write("ready\\n"))
})
`

const SOURCE_SRC = `
const net = require("net")
const fs = require("fs")
const [sourcePath, linesFile] = process.argv.slice(1)
const lines = fs.readFileSync(linesFile, "utf8").split("\\n").filter((l) => l.length > 0).map((l) => l + "\\n")
const sock = net.createConnection({ path: sourcePath }, () => {
  process.stdout.write("ready\\n")
  process.stdin.once("data", async () => {
    for (const line of lines) {
      if (!sock.write(line)) await new Promise((r) => sock.once("drain", r))
    }
  })
})
`

const startHelper = (src: string, args: ReadonlyArray<string>, children: Array<ChildProcess>): Promise<ChildProcess> =>
  new Promise((resolve, reject) => {
    const child = spawn(process.execPath, ["-e", src, ...args], { stdio: ["pipe", "pipe", "inherit"] })
    children.push(child)
    child.once("error", reject)
    child.once("exit", (code, signal) => reject(new Error(`baseline helper exited early (code ${code}, signal ${signal})`)))
    child.stdout!.once("data", () => resolve(child))
  })

const killChildren = async (children: ReadonlyArray<ChildProcess>) => {
  for (const child of children) {
    if (child.exitCode === null && child.signalCode === null) {
      child.kill("SIGKILL")
      await new Promise((r) => child.once("exit", r))
    }
  }
}

const measureRelay = async (lines: ReadonlyArray<string>, n: number): Promise<Result> => {
  const dir = fs.mkdtempSync(path.join(os.tmpdir(), "agentd-bench-relay-"))
  const children: Array<ChildProcess> = []
  const clients: Array<Client> = []
  try {
    const clientPath = path.join(dir, "clients.sock")
    const sourcePath = path.join(dir, "source.sock")
    const linesFile = path.join(dir, "lines.jsonl")
    fs.writeFileSync(linesFile, lines.join(""))
    await startHelper(RELAY_SRC, [clientPath, sourcePath], children)
    for (let i = 0; i < n; i++) clients.push(await Client.connect(clientPath, `relay${n}-${i}`))
    const source = await startHelper(SOURCE_SRC, [sourcePath, linesFile], children)
    const { counts, done } = countOn(clients, lines.length)
    const started = nowMs()
    source.stdin!.write("go\n")
    await withTimeout(done, TURN_TIMEOUT_MS, () => `relay to ${n} clients (got ${counts.join(",")})`)
    const seconds = (nowMs() - started) / 1000
    await sleep(50)
    const wrong = counts.filter((k) => k !== lines.length)
    if (wrong.length > 0) throw new Error(`relay clients received ${wrong.join(",")} lines, expected ${lines.length}`)
    return { clients: n, seconds, perClient: counts }
  } finally {
    for (const c of clients) c.close()
    await killChildren(children)
    fs.rmSync(dir, { recursive: true, force: true })
  }
}

/** The daemon's message_update lines of a WORDS-word turn, rebuilt from one received message. */
const linesLike = (sample: Msg): Array<string> => {
  const out: Array<string> = []
  const cursor = sample["meta"].cursor as { generation: number; sequence: number }
  for (let i = 0; i < EVENTS; i++) {
    out.push(
      JSON.stringify({
        type: "session_event",
        event: { ...sample["event"], delta: i === 0 ? "echo:" : ` w${i - 1}` },
        activeSessionId: sample["activeSessionId"],
        meta: { cursor: { generation: cursor.generation, sequence: cursor.sequence + i }, emittedAt: sample["meta"].emittedAt }
      }) + "\n"
    )
  }
  return out
}

/**
 * The daemon's side: the median run at each of `clientCounts`, and a sample live line.
 * `extraArgs` go to `agentd serve` (bench/storeDelivery.ts: `--store postgres://...`).
 */
export const measureOurs = async (
  extraArgs: ReadonlyArray<string> = [],
  clientCounts: ReadonlyArray<number> = CLIENT_COUNTS
): Promise<{ readonly ours: ReadonlyArray<Result>; readonly sample: Msg }> => {
  const ours: Array<Result> = []
  let sample: Msg | undefined
  let t0 = nowMs()
  await withDaemon(
    // Checkpoints are taken explicitly between runs, never while one is measured.
    { env: { AGENTD_CHECKPOINT_EVENTS: "1000000000", AGENTD_CHECKPOINT_BYTES: String(1024 * 1024 * 1024) }, extraArgs },
    async (daemon) => {
      const ctl = await daemon.connect("ctl")
      const { id } = await createSession(ctl)
      await waitReady(ctl, id)
      phase("daemon start", t0)
      // Warm-up (not timed): a daemon serves for hours, so measure it with its hot paths
      // compiled. It takes V8 about two turns of this size to optimize them (the first turn of
      // a cold daemon runs at about half the speed of the third).
      t0 = nowMs()
      const watcher = await daemon.connect("warmup")
      await watcher.ok({ type: "attach", activeSessionId: id, capabilities: ["event_sequence", "slim_attach"] })
      for (let i = 0; i < WARM_UP_TURNS; i++) await runTurn(watcher, id, message())
      watcher.close()
      phase("warm-up turn", t0)
      for (const n of clientCounts) {
        let t = nowMs()
        await ctl.ok({ type: "checkpoint", activeSessionId: id }, 60_000)
        phase(`checkpoint`, t)
        t = nowMs()
        const runs: Array<Result> = []
        for (let i = 0; i < RUNS; i++) runs.push(await measureDaemon(daemon, ctl, id, n))
        ours.push(median(runs))
        phase(`${RUNS} runs with ${n} clients`, t)
      }
      // A sample of the live lines as the clients saw them (same shape and size class).
      t0 = nowMs()
      const probe = await daemon.connect("sample")
      await probe.ok({ type: "attach", activeSessionId: id, capabilities: ["event_sequence", "slim_attach"] })
      await probe.waitFor((m) => m["type"] === "session_attached", 15_000, "session_attached")
      await ctl.ok({ type: "prompt", activeSessionId: id, message: "w0 w1" })
      sample = await probe.waitFor((m) => isEvent("message_update")(m) && m["event"].delta === " w0", 15_000, "a message_update")
      phase("sample", t0)
      t0 = nowMs()
    }
  )
  phase("daemon stop", t0)
  return { ours, sample: sample! }
}

export default async function delivery(): Promise<void> {
  const { ours, sample } = await measureOurs()
  const lines = linesLike(sample)
  for (const r of ours) {
    const t = nowMs()
    const runs: Array<Result> = []
    for (let i = 0; i < RUNS; i++) runs.push(await measureRelay(lines, r.clients))
    const base = median(runs)
    phase(`${RUNS} relay runs with ${r.clients} clients`, t)
    const rate = (x: Result) => (EVENTS * x.clients) / x.seconds
    const target = TARGETS[r.clients]
    printRatio({
      what: `live delivery of ${EVENTS} message_update events to ${r.clients} client${r.clients === 1 ? "" : "s"} (aggregate)`,
      unit: "events/s",
      ours: rate(r),
      baseline: rate(base),
      baselineName: "node:net relay process, source process -> relay -> clients",
      ...(target === undefined ? {} : { target })
    })
  }
  const avgBytes = lines.reduce((a, l) => a + Buffer.byteLength(l), 0) / lines.length
  console.log(
    `  (${WORDS} words in one turn, ~${Math.round(avgBytes)} bytes per line; time from prompt to the last client's last update; median of ${RUNS} runs each side, after ${WARM_UP_TURNS} warm-up turns)`
  )
  console.log(`  phases (s): ${phases.join(", ")}`)
}
