/**
 * Session targets on the command line: the SDK's resolver (src/SessionTarget.ts: an id, a
 * unique prefix of one, or a name), with the command line's messages; a target that fits
 * several sessions is refused with the list of them.
 */
import type * as Protocol from "../Protocol.js"
import * as SessionTarget from "../SessionTarget.js"
import { type Connection, withConnection } from "./connection.js"
import { failed } from "./errors.js"
import { count, shortDate } from "./render.js"

/** The resolver's rules, shared with the SDK (one resolver: src/SessionTarget.ts). */
export const isFullId = SessionTarget.isFullId
export const matches = SessionTarget.matches

const candidate = (s: Protocol.SessionSummary) =>
  `  ${s.activeSessionId}  ${s.name ?? "-"}  created ${shortDate(s.createdAt)}  ${count(s.messageCount, "message")}`

/** The id of the one session of `sessions` that `target` names; throws a CliError (exit 1) otherwise. */
const pick = (sessions: ReadonlyArray<Protocol.SessionSummary>, target: string): string => {
  const r = SessionTarget.resolve(sessions, target)
  switch (r._tag) {
    case "Found":
      return r.activeSessionId
    case "NoMatch":
      throw failed(`${r.message}; see \`agentd sessions\``)
    case "Ambiguous":
      throw failed(`${r.message}:\n${r.candidates.map(candidate).join("\n")}`)
  }
}

/** The session id `target` names, asking the daemon for its sessions when it is not a whole id. */
export const resolve = async (c: Connection, target: string): Promise<string> =>
  isFullId(target) ? target : pick((await c.request<Protocol.ListResult>({ type: "list" })).sessions, target)

/** {@link resolve} on a connection of its own, made only when `target` is not a whole id. */
export const resolveAt = (socketPath: string, target: string): Promise<string> =>
  isFullId(target) ? Promise.resolve(target) : withConnection(socketPath, (c) => resolve(c, target))
