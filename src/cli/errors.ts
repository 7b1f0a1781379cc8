/**
 * The command line's own failures, each with the exit code it ends the process with. A plain
 * Error (no Effect): the one-shot commands, which never load Effect, fail with it too.
 */
import { type CommandSpec, usageLine } from "./args.js"
import { EXIT } from "./exitCodes.js"

export { EXIT }

/**
 * A failure found by the command line itself or reported to it: a target that names no session
 * or several, a name already in use, an error response, a daemon that cannot be reached, a turn
 * stopped by Ctrl-C.
 */
export class CliError extends Error {
  readonly _tag = "CliError"
  constructor(message: string, readonly exitCode: number) {
    super(message)
  }
}

export const failed = (message: string) => new CliError(message, EXIT.failed)
export const usage = (message: string) => new CliError(message, EXIT.usage)
export const unreachable = (message: string) => new CliError(message, EXIT.unreachable)

/** A CliError from either bundle of the command line (each has its own class: see scripts/bundle.mjs). */
export const isCliError = (e: unknown): e is CliError =>
  e instanceof Error && (e as { _tag?: unknown })._tag === "CliError" && typeof (e as { exitCode?: unknown }).exitCode === "number"

const messageOf = (e: unknown): string =>
  typeof e === "object" && e !== null && "message" in e && typeof e.message === "string" && e.message.length > 0
    ? e.message
    : String(e)

/** The exit code of a failure: a CliError's own; the SDK's for a daemon not reachable; else 1. */
export const exitCodeOf = (e: unknown): number => {
  if (isCliError(e)) return e.exitCode
  const tag = typeof e === "object" && e !== null && "_tag" in e ? String(e._tag) : undefined
  if (tag === "DaemonUnreachable" || tag === "DaemonDisconnected") return EXIT.unreachable
  return EXIT.failed
}

/** Says why a command failed on stderr (with its usage line for a usage error); returns the exit code. */
export const report = (e: unknown, command: CommandSpec): number => {
  const code = exitCodeOf(e)
  process.stderr.write(`agentd: ${messageOf(e)}\n`)
  if (code === EXIT.usage) process.stderr.write(`Usage: ${usageLine(command)}\n`)
  return code
}
