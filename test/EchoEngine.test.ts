import { assert, describe, it } from "@effect/vitest"
import * as Chunk from "effect/Chunk"
import * as Effect from "effect/Effect"
import * as Fiber from "effect/Fiber"
import * as Stream from "effect/Stream"
import * as TestClock from "effect/TestClock"
import { Engine, EngineError, foldEvent, TranscriptReplaced, type TurnOutput } from "../src/Engine.js"
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

  it.effect("plain text: the words are JavaScript's whitespace-separated words, whatever the whitespace (random texts)", () =>
    Effect.gen(function*() {
      // Every character \s matches and some it does not (NBSP is \s; U+200B is not).
      const alphabet = ["a", "b", "é", "😀", "\u200b", " ", "\t", "\n", "\r", "\v", "\f", "\u00a0", "\u2028", "\u3000", "\ufeff"]
      let seed = 7
      const random = () => (seed = (seed * 1103515245 + 12345) % 2147483648) / 2147483648
      for (let round = 0; round < 200; round++) {
        const length = Math.floor(random() * 40)
        const text = Array.from({ length }, () => alphabet[Math.floor(random() * alphabet.length)]!).join("")
        const events = yield* turn(text)
        const [assistant] = endOf(events, "assistant")
        const words = text.split(/\s+/).filter((w) => w.length > 0)
        assert.deepStrictEqual(deltasOf(events, assistant!.id), ["echo:", ...words.map((w) => ` ${w}`)], JSON.stringify(text))
      }
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
  // The worker runs a turn as `pushTurn` (plain timers); `runTurn` is the same steps on Effect's
  // clock. Both must say the same, wait on a full pipe, and stop dead when cancelled.
  describe("pushTurn", () => {
    const session = (config: Record<string, unknown>) =>
      Effect.runPromise(Effect.flatMap(Engine, (engine) => engine.make("echo", config)).pipe(Effect.provide(EchoEngine.layer)))
    /** Outputs without their clocks (timestamps differ between two runs). */
    const plain = (outputs: ReadonlyArray<TurnOutput>) => JSON.parse(JSON.stringify(outputs, (k, v) => (k === "timestamp" ? 0 : v)))

    const pushed = (s: Awaited<ReturnType<typeof session>>, message: string) =>
      new Promise<{ outputs: Array<TurnOutput>; error: EngineError | undefined; emits: number }>((resolve) => {
        const outputs: Array<TurnOutput> = []
        let emits = 0
        s.pushTurn!({ turnId: "t1", message, history: [] }, {
          emit: (batch) => {
            emits++
            outputs.push(...batch)
            return undefined
          },
          end: (error) => resolve({ outputs, error, emits })
        })
      })

    it.live("says what runTurn says, each wait a timer", () =>
      Effect.promise(async () => {
        const s = await session({ tokenDelayMs: 2 })
        for (const message of ["a b c", "/bulk 200000", "/sleep 5", "/compact", "/bulk 99999999999999999999"]) {
          const push = await pushed(s, message)
          const pull = await Effect.runPromise(Effect.either(Stream.runCollect(s.runTurn({ turnId: "t1", message, history: [] }))))
          if (pull._tag === "Left") {
            assert.strictEqual(push.error?.message, pull.left.message, message)
            assert.strictEqual(push.error?.reason, "turn_failed")
            assert.deepStrictEqual(types(push.outputs), ["agent_start", "turn_start", "message_start", "message_end"])
            continue
          }
          assert.isUndefined(push.error, message)
          assert.deepStrictEqual(plain(push.outputs), plain(Chunk.toReadonlyArray(pull.right)), message)
        }
        // One emit per wake-up: the start of the turn with the first delta, then one per delta.
        const paced = await pushed(s, "a b c")
        assert.strictEqual(paced.emits, 4)
      }))

    it.live("with no wait between deltas, a long message goes in full batches that split it anywhere; a full sink mid-message holds the rest", () =>
      Effect.promise(async () => {
        const s = await session({ tokenDelayMs: 0 })
        const message = Array.from({ length: 1000 }, (_, i) => `w${i}`).join(" ")
        const pull = Chunk.toReadonlyArray(await Effect.runPromise(Stream.runCollect(s.runTurn({ turnId: "t1", message, history: [] }))))
        const sizes: Array<number> = []
        let release: (() => void) | undefined
        const outputs: Array<unknown> = []
        const done = new Promise<void>((resolve) => {
          s.pushTurn!({ turnId: "t1", message, history: [] }, {
            emit: (batch) => {
              sizes.push(batch.length)
              outputs.push(...batch)
              // The second batch (in the middle of the message) is taken late.
              return sizes.length === 2 ? new Promise<void>((r) => (release = r)) : undefined
            },
            end: () => resolve()
          })
        })
        await new Promise((r) => setTimeout(r, 30))
        assert.deepStrictEqual(sizes, [256, 256])
        release!()
        await done
        // 4 events before the reply, its start, "echo:" and 1000 words, its end, turn_end, agent_end: 1009.
        assert.deepStrictEqual(sizes, [256, 256, 256, 1009 - 3 * 256])
        assert.deepStrictEqual(plain(outputs as ReadonlyArray<TurnOutput>), plain(pull))
        const deltas = pull.flatMap((o) => "type" in o && o.type === "message_update" ? [o.delta] : [])
        assert.deepStrictEqual(deltas, ["echo:", ...message.split(" ").map((w) => ` ${w}`)])
        const ends = pull.flatMap((o) => "type" in o && o.type === "message_end" ? [o.message.content] : [])
        assert.deepStrictEqual(ends, [message, `echo: ${message}`])
      }))

    it.live("waits for a full sink before anything more, its end included; cancel stops it", () =>
      Effect.promise(async () => {
        const s = await session({ tokenDelayMs: 1 })
        const calls: Array<string> = []
        let release!: () => void
        s.pushTurn!({ turnId: "t1", message: "a b c d", history: [] }, {
          emit: (batch) => {
            calls.push(`emit ${batch.length}`)
            return calls.length === 2 ? new Promise<void>((r) => (release = r)) : undefined
          },
          end: () => calls.push("end")
        })
        await new Promise((r) => setTimeout(r, 60))
        assert.deepStrictEqual(calls, ["emit 6", "emit 1"])
        release()
        await new Promise((r) => setTimeout(r, 60))
        assert.deepStrictEqual(calls, ["emit 6", "emit 1", "emit 1", "emit 1", "emit 4", "end"])
        const cut: Array<string> = []
        const cancel = s.pushTurn!({ turnId: "t2", message: "a b c d", history: [] }, {
          emit: (batch) => void cut.push(`emit ${batch.length}`),
          end: () => cut.push("end")
        })
        cancel()
        await new Promise((r) => setTimeout(r, 60))
        assert.deepStrictEqual(cut, ["emit 6"])
      }))
  })
})
