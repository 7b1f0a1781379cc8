/**
 * Many sessions streaming at model-like rates: AGENTD_BENCH_SESSIONS sessions (default 200),
 * `--max-workers` as many, the echo engine with `tokenDelayMs` 20 (about 50 events/s each),
 * one turn of AGENTD_BENCH_STREAM_WORDS words (default 150, about 3 s) in every session at once,
 * 10 clients attached across them (each to a tenth of the sessions). Reports the daemon's CPU %
 * over the streaming window, its CPU per delivered event next to the envelope relay's CPU per
 * relayed event (bench/hotPath.ts, measured in the same run), the latency from an event's
 * `emittedAt` to a client reading its line (p50, p99; millisecond clocks, same host), and the
 * daemon's and all processes' RSS at the end of the turns.
 *
 * First figures (2026-12-02, shared 2-core machine, load 10-45): 20 sessions: daemon 20% of a
 * core, 641 us of daemon CPU per delivered event (relay: 8.5 us), p50 265 ms, p99 1243 ms, RSS
 * daemon 128 MB, 67 MB per worker. At this rate every event is its own batch (one append, one
 * fdatasync, one write per client): the per-batch cost, not the per-event one, is what to cut.
 * 200 sessions did not finish: a prompt waited more than 60 s for its answer at load 45.
 */
import * as net from "node:net"
import * as os from "node:os"
import { cpuTicksOf, descendantsOf } from "../test/support/procfs.js"
import { type Client, createSession, nowMs, rssOf, waitReady, withDaemon } from "./daemonHarness.js"
import { relayCpuPerEvent } from "./hotPath.js"

const SESSIONS = Number(process.env["AGENTD_BENCH_SESSIONS"] ?? 200)
const WORDS = Number(process.env["AGENTD_BENCH_STREAM_WORDS"] ?? 150)
const CLIENTS = 10
const TOKEN_DELAY_MS = 20
const TIMEOUT_MS = 180_000

const cpuMicros = (pid: number): number => (cpuTicksOf(pid) ?? 0) * 10_000

const percentile = (sorted: ReadonlyArray<number>, q: number): number => sorted[Math.min(sorted.length - 1, Math.floor(q * sorted.length))] ?? NaN

const EMITTED_AT = '"emittedAt":'

/** Reads a client's live lines beside the harness's own reading: each event's latency, each turn's end. */
const watch = (client: Client, latencies: Array<number>, onEnd: () => void) => {
  // The harness parses what its hook does not consume: events are consumed (counted here).
  client.rawHook = (prefix) => prefix.startsWith('{"type":"session_event"')
  let rest = ""
  ;(client.socket as net.Socket).on("data", (data: Buffer) => {
    const now = Date.now()
    const text = rest + data.toString("utf8")
    const last = text.lastIndexOf("\n")
    if (last < 0) {
      rest = text
      return
    }
    rest = text.slice(last + 1)
    for (const line of text.slice(0, last).split("\n")) {
      if (!line.startsWith('{"type":"session_event"')) continue
      const at = line.lastIndexOf(EMITTED_AT)
      if (at > 0) latencies.push(now - parseInt(line.slice(at + EMITTED_AT.length), 10))
      if (line.startsWith('{"type":"session_event","event":{"type":"agent_end"')) onEnd()
    }
  })
}

export default async function streaming(): Promise<void> {
  const message = Array.from({ length: WORDS }, (_, i) => `w${i}`).join(" ")
  const result = await withDaemon(
    { env: { AGENTD_MAX_WORKERS: String(SESSIONS) } },
    async (daemon) => {
      const ctl = await daemon.connect("ctl")
      const ids: Array<string> = []
      for (let i = 0; i < SESSIONS; i++) ids.push((await createSession(ctl, { config: { tokenDelayMs: TOKEN_DELAY_MS } })).id)
      // Every worker up before the clock starts (they start one after another otherwise).
      for (let i = 0; i < ids.length; i += 10) await Promise.all(ids.slice(i, i + 10).map((id) => waitReady(ctl, id, 120_000)))
      const clients: Array<Client> = []
      const latencies: Array<number> = []
      let ended = 0
      let allEnded!: () => void
      const done = new Promise<void>((resolve) => (allEnded = resolve))
      for (let k = 0; k < CLIENTS; k++) {
        const c = await daemon.connect(`client-${k}`)
        clients.push(c)
        for (let i = k; i < ids.length; i += CLIENTS) {
          await c.ok({ type: "attach", activeSessionId: ids[i], capabilities: ["event_sequence", "slim_attach"] }, 60_000)
          await c.waitFor((m) => m["type"] === "session_attached", 60_000, "session_attached")
        }
        c.drain()
      }
      for (const c of clients) {
        watch(c, latencies, () => {
          if (++ended === ids.length) allEnded()
        })
      }
      const daemonBefore = cpuMicros(daemon.pid)
      const started = nowMs()
      await Promise.all(ids.map((id) => ctl.ok({ type: "prompt", activeSessionId: id, message }, 60_000)))
      let timer: NodeJS.Timeout | undefined
      await Promise.race([done, new Promise((_, reject) => (timer = setTimeout(() => reject(new Error(`${ended} of ${ids.length} turns ended in ${TIMEOUT_MS} ms`)), TIMEOUT_MS)))])
      clearTimeout(timer)
      const windowUs = (nowMs() - started) * 1000
      const daemonCpu = cpuMicros(daemon.pid) - daemonBefore
      const daemonRss = rssOf(daemon.pid)
      const totalRss = [daemon.pid, ...descendantsOf(daemon.pid)].reduce((sum, pid) => sum + (rssOf(pid) || 0), 0)
      const workers = descendantsOf(daemon.pid).length
      for (const c of clients) c.close()
      return { windowUs, daemonCpu, daemonRss, totalRss, workers, latencies }
    }
  )
  const relayCpu = await relayCpuPerEvent()
  const sorted = [...result.latencies].sort((a, b) => a - b)
  const p99 = percentile(sorted, 0.99)
  const perEvent = result.daemonCpu / sorted.length
  console.log(`${SESSIONS} sessions streaming (echo, tokenDelayMs ${TOKEN_DELAY_MS}, ${WORDS} words), ${CLIENTS} clients across them, ${result.workers} workers:`)
  console.log(`  daemon CPU ${(100 * result.daemonCpu / result.windowUs).toFixed(1)}% of one core over ${(result.windowUs / 1e6).toFixed(1)} s; ${sorted.length} events delivered`)
  console.log(`  daemon CPU per delivered event ${perEvent.toFixed(1)} us | relay process ${relayCpu.toFixed(1)} us per relayed event | ratio ${(perEvent / relayCpu).toFixed(2)}x (lower is better)`)
  console.log(`  latency emittedAt -> client: p50 ${percentile(sorted, 0.5)} ms, p99 ${p99} ms, max ${sorted.at(-1)} ms  (target p99 < 20 ms: ${p99 < 20 ? "met" : "MISSED"})`)
  console.log(`  RSS: daemon ${(result.daemonRss / 1048576).toFixed(0)} MB, daemon and workers ${(result.totalRss / 1048576).toFixed(0)} MB (${((result.totalRss - result.daemonRss) / 1048576 / Math.max(1, result.workers)).toFixed(1)} MB per worker)`)
  console.log(`  (load average at the end: ${os.loadavg().map((l) => l.toFixed(1)).join(", ")})`)
}
