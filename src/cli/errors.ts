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
  const id = /`([^`]+)`/.exec(message)?.[1] ?? "ID"
  switch (code) {
    case "session_damaged":
      return `${message.replace(/ What can be read.*$/s, "")} \`agentd log ${id}\` shows what can be read, ` +
        `\`agentd retry ${id}\` loads it again, \`agentd kill ${id}\` archives it.`
    case "session_failed":
      return `${message.replace(/;? ?use retry_worker\.?$/, ".")} \`agentd retry ${id}\` starts its worker again.`
    case "name_taken":
      return `${message.replace(/`([^`]+)`/, "$1")} \`agentd rename ${id} NEW-NAME\` renames that session.`
    case "session_busy":
      return `${message} \`agentd abort ${id}\` stops the turn; \`agentd attach ${id}\` watches it.`
    default:
      return message
  }
}

/** What an errno of a connect says to a user (the code stays, for searching). */
const CONNECT_ERRORS: Readonly<Record<string, string>> = {
  ENOENT: "no socket file there",
  ECONNREFUSED: "a socket file with nothing listening on it",
  EACCES: "permission denied",
  ENOTSOCK: "not a socket"
}

/** No daemon answered at `socketPath`: why, and how to start one. */
export const noDaemonText = (socketPath: string, code: string | undefined): string => {
  const why = code === undefined ? "" : ` (${CONNECT_ERRORS[code] === undefined ? code : `${CONNECT_ERRORS[code]}: ${code}`})`
  const hint = code === "ENOENT" || code === "ECONNREFUSED" ? "; start one with `agentd serve --detach`" : ""
  return `no daemon listens at ${socketPath}${why}${hint}`
}

const messageOf = (e: unknown): string => {
  if (typeof e !== "object" || e === null || !("message" in e) || typeof e.message !== "string" || e.message.length === 0) return String(e)
  if ("_tag" in e && e._tag === "DaemonError" && "code" in e) return daemonErrorText(e.code, e.message)
  // A failed connect: the command line also says what to do.
  if (
    "_tag" in e && e._tag === "DaemonUnreachable" && "errno" in e && typeof e.errno === "string" && "socketPath" in e &&
    // Over a URL the SDK's message already says what to do.
    !/^[a-z][a-z0-9+.-]*:\/\//i.test(String(e.socketPath))
  ) {
    return noDaemonText(String(e.socketPath), e.errno)
  }
  return e.message
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
