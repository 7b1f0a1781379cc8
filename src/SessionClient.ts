/**
 * Following one session (docs/protocol.md sections 4-5): a {@link SessionClient} attaches to a
 * session, reassembles the attach, `resync` and `replacement` snapshots (chunked or inline),
 * folds the snapshot and the events into the session's state (its transcript, the message being
 * streamed, busy, the worker's state, the last cursor), and emits every sequenced event once, in
 * cursor order, as a `Stream`. When the connection drops or the daemon restarts, it reconnects
 * on a `Schedule` and resumes from its last cursor (dropping anything at or before it); a
 * `partial` or `unavailable` replay gives a new baseline, which replaces the state.
 *
 * ```ts
 * const follower = yield* SessionClient.make({ socketPath, activeSessionId: id })
 * yield* follower.events.pipe(Stream.runForEach((e) => Console.log(e.type)))
 * const { messages } = follower.current()
 * ```
 *
 * Positions. Two cursors are kept: the fold's (the last event folded, or the cursor of the last
 * snapshot taken as a baseline: what a resume starts after) and the consumer's (the last event
 * emitted). They differ only when the client starts from a given `cursor` (or a persisted one):
 * its state is then rebuilt from a fresh baseline (snapshot + the current generation's events),
 * and only the events after that cursor are emitted.
 *
 * Persistence (`persistPath`): the consumer's cursor is written there (JSON, 0600, temp file +
 * fsync + rename), coalesced while a write is in flight and once more when the stream ends. The
 * transcript is not written: a new process rebuilds it from the daemon's baseline, which is
 * the same work a first attach does, and emits only the events after the persisted cursor. If
 * that cursor is older than the baseline's snapshot (its generation was checkpointed since),
 * the events between the two are not re-emitted one by one: the `baseline` event says so
 * (`skipped: true`).
 *
 * Loads only the protocol's modules and `DaemonClient`, never the daemon's.
 */
import * as Data from "effect/Data"
import * as Duration from "effect/Duration"
import * as Effect from "effect/Effect"
import * as Either from "effect/Either"
import * as Fiber from "effect/Fiber"
import * as Queue from "effect/Queue"
import * as Schedule from "effect/Schedule"
import * as Schema from "effect/Schema"
import * as Stream from "effect/Stream"
import * as fs from "node:fs"
import * as path from "node:path"
import * as Cursor from "./Cursor.js"
import { type ConnectError, DaemonClient, isDaemonShutdown, type RequestError } from "./DaemonClient.js"
import type * as Protocol from "./Protocol.js"

// ---------------------------------------------------------------------------------------------
// What a follower emits
// ---------------------------------------------------------------------------------------------

/** Why a snapshot replaced the follower's state. */
export type BaselinePurpose = "attach" | "resync" | "replacement"

/**
 * A snapshot became the follower's state (the first attach, a resync after the events it
 * lacked were pruned, a history rewrite): `messages` is the transcript at `cursor` (absent: the
 * session's start); the events after it follow.
 */
export interface Baseline {
  readonly type: "baseline"
  readonly activeSessionId: string
  readonly purpose: BaselinePurpose
  readonly snapshotId: string
  readonly cursor?: Cursor.Cursor | undefined
  readonly messages: ReadonlyArray<Protocol.AgentMessage>
  /**
   * True when events after the consumer's last cursor and at or before `cursor` exist that
   * will not be emitted (they are inside the snapshot): a resync, a rewrite, or a start from a
   * cursor older than the current generation.
   */
  readonly skipped: boolean
}

/** What {@link SessionClientService.events} emits: every sequenced message once, and baselines. */
export type FollowEvent = Protocol.SessionEvent | Protocol.SessionStatus | Protocol.SessionClosed | Baseline

/** The folded state of a session, as its follower knows it. */
export interface SessionState {
  readonly activeSessionId: string
  /** The transcript: the baseline's messages, then each `message_end`'s message. A live view. */
  readonly messages: ReadonlyArray<Protocol.AgentMessage>
  /** The message being streamed (from `message_start`, its `message_update` deltas appended). */
  readonly streaming: Protocol.AgentMessage | undefined
  /** Whether a turn runs (from the latest `session_status` or `session_attached`). */
  readonly busy: boolean
  /** The worker's state (ditto); undefined before the first attach. */
  readonly worker: Protocol.WorkerState | undefined
  /** The latest summary the daemon sent. */
  readonly summary: Protocol.SessionSummary | undefined
  /** The fold's position: the last event folded, or the last baseline's snapshot cursor. */
  readonly lastCursor: Cursor.Cursor | undefined
  /** The last event emitted to the consumer (what is persisted). */
  readonly emittedCursor: Cursor.Cursor | undefined
  /** Whether a baseline has been received (before it, `messages` is empty and means nothing). */
  readonly hasBaseline: boolean
  /** The `session_closed` reason, once closed. */
  readonly closed: string | undefined
  /**
   * The error of the latest turn when it ended failed (its `agent_end` carried an `error`: the
   * model endpoint failed; its last assistant message has `isError`). Cleared when a turn
   * starts; undefined after a baseline (the transcript's `isError` messages still say it).
   */
  readonly turnError: Protocol.TurnFailure | undefined
}

// ---------------------------------------------------------------------------------------------
// Errors
// ---------------------------------------------------------------------------------------------

/** The daemon could not stream a snapshot (`session_snapshot_failed`): the follower attaches again. */
export class SnapshotFailed extends Data.TaggedError("SnapshotFailed")<{
  readonly activeSessionId: string
  readonly snapshotId: string
  readonly error: Protocol.ErrorBody
  readonly message: string
}> {}

/**
 * The daemon broke a promise of the protocol on this follower's stream (an event out of cursor
 * order or with a gap, a frame out of place, a snapshot whose chunks do not add up). Not
 * retried: the follower's state can no longer be trusted.
 */
export class SessionProtocolViolation extends Data.TaggedError("SessionProtocolViolation")<{
  readonly activeSessionId: string
  readonly message: string
}> {}

/**
 * The daemon stopped gracefully (it said `daemon_closing`, or refused the attach
 * `shutting_down`) and the follower was not asked to wait for a restart
 * (`waitForRestart`): the follow ends with this rather than reconnect to a daemon that may
 * never come back.
 */
export class DaemonShutDown extends Data.TaggedError("DaemonShutDown")<{
  readonly activeSessionId: string
  readonly message: string
}> {}

/** Why a follower stopped. */
export type SessionClientError = ConnectError | RequestError | SnapshotFailed | SessionProtocolViolation | DaemonShutDown

/**
 * The errors a follower reconnects after: the daemon unreachable or gone (restarting), a
 * failed snapshot stream, a daemon shutting down or failing internally.
 */
export const isRetriable = (e: SessionClientError): boolean =>
  // A daemon that refused the connection with a 4xx (a wrong token: 401) refuses it again.
  (e._tag === "DaemonUnreachable" && !(e.status !== undefined && e.status >= 400 && e.status < 500)) ||
  e._tag === "DaemonDisconnected" || e._tag === "SnapshotFailed" ||
  (e._tag === "DaemonError" && (e.code === "shutting_down" || e.code === "internal"))

// ---------------------------------------------------------------------------------------------
// The fold (pure, no I/O)
// ---------------------------------------------------------------------------------------------

interface Assembling {
  readonly purpose: BaselinePurpose
  readonly snapshotId: string
  readonly cursor: Cursor.Cursor | undefined
  readonly messageCount: number
  readonly messages: Array<Protocol.AgentMessage>
  chunks: number
}

/**
 * One follower's view of one session across its connections: takes the attach results and the
 * daemon's pushed messages in wire order, and returns what to emit. Pure; exported for tests.
 */
export class SessionFold implements SessionState {
  messages: Array<Protocol.AgentMessage> = []
  streaming: Protocol.AgentMessage | undefined = undefined
  summary: Protocol.SessionSummary | undefined = undefined
  lastCursor: Cursor.Cursor | undefined = undefined
  emittedCursor: Cursor.Cursor | undefined
  hasBaseline = false
  closed: string | undefined = undefined
  turnError: Protocol.TurnFailure | undefined = undefined
  private assembling: Assembling | undefined = undefined
  /** A snapshot a dropped connection was in the middle of (its chunks so far), to resume. */
  private cutOff: Assembling | undefined = undefined
  /** Whether `session_attached` came on this connection (events may flow). */
  private flowing = false
  /** The cursor of the last status folded. */
  private statusCursor: Cursor.Cursor | undefined = undefined

  /** `from`: emit only events after it (the consumer has seen the rest). */
  constructor(readonly activeSessionId: string, from?: Cursor.Cursor) {
    this.emittedCursor = from
  }

  get busy(): boolean {
    return this.summary?.busy ?? false
  }

  get worker(): Protocol.WorkerState | undefined {
    return this.summary?.worker
  }

  /** A plain copy of the state (the transcript array is shared, not copied). */
  snapshot(): SessionState {
    return {
      activeSessionId: this.activeSessionId,
      messages: this.messages,
      streaming: this.streaming,
      busy: this.busy,
      worker: this.worker,
      summary: this.summary,
      lastCursor: this.lastCursor,
      emittedCursor: this.emittedCursor,
      hasBaseline: this.hasBaseline,
      closed: this.closed,
      turnError: this.turnError
    }
  }

  /**
   * A new connection is about to attach: the cursor to resume from (none: a baseline is needed),
   * and the snapshot the last connection was cut off in, to continue from its next chunk.
   */
  attaching(): { readonly resumeCursor?: Cursor.Cursor; readonly snapshotResume?: { readonly snapshotId: string; readonly fromChunk: number } } {
    const cut = this.assembling
    this.assembling = undefined
    this.cutOff = cut !== undefined && cut.chunks > 0 ? cut : undefined
    this.flowing = false
    return {
      ...(this.hasBaseline && this.lastCursor !== undefined ? { resumeCursor: this.lastCursor } : {}),
      ...(this.cutOff === undefined ? {} : { snapshotResume: { snapshotId: this.cutOff.snapshotId, fromChunk: this.cutOff.chunks } })
    }
  }

  /** The attach response: an inline baseline, if it carries one. */
  attached(result: Protocol.DaemonAttachResult): Either.Either<ReadonlyArray<FollowEvent>, SessionProtocolViolation> {
    // The daemon continues the cut-off snapshot only when it streams that one again.
    if (result.snapshotStream?.id !== this.cutOff?.snapshotId) this.cutOff = undefined
    if (result.replay.status === "complete") {
      if (!this.hasBaseline) return Either.left(this.violation("a complete replay for an attach without a resume cursor"))
      return Either.right([])
    }
    if (result.snapshotStream !== undefined) return Either.right([])
    const snapshot = result.snapshot
    if (snapshot.messages.length !== snapshot.messageCount) {
      return Either.left(this.violation(`an inline snapshot of ${snapshot.messageCount} messages carries ${snapshot.messages.length}`))
    }
    return Either.right([this.baseline(purposeOf(result.replay), snapshot.snapshotId, snapshot.cursor, snapshot.messages)])
  }

  /** Any pushed message (others' sessions are ignored). */
  receive(m: Protocol.PushMessage): Either.Either<ReadonlyArray<FollowEvent>, SessionProtocolViolation | SnapshotFailed> {
    if (m.type === "daemon_closing" || m.activeSessionId !== this.activeSessionId) return Either.right([])
    switch (m.type) {
      case "session_attached":
        if (this.assembling !== undefined) return Either.left(this.violation("session_attached inside a snapshot"))
        this.flowing = true
        this.summary = m.state
        return Either.right([])
      case "session_snapshot_begin": {
        if (this.assembling !== undefined) return Either.left(this.violation(`snapshot ${m.snapshotId} begins inside ${this.assembling.snapshotId}`))
        if (m.purpose === "checkpoint") return Either.left(this.violation("a snapshot with purpose checkpoint"))
        const cut = this.cutOff
        this.cutOff = undefined
        if (cut !== undefined && cut.snapshotId === m.snapshotId) {
          // Resumed: its chunks continue from the one after those already here.
          this.assembling = cut
          return Either.right([])
        }
        this.assembling = {
          purpose: m.purpose,
          snapshotId: m.snapshotId,
          cursor: m.cursor,
          messageCount: m.messageCount,
          messages: [],
          chunks: 0
        }
        return Either.right([])
      }
      case "session_snapshot_chunk": {
        const a = this.assembling
        if (a === undefined || a.snapshotId !== m.snapshotId) return Either.left(this.violation(`chunk of ${m.snapshotId} outside its snapshot`))
        if (m.index !== a.chunks) return Either.left(this.violation(`chunk ${m.index} of ${m.snapshotId}, expected ${a.chunks}`))
        a.chunks++
        for (const message of m.messages) a.messages.push(message)
        return Either.right([])
      }
      case "session_snapshot_end": {
        const a = this.assembling
        if (a === undefined || a.snapshotId !== m.snapshotId) return Either.left(this.violation(`end of ${m.snapshotId} outside its snapshot`))
        if (m.chunkCount !== a.chunks) return Either.left(this.violation(`${m.snapshotId} ends after ${m.chunkCount} chunks, ${a.chunks} came`))
        if (a.messages.length !== a.messageCount) {
          return Either.left(this.violation(`${m.snapshotId} announced ${a.messageCount} messages, ${a.messages.length} came`))
        }
        this.assembling = undefined
        return Either.right([this.baseline(a.purpose, a.snapshotId, a.cursor, a.messages)])
      }
      case "session_snapshot_failed":
        this.assembling = undefined
        return Either.left(
          new SnapshotFailed({
            activeSessionId: this.activeSessionId,
            snapshotId: m.snapshotId,
            error: m.error,
            message: `the daemon could not stream snapshot ${m.snapshotId} (${m.error.code}: ${m.error.message})`
          })
        )
      default:
        return this.sequenced(m)
    }
  }

  private sequenced(
    m: Protocol.SessionEvent | Protocol.SessionStatus | Protocol.SessionClosed
  ): Either.Either<ReadonlyArray<FollowEvent>, SessionProtocolViolation> {
    const c = m.meta.cursor
    if (this.assembling !== undefined) return Either.left(this.violation(`event ${Cursor.format(c)} inside snapshot ${this.assembling.snapshotId}`))
    if (!this.flowing) return Either.left(this.violation(`event ${Cursor.format(c)} before session_attached`))
    if (!this.hasBaseline) return Either.left(this.violation(`event ${Cursor.format(c)} before any baseline`))
    const last = this.lastCursor
    // At or before the fold's position: already folded (a replay that overlaps).
    if (last !== undefined && !Cursor.isAfter(c, last)) return Either.right([])
    const follows = last === undefined
      ? c.sequence === 0
      : (c.generation === last.generation && c.sequence === last.sequence + 1) || (c.generation > last.generation && c.sequence === 0)
    if (!follows) return Either.left(this.violation(`event ${Cursor.format(c)} does not follow ${last === undefined ? "the session's start" : Cursor.format(last)}`))
    this.fold(m)
    if (this.emittedCursor !== undefined && !Cursor.isAfter(c, this.emittedCursor)) return Either.right([])
    this.emittedCursor = c
    return Either.right([m])
  }

  /**
   * The session's summary as `get_state` read it after a `resync` or `replacement` that came in
   * the middle of the stream: its snapshot may hold the statuses since the last one folded (the
   * idle status of a turn, say), and no `session_attached` follows it to say the state. Taken
   * unless a status newer than it was folded meanwhile (like an attach's `state`, it may be
   * ahead of the events still to come, whose statuses are folded in their turn).
   */
  refreshed(summary: Protocol.SessionSummary): void {
    const at = summary.lastEventCursor
    if (this.statusCursor !== undefined && (at === undefined || Cursor.isAfter(this.statusCursor, at))) return
    this.summary = summary
  }

  private fold(m: Protocol.SessionEvent | Protocol.SessionStatus | Protocol.SessionClosed): void {
    this.lastCursor = m.meta.cursor
    if (m.type === "session_status") {
      this.summary = m.state
      this.statusCursor = m.meta.cursor
      return
    }
    if (m.type === "session_closed") {
      this.closed = m.reason
      return
    }
    const e = m.event
    switch (e.type) {
      case "message_start":
        this.streaming = e.message
        return
      case "message_update":
        if (this.streaming !== undefined && this.streaming.id === e.messageId) {
          this.streaming = { ...this.streaming, content: this.streaming.content + e.delta }
        }
        return
      case "message_end":
        this.messages.push(e.message)
        this.streaming = undefined
        return
      case "agent_start":
        this.turnError = undefined
        return
      case "turn_interrupted":
        this.streaming = undefined
        this.turnError = undefined
        return
      case "agent_end":
        this.streaming = undefined
        this.turnError = e.error
        return
      default:
        return
    }
  }

  private baseline(
    purpose: BaselinePurpose,
    snapshotId: string,
    cursor: Cursor.Cursor | undefined,
    messages: ReadonlyArray<Protocol.AgentMessage>
  ): Baseline {
    const emitted = this.emittedCursor
    // Events after what the consumer saw and inside the snapshot are not emitted one by one.
    const skipped = cursor !== undefined && (emitted === undefined ? this.hasBaseline : Cursor.isAfter(cursor, emitted))
    this.messages = [...messages]
    this.streaming = undefined
    this.turnError = undefined
    this.lastCursor = cursor
    this.hasBaseline = true
    if (cursor !== undefined && (emitted === undefined || Cursor.isAfter(cursor, emitted))) this.emittedCursor = cursor
    return { type: "baseline", activeSessionId: this.activeSessionId, purpose, snapshotId, cursor, messages, skipped }
  }

  private violation(what: string): SessionProtocolViolation {
    return new SessionProtocolViolation({ activeSessionId: this.activeSessionId, message: `session ${this.activeSessionId}: ${what}` })
  }
}

const purposeOf = (replay: Protocol.Replay): BaselinePurpose =>
  replay.reason === "transcript_replaced" ? "replacement" : replay.status === "partial" ? "resync" : "attach"

// ---------------------------------------------------------------------------------------------
// Persisted cursor
// ---------------------------------------------------------------------------------------------

const PersistedCursor = Schema.Struct({
  version: Schema.Literal(1),
  activeSessionId: Schema.String,
  cursor: Schema.optionalWith(Cursor.Cursor, { exact: true })
})
const decodePersisted = Schema.decodeUnknownEither(Schema.parseJson(PersistedCursor))

/** A persisted cursor file could not be read or written. */
export class CursorFileError extends Data.TaggedError("CursorFileError")<{
  readonly path: string
  readonly message: string
}> {}

/**
 * Reads a cursor file written by a follower of `activeSessionId`: the cursor, or undefined when
 * the file does not exist. A file of another session, or not a cursor file, is an error.
 */
export const readCursorFile = (file: string, activeSessionId: string): Effect.Effect<Cursor.Cursor | undefined, CursorFileError> =>
  Effect.gen(function*() {
    const text = yield* Effect.try({
      try: () => fs.readFileSync(file, "utf8"),
      catch: (e) => new CursorFileError({ path: file, message: `cannot read ${file}: ${String(e)}` })
    }).pipe(Effect.catchIf((e) => !fs.existsSync(file) && e._tag === "CursorFileError", () => Effect.succeed(undefined)))
    if (text === undefined) return undefined
    const decoded = decodePersisted(text)
    if (Either.isLeft(decoded)) return yield* new CursorFileError({ path: file, message: `${file} is not a cursor file` })
    if (decoded.right.activeSessionId !== activeSessionId) {
      return yield* new CursorFileError({ path: file, message: `${file} holds the cursor of session ${decoded.right.activeSessionId}, not ${activeSessionId}` })
    }
    return decoded.right.cursor
  })

/** Writes a cursor file atomically (temp file 0600, fsync, rename, fsync of the directory). */
export const writeCursorFileSync = (file: string, activeSessionId: string, cursor: Cursor.Cursor | undefined): void => {
  const dir = path.dirname(file)
  const temp = path.join(dir, `.${path.basename(file)}.${process.pid}.tmp`)
  const body = JSON.stringify({ version: 1, activeSessionId, ...(cursor === undefined ? {} : { cursor }) }) + "\n"
  const fd = fs.openSync(temp, "w", 0o600)
  try {
    fs.writeFileSync(fd, body)
    fs.fsyncSync(fd)
  } finally {
    fs.closeSync(fd)
  }
  fs.renameSync(temp, file)
  try {
    const dfd = fs.openSync(dir, "r")
    try {
      fs.fsyncSync(dfd)
    } finally {
      fs.closeSync(dfd)
    }
  } catch {
    // Some file systems refuse to fsync a directory; the rename is still atomic.
  }
}

// ---------------------------------------------------------------------------------------------
// The follower
// ---------------------------------------------------------------------------------------------

/** Options of {@link make}. */
export interface SessionClientOptions {
  readonly activeSessionId: string
  /** The daemon's socket, or its URL (default as for `DaemonClient`). */
  readonly socketPath?: string | undefined
  /** The daemon's URL and the token for it, as for `DaemonClient`. */
  readonly url?: string | undefined
  readonly token?: string | undefined
  /** Emit only the events after this cursor (the consumer saw the rest). */
  readonly cursor?: Cursor.Cursor | undefined
  /**
   * A file for the consumer's cursor: read at `make` (the later of it and `cursor` wins),
   * written as events are emitted and when the stream ends.
   */
  readonly persistPath?: string | undefined
  /**
   * When to reconnect after a retriable failure ({@link isRetriable}); the schedule restarts
   * once an element flows again. Default: exponential from 50 ms, at most 2 s apart, forever.
   */
  readonly reconnect?: Schedule.Schedule<unknown, SessionClientError> | undefined
  /** How long to wait for a daemon's hello (default 10 seconds). */
  readonly helloTimeout?: Duration.DurationInput | undefined
  /**
   * Called on every connection once the daemon greeted, before the attach: the first, and each
   * reconnect (a changed `supervisorGeneration` means the daemon restarted meanwhile).
   */
  readonly onConnect?: ((hello: Protocol.DaemonHello) => Effect.Effect<void>) | undefined
  /**
   * Keep reconnecting (on `reconnect`) after the daemon stopped gracefully, to resume once it
   * is started again. Default false: a graceful stop ends the follow with {@link DaemonShutDown}.
   */
  readonly waitForRestart?: boolean | undefined
  /** Passed with every attach (see docs/protocol.md section 3). */
  readonly launchEnv?: Protocol.CommandOf<"attach">["launchEnv"]
  readonly env?: Protocol.CommandOf<"attach">["env"]
}

/** A follower of one session. */
export interface SessionClientService {
  readonly activeSessionId: string
  /**
   * Follows the session: every sequenced message once, in cursor order, and a `baseline` when
   * a snapshot replaces the state; across reconnects. Ends after `session_closed`; fails with a
   * non-retriable error (e.g. `DaemonError` `session_not_found`, a protocol violation) or when
   * the reconnect schedule gives up. Run it once at a time; a later run continues from where
   * the previous one stopped.
   */
  readonly events: Stream.Stream<FollowEvent, SessionClientError>
  /** The folded state now. */
  readonly state: Effect.Effect<SessionState>
  /** The folded state now, synchronously (for the Promise facade). */
  readonly current: () => SessionState
}

/** The default reconnect schedule: exponential from 50 ms, capped at 2 s, forever. */
export const defaultReconnect: Schedule.Schedule<unknown, unknown> = Schedule.exponential("50 millis").pipe(
  Schedule.union(Schedule.spaced("2 seconds"))
)

/** Makes a follower (reading its persisted cursor, if any). Nothing is sent until `events` runs. */
export const make = (options: SessionClientOptions): Effect.Effect<SessionClientService, CursorFileError> =>
  Effect.gen(function*() {
    const { activeSessionId } = options
    const persisted = options.persistPath === undefined ? undefined : yield* readCursorFile(options.persistPath, activeSessionId)
    const from = persisted === undefined
      ? options.cursor
      : options.cursor === undefined
      ? persisted
      : Cursor.max(persisted, options.cursor)
    const fold = new SessionFold(activeSessionId, from)
    const capabilities: Array<Protocol.Capability> = ["attach_snapshot", "event_sequence", "slim_attach", "chunked_snapshot"]

    const unwrap = <A, E>(either: Either.Either<A, E>): Effect.Effect<A, E> =>
      Either.isRight(either) ? Effect.succeed(either.right) : Effect.fail(either.left)

    /** One connection: connect, attach (resuming), then the pushed messages folded. */
    const connection: Stream.Stream<FollowEvent, SessionClientError> = Stream.unwrapScoped(
      Effect.gen(function*() {
        const client = yield* DaemonClient.make({ socketPath: options.socketPath, url: options.url, token: options.token, helloTimeout: options.helloTimeout })
        if (options.onConnect !== undefined) yield* options.onConnect(client.hello)
        const pushes = yield* client.subscribe
        const result = yield* client.attach(activeSessionId, {
          capabilities,
          ...fold.attaching(),
          ...(options.launchEnv === undefined ? {} : { launchEnv: options.launchEnv }),
          ...(options.env === undefined ? {} : { env: options.env })
        })
        const first = yield* unwrap(fold.attached(result))
        const scope = yield* Effect.scope
        /** After a resync or replacement mid-stream, the state it may have swallowed is read. */
        const refresh = (out: ReadonlyArray<FollowEvent>) =>
          out.some((e) => e.type === "baseline" && e.purpose !== "attach")
            ? Effect.asVoid(Effect.forkIn(
              Effect.ignore(Effect.map(client.getState(activeSessionId), (summary) => fold.refreshed(summary))),
              scope
            ))
            : Effect.void
        return Stream.concat(
          Stream.fromIterable(first),
          pushes.pipe(
            Stream.mapEffect((m) => Effect.tap(unwrap(fold.receive(m)), refresh)),
            Stream.flattenIterables
          )
        )
      })
    ).pipe(
      // A daemon that stopped gracefully is not waited for, unless asked.
      Stream.mapError((e): SessionClientError =>
        options.waitForRestart !== true && isDaemonShutdown(e)
          ? new DaemonShutDown({ activeSessionId, message: `the daemon shut down (${e.message})` })
          : e
      ),
      Stream.withSpan("SessionClient.connection", { attributes: { activeSessionId } })
    )

    const schedule = (options.reconnect ?? defaultReconnect).pipe(
      Schedule.whileInput((e: SessionClientError) => isRetriable(e))
    )
    const followed: Stream.Stream<FollowEvent, SessionClientError> = Stream.suspend(() =>
      fold.closed !== undefined ? Stream.empty : connection
    ).pipe(
      Stream.retry(schedule),
      // `session_closed` is the last event: the stream ends with it.
      Stream.takeUntil((e) => e.type === "session_closed")
    )

    const persistPath = options.persistPath
    const events: Stream.Stream<FollowEvent, SessionClientError> = persistPath === undefined
      ? followed
      : Stream.unwrapScoped(Effect.gen(function*() {
        let written = from
        const dirty = yield* Queue.sliding<void>(1)
        const write = Effect.sync(() => {
          const cursor = fold.emittedCursor
          if (cursor === written || (cursor !== undefined && written !== undefined && Cursor.equals(cursor, written))) return
          writeCursorFileSync(persistPath, activeSessionId, cursor)
          written = cursor
        }).pipe(Effect.catchAllDefect((d) => Effect.logWarning(`agentd SessionClient: cannot write ${persistPath}`, d)))
        const writer = yield* Effect.forkScoped(Effect.forever(Effect.zipRight(Queue.take(dirty), write)))
        // Last write when the stream ends, whichever way (after the writer stopped).
        yield* Effect.addFinalizer(() => Effect.zipRight(Fiber.interrupt(writer), write))
        return followed.pipe(Stream.tap(() => Queue.offer(dirty, undefined)))
      }))

    return {
      activeSessionId,
      events,
      state: Effect.sync(() => fold.snapshot()),
      current: () => fold.snapshot()
    } satisfies SessionClientService
  })

/** Follows a session: {@link make} then its `events`. */
export const follow = (options: SessionClientOptions): Stream.Stream<FollowEvent, SessionClientError | CursorFileError> =>
  Stream.unwrap(Effect.map(make(options), (c) => c.events))
