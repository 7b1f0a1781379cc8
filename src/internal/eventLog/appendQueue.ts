/**
 * The event logs' append path, the same for every store: the open sessions, the per-session
 * queue with group commit, and `append`/`appendAll`/`startGeneration`. A store gives how to open
 * a session and how to write one flush (`flush`); this module does the rest.
 *
 * Group commit: `append` serializes the event, assigns its cursor and queues it in one
 * synchronous step (cursor order is queue order), then waits. A flusher fiber takes everything
 * queued, hands it to the store's `flush` in one batch, and the store acknowledges those ops only
 * once they are durable; appends that arrive meanwhile form the next batch. Single-threaded JS
 * makes each synchronous section atomic between fibers, and no interruption can fall between
 * assigning a cursor and queueing it.
 *
 * Two groupings: `Session`, one flusher per busy session under that session's lock (a file per
 * session: sessions write in parallel); `Store`, one flusher for every session under one lock
 * (a database: one commit, one WAL flush, however many sessions a flush carries).
 */
import * as Deferred from "effect/Deferred"
import * as Effect from "effect/Effect"
import * as Exit from "effect/Exit"
import * as FiberId from "effect/FiberId"
import * as FiberSet from "effect/FiberSet"
import type * as Scope from "effect/Scope"
import type * as Tracer from "effect/Tracer"
import * as Cursor from "../../Cursor.js"
import { type EncodedEvent, type EventData, EventLogError } from "../../EventLog.js"
import type { Lock } from "../lock.js"
import { type EventText, fail, serialize } from "./records.js"

/** One queued write: an event with its assigned cursor, or the start of a generation. */
export type Op =
  | {
    readonly _tag: "Append"
    readonly cursor: Cursor.Cursor
    /** The event's JSON text. */
    readonly json: EventText
    readonly resume: (result: Effect.Effect<Cursor.Cursor, EventLogError>) => void
  }
  | {
    readonly _tag: "Rotate"
    readonly generation: number
    readonly resume: (result: Effect.Effect<number, EventLogError>) => void
  }

export type AppendOp = Extract<Op, { readonly _tag: "Append" }>

/**
 * The `resume` of an op of `appendAll` other than its last: the last answers for all of them
 * (they are written together), so a store may skip making a result for this one.
 */
export const answeredByLast = (): void => {}

/** What the queue needs of a store's open session. */
export interface QueueHandle {
  readonly sessionId: string
  /** The cursor the next append gets (assigned, not yet durable). */
  next: Cursor.Cursor
  /** Ops queued for the next flush. */
  queue: Array<Op>
  /** Set once the handle is unusable: every op fails with it. */
  dead: EventLogError | undefined
}

/** One flush: each session's queued ops, in order. */
export type Batch<H> = ReadonlyArray<readonly [H, ReadonlyArray<Op>]>

export interface AppendQueueOptions<H extends QueueHandle> {
  /** Opens a session (reads where its log stands); called once per session at a time. */
  readonly open: (sessionId: string) => Effect.Effect<H, EventLogError>
  /**
   * Writes one batch and answers every op of it; never fails: on a failure it fails the ops and
   * kills their handles ({@link AppendQueue.kill}), so the session is opened again at its next use.
   */
  readonly flush: (batch: Batch<H>) => Effect.Effect<void>
  /**
   * Session grouping, optional: writing outside any fiber, for {@link AppendQueue.appendAllNow}.
   * `ready`: whether `write` can start on the handle now. `write` starts writing the appends in
   * the caller's synchronous step and calls `done` once they are durable or failed (the
   * failure handled as `flush` handles it, the handle killed with {@link AppendQueue.killNow});
   * `done` may be called before `write` returns. The ops' own `resume`s need not be called.
   */
  readonly writeNow?: {
    readonly ready: (h: H) => boolean
    readonly write: (h: H, ops: ReadonlyArray<AppendOp>, done: (error: EventLogError | undefined) => void) => void
  }
  /** Releases what a dead handle holds (an open file). */
  readonly release?: (h: H) => Effect.Effect<void>
  readonly grouping:
    | { readonly _tag: "Session"; readonly lockOf: (h: H) => Lock }
    | { readonly _tag: "Store"; readonly lock: Effect.Semaphore }
  /** When set, every write fails with what it returns (a read-only log). */
  readonly refuse?: (sessionId: string) => EventLogError
}

export interface AppendQueue<H extends QueueHandle> {
  /** The open handles (a handle that is not here is opened by {@link handleFor}). */
  readonly handles: ReadonlyMap<string, H>
  /** The session's open handle, opening it once however many fibers ask at the same time. */
  readonly handleFor: (sessionId: string) => Effect.Effect<H, EventLogError>
  /** Marks a handle unusable: fails everything queued, forgets it and releases what it holds. */
  readonly kill: (h: H, error: EventLogError) => Effect.Effect<void>
  /** `kill` outside a fiber: done at once but for the release, which runs in the queue's scope. */
  readonly killNow: (h: H, error: EventLogError) => void
  /** Kills the session's open handle, if any (`EventLogService.forget`). */
  readonly forget: (sessionId: string) => Effect.Effect<void>
  readonly append: (sessionId: string, event: EventData | EncodedEvent) => Effect.Effect<Cursor.Cursor, EventLogError>
  readonly appendAll: (
    sessionId: string,
    events: ReadonlyArray<EventData | EncodedEvent>
  ) => Effect.Effect<ReadonlyArray<Cursor.Cursor>, EventLogError>
  readonly startGeneration: (sessionId: string) => Effect.Effect<number, EventLogError>
  /** See EventLogService.appendAllNow; undefined for a store without `writeNow`. */
  readonly appendAllNow:
    | ((
      sessionId: string,
      events: ReadonlyArray<EventData | EncodedEvent>,
      tracer: Tracer.Tracer,
      done: (error: EventLogError | undefined) => void
    ) => ReadonlyArray<Cursor.Cursor> | EventLogError | undefined)
    | undefined
}

/** The tracer a program has when none was provided: Effect's own, which nobody reads. */
const builtInTracer = Effect.runSync(Effect.tracer)

/**
 * A flush as the span `EventLog.flush`, when a tracer was provided (an embedder's OpenTelemetry):
 * a span costs ~12 us of CPU even with Effect's own tracer, which keeps it nowhere, and at a
 * model's pace every event is a flush of its own (~10% of the daemon's CPU per event).
 */
const traced = (flush: Effect.Effect<void>, attributes: Record<string, unknown>): Effect.Effect<void> =>
  Effect.tracerWith((tracer) =>
    tracer === builtInTracer ? flush : Effect.withSpan(flush, "EventLog.flush", { attributes, captureStackTrace: false })
  )

/** Builds the queue; its scope owns the flusher fibers, and closing it fails what is still queued. */
export const make = <H extends QueueHandle>(
  options: AppendQueueOptions<H>
): Effect.Effect<AppendQueue<H>, never, Scope.Scope> =>
  Effect.gen(function*() {
    const handles = new Map<string, H>()
    const opening = new Map<string, Deferred.Deferred<H, EventLogError>>()
    let closed: EventLogError | undefined

    /** What `kill` does at once: the handle is dead, its queue failed, and it is forgotten. */
    const markDead = (h: H, error: EventLogError): void => {
      h.dead ??= error
      const queued = h.queue
      h.queue = []
      for (const op of queued) op.resume(Effect.fail(h.dead))
      if (handles.get(h.sessionId) === h) handles.delete(h.sessionId)
    }

    /**
     * A batch being written keeps what the handle holds until its write ends (see `flushEnded`):
     * a failed write cuts its bytes off through the handle's file, which a release would close
     * under it (and a reopen would then adopt records whose appends reported failure).
     */
    const kill = (h: H, error: EventLogError): Effect.Effect<void> =>
      Effect.suspend(() => {
        markDead(h, error)
        return options.release === undefined || flushing.has(h) ? Effect.void : options.release(h)
      })

    // Registered before the FiberSet so that it runs after the flushers were interrupted (each
    // finishes its in-flight batch first: the store's flush is uninterruptible).
    yield* Effect.addFinalizer(() =>
      Effect.suspend(() => {
        closed = fail("Closed", "", "the event log was closed")
        return Effect.forEach([...handles.values()], (h) => kill(h, fail("Closed", h.sessionId, "the event log was closed")), {
          discard: true
        })
      })
    )
    const flushers = yield* FiberSet.make<void, never>()
    const runFlusher = yield* FiberSet.runtime(flushers)<never>()

    const handleFor = (sessionId: string): Effect.Effect<H, EventLogError> =>
      Effect.suspend(() => {
        const h = handles.get(sessionId)
        if (h !== undefined) return Effect.succeed(h)
        if (closed !== undefined) return Effect.fail(closed)
        const pending = opening.get(sessionId)
        if (pending !== undefined) return Deferred.await(pending)
        const deferred = Deferred.unsafeMake<H, EventLogError>(FiberId.none)
        opening.set(sessionId, deferred)
        // Uninterruptible: other fibers may be waiting on this opening.
        return options.open(sessionId).pipe(
          Effect.exit,
          Effect.flatMap((exit) => {
            opening.delete(sessionId)
            if (Exit.isSuccess(exit)) handles.set(sessionId, exit.value)
            Deferred.unsafeDone(deferred, exit)
            return exit
          }),
          Effect.uninterruptible
        )
      })

    // After each flush the loop yields: the appenders just acknowledged usually append again at
    // once, and their records then join the next write instead of waiting for the one after it.
    /** Session grouping: the sessions whose batch is being written (by a flusher, or in place). */
    const flushing = new Set<H>()
    /**
     * Session grouping: a batch's write ended. A handle killed meanwhile lets go of what it holds
     * now (`kill` left it); otherwise what was queued meanwhile gets a flusher.
     */
    const flushEnded = (h: H): void => {
      flushing.delete(h)
      if (h.dead !== undefined) {
        // Forked on the default runtime: this queue's scope may be closing (its finalizer kills
        // every handle, and a write outside a fiber may end after it).
        if (options.release !== undefined) Effect.runFork(options.release(h))
      } else if (h.queue.length > 0) ensureFlusher(h)
    }
    /**
     * Session grouping: writes what `h` has queued once its lock is taken, as one batch (taken
     * then, not before: a caller interrupted while it waits for the lock leaves its ops queued).
     */
    const flushQueued = (lockOf: (h: H) => Lock, h: H): Effect.Effect<void> =>
      Effect.uninterruptibleMask((restore) => flushQueuedIn(restore, lockOf(h), h))
    /**
     * The same, inside an uninterruptible region whose `restore` makes only the wait for the lock
     * interruptible: from taking the ops to the end of their write no interruption can land (an
     * interruption between them lost the batch: its cursors never written, its appenders never
     * answered).
     */
    const flushQueuedIn = (
      restore: <A, E, R>(effect: Effect.Effect<A, E, R>) => Effect.Effect<A, E, R>,
      lock: Lock,
      h: H
    ): Effect.Effect<void> =>
      Effect.zipRight(
        lock.take(restore),
        Effect.ensuring(
          Effect.suspend(() => {
            const ops = h.queue
            if (ops.length === 0) return Effect.void
            h.queue = []
            return traced(options.flush([[h, ops]]), { sessionId: h.sessionId, ops: ops.length })
          }),
          Effect.sync(() => lock.release())
        )
      )
    const ensureFlusher: (h: H) => void = options.grouping._tag === "Session"
      ? (() => {
        const lockOf = options.grouping.lockOf
        const loop = (h: H): Effect.Effect<void> =>
          Effect.gen(function*() {
            while (true) {
              if (h.queue.length === 0) return flushEnded(h)
              yield* flushQueued(lockOf, h)
              yield* Effect.yieldNow()
            }
          })
        return (h: H) => {
          if (flushing.has(h)) return
          flushing.add(h)
          // Interruptible between batches (each batch itself is not), so closing the layer is prompt.
          runFlusher(Effect.interruptible(loop(h)))
        }
      })()
      : (() => {
        const lock = options.grouping.lock
        /** Sessions with queued ops, in the order they became so. */
        const dirty = new Set<H>()
        let flushing = false
        const loop: Effect.Effect<void> = Effect.gen(function*() {
          while (true) {
            if (dirty.size === 0) {
              flushing = false
              return
            }
            const batch = [...dirty].map((h) => {
              const ops = h.queue
              h.queue = []
              return [h, ops] as const
            })
            dirty.clear()
            yield* lock.withPermits(1)(traced(options.flush(batch), { sessions: batch.length }))
            yield* Effect.yieldNow()
          }
        })
        return (h: H) => {
          dirty.add(h)
          if (flushing) return
          flushing = true
          runFlusher(Effect.interruptible(loop))
        }
      })()

    const refuse = options.refuse

    /**
     * Session grouping, nothing queued and no batch being written: the caller writes its own
     * batch in its own fiber, with no flusher forked. A session's events come one batch at a time
     * (its publisher waits for each to be durable), so at a model's pace, one event per batch,
     * the flusher forked for each and the wake-up of the appender were most of an append's cost
     * beside the write and the fdatasync. The batch, once taken, is written whatever happens to
     * the caller (the store's flush is uninterruptible); what is still queued when the caller is
     * done or interrupted (its own ops, if it was interrupted waiting for the lock; appends that
     * arrived meanwhile) gets a flusher.
     */
    type Restore = <A, E, R>(effect: Effect.Effect<A, E, R>) => Effect.Effect<A, E, R>
    const inPlace = (h: H, restore: Restore): ((ops: () => void) => Effect.Effect<void>) | undefined => {
      if (options.grouping._tag !== "Session" || flushing.has(h) || h.queue.length > 0) return undefined
      const lock = options.grouping.lockOf(h)
      // Called in the synchronous step that decided on it, inside the caller's
      // `uninterruptibleMask`: the ops are queued and `flushing` set in the step that returns
      // their clean-up, and nothing but the wait for the lock is interruptible after it.
      return (queueOps) => {
        flushing.add(h)
        queueOps()
        return flushQueuedIn(restore, lock, h).pipe(
          Effect.ensuring(Effect.sync(() => flushEnded(h)))
        )
      }
    }

    /** Serializes, assigns the cursor and queues in one synchronous step, then waits (or writes it: `inPlace`). */
    const appendTo = (h: H, sessionId: string, event: EventData | EncodedEvent) =>
      Effect.uninterruptibleMask((restore) =>
        Effect.suspend(() => {
          if (h.dead !== undefined) return Effect.fail(h.dead)
          const json = serialize(sessionId, event)
          if (json instanceof EventLogError) return Effect.fail(json)
          return Effect.map(enqueue(h, [json], restore), (cursors) => cursors[0]!)
        })
      )

    // No `Effect.fn` on the hot path: a span cost ~40 µs of CPU per call here, more than the whole
    // rest of an append.
    // Each write is traced instead, as `EventLog.flush` (one span per group commit, when a tracer
    // was provided: see `traced`).
    const append = (sessionId: string, event: EventData | EncodedEvent): Effect.Effect<Cursor.Cursor, EventLogError> => {
      if (refuse !== undefined) return Effect.fail(refuse(sessionId))
      const h = handles.get(sessionId)
      return h !== undefined
        ? appendTo(h, sessionId, event)
        : Effect.flatMap(handleFor(sessionId), (opened) => appendTo(opened, sessionId, event))
    }

    /** Assigns the cursors and queues the ops in one synchronous step, then waits for the last (or writes them: `inPlace`). */
    const queueAll = (h: H, jsons: ReadonlyArray<EventText>) =>
      Effect.uninterruptibleMask((restore) => Effect.suspend(() => enqueue(h, jsons, restore)))

    /** `queueAll` (and `appendTo`) inside the caller's uninterruptible region: `restore` is all that may be interrupted. */
    const enqueue = (h: H, jsons: ReadonlyArray<EventText>, restore: Restore): Effect.Effect<ReadonlyArray<Cursor.Cursor>, EventLogError> => {
      if (h.dead !== undefined) return Effect.fail(h.dead)
      // Queued in one synchronous step, so the ops are consecutive in one batch and one write:
      // they succeed or fail together, and the last one answers for all.
      const cursors: Array<Cursor.Cursor> = []
      const queueOps = (answerLast: (result: Effect.Effect<Cursor.Cursor, EventLogError>) => void) => {
        for (let i = 0; i < jsons.length; i++) {
          const cursor = h.next
          h.next = Cursor.next(cursor)
          cursors.push(cursor)
          h.queue.push({ _tag: "Append", cursor, json: jsons[i]!, resume: i === jsons.length - 1 ? answerLast : answeredByLast })
        }
      }
      const here = inPlace(h, restore)
      if (here !== undefined) {
        let answer: Effect.Effect<Cursor.Cursor, EventLogError> | undefined
        return Effect.zipRight(
          here(() => queueOps((result) => (answer = result))),
          Effect.suspend(() =>
            answer === undefined ? Effect.die(new Error("a flush left an append unanswered")) : Effect.as(answer, cursors)
          )
        )
      }
      return restore(Effect.async<ReadonlyArray<Cursor.Cursor>, EventLogError>((resume) => {
        if (h.dead !== undefined) return resume(Effect.fail(h.dead))
        queueOps((result) => resume(Effect.as(result, cursors)))
        ensureFlusher(h)
      }))
    }

    // The session's hot path (each batch of a worker's events), so no `Effect.fn` either, as
    // `append`: at a model's pace every batch is one event, and its span was paid per event.
    const appendAll = (
      sessionId: string,
      events: ReadonlyArray<EventData | EncodedEvent>
    ): Effect.Effect<ReadonlyArray<Cursor.Cursor>, EventLogError> => {
      if (refuse !== undefined) return Effect.fail(refuse(sessionId))
      if (events.length === 0) return Effect.succeed([])
      const jsons: Array<EventText> = []
      for (const event of events) {
        const json = serialize(sessionId, event)
        if (json instanceof EventLogError) return Effect.fail(json)
        jsons.push(json)
      }
      const h = handles.get(sessionId)
      return h !== undefined ? queueAll(h, jsons) : Effect.flatMap(handleFor(sessionId), (opened) => queueAll(opened, jsons))
    }

    const startGeneration = Effect.fn("EventLog.startGeneration")(function*(sessionId: string) {
      if (refuse !== undefined) return yield* Effect.fail(refuse(sessionId))
      const h = yield* handleFor(sessionId)
      return yield* Effect.async<number, EventLogError>((resume) => {
        if (h.dead !== undefined) return resume(Effect.fail(h.dead))
        const generation = h.next.generation + 1
        h.next = Cursor.make(generation, 0)
        h.queue.push({ _tag: "Rotate", generation, resume })
        ensureFlusher(h)
      })
    })

    const forget = (sessionId: string): Effect.Effect<void> =>
      Effect.suspend(() => {
        const h = handles.get(sessionId)
        return h === undefined ? Effect.void : kill(h, fail("Closed", sessionId, "the session's log was let go (it is read again at its next use)"))
      })

    const killNow = (h: H, error: EventLogError): void => {
      markDead(h, error)
      if (options.release !== undefined && !flushing.has(h)) runFlusher(options.release(h))
    }

    const writeNow = options.writeNow
    /**
     * `appendAll` done outside any fiber (the session's hot path): when the session's log is open
     * and the store can write on it now, nothing of it is queued or being written and its lock is
     * free, the cursors are assigned, the lock taken and the write started here, and `done` is
     * called once the events are durable (or failed); the lock is let go just before. Returns
     * the cursors, the error of an event that cannot be serialized (nothing appended, `done` not
     * called), or undefined when it cannot (`appendAll` then). Not for a traced program (its
     * writes are `EventLog.flush` spans), nor a read-only log.
     */
    const appendAllNow = options.grouping._tag !== "Session" || writeNow === undefined || refuse !== undefined
      ? undefined
      : (() => {
        const lockOf = options.grouping.lockOf
        return (
          sessionId: string,
          events: ReadonlyArray<EventData | EncodedEvent>,
          tracer: Tracer.Tracer,
          done: (error: EventLogError | undefined) => void
        ): ReadonlyArray<Cursor.Cursor> | EventLogError | undefined => {
          if (tracer !== builtInTracer || events.length === 0) return undefined
          const h = handles.get(sessionId)
          if (h === undefined || h.dead !== undefined || flushing.has(h) || h.queue.length > 0 || !writeNow.ready(h)) return undefined
          const ops: Array<AppendOp> = []
          const cursors: Array<Cursor.Cursor> = []
          let next = h.next
          for (let i = 0; i < events.length; i++) {
            const json = serialize(sessionId, events[i]!)
            if (json instanceof EventLogError) return json
            cursors.push(next)
            ops.push({ _tag: "Append", cursor: next, json, resume: answeredByLast })
            next = Cursor.next(next)
          }
          const lock = lockOf(h)
          if (!lock.tryTake()) return undefined
          h.next = next
          flushing.add(h)
          writeNow.write(h, ops, (error) => {
            lock.release()
            // (Run from the write-ahead commit's callback: a flusher started here writes its
            // batch at once, adding it to the next commit, which is safe there.)
            flushEnded(h)
            done(error)
          })
          return cursors
        }
      })()

    return { handles, handleFor, kill, killNow, forget, append, appendAll, startGeneration, appendAllNow }
  })
