/**
 * Delivery through a runner that does not own the session (docs/cluster.md section 4): two
 * runners over one private PostgreSQL (AGENTD_BENCH_PG_URL, AGENTD_TEST_PG_URL, else
 * scripts/pg-test-server.sh), one session owned by runner A, one client attached through A and
 * one through B, one echo turn of WORDS words at a time.
 *
 * - events/s each, from the `prompt` to that client's `agent_end` (median of 3 turns after a
 *   warm-up), and their ratio B / A in the same turns (the target: >= 0.5x);
 * - the latency: the owner's `emittedAt` to the client's receipt of each event, p50 and p99,
 *   through B and (the baseline) through A: in short turns (the wake-up itself) and during the
 *   long turns (where a tail that reads slower than the owner writes falls behind);
 * - CPU per event of the owner A with only its own client, then with B's client attached (what
 *   a remote reader costs the owner: the NOTIFY; B reads PostgreSQL, not A), and B's CPU per
 *   event (what its tail costs).
 *
 * Both clients parse every line (they read `emittedAt`), the same code for both.
 */
import * as os from "node:os"
import { cpuTicksOf } from "../test/support/procfs.js"
import { type Client, createSession, type Daemon, isIdleStatus, nowMs, sleep, startDaemon, TurnEnds, waitReady } from "./daemonHarness.js"
import { printRatio } from "./report.js"
import { benchStore } from "./storeAppend.js"

const WORDS = 20_000
const TURNS = 3
const TIMEOUT_MS = 120_000
/** Short turns for the wake-up latency alone, and their words. */
const QUIET_TURNS = 20
const QUIET_WORDS = 3

const median = (xs: ReadonlyArray<number>): number => [...xs].sort((a, b) => a - b)[Math.floor(xs.length / 2)]!
const quantile = (xs: ReadonlyArray<number>, q: number): number => {
  const sorted = [...xs].sort((a, b) => a - b)
  return sorted[Math.min(sorted.length - 1, Math.floor(q * sorted.length))]!
}
/** CPU time of a process from /proc, in microseconds (clock ticks of 10 ms: figures over whole turns). */
const cpuMicros = (pid: number): number => (cpuTicksOf(pid) ?? 0) * 10_000

const text = Array.from({ length: WORDS }, (_, i) => `w${i}`).join(" ")

interface Timed {
  /** Seconds from the prompt to this client's `agent_end`. */
  readonly seconds: number
  /** Milliseconds from each event's `emittedAt` to its receipt. */
  readonly lags: ReadonlyArray<number>
}

/** One turn; for each client, when its `agent_end` came and each event's lag. */
const turn = async (ctl: Client, clients: ReadonlyArray<Client>, id: string, message = text): Promise<Array<Timed>> => {
  const started = nowMs()
  const results = clients.map(() => ({ seconds: 0, lags: [] as Array<number> }))
  const ends = new TurnEnds(clients.length)
  clients.forEach((c, i) => {
    c.messageHook = (m) => {
      if (m["type"] !== "session_event" || m["activeSessionId"] !== id) return false
      results[i]!.lags.push(Date.now() - (m["meta"]["emittedAt"] as number))
      const type = m["event"]["type"]
      if (type === "turn_interrupted") ends.interrupted()
      if (type === "agent_end") {
        results[i]!.seconds = (nowMs() - started) / 1000
        ends.ended()
      }
      return true
    }
  })
  await ctl.ok({ type: "prompt", activeSessionId: id, message })
  await ends.wait(TIMEOUT_MS)
  for (const c of clients) c.messageHook = undefined
  await Promise.all(clients.map((c) => c.waitFor((m) => m["activeSessionId"] === id && isIdleStatus(m), 30_000, "idle status")))
  for (const c of clients) c.drain()
  return results
}

/** A turn of a few events (`QUIET_WORDS` words), after a pause: each event's lag is the wake-up's. */
const shortTurn = async (ctl: Client, clients: ReadonlyArray<Client>, id: string): Promise<Array<Timed>> => {
  await sleep(50)
  return turn(ctl, clients, id, Array.from({ length: QUIET_WORDS }, (_, i) => `q${i}`).join(" "))
}

const attach = async (runner: Daemon, id: string, label: string): Promise<Client> => {
  const c = await runner.connect(label)
  const resumeCursor = (await c.ok({ type: "get_state", activeSessionId: id }))["lastEventCursor"]
  await c.ok({ type: "attach", activeSessionId: id, capabilities: ["event_sequence", "slim_attach"], ...(resumeCursor === undefined ? {} : { resumeCursor }) }, 30_000)
  await c.waitFor((m) => m["type"] === "session_attached", 30_000, "session_attached")
  c.drain()
  return c
}

export default async function clusterDelivery(): Promise<void> {
  const store = await benchStore("cluster")
  const runners: Array<Daemon> = []
  try {
    const start = async () => {
      const port = 20_000 + Math.floor(Math.random() * 20_000)
      const address = `127.0.0.1:${port}`
      const daemon = await startDaemon({
        extraArgs: ["--store", store.url, "--cluster", "--runner-address", address],
        // Checkpoints between the turns would be timed with them: none during this run.
        env: {
          AGENTD_CLUSTER_LEASE_MS: "6000",
          AGENTD_CHECKPOINT_EVENTS: "1000000000",
          AGENTD_CHECKPOINT_BYTES: String(1024 * 1024 * 1024)
        }
      })
      runners.push(daemon)
      return { daemon, address }
    }
    const a = await start()
    const b = await start()
    const ctl = await a.daemon.connect("ctl")
    // Both runners holding shards, then a session whose owner is A.
    const deadline = Date.now() + 60_000
    for (;;) {
      const listed = ((await ctl.ok({ type: "status" }))["runners"] ?? []) as Array<Record<string, number>>
      if (listed.length === 2 && listed.every((r) => r["shards"]! > 0) && listed.reduce((n, r) => n + r["shards"]!, 0) === 300) break
      if (Date.now() > deadline) throw new Error("the runners did not settle")
      await sleep(100)
    }
    let id: string | undefined
    for (let i = 0; i < 40 && id === undefined; i++) {
      const made = await createSession(ctl)
      if (made.state["runner"] === a.address) id = made.id
    }
    if (id === undefined) throw new Error("no session landed on runner A")
    await waitReady(ctl, id)

    // The owner with its own client only.
    const onA = await attach(a.daemon, id, "on-A")
    await turn(ctl, [onA], id)
    let cpuA = cpuMicros(a.daemon.pid)
    for (let i = 0; i < TURNS; i++) await turn(ctl, [onA], id)
    const ownerAlone = (cpuMicros(a.daemon.pid) - cpuA) / (TURNS * (WORDS + 1))

    // A client through B too: both timed in the same turns.
    const onB = await attach(b.daemon, id, "on-B")
    await turn(ctl, [onA, onB], id)
    cpuA = cpuMicros(a.daemon.pid)
    const cpuB = cpuMicros(b.daemon.pid)
    const runs: Array<Array<Timed>> = []
    for (let i = 0; i < TURNS; i++) runs.push(await turn(ctl, [onA, onB], id))
    const ownerWithRemote = (cpuMicros(a.daemon.pid) - cpuA) / (TURNS * (WORDS + 1))
    const remoteRunner = (cpuMicros(b.daemon.pid) - cpuB) / (TURNS * (WORDS + 1))

    // The wake-up alone: short turns (a few events each), one at a time.
    const quiet: Array<Array<Timed>> = []
    for (let i = 0; i < QUIET_TURNS; i++) quiet.push(await shortTurn(ctl, [onA, onB], id))

    const rate = (i: number) => (WORDS + 1) / median(runs.map((r) => r[i]!.seconds))
    const lags = (i: number) => runs.flatMap((r) => r[i]!.lags)
    printRatio({
      what: `delivery of a ${WORDS}-word echo turn, client attached through runner B (not the owner)`,
      unit: "events/s",
      ours: rate(1),
      baseline: rate(0),
      baselineName: "client attached through the owner A, same turns",
      target: 0.5
    })
    const quietLags = (i: number) => quiet.flatMap((r) => r[i]!.lags)
    for (const [name, i] of [["through B (log tail)", 1], ["through A (owner)", 0]] as const) {
      console.log(
        `latency ${name}: emittedAt to receipt, short turns p50 ${quantile(quietLags(i), 0.5)} ms, p99 ${quantile(quietLags(i), 0.99)} ms; ` +
          `during the ${WORDS}-word turns p50 ${quantile(lags(i), 0.5)} ms, p99 ${quantile(lags(i), 0.99)} ms`
      )
    }
    console.log(
      `CPU per event: owner A alone ${ownerAlone.toFixed(1)} us, with B's client attached ${ownerWithRemote.toFixed(1)} us ` +
        `(${(ownerWithRemote / ownerAlone).toFixed(2)}x); runner B's tail ${remoteRunner.toFixed(1)} us`
    )
    console.log(`  (median of ${TURNS} turns after a warm-up; load average at the end: ${os.loadavg().map((l) => l.toFixed(1)).join(", ")})`)
  } finally {
    for (const r of runners) await r.cleanup()
    await store.close()
  }
}
