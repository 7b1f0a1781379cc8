/**
 * The file event log's write-ahead log: one group commit per tick for every session.
 *
 * Why: at a model's pace every session's batch is one event, and an fdatasync per session per
 * event cost the daemon ~70 us of CPU per event on its own (200 sessions x 50 events/s: 90 us
 * per event with an fdatasync per session, 22-26 us with one shared log synced per commit,
 * measured on a 2-core VM). So a session's batch is written to its segment without a sync, its
 * bytes are copied into this log, and the batch is acknowledged once this log's commit that
 * holds it is fdatasynced: one write and one fdatasync per commit, whatever the sessions.
 *
 * On disk: `<root>/.write-ahead/<n>.wal` (0600 in 0700; `.` is a name no session's directory
 * can have). A file is a run of records, each
 * `[u32 magic][u32 body length][u32 crc32 of body][body]`, body = `[u16 path length][segment's
 * path, relative to root][f64 offset][the bytes written at that offset]`, little-endian.
 * The first record that is cut or does not check ends the file (a commit torn by a crash was
 * never acknowledged).
 *
 * Invariant: every byte written to a segment since that segment was last fdatasynced is in a
 * write-ahead file on disk. Hence:
 * - Rotation: once a file holds `rotateBytes`, the next commit goes to a new file; then every
 *   segment the old one wrote to is fdatasynced, and only then is the old file removed.
 * - Replay (at start, before any segment is opened): each segment's records, in the order they
 *   were written, are written again at their offsets and the segment is cut at the end of the
 *   last one (appends are sequential: what lies beyond was never acknowledged), fdatasynced; then
 *   the files are removed. A segment that is gone (pruned, removed) is skipped.
 * - A segment changed outside the append path (repair cuts a damaged one; a removed session's
 *   are deleted, and its id could be used again) is preceded by {@link WriteAhead.checkpoint},
 *   so that no record written before it is replayed over it.
 * - A commit whose write or fdatasync fails fails its appends, and the file is retired before any
 *   other commit (`recovering`): records after a failed one could sit behind bytes that never
 *   reached the disk, where a replay stops.
 * - A segment's fdatasync that fails is not retried (the kernel reports a write-back error once,
 *   then the pages may be clean and a retry "succeeds"): the log keeps its files and refuses
 *   appends (`stalled`) until the start's replay, run then, has written every file's records into
 *   their segments again and fdatasynced them (`recoverStall`: the next append tries it; with
 *   appends refused, nothing writes the segments meanwhile).
 *
 * The commit loop runs in node's callbacks, not in fibers: it is the one piece of the log
 * every session's batch goes through, and a fiber's wake-up costs more than the write.
 */
import * as Effect from "effect/Effect"
import type * as Scope from "effect/Scope"
import * as path from "node:path"
import { crc32 } from "node:zlib"
import * as FileIo from "../fileIo.js"

/** The directory of the write-ahead files under the log's root. */
export const WRITE_AHEAD_DIR = ".write-ahead"

/** Bytes after which the next commit starts a new file (and the old one's segments are synced). */
export const DEFAULT_ROTATE_BYTES = 32 * 1024 * 1024

/** The commit buffer's size at start, and the size past which it is let go after a commit. */
const SCRATCH_START_BYTES = 256 * 1024
const SCRATCH_KEEP_BYTES = 4 * 1024 * 1024

/** Segments fdatasynced at once when a file is retired (the pool's other work waits behind them). */
const SEGMENT_SYNCS_AT_ONCE = 4

const MAGIC = 0x4c415741 // "AWAL", little-endian
const RECORD_HEAD = 12
const FILE_NAME = /^([0-9]+)\.wal$/

/** One group commit: the records it writes and the appends waiting for it. */
export interface Commit {
  /** undefined while pending; null once durable; the error once failed. */
  outcome: FileIo.FsError | null | undefined
  readonly waiters: Array<(outcome: FileIo.FsError | null) => void>
  /** The segments (relative paths) it writes to. */
  readonly segments: Set<string>
}

export interface WriteAhead {
  /**
   * Copies a segment write (`bytes` at `offset` of the segment `file`, relative to the root) into
   * the next commit, which starts once the event loop's turn has run its I/O callbacks (or, with
   * one in flight then, once that one completes). Call it right after the bytes
   * were written to the segment, in the same synchronous step (`bytes` may be a scratch buffer).
   */
  readonly add: (file: string, offset: number, bytes: Uint8Array) => Commit
  /** Waits until `commit` is durable (or fails with its error). */
  readonly durable: (commit: Commit) => Effect.Effect<void, FileIo.FsError>
  /**
   * Calls `done` once `commit` is durable (null) or failed (its error): at once if it is settled
   * already, else from the commit's completion (a node callback). `done` must not throw.
   */
  readonly whenDurable: (commit: Commit, done: (outcome: FileIo.FsError | null) => void) => void
  /**
   * Every segment write added so far durable in its segment, and the files that held them
   * removed: from here on no record written before is replayed.
   */
  readonly checkpoint: Effect.Effect<void, FileIo.FsError>
}

interface OpenFile {
  readonly seq: number
  readonly file: string
  readonly fd: number
  /** The segments this file holds records of. */
  readonly dirty: Set<string>
  /** Its descriptor was closed (a retired file whose removal failed stays retired, closed). */
  closed?: boolean
}

const fileName = (dir: string, seq: number) => path.join(dir, `${String(seq).padStart(12, "0")}.wal`)

/** Closes a file's descriptor once: a number closed twice may be another file's by then. */
const closeFile = (file: OpenFile): Effect.Effect<void> =>
  Effect.suspend(() => {
    if (file.closed === true) return Effect.void
    file.closed = true
    return FileIo.fdClose(file.fd)
  })

/** Closes and removes a file no record was written to (made, but not to be used). */
const dropFile = (file: OpenFile): Effect.Effect<void> => Effect.zipRight(closeFile(file), Effect.ignore(FileIo.unlink(file.file)))

const closedError = (op: string, dir: string) =>
  new FileIo.FsError({ op, path: dir, cause: new Error("the write-ahead log is closed") })

/** The records of one write-ahead file, in order, up to the first one cut or not checking. */
export const parseRecords = (bytes: Buffer): { records: Array<{ file: string; offset: number; payload: Buffer }>; end: number } => {
  const records: Array<{ file: string; offset: number; payload: Buffer }> = []
  let at = 0
  while (at + RECORD_HEAD <= bytes.length) {
    if (bytes.readUInt32LE(at) !== MAGIC) break
    const length = bytes.readUInt32LE(at + 4)
    const bodyStart = at + RECORD_HEAD
    if (length < 10 || bodyStart + length > bytes.length) break
    const body = bytes.subarray(bodyStart, bodyStart + length)
    if (crc32(body) !== bytes.readUInt32LE(at + 8)) break
    const pathLength = body.readUInt16LE(0)
    if (2 + pathLength + 8 > length) break
    const file = body.toString("utf8", 2, 2 + pathLength)
    const offset = body.readDoubleLE(2 + pathLength)
    records.push({ file, offset, payload: body.subarray(2 + pathLength + 8) })
    at = bodyStart + length
  }
  return { records, end: at }
}

/** Appends one record to `out` at `at` (grown as needed); the new end. */
const putRecord = (out: { buffer: Buffer }, at: number, file: string, offset: number, bytes: Uint8Array): number => {
  const pathLength = Buffer.byteLength(file, "utf8")
  const bodyLength = 2 + pathLength + 8 + bytes.length
  const need = at + RECORD_HEAD + bodyLength
  if (need > out.buffer.length) {
    const grown = Buffer.allocUnsafe(Math.max(need, out.buffer.length * 2))
    out.buffer.copy(grown, 0, 0, at)
    out.buffer = grown
  }
  const b = out.buffer
  const bodyStart = at + RECORD_HEAD
  b.writeUInt32LE(MAGIC, at)
  b.writeUInt32LE(bodyLength, at + 4)
  b.writeUInt16LE(pathLength, bodyStart)
  b.write(file, bodyStart + 2, pathLength, "utf8")
  b.writeDoubleLE(offset, bodyStart + 2 + pathLength)
  b.set(bytes, bodyStart + 2 + pathLength + 8)
  b.writeUInt32LE(crc32(b.subarray(bodyStart, bodyStart + bodyLength)), at + 8)
  return bodyStart + bodyLength
}

/** The bytes of a write-ahead file holding `records`, in order (what the commits write; for tests). */
export const encodeRecords = (records: ReadonlyArray<{ readonly file: string; readonly offset: number; readonly bytes: Uint8Array }>): Buffer => {
  const out = { buffer: Buffer.allocUnsafe(1024) }
  let at = 0
  for (const record of records) at = putRecord(out, at, record.file, record.offset, record.bytes)
  return Buffer.from(out.buffer.subarray(0, at))
}

/**
 * Replays what the write-ahead files under `root` hold into their segments, then removes them
 * (see the module's comment). Run before any segment of the log is opened.
 */
export const replay = (root: string): Effect.Effect<void, FileIo.FsError> =>
  Effect.gen(function*() {
    const dir = path.join(root, WRITE_AHEAD_DIR)
    const names = (yield* FileIo.readdirOrEmpty(dir))
      .flatMap((name) => {
        const match = FILE_NAME.exec(name)
        return match === null ? [] : [{ name, seq: Number(match[1]) }]
      })
      .sort((a, b) => a.seq - b.seq)
    if (names.length === 0) return
    const bySegment = new Map<string, Array<{ offset: number; payload: Buffer }>>()
    for (const { name } of names) {
      const bytes = yield* FileIo.readFile(path.join(dir, name))
      const { end, records } = parseRecords(bytes)
      for (const record of records) {
        let list = bySegment.get(record.file)
        if (list === undefined) bySegment.set(record.file, list = [])
        list.push(record)
      }
      if (end < bytes.length) {
        yield* Effect.logDebug(`event log: write-ahead file ${name}: ${bytes.length - end} bytes after its last whole record ignored (a commit cut by a crash)`)
      }
    }
    for (const [file, records] of bySegment) {
      const absolute = path.resolve(root, file)
      // Only segments under the root (a record is the daemon's own, but a path is still a path).
      if (path.relative(root, absolute).startsWith("..")) continue
      yield* replaySegment(absolute, records)
    }
    for (const { name } of names) yield* FileIo.unlink(path.join(dir, name))
    yield* FileIo.fsyncDir(dir)
  })

const replaySegment = (file: string, records: ReadonlyArray<{ offset: number; payload: Buffer }>) =>
  Effect.gen(function*() {
    const opened = yield* Effect.either(FileIo.fdOpen(file, "r+"))
    if (opened._tag === "Left") {
      // Pruned or removed after its records were written: nothing to put back.
      if (FileIo.isNotFound(opened.left)) return
      return yield* Effect.fail(opened.left)
    }
    const fd = opened.right
    yield* Effect.gen(function*() {
      const size = yield* FileIo.fdSize(fd)
      // (Not Math.min(...offsets): ~125k arguments overflow the stack.)
      let first = Number.MAX_SAFE_INTEGER
      for (const record of records) first = Math.min(first, record.offset)
      if (size < first) {
        // Everything before a segment's first record was durable in it: this one was changed by
        // something else than this log. Leave it to the log's checks (they name the damage).
        yield* Effect.logWarning(`event log: ${file} is shorter (${size} bytes) than its write-ahead records say (${first}); not replayed`)
        return
      }
      // Consecutive records (each starting where the one before ended: appends) go back in one
      // write; a record that starts elsewhere (after a failed append was cut) starts another.
      let run: Array<Buffer> = []
      let runStart = 0
      let runEnd = -1
      const writeRun = () => (run.length === 0 ? Effect.void : FileIo.fdWriteAll(fd, run.length === 1 ? run[0]! : Buffer.concat(run), runStart))
      for (const record of records) {
        if (record.offset !== runEnd) {
          yield* writeRun()
          run = []
          runStart = record.offset
        }
        run.push(record.payload)
        runEnd = record.offset + record.payload.length
      }
      yield* writeRun()
      const last = records[records.length - 1]!
      yield* FileIo.fdTruncate(fd, last.offset + last.payload.length)
      yield* FileIo.fdDataSync(fd)
    }).pipe(Effect.ensuring(FileIo.fdClose(fd)))
  })

/**
 * The calls the commit loop makes (FileIo's); a test puts faults in them (an EIO from an
 * fdatasync is not something a real disk gives on demand).
 */
export interface WriteAheadIo {
  readonly writeAll: (fd: number, bytes: Uint8Array, position: number) => void
  readonly dataSync: (fd: number, done: (error: NodeJS.ErrnoException | null) => void) => void
  readonly dataSyncPath: (path: string, done: (error: NodeJS.ErrnoException | null) => void) => void
  readonly syncDir: (dir: string) => Effect.Effect<void, FileIo.FsError>
}

const fileIo: WriteAheadIo = {
  writeAll: FileIo.writeAllSyncRaw,
  dataSync: FileIo.dataSyncRaw,
  dataSyncPath: FileIo.dataSyncPathRaw,
  syncDir: FileIo.fsyncDir
}

/**
 * Replays what is left under `root` (see {@link replay}), then opens a new write-ahead file. Its
 * scope's close makes every segment write durable in its segment and removes the files, so that
 * a clean stop leaves nothing to replay.
 */
export const make = (
  root: string,
  options?: { readonly rotateBytes?: number; readonly io?: WriteAheadIo }
): Effect.Effect<WriteAhead, FileIo.FsError, Scope.Scope> =>
  Effect.gen(function*() {
    const rotateBytes = options?.rotateBytes ?? DEFAULT_ROTATE_BYTES
    const io = options?.io ?? fileIo
    const dir = path.join(root, WRITE_AHEAD_DIR)
    yield* FileIo.mkdirPrivate(dir)
    yield* replay(root)

    /** The number of the next file (never reused while this log runs: a failed creation's too). */
    let nextSeq = 1
    const openFile: Effect.Effect<OpenFile, FileIo.FsError> = Effect.suspend(() => {
      const seq = nextSeq++
      const file = fileName(dir, seq)
      return Effect.flatMap(FileIo.fdOpen(file, "wx", FileIo.FILE_MODE), (fd) => {
        const opened: OpenFile = { seq, file, fd, dirty: new Set<string>() }
        // Not known to be in its directory: not used, and gone.
        return io.syncDir(dir).pipe(Effect.as(opened), Effect.tapError(() => dropFile(opened)))
      })
    })

    let current = yield* openFile
    /** Bytes of the current file written by commits so far. */
    let size = 0
    /** The next file, opened by a rotation; the next commit switches to it. */
    let next: OpenFile | undefined
    /** Files switched away from: removed once their segments are synced. */
    const retired: Array<OpenFile> = []
    let rotating = false
    let inFlight = false
    /**
     * A commit of the current file failed: no commit is written until the files up to it are
     * retired (their segments synced, the files removed), so that nothing is acknowledged after a
     * record that may not be on disk, in a file whose later records a replay would never reach.
     */
    let recovering = false
    /** A segment's fdatasync failed (see `stall`): appends fail until `recoverStall` succeeds. */
    let stalled: FileIo.FsError | undefined
    /** The replay that ends a stall is running. */
    let unstalling = false
    const scratch = { buffer: Buffer.allocUnsafe(SCRATCH_START_BYTES) }
    let used = 0
    const newCommit = (): Commit => ({ outcome: undefined, waiters: [], segments: new Set() })
    let pending = newCommit()
    /** Checkpoints waiting until every file up to `upTo` (the current one when they came) is gone. */
    let checkpointWaiters: Array<{ readonly upTo: number; readonly done: (error: FileIo.FsError | null) => void }> = []
    /** Waiting for no commit and no rotation to be under way (the scope's close). */
    let quietWaiters: Array<() => void> = []
    let closed = false

    /** Every file this log holds open. */
    const openFiles = (): Array<OpenFile> => [current, ...retired, ...(next === undefined ? [] : [next])]

    const settle = (commit: Commit, outcome: FileIo.FsError | null) => {
      commit.outcome = outcome
      for (const waiter of commit.waiters) waiter(outcome)
      commit.waiters.length = 0
    }

    /** No commit in flight, and no rotation or recovery under way. */
    const isQuiet = () => !inFlight && !rotating && !unstalling
    const quiet = () => {
      if (!isQuiet()) return
      const waiters = quietWaiters
      quietWaiters = []
      for (const waiter of waiters) waiter()
    }

    /**
     * A segment's fdatasync failed (EIO, or ENOSPC from a file system that allocates at
     * write-back), or the files holding a failed commit could not be retired: what was written
     * may not be on disk, and a second fdatasync would not say (the kernel reports a write-back
     * error once, then may mark the pages clean). The write-ahead files keep the bytes: appends
     * fail until {@link recoverStall} has written them into their segments again.
     */
    const stall = (error: FileIo.FsError) => {
      stalled ??= error
      used = 0
      settle(pending, stalled)
      pending = newCommit()
      failCheckpoints(stalled)
      quiet()
    }

    /**
     * Ends a stall as a start would: the replay of every file (retired and current) writes each
     * segment's records again, cuts it after the last and fdatasyncs it, then removes the files;
     * a new file takes the commits. Appends are refused meanwhile, so nothing else writes the
     * segments (a refused batch's bytes past the last record are cut, as its appender does). A
     * failure leaves the stall, and the next append tries again.
     */
    const recoverStall = (): void => {
      if (stalled === undefined || unstalling || closed || inFlight || rotating) return
      unstalling = true
      Effect.runCallback(Effect.zipRight(replay(root), openFile), {
        onExit: (exit) => {
          unstalling = false
          if (exit._tag === "Success" && !closed) {
            for (const file of openFiles()) Effect.runFork(closeFile(file))
            current = exit.value
            retired.length = 0
            next = undefined
            size = 0
            stalled = undefined
            recovering = false
          } else if (exit._tag === "Success") {
            Effect.runFork(dropFile(exit.value))
          }
          quiet()
          start()
        }
      })
    }

    /** Switches to the next file once it is open and no commit is in flight on the current one. */
    const switchIfReady = (): void => {
      if (next === undefined || inFlight) return
      retired.push(current)
      current = next
      next = undefined
      size = 0
      syncRetired()
    }

    /** A commit's write or fdatasync failed: its appends fail, and the file is retired first. */
    const commitFailed = (target: OpenFile, before: number, error: FileIo.FsError) => {
      // Best effort, so that a crash's replay does not find it: the file as it was before.
      if (target === current) {
        try {
          FileIo.truncateSyncRaw(target.fd, before)
        } catch {
          // The retirement below removes the whole file anyway.
        }
      }
      if (recovering) return
      recovering = true
      checkpointWaiters.push({
        upTo: target.seq,
        done: (failure) => {
          if (failure !== null) return stall(failure)
          recovering = false
          start()
        }
      })
      rotate()
    }

    const start = (): void => {
      if (inFlight || stalled !== undefined) return
      switchIfReady()
      if (used === 0 || recovering) return
      const commit = pending
      const bytes = scratch.buffer.subarray(0, used)
      pending = newCommit()
      for (const segment of commit.segments) current.dirty.add(segment)
      const target = current
      const before = size
      try {
        io.writeAll(target.fd, bytes, before)
      } catch (cause) {
        used = 0
        settle(commit, new FileIo.FsError({ op: "write", path: target.file, cause }))
        return commitFailed(target, before, commit.outcome!)
      }
      used = 0
      size += bytes.length
      // `bytes` is a view of the scratch buffer: it is written already (write(2) copied it).
      // A burst's commit grew it: give that memory back.
      if (scratch.buffer.length > SCRATCH_KEEP_BYTES) scratch.buffer = Buffer.allocUnsafe(SCRATCH_START_BYTES)
      inFlight = true
      io.dataSync(target.fd, (error) => {
        inFlight = false
        if (error === null) settle(commit, null)
        else {
          settle(commit, new FileIo.FsError({ op: "fdatasync", path: target.file, cause: error }))
          commitFailed(target, before, commit.outcome!)
        }
        if (size >= rotateBytes) rotate()
        start()
        quiet()
      })
    }

    /** Opens the next file; the next commit (or, with none pending, this one) switches to it. */
    const rotate = (): void => {
      if (rotating || closed || stalled !== undefined) return
      rotating = true
      Effect.runCallback(openFile, {
        onExit: (exit) => {
          if (closed) {
            rotating = false
            if (exit._tag === "Success") Effect.runFork(dropFile(exit.value))
            return quiet()
          }
          if (exit._tag === "Failure") {
            rotating = false
            failCheckpoints(new FileIo.FsError({ op: "open", path: dir, cause: exit.cause }))
            return quiet()
          }
          next = exit.value
          switchIfReady()
        }
      })
    }

    const failCheckpoints = (error: FileIo.FsError) => {
      const waiters = checkpointWaiters
      checkpointWaiters = []
      for (const waiter of waiters) waiter.done(error)
    }

    /** After a rotation: answers the checkpoints it covered; those that came later get another. */
    const rotated = () => {
      const covered = checkpointWaiters.filter((w) => w.upTo < current.seq && retired.every((f) => f.seq > w.upTo))
      checkpointWaiters = checkpointWaiters.filter((w) => !covered.includes(w))
      for (const waiter of covered) waiter.done(null)
      if (checkpointWaiters.length > 0) rotate()
    }

    /**
     * fdatasyncs every segment the retired files wrote to, a few at a time (all at once, they
     * held libuv's pool from the commits' own fdatasync for 100-200 ms), then removes the files.
     */
    const syncRetired = (): void => {
      const files = retired.slice()
      const segments = [...new Set(files.flatMap((file) => [...file.dirty]))]
      let started = 0
      let finished = 0
      /** A write-back error (the fdatasync's): the log stalls. */
      let failure: FileIo.FsError | undefined
      /** A segment that could not be opened (EMFILE...): nothing was lost, the next rotation tries again. */
      let unopened: FileIo.FsError | undefined
      const startOne = (): void => {
        if (failure !== undefined || unopened !== undefined || started >= segments.length) return
        const segment = segments[started++]!
        io.dataSyncPath(path.join(root, segment), (error) => {
          // A segment removed since (pruned, its session deleted) has nothing left to keep.
          if (error !== null && error.code !== "ENOENT") {
            const failed = new FileIo.FsError({ op: error.syscall ?? "fdatasync", path: segment, cause: error })
            if (error.syscall === "open") unopened ??= failed
            else failure ??= failed
          }
          finished++
          if (failure !== undefined || unopened !== undefined) {
            if (finished === started) segmentsFailed()
            return
          }
          if (finished === segments.length) return segmentsSynced()
          startOne()
        })
      }
      const segmentsFailed = () => {
        rotating = false
        if (failure !== undefined) return stall(failure)
        // The files stay retired, their segments dirty: the next rotation syncs them with its own.
        failCheckpoints(unopened!)
        quiet()
      }
      const segmentsSynced = () => {
        Effect.runCallback(
          Effect.gen(function*() {
            for (const file of files) {
              yield* closeFile(file)
              yield* FileIo.unlink(file.file)
            }
            yield* io.syncDir(dir)
          }),
          {
            onExit: (exit) => {
              rotating = false
              if (exit._tag === "Failure") {
                failCheckpoints(new FileIo.FsError({ op: "unlink", path: dir, cause: exit.cause }))
              } else {
                for (const file of files) retired.splice(retired.indexOf(file), 1)
                rotated()
              }
              quiet()
            }
          }
        )
      }
      if (segments.length === 0) return segmentsSynced()
      for (let i = 0; i < SEGMENT_SYNCS_AT_ONCE; i++) startOne()
    }

    const add = (file: string, offset: number, bytes: Uint8Array): Commit => {
      if (stalled !== undefined || closed) {
        recoverStall()
        const refused = newCommit()
        settle(refused, stalled ?? closedError("write", dir))
        return refused
      }
      used = putRecord(scratch, used, file, offset, bytes)
      const commit = pending
      commit.segments.add(file)
      startSoon()
      return commit
    }

    /**
     * Starts the pending commit once the event loop has run this turn's I/O callbacks (a
     * `setImmediate`), so that it holds every record they added. Started at the first add, the
     * commit held that one record, and the others of the turn waited for it to complete in the
     * next turn before their own started: two turns of the loop instead of one, and at 200
     * streaming sessions a turn of the loop is ~10 ms of work.
     */
    let startScheduled = false
    const startSoon = (): void => {
      if (startScheduled) return
      startScheduled = true
      setImmediate(() => {
        startScheduled = false
        start()
      })
    }

    const whenDurable = (commit: Commit, done: (outcome: FileIo.FsError | null) => void): void => {
      if (commit.outcome !== undefined) done(commit.outcome)
      else commit.waiters.push(done)
    }

    const durable = (commit: Commit): Effect.Effect<void, FileIo.FsError> =>
      Effect.async<void, FileIo.FsError>((resume) =>
        whenDurable(commit, (outcome) => resume(outcome === null ? Effect.void : Effect.fail(outcome)))
      )

    /** Every file up to the current one gone (their segments synced). */
    const retireCurrent: Effect.Effect<void, FileIo.FsError> = Effect.async<void, FileIo.FsError>((resume) => {
      if (stalled !== undefined) {
        recoverStall()
        return resume(Effect.fail(stalled))
      }
      if (current.dirty.size === 0 && !inFlight && used === 0 && retired.length === 0) return resume(Effect.void)
      if (closed) return resume(Effect.fail(closedError("checkpoint", dir)))
      checkpointWaiters.push({ upTo: current.seq, done: (error) => resume(error === null ? Effect.void : Effect.fail(error)) })
      // A rotation under way covers the files before the current one: `rotated` starts the next.
      rotate()
    })

    // Records still pending go to the file current when their commit starts, which may be a later
    // one: they are written first (their commit failing or not: they may be in a file either way).
    const checkpoint: Effect.Effect<void, FileIo.FsError> = Effect.suspend(() =>
      used === 0 ? retireCurrent : Effect.zipRight(Effect.ignore(durable(pending)), retireCurrent)
    )

    const whenQuiet = Effect.async<void>((resume) => {
      if (isQuiet()) return resume(Effect.void)
      quietWaiters.push(() => resume(Effect.void))
    })

    yield* Effect.addFinalizer(() =>
      Effect.gen(function*() {
        const synced = yield* Effect.either(checkpoint)
        closed = true
        // A rotation another checkpoint asked for may still be opening its file (dropped then).
        yield* whenQuiet
        for (const file of openFiles()) yield* closeFile(file)
        if (synced._tag === "Right" && retired.length === 0 && current.dirty.size === 0) {
          yield* Effect.ignore(FileIo.unlink(current.file))
          yield* Effect.ignore(FileIo.fsyncDir(dir))
        }
      })
    )

    return { add, durable, whenDurable, checkpoint }
  })
