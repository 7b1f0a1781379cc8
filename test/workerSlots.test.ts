/**
 * The worker slots (the maxWorkers bound): a slot is held from before a spawn until the
 * worker's exit; a failed or interrupted spawn, or an interrupted wait, holds nothing; waiters
 * are served in order, each after its `onWait`; workers on their way out are not asked again.
 */
import { assert, describe, it } from "@effect/vitest"
import * as Deferred from "effect/Deferred"
import * as Effect from "effect/Effect"
import * as Exit from "effect/Exit"
import * as Fiber from "effect/Fiber"
import * as FiberSet from "effect/FiberSet"
import * as WorkerSlots from "../src/internal/session/workerSlots.js"
import type { WorkerExit, WorkerHandle } from "../src/WorkerPool.js"

/** A worker as far as the slots see it: its `exited`, completed by the test. */
const fakeWorker = (pid: number) =>
  Effect.map(Deferred.make<WorkerExit>(), (exited) => ({ pid, exited } as unknown as WorkerHandle))

const exit = (w: WorkerHandle) => Deferred.succeed(w.exited, { code: 0, signal: null })

const setup = (max: number) =>
  Effect.gen(function*() {
    const fibers = yield* FiberSet.make()
    const slots = yield* WorkerSlots.make(max, (effect) => Effect.asVoid(FiberSet.run(fibers, effect)))
    let waits = 0
    const onWait = Effect.sync(() => void waits++)
    return { slots, onWait, waits: () => waits }
  })

const isPending = <A, E>(f: Fiber.RuntimeFiber<A, E>) => Effect.map(Fiber.poll(f), (o) => o._tag === "None")

/** Lets forked fibers run. */
const settle = Effect.sleep("10 millis")

describe("WorkerSlots", () => {
  it.scopedLive("holds a slot until the worker exits; the next spawn waits (after onWait) and runs then", () =>
    Effect.gen(function*() {
      const { onWait, slots, waits } = yield* setup(1)
      const first = yield* slots.withSlot(fakeWorker(1), onWait)
      assert.strictEqual(waits(), 0)
      const second = yield* Effect.fork(slots.withSlot(fakeWorker(2), onWait))
      yield* settle
      assert.isTrue(yield* isPending(second))
      assert.strictEqual(slots.waiting(), 1)
      assert.strictEqual(waits(), 1)
      yield* exit(first)
      const w2 = yield* Fiber.join(second)
      assert.strictEqual(w2.pid, 2)
      assert.strictEqual(slots.waiting(), 0)
    }))

  it.scopedLive("a failed spawn releases its slot at once; an interrupted wait holds nothing", () =>
    Effect.gen(function*() {
      const { onWait, slots } = yield* setup(1)
      const failed = yield* Effect.exit(slots.withSlot(Effect.fail("no spawn"), onWait))
      assert.isTrue(Exit.isFailure(failed))
      const held = yield* slots.withSlot(fakeWorker(1), onWait)
      const waiter = yield* Effect.fork(slots.withSlot(fakeWorker(2), onWait))
      yield* settle
      yield* Fiber.interrupt(waiter)
      assert.strictEqual(slots.waiting(), 0)
      yield* exit(held)
      yield* settle
      // The interrupted waiter took nothing: the slot is free for the next one.
      const next = yield* slots.withSlot(fakeWorker(3), onWait).pipe(Effect.timeout("1 second"))
      assert.strictEqual(next.pid, 3)
    }))

  it.scopedLive("wanted: the waiting spawns less the workers already on their way out, until those exit", () =>
    Effect.gen(function*() {
      const { onWait, slots } = yield* setup(2)
      const a = yield* slots.withSlot(fakeWorker(1), onWait)
      const b = yield* slots.withSlot(fakeWorker(2), onWait)
      assert.strictEqual(slots.wanted(), 0)
      const c = yield* Effect.fork(slots.withSlot(fakeWorker(3), onWait))
      yield* settle
      assert.strictEqual(slots.wanted(), 1)
      // a's session passivates: b's need not, though c still waits.
      slots.leaving(a)
      assert.strictEqual(slots.wanted(), 0)
      yield* exit(a)
      assert.strictEqual((yield* Fiber.join(c)).pid, 3)
      assert.strictEqual(slots.wanted(), 0)
      yield* exit(b)
    }))

  it.scopedLive("a worker that exited before its session gave it up is not counted on its way out", () =>
    Effect.gen(function*() {
      const { onWait, slots } = yield* setup(2)
      const a = yield* slots.withSlot(fakeWorker(1), onWait)
      const b = yield* slots.withSlot(fakeWorker(2), onWait)
      // a dies (killed while its session is idle); c takes its slot.
      const c = yield* Effect.fork(slots.withSlot(fakeWorker(3), onWait))
      yield* settle
      yield* exit(a)
      const w3 = yield* Fiber.join(c)
      const d = yield* Effect.fork(slots.withSlot(fakeWorker(4), onWait))
      yield* settle
      assert.strictEqual(slots.wanted(), 1)
      // a's session, between turns, passivates before it has seen a's exit.
      slots.leaving(a)
      assert.strictEqual(slots.wanted(), 1, "d still needs a worker to give up its slot")
      slots.leaving(b)
      assert.strictEqual(slots.wanted(), 0)
      yield* exit(b)
      assert.strictEqual((yield* Fiber.join(d)).pid, 4)
      yield* exit(w3)
    }))

  it.scopedLive("waiters are served first come, first served", () =>
    Effect.gen(function*() {
      const { onWait, slots } = yield* setup(1)
      const held = yield* slots.withSlot(fakeWorker(1), onWait)
      const order: Array<number> = []
      const waiters: Array<Fiber.RuntimeFiber<WorkerHandle>> = []
      for (const pid of [2, 3, 4]) {
        waiters.push(yield* Effect.fork(Effect.tap(slots.withSlot(fakeWorker(pid), onWait), (w) => Effect.sync(() => order.push(w.pid)))))
        yield* settle
      }
      assert.strictEqual(slots.waiting(), 3)
      let current = held
      for (const w of waiters) {
        yield* exit(current)
        current = yield* Fiber.join(w)
      }
      assert.deepStrictEqual(order, [2, 3, 4])
    }))
})
