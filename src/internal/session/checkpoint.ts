/**
 * A checkpoint, as the session's entity runs it: the worker streams its transcript as snapshot
 * frames into the snapshot cache; once complete, the transcript file is written from the cache
 * and the event log moves to the next generation in the same step of the entity; old
 * generations are pruned. Also the readers of the current generation's snapshot.
 */
import * as Deferred from "effect/Deferred"
import * as Effect from "effect/Effect"
import * as Either from "effect/Either"
import * as Option from "effect/Option"
import * as Stream from "effect/Stream"
import { randomUUID } from "node:crypto"
import type * as Protocol from "../../Protocol.js"
import type { AgentMessage } from "../../Protocol.js"
import { ChunkBuilder } from "../../SnapshotCache.js"
import type { WorkerHandle } from "../../WorkerPool.js"
import type { LoggedBody } from "../delivery/wireLines.js"
import type { AnyFrame, Phase } from "./phase.js"
import { type Core, CommandError, internal, READ_GATE_PERMITS, type Session, snapshotIdOf } from "./session.js"

/** Checkpoints: the worker's snapshot into the cache, the transcript file, the new generation, pruning. */
export const makeCheckpoints = (core: Core) => {
  const { cache, config, log, store, record } = core

  /** Asks the worker for its state: the first step of a checkpoint (the rest comes as frames). */
  const beginCheckpoint = (s: Session, worker: WorkerHandle) =>
    Effect.gen(function*() {
      const generation = s.generation + 1
      const snapshotId = snapshotIdOf(s, generation)
      const waiters = s.checkpointWaiters
      s.checkpointWaiters = []
      s.checkpointDue = false
      s.phase = { _tag: "Checkpointing", worker, snapshotId, generation, waiters, began: false }
      yield* record(s, false, "snapshot_begin")
      yield* worker.send({ type: "checkpoint", snapshotId, targetChunkBytes: config.targetChunkBytes })
    })

  /**
   * The worker's snapshot is complete in the cache: the transcript is written from it and the
   * log moves on to the new generation, in one step of the entity (no event can come between
   * the snapshot's cursor and the new generation).
   */
  const completeCheckpoint = (s: Session, phase: Extract<Phase, { _tag: "Checkpointing" }>) =>
    s.readGate.withPermits(READ_GATE_PERMITS)(Effect.gen(function*() {
      const { generation, snapshotId } = phase
      const snapshotCursor = s.lastCursor
      const messageCount = (yield* cache.info(snapshotId).pipe(Effect.mapError(internal("snapshot")))).meta.messageCount
      const written = yield* store.writeSnapshot(
        s.meta.activeSessionId,
        { snapshotId, generation, messageCount, ...(snapshotCursor === undefined ? {} : { cursor: snapshotCursor }) },
        entryMessages(snapshotId)
      ).pipe(Effect.mapError(internal("transcript")))
      yield* log.startGeneration(s.meta.activeSessionId).pipe(Effect.mapError(internal("event log")))
      const previous = s.snapshotId
      s.generation = generation
      s.snapshotCursor = snapshotCursor
      s.baseMessageCount = messageCount
      s.generationEvents = 0
      s.generationBytes = 0
      s.snapshotId = snapshotId
      if (previous !== undefined) yield* Effect.ignore(cache.dispose(previous))
      yield* record(s, false, "snapshot_end", written.path)
      const keepFrom = generation - config.retainGenerations + 1
      if (keepFrom > 1) {
        yield* Effect.ignoreLogged(log.prune(s.meta.activeSessionId, keepFrom))
        yield* Effect.ignoreLogged(store.pruneSnapshots(s.meta.activeSessionId, keepFrom))
      }
      return { generation, snapshotId }
    }))

  /** A checkpoint's snapshot that will not be completed: gone, so that a retry can take its id. */
  const discardSnapshot = (snapshotId: string, why: string) =>
    Effect.zipRight(Effect.ignore(cache.markFailed(snapshotId, why)), Effect.ignore(cache.dispose(snapshotId)))

  /** A snapshot frame of the running checkpoint; returns true when the checkpoint is over. */
  const snapshotFrame = (s: Session, phase: Extract<Phase, { _tag: "Checkpointing" }>, frame: AnyFrame) =>
    Effect.gen(function*() {
      if (frame["snapshotId"] !== phase.snapshotId) {
        yield* Effect.logWarning(`unexpected snapshot frame ${frame.type} from ${s.meta.activeSessionId}`)
        return false
      }
      const id = phase.snapshotId
      const outcome = yield* Effect.either(Effect.gen(function*(): Effect.fn.Return<{ generation: number; snapshotId: string } | undefined, CommandError> {
        switch (frame.type) {
          case "session_snapshot_begin":
            phase.began = true
            yield* cache.create(id, {
              activeSessionId: s.meta.activeSessionId,
              messageCount: frame["messageCount"] as number,
              targetChunkBytes: frame["targetChunkBytes"] as number,
              cursor: s.lastCursor
            }).pipe(Effect.mapError(internal("snapshot cache")))
            return undefined
          case "session_snapshot_chunk":
            yield* cache.appendChunk(id, Buffer.from(JSON.stringify(frame) + "\n")).pipe(Effect.mapError(internal("snapshot cache")))
            return undefined
          case "session_snapshot_end":
            yield* cache.markComplete(id, {
              chunkCount: frame["chunkCount"] as number,
              lastEventSequence: s.lastCursor?.sequence ?? -1,
              lastEventCursor: s.lastCursor
            }).pipe(Effect.mapError(internal("snapshot cache")))
            return yield* completeCheckpoint(s, phase)
          default:
            return yield* new CommandError({ code: "internal", message: `the worker could not snapshot: ${JSON.stringify(frame["error"])}` })
        }
      }))
      if (Either.isRight(outcome)) {
        const done = outcome.right
        if (done === undefined) return false
        s.phase = { _tag: "Idle", worker: phase.worker }
        for (const w of phase.waiters) yield* Deferred.succeed(w, done)
        return true
      }
      s.phase = { _tag: "Idle", worker: phase.worker }
      if (phase.began) yield* discardSnapshot(id, outcome.left.message)
      for (const w of phase.waiters) yield* Deferred.fail(w, outcome.left)
      return true
    })

  /** Chunks of a snapshot entry as the messages they hold. */
  const entryMessages = (snapshotId: string) =>
    cache.stream(snapshotId).pipe(
      Stream.mapConcat((bytes) => (JSON.parse(Buffer.from(bytes).toString("utf8")) as { messages: Array<unknown> }).messages)
    )

  /** The messages of the current generation's snapshot, read from its transcript file. */
  const snapshotLines = (s: Session): Stream.Stream<string, CommandError> =>
    s.generation === 1
      ? Stream.empty
      : store.readSnapshotLines(s.meta.activeSessionId, s.generation).pipe(Stream.mapError(internal("transcript")))

  /** Every message of the transcript: the snapshot, then the messages ended since. */
  const transcript = (s: Session): Stream.Stream<AgentMessage, CommandError> =>
    Stream.concat(
      Stream.map(snapshotLines(s), (line) => JSON.parse(line) as AgentMessage),
      log.readGeneration(s.meta.activeSessionId, s.generation).pipe(
        Stream.filterMap((r) => {
          const body = r.event as unknown as LoggedBody
          return body.type === "session_event" && body.event.type === "message_end"
            ? Option.some((body.event as Extract<Protocol.AgentEvent, { type: "message_end" }>).message)
            : Option.none()
        }),
        Stream.mapError(internal("event log"))
      )
    )

  /**
   * The current generation's snapshot in the cache: the entry the worker's checkpoint filled,
   * or one chunked now from the transcript file (after a restart), without reading it whole.
   */
  const currentSnapshotEntry = (s: Session) =>
    Effect.gen(function*() {
      const existing = s.snapshotId
      if (existing !== undefined) {
        const ok = yield* Effect.either(cache.info(existing))
        if (Either.isRight(ok) && !ok.right.disposed && ok.right.status !== "failed") return existing
      }
      const snapshotId = `${snapshotIdOf(s, s.generation)}~${randomUUID().slice(0, 8)}`
      yield* cache.create(snapshotId, {
        activeSessionId: s.meta.activeSessionId,
        messageCount: s.baseMessageCount,
        targetChunkBytes: config.targetChunkBytes,
        cursor: s.snapshotCursor
      }).pipe(Effect.mapError(internal("snapshot cache")))
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
        yield* cache.markComplete(snapshotId, {
          chunkCount: builder.chunkCount,
          lastEventSequence: s.snapshotCursor?.sequence ?? -1,
          lastEventCursor: s.snapshotCursor
        })
      }))
      if (Either.isLeft(filled)) {
        yield* Effect.ignore(cache.markFailed(snapshotId, filled.left.message))
        return yield* internal("snapshot")(filled.left)
      }
      if (existing !== undefined) yield* Effect.ignore(cache.dispose(existing))
      s.snapshotId = snapshotId
      return snapshotId
    })

  return { beginCheckpoint, discardSnapshot, snapshotFrame, snapshotLines, transcript, currentSnapshotEntry }
}

export type Checkpoints = ReturnType<typeof makeCheckpoints>
