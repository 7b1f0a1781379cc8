/**
 * Shared helpers of the benchmarks that run the real daemon (`recovery`, `delivery`, `attach`):
 * start `agentd serve` (the built `dist/src/bin/agentd.js`) in a fresh temp dir, talk to it with
 * a plain `node:net` JSON-lines client, wait for messages, and clean everything up.
 *
 * Process hygiene: the daemon is spawned detached (its own process group) with a unique marker
 * in its environment (`AGENTD_BENCH_MARK`, inherited by its workers). `Daemon.cleanup` SIGKILLs
 * the daemon's process group, every descendant found in /proc, every process carrying the
 * marker and every worker pid the bench recorded, then removes the temp dir. `withDaemon` runs
 * it in a `finally`, and an `exit` hook kills whatever a crashed bench left behind.
 *
 * Independent of the project's own client code on purpose: the figures are what a plain client
 * of the wire protocol sees.
 */
import { type ChildProcess, spawn } from "node:child_process"
import { randomUUID } from "node:crypto"
import * as fs from "node:fs"
import * as net from "node:net"
import * as os from "node:os"
import * as path from "node:path"
import { fileURLToPath } from "node:url"
import { Inbox } from "../test/support/inbox.js"
import { cpuTicksOf, descendantsOf, isAlive, killQuietly, processesWithEnv } from "../test/support/procfs.js"
import { withTimeout } from "../test/support/timeout.js"

/** Re-exported for the benchmarks that import their helpers from here. */
export { withTimeout }

const here = path.dirname(fileURLToPath(import.meta.url))
/** The built daemon: dist/src/bin/agentd.js (from dist/bench, or from bench/ when run with tsx). */
export const DAEMON_BIN = process.env["AGENTD_BENCH_BIN"] ??
  (path.basename(path.dirname(here)) === "dist"
    ? path.resolve(here, "..", "src", "bin", "agentd.js")
    : path.resolve(here, "..", "dist", "src", "bin", "agentd.js"))

const START_TIMEOUT_MS = 20_000
export const DEFAULT_WAIT_MS = 15_000
export const MiB = 1024 * 1024

export const sleep = (ms: number): Promise<void> => new Promise((resolve) => setTimeout(resolve, ms))

export const nowMs = (): number => Number(process.hrtime.bigint()) / 1e6

// eslint-disable-next-line @typescript-eslint/no-explicit-any
export type Msg = Record<string, any>

// ---------------------------------------------------------------------------------------------
// /proc helpers (the shared ones are in test/support/procfs.ts)
// ---------------------------------------------------------------------------------------------

export { descendantsOf, isAlive }

/**
 * Waits until every process in `pids` is idle: blocked in epoll_wait and using no CPU over
 * `quietMs` (a started Node process waiting for input). Returns false at the timeout.
 */
export const waitIdleProcesses = async (pids: ReadonlyArray<number>, quietMs = 60, timeoutMs = 10_000): Promise<boolean> => {
  const deadline = Date.now() + timeoutMs
  let last = pids.map(cpuTicksOf)
  while (Date.now() < deadline) {
    await sleep(quietMs)
    const now = pids.map(cpuTicksOf)
    const idle = pids.every((pid, i) => {
      if (now[i] === undefined) return true
      let wchan = ""
      try {
        wchan = fs.readFileSync(`/proc/${pid}/wchan`, "utf8")
      } catch {
        return true
      }
      return now[i] === last[i] && wchan.includes("epoll")
    })
    if (idle) return true
    last = now
  }
  return false
}

/** A `kB` field of /proc/<pid>/status in bytes (NaN when the process is gone). */
const statusBytes = (pid: number, field: "VmRSS" | "VmHWM"): number => {
  try {
    const m = new RegExp(`${field}:\\s+(\\d+)\\s+kB`).exec(fs.readFileSync(`/proc/${pid}/status`, "utf8"))
    return m === null ? NaN : Number(m[1]) * 1024
  } catch {
    return NaN
  }
}

/** VmRSS of a process in bytes (NaN when it is gone). */
export const rssOf = (pid: number): number => statusBytes(pid, "VmRSS")

/** VmHWM (peak RSS over the process's life) in bytes (NaN when it is gone). */
export const hwmOf = (pid: number): number => statusBytes(pid, "VmHWM")

/** Samples a process's RSS every `everyMs` until stopped; returns the samples' max and count. */
export const sampleRss = (pid: number, everyMs = 20): { stop: () => { peak: number; samples: number } } => {
  let peak = rssOf(pid)
  let samples = 1
  const timer = setInterval(() => {
    const v = rssOf(pid)
    samples++
    if (v > peak) peak = v
  }, everyMs)
  return {
    stop: () => {
      clearInterval(timer)
      const v = rssOf(pid)
      if (v > peak) peak = v
      return { peak, samples: samples + 1 }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// The client
// ---------------------------------------------------------------------------------------------

/**
 * Called for every complete line before it is parsed, with the first (up to 160) bytes of the
 * line decoded and its length in bytes (without `\n`). Returning true consumes the line: it is
 * neither concatenated nor parsed (cheap counting of bulk traffic).
 */
export type RawLineHook = (prefix: string, bytes: number) => boolean

const PREFIX_BYTES = 160

/**
 * A line-based JSON client over a Unix socket. Messages not consumed by `rawHook` are parsed
 * and queued; `waitFor` removes and returns the first queued message that matches (waiting for
 * one if needed).
 */
export class Client {
  rawHook: RawLineHook | undefined
  /**
   * Called with every parsed message before it is queued; returning true consumes it (a bench
   * that parses what it counts, as a real client does, without queueing it).
   */
  messageHook: ((msg: Msg) => boolean) | undefined
  /** Called with every line's bytes that is parsed (not consumed by `rawHook`), before the parse. */
  lineTap: ((line: Buffer) => void) | undefined
  /** Bytes received (all lines, newlines included). */
  bytesReceived = 0
  badLines = 0
  error: Error | undefined
  closed = false
  private parts: Array<Buffer> = []
  private partsBytes = 0
  private recent: Array<string> = []
  private readonly inbox: Inbox<Msg>
  private nextId = 0

  constructor(readonly socket: net.Socket, readonly label: string) {
    this.inbox = new Inbox(label, () => `closed=${this.closed}; last: ${this.recent.join(", ")}`)
    socket.on("data", (data: Buffer) => this.onData(data))
    socket.on("error", (e) => {
      this.error = e
    })
    socket.on("close", () => {
      this.closed = true
      // Nothing more will arrive: fail every wait now rather than at its timeout.
      this.inbox.failWaits(new Error(`[${this.label}] the connection closed; last: ${this.recent.join(", ")}`))
    })
  }

  static connect(socketPath: string, label = "client", awaitHello = true): Promise<Client> {
    return new Promise((resolve, reject) => {
      const socket = net.createConnection({ path: socketPath })
      const client = new Client(socket, label)
      socket.once("error", reject)
      socket.once("connect", () => {
        socket.off("error", reject)
        if (!awaitHello) return resolve(client)
        client.waitFor((m) => m["type"] === "daemon_hello", START_TIMEOUT_MS, "daemon_hello").then(() => resolve(client), reject)
      })
    })
  }

  private onData(data: Buffer): void {
    this.bytesReceived += data.length
    let start = 0
    for (;;) {
      const nl = data.indexOf(0x0a, start)
      if (nl < 0) break
      const piece = data.subarray(start, nl)
      let parts: Array<Buffer>
      let bytes: number
      if (this.parts.length === 0) {
        parts = [piece]
        bytes = piece.length
      } else {
        this.parts.push(piece)
        parts = this.parts
        bytes = this.partsBytes + piece.length
        this.parts = []
        this.partsBytes = 0
      }
      this.onLine(parts, bytes)
      start = nl + 1
    }
    if (start < data.length) {
      const rest = data.subarray(start)
      this.parts.push(rest)
      this.partsBytes += rest.length
    }
  }

  private onLine(parts: Array<Buffer>, bytes: number): void {
    if (bytes === 0) return
    if (this.rawHook !== undefined) {
      let head = parts[0]!
      if (head.length < PREFIX_BYTES && parts.length > 1) {
        // Only the first bytes: never join a whole (possibly huge) line for its prefix.
        const first: Array<Buffer> = []
        let n = 0
        for (const part of parts) {
          first.push(part)
          n += part.length
          if (n >= PREFIX_BYTES) break
        }
        head = Buffer.concat(first)
      }
      if (this.rawHook(head.toString("utf8", 0, Math.min(head.length, PREFIX_BYTES)), bytes)) return
    }
    const line = parts.length === 1 ? parts[0]! : Buffer.concat(parts, bytes)
    this.lineTap?.(line)
    let msg: Msg
    try {
      msg = JSON.parse(line.toString("utf8")) as Msg
    } catch {
      this.badLines++
      return
    }
    if (this.messageHook?.(msg) === true) return
    this.recent.push(describe(msg))
    if (this.recent.length > 12) this.recent.shift()
    this.inbox.deliver(msg)
  }

  send(obj: unknown): void {
    this.socket.write(JSON.stringify(obj) + "\n")
  }

  /** Sends a bare command with a fresh id; returns the id. */
  sendCommand(command: Msg): string {
    const id = `${this.label}-${++this.nextId}`
    this.send({ ...command, id })
    return id
  }

  /** Sends a bare command and waits for its response. */
  request(command: Msg, timeoutMs = DEFAULT_WAIT_MS): Promise<Msg> {
    const id = this.sendCommand(command)
    return this.waitFor((m) => m["type"] === "response" && m["id"] === id, timeoutMs, `response to ${command["type"]}`)
  }

  /** Like `request`, but throws unless the command succeeded; returns its `data`. */
  async ok(command: Msg, timeoutMs = DEFAULT_WAIT_MS): Promise<Msg> {
    const r = await this.request(command, timeoutMs)
    if (r["success"] !== true) throw new Error(`[${this.label}] ${command["type"]} failed: ${JSON.stringify(r["error"])}`)
    return r["data"] as Msg
  }

  waitFor(pred: (m: Msg) => boolean, timeoutMs = DEFAULT_WAIT_MS, what = "message"): Promise<Msg> {
    // Nothing more will arrive on a closed connection: only what is already queued can match.
    if (this.closed) {
      const taken = this.inbox.take(pred)
      if (taken !== undefined) return Promise.resolve(taken)
      return Promise.reject(new Error(`[${this.label}] the connection is closed (waiting for ${what}); last: ${this.recent.join(", ")}`))
    }
    return this.inbox.waitFor(pred, timeoutMs, what)
  }

  /** Forgets every queued message. */
  drain(): void {
    this.inbox.drain()
  }

  close(): void {
    this.socket.destroy()
  }
}

/** A compact description of a message for error output. */
export const describe = (m: Msg): string => {
  const c = m["meta"]?.cursor
  const cur = c !== undefined ? `@${c.generation}:${c.sequence}` : ""
  switch (m["type"]) {
    case "session_event":
      return `ev:${m["event"]?.type}${cur}`
    case "session_status":
      return `status(busy=${m["state"]?.busy},worker=${m["state"]?.worker})${cur}`
    case "response":
      return `resp(${m["id"]},${m["command"]},${m["success"] === true ? "ok" : m["error"]?.code})`
    default:
      return `${m["type"]}${cur}`
  }
}

export const isEvent = (type: string) => (m: Msg): boolean => m["type"] === "session_event" && m["event"]?.type === type

export const isIdleStatus = (m: Msg): boolean => m["type"] === "session_status" && m["state"]?.busy === false

export interface Cursor {
  readonly generation: number
  readonly sequence: number
}

export const cursorAfter = (a: Cursor | undefined, b: Cursor | undefined): boolean =>
  a !== undefined && (b === undefined || a.generation > b.generation || (a.generation === b.generation && a.sequence > b.sequence))


/**
 * The end of one turn on each of `clients` clients, told by their hooks (which see the events
 * as the bench reads them: parsed, or a line's first bytes): `ended()` at a client's
 * `agent_end`, `interrupted()` at a `turn_interrupted`. `wait` resolves once every client has
 * ended, and rejects at an interruption or after `ms`.
 */
export class TurnEnds {
  /** How many clients have seen `agent_end`. */
  count = 0
  private readonly done: Promise<void>
  private resolve!: () => void
  private reject!: (e: Error) => void

  constructor(readonly clients: number) {
    this.done = new Promise<void>((resolve, reject) => {
      this.resolve = resolve
      this.reject = reject
    })
    // An interruption seen before `wait` is called is its answer, not an unhandled rejection.
    this.done.catch(() => {})
  }

  ended(): void {
    if (++this.count === this.clients) this.resolve()
  }

  interrupted(): void {
    this.reject(new Error("the turn was interrupted"))
  }

  wait(ms: number): Promise<void> {
    return withTimeout(this.done, ms, () => `agent_end on ${this.count} of ${this.clients} clients`)
  }
}

/**
 * Runs one prompt on `client` (attached to the session) and waits for the end of the turn:
 * `agent_end` then the `busy: false` status that follows it. Throws on an interrupted turn.
 * The sequenced messages of the turn are left in the client's queue only if unmatched; call
 * `client.drain()` afterwards when they are of no interest.
 */
export const runTurn = async (client: Client, activeSessionId: string, message: string, timeoutMs = 60_000): Promise<void> => {
  await client.ok({ type: "prompt", activeSessionId, message }, timeoutMs)
  const end = await client.waitFor(
    (m) => m["activeSessionId"] === activeSessionId && (isEvent("agent_end")(m) || isEvent("turn_interrupted")(m)),
    timeoutMs,
    "end of turn"
  )
  if (isEvent("turn_interrupted")(end)) throw new Error(`turn interrupted: ${JSON.stringify(end["event"])}`)
  const endCursor = end["meta"]?.cursor as Cursor | undefined
  await client.waitFor(
    (m) => m["activeSessionId"] === activeSessionId && isIdleStatus(m) && cursorAfter(m["meta"]?.cursor, endCursor),
    timeoutMs,
    "idle status after agent_end"
  )
}

// ---------------------------------------------------------------------------------------------
// The daemon
// ---------------------------------------------------------------------------------------------

const live = new Set<Daemon>()
let exitHookInstalled = false

const installExitHook = () => {
  if (exitHookInstalled) return
  exitHookInstalled = true
  // Last resort (a bench threw past its finally, or the process is exiting): kill synchronously.
  process.once("exit", () => {
    for (const d of live) {
      d.killAllSync()
      d.removeRootSync()
    }
  })
  // The daemons run in their own sessions: a Ctrl-C of the bench would not reach them.
  for (const signal of ["SIGINT", "SIGTERM", "SIGHUP"] as const) {
    process.once(signal, () => {
      for (const d of live) d.killAllSync()
      // The exit hook removes the temp dirs.
      process.exit(128 + (signal === "SIGINT" ? 2 : signal === "SIGTERM" ? 15 : 1))
    })
  }
}

export interface StartOptions {
  /** AGENTD_* settings and the like, merged over the bench's environment. */
  readonly env?: Readonly<Record<string, string>>
  readonly extraArgs?: ReadonlyArray<string>
  /** Another build's `agentd.js` (default {@link DAEMON_BIN}), to compare two builds in one run. */
  readonly bin?: string
  /** Node's flags for the daemon itself (e.g. `--cpu-prof`). */
  readonly nodeArgs?: ReadonlyArray<string>
}

/**
 * AGENTD_BENCH_DAEMON_NODE_ARGS: Node flags for the daemon under a benchmark (e.g. `--cpu-prof
 * --cpu-prof-dir=/tmp/p`), as {@link DaemonOptions.nodeArgs}; none when unset.
 */
export const benchDaemonNodeArgs = (): ReadonlyArray<string> =>
  (process.env["AGENTD_BENCH_DAEMON_NODE_ARGS"] ?? "").split(" ").filter((a) => a !== "")

/**
 * Under AGENTD_BENCH_DAEMON_NODE_ARGS, stops the daemon with `shutdown` and waits for its exit:
 * Node writes a profile (--cpu-prof) at a normal exit only, not at the cleanup's SIGKILL. What
 * the daemon printed goes to AGENTD_BENCH_DAEMON_LOG's file when that is set (e.g. --trace-deopt).
 */
export const stopForProfile = async (daemon: Daemon, ctl: Client): Promise<void> => {
  if (process.env["AGENTD_BENCH_DAEMON_LOG"] !== undefined) fs.writeFileSync(process.env["AGENTD_BENCH_DAEMON_LOG"], daemon.stderrTail(1e9))
  if (benchDaemonNodeArgs().length === 0) return
  daemon.stopping = true
  const processes = daemon.processes()
  await ctl.ok({ type: "shutdown" }, 60_000).catch(() => undefined)
  await Promise.race([daemon.exited, sleep(30_000)])
  // Profiled workers (AGENTD_BENCH_WORKER_NODE_ARGS=--cpu-prof) write their profiles as they exit,
  // after the daemon: the cleanup's SIGKILL would lose them.
  if (/--cpu-prof/.test(process.env["AGENTD_BENCH_WORKER_NODE_ARGS"] ?? "")) {
    const deadline = Date.now() + 30_000
    while (Date.now() < deadline && processes.some(isAlive)) await sleep(50)
  }
  if (process.env["AGENTD_BENCH_DAEMON_LOG"] !== undefined) fs.writeFileSync(process.env["AGENTD_BENCH_DAEMON_LOG"], daemon.stderrTail(1e9))
}

export class Daemon {
  readonly clients: Array<Client> = []
  readonly recordedWorkerPids = new Set<number>()
  private readonly stderrChunks: Array<string> = []
  exitCode: number | null = null
  exitSignal: NodeJS.Signals | null = null
  readonly exited: Promise<void>
  /** Set once the bench itself stops the daemon (an exit before that is unexpected). */
  stopping = false

  constructor(
    readonly proc: ChildProcess,
    /** The temp dir this daemon owns (removed by cleanup). */
    readonly root: string,
    readonly stateDir: string,
    readonly socketPath: string,
    readonly mark: string
  ) {
    const keep = (d: string) => {
      this.stderrChunks.push(d)
      if (this.stderrChunks.length > 4000) this.stderrChunks.splice(0, 2000)
    }
    proc.stderr?.setEncoding("utf8")
    proc.stderr?.on("data", keep)
    proc.stdout?.setEncoding("utf8")
    proc.stdout?.on("data", (d: string) => keep(`[stdout] ${d}`))
    this.exited = new Promise((resolve) => {
      proc.once("exit", (code, signal) => {
        this.exitCode = code
        this.exitSignal = signal
        if (!this.stopping) {
          console.error(`  !! daemon ${proc.pid} exited on its own or by a signal from outside this bench (code ${code}, signal ${signal})`)
        }
        resolve()
      })
    })
  }

  get pid(): number {
    return this.proc.pid!
  }

  get running(): boolean {
    return this.exitCode === null && this.exitSignal === null
  }

  /** The tail of the daemon's log (stderr). */
  stderrTail(chars = 3000): string {
    return this.stderrChunks.join("").slice(-chars)
  }

  async connect(label = "client"): Promise<Client> {
    const c = await Client.connect(this.socketPath, label)
    this.clients.push(c)
    return c
  }

  /** Remembers a worker pid (from a SessionSummary) so cleanup kills it even if orphaned. */
  recordWorker(summary: Msg | undefined): void {
    const pid = summary?.["workerPid"]
    if (typeof pid === "number") this.recordedWorkerPids.add(pid)
  }

  /** Everything of this daemon alive now (daemon, workers, spares). */
  processes(): Array<number> {
    const set = new Set<number>()
    if (this.running) {
      set.add(this.pid)
      for (const p of descendantsOf(this.pid)) set.add(p)
    }
    for (const p of processesWithEnv("AGENTD_BENCH_MARK", this.mark)) set.add(p)
    for (const p of this.recordedWorkerPids) if (isAlive(p)) set.add(p)
    return [...set]
  }

  /** Synchronous kill of the group and known processes (exit hook). */
  killAllSync(): void {
    this.stopping = true
    for (const c of this.clients) c.close()
    try {
      process.kill(-this.pid, "SIGKILL")
    } catch {
      // no such group
    }
    for (const p of this.processes()) killQuietly(p, "SIGKILL")
  }

  /** Removes the temp dir (best effort; the processes must be gone). */
  removeRootSync(): void {
    try {
      fs.rmSync(this.root, { recursive: true, force: true })
    } catch {
      // a worker killed a moment ago may still be writing; nothing more to do at exit
    }
  }

  /** Kills the daemon and all its workers with SIGKILL and removes the temp dir. Never throws. */
  async cleanup(): Promise<void> {
    try {
      this.killAllSync()
      if (this.running) await Promise.race([this.exited, sleep(5_000)])
      // Anything spawned at the last moment.
      for (const p of processesWithEnv("AGENTD_BENCH_MARK", this.mark)) killQuietly(p, "SIGKILL")
      const deadline = Date.now() + 3_000
      while (Date.now() < deadline && processesWithEnv("AGENTD_BENCH_MARK", this.mark).length > 0) await sleep(25)
      const left = processesWithEnv("AGENTD_BENCH_MARK", this.mark)
      if (left.length > 0) console.error(`  (cleanup: processes still alive after SIGKILL: ${left.join(", ")})`)
    } finally {
      live.delete(this)
      try {
        fs.rmSync(this.root, { recursive: true, force: true })
      } catch (e) {
        console.error(`  (cleanup: cannot remove ${this.root}: ${String(e)})`)
      }
    }
  }
}

/** Starts `agentd serve --state-dir <tmp>/state` and waits until its socket greets. */
export const startDaemon = async (options: StartOptions = {}): Promise<Daemon> => {
  const bin = options.bin ?? DAEMON_BIN
  if (!fs.existsSync(bin)) throw new Error(`${bin} does not exist: run \`npm run build\` first`)
  const root = fs.mkdtempSync(path.join(os.tmpdir(), "agentd-bench-"))
  const stateDir = path.join(root, "state")
  const socketPath = path.join(stateDir, "agentd.sock")
  const mark = randomUUID()
  const env: Record<string, string> = {}
  for (const [k, v] of Object.entries(process.env)) {
    if (v === undefined || k.startsWith("AGENTD_") || k === "NODE_OPTIONS") continue
    env[k] = v
  }
  // AGENTD_BENCH_WORKER_NODE_ARGS: Node flags for every daemon's workers (to measure or profile them).
  const workerNodeArgs = process.env["AGENTD_BENCH_WORKER_NODE_ARGS"]
  if (workerNodeArgs !== undefined) env["AGENTD_WORKER_NODE_ARGS"] = workerNodeArgs
  Object.assign(env, options.env ?? {}, { AGENTD_BENCH_MARK: mark })
  const proc = spawn(process.execPath, [...(options.nodeArgs ?? []), bin, "serve", "--state-dir", stateDir, ...(options.extraArgs ?? [])], {
    cwd: root,
    env,
    stdio: ["ignore", "pipe", "pipe"],
    detached: true
  })
  const daemon = new Daemon(proc, root, stateDir, socketPath, mark)
  live.add(daemon)
  installExitHook()
  const deadline = Date.now() + START_TIMEOUT_MS
  let lastError: unknown
  while (Date.now() < deadline) {
    if (!daemon.running) {
      await daemon.cleanup()
      throw new Error(`daemon exited during start-up (code ${daemon.exitCode}, signal ${daemon.exitSignal}):\n${daemon.stderrTail()}`)
    }
    if (fs.existsSync(socketPath)) {
      try {
        const probe = await Client.connect(socketPath, "probe")
        probe.close()
        return daemon
      } catch (e) {
        lastError = e
      }
    }
    await sleep(30)
  }
  await daemon.cleanup()
  throw new Error(`daemon did not greet within ${START_TIMEOUT_MS} ms (${String(lastError)}):\n${daemon.stderrTail()}`)
}

/** Runs `f` with a fresh daemon; always cleans up (daemon, workers, temp dir). */
export const withDaemon = async <A>(options: StartOptions, f: (d: Daemon) => Promise<A>): Promise<A> => {
  const daemon = await startDaemon(options)
  try {
    return await f(daemon)
  } catch (e) {
    // Say what the daemon logged: a bench failure is often a daemon problem.
    const state = daemon.running ? "running" : `exited: code ${daemon.exitCode}, signal ${daemon.exitSignal}`
    console.error(`  daemon log tail (pid ${daemon.pid}, ${state}):\n${daemon.stderrTail(2000)}`)
    throw e
  } finally {
    await daemon.cleanup()
  }
}

/** Creates a session; returns its id and summary. */
export const createSession = async (client: Client, fields: Msg = {}): Promise<{ id: string; state: Msg }> => {
  const data = await client.ok({ type: "create", ...fields })
  return { id: data["activeSessionId"] as string, state: data["state"] as Msg }
}

/** Polls get_state until the session's worker is ready and it is not busy. */
export const waitReady = async (client: Client, activeSessionId: string, timeoutMs = DEFAULT_WAIT_MS): Promise<Msg> => {
  const deadline = Date.now() + timeoutMs
  for (;;) {
    const s = await client.ok({ type: "get_state", activeSessionId })
    if (s["worker"] === "ready" && s["busy"] === false) return s
    if (Date.now() > deadline) throw new Error(`session ${activeSessionId} not ready after ${timeoutMs} ms: ${JSON.stringify(s)}`)
    await sleep(20)
  }
}

// ---------------------------------------------------------------------------------------------
// Reporting of latencies (lower is better, unlike printRatio's rates)
// ---------------------------------------------------------------------------------------------

const fmtMs = (n: number): string => (n >= 100 ? Math.round(n).toString() : n.toFixed(1))

/** Prints one latency figure next to its same-run baseline; ratio = agentd / baseline (lower is better). */
export const printLatency = (r: {
  readonly what: string
  readonly median: number
  readonly p95: number
  readonly baselineMedian: number
  readonly baselineName: string
  /** Absolute target for the median, in ms. */
  readonly targetMedianMs?: number
}): void => {
  const ratio = r.median / r.baselineMedian
  const verdict = r.targetMedianMs === undefined
    ? ""
    : `  (target median <= ${r.targetMedianMs} ms: ${r.median <= r.targetMedianMs ? "met" : "MISSED"})`
  console.log(
    `${r.what}: agentd median ${fmtMs(r.median)} ms, p95 ${fmtMs(r.p95)} ms | baseline (${r.baselineName}) median ` +
      `${fmtMs(r.baselineMedian)} ms | ratio median/baseline ${ratio.toFixed(2)}x (lower is better)${verdict}`
  )
}
