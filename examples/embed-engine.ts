/**
 * The engine of the embed example (embed.ts): `reverse` answers with the prompt's words in
 * reverse order, one word per delta. Its registry keeps the built-in `echo` beside it.
 */
import { EchoEngine, Engine, type Protocol } from "agentd"
import * as Effect from "effect/Effect"
import * as Layer from "effect/Layer"
import * as Stream from "effect/Stream"

const message = (id: string, role: Protocol.AgentMessage["role"], content: string): Protocol.AgentMessage => ({
  id,
  role,
  content,
  timestamp: Date.now()
})

const reverse: Engine.EngineDefinition = {
  validate: () => Effect.void,
  make: () =>
    Effect.succeed({
      runTurn: ({ message: prompt, turnId }) => {
        const user = message(`${turnId}-u`, "user", prompt)
        const words = prompt.split(/\s+/).filter((w) => w !== "").reverse()
        const deltas = words.map((w, i) => (i === 0 ? w : ` ${w}`))
        const reply = message(`${turnId}-a`, "assistant", deltas.join(""))
        return Stream.make<Array<Protocol.AgentEvent>>(
          { type: "agent_start" },
          { type: "turn_start" },
          { type: "message_start", message: user },
          { type: "message_end", message: user },
          { type: "message_start", message: { ...reply, content: "" } }
        ).pipe(
          Stream.concat(Stream.fromIterable(deltas.map((delta): Protocol.AgentEvent => ({ type: "message_update", messageId: reply.id, delta })))),
          Stream.concat(Stream.make<Array<Protocol.AgentEvent>>(
            { type: "message_end", message: reply },
            { type: "turn_end" },
            { type: "agent_end" }
          ))
        )
      }
    })
}

/** The app's engine registry, for the daemon (`DaemonLive`) and its workers (`Worker.main`). */
export const Engines: Layer.Layer<Engine.Engine> = Layer.succeed(Engine.Engine, Engine.registry({ ...EchoEngine.engines, reverse }))
