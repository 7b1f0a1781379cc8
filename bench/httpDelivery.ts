/**
 * Live delivery over HTTP SSE next to the socket's, in the same run and on the same daemon: one
 * long turn (WORDS words: one `message_update` per word, plus the `echo:` delta) timed from the
 * `prompt` until every client has every `message_update`, with 1 and 100 clients, each its own
 * connection. Socket clients attach from the session's last cursor; SSE clients read
 * `/v1/sessions/:id/events?offset=<tail>&live=sse`. Both clients do what a real one does: the
 * socket client splits lines and `JSON.parse`s each; the SSE client parses the stream as a
 * browser's EventSource does (lines, `event:`/`id:`/`data:` fields, data lines joined, one
 * event dispatched per blank line) and `JSON.parse`s each data event. Aggregate events/s =
 * events x clients / time; the figure is SSE / socket (target 0.7).
 *
 * Next to it, the daemon's own CPU time per delivered event (utime + stime of its process from
 * /proc, over each timed turn, summed over the runs): far less noisy than wall-clock on a loaded
 * machine, and what the SSE path costs more than the socket's is what delivery does differently.
 * The load average is printed beside every figure.
 *
 * Settings (environment): AGENTD_BENCH_HTTP_RUNS (turns per kind and client count, default 5),
 * AGENTD_BENCH_HTTP_CLIENTS (default `1,100`), AGENTD_BENCH_HTTP_ONLY (`sse` or `socket`: time
 * only that kind, e.g. to profile it), AGENTD_BENCH_HTTP_NODE_ARGS (the daemon's Node flags, e.g.
 * `--cpu-prof --cpu-prof-dir=/tmp/prof`: a profile is written when the daemon stops, so stop it
 * with SIGTERM, which the bench's cleanup does not; see `profileExit` below).
 */
import * as http from "node:http"
import * as os from "node:os"
import * as fs from "node:fs"
import { type Client, createSession, type Daemon, isIdleStatus, type Msg, nowMs, runTurn, sleep, waitReady } from "./daemonHarness.js"
import { get, NO_AUTO_CHECKPOINT, withHttpDaemon } from "./httpHarness.js"
import { printRatio } from "./report.js"

const WORDS = 20_000
const EVENTS = WORDS + 1
const CLIENT_COUNTS = (process.env["AGENTD_BENCH_HTTP_CLIENTS"] ?? "1,100").split(",").map(Number)
const RUNS = Number(process.env["AGENTD_BENCH_HTTP_RUNS"] ?? 5)
const ONLY = process.env["AGENTD_BENCH_HTTP_ONLY"]
const NODE_ARGS = (process.env["AGENTD_BENCH_HTTP_NODE_ARGS"] ?? "").split(" ").filter((a) => a.length > 0)
const WARM_UP_TURNS = 3
const TIMEOUT_MS = 120_000
/** Microseconds per clock tick of /proc/<pid>/stat (USER_HZ is 100 on Linux). */
const TICK_US = 10_000

const message = (): string => Array.from({ length: WORDS }, (_, i) => `w${i}`).join(" ")
const median = (xs: ReadonlyArray<number>) => [...xs].sort((a, b) => a - b)[Math.floor(xs.length / 2)]!
const load = () => os.loadavg().map((l) => l.toFixed(2)).join(" ")

const isUpdate = (m: Msg): boolean => m["type"] === "session_event" && m["event"]?.["type"] === "message_update"

const withTimeout = <A>(p: Promise<A>, ms: number, what: () => string): Promise<A> => {
  let timer: NodeJS.Timeout | undefined
  const timeout = new Promise<never>((_, reject) => {
    timer = setTimeout(() => reject(new Error(`timed out after ${ms} ms: ${what()}`)), ms)
  })
  return Promise.race([p, timeout]).finally(() => clearTimeout(timer))
}

/**
 * An SSE stream parsed as EventSource parses it (WHATWG HTML, "event stream interpretation"):
 * lines end with LF, CR LF or CR; a blank line dispatches the event; `data` lines are joined with
 * LF; `id` sets the last event id; comments (`:`) are ignored. Lines are read in place in the
 * chunk's text (no string per line but the values kept), as a native EventSource does.
 */
class SseParser {
  lastEventId = ""
  private carry = ""
  private dataLines: Array<string> = []
  private eventType = ""
  private pendingCr = false

  constructor(private readonly dispatch: (type: string, data: string, lastEventId: string) => void) {}

  push(text: string): void {
    let all = this.carry.length === 0 ? text : this.carry + text
    if (this.pendingCr && all.charCodeAt(0) === 10) all = all.slice(1)
    this.pendingCr = false
    let start = 0
    // Found once, and again only once passed: no scan of the rest per line when there is no CR.
    let cr = all.indexOf("\r")
    for (;;) {
      if (cr >= 0 && cr < start) cr = all.indexOf("\r", start)
      const lf = all.indexOf("\n", start)
      if (cr >= 0 && (lf < 0 || cr < lf)) {
        this.line(all, start, cr)
        if (cr + 1 === all.length) this.pendingCr = true
        start = all.charCodeAt(cr + 1) === 10 ? cr + 2 : cr + 1
      } else if (lf >= 0) {
        this.line(all, start, lf)
        start = lf + 1
      } else break
    }
    this.carry = start === 0 ? all : all.slice(start)
  }

  /** The line `all[start, end)`. */
  private line(all: string, start: number, end: number): void {
    if (start === end) {
      if (this.dataLines.length > 0) this.dispatch(this.eventType || "message", this.dataLines.join("\n"), this.lastEventId)
      this.dataLines = []
      this.eventType = ""
      return
    }
    if (all.charCodeAt(start) === 58) return
    let colon = all.indexOf(":", start)
    if (colon < 0 || colon > end) colon = end
    // The value: after the colon and one space, if any.
    let from = colon === end ? end : colon + 1
    if (from < end && all.charCodeAt(from) === 32) from++
    const field = colon - start
    if (field === 4 && all.startsWith("data", start)) this.dataLines.push(all.slice(from, end))
    else if (field === 5 && all.startsWith("event", start)) this.eventType = all.slice(from, end)
    else if (field === 2 && all.startsWith("id", start)) {
      const id = all.slice(from, end)
      if (!id.includes("\0")) this.lastEventId = id
    }
  }
}

/** SSE data events received (all readers): how finely the daemon batches. */
let sseDataEvents = 0

/** One SSE reader: every data event's array parsed, `onUpdate` per `message_update`; `close` ends it. */
const sseReader = (port: number, token: string, target: string, onUpdate: () => void) =>
  new Promise<{ readonly close: () => void }>((resolve, reject) => {
    const req = http.request({ host: "127.0.0.1", port, path: target, headers: { authorization: `Bearer ${token}` }, agent: false })
    req.on("error", reject)
    req.on("response", (res) => {
      if (res.statusCode !== 200) return reject(new Error(`SSE answered ${res.statusCode}`))
      res.setEncoding("utf8")
      const parser = new SseParser((type, data) => {
        if (type !== "data") return
        sseDataEvents++
        for (const m of JSON.parse(data) as Array<Msg>) if (isUpdate(m)) onUpdate()
      })
      res.on("data", (text: string) => parser.push(text))
      res.on("error", () => {})
      resolve({ close: () => req.destroy() })
    })
    req.end()
  })

/** User and system CPU ticks of a process (fields 14 and 15 of /proc/<pid>/stat). */
const cpuTicks = (pid: number): { readonly user: number; readonly system: number } => {
  const stat = fs.readFileSync(`/proc/${pid}/stat`, "utf8")
  const fields = stat.slice(stat.lastIndexOf(")") + 2).split(" ")
  return { user: Number(fields[11]), system: Number(fields[12]) }
}

/** What one timed turn gave: aggregate events/s and the daemon's CPU ticks over it. */
interface Turn {
  readonly rate: number
  readonly ticks: number
  /** Of which in the kernel (system time). */
  readonly systemTicks: number
  /** The clients' CPU time (this process's) over the turn, in microseconds. */
  readonly clientUs: number
  /** SSE only: data events per reader over the turn. */
  readonly dataEvents?: number
}

const measureSocket = async (daemon: Daemon, ctl: Client, id: string, n: number): Promise<Turn> => {
  const clients: Array<Client> = []
  try {
    const resumeCursor = (await ctl.ok({ type: "get_state", activeSessionId: id }))["lastEventCursor"]
    for (let i = 0; i < n; i++) {
      const c = await daemon.connect(`s${n}-${i}`)
      clients.push(c)
      await c.ok({ type: "attach", activeSessionId: id, capabilities: ["event_sequence", "slim_attach"], resumeCursor })
      await c.waitFor((m) => m["type"] === "session_attached", 15_000, "session_attached")
      c.drain()
    }
    const counts = clients.map(() => 0)
    let complete = 0
    let resolve!: () => void
    const done = new Promise<void>((r) => (resolve = r))
    clients.forEach((client, i) => {
      client.messageHook = (m) => {
        if (!isUpdate(m)) return false
        if (++counts[i]! === EVENTS && ++complete === clients.length) resolve()
        return true
      }
    })
    const text = message()
    const before = cpuTicks(daemon.pid)
    const clientBefore = process.cpuUsage()
    const started = nowMs()
    await ctl.ok({ type: "prompt", activeSessionId: id, message: text })
    await withTimeout(done, TIMEOUT_MS, () => `socket: ${counts.join(",")}`)
    const seconds = (nowMs() - started) / 1000
    const after = cpuTicks(daemon.pid)
    const client = process.cpuUsage(clientBefore)
    await Promise.all(clients.map((c) => c.waitFor((m) => m["activeSessionId"] === id && isIdleStatus(m), 30_000, "idle")))
    return { rate: (EVENTS * n) / seconds, ticks: after.user + after.system - before.user - before.system, systemTicks: after.system - before.system, clientUs: client.user + client.system }
  } finally {
    for (const c of clients) c.close()
  }
}

const measureSse = async (daemon: Daemon, port: number, token: string, ctl: Client, id: string, n: number): Promise<Turn> => {
  const readers: Array<{ readonly close: () => void }> = []
  try {
    const counts = Array.from({ length: n }, () => 0)
    let complete = 0
    let resolve!: () => void
    const done = new Promise<void>((r) => (resolve = r))
    for (let i = 0; i < n; i++) {
      readers.push(await sseReader(port, token, `/v1/sessions/${id}/events?offset=now&live=sse`, () => {
        if (++counts[i]! === EVENTS && ++complete === n) resolve()
      }))
    }
    await sleep(200)
    sseDataEvents = 0
    const text = message()
    const before = cpuTicks(daemon.pid)
    const clientBefore = process.cpuUsage()
    const started = nowMs()
    await ctl.ok({ type: "prompt", activeSessionId: id, message: text })
    await withTimeout(done, TIMEOUT_MS, () => `SSE: ${counts.join(",")}`)
    const seconds = (nowMs() - started) / 1000
    const after = cpuTicks(daemon.pid)
    const client = process.cpuUsage(clientBefore)
    await waitReady(ctl, id, 30_000)
    const wrong = counts.filter((k) => k !== EVENTS)
    if (wrong.length > 0) throw new Error(`SSE readers got ${wrong.join(",")} updates, expected ${EVENTS}`)
    return { rate: (EVENTS * n) / seconds, ticks: after.user + after.system - before.user - before.system, systemTicks: after.system - before.system, clientUs: client.user + client.system, dataEvents: sseDataEvents / n }
  } finally {
    for (const r of readers) r.close()
  }
}

/** The daemon's count of slow-client pauses so far (readers that fell an outbox behind, then caught up from the log). */
const pausesOf = async (port: number, token: string): Promise<number> => {
  const res = await get({ port, token }, "/metrics")
  return Number(/^agentd_slow_client_pauses_total(?:\{[^}]*\})? (\d+)/m.exec(res.text)?.[1] ?? 0)
}

/** Daemon CPU per delivered event in microseconds, over all of `turns`. */
const cpuPerEvent = (turns: ReadonlyArray<Turn>, n: number, pick: (t: Turn) => number = (t) => t.ticks) =>
  (turns.reduce((sum, t) => sum + pick(t), 0) * TICK_US) / (turns.length * EVENTS * n)

/** The clients' CPU per delivered event, in microseconds. */
const clientPerEvent = (turns: ReadonlyArray<Turn>, n: number) => turns.reduce((sum, t) => sum + t.clientUs, 0) / (turns.length * EVENTS * n)

/** `<all> us (<system> in the kernel)`. */
const cpuText = (turns: ReadonlyArray<Turn>, n: number) =>
  `${cpuPerEvent(turns, n).toFixed(2)} us (${cpuPerEvent(turns, n, (t) => t.systemTicks).toFixed(2)} system)`

/** Median over turns of the events per SSE data event a reader got. */
const eventsPerDataEvent = (turns: ReadonlyArray<Turn>) => Math.round(median(turns.map((t) => EVENTS / (t.dataEvents ?? NaN))))

export default async function httpDelivery(): Promise<void> {
  await withHttpDaemon(
    { env: NO_AUTO_CHECKPOINT, nodeArgs: NODE_ARGS },
    async ({ daemon, port, token }) => {
      const ctl = await daemon.connect("ctl")
      const { id } = await createSession(ctl)
      await waitReady(ctl, id)
      const watcher = await daemon.connect("warmup")
      await watcher.ok({ type: "attach", activeSessionId: id, capabilities: ["event_sequence", "slim_attach"] })
      for (let i = 0; i < WARM_UP_TURNS; i++) await runTurn(watcher, id, message())
      watcher.close()
      // One SSE turn to warm the HTTP path too.
      await measureSse(daemon, port, token, ctl, id, 1)
      for (const n of CLIENT_COUNTS) {
        await ctl.ok({ type: "checkpoint", activeSessionId: id }, 60_000)
        const socket: Array<Turn> = []
        const sse: Array<Turn> = []
        // Interleaved, so that drift in the machine's load hits both alike.
        let socketPauses = 0
        let ssePauses = 0
        for (let i = 0; i < RUNS; i++) {
          const p0 = await pausesOf(port, token)
          if (ONLY !== "sse") socket.push(await measureSocket(daemon, ctl, id, n))
          const p1 = await pausesOf(port, token)
          if (ONLY !== "socket") sse.push(await measureSse(daemon, port, token, ctl, id, n))
          socketPauses += p1 - p0
          ssePauses += (await pausesOf(port, token)) - p1
        }
        const what = `live delivery of ${EVENTS} message_update events to ${n} client${n === 1 ? "" : "s"} over SSE`
        if (ONLY === undefined) {
          printRatio({
            what: `${what} (aggregate)`,
            unit: "events/s",
            ours: median(sse.map((t) => t.rate)),
            baseline: median(socket.map((t) => t.rate)),
            baselineName: "the same daemon's socket",
            target: 0.7
          })
          const sseUs = cpuPerEvent(sse, n)
          const socketUs = cpuPerEvent(socket, n)
          console.log(
            `${what}, daemon CPU per delivered event over ${RUNS} turns: SSE ${cpuText(sse, n)} | socket ${cpuText(socket, n)} | ` +
              `ratio socket/SSE ${(socketUs / sseUs).toFixed(2)}x (higher is better) | ${eventsPerDataEvent(sse)} events per SSE data event | ` +
              `slow-reader pauses: SSE ${ssePauses}, socket ${socketPauses} | ` +
              `the clients' own CPU per event: SSE ${clientPerEvent(sse, n).toFixed(2)} us, socket ${clientPerEvent(socket, n).toFixed(2)} us | ` +
              `load average ${load()}`
          )
        } else {
          const turns = ONLY === "sse" ? sse : socket
          console.log(
            `${ONLY} only, ${n} client(s): median ${Math.round(median(turns.map((t) => t.rate)))} events/s, daemon CPU per delivered event ` +
              `${cpuText(turns, n)}${ONLY === "sse" ? ` | ${eventsPerDataEvent(sse)} events per SSE data event` : ""} | load average ${load()}`
          )
        }
      }
      if (NODE_ARGS.length > 0) await profileExit(daemon)
    }
  )
}

/** Stops the daemon with SIGTERM and waits for it: Node writes `--cpu-prof` profiles only at a clean exit. */
const profileExit = async (daemon: Daemon): Promise<void> => {
  daemon.stopping = true
  process.kill(daemon.pid, "SIGTERM")
  await Promise.race([daemon.exited, sleep(15_000)])
}
