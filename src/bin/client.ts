/** The CLI's client commands (everything but `serve`), over the Effect client. */
import * as Console from "effect/Console"
import * as Effect from "effect/Effect"
import * as Stream from "effect/Stream"
import type { Cursor } from "../Cursor.js"
import * as DaemonClient from "../DaemonClient.js"

const withClient = <A, E>(socketPath: string, f: (c: DaemonClient.DaemonClientService) => Effect.Effect<A, E>) =>
  Effect.scoped(Effect.flatMap(DaemonClient.make({ socketPath }), f))

const print = (json: boolean, value: unknown, text: () => string) => Console.log(json ? JSON.stringify(value) : text())

export const create = (socketPath: string, name: string | undefined, json: boolean) =>
  withClient(socketPath, (c) =>
    Effect.gen(function*() {
      const data = yield* c.create(name === undefined ? {} : { name })
      yield* print(json, data, () => data.activeSessionId)
    }))

export const sessions = (socketPath: string, json: boolean) =>
  withClient(socketPath, (c) =>
    Effect.gen(function*() {
      const data = yield* c.list()
      yield* print(json, data, () =>
        data.sessions.map((s) =>
          `${s.activeSessionId}\t${s.name ?? "-"}\t${s.worker}${s.busy ? " busy" : ""}\t${s.messageCount} messages`
        ).join("\n") || "(no sessions)")
    }))

export const status = (socketPath: string, json: boolean) =>
  withClient(socketPath, (c) =>
    Effect.gen(function*() {
      const data = yield* c.status()
      yield* print(json, data, () =>
        `agentd pid ${data.pid}, supervisor generation ${data.supervisorGeneration}, up ${Math.round(data.uptimeMs / 1000)} s, ${data.sessions} sessions, ${data.workers.length} workers`)
    }))

export const kill = (socketPath: string, activeSessionId: string) => withClient(socketPath, (c) => c.kill(activeSessionId))

export const shutdown = (socketPath: string) => withClient(socketPath, (c) => c.shutdown())

/**
 * Sends a prompt and streams the assistant's text until the turn ends. A turn that ends with
 * `turn_interrupted` fails with `TurnInterrupted` (exit 1, reason on stderr).
 */
export const prompt = (socketPath: string, activeSessionId: string, message: string, json: boolean) =>
  withClient(socketPath, (c) =>
    c.promptTurn(activeSessionId, message).pipe(
      Stream.runForEach((m) =>
        json
          ? Console.log(JSON.stringify(m))
          : Effect.sync(() => {
            if (m.event.type === "message_update") process.stdout.write(m.event.delta)
          })
      ),
      Effect.ensuring(json ? Effect.void : Effect.sync(() => process.stdout.write("\n")))
    ))

/** Follows a session's events, reconnecting and resuming from the last cursor. */
export const attach = (socketPath: string, activeSessionId: string, json: boolean) =>
  Effect.gen(function*() {
    let cursor: Cursor | undefined
    while (true) {
      const result = yield* Effect.either(withClient(socketPath, (c) =>
        Effect.scoped(Effect.gen(function*() {
          const messages = yield* c.subscribe
          yield* c.attach(activeSessionId, {
            capabilities: ["event_sequence", "slim_attach"],
            ...(cursor === undefined ? {} : { resumeCursor: cursor })
          })
          yield* messages.pipe(
            Stream.tap((msg) =>
              Effect.gen(function*() {
                if ("meta" in msg) cursor = msg.meta.cursor
                if (json) {
                  yield* Console.log(JSON.stringify(msg))
                } else if (msg.type === "session_event" && msg.event.type === "message_update") {
                  process.stdout.write(msg.event.delta)
                } else if (msg.type === "session_event" && msg.event.type === "message_end") {
                  process.stdout.write("\n")
                }
              })
            ),
            Stream.takeUntil((msg) => msg.type === "session_closed" && msg.activeSessionId === activeSessionId),
            Stream.runDrain
          )
        }))
      ))
      if (result._tag === "Right") return
      const error = result.left
      // Daemon gone or restarting: try again shortly and resume from the last cursor.
      if (error._tag !== "DaemonUnreachable" && error._tag !== "DaemonDisconnected") return yield* error
      yield* Effect.sleep("500 millis")
    }
  })
