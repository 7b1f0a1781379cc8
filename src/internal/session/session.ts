/**
 * A session's state in the supervisor, the errors commands fail with, and the helpers every part
 * of the core shares (lookup, publishing to the log and to attached clients, the journal).
 * The lifecycle itself is in entity.ts; see SessionManager.ts for the whole picture.
 */
import type * as Context from "effect/Context"
import * as Data from "effect/Data"
import * as Deferred from "effect/Deferred"
import * as Effect from "effect/Effect"
import * as FiberSet from "effect/FiberSet"
import * as Queue from "effect/Queue"
import type * as Scope from "effect/Scope"
import type * as Schedule from "effect/Schedule"
import type * as Cursor from "../../Cursor.js"
import type { DaemonConfigShape } from "../../DaemonConfig.js"
import type { EventLogService } from "../../EventLog.js"
import type * as Protocol from "../../Protocol.js"
import type { SessionSummary } from "../../Protocol.js"
import type { RecoveryJournalService } from "../../RecoveryJournal.js"
import type { SupervisorInfo } from "../../SessionManager.js"
import type { SessionMeta, SessionStoreService } from "../../SessionStore.js"
import type { SnapshotCacheService } from "../../SnapshotCache.js"
import type { RestartPolicy, WorkerPool } from "../../WorkerPool.js"
import type { Attachment } from "../delivery/attachment.js"
import { bodyMessage, logged, type LoggedBody, type Outgoing, wireLine } from "../delivery/wireLines.js"
import type { CheckpointReply, Input, PendingPrompt, Phase } from "./phase.js"
import { workerOf, workerStateOf } from "./phase.js"
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

export { CommandError, failed, internal, notFound } from "./errors.js"

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

/**
 * Where a cut turn's end stands: its `turn_interrupted` is owed (`InterruptOwed`: the supervisor,
 * or the restored worker, says it), or it is out and the `busy: false` status that must come
 * next is owed (`StatusOwed`: a restored worker reported the cut turn and is not ready yet).
 */
export type CutTurn =
  | { readonly _tag: "InterruptOwed"; readonly reason: Protocol.InterruptReason }
  | { readonly _tag: "StatusOwed" }

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
  publishLock: Effect.Semaphore
  /** Readers of the current generation take one permit; a checkpoint's completion takes them all. */
  readGate: Effect.Semaphore
  lastUsed: number
  launchEnv: Record<string, string> | undefined
  clientEnv: Record<string, string> | undefined
  /** The latest generation whose snapshot rewrote history (PROTOCOL: replay never crosses it). */
  rewriteGeneration: number | undefined
  /** A history rewrite the worker is streaming (during a turn). */
  rewrite: { readonly workerSnapshotId: string; readonly snapshotId: string; readonly generation: number } | undefined
  closed: boolean
  /**
   * The session's own scope: its fibers (the worker's frame pump, a restart waiting for its
   * backoff, a worker being acquired) end with it. `kill` closes it; passivation closes it and
   * the session gets a new one.
   */
  scope: Scope.CloseableScope
  fibers: FiberSet.FiberSet
  // The lifecycle: read by anyone, changed only by the session's entity.
  phase: Phase
  /** Bumped at every worker start and stop: inputs of an older attempt are ignored. */
  epoch: number
  mailbox: Queue.Queue<Input>
  pendingPrompt: PendingPrompt | undefined
  /** The latest checkpoint's snapshot file: every journal record names it (once there is one). */
  sessionFile: string | undefined
  /**
   * A turn cut by a crash (of the worker or the daemon), until the status that ends it is out:
   * the session is busy till then, and a prompt waits (`promptAfterCut`).
   */
  cutTurn: CutTurn | undefined
  /**
   * A prompt that came while a cut turn waited for its end (the worker recovering): it becomes
   * the reserved prompt right after that turn's `turn_interrupted` and idle status.
   */
  promptAfterCut: PendingPrompt | undefined
  /** Checkpoints asked for, run when the session is next idle (during a turn: at its end). */
  checkpointWaiters: Array<CheckpointReply>
  /** An automatic checkpoint is due (one mark, however many turns asked). */
  checkpointDue: boolean
  passivationWanted: boolean
  retryWaiters: Array<Deferred.Deferred<SessionSummary, CoreError>>
  restarts: number
  /** The state of the restart schedule (the crashes in its window). */
  restartState: unknown
  /** Whether the last `session_status` logged said busy. */
  publishedBusy: boolean
  /**
   * A turn cut because storage failed, whose end could not be logged yet: the summary the stream
   * last showed (busy), which `get_state` shows until that end is out; the entity retries it.
   */
  stalled: SessionSummary | undefined
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
  readonly restarts: Schedule.Schedule<number, unknown>
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
  readonly publish: (s: Session, body: LoggedBody) => Effect.Effect<void, StorageFailed>
  /**
   * Publishes the session's status; `change` (a change of phase) is made under the publish lock
   * first, and undone should the status not be logged.
   */
  readonly publishStatus: (s: Session, change?: () => void) => Effect.Effect<void, StorageFailed>
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
    // Nothing is logged while an owed end waits: the stream still shows the cut turn running.
    if (s.stalled !== undefined && !s.closed) return s.stalled
    const out: {
      -readonly [K in keyof SessionSummary]: SessionSummary[K]
    } = {
      activeSessionId: s.meta.activeSessionId,
      engine: s.meta.engine,
      createdAt: s.meta.createdAt,
      messageCount: s.messageCount,
      busy: s.phase._tag === "Running" || s.pendingPrompt !== undefined || s.cutTurn !== undefined,
      worker: workerStateOf(s.phase),
      restarts: s.restarts,
      telemetry: s.meta.telemetry
    }
    if (s.meta.name !== undefined) out.name = s.meta.name
    const worker = workerOf(s.phase)
    if (worker !== undefined) out.workerPid = worker.pid
    if (s.lastCursor !== undefined) out.lastEventCursor = s.lastCursor
    return out
  }

  const get = (id: string) =>
    Effect.suspend(() => {
      const s = sessions.get(id)
      return s === undefined || s.closed ? Effect.fail(notFound(id)) : Effect.succeed(s)
    })

  /** Appends messages to the log (one group commit) and hands them to live attachments. */
  const publishAll = (s: Session, messages: ReadonlyArray<Outgoing>) =>
    s.publishLock.withPermits(1)(appendAndDeliver(s, messages))

  /** What publishAll does under the publish lock. */
  const appendAndDeliver = (s: Session, messages: ReadonlyArray<Outgoing>) =>
    Effect.gen(function*() {
      if (messages.length === 0) return
      const emittedAt = Date.now()
      // One write and one fsync for the batch; cursors follow the array order.
      const cursors = yield* log.appendAll(s.meta.activeSessionId, messages.map((m) => logged(m, emittedAt))).pipe(
        Effect.mapError((e) => new StorageFailed({ what: "event log", message: e.message }))
      )
      const sessionJson = JSON.stringify(s.meta.activeSessionId)
      let text = ""
      for (let i = 0; i < messages.length; i++) {
        const m = messages[i]!
        text += wireLine(sessionJson, m.open, cursors[i]!, emittedAt, false)
        // Counted once logged, so the count never runs ahead of what get_messages can read.
        if (m.eventType === "message_end") s.messageCount++
      }
      // Encoded once for the whole batch, shared by every attached client.
      const lines = Buffer.from(text, "utf8")
      const last = cursors[cursors.length - 1]!
      s.lastCursor = last
      s.generationEvents += messages.length
      s.generationBytes += lines.byteLength
      for (const a of s.attachments) a.onLive(last, lines)
    })

  const publish = (s: Session, body: LoggedBody) => publishAll(s, [bodyMessage(body)])

  /**
   * Publishes the session's status; `change` (a change of phase) is made under the publish lock
   * first, so that whoever reads a summary under that lock (`get_state`, an attach) sees the
   * new phase only together with the status event that says it, never ahead of the log.
   */
  const publishStatus = (s: Session, change?: () => void) =>
    s.publishLock.withPermits(1)(Effect.suspend(() => {
      // A status that cannot be logged did not happen: the change is undone with it.
      const before = { phase: s.phase, cutTurn: s.cutTurn, pendingPrompt: s.pendingPrompt, stalled: s.stalled }
      change?.()
      const state = summary(s)
      return appendAndDeliver(s, [bodyMessage({ type: "session_status", state })]).pipe(
        Effect.tap(() => Effect.sync(() => (s.publishedBusy = state.busy))),
        Effect.tapError(() => Effect.sync(() => Object.assign(s, before)))
      )
    }))

  /** The session's summary and last cursor at one moment, consistent with what is logged. */
  const publishedState = (s: Session) =>
    s.publishLock.withPermits(1)(Effect.sync(() => ({ state: summary(s), lastCursor: s.lastCursor })))

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
      if (!s.closed) s.mailbox.unsafeOffer(input)
    })

  /** Only the variables of a client's `env` that the configuration lets through. */
  const filterEnv = (env: Record<string, string> | undefined) => {
    if (env === undefined) return undefined
    const out: Record<string, string> = {}
    for (const key of config.clientEnvKeys) if (Object.hasOwn(env, key)) out[key] = env[key]!
    return out
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
    publish,
    publishStatus,
    record,
    recordBestEffort,
    workerEnv,
    post,
    filterEnv
  }
}
