/**
 * Recovery latency: a session's worker is SIGKILLed and the time until the session is `ready`
 * again is measured, as an attached client sees it (`session_status` worker `recovering`, then
 * `ready` with a new workerPid), with a ~1 MB transcript (one `/bulk 1000000` turn, 20 kills) and a ~51 MB one (5 more turns
 * of `/bulk 10000000`, 6 kills, to stay within the time budget). Baseline in the same run: a bare `node -e 0` spawn-to-exit
 * (median of 20), the floor of anything that starts a Node process.
 *
 * Before each kill the bench also waits for the pool's warm spare to exist: the spare is started
 * up to 2 s after it was wanted when a session is created or a turn starts meanwhile, and a kill
 * in that window restores on a cold spawn (session 26: the first 5 kills, 165-280 ms against
 * 33-63 ms for the others, all of them within 2 s of the session's creation).
 *
 * Settings: AGENTD_MAX_RESTARTS=1000 and AGENTD_RESTART_WINDOW_MS=1, so every kill is measured
 * as the "first restart after a crash" of docs/protocol.md section 6 (immediate, no exponential
 * back-off); automatic checkpoints are off and the transcript is checkpointed explicitly, so a
 * restore loads one snapshot and folds no events. Before each kill the bench waits until the
 * daemon's worker processes (the session's worker and the pool's warm spare, started at the
 * previous restore) are idle in epoll_wait, as they would be for crashes that are not back to
 * back: the figure is the restore path the daemon is designed for (warm spare), not Node's boot.
 *
 * `AGENTD_BENCH_COMPARE_BIN=<another build>/dist/src/bin/agentd.js` runs that build's daemon
 * beside this one on the same transcripts, the kills alternating between the two, and prints the
 * ratio of the medians: two builds compared under the same load (a shared machine's load moves
 * between two runs far more than the difference measured).
 */
import { spawn } from "node:child_process"
import {
  type Client,
  createSession,
  type Cursor,
  cursorAfter,
  type Daemon,
  descendantsOf,
  MiB,
  type Msg,
  nowMs,
  printLatency,
  runTurn,
  sleep,
  waitIdleProcesses,
  startDaemon,
  waitReady
} from "./daemonHarness.js"
import { percentiles } from "./report.js"

/** The small transcript: one turn of `/bulk 1000000` (~1 MB). */
const SMALL_BULK = 1_000_000
/** The large one: the small one plus 5 turns of `/bulk 10000000` (~51 MB). */
const LARGE_EXTRA_TURNS = 5
const LARGE_BULK = 10_000_000
const SMALL_KILLS = 20
const LARGE_KILLS = 6
const PAUSE_MS = 100
const BASELINE_SPAWNS = 20

const spawnToExit = (): Promise<number> =>
  new Promise((resolve, reject) => {
    const started = nowMs()
    const child = spawn(process.execPath, ["-e", "0"], { stdio: "ignore" })
    child.once("error", reject)
    child.once("exit", () => resolve(nowMs() - started))
  })

const isStatus = (worker: string) => (m: Msg): boolean => m["type"] === "session_status" && m["state"]?.worker === worker

/** One SIGKILL of the session's worker; returns ms from the kill to the `ready` status. */
const killOnce = async (
  daemon: Daemon,
  client: Client,
  id: string
): Promise<{ ms: number; toRecovering: number; state: Msg }> => {
  const before = await waitReady(client, id)
  const pid = before["workerPid"]
  if (typeof pid !== "number") throw new Error(`get_state gives no workerPid: ${JSON.stringify(before)}`)
  daemon.recordWorker(before)
  client.drain()
  const started = nowMs()
  process.kill(pid, "SIGKILL")
  const recovering = await client.waitFor((m) => m["activeSessionId"] === id && isStatus("recovering")(m), 15_000, "recovering status")
  const toRecovering = nowMs() - started
  const ready = await client.waitFor(
    (m) => m["activeSessionId"] === id && isStatus("ready")(m) && cursorAfter(m["meta"]?.cursor, recovering["meta"]?.cursor as Cursor),
    30_000,
    "ready status after recovering"
  )
  const ms = nowMs() - started
  const state = ready["state"] as Msg
  daemon.recordWorker(state)
  if (state["workerPid"] === pid) throw new Error(`ready after the kill, but with the killed worker's pid ${pid}`)
  if (state["busy"] !== false) throw new Error(`ready status says busy: ${JSON.stringify(state)}`)
  return { ms, toRecovering, state }
}

/** One daemon under measure: its build, and the session whose worker is killed. */
interface Subject {
  readonly name: string
  readonly daemon: Daemon
  readonly client: Client
  readonly id: string
}

/**
 * `kills` rounds; in each, the worker of every subject is killed once, one after the other (two
 * builds compared in one run see the same load, round by round).
 */
const measure = async (subjects: ReadonlyArray<Subject>, kills: number, expectedMessages: number) => {
  const samples = subjects.map(() => [] as Array<number>)
  const firstStatus = subjects.map(() => [] as Array<number>)
  for (let i = 0; i < kills; i++) {
    for (const [k, { client, daemon, id }] of subjects.entries()) {
      await sleep(PAUSE_MS)
      // The spare is started up to SPARE_HOLD_MS (2 s) after it is wanted when a session is
      // created or a turn starts meanwhile (a booting process beside a first turn slows it down):
      // a kill in that window is a cold spawn (~170 ms here, against ~40 with the spare).
      for (const x of subjects) {
        const deadline = nowMs() + 5_000
        while (descendantsOf(x.daemon.pid).length < 2 && nowMs() < deadline) await sleep(20)
      }
      if (!(await waitIdleProcesses(subjects.flatMap((x) => descendantsOf(x.daemon.pid))))) {
        console.log(`  (kill ${i + 1}: the daemons' workers were still busy after 10 s; killing anyway)`)
      }
      const { ms, toRecovering, state } = await killOnce(daemon, client, id)
      if (state["messageCount"] !== expectedMessages) {
        throw new Error(`after recovery the session has ${state["messageCount"]} messages, expected ${expectedMessages}`)
      }
      samples[k]!.push(ms)
      firstStatus[k]!.push(toRecovering)
    }
  }
  return subjects.map((_, k) => ({ samples: samples[k]!, firstStatus: firstStatus[k]! }))
}

/** Adds `turns` turns of `/bulk <bytes>`, then checkpoints. */
const grow = async (client: Client, id: string, turns: number, bytes: number) => {
  for (let i = 0; i < turns; i++) {
    await runTurn(client, id, `/bulk ${bytes}`)
    client.drain()
  }
  await client.ok({ type: "checkpoint", activeSessionId: id }, 120_000)
  client.drain()
}

/** What to measure: a daemon's build (default: this one) and its extra `serve` arguments. */
export interface SubjectSpec {
  readonly name: string
  readonly bin?: string
  readonly extraArgs?: ReadonlyArray<string>
}

/** Starts a daemon from `bin` (default: this build) with a session attached and ready. */
const startSubject = async ({ bin, extraArgs, name }: SubjectSpec): Promise<Subject> => {
  const daemon = await startDaemon({
    env: {
      AGENTD_MAX_RESTARTS: "1000",
      AGENTD_RESTART_WINDOW_MS: "1",
      AGENTD_CHECKPOINT_EVENTS: "1000000000",
      AGENTD_CHECKPOINT_BYTES: String(1024 * MiB)
    },
    ...(bin === undefined ? {} : { bin }),
    ...(extraArgs === undefined ? {} : { extraArgs: [...extraArgs] })
  })
  const client = await daemon.connect("recovery")
  const { id } = await createSession(client)
  await client.ok({ type: "attach", activeSessionId: id, capabilities: ["event_sequence", "slim_attach"] })
  await client.waitFor((m) => m["type"] === "session_attached", 15_000, "session_attached")
  await waitReady(client, id)
  return { name, daemon, client, id }
}

/**
 * With `AGENTD_BENCH_COMPARE_BIN=<another build's dist/src/bin/agentd.js>` a second daemon runs
 * that build beside this one, on the same transcripts, and the kills alternate between the two.
 */
export default async function recovery(): Promise<void> {
  const compareBin = process.env["AGENTD_BENCH_COMPARE_BIN"]
  await measureRecovery([{ name: "this build" }, ...(compareBin === undefined ? [] : [{ name: compareBin, bin: compareBin }])])
}

/**
 * The measurement for one daemon or, kills alternating, two (the ratio of their medians is the
 * first's over the second's).
 */
export const measureRecovery = async (specs: ReadonlyArray<SubjectSpec>): Promise<void> => {
  // Baseline first, before the daemon and its workers run, after one warm-up spawn.
  await spawnToExit()
  const base: Array<number> = []
  for (let i = 0; i < BASELINE_SPAWNS; i++) base.push(await spawnToExit())
  const baseline = percentiles(base)

  const subjects: Array<Subject> = []
  try {
    for (const spec of specs) subjects.push(await startSubject(spec))
    const label = (x: Subject) => (subjects.length > 1 ? ` [${x.name}]` : "")

    let t = nowMs()
    for (const x of subjects) await grow(x.client, x.id, 1, SMALL_BULK)
    const buildSmall = nowMs() - t
    t = nowMs()
    const small = await measure(subjects, SMALL_KILLS, 2)
    const killSmall = nowMs() - t
    for (const [k, x] of subjects.entries()) {
      const s = percentiles(small[k]!.samples)
      printLatency({
        what: `recovery after SIGKILL of the worker, ~${(SMALL_BULK / 1e6).toFixed(0)} MB transcript (${SMALL_KILLS} kills)${label(x)}`,
        median: s.median,
        p95: s.p95,
        baselineMedian: baseline.median,
        baselineName: `node -e 0 spawn-to-exit, median of ${BASELINE_SPAWNS}`,
        targetMedianMs: 150
      })
    }

    t = nowMs()
    for (const x of subjects) await grow(x.client, x.id, LARGE_EXTRA_TURNS, LARGE_BULK)
    const buildLarge = nowMs() - t
    t = nowMs()
    const large = await measure(subjects, LARGE_KILLS, 2 * (1 + LARGE_EXTRA_TURNS))
    const killLarge = nowMs() - t
    for (const [k, x] of subjects.entries()) {
      const l = percentiles(large[k]!.samples)
      printLatency({
        what: `recovery after SIGKILL of the worker, ~${((SMALL_BULK + LARGE_EXTRA_TURNS * LARGE_BULK) / 1e6).toFixed(0)} MB transcript (${LARGE_KILLS} kills, fewer to fit the time)${label(x)}`,
        median: l.median,
        p95: l.p95,
        baselineMedian: baseline.median,
        baselineName: `node -e 0 spawn-to-exit, median of ${BASELINE_SPAWNS}`
      })
    }
    for (const [k, x] of subjects.entries()) {
      const { firstStatus: smallFirst, samples: smallSamples } = small[k]!
      const { firstStatus: largeFirst, samples: largeSamples } = large[k]!
      console.log(
        `  samples (ms)${label(x)}: 1 MB [${smallSamples.map((v) => v.toFixed(0)).join(" ")}]; 51 MB [${largeSamples.map((v) => v.toFixed(0)).join(" ")}]`
      )
      console.log(
        `  of which kill -> "recovering" status, median${label(x)}: 1 MB ${percentiles(smallFirst).median.toFixed(0)} ms, ` +
          `51 MB ${percentiles(largeFirst).median.toFixed(0)} ms`
      )
    }
    if (subjects.length > 1) {
      const ratio = (of: typeof small) => (percentiles(of[0]!.samples).median / percentiles(of[1]!.samples).median).toFixed(2)
      console.log(`  ${subjects[0]!.name} / ${subjects[1]!.name}, medians: 1 MB ${ratio(small)}x, 51 MB ${ratio(large)}x`)
    }
    const sec = (ms: number) => (ms / 1000).toFixed(1)
    console.log(
      `  phases (s): build 1 MB ${sec(buildSmall)}, kills ${sec(killSmall)}; build 51 MB ${sec(buildLarge)}, kills ${sec(killLarge)}`
    )
  } catch (e) {
    for (const x of subjects) {
      const state = x.daemon.running ? "running" : `exited: code ${x.daemon.exitCode}, signal ${x.daemon.exitSignal}`
      console.error(`  daemon log tail (pid ${x.daemon.pid}, ${state}):\n${x.daemon.stderrTail(2000)}`)
    }
    throw e
  } finally {
    for (const x of subjects) await x.daemon.cleanup()
  }
}
