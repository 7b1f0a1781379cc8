/**
 * The session store on disk (the public module, ../../SessionStore.ts, holds its interface):
 * session metadata and transcript (snapshot) files.
 *
 * Layout under `root` (normally the state dir), every directory 0700 and every file 0600:
 * ```
 * sessions/<sanitized id>/meta.json                 SessionMeta, replaced atomically
 * sessions/<sanitized id>/snapshots/<g>.jsonl       transcript of generation g (its header, or whole)
 * sessions/<sanitized id>/transcripts/<e>.jsonl     append-only messages shared by generations e, e+1, ...
 * archive/<sanitized id>-<timestamp>/               a killed session, moved there whole
 * ```
 * A generation's file starts with a header line `{"type":"snapshot_header",snapshotId,
 * generation,cursor?,messageCount,transcript?,rewrittenAt?}`. Written whole
 * ({@link SessionStoreService.writeSnapshot}, a history rewrite) the messages follow it, one
 * (opaque JSON) per line. Written as an extension of the previous generation
 * ({@link SessionStoreService.appendSnapshot}, every ordinary checkpoint) the file is the header
 * alone and `transcript: {epoch, bytes}` says that the messages are the first `bytes` bytes of
 * `transcripts/<epoch>.jsonl`: a checkpoint appends only the new messages there, so it costs
 * what changed, not the size of the transcript. Bytes below a published length never change.
 *
 * Every header is written to a temp file, fsynced and renamed (after the messages it names are
 * synced), so a file with a final name is always complete: the recovery journal may name it as
 * `sessionFile` and a restoring worker may trust it. Transcripts can be 100 MB, so writing and
 * reading are streamed and never hold a whole file in memory. Pruning a generation removes its
 * file, and an append-only transcript once no retained generation reads it.
 *
 * The paths are StateLayout's. Session ids come from the wire: they are turned into a single
 * path segment by {@link StateLayout.safeSegment} (injective, so ids never collide, and `..`/`/`
 * cannot escape `root`).
 * `env` and `launchEnv` are not part of {@link SessionMeta} and are never written.
 */
import * as nodePath from "node:path"
import * as Clock from "effect/Clock"
import * as Effect from "effect/Effect"
import * as Either from "effect/Either"
import { identity } from "effect/Function"
import * as Option from "effect/Option"
import * as ParseResult from "effect/ParseResult"
import * as Stream from "effect/Stream"
import {
  type Options,
  type SessionListing,
  SessionMeta,
  SessionNotFound,
  SessionStore,
  SessionStoreError,
  type SessionStoreService,
  SnapshotHeader,
  type SnapshotHeaderInput,
  type SnapshotInfo,
  type TranscriptSource
} from "../../SessionStore.js"
import * as StateLayout from "../../StateLayout.js"
import * as Fsx from "../fileIo.js"
import {
  appendBase, byCreation, checkCount, cleanMeta, compactTimestamp, countLines, countMismatch, decodeHeaderJson, decodeMetaJson, encodeMessages, frame, GENERATION_FILE, makeHeader, parseLines, pathsOf, snapshotNotFound, TEMP_GENERATION
} from "./shared.js"

const ioError = (activeSessionId: string | undefined) => (error: Fsx.FsError): SessionStoreError =>
  new SessionStoreError({
    reason: "Io",
    detail: error.message,
    ...(activeSessionId !== undefined ? { activeSessionId } : {}),
    path: error.path,
    cause: error.cause
  })


/** The store on disk under `options.root`, which is created 0700 if missing. */
export const make = (options: Options): Effect.Effect<SessionStoreService, SessionStoreError> =>
  Effect.gen(function*() {
    const root = nodePath.resolve(options.root)
    const paths = pathsOf(root)
    yield* Fsx.ensureDir(paths.sessions).pipe(Effect.mapError(ioError(undefined)))
    // Metadata writes check-then-write; serializing them makes `create` reliably exclusive.
    const metaLock = yield* Effect.makeSemaphore(1)

    const exists = (path: string) =>
      Fsx.stat(path).pipe(
        Effect.as(true),
        Effect.catchIf(Fsx.isNotFound, () => Effect.succeed(false))
      )

    const requireSession = (id: string): Effect.Effect<void, SessionNotFound | SessionStoreError> =>
      exists(paths.metaFile(id)).pipe(
        Effect.mapError(ioError(id)),
        Effect.flatMap((found) => (found ? Effect.void : Effect.fail(new SessionNotFound({ activeSessionId: id }))))
      )

    const writeMeta = (meta: SessionMeta) =>
      Effect.gen(function*() {
        const clean = yield* cleanMeta(meta)
        yield* Fsx.writeFileAtomic(paths.metaFile(meta.activeSessionId), JSON.stringify(clean, null, 2) + "\n").pipe(
          Effect.mapError(ioError(meta.activeSessionId))
        )
      })

    const create = Effect.fn("SessionStore.create")(function*(meta: SessionMeta) {
      yield* metaLock.withPermits(1)(Effect.gen(function*() {
        const id = meta.activeSessionId
        if (yield* exists(paths.metaFile(id)).pipe(Effect.mapError(ioError(id)))) {
          return yield* new SessionStoreError({ reason: "AlreadyExists", detail: "session id already in use", activeSessionId: id })
        }
        yield* Fsx.ensureDir(paths.sessionDir(id)).pipe(
          // The new directory's entry must be durable before anything inside it matters.
          Effect.zipRight(Fsx.fsyncDir(paths.sessions)),
          Effect.mapError(ioError(id))
        )
        yield* writeMeta(meta)
      }))
    })

    const saveMeta = Effect.fn("SessionStore.saveMeta")(function*(meta: SessionMeta) {
      yield* metaLock.withPermits(1)(Effect.zipRight(requireSession(meta.activeSessionId), writeMeta(meta)))
    })

    const readMetaFile = (id: string, path: string): Effect.Effect<Option.Option<SessionMeta>, SessionStoreError> =>
      Fsx.readFileIfExists(path).pipe(
        Effect.mapError(ioError(id)),
        Effect.flatMap(Option.match({
          onNone: () => Effect.succeed(Option.none()),
          onSome: (text) => {
            const decoded = decodeMetaJson(text)
            return Either.isRight(decoded)
              ? Effect.succeed(Option.some(decoded.right))
              : Effect.fail(
                new SessionStoreError({
                  reason: "Corrupt",
                  detail: `invalid ${path}: ${ParseResult.TreeFormatter.formatErrorSync(decoded.left)}`,
                  activeSessionId: id,
                  path
                })
              )
          }
        }))
      )

    const loadMeta = Effect.fn("SessionStore.loadMeta")(function*(id: string) {
      const found = yield* readMetaFile(id, paths.metaFile(id))
      if (Option.isNone(found)) return yield* new SessionNotFound({ activeSessionId: id })
      return found.value
    })

    const list = Effect.fn("SessionStore.list")(function*() {
      const names = yield* Fsx.readdir(paths.sessions).pipe(
        Effect.catchIf(Fsx.isNotFound, () => Effect.succeed<Array<string>>([])),
        Effect.mapError(ioError(undefined))
      )
      const metas: Array<SessionMeta> = []
      const unreadable: Array<SessionListing> = []
      for (const name of names) {
        if (name.startsWith(".")) continue
        const id = StateLayout.segmentId(name)
        const path = nodePath.join(paths.sessions, name, "meta.json")
        const found = yield* Effect.either(readMetaFile(name, path))
        if (Either.isRight(found) && Option.isSome(found.right)) metas.push(found.right.value)
        else if (id === undefined) yield* Effect.logWarning(`session store: ${name} names no session; left alone`)
        else unreadable.push({ _tag: "Unreadable", activeSessionId: id, reason: Either.isLeft(found) ? found.left.detail : `${path} is missing` })
      }
      return [...metas.sort(byCreation).map((meta): SessionListing => ({ _tag: "Loaded", meta })), ...unreadable]
    })

    const writeSnapshotLines = <E = never, R = never>(
      id: string,
      input: SnapshotHeaderInput,
      lines: Stream.Stream<string | Uint8Array, E, R>
    ): Effect.Effect<SnapshotInfo, SessionNotFound | SessionStoreError | E, R> =>
      Effect.gen(function*() {
        const header = yield* makeHeader(id, input)
        yield* requireSession(id)
        yield* Fsx.ensureDir(paths.snapshotsDir(id)).pipe(Effect.mapError(ioError(id)))
        const path = paths.snapshotFile(id, header.generation)
        yield* Fsx.writeAtomicWith(path, (write) => Stream.runForEach(frame(id, header, lines), write)).pipe(
          Effect.mapError((e) => (e instanceof Fsx.FsError ? ioError(id)(e) : e))
        )
        return { header, path }
      }).pipe(Effect.withSpan("SessionStore.writeSnapshot", { attributes: { activeSessionId: id } }))

    const writeSnapshot = <E = never, R = never>(
      id: string,
      header: SnapshotHeaderInput,
      messages: Stream.Stream<unknown, E, R> | Iterable<unknown>
    ): Effect.Effect<SnapshotInfo, SessionNotFound | SessionStoreError | E, R> =>
      writeSnapshotLines(id, header, encodeMessages(id, messages))

    /** The header of a generation's transcript; `SnapshotNotFound` when it has none. */
    const headerOf = (id: string, generation: number): Effect.Effect<SnapshotHeader, SessionStoreError> => {
      const path = paths.snapshotFile(id, generation)
      return readHeader(id, path).pipe(
        Effect.catchIf((e) => Fsx.errnoCode(e.cause) === "ENOENT", () =>
          Effect.fail(snapshotNotFound(id, generation, path))),
        Effect.flatMap(Option.match({
          onNone: () => Effect.fail(new SessionStoreError({ reason: "Corrupt", detail: `invalid header in ${path}`, activeSessionId: id, path })),
          onSome: Effect.succeed
        }))
      )
    }

    const appendSnapshot = <E = never, R = never>(
      id: string,
      input: SnapshotHeaderInput,
      messages: Stream.Stream<unknown, E, R> | Iterable<unknown>
    ): Effect.Effect<SnapshotInfo, SessionNotFound | SessionStoreError | E, R> =>
      Effect.gen(function*() {
        const { base, baseGeneration, copied, epoch, requested } = yield* appendBase(id, input, requireSession, headerOf, identity)
        const start = base?.transcript?.bytes ?? 0
        const file = paths.transcriptFile(id, epoch)
        yield* Fsx.ensureDir(paths.transcriptsDir(id)).pipe(Effect.mapError(ioError(id)))
        const body = copied
          ? Stream.concat(Stream.map(readSnapshotLines(id, baseGeneration), (line) => line + "\n"), encodeMessages(id, messages))
          : encodeMessages(id, messages)
        // Written after the base's bytes (anything beyond them is the leftover of a write that
        // never got its header), then cut there, synced, and only then published by the header.
        const { bytes, count } = yield* Effect.acquireUseRelease(
          Fsx.open(file, Fsx.READ_WRITE_CREATE),
          (handle) =>
            Effect.gen(function*() {
              const { size } = yield* Fsx.attempt("stat", file, () => handle.stat())
              if (size < start) {
                return yield* new SessionStoreError({
                  reason: "Corrupt",
                  detail: `${file} holds ${size} bytes, generation ${baseGeneration} says ${start}`,
                  activeSessionId: id,
                  path: file
                })
              }
              let position = start
              let count = 0
              yield* Stream.runForEach(body, (text) => {
                const data = Buffer.from(text, "utf8")
                return Fsx.writeAll(handle, file, data, position).pipe(Effect.tap(() => {
                  position += data.byteLength
                  count += countLines(text)
                }))
              })
              yield* Fsx.attempt("truncate", file, () => handle.truncate(position))
              yield* Fsx.attempt("fsync", file, () => handle.datasync())
              return { bytes: position, count }
            }),
          Fsx.closeQuietly
        ).pipe(Effect.mapError((e) => (e instanceof Fsx.FsError ? ioError(id)(e) : e)))
        const total = (copied ? 0 : base?.messageCount ?? 0) + count
        if (total !== requested.messageCount) return yield* countMismatch(id, requested, total)
        // The transcript file's own entry is durable before a header names it.
        if (start === 0) yield* Fsx.fsyncDir(paths.transcriptsDir(id)).pipe(Effect.mapError(ioError(id)))
        const header: SnapshotHeader = { ...requested, transcript: { epoch, bytes } }
        const path = paths.snapshotFile(id, header.generation)
        yield* Fsx.ensureDir(paths.snapshotsDir(id)).pipe(
          Effect.zipRight(Fsx.writeFileAtomic(path, JSON.stringify(header) + "\n")),
          Effect.mapError(ioError(id))
        )
        return { header, path }
      }).pipe(Effect.withSpan("SessionStore.appendSnapshot", { attributes: { activeSessionId: id } }))

    const generationsOf = (id: string) =>
      Fsx.readdir(paths.snapshotsDir(id)).pipe(
        Effect.catchIf(Fsx.isNotFound, () => Effect.succeed<Array<string>>([])),
        Effect.mapError(ioError(id))
      )

    const readHeader = (id: string, path: string): Effect.Effect<Option.Option<SnapshotHeader>, SessionStoreError> =>
      Fsx.readFirstLine(path).pipe(
        Effect.mapError(ioError(id)),
        Effect.map(Option.flatMap((line) => Either.getRight(decodeHeaderJson(line))))
      )

    const latestSnapshot = Effect.fn("SessionStore.latestSnapshot")(function*(id: string) {
      yield* requireSession(id)
      const generations = (yield* generationsOf(id))
        .flatMap((name) => {
          const match = GENERATION_FILE.exec(name)
          return match?.[1] === undefined ? [] : [Number(match[1])]
        })
        .sort((a, b) => b - a)
      for (const generation of generations) {
        const path = paths.snapshotFile(id, generation)
        const header = yield* readHeader(id, path).pipe(
          Effect.catchIf((e) => e.cause !== undefined && Fsx.errnoCode(e.cause) === "ENOENT", () => Effect.succeed(Option.none()))
        )
        if (Option.isSome(header) && header.value.generation === generation) {
          return Option.some<SnapshotInfo>({ header: header.value, path })
        }
        yield* Effect.logWarning(`session store: ignoring unreadable transcript ${path}`)
      }
      return Option.none<SnapshotInfo>()
    })

    function readSnapshotLines(id: string, generation: number): Stream.Stream<string, SessionNotFound | SessionStoreError> {
      return Stream.unwrap(Effect.gen(function*() {
        yield* requireSession(id)
        const header = yield* headerOf(id, generation)
        const path = header.transcript === undefined
          ? paths.snapshotFile(id, generation)
          : paths.transcriptFile(id, header.transcript.epoch)
        const body = Stream.fromAsyncIterable(
          Fsx.lineBatches(path, header.transcript?.bytes),
          (cause) => ioError(id)(new Fsx.FsError({ op: "read", path, cause }))
        ).pipe(
          Stream.flattenIterables,
          Stream.drop(header.transcript === undefined ? 1 : 0),
          Stream.filter((line) => line.trim().length > 0)
        )
        return checkCount(id, path, header, body)
      }))
    }

    const readSnapshot = (id: string, generation: number): Stream.Stream<unknown, SessionNotFound | SessionStoreError> =>
      parseLines(id, paths.snapshotFile(id, generation), readSnapshotLines(id, generation))

    const checkTranscript = Effect.fn("SessionStore.checkTranscript")(function*(id: string, generation: number) {
      const source = yield* transcriptSource(id, generation)
      if (Option.isNone(source) || source.value.end === source.value.start) return
      const { path, end } = source.value
      const last = yield* Effect.acquireUseRelease(
        Fsx.open(path, "r"),
        (file) =>
          Fsx.attempt("read", path, async () => {
            const size = (await file.stat()).size
            const byte = Buffer.alloc(1)
            if (size >= end) await file.read(byte, 0, 1, end - 1)
            return { size, byte: byte[0] }
          }),
        Fsx.closeQuietly
      ).pipe(Effect.mapError(ioError(id)))
      const corrupt = (detail: string) => new SessionStoreError({ reason: "Corrupt", detail: `${path}: ${detail}`, activeSessionId: id, path })
      if (last.size < end) return yield* corrupt(`holds ${last.size} bytes, generation ${generation}'s transcript needs ${end}`)
      if (last.byte !== 0x0a) return yield* corrupt(`generation ${generation}'s transcript does not end with a whole line`)
    })

    const transcriptSource = Effect.fn("SessionStore.transcriptSource")(function*(id: string, generation: number) {
      yield* requireSession(id)
      const header = yield* headerOf(id, generation)
      if (header.transcript !== undefined) {
        return Option.some<TranscriptSource>({
          path: paths.transcriptFile(id, header.transcript.epoch),
          start: 0,
          end: header.transcript.bytes,
          messageCount: header.messageCount
        })
      }
      // Written whole: the messages follow the header line, to the end of the file.
      const path = paths.snapshotFile(id, generation)
      const size = yield* Fsx.stat(path).pipe(
        Effect.map((st) => Number(st.size)),
        Effect.mapError(ioError(id))
      )
      const firstLine = yield* Fsx.readFirstLine(path).pipe(Effect.mapError(ioError(id)))
      const headerBytes = Option.match(firstLine, { onNone: () => size, onSome: (line) => Buffer.byteLength(line) + 1 })
      return Option.some<TranscriptSource>({ path, start: Math.min(headerBytes, size), end: size, messageCount: header.messageCount })
    })

    const pruneSnapshots = Effect.fn("SessionStore.pruneSnapshots")(function*(id: string, keepFromGeneration: number) {
      yield* requireSession(id)
      const dir = paths.snapshotsDir(id)
      const removed: Array<number> = []
      for (const name of yield* generationsOf(id)) {
        const final = GENERATION_FILE.exec(name)?.[1]
        // Temp files of old generations are leftovers of a crashed writer.
        const temp = TEMP_GENERATION.exec(name)?.[1]
        const generation = Number(final ?? temp ?? Number.NaN)
        if (!(generation < keepFromGeneration)) continue
        yield* Fsx.unlink(nodePath.join(dir, name)).pipe(
          Effect.catchIf(Fsx.isNotFound, () => Effect.void),
          Effect.mapError(ioError(id))
        )
        if (final !== undefined) removed.push(generation)
      }
      if (removed.length > 0) yield* Fsx.fsyncDir(dir).pipe(Effect.mapError(ioError(id)))
      // An append-only transcript goes with the last generation that reads it.
      const referenced = new Set<number>()
      for (const name of yield* generationsOf(id)) {
        const generation = Number(GENERATION_FILE.exec(name)?.[1] ?? Number.NaN)
        if (!(generation >= keepFromGeneration)) continue
        const header = yield* Effect.option(headerOf(id, generation))
        if (Option.isSome(header) && header.value.transcript !== undefined) referenced.add(header.value.transcript.epoch)
      }
      const transcripts = paths.transcriptsDir(id)
      const names = yield* Fsx.readdir(transcripts).pipe(
        Effect.catchIf(Fsx.isNotFound, () => Effect.succeed<Array<string>>([])),
        Effect.mapError(ioError(id))
      )
      for (const name of names) {
        const epoch = Number(GENERATION_FILE.exec(name)?.[1] ?? TEMP_GENERATION.exec(name)?.[1] ?? Number.NaN)
        if (!(epoch < keepFromGeneration) || referenced.has(epoch)) continue
        yield* Fsx.unlinkQuietly(nodePath.join(transcripts, name))
      }
      return removed.sort((a, b) => a - b)
    })

    const archive = Effect.fn("SessionStore.archive")(function*(id: string) {
      return yield* metaLock.withPermits(1)(Effect.gen(function*() {
        const source = paths.sessionDir(id)
        if (!(yield* exists(source).pipe(Effect.mapError(ioError(id))))) {
          return yield* new SessionNotFound({ activeSessionId: id })
        }
        yield* Fsx.ensureDir(paths.archive).pipe(Effect.mapError(ioError(id)))
        const base = paths.archiveDir(id, compactTimestamp(yield* Clock.currentTimeMillis))
        // The same id can be created and archived twice within one millisecond.
        let target = base
        for (let n = 1; yield* exists(target).pipe(Effect.mapError(ioError(id))); n++) {
          target = `${base}-${n}`
        }
        const destination = target
        yield* Fsx.rename(source, destination).pipe(
          Effect.zipRight(Fsx.fsyncDir(paths.sessions)),
          Effect.zipRight(Fsx.fsyncDir(paths.archive)),
          Effect.mapError(ioError(id))
        )
        return destination
      }))
    })

    return SessionStore.of({
      create,
      saveMeta,
      loadMeta,
      list,
      writeSnapshot,
      writeSnapshotLines,
      appendSnapshot,
      latestSnapshot,
      readSnapshot,
      readSnapshotLines,
      transcriptSource,
      checkTranscript,
      snapshotPath: paths.snapshotFile,
      pruneSnapshots,
      archive
    })
  })
