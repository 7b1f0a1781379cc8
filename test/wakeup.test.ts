/**
 * The log tail's wake-up (src/internal/cluster/wakeup.ts): notifications coalesce, none is lost
 * while the tail reads, and the safety poll wakes a tail that hears nothing.
 */
import { assert, describe, it } from "@effect/vitest"
import * as Effect from "effect/Effect"
import * as Fiber from "effect/Fiber"
import * as Option from "effect/Option"
import * as TestClock from "effect/TestClock"
import { Wakeup } from "../src/internal/cluster/wakeup.js"

describe("Wakeup", () => {
  it.effect("with no notification, wait returns false after the poll, not before", () =>
    Effect.gen(function*() {
      const w = new Wakeup()
      const fiber = yield* Effect.fork(w.wait("2 seconds"))
      yield* TestClock.adjust("1999 millis")
      assert.isTrue(Option.isNone(yield* Fiber.poll(fiber)))
      yield* TestClock.adjust("1 millis")
      assert.isFalse(yield* Fiber.join(fiber))
    }))

  it.effect("a notification wakes a waiting tail at once", () =>
    Effect.gen(function*() {
      const w = new Wakeup()
      const fiber = yield* Effect.fork(w.wait("2 seconds"))
      yield* Effect.yieldNow()
      w.notify()
      assert.isTrue(yield* Fiber.join(fiber))
    }))

  it.effect("notifications while the tail reads make one more read, not one each", () =>
    Effect.gen(function*() {
      const w = new Wakeup()
      // The tail is reading (not waiting): three commits notify meanwhile.
      w.notify()
      w.notify()
      w.notify()
      // Its next wait returns at once: one read owed...
      assert.isTrue(yield* w.wait("2 seconds"))
      // ...and only one: the following wait sleeps until the poll.
      const fiber = yield* Effect.fork(w.wait("2 seconds"))
      yield* TestClock.adjust("1 second")
      assert.isTrue(Option.isNone(yield* Fiber.poll(fiber)))
      yield* TestClock.adjust("1 second")
      assert.isFalse(yield* Fiber.join(fiber))
    }))

  it.effect("a notification after a poll wake-up is not lost", () =>
    Effect.gen(function*() {
      const w = new Wakeup()
      const first = yield* Effect.fork(w.wait("2 seconds"))
      yield* TestClock.adjust("2 seconds")
      assert.isFalse(yield* Fiber.join(first))
      // A commit while the tail reads after its poll: the next wait returns at once.
      w.notify()
      assert.isTrue(yield* w.wait("2 seconds"))
    }))
})


