/**
 * The programs of the commands: from a parsed command line to the command's Effect, and from
 * its failure to the exit code and the line on stderr. Loaded by main.ts once a command is to
 * run, so that help, --version and usage errors never load Effect.
 */
import * as Cause from "effect/Cause"
import * as Duration from "effect/Duration"
import * as Effect from "effect/Effect"
import * as Exit from "effect/Exit"
import * as path from "node:path"
import { defaultStateDir, resolveSocketPath } from "../StatePaths.js"
import { type Parsed, usageLine, useColor } from "./args.js"
import * as Commands from "./commands.js"
import { CliError } from "./errors.js"
import { EXIT } from "./exitCodes.js"
import type { Hooks, ServeOptions } from "./main.js"


const stateDirOf = (p: Parsed) => path.resolve((p.options.get("state-dir") as string | undefined) ?? defaultStateDir())

const socketOf = (p: Parsed) => resolveSocketPath(stateDirOf(p), p.options.get("socket") as string | undefined)

/**
 * A module only some commands need (attach's follower, serve --detach's child_process), loaded
 * when one runs: in the bundle its initialisation is deferred the same way.
 */
const load = <A>(f: () => Promise<A>): Effect.Effect<A> => Effect.promise(f)

const program = (p: Parsed, hooks: Hooks): Effect.Effect<void, unknown> => {
  const ctx: Commands.Context = {
    socketPath: socketOf(p),
    json: p.options.get("json") === true,
    color: useColor(process.stdout),
    stdoutIsTTY: process.stdout.isTTY === true
  }
  const target = p.args[0]!
  const int = (name: string) => p.options.get(name) as number | undefined
  switch (p.command.name) {
    case "serve": {
      const options: ServeOptions = {
        stateDir: stateDirOf(p),
        socketPath: socketOf(p),
        engine: p.options.get("engine") as string | undefined,
        maxWorkers: int("max-workers"),
        logLevel: p.options.get("log-level") as string | undefined
      }
      if (p.options.get("detach") === true) return Effect.flatMap(load(() => import("./daemon.js")), (m) => m.detach(ctx, options, hooks.self))
      // The daemon's runtime owns the process from here (signals, exit code): this program
      // waits without holding the event loop open (Effect.never would), so the process ends
      // when the daemon does.
      return Effect.promise(() => hooks.loadServe()).pipe(
        Effect.flatMap((m) => Effect.sync(() => m.serve(options))),
        Effect.zipRight(Effect.async<never>(() => {}))
      )
    }
    case "status":
      return Commands.status(ctx)
    case "create":
      return Commands.create(ctx, p.options.get("name") as string | undefined)
    case "sessions":
      return Commands.sessions(ctx)
    case "prompt":
      return Effect.flatMap(
        Commands.promptText(p.args[1], p.options.get("file") as string | undefined),
        (text) => Commands.prompt(ctx, target, text)
      )
    case "attach":
      return Effect.flatMap(load(() => import("./attach.js")), ({ attach, parseCursor }) => {
        const fromText = p.options.get("from") as string | undefined
        const from = fromText === undefined ? undefined : parseCursor(fromText)
        if (fromText !== undefined && from === undefined) {
          return Effect.fail(
            new CliError({ message: `--from takes a cursor GENERATION:SEQUENCE (e.g. 2:17), got ${JSON.stringify(fromText)}`, exitCode: EXIT.usage })
          )
        }
        const history = from !== undefined ? 0 : int("history") ?? (ctx.json ? 0 : 20)
        return attach(ctx, target, { history, from, reconnectFor: Duration.seconds(int("reconnect-timeout") ?? 30) })
      })
    case "log":
      return Commands.log(ctx, target, { tail: int("tail"), offset: int("offset"), limit: int("limit") })
    case "state":
      return Commands.state(ctx, target)
    case "abort":
      return Commands.abort(ctx, target)
    case "retry":
      return Commands.retry(ctx, target)
    case "checkpoint":
      return Commands.checkpoint(ctx, target)
    case "kill":
      return Commands.kill(ctx, target)
    case "shutdown":
      return Commands.shutdown(ctx)
    case "logs":
      return Effect.flatMap(load(() => import("./daemon.js")), (m) => m.logs(stateDirOf(p), { follow: p.options.get("follow") === true, lines: int("lines") }))
    default:
      return Effect.die(`no program for ${p.command.name}`)
  }
}

const messageOf = (e: unknown): string =>
  typeof e === "object" && e !== null && "message" in e && typeof e.message === "string" && e.message.length > 0
    ? e.message
    : String(e)

/** The exit code of a command's failure (and what to say on stderr). */
export const exitCodeOf = (e: unknown): number => {
  const tag = typeof e === "object" && e !== null && "_tag" in e ? String(e._tag) : undefined
  if (e instanceof CliError) return e.exitCode
  if (tag === "DaemonUnreachable" || tag === "DaemonDisconnected") return EXIT.unreachable
  return EXIT.failed
}


/** Runs a parsed command line; resolves with the exit code. */
export const run = async (parsed: Parsed, hooks: Hooks): Promise<number> => {
  // A reader that went away (`agentd log x | head`): stop quietly, as `cat` would.
  process.stdout.on("error", (e: NodeJS.ErrnoException) => {
    if (e.code === "EPIPE") process.exit(EXIT.ok)
    throw e
  })
  const exit = await Effect.runPromiseExit(program(parsed, hooks))
  if (Exit.isSuccess(exit)) return EXIT.ok
  const failure = Cause.failureOption(exit.cause)
  if (failure._tag === "Some") {
    const code = exitCodeOf(failure.value)
    process.stderr.write(`agentd: ${messageOf(failure.value)}\n`)
    if (code === EXIT.usage) process.stderr.write(`Usage: ${usageLine(parsed.command)}\n`)
    return code
  }
  process.stderr.write(`agentd: unexpected failure: ${Cause.pretty(exit.cause)}\n`)
  return EXIT.failed
}
