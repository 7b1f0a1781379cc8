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
 * Loads only the protocol's modules and `DaemonClient`, never the daemon's. The fold itself is
 * SessionFold.ts, shared with the web page.
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
import * as fs from "./internal/fileIoSync.js"
import * as path from "node:path"
import * as Cursor from "./Cursor.js"
import { type ConnectError, DaemonClient, isDaemonShutdown, type RequestError } from "./DaemonClient.js"
import type * as Protocol from "./Protocol.js"
import { type FollowEvent, SessionFold, type SessionProtocolViolation, type SessionState, type SnapshotFailed } from "./SessionFold.js"

// The fold lives in SessionFold.ts (no Node imports: the web page bundles it); its types and
// errors are part of this module's API as before.
export {
  type Baseline,
  type BaselinePurpose,
  type FollowEvent,
  SessionFold,
  SessionProtocolViolation,
  type SessionState,
  SnapshotFailed
} from "./SessionFold.js"

// ---------------------------------------------------------------------------------------------
// Errors
// ---------------------------------------------------------------------------------------------

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
