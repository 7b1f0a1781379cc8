/**
 * The daemon's one file I/O module: every `node:fs` call of src/ goes through here (or through
 * its synchronous part, ./fileIoSync.ts, for the command line, which must not load Effect).
 *
 * Paths and whole files go through `@effect/platform`'s FileSystem (the Node implementation of
 * `@effect/platform-node`, held here, so that callers' types carry no FileSystem requirement and
 * the storage layers are built and swapped as before): directories, stat, readdir, read,
 * rename, remove, chmod, realpath, and the atomic replacement (open, write, `File.sync`, rename,
 * directory sync). What FileSystem does not have stays on `node:fs`, here only: fdatasync,
 * positioned writes and reads on a descriptor with their own position (the event log's segments,
 * the append-only transcripts), the group commit's synchronous write(2) (a round trip through
 * libuv's pool cost ~0.8 ms per batch under load), `wx`/append opens with a mode returning a
 * Node FileHandle for async code (tools, the snapshot cache's spill reads), lstat, readdir with
 * entry types, and the streamed line and byte-range reads of 100 MB transcripts. The event
 * log's append path uses only the descriptor operations, so it is the same as before.
 *
 * One error type ({@link FsError}: the operation, the path, the Node error, also for a
 * FileSystem failure, whose Node error it unwraps); each layer maps it to its own error.
 * Everything private to the daemon is created 0700 (dirs) and 0600 (files): transcripts and
 * journals hold users' conversations.
 */
import { randomBytes } from "node:crypto"
import * as fs from "node:fs"
import { createReadStream } from "node:fs"
import * as fsp from "node:fs/promises"
import type { FileHandle } from "node:fs/promises"
import * as nodePath from "node:path"
import type { PlatformError } from "@effect/platform/Error"
import * as FileSystem from "@effect/platform/FileSystem"
import * as NodeFileSystem from "@effect/platform-node/NodeFileSystem"
import * as Data from "effect/Data"
import * as Effect from "effect/Effect"
import * as Exit from "effect/Exit"
import * as Option from "effect/Option"

/** Mode of every directory the daemon creates. */
export const DIR_MODE = 0o700

/** Mode of every file the daemon creates. */
export const FILE_MODE = 0o600

/** A failed file-system call: which operation, on which path, and the Node error. */
export class FsError extends Data.TaggedError("FsError")<{
  readonly op: string
  readonly path: string
  readonly cause: unknown
}> {
  /** The errno code (`ENOENT`, `EACCES`, ...) when the cause carries one. */
  get code(): string | undefined {
    return errnoCode(this.cause)
  }
  override get message(): string {
    const detail = this.cause instanceof Error ? this.cause.message : String(this.cause)
    return `${this.op} ${this.path}: ${detail}`
  }
}

/** The `code` of a Node system error, if any. */
export const errnoCode = (cause: unknown): string | undefined =>
  typeof cause === "object" && cause !== null && "code" in cause && typeof cause.code === "string"
    ? cause.code
    : undefined

/** True when the error is "no such file or directory". */
export const isNotFound = (error: FsError): boolean => error.code === "ENOENT"

let nodeFileSystem: FileSystem.FileSystem | undefined

/**
 * The Node FileSystem, built once, on first use (a bundle that uses none of this module's
 * FileSystem operations, the worker's, does not build it).
 */
const fileSystem = (): FileSystem.FileSystem =>
  nodeFileSystem ??= Effect.runSync(Effect.provide(FileSystem.FileSystem, NodeFileSystem.layer))

/** The Node error behind a FileSystem failure (so errno codes read as before), else the failure. */
const nodeCause = (error: PlatformError): unknown =>
  error._tag === "SystemError" && error.cause !== undefined ? error.cause : error

/** Runs one FileSystem operation; its failure becomes an {@link FsError} of `op` on `path`. */
const withFs = <A, R>(
  op: string,
  path: string,
  f: (fs: FileSystem.FileSystem) => Effect.Effect<A, PlatformError, R>
): Effect.Effect<A, FsError, R> =>
  Effect.suspend(() => f(fileSystem())).pipe(Effect.mapError((error) => new FsError({ op, path, cause: nodeCause(error) })))

/** Wraps one promise-returning fs call. */
export const attempt = <A>(op: string, path: string, f: () => Promise<A>): Effect.Effect<A, FsError> =>
  Effect.tryPromise({ try: f, catch: (cause) => new FsError({ op, path, cause }) })

/**
 * `mkdir -p` with mode 0700. Directories that already exist keep their mode: the daemon does not
 * take over a directory a user pointed it at.
 */
export const ensureDir = (path: string): Effect.Effect<void, FsError> =>
  withFs("mkdir", path, (fs) => fs.makeDirectory(path, { recursive: true, mode: DIR_MODE }))

/**
 * fsync a directory, which makes a rename, create or unlink inside it durable. Without it a
 * rename can be lost on power failure even though the file's own data was synced.
 */
export const fsyncDir = (path: string): Effect.Effect<void, FsError> =>
  withFs("fsync", path, (fs) => Effect.scoped(Effect.flatMap(fs.open(path, { flag: "r" }), (dir) => dir.sync)))

/**
 * Writes every byte (a single `write` may write fewer than asked), at the file's position or, if
 * given, at `position`.
 */
export const writeAll = (handle: FileHandle, path: string, data: string | Uint8Array, position?: number): Effect.Effect<void, FsError> =>
  attempt("write", path, async () => {
    const bytes = typeof data === "string" ? Buffer.from(data, "utf8") : data
    let offset = 0
    while (offset < bytes.byteLength) {
      const at = position === undefined ? null : position + offset
      const { bytesWritten } = await handle.write(bytes, offset, bytes.byteLength - offset, at)
      offset += bytesWritten
    }
  })

/** Writes every byte then fsyncs: once this succeeds, the data survives a crash. */
export const appendDurable = (
  handle: FileHandle,
  path: string,
  data: string | Uint8Array
): Effect.Effect<void, FsError> =>
  Effect.zipRight(writeAll(handle, path, data), attempt("fsync", path, () => handle.sync()))

/** Opens (creating 0600 if needed) a file for appending. */
export const openAppend = (path: string): Effect.Effect<FileHandle, FsError> =>
  attempt("open", path, () => fsp.open(path, "a", FILE_MODE))

/** Closes a handle, ignoring errors (there is nothing useful to do with them). */
export const closeQuietly = (handle: FileHandle): Effect.Effect<void> =>
  Effect.promise(() => handle.close().catch(() => undefined))

/** Unlinks a file, ignoring every error (best-effort cleanup of temp files). */
export const unlinkQuietly = (path: string): Effect.Effect<void> =>
  Effect.promise(() => fsp.unlink(path).catch(() => undefined))

/**
 * The temp file used while `path` is written: same directory (rename must not cross file
 * systems), a dot name ending in `.tmp` (readers list only final names), pid + random so two
 * writers never share one.
 */
export const tempPathFor = (path: string): string =>
  nodePath.join(
    nodePath.dirname(path),
    `.${nodePath.basename(path)}.${process.pid}.${randomBytes(4).toString("hex")}.tmp`
  )

/** True for a name produced by {@link tempPathFor}. */
export const isTempName = (name: string): boolean => name.startsWith(".") && name.endsWith(".tmp")

/**
 * Atomically replaces `path` with what `body` writes: temp file (0600, exclusive create), the
 * writes, fsync, close, rename over `path`, fsync the directory. A reader sees the old file or
 * the complete new one, never a prefix, even if the process dies at any point; a failure or an
 * interruption of `body` removes the temp file and leaves `path` untouched.
 *
 * `body` gets a `write` function rather than this module taking a Stream, so that callers that
 * only need small files (the journal, loaded by every worker) do not pay for loading Stream.
 */
export const writeAtomicWith = <E, R>(
  path: string,
  body: (write: (data: string | Uint8Array) => Effect.Effect<void, FsError>) => Effect.Effect<void, E, R>
): Effect.Effect<void, FsError | E, R> =>
  Effect.suspend(() => {
    const temp = tempPathFor(path)
    // The scope closes the file before the rename (a failed close of a synced file loses nothing).
    return Effect.scoped(Effect.gen(function*() {
      const file = yield* withFs("open", temp, (fs) => fs.open(temp, { flag: "wx", mode: FILE_MODE }))
      yield* body((data) =>
        withFs("write", temp, () => file.writeAll(typeof data === "string" ? Buffer.from(data, "utf8") : data))
      )
      yield* withFs("fsync", temp, () => file.sync)
    })).pipe(
      Effect.zipRight(rename(temp, path)),
      Effect.onExit((exit) => (Exit.isSuccess(exit) ? Effect.void : unlinkQuietly(temp))),
      Effect.zipRight(fsyncDir(nodePath.dirname(path)))
    )
  })

/** {@link writeAtomicWith} for data already in memory. */
export const writeFileAtomic = (path: string, data: string | Uint8Array): Effect.Effect<void, FsError> =>
  writeAtomicWith(path, (write) => write(data))

/** Reads a whole file as UTF-8; `None` when it does not exist. */
export const readFileIfExists = (path: string): Effect.Effect<Option.Option<string>, FsError> =>
  withFs("read", path, (fs) => fs.readFileString(path, "utf8")).pipe(
    Effect.map(Option.some),
    Effect.catchIf(isNotFound, () => Effect.succeed(Option.none()))
  )

/**
 * The lines of a file, lazily, in batches (one per 64 KiB read): the file is never held whole in
 * memory (transcripts reach 100 MB). Lines are split on `\n` bytes, which never occur inside a
 * multi-byte UTF-8 sequence, so decoding per line is exact; a trailing `\r` is dropped; the last
 * line is yielded even without a final `\n`. The file is closed when iteration ends, throws or
 * is abandoned (`return()`), which is what `Stream.fromAsyncIterable` does on interruption.
 * With `byteLength`, only that prefix of the file is read.
 */
export async function* lineBatches(path: string, byteLength?: number): AsyncGenerator<ReadonlyArray<string>> {
  if (byteLength === 0) return
  // `end` is inclusive: the first `byteLength` bytes (a prefix of an append-only file).
  const input = createReadStream(path, { highWaterMark: 64 * 1024, ...(byteLength === undefined ? {} : { end: byteLength - 1 }) })
  let pending: Array<Buffer> = []
  try {
    for await (const piece of input as AsyncIterable<Buffer>) {
      const lines: Array<string> = []
      let start = 0
      let newline = piece.indexOf(0x0a, start)
      while (newline !== -1) {
        const bytes = pending.length === 0
          ? piece.subarray(start, newline)
          : Buffer.concat([...pending, piece.subarray(start, newline)])
        pending = []
        lines.push(stripCr(bytes.toString("utf8")))
        start = newline + 1
        newline = piece.indexOf(0x0a, start)
      }
      if (start < piece.length) pending.push(piece.subarray(start))
      if (lines.length > 0) yield lines
    }
    if (pending.length > 0) yield [stripCr(Buffer.concat(pending).toString("utf8"))]
  } finally {
    input.destroy()
  }
}

const stripCr = (line: string): string => (line.endsWith("\r") ? line.slice(0, -1) : line)

/** The bytes `[start, end)` of a file, in pieces of about `chunkBytes`, as they are read. */
export async function* byteRange(path: string, start: number, end: number, chunkBytes: number): AsyncGenerator<Buffer> {
  if (end <= start) return
  // `end` is inclusive for createReadStream.
  const input = createReadStream(path, { start, end: end - 1, highWaterMark: chunkBytes })
  try {
    for await (const piece of input as AsyncIterable<Buffer>) yield piece
  } finally {
    input.destroy()
  }
}

/**
 * The first line of a file (without its `\n`), reading no more than `maxBytes`; `None` when the
 * file has no complete first line within that bound. Used to read a transcript's header without
 * touching its body.
 */
export const readFirstLine = (path: string, maxBytes = 1024 * 1024): Effect.Effect<Option.Option<string>, FsError> =>
  withFs("read", path, (fs) =>
    Effect.scoped(Effect.gen(function*() {
      // A fresh file reads from its start, each read after the last.
      const file = yield* fs.open(path, { flag: "r" })
      const pieces: Array<Buffer> = []
      let total = 0
      while (total < maxBytes) {
        const buffer = Buffer.alloc(Math.min(16 * 1024, maxBytes - total))
        const bytesRead = Number(yield* file.read(buffer))
        if (bytesRead === 0) return Option.none<string>()
        const piece = buffer.subarray(0, bytesRead)
        const newline = piece.indexOf(0x0a)
        if (newline !== -1) {
          pieces.push(piece.subarray(0, newline))
          return Option.some(stripCr(Buffer.concat(pieces).toString("utf8")))
        }
        pieces.push(piece)
        total += bytesRead
      }
      return Option.none<string>()
    })))


// ---------------------------------------------------------------------------------------------
// Paths
// ---------------------------------------------------------------------------------------------

export type { FileHandle }

/** Opens a file (a FileHandle: closed by {@link closeQuietly}). */
export const open = (path: string, flags: string | number, mode: number = FILE_MODE): Effect.Effect<FileHandle, FsError> =>
  attempt("open", path, () => fsp.open(path, flags, mode))

/** {@link open} as a promise, for code that is already inside an async function. */
export const openAsync = (path: string, flags: string | number = "r", mode: number = FILE_MODE): Promise<FileHandle> =>
  fsp.open(path, flags, mode)

/** realpath(3) as a promise, for code inside an async function. */
export const realpathAsync = (path: string): Promise<string> => fsp.realpath(path)

/** A directory's entries with their types, as a promise, for code inside an async function. */
export const readdirEntriesAsync = (path: string): Promise<Array<fs.Dirent>> => fsp.readdir(path, { withFileTypes: true })

/** The flags of an open for reading and writing that creates the file when missing. */
export const READ_WRITE_CREATE = fs.constants.O_RDWR | fs.constants.O_CREAT

/** The flags of an open for reading that refuses to follow a final symbolic link. */
export const READ_NO_FOLLOW = fs.constants.O_RDONLY | fs.constants.O_NOFOLLOW

/** stat(2), following links: FileSystem's `File.Info` (its `size` is a bigint). */
export const stat = (path: string): Effect.Effect<FileSystem.File.Info, FsError> => withFs("stat", path, (fs) => fs.stat(path))

/** lstat(2) (the link itself, not what it points at); `None` when nothing is there. */
export const lstat = (path: string): Effect.Effect<Option.Option<fs.Stats>, FsError> =>
  attempt("lstat", path, () => fsp.lstat(path)).pipe(
    Effect.map(Option.some),
    Effect.catchIf(isNotFound, () => Effect.succeed(Option.none()))
  )

/** Whether anything is at `path` (following links). */
export const exists = (path: string): Effect.Effect<boolean, FsError> => withFs("stat", path, (fs) => fs.exists(path))

export const readdir = (path: string): Effect.Effect<Array<string>, FsError> =>
  withFs("readdir", path, (fs) => Effect.map(fs.readDirectory(path), (names) => [...names]))

/** The entries of a directory; none when it does not exist. */
export const readdirOrEmpty = (path: string): Effect.Effect<Array<string>, FsError> =>
  readdir(path).pipe(Effect.catchIf(isNotFound, () => Effect.succeed<Array<string>>([])))

export const readFile = (path: string): Effect.Effect<Buffer, FsError> =>
  withFs("read", path, (fs) => Effect.map(fs.readFile(path), (bytes) => Buffer.from(bytes.buffer, bytes.byteOffset, bytes.byteLength)))

export const rename = (from: string, to: string): Effect.Effect<void, FsError> =>
  withFs("rename", `${from} -> ${to}`, (fs) => fs.rename(from, to))

export const unlink = (path: string): Effect.Effect<void, FsError> => withFs("unlink", path, (fs) => fs.remove(path))

export const chmod = (path: string, mode: number): Effect.Effect<void, FsError> => withFs("chmod", path, (fs) => fs.chmod(path, mode))

/** `rm -rf`: nothing there is not an error. */
export const removeTree = (path: string): Effect.Effect<void, FsError> =>
  withFs("rm", path, (fs) => fs.remove(path, { recursive: true, force: true }))

export const realpath = (path: string): Effect.Effect<string, FsError> => withFs("realpath", path, (fs) => fs.realPath(path))

/**
 * Creates `dir` (and missing parents) 0700 exactly: the umask may have removed bits (or an odd
 * one kept too few), so a directory this call created is chmod-ed; one that existed is left as
 * it is.
 */
export const mkdirPrivate = (dir: string): Effect.Effect<void, FsError> =>
  Effect.flatMap(exists(dir), (existed) => existed ? Effect.void : Effect.zipRight(ensureDir(dir), chmod(dir, DIR_MODE)))

// ---------------------------------------------------------------------------------------------
// Descriptors (numbers, the callback API: the event log's hot path)
// ---------------------------------------------------------------------------------------------

type Callback<A> = (err: NodeJS.ErrnoException | null, value: A) => void

const io = <A>(op: string, path: string, run: (cb: Callback<A>) => void): Effect.Effect<A, FsError> =>
  Effect.async<A, FsError>((resume) => {
    run((err, value) => resume(err === null ? Effect.succeed(value) : Effect.fail(new FsError({ op, path, cause: err }))))
  })

const unit = (cb: Callback<void>) => (err: NodeJS.ErrnoException | null) => cb(err, undefined)

const fdName = (fd: number) => `fd ${fd}`

export const fdOpen = (path: string, flags: string, mode: number = FILE_MODE): Effect.Effect<number, FsError> =>
  io<number>("open", path, (cb) => fs.open(path, flags, mode, cb))

/** Closes a descriptor; a failure to close is ignored (nothing is left to do about it). */
export const fdClose = (fd: number): Effect.Effect<void> => Effect.async<void>((resume) => fs.close(fd, () => resume(Effect.void)))

export const fdSync = (fd: number): Effect.Effect<void, FsError> => io<void>("fsync", fdName(fd), (cb) => fs.fsync(fd, unit(cb)))

export const fdDataSync = (fd: number): Effect.Effect<void, FsError> =>
  io<void>("fdatasync", fdName(fd), (cb) => fs.fdatasync(fd, unit(cb)))

export const fdTruncate = (fd: number, size: number): Effect.Effect<void, FsError> =>
  io<void>("ftruncate", fdName(fd), (cb) => fs.ftruncate(fd, size, unit(cb)))

export const fdSize = (fd: number): Effect.Effect<number, FsError> =>
  io<fs.Stats>("fstat", fdName(fd), (cb) => fs.fstat(fd, cb)).pipe(Effect.map((s) => s.size))

/** Reads up to `length` bytes at `position` into the start of `buffer`; the count read. */
export const fdRead = (fd: number, buffer: Buffer, length: number, position: number): Effect.Effect<number, FsError> =>
  io<number>("read", fdName(fd), (cb) => fs.read(fd, buffer, 0, length, position, cb))

/** Writes the whole buffer at `position` (write(2) may write less than asked). */
export const fdWriteAll = (fd: number, buffer: Buffer, position: number): Effect.Effect<void, FsError> =>
  Effect.suspend(() => {
    const loop = (offset: number): Effect.Effect<void, FsError> =>
      offset >= buffer.length
        ? Effect.void
        : io<number>("write", fdName(fd), (cb) => fs.write(fd, buffer, offset, buffer.length - offset, position + offset, cb)).pipe(
          Effect.flatMap((n) => loop(offset + n))
        )
    return loop(0)
  })

/**
 * Writes the whole buffer `make` returns at `position` with write(2) on the calling thread, and
 * returns its length; throws an FsError. For group commits: copying a batch into the page cache
 * takes microseconds, while a round trip through libuv's thread pool cost ~0.8 ms per batch under load (a third of the
 * cycle); the fdatasync, which does wait for the disk, stays on the pool. The buffer is made and
 * written in one synchronous step, so it may be a view of a scratch buffer that the next
 * synchronous section reuses (Utf8Batch.view).
 */
export const fdWriteAllNow = (
  fd: number,
  make: () => Buffer,
  position: number,
  written?: (buffer: Buffer) => void
): number => {
  const buffer = make()
  try {
    writeAllSyncRaw(fd, buffer, position)
  } catch (cause) {
    throw new FsError({ op: "write", path: fdName(fd), cause })
  }
  // Still the same synchronous step: a scratch buffer has not been reused yet.
  written?.(buffer)
  return buffer.length
}

// ---------------------------------------------------------------------------------------------
// Raw descriptor calls, outside Effect: the write-ahead log's group commit (one per tick for
// every session), which runs in node's callbacks, not in a fiber (../eventLog/writeAhead.ts)
// ---------------------------------------------------------------------------------------------

/** write(2) of the whole buffer at `position` on the calling thread; throws the Node error. */
export const writeAllSyncRaw = (fd: number, buffer: Uint8Array, position: number): void => {
  let offset = 0
  while (offset < buffer.length) offset += fs.writeSync(fd, buffer, offset, buffer.length - offset, position + offset)
}

/** ftruncate(2) on the calling thread; throws the Node error. */
export const truncateSyncRaw = (fd: number, size: number): void => fs.ftruncateSync(fd, size)

/** fdatasync(2) on libuv's pool; `done` gets the Node error or null. */
export const dataSyncRaw = (fd: number, done: (error: NodeJS.ErrnoException | null) => void): void => fs.fdatasync(fd, done)

/**
 * Opens `path` for reading, fdatasyncs it and closes it, for a file whose descriptor is gone;
 * `done` gets the open's error (its `syscall` is "open") or the fdatasync's, or null.
 */
export const dataSyncPathRaw = (path: string, done: (error: NodeJS.ErrnoException | null) => void): void =>
  fs.open(path, "r", (openError, fd) => {
    if (openError !== null) return done(openError)
    fs.fdatasync(fd, (syncError) => fs.close(fd, () => done(syncError)))
  })

/** {@link fsyncDir} on descriptors: makes a directory's entries durable. */
export const fdSyncDir = (dir: string): Effect.Effect<void, FsError> =>
  Effect.acquireUseRelease(fdOpen(dir, "r"), fdSync, fdClose)
