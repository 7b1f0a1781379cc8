/**
 * The per-session durable event log (docs/protocol.md sections 4 and 5).
 *
 * Every sequenced event of a session is appended here before anyone sees it: `append` assigns
 * the event's cursor (the one place cursors are assigned) and answers only once the record is on
 * disk. Replay, attach baselines and slow-client catch-up all read back from this log, lazily.
 *
 * This module holds the interface, the errors and the layers; the implementations live under
 * internal/eventLog/ (file: one segment file per generation, see its header for the format;
 * memory) and internal/postgres/, and share one append queue with group commit.
 *
 * @since 0.1.0
 */
import * as Context from "effect/Context"
import * as Data from "effect/Data"
import * as Effect from "effect/Effect"
import * as Either from "effect/Either"
import * as Layer from "effect/Layer"
import type * as Option from "effect/Option"
import type * as Scope from "effect/Scope"
import type * as Stream from "effect/Stream"
import type * as Tracer from "effect/Tracer"
import type * as Cursor from "./Cursor.js"
import * as FileEventLog from "./internal/eventLog/file.js"
import * as MemoryEventLog from "./internal/eventLog/memory.js"
import * as StateLayout from "./StateLayout.js"

// ---------------------------------------------------------------------------------------------
// Public types
// ---------------------------------------------------------------------------------------------

/** An event as the log sees it: an opaque JSON object (the supervisor gives it meaning). */
export type EventData = { readonly [key: string]: unknown }

/**
 * An event its caller already serialized: its text (`json`, or `parts` joined) must be the text
 * of one JSON object. The file layer writes it as it is, unchecked, so that a caller holding an
 * event's JSON (the supervisor, which receives events as JSON from its workers) does not parse
 * and serialize it again.
 *
 * The text may come in parts (a worker's event between the head and tail the supervisor adds),
 * which the file layer writes one after the other and never joins: a joined text is a new string
 * of the whole event, which V8 allocates and copies at each write, and for a large event (a 16 MB
 * message) that copy was most of what the daemon spent on it. A part is a string or UTF-8 bytes
 * (a worker's event as it came off its pipe, never decoded on the live path): a store reads
 * the text with `json`, or writes string parts as UTF-8 and byte parts as they are. A part of
 * bytes may be a view of a larger buffer (the pipe's chunk, up to 64 KB): a store that keeps
 * events after their append keeps their `json`, not these objects.
 */
export class EncodedEvent {
  readonly parts: ReadonlyArray<string | Uint8Array>
  private joined: string | undefined

  constructor(text: string | ReadonlyArray<string | Uint8Array>) {
    this.parts = typeof text === "string" ? [text] : text
    if (typeof text === "string") this.joined = text
  }

  /** The whole text, joined on first use (by the stores that keep it as one string). */
  get json(): string {
    return (this.joined ??= this.parts.map(partText).join(""))
  }

  /**
   * Whether the text starts with `prefix`, an ASCII string (read across the parts, without
   * joining them: a part of bytes is compared byte for character).
   */
  startsWith(prefix: string): boolean {
    let at = 0
    for (const part of this.parts) {
      const n = Math.min(part.length, prefix.length - at)
      if (typeof part === "string") {
        if (!part.startsWith(prefix.slice(at, at + n))) return false
      } else {
        for (let i = 0; i < n; i++) if (part[i] !== prefix.charCodeAt(at + i)) return false
      }
      at += n
      if (at === prefix.length) return true
    }
    return false
  }

  /**
   * The code unit at `index` of the text (NaN past its end), without joining the parts. A part
   * of bytes counts bytes: exact for an index within an ASCII start, which is how it is used.
   */
  charCodeAt(index: number): number {
    for (const part of this.parts) {
      if (index < part.length) return typeof part === "string" ? part.charCodeAt(index) : part[index]!
      index -= part.length
    }
    return NaN
  }
}

/** A part's text (bytes are UTF-8). */
const partText = (part: string | Uint8Array): string =>
  typeof part === "string" ? part : Buffer.from(part.buffer, part.byteOffset, part.byteLength).toString("utf8")

/** One logged event with the cursor the log assigned to it. */
export interface EventRecord {
  readonly cursor: Cursor.Cursor
  readonly event: EventData
  /** The event's JSON text as it was logged. */
  readonly json: string
}

/** A consistent view of one session's log, taken at one moment. */
export interface EventLogStatus {
  /** The current generation (1 for a session that has logged nothing yet). */
  readonly generation: number
  /** The last durable event of the session, in whatever generation it is. */
  readonly lastCursor: Option.Option<Cursor.Cursor>
  /** The retained generations, ascending; always ends with `generation`. */
  readonly generations: ReadonlyArray<number>
  /** How many events the current generation holds (drives automatic checkpoints). */
  readonly generationEvents: number
  /** How many bytes of event records the current generation holds (drives automatic checkpoints). */
  readonly generationBytes: number
}

/** Why an EventLog operation failed. */
export type EventLogErrorReason =
  /** The session id cannot name a directory (empty or too long). */
  | "InvalidSessionId"
  /** The event is not a JSON object, or cannot be serialized. */
  | "InvalidEvent"
  /** The generation asked for was never started or has been pruned. */
  | "GenerationNotFound"
  /** A segment on disk is not what this module writes. */
  | "Corrupt"
  /** The file system refused an operation. */
  | "Io"
  /** The session's log was removed, or the layer was closed, while the operation waited. */
  | "Closed"

/** A failure of the event log; `message` is a readable sentence. */
export class EventLogError extends Data.TaggedError("EventLogError")<{
  readonly reason: EventLogErrorReason
  readonly sessionId: string
  readonly message: string
  readonly cause?: unknown
}> {}

/**
 * Gives `service` its `appendAllNow`, not enumerable: a wrapper that spreads the service
 * (`{ ...log, appendAll }`) does not inherit it, so that its own `appendAll` sees every append.
 */
export const withAppendAllNow = (service: EventLogService, appendAllNow: EventLogService["appendAllNow"]): EventLogService => {
  if (appendAllNow !== undefined) Object.defineProperty(service, "appendAllNow", { value: appendAllNow, enumerable: false })
  return service
}

/** The operations of the event log. */
export interface EventLogService {
  /**
   * Appends one event to the session's current generation and returns its cursor once the record
   * is durable. Cursors are `{1, 0}` for a session's first event, then `sequence + 1` within a
   * generation. If the caller is interrupted while waiting, the event may still be logged.
   */
  readonly append: (sessionId: string, event: EventData | EncodedEvent) => Effect.Effect<Cursor.Cursor, EventLogError>
  /**
   * Appends several events as one unit: they get consecutive cursors in array order (no other
   * append falls between them), share one write and one fsync, and the call returns their cursors
   * once all are durable. If one event cannot be serialized, nothing is appended.
   */
  readonly appendAll: (
    sessionId: string,
    events: ReadonlyArray<EventData | EncodedEvent>
  ) => Effect.Effect<ReadonlyArray<Cursor.Cursor>, EventLogError>
  /**
   * Optional, for a caller on a hot path: `appendAll` done outside any fiber, when the store can
   * take the events at once (the session open, nothing of it queued or being written). Returns
   * their cursors and calls `done` once they are durable (`undefined`) or failed (the error);
   * `done` may be called before it returns, and must not throw. Returns the error of an event
   * that cannot be serialized (nothing appended, `done` not called), or `undefined` when it
   * cannot take them now (then call `appendAll`). `tracer` is the caller's fiber's: a traced
   * program takes `appendAll` (its writes are spans). Not enumerable ({@link withAppendAllNow}):
   * a wrapper that spreads the service and replaces `appendAll` does not inherit it, so it sees
   * every append; to keep the hot path, it forwards `appendAllNow` itself.
   */
  readonly appendAllNow?: (
    sessionId: string,
    events: ReadonlyArray<EventData | EncodedEvent>,
    tracer: Tracer.Tracer,
    done: (error: EventLogError | undefined) => void
  ) => ReadonlyArray<Cursor.Cursor> | EventLogError | undefined
  /**
   * The events strictly after `after` (all retained events when absent), in cursor order, across
   * generations, read lazily from disk. When some of them were pruned (checked as the read
   * reaches them, so a prune during the read is seen too) the stream fails with
   * `GenerationNotFound`, never skips them; a cursor at the very end of a pruned generation is
   * fine when the next retained generation starts right after it.
   * The stream ends at the last durable event it finds when it gets there.
   */
  readonly read: (sessionId: string, after?: Cursor.Cursor) => Stream.Stream<EventRecord, EventLogError>
  /** The events of one generation so far (the attach baseline); `GenerationNotFound` if not retained. */
  readonly readGeneration: (sessionId: string, generation: number) => Stream.Stream<EventRecord, EventLogError>
  /**
   * Starts generation g+1 (a new, empty, durable segment) and returns g+1; events appended after
   * this call get `{g+1, 0}`, `{g+1, 1}`, ...
   */
  readonly startGeneration: (sessionId: string) => Effect.Effect<number, EventLogError>
  /** The current generation (1 for a session that has logged nothing yet). */
  readonly currentGeneration: (sessionId: string) => Effect.Effect<number, EventLogError>
  /** The session's last durable event, if any. */
  readonly lastCursor: (sessionId: string) => Effect.Effect<Option.Option<Cursor.Cursor>, EventLogError>
  /** The retained generations, ascending (always including the current one). */
  readonly generations: (sessionId: string) => Effect.Effect<ReadonlyArray<number>, EventLogError>
  /**
   * Where the history stood when a retained generation began: the cursor of the last event
   * before it (none before generation 1's first event, or when its header cannot say);
   * `GenerationNotFound` when the generation is not retained. It outlives the generations
   * before it: the replay decision knows from it where a pruned generation ended.
   */
  readonly generationStart: (sessionId: string, generation: number) => Effect.Effect<Option.Option<Cursor.Cursor>, EventLogError>
  /** Generation, last cursor, retained generations and the size of the current generation at once. */
  readonly status: (sessionId: string) => Effect.Effect<EventLogStatus, EventLogError>
  /**
   * Deletes the segments of generations before `keepFromGeneration` (never the current one) and
   * returns the generations deleted.
   */
  readonly prune: (sessionId: string, keepFromGeneration: number) => Effect.Effect<ReadonlyArray<number>, EventLogError>
  /**
   * Closes and deletes the session's log, or moves its directory to `archiveTo` (a path that must
   * not exist yet, on the same file system). Appends still queued fail with `Closed`. The caller
   * must not use the session concurrently with `remove`; afterwards the id starts a fresh log.
   */
  readonly remove: (sessionId: string, options?: { readonly archiveTo?: string }) => Effect.Effect<void, EventLogError>
  /**
   * Repairs a damaged log (docs/protocol.md section 6, damaged sessions): every record before
   * the first one that is not what this module writes is kept; the rest of that segment and
   * every later segment are moved aside, next to them (`<g>.jsonl.damaged-<time>`), never
   * deleted. `None` when the log is whole. The caller must not use the session meanwhile.
   */
  readonly repair: (sessionId: string) => Effect.Effect<Option.Option<EventLogRepair>, EventLogError>
  /**
   * Drops what the log keeps in memory of the session (where its log stands, an open file),
   * failing appends still queued with `Closed`; its next use reads it again from the store. A
   * cluster runner calls it when a session leaves it and when one comes to it: another runner
   * may have written the session's log in between, and a stale position would write over it.
   */
  readonly forget: (sessionId: string) => Effect.Effect<void>
}

/** What {@link EventLogService.repair} moved aside. */
export interface EventLogRepair {
  /** The segment where the damage starts, and its first bad line (1-based). */
  readonly file: string
  readonly line: number
  /** The files the damaged bytes now live in, and how many bytes moved. */
  readonly movedTo: ReadonlyArray<string>
  readonly bytes: number
  /** A readable sentence saying all of it. */
  readonly message: string
}

/** The event log service. */
export class EventLog extends Context.Tag("agentd/EventLog")<EventLog, EventLogService>() {}

/**
 * A session id's directory name, StateLayout's one sanitizer ({@link StateLayout.safeSegment}:
 * injective, never a path separator, `.` or `..`); the empty id is refused.
 */
export const sanitizeSessionId = (sessionId: string): Either.Either<string, EventLogError> =>
  sessionId.length === 0
    ? Either.left(new EventLogError({ reason: "InvalidSessionId", sessionId, message: "session id is empty" }))
    : Either.right(StateLayout.safeSegment(sessionId))

// ---------------------------------------------------------------------------------------------
// Layers
// ---------------------------------------------------------------------------------------------

/** Where the file-backed log lives, and whether this process writes it. */
export interface EventLogOptions {
  readonly root: string
  /**
   * A reader in another process than the log's writer (a worker restoring its session while
   * the supervisor appends): segments are opened read-only, never repaired (a torn tail is the
   * writer's write in flight, and a `.tmp` segment the one it is creating), and every write
   * fails.
   */
  readonly readOnly?: boolean
  /**
   * Bytes a write-ahead file holds before the next commit starts a new one and the segments the
   * old one wrote to are fdatasynced (default 32 MiB; small values for tests of the rotation).
   */
  readonly writeAheadRotateBytes?: number
}

/**
 * Builds the file-backed service; its scope owns every open file and flusher fiber (group
 * commit: a session's batch is written to its segment, and acknowledged once the shared
 * write-ahead log's commit that holds it, one write and one fdatasync for every session's
 * batches of the moment, is durable).
 */
export const make = (options: EventLogOptions): Effect.Effect<EventLogService, EventLogError, Scope.Scope> =>
  FileEventLog.make(options)

/** The file-backed event log under `options.root` (created 0700 if missing). */
export const layer = (options: EventLogOptions): Layer.Layer<EventLog, EventLogError> =>
  Layer.scoped(EventLog, make(options))

/**
 * Where a segment's damage starts: the byte offset and 1-based number of its first line that is
 * not what the file layer writes; `undefined` when it is whole (see the file layer).
 */
export const firstDamage = (
  bytes: Buffer,
  generation: number,
  newest: boolean
): { readonly offset: number; readonly line: number } | undefined => FileEventLog.firstDamage(bytes, generation, newest)

/** Builds the in-memory service (same semantics, nothing durable): for tests of other modules. */
export const makeMemory: Effect.Effect<EventLogService> = Effect.suspend(() => MemoryEventLog.make)

/** An in-memory event log, for tests of the modules that use one. */
export const layerMemory: Layer.Layer<EventLog> = Layer.effect(EventLog, makeMemory)
