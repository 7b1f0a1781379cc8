/**
 * The runner's self-fence (src/internal/cluster/fence.ts), on the TestClock: it comes up once no
 * shard lock refresh started within the window has succeeded, whatever else happens, and goes
 * down only at a success that started within the window; a refresh counts from its start.
 */
import { assert, describe, it } from "@effect/vitest"
import * as Effect from "effect/Effect"
import * as TestClock from "effect/TestClock"
import * as Fence from "../src/internal/cluster/fence.js"

/** A fence over a hold that records when it is entered and left (ms on the TestClock). */
const setUp = (windowMs: number) =>
  Effect.gen(function*() {
    const events: Array<string> = []
    const now = () => Effect.map(TestClock.currentTimeMillis, (t) => t)
    const hold = Effect.acquireRelease(
      Effect.flatMap(now(), (t) => Effect.sync(() => void events.push(`up ${t}`))),
      () => Effect.flatMap(now(), (t) => Effect.sync(() => void events.push(`down ${t}`)))
    )
    const fence = yield* Fence.make(windowMs, hold)
    yield* Effect.forkScoped(fence.run)
    yield* Effect.yieldNow()
    /** A refresh that answers after `tookMs` (on the TestClock), successfully or not. */
    const refresh = (tookMs: number, ok = true) =>
      Effect.fork(fence.timed(Effect.zipRight(Effect.sleep(`${tookMs} millis`), ok ? Effect.void : Effect.fail("unreachable"))))
    return { events, fence, refresh }
  })

const advance = (ms: number) => Effect.zipRight(TestClock.adjust(`${ms} millis`), Effect.yieldNow())

describe("the self-fence", () => {
  it.scoped("comes up at the window after the last success's start, not a tick before; down at the next success", () =>
    Effect.gen(function*() {
      const { events, fence, refresh } = yield* setUp(3000)
      // Refreshes every 2 s, each answering after 100 ms; the third never answers (a partition).
      yield* refresh(100)
      yield* advance(2000)
      yield* refresh(100)
      yield* advance(2000)
      yield* refresh(60_000)
      // The last success started at 2000: the fence is due at 5000.
      yield* advance(999)
      assert.deepStrictEqual(events, [])
      assert.isFalse(fence.up())
      yield* advance(1)
      assert.deepStrictEqual(events, ["up 5000"])
      assert.isTrue(fence.up())
      // Failing refreshes keep it up.
      yield* refresh(10, false)
      yield* advance(5000)
      assert.deepStrictEqual(events, ["up 5000"])
      // A success takes it down.
      yield* refresh(200)
      yield* advance(200)
      assert.deepStrictEqual(events, ["up 5000", "down 10200"])
      assert.isFalse(fence.up())
    }))

  it.scoped("a success that started before the window ran out, answering after, does not hold it down", () =>
    Effect.gen(function*() {
      const { events, refresh } = yield* setUp(3000)
      yield* refresh(100)
      yield* advance(100)
      // Started at 100, answers at 3500: the heartbeat it wrote may date from 100.
      yield* refresh(3400)
      yield* advance(2900)
      // Due at 3000 (the first success started at 0).
      assert.deepStrictEqual(events, ["up 3000"])
      yield* advance(500)
      // Its start (100) is 3400 ms old when it answers: still stale, the fence stays up...
      assert.deepStrictEqual(events, ["up 3000"])
      // ...until a fresh one.
      yield* refresh(50)
      yield* advance(50)
      assert.deepStrictEqual(events, ["up 3000", "down 3550"])
    }))

  it.scoped("a slow success that started within the window keeps it down; it counts from its start", () =>
    Effect.gen(function*() {
      const { events, refresh } = yield* setUp(3000)
      yield* refresh(0)
      yield* advance(1000)
      // Started at 1000, answers at 2800: the fence is now due at 4000, not at 5800.
      yield* refresh(1800)
      yield* advance(1800)
      yield* advance(1199)
      assert.deepStrictEqual(events, [])
      yield* advance(1)
      assert.deepStrictEqual(events, ["up 4000"])
    }))

  it.scoped("with refreshes on time it never comes up", () =>
    Effect.gen(function*() {
      const { events, refresh } = yield* setUp(3000)
      for (let i = 0; i < 50; i++) {
        yield* refresh(900)
        yield* advance(2000)
      }
      assert.deepStrictEqual(events, [])
    }))

  it.scoped("refreshes late (queued on the lock connection): the heartbeat probe, answering in time, keeps it down", () =>
    Effect.gen(function*() {
      const { events, fence, refresh } = yield* setUp(3000)
      const probes: Array<number> = []
      const probe = Effect.flatMap(TestClock.currentTimeMillis, (t) => {
        probes.push(t)
        return Effect.sleep("300 millis")
      })
      yield* Effect.forkScoped(fence.probing(probe))
      yield* Effect.yieldNow()
      // Refreshes due every 2 s, each answering after 1500 ms: the last success's start is 2 s
      // old when the next answers, and the window (3 s) runs out between two answers (without
      // the probe the fence comes up at 3000, the next test).
      for (let i = 0; i < 10; i++) {
        yield* refresh(1500)
        yield* advance(2000)
      }
      assert.deepStrictEqual(events, [])
      // Due at three quarters of the window after the last success's start.
      assert.strictEqual(probes[0], 2250)
    }))

  it.scoped("the same late refreshes without a probe that answers: up at the window after the last success's start, not later", () =>
    Effect.gen(function*() {
      const { events, fence, refresh } = yield* setUp(3000)
      yield* Effect.forkScoped(fence.probing(Effect.never))
      yield* Effect.yieldNow()
      yield* refresh(1500)
      yield* advance(2000)
      yield* refresh(1500)
      yield* advance(999)
      assert.deepStrictEqual(events, [])
      yield* advance(1)
      assert.deepStrictEqual(events, ["up 3000"])
      // The refresh that started at 2000 answers at 3500: down (it started within the window).
      yield* advance(500)
      assert.deepStrictEqual(events, ["up 3000", "down 3500"])
    }))
})
