/**
 * The HTTP front (docs/protocol.md section 10): the same sessions and commands as the socket,
 * for browsers and any HTTP client. Another door to the SessionManager, not a second core:
 * commands call the manager's methods after the socket's own schema checked them, event reads
 * attach to sessions exactly as socket clients do (internal/http/events.ts), and `/v1/socket`
 * carries the socket protocol itself over a WebSocket.
 *
 * Off unless asked (`agentd serve --http HOST:PORT`, `AGENTD_HTTP`). Every request passes the
 * gate first (internal/http/security.ts): the Host must name this server (no DNS rebinding), an
 * Origin must be our own (no cross-site request; no CORS header is ever sent), and the token
 * must come as a bearer token or as the cookie the login URL sets. A non-loopback bind is
 * refused without `--http-insecure`. The token is never logged.
 *
 * On @effect/platform's HttpServer over @effect/platform-node. Routing is one table rather than
 * HttpRouter: the table also knows which methods a path takes, for the 405 and its `Allow`.
 */
import * as HttpServer from "@effect/platform/HttpServer"
import * as HttpServerRequest from "@effect/platform/HttpServerRequest"
import * as HttpServerResponse from "@effect/platform/HttpServerResponse"
import * as Socket from "@effect/platform/Socket"
import * as NodeHttpServer from "@effect/platform-node/NodeHttpServer"
import * as NodeHttpServerRequest from "@effect/platform-node/NodeHttpServerRequest"
import * as Cause from "effect/Cause"
import * as Context from "effect/Context"
import * as Data from "effect/Data"
import * as Effect from "effect/Effect"
import * as Either from "effect/Either"
import * as Exit from "effect/Exit"
import * as FiberSet from "effect/FiberSet"
import * as Layer from "effect/Layer"
import * as Metric from "effect/Metric"
import * as Option from "effect/Option"
import * as Scope from "effect/Scope"
import * as Stream from "effect/Stream"
import { randomUUID } from "node:crypto"
import * as http from "node:http"
import * as net from "node:net"
import { DaemonConfig } from "./DaemonConfig.js"
import { EventLog } from "./EventLog.js"
import { errorResponse, REQUEST_ID_HEADER } from "./internal/http/errors.js"
import {
  openReader,
  type Reader,
  type ReaderOptions,
  readPage,
  ReadRefused,
  rewriteFields,
  snapshotLink,
  sseStream
} from "./internal/http/events.js"
import * as Metrics from "./internal/http/metrics.js"
import * as DaemonMetrics from "./Metrics.js"
import * as Offset from "./internal/http/offset.js"
import { loadPage, PAGE_HEADERS } from "./internal/http/page.js"
import { StreamPort } from "./internal/http/port.js"
import * as Security from "./internal/http/security.js"
import { readOrCreateToken, tokenMatches } from "./internal/http/token.js"
import * as Protocol from "./Protocol.js"
import { CommandError, internalOfCause, SessionManager, SupervisorInfo } from "./SessionManager.js"
import { SnapshotCache } from "./SnapshotCache.js"

/** The HTTP front could not start (a bad address, a refused bind, the port in use). */
export class HttpStartError extends Data.TaggedError("HttpStartError")<{ readonly message: string }> {}

/** The running HTTP front. */
export class HttpFront extends Context.Tag("agentd/HttpFront")<HttpFront, {
  readonly host: string
  readonly port: number
  /** `http://host:port` (the port is the one bound, also when 0 was asked). */
  readonly url: string
}>() {}

/**
 * The least of the most bytes of one catch-up or long-poll page of events; the most is the
 * outbox limit when it is higher (8 MiB by default: the bound a socket client is held to). Each
 * page is a new attach whose catch-up finds its offset in the log: fewer, larger pages read a
 * long history faster (`npm run bench -- httpCatchUp`, 100k events: 0.56x of the socket's
 * replay with 4 MiB pages, 0.77x with 16 MiB).
 */
const MIN_PAGE_BYTES = 4 * 1024 * 1024
/** Bytes a WebSocket may have unsent before its bridge stops reading the daemon's socket. */
const WS_HIGH_BYTES = 1024 * 1024
/** At a stop, how long open responses may take to end before their connections are closed. */
const CLOSE_GRACE_MS = 1_000

type Handler = (ctx: RequestContext) => Effect.Effect<HttpServerResponse.HttpServerResponse, Refusal>

interface RequestContext {
  readonly request: HttpServerRequest.HttpServerRequest
  readonly url: URL
  readonly params: ReadonlyArray<string>
  readonly requestId: string
}

/** An error answer on its way out (a code of errors.ts, its message, extra headers). */
class Refusal extends Data.TaggedError("Refusal")<{
  readonly code: string
  readonly message: string
  readonly headers: Record<string, string>
}> {}

const refusal = (code: string, message: string, headers: Record<string, string> = {}) => new Refusal({ code, message, headers })

const refuse = (code: string, message: string, headers: Record<string, string> = {}) => Effect.fail(refusal(code, message, headers))

const fromCommandError = (e: CommandError | ReadRefused) =>
  e instanceof ReadRefused ? refusal(e.code, e.message, e.headers) : refusal(e.code, e.message)

/** A request id given by the client, if it is a sane one, else ours. */
let requestCounter = 0
const requestIdOf = (headers: Readonly<Record<string, string | undefined>>) => {
  const given = headers[REQUEST_ID_HEADER]
  return given !== undefined && /^[\w.:-]{1,128}$/.test(given) ? given : `h-${++requestCounter}-${randomUUID().slice(0, 8)}`
}

/**
 * The session core's connection id of one HTTP read: unique even when clients reuse a request
 * id (an attach replaces the same connection's earlier one, and a detach ends all of them).
 */
let readCounter = 0
const connectionIdOf = (ctx: { readonly requestId: string }) => `http-${++readCounter}-${ctx.requestId}`

/** Durable Streams' `Stream-Cursor`: 20 s intervals since 2024-10-09, for CDN collapsing. */
const streamCursor = () => String(Math.floor((Date.now() - Date.UTC(2024, 9, 9)) / 20_000))

const jsonResponse = (data: unknown, requestId: string, status = 200, headers: Record<string, string> = {}) =>
  HttpServerResponse.text(JSON.stringify(data), {
    status,
    contentType: "application/json",
    headers: { ...headers, [REQUEST_ID_HEADER]: requestId, "cache-control": "no-store" }
  })

export const make = Effect.gen(function*() {
  const config = yield* DaemonConfig
  const manager = yield* SessionManager
  const log = yield* EventLog
  const info = yield* SupervisorInfo
  const cache = yield* SnapshotCache
  const listen = Security.parseListen(config.http ?? "")
  if (typeof listen === "string") return yield* new HttpStartError({ message: `--http: ${listen}` })
  if (!Security.isLoopback(listen.host) && !config.httpInsecure) {
    return yield* new HttpStartError({
      message: `refusing to serve HTTP on ${listen.host}, which is not a loopback address: put TLS in front and pass --http-insecure (AGENTD_HTTP_INSECURE=1) to allow it`
    })
  }
  const token = yield* Effect.try({
    try: () => readOrCreateToken(config.stateDir),
    catch: (e) => new HttpStartError({ message: `cannot make the HTTP token: ${e instanceof Error ? e.message : String(e)}` })
  })
  /** Anything logged goes through this: the token never reaches a log. */
  const scrub = (text: string) => text.split(token).join("<token>")

  // A request without `Host` reaches the Host check (421, a JSON body, its request id) instead
  // of node's bare 400.
  const nodeServer = http.createServer({ requireHostHeader: false })
  // The body limit is enforced while reading (readBody); node's own header limits stay.
  const server = yield* NodeHttpServer.make(() => nodeServer, { host: listen.host, port: listen.port }).pipe(
    Effect.mapError((e) => new HttpStartError({ message: `cannot listen on ${config.http}: ${scrub(String((e.cause as Error)?.message ?? e.message))}` }))
  )
  const address = server.address
  const port = address._tag === "TcpAddress" ? address.port : listen.port
  const hostForUrl = net.isIPv6(listen.host) ? `[${listen.host}]` : listen.host
  const url = `http://${hostForUrl}:${port}`

  const pageBytes = Math.max(MIN_PAGE_BYTES, config.outboxBytes)

  /** Open event reads and sockets, closed at a stop so that no response holds the daemon. */
  const openScopes = new Set<Scope.CloseableScope>()
  let stopping = false
  const fibers = yield* FiberSet.make()
  const runFork = yield* FiberSet.runtime(fibers)<never>()
  const layerScope = yield* Effect.scope

  /** Ends every open stream and connection (once): what a stop does first. */
  const stopStreams = Effect.gen(function*() {
    if (stopping) return
    stopping = true
    for (const scope of [...openScopes]) yield* Effect.ignore(Scope.close(scope, Exit.void))
    nodeServer.closeIdleConnections()
    // Interruptible: in a finalizer the timeout could not cut the wait otherwise (close waits for
    // every connection, and a client that reconnects at once keeps one open).
    yield* Effect.interruptible(Effect.async<void>((resume) => {
      nodeServer.close(() => resume(Effect.void))
    })).pipe(Effect.timeout(CLOSE_GRACE_MS), Effect.ignore)
    nodeServer.closeAllConnections()
  })
  /**
   * The platform makes its WebSocket server at the first upgrade, and its close (which waits for
   * every WebSocket to end) then runs before our finalizer: the streams are ended again from a
   * finalizer added after it.
   */
  let stopAfterWebSockets = false
  const onFirstWebSocket = Effect.suspend(() => {
    if (stopAfterWebSockets) return Effect.void
    stopAfterWebSockets = true
    return Scope.addFinalizer(layerScope, Effect.suspend(() => {
      stopping = false
      return stopStreams
    }))
  })

  /** Reads a request body up to the line limit (413 past it), as text. */
  const readBody = (request: HttpServerRequest.HttpServerRequest) =>
    Effect.async<string, Refusal>((resume) => {
      const source = NodeHttpServerRequest.toIncomingMessage(request)
      const limit = config.maxLineBytes
      const declared = Number(source.headers["content-length"] ?? "NaN")
      const tooLong = () =>
        resume(Effect.fail(refusal("line_too_long", `The body is longer than ${limit} bytes; it was not read.`, { connection: "close" })))
      if (Number.isFinite(declared) && declared > limit) return tooLong()
      const chunks: Array<Buffer> = []
      let size = 0
      let done = false
      source.on("data", (chunk: Buffer) => {
        if (done) return
        size += chunk.length
        if (size > limit) {
          done = true
          chunks.length = 0
          // The rest is not read: the connection closes after the answer.
          source.pause()
          return tooLong()
        }
        chunks.push(chunk)
      })
      source.on("end", () => {
        if (done) return
        done = true
        resume(Effect.succeed(Buffer.concat(chunks).toString("utf8")))
      })
      source.on("error", (err) => {
        if (done) return
        done = true
        resume(Effect.fail(refusal("parse_error", `The body could not be read: ${err.message}`)))
      })
    })

  /**
   * A command from the route and the body, checked by the socket's own schema: the same
   * messages for the same mistakes. An empty body counts as `{}`.
   */
  const command = <T extends Protocol.CommandType>(
    type: T,
    ctx: RequestContext,
    fields: Record<string, unknown>,
    withBody: boolean
  ) =>
    Effect.gen(function*() {
      let body: Record<string, unknown> = {}
      if (withBody) {
        const text = yield* readBody(ctx.request)
        if (text.trim().length > 0) {
          let parsed: unknown
          try {
            parsed = JSON.parse(text)
          } catch (e) {
            return yield* refuse("parse_error", `The body is not valid JSON (${e instanceof Error ? e.message : String(e)}).`)
          }
          if (typeof parsed !== "object" || parsed === null || Array.isArray(parsed)) {
            return yield* refuse("invalid_command", "The body must be a JSON object.")
          }
          body = parsed as Record<string, unknown>
        }
      }
      const { type: _t, id: _i, ...rest } = body
      const decoded = Protocol.decodeCommandValue({ ...rest, ...fields, type })
      if (Either.isLeft(decoded)) return yield* refuse(decoded.left.code, decoded.left.message)
      return decoded.right.command as Protocol.CommandOf<T>
    })

  // A command that died, or that someone else than this request interrupted (a cluster owner
  // that lost the session mid-command), is answered as an internal error; the request's own
  // interruption (its client went away) is not caught.
  const run = <A>(effect: Effect.Effect<A, CommandError>) =>
    Effect.mapError(
      effect.pipe(Effect.catchAllCause((cause) =>
        Option.match(Cause.failureOption(cause), {
          onSome: Effect.fail,
          onNone: () => Effect.fail(internalOfCause(cause, scrub))
        })
      )),
      fromCommandError
    )

  const ok = (ctx: RequestContext, status = 200) => (data: unknown) => jsonResponse(data, ctx.requestId, status)

  const sessionId = (ctx: RequestContext) => ctx.params[0]!

  /** The read an events request asks for: `Last-Event-ID` (EventSource's resume) wins over `offset`. */
  const requestedOffset = (ctx: RequestContext) => {
    const text = ctx.request.headers["last-event-id"] ?? ctx.url.searchParams.get("offset") ?? "-1"
    const requested = Offset.decode(text)
    return requested === undefined
      ? refuse("invalid_offset", `Invalid offset ${JSON.stringify(text.slice(0, 64))}: -1, now, or an offset this server gave.`)
      : Effect.succeed(requested)
  }

  /**
   * Runs `use` with a read attached in a scope of its own, which outlives the handler when the
   * response is a stream: it closes when the stream ends, when the client goes away, or at a stop.
   */
  const withReader = (
    ctx: RequestContext,
    requested: Offset.Requested,
    use: (reader: Reader, close: Effect.Effect<void>) => Effect.Effect<HttpServerResponse.HttpServerResponse, Refusal>,
    options: ReaderOptions = {}
  ) =>
    Effect.gen(function*() {
      if (stopping) return yield* refuse("shutting_down", "The daemon is shutting down.")
      const scope = yield* Scope.make()
      openScopes.add(scope)
      const close = Effect.suspend(() => {
        openScopes.delete(scope)
        return Scope.close(scope, Exit.void)
      })
      NodeHttpServerRequest.toServerResponse(ctx.request).once("close", () => runFork(close))
      const reader = yield* openReader(manager, log, connectionIdOf(ctx), sessionId(ctx), requested, options).pipe(
        Scope.extend(scope),
        Effect.mapError(fromCommandError),
        Effect.onExit((exit) => (Exit.isSuccess(exit) ? Effect.void : close))
      )
      return yield* use(reader, close).pipe(Effect.onExit((exit) => (Exit.isSuccess(exit) ? Effect.void : close)))
    })

  const streamHeaders = (ctx: RequestContext, next: string, upToDate: boolean, live: boolean) => ({
    [REQUEST_ID_HEADER]: ctx.requestId,
    "cache-control": "no-store",
    "stream-next-offset": next,
    ...(upToDate ? { "stream-up-to-date": "true" } : {}),
    ...(live ? { "stream-cursor": streamCursor() } : {}),
    "x-content-type-options": "nosniff"
  })

  const events: Handler = (ctx) =>
    Effect.gen(function*() {
      const live = ctx.url.searchParams.get("live")
      if (live !== null && live !== "sse" && live !== "long-poll" && live !== "false") {
        return yield* refuse("invalid_offset", `Invalid live mode ${JSON.stringify(live.slice(0, 32))}: sse or long-poll.`)
      }
      const requested = yield* requestedOffset(ctx)
      return yield* withReader(ctx, requested, (reader, close) =>
        Effect.gen(function*() {
          if (live === "sse") {
            DaemonMetrics.gaugeBy(DaemonMetrics.clients.sse, 1)
            const body = sseStream(reader, {
              keepAliveMs: config.httpKeepAliveMs,
              cursor: streamCursor,
              snapshotLink: (snapshotId) => snapshotLink(sessionId(ctx), snapshotId)
            }).pipe(Stream.ensuring(Effect.zipRight(close, Effect.sync(() => DaemonMetrics.gaugeBy(DaemonMetrics.clients.sse, -1)))))
            return HttpServerResponse.stream(body, {
              contentType: "text/event-stream",
              headers: { ...streamHeaders(ctx, Offset.encode(reader.from), false, true), connection: "keep-alive" }
            })
          }
          const page = yield* readPage(reader, pageBytes, live === "long-poll" ? config.httpLongPollMs : undefined)
          yield* close
          DaemonMetrics.delivered("http", page.lines.length, page.lines.reduce((n, l) => n + l.length, 0))
          const next = Offset.encode(page.next)
          if (live === "long-poll" && page.lines.length === 0 && page.rewrite === undefined) {
            return HttpServerResponse.empty({ status: 204, headers: streamHeaders(ctx, next, true, true) })
          }
          // A read from before a history rewrite: the array starts with what SSE's control
          // event says of it (the replacement snapshot to read, the offset after it).
          const elements = page.rewrite === undefined
            ? page.lines
            : [JSON.stringify({ type: "control", rewrite: rewriteFields(page.rewrite, (s) => snapshotLink(sessionId(ctx), s)) }), ...page.lines]
          // Encoded by Buffer.from, faster than the TextEncoder `text` uses on a 4 MiB page.
          return HttpServerResponse.uint8Array(Buffer.from(`[${elements.join(",")}]`, "utf8"), {
            contentType: "application/json",
            headers: streamHeaders(ctx, next, page.upToDate, live === "long-poll")
          })
        }), live === "sse" ? {} : { budget: pageBytes })
    })

  const NEWLINE = 0x0a
  const ATTACHED_LINE = Buffer.from('{"type":"session_attached"')
  const SNAPSHOT_LINE = Buffer.from('{"type":"session_snapshot_')
  const CHUNK_LINE = Buffer.from('{"type":"session_snapshot_chunk"')
  const END_LINE = Buffer.from('{"type":"session_snapshot_end"')
  const FAILED_LINE = Buffer.from('{"type":"session_snapshot_failed"')
  const startsWith = (line: Buffer, prefix: Buffer) => line.length >= prefix.length && line.compare(prefix, 0, prefix.length, 0, prefix.length) === 0

  /**
   * Where a `tailBytes` read of the current snapshot starts: a chunk resume of it (an attach's
   * `snapshotResume`), so that the daemon does not read the chunks before its end at all. An
   * attach that is not delivered names the snapshot; the cache says, once it is made, how many
   * chunks it has and their bytes, from which the chunks that make about `tailBytes` are counted (one more for
   * chunks of unequal size: the read trims to the bytes exactly). Undefined: read it all (a
   * snapshot still being made, or small enough).
   */
  const tailStart = (connectionId: string, attach: Protocol.CommandOf<"attach">, tailBytes: number) =>
    Effect.scoped(Effect.gen(function*() {
      const probe = new StreamPort()
      yield* Effect.addFinalizer(() => Effect.zipRight(Effect.sync(() => probe.close()), manager.detachAll(connectionId)))
      const named = (yield* run(manager.attach(connectionId, probe, attach))).data.snapshotStream
      if (named === undefined) return undefined
      // Held while it is being made (a snapshot the cache is still reading): its end gives the count.
      const ended = yield* Effect.option(Effect.flatMap(cache.retain(named.id), (r) => r.awaitEnd))
      if (Option.isNone(ended)) return undefined
      const found = yield* Effect.option(cache.info(named.id))
      if (Option.isNone(found) || found.value.status !== "complete" || found.value.chunkCount === 0) return undefined
      const { chunkCount, totalBytes } = found.value
      const keep = Math.min(chunkCount, 1 + Math.max(1, Math.ceil(tailBytes / Math.max(1, totalBytes / chunkCount))))
      return keep >= chunkCount ? undefined : { snapshotId: named.id, fromChunk: chunkCount - keep }
    }))

  /**
   * The session's current snapshot as `session_snapshot_*` lines (the socket's frames, read as
   * an attach reads them), then one `snapshot_offset` line: the offset to read events after.
   */
  const snapshot: Handler = (ctx) =>
    Effect.gen(function*() {
      if (stopping) return yield* refuse("shutting_down", "The daemon is shutting down.")
      const id = sessionId(ctx)
      const resumeId = ctx.url.searchParams.get("id")
      const fromChunkText = ctx.url.searchParams.get("fromChunk")
      const fromChunk = fromChunkText === null ? 0 : Number(fromChunkText)
      if (!Number.isSafeInteger(fromChunk) || fromChunk < 0) return yield* refuse("invalid_command", "`fromChunk` must be a whole number >= 0.")
      const tailText = ctx.url.searchParams.get("tailBytes")
      const tailBytes = tailText === null ? undefined : Number(tailText)
      if (tailBytes !== undefined && (!Number.isSafeInteger(tailBytes) || tailBytes < 0)) {
        return yield* refuse("invalid_command", "`tailBytes` must be a whole number >= 0.")
      }
      const connectionId = connectionIdOf(ctx)
      const first = yield* command("attach", ctx, {
        activeSessionId: id,
        capabilities: ["attach_snapshot", "event_sequence", "slim_attach", "chunked_snapshot"],
        ...(resumeId === null ? {} : { snapshotResume: { snapshotId: resumeId, fromChunk } })
      }, false)
      const tailFrom = tailBytes === undefined || resumeId !== null ? undefined : yield* tailStart(connectionId, first, tailBytes)
      const attach = tailFrom === undefined ? first : { ...first, snapshotResume: tailFrom }
      const scope = yield* Scope.make()
      openScopes.add(scope)
      const close = Effect.suspend(() => {
        openScopes.delete(scope)
        return Scope.close(scope, Exit.void)
      })
      NodeHttpServerRequest.toServerResponse(ctx.request).once("close", () => runFork(close))
      const port = new StreamPort()
      yield* Scope.addFinalizer(scope, Effect.zipRight(Effect.sync(() => port.close()), manager.detachAll(connectionId)))
      const outcome = yield* run(manager.attach(connectionId, port, attach)).pipe(Effect.onError(() => close))
      yield* Effect.forkIn(Effect.interruptible(outcome.deliver), scope)
      const offset = Offset.encode(outcome.data.snapshot.cursor)
      // Lines are sorted as bytes (a 100 MB snapshot is not decoded to be passed on or skipped).
      let carry: Buffer = Buffer.alloc(0)
      let done = false
      // `tailBytes`: the chunks held back, of which only the last ones making that many bytes
      // (the last one at least) are sent, once the end says no more come.
      const tail: Array<Buffer> = []
      let tailHeld = 0
      const body = Stream.repeatEffectOption(Effect.gen(function*() {
        if (done) return yield* Effect.fail(Option.none())
        if (!port.hasItems) yield* port.awaitItems
        if (!port.hasItems) {
          done = true
          return yield* Effect.fail(Option.none())
        }
        const out: Array<Buffer> = []
        for (const data of port.takeAll()) {
          const piece = typeof data === "string" ? Buffer.from(data, "utf8") : Buffer.from(data.buffer, data.byteOffset, data.byteLength)
          const text = carry.length === 0 ? piece : Buffer.concat([carry, piece])
          let start = 0
          for (;;) {
            const nl = text.indexOf(NEWLINE, start)
            if (nl < 0) break
            const line = text.subarray(start, nl + 1)
            start = nl + 1
            if (done) continue
            if (startsWith(line, ATTACHED_LINE)) {
              out.push(Buffer.from(`${JSON.stringify({ type: "snapshot_offset", activeSessionId: id, offset })}\n`))
              done = true
            } else if (tailBytes !== undefined && startsWith(line, CHUNK_LINE)) {
              // Copied: the piece it is part of may be a larger buffer.
              tail.push(Buffer.from(line))
              tailHeld += line.length
              while (tail.length > 1 && tailHeld - tail[0]!.length >= tailBytes) tailHeld -= tail.shift()!.length
            } else if (startsWith(line, SNAPSHOT_LINE)) {
              if (startsWith(line, END_LINE) || startsWith(line, FAILED_LINE)) out.push(...tail.splice(0))
              out.push(line)
              if (startsWith(line, FAILED_LINE)) done = true
            }
          }
          carry = Buffer.from(text.subarray(start))
        }
        return out.length === 1 ? out[0]! : Buffer.concat(out)
      })).pipe(Stream.ensuring(close))
      return HttpServerResponse.stream(body, {
        contentType: "application/x-ndjson",
        headers: { [REQUEST_ID_HEADER]: ctx.requestId, "cache-control": "no-store", "stream-next-offset": offset }
      })
    })

  /**
   * The socket protocol over a WebSocket: each frame is one line to the daemon's own socket, each
   * line from it one frame back. Bridged to the socket rather than served beside it, so that it
   * is the socket's protocol exactly (hello, envelopes, attach, half-close, slow-client rules).
   */
  const webSocket: Handler = (ctx) =>
    Effect.gen(function*() {
      if (stopping) return yield* refuse("shutting_down", "The daemon is shutting down.")
      const upgrade = ctx.request.headers["upgrade"]
      if (upgrade === undefined || upgrade.toLowerCase() !== "websocket") {
        return yield* refuse("invalid_command", "GET /v1/socket upgrades to a WebSocket (Upgrade: websocket).")
      }
      const socket = yield* Effect.orDie(ctx.request.upgrade)
      const scope = yield* Scope.make()
      openScopes.add(scope)
      const close = Effect.suspend(() => {
        openScopes.delete(scope)
        return Scope.close(scope, Exit.void)
      })
      const write = yield* socket.writer.pipe(Scope.extend(scope))
      DaemonMetrics.gaugeBy(DaemonMetrics.clients.ws, 1)
      yield* Scope.addFinalizer(scope, Effect.sync(() => DaemonMetrics.gaugeBy(DaemonMetrics.clients.ws, -1)))
      const unix = net.connect(config.socketPath)
      yield* Scope.addFinalizer(scope, Effect.sync(() => unix.destroy()))
      let carry = ""
      unix.setEncoding("utf8")
      /**
       * The WebSocket under the platform's socket, once a frame handler has seen it: what it has
       * not sent yet is what backpressure looks at (the platform's writes never wait).
       */
      let raw: { readonly bufferedAmount: number } | undefined
      let drainTimer: NodeJS.Timeout | undefined
      yield* Scope.addFinalizer(scope, Effect.sync(() => clearInterval(drainTimer)))
      unix.on("data", (text: string) => {
        const all = carry + text
        let start = 0
        for (;;) {
          const nl = all.indexOf("\n", start)
          if (nl < 0) break
          runFork(Effect.ignore(write(all.slice(start, nl))))
          start = nl + 1
        }
        carry = all.slice(start)
        // A client that does not read: stop reading the socket, so that the daemon's own
        // backpressure (pause, then catch-up from the log) applies, as for a socket client.
        if (raw !== undefined && raw.bufferedAmount > WS_HIGH_BYTES && drainTimer === undefined) {
          unix.pause()
          drainTimer = setInterval(() => {
            if (raw !== undefined && raw.bufferedAmount > WS_HIGH_BYTES / 2) return
            clearInterval(drainTimer)
            drainTimer = undefined
            unix.resume()
          }, 10)
        }
      })
      const unixClosed = Effect.async<void>((resume) => {
        unix.once("close", () => resume(Effect.void))
      })
      const frames = socket.runRaw((data) =>
        Effect.gen(function*() {
          if (raw === undefined) {
            const ws = yield* Effect.serviceOption(Socket.WebSocket)
            if (Option.isSome(ws)) raw = ws.value
          }
          unix.write(typeof data === "string" ? data : Buffer.from(data))
          unix.write("\n")
        }), { onOpen: onFirstWebSocket }
      ).pipe(Effect.ignore, Effect.zipRight(Effect.sync(() => unix.end())))
      yield* Effect.raceFirst(Effect.zipRight(frames, unixClosed), unixClosed).pipe(Effect.ensuring(close))
      return HttpServerResponse.empty()
    })

  const metrics: Handler = (ctx) =>
    Effect.gen(function*() {
      // This daemon's sessions (a cluster runner's own: scraping every runner counts each once).
      const list = yield* run(manager.listHere)
      const text = yield* Metrics.render(list.sessions, info.generation)
      return HttpServerResponse.text(text, {
        contentType: "text/plain; version=0.0.4",
        headers: { [REQUEST_ID_HEADER]: ctx.requestId, "cache-control": "no-store" }
      })
    })

  /** The web page (web/, built into dist/src/web/), behind the same gate as everything else. */
  const pageFiles = loadPage()
  const page: Handler = (ctx) => {
    if (typeof pageFiles === "string") return refuse("not_found", pageFiles)
    const file = pageFiles.get(ctx.url.pathname)!
    return Effect.succeed(HttpServerResponse.uint8Array(file.body, {
      contentType: file.contentType,
      headers: { ...PAGE_HEADERS, [REQUEST_ID_HEADER]: ctx.requestId }
    }))
  }

  /** Path pattern (one capture: the session id), then a handler per method. */
  const routes: ReadonlyArray<readonly [RegExp, Readonly<Record<string, Handler>>]> = [
    [/^\/(?:app\.js|app\.css)?$/, { GET: page }],
    [/^\/healthz$/, { GET: (ctx) => Effect.succeed(jsonResponse({ ok: true }, ctx.requestId)) }],
    [/^\/metrics$/, { GET: metrics }],
    [/^\/v1\/status$/, { GET: (ctx) => Effect.map(run(manager.status), ok(ctx)) }],
    [/^\/v1\/socket$/, { GET: webSocket }],
    [/^\/v1\/sessions$/, {
      GET: (ctx) => Effect.map(run(manager.list), ok(ctx)),
      POST: (ctx) =>
        Effect.flatMap(command("create", ctx, {}, true), (cmd) => Effect.map(run(manager.create(cmd)), ok(ctx, 201)))
    }],
    [/^\/v1\/sessions\/([^/]+)$/, {
      GET: (ctx) => Effect.map(run(manager.getState(sessionId(ctx))), ok(ctx)),
      DELETE: (ctx) =>
        Effect.flatMap(command("kill", ctx, { activeSessionId: sessionId(ctx) }, false), (cmd) =>
          Effect.map(run(manager.kill(cmd.activeSessionId)), ok(ctx)))
    }],
    [/^\/v1\/sessions\/([^/]+)\/prompt$/, {
      POST: (ctx) =>
        Effect.flatMap(command("prompt", ctx, { activeSessionId: sessionId(ctx) }, true), (cmd) => Effect.map(run(manager.prompt(cmd)), ok(ctx)))
    }],
    [/^\/v1\/sessions\/([^/]+)\/abort$/, {
      POST: (ctx) =>
        Effect.flatMap(command("abort", ctx, { activeSessionId: sessionId(ctx) }, true), (cmd) => Effect.map(run(manager.abort(cmd)), ok(ctx)))
    }],
    [/^\/v1\/sessions\/([^/]+)\/checkpoint$/, {
      POST: (ctx) =>
        Effect.flatMap(command("checkpoint", ctx, { activeSessionId: sessionId(ctx) }, true), (cmd) =>
          Effect.map(run(manager.checkpoint(cmd.activeSessionId)), ok(ctx)))
    }],
    [/^\/v1\/sessions\/([^/]+)\/retry$/, {
      POST: (ctx) =>
        Effect.flatMap(command("retry_worker", ctx, { activeSessionId: sessionId(ctx) }, true), (cmd) =>
          Effect.map(run(manager.retryWorker(cmd.activeSessionId)), ok(ctx)))
    }],
    [/^\/v1\/sessions\/([^/]+)\/rename$/, {
      POST: (ctx) =>
        Effect.flatMap(command("rename", ctx, { activeSessionId: sessionId(ctx) }, true), (cmd) => Effect.map(run(manager.rename(cmd)), ok(ctx)))
    }],
    [/^\/v1\/sessions\/([^/]+)\/messages$/, {
      GET: (ctx) => {
        // A query value is text: one that is not a whole number is refused here, by what it is
        // (the socket's schema would say it is a string). Bounds (limit <= 1000) stay the schema's.
        const fields: Record<string, number> = {}
        for (const name of ["offset", "limit"]) {
          const v = ctx.url.searchParams.get(name)
          if (v === null) continue
          if (!/^\d+$/.test(v)) {
            return refuse("invalid_command", `Invalid \`get_messages\` query: \`${name}\` must be a whole number >= 0, got ${JSON.stringify(v.slice(0, 32))}.`)
          }
          fields[name] = Number(v)
        }
        return Effect.flatMap(
          command("get_messages", ctx, { activeSessionId: sessionId(ctx), ...fields }, false),
          (cmd) => Effect.map(run(manager.getMessages(cmd)), ok(ctx))
        )
      }
    }],
    [/^\/v1\/sessions\/([^/]+)\/events$/, { GET: events }],
    [/^\/v1\/sessions\/([^/]+)\/snapshot$/, { GET: snapshot }]
  ]

  const login = (ctx: RequestContext) => {
    if (!tokenMatches(ctx.url.searchParams.get("token") ?? undefined, token)) {
      return refuse("unauthorized", "The login link's token is not this daemon's (`agentd http-token` prints it).")
    }
    return Effect.succeed(HttpServerResponse.empty({
      status: 303,
      headers: {
        location: "/",
        [REQUEST_ID_HEADER]: ctx.requestId,
        "cache-control": "no-store",
        // The token leaves the address bar at once (the redirect) and lives on in a cookie
        // scripts cannot read and other sites cannot send.
        "set-cookie": `${Security.COOKIE_NAME}=${token}; HttpOnly; SameSite=Strict; Path=/`,
        "referrer-policy": "no-referrer"
      }
    }))
  }

  const app = Effect.gen(function*() {
    const request = yield* HttpServerRequest.HttpServerRequest
    const headers = request.headers
    const requestId = requestIdOf(headers)
    const respond = Effect.gen(function*() {
      let url: URL
      try {
        // Appended, not resolved: a path starting `//` would be read as a host (`//v1/status`).
        url = request.url.startsWith("/") ? new URL(`http://localhost${request.url}`) : new URL(request.url, "http://localhost")
      } catch {
        return yield* refuse("not_found", "The request's path cannot be read.")
      }
      const isLogin = url.pathname === "/login"
      const verdict = Security.check(headers, listen, port, token, !isLogin)
      if (verdict._tag === "Refuse") return yield* refuse(verdict.code, verdict.message)
      const ctx = (params: ReadonlyArray<string>): RequestContext => ({ request, url, params, requestId })
      if (isLogin) {
        if (request.method !== "GET" && request.method !== "HEAD") {
          return yield* refuse("method_not_allowed", `${request.method} is not allowed on /login.`, { allow: "GET, HEAD" })
        }
        return yield* login(ctx([]))
      }
      for (const [pattern, methods] of routes) {
        const m = pattern.exec(url.pathname)
        if (m === null) continue
        const handler = methods[request.method] ?? (request.method === "HEAD" ? methods["GET"] : undefined)
        if (handler === undefined) {
          const allow = Object.keys(methods).join(", ")
          return yield* refuse("method_not_allowed", `${request.method} is not allowed on this path (allowed: ${allow}).`, { allow })
        }
        let params: Array<string>
        try {
          params = m.slice(1).map((p) => decodeURIComponent(p))
        } catch {
          return yield* refuse("not_found", "The path's session id is not valid percent-encoding.")
        }
        return yield* handler(ctx(params))
      }
      return yield* refuse("not_found", `No route for ${request.method} ${url.pathname.slice(0, 200)}.`)
    })
    // Interruptible: a request's waits (a long-poll, an event read) end when the client goes
    // away or at a stop, and their timeouts can cut them.
    const response = yield* Effect.interruptible(respond).pipe(
      Effect.catchAll((r) => Effect.succeed(errorResponse(r.code, r.message, requestId, r.headers))),
      Effect.catchAllDefect((defect) =>
        Effect.gen(function*() {
          yield* Effect.logError(`HTTP request ${requestId} died: ${scrub(String(defect))}`)
          return errorResponse("internal", "Internal error.", requestId)
        })
      )
    )
    yield* Metric.increment(Metrics.httpRequests(response.status))
    return response
  })

  yield* server.serve(app)
  yield* Effect.logInfo(`agentd HTTP at ${url} (log in with ${url}/login?token=..., \`agentd http-token\` prints the token)`)

  // Runs before the server's own close (finalizers run in reverse): the event streams and
  // sockets end first, so that closing the server does not wait for them forever.
  yield* Effect.addFinalizer(() => stopStreams)

  return HttpFront.of({ host: listen.host, port, url })
})

/** The HTTP front, over the daemon's sessions. */
export const layer: Layer.Layer<HttpFront, HttpStartError, DaemonConfig | SessionManager | EventLog | SupervisorInfo | SnapshotCache> = Layer.scoped(
  HttpFront,
  make
)

/** The HTTP front when the configuration asks for one (`http`), nothing otherwise. */
export const layerIfConfigured: Layer.Layer<never, HttpStartError, DaemonConfig | SessionManager | EventLog | SupervisorInfo | SnapshotCache> = Layer
  .unwrapEffect(Effect.map(DaemonConfig, (config) => (config.http === undefined ? Layer.empty : Layer.discard(layer))))
