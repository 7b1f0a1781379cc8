/**
 * Session targets, as tmux's `-t`: a session is named by its id, by a unique prefix of its id
 * (the `s-` may be left out), or by its name. An exact id wins, then an exact name, then a
 * prefix; a target that fits several sessions is refused with the list of them.
 */
import type * as Protocol from "../Protocol.js"
import { type Connection, withConnection } from "./connection.js"
import { failed } from "./errors.js"
import { count, shortDate } from "./render.js"

/** A whole session id: then no `list` is needed, the daemon is the judge. */
export const isFullId = (target: string): boolean =>
  /^s-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$/.test(target)

/** The sessions `target` may mean, best rule first (pure; exported for tests). */
export const matches = (
  sessions: ReadonlyArray<Protocol.SessionSummary>,
  target: string
): ReadonlyArray<Protocol.SessionSummary> => {
  const exact = sessions.filter((s) => s.activeSessionId === target)
  if (exact.length > 0) return exact
  const named = sessions.filter((s) => s.name === target)
  if (named.length > 0) return named
  if (target.length === 0) return []
  const prefix = target.startsWith("s-") ? target : `s-${target}`
  return sessions.filter((s) => s.activeSessionId.startsWith(prefix))
}

const candidate = (s: Protocol.SessionSummary) =>
  `  ${s.activeSessionId}  ${s.name ?? "-"}  created ${shortDate(s.createdAt)}  ${count(s.messageCount, "message")}`

/** The id of the one session of `sessions` that `target` names; throws a CliError (exit 1) otherwise. */
const pick = (sessions: ReadonlyArray<Protocol.SessionSummary>, target: string): string => {
  const found = matches(sessions, target)
  if (found.length === 1) return found[0]!.activeSessionId
  if (found.length === 0) {
    throw failed(`no session matches ${JSON.stringify(target)} (an id, a unique prefix of one, or a name; see \`agentd sessions\`)`)
  }
  throw failed(`${JSON.stringify(target)} matches ${found.length} sessions; name one by a longer prefix of its id:\n${found.map(candidate).join("\n")}`)
}

/** The session id `target` names, asking the daemon for its sessions when it is not a whole id. */
export const resolve = async (c: Connection, target: string): Promise<string> =>
  isFullId(target) ? target : pick((await c.request<Protocol.ListResult>({ type: "list" })).sessions, target)

/** {@link resolve} on a connection of its own, made only when `target` is not a whole id. */
export const resolveAt = (socketPath: string, target: string): Promise<string> =>
  isFullId(target) ? Promise.resolve(target) : withConnection(socketPath, (c) => resolve(c, target))
