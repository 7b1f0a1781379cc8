/**
 * Sessions (docs/protocol.md sections 3-6): the registry, the public service, and start-up.
 *
 * Each session is an entity (internal/session/entity.ts): one fiber owns its lifecycle and takes
 * every input from one mailbox. The parts of the core, each a factory over the shared `Core`
 * (internal/session/session.ts: dependencies, registry, publishing):
 *
 * ```
 * internal/session/transition.ts  the lifecycle as one value and a pure step (docs/session-core.md)
 * internal/session/entity.ts      the interpreter of step: one input at a time, its actions in order
 * internal/session/mailbox.ts     the mailbox's inputs (commands, worker frames and exit, timers)
 * internal/session/errors.ts      the core's typed errors and their one mapping to wire codes
 * internal/session/supervisor.ts  a worker's acquisition (slot, spawn, load, restore) and frame pump
 * internal/session/checkpoint.ts  snapshot intake, transcript write, new generation, prune
 * internal/session/restore.ts     the restore read a new worker is sent
 * internal/session/workerSlots.ts the bound on live workers (maxWorkers)
 * internal/session/names.ts       names unique among live sessions (create, rename)
 * internal/delivery/attach.ts     attach, baseline, catch-up from the log, resync, detach
 * internal/delivery/replay.ts     the replay decision of an attach (pure)
 * internal/delivery/wireLines.ts  the wire lines of logged events
 * ```
 *
 * Every sequenced message of a session goes through `publish`: it is appended to the EventLog
 * (which assigns the cursor and makes it durable), then handed to every attachment that is
 * live. Event history is never held in memory per client. The core talks to connections only
 * through {@link ConnectionPort}, so it runs in-process in tests (WorkerPool.layerInProcess).
 *
 * Owns: the registry of sessions (live and damaged), each session's entity fiber, the start-up
 * load, and the one place where the core's errors become the wire's (`route`). Each file of the
 * core says in its header what it owns; a session's fields are written by its entity or by the
 * owner session.ts names, never here once the session exists.
 */
import * as Chunk from "effect/Chunk"
import * as Context from "effect/Context"
import * as Deferred from "effect/Deferred"
import * as Effect from "effect/Effect"
import * as ExecutionStrategy from "effect/ExecutionStrategy"
import * as Either from "effect/Either"
import * as Exit from "effect/Exit"
import * as Fiber from "effect/Fiber"
import * as FiberMap from "effect/FiberMap"
import * as FiberRef from "effect/FiberRef"
import * as FiberSet from "effect/FiberSet"
import * as Layer from "effect/Layer"
import * as Option from "effect/Option"
import * as Scope from "effect/Scope"
import * as Stream from "effect/Stream"
import { randomUUID } from "node:crypto"
import * as Cursor from "./Cursor.js"
import { DaemonConfig } from "./DaemonConfig.js"
import { Engine } from "./Engine.js"
import { EventLog } from "./EventLog.js"
import { makeDelivery } from "./internal/delivery/attach.js"
import { bodyMessage, type LoggedBody, logged } from "./internal/delivery/wireLines.js"
import { Lock } from "./internal/lock.js"
import { makeCheckpoints } from "./internal/session/checkpoint.js"
import { makeEntity } from "./internal/session/entity.js"
import { makeNames } from "./internal/session/names.js"
import { CommandTakesEffect, type Input, InputQueue, progressDone } from "./internal/session/mailbox.js"
import * as Transition from "./internal/session/transition.js"
import { type CoreError, metaWriteFailed, toCommandError } from "./internal/session/errors.js"
import { CommandError, internal, isClosed, makeCore, newHandles, notFound, READ_GATE_PERMITS, rememberPrompt, type Session } from "./internal/session/session.js"
import * as WorkerSlots from "./internal/session/workerSlots.js"
import { makeSupervisor } from "./internal/session/supervisor.js"
import type * as Protocol from "./Protocol.js"
import type { AgentMessage, CommandOf, SessionSummary } from "./Protocol.js"
import { RecoveryJournal } from "./RecoveryJournal.js"
import { type SessionMeta, SessionStore } from "./SessionStore.js"
import { SnapshotCache } from "./SnapshotCache.js"
import * as StateLayout from "./StateLayout.js"
import { defaultRestartPolicy, WorkerPool } from "./WorkerPool.js"

export { CommandError, internalOfCause } from "./internal/session/session.js"
export { type CommandProgress, CommandTakesEffect, progressDone } from "./internal/session/mailbox.js"

/**
 * What the core needs of a client's connection: a queue of outgoing bytes it can fill without
 * waiting, and the means to wait for it to drain (the backpressure rules of docs/protocol.md
 * section 5). The socket server's outbox is one; tests use an in-memory one.
 */
export interface ConnectionPort {
  /**
   * Queues a line (or pre-encoded lines); never waits. Dropped once the connection is gone.
   * `done`, if given, is called once the port no longer holds `data` (written out, or dropped):
   * a snapshot chunk's buffer is then reused. A port that cannot tell never calls it.
   */
  offer(data: string | Uint8Array, done?: () => void): void
  /** Bytes queued and not yet written out. */
  readonly queuedBytes: number
  readonly isClosed: boolean
  /** Waits until fewer than `bytes` are queued (or the connection is gone). */
  awaitBelow(bytes: number): Effect.Effect<void>
}

/** Where the daemon's files live and what generation of supervisor this is. */
export class SupervisorInfo extends Context.Tag("agentd/SupervisorInfo")<SupervisorInfo, {
  readonly generation: number
  readonly startedAt: number
  readonly journalPath: string
  readonly storeRoot: string
  readonly eventLogRoot: string
}>() {}

/** Where an ended attachment stood, for another delivery to continue it (see `evict`). */
export interface HandedOver {
  readonly connectionId: string
  readonly outbox: ConnectionPort
  /** The last cursor sent to the client. */
  readonly delivered: Cursor.Cursor | undefined
  /** Events up to this cursor are flagged replayed. */
  readonly attachCursor: Cursor.Cursor | undefined
  /** The latest history rewrite the client's state includes. */
  readonly knownRewrite: number | undefined
  /** Re-sent events are flagged replayed. */
  readonly resumed: boolean
}

export interface AttachOutcome {
  readonly data: Protocol.DaemonAttachResult
  /** Sends the snapshot frames, `session_attached` and the events; run after the response. */
  readonly deliver: Effect.Effect<void>
}

/** What a session starts with, found by its create or its load (the rest starts empty). */
type SessionStart = Pick<
  Session,
  | "generation"
  | "sessionFile"
  | "lastCursor"
  | "generationEvents"
  | "generationBytes"
  | "messageCount"
  | "baseMessageCount"
  | "snapshotCursor"
  | "rewriteGeneration"
  | "launchEnv"
  | "clientEnv"
  | "startedPrompts"
>

/** The sessions of this daemon. */
export class SessionManager extends Context.Tag("agentd/SessionManager")<SessionManager, {
  /** `activeSessionId`: the id the new session takes (a cluster runner chooses it before routing the create to its owner). */
  readonly create: (cmd: CommandOf<"create">, activeSessionId?: string) => Effect.Effect<{ activeSessionId: string; state: SessionSummary }, CommandError>
  readonly list: Effect.Effect<{ sessions: Array<SessionSummary> }>
  /**
   * The sessions this daemon runs: all of them on a single daemon; on a cluster runner, those of
   * its shards only (`list` covers the cluster, asking each owner). What its `/metrics` counts.
   */
  readonly listHere: Effect.Effect<{ sessions: Array<SessionSummary> }>
  readonly status: Effect.Effect<unknown>
  readonly attach: (connectionId: string, outbox: ConnectionPort, cmd: CommandOf<"attach">) => Effect.Effect<AttachOutcome, CommandError>
  readonly detach: (connectionId: string, activeSessionId: string) => Effect.Effect<void, CommandError>
  readonly detachAll: (connectionId: string) => Effect.Effect<void>
  /** How many sessions a connection is attached to. */
  readonly attachedCount: (connectionId: string) => number
  /**
   * `promptId` (default: the command's own): the client's id for the prompt, or a cluster
   * runner's for one it forwarded and may send again (docs/cluster.md section 3). The status that
   * starts its turn carries it; once a turn of it started, here or on the session's previous
   * owner (that status, logged, carries the id), it is answered `accepted` again and starts no
   * other turn.
   */
  readonly prompt: (cmd: CommandOf<"prompt">, promptId?: string) => Effect.Effect<{ accepted: true }, CommandError>
  readonly abort: (cmd: CommandOf<"abort">) => Effect.Effect<{ aborted: boolean }, CommandError>
  readonly getState: (activeSessionId: string) => Effect.Effect<SessionSummary, CommandError>
  readonly getMessages: (cmd: CommandOf<"get_messages">) => Effect.Effect<{ messages: ReadonlyArray<AgentMessage>; total: number }, CommandError>
  readonly checkpoint: (activeSessionId: string) => Effect.Effect<{ generation: number; snapshotId: string }, CommandError>
  readonly retryWorker: (activeSessionId: string) => Effect.Effect<SessionSummary, CommandError>
  readonly kill: (activeSessionId: string) => Effect.Effect<{}, CommandError>
  /** Gives a session a new name (`name_taken` when another live session has it). */
  readonly rename: (cmd: CommandOf<"rename">) => Effect.Effect<SessionSummary, CommandError>
  /**
   * The daemon stops: later commands are refused with `shutting_down`, and those waiting in a
   * session (for a turn's end, for a worker) are answered the same way, so that each gets its
   * one response before the connections close.
   */
  readonly settleForShutdown: Effect.Effect<void>
  /**
   * Loads a session of the store that this manager does not hold yet, as a daemon start does
   * (restored at once when it was busy): a cluster runner that gained the session's shard. A
   * session the store does not have is left alone; one already held is untouched.
   */
  readonly adopt: (activeSessionId: string) => Effect.Effect<void>
  /**
   * Drops a session from this manager without writing anything for it: its worker is killed
   * (waited for), its entity stopped, its attachments ended, the commands waiting in it answered
   * `internal`. What a cluster runner does with the sessions of a shard it lost (another runner
   * may be writing them already); the store keeps the session whole, as after a crash. Its
   * attachments that were streaming are given to `handOver` once ended (a runner's log tail
   * continues them from where they stood).
   */
  readonly evict: (activeSessionId: string, handOver?: (attachments: ReadonlyArray<HandedOver>) => Effect.Effect<void>) => Effect.Effect<void>
  /** Whether this manager holds the session (live or damaged). */
  readonly holds: (activeSessionId: string) => boolean
  /**
   * An attach's `launchEnv` and `env` for the session's next worker, without the attach: what a
   * cluster runner sends the owner for an attach it serves from its log tail.
   */
  readonly setEnv: (cmd: Pick<CommandOf<"attach">, "activeSessionId" | "launchEnv" | "env">) => Effect.Effect<void, CommandError>
}>() {}

/**
 * Whether the manager loads every session of its store when it starts (the default). A cluster
 * runner loads none then: it adopts the sessions of the shards it acquires, as it acquires them.
 */
export class LoadAtStart extends Context.Reference<LoadAtStart>()("agentd/SessionManager/LoadAtStart", {
  defaultValue: () => true
}) {}

export const make = Effect.gen(function*() {
  const config = yield* DaemonConfig
  const engines = yield* Engine
  const info = yield* SupervisorInfo
  const log = yield* EventLog
  const store = yield* SessionStore
  const journal = yield* RecoveryJournal
  const cache = yield* SnapshotCache
  const pool = yield* WorkerPool
  const managerScope = yield* Effect.scope
  const sessionScope = Effect.gen(function*() {
    const scope = yield* Scope.fork(managerScope, ExecutionStrategy.sequential)
    return { scope, fibers: yield* Scope.extend(FiberSet.make(), scope) }
  })
  /** Each session's entity fiber, by activeSessionId. */
  const entities = yield* FiberMap.make<string>()
  const restartPolicy = {
    ...defaultRestartPolicy,
    maxRestarts: config.maxRestarts,
    restartWindowMs: config.restartWindowMs
  }
  const fibers = yield* FiberSet.make()
  const core = makeCore({
    config,
    info,
    log,
    store,
    journal,
    cache,
    pool,
    fibers,
    slots: yield* WorkerSlots.make(config.maxWorkers, (effect) => Effect.asVoid(FiberSet.run(fibers, effect))),
    sessions: new Map(),
    connections: new Map(),
    restartPolicy,
    sessionScope
  })
  const { connections, sessions, filterEnv, get, post, publishStatus, publishedState, recordBestEffort, summary } = core
  const checkpoints = makeCheckpoints(core)
  const delivery = makeDelivery(core, checkpoints)
  const supervisor = makeSupervisor(core)
  const names = makeNames({
    live: function*() {
      for (const s of sessions.values()) if (!isClosed(s)) yield s.meta
    },
    damaged: () => Array.from(damaged.values(), (d) => ({ activeSessionId: d.activeSessionId, name: d.meta?.name }))
  })
  const { runEntity, send, settleForShutdown, startFirstWorker } = makeEntity(core, checkpoints, supervisor, delivery, names)
  const { attach, detachAttachment } = delivery
  const { transcript } = checkpoints

  /**
   * A session as it starts: `from` is what a create or a load found (its generation, its
   * environment). Built whole here, so that once it exists only its owners write it (its entity,
   * and the parts that act for it: see internal/session/session.ts).
   */
  const newSession = (meta: SessionMeta, state: Transition.State, from: Partial<SessionStart> = {}): Effect.Effect<Session> =>
    Effect.gen(function*() {
      return {
        ...yield* sessionScope,
        meta,
        messageCount: 0,
        baseMessageCount: 0,
        generation: 1,
        snapshotCursor: undefined,
        generationEvents: 0,
        generationBytes: 0,
        lastCursor: undefined,
        launchEnv: undefined,
        clientEnv: undefined,
        sessionFile: undefined,
        rewriteGeneration: undefined,
        startedPrompts: [],
        ...from,
        attachments: new Set(),
        waitingPrompts: new Map(),
        publishLock: new Lock(),
        readGate: yield* Effect.makeSemaphore(READ_GATE_PERMITS),
        lastUsed: Date.now(),
        state,
        handles: newHandles(),
        mailbox: new InputQueue<Input>(),
        shown: { busy: Transition.busyOf(state), worker: Transition.workerStateOf(state) }
      }
    })

  /** Registers a session and starts its entity. */
  const register = (s: Session) =>
    Effect.gen(function*() {
      sessions.set(s.meta.activeSessionId, s)
      yield* FiberMap.run(entities, s.meta.activeSessionId, runEntity(s))
    })

  const create = (cmd: CommandOf<"create">, givenId?: string) => {
    const name = cmd.name
    if (name === undefined) return createSession(cmd, givenId)
    return Effect.acquireUseRelease(
      // Claimed until the session is registered (or the create failed): then its name is in `sessions`.
      Effect.suspend(() => {
        const invalid = names.invalid("create", name)
        if (invalid !== undefined) return Effect.fail(invalid)
        const claimed = names.claim(name, undefined, "a session being created")
        return typeof claimed === "function" ? Effect.succeed(claimed) : Effect.fail(toCommandError(claimed))
      }),
      () => createSession(cmd, givenId),
      (release) => Effect.sync(release)
    )
  }

  /** `rename`: the session's entity claims the name and saves it (see names.ts). */
  const rename = (cmd: CommandOf<"rename">) =>
    route(cmd.activeSessionId, (s) => {
      const invalid = names.invalid("rename", cmd.name)
      return invalid !== undefined ? Effect.fail(invalid) : send<SessionSummary>(s, (c) => ({ _tag: "Rename", name: cmd.name, ...c }))
    })

  const createSession = (cmd: CommandOf<"create">, givenId?: string) =>
    Effect.gen(function*() {
      const engine = cmd.engine ?? config.engine
      yield* engines.validate(engine, cmd.config ?? {}).pipe(
        Effect.mapError((e) =>
          new CommandError({
            code: "invalid_command",
            message: `Invalid \`create\` command: \`${e.reason === "unknown_engine" ? "engine" : "config"}\`: ${e.message}`
          })
        )
      )
      const activeSessionId = givenId ?? `s-${randomUUID()}`
      // A given id names a new session only (a create routed twice must not reopen one).
      if (givenId !== undefined && (sessions.has(givenId) || damaged.has(givenId))) {
        return yield* new CommandError({ code: "internal", message: `Session \`${givenId}\` exists already.` })
      }
      const meta: SessionMeta = {
        activeSessionId,
        sessionId: activeSessionId,
        engine,
        telemetry: cmd.telemetry ?? false,
        createdAt: new Date().toISOString(),
        ...(cmd.name === undefined ? {} : { name: cmd.name }),
        ...(cmd.config === undefined ? {} : { config: cmd.config as Record<string, unknown> })
      }
      // A config nested too deeply for JSON.stringify would fail only once the session's
      // directory exists: refuse it before anything is written.
      yield* Effect.try({
        try: () => JSON.stringify(meta),
        catch: () =>
          new CommandError({ code: "invalid_command", message: "Invalid `create` command: `config` is nested too deeply to be stored." })
      })
      yield* store.create(meta).pipe(Effect.mapError(metaWriteFailed))
      const s = yield* newSession(meta, Transition.initial, {
        launchEnv: cmd.launchEnv === undefined ? undefined : { ...cmd.launchEnv },
        clientEnv: filterEnv(cmd.env)
      })
      // An idle record: a session the journal does not name is idle all the same.
      yield* recordBestEffort(s, false, "created")
      // The first worker starts before the entity takes any input (nothing can race it yet).
      yield* startFirstWorker(s)
      yield* register(s)
      return { activeSessionId, state: summary(s) }
    }).pipe(Effect.mapError(toCommandError))

  // ------------------------------------------------------------------------------------------
  // Start-up: load every session; restore those that were busy when the last daemon died.
  // ------------------------------------------------------------------------------------------

  const loadSession = (meta: SessionMeta) =>
    Effect.gen(function*() {
      const { from, lastStatusBusy, endsWithTurnEnd } = yield* load(meta.activeSessionId)
      return { session: yield* newSession(meta, Transition.loaded, from), lastStatusBusy, endsWithTurnEnd }
    })

  /** What a session's files say: where its generation stands, and how its last turn ended. */
  const load = (id: string) =>
    Effect.gen(function*() {
      let status = yield* log.status(id)
      const snapshot = yield* store.latestSnapshot(id)
      if (Option.isSome(snapshot) && snapshot.value.header.generation > status.generation) {
        // The daemon died between writing a checkpoint's transcript and starting its generation:
        // the transcript is complete and durable, so finish that checkpoint.
        // (The loop once tested a status read before it, so it never ended: the daemon never
        // listened, and started generations by the thousand.)
        let generation = status.generation
        while (generation < snapshot.value.header.generation) generation = yield* log.startGeneration(id)
        status = yield* log.status(id)
      }
      const from: SessionStart = {
        generation: status.generation,
        sessionFile: Option.getOrUndefined(Option.map(snapshot, (found) => found.path)),
        lastCursor: Option.getOrUndefined(status.lastCursor),
        generationEvents: status.generationEvents,
        generationBytes: status.generationBytes,
        messageCount: 0,
        baseMessageCount: 0,
        snapshotCursor: undefined,
        rewriteGeneration: undefined,
        launchEnv: undefined,
        clientEnv: undefined,
        startedPrompts: []
      }
      let after: Cursor.Cursor | undefined
      if (Option.isSome(snapshot)) {
        from.messageCount = snapshot.value.header.messageCount
        from.rewriteGeneration = snapshot.value.header.rewrittenAt
        after = snapshot.value.header.cursor
      }
      const isCurrent = Option.isSome(snapshot) && snapshot.value.header.generation === status.generation
      let lastStatusBusy = false
      let endsWithTurnEnd = false
      from.snapshotCursor = isCurrent ? after : undefined
      from.baseMessageCount = from.messageCount
      if (Option.isSome(snapshot)) yield* store.checkTranscript(id, snapshot.value.header.generation)
      // Every retained event is read, not only those after the snapshot: damage anywhere in the
      // log is found now (and repaired, see `admit`), not by a client's replay later.
      yield* Stream.flatMap(Stream.fromIterable(status.generations), (g) => log.readGeneration(id, g)).pipe(
        Stream.runForEach((r) =>
          Effect.sync(() => {
            if (after !== undefined && Cursor.compare(r.cursor, after) <= 0) return
            const body = r.event as unknown as LoggedBody
            if (body.type === "session_event" && body.event.type === "message_end") from.messageCount++
            if (body.type === "session_status") {
              lastStatusBusy = body.state.busy
              // A tagged prompt's turn started here (in cluster mode perhaps on another runner).
              if (body.promptId !== undefined) rememberPrompt(from.startedPrompts, body.promptId)
            }
            endsWithTurnEnd = body.type === "session_event" && (body.event.type === "agent_end" || body.event.type === "turn_interrupted")
            // Without a transcript of the current generation, its snapshot is what was folded
            // before its first event.
            if (!isCurrent && r.cursor.generation < status.generation) {
              from.snapshotCursor = r.cursor
              from.baseMessageCount = from.messageCount
            }
          })
        )
      )
      return { from, lastStatusBusy, endsWithTurnEnd }
    })

  // ------------------------------------------------------------------------------------------
  // Damaged sessions: their files did not load. Kept, listed and readable; never dropped.
  // ------------------------------------------------------------------------------------------

  /** A session whose files did not load (`meta` when its metadata could be read). */
  interface Damaged {
    readonly activeSessionId: string
    readonly meta: SessionMeta | undefined
    readonly reason: string
    readonly messageCount: number
    readonly lastCursor: Cursor.Cursor | undefined
  }
  const damaged = new Map<string, Damaged>()
  /** Retry and kill of damaged sessions, one at a time (each moves a session in or out of the maps). */
  const damagedLock = yield* Effect.makeSemaphore(1)

  const damagedSummary = (d: Damaged): SessionSummary => ({
    activeSessionId: d.activeSessionId,
    ...(d.meta?.name === undefined ? {} : { name: d.meta.name }),
    engine: d.meta?.engine ?? "unknown",
    createdAt: d.meta?.createdAt ?? "",
    messageCount: d.messageCount,
    busy: false,
    worker: "damaged",
    restarts: 0,
    telemetry: d.meta?.telemetry ?? false,
    ...(d.lastCursor === undefined ? {} : { lastEventCursor: d.lastCursor }),
    damage: { reason: d.reason }
  })

  const damagedError = (d: Damaged) =>
    new CommandError({
      code: "session_damaged",
      message: `Session \`${d.activeSessionId}\` is damaged (${d.reason}). What can be read stays readable (get_messages); ` +
        "retry_worker loads it again, kill archives it."
    })

  /**
   * What can be read of a damaged session: its latest transcript up to the first line that does
   * not load, then, if that was whole, the messages of the events after it up to the first bad one.
   */
  const readableMessages = (id: string): Stream.Stream<AgentMessage> =>
    Stream.unwrap(Effect.gen(function*() {
      const latest = yield* Effect.either(store.latestSnapshot(id))
      const snapshot = Either.isRight(latest) ? Option.getOrUndefined(latest.right) : undefined
      let whole = Either.isRight(latest)
      const base: Stream.Stream<AgentMessage> = snapshot === undefined
        ? Stream.empty
        : store.readSnapshot(id, snapshot.header.generation).pipe(
          Stream.map((m) => m as AgentMessage),
          Stream.catchAll(() => Stream.suspend(() => (whole = false, Stream.empty)))
        )
      const after = snapshot?.header.cursor
      const events = log.read(id, after).pipe(
        Stream.catchAll(() => Stream.empty),
        Stream.filterMap((r) => {
          const body = r.event as unknown as LoggedBody
          return body.type === "session_event" && body.event.type === "message_end"
            ? Option.some((body.event as unknown as { readonly message: AgentMessage }).message)
            : Option.none()
        })
      )
      return Stream.concat(base, Stream.suspend(() => (whole ? events : Stream.empty)))
    }))

  /** Registers a damaged session: logged, listed, and (when its log was repaired) said in its history. */
  const markDamaged = (id: string, meta: SessionMeta | undefined, reason: string, repaired: boolean) =>
    Effect.gen(function*() {
      const messageCount = yield* Stream.runCount(readableMessages(id))
      const lastCursor = Option.getOrUndefined(yield* Effect.orElseSucceed(log.lastCursor(id), () => Option.none()))
      const d: Damaged = { activeSessionId: id, meta, reason, messageCount, lastCursor }
      yield* Effect.logError(`session ${id} is damaged: ${reason}`)
      if (repaired && meta !== undefined) {
        // The repaired log takes appends again: the notice is part of the session's history.
        const notice = { type: "session_status", state: damagedSummary(d) }
        const cursor = yield* Effect.either(log.append(id, logged(bodyMessage(notice as LoggedBody), Date.now())))
        if (Either.isRight(cursor)) {
          damaged.set(id, { ...d, lastCursor: cursor.right })
          return
        }
      }
      damaged.set(id, d)
    })

  /**
   * Loads a session from its files and starts its entity; a session that does not load is kept
   * as damaged, after its event log's damage (if that is what failed) was moved aside.
   */
  const admit = (meta: SessionMeta, journalSays: boolean | "ask the log") =>
    Effect.gen(function*() {
      const loaded = yield* Effect.either(loadSession(meta))
      if (Either.isLeft(loaded)) {
        const error = loaded.left
        let reason = error.message
        let repaired = false
        if (error._tag === "EventLogError" && error.reason === "Corrupt") {
          const repair = yield* Effect.either(log.repair(meta.activeSessionId))
          if (Either.isRight(repair) && Option.isSome(repair.right)) {
            reason = repair.right.value.message
            repaired = true
          } else if (Either.isLeft(repair)) {
            reason = `${reason} (repair failed: ${repair.left.message})`
          }
        }
        yield* markDamaged(meta.activeSessionId, meta, reason, repaired)
        return Option.none<Session>()
      }
      const { session: s, lastStatusBusy, endsWithTurnEnd } = loaded.right
      // A session adopted from another runner: this manager's journal was read at its start, so
      // whether a turn was running is what the shared log's last status says.
      const journalBusy = journalSays === "ask the log" ? lastStatusBusy : journalSays
      if (journalBusy && !endsWithTurnEnd) {
        // It was running a turn when the daemon died: restored now, and the cut turn reported.
        yield* post(s, { _tag: "Restore" })
      } else if (lastStatusBusy || endsWithTurnEnd) {
        // The daemon died between a turn's end and its idle status: the status is owed (and the
        // journal's idle record, if the end was logged but not journaled: that turn is not cut).
        if (journalBusy) yield* recordBestEffort(s, false, "turn_end")
        yield* Effect.catchAllCause(publishStatus(s), (cause) => Effect.logError(`session ${meta.activeSessionId}: idle status`, cause))
      }
      yield* register(s)
      return Option.some(s)
    })

  /** `retry_worker` of a damaged session: loads it again (its metadata too). */
  const retryDamaged = (d: Damaged) =>
    damagedLock.withPermits(1)(Effect.gen(function*() {
      if (damaged.get(d.activeSessionId) !== d) return yield* get(d.activeSessionId).pipe(Effect.map(summary))
      const meta = yield* Effect.either(store.loadMeta(d.activeSessionId))
      damaged.delete(d.activeSessionId)
      if (Either.isLeft(meta)) {
        yield* markDamaged(d.activeSessionId, undefined, meta.left.message, false)
      } else {
        const journalBusy = (yield* journal.latest()).get(d.activeSessionId)?.busy === true
        const s = yield* admit(meta.right, journalBusy)
        if (Option.isSome(s)) return summary(s.value)
      }
      return yield* Effect.fail(damagedError(damaged.get(d.activeSessionId)!))
    }))

  /** `kill` of a damaged session: its files move to the archive as they are. */
  const killDamaged = (d: Damaged) =>
    damagedLock.withPermits(1)(Effect.gen(function*() {
      if (damaged.get(d.activeSessionId) !== d) return yield* Effect.fail(notFound(d.activeSessionId))
      const id = d.activeSessionId
      yield* Effect.ignoreLogged(journal.forget(id))
      const dir = yield* store.archive(id).pipe(Effect.mapError(internal("session store")))
      yield* log.remove(id, { archiveTo: StateLayout.archivedEventsDir(dir) }).pipe(Effect.mapError(internal("event log")))
      damaged.delete(id)
      return {}
    }))

  /**
   * A command on a session: `live` for a loaded one, `onDamaged` for a damaged one. The core's
   * typed errors become the wire's here, where the core answers its callers.
   */
  const route = <A>(
    id: string,
    live: (s: Session) => Effect.Effect<A, CoreError | CommandError>,
    onDamaged: (d: Damaged) => Effect.Effect<A, CoreError | CommandError> = (d) => Effect.fail(damagedError(d))
  ): Effect.Effect<A, CommandError> =>
    Effect.suspend(() => {
      const d = damaged.get(id)
      return d === undefined ? Effect.flatMap(get(id), live) : onDamaged(d)
    }).pipe(Effect.mapError(toCommandError))

  const listings = (yield* LoadAtStart) ? yield* store.list().pipe(Effect.orDie) : []
  const latest = yield* journal.latest()
  for (const listing of listings) {
    if (listing._tag === "Unreadable") {
      yield* markDamaged(listing.activeSessionId, undefined, listing.reason, false)
      continue
    }
    yield* admit(listing.meta, latest.get(listing.meta.activeSessionId)?.busy === true)
  }

  // ------------------------------------------------------------------------------------------
  // A cluster runner's sessions come and go with its shards (docs/cluster.md).
  // ------------------------------------------------------------------------------------------

  /** `adopt`: one at a time with retry and kill of damaged sessions (each moves a session between the maps). */
  const adopt = (id: string) =>
    damagedLock.withPermits(1)(Effect.gen(function*() {
      if (sessions.has(id) || damaged.has(id)) return
      // Where this runner last saw the log (before the session left it, or a read since) is
      // stale: its owner meanwhile wrote on.
      yield* log.forget(id)
      const meta = yield* Effect.either(store.loadMeta(id))
      if (Either.isLeft(meta)) {
        // Not in the store (a create on its way, or archived): nothing to adopt.
        if (meta.left._tag === "SessionNotFound") return
        return yield* markDamaged(id, undefined, meta.left.message, false)
      }
      yield* admit(meta.right, "ask the log")
    })).pipe(Effect.catchAllCause((cause) => Effect.logError(`session ${id}: could not be adopted`, cause)))

  /** `evict`: the worker is killed, not stopped: another runner may be restoring the session already. */
  const evict = (id: string, handOver?: (attachments: ReadonlyArray<HandedOver>) => Effect.Effect<void>) =>
    Effect.gen(function*() {
      // The workers die first, before anything that can wait: the lock below (evictions of a
      // lost shard run one by one), or the end of the entity fiber, which waits for a log
      // flush under way, itself waiting on a database that may be unreachable (seen under
      // chaos: a runner cut off killed a session's worker 12 s after losing its shard, 6 s
      // after another runner had started one). The entity fiber is told to stop just before
      // (without waiting), so that it does not take the worker's death for a crash to handle.
      const s = sessions.get(id)
      if (s === undefined) return yield* evictLocked(id, handOver)
      const entity = yield* Effect.option(FiberMap.get(entities, id))
      if (Option.isSome(entity)) yield* Fiber.interruptFork(entity.value)
      for (const worker of s.handles.workers.values()) worker.kill()
      yield* evictLocked(id, handOver)
    })
  const evictLocked = (id: string, handOver: ((attachments: ReadonlyArray<HandedOver>) => Effect.Effect<void>) | undefined) =>
    damagedLock.withPermits(1)(Effect.gen(function*() {
      if (damaged.delete(id)) return
      const s = sessions.get(id)
      if (s === undefined) return
      sessions.delete(id)
      yield* FiberMap.remove(entities, id)
      // Again: any worker the session started meanwhile.
      const workers = [...s.handles.workers.values()]
      for (const worker of workers) worker.kill()
      yield* Effect.forEach(workers, (worker) => Deferred.await(worker.exited), { discard: true }).pipe(
        Effect.timeout("5 seconds"),
        Effect.catchAllCause((cause) => Effect.logError(`session ${id}: its worker did not exit after SIGKILL`, cause))
      )
      yield* Scope.close(s.scope, Exit.void)
      // Another runner writes its log from now on: what this one kept of it is stale (a session
      // that came back appended at cursors the other runner had written), and appends still
      // queued are dropped, not written after the new owner's.
      yield* log.forget(id)
      const moved = new CommandError({
        code: "internal",
        message: `Session \`${id}\` left this runner (its shard moved to another runner): send the command again.`
      })
      for (const waiting of s.handles.requests.values()) yield* Deferred.fail(waiting, moved)
      for (const input of s.mailbox.takeAll()) {
        if ("reply" in input) yield* Deferred.fail(input.reply as Deferred.Deferred<unknown, unknown>, moved)
      }
      const streaming: Array<HandedOver> = []
      for (const a of [...s.attachments]) {
        detachAttachment(a)
        // One still sending its baseline ends here (its client attaches again).
        if (a.streaming && !a.outbox.isClosed) {
          const { attachCursor, connectionId, delivered, knownRewrite, outbox, resumed } = a
          streaming.push({ connectionId, outbox, delivered, attachCursor, knownRewrite, resumed })
        }
      }
      if (handOver !== undefined && streaming.length > 0) yield* handOver(streaming)
      yield* Effect.logInfo(`session ${id} left this runner`)
    }))

  const list = Effect.suspend(() =>
    Effect.forEach([...sessions.values()].filter((s) => !isClosed(s)), (s) => Effect.map(publishedState(s), ({ state }) => state))
  ).pipe(Effect.map((summaries) => ({ sessions: [...summaries, ...Array.from(damaged.values(), damagedSummary)] })))

  return SessionManager.of({
    create,
    list,
    listHere: list,
    status: Effect.gen(function*() {
      const live = yield* pool.live
      return {
        supervisorGeneration: info.generation,
        pid: process.pid,
        uptimeMs: Date.now() - info.startedAt,
        sessions: sessions.size + damaged.size,
        workers: live.filter((w) => w.activeSessionId !== undefined).map((w) => {
          const s = sessions.get(w.activeSessionId!)
          return { pid: w.pid, activeSessionId: w.activeSessionId!, state: s === undefined ? "closed" : summary(s).worker, restarts: s?.state.restarts ?? 0 }
        }),
        storage: core.storage.ok ? { ok: true } : { ok: false, error: core.storage.error ?? "unknown" }
      }
    }),
    attach: (connectionId, outbox, cmd) => route(cmd.activeSessionId, () => attach(connectionId, outbox, cmd)),
    detach: (connectionId, id) =>
      route(id, () =>
        Effect.sync(() => {
          const a = connections.get(connectionId)?.get(id)
          if (a !== undefined) detachAttachment(a)
        }), () => Effect.void),
    detachAll: (connectionId) =>
      Effect.sync(() => {
        for (const a of [...(connections.get(connectionId)?.values() ?? [])]) detachAttachment(a)
      }),
    attachedCount: (connectionId) => connections.get(connectionId)?.size ?? 0,
    prompt: (cmd, promptId = cmd.promptId) =>
      route(cmd.activeSessionId, (s) =>
        Effect.gen(function*() {
          if (promptId === undefined) return yield* send<{ accepted: true }>(s, (c) => ({ _tag: "Prompt", message: cmd.message, ...c }))
          if (s.startedPrompts.includes(promptId)) return { accepted: true as const }
          // Sent again before the first was answered: the first's answer (its turn started, or it was refused).
          const first = s.waitingPrompts.get(promptId)
          if (first !== undefined && !(yield* Deferred.isDone(first))) {
            // Joining it changes nothing: the connection's next commands need not wait for it.
            const progress = yield* FiberRef.get(CommandTakesEffect)
            if (progress !== undefined) yield* progressDone(progress)
            return yield* Deferred.await(first)
          }
          for (const [id, answer] of s.waitingPrompts) if (yield* Deferred.isDone(answer)) s.waitingPrompts.delete(id)
          return yield* send<{ accepted: true }>(s, (c) => {
            s.waitingPrompts.set(promptId, c.reply)
            return { _tag: "Prompt", message: cmd.message, promptId, ...c }
          })
        })),
    abort: (cmd) => route(cmd.activeSessionId, (s) => send<{ aborted: boolean }>(s, (c) => ({ _tag: "Abort", ...c }))),
    // Under the publish lock: a change of state being published is out before it is read here.
    getState: (id) =>
      route(id, (s) => Effect.map(publishedState(s), ({ state }) => state), (d) => Effect.succeed(damagedSummary(d))),
    getMessages: (cmd) => {
      const page = <E>(messages: Stream.Stream<AgentMessage, E>) =>
        messages.pipe(Stream.drop(cmd.offset ?? 0), Stream.take(cmd.limit ?? 100), Stream.runCollect, Effect.map(Chunk.toReadonlyArray))
      return route(
        cmd.activeSessionId,
        (s) =>
          s.readGate.withPermits(1)(Effect.suspend(() => {
            const total = s.messageCount
            return Effect.map(page(transcript(s)), (messages) => ({ messages, total }))
          })),
        (d) => Effect.map(page(readableMessages(d.activeSessionId)), (messages) => ({ messages, total: d.messageCount }))
      )
    },
    checkpoint: (id) => route(id, (s) => send<{ generation: number; snapshotId: string }>(s, (c) => ({ _tag: "Checkpoint", ...c }))),
    retryWorker: (id) => route(id, (s) => send<SessionSummary>(s, (c) => ({ _tag: "Retry", ...c })), retryDamaged),
    kill: (id) => route(id, (s) => send<{}>(s, (c) => ({ _tag: "Kill", ...c })), killDamaged),
    rename,
    settleForShutdown,
    adopt,
    evict,
    holds: (id) => damaged.has(id) || (sessions.has(id) && !isClosed(sessions.get(id)!)),
    setEnv: (cmd) =>
      route(cmd.activeSessionId, (s) =>
        post(s, {
          _tag: "SetEnv",
          ...(cmd.launchEnv === undefined ? {} : { launchEnv: { ...cmd.launchEnv } }),
          ...(cmd.env === undefined ? {} : { clientEnv: filterEnv(cmd.env) ?? {} })
        }))
  })
})


/** The session manager over its storage, worker pool and configuration. */
export const layer: Layer.Layer<
  SessionManager,
  never,
  DaemonConfig | Engine | SupervisorInfo | EventLog | SessionStore | RecoveryJournal | SnapshotCache | WorkerPool
> = Layer.scoped(SessionManager, make)
