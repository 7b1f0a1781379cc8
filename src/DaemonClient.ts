/**
 * A client of the daemon over its socket: commands with their responses, and the server's
 * other messages (events, snapshot frames) as they come. Used by the CLI.
 */
import * as Data from "effect/Data"
import * as Deferred from "effect/Deferred"
import * as Effect from "effect/Effect"
import * as Queue from "effect/Queue"
import type * as Scope from "effect/Scope"
import * as net from "node:net"
import { LineDecoder } from "./JsonLines.js"
import * as Protocol from "./Protocol.js"

/** Nothing answers at the socket path. */
export class DaemonUnreachable extends Data.TaggedError("DaemonUnreachable")<{
  readonly socketPath: string
  readonly message: string
}> {}

/** The daemon answered a command with an error. */
export class DaemonError extends Data.TaggedError("DaemonError")<{
  readonly code: string
  readonly message: string
}> {}

export interface Connection {
  readonly hello: Protocol.DaemonHello
  /** Sends a command and waits for its response's data. */
  readonly request: (command: Protocol.Command) => Effect.Effect<unknown, DaemonError | DaemonUnreachable>
  /** Every message that is not a response, in arrival order; `null` when the connection ends. */
  readonly messages: Queue.Dequeue<unknown>
}

/** Connects, reads `daemon_hello`; the connection closes with the scope. */
export const connect = (socketPath: string): Effect.Effect<Connection, DaemonUnreachable, Scope.Scope> =>
  Effect.gen(function*() {
    const messages = yield* Queue.unbounded<unknown>()
    const hello = yield* Deferred.make<Protocol.DaemonHello, DaemonUnreachable>()
    const pending = new Map<string, Deferred.Deferred<unknown, DaemonError | DaemonUnreachable>>()
    let next = 0
    const unreachable = (message: string) => new DaemonUnreachable({ socketPath, message })
    const socket = yield* Effect.acquireRelease(
      Effect.async<net.Socket, DaemonUnreachable>((resume) => {
        const s = net.connect(socketPath)
        s.once("connect", () => resume(Effect.succeed(s)))
        s.once("error", (err) => resume(Effect.fail(unreachable(`cannot connect to ${socketPath}: ${err.message}`))))
      }),
      (s) => Effect.sync(() => s.destroy())
    )
    const decoder = new LineDecoder(Number.MAX_SAFE_INTEGER)
    socket.on("data", (chunk: Buffer) => {
      for (const line of decoder.push(chunk)) {
        if (typeof line !== "string") continue
        const message = JSON.parse(line) as { type?: string; id?: string; success?: boolean; data?: unknown; error?: { code: string; message: string } }
        if (message.type === "daemon_hello") Deferred.unsafeDone(hello, Effect.succeed(message as Protocol.DaemonHello))
        else if (message.type === "response" && typeof message.id === "string" && pending.has(message.id)) {
          const waiter = pending.get(message.id)!
          pending.delete(message.id)
          Deferred.unsafeDone(
            waiter,
            message.success === true
              ? Effect.succeed(message.data)
              : Effect.fail(new DaemonError({ code: message.error?.code ?? "internal", message: message.error?.message ?? "" }))
          )
          // Attach frames follow their response: keep the order visible to readers.
          if (message.success === true) Queue.unsafeOffer(messages, message)
        } else Queue.unsafeOffer(messages, message)
      }
    })
    socket.on("close", () => {
      Deferred.unsafeDone(hello, Effect.fail(unreachable("the daemon closed the connection")))
      for (const waiter of pending.values()) Deferred.unsafeDone(waiter, Effect.fail(unreachable("the daemon closed the connection")))
      pending.clear()
      Queue.unsafeOffer(messages, null)
    })
    socket.on("error", () => {})
    const helloMessage = yield* Deferred.await(hello)
    return {
      hello: helloMessage,
      messages,
      request: (command) =>
        Effect.gen(function*() {
          const id = `r${++next}`
          const waiter = yield* Deferred.make<unknown, DaemonError | DaemonUnreachable>()
          pending.set(id, waiter)
          socket.write(Protocol.encodeCommand(id, command, helloMessage.clientId))
          return yield* Deferred.await(waiter)
        })
    }
  })
