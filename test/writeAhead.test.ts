/**
 * The file event log's write-ahead log (src/internal/eventLog/writeAhead.ts): its record format
 * (every cut and every flipped byte ends the file there, never a wrong record), its replay into
 * the segments (a table of what a crash can leave), its rotation (old files go once their
 * segments are synced) and its checkpoint. What a power loss does to the whole log is
 * test/EventLogPowerLoss.test.ts's.
 */
import { assert, describe, it } from "@effect/vitest"
import * as Effect from "effect/Effect"
import * as Exit from "effect/Exit"
import * as Fiber from "effect/Fiber"
import * as Scope from "effect/Scope"
import * as Stream from "effect/Stream"
import * as fs from "node:fs"
import * as os from "node:os"
import * as path from "node:path"
import * as Cursor from "../src/Cursor.js"
import { EventLogError } from "../src/EventLog.js"
import * as FileEventLog from "../src/internal/eventLog/file.js"
import * as FileIo from "../src/internal/fileIo.js"
import * as WriteAhead from "../src/internal/eventLog/writeAhead.js"

const tempRoot = Effect.acquireRelease(
  Effect.sync(() => fs.mkdtempSync(path.join(os.tmpdir(), "agentd-wal-"))),
  (dir) => Effect.sync(() => fs.rmSync(dir, { recursive: true, force: true }))
)

const walDir = (root: string) => path.join(root, WriteAhead.WRITE_AHEAD_DIR)
const walFiles = (root: string) => fs.readdirSync(walDir(root)).filter((name) => name.endsWith(".wal")).sort()

const record = (file: string, offset: number, text: string) => ({ file, offset, bytes: Buffer.from(text) })

/** Writes a segment's content and write-ahead files (each a list of records) as a crash left them. */
const crashLeft = (
  root: string,
  segments: Record<string, string>,
  files: ReadonlyArray<ReadonlyArray<ReturnType<typeof record>>>,
  tail?: Buffer
) => {
  for (const [file, content] of Object.entries(segments)) {
    fs.mkdirSync(path.dirname(path.join(root, file)), { recursive: true })
    fs.writeFileSync(path.join(root, file), content)
  }
  fs.mkdirSync(walDir(root), { recursive: true })
  files.forEach((records, i) => {
    const bytes = WriteAhead.encodeRecords(records)
    const last = i === files.length - 1 && tail !== undefined ? Buffer.concat([bytes, tail]) : bytes
    fs.writeFileSync(path.join(walDir(root), `${String(i + 1).padStart(12, "0")}.wal`), last)
  })
}

describe("write-ahead log", () => {
  it("a record format where every cut and every flipped byte ends the file at a whole record, never a wrong one", () => {
    const records = [record("a/events/1.jsonl", 0, "one\n"), record("b/events/2.jsonl", 17, "two two\n"), record("a/events/1.jsonl", 4, "three\n")]
    const bytes = WriteAhead.encodeRecords(records)
    const whole = WriteAhead.parseRecords(bytes)
    assert.deepStrictEqual(whole.records.map((r) => [r.file, r.offset, r.payload.toString()]), records.map((r) => [r.file, r.offset, r.bytes.toString()]))
    assert.strictEqual(whole.end, bytes.length)
    const ends: Array<number> = []
    for (let k = 0; k <= records.length; k++) ends.push(WriteAhead.encodeRecords(records.slice(0, k)).length)
    for (let cut = 0; cut <= bytes.length; cut++) {
      const parsed = WriteAhead.parseRecords(bytes.subarray(0, cut))
      const wholeBefore = ends.filter((end) => end <= cut).length - 1
      assert.strictEqual(parsed.records.length, wholeBefore, `cut at ${cut}`)
      assert.strictEqual(parsed.end, ends[wholeBefore], `cut at ${cut}`)
    }
    for (let at = 0; at < bytes.length; at++) {
      for (const flip of [0x01, 0x80]) {
        const damaged = Buffer.from(bytes)
        damaged[at] = damaged[at]! ^ flip
        const parsed = WriteAhead.parseRecords(damaged)
        // The record holding the flipped byte and those after it are not read; those before are.
        const holder = ends.findIndex((end) => end > at) - 1
        assert.strictEqual(parsed.records.length, holder, `byte ${at} ^ ${flip}`)
      }
    }
  })

  const replayCases: ReadonlyArray<{
    readonly name: string
    readonly segments: Record<string, string>
    readonly files: ReadonlyArray<ReadonlyArray<ReturnType<typeof record>>>
    readonly tail?: Buffer
    readonly after: Record<string, string | undefined>
  }> = [
    {
      name: "a power loss dropped the segment's unsynced bytes: the records write them again",
      segments: { "s/events/1.jsonl": "abc" },
      files: [[record("s/events/1.jsonl", 3, "def"), record("s/events/1.jsonl", 6, "ghi")]],
      after: { "s/events/1.jsonl": "abcdefghi" }
    },
    {
      name: "zeros or garbage after the synced part: overwritten, and cut after the last record",
      segments: { "s/events/1.jsonl": "abcde\0\0\0\0\0\0\0\0\0\0\0XYZ" },
      files: [[record("s/events/1.jsonl", 3, "def"), record("s/events/1.jsonl", 6, "ghi")]],
      after: { "s/events/1.jsonl": "abcdefghi" }
    },
    {
      name: "a failed append cut and written again shorter: the later record wins, nothing of the earlier one is left",
      segments: { "s/events/1.jsonl": "abcdefgh" },
      files: [[record("s/events/1.jsonl", 3, "defgh"), record("s/events/1.jsonl", 3, "DE")]],
      after: { "s/events/1.jsonl": "abcDE" }
    },
    {
      name: "records over two files (a crash during a rotation): applied in the files' order",
      segments: { "s/events/1.jsonl": "ab", "t/events/3.jsonl": "x" },
      files: [[record("s/events/1.jsonl", 2, "cd"), record("t/events/3.jsonl", 1, "y")], [record("s/events/1.jsonl", 4, "ef"), record("t/events/3.jsonl", 2, "z")]],
      after: { "s/events/1.jsonl": "abcdef", "t/events/3.jsonl": "xyz" }
    },
    {
      name: "a segment pruned or removed since: skipped, not created",
      segments: { "s/events/2.jsonl": "h" },
      files: [[record("s/events/1.jsonl", 0, "gone"), record("s/events/2.jsonl", 1, "i")]],
      after: { "s/events/1.jsonl": undefined, "s/events/2.jsonl": "hi" }
    },
    {
      name: "a segment shorter than its first record (changed by something else): left as it is",
      segments: { "s/events/1.jsonl": "a" },
      files: [[record("s/events/1.jsonl", 5, "f")]],
      after: { "s/events/1.jsonl": "a" }
    },
    {
      name: "a commit cut by the crash (torn last record): what is before it is replayed",
      segments: { "s/events/1.jsonl": "a" },
      files: [[record("s/events/1.jsonl", 1, "b")]],
      tail: WriteAhead.encodeRecords([record("s/events/1.jsonl", 2, "cdefgh")]).subarray(0, 20),
      after: { "s/events/1.jsonl": "ab" }
    },
    {
      name: "a path that leaves the root: ignored",
      segments: { "s/events/1.jsonl": "a" },
      files: [[record("../outside", 0, "x"), record("s/events/1.jsonl", 1, "b")]],
      after: { "s/events/1.jsonl": "ab" }
    }
  ]
  for (const c of replayCases) {
    it.scoped(`replay: ${c.name}`, () =>
      Effect.gen(function*() {
        const parent = yield* tempRoot
        const root = path.join(parent, "root")
        fs.mkdirSync(root)
        crashLeft(root, c.segments, c.files, c.tail)
        yield* WriteAhead.replay(root)
        for (const [file, content] of Object.entries(c.after)) {
          const where = path.join(root, file)
          if (content === undefined) assert.isFalse(fs.existsSync(where), file)
          else assert.strictEqual(fs.readFileSync(where, "latin1"), content, file)
        }
        assert.isFalse(fs.existsSync(path.join(parent, "outside")))
        assert.deepStrictEqual(walFiles(root), [], "the replayed files are removed")
      }))
  }

  it.scoped("many sessions' writes from concurrent fibers: each add is durable once its commit is; old files go at each rotation, a checkpoint leaves none with records; a crash's files replay to the same bytes", () =>
    Effect.gen(function*() {
      const root = yield* tempRoot
      const files = ["a/events/1.jsonl", "b/events/1.jsonl", "c/events/1.jsonl"]
      const sizes = new Map<string, number>()
      for (const file of files) {
        fs.mkdirSync(path.dirname(path.join(root, file)), { recursive: true })
        fs.writeFileSync(path.join(root, file), "")
        sizes.set(file, 0)
      }
      const scope = yield* Scope.make()
      const wal = yield* Scope.extend(WriteAhead.make(root, { rotateBytes: 2048 }), scope)
      let seen = 0
      // As the event log does: write the segment, then add the same bytes, in one synchronous step.
      const append = (file: string, text: string) =>
        Effect.suspend(() => {
          const bytes = Buffer.from(text)
          const offset = sizes.get(file)!
          const fd = fs.openSync(path.join(root, file), "r+")
          fs.writeSync(fd, bytes, 0, bytes.length, offset)
          fs.closeSync(fd)
          sizes.set(file, offset + bytes.length)
          return wal.durable(wal.add(file, offset, bytes))
        })
      yield* Effect.forEach(files, (file) =>
        Effect.forEach(Array.from({ length: 150 }, (_, i) => i), (i) =>
          Effect.zipRight(append(file, `${file} line ${i}\n`), Effect.sync(() => {
            seen = Math.max(seen, walFiles(root).length)
          })), { discard: true }), { concurrency: "unbounded", discard: true })
      // 3 x 150 records of ~40 bytes against 2 KiB a file: rotations happened, and removed the old files.
      assert.isAtMost(seen, 3, "old write-ahead files are removed once their segments are synced")
      const before = Object.fromEntries(files.map((file) => [file, fs.readFileSync(path.join(root, file), "utf8")]))
      for (const file of files) assert.strictEqual(before[file]!.split("\n").length - 1, 150)
      // A "power loss" now: each segment loses what its write-ahead records hold (everything
      // after the first of them: never synced to it), the files are kept as they are; the replay
      // gives back every byte.
      const copy = yield* tempRoot
      fs.cpSync(root, copy, { recursive: true })
      const firstRecord = new Map<string, number>()
      for (const name of walFiles(copy)) {
        for (const r of WriteAhead.parseRecords(fs.readFileSync(path.join(walDir(copy), name))).records) {
          if (!firstRecord.has(r.file)) firstRecord.set(r.file, r.offset)
        }
      }
      assert.isAbove(firstRecord.size, 0)
      for (const [file, offset] of firstRecord) fs.truncateSync(path.join(copy, file), offset)
      yield* WriteAhead.replay(copy)
      for (const file of files) assert.strictEqual(fs.readFileSync(path.join(copy, file), "utf8"), before[file], file)
      // A checkpoint: every segment durable, no file left with records.
      yield* wal.checkpoint
      const left = walFiles(root)
      assert.strictEqual(left.length, 1)
      assert.strictEqual(fs.statSync(path.join(walDir(root), left[0]!)).size, 0)
      // A clean close removes the last one.
      yield* Scope.close(scope, Exit.void)
      assert.deepStrictEqual(walFiles(root), [])
    }))

  it.scoped("checkpoints racing appends and each other all answer, and each covers what was added before it", () =>
    Effect.gen(function*() {
      const root = yield* tempRoot
      fs.mkdirSync(path.join(root, "s/events"), { recursive: true })
      fs.writeFileSync(path.join(root, "s/events/1.jsonl"), "")
      const wal = yield* WriteAhead.make(root, { rotateBytes: 4096 })
      let size = 0
      const append = Effect.suspend(() => {
        const bytes = Buffer.from(`record ${size}\n`)
        const offset = size
        size += bytes.length
        fs.appendFileSync(path.join(root, "s/events/1.jsonl"), bytes)
        return wal.durable(wal.add("s/events/1.jsonl", offset, bytes))
      })
      // Once a checkpoint answers, no file left holds a record added before it was asked for.
      const checkpoint = Effect.suspend(() => {
        const covered = size
        return Effect.map(wal.checkpoint, () => {
          for (const name of walFiles(root)) {
            for (const r of WriteAhead.parseRecords(fs.readFileSync(path.join(walDir(root), name))).records) {
              assert.isAtLeast(r.offset, covered, `${name} still holds a record from before the checkpoint`)
            }
          }
          return covered
        })
      })
      const results = yield* Effect.all([
        Effect.forEach(Array.from({ length: 300 }, (_, i) => i), () => append, { concurrency: 8, discard: true }),
        Effect.forEach(Array.from({ length: 20 }, (_, i) => i), () => Effect.zipRight(Effect.yieldNow(), checkpoint), { concurrency: 4 })
      ], { concurrency: "unbounded" })
      assert.strictEqual(results[1].length, 20)
      // After a last checkpoint, a replay has nothing to do.
      yield* wal.checkpoint
      const file = walFiles(root)
      assert.strictEqual(file.length, 1)
      assert.strictEqual(fs.statSync(path.join(walDir(root), file[0]!)).size, 0)
    }))
})

/**
 * Faults of the disk, put into the commit loop's calls (WriteAheadIo): an EIO from an fdatasync
 * or a directory's fsync, which no real disk gives on demand.
 */
describe("write-ahead log under disk faults", () => {
  const eio = (op: string) => Object.assign(new Error(`EIO: i/o error, ${op}`), { code: "EIO" })
  interface Faults {
    walSync: number
    segmentSync: number
    dirSync: number
    segmentOpen: number
  }
  const faultyIo = (faults: Faults): WriteAhead.WriteAheadIo => ({
    writeAll: (fd, bytes, position) => {
      let done = 0
      while (done < bytes.length) done += fs.writeSync(fd, bytes, done, bytes.length - done, position + done)
    },
    dataSync: (fd, done) => {
      if (faults.walSync > 0) {
        faults.walSync--
        return void setImmediate(done, eio("fdatasync"))
      }
      fs.fdatasync(fd, done)
    },
    dataSyncPath: (file, done) => {
      if (faults.segmentOpen > 0) {
        faults.segmentOpen--
        return void setImmediate(done, Object.assign(new Error("EMFILE: too many open files, open"), { code: "EMFILE", syscall: "open" }))
      }
      if (faults.segmentSync > 0) {
        faults.segmentSync--
        return void setImmediate(done, eio("fdatasync"))
      }
      fs.open(file, "r", (error, fd) => (error !== null ? done(error) : fs.fdatasync(fd, (e) => fs.close(fd, () => done(e)))))
    },
    syncDir: (dir) =>
      Effect.suspend(() => {
        if (faults.dirSync > 0) {
          faults.dirSync--
          return Effect.fail(new FileIo.FsError({ op: "fsync", path: dir, cause: eio("fsync") }))
        }
        return FileIo.fsyncDir(dir)
      })
  })

  /** A segment of `root` and an appender writing it then adding the same bytes (as the event log does). */
  const segmentOf = (root: string, wal: WriteAhead.WriteAhead, file: string) => {
    fs.mkdirSync(path.dirname(path.join(root, file)), { recursive: true })
    fs.writeFileSync(path.join(root, file), "")
    let size = 0
    return (text: string) =>
      Effect.suspend(() => {
        const bytes = Buffer.from(text)
        const offset = size
        fs.appendFileSync(path.join(root, file), bytes)
        size += bytes.length
        return Effect.either(wal.durable(wal.add(file, offset, bytes))).pipe(
          Effect.tap((result) =>
            Effect.sync(() => {
              // A failed append is cut, as the event log does.
              if (result._tag === "Left") {
                fs.truncateSync(path.join(root, file), offset)
                size = offset
              }
            })
          )
        )
      })
  }

  /** A log over a fresh root whose calls fail as `faults` say (none at first), and an appender of one segment. */
  const faultyLog = (options?: { readonly rotateBytes?: number }) =>
    Effect.gen(function*() {
      const root = yield* tempRoot
      const faults: Faults = { walSync: 0, segmentSync: 0, dirSync: 0, segmentOpen: 0 }
      const wal = yield* WriteAhead.make(root, { io: faultyIo(faults), ...options })
      return { root, faults, wal, a: segmentOf(root, wal, "a/events/1.jsonl") }
    })

  it.scoped("the event log's hot path (appendAllNow) under an EIO of its commit: answered with the error, the unacknowledged bytes cut, the session opened again at its next append, no gap", () =>
    Effect.gen(function*() {
      const root = yield* tempRoot
      const faults: Faults = { walSync: 0, segmentSync: 0, dirSync: 0, segmentOpen: 0 }
      const log = yield* FileEventLog.make({ root }, { writeAheadIo: faultyIo(faults) })
      const tracer = yield* Effect.tracer
      const now = (events: ReadonlyArray<Record<string, unknown>>) =>
        Effect.async<ReadonlyArray<Cursor.Cursor> | EventLogError>((resume) => {
          let cursors: ReadonlyArray<Cursor.Cursor> | undefined
          const started = log.appendAllNow!("s", events, tracer, (error) => resume(Effect.sync(() => error ?? cursors!)))
          assert.isTrue(Array.isArray(started))
          cursors = started as ReadonlyArray<Cursor.Cursor>
        })
      assert.deepStrictEqual(yield* log.appendAll("s", [{ n: 0 }]), [Cursor.make(1, 0)])
      assert.deepStrictEqual(yield* now([{ n: 1 }, { n: 2 }]), [Cursor.make(1, 1), Cursor.make(1, 2)])
      const segment = path.join(root, "s", "events", "1.jsonl")
      const size = fs.statSync(segment).size
      faults.walSync = 1
      const failed = yield* now([{ n: 3 }])
      assert.instanceOf(failed, EventLogError)
      assert.match((failed as EventLogError).message, /EIO/)
      // Its bytes were cut: a reopen does not adopt a record whose append reported failure.
      assert.strictEqual(fs.statSync(segment).size, size)
      // The handle is gone: the next append opens the session again (declined until then).
      assert.isUndefined(log.appendAllNow!("s", [{ n: 3 }], tracer, () => {}))
      assert.deepStrictEqual(yield* log.appendAll("s", [{ n: 3 }]), [Cursor.make(1, 3)])
      assert.deepStrictEqual(yield* now([{ n: 4 }]), [Cursor.make(1, 4)])
      // Let go (forget: a repair, the log closing) while a write waits for its commit, which then
      // fails: the handle's file stays open until the write ends, so its bytes are still cut.
      const size2 = fs.statSync(segment).size
      faults.walSync = 1
      const failing = yield* Effect.fork(now([{ n: 5 }]))
      yield* Effect.yieldNow()
      assert.isAbove(fs.statSync(segment).size, size2)
      yield* log.forget("s")
      assert.instanceOf(yield* Fiber.join(failing), EventLogError)
      assert.strictEqual(fs.statSync(segment).size, size2)
      const read = yield* Stream.runCollect(log.read("s"))
      assert.deepStrictEqual([...read].map((r) => r.event["n"]), [0, 1, 2, 3, 4])
      // Not enumerable: a wrapper that spreads the log and replaces appendAll does not inherit it.
      assert.isUndefined({ ...log }.appendAllNow)
    }))

  it.scoped("an EIO from the log's fdatasync fails that commit only; the file is retired (its segments synced, it removed) before any later commit, which goes to a new one", () =>
    Effect.gen(function*() {
      const { a, faults, root, wal } = yield* faultyLog()
      assert.isTrue((yield* a("a0\n"))._tag === "Right")
      const before = walFiles(root)
      faults.walSync = 1
      const failed = yield* a("a1\n")
      assert.isTrue(failed._tag === "Left", "the commit whose fdatasync failed fails")
      const later = yield* a("a2\n")
      assert.isTrue(later._tag === "Right", "a later commit succeeds")
      const after = walFiles(root)
      assert.notInclude(after, before[0]!, "the file that failed a commit is gone")
      // What the failed file held up to its failure was made durable in the segment before it went.
      const records = after.flatMap((name) => WriteAhead.parseRecords(fs.readFileSync(path.join(walDir(root), name))).records)
      assert.deepStrictEqual(records.map((r) => r.payload.toString()), ["a2\n"])
    }))

  it.scopedLive("an EIO from a segment's fdatasync at a rotation is not retried: appends fail until the files' records are written into the segments again (the start's replay, run by the next append), then go on", () =>
    Effect.gen(function*() {
      const { a, faults, root, wal } = yield* faultyLog()
      for (let i = 0; i < 5; i++) assert.isTrue((yield* a(`a${i}\n`))._tag === "Right")
      const before = walFiles(root)
      faults.segmentSync = 1
      const checkpoint = yield* Effect.either(wal.checkpoint)
      assert.isTrue(checkpoint._tag === "Left", "the checkpoint reports the segment's EIO")
      assert.includeMembers(walFiles(root), before, "the files that hold the segment's bytes stay")
      // A second fdatasync would "succeed" on pages the kernel may have marked clean: the next
      // append is refused and starts the replay instead.
      assert.isTrue((yield* a("refused\n"))._tag === "Left")
      let resumed = false
      for (let i = 0; i < 100 && !resumed; i++) {
        resumed = (yield* a("a5\n"))._tag === "Right"
        if (!resumed) yield* Effect.sleep("20 millis")
      }
      assert.isTrue(resumed, "appends go on once the replay rewrote and synced the segment")
      assert.notInclude(walFiles(root), before[0]!, "the replayed files are removed")
      assert.strictEqual(fs.readFileSync(path.join(root, "a/events/1.jsonl"), "utf8"), "a0\na1\na2\na3\na4\na5\n")
      yield* wal.checkpoint
    }))

  it.scoped("a segment that cannot be opened at a rotation (EMFILE: no write-back error) fails that checkpoint only: appends go on, the next rotation syncs it", () =>
    Effect.gen(function*() {
      const { a, faults, root, wal } = yield* faultyLog()
      faults.segmentOpen = 1
      assert.isTrue((yield* a("a0\n"))._tag === "Right")
      assert.isTrue((yield* Effect.either(wal.checkpoint))._tag === "Left")
      assert.isTrue((yield* a("a1\n"))._tag === "Right", "no stall")
      yield* wal.checkpoint
      assert.strictEqual(walFiles(root).length, 1)
      assert.strictEqual(fs.statSync(path.join(walDir(root), walFiles(root)[0]!)).size, 0)
    }))

  it.scoped("a new file whose directory entry cannot be synced is dropped (closed, removed) and the next rotation takes another number", () =>
    Effect.gen(function*() {
      const { a, faults, root, wal } = yield* faultyLog({ rotateBytes: 64 })
      const fds = () => fs.readdirSync("/proc/self/fd").length
      assert.isTrue((yield* a("a0 a long enough line to pass the rotation size of 64 bytes\n"))._tag === "Right")
      yield* wal.checkpoint
      const before = fds()
      assert.isTrue((yield* a("a1 a long enough line to pass the rotation size of 64 bytes\n"))._tag === "Right")
      faults.dirSync = 1
      const refused = yield* Effect.either(wal.checkpoint)
      assert.isTrue(refused._tag === "Left", "the checkpoint's rotation could not make its new file durable")
      assert.deepStrictEqual(walFiles(root).length, 1, "the file it made is removed")
      for (let i = 2; i < 6; i++) assert.isTrue((yield* a(`a${i} a long enough line to pass the rotation size of 64 bytes\n`))._tag === "Right")
      yield* wal.checkpoint
      assert.strictEqual(walFiles(root).length, 1, "rotations went on")
      assert.strictEqual(fs.statSync(path.join(walDir(root), walFiles(root)[0]!)).size, 0)
      assert.isAtMost(fds(), before, "no descriptor left open")
    }))
})
