/**
 * A session's restore as the supervisor sends it to a new worker (docs/protocol.md section 6):
 * the latest complete transcript and the events logged after it, read through the daemon's own
 * storage layers (whatever they are: files, memory, a database) and streamed to the worker in
 * restore frames after its `load`. The worker never opens the state dir.
 *
 * Nothing is held whole and nothing is parsed here: a `restore_messages {count}` frame is
 * followed by `count` message lines exactly as the store holds them. When the store says where a
 * transcript's bytes are (`SessionStore.transcriptSource`, the file store) they are read in
 * pieces of about RESTORE_CHUNK_BYTES, cut at whole lines and written to the pipe as they are;
 * otherwise the store's lines are batched the same way. Each piece is written once the pipe has
 * room (its backpressure), so a 100 MB transcript is never one line nor one buffer.
 *
 * Owns: the restore read and its frames (no session field: it reads storage, and the session's
 * id, and writes only to the worker's pipe).
 */
import * as Data from "effect/Data"
import * as Deferred from "effect/Deferred"
import * as Effect from "effect/Effect"
import * as Option from "effect/Option"
import * as Stream from "effect/Stream"
import type { Cursor } from "../../Cursor.js"
import type { EventLogService } from "../../EventLog.js"
import type { RecoveryJournalService } from "../../RecoveryJournal.js"
import type { SessionStoreService, TranscriptSource } from "../../SessionStore.js"
import type { WorkerHandle } from "../../WorkerPool.js"
import * as WorkerProtocol from "../../WorkerProtocol.js"
import * as Fsx from "../fileIo.js"

/** What a restore reads from. */
export interface RestoreStorage {
  readonly store: SessionStoreService
  readonly log: EventLogService
  readonly journal: RecoveryJournalService
}

/** A restore could not be read (the transcript's bytes, or lines that are no message). */
export class RestoreReadError extends Data.TaggedError("RestoreReadError")<{ readonly message: string }> {}

/** Whether the journal says a turn was running: the restored worker then reports it cut. */
export const journalSaysBusy = (storage: RestoreStorage, activeSessionId: string): Effect.Effect<boolean> =>
  Effect.map(storage.journal.get(activeSessionId), (record) => Option.isSome(record) && record.value.busy)

/** Whitespace a line decoder drops a line of (space, \t, \v, \f, \r; \n ends the line). */
const isSpace = (byte: number) => byte === 0x20 || (byte >= 0x09 && byte <= 0x0d)

/**
 * Cuts bytes of JSON lines at whole lines and counts the lines a worker's line decoder will
 * yield (those that are not blank), without decoding them. A line whose first non-blank byte
 * is no printable ASCII character cannot be a JSON message (and the decoder might count it
 * otherwise): it is refused, before any of it is sent.
 */
export class LineCutter {
  /** Lines counted so far. */
  count = 0
  private held: Array<Uint8Array> = []
  /** The current line has something else than whitespace. */
  private content = false

  /** The whole lines completed by `piece` (with the pieces held before it), or none yet. */
  push(piece: Buffer): { readonly lines: number; readonly bytes: ReadonlyArray<Uint8Array> } | undefined | string {
    let pos = 0
    let lines = 0
    let cut = -1
    while (true) {
      const nl = piece.indexOf(0x0a, pos)
      const end = nl === -1 ? piece.length : nl
      if (!this.content) {
        let i = pos
        while (i < end && isSpace(piece[i]!)) i++
        if (i < end) {
          const first = piece[i]!
          if (first < 0x21 || first > 0x7e) return `a transcript line starts with byte 0x${first.toString(16)}, not a JSON value`
          this.content = true
        }
      }
      if (nl === -1) break
      if (this.content) lines++
      this.content = false
      pos = cut = nl + 1
    }
    if (cut === -1) {
      this.held.push(piece)
      return undefined
    }
    const bytes = [...this.held, piece.subarray(0, cut)]
    this.held = cut < piece.length ? [piece.subarray(cut)] : []
    this.count += lines
    return { lines, bytes }
  }

  /** The last line if it has no newline (one is added). */
  end(): { readonly lines: number; readonly bytes: ReadonlyArray<Uint8Array> } | undefined {
    const held = this.held
    this.held = []
    if (!this.content) return undefined
    this.content = false
    this.count++
    return { lines: 1, bytes: [...held, Buffer.from("\n")] }
  }
}

/** Gathers lines into frames of about RESTORE_CHUNK_BYTES and sends each when it is full. */
class Batcher {
  private lines: Array<string> = []
  private bytes = 0
  constructor(
    private readonly encode: (lines: ReadonlyArray<string>) => string,
    private readonly send: (data: string) => Effect.Effect<void>
  ) {}

  /** Adds a line (JSON text without a newline); sends the frame once it is full. */
  add(line: string): Effect.Effect<void> {
    this.lines.push(line)
    this.bytes += line.length
    return this.bytes >= WorkerProtocol.RESTORE_CHUNK_BYTES ? this.flush : Effect.void
  }

  readonly flush: Effect.Effect<void> = Effect.suspend(() => {
    if (this.lines.length === 0) return Effect.void
    const frame = this.encode(this.lines)
    this.lines = []
    this.bytes = 0
    return this.send(frame)
  })
}

/**
 * Streams the session's restore frames to `worker`, which was sent its `load` (with `restore`):
 * the messages of the latest transcript, the logged `session_event` records after it, then
 * `restore_end` with the message count. A read that fails sends `restore_failed` (the worker
 * reports it and is replaced, as a worker that failed to load always was); the failure is
 * returned too. A worker that dies meanwhile ends the reading.
 */
export const sendRestore = (storage: RestoreStorage, activeSessionId: string, worker: WorkerHandle) =>
  Effect.gen(function*() {
    const { log, store } = storage
    const untilGone = Stream.interruptWhen(Deferred.await(worker.exited))
    const latest = yield* store.latestSnapshot(activeSessionId)
    let messageCount = 0
    let after: Cursor | undefined
    if (Option.isSome(latest)) {
      after = latest.value.header.cursor
      const generation = latest.value.header.generation
      const source = yield* store.transcriptSource(activeSessionId, generation)
      if (Option.isSome(source)) {
        messageCount = yield* sendTranscriptBytes(source.value, worker, untilGone)
      } else {
        const messages = new Batcher(WorkerProtocol.encodeRestoreMessages, (data) => worker.sendRaw(data))
        yield* store.readSnapshotLines(activeSessionId, generation).pipe(
          untilGone,
          Stream.runForEach((line) => {
            messageCount++
            return messages.add(line)
          }),
          Effect.zipRight(messages.flush)
        )
      }
    }
    const events = new Batcher(WorkerProtocol.encodeRestoreEvents, (data) => worker.sendRaw(data))
    yield* log.read(activeSessionId, after).pipe(
      untilGone,
      // A log record holds the wire body; only a `session_event`'s agent event changes the transcript.
      Stream.filter((record) => record.event["type"] === "session_event"),
      Stream.runForEach((record) => events.add(record.json)),
      Effect.zipRight(events.flush)
    )
    yield* worker.send({ type: "restore_end", messageCount })
  }).pipe(
    Effect.tapError((error) => worker.send({ type: "restore_failed", message: error.message }))
  )

/** A transcript's bytes, cut at whole lines, each piece after the frame that counts its lines. */
const sendTranscriptBytes = (
  source: TranscriptSource,
  worker: WorkerHandle,
  untilGone: <A, E, R>(stream: Stream.Stream<A, E, R>) => Stream.Stream<A, E, R>
) =>
  Effect.gen(function*() {
    const cutter = new LineCutter()
    const send = (cut: { readonly lines: number; readonly bytes: ReadonlyArray<Uint8Array> }) =>
      Effect.gen(function*() {
        // Only blank lines: nothing a worker would take.
        if (cut.lines === 0) return
        yield* worker.sendRaw(WorkerProtocol.encodeFrame({ type: "restore_messages", count: cut.lines }))
        for (const bytes of cut.bytes) yield* worker.sendRaw(bytes)
      })
    yield* Stream.fromAsyncIterable(
      Fsx.byteRange(source.path, source.start, source.end, WorkerProtocol.RESTORE_CHUNK_BYTES),
      (cause) => new RestoreReadError({ message: new Fsx.FsError({ op: "read", path: source.path, cause }).message })
    ).pipe(
      untilGone,
      Stream.runForEach((piece) => {
        const cut = cutter.push(piece)
        if (typeof cut === "string") return new RestoreReadError({ message: `${source.path}: ${cut}` })
        return cut === undefined ? Effect.void : send(cut)
      })
    )
    const last = cutter.end()
    if (last !== undefined) yield* send(last)
    if (cutter.count !== source.messageCount && !(yield* Deferred.isDone(worker.exited))) {
      return yield* new RestoreReadError({
        message: `${source.path}: ${cutter.count} messages where the transcript's header says ${source.messageCount}`
      })
    }
    return cutter.count
  })
