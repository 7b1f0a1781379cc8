/**
 * The append queue's Session grouping, on a store made up here whose writes wait until the test
 * lets them finish: a session's batch is written in the appender's own fiber when nothing else is
 * queued or being written (no flusher forked), appends arriving meanwhile are queued for a
 * flusher, and an appender interrupted at any point (waiting for the session's lock, or while its
 * batch is written) leaves no gap: every cursor handed out is written, in order, once. The last
 * two tests deliver the interruption at a chosen op boundary inside the in-place path (an
 * interruption lands at any boundary where the fiber yields, every 2048 ops): the fiber is
 * interrupted from code that runs exactly there (an event's `toJSON`, a provided tracer's span).
 */
import { assert, describe, it } from "@effect/vitest"
import * as Deferred from "effect/Deferred"
import * as Effect from "effect/Effect"
import * as Fiber from "effect/Fiber"
import * as FiberId from "effect/FiberId"
import * as Tracer from "effect/Tracer"
import * as Cursor from "../src/Cursor.js"
import { EventLogError } from "../src/EventLog.js"
import * as AppendQueue from "../src/internal/eventLog/appendQueue.js"
import { Lock } from "../src/internal/lock.js"

interface FakeHandle extends AppendQueue.QueueHandle {
  readonly lock: Lock
}

/**
 * A store whose flushes record what they write, each waiting for `gate` when one is set. Its
 * `writeNow` records the batch's write at once (the file store writes it then) and answers it
 * then, or when the gate opens.
 */
const fakeStore = Effect.gen(function*() {
  const written: Array<string> = []
  const flushes: Array<number> = []
  /** The fiber each flush ran in. */
  const flushFibers: Array<FiberId.FiberId> = []
  let gate: Deferred.Deferred<void> | undefined
  /** `writeNow` answers held by the gate. */
  let heldNow: Array<() => void> = []
  const handle: FakeHandle = { sessionId: "s", next: Cursor.make(1, 0), queue: [], dead: undefined, lock: new Lock() }
  const queue = yield* AppendQueue.make<FakeHandle>({
    open: () => Effect.succeed(handle),
    writeNow: {
      ready: () => true,
      write: (_h, ops, done) => {
        flushes.push(ops.length)
        for (const op of ops) written.push(Cursor.format(op.cursor))
        if (gate === undefined) done(undefined)
        else heldNow.push(() => done(undefined))
      }
    },
    flush: (batch) =>
      Effect.uninterruptible(Effect.gen(function*() {
        flushFibers.push(yield* Effect.fiberId)
        if (gate !== undefined) yield* Deferred.await(gate)
        for (const [, ops] of batch) {
          flushes.push(ops.length)
          for (const op of ops) {
            if (op._tag !== "Append") continue
            written.push(Cursor.format(op.cursor))
            op.resume(Effect.succeed(op.cursor))
          }
        }
      })),
    grouping: { _tag: "Session", lockOf: (h) => h.lock }
  })
  return {
    queue,
    handle,
    written,
    flushes,
    flushFibers,
    /** Holds every write until the returned effect is run. */
    hold: Effect.gen(function*() {
      const d = yield* Deferred.make<void>()
      gate = d
      return Effect.sync(() => {
        gate = undefined
        Deferred.unsafeDone(d, Effect.void)
        const held = heldNow
        heldNow = []
        for (const answer of held) answer()
      })
    })
  }
})

const range = (n: number) => Array.from({ length: n }, (_, i) => i)

/** `appendAll` through `appendAllNow` when the queue takes it at once, as the session's publish does. */
const appendNow = (queue: AppendQueue.AppendQueue<FakeHandle>, events: ReadonlyArray<Record<string, unknown>>) =>
  Effect.withFiberRuntime<ReadonlyArray<Cursor.Cursor>, EventLogError>((fiber) =>
    Effect.async((resume) => {
      let cursors: ReadonlyArray<Cursor.Cursor> | undefined
      const now = queue.appendAllNow!("s", events, fiber.currentTracer, (error) =>
        // Possibly called before appendAllNow returned: the cursors are read once they are set.
        resume(error === undefined ? Effect.suspend(() => Effect.succeed(cursors!)) : Effect.fail(error)))
      if (now === undefined) return resume(queue.appendAll("s", events))
      if (now instanceof EventLogError) return resume(Effect.fail(now))
      cursors = now
    })
  )

describe("AppendQueue (Session grouping)", () => {
  it.scoped("an append with nothing queued is written in the appender's fiber; those arriving meanwhile form the next batch", () =>
    Effect.gen(function*() {
      const store = yield* fakeStore
      assert.deepStrictEqual(yield* store.queue.appendAll("s", [{ a: 1 }, { a: 2 }]), [Cursor.make(1, 0), Cursor.make(1, 1)])
      assert.deepStrictEqual(store.flushes, [2])
      assert.deepStrictEqual(store.flushFibers, [yield* Effect.fiberId])
      const release = yield* store.hold
      const first = yield* Effect.fork(store.queue.append("s", { b: 1 }))
      yield* Effect.yieldNow()
      // Queued behind the batch being written: one more batch for the two of them.
      const later = yield* Effect.fork(Effect.all([store.queue.append("s", { c: 1 }), store.queue.append("s", { c: 2 })], { concurrency: "unbounded" }))
      while (store.handle.queue.length < 2) yield* Effect.yieldNow()
      assert.deepStrictEqual(store.flushes, [2])
      yield* release
      assert.deepStrictEqual(yield* Fiber.join(first), Cursor.make(1, 2))
      assert.deepStrictEqual(yield* Fiber.join(later), [Cursor.make(1, 3), Cursor.make(1, 4)])
      assert.deepStrictEqual(store.flushes, [2, 1, 2])
      assert.deepStrictEqual(store.written, range(5).map((i) => `1:${i}`))
    }))

  it.scoped("an appender interrupted while it waits for the session's lock leaves its events queued: they are written, no gap", () =>
    Effect.gen(function*() {
      const store = yield* fakeStore
      // The lock held elsewhere (a prune, a removal): the appender waits for it.
      yield* store.handle.lock.take((e) => e)
      const waiting = yield* Effect.fork(store.queue.appendAll("s", [{ a: 1 }, { a: 2 }]))
      yield* Effect.yieldNow()
      yield* Fiber.interrupt(waiting)
      const next = yield* Effect.fork(store.queue.append("s", { b: 1 }))
      yield* Effect.yieldNow()
      store.handle.lock.release()
      assert.deepStrictEqual(yield* Fiber.join(next), Cursor.make(1, 2))
      assert.deepStrictEqual(store.written, ["1:0", "1:1", "1:2"])
    }))

  it.scoped("appendAllNow writes at once when nothing of the session is queued, being written or locked, and answers once durable; otherwise it declines", () =>
    Effect.gen(function*() {
      const store = yield* fakeStore
      const tracer = yield* Effect.tracer
      const answers: Array<EventLogError | undefined> = []
      const answer = (error: EventLogError | undefined) => void answers.push(error)
      // Not open yet: declined (appendAll opens it).
      assert.isUndefined(store.queue.appendAllNow!("s", [{ a: 0 }], tracer, answer))
      yield* store.queue.append("s", { a: 0 })
      // An event that cannot be serialized: its error, nothing taken or held, no answer.
      const bad = store.queue.appendAllNow!("s", [{ c: 1 }, { c: 1n }], tracer, answer)
      assert.instanceOf(bad, EventLogError)
      assert.strictEqual((bad as EventLogError).reason, "InvalidEvent")
      assert.isFalse(store.handle.lock.isHeld)
      const release = yield* store.hold
      const now = store.queue.appendAllNow!("s", [{ a: 1 }, { a: 2 }], tracer, answer)
      assert.deepStrictEqual(now, [Cursor.make(1, 1), Cursor.make(1, 2)])
      // Written at once; answered once durable, holding the lock until then.
      assert.deepStrictEqual(store.written, ["1:0", "1:1", "1:2"])
      assert.deepStrictEqual(answers, [])
      assert.isTrue(store.handle.lock.isHeld)
      // A batch is being written: declined, and an append queues behind it.
      assert.isUndefined(store.queue.appendAllNow!("s", [{ b: 1 }], tracer, answer))
      const queued = yield* Effect.fork(store.queue.append("s", { b: 1 }))
      while (store.handle.queue.length < 1) yield* Effect.yieldNow()
      assert.isUndefined(store.queue.appendAllNow!("s", [{ b: 2 }], tracer, answer))
      yield* release
      assert.deepStrictEqual(answers, [undefined])
      // What queued meanwhile got a flusher when the batch ended (it ends once it finds none).
      assert.deepStrictEqual(yield* Fiber.join(queued), Cursor.make(1, 3))
      yield* Effect.repeatN(Effect.yieldNow(), 2)
      assert.isFalse(store.handle.lock.isHeld)
      // The lock held elsewhere (a prune): declined.
      assert.isTrue(store.handle.lock.tryTake())
      assert.isUndefined(store.queue.appendAllNow!("s", [{ c: 1 }], tracer, answer))
      store.handle.lock.release()
      // A traced program's writes are spans: declined.
      const recording = Tracer.make({ span: tracer.span, context: (f) => f() })
      assert.isUndefined(store.queue.appendAllNow!("s", [{ c: 1 }], recording, answer))
      assert.deepStrictEqual(yield* appendNow(store.queue, [{ c: 2 }]), [Cursor.make(1, 4)])
      assert.deepStrictEqual(store.written, range(5).map((i) => `1:${i}`))
    }))

  it.scoped("appenders interrupted at random points, with the lock and the writes held at random: every cursor handed out is written once, in order", () =>
    Effect.gen(function*() {
      const store = yield* fakeStore
      let seed = 11
      const rand = (n: number) => {
        seed = (seed * 1103515245 + 12345) % 2147483648
        return seed % n
      }
      let handedOut = 0
      const acknowledged: Array<string> = []
      for (const _round of range(200)) {
        const release = rand(3) === 0 ? yield* store.hold : undefined
        const locked = rand(4) === 0
        if (locked) yield* store.handle.lock.take((e) => e)
        const fibers = yield* Effect.forEach(range(1 + rand(4)), () => {
          const events = range(1 + rand(3)).map((i) => ({ i }))
          handedOut += events.length
          const appended = rand(2) === 0 ? store.queue.appendAll("s", events) : appendNow(store.queue, events)
          return Effect.fork(Effect.tap(appended, (cs) => Effect.sync(() => acknowledged.push(...cs.map(Cursor.format)))))
        })
        for (const fiber of fibers) {
          yield* Effect.repeatN(Effect.yieldNow(), rand(3))
          if (rand(2) === 0) yield* Fiber.interrupt(fiber)
        }
        if (locked) store.handle.lock.release()
        if (release !== undefined) yield* release
        yield* Effect.forEach(fibers, Fiber.await, { discard: true })
      }
      // Whatever is still queued is written by then.
      yield* store.queue.append("s", { last: true })
      handedOut++
      assert.deepStrictEqual(store.written, range(handedOut).map((i) => `1:${i}`))
      const written = new Set(store.written)
      for (const c of acknowledged) assert.isTrue(written.has(c))
    }))

  it.scoped("a flush is the span EventLog.flush when a tracer was provided (an embedder's); with Effect's own tracer none is made", () =>
    Effect.gen(function*() {
      const spans: Array<string> = []
      const recording = Tracer.make({
        span: (name, parent, context, links, startTime, kind) => {
          spans.push(name)
          return builtIn.span(name, parent, context, links, startTime, kind)
        },
        context: (f) => f()
      })
      const builtIn = yield* Effect.tracer
      const store = yield* fakeStore
      yield* store.queue.append("s", { a: 1 }).pipe(Effect.withTracer(recording))
      assert.deepStrictEqual(spans, ["EventLog.flush"])
      // Effect's own tracer keeps its spans nowhere: none is made.
      yield* store.queue.append("s", { a: 2 })
      assert.deepStrictEqual(spans, ["EventLog.flush"])
    }))
})

/** As the file store: a forEach over writes that are each uninterruptible (not the whole flush). */
const forEachStore = Effect.gen(function*() {
  const written: Array<string> = []
  const handle: FakeHandle = { sessionId: "s", next: Cursor.make(1, 0), queue: [], dead: undefined, lock: new Lock() }
  const queue = yield* AppendQueue.make<FakeHandle>({
    open: () => Effect.succeed(handle),
    // As the file store: a forEach over writes that are each uninterruptible.
    flush: (batch) =>
      Effect.forEach(batch, ([, ops]) =>
        Effect.uninterruptible(Effect.sync(() => {
          for (const op of ops) {
            if (op._tag !== "Append") continue
            written.push(Cursor.format(op.cursor))
            op.resume(Effect.succeed(op.cursor))
          }
        })), { discard: true }),
    grouping: { _tag: "Session", lockOf: (h) => h.lock }
  })
  return { queue, handle, written }
})

let victim: Fiber.RuntimeFiber<unknown, unknown> | undefined
const interruptVictim = () => victim!.unsafeInterruptAsFork(FiberId.none)

describe("AppendQueue in place: interruption at any op boundary", () => {
  it.scopedLive("A: interrupted right after its op is queued: later appends are still written", () =>
    Effect.gen(function*() {
      const s = yield* forEachStore
      yield* s.queue.append("s", { n: 0 })
      const event = { n: 1, toJSON: () => (interruptVictim(), { n: 1 }) }
      victim = yield* Effect.fork(s.queue.append("s", event))
      yield* Fiber.await(victim)
      const later = yield* s.queue.append("s", { n: 2 }).pipe(Effect.timeout("1 second"), Effect.either)
      assert.isTrue(later._tag === "Right", "a later append hangs: the session is left `flushing` with nobody flushing")
      assert.deepStrictEqual(s.written, ["1:0", "1:1", "1:2"])
    }))

  it.scopedLive("B: interrupted after its batch is taken, before the store's write: no cursor lost, every caller answered", () =>
    Effect.gen(function*() {
      const s = yield* forEachStore
      yield* s.queue.append("s", { n: 0 })
      let armed = true
      const builtIn = yield* Effect.tracer
      const tracer = Tracer.make({
        span: (name, parent, context, links, startTime, kind) => {
          if (armed && name === "EventLog.flush") {
            armed = false
            interruptVictim()
          }
          return builtIn.span(name, parent, context, links, startTime, kind)
        },
        context: (f) => f()
      })
      yield* s.handle.lock.take((e) => e)
      victim = yield* Effect.fork(Effect.withTracer(s.queue.append("s", { n: 1 }), tracer))
      yield* Effect.yieldNow()
      const bystander = yield* Effect.fork(s.queue.append("s", { n: 2 }))
      yield* Effect.yieldNow()
      s.handle.lock.release()
      yield* Fiber.await(victim)
      const answered = yield* Fiber.join(bystander).pipe(Effect.timeout("1 second"), Effect.either)
      assert.isTrue(answered._tag === "Right", "an append taken into the interrupted batch is never answered")
      yield* s.queue.append("s", { n: 3 })
      assert.deepStrictEqual(s.written, ["1:0", "1:1", "1:2", "1:3"])
    }))
})
