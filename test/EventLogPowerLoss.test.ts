/**
 * Power-loss test of the file event log: every append acknowledged as durable survives a power
 * loss, i.e. the loss of everything that was not fsynced/fdatasynced, not only a SIGKILL (after
 * which the page cache survives: test/EventLog.test.ts's crash test cannot tell a synced write
 * from an unsynced one).
 *
 * How: a child (test/fixtures/eventLogPowerChild.ts) appends to 8 sessions x 8 appenders under
 * the harness's preload (test/fixtures/powerLossPreload.ts, test/support/powerLoss.ts), which
 * stores, per file under the log's root, its durable image: its whole content as of its last
 * completed fsync/fdatasync on any descriptor. The child is SIGKILLed after a random 200-800 ms;
 * then every file is rewritten to what a power loss leaves of it (`simulatePowerLoss`), per
 * variant: `drop` (exactly the image), `keep-prefix` (the image and a random prefix of the bytes
 * written after it), `zeros` (the image and a run of zero bytes); a file never synced is emptied
 * (or, variant, removed). The log is then opened in this process and checked, per session: every
 * acknowledged cursor is read back with its event; each generation's sequences are 0, 1, 2, ...
 * (no gap, no duplicate); each appender's events are a gapless run (an append starts only after
 * the previous one was acknowledged); every acknowledged generation exists; then one more append,
 * a clean close and a second open are checked too. Each round's child starts on the state the
 * previous round's power loss and checks left (recovery after recovery). Each round applies every
 * variant: its own on the root the next round uses, the other two on copies.
 * The self-check shows the harness can fail: a child whose syncs are skipped (acknowledged, never
 * made durable) passes a SIGKILL-only check and must lose acknowledged appends under `drop`.
 *
 * What the model covers:
 * - file contents: durable up to the last COMPLETED sync of the file (the content when that sync
 *   was called; bytes written while it ran are not counted), whatever the descriptor (the image
 *   is of the file, read through /proc/self/fd);
 * - unsynced appends: lost (`drop`), partly kept as a prefix, or replaced by zeros up to the
 *   length the file grew (`zeros`): a torn tail, a torn record, a zero-filled tail; each file on
 *   its own (a file's unsynced bytes may survive while another's, written before, do not: a
 *   segment's tail without the write-ahead record that covers it, or the other way round);
 * - a never-synced file: empty, or gone (`unsynced: "remove"`).
 * What it does NOT model:
 * - directory entries: create, rename, unlink, mkdir, rm are durable at once (the code under test
 *   fsyncs the directory after each; a missing directory fsync goes unnoticed here);
 * - unsynced writes that are not appends: an overwrite in place of synced bytes, or unsynced
 *   writes reaching the disk out of order (a later block durable, an earlier one not, beyond the
 *   prefix/zeros variants), or a truncation that is not synced (the image wins either way);
 * - data a sync made durable while it ran (bytes written during an fdatasync may be on disk:
 *   counted as lost, which is strict, never lenient);
 * - syncs Node makes inside its own implementations (`writeFile` with `flush`, streams): they read
 *   as missing (strict again); the log's paths (fs callbacks, writeSync, NodeFileSystem) are seen,
 *   which the first test and the per-round counters check;
 * - sector tearing inside the image, bit rot, lying disks, a sync that fails.
 *
 * Rounds: AGENTD_POWERLOSS_ROUNDS (default 4), e.g. `AGENTD_POWERLOSS_ROUNDS=30 npx vitest run
 * test/EventLogPowerLoss.test.ts` for a soak. A failure prints the round's seed.
 */
import * as Chunk from "effect/Chunk"
import * as Effect from "effect/Effect"
import * as Option from "effect/Option"
import * as Stream from "effect/Stream"
import { spawn } from "node:child_process"
import type { ChildProcess } from "node:child_process"
import * as fs from "node:fs"
import * as os from "node:os"
import * as path from "node:path"
import { afterEach, describe, expect, it } from "vitest"
import * as Cursor from "../src/Cursor.js"
import * as EventLog from "../src/EventLog.js"
import { childProgram } from "./support/fixtures.js"
import { rng } from "./support/sessionSim.js"
import {
  emptyManifest,
  listFiles,
  markAllDurable,
  MANIFEST,
  type Manifest,
  type PowerLossVariant,
  powerLossEnv,
  powerLossNodeArgs,
  readManifest,
  simulatePowerLoss,
  VARIANTS
} from "./support/powerLoss.js"

const ROUNDS = Number(process.env["AGENTD_POWERLOSS_ROUNDS"] ?? 4)
const SESSIONS = 8
const APPENDERS = 8
/** Appender 0 of each session starts a new generation after this many of its appends. */
const ROTATE_EVERY = 40
/**
 * The log's `writeAheadRotateBytes` in even rounds (odd rounds: the default, 32 MiB, which a
 * child never reaches): the shared write-ahead file rotates many times per child, so that power
 * losses land around rotations (segments fdatasynced, the old file removed).
 */
const WRITE_AHEAD_ROTATE_BYTES = 64 * 1024

// Cleanup: children and temp dirs, even when a test fails
// ---------------------------------------------------------------------------------------------

const cleanups: Array<() => void | Promise<void>> = []
afterEach(async () => {
  for (const cleanup of cleanups.splice(0).reverse()) {
    try {
      await cleanup()
    } catch {
      // best effort
    }
  }
})

/** The side dirs only need to survive a SIGKILL: tmpfs when there is one (halves the harness's cost). */
const SIDE_BASE = fs.existsSync("/dev/shm") ? "/dev/shm" : os.tmpdir()

const tempDir = (prefix: string, base = os.tmpdir()): string => {
  const dir = fs.mkdtempSync(path.join(base, prefix))
  cleanups.push(() => fs.rmSync(dir, { recursive: true, force: true }))
  return dir
}

// The child
// ---------------------------------------------------------------------------------------------

interface ChildRun {
  readonly lines: ReadonlyArray<string>
  readonly stderr: string
}

const killAndWait = (proc: ChildProcess): Promise<void> =>
  new Promise((resolve) => {
    if (proc.exitCode !== null || proc.signalCode !== null) return resolve()
    proc.once("exit", () => resolve())
    proc.kill("SIGKILL")
  })

/**
 * Runs `script` (with `args`) under the preload on `root` / `side`, SIGKILLs it `runMs` after its
 * `ready` line (or lets it exit by itself when `runMs` is undefined), and returns its complete
 * stdout lines.
 */
const runUnderHarness = (
  script: string,
  args: ReadonlyArray<string>,
  root: string,
  side: string,
  options: { readonly runMs?: number; readonly skipSync?: string }
): Promise<ChildRun> =>
  new Promise((resolve, reject) => {
    const proc = spawn(process.execPath, [...powerLossNodeArgs(childProgram("powerLossPreload")), script, ...args], {
      stdio: ["pipe", "pipe", "pipe"],
      env: { ...process.env, ...powerLossEnv(root, side, options.skipSync) }
    })
    cleanups.push(() => killAndWait(proc))
    const lines: Array<string> = []
    let buffered = ""
    let stderr = ""
    let timer: NodeJS.Timeout | undefined
    const guard = setTimeout(() => {
      proc.kill("SIGKILL")
      reject(new Error(`child did not finish in time: ${stderr}`))
    }, 30_000)
    proc.stdout!.on("data", (d: Buffer) => {
      buffered += d.toString()
      const parts = buffered.split("\n")
      // Only complete lines count: a line cut by the kill was never fully reported.
      buffered = parts.pop()!
      lines.push(...parts)
      if (timer === undefined && options.runMs !== undefined && parts.includes("ready")) {
        timer = setTimeout(() => proc.kill("SIGKILL"), options.runMs)
      }
    })
    proc.stderr!.on("data", (d: Buffer) => {
      stderr += d.toString()
    })
    proc.stdin!.on("error", () => {})
    proc.once("close", (code, signal) => {
      clearTimeout(guard)
      if (timer !== undefined) clearTimeout(timer)
      const expected = options.runMs === undefined ? code === 0 : signal === "SIGKILL"
      if (expected) resolve({ lines, stderr })
      else reject(new Error(`child ended with ${code}/${signal} (expected ${options.runMs === undefined ? "exit 0" : "SIGKILL"}): ${stderr}`))
    })
  })

// What was acknowledged, and the check of a log against it
// ---------------------------------------------------------------------------------------------

interface AckedEvent {
  readonly run: number
  readonly s: number
  readonly w: number
  readonly i: number
}

interface Acked {
  /** Per session: cursor (`g:s`) -> the event acknowledged at it. */
  readonly events: Map<string, Map<string, AckedEvent>>
  /** Per session: the highest generation a startGeneration acknowledged. */
  readonly generations: Map<string, number>
}

const sessionIds = Array.from({ length: SESSIONS }, (_, s) => `power-${s}`)

const newAcked = (): Acked => ({
  events: new Map(sessionIds.map((sid) => [sid, new Map()])),
  generations: new Map()
})

/** Records a child's `ack` and `gen` lines; returns how many appends it acknowledged. */
const recordAcks = (acked: Acked, lines: ReadonlyArray<string>): number => {
  let n = 0
  for (const line of lines) {
    const parts = line.split(" ")
    if (parts[0] === "ack") {
      const sid = parts[1]!
      const [g, seq, run, w, i] = parts.slice(2).map(Number) as [number, number, number, number, number]
      const events = acked.events.get(sid)!
      const key = `${g}:${seq}`
      // A cursor acknowledged twice: an acknowledged record was lost and its cursor reused.
      expect(events.has(key), `${sid}: cursor ${key} acknowledged twice`).toBe(false)
      events.set(key, { run, s: Number(sid.slice("power-".length)), w, i })
      n++
    } else if (parts[0] === "gen") {
      const sid = parts[1]!
      acked.generations.set(sid, Math.max(acked.generations.get(sid) ?? 0, Number(parts[2])))
    }
  }
  return n
}

const range = (n: number) => Array.from({ length: n }, (_, i) => i)

/**
 * Opens the log on `root` (for writing: it recovers) and checks every session against what was
 * acknowledged; the problems found (none: the log is right). The log is closed before it returns.
 */
const checkLog = (root: string, acked: Acked): Promise<Array<string>> =>
  Effect.runPromise(Effect.gen(function*() {
    const problems: Array<string> = []
    const log = yield* EventLog.EventLog
    for (const sid of sessionIds) {
      const found: Array<string> = []
      const problem = (text: string) => {
        // Enough to see what went wrong, not thousands of lines.
        if (found.length < 8) found.push(`${sid}: ${text}`)
        else if (found.length === 8) found.push(`${sid}: ...`)
      }
      const current = yield* log.currentGeneration(sid)
      const generations = yield* log.generations(sid)
      if (JSON.stringify(generations) !== JSON.stringify(range(current).map((g) => g + 1))) {
        problem(`generations ${generations.join(",")}, expected 1..${current}`)
      }
      const ackedGeneration = acked.generations.get(sid) ?? 1
      if (current < ackedGeneration) problem(`generation ${ackedGeneration} was acknowledged, the log is at ${current}`)
      const read = yield* Effect.either(Stream.runCollect(log.read(sid)))
      if (read._tag === "Left") problem(`reading failed: ${read.left.message}`)
      const records = read._tag === "Left" ? [] : Chunk.toReadonlyArray(read.right)
      // Contiguous: per generation 0, 1, 2, ... in order (no gap, no duplicate).
      const next = new Map<number, number>()
      for (const r of records) {
        const expected = next.get(r.cursor.generation) ?? 0
        if (r.cursor.sequence !== expected) problem(`read ${Cursor.format(r.cursor)} where sequence ${expected} was due`)
        next.set(r.cursor.generation, r.cursor.sequence + 1)
      }
      // Every acknowledged cursor, with its event.
      const byCursor = new Map(records.map((r) => [Cursor.format(r.cursor), r.event]))
      let missing = 0
      for (const [cursor, event] of acked.events.get(sid)!) {
        const got = byCursor.get(cursor)
        if (got === undefined) {
          missing++
          problem(`acknowledged ${cursor} is missing`)
        } else if (got["run"] !== event.run || got["s"] !== event.s || got["w"] !== event.w || got["i"] !== event.i) {
          problem(`acknowledged ${cursor} holds ${JSON.stringify(got)}, expected ${JSON.stringify(event)}`)
        }
      }
      // (the count always, whatever the cap on the lines above)
      if (missing > 0) found.push(`${sid}: ${missing} of ${acked.events.get(sid)!.size} acknowledged cursors missing in all`)
      // Each appender's events: 0, 1, 2, ... without a gap or a duplicate (one append at a time,
      // the next only after the previous was acknowledged, hence durable).
      const perAppender = new Map<string, Array<number>>()
      for (const r of records) {
        const key = `run ${String(r.event["run"])} appender ${String(r.event["w"])}`
        const list = perAppender.get(key) ?? []
        list.push(Number(r.event["i"]))
        perAppender.set(key, list)
      }
      for (const [key, list] of perAppender) {
        const sorted = [...list].sort((a, b) => a - b)
        if (sorted.some((i, n) => i !== n)) problem(`${key}: events ${sorted.slice(0, 20).join(",")}... are not 0..${list.length - 1}`)
      }
      const last = records[records.length - 1]
      const lastCursor = yield* log.lastCursor(sid)
      if (last !== undefined && !(Option.isSome(lastCursor) && Cursor.equals(lastCursor.value, last.cursor))) {
        problem(`lastCursor ${Option.isSome(lastCursor) ? Cursor.format(lastCursor.value) : "none"}, last read ${Cursor.format(last.cursor)}`)
      }
      problems.push(...found)
    }
    return problems
  }).pipe(
    Effect.provide(EventLog.layer({ root })),
    Effect.catchAll((error) => Effect.succeed([`the log failed: ${error.message}`]))
  ))

/** One more append per session, in this process, then a clean close (recorded in `acked`). */
const appendAndClose = (root: string, acked: Acked, run: number): Promise<void> =>
  Effect.runPromise(Effect.gen(function*() {
    const log = yield* EventLog.EventLog
    for (const [s, sid] of sessionIds.entries()) {
      const cursor = yield* log.append(sid, { run, s, w: -1, i: 0 })
      acked.events.get(sid)!.set(Cursor.format(cursor), { run, s, w: -1, i: 0 })
    }
  }).pipe(Effect.provide(EventLog.layer({ root }))))

const copyOf = (root: string): string => {
  const copy = tempDir("agentd-powerloss-copy-")
  fs.cpSync(root, copy, { recursive: true })
  return copy
}

const stat = (m: Manifest, name: string) => m.stats[name] ?? 0

// ---------------------------------------------------------------------------------------------

describe("power-loss harness", () => {
  it("sees node:fs through ESM namespace and named imports, the Sync API, FileHandle, renames and unlinks", async () => {
    const root = tempDir("agentd-powerloss-api-")
    const side = tempDir("agentd-powerloss-side-", SIDE_BASE)
    const script = path.join(tempDir("agentd-powerloss-script-"), "script.mjs")
    fs.writeFileSync(
      script,
      `
import * as NFS from "node:fs"
import { open as openNamed, fdatasync as fdatasyncNamed, writeSync } from "node:fs"
import * as fsp from "node:fs/promises"
const root = process.argv[2]
const p = (name) => root + "/" + name
const cb = (f) => new Promise((resolve, reject) => f((e, v) => (e ? reject(e) : resolve(v))))
// the callback API through the namespace (what fileIo.ts and NodeFileSystem use)
const a = await cb((k) => NFS.open(p("a"), "w", 0o600, k))
NFS.writeSync(a, "synced-a|")
await cb((k) => NFS.fdatasync(a, k))
NFS.writeSync(a, "lost-a")
// named imports
const b = await cb((k) => openNamed(p("b"), "w", k))
writeSync(b, "synced-b|")
await cb((k) => fdatasyncNamed(b, k))
writeSync(b, "lost-b")
// the Sync API, and a second descriptor of a file synced through another one
const c = NFS.openSync(p("c"), "w")
NFS.writeSync(c, "synced-c|")
NFS.fsyncSync(c)
const c2 = NFS.openSync(p("c"), "r+")
NFS.closeSync(c)
NFS.writeSync(c2, "lost-c", 9)
// FileHandle
const d = await fsp.open(p("d"), "w")
await d.write("synced-d|")
await d.sync()
await d.write("lost-d")
await d.close()
// renames: callback, promise, Sync; one over a synced file
for (const [name, how] of [["e", "cb"], ["f", "promise"], ["g", "sync"], ["r", "cb"]]) {
  const fd = NFS.openSync(p(name + ".tmp"), "w")
  NFS.writeSync(fd, "synced-" + name)
  NFS.fdatasyncSync(fd)
  NFS.closeSync(fd)
  if (name === "r") {
    NFS.writeFileSync(p("r"), "old-r")
    const old = NFS.openSync(p("r"), "r")
    NFS.fsyncSync(old)
    NFS.closeSync(old)
  }
  if (how === "cb") await cb((k) => NFS.rename(p(name + ".tmp"), p(name), k))
  else if (how === "promise") await fsp.rename(p(name + ".tmp"), p(name))
  else NFS.renameSync(p(name + ".tmp"), p(name))
}
// a synced file unlinked, then made again and never synced
const h = NFS.openSync(p("h"), "w")
NFS.writeSync(h, "synced-h")
NFS.fsyncSync(h)
NFS.closeSync(h)
await fsp.unlink(p("h"))
NFS.writeFileSync(p("h"), "lost-h")
// never synced at all
NFS.writeFileSync(p("n"), "lost-n")
// a directory of synced files removed; a synced directory; a directory renamed
NFS.mkdirSync(p("dd"))
NFS.mkdirSync(p("moved-from"))
for (const dir of ["dd", "moved-from"]) {
  const fd = NFS.openSync(p(dir + "/x"), "w")
  NFS.writeSync(fd, "synced-" + dir)
  NFS.fdatasyncSync(fd)
  NFS.closeSync(fd)
}
await cb((k) => NFS.rm(p("dd"), { recursive: true }, k))
await cb((k) => NFS.rename(p("moved-from"), p("moved-to"), k))
const dir = await cb((k) => NFS.open(root, "r", k))
await cb((k) => NFS.fsync(dir, k))
// outside the state dir: not recorded
const outside = NFS.openSync(process.argv[3], "w")
NFS.fsyncSync(outside)
process.exit(0)
`
    )
    const outside = path.join(tempDir("agentd-powerloss-outside-"), "o")
    await runUnderHarness(script, [root, outside], root, side, {})
    const m = readManifest(side)
    expect(Object.keys(m.images).sort()).toEqual(["a", "b", "c", "d", "e", "f", "g", "moved-to/x", "r"])
    expect(m.pendingRenames).toEqual([])
    expect(stat(m, "fdatasyncs")).toBeGreaterThanOrEqual(8)
    expect(stat(m, "fsyncs")).toBeGreaterThanOrEqual(4)
    expect(stat(m, "dirSyncs")).toBe(1)
    expect(stat(m, "renames")).toBe(5)
    expect(stat(m, "fsyncsUntracked") + stat(m, "fdatasyncsUntracked") + stat(m, "fdPathMismatch")).toBe(0)

    const expected: Record<string, string> = {
      a: "synced-a|",
      b: "synced-b|",
      c: "synced-c|",
      d: "synced-d|",
      e: "synced-e",
      f: "synced-f",
      g: "synced-g",
      h: "",
      "moved-to/x": "synced-moved-from",
      n: "",
      r: "synced-r"
    }
    const lostTails: Record<string, string> = { a: "lost-a", b: "lost-b", c: "lost-c", d: "lost-d", h: "lost-h", n: "lost-n" }
    for (const variant of VARIANTS) {
      const copy = copyOf(root)
      const report = simulatePowerLoss(copy, side, variant)
      expect([...report.unsynced].sort()).toEqual(["h", "n"])
      expect(listFiles(copy)).toEqual(Object.keys(expected).sort())
      for (const [name, image] of Object.entries(expected)) {
        const after = fs.readFileSync(path.join(copy, name), "latin1")
        const tail = after.slice(image.length)
        expect(after.startsWith(image), `${variant}: ${name} is ${JSON.stringify(after)}`).toBe(true)
        const lost = lostTails[name] ?? ""
        if (variant === "drop") expect(tail, `${variant}: ${name}`).toBe("")
        if (variant === "keep-prefix") expect(lost.startsWith(tail), `${variant}: ${name} ends ${JSON.stringify(tail)}`).toBe(true)
        if (variant === "zeros") {
          expect(/^\0*$/.test(tail) && tail.length <= lost.length, `${variant}: ${name} ends ${JSON.stringify(tail)}`).toBe(true)
          if (lost !== "") expect(tail.length).toBeGreaterThan(0)
        }
      }
    }
    const removed = copyOf(root)
    simulatePowerLoss(removed, side, "drop", { unsynced: "remove" })
    expect(listFiles(removed)).toEqual(Object.keys(expected).filter((f) => f !== "h" && f !== "n").sort())
  })

  it("completes a rename the child was killed in, and images in pieces", () => {
    const root = tempDir("agentd-powerloss-pending-")
    const side = tempDir("agentd-powerloss-side-", SIDE_BASE)
    fs.writeFileSync(path.join(side, "p1"), "head|")
    fs.writeFileSync(path.join(side, "p2"), "tail")
    const m = emptyManifest()
    m.images["s.tmp"] = { files: ["p1", "p2"], size: 9 }
    m.images["stays.tmp"] = { files: ["p2"], size: 4 }
    m.pendingRenames.push({ from: "s.tmp", to: "s" }, { from: "stays.tmp", to: "stays" })
    fs.writeFileSync(path.join(side, MANIFEST), JSON.stringify(m))
    // the first rename happened before the kill, the second did not
    fs.writeFileSync(path.join(root, "s"), "head|tail+unsynced")
    fs.writeFileSync(path.join(root, "stays.tmp"), "tail+unsynced")
    const report = simulatePowerLoss(root, side, "drop")
    expect(report.pendingRenamesCompleted).toBe(1)
    expect(fs.readFileSync(path.join(root, "s"), "utf8")).toBe("head|tail")
    expect(fs.readFileSync(path.join(root, "stays.tmp"), "utf8")).toBe("tail")
  })
})

describe("EventLog power loss", () => {
  it("every acknowledged append survives a power loss, under every variant, round after round", async () => {
    const started = Date.now()
    const root = tempDir("agentd-powerloss-")
    const acked = newAcked()
    const totals = { acks: 0, fdatasyncs: 0, renames: 0, unlinks: 0, dirSyncs: 0, lostBytes: 0, keptBytes: 0, zeroBytes: 0 }
    for (let round = 0; round < ROUNDS; round++) {
      const seed = (Date.now() ^ (round * 0x9e3779b1)) >>> 0
      const random = rng(seed)
      const side = tempDir("agentd-powerloss-side-", SIDE_BASE)
      // What the previous round left (after its checks and clean close) is durable as a whole.
      markAllDurable(root, side)
      const runMs = 200 + Math.floor(random() * 600)
      const writeAheadRotateBytes = round % 2 === 0 ? WRITE_AHEAD_ROTATE_BYTES : 0
      const where = `round ${round} (seed ${seed}, writeAheadRotateBytes ${writeAheadRotateBytes || "default"})`
      const child = await runUnderHarness(
        childProgram("eventLogPowerChild"),
        [root, String(round), String(SESSIONS), String(APPENDERS), String(ROTATE_EVERY), String(writeAheadRotateBytes)],
        root,
        side,
        { runMs }
      )
      totals.acks += recordAcks(acked, child.lines)
      const m = readManifest(side)
      // The preload saw the log's calls: every sync on a descriptor it knows, on the file it names.
      expect(stat(m, "fsyncsUntracked") + stat(m, "fdatasyncsUntracked"), `${where}: syncs of unknown descriptors`).toBe(0)
      expect(stat(m, "fdPathMismatch"), `${where}: descriptors tracked under the wrong path`).toBe(0)
      expect(stat(m, "skippedSyncs")).toBe(0)
      totals.fdatasyncs += stat(m, "fdatasyncs") + stat(m, "fsyncs")
      totals.renames += stat(m, "renames")
      totals.unlinks += stat(m, "unlinks") + stat(m, "rms")
      totals.dirSyncs += stat(m, "dirSyncs")

      // Every variant: the round's own on the root (the next round starts from it), the others on copies.
      const own = VARIANTS[round % VARIANTS.length]!
      const others: Array<{ variant: PowerLossVariant; unsynced: "truncate" | "remove" }> = VARIANTS
        .filter((v) => v !== own)
        .map((variant) => ({ variant, unsynced: variant === "drop" && round % 2 === 1 ? "remove" : "truncate" }))
      for (const { unsynced, variant } of [...others, { variant: own, unsynced: "truncate" as const }]) {
        const target = variant === own ? root : copyOf(root)
        const report = simulatePowerLoss(target, side, variant, { random, unsynced })
        totals.lostBytes += report.bytesLost
        totals.keptBytes += report.bytesKept
        totals.zeroBytes += report.zeroBytes
        const problems = await checkLog(target, acked)
        expect(problems, `${where}, ${variant} (never-synced files: ${unsynced}), after ${runMs} ms`).toEqual([])
        if (target !== root) fs.rmSync(target, { recursive: true, force: true })
      }
      // A second open after one more append and a clean close.
      await appendAndClose(root, acked, 1000 + round)
      expect(await checkLog(root, acked), `${where}: after an append and a clean close`).toEqual([])
    }
    // The kills landed while appends flowed and syncs ran, or the test proves nothing.
    expect(totals.acks).toBeGreaterThan(100 * ROUNDS)
    expect(totals.fdatasyncs).toBeGreaterThan(10 * ROUNDS)
    expect(totals.renames).toBeGreaterThan(0)
    expect(totals.dirSyncs).toBeGreaterThan(0)
    expect(totals.lostBytes).toBeGreaterThan(0)
    console.log(`power loss: ${ROUNDS} rounds, ${totals.acks} acknowledged appends, ${JSON.stringify(totals)}, ${Date.now() - started} ms`)
  }, 120_000)

  it("self-check: a log whose syncs are skipped passes a SIGKILL-only check and loses acknowledged appends under drop", async () => {
    const root = tempDir("agentd-powerloss-selfcheck-")
    const side = tempDir("agentd-powerloss-side-", SIDE_BASE)
    markAllDurable(root, side)
    const acked = newAcked()
    // Every sync of a file but a `.tmp` one reports success without syncing: appends are
    // acknowledged, never made durable (segments keep their header, synced as `.tmp`, so the
    // loss shows as missing acknowledged appends rather than as a damaged segment).
    const child = await runUnderHarness(
      childProgram("eventLogPowerChild"),
      [root, "0", String(SESSIONS), String(APPENDERS), String(ROTATE_EVERY)],
      root,
      side,
      { runMs: 400, skipSync: "^(?!.*\\.tmp$)" }
    )
    const acks = recordAcks(acked, child.lines)
    expect(acks).toBeGreaterThan(100)
    expect(stat(readManifest(side), "skippedSyncs")).toBeGreaterThan(0)
    // After a SIGKILL alone (the page cache survives) nothing is missing...
    expect(await checkLog(copyOf(root), acked)).toEqual([])
    // ...after a power loss the check finds the acknowledged appends gone.
    simulatePowerLoss(root, side, "drop")
    const problems = await checkLog(root, acked)
    expect(problems.some((p) => p.includes("acknowledged cursors missing in all")), problems.join("\n")).toBe(true)
    console.log(`self-check: ${acks} acknowledged appends without a sync; after drop: ${problems.filter((p) => p.includes("in all")).join("; ")}`)
  }, 60_000)
})
