/**
 * `agentd/client`: talk to a running agentd daemon over its socket, or over the network through
 * its HTTP front (`connect({ url: "http://127.0.0.1:7433", token })`).
 *
 * Two faces on one core:
 * - Effect: the {@link DaemonClient} service (`DaemonClient.layer({ socketPath })`), typed
 *   commands, typed errors, server messages as a `Stream`.
 * - Promises, for code without Effect:
 *   ```ts
 *   import { connect } from "agentd/client"
 *   const client = await connect({ socketPath })
 *   const session = await client.create({ name: "demo" })
 *   for await (const event of session.prompt("hello")) {
 *     if (event.type === "message_update") process.stdout.write(event.delta)
 *   }
 *   await client.close()
 *   ```
 *   A failed promise rejects with the same typed errors (`DaemonError` with its `code`,
 *   `TurnInterrupted`, `TurnFailed`, `PromptTooLarge`, `DaemonUnreachable`, ...), each an `Error` with a `_tag`.
 *
 * This entry loads the protocol's modules only, never the daemon's.
 */
import * as Cause from "effect/Cause"
import * as Effect from "effect/Effect"
import * as Exit from "effect/Exit"
import * as Fiber from "effect/Fiber"
import * as Scope from "effect/Scope"
import * as Stream from "effect/Stream"
import {
  type AttachOptions,
  type CreateOptions,
  type ResolveError,
  DaemonClient,
  type DaemonClientOptions,
  type DaemonClientService,
  type GetMessagesOptions
} from "./DaemonClient.js"
import type { Cursor as CursorType } from "./Cursor.js"
import * as CursorModule from "./Cursor.js"
import type * as Protocol from "./Protocol.js"
import * as SessionClient from "./SessionClient.js"
import * as SessionTarget from "./SessionTarget.js"

export {
  AmbiguousSession,
  type AttachOptions,
  type ConnectError,
  type CreateOptions,
  DaemonClient,
  type DaemonClientOptions,
  type DaemonClientService,
  DaemonDisconnected,
  DaemonError,
  DaemonUnreachable,
  type GetMessagesOptions,
  InvalidResponse,
  isDaemonError,
  PromptTooLarge,
  ProtocolMismatch,
  type RequestError,
  type ResolveError,
  SessionClosedError,
  type TurnError,
  TurnFailed,
  TurnInterrupted
} from "./DaemonClient.js"
export * as Cursor from "./Cursor.js"
export {
  type Baseline,
  type BaselinePurpose,
  CursorFileError,
  type FollowEvent,
  type SessionClientError,
  type SessionClientOptions,
  type SessionClientService,
  SessionProtocolViolation,
  type SessionState,
  SnapshotFailed
} from "./SessionClient.js"
export * as SessionClient from "./SessionClient.js"
export * as Protocol from "./Protocol.js"
export * as SessionTarget from "./SessionTarget.js"
export { defaultSocketPath } from "./StatePaths.js"

// ---------------------------------------------------------------------------------------------
// Promise facade
// ---------------------------------------------------------------------------------------------

/** Options of {@link connect}. */
export interface ConnectOptions extends DaemonClientOptions {}

/** A connection to the daemon, for code that uses promises. */
export interface Client {
  readonly socketPath: string
  /** The daemon's greeting on this connection. */
  readonly hello: Protocol.DaemonHello
  /** The Effect client underneath (the same connection). */
  readonly core: DaemonClientService
  /** Creates a session (with `name`, `engine`, `config`, ...) and returns its handle. */
  create(options?: CreateOptions): Promise<SessionHandle>
  /**
   * A handle on an existing session, named by its id, a unique prefix of its id or its name
   * (the command line's rules: `SessionTarget`). Nothing is sent until it is used: its first
   * use resolves the target (a `list`, unless it is a whole id) and the handle keeps that
   * session from then on, even if it is renamed. A target that names no session fails that
   * use with `DaemonError` `session_not_found`, one that names several with `AmbiguousSession`.
   */
  session(target: string): SessionHandle
  /** The id of the session `target` names (see {@link session}). */
  resolve(target: string): Promise<string>
  list(): Promise<ReadonlyArray<Protocol.SessionSummary>>
  status(): Promise<Protocol.StatusResult>
  ping(): Promise<Protocol.PingResult>
  /** Asks the daemon to stop. */
  shutdown(): Promise<void>
  /** Closes the connection; what still waits on it fails with `DaemonDisconnected`. */
  close(): Promise<void>
}

/** Options of {@link SessionHandle.follow}. */
export interface FollowOptions {
  /** Yield only the events after this cursor (the caller saw the rest). */
  readonly cursor?: CursorType | undefined
  /**
   * A file holding the last yielded cursor (0600, written atomically): a later `follow` with
   * the same file, in this process or another, goes on after it.
   */
  readonly persistPath?: string | undefined
  /** When to reconnect (an Effect `Schedule`; default exponential from 50 ms, capped at 2 s, forever). */
  readonly reconnect?: SessionClient.SessionClientOptions["reconnect"]
  /**
   * Keep reconnecting after the daemon stopped gracefully (`daemon_closing`), to resume once
   * it is started again. Default false: the follow then throws `DaemonShutDown`.
   */
  readonly waitForRestart?: boolean | undefined
}

/** One session, through a {@link Client}'s connection. */
export interface SessionHandle {
  /** The session's id once the target is resolved (at once for a whole id); before that, the target. */
  readonly activeSessionId: string
  /** The target the handle was made with (an id, a prefix or a name). */
  readonly target: string
  /**
   * Follows the session: yields every sequenced event (`session_event`, `session_status`,
   * `session_closed`) once, in cursor order, and a `baseline` whenever a snapshot becomes the
   * session's state (first attach, resync, history rewrite). Runs on its own connections:
   * when the daemon restarts or the socket drops it reconnects and resumes from its last
   * cursor. Ends after `session_closed`; throws `DaemonError` (e.g. `session_not_found`),
   * `SessionProtocolViolation`, `DaemonShutDown` when the daemon stopped gracefully (unless
   * `waitForRestart`), or the last connection error if `reconnect` gives up. Leaving
   * the loop closes its connection.
   */
  follow(options?: FollowOptions): AsyncIterable<SessionClient.FollowEvent>
  /**
   * The transcript as the latest {@link follow} has folded it (the baseline's messages, then
   * each `message_end`'s message); empty before a follow has received its baseline.
   */
  readonly messages: ReadonlyArray<Protocol.AgentMessage>
  /** The whole folded state of the latest {@link follow} (undefined before any). */
  readonly state: SessionClient.SessionState | undefined
  /**
   * Prompts the session and yields that turn's events, ending with its `agent_end`; throws
   * `TurnInterrupted` (with its `reason`) when the turn ends with `turn_interrupted`,
   * `TurnFailed` (with its `code` and `message`) after yielding an `agent_end` that carries an
   * `error` (the model endpoint failed), or the prompt's `DaemonError` (e.g. `session_busy`). Attaches the connection to the session first
   * if needed. The prompt is sent when the iteration starts; leaving the loop early does not
   * abort the turn (use {@link abort}). A prompt too large for the daemon's line limit throws
   * `PromptTooLarge` (naming the limit and the size) without being sent.
   */
  prompt(text: string): AsyncIterable<Protocol.AgentEvent>
  /** Aborts the running turn; true when a turn was cut by it. */
  abort(): Promise<boolean>
  getState(): Promise<Protocol.SessionSummary>
  getMessages(options?: GetMessagesOptions): Promise<Protocol.GetMessagesResult>
  attach(options?: AttachOptions): Promise<Protocol.DaemonAttachResult>
  detach(): Promise<void>
  checkpoint(): Promise<Protocol.CheckpointResult>
  retryWorker(): Promise<Protocol.SessionSummary>
  /** Gives the session a new name; rejects with `DaemonError` `name_taken` when another session has it. */
  rename(name: string): Promise<Protocol.SessionSummary>
  kill(): Promise<void>
}

/** Runs an effect; a failure rejects with the typed error itself (not a wrapper). */
const run = <A, E>(effect: Effect.Effect<A, E>): Promise<A> =>
  Effect.runPromiseExit(effect).then((exit) => {
    if (Exit.isSuccess(exit)) return exit.value
    throw Cause.squash(exit.cause)
  })

/**
 * A stream as an async iterable whose `return()` (leaving a `for await` loop, or called while
 * a `next()` waits) interrupts the stream, runs its finalizers, and ends the waiting `next()`
 * (`Stream.toAsyncIterable` leaves such a `next()` pending). A failure is thrown as the typed
 * error itself. The stream runs ahead of the consumer (its elements are buffered).
 */
const iterate = <A, E>(
  stream: Stream.Stream<A, E>,
  /** Told of each element handed to the consumer, and once the iteration is over. */
  hooks: { readonly yielded?: (a: A) => void; readonly over?: () => void } = {}
): AsyncIterable<A> => ({
  [Symbol.asyncIterator]() {
    const buffer: Array<A> = []
    let end: { readonly error?: unknown } | undefined
    let wake: Array<() => void> = []
    const notify = () => {
      const waiting = wake
      wake = []
      for (const w of waiting) w()
    }
    const fiber = Effect.runFork(Stream.runForEach(stream, (a) =>
      Effect.sync(() => {
        buffer.push(a)
        notify()
      })))
    fiber.addObserver((exit) => {
      if (end === undefined) {
        end = Exit.isSuccess(exit) || Exit.isInterrupted(exit) ? {} : { error: Cause.squash(exit.cause) }
      }
      notify()
    })
    return {
      async next(): Promise<IteratorResult<A>> {
        for (;;) {
          if (buffer.length > 0) {
            const value = buffer.shift()!
            hooks.yielded?.(value)
            return { value, done: false }
          }
          if (end !== undefined) {
            hooks.over?.()
            if ("error" in end) throw end.error
            return { value: undefined, done: true }
          }
          await new Promise<void>((resolve) => wake.push(resolve))
        }
      },
      async return(): Promise<IteratorResult<A>> {
        end ??= {}
        buffer.length = 0
        await Effect.runPromise(Fiber.interrupt(fiber))
        hooks.over?.()
        notify()
        return { value: undefined, done: true }
      }
    }
  }
})

/**
 * Connects to the daemon (default: `AGENTD_URL`, else the socket `AGENTD_SOCKET`, else the
 * default state dir's); over the network with `url` (`http://HOST:PORT` of `agentd serve
 * --http`, or `ws://`) and `token` (default `AGENTD_TOKEN`). Rejects with `DaemonUnreachable`
 * when nothing answers or the daemon refuses the connection (its `status`: 401 for a wrong
 * token), `ProtocolMismatch` when the daemon speaks another protocol.
 */
export const connect = async (options: ConnectOptions = {}): Promise<Client> => {
  const connectOptions = options
  const scope = Effect.runSync(Scope.make())
  const exit = await Effect.runPromiseExit(Scope.extend(DaemonClient.make(options), scope))
  if (Exit.isFailure(exit)) {
    await Effect.runPromise(Scope.close(scope, exit))
    throw Cause.squash(exit.cause)
  }
  const core = exit.value
  const session = (target: string): SessionHandle => {
    // The follower of the latest `follow()`, for `messages` and `state`.
    let follower: SessionClient.SessionClientService | undefined
    let resolved: string | undefined = SessionTarget.isFullId(target) ? target : undefined
    /** The session's id: resolved once, at the first use. */
    const id: Effect.Effect<string, ResolveError> = Effect.suspend(() =>
      resolved !== undefined ? Effect.succeed(resolved) : Effect.tap(core.resolve(target), (found) => Effect.sync(() => (resolved = found)))
    )
    const withId = <A, E>(f: (activeSessionId: string) => Effect.Effect<A, E>) => run(Effect.flatMap(id, f))
    return {
      get activeSessionId() {
        return resolved ?? target
      },
      target,
      follow: (options = {}) => {
        // The cursor file holds the last event handed to the loop, which the follower's own
        // persistence (the last event it emitted) would run past: the stream runs ahead.
        const persistPath = options.persistPath
        let activeSessionId = target
        let last: CursorType | undefined
        let written: CursorType | undefined
        let pending = false
        const save = () => {
          pending = false
          if (persistPath === undefined || last === written) return
          SessionClient.writeCursorFileSync(persistPath, activeSessionId, last)
          written = last
        }
        const yielded = (e: SessionClient.FollowEvent) => {
          const cursor = e.type === "baseline" ? e.cursor : e.meta.cursor
          if (cursor === undefined || (last !== undefined && !CursorModule.isAfter(cursor, last))) return
          last = cursor
          // Coalesced: one write for a burst of events.
          if (persistPath !== undefined && !pending) {
            pending = true
            setImmediate(save)
          }
        }
        return iterate(
          Stream.unwrap(Effect.gen(function*() {
            activeSessionId = yield* id
            const persisted = persistPath === undefined ? undefined : yield* SessionClient.readCursorFile(persistPath, activeSessionId)
            last = persisted === undefined || options.cursor === undefined
              ? persisted ?? options.cursor
              : CursorModule.max(persisted, options.cursor)
            written = persisted
            follower = yield* SessionClient.make({
              activeSessionId,
              // The same daemon, the same way (a socket path, or a URL with its token).
              socketPath: core.socketPath,
              token: connectOptions.token,
              cursor: last,
              reconnect: options.reconnect,
              waitForRestart: options.waitForRestart
            })
            return follower.events
          })),
          { yielded, over: save }
        )
      },
      get messages() {
        return follower?.current().messages ?? []
      },
      get state() {
        return follower?.current()
      },
      prompt: (text) =>
        Stream.toAsyncIterable(Stream.unwrap(Effect.map(id, (activeSessionId) =>
          Stream.map(core.promptTurn(activeSessionId, text), (m) => m.event)))),
      abort: () => withId((activeSessionId) => Effect.map(core.abort(activeSessionId), (r) => r.aborted)),
      getState: () => withId(core.getState),
      getMessages: (options) => withId((activeSessionId) => core.getMessages(activeSessionId, options)),
      attach: (options) => withId((activeSessionId) => core.attach(activeSessionId, options)),
      detach: () => withId(core.detach),
      checkpoint: () => withId(core.checkpoint),
      retryWorker: () => withId(core.retryWorker),
      rename: (name) => withId((activeSessionId) => core.rename(activeSessionId, name)),
      kill: () => withId(core.kill)
    }
  }
  return {
    socketPath: core.socketPath,
    hello: core.hello,
    core,
    create: (options) => run(Effect.map(core.create(options), (r) => session(r.activeSessionId))),
    session,
    resolve: (target) => run(core.resolve(target)),
    list: () => run(Effect.map(core.list(), (r) => r.sessions)),
    status: () => run(core.status()),
    ping: () => run(core.ping()),
    shutdown: () => run(core.shutdown()),
    close: () => run(Scope.close(scope, Exit.void))
  }
}
