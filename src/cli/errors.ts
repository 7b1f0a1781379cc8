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

/**
 * A daemon's error as the command line says it: the daemon's hints name protocol commands, the
 * command line names its own.
 */
export const daemonErrorText = (code: unknown, message: string): string => {
  if (code === "session_damaged") {
    const id = /`([^`]+)`/.exec(message)?.[1] ?? "ID"
    return `${message.replace(/ What can be read.*$/s, "")} \`agentd log ${id}\` shows what can be read, ` +
      `\`agentd retry ${id}\` loads it again, \`agentd kill ${id}\` archives it.`
  }
  return message
}

const messageOf = (e: unknown): string => {
  if (typeof e !== "object" || e === null || !("message" in e) || typeof e.message !== "string" || e.message.length === 0) return String(e)
  return "_tag" in e && e._tag === "DaemonError" && "code" in e ? daemonErrorText(e.code, e.message) : e.message
}

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
