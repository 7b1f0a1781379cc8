/**
 * The Effect client of the daemon (docs/protocol.md sections 2-5): one connection to the daemon's
 * socket, each command a typed method whose answer is decoded with the protocol's own Schemas,
 * each failure a typed error, and the daemon's other messages (events, snapshot frames,
 * `session_attached`, `daemon_closing`) as a `Stream`.
 *
 * ```ts
 * const program = Effect.gen(function*() {
 *   const client = yield* DaemonClient
 *   const { activeSessionId } = yield* client.create({ name: "demo" })
 *   yield* client.promptTurn(activeSessionId, "hello").pipe(
 *     Stream.runForEach((m) => Console.log(m.event.type))
 *   )
 * }).pipe(Effect.provide(DaemonClient.layer({ socketPath })))
 * ```
 *
 * Over a socket path, or over the network: `DaemonClient.layer({ url: "http://127.0.0.1:7433" })`
 * speaks the same protocol through the HTTP front's `/v1/socket` WebSocket (with the token of
 * `agentd http-token`), the same code above a transport of lines either way.
 *
 * This module loads only the protocol's own modules (Protocol, Cursor, JsonLines) and
 * `node:net` (and `ws` for a URL, when one is used), never the daemon's, so that a client starts fast. It does not reconnect: a
 * connection that drops fails what waits on it with {@link DaemonDisconnected}.
 */
import * as Context from "effect/Context"
import * as Deferred from "effect/Deferred"
import * as Duration from "effect/Duration"
import * as Effect from "effect/Effect"
import * as Either from "effect/Either"
import * as Layer from "effect/Layer"
import * as Option from "effect/Option"
import * as ParseResult from "effect/ParseResult"
import { isRecord } from "effect/Predicate"
import * as Queue from "effect/Queue"
import * as Schema from "effect/Schema"
import type * as Scope from "effect/Scope"
import * as Stream from "effect/Stream"
import * as Take from "effect/Take"
import { randomUUID } from "node:crypto"
import * as net from "node:net"
import * as Cursor from "./Cursor.js"
import * as Remote from "./internal/remote.js"
import { DEFAULT_MAX_LINE_BYTES, LineDecoder } from "./JsonLines.js"
import * as Protocol from "./Protocol.js"
import * as SessionTarget from "./SessionTarget.js"
import { defaultSocketPath } from "./StatePaths.js"

// ---------------------------------------------------------------------------------------------
// Errors
// ---------------------------------------------------------------------------------------------

/**
 * Nothing answers at the socket path or URL, or it closed (or stayed silent) before its hello;
 * over a URL also: the URL is not one, or the daemon refused the connection (`status`: 401 for a
 * wrong or missing token, 421 for a Host it does not answer to, 403).
 */
export class DaemonUnreachable extends Schema.TaggedError<DaemonUnreachable>()("DaemonUnreachable", {
  /** Where: the socket path, or the daemon's URL. */
  socketPath: Schema.String,
  message: Schema.String,
  /** The connect's errno (`ENOENT`, `ECONNREFUSED`...), when the connect itself failed. */
  errno: Schema.optional(Schema.String),
  /** Over a URL: the HTTP status the daemon refused the WebSocket with. */
  status: Schema.optional(Schema.Int)
}) {}

/**
 * What answered at the socket is not an agentd daemon speaking this client's protocol
 * (`{ name: "agentd", version: 1 }`): its first message is not a `daemon_hello`, or the hello
 * announces another protocol name or version. `received` is what the hello announced.
 */
export class ProtocolMismatch extends Schema.TaggedError<ProtocolMismatch>()("ProtocolMismatch", {
  socketPath: Schema.String,
  expected: Protocol.ProtocolId,
  received: Schema.Unknown,
  message: Schema.String
}) {}

/**
 * The connection ended while something waited on it (a response, a stream), or a command was
 * sent after it ended: the daemon stopped or crashed, or the client was closed.
 * `daemonShutdown` is true when the daemon said `daemon_closing` first: it stopped gracefully
 * (a `shutdown`, SIGINT, SIGTERM), and will not come back unless someone starts it again.
 */
export class DaemonDisconnected extends Schema.TaggedError<DaemonDisconnected>()("DaemonDisconnected", {
  socketPath: Schema.String,
  message: Schema.String,
  daemonShutdown: Schema.optional(Schema.Boolean)
}) {}

/**
 * The daemon answered a command with an error response. Switch on `code` (one of
 * docs/protocol.md section 3's error codes); `command` is the command's type.
 *
 * ```ts
 * client.getState(id).pipe(
 *   Effect.catchTag("DaemonError", (e) => e.code === "session_not_found" ? Effect.succeed(undefined) : Effect.fail(e))
 * )
 * ```
 */
export class DaemonError extends Schema.TaggedError<DaemonError>()("DaemonError", {
  code: Protocol.ErrorCode,
  command: Schema.String,
  message: Schema.String,
  details: Protocol.optional(Protocol.JsonObject)
}) {}

/** A response this client cannot read (its shape or its `data` does not match the protocol). */
export class InvalidResponse extends Schema.TaggedError<InvalidResponse>()("InvalidResponse", {
  command: Schema.String,
  message: Schema.String
}) {}

/** A prompted turn ended with `turn_interrupted` instead of `agent_end`. */
export class TurnInterrupted extends Schema.TaggedError<TurnInterrupted>()("TurnInterrupted", {
  activeSessionId: Schema.String,
  reason: Protocol.InterruptReason,
  message: Schema.String
}) {}

/**
 * A prompted turn ended failed: its `agent_end` carries an `error` (the model endpoint failed:
 * an error status, a refused connection, a cut or malformed stream, a timeout). `code` is the
 * engine's stable code (docs/protocol.md section 7a), `status` the HTTP status if there was one.
 * The turn's partial text and its error message stay in the transcript (the error message has
 * `isError: true`).
 */
export class TurnFailed extends Schema.TaggedError<TurnFailed>()("TurnFailed", {
  activeSessionId: Schema.String,
  code: Schema.String,
  message: Schema.String,
  status: Protocol.optional(Schema.Int)
}) {}

/** The session was closed (`session_closed`, e.g. killed) before the prompted turn ended. */
export class SessionClosedError extends Schema.TaggedError<SessionClosedError>()("SessionClosedError", {
  activeSessionId: Schema.String,
  reason: Schema.String,
  message: Schema.String
}) {}

/**
 * A prompt too large to send: its command line (the envelope as it would be written, in UTF-8
 * bytes, without its `\n`) is longer than `maxLineBytes`, the longest line the daemon takes. The
 * daemon would refuse it (`line_too_long`); it was not sent. `bytes` is the line's size.
 */
export class PromptTooLarge extends Schema.TaggedError<PromptTooLarge>()("PromptTooLarge", {
  activeSessionId: Schema.String,
  bytes: Schema.Int,
  maxLineBytes: Schema.Int,
  message: Schema.String
}) {}

/**
 * A session target (docs: `SessionTarget`) that fits several sessions: a prefix shared by
 * several ids, or a name shared by sessions created before names were unique. `candidates`
 * are their ids.
 */
export class AmbiguousSession extends Schema.TaggedError<AmbiguousSession>()("AmbiguousSession", {
  target: Schema.String,
  candidates: Schema.Array(Schema.String),
  message: Schema.String
}) {}

/** Why a session target could not be resolved to one session. */
export type ResolveError = RequestError | AmbiguousSession

/** Why `make`/`layer` could not connect. */
export type ConnectError = DaemonUnreachable | ProtocolMismatch

/** Why a command failed. */
export type RequestError = DaemonError | DaemonDisconnected | InvalidResponse | PromptTooLarge

/** Why a prompted turn could not be followed to its `agent_end`. */
export type TurnError = RequestError | TurnInterrupted | TurnFailed | SessionClosedError

/**
 * True when an error says the daemon stopped gracefully: the connection ended after its
 * `daemon_closing`, or a command was refused `shutting_down`.
 */
export const isDaemonShutdown = (u: unknown): boolean => {
  // By tag: the command line's bundles each have their own copy of these classes.
  const e = u as { readonly _tag?: unknown; readonly daemonShutdown?: unknown; readonly code?: unknown } | null
  return typeof e === "object" && e !== null &&
    ((e._tag === "DaemonDisconnected" && e.daemonShutdown === true) || (e._tag === "DaemonError" && e.code === "shutting_down"))
}

/** True for a {@link DaemonError} with one of `codes` (for `Effect.catchIf`). */
export const isDaemonError = <const C extends Protocol.ErrorCode>(...codes: ReadonlyArray<C>) =>
(u: unknown): u is DaemonError & { readonly code: C } =>
  u instanceof DaemonError && (codes as ReadonlyArray<string>).includes(u.code)

// ---------------------------------------------------------------------------------------------
// The service
// ---------------------------------------------------------------------------------------------

/** Options of a connection. */
export interface DaemonClientOptions {
  /**
   * The daemon's socket; default `AGENTD_URL` (see `url`), else `AGENTD_SOCKET`, else
   * `<default state dir>/agentd.sock`. A URL here (`http://`, `ws://`...) counts as `url`.
   */
  readonly socketPath?: string | undefined
  /**
   * The daemon over the network: the URL of its HTTP front (`agentd serve --http`),
   * `http://HOST:PORT`, `https://...`, `ws://...` or `wss://...`; the client speaks the same
   * protocol through its `/v1/socket` WebSocket. Wins over `socketPath`.
   */
  readonly url?: string | undefined
  /**
   * The HTTP front's bearer token, for `url`: default `AGENTD_TOKEN`, else (a loopback URL) the
   * `http-token` file of the default state dir. `agentd http-token` prints it.
   */
  readonly token?: string | undefined
  /** How long to wait for `daemon_hello` once connected (default 10 seconds). */
  readonly helloTimeout?: Duration.DurationInput | undefined
  /**
   * The longest command line this client sends, in bytes (without its `\n`): a prompt whose
   * line would be longer fails with {@link PromptTooLarge} before anything is written. Default:
   * the limit the daemon announces in its hello (`limits.maxLineBytes`), else 16 MiB (the
   * protocol's default); never more than the daemon announces.
   */
  readonly maxLineBytes?: number | undefined
}

/** The fields of `create`. */
export type CreateOptions = Omit<Protocol.CommandOf<"create">, "type">
/** The fields of `attach` besides the session. */
export type AttachOptions = Omit<Protocol.CommandOf<"attach">, "type" | "activeSessionId">
/** The fields of `get_messages` besides the session. */
export type GetMessagesOptions = Omit<Protocol.CommandOf<"get_messages">, "type" | "activeSessionId">

/** One connection to the daemon. */
export interface DaemonClientService {
  readonly socketPath: string
  /** The daemon's greeting on this connection (protocol checked). */
  readonly hello: Protocol.DaemonHello
  /** Sends any command and decodes its response's `data` with the command's schema. */
  readonly request: <C extends Protocol.Command>(
    command: C
  ) => Effect.Effect<Protocol.ResponseDataOf<C["type"]>, RequestError>
  readonly ping: () => Effect.Effect<Protocol.PingResult, RequestError>
  /** Creates a session (without attaching to it). */
  readonly create: (options?: CreateOptions) => Effect.Effect<Protocol.CreateResult, RequestError>
  readonly list: () => Effect.Effect<Protocol.ListResult, RequestError>
  /**
   * The id of the session `target` names: its id, a unique prefix of its id (the `s-` may be
   * left out) or its name, by the same rules as the command line (`SessionTarget`). A whole
   * id is returned as it is; otherwise the daemon's `list` is read. No match fails with a
   * `DaemonError` of code `session_not_found`; several with {@link AmbiguousSession}.
   */
  readonly resolve: (target: string) => Effect.Effect<string, ResolveError>
  /** Gives a session a new name (`DaemonError` `name_taken` when another session has it). */
  readonly rename: (activeSessionId: string, name: string) => Effect.Effect<Protocol.SessionSummary, RequestError>
  readonly status: () => Effect.Effect<Protocol.StatusResult, RequestError>
  /**
   * Attaches this connection to a session. The snapshot frames, `session_attached` and the
   * events follow the response on {@link messages}: {@link subscribe} before attaching to see
   * them all.
   */
  readonly attach: (activeSessionId: string, options?: AttachOptions) => Effect.Effect<Protocol.DaemonAttachResult, RequestError>
  readonly detach: (activeSessionId: string) => Effect.Effect<void, RequestError>
  /**
   * Sends a prompt; answered once its turn starts. The turn's events go to attached connections.
   * `promptId` (1-128 characters) tags it: the `session_status` that starts its turn carries the
   * id, and the same prompt sent again with it (say after a lost connection) runs no second turn
   * once its turn started.
   */
  readonly prompt: (
    activeSessionId: string,
    message: string,
    options?: { readonly promptId?: string }
  ) => Effect.Effect<Protocol.PromptResult, RequestError>
  /** Aborts the running turn; answered once it has ended. */
  readonly abort: (activeSessionId: string) => Effect.Effect<Protocol.AbortResult, RequestError>
  readonly getState: (activeSessionId: string) => Effect.Effect<Protocol.SessionSummary, RequestError>
  readonly getMessages: (
    activeSessionId: string,
    options?: GetMessagesOptions
  ) => Effect.Effect<Protocol.GetMessagesResult, RequestError>
  readonly checkpoint: (activeSessionId: string) => Effect.Effect<Protocol.CheckpointResult, RequestError>
  readonly retryWorker: (activeSessionId: string) => Effect.Effect<Protocol.SessionSummary, RequestError>
  /** Kills a session; its files move to the daemon's archive. */
  readonly kill: (activeSessionId: string) => Effect.Effect<void, RequestError>
  /** Asks the daemon to stop; it answers, sends `daemon_closing` and exits. */
  readonly shutdown: () => Effect.Effect<void, RequestError>
  /**
   * Subscribes now to the daemon's messages that are not responses, decoded, in arrival order;
   * the subscription ends with the scope. Messages that arrive before it are not in it. The
   * stream fails with {@link DaemonDisconnected} when the connection ends other than by
   * closing this client (then it just ends). A subscription buffers what it has not read yet.
   */
  readonly subscribe: Effect.Effect<Stream.Stream<Protocol.PushMessage, DaemonDisconnected>, never, Scope.Scope>
  /** Like {@link subscribe}, subscribing when the stream starts. */
  readonly messages: Stream.Stream<Protocol.PushMessage, DaemonDisconnected>
  /** Whether this connection is attached to a session (attached, not detached, not closed). */
  readonly isAttached: (activeSessionId: string) => boolean
  /**
   * Prompts a session and follows that turn: attaches this connection to the session if it is
   * not attached yet (resuming from the session's last event, so no history is sent), sends
   * the prompt, and emits the turn's `session_event`s from its `agent_start` to its
   * `agent_end` (included), then ends. Fails with {@link TurnInterrupted} when the turn ends
   * with `turn_interrupted`, with {@link TurnFailed} after emitting an `agent_end` that carries
   * an `error` (the model endpoint failed), with {@link SessionClosedError} when the session is
   * closed first,
   * and with the command's error when the prompt is refused (e.g. `session_busy`). The prompt
   * is sent when the stream starts; ending the stream early does not abort the turn.
   *
   * A connection that falls so far behind that the turn's last events are pruned before it
   * reads them gets a `resync` snapshot instead: the stream then ends once the session is
   * idle, without the events it never received (the transcript holds the turn's messages).
   *
   * The turn followed is the prompt's own: the prompt goes with a `promptId` of its own, and the
   * turn is the one whose starting `session_status` carries it (not a turn of another client, nor
   * a turn cut by a restart that was still ending when the prompt was sent). Only a resync that
   * covers that status falls back to the session's state (see above). Needs a daemon that tags
   * the status (this package's; docs/protocol.md section 9).
   */
  readonly promptTurn: (activeSessionId: string, message: string) => Stream.Stream<Protocol.SessionEvent, TurnError>
}

/**
 * Connects to the daemon and checks its hello; the connection closes with the scope. Fails
 * with {@link DaemonUnreachable} when nothing answers (or nothing greets within
 * `helloTimeout`), {@link ProtocolMismatch} when something else than this protocol answers.
 */
export const make = (options: DaemonClientOptions = {}): Effect.Effect<DaemonClientService, ConnectError, Scope.Scope> =>
  Effect.gen(function*() {
    const url = options.url ?? (options.socketPath !== undefined && Remote.isUrl(options.socketPath)
      ? options.socketPath
      : options.socketPath === undefined
      ? process.env["AGENTD_URL"] || undefined
      : undefined)
    const socketPath = url ?? options.socketPath ?? defaultSocketPath()
    const inbox = yield* Queue.unbounded<string | null>()
    const socket = yield* Effect.acquireRelease(
      url === undefined ? open(socketPath, inbox) : openUrl(url, options.token, inbox),
      (s) => Effect.sync(() => s.close())
    )

    const hello = yield* Deferred.make<Protocol.DaemonHello, ConnectError>()
    let helloSeen = false
    /** Commands sent and not answered yet, by id. */
    const pending = new Map<string, {
      readonly command: Protocol.Command
      readonly waiter: Deferred.Deferred<unknown, DaemonDisconnected>
      /** The size of its line (without `\n`). */
      readonly bytes: number
    }>()
    const subscribers = new Set<Queue.Queue<Take.Take<Protocol.PushMessage, DaemonDisconnected>>>()
    const attached = new Set<string>()
    let daemonClosing = false
    /** Set once the connection is over: what later requests fail with, what late subscribers get. */
    let over: { readonly error: DaemonDisconnected; readonly take: Take.Take<never, DaemonDisconnected> } | undefined
    let nextId = 0

    // Synchronous, so that no request or subscription can slip in between the end and its
    // notification (each checks `over` in the same synchronous step that registers it).
    const finish = (cause: DaemonDisconnected | undefined) => {
      if (over !== undefined) return
      const error = cause ?? new DaemonDisconnected({ socketPath, message: "the client was closed" })
      over = { error, take: cause === undefined ? Take.end : Take.fail(cause) }
      Deferred.unsafeDone(
        hello,
        Effect.fail(new DaemonUnreachable({ socketPath, message: `${socketPath}: the connection closed before the daemon's hello` }))
      )
      for (const { waiter } of pending.values()) Deferred.unsafeDone(waiter, Effect.fail(error))
      pending.clear()
      for (const queue of subscribers) Queue.unsafeOffer(queue, over.take)
      subscribers.clear()
      attached.clear()
    }

    const dispatch = (line: string): Effect.Effect<void> => {
      let json: unknown
      try {
        json = JSON.parse(line)
      } catch {
        if (!helloSeen) {
          helloSeen = true
          return Deferred.fail(hello, mismatch(socketPath, undefined, `the first line from ${socketPath} is not JSON: ${preview(line)}`))
        }
        return Effect.logWarning(`agentd client: ignored a line that is not JSON: ${preview(line)}`)
      }
      if (!helloSeen) {
        helloSeen = true
        return Deferred.complete(hello, checkHello(socketPath, json))
      }
      if (isRecord(json) && json["type"] === "response") {
        const id = json["id"]
        const key = typeof id === "string" ? id : tooLongKey(json)
        const request = key === undefined ? undefined : pending.get(key)
        if (request === undefined) {
          return Effect.logWarning(`agentd client: ignored a response nobody waits for: ${preview(line)}`)
        }
        pending.delete(key!)
        // Here rather than in the caller's fiber: in wire order with a `session_closed` after it.
        if (json["success"] === true) {
          const command = request.command
          if (command.type === "attach") attached.add(command.activeSessionId)
          else if (command.type === "detach" || command.type === "kill") attached.delete(command.activeSessionId)
        }
        return Deferred.succeed(request.waiter, json)
      }
      const decoded = decodePush(json)
      if (Either.isLeft(decoded)) {
        return Effect.logWarning(`agentd client: ignored a message this client cannot read (${decoded.left}): ${preview(line)}`)
      }
      const message = decoded.right
      if (message.type === "daemon_closing") daemonClosing = true
      else if (message.type === "session_closed") attached.delete(message.activeSessionId)
      return Effect.sync(() => {
        const take = Take.of(message)
        for (const queue of subscribers) Queue.unsafeOffer(queue, take)
      })
    }

    /** The longest line this client sends, known once the hello is (see `limit` below). */
    let maxLineBytes: number | undefined
    /**
     * The request a `line_too_long` answered without its id belongs to (a daemon that cannot
     * read the id from the line's head, or one older than that): the first one waiting whose
     * line was over the daemon's limit, so that it fails instead of waiting forever.
     */
    const tooLongKey = (json: Record<string, unknown>): string | undefined => {
      const error = json["error"]
      if (json["success"] !== false || !isRecord(error) || error["code"] !== "line_too_long") return undefined
      const details = error["details"]
      const limit = isRecord(details) && typeof details["maxLineBytes"] === "number"
        ? details["maxLineBytes"]
        : maxLineBytes ?? DEFAULT_MAX_LINE_BYTES
      for (const [key, request] of pending) if (request.bytes > limit) return key
      return undefined
    }
    // One fiber reads the lines in order, so a response and the frames after it are seen in
    // the order the daemon sent them.
    yield* Effect.forkScoped(Effect.gen(function*() {
      while (true) {
        const lines = yield* Queue.takeBetween(inbox, 1, Number.MAX_SAFE_INTEGER)
        for (const line of lines) {
          if (line === null) {
            return finish(
              new DaemonDisconnected({
                socketPath,
                message: daemonClosing ? "the daemon shut down (daemon_closing)" : "the daemon closed the connection",
                ...(daemonClosing ? { daemonShutdown: true } : {})
              })
            )
          }
          yield* dispatch(line)
        }
      }
    }).pipe(
      // Not expected (dispatch is total); if it happens, nothing may be left waiting forever.
      Effect.catchAllCause((cause) =>
        Effect.zipRight(
          Effect.logError("agentd client: the connection's reader failed", cause),
          Effect.sync(() => finish(new DaemonDisconnected({ socketPath, message: "the client's reader failed" })))
        )
      )
    ))
    // Runs first when the scope closes: whatever still waits on this connection learns it is over.
    yield* Effect.addFinalizer(() => Effect.sync(() => finish(undefined)))

    const helloTimeout = Duration.decode(options.helloTimeout ?? "10 seconds")
    const greeting = yield* Deferred.await(hello).pipe(
      Effect.timeoutFail({
        duration: helloTimeout,
        onTimeout: () =>
          new DaemonUnreachable({
            socketPath,
            message: `${socketPath} accepted the connection but sent no daemon_hello within ${Duration.format(helloTimeout)}`
          })
      })
    )

    const announced = greeting.limits?.maxLineBytes
    const limit = options.maxLineBytes === undefined
      ? announced ?? DEFAULT_MAX_LINE_BYTES
      : Math.min(options.maxLineBytes, announced ?? Number.POSITIVE_INFINITY)
    maxLineBytes = limit

    /** A prompt whose line is over the limit, as the error it fails with. */
    const tooLarge = (command: Protocol.Command, bytes: number): PromptTooLarge | undefined =>
      command.type === "prompt" && bytes > limit
        ? new PromptTooLarge({
          activeSessionId: command.activeSessionId,
          bytes,
          maxLineBytes: limit,
          message: `the prompt is too large to send: its command line is ${bytes} bytes, over the limit of ${limit} bytes (${
            formatBytes(limit)
          }${announced === undefined || limit < announced ? "" : ", the daemon's maxLineBytes"}); it was not sent`
        })
        : undefined

    const request = <C extends Protocol.Command>(command: C): Effect.Effect<Protocol.ResponseDataOf<C["type"]>, RequestError> =>
      Effect.gen(function*() {
        const waiter = yield* Deferred.make<unknown, DaemonDisconnected>()
        const sent = yield* Effect.sync((): RequestError | string => {
          if (over !== undefined) return over.error
          // A refused command takes no id: ids stay consecutive on the wire.
          const id = `r${nextId + 1}`
          const line = Protocol.encodeCommand(id, command, greeting.clientId)
          // Measured as written: UTF-8 bytes of the whole envelope, without its `\n`.
          const bytes = Buffer.byteLength(line, "utf8") - 1
          const error = tooLarge(command, bytes)
          if (error !== undefined) return error
          nextId++
          pending.set(id, { command, waiter, bytes })
          socket.write(line)
          return id
        })
        if (typeof sent !== "string") return yield* sent
        const id = sent
        const response = yield* Deferred.await(waiter).pipe(Effect.onInterrupt(() => Effect.sync(() => pending.delete(id))))
        const data = yield* decodeAnswer(command.type, response)
        return data as Protocol.ResponseDataOf<C["type"]>
      }).pipe(Effect.withSpan("DaemonClient.request", { attributes: { command: command.type } }))

    const subscribe: DaemonClientService["subscribe"] = Effect.gen(function*() {
      const queue = yield* Effect.acquireRelease(
        Queue.unbounded<Take.Take<Protocol.PushMessage, DaemonDisconnected>>(),
        (q) => Effect.zipRight(Effect.sync(() => subscribers.delete(q)), Queue.shutdown(q))
      )
      yield* Effect.sync(() => {
        if (over !== undefined) Queue.unsafeOffer(queue, over.take)
        else subscribers.add(queue)
      })
      return Stream.flattenTake(Stream.fromQueue(queue))
    })

    const service: DaemonClientService = {
      socketPath,
      hello: greeting,
      request,
      ping: () => request({ type: "ping" }),
      create: (options = {}) => request({ ...options, type: "create" }),
      list: () => request({ type: "list" }),
      resolve: (target) =>
        SessionTarget.isFullId(target) ? Effect.succeed(target) : Effect.flatMap(request({ type: "list" }), ({ sessions }): Effect.Effect<string, ResolveError> => {
          const r = SessionTarget.resolve(sessions, target)
          switch (r._tag) {
            case "Found":
              return Effect.succeed(r.activeSessionId)
            case "NoMatch":
              return Effect.fail(new DaemonError({ code: "session_not_found", command: "list", message: r.message }))
            case "Ambiguous":
              return Effect.fail(
                new AmbiguousSession({ target, candidates: r.candidates.map((c) => c.activeSessionId), message: r.message })
              )
          }
        }),
      rename: (activeSessionId, name) => request({ type: "rename", activeSessionId, name }),
      status: () => request({ type: "status" }),
      attach: (activeSessionId, options = {}) => request({ ...options, type: "attach", activeSessionId }),
      detach: (activeSessionId) => Effect.asVoid(request({ type: "detach", activeSessionId })),
      prompt: (activeSessionId, message, options = {}) => request({ ...options, type: "prompt", activeSessionId, message }),
      abort: (activeSessionId) => request({ type: "abort", activeSessionId }),
      getState: (activeSessionId) => request({ type: "get_state", activeSessionId }),
      getMessages: (activeSessionId, options = {}) => request({ ...options, type: "get_messages", activeSessionId }),
      checkpoint: (activeSessionId) => request({ type: "checkpoint", activeSessionId }),
      retryWorker: (activeSessionId) => request({ type: "retry_worker", activeSessionId }),
      kill: (activeSessionId) => Effect.asVoid(request({ type: "kill", activeSessionId })),
      shutdown: () => Effect.asVoid(request({ type: "shutdown" })),
      subscribe,
      messages: Stream.unwrapScoped(subscribe),
      isAttached: (activeSessionId) => attached.has(activeSessionId),
      promptTurn: (activeSessionId, message) =>
        Stream.unwrapScoped(Effect.gen(function*() {
          // Refused before anything is sent (no attach for a prompt that cannot go).
          const promptId = randomUUID()
          const command: Protocol.Command = { type: "prompt", activeSessionId, message, promptId }
          const error = tooLarge(command, Buffer.byteLength(Protocol.encodeCommand(`r${nextId + 1}`, command, greeting.clientId), "utf8") - 1)
          if (error !== undefined) return yield* error
          const pushes = yield* subscribe
          // The session as it is before the prompt: the turn is after its last event.
          const before = yield* service.getState(activeSessionId)
          if (!attached.has(activeSessionId)) {
            yield* service.attach(activeSessionId, {
              capabilities: ["event_sequence", "slim_attach"],
              ...(before.lastEventCursor === undefined ? {} : { resumeCursor: before.lastEventCursor })
            })
          }
          yield* service.prompt(activeSessionId, message, { promptId })
          return turnOf(pushes, activeSessionId, promptId, before, socketPath, service.getState(activeSessionId))
        }))
    }
    return service
  })

/**
 * The client as a service. `DaemonClient.layer({ socketPath })` provides one connection for
 * the layer's lifetime; `DaemonClient.make` is the scoped constructor.
 */
export class DaemonClient extends Context.Tag("agentd/DaemonClient")<DaemonClient, DaemonClientService>() {
  /** See {@link make}. */
  static readonly make = (options: DaemonClientOptions = {}) => make(options)
  /** See {@link layer}. */
  static readonly layer = (options: DaemonClientOptions = {}) => layer(options)
}

/** One connection for the lifetime of the layer. */
export const layer = (options: DaemonClientOptions = {}): Layer.Layer<DaemonClient, ConnectError> =>
  Layer.scoped(DaemonClient, make(options))

// ---------------------------------------------------------------------------------------------
// Internals
// ---------------------------------------------------------------------------------------------

/**
 * Connects with plain `node:net`: a client needs no more than connect, write and data
 * callbacks, and stays free of the platform packages. Lines go to `inbox`, then `null` once the
 * connection has closed.
 */
const open = (socketPath: string, inbox: Queue.Queue<string | null>) =>
  Effect.async<Remote.LineTransport, DaemonUnreachable>((resume) => {
    const socket = net.connect(socketPath)
    const onError = (err: NodeJS.ErrnoException) =>
      resume(Effect.fail(
        new DaemonUnreachable({
          socketPath,
          message: `no daemon listens at ${socketPath} (${err.code ?? err.message})`,
          ...(err.code === undefined ? {} : { errno: err.code })
        })
      ))
    socket.once("error", onError)
    socket.once("connect", () => {
      socket.off("error", onError)
      const decoder = new LineDecoder(Number.MAX_SAFE_INTEGER)
      const offer = (items: ReadonlyArray<unknown>) => {
        for (const item of items) if (typeof item === "string") Queue.unsafeOffer(inbox, item)
      }
      socket.on("data", (chunk: Buffer) => offer(decoder.push(chunk)))
      socket.on("end", () => offer(decoder.end()))
      // Every error is followed by `close`, which is what ends the connection.
      socket.on("error", () => {})
      socket.on("close", () => Queue.unsafeOffer(inbox, null))
      resume(Effect.succeed({ write: (line) => void socket.write(line), close: () => socket.destroy() }))
    })
    return Effect.sync(() => socket.destroy())
  })

/**
 * Connects over the network: the same lines through the HTTP front's `/v1/socket` WebSocket
 * (internal/remote.ts), into the same `inbox`, so nothing above the transport differs.
 */
const openUrl = (text: string, token: string | undefined, inbox: Queue.Queue<string | null>) =>
  Effect.suspend(() => {
    const url = Remote.socketUrl(text)
    if (typeof url === "string") return Effect.fail(new DaemonUnreachable({ socketPath: text, message: url }))
    return Effect.async<Remote.LineTransport, DaemonUnreachable>((resume) => {
      const abort = Remote.openLines(url, Remote.tokenFor(url, token), {
        onOpen: (transport) => resume(Effect.succeed(transport)),
        onFail: (f) =>
          resume(Effect.fail(
            new DaemonUnreachable({
              socketPath: text,
              message: f.message,
              ...(f.errno === undefined ? {} : { errno: f.errno }),
              ...(f.status === undefined ? {} : { status: f.status })
            })
          )),
        onLine: (line) => Queue.unsafeOffer(inbox, line),
        onClose: () => Queue.unsafeOffer(inbox, null)
      })
      return Effect.sync(abort)
    })
  })

/** A size in bytes for a person: `16 MiB`, `64 KiB`, `1.5 MiB`, `900 bytes`. */
const formatBytes = (n: number): string => {
  const units: ReadonlyArray<readonly [string, number]> = [["GiB", 2 ** 30], ["MiB", 2 ** 20], ["KiB", 2 ** 10]]
  for (const [unit, size] of units) {
    if (n >= size) return `${Number((n / size).toFixed(n % size === 0 ? 0 : 1))} ${unit}`
  }
  return `${n} bytes`
}

const preview = (line: string): string => (line.length > 200 ? `${line.slice(0, 200)}...` : line)

const show = (u: unknown): string => {
  try {
    return JSON.stringify(u) ?? String(u)
  } catch {
    return String(u)
  }
}

const mismatch = (socketPath: string, received: unknown, message: string) =>
  new ProtocolMismatch({ socketPath, expected: Protocol.PROTOCOL, received, message })

/** The failed fields of a parse error, on one line (a union's whole type is no message). */
const formatIssues = (error: ParseResult.ParseError): string => {
  const issues = ParseResult.ArrayFormatter.formatErrorSync(error)
  const shown = issues.slice(0, 3).map((i) => `${i.path.length === 0 ? "" : `${i.path.join(".")}: `}${i.message}`)
  return issues.length > 3 ? `${shown.join("; ")}; ...` : shown.join("; ")
}

/**
 * A decoder made on first use. Making one compiles its schema's parser at once; a client makes
 * few kinds of requests in its life (a command line one), so it compiles only those.
 */
const lazy = <A>(make: () => A): () => A => {
  let made: { readonly value: A } | undefined
  return () => (made ??= { value: make() }).value
}

const decodeHelloLazy = lazy(() => Schema.decodeUnknownEither(Protocol.DaemonHello))
const decodeHello = (u: unknown) => decodeHelloLazy()(u)
const knownCapabilities: ReadonlyArray<unknown> = Protocol.Capability.literals

/** The first message must be a `daemon_hello` of this protocol. */
const checkHello = (socketPath: string, json: unknown): Effect.Effect<Protocol.DaemonHello, ProtocolMismatch> => {
  if (!isRecord(json) || json["type"] !== "daemon_hello") {
    return Effect.fail(mismatch(
      socketPath,
      isRecord(json) ? json["type"] : json,
      `${socketPath} did not greet with daemon_hello (first message: ${preview(show(json))})`
    ))
  }
  const protocol = json["protocol"]
  if (!isRecord(protocol) || protocol["name"] !== Protocol.PROTOCOL.name || protocol["version"] !== Protocol.PROTOCOL.version) {
    return Effect.fail(mismatch(
      socketPath,
      protocol,
      `the daemon at ${socketPath} speaks protocol ${show(protocol)}; this client speaks ${show(Protocol.PROTOCOL)}`
    ))
  }
  // Capabilities this client does not know of are no reason to refuse a daemon of its protocol;
  // nor are limits it cannot read (an extension): it goes on without them.
  const capabilities = json["serverCapabilities"]
  const { limits, ...rest } = json
  const readable = isRecord(limits) && Number.isSafeInteger(limits["maxLineBytes"]) && (limits["maxLineBytes"] as number) > 0
  const decoded = decodeHello({
    ...rest,
    ...(readable ? { limits: { maxLineBytes: limits["maxLineBytes"] } } : {}),
    ...(Array.isArray(capabilities) ? { serverCapabilities: capabilities.filter((c) => knownCapabilities.includes(c)) } : {})
  })
  return Either.isRight(decoded)
    ? Effect.succeed(decoded.right)
    : Effect.fail(mismatch(
      socketPath,
      protocol,
      `malformed daemon_hello from ${socketPath}: ${formatIssues(decoded.left)}`
    ))
}

const pushSchemas: { readonly [T in Protocol.PushMessage["type"]]: Schema.Schema<Extract<Protocol.PushMessage, { type: T }>, any> } = {
  session_event: Protocol.SessionEvent,
  session_status: Protocol.SessionStatus,
  session_closed: Protocol.SessionClosed,
  session_attached: Protocol.SessionAttached,
  session_snapshot_begin: Protocol.SnapshotBegin,
  session_snapshot_chunk: Protocol.SnapshotChunk,
  session_snapshot_end: Protocol.SnapshotEnd,
  session_snapshot_failed: Protocol.SnapshotFailed,
  daemon_closing: Protocol.DaemonClosing
}
const pushDecoders = new Map<string, () => (u: unknown) => Either.Either<Protocol.PushMessage, ParseResult.ParseError>>(
  Object.entries(pushSchemas).map((
    [type, schema]
  ) => [type, lazy(() => Schema.decodeUnknownEither(schema as Schema.Schema<Protocol.PushMessage, any>))])
)

/** A message that is not a response, decoded with the schema its `type` names; or why not. */
const decodePush = (json: unknown): Either.Either<Protocol.PushMessage, string> => {
  const type = isRecord(json) ? json["type"] : undefined
  const decode = typeof type === "string" ? pushDecoders.get(type) : undefined
  if (decode === undefined) return Either.left(`unknown message type ${show(type)}`)
  return Either.mapLeft(decode()(json), formatIssues)
}

const decodeSuccess = lazy(() => Schema.decodeUnknownEither(Protocol.ResponseSuccess))
const decodeFailure = lazy(() => Schema.decodeUnknownEither(Protocol.ResponseFailure))
const decodeResponse = (raw: unknown) =>
  isRecord(raw) && raw["success"] === true
    ? decodeSuccess()(raw)
    : Either.map(decodeFailure()(raw), (r): Protocol.Response => r)
const dataDecoders = Object.fromEntries(
  Object.entries(Protocol.ResponseData).map(([type, schema]) => [type, lazy(() => Schema.decodeUnknownEither(schema as Schema.Schema<unknown>))])
) as Record<Protocol.CommandType, () => (u: unknown) => Either.Either<unknown, ParseResult.ParseError>>

/** A response's data, decoded for its command, or its error. */
const decodeAnswer = (type: Protocol.CommandType, raw: unknown): Effect.Effect<unknown, DaemonError | InvalidResponse> => {
  const response = decodeResponse(raw)
  if (Either.isLeft(response)) {
    return Effect.fail(
      new InvalidResponse({
        command: type,
        message: `malformed response to \`${type}\`: ${formatIssues(response.left)}`
      })
    )
  }
  const answer = response.right
  if (!answer.success) {
    const { code, details, message } = answer.error
    return Effect.fail(new DaemonError({ code, command: type, message, ...(details === undefined ? {} : { details }) }))
  }
  const data = dataDecoders[type]()(answer.data)
  return Either.isRight(data)
    ? Effect.succeed(data.right)
    : Effect.fail(
      new InvalidResponse({
        command: type,
        message: `unexpected data in the response to \`${type}\`: ${formatIssues(data.left)}`
      })
    )
}

/**
 * The events of prompt `promptId`'s turn: the session's events after the `session_status` that
 * starts it (which carries that id), each once (a resync or a replay after a pause may send some
 * again), looked for after `before` (the session's state before the prompt was sent).
 */
const turnOf = (
  pushes: Stream.Stream<Protocol.PushMessage, DaemonDisconnected>,
  activeSessionId: string,
  promptId: string,
  before: Protocol.SessionSummary,
  socketPath: string,
  stateNow: Effect.Effect<Protocol.SessionSummary, RequestError>
): Stream.Stream<Protocol.SessionEvent, TurnError> =>
  Stream.suspend(() => {
    let last = before.lastEventCursor
    /** Whether the status that starts the prompt's turn was seen (or skipped in a snapshot). */
    let started = false
    let ended = false
    /** The turn ended failed: its `agent_end` is emitted, then the stream fails with this. */
    let failure: TurnFailed | undefined
    /**
     * A `resync` or `replacement` snapshot (this connection fell so far behind that the events
     * it lacked were pruned, or history was rewritten): the events up to its cursor will never
     * come. If the session is idle by then, the turn's end was among them: the stream ends
     * (the transcript holds the turn's messages).
     */
    const skipped = (cursor: Cursor.Cursor) =>
      Effect.gen(function*() {
        if (last !== undefined && !Cursor.isAfter(cursor, last)) return false
        last = cursor
        if ((yield* stateNow).busy) {
          // The prompt was accepted before this stream runs, so its turn has started (its status
          // may be inside the snapshot): the turn running now is this one.
          started = true
          return false
        }
        ended = true
        return true
      })
    const step = (
      message: Protocol.PushMessage
    ): Effect.Effect<Option.Option<Protocol.SessionEvent>, TurnError> => {
      if (message.type === "session_snapshot_end" && message.activeSessionId === activeSessionId && message.lastEventCursor !== undefined) {
        return Effect.as(skipped(message.lastEventCursor), Option.none())
      }
      if (message.type !== "session_event" && message.type !== "session_status" && message.type !== "session_closed") {
        return Effect.succeedNone
      }
      if (message.activeSessionId !== activeSessionId) return Effect.succeedNone
      if (last !== undefined && !Cursor.isAfter(message.meta.cursor, last)) return Effect.succeedNone
      last = message.meta.cursor
      if (message.type === "session_closed") {
        return Effect.fail(
          new SessionClosedError({
            activeSessionId,
            reason: message.reason,
            message: `session ${activeSessionId} was closed (${message.reason}) before its turn ended`
          })
        )
      }
      if (!started) {
        if (message.type === "session_status" && message.promptId === promptId) started = true
        return Effect.succeedNone
      }
      if (message.type !== "session_event") return Effect.succeedNone
      const event = message.event
      if (event.type === "turn_interrupted") {
        return Effect.fail(
          new TurnInterrupted({
            activeSessionId,
            reason: event.reason,
            message: `the turn of session ${activeSessionId} was interrupted (${event.reason})`
          })
        )
      }
      if (event.type === "agent_end") {
        ended = true
        if (event.error !== undefined) {
          failure = new TurnFailed({
            activeSessionId,
            code: event.error.code,
            message: event.error.message,
            ...(event.error.status === undefined ? {} : { status: event.error.status })
          })
        }
      }
      return Effect.succeedSome(message)
    }
    return pushes.pipe(
      Stream.mapEffect(step),
      Stream.takeUntil(() => ended),
      Stream.filterMap((o) => o),
      Stream.concat(Stream.suspend((): Stream.Stream<never, TurnFailed | DaemonDisconnected> =>
        failure !== undefined
          ? Stream.fail(failure)
          : ended
          ? Stream.empty
          : Stream.fail(new DaemonDisconnected({ socketPath, message: "the client was closed before the turn ended" }))
      ))
    )
  })
