import { assert, describe, it } from "@effect/vitest"
import * as Chunk from "effect/Chunk"
import * as Effect from "effect/Effect"
import * as Fiber from "effect/Fiber"
import * as Stream from "effect/Stream"
import * as TestClock from "effect/TestClock"
import { Engine, foldEvent, TranscriptReplaced, type TurnOutput } from "../src/Engine.js"
import * as EchoEngine from "../src/engines/EchoEngine.js"
import type { AgentEvent, AgentMessage } from "../src/Protocol.js"

const turn = (message: string, config: Record<string, unknown> = {}) =>
  Effect.gen(function*() {
    const engine = yield* Engine
    const session = yield* engine.make("echo", config)
    return Chunk.toReadonlyArray(yield* Stream.runCollect(session.runTurn({ turnId: "t1", message, history: [] })))
  }).pipe(Effect.provide(EchoEngine.layer))

const types = (events: ReadonlyArray<TurnOutput>) => events.map((e) => (e instanceof TranscriptReplaced ? e._tag : e.type))

const agentEvents = (outputs: ReadonlyArray<TurnOutput>): ReadonlyArray<AgentEvent> =>
  outputs.flatMap((e) => (e instanceof TranscriptReplaced ? [] : [e]))

const deltasOf = (events: ReadonlyArray<TurnOutput>, messageId: string) =>
  agentEvents(events).flatMap((e) => (e.type === "message_update" && e.messageId === messageId ? [e.delta] : []))

const endOf = (events: ReadonlyArray<TurnOutput>, role: AgentMessage["role"]) =>
  agentEvents(events).flatMap((e) => (e.type === "message_end" && e.message.role === role ? [e.message] : []))

describe("EchoEngine", () => {
  it.effect("plain text: echo: then one delta per word", () =>
    Effect.gen(function*() {
      const events = yield* turn("  hello   big\tworld ")
      assert.deepStrictEqual(types(events), [
        "agent_start", "turn_start", "message_start", "message_end",
        "message_start", "message_update", "message_update", "message_update", "message_update", "message_end",
        "turn_end", "agent_end"
      ])
      const [user] = endOf(events, "user")
      assert.strictEqual(user?.content, "  hello   big\tworld ")
      const [assistant] = endOf(events, "assistant")
      assert.deepStrictEqual(deltasOf(events, assistant!.id), ["echo:", " hello", " big", " world"])
      assert.strictEqual(assistant!.content, "echo: hello big world")
    }))

  it.effect("/bulk N: exactly N ASCII bytes in deltas of at most 65536", () =>
    Effect.gen(function*() {
      for (const n of [0, 1, 65536, 65537, 200_000]) {
        const events = yield* turn(`/bulk ${n}`)
        const [assistant] = endOf(events, "assistant")
        const deltas = deltasOf(events, assistant!.id)
        assert.strictEqual(assistant!.content.length, n)
        assert.strictEqual(Buffer.byteLength(assistant!.content), n)
        assert.strictEqual(deltas.join(""), assistant!.content)
        assert.isTrue(deltas.every((d) => d.length <= 65536 && d.length > 0))
      }
    }))

  it.effect("/sleep MS: a sleep tool call, a tool message, then done", () =>
    Effect.gen(function*() {
      const fiber = yield* Effect.fork(turn("/sleep 250"))
      yield* TestClock.adjust("250 millis")
      const events = yield* Fiber.join(fiber)
      assert.deepStrictEqual(types(events), [
        "agent_start", "turn_start", "message_start", "message_end",
        "tool_execution_start", "tool_execution_end", "message_start", "message_end",
        "message_start", "message_update", "message_end", "turn_end", "agent_end"
      ])
      const [tool] = endOf(events, "tool")
      assert.strictEqual(tool!.content, "slept 250 ms")
      assert.strictEqual(tool!.toolName, "sleep")
      assert.strictEqual(endOf(events, "assistant")[0]!.content, "done")
    }))

  it.effect("tokenDelayMs waits between deltas", () =>
    Effect.gen(function*() {
      const fiber = yield* Effect.fork(turn("a b c", { tokenDelayMs: 100 }))
      yield* TestClock.adjust("250 millis")
      assert.isNull(fiber.unsafePoll())
      yield* TestClock.adjust("50 millis")
      const events = yield* Fiber.join(fiber)
      assert.strictEqual(endOf(events, "assistant")[0]!.content, "echo: a b c")
    }))

  it.effect("rejects bad config and unknown engines", () =>
    Effect.gen(function*() {
      const engine = yield* Engine
      const bad = yield* Effect.flip(engine.make("echo", { tokenDelayMs: -1 }))
      assert.strictEqual(bad.reason, "invalid_config")
      const unknown = yield* Effect.flip(engine.make("gpt", {}))
      assert.strictEqual(unknown.reason, "unknown_engine")
      // validate says the same without making a session.
      assert.strictEqual((yield* Effect.flip(engine.validate("echo", { tokenDelayMs: "x" }))).reason, "invalid_config")
      assert.strictEqual((yield* Effect.flip(engine.validate("gpt", {}))).reason, "unknown_engine")
      const typo = yield* Effect.flip(engine.validate("echo", { tokenDelay: 10 }))
      assert.strictEqual(typo.reason, "invalid_config")
      assert.include(typo.message, "config.tokenDelay ")
      assert.include(typo.message, "tokenDelayMs")
      yield* engine.validate("echo", { tokenDelayMs: 5 })
    }).pipe(Effect.provide(EchoEngine.layer)))

  it.effect("folding the events yields the transcript", () =>
    Effect.gen(function*() {
      const events = yield* turn("hi there")
      const messages: Array<AgentMessage> = []
      for (const e of events) foldEvent(messages, e)
      assert.deepStrictEqual(messages.map((m) => [m.role, m.content]), [["user", "hi there"], ["assistant", "echo: hi there"]])
    }))
})
