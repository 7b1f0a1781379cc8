/**
 * A worker's turn under an abort (Worker.runTurnOutputs with a TurnAbort): an engine that pushes
 * its outputs (echo's pushTurn) and one whose Stream is pulled (pushTurn removed) end at the
 * abort, even one that came before the turn started, and write nothing after it.
 */
import { assert, describe, it } from "@effect/vitest"
import * as Effect from "effect/Effect"
import * as Fiber from "effect/Fiber"
import { Engine, type EngineSession, type TurnOutput } from "../src/Engine.js"
import * as EchoEngine from "../src/engines/EchoEngine.js"
import { runTurnOutputs, TurnAbort } from "../src/Worker.js"

/** An echo session paced at `tokenDelayMs`, pushing its outputs or (`pulled`) pulled as a Stream. */
const echo = (pulled: boolean) =>
  Effect.gen(function*() {
    const engine = yield* Engine
    const session = yield* engine.make("echo", { tokenDelayMs: 5 })
    if (!pulled) return session
    const { pushTurn: _pushed, ...withoutPush } = session
    return withoutPush as EngineSession
  }).pipe(Effect.provide(EchoEngine.layer))

/** Runs a turn of `words` words; every batch written is noted (its outputs' types). */
const runTurn = (session: EngineSession, abort: TurnAbort | undefined, words = 200) => {
  const written: Array<string> = []
  const encode = (outputs: ReadonlyArray<TurnOutput>) => {
    for (const o of outputs) written.push("type" in o ? o.type : "replaced")
    return new Uint8Array(0)
  }
  const message = Array.from({ length: words }, (_, i) => `w${i}`).join(" ")
  return { written, turn: runTurnOutputs(session, { turnId: "t1", message, history: [] }, encode, () => undefined, abort) }
}

for (const pulled of [false, true]) {
  describe(`a turn's abort (${pulled ? "a pulled Stream" : "pushed outputs"})`, () => {
    it.live("ends the turn mid-way: the effect succeeds at once, nothing is written after it", () =>
      Effect.gen(function*() {
        const abort = new TurnAbort()
        const { turn, written } = runTurn(yield* echo(pulled), abort)
        const fiber = yield* Effect.fork(turn)
        while (!written.includes("message_update")) yield* Effect.sleep("5 millis")
        abort.abort("daemon_shutdown")
        yield* Fiber.join(fiber).pipe(Effect.timeoutFail({ duration: "2 seconds", onTimeout: () => new Error("the turn did not end at its abort") }))
        const at = written.length
        yield* Effect.sleep("50 millis")
        assert.strictEqual(written.length, at, "written after the abort")
        assert.notInclude(written, "agent_end")
        assert.strictEqual(abort.reason, "daemon_shutdown")
      }))

    it.live("an abort before the turn started ends it after the outputs the engine writes as it starts; a second abort changes nothing", () =>
      Effect.gen(function*() {
        const abort = new TurnAbort()
        abort.abort("aborted")
        abort.abort("daemon_shutdown")
        const { turn, written } = runTurn(yield* echo(pulled), abort)
        yield* turn.pipe(Effect.timeoutFail({ duration: "2 seconds", onTimeout: () => new Error("the turn did not end at its abort") }))
        const at = written.length
        yield* Effect.sleep("30 millis")
        assert.strictEqual(written.length, at, "written after the turn ended")
        assert.isAtMost(written.filter((t) => t === "message_update").length, 1)
        assert.notInclude(written, "agent_end")
        assert.strictEqual(abort.reason, "aborted")
      }))

    it.live("an engine's cancel that throws still ends its turn at the abort", () =>
      Effect.gen(function*() {
        const session = yield* echo(pulled)
        const throwing: EngineSession = session.pushTurn === undefined ? session : {
          ...session,
          pushTurn: (input, sink) => {
            const cancel = session.pushTurn!(input, sink)
            return () => {
              cancel()
              throw new Error("cancel threw")
            }
          }
        }
        const abort = new TurnAbort()
        const { turn, written } = runTurn(throwing, abort)
        const fiber = yield* Effect.fork(turn)
        while (!written.includes("message_update")) yield* Effect.sleep("5 millis")
        const thrown = (() => {
          try {
            abort.abort("aborted")
          } catch (e) {
            return e
          }
        })()
        if (!pulled) assert.instanceOf(thrown, Error)
        yield* Fiber.join(fiber).pipe(Effect.timeoutFail({ duration: "2 seconds", onTimeout: () => new Error("the turn did not end at its abort") }))
      }))

    it.live("not aborted: the turn runs to its agent_end; an abort after it does nothing", () =>
      Effect.gen(function*() {
        const abort = new TurnAbort()
        const { turn, written } = runTurn(yield* echo(pulled), abort, 3)
        yield* turn
        assert.strictEqual(written.at(-1), "agent_end")
        abort.abort("aborted")
        assert.strictEqual(written.at(-1), "agent_end")
      }))
  })
}
