/**
 * The session core's errors, typed (a command's answer, when it is no success), and the one
 * mapping of them to the wire's `{code, message}` (`toCommandError`), applied where the core
 * answers its callers (SessionManager's service; the socket server and the HTTP front both
 * reach the core through it). Storage failures under a step are `StorageFailed`
 * (session.ts): the core turns those into a stall or into `StorageUnavailable` itself.
 *
 * Owns: the core's error types and the one mapping of them to wire codes.
 */
import * as Cause from "effect/Cause"
import * as Data from "effect/Data"
import type { ErrorCode } from "../../Protocol.js"

/** A command failed with one of the documented error codes: the wire's error. */
export class CommandError extends Data.TaggedError("CommandError")<{
  readonly code: ErrorCode
  readonly message: string
}> {}

/**
 * The wire error of a command that ended without one: it died, or someone else than its caller
 * interrupted it (a cluster owner that lost the session mid-command). Both doors (the socket
 * server, the HTTP front) answer it rather than let the cause end the connection or request;
 * `describe` shapes a defect's text (the HTTP front scrubs its token out of it).
 */
export const internalOfCause = (cause: Cause.Cause<unknown>, describe: (text: string) => string = (text) => text): CommandError =>
  new CommandError({
    code: "internal",
    message: Cause.isInterruptedOnly(cause)
      ? "Internal error: the command was interrupted before it was answered (it may have run)."
      : `Internal error: ${describe(String(Cause.squash(cause)))}`
  })

export class SessionNotFound extends Data.TaggedError("SessionNotFound")<{ readonly activeSessionId: string; readonly message: string }> {}
/** A prompt while another holds the session (reserved, or its turn running). */
export class SessionBusy extends Data.TaggedError("SessionBusy")<{ readonly activeSessionId: string; readonly message: string }> {}
/** The session has failed (its worker kept crashing): `retry_worker` first. */
export class SessionFailed extends Data.TaggedError("SessionFailed")<{ readonly message: string }> {}
/** What the command needed could not be made durable (the event log or the journal refused). */
export class StorageUnavailable extends Data.TaggedError("StorageUnavailable")<{ readonly message: string }> {}
export class ShuttingDown extends Data.TaggedError("ShuttingDown")<{ readonly message: string }> {}
/** The session was created with telemetry on; the attach asked for it off. */
export class TelemetryPolicyViolation extends Data.TaggedError("TelemetryPolicyViolation")<{ readonly message: string }> {}
/** A create or rename asked for a name another live (or damaged) session has. */
export class NameTaken extends Data.TaggedError("NameTaken")<{ readonly message: string }> {}
/** A part below the core failed unexpectedly (a store, the cache, the log outside a step). */
export class CoreInternal extends Data.TaggedError("CoreInternal")<{ readonly message: string }> {}

export type CoreError =
  | SessionNotFound
  | SessionBusy
  | SessionFailed
  | StorageUnavailable
  | ShuttingDown
  | TelemetryPolicyViolation
  | NameTaken
  | CoreInternal

export const notFound = (id: string) => new SessionNotFound({ activeSessionId: id, message: `No session \`${id}\`.` })

export const failed = (message: string) => new SessionFailed({ message })

export const shuttingDown = () => new ShuttingDown({ message: "The daemon is shutting down." })

/** An unexpected failure of a part below the core, as the `internal` error code. */
export const internal = (what: string) => (e: { readonly message: string }) => new CoreInternal({ message: `${what}: ${e.message}` })

/**
 * A session's files that could not be read now (a descriptor short, a file gone or damaged
 * under a live session), as `storage_unavailable`: the daemon works, this session's storage
 * does not; the message names the file and the error. Not `internal`, which says the daemon is
 * at fault.
 */
export const unreadable = (what: string) => (e: { readonly message: string }) =>
  new StorageUnavailable({ message: `${what} could not be read: ${e.message}` })

/**
 * A failure to write a session's meta: `NameTaken` when a store shared by several daemons (a
 * cluster's runners) found the name held by a session this daemon does not have; else `internal`.
 */
export const metaWriteFailed = (e: { readonly message: string; readonly reason?: string; readonly detail?: string }) =>
  e.reason === "NameTaken" ? new NameTaken({ message: e.detail ?? e.message }) : internal("session store")(e)

const CODES: { readonly [K in CoreError["_tag"]]: ErrorCode } = {
  SessionNotFound: "session_not_found",
  SessionBusy: "session_busy",
  SessionFailed: "session_failed",
  StorageUnavailable: "storage_unavailable",
  ShuttingDown: "shutting_down",
  TelemetryPolicyViolation: "telemetry_policy_violation",
  NameTaken: "name_taken",
  CoreInternal: "internal"
}

/** The one mapping of the core's errors to the wire's (a wire error passes as it is). */
export const toCommandError = (e: CoreError | CommandError): CommandError =>
  e._tag === "CommandError" ? e : new CommandError({ code: CODES[e._tag], message: e.message })
