/**
 * A cluster runner (`agentd serve --store postgres://... --cluster`; docs/cluster.md): the
 * daemon joins @effect/cluster's sharding over the PostgreSQL store, and its SessionManager is
 * replaced by one that routes each session's commands to the runner owning the session.
 *
 * - Sharding: @effect/cluster's socket runner (runners talk over TCP, msgpack), its runner and
 *   message storage in the store's database (tables `agentd_cluster_*`), shard locks as
 *   PostgreSQL advisory locks held on one connection per runner.
 * - The `Session` entity (entity.ts): its handler runs on the owner. Building it adopts the
 *   session into the local SessionManager; its scope closing (the shard released, lost, or the
 *   runner stopping) evicts it, so the cluster waits for the session's worker to be gone before
 *   it lets go of the shard's lock: that wait is the fencing.
 * - The watcher: every {@link WATCH_INTERVAL} it reads which shards this runner holds, wakes the
 *   entities of the sessions of newly held shards (their busy sessions are restored at once, as
 *   at a daemon start), evicts what a lost shard left behind, and publishes the count for `status`.
 * - The router: a SessionManager whose session commands run locally when this runner holds the
 *   session, else go to the owner through the entity; `list` covers every runner's sessions.
 *
 * Owns: the sharding's layers and settings, the entity's handler, the watcher, the router.
 */
import { CurrentAddress } from "@effect/cluster/Entity"
import * as EntityId from "@effect/cluster/EntityId"
import * as RunnerAddress from "@effect/cluster/RunnerAddress"
import * as RunnerHealth from "@effect/cluster/RunnerHealth"
import * as Runners from "@effect/cluster/Runners"
import * as Sharding from "@effect/cluster/Sharding"
import * as ShardingConfig from "@effect/cluster/ShardingConfig"
import * as ShardId from "@effect/cluster/ShardId"
import * as RunnerServer from "@effect/cluster/RunnerServer"
import * as SqlMessageStorage from "@effect/cluster/SqlMessageStorage"
import * as SqlRunnerStorage from "@effect/cluster/SqlRunnerStorage"
import * as NodeClusterSocket from "@effect/platform-node/NodeClusterSocket"
import * as RpcSerialization from "@effect/rpc/RpcSerialization"
import * as RpcServer from "@effect/rpc/RpcServer"
import * as SqlClient from "@effect/sql/SqlClient"
import * as Cause from "effect/Cause"
import * as Deferred from "effect/Deferred"
import * as Duration from "effect/Duration"
import * as Effect from "effect/Effect"
import * as Exit from "effect/Exit"
import * as FiberId from "effect/FiberId"
import * as Layer from "effect/Layer"
import * as Option from "effect/Option"
import * as Schedule from "effect/Schedule"
import { randomUUID } from "node:crypto"
import * as os from "node:os"
import { DaemonConfig } from "../../DaemonConfig.js"
import type { CommandOf, SessionSummary } from "../../Protocol.js"
import { CommandError, SessionManager } from "../../SessionManager.js"
import { listingId, SessionStore } from "../../SessionStore.js"
import { WorkerPool } from "../../WorkerPool.js"
import { parseListen } from "../http/listen.js"
import { retrySchemaRace, retryingSchemaRace } from "../postgres/store.js"
import { RemoteCommandError, SessionEntity } from "./entity.js"
import * as Fence from "./fence.js"
import * as Leave from "./leave.js"
import * as StopBound from "./stopBound.js"
import { LogTail } from "./logTail.js"
import * as Transport from "./transport.js"

/** The prefix of @effect/cluster's tables in the store (`agentd_cluster_runners`, `_messages`, `_replies`). */
export const TABLE_PREFIX = "agentd_cluster"
/** This project's own table: how many shards each runner holds, for `status`. */
const SHARDS_TABLE = "agentd_cluster_shards"
/** Default port of `--runner-address` (@effect/cluster's own default). */
export const DEFAULT_RUNNER_PORT = 34431
/** Default shard lease (@effect/cluster's default `shardLockExpiration`). */
export const DEFAULT_LEASE_MS = 35_000
/** How often the watcher reads which shards this runner holds. */
const WATCH_INTERVAL = Duration.millis(250)
/** The entity's own command (never a wire command): an attach's environment, see the router's `attach`. */
const SET_ENV = "agentd/set_env"
/**
 * How long a command sent to a session's owner may wait for its answer. Seen under chaos (a
 * runner cut off from PostgreSQL while a forwarded prompt was in it; a create sent while the
 * cluster was still assigning shards): without a bound such a command was never answered. Past
 * it the client is answered `internal` (the command may have run: ask `get_state`). Longer
 * than the longest command an owner runs (a worker start waits up to 30 s).
 */
const FORWARD_TIMEOUT = Duration.seconds(45)
/** How long `status` and `list` wait for the store before answering with what this runner knows. */
const STORE_READ_TIMEOUT = Duration.seconds(5)
/** A runner's stop is bounded by the clients' grace period plus this (unless configured). */
const STOP_MARGIN = Duration.seconds(30)
/** How long a stopping runner waits for its shards to be handed over before its stop goes on. */
const HAND_OVER_TIMEOUT = Duration.seconds(4)
/** Commands an owner answers once per id (see the entity's `answerOnce`); the others only read. */
const CHANGES_SESSION = new Set(["create", "prompt", "abort", "checkpoint", "retry_worker", "kill", "rename", SET_ENV])
/** How many answers to commands sent with an id an owner keeps per session. */
const ANSWERS_KEPT = 64
/** How often a forwarder asks again for a command its owner is still running (see `forward`). */
const ASK_AGAIN_INTERVAL = Duration.millis(250)
/**
 * Test only: how long an owner holds its answer to a forwarded prompt, after the turn started
 * (test/e2e/cluster.test.ts kills the owner meanwhile, so that the cluster sends it again).
 */
const replyDelay = Effect.suspend(() => {
  const ms = Number(process.env["AGENTD_TEST_FORWARDED_PROMPT_REPLY_DELAY_MS"] ?? 0)
  return ms > 0 ? Effect.sleep(Duration.millis(ms)) : Effect.void
})
/**
 * Test only: a stop that never ends, its workers still running (test/e2e/cluster.test.ts), as a
 * stuck finalizer hung a stopping runner (uninterruptible, as a finalizer is: no bound of a step
 * cuts it).
 */
const hangForTest = Effect.suspend(() => (process.env["AGENTD_TEST_HANG_STOP"] === "1" ? Effect.uninterruptible(Effect.never) : Effect.void))
/** Sessions asked about at once by `list` (one `get_state` each to their owners). */
const LIST_CONCURRENCY = 8

/** `HOST:PORT` of this runner: `--runner-address`, else `<hostname>:34431`. */
export const runnerAddressOf = (configured: string | undefined): RunnerAddress.RunnerAddress => {
  const parsed = configured === undefined ? undefined : parseListen(configured)
  if (parsed === undefined || typeof parsed === "string") return RunnerAddress.make(os.hostname(), DEFAULT_RUNNER_PORT)
  return RunnerAddress.make(parsed.host, parsed.port)
}

/**
 * The sharding settings: the lease (`clusterLeaseMs`) and what follows from it. The locks are
 * refreshed every third of it (the cluster's own rule); runners and assignments are re-read
 * every sixth (at most 3 s, the cluster's default), so that a dead runner's shards are taken
 * soon after its lease ran out.
 */
export const shardingSettings = (address: RunnerAddress.RunnerAddress, leaseMs: number): Partial<ShardingConfig.ShardingConfig["Type"]> => ({
  runnerAddress: Option.some(address),
  shardLockExpiration: Duration.millis(leaseMs),
  shardLockRefreshInterval: Duration.millis(Math.min(10_000, Math.floor(leaseMs / 3))),
  refreshAssignmentsInterval: Duration.millis(Math.min(3_000, Math.max(100, Math.floor(leaseMs / 6)))),
  // A runner's health is judged by its heartbeat in the store (the lease), and by a ping at
  // the same pace, not once a minute.
  runnerHealthCheckInterval: Duration.millis(Math.max(1_000, leaseMs)),
  // Commands to a session this runner owns skip the entity (see `route`); what goes through it
  // locally need not be serialized to be checked.
  simulateRemoteSerialization: false
})

/** @effect/cluster's sharding on this runner: socket transport, storage in the store's database. */
const shardingLayer = (address: RunnerAddress.RunnerAddress, leaseMs: number): Layer.Layer<
  Sharding.Sharding | Runners.Runners | ShardingConfig.ShardingConfig | Leave.Leave,
  never,
  SqlClient.SqlClient | WorkerPool
> =>
  Layer.unwrapEffect(Effect.sync(() => {
    // @effect/cluster's SocketRunner.layer, but over connections closed when their runner
    // leaves the ring and does not answer (transport.ts).
    const transport = Transport.make(address)
    return RunnerServer.layer.pipe(
      Layer.provideMerge(Sharding.layer),
      Layer.provideMerge(transport.closingUnavailable(Runners.layerRpc)),
      Layer.provide(RpcServer.layerProtocolSocketServer),
      Layer.provide([NodeClusterSocket.layerSocketServer, transport.clientProtocol]),
      Layer.provide(RunnerHealth.layerPing.pipe(Layer.provide(Runners.layerRpc), Layer.provide(transport.clientProtocol)))
    )
  })).pipe(
    // Their tables are made at start: runners that start together on a new store race for them.
    Layer.provide(retryingSchemaRace(SqlMessageStorage.layerWith({ prefix: TABLE_PREFIX }))),
    // Its lock refreshes timed for the fence (fence.ts); able to leave at a graceful stop (leave.ts).
    Layer.provideMerge(Leave.layer(address).pipe(
      Layer.provide(Fence.layer(leaseMs, `${address.host}:${address.port}`, `${TABLE_PREFIX}_runners`)),
      Layer.provide(Layer.orDie(retryingSchemaRace(SqlRunnerStorage.layerWith({ prefix: TABLE_PREFIX }))))
    )),
    Layer.provideMerge(ShardingConfig.layer(shardingSettings(address, leaseMs))),
    Layer.provide(RpcSerialization.layerMsgPack),
    // A runner port already taken (SocketServerError) stops the start as a defect: exit 1 with
    // the error in the log. (A typed start error with its own message is still to do.)
    Layer.orDie
  )

const toRemote = (e: CommandError) => new RemoteCommandError({ code: e.code, message: e.message })

/**
 * The entity's handlers on the owner. Building them adopts the session; the entity's scope
 * closing evicts it (see the module's header).
 */
const entityLayer = (self: string) =>
  SessionEntity.toLayer(
    Effect.gen(function*() {
      const local = yield* SessionManager
      const tails = yield* LogTail
      const stopping = yield* Leave.Leave
      const id: string = (yield* CurrentAddress).entityId
      // Its clients attached here go on reading through this runner's log tail; not when this
      // runner stops (they are told `daemon_closing`, and the tails stop with it).
      yield* Effect.addFinalizer(() => local.evict(id, stopping.leaving() ? undefined : tails.handOver(id)))
      yield* local.adopt(id)
      const withRunner = (s: SessionSummary): SessionSummary => ({ ...s, runner: self })
      const run = (command: any, commandId: string | undefined): Effect.Effect<unknown, CommandError> => {
        switch (command?.type) {
          case "create":
            return Effect.map(local.create(command as CommandOf<"create">, id), (r) => ({ ...r, state: withRunner(r.state) }))
          case "prompt":
            // The id goes with the turn's first status into the log: the next owner knows it too.
            // The client's own id, when it gave one, is the one its turn's status must carry.
            return Effect.tap(local.prompt(command as CommandOf<"prompt">, command.promptId ?? commandId), () => replyDelay)
          case "abort":
            return local.abort(command as CommandOf<"abort">)
          case "get_state":
            return Effect.map(local.getState(id), withRunner)
          case "get_messages":
            return local.getMessages(command as CommandOf<"get_messages">)
          case "checkpoint":
            return local.checkpoint(id)
          case "retry_worker":
            return Effect.map(local.retryWorker(id), withRunner)
          case "kill":
            return local.kill(id)
          case "rename":
            return Effect.map(local.rename(command as CommandOf<"rename">), withRunner)
          case SET_ENV:
            // An attach served by another runner's log tail: its environment is the owner's to set.
            return local.setEnv({ ...command, activeSessionId: id })
          default:
            return Effect.fail(new CommandError({ code: "unknown_command", message: `\`${String(command?.type)}\` is not routed to a session's owner.` }))
        }
      }
      /**
       * The answers of the last commands sent here with an id (see `answerOnce`): this entity's,
       * so this session's on this runner, forgotten when it leaves.
       */
      const answered = new Map<string, Deferred.Deferred<unknown, CommandError>>()
      /**
       * A command that changes the session, run once per id: sent again (the cluster resends a
       * command whose connection broke, to whoever owns the session then, or the forwarder asks
       * again, see `forward`) it gets the first run's answer, waiting for it if need be. Reads
       * run again. A run interrupted (the session leaving this runner) is forgotten: its next
       * owner decides (a prompt's turn that started is in the log).
       */
      const answerOnce = (command: any, commandId: string | undefined): Effect.Effect<unknown, CommandError> =>
        Effect.suspend(() => {
          if (commandId === undefined || !CHANGES_SESSION.has(command?.type)) return run(command, commandId)
          const known = answered.get(commandId)
          if (known !== undefined) return Deferred.await(known)
          const answer = Deferred.unsafeMake<unknown, CommandError>(FiberId.none)
          answered.set(commandId, answer)
          for (const old of answered.keys()) {
            if (answered.size <= ANSWERS_KEPT) break
            answered.delete(old)
          }
          return run(command, commandId).pipe(
            Effect.onExit((exit) =>
              Exit.isInterrupted(exit)
                ? Effect.sync(() => answered.delete(commandId))
                : Deferred.done(answer, exit)
            ),
            // A resend waiting on this answer gets the interruption as its own: sent again, it runs.
            Effect.onInterrupt(() => Deferred.interrupt(answer))
          )
        })
      return SessionEntity.of({
        Command: (envelope) =>
          Effect.mapError(answerOnce(envelope.payload.command, envelope.payload.id), (e) =>
            // Sent by another runner's client to this runner, which is stopping: the session
            // moves to another runner, where the command can be sent again.
            toRemote(
              e.code === "shutting_down"
                ? new CommandError({
                  code: "internal",
                  message: `Session \`${id}\` is moving to another runner (its runner ${self} is stopping): send the command again.`
                })
                : e
            )),
        Activate: () => Effect.void
      })
    }),
    // The session's own mailbox orders its inputs; reads must not queue behind a waiting prompt.
    { concurrency: "unbounded", maxIdleTime: Duration.infinity }
  )

/** One runner as `status` lists it. */
interface RunnerRow {
  readonly address: string
  readonly shards: number
  readonly healthy: boolean
}

/**
 * The runner: sharding, the entity, the watcher, and the routing SessionManager over the local
 * one (which it takes from its context, built to load no session at start).
 */
export const layer: Layer.Layer<
  SessionManager,
  never,
  SessionManager | SessionStore | SqlClient.SqlClient | DaemonConfig | LogTail | WorkerPool
> = Layer
  .unwrapEffect(Effect.gen(function*() {
    const config = yield* DaemonConfig
    const address = runnerAddressOf(config.runnerAddress)
    const self = `${address.host}:${address.port}`
    const leaseMs = config.clusterLeaseMs ?? DEFAULT_LEASE_MS
    const router = Layer.scoped(SessionManager, makeRouter(self, leaseMs))
    return router.pipe(
      Layer.provide(entityLayer(self)),
      Layer.provideMerge(shardingLayer(address, leaseMs))
    )
  }))

const makeRouter = (self: string, leaseMs: number) =>
  Effect.gen(function*() {
    const local = yield* SessionManager
    const store = yield* SessionStore
    const sql = yield* SqlClient.SqlClient
    const sharding = yield* Sharding.Sharding
    const client = yield* SessionEntity.client
    const tails = yield* LogTail
    const leaving = yield* Leave.Leave
    const config = yield* DaemonConfig
    const stopBound = yield* StopBound.make(config.clusterStopTimeoutMs ?? config.shutdownGraceMs + Duration.toMillis(STOP_MARGIN))
    // Run first (finalizers run last added first): the daemon's own steps are done, the layers close.
    yield* Effect.addFinalizer(() => Effect.sync(() => stopBound.reached("closing the cluster's layers (the router, the sharding, the store)")))

    const shardOf = (id: string) => sharding.getShardId(EntityId.make(id), SessionEntity.getShardGroup(EntityId.make(id)))
    /** Whether this runner runs the session now: it holds the session and its shard's lock. */
    const owns = (id: string) => local.holds(id) && sharding.hasShardId(shardOf(id))

    /**
     * A command sent to the session's owner; its wire error comes back as it was. It carries an
     * id of its own (this runner's, one per command), with which the owner answers it once
     * however often it comes (the entity's `answerOnce`): @effect/cluster sends it again when
     * the connection to the owner breaks, to whoever owns the session then. When it comes again
     * to an owner still running it (or that ran it a moment ago), the cluster refuses it
     * (`AlreadyProcessingMessage`: same request); asked again as a new request with the same id,
     * the owner answers with the first run's answer. `moved`: what to do instead of answering
     * `internal` when the owner lost the session while it ran the command.
     */
    const forward = <A>(id: string, command: unknown, moved?: () => Effect.Effect<A, CommandError>): Effect.Effect<A, CommandError> =>
      Effect.suspend(() => {
        const commandId = randomUUID()
        return Effect.retry(client(id).Command({ command, id: commandId }), {
          while: (e) => e._tag === "AlreadyProcessingMessage",
          schedule: Schedule.spaced(ASK_AGAIN_INTERVAL)
        })
      }).pipe(
        Effect.map((data) => data as A),
        // The bound answers at once: interrupting the send (which tells the owner) is left to
        // finish in the background, as it may wait on a runner that cannot be reached.
        Effect.disconnect,
        Effect.timeoutFail({
          duration: FORWARD_TIMEOUT,
          onTimeout: () =>
            new RemoteCommandError({
              code: "internal",
              message: `The runner of session \`${id}\` did not answer within ${Duration.toSeconds(FORWARD_TIMEOUT)} s ` +
                "(the command may have run: ask get_state)."
            })
        }),
        Effect.catchAll((e) =>
          Effect.fail(
            e._tag === "RemoteCommandError"
              ? new CommandError({ code: e.code as CommandError["code"], message: e.message })
              : new CommandError({ code: "internal", message: `The runner of session \`${id}\` could not be reached: ${e.message}` })
          )
        ),
        Effect.catchAllDefect((defect) =>
          Effect.fail(new CommandError({ code: "internal", message: `The runner of session \`${id}\` did not answer: ${String(defect)}` }))
        ),
        // The owner's handler was interrupted (it lost the session's shard while running the
        // command): the reply is an interruption, which is not this fiber's own. Answered as an
        // error, it leaves the connection that sent the command alive (chaos --cluster seed 13:
        // a get_state's interruption ended its connection, a prompt's stopped its answers).
        // This fiber's own interruption is never caught here.
        Effect.catchAllCause((cause) =>
          Cause.isInterruptedOnly(cause)
            ? moved !== undefined ? moved() : Effect.fail(
              new CommandError({
                code: "internal",
                message: `The runner of session \`${id}\` stopped the command before answering (the session is moving to ` +
                  "another runner; the command may have run: ask get_state)."
              })
            )
            : Effect.failCause(cause)
        )
      )

    const withRunner = (s: SessionSummary): SessionSummary => ({ ...s, runner: self })

    /**
     * A create whose owner lost the session's shard while it ran (runners joining or leaving):
     * the session was created or not, and its next owner knows which (the store). Created, the
     * answer is its state; not, it is created there. The id is this runner's own choice, so no
     * one else creates it meanwhile. Without this, such a create was answered `internal` (seen
     * right after runners start, at load 15).
     */
    const createdOrAgain = (id: string, cmd: CommandOf<"create">) =>
      forward<SessionSummary>(id, { type: "get_state", activeSessionId: id }).pipe(
        Effect.map((state) => ({ activeSessionId: id, state })),
        Effect.catchIf((e) => e.code === "session_not_found", () => forward<{ activeSessionId: string; state: SessionSummary }>(id, cmd))
      )

    yield* sql.unsafe(`CREATE TABLE IF NOT EXISTS ${SHARDS_TABLE} (
      address text PRIMARY KEY,
      shards integer NOT NULL,
      updated_at timestamptz NOT NULL DEFAULT now()
    )`).pipe(Effect.retry(retrySchemaRace), Effect.orDie)
    yield* Effect.addFinalizer(() => Effect.ignore(sql`DELETE FROM ${sql(SHARDS_TABLE)} WHERE address = ${self}`))

    // The watcher (see the module's header).
    const group = SessionEntity.getShardGroup(EntityId.make(""))
    const { shardsPerGroup } = yield* ShardingConfig.ShardingConfig
    const allShards = Array.from({ length: shardsPerGroup }, (_, i) => ShardId.make(group, i + 1))
    let held = new Set<number>()
    let published = -1
    const watch = Effect.gen(function*() {
      const now = new Set<number>()
      for (const shard of allShards) if (sharding.hasShardId(shard)) now.add(shard.id)
      const gained = [...now].filter((s) => !held.has(s))
      const lost = [...held].filter((s) => !now.has(s))
      held = now
      if (gained.length > 0 || lost.length > 0) {
        yield* Effect.logInfo(`cluster: holds ${now.size} shards (${gained.length} gained, ${lost.length} lost)`)
        // Bounded: a runner cut off from PostgreSQL lists its own sessions only.
        const listings = yield* Effect.orElseSucceed(Effect.timeout(store.list(), STORE_READ_TIMEOUT), () => [])
        const ids = listings.map(listingId)
        const gainedSet = new Set(gained)
        const lostSet = new Set(lost)
        // What a lost shard's entities did not take with them (their scope evicts them first).
        yield* Effect.forEach(
          ids.filter((id) => lostSet.has(shardOf(id).id) && local.holds(id)),
          (id) => local.evict(id, leaving.leaving() ? undefined : tails.handOver(id)),
          { discard: true }
        )
        yield* Effect.forEach(
          ids.filter((id) => gainedSet.has(shardOf(id).id)),
          (id) => Effect.catchAllCause(client(id).Activate(), (cause) => Effect.logWarning(`session ${id}: could not be activated`, cause)),
          { concurrency: LIST_CONCURRENCY, discard: true }
        )
      }
      if (now.size !== published) {
        yield* sql`INSERT INTO ${sql(SHARDS_TABLE)} (address, shards, updated_at) VALUES (${self}, ${now.size}, now())
          ON CONFLICT (address) DO UPDATE SET shards = EXCLUDED.shards, updated_at = EXCLUDED.updated_at`
        published = now.size
      }
    }).pipe(Effect.catchAllCause((cause) => Effect.logWarning("cluster: the shard watcher failed once", cause)))
    yield* Effect.forkScoped(Effect.forever(Effect.zipRight(watch, Effect.sleep(WATCH_INTERVAL))))

    /**
     * `effect`, answered `internal` with `message` past the bound a forwarded command has. Seen
     * under chaos: commands run here that waited on a store cut off, or on a session that left
     * this runner, and held their connection's next commands behind them (responses keep their
     * order). `leaveRunning`: past the bound, the effect goes on in the background (a command
     * that may have taken effect); otherwise it is interrupted (an attach must not register,
     * late, an attachment nobody delivers to).
     */
    const withinBound = <A>(effect: Effect.Effect<A, CommandError>, message: string, leaveRunning: boolean): Effect.Effect<A, CommandError> =>
      Effect.timeoutFail(leaveRunning ? Effect.disconnect(effect) : effect, {
        duration: FORWARD_TIMEOUT,
        onTimeout: () => new CommandError({ code: "internal", message })
      })

    /** A session command run here. */
    const bounded = <A>(id: string, here: Effect.Effect<A, CommandError>): Effect.Effect<A, CommandError> =>
      withinBound(
        here,
        `Session \`${id}\` did not answer within ${Duration.toSeconds(FORWARD_TIMEOUT)} s (it may have moved to ` +
          "another runner; the command may have run: ask get_state).",
        true
      )

    /** An attach or a detach. */
    const answeredWithin = <A>(id: string, effect: Effect.Effect<A, CommandError>): Effect.Effect<A, CommandError> =>
      withinBound(
        effect,
        `Session \`${id}\`: no answer within ${Duration.toSeconds(FORWARD_TIMEOUT)} s (this runner may be cut off from the store): try another runner.`,
        false
      )

    /** A session command: run here when this runner owns the session, else by its owner. */
    const route = <A>(id: string, here: Effect.Effect<A, CommandError>, command: unknown): Effect.Effect<A, CommandError> =>
      Effect.suspend(() => (owns(id) ? bounded(id, here) : forward<A>(id, command)))

    const runners: Effect.Effect<ReadonlyArray<RunnerRow>> = sql<{ address: string; healthy: boolean; shards: number }>`
      SELECT r.address, r.healthy, COALESCE(s.shards, 0)::int AS shards
      FROM ${sql(`${TABLE_PREFIX}_runners`)} r LEFT JOIN ${sql(SHARDS_TABLE)} s USING (address)
      WHERE r.last_heartbeat > now() - make_interval(secs => ${Math.ceil(leaseMs / 1000)})
      ORDER BY r.address`.pipe(
      Effect.map((rows) => rows.map((r) => ({ address: r.address, shards: Number(r.shards), healthy: Boolean(r.healthy) }))),
      // A runner cut off from PostgreSQL still answers `status` (without the runners).
      Effect.timeout(STORE_READ_TIMEOUT),
      Effect.catchAllCause((cause) => Effect.as(Effect.logWarning("cluster: runners could not be read", cause), []))
    )

    const summaryOfOwner = (id: string): Effect.Effect<SessionSummary, CommandError> =>
      route(id, Effect.map(local.getState(id), withRunner), { type: "get_state", activeSessionId: id })

    /**
     * Once every shard this runner held when it left is let go of (its sessions evicted), its
     * locks are released at once (leave.ts). Bounded: past it, the sharding's own close releases
     * them, as before.
     */
    const handedOver = Effect.suspend(() => {
      const holding = allShards.filter((shard) => sharding.hasShardId(shard)).length
      return Effect.sleep(WATCH_INTERVAL).pipe(
        Effect.repeat({ until: () => leaving.released() >= holding && allShards.every((shard) => !sharding.hasShardId(shard)) }),
        Effect.zipRight(leaving.releaseAll),
        Effect.timeout(HAND_OVER_TIMEOUT),
        Effect.ignore
      )
    })

    /** This runner's sessions: a session of a shard it just lost is its new owner's to list. */
    const listMine = Effect.map(
      local.list,
      ({ sessions }) => sessions.filter((s) => s.worker === "damaged" || sharding.hasShardId(shardOf(s.activeSessionId)))
    )

    return SessionManager.of({
      ...local,
      // A graceful stop: once the sessions here are settled (running turns cut `daemon_shutdown`,
      // their idle status logged), the runner hands its shards over at once (leave.ts), while
      // the daemon gives its clients their grace period. Also when the settling was cut short
      // (its bound): the shards then move as after a crash, but without waiting for the lease.
      // The whole stop is bounded from here (stopBound.ts).
      settleForShutdown: Effect.zipRight(
        stopBound.arm,
        Effect.zipRight(hangForTest, Effect.ensuring(
          local.settleForShutdown,
          Effect.suspend(() => {
            stopBound.reached("leaving the cluster")
            return Effect.ignore(Effect.timeout(leaving.leave, STORE_READ_TIMEOUT))
          })
        ))
      ).pipe(
        Effect.tap(() => Effect.sync(() => stopBound.reached("handing its shards over"))),
        Effect.zipRight(handedOver),
        Effect.tap(() => Effect.sync(() => stopBound.reached("its clients' grace period")))
      ),
      create: (cmd, given) => {
        // The id is chosen here, so that the create goes to the runner that will own the session.
        const id = given ?? `s-${randomUUID()}`
        return forward(id, cmd, () => createdOrAgain(id, cmd))
      },
      listHere: Effect.map(listMine, (sessions) => ({ sessions: sessions.map(withRunner) })),
      list: Effect.gen(function*() {
        const listings = yield* Effect.orElseSucceed(store.list(), () => [])
        const mine = yield* listMine
        const here = new Set(mine.map((s) => s.activeSessionId))
        const elsewhere = yield* Effect.forEach(
          listings.filter((l) => !here.has(listingId(l)) && l._tag !== "Unreadable"),
          (l) => Effect.option(summaryOfOwner(listingId(l))),
          { concurrency: LIST_CONCURRENCY }
        )
        return {
          sessions: [
            ...mine.map(withRunner),
            ...elsewhere.flatMap((o) => (Option.isSome(o) && o.value.worker !== "closed" ? [o.value] : []))
          ]
        }
      }),
      status: Effect.gen(function*() {
        const status = (yield* local.status) as Record<string, unknown>
        return { ...status, runner: self, runners: yield* runners }
      }),
      ...attachments(local, tails, owns, summaryOfOwner, (cmd) =>
        forward(cmd.activeSessionId, {
          type: SET_ENV,
          ...(cmd.launchEnv === undefined ? {} : { launchEnv: cmd.launchEnv }),
          ...(cmd.env === undefined ? {} : { env: cmd.env })
        }), answeredWithin),
      prompt: (cmd) => route(cmd.activeSessionId, local.prompt(cmd), cmd),
      abort: (cmd) => route(cmd.activeSessionId, local.abort(cmd), cmd),
      getState: (id) => summaryOfOwner(id),
      getMessages: (cmd) => route(cmd.activeSessionId, local.getMessages(cmd), cmd),
      checkpoint: (id) => route(id, local.checkpoint(id), { type: "checkpoint", activeSessionId: id }),
      retryWorker: (id) => route(id, Effect.map(local.retryWorker(id), withRunner), { type: "retry_worker", activeSessionId: id }),
      kill: (id) => route(id, local.kill(id), { type: "kill", activeSessionId: id }),
      rename: (cmd) => route(cmd.activeSessionId, Effect.map(local.rename(cmd), withRunner), cmd)
    })
  })

/**
 * Attach, detach and the HTTP event reads (which attach too): through the local session when
 * this runner owns it, else through its log tail (logTail.ts). One connection has one
 * attachment per session: attaching through one drops the other.
 */
const attachments = (
  local: SessionManager["Type"],
  tails: LogTail["Type"],
  owns: (id: string) => boolean,
  summaryOfOwner: (id: string) => Effect.Effect<SessionSummary, CommandError>,
  /** Sends an attach's `launchEnv` and `env` to the owner. */
  setEnvOnOwner: (cmd: CommandOf<"attach">) => Effect.Effect<unknown, CommandError>,
  /** Bounds the time to an answer. */
  within: <A>(id: string, effect: Effect.Effect<A, CommandError>) => Effect.Effect<A, CommandError>
): Pick<SessionManager["Type"], "attach" | "detach" | "detachAll" | "attachedCount"> => ({
  attach: (connectionId, outbox, cmd) =>
    within(cmd.activeSessionId, Effect.suspend(() => {
      const id = cmd.activeSessionId
      return owns(id)
        ? Effect.zipRight(tails.detach(connectionId, id), local.attach(connectionId, outbox, cmd))
        : Effect.zipRight(
          local.holds(id) ? Effect.ignore(local.detach(connectionId, id)) : Effect.void,
          tails.attach(connectionId, outbox, cmd, summaryOfOwner(id)).pipe(
            // Before the response, as through the owner: it comes before any command this
            // client sends after the attach.
            Effect.tap(() => (cmd.launchEnv === undefined && cmd.env === undefined ? Effect.void : setEnvOnOwner(cmd))),
            Effect.onError(() => tails.detach(connectionId, id))
          )
        )
    })),
  detach: (connectionId, id) =>
    within(id, Effect.suspend(() => {
      const here = local.holds(id) ? local.detach(connectionId, id) : Effect.void
      // Of a session attached nowhere here: the owner says whether it exists.
      if (tails.attachedTo(connectionId, id)) return Effect.zipRight(tails.detach(connectionId, id), Effect.ignore(here))
      return local.holds(id) ? here : Effect.asVoid(summaryOfOwner(id))
    })),
  detachAll: (connectionId) => Effect.zipRight(tails.detachAll(connectionId), local.detachAll(connectionId)),
  attachedCount: (connectionId) => tails.attachedCount(connectionId) + local.attachedCount(connectionId)
})
