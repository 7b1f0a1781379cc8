/**
 * `agentd prompt`: sends a prompt and streams the assistant's reply until the turn ends, over
 * the client SDK (`DaemonClient.promptTurn` sees the turn to its end however its events come:
 * live, replayed after a backpressure pause, or after a reconnect).
 */
import * as Deferred from "effect/Deferred"
import * as Duration from "effect/Duration"
import * as Effect from "effect/Effect"
import * as Either from "effect/Either"
import * as Fiber from "effect/Fiber"
import * as Option from "effect/Option"
import * as Schedule from "effect/Schedule"
import * as Stream from "effect/Stream"
import * as fs from "../internal/fileIoSync.js"
import type * as Cursor from "../Cursor.js"
import * as DaemonClient from "../DaemonClient.js"
import type * as Protocol from "../Protocol.js"
import * as SessionClient from "../SessionClient.js"
import type { Context } from "./commands.js"
import { CliError, EXIT, failed, usage } from "./errors.js"
import * as Target from "./target.js"

/** Reads a whole stream (stdin) as UTF-8. */
const readAll = (stream: NodeJS.ReadableStream): Effect.Effect<string, CliError> =>
  Effect.async<string, CliError>((resume) => {
    const chunks: Array<Buffer> = []
    const onData = (b: Buffer) => chunks.push(b)
    const onEnd = () => resume(Effect.succeed(Buffer.concat(chunks).toString("utf8")))
    const onError = (e: Error) => resume(Effect.fail(failed(`cannot read the prompt from stdin: ${e.message}`)))
    stream.on("data", onData)
    stream.once("end", onEnd)
    stream.once("error", onError)
    return Effect.sync(() => {
      stream.off("data", onData)
      stream.off("end", onEnd)
      stream.off("error", onError)
    })
  })

/** The prompt's text: the argument, stdin (`-`), or `--file` (`-` for stdin too). */
export const promptText = (text: string | undefined, file: string | undefined): Effect.Effect<string, CliError> => {
  if (text !== undefined && file !== undefined) return Effect.fail(usage("give the prompt as TEXT or with --file, not both"))
  const source = file ?? text
  if (source === undefined) return Effect.fail(usage("missing TEXT (or `-` to read it from stdin, or --file PATH)"))
  if (file === undefined && text !== "-") return Effect.succeed(source)
  if (source === "-") {
    if (process.stdin.isTTY === true) process.stderr.write("agentd: reading the prompt from stdin (end it with Ctrl-D)\n")
    return Effect.map(readAll(process.stdin), withoutFinalNewline)
  }
  return Effect.try({
    try: () => withoutFinalNewline(fs.readFileSync(source, "utf8")),
    catch: (e) => failed(`cannot read ${source}: ${(e as NodeJS.ErrnoException).code ?? String(e)}`)
  })
}

/** A text read from a file or a pipe loses one final newline (as `$(...)` in a shell would). */
const withoutFinalNewline = (s: string): string => s.replace(/\r?\n$/, "")

/**
 * Follows the session from `from` (the turn's last event seen) over a new connection, through
 * the daemon's restart, until the turn's end: `agent_end` (success), `turn_interrupted` (its
 * reason: `daemon_restarted` after a daemon crash), the session closed, or (the events in
 * between checkpointed away) the session idle again. Gives up (exit 3) after `reconnectFor`.
 */
const followToEnd = (
  ctx: Context,
  id: string,
  from: Cursor.Cursor,
  why: string,
  reconnectFor: Duration.Duration,
  waitForRestart: boolean,
  show: (m: Protocol.SessionEvent) => void
) =>
  Effect.scoped(Effect.gen(function*() {
    process.stderr.write(`agentd: lost the daemon during the turn (${why}); reconnecting for up to ${Duration.format(reconnectFor)} to see its end\n`)
    const lostAt = Date.now()
    const follower = yield* SessionClient.make({
      socketPath: ctx.socketPath,
      activeSessionId: id,
      cursor: from,
      waitForRestart,
      reconnect: Schedule.spaced("200 millis").pipe(Schedule.whileOutput(() => Date.now() - lostAt < Duration.toMillis(reconnectFor)))
    })
    let swallowed = false
    const swallowedEnd = Effect.sync(() => {
      process.stderr.write(`agentd: the turn's last events were checkpointed away meanwhile; \`agentd log ${id}\` shows its messages\n`)
    })
    // Whether the session is idle now (so the turn is over), read on a connection of its own.
    const idleNow = Effect.scoped(Effect.flatMap(DaemonClient.make({ socketPath: ctx.socketPath }), (c) => c.getState(id))).pipe(
      Effect.map((state) => !state.busy),
      Effect.orElseSucceed(() => false)
    )
    type Step = Effect.Effect<Option.Option<Effect.Effect<void, CliError>>>
    const none: Step = Effect.succeed(Option.none())
    const end = yield* follower.events.pipe(
      Stream.mapEffect((e): Step => {
        switch (e.type) {
          case "session_event": {
            show(e)
            if (e.event.type === "agent_end") {
              const error = e.event.error
              return Effect.succeed(Option.some(error === undefined ? Effect.void : Effect.fail(turnFailed(error))))
            }
            if (e.event.type === "turn_interrupted") {
              return Effect.succeed(Option.some(Effect.fail(failed(`the turn of session ${id} was interrupted (${e.event.reason})`))))
            }
            return none
          }
          case "session_closed":
            return Effect.succeed(Option.some(Effect.fail(failed(`session ${id} was closed (${e.reason}) before its turn ended`))))
          case "baseline":
            // Events after `from` were checkpointed away (the snapshot holds them: `skipped`),
            // the turn's end perhaps with them. If the session is idle, the turn is over (no
            // status may ever come); if not, its next idle status ends the wait.
            if (!e.skipped) return none
            swallowed = true
            return Effect.map(idleNow, (idle) => (idle ? Option.some(swallowedEnd) : Option.none()))
          case "session_status":
            return Effect.succeed(swallowed && !e.state.busy ? Option.some(swallowedEnd) : Option.none())
        }
      }),
      Stream.filterMap((x) => x),
      Stream.runHead,
      Effect.catchAll((e) =>
        Effect.fail(
          e._tag === "DaemonShutDown"
            ? failed(`the daemon shut down before the end of the turn of session ${id} was seen`)
            : new CliError(`gave up: the daemon stayed away for ${Duration.format(reconnectFor)} (${e.message})`, EXIT.unreachable)
        )
      )
    )
    if (Option.isNone(end)) return yield* Effect.fail(new CliError("the turn's end was not seen", EXIT.unreachable))
    yield* end.value
  }))

/** A turn whose `agent_end` carries an `error` (the model endpoint failed): exit 1, said on stderr. */
const turnFailed = (error: Protocol.TurnFailure) => Object.assign(failed(`the turn failed (${error.code}): ${error.message}`), { turnFailure: error })

/** How long `prompt` waits, after Ctrl-C, for its turn to end once aborted. */
const ABORT_WAIT = Duration.seconds(10)

/**
 * `agentd prompt`: sends the prompt and streams the assistant's reply to stdout until the turn
 * ends. A turn that ends with `turn_interrupted`, or with an `agent_end` that carries an
 * `error` (the model endpoint failed), is an error (exit 1, the reason or the error on stderr;
 * the text streamed before it stays on stdout, the error message itself goes only to stderr).
 * Ctrl-C aborts the turn (`abort`, repeated until the daemon says it aborted one or the turn
 * ends), waits for its end, and exits 130; a second Ctrl-C exits 130 at once.
 *
 * A daemon that goes away during the turn is reconnected to (for `reconnectFor`) to see the
 * turn's end; one that shut down gracefully (it cut the turn, `daemon_shutdown`, and said
 * `daemon_closing`) ends the command at once (exit 1), unless `waitForRestart` (an explicit
 * `--reconnect-timeout`) asks to wait for it to be started again.
 */
export const prompt = (
  ctx: Context,
  target: string,
  message: string,
  reconnectFor: Duration.Duration,
  waitForRestart = false
) =>
  Effect.scoped(Effect.gen(function*() {
      // The plain connection fails only with CliErrors (unreachable, an error response, a target).
      const id = yield* Effect.tryPromise({ try: () => Target.resolveAt(ctx.socketPath, target), catch: (e) => e as CliError })
      const c = yield* DaemonClient.make({ socketPath: ctx.socketPath })
      const sigint = yield* Deferred.make<void>()
      let signals = 0
      const onSigint = () => {
        if (++signals > 1) process.exit(EXIT.interrupted)
        Deferred.unsafeDone(sigint, Effect.void)
      }
      yield* Effect.acquireRelease(
        Effect.sync(() => process.on("SIGINT", onSigint)),
        () => Effect.sync(() => process.off("SIGINT", onSigint))
      )
      const roles = new Map<string, string>()
      /** The engine's error messages (`isError` from their start): said on stderr, not stdout. */
      const errorMessages = new Set<string>()
      let wrote = false
      /** The last event of the turn seen: where to follow from after a lost connection. */
      let seen: Cursor.Cursor | undefined
      const show = (m: Protocol.SessionEvent) => {
        seen = m.meta.cursor
        if (ctx.json) {
          process.stdout.write(JSON.stringify(m) + "\n")
          return
        }
        const e = m.event
        if (e.type === "message_start") {
          roles.set(e.message.id, e.message.role)
          if (e.message.isError === true) errorMessages.add(e.message.id)
        } else if (e.type === "message_update" && (roles.get(e.messageId) ?? "assistant") === "assistant" && !errorMessages.has(e.messageId)) {
          process.stdout.write(e.delta)
          wrote = true
        }
      }
      const turn = c.promptTurn(id, message).pipe(
        Stream.runForEach((m) => Effect.sync(() => show(m))),
        Effect.catchTag("TurnFailed", (e) => Effect.fail(turnFailed(e))),
        // The daemon went away during the turn (it was killed, or restarts): its end is still
        // to be seen, from the daemon that comes back (a cut turn ends with turn_interrupted).
        Effect.catchIf(
          (e): e is DaemonClient.DaemonDisconnected =>
            e._tag === "DaemonDisconnected" && seen !== undefined && (waitForRestart || e.daemonShutdown !== true),
          (e) => followToEnd(ctx, id, seen!, e.message, reconnectFor, waitForRestart, show)
        ),
        // A graceful shutdown is said as such (exit 1), not as a daemon out of reach (exit 3).
        Effect.mapError((e) =>
          e._tag === "TurnInterrupted" && e.reason === "daemon_shutdown"
            ? failed(`the daemon shut down: the turn of session ${id} was interrupted (daemon_shutdown)`)
            : DaemonClient.isDaemonShutdown(e)
            ? failed(`the daemon shut down before the end of the turn of session ${id} was seen (${e.message})`)
            : e
        ),
        Effect.ensuring(Effect.sync(() => {
          if (!ctx.json && wrote) process.stdout.write("\n")
        }))
      )
      const running = yield* Effect.fork(Effect.either(turn))
      const first = yield* Effect.raceFirst(
        Effect.map(Fiber.join(running), Option.some),
        Effect.as(Deferred.await(sigint), Option.none())
      )
      if (Option.isSome(first)) {
        // The turn ended before any Ctrl-C.
        if (Either.isLeft(first.value)) return yield* Effect.fail(first.value.left)
        return
      }
      // Ctrl-C: abort the turn (until the daemon says it aborted one: the prompt may still
      // wait for a worker), then wait for the turn's end.
      const aborting = yield* Effect.fork(
        c.abort(id).pipe(
          Effect.repeat({ until: (r) => r.aborted, schedule: Schedule.spaced("100 millis") }),
          Effect.ignore
        )
      )
      const ended = yield* Fiber.join(running).pipe(Effect.timeout(ABORT_WAIT), Effect.option)
      yield* Fiber.interrupt(aborting)
      const how = Option.match(ended, {
        onNone: () => `the turn did not end within ${Duration.format(ABORT_WAIT)} of the abort`,
        onSome: (r) =>
          Either.isLeft(r) && r.left._tag === "TurnInterrupted"
            ? `the turn was aborted`
            : Either.isRight(r)
            ? `the turn had ended`
            : "turnFailure" in r.left
            ? `the turn had ended failed (${(r.left as ReturnType<typeof turnFailed>).turnFailure.code})`
            : `the turn's end was not seen (${r.left.message})`
      })
      return yield* Effect.fail(new CliError(`interrupted (Ctrl-C): ${how}`, EXIT.interrupted))
    }))
