/**
 * `agentd/client`: talk to a running agentd daemon over its socket.
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
 *   `TurnInterrupted`, `DaemonUnreachable`, ...), each an `Error` with a `_tag`.
 *
 * This entry loads the protocol's modules only, never the daemon's.
 */
import * as Cause from "effect/Cause"
import * as Effect from "effect/Effect"
import * as Exit from "effect/Exit"
import * as Scope from "effect/Scope"
import * as Stream from "effect/Stream"
import {
  type AttachOptions,
  type CreateOptions,
  DaemonClient,
  type DaemonClientOptions,
  type DaemonClientService,
  type GetMessagesOptions
} from "./DaemonClient.js"
import type * as Protocol from "./Protocol.js"

export {
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
  ProtocolMismatch,
  type RequestError,
  SessionClosedError,
  type TurnError,
  TurnInterrupted
} from "./DaemonClient.js"
export * as Cursor from "./Cursor.js"
export * as Protocol from "./Protocol.js"
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
  /** A handle on an existing session (nothing is sent until it is used). */
  session(activeSessionId: string): SessionHandle
  list(): Promise<ReadonlyArray<Protocol.SessionSummary>>
  status(): Promise<Protocol.StatusResult>
  ping(): Promise<Protocol.PingResult>
  /** Asks the daemon to stop. */
  shutdown(): Promise<void>
  /** Closes the connection; what still waits on it fails with `DaemonDisconnected`. */
  close(): Promise<void>
}

/** One session, through a {@link Client}'s connection. */
export interface SessionHandle {
  readonly activeSessionId: string
  /**
   * Prompts the session and yields that turn's events, ending with its `agent_end`; throws
   * `TurnInterrupted` (with its `reason`) when the turn ends with `turn_interrupted`, or the
   * prompt's `DaemonError` (e.g. `session_busy`). Attaches the connection to the session first
   * if needed. The prompt is sent when the iteration starts; leaving the loop early does not
   * abort the turn (use {@link abort}).
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
  kill(): Promise<void>
}

/** Runs an effect; a failure rejects with the typed error itself (not a wrapper). */
const run = <A, E>(effect: Effect.Effect<A, E>): Promise<A> =>
  Effect.runPromiseExit(effect).then((exit) => {
    if (Exit.isSuccess(exit)) return exit.value
    throw Cause.squash(exit.cause)
  })

/**
 * Connects to the daemon (default socket: `AGENTD_SOCKET`, else the default state dir's).
 * Rejects with `DaemonUnreachable` when nothing answers, `ProtocolMismatch` when the daemon
 * speaks another protocol.
 */
export const connect = async (options: ConnectOptions = {}): Promise<Client> => {
  const scope = Effect.runSync(Scope.make())
  const exit = await Effect.runPromiseExit(Scope.extend(DaemonClient.make(options), scope))
  if (Exit.isFailure(exit)) {
    await Effect.runPromise(Scope.close(scope, exit))
    throw Cause.squash(exit.cause)
  }
  const core = exit.value
  const session = (activeSessionId: string): SessionHandle => ({
    activeSessionId,
    prompt: (text) => Stream.toAsyncIterable(Stream.map(core.promptTurn(activeSessionId, text), (m) => m.event)),
    abort: () => run(Effect.map(core.abort(activeSessionId), (r) => r.aborted)),
    getState: () => run(core.getState(activeSessionId)),
    getMessages: (options) => run(core.getMessages(activeSessionId, options)),
    attach: (options) => run(core.attach(activeSessionId, options)),
    detach: () => run(core.detach(activeSessionId)),
    checkpoint: () => run(core.checkpoint(activeSessionId)),
    retryWorker: () => run(core.retryWorker(activeSessionId)),
    kill: () => run(core.kill(activeSessionId))
  })
  return {
    socketPath: core.socketPath,
    hello: core.hello,
    core,
    create: (options) => run(Effect.map(core.create(options), (r) => session(r.activeSessionId))),
    session,
    list: () => run(Effect.map(core.list(), (r) => r.sessions)),
    status: () => run(core.status()),
    ping: () => run(core.ping()),
    shutdown: () => run(core.shutdown()),
    close: () => run(Scope.close(scope, Exit.void))
  }
}
