/**
 * The `Session` entity of a cluster (docs/cluster.md): the thin door through which a command
 * for a session reaches the runner that owns it. Its id is the session's `activeSessionId`,
 * which @effect/cluster hashes to one of its shards; the runner holding that shard's lock runs
 * the handler, which hands the command to its own SessionManager.
 *
 * Both messages are volatile (not persisted): a command is answered by the owner over the
 * runners' own connection; nothing is written to the cluster's message tables for it. A
 * command whose connection breaks before its answer is sent again by the cluster (to the
 * session's owner of the moment): its `id` makes that harmless (docs/cluster.md section 3).
 *
 * Owns: the entity's protocol (its messages and the error that carries a wire error back).
 */
import * as Entity from "@effect/cluster/Entity"
import * as Rpc from "@effect/rpc/Rpc"
import * as Schema from "effect/Schema"

/** A command's wire error (`{code, message}`), as the owner answered it. */
export class RemoteCommandError extends Schema.TaggedError<RemoteCommandError>()("RemoteCommandError", {
  code: Schema.String,
  message: Schema.String
}) {}

export const SessionEntity = Entity.make("agentd/Session", [
  /** A session command of the wire (docs/protocol.md section 3), decoded; its answer is the response's `data`. */
  Rpc.make("Command", {
    /**
     * `id`: the forwarding runner's own id of the command (one per command, the same each time
     * the cluster sends it again): the owner answers a command that changes the session once per
     * id, and a prompt's id goes into the log with its turn's first status (docs/cluster.md
     * section 3).
     */
    payload: { command: Schema.Unknown, id: Schema.optional(Schema.String) },
    success: Schema.Unknown,
    error: RemoteCommandError
  }),
  /**
   * Wakes the entity on the runner that gained its shard: building it adopts the session (a busy
   * one is restored at once, as at a daemon start), with no client command needed.
   */
  Rpc.make("Activate")
])
