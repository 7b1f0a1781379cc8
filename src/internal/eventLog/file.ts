/**
 * The file-backed event log (the public module, ../../EventLog.ts, holds its interface).
 *
 * On disk, per session:
 * ```
 * <root>/<sanitized sessionId>/            0700
 * <root>/<sanitized sessionId>/events/     0700
 * <root>/<sanitized sessionId>/events/<generation>.jsonl   0600, one segment per generation
 * ```
 * (the paths are StateLayout's, the sanitizer its {@link StateLayout.safeSegment})
 * A segment starts with one header line `{"segment":{"generation":g,"after"?:Cursor}}` (`after`
 * is the session's last event before generation g), then one line per event:
 * `{"cursor":{"generation":g,"sequence":s},"event":{...}}`, with `s` = 0, 1, 2, ... in line order.
 * The header lets an empty generation remember where the history stood even after the earlier
 * segments were pruned; segments are created complete (temp file, fsync, rename, fsync dir) so a
 * crash never leaves a segment without its header.
 *
 * Appends are written to their segment without a sync and made durable by the shared
 * write-ahead log (./writeAhead.ts, `<root>/.write-ahead/`), replayed into the segments when the
 * log is opened for writing.
 */
import * as Chunk from "effect/Chunk"
import * as Effect from "effect/Effect"
import * as Option from "effect/Option"
import { isRecord } from "effect/Predicate"
import type * as Scope from "effect/Scope"
import * as Stream from "effect/Stream"
import * as path from "node:path"
import * as Cursor from "../../Cursor.js"
import {
  type EventLogError,
  type EventLogOptions,
  type EventLogRepair,
  type EventLogService,
  type EventLogStatus,
  type EventRecord,
  sanitizeSessionId
} from "../../EventLog.js"
import * as StateLayout from "../../StateLayout.js"
import * as FileIo from "../fileIo.js"
import { Lock } from "../lock.js"
import * as AppendQueue from "./appendQueue.js"
import * as WriteAhead from "./writeAhead.js"
import { fail, isCursor, makeService, parseRecord, putRecordClose, putRecordOpen } from "./records.js"
import * as Utf8Batch from "../utf8Batch.js"

const headerLine = (generation: number, after: Option.Option<Cursor.Cursor>): string =>
  JSON.stringify({ segment: Option.isSome(after) ? { generation, after: after.value } : { generation } }) + "\n"

/** Parses a header line; `undefined` when it is not the header of `generation`. */
const parseHeader = (text: string, generation: number): { readonly after: Option.Option<Cursor.Cursor> } | undefined => {
  let value: unknown
  try {
    value = JSON.parse(text)
  } catch {
    return undefined
  }
  if (!isRecord(value) || !isRecord(value["segment"]) || value["segment"]["generation"] !== generation) return undefined
  const after = value["segment"]["after"]
  if (after === undefined) return { after: Option.none() }
  return isCursor(after) ? { after: Option.some(Cursor.make(after.generation, after.sequence)) } : undefined
}

// The file I/O module's operations, their failures as this log's (`Io`, naming the session)
// ---------------------------------------------------------------------------------------------

const io = <A>(sid: string, effect: Effect.Effect<A, FileIo.FsError>): Effect.Effect<A, EventLogError> =>
  Effect.mapError(effect, (e) => fail("Io", sid, e.message, e.cause))

const isNotFound = (e: EventLogError): boolean => e.reason === "Io" && FileIo.errnoCode(e.cause) === "ENOENT"

const fsOpen = (sid: string, file: string, flags: string, mode?: number) => io(sid, FileIo.fdOpen(file, flags, mode))
const fsCloseQuiet = FileIo.fdClose
const fsDataSync = (sid: string, fd: number) => io(sid, FileIo.fdDataSync(fd))
const fsTruncate = (sid: string, fd: number, size: number) => io(sid, FileIo.fdTruncate(fd, size))
const fsFstatSize = (sid: string, fd: number) => io(sid, FileIo.fdSize(fd))
const fsRead = (sid: string, fd: number, buffer: Buffer, length: number, position: number) =>
  io(sid, FileIo.fdRead(fd, buffer, length, position))
const fsReaddir = (sid: string, dir: string) => io(sid, FileIo.readdir(dir))
const fsRename = (sid: string, from: string, to: string) => io(sid, FileIo.rename(from, to))
const fsUnlink = (sid: string, file: string) => io(sid, FileIo.unlink(file))
const fsChmod = (sid: string, file: string, mode: number) => io(sid, FileIo.chmod(file, mode))
const fsWriteAll = (sid: string, fd: number, buffer: Buffer, position: number) => io(sid, FileIo.fdWriteAll(fd, buffer, position))
const mkdirPrivate = (sid: string, dir: string) => io(sid, FileIo.mkdirPrivate(dir))
const fsyncDir = (sid: string, dir: string) => io(sid, FileIo.fdSyncDir(dir))

// ---------------------------------------------------------------------------------------------
// File layer
// ---------------------------------------------------------------------------------------------

/** Bytes read per disk read when streaming a segment. */
const READ_CHUNK = 128 * 1024

/**
 * One open session. The fields under `// durable` describe what is on disk and fsynced (readers
 * and `status` use only those); the others describe what was assigned and waits to be written.
 * Single-threaded JS makes each synchronous section below atomic between fibers.
 */
interface Handle extends AppendQueue.QueueHandle {
  readonly dir: string
  readonly eventsDir: string
  /** Held by the flusher while it writes, and by prune/remove, so they never interleave. */
  readonly lock: Lock
  // durable
  segments: Array<number>
  fd: number | undefined
  /** The current segment's path relative to the log's root (how the write-ahead log names it). */
  file: string
  generation: number
  size: number
  count: number
  bytes: number
  last: Option.Option<Cursor.Cursor>
  /**
   * Where the lines of some records of the current segment start (every MARK_EVERY-th sequence
   * this handle wrote, durable), so that a read after a cursor starts near it instead of reading
   * the segment from its start: a client paused and resumed many times during a long turn
   * re-read the whole generation at each resume (quadratic in the generation's size).
   */
  marks: Map<number, number>
}

/** One mark (see Handle.marks) per this many records: ~600 numbers for a 10,000-event generation. */
const MARK_EVERY = 16

/**
 * Where a segment's damage starts: the byte offset and 1-based number of its first line that is
 * not what this module writes (the header, then the record of sequence k on line k + 2);
 * `undefined` when it is whole. Bytes after the last `\n` of the newest segment are a torn
 * write (cut on open), not damage; in an older segment, which was complete, they are.
 */
export const firstDamage = (
  bytes: Buffer,
  generation: number,
  newest: boolean
): { readonly offset: number; readonly line: number } | undefined => {
  let offset = 0
  for (let index = 0; offset < bytes.length; index++) {
    const nl = bytes.indexOf(0x0a, offset)
    if (nl === -1) return newest ? undefined : { offset, line: index + 1 }
    const text = bytes.toString("utf8", offset, nl)
    const whole = index === 0
      ? parseHeader(text, generation) !== undefined
      : parseRecord(text, generation)?.cursor.sequence === index - 1
    if (!whole) return { offset, line: index + 1 }
    offset = nl + 1
  }
  return offset === 0 ? { offset: 0, line: 1 } : undefined
}

const segmentPath = (h: Handle, generation: number) => StateLayout.eventSegmentFile(h.eventsDir, generation)

const SEGMENT_NAME = /^([1-9][0-9]*)\.jsonl$/

/** Finds the offset just after the last `\n` before `end`, reading backwards; 0 when none. */
const lineStartBefore = (sid: string, fd: number, end: number): Effect.Effect<number, EventLogError> =>
  Effect.gen(function*() {
    const buffer = Buffer.allocUnsafe(64 * 1024)
    let hi = end
    while (hi > 0) {
      const lo = Math.max(0, hi - buffer.length)
      const n = yield* fsRead(sid, fd, buffer, hi - lo, lo)
      const nl = buffer.subarray(0, n).lastIndexOf(0x0a)
      if (nl !== -1) return lo + nl + 1
      hi = lo
    }
    return 0
  })

const readRange = (sid: string, fd: number, start: number, end: number): Effect.Effect<string, EventLogError> =>
  Effect.gen(function*() {
    const buffer = Buffer.allocUnsafe(end - start)
    let done = 0
    while (done < buffer.length) {
      const n = yield* fsRead(sid, fd, buffer.subarray(done), buffer.length - done, start + done)
      if (n === 0) break
      done += n
    }
    return buffer.toString("utf8", 0, done)
  })

/**
 * Recovers the newest segment after a crash: drops a torn tail (bytes after the last `\n`: a
 * write cut by the crash, never acknowledged). A whole last line that is not a record is not
 * a torn write but damage: it fails `Corrupt` (see `repair`), its bytes are never dropped here.
 */
const recoverSegment = (sid: string, fd: number, file: string, generation: number, repair: boolean) =>
  Effect.gen(function*() {
    const size = yield* fsFstatSize(sid, fd)
    // The bytes after the last newline were never acknowledged: a write cut by the crash.
    const end = yield* lineStartBefore(sid, fd, size)
    if (end === 0) return yield* Effect.fail(fail("Corrupt", sid, `${file} has no segment header`))
    const start = yield* lineStartBefore(sid, fd, end - 1)
    const text = yield* readRange(sid, fd, start, end - 1)
    let result: { count: number; last: Option.Option<Cursor.Cursor> }
    if (start === 0) {
      const header = parseHeader(text, generation)
      if (header === undefined) return yield* Effect.fail(fail("Corrupt", sid, `${file} has an invalid segment header`))
      result = { count: 0, last: header.after }
    } else {
      const record = parseRecord(text, generation)
      if (record === undefined) return yield* Effect.fail(fail("Corrupt", sid, `${file}: its last line is not a record`))
      result = { count: record.cursor.sequence + 1, last: Option.some(record.cursor) }
    }
    if (end < size && repair) {
      yield* fsTruncate(sid, fd, end)
      yield* fsDataSync(sid, fd)
    }
    const headerEnd = yield* headerLength(sid, fd, file)
    return { size: end, count: result.count, last: result.last, bytes: end - headerEnd }
  })

/**
 * The segment's header line (`text` without its `\n`, `bytes` with it); `undefined` when none
 * ends within 4 KiB.
 */
const readHeaderLine = (
  sid: string,
  fd: number
): Effect.Effect<{ readonly text: string; readonly bytes: number } | undefined, EventLogError> =>
  Effect.gen(function*() {
    const buffer = Buffer.allocUnsafe(4096)
    const n = yield* fsRead(sid, fd, buffer, buffer.length, 0)
    const nl = buffer.subarray(0, n).indexOf(0x0a)
    return nl === -1 ? undefined : { text: buffer.toString("utf8", 0, nl), bytes: nl + 1 }
  })

const headerLength = (sid: string, fd: number, file: string): Effect.Effect<number, EventLogError> =>
  Effect.flatMap(readHeaderLine(sid, fd), (line) =>
    line === undefined
      ? Effect.fail(fail("Corrupt", sid, `${file} has an oversized segment header`))
      : Effect.succeed(line.bytes))

/**
 * Where the history stood when `generation` began (its header's `after`); `None` when the
 * header says nothing or cannot be read (the caller then reads the segments themselves).
 */
const segmentStart = (sid: string, file: string, generation: number): Effect.Effect<Option.Option<Cursor.Cursor>> =>
  Effect.acquireUseRelease(
    fsOpen(sid, file, "r"),
    (fd) =>
      Effect.map(readHeaderLine(sid, fd), (line) =>
        (line === undefined ? undefined : parseHeader(line.text, generation)?.after) ?? Option.none()),
    fsCloseQuiet
  ).pipe(Effect.orElseSucceed(() => Option.none()))

/** Opens a session's log from disk (or an empty handle when it has none yet). */
const openHandle = (root: string, sessionId: string, readOnly: boolean): Effect.Effect<Handle, EventLogError> =>
  Effect.gen(function*() {
    const name = sanitizeSessionId(sessionId)
    if (name._tag === "Left") return yield* Effect.fail(name.left)
    const paths = StateLayout.eventLogPaths(root)
    const h: Handle = {
      sessionId,
      dir: paths.sessionDir(sessionId),
      eventsDir: paths.eventsDir(sessionId),
      lock: new Lock(),
      segments: [],
      fd: undefined,
      file: "",
      generation: 1,
      size: 0,
      count: 0,
      bytes: 0,
      last: Option.none(),
      marks: new Map(),
      next: Cursor.initial,
      queue: [],
      dead: undefined
    }
    const names = yield* fsReaddir(sessionId, h.eventsDir).pipe(
      Effect.catchIf(isNotFound, () => Effect.succeed<Array<string>>([]))
    )
    for (const entry of names) {
      // A segment creation cut by a crash: it was never acknowledged, the temp file is garbage
      // (to a reader it may be the writer's segment being made: left alone).
      if (entry.endsWith(".tmp") && !readOnly) yield* fsUnlink(sessionId, path.join(h.eventsDir, entry))
      const match = SEGMENT_NAME.exec(entry)
      if (match !== null) h.segments.push(Number(match[1]))
    }
    h.segments.sort((a, b) => a - b)
    const newest = h.segments[h.segments.length - 1]
    if (newest === undefined) return h
    const file = segmentPath(h, newest)
    const fd = yield* fsOpen(sessionId, file, readOnly ? "r" : "r+")
    // A reader stops before a torn tail (the writer's write in flight); only the writer repairs.
    const recovered = yield* recoverSegment(sessionId, fd, file, newest, !readOnly).pipe(Effect.tapError(() => fsCloseQuiet(fd)))
    h.fd = fd
    h.file = path.relative(root, file)
    h.generation = newest
    h.size = recovered.size
    h.count = recovered.count
    h.bytes = recovered.bytes
    h.last = recovered.last
    h.next = Cursor.make(newest, recovered.count)
    return h
  })

/** Creates a complete segment (header included) atomically and opens it for appending. */
const createSegment = (h: Handle, generation: number, after: Option.Option<Cursor.Cursor>) =>
  Effect.gen(function*() {
    const sid = h.sessionId
    const file = segmentPath(h, generation)
    const tmp = `${file}.tmp`
    const header = Buffer.from(headerLine(generation, after), "utf8")
    yield* Effect.acquireUseRelease(
      fsOpen(sid, tmp, "w", 0o600),
      (fd) =>
        Effect.gen(function*() {
          yield* fsWriteAll(sid, fd, header, 0)
          yield* fsDataSync(sid, fd)
        }),
      fsCloseQuiet
    )
    // open(2) applies the umask, which can only remove bits; set 0600 exactly anyway.
    yield* fsChmod(sid, tmp, 0o600)
    yield* fsRename(sid, tmp, file)
    yield* fsyncDir(sid, h.eventsDir)
    const fd = yield* fsOpen(sid, file, "r+")
    return { fd, size: header.length }
  })

/** Creates the session's directories and its first segment, on its first write. */
const createSession = (root: string, h: Handle) =>
  Effect.gen(function*() {
    yield* mkdirPrivate(h.sessionId, h.eventsDir)
    yield* fsChmod(h.sessionId, h.dir, 0o700)
    yield* fsyncDir(h.sessionId, root)
    yield* fsyncDir(h.sessionId, h.dir)
    const created = yield* createSegment(h, 1, Option.none())
    h.segments = [1]
    h.fd = created.fd
    h.file = path.relative(root, segmentPath(h, 1))
    h.generation = 1
    h.size = created.size
    h.count = 0
    h.bytes = 0
    h.marks = new Map()
  })

/**
 * Builds the file-backed service; its scope owns every open file and flusher fiber.
 *
 * Group commit (./appendQueue.ts, grouped per session): one flusher per busy session (or the
 * appender itself, or, on the hot path, no fiber at all: `writeNow`) takes everything queued,
 * writes it to the segment in one write and into the shared write-ahead log, and acknowledges
 * those appends once that log's commit is durable; appends that arrive meanwhile form the next
 * batch. `internal.writeAheadIo`: the write-ahead log's disk calls, for fault tests.
 */
export const make = (
  options: EventLogOptions,
  internal?: { readonly writeAheadIo?: WriteAhead.WriteAheadIo }
): Effect.Effect<EventLogService, EventLogError, Scope.Scope> =>
  Effect.gen(function*() {
    const root = path.resolve(options.root)
    const readOnly = options.readOnly === true
    const refuseWrite = (sessionId: string) =>
      fail("Closed", sessionId, "this event log was opened read-only (a reader in another process than its writer)")
    yield* mkdirPrivate("", root)
    // Before any segment is opened: what the last run's commits hold goes back into them.
    const writeAhead = readOnly
      ? undefined
      : yield* WriteAhead.make(root, {
        ...(options.writeAheadRotateBytes === undefined ? {} : { rotateBytes: options.writeAheadRotateBytes }),
        ...(internal?.writeAheadIo === undefined ? {} : { io: internal.writeAheadIo })
      }).pipe(
        Effect.mapError((e) => fail("Io", "", `the event log's write-ahead log: ${e.message}`, e.cause))
      )

    /** Writes one session's batch; on any failure the handle is killed and the session reopened later from disk. */
    const flush = (batch: AppendQueue.Batch<Handle>): Effect.Effect<void> =>
      Effect.forEach(batch, ([h, ops]) => writeOps(h, ops), { discard: true })

    /** The appends of `batch` from `start` up to the next rotation, written and waiting for their commit. */
    interface Run {
      readonly end: number
      readonly length: number
      readonly marks: ReadonlyArray<readonly [number, number]>
      readonly commit: WriteAhead.Commit
    }

    /**
     * Writes the appends of `batch` from `start` (up to the next rotation) to the current segment
     * and copies them into the write-ahead log, in one synchronous step; throws the write's error.
     * Encoded piece by piece (a joined string would be a rope to flatten first: see utf8Batch)
     * and written straight from the scratch buffer: a copy of its own was fresh memory, page
     * faults and all, on a session's first turns.
     */
    const writeRun = (h: Handle, batch: ReadonlyArray<AppendQueue.Op>, start: number): Run => {
      // (A log opened read-only refuses every write: one that writes has its write-ahead log.)
      const wal = writeAhead!
      let end = start
      const marks: Array<readonly [number, number]> = []
      let commit: WriteAhead.Commit | undefined
      const offset = h.size
      const length = FileIo.fdWriteAllNow(h.fd!, () => {
        Utf8Batch.begin()
        while (end < batch.length) {
          const next = batch[end]!
          if (next._tag !== "Append") break
          if (next.cursor.sequence % MARK_EVERY === 0) marks.push([next.cursor.sequence, h.size + Utf8Batch.size()])
          putRecordOpen(next.cursor)
          if (typeof next.json === "string") Utf8Batch.put(next.json)
          else for (const part of next.json.parts) Utf8Batch.putPart(part)
          putRecordClose()
          end++
        }
        return Utf8Batch.view()
      }, offset, (bytes) => {
        commit = wal.add(h.file, offset, bytes)
      })
      return { end, length, marks, commit: commit! }
    }

    /** A run's commit is durable: the handle takes its records in, and its appends are answered. */
    const runDurable = (h: Handle, batch: ReadonlyArray<AppendQueue.Op>, start: number, run: Run): void => {
      h.size += run.length
      h.bytes += run.length
      for (const [sequence, offset] of run.marks) h.marks.set(sequence, offset)
      h.count += run.end - start
      h.last = Option.some((batch[run.end - 1] as AppendQueue.AppendOp).cursor)
      for (let i = start; i < run.end; i++) {
        const append = batch[i] as AppendQueue.AppendOp
        if (append.resume !== AppendQueue.answeredByLast) append.resume(Effect.succeed(append.cursor))
      }
    }

    /**
     * A write failed: its bytes, past the durable size, were never acknowledged, so they are cut
     * (a reopen must not adopt records whose appends reported failure; should the cut fail too,
     * the handle is killed anyway and its next open reads what is on disk). Returns the error the
     * handle fails with (its first one, if it had one already); the caller kills it.
     */
    const abandonWrite = (h: Handle, cause: unknown): EventLogError => {
      try {
        if (h.fd !== undefined) FileIo.truncateSyncRaw(h.fd, h.size)
      } catch {
        // See above: the kill that follows is what matters.
      }
      return h.dead ?? fail("Io", h.sessionId, `writing the event log failed: ${String(cause)}`, cause)
    }

    /**
     * `writeOps` of a session's appends outside any fiber (the hot path: `AppendQueue.writeNow`),
     * on an open handle: written at once, answered through `done` once their commit is durable.
     * A failure is handled as writeOps handles it: the bytes cut back and the handle killed.
     */
    const writeNow = (h: Handle, ops: ReadonlyArray<AppendQueue.AppendOp>, done: (error: EventLogError | undefined) => void): void => {
      const failed = (cause: unknown) => {
        const error = abandonWrite(h, cause)
        queue.killNow(h, error)
        done(error)
      }
      let run: Run
      try {
        run = writeRun(h, ops, 0)
      } catch (cause) {
        return failed(cause)
      }
      writeAhead!.whenDurable(run.commit, (outcome) => {
        if (outcome !== null) return failed(outcome)
        runDurable(h, ops, 0, run)
        done(undefined)
      })
    }

    const writeOps = (h: Handle, batch: ReadonlyArray<AppendQueue.Op>): Effect.Effect<void> => {
      let done = 0
      const run = Effect.gen(function*() {
        if (h.dead !== undefined) return yield* Effect.fail(h.dead)
        if (h.fd === undefined) yield* createSession(root, h)
        while (done < batch.length) {
          const op = batch[done]!
          if (op._tag === "Rotate") {
            const created = yield* createSegment(h, op.generation, h.last)
            const previous = h.fd
            h.segments.push(op.generation)
            h.fd = created.fd
            h.file = path.relative(root, segmentPath(h, op.generation))
            h.generation = op.generation
            h.size = created.size
            h.count = 0
            h.bytes = 0
            h.marks = new Map()
            if (previous !== undefined) yield* fsCloseQuiet(previous)
            op.resume(Effect.succeed(op.generation))
            done++
            continue
          }
          const run = yield* Effect.try({ try: () => writeRun(h, batch, done), catch: (cause) => cause })
          yield* io(h.sessionId, writeAhead!.durable(run.commit))
          runDurable(h, batch, done, run)
          done = run.end
        }
      })
      return run.pipe(
        Effect.catchAllCause((cause) =>
          Effect.gen(function*() {
            const error = abandonWrite(h, cause)
            for (const op of batch.slice(done)) op.resume(Effect.fail(error))
            yield* queue.kill(h, error)
          })
        ),
        Effect.uninterruptible
      )
    }

    const queue = yield* AppendQueue.make<Handle>({
      open: (sessionId) => openHandle(root, sessionId, readOnly),
      flush,
      writeNow: { ready: (h) => h.fd !== undefined, write: writeNow },
      release: (h) =>
        Effect.suspend(() => {
          const fd = h.fd
          h.fd = undefined
          return fd === undefined ? Effect.void : fsCloseQuiet(fd)
        }),
      grouping: { _tag: "Session", lockOf: (h) => h.lock },
      ...(readOnly ? { refuse: refuseWrite } : {})
    })
    const { append, appendAll, appendAllNow, forget, handleFor, handles, kill, startGeneration } = queue

    const statusOf = (h: Handle): EventLogStatus => ({
      generation: h.generation,
      lastCursor: h.last,
      generations: h.segments.length === 0 ? [h.generation] : [...h.segments],
      generationEvents: h.count,
      generationBytes: h.bytes
    })

    /** Where a retained generation began: its segment's header (none before anything was written). */
    const generationStart = (sessionId: string, h: Handle, generation: number) =>
      h.segments.includes(generation)
        ? segmentStart(sessionId, segmentPath(h, generation), generation).pipe(Effect.withSpan("EventLog.generationStart"))
        : Effect.succeed(Option.none<Cursor.Cursor>())

    /**
     * Streams the records of one segment with `sequence >= fromSequence`. Reads stop at the
     * durable size while the segment is current, so a reader never sees a record before it is
     * acknowledged; skipped lines are counted, not parsed (line k+1 holds sequence k).
     */
    const segmentStream = (
      h: Handle,
      generation: number,
      fromSequence: number
    ): Stream.Stream<EventRecord, EventLogError> =>
      Stream.unwrapScoped(Effect.gen(function*() {
        const sid = h.sessionId
        const file = segmentPath(h, generation)
        const fd = yield* Effect.acquireRelease(
          fsOpen(sid, file, "r").pipe(
            Effect.catchIf(isNotFound, () =>
              Effect.fail(fail("GenerationNotFound", sid, `generation ${generation} was pruned`)))
          ),
          fsCloseQuiet
        )
        const buffer = Buffer.allocUnsafe(READ_CHUNK)
        let position = 0
        let line = 0
        // From the nearest mark at or before the wanted sequence, in the current segment (its
        // lines are immutable once durable: the offset stays right if the segment is finished
        // meanwhile). The header was checked when the segment was made or opened.
        if (h.generation === generation && fromSequence >= MARK_EVERY) {
          const mark = fromSequence - (fromSequence % MARK_EVERY)
          const offset = h.marks.get(mark)
          if (offset !== undefined) {
            position = offset
            line = mark + 1
          }
        }
        let partial: Array<Buffer> = []
        // Only the current segment grows; an older one is complete up to its end of file.
        const limit = () => (h.generation === generation ? h.size : Number.MAX_SAFE_INTEGER)
        const corrupt = (message: string) => Option.some(fail("Corrupt", sid, `${file}: ${message}`))

        const take = (text: string, out: Array<EventRecord>): Option.Option<EventLogError> | undefined => {
          const index = line++
          if (index === 0) {
            return parseHeader(text, generation) === undefined ? corrupt("invalid segment header") : undefined
          }
          const record = parseRecord(text, generation)
          if (record === undefined || record.cursor.sequence !== index - 1) {
            return corrupt(`line ${index + 1} is not the record of sequence ${index - 1}`)
          }
          out.push(record)
          return undefined
        }

        const pull: Effect.Effect<Chunk.Chunk<EventRecord>, Option.Option<EventLogError>> = Effect.suspend(() => {
          const want = Math.min(buffer.length, limit() - position)
          const atEnd = (): Effect.Effect<never, Option.Option<EventLogError>> =>
            Effect.fail(partial.length > 0 ? corrupt("ends inside a record") : Option.none())
          if (want <= 0) return atEnd()
          return fsRead(sid, fd, buffer, want, position).pipe(
            Effect.mapError(Option.some),
            Effect.flatMap((n) => {
              if (n === 0) return atEnd()
              position += n
              const out: Array<EventRecord> = []
              let start = 0
              while (start < n) {
                const nl = buffer.indexOf(0x0a, start)
                if (nl === -1 || nl >= n) break
                // Lines before the wanted sequence are only counted.
                if (line === 0 || line - 1 >= fromSequence) {
                  const piece = buffer.subarray(start, nl)
                  const text = partial.length === 0
                    ? piece.toString("utf8")
                    : Buffer.concat([...partial, piece]).toString("utf8")
                  const error = take(text, out)
                  if (error !== undefined) return Effect.fail(error)
                } else {
                  line++
                }
                partial = []
                start = nl + 1
              }
              // The buffer is reused: keep a copy of the unfinished line.
              if (start < n) partial.push(Buffer.from(buffer.subarray(start, n)))
              return out.length === 0 ? pull : Effect.succeed(Chunk.unsafeFromArray(out))
            })
          )
        })
        return Stream.repeatEffectChunkOption(pull)
      }))

    const read = (sessionId: string, after?: Cursor.Cursor): Stream.Stream<EventRecord, EventLogError> =>
      Stream.unwrap(Effect.map(handleFor(sessionId), (h) => {
        const wholeFrom = (generation: number, fromSequence: number): Stream.Stream<EventRecord, EventLogError> => {
          // A segment read while it is current ends at its durable size. If it is finished by
          // the time the read moves on, records may have joined it after that end: they are
          // read before the next generation (its header says where this one ended).
          const wasCurrent = h.generation === generation
          let next = fromSequence
          const body = segmentStream(h, generation, fromSequence).pipe(Stream.mapChunks((chunk) => {
            const last = Chunk.last(chunk)
            if (Option.isSome(last)) {
              next = last.value.cursor.sequence + 1
              lastSeen = last.value.cursor
            }
            return chunk
          }))
          return Stream.concat(body, Stream.suspend(() => {
            const later = h.segments.find((g) => g > generation)
            if (!wasCurrent || later === undefined) return from(generation + 1)
            return Stream.unwrap(Effect.map(segmentStart(sessionId, segmentPath(h, later), later), (start) =>
              Option.isSome(start) && start.value.generation === generation && start.value.sequence >= next
                ? wholeFrom(generation, next)
                : from(generation + 1)))
          }))
        }
        /** The last record read (or the cursor read after): where the next segment must start. */
        let lastSeen: Cursor.Cursor | undefined = after
        // The next retained generation is looked up only when the previous one is finished, so
        // a generation started during the read is included.
        const from = (minGeneration: number): Stream.Stream<EventRecord, EventLogError> =>
          Stream.suspend(() => {
            const generation = h.segments.find((g) => g >= minGeneration)
            if (generation === undefined) return Stream.empty
            const skipped = generation !== minGeneration && !(after !== undefined && minGeneration === after.generation)
            if (skipped) {
              // Generations between were pruned (before this read began, or while it went on):
              // what follows is complete only if they held nothing after what was read, which
              // the next segment's header says.
              return Stream.unwrap(Effect.map(segmentStart(sessionId, segmentPath(h, generation), generation), (start) =>
                Option.isNone(start) || (lastSeen !== undefined && !Cursor.isBefore(lastSeen, start.value))
                  ? wholeFrom(generation, 0)
                  : Stream.fail(fail("GenerationNotFound", sessionId, `events before generation ${generation} were pruned`))))
            }
            if (after !== undefined && minGeneration === after.generation && generation !== after.generation) {
              // The cursor's generation is gone (pruned, possibly while this read waited): the
              // events after it are all here only if the next segment starts right after it.
              return Stream.unwrap(Effect.map(segmentStart(sessionId, segmentPath(h, generation), generation), (start) =>
                Option.isSome(start) && !Cursor.isBefore(after, start.value)
                  ? wholeFrom(generation, 0)
                  : Stream.fail(fail("GenerationNotFound", sessionId, `the events after ${after.generation}:${after.sequence} were pruned`))))
            }
            const fromSequence = after !== undefined && generation === after.generation ? after.sequence + 1 : 0
            const whole = wholeFrom(generation, fromSequence)
            const later = h.segments.find((g) => g > generation)
            if (fromSequence === 0 || later === undefined) return whole
            // A cursor at the end of a finished generation (a checkpoint's cursor, which is
            // where a restore starts): the next segment's header says so, and the finished one,
            // possibly megabytes, need not be read at all.
            return Stream.unwrap(Effect.map(segmentStart(sessionId, segmentPath(h, later), later), (start) =>
              Option.isSome(start) && !Cursor.isBefore(after!, start.value) ? from(later) : whole))
          })
        return from(after?.generation ?? 1)
      })).pipe(Stream.withSpan("EventLog.read"))

    const readGeneration = (sessionId: string, generation: number): Stream.Stream<EventRecord, EventLogError> =>
      Stream.unwrap(Effect.map(handleFor(sessionId), (h) => {
        if (h.segments.includes(generation)) return segmentStream(h, generation, 0)
        if (h.segments.length === 0 && generation === h.generation) return Stream.empty
        return Stream.fail(fail("GenerationNotFound", sessionId, `generation ${generation} is not retained`))
      })).pipe(Stream.withSpan("EventLog.readGeneration"))

    const prune = Effect.fn("EventLog.prune")(function*(sessionId: string, keepFromGeneration: number) {
      if (readOnly) return yield* Effect.fail(refuseWrite(sessionId))
      const h = yield* handleFor(sessionId)
      return yield* h.lock.withLock(Effect.gen(function*() {
        const keep = Math.min(keepFromGeneration, h.generation)
        const doomed = h.segments.filter((g) => g < keep)
        if (doomed.length === 0) return []
        // Readers look segments up lazily: drop them from the list before unlinking.
        h.segments = h.segments.filter((g) => g >= keep)
        for (const g of doomed) {
          yield* fsUnlink(sessionId, segmentPath(h, g)).pipe(Effect.catchIf(isNotFound, () => Effect.void))
        }
        yield* fsyncDir(sessionId, h.eventsDir)
        return doomed
      }))
    })

    const remove = Effect.fn("EventLog.remove")(
      function*(sessionId: string, options?: { readonly archiveTo?: string }) {
        if (readOnly) return yield* Effect.fail(refuseWrite(sessionId))
        const h = yield* handleFor(sessionId)
        yield* h.lock.withLock(Effect.gen(function*() {
          yield* kill(h, fail("Closed", sessionId, "the session's event log was removed"))
          const exists = yield* FileIo.exists(h.dir).pipe(Effect.orElseSucceed(() => false))
          if (!exists) return
          // No record of these segments stays to be replayed: deleted, a session of the same id
          // made later would get them; archived, their last writes become durable where they go
          // (best effort there: a kill at the fd limit still archives, as it did before).
          if (writeAhead !== undefined) {
            const synced = yield* Effect.either(io(sessionId, writeAhead.checkpoint))
            if (synced._tag === "Left") {
              if (options?.archiveTo === undefined) return yield* Effect.fail(synced.left)
              yield* Effect.logWarning(`event log: ${sessionId}: archived without its last writes synced: ${synced.left.message}`)
            }
          }
          if (options?.archiveTo !== undefined) {
            const target = path.resolve(options.archiveTo)
            yield* mkdirPrivate(sessionId, path.dirname(target))
            yield* fsRename(sessionId, h.dir, target)
            yield* fsyncDir(sessionId, path.dirname(target))
          } else {
            yield* io(sessionId, FileIo.removeTree(h.dir))
          }
          yield* fsyncDir(sessionId, root)
        }))
      }
    )

    const repair = Effect.fn("EventLog.repair")(function*(sessionId: string) {
      if (readOnly) return yield* Effect.fail(refuseWrite(sessionId))
      const open = handles.get(sessionId)
      if (open !== undefined) {
        yield* kill(open, fail("Closed", sessionId, "the session's event log is being repaired"))
        // A batch being written (its records on their way to the write-ahead log) ends first.
        yield* open.lock.withLock(Effect.void)
      }
      // No record written before a cut is replayed over it after a crash.
      if (writeAhead !== undefined) yield* io(sessionId, writeAhead.checkpoint)
      const name = sanitizeSessionId(sessionId)
      if (name._tag === "Left") return yield* Effect.fail(name.left)
      const eventsDir = StateLayout.eventLogPaths(root).eventsDir(sessionId)
      const segments = (yield* fsReaddir(sessionId, eventsDir).pipe(
        Effect.catchIf(isNotFound, () => Effect.succeed<Array<string>>([]))
      )).flatMap((entry) => {
        const match = SEGMENT_NAME.exec(entry)
        return match === null ? [] : [Number(match[1])]
      }).sort((a, b) => a - b)
      for (const [i, generation] of segments.entries()) {
        const file = StateLayout.eventSegmentFile(eventsDir, generation)
        const bytes = yield* io(sessionId, FileIo.readFile(file))
        const damage = firstDamage(bytes, generation, i === segments.length - 1)
        if (damage === undefined) continue
        const suffix = `.damaged-${new Date().toISOString().replace(/[:.]/g, "-")}`
        const movedTo: Array<string> = []
        let moved = 0
        if (damage.offset === 0) {
          yield* fsRename(sessionId, file, file + suffix)
        } else {
          // The damaged bytes are durable in their new file before the segment gives them up.
          yield* Effect.acquireUseRelease(
            fsOpen(sessionId, file + suffix, "wx", 0o600),
            (fd) => Effect.zipRight(fsWriteAll(sessionId, fd, bytes.subarray(damage.offset), 0), fsDataSync(sessionId, fd)),
            fsCloseQuiet
          )
          yield* Effect.acquireUseRelease(
            fsOpen(sessionId, file, "r+"),
            (fd) => Effect.zipRight(fsTruncate(sessionId, fd, damage.offset), fsDataSync(sessionId, fd)),
            fsCloseQuiet
          )
        }
        movedTo.push(file + suffix)
        moved += bytes.length - damage.offset
        for (const later of segments.slice(i + 1)) {
          const laterFile = StateLayout.eventSegmentFile(eventsDir, later)
          moved += yield* io(sessionId, FileIo.stat(laterFile)).pipe(Effect.map((st) => Number(st.size)))
          yield* fsRename(sessionId, laterFile, laterFile + suffix)
          movedTo.push(laterFile + suffix)
        }
        yield* fsyncDir(sessionId, eventsDir)
        const later = segments.length - 1 - i
        return Option.some<EventLogRepair>({
          file,
          line: damage.line,
          movedTo,
          bytes: moved,
          message: `${file}: line ${damage.line} is not a record of the log; the ${moved} bytes from there on` +
            `${later > 0 ? ` (with ${later} later generation${later === 1 ? "" : "s"})` : ""} were moved aside to ` +
            movedTo.map((f) => path.basename(f)).join(", ")
        })
      }
      return Option.none<EventLogRepair>()
    })

    return makeService(handleFor, statusOf, generationStart, {
      append,
      appendAll,
      ...(appendAllNow === undefined ? {} : { appendAllNow }),
      read,
      readGeneration,
      startGeneration,
      prune,
      remove,
      repair,
      forget
    })
  })

