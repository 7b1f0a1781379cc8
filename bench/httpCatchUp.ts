/**
 * Catch-up of a long history over HTTP next to the socket's replay, in the same run and on the
 * same daemon: a session with EVENTS events in one generation (one turn of as many words; no
 * checkpoint), read from its start to its tail
 * - over HTTP: `GET /v1/sessions/:id/events?offset=-1&live=long-poll`, then from each page's
 *   `Stream-Next-Offset`, until `Stream-Up-To-Date` (the Durable Streams client's loop), each
 *   page parsed as JSON;
 * - over the socket: one `attach` resuming from the first event, its replay of every later
 *   event parsed line by line as they arrive.
 * Events/s = events read / time from the first request to the last event; the figure is
 * HTTP / socket. AGENTD_BENCH_CATCHUP_EVENTS sets EVENTS (default 100000).
 */
import * as http from "node:http"
import { type Client, createSession, type Daemon, nowMs, runTurn, waitReady } from "./daemonHarness.js"
import { get, NO_AUTO_CHECKPOINT, withHttpDaemon } from "./httpHarness.js"
import { printRatio } from "./report.js"

const EVENTS = Number(process.env["AGENTD_BENCH_CATCHUP_EVENTS"] ?? 100_000)
const RUNS = 3

const median = (xs: ReadonlyArray<number>) => [...xs].sort((a, b) => a - b)[Math.floor(xs.length / 2)]!

const agent = new http.Agent({ keepAlive: true, maxSockets: 1 })

/** One GET; the body as text and the headers. */
/** Reads every event of `id` from -1 to the tail; events/s and pages. */
const measureHttp = async (port: number, token: string, id: string, total: number) => {
  const started = nowMs()
  let offset = "-1"
  let read = 0
  let pages = 0
  for (;;) {
    const res = await get({ port, token }, `/v1/sessions/${encodeURIComponent(id)}/events?offset=${offset}&live=long-poll`, agent)
    if (res.status !== 200) throw new Error(`catch-up read answered ${res.status}: ${res.text.slice(0, 200)}`)
    read += (JSON.parse(res.text) as Array<unknown>).length
    pages++
    offset = String(res.headers["stream-next-offset"])
    if (res.headers["stream-up-to-date"] === "true") break
  }
  const seconds = (nowMs() - started) / 1000
  if (read !== total) throw new Error(`HTTP catch-up read ${read} events, expected ${total}`)
  return { rate: read / seconds, pages }
}

/** Replays every event of `id` after the first over one socket attach; events/s. */
const measureSocket = async (daemon: Daemon, id: string, total: number, last: { generation: number; sequence: number }) => {
  const c: Client = await daemon.connect("replay")
  try {
    let read = 0
    let resolve!: () => void
    const done = new Promise<void>((r) => (resolve = r))
    // Counted by their head; not consumed, so that the client parses each line as it comes.
    c.rawHook = (prefix) => {
      if (prefix.startsWith('{"type":"session_event"') || prefix.startsWith('{"type":"session_status"')) {
        if (++read === total - 1) resolve()
      }
      return false
    }
    const started = nowMs()
    await c.ok({
      type: "attach",
      activeSessionId: id,
      capabilities: ["event_sequence", "slim_attach"],
      resumeCursor: { generation: last.generation, sequence: 0 }
    }, 60_000)
    let timer: NodeJS.Timeout | undefined
    await Promise.race([
      done,
      new Promise<never>((_, reject) => {
        timer = setTimeout(() => reject(new Error(`socket replay: ${read} of ${total - 1} events`)), 120_000)
      })
    ]).finally(() => clearTimeout(timer))
    const seconds = (nowMs() - started) / 1000
    // The first event is not replayed (the attach resumes after it).
    if (read !== total - 1) throw new Error(`socket replay gave ${read} events, expected ${total - 1}`)
    return (read + 1) / seconds
  } finally {
    c.rawHook = undefined
    c.drain()
    c.close()
  }
}

export default async function httpCatchUp(): Promise<void> {
  await withHttpDaemon(
    { env: NO_AUTO_CHECKPOINT },
    async ({ daemon, port, token }) => {
      const ctl = await daemon.connect("ctl")
      const { id } = await createSession(ctl)
      await waitReady(ctl, id)
      // One turn of EVENTS - 1 words: a `message_update` per word and one more, with the turn's own.
      await ctl.ok({ type: "attach", activeSessionId: id, capabilities: ["event_sequence", "slim_attach"] })
      await runTurn(ctl, id, Array.from({ length: Math.max(1, EVENTS - 1) }, (_, i) => `w${i}`).join(" "), 300_000)
      await ctl.ok({ type: "detach", activeSessionId: id })
      ctl.drain()
      const state = await ctl.ok({ type: "get_state", activeSessionId: id })
      const last = state["lastEventCursor"] as { generation: number; sequence: number }
      if (last.generation !== 1) throw new Error(`the history is not one generation (${JSON.stringify(last)})`)
      const total = last.sequence + 1
      // Warm both paths once.
      await measureHttp(port, token, id, total)
      await measureSocket(daemon, id, total, last)
      const viaHttp: Array<number> = []
      const viaSocket: Array<number> = []
      let pages = 0
      // Interleaved, so that drift in the machine's load hits both alike.
      for (let i = 0; i < RUNS; i++) {
        const h = await measureHttp(port, token, id, total)
        viaHttp.push(h.rate)
        pages = h.pages
        viaSocket.push(await measureSocket(daemon, id, total, last))
      }
      printRatio({
        what: `catch-up of ${total} events from -1 to the tail over HTTP long-poll reads (${pages} pages)`,
        unit: "events/s",
        ours: median(viaHttp),
        baseline: median(viaSocket),
        baselineName: "the same daemon's socket replay",
        target: 0.7
      })
    }
  )
}
