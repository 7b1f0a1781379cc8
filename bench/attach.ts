/**
 * Chunked attach of a ~100 MB transcript built as a user would, at default settings: 50 turns of
 * `/bulk 2097152`, automatic checkpoints every 8 MiB (so the snapshot is many generations deep):
 * a client attaches with `capabilities: ["chunked_snapshot", "event_sequence"]` and the MB/s
 * are the bytes of every snapshot frame line (begin, chunks, end, newlines included) over the
 * time from the attach request to `session_snapshot_end`. Two clients, each against a baseline
 * in the same run that a separate `node:net` process serves through a plain Unix socket, one
 * write per line, read by the same client code:
 * - a client that splits lines and `JSON.parse`s every chunk line, as a real client does; the
 *   baseline serves the very bytes the attach sent;
 * - a client that splits lines only (the transport alone: the chunks are counted, not parsed);
 *   the baseline serves lines of the same sizes.
 * Each is measured 3 times, alternating with its baseline; the medians are compared.
 *
 * Memory: 3 clients attach at once while the daemon's VmRSS is sampled every 20 ms; the peak
 * growth is the peak during the attaches minus the RSS just before them (taken first, before
 * the single attach). Building and checkpointing the transcript already grew the daemon's heap,
 * which V8 does not necessarily give back, so the figure is printed with the daemon's VmHWM.
 */
import { type ChildProcess, spawn } from "node:child_process"
import * as fs from "node:fs"
import * as os from "node:os"
import * as path from "node:path"
import {
  benchDaemonNodeArgs,
  Client,
  createSession,
  type Daemon,
  MiB,
  type Msg,
  hwmOf,
  nowMs,
  rssOf,
  runTurn,
  sampleRss,
  sleep,
  stopForProfile,
  waitReady,
  withDaemon
} from "./daemonHarness.js"
import { percentiles, printRatio } from "./report.js"

const TURNS = 50
const BULK_BYTES = 2_097_152
const CONCURRENT = 3
const RSS_TARGET_MB = 64
const ATTACH_TIMEOUT_MS = 60_000
const ROUNDS = 3

/** How the client reads chunk lines: parsed as JSON (a real client), or counted from their first bytes. */
type ReadMode = "parse" | "split"

interface Streamed {
  readonly bytes: number
  readonly seconds: number
  /** Byte length of every snapshot frame line, in order (without the newline). */
  readonly lineSizes: ReadonlyArray<number>
  readonly chunkLines: number
  /** From the attach request to the first chunk line (ms). */
  readonly firstChunkMs: number
}

/**
 * Attaches `client` and counts the snapshot frame lines up to `session_snapshot_end`: chunk lines
 * are parsed (`parse`) or counted from their first bytes (`split`). `tap` gets every snapshot
 * frame line's bytes (for the baseline to serve the same).
 */
const attachCounting = async (client: Client, id: string, mode: ReadMode = "split", tap?: (line: Buffer) => void): Promise<Streamed> => {
  const lineSizes: Array<number> = []
  let chunkLines = 0
  client.rawHook = (prefix, bytes) => {
    if (!prefix.startsWith('{"type":"session_snapshot_')) return false
    lineSizes.push(bytes)
    if (mode === "split" && prefix.startsWith('{"type":"session_snapshot_chunk"')) {
      firstChunkAt ??= nowMs()
      chunkLines++
      return true
    }
    return false // parsed below (begin, end, failed: small)
  }
  client.lineTap = tap
  let firstChunkAt: number | undefined
  client.messageHook = (m) => {
    if (m["type"] !== "session_snapshot_chunk") return false
    firstChunkAt ??= nowMs()
    chunkLines++
    return true
  }
  const started = nowMs()
  const response = client.request({ type: "attach", activeSessionId: id, capabilities: ["chunked_snapshot", "event_sequence"] }, ATTACH_TIMEOUT_MS)
  const end = await client.waitFor(
    (m) => m["type"] === "session_snapshot_end" || m["type"] === "session_snapshot_failed",
    ATTACH_TIMEOUT_MS,
    "session_snapshot_end"
  )
  const seconds = (nowMs() - started) / 1000
  client.rawHook = undefined
  client.messageHook = undefined
  client.lineTap = undefined
  const r = await response
  if (r["success"] !== true) throw new Error(`attach failed: ${JSON.stringify(r["error"])}`)
  if (r["data"]?.snapshotStream === undefined) throw new Error(`attach response has no snapshotStream: ${JSON.stringify(r["data"]).slice(0, 300)}`)
  if (end["type"] === "session_snapshot_failed") throw new Error(`session_snapshot_failed: ${JSON.stringify(end["error"])}`)
  if (end["chunkCount"] !== chunkLines) throw new Error(`session_snapshot_end says ${end["chunkCount"]} chunks, ${chunkLines} received`)
  await client.waitFor((m) => m["type"] === "session_attached", 15_000, "session_attached")
  const bytes = lineSizes.reduce((a, b) => a + b + 1, 0)
  return { bytes, seconds, lineSizes, chunkLines, firstChunkMs: (firstChunkAt ?? NaN) - started }
}

// ---------------------------------------------------------------------------------------------
// Baseline: a separate process writes lines of the same sizes to a plain Unix socket
// ---------------------------------------------------------------------------------------------

// The lines: the file's own (newline-terminated), or lines of the sizes listed in it (JSON).
const WRITER_SRC = `
const net = require("net")
const fs = require("fs")
const [socketPath, source, kind] = process.argv.slice(1)
const lines = []
if (kind === "bytes") {
  const all = fs.readFileSync(source)
  for (let at = 0; at < all.length;) {
    const nl = all.indexOf(10, at)
    lines.push(all.subarray(at, nl + 1))
    at = nl + 1
  }
} else {
  const sizes = JSON.parse(fs.readFileSync(source, "utf8"))
  const max = Math.max(...sizes)
  const line = Buffer.alloc(max + 1, 0x78)
  line[max] = 10
  const prefix = Buffer.from('{"type":"session_snapshot_chunk"')
  for (const size of sizes) {
    const view = Buffer.from(line.subarray(max - size))
    prefix.copy(view, 0)
    lines.push(view)
  }
}
const server = net.createServer((sock) => {
  sock.on("error", () => {})
  sock.write('{"type":"daemon_hello"}\\n')
  sock.once("data", async () => {
    for (const line of lines) {
      if (!sock.write(line)) await new Promise((r) => sock.once("drain", r))
    }
  })
})
server.listen(socketPath, () => process.stdout.write("ready\\n"))
`

/**
 * The baseline: `lines` (the attach's own bytes, in a file) or lines of `lineSizes`, served by a
 * plain `node:net` process, read as `mode` says.
 */
const plainSocket = async (
  source: { readonly linesFile: string } | { readonly lineSizes: ReadonlyArray<number> },
  lineCount: number,
  mode: ReadMode
): Promise<{ bytes: number; seconds: number }> => {
  const dir = fs.mkdtempSync(path.join(os.tmpdir(), "agentd-bench-attach-"))
  let child: ChildProcess | undefined
  let client: Client | undefined
  try {
    const socketPath = path.join(dir, "plain.sock")
    let args: Array<string>
    if ("linesFile" in source) {
      args = [source.linesFile, "bytes"]
    } else {
      const sizesFile = path.join(dir, "sizes.json")
      fs.writeFileSync(sizesFile, JSON.stringify(source.lineSizes))
      args = [sizesFile, "sizes"]
    }
    child = spawn(process.execPath, ["-e", WRITER_SRC, socketPath, ...args], { stdio: ["ignore", "pipe", "inherit"] })
    await new Promise<void>((resolve, reject) => {
      child!.once("error", reject)
      child!.once("exit", (code, signal) => reject(new Error(`baseline writer exited early (code ${code}, signal ${signal})`)))
      child!.stdout!.once("data", () => resolve())
    })
    client = await Client.connect(socketPath, "plain")
    let bytes = 0
    let lines = 0
    let resolve!: () => void
    const done = new Promise<void>((r) => (resolve = r))
    const counted = () => {
      if (++lines === lineCount) resolve()
    }
    client.rawHook = (_prefix, size) => {
      bytes += size + 1
      if (mode === "parse") return false
      counted()
      return true
    }
    client.messageHook = () => {
      counted()
      return true
    }
    const started = nowMs()
    client.send({ type: "go" })
    let timer: NodeJS.Timeout | undefined
    await Promise.race([
      done,
      new Promise((_, reject) => {
        timer = setTimeout(() => reject(new Error(`plain socket: ${lines} of ${lineCount} lines after ${ATTACH_TIMEOUT_MS} ms`)), ATTACH_TIMEOUT_MS)
      })
    ]).finally(() => clearTimeout(timer))
    return { bytes, seconds: (nowMs() - started) / 1000 }
  } finally {
    client?.close()
    if (child !== undefined && child.exitCode === null && child.signalCode === null) {
      child.kill("SIGKILL")
      await new Promise((r) => child!.once("exit", r))
    }
    fs.rmSync(dir, { recursive: true, force: true })
  }
}

// ---------------------------------------------------------------------------------------------

const mb = (bytes: number) => bytes / 1e6

const concurrentAttaches = async (daemon: Daemon, id: string) => {
  const clients: Array<Client> = []
  try {
    for (let i = 0; i < CONCURRENT; i++) clients.push(await daemon.connect(`concurrent-${i}`))
    // RSS before: the median of a short quiet sample.
    const quiet: Array<number> = []
    for (let i = 0; i < 10; i++) {
      quiet.push(rssOf(daemon.pid))
      await sleep(20)
    }
    quiet.sort((a, b) => a - b)
    const before = quiet[Math.floor(quiet.length / 2)]!
    const hwmBefore = hwmOf(daemon.pid)
    const sampler = sampleRss(daemon.pid, 20)
    const started = nowMs()
    const results = await Promise.all(clients.map((c) => attachCounting(c, id)))
    const seconds = (nowMs() - started) / 1000
    const { peak, samples } = sampler.stop()
    const hwmAfter = hwmOf(daemon.pid)
    const bytes = results.reduce((a, r) => a + r.bytes, 0)
    return { before, peak, samples, seconds, bytes, hwmBefore, hwmAfter }
  } finally {
    for (const c of clients) c.close()
  }
}

export default async function attach(): Promise<void> {
  await withDaemon(
    // e.g. AGENTD_BENCH_DAEMON_NODE_ARGS=--cpu-prof to profile the daemon over the run.
    { nodeArgs: benchDaemonNodeArgs() },
    async (daemon) => {
      const ctl = await daemon.connect("ctl")
      const { id } = await createSession(ctl)
      await waitReady(ctl, id)
      await ctl.ok({ type: "attach", activeSessionId: id, capabilities: ["event_sequence", "slim_attach"] })
      await ctl.waitFor((m) => m["type"] === "session_attached", 15_000, "session_attached")
      let t = nowMs()
      for (let i = 0; i < TURNS; i++) {
        await runTurn(ctl, id, `/bulk ${BULK_BYTES}`, 60_000)
        ctl.drain()
      }
      const built = nowMs() - t
      await ctl.ok({ type: "detach", activeSessionId: id })
      const state: Msg = await ctl.ok({ type: "get_state", activeSessionId: id })
      await sleep(300)

      const conc = await concurrentAttaches(daemon, id)

      const single = async (mode: ReadMode, tap?: (line: Buffer) => void) => {
        const c = await daemon.connect("single")
        try {
          return await attachCounting(c, id, mode, tap)
        } finally {
          c.close()
        }
      }
      // The attach's own bytes, for the parsing client's baseline (not timed).
      const dir = fs.mkdtempSync(path.join(os.tmpdir(), "agentd-bench-attach-lines-"))
      try {
        const linesFile = path.join(dir, "lines.jsonl")
        const out = fs.openSync(linesFile, "w")
        const snapshotFrame = Buffer.from('{"type":"session_snapshot_')
        const recorded = await single("parse", (line) => {
          if (line.subarray(0, snapshotFrame.length).equals(snapshotFrame)) fs.writeSync(out, Buffer.concat([line, Buffer.from("\n")]))
        })
        fs.closeSync(out)
        const runs = { parse: { ours: [] as Array<number>, base: [] as Array<number> }, split: { ours: [] as Array<number>, base: [] as Array<number> } }
        const firstChunk: Array<number> = []
        for (let round = 0; round < ROUNDS; round++) {
          for (const mode of ["parse", "split"] as const) {
            const ours = await single(mode)
            if (ours.bytes !== recorded.bytes) throw new Error(`an attach moved ${ours.bytes} bytes, the first ${recorded.bytes}`)
            const base = await plainSocket(mode === "parse" ? { linesFile } : { lineSizes: ours.lineSizes }, ours.lineSizes.length, mode)
            if (base.bytes !== ours.bytes) throw new Error(`baseline moved ${base.bytes} bytes, the attach ${ours.bytes}`)
            runs[mode].ours.push(mb(ours.bytes) / ours.seconds)
            firstChunk.push(ours.firstChunkMs)
            runs[mode].base.push(mb(base.bytes) / base.seconds)
          }
        }
        await stopForProfile(daemon, ctl)
        const what = `chunked attach of a ${mb(recorded.bytes).toFixed(0)} MB snapshot (${recorded.chunkLines} chunks, ${state["messageCount"]} messages)`
        const median = (xs: Array<number>) => percentiles(xs).median
        const spread = (xs: Array<number>) => xs.map((x) => x.toFixed(0)).join(", ")
        printRatio({
          what: `${what}, a client that parses every chunk`,
          unit: "MB/s",
          ours: median(runs.parse.ours),
          baseline: median(runs.parse.base),
          baselineName: "the same bytes through a plain node:net Unix socket, to the same client",
          target: 0.9
        })
        console.log(`  (medians of ${ROUNDS}; agentd ${spread(runs.parse.ours)}, baseline ${spread(runs.parse.base)} MB/s)`)
        printRatio({
          what: `${what}, a client that splits lines only`,
          unit: "MB/s",
          ours: median(runs.split.ours),
          baseline: median(runs.split.base),
          baselineName: "lines of the same sizes through a plain node:net Unix socket",
          target: 0.9
        })
        console.log(`  (medians of ${ROUNDS}; agentd ${spread(runs.split.ours)}, baseline ${spread(runs.split.base)} MB/s)`)
        console.log(`  (agentd: the attach request to the first chunk line ${firstChunk.map((ms) => ms.toFixed(1)).join(", ")} ms)`)
      } finally {
        fs.rmSync(dir, { recursive: true, force: true })
      }
      const growth = (conc.peak - conc.before) / MiB
      console.log(
        `${CONCURRENT} concurrent chunked attaches: daemon RSS before ${(conc.before / MiB).toFixed(0)} MiB, peak ` +
          `${(conc.peak / MiB).toFixed(0)} MiB (${conc.samples} samples every 20 ms) | peak RSS growth ${growth.toFixed(1)} MiB ` +
          `(target <= ${RSS_TARGET_MB} MiB: ${growth <= RSS_TARGET_MB ? "met" : "MISSED"}) | ` +
          `${(mb(conc.bytes) / conc.seconds).toFixed(0)} MB/s aggregate`
      )
      console.log(
        `  (daemon VmHWM, its lifetime peak RSS: ${(conc.hwmBefore / MiB).toFixed(0)} MiB before the attaches, set while the ` +
          `transcript was built and checkpointed; ${(conc.hwmAfter / MiB).toFixed(0)} MiB after. RSS growth is measured from ` +
          `the RSS just before, so heap already grown and not returned earlier can absorb part of it.)`
      )
      console.log(`  (transcript built in ${(built / 1000).toFixed(1)} s, in ${TURNS} turns; the snapshot is generation ${state["lastEventCursor"]?.generation}'s)`)
    }
  )
}
