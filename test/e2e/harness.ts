/**
 * End-to-end harness: starts the real `agentd serve` (the built `dist/src/bin/agentd.js`) in a
 * fresh temporary state dir and talks to it with a plain line-based client on `node:net`.
 *
 * Deliberately independent of the project's own client and protocol code: the point is to check
 * the wire contract (docs/protocol.md) from the outside.
 *
 * Process hygiene: every daemon gets a unique marker in its environment (`AGENTD_E2E_MARK`),
 * which workers inherit; cleanup kills, with SIGKILL, the daemon, its process group, every
 * descendant found by walking /proc, every process whose environment carries the marker, and
 * every worker pid recorded from `status` / `get_state`. `useDaemon` registers that cleanup with
 * `onTestFinished`, so it runs whether the test passed or not.
 */
import { type ChildProcess, spawn } from "node:child_process"
import { randomUUID } from "node:crypto"
import * as fs from "node:fs"
import * as net from "node:net"
import * as os from "node:os"
import * as path from "node:path"
import { fileURLToPath } from "node:url"
import { afterAll, afterEach, beforeAll, onTestFinished } from "vitest"
import { Inbox } from "../support/inbox.js"
import { freshSchemaUrl } from "../support/postgres.js"
import { descendantsOf, isAlive, killQuietly, processesWithEnv } from "../support/procfs.js"

export { isAlive }

// ---------------------------------------------------------------------------------------------
// Paths and constants
// ---------------------------------------------------------------------------------------------

const here = path.dirname(fileURLToPath(import.meta.url))
export const PROJECT_ROOT = path.resolve(here, "..", "..")
/** The daemon under test; `AGENTD_E2E_BIN` may point at another build. */
export const DAEMON_BIN = process.env["AGENTD_E2E_BIN"] ?? path.join(PROJECT_ROOT, "dist", "src", "bin", "agentd.js")

export const PROTOCOL = { name: "agentd", version: 1 } as const
export const MAX_LINE_BYTES = 16 * 1024 * 1024

/** How long a daemon may take to start listening and greet. */
const START_TIMEOUT_MS = 20_000
/** Default wait of `waitFor` / `request`. */
export const DEFAULT_WAIT_MS = 10_000

// ---------------------------------------------------------------------------------------------
// Small utilities
// ---------------------------------------------------------------------------------------------

export const sleep = (ms: number): Promise<void> => new Promise((resolve) => setTimeout(resolve, ms))

/**
 * The records of a state dir's recovery journal once it is compacted (one line per session):
 * the daemon compacts it a moment after every session went idle. Fails after 10 s.
 */
export const compactedJournal = async (stateDir: string): Promise<Array<Record<string, unknown>>> => {
  const journal = path.join(stateDir, "recovery.jsonl")
  let ids: Array<unknown> = []
  for (let i = 0; i < 200; i++) {
    const records = fs.existsSync(journal)
      ? fs.readFileSync(journal, "utf8").split("\n").filter((l) => l.trim() !== "").map((l) => JSON.parse(l) as Record<string, unknown>)
      : []
    ids = records.map((r) => r["activeSessionId"])
    if (new Set(ids).size === ids.length) return records
    await sleep(50)
  }
  throw new Error(`the journal of ${stateDir} was never compacted: ${ids.join(", ")}`)
}

/** JSON-ish value as read from the wire (tests inspect it freely). */
// eslint-disable-next-line @typescript-eslint/no-explicit-any
export type Msg = Record<string, any>

export interface Cursor {
  readonly generation: number
  readonly sequence: number
}

export const compareCursor = (a: Cursor, b: Cursor): number =>
  a.generation !== b.generation ? a.generation - b.generation : a.sequence - b.sequence

export const fmtCursor = (c: Cursor | undefined): string => (c === undefined ? "-" : `${c.generation}:${c.sequence}`)

/** Messages that carry `meta.cursor` (section 4). */
export const SEQUENCED_TYPES = new Set(["session_event", "session_status", "session_closed"])

export const isSequenced = (m: Msg): boolean => SEQUENCED_TYPES.has(m["type"])

/** A compact description of a message for failure output. */
export const describeMsg = (m: Msg): string => {
  const t = m["type"]
  const c = m["meta"]?.cursor as Cursor | undefined
  const cur = c !== undefined ? `@${fmtCursor(c)}${m["meta"]?.replayed === true ? "r" : ""}` : ""
  switch (t) {
    case "session_event": {
      const e = m["event"] ?? {}
      const extra = e.type === "turn_interrupted" ? `(${e.reason})` : e.type === "message_update" ? `(${String(e.delta).slice(0, 20)})` : ""
      return `ev:${e.type}${extra}${cur}`
    }
    case "session_status":
      return `status(busy=${m["state"]?.busy},worker=${m["state"]?.worker})${cur}`
    case "response":
      return `resp(${m["id"]},${m["command"]},${m["success"] === true ? "ok" : m["error"]?.code})`
    default:
      return `${t}${cur}`
  }
}

/** Waits until none of `pids` is alive; returns the ones still alive at the deadline. */
export const waitGone = async (pids: ReadonlyArray<number>, timeoutMs: number): Promise<Array<number>> => {
  const deadline = Date.now() + timeoutMs
  for (;;) {
    const alive = pids.filter(isAlive)
    if (alive.length === 0 || Date.now() >= deadline) return alive
    await sleep(25)
  }
}

// ---------------------------------------------------------------------------------------------
// The client
// ---------------------------------------------------------------------------------------------

export interface ClientOptions {
  /** Wait for and consume `daemon_hello` before returning (default true). */
  readonly awaitHello?: boolean
}

let idCounter = 0
export const nextId = (prefix = "r"): string => `${prefix}-${++idCounter}-${randomUUID().slice(0, 8)}`

/**
 * A line-based JSON client. Every message received is kept in `all` (arrival order) and in a
 * pending queue; `waitFor` removes and returns the first pending message that matches, waiting
 * for it if needed, so several waits can interleave without stealing each other's messages.
 */
export class Client {
  /** Every message received, in arrival order. */
  readonly all: Array<Msg> = []
  /** Lines that were not JSON (should never happen). */
  readonly badLines: Array<string> = []
  /** Byte length (without `\n`) of the line each message came on. */
  readonly lineBytes = new WeakMap<Msg, number>()
  private readonly inbox: Inbox<Msg>
  private chunks: Array<Buffer> = []
  private closedFlag = false
  private endWaiters: Array<() => void> = []
  error: Error | undefined
  hello: Msg | undefined

  constructor(readonly socket: net.Socket, readonly label: string) {
    this.inbox = new Inbox(label, () =>
      `closed=${this.closedFlag}; ${this.all.length} received, last: ${this.all.slice(-15).map(describeMsg).join(", ")}`)
    socket.on("data", (data: Buffer) => this.onData(data))
    socket.on("end", () => {
      this.flushTail()
    })
    socket.on("close", () => {
      this.closedFlag = true
      for (const w of this.endWaiters.splice(0)) w()
    })
    socket.on("error", (e) => {
      this.error = e
    })
  }

  static connect(socketPath: string, label = "client", options: ClientOptions = {}): Promise<Client> {
    return new Promise((resolve, reject) => {
      const socket = net.createConnection({ path: socketPath })
      const client = new Client(socket, label)
      const onError = (e: Error) => reject(e)
      socket.once("error", onError)
      socket.once("connect", () => {
        socket.off("error", onError)
        if (options.awaitHello === false) return resolve(client)
        client
          .waitFor((m) => m["type"] === "daemon_hello", START_TIMEOUT_MS, "daemon_hello")
          .then((hello) => {
            client.hello = hello
            resolve(client)
          }, reject)
      })
    })
  }

  get closed(): boolean {
    return this.closedFlag
  }

  /** Resolves when the socket has closed (or at the timeout, with false). */
  waitClosed(timeoutMs = DEFAULT_WAIT_MS): Promise<boolean> {
    if (this.closedFlag) return Promise.resolve(true)
    return new Promise((resolve) => {
      const t = setTimeout(() => resolve(false), timeoutMs)
      this.endWaiters.push(() => {
        clearTimeout(t)
        resolve(true)
      })
    })
  }

  private onData(data: Buffer): void {
    let start = 0
    for (;;) {
      const nl = data.indexOf(0x0a, start)
      if (nl < 0) break
      const piece = data.subarray(start, nl)
      const line = this.chunks.length === 0 ? piece : Buffer.concat([...this.chunks, piece])
      this.chunks = []
      this.onLine(line)
      start = nl + 1
    }
    if (start < data.length) this.chunks.push(Buffer.from(data.subarray(start)))
  }

  private flushTail(): void {
    if (this.chunks.length > 0) {
      const line = Buffer.concat(this.chunks)
      this.chunks = []
      this.onLine(line)
    }
  }

  private onLine(line: Buffer): void {
    if (line.length === 0) return
    const text = line.toString("utf8")
    let msg: Msg
    try {
      msg = JSON.parse(text) as Msg
    } catch {
      this.badLines.push(text.slice(0, 500))
      return
    }
    this.lineBytes.set(msg, line.length)
    this.all.push(msg)
    this.inbox.deliver(msg)
  }

  /** Writes one JSON value as a line. */
  send(obj: unknown): void {
    this.socket.write(JSON.stringify(obj) + "\n")
  }

  /** Writes raw bytes (no newline added). */
  sendRaw(bytes: string | Buffer | Uint8Array): Promise<void> {
    return new Promise((resolve, reject) => {
      this.socket.write(bytes, (e) => (e ? reject(e) : resolve()))
    })
  }

  /** Sends a command in envelope form and returns its id. */
  sendCommand(command: Msg, id: string = nextId(command["type"])): string {
    this.send({ type: "command", id, protocol: PROTOCOL, command })
    return id
  }

  /** Sends a command (envelope form) and waits for the response with its id. */
  async request(command: Msg, timeoutMs = DEFAULT_WAIT_MS): Promise<Msg> {
    const id = this.sendCommand(command)
    return this.waitFor((m) => m["type"] === "response" && m["id"] === id, timeoutMs, `response to ${command["type"]} ${id}`)
  }

  /** Like `request` but fails unless the response is a success; returns its `data`. */
  async ok(command: Msg, timeoutMs = DEFAULT_WAIT_MS): Promise<Msg> {
    const r = await this.request(command, timeoutMs)
    if (r["success"] !== true) {
      throw new Error(`${command["type"]} failed: ${JSON.stringify(r["error"])}`)
    }
    return r["data"] as Msg
  }

  /** Waits for a response with this id (to a raw/bare line the test wrote itself). */
  response(id: string | null, timeoutMs = DEFAULT_WAIT_MS): Promise<Msg> {
    return this.waitFor((m) => m["type"] === "response" && m["id"] === id, timeoutMs, `response ${id}`)
  }

  /**
   * Removes and returns the first received-but-unclaimed message matching `pred`, waiting up to
   * `timeoutMs` for one to arrive.
   */
  waitFor(pred: (m: Msg) => boolean, timeoutMs = DEFAULT_WAIT_MS, what = "message"): Promise<Msg> {
    return this.inbox.waitFor(pred, timeoutMs, what)
  }

  /** Returns (without consuming) every message received so far that matches. */
  received(pred: (m: Msg) => boolean = () => true): Array<Msg> {
    return this.all.filter(pred)
  }

  /** Sequenced messages of a session received so far, in arrival order. */
  sequenced(activeSessionId: string): Array<Msg> {
    return this.all.filter((m) => isSequenced(m) && m["activeSessionId"] === activeSessionId)
  }

  /** Clears the pending queue (the `all` log is kept). */
  drain(): void {
    this.inbox.drain()
  }

  /** Ends the write side (half-close). */
  end(): void {
    this.socket.end()
  }

  close(): void {
    this.socket.destroy()
  }
}

// ---------------------------------------------------------------------------------------------
// The daemon
// ---------------------------------------------------------------------------------------------

export interface StartOptions {
  /** Reuse this state dir (for restarts); default: a new dir `<mkdtemp>/state` that does not exist yet. */
  readonly stateDir?: string
  /** A daemon shared by the tests of a block (see `sharedDaemon`): `cleanupAllDaemons` spares it. */
  readonly shared?: boolean
  /** Run the daemon in this network namespace (`ip netns exec NAME node ...`; the same pid). */
  readonly netns?: string
  /** Passed as `--socket`; the harness then waits on that path. */
  readonly socket?: string
  readonly extraArgs?: ReadonlyArray<string>
  readonly env?: Readonly<Record<string, string>>
  /**
   * Runs the daemon (and its workers) under `ulimit -f` with SIGXFSZ ignored: writes past this
   * many KiB fail with EFBIG (a full disk, as far as the daemon can tell).
   */
  readonly fileSizeLimitKiB?: number
  /** Runs the daemon (and its workers) under `ulimit -n`: at most this many open file descriptors. */
  readonly fdLimit?: number
  /** The `agentd` program to run (an embedder's, with a worker entry of its own); default DAEMON_BIN. */
  readonly bin?: string
}

const liveDaemons = new Set<Daemon>()

export class Daemon {
  readonly stderrChunks: Array<string> = []
  readonly stdoutChunks: Array<string> = []
  readonly recordedWorkerPids = new Set<number>()
  readonly clients: Array<Client> = []
  exitCode: number | null = null
  exitSignal: NodeJS.Signals | null = null
  shared = false
  readonly exited: Promise<void>
  hello: Msg | undefined

  constructor(
    readonly proc: ChildProcess,
    readonly stateDir: string,
    readonly socketPath: string,
    readonly mark: string
  ) {
    proc.stderr?.setEncoding("utf8")
    proc.stderr?.on("data", (d: string) => {
      this.stderrChunks.push(d)
      if (this.stderrChunks.length > 2000) this.stderrChunks.splice(0, 1000)
    })
    proc.stdout?.setEncoding("utf8")
    proc.stdout?.on("data", (d: string) => {
      this.stdoutChunks.push(d)
      if (this.stdoutChunks.length > 2000) this.stdoutChunks.splice(0, 1000)
    })
    this.exited = new Promise((resolve) => {
      proc.once("exit", (code, signal) => {
        this.exitCode = code
        this.exitSignal = signal
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

  get stderr(): string {
    return this.stderrChunks.join("")
  }

  get stdout(): string {
    return this.stdoutChunks.join("")
  }

  /** The built daemon's newest file time when this daemon started. */
  distStampAtStart = 0

  /** A warning when dist/ was rebuilt since this daemon started (mixed builds explain odd failures). */
  get rebuiltWarning(): string {
    return this.distStampAtStart !== 0 && distStamp() > this.distStampAtStart
      ? "WARNING: dist/ was rebuilt while this daemon ran; its workers may run newer code than it does.\n"
      : ""
  }

  /** Both streams, for failure messages. */
  get output(): string {
    return `${this.rebuiltWarning}--- stderr ---\n${this.stderr.slice(-3000)}\n--- stdout ---\n${this.stdout.slice(-3000)}`
  }

  /** A new connected client (hello consumed and stored in `client.hello`). */
  async connect(label = "client", options: ClientOptions = {}): Promise<Client> {
    const c = await Client.connect(this.socketPath, label, options)
    this.clients.push(c)
    return c
  }

  /** Records worker pids of a `status` response or a `SessionSummary`, for cleanup. */
  recordWorkers(data: Msg | undefined): void {
    if (data === undefined || data === null) return
    if (Array.isArray(data["workers"])) {
      for (const w of data["workers"]) if (typeof w?.pid === "number") this.recordedWorkerPids.add(w.pid)
    }
    if (typeof data["workerPid"] === "number") this.recordedWorkerPids.add(data["workerPid"])
    if (typeof data["state"]?.workerPid === "number") this.recordedWorkerPids.add(data["state"].workerPid)
  }

  /** Every process that belongs to this daemon right now (workers, spares, the daemon itself). */
  processes(): Array<number> {
    const set = new Set<number>()
    if (this.running) {
      set.add(this.pid)
      for (const p of descendantsOf(this.pid)) set.add(p)
    }
    for (const p of processesWithEnv("AGENTD_E2E_MARK", this.mark)) set.add(p)
    return [...set].filter(isAlive)
  }

  /** Worker processes (everything of this daemon but the daemon itself). */
  workerProcesses(): Array<number> {
    return this.processes().filter((p) => p !== this.pid)
  }

  signal(sig: NodeJS.Signals): void {
    killQuietly(this.pid, sig)
  }

  /** SIGKILLs the daemon only (its workers are left to notice). Resolves once it has exited. */
  async sigkill(): Promise<void> {
    this.signal("SIGKILL")
    await this.exited
  }

  /** Sends SIGTERM (or another signal) and waits for the exit; returns the exit code. */
  async stop(sig: NodeJS.Signals = "SIGTERM", timeoutMs = 15_000): Promise<{ code: number | null; signal: NodeJS.Signals | null }> {
    this.signal(sig)
    const done = await Promise.race([this.exited.then(() => true), sleep(timeoutMs).then(() => false)])
    if (!done) throw new Error(`daemon ${this.pid} did not exit within ${timeoutMs} ms of ${sig}`)
    return { code: this.exitCode, signal: this.exitSignal }
  }

  /** Kills everything this daemon started, closes the clients. Never throws. */
  async cleanup(): Promise<void> {
    const warning = this.rebuiltWarning
    if (warning !== "") console.warn(`[e2e daemon ${this.pid}] ${warning}`)
    for (const c of this.clients) c.close()
    const victims = new Set<number>([...this.processes(), ...[...this.recordedWorkerPids].filter(isAlive)])
    if (this.running || victims.size > 0) {
      try {
        process.kill(-this.pid, "SIGKILL") // its process group (spawned detached)
      } catch {
        // no such group
      }
    }
    for (const p of victims) killQuietly(p, "SIGKILL")
    if (this.running) await Promise.race([this.exited, sleep(5_000)])
    // Anything a dying daemon spawned at the last moment.
    for (const p of processesWithEnv("AGENTD_E2E_MARK", this.mark)) killQuietly(p, "SIGKILL")
    await waitGone([...victims], 3_000)
    liveDaemons.delete(this)
    // Its temp root goes too, unless another daemon of this process still runs on it (restarts).
    const root = path.dirname(this.stateDir)
    if (tempRoots.has(root) && ![...liveDaemons].some((d) => d.running && path.dirname(d.stateDir) === root)) {
      try {
        fs.rmSync(root, { recursive: true, force: true })
      } catch {
        // best effort
      }
      tempRoots.delete(root)
    }
  }
}

/** The newest mtime of the built daemon's files (to notice a rebuild during a run). */
const distStamp = (): number => {
  let newest = 0
  const walk = (dir: string): void => {
    let entries: Array<fs.Dirent>
    try {
      entries = fs.readdirSync(dir, { withFileTypes: true })
    } catch {
      return
    }
    for (const e of entries) {
      const f = path.join(dir, e.name)
      if (e.isDirectory()) walk(f)
      else if (e.name.endsWith(".js")) newest = Math.max(newest, fs.statSync(f).mtimeMs)
    }
  }
  walk(path.dirname(path.dirname(fs.realpathSync(DAEMON_BIN))))
  return newest
}

const tempRoots = new Set<string>()

/**
 * A fresh temp root; the state dir is `<root>/state` and does not exist yet. The root is
 * removed by `removeTempRoots` (each file's afterAll) once no daemon runs in it.
 */
export const freshStateDir = (): string => {
  const root = fs.mkdtempSync(path.join(os.tmpdir(), "ade2e-"))
  tempRoots.add(root)
  return path.join(root, "state")
}

/** Starts `agentd serve` and waits until its socket greets with `daemon_hello`. */
/** Whether this run's daemons keep their sessions in PostgreSQL (`AGENTD_E2E_STORE=postgres`): tests of the files' own crash points skip then. */
export const e2eOnPostgres = process.env["AGENTD_E2E_STORE"] === "postgres"

/** PostgreSQL stores of `AGENTD_E2E_STORE=postgres` runs, one per state dir, and how to drop them. */
const stores = new Map<string, { readonly url: string; readonly drop: () => Promise<void> }>()

/**
 * `AGENTD_E2E_STORE=postgres`: every daemon runs with `--store`, over a schema of its state dir's
 * own (a restart on the same state dir finds its store again), so that the e2e suites run once
 * more on the PostgreSQL store. Tests that name a store themselves are left as they are.
 */
const storeArgs = async (stateDir: string, options: StartOptions): Promise<Array<string>> => {
  if (process.env["AGENTD_E2E_STORE"] !== "postgres" || (options.extraArgs ?? []).includes("--store")) return []
  let store = stores.get(stateDir)
  if (store === undefined) stores.set(stateDir, store = await freshSchemaUrl())
  return ["--store", store.url]
}

export const startDaemon = async (options: StartOptions = {}): Promise<Daemon> => {
  if (!fs.existsSync(DAEMON_BIN)) {
    throw new Error(`${DAEMON_BIN} does not exist: run \`npm run build\` first`)
  }
  const stateDir = options.stateDir ?? freshStateDir()
  tempRoots.add(path.dirname(stateDir))
  const socketPath = options.socket ?? path.join(stateDir, "agentd.sock")
  const socketArgs = options.socket !== undefined ? ["--socket", options.socket] : []
  const mark = randomUUID()
  const env: Record<string, string> = {}
  for (const [k, v] of Object.entries(process.env)) {
    if (v === undefined) continue
    if (k.startsWith("AGENTD_") || k.startsWith("VITEST") || k === "NODE_OPTIONS" || k === "TEST") continue
    env[k] = v
  }
  // Without the warm-ups (a spare's restores and echo turns, ~0.1-0.2 s of CPU at every spare
  // start; the daemon's echo turns on a throwaway session, ~0.6 s at every daemon start: hundreds
  // of starts in the suite) unless a test
  // asks for them; they make nothing correct or not (recovery.test and the chaos runs keep them).
  Object.assign(env, { AGENTD_WARM_UP: "0" }, options.env ?? {}, { AGENTD_E2E_MARK: mark })
  // Started through a symlink with a neutral name: the daemon under test is the same file, but
  // its command line does not match `agentd.js serve`, which other people's clean-up scripts
  // on a shared machine have been seen to `pkill -f` (observed: SIGTERM to daemons mid-start).
  const entry = path.join(path.dirname(stateDir), `daemon-under-test-${mark.slice(0, 8)}.js`)
  if (!fs.existsSync(entry)) fs.symlinkSync(options.bin ?? DAEMON_BIN, entry)
  const argv = [entry, "serve", "--state-dir", stateDir, ...socketArgs, ...(await storeArgs(stateDir, options)), ...(options.extraArgs ?? [])]
  const limit = options.fileSizeLimitKiB
  const limits = [
    // /bin/sh (dash) counts `ulimit -f` in 512-byte blocks; an ignored signal stays ignored across exec.
    ...(limit === undefined ? [] : [`ulimit -f ${Math.ceil(limit * 2)} && trap '' XFSZ`]),
    ...(options.fdLimit === undefined ? [] : [`ulimit -n ${options.fdLimit}`])
  ]
  const command = [
    // `ip netns exec` execs the command: the daemon keeps the pid spawned here.
    ...(options.netns === undefined ? [] : ["ip", "netns", "exec", options.netns]),
    ...(limits.length === 0 ? [process.execPath] : ["/bin/sh", "-c", `${limits.join(" && ")} && exec "$0" "$@"`, process.execPath]),
    ...argv
  ]
  const proc = spawn(command[0]!, command.slice(1), {
    cwd: path.dirname(stateDir),
    env,
    stdio: ["ignore", "pipe", "pipe"],
    detached: true // own process group, so cleanup can kill the group
  })
  const daemon = new Daemon(proc, stateDir, socketPath, mark)
  daemon.distStampAtStart = distStamp()
  liveDaemons.add(daemon)
  if (options.shared === true) daemon.shared = true
  const deadline = Date.now() + START_TIMEOUT_MS
  let lastError: unknown
  // When the socket path already existed (a restart, or a second daemon on a live path), a
  // hello is ours only if it names our pid; on a fresh path any hello is ours (the hello test
  // checks supervisorPid separately).
  const pathExisted = fs.existsSync(socketPath)
  while (Date.now() < deadline) {
    if (!daemon.running) {
      throw new Error(
        `daemon exited during start-up (code ${daemon.exitCode}, signal ${daemon.exitSignal});\n${daemon.output}`
      )
    }
    if (fs.existsSync(socketPath)) {
      try {
        const probe = await Client.connect(socketPath, "probe", { awaitHello: false })
        let hello: Msg
        try {
          hello = await probe.waitFor((m) => m["type"] === "daemon_hello", 5_000, "daemon_hello")
        } finally {
          probe.close()
        }
        if (!pathExisted || hello["supervisorPid"] === daemon.pid) {
          daemon.hello = hello
          return daemon
        }
        lastError = new Error(`hello from supervisorPid ${hello["supervisorPid"]}, not ${daemon.pid}`)
      } catch (e) {
        lastError = e
      }
    }
    await sleep(50)
  }
  await daemon.cleanup()
  throw new Error(`daemon did not greet within ${START_TIMEOUT_MS} ms (${String(lastError)});\n${daemon.output}`)
}

/**
 * Starts a daemon for the current test and registers its cleanup (daemon + workers killed,
 * clients closed) to run when the test finishes, pass or fail.
 */
export const useDaemon = async (options: StartOptions = {}): Promise<Daemon> => {
  const daemon = await startDaemon(options)
  onTestFinished(async () => {
    await daemon.cleanup()
  })
  return daemon
}

/**
 * One daemon for every test of the enclosing `describe` (or file): started in `beforeAll`,
 * killed with its workers in `afterAll` (which runs whether tests passed or not); the clients a
 * test opened are closed after it. For tests that only need sessions of their own, which saves
 * a daemon start (seconds on a loaded machine) per test.
 */
export const sharedDaemon = (options: StartOptions = {}): (() => Daemon) => {
  let daemon: Daemon | undefined
  beforeAll(async () => {
    daemon = await startDaemon({ ...options, shared: true })
  }, 30_000)
  afterEach(() => {
    if (daemon === undefined) return
    for (const c of daemon.clients.splice(0)) c.close()
  })
  afterAll(async () => {
    await daemon?.cleanup()
  })
  return () => {
    if (daemon === undefined) throw new Error("the shared daemon did not start")
    if (!daemon.running) throw new Error(`the shared daemon has exited (code ${daemon.exitCode}, signal ${daemon.exitSignal});\n${daemon.output}`)
    return daemon
  }
}

/**
 * Kills every daemon this module started that is still tracked (an afterEach safety net), except
 * shared ones (`all: true` includes them).
 */
export const cleanupAllDaemons = async (all = false): Promise<void> => {
  await Promise.all([...liveDaemons].filter((d) => all || !d.shared).map((d) => d.cleanup()))
}

/**
 * Registers, for the calling test file, the clean-up every e2e file needs: after each test the
 * daemons it left (a safety net: `useDaemon` already cleans up its own), after the file the
 * temp roots.
 */
export const cleanUpAfterTests = (): void => {
  afterEach(() => cleanupAllDaemons())
  afterAll(() => removeTempRoots())
}

/** Removes the temp roots of daemons that are gone (best effort). */
export const removeTempRoots = async (): Promise<void> => {
  if ([...liveDaemons].some((d) => d.running)) return
  for (const root of tempRoots) {
    try {
      fs.rmSync(root, { recursive: true, force: true })
    } catch {
      // best effort
    }
  }
  tempRoots.clear()
  const dropped = [...stores.values()]
  stores.clear()
  await Promise.all(dropped.map((s) => s.drop().catch(() => undefined)))
}

// ---------------------------------------------------------------------------------------------
// Protocol helpers used by several test files
// ---------------------------------------------------------------------------------------------

/** Creates a session and returns its id (and the create data). */
export const createSession = async (client: Client, fields: Msg = {}): Promise<{ id: string; data: Msg }> => {
  const data = await client.ok({ type: "create", ...fields })
  return { id: data["activeSessionId"] as string, data }
}

/**
 * Collects the sequenced messages of a session from `client` until `until` matches one
 * (inclusive). Consumes them from the client's pending queue.
 */
export const collectUntil = async (
  client: Client,
  activeSessionId: string,
  until: (m: Msg) => boolean,
  timeoutMs = DEFAULT_WAIT_MS
): Promise<Array<Msg>> => {
  const out: Array<Msg> = []
  const deadline = Date.now() + timeoutMs
  for (;;) {
    const left = deadline - Date.now()
    if (left <= 0) throw new Error(`collectUntil timed out; got ${out.map(describeMsg).join(", ")}`)
    const m = await client.waitFor(
      (x) => isSequenced(x) && x["activeSessionId"] === activeSessionId,
      left,
      `sequenced events of ${activeSessionId} (so far: ${out.map(describeMsg).join(", ")})`
    )
    out.push(m)
    if (until(m)) return out
  }
}

export const isEvent = (type: string) => (m: Msg): boolean => m["type"] === "session_event" && m["event"]?.type === type

export const isIdleStatus = (m: Msg): boolean => m["type"] === "session_status" && m["state"]?.busy === false

/** Collects one whole turn: up to `agent_end`/`turn_interrupted` and then the `busy: false` status. */
export const collectTurn = async (client: Client, activeSessionId: string, timeoutMs = DEFAULT_WAIT_MS): Promise<Array<Msg>> => {
  let ended = false
  return collectUntil(
    client,
    activeSessionId,
    (m) => {
      if (isEvent("agent_end")(m) || isEvent("turn_interrupted")(m)) ended = true
      return ended && isIdleStatus(m)
    },
    timeoutMs
  )
}

/** Polls `get_state` until the session is idle (not busy); returns the summary. */
export const waitIdle = async (client: Client, activeSessionId: string, timeoutMs = DEFAULT_WAIT_MS): Promise<Msg> => {
  const deadline = Date.now() + timeoutMs
  for (;;) {
    const s = await client.ok({ type: "get_state", activeSessionId })
    if (s["busy"] === false && s["worker"] === "ready") return s
    if (Date.now() > deadline) throw new Error(`session ${activeSessionId} not idle after ${timeoutMs} ms: ${JSON.stringify(s)}`)
    await sleep(50)
  }
}

/**
 * Checks that `msgs` (sequenced messages) have cursors that follow each other by exactly one
 * (same generation: sequence + 1; a new generation: sequence 0 of generation + 1), starting
 * right after `after` when given. Returns a description of the first problem, or undefined.
 */
export const cursorGap = (msgs: ReadonlyArray<Msg>, after?: Cursor): string | undefined => {
  let prev = after
  for (const m of msgs) {
    const c = m["meta"]?.cursor as Cursor | undefined
    if (c === undefined) return `${describeMsg(m)} has no meta.cursor`
    if (prev !== undefined) {
      const sameGenNext = c.generation === prev.generation && c.sequence === prev.sequence + 1
      const nextGen = c.generation > prev.generation && c.sequence === 0
      if (!sameGenNext && !nextGen) return `cursor ${fmtCursor(c)} (${describeMsg(m)}) does not follow ${fmtCursor(prev)}`
    }
    prev = c
  }
  return undefined
}

export const cursorOf = (m: Msg): Cursor => m["meta"].cursor as Cursor

/** Reads all messages of a session with get_messages, paging by 1000. */
export const allMessages = async (client: Client, activeSessionId: string): Promise<Array<Msg>> => {
  const out: Array<Msg> = []
  for (;;) {
    const data = await client.ok({ type: "get_messages", activeSessionId, offset: out.length, limit: 1000 }, 30_000)
    const page = data["messages"] as Array<Msg>
    out.push(...page)
    if (page.length === 0 || out.length >= (data["total"] as number)) return out
  }
}

/** Reads a file mode as an octal permission number (e.g. 0o600). */
export const modeOf = (p: string): number => fs.statSync(p).mode & 0o777

// ---------------------------------------------------------------------------------------------
// Shape checks (return a list of problems; tests assert it is empty, so failures say what is wrong)
// ---------------------------------------------------------------------------------------------

const isInt = (v: unknown): boolean => typeof v === "number" && Number.isInteger(v)

export const cursorProblems = (c: unknown, where: string): Array<string> => {
  if (typeof c !== "object" || c === null) return [`${where}: not a cursor object: ${JSON.stringify(c)}`]
  const o = c as Msg
  const out: Array<string> = []
  if (!isInt(o["generation"]) || o["generation"] < 1) out.push(`${where}.generation must be an int >= 1: ${o["generation"]}`)
  if (!isInt(o["sequence"]) || o["sequence"] < 0) out.push(`${where}.sequence must be an int >= 0: ${o["sequence"]}`)
  return out
}

const WORKER_STATES = ["starting", "ready", "recovering", "passivated", "failed", "closed"]

export const summaryProblems = (s: unknown, where = "summary"): Array<string> => {
  if (typeof s !== "object" || s === null) return [`${where}: not an object: ${JSON.stringify(s)}`]
  const o = s as Msg
  const out: Array<string> = []
  if (typeof o["activeSessionId"] !== "string" || o["activeSessionId"] === "") out.push(`${where}.activeSessionId`)
  if ("name" in o && typeof o["name"] !== "string") out.push(`${where}.name must be a string when present`)
  if (typeof o["engine"] !== "string") out.push(`${where}.engine must be a string: ${o["engine"]}`)
  if (typeof o["createdAt"] !== "string" || Number.isNaN(Date.parse(o["createdAt"])) || !/^\d{4}-\d\d-\d\dT/.test(o["createdAt"])) {
    out.push(`${where}.createdAt must be an ISO 8601 string: ${o["createdAt"]}`)
  }
  if (!isInt(o["messageCount"]) || o["messageCount"] < 0) out.push(`${where}.messageCount: ${o["messageCount"]}`)
  if (typeof o["busy"] !== "boolean") out.push(`${where}.busy must be a boolean`)
  if (!WORKER_STATES.includes(o["worker"])) out.push(`${where}.worker invalid: ${o["worker"]}`)
  if ("workerPid" in o && !isInt(o["workerPid"])) out.push(`${where}.workerPid must be an int when present`)
  if (!isInt(o["restarts"]) || o["restarts"] < 0) out.push(`${where}.restarts: ${o["restarts"]}`)
  if (typeof o["telemetry"] !== "boolean") out.push(`${where}.telemetry must be a boolean`)
  if ("lastEventCursor" in o) out.push(...cursorProblems(o["lastEventCursor"], `${where}.lastEventCursor`))
  return out
}

export const agentMessageProblems = (m: unknown, where = "message"): Array<string> => {
  if (typeof m !== "object" || m === null) return [`${where}: not an object`]
  const o = m as Msg
  const out: Array<string> = []
  if (typeof o["id"] !== "string") out.push(`${where}.id`)
  if (!["user", "assistant", "tool"].includes(o["role"])) out.push(`${where}.role: ${o["role"]}`)
  if (typeof o["content"] !== "string") out.push(`${where}.content`)
  if ("toolCallId" in o && typeof o["toolCallId"] !== "string") out.push(`${where}.toolCallId`)
  if ("toolName" in o && typeof o["toolName"] !== "string") out.push(`${where}.toolName`)
  if ("isError" in o && typeof o["isError"] !== "boolean") out.push(`${where}.isError`)
  if ("interrupted" in o && o["interrupted"] !== true) out.push(`${where}.interrupted must be true when present`)
  if (!isInt(o["timestamp"]) || o["timestamp"] < 1_000_000_000_000) out.push(`${where}.timestamp must be epoch ms: ${o["timestamp"]}`)
  return out
}

/** Problems of a sequenced message's `meta` (cursor, integer emittedAt, `replayed` only `true`). */
export const metaProblems = (m: Msg, expectReplayed: boolean | undefined): Array<string> => {
  const meta = m["meta"]
  const where = describeMsg(m)
  if (typeof meta !== "object" || meta === null) return [`${where}: no meta`]
  const out = cursorProblems(meta.cursor, `${where} meta.cursor`)
  if (!isInt(meta.emittedAt) || meta.emittedAt < 1_000_000_000_000) out.push(`${where} meta.emittedAt must be epoch ms: ${meta.emittedAt}`)
  if ("replayed" in meta && meta.replayed !== true) out.push(`${where} meta.replayed must be absent or true: ${meta.replayed}`)
  if (expectReplayed === true && meta.replayed !== true) out.push(`${where} should carry meta.replayed: true`)
  if (expectReplayed === false && "replayed" in meta) out.push(`${where} is live and must not carry meta.replayed`)
  return out
}
