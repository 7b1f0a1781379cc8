/**
 * SnapshotCache: 100 MiB through one entry (spilling past the default 4 MiB budget) with three
 * concurrent readers, next to baselines measured in the same run: a plain stream-pipe copy of
 * the same bytes (and fs.copyFile), and the same write-chunk-files-then-read-them pattern done
 * by hand with `node:fs`. Prints time, MB/s, ratios and the peak RSS growth (target <= 16 MiB).
 *
 * Every scenario runs in its own child process (this file, run with a scenario in the
 * environment): RSS is a high-water mark that the allocator rarely gives back, so a scenario
 * measured after another one in the same process would only show the part above the previous
 * peak. Each child warms up (module loading, JIT) before it takes its baseline.
 */
import * as NodeFileSystem from "@effect/platform-node/NodeFileSystem"
import * as Effect from "effect/Effect"
import * as Fiber from "effect/Fiber"
import * as Layer from "effect/Layer"
import * as Stream from "effect/Stream"
import { spawnSync } from "node:child_process"
import * as fs from "node:fs"
import * as os from "node:os"
import * as path from "node:path"
import { pipeline } from "node:stream/promises"
import { fileURLToPath } from "node:url"
import * as v8 from "node:v8"
import * as vm from "node:vm"
import * as SnapshotCache from "../src/SnapshotCache.js"

const MiB = 1024 * 1024
const TOTAL_BYTES = 100 * MiB
const READERS = 3
const SCENARIO_ENV = "AGENTD_BENCH_SNAPSHOT_CACHE_SCENARIO"
const SNAPSHOT_ID = "bench-snapshot"

const mib = (bytes: number) => (bytes / MiB).toFixed(1)
const rate = (bytes: number, ms: number) => bytes / MiB / (ms / 1000)

interface Measure {
  readonly elapsed: number
  readonly rssGrowth: number
  /** Peak of heap used + array buffers right after a forced GC (only with `forceGc`). */
  readonly liveGrowth?: number
  readonly written: number
  readonly delivered: number
  readonly chunkCount: number
  readonly chunkBytes: number
}

/**
 * Samples RSS every few milliseconds (the event loop stays responsive: all I/O is async). With
 * `gc`, it also samples live memory: a full GC, then another one a tick later (array buffers are
 * swept concurrently, so the figure right after the first one still counts dead buffers), and
 * only then heap used + array buffers, that is memory something still references.
 */
const sampler = (gc: (() => void) | undefined) => {
  const live = () => {
    const m = process.memoryUsage()
    return m.heapUsed + m.arrayBuffers
  }
  gc?.()
  const rssBase = process.memoryUsage.rss()
  const liveBase = live()
  let rssPeak = rssBase
  let livePeak = liveBase
  const rssTimer = setInterval(() => {
    rssPeak = Math.max(rssPeak, process.memoryUsage.rss())
  }, 5)
  // A forced full GC costs milliseconds: sample it sparsely so the run stays a streaming run.
  const liveTimer = gc === undefined ? undefined : setInterval(() => {
    gc()
    setTimeout(() => {
      gc()
      livePeak = Math.max(livePeak, live())
    }, 10)
  }, 200)
  return {
    stop: () => {
      clearInterval(rssTimer)
      if (liveTimer !== undefined) clearInterval(liveTimer)
      rssPeak = Math.max(rssPeak, process.memoryUsage.rss())
      return { rssGrowth: rssPeak - rssBase, liveGrowth: livePeak - liveBase }
    }
  }
}

/**
 * Chunk lines of ~512 KiB, arriving as fresh byte buffers (as they do from the worker pipe): the
 * message array is encoded once with `chunkMessages` and only the index in the frame changes,
 * so the bench measures the cache, not JSON.stringify.
 */
const chunkSource = (totalBytes: number) => {
  const messages = Array.from({ length: 480 }, (_, i) => ({
    id: `m${i}`,
    role: i % 2 === 0 ? "user" : "assistant",
    content: "lorem ipsum dolor sit amet ".repeat(40),
    timestamp: 1_700_000_000_000 + i
  }))
  const [template] = SnapshotCache.chunkMessages("bench-session", SNAPSHOT_ID, messages)
  if (template === undefined) throw new Error("no chunk")
  const bytes = Buffer.from(template)
  const cut = bytes.indexOf(`"index":0,`) + `"index":`.length
  const head = bytes.subarray(0, cut)
  const tail = bytes.subarray(cut + 1)
  return {
    count: Math.ceil(totalBytes / bytes.byteLength),
    messagesPerChunk: messages.length,
    chunkBytes: bytes.byteLength,
    make: (index: number) => Buffer.concat([head, Buffer.from(String(index)), tail])
  }
}

/** Writes `totalBytes` through one entry while `READERS` readers stream it. */
const runCache = async (cacheRoot: string, totalBytes: number, gc?: () => void): Promise<Measure> => {
  const source = chunkSource(totalBytes)
  const program = Effect.gen(function*() {
    const cache = yield* SnapshotCache.SnapshotCache
    yield* cache.create(SNAPSHOT_ID, {
      activeSessionId: "bench-session",
      messageCount: source.count * source.messagesPerChunk,
      targetChunkBytes: SnapshotCache.DEFAULT_TARGET_CHUNK_BYTES
    })
    // The readers start first and park: they follow the writer as attached clients would.
    const readers = yield* Effect.forEach(
      Array.from({ length: READERS }),
      () => Effect.fork(Stream.runFold(cache.stream(SNAPSHOT_ID), 0, (n, chunk) => n + chunk.byteLength))
    )
    let written = 0
    for (let index = 0; index < source.count; index++) {
      const bytes = source.make(index)
      written += bytes.byteLength
      yield* cache.appendChunk(SNAPSHOT_ID, bytes)
    }
    yield* cache.markComplete(SNAPSHOT_ID, { chunkCount: source.count, lastEventSequence: -1 })
    const read = yield* Effect.forEach(readers, Fiber.join)
    const info = yield* cache.info(SNAPSHOT_ID)
    yield* cache.dispose(SNAPSHOT_ID)
    return { written, read, info }
  })
  const layer = SnapshotCache.layer({ cacheRoot }).pipe(Layer.provide(NodeFileSystem.layer))
  const memory = sampler(gc)
  const started = performance.now()
  const result = await Effect.runPromise(Effect.provide(program, layer))
  const elapsed = performance.now() - started
  const { liveGrowth, rssGrowth } = memory.stop()
  for (const n of result.read) if (n !== result.written) throw new Error(`a reader got ${n} of ${result.written} bytes`)
  if (!result.info.spilled) throw new Error("the entry did not spill")
  if (fs.readdirSync(cacheRoot).length !== 0) throw new Error("dispose left a spill directory")
  return {
    elapsed,
    rssGrowth,
    ...(gc !== undefined ? { liveGrowth } : {}),
    written: result.written,
    delivered: result.read.reduce((a, b) => a + b, 0),
    chunkCount: source.count,
    chunkBytes: source.chunkBytes
  }
}

/**
 * The same pattern by hand with plain `node:fs`, no cache: every chunk (a fresh buffer) goes to
 * its own file and each reader reads every file back.
 */
const runPlain = async (dir: string, totalBytes: number): Promise<Measure> => {
  const source = chunkSource(totalBytes)
  fs.mkdirSync(dir, { mode: 0o700 })
  let appended = 0
  let wake: Array<() => void> = []
  let written = 0
  const memory = sampler(undefined)
  const started = performance.now()
  const writer = (async () => {
    for (let index = 0; index < source.count; index++) {
      const bytes = source.make(index)
      written += bytes.byteLength
      await fs.promises.writeFile(path.join(dir, `${index}.jsonl`), bytes, { mode: 0o600 })
      appended++
      const woken = wake
      wake = []
      for (const resume of woken) resume()
    }
  })()
  const reader = async () => {
    let n = 0
    for (let index = 0; index < source.count; index++) {
      while (appended <= index) await new Promise<void>((resume) => wake.push(resume))
      n += (await fs.promises.readFile(path.join(dir, `${index}.jsonl`))).byteLength
    }
    return n
  }
  const read = await Promise.all([writer, ...Array.from({ length: READERS }, reader)])
  const elapsed = performance.now() - started
  const { rssGrowth } = memory.stop()
  fs.rmSync(dir, { recursive: true, force: true })
  const delivered = read.reduce<number>((a, b) => a + (b ?? 0), 0)
  return { elapsed, rssGrowth, written, delivered, chunkCount: source.count, chunkBytes: source.chunkBytes }
}

/** A plain copy of a file of `totalBytes` through user space (stream pipe), and fs.copyFile. */
const runCopy = async (dir: string, totalBytes: number) => {
  const source = path.join(dir, "source.bin")
  const block = Buffer.alloc(MiB, 0x61)
  const handle = await fs.promises.open(source, "w")
  for (let written = 0; written < totalBytes; written += block.byteLength) {
    await handle.write(block, 0, Math.min(block.byteLength, totalBytes - written))
  }
  await handle.close()
  const memory = sampler(undefined)
  let started = performance.now()
  await pipeline(fs.createReadStream(source), fs.createWriteStream(path.join(dir, "piped.bin")))
  const pipeMs = performance.now() - started
  const { rssGrowth } = memory.stop()
  started = performance.now()
  await fs.promises.copyFile(source, path.join(dir, "copied.bin"))
  const copyFileMs = performance.now() - started
  for (const name of ["source.bin", "piped.bin", "copied.bin"]) fs.rmSync(path.join(dir, name))
  return { pipeMs, rssGrowth, copyFileMs }
}

/** One scenario, in this (child) process; prints its figures as one JSON line. */
const runScenario = async (scenario: string) => {
  const [name, size] = scenario.split(":")
  const totalBytes = Number(size)
  const dir = fs.mkdtempSync(path.join(os.tmpdir(), "agentd-bench-snapshot-cache-"))
  try {
    let result: unknown
    if (name === "cache" || name === "cache-gc") {
      let gc: (() => void) | undefined
      if (name === "cache-gc") {
        v8.setFlagsFromString("--expose-gc")
        gc = vm.runInNewContext("gc") as () => void
      }
      await runCache(path.join(dir, "warmup"), 8 * MiB, gc)
      result = await runCache(path.join(dir, "cache"), totalBytes, gc)
    } else if (name === "plain") {
      await runPlain(path.join(dir, "warmup"), 8 * MiB)
      result = await runPlain(path.join(dir, "plain"), totalBytes)
    } else if (name === "copy") {
      result = await runCopy(dir, totalBytes)
    } else {
      throw new Error(`unknown scenario ${scenario}`)
    }
    console.log(JSON.stringify(result))
  } finally {
    fs.rmSync(dir, { recursive: true, force: true })
  }
}

const inChild = <A>(scenario: string): A => {
  const child = spawnSync(process.execPath, [fileURLToPath(import.meta.url)], {
    env: { ...process.env, [SCENARIO_ENV]: scenario },
    encoding: "utf8",
    stdio: ["ignore", "pipe", "inherit"]
  })
  const line = child.stdout.trim().split("\n").pop()
  if (child.status !== 0 || line === undefined || line === "") {
    throw new Error(`scenario ${scenario} failed (exit ${child.status}): ${child.stdout}`)
  }
  return JSON.parse(line) as A
}

export default async function snapshotCache(): Promise<void> {
  const cache = inChild<Measure>(`cache:${TOTAL_BYTES}`)
  const double = inChild<Measure>(`cache:${2 * TOTAL_BYTES}`)
  const live = inChild<Measure>(`cache-gc:${TOTAL_BYTES}`)
  const plain = inChild<Measure>(`plain:${TOTAL_BYTES}`)
  const copy = inChild<{ pipeMs: number; rssGrowth: number; copyFileMs: number }>(`copy:${cache.written}`)
  const cacheRate = rate(cache.written, cache.elapsed)
  const pipeRate = rate(cache.written, copy.pipeMs)
  const plainRate = rate(plain.written, plain.elapsed)
  console.log(
    `snapshotCache: ${mib(cache.written)} MiB in ${cache.chunkCount} chunks of ${mib(cache.chunkBytes)} MiB ` +
      `through one entry (spilling past the default 4 MiB), ${READERS} concurrent readers; one process per line`
  )
  console.log(
    `  cache:            ${cache.elapsed.toFixed(0)} ms, ${cacheRate.toFixed(0)} MB/s of snapshot ` +
      `(written once, read ${READERS}x: ${rate(cache.delivered, cache.elapsed).toFixed(0)} MB/s delivered), ` +
      `peak RSS growth ${mib(cache.rssGrowth)} MiB for ${mib(cache.delivered)} MiB streamed`
  )
  console.log(
    `  cache, 2x size:   ${mib(double.written)} MiB: ${double.elapsed.toFixed(0)} ms, ` +
      `${rate(double.written, double.elapsed).toFixed(0)} MB/s, peak RSS growth ${mib(double.rssGrowth)} MiB ` +
      `for ${mib(double.delivered)} MiB streamed`
  )
  console.log(
    `  cache, forced GC: peak live memory growth (heap used + array buffers after GC) ` +
      `${mib(live.liveGrowth ?? Number.NaN)} MiB, peak RSS growth ${mib(live.rssGrowth)} MiB, ${live.elapsed.toFixed(0)} ms`
  )
  console.log(
    `  baseline copy:    stream pipe of ${mib(cache.written)} MiB: ${copy.pipeMs.toFixed(0)} ms, ` +
      `${pipeRate.toFixed(0)} MB/s, peak RSS growth ${mib(copy.rssGrowth)} MiB ` +
      `(fs.copyFile: ${copy.copyFileMs.toFixed(0)} ms, ${rate(cache.written, copy.copyFileMs).toFixed(0)} MB/s)`
  )
  console.log(
    `  baseline node:fs: same pattern by hand (chunk files, ${READERS} readers each reading every file): ` +
      `${plain.elapsed.toFixed(0)} ms, ${plainRate.toFixed(0)} MB/s, peak RSS growth ${mib(plain.rssGrowth)} MiB`
  )
  console.log(
    `  ratio cache/pipe copy ${(cacheRate / pipeRate).toFixed(2)}x, cache/node:fs by hand ` +
      `${(cacheRate / plainRate).toFixed(2)}x; RSS target <= 16 MiB: ` +
      `${cache.rssGrowth <= 16 * MiB ? "met" : "NOT met"} (${mib(cache.rssGrowth)} MiB)`
  )
}

const scenario = process.env[SCENARIO_ENV]
if (scenario !== undefined && process.argv[1] === fileURLToPath(import.meta.url)) {
  await runScenario(scenario)
}
