/**
 * The socket server (docs/protocol.md sections 1-3): stale-socket probe, 0700 dir, 0600 socket,
 * `daemon_hello`, envelope and bare commands, one response per command in order (a command that
 * waits for its answer does not hold back the next one's effect), every documented error code
 * for bad input, and at shutdown a response for every command taken. Each connection runs in
 * its own fibers; a connection's failure is logged and contained.
 *
 * Built on `node:net` rather than @effect/platform's SocketServer: the protocol needs responses
 * to reach half-closed clients (the platform socket is destroyed once its reader ends) and
 * per-write drain callbacks for the outbox's byte accounting.
 */
import * as Cause from "effect/Cause"
import * as Context from "effect/Context"
import * as Deferred from "effect/Deferred"
import * as Effect from "effect/Effect"
import * as Either from "effect/Either"
import * as Fiber from "effect/Fiber"
import * as FiberId from "effect/FiberId"
import * as FiberSet from "effect/FiberSet"
import * as Layer from "effect/Layer"
import * as Queue from "effect/Queue"
import { randomUUID } from "node:crypto"
import * as fs from "./internal/fileIoSync.js"
import { probeSocket } from "./internal/liveness.js"
import * as net from "node:net"
import * as path from "node:path"
import { DaemonConfig } from "./DaemonConfig.js"
import { type CommandHead, scanCommandHead } from "./internal/commandHead.js"
import { Outbox } from "./internal/outbox.js"
import * as Metrics from "./Metrics.js"
import { LineDecoder, type LineItem } from "./JsonLines.js"
import * as Protocol from "./Protocol.js"
import { CommandError, type CommandProgress, CommandTakesEffect, internalOfCause, progressDone, SessionManager, SupervisorInfo } from "./SessionManager.js"

/** The version this daemon reports in `daemon_hello`. */
export const APP_VERSION = "0.1.0"

/** The server could not start. */
export class ServerStartError extends Error {
  readonly _tag = "ServerStartError"
}

/** The running server: resolves `shutdownRequested` when a client sends `shutdown`. */
export class DaemonServer extends Context.Tag("agentd/DaemonServer")<DaemonServer, {
  readonly socketPath: string
  readonly shutdownRequested: Deferred.Deferred<void>
}>() {}

/**
 * Makes the socket path ours: creates its directory (0700) if missing, removes a stale socket
 * file (nothing answers), fails if a daemon answers there. Anything else at the path (a file, a
 * directory) is refused, never removed: it is not ours. Run before anything touches the state
 * dir, so a refused second daemon changes nothing.
 */
export const claimSocketPath = (socketPath: string): Effect.Effect<void, ServerStartError> =>
  Effect.gen(function*() {
    const socketDir = path.dirname(socketPath)
    if (!fs.existsSync(socketDir)) fs.mkdirSync(socketDir, { recursive: true, mode: 0o700 })
    const existing = fs.lstatSync(socketPath, { throwIfNoEntry: false })
    if (existing === undefined) return
    if (!existing.isSocket()) {
      return yield* Effect.fail(new ServerStartError(`${socketPath} exists and is not a socket; not removing it`))
    }
    // A listener that does not answer within a second is taken for gone.
    if ((yield* Effect.promise(() => probeSocket(socketPath))) === "answers") {
      return yield* Effect.fail(new ServerStartError(`another daemon is listening at ${socketPath}`))
    }
    fs.unlinkSync(socketPath)
  })

/** Listens with umask 077 so the socket is never world-accessible, then pins it to 0600. */
const listen = (server: net.Server, socketPath: string) =>
  Effect.async<void, ServerStartError>((resume) => {
    const previous = process.umask(0o077)
    const onError = (err: Error) => {
      process.umask(previous)
      resume(Effect.fail(new ServerStartError(`cannot listen at ${socketPath}: ${err.message}`)))
    }
    server.once("error", onError)
    server.listen(socketPath, () => {
      process.umask(previous)
      server.off("error", onError)
      fs.chmodSync(socketPath, 0o600)
      resume(Effect.void)
    })
  })

const MAX_PENDING_LINES = 1024
/**
 * Bytes of complete lines read and not yet taken past which a connection is not read further
 * (a line is at most maxLineBytes, which the decoder holds while it is incomplete).
 */
const MAX_PENDING_BYTES = 1024 * 1024
/** At a stop, how long the sessions may take to answer the commands waiting in them. */
const SETTLE_MS = 5_000
/** At a stop, how long the answers then due may take to be queued for their connections. */
const ANSWER_MS = 2_000

/**
 * Waits for `effect` at most `ms`. A finalizer runs uninterruptibly, and there a timeout cannot
 * cut what it times (it would wait for it all the same): the effect is made interruptible.
 */
const bounded = (effect: Effect.Effect<unknown>, ms: number): Effect.Effect<void> =>
  Effect.interruptible(effect).pipe(Effect.timeout(ms), Effect.ignore)

export const make = Effect.gen(function*() {
  const config = yield* DaemonConfig
  const manager = yield* SessionManager
  const info = yield* SupervisorInfo
  const socketPath = config.socketPath
  const shutdownRequested = yield* Deferred.make<void>()
  const connectionFibers = yield* FiberSet.make()
  const outboxes = new Set<Outbox>()
  /** Every open connection's socket, until it has closed (a stop closes those left). */
  const sockets = new Set<net.Socket>()
  let stopping = false
  let counter = 0
  /** Commands taken on any connection whose response is not written yet. */
  let unanswered = 0

  yield* claimSocketPath(socketPath)

  // Callbacks of node's sockets run their effects as fibers of the server (the daemon's runtime
  // and logger), interrupted when it closes.
  const runFork = yield* FiberSet.runtime(connectionFibers)<never>()

  const dispatch = (clientId: string, outbox: Outbox, command: Protocol.Command) =>
    Effect.gen(function*(): Effect.fn.Return<unknown, CommandError> {
      if (stopping && command.type !== "ping") {
        return yield* new CommandError({ code: "shutting_down", message: "The daemon is shutting down." })
      }
      switch (command.type) {
        case "ping":
          return { pong: true }
        case "create":
          return yield* manager.create(command)
        case "list":
          return yield* manager.list
        case "status":
          return yield* manager.status
        case "attach": {
          // The response goes out first; the snapshot frames and events follow it.
          const outcome = yield* manager.attach(clientId, outbox, command)
          return new ThenRun(outcome.data, outcome.deliver)
        }
        case "detach":
          yield* manager.detach(clientId, command.activeSessionId)
          return {}
        case "prompt":
          return yield* manager.prompt(command)
        case "abort":
          return yield* manager.abort(command)
        case "get_state":
          return yield* manager.getState(command.activeSessionId)
        case "get_messages":
          return yield* manager.getMessages(command)
        case "checkpoint":
          return yield* manager.checkpoint(command.activeSessionId)
        case "retry_worker":
          return yield* manager.retryWorker(command.activeSessionId)
        case "kill":
          return yield* manager.kill(command.activeSessionId)
        case "rename":
          return yield* manager.rename(command)
        case "shutdown":
          stopping = true
          // Whatever waits in a session is answered now (so this response is not held behind
          // an earlier one); the stop is asked once this response is written: `daemon_closing`
          // comes after it.
          yield* manager.settleForShutdown
          return new ThenRun({}, Deferred.succeed(shutdownRequested, undefined))
      }
    })

  const handleConnection = (socket: net.Socket) =>
    Effect.gen(function*() {
      const clientId = `c-${++counter}-${randomUUID().slice(0, 8)}`
      /** This connection's share of `unanswered`. */
      let owed = 0
      const outbox = new Outbox(socket)
      outboxes.add(outbox)
      Metrics.gaugeBy(Metrics.clients.socket, 1)
      yield* Effect.addFinalizer(() =>
        Effect.gen(function*() {
          Metrics.gaugeBy(Metrics.clients.socket, -1)
          outboxes.delete(outbox)
          // Answers this connection will not write any more (it closed or was interrupted).
          unanswered -= owed
          owed = 0
          yield* manager.detachAll(clientId)
          socket.destroy()
        })
      )
      const decoder = new LineDecoder(config.maxLineBytes)
      const lines = yield* Queue.unbounded<LineItem | null>()
      const deliveries = yield* FiberSet.make()
      const closed = yield* Deferred.make<void>()
      let pending = 0
      let pendingBytes = 0
      const sizeOf = (item: LineItem | null) => (typeof item === "string" ? item.length : 0)

      outbox.offer(Protocol.encode({
        type: "daemon_hello",
        protocol: Protocol.PROTOCOL,
        clientId,
        supervisorGeneration: info.generation,
        supervisorPid: process.pid,
        appVersion: APP_VERSION,
        serverCapabilities: Protocol.SERVER_CAPABILITIES,
        // An extension (docs/protocol.md section 9): clients refuse a prompt over it up front.
        limits: { maxLineBytes: config.maxLineBytes }
      }))

      socket.on("data", (chunk: Buffer) => {
        const items = decoder.push(chunk)
        pending += items.length
        for (const item of items) {
          pendingBytes += sizeOf(item)
          Queue.unsafeOffer(lines, item)
        }
        // A client that sends faster than we answer is paused, not buffered without bound.
        if (pending > MAX_PENDING_LINES || pendingBytes > MAX_PENDING_BYTES) socket.pause()
      })
      socket.on("end", () => {
        for (const item of [...decoder.end(), null]) Queue.unsafeOffer(lines, item)
      })
      socket.on("error", (err) => runFork(Effect.logDebug(`client ${clientId}: ${err.message}`)))
      socket.on("close", () => {
        outbox.close()
        Queue.unsafeOffer(lines, null)
        Deferred.unsafeDone(closed, Effect.void)
      })

      /** Runs what follows an answer (an attach's delivery), and the writer of owed answers. */
      const runDelivery = yield* FiberSet.runtime(deliveries)<never>()

      /** A line's answer: its response, and what follows it (an attach's delivery). */
      type Answer = { readonly response: Protocol.ServerMessage; readonly then?: Effect.Effect<void> }

      /** A line as a command to run, or its answer already (bad input). */
      const decodeLine = (item: LineItem) =>
        Effect.gen(function*(): Effect.fn.Return<Answer | Protocol.DecodedCommand> {
          if (typeof item !== "string") {
            // Its id and type, when its head holds them: the client that sent it can match the
            // answer (the rest of the line was never kept).
            let head: CommandHead = { id: null, command: "parse" }
            try {
              head = scanCommandHead(Buffer.from(item.head.buffer, item.head.byteOffset, item.head.byteLength).toString("utf8"))
            } catch (defect) {
              yield* Effect.logError(`reading the head of a too-long line of ${clientId} died`, defect)
            }
            return {
              response: Protocol.failure(head.id, head.command, {
                code: "line_too_long",
                message: `The line is longer than ${item.maxLineBytes} bytes; it was discarded.`,
                details: { maxLineBytes: item.maxLineBytes }
              })
            }
          }
          // The decoder never throws by contract; should it ever, the line still gets its one
          // response and the connection lives on (a defect here would end the connection).
          let decoded: Either.Either<Protocol.DecodedCommand, Protocol.ProtocolError>
          try {
            decoded = Protocol.decodeCommandLine(item)
          } catch (defect) {
            yield* Effect.logError(`decoding a line of ${clientId} died`, defect)
            return { response: Protocol.failure(null, "parse", { code: "internal", message: `Internal error: ${String(defect)}` }) }
          }
          return Either.isLeft(decoded) ? { response: Protocol.failureOf(decoded.left) } : decoded.right
        })

      const answerCommand = ({ command, id }: Protocol.DecodedCommand) =>
        Effect.gen(function*(): Effect.fn.Return<Answer> {
          // A command that died, or whose effect was interrupted by someone else than this
          // connection (a cluster owner that lost the session mid-command), is still answered:
          // uncaught, an interruption would end the connection (or, for a command answered in
          // its own fiber, stop every answer after it). This connection's own interruption is
          // not caught.
          const result = yield* Effect.either(dispatch(clientId, outbox, command)).pipe(
            Effect.catchAllCause((cause) =>
              Effect.gen(function*() {
                const interrupted = Cause.isInterruptedOnly(cause)
                yield* (interrupted ? Effect.logWarning : Effect.logError)(
                  `command ${command.type} of ${clientId} ${interrupted ? "was interrupted" : "died"}`,
                  cause
                )
                return Either.left(internalOfCause(cause))
              })
            )
          )
          if (Either.isLeft(result)) {
            return { response: Protocol.failure(id, command.type, { code: result.left.code, message: result.left.message }) }
          }
          if (result.right instanceof ThenRun) {
            return { response: Protocol.success(id, command.type, result.right.data), then: result.right.then }
          }
          return { response: Protocol.success(id, command.type, result.right) }
        })

      // Commands take effect one at a time, in the order received, and their answers are
      // written in that order. A command that may wait for its answer (a checkpoint during a
      // turn, a prompt while the worker starts) runs in a fiber of its own once it has taken
      // effect, so that it does not hold back the ones after it: an abort behind a checkpoint
      // still aborts the turn. The others answer at once. A bounded number may be owed.
      // Taking effect is its session's step; the writes that step asked for (a prompt's busy
      // record and status, fsynced) go on beside the commands after it: those to the same session
      // queue behind it in its mailbox, and the others wait for them only if they read sessions
      // (`get_state`, `list`, every command that is not a session's own). 200 prompts to 200
      // sessions on one connection took their fsyncs one after another (25-45 s on a loaded
      // machine); now they share the journal's and logs' group commits.
      const answering = yield* FiberSet.make<Answer>()
      /** Commands that took effect whose writes may not be done (`settled` not yet completed). */
      let unsettled: Array<Deferred.Deferred<void>> = []
      /** Answers owed behind one still being answered, in command order. */
      const owedAnswers: Array<Answer | Fiber.Fiber<Answer>> = []
      let flushing = false
      /** Completed when an owed answer is written (for whoever waits for room or for the end). */
      let progress: Deferred.Deferred<void> | undefined
      const written = Effect.suspend(() => Deferred.await(progress ??= Deferred.unsafeMake<void>(FiberId.none)))
      const write = (answer: Answer) => {
        outbox.offer(Protocol.encode(answer.response))
        if (answer.then !== undefined) runDelivery(answer.then)
        unanswered--
        owed--
      }
      /** Writes the owed answers in order, waiting for each one still being answered. */
      const flush = Effect.gen(function*() {
        while (owedAnswers.length > 0) {
          const head = owedAnswers[0]!
          const answer = Fiber.isFiber(head) ? yield* Fiber.join(head) : head
          owedAnswers.shift()
          write(answer)
          if (progress !== undefined) {
            Deferred.unsafeDone(progress, Effect.void)
            progress = undefined
          }
        }
        flushing = false
      })
      const owe = (answer: Answer | Fiber.Fiber<Answer>) => {
        // Nothing owed ahead of a ready answer: written at once.
        if (!flushing && !Fiber.isFiber(answer)) return write(answer)
        owedAnswers.push(answer)
        if (flushing) return
        flushing = true
        runDelivery(flush)
      }
      while (true) {
        const item = yield* Queue.take(lines)
        if (item === null) break
        pending--
        pendingBytes -= sizeOf(item)
        // Bounded: a client that does not read what it is sent (its outbox holds outboxBytes or
        // more) has no further command run, and with the lines above taken no more is read from
        // it, so its own writes back up; it goes on once it reads.
        if (outbox.queuedBytes >= config.outboxBytes) yield* outbox.awaitBelow(config.outboxBytes)
        if (pending <= MAX_PENDING_LINES / 2 && pendingBytes <= MAX_PENDING_BYTES / 2 && socket.isPaused()) socket.resume()
        // Bounded: a client whose answers wait is not read further meanwhile.
        while (owedAnswers.length >= MAX_PENDING_LINES) yield* written
        unanswered++
        owed++
        const decoded = yield* decodeLine(item)
        if ("response" in decoded) {
          owe(decoded)
        } else if (MAY_WAIT.has(decoded.command.type)) {
          const progress: CommandProgress = { taken: yield* Deferred.make<void>(), settled: yield* Deferred.make<void>() }
          const answer = yield* FiberSet.run(
            answering,
            answerCommand(decoded).pipe(
              Effect.locally(CommandTakesEffect, progress),
              Effect.ensuring(progressDone(progress))
            )
          )
          yield* Deferred.await(progress.taken)
          if (unsettled.length >= MAX_PENDING_LINES) unsettled = yield* Effect.filter(unsettled, (d) => Effect.map(Deferred.isDone(d), (done) => !done))
          unsettled.push(progress.settled)
          owe(answer)
        } else {
          for (const settled of unsettled) yield* Deferred.await(settled)
          unsettled = []
          owe(yield* answerCommand(decoded))
        }
      }
      // Every answer owed is written before the connection may end.
      while (owedAnswers.length > 0) yield* written
      // Half-closed: events keep flowing to the sessions it is attached to; once none is left,
      // the connection ends after its last response.
      while (manager.attachedCount(clientId) > 0 && !outbox.isClosed) {
        yield* Effect.race(Deferred.await(closed), Effect.sleep("100 millis"))
      }
      outbox.endWhenFlushed()
      yield* Deferred.await(closed)
    }).pipe(
      Effect.scoped,
      Effect.catchAllCause((cause) => Effect.logError("connection failed", cause))
    )

  const server = net.createServer({ allowHalfOpen: true })
  server.on("connection", (socket) => {
    if (stopping) {
      socket.destroy()
      return
    }
    sockets.add(socket)
    socket.once("close", () => sockets.delete(socket))
    runFork(handleConnection(socket))
  })
  server.on("error", (err) => runFork(Effect.logError(`server: ${err.message}`)))
  yield* listen(server, socketPath)
  yield* Effect.logInfo(`agentd listening at ${socketPath} (supervisor generation ${info.generation}, pid ${process.pid})`)

  yield* Effect.addFinalizer(() =>
    Effect.gen(function*() {
      stopping = true
      // Every command gets its response first: those waiting in a session are answered
      // `shutting_down`, then their responses are written (bounded: a stuck one is not waited for).
      yield* bounded(manager.settleForShutdown, SETTLE_MS)
      yield* bounded(Effect.sleep("10 millis").pipe(Effect.repeat({ while: () => unanswered > 0 })), ANSWER_MS)
      // Tell every client, end each connection once what it is owed is written, and give the
      // clients the grace period to read it and close. Whatever is still open then (a client
      // that does not read, reads slowly, or half-closed and keeps its read side open) is
      // closed anyway: a client never keeps the daemon alive.
      const closing = Protocol.encode({ type: "daemon_closing", reason: "shutdown" })
      // `daemon_closing` is the last line of each: a delivery still under way (a replay) stops
      // there, and the client resumes it from its cursor.
      for (const outbox of outboxes) outbox.endWith(closing)
      server.close()
      yield* bounded(Effect.sleep("10 millis").pipe(Effect.repeat({ while: () => sockets.size > 0 })), config.shutdownGraceMs)
      if (sockets.size > 0) {
        yield* Effect.logInfo(`closing ${sockets.size} connection(s) still open after the ${config.shutdownGraceMs} ms grace period`)
      }
      for (const socket of sockets) socket.destroy()
      // Their fibers end with their sockets (bounded all the same: nothing here may hang the stop).
      yield* bounded(FiberSet.clear(connectionFibers), ANSWER_MS)
      try {
        fs.unlinkSync(socketPath)
      } catch {
        // Already gone.
      }
    })
  )

  return DaemonServer.of({ socketPath, shutdownRequested })
})

/** The commands whose answer may wait for a turn's end or a worker (see handleConnection). */
const MAY_WAIT: ReadonlySet<string> = new Set(["prompt", "abort", "checkpoint", "retry_worker", "kill"])

/**
 * A command's data, and what runs once its response is written: an attach's delivery (snapshot
 * frames, events), a shutdown's request (then `daemon_closing`).
 */
class ThenRun {
  constructor(readonly data: unknown, readonly then: Effect.Effect<unknown>) {}
}

/** The socket server layer. */
export const layer: Layer.Layer<DaemonServer, ServerStartError, DaemonConfig | SessionManager | SupervisorInfo> = Layer
  .scoped(DaemonServer, make)
