/**
 * `npm run soak -- --minutes N [--sessions 10] [--clients 100] [--svg PATH]`: a long run of the
 * real daemon under steady load, to see whether it leaks (memory, fds) or loses order.
 *
 * The built daemon (`dist/src/bin/agentd.js`, default settings, faults off) runs in a temp state
 * dir (bench harness: own process group, everything killed and removed in a `finally`, and on
 * Ctrl-C). `--sessions` sessions are created and `--clients` clients attach in all, round robin
 * (client j to session j % sessions), each on its own socket connection, with capabilities
 * `attach_snapshot`, `event_sequence`, `slim_attach`. The first client of each session prompts
 * continuously: a prompt (mostly plain text of 3 to 300 words, sometimes `/bulk 20000`, sometimes
 * `/sleep 20`), then the end of its turn (`agent_end` or `turn_interrupted`, then the
 * `session_status` with `busy: false`), then the next prompt.
 *
 * Every client checks each sequenced event (session_event, session_status, session_closed)
 * against the one before: same generation, sequence + 1; or a higher generation, sequence 0
 * (the first event after the attach baseline follows the snapshot's cursor). Anything else is a
 * cursor violation (gap, duplicate, reordering); they are counted and the first ones printed. At
 * the end every client must have reached its session's last cursor (get_state).
 *
 * Latency: `Date.now()` when a socket chunk arrives minus the line's `meta.emittedAt` (set by
 * the supervisor when it logs the event; same machine clock; both are whole milliseconds, so a
 * figure is +-1 ms), over every sequenced event received in the measured period. A second figure
 * for `message_start` events uses the engine's `message.timestamp` (set in the worker) instead,
 * so it includes the worker -> supervisor hop. Clients read only the fields they need, from the
 * bytes of the line (`meta` is at the end of every sequenced line the daemon writes); lines of
 * any other shape are parsed with JSON.parse. The client process's CPU and event-loop delay are
 * sampled too, so that a client bottleneck would show.
 *
 * Every sample interval (duration / 120, at least 0.5 s: 5 s for 10 minutes) one line is
 * printed: daemon VmRSS and open fds (/proc/<pid>/status, /proc/<pid>/fd), the daemon's
 * descendants (workers, spare) and their total VmRSS, events/s, latency, turns/s, CPU, state dir
 * size. A warm-up (10% of the duration, at most 30 s) runs the same load before the measured
 * period; `start` figures are the first measured sample. At the end: totals, figures at start
 * and end with their least-squares slope per minute, terminal charts of RSS and fds, and an SVG
 * (`--svg PATH`, default ./soak-<timestamp>.svg in the directory npm was started from).
 *
 * Baseline in the same run (after the daemon has stopped; `--baseline-seconds 0` skips it): a
 * plain `node:net` server process writing sequenced lines of the same shape to the same number
 * of clients, read by the same client code, (a) paced at the event rate the daemon reached, for
 * the latency a bare socket relay gives at that load, (b) as fast as it can, for the ceiling of
 * this client code on this machine.
 */
import { type ChildProcess, spawn } from "node:child_process"
import * as fs from "node:fs"
import * as net from "node:net"
import * as os from "node:os"
import * as path from "node:path"
import { monitorEventLoopDelay, performance } from "node:perf_hooks"
import { parseArgs } from "node:util"
import { cpuTicksOf, processesWithEnv } from "../test/support/procfs.js"
import { type Point, shortNumber, slope, svgChart, terminalChart } from "./chart.js"
import { type Daemon, descendantsOf, MiB, type Msg, rssOf, sleep, withDaemon } from "./daemonHarness.js"

// ---------------------------------------------------------------------------------------------
// Options
// ---------------------------------------------------------------------------------------------

const USAGE = `usage: npm run soak -- [--minutes N] [--sessions N] [--clients N] [--svg PATH]
                      [--interval SECONDS] [--warmup SECONDS] [--baseline-seconds N] [--seed N]
  --minutes           measured duration, may be fractional (default 10)
  --sessions          sessions, each with one prompting client (default 10)
  --clients           attached clients in all, round robin over the sessions (default 100)
  --svg               where to write the SVG chart (default ./soak-<timestamp>.svg)
  --interval          seconds between samples (default minutes*60/120, at least 0.5)
  --warmup            seconds of load before the measured period (default 10%, at most 30)
  --baseline-seconds  length of each node:net baseline run (default 10% of the run, 5..20; 0: none)
  --seed              seed of the prompt mix (default 1)`

interface Options {
  readonly minutes: number
  readonly sessions: number
  readonly clients: number
  readonly svgPath: string
  readonly intervalMs: number
  readonly warmupMs: number
  readonly baselineMs: number
  readonly seed: number
}

const usageError = (message: string): never => {
  console.error(`soak: ${message}\n${USAGE}`)
  process.exit(2)
}

const parseOptions = (argv: ReadonlyArray<string>): Options => {
  let values: Record<string, string | boolean | undefined>
  try {
    values = parseArgs({
      args: [...argv],
      options: {
        minutes: { type: "string" },
        sessions: { type: "string" },
        clients: { type: "string" },
        svg: { type: "string" },
        interval: { type: "string" },
        warmup: { type: "string" },
        "baseline-seconds": { type: "string" },
        seed: { type: "string" },
        help: { type: "boolean", short: "h" }
      },
      strict: true,
      allowPositionals: false
    }).values
  } catch (e) {
    return usageError((e as Error).message)
  }
  if (values["help"] === true) {
    console.log(USAGE)
    process.exit(0)
  }
  const num = (name: string, fallback: number, check: (n: number) => boolean, what: string): number => {
    const raw = values[name]
    if (raw === undefined) return fallback
    const n = Number(raw)
    if (typeof raw !== "string" || raw.trim() === "" || !Number.isFinite(n) || !check(n)) usageError(`--${name} must be ${what} (got ${String(raw)})`)
    return n
  }
  const minutes = num("minutes", 10, (n) => n > 0, "a number > 0")
  const sessions = num("sessions", 10, (n) => Number.isInteger(n) && n >= 1, "an integer >= 1")
  const clients = num("clients", 100, (n) => Number.isInteger(n) && n >= sessions, "an integer >= --sessions")
  const durationS = minutes * 60
  const intervalS = num("interval", Math.max(0.5, durationS / 120), (n) => n >= 0.05, "a number >= 0.05")
  const warmupS = num("warmup", Math.min(30, durationS * 0.1), (n) => n >= 0, "a number >= 0")
  const baselineS = num("baseline-seconds", Math.min(20, Math.max(5, durationS * 0.1)), (n) => n >= 0, "a number >= 0")
  const seed = num("seed", 1, (n) => Number.isInteger(n), "an integer")
  const stamp = new Date().toISOString().replace(/[:.]/g, "-")
  const svg = values["svg"]
  const svgPath = typeof svg === "string"
    ? path.resolve(process.env["INIT_CWD"] ?? process.cwd(), svg)
    : path.join(process.env["INIT_CWD"] ?? process.cwd(), `soak-${stamp}.svg`)
  return { minutes, sessions, clients, svgPath, intervalMs: intervalS * 1000, warmupMs: warmupS * 1000, baselineMs: baselineS * 1000, seed }
}

// ---------------------------------------------------------------------------------------------
// Statistics
// ---------------------------------------------------------------------------------------------

const HIST_MAX_MS = 120_000

/** Whole-millisecond histogram (0 .. 120 s, then one overflow bucket). */
class Histogram {
  readonly counts = new Float64Array(HIST_MAX_MS + 2)
  n = 0
  max = 0
  /** Samples below 0 (a clock step), counted as 0. */
  negative = 0

  add(ms: number): void {
    if (ms < 0) {
      this.negative++
      ms = 0
    }
    this.counts[ms > HIST_MAX_MS ? HIST_MAX_MS + 1 : Math.floor(ms)]!++
    this.n++
    if (ms > this.max) this.max = ms
  }

  merge(o: Histogram): void {
    if (o.n === 0) return
    for (let i = 0; i < this.counts.length; i++) this.counts[i]! += o.counts[i]!
    this.n += o.n
    this.negative += o.negative
    if (o.max > this.max) this.max = o.max
  }

  quantile(q: number): number {
    if (this.n === 0) return NaN
    const target = Math.max(1, Math.ceil(q * this.n))
    let cum = 0
    for (let i = 0; i < this.counts.length; i++) {
      cum += this.counts[i]!
      if (cum >= target) return i > HIST_MAX_MS ? this.max : i
    }
    return this.max
  }
}

/** What the clients count; one object per sample interval, merged into the run's total. */
class Stats {
  /** Sequenced lines received, all clients. */
  events = 0
  /** Sequenced lines received by the prompting clients (one per session): events emitted. */
  emitted = 0
  bytes = 0
  /** Events flagged `replayed` (after the attach baseline: re-sent after a backpressure pause). */
  replayed = 0
  turns = 0
  readonly latency = new Histogram()
  readonly engineLatency = new Histogram()
  readonly turnMs = new Histogram()

  merge(o: Stats): void {
    this.events += o.events
    this.emitted += o.emitted
    this.bytes += o.bytes
    this.replayed += o.replayed
    this.turns += o.turns
    this.latency.merge(o.latency)
    this.engineLatency.merge(o.engineLatency)
    this.turnMs.merge(o.turnMs)
  }
}

interface Sample {
  /** Minutes since the start of the measured period (negative during the warm-up). */
  readonly t: number
  readonly measured: boolean
  readonly seconds: number
  readonly daemonRss: number
  readonly fds: number
  readonly workers: number
  readonly workersRss: number
  readonly eventsPerS: number
  readonly emittedPerS: number
  readonly mbPerS: number
  readonly p50: number
  readonly p99: number
  readonly max: number
  readonly turnsPerS: number
  readonly cpuDaemon: number
  readonly cpuWorkers: number
  readonly cpuClient: number
  /** CPU used on the whole machine (all processes, cores). */
  readonly cpuMachine: number
  readonly loopDelayP99: number
  readonly replayed: number
  readonly diskBytes: number
}

interface ProcSnapshot {
  readonly daemonRss: number
  readonly fds: number
  readonly workers: number
  readonly workersRss: number
  readonly diskBytes: number
}

/** The run's shared state: what the clients count and what the report prints. */
const run = {
  options: undefined as Options | undefined,
  win: new Stats(),
  total: new Stats(),
  samples: [] as Array<Sample>,
  measuring: false,
  stopping: false,
  measureStart: 0,
  violations: 0,
  violationNotes: [] as Array<string>,
  resyncs: 0,
  slowSequenced: 0,
  badLines: 0,
  unexpectedClosed: 0,
  interrupted: 0,
  promptErrors: new Map<string, number>(),
  promptKinds: new Map<string, number>(),
  eventTypes: new Map<string, number>(),
  stuckTurns: [] as Array<string>,
  behindAtEnd: [] as Array<string>,
  notes: [] as Array<string>,
  idleBefore: undefined as ProcSnapshot | undefined,
  idleAfter: undefined as ProcSnapshot | undefined,
  fdsBeforeClients: NaN,
  fdsAfterClientsClosed: NaN,
  fdsAfterNextTurn: NaN,
  leftoverProcesses: [] as Array<number>,
  baselinePaced: undefined as BaselineResult | undefined,
  baselineMax: undefined as BaselineResult | undefined,
  daemonPid: 0,
  mark: "",
  stateDir: ""
}

const inc = (m: Map<string, number>, k: string, by = 1) => m.set(k, (m.get(k) ?? 0) + by)

const note = (s: string) => {
  run.notes.push(s)
  console.log(`  !! ${s}`)
}

// ---------------------------------------------------------------------------------------------
// The client: reads only what it needs from each line's bytes
// ---------------------------------------------------------------------------------------------

const CAPABILITIES = ["attach_snapshot", "event_sequence", "slim_attach"]
const REQUEST_TIMEOUT_MS = 60_000

const lit = (s: string) => Buffer.from(s, "latin1")
const SESSION_PREFIX = lit('{"type":"session_')
const EVENT_PREFIX = lit('{"type":"session_event","event":{"type":"')
const META = lit('"meta":{"cursor":{"generation":')
const SEQUENCE = lit(',"sequence":')
const EMITTED_AT = lit('},"emittedAt":')
const REPLAYED = lit(',"replayed":true')
const TIMESTAMP = lit('"timestamp":')
const BUSY_FALSE = lit('"busy":false')

const bytesAt = (b: Buffer, p: number, l: Buffer): boolean => p >= 0 && b.length >= p + l.length && b.compare(l, 0, l.length, p, p + l.length) === 0

/** End of the digits read by the last `digitsAt`. */
let digitsEnd = 0
/** The unsigned integer at `p` (-1 if there is none); `digitsEnd` is set after it. */
const digitsAt = (b: Buffer, p: number): number => {
  let v = 0
  const start = p
  while (p < b.length) {
    const c = b[p]!
    if (c < 48 || c > 57) break
    v = v * 10 + (c - 48)
    p++
  }
  digitsEnd = p
  return p === start ? -1 : v
}

/** The sequenced message types. */
const Kind = { Event: 0, Status: 1, Closed: 2 } as const
type Kind = (typeof Kind)[keyof typeof Kind]
const KIND_NAMES = ["session_event", "session_status", "session_closed"] as const

interface TurnWait {
  phase: "end" | "idle"
  interrupted: boolean
  resolve: (interrupted: boolean) => void
}

class SoakClient {
  /** The last sequenced cursor seen (generation 0: nothing yet, the next must be sequence 0). */
  gen = 0
  seq = -1
  events = 0
  helloSeen = false
  closed = false
  turn: TurnWait | undefined
  private parts: Array<Buffer> = []
  private partsBytes = 0
  private readonly pending = new Map<string, { resolve: (m: Msg) => void; reject: (e: Error) => void; sync?: (m: Msg) => void }>()
  private nextId = 0
  private onHello: (() => void) | undefined
  private onAttached: ((m: Msg) => void) | undefined

  private constructor(readonly socket: net.Socket, readonly label: string, readonly prompter: boolean) {
    socket.on("data", (d: Buffer) => this.onData(d))
    socket.on("error", () => {})
    socket.on("close", () => {
      this.closed = true
      const e = new Error(`[${label}] connection closed`)
      for (const p of this.pending.values()) p.reject(e)
      this.pending.clear()
    })
  }

  static connect(socketPath: string, label: string, prompter: boolean): Promise<SoakClient> {
    return new Promise((resolve, reject) => {
      const socket = net.createConnection({ path: socketPath })
      const c = new SoakClient(socket, label, prompter)
      const timer = setTimeout(() => reject(new Error(`[${label}] no daemon_hello within 20 s`)), 20_000)
      socket.once("error", (e) => {
        clearTimeout(timer)
        reject(e)
      })
      c.onHello = () => {
        clearTimeout(timer)
        resolve(c)
      }
    })
  }

  close(): void {
    this.socket.destroy()
  }

  request(command: Msg, sync?: (m: Msg) => void): Promise<Msg> {
    const id = `${this.label}-${++this.nextId}`
    return new Promise((resolve, reject) => {
      const timer = setTimeout(() => {
        this.pending.delete(id)
        reject(new Error(`[${this.label}] no response to ${command["type"]} within ${REQUEST_TIMEOUT_MS} ms`))
      }, REQUEST_TIMEOUT_MS)
      this.pending.set(id, {
        resolve: (m) => {
          clearTimeout(timer)
          resolve(m)
        },
        reject: (e) => {
          clearTimeout(timer)
          reject(e)
        },
        ...(sync === undefined ? {} : { sync })
      })
      this.socket.write(JSON.stringify({ ...command, id }) + "\n")
    })
  }

  async ok(command: Msg): Promise<Msg> {
    const r = await this.request(command)
    if (r["success"] !== true) throw new Error(`[${this.label}] ${command["type"]} failed: ${JSON.stringify(r["error"])}`)
    return r["data"] as Msg
  }

  /** Attaches without a cursor; the baseline's snapshot cursor is where the checks start. */
  async attach(activeSessionId: string): Promise<void> {
    const attached = new Promise<Msg>((resolve) => (this.onAttached = resolve))
    // The cursor is taken in the response handler itself: replayed events may follow in the
    // same socket chunk, before any promise continuation runs.
    const r = await this.request({ type: "attach", activeSessionId, capabilities: CAPABILITIES }, (m) => {
      const data = m["data"] as Msg | undefined
      if (m["success"] === true && data?.["replay"]?.status !== "complete") this.resetTo(data?.["snapshot"]?.cursor)
    })
    if (r["success"] !== true) throw new Error(`[${this.label}] attach failed: ${JSON.stringify(r["error"])}`)
    let timer: NodeJS.Timeout | undefined
    await Promise.race([
      attached,
      new Promise((_, reject) => (timer = setTimeout(() => reject(new Error(`[${this.label}] no session_attached within 30 s`)), 30_000)))
    ]).finally(() => clearTimeout(timer))
  }

  /** Expects the turn the next prompt starts: resolves at its idle status (true if interrupted). */
  armTurn(): Promise<boolean> {
    return new Promise((resolve) => (this.turn = { phase: "end", interrupted: false, resolve }))
  }

  private resetTo(cursor: Msg | undefined): void {
    if (cursor !== undefined && typeof cursor["generation"] === "number" && typeof cursor["sequence"] === "number") {
      this.gen = cursor["generation"]
      this.seq = cursor["sequence"]
    } else {
      this.gen = 0
      this.seq = -1
    }
  }

  private onData(data: Buffer): void {
    const now = Date.now()
    let start = 0
    for (;;) {
      const nl = data.indexOf(0x0a, start)
      if (nl < 0) break
      let line = data.subarray(start, nl)
      if (this.parts.length > 0) {
        this.parts.push(line)
        line = Buffer.concat(this.parts, this.partsBytes + line.length)
        this.parts = []
        this.partsBytes = 0
      }
      if (line.length > 0 && line[line.length - 1] === 0x0d) line = line.subarray(0, line.length - 1)
      if (line.length > 0) this.onLine(line, now)
      start = nl + 1
    }
    if (start < data.length) {
      const rest = data.subarray(start)
      this.parts.push(rest)
      this.partsBytes += rest.length
    }
  }

  private onLine(line: Buffer, now: number): void {
    if (!bytesAt(line, 0, SESSION_PREFIX)) return this.slow(line, now)
    const k = line[SESSION_PREFIX.length]
    const kind = k === 0x65 /* e */
      ? Kind.Event
      : k === 0x63 /* c */
      ? Kind.Closed
      : k === 0x73 /* s */ && line[SESSION_PREFIX.length + 1] === 0x74 /* t */
      ? Kind.Status
      : undefined
    if (kind === undefined) return this.slow(line, now)
    const m = line.lastIndexOf(META)
    if (m < 0) return this.slow(line, now)
    const gen = digitsAt(line, m + META.length)
    if (gen < 0 || !bytesAt(line, digitsEnd, SEQUENCE)) return this.slow(line, now)
    const seq = digitsAt(line, digitsEnd + SEQUENCE.length)
    if (seq < 0 || !bytesAt(line, digitsEnd, EMITTED_AT)) return this.slow(line, now)
    const emittedAt = digitsAt(line, digitsEnd + EMITTED_AT.length)
    if (emittedAt < 0) return this.slow(line, now)
    const replayed = bytesAt(line, digitsEnd, REPLAYED)
    let eventType = ""
    if (kind === Kind.Event) {
      if (!bytesAt(line, 0, EVENT_PREFIX)) return this.slow(line, now)
      const q = line.indexOf(0x22, EVENT_PREFIX.length)
      eventType = line.toString("latin1", EVENT_PREFIX.length, q)
    }
    this.onSequenced(kind, gen, seq, emittedAt, replayed, eventType, line, m, now)
  }

  private onSequenced(
    kind: Kind,
    gen: number,
    seq: number,
    emittedAt: number,
    replayed: boolean,
    eventType: string,
    line: Buffer,
    metaAt: number,
    now: number
  ): void {
    this.events++
    const ok = gen === this.gen ? seq === this.seq + 1 : gen > this.gen && seq === 0
    if (!ok) {
      run.violations++
      if (run.violationNotes.length < 20) {
        const what = gen === this.gen
          ? seq <= this.seq ? "duplicate or out of order" : `gap of ${seq - this.seq - 1}`
          : gen < this.gen
          ? "older generation"
          : "new generation not starting at 0"
        run.violationNotes.push(`${this.label}: after ${this.gen}:${this.seq} got ${gen}:${seq} (${what}; ${kind === Kind.Event ? eventType : KIND_NAMES[kind]})`)
      }
    }
    this.gen = gen
    this.seq = seq
    const w = run.win
    w.events++
    w.bytes += line.length + 1
    if (replayed) w.replayed++
    w.latency.add(now - emittedAt)
    if (this.prompter) {
      w.emitted++
      inc(run.eventTypes, kind === Kind.Event ? eventType : KIND_NAMES[kind])
    }
    if (eventType === "message_start") {
      const t = line.lastIndexOf(TIMESTAMP, metaAt)
      if (t >= 0) {
        const ts = digitsAt(line, t + TIMESTAMP.length)
        if (ts > 0) w.engineLatency.add(now - ts)
      }
    }
    const turn = this.turn
    if (turn !== undefined) {
      if (kind === Kind.Event && turn.phase === "end" && (eventType === "agent_end" || eventType === "turn_interrupted")) {
        turn.phase = "idle"
        turn.interrupted = eventType === "turn_interrupted"
      } else if (kind === Kind.Status && turn.phase === "idle" && line.indexOf(BUSY_FALSE) >= 0) {
        this.turn = undefined
        turn.resolve(turn.interrupted)
      }
    }
    if (kind === Kind.Closed) {
      run.unexpectedClosed++
      note(`${this.label}: session_closed ${line.toString("utf8", 0, Math.min(line.length, 300))}`)
    }
  }

  /** Any line not in the shape the fast path knows: parsed. */
  private slow(line: Buffer, now: number): void {
    let m: Msg
    try {
      m = JSON.parse(line.toString("utf8")) as Msg
    } catch {
      run.badLines++
      return
    }
    if (typeof m !== "object" || m === null) {
      run.badLines++
      return
    }
    switch (m["type"]) {
      case "daemon_hello":
        this.helloSeen = true
        this.onHello?.()
        return
      case "response": {
        const p = this.pending.get(m["id"])
        if (p !== undefined) {
          this.pending.delete(m["id"])
          p.sync?.(m)
          p.resolve(m)
        }
        return
      }
      case "session_attached":
        this.onAttached?.(m)
        this.onAttached = undefined
        return
      case "session_snapshot_begin":
        // A baseline (attach) or a state replacement (resync, replacement): the next event
        // follows the snapshot's cursor.
        if (m["purpose"] !== "attach") {
          run.resyncs++
          note(`${this.label}: snapshot with purpose ${m["purpose"]} at ${JSON.stringify(m["cursor"])}`)
        }
        this.resetTo(m["cursor"])
        return
      case "session_event":
      case "session_status":
      case "session_closed": {
        const c = m["meta"]?.cursor
        if (typeof c?.generation !== "number" || typeof c?.sequence !== "number") {
          run.badLines++
          return
        }
        run.slowSequenced++
        const kind = m["type"] === "session_event" ? Kind.Event : m["type"] === "session_status" ? Kind.Status : Kind.Closed
        const eventType = String(m["event"]?.type ?? "")
        this.onSequenced(kind, c.generation, c.sequence, Number(m["meta"].emittedAt), m["meta"].replayed === true, eventType, line, line.length, now)
        return
      }
      default:
        return
    }
  }
}

// ---------------------------------------------------------------------------------------------
// The load
// ---------------------------------------------------------------------------------------------

/** mulberry32: a small seeded PRNG, so that a run's prompt mix can be repeated. */
const prng = (seed: number) => {
  let a = seed >>> 0
  return () => {
    a = (a + 0x6d2b79f5) >>> 0
    let t = a
    t = Math.imul(t ^ (t >>> 15), t | 1)
    t ^= t + Math.imul(t ^ (t >>> 7), t | 61)
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296
  }
}

const WORDS = (
  "the daemon keeps every session alive in its own worker and streams each event to the clients " +
  "attached to it in cursor order so that a client may leave and come back and resume where it was"
).split(" ")

/** 4% `/bulk 20000`, 4% `/sleep 20`, else plain text of 3 to 300 words (log-uniform). */
const nextPrompt = (rand: () => number): { kind: string; message: string } => {
  const r = rand()
  if (r < 0.04) return { kind: "/bulk 20000", message: "/bulk 20000" }
  if (r < 0.08) return { kind: "/sleep 20", message: "/sleep 20" }
  const n = Math.round(3 * Math.pow(100, rand()))
  const words: Array<string> = []
  for (let i = 0; i < n; i++) words.push(WORDS[Math.floor(rand() * WORDS.length)]!)
  return { kind: "text", message: words.join(" ") }
}

const STUCK_MS = 60_000

/** One session's prompting client: prompt, wait for the turn's end, again, until stopped. */
const promptLoop = async (c: SoakClient, activeSessionId: string, rand: () => number): Promise<void> => {
  while (!run.stopping && !c.closed) {
    const { kind, message } = nextPrompt(rand)
    const done = c.armTurn()
    const started = performance.now()
    let r: Msg
    try {
      r = await c.request({ type: "prompt", activeSessionId, message })
    } catch (e) {
      c.turn = undefined
      inc(run.promptErrors, (e as Error).message)
      await sleep(100)
      continue
    }
    if (r["success"] !== true) {
      c.turn = undefined
      const code = String(r["error"]?.code)
      inc(run.promptErrors, code)
      await sleep(code === "session_busy" ? 5 : 100)
      continue
    }
    inc(run.promptKinds, kind)
    let warned = false
    for (;;) {
      const interrupted = await Promise.race([done, sleep(STUCK_MS / 4).then(() => "waiting" as const)])
      if (interrupted !== "waiting") {
        run.win.turns++
        run.win.turnMs.add(Math.round(performance.now() - started))
        if (interrupted) run.interrupted++
        break
      }
      const waited = performance.now() - started
      if (waited >= STUCK_MS && !warned) {
        warned = true
        const what = `${c.label} (${activeSessionId}): a turn (${kind}) has not ended after ${Math.round(waited / 1000)} s; last cursor ${c.gen}:${c.seq}, waiting for ${c.turn?.phase === "idle" ? "the idle status" : "agent_end"}`
        run.stuckTurns.push(what)
        note(what)
      }
      if (run.stopping && waited >= STUCK_MS) return
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Sampling /proc
// ---------------------------------------------------------------------------------------------

const CLK_TCK = 100

/** Busy ticks of the whole machine (the `cpu` line of /proc/stat: all but idle and iowait). */
const machineBusyTicks = (): number => {
  try {
    const f = fs.readFileSync("/proc/stat", "utf8").split("\n", 1)[0]!.trim().split(/\s+/).slice(1).map(Number)
    return f.reduce((a, b) => a + b, 0) - (f[3] ?? 0) - (f[4] ?? 0)
  } catch {
    return NaN
  }
}
const LOOP_RESOLUTION_MS = 10

const fdCount = (pid: number): number => {
  try {
    return fs.readdirSync(`/proc/${pid}/fd`).length
  } catch {
    return NaN
  }
}

const dirBytes = (dir: string): number => {
  let total = 0
  let entries: Array<fs.Dirent>
  try {
    entries = fs.readdirSync(dir, { withFileTypes: true })
  } catch {
    return 0
  }
  for (const e of entries) {
    const p = path.join(dir, e.name)
    if (e.isDirectory()) total += dirBytes(p)
    else {
      try {
        total += fs.statSync(p).size
      } catch {
        // pruned meanwhile
      }
    }
  }
  return total
}

const procSnapshot = (pid: number, stateDir: string): ProcSnapshot & { workerPids: Array<number> } => {
  const workerPids = descendantsOf(pid)
  const workersRss = workerPids.map(rssOf).filter(Number.isFinite).reduce((a, b) => a + b, 0)
  return { daemonRss: rssOf(pid), fds: fdCount(pid), workers: workerPids.length, workersRss, diskBytes: dirBytes(stateDir), workerPids }
}

class Sampler {
  private last = performance.now()
  private lastCpu = process.cpuUsage()
  private lastDaemonTicks: number
  private lastMachineTicks = machineBusyTicks()
  private lastWorkerTicks = new Map<number, number>()
  /** The histogram records the whole interval between two of its timer ticks. */
  private readonly loop = monitorEventLoopDelay({ resolution: LOOP_RESOLUTION_MS })
  private timer: NodeJS.Timeout | undefined

  constructor(private readonly daemon: Daemon) {
    this.lastDaemonTicks = cpuTicksOf(daemon.pid) ?? 0
    for (const p of descendantsOf(daemon.pid)) this.lastWorkerTicks.set(p, cpuTicksOf(p) ?? 0)
    this.loop.enable()
  }

  start(everyMs: number): void {
    this.timer = setInterval(() => this.sample(), everyMs)
  }

  stop(): void {
    if (this.timer !== undefined) clearInterval(this.timer)
    this.timer = undefined
  }

  dispose(): void {
    this.stop()
    this.loop.disable()
  }

  /** Resets the interval counters (the start of the measured period). */
  restart(): void {
    this.last = performance.now()
    this.lastCpu = process.cpuUsage()
    this.lastMachineTicks = machineBusyTicks()
    this.lastDaemonTicks = cpuTicksOf(this.daemon.pid) ?? this.lastDaemonTicks
    run.win = new Stats()
    this.loop.reset()
  }

  sample(): Sample {
    const now = performance.now()
    const seconds = (now - this.last) / 1000
    this.last = now
    const w = run.win
    run.win = new Stats()
    if (run.measuring) run.total.merge(w)
    const cpu = process.cpuUsage(this.lastCpu)
    this.lastCpu = process.cpuUsage()
    const daemonTicks = cpuTicksOf(this.daemon.pid) ?? this.lastDaemonTicks
    const cpuDaemon = (daemonTicks - this.lastDaemonTicks) / CLK_TCK / seconds
    this.lastDaemonTicks = daemonTicks
    const snap = procSnapshot(this.daemon.pid, run.stateDir)
    let workerTicks = 0
    const next = new Map<number, number>()
    for (const p of snap.workerPids) {
      const t = cpuTicksOf(p)
      if (t === undefined) continue
      workerTicks += t - (this.lastWorkerTicks.get(p) ?? 0)
      next.set(p, t)
    }
    this.lastWorkerTicks = next
    const machineTicks = machineBusyTicks()
    const cpuMachine = (machineTicks - this.lastMachineTicks) / CLK_TCK / seconds
    this.lastMachineTicks = machineTicks
    const s: Sample = {
      t: (now - run.measureStart) / 60_000,
      measured: run.measuring,
      seconds,
      daemonRss: snap.daemonRss,
      fds: snap.fds,
      workers: snap.workers,
      workersRss: snap.workersRss,
      eventsPerS: w.events / seconds,
      emittedPerS: w.emitted / seconds,
      mbPerS: w.bytes / MiB / seconds,
      p50: w.latency.quantile(0.5),
      p99: w.latency.quantile(0.99),
      max: w.latency.n > 0 ? w.latency.max : NaN,
      turnsPerS: w.turns / seconds,
      cpuDaemon,
      cpuWorkers: workerTicks / CLK_TCK / seconds,
      cpuClient: (cpu.user + cpu.system) / 1e6 / seconds,
      cpuMachine,
      loopDelayP99: Math.max(0, this.loop.percentile(99) / 1e6 - LOOP_RESOLUTION_MS),
      replayed: w.replayed,
      diskBytes: snap.diskBytes
    }
    this.loop.reset()
    run.samples.push(s)
    printSample(s)
    return s
  }
}

const mb = (bytes: number) => (bytes / MiB).toFixed(1)
const ms = (v: number) => (Number.isFinite(v) ? String(Math.round(v)) : "-")

/** CPU used by processes other than the daemon, its workers and this one (cores). */
const other = (s: Sample) => Math.max(0, s.cpuMachine - s.cpuDaemon - s.cpuWorkers - s.cpuClient)

const printSample = (s: Sample) => {
  const when = s.measured ? `${s.t.toFixed(2).padStart(6)} min` : `warm-up   `
  console.log(
    `${when} | daemon ${mb(s.daemonRss)} MB ${s.fds} fds | ${s.workers} workers ${mb(s.workersRss)} MB | ` +
      `${shortNumber(s.eventsPerS)} ev/s (${shortNumber(s.emittedPerS)} emitted) ${s.mbPerS.toFixed(1)} MB/s | ` +
      `lat p50 ${ms(s.p50)} p99 ${ms(s.p99)} max ${ms(s.max)} ms | ${s.turnsPerS.toFixed(1)} turns/s | ` +
      `cpu d ${s.cpuDaemon.toFixed(2)} w ${s.cpuWorkers.toFixed(2)} c ${s.cpuClient.toFixed(2)} other ${other(s).toFixed(2)} (loop p99 ${s.loopDelayP99.toFixed(0)} ms) | ` +
      `disk ${mb(s.diskBytes)} MB${s.replayed > 0 ? ` | ${s.replayed} replayed` : ""}`
  )
}

// ---------------------------------------------------------------------------------------------
// The soak
// ---------------------------------------------------------------------------------------------

const inBatches = async <A>(items: ReadonlyArray<A>, size: number, f: (a: A) => Promise<void>): Promise<void> => {
  for (let i = 0; i < items.length; i += size) await Promise.all(items.slice(i, i + size).map(f))
}

const soak = async (o: Options): Promise<void> => {
  await withDaemon({}, async (daemon) => {
    run.daemonPid = daemon.pid
    run.mark = daemon.mark
    run.stateDir = daemon.stateDir
    const ctl = await SoakClient.connect(daemon.socketPath, "ctl", false)
    const ids: Array<string> = []
    for (let i = 0; i < o.sessions; i++) {
      const data = await ctl.ok({ type: "create", name: `soak-${i}` })
      ids.push(data["activeSessionId"] as string)
      daemon.recordWorker(data["state"])
    }
    for (const id of ids) {
      const deadline = Date.now() + 30_000
      for (;;) {
        const s = await ctl.ok({ type: "get_state", activeSessionId: id })
        daemon.recordWorker(s)
        if (s["worker"] === "ready" && s["busy"] === false) break
        if (Date.now() > deadline) throw new Error(`session ${id} not ready after 30 s: ${JSON.stringify(s)}`)
        await sleep(20)
      }
    }
    run.fdsBeforeClients = fdCount(daemon.pid)
    const clients: Array<SoakClient> = []
    const t0 = performance.now()
    await inBatches(Array.from({ length: o.clients }, (_, j) => j), 25, async (j) => {
      const c = await SoakClient.connect(daemon.socketPath, `c${j % o.sessions}.${Math.floor(j / o.sessions)}`, j < o.sessions)
      clients[j] = c
      await c.attach(ids[j % o.sessions]!)
    })
    const prompters = clients.slice(0, o.sessions)
    console.log(
      `${o.sessions} sessions, ${o.clients} clients attached in ${((performance.now() - t0) / 1000).toFixed(1)} s; ` +
        `daemon pid ${daemon.pid}, fds ${fdCount(daemon.pid)}, state dir ${daemon.stateDir}`
    )
    run.idleBefore = procSnapshot(daemon.pid, daemon.stateDir)

    const sampler = new Sampler(daemon)
    run.measureStart = performance.now() + o.warmupMs
    sampler.start(o.intervalMs)
    const rand = prng(o.seed)
    const loops = prompters.map((c, i) => promptLoop(c, ids[i]!, prng(Math.floor(rand() * 2 ** 32))))
    if (o.warmupMs > 0) await sleep(o.warmupMs)
    // The measured period: the sample clock restarts, totals count from here.
    sampler.stop()
    sampler.restart()
    run.measureStart = performance.now()
    run.measuring = true
    sampler.start(o.intervalMs)
    const end = run.measureStart + o.minutes * 60_000
    while (performance.now() < end - 5) await sleep(Math.min(1000, end - performance.now()))
    sampler.stop()
    // The last partial interval, if any time passed since the last sample.
    const lastT = run.samples[run.samples.length - 1]?.t ?? 0
    if ((performance.now() - run.measureStart) / 60_000 - lastT > 0.1 / 60) sampler.sample()
    sampler.dispose()
    run.measuring = false

    // Stop prompting; every turn in flight ends, then every client must reach the last cursor.
    run.stopping = true
    await Promise.all(loops)
    const lastCursors = new Map<string, Msg | undefined>()
    for (const id of ids) lastCursors.set(id, (await ctl.ok({ type: "get_state", activeSessionId: id }))["lastEventCursor"])
    const reached = (c: SoakClient, j: number) => {
      const want = lastCursors.get(ids[j % o.sessions]!)
      return want === undefined || c.gen > want["generation"] || (c.gen === want["generation"] && c.seq >= want["sequence"])
    }
    const deadline = Date.now() + 30_000
    while (Date.now() < deadline && !clients.every(reached)) await sleep(50)
    clients.forEach((c, j) => {
      if (!reached(c, j)) {
        const want = lastCursors.get(ids[j % o.sessions]!)
        run.behindAtEnd.push(`${c.label}: at ${c.gen}:${c.seq}, session's last event ${want?.["generation"]}:${want?.["sequence"]}${c.closed ? " (connection closed)" : ""}`)
      }
    })
    await sleep(1000)
    run.idleAfter = procSnapshot(daemon.pid, daemon.stateDir)
    for (const c of clients) c.close()
    ctl.close()
    // The daemon notices the closed connections at once; give it a moment.
    const fdDeadline = Date.now() + 5_000
    const expected = run.fdsBeforeClients - 1
    while (Date.now() < fdDeadline && fdCount(daemon.pid) > expected) await sleep(50)
    run.fdsAfterClientsClosed = fdCount(daemon.pid)
    // A connection whose client went away while attached stays open in the daemon until a write
    // to it fails (the daemon cannot tell a closed peer from a half-closed one): one more turn
    // per session, prompted from a fresh connection that is not attached, flushes them out.
    if (run.fdsAfterClientsClosed > expected) {
      const ctl2 = await SoakClient.connect(daemon.socketPath, "ctl2", false)
      for (const id of ids) {
        const before = (await ctl2.ok({ type: "get_state", activeSessionId: id }))["lastEventCursor"]
        await ctl2.ok({ type: "prompt", activeSessionId: id, message: "one more turn" })
        const turnDeadline = Date.now() + 30_000
        for (;;) {
          const s = await ctl2.ok({ type: "get_state", activeSessionId: id })
          if (s["busy"] === false && JSON.stringify(s["lastEventCursor"]) !== JSON.stringify(before)) break
          if (Date.now() > turnDeadline) break
          await sleep(20)
        }
      }
      const deadline2 = Date.now() + 5_000
      while (Date.now() < deadline2 && fdCount(daemon.pid) > run.fdsBeforeClients) await sleep(50)
      run.fdsAfterNextTurn = fdCount(daemon.pid)
      ctl2.close()
    }
  })
}

// ---------------------------------------------------------------------------------------------
// Baseline: a plain node:net server writing lines of the same shape
// ---------------------------------------------------------------------------------------------

interface BaselineResult {
  readonly eventsPerS: number
  readonly emittedPerS: number
  readonly p50: number
  readonly p99: number
  readonly max: number
  readonly cpuClient: number
  readonly violations: number
}

const FAKE_SERVER_SRC = `
const net = require("net")
const [socketPath, sessionsArg, clientsArg, rateArg] = process.argv.slice(1)
const S = Number(sessionsArg), C = Number(clientsArg), rate = Number(rateArg)
const groups = Array.from({ length: S }, () => [])
const ids = Array.from({ length: S }, (_, s) => "s-" + String(s).padStart(8, "0") + "-0000-4000-8000-000000000000")
let connected = 0
const line = (s, seq, now) => '{"type":"session_event","event":{"type":"message_update","messageId":"t-' + ids[s].slice(2) +
  '-a","delta":" w' + (seq % 1000) + '"},"activeSessionId":"' + ids[s] + '","meta":{"cursor":{"generation":1,"sequence":' + seq +
  '},"emittedAt":' + now + '}}\\n'
const seqs = new Array(S).fill(0)
const batch = (s, n) => { const now = Date.now(); let t = ""; for (let i = 0; i < n; i++) t += line(s, seqs[s]++, now); return t }
const unpaced = (s) => {
  const socks = groups[s]
  const step = () => {
    const text = batch(s, 64)
    const waits = []
    for (const k of socks) if (!k.write(text)) waits.push(new Promise((r) => k.once("drain", r)))
    if (waits.length > 0) Promise.all(waits).then(step)
    else setImmediate(step)
  }
  step()
}
const paced = () => {
  const t0 = Date.now()
  setInterval(() => {
    const target = Math.floor((rate * (Date.now() - t0)) / 1000)
    for (let s = 0; s < S; s++) {
      const n = Math.min(target - seqs[s], 5000)
      if (n <= 0 || groups[s].some((k) => k.writableLength > 8 * 1024 * 1024)) continue
      const text = batch(s, n)
      for (const k of groups[s]) k.write(text)
    }
  }, 2)
}
net.createServer((sock) => {
  sock.on("error", () => {})
  groups[connected % S].push(sock)
  connected++
  sock.write('{"type":"daemon_hello"}\\n')
  if (connected === C) {
    if (rate > 0) paced()
    else for (let s = 0; s < S; s++) unpaced(s)
  }
}).listen(socketPath, () => process.stdout.write("ready\\n"))
`

let baselineChild: ChildProcess | undefined

const killBaselineChild = () => {
  if (baselineChild !== undefined && baselineChild.exitCode === null && baselineChild.signalCode === null) baselineChild.kill("SIGKILL")
}

const runBaseline = async (o: Options, ratePerSession: number): Promise<BaselineResult> => {
  const dir = fs.mkdtempSync(path.join(os.tmpdir(), "agentd-soak-baseline-"))
  const clients: Array<SoakClient> = []
  const violationsBefore = run.violations
  try {
    const socketPath = path.join(dir, "s.sock")
    const child = spawn(process.execPath, ["-e", FAKE_SERVER_SRC, socketPath, String(o.sessions), String(o.clients), String(ratePerSession)], {
      stdio: ["ignore", "pipe", "inherit"]
    })
    baselineChild = child
    await new Promise<void>((resolve, reject) => {
      child.once("error", reject)
      child.once("exit", (code, signal) => reject(new Error(`baseline server exited early (code ${code}, signal ${signal})`)))
      child.stdout!.once("data", () => resolve())
    })
    for (let j = 0; j < o.clients; j++) clients.push(await SoakClient.connect(socketPath, `b${j % o.sessions}.${Math.floor(j / o.sessions)}`, j < o.sessions))
    await sleep(1000)
    run.win = new Stats()
    const started = performance.now()
    const cpu = process.cpuUsage()
    await sleep(o.baselineMs)
    const w = run.win
    const seconds = (performance.now() - started) / 1000
    const used = process.cpuUsage(cpu)
    return {
      eventsPerS: w.events / seconds,
      emittedPerS: w.emitted / seconds,
      p50: w.latency.quantile(0.5),
      p99: w.latency.quantile(0.99),
      max: w.latency.max,
      cpuClient: (used.user + used.system) / 1e6 / seconds,
      violations: run.violations - violationsBefore
    }
  } finally {
    for (const c of clients) c.close()
    killBaselineChild()
    if (baselineChild !== undefined && baselineChild.exitCode === null && baselineChild.signalCode === null) {
      await new Promise((r) => baselineChild!.once("exit", r))
    }
    baselineChild = undefined
    fs.rmSync(dir, { recursive: true, force: true })
  }
}

// ---------------------------------------------------------------------------------------------
// The report
// ---------------------------------------------------------------------------------------------

const fmtInt = (n: number) => Math.round(n).toLocaleString("en-US")

const trend = (points: ReadonlyArray<Point>, unit: string, scale = 1): string => {
  const k = slope(points) / scale
  return Number.isFinite(k) ? `${k >= 0 ? "+" : ""}${k.toFixed(Math.abs(k) >= 10 ? 1 : 3)} ${unit}/min` : "-"
}

const mapLine = (m: Map<string, number>) => [...m.entries()].sort((a, b) => b[1] - a[1]).map(([k, v]) => `${k} ${fmtInt(v)}`).join(", ")

/** Prints the summary and the charts and writes the SVG; synchronous (also used on Ctrl-C). */
const report = (o: Options, interrupted: boolean): void => {
  const measured = run.samples.filter((s) => s.measured)
  const t = run.total
  const seconds = measured.reduce((a, s) => a + s.seconds, 0)
  const first = measured[0]
  const last = measured[measured.length - 1]
  const pts = (f: (s: Sample) => number) => measured.map((s) => ({ x: s.t, y: f(s) }))
  console.log(`\n## soak report${interrupted ? " (INTERRUPTED: figures so far)" : ""}`)
  console.log(
    `setup: ${o.sessions} sessions, ${o.clients} clients (${o.clients / o.sessions} per session), ${o.minutes} min measured after ` +
      `${(o.warmupMs / 1000).toFixed(0)} s warm-up, ${measured.length} samples every ${(o.intervalMs / 1000).toFixed(1)} s, daemon defaults (faults off), ${os.cpus().length} CPUs`
  )
  if (seconds === 0) console.log("(no measured period yet: the figures below are empty)")
  console.log(
    `events: ${fmtInt(t.events)} delivered (${fmtInt(t.emitted)} emitted x ${o.clients / o.sessions} clients each) in ${seconds.toFixed(1)} s = ` +
      `${fmtInt(t.events / seconds)} events/s delivered, ${fmtInt(t.emitted / seconds)} emitted/s, ${(t.bytes / MiB / seconds).toFixed(1)} MB/s`
  )
  console.log(
    `latency emittedAt -> client (all ${fmtInt(t.latency.n)} events): p50 ${ms(t.latency.quantile(0.5))} ms, p99 ${ms(t.latency.quantile(0.99))} ms, ` +
      `p99.9 ${ms(t.latency.quantile(0.999))} ms, max ${ms(t.latency.max)} ms${t.latency.negative > 0 ? ` (${t.latency.negative} negative, counted as 0)` : ""}`
  )
  console.log(
    `latency engine message.timestamp -> client (${fmtInt(t.engineLatency.n)} message_start): p50 ${ms(t.engineLatency.quantile(0.5))} ms, ` +
      `p99 ${ms(t.engineLatency.quantile(0.99))} ms, max ${ms(t.engineLatency.max)} ms`
  )
  console.log(
    `turns: ${fmtInt(t.turns)} (${(t.turns / seconds).toFixed(1)}/s), prompt to idle p50 ${ms(t.turnMs.quantile(0.5))} ms, p99 ${ms(t.turnMs.quantile(0.99))} ms, ` +
      `max ${ms(t.turnMs.max)} ms; prompts sent (whole run): ${mapLine(run.promptKinds)}`
  )
  console.log(`event types (one client per session, whole run): ${mapLine(run.eventTypes)}`)
  console.log(
    `cursor violations: ${run.violations}; resync/replacement snapshots: ${run.resyncs}; replayed events during the measured period: ${fmtInt(t.replayed)}; ` +
      `interrupted turns: ${run.interrupted}; prompt errors: ${run.promptErrors.size === 0 ? 0 : mapLine(run.promptErrors)}; ` +
      `session_closed: ${run.unexpectedClosed}; unparsable lines: ${run.badLines}; lines off the fast path: ${run.slowSequenced}`
  )
  for (const v of run.violationNotes) console.log(`  violation: ${v}`)
  if (run.violations > run.violationNotes.length) console.log(`  ... and ${run.violations - run.violationNotes.length} more`)
  for (const s of run.stuckTurns) console.log(`  stuck: ${s}`)
  console.log(
    `end check: ${run.behindAtEnd.length === 0 ? (interrupted ? "not reached" : "every client reached its session's last cursor") : `${run.behindAtEnd.length} clients behind`}`
  )
  for (const b of run.behindAtEnd.slice(0, 20)) console.log(`  behind: ${b}`)
  if (first !== undefined && last !== undefined) {
    const b = run.idleBefore
    const a = run.idleAfter
    console.log(
      `daemon RSS: idle before load ${b === undefined ? "-" : mb(b.daemonRss)} MB | start ${mb(first.daemonRss)} MB | end ${mb(last.daemonRss)} MB | ` +
        `max ${mb(Math.max(...measured.map((s) => s.daemonRss)))} MB | idle after load ${a === undefined ? "-" : mb(a.daemonRss)} MB | trend ${trend(pts((s) => s.daemonRss), "MB", MiB)}`
    )
    console.log(
      `daemon fds: before clients ${run.fdsBeforeClients} | idle before load ${b?.fds ?? "-"} | start ${first.fds} | end ${last.fds} | ` +
        `max ${Math.max(...measured.map((s) => s.fds))} | idle after load ${a?.fds ?? "-"} | after all clients closed ${run.fdsAfterClientsClosed}` +
        `${Number.isNaN(run.fdsAfterNextTurn) ? "" : ` | after one more turn per session ${run.fdsAfterNextTurn}`} | trend ${trend(pts((s) => s.fds), "fds")}`
    )
    if (run.fdsAfterClientsClosed > run.fdsBeforeClients) {
      console.log(
        `  (closed clients' connections still held by the daemon ${run.fdsAfterClientsClosed >= run.fdsBeforeClients ? run.fdsAfterClientsClosed - run.fdsBeforeClients + 1 : 0}` +
          ` fds after 5 s with idle sessions; they ${Number.isNaN(run.fdsAfterNextTurn) ? "-" : run.fdsAfterNextTurn <= run.fdsBeforeClients ? "were released by the next event written to them" : "were NOT released by the next turn either"})`
      )
    }
    console.log(
      `workers: ${first.workers} -> ${last.workers} processes, total RSS idle before load ${b === undefined ? "-" : mb(b.workersRss)} MB | start ${mb(first.workersRss)} MB | ` +
        `end ${mb(last.workersRss)} MB | idle after load ${a === undefined ? "-" : mb(a.workersRss)} MB | trend ${trend(pts((s) => s.workersRss), "MB", MiB)}`
    )
    console.log(`state dir: start ${mb(first.diskBytes)} MB, end ${mb(last.diskBytes)} MB, trend ${trend(pts((s) => s.diskBytes), "MB", MiB)}`)
    const mean = (f: (s: Sample) => number) => measured.reduce((acc, s) => acc + f(s) * s.seconds, 0) / seconds
    console.log(
      `cpu (cores, mean): daemon ${mean((s) => s.cpuDaemon).toFixed(2)}, workers ${mean((s) => s.cpuWorkers).toFixed(2)}, this client process ` +
        `${mean((s) => s.cpuClient).toFixed(2)} (max ${Math.max(...measured.map((s) => s.cpuClient)).toFixed(2)}), client event-loop delay p99 max ` +
        `${Math.max(...measured.map((s) => s.loopDelayP99)).toFixed(0)} ms; other processes on the machine ${mean(other).toFixed(2)} ` +
        `(of ${os.cpus().length} cores; the machine was ${mean((s) => s.cpuMachine).toFixed(2)} cores busy)`
    )
  }
  if (run.baselinePaced !== undefined || run.baselineMax !== undefined) {
    const ours = t.events / seconds
    for (const [name, r] of [["paced at agentd's emitted rate", run.baselinePaced], ["unpaced", run.baselineMax]] as const) {
      if (r === undefined) continue
      console.log(
        `baseline (plain node:net server process, same clients, ${name}): ${fmtInt(r.eventsPerS)} events/s delivered, latency p50 ${ms(r.p50)} ms, ` +
          `p99 ${ms(r.p99)} ms, max ${ms(r.max)} ms, client cpu ${r.cpuClient.toFixed(2)} cores, violations ${r.violations}` +
          (name === "unpaced" ? ` | agentd/baseline events/s ${(ours / r.eventsPerS).toFixed(2)}x` : "")
      )
    }
  }
  for (const n of run.notes.slice(0, 20)) console.log(`  note: ${n}`)
  if (run.leftoverProcesses.length > 0) console.log(`LEFTOVER PROCESSES: ${run.leftoverProcesses.join(", ")}`)
  if (measured.length > 0) {
    console.log("")
    console.log(terminalChart(pts((s) => s.daemonRss / MiB), { title: "daemon RSS (MB) over minutes" }))
    console.log("")
    console.log(terminalChart(pts((s) => s.fds), { title: "daemon open fds over minutes" }))
    console.log("")
    console.log(terminalChart(pts((s) => s.eventsPerS), { title: "events/s delivered over minutes", reduce: "mean", minSpanFraction: 0.2 }))
    const svg = svgChart(
      `agentd soak: ${o.sessions} sessions, ${o.clients} clients, ${o.minutes} min${interrupted ? " (interrupted)" : ""}`,
      `${fmtInt(t.events / seconds)} events/s delivered, latency p50 ${ms(t.latency.quantile(0.5))} ms p99 ${ms(t.latency.quantile(0.99))} ms, ` +
        `cursor violations ${run.violations}; ${new Date().toISOString()}`,
      [
        { title: "daemon RSS (MB)", series: [{ name: "daemon VmRSS", color: "#1f6feb", points: pts((s) => s.daemonRss / MiB) }] },
        { title: "daemon open fds", series: [{ name: "/proc/pid/fd", color: "#d1242f", points: pts((s) => s.fds) }] },
        {
          title: "events/s",
          fromZero: true,
          series: [
            { name: "delivered", color: "#1a7f37", points: pts((s) => s.eventsPerS) },
            { name: "emitted", color: "#8250df", points: pts((s) => s.emittedPerS), dashed: true }
          ]
        },
        { title: "workers total RSS (MB)", series: [{ name: "workers VmRSS", color: "#bc4c00", points: pts((s) => s.workersRss / MiB) }] },
        {
          title: "latency emittedAt -> client (ms)",
          fromZero: true,
          series: [
            { name: "p50", color: "#1f6feb", points: pts((s) => s.p50) },
            { name: "p99", color: "#d1242f", points: pts((s) => s.p99) }
          ]
        }
      ]
    )
    try {
      fs.writeFileSync(o.svgPath, svg)
      console.log(`\nSVG chart: ${o.svgPath}`)
    } catch (e) {
      console.log(`\nSVG chart: cannot write ${o.svgPath}: ${String(e)}`)
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Main
// ---------------------------------------------------------------------------------------------

const main = async () => {
  const o = parseOptions(process.argv.slice(2))
  run.options = o
  // Registered before the harness's own handlers (installed when the daemon starts), so this
  // runs first: report what was measured, then exit; the harness's exit hook kills the daemon
  // and its workers and removes the temp dir.
  let reported = false
  for (const signal of ["SIGINT", "SIGTERM"] as const) {
    process.once(signal, () => {
      killBaselineChild()
      if (!reported) {
        reported = true
        try {
          report(o, true)
        } catch (e) {
          console.error(`report failed: ${String(e)}`)
        }
      }
      process.exit(signal === "SIGINT" ? 130 : 143)
    })
  }
  process.once("exit", killBaselineChild)
  console.log(
    `agentd soak: ${o.minutes} min measured (after ${(o.warmupMs / 1000).toFixed(0)} s warm-up), ${o.sessions} sessions, ${o.clients} clients, ` +
      `sample every ${(o.intervalMs / 1000).toFixed(1)} s`
  )
  await soak(o)
  // The harness has stopped the daemon: nothing carrying its mark may be left.
  const leftovers = processesWithEnv("AGENTD_BENCH_MARK", run.mark)
  run.leftoverProcesses = leftovers
  console.log(
    `daemon stopped; processes left with its mark: ${leftovers.length === 0 ? "none" : leftovers.join(", ")}; ` +
      `temp dir ${fs.existsSync(run.stateDir) ? "STILL THERE" : "removed"}`
  )
  if (o.baselineMs > 0) {
    const seconds = run.samples.filter((s) => s.measured).reduce((a, s) => a + s.seconds, 0)
    const ratePerSession = run.total.emitted / seconds / o.sessions
    console.log(`baseline: node:net server, ${(o.baselineMs / 1000).toFixed(0)} s paced at ${fmtInt(ratePerSession)} events/s per session, then ${(o.baselineMs / 1000).toFixed(0)} s unpaced`)
    if (ratePerSession > 0) run.baselinePaced = await runBaseline(o, ratePerSession)
    run.baselineMax = await runBaseline(o, 0)
  }
  reported = true
  report(o, false)
}

await main()
