/**
 * The snapshot cache's implementation, one for both layers: memory only (`spill` undefined), or
 * memory then disk under a cache root (the public module, ../../SnapshotCache.ts, holds the
 * interface and describes the behaviour).
 */
import type * as FileSystem from "@effect/platform/FileSystem"
import * as Deferred from "effect/Deferred"
import * as Effect from "effect/Effect"
import * as Exit from "effect/Exit"
import * as FiberId from "effect/FiberId"
import * as HashMap from "effect/HashMap"
import * as Option from "effect/Option"
import * as Ref from "effect/Ref"
import type * as Scope from "effect/Scope"
import * as Stream from "effect/Stream"
import * as NodePath from "node:path"
import {
  type ChunkResult,
  type FileRange,
  SnapshotCache,
  SnapshotCacheError,
  type SnapshotCacheService,
  type SnapshotCacheStats,
  type SnapshotEnd,
  type SnapshotInfo,
  type SnapshotMeta,
  type SnapshotReader
} from "../../SnapshotCache.js"
import * as StateLayout from "../../StateLayout.js"
import * as FileIo from "../fileIo.js"
import { error, NEWLINE } from "./chunking.js"

type Slot =
  | { readonly _tag: "Memory"; readonly bytes: Uint8Array }
  | { readonly _tag: "Disk"; readonly byteLength: number }
  | { readonly _tag: "Range"; readonly range: FileRange }

type Status =
  | { readonly _tag: "Open" }
  | { readonly _tag: "Complete"; readonly end: SnapshotEnd }
  | { readonly _tag: "Failed"; readonly error: SnapshotCacheError }

interface EntryState {
  readonly status: Status
  readonly chunkCount: number
  readonly readers: number
  readonly disposed: boolean
  /** Set exactly once, by whoever drops the entry; guards against a second cleanup. */
  readonly removed: boolean
  /** Completed (and replaced) on every change of `status` or `chunkCount`: the waiters' signal. */
  readonly changed: Deferred.Deferred<void>
}

interface Entry {
  readonly snapshotId: string
  readonly meta: SnapshotMeta
  readonly directory: string | undefined
  readonly state: Ref.Ref<EntryState>
  /** One writer at a time: appends, spills, ends and disposal never interleave. */
  readonly lock: Effect.Semaphore
  // Mutated only under `lock`, and published through `state.chunkCount` after the mutation, so a
  // reader never sees a slot that is not ready. A plain array keeps `append` O(1).
  readonly slots: Array<Slot>
  /**
   * Chunks read from files being read or still held by a reader, by index: readers that move
   * together (the usual case: clients attached to the same checkpoint) share one read and one
   * buffer instead of each reading the file. A `WeakRef` never keeps a chunk alive: memory stays
   * what readers hold.
   */
  readonly reads: Map<number, SharedRead>
  /**
   * Buffers of released range reads, lent to the next ones (see `Lease`); emptied when the last
   * reader goes, so an entry nobody reads holds none.
   */
  readonly pool: Array<Buffer>
  /** No reader now: a buffer released meanwhile (its socket drained late) is not kept. */
  idle: boolean
  /**
   * The files its ranges are read from, kept open from its disposal (a newer generation took
   * over) until it is gone: a file that generation prunes or replaces meanwhile still reads as
   * it was, so a newer snapshot never disturbs a reader of an older one.
   */
  readonly files: Map<string, FileIo.FileHandle>
  /**
   * The files its ranges are read from while it has readers (one open per attach, not one per
   * chunk); closed when the last reader goes, so a cached snapshot nobody reads holds no
   * descriptor.
   */
  readonly reading: Map<string, Promise<FileIo.FileHandle>>
  spilled: boolean
  /** Set before the first file operation, so that a half-done spill is cleaned up too. */
  touchedDisk: boolean
  memoryBytes: number
  totalBytes: number
}

/**
 * A chunk read from a file, counted by the readers holding it. The last release gives a pooled
 * buffer back to its entry for the next range read: a fresh 1-2 MB buffer per chunk was external
 * memory that made V8 run a full mark-compact every few chunks (a quarter of an attach's CPU).
 * `refs` 0 means released for good: nobody may take it again.
 */
interface Lease {
  readonly index: number
  readonly bytes: Uint8Array
  /** The pooled buffer `bytes` is a view of; undefined for a buffer of its own (a spill file's). */
  readonly pooled: Buffer | undefined
  refs: number
}

type SharedRead =
  | { readonly _tag: "Pending"; readonly deferred: Deferred.Deferred<Lease, SnapshotCacheError> }
  | { readonly _tag: "Done"; readonly lease: WeakRef<Lease> }

/** A chunk held in memory is the cache's own: nothing to give back. */
const noRelease = () => {}

/** Released buffers an entry keeps for its next reads: a few chunks in flight per reader. */
const POOL_BUFFERS = 6
/** Pooled buffers are allocated in steps of this, so that chunks of close sizes share them. */
const POOL_STEP = 64 * 1024
/**
 * A buffer larger than this (a chunk of one huge message) is not kept for reuse: six of them
 * would be held for as long as the entry has readers.
 */
const POOL_MAX_BUFFER_BYTES = 8 * 1024 * 1024

export interface SpillConfig {
  readonly fs: FileSystem.FileSystem
  readonly root: string
}

const DIRECTORY_MODE = 0o700
const FILE_MODE = 0o600

const chunkPath = (directory: string, index: number) => NodePath.join(directory, `${index}.jsonl`)

// A view into a larger buffer (a pooled Buffer, a slice of a read buffer) would keep the whole
// buffer alive and make the memory accounting lie: keep an exact-size copy instead.
const own = (bytes: Uint8Array): Uint8Array =>
  bytes.byteOffset === 0 && bytes.byteLength === bytes.buffer.byteLength ? bytes : new Uint8Array(bytes)

const statusName = (status: Status): SnapshotInfo["status"] =>
  status._tag === "Open" ? "open" : status._tag === "Complete" ? "complete" : "failed"

export const makeWith = (
  memoryCacheBytes: number,
  spill: SpillConfig | undefined
): Effect.Effect<SnapshotCacheService, never, Scope.Scope> =>
  Effect.gen(function*() {
    // None once the cache is closed: `create` and shutdown decide atomically who comes last.
    const entries = yield* Ref.make(Option.some(HashMap.empty<string, Entry>()))
    const memoryUsed = yield* Ref.make(0)
    const closedError = (snapshotId: string) => error("Closed", "the snapshot cache is closed", snapshotId)

    const ioError = (snapshotId: string, what: string) => (cause: { readonly message: string }) =>
      error("Io", `snapshot ${snapshotId}: ${what}: ${cause.message}`, snapshotId, cause)

    const lookup = (snapshotId: string) =>
      Effect.flatMap(Ref.get(entries), (map) =>
        Option.match(Option.flatMap(map, HashMap.get(snapshotId)), {
          onNone: () => Effect.fail(error("NotFound", `no snapshot ${snapshotId} in the cache`, snapshotId)),
          onSome: Effect.succeed
        }))

    /** Applies `f` to the entry's state and wakes every waiter. Callers hold `entry.lock`. */
    const publish = (entry: Entry, f: (state: EntryState) => EntryState) =>
      Effect.gen(function*() {
        const next = yield* Deferred.make<void>()
        const previous = yield* Ref.modify(entry.state, (s) => [s.changed, { ...f(s), changed: next }] as const)
        yield* Deferred.succeed(previous, undefined)
      })

    /** Fails an open entry (a no-op otherwise: the first end wins). Callers hold `entry.lock`. */
    const failEntry = (entry: Entry, failure: SnapshotCacheError) =>
      publish(entry, (s) => s.status._tag === "Open" ? { ...s, status: { _tag: "Failed", error: failure } } : s)

    /** Frees the entry's memory and files and forgets it. Runs once, after `removed` was set. */
    const cleanup = (entry: Entry) =>
      Effect.gen(function*() {
        yield* Ref.update(entries, Option.map((map) =>
          Option.exists(HashMap.get(map, entry.snapshotId), (e) => e === entry)
            ? HashMap.remove(map, entry.snapshotId)
            : map))
        const freed = entry.memoryBytes
        entry.memoryBytes = 0
        entry.slots.length = 0
        entry.reads.clear()
        entry.pool.length = 0
        const files = [...entry.files.values()]
        entry.files.clear()
        yield* Effect.forEach(files, (handle) => Effect.promise(() => handle.close().catch(() => undefined)), { discard: true })
        yield* closeReading(entry)
        yield* Ref.update(memoryUsed, (used) => used - freed)
        if (entry.touchedDisk && spill !== undefined && entry.directory !== undefined) {
          const directory = entry.directory
          yield* spill.fs.remove(directory, { recursive: true, force: true }).pipe(
            Effect.mapError(ioError(entry.snapshotId, `could not remove ${directory}`))
          )
        }
      })

    /** Moves every in-memory chunk of the entry to its spill directory. Callers hold `entry.lock`. */
    const spillEntry = (entry: Entry, config: SpillConfig, directory: string) =>
      Effect.gen(function*() {
        const { fs } = config
        const wrap = ioError(entry.snapshotId, `could not spill to ${directory}`)
        entry.touchedDisk = true
        yield* fs.makeDirectory(config.root, { recursive: true, mode: DIRECTORY_MODE }).pipe(Effect.mapError(wrap))
        // A directory left by an interrupted run of this generation would mix old chunks in.
        yield* fs.remove(directory, { recursive: true, force: true }).pipe(Effect.mapError(wrap))
        yield* fs.makeDirectory(directory, { mode: DIRECTORY_MODE }).pipe(Effect.mapError(wrap))
        // The umask can only remove bits; chmod makes the mode exact whatever the umask is.
        yield* fs.chmod(directory, DIRECTORY_MODE).pipe(Effect.mapError(wrap))
        for (let index = 0; index < entry.slots.length; index++) {
          const slot = entry.slots[index]
          if (slot?._tag === "Memory") {
            yield* fs.writeFile(chunkPath(directory, index), slot.bytes, { mode: FILE_MODE }).pipe(Effect.mapError(wrap))
          }
        }
        // Switch only once every file exists: a reader that already took a memory slot keeps its
        // bytes, a reader that comes later finds the file.
        for (let index = 0; index < entry.slots.length; index++) {
          const slot = entry.slots[index]
          if (slot?._tag === "Memory") entry.slots[index] = { _tag: "Disk", byteLength: slot.bytes.byteLength }
        }
        const freed = entry.memoryBytes
        entry.memoryBytes = 0
        entry.spilled = true
        yield* Ref.update(memoryUsed, (used) => used - freed)
      })

    const checkId = (snapshotId: string) =>
      snapshotId.length === 0
        ? Effect.fail(error("InvalidSnapshotId", "a snapshotId must not be empty", snapshotId))
        : Effect.void

    const create = Effect.fn("SnapshotCache.create")(function*(snapshotId: string, meta: SnapshotMeta) {
      yield* checkId(snapshotId)
      const entry: Entry = {
        snapshotId,
        meta,
        directory: spill !== undefined ? StateLayout.spillDir(spill.root, snapshotId) : undefined,
        state: yield* Ref.make<EntryState>({
          status: { _tag: "Open" },
          chunkCount: 0,
          readers: 0,
          disposed: false,
          removed: false,
          changed: yield* Deferred.make<void>()
        }),
        lock: yield* Effect.makeSemaphore(1),
        slots: [],
        reads: new Map(),
        pool: [],
        idle: true,
        files: new Map(),
        reading: new Map(),
        spilled: false,
        touchedDisk: false,
        memoryBytes: 0,
        totalBytes: 0
      }
      const failure = yield* Ref.modify(entries, (current) =>
        Option.isNone(current)
          ? [Option.some(closedError(snapshotId)), current] as const
          : HashMap.has(current.value, snapshotId)
          ? [Option.some(error("AlreadyExists", `snapshot ${snapshotId} already exists`, snapshotId)), current] as const
          : [Option.none(), Option.some(HashMap.set(current.value, snapshotId, entry))] as const)
      if (Option.isSome(failure)) return yield* Effect.fail(failure.value)
    })

    /** Fails unless the entry still takes writes. Callers hold `entry.lock`. */
    const checkWritable = (entry: Entry) =>
      Effect.flatMap(Ref.get(entry.state), (s) =>
        s.disposed
          ? Effect.fail(error("Disposed", `snapshot ${entry.snapshotId} was disposed`, entry.snapshotId))
          : s.status._tag !== "Open"
          ? Effect.fail(error("NotWritable", `snapshot ${entry.snapshotId} is already ${statusName(s.status)}`, entry.snapshotId))
          : Effect.void)

    const appendChunk = Effect.fn("SnapshotCache.appendChunk")(function*(snapshotId: string, chunkBytes: Uint8Array) {
      const entry = yield* lookup(snapshotId)
      const size = chunkBytes.byteLength
      if (size === 0 || chunkBytes[size - 1] !== NEWLINE) {
        return yield* Effect.fail(error("InvalidChunk", `a chunk of snapshot ${snapshotId} must be one \\n-terminated line`, snapshotId))
      }
      // Uninterruptible so that the slots, the files and the memory accounting always agree.
      return yield* entry.lock.withPermits(1)(Effect.uninterruptible(Effect.gen(function*() {
        yield* checkWritable(entry)
        const index = entry.slots.length
        let toDisk = entry.spilled
        if (!toDisk) {
          const reserved = yield* Ref.modify(memoryUsed, (used) =>
            used + size <= memoryCacheBytes ? [true, used + size] as const : [false, used] as const)
          if (!reserved) {
            if (spill === undefined || entry.directory === undefined) {
              return yield* Effect.die(new Error("SnapshotCache: a memory-only cache cannot run out of budget"))
            }
            yield* spillEntry(entry, spill, entry.directory)
            toDisk = true
          }
        }
        if (toDisk && spill !== undefined && entry.directory !== undefined) {
          const path = chunkPath(entry.directory, index)
          yield* spill.fs.writeFile(path, chunkBytes, { mode: FILE_MODE }).pipe(
            Effect.mapError(ioError(snapshotId, `could not write ${path}`))
          )
          entry.slots.push({ _tag: "Disk", byteLength: size })
        } else {
          entry.slots.push({ _tag: "Memory", bytes: own(chunkBytes) })
          entry.memoryBytes += size
        }
        entry.totalBytes += size
        yield* publish(entry, (s) => ({ ...s, chunkCount: index + 1 }))
        return index
      }).pipe(
        // A half-spilled entry cannot be continued: fail it so its readers stop waiting.
        Effect.tapError((e) => e.reason === "Io" ? failEntry(entry, e) : Effect.void)
      )))
    })

    const appendRange = Effect.fn("SnapshotCache.appendRange")(function*(snapshotId: string, range: FileRange) {
      const entry = yield* lookup(snapshotId)
      if (!(Number.isSafeInteger(range.start) && Number.isSafeInteger(range.end) && range.start >= 0 && range.end > range.start)) {
        return yield* Effect.fail(error("InvalidChunk", `an empty or invalid range of snapshot ${snapshotId}`, snapshotId))
      }
      return yield* entry.lock.withPermits(1)(Effect.gen(function*() {
        yield* checkWritable(entry)
        const index = entry.slots.length
        entry.slots.push({ _tag: "Range", range })
        entry.totalBytes += range.end - range.start
        yield* publish(entry, (s) => ({ ...s, chunkCount: index + 1 }))
        return index
      }))
    })

    const markComplete = Effect.fn("SnapshotCache.markComplete")(function*(snapshotId: string, end: SnapshotEnd) {
      const entry = yield* lookup(snapshotId)
      yield* entry.lock.withPermits(1)(Effect.gen(function*() {
        yield* checkWritable(entry)
        if (end.chunkCount !== entry.slots.length) {
          const mismatch = error(
            "ChunkCountMismatch",
            `snapshot ${snapshotId} ended with chunkCount ${end.chunkCount} but ${entry.slots.length} chunks were appended`,
            snapshotId
          )
          yield* failEntry(entry, mismatch)
          return yield* Effect.fail(mismatch)
        }
        yield* publish(entry, (s) => ({ ...s, status: { _tag: "Complete", end } }))
      }))
    })

    const markFailed = Effect.fn("SnapshotCache.markFailed")(function*(snapshotId: string, message: string) {
      const entry = yield* lookup(snapshotId)
      yield* entry.lock.withPermits(1)(Effect.gen(function*() {
        const s = yield* Ref.get(entry.state)
        if (s.status._tag === "Complete") {
          return yield* Effect.fail(error("NotWritable", `snapshot ${snapshotId} is already complete`, snapshotId))
        }
        yield* failEntry(entry, error("SnapshotFailed", message, snapshotId))
      }))
    })

    /** Takes a reference to `lease` unless it was released for good (its buffer may be reused). */
    const acquire = (lease: Lease): boolean => {
      if (lease.refs === 0) return false
      lease.refs++
      return true
    }

    /** Drops a reference; the last one forgets the shared read and gives its buffer back. */
    const releaseLease = (entry: Entry, lease: Lease) => {
      if (lease.refs === 0) return
      if (--lease.refs > 0) return
      const shared = entry.reads.get(lease.index)
      if (shared?._tag === "Done" && shared.lease.deref() === lease) entry.reads.delete(lease.index)
      if (lease.pooled !== undefined) giveBuffer(entry, lease.pooled)
    }

    /** Keeps a buffer nobody holds for the entry's next reads, if the entry is read and has room. */
    const giveBuffer = (entry: Entry, buffer: Buffer) => {
      if (!entry.idle && entry.pool.length < POOL_BUFFERS && buffer.length <= POOL_MAX_BUFFER_BYTES) entry.pool.push(buffer)
    }

    /** A buffer of at least `size` bytes: a pooled one if one fits, else a new one. */
    const takeBuffer = (entry: Entry, size: number): Buffer => {
      let best = -1
      for (let i = 0; i < entry.pool.length; i++) {
        const length = entry.pool[i]!.length
        if (length >= size && (best === -1 || length < entry.pool[best]!.length)) best = i
      }
      if (best !== -1) return entry.pool.splice(best, 1)[0]!
      return Buffer.allocUnsafeSlow(Math.ceil(size / POOL_STEP) * POOL_STEP)
    }

    /**
     * Reads a chunk from disk, sharing a read in flight or a lease another reader still holds;
     * the lease returned carries a reference for the caller.
     */
    const readShared = (entry: Entry, index: number, read: Effect.Effect<Lease, SnapshotCacheError>): Effect.Effect<Lease, SnapshotCacheError> =>
      Effect.suspend(() => {
        const shared = entry.reads.get(index)
        // A read in flight: its lease, unless every holder released it before this fiber woke.
        if (shared?._tag === "Pending") {
          return Effect.flatMap(Deferred.await(shared.deferred), (lease) => acquire(lease) ? Effect.succeed(lease) : readShared(entry, index, read))
        }
        const held = shared?.lease.deref()
        if (held !== undefined && acquire(held)) return Effect.succeed(held)
        // Registered synchronously, before any other fiber can run, so that one read is shared.
        const deferred = Deferred.unsafeMake<Lease, SnapshotCacheError>(FiberId.none)
        entry.reads.set(index, { _tag: "Pending", deferred })
        // Uninterruptible up to the hand-over: the readers sharing this read must always hear back,
        // and the lease (one reference, the caller's) must reach the caller.
        return Effect.uninterruptible(
          read.pipe(
            Effect.exit,
            Effect.flatMap((exit) => {
              if (entry.reads.get(index)?._tag === "Pending") {
                if (Exit.isSuccess(exit)) entry.reads.set(index, { _tag: "Done", lease: new WeakRef(exit.value) })
                else entry.reads.delete(index)
              }
              return Effect.zipRight(Deferred.done(deferred, exit), exit)
            })
          )
        )
      })

    /** The open file of `path` for the entry's readers (see `reading`). */
    const fileForReaders = (entry: Entry, path: string): Promise<FileIo.FileHandle> => {
      const kept = entry.files.get(path)
      if (kept !== undefined) return Promise.resolve(kept)
      let opening = entry.reading.get(path)
      if (opening === undefined) {
        opening = FileIo.openAsync(path)
        entry.reading.set(path, opening)
        // A failed open is tried again by the next read (it fails that read with its cause).
        opening.catch(() => {
          if (entry.reading.get(path) === opening) entry.reading.delete(path)
        })
      }
      return opening
    }

    /** Closes the files opened for readers (a read still running on one finishes first: Node waits). */
    const closeReading = (entry: Entry) =>
      Effect.suspend(() => {
        const open = [...entry.reading.values()]
        entry.reading.clear()
        return Effect.forEach(open, (opening) => Effect.promise(() => opening.then((h) => h.close()).catch(() => undefined)), { discard: true })
      })

    /**
     * The line of chunk `index` from the messages on `range`: the frame around them, and the
     * lines' newlines turned into the array's commas, in one (pooled) buffer.
     */
    const readRangeChunk = (entry: Entry, index: number, range: FileRange) =>
      Effect.tryPromise({
        try: async (): Promise<Lease> => {
          const prefix = Buffer.from(
            `{"type":"session_snapshot_chunk","activeSessionId":${JSON.stringify(entry.meta.activeSessionId)},` +
              `"snapshotId":${JSON.stringify(entry.snapshotId)},"index":${index},"messages":[`
          )
          const length = range.end - range.start
          // The range's last newline becomes the closing `]`; then `}` and the line's newline.
          const size = prefix.length + length + 2
          const pooled = takeBuffer(entry, size)
          try {
            const line = pooled.subarray(0, size)
            prefix.copy(line, 0)
            const handle = await fileForReaders(entry, range.path)
            let done = 0
            while (done < length) {
              const { bytesRead } = await handle.read(line, prefix.length + done, length - done, range.start + done)
              if (bytesRead === 0) throw new Error(`${range.path} ends before byte ${range.end}`)
              done += bytesRead
            }
            const last = prefix.length + length - 1
            if (line[last] !== NEWLINE) throw new Error(`${range.path}: bytes ${range.start}-${range.end} are not whole lines`)
            for (let at = line.indexOf(NEWLINE, prefix.length); at !== -1 && at < last; at = line.indexOf(NEWLINE, at + 1)) {
              line[at] = 0x2c
            }
            line[last] = 0x5d
            line[last + 1] = 0x7d
            line[last + 2] = NEWLINE
            return { index, bytes: new Uint8Array(line.buffer, line.byteOffset, line.length), pooled, refs: 1 }
          } catch (cause) {
            giveBuffer(entry, pooled)
            throw cause
          }
        },
        catch: (cause) => error("Io", `snapshot ${entry.snapshotId}: could not read ${range.path}: ${String(cause)}`, entry.snapshotId, cause)
      })

    /** The chunk a reader gets from a lease: its bytes, and its release (once). */
    const leased = (entry: Entry, lease: Lease): ChunkResult => {
      let released = false
      return {
        _tag: "Chunk",
        index: lease.index,
        bytes: lease.bytes,
        release: () => {
          if (released) return
          released = true
          releaseLease(entry, lease)
        }
      }
    }

    /** Parks until `index` exists or the entry ends. */
    const waitOn = (entry: Entry, index: number): Effect.Effect<ChunkResult, SnapshotCacheError> =>
      Effect.gen(function*() {
        if (!Number.isSafeInteger(index) || index < 0) {
          return yield* Effect.fail(error("InvalidIndex", `invalid chunk index ${index}`, entry.snapshotId))
        }
        while (true) {
          const s = yield* Ref.get(entry.state)
          if (s.status._tag === "Failed") return yield* Effect.fail(s.status.error)
          if (index < s.chunkCount) {
            const slot = entry.slots[index]
            if (slot === undefined) return yield* Effect.die(new Error("SnapshotCache: a published chunk has no slot"))
            if (slot._tag === "Memory") return { _tag: "Chunk", index, bytes: slot.bytes, release: noRelease } as const
            if (slot._tag === "Range") return leased(entry, yield* readShared(entry, index, readRangeChunk(entry, index, slot.range)))
            if (spill === undefined || entry.directory === undefined) {
              return yield* Effect.die(new Error("SnapshotCache: a spilled chunk in a memory-only cache"))
            }
            const path = chunkPath(entry.directory, index)
            const lease = yield* readShared(
              entry,
              index,
              spill.fs.readFile(path).pipe(
                Effect.map((bytes): Lease => ({ index, bytes, pooled: undefined, refs: 1 })),
                Effect.mapError(ioError(entry.snapshotId, `could not read ${path}`))
              )
            )
            return leased(entry, lease)
          }
          if (s.status._tag === "Complete") return { _tag: "End", end: s.status.end } as const
          yield* Deferred.await(s.changed)
        }
      })

    const awaitEndOf = (entry: Entry): Effect.Effect<SnapshotEnd, SnapshotCacheError> =>
      Effect.gen(function*() {
        while (true) {
          const s = yield* Ref.get(entry.state)
          if (s.status._tag === "Failed") return yield* Effect.fail(s.status.error)
          if (s.status._tag === "Complete") return s.status.end
          yield* Deferred.await(s.changed)
        }
      })

    /** Drops one reader; the last reader of a disposed entry cleans it up. */
    const releaseReader = (entry: Entry) =>
      Effect.gen(function*() {
        const [drop, idle] = yield* Ref.modify(entry.state, (s) => {
          const readers = s.readers - 1
          const drop = readers === 0 && s.disposed && !s.removed
          return [[drop, readers === 0 && !drop], { ...s, readers, removed: s.removed || drop }] as const
        })
        if (drop) {
          yield* cleanup(entry).pipe(
            Effect.catchAll((e) => Effect.logWarning("SnapshotCache: cleanup after the last reader failed", e))
          )
        } else if (idle) {
          // Nobody reads it now: it holds no descriptor and no spare buffer until someone does.
          entry.idle = true
          entry.pool.length = 0
          yield* closeReading(entry)
        }
      })

    const retain = Effect.fn("SnapshotCache.retain")(function*(snapshotId: string) {
      const entry = yield* lookup(snapshotId)
      const released = yield* Ref.make(false)
      const release = Effect.flatMap(Ref.getAndSet(released, true), (was) => was ? Effect.void : releaseReader(entry))
      yield* Effect.acquireRelease(
        Effect.flatMap(
          Ref.modify(entry.state, (s) =>
            s.removed
              ? [Option.some(error("NotFound", `no snapshot ${snapshotId} in the cache`, snapshotId)), s] as const
              : s.disposed
              ? [Option.some(error("Disposed", `snapshot ${snapshotId} was disposed`, snapshotId)), s] as const
              : [Option.none(), { ...s, readers: s.readers + 1 }] as const),
          Option.match({
            onNone: () =>
              Effect.sync(() => {
                entry.idle = false
              }),
            onSome: Effect.fail
          })
        ),
        () => release
      )
      const guard = <A>(effect: Effect.Effect<A, SnapshotCacheError>) =>
        Effect.flatMap(Ref.get(released), (was) =>
          was ? Effect.fail(error("Released", `this reader of snapshot ${snapshotId} was released`, snapshotId)) : effect)
      const waitForChunk = (index: number) => guard(waitOn(entry, index))
      const reader: SnapshotReader = {
        snapshotId,
        meta: entry.meta,
        waitForChunk,
        stream: Stream.unfoldEffect(0, (index) =>
          Effect.map(waitForChunk(index), (result) =>
            result._tag === "Chunk" ? Option.some([result.bytes, index + 1] as const) : Option.none())),
        awaitEnd: guard(awaitEndOf(entry)),
        release
      }
      return reader
    })

    const waitForChunk = Effect.fn("SnapshotCache.waitForChunk")(function*(snapshotId: string, index: number) {
      return yield* Effect.scoped(Effect.flatMap(retain(snapshotId), (reader) => reader.waitForChunk(index)))
    })

    const stream = (snapshotId: string): Stream.Stream<Uint8Array, SnapshotCacheError> =>
      Stream.unwrapScoped(Effect.map(retain(snapshotId), (reader) => reader.stream)).pipe(
        Stream.withSpan("SnapshotCache.stream", { attributes: { snapshotId } })
      )

    const dispose = Effect.fn("SnapshotCache.dispose")(function*(snapshotId: string) {
      const found = Option.flatMap(yield* Ref.get(entries), HashMap.get(snapshotId))
      if (Option.isNone(found)) return
      const entry = found.value
      // Under the lock: an append in flight finishes first, and none starts after.
      yield* entry.lock.withPermits(1)(Effect.gen(function*() {
        yield* failEntry(entry, error("Disposed", `snapshot ${snapshotId} was disposed before it was complete`, snapshotId))
        // Its readers may outlive the files it reads (see `files`); cleanup closes them.
        const paths = new Set(entry.slots.flatMap((slot) => slot._tag === "Range" && !entry.files.has(slot.range.path) ? [slot.range.path] : []))
        for (const file of paths) {
          const handle = yield* Effect.option(FileIo.open(file, "r"))
          // A file already gone: its reads fail as they would have (with its name).
          if (Option.isSome(handle)) entry.files.set(file, handle.value)
        }
        const drop = yield* Ref.modify(entry.state, (s) => {
          const drop = s.readers === 0 && !s.removed
          return [drop, { ...s, disposed: true, removed: s.removed || drop }] as const
        })
        if (drop) yield* cleanup(entry)
      }))
    })

    const info = Effect.fn("SnapshotCache.info")(function*(snapshotId: string) {
      const entry = yield* lookup(snapshotId)
      const s = yield* Ref.get(entry.state)
      const result: SnapshotInfo = {
        snapshotId,
        meta: entry.meta,
        status: statusName(s.status),
        end: s.status._tag === "Complete" ? s.status.end : undefined,
        chunkCount: s.chunkCount,
        totalBytes: entry.totalBytes,
        memoryBytes: entry.memoryBytes,
        spilled: entry.spilled,
        spillDirectory: entry.directory,
        readers: s.readers,
        disposed: s.disposed
      }
      return result
    })

    const stats: Effect.Effect<SnapshotCacheStats> = Effect.gen(function*() {
      const map = Option.getOrElse(yield* Ref.get(entries), () => HashMap.empty<string, Entry>())
      let spilledEntries = 0
      for (const entry of HashMap.values(map)) if (entry.spilled) spilledEntries++
      return {
        entries: HashMap.size(map),
        spilledEntries,
        memoryBytes: yield* Ref.get(memoryUsed),
        memoryCacheBytes
      }
    }).pipe(Effect.withSpan("SnapshotCache.stats"))

    // Shutdown: every reader, even of a complete entry, gets `Closed` from now on (its files are
    // about to go), and every spill directory is removed, readers or not: the cache is going away.
    yield* Effect.addFinalizer(() =>
      Effect.gen(function*() {
        const all = Option.match(yield* Ref.getAndSet(entries, Option.none()), {
          onNone: () => [],
          onSome: (map) => Array.from(HashMap.values(map))
        })
        yield* Effect.forEach(all, (entry) =>
          entry.lock.withPermits(1)(Effect.gen(function*() {
            yield* publish(entry, (s) => ({ ...s, status: { _tag: "Failed", error: closedError(entry.snapshotId) } }))
            const drop = yield* Ref.modify(entry.state, (s) => [!s.removed, { ...s, disposed: true, removed: true }] as const)
            if (drop) yield* cleanup(entry)
          })).pipe(Effect.catchAll((e) => Effect.logWarning("SnapshotCache: cleanup at shutdown failed", e))), { discard: true })
      })
    )

    return SnapshotCache.of({
      create,
      appendChunk,
      appendRange,
      markComplete,
      markFailed,
      retain,
      waitForChunk,
      stream,
      dispose,
      info,
      stats
    })
  })
