/**
 * The built-in `echo` engine (docs/protocol.md section 7): deterministic, for demos, tests and
 * benchmarks.
 */
import * as Duration from "effect/Duration"
import * as Effect from "effect/Effect"
import * as Layer from "effect/Layer"
import * as Stream from "effect/Stream"
import {
  agentMessage,
  Engine,
  type EngineDefinition,
  EngineError,
  type EngineSession,
  registry,
  TranscriptReplaced,
  type TurnInput,
  type TurnOutput
} from "../Engine.js"
import type { AgentEvent } from "../Protocol.js"

/** The largest delta of a `/bulk` message. */
export const BULK_DELTA_BYTES = 65536

interface EchoConfig {
  readonly tokenDelayMs: number
}

const CONFIG_KEYS: ReadonlyArray<string> = ["tokenDelayMs"]

/** Checks a session's config; unknown keys are refused (a typo such as `tokenDelay` is not ignored). */
const readConfig = (config: Readonly<Record<string, unknown>>): Effect.Effect<EchoConfig, EngineError> => {
  const unknown = Object.keys(config).find((key) => !CONFIG_KEYS.includes(key))
  if (unknown !== undefined) {
    return Effect.fail(
      new EngineError({
        reason: "invalid_config",
        message: `echo: unknown option config.${unknown} (known: ${CONFIG_KEYS.join(", ")})`
      })
    )
  }
  const delay = config["tokenDelayMs"] ?? 0
  return typeof delay === "number" && Number.isFinite(delay) && delay >= 0
    ? Effect.succeed({ tokenDelayMs: delay })
    : Effect.fail(
      new EngineError({ reason: "invalid_config", message: "echo: config.tokenDelayMs must be a number >= 0" })
    )
}

/** An assistant message streamed as the given deltas, waiting `delayMs` between two. */
const streamMessage = (id: string, deltas: ReadonlyArray<string> | Iterable<string>, delayMs: number) => {
  const parts = Array.from(deltas)
  const content = parts.join("")
  const updates = Stream.fromIterable(parts).pipe(
    Stream.map((delta): AgentEvent => ({ type: "message_update", messageId: id, delta }))
  )
  const paced = delayMs > 0
    ? updates.pipe(Stream.zipWithIndex, Stream.mapEffect(([event, i]) =>
      i === 0 ? Effect.succeed(event) : Effect.as(Effect.sleep(Duration.millis(delayMs)), event)
    ))
    : updates
  return Stream.make<Array<AgentEvent>>({ type: "message_start", message: agentMessage(id, "assistant", "") }).pipe(
    Stream.concat(paced),
    Stream.concat(Stream.suspend(() => Stream.make<Array<AgentEvent>>({ type: "message_end", message: agentMessage(id, "assistant", content) })))
  )
}

function* bulkDeltas(size: number): Generator<string> {
  // Repeating printable ASCII so a transcript is easy to eyeball and every byte is one char.
  const block = "abcdefghijklmnopqrstuvwxyz0123456789".repeat(Math.ceil(BULK_DELTA_BYTES / 36)).slice(0, BULK_DELTA_BYTES)
  for (let left = size; left > 0; left -= BULK_DELTA_BYTES) {
    yield left >= BULK_DELTA_BYTES ? block : block.slice(0, left)
  }
}

/** The events after the user message, per the prompt's form. */
const reply = (input: TurnInput, config: EchoConfig): Stream.Stream<TurnOutput, EngineError> => {
  const text = input.message
  if (/^\/compact\s*$/.test(text)) {
    // A history rewrite: the transcript so far (this turn's user message included) becomes one
    // assistant message that says how many it replaced.
    const replaced = input.history.length + 1
    return Stream.make(new TranscriptReplaced({
      messages: [agentMessage(`${input.turnId}-c`, "assistant", `compacted ${replaced} messages`)]
    }))
  }
  const assistantId = `${input.turnId}-a`
  const bulk = /^\/bulk\s+(\d+)\s*$/.exec(text)
  if (bulk !== null) {
    const size = Number(bulk[1])
    return Number.isSafeInteger(size)
      ? streamMessage(assistantId, bulkDeltas(size), config.tokenDelayMs)
      : Stream.fail(new EngineError({ reason: "turn_failed", message: `/bulk: ${bulk[1]} is too large` }))
  }
  const sleep = /^\/sleep\s+(\d+)\s*$/.exec(text)
  if (sleep !== null) {
    const ms = Number(sleep[1])
    const toolCallId = `${input.turnId}-t`
    return Stream.make<Array<AgentEvent>>({ type: "tool_execution_start", toolCallId, name: "sleep", args: { ms } }).pipe(
      Stream.concat(Stream.fromEffect(Effect.sleep(Duration.millis(ms))).pipe(Stream.drain)),
      Stream.concat(Stream.suspend(() => {
        const result = `slept ${ms} ms`
        const toolMessage = agentMessage(`${input.turnId}-r`, "tool", result, { toolCallId, toolName: "sleep", toolArgs: { ms } })
        return Stream.make<Array<AgentEvent>>(
          { type: "tool_execution_end", toolCallId, result, isError: false },
          { type: "message_start", message: toolMessage },
          { type: "message_end", message: toolMessage }
        )
      })),
      Stream.concat(streamMessage(assistantId, ["done"], config.tokenDelayMs))
    )
  }
  const words = text.split(/\s+/).filter((w) => w.length > 0)
  return streamMessage(assistantId, ["echo:", ...words.map((w) => ` ${w}`)], config.tokenDelayMs)
}

const makeSession = (config: EchoConfig): EngineSession => ({
  runTurn: (input) =>
    Stream.suspend(() => {
      const user = agentMessage(`${input.turnId}-u`, "user", input.message)
      return Stream.make<Array<TurnOutput>>(
        { type: "agent_start" },
        { type: "turn_start" },
        { type: "message_start", message: user },
        { type: "message_end", message: user }
      ).pipe(
        Stream.concat(reply(input, config)),
        Stream.concat(Stream.make<Array<TurnOutput>>({ type: "turn_end" }, { type: "agent_end" }))
      )
    })
})

/** The engines built into agentd (today: `echo`), to combine with others in a registry. */
export const engines: Readonly<Record<string, EngineDefinition>> = {
  echo: {
    validate: (config) => Effect.asVoid(readConfig(config)),
    make: (config) => Effect.map(readConfig(config), makeSession)
  }
}

/** The registry of the built-in engines. */
export const layer: Layer.Layer<Engine> = Layer.succeed(Engine, registry(engines))
