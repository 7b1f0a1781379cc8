/**
 * Events of sessions another runner owns (docs/cluster.md section 4): a runner serves `attach`,
 * `detach` and the HTTP event reads of every session by reading the shared event log.
 *
 * - A *follower* is this runner's read-only copy of a session it does not own: a `Session` of
 *   the core (internal/session/session.ts) that no entity runs and no worker serves, built from
 *   the store and the log (its generation, its snapshot's cursor, its counts, its last cursor)
 *   on the first attach through this runner. The single daemon's delivery (internal/delivery:
 *   the replay decision, baselines, chunked snapshots, catch-up, backpressure, resync) runs on it
 *   unchanged, over a read-only event log (postgres/eventLog.ts `readOnly`: nothing kept in
 *   memory, since another process writes it) and this runner's snapshot cache.
 * - Its *tail* is the one fiber that moves it: woken by the log's notification (one per group
 *   commit of the session, sent in the commit: postgres/eventLog.ts `notify`; one LISTEN
 *   connection per runner), or every {@link SAFETY_POLL} without one, it reads the log after its
 *   last cursor and does what the owner's publish did: counts, a new generation (under the whole
 *   read gate, as a checkpoint; a history rewrite has every attachment send the replacement
 *   snapshot first), then hands the batch to the live attachments. A `session_closed` ends it.
 * - The LISTEN connection reconnects when it drops, and then every tail reads: a notification
 *   lost meanwhile delays nothing for longer than the reconnection.
 *
 * The attach response's `state` is the log's: the last `session_status` logged (the owner's
 * summary when it logged it), with the message count and last cursor of the same moment; the
 * owner is asked (`get_state` through the cluster) only for a session whose retained log holds
 * no status yet.
 *
 * A follower stays while it has attachments, also once this runner owns the session (its
 * clients keep reading the log the new owner writes: nothing to hand over, no gap, no
 * duplicate); new attaches then go to the local session. A follower without attachments for
 * {@link IDLE} is dropped.
 *
 * Owns: the followers (their sessions' fields, written by their tail only), the LISTEN
 * connection, the read-only log.
 */
import * as SqlClient from "@effect/sql/SqlClient"
import * as Context from "effect/Context"
import * as Duration from "effect/Duration"
import * as Effect from "effect/Effect"
import * as Either from "effect/Either"
import * as Exit from "effect/Exit"
import * as ExecutionStrategy from "effect/ExecutionStrategy"
import * as FiberSet from "effect/FiberSet"
import * as Layer from "effect/Layer"
import * as Option from "effect/Option"
import * as Schema from "effect/Schema"
import * as Scope from "effect/Scope"
import * as Stream from "effect/Stream"
import { createRequire } from "node:module"
import * as nodePath from "node:path"
import * as Cursor from "../../Cursor.js"
import { Lock } from "../lock.js"
import { DaemonConfig } from "../../DaemonConfig.js"
import type { EventRecord } from "../../EventLog.js"
import type { CommandOf, SessionSummary } from "../../Protocol.js"
import { RecoveryJournal } from "../../RecoveryJournal.js"
import { type AttachOutcome, CommandError, type ConnectionPort, type HandedOver, SupervisorInfo } from "../../SessionManager.js"
import { SessionStore, SnapshotHeader } from "../../SessionStore.js"
import { SnapshotCache } from "../../SnapshotCache.js"
import * as StateLayout from "../../StateLayout.js"
import { defaultRestartPolicy, WorkerPool } from "../../WorkerPool.js"
import { makeDelivery } from "../delivery/attach.js"
import type { Attachment } from "../delivery/attachment.js"
import { type LoggedBody, wireLineOfRecord } from "../delivery/wireLines.js"
import * as PgEventLog from "../postgres/eventLog.js"
import * as PgSessionStore from "../postgres/sessionStore.js"
import { makeCheckpoints } from "../session/checkpoint.js"
import { toCommandError } from "../session/errors.js"
import { makeCore, newHandles, notFound, READ_GATE_PERMITS, type Session } from "../session/session.js"
import { InputQueue } from "../session/mailbox.js"
import * as Transition from "../session/transition.js"
import * as WorkerSlots from "../session/workerSlots.js"
import { Wakeup } from "./wakeup.js"

/** A tail reads this often without a notification (one lost with a dropped connection, say). */
export const SAFETY_POLL = Duration.seconds(2)
/** A follower without attachments for this long is dropped. */
export const IDLE = Duration.seconds(30)
/** Wait before reconnecting the LISTEN connection after it dropped. */
const RECONNECT = Duration.seconds(1)
/** Its `application_name`: how a test finds (and cuts) it in `pg_stat_activity`. */
export const LISTEN_APPLICATION = "agentd-log-tail"
/** How long a handover may take (a follower's open: a few reads). */
const HANDOVER_TIMEOUT = Duration.seconds(5)
/** Lines handed to live attachments at once (one encode each), as the owner's publish does. */
const BATCH_BYTES = 256 * 1024

/** The pg driver's client, as far as the LISTEN connection uses it (the project has no @types/pg). */
interface PgListenClient {
  connect(): Promise<void>
  query(text: string): Promise<unknown>
  end(): Promise<void>
  on(event: "notification", f: (msg: { channel: string; payload?: string }) => void): void
  on(event: "error" | "end", f: (e?: unknown) => void): void
}
const Pg = createRequire(import.meta.url)("pg") as { Client: new(options: { connectionString: string; application_name: string }) => PgListenClient }

/** A follower: the session delivery runs on, and what its tail keeps besides. */
interface Follower {
  readonly session: Session
  readonly key: string
  readonly wakeup: Wakeup
  /** The last `session_status` logged (what the attach response's `state` starts from). */
  status: SessionSummary
  /** Whether `status` was read from the log (else it is the owner's, or the store's guess). */
  logged: boolean
  closed: boolean
}

/** The log tails of this runner: attach, detach and reads of sessions owned elsewhere. */
export class LogTail extends Context.Tag("agentd/cluster/LogTail")<LogTail, {
  /** `ownerState`: the owner's summary, asked for only when the retained log holds no status of the session. */
  readonly attach: (
    connectionId: string,
    outbox: ConnectionPort,
    cmd: CommandOf<"attach">,
    ownerState: Effect.Effect<SessionSummary, CommandError>
  ) => Effect.Effect<AttachOutcome, CommandError>
  /** Whether the connection has an attachment to the session here. */
  readonly attachedTo: (connectionId: string, activeSessionId: string) => boolean
  readonly detach: (connectionId: string, activeSessionId: string) => Effect.Effect<void>
  readonly detachAll: (connectionId: string) => Effect.Effect<void>
  readonly attachedCount: (connectionId: string) => number
  /**
   * Takes over the clients of a session this runner's SessionManager just let go of (its shard
   * moved): each goes on from the last cursor it was sent, read from the log.
   */
  readonly handOver: (activeSessionId: string) => (attachments: ReadonlyArray<HandedOver>) => Effect.Effect<void>
}>() {}

/** The tails over the store at `url` (their LISTEN connection is their own). */
export const make = (url: string) =>
  Effect.gen(function*() {
    const config = yield* DaemonConfig
    const info = yield* SupervisorInfo
    const store = yield* SessionStore
    const journal = yield* RecoveryJournal
    const cache = yield* SnapshotCache
    const pool = yield* WorkerPool
    const sql = yield* SqlClient.SqlClient
    const log = yield* PgEventLog.makeWith({ notify: false, readOnly: true })
    const scope = yield* Effect.scope
    const fibers = yield* FiberSet.make()
    const followers = new Map<string, Follower>()
    /** Each follower's session's follower (a dropped one's too: an attach may still hold it). */
    const ofSession = new WeakMap<Session, Follower>()
    const byKey = new Map<string, Follower>()
    const base = makeCore({
      config,
      info,
      log,
      store,
      journal,
      cache,
      pool,
      fibers,
      // No worker ever runs here.
      slots: yield* WorkerSlots.make(0, (effect) => Effect.asVoid(FiberSet.run(fibers, effect))),
      sessions: new Map(),
      connections: new Map(),
      restartPolicy: defaultRestartPolicy,
      sessionScope: Effect.gen(function*() {
        const child = yield* Scope.fork(scope, ExecutionStrategy.sequential)
        return { scope: child, fibers: yield* Scope.extend(FiberSet.make(), child) }
      })
    })
    const { connections, sessions } = base
    /** The attach response's state: the last status logged, at the follower's last cursor. */
    const stateOf = (f: Follower): SessionSummary => {
      const s = f.session
      const { lastEventCursor: _, ...rest } = f.status
      return {
        ...rest,
        messageCount: s.messageCount,
        busy: s.shown.busy,
        worker: s.shown.worker,
        ...(s.lastCursor === undefined ? {} : { lastEventCursor: s.lastCursor })
      }
    }
    const core = {
      ...base,
      // The next worker's environment is the owner's to set: not through a follower.
      post: () => Effect.void,
      publishedState: (s: Session) =>
        s.publishLock.withLock(Effect.sync(() => ({ state: stateOf(ofSession.get(s)!), lastCursor: s.lastCursor })))
    }
    const checkpoints = makeCheckpoints(core)
    const delivery = makeDelivery(core, checkpoints)

    /** The header of a generation's snapshot (written before the owner started that generation). */
    const headerOf = (id: string, generation: number) =>
      sql<{ header: string }>`SELECT header FROM agentd_snapshots
        WHERE active_session_id = ${StateLayout.safeSegment(id)} AND generation = ${generation}`.pipe(
        Effect.flatMap((rows) =>
          rows.length === 0
            ? Effect.succeed(Option.none<SnapshotHeader>())
            : Effect.map(Schema.decodeUnknown(Schema.parseJson(SnapshotHeader))(rows[0]!.header), Option.some)
        )
      )

    /** The newest generation the log has started (0 when none). */
    const newestGeneration = (key: string) =>
      Effect.map(
        sql<{ g: number | null }>`SELECT max(generation) AS g FROM agentd_generations WHERE session_id = ${key}`,
        (rows) => Number(rows[0]?.g ?? 0)
      )

    /**
     * Moves a follower to `generation`, whose snapshot's cursor is the follower's last event:
     * as the owner's checkpoint did, under the whole read gate (no baseline mixes generations).
     */
    const enterGeneration = (f: Follower, generation: number) =>
      Effect.gen(function*() {
        const s = f.session
        const id = s.meta.activeSessionId
        const header = yield* headerOf(id, generation)
        yield* s.readGate.withPermits(READ_GATE_PERMITS)(Effect.gen(function*() {
          const messageCount = Option.match(header, { onNone: () => s.messageCount, onSome: (h) => h.messageCount })
          s.generation = generation
          s.snapshotCursor = s.lastCursor
          s.baseMessageCount = messageCount
          s.messageCount = messageCount
          s.generationEvents = 0
          s.generationBytes = 0
          s.rewriteGeneration = Option.isSome(header) ? header.value.rewrittenAt : s.rewriteGeneration
          // The previous generation's snapshot entry is no longer the current one.
          yield* checkpoints.disposeSnapshotEntry(s)
          if (s.rewriteGeneration === generation) for (const a of s.attachments) a.replaceState()
        }))
      })

    /** Hands a batch of lines (the last at `last`) to the live attachments, as publish does. */
    const publish = (f: Follower, records: ReadonlyArray<EventRecord>) =>
      f.session.publishLock.withLock(Effect.sync(() => {
        if (records.length === 0) return
        const s = f.session
        const sessionJson = JSON.stringify(s.meta.activeSessionId)
        let text = ""
        for (const r of records) {
          text += wireLineOfRecord(sessionJson, r, false)
          const body = r.event as unknown as LoggedBody
          if (body.type === "session_event" && body.event.type === "message_end") s.messageCount++
          if (body.type === "session_status") {
            f.status = body.state
            f.logged = true
            s.shown = { busy: body.state.busy, worker: body.state.worker }
          }
        }
        const last = records[records.length - 1]!.cursor
        const lines = Buffer.from(text, "utf8")
        s.lastCursor = last
        s.generationEvents += records.length
        s.generationBytes += lines.byteLength
        for (const a of s.attachments) a.onLive(last, lines)
      }))

    /** Drops a follower: its attachments end (after `closedLine`, if the session was killed). */
    const drop = (f: Follower, closedLine?: { readonly line: string; readonly cursor: Cursor.Cursor }) =>
      Effect.gen(function*() {
        if (f.closed) return
        f.closed = true
        const s = f.session
        if (followers.get(s.meta.activeSessionId) === f) followers.delete(s.meta.activeSessionId)
        if (byKey.get(f.key) === f) byKey.delete(f.key)
        sessions.delete(s.meta.activeSessionId)
        s.state = { ...s.state, _tag: "Closed" } as Transition.State
        const attachments = [...s.attachments]
        for (const a of attachments) delivery.detachAttachment(a)
        if (closedLine !== undefined) {
          // As the owner's kill does: an attachment that was not sent it (catching up, paused,
          // or the log archived before the tail read it) gets the closing line after what it
          // was sent, the log being gone.
          for (const a of attachments) {
            if (a.outbox.isClosed || (a.delivered !== undefined && !Cursor.isBefore(a.delivered, closedLine.cursor))) continue
            if (a.streaming) a.outbox.offer(closedLine.line)
            else a.closedLine = closedLine.line
          }
        }
        yield* checkpoints.disposeSnapshotEntry(s)
        // Its tail runs in this scope: closed from another fiber (the tail may be the one dropping it).
        yield* FiberSet.run(fibers, Scope.close(s.scope, Exit.void))
      })

    /** The archived log's last event, if it is the session's `session_closed` (a kill archived it before it was read). */
    const archivedClose = (f: Follower) =>
      Effect.gen(function*() {
        // The key `kill` moves the log's rows to: `archive:` + the archive's path + `/events`.
        const prefix = `archive:${nodePath.join(PgSessionStore.BASE, `archive/${StateLayout.safeSegment(f.session.meta.activeSessionId)}-`)}`
        const rows = yield* sql<{ generation: number; first_sequence: number; count: number; lengths: ReadonlyArray<number> | null; events: string }>`
          SELECT generation, first_sequence, count, lengths, events FROM agentd_event_batches
          WHERE starts_with(session_id, ${prefix}) ORDER BY generation DESC, first_sequence DESC LIMIT 1`
        const row = rows[0]
        if (row === undefined) return undefined
        const lengths = row.lengths ?? [row.events.length]
        const lastLength = lengths[lengths.length - 1]!
        const json = row.events.slice(row.events.length - lastLength)
        const event = JSON.parse(json) as Record<string, unknown>
        if (event["type"] !== "session_closed") return undefined
        const cursor = Cursor.make(row.generation, row.first_sequence + row.count - 1)
        const last = f.session.lastCursor
        if (last !== undefined && !Cursor.isBefore(last, cursor)) return undefined
        return { cursor, line: wireLineOfRecord(JSON.stringify(f.session.meta.activeSessionId), { cursor, event, json }, false) }
      })

    /** One read of the tail: everything logged after the follower's last cursor. */
    const pull = (f: Follower) =>
      Effect.gen(function*() {
        const s = f.session
        const id = s.meta.activeSessionId
        // Read before the events: a generation it names began after every event read below
        // that precedes it, so that an empty new generation is entered at the right cursor.
        const newest = yield* newestGeneration(f.key)
        let batch: Array<EventRecord> = []
        let bytes = 0
        let closed: EventRecord | undefined
        let records = 0
        const read = yield* Effect.either(log.read(id, s.lastCursor).pipe(
          Stream.runForEach((r) =>
            Effect.gen(function*() {
              records++
              if (closed !== undefined) return
              if (r.cursor.generation > s.generation) {
                yield* publish(f, batch)
                batch = []
                bytes = 0
                yield* enterGeneration(f, r.cursor.generation)
              }
              batch.push(r)
              bytes += r.json.length
              if ((r.event as { type?: unknown }).type === "session_closed") closed = r
              if (bytes >= BATCH_BYTES) {
                yield* publish(f, batch)
                batch = []
                bytes = 0
              }
            })
          )
        ))
        yield* publish(f, batch)
        if (closed !== undefined) {
          return yield* drop(f, { cursor: closed.cursor, line: wireLineOfRecord(JSON.stringify(id), closed, false) })
        }
        // Nothing read and no generation left, or the read failed: the log may be gone (killed
        // elsewhere, its log archived before this read: a read of a removed log ends empty).
        if (Either.isLeft(read) || (newest === 0 && records === 0)) {
          // Gone from the store: killed (its log archived, perhaps before this read).
          const meta = yield* Effect.either(store.loadMeta(id))
          if (Either.isLeft(meta) && meta.left._tag === "SessionNotFound") {
            const close = yield* Effect.orElseSucceed(archivedClose(f), () => undefined)
            return yield* drop(f, close)
          }
          if (Either.isLeft(read)) yield* Effect.logWarning(`log tail of ${id}: ${read.left.message}`)
          return
        }
        if (newest > s.generation) yield* enterGeneration(f, newest)
      })

    /** The tail's loop: a read per wake-up; a follower without attachments for IDLE is dropped. */
    const tail = (f: Follower) =>
      Effect.gen(function*() {
        let idleSince: number | undefined
        while (!f.closed) {
          yield* f.wakeup.wait(SAFETY_POLL)
          if (f.closed) return
          yield* pull(f).pipe(Effect.catchAllCause((cause) => Effect.logWarning(`log tail of ${f.session.meta.activeSessionId}: read failed`, cause)))
          if (f.session.attachments.size > 0) idleSince = undefined
          else if (idleSince === undefined) idleSince = Date.now()
          else if (Date.now() - idleSince >= Duration.toMillis(IDLE)) {
            // Under the whole read gate: an attach holds a permit while it adds its attachment.
            yield* f.session.readGate.withPermits(READ_GATE_PERMITS)(
              Effect.suspend(() => (f.session.attachments.size === 0 ? drop(f) : Effect.void))
            )
          }
        }
      })

    /** A follower of the session as the store and the log say it is now. */
    const open = (id: string, ownerState: Effect.Effect<SessionSummary, CommandError>) =>
      Effect.gen(function*() {
        const key = PgEventLog.sessionKey(id)
        if (key === undefined) return yield* Effect.fail(notFound(id))
        const meta = yield* store.loadMeta(id)
        // The owner may be between a checkpoint's transcript and its new generation: the
        // generation the log says, with that generation's own snapshot.
        const status = yield* log.status(id)
        const header = status.generation === 1 ? Option.none() : yield* headerOf(id, status.generation)
        const snapshotCursor = Option.isSome(header) ? header.value.cursor : Option.getOrUndefined(status.generations.length > 0
          ? yield* log.generationStart(id, status.generation)
          : Option.none())
        const baseMessageCount = Option.isSome(header) ? header.value.messageCount : 0
        const scoped = yield* base.sessionScope
        const state = Transition.loaded
        const s: Session = {
          ...scoped,
          meta,
          messageCount: baseMessageCount,
          baseMessageCount,
          generation: status.generation,
          snapshotCursor,
          generationEvents: 0,
          generationBytes: 0,
          lastCursor: snapshotCursor,
          attachments: new Set(),
          publishLock: new Lock(),
          readGate: yield* Effect.makeSemaphore(READ_GATE_PERMITS),
          lastUsed: Date.now(),
          launchEnv: undefined,
          clientEnv: undefined,
          rewriteGeneration: Option.isSome(header) ? header.value.rewrittenAt : undefined,
          state,
          handles: newHandles(),
          mailbox: new InputQueue(),
          sessionFile: undefined,
          shown: { busy: false, worker: "passivated" },
          startedPrompts: [],
          waitingPrompts: new Map()
        }
        const f: Follower = {
          session: s,
          key,
          wakeup: new Wakeup(),
          status: {
            activeSessionId: id,
            engine: meta.engine,
            createdAt: meta.createdAt,
            messageCount: 0,
            busy: false,
            worker: "passivated",
            restarts: 0,
            telemetry: meta.telemetry,
            ...(meta.name === undefined ? {} : { name: meta.name })
          },
          logged: false,
          closed: false
        }
        ofSession.set(s, f)
        // The current generation's events (its status among them), then its tail.
        yield* pull(f)
        if (f.closed) return yield* Effect.fail(notFound(id))
        if (!f.logged) {
          // No status since the snapshot (a checkpoint between turns): the owner's word.
          const owner = yield* Effect.option(ownerState)
          if (Option.isSome(owner)) {
            f.status = owner.value
            s.shown = { busy: owner.value.busy, worker: owner.value.worker }
          }
        }
        followers.set(id, f)
        byKey.set(key, f)
        sessions.set(id, s)
        // Interruptible whoever opens it: a hand-over opens it in an entity's finalizer, where a
        // fork would inherit the finalizer's uninterruptibility and the tail would never stop.
        yield* FiberSet.run(s.fibers, Effect.interruptible(tail(f)))
        return f
      })

    /** Followers are opened one at a time (two attaches of one session share one). */
    const opening = yield* Effect.makeSemaphore(1)
    const followerOf = (id: string, ownerState: Effect.Effect<SessionSummary, CommandError>) =>
      Effect.suspend(() => {
        const f = followers.get(id)
        return f !== undefined && !f.closed ? Effect.succeed(f) : opening.withPermits(1)(Effect.suspend(() => {
          const again = followers.get(id)
          return again !== undefined && !again.closed ? Effect.succeed(again) : open(id, ownerState)
        }))
      })

    /** A failure of a follower's attach as the wire says it. */
    const wireError = (e: { readonly _tag: string; readonly message: string }, id: string): CommandError => {
      if (e instanceof CommandError) return e
      if (e._tag === "SessionNotFound") return toCommandError(notFound(id))
      if (e._tag === "TelemetryPolicyViolation" || e._tag === "CoreInternal") {
        return toCommandError(e as Parameters<typeof toCommandError>[0])
      }
      return new CommandError({ code: "internal", message: `Session \`${id}\` could not be read from the shared log: ${e.message}` })
    }

    const attach = (
      connectionId: string,
      outbox: ConnectionPort,
      cmd: CommandOf<"attach">,
      ownerState: Effect.Effect<SessionSummary, CommandError>
    ): Effect.Effect<AttachOutcome, CommandError> =>
      Effect.gen(function*() {
        for (;;) {
          const f = yield* followerOf(cmd.activeSessionId, ownerState)
          const outcome = yield* delivery.attach(connectionId, outbox, cmd)
          // Dropped (idle, or killed) while it attached: attach to the session as it is now.
          if (!f.closed) return outcome
          const a = connections.get(connectionId)?.get(cmd.activeSessionId)
          if (a !== undefined) delivery.detachAttachment(a)
        }
      }).pipe(
        Effect.mapError((e) => wireError(e, cmd.activeSessionId)),
        Effect.catchAllDefect((defect) => Effect.fail(new CommandError({ code: "internal", message: `attach failed: ${String(defect)}` })))
      )

    // The LISTEN connection: every notification wakes its session's tail; each (re)connection
    // wakes them all (what was sent while it was down is read now).
    const listenOnce = Effect.async<void>((resume) => {
      const client = new Pg.Client({ connectionString: url, application_name: LISTEN_APPLICATION })
      let done = false
      const end = () => {
        if (done) return
        done = true
        resume(Effect.void)
      }
      client.on("notification", (msg) => {
        if (msg.channel === PgEventLog.NOTIFY_CHANNEL && msg.payload !== undefined) byKey.get(msg.payload)?.wakeup.notify()
      })
      client.on("error", end)
      client.on("end", end)
      client.connect().then(() => client.query(`LISTEN ${PgEventLog.NOTIFY_CHANNEL}`)).then(
        () => {
          for (const f of followers.values()) f.wakeup.notify()
        },
        end
      )
      return Effect.promise(() => client.end().catch(() => undefined))
    })
    yield* Effect.forkScoped(Effect.forever(Effect.zipRight(listenOnce, Effect.sleep(RECONNECT))))
    yield* Effect.addFinalizer(() => Effect.forEach([...followers.values()], (f) => drop(f), { discard: true }))

    return LogTail.of({
      attach,
      attachedTo: (connectionId, id) => connections.get(connectionId)?.has(id) === true,
      detach: (connectionId, id) =>
        Effect.sync(() => {
          const a: Attachment | undefined = connections.get(connectionId)?.get(id)
          if (a !== undefined) delivery.detachAttachment(a)
        }),
      detachAll: (connectionId) =>
        Effect.sync(() => {
          for (const a of [...(connections.get(connectionId)?.values() ?? [])]) delivery.detachAttachment(a)
        }),
      attachedCount: (connectionId) => connections.get(connectionId)?.size ?? 0,
      // Called from the finalizer of the session's entity, which runs uninterruptibly: made
      // interruptible here, so that its bound can cut it, and so that the deliveries it starts
      // (forks inherit their parent's interruptibility) stop when their follower is dropped.
      // Uninterruptible, a follower opened here could never be dropped: its tail went on for
      // ever, and the runner's stop waited for it (a SIGTERMed runner that did not exit).
      handOver: (id) => (list) =>
        Effect.gen(function*() {
          const f = yield* followerOf(id, Effect.fail(new CommandError({ code: "internal", message: "the session is moving" })))
          for (const from of list) {
            if (!from.outbox.isClosed) {
              yield* FiberSet.run(f.session.fibers, Effect.interruptible(delivery.continueAttachment(f.session, from)))
            }
          }
        }).pipe(
          Effect.interruptible,
          // Not for long: the runner may be stopping (its clients' connections close then).
          Effect.timeout(HANDOVER_TIMEOUT),
          Effect.catchAllCause((cause) => Effect.logWarning(`session ${id}: its clients could not be handed to the log tail`, cause))
        )
    })
  })

/** The tails of a runner over the store at `url`. */
export const layer = (url: string) => Layer.scoped(LogTail, make(url))
