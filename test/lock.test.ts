/**
 * The lock the session's publish and its log's writes share between fibers and synchronous
 * callers: one holder at a time, taken synchronously when free, and no holder or waiter lost to
 * an interruption at any point.
 */
import { assert, describe, it } from "@effect/vitest"
import * as Effect from "effect/Effect"
import * as Fiber from "effect/Fiber"
import * as FiberId from "effect/FiberId"
import * as FiberRef from "effect/FiberRef"
import { Lock } from "../src/internal/lock.js"

const range = (n: number) => Array.from({ length: n }, (_, i) => i)

describe("Lock", () => {
  it.effect("tryTake takes a free lock and declines a held one; withLock waits for the holder and runs after it", () =>
    Effect.gen(function*() {
      const lock = new Lock()
      assert.isTrue(lock.tryTake())
      assert.isFalse(lock.tryTake())
      const order: Array<string> = []
      const waiter = yield* Effect.fork(lock.withLock(Effect.sync(() => order.push("waiter"))))
      yield* Effect.yieldNow()
      assert.deepStrictEqual(order, [])
      order.push("holder")
      lock.release()
      yield* Fiber.join(waiter)
      assert.deepStrictEqual(order, ["holder", "waiter"])
      assert.isFalse(lock.isHeld)
    }))

  it.effect("withLock releases on failure and on interruption of what it runs", () =>
    Effect.gen(function*() {
      const lock = new Lock()
      const failed = yield* Effect.either(lock.withLock(Effect.fail("no")))
      assert.isTrue(failed._tag === "Left")
      assert.isFalse(lock.isHeld)
      const running = yield* Effect.fork(lock.withLock(Effect.never))
      yield* Effect.yieldNow()
      assert.isTrue(lock.isHeld)
      yield* Fiber.interrupt(running)
      assert.isFalse(lock.isHeld)
    }))

  // The first of two waiters is interrupted before the holder lets go, or in the same step as
  // the release that woke it (before it ran): either way the second takes the lock.
  for (const when of ["while it waits", "in the same step as the release that woke it"] as const) {
    it.effect(`a waiter interrupted ${when} leaves no other waiting on a free lock`, () =>
      Effect.gen(function*() {
        const lock = new Lock()
        assert.isTrue(lock.tryTake())
        const first = yield* Effect.fork(lock.withLock(Effect.void))
        let ran = false
        const second = yield* Effect.fork(lock.withLock(Effect.sync(() => (ran = true))))
        yield* Effect.yieldNow()
        if (when === "while it waits") yield* Fiber.interrupt(first)
        yield* Effect.sync(() => {
          lock.release()
          first.unsafeInterruptAsFork(FiberId.none)
        })
        yield* Fiber.await(first)
        yield* Fiber.join(second)
        assert.isTrue(ran)
        assert.isFalse(lock.isHeld)
      }))
  }

  it.effect("a release while a waiter's fiber yields between its try and its wait (every yield point swept) still wakes it", () =>
    Effect.gen(function*() {
      // The run loop yields every `maxOps` ops: swept so that one yield falls between `take`'s
      // failed try and its registration as a waiter, with the holder letting go then (18 did
      // here; below ~10 the run loop does little but yield).
      for (const maxOps of range(16).map((i) => i + 15)) {
        for (const delay of range(3)) {
          const lock = new Lock()
          assert.isTrue(lock.tryTake())
          const releaser = yield* Effect.fork(Effect.zipRight(Effect.repeatN(Effect.yieldNow(), delay), Effect.sync(() => lock.release())))
          const waiter = yield* Effect.fork(Effect.locally(lock.withLock(Effect.void), FiberRef.currentMaxOpsBeforeYield, maxOps))
          yield* Fiber.join(releaser)
          // Bounded by yields, not time (TestClock): a parked waiter never ends.
          let steps = 0
          while (waiter.unsafePoll() === null && steps++ < 200) yield* Effect.yieldNow()
          assert.isNotNull(waiter.unsafePoll(), `maxOps ${maxOps}, delay ${delay}: the waiter is parked on a free lock`)
          assert.isFalse(lock.isHeld)
        }
      }
    }))

  it.effect("fibers and synchronous holders at random, interrupted at random points: never two holders, every survivor runs, the lock ends free", () =>
    Effect.gen(function*() {
      let seed = 7
      const rand = (n: number) => {
        seed = (seed * 1103515245 + 12345) % 2147483648
        return seed % n
      }
      const lock = new Lock()
      let holders = 0
      let most = 0
      let runs = 0
      const critical = Effect.gen(function*() {
        holders++
        most = Math.max(most, holders)
        yield* Effect.repeatN(Effect.yieldNow(), rand(3))
        holders--
        runs++
      }).pipe(Effect.onInterrupt(() => Effect.sync(() => holders--)))
      for (const _round of range(300)) {
        // A synchronous holder now and then (the hot path's tryTake), let go a few steps later.
        const syncHeld = rand(3) === 0 && lock.tryTake()
        if (syncHeld) holders++
        const before = runs
        const fibers = yield* Effect.forEach(range(1 + rand(4)), () => Effect.fork(lock.withLock(critical)))
        const interrupted = new Set<number>()
        for (let i = 0; i < fibers.length; i++) {
          yield* Effect.repeatN(Effect.yieldNow(), rand(3))
          if (syncHeld && i === 0) {
            holders--
            lock.release()
          }
          if (rand(3) === 0) {
            interrupted.add(i)
            yield* Fiber.interrupt(fibers[i]!)
          }
        }
        if (syncHeld && fibers.length === 0) lock.release()
        yield* Effect.forEach(fibers, Fiber.await, { discard: true })
        // Every fiber not interrupted ran its critical section.
        assert.isAtLeast(runs - before, fibers.length - interrupted.size)
        assert.isFalse(lock.isHeld)
        assert.strictEqual(holders, 0)
      }
      assert.strictEqual(most, 1)
      assert.isAbove(runs, 150)
    }))
})
