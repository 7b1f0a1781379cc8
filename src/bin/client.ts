/** The CLI's client commands (everything but `serve`). */
import * as Console from "effect/Console"
import * as Effect from "effect/Effect"
import * as Queue from "effect/Queue"
import * as DaemonClient from "../DaemonClient.js"
import type { SessionSummary } from "../Protocol.js"

const withConnection = <A, E>(socketPath: string, f: (c: DaemonClient.Connection) => Effect.Effect<A, E>) =>
  Effect.scoped(Effect.flatMap(DaemonClient.connect(socketPath), f))

const print = (json: boolean, value: unknown, text: () => string) =>
  Console.log(json ? JSON.stringify(value) : text())

export const create = (socketPath: string, name: string | undefined, json: boolean) =>
  withConnection(socketPath, (c) =>
    Effect.gen(function*() {
      const data = (yield* c.request({ type: "create", ...(name === undefined ? {} : { name }) })) as { activeSessionId: string }
      yield* print(json, data, () => data.activeSessionId)
    }))

export const sessions = (socketPath: string, json: boolean) =>
  withConnection(socketPath, (c) =>
    Effect.gen(function*() {
      const data = (yield* c.request({ type: "list" })) as { sessions: Array<SessionSummary> }
      yield* print(json, data, () =>
        data.sessions.map((s) =>
          `${s.activeSessionId}\t${s.name ?? "-"}\t${s.worker}${s.busy ? " busy" : ""}\t${s.messageCount} messages`
        ).join("\n") || "(no sessions)")
    }))

export const status = (socketPath: string, json: boolean) =>
  withConnection(socketPath, (c) =>
    Effect.gen(function*() {
      const data = (yield* c.request({ type: "status" })) as { supervisorGeneration: number; pid: number; uptimeMs: number; sessions: number; workers: Array<unknown> }
      yield* print(json, data, () =>
        `agentd pid ${data.pid}, supervisor generation ${data.supervisorGeneration}, up ${Math.round(data.uptimeMs / 1000)} s, ${data.sessions} sessions, ${data.workers.length} workers`)
    }))

export const simple = (socketPath: string, command: Parameters<DaemonClient.Connection["request"]>[0]) =>
  withConnection(socketPath, (c) => Effect.asVoid(c.request(command)))

/** Sends a prompt and streams the assistant's text until the turn ends. */
export const prompt = (socketPath: string, activeSessionId: string, message: string, json: boolean) =>
  withConnection(socketPath, (c) =>
    Effect.gen(function*() {
      yield* c.request({ type: "attach", activeSessionId, capabilities: ["event_sequence", "slim_attach"] })
      yield* c.request({ type: "prompt", activeSessionId, message })
      while (true) {
        const msg = (yield* Queue.take(c.messages)) as {
          type?: string
          event?: { type: string; delta?: string }
          meta?: { replayed?: boolean }
        } | null
        if (msg === null) return
        // The attach baseline replays earlier turns: only this turn's live events count.
        if (msg.type !== "session_event" || msg.meta?.replayed === true) continue
        if (json && msg.type === "session_event") yield* Console.log(JSON.stringify(msg))
        const event = msg.event
        if (!json && event?.type === "message_update") process.stdout.write(event.delta ?? "")
        if (event?.type === "agent_end" || event?.type === "turn_interrupted") {
          if (!json) process.stdout.write("\n")
          return
        }
      }
    }))

/** Follows a session's events, reconnecting and resuming from the last cursor. */
export const attach = (socketPath: string, activeSessionId: string, json: boolean) =>
  Effect.gen(function*() {
    let cursor: { generation: number; sequence: number } | undefined
    while (true) {
      const result = yield* Effect.either(withConnection(socketPath, (c) =>
        Effect.gen(function*() {
          yield* c.request({
            type: "attach",
            activeSessionId,
            capabilities: ["event_sequence", "slim_attach"],
            ...(cursor === undefined ? {} : { resumeCursor: cursor })
          })
          while (true) {
            const msg = (yield* Queue.take(c.messages)) as {
              type?: string
              event?: { type: string; delta?: string }
              reason?: string
              meta?: { cursor: { generation: number; sequence: number } }
            } | null
            if (msg === null) return "disconnected" as const
            if (msg.meta?.cursor !== undefined) cursor = msg.meta.cursor
            if (json) {
              yield* Console.log(JSON.stringify(msg))
            } else if (msg.type === "session_event" && msg.event?.type === "message_update") {
              process.stdout.write(msg.event.delta ?? "")
            } else if (msg.type === "session_event" && msg.event?.type === "message_end") {
              process.stdout.write("\n")
            }
            if (msg.type === "session_closed") return "closed" as const
          }
        })))
      if (result._tag === "Right" && result.right === "closed") return
      if (result._tag === "Left" && result.left._tag === "DaemonError") return yield* result.left
      // Daemon gone or restarting: try again shortly and resume from the last cursor.
      yield* Effect.sleep("500 millis")
    }
  })
