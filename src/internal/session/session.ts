/**
 * A session's state in the supervisor, the errors commands fail with, and the helpers every part
 * of the core shares (lookup, publishing to the log and to attached clients, the journal).
 * The lifecycle itself is transition.ts's `step`, run by entity.ts; see SessionManager.ts for
 * the whole picture.
 *
 * Owns: the publisher (the stream's position: `lastCursor`, `messageCount`, the generation's
 * counts, and `shown`, written under the session's publish lock by whoever publishes: the
 * entity, or the loader before the entity starts) and the journal writer (`storage`).
 *
 * Who writes a `Session` once it exists: its entity (`state`, `handles`, `meta` by a rename,
 * `launchEnv`/`clientEnv`, `lastUsed`, its scope's close), and the parts that act within the
 * entity's steps or own a field: checkpoint.ts (the generation fields), the publisher here (the
 * stream's position), delivery (`attachments`: an attach adds, a detach removes). Its create or
 * its load builds it whole (SessionManager.ts `newSession`); nothing else writes it.
 */
import type * as Context from "effect/Context"
import * as Data from "effect/Data"
import type * as Deferred from "effect/Deferred"
import * as Effect from "effect/Effect"
import * as FiberSet from "effect/FiberSet"
import type * as Scope from "effect/Scope"
import type * as Tracer from "effect/Tracer"
import type * as Cursor from "../../Cursor.js"
import type { DaemonConfigShape } from "../../DaemonConfig.js"
import { EventLogError, type EventLogService } from "../../EventLog.js"
import type { SessionSummary, WorkerState } from "../../Protocol.js"
import type { RecoveryJournalService } from "../../RecoveryJournal.js"
import type { SupervisorInfo } from "../../SessionManager.js"
import type { SessionMeta, SessionStoreService } from "../../SessionStore.js"
import type { SnapshotCacheService } from "../../SnapshotCache.js"
import type { RestartPolicy, WorkerHandle, WorkerPool } from "../../WorkerPool.js"
import type { Attachment } from "../delivery/attachment.js"
import { bodyMessage, liveTailWriter, type LoggedBody, loggedTail, loggedWith, type Outgoing } from "../delivery/wireLines.js"
import * as Utf8Batch from "../utf8Batch.js"
import type { Lock } from "../lock.js"
import type { Input, InputQueue } from "./mailbox.js"
import { busyOf, type ReqId, type State, type WorkerId, workerOf, workerStateOf } from "./transition.js"
import { type CoreError, notFound, type SessionNotFound, StorageUnavailable } from "./errors.js"
import type { WorkerSlots } from "./workerSlots.js"

/**
 * Events of one worker read are logged and sent in batches of about this many bytes (one write,
 * one fsync, one encode for every client). A slow client is checked against its outbox limit
 * between batches, so it can go past the limit by one batch (or one larger event).
 */
export const PUBLISH_BATCH_BYTES = 256 * 1024

/** More than the readers of one session's baseline at any one time. */
export const READ_GATE_PERMITS = 1_000_000

export { CommandError, failed, internal, internalOfCause, notFound } from "./errors.js"

/**
 * The event log or the recovery journal could not be written (ENOSPC, EFBIG, EMFILE, EIO,
 * EACCES...): what depended on that write did not happen. A running turn is cut by it
 * (`turn_interrupted {storage_failed}`, owed until it can be logged); a prompt is refused
 * `storage_unavailable`.
 */
export class StorageFailed extends Data.TaggedError("StorageFailed")<{
  readonly what: "event log" | "recovery journal"
  readonly message: string
}> {}

/** A prompt that cannot be made durable: refused, never accepted then dropped. */
export const storageUnavailable = (id: string, e: StorageFailed) =>
  new StorageUnavailable({ message: `Session \`${id}\` cannot take a prompt: ${e.message}` })

/** A storage failure outside a turn, as the answer to the command that met it. */
export const storageAsUnavailable = <A, E, R>(effect: Effect.Effect<A, E | StorageFailed, R>) =>
  Effect.catchIf(
    effect,
    (e): e is StorageFailed => e instanceof StorageFailed,
    (e) => Effect.fail(new StorageUnavailable({ message: e.message }))
  ) as Effect.Effect<A, Exclude<E, StorageFailed> | StorageUnavailable, R>

/** A session's state in the supervisor. */
export interface Session {
  meta: SessionMeta
  /**
   * Messages in the transcript. The transcript itself is never held here: it is the current
   * generation's snapshot file plus the `message_end` events logged since (the worker holds it).
   */
  messageCount: number
  /** How many messages the current generation's snapshot holds. */
  baseMessageCount: number
  generation: number
  /** The cursor of the last event before the current generation (the snapshot's cursor). */
  snapshotCursor: Cursor.Cursor | undefined
  generationEvents: number
  generationBytes: number
  lastCursor: Cursor.Cursor | undefined
  attachments: Set<Attachment>
  /** Serializes appends so cursors are published in order. */
  publishLock: Lock
  /** Readers of the current generation take one permit; a checkpoint's completion takes them all. */
  readGate: Effect.Semaphore
  lastUsed: number
  launchEnv: Record<string, string> | undefined
  clientEnv: Record<string, string> | undefined
  /** The latest generation whose snapshot rewrote history (PROTOCOL: replay never crosses it). */
  rewriteGeneration: number | undefined
  /**
   * The session's own scope: its fibers (the worker's frame pump, a restart waiting for its
   * backoff, a worker being acquired) end with it. `kill` closes it.
   */
  scope: Scope.CloseableScope
  fibers: FiberSet.FiberSet
  /**
   * The lifecycle, one value: written only by the session's entity, with what `step` returns
   * (transition.ts). Read by anyone.
   */
  state: State
  /** The worker and request handles the state names by id (the entity's tables). */
  handles: Handles
  mailbox: InputQueue<Input>
  /** The latest checkpoint's snapshot file: every journal record names it (once there is one). */
  sessionFile: string | undefined
  /**
   * What the stream last said of the session's busy and worker state (its last status logged):
   * what the summary shows, so that nobody reading under the publish lock sees a state the log
   * does not say yet, nor one a status that could not be logged was to say.
   */
  shown: { busy: boolean; worker: WorkerState }
  /**
   * The ids of the last tagged prompts whose turns started (a client's `promptId`, or a cluster
   * runner's for a forwarded prompt), oldest first, at most {@link STARTED_PROMPTS_KEPT}: read
   * from the log at the session's load, then added by each turn's start. A prompt sent again with
   * one of them is answered without a second turn.
   */
  startedPrompts: Array<string>
  /**
   * The answers of tagged prompts not answered yet, by `promptId`: the same prompt sent again
   * meanwhile (its worker still starting, its turn not durable yet) gets the first one's answer
   * instead of `session_busy`. An entry whose answer came is dropped when another is added.
   */
  readonly waitingPrompts: Map<string, Deferred.Deferred<{ accepted: true }, CoreError>>
}

/** How many started prompt ids a session remembers (docs/protocol.md section 9). */
export const STARTED_PROMPTS_KEPT = 64

/** Remembers `promptId` among the session's started prompts (bounded, oldest dropped). */
export const rememberPrompt = (started: Array<string>, promptId: string): void => {
  started.push(promptId)
  if (started.length > STARTED_PROMPTS_KEPT) started.splice(0, started.length - STARTED_PROMPTS_KEPT)
}

/** The entity's tables: the handles behind the ids in the session's state. */
export interface Handles {
  nextId: number
  readonly requests: Map<ReqId, Deferred.Deferred<any, any>>
  readonly workers: Map<WorkerId, WorkerHandle>
  readonly workerIds: Map<WorkerHandle, WorkerId>
  /** The wire id of the turn running (`prompt` and `abort` frames name it). */
  turnId: string
}

export const newHandles = (): Handles => ({ nextId: 0, requests: new Map(), workers: new Map(), workerIds: new Map(), turnId: "" })

/** Whether the session is closed (killed). */
export const isClosed = (s: Session): boolean => s.state._tag === "Closed"

/** The session's worker process, if its state has one. */
export const workerHandleOf = (s: Session): WorkerHandle | undefined => {
  const id = workerOf(s.state)
  return id === undefined ? undefined : s.handles.workers.get(id)
}

export const snapshotIdOf = (s: Session, generation: number) => `${s.meta.activeSessionId}~g${generation}`

/** What every part of the core works with: its dependencies and the sessions' registry. */
export interface CoreDeps {
  readonly config: DaemonConfigShape
  readonly info: Context.Tag.Service<typeof SupervisorInfo>
  readonly log: EventLogService
  readonly store: SessionStoreService
  readonly journal: RecoveryJournalService
  readonly cache: SnapshotCacheService
  readonly pool: Context.Tag.Service<typeof WorkerPool>
  readonly fibers: FiberSet.FiberSet
  /** The bound on live workers (`maxWorkers`). */
  readonly slots: WorkerSlots
  readonly sessions: Map<string, Session>
  /** connectionId -> its attachments. */
  readonly connections: Map<string, Map<string, Attachment>>
  readonly restartPolicy: RestartPolicy
  /** A new scope for a session (a child of the manager's) and its fibers. */
  readonly sessionScope: Effect.Effect<{ readonly scope: Scope.CloseableScope; readonly fibers: FiberSet.FiberSet }>
}

/**
 * The seam between the session core and its clients' stream: every sequenced message of a
 * session is appended to the event log, then handed to its live attachments.
 */
export interface Publisher {
  /** The session's summary now (what the stream shows, while a storage stall freezes it). */
  readonly summary: (s: Session) => SessionSummary
  /** Appends messages to the log (one group commit) and hands them to live attachments. */
  readonly publishAll: (s: Session, messages: ReadonlyArray<Outgoing>) => Effect.Effect<void, StorageFailed>
  /**
   * `publishAll` outside any fiber: true when it took the batch (then `done` is called once, when
   * it was logged and delivered, or failed; `defect`: delivering it threw, a broken invariant);
   * false, having done nothing, when it cannot now.
   */
  readonly publishNow: (
    s: Session,
    messages: ReadonlyArray<Outgoing>,
    tracer: Tracer.Tracer,
    done: (error: StorageFailed | undefined, defect?: unknown) => void
  ) => boolean
  readonly publish: (s: Session, body: LoggedBody) => Effect.Effect<void, StorageFailed>
  /** Publishes the session's status (`view`, or what its state says); the summary shows it once logged. */
  /** `promptId`: the tagged prompt whose turn this status starts (docs/protocol.md section 9). */
  readonly publishStatus: (s: Session, view?: { readonly busy: boolean; readonly worker: WorkerState }, promptId?: string) => Effect.Effect<void, StorageFailed>
  /** The session's summary and last cursor at one moment, consistent with what is logged. */
  readonly publishedState: (s: Session) => Effect.Effect<{ state: SessionSummary; lastCursor: Cursor.Cursor | undefined }>
}

/** The seam between the session core and the recovery journal. */
export interface JournalWriter {
  /** Whether the journal takes writes (`status` shows it). */
  readonly storage: { ok: boolean; error: string | undefined }
  /** A record a step depends on: its failure is the step's. */
  readonly record: (s: Session, busy: boolean, operation: string) => Effect.Effect<boolean, StorageFailed>
  /** A record nothing waits on: a failure is logged and shown in `status`. */
  readonly recordBestEffort: (s: Session, busy: boolean, operation: string) => Effect.Effect<void>
}

/** What every part of the core works with: its dependencies, the registry, publishing, the journal. */
export interface Core extends CoreDeps, Publisher, JournalWriter {
  /** Forks work that must finish even if its session is killed (stopping a worker). */
  readonly fork: <A, E>(effect: Effect.Effect<A, E>) => Effect.Effect<void>
  /** Forks work of one session, in its scope. */
  readonly forkIn: <A, E>(s: Session, effect: Effect.Effect<A, E>) => Effect.Effect<void>
  /** A live session, or `session_not_found`. */
  readonly get: (id: string) => Effect.Effect<Session, SessionNotFound>
  /** The environment a new worker of the session gets. */
  readonly workerEnv: (s: Session) => Record<string, string> | undefined
  /** Posts an input that needs no answer (from the session's own fibers). */
  readonly post: (s: Session, input: Input) => Effect.Effect<void>
  /** Only the variables of a client's `env` that the configuration lets through. */
  readonly filterEnv: (env: Record<string, string> | undefined) => Record<string, string> | undefined
}

/** The dependencies and the helpers every part of the core shares: lookup, publishing, journal. */
export const makeCore = (deps: CoreDeps): Core => {
  const { config, journal, log, sessions } = deps

  /**
   * Whether the journal takes writes (`status` shows it): set by a failed journal write, cleared
   * by the next one that succeeds.
   */
  const storage: { ok: boolean; error: string | undefined } = { ok: true, error: undefined }

  /** Forks work that must finish even if its session is killed (stopping a worker). */
  const fork = <A, E>(effect: Effect.Effect<A, E>) => FiberSet.run(deps.fibers, effect).pipe(Effect.asVoid)

  /** Forks work of one session, in its scope. */
  const forkIn = <A, E>(s: Session, effect: Effect.Effect<A, E>) => FiberSet.run(s.fibers, effect).pipe(Effect.asVoid)

  const summary = (s: Session): SessionSummary => {
    const out: {
      -readonly [K in keyof SessionSummary]: SessionSummary[K]
    } = {
      activeSessionId: s.meta.activeSessionId,
      engine: s.meta.engine,
      createdAt: s.meta.createdAt,
      messageCount: s.messageCount,
      // What the stream said last (a storage stall freezes it): see Session.shown.
      busy: s.state._tag === "Closed" ? false : s.shown.busy,
      worker: s.state._tag === "Closed" ? "closed" : s.shown.worker,
      restarts: s.state.restarts,
      telemetry: s.meta.telemetry
    }
    if (s.meta.name !== undefined) out.name = s.meta.name
    const worker = workerHandleOf(s)
    if (worker !== undefined) out.workerPid = worker.pid
    if (s.lastCursor !== undefined) out.lastEventCursor = s.lastCursor
    return out
  }

  const get = (id: string) =>
    Effect.suspend(() => {
      const s = sessions.get(id)
      return s === undefined || isClosed(s) ? Effect.fail(notFound(id)) : Effect.succeed(s)
    })

  const storageFailed = (e: EventLogError) => new StorageFailed({ what: "event log", message: e.message })

  /** The log's append outside any fiber (the hot path), when it has one. */
  const appendNow = log.appendAllNow

  /**
   * `publishAll` outside any fiber, when the publish lock is free and the log takes the batch at
   * once (`appendAllNow`): the batch is logged, handed to the attachments and `done` called, with
   * no fiber's step between the write and its delivery. At a model's pace every batch is one
   * event, and the Effect steps of the lock, the append and the write were most of its cost.
   * Returns false, having done nothing, when it cannot (then `publishAll`).
   */
  const publishNow = (
    s: Session,
    messages: ReadonlyArray<Outgoing>,
    tracer: Tracer.Tracer,
    done: (error: StorageFailed | undefined, defect?: unknown) => void
  ): boolean => {
    if (appendNow === undefined || messages.length === 0 || !s.publishLock.tryTake()) return false
    const emittedAt = Date.now()
    let cursors: ReadonlyArray<Cursor.Cursor> | EventLogError | undefined
    /** Set once appendNow returned: an answer before that is taken after it. */
    let returned = false
    let early: { readonly error: EventLogError | undefined } | undefined
    const settle = (error: EventLogError | undefined) => {
      // Usually from the log's commit callback, where a throw would skip the other sessions'
      // answers: a defect goes to the fiber waiting instead.
      let defect: unknown
      if (error === undefined) {
        try {
          deliver(s, messages, emittedAt, cursors as ReadonlyArray<Cursor.Cursor>)
        } catch (thrown) {
          defect = thrown ?? new Error("publish: delivery threw")
        }
      }
      s.publishLock.release()
      done(error === undefined ? undefined : storageFailed(error), defect)
    }
    try {
      cursors = appendNow(s.meta.activeSessionId, loggedEntries(messages, emittedAt), tracer, (error) => {
        if (returned) settle(error)
        else early = { error }
      })
    } catch (thrown) {
      s.publishLock.release()
      throw thrown
    }
    returned = true
    if (cursors === undefined) {
      s.publishLock.release()
      return false
    }
    if (cursors instanceof EventLogError) {
      s.publishLock.release()
      done(storageFailed(cursors))
      return true
    }
    if (early !== undefined) settle(early.error)
    return true
  }

  /**
   * Appends messages to the log (one group commit) and hands them to live attachments; outside
   * any fiber's steps when it can (`publishNow`).
   */
  const publishAll = (s: Session, messages: ReadonlyArray<Outgoing>): Effect.Effect<void, StorageFailed> =>
    messages.length === 0 ? Effect.void : publishMade(s, () => messages)

  /**
   * Publishes the messages `make` returns: made and logged in one synchronous step with taking
   * the publish lock (`publishNow`) when it is free, else made under the lock, so that what they
   * say of the session follows every batch logged before them. `logged` runs once they are.
   */
  const publishMade = (s: Session, make: () => ReadonlyArray<Outgoing>, logged?: () => void): Effect.Effect<void, StorageFailed> => {
    const locked = s.publishLock.withLock(Effect.suspend(() => {
      const append = appendAndDeliver(s, make())
      return logged === undefined ? append : Effect.tap(append, () => Effect.sync(logged))
    }))
    if (appendNow === undefined) return locked
    return Effect.withFiberRuntime<void, StorageFailed>((fiber) =>
      Effect.async<void, StorageFailed>((resume) => {
        if (s.publishLock.isHeld) return resume(locked)
        const now = publishNow(s, make(), fiber.currentTracer, (error, defect) => {
          if (defect === undefined && error === undefined) logged?.()
          resume(defect !== undefined ? Effect.die(defect) : error === undefined ? Effect.void : Effect.fail(error))
        })
        if (!now) resume(locked)
      })
    )
  }

  /** The messages as the log stores them, stamped `emittedAt`. */
  const loggedEntries = (messages: ReadonlyArray<Outgoing>, emittedAt: number) => {
    const tail = loggedTail(emittedAt)
    return messages.map((m) => loggedWith(m, tail))
  }

  /** What publishAll does under the publish lock. */
  const appendAndDeliver = (s: Session, messages: ReadonlyArray<Outgoing>) =>
    Effect.suspend(() => {
      const emittedAt = Date.now()
      // One write and one fsync for the batch; cursors follow the array order.
      return Effect.mapBoth(log.appendAll(s.meta.activeSessionId, loggedEntries(messages, emittedAt)), {
        onFailure: storageFailed,
        onSuccess: (cursors) => deliver(s, messages, emittedAt, cursors)
      })
    })

  /** Hands a logged batch (its cursors) to the live attachments and counts it. */
  const deliver = (s: Session, messages: ReadonlyArray<Outgoing>, emittedAt: number, cursors: ReadonlyArray<Cursor.Cursor>): void => {
    const sessionJson = JSON.stringify(s.meta.activeSessionId)
    // Encoded once for the whole batch, shared by every attached client; piece by piece (a
    // joined string would be a rope of thousands of pieces to flatten first: see utf8Batch).
    const putTail = liveTailWriter(sessionJson, emittedAt)
    Utf8Batch.begin()
    for (let i = 0; i < messages.length; i++) {
      const m = messages[i]!
      Utf8Batch.put(m.head)
      Utf8Batch.putPart(m.body)
      putTail(cursors[i]!)
      // Counted once logged, so the count never runs ahead of what get_messages can read.
      if (m.eventType === "message_end") s.messageCount++
    }
    const lines = Utf8Batch.take()
    const last = cursors[cursors.length - 1]!
    s.lastCursor = last
    s.generationEvents += messages.length
    s.generationBytes += lines.byteLength
    for (const a of s.attachments) a.onLive(last, lines)
  }

  const publish = (s: Session, body: LoggedBody) => publishAll(s, [bodyMessage(body)])

  /**
   * Publishes the session's status, saying `view` (by default what its state says); once logged,
   * the summary shows it (see Session.shown). A status that cannot be logged did not happen.
   */
  const publishStatus = (s: Session, view?: { readonly busy: boolean; readonly worker: WorkerState }, promptId?: string) =>
    // Outside any fiber's steps when it can, as events are: a turn publishes two statuses.
    Effect.suspend(() => {
      // What this run's status said (each run of the effect makes its own).
      let shown: { readonly busy: boolean; readonly worker: WorkerState } | undefined
      return publishMade(s, () => {
        shown = view ?? { busy: busyOf(s.state), worker: workerStateOf(s.state) }
        const state = { ...summary(s), busy: shown.busy, worker: shown.worker }
        return [bodyMessage(promptId === undefined ? { type: "session_status", state } : { type: "session_status", state, promptId })]
      }, () => (s.shown = shown!))
    })

  /** The session's summary and last cursor at one moment, consistent with what is logged. */
  const publishedState = (s: Session) =>
    s.publishLock.withLock(Effect.sync(() => ({ state: summary(s), lastCursor: s.lastCursor })))

  const record = (s: Session, busy: boolean, operation: string) =>
    journal.record({
      activeSessionId: s.meta.activeSessionId,
      sessionId: s.meta.sessionId,
      busy,
      operation,
      ...(s.sessionFile === undefined ? {} : { sessionFile: s.sessionFile })
    }).pipe(
      Effect.tap(() => Effect.sync(() => Object.assign(storage, { ok: true, error: undefined }))),
      Effect.mapError((e) => new StorageFailed({ what: "recovery journal", message: e.message })),
      Effect.tapError((e) =>
        Effect.zipRight(Effect.sync(() => Object.assign(storage, { ok: false, error: e.message })), Effect.logError(`journal: ${e.message}`))
      )
    )

  /**
   * A journal record that nothing waits on (the turn's tool steps, an idle record whose failure
   * only leaves the journal saying busy: a restart then finds the turn's end in the log): logged
   * and shown in `status`, not a failure of the step that writes it.
   */
  const recordBestEffort = (s: Session, busy: boolean, operation: string) => Effect.ignore(record(s, busy, operation))

  const workerEnv = (s: Session): Record<string, string> | undefined =>
    s.launchEnv === undefined && s.clientEnv === undefined ? undefined : { ...s.clientEnv, ...s.launchEnv }

  /** Posts an input that needs no answer (from the session's own fibers). */
  const post = (s: Session, input: Input) =>
    Effect.sync(() => {
      if (!isClosed(s)) s.mailbox.unsafeOffer(input)
    })

  /**
   * Only the variables of a client's `env` that the configuration lets through; undefined when
   * none does (a worker host can run the session: a process has one environment).
   */
  const filterEnv = (env: Record<string, string> | undefined) => {
    if (env === undefined) return undefined
    const out: Record<string, string> = {}
    for (const key of config.clientEnvKeys) if (Object.hasOwn(env, key)) out[key] = env[key]!
    return Object.keys(out).length > 0 ? out : undefined
  }

  return {
    ...deps,
    storage,
    fork,
    forkIn,
    summary,
    publishedState,
    get,
    publishAll,
    publishNow,
    publish,
    publishStatus,
    record,
    recordBestEffort,
    workerEnv,
    post,
    filterEnv
  }
}
