/** The command line's own failures, each with the exit code it ends the process with. */
import * as Data from "effect/Data"

import { EXIT } from "./exitCodes.js"

export { EXIT }

/**
 * A failure found by the command line itself: a target that names no session or several, a
 * name already in use, a usage error found after parsing, a turn stopped by Ctrl-C.
 */
export class CliError extends Data.TaggedError("CliError")<{
  readonly message: string
  readonly exitCode: number
}> {}

export const failed = (message: string) => new CliError({ message, exitCode: EXIT.failed })
export const usage = (message: string) => new CliError({ message, exitCode: EXIT.usage })
