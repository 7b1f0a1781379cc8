import * as NodeFileSystem from "@effect/platform-node/NodeFileSystem"
import { assert, describe, it } from "@effect/vitest"
import * as Cause from "effect/Cause"
import * as Chunk from "effect/Chunk"
import * as Context from "effect/Context"
import * as Effect from "effect/Effect"
import * as Exit from "effect/Exit"
import * as FastCheck from "effect/FastCheck"
import * as Fiber from "effect/Fiber"
import * as Layer from "effect/Layer"
import * as Option from "effect/Option"
import * as Scope from "effect/Scope"
import * as Stream from "effect/Stream"
import * as fs from "node:fs"
import * as os from "node:os"
import * as path from "node:path"
import * as SnapshotCache from "../src/SnapshotCache.js"

const decoder = new TextDecoder()
const text = (bytes: Uint8Array) => decoder.decode(bytes)
const jsonBytes = (value: unknown) => Buffer.byteLength(JSON.stringify(value), "utf8")

// A real directory per test, removed at the end of the test's scope (after the cache's own
// finalizer, which was registered later).
const tempDir = Effect.acquireRelease(
  Effect.sync(() => fs.mkdtempSync(path.join(os.tmpdir(), "agentd-snapshot-cache-"))),
  (dir) => Effect.sync(() => fs.rmSync(dir, { recursive: true, force: true }))
)

const mode = (p: string) => fs.statSync(p).mode & 0o777

const meta = (activeSessionId = "session-1"): SnapshotCache.SnapshotMeta => ({
  activeSessionId,
  messageCount: 0,
  targetChunkBytes: 64
})

/** Chunk lines of `count` messages, one message per chunk (each line is ~110 bytes). */
const linesFor = (snapshotId: string, count: number, activeSessionId = "session-1") =>
  SnapshotCache.chunkMessages(
    activeSessionId,
    snapshotId,
    Array.from({ length: count }, (_, i) => ({ id: `m${i}`, role: "user", content: `message ${i}` })),
    48
  )

const endOf = (chunkCount: number): SnapshotCache.SnapshotEnd => ({ chunkCount, lastEventSequence: chunkCount - 1 })

const failureOf = <A>(exit: Exit.Exit<A, SnapshotCache.SnapshotCacheError>): SnapshotCache.SnapshotCacheError => {
  if (Exit.isSuccess(exit)) throw new Error(`expected a failure, got ${String(exit.value)}`)
  return Option.getOrThrowWith(
    Cause.failureOption(exit.cause),
    () => new Error(`expected a typed failure, got ${Cause.pretty(exit.cause)}`)
  )
}

/** Lets every ready fiber run, so that a forked waiter reaches its parking point. */
const settle = Effect.repeatN(Effect.yieldNow(), 20)

// ---------------------------------------------------------------------------------------------
// chunkMessages
// ---------------------------------------------------------------------------------------------

describe("chunkMessages", () => {
  const parse = (bytes: Uint8Array) => {
    const line = text(bytes)
    assert.isTrue(line.endsWith("\n"))
    assert.strictEqual(line.indexOf("\n"), line.length - 1, "one line per chunk")
    return JSON.parse(line) as { type: string; activeSessionId: string; snapshotId: string; index: number; messages: Array<unknown> }
  }

  /** Checks the line format, the size bound, greediness and that the chunks rebuild the input. */
  const check = (messages: ReadonlyArray<unknown>, target: number) => {
    const chunks = SnapshotCache.chunkMessages("sess-\"1\"", "snap/1", messages, target)
    const rebuilt: Array<unknown> = []
    chunks.forEach((bytes, index) => {
      const frame = parse(bytes)
      assert.isTrue(text(bytes).startsWith(
        `{"type":"session_snapshot_chunk","activeSessionId":"sess-\\"1\\"","snapshotId":"snap/1","index":${index},"messages":[`
      ))
      assert.deepStrictEqual(Object.keys(frame), ["type", "activeSessionId", "snapshotId", "index", "messages"])
      assert.strictEqual(frame.index, index)
      assert.isAbove(frame.messages.length, 0)
      const size = jsonBytes(frame.messages)
      if (frame.messages.length > 1) assert.isAtMost(size, target)
      else if (size > target) assert.isAbove(size, target) // an oversized message travels alone
      // Greedy: the next chunk's first message would not have fitted in this one.
      const next = chunks[index + 1]
      if (next !== undefined) {
        assert.isAbove(jsonBytes([...frame.messages, parse(next).messages[0]]), target)
      }
      rebuilt.push(...frame.messages)
    })
    assert.deepStrictEqual(rebuilt, JSON.parse(JSON.stringify(messages)))
    return chunks
  }

  it("gives zero chunks for zero messages", () => {
    assert.deepStrictEqual(SnapshotCache.chunkMessages("s", "x", []), [])
  })

  it("fills a chunk exactly up to the target, not one byte past it", () => {
    // ["aaaa","bbbb"] is 15 bytes: 2 brackets + 6 + 1 comma + 6.
    const messages = ["aaaa", "bbbb"]
    assert.strictEqual(jsonBytes(messages), 15)
    assert.strictEqual(check(messages, 15).length, 1)
    assert.strictEqual(check(messages, 14).length, 2)
    assert.strictEqual(check(messages, 8).length, 2) // ["aaaa"] is exactly 8
    assert.strictEqual(check(["aaaa", "bbbb", "cccc"], 22).length, 1)
    assert.strictEqual(check(["aaaa", "bbbb", "cccc"], 21).length, 2)
  })

  it("measures UTF-8 bytes, not UTF-16 code units", () => {
    // "€" is 3 bytes in UTF-8 but one UTF-16 unit: ["€€","€€"] is 19 bytes (11 code units).
    assert.strictEqual(jsonBytes(["€€", "€€"]), 19)
    assert.strictEqual(check(["€€", "€€"], 19).length, 1)
    assert.strictEqual(check(["€€", "€€"], 18).length, 2)
  })

  it("sends an oversized message alone, between its neighbours", () => {
    const big = { content: "x".repeat(1000) }
    const chunks = check(["a", "b", big, "c", "d"], 100)
    assert.deepStrictEqual(chunks.map((c) => parse(c).messages.length), [2, 1, 2])
    assert.deepStrictEqual(parse(chunks[1]!).messages, [big])
    assert.deepStrictEqual(check([big], 10).map((c) => parse(c).messages), [[big]])
  })

  it("uses 524288 bytes by default", () => {
    const message = "y".repeat(100_000) // 100002 bytes of JSON each
    const chunks = SnapshotCache.chunkMessages("s", "x", Array.from({ length: 11 }, () => message))
    assert.deepStrictEqual(chunks.map((c) => parse(c).messages.length), [5, 5, 1])
    assert.strictEqual(SnapshotCache.DEFAULT_TARGET_CHUNK_BYTES, 524288)
  })

  it("keeps every chunk line parseable and the concatenation equal to the input (random)", () => {
    let seed = 42
    const random = () => (seed = (seed * 1103515245 + 12345) % 2147483648) / 2147483648
    for (let round = 0; round < 50; round++) {
      const messages = Array.from({ length: Math.floor(random() * 60) }, (_, i) => ({
        id: `m${i}`,
        role: random() < 0.5 ? "user" : "assistant",
        content: "é\"\n\\".repeat(Math.floor(random() * 40)) + "z".repeat(Math.floor(random() * 200)),
        nested: random() < 0.3 ? [1, null, { deep: true }] : undefined
      }))
      check(messages, 1 + Math.floor(random() * 600))
    }
  })

  it("encodes values JSON drops inside arrays as null, as JSON.stringify does", () => {
    const [chunk] = SnapshotCache.chunkMessages("s", "x", [undefined, 1])
    assert.deepStrictEqual(parse(chunk!).messages, [null, 1])
  })

  it("rejects a target that is not a positive integer", () => {
    assert.throws(() => SnapshotCache.chunkMessages("s", "x", ["a"], 0), RangeError)
    assert.throws(() => SnapshotCache.chunkMessages("s", "x", ["a"], 1.5), RangeError)
  })

  it("handles many messages in linear time", () => {
    const messages = Array.from({ length: 200_000 }, (_, i) => ({ id: i, content: "hello" }))
    const started = performance.now()
    const chunks = SnapshotCache.chunkMessages("s", "x", messages, 4096)
    const elapsed = performance.now() - started
    assert.isAbove(chunks.length, 1000)
    assert.isBelow(elapsed, 5_000)
  })
})

// ---------------------------------------------------------------------------------------------
// spillDirectoryName
// ---------------------------------------------------------------------------------------------

describe("chunkRanges and appendRange", () => {
  const messages = [
    { id: "m0", role: "user", content: "hello", timestamp: 1 },
    { id: "m1", role: "assistant", content: "x".repeat(300), timestamp: 2 },
    { id: "m2", role: "assistant", content: "ünïcödé ✓ \n quoted \"newline\"", timestamp: 3 },
    { id: "m3", role: "assistant", content: "y".repeat(5000), timestamp: 4 },
    ...Array.from({ length: 40 }, (_, i) => ({ id: `s${i}`, role: "user", content: `small ${i}`, timestamp: 10 + i }))
  ]

  for (const target of [1, 64, 400, 1000, 1_000_000]) {
    it.scoped(`a transcript file's lines read as chunks are byte for byte chunkMessages' (target ${target})`, () =>
      Effect.gen(function*() {
        const dir = yield* tempDir
        const file = path.join(dir, "transcript.jsonl")
        // Other bytes before and after the range: only [start, end) is read.
        const head = "a header line\n"
        const body = messages.map((m) => JSON.stringify(m) + "\n").join("")
        fs.writeFileSync(file, head + body + "{\"later\":1}\n")
        const start = Buffer.byteLength(head)
        const end = start + Buffer.byteLength(body)
        const cache = yield* SnapshotCache.makeMemory
        yield* cache.create("snap", meta())
        const found = yield* SnapshotCache.chunkRanges(file, start, end, target, (range) => cache.appendRange("snap", range))
        yield* cache.markComplete("snap", endOf(found.chunks))
        assert.strictEqual(found.messages, messages.length)
        const expected = SnapshotCache.chunkMessages("session-1", "snap", messages, target).map(text)
        const got = Chunk.toArray(yield* Stream.runCollect(cache.stream("snap"))).map(text)
        assert.deepStrictEqual(got, expected)
        // Two readers at once share what they read and see the same bytes.
        const [a, b] = yield* Effect.all([Stream.runCollect(cache.stream("snap")), Stream.runCollect(cache.stream("snap"))], { concurrency: 2 })
        assert.deepStrictEqual(Chunk.toArray(a).map(text), expected)
        assert.deepStrictEqual(Chunk.toArray(b).map(text), expected)
      }))
  }

  /**
   * A memory cache whose complete entry "snap" is `all` as the lines of a transcript file (in a
   * temp dir of the scope), chunked by range at `target`.
   */
  const rangeSnapshot = (all: ReadonlyArray<unknown>, target: number) =>
    Effect.gen(function*() {
      const file = path.join(yield* tempDir, "transcript.jsonl")
      const body = all.map((m) => JSON.stringify(m) + "\n").join("")
      fs.writeFileSync(file, body)
      const cache = yield* SnapshotCache.makeMemory
      yield* cache.create("snap", meta())
      const found = yield* SnapshotCache.chunkRanges(file, 0, Buffer.byteLength(body), target, (range) => cache.appendRange("snap", range))
      yield* cache.markComplete("snap", endOf(found.chunks))
      return { file, cache, chunks: found.chunks }
    })

  it.scoped("a reader of a disposed entry reads on after its file is removed or replaced (a newer generation pruned it)", () =>
    Effect.gen(function*() {
      const { file, cache } = yield* rangeSnapshot(messages, 400)
      const expected = SnapshotCache.chunkMessages("session-1", "snap", messages, 400).map(text)
      const early = yield* cache.retain("snap")
      const late = yield* cache.retain("snap")
      const first = yield* early.waitForChunk(0)
      assert.strictEqual(first._tag === "Chunk" ? text(first.bytes) : first._tag, expected[0])
      // A newer generation takes over, then prunes the file: one reader is mid-way, one has not begun.
      yield* cache.dispose("snap")
      fs.unlinkSync(file)
      fs.writeFileSync(file, "{\"other\":\"file\"}\n")
      const rest: Array<string> = []
      for (let i = 1; i < expected.length; i++) {
        const chunk = yield* early.waitForChunk(i)
        rest.push(chunk._tag === "Chunk" ? text(chunk.bytes) : chunk._tag)
      }
      assert.deepStrictEqual(rest, expected.slice(1))
      assert.deepStrictEqual(Chunk.toArray(yield* Stream.runCollect(late.stream)).map(text), expected)
      yield* early.release
      yield* late.release
      // The last reader gone, so is the entry (and its open file).
      assert.strictEqual((yield* Effect.flip(cache.info("snap"))).reason, "NotFound")
    }))

  /** Descriptors this process holds open on `file` (from /proc/self/fd). */
  const openOn = (file: string) =>
    fs.readdirSync("/proc/self/fd").filter((fd) => {
      try {
        return fs.readlinkSync(`/proc/self/fd/${fd}`) === file
      } catch {
        return false
      }
    }).length

  it.scoped("the readers of an entry open its file once, not once per chunk; the last reader's release closes it", () =>
    Effect.gen(function*() {
      const { file, cache, chunks } = yield* rangeSnapshot(messages, 400)
      assert.isAtLeast(chunks, 5)
      assert.strictEqual(openOn(file), 0)
      const a = yield* cache.retain("snap")
      const b = yield* cache.retain("snap")
      for (let i = 0; i < chunks; i++) {
        const chunk = yield* (i % 2 === 0 ? a : b).waitForChunk(i)
        if (chunk._tag === "Chunk") chunk.release()
        assert.strictEqual(openOn(file), 1, `after chunk ${i}`)
      }
      yield* a.release
      assert.strictEqual(openOn(file), 1, "one reader left")
      yield* b.release
      assert.strictEqual(openOn(file), 0, "nobody reads: no descriptor held")
      // A new reader opens it again.
      const again = yield* cache.retain("snap")
      const first = yield* again.waitForChunk(0)
      assert.strictEqual(first._tag === "Chunk" ? text(first.bytes) : first._tag, text(SnapshotCache.chunkMessages("session-1", "snap", messages, 400)[0]!))
      yield* again.release
      assert.strictEqual(openOn(file), 0)
    }))

  it("a range chunk's buffer is lent to a later read only once every reader holding it released it (random readers, reads and releases)", async () => {
    let lent = 0
    await FastCheck.assert(
      FastCheck.asyncProperty(
        FastCheck.array(FastCheck.integer({ min: 1, max: 3000 }), { minLength: 3, maxLength: 30 }),
        FastCheck.array(
          FastCheck.record({ reader: FastCheck.nat(3), action: FastCheck.constantFrom("read", "read", "release", "twice", "restart"), pick: FastCheck.nat(50) }),
          { minLength: 1, maxLength: 120 }
        ),
        (sizes, ops) =>
          Effect.runPromise(Effect.scoped(Effect.gen(function*() {
            const all = sizes.map((n, i) => ({ id: `m${i}`, role: "assistant", content: String.fromCharCode(97 + (i % 26)).repeat(n) }))
            const { cache } = yield* rangeSnapshot(all, 2000)
            const expected = SnapshotCache.chunkMessages("session-1", "snap", all, 2000).map(text)
            const readers = [0, 1, 2, 3].map(() => ({ reader: undefined as SnapshotCache.SnapshotReader | undefined, next: 0 }))
            const held: Array<{ readonly index: number; readonly bytes: Uint8Array; readonly release: () => void }> = []
            const released = new Set<ArrayBufferLike>()
            for (const op of ops) {
              const r = readers[op.reader]!
              if (op.action === "read") {
                r.reader ??= yield* cache.retain("snap")
                const chunk = yield* r.reader.waitForChunk(r.next)
                if (chunk._tag === "End") {
                  r.next = 0
                  continue
                }
                assert.strictEqual(text(chunk.bytes), expected[r.next], `chunk ${r.next} as read`)
                if (released.has(chunk.bytes.buffer)) lent++
                held.push(chunk)
                r.next++
              } else if (op.action === "restart") {
                // A reader goes (its held chunks stay held, as an outbox still writing them would).
                if (r.reader !== undefined) yield* r.reader.release
                r.reader = undefined
                r.next = 0
              } else if (held.length > 0) {
                const [chunk] = held.splice(op.pick % held.length, 1)
                chunk!.release()
                // A second release of the same chunk must not drop another reader's reference.
                if (op.action === "twice") chunk!.release()
                released.add(chunk!.bytes.buffer)
              }
              // No chunk still held was overwritten by a read into a reused buffer.
              for (const chunk of held) assert.strictEqual(text(chunk.bytes), expected[chunk.index], `chunk ${chunk.index} while held`)
            }
            for (const chunk of held) chunk.release()
          })))
      ),
      { numRuns: 60 }
    )
    // The buffers are lent at all (else the test above proves nothing about reuse).
    assert.isAbove(lent, 0)
  })

  it.scoped("a range that is not whole lines, or a file cut short, fails the read instead of sending garbage", () =>
    Effect.gen(function*() {
      const dir = yield* tempDir
      const file = path.join(dir, "transcript.jsonl")
      fs.writeFileSync(file, "{\"a\":1}\n{\"b\":2}\n")
      const notWhole = yield* Effect.flip(SnapshotCache.chunkRanges(file, 0, 10, 100, () => Effect.void))
      assert.strictEqual(notWhole.reason, "Io")
      const short = yield* Effect.flip(SnapshotCache.chunkRanges(file, 0, 100, 100, () => Effect.void))
      assert.strictEqual(short.reason, "Io")
      const cache = yield* SnapshotCache.makeMemory
      yield* cache.create("snap", meta())
      yield* cache.appendRange("snap", { path: file, start: 0, end: 12 })
      yield* cache.markComplete("snap", endOf(1))
      const failed = yield* Effect.flip(cache.waitForChunk("snap", 0))
      assert.strictEqual(failed.reason, "Io")
      assert.strictEqual((yield* Effect.flip(cache.appendRange("snap", { path: file, start: 3, end: 3 }))).reason, "InvalidChunk")
    }))
})

describe("spillDirectoryName", () => {
  it("never yields a path separator, a dot or an empty name", () => {
    for (const id of ["../../etc/x", ".", "..", "a/b", "a\\b", "\u0000", "snap.1", "日本", "%2F", "x".repeat(500)]) {
      const name = SnapshotCache.spillDirectoryName(id)
      assert.match(name, /^[A-Za-z0-9_%~-]+$/)
      assert.isAtMost(name.length, 180)
      assert.strictEqual(path.basename(name), name)
    }
    assert.strictEqual(SnapshotCache.spillDirectoryName("../../etc/x"), "%2E%2E%2F%2E%2E%2Fetc%2Fx")
    assert.strictEqual(SnapshotCache.spillDirectoryName("gen-3_snap"), "gen-3_snap")
  })

  it("gives distinct ids distinct names", () => {
    const ids = ["a/b", "a%2Fb", "a.b", "a%2Eb", "x".repeat(300), "x".repeat(301), `${"x".repeat(300)}~`]
    const names = new Set(ids.map(SnapshotCache.spillDirectoryName))
    assert.strictEqual(names.size, ids.length)
  })
})

// ---------------------------------------------------------------------------------------------
// The shared suite, run against every implementation of the Tag
// ---------------------------------------------------------------------------------------------

interface Implementation {
  readonly name: string
  readonly layer: (cacheRoot: string) => Layer.Layer<SnapshotCache.SnapshotCache>
}

// The file-backed layer gets a budget of two chunk lines, so every test also crosses a spill.
const implementations: ReadonlyArray<Implementation> = [
  { name: "layerMemory", layer: () => SnapshotCache.layerMemory },
  {
    name: "layer (spilling after 256 bytes)",
    layer: (cacheRoot) =>
      SnapshotCache.layer({ cacheRoot, memoryCacheBytes: 256 }).pipe(Layer.provide(NodeFileSystem.layer))
  }
]

const withCache = <A, E>(
  implementation: Implementation,
  body: (cache: SnapshotCache.SnapshotCacheService, cacheRoot: string) => Effect.Effect<A, E, Scope.Scope>
) =>
  Effect.gen(function*() {
    const cacheRoot = path.join(yield* tempDir, "cache")
    const context = yield* Layer.build(implementation.layer(cacheRoot))
    return yield* body(Context.get(context, SnapshotCache.SnapshotCache), cacheRoot)
  })

for (const implementation of implementations) {
  describe(`SnapshotCache ${implementation.name}`, () => {
    it.scoped("reads back every chunk in order, then the end", () =>
      withCache(implementation, (cache) =>
        Effect.gen(function*() {
          const lines = linesFor("snap-1", 5)
          yield* cache.create("snap-1", meta())
          for (const [i, line] of lines.entries()) assert.strictEqual(yield* cache.appendChunk("snap-1", line), i)
          yield* cache.markComplete("snap-1", endOf(5))
          const reader = yield* cache.retain("snap-1")
          assert.deepStrictEqual(reader.meta, meta())
          for (const [i, line] of lines.entries()) {
            const result = yield* reader.waitForChunk(i)
            assert.strictEqual(result._tag, "Chunk")
            if (result._tag === "Chunk") assert.deepStrictEqual(Buffer.from(result.bytes), Buffer.from(line))
          }
          assert.deepStrictEqual(yield* reader.waitForChunk(5), { _tag: "End", end: endOf(5) })
          assert.deepStrictEqual(yield* reader.waitForChunk(99), { _tag: "End", end: endOf(5) })
          assert.deepStrictEqual(yield* reader.awaitEnd, endOf(5))
          const info = yield* cache.info("snap-1")
          assert.strictEqual(info.status, "complete")
          assert.strictEqual(info.chunkCount, 5)
          assert.strictEqual(info.readers, 1)
          assert.strictEqual(info.totalBytes, lines.reduce((n, l) => n + l.byteLength, 0))
          const streamed = yield* Stream.runCollect(cache.stream("snap-1"))
          assert.deepStrictEqual(Chunk.toArray(streamed).map(text), lines.map(text))
        })))

    it.scoped("gives three concurrent readers and a parked one every chunk in order", () =>
      withCache(implementation, (cache) =>
        Effect.gen(function*() {
          const lines = linesFor("snap-1", 8)
          yield* cache.create("snap-1", meta())
          // Readers start before the first chunk exists: they park.
          const readers = yield* Effect.forEach([1, 2, 3], () =>
            Effect.fork(Stream.runCollect(cache.stream("snap-1"))))
          const parked = yield* Effect.fork(cache.waitForChunk("snap-1", 6))
          yield* settle
          assert.isTrue(Option.isNone(yield* Fiber.poll(parked)), "waiting for a chunk not appended yet")
          assert.strictEqual((yield* cache.info("snap-1")).readers, 4)
          for (const line of lines) {
            yield* cache.appendChunk("snap-1", line)
            yield* settle
          }
          const sixth = yield* Fiber.join(parked)
          assert.strictEqual(sixth._tag, "Chunk")
          if (sixth._tag === "Chunk") assert.strictEqual(text(sixth.bytes), text(lines[6]!))
          yield* cache.markComplete("snap-1", endOf(8))
          for (const fiber of readers) {
            assert.deepStrictEqual(Chunk.toArray(yield* Fiber.join(fiber)).map(text), lines.map(text))
          }
          // Every stream released its reference when it ended.
          assert.strictEqual((yield* cache.info("snap-1")).readers, 0)
        })))

    it.scoped("delivers a failure to every waiter, present and future", () =>
      withCache(implementation, (cache) =>
        Effect.gen(function*() {
          const lines = linesFor("snap-1", 3)
          yield* cache.create("snap-1", meta())
          yield* cache.appendChunk("snap-1", lines[0]!)
          const waiters = yield* Effect.forEach([1, 1, 1, 7], (i) => Effect.fork(Effect.exit(cache.waitForChunk("snap-1", i))))
          const streams = yield* Effect.forEach([1, 2], () => Effect.fork(Effect.exit(Stream.runDrain(cache.stream("snap-1")))))
          const reader = yield* cache.retain("snap-1")
          const ending = yield* Effect.fork(Effect.exit(reader.awaitEnd))
          yield* settle
          yield* cache.markFailed("snap-1", "worker crashed while streaming")
          const fibers: ReadonlyArray<Fiber.Fiber<Exit.Exit<unknown, SnapshotCache.SnapshotCacheError>>> = [
            ...waiters,
            ...streams,
            ending
          ]
          for (const fiber of fibers) {
            const failure = failureOf(yield* Fiber.join(fiber))
            assert.strictEqual(failure.reason, "SnapshotFailed")
            assert.strictEqual(failure.message, "worker crashed while streaming")
            assert.strictEqual(failure.snapshotId, "snap-1")
          }
          // Later readers fail too, even for a chunk that exists.
          assert.strictEqual(failureOf(yield* Effect.exit(cache.waitForChunk("snap-1", 0))).reason, "SnapshotFailed")
          assert.strictEqual((yield* cache.info("snap-1")).status, "failed")
          assert.strictEqual(failureOf(yield* Effect.exit(cache.appendChunk("snap-1", lines[1]!))).reason, "NotWritable")
        })))

    it.scoped("defers dispose until the last reader releases", () =>
      withCache(implementation, (cache) =>
        Effect.gen(function*() {
          const lines = linesFor("snap-1", 4)
          yield* cache.create("snap-1", meta())
          for (const line of lines) yield* cache.appendChunk("snap-1", line)
          yield* cache.markComplete("snap-1", endOf(4))
          const scope = yield* Scope.make()
          const reader = yield* cache.retain("snap-1").pipe(Scope.extend(scope))
          yield* cache.dispose("snap-1")
          yield* cache.dispose("snap-1") // idempotent
          const info = yield* cache.info("snap-1")
          assert.isTrue(info.disposed)
          assert.strictEqual(failureOf(yield* Effect.exit(Effect.scoped(cache.retain("snap-1")))).reason, "Disposed")
          // The existing reader still gets everything.
          const read = yield* Stream.runCollect(reader.stream)
          assert.deepStrictEqual(Chunk.toArray(read).map(text), lines.map(text))
          yield* Scope.close(scope, Exit.void)
          assert.strictEqual(failureOf(yield* Effect.exit(cache.info("snap-1"))).reason, "NotFound")
          assert.strictEqual((yield* cache.stats).entries, 0)
          assert.strictEqual((yield* cache.stats).memoryBytes, 0)
          assert.strictEqual(failureOf(yield* Effect.exit(reader.waitForChunk(0))).reason, "Released")
          yield* cache.dispose("snap-1") // unknown now: still not an error
        })))

    it.scoped("releases a reader once, however often release is called", () =>
      withCache(implementation, (cache) =>
        Effect.gen(function*() {
          yield* cache.create("snap-1", meta())
          const first = yield* cache.retain("snap-1")
          yield* cache.retain("snap-1")
          assert.strictEqual((yield* cache.info("snap-1")).readers, 2)
          yield* first.release
          yield* first.release
          assert.strictEqual((yield* cache.info("snap-1")).readers, 1)
          yield* cache.dispose("snap-1")
          // The second reader still holds the entry.
          assert.isTrue((yield* cache.info("snap-1")).disposed)
        })))

    it.scoped("fails the waiters of an unfinished entry that is disposed", () =>
      withCache(implementation, (cache) =>
        Effect.gen(function*() {
          yield* cache.create("snap-1", meta())
          const waiter = yield* Effect.fork(Effect.exit(cache.waitForChunk("snap-1", 0)))
          yield* settle
          yield* cache.dispose("snap-1")
          assert.strictEqual(failureOf(yield* Fiber.join(waiter)).reason, "Disposed")
        })))

    it.scoped("never disturbs a reader of an older snapshot when a newer one of the session arrives", () =>
      withCache(implementation, (cache) =>
        Effect.gen(function*() {
          const older = linesFor("snap-1", 5, "session-A")
          const newer = linesFor("snap-2", 6, "session-A")
          yield* cache.create("snap-1", meta("session-A"))
          for (const line of older) yield* cache.appendChunk("snap-1", line)
          yield* cache.markComplete("snap-1", endOf(5))
          const reader = yield* cache.retain("snap-1")
          const first = yield* reader.waitForChunk(0)
          // The session checkpoints again: the newer snapshot takes over and the older one is let go.
          yield* cache.create("snap-2", meta("session-A"))
          const newerReader = yield* Effect.fork(Stream.runCollect(cache.stream("snap-2")))
          for (const line of newer) yield* cache.appendChunk("snap-2", line)
          yield* cache.markComplete("snap-2", endOf(6))
          yield* cache.dispose("snap-1")
          const rest = yield* Stream.runCollect(Stream.drop(reader.stream, 1))
          assert.strictEqual(first._tag, "Chunk")
          if (first._tag === "Chunk") assert.strictEqual(text(first.bytes), text(older[0]!))
          assert.deepStrictEqual(Chunk.toArray(rest).map(text), older.slice(1).map(text))
          assert.deepStrictEqual(yield* reader.awaitEnd, endOf(5))
          assert.deepStrictEqual(Chunk.toArray(yield* Fiber.join(newerReader)).map(text), newer.map(text))
        })))

    it.scoped("rejects bad input with a reason", () =>
      withCache(implementation, (cache) =>
        Effect.gen(function*() {
          const reason = <A>(effect: Effect.Effect<A, SnapshotCache.SnapshotCacheError, Scope.Scope>) =>
            Effect.map(Effect.exit(Effect.scoped(effect)), (exit) => failureOf(exit).reason)
          yield* cache.create("snap-1", meta())
          assert.strictEqual(yield* reason(cache.create("snap-1", meta())), "AlreadyExists")
          assert.strictEqual(yield* reason(cache.create("", meta())), "InvalidSnapshotId")
          assert.strictEqual(yield* reason(cache.appendChunk("nope", linesFor("nope", 1)[0]!)), "NotFound")
          assert.strictEqual(yield* reason(cache.retain("nope")), "NotFound")
          assert.strictEqual(yield* reason(cache.appendChunk("snap-1", new TextEncoder().encode("{}"))), "InvalidChunk")
          assert.strictEqual(yield* reason(cache.appendChunk("snap-1", new Uint8Array(0))), "InvalidChunk")
          assert.strictEqual(yield* reason(cache.waitForChunk("snap-1", -1)), "InvalidIndex")
          assert.strictEqual(yield* reason(cache.waitForChunk("snap-1", 0.5)), "InvalidIndex")
          yield* cache.appendChunk("snap-1", linesFor("snap-1", 1)[0]!)
          const waiter = yield* Effect.fork(Effect.exit(cache.waitForChunk("snap-1", 1)))
          yield* settle
          assert.strictEqual(yield* reason(cache.markComplete("snap-1", endOf(2))), "ChunkCountMismatch")
          assert.strictEqual(failureOf(yield* Fiber.join(waiter)).reason, "ChunkCountMismatch")
          yield* cache.create("snap-2", meta())
          yield* cache.markComplete("snap-2", endOf(0))
          assert.deepStrictEqual(yield* cache.waitForChunk("snap-2", 0), { _tag: "End", end: endOf(0) })
          assert.strictEqual(yield* reason(cache.appendChunk("snap-2", linesFor("snap-2", 1)[0]!)), "NotWritable")
          assert.strictEqual(yield* reason(cache.markFailed("snap-2", "late")), "NotWritable")
          assert.strictEqual(yield* reason(cache.markComplete("snap-2", endOf(0))), "NotWritable")
        })))

    it.scoped("fails waiters with Closed when the cache shuts down", () =>
      Effect.gen(function*() {
        const cacheRoot = path.join(yield* tempDir, "cache")
        const scope = yield* Scope.make()
        const context = yield* Layer.buildWithScope(implementation.layer(cacheRoot), scope)
        const cache = Context.get(context, SnapshotCache.SnapshotCache)
        yield* cache.create("snap-1", meta())
        for (const line of linesFor("snap-1", 4)) yield* cache.appendChunk("snap-1", line)
        const waiter = yield* Effect.fork(Effect.exit(cache.waitForChunk("snap-1", 4)))
        yield* cache.create("snap-done", meta())
        yield* cache.markComplete("snap-done", endOf(0))
        const reader = yield* cache.retain("snap-done")
        yield* settle
        yield* Scope.close(scope, Exit.void)
        assert.strictEqual(failureOf(yield* Fiber.join(waiter)).reason, "Closed")
        // A reader of a complete entry is told too, rather than finding its files gone.
        assert.strictEqual(failureOf(yield* Effect.exit(reader.waitForChunk(0))).reason, "Closed")
        assert.strictEqual(failureOf(yield* Effect.exit(cache.create("snap-2", meta()))).reason, "Closed")
        // Nothing is left on disk.
        assert.deepStrictEqual(fs.existsSync(cacheRoot) ? fs.readdirSync(cacheRoot) : [], [])
      }))
  })
}

// ---------------------------------------------------------------------------------------------
// File-backed specifics: spilling, modes, paths, cleanup
// ---------------------------------------------------------------------------------------------

describe("SnapshotCache layer (files)", () => {
  const fileCache = <A, E>(
    memoryCacheBytes: number,
    body: (cache: SnapshotCache.SnapshotCacheService, cacheRoot: string) => Effect.Effect<A, E, Scope.Scope>
  ) =>
    withCache({
      name: "file",
      layer: (cacheRoot) =>
        SnapshotCache.layer({ cacheRoot, memoryCacheBytes }).pipe(Layer.provide(NodeFileSystem.layer))
    }, body)

  it.scoped("keeps chunks in memory up to the budget, then spills every chunk of the entry", () =>
    fileCache(1000, (cache, cacheRoot) =>
      Effect.gen(function*() {
        const lines = linesFor("snap-1", 20)
        const size = lines[0]!.byteLength
        const fit = Math.floor(1000 / size)
        assert.isAbove(fit, 2)
        yield* cache.create("snap-1", meta())
        for (const line of lines.slice(0, fit)) yield* cache.appendChunk("snap-1", line)
        let info = yield* cache.info("snap-1")
        assert.isFalse(info.spilled)
        assert.strictEqual(info.memoryBytes, fit * size)
        assert.strictEqual((yield* cache.stats).memoryBytes, fit * size)
        assert.isFalse(fs.existsSync(cacheRoot), "nothing touches the disk before the first spill")

        // The next chunk passes the budget: the entry moves to disk, chunk by chunk.
        for (const line of lines.slice(fit)) yield* cache.appendChunk("snap-1", line)
        info = yield* cache.info("snap-1")
        assert.isTrue(info.spilled)
        assert.strictEqual(info.memoryBytes, 0)
        assert.deepStrictEqual(yield* cache.stats, {
          entries: 1,
          spilledEntries: 1,
          memoryBytes: 0,
          memoryCacheBytes: 1000
        })
        const dir = path.join(cacheRoot, "snap-1")
        assert.strictEqual(info.spillDirectory, dir)
        assert.strictEqual(mode(cacheRoot), 0o700)
        assert.strictEqual(mode(dir), 0o700)
        assert.deepStrictEqual(
          fs.readdirSync(dir).sort((a, b) => parseInt(a) - parseInt(b)),
          lines.map((_, i) => `${i}.jsonl`)
        )
        for (const [i, line] of lines.entries()) {
          const file = path.join(dir, `${i}.jsonl`)
          assert.strictEqual(mode(file), 0o600)
          assert.strictEqual(fs.readFileSync(file, "utf8"), text(line))
        }

        // The budget is free again for the next entry, which stays in memory.
        yield* cache.create("snap-2", meta())
        yield* cache.appendChunk("snap-2", linesFor("snap-2", 1)[0]!)
        assert.isFalse((yield* cache.info("snap-2")).spilled)
        assert.strictEqual((yield* cache.stats).memoryBytes, linesFor("snap-2", 1)[0]!.byteLength)
        yield* cache.dispose("snap-2")
        assert.strictEqual((yield* cache.stats).memoryBytes, 0)

        yield* cache.markComplete("snap-1", endOf(20))
        const read = yield* Stream.runCollect(cache.stream("snap-1"))
        assert.deepStrictEqual(Chunk.toArray(read).map(text), lines.map(text))
        yield* cache.dispose("snap-1")
        assert.isFalse(fs.existsSync(dir))
      })))

  it.scoped("copies a chunk that is a view into a larger buffer, so memory accounting is exact", () =>
    fileCache(1 << 20, (cache) =>
      Effect.gen(function*() {
        const line = linesFor("snap-1", 1)[0]!
        const big = new Uint8Array(64 * 1024)
        big.set(line, 100)
        const view = big.subarray(100, 100 + line.byteLength)
        yield* cache.create("snap-1", meta())
        yield* cache.appendChunk("snap-1", view)
        big.fill(0) // the caller reuses its read buffer
        const result = yield* cache.waitForChunk("snap-1", 0)
        assert.strictEqual(result._tag, "Chunk")
        if (result._tag === "Chunk") {
          assert.strictEqual(text(result.bytes), text(line))
          assert.strictEqual(result.bytes.buffer.byteLength, line.byteLength)
        }
      })))

  it.scoped("shares one read of a spilled chunk between readers that ask together", () =>
    fileCache(0, (cache) =>
      Effect.gen(function*() {
        const lines = linesFor("snap-1", 2)
        yield* cache.create("snap-1", meta())
        for (const line of lines) yield* cache.appendChunk("snap-1", line)
        const results = yield* Effect.all(
          [1, 2, 3].map(() => cache.waitForChunk("snap-1", 1)),
          { concurrency: "unbounded" }
        )
        const [first, ...others] = results.map((r) => r._tag === "Chunk" ? r.bytes : undefined)
        assert.strictEqual(text(first!), text(lines[1]!))
        for (const other of others) assert.strictEqual(other, first, "the same buffer, read once")
        // While a reader still holds it, a later reader gets it without reading the file again.
        const later = yield* cache.waitForChunk("snap-1", 1)
        assert.strictEqual(later._tag === "Chunk" ? later.bytes : undefined, first)
      })))

  it.scoped("keeps a snapshotId such as ../../etc/x inside the cache root", () =>
    fileCache(0, (cache, cacheRoot) =>
      Effect.gen(function*() {
        const id = "../../etc/x"
        yield* cache.create(id, meta())
        yield* cache.appendChunk(id, linesFor(id, 1)[0]!)
        const info = yield* cache.info(id)
        assert.strictEqual(info.spillDirectory, path.join(cacheRoot, "%2E%2E%2F%2E%2E%2Fetc%2Fx"))
        assert.deepStrictEqual(fs.readdirSync(cacheRoot), ["%2E%2E%2F%2E%2E%2Fetc%2Fx"])
        assert.isFalse(fs.existsSync(path.resolve(cacheRoot, "../../etc")), "nothing escaped the root")
        assert.isFalse(fs.existsSync(path.resolve(cacheRoot, "../etc")))
        for (const other of [".", "..", "a/../b", "/abs"]) {
          yield* cache.create(other, meta())
          yield* cache.appendChunk(other, linesFor(other, 1)[0]!)
          const dir = (yield* cache.info(other)).spillDirectory!
          assert.strictEqual(path.dirname(dir), cacheRoot)
          assert.isTrue(fs.existsSync(path.join(dir, "0.jsonl")))
        }
        assert.strictEqual(fs.readdirSync(path.dirname(cacheRoot)).length, 1, "only the cache root in its parent")
      })))

  it.scoped("removes the spill directory only after the last reader releases", () =>
    fileCache(0, (cache, cacheRoot) =>
      Effect.gen(function*() {
        const lines = linesFor("snap-1", 3)
        yield* cache.create("snap-1", meta())
        for (const line of lines) yield* cache.appendChunk("snap-1", line)
        yield* cache.markComplete("snap-1", endOf(3))
        const dir = path.join(cacheRoot, "snap-1")
        const first = yield* Scope.make()
        const second = yield* Scope.make()
        const a = yield* cache.retain("snap-1").pipe(Scope.extend(first))
        const b = yield* cache.retain("snap-1").pipe(Scope.extend(second))
        yield* cache.dispose("snap-1")
        assert.isTrue(fs.existsSync(dir), "readers hold the spill directory")
        yield* Scope.close(first, Exit.void)
        assert.isTrue(fs.existsSync(dir), "one reader still holds it")
        assert.strictEqual(failureOf(yield* Effect.exit(a.waitForChunk(0))).reason, "Released")
        const read = yield* Stream.runCollect(b.stream)
        assert.deepStrictEqual(Chunk.toArray(read).map(text), lines.map(text))
        yield* b.release
        assert.isFalse(fs.existsSync(dir), "gone after the last release")
        yield* Scope.close(second, Exit.void) // the scope's release is a no-op now
        assert.deepStrictEqual(fs.readdirSync(cacheRoot), [])
      })))

  it.scoped("fails the entry and its waiters when a spill cannot be written", () =>
    fileCache(0, (cache, cacheRoot) =>
      Effect.gen(function*() {
        // A file where the cache root should be: mkdir fails.
        fs.mkdirSync(path.dirname(cacheRoot), { recursive: true })
        fs.writeFileSync(cacheRoot, "not a directory")
        yield* cache.create("snap-1", meta())
        const waiter = yield* Effect.fork(Effect.exit(cache.waitForChunk("snap-1", 0)))
        yield* settle
        const failure = failureOf(yield* Effect.exit(cache.appendChunk("snap-1", linesFor("snap-1", 1)[0]!)))
        assert.strictEqual(failure.reason, "Io")
        assert.strictEqual(failureOf(yield* Fiber.join(waiter)).reason, "Io")
        assert.strictEqual((yield* cache.info("snap-1")).status, "failed")
        assert.strictEqual((yield* cache.stats).memoryBytes, 0)
      })))
})
