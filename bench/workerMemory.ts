/**
 * An idle echo worker's memory against a bare Node process: the daemon is started, SESSIONS echo
 * sessions are created and prompted once each, and once they are idle each worker's VmRSS is read
 * from /proc (median), next to the median VmRSS of as many `node -e 'setInterval(() => {}, 1e9)'`
 * started the way the pool starts a worker (detached, a pipe on fd 3) and read after the same wait.
 * The target: an idle echo worker within 1.25x a bare node.
 *
 * Then one more daemon whose workers preload a probe (`--import`, AGENTD_WORKER_NODE_ARGS) that
 * writes `process.memoryUsage()` and V8's heap spaces to a file on SIGUSR2: the breakdown of an
 * idle echo worker's memory (the probe itself adds a few hundred KB, which is why it is not in the
 * figure above). AGENTD_BENCH_WORKER_NODE_ARGS gives the workers of the first daemon Node flags
 * (to measure one, e.g. `--max-semi-space-size=1`), AGENTD_BENCH_MEMORY_DAEMON_ENV the daemon settings
 * (`AGENTD_WARM_SPARE=0 ...`).
 *
 * Session 14 (2-core machine, load 6-11; RSS hardly moves with the load): 65.1 MB before (1.65x
 * a bare node's 39.4 MB), 50-51 MB with the workers' lean flags and a full GC once idle
 * (1.27-1.29x). What was tried, the idle echo worker's median RSS after one turn: the spare's
 * warm-up off 81.8 -> no gain worth its first-turn cost; `--max-semi-space-size=1` alone 60.3
 * (new space is committed, not resident); `--no-opt` 54.2; `--lite-mode` 51.0 but it implies
 * `--jitless`, which removes WebAssembly and so `fetch` (undici's HTTP parser), the model
 * engines' HTTP; `--v8-pool-size=0/1`, `--single-threaded-gc`, glibc's MALLOC_* tunables:
 * nothing. An empty spare: 49 MB, of which ~32 MB are the `node` binary's own pages (file-backed,
 * shared by every worker: a bare node has 31 MB of them), the rest V8's heap (6.4 MB used against
 * 4.3 for a bare node: Effect's code and objects, ~500 KB of source) and the ES module loader
 * (~1.5 MB against a CommonJS entry). A full minification of the bundle saves ~0.5 MB more.
 *
 * Session 15 (load 7-29): 49.3-49.5 MB (1.25x) -> 48.4 MB (1.23x). What helped: the echo worker no
 * longer loads `node:crypto` (2.2 MB in a bare node with the workers' flags: OpenSSL; it came
 * with the file system layer, through the snapshot chunking the worker imported from
 * SnapshotCache.ts, and with StateLayout's hash of over-long ids), and identifiers minified in the
 * worker's bundle (~0.3 MB). Tried, not kept: `--single-threaded` -0.8 MB, but the worker's CPU
 * per event in a burst rose ~1 us (6.1 -> 7.2, 3 runs each, load 8-11); UV_THREADPOOL_SIZE=1
 * (11 -> 8 threads) nothing; a CommonJS worker bundle (esbuild, dynamic imports as require) 61.5
 * MB: the model engines' dependencies were evaluated at start. An ES module entry costs 1.9 MB
 * against a CommonJS one in a bare node with the workers' flags (40.3 vs 38.4 MB).
 *
 * Session 16 (load 4-17): main 49.9 MB (1.27x, wide spread: 47.0-51.7), after the merge of the
 * pushed turn (s15-paced) with s15-first's 48.4. Not the pushed turn as such: heapUsed was the
 * same, the old space's committed size was not (7.7 MB for 5.4 used, against 5.7 for 5.6), and
 * with the spare's warm-up off (AGENTD_WARM_UP=0) both builds fragment alike after one turn
 * (7.2 for 5.4-5.5). A full GC keeps a page that holds any live object, and V8 compacts a page
 * only when 20% of it is free (--optimize-for-size); the 2.3 MB were spread thin over ~30
 * pages, more or fewer depending on where the last objects of the warm-up and turn landed. Kept:
 * the idle collection compacts (Worker.ts, idleGc: `--compact-on-every-full-gc` for that GC
 * only, when a plain one left >= 1 MB free, and an eighth of the used): 49.9/49.9/49.9 ->
 * 48.3/48.2/48.1 MB (1.22x; main's build and this one alternating, load 8-10). A compacting GC
 * of an idle echo worker: 43-50 ms of CPU against 14-16 for a plain one (load 4-6), which is
 * why it runs only for a megabyte's gain. Dropped: `--compact-on-every-full-gc` as a
 * start flag (47.9-48.0 MB, node:v8 not loaded) compacted the full GCs of a turn too: a burst's
 * worker CPU per event 6.7 -> 8.8 us (hotPath, 3 runs each, load 4-5); gc()'s `flavor:
 * "last-resort"` option is not in Node 20's V8 (no effect). What is left of the spread: about
 * one worker in three keeps 1.8 MB more of glibc's main heap ([heap] in /proc/PID/smaps: 5.1 MB
 * against 3.3), the same on main. Free memory, mostly: malloc_trim(0) called from gdb gave
 * 0.9 MB of one back, which the trim of the heap's top at free() does not reach (a live block
 * above it, presumably); MALLOC_TRIM_THRESHOLD_ and MALLOC_MMAP_THRESHOLD_ at 131072 (which stop
 * glibc from raising them) did not change it, and Node has no malloc_trim. With 2-3 such workers
 * of 6 the median is theirs: 3 of the last 6 runs read 49.8-49.9 MB (1.26x): the target was
 * not met reliably (11 runs at load 7-17: 48.1-48.3 in 8, 49.8-49.9 in 3).
 * Also, in 4 of those 11 runs one worker read 54-55 MB (never on main's build, 4 runs): its
 * /proc/PID/smaps had ~7 MB more in two plain anonymous mappings (3.6 and 4.0 MB resident),
 * neither V8's 256 KB pages nor glibc's main heap: presumably what the compaction's helper
 * threads allocated (V8 compacts in parallel), not confirmed. Then kept: `--single-threaded-gc`
 * (WorkerPool's LEAN_WORKER_FLAGS), which took both away: 47.1 MB in 6 runs of 7, 48.7 in one
 * (1.19-1.23x, load 3-14; a worker or two of 6 at 48.7-48.8 in 3 of them), a burst's worker CPU
 * per event the same (hotPath, 6.2-7.2 us without, 6.0-6.8 with, 3 runs each, load 7-11). Each
 * worker's RSS, in session order, is printed after the figure.
 */
import { type ChildProcess, spawn } from "node:child_process"
import * as fs from "node:fs"
import * as os from "node:os"
import * as path from "node:path"
import { createSession, type Daemon, rssOf, runTurn, sleep, waitReady, withDaemon } from "./daemonHarness.js"

const SESSIONS = Number(process.env["AGENTD_BENCH_MEMORY_SESSIONS"] ?? 6)
/** How long workers and bare processes sit idle before their RSS is read. */
const IDLE_MS = 3000
const MiB = 1024 * 1024

const median = (xs: ReadonlyArray<number>): number => [...xs].sort((a, b) => a - b)[Math.floor(xs.length / 2)]!
const mb = (bytes: number): string => (bytes / MiB).toFixed(1)

/** Creates `n` echo sessions, runs one short turn in each; returns their worker pids. */
const idleWorkers = async (daemon: Daemon, n: number): Promise<Array<number>> => {
  const ctl = await daemon.connect("ctl")
  const pids: Array<number> = []
  for (let i = 0; i < n; i++) {
    const { id } = await createSession(ctl)
    await waitReady(ctl, id, 60_000)
    await ctl.ok({ type: "attach", activeSessionId: id, capabilities: ["event_sequence"] }, 30_000)
    await runTurn(ctl, id, `hello from session ${i}, one short echo turn`)
    const state = await waitReady(ctl, id, 60_000)
    daemon.recordWorker(state)
    pids.push(state["workerPid"] as number)
    ctl.drain()
  }
  ctl.close()
  return pids
}

/** `n` bare node processes started as the pool starts a worker; their median RSS after the idle wait. */
const bareNodes = async (n: number): Promise<number> => {
  const children: Array<ChildProcess> = []
  try {
    for (let i = 0; i < n; i++) {
      children.push(spawn(process.execPath, ["-e", "setInterval(() => {}, 1e9)"], { stdio: ["ignore", "pipe", "pipe", "pipe"], detached: true }))
    }
    await sleep(IDLE_MS)
    return median(children.map((c) => rssOf(c.pid!)))
  } finally {
    for (const c of children) {
      if (c.exitCode === null && c.signalCode === null) {
        c.kill("SIGKILL")
        await new Promise((r) => c.once("exit", r))
      }
    }
  }
}

const PROBE_SRC = `
import * as fs from "node:fs"
import * as v8 from "node:v8"
process.on("SIGUSR2", () => {
  const spaces = Object.fromEntries(v8.getHeapSpaceStatistics().map((s) => [s.space_name, s.space_used_size]))
  fs.writeFileSync(process.env.AGENTD_BENCH_PROBE_DIR + "/" + process.pid + ".json", JSON.stringify({ usage: process.memoryUsage(), spaces }))
})
`

/** The memory breakdown of one idle echo worker, from the probe. */
const breakdown = async (env: Readonly<Record<string, string>>, flags: string): Promise<string> => {
  const dir = fs.mkdtempSync(path.join(os.tmpdir(), "agentd-bench-memprobe-"))
  try {
    const probe = path.join(dir, "probe.mjs")
    fs.writeFileSync(probe, PROBE_SRC)
    return await withDaemon({ env: { ...env, AGENTD_WORKER_NODE_ARGS: `${flags} --import=${probe}`, AGENTD_BENCH_PROBE_DIR: dir } }, async (daemon) => {
      const [pid] = await idleWorkers(daemon, 1)
      await sleep(IDLE_MS)
      const rss = rssOf(pid!)
      process.kill(pid!, "SIGUSR2")
      const file = path.join(dir, `${pid}.json`)
      for (let i = 0; i < 100 && !fs.existsSync(file); i++) await sleep(50)
      const { usage, spaces } = JSON.parse(fs.readFileSync(file, "utf8")) as { usage: NodeJS.MemoryUsage; spaces: Record<string, number> }
      const top = Object.entries(spaces).filter(([, used]) => used > 64 * 1024).map(([name, used]) => `${name} ${mb(used)}`).join(", ")
      return `VmRSS ${mb(rss)} MB; memoryUsage: rss ${mb(usage.rss)}, heapTotal ${mb(usage.heapTotal)}, heapUsed ${mb(usage.heapUsed)}, ` +
        `external ${mb(usage.external)}, arrayBuffers ${mb(usage.arrayBuffers)} MB; heap spaces used (MB): ${top}`
    })
  } finally {
    fs.rmSync(dir, { recursive: true, force: true })
  }
}

export default async function workerMemory(): Promise<void> {
  const extra = process.env["AGENTD_BENCH_WORKER_NODE_ARGS"]
  // AGENTD_BENCH_MEMORY_DAEMON_ENV: the daemon's settings for this run ("AGENTD_WARM_SPARE=0 ...").
  const daemonEnv = Object.fromEntries(
    (process.env["AGENTD_BENCH_MEMORY_DAEMON_ENV"] ?? "").split(" ").filter((kv) => kv.includes("=")).map((kv) => [kv.slice(0, kv.indexOf("=")), kv.slice(kv.indexOf("=") + 1)])
  )
  const workerRss = await withDaemon(
    { env: { ...daemonEnv, ...(extra === undefined ? {} : { AGENTD_WORKER_NODE_ARGS: extra }) } },
    async (daemon) => {
      const pids = await idleWorkers(daemon, SESSIONS)
      await sleep(IDLE_MS)
      return pids.map(rssOf)
    }
  )
  const bare = await bareNodes(SESSIONS)
  const ratio = median(workerRss) / bare
  console.log(
    `idle echo worker RSS (median of ${SESSIONS}, after one turn and ${IDLE_MS} ms idle${extra === undefined ? "" : `, worker flags ${extra}`}): ` +
      `agentd ${mb(median(workerRss))} MB (min ${mb(Math.min(...workerRss))}, max ${mb(Math.max(...workerRss))}) | ` +
      `baseline (node -e 'setInterval(() => {}, 1e9)', started alike) ${mb(bare)} MB | ratio ${ratio.toFixed(2)}x ` +
      `(lower is better; target <= 1.25x: ${ratio <= 1.25 ? "met" : "MISSED"})`
  )
  console.log(`  each worker (MB, in session order): ${workerRss.map(mb).join(", ")}`)
  console.log(`  one idle echo worker: ${await breakdown(daemonEnv, extra ?? "")}`)
  console.log(`  (load average at the end: ${os.loadavg().map((l) => l.toFixed(1)).join(", ")})`)
}
