/**
 * Generations, as the session's entity moves through them: a checkpoint (between turns) appends
 * the messages the generation added to the transcript and starts the next generation in one
 * step; a history rewrite (an engine replaced its transcript during a turn) arrives from the
 * worker as snapshot frames, is written whole and starts the next generation at once. Old
 * generations are pruned. Also the readers of the current generation's snapshot.
 *
 * Owns: a session's generation fields (`generation`, `snapshotCursor`, `baseMessageCount`, the
 * counts reset at a new generation, `sessionFile`, `rewriteGeneration`), written only within a
 * step of its entity (the `RunCheckpoint`, `CheckpointIfGrown` and `RewriteFrame` actions and
 * the rewrite frames the entity hands over), under the whole read gate; the history rewrite
 * under way (`rewrites`); and each session's snapshot entry in the cache (`entries`), which
 * readers (attaches, resyncs) make when they first need it.
 */
import * as Cause from "effect/Cause"
import * as Deferred from "effect/Deferred"
import * as Effect from "effect/Effect"
import * as Either from "effect/Either"
import * as Exit from "effect/Exit"
import * as Option from "effect/Option"
import * as Stream from "effect/Stream"
import { randomUUID } from "node:crypto"
import type * as Protocol from "../../Protocol.js"
import type { Cursor } from "../../Cursor.js"
import type { AgentMessage } from "../../Protocol.js"
import { ChunkBuilder, chunkRanges } from "../../SnapshotCache.js"
import type { WorkerHandle } from "../../WorkerPool.js"
import type { SnapshotHeaderInput, SnapshotInfo } from "../../SessionStore.js"
import type { LoggedBody } from "../delivery/wireLines.js"
import type { AnyFrame, CheckpointReply } from "./mailbox.js"
import { type CoreError, CoreInternal, internal, unreadable } from "./errors.js"
import { type Core, READ_GATE_PERMITS, type Session, snapshotIdOf, storageAsUnavailable } from "./session.js"

/** The seam of generations: checkpoints and rewrites move a session to its next one. */
export interface Checkpoints {
  /** Takes a checkpoint between turns and answers `waiters` with its outcome. */
  readonly runCheckpoint: (s: Session, waiters: ReadonlyArray<CheckpointReply>) => Effect.Effect<void>
  /** A frame of the history rewrite the worker streams during a turn. */
  readonly rewriteFrame: (s: Session, worker: WorkerHandle, frame: AnyFrame) => Effect.Effect<void>
  /** A rewrite being streamed that will not be completed: its entry is gone. */
  readonly abandonRewrite: (s: Session, why: string) => Effect.Effect<void>
  /** The messages of the current generation's snapshot, as the transcript file holds them. */
  readonly snapshotLines: (s: Session) => Stream.Stream<string, CoreError>
  /** Every message of the transcript: the snapshot, then the messages ended since. */
  readonly transcript: (s: Session) => Stream.Stream<AgentMessage, CoreError>
  /** The current generation's snapshot entry in the cache (made when first needed). */
  readonly currentSnapshotEntry: (s: Session) => Effect.Effect<string, CoreError>
  /** The current generation's snapshot entry, if one was made. */
  readonly snapshotEntryOf: (s: Session) => string | undefined
  /** The session is gone: its snapshot entry goes too. */
  readonly disposeSnapshotEntry: (s: Session) => Effect.Effect<void>
}

/** Checkpoints: the transcript of the next generation, the log's new generation, pruning. */
export const makeCheckpoints = (core: Core): Checkpoints => {
  const { cache, config, log, store, record, recordBestEffort, fork } = core

  /**
   * Each session's current snapshot entry in the cache, if made: owned here (the entity moves
   * it to a new generation; readers, attaches and resyncs, make it when they first need it).
   */
  const entries = new WeakMap<Session, string>()
  /**
   * The history rewrite each session's worker is streaming, if any (the session's state says
   * only that one runs): where its snapshot goes in the cache and which generation it makes.
   */
  const rewrites = new WeakMap<Session, { readonly workerSnapshotId: string; readonly snapshotId: string; readonly generation: number }>()
  const setEntry = (s: Session, snapshotId: string | undefined) => {
    if (snapshotId === undefined) entries.delete(s)
    else entries.set(s, snapshotId)
  }

  /**
   * Takes a checkpoint in one step of the entity, between turns: the messages the current
   * generation added (its `message_end` events, read back from the log) are appended to the
   * transcript, and the log moves on to the new generation. Its cost is what the generation
   * added, whatever the transcript's size; no worker is involved (the log is what a worker
   * restores from, so it holds the same transcript). Answers every checkpoint waiting.
   */
  const runCheckpoint = (s: Session, waiters: ReadonlyArray<CheckpointReply>) =>
    Effect.gen(function*() {
      const outcome = yield* Effect.either(takeCheckpoint(s))
      if (Either.isLeft(outcome)) yield* Effect.logError(`checkpoint of ${s.meta.activeSessionId} failed: ${outcome.left.message}`)
      for (const w of waiters) yield* Deferred.complete(w, outcome)
    })

  const takeCheckpoint = (s: Session) =>
    nextGeneration(s, {
      busy: false,
      messageCount: s.messageCount,
      rewrittenAt: s.rewriteGeneration,
      write: (header) => store.appendSnapshot(s.meta.activeSessionId, header, generationMessages(s))
    })

  /**
   * Moves the session to its next generation in one step, under the whole read gate (no baseline
   * mixes two generations, no event comes between the snapshot's cursor and the generation):
   * the snapshot's transcript (`write`, given its header), the log's new generation, the
   * session's state, the journal, pruning. A rewrite (`rewrittenAt` is the new generation) also
   * has every attachment send its client the new snapshot before any later event.
   */
  const nextGeneration = <E extends { readonly message: string }>(
    s: Session,
    next: {
      readonly busy: boolean
      readonly messageCount: number
      readonly rewrittenAt: number | undefined
      /** The rewrite's cache entry, which becomes the generation's snapshot entry. */
      readonly snapshotId?: string
      readonly write: (header: SnapshotHeaderInput) => Effect.Effect<SnapshotInfo, E>
    }
  ) =>
    s.readGate.withPermits(READ_GATE_PERMITS)(Effect.gen(function*() {
      const id = s.meta.activeSessionId
      const generation = s.generation + 1
      const snapshotId = snapshotIdOf(s, generation)
      const snapshotCursor = s.lastCursor
      const { messageCount, rewrittenAt } = next
      // No journal, no checkpoint: it is refused before anything moves.
      yield* storageAsUnavailable(record(s, next.busy, "snapshot_begin"))
      const written = yield* next.write({
        snapshotId,
        generation,
        messageCount,
        ...(snapshotCursor === undefined ? {} : { cursor: snapshotCursor }),
        ...(rewrittenAt === undefined ? {} : { rewrittenAt })
      }).pipe(Effect.mapError(internal("transcript")))
      // A start reported failed may have happened all the same (the new segment was in place
      // when a later step of it failed: a file descriptor or the disk ran out), and the log then
      // appends to the new generation. The transcript is written, so the checkpoint is whole:
      // the session moves with the log, as a daemon start finishes such a checkpoint. (Left
      // behind, every later checkpoint read the old generation and failed, and a restore missed
      // what was logged since: chaos seed 41.)
      const started = yield* log.startGeneration(id).pipe(
        Effect.catchAll((e) => Effect.flatMap(log.currentGeneration(id), (now) => now === generation ? Effect.succeed(now) : Effect.fail(e))),
        Effect.mapError(internal("event log"))
      )
      if (started !== generation) {
        return yield* new CoreInternal({ message: `event log: the log is at generation ${started}, the session moves to ${generation}` })
      }
      yield* enterGeneration(s, { generation, snapshotCursor, messageCount, ...(next.snapshotId === undefined ? {} : { snapshotId: next.snapshotId }) })
      s.rewriteGeneration = rewrittenAt
      s.sessionFile = written.path
      // The generation is on disk already (the store is what restores it): a journal that
      // cannot say so is shown in `status`, and its next record names the new file.
      yield* recordBestEffort(s, next.busy, "snapshot_end")
      if (rewrittenAt === generation) for (const a of s.attachments) a.replaceState()
      yield* pruneBefore(s, generation)
      return { generation, snapshotId }
    }))

  /** The session's state moves to a new generation whose snapshot was just written. */
  const enterGeneration = (
    s: Session,
    next: { readonly generation: number; readonly snapshotCursor: Cursor | undefined; readonly messageCount: number; readonly snapshotId?: string }
  ) =>
    Effect.gen(function*() {
      const previous = entries.get(s)
      s.generation = next.generation
      s.snapshotCursor = next.snapshotCursor
      s.baseMessageCount = next.messageCount
      s.messageCount = next.messageCount
      s.generationEvents = 0
      s.generationBytes = 0
      // The snapshot's cache entry is made when a reader first needs it.
      setEntry(s, next.snapshotId)
      if (previous !== undefined) yield* Effect.ignore(cache.dispose(previous))
    })

  const pruneBefore = (s: Session, generation: number) =>
    Effect.gen(function*() {
      const keepFrom = generation - config.retainGenerations + 1
      if (keepFrom <= 1) return
      yield* Effect.ignoreLogged(log.prune(s.meta.activeSessionId, keepFrom))
      yield* Effect.ignoreLogged(store.pruneSnapshots(s.meta.activeSessionId, keepFrom))
    })

  /**
   * A frame of the history rewrite the worker streams during a turn (its engine replaced the
   * transcript): the snapshot goes into the cache under the next generation's id; at its end the
   * new generation starts at once, with that snapshot written whole, and every attached client
   * is sent it (purpose `replacement`). A rewrite that cannot be kept stops the worker: its
   * replacement restores the transcript the files hold, so the worker never differs from them.
   */
  const rewriteFrame = (s: Session, worker: WorkerHandle, frame: AnyFrame) =>
    Effect.gen(function*() {
      const id = s.meta.activeSessionId
      const rewrite = rewrites.get(s)
      const outcome = yield* Effect.either(Effect.gen(function*(): Effect.fn.Return<void, CoreError> {
        if (frame.type === "session_snapshot_begin") {
          if (rewrite !== undefined || frame["purpose"] !== "replacement") {
            return yield* new CoreInternal({ message: `unexpected ${frame.type} (purpose ${String(frame["purpose"])})` })
          }
          const generation = s.generation + 1
          const snapshotId = snapshotIdOf(s, generation)
          // An entry of that id left by an earlier failed attempt is gone first.
          yield* Effect.ignore(cache.dispose(snapshotId))
          yield* cache.create(snapshotId, {
            activeSessionId: id,
            messageCount: frame["messageCount"] as number,
            targetChunkBytes: frame["targetChunkBytes"] as number,
            cursor: s.lastCursor
          }).pipe(Effect.mapError(internal("snapshot cache")))
          rewrites.set(s, { workerSnapshotId: String(frame["snapshotId"]), snapshotId, generation })
          return
        }
        if (rewrite === undefined || frame["snapshotId"] !== rewrite.workerSnapshotId) {
          return yield* new CoreInternal({ message: `unexpected ${frame.type}` })
        }
        switch (frame.type) {
          case "session_snapshot_chunk":
            // Clients are sent the chunk as it is stored: under the supervisor's snapshot id.
            yield* cache.appendChunk(
              rewrite.snapshotId,
              Buffer.from(JSON.stringify({ ...frame, activeSessionId: id, snapshotId: rewrite.snapshotId }) + "\n")
            ).pipe(Effect.mapError(internal("snapshot cache")))
            return
          case "session_snapshot_end":
            yield* cache.markComplete(rewrite.snapshotId, {
              chunkCount: frame["chunkCount"] as number,
              lastEventSequence: s.lastCursor?.sequence ?? -1,
              lastEventCursor: s.lastCursor
            }).pipe(Effect.mapError(internal("snapshot cache")))
            rewrites.delete(s)
            return yield* completeRewrite(s, rewrite)
          default:
            return yield* new CoreInternal({ message: `the worker could not stream its rewrite: ${JSON.stringify(frame["error"])}` })
        }
      }))
      if (Either.isRight(outcome)) return
      yield* Effect.logError(`history rewrite of ${id} not kept: ${outcome.left.message}; its worker is stopped`)
      yield* abandonRewrite(s, outcome.left.message)
      worker.kill()
    })

  /** A rewrite being streamed that will not be completed: its entry is gone. */
  const abandonRewrite = (s: Session, why: string) =>
    Effect.gen(function*() {
      const rewrite = rewrites.get(s)
      rewrites.delete(s)
      if (rewrite === undefined) return
      yield* Effect.ignore(cache.markFailed(rewrite.snapshotId, why))
      yield* Effect.ignore(cache.dispose(rewrite.snapshotId))
    })

  const completeRewrite = (s: Session, rewrite: { readonly snapshotId: string; readonly generation: number }) =>
    Effect.gen(function*() {
      const { generation, snapshotId } = rewrite
      const messageCount = (yield* cache.info(snapshotId).pipe(Effect.mapError(internal("snapshot")))).meta.messageCount
      yield* nextGeneration(s, {
        busy: true,
        messageCount,
        rewrittenAt: generation,
        snapshotId,
        write: (header) => store.writeSnapshot(s.meta.activeSessionId, header, entryMessages(snapshotId))
      })
    })

  /** The messages the current generation added: its `message_end` events, from the log. */
  const generationMessages = (s: Session): Stream.Stream<AgentMessage, CoreError> =>
    log.readGeneration(s.meta.activeSessionId, s.generation).pipe(
      Stream.filterMap((r) => {
        const body = r.event as unknown as LoggedBody
        return body.type === "session_event" && body.event.type === "message_end"
          ? Option.some((body.event as Extract<Protocol.AgentEvent, { type: "message_end" }>).message)
          : Option.none()
      }),
      Stream.mapError(unreadable("the event log"))
    )

  /** Chunks of a snapshot entry as the messages they hold. */
  const entryMessages = (snapshotId: string) =>
    cache.stream(snapshotId).pipe(
      Stream.mapConcat((bytes) => (JSON.parse(Buffer.from(bytes).toString("utf8")) as { messages: Array<unknown> }).messages)
    )

  /** The messages of the current generation's snapshot, read from its transcript file. */
  const snapshotLines = (s: Session): Stream.Stream<string, CoreError> =>
    s.generation === 1
      ? Stream.empty
      : store.readSnapshotLines(s.meta.activeSessionId, s.generation).pipe(Stream.mapError(unreadable("the transcript")))

  /** Every message of the transcript: the snapshot, then the messages ended since. */
  const transcript = (s: Session): Stream.Stream<AgentMessage, CoreError> =>
    Stream.concat(Stream.map(snapshotLines(s), (line) => JSON.parse(line) as AgentMessage), generationMessages(s))

  /**
   * The current generation's snapshot in the cache: the entry the worker's checkpoint filled,
   * or one chunked now from the transcript file (after a restart), without reading it whole.
   */
  const currentSnapshotEntry = (s: Session) =>
    Effect.gen(function*() {
      const existing = entries.get(s)
      if (existing !== undefined) {
        const ok = yield* Effect.either(cache.info(existing))
        if (Either.isRight(ok) && !ok.right.disposed && ok.right.status !== "failed") return existing
      }
      // The generation's own id unless an entry of it is still around (failed, or disposed and
      // still read by someone): a new entry never shares an id with an old one.
      const plain = snapshotIdOf(s, s.generation)
      const taken = Either.isRight(yield* Effect.either(cache.info(plain)))
      const snapshotId = taken ? `${plain}~${randomUUID().slice(0, 8)}` : plain
      yield* cache.create(snapshotId, {
        activeSessionId: s.meta.activeSessionId,
        messageCount: s.baseMessageCount,
        targetChunkBytes: config.targetChunkBytes,
        cursor: s.snapshotCursor
      }).pipe(Effect.mapError(internal("snapshot cache")))
      const end = {
        lastEventSequence: s.snapshotCursor?.sequence ?? -1,
        lastEventCursor: s.snapshotCursor
      }
      const source = s.generation === 1
        ? Option.none()
        : yield* Effect.either(store.transcriptSource(s.meta.activeSessionId, s.generation)).pipe(Effect.map(Either.getOrElse(() => Option.none())))
      if (Option.isSome(source)) {
        // The chunks are ranges of the transcript file, found by a scan that runs while the first
        // readers already stream: nothing is copied, whatever the transcript's size.
        const { path, start, end: stop, messageCount } = source.value
        const fill = Effect.gen(function*() {
          const found = yield* chunkRanges(path, start, stop, config.targetChunkBytes, (range) => cache.appendRange(snapshotId, range))
          if (found.messages !== messageCount) {
            return yield* Effect.fail({ message: `${path} holds ${found.messages} messages, generation ${s.generation} says ${messageCount}` })
          }
          yield* cache.markComplete(snapshotId, { chunkCount: found.chunks, ...end })
        })
        yield* fork(fill.pipe(
          // Readers never wait for an entry whose fill stopped (a pruned file, an interruption).
          Effect.onExit((exit) =>
            Exit.isSuccess(exit) ? Effect.void : Effect.ignore(cache.markFailed(
              snapshotId,
              Option.match(Cause.failureOption(exit.cause), { onNone: () => "the snapshot could not be read", onSome: (e) => e.message })
            ))),
          Effect.catchAll((e) => Effect.logWarning(`snapshot ${snapshotId}: ${e.message}`))
        ))
      } else {
        yield* fillFromLines(s, snapshotId, end)
      }
      if (existing !== undefined) yield* Effect.ignore(cache.dispose(existing))
      setEntry(s, snapshotId)
      return snapshotId
    })

  /** Fills an entry from the transcript's lines (a store without files): chunked as they are read. */
  const fillFromLines = (s: Session, snapshotId: string, end: { readonly lastEventSequence: number; readonly lastEventCursor: Cursor | undefined }) =>
    Effect.gen(function*() {
      const builder = new ChunkBuilder(s.meta.activeSessionId, snapshotId, config.targetChunkBytes)
      const filled = yield* Effect.either(Effect.gen(function*() {
        yield* snapshotLines(s).pipe(
          Stream.runForEach((line) => {
            const chunk = builder.add(line)
            return chunk === undefined ? Effect.void : Effect.asVoid(cache.appendChunk(snapshotId, chunk))
          })
        )
        const last = builder.finish()
        if (last !== undefined) yield* cache.appendChunk(snapshotId, last)
        yield* cache.markComplete(snapshotId, { chunkCount: builder.chunkCount, ...end })
      }))
      if (Either.isLeft(filled)) {
        yield* Effect.ignore(cache.markFailed(snapshotId, filled.left.message))
        return yield* internal("snapshot")(filled.left)
      }
    })

  const disposeSnapshotEntry = (s: Session) =>
    Effect.suspend(() => {
      const entry = entries.get(s)
      entries.delete(s)
      return entry === undefined ? Effect.void : Effect.ignore(cache.dispose(entry))
    })

  return {
    runCheckpoint,
    rewriteFrame,
    abandonRewrite,
    snapshotLines,
    transcript,
    currentSnapshotEntry,
    snapshotEntryOf: (s) => entries.get(s),
    disposeSnapshotEntry
  }
}
