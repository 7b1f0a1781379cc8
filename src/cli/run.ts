/**
 * The commands that run on Effect and the client SDK: `prompt` and `attach` (they follow a
 * session's events, across reconnects), `serve` and `logs`. Loaded by main.ts only for them
 * (a bundle of its own, see scripts/bundle.mjs), so that help, usage errors and the one-shot
 * commands never load Effect.
 */
import * as Cause from "effect/Cause"
import * as Duration from "effect/Duration"
import * as Effect from "effect/Effect"
import * as Exit from "effect/Exit"
import * as Logger from "effect/Logger"
import type { Parsed } from "./args.js"
import type { Context } from "./commands.js"
import { CliError, EXIT, report, usage } from "./errors.js"
import type { Hooks } from "./main.js"
import { serveOptionsOf, stateDirOf } from "./paths.js"
import * as Prompt from "./prompt.js"

/**
 * A module only some commands need (attach's follower, serve --detach's child_process), loaded
 * when one runs: in the bundle its initialisation is deferred the same way.
 */
const load = <A>(f: () => Promise<A>): Effect.Effect<A> => Effect.promise(f)

const program = (p: Parsed, ctx: Context, hooks: Hooks): Effect.Effect<void, unknown> => {
  const target = p.args[0]!
  const int = (name: string) => p.options.get(name) as number | undefined
  switch (p.command.name) {
    case "serve":
      // Only `serve --detach` comes here: main.ts starts a foreground daemon itself.
      return Effect.flatMap(load(() => import("./daemon.js")), (m) => m.detach(ctx, serveOptionsOf(p, ctx.socketPath), hooks.self))
    case "prompt":
      return Effect.flatMap(
        Prompt.promptText(p.args[1], p.options.get("file") as string | undefined),
        // An explicit --reconnect-timeout also asks to wait for a daemon that shut down gracefully.
        (text) => Prompt.prompt(ctx, target, text, Duration.seconds(int("reconnect-timeout") ?? 30), int("reconnect-timeout") !== undefined)
      )
    case "attach":
      return Effect.flatMap(load(() => import("./attach.js")), ({ attach, parseCursor }) => {
        const fromText = p.options.get("from") as string | undefined
        const from = fromText === undefined ? undefined : parseCursor(fromText)
        if (fromText !== undefined && from === undefined) {
          return Effect.fail(usage(`--from takes a cursor GENERATION:SEQUENCE (e.g. 2:17), got ${JSON.stringify(fromText)}`))
        }
        if (from !== undefined && int("history") !== undefined) {
          return Effect.fail(usage("--history and --from do not go together: --from shows the events after the cursor, without history"))
        }
        const history = from !== undefined ? 0 : int("history") ?? (ctx.json ? 0 : 20)
        return attach(ctx, target, {
          history,
          from,
          reconnectFor: Duration.seconds(int("reconnect-timeout") ?? 30),
          waitForRestart: int("reconnect-timeout") !== undefined,
          interactive: !ctx.json && p.options.get("read-only") !== true && process.stdin.isTTY === true && ctx.stdoutIsTTY
        })
      })
    case "logs":
      return Effect.flatMap(load(() => import("./daemon.js")), (m) => m.logs(stateDirOf(p), { follow: p.options.get("follow") === true, lines: int("lines") }))
    default:
      return Effect.die(`no program for ${p.command.name}`)
  }
}

/**
 * Ctrl-C, for the commands that run until it (`attach`, `logs -f`): they end with exit 130 and
 * a word on stderr rather than die of the signal (a parent process sees an exit code).
 */
const ctrlC = Effect.async<never, CliError>((resume) => {
  const onSigint = () => resume(Effect.fail(new CliError("interrupted (Ctrl-C)", EXIT.interrupted)))
  process.once("SIGINT", onSigint)
  return Effect.sync(() => process.off("SIGINT", onSigint))
})

/**
 * The client's own log lines (the SDK's warnings: a message it cannot read, an answer nobody
 * waits for) go to stderr, in Effect's usual format: stdout carries the command's output alone
 * (a reply, JSON lines), which other programs read. Effect's default logger writes to stdout.
 */
const logToStderr = Logger.replace(Logger.defaultLogger, Logger.withConsoleError(Logger.stringLogger))

/** Runs a parsed command line of one of these commands; resolves with the exit code. */
export const run = async (parsed: Parsed, ctx: Context, hooks: Hooks): Promise<number> => {
  const main = program(parsed, ctx, hooks)
  const untilCtrlC = parsed.command.name === "attach" || parsed.command.name === "logs"
  const exit = await Effect.runPromiseExit((untilCtrlC ? Effect.raceFirst(main, ctrlC) : main).pipe(Effect.provide(logToStderr)))
  if (Exit.isSuccess(exit)) return EXIT.ok
  const failure = Cause.failureOption(exit.cause)
  if (failure._tag === "Some") return report(failure.value, parsed.command)
  process.stderr.write(`agentd: unexpected failure: ${Cause.pretty(exit.cause)}\n`)
  return EXIT.failed
}
