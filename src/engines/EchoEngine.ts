/**
 * The built-in `echo` engine (docs/protocol.md section 7): deterministic, for demos, tests and
 * benchmarks.
 */
import * as Chunk from "effect/Chunk"
import * as Duration from "effect/Duration"
import * as Effect from "effect/Effect"
import * as Layer from "effect/Layer"
import * as Option from "effect/Option"
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
  type TurnOutput,
  type TurnSink
} from "../Engine.js"

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

/** A wait between two outputs of a turn (`tokenDelayMs`, `/sleep`). */
class Pause {
  constructor(readonly ms: number) {}
}

/**
 * One step of an echo turn: an output, a wait, or the turn's failure. A turn is written once,
 * as a generator of steps, and run by two drivers: {@link streamSteps} (`runTurn`, timed by
 * Effect's clock, so that tests can drive it with `TestClock`) and {@link pushSteps}
 * (`pushTurn`, what the worker runs: plain timers, no fiber per event).
 */
type Step = TurnOutput | Pause | EngineError | Burst

/**
 * A message's deltas with no wait between them, as one step: {@link collect} takes them straight
 * from `deltas` into its batch as `message_update` outputs, and keeps each in `parts` (for the
 * message's end). One step each went through every generator of the turn: four resumptions and
 * four iterator results per event, in a worker that runs interpreted (~40% of its CPU in a
 * 20,000-word turn).
 */
class Burst {
  readonly parts: Array<string> = []
  constructor(readonly messageId: string, readonly deltas: Iterator<string>) {}
}

/** An assistant message streamed as the given deltas, waiting `delayMs` between two. */
function* streamMessage(id: string, deltas: Iterable<string>, delayMs: number): Generator<Step> {
  yield { type: "message_start", message: agentMessage(id, "assistant", "") }
  let parts: Array<string> = []
  if (delayMs > 0) {
    for (const delta of deltas) {
      if (parts.length > 0) yield new Pause(delayMs)
      parts.push(delta)
      yield { type: "message_update", messageId: id, delta }
    }
  } else {
    // Resumed once collect has taken every delta.
    const burst = new Burst(id, deltas[Symbol.iterator]())
    yield burst
    parts = burst.parts
  }
  yield { type: "message_end", message: agentMessage(id, "assistant", parts.join("")) }
}

function* bulkDeltas(size: number): Generator<string> {
  // Repeating printable ASCII so a transcript is easy to eyeball and every byte is one char.
  const block = "abcdefghijklmnopqrstuvwxyz0123456789".repeat(Math.ceil(BULK_DELTA_BYTES / 36)).slice(0, BULK_DELTA_BYTES)
  for (let left = size; left > 0; left -= BULK_DELTA_BYTES) {
    yield left >= BULK_DELTA_BYTES ? block : block.slice(0, left)
  }
}

/** The steps after the user message, per the prompt's form. */
function* reply(input: TurnInput, config: EchoConfig): Generator<Step> {
  const text = input.message
  if (/^\/compact\s*$/.test(text)) {
    // A history rewrite: the transcript so far (this turn's user message included) becomes one
    // assistant message that says how many it replaced.
    const replaced = input.history.length + 1
    yield new TranscriptReplaced({
      messages: [agentMessage(`${input.turnId}-c`, "assistant", `compacted ${replaced} messages`)]
    })
    return
  }
  const assistantId = `${input.turnId}-a`
  const bulk = /^\/bulk\s+(\d+)\s*$/.exec(text)
  if (bulk !== null) {
    const size = Number(bulk[1])
    if (!Number.isSafeInteger(size)) {
      yield new EngineError({ reason: "turn_failed", message: `/bulk: ${bulk[1]} is too large` })
      return
    }
    yield* streamMessage(assistantId, bulkDeltas(size), config.tokenDelayMs)
    return
  }
  const sleep = /^\/sleep\s+(\d+)\s*$/.exec(text)
  if (sleep !== null) {
    const ms = Number(sleep[1])
    const toolCallId = `${input.turnId}-t`
    yield { type: "tool_execution_start", toolCallId, name: "sleep", args: { ms } }
    yield new Pause(ms)
    const result = `slept ${ms} ms`
    const toolMessage = agentMessage(`${input.turnId}-r`, "tool", result, { toolCallId, toolName: "sleep", toolArgs: { ms } })
    yield { type: "tool_execution_end", toolCallId, result, isError: false }
    yield { type: "message_start", message: toolMessage }
    yield { type: "message_end", message: toolMessage }
    yield* streamMessage(assistantId, ["done"], config.tokenDelayMs)
    return
  }
  yield* streamMessage(assistantId, echoDeltas(text), config.tokenDelayMs)
}

/**
 * `echo:`, then ` w` for each whitespace-separated word w of `text`, found as they are streamed:
 * a long prompt's first deltas go out at once, as a model's first tokens would (splitting 20,000
 * words up front held a turn's first event back by 15-30 ms in a worker, which runs interpreted).
 */
function* echoDeltas(text: string): Generator<string> {
  yield "echo:"
  const word = /\S+/g
  for (let m = word.exec(text); m !== null; m = word.exec(text)) yield ` ${m[0]}`
}

/** A whole turn, `agent_start` to `agent_end` (a failure ends it where it happens). */
function* turnSteps(input: TurnInput, config: EchoConfig): Generator<Step> {
  const user = agentMessage(`${input.turnId}-u`, "user", input.message)
  yield { type: "agent_start" }
  yield { type: "turn_start" }
  yield { type: "message_start", message: user }
  yield { type: "message_end", message: user }
  for (const step of reply(input, config)) {
    yield step
    if (step instanceof EngineError) return
  }
  yield { type: "turn_end" }
  yield { type: "agent_end" }
}

/** At most this many outputs, or about this many delta bytes, go in one batch (a `/bulk` of 100 MB is not one buffer). */
const BATCH_OUTPUTS = 256
const BATCH_BYTES = 1024 * 1024

/** What ends a batch: a wait, the failure, the turn's end, or a full batch. */
type BatchEnd = Pause | EngineError | "end" | "full"

/** A turn being run: its steps, and the burst being taken (see {@link Burst}), across batches. */
interface Running {
  readonly steps: Iterator<Step>
  burst: Burst | undefined
}

const running = (steps: Iterator<Step>): Running => ({ steps, burst: undefined })

/** Takes the outputs ready now (up to a batch's worth) into `batch`; says what stopped it. */
const collect = (turn: Running, batch: Array<TurnOutput>): BatchEnd => {
  let bytes = 0
  for (;;) {
    let output: TurnOutput
    const burst = turn.burst
    if (burst !== undefined) {
      const next = burst.deltas.next()
      if (next.done === true) {
        turn.burst = undefined
        continue
      }
      burst.parts.push(next.value)
      output = { type: "message_update", messageId: burst.messageId, delta: next.value }
    } else {
      const next = turn.steps.next()
      if (next.done === true) return "end"
      const step = next.value
      if (step instanceof Burst) {
        turn.burst = step
        continue
      }
      if (step instanceof Pause || step instanceof EngineError) return step
      output = step
    }
    batch.push(output)
    if (!(output instanceof TranscriptReplaced) && output.type === "message_update") bytes += output.delta.length
    if (batch.length >= BATCH_OUTPUTS || bytes >= BATCH_BYTES) return "full"
  }
}

/** A turn's steps as a Stream, its waits on Effect's clock. */
const streamSteps = (makeSteps: () => Iterator<Step>): Stream.Stream<TurnOutput, EngineError> =>
  Stream.suspend(() => {
    const turn = running(makeSteps())
    let pending: BatchEnd | undefined
    const take = Effect.sync(() => {
      const batch: Array<TurnOutput> = []
      pending = collect(turn, batch)
      return Chunk.unsafeFromArray(batch)
    })
    return Stream.repeatEffectChunkOption(Effect.suspend(() => {
      const before = pending
      pending = undefined
      if (before === "end") return Effect.fail(Option.none())
      if (before instanceof EngineError) return Effect.fail(Option.some(before))
      return before instanceof Pause ? Effect.zipRight(Effect.sleep(Duration.millis(before.ms)), take) : take
    }))
  })

/**
 * A turn's steps pushed to `sink` from plain timers: per wait one `setTimeout`, per batch one
 * `emit`, and nothing else (the worker's cost per event at a model's pace is the wake-up).
 */
const pushSteps = (steps: Iterator<Step>, sink: TurnSink): () => void => {
  const turn = running(steps)
  let cancelled = false
  let timer: ReturnType<typeof setTimeout> | undefined
  const run = (): void => {
    timer = undefined
    for (;;) {
      if (cancelled) return
      const batch: Array<TurnOutput> = []
      let end: BatchEnd
      try {
        end = collect(turn, batch)
      } catch (e) {
        // A bug of the engine's own: the turn fails, the worker lives on.
        end = new EngineError({ reason: "turn_failed", message: `echo: ${String(e)}` })
      }
      const taken = batch.length > 0 ? sink.emit(batch) : undefined
      const next = (): void => {
        if (cancelled) return
        if (end === "end") sink.end()
        else if (end instanceof EngineError) sink.end(end)
        else if (end instanceof Pause) timer = setTimeout(run, end.ms)
        else run()
      }
      // A full batch taken at once goes on in this loop (no recursion through `next`).
      if (taken === undefined && end === "full") continue
      if (taken === undefined) next()
      else void taken.then(next)
      return
    }
  }
  run()
  return () => {
    cancelled = true
    if (timer !== undefined) clearTimeout(timer)
  }
}

const makeSession = (config: EchoConfig): EngineSession => ({
  runTurn: (input) => streamSteps(() => turnSteps(input, config)),
  pushTurn: (input, sink) => pushSteps(turnSteps(input, config), sink)
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
