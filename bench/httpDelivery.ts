/**
 * Live delivery over HTTP SSE next to the socket's, in the same run and on the same daemon: one
 * long turn (WORDS words: one `message_update` per word, plus the `echo:` delta) timed from the
 * `prompt` until every client has every `message_update`, with 1 and 100 clients, each its own
 * connection. Socket clients attach from the session's last cursor; SSE clients read
 * `/v1/sessions/:id/events?offset=<tail>&live=sse`. Both count lines by a substring check without
 * parsing. Aggregate events/s = events x clients / time; the figure is SSE / socket (target 0.7).
 */
import * as http from "node:http"
import { type Client, createSession, type Daemon, isIdleStatus, nowMs, runTurn, sleep, waitReady } from "./daemonHarness.js"
import { NO_AUTO_CHECKPOINT, withHttpDaemon } from "./httpHarness.js"
import { printRatio } from "./report.js"

const WORDS = 20_000
const EVENTS = WORDS + 1
const CLIENT_COUNTS = [1, 100] as const
const RUNS = 3
const WARM_UP_TURNS = 3
const TIMEOUT_MS = 120_000
const UPDATE_MARK = '"type":"message_update"'

const message = (): string => Array.from({ length: WORDS }, (_, i) => `w${i}`).join(" ")
const median = (xs: ReadonlyArray<number>) => [...xs].sort((a, b) => a - b)[Math.floor(xs.length / 2)]!

const withTimeout = <A>(p: Promise<A>, ms: number, what: () => string): Promise<A> => {
  let timer: NodeJS.Timeout | undefined
  const timeout = new Promise<never>((_, reject) => {
    timer = setTimeout(() => reject(new Error(`timed out after ${ms} ms: ${what()}`)), ms)
  })
  return Promise.race([p, timeout]).finally(() => clearTimeout(timer))
}

/** One SSE reader counting `message_update` lines; `close` ends it. */
const sseReader = (port: number, token: string, target: string, onUpdate: () => void) =>
  new Promise<{ readonly close: () => void }>((resolve, reject) => {
    const req = http.request({ host: "127.0.0.1", port, path: target, headers: { authorization: `Bearer ${token}` }, agent: false })
    req.on("error", reject)
    req.on("response", (res) => {
      if (res.statusCode !== 200) return reject(new Error(`SSE answered ${res.statusCode}`))
      res.setEncoding("utf8")
      let carry = ""
      res.on("data", (text: string) => {
        const all = carry + text
        let at = all.indexOf(UPDATE_MARK)
        while (at >= 0) {
          onUpdate()
          at = all.indexOf(UPDATE_MARK, at + UPDATE_MARK.length)
        }
        carry = all.slice(Math.max(0, all.length - UPDATE_MARK.length + 1))
      })
      res.on("error", () => {})
      resolve({ close: () => req.destroy() })
    })
    req.end()
  })

const measureSocket = async (daemon: Daemon, ctl: Client, id: string, n: number): Promise<number> => {
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
      client.rawHook = (prefix) => {
        if (!prefix.includes(UPDATE_MARK)) return false
        if (++counts[i]! === EVENTS && ++complete === clients.length) resolve()
        return true
      }
    })
    const started = nowMs()
    await ctl.ok({ type: "prompt", activeSessionId: id, message: message() })
    await withTimeout(done, TIMEOUT_MS, () => `socket: ${counts.join(",")}`)
    const seconds = (nowMs() - started) / 1000
    await Promise.all(clients.map((c) => c.waitFor((m) => m["activeSessionId"] === id && isIdleStatus(m), 30_000, "idle")))
    return (EVENTS * n) / seconds
  } finally {
    for (const c of clients) c.close()
  }
}

const measureSse = async (port: number, token: string, ctl: Client, id: string, n: number): Promise<number> => {
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
    const started = nowMs()
    await ctl.ok({ type: "prompt", activeSessionId: id, message: message() })
    await withTimeout(done, TIMEOUT_MS, () => `SSE: ${counts.join(",")}`)
    const seconds = (nowMs() - started) / 1000
    await waitReady(ctl, id, 30_000)
    const wrong = counts.filter((k) => k !== EVENTS)
    if (wrong.length > 0) throw new Error(`SSE readers got ${wrong.join(",")} updates, expected ${EVENTS}`)
    return (EVENTS * n) / seconds
  } finally {
    for (const r of readers) r.close()
  }
}

export default async function httpDelivery(): Promise<void> {
  await withHttpDaemon(
    { env: NO_AUTO_CHECKPOINT },
    async ({ daemon, port, token }) => {
      const ctl = await daemon.connect("ctl")
      const { id } = await createSession(ctl)
      await waitReady(ctl, id)
      const watcher = await daemon.connect("warmup")
      await watcher.ok({ type: "attach", activeSessionId: id, capabilities: ["event_sequence", "slim_attach"] })
      for (let i = 0; i < WARM_UP_TURNS; i++) await runTurn(watcher, id, message())
      watcher.close()
      // One SSE turn to warm the HTTP path too.
      await measureSse(port, token, ctl, id, 1)
      for (const n of CLIENT_COUNTS) {
        await ctl.ok({ type: "checkpoint", activeSessionId: id }, 60_000)
        const socket: Array<number> = []
        const sse: Array<number> = []
        // Interleaved, so that drift in the machine's load hits both alike.
        for (let i = 0; i < RUNS; i++) {
          socket.push(await measureSocket(daemon, ctl, id, n))
          sse.push(await measureSse(port, token, ctl, id, n))
        }
        printRatio({
          what: `live delivery of ${EVENTS} message_update events to ${n} client${n === 1 ? "" : "s"} over SSE (aggregate)`,
          unit: "events/s",
          ours: median(sse),
          baseline: median(socket),
          baselineName: "the same daemon's socket",
          target: 0.7
        })
      }
    }
  )
}
