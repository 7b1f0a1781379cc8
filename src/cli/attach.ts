/**
 * `agentd attach`: a readable, live view of one session, on the SDK's `SessionClient` (which
 * folds snapshots and events, reconnects and resumes by cursor). stdout carries the session
 * (history, then a separator, then user messages, assistant text as it streams, tool calls and
 * results, turn ends); stderr carries one-line notices of what happens around it (worker
 * recovering and ready, connection lost and back, daemon restarted, resync, history
 * rewritten, session closed). With `--json`: the follower's events as JSON lines.
 */
import * as Deferred from "effect/Deferred"
import * as Duration from "effect/Duration"
import * as Effect from "effect/Effect"
import * as Schedule from "effect/Schedule"
import * as Stream from "effect/Stream"
import * as Cursor from "../Cursor.js"
import type * as Protocol from "../Protocol.js"
import * as SessionClient from "../SessionClient.js"
import { type Context, eachMessage } from "./commands.js"
import { withConnection } from "./connection.js"
import { CliError, daemonErrorText, EXIT, failed } from "./errors.js"
import { type InputHandlers, Screen } from "./interactive.js"
import { count, EventRenderer, LIVE_SEPARATOR } from "./render.js"
import * as Target from "./target.js"

export interface AttachOptions {
  /** Print the last N messages of the transcript first (`get_messages`). */
  readonly history: number
  /** Follow from this cursor (`G:S`) instead of the session's last event. */
  readonly from: Cursor.Cursor | undefined
  /** How long to keep trying to reach a daemon that went away. */
  readonly reconnectFor: Duration.Duration
  /**
   * Wait (for `reconnectFor`) for a daemon that shut down gracefully to be started again; by
   * default a graceful shutdown ends `attach` (exit 0) at once.
   */
  readonly waitForRestart: boolean
  /**
   * Take input (a terminal, without --read-only or --json): Enter sends a prompt, Ctrl-C aborts
   * a running turn, Ctrl-C when idle or Ctrl-D detaches, `/` commands (see {@link COMMANDS_HELP}).
   */
  readonly interactive?: boolean
}

/** The input line's commands (any other line, `/sleep 100` included, is sent as a prompt). */
export const COMMANDS_HELP =
  "/abort (or Ctrl-C during a turn), /checkpoint, /retry, /log [N], /detach (or Ctrl-C when idle, Ctrl-D), /help; " +
  "any other line is sent as a prompt (//x sends /x); during a turn a prompt is refused (the session is busy)"

/** `G:S` -> a cursor, or undefined. */
export const parseCursor = (s: string): Cursor.Cursor | undefined => {
  const m = /^(\d+):(\d+)$/.exec(s)
  if (m === null) return undefined
  const generation = Number(m[1])
  return generation >= 1 ? Cursor.make(generation, Number(m[2])) : undefined
}

/** The input line of an interactive attach, once it exists. */
let screen: Screen | undefined

const notice = (renderer: EventRenderer | undefined, ctx: Context, s: string) =>
  Effect.sync(() => {
    if (screen !== undefined) return screen.write(`agentd: ${s}\n`, "err")
    // On a terminal stdout and stderr share the screen: end the session's line first.
    if (renderer !== undefined && ctx.stdoutIsTTY && process.stderr.isTTY === true) renderer.newline()
    process.stderr.write(`agentd: ${s}\n`)
  })

export const attach = (ctx: Context, target: string, options: AttachOptions) =>
  Effect.scoped(Effect.gen(function*() {
    const renderer = ctx.json ? undefined : new EventRenderer((s) => screen === undefined ? process.stdout.write(s) : screen.write(s))
    const writeJson = (v: unknown) => Effect.sync(() => process.stdout.write(JSON.stringify(v) + "\n"))

    // First connection: find the session and read its history. Fails at once (exit 3) when no
    // daemon answers: retrying is only for a daemon that was there and went away.
    const start = yield* Effect.tryPromise({
      try: () => withConnection(ctx.socketPath, async (c) => {
        const id = await Target.resolve(c, target)
        const state = await c.request<Protocol.SessionSummary>({ type: "get_state", activeSessionId: id })
        // Nothing to follow: say so before any history (`agentd log` reads what is left).
        if (state.worker === "damaged") throw failed(daemonErrorText("session_damaged", `Session \`${id}\` is damaged (${state.damage?.reason}).`))
        if (options.history > 0 && options.from === undefined) {
          // The transcript up to `state`'s last event: its first messageCount messages.
          const from = Math.max(0, state.messageCount - options.history)
          await eachMessage(c, id, from, state.messageCount, (m) =>
            renderer === undefined ? process.stdout.write(JSON.stringify({ type: "history", message: m }) + "\n") : renderer.message(m))
        }
        return { id, state, generation: c.hello.supervisorGeneration }
      }),
      // The plain connection fails only with CliErrors (unreachable, an error response, a target).
      catch: (e) => e as CliError
    })
    const { id } = start
    const from = options.from ?? start.state.lastEventCursor
    if (options.from !== undefined && start.state.lastEventCursor !== undefined && Cursor.isAfter(options.from, start.state.lastEventCursor)) {
      return yield* Effect.fail(failed(`--from ${Cursor.format(options.from)} is after the session's last event ${Cursor.format(start.state.lastEventCursor)}`))
    }
    if (renderer !== undefined && options.history > 0 && options.from === undefined) renderer.line(LIVE_SEPARATOR)
    // Followed all the same (a retry from elsewhere shows here), but nothing runs until then.
    if (start.state.worker === "failed") {
      yield* notice(renderer, ctx, `session ${id} has failed (its worker could not be kept running): \`agentd retry ${id}\` starts it again`)
    }
    else if (renderer === undefined && options.history > 0 && options.from === undefined) yield* writeJson({ type: "live" })

    let generation = start.generation
    let lost: string | undefined
    let lostAt = 0
    const onConnect = (hello: Protocol.DaemonHello) =>
      Effect.suspend(() => {
        const restarted = hello.supervisorGeneration !== generation
        generation = hello.supervisorGeneration
        const wasLost = lost !== undefined
        lost = undefined
        if (restarted) return notice(renderer, ctx, `the daemon restarted (pid ${hello.supervisorPid}, supervisor generation ${generation}); resuming`)
        if (wasLost) return notice(renderer, ctx, `reconnected; resuming`)
        return Effect.void
      })
    const reconnect = Schedule.exponential("100 millis").pipe(
      Schedule.union(Schedule.spaced("1 second")),
      Schedule.tapInput((e: SessionClient.SessionClientError) =>
        Effect.suspend(() => {
          if (!SessionClient.isRetriable(e)) return Effect.void
          if (lost !== undefined) return Effect.void
          lost = e.message
          lostAt = Date.now()
          return notice(renderer, ctx, `lost the daemon (${e.message}); reconnecting for up to ${Duration.format(options.reconnectFor)}`)
        })
      ),
      // Bounded from the moment the daemon went away (each loss starts anew: see below).
      Schedule.whileOutput(() => Date.now() - lostAt < Duration.toMillis(options.reconnectFor))
    )
    const follower = yield* SessionClient.make({
      socketPath: ctx.socketPath,
      activeSessionId: id,
      cursor: from,
      reconnect,
      onConnect,
      waitForRestart: options.waitForRestart
    })
    const detached = yield* Deferred.make<void>()
    if (options.interactive === true && renderer !== undefined) {
      yield* Effect.acquireRelease(
        Effect.sync(() => {
          screen = new Screen(process.stdout, process.stderr, process.stdin, inputHandlers(ctx, id, renderer, () => Deferred.unsafeDone(detached, Effect.void)))
          screen.setBusy(start.state.busy)
        }),
        () => Effect.sync(() => {
          screen?.close()
          screen = undefined
        })
      )
    }
    let closed: string | undefined
    let previousWorker: Protocol.WorkerState | undefined = start.state.worker
    let firstBaseline = true
    const show = (e: SessionClient.FollowEvent): Effect.Effect<void> => {
      if (renderer === undefined) {
        if (e.type === "session_closed") closed = e.reason
        return Effect.zipRight(writeJson(e), e.type === "baseline" ? baselineNotice(e) : Effect.void)
      }
      switch (e.type) {
        case "baseline":
          return baselineNotice(e)
        case "session_event":
          return Effect.sync(() => {
            renderer.event(e.event)
            // The input line comes back at a turn's end (a prompt is taken from then on).
            if (e.event.type === "agent_start") screen?.setBusy(true)
            if (e.event.type === "agent_end" || e.event.type === "turn_interrupted") screen?.setBusy(false)
          })
        case "session_status": {
          // A turn's status is written before its first event and after its end.
          if (e.state.busy) screen?.setBusy(true)
          const worker = e.state.worker
          const before = previousWorker
          previousWorker = worker
          if (worker === before) return Effect.void
          if (worker === "recovering") return notice(renderer, ctx, `the worker of ${id} stopped; recovering`)
          if (worker === "ready" && before === "recovering") return notice(renderer, ctx, `the worker of ${id} is ready again`)
          if (worker === "failed") return notice(renderer, ctx, `the worker of ${id} failed (restarted too often); \`agentd retry ${id}\` starts it again`)
          return Effect.void
        }
        case "session_closed":
          closed = e.reason
          return Effect.void
      }
    }
    const baselineNotice = (b: SessionClient.Baseline): Effect.Effect<void> =>
      Effect.suspend(() => {
        const first = firstBaseline
        firstBaseline = false
        if (b.purpose === "replacement") {
          return Effect.zipRight(
            notice(renderer, ctx, `the history of ${id} was rewritten; it now holds ${count(b.messages.length, "message")}`),
            renderer === undefined ? Effect.void : Effect.sync(() => {
              for (const m of b.messages) renderer.message(m)
              renderer.line(LIVE_SEPARATOR)
            })
          )
        }
        if (b.purpose === "resync") {
          return notice(renderer, ctx, `resync: events this view lacked were checkpointed meanwhile; continuing from snapshot ${b.snapshotId} (${count(b.messages.length, "message")})`)
        }
        if (b.skipped && first) {
          return notice(renderer, ctx, `events after ${from === undefined ? "the start" : Cursor.format(from)} up to ${b.cursor === undefined ? "-" : Cursor.format(b.cursor)} were checkpointed and are not shown one by one (\`agentd log\` shows the transcript)`)
        }
        return Effect.void
      })

    const shutDown = yield* follower.events.pipe(
      Stream.runForEach(show),
      Effect.as(false),
      // Detached from the input line (Ctrl-C when idle, Ctrl-D, /detach): exit 0.
      Effect.raceFirst(Effect.as(Deferred.await(detached), false)),
      // The daemon stopped gracefully: the view ends there, as it would for Ctrl-C.
      Effect.catchTag("DaemonShutDown", () => Effect.as(notice(renderer, ctx, `the daemon shut down; detached from ${id}`), true)),
      Effect.catchIf(
        (e) => lost !== undefined && SessionClient.isRetriable(e),
        (e) =>
          Effect.fail(
            new CliError(`gave up: the daemon stayed away for ${Duration.format(options.reconnectFor)} (${e.message})`, EXIT.unreachable)
          )
      )
    )
    if (renderer !== undefined) renderer.newline()
    if (closed !== undefined) {
      return yield* Effect.fail(failed(`session ${id} was closed (${closed})`))
    }
  }))

/** What the input line of an interactive attach does with what is typed. */
const inputHandlers = (ctx: Context, id: string, renderer: EventRenderer, detach: () => void): InputHandlers => {
  const say = (s: string) => screen?.write(`agentd: ${s}\n`, "err")
  const request = <A>(command: { readonly type: string; readonly [field: string]: unknown }) =>
    withConnection(ctx.socketPath, (c) => c.request<A>({ ...command, activeSessionId: id }))
  const abort = () =>
    request<Protocol.AbortResult>({ type: "abort" }).then((r) => say(r.aborted ? "aborted the turn" : "no turn was running"))
  const busyText = "a turn is running: wait for its end, or stop it with Ctrl-C (/abort)"
  const line = async (text: string): Promise<void> => {
    const [command, ...rest] = text.trim().split(/\s+/)
    try {
      switch (command) {
        case "":
        case undefined:
          return
        case "/abort":
          return await abort()
        case "/checkpoint": {
          const r = await request<Protocol.CheckpointResult>({ type: "checkpoint" })
          return say(`checkpoint: generation ${r.generation} (snapshot ${r.snapshotId})`)
        }
        case "/retry": {
          const r = await request<Protocol.SessionSummary>({ type: "retry_worker" })
          return say(`worker: ${r.worker}${r.workerPid === undefined ? "" : ` (pid ${r.workerPid})`}`)
        }
        case "/log": {
          const n = rest[0] === undefined ? 20 : Number(rest[0])
          if (!Number.isInteger(n) || n < 0) return say("/log takes a number of messages (default 20)")
          const messages: Array<Protocol.AgentMessage> = []
          await withConnection(ctx.socketPath, async (c) => {
            const { total } = await c.request<Protocol.GetMessagesResult>({ type: "get_messages", activeSessionId: id, offset: 0, limit: 1 })
            await eachMessage(c, id, Math.max(0, total - n), total, (m) => void messages.push(m))
          })
          const log = new EventRenderer((s) => screen?.write(s))
          log.line(`--- the last ${count(messages.length, "message")} ---`)
          for (const m of messages) log.message(m)
          return log.line(LIVE_SEPARATOR)
        }
        case "/detach":
          return detach()
        case "/help":
          return say(COMMANDS_HELP)
        default: {
          // The daemon judges (a prompt right after a turn's end is accepted; during it, refused).
          // `//x` sends `/x`; every other line as it is (the echo engine's /sleep, /bulk...).
          const message = text.startsWith("//") ? text.slice(1) : text
          renderer.newline()
          await request<Protocol.PromptResult>({ type: "prompt", message })
        }
      }
    } catch (e) {
      const message = e instanceof Error ? e.message : String(e)
      say(/is running a turn/.test(message) ? busyText : message)
    }
  }
  return {
    line,
    interrupt: () => {
      if (screen?.isBusy === true) void abort().catch((e: unknown) => say(e instanceof Error ? e.message : String(e)))
      else detach()
    },
    end: detach
  }
}
