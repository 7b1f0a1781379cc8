import { spawn } from "node:child_process"
import type { ChildProcessByStdio } from "node:child_process"
import * as fsp from "node:fs/promises"
import * as os from "node:os"
import * as nodePath from "node:path"
import type { Readable, Writable } from "node:stream"
import { fileURLToPath } from "node:url"
import { assert, describe, it } from "@effect/vitest"
import * as Context from "effect/Context"
import * as Deferred from "effect/Deferred"
import * as Effect from "effect/Effect"
import * as Fiber from "effect/Fiber"
import * as Either from "effect/Either"
import * as Layer from "effect/Layer"
import * as Logger from "effect/Logger"
import * as Option from "effect/Option"
import * as Schema from "effect/Schema"
import type * as Scope from "effect/Scope"
import * as TestClock from "effect/TestClock"
import * as PostgresStore from "../src/PostgresStore.js"
import * as RecoveryJournal from "../src/RecoveryJournal.js"
import { shouldCompact } from "../src/internal/recoveryJournal/service.js"
import { makeService } from "../src/internal/recoveryJournal/service.js"
import { describePg, storeLayer } from "./support/postgres.js"
import { childProgram } from "./support/fixtures.js"

// ---------------------------------------------------------------------------------------------
// Helpers

const tempDir = Effect.acquireRelease(
  Effect.promise(() => fsp.mkdtemp(nodePath.join(os.tmpdir(), "agentd-journal-"))),
  (dir) => Effect.promise(() => fsp.rm(dir, { recursive: true, force: true }))
)

const readText = (path: string) => Effect.promise(() => fsp.readFile(path, "utf8"))

/** Non-empty lines of a file. */
const fileLines = (path: string) =>
  Effect.map(readText(path), (text) => text.split("\n").filter((line) => line.length > 0))

const decodeLine = Schema.decodeUnknownEither(Schema.parseJson(RecoveryJournal.JournalRecord))

const mode = (path: string) => Effect.promise(() => fsp.stat(path)).pipe(Effect.map((s) => s.mode & 0o777))

/** Collects log lines at Warning and above. */
const captureWarnings = () => {
  const warnings: Array<string> = []
  const logger = Logger.make(({ logLevel, message }) => {
    if (logLevel._tag === "Warning" || logLevel._tag === "Error") {
      warnings.push(Array.isArray(message) ? message.map(String).join(" ") : String(message))
    }
  })
  return { warnings, layer: Logger.replace(Logger.defaultLogger, logger) }
}

const input = (
  activeSessionId: string,
  busy: boolean,
  operation: string,
  sessionFile?: string
): RecoveryJournal.JournalInput => ({
  activeSessionId,
  sessionId: `engine-${activeSessionId}`,
  busy,
  operation,
  ...(sessionFile !== undefined ? { sessionFile } : {})
})

/** A journal built from one of the exported layers; `path` is set for the file implementation. */
interface Fixture {
  readonly journal: RecoveryJournal.RecoveryJournalService
  readonly path: Option.Option<string>
}

const implementations: ReadonlyArray<{
  readonly name: string
  readonly make: Effect.Effect<Fixture, RecoveryJournal.RecoveryJournalError, Scope.Scope>
}> = [
  {
    name: "file",
    make: Effect.gen(function*() {
      const dir = yield* tempDir
      const path = nodePath.join(dir, "state", "recovery.jsonl")
      // Compacting inside the record that leaves every session idle: the shared cases race
      // records with the compactions they trigger.
      const context = yield* Layer.build(RecoveryJournal.layer({ path, compactDelayMs: 0 }))
      return { journal: Context.get(context, RecoveryJournal.RecoveryJournal), path: Option.some(path) }
    })
  },
  {
    name: "memory",
    make: Effect.gen(function*() {
      const context = yield* Layer.build(RecoveryJournal.layerMemory)
      return { journal: Context.get(context, RecoveryJournal.RecoveryJournal), path: Option.none() }
    })
  },
  {
    // A fresh schema of the test server per test.
    name: "postgres",
    make: Effect.gen(function*() {
      const context = yield* Layer.build(PostgresStore.recoveryJournal.pipe(Layer.provide(storeLayer())))
      return { journal: Context.get(context, RecoveryJournal.RecoveryJournal), path: Option.none() }
    })
  }
]

// ---------------------------------------------------------------------------------------------
// The shared suite

for (const implementation of implementations) {
  ;(implementation.name === "postgres" ? describePg : describe)(`RecoveryJournal (${implementation.name})`, () => {
    it.scoped("records and returns the latest record per session", () =>
      Effect.gen(function*() {
        const { journal, path } = yield* implementation.make
        assert.isTrue(yield* journal.record(input("a", true, "prompt", "/s/a/1.jsonl")))
        assert.isTrue(yield* journal.record(input("b", true, "prompt")))
        assert.isTrue(yield* journal.record(input("a", true, "checkpoint", "/s/a/2.jsonl")))

        const latest = yield* journal.latest()
        assert.deepStrictEqual([...latest.keys()].sort(), ["a", "b"])
        assert.deepStrictEqual(latest.get("a"), {
          version: 1,
          activeSessionId: "a",
          sessionId: "engine-a",
          busy: true,
          operation: "checkpoint",
          sessionFile: "/s/a/2.jsonl",
          // TestClock starts at the epoch.
          recordedAt: new Date(0).toISOString()
        })
        assert.isFalse("sessionFile" in (latest.get("b") ?? {}))
        assert.deepStrictEqual(yield* journal.get("b"), Option.fromNullable(latest.get("b")))
        assert.isTrue(Option.isNone(yield* journal.get("nope")))

        if (Option.isSome(path)) {
          const lines = yield* fileLines(path.value)
          assert.strictEqual(lines.length, 3)
          assert.deepStrictEqual(yield* RecoveryJournal.readLatest(path.value), latest)
        }
      }))

    it.scoped("does not write a record equal to the latest in busy, operation and sessionFile", () =>
      Effect.gen(function*() {
        const { journal, path } = yield* implementation.make
        assert.isTrue(yield* journal.record(input("a", true, "prompt", "/f1")))
        const first = yield* journal.get("a")
        assert.isFalse(yield* journal.record(input("a", true, "prompt", "/f1")))
        // sessionId is not part of the comparison (docs/protocol.md section 6).
        assert.isFalse(yield* journal.record({ ...input("a", true, "prompt", "/f1"), sessionId: "other" }))
        assert.deepStrictEqual(yield* journal.get("a"), first)

        assert.isTrue(yield* journal.record(input("a", true, "prompt", "/f2")))
        assert.isTrue(yield* journal.record(input("a", true, "prompt")))
        assert.isTrue(yield* journal.record(input("a", true, "abort")))
        assert.isFalse(yield* journal.record(input("a", true, "abort")))
        // Another session with the same state is not a duplicate.
        assert.isTrue(yield* journal.record(input("b", true, "abort")))

        if (Option.isSome(path)) {
          assert.strictEqual((yield* fileLines(path.value)).length, 5)
        }
      }))

    it.scoped("forget drops a session", () =>
      Effect.gen(function*() {
        const { journal, path } = yield* implementation.make
        yield* journal.record(input("a", true, "prompt"))
        yield* journal.record(input("b", false, "idle"))
        yield* journal.forget("a")
        yield* journal.forget("never-recorded")
        assert.deepStrictEqual([...(yield* journal.latest()).keys()], ["b"])
        if (Option.isSome(path)) {
          const lines = yield* fileLines(path.value)
          assert.strictEqual(lines.length, 1)
          assert.deepStrictEqual([...(yield* RecoveryJournal.readLatest(path.value)).keys()], ["b"])
        }
        // A forgotten session that comes back starts over (no stale dedupe).
        assert.isTrue(yield* journal.record(input("a", true, "prompt")))
      }))

    it.scoped("serializes concurrent records: every line whole, none lost", () =>
      Effect.gen(function*() {
        const { journal, path } = yield* implementation.make
        const sessions = ["a", "b", "c", "d", "e", "f"]
        const busyRound = sessions.flatMap((s) => Array.from({ length: 10 }, (_, n) => input(s, true, `op-${s}-${n}`)))
        const written = yield* Effect.all(busyRound.map((i) => journal.record(i)), { concurrency: "unbounded" })
        assert.isTrue(written.every((w) => w))
        assert.strictEqual((yield* journal.latest()).size, 6)
        if (Option.isSome(path)) {
          const lines = yield* fileLines(path.value)
          assert.strictEqual(lines.length, 60)
          for (const line of lines) assert.isTrue(Either.isRight(decodeLine(line)), line)
        }

        // Idle records racing with the compactions they trigger.
        const idleRound = sessions.flatMap((s) => [input(s, false, "idle-1"), input(s, true, "again"), input(s, false, "idle-2")])
        yield* Effect.all(idleRound.map((i) => journal.record(i)), { concurrency: "unbounded" })
        const latest = yield* journal.latest()
        for (const s of sessions) {
          // Each session's three records ran in some order; the journal holds the last to run.
          assert.isTrue(latest.has(s))
        }
        if (Option.isSome(path)) {
          const lines = yield* fileLines(path.value)
          for (const line of lines) assert.isTrue(Either.isRight(decodeLine(line)), line)
          assert.deepStrictEqual(yield* RecoveryJournal.readLatest(path.value), latest)
        }
      }))

    it.scoped("compact() keeps the latest record of every session, busy or not", () =>
      Effect.gen(function*() {
        const { journal, path } = yield* implementation.make
        yield* journal.record(input("a", true, "one"))
        yield* journal.record(input("a", true, "two"))
        yield* journal.record(input("b", false, "idle"))
        const before = yield* journal.latest()
        yield* journal.compact()
        assert.deepStrictEqual(yield* journal.latest(), before)
        if (Option.isSome(path)) {
          assert.strictEqual((yield* fileLines(path.value)).length, 2)
          assert.deepStrictEqual(yield* RecoveryJournal.readLatest(path.value), before)
        }
        // Dedupe still works against the compacted state.
        assert.isFalse(yield* journal.record(input("a", true, "two")))
      }))
  })
}

/**
 * A journal over a backend that notes each write's operations; the first write waits for
 * `release` (an fsync behind many others): the records asked for meanwhile queue.
 */
const slowFirstWrite = Effect.gen(function*() {
  const release = yield* Deferred.make<void>()
  const writes: Array<ReadonlyArray<string>> = []
  const write = (records: ReadonlyArray<RecoveryJournal.JournalRecord>) =>
    Effect.gen(function*() {
      writes.push(records.map((r) => r.operation))
      if (writes.length === 1) yield* Deferred.await(release)
    })
  const journal = yield* makeService({ latest: new Map(), lines: 0 }, { append: (r) => write([r]), appendAll: write, compact: () => Effect.void, remove: () => Effect.void })
  return { journal, writes, release }
})

describe("RecoveryJournal group commit", () => {
  it.effect("records asked for while a write is under way go together in the next write, in order, each answered", () =>
    Effect.gen(function*() {
      const { journal, release, writes } = yield* slowFirstWrite
      const ask = (i: number) => Effect.fork(journal.record(input(`s${i % 10}`, true, `op-${i}`)))
      const first = yield* ask(0)
      while (writes.length === 0) yield* Effect.yieldNow()
      // The first write is under way: these wait for it, and go in the next.
      const fibers = [first, ...yield* Effect.forEach(Array.from({ length: 49 }, (_, i) => i + 1), ask)]
      for (let i = 0; i < 20; i++) yield* Effect.yieldNow()
      assert.deepStrictEqual(writes, [["op-0"]])
      yield* Deferred.succeed(release, undefined)
      const changed = yield* Fiber.joinAll(fibers)
      assert.isTrue(changed.every((c) => c))
      // One at a time, that was 50 write+fsync round trips.
      assert.deepStrictEqual(writes, [["op-0"], Array.from({ length: 49 }, (_, i) => `op-${i + 1}`)])
      const latest = yield* journal.latest()
      for (let s = 0; s < 10; s++) assert.strictEqual(latest.get(`s${s}`)?.operation, `op-${40 + s}`)
    }))

  it.effect("a write that fails (or dies) answers every record of its batch so, changes nothing, and the next record is written", () =>
    Effect.gen(function*() {
      const writes: Array<ReadonlyArray<string>> = []
      let outcome: "fail" | "die" | "ok" = "fail"
      const write = (records: ReadonlyArray<RecoveryJournal.JournalRecord>) =>
        Effect.suspend(() => {
          writes.push(records.map((r) => r.operation))
          if (outcome === "fail") return Effect.fail(new RecoveryJournal.RecoveryJournalError({ operation: "append", path: "j", cause: "disk full" }))
          if (outcome === "die") return Effect.die("a bug")
          return Effect.void
        })
      const journal = yield* makeService({ latest: new Map(), lines: 0 }, { append: (r) => write([r]), appendAll: write, compact: () => Effect.void, remove: () => Effect.void })
      const batch = (ops: ReadonlyArray<string>) => Effect.forEach(ops, (op, i) => Effect.exit(journal.record(input(`s${i}`, true, op))), { concurrency: "unbounded" })
      const failed = yield* batch(["a", "b", "c"])
      for (const exit of failed) assert.strictEqual(exit._tag === "Failure" && exit.cause._tag === "Fail" ? exit.cause.error.message : "", "recovery journal: append j failed: disk full")
      outcome = "die"
      const died = yield* batch(["d"])
      assert.strictEqual(died[0]!._tag === "Failure" && died[0]!.cause._tag, "Die")
      assert.strictEqual((yield* journal.latest()).size, 0)
      outcome = "ok"
      const ok = yield* batch(["e"])
      assert.deepStrictEqual(ok.map((e) => e._tag), ["Success"])
      assert.deepStrictEqual(writes, [["a", "b", "c"], ["d"], ["e"]])
      assert.strictEqual((yield* journal.latest()).get("s0")?.operation, "e")
    }))

  it.effect("a record given up before a write took it is not written; one given up during its write is", () =>
    Effect.gen(function*() {
      const { journal, release, writes } = yield* slowFirstWrite
      const first = yield* Effect.fork(journal.record(input("s0", true, "taken")))
      while (writes.length === 0) yield* Effect.yieldNow()
      const queued = yield* Effect.fork(journal.record(input("s1", true, "given-up")))
      const kept = yield* Effect.fork(journal.record(input("s2", true, "kept")))
      for (let i = 0; i < 10; i++) yield* Effect.yieldNow()
      yield* Fiber.interrupt(first)
      yield* Fiber.interrupt(queued)
      yield* Deferred.succeed(release, undefined)
      assert.isTrue(yield* Fiber.join(kept))
      assert.deepStrictEqual(writes, [["taken"], ["kept"]])
      assert.deepStrictEqual([...(yield* journal.latest()).keys()].sort(), ["s0", "s2"])
    }))
})

// ---------------------------------------------------------------------------------------------
// File-specific behaviour

describe("RecoveryJournal (file)", () => {
  const openAt = (path: string, options: Omit<RecoveryJournal.Options, "path"> = { compactDelayMs: 0 }) =>
    Layer.build(RecoveryJournal.layer({ path, ...options })).pipe(
      Effect.map((context) => Context.get(context, RecoveryJournal.RecoveryJournal))
    )

  it.scoped("compacts to one line per session through a temp file and a rename once every session is idle", () =>
    Effect.gen(function*() {
      const dir = yield* tempDir
      const path = nodePath.join(dir, "recovery.jsonl")
      const journal = yield* openAt(path)
      yield* journal.record(input("a", true, "prompt"))
      yield* journal.record(input("b", true, "prompt"))
      yield* journal.record(input("a", false, "idle"))
      yield* journal.record(input("a", true, "prompt-2"))
      yield* journal.record(input("a", false, "idle-2"))
      // b is still busy: nothing is compacted yet.
      assert.strictEqual((yield* fileLines(path)).length, 5)
      const inodeBefore = (yield* Effect.promise(() => fsp.stat(path))).ino

      yield* journal.record(input("b", false, "idle", "/s/b/3.jsonl"))
      const lines = yield* fileLines(path)
      assert.strictEqual(lines.length, 2)
      const records = lines.map((line) => Either.getOrThrow(decodeLine(line)))
      assert.deepStrictEqual(records.map((r) => [r.activeSessionId, r.busy, r.operation]), [
        ["a", false, "idle-2"],
        ["b", false, "idle"]
      ])
      // A new inode: the file was replaced by rename, not rewritten in place.
      assert.notStrictEqual((yield* Effect.promise(() => fsp.stat(path))).ino, inodeBefore)
      assert.deepStrictEqual(yield* Effect.promise(() => fsp.readdir(dir)), ["recovery.jsonl"])

      // Appends after a compaction go to the new file.
      yield* journal.record(input("a", true, "prompt-3"))
      assert.strictEqual((yield* fileLines(path)).length, 3)
      assert.strictEqual((yield* RecoveryJournal.readLatest(path)).get("a")?.operation, "prompt-3")
      // An idle record that changes nothing does not compact an already compact file either.
      yield* journal.record(input("a", false, "idle-3"))
      assert.strictEqual((yield* fileLines(path)).length, 2)
    }))

  /** Real time passing (the journal's delay runs on the TestClock). */
  const realSleep = (ms: number) => Effect.promise(() => new Promise<void>((resolve) => setTimeout(resolve, ms)))
  /** Waits (real time) until the file has `n` lines; fails after 10 s. */
  const untilLines = (path: string, n: number) =>
    Effect.gen(function*() {
      for (let i = 0; i < 500; i++) {
        if ((yield* fileLines(path)).length === n) return
        yield* realSleep(20)
      }
      assert.fail(`the journal never had ${n} lines: ${(yield* fileLines(path)).length}`)
    })

  it.scoped("a compaction waits until every session has stayed idle for compactDelayMs: turns back to back do not compact", () =>
    Effect.gen(function*() {
      const dir = yield* tempDir
      const path = nodePath.join(dir, "recovery.jsonl")
      const journal = yield* openAt(path, { compactDelayMs: 200 })
      yield* journal.record(input("a", true, "prompt-0"))
      const inode = (yield* Effect.promise(() => fsp.stat(path))).ino
      yield* journal.record(input("a", false, "idle-0"))
      for (let turn = 1; turn < 5; turn++) {
        yield* journal.record(input("a", true, `prompt-${turn}`))
        yield* journal.record(input("a", false, `idle-${turn}`))
      }
      // No time passed: every idle moment was cut short by the next prompt.
      yield* TestClock.adjust("199 millis")
      yield* realSleep(100)
      assert.strictEqual((yield* fileLines(path)).length, 10)
      assert.strictEqual((yield* Effect.promise(() => fsp.stat(path))).ino, inode)

      // A prompt inside the delay: the compaction due at its start is not run when the delay ends.
      yield* journal.record(input("a", true, "prompt-5"))
      yield* TestClock.adjust("1 millis")
      yield* realSleep(100)
      assert.strictEqual((yield* fileLines(path)).length, 11)

      // Idle for the whole delay: compacted, through a new file.
      yield* journal.record(input("a", false, "idle-5"))
      yield* TestClock.adjust("200 millis")
      yield* untilLines(path, 1)
      const [line] = yield* fileLines(path)
      assert.strictEqual(Either.getOrThrow(decodeLine(line!)).operation, "idle-5")
      assert.notStrictEqual((yield* Effect.promise(() => fsp.stat(path))).ino, inode)
      assert.deepStrictEqual(yield* Effect.promise(() => fsp.readdir(dir)), ["recovery.jsonl"])
      // Appends go to the new file.
      yield* journal.record(input("a", true, "prompt-6"))
      assert.strictEqual((yield* RecoveryJournal.readLatest(path)).get("a")?.operation, "prompt-6")
    }))

  it.scoped("sessions that are never idle together still have the file compacted, at compactBusyAfter lines too many", () =>
    Effect.gen(function*() {
      const dir = yield* tempDir
      const path = nodePath.join(dir, "recovery.jsonl")
      const journal = yield* openAt(path, { compactDelayMs: 0, compactBusyAfter: 30 })
      yield* journal.record(input("b", true, "prompt"))
      // b stays busy; a's turns come and go: 2 sessions, compacted once 30 lines are too many.
      for (let turn = 0; turn < 15; turn++) {
        yield* journal.record(input("a", true, `prompt-${turn}`))
        yield* journal.record(input("a", false, `idle-${turn}`))
      }
      assert.strictEqual((yield* fileLines(path)).length, 31)
      yield* journal.record(input("a", true, "prompt-15"))
      const lines = (yield* fileLines(path)).map((line) => Either.getOrThrow(decodeLine(line)))
      assert.deepStrictEqual(lines.map((r) => [r.activeSessionId, r.operation]).sort(), [["a", "prompt-15"], ["b", "prompt"]])
      assert.deepStrictEqual(yield* RecoveryJournal.readLatest(path), yield* journal.latest())
    }))

  it.scoped("closing the journal compacts it, a compaction still waiting included", () =>
    Effect.gen(function*() {
      const dir = yield* tempDir
      const path = nodePath.join(dir, "recovery.jsonl")
      yield* Effect.scoped(Effect.gen(function*() {
        const journal = yield* openAt(path, { compactDelayMs: 200 })
        for (let turn = 0; turn < 5; turn++) {
          yield* journal.record(input("a", true, `prompt-${turn}`))
          yield* journal.record(input("a", false, `idle-${turn}`))
        }
        yield* journal.record(input("b", true, "prompt"))
        assert.strictEqual((yield* fileLines(path)).length, 11)
      }))
      const lines = (yield* fileLines(path)).map((line) => Either.getOrThrow(decodeLine(line)))
      assert.deepStrictEqual(lines.map((r) => [r.activeSessionId, r.operation]), [["a", "idle-4"], ["b", "prompt"]])
      // Compact already: the next close (and compact()) leaves the file as it is, same inode.
      const inode = (yield* Effect.promise(() => fsp.stat(path))).ino
      const sameFile = Effect.gen(function*() {
        assert.strictEqual((yield* Effect.promise(() => fsp.stat(path))).ino, inode)
        assert.strictEqual((yield* fileLines(path)).length, 2)
      })
      // (Checked after each one: two rewrites in a row may give the file its old inode number back.)
      yield* Effect.scoped(Effect.gen(function*() {
        const journal = yield* openAt(path, { compactDelayMs: 200 })
        yield* journal.compact()
        yield* sameFile
      }))
      yield* sameFile
    }))

  it("shouldCompact: more lines than sessions, and every session idle or the busy bound reached (table)", () => {
    const latest = (...busy: Array<boolean>) =>
      new Map(busy.map((b, i) => [`s${i}`, Either.getOrThrow(decodeLine(JSON.stringify({
        version: 1,
        activeSessionId: `s${i}`,
        sessionId: `e${i}`,
        busy: b,
        operation: "op",
        recordedAt: new Date(0).toISOString()
      })))]))
    const cases: ReadonlyArray<readonly [lines: number, sessions: ReturnType<typeof latest>, busyAfter: number, expected: boolean]> = [
      [0, latest(), 10, false],
      [1, latest(false), 10, false], // one line per session: nothing to gain
      [2, latest(false), 10, true],
      [2, latest(false, false), 10, false],
      [3, latest(false, false), 10, true],
      [2, latest(true), 10, false], // busy: wait for a quiet moment
      [10, latest(true), 10, false], // 9 too many
      [11, latest(true), 10, true], // the busy bound: whatever the sessions do
      [12, latest(false, true), 10, true],
      [11, latest(false, true), 10, false]
    ]
    for (const [lines, sessions, busyAfter, expected] of cases) {
      assert.strictEqual(shouldCompact(lines, sessions, busyAfter), expected, `${lines} lines, ${sessions.size} sessions, busy bound ${busyAfter}`)
    }
  })

  it.scoped("skips torn, garbage and unknown-version lines with one warning, and repairs the file on open", () =>
    Effect.gen(function*() {
      const dir = yield* tempDir
      const path = nodePath.join(dir, "recovery.jsonl")
      const good = (id: string, operation: string) =>
        JSON.stringify({
          version: 1,
          activeSessionId: id,
          sessionId: `engine-${id}`,
          busy: true,
          operation,
          recordedAt: "2026-01-01T00:00:00.000Z"
        })
      const text = [
        good("a", "first"),
        "not json at all",
        JSON.stringify({ ...JSON.parse(good("a", "future")), version: 2 }),
        "",
        "{\"version\":1,\"activeSessionId\":\"c\"}",
        good("b", "second") + "\r",
        good("a", "third"),
        good("c", "torn").slice(0, 40)
      ].join("\n")
      yield* Effect.promise(() => fsp.writeFile(path, text, { mode: 0o600 }))

      const capture = captureWarnings()
      const latest = yield* RecoveryJournal.readLatest(path).pipe(Effect.provide(capture.layer))
      assert.deepStrictEqual([...latest.keys()], ["a", "b"])
      assert.strictEqual(latest.get("a")?.operation, "third")
      assert.strictEqual(latest.get("b")?.operation, "second")
      assert.strictEqual(capture.warnings.length, 1)
      assert.include(capture.warnings[0], "skipped 4 invalid line(s)")
      assert.include(capture.warnings[0], "torn last line")
      // Reading never writes.
      assert.strictEqual(yield* readText(path), text)

      // A missing journal is an empty one.
      assert.strictEqual((yield* RecoveryJournal.readLatest(nodePath.join(dir, "absent.jsonl"))).size, 0)

      // The writer repairs on open: the torn bytes can never end up in the middle of the file.
      const journal = yield* openAt(path).pipe(Effect.provide(capture.layer))
      assert.deepStrictEqual(yield* journal.latest(), latest)
      const repaired = yield* fileLines(path)
      assert.strictEqual(repaired.length, 2)
      for (const line of repaired) assert.isTrue(Either.isRight(decodeLine(line)))
      yield* journal.record(input("c", true, "after"))
      const lines = yield* fileLines(path)
      assert.strictEqual(lines.length, 3)
      for (const line of lines) assert.isTrue(Either.isRight(decodeLine(line)), line)
      assert.strictEqual((yield* RecoveryJournal.readLatest(path)).get("c")?.operation, "after")
    }))

  it.scoped("starts a new line after a complete record that lost only its newline", () =>
    Effect.gen(function*() {
      const dir = yield* tempDir
      const path = nodePath.join(dir, "recovery.jsonl")
      const last = JSON.stringify({
        version: 1,
        activeSessionId: "a",
        sessionId: "engine-a",
        busy: true,
        operation: "no-newline",
        recordedAt: "2026-01-01T00:00:00.000Z"
      })
      yield* Effect.promise(() => fsp.writeFile(path, last, { mode: 0o600 }))
      const journal = yield* openAt(path)
      assert.strictEqual((yield* journal.get("a")).pipe(Option.map((r) => r.operation), Option.getOrNull), "no-newline")
      yield* journal.record(input("b", true, "next"))
      const text = yield* readText(path)
      assert.strictEqual(text, `${last}\n${JSON.stringify(Option.getOrThrow(yield* journal.get("b")))}\n`)
    }))

  it.scoped("creates the file 0600 in a 0700 directory and keeps it 0600 across compactions", () =>
    Effect.gen(function*() {
      const dir = yield* tempDir
      const stateDir = nodePath.join(dir, "a", "state")
      const path = nodePath.join(stateDir, "recovery.jsonl")
      const journal = yield* openAt(path)
      yield* journal.record(input("a", true, "prompt"))
      assert.strictEqual(yield* mode(stateDir), 0o700)
      assert.strictEqual(yield* mode(nodePath.join(dir, "a")), 0o700)
      assert.strictEqual(yield* mode(path), 0o600)
      yield* journal.record(input("a", false, "idle"))
      assert.strictEqual((yield* fileLines(path)).length, 1)
      assert.strictEqual(yield* mode(path), 0o600)

      // A pre-existing journal with a loose mode is tightened.
      const loose = nodePath.join(dir, "loose.jsonl")
      yield* Effect.promise(() => fsp.writeFile(loose, "", { mode: 0o644 }))
      yield* Effect.promise(() => fsp.chmod(loose, 0o644))
      yield* openAt(loose)
      assert.strictEqual(yield* mode(loose), 0o600)
    }))

  it.scoped("another reader sees what the writer recorded; a reopened journal resumes its state", () =>
    Effect.gen(function*() {
      const dir = yield* tempDir
      const path = nodePath.join(dir, "recovery.jsonl")
      const journal = yield* openAt(path)
      yield* journal.record(input("a", true, "prompt", "/s/a/1.jsonl"))
      yield* journal.record(input("b", false, "idle"))
      // A worker restoring a session reads the file without opening it for writing.
      const seen = yield* RecoveryJournal.readLatest(path)
      assert.deepStrictEqual(seen, yield* journal.latest())
      assert.strictEqual(seen.get("a")?.sessionFile, "/s/a/1.jsonl")

      const reopened = yield* Effect.scoped(Effect.gen(function*() {
        const again = yield* openAt(path)
        // Dedupe holds across restarts: the state came from the file.
        assert.isFalse(yield* again.record(input("a", true, "prompt", "/s/a/1.jsonl")))
        return yield* again.latest()
      }))
      assert.deepStrictEqual(reopened, seen)
    }))

  it.scoped("removes a temp file left by a writer killed during compaction", () =>
    Effect.gen(function*() {
      const dir = yield* tempDir
      const path = nodePath.join(dir, "recovery.jsonl")
      const stray = nodePath.join(dir, ".recovery.jsonl.12345.abcd.tmp")
      yield* Effect.promise(() => fsp.writeFile(stray, "{\"half\":"))
      const journal = yield* openAt(path)
      yield* journal.record(input("a", true, "prompt"))
      assert.deepStrictEqual(yield* Effect.promise(() => fsp.readdir(dir)), ["recovery.jsonl"])
    }))
})

// ---------------------------------------------------------------------------------------------
// Crash test: real processes killed with SIGKILL at random moments

const root = fileURLToPath(new URL("..", import.meta.url))
// Bundled once for the run (test/support/fixturesGlobalSetup.ts): a start costs ~plain node's.
const childPath = childProgram("journalChild")
const SESSIONS = 3
const LANES = 2
/**
 * Children SIGKILLed per lane (`AGENTD_CRASH_RUNS`, default 5). A soak run sets more, e.g.
 * `AGENTD_CRASH_RUNS=50 npx vitest run test/RecoveryJournal.test.ts`.
 */
const RUNS_PER_LANE = Number(process.env["AGENTD_CRASH_RUNS"] ?? 5)

type Child = ChildProcessByStdio<Writable, Readable, Readable>

/** Every live child, so that the test's finalizer can kill them; `stopped` forbids new ones. */
interface Children {
  stopped: boolean
  readonly running: Set<Running>
}

/** A spawned journal child and what it has said so far. */
interface Running {
  readonly child: Child
  readonly acks: Array<number>
  readonly exited: Promise<void>
  readonly stderr: Array<string>
  /** Resolves when the child prints `line` (or exits). */
  readonly waitFor: (line: "loaded" | "ack") => Promise<void>
}

const spawnChild = (path: string, start: number): Running => {
  const child = spawn(process.execPath, [childPath, path, String(SESSIONS), String(start), "--wait"], {
    cwd: root,
    stdio: ["pipe", "pipe", "pipe"]
  })
  const acks: Array<number> = []
  const stderr: Array<string> = []
  const seen = new Set<string>()
  const waiters: Array<{ line: string; resolve: () => void }> = []
  const notify = (line: string) => {
    seen.add(line)
    for (const w of waiters.splice(0)) {
      if (w.line === line) w.resolve()
      else waiters.push(w)
    }
  }
  let buffered = ""
  child.stdout.setEncoding("utf8")
  child.stdout.on("data", (data: string) => {
    buffered += data
    const lines = buffered.split("\n")
    buffered = lines.pop() ?? ""
    for (const line of lines) {
      if (line.startsWith("ack ")) {
        acks.push(Number(line.slice(4)))
        notify("ack")
      } else if (line === "loaded") notify("loaded")
    }
  })
  child.stderr.setEncoding("utf8")
  child.stderr.on("data", (data: string) => stderr.push(data))
  child.stdin.on("error", () => undefined)
  const exited = new Promise<void>((resolve) => child.once("close", () => resolve()))
  void exited.then(() => {
    for (const w of waiters.splice(0)) w.resolve()
  })
  return {
    child,
    acks,
    exited,
    stderr,
    waitFor: (line) =>
      seen.has(line) || child.exitCode !== null || child.signalCode !== null
        ? Promise.resolve()
        : new Promise((resolve) => waiters.push({ line, resolve }))
  }
}

const killChild = (running: Running): Promise<void> => {
  if (running.child.exitCode === null && running.child.signalCode === null) running.child.kill("SIGKILL")
  return running.exited
}

const indexOf = (record: RecoveryJournal.JournalRecord): number => Number(record.operation.slice("op-".length))

/**
 * One lane: a journal file and a sequence of children, each killed at a random moment after its
 * first acknowledged record. The next child boots (loads its modules) while the current one runs,
 * and opens the journal only once the current one is dead.
 */
const runLane = async (dir: string, lane: number, children: Children): Promise<number> => {
  const path = nodePath.join(dir, `lane-${lane}`, "recovery.jsonl")
  // The latest record known to be durable for each session, as a record index.
  const durable = new Map<string, number>()
  const startOf = (run: number) => (run + 1) * 1_000_000
  const launch = (run: number) => {
    if (children.stopped) throw new Error("crash test stopped")
    const running = spawnChild(path, startOf(run))
    children.running.add(running)
    return running
  }
  let next = launch(0)
  let kills = 0
  for (let run = 0; run < RUNS_PER_LANE; run++) {
    const current = next
    await current.waitFor("loaded")
    current.child.stdin.write("go\n")
    if (run + 1 < RUNS_PER_LANE) next = launch(run + 1)
    await current.waitFor("ack")
    // Random moment: from right after the first ack to a few dozen records (and compactions) later.
    await new Promise((resolve) => setTimeout(resolve, Math.random() * 80))
    await killChild(current)
    children.running.delete(current)
    if (current.acks.length === 0) {
      throw new Error(`lane ${lane} run ${run}: child exited without recording: ${current.stderr.join("")}`)
    }
    if (current.child.signalCode === "SIGKILL") kills++

    // What must be on disk: per session, the last acknowledged record or the one in flight.
    const lastAck = current.acks[current.acks.length - 1]!
    const inFlight = lastAck + 1
    const expected = new Map(durable)
    for (const i of current.acks) expected.set(`s${i % SESSIONS}`, i)

    const latest = await Effect.runPromise(RecoveryJournal.readLatest(path).pipe(Effect.provide(Logger.remove(Logger.defaultLogger))))
    for (const [session, index] of expected) {
      const record = latest.get(session)
      assert.isDefined(record, `lane ${lane} run ${run}: ${session} lost`)
      const found = indexOf(record!)
      const ok = found === index || (found === inFlight && `s${inFlight % SESSIONS}` === session)
      assert.isTrue(ok, `lane ${lane} run ${run}: ${session} has op-${found}, expected op-${index} or op-${inFlight}`)
      assert.strictEqual(record!.busy, Math.floor(found / SESSIONS) % 2 === 0)
      durable.set(session, found)
    }

    // No invalid line, except possibly a torn last one.
    const text = await fsp.readFile(path, "utf8")
    const lines = text.split("\n")
    const torn = lines.pop() ?? ""
    for (const line of lines) {
      if (line.length === 0) continue
      assert.isTrue(Either.isRight(decodeLine(line)), `lane ${lane} run ${run}: invalid line ${JSON.stringify(line)}`)
    }
    if (torn.length > 0) assert.isFalse(text.endsWith("\n"))
  }
  return kills
}

describe("RecoveryJournal crash safety", () => {
  it.live(`every acknowledged record survives SIGKILL at random moments (${LANES * RUNS_PER_LANE} runs)`, () =>
    Effect.gen(function*() {
      const dir = yield* tempDir
      const children: Children = { stopped: false, running: new Set() }
      // Kill whatever is still running however the test ends (a failed lane stops the others).
      yield* Effect.addFinalizer(() =>
        Effect.promise(() => {
          children.stopped = true
          return Promise.all([...children.running].map(killChild))
        })
      )
      const started = Date.now()
      const kills = yield* Effect.promise(() =>
        Promise.all(Array.from({ length: LANES }, (_, lane) => runLane(dir, lane, children)))
      )
      const total = kills.reduce((a, b) => a + b, 0)
      assert.strictEqual(total, LANES * RUNS_PER_LANE)
      yield* Effect.logDebug(`crash test: ${total} kills in ${Date.now() - started} ms`)
    }).pipe(Effect.scoped), {
      // Each child spends ~0.3 s loading effect; the margin is for a machine busy with other
      // test files.
      timeout: 120_000
    })
})
