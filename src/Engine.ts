/**
 * The agent engine a worker runs. An engine turns a prompt into a stream of AgentEvents; the
 * worker folds those events into the session's transcript, which is all the state a session
 * has (docs/protocol.md section 4: a `message_end` appends its message).
 */
import * as Context from "effect/Context"
import * as Data from "effect/Data"
import * as Effect from "effect/Effect"
import type * as Stream from "effect/Stream"
import type { AgentEvent, AgentMessage } from "./Protocol.js"

/** An engine could not run a turn. */
export class EngineError extends Data.TaggedError("EngineError")<{
  readonly reason: "unknown_engine" | "invalid_config" | "turn_failed"
  readonly message: string
}> {}

/** What a turn needs: the prompt, the transcript so far, and ids for the messages it creates. */
export interface TurnInput {
  readonly turnId: string
  readonly message: string
  readonly history: ReadonlyArray<AgentMessage>
}

/**
 * What a turn's stream may say besides events: the engine replaced its transcript (compacted
 * its context, say) with `messages`. The session starts a new generation whose snapshot is
 * exactly those messages, and attached clients are sent it as a `replacement` snapshot. Events
 * after it extend the new transcript.
 */
export class TranscriptReplaced extends Data.TaggedClass("TranscriptReplaced")<{
  readonly messages: ReadonlyArray<AgentMessage>
}> {}

/** One item of a turn's stream: an event, or the replacement of the whole transcript. */
export type TurnOutput = AgentEvent | TranscriptReplaced

/** One engine configured for one session. */
export interface EngineSession {
  /**
   * The events of one turn, `agent_start` to `agent_end`. Interrupting the stream aborts the
   * turn; the worker then reports `turn_interrupted`.
   */
  readonly runTurn: (input: TurnInput) => Stream.Stream<TurnOutput, EngineError>
  /**
   * When a turn of this engine is cut while it streams a message (an abort, a crash of the
   * worker or of the daemon), the worker ends that message with the text streamed so far and
   * `interrupted: true` right before `turn_interrupted`, so that it stays in the transcript (a
   * model's partial answer is worth keeping). Off by default: the message then never ends and
   * only its logged deltas remain (echo's turns are exact by definition).
   */
  readonly endsCutMessages?: boolean
  /**
   * The same turn as `runTurn`, pushed from the engine's own callbacks (a timer, a socket's
   * data) instead of pulled as a Stream. Optional: the worker uses it when it is there. Why: at
   * a model's pace (one event every 20 ms) every event is its own wake-up, and a Stream's pull
   * per event (its fibers, its channel layers, `Effect.sleep`) cost a worker two to three times
   * the wake-up itself (bench/streaming.ts). Returns the function that cancels the turn (an
   * abort): after it, the engine calls neither `emit` nor `end` again.
   */
  readonly pushTurn?: (input: TurnInput, sink: TurnSink) => () => void
}

/** Where a pushed turn's outputs go ({@link EngineSession.pushTurn}). */
export interface TurnSink {
  /**
   * Takes the next outputs, in order. A promise back means the worker's pipe is full: the
   * engine pushes nothing more (`end` included) until it resolves.
   */
  readonly emit: (outputs: ReadonlyArray<TurnOutput>) => Promise<void> | undefined
  /** The turn is over: everything was emitted, or it failed with `error`. Called once. */
  readonly end: (error?: EngineError) => void
}

/**
 * The engines a worker can run, by name. The supervisor holds the same service to check a
 * session's engine and config at `create`, so that a bad config is an `invalid_command` there
 * rather than a worker that fails to load again and again.
 */
export class Engine extends Context.Tag("agentd/Engine")<Engine, {
  readonly names: ReadonlyArray<string>
  /** Checks that `name` is known and `config` is valid for it, without starting anything. */
  readonly validate: (name: string, config: Readonly<Record<string, unknown>>) => Effect.Effect<void, EngineError>
  readonly make: (name: string, config: Readonly<Record<string, unknown>>) => Effect.Effect<EngineSession, EngineError>
}>() {}

/** One engine of a registry: how to check a session's config, and how to start it. */
export interface EngineDefinition {
  readonly validate: (config: Readonly<Record<string, unknown>>) => Effect.Effect<void, EngineError>
  readonly make: (config: Readonly<Record<string, unknown>>) => Effect.Effect<EngineSession, EngineError>
}

/**
 * A registry of engines by name (the `Engine` service): an unknown name fails `unknown_engine`
 * listing the known ones. Registries combine by spreading their definitions:
 * `registry({ ...EchoEngine.engines, mine })`.
 */
export const registry = (engines: Readonly<Record<string, EngineDefinition>>): Context.Tag.Service<typeof Engine> => {
  const names = Object.keys(engines)
  const find = (name: string): Effect.Effect<EngineDefinition, EngineError> => {
    const found = Object.hasOwn(engines, name) ? engines[name] : undefined
    return found !== undefined
      ? Effect.succeed(found)
      : Effect.fail(new EngineError({ reason: "unknown_engine", message: `unknown engine \`${name}\` (known: ${names.join(", ")})` }))
  }
  return {
    names,
    validate: (name, config) => Effect.flatMap(find(name), (engine) => engine.validate(config)),
    make: (name, config) => Effect.flatMap(find(name), (engine) => engine.make(config))
  }
}

/** A transcript message made now (the engines' constructor of the messages they stream). */
export const agentMessage = (id: string, role: AgentMessage["role"], content: string, extra?: Partial<AgentMessage>): AgentMessage => ({
  id,
  role,
  content,
  timestamp: Date.now(),
  ...extra
})

/** Folds one event (or a replacement) into a transcript, in place; returns whether it changed. */
export const foldEvent = (messages: Array<AgentMessage>, event: TurnOutput | { readonly type: string }): boolean => {
  if (event instanceof TranscriptReplaced) {
    messages.length = 0
    for (const message of event.messages) messages.push(message)
    return true
  }
  if (event.type === "message_end") {
    messages.push((event as Extract<AgentEvent, { type: "message_end" }>).message)
    return true
  }
  return false
}
