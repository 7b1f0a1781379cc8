/**
 * A session's restore as the supervisor sends it to a new worker (docs/protocol.md section 6):
 * the latest complete transcript and the events logged after it, read through the daemon's own
 * storage layers (whatever they are: files, memory, a database) and streamed to the worker in
 * restore frames after its `load`. The worker never opens the state dir.
 *
 * Nothing is held whole: the transcript's messages go as the store's JSON lines, put into frames
 * of about RESTORE_CHUNK_BYTES without being parsed, each written once the worker's pipe has room
 * (its backpressure), so a 100 MB transcript is never one line nor one buffer.
 */
import * as Deferred from "effect/Deferred"
import * as Effect from "effect/Effect"
import * as Option from "effect/Option"
import * as Stream from "effect/Stream"
import type { Cursor } from "../../Cursor.js"
import type { EventLogService } from "../../EventLog.js"
import type { RecoveryJournalService } from "../../RecoveryJournal.js"
import type { SessionStoreService } from "../../SessionStore.js"
import type { WorkerHandle } from "../../WorkerPool.js"
import * as WorkerProtocol from "../../WorkerProtocol.js"

/** What a restore reads from. */
export interface RestoreStorage {
  readonly store: SessionStoreService
  readonly log: EventLogService
  readonly journal: RecoveryJournalService
}

/** Whether the journal says a turn was running: the restored worker then reports it cut. */
export const journalSaysBusy = (storage: RestoreStorage, activeSessionId: string): Effect.Effect<boolean> =>
  Effect.map(storage.journal.get(activeSessionId), (record) => Option.isSome(record) && record.value.busy)

/** Gathers encoded items into frames of about RESTORE_CHUNK_BYTES and sends each when it is full. */
class Batcher {
  private items: Array<string> = []
  private bytes = 0
  constructor(private readonly encode: (items: ReadonlyArray<string>) => string, private readonly send: (lines: string) => Effect.Effect<void>) {}

  add(item: string): void {
    this.items.push(item)
    this.bytes += item.length
  }

  get full(): boolean {
    return this.bytes >= WorkerProtocol.RESTORE_CHUNK_BYTES
  }

  readonly flush: Effect.Effect<void> = Effect.suspend(() => {
    if (this.items.length === 0) return Effect.void
    const frame = this.encode(this.items)
    this.items = []
    this.bytes = 0
    return this.send(frame)
  })
}

/**
 * Streams the session's restore frames to `worker`, which was sent its `load` (with `restore`):
 * the messages of the latest transcript, the agent events logged after it, then `restore_end`
 * with the message count. A read that fails sends `restore_failed` (the worker reports it and
 * is replaced, as a worker that failed to load always was); the failure is returned too.
 * Stops early, quietly, once the worker is gone.
 */
export const sendRestore = (storage: RestoreStorage, activeSessionId: string, worker: WorkerHandle) =>
  Effect.gen(function*() {
    const { log, store } = storage
    // A worker that dies meanwhile ends the reading: nobody is left to send it to.
    const untilGone = Stream.interruptWhen(Deferred.await(worker.exited))
    const latest = yield* store.latestSnapshot(activeSessionId)
    let messageCount = 0
    let after: Cursor | undefined
    if (Option.isSome(latest)) {
      after = latest.value.header.cursor
      const messages = new Batcher(WorkerProtocol.encodeRestoreMessages, (lines) => worker.sendRaw(lines))
      yield* store.readSnapshotLines(activeSessionId, latest.value.header.generation).pipe(
        untilGone,
        Stream.runForEachChunk((lines) =>
          Effect.gen(function*() {
            for (const line of lines) {
              messages.add(line)
              messageCount++
              if (messages.full) yield* messages.flush
            }
          })
        ),
        Effect.zipRight(messages.flush)
      )
    }
    const events = new Batcher(WorkerProtocol.encodeRestoreEvents, (lines) => worker.sendRaw(lines))
    yield* log.read(activeSessionId, after).pipe(
      untilGone,
      Stream.runForEachChunk((records) =>
        Effect.gen(function*() {
          for (const record of records) {
            // A log record holds the wire body (`session_event`, `session_status`, ...); the
            // agent event is inside a `session_event`.
            const body = record.event as { readonly type: string; readonly event?: unknown }
            if (body.type !== "session_event" || body.event === undefined) continue
            events.add(JSON.stringify(body.event))
            if (events.full) yield* events.flush
          }
        })
      ),
      Effect.zipRight(events.flush)
    )
    yield* worker.send({ type: "restore_end", messageCount })
  }).pipe(
    Effect.tapError((error) => worker.send({ type: "restore_failed", message: error.message }))
  )
