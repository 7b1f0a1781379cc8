/**
 * The session's mailbox (`InputQueue`): inputs are taken in the order offered whether the taker
 * waits or not, and an interrupted take loses nothing offered after it.
 */
import { assert, describe, it } from "@effect/vitest"
import * as Effect from "effect/Effect"
import * as Fiber from "effect/Fiber"
import { InputQueue } from "../src/internal/session/mailbox.js"

describe("InputQueue", () => {
  it.effect("inputs are taken in the order offered, offered before the take or while it waits", () =>
    Effect.gen(function*() {
      const q = new InputQueue<number>()
      q.unsafeOffer(1)
      q.unsafeOffer(2)
      assert.strictEqual(yield* q.take, 1)
      const waiting = yield* Effect.fork(Effect.zip(q.take, q.take))
      yield* Effect.yieldNow()
      q.unsafeOffer(3)
      q.unsafeOffer(4)
      assert.deepStrictEqual(yield* Fiber.join(waiting), [2, 3])
      assert.deepStrictEqual(q.takeAll(), [4])
      assert.deepStrictEqual(q.takeAll(), [])
    }))

  it.effect("an interrupted take takes nothing: what is offered after it waits for the next take", () =>
    Effect.gen(function*() {
      const q = new InputQueue<string>()
      const waiting = yield* Effect.fork(q.take)
      yield* Effect.yieldNow()
      yield* Fiber.interrupt(waiting)
      q.unsafeOffer("a")
      assert.deepStrictEqual(q.takeAll(), ["a"])
      q.unsafeOffer("b")
      assert.strictEqual(yield* q.take, "b")
    }))

  it.effect("random interleavings of offers and takes: every input taken once, in order", () =>
    Effect.gen(function*() {
      const q = new InputQueue<number>()
      let seed = 5
      const rand = (n: number) => {
        seed = (seed * 1103515245 + 12345) % 2147483648
        return seed % n
      }
      const taken: Array<number> = []
      const taker = yield* Effect.fork(Effect.forever(Effect.flatMap(q.take, (n) => Effect.sync(() => taken.push(n)))))
      let offered = 0
      for (let round = 0; round < 500; round++) {
        for (let k = rand(4); k > 0; k--) q.unsafeOffer(offered++)
        yield* Effect.repeatN(Effect.yieldNow(), rand(3))
      }
      while (taken.length < offered) yield* Effect.yieldNow()
      yield* Fiber.interrupt(taker)
      assert.deepStrictEqual(taken, Array.from({ length: offered }, (_, i) => i))
    }))
})
